//! The Leases stream (L8) and the bounded queue that admits its batches (B2).
//!
//! A gateway's stream is read by its own task, which decodes a batch, hands it
//! to the lease queue and waits for the results before reading the next one,
//! so one stream's batches apply in order. A fixed set of workers drains the
//! queue. The queue is bounded: when it is full the server is behind, and a
//! batch's renewals are shed at once, each answered `RESOURCE_EXHAUSTED` (the
//! next heartbeat carries the same information), while its registers and
//! unregisters wait for room: they are never dropped, and the wait pushes back
//! on the gateway through its stream. They wait in a queue of their own, which
//! the workers drain first: in the main queue, a slot freed by a worker would
//! go to whichever batch asked first, and under a flood of renewals that is
//! almost always a renewal, so a register could wait for as long as the flood
//! lasted.

use std::sync::Arc;

use presence_proto::lease_frames::{LeaseBatchFrame, LeaseItemFrame, LeaseOpFrame};
use presence_proto::v1::{self as pb, lease_result};
use prost::Message as _;
use tokio::sync::{mpsc, oneshot};
use tonic::metadata::{Ascii, MetadataValue};
use tonic::{Status, Streaming};

use crate::error::ServiceError;
use crate::metrics::RenewResult;
use crate::node::context::Context;
use crate::node::placement::HOLD_THROUGH_FREEZE;
use crate::node::publish::RoomAnswer;
use crate::{node::ops, node::wire};

pub use presence_proto::lease_frames::MAX_BATCH_ITEMS;

/// What a worker is given.
#[derive(Debug)]
pub(crate) struct Job {
    batch: LeaseBatchFrame,
    /// Answer the batch's renewals `RESOURCE_EXHAUSTED` instead of applying them.
    shed_renewals: bool,
    /// Who sent it, for items held through a move's freeze to be sent on as.
    caller: Caller,
    reply: oneshot::Sender<pb::LeaseResults>,
}

/// Who sent a Leases stream's batches: what its items held through a move's
/// freeze (C7) are sent on to the new owner with.
#[derive(Debug, Clone, Default)]
pub(crate) struct Caller {
    /// The stream's `authorization`, if any.
    pub(crate) authorization: Option<MetadataValue<Ascii>>,
    /// Whether another node forwarded the stream: what it sends is never sent on again.
    pub(crate) forwarded: bool,
}

/// The bounded queue between Leases streams and the workers that apply batches.
#[derive(Debug, Clone)]
pub(crate) struct LeaseQueue {
    jobs: async_channel::Sender<Job>,
    /// Batches with registers or unregisters that found `jobs` full: applied first.
    waiting: async_channel::Sender<Job>,
    context: Arc<Context>,
}

/// The workers' ends of the two queues.
#[derive(Debug, Clone)]
pub(crate) struct Receivers {
    jobs: async_channel::Receiver<Job>,
    waiting: async_channel::Receiver<Job>,
}

impl LeaseQueue {
    /// A queue of `capacity` batches (and as many waiting ones), without workers.
    pub(crate) fn new(context: Arc<Context>, capacity: usize) -> (Self, Receivers) {
        let (jobs, jobs_receiver) = async_channel::bounded(capacity.max(1));
        let (waiting, waiting_receiver) = async_channel::bounded(capacity.max(1));
        (LeaseQueue { jobs, waiting, context }, Receivers { jobs: jobs_receiver, waiting: waiting_receiver })
    }

    /// A queue of `capacity` batches drained by `workers` tasks.
    pub(crate) fn start(context: Arc<Context>, capacity: usize, workers: usize) -> Self {
        let (queue, receivers) = Self::new(context, capacity);
        for _ in 0..workers.max(1) {
            tokio::spawn(work(Arc::clone(&queue.context), receivers.clone()));
        }
        queue
    }

    /// Whether the queue is full: the server is behind, and renewals are shed.
    pub(crate) fn is_overloaded(&self) -> bool {
        self.jobs.is_full()
    }

