//! `expiry`: how long after a lease's deadline does a viewer learn that its user went
//! OFFLINE?
//!
//! 1. Register N users (one session each) with a long TTL, and measure how long that takes.
//! 2. Start the viewer: on presenced, Watch streams (presence-client `Watcher`) of at most
//!    `--watch-chunk` users covering all N; on Redis, `PSUBSCRIBE presence:out:*`, with
//!    the seed's sweeper (every 2 s, 500 users per sweep) running inside the generator.
//! 3. Register every session again with the TTL that puts its deadline at
//!    `first + k * window / N`: all leases run out within `--window-ms`. The user stays
//!    ONLINE (a reconnect replaces the lease), so nothing is published yet. The deadline
//!    of each lease is the server's: presenced's `expires_at_ms`, Redis's score of the
//!    session in `presence:{u}:idx` (read right after the script).
//! 4. For each OFFLINE the viewer receives, lag = arrival - deadline. Wait until all N
//!    arrived (or `--timeout` after the last deadline).
//!
//! With `--gateway-sessions G`, G more users (one session each, watched by no one) are
//! registered in step 1, and once step 3 is done a gateway renews them with unary
//! `Renew`s at `--gateway-rate` in two phases: *quiet*, from the end of step 3 to the
//! first deadline (the window is moved `--quiet-ms` later to make room for it), and
//! *expiry*, from the first deadline to the last (see [`crate::gateway`]). The ratio of
//! their p99s says how much a wave of expiries costs the gateways that keep renewing
//! through it.

use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::StreamExt;
use presence_client::pb::{self, presence_client::PresenceClient};
use presence_client::{Backoff, Watcher, WatcherEvent};
use serde_json::json;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cli::{ExpiryArgs, ExpiryViewer};
use crate::conn::{Endpoints, Naming, TargetKind};
use crate::gateway::{self, GatewaySpec};
use crate::ids::{Generations, Population, Slots, parse_user_id, user_id};
use crate::load::phase_report;
use crate::phase::{Bound, PhaseSpec, Shared, TtlPlan, Work, register_everyone, run_phase};
use crate::progress::Progress;
use crate::redis_seed::{self, OUT_PREFIX, Scripts};
use crate::report::Report;
use crate::stats::{Recorder, fmt_ns};

/// TTL of the first registration, long enough to outlast the setup.
const SETUP_TTL_MS: u32 = 600_000;

/// Unix time in ns.
pub(crate) fn unix_ns() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as i64)
}

/// Gathers the viewer's OFFLINE events.
#[derive(Debug)]
pub(crate) struct Collector {
    /// Lease deadline per user (Unix ms; user n holds session n).
    deadlines: Arc<Shared>,
    seen: Vec<AtomicBool>,
    received: AtomicU64,
    duplicates: AtomicU64,
    unexpected: AtomicU64,
    via_resync: AtomicU64,
    early: AtomicU64,
    last_arrival_ns: AtomicI64,
    lags: Mutex<Recorder>,
    /// Arrival per user (Unix ns, 0 = none), for `--lags-csv`.
    arrivals: Slots,
}

impl Collector {
    /// A collector for `users` users whose deadlines `shared` holds.
    pub(crate) fn new(shared: Arc<Shared>, users: u64) -> Collector {
        Collector {
            deadlines: shared,
            seen: (0..users).map(|_| AtomicBool::new(false)).collect(),
            received: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            unexpected: AtomicU64::new(0),
            via_resync: AtomicU64::new(0),
            early: AtomicU64::new(0),
            last_arrival_ns: AtomicI64::new(0),
            lags: Mutex::new(Recorder::default()),
            arrivals: Slots::new(users),
        }
    }

