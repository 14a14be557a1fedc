//! Batching, pipelined access to the `Leases` stream (L8).
//!
//! This module owns one long-lived `Leases` stream per [`LeaseChannel`] and the
//! background task (the *driver*) that feeds it. Submitters hand items to the
//! driver over a bounded queue and wait on a oneshot for their own result; the
//! driver coalesces items into batches, keeps at most `max_in_flight_batches`
//! of them unanswered, matches each `LeaseResults` to its batch by `batch_id`
//! and hands every item its result. It must not queue without bound: when the
//! stream is full or down the driver stops reading the queue, and submitters
//! wait in `send`.
//!
//! A broken stream fails the items it carried with `UNAVAILABLE` (the server may
//! or may not have applied them) and is reopened with backoff and jitter when
//! the next batch is ready to go: the batch rides on the new stream while it
//! opens, and fails with it if it cannot be opened, so no submitter waits longer
//! than about one backoff period plus one connection attempt. A stream that
//! stays silent while a batch waits longer than `response_timeout` counts as
//! broken too.

use std::collections::HashMap;
use std::fmt;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, lease_item, lease_result};
use tokio::sync::{mpsc, oneshot};
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

use crate::transport::{self, ClientTlsConfig};
use tonic::{Code, Response, Status, Streaming};

use tonic::metadata::MetadataValue;

use crate::backoff::Backoff;
use crate::error::ClientError;

/// Metadata on a batch's failure when the stream it was queued on never
/// opened: nothing of it reached the server, so it may be sent elsewhere.
pub(crate) const UNSENT: &str = "presenced-unsent";

/// How a [`LeaseChannel`] batches, pipelines and reconnects.
#[derive(Debug, Clone, PartialEq)]
pub struct LeaseChannelConfig {
    /// Items per `LeaseBatch`; a batch is sent as soon as it holds this many
    /// (0 is taken as 1).
    pub max_batch: usize,
    /// How long an item may wait for its batch to fill before the batch is sent anyway.
    pub max_delay: Duration,
    /// Batches sent and not yet answered; beyond it submitters wait (0 is taken as 1).
    pub max_in_flight_batches: usize,
    /// Delays between attempts to reopen a broken stream.
    pub reconnect: Backoff,
    /// A stream whose oldest unanswered batch has waited this long is taken as
    /// broken (its items fail with `UNAVAILABLE`) and reopened: a server that
    /// stopped answering without closing the connection must not hold
    /// submitters for ever.
    pub response_timeout: Duration,
    /// Sent as `authorization: Bearer <token>` when the stream opens: the
    /// gateway's service token, when the server requires credentials.
    pub bearer_token: Option<String>,
    /// TLS for `https://` addresses (T1): the server's CA, a client
    /// certificate for mutual TLS, a server name. `None` dials `https://`
    /// with the system's trusted roots.
    pub tls: Option<ClientTlsConfig>,
}

impl Default for LeaseChannelConfig {
    /// 512 items or 1 ms per batch, 8 batches in flight, reconnects from 50 ms
    /// to 5 s, answers within 10 s.
    fn default() -> Self {
        LeaseChannelConfig {
            max_batch: 512,
            max_delay: Duration::from_millis(1),
            max_in_flight_batches: 8,
            reconnect: Backoff::default(),
            response_timeout: Duration::from_secs(10),
            bearer_token: None,
            tls: None,
        }
    }
}

/// Counters of a [`LeaseChannel`] since it was created, shared by all its clones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LeaseChannelStats {
    /// `LeaseBatch` messages sent.
    pub batches_sent: u64,
    /// Items sent, over all batches.
    pub items_sent: u64,
    /// `Leases` streams opened (the first one included).
    pub streams_opened: u64,
    /// Streams that broke or could not be opened.
    pub streams_broken: u64,
}

/// Batching, pipelined access to the Leases stream. Cheap to clone; all clones share one stream.
///
/// Items submitted one at a time ([`register`](Self::register), [`renew`](Self::renew),
/// [`unregister`](Self::unregister), [`join`](Self::join), [`leave`](Self::leave),
/// [`signal`](Self::signal)) are coalesced into batches by a background task,
/// which is spawned on the current Tokio runtime and stops when the last clone is dropped.
#[derive(Clone)]
pub struct LeaseChannel {
    /// The driver's bounded queue; its capacity is the only buffer between submitters and the stream.
    submissions: mpsc::Sender<Submission>,
    /// Configuration and counters, shared with the driver.
    shared: Arc<Shared>,
}

