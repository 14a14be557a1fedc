//! `soak` (presenced): does a server that holds millions of healthy, renewing sessions
//! stay correct and flat for a long time, and does it absorb a reconnect storm?
//!
//! 1. `--sessions` sessions (2.5 per user) are registered in `Leases` batches.
//! 2. Each then renews every `--interval-ms`, from a phase of its own (spread evenly over
//!    the interval by session number), each renewal up to `--jitter-ms` early or late: a
//!    timer wheel of 100 ms slots holds every session's next renewal, and what falls due
//!    goes out in batches of `--batch`, `--concurrency` in flight.
//! 3. Beside them, `--expiring-per-minute` other users (one session each) register and
//!    never renew: their leases run out all through the run, so the server's expiry lag
//!    is measured, and their OFFLINE events (watched too) are expected ones.
//! 4. A Watch on `--watch-sample` users spread over the healthy ones: every OFFLINE it
//!    sees is false. The server's own count is `presenced_flips_total{state="offline"}`,
//!    which, once the expiring users have all run out, must equal their OFFLINEs.
//! 5. Every `--window` a line: renewals/s, errors, false OFFLINE (viewer and server),
//!    expected expiries, the server's expiry lag p99 (its histogram, that window), the
//!    viewer's, resident memory, server CPU and the machine's load.
//! 6. The storm: the gateway holding sessions `0..--storm-sessions` dies (they stop
//!    renewing) and its clients come back through other gateways, which register every one
//!    of them again as fast as they can, on new connections: same session id, new
//!    generation, while the old lease still runs. The contract's answer to that is a
//!    reconnect (L1): a new generation and no flip. Renewals of the rest go on through
//!    it, and for `--after-storm` after it.
//!
//! Memory drift is measured after `--warmup`: by then every session has renewed many
//! times and the expiring population has reached its steady size up to forgetting (B6).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient};
use presence_client::{Backoff, LeaseChannel, LeaseChannelConfig, Watcher, WatcherEvent};
use serde_json::{Value, json};
use tokio::sync::{Semaphore, watch};
use tokio::task::JoinHandle;

use crate::cli::SoakArgs;
use crate::conn::{Conn, ConnSpec, Endpoints, GenItem, LeaseSink, Mode, Naming, RegItem, TargetKind};
use crate::expiry::unix_ns;
use crate::ids::{Generations, Population, Rng, Slots};
use crate::phase::{PhaseResult, Shared, register_everyone};
use crate::progress::Progress;
use crate::redis_seed::now_ms;
use crate::report::Report;
use crate::server::{Sample, Server, bucket_quantile, fmt_bound, loadavg_line, wait_for};
use crate::stats::{Recorder, fmt_ns};

/// The timer wheel's slot.
const SLOT: Duration = Duration::from_millis(100);
/// The server's expiry lag histogram.
const LAG: &str = "presenced_expiry_lag_seconds";
/// Its highest finite bucket, in seconds (presenced's LATENCY_BUCKETS).
const LAG_TOP_S: f64 = 5.0;
const OFFLINE_FLIPS: &str = "presenced_flips_total{state=\"offline\"}";
const EXPIRIES: &str = "presenced_expiries_total";
const RECONNECTS: &str = "presenced_reconnects_total";

/// Session `k`'s phase within the interval: spread evenly, in an order unrelated to `k`'s
/// user, so that no shard sees its sessions come due together.
pub(crate) fn phase_ms(k: u64, interval_ms: u64) -> u64 {
    // A multiplicative hash is a bijection of u64: every phase is taken about equally.
    k.wrapping_mul(0x9e37_79b9_7f4a_7c15) % interval_ms.max(1)
}

/// The next renewal of a session renewed now: the interval, give or take the jitter.
pub(crate) fn next_delay_ms(rng: &mut Rng, interval_ms: u64, jitter_ms: u64) -> u64 {
    let spread = 2 * jitter_ms + 1;
    (interval_ms + rng.below(spread)).saturating_sub(jitter_ms).max(1)
}

/// One window's renewals, as the workers record them.
#[derive(Debug, Default)]
struct Window {
    rec: Recorder,
    /// Renewals answered `RESOURCE_EXHAUSTED`: shed (B2), allowed, counted apart.
    shed: u64,
    throttled: u64,
    /// Renewals sent after their lease's deadline: the generator (or the machine) was late.
    sent_late: u64,
    /// `NOT_FOUND` answers that came after the lease's deadline could have passed: the
    /// lease may well have expired, as the contract says it must. Every other error is
    /// unexplained.
    not_found_late: u64,
    /// Sessions registered again after a `NOT_FOUND`, as a gateway does.
    reregistered: u64,
    reregister_errors: u64,
}

impl Window {
    fn add(&mut self, w: &Window) {
        self.rec.merge(&w.rec);
        self.shed += w.shed;
        self.throttled += w.throttled;
        self.sent_late += w.sent_late;
        self.not_found_late += w.not_found_late;
        self.reregistered += w.reregistered;
        self.reregister_errors += w.reregister_errors;
    }

    /// Errors: every answer but OK and shed.
    fn errors(&self) -> u64 {
        self.rec.count() - self.rec.ok_count() - self.shed
    }

    /// Errors a late renewal does not explain.
    fn unexplained(&self) -> u64 {
        self.errors() - self.not_found_late
    }
}

