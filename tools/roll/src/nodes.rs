//! The nodes under the roll: `presenced serve` processes started, stopped
//! with SIGTERM as an orchestrator stops them, started again (the same
//! binary or the next build), and probed on `/readyz` until ready (D2), over
//! TLS when the service port has it; and the etcd they join, over TLS too.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::sync::Arc;
use std::time::{Duration, Instant};

use presence_cluster::testing::{EtcdServer, EtcdServerTls};
use presence_tls::testing::Pki;
use presence_tls::{ClientTls, ClientTlsFiles};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::process::{Child, ChildStdout, Command};

use crate::moves::MoveMetrics;

/// The service token every node takes and every client presents.
pub(crate) const TOKEN: &str = "roll-service-token-of-at-least-32-bytes";

/// How long a node may take to print its listening line, to exit after
/// SIGTERM, or to become ready.
const NODE_STEP_WITHIN: Duration = Duration::from_secs(300);

/// The certificates of a roll with TLS on: the service port's (clients and
/// the metrics port), the nodes' to each other and to etcd, etcd's own.
pub(crate) struct Certificates {
    service: Pki,
    cluster: Pki,
    etcd: Pki,
}

impl Certificates {
    pub(crate) fn new(dir: &Path) -> Certificates {
        Certificates {
            service: Pki::new(dir, "service"),
            cluster: Pki::new(dir, "cluster"),
            etcd: Pki::new(dir, "etcd"),
        }
    }

    /// The CA of the service port's certificates, which clients trust.
    pub(crate) fn service_ca(&self) -> PathBuf {
        self.service.ca_path()
    }

    /// `node`'s TLS flags: its service certificate, its peer certificate
    /// (node to node, and to etcd) with the cluster's CA.
    fn node_flags(&self, node: &str, clustered: bool) -> Vec<String> {
        let service = self.service.issue(&format!("{node}-service"), &["127.0.0.1", "localhost"]);
        let mut flags =
            vec![("--tls-cert", service.cert.display().to_string()), ("--tls-key", service.key.display().to_string())];
        if clustered {
            let peer = self.cluster.issue(node, &["127.0.0.1", &format!("{node}.cluster")]);
            let (cert, key, ca) =
                (peer.cert.display().to_string(), peer.key.display().to_string(), self.cluster.ca_path());
            flags.extend([
                ("--peer-tls-cert", cert.clone()),
                ("--peer-tls-key", key.clone()),
                ("--peer-tls-ca", ca.display().to_string()),
                ("--etcd-ca", self.etcd.ca_path().display().to_string()),
                ("--etcd-cert", cert),
                ("--etcd-key", key),
            ]);
        }
        flags.into_iter().flat_map(|(flag, value)| [flag.to_owned(), value]).collect()
    }

    /// etcd over TLS, trusting the nodes' peer certificates.
    async fn etcd(&self) -> EtcdServer {
        let server = self.etcd.issue("etcd", &["127.0.0.1", "localhost"]);
        let harness = self.cluster.issue("roll", &["roll.cluster"]);
        let files = ClientTlsFiles::new(Some(self.etcd.ca_path()), Some(harness.cert), Some(harness.key));
        let client = Arc::new(ClientTls::load(files).expect("the roll's etcd client certificate"));
        EtcdServer::start_with_tls(EtcdServerTls {
            cert: server.cert,
            key: server.key,
            client_ca: self.cluster.ca_path(),
            client,
        })
        .await
    }
}

/// What every node of the roll shares.
pub(crate) struct Layout {
    /// Where data directories, logs and certificates go.
    pub(crate) dir: PathBuf,
    /// TLS material, with TLS on.
    pub(crate) certificates: Option<Certificates>,
    /// etcd, for a cluster.
    pub(crate) etcd: Option<EtcdServer>,
    /// The cluster's slots.
    pub(crate) slots: u32,
    /// The nodes' etcd lease TTL.
    pub(crate) lease_ttl_ms: u64,
    /// Extra `serve` flags for every node.
    pub(crate) extra: Vec<String>,
}

impl Layout {
    pub(crate) async fn new(
        dir: PathBuf,
        tls: bool,
        clustered: bool,
        slots: u32,
        lease_ttl_ms: u64,
        extra: Vec<String>,
    ) -> Layout {
        std::fs::create_dir_all(&dir).expect("create the roll's directory");
        let certificates = tls.then(|| Certificates::new(&dir.join("certs")));
        let etcd = match (clustered, &certificates) {
            (false, _) => None,
            (true, Some(certificates)) => Some(certificates.etcd().await),
            (true, None) => Some(EtcdServer::start().await),
        };
        Layout { dir, certificates, etcd, slots, lease_ttl_ms, extra }
    }

