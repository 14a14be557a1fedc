//! Planned handover (C3, C7): slots move to another node with their users'
//! state, and no client sees them move.
//!
//! The node handing slots over (the source), for at most
//! [`MOVES_PER_TXN`] slots at a time (a round):
//! 1. copies them while it serves them: it starts noting every change to
//!    their users (renewals included), takes their state (a checkpoint of
//!    their users: leases with their generations and deadlines, versions,
//!    room memberships) and sends it to the node taking them (the target),
//!    which keeps it aside: it answers for none of it and expires none of it;
//! 2. sends what changed since, again and again, until little is left
//!    (at most [`FREEZE_AT_USERS`] users): a round whose slots change
//!    faster than they are sent is given up, never frozen, and made again
//!    as two rounds of half its slots each (a move of one slot that still
//!    changes faster than it is sent fails, its slot staying here);
//! 3. freezes them: refuses their requests, once every request that passed
//!    its ownership check before has written (the gates in
//!    `membership.rs`), and holds back their users' expiry. A request that
//!    meets the freeze waits at the node that received it
//!    (`HOLD_THROUGH_FREEZE`), and is then answered by the new owner;
//! 4. sends the last changes with what each user keeps beside its state
//!    (status, visibility, audience) and the slots' feed entries; the
//!    target takes the slots as its own state;
//! 5. gives the slots to the target in etcd, by compare-and-swap on the
//!    epochs it owned them at, and drops them.
//!
//! Steps 3 to 5 are the freeze, bounded: a target that has not taken the
//! last changes within `ClusterConfig::move_freeze_bound` is told to drop
//! what it took and the slots are answered here again
//! (`presenced_move_freezes_aborted_total`).
//! No slot of a round is frozen while another's copy is under way.
//!
//! The target answers for the slots once its slot map shows them as its own.
//! A step that fails undoes the ones before: the target drops what it took,
//! the source answers again. None is lost, and a gateway that keeps
//! renewing sees no flip.
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
use tonic::metadata::{Ascii, MetadataValue};

use crate::cluster::ClusterNode;
use crate::cluster::forward::{call_peer, with_credential};
use crate::cluster::membership::{Membership, checked_slots};
use crate::error::ServiceError;
use crate::node::background;
use crate::node::context::Context;
use crate::node::feed::Carried;
use crate::node::privacy::HandedOver;
use crate::{cluster::wire as cluster_wire, node::user_data};

/// The state bytes one `SlotState` message carries: well under gRPC's 4 MiB.
const PIECE_BYTES: usize = 1 << 20;