    /// An OFFLINE for user `user_id` arrived at `arrival_ns`.
    pub(crate) fn offline(&self, user_id: &str, arrival_ns: i64, via_resync: bool) {
        let Some(n) = parse_user_id(user_id).filter(|&n| (n as usize) < self.seen.len()) else {
            self.unexpected.fetch_add(1, Ordering::Relaxed);
            return;
        };
        if self.seen[n as usize].swap(true, Ordering::Relaxed) {
            self.duplicates.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let deadline_ms = self.deadlines.deadlines.as_ref().map_or(0, |d| d.get(n));
        let lag_ns = arrival_ns - deadline_ms * 1_000_000;
        // Deadlines are whole milliseconds: up to 1 ms early is rounding, more is early.
        if lag_ns < -1_000_000 {
            self.early.fetch_add(1, Ordering::Relaxed);
        }
        if via_resync {
            self.via_resync.fetch_add(1, Ordering::Relaxed);
        }
        self.lags.lock().unwrap_or_else(|e| e.into_inner()).ok(Duration::from_nanos(lag_ns.max(0) as u64), 1);
        self.last_arrival_ns.fetch_max(arrival_ns, Ordering::Relaxed);
        self.arrivals.set(n, arrival_ns);
        self.received.fetch_add(1, Ordering::Relaxed);
    }

    /// OFFLINE events counted so far.
    pub(crate) fn received(&self) -> u64 {
        self.received.load(Ordering::Relaxed)
    }
}

/// The viewer's tasks and the switch that stops them.
#[derive(Debug)]
struct Viewer {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<()>>,
    streams: u64,
}

impl Viewer {
    async fn stop(self) {
        let _ = self.stop.send(true);
        for t in self.tasks {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Watch streams of at most `chunk` users over users `0..users`, `per_conn` streams per
/// HTTP/2 connection; returns once every stream has its first snapshot.
async fn presenced_viewer(
    endpoints: &Endpoints,
    users: u64,
    chunk: u64,
    collector: Arc<Collector>,
) -> Result<Viewer, String> {
    let (stop, stop_rx) = watch::channel(false);
    let mut tasks = Vec::new();
    let chunk = chunk.clamp(1, 10_000);
    let mut streams = 0;
    let mut channel = None;
    for (i, start) in (0..users).step_by(chunk as usize).enumerate() {
        if i % 50 == 0 {
            channel = Some(endpoints.grpc_channel().await?);
        }
        let Some(ch) = channel.clone() else { unreachable!("a channel was opened for the first stream") };
        let ids: Vec<String> = (start..(start + chunk).min(users)).map(user_id).collect();
        let client = PresenceClient::new(ch).max_decoding_message_size(64 << 20);
        let mut watcher =
            Watcher::open(client, ids, Backoff::default()).await.map_err(|s| format!("Watch refused: {s}"))?;
        streams += 1;
        let (collector, mut stop_rx) = (Arc::clone(&collector), stop_rx.clone());
        tasks.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    ev = watcher.next() => match ev {
                        Some(WatcherEvent::Update(u)) => {
                            if u.state == pb::State::Offline as i32 {
                                collector.offline(&u.user_id, unix_ns(), false);
                            }
                        }
                        Some(WatcherEvent::Resynced) => {
                            let now = unix_ns();
                            for u in watcher.store().iter() {
                                if u.state == pb::State::Offline as i32 {
                                    collector.offline(&u.user_id, now, true);
                                }
                            }
                        }
                        None => break,
                    },
                    _ = stop_rx.changed() => break,
                }
            }
        }));
    }
    Ok(Viewer { stop, tasks, streams })
}

/// When a viewer goes away and for how long (`--viewer-away-ms`).
#[derive(Debug, Clone, Copy)]
struct Away {
    /// Unix ms at which it goes.
    at_ms: i64,
    /// How long it stays away.
    for_ms: u64,
}

/// Completes when the viewer is to go away (never, if it is not to).
fn time_to_go(away: &Mutex<Option<Away>>) -> impl Future<Output = ()> + use<> {
    let away_at = *away.lock().unwrap_or_else(|e| e.into_inner());
    async move {
        match away_at {
            Some(away) => until_unix_ms(away.at_ms).await,
            None => std::future::pending().await,
        }
    }
}

