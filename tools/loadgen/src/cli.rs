//! Command-line flags.

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};

use crate::conn::{ConnSpec, Endpoints, Mode, TargetKind};

/// Load generator for presenced and for the Redis + Lua baseline of seed 000.
#[derive(Debug, Parser)]
#[command(name = "presence-loadgen", version, about, long_about = None)]
pub(crate) struct Cli {
    /// The scenario.
    #[command(subcommand)]
    pub(crate) command: Command,
}

/// The scenarios.
#[derive(Debug, Subcommand)]
pub(crate) enum Command {
    /// Register U×S sessions (registers/s), then renew them for a duration (heartbeats/s, latency).
    Load(LoadArgs),
    /// Register N sessions and report the server's resident memory growth per session.
    Memory(MemoryArgs),
    /// Let N leases run out within a window; measure the lag from each deadline to the OFFLINE a viewer gets
    /// (and, with --gateway-sessions, a gateway's renewal latency before and during the expiries).
    Expiry(ExpiryArgs),
    /// V viewers watching W users each while users flip; events/s, and gateway p99 with a stalled viewer.
    Fanout(FanoutArgs),
    /// A reconnect storm (presenced): V viewers reopen their Watch at once, without and with `known_versions`.
    Resume(ResumeArgs),
    /// One huge room (presenced only: the Redis design has no rooms): count-mode watchers
    /// under join/leave churn; frames per interval and a gateway's p99 quiet and during.
    RoomCount(RoomCountArgs),
    /// The counts of many rooms (presenced only: the Redis design has no rooms):
    /// `WatchRoomCounts` streams of every room under join/leave churn across them
    /// (messages per stream per interval, server CPU), then batched `RoomCounts`
    /// reads (rooms/s); a gateway's p99 quiet, during the churn and during the reads.
    RoomCounts(RoomCountsArgs),
    /// Where notifications go (presenced only: the Redis design has no attention):
    /// `NotifyTargets` batches over users whose sessions said their attention
    /// (users answered per second, server CPU), a gateway's p99 quiet and during.
    NotifyTargets(NotifyTargetsArgs),
    /// Many small rooms (presenced only: the Redis design has no rooms): member-mode
    /// watchers while members update; changes delivered per second and change -> watcher p99.
    RoomMembers(RoomMembersArgs),
    /// Typing signals in many small rooms (presenced only: the Redis design has no
    /// signals): signals accepted per second and signal sets delivered per second.
    Typing(TypingArgs),
    /// Sessions that drop and come back within a window, watched (presenced only: the
    /// Redis design has no damping): OFFLINE events viewers get; run it with and without
    /// presenced's --offline-grace-ms.
    Damping(DampingArgs),
    /// Sessions renewing every interval with jitter for a long time (presenced): errors, false
    /// OFFLINE, resident memory, expiry lag and CPU per minute; then a reconnect storm.
    Soak(SoakArgs),
    /// Renewals at twice the server's capacity beside registers, unregisters and revokes
    /// (presenced): only renewals may be shed, and none of the others may be lost.
    Overload(OverloadArgs),
    /// Register one session on presenced and write its Renew as a gRPC frame, for `h2load -d FILE`.
    H2loadPrepare(H2loadPrepareArgs),
    /// Make a report of an h2load run: its output, its --log-file, presenced's metrics before and after.
    H2loadReport(H2loadReportArgs),
    /// A storm of TLS clients (presenced with --tls): full handshakes, then each client resuming
    /// its session; time until all are served, handshakes/s, server CPU per handshake.
    TlsHandshakes(HandshakeArgs),
    /// Connections that make one call each and stay open, idle: the server's memory per
    /// connection (plaintext, or TLS with --tls).
    IdleConnections(IdleArgs),
}

/// `tls-handshakes` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct HandshakeArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Clients in each storm.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) clients: usize,
    /// Clients connecting at once.
    #[arg(long, default_value_t = 256)]
    pub(crate) concurrency: usize,
    /// presenced's process id, for its CPU time per handshake.
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
}

/// `idle-connections` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct IdleArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Connections held open.
    #[arg(long, default_value_t = 2_000)]
    pub(crate) connections: u64,
    /// presenced's process id, for its resident memory.
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
}

impl Command {
    /// The flags every scenario has.
    pub(crate) fn common(&self) -> &Common {
        match self {
            Command::Load(a) => &a.common,
            Command::Memory(a) => &a.common,
            Command::Expiry(a) => &a.common,
            Command::Fanout(a) => &a.common,
            Command::Resume(a) => &a.common,
            Command::RoomCount(a) => &a.common,
            Command::RoomCounts(a) => &a.common,
            Command::NotifyTargets(a) => &a.common,
            Command::RoomMembers(a) => &a.common,
            Command::Typing(a) => &a.common,
            Command::Damping(a) => &a.common,
            Command::Soak(a) => &a.common,
            Command::Overload(a) => &a.common,
            Command::H2loadPrepare(a) => &a.common,
            Command::H2loadReport(a) => &a.common,
            Command::TlsHandshakes(a) => &a.common,
            Command::IdleConnections(a) => &a.common,
        }
    }
}

