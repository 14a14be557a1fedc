//! The shared relay of other nodes' users to this node's viewers (C2, E5,
//! P2–P4): a viewer's Watch at a node that owns not all of its users costs
//! about what it costs at their owners.
//!
//! A node keeps one `Cluster/Relay` stream (a *link*) at each node that owns
//! users its viewers watch, and names on it, as they come and go, the users
//! watched there, each once however many viewers watch it. The owner answers
//! each named user's state, then every change of it as a service acting for
//! no viewer sees it, and tells of every change of relations in order with
//! those changes. This node publishes what arrives into a hub of its own (the
//! relay hub), where each viewer's mailbox takes it exactly as a mailbox at
//! the owner would: a change is encoded once for every viewer that sees it,
//! and a viewer that falls behind is conflated or resynced (E4).
//!
//! Privacy is applied here, viewer by viewer, with the owner's word: the
//! owner says of each user whether everyone, nobody or only an audience may
//! see it; for an audience this node asks the owner (`MayView`) when a
//! viewer starts watching, and keeps the answer in the viewer's mailbox
//! until the owner tells of a change of relations. Then the link stops
//! taking changes until it has asked again for every viewer whose view may
//! have changed; a view that did change is shown as at the owner, with a
//! new version the owner gives the user (`BumpVersions`): hidden as a user
//! never seen, or revealed as it is. Decisions and subscriptions of viewers
//! are made under `views` for reading, a change of relations under it for
//! writing, so a viewer's mailbox is never subscribed with an answer a
//! change of relations has already overtaken.
//!
//! What a relay cannot carry faithfully ends the mailboxes it feeds (their
//! streams end `UNAVAILABLE`, and clients reopen, resuming with the versions
//! they hold, E8): its owner ending the link or becoming unreachable, a
//! relayed user's slot moving to another node, an answer about privacy that
//! does not come.
//!
//! The owner's side is [`serve`]: one mailbox per link at the owner, for a
//! service acting for no viewer, and the relations' listener.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use dashmap::DashMap;
use futures_util::future::BoxFuture;
use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;
use presence_core::{ChangeKind, CompactString, PresenceChange, State, slot_of};
use presence_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::cluster::ClusterNode;
use crate::cluster::forward::{FORWARD_TIMEOUT, call_peer, with_credential};
use crate::cluster::wire::{self as cluster_wire, Relayed};
use crate::error::ServiceError;
use crate::metrics::OpenGauge;
use crate::node::context::Context;
use crate::node::hub::{Delivery, Hub, Mailbox, Pending, Subscription};
use crate::node::privacy::{RelationsChanged, SeenBy, Shown};
use crate::node::watch::{ReadUsers, Subscribed, WatchSource, hold};
use crate::node::wire;

/// Users with a change pending at an owner for one link before the owner
/// sends them all again instead (E4: a slow link is conflated, never waited for).
const LINK_MAILBOX_USERS: usize = 1 << 16;
/// Changes of relations waiting at an owner to go out on one link; past
/// them the link ends (its viewers reopen), since a view it could not
/// update must not stay.
const RELATIONS_WAITING: usize = 4_096;
/// Controls waiting to go out on a link.
const CONTROLS_WAITING: usize = 1_024;
/// Frames an owner has not yet sent on a link.
const FRAMES_WAITING: usize = 64;
/// Users in one frame of changes.
const USERS_PER_FRAME: usize = 4_096;
/// How often a link stops relaying the users no viewer watches any more.
const SWEEP_EVERY: Duration = Duration::from_secs(1);

/// A relayed user as this node holds it.
#[derive(Debug, Clone)]
struct Held {
    user: Relayed,
    /// The address of the node that sends it.
    owner: Arc<str>,
}

/// This node's relays of other nodes' users.
#[derive(Debug, Default)]
pub(crate) struct Relay {
    hub: Arc<Hub>,
    held: DashMap<CompactString, Held>,
    links: Mutex<HashMap<String, Arc<Link>>>,
    views: tokio::sync::RwLock<()>,
}

/// One relay stream to an owner.
#[derive(Debug)]
struct Link {
    address: Arc<str>,
    control: mpsc::Sender<pb::RelayControl>,
    state: Mutex<LinkState>,
    /// The greatest control sequence the owner answered; `u64::MAX` once the link ended.
    answered: watch::Sender<u64>,
}

#[derive(Debug, Default)]
struct LinkState {
    /// Relayed users, with the sequence of the control that named them.
    relayed: HashMap<CompactString, u64>,
    /// Users being subscribed by a viewer: not swept, though no mailbox watches them yet.
    opening: HashMap<CompactString, usize>,
    next_sequence: u64,
    /// Why the link ended, once it did.
    ended: Option<String>,
    /// The owner is of an earlier version, which relays nothing.
    older_node: bool,
}

