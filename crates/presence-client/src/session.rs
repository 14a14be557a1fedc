//! One session's lease, kept alive by a background heartbeat task.
//!
//! A [`Session`] is the gateway's handle on one authenticated socket. Its task
//! renews the lease through a shared [`LeaseChannel`] (or, in a cluster, a
//! [`ClusterLeases`], which sends each item to its user's owner: see
//! [`SessionLeases`]): the first beat after a
//! random part of the interval (so that sessions registered together, as after
//! a gateway restart, do not renew in lockstep), then every interval, and at
//! once on [`Session::touch`] unless the last renewal was too recent (the
//! client-side throttle, seed 000). It reacts to the contract's two rejections
//! (L2): `NOT_FOUND` means the lease is gone, so it registers again under a new
//! generation; `FAILED_PRECONDITION` means a newer connection owns the session,
//! so it stops. A renewal shed under overload (`RESOURCE_EXHAUSTED`) waits for
//! the next heartbeat, as the server asks. Any other failure is retried with
//! backoff and jitter, never waiting longer than one heartbeat, while the lease
//! may still be alive.
//!
//! A session also joins and leaves rooms and sends signals into them
//! ([`Session::join`], [`Session::leave`], [`Session::signal`]), as items of
//! the same channel, named by its current generation. It remembers the rooms
//! it joined, with its metadata in each: a re-register starts a new
//! generation, which the server puts in no room (R6), so the task joins them
//! all again before it reports [`SessionState::Reregistered`].
//!
//! A session says what its human is doing with it (A1): the device kind in
//! its [`SessionConfig`], and [`Session::set_attention`] and
//! [`Session::focus`] as they change, each sent at once on a renewal of its
//! own. It remembers what it said and says it again with every re-register,
//! since a new generation starts with nothing said.
//!
//! The handle unregisters in `Drop` (best effort, through the task, which still
//! holds the channel), or explicitly with [`Session::close`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use presence_proto::v1 as pb;
use tokio::sync::{Notify, oneshot, watch};
use tokio::time::Instant;
use tonic::{Code, Status};

use crate::backoff::jitter;
use crate::cluster::ClusterLeases;
use crate::lease_channel::{LeaseChannel, LeaseChannelConfig, lease_result};

/// Where a [`Session`]'s items go: one node's [`LeaseChannel`], or a
/// cluster's owners through [`ClusterLeases`] (C2). Made from a reference to
/// either (`&channel` or `&cluster`); cheap to clone.
#[derive(Debug, Clone)]
pub enum SessionLeases {
    /// One node (or a single presenced).
    Node(LeaseChannel),
    /// A cluster: each item goes to its user's owner.
    Cluster(ClusterLeases),
}

impl From<&LeaseChannel> for SessionLeases {
    fn from(channel: &LeaseChannel) -> Self {
        SessionLeases::Node(channel.clone())
    }
}

impl From<&ClusterLeases> for SessionLeases {
    fn from(cluster: &ClusterLeases) -> Self {
        SessionLeases::Cluster(cluster.clone())
    }
}

/// Calls the method of that name on whichever the session's items go through.
macro_rules! either {
    ($leases:expr, $method:ident($request:expr)) => {
        match $leases {
            SessionLeases::Node(channel) => channel.$method($request).await,
            SessionLeases::Cluster(cluster) => cluster.$method($request).await,
        }
    };
}

impl SessionLeases {
    async fn register(&self, request: pb::RegisterRequest) -> Result<pb::RegisterResponse, Status> {
        either!(self, register(request))
    }

    async fn renew(&self, request: pb::RenewRequest) -> Result<pb::RenewResponse, Status> {
        either!(self, renew(request))
    }

    async fn unregister(&self, request: pb::UnregisterRequest) -> Result<pb::UnregisterResponse, Status> {
        either!(self, unregister(request))
    }

    async fn join(&self, request: pb::JoinRequest) -> Result<pb::JoinResponse, Status> {
        either!(self, join(request))
    }

    async fn leave(&self, request: pb::LeaveRequest) -> Result<pb::LeaveResponse, Status> {
        either!(self, leave(request))
    }

    async fn signal(&self, request: pb::SignalRequest) -> Result<pb::SignalResponse, Status> {
        either!(self, signal(request))
    }