/// What the viewers saw.
#[derive(Debug, Default)]
struct Seen {
    /// OFFLINE updates for healthy users: false.
    false_offline: AtomicU64,
    /// Of those, for users with a session whose lease was provably still running (its
    /// earliest deadline after the update's arrival): not explained by a late renewal.
    false_offline_unexplained: AtomicU64,
    /// Users found OFFLINE in a resync snapshot of the healthy sample: false too.
    false_offline_resync: AtomicU64,
    resyncs: AtomicU64,
    /// OFFLINE updates for expiring users: expected.
    expected_offline: AtomicU64,
    /// Their lag from the lease deadline to the viewer, this window and the whole run.
    lags: Mutex<(Recorder, Recorder)>,
}

/// The renewal machinery's switches and counters.
#[derive(Debug, Default)]
struct Control {
    stop: AtomicBool,
    /// Sessions below this number are not renewed (their gateway died).
    paused_below: AtomicU64,
    /// Ticks the scheduler ran since it last saw `paused_below` change.
    ticks: AtomicU64,
    dispatched: AtomicU64,
    completed: AtomicU64,
    /// Ticks run more than one slot late (the generator behind its schedule).
    late_ticks: AtomicU64,
    max_tick_lag_ms: AtomicU64,
}

/// One line of the report.
#[derive(Debug, Clone)]
struct Line {
    label: String,
    seconds: f64,
    renewals: u64,
    errors: u64,
    unexplained: u64,
    sent_late: u64,
    shed: u64,
    p99_ns: u64,
    false_offline_viewer: u64,
    offline_flips_server: Option<f64>,
    expiries_server: Option<f64>,
    expected_offline: u64,
    lag_p99_server: Option<f64>,
    lag_p99_viewer_ns: u64,
    rss: Option<u64>,
    cores: Option<f64>,
    late_ticks: u64,
    loadavg: String,
}

impl Line {
    fn json(&self) -> Value {
        json!({
            "window": self.label, "seconds": self.seconds, "renewals": self.renewals,
            "renewals_per_s": self.renewals as f64 / self.seconds.max(1e-9), "errors": self.errors,
            "errors_unexplained": self.unexplained, "renewals_sent_after_deadline": self.sent_late,
            "shed": self.shed, "renew_p99_ns": self.p99_ns, "false_offline_viewer": self.false_offline_viewer,
            "offline_flips_server": self.offline_flips_server, "expiries_server": self.expiries_server,
            "expected_offline_viewer": self.expected_offline, "expiry_lag_p99_server_s": self.lag_p99_server,
            "expiry_lag_p99_viewer_ns": self.lag_p99_viewer_ns, "rss_bytes": self.rss, "server_cores": self.cores,
            "late_ticks": self.late_ticks, "loadavg": self.loadavg,
        })
    }

    fn header() -> String {
        format!(
            "{:>8} {:>9} {:>6} {:>6} {:>6} {:>5} {:>9} {:>5} {:>7} {:>7} {:>6} {:>11} {:>9} {:>9} {:>5} {:>5} {}",
            "window",
            "renew/s",
            "errors",
            "unexpl",
            "late",
            "shed",
            "p99",
            "false",
            "offl(s)",
            "expir(s)",
            "expct",
            "lag p99(s)",
            "lag p99(v)",
            "RSS MiB",
            "CPU",
            "ticks",
            "loadavg"
        )
    }

    fn row(&self) -> String {
        let opt = |v: Option<f64>| v.map_or_else(|| "-".into(), |v| format!("{v:.0}"));
        format!(
            "{:>8} {:>9.0} {:>6} {:>6} {:>6} {:>5} {:>9} {:>5} {:>7} {:>8} {:>6} {:>11} {:>9} {:>9} {:>5} {:>5} {}",
            self.label,
            self.renewals as f64 / self.seconds.max(1e-9),
            self.errors,
            self.unexplained,
            self.sent_late,
            self.shed,
            fmt_ns(self.p99_ns),
            self.false_offline_viewer,
            opt(self.offline_flips_server),
            opt(self.expiries_server),
            self.expected_offline,
            fmt_bound(self.lag_p99_server, LAG_TOP_S),
            fmt_ns(self.lag_p99_viewer_ns),
            self.rss.map_or_else(|| "-".into(), |b| format!("{:.1}", b as f64 / 1048576.0)),
            self.cores.map_or_else(|| "-".into(), |c| format!("{c:.2}")),
            self.late_ticks,
            self.loadavg
        )
    }
}

/// Everything the windows measure, shared by the tasks.
struct Run {
    healthy: Arc<Shared>,
    expiring: Arc<Shared>,
    window: Mutex<Window>,
    /// Every renewal of the run.
    total: Mutex<Window>,
    seen: Seen,
    control: Control,
    /// Expiring sessions registered so far.
    expiring_registered: AtomicU64,
    expiring_errors: Mutex<Recorder>,
}

