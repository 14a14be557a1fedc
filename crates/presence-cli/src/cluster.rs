//! `presenced cluster status`: a cluster's slot map and nodes, read from etcd
//! (where the cluster keeps them, docs/cluster.md), not from any node.

use std::collections::BTreeMap;

use presence_cluster::{Etcd, NodeSetWatch, SlotMapWatch, election_name};
use serde_json::json;

use crate::ClusterStatusArgs;
use crate::exit::{Exit, Failure};
use crate::output::{print, print_json};
use crate::text::Table;

pub(crate) async fn status(mut args: ClusterStatusArgs) -> Result<(), Failure> {
    // As the nodes read --etcd-prefix.
    if !args.etcd_prefix.ends_with('/') {
        args.etcd_prefix.push('/');
    }
    let refused = |error: presence_cluster::Error| Failure::new(Exit::Unreachable, error.to_string());
    let etcd = Etcd::connect_any(&args.etcd).await.map_err(refused)?;
    let map = SlotMapWatch::start(&etcd, &args.etcd_prefix, args.slots).await.map_err(refused)?.current();
    let nodes = NodeSetWatch::start(&etcd, &args.etcd_prefix).await.map_err(refused)?.current();
    let coordinator = etcd.leader(&election_name(&args.etcd_prefix)).await.map_err(refused)?;
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