impl fmt::Debug for LeaseChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LeaseChannel").field("config", &self.shared.config).field("stats", &self.stats()).finish()
    }
}

impl LeaseChannel {
    /// Connects to `endpoint` (for instance `http://127.0.0.1:50051`) and starts the batching task.
    ///
    /// The connection is made eagerly, so that a wrong address fails here; the
    /// `Leases` stream itself opens with the first batch. HTTP/2 keep-alives are
    /// on, so that a server that vanished without closing the connection is
    /// noticed within seconds and the stream reopened.
    pub async fn connect(endpoint: impl Into<String>, config: LeaseChannelConfig) -> Result<Self, ClientError> {
        let channel = transport::connect(&endpoint.into(), config.tls.as_ref()).await?;
        Ok(Self::from_channel(channel, config))
    }

    /// Like [`connect`](Self::connect), but the connection is made by the
    /// first batch: for clients that open channels to many servers as they
    /// learn of them (a cluster's nodes).
    pub fn connect_lazy(endpoint: &str, config: LeaseChannelConfig) -> Result<Self, ClientError> {
        Ok(Self::from_channel(transport::connect_lazy(endpoint, config.tls.as_ref())?, config))
    }

    /// From an existing tonic Channel (tests, custom TLS...).
    ///
    /// # Panics
    ///
    /// Outside a Tokio runtime, since it spawns the batching task.
    pub fn from_channel(channel: Channel, config: LeaseChannelConfig) -> Self {
        let config = LeaseChannelConfig {
            max_batch: config.max_batch.max(1),
            max_in_flight_batches: config.max_in_flight_batches.max(1),
            ..config
        };
        let shared = Arc::new(Shared { config, counters: Counters::default() });
        let (submissions, queue) = mpsc::channel(shared.config.max_batch);
        tokio::spawn(Driver::new(PresenceClient::new(channel), queue, Arc::clone(&shared)).run());
        LeaseChannel { submissions, shared }
    }

    /// The configuration in force (with zero limits raised to 1).
    pub fn config(&self) -> &LeaseChannelConfig {
        &self.shared.config
    }

    /// Counters since the channel was created.
    pub fn stats(&self) -> LeaseChannelStats {
        let c = &self.shared.counters;
        LeaseChannelStats {
            batches_sent: c.batches_sent.load(Ordering::Relaxed),
            items_sent: c.items_sent.load(Ordering::Relaxed),
            streams_opened: c.streams_opened.load(Ordering::Relaxed),
            streams_broken: c.streams_broken.load(Ordering::Relaxed),
        }
    }

    // register, renew, unregister, join, leave and signal, each one item of a batch.
    lease_item_calls!();

    /// Sends these items as one batch (bypassing the coalescing), for load generators; results in item order.
    ///
    /// The outer error is the batch's: the stream broke (`UNAVAILABLE`) or could
    /// not be opened. Each item's own outcome is in its `LeaseResult` (see
    /// [`lease_result`](crate::lease_result)).
    pub async fn submit_batch(&self, items: Vec<pb::LeaseItem>) -> Result<Vec<pb::LeaseResult>, Status> {
        if items.is_empty() {
            return Ok(Vec::new());
        }
        let (reply, answer) = oneshot::channel();
        self.submissions.send(Submission::Batch(items, reply)).await.map_err(|_| driver_gone())?;
        answer.await.map_err(|_| driver_gone())?
    }

    async fn submit_item(&self, op: lease_item::Op) -> Result<lease_result::Result, Status> {
        let (reply, answer) = oneshot::channel();
        let item = pb::LeaseItem { op: Some(op), ..Default::default() };
        self.submissions.send(Submission::Item(item, reply)).await.map_err(|_| driver_gone())?;
        lease_result(answer.await.map_err(|_| driver_gone())??)
    }
}

