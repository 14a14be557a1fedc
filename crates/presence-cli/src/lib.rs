//! The client subcommands of the `presenced` binary (O4): `get`, `watch`,
//! `changes` (the change feed, F1, F2), `sessions`, `revoke`, `room`, `stats`, `export` and
//! `erase` (P7), over the public gRPC API with
//! the caller's token, readable by default and JSON with `--json`;
//! `register`, which plays a gateway's session from the terminal; and
//! `cluster status`, which reads a cluster's slot map from etcd, and
//! `cluster move`, which asks a slot's owner to hand it over.
//!
//! This crate owns the command line of those subcommands (their clap
//! arguments), what they print and the exit status a script reads
//! ([`EXIT_CODES`]). It talks to presenced only through the API, with
//! presence-client's watchers and change feed consumer for the live streams; the binary's `main` only
//! dispatches here, and `serve` is not this crate's.

mod backup;
mod changes;
mod cluster;
mod commands;
mod connect;
mod exit;
mod json;
mod output;
mod register;
mod text;
mod watch;

use std::process::ExitCode;

use clap::{Args, Subcommand};

pub use connect::Target;
pub use exit::EXIT_CODES;

/// The client subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Print each user's presence: state, version, status, last activity.
    #[command(after_help = EXIT_CODES)]
    Get(GetArgs),
    /// Follow users (or a room, with --room) live, one line per change, until interrupted.
    #[command(after_help = EXIT_CODES)]
    Watch(WatchArgs),
    /// Follow the change feed, one line per change with its cursor (the feed scope).
    ///
    /// Every flip, status change and room becoming occupied or empty, in
    /// order, until interrupted; with --cursor-file, resume where the last
    /// run stopped. Needs the feed scope.
    #[command(after_help = EXIT_CODES)]
    Changes(ChangesArgs),
    /// List a user's live sessions: gateway, generation, deadline, rooms, metadata.
    #[command(after_help = EXIT_CODES)]
    Sessions(SessionsArgs),
    /// Where a notification for each user should go now (A3): the sessions
    /// to show it in-app, whether to push now or after a hand-off, and why.
    ///
    /// From the attention the users' sessions reported; what presenced does
    /// not know is answered "push". Needs the read scope.
    #[command(after_help = EXIT_CODES)]
    NotifyTargets(NotifyTargetsArgs),
    /// Revoke one session of a user, or all of them; the user goes OFFLINE with its last.
    #[command(after_help = EXIT_CODES)]
    Revoke(RevokeArgs),
    /// Print a room's members, counts and signals.
    #[command(after_help = EXIT_CODES)]
    Room(RoomArgs),
    /// Print the service's own figures: what it holds, totals, expiry lag, TTL settings.
    #[command(after_help = EXIT_CODES)]
    Stats(StatsArgs),
    /// Print everything presenced holds about a user, as one JSON document.
    ///
    /// P7: sessions, rooms, presence, status, visibility, audience both
    /// ways, groups, last activity, settings.
    #[command(after_help = EXIT_CODES)]
    Export(ExportArgs),
    /// Erase a user and everything held about it; prints what was removed.
    ///
    /// P7: revokes its sessions, removes its status, visibility, audience
    /// (both ways), groups, activity and settings, and forgets it. Erasing a
    /// user never seen removes nothing and succeeds.
    #[command(after_help = EXIT_CODES)]
    Erase(EraseArgs),
    /// Take an online, consistent snapshot of one node into FILE (the admin scope).
    ///
    /// D3: leases with their deadlines, versions, rooms and durable per-user
    /// data, without stopping it; `presenced serve --restore FILE` starts
    /// from it. Needs the admin scope.
    #[command(after_help = EXIT_CODES)]
    Backup(BackupArgs),
    /// Play a gateway: register a session, renew it until interrupted, unregister it.
    ///
    /// Registers USER's SESSION (and joins each --room), renews it until
    /// interrupted, then unregisters it: a session to watch in the first minute.
    #[command(after_help = EXIT_CODES)]
    Register(RegisterArgs),
    /// A cluster's slot map and nodes, as etcd holds them.
    #[command(subcommand)]
    Cluster(ClusterCommand),
}