/// Target, output and runtime flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct Common {
    /// The system under test.
    #[arg(long, value_enum, default_value = "presenced")]
    pub(crate) target: TargetKind,
    /// presenced's gRPC address.
    #[arg(long, env = "PRESENCED_ADDR", default_value = "127.0.0.1:50051")]
    pub(crate) addr: String,
    /// Redis URL (the seed's scripts are loaded with SCRIPT LOAD).
    #[arg(long, env = "REDIS_URL", default_value = "redis://127.0.0.1:6379")]
    pub(crate) redis_url: String,
    /// Write the JSON report (ghz's field names) to this file.
    #[arg(long)]
    pub(crate) report: Option<PathBuf>,
    /// No progress bars (they are also hidden when stdout is not a terminal).
    #[arg(long)]
    pub(crate) quiet: bool,
    /// Threads of the generator (default: one per core). With 1 it is a single
    /// event loop (tokio's current-thread runtime), with no wake-ups across
    /// threads: the cheapest way to drive many small calls from one core.
    #[arg(long)]
    pub(crate) threads: Option<usize>,
    /// Gateway id sent with every register.
    #[arg(long, default_value = "loadgen")]
    pub(crate) gateway_id: String,
    /// presenced is a cluster of this many slots (its `--slots`): lease
    /// batches (`--mode leases`) go through `ClusterLeases`, which enters
    /// at `--addr` and sends each item to its user's owner. 0: one node.
    #[arg(long, default_value_t = 0)]
    pub(crate) cluster_slots: u32,
    /// With `--cluster-slots`: etcd endpoints (comma-separated) whose slot
    /// map the `ClusterLeases` follows, so that every item goes straight to
    /// its owner from the first batch on and a move is learnt without a
    /// refusal. Without it, owners are learnt from refusals.
    #[arg(long, value_delimiter = ',', requires = "cluster_slots")]
    pub(crate) etcd: Vec<String>,
    /// The cluster's `--etcd-prefix`.
    #[arg(long, default_value = "/presenced/")]
    pub(crate) etcd_prefix: String,
    /// presenced serves TLS: dial `https://` (`--addr` without a scheme
    /// becomes https://ADDR), verifying its certificate against `--tls-ca`.
    #[arg(long)]
    pub(crate) tls: bool,
    /// The PEM CA of presenced's certificate (with `--tls`) [default: the system's roots].
    #[arg(long, value_name = "FILE", requires = "tls")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// A PEM client certificate, for a presenced with `--tls-client-ca`; with `--tls-key`.
    #[arg(long, value_name = "FILE", requires_all = ["tls", "tls_key"])]
    pub(crate) tls_cert: Option<PathBuf>,
    /// The key of `--tls-cert`.
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// A service token presenced requires, sent as `authorization: Bearer TOKEN` on every call.
    #[arg(long, env = "PRESENCED_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    pub(crate) token: Option<String>,
}

impl Common {
    /// The target's addresses.
    pub(crate) fn endpoints(&self) -> Endpoints {
        let tls = self.tls.then(|| crate::conn::TlsFiles {
            ca: self.tls_ca.clone(),
            cert: self.tls_cert.clone(),
            key: self.tls_key.clone(),
        });
        Endpoints {
            target: self.target,
            addr: self.addr.clone(),
            redis_url: self.redis_url.clone(),
            cluster_slots: self.cluster_slots,
            etcd: self.etcd.clone(),
            etcd_prefix: self.etcd_prefix.clone(),
            tls,
            token: self.token.clone(),
        }
    }
}

/// How gateway operations are sent.
#[derive(Debug, Clone, Args)]
pub(crate) struct Drive {
    /// unary: one call per operation (presenced RPC / redis EVALSHA); leases: explicit batches
    /// (presenced Leases stream / redis pipeline); coalesced: presenced LeaseChannel single calls.
    #[arg(long, value_enum, default_value = "unary")]
    pub(crate) mode: Mode,
    /// Items per batch (leases: per submit_batch; redis: pipeline depth; coalesced: largest batch).
    #[arg(long, default_value_t = 100)]
    pub(crate) batch: u64,
    /// Calls in flight (workers). On Redis each worker has its own connection.
    #[arg(long, default_value_t = 64)]
    pub(crate) concurrency: u64,
    /// presenced: HTTP/2 connections (unary) or Leases streams (leases, coalesced), shared by the workers.
    #[arg(long, default_value_t = 4)]
    pub(crate) connections: u64,
    /// Items per second, 0 = as fast as possible; `interval` = sessions / heartbeat interval.
    #[arg(long, default_value = "0", value_parser = parse_rate)]
    pub(crate) rate: Rate,
    /// coalesced mode: longest wait for a batch to fill, in microseconds.
    #[arg(long, default_value_t = 1000)]
    pub(crate) max_delay_us: u64,
}

