//! Room watchers (R3, R4, R5, S3): one topic per watched room in this
//! process, however many watch it, and the two ways of watching one.
//!
//! Member mode: a WatchRoom stream opens with the room's snapshot and then
//! gets each member change and signal set the store publishes, with the room
//! version. As for users, the stream subscribes before it reads the snapshot
//! and drops what is not newer than it, so nothing falls between them. Its
//! mailbox (`room_hub.rs`) conflates what it has not taken yet, in version
//! order, and resyncs a watcher that fell too far behind.
//!
//! Count mode needs no subscription: the stream reads the room's counts once
//! per `count_interval_ms` (O(1) plus the invisible users, who are counted by
//! nobody) and sends them only when they changed.
//!
//! Privacy is applied where data leaves: a member hidden from the viewer is
//! not listed, and none of its changes or signals reach it (R4). A change of
//! relations resyncs the member watchers it may concern. Who may read a room
//! at all is checked on open and again on every change of its access or of
//! the viewer's own membership; a stream that may no longer read it ends with
//! the status an unknown room gets.

use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;
use presence_core::{CompactString, RoomAccess, RoomChange, RoomChangeKind, RoomEventBody, Store};
use presence_proto::v1::{self as pb, room_event};
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::ServiceError;
use crate::metrics::OpenGauge;
use crate::node::context::Context;
use crate::node::room_hub::{RoomDelivery, RoomMailbox};
use crate::node::wire;

/// Items the gRPC layer has not yet sent; the mailbox conflates the rest.
const STREAM_BUFFER: usize = 64;

/// The stream type the WatchRoom RPC returns.
pub(crate) type RoomStream = tokio_stream::wrappers::ReceiverStream<Result<pb::RoomEvent, Status>>;

/// What a WatchRoom or RoomSnapshot is for.
#[derive(Debug, Clone)]
pub(crate) struct RoomRequest {
    pub(crate) room_id: CompactString,
    /// `None`: a service acting for no viewer, who sees every member.
    pub(crate) viewer: Option<CompactString>,
}

/// Which of a room's members one caller may see (R4). On one node, the
/// relations here decide. On a cluster node the room's members are users of
/// every node, and each node holds only its own users' visibility and
/// audience: the others' are asked of their nodes (`Placement::may_view`)
/// before they are shown, once per member for as long as the lens is kept
/// (a watch keeps it until it resyncs, which a change of a member's
/// relations at its node makes it do).
#[derive(Debug)]
pub(crate) struct MemberLens {
    viewer: Option<CompactString>,
    /// What the members' own nodes answered; empty outside a cluster.
    asked: HashMap<CompactString, bool>,
}

impl MemberLens {
    pub(crate) fn new(request: &RoomRequest) -> Self {
        MemberLens { viewer: request.viewer.clone(), asked: HashMap::new() }
    }

    /// Asks the nodes of those of `users` not asked yet (for a viewer;
    /// a single node answers none, and its relations decide every member).
    async fn learn<'a>(
        &mut self,
        context: &Context,
        users: impl IntoIterator<Item = &'a CompactString>,
    ) -> Result<(), ServiceError> {
        let Some(viewer) = &self.viewer else { return Ok(()) };
        let mut new: Vec<CompactString> =
            users.into_iter().filter(|user| !self.asked.contains_key(*user)).cloned().collect();
        new.sort_unstable();
        new.dedup();
        if !new.is_empty() {
            self.asked.extend(context.placement.may_view(&context.privacy, viewer, new).await?);
        }
        Ok(())
    }

    /// Whether the caller may see `user` (learned first, on a cluster node).
    fn can_see(&self, context: &Context, user: &str) -> bool {
        match self.asked.get(user) {
            Some(&visible) => visible,
            None => context.privacy.can_see(self.viewer.as_deref(), user),
        }
    }

    /// Those of `items` whose user (`user(item)`) the caller may see; the
    /// relations here are read once for all the users not asked elsewhere.
    fn visible<T>(&self, context: &Context, items: Vec<T>, user: impl Fn(&T) -> &str) -> Vec<T> {
        if self.asked.is_empty() {
            return context.privacy.visible(self.viewer.as_deref(), items, user);
        }
        let (asked, here): (Vec<T>, Vec<T>) = items.into_iter().partition(|item| self.asked.contains_key(user(item)));
        let mut shown = context.privacy.visible(self.viewer.as_deref(), here, &user);
        shown.extend(asked.into_iter().filter(|item| self.asked[user(item)]));
        shown
    }

    /// Forgets what was asked: relations changed somewhere.
    fn forget(&mut self) {
        self.asked.clear();
    }
}