/// Users a viewer is subscribing through a link: kept relayed until dropped.
struct Opening {
    link: Arc<Link>,
    users: Vec<CompactString>,
}

impl Drop for Opening {
    fn drop(&mut self) {
        let mut state = self.link.state.lock();
        for user in &self.users {
            if let hashbrown::hash_map::Entry::Occupied(mut opening) = state.opening.entry(user.clone()) {
                *opening.get_mut() -= 1;
                if *opening.get() == 0 {
                    opening.remove();
                }
            }
        }
    }
}

impl Relay {
    /// The source a viewer's Watch of other nodes' users reads from.
    pub(crate) fn source(cluster: &Arc<ClusterNode>, context: &Arc<Context>) -> Arc<dyn WatchSource> {
        Arc::new(RelaySource { cluster: Arc::clone(cluster), context: Arc::clone(context) })
    }

    /// The link to the node at `address`, opened if there is none.
    fn link(&self, cluster: &Arc<ClusterNode>, context: &Arc<Context>, address: &str) -> Arc<Link> {
        let mut links = self.links.lock();
        if let Some(link) = links.get(address)
            && link.state.lock().ended.is_none()
        {
            return Arc::clone(link);
        }
        let (control, controls) = mpsc::channel(CONTROLS_WAITING);
        let link = Arc::new(Link {
            address: Arc::from(address),
            control,
            state: Mutex::new(LinkState::default()),
            answered: watch::Sender::new(0),
        });
        links.insert(address.to_owned(), Arc::clone(&link));
        tokio::spawn(run_link(Arc::clone(cluster), Arc::clone(context), Arc::clone(&link), controls));
        link
    }

    /// Ends every mailbox watching `user` here, for `reason`.
    fn end_watchers(&self, user: &CompactString, reason: &str) {
        for mailbox in self.hub.watchers_of(user) {
            mailbox.end(reason.to_owned());
        }
    }

    /// Forgets `users` (no longer relayed by `link`).
    fn forget(&self, context: &Context, link: &Link, users: impl IntoIterator<Item = CompactString>) {
        for user in users {
            if self.held.remove_if(&user, |_, held| *held.owner == *link.address).is_some() {
                context.metrics().relayed_users.add(-1);
            }
        }
    }

    /// How `users`, all held, are shown in `mailbox`.
    fn shown(&self, mailbox: &Mailbox, users: &[CompactString]) -> Result<Vec<Shown>, ServiceError> {
        users
            .iter()
            .map(|user| match self.held.get(user) {
                Some(held) => Ok(Shown { view: held.user.view.clone(), visible: !mailbox.is_hidden(user) }),
                None => {
                    Err(ServiceError::Reopen(format!("{user} is no longer relayed here (its owner changed); reopen")))
                }
            })
            .collect()
    }
}

impl Link {
    /// Tells the owner to relay `users` no more and stops counting them as
    /// relayed; `state` is this link's, locked, so that the removal is sent
    /// before or after an addition of the same users, never across it (see
    /// [`Link::add`]). False, with nothing changed, when the controls'
    /// queue is full: the caller tries again at its next turn.
    fn stop_relaying(&self, state: &mut LinkState, users: &[CompactString]) -> bool {
        let control = pb::RelayControl {
            add_user_ids: Vec::new(),
            remove_user_ids: users.iter().map(ToString::to_string).collect(),
            sequence: 0,
        };
        if self.control.try_send(control).is_err() {
            return false;
        }
        for user in users {
            state.relayed.remove(user);
        }
        true
    }

    /// Relays `users` from now on (those not relayed yet are named to the
    /// owner) and waits until the owner answered their state. The users stay
    /// relayed while the answer is held, whether or not a mailbox watches them.
    async fn add(self: &Arc<Self>, relay: &Relay, users: Vec<CompactString>) -> Result<Opening, ServiceError> {
        let waited_for = {
            let mut state = self.state.lock();
            if let Some(reason) = &state.ended {
                return Err(ServiceError::Reopen(reason.clone()));
            }
            let new: Vec<CompactString> =
                users.iter().filter(|user| !state.relayed.contains_key(*user)).cloned().collect();
            let mut waited_for = users.iter().filter_map(|user| state.relayed.get(user).copied()).max().unwrap_or(0);
            if !new.is_empty() {
                state.next_sequence += 1;
                let sequence = state.next_sequence;
                let control = pb::RelayControl {
                    add_user_ids: new.iter().map(ToString::to_string).collect(),
                    remove_user_ids: Vec::new(),
                    sequence,
                };
                // Sent under the state's lock: a removal of the same user
                // by the sweep is sent before or after it, never across it.
                self.control.try_send(control).map_err(|_| {
                    ServiceError::Reopen(format!("the relay to the node at {} is busy; reopen", self.address))
                })?;
                for user in &new {
                    state.relayed.insert(user.clone(), sequence);
                }
                waited_for = sequence;
            }
            for user in &users {
                *state.opening.entry(user.clone()).or_default() += 1;
            }
            waited_for
        };
        let opening = Opening { link: Arc::clone(self), users };
        let mut answered = self.answered.subscribe();
        let older_node = || ServiceError::Peer {
            node: self.address.to_string(),
            status: Status::unimplemented("Cluster/Relay: a node of an earlier version"),
        };
        let answer = tokio::time::timeout(FORWARD_TIMEOUT, answered.wait_for(|answered| *answered >= waited_for));
        if answer.await.is_err() {
            return Err(ServiceError::PeerTimedOut {
                node: self.address.to_string(),
                awaited: "relayed users' state",
                within: FORWARD_TIMEOUT,
            });
        }
        {
            let state = self.state.lock();
            if state.older_node {
                return Err(older_node());
            }
            if let Some(reason) = &state.ended {
                return Err(ServiceError::Reopen(reason.clone()));
            }
        }
        if let Some(missing) = opening.users.iter().find(|user| !relay.held.contains_key(*user)) {
            let moved = format!("the node at {} no longer owns {missing}; reopen", self.address);
            return Err(ServiceError::Reopen(moved));
        }
        Ok(opening)
    }
}