impl Drive {
    /// The connection layout for `common`'s target.
    pub(crate) fn conn_spec(&self, common: &Common) -> ConnSpec {
        ConnSpec {
            endpoints: common.endpoints(),
            mode: self.mode,
            concurrency: self.concurrency,
            connections: self.connections,
            batch: self.batch,
            max_delay: Duration::from_micros(self.max_delay_us),
        }
    }
}

/// A rate: fixed, unlimited, or the heartbeat model's.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Rate {
    /// Items per second (0 = as fast as possible).
    PerSecond(f64),
    /// Every session once per heartbeat interval.
    Interval,
}

impl Rate {
    /// Items per second for `sessions` sessions heartbeating every `interval`.
    pub(crate) fn resolve(self, sessions: u64, interval: Duration) -> f64 {
        match self {
            Rate::PerSecond(r) => r,
            Rate::Interval => sessions as f64 / interval.as_secs_f64().max(1e-3),
        }
    }
}

fn parse_rate(s: &str) -> Result<Rate, String> {
    if s == "interval" {
        return Ok(Rate::Interval);
    }
    match s.parse::<f64>() {
        Ok(r) if r >= 0.0 && r.is_finite() => Ok(Rate::PerSecond(r)),
        _ => Err(format!("{s:?}: a non-negative number or `interval`")),
    }
}

/// Parses `500ms`, `30s`, `2m`, `1h` or a bare number of seconds.
pub(crate) fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let (num, unit) = match s.find(|c: char| !(c.is_ascii_digit() || c == '.')) {
        Some(i) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: f64 = num.parse().map_err(|_| format!("{s:?}: expected a duration such as 500ms, 30s, 2m"))?;
    let secs = match unit {
        "ms" => n / 1e3,
        "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (ms, s, m, h)")),
    };
    Duration::try_from_secs_f64(secs).map_err(|e| format!("{s:?}: {e}"))
}

/// `load` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct LoadArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: Drive,
    /// Users (U).
    #[arg(long, default_value_t = 1_200_000)]
    pub(crate) users: u64,
    /// Sessions per user (S), on average; 2.5 gives each user 2 or 3.
    #[arg(long, default_value_t = 2.5)]
    pub(crate) sessions_per_user: f64,
    /// Lease TTL of registers and renewals, ms.
    #[arg(long, default_value_t = 45_000)]
    pub(crate) ttl_ms: u32,
    /// The modelled heartbeat interval, ms: the rate a real fleet needs is sessions / interval.
    #[arg(long, default_value_t = 15_000)]
    pub(crate) heartbeat_interval_ms: u64,
    /// Length of the heartbeat phase.
    #[arg(long, default_value = "30s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Send registers in another mode than the heartbeats (default: --mode).
    #[arg(long, value_enum)]
    pub(crate) register_mode: Option<Mode>,
    /// The server's process id: report its CPU time per heartbeat (from /proc/PID/stat).
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
    /// Name the users from `u<N>` and the sessions from `sess_<N × 16>` on, so
    /// that a second run beside a first one (of fewer users, with fewer than
    /// 16 sessions each) shares no user and no session with it.
    #[arg(long, default_value_t = 0)]
    pub(crate) first_user: u64,
}

/// `memory` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct MemoryArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: Drive,
    /// Sessions to register (N).
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) sessions: u64,
    /// Sessions per user, on average.
    #[arg(long, default_value_t = 2.5)]
    pub(crate) sessions_per_user: f64,
    /// The server's process id (presenced or redis-server), for /proc/PID/status.
    #[arg(long)]
    pub(crate) pid: u32,
    /// Lease TTL, ms (long enough that nothing expires while measuring).
    #[arg(long, default_value_t = 3_600_000)]
    pub(crate) ttl_ms: u32,
    /// Wait this long after the last register before reading memory again.
    #[arg(long, default_value = "2s", value_parser = parse_duration)]
    pub(crate) settle: Duration,
}