/// The refusal for a room the caller may not read, the same as for a room that does not exist.
fn not_visible(room_id: &str) -> ServiceError {
    ServiceError::RoomNotFound { room_id: room_id.into() }
}

/// Whether the caller may read the room (R4): a service acting for no
/// viewer always; a viewer when the room is public or it is a member.
fn may_read(context: &Context, request: &RoomRequest) -> bool {
    may_read_room(context.store(), request.viewer.as_deref(), &request.room_id)
}

/// [`may_read`] of one room held in `store`, for `viewer` (`None`: a service acting for no viewer).
pub(crate) fn may_read_room(store: &Store, viewer: Option<&str>, room_id: &str) -> bool {
    let Some(viewer) = viewer else { return true };
    store.room_access(room_id) == RoomAccess::Public || store.is_member(room_id, viewer)
}

/// The room as `request`'s caller may see it (R4, R6): hidden members left
/// out; past `member_cap` members, only the counts.
pub(crate) async fn snapshot(
    context: &Context,
    request: &RoomRequest,
    lens: &mut MemberLens,
) -> Result<pb::RoomSnapshot, ServiceError> {
    if !may_read(context, request) {
        return Err(not_visible(&request.room_id));
    }
    let view = context.store().room(&request.room_id, context.room_member_cap);
    let listed_users = view.members.iter().flatten().map(|member| &member.user_id);
    let signalling = view.signals.iter().flat_map(|(_, users, _)| users);
    lens.learn(context, listed_users.chain(signalling)).await?;
    let Some(members) = view.members else {
        let (_, users, sessions) = context.placement.room_counts(context.store(), &context.privacy, &request.room_id);
        return Ok(pb::RoomSnapshot {
            room_id: view.room_id.to_string(),
            version: view.version,
            users,
            sessions,
            members_omitted: true,
            signals: signal_sets(context, lens, &view.room_id, view.version, view.signals),
            ..Default::default()
        });
    };
    let listed: Vec<pb::RoomMember> =
        members.iter().filter(|member| lens.can_see(context, &member.user_id)).map(wire::room_member).collect();
    Ok(pb::RoomSnapshot {
        room_id: view.room_id.to_string(),
        version: view.version,
        users: listed.len() as u32,
        sessions: listed.iter().map(|member| member.sessions).sum(),
        members: listed,
        members_omitted: false,
        signals: signal_sets(context, lens, &view.room_id, view.version, view.signals),
    })
}

fn signal_sets(
    context: &Context,
    lens: &MemberLens,
    room_id: &str,
    version: u64,
    signals: Vec<(CompactString, Vec<CompactString>, u32)>,
) -> Vec<pb::SignalSet> {
    signals
        .into_iter()
        .map(|(kind, user_ids, count)| signal_set(context, lens, room_id, version, &kind, user_ids, count))
        .collect()
}

/// A signal set as the viewer may see it: hidden users left out of the list and the count.
fn signal_set(
    context: &Context,
    lens: &MemberLens,
    room_id: &str,
    version: u64,
    kind: &str,
    user_ids: Vec<CompactString>,
    count: u32,
) -> pb::SignalSet {
    let listed = user_ids.len() as u32;
    let shown = lens.visible(context, user_ids, |user_id| user_id);
    pb::SignalSet {
        room_id: room_id.to_owned(),
        version,
        kind: kind.to_owned(),
        count: count - (listed - shown.len() as u32),
        user_ids: shown.into_iter().map(String::from).collect(),
    }
}

/// Opens a WatchRoom stream.
pub(crate) async fn watch(
    context: Arc<Context>,
    request: RoomRequest,
    count_interval: Option<Duration>,
) -> Result<RoomStream, ServiceError> {
    if !may_read(&context, &request) {
        return Err(not_visible(&request.room_id));
    }
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    match count_interval {
        Some(interval) => {
            tokio::spawn(async move {
                let _watcher = OpenGauge::open(&context.metrics().room_watchers);
                if let Err(err) = counts(&context, &request, interval, &tx).await {
                    let _ = tx.send(Err(err.into())).await;
                }
            });
        }
        None => {
            // Subscribed before the snapshot is read, so no change falls between them.
            let subscription =
                context.rooms().subscribe(&request.room_id, request.viewer.clone(), context.watch_buffer);
            let mut lens = MemberLens::new(&request);
            let first = member_snapshot(&context, &request, &mut lens).await?;
            subscription.mailbox.hold(first.version);
            tx.try_send(Ok(room_event(room_event::Event::Snapshot(first)))).expect("a new channel has room");
            tokio::spawn(async move {
                let _watcher = OpenGauge::open(&context.metrics().room_watchers);
                if let Err(err) = members(&context, &request, &mut lens, &subscription.mailbox, &tx).await {
                    let _ = tx.send(Err(err.into())).await;
                }
            });
        }
    }
    Ok(RoomStream::new(rx))
}

