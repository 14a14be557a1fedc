//! The cluster: the nodes that share the slots through etcd, and what each does for the others.
//! It may name `node/`, plugging into it through [`crate::node::placement`]; it names nothing in `api/`.
//!
//! Everything that runs only with `--etcd`: membership and slot ownership,
//! forwarding to owners, the node-to-node `Cluster` service and its wire
//! conversions and protocol version, planned moves, followers' copies, etcd outages, rebalancing,
//! rooms and groups across nodes, and the connections between nodes.

pub(crate) mod config;
pub(crate) mod erase;
pub(crate) mod fanin;
pub(crate) mod feed;
pub(crate) mod forward;
pub(crate) mod group_sync;
pub(crate) mod handover;
pub(crate) mod membership;
pub(crate) mod outage;
pub(crate) mod peers;
pub(crate) mod protocol;
pub(crate) mod rebalance;
pub(crate) mod relay;
pub(crate) mod replica;
pub(crate) mod room_sync;
pub(crate) mod service;
pub(crate) mod taking;
pub(crate) mod wire;

use std::sync::Arc;

use futures_util::future::BoxFuture;
use hashbrown::HashMap;
use presence_core::{CompactString, Store};
use presence_proto::v1 as pb;
use tonic::metadata::{Ascii, MetadataValue};

use crate::error::ServiceError;
use crate::node::context::Context;
use crate::node::placement::{Acting, Placement};
use crate::node::privacy::Privacy;

/// This node's part in its cluster: what every cluster task and the
/// `Cluster` service are given, and the node's [`Placement`].
#[derive(Debug)]
pub(crate) struct ClusterNode {
    /// Membership, slot ownership and the connections to the other nodes.
    pub(crate) membership: membership::Membership,
    /// The copies of the slots this node follows (C4).
    pub(crate) replica: replica::Replica,
    /// Where this node sends each room's facts, and which of its room slots
    /// it is rebuilding (`room_sync.rs`).
    pub(crate) room_routes: room_sync::RoomRoutes,
    /// The moves bringing slots here, while their copies are kept aside (C7).
    pub(crate) arrivals: taking::Arrivals,
    /// Other nodes' users relayed to this node's viewers, each once (`relay.rs`).
    pub(crate) relay: relay::Relay,
}

impl ClusterNode {
    /// A cluster node of `membership` keeping `replica`.
    pub(crate) fn new(membership: membership::Membership, replica: replica::Replica) -> Self {
        ClusterNode {
            membership,
            replica,
            room_routes: room_sync::RoomRoutes::default(),
            arrivals: taking::Arrivals::default(),
            relay: relay::Relay::default(),
        }
    }
}

impl Placement for ClusterNode {
    fn acting(&self) -> Acting<'_> {
        Acting::Some(Box::new(self.membership.view()))
    }

    fn durable_gate(&self) -> Option<&tokio::sync::RwLock<()>> {
        Some(self.membership.durable_gate())
    }

    fn freeze_over<'a>(&'a self, slots: Vec<u32>, deadline: tokio::time::Instant) -> BoxFuture<'a, bool> {
        Box::pin(async move { self.membership.freeze_over(&slots, deadline).await })
    }

    fn forward_leases<'a>(
        &'a self,
        address: &'a str,
        batch: pb::LeaseBatch,
        authorization: Option<MetadataValue<Ascii>>,
    ) -> BoxFuture<'a, Result<pb::LeaseResults, ServiceError>> {
        Box::pin(self.membership.forward_leases(address, batch, authorization))
    }

    fn room_here(&self, room_id: &str) -> Result<(), ServiceError> {
        room_sync::place_of(self, room_id, true).map(drop)
    }

    fn room_version<'a>(
        &'a self,
        store: &'a Store,
        room_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<u64>, ServiceError>> {
        Box::pin(room_sync::room_version(store, self, room_id))
    }

    fn may_view<'a>(
        &'a self,
        privacy: &'a Privacy,
        viewer: &'a str,
        users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<HashMap<CompactString, bool>, ServiceError>> {
        Box::pin(room_sync::may_view(privacy, self, viewer, users))
    }

    fn room_counts(&self, store: &Store, _privacy: &Privacy, room_id: &str) -> (u64, u32, u32) {
        // The members' own nodes marked those they hold invisible (R4).
        store.room_visible_tally(room_id)
    }

    fn counts_elsewhere<'a>(
        &'a self,
        viewer: Option<&'a str>,
        rooms: Vec<CompactString>,
    ) -> BoxFuture<'a, Vec<Option<pb::RoomCount>>> {
        Box::pin(room_sync::counts_elsewhere(self, viewer, rooms))
    }
}

/// Starts what runs only on a cluster node: copies to and from followers,
/// riding out etcd outages, joining again after a lost lease, rebalancing
/// (when enabled), group catch-up, and rooms at their owners (facts leave
/// the store for them from now on).
pub(crate) fn start(context: &Arc<Context>, cluster: &Arc<ClusterNode>) {
    let (c, n) = (context, cluster);
    tokio::spawn(replica::send_to_followers(Arc::clone(c), Arc::clone(n)));
    tokio::spawn(replica::act_on_the_map(Arc::clone(c), Arc::clone(n)));
    tokio::spawn(outage::ride_out(Arc::clone(c), Arc::clone(n)));
    tokio::spawn(membership::join_again_when_lost(Arc::clone(c), Arc::clone(n)));
    if cluster.membership.rebalance {
        tokio::spawn(rebalance::rebalance(Arc::clone(c), Arc::clone(n)));
    }
    tokio::spawn(group_sync::catch_up(Arc::clone(c), Arc::clone(n)));
    context.store().send_room_facts_out();
    let queue = room_sync::start(context, cluster);
    context.publisher.install_room_facts(queue);
    tokio::spawn(room_sync::rebuild_rooms(Arc::clone(c), Arc::clone(n)));
    tokio::spawn(room_sync::forget_gone_nodes(Arc::clone(c), Arc::clone(n)));
}

#[cfg(test)]
mod tests {
    use crate::node::tests::{lines_naming, rust_files_under, source_folder};

    /// `api → cluster`, one way: a file under `cluster/` or any of its
    /// sub-folders with a crate path into the api folder (or one climbing
    /// out of `cluster` by `super`s into it) fails here, naming the file and
    /// line. (The path is spelled in pieces so that this file does not name
    /// it.)
    #[test]
    fn cluster_names_nothing_of_the_api() {
        let dir = source_folder("cluster");
        let files = rust_files_under(&dir);
        assert!(files.len() > 10, "the cluster's files are read from {}", dir.display());
        let named = lines_naming(&dir, &files, &[concat!("crate::", "api")], &["::api"]);
        assert!(named.is_empty(), "cluster/ names what builds on it:\n{}", named.join("\n"));
    }
}
