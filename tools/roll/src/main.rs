//! `presence-roll`: a rolling upgrade of a presenced cluster, proven (D1).
//!
//! Starts etcd and `--nodes` nodes (TLS on every connection unless
//! `--no-tls`), registers `--sessions` sessions through the Rust client's
//! `ClusterLeases`, and runs, until the end, gateways renewing every session
//! each heartbeat (a refused renewal sent again after the client's backoff,
//! as `Session` does), a churn of registers, joins and unregisters, and viewers
//! watching through whichever node answers. Then it restarts every node in
//! turn the way an orchestrator does: SIGTERM (the node drains: its slots and
//! followers handed over), wait for the exit, start `--next-binary` (or the
//! same binary) on the same ports and data directory, wait until `/readyz`
//! says ready, next. With `--nodes 1` it replaces a single node on its data
//! directory (no etcd; the restart grace carries the sessions).
//!
//! It checks and reports: OFFLINE events at the viewers (every user's
//! gateway kept renewing, so the target is 0), sessions lost (renewals
//! answered `NOT_FOUND`), acknowledged registers, unregisters and joins not
//! found at the end, versions going back at a viewer, viewer streams that
//! reloaded instead of resuming with `known_versions`, and the renewal p99
//! before, during and after the roll, and the time per node. A lost
//! session's example says when it was last renewed, when last refused and
//! in how many heartbeats in a row. It exits 1 if any target is missed.

mod moves;
mod nodes;
mod traffic;

use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::Parser;
use presence_client::ClientTlsConfig;

use crate::nodes::{Layout, Node, Probe};
use crate::traffic::{Phases, Reach};

#[derive(Debug, Parser)]
#[command(name = "presence-roll", about = "A rolling upgrade of a presenced cluster under load, measured and checked.")]
struct Args {
    /// The `presenced` the nodes start with.
    #[arg(long, default_value = "target/release/presenced")]
    binary: PathBuf,
    /// The `presenced` each node is started again with (an upgrade); the
    /// same as --binary if not given.
    #[arg(long)]
    next_binary: Option<PathBuf>,
    /// Nodes; 1 replaces a single node on its data directory (no etcd).
    #[arg(long, default_value_t = 3)]
    nodes: usize,
    /// Sessions, one per user, renewed every heartbeat.
    #[arg(long, default_value_t = 3_000)]
    sessions: usize,
    /// The sessions' TTL.
    #[arg(long, default_value_t = 6_000)]
    ttl_ms: u32,
    /// How often each session is renewed.
    #[arg(long, default_value_t = 2_000)]
    heartbeat_ms: u64,
    /// Viewers, each watching `--watched` of the users.
    #[arg(long, default_value_t = 4)]
    viewers: usize,
    /// Users each viewer watches.
    #[arg(long, default_value_t = 500)]
    watched: usize,
    /// New sessions registered (and joined to a room) per churn round, every 500 ms.
    #[arg(long, default_value_t = 10)]
    churn: usize,
    /// The cluster's slots.
    #[arg(long, default_value_t = 256)]
    slots: u32,
    /// The nodes' etcd lease TTL.
    #[arg(long, default_value_t = 2_000)]
    lease_ttl_ms: u64,
    /// Traffic before the roll and after it, for the latency beside it.
    #[arg(long, default_value_t = 5)]
    settle_secs: u64,
    /// A renewal refused is not sent again, neither by the generator nor
    /// by its client (`ClusterLeases` waits out no move): the session waits
    /// for its next heartbeat, as a hand-written gateway does. Every refusal
    /// the generator sees then misses a target (C7: moves refuse nothing).
    #[arg(long)]
    no_renewal_retry: bool,
    /// Plaintext everywhere instead of TLS on every connection.
    #[arg(long)]
    no_tls: bool,
    /// Prints each renewal batch that took at least this many milliseconds,
    /// with when it was sent (UTC, as the nodes' logs): what to look at in
    /// the nodes' logs when the p99 misses. 0: none.
    #[arg(long, default_value_t = 0)]
    print_batches_slower_than_ms: u64,
    /// Where data directories, certificates and the nodes' logs go.
    #[arg(long, default_value = "target/roll")]
    dir: PathBuf,
    /// Writes the report as JSON here too.
    #[arg(long)]
    json: Option<PathBuf>,
    /// A `serve` flag for every node (repeat it), e.g. `--node-flag=--shards=8`.
    #[arg(long = "node-flag", allow_hyphen_values = true)]
    node_flags: Vec<String>,
}

/// One node's turn in the roll.
#[derive(Debug, serde::Serialize)]
struct Turn {
    node: String,
    /// From SIGTERM to its exit (the drain).
    stop_ms: u64,
    /// From the start to `/readyz` answering 200.
    start_to_ready_ms: u64,
}