/// One item's `LeaseResult` as a `Result`: its payload when `code` is OK, otherwise
/// `Status::new(Code::from(code), message)`.
pub fn lease_result(result: pb::LeaseResult) -> Result<lease_result::Result, Status> {
    if result.code != 0 {
        let code = i32::try_from(result.code).map_or(Code::Unknown, Code::from);
        return Err(Status::new(code, result.message));
    }
    result.result.ok_or_else(|| Status::internal("presenced answered OK with no result"))
}

/// The answer of the kind `$kind` in an item's result, or `INTERNAL` if the
/// server answered the item with another kind.
macro_rules! answer_of {
    ($result:expr, $kind:ident) => {
        match $result {
            presence_proto::v1::lease_result::Result::$kind(response) => Ok(response),
            other => Err($crate::lease_channel::wrong_result(&stringify!($kind).to_lowercase(), &other)),
        }
    };
}
pub(crate) use answer_of;

/// The typed calls of one lease item each, over the type's own
/// `submit_item(op) -> Result<lease_result::Result, Status>`: how the item
/// travels (coalesced on one stream, or routed to its user's owner) is the type's.
macro_rules! lease_item_calls {
    () => {
        /// Registers a session (L1).
        pub async fn register(
            &self,
            request: presence_proto::v1::RegisterRequest,
        ) -> Result<presence_proto::v1::RegisterResponse, tonic::Status> {
            $crate::lease_channel::answer_of!(
                self.submit_item(presence_proto::v1::lease_item::Op::Register(request)).await?,
                Register
            )
        }

        /// Renews a lease (L2): `NOT_FOUND` when the lease is gone,
        /// `FAILED_PRECONDITION` when a newer generation owns the session.
        pub async fn renew(
            &self,
            request: presence_proto::v1::RenewRequest,
        ) -> Result<presence_proto::v1::RenewResponse, tonic::Status> {
            $crate::lease_channel::answer_of!(
                self.submit_item(presence_proto::v1::lease_item::Op::Renew(request)).await?,
                Renew
            )
        }

        /// Unregisters a session (L3); an older generation changes nothing.
        pub async fn unregister(
            &self,
            request: presence_proto::v1::UnregisterRequest,
        ) -> Result<presence_proto::v1::UnregisterResponse, tonic::Status> {
            $crate::lease_channel::answer_of!(
                self.submit_item(presence_proto::v1::lease_item::Op::Unregister(request)).await?,
                Unregister
            )
        }

        /// Puts a session in a room (R1): `NOT_FOUND` when the lease is gone,
        /// `FAILED_PRECONDITION` for an older generation.
        pub async fn join(
            &self,
            request: presence_proto::v1::JoinRequest,
        ) -> Result<presence_proto::v1::JoinResponse, tonic::Status> {
            $crate::lease_channel::answer_of!(
                self.submit_item(presence_proto::v1::lease_item::Op::Join(request)).await?,
                Join
            )
        }

        /// Takes a session out of a room.
        pub async fn leave(
            &self,
            request: presence_proto::v1::LeaveRequest,
        ) -> Result<presence_proto::v1::LeaveResponse, tonic::Status> {
            $crate::lease_channel::answer_of!(
                self.submit_item(presence_proto::v1::lease_item::Op::Leave(request)).await?,
                Leave
            )
        }

        /// Sets or clears a session's signal in a room (S3).
        pub async fn signal(
            &self,
            request: presence_proto::v1::SignalRequest,
        ) -> Result<presence_proto::v1::SignalResponse, tonic::Status> {
            $crate::lease_channel::answer_of!(
                self.submit_item(presence_proto::v1::lease_item::Op::Signal(request)).await?,
                Signal
            )
        }
    };
}
pub(crate) use lease_item_calls;

pub(crate) fn wrong_result(op: &str, result: &lease_result::Result) -> Status {
    let got = match result {
        lease_result::Result::Register(_) => "register",
        lease_result::Result::Renew(_) => "renew",
        lease_result::Result::Unregister(_) => "unregister",
        lease_result::Result::Join(_) => "join",
        lease_result::Result::Leave(_) => "leave",
        lease_result::Result::Signal(_) => "signal",
    };
    Status::internal(format!("presenced answered a {op} item with a {got} result"))
}

fn driver_gone() -> Status {
    Status::unavailable("the lease channel's task has stopped (is the runtime shutting down?)")
}