    /// The items as one batch; results in item order.
    async fn submit_batch(&self, items: Vec<pb::LeaseItem>) -> Result<Vec<pb::LeaseResult>, Status> {
        match self {
            SessionLeases::Node(channel) => channel.submit_batch(items).await,
            SessionLeases::Cluster(cluster) => Ok(cluster.submit_batch(items).await),
        }
    }

    fn config(&self) -> &LeaseChannelConfig {
        match self {
            SessionLeases::Node(channel) => channel.config(),
            SessionLeases::Cluster(cluster) => cluster.config(),
        }
    }
}

/// How a [`Session`] keeps its lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionConfig {
    /// Lease time to live asked for on every register and renew; 0 takes the server default.
    pub ttl_ms: u32,
    /// Time between renewals. Pick it so that the TTL covers two or more lost
    /// beats (15 s against the default 45 s TTL, L5).
    pub heartbeat: Duration,
    /// The unregister linger on close (L3): 0 deletes the lease at once.
    pub linger_ms: u32,
    /// [`Session::touch`] renews only if the last renewal is at least this old,
    /// so that a chatty socket cannot turn its traffic into renewals.
    pub min_renew_interval: Duration,
    /// The device the session is on (A1), sent with every register;
    /// `DeviceKind::DeviceUnspecified` says nothing.
    pub device_kind: pb::DeviceKind,
}

impl Default for SessionConfig {
    /// Server-default TTL, a 15 s heartbeat, no linger, touches throttled to one per 7.5 s.
    fn default() -> Self {
        SessionConfig::with_heartbeat(Duration::from_secs(15))
    }
}

impl SessionConfig {
    /// The defaults with this heartbeat, and the touch throttle at half of it.
    pub fn with_heartbeat(heartbeat: Duration) -> Self {
        SessionConfig {
            ttl_ms: 0,
            heartbeat,
            linger_ms: 0,
            min_renew_interval: heartbeat / 2,
            device_kind: pb::DeviceKind::DeviceUnspecified,
        }
    }
}

/// Where a [`Session`]'s lease stands, as published on [`Session::events`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SessionState {
    /// The lease is held at `generation` and renewed.
    Live {
        /// The generation the session renews with.
        generation: u64,
    },
    /// The server had lost the lease (`NOT_FOUND`: expired, revoked, or a
    /// restart without it), and the session registered again, and joined its
    /// rooms again with the new generation.
    Reregistered {
        /// The new generation.
        generation: u64,
    },
    /// `FAILED_PRECONDITION`: a newer connection owns the session. The session
    /// has stopped renewing; the gateway should close this socket.
    Superseded,
    /// Renewals (or the re-register) fail for another reason, typically an
    /// unreachable server; the session keeps retrying with backoff. The lease
    /// may still be alive.
    Lost,
}

/// What the heartbeat task is asked to do when the handle goes: unregister, and
/// answer on the sender if there is one ([`Session::close`]) or not (`Drop`).
type CloseRequest = Option<oneshot::Sender<Result<pb::UnregisterResponse, Status>>>;

/// One session's lease, kept alive in the background.
///
/// Dropping the handle stops the heartbeat task and sends `Unregister` (best
/// effort, with the configured linger); [`close`](Self::close) does the same
/// and returns the server's answer.
#[derive(Debug)]
pub struct Session {
    shared: Arc<SessionShared>,
    /// Tells the task to unregister and stop; taken by `close` or `Drop`.
    close: Option<oneshot::Sender<CloseRequest>>,
    /// For `close` to unregister by itself if the task is gone.
    channel: SessionLeases,
}

impl Session {
    /// Registers the session (L1) and starts renewing it in the background.
    ///
    /// Fails with the server's answer to the register: nothing runs then.
    pub async fn register(
        channel: impl Into<SessionLeases>,
        user_id: impl Into<String>,
        session_id: impl Into<String>,
        gateway_id: impl Into<String>,
        metadata: HashMap<String, String>,
        config: SessionConfig,
    ) -> Result<Session, Status> {
        let channel: SessionLeases = channel.into();
        let identity = Identity {
            user_id: user_id.into(),
            session_id: session_id.into(),
            gateway_id: gateway_id.into(),
            metadata,
        };
        let said = Said::default();
        let registered = channel.register(identity.register_request(&config, &said)).await?;
        let (state, _) = watch::channel(SessionState::Live { generation: registered.generation });
        let shared = Arc::new(SessionShared {
            throttle: Throttle::new(config.min_renew_interval, Instant::now()),
            identity,
            config,
            generation: AtomicU64::new(registered.generation),
            touched: Notify::new(),
            state,
            rooms: Mutex::default(),
            said: Mutex::new(said),
            room_calls: tokio::sync::Mutex::new(()),
        });
        let (close, closing) = oneshot::channel();
        tokio::spawn(heartbeat(Arc::clone(&shared), channel.clone(), closing));
        Ok(Session { shared, close: Some(close), channel })
    }