/// Runs the scenario.
pub(crate) async fn run(args: SoakArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    if common.target != TargetKind::Presenced {
        return Err("soak drives presenced only".into());
    }
    let server = Server::start(&args.server, &common.addr)?;
    let endpoints = Endpoints { addr: server.addr.clone(), ..common.endpoints() };
    let pop = Population::from_sessions(args.sessions, args.sessions_per_user);
    let minutes = args.duration.as_secs_f64() / 60.0;
    let expiring_total = (args.expiring_per_minute as f64 * (minutes + 1.0)).ceil() as u64;
    let expiring_pop = Population { users: expiring_total.max(1), sessions: expiring_total.max(1) };
    let run = Arc::new(Run {
        // Each healthy session's earliest possible deadline (Unix ms): the register's
        // `expires_at_ms`, then a renewal's send time plus the TTL.
        healthy: Arc::new(Shared {
            naming: Naming::new(pop, common.gateway_id.clone()),
            gens: Generations::new(pop.sessions),
            deadlines: Some(Slots::new(pop.sessions)),
        }),
        expiring: Arc::new(Shared {
            naming: Naming::offset(expiring_pop, common.gateway_id.clone(), pop.users, pop.sessions),
            gens: Generations::new(expiring_pop.sessions),
            deadlines: Some(Slots::new(expiring_pop.sessions)),
        }),
        window: Mutex::new(Window::default()),
        total: Mutex::new(Window::default()),
        seen: Seen::default(),
        control: Control::default(),
        expiring_registered: AtomicU64::new(0),
        expiring_errors: Mutex::new(Recorder::default()),
    });
    println!(
        "soak: {} sessions of {} users renewing every {} ms +- {} ms for {:.0} min (TTL {} ms), {} expiring users a \
         minute, {} watched; then {} sessions register again; on {} (machine load {})",
        pop.sessions,
        pop.users,
        args.interval_ms,
        args.jitter_ms,
        minutes,
        args.ttl_ms,
        args.expiring_per_minute,
        args.watch_sample,
        args.storm_sessions.min(pop.sessions),
        endpoints.host(),
        loadavg_line()
    );

    let spec = ConnSpec {
        endpoints: endpoints.clone(),
        mode: Mode::Leases,
        concurrency: args.concurrency.max(1),
        connections: args.connections.max(1),
        batch: args.batch.max(1),
        max_delay: Duration::from_millis(1),
    };
    let before_register = server.sample().await;
    let (reg, conns) = register_everyone(&spec, &run.healthy, args.ttl_ms, 0..pop.sessions, progress).await?;
    if reg.rec.ok_count() < pop.sessions {
        return Err(format!(
            "only {} of {} registers succeeded: {:?}",
            reg.rec.ok_count(),
            pop.sessions,
            reg.rec.errors()
        ));
    }
    let registered = server.sample().await;
    println!(
        "registered {} sessions in {:.1} s ({:.0}/s, p99 {}); server RSS {} -> {} MiB",
        pop.sessions,
        reg.elapsed.as_secs_f64(),
        reg.rate(),
        fmt_ns(reg.rec.percentile_ns(99.0)),
        mib(before_register.rss_bytes),
        mib(registered.rss_bytes)
    );
    let channels: Vec<LeaseChannel> = conns
        .into_iter()
        .filter_map(|c| match c {
            Conn::Leases(LeaseSink::One(ch)) => Some(ch),
            _ => None,
        })
        .collect();

    // The viewers: the healthy sample, and every expiring user.
    let (stop_viewers, stop_rx) = watch::channel(false);
    let sample: Vec<u64> =
        (0..args.watch_sample.min(pop.users)).map(|i| i * pop.users / args.watch_sample.max(1)).collect();
    let sample_ids: Vec<String> = sample.iter().map(|&u| crate::ids::user_id(u)).collect();
    let mut viewers = Vec::new();
    for chunk in sample_ids.chunks(10_000) {
        viewers.push(open_viewer(&endpoints, chunk.to_vec(), Arc::clone(&run), false, stop_rx.clone()).await?);
    }
    let expiring_ids: Vec<String> = (0..expiring_pop.users).map(|k| run.expiring.naming.ids(k).0).collect();
    for chunk in expiring_ids.chunks(10_000) {
        viewers.push(open_viewer(&endpoints, chunk.to_vec(), Arc::clone(&run), true, stop_rx.clone()).await?);
    }

    // Renewals, and the expiring users beside them.
    let start = Instant::now();
    let generator_cpu_start = crate::server_cpu::cpu_ns(std::process::id()).ok();
    let scheduler = start_scheduler(&args, Arc::clone(&run), channels, pop.sessions);
    let expiring_task = start_expiring(&args, &endpoints, Arc::clone(&run), expiring_pop.sessions).await?;

    println!("\n{}", Line::header());
    let first = server.sample().await;
    let mut lines = Vec::new();
    let mut prev = first.clone();
    let mut prev_viewer = ViewerCounts::read(&run.seen);
    let mut warm: Option<Sample> = None;
    let mut after_warmup = Vec::new();
    let mut n = 0u32;
    while start.elapsed() < args.duration {
        n += 1;
        let next = start + args.window * n;
        let until = next.min(start + args.duration);
        tokio::time::sleep_until(until.into()).await;
        let now = server.sample().await;
        let secs = start.elapsed().as_secs();
        let line = window_line(format!("{}:{:02}", secs / 60, secs % 60), &run, &prev, &now, &mut prev_viewer);
        println!("{}", line.row());
        if warm.is_none() && start.elapsed() >= args.warmup {
            warm = Some(now.clone());
        }
        if warm.is_some() {
            after_warmup.push(now.rss_bytes);
        }
        lines.push(line);
        prev = now;
    }
    let soak_end = prev.clone();
    let soak_viewer = ViewerCounts::read(&run.seen);
    let soak_total = take(&run.total);

    // The storm.
    let storm = if args.storm_sessions > 0 {
        Some(storm(&args, &endpoints, &run, &server, pop.sessions.min(args.storm_sessions)).await?)
    } else {
        None
    };
    if let Some(s) = &storm {
        println!("{}", s.line.row());
        lines.push(s.line.clone());
        prev = s.after.clone();
    }
    // After it, renewals go on.
    let after_start = Instant::now();
    while after_start.elapsed() < args.after_storm && storm.is_some() {
        let step = args.window.min(args.after_storm - after_start.elapsed());
        tokio::time::sleep(step).await;
        let now = server.sample().await;
        let line = window_line("after".into(), &run, &prev, &now, &mut prev_viewer);
        println!("{}", line.row());
        lines.push(line);
        prev = now;
    }

    // The end: stop renewing, let every expiring lease run out and its OFFLINE arrive.
    run.control.stop.store(true, Ordering::Relaxed);
    expiring_task.abort();
    let _ = expiring_task.await;
    let _ = scheduler.await;
    let expiring_registered = run.expiring_registered.load(Ordering::Relaxed);
    let ttl = Duration::from_millis(u64::from(args.expiring_ttl_ms));
    let all_expired = wait_for(ttl + Duration::from_secs(10), || {
        run.seen.expected_offline.load(Ordering::Relaxed) >= expiring_registered
    })
    .await;
    let last = server.sample().await;
    let _ = stop_viewers.send(true);
    for v in viewers {
        v.abort();
        let _ = v.await;
    }

    // Summary.
    let total = take(&run.total);
    let all_renewals = merge(&soak_total, &total);
    let viewer_false =
        run.seen.false_offline.load(Ordering::Relaxed) + run.seen.false_offline_resync.load(Ordering::Relaxed);
    let expected_offline = run.seen.expected_offline.load(Ordering::Relaxed);
    let server_offline = last.delta(&first, OFFLINE_FLIPS);
    let server_expiries = last.delta(&first, EXPIRIES);
    let server_false = server_offline.map(|o| o - expected_offline as f64);
    let warm_rss = warm.as_ref().and_then(|w| w.rss_bytes);
    let soak_rss = soak_end.rss_bytes;
    let drift = warm_rss.zip(soak_rss).map(|(w, e)| (e as f64 - w as f64) / w as f64);
    let after: Vec<u64> = after_warmup.iter().flatten().copied().collect();
    let (rss_min, rss_max) = (after.iter().min().copied(), after.iter().max().copied());
    let spread = rss_min.zip(rss_max).zip(warm_rss).map(|((lo, hi), w)| (hi - lo) as f64 / w as f64);
    let lag_buckets = soak_end.buckets_since(&first, LAG);
    let lags = run.seen.lags.lock().unwrap_or_else(|e| e.into_inner()).1.clone();
    let expiring_errors = run.expiring_errors.lock().unwrap_or_else(|e| e.into_inner()).count();
    let soak_cores = soak_end.cores_since(&first);
    let generator_cores = generator_cpu_start
        .zip(crate::server_cpu::cpu_ns(std::process::id()).ok())
        .map(|(a, b)| b.saturating_sub(a) as f64 / start.elapsed().as_nanos().max(1) as f64);
    let lag_p99_windows: Vec<Option<f64>> = lines.iter().map(|l| l.lag_p99_server).collect();

    let mut table: Vec<(String, String)> = vec![
        ("healthy sessions / users".into(), format!("{} / {}", pop.sessions, pop.users)),
        ("registered in".into(), format!("{:.1} s ({:.0}/s)", reg.elapsed.as_secs_f64(), reg.rate())),
        (
            "renewals (soak)".into(),
            format!(
                "{} in {:.0} s = {:.0}/s (needed {:.0}/s), p99 {}",
                soak_total.rec.count(),
                args.duration.as_secs_f64(),
                soak_total.rec.count() as f64 / args.duration.as_secs_f64(),
                pop.sessions as f64 * 1000.0 / args.interval_ms as f64,
                fmt_ns(soak_total.rec.percentile_ns(99.0))
            ),
        ),
        (
            "renewal errors (all run)".into(),
            format!(
                "{} ({} unexplained; {} NOT_FOUND answered after the lease's earliest deadline) + {} shed (allowed \
                 by B2) {:?}",
                all_renewals.errors(),
                all_renewals.unexplained(),
                all_renewals.not_found_late,
                all_renewals.shed,
                all_renewals.rec.errors()
            ),
        ),
        (
            "renewals sent after their deadline".into(),
            format!(
                "{} (the generator late); {} sessions registered again after NOT_FOUND ({} errors)",
                all_renewals.sent_late, all_renewals.reregistered, all_renewals.reregister_errors
            ),
        ),
        ("expiring users registered".into(), format!("{expiring_registered} ({expiring_errors} register errors)")),
        (
            "false OFFLINE, viewer".into(),
            format!(
                "{viewer_false} (updates {}, of which {} for a user with a lease provably running; in resyncs {}; {} \
                 resyncs)",
                run.seen.false_offline.load(Ordering::Relaxed),
                run.seen.false_offline_unexplained.load(Ordering::Relaxed),
                run.seen.false_offline_resync.load(Ordering::Relaxed),
                run.seen.resyncs.load(Ordering::Relaxed)
            ),
        ),
        (
            "false OFFLINE, server".into(),
            format!(
                "{} (offline flips {} - expected {expected_offline}; expiries {})",
                opt(server_false),
                opt(server_offline),
                opt(server_expiries)
            ),
        ),
        (
            "expected OFFLINE (expiring)".into(),
            format!(
                "{expected_offline} of {expiring_registered}{}",
                if all_expired { "" } else { " (some never arrived)" }
            ),
        ),
        (
            "expiry lag p99, server".into(),
            format!(
                "{} over the soak; per window: {}",
                fmt_bound(bucket_quantile(&lag_buckets, 0.99), LAG_TOP_S),
                lag_p99_windows.iter().map(|l| fmt_bound(*l, LAG_TOP_S)).collect::<Vec<_>>().join(", ")
            ),
        ),
        (
            "expiry lag, viewer".into(),
            format!(
                "p50 {} p99 {} max {}",
                fmt_ns(lags.percentile_ns(50.0)),
                fmt_ns(lags.percentile_ns(99.0)),
                fmt_ns(lags.slowest_ns())
            ),
        ),
        (
            "server RSS".into(),
            format!(
                "{} MiB registered, {} at warm-up end ({:.0} s), {} at soak end, min {} max {} after warm-up",
                mib(registered.rss_bytes),
                mib(warm_rss),
                args.warmup.as_secs_f64(),
                mib(soak_rss),
                mib(rss_min),
                mib(rss_max)
            ),
        ),
        (
            "RSS drift after warm-up".into(),
            format!("{} (end vs warm-up end), spread {} (max - min over warm-up end)", pct(drift), pct(spread)),
        ),
        (
            "CPU (soak)".into(),
            format!(
                "server {} cores, generator {} cores (whole run)",
                soak_cores.map_or("-".into(), |c| format!("{c:.2}")),
                generator_cores.map_or("-".into(), |c| format!("{c:.2}"))
            ),
        ),
        (
            "scheduler".into(),
            format!(
                "{} ticks more than a slot late, worst {} ms",
                run.control.late_ticks.load(Ordering::Relaxed),
                run.control.max_tick_lag_ms.load(Ordering::Relaxed)
            ),
        ),
        ("machine load (1/5/15 min)".into(), loadavg_line()),
    ];
    if let Some(s) = &storm {
        table.extend(s.table());
        table.push((
            "false OFFLINE, viewer, storm and after".into(),
            format!("{}", viewer_false.saturating_sub(soak_viewer.false_total())),
        ));
    }
    println!("\nSummary:");
    let width = table.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (k, v) in &table {
        println!("  {k:<width$}  {v}");
    }

    let mut report = Report::from_recorder("soak", &all_renewals.rec, start.elapsed(), "normal");
    report.options.host = endpoints.host();
    report.options.call = "presence.v1.Presence.Leases (renew items)".into();
    report.options.concurrency = args.concurrency;
    report.options.connections = args.connections;
    report.options.duration = args.duration.as_nanos() as u64;
    report.tag("target", "presenced");
    report.tag("sessions", pop.sessions);
    report.set("target", "presenced");
    report.set("sessions", pop.sessions);
    report.set("users", pop.users);
    report.set("interval_ms", args.interval_ms);
    report.set("jitter_ms", args.jitter_ms);
    report.set("ttl_ms", args.ttl_ms);
    report.set("duration_s", args.duration.as_secs_f64());
    report.set("warmup_s", args.warmup.as_secs_f64());
    report.set("register_phase", phase_json(&reg));
    report.set("windows", lines.iter().map(Line::json).collect::<Vec<_>>());
    report.set("renewal_errors", all_renewals.errors());
    report.set("renewal_errors_unexplained", all_renewals.unexplained());
    report.set("renewal_not_found_late", all_renewals.not_found_late);
    report.set("renewals_sent_after_deadline", all_renewals.sent_late);
    report.set("reregistered", all_renewals.reregistered);
    report.set("reregister_errors", all_renewals.reregister_errors);
    report.set("false_offline_viewer_unexplained", run.seen.false_offline_unexplained.load(Ordering::Relaxed));
    report.set("renewals_shed", all_renewals.shed);
    report.set("renewals_throttled", all_renewals.throttled);
    report.set("false_offline_viewer", viewer_false);
    report.set("false_offline_server", server_false);
    report.set("offline_flips_server", server_offline);
    report.set("expiries_server", server_expiries);
    report.set("expiring_registered", expiring_registered);
    report.set("expected_offline_viewer", expected_offline);
    report.set("expiry_lag_p99_server_s", bucket_quantile(&lag_buckets, 0.99));
    report.set(
        "expiry_lag_viewer_ns",
        json!({"p50": lags.percentile_ns(50.0), "p99": lags.percentile_ns(99.0), "max": lags.slowest_ns()}),
    );
    report.set("rss_registered_bytes", registered.rss_bytes);
    report.set("rss_warmup_end_bytes", warm_rss);
    report.set("rss_soak_end_bytes", soak_rss);
    report.set("rss_drift", drift);
    report.set("rss_spread", spread);
    report.set("server_cores", soak_cores);
    report.set("generator_cores", generator_cores);
    report.set("loadavg_end", loadavg_line());
    if let Some(s) = &storm {
        report.set("storm", s.json());
    }
    report.set("summary", table.iter().map(|(k, v)| (k.clone(), v.clone())).collect::<BTreeMap<_, _>>());
    Ok(report)
}

