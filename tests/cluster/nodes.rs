//! A cluster of presenced nodes in this process, on loopback, joined
//! through one etcd the test starts (`etcd` from PATH or
//! `PRESENCED_ETCD_BIN`; `.ci/install-etcd`).

use std::net::SocketAddr;
use std::time::Duration;

use presence_cluster::testing::EtcdServer;
use presence_cluster::{Etcd, SlotMap, SlotMapWatch};
use presence_server::testing::{TestServer, fast_config};
use presence_server::{ClusterConfig, ServerConfig};
use tokio::time::Instant;

use crate::common::{PATIENCE, daemon};

pub(crate) const SLOTS: u32 = 64;
pub(crate) const PREFIX: &str = "/test/";

pub(crate) fn node_config(etcd: &EtcdServer, node: &str, addr: SocketAddr) -> ServerConfig {
    node_config_with(etcd, node, addr, fast_config())
}

pub(crate) fn node_config_with(etcd: &EtcdServer, node: &str, addr: SocketAddr, base: ServerConfig) -> ServerConfig {
    log_in_process_nodes();
    let mut cluster = ClusterConfig::new(vec![etcd.endpoint.clone()], node, addr.to_string());
    cluster.slots = SLOTS;
    cluster.prefix = PREFIX.to_owned();
    cluster.lease_ttl = Duration::from_secs(2);
    cluster.settle = Duration::from_millis(500);
    ServerConfig { cluster: Some(cluster), ..base }
}

/// With `PRESENCED_TEST_LOG` set (a `RUST_LOG` filter, as the node
/// processes take it), the nodes in the test's own process log to its
/// standard error too: a cluster test's failure then shows what its
/// coordinator decided, and when.
fn log_in_process_nodes() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    let Ok(filter) = std::env::var("PRESENCED_TEST_LOG") else { return };
    ONCE.call_once(|| {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_writer(std::io::stderr)
            .try_init();
    });
}

/// The `presenced serve` flags of `node` as a process of its own, reached at
/// `advertise`, with the settings [`node_config`] gives a node in the test.
pub(crate) fn node_process_args(etcd: &EtcdServer, node: &str, advertise: &str) -> Vec<String> {
    let slots = SLOTS.to_string();
    let flags = [("--etcd", etcd.endpoint.as_str()), ("--node-id", node), ("--advertise", advertise)];
    let settings = [
        ("--slots", slots.as_str()),
        ("--etcd-prefix", PREFIX),
        ("--etcd-lease-ttl-ms", "2000"),
        ("--cluster-settle-ms", "500"),
    ];
    flags.into_iter().chain(settings).flat_map(|(flag, value)| [flag.to_owned(), value.to_owned()]).collect()
}

/// node-a as a `presenced` process of its own (for a `kill -9`), node-b and
/// node-c in this process, each holding what it takes over for
/// `restart_grace`, and the slot map once every node owns slots.
pub(crate) async fn node_a_apart(
    etcd: &EtcdServer,
    restart_grace: Duration,
) -> (daemon::Daemon, Vec<TestServer>, SlotMap) {
    let advertise = format!("127.0.0.1:{}", daemon::free_port());
    let args = node_process_args(etcd, "node-a", &advertise);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node_a = daemon::Daemon::start_on(&advertise, &args, &[], None);
    let mut servers = Vec::new();
    for node in &NODES[1..] {
        tokio::time::sleep(node_stagger()).await;
        let held = ServerConfig { restart_grace: Some(restart_grace), ..fast_config() };
        servers.push(TestServer::start_with(|addr| node_config_with(etcd, node, addr, held)).await);
    }
    let map = map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    (node_a, servers, map)
}

/// Waits until every slot has an owner and the map is as `done` wants it.
pub(crate) async fn map_where(etcd: &Etcd, what: &str, done: impl Fn(&SlotMap) -> bool) -> SlotMap {
    let watch = SlotMapWatch::start(etcd, PREFIX, SLOTS).await.unwrap();
    let deadline = Instant::now() + PATIENCE;
    loop {
        let map = watch.current();
        if (0..SLOTS).all(|slot| map.owner(slot).is_some()) && done(&map) {
            return (*map).clone();
        }
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}: {map:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

pub(crate) const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// The wait between two nodes' starts: `PRESENCED_TEST_NODE_STAGGER_MS`, else none.
pub(crate) fn node_stagger() -> Duration {
    let ms = std::env::var("PRESENCED_TEST_NODE_STAGGER_MS").ok().and_then(|ms| ms.parse().ok()).unwrap_or(0);
    Duration::from_millis(ms)
}

/// Three nodes started together, and the slot map once they share the slots
/// (the coordinator of a new cluster waits for the nodes starting with it).
pub(crate) async fn three_nodes(etcd: &EtcdServer) -> (Vec<TestServer>, SlotMap) {
    three_nodes_with(etcd, fast_config, true).await
}

/// [`three_nodes`] on `base`'s settings, evening the slots out by themselves if `rebalance`.
pub(crate) async fn three_nodes_with(
    etcd: &EtcdServer,
    base: fn() -> ServerConfig,
    rebalance: bool,
) -> (Vec<TestServer>, SlotMap) {
    let mut servers = Vec::new();
    for (started, node) in NODES.into_iter().enumerate() {
        // PRESENCED_TEST_NODE_STAGGER_MS starts each node that long after
        // the one before, to shake out races of nodes joining at different
        // moments (the default starts them back to back). Keep it under the
        // settle window (500 ms): a node later than that is given no slots
        // where the test turned rebalancing off, as the test then reports.
        if started > 0 {
            tokio::time::sleep(node_stagger()).await;
        }
        servers.push(
            TestServer::start_with(|addr| {
                let mut config = node_config_with(etcd, node, addr, base());
                config.cluster.as_mut().expect("a cluster node").rebalance = rebalance;
                config
            })
            .await,
        );
    }
    let map = map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    (servers, map)
}
