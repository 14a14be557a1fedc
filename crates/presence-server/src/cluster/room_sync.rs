//! Rooms across nodes (C1, R5): every room lives at the node that owns its
//! room id's slot, whoever owns its members.
//!
//! A cluster node's store hands its users' room facts out, stamped (see
//! `presence_core::room_intake`). The router here marks the member facts of
//! users this node holds invisible (the owner's counts leave them out, R4)
//! and sends each fact to the owner of its room's slot: facts for this
//! node's own rooms are taken in at once, the others queue per destination
//! node and go in the order they were made, one call at a time (carrying
//! whatever queued up meanwhile). Join, Leave and Signal wait for the owner's
//! answer, which carries the room version they answer with. The owner takes
//! facts in by stamp, so a user that moves between nodes never goes back.
//!
//! Facts can be lost on the way (a node down or cut off, a queue that
//! overflowed, a node that restarted). A destination that may have missed
//! some is sent a scan before anything else: where this node's users stand in
//! the rooms it owns, from which the owner mends what it missed.
//!
//! A node that starts owning room slots (a move, a takeover, the cluster's
//! first map) rebuilds their rooms before it answers for them: it asks every
//! other node for a scan of those slots ([`rebuild_rooms`]), and each node
//! asked sends its later facts of those rooms to it from then on, even
//! before its own map shows the new owner. A node that stops owning room
//! slots forgets their rooms and ends their watchers, which open again
//! through any node at the new owner.
//!
//! Privacy stays where each user's relations are: the owner asks a member's
//! node which members a viewer may see ([`may_view`]), and a change of a
//! member's relations is sent to the owners of its rooms, whose viewers'
//! watches start over. A room's access is set by its owner and kept at every
//! node ([`send_access_to_the_others`]), so that its next owner has it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;
use presence_cluster::SlotMap;
use presence_core::{CompactString, ScanTakenFor, SlotSet, StampedRoomFact, Store, slot_of};
use presence_proto::v1 as pb;
use tokio::sync::{mpsc, oneshot};

use crate::cluster::ClusterNode;
use crate::cluster::forward::{FORWARD_TIMEOUT, call_peer, with_credential};
use crate::cluster::membership::Membership;
use crate::cluster::wire as cluster_wire;
use crate::error::ServiceError;
use crate::node::context::Context;
use crate::node::privacy::Privacy;
use crate::node::publish::{RoomAnswer, RoomFactSink, RoomVersions};
use crate::node::wire;

/// Batches of facts made and not yet routed; past it, facts are dropped and
/// every destination is sent a scan instead.
const ROUTER_QUEUE: usize = 4_096;

/// Batches queued for one destination.
const DESTINATION_QUEUE: usize = 1_024;

/// Most queued batches one call to a destination carries.
const COALESCED: usize = 256;

/// How often a destination that needs a scan and has no facts coming is tried.
const SCAN_RETRY: Duration = Duration::from_secs(1);

/// One operation's facts, and where to tell their owners' answer; or rooms
/// whose viewers' watches are to start over, a member's relations having
/// changed here (P4).
#[derive(Debug)]
pub(crate) struct FactBatch {
    facts: Vec<StampedRoomFact>,
    relations_changed: Vec<CompactString>,
    answer: Option<oneshot::Sender<RoomAnswer>>,
}

/// The store's side of the router: where the publisher puts facts.
#[derive(Debug)]
pub(crate) struct RoomFactQueue {
    sender: mpsc::Sender<FactBatch>,
    /// Set when facts were dropped for want of room: every destination then
    /// needs a scan.
    overflowed: AtomicBool,
}

impl RoomFactSink for RoomFactQueue {
    /// Queues an operation's facts; `answer` hears from their owners. A full
    /// queue drops them (the answer hears so) and has every owner sent a scan.
    fn send(&self, facts: Vec<StampedRoomFact>, answer: Option<oneshot::Sender<RoomAnswer>>) {
        self.queue(FactBatch { facts, relations_changed: Vec::new(), answer });
    }

    /// Tells the owners of `rooms` that a member's relations changed here
    /// (P4): their viewers' watches start over. Dropped with a full queue,
    /// as facts are.
    fn send_relations_changed(&self, rooms: Vec<CompactString>) {
        if !rooms.is_empty() {
            self.queue(FactBatch { facts: Vec::new(), relations_changed: rooms, answer: None });
        }
    }
}

impl RoomFactQueue {
    fn queue(&self, batch: FactBatch) {
        if let Err(mpsc::error::TrySendError::Full(batch) | mpsc::error::TrySendError::Closed(batch)) =
            self.sender.try_send(batch)
        {
            self.overflowed.store(true, Ordering::Release);
            metrics::counter!(crate::metrics::names::ROOM_FACTS_DROPPED).increment(batch.facts.len() as u64);
            if let Some(answer) = batch.answer {
                let _ = answer.send(Err("any, this node's queue of room facts being full".into()));
            }
        }
    }
}

