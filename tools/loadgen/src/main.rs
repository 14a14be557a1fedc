//! `presence-loadgen`: drives presenced (through presence-client) or the Redis + Lua
//! baseline of seed 000 with the same gateway and viewer workloads, prints a summary and
//! writes a JSON report shaped like ghz's.
//!
//! Scenarios (subcommands): `load` (register U×S sessions, then heartbeats for a
//! duration), `memory` (resident memory per session), `expiry` (lag from lease deadline
//! to the OFFLINE a viewer receives), `fanout` (events per second to many viewers, and
//! gateway renewal latency with and without a stalled viewer), `resume` (a reconnect storm of
//! viewers with and without `known_versions`), `room-count`, `room-counts`, `room-members` and
//! `typing` (rooms and signals, see `rooms/`), `damping` (flaps with and without the server's offline
//! grace), `soak` (a long run of renewing sessions, then a reconnect storm), `overload`
//! (renewals at twice capacity beside registers, unregisters and revokes), `tls-handshakes` and
//! `idle-connections` (what TLS costs: handshake storms, memory per connection), and `h2load-prepare` /
//! `h2load-report` around an h2load run (an outside client's view of unary `Renew`). `--help` on each
//! subcommand lists its flags; `benches/compare.sh` runs them all against both targets.

mod cli;
mod conn;
mod damping;
mod direct;
mod expiry;
mod fanout;
mod gateway;
mod h2load;
mod ids;
mod load;
mod memory;
mod notify;
mod overload;
mod phase;
mod progress;
mod redis_seed;
mod report;
mod resume;
mod rooms;
mod server;
mod server_cpu;
mod soak;
mod stats;
mod tls;

use std::process::ExitCode;

use clap::Parser;

use crate::cli::{Cli, Command};
use crate::progress::Progress;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let common = cli.command.common().clone();
    let threads = common.threads.unwrap_or_else(|| report::cpus() as usize).max(1);
    // One thread is a single event loop rather than a pool of one: a pool parks
    // and wakes through futexes even when it has only one worker.
    let mut builder = if threads == 1 {
        tokio::runtime::Builder::new_current_thread()
    } else {
        let mut pool = tokio::runtime::Builder::new_multi_thread();
        pool.worker_threads(threads);
        pool
    };
    let runtime = match builder.enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("presence-loadgen: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let progress = Progress::new(common.quiet);
    let outcome = runtime.block_on(async move {
        match cli.command {
            Command::Load(args) => load::run(args, progress).await,
            Command::Memory(args) => memory::run(args, progress).await,
            Command::Expiry(args) => expiry::run(args, progress).await,
            Command::Fanout(args) => fanout::run(args, progress).await,
            Command::Resume(args) => resume::run(args, progress).await,
            Command::RoomCount(args) => rooms::count::run(args, progress).await,
            Command::RoomCounts(args) => rooms::counts::run(args, progress).await,
            Command::NotifyTargets(args) => notify::run(args, progress).await,
            Command::RoomMembers(args) => rooms::members::run(args, progress).await,
            Command::Typing(args) => rooms::typing::run(args, progress).await,
            Command::Damping(args) => damping::run(args, progress).await,
            Command::Soak(args) => soak::run(args, progress).await,
            Command::Overload(args) => overload::run(args, progress).await,
            Command::H2loadPrepare(args) => h2load::prepare(args).await,
            Command::H2loadReport(args) => h2load::report(args),
            Command::TlsHandshakes(args) => tls::handshakes(args, progress).await,
            Command::IdleConnections(args) => tls::idle(args, progress).await,
        }
    });
    let report = match outcome {
        Ok(report) => report,
        Err(e) => {
            eprintln!("presence-loadgen: {e}");
            return ExitCode::FAILURE;
        }
    };
    if let Some(path) = &common.report {
        if let Err(e) = report.write(path) {
            eprintln!("presence-loadgen: cannot write {}: {e}", path.display());
            return ExitCode::FAILURE;
        }
        println!("report: {}", path.display());
    }
    // Dropping the runtime would wait for tasks blocked on sockets; leave at once.
    runtime.shutdown_background();
    ExitCode::SUCCESS
}