/// A viewer's Watch of other nodes' users, read from this node's relays.
struct RelaySource {
    cluster: Arc<ClusterNode>,
    context: Arc<Context>,
}

impl RelaySource {
    fn relay(&self) -> &Relay {
        &self.cluster.relay
    }

    /// Whether `viewer` may see each of `users`, all held: by who the owner
    /// shows each to, asking the owners about users shown to an audience.
    /// Called holding `views`.
    async fn visible(
        &self,
        context: &Context,
        viewer: Option<&str>,
        users: &[CompactString],
    ) -> Result<HashMap<CompactString, bool>, ServiceError> {
        let Some(viewer) = viewer else { return Ok(users.iter().map(|user| (user.clone(), true)).collect()) };
        let mut visible = HashMap::new();
        let mut asked = Vec::new();
        for user in users {
            let seen_by = self.relay().held.get(user).map_or(SeenBy::Nobody, |held| held.user.seen_by);
            match seen_by.decides(viewer, user) {
                Some(decided) => {
                    visible.insert(user.clone(), decided);
                }
                None => asked.push(user.clone()),
            }
        }
        if !asked.is_empty() {
            let answered = crate::cluster::room_sync::may_view(&context.privacy, &self.cluster, viewer, asked).await?;
            visible.extend(answered);
        }
        Ok(visible)
    }
}

impl WatchSource for RelaySource {
    fn subscribe(
        &self,
        users: Vec<CompactString>,
        capacity: usize,
        viewer: Option<CompactString>,
    ) -> BoxFuture<'_, Result<Subscribed, ServiceError>> {
        Box::pin(async move {
            let context = &self.context;
            let mut by_owner: BTreeMap<String, Vec<CompactString>> = BTreeMap::new();
            {
                let membership = &self.cluster.membership;
                let (map, nodes) = (membership.acted_map(), membership.nodes());
                for user in &users {
                    let owner = map.owner(slot_of(user.as_bytes(), membership.slot_count()));
                    if owner.is_some_and(|owner| owner.node == membership.node()) {
                        return Err(ServiceError::Reopen(format!("{user}'s slot moved to this node; reopen")));
                    }
                    let address = owner.and_then(|owner| nodes.address(&owner.node).map(str::to_owned));
                    let address = address.ok_or_else(|| {
                        ServiceError::Reopen(format!("{user}'s slot has no reachable owner now; reopen"))
                    })?;
                    by_owner.entry(address).or_default().push(user.clone());
                }
            }
            let mut openings = Vec::new();
            for (address, users) in by_owner {
                let link = self.relay().link(&self.cluster, context, &address);
                openings.push(link.add(self.relay(), users).await?);
            }
            let _views = self.relay().views.read().await;
            let visible = self.visible(context, viewer.as_deref(), &users).await?;
            let subscription = self
                .relay()
                .hub
                .subscribe(users, capacity, viewer, |user| !visible.get(user).copied().unwrap_or(false));
            drop(openings);
            let shown = self.relay().shown(subscription.mailbox(), &subscription.users())?;
            Ok((subscription, shown))
        })
    }

    fn resync<'a>(&'a self, subscription: &'a Subscription) -> BoxFuture<'a, Result<ReadUsers, ServiceError>> {
        Box::pin(async move {
            if let Some(reason) = subscription.mailbox().ended() {
                return Err(ServiceError::Reopen(reason));
            }
            let _views = self.relay().views.read().await;
            let users = subscription.users();
            let shown = self.relay().shown(subscription.mailbox(), &users)?;
            Ok((users, shown))
        })
    }

    fn add<'a>(
        &'a self,
        _subscription: &'a Subscription,
        _users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<ReadUsers, ServiceError>> {
        // A merged watch names no watch id, so UpdateWatch never reaches it.
        Box::pin(std::future::ready(Err(ServiceError::Reopen("reopen the watch with the users to add".into()))))
    }

    fn last_active_at<'a>(&'a self, users: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<u64>, ServiceError>> {
        let held = &self.relay().held;
        let active = users.iter().map(|user| held.get(*user).map_or(0, |held| held.user.last_active_at)).collect();
        Box::pin(std::future::ready(Ok(active)))
    }
}

