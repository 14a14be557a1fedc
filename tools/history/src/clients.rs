//! The clients that record: gateways holding sessions and viewers watching users.
//!
//! Gateways come in two kinds, so that both client paths are exercised: a
//! *session* gateway holds each session as a `presence-client` [`Session`] on
//! one shared [`LeaseChannel`] (register and close are recorded, and the
//! session's own reports of its lease, since its renewals are internal); a
//! *unary* gateway makes plain `Register`, `Renew` and `Unregister` calls and
//! records every one. Each session slot loops: register, hold a while
//! (renewing), unregister, stay away a while. While churn is off (quiet
//! phases) no slot registers or unregisters, and held sessions keep renewing.
//!
//! Viewers use raw `Watch` streams, not `Watcher`, so that every event the
//! server sends is recorded, stale ones included; they reconnect with the
//! versions they hold (E8) and apply events the way a careful client does.

use std::collections::{HashMap, HashSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use presence_client::{
    Backoff, LeaseChannel, LeaseChannelConfig, Session, SessionConfig, SessionState as Reported, pb,
};
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::watch_event;
use tokio::sync::watch;
use tokio::time::{Instant, sleep, timeout};
use tonic::transport::{Channel, Endpoint};
use tonic::{Code, Status};

use crate::history::{Call, EventKind, Op, Outcome, Presence, Record, Recorder, SessionState};

/// The user every viewer watches and the runner flips, to know when every
/// viewer has received everything published before (a barrier).
pub const SENTINEL: &str = "~sentinel";

/// Where clients connect: the server's URL, and the local address to bind
/// (a namespace's veth address, for network faults), if any.
#[derive(Debug, Clone)]
pub struct Target {
    /// `http://HOST:PORT`.
    pub url: String,
    /// Local IP to bind outgoing connections to.
    pub bind: Option<IpAddr>,
}

impl Target {
    /// A lazily connecting channel: it connects at the first call and
    /// reconnects by itself after the server restarts.
    pub fn channel(&self) -> Result<Channel, String> {
        let endpoint = Endpoint::from_shared(self.url.clone())
            .map_err(|e| format!("{}: {e}", self.url))?
            .connect_timeout(Duration::from_secs(1))
            .tcp_nodelay(true)
            .local_address(self.bind);
        Ok(endpoint.connect_lazy())
    }
}

/// The shape of the workload.
#[derive(Debug, Clone)]
pub struct Workload {
    /// Users `u0` .. `u{users-1}`.
    pub users: usize,
    /// Gateways; even ones use `Session`s, odd ones unary calls.
    pub gateways: usize,
    /// Viewers.
    pub viewers: usize,
    /// Lease TTL asked for.
    pub ttl_ms: u32,
    /// Time between renewals (a third of the TTL).
    pub heartbeat: Duration,
    /// How long a slot holds its session in churn, at most (uniform from a tenth of it).
    pub hold: Duration,
    /// How long a slot stays away in churn, at most.
    pub away: Duration,
    /// A unary call that has not been answered by then failed (outcome unknown).
    pub call_timeout: Duration,
}

/// What the runner tells the clients, and what they tell it.
#[derive(Debug, Default)]
pub struct Control {
    /// Registers and unregisters happen only while this is on.
    pub churn: AtomicBool,
    /// Register and unregister calls under way.
    pub in_flight: AtomicUsize,
    /// Sessions registered and not yet being closed: (user, session).
    held: Mutex<HashSet<(String, String)>>,
}

impl Control {
    fn held(&self) -> std::sync::MutexGuard<'_, HashSet<(String, String)>> {
        // Inserts and removes cannot leave the set half-changed.
        self.held.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The sessions held now.
    pub fn held_now(&self) -> Vec<(String, String)> {
        let mut held: Vec<_> = self.held().iter().cloned().collect();
        held.sort();
        held
    }
}

/// The user id of user number `i`.
pub fn user_id(i: usize) -> String {
    format!("u{i}")
}

/// The session slots of gateway `gateway`: user `i` has a session on gateway
/// `i % gateways`, and every fourth user a second one on the next gateway (a
/// second device, often on the other client path).
pub fn slots(workload: &Workload, gateway: usize) -> Vec<(String, String)> {
    let g = workload.gateways.max(1);
    let mut slots = Vec::new();
    for i in 0..workload.users {
        if i % g == gateway {
            slots.push((user_id(i), format!("s{i}a")));
        }
        if g > 1 && i.is_multiple_of(4) && (i + 1) % g == gateway {
            slots.push((user_id(i), format!("s{i}b")));
        }
    }
    slots
}

/// The users viewer `viewer` watches: about two thirds of them, overlapping
/// with every other viewer's, and the sentinel.
pub fn watched(workload: &Workload, viewer: usize) -> Vec<String> {
    let mut users: Vec<String> =
        (0..workload.users).filter(|i| !(i + viewer).is_multiple_of(3) || workload.viewers == 1).map(user_id).collect();
    users.push(SENTINEL.to_owned());
    users
}

fn code_name(status: &Status) -> String {
    format!("{:?}", status.code())
}

fn failed(status: &Status) -> Outcome {
    Outcome::Err { code: code_name(status), message: status.message().chars().take(200).collect() }
}

fn presence_of(p: Option<&pb::UserPresence>) -> Option<Presence> {
    p.map(|p| Presence { user: p.user_id.clone(), online: p.state == pb::State::Online as i32, version: p.version })
}

/// A random duration up to `max`, at least a tenth of it.
fn some_of(max: Duration) -> Duration {
    let max_ms = max.as_millis().max(10) as u64;
    Duration::from_millis(fastrand::u64(max_ms / 10..=max_ms))
}

/// Waits until churn is on or the run stops; false when it stopped.
async fn until_churn(control: &Control, stop: &watch::Receiver<bool>) -> bool {
    while !control.churn.load(Ordering::SeqCst) {
        if *stop.borrow() {
            return false;
        }
        sleep(Duration::from_millis(20)).await;
    }
    !*stop.borrow()
}

/// Sleeps `duration` unless the run stops first; false when it stopped.
async fn nap(duration: Duration, stop: &mut watch::Receiver<bool>) -> bool {
    let stopped = tokio::select! {
        () = sleep(duration) => false,
        _ = stop.wait_for(|stopped| *stopped) => true,
    };
    !stopped && !*stop.borrow()
}

/// Runs gateway `gateway` until `stop`.
pub async fn run_gateway(
    gateway: usize,
    workload: Workload,
    target: Target,
    recorder: Recorder,
    control: Arc<Control>,
    stop: watch::Receiver<bool>,
) -> Result<(), String> {
    let channel = target.channel()?;
    let name = format!("gw{gateway}");
    let mut tasks = Vec::new();
    let sessions = gateway.is_multiple_of(2);
    let leases = if sessions {
        let config = LeaseChannelConfig { response_timeout: workload.call_timeout, ..LeaseChannelConfig::default() };
        Some(LeaseChannel::from_channel(channel.clone(), config))
    } else {
        None
    };
    for (user, session) in slots(&workload, gateway) {
        let slot = Slot {
            client: name.clone(),
            user,
            session,
            workload: workload.clone(),
            recorder: recorder.clone(),
            control: Arc::clone(&control),
            stop: stop.clone(),
        };
        tasks.push(match &leases {
            Some(leases) => tokio::spawn(slot.run_session(leases.clone())),
            None => tokio::spawn(slot.run_unary(PresenceClient::new(channel.clone()))),
        });
    }
    for task in tasks {
        task.await.map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// One session slot of a gateway.
struct Slot {
    client: String,
    user: String,
    session: String,
    workload: Workload,
    recorder: Recorder,
    control: Arc<Control>,
    stop: watch::Receiver<bool>,
}

impl Slot {
    fn record(&self, op: Op, sent_generation: u64, start_us: u64, outcome: Outcome) {
        let call = Call {
            client: self.client.clone(),
            op,
            user: self.user.clone(),
            session: self.session.clone(),
            sent_generation,
            start_us,
            end_us: self.recorder.now_us(),
            outcome,
        };
        self.recorder.push(Record::Call(call));
    }

    fn hold(&self, held: bool) {
        let key = (self.user.clone(), self.session.clone());
        if held {
            self.control.held().insert(key);
        } else {
            self.control.held().remove(&key);
        }
    }

    /// Whether it is time to close: churn is on and the hold is over.
    fn closing_due(&self, until: Instant) -> bool {
        self.control.churn.load(Ordering::SeqCst) && Instant::now() >= until
    }

    /// The slot through unary calls.
    async fn run_unary(mut self, mut client: PresenceClient<Channel>) {
        let ttl_ms = self.workload.ttl_ms;
        loop {
            if !nap(some_of(self.workload.away), &mut self.stop).await || !until_churn(&self.control, &self.stop).await
            {
                return;
            }
            let Some(mut generation) = self.unary_register(&mut client).await else { return };
            let until = Instant::now() + some_of(self.workload.hold);
            loop {
                if !nap(self.workload.heartbeat, &mut self.stop).await {
                    return;
                }
                if self.closing_due(until) {
                    break;
                }
                let request = pb::RenewRequest {
                    user_id: self.user.clone(),
                    session_id: self.session.clone(),
                    generation,
                    ttl_ms,
                    ..Default::default()
                };
                let start = self.recorder.now_us();
                let answer = timeout(self.workload.call_timeout, client.renew(request)).await;
                let answer = answer.unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer in time")));
                match answer {
                    Ok(_) => self.record(
                        Op::Renew,
                        generation,
                        start,
                        Outcome::Ok { changed: None, presence: None, generation },
                    ),
                    Err(status) => {
                        self.record(Op::Renew, generation, start, failed(&status));
                        if matches!(status.code(), Code::NotFound | Code::FailedPrecondition) {
                            // The lease is gone (L2): register again, outside churn too.
                            match self.unary_register(&mut client).await {
                                Some(again) => generation = again,
                                None => return,
                            }
                        }
                    }
                }
            }
            self.hold(false);
            self.control.in_flight.fetch_add(1, Ordering::SeqCst);
            for _ in 0..3 {
                let request = pb::UnregisterRequest {
                    user_id: self.user.clone(),
                    session_id: self.session.clone(),
                    generation,
                    linger_ms: 0,
                };
                let start = self.recorder.now_us();
                let answer = timeout(self.workload.call_timeout, client.unregister(request)).await;
                match answer.unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer in time"))) {
                    Ok(response) => {
                        let response = response.into_inner();
                        let outcome = Outcome::Ok {
                            changed: Some(response.changed),
                            presence: presence_of(response.presence.as_ref()),
                            generation,
                        };
                        self.record(Op::Unregister, generation, start, outcome);
                        break;
                    }
                    Err(status) => {
                        self.record(Op::Unregister, generation, start, failed(&status));
                        sleep(Duration::from_millis(200)).await;
                    }
                }
            }
            self.control.in_flight.fetch_sub(1, Ordering::SeqCst);
        }
    }

    /// Registers until answered OK; the generation, or none when the run stopped.
    async fn unary_register(&mut self, client: &mut PresenceClient<Channel>) -> Option<u64> {
        loop {
            let request = pb::RegisterRequest {
                user_id: self.user.clone(),
                session_id: self.session.clone(),
                gateway_id: self.client.clone(),
                ttl_ms: self.workload.ttl_ms,
                ..Default::default()
            };
            let start = self.recorder.now_us();
            self.control.in_flight.fetch_add(1, Ordering::SeqCst);
            let answer = timeout(self.workload.call_timeout, client.register(request)).await;
            let answer = answer.unwrap_or_else(|_| Err(Status::deadline_exceeded("no answer in time")));
            let done = match answer {
                Ok(response) => {
                    let response = response.into_inner();
                    let generation = response.generation;
                    let outcome = Outcome::Ok {
                        changed: Some(response.changed),
                        presence: presence_of(response.presence.as_ref()),
                        generation,
                    };
                    self.record(Op::Register, 0, start, outcome);
                    self.hold(true);
                    Some(generation)
                }
                Err(status) => {
                    self.record(Op::Register, 0, start, failed(&status));
                    None
                }
            };
            self.control.in_flight.fetch_sub(1, Ordering::SeqCst);
            if done.is_some() {
                return done;
            }
            if !nap(Duration::from_millis(200), &mut self.stop).await {
                return None;
            }
        }
    }

    /// The slot through a `Session` on the gateway's `LeaseChannel`.
    async fn run_session(mut self, leases: LeaseChannel) {
        let config = SessionConfig {
            ttl_ms: self.workload.ttl_ms,
            heartbeat: self.workload.heartbeat,
            linger_ms: 0,
            min_renew_interval: self.workload.heartbeat / 2,
            ..SessionConfig::default()
        };
        loop {
            if !nap(some_of(self.workload.away), &mut self.stop).await || !until_churn(&self.control, &self.stop).await
            {
                return;
            }
            let start = self.recorder.now_us();
            self.control.in_flight.fetch_add(1, Ordering::SeqCst);
            let registered = Session::register(
                &leases,
                self.user.clone(),
                self.session.clone(),
                self.client.clone(),
                HashMap::new(),
                config.clone(),
            )
            .await;
            let session = match registered {
                Ok(session) => {
                    let generation = session.generation();
                    self.record(
                        Op::SessionRegister,
                        0,
                        start,
                        Outcome::Ok { changed: None, presence: None, generation },
                    );
                    self.hold(true);
                    session
                }
                Err(status) => {
                    self.record(Op::SessionRegister, 0, start, failed(&status));
                    self.control.in_flight.fetch_sub(1, Ordering::SeqCst);
                    continue;
                }
            };
            self.control.in_flight.fetch_sub(1, Ordering::SeqCst);
            let reports = tokio::spawn(record_reports(
                session.events(),
                self.recorder.clone(),
                self.client.clone(),
                self.user.clone(),
                self.session.clone(),
            ));
            let until = Instant::now() + some_of(self.workload.hold);
            loop {
                if !nap(Duration::from_millis(50), &mut self.stop).await {
                    // The run is over and checked: the drop's unregister is not part of the history.
                    reports.abort();
                    drop(session);
                    return;
                }
                if self.closing_due(until) {
                    break;
                }
            }
            self.hold(false);
            self.control.in_flight.fetch_add(1, Ordering::SeqCst);
            let generation = session.generation();
            let start = self.recorder.now_us();
            let outcome = match session.close().await {
                Ok(response) => Outcome::Ok {
                    changed: Some(response.changed),
                    presence: presence_of(response.presence.as_ref()),
                    generation,
                },
                Err(status) => failed(&status),
            };
            self.record(Op::SessionClose, generation, start, outcome);
            self.control.in_flight.fetch_sub(1, Ordering::SeqCst);
            let _ = reports.await;
        }
    }
}

/// Records every state a `Session` reports until it is gone.
async fn record_reports(
    mut events: watch::Receiver<Reported>,
    recorder: Recorder,
    client: String,
    user: String,
    session: String,
) {
    while events.changed().await.is_ok() {
        let reported = *events.borrow_and_update();
        let (state, generation) = match reported {
            Reported::Live { generation } => (SessionState::Live, generation),
            Reported::Reregistered { generation } => (SessionState::Reregistered, generation),
            Reported::Lost => (SessionState::Lost, 0),
            Reported::Superseded => (SessionState::Superseded, 0),
        };
        let at_us = recorder.now_us();
        recorder.push(Record::Session {
            client: client.clone(),
            user: user.clone(),
            session: session.clone(),
            at_us,
            state,
            generation,
        });
    }
}

/// What a viewer holds, and the sentinel version it has seen (for barriers).
#[derive(Debug, Default)]
pub struct ViewerProgress {
    /// The highest version of [`SENTINEL`] received.
    pub sentinel: AtomicU64,
    /// Streams opened.
    pub streams: AtomicU64,
}

/// Runs viewer `viewer` until `stop`; returns what it holds then.
pub async fn run_viewer(
    viewer: usize,
    workload: Workload,
    target: Target,
    recorder: Recorder,
    progress: Arc<ViewerProgress>,
    mut stop: watch::Receiver<bool>,
) -> Result<HashMap<String, (bool, u64)>, String> {
    let mut client = PresenceClient::new(target.channel()?);
    let users = watched(&workload, viewer);
    recorder.push(Record::Watching { viewer, users: users.clone() });
    // Odd viewers ask for batches, so that both event forms are recorded.
    let batch_window_ms = if viewer % 2 == 1 { 20 } else { 0 };
    let mut view: HashMap<String, (bool, u64)> = HashMap::new();
    let backoff = Backoff::default();
    let mut attempt = 0u32;
    let mut stream_no = 0u64;
    loop {
        if *stop.borrow() {
            return Ok(view);
        }
        let request = pb::WatchRequest {
            user_ids: users.clone(),
            known_versions: view.iter().map(|(user, (_, version))| (user.clone(), *version)).collect(),
            batch_window_ms,
            ..Default::default()
        };
        let opened = tokio::select! {
            opened = timeout(workload.call_timeout, client.watch(request)) => opened,
            _ = stop.wait_for(|s| *s) => return Ok(view),
        };
        let mut stream = match opened {
            Ok(Ok(response)) => response.into_inner(),
            _ => {
                attempt = attempt.saturating_add(1);
                if !nap(backoff.delay(attempt).min(Duration::from_millis(500)), &mut stop).await {
                    return Ok(view);
                }
                continue;
            }
        };
        stream_no += 1;
        let mut first = true;
        loop {
            let message = tokio::select! {
                message = stream.message() => message,
                _ = stop.wait_for(|s| *s) => return Ok(view),
            };
            let event = match message {
                Ok(Some(pb::WatchEvent { event: Some(event), .. })) => event,
                Ok(Some(_)) => continue,
                Ok(None) | Err(_) => break,
            };
            let at_us = recorder.now_us();
            let mut entries = Vec::new();
            let kind = match event {
                watch_event::Event::Snapshot(snapshot) => {
                    let kind = if first { EventKind::Opening { partial: snapshot.partial } } else { EventKind::Resync };
                    if !snapshot.partial {
                        view.clear();
                    }
                    entries = snapshot.users;
                    kind
                }
                watch_event::Event::Update(update) => {
                    entries.push(update);
                    EventKind::Update
                }
                watch_event::Event::Updates(batch) => {
                    entries = batch.users;
                    EventKind::Update
                }
                watch_event::Event::Added(added) => {
                    entries = added.users;
                    EventKind::Update
                }
            };
            if first {
                first = false;
                attempt = 0;
                progress.streams.fetch_add(1, Ordering::SeqCst);
                recorder.push(Record::Stream { viewer, stream: stream_no, at_us, opened: true });
            }
            for entry in entries {
                let presence = presence_of(Some(&entry)).expect("an entry");
                let newer = view.get(&presence.user).is_none_or(|(_, held)| presence.version > *held);
                // A snapshot replaces what is held; an update only when newer (E3).
                if kind.is_snapshot() || newer {
                    view.insert(presence.user.clone(), (presence.online, presence.version));
                }
                if presence.user == SENTINEL {
                    progress.sentinel.fetch_max(presence.version, Ordering::SeqCst);
                }
                recorder.push(Record::Event { viewer, stream: stream_no, at_us, kind, presence });
            }
        }
        let at_us = recorder.now_us();
        recorder.push(Record::Stream { viewer, stream: stream_no, at_us, opened: false });
    }
}