fn opt(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{v:.0}"))
}

fn pct(v: Option<f64>) -> String {
    v.map_or_else(|| "-".into(), |v| format!("{:+.2}%", v * 100.0))
}

fn mib(b: Option<u64>) -> String {
    b.map_or_else(|| "-".into(), |b| format!("{:.1}", b as f64 / 1048576.0))
}

fn phase_json(p: &PhaseResult) -> Value {
    json!({
        "count": p.rec.count(), "ok": p.rec.ok_count(), "seconds": p.elapsed.as_secs_f64(), "per_s": p.rate(),
        "p50_ns": p.rec.percentile_ns(50.0), "p99_ns": p.rec.percentile_ns(99.0), "max_ns": p.rec.slowest_ns(),
        "flips": p.flips, "errors": p.rec.errors(),
    })
}

fn take(w: &Mutex<Window>) -> Window {
    std::mem::take(&mut *w.lock().unwrap_or_else(|e| e.into_inner()))
}

fn merge(a: &Window, b: &Window) -> Window {
    let mut out = Window::default();
    out.add(a);
    out.add(b);
    out
}

/// The viewers' counters at one moment.
#[derive(Debug, Clone, Copy)]
struct ViewerCounts {
    false_offline: u64,
    false_resync: u64,
    expected: u64,
}