    /// Applies a batch and returns its results, in item order.
    async fn run(&self, batch: LeaseBatchFrame, caller: &Caller) -> Result<pb::LeaseResults, ServiceError> {
        let (reply, results) = oneshot::channel();
        let job = Job { batch, shed_renewals: false, caller: caller.clone(), reply };
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(async_channel::TrySendError::Full(mut job)) => {
                job.shed_renewals = true;
                let only_renewals = job.batch.items.iter().all(is_renewal);
                if only_renewals {
                    // Nothing in it must wait: answer at once, without a worker.
                    return Ok(apply(&self.context, &job.batch, true));
                }
                tokio::select! {
                    sent = self.waiting.send(job) => sent.map_err(|_| stopping())?,
                    () = self.context.stopping.cancelled() => return Err(stopping()),
                }
            }
            Err(async_channel::TrySendError::Closed(_)) => return Err(stopping()),
        }
        self.context.metrics().queue_depth.set((self.jobs.len() + self.waiting.len()) as f64);
        // On shutdown the workers stop: a batch still queued is answered here.
        tokio::select! {
            results = results => results.map_err(|_| stopping()),
            () = self.context.stopping.cancelled() => Err(stopping()),
        }
    }
}

fn stopping() -> ServiceError {
    ServiceError::ShuttingDown
}

fn is_renewal(item: &LeaseItemFrame) -> bool {
    matches!(item.op, Some(LeaseOpFrame::Renew(_)))
}

/// The next batch to apply: a waiting one first (B2), else the oldest queued one;
/// `None` once the queues close or the server stops.
async fn next_job(queues: &Receivers, stopping: &tokio_util::sync::CancellationToken) -> Option<Job> {
    tokio::select! {
        biased;
        () = stopping.cancelled() => None,
        job = queues.waiting.recv() => job.ok(),
        job = queues.jobs.recv() => job.ok(),
    }
}

/// A worker: applies queued batches until the queue closes or the server stops.
async fn work(context: Arc<Context>, queues: Receivers) {
    while let Some(job) = next_job(&queues, &context.stopping).await {
        let rooms = rooms_to_hear(&context, &job.batch);
        let Applied { results, rooms_answered, held } = apply_hearing_rooms(&context, &job.batch, job.shed_renewals);
        if rooms.is_none() && held.is_empty() {
            let _ = job.reply.send(results);
        } else {
            // The rooms' owners answer the room versions, and held items
            // wait out a freeze: aside, so that the worker goes on with the
            // next batch (H1).
            let context = Arc::clone(&context);
            tokio::spawn(async move {
                let mut results = match rooms {
                    Some(rooms) => with_room_versions(Arc::clone(&context), results, &rooms, rooms_answered).await,
                    None => results,
                };
                if !held.is_empty() {
                    answer_held(&context, &job.batch, &job.caller, held, &mut results).await;
                }
                let _ = job.reply.send(results);
            });
        }
        // A batch is a burst of CPU work: let other tasks (readers, viewers) in between.
        tokio::task::yield_now().await;
    }
}

/// Applies every item of a batch at one `now`, then publishes the flips.
///
/// Consecutive renewals go to the store together ([`presence_core::Store::renew_batch`]),
/// which applies each user's in order; a register or unregister between them
/// ends the run, so every item still sees exactly the items before it.
pub(crate) fn apply(context: &Context, batch: &LeaseBatchFrame, shed_renewals: bool) -> pb::LeaseResults {
    apply_hearing_rooms(context, batch, shed_renewals).results
}

/// A batch applied: its results, what the owners of the rooms it changed
/// answer, and its items held (by index, with their slots) because their
/// slots are frozen for a move out of this node (C7); each of those has a
/// refusal in `results` for now.
struct Applied {
    results: pb::LeaseResults,
    rooms_answered: tokio::sync::oneshot::Receiver<RoomAnswer>,
    held: Vec<(usize, u32)>,
}

