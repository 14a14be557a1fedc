//! The runner: starts the server, runs the recording clients, injects the
//! fault on schedule, settles, checks, and reports.
//!
//! The schedule, with `D` the duration:
//!
//! | phase mark | what happens |
//! |---|---|
//! | (start) | viewers open their watches, then gateways churn: register, hold, unregister, away |
//! | `quiet` at 0.4·D | churn stops (held sessions keep renewing); every call under way is answered; a barrier |
//! | `inject`, `heal` | the fault, for as long as it lasts |
//! | `churn` | after the fault's recovery (quiet, renewals only): churn again until D |
//! | `final-quiet` | churn stops; a barrier; the settle (a TTL and the delivery bound) |
//! | `check` | a barrier; a fresh `Snapshot`; each viewer's view; the sessions held |
//!
//! A barrier flips the sentinel user and waits until every viewer has
//! received that version, so that every change published before it has
//! reached every viewer (a mailbox sends users in the order they first
//! changed, E4).

use std::net::IpAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use presence_client::pb;
use presence_proto::v1::presence_client::PresenceClient;
use tokio::sync::watch;
use tokio::time::{Instant, sleep};
use tonic::transport::Channel;

use crate::checker::{self, Analysis, CheckConfig, Expectation, Figures};
use crate::clients::{self, Control, SENTINEL, Target, ViewerProgress, Workload};
use crate::faults::{Client, Fault, FaultCx, Plan};
use crate::history::{Presence, Record, Recorder, write_json_lines};
use crate::server::{Launch, Server};

/// Everything a run needs besides the fault.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// The shape of the run.
    pub plan: Plan,
    /// The `presenced` binary.
    pub presenced: PathBuf,
    /// Words before the binary (`ip netns exec NS`).
    pub prefix: Vec<String>,
    /// The server's listen address; port 0 picks a free one (kept across restarts).
    pub listen: String,
    /// The address clients connect to, when not the listen address (a proxy, a namespace's address).
    pub connect: Option<String>,
    /// The local address clients bind to.
    pub bind: Option<IpAddr>,
    /// The data directory; a scratch one is made when the fault needs one and none is given.
    pub data_dir: Option<PathBuf>,
    /// Further server flags.
    pub server_args: Vec<String>,
    /// Where to write the whole history: always when given, else to a scratch file when a rule broke.
    pub history: Option<PathBuf>,
}

/// What a run found.
#[derive(Debug)]
pub struct RunReport {
    /// The fault.
    pub fault: String,
    /// The expected outcome, as printed before the run.
    pub expected: Vec<String>,
    /// The figures.
    pub figures: Figures,
    /// Every expectation, generic and the fault's.
    pub expectations: Vec<Expectation>,
    /// Where the history was written, if it was.
    pub history_file: Option<PathBuf>,
    /// The records (for tests that doctor them).
    pub records: Vec<Record>,
}

impl RunReport {
    /// Whether every expectation held.
    pub fn passed(&self) -> bool {
        self.expectations.iter().all(Expectation::held)
    }

    /// The report after the run: figures, then HELD or VIOLATED per expectation with excerpts.
    pub fn render(&self) -> String {
        let f = &self.figures;
        let violations: usize = self.expectations.iter().map(|e| e.violations.len()).sum();
        let mut out = String::new();
        out.push_str(&format!(
            "figures: {} calls ({} failed, {} NOT_FOUND), {} events ({} updates), {} viewer streams, {} flips, {} violations\n",
            f.calls, f.calls_failed, f.not_found, f.events, f.updates, f.streams, f.flips, violations
        ));
        out.push_str(&format!(
            "  slowest acknowledged-unregister-to-viewer OFFLINE: {:.1} ms\n",
            f.max_offline_delivery_ms
        ));
        out.push_str("  changes first seen per phase (ONLINE / OFFLINE):");
        for (name, on, off) in &f.per_phase {
            out.push_str(&format!(" {name} {on}/{off};"));
        }
        out.push('\n');
        for e in &self.expectations {
            let verdict = if e.held() { "HELD" } else { "VIOLATED" };
            out.push_str(&format!(
                "{verdict:8} {} ({} checked, {} violations): {}\n",
                e.name,
                e.checked,
                e.violations.len(),
                e.statement
            ));
            for v in e.violations.iter().take(3) {
                out.push_str(&format!("    user {}: {}\n", v.user, v.what));
                for record in &v.excerpt {
                    out.push_str(&format!("      {}\n", serde_json::to_string(record).unwrap_or_default()));
                }
            }
        }
        if let Some(path) = &self.history_file {
            out.push_str(&format!("history: {}\n", path.display()));
        }
        out.push_str(if self.passed() { "result: every expectation HELD\n" } else { "result: VIOLATED\n" });
        out
    }
}