    /// `http://` or `https://`.
    pub(crate) fn scheme(&self) -> &'static str {
        if self.certificates.is_some() { "https://" } else { "http://" }
    }
}

/// One node: its fixed addresses and data directory, and its process now.
pub(crate) struct Node {
    pub(crate) id: String,
    /// `host:port` of the service port, the same across restarts.
    pub(crate) listen: String,
    /// `host:port` of the metrics port.
    pub(crate) metrics: String,
    /// Its `serve` flags, the same across restarts.
    args: Vec<String>,
    /// Its process now; `None` between a stop and a start.
    child: Option<(Child, ChildStdout)>,
    /// How many times it was started.
    starts: u32,
    logs: PathBuf,
    /// What its processes that exited last said of moves, summed.
    moves_before: MoveMetrics,
    /// What its process now last said of moves.
    moves_now: MoveMetrics,
}

impl Node {
    /// A node of `layout` named `id`, not started.
    pub(crate) fn new(layout: &Layout, id: &str) -> Node {
        let listen = format!("127.0.0.1:{}", free_port());
        let metrics = format!("127.0.0.1:{}", free_port());
        let data = layout.dir.join(id);
        std::fs::create_dir_all(&data).expect("create a data directory");
        let mut args: Vec<String> =
            ["serve", "--listen", &listen, "--metrics-listen", &metrics].into_iter().map(str::to_owned).collect();
        args.extend(["--data-dir".to_owned(), data.display().to_string()]);
        args.extend(["--service-token".to_owned(), TOKEN.to_owned()]);
        args.extend(["--default-visibility".to_owned(), "everyone".to_owned()]);
        if let Some(etcd) = &layout.etcd {
            for (flag, value) in [
                ("--etcd", etcd.endpoint.clone()),
                ("--node-id", id.to_owned()),
                ("--advertise", listen.clone()),
                ("--slots", layout.slots.to_string()),
                ("--etcd-prefix", "/roll/".to_owned()),
                ("--etcd-lease-ttl-ms", layout.lease_ttl_ms.to_string()),
                ("--cluster-settle-ms", "1000".to_owned()),
            ] {
                args.extend([flag.to_owned(), value]);
            }
        }
        if let Some(certificates) = &layout.certificates {
            args.extend(certificates.node_flags(id, layout.etcd.is_some()));
        }
        args.extend(layout.extra.iter().cloned());
        Node {
            id: id.to_owned(),
            listen,
            metrics,
            args,
            child: None,
            starts: 0,
            logs: layout.dir.clone(),
            moves_before: MoveMetrics::default(),
            moves_now: MoveMetrics::default(),
        }
    }

    /// The service port's URL.
    pub(crate) fn url(&self, layout: &Layout) -> String {
        format!("{}{}", layout.scheme(), self.listen)
    }

    /// Starts `binary` and waits for its listening line.
    pub(crate) async fn start(&mut self, binary: &Path) -> Result<(), String> {
        let log = self.logs.join(format!("{}.{}.log", self.id, self.starts));
        self.starts += 1;
        let stderr = std::fs::File::create(&log).map_err(|err| format!("create {}: {err}", log.display()))?;
        let mut child = Command::new(binary)
            .args(&self.args)
            .env("RUST_LOG", std::env::var("ROLL_NODE_LOG").unwrap_or_else(|_| "info".into()))
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .map_err(|err| format!("start {}: {err}", binary.display()))?;
        let mut stdout = BufReader::new(child.stdout.take().expect("piped stdout"));
        let mut line = String::new();
        let read = tokio::time::timeout(NODE_STEP_WITHIN, stdout.read_line(&mut line)).await;
        if !matches!(read, Ok(Ok(_))) || !line.starts_with("listening on ") {
            return Err(format!("{} printed {line:?} instead of its listening line (log: {})", self.id, log.display()));
        }
        self.child = Some((child, stdout.into_inner()));
        Ok(())
    }

    /// Reads what the process says of moves now (it is kept if it answers).
    pub(crate) async fn read_moves(&mut self, probe: &Probe) {
        if let Ok((200, page)) = probe.get(&self.metrics, "/metrics").await {
            self.moves_now = MoveMetrics::parse(&page);
        }
    }