    /// The user this session belongs to.
    pub fn user_id(&self) -> &str {
        &self.shared.identity.user_id
    }

    /// The session id.
    pub fn session_id(&self) -> &str {
        &self.shared.identity.session_id
    }

    /// Current generation (changes after a re-register).
    pub fn generation(&self) -> u64 {
        self.shared.generation()
    }

    /// The current state (the latest value of [`events`](Self::events)).
    pub fn state(&self) -> SessionState {
        *self.shared.state.borrow()
    }

    /// Activity seen on the socket: renew now unless throttled (the last
    /// renewal less than `min_renew_interval` ago).
    pub fn touch(&self) {
        // Checked here as well as in the task, so that a chatty socket does not even wake it.
        if self.shared.throttle.allows(Instant::now()) {
            self.shared.touched.notify_one();
        }
    }

    /// Changes of the lease's state: `Live`, `Reregistered`, `Superseded`, `Lost`.
    pub fn events(&self) -> watch::Receiver<SessionState> {
        self.shared.state.subscribe()
    }

    /// Puts this session in `room_id` with its `metadata` there (R1), or
    /// replaces its metadata when it is in already. The answer says whether
    /// the user joined (`changed`; false for a second session of a member) and
    /// the room's version.
    ///
    /// The session remembers the room: after a re-register it joins it again
    /// with this metadata (see [`SessionState::Reregistered`]). A join the
    /// server refuses is forgotten, except `NOT_FOUND`: the lease is gone, the
    /// session registers again at its next beat and joins the room then.
    pub async fn join(
        &self,
        room_id: impl Into<String>,
        metadata: HashMap<String, String>,
    ) -> Result<pb::JoinResponse, Status> {
        let room_id = room_id.into();
        let _turn = self.shared.room_calls.lock().await;
        let earlier = self.shared.remember(&room_id, Some(metadata.clone()));
        let identity = &self.shared.identity;
        let join = |generation| identity.join_request(&room_id, generation, &metadata);
        let answer = self.shared.with_generation(|generation| self.channel.join(join(generation))).await;
        if let Err(status) = &answer
            && status.code() != Code::NotFound
        {
            self.shared.remember(&room_id, earlier);
        }
        answer
    }

    /// Takes this session out of `room_id`, and forgets the room. `removed` is
    /// false when the session was not in it; `changed` says whether the user
    /// left (its last session in the room did).
    pub async fn leave(&self, room_id: &str) -> Result<pb::LeaveResponse, Status> {
        let _turn = self.shared.room_calls.lock().await;
        self.shared.remember(room_id, None);
        let identity = &self.shared.identity;
        self.shared.with_generation(|generation| self.channel.leave(identity.leave_request(room_id, generation))).await
    }

    /// Sets (`ttl_ms` 1 to 10000, extending one already set) or clears
    /// (`ttl_ms` 0) this session's signal of `kind` ("typing", "speaking") in
    /// `room_id`, a room it is in (S3). `changed` says whether the room's set
    /// of users signalling `kind` changed. `FAILED_PRECONDITION` when the
    /// session is not in the room, `RESOURCE_EXHAUSTED` past the server's rate
    /// of signal changes. Signals are not remembered: they end with the
    /// generation that set them.
    pub async fn signal(&self, room_id: &str, kind: &str, ttl_ms: u32) -> Result<pb::SignalResponse, Status> {
        let _turn = self.shared.room_calls.lock().await;
        let identity = &self.shared.identity;
        let signal = |generation| identity.signal_request(room_id, generation, kind, ttl_ms);
        self.shared.with_generation(|generation| self.channel.signal(signal(generation))).await
    }