/// Answers the items of `batch` held through a move's freeze (C7), in
/// `results`: once the freeze is over (or [`HOLD_THROUGH_FREEZE`] passed)
/// each is applied again here, which answers it if the move was given up;
/// one whose slot went to another node is sent on to it, as the caller. A
/// refusal left names the new owner and epoch when they are known.
async fn answer_held(
    context: &Arc<Context>,
    batch: &LeaseBatchFrame,
    caller: &Caller,
    held: Vec<(usize, u32)>,
    results: &mut pb::LeaseResults,
) {
    let metrics = context.metrics();
    metrics.requests_held.increment(held.len() as u64);
    let started = tokio::time::Instant::now();
    let mut slots: Vec<u32> = held.iter().map(|&(_, slot)| slot).collect();
    slots.sort_unstable();
    slots.dedup();
    context.placement.freeze_over(slots, started + HOLD_THROUGH_FREEZE).await;
    metrics.request_hold_seconds.record(started.elapsed().as_secs_f64());
    let again = LeaseBatchFrame {
        batch_id: results.batch_id,
        items: held.iter().map(|&(index, _)| batch.items[index].clone()).collect(),
        items_beyond_limit: 0,
    };
    let rooms = rooms_to_hear(context, &again);
    let Applied { results: answers, rooms_answered, .. } = apply_hearing_rooms(context, &again, false);
    let mut answers = match rooms {
        Some(rooms) => with_room_versions(Arc::clone(context), answers, &rooms, rooms_answered).await,
        None => answers,
    };
    if !caller.forwarded {
        send_on_to_owners(context, &again, caller, &mut answers.results).await;
    }
    for ((index, _), answer) in held.into_iter().zip(answers.results) {
        results.results[index] = answer;
    }
}

/// Sends each item of `batch` whose answer names another node as its owner
/// there, and puts that node's answer in its place (C7).
async fn send_on_to_owners(
    context: &Context,
    batch: &LeaseBatchFrame,
    caller: &Caller,
    answers: &mut [pb::LeaseResult],
) {
    let mut by_owner: std::collections::BTreeMap<String, Vec<usize>> = std::collections::BTreeMap::new();
    for (index, answer) in answers.iter().enumerate() {
        if let Some(owner) = answer.not_owner.as_ref().filter(|owner| !owner.owner_addr.is_empty()) {
            by_owner.entry(owner.owner_addr.clone()).or_default().push(index);
        }
    }
    for (address, indices) in by_owner {
        // Text that is not UTF-8 goes no further: it is refused here, naming the field.
        let mut items = Vec::with_capacity(indices.len());
        let mut sent = Vec::with_capacity(indices.len());
        for index in indices {
            match pb::LeaseItem::decode(batch.items[index].encode_to_vec().as_slice()) {
                Ok(item) => {
                    items.push(item);
                    sent.push(index);
                }
                Err(_) => {
                    answers[index] = wire::lease_refused(&ServiceError::invalid("items", "text that is not UTF-8"));
                }
            }
        }
        let forwarded = pb::LeaseBatch { batch_id: batch.batch_id, items };
        match context.placement.forward_leases(&address, forwarded, caller.authorization.clone()).await {
            Ok(owner_answers) if owner_answers.results.len() == sent.len() => {
                for (index, answer) in sent.into_iter().zip(owner_answers.results) {
                    answers[index] = answer;
                }
            }
            Ok(owner_answers) => tracing::warn!(
                address,
                sent = sent.len(),
                answered = owner_answers.results.len(),
                "a node answered a different number of lease items than it was sent; they are refused, naming it"
            ),
            Err(error) => tracing::debug!(address, %error, "lease items held through a freeze could not be sent on"),
        }
    }
}

/// When room facts leave the store (a cluster node), the room each item
/// names (Join, Leave, Signal), by item, whose version its owner answers;
/// `None` for a batch that names no room, and when the store answers room
/// versions itself (a single node).
fn rooms_to_hear(context: &Context, batch: &LeaseBatchFrame) -> Option<Vec<Option<String>>> {
    if !context.publisher.sends_room_facts() {
        return None;
    }
    let room_of = |item: &LeaseItemFrame| match &item.op {
        Some(LeaseOpFrame::Join(frame)) => Some(frame.room_id.clone()),
        Some(LeaseOpFrame::Leave(frame)) => Some(frame.room_id.clone()),
        Some(LeaseOpFrame::Signal(frame)) => Some(frame.room_id.clone()),
        _ => None,
    };
    batch.items.iter().any(|item| room_of(item).is_some()).then(|| {
        let name = |room_id: bytes::Bytes| String::from_utf8_lossy(&room_id).into_owned();
        batch.items.iter().map(|item| room_of(item).map(name)).collect()
    })
}

