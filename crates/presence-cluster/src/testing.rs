//! A real etcd for tests (feature `testing`): one member on loopback ports
//! with its own data directory, killed when dropped. The binary is
//! `PRESENCED_ETCD_BIN`, or `etcd` from PATH, which the first test that
//! finds it missing installs (`.ci/install-etcd`, Debian's, through
//! `presence_faults::install`: once, as root).

use std::path::PathBuf;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

use presence_tls::ClientTls;

use tokio::process::{Child, Command};
use tokio::time::Instant;

use crate::{Etcd, SlotMapWatch};

/// How long any awaited condition may take before a test fails: the one
/// deadline of the workspace's tests (`presence_server::testing` re-exports
/// it), long enough for the slowest of them, a cluster's (an etcd election, a
/// slot move on a loaded machine). Here: etcd answering after its start.
pub const PATIENCE: Duration = Duration::from_secs(20);

/// One etcd member on loopback, killed when dropped.
#[derive(Debug)]
pub struct EtcdServer {
    child: Option<Child>,
    /// Its client URL.
    pub endpoint: String,
    peer_url: String,
    data: TempDir,
    tls: Option<EtcdServerTls>,
}

/// etcd serving its clients over TLS, with `--client-cert-auth`.
#[derive(Debug, Clone)]
pub struct EtcdServerTls {
    /// etcd's certificate (`--cert-file`).
    pub cert: PathBuf,
    /// Its key (`--key-file`).
    pub key: PathBuf,
    /// The CA its clients' certificates must come from (`--trusted-ca-file`).
    pub client_ca: PathBuf,
    /// What the harness itself dials etcd with, to see that it answers.
    pub client: Arc<ClientTls>,
}

#[derive(Debug)]
struct TempDir(std::path::PathBuf);

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

impl EtcdServer {
    /// Starts etcd and waits until it answers. Its ports are picked free
    /// just before; should another process take one first (etcd then exits
    /// at once), it starts again on others.
    pub async fn start() -> EtcdServer {
        EtcdServer::start_on(std::net::Ipv4Addr::LOCALHOST.into()).await
    }

    /// [`EtcdServer::start`], serving clients on `host` (an address other
    /// than loopback, for nodes in another network namespace).
    pub async fn start_on(host: std::net::IpAddr) -> EtcdServer {
        EtcdServer::start_with(host, None).await
    }

    /// [`EtcdServer::start`] with TLS for its clients (`https://`), requiring
    /// client certificates from `tls.client_ca`.
    pub async fn start_with_tls(tls: EtcdServerTls) -> EtcdServer {
        EtcdServer::start_with(std::net::Ipv4Addr::LOCALHOST.into(), Some(tls)).await
    }

    async fn start_with(host: std::net::IpAddr, tls: Option<EtcdServerTls>) -> EtcdServer {
        let name = format!("presenced-etcd-{}-{}", std::process::id(), free_port());
        let data = TempDir(etcd_data_parent().join(name));
        let scheme = if tls.is_some() { "https" } else { "http" };
        let mut server = EtcdServer { child: None, endpoint: String::new(), peer_url: String::new(), data, tls };
        for _ in 0..5 {
            server.endpoint = format!("{scheme}://{host}:{}", free_port());
            server.peer_url = format!("http://127.0.0.1:{}", free_port());
            if server.run().await {
                return server;
            }
            let _ = std::fs::remove_dir_all(&server.data.0);
        }
        panic!("etcd exited at start five times, on other ports each time");
    }

    /// Runs etcd on the server's ports and data directory; returns once it
    /// answers (true), or false if it exited first.
    async fn run(&mut self) -> bool {
        let binary = std::env::var("PRESENCED_ETCD_BIN").unwrap_or_else(|_| {
            if let Err(why) = presence_faults::install::provide(&["etcd"], "install-etcd") {
                panic!("the cluster tests need etcd: {why}");
            }
            "etcd".to_owned()
        });
        let (endpoint, peer_url) = (&self.endpoint, &self.peer_url);
        let mut command = Command::new(&binary);
        if let Some(tls) = &self.tls {
            command.arg("--cert-file").arg(&tls.cert).arg("--key-file").arg(&tls.key);
            command.arg("--client-cert-auth").arg("--trusted-ca-file").arg(&tls.client_ca);
        }
        let mut child = command
            .args(["--name", "test", "--data-dir"])
            .arg(&self.data.0)
            .args(["--listen-client-urls", endpoint, "--advertise-client-urls", endpoint])
            .args(["--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url])
            .args(["--initial-cluster", &format!("test={peer_url}")])
            // Short raft timers, so that one-second leases are allowed and expire on time.
            .args(["--heartbeat-interval", "10", "--election-timeout", "50"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .kill_on_drop(true)
            .spawn()
            .unwrap_or_else(|error| {
                panic!("could not start {binary} ({error}): install etcd (sudo bash .ci/install-etcd) or set PRESENCED_ETCD_BIN to an etcd binary")
            });
        let deadline = Instant::now() + PATIENCE;
        loop {
            if let Ok(Some(_)) = child.try_wait() {
                return false;
            }
            if let Ok(etcd) = Etcd::connect(&self.endpoint, self.tls.as_ref().map(|tls| &tls.client)).await
                && SlotMapWatch::start(&etcd, "/probe/", 1).await.is_ok()
            {
                self.child = Some(child);
                return true;
            }
            assert!(Instant::now() < deadline, "etcd did not answer on {} within {PATIENCE:?}", self.endpoint);
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Kills etcd (SIGKILL) and waits for it to be gone: etcd is down.
    pub async fn kill(&mut self) {
        let mut child = self.child.take().expect("etcd is running");
        child.kill().await.expect("etcd is killed");
    }

    /// Starts etcd again on the same ports and data, after [`EtcdServer::kill`],
    /// and waits until it answers: etcd is back, with what it held.
    pub async fn restart(&mut self) {
        assert!(self.child.is_none(), "etcd is still running");
        for _ in 0..50 {
            if self.run().await {
                return;
            }
            // A port of the old process may be held a moment longer.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        panic!("etcd did not start again on {}", self.endpoint);
    }

    /// A client of it.
    pub async fn client(&self) -> Etcd {
        Etcd::connect(&self.endpoint, self.tls.as_ref().map(|tls| &tls.client)).await.unwrap()
    }

    /// Sends `signal` (`-STOP`, `-CONT`, `-KILL`) to the etcd process.
    pub fn signal(&self, signal: &str) {
        let pid = self.child.as_ref().and_then(Child::id).expect("etcd is running").to_string();
        assert!(std::process::Command::new("kill").args([signal, &pid]).status().unwrap().success());
    }
}

/// Where a test's etcd keeps its data: in memory (`/dev/shm`) where there is
/// one. etcd syncs its log to disk on every write, and a disk shared with a
/// build or another test's writes can hold a sync for hundreds of
/// milliseconds: a lease revoked late by that is etcd's disk, not the
/// cluster's timing that the tests bound (C4: a silent node taken over
/// within its lease's TTL and a second).
fn etcd_data_parent() -> std::path::PathBuf {
    let shm = std::path::Path::new("/dev/shm");
    if shm.is_dir() { shm.to_owned() } else { std::env::temp_dir() }
}