/// What [`LeaseChannel`] clones share with the driver.
#[derive(Debug)]
struct Shared {
    /// Validated configuration.
    config: LeaseChannelConfig,
    /// Written by the driver, read by [`LeaseChannel::stats`].
    counters: Counters,
}

#[derive(Debug, Default)]
struct Counters {
    batches_sent: AtomicU64,
    items_sent: AtomicU64,
    streams_opened: AtomicU64,
    streams_broken: AtomicU64,
}

type ItemReply = oneshot::Sender<Result<pb::LeaseResult, Status>>;
type BatchReply = oneshot::Sender<Result<Vec<pb::LeaseResult>, Status>>;

/// What a submitter hands the driver.
enum Submission {
    /// One item, to be coalesced with others.
    Item(pb::LeaseItem, ItemReply),
    /// A whole batch, sent as it is.
    Batch(Vec<pb::LeaseItem>, BatchReply),
}

/// Who is waiting for a batch's results.
enum Replies {
    /// One submitter per item, in item order.
    Items(Vec<ItemReply>),
    /// One submitter for the whole batch of `count` items.
    Batch { reply: BatchReply, count: usize },
}

impl Replies {
    /// Answers everyone with `status` (the batch never got its results).
    fn fail(self, status: &Status) {
        match self {
            Replies::Items(replies) => {
                for reply in replies {
                    let _ = reply.send(Err(status.clone()));
                }
            }
            Replies::Batch { reply, .. } => {
                let _ = reply.send(Err(status.clone()));
            }
        }
    }

    /// Hands every item its result.
    fn answer(self, results: Vec<pb::LeaseResult>) {
        match self {
            Replies::Items(replies) => {
                let (count, got) = (replies.len(), results.len());
                let mut results = results.into_iter();
                for reply in replies {
                    let result = results.next().ok_or_else(|| result_count_mismatch(count, got));
                    let _ = reply.send(result);
                }
            }
            Replies::Batch { reply, count } => {
                let answer =
                    if results.len() == count { Ok(results) } else { Err(result_count_mismatch(count, results.len())) };
                let _ = reply.send(answer);
            }
        }
    }
}

fn result_count_mismatch(count: usize, got: usize) -> Status {
    Status::internal(format!("presenced answered {got} results for a batch of {count} items"))
}

/// A batch that is complete and waits for the stream.
struct Outgoing {
    items: Vec<pb::LeaseItem>,
    replies: Replies,
}

type OpenFuture = Pin<Box<dyn Future<Output = Result<Response<Streaming<pb::LeaseResults>>, Status>> + Send>>;

/// One `Leases` stream.
struct Conn {
    /// The request side; holds at most `max_in_flight_batches` batches, since every
    /// batch in it is also in flight.
    outbound: mpsc::Sender<pb::LeaseBatch>,
    inbound: Inbound,
}

enum Inbound {
    /// The call is under way; batches may already be queued on `outbound`.
    Opening(OpenFuture),
    /// The server answered with its stream of results.
    Open(Box<Streaming<pb::LeaseResults>>),
}

/// What happened on the stream.
enum StreamEvent {
    Opened(Streaming<pb::LeaseResults>),
    OpenFailed(Status),
    Results(pb::LeaseResults),
    Broke(Status),
}

/// The next event of `conn`, or never when there is no stream.
async fn next_event(conn: Option<&mut Conn>) -> StreamEvent {
    let Some(conn) = conn else { return std::future::pending().await };
    match &mut conn.inbound {
        Inbound::Opening(call) => match call.await {
            Ok(response) => StreamEvent::Opened(response.into_inner()),
            Err(status) => StreamEvent::OpenFailed(status),
        },
        Inbound::Open(stream) => match stream.message().await {
            Ok(Some(results)) => StreamEvent::Results(results),
            Ok(None) => StreamEvent::Broke(Status::unavailable("presenced ended the lease stream")),
            Err(status) => StreamEvent::Broke(status),
        },
    }
}