/// Where this node sends the facts of each room slot, and which of its own
/// room slots are being rebuilt.
#[derive(Debug, Default)]
pub(crate) struct RoomRoutes {
    /// Slots a node said it owns from an epoch on (in a RoomScan) that this
    /// node's map may not show yet.
    claimed: Mutex<HashMap<u32, (String, i64)>>,
    /// This node's room slots whose rooms are not rebuilt yet: their reads wait.
    rebuilding: Mutex<HashSet<u32>>,
}

impl RoomRoutes {
    /// The node that owns `slot`: the map's owner, unless a node claimed it
    /// from a later epoch.
    pub(crate) fn owner(&self, map: &SlotMap, slot: u32) -> Option<String> {
        let owner = map.owner(slot);
        let mut claimed = self.claimed.lock();
        match (claimed.get(&slot), owner) {
            (Some((node, epoch)), Some(owner)) if *epoch > owner.epoch => Some(node.clone()),
            (Some((node, _)), None) => Some(node.clone()),
            (Some(_), Some(owner)) => {
                claimed.remove(&slot);
                Some(owner.node.clone())
            }
            (None, owner) => owner.map(|owner| owner.node.clone()),
        }
    }

    fn claim(&self, slots: &SlotSet, node: &str, epoch: i64) {
        let mut claimed = self.claimed.lock();
        for slot in slots.iter() {
            claimed.insert(slot, (node.to_owned(), epoch));
        }
    }

    /// How many of this node's room slots are being rebuilt (D2: not ready meanwhile).
    pub(crate) fn rebuilding_slots(&self) -> usize {
        self.rebuilding.lock().len()
    }

    /// Whether `slot`'s rooms are being rebuilt here.
    pub(crate) fn is_rebuilding(&self, slot: u32) -> bool {
        self.rebuilding.lock().contains(&slot)
    }
}

/// Starts routing the store's room facts (a cluster node): returns the
/// queue the publisher feeds, and runs the router until the server stops.
pub(crate) fn start(context: &Arc<Context>, cluster: &Arc<ClusterNode>) -> Arc<RoomFactQueue> {
    let (sender, receiver) = mpsc::channel(ROUTER_QUEUE);
    let queue = Arc::new(RoomFactQueue { sender, overflowed: AtomicBool::new(false) });
    tokio::spawn(route(Arc::clone(context), Arc::clone(cluster), Arc::clone(&queue), receiver));
    queue
}

/// What goes to one destination in one call: facts, or rooms whose
/// viewers' watches start over, and where the owner's answer goes.
struct Outgoing {
    facts: Vec<StampedRoomFact>,
    relations_changed: Vec<CompactString>,
    answer: Option<oneshot::Sender<RoomAnswer>>,
}

/// One destination's queue, and whether it needs a scan before more facts.
struct Destination {
    sender: mpsc::Sender<Outgoing>,
    needs_scan: Arc<AtomicBool>,
}

async fn route(
    context: Arc<Context>,
    cluster: Arc<ClusterNode>,
    queue: Arc<RoomFactQueue>,
    mut batches: mpsc::Receiver<FactBatch>,
) {
    let membership = &cluster.membership;
    // Every owner hears from this node at once, with a scan: it may hold
    // users (restored from its data directory) that the owners never had.
    let mut destinations: HashMap<String, Destination> = HashMap::new();
    let map = membership.acted_map();
    for slot in 0..membership.slot_count() {
        if let Some(owner) = map.owner(slot).filter(|owner| owner.node != membership.node()) {
            destinations
                .entry(owner.node.clone())
                .or_insert_with(|| open_destination(&context, &cluster, owner.node.clone()));
        }
    }
    loop {
        let batch = tokio::select! {
            batch = batches.recv() => match batch { Some(batch) => batch, None => return },
            () = context.stopping.cancelled() => return,
        };
        if queue.overflowed.swap(false, Ordering::AcqRel) {
            destinations.values().for_each(|destination| destination.needs_scan.store(true, Ordering::Release));
        }
        let mut facts = batch.facts;
        mark_invisible(&context, &mut facts);
        let map = membership.acted_map();
        let owner_of =
            |room_id: &str| cluster.room_routes.owner(&map, slot_of(room_id.as_bytes(), membership.slot_count()));
        let mut by_owner: HashMap<String, Outgoing> = HashMap::new();
        let outgoing = || Outgoing { facts: Vec::new(), relations_changed: Vec::new(), answer: None };
        for fact in facts {
            match owner_of(fact.fact.room_id()) {
                Some(owner) => by_owner.entry(owner).or_insert_with(outgoing).facts.push(fact),
                // No owner yet (a new cluster): its first owner rebuilds from scans.
                None => metrics::counter!(crate::metrics::names::ROOM_FACTS_DROPPED).increment(1),
            }
        }
        for room_id in batch.relations_changed {
            if let Some(owner) = owner_of(&room_id) {
                by_owner.entry(owner).or_insert_with(outgoing).relations_changed.push(room_id);
            }
        }
        let mut parts = Vec::new();
        for (owner, mut sent) in by_owner {
            if owner == membership.node() {
                context.rooms().relations_changed(&sent.relations_changed, &[]);
                let rooms: Vec<CompactString> = sent.facts.iter().map(|fact| fact.fact.room_id().clone()).collect();
                let node = membership.node().to_owned();
                let facts = sent.facts;
                let versions =
                    context.apply(|store, now, changes| store.take_in_room_facts(now, &node, facts, changes));
                parts.push(Part::Done(Ok(rooms.into_iter().zip(versions).collect())));
                continue;
            }
            let destination = destinations
                .entry(owner.clone())
                .or_insert_with(|| open_destination(&context, &cluster, owner.clone()));
            if destination.sender.is_closed() {
                *destination = open_destination(&context, &cluster, owner.clone());
            }
            let (answer, answered) = oneshot::channel();
            sent.answer = Some(answer);
            match destination.sender.try_send(sent) {
                Ok(()) => parts.push(Part::Pending(owner, answered)),
                Err(_) => {
                    destination.needs_scan.store(true, Ordering::Release);
                    parts.push(Part::Done(Err(owner)));
                }
            }
        }
        if let Some(answer) = batch.answer {
            tokio::spawn(async move {
                let _ = answer.send(gather(parts).await);
            });
        }
    }
}

