//! Followers (C4): each slot's follower keeps a copy of its owner's users,
//! and takes the slot over with that copy when the owner dies.
//!
//! A slot's follower is the node [`follower_of`] names: every node computes
//! it alike from the slot map and the live nodes, and the coordinator gives
//! a dead owner's slot to it. Every [`FOLLOW_INTERVAL`], an owner sends each
//! of its followers (`Cluster/Follow`, one stream per follower) the state of
//! the users that changed in the slots it follows: everything but renewals,
//! which carry no news but a later deadline (the store notes the changes,
//! `Store::take_changed`). A new stream, or a node newly a slot's follower,
//! starts with the whole state of those slots. The follower keeps the copy
//! in a store of its own, which expires nothing and serves nobody.
//!
//! When etcd's slot map gives this node a slot whose owner was another node
//! and no handover brought its state (C3), this node takes the copy in
//! (`Store::take_over`) before it answers for the slot: the users keep their
//! versions and their sessions' generations; each user the copy has online
//! is held online for the restart grace (B3), and each lease lives that
//! long at least, so that gateways renew the sessions they hold and
//! register again those the copy missed, without a flip. A user the copy
//! never had (registered in the last interval before the death) is unknown
//! until its gateway registers it again.
//!
//! Versions never go back across a takeover (M4): the copy carries the
//! owner's stamp clocks, and a takeover comes a lease TTL after the owner's
//! last stamp, so that every stamp this node issues is above any the dead
//! node issued (hybrid stamps, `stamp.rs`), as long as the nodes' clocks agree
//! within that.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use compact_str::CompactString;
use metrics::{counter, histogram};
use parking_lot::Mutex;
use presence_cluster::follower_of;
use presence_core::{Changes, ConfigError, SlotSet, Store, StoreConfig, slot_of};
use presence_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Streaming;

use crate::cluster::ClusterNode;
use crate::cluster::forward::with_credential;
use crate::cluster::handover::off_the_runtime;
use crate::cluster::membership::Membership;
use crate::cluster::wire as cluster_wire;
use crate::error::ServiceError;
use crate::metrics::names;
use crate::node::context::Context;
use crate::node::privacy::HandedOver;
use crate::node::user_data;
use crate::node::wire;

/// How often an owner sends its followers what changed: the bound on how
/// much a follower's copy lags behind (plus the time to send it).
pub(crate) const FOLLOW_INTERVAL: Duration = Duration::from_millis(50);

/// How long an owner waits for a follower to take a message before it
/// drops the stream and starts a new one later, with the whole state.
const SEND_TIMEOUT: Duration = Duration::from_secs(2);

/// How long after a stream to a follower broke an owner tries again.
const RETRY_AFTER: Duration = Duration::from_secs(1);

/// The state bytes one `FollowUpdate` message carries: well under gRPC's 4 MiB.
const PIECE_BYTES: usize = 1 << 20;

/// Users' durable data, and users removed, per `FollowUpdate` message.
const USERS_PER_PIECE: usize = 1_000;

/// The most state one update may carry: a whole node's slots of a large
/// node fit; a peer cannot make the follower hold more.
const MAX_UPDATE_BYTES: usize = 1 << 30;

/// The most users one update may name (removed, or with durable data).
const MAX_UPDATE_USERS: usize = 10_000_000;

/// The copies this node keeps of the slots it follows.
#[derive(Debug)]
pub(crate) struct Replica {
    /// The followed users, as their owners last sent them. Nothing here
    /// expires or publishes: it is only ever copied from and taken over.
    /// Whatever walks it goes to a blocking thread (`off_the_runtime`): a
    /// node newly a follower takes in a third of another node's users at
    /// once, and the runtime's workers answer renewals meanwhile (H1).
    copy: Arc<Store>,
    /// What each followed user keeps beside its leases, when it has anything.
    durable: Mutex<HashMap<CompactString, HandedOver>>,
    /// By slot: the owner whose copy this node holds.
    followed: Mutex<Vec<Option<String>>>,
    /// Held by each change of the copy, from its store's work (on another
    /// thread, awaited) to `followed`: a prune that read `followed` while an
    /// owner's new copy of a slot was going in would drop that copy.
    changing: tokio::sync::Mutex<()>,
    /// How long a taken-over user is held online, and its leases kept alive.
    hold_ms: u64,
}

