//! `fanout`: V viewers each watch W users out of a population while users flip ONLINE and
//! OFFLINE at `--churn-rate`; counts the changes delivered per second across all viewers
//! and their latency from the flip's send to the viewer, while a gateway renews other
//! sessions at `--gateway-rate` and its latency is recorded. With `--stalled-viewer` a
//! second phase adds one viewer that opens a Watch (its own connection) and never reads:
//! the gateway's p99 and the other viewers' rate should not move.
//!
//! presenced: each viewer is a presence-client `Watcher` (one Watch stream), at most
//! `--viewers-per-connection` streams per HTTP/2 connection.
//! Redis: the seed's subscription side — one process-wide connection that SUBSCRIBEs once to
//! `presence:out:<user>` for every watched user and fans out locally to its viewers (in
//! memory, so this side measures Redis pub/sub delivery, not per-viewer network sends);
//! the stalled viewer is a raw connection that sends `PSUBSCRIBE presence:out:*` and never
//! reads, so Redis buffers for it until its client-output-buffer limit cuts it off.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use futures_util::StreamExt;
use presence_client::pb::{self, presence_client::PresenceClient};
use presence_client::{Backoff, Watcher, WatcherEvent};
use serde_json::{Value, json};
use tokio::io::AsyncWriteExt;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::cli::FanoutArgs;
use crate::conn::{Conn, ConnSpec, Endpoints, GenItem, Naming, RegItem, TargetKind, open_conns};
use crate::expiry::unix_ns;
use crate::ids::{Generations, Population, Rng, Slots, parse_user_id, sample_distinct, user_id};
use crate::load::phase_report;
use crate::phase::{Bound, PhaseResult, PhaseSpec, Shared, Work, register_everyone, run_phase};
use crate::progress::Progress;
use crate::redis_seed::{OUT_PREFIX, out_channel};
use crate::report::Report;
use crate::stats::{Recorder, fmt_ns};

/// Phases: 0 setup, 1 plain, 2 with the stalled viewer, 3 done.
const PHASES: usize = 4;

/// What the viewers share.
#[derive(Debug)]
struct Board {
    /// The phase events are counted in.
    phase: AtomicUsize,
    /// Updates delivered, per phase.
    events: [AtomicU64; PHASES],
    /// Resync snapshots, per phase.
    resyncs: [AtomicU64; PHASES],
    /// When each user's latest flip was sent (Unix ns), by user number.
    flip_ns: Slots,
}

impl Board {
    fn phase(&self) -> usize {
        self.phase.load(Ordering::Relaxed).min(PHASES - 1)
    }
}

/// Per-phase latency recorders of one viewer task.
type PhaseRecorders = Vec<Recorder>;

fn phase_recorders() -> PhaseRecorders {
    (0..PHASES).map(|_| Recorder::default()).collect()
}

/// Records one delivered change of `user`, `fanout` times (viewers that got it).
fn deliver(board: &Board, recs: &mut PhaseRecorders, user: &str, fanout: u64) {
    let phase = board.phase();
    board.events[phase].fetch_add(fanout, Ordering::Relaxed);
    record_lag(board, recs, phase, user, fanout);
}

/// Records the latency of one delivered change of `user`, from its flip's send.
fn record_lag(board: &Board, recs: &mut PhaseRecorders, phase: usize, user: &str, fanout: u64) {
    let sent = parse_user_id(user).map_or(0, |n| board.flip_ns.get(n));
    if sent > 0 {
        let lag = (unix_ns() - sent).max(0) as u64;
        recs[phase].ok(Duration::from_nanos(lag), fanout);
    }
}

struct Viewers {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<PhaseRecorders>>,
}

impl Viewers {
    async fn stop(self) -> PhaseRecorders {
        let _ = self.stop.send(true);
        let mut all = phase_recorders();
        for t in self.tasks {
            if let Ok(recs) = t.await {
                for (a, r) in all.iter_mut().zip(&recs) {
                    a.merge(r);
                }
            }
        }
        all
    }
}

/// Events one viewer counted but has not yet added to the board's shared counters
/// (a shared atomic per event would be a contended cache line at a million a second).
#[derive(Debug, Default)]
struct Tally {
    phase: usize,
    events: u64,
}