    /// Says what the session's human is doing with it (A1): `Active` on
    /// input after being idle or hidden, `Idle` after a while without input,
    /// `Background` when the page is hidden, the screen locks or the app
    /// goes to the background. Sent at once, on a renewal of its own (the
    /// heartbeat carries nothing), and again with any re-register. Call it
    /// when the attention changes, not on every input: a repeat is sent
    /// anyway.
    pub async fn set_attention(&self, attention: pb::Attention) -> Result<pb::RenewResponse, Status> {
        self.say(|said| said.attention = Some(attention)).await
    }

    /// Says which room the session has on screen (`None`: none), as
    /// [`Session::set_attention`] says its attention: a notification for a
    /// room open in the foreground is not pushed (A3).
    pub async fn focus(&self, room_id: Option<&str>) -> Result<pb::RenewResponse, Status> {
        let focused = room_id.unwrap_or_default().to_owned();
        self.say(|said| said.focused_room_id = Some(focused)).await
    }

    /// Records a change of what the session says and sends it on a renewal.
    async fn say(&self, change: impl FnOnce(&mut Said)) -> Result<pb::RenewResponse, Status> {
        // In turn with the room calls and the rejoin after a re-register, so
        // that the server hears the changes in the order they were made.
        let _turn = self.shared.room_calls.lock().await;
        let said = {
            let mut said = self.shared.said();
            change(&mut said);
            said.clone()
        };
        let shared = &self.shared;
        self.shared.throttle.mark(Instant::now());
        let renew = |generation| {
            let mut request = shared.identity.renew_request(generation, shared.config.ttl_ms);
            request.attention = said.attention.map(|attention| attention as i32);
            request.focused_room_id.clone_from(&said.focused_room_id);
            request
        };
        self.shared.with_generation(|generation| self.channel.renew(renew(generation))).await
    }

    /// The rooms the session is in, as it joined them, sorted: those it joins
    /// again after a re-register.
    pub fn rooms(&self) -> Vec<String> {
        let mut rooms: Vec<String> = self.shared.rooms().keys().cloned().collect();
        rooms.sort_unstable();
        rooms
    }

    /// Stops renewing and unregisters (compare-and-delete on the current
    /// generation, with the configured linger). A renewal already under way is
    /// let finish first, so that the unregister carries the newest generation.
    pub async fn close(mut self) -> Result<pb::UnregisterResponse, Status> {
        let (reply, answer) = oneshot::channel();
        let close = self.close.take().expect("only close and drop take it");
        if close.send(Some(reply)).is_ok()
            && let Ok(answered) = answer.await
        {
            return answered;
        }
        // The task is gone (its runtime is shutting down): unregister from here.
        unregister(&self.shared, &self.channel).await
    }
}

impl Drop for Session {
    fn drop(&mut self) {
        if let Some(close) = self.close.take() {
            let _ = close.send(None);
        }
    }
}

/// Who the session is; sent again on every re-register.
#[derive(Debug)]
struct Identity {
    user_id: String,
    session_id: String,
    gateway_id: String,
    metadata: HashMap<String, String>,
}

impl Identity {
    /// A register that says again all the session has said of its human (A1).
    fn register_request(&self, config: &SessionConfig, said: &Said) -> pb::RegisterRequest {
        pb::RegisterRequest {
            user_id: self.user_id.clone(),
            session_id: self.session_id.clone(),
            gateway_id: self.gateway_id.clone(),
            ttl_ms: config.ttl_ms,
            metadata: self.metadata.clone(),
            device_kind: config.device_kind as i32,
            attention: said.attention.map(|attention| attention as i32),
            focused_room_id: said.focused_room_id.clone().filter(|room_id| !room_id.is_empty()),
        }
    }

    fn renew_request(&self, generation: u64, ttl_ms: u32) -> pb::RenewRequest {
        pb::RenewRequest {
            user_id: self.user_id.clone(),
            session_id: self.session_id.clone(),
            generation,
            ttl_ms,
            ..Default::default()
        }
    }

    // The room calls name the session as a renewal does: user, session and generation.

    fn join_request(&self, room_id: &str, generation: u64, metadata: &HashMap<String, String>) -> pb::JoinRequest {
        let (user_id, session_id, room_id) = self.room_call(room_id);
        pb::JoinRequest { user_id, session_id, generation, room_id, metadata: metadata.clone(), ..Default::default() }
    }

    fn leave_request(&self, room_id: &str, generation: u64) -> pb::LeaveRequest {
        let (user_id, session_id, room_id) = self.room_call(room_id);
        pb::LeaveRequest { user_id, session_id, generation, room_id, ..Default::default() }
    }