/// How long the target may take to answer a handover's state: a hundred
/// slots of a node with a million sessions are ten megabytes, taken in well
/// under a second; a node that does not answer must not hold up a drain.
const TAKE_TIMEOUT: Duration = Duration::from_secs(10);

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
    // The rounds still to make, the next one last.
    let mut rounds: Vec<Vec<u32>> = slots.chunks(MOVES_PER_TXN).rev().map(<[u32]>::to_vec).collect();
    while let Some(chunk) = rounds.pop() {
        let mut tries = 1;
        let part = loop {
            match move_chunk(context, membership, &chunk, to_node, &address, &mut carried, credential).await? {
                Round::Moved(part) => break Some(part),
                Round::FreezeGivenUp(error) if tries >= FREEZE_TRIES => return Err(error),
                Round::FreezeGivenUp(_) => tries += 1,
                Round::OutPaced(error) if chunk.len() == 1 => return Err(error),
                Round::OutPaced(_) => {
                    // Fewer slots change by fewer users between two steps,
                    // whatever starves the move of CPU (H1 puts it last).
                    let (first, second) = chunk.split_at(chunk.len() / 2);
                    tracing::info!(
                        slots = chunk.len(),
                        to_node,
                        "a round's slots changed faster than they were sent: moving them in two rounds"
                    );
                    rounds.push(second.to_vec());
                    rounds.push(first.to_vec());
                    break None;
                }
            }
        };
        let Some(part) = part else { continue };
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

/// The most users changed since the last step a round freezes its slots
/// with: sent in a few milliseconds, so the freeze stays short.
pub(crate) const FREEZE_AT_USERS: usize = 500;

/// How many times a round sends what changed before it gives up: slots that
/// change faster than they are sent are never frozen (the move is aborted,
/// and the slots stay here).
const CATCH_UP_STEPS: usize = 16;

/// How many times a round whose freeze was given up is made again (copied
/// again, frozen again) before the move fails.
const FREEZE_TRIES: usize = 3;

/// How a round of a move ended, short of an error.
enum Round {
    /// Its slots are the target's.
    Moved(Moved),
    /// Its freeze was given up past `ClusterConfig::move_freeze_bound`: the
    /// slots stayed here, and the round may be made again.
    FreezeGivenUp(ServiceError),
    /// Its slots changed faster than they were sent, [`CATCH_UP_STEPS`]
    /// times over: never frozen, they stayed here, and may move in smaller
    /// rounds.
    OutPaced(ServiceError),
}

/// One round of a move, for at most [`MOVES_PER_TXN`] slots: copied while
/// served, then frozen for the last changes and the ownership write.
async fn move_chunk(
    context: &Arc<Context>,
    membership: &Membership,
    chunk: &[u32],
    to_node: &str,
    address: &str,
    carried: &mut Carried,
    credential: Option<&MetadataValue<Ascii>>,
) -> Result<Round, ServiceError> {
    let set = SlotSet::of(membership.slot_count(), chunk.iter().copied());
    let store = context.store();
    let target = Target { membership, address, set: &set, move_id: fastrand::u64(1..), credential };
    // Every change to the slots' users from here on is noted, until the round ends.
    let _noting = NotingChanges::start(store, &set);
    let began = Instant::now();
    let (to_copy, now) = (set.clone(), context.now());
    let copy = off_the_runtime(store, move |store| store.export_slots(&to_copy, now)).await?;
    let mut bytes = copy.len() as u64;
    let map = membership.map();
    // What the feed held of the slots when the move began goes with the copy.
    let feed_so_far = FeedPart { entries: carried.take(&set), last_position: 0 };
    let copied = target.send(Step::copy(copy, map.revision(), feed_so_far)).await;
    if let Err(refused) = copied {
        drop_at(membership, address, &set, credential).await;
        return Err(refused);
    }
    let mut changed = store.take_moving_changed();
    let mut steps = 0;
    while changed.len() > FREEZE_AT_USERS {
        steps += 1;
        if steps > CATCH_UP_STEPS {
            drop_at(membership, address, &set, credential).await;
            return Ok(Round::OutPaced(ServiceError::MoveAborted(format!(
                "slots {chunk:?} changed faster than they were sent ({} users after {CATCH_UP_STEPS} steps); \
                 they were never frozen and stayed here",
                changed.len()
            ))));
        }
        let now = context.now();
        let (state, absent) = off_the_runtime(store, move |store| store.export_users(&changed, now)).await?;
        bytes += state.len() as u64;
        if let Err(refused) = target.send(Step::changes(state, absent)).await {
            drop_at(membership, address, &set, credential).await;
            return Err(refused);
        }
        changed = store.take_moving_changed();
    }

    let copied_in = began.elapsed();
    // The freeze: every request checked before is written; every later one waits.
    store.pause_expiry(Some(membership.start_leaving(&set).await));
    let frozen_at = Instant::now();
    // A freeze that ends without the move answers the slots here again
    // first, so that the requests held through it go on at once, then has
    // the target drop its copy (the map never gave it the slots).
    let set = &set;
    let give_up = |error: ServiceError| async move {
        answer_again(context, membership, set);
        drop_at(membership, address, set, credential).await;
        error
    };
    let map = membership.map();
    let seen: Vec<(u32, i64)> =
        chunk.iter().map(|&slot| (slot, map.owner(slot).map_or(0, |owner| owner.epoch))).collect();
    let mine = chunk.iter().all(|&slot| membership.owns(&map, slot));
    if !mine || !membership.acting_now() {
        return Err(give_up(ServiceError::MoveAborted(
            "the slot map changed as the move began; nothing moved".to_owned(),
        ))
        .await);
    }
    changed.extend(store.take_moving_changed());
    let (state, absent) = store.export_users(&changed, context.now());
    bytes += state.len() as u64;
    let exported_after = frozen_at.elapsed();
    let durable = match user_data::in_slots(context, set).await {
        Ok(durable) => durable,
        Err(error) => {
            return Err(give_up(error).await);
        }
    };
    let durable_after = frozen_at.elapsed();
    let feed = match feed_of(context, set, carried).await {
        Ok(feed) => feed,
        Err(error) => {
            return Err(give_up(error).await);
        }
    };
    let last = Step::last(state, absent, durable, feed);
    let sending_at = frozen_at.elapsed();
    let bound = membership.move_freeze_bound;
    // A freeze already past its bound sends nothing more.
    let left = bound.saturating_sub(frozen_at.elapsed());
    let sent = async { if left.is_zero() { None } else { tokio::time::timeout(left, target.send(last)).await.ok() } };
    let taken = match sent.await {
        Some(Ok(taken)) => taken,
        Some(Err(refused)) => {
            return Err(give_up(refused).await);
        }
        None => {
            let given_up = give_up(ServiceError::MoveAborted(format!(
                "node {to_node} did not take the last changes of slots {chunk:?} within {bound:?}; they stayed here"
            )))
            .await;
            context.metrics().move_freezes_aborted.increment(1);
            tracing::warn!(
                slots = chunk.len(),
                to_node,
                bound_ms = bound.as_millis() as u64,
                "a move's freeze was given up: the target did not take the last changes in time; the slots stay here"
            );
            return Ok(Round::FreezeGivenUp(given_up));
        }
    };
    let taken_after = frozen_at.elapsed();
    let epoch = match give_slots(&membership.etcd, &membership.prefix, &seen, to_node).await {
        Ok(Some(epoch)) => epoch,
        Ok(None) => {
            return Err(give_up(ServiceError::MoveAborted(format!(
                "slots {chunk:?} changed in etcd during the move; they stayed here"
            )))
            .await);
        }
        Err(error) => {
            // The transaction may have been made: the map says.
            match outcome(membership, &seen, to_node).await {
                Some(epoch) => epoch,
                None => {
                    return Err(give_up(ServiceError::Etcd(format!(
                        "giving the slots to {to_node}: {error}; they stayed here"
                    )))
                    .await);
                }
            }
        }
    };
    let frozen = frozen_at.elapsed();
    context.metrics().move_freeze_seconds.record(frozen.as_secs_f64());
    // The slots stay refused here: this node's map may show them as its own
    // a little longer, and requests held meanwhile go to the target once it does.
    let released = drop_here(context, set, "slots handed over").await;
    tracing::info!(
        slots = chunk.len(),
        released,
        epoch,
        copy_and_catch_up_ms = copied_in.as_secs_f64() * 1e3,
        catch_up_steps = steps,
        last_changes = changed.len(),
        frozen_ms = frozen.as_secs_f64() * 1e3,
        last_step_sent_after_ms = sending_at.as_secs_f64() * 1e3,
        exported_after_ms = exported_after.as_secs_f64() * 1e3,
        durable_after_ms = durable_after.as_secs_f64() * 1e3,
        last_step_taken_after_ms = taken_after.as_secs_f64() * 1e3,
        "a round of slots handed over and dropped here"
    );
    Ok(Round::Moved(Moved { epoch, users: taken.users, sessions: taken.sessions, bytes, elapsed: Duration::ZERO }))
}

/// Runs `work` on a store (a move's export or import, dropping slots, a
/// follower's copy) on a background thread, so that the runtime's workers
/// go on with renewals meanwhile, and go first when the cores are full
/// (H1): a hundred slots of a node of a million sessions are a few hundred
/// milliseconds of CPU, which would hold up every request queued behind
/// them on that worker.
pub(crate) async fn off_the_runtime<T: Send + 'static>(
    store: &Arc<presence_core::Store>,
    work: impl FnOnce(&presence_core::Store) -> T + Send + 'static,
) -> Result<T, ServiceError> {
    let store = Arc::clone(store);
    background::run("presenced-slots", move || work(&store))
        .await
        .map_err(|error| ServiceError::Internal(format!("work on a store's slots failed: {error}")))
}