impl Tally {
    /// Counts one event in `phase`, first publishing what was counted in another phase.
    fn count(&mut self, board: &Board, phase: usize) {
        if phase != self.phase {
            self.flush(board);
            self.phase = phase;
        }
        self.events += 1;
        if self.events >= 256 {
            self.flush(board);
        }
    }

    fn flush(&mut self, board: &Board) {
        board.events[self.phase].fetch_add(std::mem::take(&mut self.events), Ordering::Relaxed);
    }
}

async fn presenced_viewers(
    endpoints: &Endpoints,
    sets: Vec<Vec<u64>>,
    per_connection: u64,
    batch_window_ms: u32,
    board: Arc<Board>,
    progress: Progress,
) -> Result<Viewers, String> {
    let (stop, stop_rx) = watch::channel(false);
    let bar = progress.items("viewers", sets.len() as u64);
    let mut tasks = Vec::with_capacity(sets.len());
    let mut channel = None;
    for (i, set) in sets.into_iter().enumerate() {
        if (i as u64).is_multiple_of(per_connection.max(1)) {
            channel = Some(endpoints.grpc_channel().await?);
        }
        let Some(ch) = channel.clone() else { unreachable!("a channel was opened for the first viewer") };
        let client = PresenceClient::new(ch).max_decoding_message_size(64 << 20);
        let request = pb::WatchRequest {
            user_ids: set.into_iter().map(user_id).collect(),
            batch_window_ms,
            ..Default::default()
        };
        let mut watcher = Watcher::open_request(client, request, Backoff::default())
            .await
            .map_err(|s| format!("Watch refused: {s}"))?;
        bar.inc(1);
        let (board, mut stop_rx) = (Arc::clone(&board), stop_rx.clone());
        tasks.push(tokio::spawn(async move {
            let mut recs = phase_recorders();
            let mut tally = Tally::default();
            loop {
                tokio::select! {
                    ev = watcher.next() => match ev {
                        Some(WatcherEvent::Update(u)) => {
                            let phase = board.phase();
                            tally.count(&board, phase);
                            record_lag(&board, &mut recs, phase, &u.user_id, 1);
                        }
                        Some(WatcherEvent::Resynced) => {
                            board.resyncs[board.phase()].fetch_add(1, Ordering::Relaxed);
                        }
                        None => break,
                    },
                    _ = stop_rx.changed() => break,
                }
            }
            tally.flush(&board);
            recs
        }));
    }
    bar.finish_and_clear();
    Ok(Viewers { stop, tasks })
}

/// The seed's subscription gateway: one SUBSCRIBE per watched user, local fan-out.
async fn redis_viewers(
    endpoints: &Endpoints,
    sets: Vec<Vec<u64>>,
    population: u64,
    board: Arc<Board>,
) -> Result<Viewers, String> {
    let mut watchers: Vec<u64> = vec![0; population as usize];
    for set in &sets {
        for &u in set {
            watchers[u as usize] += 1;
        }
    }
    let client = endpoints.redis_client()?;
    let mut pubsub = client.get_async_pubsub().await.map_err(|e| format!("pub/sub connection: {e}"))?;
    let watched: Vec<String> =
        (0..population).filter(|&u| watchers[u as usize] > 0).map(|u| out_channel(&user_id(u))).collect();
    for chunk in watched.chunks(500) {
        pubsub.subscribe(chunk).await.map_err(|e| format!("SUBSCRIBE: {e}"))?;
    }
    let (stop, mut stop_rx) = watch::channel(false);
    let task = tokio::spawn(async move {
        let mut recs = phase_recorders();
        let mut messages = pubsub.into_on_message();
        loop {
            tokio::select! {
                msg = messages.next() => {
                    let Some(msg) = msg else { break };
                    let channel = msg.get_channel_name();
                    let Some(user) = channel.strip_prefix(OUT_PREFIX) else { continue };
                    let fanout = parse_user_id(user).map_or(0, |n| watchers.get(n as usize).copied().unwrap_or(0));
                    if fanout > 0 {
                        deliver(&board, &mut recs, user, fanout);
                    }
                }
                _ = stop_rx.changed() => break,
            }
        }
        recs
    });
    Ok(Viewers { stop, tasks: vec![task] })
}

