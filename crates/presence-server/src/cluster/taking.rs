//! The side of a planned move (C3, C7) that takes slots in: the target.
//!
//! A move copies its slots here while their owner serves them
//! (`MOVE_PHASE_COPY`), then sends what changed since (`MOVE_PHASE_CHANGES`)
//! until little is left, and last what changed before it froze them, with
//! the users' durable data and the slots' feed entries (`MOVE_PHASE_FINAL`;
//! `handover.rs` is the other side). Until the last step the copy is kept
//! aside in this node's store: nothing of it is published, none of it
//! expires (the owner expires its users and sends what that changed), and
//! requests for its users still go to the owner, since the map gives it the
//! slots. Their room facts wait too, and go to the rooms' owners with the
//! last step. A copy whose move stops sending (the source died, or gave the
//! move up without a word) is dropped after [`CLAIM_WAIT`].
//!
//! A source that copies nothing first sends its whole state in one call
//! (`MOVE_PHASE_WHOLE`), which is taken as the last step is.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use parking_lot::Mutex;
use presence_core::{CompactString, Imported, Replaced, SlotSet, StampedRoomFact};
use presence_proto::v1 as pb;
use tonic::Streaming;

use crate::cluster::ClusterNode;
use crate::cluster::handover::{answer_again, drop_here, off_the_runtime};
use crate::cluster::membership::{Membership, slot_set};
use crate::error::ServiceError;
use crate::node::context::Context;
use crate::{cluster::wire as cluster_wire, node::user_data};

/// The most state a node takes in one call of a move: far above the few
/// hundred bytes per session of a real one, low enough that a caller cannot
/// make the node hold much memory.
const MAX_HANDOVER_BYTES: usize = 1 << 30;

/// The most users named in one call of a move (with durable data, or no
/// longer held by the source).
const MAX_HANDOVER_USERS: usize = 10_000_000;

/// How long a target keeps state it took for slots the map does not give
/// it (the source gives them in etcd milliseconds after the target answered
/// the last step), and a copy no step of its move touched.
const CLAIM_WAIT: Duration = Duration::from_secs(10);

/// The moves under way into this node, by move id (C7).
#[derive(Debug, Default)]
pub(crate) struct Arrivals {
    moves: Mutex<HashMap<u64, Arrival>>,
}

/// A move under way into this node: its copy is in the store, kept aside.
#[derive(Debug)]
struct Arrival {
    from_node: String,
    slots: SlotSet,
    /// The room facts the copy's users made here, sent to the rooms' owners with the last step.
    room_facts: Vec<StampedRoomFact>,
    /// The users and sessions of the copy as it stands.
    held: Imported,
    /// When a step last came.
    touched: Instant,
}

impl Arrivals {
    /// Whether `move_id` from `from_node` brings `slots` exactly.
    fn expects(&self, move_id: u64, from_node: &str, slots: &SlotSet) -> Result<(), ServiceError> {
        match self.moves.lock().get(&move_id) {
            Some(arrival) if arrival.matches(from_node, slots) => Ok(()),
            _ => Err(no_copy(move_id)),
        }
    }

    /// Adds a step's changes to the arrival of `move_id`; what its copy holds now.
    fn touch(&self, move_id: u64, replaced: Replaced, facts: Vec<StampedRoomFact>) -> Result<Imported, ServiceError> {
        let mut moves = self.moves.lock();
        let Some(arrival) = moves.get_mut(&move_id) else { return Err(no_copy(move_id)) };
        arrival.room_facts.extend(facts);
        arrival.touched = Instant::now();
        arrival.held = held_after(arrival.held, replaced);
        Ok(arrival.held)
    }

    /// Ends the arrival of `move_id`: its room facts, and what its copy held.
    fn finish(
        &self,
        move_id: u64,
        from_node: &str,
        slots: &SlotSet,
    ) -> Result<(Vec<StampedRoomFact>, Imported), ServiceError> {
        let mut moves = self.moves.lock();
        match moves.get(&move_id) {
            Some(arrival) if arrival.matches(from_node, slots) => {
                Ok(moves.remove(&move_id).map(|arrival| (arrival.room_facts, arrival.held)).unwrap_or_default())
            }
            _ => Err(no_copy(move_id)),
        }
    }