/// One owner's share of a batch.
enum Part {
    Done(RoomAnswer),
    Pending(String, oneshot::Receiver<RoomAnswer>),
}

/// The owners' answers to one batch, as one.
async fn gather(parts: Vec<Part>) -> RoomAnswer {
    let mut versions = RoomVersions::new();
    for part in parts {
        let answered = match part {
            Part::Done(answered) => answered?,
            Part::Pending(owner, answered) => answered.await.map_err(|_| owner)??,
        };
        for (room, version) in answered {
            let at = versions.entry(room).or_default();
            *at = (*at).max(version);
        }
    }
    Ok(versions)
}

/// Opens the queue to `node`, whose sender starts with a scan: this node may
/// hold users whose facts `node` never had (it restarted, or was away).
fn open_destination(context: &Arc<Context>, cluster: &Arc<ClusterNode>, node: String) -> Destination {
    let (sender, receiver) = mpsc::channel(DESTINATION_QUEUE);
    let needs_scan = Arc::new(AtomicBool::new(true));
    tokio::spawn(send_to(Arc::clone(context), Arc::clone(cluster), node, receiver, Arc::clone(&needs_scan)));
    Destination { sender, needs_scan }
}

/// Sends one destination its facts, in order, each batch once its scan is in.
async fn send_to(
    context: Arc<Context>,
    cluster: Arc<ClusterNode>,
    node: String,
    mut batches: mpsc::Receiver<Outgoing>,
    needs_scan: Arc<AtomicBool>,
) {
    let membership = &cluster.membership;
    loop {
        let next = tokio::select! {
            next = batches.recv() => match next { Some(next) => Some(next), None => return },
            () = tokio::time::sleep(SCAN_RETRY), if needs_scan.load(Ordering::Acquire) => None,
            () = context.stopping.cancelled() => return,
        };
        if needs_scan.load(Ordering::Acquire) {
            match send_scan(&context, &cluster, &node).await {
                Ok(()) => needs_scan.store(false, Ordering::Release),
                Err(err) => tracing::debug!(node, %err, "no room scan to this node yet"),
            }
        }
        let Some(first) = next else { continue };
        // What queued up meanwhile goes in the same call, in order.
        let mut sending = vec![first];
        while sending.len() < COALESCED
            && let Ok(more) = batches.try_recv()
        {
            sending.push(more);
        }
        let mut message = cluster_wire::room_facts_message(membership.node(), &[]);
        let mut answers = Vec::with_capacity(sending.len());
        for Outgoing { facts, relations_changed, answer } in sending {
            let rooms: Vec<CompactString> = facts.iter().map(|fact| fact.fact.room_id().clone()).collect();
            message.facts.extend(facts.iter().map(cluster_wire::room_fact_message));
            message.relations_changed.extend(relations_changed.iter().map(ToString::to_string));
            answers.push((rooms, answer));
        }
        let answered = send_facts(membership, &node, message).await;
        if let Err(err) = &answered {
            tracing::debug!(node, %err, "room facts not taken; the node gets a scan");
            needs_scan.store(true, Ordering::Release);
        }
        let mut versions = answered.map(Vec::into_iter);
        for (rooms, answer) in answers {
            let told = match &mut versions {
                Ok(versions) => Ok(rooms.into_iter().zip(versions.by_ref()).collect()),
                Err(_) => Err(node.clone()),
            };
            if let Some(answer) = answer {
                let _ = answer.send(told);
            }
        }
    }
}