/// The check config a plan implies.
pub fn check_config(plan: &Plan) -> CheckConfig {
    CheckConfig {
        ttl_ms: u64::from(plan.ttl_ms),
        heartbeat_ms: u64::from(plan.heartbeat_ms),
        delivery_bound_ms: u64::from(plan.delivery_bound_ms),
    }
}

/// The expected outcome of `fault` under `plan`, one line each, as printed before the run.
pub fn expected_outcome(fault: &dyn Fault, plan: &Plan) -> Vec<String> {
    let mut lines = fault.expected_outcome(plan);
    lines.extend(checker::statements().into_iter().map(|(name, statement)| format!("{name}: {statement}")));
    lines
}

/// Checks a recorded history against the generic rules and the fault's.
pub fn check_history(records: &[Record], fault: &dyn Fault, plan: &Plan) -> (Figures, Vec<Expectation>) {
    let analysis = Analysis::new(records, check_config(plan));
    let mut expectations = checker::check(&analysis, fault);
    expectations.extend(fault.check(&analysis));
    (checker::figures(&analysis), expectations)
}

/// The flags every run gives the server: the TTL as default, the restart
/// grace, no renewal throttle (the gateways renew at a third of the TTL).
fn server_args(plan: &Plan) -> Vec<String> {
    [
        ("--default-ttl-ms", plan.ttl_ms),
        ("--min-ttl-ms", plan.ttl_ms.min(1_000)),
        ("--restart-grace-ms", plan.restart_grace_ms),
        ("--min-renew-interval-ms", 0),
    ]
    .iter()
    .flat_map(|(flag, value)| [flag.to_string(), value.to_string()])
    .collect()
}

