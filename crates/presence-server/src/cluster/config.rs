//! How a node joins its cluster (`serve --etcd ...`): the settings, checked
//! before the server starts (B7), and why joining can fail.

use std::sync::Arc;
use std::time::Duration;

use presence_tls::{ClientTls, ClientTlsFiles};

/// How to join a cluster: `serve --etcd ... --node-id ... --advertise ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// etcd's client URLs; the first one that answers is used.
    pub etcd: Vec<String>,
    /// This node's name, unique in the cluster.
    pub node_id: String,
    /// Where clients reach this node (host:port), as `NotOwner` names it.
    pub advertise: String,
    /// The cluster's slot count, the same on every node for its whole life.
    pub slots: u32,
    /// The keys' prefix in etcd, so that clusters can share one etcd.
    pub prefix: String,
    /// The TTL of this node's etcd lease: how long after its last confirmed
    /// keep-alive a dead or cut-off node's slots are given to others.
    pub lease_ttl: Duration,
    /// How long a new cluster waits for no more nodes to join before giving
    /// out its slots.
    pub settle: Duration,
    /// How long past its lease this node may act riding out an etcd outage
    /// that every node it knows is in too; and how long the coordinator
    /// waits, after a node's registration is gone, before it gives away the
    /// slots of a node it cannot reach (C6). The same on every node.
    pub ride_out: Duration,
    /// Whether this node, while it coordinates, evens the slots out between
    /// the live nodes by planned moves (`rebalance`).
    pub rebalance: bool,
    /// How long a move out of this node may keep its slots frozen for the
    /// target to take the last changes (C7) before it gives the freeze up
    /// and answers them here again. At most `HOLD_THROUGH_FREEZE` (250 ms),
    /// so that requests held meanwhile are answered; not a flag (0 gives
    /// every freeze up, which only a test wants).
    pub move_freeze_bound: Duration,
    /// Whether this node answers `Cluster/Relay` (E5). False answers it
    /// `UNIMPLEMENTED`, as a node of a build from before the relay does, so
    /// that the other nodes fall back to a watch per viewer: for the test of
    /// that fallback, not a flag.
    pub serves_relay: bool,
    /// What this node presents to the other nodes when it calls them of its
    /// own accord (handing its slots over as it drains): one of the service
    /// tokens every node accepts. `None` when the cluster runs open.
    pub peer_token: Option<String>,
    /// Node-to-node TLS, as this node dials the others: the cluster's CA,
    /// which their certificates must come from, and the certificate this
    /// node shows them. With it, nodes dial each other over `https://`,
    /// verifying each other's advertised names, and accept `Cluster` calls
    /// only from a certificate of the cluster's CA (T2).
    pub peer_tls: Option<ClientTlsFiles>,
    /// TLS to etcd (`https://` endpoints): its CA, and a client certificate
    /// for etcd's `--client-cert-auth`.
    pub etcd_tls: Option<ClientTlsFiles>,
}

impl ClusterConfig {
    /// The defaults for joining through `etcd` as `node_id`, reached at `advertise`.
    pub fn new(etcd: Vec<String>, node_id: impl Into<String>, advertise: impl Into<String>) -> Self {
        ClusterConfig {
            etcd,
            node_id: node_id.into(),
            advertise: advertise.into(),
            slots: DEFAULT_SLOTS,
            prefix: "/presenced/".to_owned(),
            lease_ttl: Duration::from_secs(5),
            settle: Duration::from_secs(2),
            ride_out: DEFAULT_RIDE_OUT,
            rebalance: true,
            move_freeze_bound: FREEZE_BOUND,
            serves_relay: true,
            peer_token: None,
            peer_tls: None,
            etcd_tls: None,
        }
    }

    /// Refuses a configuration no cluster could run with.
    pub(crate) fn validate(&self) -> Result<(), Refused> {
        let refuse = |setting, reason| Err(Refused::Setting { setting, reason });
        if self.etcd.is_empty() {
            return refuse("cluster.etcd", "needs at least one etcd URL");
        }
        if self.node_id.is_empty() || self.node_id.len() > 128 || self.node_id.contains('/') {
            return refuse("cluster.node_id", "must be 1 to 128 bytes without '/'");
        }
        if self.advertise.is_empty() {
            return refuse("cluster.advertise", "must be the host:port clients reach this node at");
        }
        if !(1..=MAX_SLOTS).contains(&self.slots) {
            return refuse("cluster.slots", "must be between 1 and 65536");
        }
        if self.lease_ttl < Duration::from_secs(2) {
            return refuse("cluster.lease_ttl", "must be at least 2 s (etcd counts whole seconds, less a margin)");
        }
        if self.move_freeze_bound > crate::node::placement::HOLD_THROUGH_FREEZE {
            return refuse(
                "cluster.move_freeze_bound",
                "must be at most 250 ms, the time requests wait through a freeze",
            );
        }
        // Read now, so that a bad file refuses the start (B7); `join` reads them again.
        self.client_tls()?;
        Ok(())
    }

    /// The peer and etcd client TLS material, read and checked.
    pub(crate) fn client_tls(&self) -> Result<ClusterTls, presence_tls::TlsError> {
        let load = |files: &Option<ClientTlsFiles>| {
            files.clone().map(ClientTls::load).transpose().map(|tls| tls.map(Arc::new))
        };
        Ok(ClusterTls { peer: load(&self.peer_tls)?, etcd: load(&self.etcd_tls)? })
    }
}