async fn send_facts(membership: &Membership, node: &str, facts: pb::RoomFacts) -> Result<Vec<u64>, ServiceError> {
    let address = membership.nodes().address(node).map(str::to_owned);
    let address = address.ok_or_else(|| ServiceError::RoomOwnerUnreachable { node: node.to_owned() })?;
    let mut client = membership.cluster_client(&address)?;
    let request = with_credential(facts, membership.peer_token());
    Ok(call_peer(node, FORWARD_TIMEOUT, client.take_room_facts(request)).await?.versions)
}

/// The room's version at its owner: what a Join, Leave or Signal that made
/// no fact answers (`Placement::room_version`).
pub(crate) async fn room_version(
    store: &Store,
    cluster: &ClusterNode,
    room_id: &str,
) -> Result<Option<u64>, ServiceError> {
    let membership = &cluster.membership;
    let owner =
        cluster.room_routes.owner(&membership.acted_map(), slot_of(room_id.as_bytes(), membership.slot_count()));
    let Some(owner) = owner else { return Err(ServiceError::RoomOwnerUnreachable { node: "none yet".into() }) };
    if owner == membership.node() {
        return Ok(Some(store.room_tally(room_id).0));
    }
    let address = membership.nodes().address(&owner).map(str::to_owned);
    let address = address.ok_or_else(|| ServiceError::RoomOwnerUnreachable { node: owner.clone() })?;
    let mut client = membership.cluster_client(&address)?;
    let asked = pb::RoomFacts {
        from_node: membership.node().to_owned(),
        versions_of: vec![room_id.to_owned()],
        ..Default::default()
    };
    let answer =
        call_peer(&owner, FORWARD_TIMEOUT, client.take_room_facts(with_credential(asked, membership.peer_token())));
    Ok(answer.await?.room_versions.first().copied())
}

/// Sends `node` where this node's users stand in the rooms it owns.
async fn send_scan(context: &Arc<Context>, cluster: &ClusterNode, node: &str) -> Result<(), ServiceError> {
    let membership = &cluster.membership;
    let map = membership.acted_map();
    let mut slots = SlotSet::new(membership.slot_count());
    for slot in 0..membership.slot_count() {
        if cluster.room_routes.owner(&map, slot).as_deref() == Some(node) {
            slots.insert(slot);
        }
    }
    if slots.is_empty() {
        // It owns no room now: nothing to mend there.
        return Ok(());
    }
    let message = scan_message(context, membership, &slots).await?;
    send_facts(membership, node, message).await.map(drop)
}

/// Marks the member facts of users this node holds invisible (R4): the
/// rooms' owners count them for nobody.
fn mark_invisible(context: &Context, facts: &mut [StampedRoomFact]) {
    for fact in facts.iter_mut().filter(|fact| matches!(fact.fact, presence_core::RoomFact::Member { .. })) {
        fact.invisible = context.privacy.is_invisible(fact.fact.user_id());
    }
}

/// A scan of this node's users in the rooms of `slots`, made off the
/// runtime's threads, its member facts marked as [`mark_invisible`] does.
async fn scan_of(context: &Arc<Context>, slots: &SlotSet) -> Result<presence_core::RoomFactScan, ServiceError> {
    let (store, now, slots) = (Arc::clone(context.store()), context.now(), slots.clone());
    let scanned = tokio::task::spawn_blocking(move || {
        store.room_facts_held(now, &|_| true, &|room_id| slots.holds(room_id.as_bytes()))
    });
    let mut scan = scanned.await.map_err(|_| ServiceError::Internal("a room scan did not finish".into()))?;
    mark_invisible(context, &mut scan.facts);
    Ok(scan)
}

/// [`scan_of`] as sent to another node, with the rooms' access.
async fn scan_message(
    context: &Arc<Context>,
    membership: &Membership,
    slots: &SlotSet,
) -> Result<pb::RoomFacts, ServiceError> {
    let scan = scan_of(context, slots).await?;
    let mut message = cluster_wire::room_scan_message(membership.node(), &scan, slots);
    let accesses = context.store().room_accesses(&|room_id| slots.holds(room_id.as_bytes()));
    message.access = cluster_wire::room_access_entries(&accesses);
    message.room_clock = context.store().room_clock();
    Ok(message)
}

/// Where a room request is answered (C1): here, or at the room slot's
/// owner's address. A request forwarded here already is not sent on.
pub(crate) enum RoomPlace {
    Here,
    At(String),
}

