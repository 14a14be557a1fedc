//! `presenced serve` as a child process, as a user or an init system runs it.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::PATIENCE;

pub const BINARY: &str = env!("CARGO_BIN_EXE_presenced");

/// A running `presenced serve`.
pub struct Daemon {
    pub child: Child,
    pub addr: String,
    /// Where its stderr goes, when the test reads it.
    pub stderr: Option<PathBuf>,
}

impl Daemon {
    /// Starts on a free port.
    pub fn start(args: &[&str], env: &[(&str, &str)]) -> Daemon {
        Daemon::start_on("127.0.0.1:0", args, env, None)
    }

    /// Starts on `listen` (a fixed address lets clients reconnect after a restart),
    /// with stderr written to `stderr` if given.
    pub fn start_on(listen: &str, args: &[&str], env: &[(&str, &str)], stderr: Option<&Path>) -> Daemon {
        Daemon::start_through(&[], listen, args, env, stderr)
    }

    /// [`Daemon::start_on`], run through `prefix` (`ip netns exec NAME`, to
    /// start it in a network namespace).
    pub fn start_through(
        prefix: &[&str],
        listen: &str,
        args: &[&str],
        env: &[(&str, &str)],
        stderr: Option<&Path>,
    ) -> Daemon {
        let stderr_target = match stderr {
            Some(path) => Stdio::from(std::fs::File::create(path).expect("create the stderr file")),
            None => Stdio::inherit(),
        };
        let mut command = match prefix.split_first() {
            Some((program, rest)) => {
                let mut command = Command::new(program);
                command.args(rest).arg(BINARY);
                command
            }
            None => Command::new(BINARY),
        };
        let mut child = command
            .args(["serve", "--listen", listen])
            .args(args)
            .env("RUST_LOG", std::env::var("PRESENCED_TEST_LOG").unwrap_or_else(|_| "warn".into()))
            .envs(env.iter().copied())
            .stdout(Stdio::piped())
            .stderr(stderr_target)
            .spawn()
            .expect("spawn presenced");
        let mut first_line = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first_line).expect("read stdout");
        let addr = first_line
            .strip_prefix("listening on ")
            .unwrap_or_else(|| panic!("first stdout line must be `listening on ADDR`, got {first_line:?}"))
            .trim()
            .to_owned();
        Daemon { child, addr, stderr: stderr.map(Path::to_owned) }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `HOST:PORT`, for raw TCP.
    pub fn addr(&self) -> &str {
        &self.addr
    }

    fn signal(&self, signal: &str) {
        let status = Command::new("kill").args([signal, &self.child.id().to_string()]).status().unwrap();
        assert!(status.success());
    }

    /// SIGTERM: a graceful shutdown.
    pub fn terminate(&mut self) {
        self.signal("-TERM");
    }

    /// SIGSTOP: the process stops running, its sockets stay open.
    pub fn pause(&self) {
        self.signal("-STOP");
    }

    /// SIGCONT after [`Daemon::pause`].
    pub fn resume(&self) {
        self.signal("-CONT");
    }

    /// `kill -9`: no shutdown at all.
    pub fn kill9(mut self) {
        self.signal("-KILL");
        let status = self.child.wait().unwrap();
        assert!(!status.success());
    }

    /// SIGTERM, then waits for a clean exit.
    pub async fn stop(mut self) {
        self.terminate();
        let status = self.wait_exit().await;
        assert!(status.success(), "graceful shutdown exits 0, got {status:?}");
    }

    /// Waits for the process to exit. It yields to the test's runtime while it
    /// waits: a test that blocked its thread instead would stop its own clients
    /// from answering the server's shutdown handshake.
    pub async fn wait_exit(&mut self) -> std::process::ExitStatus {
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status;
            }
            assert!(Instant::now() < deadline, "presenced did not exit after SIGTERM");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// What it wrote to stderr so far (when started with a stderr file).
    pub fn stderr_text(&self) -> String {
        std::fs::read_to_string(self.stderr.as_ref().expect("started with a stderr file")).unwrap_or_default()
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A free loopback port for a listener that must be told one.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// A fresh scratch directory for one test.
pub fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("presenced-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Waits until the latest checkpoint in `dir` holds `user_id`.
pub async fn until_checkpointed(dir: &Path, user_id: &str) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        if let Ok(bytes) = std::fs::read(dir.join("leases.checkpoint"))
            && let Ok(checkpoint) = presence_core::checkpoint::decode(&bytes)
            && checkpoint.users.iter().any(|user| user.user_id == user_id)
        {
            return;
        }
        assert!(Instant::now() < deadline, "no checkpoint ever held {user_id}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