/// Keeps one link open: sends its controls, takes in what the owner sends,
/// follows the slot map, and stops relaying users no viewer watches.
async fn run_link(
    cluster: Arc<ClusterNode>,
    context: Arc<Context>,
    link: Arc<Link>,
    controls: mpsc::Receiver<pb::RelayControl>,
) {
    let _open = OpenGauge::open(&context.metrics().relay_links);
    let reason = match follow_link(&cluster, &context, &link, controls).await {
        Ok(reason) | Err(reason) => reason,
    };
    tracing::debug!(node = %link.address, %reason, "a relay ended");
    let relay = &cluster.relay;
    let users: Vec<CompactString> = {
        let mut state = link.state.lock();
        state.ended = Some(reason.clone());
        state.relayed.drain().map(|(user, _)| user).collect()
    };
    {
        let mut links = relay.links.lock();
        if links.get(&*link.address).is_some_and(|open| Arc::ptr_eq(open, &link)) {
            links.remove(&*link.address);
        }
    }
    for user in &users {
        relay.end_watchers(user, &reason);
    }
    relay.forget(&context, &link, users);
    link.answered.send_replace(u64::MAX);
}

/// [`run_link`] until the link ends: why it did.
async fn follow_link(
    cluster: &Arc<ClusterNode>,
    context: &Arc<Context>,
    link: &Arc<Link>,
    controls: mpsc::Receiver<pb::RelayControl>,
) -> Result<String, String> {
    let address = &*link.address;
    let broke = |status: &Status| format!("the relay from the node at {address} broke ({}); reopen", status.message());
    let membership = &cluster.membership;
    let mut client = membership.cluster_client(address).map_err(|err| err.to_string())?;
    let request = with_credential(ReceiverStream::new(controls), membership.peer_token());
    let opened = tokio::time::timeout(FORWARD_TIMEOUT, client.relay(request)).await;
    let mut frames = match opened {
        Ok(Ok(frames)) => frames.into_inner(),
        Ok(Err(status)) => {
            link.state.lock().older_node = status.code() == tonic::Code::Unimplemented;
            return Err(broke(&status));
        }
        Err(_) => return Err(format!("the node at {address} did not open a relay within {FORWARD_TIMEOUT:?}; reopen")),
    };
    let mut changes = membership.changes();
    let mut sweep = tokio::time::interval(SWEEP_EVERY);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            () = context.stopping.cancelled() => return Ok("the server is shutting down".into()),
            frame = frames.message() => match frame {
                Ok(Some(frame)) => take_frame(cluster, context, link, frame).await?,
                Ok(None) => return Err(format!("the node at {address} ended the relay; reopen")),
                Err(status) => return Err(broke(&status)),
            },
            () = changes.changed() => moved_away(cluster, context, link),
            _ = sweep.tick() => {
                // Again at each sweep: a move whose removal found the controls' queue full is tried again.
                moved_away(cluster, context, link);
                sweep_unwatched(cluster, context, link);
            }
        }
    }
}

/// Takes in one frame from the owner.
async fn take_frame(
    cluster: &Arc<ClusterNode>,
    context: &Arc<Context>,
    link: &Arc<Link>,
    frame: pb::RelayFrame,
) -> Result<(), String> {
    let relay = &cluster.relay;
    let now = context.publisher.clock.now();
    let damaged =
        |err: ServiceError| format!("the node at {} sent a damaged relay frame ({err}); reopen", link.address);
    match frame.frame {
        Some(pb::relay_frame::Frame::Added(added)) => {
            {
                let state = link.state.lock();
                for user in added.users {
                    let user = cluster_wire::relayed(user, now).map_err(damaged)?;
                    if state.relayed.get(&user.user_id) != Some(&added.sequence) {
                        continue;
                    }
                    let held = Held { user, owner: Arc::clone(&link.address) };
                    if relay.held.insert(held.user.user_id.clone(), held).is_none() {
                        context.metrics().relayed_users.add(1);
                    }
                }
            }
            if !added.not_owned.is_empty() {
                let mut state = link.state.lock();
                for user in &added.not_owned {
                    if state.relayed.get(user.as_str()) == Some(&added.sequence) {
                        state.relayed.remove(user.as_str());
                    }
                }
            }
            link.answered.send_modify(|answered| *answered = (*answered).max(added.sequence));
        }
        Some(pb::relay_frame::Frame::Changes(changes)) => {
            for user in changes.users {
                let user = cluster_wire::relayed(user, now).map_err(damaged)?;
                publish(relay, link, user);
            }
        }
        Some(pb::relay_frame::Frame::Relations(changed)) => {
            let users = changed
                .users
                .into_iter()
                .map(|user| cluster_wire::relayed(user, now).map(|user| (user.user_id, user.seen_by)))
                .collect::<Result<Vec<_>, _>>()
                .map_err(damaged)?;
            let viewers = changed.viewer_ids.into_iter().map(CompactString::from).collect();
            relations_changed(cluster, context, link, RelationsChanged { users, viewers }).await;
        }
        None => {}
    }
    Ok(())
}