    /// Forgets every arrival of a slot of `slots` (their state is dropped);
    /// the slots they were bringing.
    pub(crate) fn forget(&self, slots: &SlotSet) -> SlotSet {
        let mut forgotten = SlotSet::new(slots.slots());
        self.moves.lock().retain(|_, arrival| {
            let keep = !arrival.slots.iter().any(|slot| slots.contains(slot));
            if !keep {
                arrival.slots.iter().for_each(|slot| forgotten.insert(slot));
            }
            keep
        });
        forgotten
    }

    /// Whether any arrival brings one of `slots`.
    fn brings_any(&self, slots: &SlotSet) -> bool {
        self.moves.lock().values().any(|arrival| arrival.slots.iter().any(|slot| slots.contains(slot)))
    }
}

impl Arrival {
    fn matches(&self, from_node: &str, slots: &SlotSet) -> bool {
        self.from_node == from_node && &self.slots == slots
    }
}

fn no_copy(move_id: u64) -> ServiceError {
    ServiceError::MoveAborted(format!("no copy of move {move_id} is kept here: it ended, or was dropped; start again"))
}

/// One call of a move, read whole.
struct Received {
    from_node: String,
    set: SlotSet,
    phase: pb::MovePhase,
    move_id: u64,
    feed_position: u64,
    state: Vec<u8>,
    absent: Vec<CompactString>,
    durable: Vec<pb::HandedOverUser>,
    feed_entries: Vec<presence_feed::Frame>,
}

/// Reads every piece of one call of a move, within the bounds.
async fn receive(membership: &Membership, mut pieces: Streaming<pb::SlotState>) -> Result<Received, ServiceError> {
    let Some(first) =
        pieces.message().await.map_err(|status| ServiceError::Peer { node: "the source".into(), status })?
    else {
        return Err(ServiceError::invalid("slots", "the handover sent nothing"));
    };
    let set = slot_set(membership, &first.slots, first.slot_count)?;
    let phase = pb::MovePhase::try_from(first.phase)
        .map_err(|_| ServiceError::invalid("phase", format!("{} is not a step of a move", first.phase)))?;
    if phase != pb::MovePhase::Whole && first.move_id == 0 {
        return Err(ServiceError::invalid("move_id", "a step of a move names its move"));
    }
    let mut received = Received {
        from_node: first.from_node.clone(),
        set,
        phase,
        move_id: first.move_id,
        feed_position: first.feed_position,
        state: Vec::new(),
        absent: Vec::new(),
        durable: Vec::new(),
        feed_entries: Vec::new(),
    };
    let mut feed_bytes = 0;
    let mut piece = Some(first);
    while let Some(next) = piece {
        if received.state.len() + next.state.len() > MAX_HANDOVER_BYTES {
            return Err(ServiceError::invalid(
                "state",
                format!("more than {MAX_HANDOVER_BYTES} bytes in one handover"),
            ));
        }
        if received.durable.len() + next.durable.len() + received.absent.len() + next.absent_users.len()
            > MAX_HANDOVER_USERS
        {
            return Err(ServiceError::invalid(
                "durable",
                format!("more than {MAX_HANDOVER_USERS} users named in one handover"),
            ));
        }
        received.state.extend_from_slice(&next.state);
        received.durable.extend(next.durable);
        received.absent.extend(next.absent_users.iter().map(CompactString::from));
        let more = cluster_wire::feed_entries(next.feed_entries)?;
        feed_bytes += more.iter().map(presence_feed::Frame::len).sum::<usize>();
        received.feed_entries.extend(more);
        if feed_bytes > MAX_HANDOVER_BYTES {
            return Err(ServiceError::invalid(
                "feed_entries",
                format!("more than {MAX_HANDOVER_BYTES} bytes of feed entries in one handover"),
            ));
        }
        piece =
            pieces.message().await.map_err(|status| ServiceError::Peer { node: received.from_node.clone(), status })?;
    }
    Ok(received)
}