/// Member mode's snapshot: refused past the member cap, naming count mode.
async fn member_snapshot(
    context: &Context,
    request: &RoomRequest,
    lens: &mut MemberLens,
) -> Result<pb::RoomSnapshot, ServiceError> {
    let snapshot = snapshot(context, request, lens).await?;
    if snapshot.members_omitted {
        return Err(ServiceError::RoomTooLarge { room_id: request.room_id.clone(), cap: context.room_member_cap });
    }
    Ok(snapshot)
}

fn room_event(event: room_event::Event) -> pb::RoomEvent {
    pb::RoomEvent { event: Some(event) }
}

/// Feeds a member-mode stream until the viewer leaves, may no longer read
/// the room, or the server stops.
async fn members(
    context: &Context,
    request: &RoomRequest,
    lens: &mut MemberLens,
    mailbox: &RoomMailbox,
    tx: &mpsc::Sender<Result<pb::RoomEvent, Status>>,
) -> Result<(), ServiceError> {
    loop {
        tokio::select! {
            () = mailbox.ready.notified() => {}
            () = tx.closed() => return Ok(()),
            () = context.stopping.cancelled() => return Err(ServiceError::ShuttingDown),
        }
        let (delivery, recheck) = mailbox.take();
        if recheck {
            context.placement.room_here(&request.room_id)?;
            if !may_read(context, request) {
                return Err(not_visible(&request.room_id));
            }
        }
        let events = match delivery {
            RoomDelivery::Resync => {
                // A resync may follow a change of relations: everything is asked again.
                lens.forget();
                let fresh = member_snapshot(context, request, lens).await?;
                mailbox.hold(fresh.version);
                vec![room_event(room_event::Event::Snapshot(fresh))]
            }
            RoomDelivery::Changes(changes) => {
                lens.learn(context, changes.iter().flat_map(change_users)).await?;
                let mut events = Vec::with_capacity(changes.len());
                for change in changes {
                    if change.users as usize > context.room_member_cap {
                        return Err(ServiceError::RoomTooLarge {
                            room_id: request.room_id.clone(),
                            cap: context.room_member_cap,
                        });
                    }
                    if let Some(event) = member_event(context, lens, change) {
                        events.push(event);
                    }
                }
                events
            }
        };
        for event in events {
            tokio::select! {
                sent = tx.send(Ok(event)) => if sent.is_err() { return Ok(()) },
                () = context.stopping.cancelled() => return Err(ServiceError::ShuttingDown),
            }
        }
    }
}

/// The users a room change shows.
fn change_users(change: &RoomChange) -> Vec<&CompactString> {
    match &change.body {
        RoomEventBody::Member { member, .. } => vec![&member.user_id],
        RoomEventBody::Signals { user_ids, .. } => user_ids.iter().collect(),
        RoomEventBody::Sessions => Vec::new(),
    }
}

/// A room change as the viewer may see it; `None` for a hidden member's.
fn member_event(context: &Context, lens: &MemberLens, change: RoomChange) -> Option<pb::RoomEvent> {
    match change.body {
        RoomEventBody::Member { kind, member } => {
            if !lens.can_see(context, &member.user_id) {
                return None;
            }
            let kind = match kind {
                RoomChangeKind::Joined => pb::RoomChangeKind::RoomChangeJoined,
                RoomChangeKind::Left => pb::RoomChangeKind::RoomChangeLeft,
                RoomChangeKind::Updated => pb::RoomChangeKind::RoomChangeUpdated,
            };
            Some(room_event(room_event::Event::Change(pb::RoomMemberChange {
                room_id: change.room_id.to_string(),
                version: change.version,
                kind: kind as i32,
                member: Some(wire::room_member(&member)),
            })))
        }
        RoomEventBody::Signals { kind, user_ids, count } => Some(room_event(room_event::Event::Signals(signal_set(
            context,
            lens,
            &change.room_id,
            change.version,
            &kind,
            user_ids,
            count,
        )))),
        RoomEventBody::Sessions => None,
    }
}