    fn signal_request(&self, room_id: &str, generation: u64, kind: &str, ttl_ms: u32) -> pb::SignalRequest {
        let (user_id, session_id, room_id) = self.room_call(room_id);
        pb::SignalRequest {
            user_id,
            session_id,
            generation,
            room_id,
            kind: kind.to_owned(),
            ttl_ms,
            ..Default::default()
        }
    }

    /// The user, session and room ids a room call carries.
    fn room_call(&self, room_id: &str) -> (String, String, String) {
        (self.user_id.clone(), self.session_id.clone(), room_id.to_owned())
    }
}

/// What the handle and its heartbeat task share.
#[derive(Debug)]
struct SessionShared {
    identity: Identity,
    config: SessionConfig,
    /// Written by the task on a re-register, read by the handle.
    generation: AtomicU64,
    /// When the last renewal started; read by `touch`, written by the task.
    throttle: Throttle,
    /// Wakes the task for a renewal requested by `touch`.
    touched: Notify,
    /// The lease's state; the task writes it, `events()` subscribes to it.
    state: watch::Sender<SessionState>,
    /// The rooms the session is in, with its metadata in each, by room id: what
    /// the task joins again after a re-register. Locked only to read or write
    /// it, never across a call.
    rooms: Mutex<HashMap<String, HashMap<String, String>>>,
    /// What the session last said of its human's attention; locked only to
    /// read or write it, never across a call.
    said: Mutex<Said>,
    /// Held for the whole of a room call, a change of attention or a
    /// rejoin, so that the server gets one session's calls one at a time,
    /// in the order they were made, and a rejoin never crosses a leave.
    room_calls: tokio::sync::Mutex<()>,
}

/// What a session said of its human's attention (A1), said again with every
/// re-register. The device kind is in its [`SessionConfig`].
#[derive(Debug, Clone, Default)]
struct Said {
    attention: Option<pb::Attention>,
    /// `Some("")`: said there is none.
    focused_room_id: Option<String>,
}

impl SessionShared {
    fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn said(&self) -> std::sync::MutexGuard<'_, Said> {
        // As `rooms`: nothing panics under the lock.
        self.said.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn rooms(&self) -> std::sync::MutexGuard<'_, HashMap<String, HashMap<String, String>>> {
        // Nothing panics under the lock, and a map is valid whatever happened.
        self.rooms.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Records the session in `room_id` with `metadata`, or out of it for
    /// `None`; returns what was recorded before.
    fn remember(&self, room_id: &str, metadata: Option<HashMap<String, String>>) -> Option<HashMap<String, String>> {
        let mut rooms = self.rooms();
        match metadata {
            Some(metadata) => rooms.insert(room_id.to_owned(), metadata),
            None => rooms.remove(room_id),
        }
    }

    /// `call` with the current generation; once more with the new one when it
    /// was refused as from a lost or older lease while a re-register moved the
    /// generation on (the call raced the re-register, not the lease's end).
    async fn with_generation<T, F, Fut>(&self, call: F) -> Result<T, Status>
    where
        F: Fn(u64) -> Fut,
        Fut: Future<Output = Result<T, Status>>,
    {
        let generation = self.generation();
        match call(generation).await {
            Err(status)
                if matches!(status.code(), Code::NotFound | Code::FailedPrecondition)
                    && self.generation() != generation =>
            {
                call(self.generation()).await
            }
            answered => answered,
        }
    }

    fn set_state(&self, state: SessionState) {
        self.state.send_if_modified(|current| {
            let changed = *current != state;
            *current = state;
            changed
        });
    }
}

/// The client-side renewal throttle: remembers when the last renewal started,
/// lock-free, since `touch` may be called from any thread for every message.
#[derive(Debug)]
struct Throttle {
    /// The origin of `last_nanos`.
    epoch: Instant,
    /// Nanoseconds from `epoch` to the start of the last renewal.
    last_nanos: AtomicU64,
    min_interval: Duration,
}

impl Throttle {
    /// A throttle whose last renewal is `now` (the register counts as one).
    fn new(min_interval: Duration, now: Instant) -> Self {
        Throttle { epoch: now, last_nanos: AtomicU64::new(0), min_interval }
    }

    fn nanos(&self, at: Instant) -> u64 {
        u64::try_from(at.saturating_duration_since(self.epoch).as_nanos()).unwrap_or(u64::MAX)
    }