#[derive(Debug, serde::Serialize)]
struct Report {
    nodes: usize,
    sessions: usize,
    tls: bool,
    binary: String,
    next_binary: String,
    turns: Vec<Turn>,
    roll_ms: u64,
    false_offline: usize,
    offline_examples: Vec<String>,
    sessions_lost: u64,
    lost_examples: Vec<String>,
    renewals: u64,
    /// Renewal attempts refused (a slot moving, a node restarting), retries included.
    renewals_refused: u64,
    /// Sessions renewed by a retry after their round's renewal was refused,
    /// and from the round's send to that OK: p50, p99, max (ms).
    renewed_on_retry: u64,
    retried_until_renewed_ms: [f64; 3],
    /// Whether refused renewals were never sent again (`--no-renewal-retry`).
    no_renewal_retry: bool,
    /// Requests the nodes held through a freeze (C7), and their wait: p50, p99 (ms, bucket bounds).
    requests_held: u64,
    held_wait_ms: [f64; 2],
    /// Freezes of moves, and how long: p50, p99, max (ms, bucket bounds).
    freezes: u64,
    freeze_ms: [f64; 3],
    /// Freezes given up past their bound.
    freezes_aborted: u64,
    renewal_p99_ms: [f64; 3],
    renewal_p50_ms: [f64; 3],
    registers: u64,
    joins: u64,
    unregisters: u64,
    not_acknowledged: u64,
    lost: traffic::Lost,
    versions_back: usize,
    versions_back_examples: Vec<String>,
    viewer_opens: u64,
    viewer_resumed: u64,
    viewer_reloaded: u64,
    /// CPU seconds this process (gateways, churn, viewers) used, and the
    /// wall time of the run: its share of the machine beside the nodes.
    generator_cpu_s: f64,
    run_s: f64,
}

impl Report {
    /// What missed its target, one line each.
    fn missed(&self) -> Vec<String> {
        let mut missed = Vec::new();
        let mut check = |count: usize, what: &str| {
            if count > 0 {
                missed.push(format!("{count} {what}"));
            }
        };
        check(self.false_offline, "OFFLINE events at viewers");
        check(self.sessions_lost as usize, "sessions lost (renewals answered NOT_FOUND)");
        check(self.lost.registers.len(), "acknowledged registers not found");
        check(self.lost.unregisters.len(), "acknowledged unregisters not found");
        check(self.lost.joins.len(), "acknowledged joins not found");
        check(self.versions_back, "versions going back at a viewer");
        check(self.viewer_reloaded as usize, "viewer streams reloaded instead of resumed");
        check(self.not_acknowledged as usize, "operations never acknowledged");
        if self.no_renewal_retry {
            check(self.renewals_refused as usize, "renewal attempts refused to a generator that never retries");
        }
        missed
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build().expect("a runtime");
    match runtime.block_on(run(args)) {
        Ok(report) => {
            let missed = report.missed();
            if missed.is_empty() {
                println!("roll: every target met");
                ExitCode::SUCCESS
            } else {
                println!("roll: targets missed: {}", missed.join("; "));
                ExitCode::FAILURE
            }
        }
        Err(err) => {
            eprintln!("presence-roll: {err}");
            ExitCode::from(2)
        }
    }
}

/// CPU seconds (user and system) this process used so far, from `/proc/self/stat`.
fn own_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // The fields after the command's closing parenthesis; utime and stime are the 12th and 13th.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let ticks: f64 = fields.get(11..13).map_or(0.0, |both| both.iter().filter_map(|f| f.parse::<f64>().ok()).sum());
    // Linux counts them in USER_HZ, 100 a second.
    ticks / 100.0
}

