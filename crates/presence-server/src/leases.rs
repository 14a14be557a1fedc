//! The Leases stream (L8) and the bounded queue that admits its batches (B2).
//!
//! A gateway's stream is read by its own task, which decodes a batch, hands it
//! to the lease queue and waits for the results before reading the next one,
//! so one stream's batches apply in order. A fixed set of workers drains the
//! queue. The queue is bounded: when it is full the server is behind, and a
//! batch's renewals are shed at once, each answered `RESOURCE_EXHAUSTED` (the
//! next heartbeat carries the same information), while its registers and
//! unregisters wait for room: they are never dropped, and the wait pushes back
//! on the gateway through its stream.

use std::sync::Arc;

use presence_proto::lease_frames::{
    LeaseBatchFrame, LeaseItemFrame, LeaseOpFrame, RegisterFrame, RenewFrame, UnregisterFrame,
};
use presence_proto::v1::{self as pb, lease_result};
use tokio::sync::{mpsc, oneshot};
use tonic::{Code, Status, Streaming};

use crate::context::Context;
use crate::metrics::RenewResult;
use crate::ops;

/// Most items one batch may carry.
pub const MAX_BATCH_ITEMS: usize = 10_000;

/// What a worker is given.
#[derive(Debug)]
struct Job {
    batch: LeaseBatchFrame,
    /// Answer the batch's renewals `RESOURCE_EXHAUSTED` instead of applying them.
    shed_renewals: bool,
    reply: oneshot::Sender<pb::LeaseResults>,
}

/// The bounded queue between Leases streams and the workers that apply batches.
#[derive(Debug, Clone)]
pub(crate) struct LeaseQueue {
    jobs: async_channel::Sender<Job>,
    context: Arc<Context>,
}

impl LeaseQueue {
    /// A queue of `capacity` batches, without workers (see [`LeaseQueue::spawn_workers`]).
    fn new(context: Arc<Context>, capacity: usize) -> (Self, async_channel::Receiver<Job>) {
        let (jobs, receiver) = async_channel::bounded(capacity.max(1));
        (LeaseQueue { jobs, context }, receiver)
    }

    /// A queue of `capacity` batches drained by `workers` tasks.
    pub(crate) fn start(context: Arc<Context>, capacity: usize, workers: usize) -> Self {
        let (queue, receiver) = Self::new(context, capacity);
        for _ in 0..workers.max(1) {
            tokio::spawn(work(Arc::clone(&queue.context), receiver.clone()));
        }
        queue
    }

    /// Whether the queue is full: the server is behind, and renewals are shed.
    pub(crate) fn is_overloaded(&self) -> bool {
        self.jobs.is_full()
    }

    /// Applies a batch and returns its results, in item order.
    async fn run(&self, batch: LeaseBatchFrame) -> Result<pb::LeaseResults, Status> {
        let (reply, results) = oneshot::channel();
        let job = Job { batch, shed_renewals: false, reply };
        match self.jobs.try_send(job) {
            Ok(()) => {}
            Err(async_channel::TrySendError::Full(mut job)) => {
                job.shed_renewals = true;
                let only_renewals = job.batch.items.iter().all(is_renewal);
                if only_renewals {
                    // Nothing in it must wait: answer at once, without a worker.
                    return Ok(apply(&self.context, job.batch, true));
                }
                tokio::select! {
                    sent = self.jobs.send(job) => sent.map_err(|_| stopping())?,
                    () = self.context.stopping.cancelled() => return Err(stopping()),
                }
            }
            Err(async_channel::TrySendError::Closed(_)) => return Err(stopping()),
        }
        self.context.metrics.queue_depth.set(self.jobs.len() as f64);
        // On shutdown the workers stop: a batch still queued is answered here.
        tokio::select! {
            results = results => results.map_err(|_| stopping()),
            () = self.context.stopping.cancelled() => Err(stopping()),
        }
    }
}

fn stopping() -> Status {
    Status::unavailable("presenced is shutting down; reconnect")
}

fn is_renewal(item: &LeaseItemFrame) -> bool {
    matches!(item.op, Some(LeaseOpFrame::Renew(_)))
}