/// One whole update from an owner.
#[derive(Debug)]
struct Update {
    from_node: String,
    fresh: SlotSet,
    state: Vec<u8>,
    removed: Vec<CompactString>,
    durable: Vec<HandedOver>,
    taken_at_ms: u64,
}

impl Replica {
    /// An empty copy for a cluster of `slots` slots, with the store's own
    /// configuration; taken-over users are held for `hold_ms`.
    pub(crate) fn new(config: &StoreConfig, now: u64, slots: u32, hold_ms: u64) -> Result<Self, ConfigError> {
        Ok(Replica {
            copy: Arc::new(Store::new(config.clone(), now)?),
            durable: Mutex::new(HashMap::new()),
            followed: Mutex::new(vec![None; slots as usize]),
            changing: tokio::sync::Mutex::new(()),
            hold_ms,
        })
    }

    /// Applies an owner's update to the copy. The state is checked whole
    /// before anything changes.
    async fn apply(&self, now: u64, update: Update) -> Result<(), ServiceError> {
        let _changing = self.changing.lock().await;
        let Update { from_node, fresh, state, removed, durable: kept, .. } = update;
        let applied = off_the_runtime(&self.copy, move |copy| {
            let applied = if !fresh.is_empty() {
                // The copy of these slots starts afresh: what it held of them
                // is dropped once the new state is checked whole.
                copy.replace_slots(now, &fresh, &state, &mut Changes::default()).map(drop)
            } else if !state.is_empty() {
                copy.import(now, &state, &mut Changes::default()).map(drop)
            } else {
                Ok(())
            };
            if applied.is_ok() {
                copy.release_users(now, &removed);
            }
            (applied, fresh, removed)
        });
        let (applied, fresh, removed) = applied.await?;
        applied.map_err(|refused| ServiceError::invalid("state", refused.to_string()))?;
        if !fresh.is_empty() {
            self.durable.lock().retain(|user, _| !fresh.holds(user.as_bytes()));
            let mut followed = self.followed.lock();
            fresh.iter().for_each(|slot| followed[slot as usize] = Some(from_node.clone()));
        }
        let mut durable = self.durable.lock();
        for user in &removed {
            durable.remove(user);
        }
        for user in kept {
            if user.status.is_none() && user.visibility.is_none() && user.audience.is_empty() {
                durable.remove(&user.user_id);
            } else {
                durable.insert(user.user_id.clone(), user);
            }
        }
        Ok(())
    }

    /// Drops what the copy holds of `user`, erased at its owner (P7): a
    /// takeover must not bring it back.
    pub(crate) fn drop_user(&self, now: u64, user: &CompactString) {
        self.copy.release_users(now, std::slice::from_ref(user));
        self.durable.lock().remove(user);
    }

    /// Drops the copy of `slots`.
    async fn drop_slots(&self, now: u64, slots: &SlotSet) {
        let _changing = self.changing.lock().await;
        self.drop_slots_changing(now, slots).await;
    }

    /// [`Replica::drop_slots`], with `changing` held.
    async fn drop_slots_changing(&self, now: u64, slots: &SlotSet) {
        let set = slots.clone();
        if let Err(error) = off_the_runtime(&self.copy, move |copy| copy.release_slots(now, &set)).await {
            tracing::error!(%error, "a follower's copy of slots could not be dropped");
        }
        self.durable.lock().retain(|user, _| !slots.holds(user.as_bytes()));
        let mut followed = self.followed.lock();
        slots.iter().for_each(|slot| followed[slot as usize] = None);
    }

    /// Takes the copy of `slots` out: its users' state and durable data.
    async fn take(&self, now: u64, slots: &SlotSet) -> Result<(Vec<u8>, Vec<HandedOver>), ServiceError> {
        let _changing = self.changing.lock().await;
        let set = slots.clone();
        let state = off_the_runtime(&self.copy, move |copy| copy.export_slots(&set, now)).await?;
        let durable =
            self.durable.lock().values().filter(|user| slots.holds(user.user_id.as_bytes())).cloned().collect();
        self.drop_slots_changing(now, slots).await;
        Ok((state, durable))
    }

