//! Readiness (D2): what `/readyz` on the metrics port answers, so that an
//! orchestrator sends traffic to a node, and moves on to the next node of a
//! rolling upgrade, only once the node can carry its part.
//!
//! A node is ready when every check passes:
//!
//! | check | passes when |
//! |---|---|
//! | `started` | the checkpoint and durable data are loaded and the service port answers calls |
//! | `not-draining` | no shutdown has begun (SIGTERM turns it first, before anything is refused or handed over) |
//! | `slot-map` | (cluster) etcd has confirmed this node's lease and its map holds every change made before its registration |
//! | `share` | (cluster, rebalancing on) it owns at least its even share of the slots less the rebalancer's slack |
//! | `rooms` | (cluster) no room slot it gained is still being rebuilt from the other nodes' scans |
//!
//! Liveness (`/livez`) is only that the process answers: a node that is not
//! ready (restoring a large checkpoint, draining) is alive, and restarting
//! it would only make things worse.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};

use crate::cluster::ClusterNode;

/// The shared state behind `/readyz`: written by `serve` as the server
/// starts and stops, read by the metrics port on each probe.
#[derive(Debug, Default)]
pub(crate) struct Readiness {
    /// Set once the restore is done and the service's routes are up.
    started: AtomicBool,
    /// Set when the shutdown begins, before the drain and any refusal.
    stopping: AtomicBool,
    /// This node's part in its cluster, once it has joined one.
    cluster: OnceLock<Arc<ClusterNode>>,
}

/// One readiness check: its name and, when it fails, why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Check {
    /// The check's name, as `/readyz` lists it.
    pub(crate) name: &'static str,
    /// Why it fails; `None` when it passes.
    pub(crate) failure: Option<String>,
}

impl Readiness {
    /// Notes that the server is restored and serving.
    pub(crate) fn started(&self, cluster: Option<&Arc<ClusterNode>>) {
        if let Some(cluster) = cluster {
            let _ = self.cluster.set(Arc::clone(cluster));
        }
        self.started.store(true, Ordering::Release);
    }

    /// Notes that the shutdown has begun: from now on the node is not ready.
    pub(crate) fn stopping(&self) {
        self.stopping.store(true, Ordering::Release);
    }

    /// Every check, in the order `/readyz` lists them.
    pub(crate) fn checks(&self) -> Vec<Check> {
        let check = |name, failure: Option<String>| Check { name, failure };
        let mut checks = vec![
            check(
                "started",
                (!self.started.load(Ordering::Acquire))
                    .then(|| "restoring the checkpoint and durable data, or not yet serving".to_owned()),
            ),
            check("not-draining", self.stopping.load(Ordering::Acquire).then(|| "shutting down".to_owned())),
        ];
        if let Some(cluster) = self.cluster.get() {
            checks.extend(cluster_checks(cluster));
        }
        checks
    }

    /// The body of `/readyz`: a line per check (`[+]name ok` or `[-]name
    /// failed: why`), then `ready` or `not ready`, as Kubernetes' own
    /// components list theirs.
    pub(crate) fn report(&self) -> (bool, String) {
        let checks = self.checks();
        let mut body = String::new();
        for check in &checks {
            match &check.failure {
                None => writeln!(body, "[+]{} ok", check.name),
                Some(why) => writeln!(body, "[-]{} failed: {why}", check.name),
            }
            .expect("writing to a String");
        }
        let ready = checks.iter().all(|check| check.failure.is_none());
        body.push_str(if ready { "ready\n" } else { "not ready\n" });
        (ready, body)
    }
}

/// The checks only a cluster node has.
fn cluster_checks(cluster: &ClusterNode) -> Vec<Check> {
    let membership = &cluster.membership;
    let slot_map = (!membership.acting_now()).then(|| {
        if membership.lease_lost() {
            "etcd let this node's lease go; joining the cluster again".to_owned()
        } else {
            "etcd has not confirmed this node's lease, or its slot map is not current yet".to_owned()
        }
    });
    let share = membership.rebalance.then(|| share_failure(cluster)).flatten();
    let rebuilding = cluster.room_routes.rebuilding_slots();
    let rooms = (rebuilding > 0).then(|| format!("rebuilding the rooms of {rebuilding} room slots"));
    vec![
        Check { name: "slot-map", failure: slot_map },
        Check { name: "share", failure: share },
        Check { name: "rooms", failure: rooms },
    ]
}

/// Why this node does not hold its share of the slots yet, if it does not:
/// it owns fewer than the even share less the slack the rebalancer leaves
/// ([`presence_cluster::even_share`]), so moves to it are still due.
fn share_failure(cluster: &ClusterNode) -> Option<String> {
    let membership = &cluster.membership;
    let map = membership.map();
    let live = membership.live_ids();
    let (share, slack) = presence_cluster::even_share(map.slots(), live.len());
    let owned = map.owned_by(membership.node()).count();
    (owned + slack < share.max(1))
        .then(|| format!("owns {owned} of {} slots; its share among {} live nodes is {share}", map.slots(), live.len()))
}

/// The body of `/livez`: the process answers.
pub(crate) const ALIVE: &str = "ok\n";