/// A worker: applies queued batches until the queue closes or the server stops.
async fn work(context: Arc<Context>, jobs: async_channel::Receiver<Job>) {
    loop {
        let job = tokio::select! {
            job = jobs.recv() => match job { Ok(job) => job, Err(_) => return },
            () = context.stopping.cancelled() => return,
        };
        let results = apply(&context, job.batch, job.shed_renewals);
        let _ = job.reply.send(results);
        // A batch is a burst of CPU work: let other tasks (readers, viewers) in between.
        tokio::task::yield_now().await;
    }
}

/// Applies every item of a batch at one `now`, then publishes the flips.
///
/// Consecutive renewals go to the store together ([`presence_core::Store::renew_batch`]),
/// which applies each user's in order; a register or unregister between them
/// ends the run, so every item still sees exactly the items before it.
fn apply(context: &Context, batch: LeaseBatchFrame, shed_renewals: bool) -> pb::LeaseResults {
    let started = std::time::Instant::now();
    let now = context.clock.now();
    let metrics = &context.metrics;
    let mut changes = Vec::new();
    let mut renewals = [0u64; 6];
    let mut results = Vec::with_capacity(batch.items.len());
    let mut run: Vec<presence_core::Renewal<'_>> = Vec::new();
    for item in &batch.items {
        if let Some(LeaseOpFrame::Renew(frame)) = &item.op
            && !shed_renewals
        {
            match renewal_of(frame) {
                Ok(renewal) => run.push(renewal),
                Err(refusal) => {
                    apply_renewals(context, now, &mut run, &mut results, &mut changes, &mut renewals);
                    renewals[RenewResult::Invalid as usize] += 1;
                    results.push(refused(&refusal));
                }
            }
            continue;
        }
        apply_renewals(context, now, &mut run, &mut results, &mut changes, &mut renewals);
        let result = match &item.op {
            Some(LeaseOpFrame::Register(frame)) => match register_of(frame) {
                Ok(request) => answer(
                    ops::register(&context.store, metrics, now, &request, &mut changes),
                    lease_result::Result::Register,
                ),
                Err(refusal) => {
                    metrics.registers_invalid.increment(1);
                    refused(&refusal)
                }
            },
            Some(LeaseOpFrame::Renew(_)) => {
                renewals[RenewResult::Shed as usize] += 1;
                refused(&Status::resource_exhausted(
                    "renewal shed: the server is overloaded; the next heartbeat carries the same information",
                ))
            }
            Some(LeaseOpFrame::Unregister(frame)) => match unregister_of(frame) {
                Ok(request) => answer(
                    ops::unregister(&context.store, metrics, now, &request, &mut changes),
                    lease_result::Result::Unregister,
                ),
                Err(refusal) => refused(&refusal),
            },
            None => refused(&Status::invalid_argument("items: an item names no operation")),
        };
        results.push(result);
    }
    apply_renewals(context, now, &mut run, &mut results, &mut changes, &mut renewals);
    for (result, count) in RenewResult::ALL.into_iter().zip(renewals) {
        metrics.renewals(result, count);
    }
    metrics.shed.increment(renewals[RenewResult::Shed as usize]);
    metrics.renewal_seconds.record(started.elapsed().as_secs_f64());
    context.publish(&changes);
    pb::LeaseResults { batch_id: batch.batch_id, results }
}

/// A renewal item's ids as text; bytes that are not UTF-8 refuse the item alone,
/// as the unary `Renew` refuses such a request.
fn renewal_of(frame: &RenewFrame) -> Result<presence_core::Renewal<'_>, Status> {
    Ok(presence_core::Renewal {
        user_id: utf8("user_id", &frame.user_id)?,
        session_id: utf8("session_id", &frame.session_id)?,
        generation: frame.generation,
        ttl_ms: frame.ttl_ms,
    })
}

/// A register item as the request the unary `Register` takes; text that is
/// not UTF-8 refuses the item alone. A later metadata entry for a key replaces
/// an earlier one, as in a decoded `map`.
fn register_of(frame: &RegisterFrame) -> Result<pb::RegisterRequest, Status> {
    let mut metadata = std::collections::HashMap::with_capacity(frame.metadata.len());
    for entry in &frame.metadata {
        metadata.insert(utf8("metadata", &entry.key)?.to_owned(), utf8("metadata", &entry.value)?.to_owned());
    }
    Ok(pb::RegisterRequest {
        user_id: utf8("user_id", &frame.user_id)?.to_owned(),
        session_id: utf8("session_id", &frame.session_id)?.to_owned(),
        gateway_id: utf8("gateway_id", &frame.gateway_id)?.to_owned(),
        ttl_ms: frame.ttl_ms,
        metadata,
    })
}