/// Holds a relayed change and publishes it to the viewers here: held first,
/// so that a viewer subscribed before the publication reads it or gets it.
fn publish(relay: &Relay, link: &Link, user: Relayed) {
    let change = {
        let Some(mut held) = relay.held.get_mut(&user.user_id) else { return };
        if *held.owner != *link.address || user.view.presence.version < held.user.view.presence.version {
            return;
        }
        let seen_by = held.user.seen_by;
        held.user = Relayed { seen_by, ..user };
        PresenceChange {
            user_id: held.user.user_id.clone(),
            kind: ChangeKind::Flip,
            presence: held.user.view.presence,
            status: held.user.view.status.clone(),
            at: held.user.last_active_at,
            deadline: None,
        }
    };
    relay.hub.publish(&change);
}

/// Applies a change of relations at the owner to the viewers here: their
/// view of the users it names, and the view the viewers it names have of
/// every user this link relays, decided again as [`RelaySource`] decides it,
/// and shown as the owner shows it (see `Privacy::apply_transitions`).
/// The link takes nothing else meanwhile.
async fn relations_changed(cluster: &Arc<ClusterNode>, context: &Arc<Context>, link: &Link, changed: RelationsChanged) {
    let relay = &cluster.relay;
    let _views = relay.views.write().await;
    let here = |user: &str| relay.held.get(user).is_some_and(|held| *held.owner == *link.address);
    for (user, seen_by) in &changed.users {
        if let Some(mut held) = relay.held.get_mut(user)
            && *held.owner == *link.address
        {
            held.user.seen_by = *seen_by;
        }
    }
    // Every (mailbox, user) whose view may have changed, once.
    let mut pairs: Vec<(Arc<Mailbox>, CompactString)> = Vec::new();
    let mut seen = HashSet::new();
    let mut consider = |mailbox: Arc<Mailbox>, user: &CompactString, pairs: &mut Vec<_>| {
        if mailbox.viewer().is_some() && seen.insert((Arc::as_ptr(&mailbox) as usize, user.clone())) {
            pairs.push((mailbox, user.clone()));
        }
    };
    for (user, _) in changed.users.iter().filter(|(user, _)| here(user)) {
        for mailbox in relay.hub.watchers_of(user) {
            consider(mailbox, user, &mut pairs);
        }
    }
    for viewer in &changed.viewers {
        for mailbox in relay.hub.mailboxes_of(viewer) {
            for user in mailbox.users().iter().filter(|user| here(user)) {
                consider(Arc::clone(&mailbox), user, &mut pairs);
            }
        }
    }
    // Decided without the owner where who sees the user says it; asked of it, one call a viewer, otherwise.
    let mut decided: Vec<(Arc<Mailbox>, CompactString, bool)> = Vec::new();
    let mut asked: HashMap<CompactString, Vec<(Arc<Mailbox>, CompactString)>> = HashMap::new();
    for (mailbox, user) in pairs {
        let viewer = CompactString::from(mailbox.viewer().expect("only viewers' mailboxes"));
        let seen_by = relay.held.get(&user).map_or(SeenBy::Nobody, |held| held.user.seen_by);
        match seen_by.decides(&viewer, &user) {
            Some(visible) => decided.push((mailbox, user, visible)),
            None => asked.entry(viewer).or_default().push((mailbox, user)),
        }
    }
    for (viewer, pairs) in asked {
        let users: Vec<CompactString> = pairs.iter().map(|(_, user)| user.clone()).collect();
        match may_view(cluster, &link.address, &viewer, &users).await {
            Ok(visible) => {
                decided.extend(pairs.into_iter().zip(visible).map(|((mailbox, user), v)| (mailbox, user, v)))
            }
            Err(err) => {
                let reason = format!(
                    "relations changed at the node at {} and it did not say what {viewer} may see now ({err}); reopen",
                    link.address
                );
                pairs.iter().for_each(|(mailbox, _)| mailbox.end(reason.clone()));
            }
        }
    }
    let mut transitions: BTreeMap<CompactString, Vec<(Arc<Mailbox>, bool)>> = BTreeMap::new();
    for (mailbox, user, visible) in decided {
        if visible == mailbox.is_hidden(&user) {
            transitions.entry(user).or_default().push((mailbox, visible));
        }
    }
    if transitions.is_empty() {
        return;
    }
    let users: Vec<CompactString> = transitions.keys().cloned().collect();
    let bumped = match bump_versions(cluster, &link.address, &users, context.publisher.clock.now()).await {
        Ok(bumped) => bumped,
        Err(err) => {
            let reason =
                format!("relations changed at the node at {} and it gave no new version ({err}); reopen", link.address);
            transitions.values().flatten().for_each(|(mailbox, _)| mailbox.end(reason.clone()));
            return;
        }
    };
    for user in bumped {
        let Some(changed) = transitions.get(&user.user_id) else { continue };
        if let Some(mut held) = relay.held.get_mut(&user.user_id)
            && *held.owner == *link.address
            && held.user.view.presence.version < user.view.presence.version
        {
            held.user.view = user.view.clone();
            held.user.last_active_at = user.last_active_at;
        }
        let offline = presence_core::Presence::new(State::Offline, user.view.presence.version);
        for (mailbox, visible) in changed {
            if *visible {
                mailbox.set_hidden(&user.user_id, false);
                let shown = Pending::alone(user.view.presence, user.view.status.clone(), false);
                mailbox.post_transition(&user.user_id, shown);
            } else {
                mailbox.set_hidden(&user.user_id, true);
                mailbox.post_transition(&user.user_id, Pending::alone(offline, None, true));
            }
        }
    }
}