/// `presenced cluster ...`
#[derive(Debug, Subcommand)]
pub enum ClusterCommand {
    /// Print each node with its address and how many slots it owns, the
    /// slots without an owner, and the coordinator.
    #[command(after_help = EXIT_CODES)]
    Status(ClusterStatusArgs),
    /// Hand SLOT over to NODE with its users' state (a planned move).
    ///
    /// Its sessions carry on there with their generations and deadlines,
    /// and nobody flips. Asks the slot's owner, found in etcd.
    #[command(after_help = EXIT_CODES)]
    Move(ClusterMoveArgs),
    /// Back up every slot owner into DIR, with a manifest of their slots.
    ///
    /// D3: DIR/NODE.backup for each, as `presenced backup` writes it, and
    /// DIR/manifest.json naming which slots each file holds.
    #[command(after_help = EXIT_CODES)]
    Backup(ClusterBackupArgs),
}

/// `presenced cluster backup DIR`
#[derive(Debug, Args)]
pub struct ClusterBackupArgs {
    /// The directory to write the files to (created if needed).
    #[arg(value_name = "DIR")]
    dir: std::path::PathBuf,
    #[command(flatten)]
    etcd: EtcdTarget,
    /// TLS to the nodes; any of these dials them over https://.
    #[command(flatten)]
    tls: connect::TlsArgs,
    // A service token with the admin scope (--token, --token-file or PRESENCED_TOKEN).
    #[command(flatten)]
    token: connect::TokenArgs,
    /// Print the manifest as JSON instead of a line per node.
    #[arg(long)]
    json: bool,
}

/// `presenced backup FILE`
#[derive(Debug, Args)]
pub struct BackupArgs {
    /// The file to write: written beside it as FILE.tmp, then renamed over it.
    #[arg(value_name = "FILE")]
    file: std::path::PathBuf,
    #[command(flatten)]
    target: Target,
}

/// `presenced cluster move SLOT NODE`
#[derive(Debug, Args)]
pub struct ClusterMoveArgs {
    /// The slot to move (`presenced cluster status` shows who owns how many).
    #[arg(value_name = "SLOT")]
    slot: u32,
    /// The node to move it to: a live node of the cluster, by its --node-id.
    #[arg(value_name = "NODE")]
    node: String,
    #[command(flatten)]
    etcd: EtcdTarget,
    /// TLS to the owner: with node-to-node TLS, a certificate of the
    /// cluster's CA (--cert, --key) is what lets a caller move slots; any
    /// of these dials the owner over https://.
    #[command(flatten)]
    tls: connect::TlsArgs,
    // A service token with the cluster scope (--token, --token-file or PRESENCED_TOKEN).
    #[command(flatten)]
    token: connect::TokenArgs,
    /// One JSON object instead of a line.
    #[arg(long)]
    json: bool,
}

/// Where a cluster command finds the cluster: its etcd, prefix and slot count.
#[derive(Debug, Clone, Args)]
pub struct EtcdTarget {
    /// etcd's client URLs (comma-separated), as the nodes' --etcd.
    #[arg(long, env = "PRESENCED_ETCD", value_name = "URL,...", value_delimiter = ',', required = true)]
    etcd: Vec<String>,
    /// The cluster's prefix in etcd, as the nodes' --etcd-prefix.
    #[arg(long, env = "PRESENCED_ETCD_PREFIX", value_name = "PREFIX", default_value = "/presenced/")]
    etcd_prefix: String,
    /// The cluster's slot count, as the nodes' --slots.
    #[arg(long, env = "PRESENCED_SLOTS", value_name = "N", default_value_t = 1024)]
    slots: u32,
    /// The PEM CA of etcd's certificate, for https:// --etcd URLs [default: the system's roots].
    #[arg(long, env = "PRESENCED_ETCD_CA", value_name = "FILE")]
    etcd_ca: Option<std::path::PathBuf>,
    /// A PEM client certificate for etcd's --client-cert-auth; with --etcd-key.
    #[arg(long, env = "PRESENCED_ETCD_CERT", value_name = "FILE", requires = "etcd_key")]
    etcd_cert: Option<std::path::PathBuf>,
    /// The key of --etcd-cert.
    #[arg(long, env = "PRESENCED_ETCD_KEY", value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<std::path::PathBuf>,
}