/// Where a room read for `room_id` is answered, on a cluster node.
pub(crate) fn place_of(cluster: &ClusterNode, room_id: &str, forwarded: bool) -> Result<RoomPlace, ServiceError> {
    let membership = &cluster.membership;
    let slot = slot_of(room_id.as_bytes(), membership.slot_count());
    let owner = cluster.room_routes.owner(&membership.acted_map(), slot);
    let not_here = || ServiceError::RoomsNotHere { room_id: room_id.to_owned() };
    match owner {
        Some(owner) if owner == membership.node() => {
            if !membership.acting_now() {
                return Err(not_here());
            }
            if cluster.room_routes.is_rebuilding(slot) {
                return Err(ServiceError::RoomRebuilding { room_id: room_id.to_owned() });
            }
            Ok(RoomPlace::Here)
        }
        Some(owner) if !forwarded => {
            membership.nodes().address(&owner).map(|address| RoomPlace::At(address.to_owned())).ok_or_else(not_here)
        }
        _ => Err(not_here()),
    }
}

/// Takes in facts a node sent (TakeRoomFacts): a batch for rooms this node
/// owns, or a scan of the rooms of some of its slots.
pub(crate) fn take_in(
    context: &Context,
    membership: &Membership,
    sent: pb::RoomFacts,
) -> Result<pb::RoomFactsTaken, ServiceError> {
    let from = wire::id("from_node", &sent.from_node)?;
    let map = membership.acted_map();
    let owned = |room_id: &str| {
        membership.acting_now() && membership.owns(&map, slot_of(room_id.as_bytes(), membership.slot_count()))
    };
    if sent.scan {
        let slots = crate::cluster::membership::slot_set(membership, &sent.slots, sent.slot_count)?;
        let scan = presence_core::RoomFactScan {
            facts: cluster_wire::room_facts(sent.facts)?,
            shard_stamps: sent.shard_stamps,
        };
        let rooms = |room_id: &str| slots.holds(room_id.as_bytes()) && owned(room_id);
        context.apply(|store, now, changes| {
            store.take_in_room_scan(now, &from, &rooms, scan, ScanTakenFor::Mending, changes)
        });
        return Ok(pb::RoomFactsTaken::default());
    }
    let mut room_versions = Vec::with_capacity(sent.versions_of.len());
    for room_id in &sent.versions_of {
        let room_id = wire::id("versions_of", room_id)?;
        if !owned(&room_id) {
            return Err(ServiceError::RoomsNotHere { room_id: room_id.to_string() });
        }
        room_versions.push(context.store().room_tally(&room_id).0);
    }
    let facts = cluster_wire::room_facts(sent.facts)?;
    if let Some(fact) = facts.iter().find(|fact| !owned(fact.fact.room_id())) {
        return Err(ServiceError::RoomsNotHere { room_id: fact.fact.room_id().to_string() });
    }
    let relations_changed: Vec<CompactString> = sent
        .relations_changed
        .iter()
        .map(|room_id| wire::id("relations_changed", room_id))
        .collect::<Result<_, _>>()?;
    let touched: Vec<CompactString> = facts.iter().map(|fact| fact.fact.room_id().clone()).collect();
    let versions = context.apply(|store, now, changes| store.take_in_room_facts(now, &from, facts, changes));
    // A fact may change who is counted without a change to publish (a member
    // its node now holds invisible, R4): count streams read the room again.
    touched.iter().for_each(|room_id| context.rooms().counts.touch(room_id));
    context.rooms().relations_changed(&relations_changed, &[]);
    Ok(pb::RoomFactsTaken { versions, room_versions })
}

/// Answers a RoomScan: from now on the facts of `slots` go to the node that
/// asked, and here is where this node's users stand in their rooms.
pub(crate) async fn scan_for(
    context: &Arc<Context>,
    cluster: &ClusterNode,
    request: pb::RoomScanRequest,
) -> Result<pb::RoomFacts, ServiceError> {
    let membership = &cluster.membership;
    let from = wire::id("from_node", &request.from_node)?;
    let slots = crate::cluster::membership::slot_set(membership, &request.slots, request.slot_count)?;
    cluster.room_routes.claim(&slots, &from, request.epoch);
    // The users this node took over in the map change that gave the asker
    // its slots are here once this node acts on that map: wait for it, a
    // while at most (a node cut off from etcd answers with what it has).
    let mut maps = membership.acted_changes();
    let caught_up = tokio::time::timeout(FORWARD_TIMEOUT / 2, async {
        while maps.borrow_and_update().revision() < request.epoch {
            if maps.changed().await.is_err() {
                return;
            }
        }
    });
    let _ = caught_up.await;
    scan_message(context, membership, &slots).await
}