/// Runs `fault` under `options`: prints the expected outcome with `say`
/// first, then runs, checks and returns the report.
pub async fn run(
    mut fault: Box<dyn Fault>,
    options: RunOptions,
    say: &mut (dyn FnMut(&str) + Send),
) -> Result<RunReport, String> {
    let plan = options.plan.clone();
    let expected = expected_outcome(fault.as_ref(), &plan);
    say(&format!("fault: {}", fault.name()));
    say("expected outcome (written down before the run):");
    for line in &expected {
        say(&format!("  - {line}"));
    }

    let listen = fixed_port(&options.listen)?;
    let mut launch = Launch::new(options.presenced.clone(), listen.clone());
    launch.prefix = options.prefix.clone();
    launch.args = server_args(&plan);
    launch.args.extend(options.server_args.iter().cloned());
    let scratch = crate::faults::scratch_dir(fault.name());
    if fault.needs_data_dir() {
        if options.data_dir.is_none() {
            // A scratch directory of this process: nothing of an earlier run in it.
            let _ = std::fs::remove_dir_all(&scratch);
        }
        launch.data_dir = Some(options.data_dir.clone().unwrap_or_else(|| scratch.clone()));
    }
    fault.configure(&mut launch, &plan)?;
    let mut server = tokio::task::block_in_place(|| Server::start(launch))?;
    let url = match &options.connect {
        Some(addr) => format!("http://{addr}"),
        None => server.url(),
    };
    let target = Target { url, bind: options.bind };
    let route = |client: Client| fault.route(client, &target);
    say(&format!("server: {} (pid {:?})", server.launch().command_line().join(" "), server.pid()));

    let recorder = Recorder::new();
    let workload = Workload {
        users: plan.users,
        gateways: plan.gateways,
        viewers: plan.viewers,
        ttl_ms: plan.ttl_ms,
        heartbeat: Duration::from_millis(u64::from(plan.heartbeat_ms)),
        hold: Duration::from_millis(u64::from(plan.ttl_ms) * 3),
        away: Duration::from_millis(u64::from(plan.ttl_ms)),
        call_timeout: Duration::from_millis(u64::from(plan.ttl_ms).max(1_000)),
    };
    let control = Arc::new(Control::default());
    // Viewers stop first, at the check, while the gateways still renew: what
    // they hold then is what must equal the fresh snapshot.
    let (stop_viewers, viewers_stop) = watch::channel(false);
    let (stop_gateways, gateways_stop) = watch::channel(false);
    let mut admin = PresenceClient::new(route(Client::Admin).channel()?);

    let mut viewers = Vec::new();
    let mut progress = Vec::new();
    for viewer in 0..plan.viewers {
        let p = Arc::new(ViewerProgress::default());
        progress.push(Arc::clone(&p));
        viewers.push(tokio::spawn(clients::run_viewer(
            viewer,
            workload.clone(),
            route(Client::Viewer(viewer)),
            recorder.clone(),
            p,
            viewers_stop.clone(),
        )));
    }
    until(Duration::from_secs(30), "every viewer's first snapshot", || {
        progress.iter().all(|p| p.streams.load(Ordering::SeqCst) > 0)
    })
    .await?;
    control.churn.store(true, Ordering::SeqCst);
    let mut gateways = Vec::new();
    for gateway in 0..plan.gateways {
        gateways.push(tokio::spawn(clients::run_gateway(
            gateway,
            workload.clone(),
            route(Client::Gateway(gateway)),
            recorder.clone(),
            Arc::clone(&control),
            gateways_stop.clone(),
        )));
    }
    let started = Instant::now();
    let mut sentinel = Sentinel::default();

    // A random part of a second on top, so that a kill falls anywhere within
    // a checkpoint interval, not always just after a checkpoint.
    sleep(plan.duration.mul_f64(0.4) + Duration::from_millis(fastrand::u64(0..1_000))).await;
    if fault.calm_before() {
        quiesce(&control).await?;
        sentinel.barrier(&mut admin, &progress).await?;
    } else {
        control.churn.store(false, Ordering::SeqCst);
    }
    recorder.phase("quiet");
    say(&format!("{:>6.1} s: quiet; injecting {}", started.elapsed().as_secs_f64(), fault.name()));
    recorder.phase("inject");
    tokio::task::block_in_place(|| {
        fault.inject(&mut FaultCx { server: &mut server, recorder: &recorder, plan: &plan })
    })?;
    if fault.churn_during() {
        control.churn.store(true, Ordering::SeqCst);
    }
    sleep(fault.lasts(&plan)).await;
    if fault.churn_during() {
        quiesce(&control).await?;
    }
    tokio::task::block_in_place(|| fault.heal(&mut FaultCx { server: &mut server, recorder: &recorder, plan: &plan }))?;
    recorder.phase("heal");
    say(&format!(
        "{:>6.1} s: healed; recovering for {} ms",
        started.elapsed().as_secs_f64(),
        fault.recovery(&plan).as_millis()
    ));
    sleep(fault.recovery(&plan)).await;
    sentinel.barrier(&mut admin, &progress).await?;
    recorder.phase("churn");
    control.churn.store(true, Ordering::SeqCst);
    let rest = plan.duration.saturating_sub(started.elapsed());
    sleep(rest.max(Duration::from_secs(1))).await;

    quiesce(&control).await?;
    sentinel.barrier(&mut admin, &progress).await?;
    recorder.phase("final-quiet");
    let settle = Duration::from_millis(u64::from(plan.ttl_ms) + u64::from(plan.delivery_bound_ms));
    say(&format!("{:>6.1} s: settling for {} ms", started.elapsed().as_secs_f64(), settle.as_millis()));
    sleep(settle).await;
    sentinel.barrier(&mut admin, &progress).await?;
    recorder.phase("check");
    let at_us = recorder.now_us();
    let mut users: Vec<String> = (0..plan.users).map(clients::user_id).collect();
    users.push(SENTINEL.to_owned());
    let fresh = snapshot(&mut admin, &users).await?;
    recorder.push(Record::Final { viewer: None, at_us, users: fresh });
    for (user, session) in control.held_now() {
        recorder.push(Record::Held { user, session });
    }
    stop_viewers.send(true).map_err(|e| e.to_string())?;
    for (viewer, task) in viewers.into_iter().enumerate() {
        let view = task.await.map_err(|e| e.to_string())??;
        let mut users: Vec<Presence> =
            view.into_iter().map(|(user, (online, version))| Presence { user, online, version }).collect();
        users.sort_by(|a, b| a.user.cmp(&b.user));
        recorder.push(Record::Final { viewer: Some(viewer), at_us, users });
    }
    stop_gateways.send(true).map_err(|e| e.to_string())?;
    for task in gateways {
        task.await.map_err(|e| e.to_string())??;
    }
    tokio::task::block_in_place(|| server.stop(Duration::from_secs(10)));
    drop(server);
    if options.data_dir.is_none() && scratch.exists() {
        let _ = std::fs::remove_dir_all(&scratch);
    }

    let records = recorder.records_so_far();
    let (figures, expectations) = check_history(&records, fault.as_ref(), &plan);
    let passed = expectations.iter().all(Expectation::held);
    let history_file = match (&options.history, passed) {
        (Some(path), _) => Some(path.clone()),
        (None, false) => {
            Some(std::env::temp_dir().join(format!("presence-history-{}-{}.jsonl", fault.name(), std::process::id())))
        }
        (None, true) => None,
    };
    if let Some(path) = &history_file {
        write_json_lines(path, &records).map_err(|e| format!("{}: {e}", path.display()))?;
    }
    Ok(RunReport { fault: fault.name().to_owned(), expected, figures, expectations, history_file, records })
}