/// Notes every change to a round's users while it runs (see
/// `Store::track_moving`), and stops when dropped, however the round ends.
struct NotingChanges<'a>(&'a presence_core::Store);

impl<'a> NotingChanges<'a> {
    fn start(store: &'a presence_core::Store, set: &SlotSet) -> Self {
        store.track_moving(Some(set));
        NotingChanges(store)
    }
}

impl Drop for NotingChanges<'_> {
    fn drop(&mut self) {
        self.0.track_moving(None);
    }
}

/// Drops the users of `set` here without publishing anything, with what
/// they keep on disk (their state lives at another node now: `why`);
/// returns how many users went.
pub(crate) async fn drop_here(context: &Context, set: &SlotSet, why: &str) -> usize {
    let (now, slots) = (context.now(), set.clone());
    let users = match off_the_runtime(context.store(), move |store| store.release_slots(now, &slots)).await {
        Ok(users) => users,
        Err(error) => {
            tracing::error!(%error, why, "slots could not be dropped here");
            0
        }
    };
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

/// The feed's entries of `set`, once the feed's writer has taken everything
/// recorded before the slots were refused here (none of theirs comes
/// after), synced or not yet: the target keeps them from then on; read into
/// `carried`, which holds what earlier rounds of the move read.
async fn feed_of(context: &Context, set: &SlotSet, carried: &mut Carried) -> Result<FeedPart, ServiceError> {
    let Some(feed) = &context.feed else { return Ok(FeedPart::default()) };
    let last_position = feed.cursor_now().position;
    feed.taken_through(last_position).await;
    // Only what came since the last read: little, read here.
    feed.read_for_move(carried).map_err(feed_read_failed)?;
    Ok(FeedPart { entries: carried.take(set), last_position })
}

/// One call of a move to its target (C7): what it carries.
#[derive(Debug, Default)]
struct Step {
    phase: pb::MovePhase,
    state: Vec<u8>,
    absent: Vec<presence_core::CompactString>,
    durable: Vec<HandedOver>,
    feed: FeedPart,
    map_revision: i64,
}

impl Step {
    /// The slots' state, taken while they are served, with their feed entries so far.
    fn copy(state: Vec<u8>, map_revision: i64, feed: FeedPart) -> Self {
        Step { phase: pb::MovePhase::Copy, state, map_revision, feed, ..Step::default() }
    }

    /// What changed since the last step.
    fn changes(state: Vec<u8>, absent: Vec<presence_core::CompactString>) -> Self {
        Step { phase: pb::MovePhase::Changes, state, absent, ..Step::default() }
    }

    /// The last changes, with the users' durable data and the slots' feed entries since the copy.
    fn last(
        state: Vec<u8>,
        absent: Vec<presence_core::CompactString>,
        durable: Vec<HandedOver>,
        feed: FeedPart,
    ) -> Self {
        Step { phase: pb::MovePhase::Final, state, absent, durable, feed, map_revision: 0 }
    }
}

/// The node a round of a move goes to.
struct Target<'a> {
    membership: &'a Membership,
    address: &'a str,
    set: &'a SlotSet,
    move_id: u64,
    credential: Option<&'a MetadataValue<Ascii>>,
}