/// An unregister item as the request the unary `Unregister` takes.
fn unregister_of(frame: &UnregisterFrame) -> Result<pb::UnregisterRequest, Status> {
    Ok(pb::UnregisterRequest {
        user_id: utf8("user_id", &frame.user_id)?.to_owned(),
        session_id: utf8("session_id", &frame.session_id)?.to_owned(),
        generation: frame.generation,
        linger_ms: frame.linger_ms,
    })
}

fn utf8<'a>(field: &str, bytes: &'a [u8]) -> Result<&'a str, Status> {
    std::str::from_utf8(bytes)
        .map_err(|_| Status::invalid_argument(format!("{field}: invalid string value: data is not UTF-8 encoded")))
}

/// Applies a run of renewals, appends their answers to `results` and counts them.
fn apply_renewals(
    context: &Context,
    now: u64,
    run: &mut Vec<presence_core::Renewal<'_>>,
    results: &mut Vec<pb::LeaseResult>,
    changes: &mut presence_core::Changes,
    counts: &mut [u64; 6],
) {
    if run.is_empty() {
        return;
    }
    for renewed in context.store.renew_batch(now, run, changes) {
        let (counted, result) = ops::renew_answer(renewed);
        counts[counted as usize] += 1;
        results.push(answer(result, lease_result::Result::Renew));
    }
    run.clear();
}

fn answer<T>(result: Result<T, Status>, wrap: impl FnOnce(T) -> lease_result::Result) -> pb::LeaseResult {
    match result {
        Ok(response) => pb::LeaseResult { code: Code::Ok as u32, message: String::new(), result: Some(wrap(response)) },
        Err(status) => refused(&status),
    }
}

fn refused(status: &Status) -> pb::LeaseResult {
    pb::LeaseResult { code: status.code() as u32, message: status.message().to_owned(), result: None }
}

/// The stream type the Leases RPC returns.
pub type LeasesStream = tokio_stream::wrappers::ReceiverStream<Result<pb::LeaseResults, Status>>;