    /// Whether a renewal at `now` is allowed: the last one is at least `min_interval` old.
    fn allows(&self, now: Instant) -> bool {
        let since = self.nanos(now).saturating_sub(self.last_nanos.load(Ordering::Relaxed));
        Duration::from_nanos(since) >= self.min_interval
    }

    /// Records a renewal starting at `now`.
    fn mark(&self, now: Instant) {
        self.last_nanos.fetch_max(self.nanos(now), Ordering::Relaxed);
    }
}

/// What the heartbeat loop waits for next.
enum Wake {
    /// A beat is due, or a touch asked for one.
    Renew,
    /// The handle was closed or dropped.
    Close(CloseRequest),
}

/// Waits until `at`, a touch that the throttle allows, or a close.
async fn wait(
    shared: &SessionShared,
    at: Instant,
    touchable: bool,
    closing: &mut oneshot::Receiver<CloseRequest>,
) -> Wake {
    loop {
        tokio::select! {
            biased;
            // A dropped sender without a request cannot happen (Drop sends None), but means the same.
            request = &mut *closing => return Wake::Close(request.unwrap_or(None)),
            () = tokio::time::sleep_until(at) => return Wake::Renew,
            () = shared.touched.notified(), if touchable => {
                if shared.throttle.allows(Instant::now()) {
                    return Wake::Renew;
                }
            }
        }
    }
}

/// The heartbeat task of one session.
async fn heartbeat(shared: Arc<SessionShared>, channel: SessionLeases, mut closing: oneshot::Receiver<CloseRequest>) {
    let config = &shared.config;
    let backoff = channel.config().reconnect;
    let heartbeat = config.heartbeat;
    // The first beat is jittered over a whole interval (seed 000).
    let mut next_beat = Instant::now() + jitter(heartbeat);
    // Consecutive failed attempts, for the backoff.
    let mut failures = 0u32;
    // Rooms are still to be joined again after a re-register (the rejoin could not be sent).
    let mut rejoin_pending = false;
    let retry_delay = |failures: u32| backoff.delay(failures).min(heartbeat);
    loop {
        if let Wake::Close(request) = wait(&shared, next_beat, true, &mut closing).await {
            return finish(&shared, &channel, request).await;
        }
        let started = Instant::now();
        shared.throttle.mark(started);
        let generation = shared.generation();
        match channel.renew(shared.identity.renew_request(generation, config.ttl_ms)).await {
            Ok(_) => {
                failures = 0;
                if rejoin_pending {
                    rejoin_pending = !rejoin(&shared, &channel).await;
                }
                if *shared.state.borrow() == SessionState::Lost {
                    shared.set_state(SessionState::Live { generation });
                }
                next_beat = started + heartbeat;
            }
            Err(status) if status.code() == Code::NotFound => {
                tracing::debug!(user_id = %shared.identity.user_id, session_id = %shared.identity.session_id, %status, "lease lost; registering again");
                // Register again until it works or the handle goes.
                loop {
                    let started = Instant::now();
                    // What the session said goes with it: the new generation starts with nothing.
                    let said = shared.said().clone();
                    match channel.register(shared.identity.register_request(config, &said)).await {
                        Ok(registered) => {
                            shared.throttle.mark(started);
                            shared.generation.store(registered.generation, Ordering::Release);
                            rejoin_pending = !rejoin(&shared, &channel).await;
                            shared.set_state(SessionState::Reregistered { generation: registered.generation });
                            failures = 0;
                            next_beat = started + heartbeat;
                            break;
                        }
                        Err(status) => {
                            tracing::debug!(user_id = %shared.identity.user_id, %status, "re-register failed; retrying");
                            shared.set_state(SessionState::Lost);
                            let at = Instant::now() + retry_delay(failures);
                            failures = failures.saturating_add(1);
                            if let Wake::Close(request) = wait(&shared, at, false, &mut closing).await {
                                return finish(&shared, &channel, request).await;
                            }
                        }
                    }
                }
            }
            Err(status) if status.code() == Code::FailedPrecondition => {
                tracing::debug!(user_id = %shared.identity.user_id, session_id = %shared.identity.session_id, "superseded by a newer connection; renewals stop");
                shared.set_state(SessionState::Superseded);
                let request = closing.await.unwrap_or(None);
                return finish(&shared, &channel, request).await;
            }
            Err(status) if status.code() == Code::ResourceExhausted => {
                // Shed under overload (B2): the lease is most likely alive, and the
                // server asks for the next heartbeat, not an early retry.
                tracing::debug!(user_id = %shared.identity.user_id, %status, "renewal shed; next heartbeat");
                next_beat = started + heartbeat;
            }
            Err(status) => {
                tracing::debug!(user_id = %shared.identity.user_id, %status, "renewal failed; retrying");
                shared.set_state(SessionState::Lost);
                next_beat = Instant::now() + retry_delay(failures);
                failures = failures.saturating_add(1);
            }
        }
    }
}