/// Takes one call of a move of slots another node hands over (see the
/// module's description); answers how much it took.
pub(crate) async fn take_slots(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    pieces: Streaming<pb::SlotState>,
) -> Result<pb::TakeSlotsResponse, ServiceError> {
    let membership = &cluster.membership;
    let received = receive(membership, pieces).await?;
    match received.phase {
        pb::MovePhase::Copy => take_copy(context, cluster, received).await,
        pb::MovePhase::Changes => take_changes(context, cluster, received).await,
        pb::MovePhase::Whole | pb::MovePhase::Final => take_last(context, cluster, received).await,
    }
}

/// Refuses a move of `set` into this node: it is draining, or owns one of them.
fn check_welcome(membership: &Membership, set: &SlotSet) -> Result<(), ServiceError> {
    if membership.is_draining() {
        return Err(ServiceError::MoveRefused("this node is handing its slots over before it stops".to_owned()));
    }
    let map = membership.map();
    if let Some(slot) = set.iter().find(|&slot| membership.owns(&map, slot)) {
        return Err(ServiceError::MoveRefused(format!("slot {slot} is this node's already")));
    }
    Ok(())
}

/// The first step: the copy, kept aside.
async fn take_copy(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    mut received: Received,
) -> Result<pb::TakeSlotsResponse, ServiceError> {
    let membership = &cluster.membership;
    check_welcome(membership, &received.set)?;
    if cluster.arrivals.brings_any(&received.set) {
        return Err(ServiceError::MoveRefused("another move is bringing some of these slots here".to_owned()));
    }
    // Held back before the copy is in: a lease of it never expires here.
    context.store().pause_expiry(Some(membership.start_taking(&received.set)));
    let state = std::mem::take(&mut received.state);
    let (imported, room_facts) = match take_aside(context, state, Vec::new()).await {
        Ok((replaced, room_facts)) => (held_after(Imported::default(), replaced), room_facts),
        Err(refused) => {
            context.store().pause_expiry(Some(membership.stop_taking(&received.set)));
            return Err(refused);
        }
    };
    let arrival = Arrival {
        from_node: received.from_node.clone(),
        slots: received.set.clone(),
        room_facts,
        held: imported,
        touched: Instant::now(),
    };
    // The slots' feed entries so far are kept with the others handed over
    // now, outside the freeze. Nothing of the slots is recorded here before
    // the last step raises this feed above the source's positions (F3); a
    // consumer merging the cluster's feed drops an entry two nodes hold by
    // its cursor, so a move given up leaves nothing wrong behind.
    if let Some(feed) = &context.feed {
        feed.inherit(received.feed_entries, 0, context.now());
    }
    cluster.arrivals.moves.lock().insert(received.move_id, arrival);
    tokio::spawn(drop_if_abandoned(Arc::clone(context), Arc::clone(cluster), received.move_id, received.set));
    tracing::debug!(
        from_node = received.from_node,
        users = imported.users,
        sessions = imported.sessions,
        "took a copy of slots a move is bringing"
    );
    Ok(pb::TakeSlotsResponse { users: imported.users as u64, sessions: imported.sessions as u64 })
}

/// Takes a step's users into the store aside (each replacing what the store
/// holds of it; `absent` dropped), on a thread of its own, publishing
/// nothing: what it dropped and took, and the room facts it held back.
async fn take_aside(
    context: &Context,
    state: Vec<u8>,
    absent: Vec<CompactString>,
) -> Result<(Replaced, Vec<StampedRoomFact>), ServiceError> {
    let now = context.now();
    let (replaced, kept_aside) = off_the_runtime(context.store(), move |store| {
        let mut kept_aside = presence_core::Changes::default();
        (store.replace_users(now, &state, &absent, &mut kept_aside), kept_aside)
    })
    .await?;
    let replaced = replaced.map_err(|refused| ServiceError::invalid("state", refused.to_string()))?;
    Ok((replaced, kept_aside.room_facts))
}

/// What a copy holds after a step `replaced` some of its users.
fn held_after(held: Imported, replaced: Replaced) -> Imported {
    Imported {
        users: (held.users + replaced.taken.users).saturating_sub(replaced.dropped.users),
        sessions: (held.sessions + replaced.taken.sessions).saturating_sub(replaced.dropped.sessions),
    }
}

