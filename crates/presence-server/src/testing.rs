//! A presenced server inside a test process (feature `testing`): started on a
//! free port or on the port of an earlier one, stopped gracefully, with the
//! deadline every awaited condition in a test runs against.
//!
//! The workspace's end-to-end tests and presence-client's tests both drive a
//! real server; this is the one harness they share.

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use presence_proto::v1::presence_client::PresenceClient;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

use crate::{ServeError, ServerConfig};

/// How long any awaited condition may take before the test fails: the one
/// deadline of the workspace's tests, defined beside the test etcd.
pub use presence_cluster::testing::PATIENCE;

/// Short TTLs (20 ms to 60 s, 300 ms by default) and no renewal throttle, so
/// that lease and expiry tests take a fraction of a second.
pub fn fast_config() -> ServerConfig {
    ServerConfig {
        store: presence_core::StoreConfig {
            shards: 8,
            min_ttl_ms: 20,
            default_ttl_ms: 300,
            max_ttl_ms: 60_000,
            min_renew_interval_ms: 0,
            ..presence_core::StoreConfig::default()
        },
        shutdown_grace: Duration::from_millis(500),
        ..ServerConfig::default()
    }
}

/// `future`'s output, or a test failure naming `what` after `patience`.
pub async fn within<T>(patience: Duration, what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(patience, future).await.unwrap_or_else(|_| panic!("timed out after {patience:?}: {what}"))
}

/// A running server and a way to stop it; dropping it stops the server too.
#[derive(Debug)]
pub struct TestServer {
    /// Where it listens.
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), ServeError>>>,
}

impl TestServer {
    /// A server on a free port of 127.0.0.1.
    pub async fn start(config: ServerConfig) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind a free port");
        Self::serve(listener, config)
    }

    /// A server on `addr`, the port of an earlier server (retried until the OS lets it go).
    pub async fn start_on(addr: SocketAddr, config: ServerConfig) -> Self {
        let listener = within(PATIENCE, &format!("rebind {addr}"), async {
            loop {
                match TcpListener::bind(addr).await {
                    Ok(listener) => return listener,
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        })
        .await;
        Self::serve(listener, config)
    }

    /// A server on a free port of 127.0.0.1, configured knowing that port
    /// (a cluster node advertises its address).
    pub async fn start_with(config: impl FnOnce(SocketAddr) -> ServerConfig) -> Self {
        Self::start_with_at(std::net::Ipv4Addr::LOCALHOST.into(), config).await
    }

    /// [`TestServer::start_with`] on a free port of `ip`.
    pub async fn start_with_at(ip: std::net::IpAddr, config: impl FnOnce(SocketAddr) -> ServerConfig) -> Self {
        let listener = TcpListener::bind((ip, 0)).await.expect("bind a free port");
        let addr = listener.local_addr().expect("a bound listener has an address");
        Self::serve(listener, config(addr))
    }

    fn serve(listener: TcpListener, config: ServerConfig) -> Self {
        let addr = listener.local_addr().expect("a bound listener has an address");
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(crate::serve(listener, config, async {
            let _ = stopped.await;
        }));
        TestServer { addr, stop: Some(stop), task: Some(task) }
    }

    /// `http://addr`, for clients that take a URL.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A new generated client connected to the server.
    pub async fn client(&self) -> PresenceClient<Channel> {
        PresenceClient::connect(self.url()).await.expect("connect to the test server")
    }

    /// Stops the server gracefully and waits for it to return.
    pub async fn stop(mut self) {
        let _ = self.stop.take().expect("stopped once").send(());
        let task = self.task.take().expect("stopped once");
        let served = tokio::time::timeout(PATIENCE, task).await;
        served.expect("server stops within the patience").expect("server task").expect("server returns Ok");
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}
