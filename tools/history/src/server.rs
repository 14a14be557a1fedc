//! The server under test: the real `presenced` binary as a child process.
//!
//! A [`Launch`] says how to start it: a command prefix (empty, or for instance
//! `ip netns exec NS`, so that it can run inside a network namespace), the
//! binary, the listen address, a data directory and further flags. A
//! [`Server`] is one running process of it, which faults signal, kill and
//! restart on the same address and data directory.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

/// How to start `presenced serve`.
#[derive(Debug, Clone)]
pub struct Launch {
    /// Words run before the binary (`["ip", "netns", "exec", "ns1"]`); empty to run it directly.
    pub prefix: Vec<String>,
    /// The `presenced` binary.
    pub program: PathBuf,
    /// `--listen`: a fixed address, so that clients reconnect to it after a restart.
    pub listen: String,
    /// `--data-dir`, for faults that restart from a checkpoint.
    pub data_dir: Option<PathBuf>,
    /// Further flags (`--default-ttl-ms`, ...).
    pub args: Vec<String>,
    /// Where the server's stderr goes (inherited when none).
    pub stderr: Option<PathBuf>,
}

impl Launch {
    /// Runs `program` directly on `listen`, in memory, with no further flags.
    pub fn new(program: PathBuf, listen: impl Into<String>) -> Self {
        Launch { prefix: Vec::new(), program, listen: listen.into(), data_dir: None, args: Vec::new(), stderr: None }
    }

    /// The whole command line.
    pub fn command_line(&self) -> Vec<String> {
        let mut words = self.prefix.clone();
        words.push(self.program.display().to_string());
        words.extend(["serve".to_owned(), "--listen".to_owned(), self.listen.clone()]);
        if let Some(dir) = &self.data_dir {
            words.extend(["--data-dir".to_owned(), dir.display().to_string()]);
        }
        words.extend(self.args.iter().cloned());
        words
    }
}

/// A running server process.
#[derive(Debug)]
pub struct Server {
    launch: Launch,
    child: Option<Child>,
    /// The address it announced (`listening on ADDR`).
    addr: String,
}

impl Server {
    /// Starts the process and waits for its `listening on ADDR` line.
    pub fn start(launch: Launch) -> Result<Server, String> {
        let (child, addr) = spawn(&launch)?;
        Ok(Server { launch, child: Some(child), addr })
    }

    /// The launch it was started with.
    pub fn launch(&self) -> &Launch {
        &self.launch
    }

    /// `http://ADDR`, for clients.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The process id, while it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Sends a signal by name (`STOP`, `CONT`, `TERM`) with `kill`.
    pub fn signal(&self, name: &str) -> Result<(), String> {
        let pid = self.pid().ok_or("the server is not running")?;
        let status = Command::new("kill").args([format!("-{name}"), pid.to_string()]).status();
        match status {
            Ok(status) if status.success() => Ok(()),
            other => Err(format!("kill -{name} {pid}: {other:?}")),
        }
    }

    /// `kill -9`, and waits for the process to be gone.
    pub fn kill9(&mut self) -> Result<(), String> {
        let mut child = self.child.take().ok_or("the server is not running")?;
        child.kill().map_err(|e| format!("kill -9: {e}"))?;
        child.wait().map_err(|e| format!("wait after kill -9: {e}"))?;
        Ok(())
    }

    /// Starts the process again with the same launch (same address and data directory).
    pub fn restart(&mut self) -> Result<(), String> {
        if self.child.is_some() {
            return Err("the server is still running".into());
        }
        let (child, addr) = spawn(&self.launch)?;
        self.child = Some(child);
        self.addr = addr;
        Ok(())
    }

    /// SIGTERM and a wait of at most `patience` for the exit; then `kill -9`.
    pub fn stop(&mut self, patience: Duration) {
        let Some(mut child) = self.child.take() else { return };
        let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
        let deadline = std::time::Instant::now() + patience;
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // A stopped process cannot act on SIGKILL's exit until continued on some kernels' accounting; harmless.
            let _ = Command::new("kill").args(["-CONT", &child.id().to_string()]).status();
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

fn spawn(launch: &Launch) -> Result<(Child, String), String> {
    let words = launch.command_line();
    let mut command = Command::new(&words[0]);
    command.args(&words[1..]).env("RUST_LOG", std::env::var("PRESENCED_LOG").unwrap_or_else(|_| "warn".into()));
    command.stdout(Stdio::piped());
    match &launch.stderr {
        Some(path) => {
            let file = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .map_err(|e| format!("{}: {e}", path.display()))?;
            command.stderr(Stdio::from(file));
        }
        None => {
            command.stderr(Stdio::inherit());
        }
    }
    let mut child = command.spawn().map_err(|e| format!("spawn {}: {e}", words.join(" ")))?;
    let mut line = String::new();
    let stdout = child.stdout.take().ok_or("no stdout")?;
    BufReader::new(stdout).read_line(&mut line).map_err(|e| format!("read the server's stdout: {e}"))?;
    let Some(addr) = line.strip_prefix("listening on ") else {
        let _ = child.kill();
        let _ = child.wait();
        return Err(format!("the server did not announce itself: {line:?} ({})", words.join(" ")));
    };
    Ok((child, addr.trim().to_owned()))
}

/// The `presenced` binary: `explicit` if given, else `PRESENCED_BIN`, else
/// `CARGO_BIN_EXE_presenced`, else `presenced` beside this executable or in
/// the target directory above it (`target/debug/deps/x` → `target/debug/presenced`).
pub fn find_presenced(explicit: Option<&Path>) -> Result<PathBuf, String> {
    if let Some(path) = explicit {
        return Ok(path.to_owned());
    }
    for var in ["PRESENCED_BIN", "CARGO_BIN_EXE_presenced"] {
        if let Ok(path) = std::env::var(var) {
            return Ok(PathBuf::from(path));
        }
    }
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut dir = exe.parent();
    while let Some(d) = dir {
        let candidate = d.join("presenced");
        if candidate.is_file() {
            return Ok(candidate);
        }
        if d.file_name().is_some_and(|name| name == "target") {
            break;
        }
        dir = d.parent();
    }
    Err("no presenced binary: build it (`cargo build --bin presenced`) or pass --presenced PATH".into())
}