/// The background task behind a [`LeaseChannel`]: coalesces, sends, matches results, reconnects.
struct Driver {
    client: PresenceClient<Channel>,
    shared: Arc<Shared>,
    /// The submission queue; read only while there is room for what it yields.
    queue: mpsc::Receiver<Submission>,
    /// Set once every [`LeaseChannel`] clone is gone.
    queue_closed: bool,
    /// The batch being filled with single items, and their submitters.
    filling: Vec<pb::LeaseItem>,
    filling_replies: Vec<ItemReply>,
    /// When the batch being filled must go, full or not (meaningful while `filling` is not empty).
    fill_deadline: Instant,
    /// A complete batch waiting for the stream (to open, or to have room in flight).
    sealed: Option<Outgoing>,
    /// The current stream, if any.
    conn: Option<Conn>,
    /// Batches sent on `conn` and not yet answered, by batch id, with when they were sent.
    in_flight: HashMap<u64, (Instant, Replies)>,
    next_batch_id: u64,
    /// Failed attempts since a stream last delivered results; drives the backoff.
    attempt: u32,
    /// No new stream is opened before this (set when one breaks).
    retry_at: Option<Instant>,
}

impl Driver {
    fn new(client: PresenceClient<Channel>, queue: mpsc::Receiver<Submission>, shared: Arc<Shared>) -> Self {
        Driver {
            client,
            shared,
            queue,
            queue_closed: false,
            filling: Vec::new(),
            filling_replies: Vec::new(),
            fill_deadline: Instant::now(),
            sealed: None,
            conn: None,
            in_flight: HashMap::new(),
            next_batch_id: 1,
            attempt: 0,
            retry_at: None,
        }
    }

    fn config(&self) -> &LeaseChannelConfig {
        &self.shared.config
    }

    async fn run(mut self) {
        loop {
            self.pump();
            if self.queue_closed {
                // Every handle is gone, so nobody can be waiting for an answer.
                tracing::debug!("lease channel dropped; closing its stream");
                return;
            }
            let can_read = self.sealed.is_none() && self.filling.len() < self.config().max_batch;
            let fill_deadline = (self.sealed.is_none() && !self.filling.is_empty()).then_some(self.fill_deadline);
            let retry_at = if self.conn.is_none() && self.sealed.is_some() { self.retry_at } else { None };
            // At most `max_in_flight_batches` entries: a scan is cheaper than keeping them ordered.
            let answer_due =
                self.in_flight.values().map(|(sent, _)| *sent).min().map(|sent| sent + self.config().response_timeout);
            let far = Instant::now() + Duration::from_secs(3600);
            tokio::select! {
                submission = self.queue.recv(), if can_read => match submission {
                    Some(submission) => self.accept(submission),
                    None => self.queue_closed = true,
                },
                // `pump` seals the batch.
                () = tokio::time::sleep_until(fill_deadline.unwrap_or(far)), if fill_deadline.is_some() => {}
                // `pump` opens a new stream.
                () = tokio::time::sleep_until(retry_at.unwrap_or(far)), if retry_at.is_some() => {}
                () = tokio::time::sleep_until(answer_due.unwrap_or(far)), if answer_due.is_some() => {
                    let timeout = self.config().response_timeout;
                    self.broke(Status::unavailable(format!("presenced did not answer a lease batch within {timeout:?}")));
                }
                // select! builds every branch's future, so this one must cope with no stream.
                event = next_event(self.conn.as_mut()), if self.conn.is_some() => {
                    self.on_stream_event(event);
                }
            }
        }
    }

    fn accept(&mut self, submission: Submission) {
        match submission {
            Submission::Item(item, reply) => {
                if self.filling.is_empty() {
                    self.fill_deadline = Instant::now() + self.config().max_delay;
                }
                self.filling.push(item);
                self.filling_replies.push(reply);
            }
            Submission::Batch(items, reply) => {
                debug_assert!(self.sealed.is_none(), "the queue is read only when nothing is sealed");
                let count = items.len();
                self.sealed = Some(Outgoing { items, replies: Replies::Batch { reply, count } });
            }
        }
    }