/// Keeps this node's rooms those of the room slots it owns, for as long as
/// it serves: rooms of slots it gains are rebuilt from every node's scan
/// before they are answered for, rooms of slots it loses are forgotten and
/// their watchers ended.
pub(crate) async fn rebuild_rooms(context: Arc<Context>, cluster: Arc<ClusterNode>) {
    let membership = &cluster.membership;
    let mut maps = membership.acted_changes();
    let mut owned = SlotSet::new(membership.slot_count());
    loop {
        let map = maps.borrow_and_update().clone();
        let mut now_owned = SlotSet::new(membership.slot_count());
        map.owned_by(membership.node()).for_each(|slot| now_owned.insert(slot));
        let lost: SlotSet = difference(&owned, &now_owned);
        let gained: SlotSet = difference(&now_owned, &owned);
        if !lost.is_empty() {
            let rooms = |room_id: &str| lost.holds(room_id.as_bytes());
            context.store().forget_rooms(&rooms);
            context.rooms().end_rooms(&rooms);
        }
        if !gained.is_empty() {
            rebuild(&context, &cluster, &map, &gained).await;
        }
        owned = now_owned;
        tokio::select! {
            changed = maps.changed() => if changed.is_err() { return },
            () = context.stopping.cancelled() => return,
        }
    }
}

fn difference(from: &SlotSet, taking: &SlotSet) -> SlotSet {
    let mut left = from.clone();
    taking.iter().for_each(|slot| left.remove(slot));
    left
}

/// Rebuilds the rooms of `slots`, newly this node's: each other live node's
/// scan, then this node's own users'; their reads wait meanwhile.
async fn rebuild(context: &Arc<Context>, cluster: &Arc<ClusterNode>, map: &SlotMap, slots: &SlotSet) {
    let membership = &cluster.membership;
    {
        let mut rebuilding = cluster.room_routes.rebuilding.lock();
        rebuilding.extend(slots.iter());
    }
    let epoch = slots.iter().filter_map(|slot| map.owner(slot).map(|owner| owner.epoch)).max().unwrap_or(0);
    let request = pb::RoomScanRequest {
        from_node: membership.node().to_owned(),
        slots: slots.iter().collect(),
        slot_count: membership.slot_count(),
        epoch,
    };
    let asking = membership.others().into_iter().map(|(node, _)| {
        let request = request.clone();
        async move {
            let scanned = scan_at(context, membership, &node, request.clone()).await;
            (node, request, scanned)
        }
    });
    let mut asked = 0;
    for (node, request, scanned) in futures_util::future::join_all(asking).await {
        match scanned {
            Ok(()) => asked += 1,
            Err(err) => {
                // Asked again, aside: the rooms answer meanwhile without that node's members.
                tracing::warn!(node, %err, "no room scan from this node for the slots this node gained yet");
                tokio::spawn(scan_later(Arc::clone(context), Arc::clone(cluster), node, request));
            }
        }
    }
    if let Ok(own) = scan_of(context, slots).await {
        let node = membership.node().to_owned();
        let rooms = |room_id: &str| slots.holds(room_id.as_bytes());
        context.apply(|store, now, changes| {
            store.take_in_room_scan(now, &node, &rooms, own, ScanTakenFor::Rebuilding, changes)
        });
    }
    let mut rebuilding = cluster.room_routes.rebuilding.lock();
    slots.iter().for_each(|slot| {
        rebuilding.remove(&slot);
    });
    drop(rebuilding);
    tracing::info!(slots = slots.iter().count(), nodes = asked, "rebuilt the rooms of the slots this node gained");
}

/// Asks `node` for a scan of the slots `request` names, and takes it in.
async fn scan_at(
    context: &Context,
    membership: &Membership,
    node: &str,
    request: pb::RoomScanRequest,
) -> Result<(), ServiceError> {
    let address = membership.nodes().address(node).map(str::to_owned);
    let address = address.ok_or_else(|| ServiceError::RoomOwnerUnreachable { node: node.to_owned() })?;
    let mut client = membership.cluster_client(&address)?;
    let request = with_credential(request, membership.peer_token());
    let scan = call_peer(node, FORWARD_TIMEOUT, client.room_scan(request)).await?;
    // Versions here go on above every one the node issued: the rooms' old
    // owner, when it is alive to answer, among them (M4).
    context.store().raise_room_clocks(scan.room_clock);
    take_access(context, &cluster_wire::room_access_entries_sent(scan.access)?, false);
    let slots = crate::cluster::membership::slot_set(membership, &scan.slots, scan.slot_count)?;
    let scan =
        presence_core::RoomFactScan { facts: cluster_wire::room_facts(scan.facts)?, shard_stamps: scan.shard_stamps };
    let rooms = |room_id: &str| slots.holds(room_id.as_bytes());
    context.apply(|store, now, changes| {
        store.take_in_room_scan(now, node, &rooms, scan, ScanTakenFor::Rebuilding, changes)
    });
    Ok(())
}

/// How many times a node that did not answer a rebuild's scan is asked again, a second apart.
const SCAN_TRIES: u32 = 30;