/// `presenced cluster status`
#[derive(Debug, Args)]
pub struct ClusterStatusArgs {
    #[command(flatten)]
    etcd: EtcdTarget,
    /// One JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

/// `presenced get USER...`
#[derive(Debug, Args)]
pub struct GetArgs {
    /// The users (a user never seen is OFFLINE at version 0).
    #[arg(required = true, value_name = "USER")]
    users: Vec<String>,
    #[command(flatten)]
    target: Target,
}

/// `presenced watch USER...` or `presenced watch --room ROOM`
#[derive(Debug, Args)]
pub struct WatchArgs {
    /// The users to follow.
    #[arg(value_name = "USER", required_unless_present = "room", conflicts_with = "room")]
    users: Vec<String>,
    /// Follow this room's members and signals instead.
    #[arg(long, value_name = "ROOM")]
    room: Option<String>,
    /// With --room: only its counts of users and sessions (for rooms past the
    /// server's member cap, which a member watch falls back to by itself).
    #[arg(long)]
    count: bool,
    #[command(flatten)]
    target: Target,
}

/// `presenced changes [--from CURSOR|now|oldest] [--kind KIND]... [--prefix P] [--slot N]... [--cursor-file FILE]`
#[derive(Debug, Args)]
pub struct ChangesArgs {
    /// Where to start: `now`, `oldest` (the oldest change the feed retains),
    /// or after a cursor as this command prints it. A cursor in
    /// --cursor-file comes first: this says where a first run starts.
    #[arg(long, value_name = "CURSOR|now|oldest", default_value = "now", value_parser = changes::start)]
    from: changes::Start,
    /// Only changes of this kind (repeatable, or comma-separated); every kind without it.
    #[arg(long = "kind", value_name = "KIND", value_enum, value_delimiter = ',')]
    kinds: Vec<changes::Kind>,
    /// Only users and rooms whose id starts with this.
    #[arg(long, value_name = "PREFIX")]
    prefix: Option<String>,
    /// Only users and rooms of this slot (repeatable, or comma-separated; 0
    /// to 1023 on a single node), for consumers that share the feed.
    #[arg(long = "slot", value_name = "N", value_delimiter = ',')]
    slots: Vec<u32>,
    /// Start after the cursor this file holds (if it holds one), and save
    /// each batch's cursor there once printed, atomically: a run that
    /// stopped resumes where it left off, printing at most its last batch again.
    #[arg(long, value_name = "FILE")]
    cursor_file: Option<std::path::PathBuf>,
    /// Say nothing on stderr when connected (where the feed starts: from
    /// now, the oldest change, a cursor, or the cursor file's).
    #[arg(long, short)]
    quiet: bool,
    #[command(flatten)]
    target: Target,
}

/// `presenced sessions USER`
#[derive(Debug, Args)]
pub struct SessionsArgs {
    /// The user.
    #[arg(value_name = "USER")]
    user: String,
    #[command(flatten)]
    target: Target,
}

/// `presenced notify-targets USER... [--room ROOM] [--urgent] [--handoff-ms MS]`
#[derive(Debug, Args)]
pub struct NotifyTargetsArgs {
    /// The users (1 to 1,000).
    #[arg(required = true, value_name = "USER")]
    users: Vec<String>,
    /// The room the notification is about: no push to a user with it open.
    #[arg(long, value_name = "ROOM")]
    room: Option<String>,
    /// Urgent: always pushed at once.
    #[arg(long)]
    urgent: bool,
    /// The hand-off delay for this call (0: the server's --push-handoff-ms).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    handoff_ms: u32,
    #[command(flatten)]
    target: Target,
}

/// `presenced revoke USER [SESSION]`
#[derive(Debug, Args)]
pub struct RevokeArgs {
    /// The user.
    #[arg(value_name = "USER")]
    user: String,
    /// The session to revoke; without it, every session of the user.
    #[arg(value_name = "SESSION")]
    session: Option<String>,
    #[command(flatten)]
    target: Target,
}

/// `presenced export USER`
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// The user (a user never seen exports as `"held": false`).
    #[arg(value_name = "USER")]
    user: String,
    /// The export is always JSON, pretty-printed; `--json` prints it on one line.
    #[command(flatten)]
    target: Target,
}