/// `expiry` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct ExpiryArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: Drive,
    /// Users, one session each, whose leases all run out within the window.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) users: u64,
    /// The deadlines are spread evenly over this window, ms.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) window_ms: i64,
    /// The server's lowest TTL, ms (presenced's --min-ttl-ms).
    #[arg(long, default_value_t = 1_000)]
    pub(crate) min_ttl_ms: u32,
    /// presenced: users per Watch stream (the server takes at most 10,000).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) watch_chunk: u64,
    /// Give up waiting for OFFLINE events this long after the last deadline.
    #[arg(long, default_value = "600s", value_parser = parse_duration)]
    pub(crate) timeout: Duration,
    /// redis: the sweeper's period, ms (seed: 2000).
    #[arg(long, default_value_t = crate::redis_seed::SWEEP_INTERVAL_MS)]
    pub(crate) sweep_interval_ms: u64,
    /// redis: users per sweep (seed: LIMIT 0 500).
    #[arg(long, default_value_t = crate::redis_seed::SWEEP_LIMIT)]
    pub(crate) sweep_limit: u64,
    /// Also write every user's deadline, arrival and lag to this CSV file.
    #[arg(long)]
    pub(crate) lags_csv: Option<PathBuf>,
    /// Gateway sessions renewed throughout (other users, registered with the rest and
    /// watched by no one), one unary Renew each, to see whether a wave of expiries slows
    /// the gateways down; 0 = no gateway.
    #[arg(long, default_value_t = 0)]
    pub(crate) gateway_sessions: u64,
    /// Gateway renewals per second: a modest steady rate, so that its latency shows the
    /// server, not the gateway's own queueing.
    #[arg(long, default_value_t = 1_000.0)]
    pub(crate) gateway_rate: f64,
    /// Gateway renewals in flight (they share one HTTP/2 connection).
    #[arg(long, default_value_t = 8)]
    pub(crate) gateway_concurrency: u64,
    /// With a gateway: the quiet phase it is measured in before the first deadline, ms.
    /// The window is moved this much later so that the phase fits after the arranging
    /// registers.
    #[arg(long, default_value_t = 5_000)]
    pub(crate) quiet_ms: u64,
    /// presenced: how the viewer learns of the OFFLINEs: Watch streams, or one
    /// `Changes` stream of the change feed (F1).
    #[arg(long, value_enum, default_value_t = ExpiryViewer::Watch)]
    pub(crate) viewer: ExpiryViewer,
    /// The viewer goes away at the first deadline for this long, ms, and comes
    /// back: the feed resumes from its last cursor; a Redis subscriber
    /// subscribes again (what was published meanwhile is lost). 0 = never away.
    #[arg(long, default_value_t = 0)]
    pub(crate) viewer_away_ms: u64,
    /// With `--viewer feed`: after the storm, read the whole feed from its
    /// oldest change, to measure a consumer catching up.
    #[arg(long)]
    pub(crate) catch_up: bool,
}

/// `expiry --viewer`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum ExpiryViewer {
    /// Watch streams of `--watch-chunk` users.
    Watch,
    /// One `Changes` stream.
    Feed,
}

/// `fanout` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct FanoutArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: Drive,
    /// Viewers (V), one Watch stream each.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) viewers: u64,
    /// Users each viewer watches (W), drawn from the population.
    #[arg(long, default_value_t = 500)]
    pub(crate) watch: u64,
    /// Users that can be watched and flipped (one session each).
    #[arg(long, default_value_t = 100_000)]
    pub(crate) population: u64,
    /// Flips (a register of an offline user or an unregister of an online one) per second.
    #[arg(long, default_value_t = 1_000.0)]
    pub(crate) churn_rate: f64,
    /// Tasks sending flips.
    #[arg(long, default_value_t = 4)]
    pub(crate) churn_concurrency: u64,
    /// How flips are sent: unary (one RPC / EVALSHA each) or coalesced (presenced: through
    /// one `LeaseChannel`, which gathers concurrent flips into `Leases` batches).
    #[arg(long, value_enum, default_value = "unary")]
    pub(crate) churn_mode: Mode,
    /// presenced viewers: the Watch `batch_window_ms` (0 = one event per change).
    #[arg(long, default_value_t = 0)]
    pub(crate) batch_window_ms: u32,
    /// Length of each measured phase.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Also run a phase with one stalled viewer (a Watch that is opened and never read).
    #[arg(long)]
    pub(crate) stalled_viewer: bool,
    /// Users the stalled viewer watches (at most 10,000 on presenced).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) stalled_watch: u64,
    /// Gateway sessions renewed during the phases (not watched by anyone).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) gateway_sessions: u64,
    /// Gateway renewals per second during the phases.
    #[arg(long, default_value_t = 2_000.0)]
    pub(crate) gateway_rate: f64,
    /// Viewer streams per HTTP/2 connection (presenced).
    #[arg(long, default_value_t = 100)]
    pub(crate) viewers_per_connection: u64,
    /// Lease TTL, ms.
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
    /// The gateway renews this long with the viewers open and nothing flipping,
    /// for its quiet p99 (0: no quiet phase).
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) quiet_phase: Duration,
    /// The server's process id: report its CPU time per event delivered in the
    /// plain phase (from /proc/PID/stat), everything it did in the phase included.
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
}