impl ViewerCounts {
    fn read(seen: &Seen) -> ViewerCounts {
        ViewerCounts {
            false_offline: seen.false_offline.load(Ordering::Relaxed),
            false_resync: seen.false_offline_resync.load(Ordering::Relaxed),
            expected: seen.expected_offline.load(Ordering::Relaxed),
        }
    }

    fn false_total(&self) -> u64 {
        self.false_offline + self.false_resync
    }
}

/// The line of a window from `prev` to `now`; takes the window's renewals.
fn window_line(label: String, run: &Run, prev: &Sample, now: &Sample, viewer: &mut ViewerCounts) -> Line {
    let w = take(&run.window);
    run.total.lock().unwrap_or_else(|e| e.into_inner()).add(&w);
    let v = ViewerCounts::read(&run.seen);
    let lags = std::mem::take(&mut run.seen.lags.lock().unwrap_or_else(|e| e.into_inner()).0);
    let line = Line {
        label,
        seconds: now.at.duration_since(prev.at).as_secs_f64(),
        renewals: w.rec.count(),
        errors: w.errors(),
        unexplained: w.unexplained(),
        sent_late: w.sent_late,
        shed: w.shed,
        p99_ns: w.rec.percentile_ns(99.0),
        false_offline_viewer: v.false_total() - viewer.false_total(),
        offline_flips_server: now.delta(prev, OFFLINE_FLIPS),
        expiries_server: now.delta(prev, EXPIRIES),
        expected_offline: v.expected - viewer.expected,
        lag_p99_server: bucket_quantile(&now.buckets_since(prev, LAG), 0.99),
        lag_p99_viewer_ns: lags.percentile_ns(99.0),
        rss: now.rss_bytes,
        cores: now.cores_since(prev),
        late_ticks: run.control.late_ticks.swap(0, Ordering::Relaxed),
        loadavg: loadavg_line(),
    };
    *viewer = v;
    line
}