/// Serves one gateway's Leases stream.
pub(crate) fn open(queue: LeaseQueue, mut inbound: Streaming<LeaseBatchFrame>) -> LeasesStream {
    // Results wait here only while the gateway is slow to read; then this
    // stream stops reading batches, and HTTP/2 flow control pushes back.
    let (tx, rx) = mpsc::channel(4);
    let stopping = queue.context.stopping.clone();
    tokio::spawn(async move {
        loop {
            let batch = tokio::select! {
                batch = inbound.message() => batch,
                () = stopping.cancelled() => {
                    let _ = tx.send(Err(stopping_status())).await;
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
            if batch.items.len() > MAX_BATCH_ITEMS {
                let refusal = Status::invalid_argument(format!(
                    "items: {} items, more than the limit of {MAX_BATCH_ITEMS} per batch",
                    batch.items.len()
                ));
                let _ = tx.send(Err(refusal)).await;
                return;
            }
            let results = queue.run(batch).await;
            let failed = results.is_err();
            if tx.send(results).await.is_err() || failed {
                return;
            }
        }
    });
    LeasesStream::new(rx)
}

fn stopping_status() -> Status {
    stopping()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::StoreClock;
    use crate::hub::Hub;
    use crate::metrics::Metrics;
    use presence_core::{Store, StoreConfig};
    use presence_proto::v1::lease_item;
    use tokio_util::sync::CancellationToken;

    fn context() -> Arc<Context> {
        let clock = StoreClock::start();
        let config = StoreConfig { min_renew_interval_ms: 0, ..StoreConfig::default() };
        Arc::new(Context {
            store: Arc::new(Store::new(config, clock.now()).unwrap()),
            hub: Arc::new(Hub::default()),
            clock,
            metrics: Metrics::new(),
            watch_buffer: 16,
            stopping: CancellationToken::new(),
            activity: Arc::new(crate::activity::Activity::new(None, std::time::Duration::from_secs(60))),
            settings: crate::settings::Settings::Memory(Default::default()),
            durable: None,
            relations: parking_lot::RwLock::new(crate::privacy::Relations::new(crate::privacy::Visibility::Audience)),
            relations_writer: tokio::sync::Mutex::new(()),
            last_seen_granularity_ms: 300_000,
            auth: crate::auth::Authenticator::new(crate::auth::AuthConfig::default()).unwrap(),
        })
    }

    fn register(user: &str) -> pb::LeaseItem {
        pb::LeaseItem {
            op: Some(lease_item::Op::Register(pb::RegisterRequest {
                user_id: user.into(),
                session_id: "s".into(),
                gateway_id: "gw".into(),
                ttl_ms: 0,
                metadata: Default::default(),
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
        let registered = queue.run(batch(vec![register("a"), register("b")])).await.unwrap();
        let generation = |index: usize| match &registered.results[index].result {
            Some(lease_result::Result::Register(response)) => response.generation,
            other => panic!("{other:?}"),
        };
        let items = vec![renew("a", generation(0)), register(""), renew("nobody", 1), renew("b", generation(1))];
        let results = queue.run(batch(items)).await.unwrap();
        assert_eq!(results.batch_id, 7);
        let codes: Vec<Code> = results.results.iter().map(|r| Code::from(r.code as i32)).collect();
        assert_eq!(codes, [Code::Ok, Code::InvalidArgument, Code::NotFound, Code::Ok]);
        assert!(results.results[1].message.contains("user_id"));
    }

    #[tokio::test]
    async fn l8_an_item_whose_text_is_not_utf8_is_refused_alone_naming_the_field() {
        let context = context();
        let queue = LeaseQueue::start(Arc::clone(&context), 4, 1);
        let registered = queue.run(batch(vec![register("a")])).await.unwrap();
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
        let results = queue.run(items).await.unwrap();
        let codes: Vec<Code> = results.results.iter().map(|r| Code::from(r.code as i32)).collect();
        let invalid = Code::InvalidArgument;
        assert_eq!(codes, [Code::Ok, invalid, invalid, Code::Ok, invalid, Code::Ok]);
        for (index, field) in [(1, "session_id:"), (2, "gateway_id:"), (4, "user_id:")] {
            assert!(results.results[index].message.starts_with(field), "{:?}", results.results[index]);
        }
        let mut changes = Vec::new();
        let seen = context.store.snapshot(context.clock.now(), &["b", "c"], &mut changes).unwrap();
        let states: Vec<presence_core::State> = seen.iter().map(|p| p.state).collect();
        assert_eq!(states, [presence_core::State::Offline, presence_core::State::Online], "only c registered");
    }

    #[tokio::test]
    async fn b2_a_full_queue_sheds_renewals_at_once_and_makes_registers_wait() {
        let context = context();
        // No workers yet: the queue (one batch) fills and stays full.
        let (queue, jobs) = LeaseQueue::new(Arc::clone(&context), 1);
        let first = tokio::spawn({
            let queue = queue.clone();
            async move { queue.run(batch(vec![register("a")])).await }
        });
        while !queue.is_overloaded() {
            tokio::task::yield_now().await;
        }

        // A batch of renewals only is answered at once, every item RESOURCE_EXHAUSTED.
        let shed = queue.run(batch(vec![renew("a", 1), renew("b", 1)])).await.unwrap();
        assert!(shed.results.iter().all(|r| r.code == Code::ResourceExhausted as u32), "{shed:?}");

        // A batch with a register waits for room: it is not dropped and not answered yet.
        let mixed = tokio::spawn({
            let queue = queue.clone();
            async move { queue.run(batch(vec![renew("a", 1), register("c")])).await }
        });
        for _ in 0..100 {
            tokio::task::yield_now().await;
        }
        assert!(!mixed.is_finished(), "a register must wait for the queue, not be dropped");

        // Workers start: everything queued is applied; the waiting batch's renewal was shed, its register applied.
        for _ in 0..2 {
            tokio::spawn(work(Arc::clone(&context), jobs.clone()));
        }
        assert_eq!(first.await.unwrap().unwrap().results[0].code, Code::Ok as u32);
        let mixed = mixed.await.unwrap().unwrap();
        assert_eq!(mixed.results[0].code, Code::ResourceExhausted as u32);
        assert_eq!(mixed.results[1].code, Code::Ok as u32);
        let mut changes = Vec::new();
        let presences = context.store.snapshot(context.clock.now(), &["a", "c"], &mut changes).unwrap();
        assert!(presences.iter().all(|p| p.state == presence_core::State::Online));
    }
}