/// Why a cluster configuration refuses the start (B7); the server's start-up
/// error (`ServeError`) takes it in with the same words.
#[derive(Debug)]
pub(crate) enum Refused {
    /// A setting out of its range: the `ClusterConfig` field, and what is wrong.
    Setting { setting: &'static str, reason: &'static str },
    /// TLS material that cannot be read or used.
    Tls(presence_tls::TlsError),
}

impl From<presence_tls::TlsError> for Refused {
    fn from(err: presence_tls::TlsError) -> Self {
        Refused::Tls(err)
    }
}

/// A node's client TLS material: to the other nodes, and to etcd.
#[derive(Debug)]
pub(crate) struct ClusterTls {
    pub(crate) peer: Option<Arc<ClientTls>>,
    pub(crate) etcd: Option<Arc<ClientTls>>,
}

/// The most slots a cluster may have: the slot map is read whole.
pub const MAX_SLOTS: u32 = 65_536;

/// `--slots`' default.
pub const DEFAULT_SLOTS: u32 = 1024;

/// How long a freeze may last before the target has taken the last changes
/// (`ClusterConfig::move_freeze_bound`'s default): past it the freeze is
/// given up and the slots are answered here again. Below
/// `HOLD_THROUGH_FREEZE`, so that the requests held meanwhile are answered.
pub(crate) const FREEZE_BOUND: Duration = Duration::from_millis(200);

/// `--etcd-ride-out-ms`' default: an etcd outage of up to this long past
/// the lease is ridden out; a node that dies unreachable (not refusing
/// connections) is taken over this long after its lease expires.
pub(crate) const DEFAULT_RIDE_OUT: Duration = Duration::from_secs(10);

/// Why a node could not join its cluster.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// No etcd endpoint answered.
    #[error("no etcd endpoint of {endpoints:?} could be reached: {last}")]
    Unreachable {
        /// The endpoints tried.
        endpoints: Vec<String>,
        /// The last one's error.
        last: presence_cluster::Error,
    },
    /// The credential for calls to the other nodes cannot be sent.
    #[error("joining the cluster: {0}")]
    Token(&'static str),
    /// etcd refused a step of joining.
    #[error("joining the cluster through etcd: {0}")]
    Etcd(#[from] presence_cluster::Error),
    /// The node-to-node or etcd TLS material cannot be used.
    #[error("joining the cluster: {0}")]
    Tls(String),
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ServeError;
    use crate::node::placement::HOLD_THROUGH_FREEZE;

    fn validate(config: &ClusterConfig) -> Result<(), ServeError> {
        config.validate().map_err(ServeError::from)
    }

    /// Makes a good configuration bad in one setting.
    type Spoil = fn(&mut ClusterConfig);

    fn config() -> ClusterConfig {
        ClusterConfig::new(vec!["http://127.0.0.1:2379".into()], "node-a", "127.0.0.1:4000")
    }

    /// B7: a cluster setting no cluster could run with refuses the start,
    /// naming the setting; each bound itself is allowed.
    #[test]
    fn b7_a_setting_no_cluster_could_run_with_refuses_the_start_naming_it() {
        config().validate().expect("the defaults run");
        let spoiled: [(&str, Spoil); 9] = [
            ("cluster.etcd", |c| c.etcd.clear()),
            ("cluster.node_id", |c| c.node_id.clear()),
            ("cluster.node_id", |c| c.node_id = "a/b".into()),
            ("cluster.node_id", |c| c.node_id = "n".repeat(129)),
            ("cluster.advertise", |c| c.advertise.clear()),
            ("cluster.slots", |c| c.slots = 0),
            ("cluster.slots", |c| c.slots = MAX_SLOTS + 1),
            ("cluster.lease_ttl", |c| c.lease_ttl = Duration::from_millis(1_999)),
            ("cluster.move_freeze_bound", |c| c.move_freeze_bound = HOLD_THROUGH_FREEZE + Duration::from_millis(1)),
        ];
        for (setting, spoil) in spoiled {
            let mut config = config();
            spoil(&mut config);
            match validate(&config) {
                Err(ServeError::Setting { setting: named, .. }) => assert_eq!(named, setting),
                other => panic!("{setting} spoiled: {other:?}"),
            }
        }
        let mut at_the_bounds = config();
        at_the_bounds.node_id = "n".repeat(128);
        at_the_bounds.slots = MAX_SLOTS;
        at_the_bounds.lease_ttl = Duration::from_secs(2);
        at_the_bounds.move_freeze_bound = HOLD_THROUGH_FREEZE;
        at_the_bounds.validate().expect("each bound is allowed");
    }

    /// B7: node-to-node TLS that cannot be read refuses the start, naming
    /// its flag, rather than the join after the server is up.
    #[test]
    fn b7_peer_tls_that_cannot_be_read_refuses_the_start_naming_its_flag() {
        let mut config = config();
        config.peer_tls = Some(ClientTlsFiles {
            ca: Some("/nonexistent/peer-ca.pem".into()),
            cert: None,
            key: None,
            flags: ["--peer-ca", "--peer-cert", "--peer-key"],
            as_cluster_node: true,
        });
        let refused = validate(&config).expect_err("no such file");
        assert!(matches!(refused, ServeError::Tls(_)), "{refused:?}");
        assert!(refused.to_string().contains("--peer-ca"), "{refused}");
    }
}
