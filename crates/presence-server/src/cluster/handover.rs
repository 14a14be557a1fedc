//! Planned handover (C3): slots move to another node with their users' state.
//!
//! The node handing slots over (the source), for at most
//! [`MOVES_PER_TXN`] slots at a time:
//! 1. starts refusing the slots' requests, once every request that passed
//!    its ownership check before has written (the gates in `membership.rs`),
//!    and holds back their users' expiry;
//! 2. takes their state: a checkpoint of their users (leases with their
//!    generations and deadlines, versions, room memberships) and what each
//!    keeps beside it (status, visibility, audience);
//! 3. sends it to the node taking them (the target), which takes it into its
//!    store and answers;
//! 4. gives the slots to the target in etcd, by compare-and-swap on the
//!    epochs it owned them at;
//! 5. drops them.
//!
//! The target answers for the slots once its slot map shows them as its own.
//! A step that fails undoes the ones before: the target drops what it took,
//! the source answers again. Requests refused meanwhile name no owner, so
//! clients retry them after a short backoff, and reach the target once the
//! map moved: none is lost, and a gateway that keeps renewing sees no flip.
//!
//! Versions never go back across the move (M4): the target raises its stamp
//! clocks to the source's last stamp before it takes a user, so every
//! version and generation it issues is above any the source issued; and the
//! source publishes nothing for the slots' users after their state left
//! (their writes are refused, their expiry is held back, then they are
//! dropped without a word).

use std::sync::Arc;
use std::time::{Duration, Instant};

use presence_cluster::{MOVES_PER_TXN, move_slots as give_slots, repairs};
use presence_core::SlotSet;
use presence_proto::v1 as pb;
use tonic::Streaming;
use tonic::metadata::{Ascii, MetadataValue};

use crate::cluster::ClusterNode;
use crate::cluster::membership::{Membership, call_peer, checked_slots, slot_set, with_credential};
use crate::error::ServiceError;
use crate::node::context::Context;
use crate::node::feed::Carried;
use crate::node::privacy::HandedOver;
use crate::{cluster::wire as cluster_wire, node::user_data};

/// The state bytes one `SlotState` message carries: well under gRPC's 4 MiB.
const PIECE_BYTES: usize = 1 << 20;

/// The most state a node takes in one handover: far above the few hundred
/// bytes per session of a real one, low enough that a caller cannot make the
/// node hold much memory.
const MAX_HANDOVER_BYTES: usize = 1 << 30;

/// The most users with durable data in one handover.
const MAX_HANDOVER_DURABLE: usize = 10_000_000;

/// How long the target may take to answer a handover's state: a hundred
/// slots of a node with a million sessions are ten megabytes, taken in well
/// under a second; a node that does not answer must not hold up a drain.
const TAKE_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a target keeps state it took for slots the map does not give
/// it: the source gives them in etcd milliseconds after the target answered.
const CLAIM_WAIT: Duration = Duration::from_secs(10);

/// What a move came to.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Moved {
    pub(crate) epoch: i64,
    pub(crate) users: u64,
    pub(crate) sessions: u64,
    pub(crate) bytes: u64,
    pub(crate) elapsed: Duration,
}

/// Hands `slots` of this node over to `to_node` with their users' state (see
/// the module's description). `credential` is presented to `to_node`: the
/// caller's for `presenced cluster move`, this node's own for a drain.
pub(crate) async fn move_slots(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    slots: &[u32],
    to_node: &str,
    credential: Option<&MetadataValue<Ascii>>,
) -> Result<Moved, ServiceError> {
    let membership = &cluster.membership;
    let _one_at_a_time = membership.handing_over.lock().await;
    let started = Instant::now();
    let (address, slots) = check_move(membership, slots, to_node)?;
    let mut moved = Moved::default();
    // The slots' feed entries are read here, while the slots are still
    // answered: each round, once its slots are refused, reads only what
    // came since, so the feed adds little to the time they are refused.
    let moving = SlotSet::of(membership.slot_count(), slots.iter().copied());
    let mut carried = read_feed_ahead(context, Carried::of(moving)).await?;
    for chunk in slots.chunks(MOVES_PER_TXN) {
        let part = move_chunk(context, membership, chunk, to_node, &address, &mut carried, credential).await?;
        moved.epoch = part.epoch;
        moved.users += part.users;
        moved.sessions += part.sessions;
        moved.bytes += part.bytes;
    }
    moved.elapsed = started.elapsed();
    tracing::info!(
        slots = slots.len(),
        to_node,
        users = moved.users,
        sessions = moved.sessions,
        bytes = moved.bytes,
        elapsed_ms = moved.elapsed.as_millis() as u64,
        epoch = moved.epoch,
        "slots handed over"
    );
    Ok(moved)
}