/// A later step: what changed since, kept aside with the copy.
async fn take_changes(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    received: Received,
) -> Result<pb::TakeSlotsResponse, ServiceError> {
    cluster.arrivals.expects(received.move_id, &received.from_node, &received.set)?;
    let (replaced, room_facts) = take_aside(context, received.state, received.absent).await?;
    let held = cluster.arrivals.touch(received.move_id, replaced, room_facts)?;
    Ok(pb::TakeSlotsResponse { users: held.users as u64, sessions: held.sessions as u64 })
}

/// The last step (or a whole move in one call): the slots' state becomes
/// this node's, to answer for once the map gives them.
async fn take_last(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    received: Received,
) -> Result<pb::TakeSlotsResponse, ServiceError> {
    let membership = &cluster.membership;
    let Received { from_node, set, phase, move_id, feed_position, state, absent, durable, feed_entries } = received;
    let (room_facts, copied) = match phase {
        pb::MovePhase::Final => cluster.arrivals.finish(move_id, &from_node, &set)?,
        _ => {
            check_welcome(membership, &set)?;
            (Vec::new(), Imported::default())
        }
    };
    let began = Instant::now();
    let now = context.now();
    let durable =
        durable.into_iter().map(|user| cluster_wire::handed_over(user, now)).collect::<Result<Vec<_>, _>>()?;
    // One move into this node at a time; a move out of it goes on meanwhile
    // (its slots are this node's, and these are not).
    let _one_at_a_time = membership.taking_in.lock().await;
    let locked = began.elapsed();
    // Slots that come back here are answered again once the map says so.
    answer_again(context, membership, &set);
    // Before anything of the slots is recorded here: their entries stay in
    // order across the move (F3).
    let feed_entries_taken = feed_entries.len();
    if let Some(feed) = &context.feed {
        feed.inherit(feed_entries, feed_position, now);
    }
    let inherited = began.elapsed();
    let imported = context
        .apply(|store, now, changes| {
            // The copy's room facts first: the rooms' owners take facts by stamp.
            changes.room_facts.extend(room_facts);
            store.replace_users(now, &state, &absent, changes)
        })
        .map_err(|refused| ServiceError::invalid("state", refused.to_string()));
    context.store().pause_expiry(Some(membership.stop_taking(&set)));
    let replaced = imported?;
    let imported = held_after(copied, replaced);
    let applied = began.elapsed();
    user_data::take_over(context, durable, now).await?;
    membership.note_taken_in(&set);
    tracing::info!(
        from_node,
        slots = set.len(),
        users = imported.users,
        sessions = imported.sessions,
        bytes = state.len(),
        feed_entries = feed_entries_taken,
        waited_ms = locked.as_secs_f64() * 1e3,
        feed_ms = (inherited - locked).as_secs_f64() * 1e3,
        apply_ms = (applied - inherited).as_secs_f64() * 1e3,
        took_ms = began.elapsed().as_secs_f64() * 1e3,
        "took over the state of slots handed over"
    );
    tokio::spawn(drop_unless_given(Arc::clone(context), Arc::clone(cluster), set));
    Ok(pb::TakeSlotsResponse { users: imported.users as u64, sessions: imported.sessions as u64 })
}

/// Drops the copy of a move no step of which came for [`CLAIM_WAIT`]: its
/// source died, or gave it up without a word.
async fn drop_if_abandoned(context: Arc<Context>, cluster: Arc<ClusterNode>, move_id: u64, set: SlotSet) {
    loop {
        let touched = match cluster.arrivals.moves.lock().get(&move_id) {
            Some(arrival) => arrival.touched,
            None => return,
        };
        let due = touched + CLAIM_WAIT;
        if Instant::now() < due {
            tokio::time::sleep_until(due.into()).await;
            continue;
        }
        if cluster.arrivals.moves.lock().remove(&move_id).is_none() {
            return;
        }
        let membership = &cluster.membership;
        context.store().pause_expiry(Some(membership.stop_taking(&set)));
        let map = membership.map();
        let not_given = SlotSet::of(set.slots(), set.iter().filter(|&slot| !membership.owns(&map, slot)));
        let users = drop_here(&context, &not_given, "a move that stopped sending").await;
        tracing::warn!(slots = not_given.len(), users, "a move into this node stopped sending: dropped its copy");
        return;
    }
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
