//! What runs against the nodes through the roll: gateways renewing every
//! session on time through the Rust client's `ClusterLeases`, a churn of
//! registers, joins and unregisters whose acknowledged outcomes are checked
//! at the end, and viewers watching through whichever node answers,
//! reopening with the versions they hold (E8).

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use presence_client::{ClientTlsConfig, ClusterLeases, LeaseChannelConfig, ViewerStore};
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tonic::transport::Channel;

use crate::nodes::TOKEN;

/// Items per `submit_batch` when registering: each is one batch per owner.
const CHUNK: usize = 5_000;

/// Renewals per `submit_batch`: a gateway's batch, sent at its moment of
/// the heartbeat (the sessions' heartbeats are spread over it, as a
/// gateway's sockets' are), so that a batch's latency is a renewal's.
const RENEWAL_CHUNK: usize = 1_000;

/// The code a renewal of a session the owner does not hold gets.
const NOT_FOUND: u32 = tonic::Code::NotFound as u32;

/// When each phase of the run began, to file each renewal's latency.
#[derive(Debug, Default)]
pub(crate) struct Phases {
    pub(crate) roll_started: Option<Instant>,
    pub(crate) roll_ended: Option<Instant>,
}

/// Renewal latencies (µs) by phase, and what the renewals met.
#[derive(Debug)]
pub(crate) struct Renewals {
    pub(crate) before: hdrhistogram::Histogram<u64>,
    pub(crate) during: hdrhistogram::Histogram<u64>,
    pub(crate) after: hdrhistogram::Histogram<u64>,
    /// Renewals answered OK.
    pub(crate) renewed: u64,
    /// Renewal attempts refused for a reason a retry fixes (a slot moving,
    /// a node restarting), retries included.
    pub(crate) refused: u64,
    /// Sessions renewed by a retry after their round's renewal was refused.
    pub(crate) renewed_on_retry: u64,
    /// From a round's send to the OK of a session renewed on a retry (µs).
    pub(crate) retried_until_renewed: hdrhistogram::Histogram<u64>,
    /// Renewals answered `NOT_FOUND`: the session was lost.
    pub(crate) lost: u64,
    /// The first few lost sessions, with what they met before.
    pub(crate) lost_examples: Vec<String>,
    /// What each session's renewals met, by its index in the run's list.
    met: Vec<RenewalsMet>,
    /// Where [`RenewalsMet`]'s times count from.
    origin: Instant,
}

/// What one session's renewals last met, in milliseconds since
/// [`Renewals::origin`] plus one (0: never), kept for every session (12
/// bytes each) to say what a lost one met.
#[derive(Debug, Clone, Copy, Default)]
struct RenewalsMet {
    renewed_ms: u32,
    refused_ms: u32,
    refused_code: u16,
    /// Rounds in a row whose renewal (with its retries) was never answered OK.
    rounds_refused: u16,
}

impl Renewals {
    fn new(sessions: usize) -> Renewals {
        let histogram = || hdrhistogram::Histogram::new_with_bounds(1, 600_000_000, 3).expect("histogram bounds");
        Renewals {
            before: histogram(),
            during: histogram(),
            after: histogram(),
            renewed: 0,
            refused: 0,
            renewed_on_retry: 0,
            retried_until_renewed: histogram(),
            lost: 0,
            lost_examples: Vec::new(),
            met: vec![RenewalsMet::default(); sessions],
            origin: Instant::now(),
        }
    }

    fn ms(&self, at: Instant) -> u32 {
        at.saturating_duration_since(self.origin).as_millis().min(u32::MAX as u128 - 1) as u32 + 1
    }

    /// What `session`'s renewals met before, for a lost one's example.
    fn what_it_met(&self, session: usize) -> String {
        let met = self.met[session];
        let at = |ms: u32| match ms {
            0 => "never".to_owned(),
            ms => format!("{} UTC", wall_clock(self.origin + Duration::from_millis(u64::from(ms - 1)))),
        };
        format!(
            "last renewed {}; last refused {} (code {}); rounds in a row refused before: {}",
            at(met.renewed_ms),
            at(met.refused_ms),
            met.refused_code,
            met.rounds_refused
        )
    }
}