/// Ends the watchers of relayed users whose slot the map now gives another
/// node than this link's, and stops relaying them.
fn moved_away(cluster: &Arc<ClusterNode>, context: &Context, link: &Link) {
    let membership = &cluster.membership;
    let (map, nodes) = (membership.acted_map(), membership.nodes());
    let moved: Vec<CompactString> = {
        let mut state = link.state.lock();
        let moved: Vec<CompactString> = state
            .relayed
            .keys()
            .filter(|user| {
                let owner = map.owner(slot_of(user.as_bytes(), membership.slot_count()));
                owner.and_then(|owner| nodes.address(&owner.node)) != Some(&*link.address)
            })
            .cloned()
            .collect();
        if moved.is_empty() || !link.stop_relaying(&mut state, &moved) {
            return;
        }
        moved
    };
    let reason = format!("the slot of a watched user moved away from the node at {}; reopen", link.address);
    for user in &moved {
        cluster.relay.end_watchers(user, &reason);
    }
    cluster.relay.forget(context, link, moved);
}

/// Stops relaying the users no viewer here watches or is subscribing.
fn sweep_unwatched(cluster: &Arc<ClusterNode>, context: &Context, link: &Link) {
    let relay = &cluster.relay;
    let answered = *link.answered.borrow();
    let unwatched: Vec<CompactString> = {
        let mut state = link.state.lock();
        let unwatched: Vec<CompactString> = state
            .relayed
            .iter()
            .filter(|(user, sequence)| {
                **sequence <= answered && !state.opening.contains_key(*user) && !relay.hub.is_watched(user)
            })
            .map(|(user, _)| user.clone())
            .collect();
        if unwatched.is_empty() || !link.stop_relaying(&mut state, &unwatched) {
            return;
        }
        unwatched
    };
    relay.forget(context, link, unwatched);
}

/// Which of `users`, relayed from the node at `address`, `viewer` may see, by that node's relations.
async fn may_view(
    cluster: &ClusterNode,
    address: &str,
    viewer: &str,
    users: &[CompactString],
) -> Result<Vec<bool>, ServiceError> {
    let membership = &cluster.membership;
    let mut client = membership.cluster_client(address)?;
    let request =
        pb::MayViewRequest { viewer_id: viewer.to_owned(), user_ids: users.iter().map(ToString::to_string).collect() };
    let request = with_credential(request, membership.peer_token());
    let visible = call_peer(address, FORWARD_TIMEOUT, client.may_view(request)).await?.visible;
    if visible.len() != users.len() {
        return Err(ServiceError::Internal(format!("{address} answered MayView for the wrong number of users")));
    }
    Ok(visible)
}

/// New versions of `users` from the node at `address` that owns them.
async fn bump_versions(
    cluster: &ClusterNode,
    address: &str,
    users: &[CompactString],
    now: u64,
) -> Result<Vec<Relayed>, ServiceError> {
    let membership = &cluster.membership;
    let mut client = membership.cluster_client(address)?;
    let request = pb::BumpVersionsRequest { user_ids: users.iter().map(ToString::to_string).collect() };
    let request = with_credential(request, membership.peer_token());
    let bumped = call_peer(address, FORWARD_TIMEOUT, client.bump_versions(request)).await?;
    bumped.users.into_iter().map(|user| cluster_wire::relayed(user, now)).collect()
}

