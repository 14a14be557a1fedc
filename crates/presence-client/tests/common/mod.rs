//! A presenced server inside the test process, restartable on the same port,
//! and helpers that await conditions with a deadline.

#![allow(dead_code, unreachable_pub)]

use std::future::Future;
use std::net::SocketAddr;
use std::time::Duration;

use presence_client::pb;
use presence_core::StoreConfig;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::ServerConfig;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Channel;

/// How long any awaited condition may take before the test fails.
pub const PATIENCE: Duration = Duration::from_secs(10);

/// Short TTLs and no server-side throttle, so that lease tests take a fraction of a second.
pub fn fast_config() -> ServerConfig {
    ServerConfig {
        store: StoreConfig {
            shards: 8,
            min_ttl_ms: 20,
            default_ttl_ms: 300,
            max_ttl_ms: 60_000,
            min_renew_interval_ms: 0,
        },
        shutdown_grace: Duration::from_millis(300),
        ..ServerConfig::default()
    }
}

/// A running server and a way to stop it.
pub struct TestServer {
    pub addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), presence_server::ServeError>>>,
}

impl TestServer {
    /// A server on a free port.
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

    fn serve(listener: TcpListener, config: ServerConfig) -> Self {
        let addr = listener.local_addr().unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(presence_server::serve(listener, config, async {
            let _ = stopped.await;
        }));
        TestServer { addr, stop: Some(stop), task: Some(task) }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub async fn client(&self) -> PresenceClient<Channel> {
        PresenceClient::connect(self.url()).await.expect("connect to the test server")
    }

    /// Stops the server gracefully and waits for it to return.
    pub async fn stop(mut self) {
        let _ = self.stop.take().unwrap().send(());
        let served = tokio::time::timeout(PATIENCE, self.task.take().unwrap()).await;
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

/// `future`'s output, or a test failure naming `what` after `patience`.
pub async fn within<T>(patience: Duration, what: &str, future: impl Future<Output = T>) -> T {
    tokio::time::timeout(patience, future).await.unwrap_or_else(|_| panic!("timed out after {patience:?}: {what}"))
}

pub fn register(user: &str, session: &str, ttl_ms: u32) -> pb::RegisterRequest {
    pb::RegisterRequest {
        user_id: user.into(),
        session_id: session.into(),
        gateway_id: "gw-test".into(),
        ttl_ms,
        ..Default::default()
    }
}

pub fn renew(user: &str, session: &str, generation: u64, ttl_ms: u32) -> pb::RenewRequest {
    pb::RenewRequest { user_id: user.into(), session_id: session.into(), generation, ttl_ms, ..Default::default() }
}

pub fn unregister(user: &str, session: &str, generation: u64) -> pb::UnregisterRequest {
    pb::UnregisterRequest { user_id: user.into(), session_id: session.into(), generation, ..Default::default() }
}

pub fn state_of(presence: &pb::UserPresence) -> pb::State {
    pb::State::try_from(presence.state).expect("a known state")
}

pub async fn snapshot(client: &mut PresenceClient<Channel>, users: &[String]) -> Vec<pb::UserPresence> {
    let request = pb::SnapshotRequest { user_ids: users.to_vec(), ..Default::default() };
    client.snapshot(request).await.expect("snapshot").into_inner().users
}

pub async fn state_now(client: &mut PresenceClient<Channel>, user: &str) -> pb::State {
    state_of(&snapshot(client, &[user.to_owned()]).await[0])
}