/// How clients reach the nodes.
#[derive(Clone)]
pub(crate) struct Reach {
    /// Every node's service URL.
    pub(crate) urls: Vec<String>,
    pub(crate) tls: Option<ClientTlsConfig>,
    pub(crate) slots: u32,
}

impl Reach {
    /// A gateway's routing client entering at `url`.
    pub(crate) fn leases(&self, url: &str) -> ClusterLeases {
        let config = LeaseChannelConfig {
            bearer_token: Some(TOKEN.to_owned()),
            tls: self.tls.clone(),
            max_batch: 2_000,
            ..LeaseChannelConfig::default()
        };
        ClusterLeases::new(url, self.slots, config).expect("a routing client")
    }

    /// A client of the node at `url`.
    pub(crate) async fn client(&self, url: &str) -> Result<PresenceClient<Channel>, String> {
        let channel = presence_client::connect(url, self.tls.as_ref()).await.map_err(|err| err.to_string())?;
        Ok(PresenceClient::new(channel))
    }
}

/// `message` with the service token.
pub(crate) fn authorized<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    request.metadata_mut().insert("authorization", format!("Bearer {TOKEN}").parse().expect("an ASCII token"));
    request
}

fn register(user: &str, session: &str, ttl_ms: u32) -> pb::LeaseItem {
    pb::LeaseItem {
        op: Some(pb::lease_item::Op::Register(pb::RegisterRequest {
            user_id: user.into(),
            session_id: session.into(),
            gateway_id: "roll-gateway".into(),
            ttl_ms,
            ..Default::default()
        })),
    }
}

fn renew(user: &str, session: &str, generation: u64, ttl_ms: u32) -> pb::LeaseItem {
    pb::LeaseItem {
        op: Some(pb::lease_item::Op::Renew(pb::RenewRequest {
            user_id: user.into(),
            session_id: session.into(),
            generation,
            ttl_ms,
            ..Default::default()
        })),
    }
}

/// The generation a register's result gives, if it was acknowledged.
fn registered(result: &pb::LeaseResult) -> Option<u64> {
    match &result.result {
        Some(pb::lease_result::Result::Register(done)) if result.code == 0 => Some(done.generation),
        _ => None,
    }
}

/// Registers one session of each of `users`, `CHUNK` at a time, sending
/// refused ones again; the generation of each.
pub(crate) async fn register_all(leases: &ClusterLeases, users: &[String], ttl_ms: u32) -> Result<Vec<u64>, String> {
    let mut generations = vec![0; users.len()];
    let started = Instant::now();
    for (chunk, part) in users.chunks(CHUNK).enumerate() {
        let mut pending: Vec<usize> = (0..part.len()).collect();
        for _attempt in 0..50 {
            let items = pending.iter().map(|&i| register(&part[i], "s", ttl_ms)).collect();
            let results = leases.submit_batch(items).await;
            let mut again = Vec::new();
            for (&i, result) in pending.iter().zip(&results) {
                match registered(result) {
                    Some(generation) => generations[chunk * CHUNK + i] = generation,
                    None => again.push(i),
                }
            }
            if again.is_empty() {
                break;
            }
            pending = again;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        if generations[chunk * CHUNK..chunk * CHUNK + part.len()].contains(&0) {
            return Err(format!("sessions of chunk {chunk} could not be registered"));
        }
        if (chunk + 1) % 40 == 0 {
            eprintln!(
                "registered {} of {} sessions ({:.0}/s)",
                (chunk + 1) * CHUNK,
                users.len(),
                ((chunk + 1) * CHUNK) as f64 / started.elapsed().as_secs_f64()
            );
        }
    }
    Ok(generations)
}

/// A task running until told to stop, and what it comes to.
pub(crate) type Running<T> = (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<T>);

/// `at` on the wall clock, `HH:MM:SS.mmm` UTC, to find it in the nodes' logs.
pub(crate) fn wall_clock(at: Instant) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let ms = now.saturating_sub(at.elapsed()).as_millis() % 86_400_000;
    format!("{:02}:{:02}:{:02}.{:03}", ms / 3_600_000, ms / 60_000 % 60, ms / 1_000 % 60, ms % 1_000)
}