/// A Watch over `ids`, counting OFFLINEs as false (healthy) or expected (expiring).
async fn open_viewer(
    endpoints: &Endpoints,
    ids: Vec<String>,
    run: Arc<Run>,
    expiring: bool,
    mut stop: watch::Receiver<bool>,
) -> Result<JoinHandle<()>, String> {
    let client = PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20);
    let mut watcher =
        Watcher::open(client, ids, Backoff::default()).await.map_err(|s| format!("Watch refused: {s}"))?;
    Ok(tokio::spawn(async move {
        loop {
            tokio::select! {
                event = watcher.next() => match event {
                    Some(WatcherEvent::Update(u)) if u.state == pb::State::Offline as i32 => {
                        if expiring {
                            run.seen.expected_offline.fetch_add(1, Ordering::Relaxed);
                            // Expiring user k is user `healthy users + k` (Naming::offset).
                            let k = crate::ids::parse_user_id(&u.user_id)
                                .unwrap_or(0)
                                .saturating_sub(run.healthy.naming.pop.users);
                            let deadline_ms = run.expiring.deadlines.as_ref().map_or(0, |d| d.get(k));
                            let lag = Duration::from_nanos((unix_ns() - deadline_ms * 1_000_000).max(0) as u64);
                            let mut lags = run.seen.lags.lock().unwrap_or_else(|e| e.into_inner());
                            lags.0.ok(lag, 1);
                            lags.1.ok(lag, 1);
                        } else {
                            run.seen.false_offline.fetch_add(1, Ordering::Relaxed);
                            let user = crate::ids::parse_user_id(&u.user_id).unwrap_or(0);
                            if any_lease_running(&run.healthy, user, crate::redis_seed::now_ms()) {
                                run.seen.false_offline_unexplained.fetch_add(1, Ordering::Relaxed);
                            }
                        }
                    }
                    Some(WatcherEvent::Update(_)) => {}
                    Some(WatcherEvent::Resynced) => {
                        run.seen.resyncs.fetch_add(1, Ordering::Relaxed);
                        if !expiring {
                            let offline = watcher.store().iter().filter(|u| u.state == pb::State::Offline as i32).count();
                            run.seen.false_offline_resync.fetch_add(offline as u64, Ordering::Relaxed);
                        }
                    }
                    None => break,
                },
                _ = stop.changed() => break,
            }
        }
    }))
}

/// Whether a session of healthy user `user` provably held a lease at `at_ms` (its
/// earliest deadline was later).
fn any_lease_running(healthy: &Shared, user: u64, at_ms: i64) -> bool {
    let pop = healthy.naming.pop;
    let Some(deadlines) = &healthy.deadlines else { return false };
    (user..pop.sessions).step_by(pop.users.max(1) as usize).any(|k| deadlines.get(k) > at_ms)
}