/// Asks `node` again for the scan a rebuild did not get, while it is one of
/// the cluster and this node still owns those slots.
async fn scan_later(context: Arc<Context>, cluster: Arc<ClusterNode>, node: String, request: pb::RoomScanRequest) {
    let membership = &cluster.membership;
    for _ in 0..SCAN_TRIES {
        tokio::select! {
            () = tokio::time::sleep(SCAN_RETRY) => {}
            () = context.stopping.cancelled() => return,
        }
        let map = membership.acted_map();
        let still_ours = request.slots.iter().all(|&slot| membership.owns(&map, slot));
        if !still_ours || membership.nodes().address(&node).is_none() {
            return;
        }
        match scan_at(&context, membership, &node, request.clone()).await {
            Ok(()) => return tracing::info!(node, "took in a node's room scan asked again"),
            Err(err) => tracing::debug!(node, %err, "no room scan from this node yet"),
        }
    }
}

/// How long a node that sent room facts is gone (not registered, owning no
/// slot) before the members it last spoke for are taken to have left.
const GONE_FOR: Duration = Duration::from_secs(10);

/// Takes the members that only a node gone from the cluster spoke for to have
/// left, once it is gone for [`GONE_FOR`]: its users that live on were taken
/// over by other nodes meanwhile, whose facts speak for them now, and what
/// is left is users it registered after its follower's last copy, gone
/// with it.
pub(crate) async fn forget_gone_nodes(context: Arc<Context>, cluster: Arc<ClusterNode>) {
    let membership = &cluster.membership;
    let mut gone_since: HashMap<CompactString, Instant> = HashMap::new();
    loop {
        tokio::select! {
            () = tokio::time::sleep(GONE_FOR / 4) => {}
            () = context.stopping.cancelled() => return,
        }
        let (nodes, map) = (membership.nodes().ids(), membership.acted_map());
        let sources = context.store().room_fact_sources();
        gone_since.retain(|source, _| sources.contains(source));
        for source in sources {
            let gone = source != membership.node()
                && !nodes.iter().any(|node| *node == source)
                && map.owned_by(&source).next().is_none();
            if !gone {
                gone_since.remove(&source);
                continue;
            }
            let since = *gone_since.entry(source.clone()).or_insert_with(Instant::now);
            if since.elapsed() >= GONE_FOR {
                tracing::info!(node = %source, "members a gone node last spoke for have left its rooms");
                context.apply(|store, now, changes| store.forget_room_fact_source(now, &source, changes));
                gone_since.remove(&source);
            }
        }
    }
}

/// Which of `users` `viewer` may see (R4), each by its own node's relations:
/// this node's users here, the others' asked of their owners (MayView), all
/// at once. A user whose slot has no owner now is taken as hidden.
pub(crate) async fn may_view(
    privacy: &Privacy,
    cluster: &ClusterNode,
    viewer: &str,
    users: Vec<CompactString>,
) -> Result<HashMap<CompactString, bool>, ServiceError> {
    let here = |user: &CompactString| privacy.can_see(Some(viewer), user);
    let membership = &cluster.membership;
    let map = membership.acted_map();
    let mut seen = HashMap::new();
    let mut by_owner: HashMap<String, Vec<CompactString>> = HashMap::new();
    for user in users {
        match map.owner(slot_of(user.as_bytes(), membership.slot_count())) {
            Some(owner) if owner.node == membership.node() => {
                let visible = here(&user);
                seen.insert(user, visible);
            }
            Some(owner) => by_owner.entry(owner.node.clone()).or_default().push(user),
            None => {
                seen.insert(user, false);
            }
        }
    }
    let asked = by_owner.into_iter().map(|(node, users)| async move {
        let address = membership.nodes().address(&node).map(str::to_owned);
        let address = address.ok_or_else(|| ServiceError::RoomOwnerUnreachable { node: node.clone() })?;
        let mut client = membership.cluster_client(&address)?;
        let request = pb::MayViewRequest {
            viewer_id: viewer.to_owned(),
            user_ids: users.iter().map(ToString::to_string).collect(),
        };
        let request = with_credential(request, membership.peer_token());
        let visible = call_peer(&node, FORWARD_TIMEOUT, client.may_view(request)).await?.visible;
        if visible.len() != users.len() {
            return Err(ServiceError::Internal(format!("{node} answered MayView for the wrong number of users")));
        }
        Ok::<_, ServiceError>(users.into_iter().zip(visible).collect::<Vec<_>>())
    });
    for answer in futures_util::future::join_all(asked).await {
        seen.extend(answer?);
    }
    Ok(seen)
}