    /// What every process of this node said of moves, the last one's as last read.
    pub(crate) fn moves(&self) -> MoveMetrics {
        let mut moves = self.moves_before.clone();
        moves.add(&self.moves_now);
        moves
    }

    /// SIGTERM, as an orchestrator stops a node, and waits for its exit,
    /// which must be clean; what it says of moves is read every 20 ms
    /// meanwhile, so that its drain's figures are kept.
    pub(crate) async fn stop(&mut self, probe: &Probe) -> Result<(), String> {
        let Some((mut child, _stdout)) = self.child.take() else { return Ok(()) };
        let pid = child.id().ok_or("the process is gone")?.to_string();
        self.read_moves(probe).await;
        let signalled = Command::new("kill").args(["-TERM", &pid]).status().await;
        if !signalled.is_ok_and(|status| status.success()) {
            return Err(format!("cannot send SIGTERM to {}", self.id));
        }
        let exited = async {
            let mut exit = std::pin::pin!(child.wait());
            loop {
                tokio::select! {
                    status = &mut exit => return status,
                    () = tokio::time::sleep(Duration::from_millis(20)) => self.read_moves(probe).await,
                }
            }
        };
        let exited = tokio::time::timeout(NODE_STEP_WITHIN, exited).await;
        let ended = std::mem::take(&mut self.moves_now);
        self.moves_before.add(&ended);
        match exited {
            Ok(Ok(status)) if status.success() => Ok(()),
            Ok(Ok(status)) => Err(format!("{} exited with {status} after SIGTERM", self.id)),
            Ok(Err(err)) => Err(format!("waiting for {}: {err}", self.id)),
            Err(_) => Err(format!("{} did not exit within {NODE_STEP_WITHIN:?} of SIGTERM", self.id)),
        }
    }

    /// Probes `/readyz` every 50 ms until it answers 200.
    pub(crate) async fn until_ready(&self, probe: &Probe) -> Result<(), String> {
        let deadline = Instant::now() + NODE_STEP_WITHIN;
        let mut last = String::new();
        while Instant::now() < deadline {
            match probe.get(&self.metrics, "/readyz").await {
                Ok((200, _)) => return Ok(()),
                Ok((_, body)) => last = body,
                Err(err) => last = err,
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        Err(format!("{} not ready within {NODE_STEP_WITHIN:?}; /readyz said:\n{last}", self.id))
    }
}

/// A free loopback port.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0").and_then(|listener| listener.local_addr()).expect("a free port").port()
}

/// Plain HTTP/1.1 GETs of the metrics port, over TLS trusting the service CA when TLS is on.
pub(crate) struct Probe {
    tls: Option<tokio_rustls::TlsConnector>,
}

impl Probe {
    pub(crate) fn new(service_ca: Option<&Path>) -> Probe {
        let tls = service_ca.map(|ca| {
            let files = ClientTlsFiles::new(Some(ca.to_owned()), None, None);
            let client = ClientTls::load(files).expect("the service CA");
            tokio_rustls::TlsConnector::from(client.config())
        });
        Probe { tls }
    }

    /// `GET path` at `addr`: the status code and the body.
    pub(crate) async fn get(&self, addr: &str, path: &str) -> Result<(u16, String), String> {
        let tcp = tokio::net::TcpStream::connect(addr).await.map_err(|err| format!("connect to {addr}: {err}"))?;
        let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
        let mut response = Vec::new();
        match &self.tls {
            None => {
                let mut stream = tcp;
                stream.write_all(request.as_bytes()).await.map_err(|err| err.to_string())?;
                stream.read_to_end(&mut response).await.map_err(|err| err.to_string())?;
            }
            Some(connector) => {
                let name = rustls::pki_types::ServerName::try_from("127.0.0.1").expect("an IP name");
                let mut stream = connector.connect(name, tcp).await.map_err(|err| format!("TLS: {err}"))?;
                stream.write_all(request.as_bytes()).await.map_err(|err| err.to_string())?;
                // A server that closes without close_notify still sent its answer.
                let _ = stream.read_to_end(&mut response).await;
            }
        }
        let response = String::from_utf8_lossy(&response);
        let status = response.split(' ').nth(1).and_then(|code| code.parse().ok()).ok_or("no status line")?;
        Ok((status, response.split_once("\r\n\r\n").map_or("", |(_, body)| body).to_owned()))
    }
}