/// The timer wheel: renews every session when it falls due, until `control.stop`.
fn start_scheduler(args: &SoakArgs, run: Arc<Run>, channels: Vec<LeaseChannel>, sessions: u64) -> JoinHandle<()> {
    let (interval_ms, jitter_ms, ttl_ms) = (args.interval_ms.max(1), args.jitter_ms, args.ttl_ms);
    let batch = args.batch.max(1) as usize;
    let slot_ms = SLOT.as_millis() as u64;
    let slots = ((interval_ms + jitter_ms) / slot_ms + 2) as usize;
    let permits = Arc::new(Semaphore::new(args.concurrency.max(1) as usize));
    tokio::spawn(async move {
        let mut wheel: Vec<Vec<u32>> = vec![Vec::new(); slots];
        for k in 0..sessions {
            wheel[(phase_ms(k, interval_ms) / slot_ms) as usize % slots].push(k as u32);
        }
        let mut rng = Rng::new(0x50a4);
        let start = Instant::now();
        let mut next_channel = 0usize;
        for tick in 1u64.. {
            let due = start + SLOT * (tick as u32);
            tokio::time::sleep_until(due.into()).await;
            let lag = due.elapsed().as_millis() as u64;
            if lag > slot_ms {
                run.control.late_ticks.fetch_add(1, Ordering::Relaxed);
            }
            run.control.max_tick_lag_ms.fetch_max(lag, Ordering::Relaxed);
            if run.control.stop.load(Ordering::Relaxed) {
                return;
            }
            let paused_below = run.control.paused_below.load(Ordering::Relaxed);
            let slot = (tick as usize) % slots;
            let now_due = std::mem::take(&mut wheel[slot]);
            let mut out: Vec<u64> = Vec::with_capacity(batch);
            for &k in &now_due {
                let next = tick + next_delay_ms(&mut rng, interval_ms, jitter_ms) / slot_ms;
                wheel[(next as usize) % slots].push(k);
                // A session whose gateway died is not renewed; its next turn comes as usual.
                if u64::from(k) < paused_below {
                    continue;
                }
                out.push(u64::from(k));
                if out.len() == batch {
                    dispatch(&run, &permits, &channels, &mut next_channel, std::mem::take(&mut out), ttl_ms).await;
                }
            }
            if !out.is_empty() {
                dispatch(&run, &permits, &channels, &mut next_channel, out, ttl_ms).await;
            }
            run.control.ticks.fetch_add(1, Ordering::Relaxed);
        }
    })
}

/// Sends one batch of renewals once a permit is free.
async fn dispatch(
    run: &Arc<Run>,
    permits: &Arc<Semaphore>,
    channels: &[LeaseChannel],
    next: &mut usize,
    sessions: Vec<u64>,
    ttl_ms: u32,
) {
    let Ok(permit) = Arc::clone(permits).acquire_owned().await else { return };
    let mut conn = Conn::Leases(LeaseSink::One(channels[*next % channels.len()].clone()));
    *next += 1;
    run.control.dispatched.fetch_add(1, Ordering::Relaxed);
    let run = Arc::clone(run);
    tokio::spawn(async move {
        let healthy = &run.healthy;
        let Some(deadlines) = &healthy.deadlines else { return };
        let items: Vec<GenItem> =
            sessions.iter().map(|&s| GenItem { session: s, generation: healthy.gens.get(s), ttl_ms }).collect();
        let sent_ms = now_ms();
        let sent = Instant::now();
        let results = conn.renew(&healthy.naming, &items).await;
        let latency = sent.elapsed();
        let answered_ms = now_ms();
        let mut w = Window::default();
        let mut ok = 0;
        let mut gone = Vec::new();
        for (&s, r) in sessions.iter().zip(results) {
            let deadline = deadlines.get(s);
            w.sent_late += u64::from(sent_ms > deadline);
            match r {
                Ok(r) => {
                    ok += 1;
                    w.throttled += u64::from(r.throttled);
                    deadlines.set(s, sent_ms + i64::from(ttl_ms));
                }
                Err(e) => {
                    match e.status {
                        "ResourceExhausted" => w.shed += 1,
                        "NotFound" => {
                            // Answered after the earliest deadline: the lease may have run out.
                            w.not_found_late += u64::from(answered_ms >= deadline);
                            gone.push(RegItem { session: s, ttl_ms });
                        }
                        _ => {}
                    }
                    w.rec.err(latency, e.status, &e.message);
                }
            }
        }
        w.rec.ok(latency, ok);
        // A gateway told NOT_FOUND registers the session again.
        if !gone.is_empty() {
            for (item, r) in gone.iter().zip(conn.register(&healthy.naming, &gone, false).await) {
                match r {
                    Ok(reg) => {
                        w.reregistered += 1;
                        healthy.gens.set(item.session, reg.generation);
                        deadlines.set(item.session, reg.deadline_ms);
                    }
                    Err(_) => w.reregister_errors += 1,
                }
            }
        }
        run.window.lock().unwrap_or_else(|e| e.into_inner()).add(&w);
        run.control.completed.fetch_add(1, Ordering::Relaxed);
        drop(permit);
    });
}