/// Whether `err` says a relay's owner is of an earlier version, which
/// relays nothing: its users' watches are then forwarded to it viewer by viewer.
pub(crate) fn is_older_node(err: &ServiceError) -> bool {
    matches!(err, ServiceError::Peer { status, .. } if status.code() == tonic::Code::Unimplemented)
}

/// The stream an owner sends a relaying node.
pub(crate) type RelayStream = ReceiverStream<Result<pb::RelayFrame, Status>>;

/// The owner's side of a relay (see the module's notes): the users the
/// relaying node names, as a service acting for no viewer sees them, and
/// every change of relations, in order with their changes.
pub(crate) fn serve(
    context: Arc<Context>,
    mut controls: tonic::Streaming<pb::RelayControl>,
) -> Result<RelayStream, ServiceError> {
    // Listening first: a change of relations made while the first users are
    // read reaches the relaying node after them.
    let mut relations = context.privacy.listen(RELATIONS_WAITING);
    let (subscription, _) = context.privacy.subscribe(Vec::new(), LINK_MAILBOX_USERS, None)?;
    let (tx, rx) = mpsc::channel(FRAMES_WAITING);
    tokio::spawn(async move {
        let _open = OpenGauge::open(&context.metrics().relay_sessions);
        let session = Session { context: &context, subscription: &subscription, tx: &tx };
        let ended = session.run(&mut controls, &mut relations).await;
        if let Some(ended) = ended {
            let _ = tx.send(Err(ended.into())).await;
        }
    });
    Ok(ReceiverStream::new(rx))
}

/// One relay at its owner.
struct Session<'a> {
    context: &'a Arc<Context>,
    subscription: &'a Subscription,
    tx: &'a mpsc::Sender<Result<pb::RelayFrame, Status>>,
}

impl Session<'_> {
    /// Serves the relay until the relaying node leaves (`None`) or it must
    /// end (why).
    async fn run(
        &self,
        controls: &mut tonic::Streaming<pb::RelayControl>,
        relations: &mut mpsc::Receiver<RelationsChanged>,
    ) -> Option<ServiceError> {
        let context = self.context;
        loop {
            tokio::select! {
                biased;
                () = self.tx.closed() => return None,
                () = context.stopping.cancelled() => return Some(ServiceError::ShuttingDown),
                changed = relations.recv() => match changed {
                    Some(changed) => if !self.send_relations(changed).await { return None },
                    None => return Some(fell_behind()),
                },
                control = controls.message() => match control {
                    Ok(Some(control)) => {
                        if let Err(err) = self.take_control(control).await {
                            return Some(err);
                        }
                    }
                    Ok(None) | Err(_) => return None,
                },
                () = self.subscription.mailbox().ready() => {
                    // No delivery tick, unlike a Watch: one relay carries
                    // every viewer's changes of these users, so it is woken
                    // once per change however many viewers there are, and
                    // a tick here would add to the viewers' own.
                    // Relations first: a change taken below may have been made after one of them.
                    loop {
                        match relations.try_recv() {
                            Ok(changed) => if !self.send_relations(changed).await { return None },
                            Err(mpsc::error::TryRecvError::Empty) => break,
                            Err(mpsc::error::TryRecvError::Disconnected) => return Some(fell_behind()),
                        }
                    }
                    if let Err(err) = self.deliver().await {
                        return Some(err);
                    }
                }
            }
        }
    }

    async fn send(&self, frame: pb::relay_frame::Frame) -> Option<()> {
        self.tx.send(Ok(pb::RelayFrame { frame: Some(frame) })).await.ok()
    }

    /// Tells of a change of relations, if it names a relayed user or a viewer.
    /// False: the relaying node left.
    async fn send_relations(&self, changed: RelationsChanged) -> bool {
        let mailbox = self.subscription.mailbox();
        let users: Vec<pb::RelayedUser> = changed
            .users
            .into_iter()
            .filter(|(user, _)| mailbox.watches(user))
            .map(|(user, seen_by)| {
                let unread = presence_core::UserView { presence: presence_core::Presence::UNKNOWN, status: None };
                cluster_wire::relayed_message(&Relayed { user_id: user, view: unread, last_active_at: 0, seen_by })
            })
            .collect();
        if users.is_empty() && changed.viewers.is_empty() {
            return true;
        }
        let frame = pb::RelayRelations { users, viewer_ids: changed.viewers.iter().map(ToString::to_string).collect() };
        self.send(pb::relay_frame::Frame::Relations(frame)).await.is_some()
    }

    /// Takes one control: removals, then additions, answered with the added users' state.
    async fn take_control(&self, control: pb::RelayControl) -> Result<(), ServiceError> {
        let remove = wire::user_ids("remove_user_ids", &control.remove_user_ids)?;
        self.subscription.remove(&remove);
        if control.add_user_ids.is_empty() {
            return Ok(());
        }
        let add = wire::user_ids("add_user_ids", &control.add_user_ids)?;
        let (owned, not_owned): (Vec<CompactString>, Vec<CompactString>) = {
            // Checked apart: a cluster node's view is never held across an await.
            let acting = self.context.placement.acting();
            add.into_iter().partition(|user| acting.check(user).is_ok())
        };
        let users = read_relayed(self.context, Some(self.subscription), &owned).await?;
        let added = pb::RelayAdded {
            sequence: control.sequence,
            users: users.iter().map(cluster_wire::relayed_message).collect(),
            not_owned: not_owned.iter().map(ToString::to_string).collect(),
        };
        self.send(pb::relay_frame::Frame::Added(added)).await.ok_or(ServiceError::ShuttingDown)
    }

    /// Sends what the mailbox holds: its changes, or, after it overflowed,
    /// every relayed user again (the relaying node keeps what is newer).
    async fn deliver(&self) -> Result<(), ServiceError> {
        let context = self.context;
        let changed: Vec<(CompactString, Pending)> = match self.subscription.mailbox().take() {
            Delivery::Changes(changes) => changes,
            Delivery::Resync => {
                let users = self.subscription.users();
                let users = read_relayed(context, Some(self.subscription), &users).await?;
                for chunk in users.chunks(USERS_PER_FRAME) {
                    let frame = pb::RelayedUsers { users: chunk.iter().map(cluster_wire::relayed_message).collect() };
                    self.send(pb::relay_frame::Frame::Changes(frame)).await.ok_or(ServiceError::ShuttingDown)?;
                }
                return Ok(());
            }
        };
        if changed.is_empty() {
            return Ok(());
        }
        let offline: Vec<&str> = changed
            .iter()
            .filter(|(_, pending)| pending.presence.state == State::Offline)
            .map(|(user, _)| user.as_str())
            .collect();
        let active: HashMap<&str, u64> = if offline.is_empty() {
            HashMap::new()
        } else {
            offline.iter().copied().zip(context.activity.last_active_at(&offline).await?).collect()
        };
        for chunk in changed.chunks(USERS_PER_FRAME) {
            let users = chunk
                .iter()
                .map(|(user, pending)| {
                    cluster_wire::relayed_message(&Relayed {
                        user_id: user.clone(),
                        view: presence_core::UserView { presence: pending.presence, status: pending.status.clone() },
                        last_active_at: active.get(user.as_str()).copied().unwrap_or(0),
                        seen_by: SeenBy::Everyone,
                    })
                })
                .collect();
            let frame = pb::RelayedUsers { users };
            self.send(pb::relay_frame::Frame::Changes(frame)).await.ok_or(ServiceError::ShuttingDown)?;
        }
        Ok(())
    }
}

