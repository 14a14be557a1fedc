//! `presence-history run --fault NAME ...`: runs the recording clients against
//! a real presenced, injects the fault, checks the history and prints a report;
//! exits 0 only if every expectation held. `presence-history check FILE
//! --fault NAME ...` checks a history written by an earlier run.

use std::net::IpAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use presence_history::faults::{self, Plan};
use presence_history::runner::{self, RunOptions};
use presence_history::server::find_presenced;

#[derive(Debug, Parser)]
#[command(name = "presence-history", about = "A black-box history checker for presenced, with faults")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Start presenced, run the clients, inject the fault, check, report.
    Run(RunArgs),
    /// Check a history file written by an earlier run.
    Check {
        /// The JSON-lines history.
        file: PathBuf,
        #[command(flatten)]
        shape: Shape,
    },
}

#[derive(Debug, Args)]
struct Shape {
    /// The fault: none, kill9, stop, loss, partition-gateways, partition-viewers, delay, disk-full, slow-disk.
    #[arg(long, default_value = "none")]
    fault: String,
    /// Seconds of churn, fault included (the settle comes after).
    #[arg(long, default_value_t = 20)]
    duration: u64,
    /// Gateways (even ones hold `Session`s on a `LeaseChannel`, odd ones make unary calls).
    #[arg(long, default_value_t = 4)]
    gateways: usize,
    /// Viewers (odd ones ask for 20 ms batches).
    #[arg(long, default_value_t = 4)]
    viewers: usize,
    /// Users.
    #[arg(long, default_value_t = 200)]
    users: usize,
    /// Lease TTL in ms (the gateways renew at a third of it).
    #[arg(long, default_value_t = 2_000)]
    ttl_ms: u32,
    /// `--checkpoint-interval-ms` of the server, for kill9.
    #[arg(long, default_value_t = 1_000)]
    checkpoint_interval_ms: u32,
    /// How late a viewer may receive an OFFLINE after the unregister's answer.
    #[arg(long, default_value_t = 2_000)]
    delivery_bound_ms: u32,
}

#[derive(Debug, Args)]
struct RunArgs {
    #[command(flatten)]
    shape: Shape,
    /// The presenced binary (else PRESENCED_BIN, else the target directory).
    #[arg(long)]
    presenced: Option<PathBuf>,
    /// The server's listen address (port 0: a free port, kept across restarts).
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: String,
    /// The address clients connect to, when not the listen address.
    #[arg(long)]
    connect: Option<String>,
    /// The local IP clients bind to.
    #[arg(long)]
    bind: Option<IpAddr>,
    /// Words run before the binary, e.g. `--prefix ip --prefix netns --prefix exec --prefix ns1`.
    #[arg(long)]
    prefix: Vec<String>,
    /// The server's data directory (a scratch one when the fault needs one).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Write the whole history here (else only when a rule broke, to a scratch file).
    #[arg(long)]
    history: Option<PathBuf>,
    /// Further server flags, after `--`.
    #[arg(last = true)]
    server_args: Vec<String>,
}

impl Shape {
    fn plan(&self) -> Plan {
        Plan {
            users: self.users,
            gateways: self.gateways,
            viewers: self.viewers,
            ttl_ms: self.ttl_ms,
            heartbeat_ms: self.ttl_ms / 3,
            duration: Duration::from_secs(self.duration),
            restart_grace_ms: self.ttl_ms,
            checkpoint_interval_ms: self.checkpoint_interval_ms,
            delivery_bound_ms: self.delivery_bound_ms,
        }
    }

    fn fault(&self) -> Result<Box<dyn faults::Fault>, String> {
        faults::by_name(&self.fault)
            .ok_or_else(|| format!("unknown fault {:?}; known: {}", self.fault, faults::NAMES.join(", ")))
    }
}

fn main() -> ExitCode {
    match real_main() {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(message) => {
            eprintln!("presence-history: {message}");
            ExitCode::from(2)
        }
    }
}

fn real_main() -> Result<bool, String> {
    match Cli::parse().command {
        Command::Run(args) => {
            let fault = args.shape.fault()?;
            let options = RunOptions {
                plan: args.shape.plan(),
                presenced: find_presenced(args.presenced.as_deref())?,
                prefix: args.prefix,
                listen: args.listen,
                connect: args.connect,
                bind: args.bind,
                data_dir: args.data_dir,
                server_args: args.server_args,
                history: args.history,
            };
            let runtime =
                tokio::runtime::Builder::new_multi_thread().enable_all().build().map_err(|e| e.to_string())?;
            let report = runtime.block_on(runner::run(fault, options, &mut |line| println!("{line}")))?;
            print!("{}", report.render());
            Ok(report.passed())
        }
        Command::Check { file, shape } => {
            let fault = shape.fault()?;
            let records =
                presence_history::history::read_json_lines(&file).map_err(|e| format!("{}: {e}", file.display()))?;
            let (figures, expectations) = runner::check_history(&records, fault.as_ref(), &shape.plan());
            let report = runner::RunReport {
                fault: shape.fault.clone(),
                expected: Vec::new(),
                figures,
                expectations,
                history_file: None,
                records: Vec::new(),
            };
            print!("{}", report.render());
            Ok(report.passed())
        }
    }
}