/// Renews every session every `heartbeat`, in batches of
/// [`RENEWAL_CHUNK`] spread evenly over it, each sent on time whether or not
/// the ones before were answered (as gateways do); files each batch's
/// latency under the phase it was sent in: before the first SIGTERM, until
/// a heartbeat after the last node is ready, after.
///
/// A renewal refused for a reason a retry fixes (its slot is moving, its
/// node restarting) is sent again as the Rust client's `Session` does:
/// after the client's reconnect backoff (jittered, doubling from 50 ms),
/// never waiting longer than a heartbeat, until it is answered or the
/// session's next round comes. With `retry_refused` off, it waits for the
/// next round instead: a session whose renewals meet moves in rounds in a
/// row then runs out, which shows how long a move refuses a slot.
pub(crate) fn keep_renewing(
    leases: ClusterLeases,
    sessions: Arc<Vec<(String, u64)>>,
    ttl_ms: u32,
    heartbeat: Duration,
    phases: Arc<Mutex<Phases>>,
    retry_refused: bool,
    print_slower_than: Duration,
) -> Running<Renewals> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let renewals = Arc::new(Mutex::new(Renewals::new(sessions.len())));
    let task = tokio::spawn(async move {
        let chunks = sessions.len().div_ceil(RENEWAL_CHUNK).max(1);
        let mut ticks = tokio::time::interval(heartbeat / chunks as u32);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut rounds = Vec::new();
        for chunk in (0..chunks).cycle() {
            tokio::select! {
                _ = &mut stopped => break,
                _ = ticks.tick() => {}
            }
            let start = chunk * RENEWAL_CHUNK;
            let round = Round {
                leases: leases.clone(),
                sessions: Arc::clone(&sessions),
                renewals: Arc::clone(&renewals),
                phases: Arc::clone(&phases),
                range: start..(start + RENEWAL_CHUNK).min(sessions.len()),
                ttl_ms,
                heartbeat,
                retry_refused,
                print_slower_than,
            };
            rounds.push(tokio::spawn(round.run()));
            rounds.retain(|round| !round.is_finished());
        }
        for round in rounds {
            let _ = round.await;
        }
        Arc::try_unwrap(renewals).expect("every round ended").into_inner().expect("renewals")
    });
    (stop, task)
}

/// One batch of renewals, sent at its moment of the heartbeat, with its retries.
struct Round {
    leases: ClusterLeases,
    sessions: Arc<Vec<(String, u64)>>,
    renewals: Arc<Mutex<Renewals>>,
    phases: Arc<Mutex<Phases>>,
    range: std::ops::Range<usize>,
    ttl_ms: u32,
    heartbeat: Duration,
    retry_refused: bool,
    /// Batches that took at least this long are printed (zero: none).
    print_slower_than: Duration,
}

impl Round {
    async fn run(self) {
        let backoff = presence_client::Backoff::default();
        let sent = Instant::now();
        let mut pending: Vec<usize> = self.range.clone().collect();
        for attempt in 0u32.. {
            let items = pending
                .iter()
                .map(|&session| {
                    let (user, generation) = &self.sessions[session];
                    renew(user, "s", *generation, self.ttl_ms)
                })
                .collect();
            let this_send = Instant::now();
            let results = self.leases.submit_batch(items).await;
            let refused = self.file(sent, this_send, attempt, &pending, results);
            let next = backoff.delay(attempt).min(self.heartbeat);
            if refused.is_empty() || !self.retry_refused || sent.elapsed() + next >= self.heartbeat {
                // Left for the next round: the session's renewal met only refusals in this one.
                let mut renewals = self.renewals.lock().expect("renewals");
                for &session in &refused {
                    let met = &mut renewals.met[session];
                    met.rounds_refused = met.rounds_refused.saturating_add(1);
                }
                return;
            }
            tokio::time::sleep(next).await;
            pending = refused;
        }
    }