/// Registers `--expiring-per-minute` expiring users a minute, a small batch every second.
async fn start_expiring(
    args: &SoakArgs,
    endpoints: &Endpoints,
    run: Arc<Run>,
    total: u64,
) -> Result<JoinHandle<()>, String> {
    let channel =
        LeaseChannel::connect(endpoints.presenced_uri(), endpoints.lease_config(LeaseChannelConfig::default())?)
            .await
            .map_err(|e| e.to_string())?;
    let (per_minute, ttl_ms) = (args.expiring_per_minute, args.expiring_ttl_ms);
    Ok(tokio::spawn(async move {
        if per_minute == 0 {
            return;
        }
        let mut conn = Conn::Leases(LeaseSink::One(channel));
        let start = Instant::now();
        let mut next = 0u64;
        let mut tick = tokio::time::interval(Duration::from_secs(1));
        loop {
            tick.tick().await;
            let due = ((start.elapsed().as_secs_f64() / 60.0 * per_minute as f64) as u64).min(total);
            if due <= next {
                continue;
            }
            let items: Vec<RegItem> = (next..due).map(|k| RegItem { session: k, ttl_ms }).collect();
            let sent = Instant::now();
            let results = conn.register(&run.expiring.naming, &items, true).await;
            let latency = sent.elapsed();
            for (item, r) in items.iter().zip(results) {
                match r {
                    Ok(reg) => {
                        run.expiring.gens.set(item.session, reg.generation);
                        if let Some(d) = &run.expiring.deadlines {
                            d.set(item.session, reg.deadline_ms);
                        }
                        run.expiring_registered.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(e) => {
                        run.expiring_errors.lock().unwrap_or_else(|e| e.into_inner()).err(latency, e.status, &e.message)
                    }
                }
            }
            next = due;
        }
    }))
}

/// What the storm measured.
struct Storm {
    sessions: u64,
    phase: PhaseResult,
    /// From the first register sent to the last answered.
    elapsed: Duration,
    reconnects_server: Option<f64>,
    offline_flips_server: Option<f64>,
    false_offline_viewer: u64,
    line: Line,
    after: Sample,
    generations_changed: u64,
}

impl Storm {
    fn table(&self) -> Vec<(String, String)> {
        vec![
            (
                "storm: registers".into(),
                format!(
                    "{} in {:.2} s ({:.0}/s), {} errors, p50 {} p99 {} max {}",
                    self.sessions,
                    self.elapsed.as_secs_f64(),
                    self.sessions as f64 / self.elapsed.as_secs_f64().max(1e-9),
                    self.phase.rec.count() - self.phase.rec.ok_count(),
                    fmt_ns(self.phase.rec.percentile_ns(50.0)),
                    fmt_ns(self.phase.rec.percentile_ns(99.0)),
                    fmt_ns(self.phase.rec.slowest_ns())
                ),
            ),
            (
                "storm: reconnects / flips".into(),
                format!(
                    "server reconnects {}, registers that flipped the user {}, offline flips (server) {}, new \
                     generations {}",
                    opt(self.reconnects_server),
                    self.phase.flips,
                    opt(self.offline_flips_server),
                    self.generations_changed
                ),
            ),
            ("storm: false OFFLINE, viewer".into(), self.false_offline_viewer.to_string()),
        ]
    }

    fn json(&self) -> Value {
        json!({
            "sessions": self.sessions,
            "seconds": self.elapsed.as_secs_f64(),
            "per_s": self.sessions as f64 / self.elapsed.as_secs_f64().max(1e-9),
            "register": phase_json(&self.phase),
            "reconnects_server": self.reconnects_server,
            "offline_flips_server": self.offline_flips_server,
            "false_offline_viewer": self.false_offline_viewer,
            "generations_changed": self.generations_changed,
        })
    }
}

/// The reconnect storm: sessions `0..n` stop renewing, and register again at once.
async fn storm(
    args: &SoakArgs,
    endpoints: &Endpoints,
    run: &Arc<Run>,
    server: &Server,
    n: u64,
) -> Result<Storm, String> {
    let before = server.sample().await;
    let viewer_before = ViewerCounts::read(&run.seen);
    let old: Vec<u64> = (0..n).map(|k| run.healthy.gens.get(k)).collect();
    // The dying gateway's renewals stop: wait until the scheduler has seen that and every
    // batch it sent before has been answered, so that none crosses its session's register.
    let ticks = run.control.ticks.load(Ordering::Relaxed);
    run.control.paused_below.store(n, Ordering::Relaxed);
    let seen = wait_for(Duration::from_secs(10), || run.control.ticks.load(Ordering::Relaxed) > ticks + 1).await;
    let dispatched = run.control.dispatched.load(Ordering::Relaxed);
    let drained =
        wait_for(Duration::from_secs(30), || run.control.completed.load(Ordering::Relaxed) >= dispatched).await;
    if !(seen && drained) {
        return Err("the renewals of the storm's sessions did not stop".into());
    }
    println!("storm: {n} sessions register again");
    let spec = ConnSpec {
        endpoints: endpoints.clone(),
        mode: Mode::Leases,
        concurrency: args.storm_concurrency.max(1),
        connections: args.storm_concurrency.max(1),
        batch: args.batch.max(1),
        max_delay: Duration::from_millis(1),
    };
    // New connections: the clients came back through other gateways.
    let (phase, conns) = register_everyone(&spec, &run.healthy, args.ttl_ms, 0..n, Progress::new(true)).await?;
    drop(conns);
    let elapsed = phase.elapsed;
    run.control.paused_below.store(0, Ordering::Relaxed);
    let generations_changed = (0..n).filter(|&k| run.healthy.gens.get(k) != old[k as usize]).count() as u64;
    let after = server.sample().await;
    let mut viewer = viewer_before;
    // The storm's window: its renewals are the others' (the storm sessions were paused).
    let mut line = window_line("storm".into(), run, &before, &after, &mut viewer);
    line.seconds = after.at.duration_since(before.at).as_secs_f64();
    let false_offline_viewer = viewer.false_total() - viewer_before.false_total();
    Ok(Storm {
        sessions: n,
        elapsed,
        reconnects_server: after.delta(&before, RECONNECTS),
        offline_flips_server: after.delta(&before, OFFLINE_FLIPS),
        false_offline_viewer,
        line,
        after,
        phase,
        generations_changed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_cover_the_interval_evenly() {
        let interval = 15_000;
        let mut per_second = [0u64; 15];
        for k in 0..150_000 {
            per_second[(phase_ms(k, interval) / 1000) as usize] += 1;
        }
        // 10,000 a second if even; a hash leaves a few percent either way.
        assert!(per_second.iter().all(|&n| (9_500..=10_500).contains(&n)), "{per_second:?}");
    }

    #[test]
    fn delays_stay_within_the_jitter_and_use_all_of_it() {
        let mut rng = Rng::new(1);
        let delays: Vec<u64> = (0..10_000).map(|_| next_delay_ms(&mut rng, 15_000, 3_000)).collect();
        assert!(delays.iter().all(|d| (12_000..=18_000).contains(d)));
        assert!(delays.iter().any(|&d| d < 12_500) && delays.iter().any(|&d| d > 17_500));
        assert_eq!(next_delay_ms(&mut rng, 100, 0), 100);
    }
}