async fn run(args: Args) -> Result<Report, String> {
    let began = Instant::now();
    let next_binary = args.next_binary.clone().unwrap_or_else(|| args.binary.clone());
    for binary in [&args.binary, &next_binary] {
        if !binary.is_file() {
            return Err(format!("no presenced at {} (build it, or say where with --binary)", binary.display()));
        }
    }
    let _ = std::fs::remove_dir_all(&args.dir);
    let clustered = args.nodes > 1;
    let layout =
        Layout::new(args.dir.clone(), !args.no_tls, clustered, args.slots, args.lease_ttl_ms, args.node_flags.clone())
            .await;
    let ids: Vec<String> = (0..args.nodes).map(|i| format!("node-{}", (b'a' + i as u8) as char)).collect();
    let mut nodes: Vec<Node> = ids.iter().map(|id| Node::new(&layout, id)).collect();
    let service_ca = layout.certificates.as_ref().map(|certificates| certificates.service_ca());
    let probe = Probe::new(service_ca.as_deref());
    eprintln!("starting {} nodes in {}", nodes.len(), args.dir.display());
    for node in &mut nodes {
        node.start(&args.binary).await?;
    }
    for node in &nodes {
        node.until_ready(&probe).await?;
    }
    let tls = service_ca.map(|ca| ClientTlsConfig::from_files(Some(ca), None, None).expect("the service CA"));
    let reach = Reach { urls: nodes.iter().map(|node| node.url(&layout)).collect(), tls, slots: args.slots };

    // The sessions, then the traffic that runs through the roll.
    let users: Vec<String> = (0..args.sessions).map(|i| format!("user-{i}")).collect();
    let leases = match args.no_renewal_retry {
        true => reach.leases(&reach.urls[0]).with_move_wait(Duration::ZERO),
        false => reach.leases(&reach.urls[0]),
    };
    let generations = traffic::register_all(&leases, &users, args.ttl_ms).await?;
    let sessions = Arc::new(users.iter().cloned().zip(generations).collect::<Vec<_>>());
    eprintln!("{} sessions registered; traffic starts", sessions.len());
    let phases = Arc::new(Mutex::new(Phases::default()));
    let heartbeat = Duration::from_millis(args.heartbeat_ms);
    let renewing = traffic::keep_renewing(
        leases.clone(),
        sessions,
        args.ttl_ms,
        heartbeat,
        Arc::clone(&phases),
        !args.no_renewal_retry,
        Duration::from_millis(args.print_batches_slower_than_ms),
    );
    let churning =
        traffic::churn(reach.leases(&reach.urls[reach.urls.len() - 1]), args.churn, Duration::from_millis(500), 6);
    let watching: Vec<_> = (0..args.viewers)
        .map(|viewer| {
            let watched: Vec<String> = users.iter().skip(viewer * args.watched).take(args.watched).cloned().collect();
            traffic::watch(reach.clone(), viewer + 1, watched)
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;

    // The roll.
    let roll_started = Instant::now();
    phases.lock().expect("phases").roll_started = Some(roll_started);
    let mut turns = Vec::new();
    for node in &mut nodes {
        eprintln!("{}: SIGTERM at {} UTC", node.id, traffic::wall_clock(Instant::now()));
        let stopping = Instant::now();
        node.stop(&probe).await?;
        let stop_ms = stopping.elapsed().as_millis() as u64;
        let starting = Instant::now();
        eprintln!("{}: exited, starting at {} UTC", node.id, traffic::wall_clock(starting));
        node.start(&next_binary).await?;
        node.until_ready(&probe).await?;
        let start_to_ready_ms = starting.elapsed().as_millis() as u64;
        eprintln!("{}: stopped in {stop_ms} ms, ready {start_to_ready_ms} ms after its start", node.id);
        turns.push(Turn { node: node.id.clone(), stop_ms, start_to_ready_ms });
    }
    let roll_ms = roll_started.elapsed().as_millis() as u64;
    phases.lock().expect("phases").roll_ended = Some(Instant::now());
    eprintln!("roll done in {roll_ms} ms; traffic goes on for {} s", args.settle_secs);
    tokio::time::sleep(Duration::from_secs(args.settle_secs)).await;

    let _ = renewing.0.send(());
    let renewals = renewing.1.await.map_err(|err| err.to_string())?;
    let _ = churning.0.send(());
    let churn = churning.1.await.map_err(|err| err.to_string())?;
    let mut seen = Vec::new();
    for (stop, task) in watching {
        let _ = stop.send(());
        seen.push(task.await.map_err(|err| err.to_string())?);
    }
    let lost = traffic::lost_operations(&reach, &reach.urls[0], &churn).await?;
    for node in &mut nodes {
        node.stop(&probe).await?;
    }
    let mut moves = moves::MoveMetrics::default();
    nodes.iter().for_each(|node| moves.add(&node.moves()));
    let (freezes, freeze_ms) = moves.freezes();

    let millis = |histogram: &hdrhistogram::Histogram<u64>, q: f64| {
        if histogram.is_empty() { 0.0 } else { histogram.value_at_quantile(q) as f64 / 1_000.0 }
    };
    let phases = [&renewals.before, &renewals.during, &renewals.after];
    let offline: Vec<String> = seen.iter().flat_map(|seen| seen.offline.iter().cloned()).collect();
    let back: Vec<String> = seen.iter().flat_map(|seen| seen.versions_back.iter().cloned()).collect();
    let report = Report {
        nodes: args.nodes,
        sessions: args.sessions,
        tls: !args.no_tls,
        binary: args.binary.display().to_string(),
        next_binary: next_binary.display().to_string(),
        turns,
        roll_ms,
        false_offline: offline.len(),
        offline_examples: offline.into_iter().take(5).collect(),
        sessions_lost: renewals.lost,
        lost_examples: renewals.lost_examples.clone(),
        renewals: renewals.renewed,
        renewals_refused: renewals.refused,
        renewed_on_retry: renewals.renewed_on_retry,
        retried_until_renewed_ms: [
            millis(&renewals.retried_until_renewed, 0.5),
            millis(&renewals.retried_until_renewed, 0.99),
            renewals.retried_until_renewed.max() as f64 / 1_000.0,
        ],
        no_renewal_retry: args.no_renewal_retry,
        requests_held: moves.requests_held,
        held_wait_ms: moves.hold_ms(),
        freezes,
        freeze_ms,
        freezes_aborted: moves.freezes_aborted,
        renewal_p99_ms: phases.map(|histogram| millis(histogram, 0.99)),
        renewal_p50_ms: phases.map(|histogram| millis(histogram, 0.5)),
        registers: churn.registers,
        joins: churn.joins,
        unregisters: churn.unregisters,
        not_acknowledged: churn.not_acknowledged,
        lost,
        versions_back: back.len(),
        versions_back_examples: back.into_iter().take(5).collect(),
        viewer_opens: seen.iter().map(|seen| seen.opens).sum(),
        viewer_resumed: seen.iter().map(|seen| seen.resumed).sum(),
        viewer_reloaded: seen.iter().map(|seen| seen.reloaded).sum(),
        generator_cpu_s: own_cpu_seconds(),
        run_s: began.elapsed().as_secs_f64(),
    };
    print_report(&report);
    if let Some(path) = &args.json {
        let json = serde_json::to_string_pretty(&report).expect("a report as JSON");
        std::fs::write(path, json).map_err(|err| format!("write {}: {err}", path.display()))?;
    }
    Ok(report)
}

fn print_report(report: &Report) {
    println!(
        "roll of {} node(s), {} sessions, TLS {}: {} → {}",
        report.nodes,
        report.sessions,
        if report.tls { "on" } else { "off" },
        report.binary,
        report.next_binary
    );
    for turn in &report.turns {
        println!(
            "  {}: drained and exited in {} ms, ready {} ms after its start",
            turn.node, turn.stop_ms, turn.start_to_ready_ms
        );
    }
    println!("  whole roll: {} ms", report.roll_ms);
    println!("  false OFFLINE at viewers: {} {:?}", report.false_offline, report.offline_examples);
    println!("  sessions lost: {} {:?}", report.sessions_lost, report.lost_examples);
    let [retry50, retry99, retry_max] = report.retried_until_renewed_ms;
    println!(
        "  renewals: {} answered OK; {} attempts refused while a slot moved or a node restarted; {} sessions renewed on a retry, {retry50:.0}/{retry99:.0}/{retry_max:.0} ms (p50/p99/max) after their round's send",
        report.renewals, report.renewals_refused, report.renewed_on_retry
    );
    let [held50, held99] = report.held_wait_ms;
    let [freeze50, freeze99, freeze_max] = report.freeze_ms;
    println!(
        "  moves: {} freezes, {freeze50:.0}/{freeze99:.0}/{freeze_max:.0} ms (p50/p99/max, bucket bounds); {} given up; {} requests held through a freeze, waiting {held50:.0}/{held99:.0} ms (p50/p99)",
        report.freezes, report.freezes_aborted, report.requests_held
    );
    let [before, during, after] = report.renewal_p99_ms;
    let [before50, during50, after50] = report.renewal_p50_ms;
    println!(
        "  renewal batch latency p50/p99 ms: before {before50:.1}/{before:.1}, during {during50:.1}/{during:.1}, after {after50:.1}/{after:.1}"
    );
    println!(
        "  churn: {} registers, {} joins, {} unregisters acknowledged; lost: {} registers, {} unregisters, {} joins; never acknowledged: {}",
        report.registers,
        report.joins,
        report.unregisters,
        report.lost.registers.len(),
        report.lost.unregisters.len(),
        report.lost.joins.len(),
        report.not_acknowledged
    );
    println!("  versions going back at viewers: {} {:?}", report.versions_back, report.versions_back_examples);
    println!(
        "  viewer streams: {} opened, {} reopens resumed with known_versions, {} reloaded",
        report.viewer_opens, report.viewer_resumed, report.viewer_reloaded
    );
    println!(
        "  this generator: {:.1} CPU s over {:.1} s of run ({:.0}% of one core)",
        report.generator_cpu_s,
        report.run_s,
        100.0 * report.generator_cpu_s / report.run_s.max(0.001)
    );
}
