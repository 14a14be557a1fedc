//! The gRPC `presence.v1.Cluster` service: what one node asks of another.
//!
//! Each call is checked here (a service caller; a cluster node for the calls
//! only nodes make) and handed to the module that owns its idea: planned
//! moves to `handover`, followers' copies to `replica`, the outage question
//! to `outage`, groups to `privacy` and `group_sync`, rooms to `room_sync`,
//! what a node holds of another's user (P7) to `erase`.

use std::sync::Arc;

use presence_proto::v1::{self as pb, cluster_server::Cluster};
use tonic::{Request, Response, Status, Streaming};

use crate::audit::Audit;
use crate::auth::{Authenticator, ConnectionInfo, Scope};
use crate::cluster::ClusterNode;
use crate::cluster::handover::{move_slots, off_the_runtime};
use crate::cluster::membership::slot_set;
use crate::cluster::taking::take_slots;
use crate::cluster::wire as cluster_wire;
use crate::error::ServiceError;
use crate::node::context::Context;
use serde_json::json;

/// The gRPC `presence.v1.Cluster` service.
#[derive(Debug, Clone)]
pub(crate) struct ClusterService {
    context: Arc<Context>,
    /// This node's part in its cluster; `None` on a single node, which
    /// refuses every call as not clustered.
    cluster: Option<Arc<ClusterNode>>,
    auth: Arc<Authenticator>,
    audit: Arc<Audit>,
}

impl ClusterService {
    pub(crate) fn new(
        context: Arc<Context>,
        cluster: Option<Arc<ClusterNode>>,
        auth: Arc<Authenticator>,
        audit: Arc<Audit>,
    ) -> Self {
        ClusterService { context, cluster, auth, audit }
    }

    /// This node's part in its cluster, or the refusal of `operation` on a single node.
    fn cluster(&self, operation: &'static str) -> Result<&Arc<ClusterNode>, ServiceError> {
        self.cluster.as_ref().ok_or(ServiceError::NotClustered { operation })
    }

    /// A caller that may use the `Cluster` service: a service caller and,
    /// with node-to-node TLS, on a connection with a certificate of the
    /// cluster's CA (T2): a service token alone does not make a node.
    /// Every call needs the `cluster` scope, except a slot move an operator
    /// asks for, which needs `admin`.
    fn service_only<T>(&self, request: &Request<T>, operation: &'static str) -> Result<(), ServiceError> {
        if self.cluster.as_ref().is_some_and(|cluster| cluster.membership.requires_peer_certificate())
            && !ConnectionInfo::is_cluster_node(request)
        {
            return Err(ServiceError::PermissionDenied {
                operation,
                reason: "Cluster calls are for the cluster's nodes: this connection has no certificate of the cluster's CA",
            });
        }
        let scope = if operation == "MoveSlots" { Scope::Admin } else { Scope::Cluster };
        self.auth.caller_of(request)?.require(scope, operation)
    }

    /// This node's part in its cluster, for a call another node (a service
    /// caller) makes of it: `operation` is refused otherwise.
    fn node_call<T>(&self, request: &Request<T>, operation: &'static str) -> Result<&Arc<ClusterNode>, ServiceError> {
        self.service_only(request, operation)?;
        self.cluster(operation)
    }
}

#[tonic::async_trait]
impl Cluster for ClusterService {
    type NodeChangesStream = crate::node::feed::ChangesStream;

    async fn node_changes(
        &self,
        request: Request<pb::ChangesRequest>,
    ) -> Result<Response<Self::NodeChangesStream>, Status> {
        self.node_call(&request, "NodeChanges")?;
        Ok(Response::new(crate::cluster::feed::node_part(&self.context, request.get_ref())?))
    }