/// The counts of `rooms`, none held here, as `viewer` may read them (R7):
/// asked of each owner in one call, all owners at once; `None` for a room
/// whose owner is unknown, rebuilding it, unreachable, or no longer its
/// owner when asked.
pub(crate) async fn counts_elsewhere(
    cluster: &ClusterNode,
    viewer: Option<&str>,
    rooms: Vec<CompactString>,
) -> Vec<Option<pb::RoomCount>> {
    let membership = &cluster.membership;
    let map = membership.acted_map();
    let mut by_owner: HashMap<String, Vec<usize>> = HashMap::new();
    for (at, room_id) in rooms.iter().enumerate() {
        let slot = slot_of(room_id.as_bytes(), membership.slot_count());
        match cluster.room_routes.owner(&map, slot) {
            Some(owner) if owner != membership.node() => by_owner.entry(owner.to_string()).or_default().push(at),
            _ => {}
        }
    }
    let rooms = &rooms;
    let asked = by_owner.into_iter().map(|(node, at)| async move {
        let answered = async {
            let address = membership.nodes().address(&node).map(str::to_owned);
            let address = address.ok_or_else(|| ServiceError::RoomOwnerUnreachable { node: node.clone() })?;
            let mut client = membership.cluster_client(&address)?;
            let request = pb::OwnedRoomCountsRequest {
                room_ids: at.iter().map(|&at| rooms[at].to_string()).collect(),
                viewer_id: viewer.map(str::to_owned),
            };
            let request = with_credential(request, membership.peer_token());
            let counts = call_peer(&node, FORWARD_TIMEOUT, client.owned_room_counts(request)).await?.counts;
            if counts.len() != at.len() {
                return Err(ServiceError::Internal(format!("{node} answered OwnedRoomCounts for the wrong number of rooms")));
            }
            Ok::<_, ServiceError>(counts)
        };
        match answered.await {
            Ok(counts) => at.into_iter().zip(counts).collect(),
            Err(err) => {
                tracing::debug!(node = %node, error = %err, "room counts not answered; asked again at the next interval");
                Vec::new()
            }
        }
    });
    let mut answers = vec![None; rooms.len()];
    for (at, count) in futures_util::future::join_all(asked).await.into_iter().flatten() {
        // An empty room id: the node no longer owns the room.
        if count.room_id == rooms[at].as_str() {
            answers[at] = Some(count);
        }
    }
    answers
}

/// Answers an OwnedRoomCounts: the counts of the rooms this node answers for
/// now, as the viewer may read them; an empty count for the others.
pub(crate) fn answer_owned_room_counts(
    context: &Context,
    cluster: &ClusterNode,
    request: &pb::OwnedRoomCountsRequest,
) -> Result<Vec<pb::RoomCount>, ServiceError> {
    let rooms = wire::user_ids("room_ids", &request.room_ids)?;
    let viewer = request.viewer_id.as_deref().map(|viewer| wire::id("viewer_id", viewer)).transpose()?;
    Ok(rooms
        .iter()
        .map(|room_id| match place_of(cluster, room_id, true) {
            Ok(RoomPlace::Here) => crate::node::room_counts::count_here(context, viewer.as_deref(), room_id),
            _ => pb::RoomCount::default(),
        })
        .collect())
}

/// Answers a MayView: which of the users `viewer` may see by this node's relations.
pub(crate) fn answer_may_view(context: &Context, request: &pb::MayViewRequest) -> Result<Vec<bool>, ServiceError> {
    let viewer = wire::id("viewer_id", &request.viewer_id)?;
    let users = wire::user_ids("user_ids", &request.user_ids)?;
    Ok(users.iter().map(|user| context.privacy.can_see(Some(&viewer), user)).collect())
}

/// Takes in rooms' access as their owners set it; `serving`: this node may
/// serve those rooms, whose watchers then check whether they may still read.
pub(crate) fn take_access(
    context: &Context,
    entries: &[(CompactString, presence_core::RoomAccess, u64)],
    serving: bool,
) {
    for (room_id, access, stamp) in entries {
        if context.store().take_room_access(room_id, *access, *stamp) && serving {
            context.rooms().access_changed(room_id);
        }
    }
}

/// Sends a room's access, as this node, its owner, set it, to every other
/// node, all at once, before SetRoomAccess answers: the room's next owner
/// has it whichever node that is. A node that does not take it in time is
/// logged; it is sent the access again with the scans of a rebuild.
pub(crate) async fn send_access_to_the_others(
    membership: &Membership,
    entry: (CompactString, presence_core::RoomAccess, u64),
) {
    let entries = pb::RoomAccessEntries { entries: cluster_wire::room_access_entries(&[entry]) };
    let sent = membership.others().into_iter().map(|(node, address)| {
        let request = with_credential(entries.clone(), membership.peer_token());
        async move {
            let answered = async {
                let mut client = membership.cluster_client(&address)?;
                call_peer(&node, FORWARD_TIMEOUT, client.take_room_access(request)).await
            };
            answered.await.map_err(|err| (node, err))
        }
    });
    for answer in futures_util::future::join_all(sent).await {
        if let Err((node, err)) = answer {
            tracing::warn!(node, %err, "a node did not take a room's access; a rebuild at it will bring it");
        }
    }
}