    /// Files what one send of the round met; returns the sessions refused.
    fn file(
        &self,
        sent: Instant,
        this_send: Instant,
        attempt: u32,
        pending: &[usize],
        results: Vec<pb::LeaseResult>,
    ) -> Vec<usize> {
        let now = Instant::now();
        let phases = self.phases.lock().expect("phases");
        let mut renewals = self.renewals.lock().expect("renewals");
        if attempt == 0 {
            // A round sent within a heartbeat after the last node is ready
            // still meets what the roll left (reconnects).
            let took = now.duration_since(sent).as_micros().max(1) as u64;
            let histogram = match (phases.roll_started, phases.roll_ended) {
                (Some(_), Some(ended)) if sent >= ended + self.heartbeat => &mut renewals.after,
                (Some(started), _) if sent >= started => &mut renewals.during,
                _ => &mut renewals.before,
            };
            histogram.saturating_record(took);
            if !self.print_slower_than.is_zero() && took >= self.print_slower_than.as_micros() as u64 {
                eprintln!("slow renewal batch: sent {} UTC, took {} ms", wall_clock(sent), took / 1000);
            }
        }
        let mut refused = Vec::new();
        for (&session, result) in pending.iter().zip(results) {
            match result.code {
                0 => {
                    renewals.renewed += 1;
                    if attempt > 0 {
                        renewals.renewed_on_retry += 1;
                        let until = now.duration_since(sent).as_micros().max(1) as u64;
                        renewals.retried_until_renewed.saturating_record(until);
                    }
                    let ms = renewals.ms(this_send);
                    let met = &mut renewals.met[session];
                    met.renewed_ms = ms;
                    met.rounds_refused = 0;
                }
                NOT_FOUND => {
                    renewals.lost += 1;
                    if renewals.lost_examples.len() < 5 {
                        let user = &self.sessions[session].0;
                        let example = format!(
                            "{user} (sent {} UTC, routed to {}): {}; {}",
                            wall_clock(this_send),
                            self.leases.route_of(user),
                            result.message,
                            renewals.what_it_met(session),
                        );
                        renewals.lost_examples.push(example);
                    }
                }
                code => {
                    renewals.refused += 1;
                    let ms = renewals.ms(this_send);
                    let met = &mut renewals.met[session];
                    met.refused_ms = ms;
                    met.refused_code = code as u16;
                    if code == tonic::Code::ResourceExhausted as u32 {
                        // Shed under overload (B2): the server asks for the next heartbeat.
                        met.rounds_refused = met.rounds_refused.saturating_add(1);
                    } else {
                        refused.push(session);
                    }
                }
            }
        }
        refused
    }
}

/// The churn's acknowledged operations, to be found at the end.
#[derive(Debug, Default)]
pub(crate) struct Churn {
    /// Sessions registered (acknowledged) and never unregistered: ONLINE at the end.
    pub(crate) live: BTreeSet<String>,
    /// Users whose one session was unregistered (acknowledged): OFFLINE at the end.
    pub(crate) gone: BTreeSet<String>,
    /// Room → users that joined it (acknowledged) and are still live.
    pub(crate) rooms: BTreeMap<String, BTreeSet<String>>,
    pub(crate) registers: u64,
    pub(crate) joins: u64,
    pub(crate) unregisters: u64,
    /// Operations not acknowledged after every retry (not lost: never done).
    pub(crate) not_acknowledged: u64,
}