    async fn move_slots(
        &self,
        request: Request<pb::MoveSlotsRequest>,
    ) -> Result<Response<pb::MoveSlotsResponse>, Status> {
        let args = json!({ "slots": request.get_ref().slots, "to_node": request.get_ref().to_node });
        let entry = self.audit.entry(&self.auth, &request, "MoveSlots", args);
        let answered: Result<Response<pb::MoveSlotsResponse>, Status> = async {
            self.service_only(&request, "MoveSlots")?;
            let cluster = self.cluster("MoveSlots")?;
            // The target is asked with this node's own credential (the `cluster`
            // scope), else with the operator's.
            let credential =
                cluster.membership.peer_token().or_else(|| request.metadata().get("authorization")).cloned();
            let asked = request.into_inner();
            let moved = move_slots(&self.context, cluster, &asked.slots, &asked.to_node, credential.as_ref()).await?;
            Ok(Response::new(pb::MoveSlotsResponse {
                epoch: moved.epoch,
                users: moved.users,
                sessions: moved.sessions,
                bytes: moved.bytes,
                elapsed_ms: u32::try_from(moved.elapsed.as_millis()).unwrap_or(u32::MAX),
            }))
        }
        .await;
        entry.done(answered)
    }

    async fn take_slots(
        &self,
        request: Request<Streaming<pb::SlotState>>,
    ) -> Result<Response<pb::TakeSlotsResponse>, Status> {
        self.service_only(&request, "TakeSlots")?;
        let cluster = self.cluster("TakeSlots")?;
        Ok(Response::new(take_slots(&self.context, cluster, request.into_inner()).await?))
    }

    async fn drop_slots(
        &self,
        request: Request<pb::DropSlotsRequest>,
    ) -> Result<Response<pb::DropSlotsResponse>, Status> {
        let cluster = self.node_call(&request, "DropSlots")?;
        let membership = &cluster.membership;
        let request = request.into_inner();
        let set = slot_set(membership, &request.slots, request.slot_count)?;
        let map = membership.map();
        if let Some(slot) = set.iter().find(|&slot| membership.owns(&map, slot)) {
            return Err(ServiceError::MoveRefused(format!("slot {slot} is this node's: its state stays")).into());
        }
        // A copy kept aside for a move of them goes too (C7).
        let no_longer_coming = cluster.arrivals.forget(&set);
        let (now, slots) = (self.context.now(), set.clone());
        let users = off_the_runtime(self.context.store(), move |store| store.release_slots(now, &slots)).await?;
        self.context.store().pause_expiry(Some(membership.stop_taking(&no_longer_coming)));
        self.context.privacy.release_slots(&set).await?;
        Ok(Response::new(pb::DropSlotsResponse { users: users as u64 }))
    }

    async fn follow(
        &self,
        request: Request<Streaming<pb::FollowUpdate>>,
    ) -> Result<Response<pb::FollowResponse>, Status> {
        self.service_only(&request, "Follow")?;
        let cluster = self.cluster("Follow")?;
        Ok(Response::new(crate::cluster::replica::follow(&self.context, cluster, request.into_inner()).await?))
    }

    async fn etcd_reach(
        &self,
        request: Request<pb::EtcdReachRequest>,
    ) -> Result<Response<pb::EtcdReachResponse>, Status> {
        let cluster = self.node_call(&request, "EtcdReach")?;
        Ok(Response::new(crate::cluster::outage::answer(cluster, request.get_ref()).await))
    }

    async fn merge_groups(
        &self,
        request: Request<pb::GroupEntries>,
    ) -> Result<Response<pb::MergeGroupsResponse>, Status> {
        self.node_call(&request, "MergeGroups")?;
        let entries = cluster_wire::group_entries(request.into_inner())?;
        let newer = self.context.privacy.merge_groups(entries).await?.len();
        metrics::counter!(crate::metrics::names::GROUP_ENTRIES_MERGED, "via" => "sent").increment(newer as u64);
        Ok(Response::new(pb::MergeGroupsResponse { newer: u32::try_from(newer).unwrap_or(u32::MAX) }))
    }

