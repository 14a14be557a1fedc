//! `presenced cluster status`: a cluster's slot map and nodes, read from etcd
//! (where the cluster keeps them, docs/cluster.md), not from any node; and
//! `presenced cluster move`: a planned move, asked of the slot's owner.

use std::collections::BTreeMap;

use std::sync::Arc;
use std::time::Duration;

use presence_client::pb::{self, cluster_client::ClusterClient};
use presence_cluster::{Etcd, NodeSet, NodeSetWatch, SlotMap, SlotMapWatch, election_name};
use presence_tls::{ClientTls, ClientTlsFiles};
use serde_json::json;
use tonic::Request;

use crate::exit::{Exit, Failure};
use crate::output::{print, print_json};
use crate::text::Table;
use crate::{ClusterMoveArgs, ClusterStatusArgs, EtcdTarget};

/// What a cluster command reads from etcd.
pub(crate) struct Cluster {
    etcd: Etcd,
    pub(crate) prefix: String,
    pub(crate) map: Arc<SlotMap>,
    pub(crate) nodes: Arc<NodeSet>,
}

impl Cluster {
    pub(crate) async fn read(target: &EtcdTarget) -> Result<Cluster, Failure> {
        // As the nodes read --etcd-prefix.
        let mut prefix = target.etcd_prefix.clone();
        if !prefix.ends_with('/') {
            prefix.push('/');
        }
        let tls = match target.etcd.iter().any(|url| url.starts_with("https://")) {
            true => {
                let files =
                    ClientTlsFiles::new(target.etcd_ca.clone(), target.etcd_cert.clone(), target.etcd_key.clone())
                        .named(["--etcd-ca", "--etcd-cert", "--etcd-key"]);
                Some(Arc::new(ClientTls::load(files).map_err(|err| Failure::new(Exit::Usage, err.to_string()))?))
            }
            false => None,
        };
        let etcd = Etcd::connect_any(&target.etcd, tls.as_ref()).await.map_err(unreachable)?;
        let map = SlotMapWatch::start(&etcd, &prefix, target.slots).await.map_err(unreachable)?.current();
        let nodes = NodeSetWatch::start(&etcd, &prefix).await.map_err(unreachable)?.current();
        Ok(Cluster { etcd, prefix, map, nodes })
    }
}

fn unreachable(error: presence_cluster::Error) -> Failure {
    Failure::new(Exit::Unreachable, error.to_string())
}

/// How long a move may take: a slot's state is sent in milliseconds per
/// thousand sessions, but a node may be busy.
const MOVE_TIMEOUT: Duration = Duration::from_secs(120);

pub(crate) async fn move_slot(args: ClusterMoveArgs) -> Result<(), Failure> {
    let Cluster { map, nodes, .. } = Cluster::read(&args.etcd).await?;
    if args.slot >= map.slots() {
        return Err(Failure::new(
            Exit::Usage,
            format!("SLOT {}: the cluster has slots 0 to {}", args.slot, map.slots() - 1),
        ));
    }
    let Some(owner) = map.owner(args.slot) else {
        return Err(Failure::new(Exit::Failed, format!("slot {} has no owner yet: nothing to move", args.slot)));
    };
    if owner.node == args.node {
        return Err(Failure::new(Exit::Failed, format!("slot {} is owned by {} already", args.slot, args.node)));
    }
    if nodes.address(&args.node).is_none() {
        return Err(Failure::new(Exit::Failed, format!("node {} is not a live node of the cluster", args.node)));
    }
    let Some(address) = nodes.address(&owner.node) else {
        return Err(Failure::new(
            Exit::Unreachable,
            format!(
                "slot {}'s owner {} is not registered (dead or gone): the coordinator gives its slots away",
                args.slot, owner.node
            ),
        ));
    };
    let scheme = if args.tls.given() { "https" } else { "http" };
    let channel = args.tls.connect(&format!("{scheme}://{address}")).await?;
    let mut request = Request::new(pb::MoveSlotsRequest { slots: vec![args.slot], to_node: args.node.clone() });
    request.set_timeout(MOVE_TIMEOUT);
    if let Some(value) = args.token.authorization()? {
        request.metadata_mut().insert("authorization", value);
    }
    let moved =
        ClusterClient::new(channel).move_slots(request).await.map_err(|status| Failure::status(&status))?.into_inner();
    if args.json {
        print_json(&json!({
            "slot": args.slot,
            "from": owner.node,
            "to": args.node,
            "epoch": moved.epoch,
            "users": moved.users,
            "sessions": moved.sessions,
            "bytes": moved.bytes,
            "elapsed_ms": moved.elapsed_ms,
        }))?;
        return Ok(());
    }
    print(&format!(
        "slot {} moved from {} to {} at epoch {}: {} users, {} sessions, {} bytes of state, {} ms\n",
        args.slot, owner.node, args.node, moved.epoch, moved.users, moved.sessions, moved.bytes, moved.elapsed_ms
    ))?;
    Ok(())
}

pub(crate) async fn status(args: ClusterStatusArgs) -> Result<(), Failure> {
    let Cluster { etcd, prefix, map, nodes } = Cluster::read(&args.etcd).await?;
    let coordinator = etcd.leader(&election_name(&prefix)).await.map_err(unreachable)?;
    let coordinator = coordinator.map(|id| String::from_utf8_lossy(&id).into_owned());
    // Every registered node, and every owner named in the map (a dead one is no longer registered).
    let mut owned: BTreeMap<String, usize> = nodes.ids().into_iter().map(|id| (id, 0)).collect();
    let mut unowned = 0;
    for slot in 0..map.slots() {
        match map.owner(slot) {
            Some(owner) => *owned.entry(owner.node.clone()).or_default() += 1,
            None => unowned += 1,
        }
    }
    if args.json {
        let nodes: Vec<_> = owned
            .iter()
            .map(|(id, slots)| json!({ "id": id, "address": nodes.address(id), "live": nodes.address(id).is_some(), "slots": slots }))
            .collect();
        let status = json!({
            "slots": map.slots(),
            "unowned": unowned,
            "coordinator": coordinator,
            "revision": map.revision(),
            "nodes": nodes,
        });
        print_json(&status)?;
        return Ok(());
    }
    let mut table = Table::new(&["NODE", "ADDRESS", "SLOTS"]);
    for (id, slots) in &owned {
        let address = nodes.address(id).map_or_else(|| "- (not registered: dead or gone)".to_owned(), str::to_owned);
        table.row(vec![id.clone(), address, slots.to_string()]);
    }
    let coordinator = coordinator.as_deref().unwrap_or("none");
    let summary = format!(
        "{} slots, {unowned} without an owner; coordinator: {coordinator}; etcd revision {}\n",
        map.slots(),
        map.revision()
    );
    print(&format!("{}{summary}", table.render()))?;
    Ok(())
}