/// `presenced erase USER`
#[derive(Debug, Args)]
pub struct EraseArgs {
    /// The user.
    #[arg(value_name = "USER")]
    user: String,
    #[command(flatten)]
    target: Target,
}

/// `presenced room ROOM`
#[derive(Debug, Args)]
pub struct RoomArgs {
    /// The room (a room never used is empty).
    #[arg(value_name = "ROOM")]
    room: String,
    #[command(flatten)]
    target: Target,
}

/// `presenced register USER SESSION [--room ROOM]...`
#[derive(Debug, Args)]
pub struct RegisterArgs {
    /// The user the session belongs to.
    #[arg(value_name = "USER")]
    user: String,
    /// The session's id (a device, a tab).
    #[arg(value_name = "SESSION")]
    session: String,
    /// A room to put the session in once registered (repeatable).
    #[arg(long = "room", value_name = "ROOM")]
    rooms: Vec<String>,
    /// The gateway the session is registered from, as `sessions` shows it.
    #[arg(long, value_name = "ID", default_value = "presenced-cli")]
    gateway: String,
    /// The lease's time to live; 0 takes the server's default.
    #[arg(long, value_name = "MS", default_value_t = 0)]
    ttl_ms: u32,
    /// How often the lease is renewed [default: a third of --ttl-ms, so
    /// that two lost beats are tolerated; 15000 with the server's default
    /// TTL, 45 s, as `stats` suggests].
    #[arg(long, value_name = "MS")]
    heartbeat_ms: Option<u64>,
    /// Session metadata, in `sessions` and the rooms' member lists (repeatable).
    #[arg(long = "meta", value_name = "KEY=VALUE", value_parser = register::key_value)]
    metadata: Vec<(String, String)>,
    #[command(flatten)]
    target: Target,
}

/// `presenced stats`
#[derive(Debug, Args)]
pub struct StatsArgs {
    #[command(flatten)]
    target: Target,
}

/// Runs one client subcommand to its end: its answer on stdout, a failure
/// in one line on stderr, and the exit status of [`EXIT_CODES`].
pub fn run(command: Command) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread().enable_all().build() {
        Ok(runtime) => runtime,
        Err(err) => {
            eprintln!("presenced: cannot start the runtime: {err}");
            return ExitCode::from(exit::Exit::Failed as u8);
        }
    };
    let ran = runtime.block_on(async {
        match command {
            Command::Get(args) => commands::get(args).await,
            Command::Watch(args) => watch::watch(args).await,
            Command::Changes(args) => changes::changes(args).await,
            Command::Sessions(args) => commands::sessions(args).await,
            Command::NotifyTargets(args) => commands::notify_targets(args).await,
            Command::Revoke(args) => commands::revoke(args).await,
            Command::Room(args) => commands::room(args).await,
            Command::Stats(args) => commands::stats(args).await,
            Command::Export(args) => commands::export(args).await,
            Command::Erase(args) => commands::erase(args).await,
            Command::Backup(args) => backup::backup(args).await,
            Command::Register(args) => register::register(args).await,
            Command::Cluster(ClusterCommand::Status(args)) => cluster::status(args).await,
            Command::Cluster(ClusterCommand::Move(args)) => cluster::move_slot(args).await,
            Command::Cluster(ClusterCommand::Backup(args)) => backup::cluster_backup(args).await,
        }
    });
    match ran {
        Ok(()) => ExitCode::SUCCESS,
        Err(failure) => {
            eprintln!("presenced: {}", failure.message);
            ExitCode::from(failure.exit as u8)
        }
    }
}