    /// Drops the copies of slots this node no longer follows: their owner is
    /// another node than the one the copy came from, or another node follows
    /// them now. Slots the map gives this node are kept, to be taken over.
    async fn prune(&self, now: u64, membership: &Membership) {
        // A copy going in now is looked at on a later tick.
        let Ok(_changing) = self.changing.try_lock() else { return };
        let (map, nodes) = (membership.map(), membership.live_ids());
        let stale = {
            let followed = self.followed.lock();
            let stale = followed.iter().enumerate().filter_map(|(slot, from)| {
                let (slot, from) = (slot as u32, from.as_deref()?);
                let owner = map.owner(slot).map(|owner| owner.node.as_str());
                let keep = owner == Some(membership.node())
                    || (owner == Some(from) && follower_of(slot, from, &nodes) == Some(membership.node()));
                (!keep).then_some(slot)
            });
            SlotSet::of(membership.slot_count(), stale)
        };
        if !stale.is_empty() {
            tracing::debug!(slots = stale.len(), "dropped the copies of slots this node no longer follows");
            self.drop_slots_changing(now, &stale).await;
        }
    }
}

/// The follower's side of `Cluster/Follow`: applies each whole update.
pub(crate) async fn follow(
    context: &Context,
    cluster: &ClusterNode,
    mut pieces: Streaming<pb::FollowUpdate>,
) -> Result<pb::FollowResponse, ServiceError> {
    let (membership, replica) = (&cluster.membership, &cluster.replica);
    let mut updates = 0;
    let mut pending: Option<Update> = None;
    while let Some(piece) = pieces.message().await.map_err(|status| ServiceError::Peer {
        node: pending.as_ref().map_or_else(|| "the owner".to_owned(), |update| update.from_node.clone()),
        status,
    })? {
        let slots = membership.slot_count();
        if piece.slot_count != slots {
            return Err(ServiceError::invalid(
                "slot_count",
                format!("{}, but this cluster has {slots} slots", piece.slot_count),
            ));
        }
        if piece.from_node.is_empty() {
            return Err(ServiceError::invalid("from_node", "name the node sending the update"));
        }
        if let Some(bad) = piece.fresh_slots.iter().find(|&&slot| slot >= slots) {
            return Err(ServiceError::invalid(
                "fresh_slots",
                format!("{bad} is not one of the cluster's {slots} slots"),
            ));
        }
        let update = pending.get_or_insert_with(|| Update {
            from_node: piece.from_node.clone(),
            fresh: SlotSet::new(slots),
            state: Vec::new(),
            removed: Vec::new(),
            durable: Vec::new(),
            taken_at_ms: piece.taken_at_ms,
        });
        if update.state.len() + piece.state.len() > MAX_UPDATE_BYTES {
            return Err(ServiceError::invalid("state", format!("more than {MAX_UPDATE_BYTES} bytes in one update")));
        }
        if update.removed.len() + update.durable.len() + piece.removed_users.len() + piece.durable.len()
            > MAX_UPDATE_USERS
        {
            return Err(ServiceError::invalid("durable", format!("more than {MAX_UPDATE_USERS} users in one update")));
        }
        piece.fresh_slots.iter().for_each(|&slot| update.fresh.insert(slot));
        update.state.extend_from_slice(&piece.state);
        for user in piece.removed_users {
            update.removed.push(wire::id("removed_users", &user)?);
        }
        let now = context.now();
        for user in piece.durable {
            update.durable.push(cluster_wire::handed_over(user, now)?);
        }
        if piece.complete {
            let update = pending.take().expect("an update is pending");
            let taken_at_ms = update.taken_at_ms;
            replica.apply(context.now(), update).await?;
            updates += 1;
            let lag_ms = unix_ms().saturating_sub(taken_at_ms);
            histogram!(names::FOLLOWER_LAG_SECONDS).record(lag_ms as f64 / 1_000.0);
        }
    }
    Ok(pb::FollowResponse { updates })
}

/// Milliseconds since the Unix epoch, by the system clock: what the lag of
/// a follower's copy is measured with, across nodes.
fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_millis() as u64)
}