/// The target's address and the slots, sorted, once the move is one this node can make.
fn check_move(membership: &Membership, slots: &[u32], to_node: &str) -> Result<(String, Vec<u32>), ServiceError> {
    let slots: Vec<u32> = checked_slots(membership.slot_count(), slots)?.iter().collect();
    if to_node.is_empty() {
        return Err(ServiceError::invalid("to_node", "name the node to hand the slots to"));
    }
    if to_node == membership.node() {
        return Err(ServiceError::invalid("to_node", "is this node, which owns the slots already"));
    }
    let nodes = membership.nodes();
    let Some(address) = nodes.address(to_node) else {
        return Err(ServiceError::MoveRefused(format!("node {to_node} is not a live node of the cluster")));
    };
    if !membership.etcd_answers() {
        return Err(ServiceError::MoveRefused(
            "etcd does not answer this node: no slot changes owner until it does".to_owned(),
        ));
    }
    if !membership.acting_now() {
        return Err(ServiceError::MoveRefused(
            "etcd has not confirmed this node's lease in time: it acts on no slot now, and moves none".to_owned(),
        ));
    }
    let map = membership.map();
    for &slot in &slots {
        match map.owner(slot) {
            _ if membership.owns(&map, slot) => {}
            Some(owner) => {
                return Err(ServiceError::MoveRefused(format!(
                    "slot {slot} is owned by node {}, not this one: ask it",
                    owner.node
                )));
            }
            None => return Err(ServiceError::MoveRefused(format!("slot {slot} has no owner yet"))),
        }
    }
    Ok((address.to_owned(), slots))
}

/// One round of a move, for at most [`MOVES_PER_TXN`] slots.
async fn move_chunk(
    context: &Arc<Context>,
    membership: &Membership,
    chunk: &[u32],
    to_node: &str,
    address: &str,
    carried: &mut Carried,
    credential: Option<&MetadataValue<Ascii>>,
) -> Result<Moved, ServiceError> {
    let set = SlotSet::of(membership.slot_count(), chunk.iter().copied());
    let store = context.store();
    store.pause_expiry(Some(membership.start_leaving(&set).await));
    // Every request checked before is written; every later one is refused.
    let map = membership.map();
    let seen: Vec<(u32, i64)> =
        chunk.iter().map(|&slot| (slot, map.owner(slot).map_or(0, |owner| owner.epoch))).collect();
    let mine = chunk.iter().all(|&slot| membership.owns(&map, slot));
    if !mine || !membership.acting_now() {
        answer_again(context, membership, &set);
        return Err(ServiceError::MoveAborted("the slot map changed as the move began; nothing moved".to_owned()));
    }
    let state = store.export_slots(&set, context.now());
    let durable = match user_data::in_slots(context, &set).await {
        Ok(durable) => durable,
        Err(error) => {
            answer_again(context, membership, &set);
            return Err(error);
        }
    };
    let feed = match feed_of(context, &set, carried).await {
        Ok(feed) => feed,
        Err(error) => {
            answer_again(context, membership, &set);
            return Err(error);
        }
    };
    let bytes = state.len() as u64;
    let taken = send_state(membership, address, &set, map.revision(), state, durable, feed, credential).await;
    let taken = match taken {
        Ok(taken) => taken,
        Err(refused) => {
            answer_again(context, membership, &set);
            return Err(refused);
        }
    };
    let epoch = match give_slots(&membership.etcd, &membership.prefix, &seen, to_node).await {
        Ok(Some(epoch)) => epoch,
        Ok(None) => {
            drop_at(membership, address, &set, credential).await;
            answer_again(context, membership, &set);
            return Err(ServiceError::MoveAborted(format!(
                "slots {chunk:?} changed in etcd during the move; they stayed here"
            )));
        }
        Err(error) => {
            // The transaction may have been made: the map says.
            match outcome(membership, &seen, to_node).await {
                Some(epoch) => epoch,
                None => {
                    drop_at(membership, address, &set, credential).await;
                    answer_again(context, membership, &set);
                    return Err(ServiceError::Etcd(format!(
                        "giving the slots to {to_node}: {error}; they stayed here"
                    )));
                }
            }
        }
    };
    // The slots stay refused here: this node's map may show them as its own
    // a little longer.
    let released = drop_here(context, &set, "slots handed over").await;
    tracing::debug!(slots = chunk.len(), released, epoch, "slots handed over and dropped here");
    Ok(Moved { epoch, users: taken.users, sessions: taken.sessions, bytes, elapsed: Duration::ZERO })
}