/// Rooms the churn's users join.
pub(crate) const ROOMS: usize = 8;

/// Every `every`, registers `per_round` new users' sessions, joins each to
/// a room, and unregisters the sessions registered `keep` rounds before;
/// each operation retried (a refusal while a slot moves) until acknowledged.
pub(crate) fn churn(leases: ClusterLeases, per_round: usize, every: Duration, keep: usize) -> Running<Churn> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut churn = Churn::default();
        let mut rounds: Vec<Vec<(String, u64)>> = Vec::new();
        let mut ticks = tokio::time::interval(every);
        for round in 0.. {
            tokio::select! {
                _ = &mut stopped => break,
                _ = ticks.tick() => {}
            }
            let mut made = Vec::new();
            for i in 0..per_round {
                let user = format!("churn-{round}-{i}");
                let Some(result) = until_acknowledged(&leases, register(&user, "s", 600_000)).await else {
                    churn.not_acknowledged += 1;
                    continue;
                };
                let Some(generation) = registered(&result) else { continue };
                churn.registers += 1;
                churn.live.insert(user.clone());
                let room = format!("roll-room-{}", i % ROOMS);
                let join = pb::LeaseItem {
                    op: Some(pb::lease_item::Op::Join(pb::JoinRequest {
                        user_id: user.clone(),
                        session_id: "s".into(),
                        generation,
                        room_id: room.clone(),
                        ..Default::default()
                    })),
                };
                if until_acknowledged(&leases, join).await.is_some() {
                    churn.joins += 1;
                    churn.rooms.entry(room).or_default().insert(user.clone());
                } else {
                    churn.not_acknowledged += 1;
                }
                made.push((user, generation));
            }
            rounds.push(made);
            if rounds.len() > keep {
                let oldest = rounds.len() - keep - 1;
                for (user, generation) in std::mem::take(&mut rounds[oldest]) {
                    let unregister = pb::LeaseItem {
                        op: Some(pb::lease_item::Op::Unregister(pb::UnregisterRequest {
                            user_id: user.clone(),
                            session_id: "s".into(),
                            generation,
                            linger_ms: 0,
                        })),
                    };
                    if until_acknowledged(&leases, unregister).await.is_some() {
                        churn.unregisters += 1;
                        churn.live.remove(&user);
                        churn.gone.insert(user.clone());
                        churn.rooms.values_mut().for_each(|members| {
                            members.remove(&user);
                        });
                    } else {
                        churn.not_acknowledged += 1;
                    }
                }
            }
        }
        churn
    });
    (stop, task)
}