/// A stream of updates to one follower.
#[derive(Debug)]
struct Link {
    sender: mpsc::Sender<pb::FollowUpdate>,
    /// The slots whose whole state the follower got on this stream.
    synced: SlotSet,
}

/// The owner's side: sends each follower what changed in its slots, every
/// [`FOLLOW_INTERVAL`], until the server stops. Also drops the copies this
/// node no longer needs.
pub(crate) async fn send_to_followers(context: Arc<Context>, cluster: Arc<ClusterNode>) {
    let (membership, replica) = (&cluster.membership, &cluster.replica);
    let mut links: HashMap<String, Link> = HashMap::new();
    let mut broken: HashMap<String, tokio::time::Instant> = HashMap::new();
    let mut ticks = tokio::time::interval(FOLLOW_INTERVAL);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = context.stopping.cancelled() => return,
        }
        replica.prune(context.now(), membership).await;
        let taken_at_ms = unix_ms();
        let mut changed: HashSet<CompactString> = context.store().take_changed().into_iter().collect();
        changed.extend(user_data::take_changed(&context));
        let assigned = followers(membership);
        links.retain(|node, link| assigned.contains_key(node) && !link.sender.is_closed());
        let mut changed_for: BTreeMap<&str, Vec<CompactString>> = BTreeMap::new();
        for user in changed {
            let slot = slot_of(user.as_bytes(), membership.slot_count());
            if let Some((node, _)) = assigned.iter().find(|(_, slots)| slots.contains(slot)) {
                changed_for.entry(node.as_str()).or_default().push(user);
            }
        }
        let nodes = membership.nodes();
        for (node, slots) in &assigned {
            let changed = changed_for.remove(node.as_str()).unwrap_or_default();
            if !links.contains_key(node) {
                if broken.get(node).is_some_and(|&retry_at| tokio::time::Instant::now() < retry_at) {
                    continue;
                }
                let Some(address) = nodes.address(node) else { continue };
                match open_link(membership, address) {
                    Ok(sender) => {
                        links.insert(node.clone(), Link { sender, synced: SlotSet::new(membership.slot_count()) });
                    }
                    Err(error) => {
                        tracing::warn!(node, %error, "cannot reach a follower");
                        continue;
                    }
                }
            }
            let link = links.get_mut(node).expect("opened above");
            let fresh = SlotSet::of(membership.slot_count(), slots.iter().filter(|&slot| !link.synced.contains(slot)));
            let sent = send_update(&context, membership, link, &fresh, changed, taken_at_ms).await;
            match sent {
                Ok(()) => link.synced = slots.clone(),
                Err(()) => {
                    tracing::warn!(node, "a follower's stream broke: its copy starts afresh on the next one");
                    links.remove(node);
                    broken.insert(node.clone(), tokio::time::Instant::now() + RETRY_AFTER);
                }
            }
        }
    }
}

/// The slots this node owns by follower.
fn followers(membership: &Membership) -> BTreeMap<String, SlotSet> {
    let (map, nodes) = (membership.acted_map(), membership.nodes().ids());
    let mut assigned: BTreeMap<String, SlotSet> = BTreeMap::new();
    for slot in map.owned_by(membership.node()) {
        if let Some(follower) = follower_of(slot, membership.node(), &nodes) {
            assigned.entry(follower.to_owned()).or_insert_with(|| SlotSet::new(membership.slot_count())).insert(slot);
        }
    }
    assigned
}

/// Opens a `Cluster/Follow` stream to the node at `address`.
fn open_link(membership: &Membership, address: &str) -> Result<mpsc::Sender<pb::FollowUpdate>, ServiceError> {
    let mut client = membership.cluster_client(address)?;
    let (sender, receiver) = mpsc::channel(4);
    let request = with_credential(tokio_stream::wrappers::ReceiverStream::new(receiver), membership.peer_token());
    let address = address.to_owned();
    tokio::spawn(async move {
        // Ends when the follower fails or the owner drops the sender; the
        // receiver goes with it, which the owner sees as a closed link.
        if let Err(status) = client.follow(request).await {
            tracing::debug!(address, %status, "a follower's stream ended");
        }
    });
    Ok(sender)
}

