//! Fault injectors for presenced's history checker.
//!
//! Each injector makes one fault really happen to a server running on this
//! machine, and undoes it when dropped (even while a test panics):
//!
//! | injector | fault | how | needs |
//! | --- | --- | --- | --- |
//! | [`NetLab`] | loss and partitions between client groups and the server | a network namespace on one end of a veth pair, nftables drop rules inside it | root, `ip` (iproute2), `nft` (nftables) |
//! | [`DelayProxy`] | one-way delay in each direction, changeable while running | a TCP proxy that holds each chunk until its arrival plus the delay | nothing |
//! | [`SmallDisk`] | a full disk (`ENOSPC`) | a small tmpfs filled by a ballast file | root |
//! | [`SlowDisk`] | slow writes, fsyncs and renames | a FUSE passthrough filesystem that sleeps before each of them | root, `/dev/fuse` |
//!
//! The kernel these run on has no `netem` qdisc, so delay cannot come from
//! the network namespace; it comes from [`DelayProxy`], which can listen
//! inside a [`NetLab`] (see [`NetLab::run_in`]) or beside it.
//!
//! An injector whose prerequisite is missing returns [`FaultError`] naming
//! what to install or how to run, so a test that needs it fails with that
//! message instead of passing without the fault. `.ci/install-fault-tools`
//! installs the packages.

use std::io;
use std::process::Command;

mod disk;
pub mod install;
mod netlab;
mod proxy;
mod slowdisk;

pub use disk::SmallDisk;
pub use netlab::{NetLab, connect_from};
pub use proxy::{DelayProxy, ProxyCounters};
pub use slowdisk::SlowDisk;

/// Why an injector could not be set up or changed.
#[derive(Debug, thiserror::Error)]
pub enum FaultError {
    /// The injector needs root (network namespaces, mounts).
    #[error("{what} needs root: run the test as root")]
    NotRoot {
        /// What was being set up.
        what: &'static str,
    },
    /// A program the injector runs is not installed, and could not be.
    #[error("{why}")]
    MissingPrograms {
        /// What is missing, and the command that installs it.
        why: String,
    },
    /// A device the injector opens does not exist.
    #[error("{device} does not exist: {hint}")]
    MissingDevice {
        /// The device path.
        device: &'static str,
        /// How to get it.
        hint: &'static str,
    },
    /// A command the injector ran failed.
    #[error("`{command}` failed ({status}): {stderr}")]
    Command {
        /// The command line.
        command: String,
        /// Its exit status.
        status: std::process::ExitStatus,
        /// What it printed on standard error.
        stderr: String,
    },
    /// A system call failed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: io::Error,
    },
}

/// Shorthand for this crate's results.
pub type Result<T> = std::result::Result<T, FaultError>;

/// Wraps an `io::Error` with what was being done.
fn io_err(what: impl Into<String>) -> impl FnOnce(io::Error) -> FaultError {
    let what = what.into();
    move |source| FaultError::Io { what, source }
}

/// Fails unless this process runs as root.
fn require_root(what: &'static str) -> Result<()> {
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } == 0 { Ok(()) } else { Err(FaultError::NotRoot { what }) }
}

/// Makes sure `programs` are installed ([`install::provide`] runs
/// `.ci/<script>` once where it may), or fails saying what to run.
fn require_programs(programs: &[&str], script: &str) -> Result<()> {
    install::provide(programs, script).map_err(|why| FaultError::MissingPrograms { why })
}

/// Runs a command to completion, turning a non-zero exit into an error that
/// carries its standard error.
fn run(command: &mut Command, stdin: Option<&str>) -> Result<()> {
    use std::io::Write as _;
    use std::process::Stdio;

    let line = format!("{command:?}");
    command.stdout(Stdio::null()).stderr(Stdio::piped());
    if stdin.is_some() {
        command.stdin(Stdio::piped());
    }
    let mut child = command.spawn().map_err(io_err(format!("spawning {line}")))?;
    if let (Some(text), Some(mut pipe)) = (stdin, child.stdin.take()) {
        pipe.write_all(text.as_bytes()).map_err(io_err(format!("writing to {line}")))?;
    }
    let output = child.wait_with_output().map_err(io_err(format!("waiting for {line}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(FaultError::Command {
            command: line,
            status: output.status,
            stderr: String::from_utf8_lossy(&output.stderr).trim().to_owned(),
        })
    }
}