/// Drops the users of `set` here without publishing anything, with what
/// they keep on disk (their state lives at another node now: `why`);
/// returns how many users went.
pub(crate) async fn drop_here(context: &Context, set: &SlotSet, why: &str) -> usize {
    let users = context.store().release_slots(context.now(), set);
    if let Err(error) = user_data::release(context, set).await {
        tracing::warn!(%error, why, "slots dropped here, but their users' durable data could not be deleted");
    }
    users
}

/// Answers `set`'s requests again: a move of them failed, or they came back.
pub(crate) fn answer_again(context: &Context, membership: &Membership, set: &SlotSet) {
    let refused = membership.stop_leaving(set);
    context.store().pause_expiry((!refused.is_empty()).then_some(refused));
}

/// What a move carries of the change feed (F3): the slots' entries and the
/// last position the feed gave.
#[derive(Debug, Default)]
struct FeedPart {
    entries: Vec<presence_feed::Frame>,
    last_position: u64,
}

/// `carried` with what the feed holds of its slots now read into it.
async fn read_feed_ahead(context: &Context, mut carried: Carried) -> Result<Carried, ServiceError> {
    let Some(feed) = &context.feed else { return Ok(carried) };
    let reader = Arc::clone(feed);
    tokio::task::spawn_blocking(move || reader.read_for_move(&mut carried).map(|()| carried))
        .await
        .map_err(feed_read_failed)?
        .map_err(feed_read_failed)
}

fn feed_read_failed(err: impl std::fmt::Display) -> ServiceError {
    ServiceError::Internal(format!("reading the change feed for a move: {err}"))
}

/// The feed's entries of `set`, once everything recorded before the slots
/// were refused here is written (none of theirs comes after); read into
/// `carried`, which holds what earlier rounds of the move read.
async fn feed_of(context: &Context, set: &SlotSet, carried: &mut Carried) -> Result<FeedPart, ServiceError> {
    let Some(feed) = &context.feed else { return Ok(FeedPart::default()) };
    let last_position = feed.cursor_now().position;
    feed.written_through(last_position).await;
    // Only what came since the last read: little, read here.
    feed.read_for_move(carried).map_err(feed_read_failed)?;
    Ok(FeedPart { entries: carried.take(set), last_position })
}

/// Sends the state of `set`'s users to the node at `address`.
#[allow(clippy::too_many_arguments)]
async fn send_state(
    membership: &Membership,
    address: &str,
    set: &SlotSet,
    map_revision: i64,
    state: Vec<u8>,
    durable: Vec<HandedOver>,
    feed: FeedPart,
    credential: Option<&MetadataValue<Ascii>>,
) -> Result<pb::TakeSlotsResponse, ServiceError> {
    let mut pieces: Vec<pb::SlotState> = state
        .chunks(PIECE_BYTES)
        .map(|piece| pb::SlotState { state: piece.to_vec(), ..pb::SlotState::default() })
        .collect();
    pieces.extend(
        cluster_wire::handed_over_pieces(&durable, PIECE_BYTES)
            .into_iter()
            .map(|durable| pb::SlotState { durable, ..pb::SlotState::default() }),
    );
    pieces.extend(
        cluster_wire::feed_entry_pieces(&feed.entries, PIECE_BYTES)
            .into_iter()
            .map(|feed_entries| pb::SlotState { feed_entries, ..pb::SlotState::default() }),
    );
    if pieces.is_empty() {
        pieces.push(pb::SlotState::default());
    }
    let first = &mut pieces[0];
    first.from_node = membership.node().to_owned();
    first.slots = set.iter().collect();
    first.slot_count = membership.slot_count();
    first.map_revision = map_revision;
    first.feed_position = feed.last_position;
    // The next protocol minor's added field (D1's mixed-version roll).
    #[cfg(feature = "next-cluster-protocol")]
    {
        first.sender_version = env!("CARGO_PKG_VERSION").to_owned();
    }
    let request = with_credential(tokio_stream::iter(pieces), credential);
    let mut client = membership.cluster_client(address)?;
    call_peer(address, TAKE_TIMEOUT, client.take_slots(request)).await
}