/// `resume` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct ResumeArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Viewers (V), one Watch stream each.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) viewers: u64,
    /// Users each viewer watches (W), drawn from the population.
    #[arg(long, default_value_t = 500)]
    pub(crate) watch: u64,
    /// Users that can be watched; every other one is ONLINE.
    #[arg(long, default_value_t = 5_000)]
    pub(crate) population: u64,
    /// Viewer streams per HTTP/2 connection.
    #[arg(long, default_value_t = 100)]
    pub(crate) viewers_per_connection: u64,
    /// Lease TTL, ms.
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
}

/// How the room scenarios send their registers, joins, leaves and signals: explicit
/// batches on presenced `Leases` streams.
#[derive(Debug, Clone, Args)]
pub(crate) struct LeaseDrive {
    /// Items per Leases batch.
    #[arg(long, default_value_t = 500)]
    pub(crate) batch: u64,
    /// Batches in flight.
    #[arg(long, default_value_t = 8)]
    pub(crate) concurrency: u64,
    /// Leases streams (one HTTP/2 connection each) the batches share.
    #[arg(long, default_value_t = 2)]
    pub(crate) connections: u64,
}

impl LeaseDrive {
    /// The connection layout for `common`'s target, `batch` items per call.
    pub(crate) fn conn_spec(&self, common: &Common, batch: u64) -> ConnSpec {
        ConnSpec {
            endpoints: common.endpoints(),
            mode: Mode::Leases,
            concurrency: self.concurrency,
            connections: self.connections,
            batch,
            max_delay: Duration::from_millis(1),
        }
    }
}

/// What every room scenario is run with.
#[derive(Debug, Clone, Args)]
pub(crate) struct RoomRun {
    /// Watcher streams per HTTP/2 connection.
    #[arg(long, default_value_t = 100)]
    pub(crate) watchers_per_connection: u64,
    /// Length of the measured phase (churn, updates, signals).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Lease TTL, ms.
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
}

/// A bystander gateway's flags (see `gateway.rs`).
#[derive(Debug, Clone, Args)]
pub(crate) struct GatewayArgs {
    /// Gateway sessions renewed throughout (other users, in no room), one unary Renew each.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) gateway_sessions: u64,
    /// Gateway renewals per second.
    #[arg(long, default_value_t = 2_000.0)]
    pub(crate) gateway_rate: f64,
    /// Gateway renewals in flight (they share one HTTP/2 connection).
    #[arg(long, default_value_t = 8)]
    pub(crate) gateway_concurrency: u64,
    /// The quiet phase the gateway is measured in before the load starts.
    #[arg(long, default_value = "5s", value_parser = parse_duration)]
    pub(crate) quiet_phase: Duration,
}

/// `room-count` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct RoomCountArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: LeaseDrive,
    #[command(flatten)]
    pub(crate) run: RoomRun,
    #[command(flatten)]
    pub(crate) gateway: GatewayArgs,
    /// Members of the room (users with one session each), joined before the watchers open.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) members: u64,
    /// Count-mode watchers of the room.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) watchers: u64,
    /// The watchers' `count_interval_ms`.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) count_interval_ms: u32,
    /// Sessions (of other users) that join and leave the room in turn.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) churn_sessions: u64,
    /// Joins plus leaves per second.
    #[arg(long, default_value_t = 5_000.0)]
    pub(crate) churn_rate: f64,
    /// Items per churn batch.
    #[arg(long, default_value_t = 50)]
    pub(crate) churn_batch: u64,
}

/// `room-counts` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct RoomCountsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: LeaseDrive,
    #[command(flatten)]
    pub(crate) run: RoomRun,
    #[command(flatten)]
    pub(crate) gateway: GatewayArgs,
    /// Rooms (`r0` ..): every stream watches all of them, and the reads cycle over
    /// them (presenced takes at most 10,000 per call).
    #[arg(long, default_value_t = 10_000)]
    pub(crate) rooms: u64,
    /// `WatchRoomCounts` streams, each of every room (`--watchers-per-connection` of
    /// them per HTTP/2 connection).
    #[arg(long, default_value_t = 100)]
    pub(crate) streams: u64,
    /// The streams' `count_interval_ms`.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) count_interval_ms: u32,
    /// Members (users with one session each) joined before the streams open, session
    /// `k` in room `k % rooms`.
    #[arg(long, default_value_t = 20_000)]
    pub(crate) members: u64,
    /// Sessions (of other users) that join and leave in turn, session `k` room `k % rooms`.
    #[arg(long, default_value_t = 5_000)]
    pub(crate) churn_sessions: u64,
    /// Joins plus leaves per second.
    #[arg(long, default_value_t = 5_000.0)]
    pub(crate) churn_rate: f64,
    /// Items per churn batch.
    #[arg(long, default_value_t = 50)]
    pub(crate) churn_batch: u64,
    /// The server's process id: its CPU over the churn and over the reads (/proc/PID/stat).
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
    /// Rooms per `RoomCounts` call of the read phase.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) read_batch: u64,
    /// `RoomCounts` calls in flight.
    #[arg(long, default_value_t = 8)]
    pub(crate) read_concurrency: u64,
    /// HTTP/2 connections the reads share.
    #[arg(long, default_value_t = 2)]
    pub(crate) read_connections: u64,
    /// Length of the read phase (0 = no reads).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) read_duration: Duration,
}

