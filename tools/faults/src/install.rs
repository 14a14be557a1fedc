//! What the tests run from the system's packages (etcd for the cluster
//! tests, `ip` and `nft` for the network faults), installed by the tests
//! themselves the first time one finds it missing, so that `cargo test
//! --workspace` passes on a fresh machine with nothing installed by hand.
//!
//! The installing is the repository's own `.ci/install-*` scripts, which
//! pin the Debian versions; this only decides when to run one. Test
//! binaries run in parallel (cargo runs one per crate, each with many
//! threads), so a script runs under an exclusive lock on one file that
//! every test process shares, and whoever gets the lock looks again first:
//! the packages are installed once. It installs only as root, the only one
//! apt lets install, and not when `PRESENCED_TEST_NO_INSTALL` is set;
//! otherwise the error says which command to run.

use std::fs::File;
use std::os::fd::AsRawFd as _;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The file whose lock every test process takes before installing.
const LOCK: &str = "/tmp/presenced-test-install.lock";

/// Makes sure every one of `programs` is on `PATH`, running
/// `.ci/<script>` once if one is missing; an error that names the command
/// to run when it may not, or it failed.
pub fn provide(programs: &[&str], script: &str) -> Result<(), String> {
    if programs.iter().all(|program| on_path(program)) {
        return Ok(());
    }
    let script_path = scripts_dir().join(script);
    let command = format!("sudo bash {}", script_path.display());
    let missing = programs.iter().filter(|program| !on_path(program)).copied().collect::<Vec<_>>().join(", ");
    if std::env::var_os("PRESENCED_TEST_NO_INSTALL").is_some() {
        return Err(format!("{missing} not installed (PRESENCED_TEST_NO_INSTALL is set): run `{command}`"));
    }
    // SAFETY: geteuid has no preconditions and cannot fail.
    if unsafe { libc::geteuid() } != 0 {
        return Err(format!("{missing} not installed, and only root may install it: run `{command}`"));
    }
    let lock = File::options()
        .create(true)
        .append(true)
        .open(LOCK)
        .map_err(|error| format!("opening {LOCK} to install {missing}: {error}"))?;
    // SAFETY: the fd is open for the call; the lock goes with the file.
    if unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) } != 0 {
        return Err(format!("locking {LOCK}: {}", std::io::Error::last_os_error()));
    }
    // Another test process may have installed it while this one waited.
    if programs.iter().all(|program| on_path(program)) {
        return Ok(());
    }
    eprintln!("presenced tests: {missing} not installed; installing with `bash {}`", script_path.display());
    let status = Command::new("bash")
        .arg(&script_path)
        .status()
        .map_err(|error| format!("running {}: {error}: run `{command}`", script_path.display()))?;
    let still_missing = programs.iter().filter(|program| !on_path(program)).copied().collect::<Vec<_>>();
    if !status.success() || !still_missing.is_empty() {
        return Err(format!(
            "{} failed ({status}); {} still missing: run `{command}` and read what it says",
            script_path.display(),
            still_missing.join(", ")
        ));
    }
    Ok(())
}

/// Whether `program` is a file in a directory of `PATH`, where the tests
/// run it from.
pub fn on_path(program: &str) -> bool {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path).any(|dir| dir.join(program).is_file())
}

/// The repository's `.ci` folder, from this crate's (`tools/faults`).
fn scripts_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.ci")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_program_on_the_path_needs_no_install_and_the_scripts_are_where_this_looks() {
        assert!(on_path("sh"));
        assert_eq!(provide(&["sh"], "no-such-script"), Ok(()));
        for script in ["install-etcd", "install-fault-tools"] {
            assert!(scripts_dir().join(script).is_file(), "{script} in .ci");
        }
    }

    #[test]
    fn a_missing_program_that_may_not_be_installed_names_the_command_to_run() {
        // SAFETY: set before any thread of this test reads the environment.
        unsafe { std::env::set_var("PRESENCED_TEST_NO_INSTALL", "1") };
        let refused = provide(&["presenced-no-such-program"], "install-etcd").unwrap_err();
        assert!(refused.contains("presenced-no-such-program not installed"), "{refused}");
        assert!(refused.contains("sudo bash ") && refused.contains(".ci/install-etcd"), "{refused}");
    }
}