/// Joins every room the session remembers again, with the current generation
/// (R6: a new generation is in no room). False when some join could not be
/// sent or was shed, so that it is tried again after the next renewal; a
/// join refused because the lease is gone or superseded is left to the
/// renewals, which find the same.
async fn rejoin(shared: &SessionShared, channel: &SessionLeases) -> bool {
    let _turn = shared.room_calls.lock().await;
    let generation = shared.generation();
    let items: Vec<pb::LeaseItem> = shared
        .rooms()
        .iter()
        .map(|(room_id, metadata)| pb::LeaseItem {
            op: Some(pb::lease_item::Op::Join(shared.identity.join_request(room_id, generation, metadata))),
            ..Default::default()
        })
        .collect();
    let mut done = true;
    for batch in items.chunks(channel.config().max_batch) {
        let results = match channel.submit_batch(batch.to_vec()).await {
            Ok(results) => results,
            Err(status) => {
                tracing::debug!(user_id = %shared.identity.user_id, %status, "rejoining rooms failed; retrying after the next renewal");
                done = false;
                continue;
            }
        };
        for (item, result) in batch.iter().zip(results) {
            if let Err(status) = lease_result(result) {
                let Some(pb::lease_item::Op::Join(join)) = &item.op else { unreachable!("only joins are sent") };
                tracing::debug!(user_id = %shared.identity.user_id, room_id = %join.room_id, %status, "rejoining a room was refused");
                done &= !matches!(status.code(), Code::Unavailable | Code::ResourceExhausted);
            }
        }
    }
    done
}

/// The task's last act: unregister, and answer `close` if it asked.
async fn finish(shared: &SessionShared, channel: &SessionLeases, request: CloseRequest) {
    let result = unregister(shared, channel).await;
    if let Err(status) = &result {
        tracing::debug!(user_id = %shared.identity.user_id, %status, "unregister on close failed; the lease will expire");
    }
    if let Some(reply) = request {
        let _ = reply.send(result);
    }
}

async fn unregister(shared: &SessionShared, channel: &SessionLeases) -> Result<pb::UnregisterResponse, Status> {
    channel
        .unregister(pb::UnregisterRequest {
            user_id: shared.identity.user_id.clone(),
            session_id: shared.identity.session_id.clone(),
            generation: shared.generation(),
            linger_ms: shared.config.linger_ms,
            ..Default::default()
        })
        .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn throttle_refuses_renewals_closer_than_the_minimum() {
        let t0 = Instant::now();
        let throttle = Throttle::new(Duration::from_millis(100), t0);
        assert!(!throttle.allows(t0), "the register counts as a renewal");
        assert!(!throttle.allows(t0 + Duration::from_millis(99)));
        assert!(throttle.allows(t0 + Duration::from_millis(100)));
        throttle.mark(t0 + Duration::from_millis(150));
        assert!(!throttle.allows(t0 + Duration::from_millis(200)));
        assert!(throttle.allows(t0 + Duration::from_millis(250)));
        // A late mark of an earlier renewal never moves the last renewal back.
        throttle.mark(t0 + Duration::from_millis(10));
        assert!(!throttle.allows(t0 + Duration::from_millis(200)));
    }

    #[test]
    fn a_zero_throttle_allows_everything() {
        let t0 = Instant::now();
        let throttle = Throttle::new(Duration::ZERO, t0);
        assert!(throttle.allows(t0));
        throttle.mark(t0);
        assert!(throttle.allows(t0));
    }

    #[test]
    fn default_config_throttles_touches_at_half_the_heartbeat() {
        let config = SessionConfig::default();
        assert_eq!(config.heartbeat, Duration::from_secs(15));
        assert_eq!(config.min_renew_interval, Duration::from_millis(7_500));
        assert_eq!((config.ttl_ms, config.linger_ms), (0, 0));
    }
}