/// `notify-targets` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct NotifyTargetsArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: LeaseDrive,
    #[command(flatten)]
    pub(crate) gateway: GatewayArgs,
    /// Users with one session each, whose sessions say their attention.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) users: u64,
    /// Users per `NotifyTargets` call (presenced answers at most 1,000).
    #[arg(long, default_value_t = 1_000)]
    pub(crate) users_per_call: u64,
    /// `NotifyTargets` calls in flight.
    #[arg(long, default_value_t = 4)]
    pub(crate) callers: u64,
    /// HTTP/2 connections the calls share.
    #[arg(long, default_value_t = 2)]
    pub(crate) call_connections: u64,
    /// Length of the measured phase.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// Lease TTL, ms.
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
    /// The server's process id: its CPU over the calls (/proc/PID/stat).
    #[arg(long)]
    pub(crate) server_pid: Option<u32>,
}

/// `room-members` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct RoomMembersArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: LeaseDrive,
    #[command(flatten)]
    pub(crate) run: RoomRun,
    /// Rooms.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) rooms: u64,
    /// Members per room, each a distinct user with one session (session k is in room k mod rooms).
    #[arg(long, default_value_t = 50)]
    pub(crate) members: u64,
    /// Member-mode watchers per room.
    #[arg(long, default_value_t = 5)]
    pub(crate) watchers_per_room: u64,
    /// Member metadata updates per second (a join of a member again, its send time in the metadata).
    #[arg(long, default_value_t = 2_000.0)]
    pub(crate) churn_rate: f64,
    /// Items per churn batch.
    #[arg(long, default_value_t = 20)]
    pub(crate) churn_batch: u64,
}

/// `typing` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct TypingArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: LeaseDrive,
    #[command(flatten)]
    pub(crate) run: RoomRun,
    /// Rooms.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) rooms: u64,
    /// Members per room, each a distinct user with one session.
    #[arg(long, default_value_t = 3)]
    pub(crate) members: u64,
    /// The signal's TTL, ms.
    #[arg(long, default_value_t = 5_000)]
    pub(crate) signal_ttl_ms: u32,
    /// Every member sends a signal this often, ms: sets it, or renews it before it runs out.
    #[arg(long, default_value_t = 3_000)]
    pub(crate) renew_every_ms: u64,
    /// Every this many of a member's signals is a clear (ttl 0) instead: it stops typing
    /// for a while and starts again; 0 = it never stops.
    #[arg(long, default_value_t = 3)]
    pub(crate) pause_every: u64,
    /// Items per signal batch.
    #[arg(long, default_value_t = 50)]
    pub(crate) signal_batch: u64,
}

/// `damping` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct DampingArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) drive: LeaseDrive,
    /// Users (one session each) that flap, all watched.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) population: u64,
    /// Viewers, each watching every user of the population (at most 10,000 on presenced).
    #[arg(long, default_value_t = 10)]
    pub(crate) viewers: u64,
    /// Flaps (an unregister, and a register of the same session `--gap-ms` later) per second.
    #[arg(long, default_value_t = 500.0)]
    pub(crate) flap_rate: f64,
    /// Time from a session's unregister to its register, ms.
    #[arg(long, default_value_t = 200)]
    pub(crate) gap_ms: u64,
    /// Length of the flapping phase.
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// presenced's metrics endpoint (`--metrics-listen`), to read `presenced_suppressed_flaps`.
    #[arg(long)]
    pub(crate) metrics_addr: Option<String>,
    /// The server's --offline-grace-ms, as a label in the report (the generator cannot see it).
    #[arg(long, default_value_t = 0)]
    pub(crate) grace_ms: u64,
    /// Lease TTL, ms.
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
}