fn fell_behind() -> ServiceError {
    ServiceError::Reopen("changes of relations came faster than this relay sent them; reopen".into())
}

/// `users`, owned here, as a relay sends them: subscribed to first when
/// `subscription` is given (and recorded as held there), then read.
async fn read_relayed(
    context: &Context,
    subscription: Option<&Subscription>,
    users: &[CompactString],
) -> Result<Vec<Relayed>, ServiceError> {
    if let Some(subscription) = subscription {
        context.privacy.add(subscription, users.to_vec())?;
    }
    let shown = context.privacy.shown(None, users)?;
    if let Some(subscription) = subscription {
        hold(subscription, users, &shown);
    }
    relayed_as_read(context, users, shown.into_iter().map(|shown| shown.view).collect()).await
}

/// `users`, owned here and read as `views`, with who sees each and its last activity.
async fn relayed_as_read(
    context: &Context,
    users: &[CompactString],
    views: Vec<presence_core::UserView>,
) -> Result<Vec<Relayed>, ServiceError> {
    let seen_by = context.privacy.seen_by(users);
    let active = context.activity.last_active_at(users).await?;
    Ok(users
        .iter()
        .zip(views)
        .zip(seen_by)
        .zip(active)
        .map(|(((user, view), seen_by), last_active_at)| Relayed {
            user_id: user.clone(),
            view,
            last_active_at,
            seen_by,
        })
        .collect())
}

/// The owner's answer to `BumpVersions`: each of `users`, owned here, with a new version.
pub(crate) async fn answer_bump_versions(
    context: &Context,
    request: &pb::BumpVersionsRequest,
) -> Result<pb::RelayedUsers, ServiceError> {
    let users = wire::user_ids("user_ids", &request.user_ids)?;
    {
        let acting = context.placement.acting();
        users.iter().try_for_each(|user| acting.check(user))?;
    }
    let views = context.privacy.bump_versions(&users)?;
    let users = relayed_as_read(context, &users, views).await?;
    Ok(pb::RelayedUsers { users: users.iter().map(cluster_wire::relayed_message).collect() })
}