/// `listen` with a concrete port: a port 0 is replaced by a free one, so that
/// a restarted server comes back on the same address.
fn fixed_port(listen: &str) -> Result<String, String> {
    let addr: std::net::SocketAddr = listen.parse().map_err(|e| format!("--listen {listen}: {e}"))?;
    if addr.port() != 0 {
        return Ok(listen.to_owned());
    }
    let probe = std::net::TcpListener::bind(addr).map_err(|e| format!("{listen}: {e}"))?;
    let port = probe.local_addr().map_err(|e| e.to_string())?.port();
    Ok(format!("{}:{port}", addr.ip()))
}

/// Waits for `done` with a deadline, polling.
async fn until(patience: Duration, what: &str, mut done: impl FnMut() -> bool) -> Result<(), String> {
    let deadline = Instant::now() + patience;
    while !done() {
        if Instant::now() > deadline {
            return Err(format!("gave up waiting for {what}"));
        }
        sleep(Duration::from_millis(10)).await;
    }
    Ok(())
}

/// Stops churn and waits until every register and unregister under way is answered.
async fn quiesce(control: &Control) -> Result<(), String> {
    control.churn.store(false, Ordering::SeqCst);
    until(Duration::from_secs(60), "the calls under way", || control.in_flight.load(Ordering::SeqCst) == 0).await
}

/// The sentinel user, flipped for barriers.
#[derive(Debug, Default)]
struct Sentinel {
    flips: u64,
}

impl Sentinel {
    /// Flips the sentinel and waits until every viewer has its new version.
    async fn barrier(
        &mut self,
        client: &mut PresenceClient<Channel>,
        progress: &[Arc<ViewerProgress>],
    ) -> Result<(), String> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let version = loop {
            self.flips += 1;
            match self.flip(client).await {
                Ok(Some(version)) => break version,
                Ok(None) => continue,
                Err(status) if Instant::now() < deadline => {
                    tracing_free_log(&format!("barrier: {status}; retrying"));
                    sleep(Duration::from_millis(100)).await;
                }
                Err(status) => return Err(format!("barrier: {status}")),
            }
        };
        until(Duration::from_secs(60), "every viewer to see the barrier", || {
            progress.iter().all(|p| p.sentinel.load(Ordering::SeqCst) >= version)
        })
        .await
    }

    /// A register of a fresh session flips the sentinel ONLINE when it is
    /// OFFLINE; when it is ONLINE already, a revoke of all its sessions flips it OFFLINE.
    async fn flip(&mut self, client: &mut PresenceClient<Channel>) -> Result<Option<u64>, tonic::Status> {
        let register = pb::RegisterRequest {
            user_id: SENTINEL.into(),
            session_id: format!("b{}", self.flips),
            gateway_id: "runner".into(),
            ttl_ms: 3_600_000,
            ..Default::default()
        };
        let registered = client.register(register).await?.into_inner();
        if registered.changed {
            return Ok(registered.presence.map(|p| p.version));
        }
        let revoke = pb::RevokeRequest { user_id: SENTINEL.into(), session_id: String::new() };
        let revoked = client.revoke(revoke).await?.into_inner();
        Ok(if revoked.changed { revoked.presence.map(|p| p.version) } else { None })
    }
}

fn tracing_free_log(line: &str) {
    eprintln!("presence-history: {line}");
}

/// A fresh `Snapshot` of `users`, in pieces under the request limit.
async fn snapshot(client: &mut PresenceClient<Channel>, users: &[String]) -> Result<Vec<Presence>, String> {
    let mut out = Vec::with_capacity(users.len());
    for chunk in users.chunks(5_000) {
        let request = pb::SnapshotRequest { user_ids: chunk.to_vec(), ..Default::default() };
        let answer = client.snapshot(request).await.map_err(|e| format!("final snapshot: {e}"))?.into_inner();
        out.extend(answer.users.iter().map(|p| Presence {
            user: p.user_id.clone(),
            online: p.state == pb::State::Online as i32,
            version: p.version,
        }));
    }
    Ok(out)
}