/// Feeds a count-mode stream: the counts at once, then whenever they changed,
/// at most once per `interval`.
async fn counts(
    context: &Context,
    request: &RoomRequest,
    interval: Duration,
    tx: &mpsc::Sender<Result<pb::RoomEvent, Status>>,
) -> Result<(), ServiceError> {
    // The first count at once; the later ones at a phase of this watcher's
    // own, so that watchers opened together do not all read and send at the
    // same instant, each still at most once per interval.
    let phase = interval.mul_f64(fastrand::f64() / 4.0);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval + phase, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sent = None;
    let mut first = true;
    loop {
        if !std::mem::take(&mut first) {
            tokio::select! {
                _ = tick.tick() => {}
                () = tx.closed() => return Ok(()),
                () = context.stopping.cancelled() => return Err(ServiceError::ShuttingDown),
            }
        }
        context.placement.room_here(&request.room_id)?;
        if !may_read(context, request) {
            return Err(not_visible(&request.room_id));
        }
        let (version, users, sessions) =
            context.placement.room_counts(context.store(), &context.privacy, &request.room_id);
        let counts = (users, sessions);
        if sent == Some(counts) {
            continue;
        }
        sent = Some(counts);
        let count =
            pb::RoomCount { room_id: request.room_id.to_string(), version, users: counts.0, sessions: counts.1 };
        context.metrics().room_count_frames.increment(1);
        if tx.send(Ok(room_event(room_event::Event::Count(count)))).await.is_err() {
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::clock::StoreClock;
    use crate::node::context::NodeConfig;
    use crate::node::privacy::{RelationChange, Visibility};
    use crate::node::testing::ToldPlacement;
    use presence_core::{Registration, RoomRef, Store, StoreConfig};
    use tokio_util::sync::CancellationToken;

    /// A node placed by `placement` whose room "room" has v, a, b and c as
    /// members, each signalling "typing", and the generation of each one's session.
    fn room_of_four(placement: &Arc<ToldPlacement>) -> (Context, HashMap<&'static str, u64>) {
        let clock = StoreClock::start();
        let store = Arc::new(Store::new(StoreConfig::default(), clock.now()).unwrap());
        let context = Context::placed(
            store,
            clock,
            None,
            None,
            &NodeConfig::default(),
            CancellationToken::new(),
            placement.clone(),
        );
        let mut generations = HashMap::new();
        for user in ["v", "a", "b", "c"] {
            let generation = join(&context, user, "one", None);
            let room = RoomRef { user_id: user, session_id: "s", generation, room_id: "room" };
            context.apply(|store, now, changes| store.signal(now, &room, "typing", 5_000, changes)).unwrap();
            generations.insert(user, generation);
        }
        (context, generations)
    }

    /// `user`'s session "s" (registered unless `generation` is given) joins
    /// "room" with `tab` as its metadata; its generation.
    fn join(context: &Context, user: &str, tab: &str, generation: Option<u64>) -> u64 {
        let generation = generation.unwrap_or_else(|| {
            let registration =
                Registration { user_id: user, session_id: "s", gateway_id: "gw", ttl_ms: 0, metadata: &[] };
            context.apply(|store, now, changes| store.register(now, &registration, changes)).unwrap().generation
        });
        let room = RoomRef { user_id: user, session_id: "s", generation, room_id: "room" };
        let metadata = [("tab".to_owned(), tab.to_owned())];
        context.apply(|store, now, changes| store.join(now, &room, &metadata, changes)).unwrap();
        generation
    }

    fn request(viewer: Option<&str>) -> RoomRequest {
        RoomRequest { room_id: "room".into(), viewer: viewer.map(CompactString::from) }
    }

    /// The members a snapshot lists, and the users and count of its one signal set.
    fn shown(snapshot: &pb::RoomSnapshot) -> (Vec<&str>, Vec<&str>, u32) {
        let mut members: Vec<&str> = snapshot.members.iter().map(|member| member.user_id.as_str()).collect();
        members.sort_unstable();
        let [signals] = snapshot.signals.as_slice() else { panic!("one signal set: {snapshot:?}") };
        let mut signalling: Vec<&str> = signals.user_ids.iter().map(String::as_str).collect();
        signalling.sort_unstable();
        (members, signalling, signals.count)
    }

    #[tokio::test]
    async fn r4_a_snapshot_shows_other_nodes_members_as_their_nodes_answer_once_and_this_nodes_by_its_relations() {
        let placement = Arc::new(
            ToldPlacement::default()
                .owned_elsewhere("b", "node-b", "10.0.0.2:7000")
                .owned_elsewhere("c", "node-c", "10.0.0.3:7000")
                .shows("v", "b", true)
                .shows("v", "c", false),
        );
        let (context, _) = room_of_four(&placement);
        // a is this node's, seen by everyone here; b and c would be hidden by
        // the relations here (an audience of none), c is by its own node.
        let everyone = RelationChange::Visibility { user: "a".into(), visibility: Visibility::Everyone };
        context.privacy.change(everyone).await.unwrap();

        let mut lens = MemberLens::new(&request(Some("v")));
        let first = snapshot(&context, &request(Some("v")), &mut lens).await.unwrap();
        assert_eq!(shown(&first), (vec!["a", "b", "v"], vec!["a", "b", "v"], 3));
        assert_eq!(first.users, 3);
        let all: Vec<CompactString> = ["a", "b", "c", "v"].map(CompactString::from).into();
        assert_eq!(placement.asked(), [("v".to_owned(), all)], "every member asked at once");

        // The lens keeps what the members' nodes answered: only those they
        // left to the relations here are asked again.
        let again = snapshot(&context, &request(Some("v")), &mut lens).await.unwrap();
        assert_eq!(shown(&again), shown(&first));
        let left_here: Vec<CompactString> = ["a", "v"].map(CompactString::from).into();
        assert_eq!(placement.asked()[1..], [("v".to_owned(), left_here)]);

        // A service acting for no viewer sees every member and asks no node.
        let mut lens = MemberLens::new(&request(None));
        let service = snapshot(&context, &request(None), &mut lens).await.unwrap();
        assert_eq!(shown(&service), (vec!["a", "b", "c", "v"], vec!["a", "b", "c", "v"], 4));
        assert_eq!(placement.asked().len(), 2);
    }

    #[tokio::test]
    async fn r4_a_viewers_room_read_fails_naming_a_members_node_that_does_not_answer() {
        let placement =
            Arc::new(ToldPlacement::default().owned_elsewhere("b", "node-b", "10.0.0.2:7000").unreachable("node-b"));
        let (context, _) = room_of_four(&placement);
        let mut lens = MemberLens::new(&request(Some("v")));
        let refused = snapshot(&context, &request(Some("v")), &mut lens).await.unwrap_err();
        assert!(matches!(&refused, ServiceError::RoomOwnerUnreachable { node } if node == "node-b"), "{refused:?}");
        let mut lens = MemberLens::new(&request(None));
        assert_eq!(snapshot(&context, &request(None), &mut lens).await.unwrap().members.len(), 4);
    }

    #[tokio::test]
    async fn r4_a_viewers_room_watch_shows_changes_of_other_nodes_members_as_their_nodes_answer() {
        let placement = Arc::new(
            ToldPlacement::default()
                .owned_elsewhere("b", "node-b", "10.0.0.2:7000")
                .owned_elsewhere("c", "node-c", "10.0.0.3:7000")
                .owned_elsewhere("d", "node-b", "10.0.0.2:7000")
                .shows("v", "b", true)
                .shows("v", "c", false)
                .shows("v", "d", true),
        );
        let (context, generations) = room_of_four(&placement);
        let context = Arc::new(context);
        let mut events = watch(Arc::clone(&context), request(Some("v")), None).await.unwrap().into_inner();
        let next = async |events: &mut mpsc::Receiver<Result<pb::RoomEvent, Status>>| {
            let event = tokio::time::timeout(Duration::from_secs(5), events.recv()).await.expect("an event in time");
            event.expect("the stream is open").expect("not an error").event.expect("an event")
        };
        assert!(matches!(next(&mut events).await, room_event::Event::Snapshot(_)));
        assert_eq!(placement.asked().len(), 1, "the snapshot asked for every member");

        // d joins, then c and b change: c is hidden by its node, and only d,
        // not asked yet, is asked about.
        join(&context, "d", "one", None);
        join(&context, "c", "two", Some(generations["c"]));
        join(&context, "b", "two", Some(generations["b"]));
        let mut shown = Vec::new();
        while shown.last().is_none_or(|(user, _)| user != "b") {
            let room_event::Event::Change(change) = next(&mut events).await else { continue };
            let member = change.member.expect("a member");
            shown.push((member.user_id, pb::RoomChangeKind::try_from(change.kind).unwrap()));
        }
        let joined = pb::RoomChangeKind::RoomChangeJoined;
        assert_eq!(shown, [("d".to_owned(), joined), ("b".to_owned(), pb::RoomChangeKind::RoomChangeUpdated)]);
        let later: Vec<CompactString> = placement.asked()[1..].iter().flat_map(|(_, users)| users.clone()).collect();
        assert_eq!(later, [CompactString::from("d")]);
    }
}