/// Asks the node at `address` to drop what it took of `set` (best effort:
/// it drops it by itself once the map does not give it the slots).
async fn drop_at(membership: &Membership, address: &str, set: &SlotSet, credential: Option<&MetadataValue<Ascii>>) {
    let request =
        with_credential(pb::DropSlotsRequest { slots: set.iter().collect(), slot_count: set.slots() }, credential);
    let dropped = match membership.cluster_client(address) {
        Ok(mut client) => client.drop_slots(request).await.map(drop).map_err(|status| status.to_string()),
        Err(error) => Err(error.to_string()),
    };
    if let Err(error) = dropped {
        tracing::warn!(address, error, "could not ask the target to drop the state of a failed move");
    }
}

/// After etcd failed to answer the move's transaction: the epoch the map
/// shows the slots at under `to_node`, if it does within the lease's TTL.
async fn outcome(membership: &Membership, seen: &[(u32, i64)], to_node: &str) -> Option<i64> {
    let mut changes = membership.map_changes();
    let deadline = tokio::time::Instant::now() + membership.lease_ttl;
    loop {
        let map = membership.map();
        let given = seen.iter().map(|&(slot, _)| map.owner(slot)).collect::<Vec<_>>();
        if given.iter().all(|owner| owner.is_some_and(|owner| owner.node == to_node)) {
            return given.first().and_then(|owner| owner.map(|owner| owner.epoch));
        }
        if given.iter().zip(seen).any(|(owner, &(_, epoch))| owner.is_some_and(|owner| owner.epoch != epoch)) {
            return None;
        }
        if tokio::time::timeout_at(deadline, changes.changed()).await.is_err() {
            return None;
        }
    }
}

/// Takes the state of slots another node hands over: into the store, then
/// the durable data; answers how much it took.
pub(crate) async fn take_slots(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    mut pieces: Streaming<pb::SlotState>,
) -> Result<pb::TakeSlotsResponse, ServiceError> {
    let membership = &cluster.membership;
    let Some(first) =
        pieces.message().await.map_err(|status| ServiceError::Peer { node: "the source".into(), status })?
    else {
        return Err(ServiceError::invalid("slots", "the handover sent nothing"));
    };
    let set = slot_set(membership, &first.slots, first.slot_count)?;
    if membership.is_draining() {
        return Err(ServiceError::MoveRefused("this node is handing its slots over before it stops".to_owned()));
    }
    let map = membership.map();
    if let Some(slot) = set.iter().find(|&slot| membership.owns(&map, slot)) {
        return Err(ServiceError::MoveRefused(format!("slot {slot} is this node's already")));
    }
    let (mut state, mut durable) = (first.state, first.durable);
    let mut feed_entries = cluster_wire::feed_entries(first.feed_entries)?;
    let mut feed_bytes: usize = feed_entries.iter().map(presence_feed::Frame::len).sum();
    while let Some(piece) =
        pieces.message().await.map_err(|status| ServiceError::Peer { node: first.from_node.clone(), status })?
    {
        if state.len() + piece.state.len() > MAX_HANDOVER_BYTES {
            return Err(ServiceError::invalid(
                "state",
                format!("more than {MAX_HANDOVER_BYTES} bytes in one handover"),
            ));
        }
        if durable.len() + piece.durable.len() > MAX_HANDOVER_DURABLE {
            return Err(ServiceError::invalid(
                "durable",
                format!("more than {MAX_HANDOVER_DURABLE} users in one handover"),
            ));
        }
        state.extend_from_slice(&piece.state);
        durable.extend(piece.durable);
        let more = cluster_wire::feed_entries(piece.feed_entries)?;
        feed_bytes += more.iter().map(presence_feed::Frame::len).sum::<usize>();
        feed_entries.extend(more);
        if feed_bytes > MAX_HANDOVER_BYTES {
            return Err(ServiceError::invalid(
                "feed_entries",
                format!("more than {MAX_HANDOVER_BYTES} bytes of feed entries in one handover"),
            ));
        }
    }
    let now = context.now();
    let durable =
        durable.into_iter().map(|user| cluster_wire::handed_over(user, now)).collect::<Result<Vec<_>, _>>()?;
    let _one_at_a_time = membership.handing_over.lock().await;
    // Slots that come back here are answered again once the map says so.
    answer_again(context, membership, &set);
    // Before anything of the slots is recorded here: their entries stay in
    // order across the move (F3).
    if let Some(feed) = &context.feed {
        feed.inherit(feed_entries, first.feed_position, now);
    }
    let imported = context
        .apply(|store, now, changes| store.import(now, &state, changes))
        .map_err(|refused| ServiceError::invalid("state", refused.to_string()))?;
    user_data::take_over(context, durable, now).await?;
    membership.note_taken_in(&set);
    tracing::info!(
        from_node = first.from_node,
        slots = set.len(),
        users = imported.users,
        sessions = imported.sessions,
        bytes = state.len(),
        "took over the state of slots handed over"
    );
    tokio::spawn(drop_unless_given(Arc::clone(context), Arc::clone(cluster), set));
    Ok(pb::TakeSlotsResponse { users: imported.users as u64, sessions: imported.sessions as u64 })
}