/// A batch's results with the room versions the rooms' owners answered (a
/// cluster node, C1): the version of each Join, Leave and Signal done is its
/// room's; if an owner did not take the facts, those items are refused as
/// the unary calls are (`UNAVAILABLE`: they may be made again).
async fn with_room_versions(
    context: Arc<Context>,
    mut results: pb::LeaseResults,
    rooms: &[Option<String>],
    answered: tokio::sync::oneshot::Receiver<RoomAnswer>,
) -> pb::LeaseResults {
    let heard = crate::node::context::hear_rooms(answered).await;
    for (result, room) in results.results.iter_mut().zip(rooms) {
        let Some(room) = room else { continue };
        if result.result.is_none() {
            continue;
        }
        match (&mut result.result, crate::node::context::room_version_after(&context, &heard, room).await) {
            (Some(lease_result::Result::Join(joined)), Ok(Some(version))) => joined.room_version = version,
            (Some(lease_result::Result::Leave(left)), Ok(Some(version))) => left.room_version = version,
            (Some(lease_result::Result::Signal(signalled)), Ok(Some(version))) => signalled.room_version = version,
            (Some(_), Err(refusal)) => *result = wire::lease_refused(&refusal),
            _ => {}
        }
    }
    results
}

/// [`apply`], with what the owners of the rooms the batch changed answer (see [`Context::apply_to_rooms`]).
fn apply_hearing_rooms(context: &Context, batch: &LeaseBatchFrame, shed_renewals: bool) -> Applied {
    let started = std::time::Instant::now();
    let metrics = context.metrics();
    let mut renewals = [0u64; RenewResult::COUNT];
    let mut results = Vec::with_capacity(batch.items.len());
    let mut held = Vec::new();
    // One look at the slot map for the whole batch (C2).
    let acting = context.placement.acting();
    let ((), answered) = context.apply_to_rooms(|store, now, changes| {
        let mut run: Vec<presence_core::Renewal<'_>> = Vec::new();
        for item in &batch.items {
            if let Some(user_id) = item.user_id()
                && let Err(refusal) = acting.check(user_id)
            {
                apply_renewals(store, now, &mut run, &mut results, changes, &mut renewals);
                match &refusal {
                    // Waits the freeze out; counted when applied again.
                    ServiceError::NotOwner(not_owner) if not_owner.frozen => held.push((results.len(), not_owner.slot)),
                    _ if matches!(&item.op, Some(LeaseOpFrame::Renew(_))) => {
                        renewals[RenewResult::NotOwner as usize] += 1;
                    }
                    _ => {}
                }
                results.push(wire::lease_refused(&refusal));
                continue;
            }
            if let Some(LeaseOpFrame::Renew(frame)) = &item.op
                && !shed_renewals
            {
                match wire::renew_frame(frame) {
                    Ok(input) if input.attention.is_empty() => run.push(input.renewal),
                    Ok(input) => {
                        // A change of attention (A1): this renewal on its own, in order.
                        apply_renewals(store, now, &mut run, &mut results, changes, &mut renewals);
                        let renewed = ops::renew_with_attention(store, now, &input, changes);
                        renewals[ops::renew_result(&renewed) as usize] += 1;
                        let answer = renewed.map(|renewed| wire::renew_response(&renewed)).map_err(ServiceError::from);
                        results.push(wire::lease_result(answer, lease_result::Result::Renew));
                    }
                    Err(refusal) => {
                        apply_renewals(store, now, &mut run, &mut results, changes, &mut renewals);
                        renewals[RenewResult::Invalid as usize] += 1;
                        results.push(wire::lease_refused(&refusal));
                    }
                }
                continue;
            }
            apply_renewals(store, now, &mut run, &mut results, changes, &mut renewals);
            let result = match &item.op {
                Some(LeaseOpFrame::Register(frame)) => match wire::register_frame(frame) {
                    Ok(input) => wire::lease_result(
                        ops::register(store, metrics, now, &input, changes)
                            .map(|registered| wire::register_response(input.user_id(), &registered)),
                        lease_result::Result::Register,
                    ),
                    Err(refusal) => {
                        metrics.registers_invalid.increment(1);
                        wire::lease_refused(&refusal)
                    }
                },
                Some(LeaseOpFrame::Renew(_)) => {
                    renewals[RenewResult::Shed as usize] += 1;
                    wire::lease_refused(&ServiceError::RenewalShed)
                }
                Some(LeaseOpFrame::Unregister(frame)) => match wire::unregister_frame(frame) {
                    Ok(input) => wire::lease_result(
                        ops::unregister(store, metrics, now, input, changes)
                            .map(|unregistered| wire::unregister_response(input.user_id, &unregistered)),
                        lease_result::Result::Unregister,
                    ),
                    Err(refusal) => wire::lease_refused(&refusal),
                },
                Some(LeaseOpFrame::Join(frame)) => wire::lease_result(
                    wire::join_frame(frame).and_then(|input| ops::join(store, metrics, now, &input, changes)),
                    lease_result::Result::Join,
                ),
                Some(LeaseOpFrame::Leave(frame)) => wire::lease_result(
                    wire::leave_frame(frame).and_then(|room| ops::leave(store, now, &room, changes)),
                    lease_result::Result::Leave,
                ),
                Some(LeaseOpFrame::Signal(frame)) => wire::lease_result(
                    wire::signal_frame(frame).and_then(|input| ops::signal(store, metrics, now, &input, changes)),
                    lease_result::Result::Signal,
                ),
                None => wire::lease_refused(&ServiceError::invalid("items", "an item names no operation")),
            };
            results.push(result);
        }
        apply_renewals(store, now, &mut run, &mut results, changes, &mut renewals);
    });
    for (result, count) in RenewResult::ALL.into_iter().zip(renewals) {
        metrics.renewals(result, count);
    }
    metrics.shed.increment(renewals[RenewResult::Shed as usize]);
    metrics.renewal_seconds.record(started.elapsed().as_secs_f64());
    Applied { results: pb::LeaseResults { batch_id: batch.batch_id, results }, rooms_answered: answered, held }
}