/// A viewer that never reads: kept open until dropped.
enum Stalled {
    Presenced(#[allow(dead_code)] tonic::Streaming<pb::WatchEvent>),
    Redis(#[allow(dead_code)] tokio::net::TcpStream),
}

async fn open_stalled(endpoints: &Endpoints, users: u64) -> Result<Stalled, String> {
    match endpoints.target {
        TargetKind::Presenced => {
            // Its own connection, as a real stalled client has: its flow-control window fills, not others'.
            let ch = endpoints.grpc_channel().await?;
            let mut client = PresenceClient::new(ch);
            let ids = (0..users.min(10_000)).map(user_id).collect();
            #[allow(clippy::needless_update)] // WatchRequest may gain fields; the defaults are meant.
            let stream = client
                .watch(pb::WatchRequest { user_ids: ids, ..Default::default() })
                .await
                .map_err(|s| format!("stalled Watch refused: {s}"))?
                .into_inner();
            Ok(Stalled::Presenced(stream))
        }
        TargetKind::Redis => {
            let url = endpoints.redis_url.trim_start_matches("redis://");
            let hostport = url.split('/').next().unwrap_or(url);
            let hostport = hostport.rsplit('@').next().unwrap_or(hostport);
            let mut s = tokio::net::TcpStream::connect(hostport)
                .await
                .map_err(|e| format!("stalled subscriber cannot connect to {hostport}: {e}"))?;
            let pattern = format!("{OUT_PREFIX}*");
            let cmd = format!("*2\r\n$10\r\nPSUBSCRIBE\r\n${}\r\n{pattern}\r\n", pattern.len());
            s.write_all(cmd.as_bytes()).await.map_err(|e| format!("stalled PSUBSCRIBE: {e}"))?;
            Ok(Stalled::Redis(s))
        }
    }
}

/// Flip counters.
#[derive(Debug, Default)]
struct ChurnStats {
    sent: [AtomicU64; PHASES],
    changed: [AtomicU64; PHASES],
    errors: [AtomicU64; PHASES],
}

/// What the churners share.
struct Churn {
    shared: Arc<Shared>,
    board: Arc<Board>,
    /// Whether each user of the population holds its lease.
    online: Vec<AtomicBool>,
    /// Flips per second, over all churners.
    rate: f64,
    ttl_ms: u32,
    stats: ChurnStats,
}

impl Churn {
    /// One churner per connection; churner `j` of `n` owns the users `u % n == j`.
    fn start(self: &Arc<Self>, conns: Vec<Conn>, stop: watch::Receiver<bool>) -> Vec<JoinHandle<()>> {
        let tasks = conns.len() as u64;
        conns
            .into_iter()
            .enumerate()
            .map(|(j, conn)| tokio::spawn(Arc::clone(self).churner(conn, j as u64, tasks, stop.clone())))
            .collect()
    }

    async fn churner(self: Arc<Self>, mut conn: Conn, j: u64, tasks: u64, mut stop: watch::Receiver<bool>) {
        let population = self.online.len() as u64;
        let per_task = self.rate / tasks as f64;
        let mut rng = Rng::new((0xc4u64 << 32) | j);
        let slots = population.saturating_sub(j).div_ceil(tasks).max(1);
        let start = Instant::now();
        let mut i = 0u64;
        while !*stop.borrow() {
            if per_task > 0.0 {
                let due = start + Duration::from_secs_f64(i as f64 / per_task);
                tokio::select! {
                    _ = tokio::time::sleep_until(due.into()) => {}
                    _ = stop.changed() => break,
                }
            }
            i += 1;
            let u = j + tasks * rng.below(slots);
            if u >= population {
                continue;
            }
            let phase = self.board.phase();
            self.stats.sent[phase].fetch_add(1, Ordering::Relaxed);
            self.board.flip_ns.set(u, unix_ns());
            let online = &self.online[u as usize];
            let naming = &self.shared.naming;
            let outcome = if online.load(Ordering::Relaxed) {
                let item = GenItem { session: u, generation: self.shared.gens.get(u), ttl_ms: self.ttl_ms };
                match conn.unregister(naming, &[item]).await.pop() {
                    Some(Ok(r)) if r.removed => {
                        online.store(false, Ordering::Relaxed);
                        Some(r.changed)
                    }
                    _ => None,
                }
            } else {
                match conn.register(naming, &[RegItem { session: u, ttl_ms: self.ttl_ms }], false).await.pop() {
                    Some(Ok(r)) => {
                        self.shared.gens.set(u, r.generation);
                        online.store(true, Ordering::Relaxed);
                        Some(r.changed)
                    }
                    _ => None,
                }
            };
            match outcome {
                Some(changed) => self.stats.changed[phase].fetch_add(u64::from(changed), Ordering::Relaxed),
                None => self.stats.errors[phase].fetch_add(1, Ordering::Relaxed),
            };
        }
    }
}

/// A gateway phase's renewals in brief: count, errors, rate and latency percentiles.
pub(crate) fn renew_summary(p: &PhaseResult) -> Value {
    json!({
        "count": p.rec.count(),
        "errors": p.rec.count() - p.rec.ok_count(),
        "rps": p.rate(),
        "p50_ns": p.rec.percentile_ns(50.0),
        "p90_ns": p.rec.percentile_ns(90.0),
        "p99_ns": p.rec.percentile_ns(99.0),
        "p999_ns": p.rec.percentile_ns(99.9),
        "max_ns": p.rec.slowest_ns(),
    })
}

/// Runs the scenario.
pub(crate) async fn run(args: FanoutArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let target = common.target;
    let endpoints = common.endpoints();
    let population = args.population.max(1);
    let gateway = args.gateway_sessions;
    // Users 0..population are watched and flipped; population..population+gateway are the
    // gateway's renewed sessions, watched by no one. One session per user, session k = user k.
    let pop = Population { users: population + gateway, sessions: population + gateway };
    let shared = Arc::new(Shared {
        naming: Naming::new(pop, common.gateway_id.clone()),
        gens: Generations::new(pop.sessions),
        deadlines: None,
    });
    let watch = args.watch.min(population);
    let expected_per_flip = args.viewers as f64 * watch as f64 / population as f64;
    println!(
        "fanout: {} viewers x {watch} users out of {population}, {} flips/s (~{expected_per_flip:.1} viewers per \
         flip), gateway renewing {gateway} sessions at {}/s, on {} ({})",
        args.viewers,
        args.churn_rate,
        args.gateway_rate,
        endpoints.host(),
        format!("{target:?}").to_lowercase()
    );

    // Everyone ONLINE first.
    let spec = args.drive.conn_spec(common);
    let (setup, gateway_conns) = register_everyone(&spec, &shared, args.ttl_ms, 0..pop.sessions, progress).await?;
    if setup.rec.ok_count() < pop.sessions {
        return Err(format!("only {} of {} registers succeeded: {:?}", setup.rec.ok_count(), pop.sessions, {
            setup.rec.errors()
        }));
    }

    if setup.flips < pop.sessions {
        println!(
            "warning: {} users were already ONLINE before this run (an earlier run on this server): flips and \
             events will not match the model. Use a fresh server.",
            pop.sessions - setup.flips
        );
    }
    let board = Arc::new(Board {
        phase: AtomicUsize::new(0),
        events: Default::default(),
        resyncs: Default::default(),
        flip_ns: Slots::new(population),
    });
    let sets: Vec<Vec<u64>> = (0..args.viewers).map(|v| sample_distinct(&mut Rng::new(v), population, watch)).collect();
    let viewers = match target {
        TargetKind::Presenced => {
            let window = args.batch_window_ms;
            presenced_viewers(&endpoints, sets, args.viewers_per_connection, window, Arc::clone(&board), progress)
                .await?
        }
        TargetKind::Redis => redis_viewers(&endpoints, sets, population, Arc::clone(&board)).await?,
    };

    let churn_spec = ConnSpec {
        endpoints: endpoints.clone(),
        mode: args.churn_mode,
        concurrency: args.churn_concurrency.max(1),
        connections: 1,
        batch: args.churn_concurrency.max(1),
        max_delay: Duration::from_millis(1),
    };
    let churn_conns = open_conns(&churn_spec).await?;
    let churn = Arc::new(Churn {
        shared: Arc::clone(&shared),
        board: Arc::clone(&board),
        online: (0..population).map(|_| AtomicBool::new(true)).collect(),
        rate: args.churn_rate,
        ttl_ms: args.ttl_ms,
        stats: ChurnStats::default(),
    });
    let churn_stats = &churn.stats;
    let renew_spec = |title: &str, duration: Duration| PhaseSpec {
        title: title.into(),
        work: Work::Renew { ttl_ms: args.ttl_ms },
        items_per_call: args.drive.mode.items_per_call(args.drive.batch),
        bound: Bound::For { first: population, sessions: gateway.max(1), duration },
        rate: args.gateway_rate,
    };
    // The gateway alone first, the viewers open and nothing flipping: its quiet figure.
    let (quiet, gateway_conns) = if args.quiet_phase.is_zero() {
        (None, gateway_conns)
    } else {
        let (quiet, conns) =
            run_phase(gateway_conns, Arc::clone(&shared), renew_spec("quiet", args.quiet_phase), progress).await;
        (Some(quiet), conns)
    };

    let (stop_churn, stop_rx) = watch::channel(false);
    board.phase.store(1, Ordering::Relaxed);
    let server_cpu_before = args.server_pid.map(crate::server_cpu::cpu_ns).transpose()?;
    let own_cpu_before = crate::server_cpu::cpu_ns(std::process::id())?;
    let events_before = board.events[1].load(Ordering::Relaxed);
    let churners = churn.start(churn_conns, stop_rx);
    let (phase_a, gateway_conns) =
        run_phase(gateway_conns, Arc::clone(&shared), renew_spec("plain", args.duration), progress).await;
    let plain_events = board.events[1].load(Ordering::Relaxed) - events_before;
    // Everything the server did over the plain phase (delivery, the churn's
    // leases, the gateway's renewals, its own housekeeping) per event delivered.
    let server_us_per_event = match (args.server_pid, server_cpu_before) {
        (Some(pid), Some(before)) => {
            Some(crate::server_cpu::us_per_op(before, crate::server_cpu::cpu_ns(pid)?, plain_events))
        }
        _ => None,
    };
    let own_cpu_ns = crate::server_cpu::cpu_ns(std::process::id())?.saturating_sub(own_cpu_before);
    let generator_share =
        own_cpu_ns as f64 / (phase_a.elapsed.as_nanos() as f64 * crate::report::cpus() as f64).max(1.0);

    let mut stalled = None;
    let mut phase_b = None;
    if args.stalled_viewer {
        stalled = Some(open_stalled(&endpoints, args.stalled_watch).await?);
        board.phase.store(2, Ordering::Relaxed);
        let (b, _conns) =
            run_phase(gateway_conns, Arc::clone(&shared), renew_spec("stalled", args.duration), progress).await;
        phase_b = Some(b);
    }
    board.phase.store(3, Ordering::Relaxed);
    let _ = stop_churn.send(true);
    for c in churners {
        let _ = c.await;
    }
    let recs = viewers.stop().await;
    drop(stalled);

    let phase_summary = |i: usize, renew: &PhaseResult| {
        let events = board.events[i].load(Ordering::Relaxed);
        let secs = renew.elapsed.as_secs_f64().max(1e-9);
        json!({
            "events": events,
            "events_per_s": events as f64 / secs,
            "flips_sent": churn_stats.sent[i].load(Ordering::Relaxed),
            "flips_changed": churn_stats.changed[i].load(Ordering::Relaxed),
            "flips_per_s": churn_stats.changed[i].load(Ordering::Relaxed) as f64 / secs,
            "flip_errors": churn_stats.errors[i].load(Ordering::Relaxed),
            "resyncs": board.resyncs[i].load(Ordering::Relaxed),
            "delivery_p50_ns": recs[i].percentile_ns(50.0),
            "delivery_p99_ns": recs[i].percentile_ns(99.0),
            "gateway_renew": renew_summary(renew),
        })
    };
    let mut delivered = recs[1].clone();
    delivered.merge(&recs[2]);
    let total = phase_a.elapsed + phase_b.as_ref().map_or(Duration::ZERO, |b| b.elapsed);
    let mut report = Report::from_recorder("fanout", &delivered, total, "timeout");
    // Events delivered before the first flip's time was known have no latency: count them anyway.
    report.count = board.events[1].load(Ordering::Relaxed) + board.events[2].load(Ordering::Relaxed);
    report.rps = report.count as f64 / total.as_secs_f64().max(1e-9);
    report.status_code_distribution.insert("OK".into(), report.count);
    report.options.host = endpoints.host();
    report.options.call = match target {
        TargetKind::Presenced => "presence.v1.Presence.Watch (updates, all viewers)".into(),
        TargetKind::Redis => "SUBSCRIBE presence:out:<user> (local fan-out)".into(),
    };
    report.options.duration = args.duration.as_nanos() as u64;
    report.tag("target", format!("{target:?}").to_lowercase());
    report.tag("viewers", args.viewers);
    report.tag("watch", watch);
    report.set("target", format!("{target:?}").to_lowercase());
    report.set("viewers", args.viewers);
    report.set("watch", watch);
    report.set("population", population);
    report.set("churn_rate", args.churn_rate);
    report.set("churn_mode", args.churn_mode.label(target));
    report.set("churn_concurrency", args.churn_concurrency);
    report.set("batch_window_ms", args.batch_window_ms);
    report.set("expected_viewers_per_flip", expected_per_flip);
    report.set("gateway_sessions", gateway);
    report.set("gateway_rate", args.gateway_rate);
    report.set("gateway_mode", args.drive.mode.label(target));
    report.set("phase_plain", phase_summary(1, &phase_a));
    report.set("phase_plain_gateway_renew", phase_report("gateway-renew", &phase_a, "timeout"));
    report.set("server_cpu_us_per_event", server_us_per_event);
    report.set("generator_cpu_share", generator_share);
    if let Some(quiet) = &quiet {
        report.set("phase_quiet_gateway_renew", renew_summary(quiet));
        let ratio = phase_a.rec.percentile_ns(99.0) as f64 / quiet.rec.percentile_ns(99.0).max(1) as f64;
        report.set("plain_over_quiet_gateway_p99", ratio);
        println!(
            "\nquiet phase: gateway renew p50 {} p99 {} ({:.0}/s); during the plain phase its p99 is x{ratio:.2} of that",
            fmt_ns(quiet.rec.percentile_ns(50.0)),
            fmt_ns(quiet.rec.percentile_ns(99.0)),
            quiet.rate(),
        );
    }
    if let Some(us) = server_us_per_event {
        println!(
            "server CPU per event delivered in the plain phase: {us:.3} us (everything the server did, over \
             {plain_events} events); the generator used {:.0}% of the machine",
            generator_share * 100.0
        );
    }
    let a_events = board.events[1].load(Ordering::Relaxed) as f64 / phase_a.elapsed.as_secs_f64().max(1e-9);
    println!(
        "\nplain phase: {a_events:.0} events/s to viewers ({} flips/s that changed a user), delivery p50 {} p99 {}; \
         gateway renew p50 {} p99 {} ({:.0}/s, {} errors)",
        (churn_stats.changed[1].load(Ordering::Relaxed) as f64 / phase_a.elapsed.as_secs_f64().max(1e-9)).round(),
        fmt_ns(recs[1].percentile_ns(50.0)),
        fmt_ns(recs[1].percentile_ns(99.0)),
        fmt_ns(phase_a.rec.percentile_ns(50.0)),
        fmt_ns(phase_a.rec.percentile_ns(99.0)),
        phase_a.rate(),
        phase_a.rec.count() - phase_a.rec.ok_count()
    );
    if let Some(b) = &phase_b {
        report.set("phase_stalled", phase_summary(2, b));
        report.set("phase_stalled_gateway_renew", phase_report("gateway-renew", b, "timeout"));
        let p99_a = phase_a.rec.percentile_ns(99.0).max(1);
        let ratio = b.rec.percentile_ns(99.0) as f64 / p99_a as f64;
        report.set("stalled_over_plain_gateway_p99", ratio);
        let b_events = board.events[2].load(Ordering::Relaxed) as f64 / b.elapsed.as_secs_f64().max(1e-9);
        println!(
            "stalled phase: {b_events:.0} events/s to the other viewers, delivery p50 {} p99 {}; gateway renew p50 {} \
             p99 {} (x{ratio:.2} of the plain phase)",
            fmt_ns(recs[2].percentile_ns(50.0)),
            fmt_ns(recs[2].percentile_ns(99.0)),
            fmt_ns(b.rec.percentile_ns(50.0)),
            fmt_ns(b.rec.percentile_ns(99.0)),
        );
    }
    println!(
        "resync snapshots: {} plain, {} stalled",
        board.resyncs[1].load(Ordering::Relaxed),
        board.resyncs[2].load(Ordering::Relaxed)
    );
    print!("{}", report.summary("Changes delivered (latency = flip sent -> viewer received):"));
    println!("  (the generator and the server share this machine's {} cores)", crate::report::cpus());
    Ok(report)
}