/// Sends `link`'s follower the whole state of `fresh` and the state of the
/// `changed` users (of the slots it has already). `Err` when the stream broke.
async fn send_update(
    context: &Arc<Context>,
    membership: &Membership,
    link: &Link,
    fresh: &SlotSet,
    changed: Vec<CompactString>,
    taken_at_ms: u64,
) -> Result<(), ()> {
    let header = |fresh: &SlotSet| pb::FollowUpdate {
        from_node: membership.node().to_owned(),
        slot_count: membership.slot_count(),
        fresh_slots: fresh.iter().collect(),
        taken_at_ms,
        // The next protocol minor's added field (D1's mixed-version roll).
        #[cfg(feature = "next-cluster-protocol")]
        sender_version: env!("CARGO_PKG_VERSION").to_owned(),
        ..pb::FollowUpdate::default()
    };
    if !fresh.is_empty() {
        let (set, now) = (fresh.clone(), context.now());
        let state = off_the_runtime(context.store(), move |store| store.export_slots(&set, now)).await.map_err(drop)?;
        let durable = user_data::in_slots(context, fresh).await.map_err(|error| {
            tracing::warn!(%error, "the durable data of slots to follow could not be read");
        })?;
        send_pieces(link, header(fresh), state, Vec::new(), durable).await?;
    }
    let changed: Vec<CompactString> = changed.into_iter().filter(|user| !fresh.holds(user.as_bytes())).collect();
    if !changed.is_empty() {
        let (state, removed) = context.store().export_users(&changed, context.now());
        let durable = user_data::of(context, &changed).await.map_err(|error| {
            tracing::warn!(%error, "the durable data of changed users could not be read");
        })?;
        let empty = SlotSet::new(membership.slot_count());
        send_pieces(link, header(&empty), state, removed, durable).await?;
    }
    Ok(())
}

/// Sends one update in pieces, the last marked complete.
async fn send_pieces(
    link: &Link,
    header: pb::FollowUpdate,
    state: Vec<u8>,
    removed: Vec<CompactString>,
    durable: Vec<HandedOver>,
) -> Result<(), ()> {
    let mut pieces: Vec<pb::FollowUpdate> = state
        .chunks(PIECE_BYTES)
        .map(|piece| pb::FollowUpdate { state: piece.to_vec(), ..Default::default() })
        .collect();
    pieces.extend(removed.chunks(USERS_PER_PIECE).map(|users| pb::FollowUpdate {
        removed_users: users.iter().map(ToString::to_string).collect(),
        ..Default::default()
    }));
    pieces.extend(
        cluster_wire::handed_over_pieces(&durable, PIECE_BYTES)
            .into_iter()
            .map(|durable| pb::FollowUpdate { durable, ..Default::default() }),
    );
    if pieces.is_empty() {
        pieces.push(pb::FollowUpdate::default());
    }
    let count = pieces.len();
    for (index, mut piece) in pieces.into_iter().enumerate() {
        piece.from_node.clone_from(&header.from_node);
        piece.slot_count = header.slot_count;
        piece.taken_at_ms = header.taken_at_ms;
        if index == 0 {
            piece.fresh_slots.clone_from(&header.fresh_slots);
        }
        piece.complete = index + 1 == count;
        match tokio::time::timeout(SEND_TIMEOUT, link.sender.send(piece)).await {
            Ok(Ok(())) => {}
            _ => return Err(()),
        }
    }
    Ok(())
}

/// Follows etcd's slot map for this node: before it acts on a map that
/// gives it a slot another node owned, it takes in that slot's state from
/// its copy, unless a handover brought it (see the module's description).
pub(crate) async fn act_on_the_map(context: Arc<Context>, cluster: Arc<ClusterNode>) {
    let (membership, replica) = (&cluster.membership, &cluster.replica);
    let mut changes = membership.map_changes();
    loop {
        let (map, acted) = (membership.map(), membership.acted_map());
        if !Arc::ptr_eq(&map, &acted) {
            if takes_over(membership, &acted, &map) {
                // A node that told others during an etcd outage that etcd
                // does not answer it promised them to take over none of
                // their slots for a while: one of them may still act on
                // its slots until then.
                membership.outage().promises_kept().await;
            }
            let handed = take_in(&context, membership, replica, &acted, &map).await;
            membership.act_on(Arc::clone(&map));
            // Their state came whole with the handover: the copy is older.
            // Dropped once this node acts on them, since requests held
            // through the move wait for that (C7).
            if !handed.is_empty() {
                replica.drop_slots(context.now(), &handed).await;
            }
            drop_given_away(&context, membership, &acted, &map).await;
        }
        tokio::select! {
            changed = changes.changed() => if changed.is_err() { return },
            () = context.stopping.cancelled() => return,
        }
    }
}