/// The server a long scenario watches: started by it, or found at `--addr`.
#[derive(Debug, Clone, Args)]
pub(crate) struct ServerArgs {
    /// Start this presenced binary (`serve --listen 127.0.0.1:0 --metrics-listen ...`) and
    /// stop it at the end; without it the scenario drives the server at `--addr`.
    #[arg(long)]
    pub(crate) server_bin: Option<PathBuf>,
    /// With --server-bin: pin the server to these CPUs (`taskset -c`), e.g. `0`.
    #[arg(long, requires = "server_bin")]
    pub(crate) server_cpus: Option<String>,
    /// With --server-bin: one more argument for `presenced serve` (repeat the flag).
    #[arg(long, requires = "server_bin", allow_hyphen_values = true)]
    pub(crate) server_arg: Vec<String>,
    /// Without --server-bin: the server's process id, for its memory and CPU (/proc).
    #[arg(long, conflicts_with = "server_bin")]
    pub(crate) server_pid: Option<u32>,
    /// Without --server-bin: the server's metrics endpoint (`--metrics-listen`).
    #[arg(long, conflicts_with = "server_bin")]
    pub(crate) metrics_addr: Option<String>,
}

/// `soak` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct SoakArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) server: ServerArgs,
    /// Healthy sessions: registered, then renewed every interval until the end.
    #[arg(long, default_value_t = 3_000_000)]
    pub(crate) sessions: u64,
    /// Sessions per user, on average.
    #[arg(long, default_value_t = 2.5)]
    pub(crate) sessions_per_user: f64,
    /// Lease TTL of registers and renewals, ms.
    #[arg(long, default_value_t = 45_000)]
    pub(crate) ttl_ms: u32,
    /// Each session renews this often, ms, from a phase of its own.
    #[arg(long, default_value_t = 15_000)]
    pub(crate) interval_ms: u64,
    /// Each renewal comes up to this much earlier or later than the interval says, ms.
    #[arg(long, default_value_t = 3_000)]
    pub(crate) jitter_ms: u64,
    /// Length of the renewal phase (before the storm).
    #[arg(long, default_value = "30m", value_parser = parse_duration)]
    pub(crate) duration: Duration,
    /// The first part of the renewal phase, left out of the memory drift.
    #[arg(long, default_value = "5m", value_parser = parse_duration)]
    pub(crate) warmup: Duration,
    /// A report line this often.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) window: Duration,
    /// Users watched (spread evenly over the healthy users): their OFFLINE events are false.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) watch_sample: u64,
    /// Other users (one session each) registered per minute that never renew, so that leases
    /// expire throughout and the expiry lag is measured; their OFFLINEs are expected.
    #[arg(long, default_value_t = 1_000)]
    pub(crate) expiring_per_minute: u64,
    /// TTL of those sessions, ms.
    #[arg(long, default_value_t = 15_000)]
    pub(crate) expiring_ttl_ms: u32,
    /// Healthy sessions whose gateway dies after the renewal phase and which register again
    /// (a new generation, same session id) as fast as they can; 0 = no storm.
    #[arg(long, default_value_t = 1_000_000)]
    pub(crate) storm_sessions: u64,
    /// Renewals go on this long after the storm before the end.
    #[arg(long, default_value = "60s", value_parser = parse_duration)]
    pub(crate) after_storm: Duration,
    /// Items per Leases batch (registers and renewals).
    #[arg(long, default_value_t = 500)]
    pub(crate) batch: u64,
    /// Batches in flight.
    #[arg(long, default_value_t = 8)]
    pub(crate) concurrency: u64,
    /// Leases streams (one HTTP/2 connection each).
    #[arg(long, default_value_t = 2)]
    pub(crate) connections: u64,
    /// Storm registers: batches in flight, over as many new Leases streams (the reconnected
    /// gateways' connections).
    #[arg(long, default_value_t = 8)]
    pub(crate) storm_concurrency: u64,
}