    type GroupLedgerStream = tokio_stream::Iter<std::vec::IntoIter<Result<pb::GroupEntries, Status>>>;

    async fn group_ledger(
        &self,
        request: Request<pb::GroupLedgerRequest>,
    ) -> Result<Response<Self::GroupLedgerStream>, Status> {
        self.node_call(&request, "GroupLedger")?;
        let pieces = crate::cluster::group_sync::ledger_pieces(&self.context, &request.get_ref().digests);
        Ok(Response::new(tokio_stream::iter(pieces.into_iter().map(Ok).collect::<Vec<_>>())))
    }

    async fn take_room_facts(&self, request: Request<pb::RoomFacts>) -> Result<Response<pb::RoomFactsTaken>, Status> {
        let membership = &self.node_call(&request, "TakeRoomFacts")?.membership;
        Ok(Response::new(crate::cluster::room_sync::take_in(&self.context, membership, request.into_inner())?))
    }

    async fn owned_room_counts(
        &self,
        request: Request<pb::OwnedRoomCountsRequest>,
    ) -> Result<Response<pb::OwnedRoomCountsResponse>, Status> {
        let cluster = self.node_call(&request, "OwnedRoomCounts")?;
        let counts = crate::cluster::room_sync::answer_owned_room_counts(&self.context, cluster, request.get_ref())?;
        Ok(Response::new(pb::OwnedRoomCountsResponse { counts }))
    }

    type RelayStream = crate::cluster::relay::RelayStream;

    async fn relay(
        &self,
        request: Request<Streaming<pb::RelayControl>>,
    ) -> Result<Response<Self::RelayStream>, Status> {
        let cluster = self.node_call(&request, "Relay")?;
        if !cluster.membership.serves_relay {
            return Err(Status::unimplemented("Cluster/Relay is not served by this node"));
        }
        Ok(Response::new(crate::cluster::relay::serve(Arc::clone(&self.context), request.into_inner())?))
    }

    async fn bump_versions(
        &self,
        request: Request<pb::BumpVersionsRequest>,
    ) -> Result<Response<pb::RelayedUsers>, Status> {
        self.node_call(&request, "BumpVersions")?;
        let bumped = crate::cluster::relay::answer_bump_versions(&self.context, request.get_ref()).await?;
        Ok(Response::new(bumped))
    }

    async fn may_view(&self, request: Request<pb::MayViewRequest>) -> Result<Response<pb::MayViewResponse>, Status> {
        self.node_call(&request, "MayView")?;
        let visible = crate::cluster::room_sync::answer_may_view(&self.context, request.get_ref())?;
        Ok(Response::new(pb::MayViewResponse { visible }))
    }

    async fn take_room_access(
        &self,
        request: Request<pb::RoomAccessEntries>,
    ) -> Result<Response<pb::TakeRoomAccessResponse>, Status> {
        self.node_call(&request, "TakeRoomAccess")?;
        let entries = cluster_wire::room_access_entries_sent(request.into_inner().entries)?;
        crate::cluster::room_sync::take_access(&self.context, &entries, true);
        Ok(Response::new(pb::TakeRoomAccessResponse {}))
    }

    async fn held_elsewhere(
        &self,
        request: Request<pb::HeldElsewhereRequest>,
    ) -> Result<Response<pb::HeldElsewhereResponse>, Status> {
        let cluster = self.node_call(&request, "HeldElsewhere")?;
        Ok(Response::new(crate::cluster::erase::answer(&self.context, cluster, request.get_ref()).await?))
    }

    async fn room_scan(&self, request: Request<pb::RoomScanRequest>) -> Result<Response<pb::RoomFacts>, Status> {
        let cluster = self.node_call(&request, "RoomScan")?;
        Ok(Response::new(crate::cluster::room_sync::scan_for(&self.context, cluster, request.into_inner()).await?))
    }
}