/// Drops, without publishing anything, the users of the slots `acted` gave
/// this node and `map` gives another, other than by a handover (which drops
/// them itself): etcd gave them away while this node's lease was gone, and
/// their new owner took them over from its copy.
async fn drop_given_away(
    context: &Context,
    membership: &Membership,
    acted: &presence_cluster::SlotMap,
    map: &presence_cluster::SlotMap,
) {
    let given_away = (0..membership.slot_count())
        .filter(|&slot| membership.owns(acted, slot) && !membership.owns(map, slot) && !membership.is_leaving(slot));
    let given_away = SlotSet::of(membership.slot_count(), given_away);
    if given_away.is_empty() {
        return;
    }
    let users = crate::cluster::handover::drop_here(context, &given_away, "slots given to other nodes").await;
    tracing::warn!(
        slots = given_away.len(),
        users,
        "slots given to other nodes while this node was gone: dropped here"
    );
}

/// Whether `map` gives this node a slot that `acted` gave another node,
/// other than by a handover (which brought its state, and whose source
/// stopped acting on it first).
fn takes_over(membership: &Membership, acted: &presence_cluster::SlotMap, map: &presence_cluster::SlotMap) -> bool {
    (0..membership.slot_count()).any(|slot| {
        membership.owns(map, slot)
            && !membership.owns(acted, slot)
            && acted.owner(slot).is_some()
            && !membership.was_taken_in(slot)
    })
}

/// Takes in the state of the slots `map` gives this node and `acted` gave
/// another, from this node's copy unless a handover brought it; returns the
/// slots a handover brought, whose copy is to be dropped.
async fn take_in(
    context: &Context,
    membership: &Membership,
    replica: &Replica,
    acted: &presence_cluster::SlotMap,
    map: &presence_cluster::SlotMap,
) -> SlotSet {
    let slots = membership.slot_count();
    let (mut from_copy, mut handed) = (SlotSet::new(slots), SlotSet::new(slots));
    for slot in 0..slots {
        if !membership.owns(map, slot) || membership.owns(acted, slot) {
            continue;
        }
        if membership.forget_taken_in(slot) {
            handed.insert(slot);
        } else if acted.owner(slot).is_some() {
            from_copy.insert(slot);
        }
    }
    let now = context.now();
    if from_copy.is_empty() {
        return handed;
    }
    crate::cluster::handover::answer_again(context, membership, &from_copy);
    let (state, durable) = match replica.take(now, &from_copy).await {
        Ok(taken) => taken,
        Err(error) => {
            tracing::error!(%error, slots = from_copy.len(), "a follower's copy could not be read to take it over");
            return handed;
        }
    };
    let bytes = state.len();
    let hold_until = now.saturating_add(replica.hold_ms);
    // What the gone node recorded of these slots after its last handover is
    // gone with it: the feed says so, before anything the takeover changes (F3).
    if let Some(feed) = &context.feed {
        feed.mark_taken_over(from_copy.iter(), now);
    }
    // Through the publisher: the users' room facts go to their rooms' owners.
    let taken = match context.apply(|store, _, changes| store.take_over(now, &state, hold_until, changes)) {
        Ok(taken) => taken,
        Err(damaged) => {
            tracing::error!(%damaged, slots = from_copy.len(), "a follower's copy could not be taken over");
            return handed;
        }
    };
    if let Err(error) = user_data::take_over(context, durable, now).await {
        tracing::error!(%error, "the durable data of slots taken over could not be written");
    }
    counter!(names::TAKEN_OVER_USERS).increment(taken.users as u64);
    tracing::info!(
        slots = from_copy.len(),
        users = taken.users,
        sessions = taken.sessions,
        bytes,
        "took over slots of a node that is gone, from this node's copy"
    );
    handed
}