/// Sleeps until Unix time `at_ms`.
async fn until_unix_ms(at_ms: i64) {
    let wait = at_ms - redis_seed::now_ms();
    if wait > 0 {
        tokio::time::sleep(Duration::from_millis(wait as u64)).await;
    }
}

/// One `Changes` stream from now, counting OFFLINE flips; away (the stream
/// dropped) for `away`, then back from the last cursor it received.
async fn feed_viewer(
    endpoints: Endpoints,
    collector: Arc<Collector>,
    away: Arc<Mutex<Option<Away>>>,
    cursor: Arc<Mutex<Vec<u8>>>,
) -> Result<Viewer, String> {
    let channel = endpoints.grpc_channel().await?;
    let mut client = PresenceClient::new(channel).max_decoding_message_size(64 << 20);
    let from_now = pb::ChangesRequest { from: pb::ChangesFrom::Now as i32, ..Default::default() };
    let mut stream = client.changes(from_now).await.map_err(|s| format!("Changes refused: {s}"))?.into_inner();
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        loop {
            let leave = time_to_go(&away);
            tokio::select! {
                event = stream.message() => {
                    let Ok(Some(event)) = event else { break };
                    if let Some(pb::change_event::Event::Flip(user)) = &event.event
                        && user.state == pb::State::Offline as i32
                    {
                        collector.offline(&user.user_id, unix_ns(), false);
                    }
                    *cursor.lock().unwrap_or_else(|e| e.into_inner()) = event.cursor;
                }
                () = leave => {
                    let away = away.lock().unwrap_or_else(|e| e.into_inner()).take().expect("set");
                    // Away: the stream closed (the server ends its reader), nothing read meanwhile.
                    drop(stream);
                    tokio::time::sleep(Duration::from_millis(away.for_ms)).await;
                    let channel = match endpoints.grpc_channel().await {
                        Ok(channel) => channel,
                        Err(err) => { eprintln!("the feed viewer could not come back: {err}"); break }
                    };
                    let mut client = PresenceClient::new(channel).max_decoding_message_size(64 << 20);
                    let resume = pb::ChangesRequest {
                        from: pb::ChangesFrom::Cursor as i32,
                        cursor: cursor.lock().unwrap_or_else(|e| e.into_inner()).clone(),
                        ..Default::default()
                    };
                    match client.changes(resume).await {
                        Ok(resumed) => stream = resumed.into_inner(),
                        Err(status) => { eprintln!("the feed viewer could not resume: {status}"); break }
                    }
                }
                _ = stop_rx.changed() => break,
            }
        }
    });
    Ok(Viewer { stop, tasks: vec![task], streams: 1 })
}

/// `PSUBSCRIBE presence:out:*`, counting `offline` transitions; away (the
/// connection closed) for `away`, then subscribed again.
async fn redis_viewer(
    endpoints: &Endpoints,
    collector: Arc<Collector>,
    away: Arc<Mutex<Option<Away>>>,
) -> Result<Viewer, String> {
    let client = endpoints.redis_client()?;
    let subscribe = move || {
        let client = client.clone();
        async move {
            let mut pubsub = client.get_async_pubsub().await.map_err(|e| format!("pub/sub connection: {e}"))?;
            pubsub.psubscribe(format!("{OUT_PREFIX}*")).await.map_err(|e| format!("PSUBSCRIBE: {e}"))?;
            Ok::<_, String>(pubsub.into_on_message())
        }
    };
    let mut messages = subscribe().await?;
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        loop {
            let leave = time_to_go(&away);
            tokio::select! {
                msg = messages.next() => {
                    let Some(msg) = msg else { break };
                    let now = unix_ns();
                    if let Some(t) = redis_seed::parse_transition(msg.get_payload_bytes())
                        && t.state == "offline"
                    {
                        collector.offline(&t.user, now, false);
                    }
                }
                () = leave => {
                    let away = away.lock().unwrap_or_else(|e| e.into_inner()).take().expect("set");
                    drop(messages);
                    tokio::time::sleep(Duration::from_millis(away.for_ms)).await;
                    match subscribe().await {
                        Ok(again) => messages = again,
                        Err(err) => { eprintln!("the Redis viewer could not subscribe again: {err}"); break }
                    }
                }
                _ = stop_rx.changed() => break,
            }
        }
    });
    Ok(Viewer { stop, tasks: vec![task], streams: 1 })
}