/// Drops what was taken of `set` if the map has not given this node all of
/// it after [`CLAIM_WAIT`]: the source's move failed without telling.
async fn drop_unless_given(context: Arc<Context>, cluster: Arc<ClusterNode>, set: SlotSet) {
    let membership = &cluster.membership;
    let mut changes = membership.map_changes();
    let given = |membership: &Membership| {
        let map = membership.map();
        set.iter().all(|slot| membership.owns(&map, slot))
    };
    let waited = tokio::time::timeout(CLAIM_WAIT, async {
        while !given(membership) {
            if changes.changed().await.is_err() {
                return;
            }
        }
    });
    if waited.await.is_ok() && given(membership) {
        return;
    }
    let map = membership.map();
    let not_given = SlotSet::of(set.slots(), set.iter().filter(|&slot| !membership.owns(&map, slot)));
    for slot in not_given.iter() {
        membership.forget_taken_in(slot);
    }
    let users = drop_here(&context, &not_given, "a handover that did not happen").await;
    tracing::warn!(
        slots = not_given.len(),
        users,
        "a handover's slots were not given to this node: dropped their state"
    );
}

/// Hands every slot of this node over to the other live nodes before it
/// stops (SIGTERM), spread so that each ends with about as many as the
/// others, so that its users' sessions carry on there without a flip (C3).
/// A slot whose move fails is left to the coordinator, which gives it to
/// another node without its state once this node's lease is revoked.
pub(crate) async fn drain(context: &Arc<Context>, cluster: &Arc<ClusterNode>) {
    let membership = &cluster.membership;
    membership.start_draining();
    let map = membership.map();
    let others: Vec<String> = membership.nodes().ids().into_iter().filter(|node| node != membership.node()).collect();
    // This node's slots as the coordinator would give a dead node's: each to
    // the live node with the fewest at that point.
    let mut plan: std::collections::BTreeMap<String, Vec<u32>> = std::collections::BTreeMap::new();
    for (slot, node, _) in repairs(&map, &others) {
        if membership.owns(&map, slot) {
            plan.entry(node).or_default().push(slot);
        }
    }
    let mine: usize = plan.values().map(Vec::len).sum();
    if mine == 0 {
        return;
    }
    tracing::info!(slots = mine, nodes = plan.len(), "draining: handing this node's slots over");
    let credential = membership.peer_token().cloned();
    for (node, slots) in plan {
        if let Err(error) = move_slots(context, cluster, &slots, &node, credential.as_ref()).await {
            tracing::warn!(node, slots = slots.len(), %error, "draining: slots not handed over; they move without their state");
        }
    }
}