/// Users named per piece of a step (those the source no longer holds).
const ABSENT_PER_PIECE: usize = 10_000;

impl Target<'_> {
    /// Sends one step of the move to the target; its answer.
    async fn send(&self, step: Step) -> Result<pb::TakeSlotsResponse, ServiceError> {
        let Step { phase, state, absent, durable, feed, map_revision } = step;
        let mut pieces: Vec<pb::SlotState> = state
            .chunks(PIECE_BYTES)
            .map(|piece| pb::SlotState { state: piece.to_vec(), ..pb::SlotState::default() })
            .collect();
        pieces.extend(absent.chunks(ABSENT_PER_PIECE).map(|users| pb::SlotState {
            absent_users: users.iter().map(|user| user.to_string()).collect(),
            ..pb::SlotState::default()
        }));
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
        first.from_node = self.membership.node().to_owned();
        first.slots = self.set.iter().collect();
        first.slot_count = self.membership.slot_count();
        first.map_revision = map_revision;
        first.feed_position = feed.last_position;
        first.phase = phase as i32;
        first.move_id = self.move_id;
        // The next protocol minor's added field (D1's mixed-version roll).
        #[cfg(feature = "next-cluster-protocol")]
        {
            first.sender_version = env!("CARGO_PKG_VERSION").to_owned();
        }
        let request = with_credential(tokio_stream::iter(pieces), self.credential);
        let mut client = self.membership.cluster_client(self.address)?;
        call_peer(self.address, TAKE_TIMEOUT, client.take_slots(request)).await
    }
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