/// `overload` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct OverloadArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    #[command(flatten)]
    pub(crate) server: ServerArgs,
    /// Sessions renewed (one user each), registered first with a long TTL: the flood renews
    /// the first `--batch`, the unary Renews the others.
    #[arg(long, default_value_t = 100_000)]
    pub(crate) renew_sessions: u64,
    /// Renewal items per Leases batch of the flood.
    #[arg(long, default_value_t = 100)]
    pub(crate) batch: u64,
    /// The capacity ramp: batches in flight at each step (closed loop), `--ramp-step` each.
    #[arg(long, default_value = "4,8,16,32,64", value_delimiter = ',')]
    pub(crate) ramp: Vec<u64>,
    /// Length of each ramp step.
    #[arg(long, default_value = "3s", value_parser = parse_duration)]
    pub(crate) ramp_step: Duration,
    /// Renewals offered in the shedding phase, as a multiple of the capacity found.
    #[arg(long, default_value_t = 2.0)]
    pub(crate) factor: f64,
    /// h2load, which sends the ramp's and the flood's batches: one request (one `Leases`
    /// stream) per batch, the same body each time, cheaply enough to outrun the server.
    #[arg(long, default_value = "h2load")]
    pub(crate) h2load: PathBuf,
    /// Concurrent streams the flood may hold: more than the server's lease queue
    /// (`--lease-queue`, 256) plus its workers, or the queue never fills.
    #[arg(long, default_value_t = 1024)]
    pub(crate) flood_streams: u64,
    /// HTTP/2 connections (h2load clients) those streams share.
    #[arg(long, default_value_t = 8)]
    pub(crate) flood_connections: u64,
    /// Unary Renews per second during the shedding phase (other sessions of the renewed set).
    #[arg(long, default_value_t = 1_000.0)]
    pub(crate) unary_renew_rate: f64,
    /// Registers, unregisters and revokes per second, each, in both the quiet and the
    /// shedding phase; half of the registers and unregisters unary, half in Leases batches.
    #[arg(long, default_value_t = 400.0)]
    pub(crate) ops_rate: f64,
    /// Registers (and as many unregisters) per Leases batch; each batch carries a few renewals too.
    #[arg(long, default_value_t = 10)]
    pub(crate) ops_batch: u64,
    /// Length of the quiet phase and of the shedding phase.
    #[arg(long, default_value = "20s", value_parser = parse_duration)]
    pub(crate) phase: Duration,
    /// Lease TTL of every register, ms (long enough that nothing expires in the run).
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
}

/// `h2load-prepare` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct H2loadPrepareArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// Where to write the frame (5-byte gRPC header + a serialized RenewRequest).
    #[arg(long)]
    pub(crate) out: PathBuf,
    /// The user of the session h2load renews.
    #[arg(long, default_value = "h2load-u0")]
    pub(crate) user_id: String,
    /// The session h2load renews.
    #[arg(long, default_value = "sess_h2load000001")]
    pub(crate) session_id: String,
    /// Lease TTL of the register and of every renewal, ms (long enough to outlast the run).
    #[arg(long, default_value_t = 600_000)]
    pub(crate) ttl_ms: u32,
}

/// `h2load-report` flags.
#[derive(Debug, Clone, Args)]
pub(crate) struct H2loadReportArgs {
    #[command(flatten)]
    pub(crate) common: Common,
    /// h2load's standard output (its closing summary).
    #[arg(long)]
    pub(crate) output: PathBuf,
    /// h2load's --log-file: start, status and duration of every request.
    #[arg(long)]
    pub(crate) log: PathBuf,
    /// presenced's /metrics just before the run.
    #[arg(long, requires = "metrics_after")]
    pub(crate) metrics_before: Option<PathBuf>,
    /// presenced's /metrics just after the run.
    #[arg(long, requires = "metrics_before")]
    pub(crate) metrics_after: Option<PathBuf>,
    /// h2load's connections (-c), for the report's options.
    #[arg(long, default_value_t = 0)]
    pub(crate) connections: u64,
    /// Requests in flight over all connections (-c times -m), for the report's options.
    #[arg(long, default_value_t = 0)]
    pub(crate) concurrency: u64,
    /// The h2load command line as run, copied into the report.
    #[arg(long)]
    pub(crate) command: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn cli_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn durations_parse() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert_eq!(parse_duration("1.5"), Ok(Duration::from_millis(1500)));
        assert!(parse_duration("5 parsecs").is_err());
    }

    #[test]
    fn rates_parse_and_resolve() {
        assert_eq!(parse_rate("0"), Ok(Rate::PerSecond(0.0)));
        assert_eq!(parse_rate("interval"), Ok(Rate::Interval));
        assert!(parse_rate("-1").is_err());
        assert_eq!(Rate::Interval.resolve(3_000_000, Duration::from_secs(30)), 100_000.0);
    }

    #[test]
    fn defaults_model_the_issue() {
        let cli = Cli::try_parse_from(["presence-loadgen", "load"]).unwrap();
        let Command::Load(a) = cli.command else { panic!("load") };
        assert_eq!((a.users, a.sessions_per_user, a.ttl_ms, a.heartbeat_interval_ms), (1_200_000, 2.5, 45_000, 15_000));
        let cli = Cli::try_parse_from([
            "presence-loadgen",
            "load",
            "--target",
            "redis",
            "--redis-url",
            "redis://127.0.0.1:7000",
            "--mode",
            "pipelined",
        ])
        .unwrap();
        let Command::Load(a) = cli.command else { panic!("load") };
        assert_eq!((a.common.target, a.drive.mode), (TargetKind::Redis, Mode::Leases));
    }
}