/// `item`'s result once it is answered with anything but `UNAVAILABLE`
/// (a slot moving, a node restarting), tried for up to a minute.
async fn until_acknowledged(leases: &ClusterLeases, item: pb::LeaseItem) -> Option<pb::LeaseResult> {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let result = leases.submit_batch(vec![item.clone()]).await.remove(0);
        if result.code == 0 {
            return Some(result);
        }
        if result.code != tonic::Code::Unavailable as u32 || Instant::now() > deadline {
            eprintln!("not acknowledged: {item:?}: {result:?}");
            return None;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// What one viewer saw.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    /// Streams opened, the first included.
    pub(crate) opens: u64,
    /// Reopens whose snapshot left out what the viewer held (E8).
    pub(crate) resumed: u64,
    /// Reopens that sent everything again.
    pub(crate) reloaded: u64,
    /// Users shown OFFLINE (all of them had gateways renewing): `user@version`.
    pub(crate) offline: Vec<String>,
    /// Updates older than what the viewer held (M4): `user: held → got`.
    pub(crate) versions_back: Vec<String>,
    /// The nodes the streams were opened at, in order.
    pub(crate) opened_at: Vec<String>,
}

/// Watches `users` through the nodes, starting at `first`: when a stream
/// ends (its node stopping, or a part of a merged stream ending), reopens
/// at once at the same node or, if it does not answer, the next, sending
/// the versions held.
pub(crate) fn watch(reach: Reach, first: usize, users: Vec<String>) -> Running<Seen> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut seen = Seen::default();
        let mut store = ViewerStore::new();
        let mut node = first;
        loop {
            let url = reach.urls[node % reach.urls.len()].clone();
            let opened = async {
                let mut client = reach.client(&url).await?;
                let known_versions = if seen.opens == 0 { HashMap::new() } else { store.versions(&users) };
                let request = pb::WatchRequest { user_ids: users.clone(), known_versions, ..Default::default() };
                client.watch(authorized(request)).await.map(tonic::Response::into_inner).map_err(|err| err.to_string())
            };
            let stream = tokio::select! {
                _ = &mut stopped => return seen,
                opened = opened => opened,
            };
            let Ok(mut stream) = stream else {
                node += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            };
            let mut first_message = true;
            loop {
                let message = tokio::select! {
                    _ = &mut stopped => return seen,
                    message = stream.message() => message,
                };
                let presences = match message {
                    Ok(Some(pb::WatchEvent { event: Some(pb::watch_event::Event::Snapshot(snapshot)) })) => {
                        if first_message {
                            seen.opens += 1;
                            seen.opened_at.push(url.clone());
                            if seen.opens > 1 {
                                if snapshot.partial { seen.resumed += 1 } else { seen.reloaded += 1 }
                            }
                        }
                        snapshot.users
                    }
                    Ok(Some(pb::WatchEvent { event: Some(pb::watch_event::Event::Update(update)) })) => vec![update],
                    Ok(Some(_)) => continue,
                    Ok(None) | Err(_) => break,
                };
                first_message = false;
                for presence in presences {
                    let held = store.get(&presence.user_id).map_or(0, |held| held.version);
                    if presence.version < held {
                        seen.versions_back.push(format!("{}: {held} → {}", presence.user_id, presence.version));
                    }
                    if presence.state != pb::State::Online as i32 {
                        seen.offline.push(format!("{}@{}", presence.user_id, presence.version));
                    }
                    store.apply_update(&presence);
                }
            }
            // The stream ended: the same node first, then the next.
        }
    });
    (stop, task)
}

/// What the end state shows of the churn's acknowledged operations.
#[derive(Debug, Default, serde::Serialize)]
pub(crate) struct Lost {
    pub(crate) registers: Vec<String>,
    pub(crate) unregisters: Vec<String>,
    pub(crate) joins: Vec<String>,
}

/// Compares the end state, asked at `url`, with the churn's acknowledged operations.
pub(crate) async fn lost_operations(reach: &Reach, url: &str, churn: &Churn) -> Result<Lost, String> {
    let mut client = reach.client(url).await?;
    let mut lost = Lost::default();
    let users: Vec<String> = churn.live.iter().chain(&churn.gone).cloned().collect();
    for part in users.chunks(1_000) {
        let request = pb::SnapshotRequest { user_ids: part.to_vec(), ..Default::default() };
        let answer = client.snapshot(authorized(request)).await.map_err(|err| format!("Snapshot: {err}"))?;
        for presence in answer.into_inner().users {
            let online = presence.state == pb::State::Online as i32;
            if churn.live.contains(&presence.user_id) && !online {
                lost.registers.push(presence.user_id);
            } else if churn.gone.contains(&presence.user_id) && online {
                lost.unregisters.push(presence.user_id);
            }
        }
    }
    for (room, members) in &churn.rooms {
        let request = pb::RoomSnapshotRequest { room_id: room.clone(), ..Default::default() };
        let answer = client.room_snapshot(authorized(request)).await.map_err(|err| format!("RoomSnapshot: {err}"))?;
        let present: BTreeSet<String> = answer.into_inner().members.into_iter().map(|member| member.user_id).collect();
        lost.joins.extend(members.difference(&present).map(|user| format!("{user} in {room}")));
    }
    Ok(lost)
}