/// Applies a run of renewals, appends their answers to `results` and counts them.
fn apply_renewals(
    store: &presence_core::Store,
    now: u64,
    run: &mut Vec<presence_core::Renewal<'_>>,
    results: &mut Vec<pb::LeaseResult>,
    changes: &mut presence_core::Changes,
    counts: &mut [u64; RenewResult::COUNT],
) {
    if run.is_empty() {
        return;
    }
    for renewed in store.renew_batch(now, run, changes) {
        counts[ops::renew_result(&renewed) as usize] += 1;
        let answer = renewed.map(|renewed| wire::renew_response(&renewed)).map_err(ServiceError::from);
        results.push(wire::lease_result(answer, lease_result::Result::Renew));
    }
    run.clear();
}

/// Whether a decoded batch may be applied: a larger one ends its stream.
pub(crate) fn admit(batch: &LeaseBatchFrame) -> Result<(), ServiceError> {
    if batch.items_sent() > MAX_BATCH_ITEMS {
        return Err(ServiceError::invalid(
            "items",
            format!("{} items, more than the limit of {MAX_BATCH_ITEMS} per batch", batch.items_sent()),
        ));
    }
    Ok(())
}

/// The stream type the Leases RPC returns.
pub(crate) type LeasesStream = tokio_stream::wrappers::ReceiverStream<Result<pb::LeaseResults, Status>>;