/// Reads the whole feed from its oldest change (a consumer catching up):
/// how many events, in how long.
async fn catch_up(endpoints: &Endpoints, through: &[u8]) -> Result<(u64, Duration), String> {
    let channel = endpoints.grpc_channel().await?;
    let mut client = PresenceClient::new(channel).max_decoding_message_size(64 << 20);
    let oldest = pb::ChangesRequest { from: pb::ChangesFrom::Oldest as i32, ..Default::default() };
    let started = std::time::Instant::now();
    let mut stream = client.changes(oldest).await.map_err(|s| format!("Changes refused: {s}"))?.into_inner();
    let mut events = 0;
    while let Some(event) = stream.message().await.map_err(|s| format!("the catch-up read failed: {s}"))? {
        if matches!(event.event, Some(pb::change_event::Event::Progress(_))) {
            continue;
        }
        events += 1;
        if event.cursor.as_slice() >= through {
            break;
        }
    }
    Ok((events, started.elapsed()))
}

/// The sweeper's counters.
#[derive(Debug, Default)]
pub(crate) struct SweeperStats {
    /// Sweeps run.
    pub(crate) sweeps: AtomicU64,
    /// Users read from the due set.
    pub(crate) users: AtomicU64,
    /// OFFLINE transitions published.
    pub(crate) published: AtomicU64,
    /// Sweeps that failed.
    pub(crate) errors: AtomicU64,
}

/// The seed's `setInterval(sweepOnce, 2000)`: a sweep starts every interval, whether or not
/// the previous one finished.
pub(crate) async fn start_sweeper(
    endpoints: &Endpoints,
    interval: Duration,
    limit: u64,
    stats: Arc<SweeperStats>,
) -> Result<JoinHandle<()>, String> {
    let mut conn = endpoints.redis().await?;
    let scripts = Arc::new(Scripts::load(&mut conn).await.map_err(|e| format!("SCRIPT LOAD: {e}"))?);
    Ok(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.tick().await;
        loop {
            tick.tick().await;
            let (mut conn, scripts, stats) = (conn.clone(), Arc::clone(&scripts), Arc::clone(&stats));
            tokio::spawn(async move {
                match redis_seed::sweep_once(&mut conn, &scripts, limit).await {
                    Ok(s) => {
                        stats.sweeps.fetch_add(1, Ordering::Relaxed);
                        stats.users.fetch_add(s.users, Ordering::Relaxed);
                        stats.published.fetch_add(s.published, Ordering::Relaxed);
                    }
                    Err(_) => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                    }
                }
            });
        }
    }))
}