    /// Makes every move that needs no waiting: seals a full or overdue batch,
    /// opens a stream for it if allowed, and sends while there is room in flight.
    fn pump(&mut self) {
        let now = Instant::now();
        loop {
            if self.sealed.is_none()
                && !self.filling.is_empty()
                && (self.filling.len() >= self.config().max_batch || now >= self.fill_deadline)
            {
                let items = std::mem::take(&mut self.filling);
                let replies = Replies::Items(std::mem::take(&mut self.filling_replies));
                self.sealed = Some(Outgoing { items, replies });
            }
            if self.sealed.is_none() || self.in_flight.len() >= self.config().max_in_flight_batches {
                return;
            }
            if self.conn.is_none() {
                if self.retry_at.is_some_and(|at| now < at) {
                    return;
                }
                self.open();
            }
            let Outgoing { items, replies } = self.sealed.take().expect("checked above");
            let conn = self.conn.as_ref().expect("opened above");
            let batch_id = self.next_batch_id;
            let count = items.len() as u64;
            match conn.outbound.try_send(pb::LeaseBatch { batch_id, items, ..Default::default() }) {
                Ok(()) => {
                    self.next_batch_id += 1;
                    self.in_flight.insert(batch_id, (now, replies));
                    self.shared.counters.batches_sent.fetch_add(1, Ordering::Relaxed);
                    self.shared.counters.items_sent.fetch_add(count, Ordering::Relaxed);
                }
                Err(refused) => {
                    // `outbound` holds at most the batches in flight, so it is never
                    // full: tonic dropped the request side, the call is over.
                    let batch = refused.into_inner();
                    self.sealed = Some(Outgoing { items: batch.items, replies });
                    self.broke(Status::unavailable("the lease stream's request side closed"));
                }
            }
        }
    }

    /// Starts a new `Leases` call; batches can be queued on it at once.
    fn open(&mut self) {
        debug_assert!(self.in_flight.is_empty(), "a broken stream fails what it carried");
        let (outbound, requests) = mpsc::channel(self.config().max_in_flight_batches);
        let mut client = self.client.clone();
        let mut request = tonic::Request::new(ReceiverStream::new(requests));
        if let Some(token) = &self.config().bearer_token {
            match format!("Bearer {token}").parse() {
                Ok(value) => {
                    request.metadata_mut().insert("authorization", value);
                }
                Err(_) => tracing::warn!("the bearer token is not valid metadata; the stream opens without it"),
            }
        }
        let call: OpenFuture = Box::pin(async move { client.leases(request).await });
        self.conn = Some(Conn { outbound, inbound: Inbound::Opening(call) });
        self.retry_at = None;
        self.shared.counters.streams_opened.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(attempt = self.attempt, "opening the lease stream");
    }

    fn on_stream_event(&mut self, event: StreamEvent) {
        match event {
            StreamEvent::Opened(stream) => {
                if let Some(conn) = self.conn.as_mut() {
                    conn.inbound = Inbound::Open(Box::new(stream));
                }
            }
            StreamEvent::Results(results) => {
                self.attempt = 0;
                match self.in_flight.remove(&results.batch_id) {
                    Some((_, replies)) => replies.answer(results.results),
                    None => tracing::warn!(batch_id = results.batch_id, "results for a batch not in flight; dropped"),
                }
            }
            StreamEvent::OpenFailed(status) => {
                // The server's own refusals keep their code (UNIMPLEMENTED from an older
                // server, UNAUTHENTICATED...); transport failures become UNAVAILABLE.
                let status = match status.code() {
                    Code::Unimplemented | Code::Unauthenticated | Code::PermissionDenied | Code::InvalidArgument => {
                        status
                    }
                    _ => {
                        let mut unsent =
                            Status::unavailable(format!("cannot open the lease stream: {}", status.message()));
                        unsent.metadata_mut().insert(UNSENT, MetadataValue::from_static("1"));
                        unsent
                    }
                };
                self.broke(status);
            }
            StreamEvent::Broke(status) => {
                self.broke(Status::unavailable(format!("the lease stream broke: {}", status.message())));
            }
        }
    }

    /// Drops the stream, fails what it carried and schedules the next attempt.
    fn broke(&mut self, status: Status) {
        self.conn = None;
        let lost = self.in_flight.len();
        for (_, (_, replies)) in self.in_flight.drain() {
            replies.fail(&status);
        }
        let delay = self.config().reconnect.delay(self.attempt);
        self.attempt = self.attempt.saturating_add(1);
        self.retry_at = Some(Instant::now() + delay);
        self.shared.counters.streams_broken.fetch_add(1, Ordering::Relaxed);
        tracing::debug!(%status, lost_batches = lost, retry_in = ?delay, "lease stream down");
    }
}