/// Serves one gateway's Leases stream.
pub(crate) fn open(queue: LeaseQueue, mut inbound: Streaming<LeaseBatchFrame>, caller: Caller) -> LeasesStream {
    // Results wait here only while the gateway is slow to read; then this
    // stream stops reading batches, and HTTP/2 flow control pushes back.
    let (tx, rx) = mpsc::channel(4);
    let stopping = queue.context.stopping.clone();
    tokio::spawn(async move {
        loop {
            let batch = tokio::select! {
                batch = inbound.message() => batch,
                () = stopping.cancelled() => {
                    let _ = tx.send(Err(ServiceError::ShuttingDown.into())).await;
                    return;
                }
            };
            let batch = match batch {
                Ok(Some(batch)) => batch,
                Ok(None) => return,
                Err(status) => {
                    // An undecodable batch ends the stream: the gateway must see why.
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            };
            if let Err(refusal) = admit(&batch) {
                let _ = tx.send(Err(refusal.into())).await;
                return;
            }
            let results = queue.run(batch, &caller).await.map_err(Status::from);
            let failed = results.is_err();
            if tx.send(results).await.is_err() || failed {
                return;
            }
        }
    });
    LeasesStream::new(rx)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::node::clock::StoreClock;
    use crate::node::context::NodeConfig;
    use crate::node::testing::{EPOCH, ToldPlacement};
    use presence_core::{Store, StoreConfig};
    use presence_proto::v1::lease_item;
    use tokio_util::sync::CancellationToken;
    use tonic::Code;

    fn context() -> Arc<Context> {
        placed(Arc::new(crate::node::placement::SingleNode))
    }

    fn placed(placement: Arc<dyn crate::node::placement::Placement>) -> Arc<Context> {
        let clock = StoreClock::start();
        let config = StoreConfig { min_renew_interval_ms: 0, ..StoreConfig::default() };
        let store = Arc::new(Store::new(config, clock.now()).unwrap());
        Arc::new(Context::placed(store, clock, None, None, &NodeConfig::default(), CancellationToken::new(), placement))
    }

    fn register(user: &str) -> pb::LeaseItem {
        pb::LeaseItem {
            op: Some(lease_item::Op::Register(pb::RegisterRequest {
                user_id: user.into(),
                session_id: "s".into(),
                gateway_id: "gw".into(),
                ttl_ms: 0,
                ..Default::default()
            })),
        }
    }

    fn renew(user: &str, generation: u64) -> pb::LeaseItem {
        pb::LeaseItem {
            op: Some(lease_item::Op::Renew(pb::RenewRequest {
                user_id: user.into(),
                session_id: "s".into(),
                generation,
                ttl_ms: 0,
                ..Default::default()
            })),
        }
    }

    fn batch(items: Vec<pb::LeaseItem>) -> LeaseBatchFrame {
        LeaseBatchFrame::from(&pb::LeaseBatch { batch_id: 7, items })
    }

    #[tokio::test]
    async fn l8_every_item_gets_its_own_result_in_order_and_a_bad_one_fails_alone() {
        let context = context();
        let queue = LeaseQueue::start(Arc::clone(&context), 4, 1);
        let registered = queue.run(batch(vec![register("a"), register("b")]), &Caller::default()).await.unwrap();
        let generation = |index: usize| match &registered.results[index].result {
            Some(lease_result::Result::Register(response)) => response.generation,
            other => panic!("{other:?}"),
        };
        let items = vec![renew("a", generation(0)), register(""), renew("nobody", 1), renew("b", generation(1))];
        let results = queue.run(batch(items), &Caller::default()).await.unwrap();
        assert_eq!(results.batch_id, 7);
        let codes: Vec<Code> = results.results.iter().map(|r| Code::from(r.code as i32)).collect();
        assert_eq!(codes, [Code::Ok, Code::InvalidArgument, Code::NotFound, Code::Ok]);
        assert!(results.results[1].message.contains("user_id"));
    }

    #[tokio::test]
    async fn c2_items_of_users_another_node_owns_are_refused_naming_it_and_the_others_applied_in_order() {
        let told = ToldPlacement::default().owned_elsewhere("b", "node-b", "10.0.0.2:7000");
        let context = placed(Arc::new(told));
        let codes = |results: &pb::LeaseResults| -> Vec<Code> {
            results.results.iter().map(|result| Code::from(result.code as i32)).collect()
        };
        let registered = apply(&context, &batch(vec![register("a"), register("b"), register("c")]), false);
        assert_eq!(codes(&registered), [Code::Ok, Code::Unavailable, Code::Ok]);
        let owner = registered.results[1].not_owner.as_ref().expect("the refusal names the owner");
        let named = (owner.slot, owner.epoch, owner.owner_id.as_str(), owner.owner_addr.as_str());
        assert_eq!(named, (presence_core::slot_of("b", 1024), EPOCH, "node-b", "10.0.0.2:7000"));
        assert!(registered.results[0].not_owner.is_none() && registered.results[2].not_owner.is_none());
        let mut changes = presence_core::Changes::default();
        let seen = context.store().snapshot(context.now(), &["a", "b", "c"], &mut changes).unwrap();
        let states: Vec<presence_core::State> = seen.iter().map(|presence| presence.state).collect();
        let (online, offline) = (presence_core::State::Online, presence_core::State::Offline);
        assert_eq!(states, [online, offline, online], "nothing is changed for the refused user");

        // A refusal amid renewals answers in its place; those around it are applied.
        let generation = |index: usize| match &registered.results[index].result {
            Some(lease_result::Result::Register(response)) => response.generation,
            other => panic!("{other:?}"),
        };
        let items =
            vec![renew("a", generation(0)), renew("b", 1), renew("c", generation(2)), renew("a", generation(0))];
        let renewed = apply(&context, &batch(items), false);
        assert_eq!(codes(&renewed), [Code::Ok, Code::Unavailable, Code::Ok, Code::Ok]);
        assert!(renewed.results[1].not_owner.as_ref().is_some_and(|owner| owner.owner_id == "node-b"));
        for index in [0, 2, 3] {
            let renewal = &renewed.results[index].result;
            assert!(matches!(renewal, Some(lease_result::Result::Renew(_))), "{index}: {renewal:?}");
        }
    }

    #[tokio::test]
    async fn c7_a_held_item_is_answered_by_the_slots_new_owner_and_one_sent_on_by_another_node_goes_no_further() {
        let told = Arc::new(ToldPlacement::default().moving("m", "node-b", "10.0.0.2:7000"));
        let context = placed(told.clone());
        let queue = LeaseQueue::start(Arc::clone(&context), 4, 1);
        let results = queue.run(batch(vec![register("a"), register("m"), register("c")]), &Caller::default()).await;
        let results = results.unwrap().results;
        assert!(results.iter().all(|result| result.code == Code::Ok as u32), "{results:?}");
        assert_eq!(results[1].message, "taken at 10.0.0.2:7000", "the new owner's answer is the item's");
        for index in [0, 2] {
            assert!(matches!(results[index].result, Some(lease_result::Result::Register(_))), "applied here");
        }
        let sent_on = told.sent_on();
        assert_eq!(sent_on.len(), 1, "{sent_on:?}");
        assert_eq!((sent_on[0].0.as_str(), sent_on[0].1.batch_id), ("10.0.0.2:7000", 7));
        assert_eq!(sent_on[0].1.items, [register("m")], "only the held item is sent on");
        let mut changes = presence_core::Changes::default();
        let seen = context.store().snapshot(context.now(), &["m"], &mut changes).unwrap();
        assert_eq!(seen[0].state, presence_core::State::Offline, "the held item is not applied here");

        // Items another node sent on wait the same, but go no further: their
        // answer names the new owner.
        let told = Arc::new(ToldPlacement::default().moving("m", "node-b", "10.0.0.2:7000"));
        let queue = LeaseQueue::start(placed(told.clone()), 4, 1);
        let forwarded = Caller { authorization: None, forwarded: true };
        let results = queue.run(batch(vec![register("m")]), &forwarded).await.unwrap().results;
        assert_eq!(results[0].code, Code::Unavailable as u32);
        let owner = results[0].not_owner.as_ref().expect("the refusal names the new owner");
        assert_eq!((owner.owner_id.as_str(), owner.owner_addr.as_str()), ("node-b", "10.0.0.2:7000"));
        assert!(told.sent_on().is_empty());
    }

    #[tokio::test]
    async fn l8_an_item_whose_text_is_not_utf8_is_refused_alone_naming_the_field() {
        let context = context();
        let queue = LeaseQueue::start(Arc::clone(&context), 4, 1);
        let registered = queue.run(batch(vec![register("a")]), &Caller::default()).await.unwrap();
        let Some(lease_result::Result::Register(a)) = &registered.results[0].result else { panic!("{registered:?}") };
        let not_utf8 = bytes::Bytes::from_static(&[0xff, 0xfe]);
        let unregister = |user: &str| pb::LeaseItem {
            op: Some(lease_item::Op::Unregister(pb::UnregisterRequest {
                user_id: user.into(),
                session_id: "s".into(),
                generation: 1,
                linger_ms: 0,
            })),
        };
        let mut items = batch(vec![
            renew("a", a.generation),
            renew("a", a.generation),
            register("b"),
            register("c"),
            unregister("d"),
            renew("a", a.generation),
        ]);
        let Some(LeaseOpFrame::Renew(bad)) = &mut items.items[1].op else { unreachable!("a renewal") };
        bad.session_id = not_utf8.clone();
        let Some(LeaseOpFrame::Register(bad)) = &mut items.items[2].op else { unreachable!("a register") };
        bad.gateway_id = not_utf8.clone();
        let Some(LeaseOpFrame::Unregister(bad)) = &mut items.items[4].op else { unreachable!("an unregister") };
        bad.user_id = not_utf8;
        let results = queue.run(items, &Caller::default()).await.unwrap();
        let codes: Vec<Code> = results.results.iter().map(|r| Code::from(r.code as i32)).collect();
        let invalid = Code::InvalidArgument;
        assert_eq!(codes, [Code::Ok, invalid, invalid, Code::Ok, invalid, Code::Ok]);
        for (index, field) in [(1, "session_id:"), (2, "gateway_id:"), (4, "user_id:")] {
            assert!(results.results[index].message.starts_with(field), "{:?}", results.results[index]);
        }
        let mut changes = presence_core::Changes::default();
        let seen = context.store().snapshot(context.now(), &["b", "c"], &mut changes).unwrap();
        let states: Vec<presence_core::State> = seen.iter().map(|p| p.state).collect();
        assert_eq!(states, [presence_core::State::Offline, presence_core::State::Online], "only c registered");
    }

    #[tokio::test]
    async fn b2_a_full_queue_sheds_renewals_at_once_and_makes_registers_wait() {
        let context = context();
        // No workers yet: the queue (one batch) fills and stays full.
        let (queue, queues) = LeaseQueue::new(Arc::clone(&context), 1);
        let first = tokio::spawn({
            let queue = queue.clone();
            async move { queue.run(batch(vec![register("a")]), &Caller::default()).await }
        });
        while !queue.is_overloaded() {
            tokio::task::yield_now().await;
        }

        // A batch of renewals only is answered at once, every item RESOURCE_EXHAUSTED.
        let shed = queue.run(batch(vec![renew("a", 1), renew("b", 1)]), &Caller::default()).await.unwrap();
        assert!(shed.results.iter().all(|r| r.code == Code::ResourceExhausted as u32), "{shed:?}");

        // A batch with a register waits for room: it is not dropped and not answered yet.
        let mixed = tokio::spawn({
            let queue = queue.clone();
            async move { queue.run(batch(vec![renew("a", 1), register("c")]), &Caller::default()).await }
        });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!mixed.is_finished(), "a register must wait for the queue, not be dropped");

        // Workers start: everything queued is applied; the waiting batch's renewal was shed, its register applied.
        for _ in 0..2 {
            tokio::spawn(work(Arc::clone(&context), queues.clone()));
        }
        assert_eq!(first.await.unwrap().unwrap().results[0].code, Code::Ok as u32);
        let mixed = mixed.await.unwrap().unwrap();
        assert_eq!(mixed.results[0].code, Code::ResourceExhausted as u32);
        assert_eq!(mixed.results[1].code, Code::Ok as u32);
        let mut changes = presence_core::Changes::default();
        let presences = context.store().snapshot(context.now(), &["a", "c"], &mut changes).unwrap();
        assert!(presences.iter().all(|p| p.state == presence_core::State::Online));
    }

    #[tokio::test]
    async fn b2_a_waiting_register_batch_goes_before_renewals_that_find_room_after_it() {
        let context = context();
        let (queue, queues) = LeaseQueue::new(Arc::clone(&context), 1);
        let with_id = |batch_id, items| LeaseBatchFrame::from(&pb::LeaseBatch { batch_id, items });
        let first = tokio::spawn({
            let queue = queue.clone();
            let first = with_id(1, vec![register("a")]);
            async move { queue.run(first, &Caller::default()).await }
        });
        while !queue.is_overloaded() {
            tokio::task::yield_now().await;
        }
        let waiting = tokio::spawn({
            let queue = queue.clone();
            let waiting = with_id(2, vec![register("b")]);
            async move { queue.run(waiting, &Caller::default()).await }
        });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!waiting.is_finished(), "the register batch waits for room");

        // A worker takes a batch. If that gives the queue room, a batch of renewals finds
        // it before the waiting batch's task runs again (under a flood of renewals, one
        // always does). It must not be applied before the waiting register batch.
        let mut taken = vec![next_job(&queues, &context.stopping).await.expect("a batch")];
        let caller = Caller::default();
        let mut renewals = std::pin::pin!(queue.run(with_id(3, vec![renew("a", 1)]), &caller));
        let _ = renewals.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop()));
        while !taken.iter().any(|job| job.batch.batch_id == 2) {
            taken.push(next_job(&queues, &context.stopping).await.expect("a batch"));
        }
        let order: Vec<u64> = taken.iter().map(|job| job.batch.batch_id).collect();
        assert!(!order.contains(&3), "renewals went before the waiting register batch: {order:?}");
        drop((first, waiting, taken));
    }
}