/// Runs the scenario.
pub(crate) async fn run(args: ExpiryArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let target = common.target;
    let endpoints = common.endpoints();
    let n = args.users.max(1);
    let g = args.gateway_sessions;
    // One session per user, session k = user k: 0..n expire, n..n + g are the gateway's.
    let pop = Population { users: n + g, sessions: n + g };
    let shared = Arc::new(Shared {
        naming: Naming::new(pop, common.gateway_id.clone()),
        gens: Generations::new(pop.sessions),
        deadlines: Some(Slots::new(pop.sessions)),
    });
    println!(
        "expiry: {n} users whose leases run out within {} ms, on {} ({})",
        args.window_ms,
        endpoints.host(),
        format!("{target:?}").to_lowercase()
    );
    let sweeper_stats = Arc::new(SweeperStats::default());
    let sweeper = match target {
        TargetKind::Redis => Some(
            start_sweeper(
                &endpoints,
                Duration::from_millis(args.sweep_interval_ms.max(1)),
                args.sweep_limit,
                Arc::clone(&sweeper_stats),
            )
            .await?,
        ),
        TargetKind::Presenced => None,
    };

    let items_per_call = args.drive.mode.items_per_call(args.drive.batch);
    let spec = args.drive.conn_spec(common);
    let (setup, conns) = register_everyone(&spec, &shared, SETUP_TTL_MS, 0..n + g, progress).await?;
    if setup.rec.ok_count() < n + g {
        return Err(format!(
            "only {} of {} registers succeeded: {:?}",
            setup.rec.ok_count(),
            n + g,
            setup.rec.errors()
        ));
    }

    let already_online = (n + g) - setup.flips.min(n + g);
    if already_online > 0 {
        println!(
            "warning: {already_online} of the {} users were already ONLINE before this run (leases left by an earlier \
             run on this server): they go OFFLINE only when those leases end too. Use a fresh server.",
            n + g
        );
    }
    let collector = Arc::new(Collector::new(Arc::clone(&shared), n));
    let away = Arc::new(Mutex::new(None));
    let feed_cursor = Arc::new(Mutex::new(Vec::new()));
    let viewer = match (target, args.viewer) {
        (TargetKind::Presenced, ExpiryViewer::Watch) => {
            presenced_viewer(&endpoints, n, args.watch_chunk, Arc::clone(&collector)).await?
        }
        (TargetKind::Presenced, ExpiryViewer::Feed) => {
            feed_viewer(endpoints.clone(), Arc::clone(&collector), Arc::clone(&away), Arc::clone(&feed_cursor)).await?
        }
        (TargetKind::Redis, _) => redis_viewer(&endpoints, Arc::clone(&collector), Arc::clone(&away)).await?,
    };
    if args.viewer_away_ms > 0 && target == TargetKind::Presenced && args.viewer == ExpiryViewer::Watch {
        return Err("--viewer-away-ms needs --viewer feed on presenced (a Watch resyncs instead)".into());
    }

    // The second registration takes about as long as the first: start the window after it.
    let lead = setup.elapsed.mul_f64(1.5) + Duration::from_millis(1_000);
    let quiet_ms = if g > 0 { args.quiet_ms as i64 } else { 0 };
    let lead_ms = (lead.as_millis() as i64).max(i64::from(args.min_ttl_ms) + 500) + quiet_ms;
    let first_deadline = redis_seed::now_ms() + lead_ms;
    let (arranged, conns) = run_phase(
        conns,
        Arc::clone(&shared),
        PhaseSpec {
            title: "arrange".into(),
            work: Work::Register(TtlPlan::Arranged {
                first_deadline_ms: first_deadline,
                window_ms: args.window_ms.max(1),
                count: n,
                min_ttl_ms: args.min_ttl_ms,
            }),
            items_per_call,
            bound: Bound::Sessions(0..n),
            rate: 0.0,
        },
        progress,
    )
    .await;
    drop(conns);
    // The expiring users' deadlines only: the gateway's sessions hold the setup's long TTL.
    let deadlines = shared.deadlines.as_ref().map(|d| (0..n).map(|k| d.get(k)).collect::<Vec<_>>());
    let deadlines = deadlines.unwrap_or_default();
    let min_deadline = deadlines.iter().copied().filter(|&d| d > 0).min().unwrap_or(first_deadline);
    let max_deadline = deadlines.iter().copied().max().unwrap_or(first_deadline);
    if args.viewer_away_ms > 0 {
        *away.lock().unwrap_or_else(|e| e.into_inner()) =
            Some(Away { at_ms: min_deadline, for_ms: args.viewer_away_ms });
    }
    let give_up_ns = (max_deadline * 1_000_000).saturating_add(args.timeout.as_nanos() as i64);
    let gateway_spec = GatewaySpec {
        endpoints: endpoints.clone(),
        first: n,
        sessions: g,
        rate: args.gateway_rate,
        concurrency: args.gateway_concurrency,
        ttl_ms: SETUP_TTL_MS,
    };
    let gateway = if g > 0 {
        if redis_seed::now_ms() >= min_deadline {
            println!(
                "warning: the arranging registers ran past the first deadline: the gateway has no quiet phase \
                 (raise --quiet-ms)"
            );
        }
        Some(gateway::start(&gateway_spec, &shared, min_deadline, max_deadline)?)
    } else {
        None
    };

    let spinner = progress.spinner("expiring");
    while collector.received() < n && unix_ns() < give_up_ns {
        tokio::time::sleep(Duration::from_millis(20)).await;
        spinner.set_message(format!("{}/{n} OFFLINE received", collector.received()));
    }
    spinner.finish_and_clear();
    let streams = viewer.streams;
    viewer.stop().await;
    let caught_up = if args.catch_up && args.viewer == ExpiryViewer::Feed && target == TargetKind::Presenced {
        let through = feed_cursor.lock().unwrap_or_else(|e| e.into_inner()).clone();
        Some(catch_up(&endpoints, &through).await?)
    } else {
        None
    };
    if let Some(s) = sweeper {
        s.abort();
    }
    let gateway = match gateway {
        Some(task) => Some(task.await.map_err(|e| format!("the gateway task failed: {e}"))??),
        None => None,
    };

    if let Some(path) = &args.lags_csv {
        let mut csv = String::from("user,deadline_ms,arrival_unix_ns,lag_ns\n");
        for k in 0..n {
            let (d, a) = (deadlines.get(k as usize).copied().unwrap_or(0), collector.arrivals.get(k));
            let lag = if a > 0 { (a - d * 1_000_000).to_string() } else { String::new() };
            csv.push_str(&format!("{},{d},{a},{lag}\n", user_id(k)));
        }
        std::fs::write(path, csv).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    let lags = collector.lags.lock().unwrap_or_else(|e| e.into_inner()).clone();
    let received = collector.received();
    let missing = n - received.min(n);
    let last_arrival = collector.last_arrival_ns.load(Ordering::Relaxed);
    let drain_from_first = (last_arrival - min_deadline * 1_000_000).max(0) as u64;
    let drain_after_last = (last_arrival - max_deadline * 1_000_000).max(0) as u64;
    let total = Duration::from_nanos(drain_from_first);
    let mut report = Report::from_recorder("expiry", &lags, total, "normal");
    if missing > 0 {
        report.status_code_distribution.insert("DeadlineExceeded".into(), missing);
        report.end_reason = "timeout".into();
    }
    report.options.host = endpoints.host();
    report.options.call = match target {
        TargetKind::Presenced if args.viewer == ExpiryViewer::Feed => {
            "presence.v1.Presence.Changes (OFFLINE flips)".into()
        }
        TargetKind::Presenced => "presence.v1.Presence.Watch (OFFLINE updates)".into(),
        TargetKind::Redis => "PSUBSCRIBE presence:out:* (sweeper every 2 s)".into(),
    };
    report.options.total = n;
    let lag = |p: f64| lags.percentile_ns(p);
    report.tag("target", format!("{target:?}").to_lowercase());
    report.tag("users", n);
    report.set("target", format!("{target:?}").to_lowercase());
    report.set("users", n);
    report.set("window_ms", args.window_ms);
    report.set("deadline_span_ms", max_deadline - min_deadline);
    report.set("late_registrations", arranged.late);
    report.set("arranged_registers_ok", arranged.rec.ok_count());
    report.set("arranged_register_flips", arranged.flips);
    report.set("viewer_streams", streams);
    report.set("already_online", already_online);
    report.set("received", received);
    report.set("missing", missing);
    report.set("duplicates", collector.duplicates.load(Ordering::Relaxed));
    report.set("unexpected", collector.unexpected.load(Ordering::Relaxed));
    report.set("via_resync", collector.via_resync.load(Ordering::Relaxed));
    report.set("early", collector.early.load(Ordering::Relaxed));
    report.set(
        "lag_ns",
        json!({"p50": lag(50.0), "p90": lag(90.0), "p99": lag(99.0), "max": lags.slowest_ns(), "min": lags.fastest_ns()}),
    );
    report.set("drain_from_first_deadline_ns", drain_from_first);
    report.set("drain_after_last_deadline_ns", drain_after_last);
    report.set("register_phase", phase_report("register", &setup, "normal"));
    report.set("viewer", format!("{:?}", args.viewer).to_lowercase());
    report.set("viewer_away_ms", args.viewer_away_ms);
    if let Some((events, took)) = caught_up {
        report.set("catch_up", json!({"events": events, "ns": took.as_nanos() as u64}));
    }
    if let Some(gw) = &gateway {
        report.set("gateway", gw.summary(&gateway_spec, "during_expiry"));
    }
    if target == TargetKind::Redis {
        report.set(
            "sweeper",
            json!({
                "interval_ms": args.sweep_interval_ms,
                "limit": args.sweep_limit,
                "sweeps": sweeper_stats.sweeps.load(Ordering::Relaxed),
                "users": sweeper_stats.users.load(Ordering::Relaxed),
                "published": sweeper_stats.published.load(Ordering::Relaxed),
                "errors": sweeper_stats.errors.load(Ordering::Relaxed),
            }),
        );
    }
    print!("{}", report.summary("OFFLINE events (latency = lag from the lease deadline):"));
    println!(
        "\n  {received}/{n} OFFLINE received ({missing} missing, {} via a resync snapshot, {} duplicates, {} more \
         than 1 ms before the deadline)",
        collector.via_resync.load(Ordering::Relaxed),
        collector.duplicates.load(Ordering::Relaxed),
        collector.early.load(Ordering::Relaxed)
    );
    println!(
        "  lag p50 {}  p90 {}  p99 {}  max {}",
        fmt_ns(lag(50.0)),
        fmt_ns(lag(90.0)),
        fmt_ns(lag(99.0)),
        fmt_ns(lags.slowest_ns())
    );
    println!(
        "  deadlines spread over {} ms ({} registered too late for their slot); all drained {} after the first \
         deadline, {} after the last",
        max_deadline - min_deadline,
        arranged.late,
        fmt_ns(drain_from_first),
        fmt_ns(drain_after_last)
    );
    if target == TargetKind::Redis {
        println!(
            "  sweeper: {} sweeps of at most {} users every {} ms, {} users, {} OFFLINE published",
            sweeper_stats.sweeps.load(Ordering::Relaxed),
            args.sweep_limit,
            args.sweep_interval_ms,
            sweeper_stats.users.load(Ordering::Relaxed),
            sweeper_stats.published.load(Ordering::Relaxed)
        );
    }
    if args.viewer_away_ms > 0 {
        println!("  the viewer was away for {} ms from the first deadline", args.viewer_away_ms);
    }
    if let Some((events, took)) = caught_up {
        println!(
            "  catching up: {events} events of the feed read from its oldest in {} ({:.0} events/s)",
            fmt_ns(took.as_nanos() as u64),
            events as f64 / took.as_secs_f64()
        );
    }
    if let Some(gw) = &gateway {
        gw.print("during the expiries");
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collector_measures_lag_once_per_user() {
        let pop = Population::new(3, 1.0);
        let shared = Arc::new(Shared {
            naming: Naming::new(pop, "g".into()),
            gens: Generations::new(3),
            deadlines: Some(Slots::new(3)),
        });
        shared.deadlines.as_ref().unwrap().set(1, 1_000);
        let c = Collector::new(Arc::clone(&shared), 3);
        c.offline("u1", 1_000 * 1_000_000 + 5_000_000, false);
        c.offline("u1", 1_000 * 1_000_000 + 9_000_000, false);
        c.offline("u9", 0, false);
        c.offline("bogus", 0, false);
        assert_eq!(c.received(), 1);
        assert_eq!(c.duplicates.load(Ordering::Relaxed), 1);
        assert_eq!(c.unexpected.load(Ordering::Relaxed), 2);
        let lags = c.lags.lock().unwrap();
        assert_eq!(lags.slowest_ns(), 5_000_000);
    }
}
