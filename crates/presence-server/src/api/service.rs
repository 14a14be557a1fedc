//! The `presence.v1.Presence` gRPC service: requests in, store operations, changes published.
//!
//! Each handler authenticates the caller, turns the request into core values
//! (`node/wire.rs`), runs one operation through the context (which publishes what
//! it changed, even when it refused the request: a refused renewal may have
//! found an expired lease) and turns the answer back into a message. Every
//! refusal is a [`ServiceError`]; the one conversion to `tonic::Status` is in
//! `error.rs`.

use std::sync::Arc;

use presence_core::CompactString;
use presence_proto::lease_frames::LeaseBatchFrame;
use presence_proto::v1::{self as pb, lease_item, lease_result, presence_server::Presence as PresenceApi};
use serde_json::json;
use tonic::{Request, Response, Status, Streaming};

use crate::audit::FORWARDED;
use crate::audit::{Audit, AuditEntry};
use crate::auth::{Authenticator, Caller, CredentialBound, Scope, StreamCredentials};
use crate::cluster::ClusterNode;
use crate::cluster::erase::held_elsewhere;
use crate::cluster::fanin;
use crate::cluster::group_sync;
use crate::cluster::membership::Routes;
use crate::cluster::room_sync::{self, RoomPlace};
use crate::error::ServiceError;
use crate::metrics::RenewResult;
use crate::node::background;
use crate::node::context::{Context, hear_rooms, room_version_after};
use crate::node::erase;
use crate::node::feed::ChangesStream;
use crate::node::leases::{self, LeaseQueue, LeasesStream};
use crate::node::ops;
use crate::node::placement::{Acting, HOLD_THROUGH_FREEZE};
use crate::node::privacy::{RelationChange, Shown};
use crate::node::room_counts::{self, RoomCountsStream};
use crate::node::rooms::{self, RoomStream};
use crate::node::settings::{MAX_SETTING_NAME_BYTES, MAX_SETTING_VALUE_BYTES, MAX_SETTINGS_PER_USER};
use crate::node::storage::backup;
use crate::node::watch::{self, WatchStream};
use crate::node::watches::WatchUpdate;
use crate::node::wire;

/// The `presence.v1.Presence` service of one server.
#[derive(Debug, Clone)]
pub(crate) struct PresenceService {
    context: Arc<Context>,
    /// This node's part in its cluster; `None` on a single node, which
    /// answers everything here.
    cluster: Option<Arc<ClusterNode>>,
    leases: LeaseQueue,
    auth: Arc<Authenticator>,
    audit: Arc<Audit>,
}

/// Where a room request is answered (C1): here, or at its room slot's owner
/// in this node's cluster, at that address.
enum RoomAt<'a> {
    Here,
    Owner(&'a Arc<ClusterNode>, String),
}

/// A handler's answer; the refusal becomes a status in one place.
type Answer<T> = Result<Response<T>, Status>;

impl PresenceService {
    pub(crate) fn new(
        context: Arc<Context>,
        cluster: Option<Arc<ClusterNode>>,
        leases: LeaseQueue,
        auth: Arc<Authenticator>,
        audit: Arc<Audit>,
    ) -> Self {
        PresenceService { context, cluster, leases, auth, audit }
    }

    /// The audit log's entry of a privileged call (`action`, with `args`).
    fn audited<T>(&self, request: &Request<T>, action: &'static str, args: serde_json::Value) -> AuditEntry<'_> {
        self.audit.entry(&self.auth, request, action, args)
    }

    fn caller<T>(&self, request: &Request<T>) -> Result<Caller, ServiceError> {
        self.auth.caller_of(request)
    }

    /// Authenticates a service caller whose credential has `scope`.
    fn require<T>(&self, request: &Request<T>, scope: Scope, operation: &'static str) -> Result<Caller, ServiceError> {
        let caller = self.caller(request)?;
        caller.require(scope, operation)?;
        Ok(caller)
    }

    /// `Ok` when this node may act for `user_id` (always, outside a cluster;
    /// C2), with the view checked: a write holds it until it is done, so
    /// that a handover of the user's slot cannot start in between (C3).
    fn owns(&self, user_id: &str) -> Result<Acting<'_>, ServiceError> {
        let acting = self.context.placement.acting();
        acting.check(user_id)?;
        Ok(acting)
    }

    /// Where the users of a request are answered, once per request (C2):
    /// `None` when this node answers them all (always, on a single node);
    /// else this node's cluster and the routes. A `forwarded` request is
    /// answered here or refused.
    fn routes<S: AsRef<str>>(
        &self,
        user_ids: &[S],
        forwarded: bool,
    ) -> Result<Option<(&Arc<ClusterNode>, Routes)>, ServiceError> {
        let Some(cluster) = &self.cluster else { return Ok(None) };
        Ok(cluster.membership.view().route(user_ids, forwarded)?.map(|routes| (cluster, routes)))
    }

    /// The owner's address when `user_id`'s owner is another node, to which a
    /// per-user request not forwarded already goes (C2); `None` when this
    /// node answers it (always, on a single node).
    fn owner_elsewhere<T>(
        &self,
        request: &Request<T>,
        user_id: &CompactString,
    ) -> Result<Option<(&Arc<ClusterNode>, String)>, ServiceError> {
        let forwarded = request.metadata().contains_key(FORWARDED);
        let Some((cluster, routes)) = self.routes(std::slice::from_ref(user_id), forwarded)? else { return Ok(None) };
        Ok(routes.remote.into_keys().next().map(|address| (cluster, address)))
    }

    /// Serves a Join, Leave or Signal (`rpc`) of `user_id` in `room_id` with
    /// `operation`; with it, the room's version as its owner answered it, or
    /// `None` on a single node, whose store's answer carries it.
    async fn room_item<M, T>(
        &self,
        request: &Request<M>,
        rpc: &'static str,
        user_id: &str,
        room_id: &str,
        operation: impl FnOnce(&presence_core::Store, u64, &mut presence_core::Changes) -> Result<T, ServiceError>,
    ) -> Result<(T, Option<u64>), ServiceError> {
        // The ownership view is not held across the wait for the room's owner.
        let (done, answered) = {
            self.require(request, Scope::Gateway, rpc)?;
            let _owned = self.owns(user_id)?;
            self.context.apply_to_rooms(operation)
        };
        let done = done?;
        Ok((done, room_version_after(&self.context, &hear_rooms(answered).await, room_id).await?))
    }

    /// Where a room read is answered (C1): here, or at the room slot's owner,
    /// to which it is forwarded.
    fn room_place<T>(&self, request: &Request<T>, room_id: &str) -> Result<RoomAt<'_>, ServiceError> {
        let Some(cluster) = &self.cluster else { return Ok(RoomAt::Here) };
        let forwarded = request.metadata().contains_key(FORWARDED);
        Ok(match room_sync::place_of(cluster, room_id, forwarded)? {
            RoomPlace::Here => RoomAt::Here,
            RoomPlace::At(address) => RoomAt::Owner(cluster, address),
        })
    }

    /// Who a read (`operation`) answers for: the viewer itself, or the
    /// viewer a service names; `None` is a service acting for no viewer (P6).
    fn acting_viewer<T>(
        &self,
        request: &Request<T>,
        viewer_id: &str,
        operation: &'static str,
    ) -> Result<Option<CompactString>, ServiceError> {
        Ok(self.reader(request, viewer_id, operation)?.1)
    }

    /// The caller of a read (`operation`), and who it answers for (see
    /// [`PresenceService::acting_viewer`]).
    fn reader<T>(
        &self,
        request: &Request<T>,
        viewer_id: &str,
        operation: &'static str,
    ) -> Result<(Caller, Option<CompactString>), ServiceError> {
        let caller = self.caller(request)?;
        let viewer = match caller.acting_viewer(viewer_id, operation)? {
            Some(viewer) => Some(wire::id("viewer_id", &viewer)?),
            None => None,
        };
        Ok((caller, viewer))
    }
}

impl PresenceService {
    /// The scope a service caller's stream needs to stay open: `read` for
    /// true states, `read-as-viewer` on behalf of a viewer; none for a viewer.
    fn read_scope(caller: &Caller, viewer: &Option<CompactString>) -> Option<Scope> {
        match (caller, viewer) {
            (Caller::Viewer(_), _) => None,
            (Caller::Service(_), None) => Some(Scope::Read),
            (Caller::Service(_), Some(_)) => Some(Scope::ReadAsViewer),
        }
    }

    /// Who reads a room, and which.
    fn room_request<T>(
        &self,
        request: &Request<T>,
        room_id: &str,
        viewer_id: &str,
        operation: &'static str,
    ) -> Result<rooms::RoomRequest, ServiceError> {
        let viewer = self.acting_viewer(request, viewer_id, operation)?;
        Ok(rooms::RoomRequest { room_id: wire::id("room_id", room_id)?, viewer })
    }
}

/// `Ok(Response)` of an answer, or its refusal as a status.
fn answer<T>(result: Result<T, ServiceError>) -> Answer<T> {
    result.map(Response::new).map_err(Status::from)
}

impl PresenceService {
    /// A lease request for a user whose slot is frozen for a move out of
    /// this node (C7) waits the freeze out here, at most
    /// [`HOLD_THROUGH_FREEZE`]. If the slot went to another node meanwhile,
    /// the request is sent on to it as the caller, and its answer is
    /// returned (`Some`); `None`: it is answered here as any other (there was
    /// no freeze, or the move was given up, or the refusal names the owner).
    async fn through_freeze<T>(
        &self,
        request: &Request<T>,
        operation: &'static str,
        user_id: &str,
        item: impl FnOnce() -> lease_item::Op,
    ) -> Option<Result<lease_result::Result, ServiceError>> {
        let frozen_slot = |acting: Acting<'_>| match acting.check(user_id) {
            Err(ServiceError::NotOwner(not_owner)) if not_owner.frozen => Some(not_owner.slot),
            _ => None,
        };
        let slot = frozen_slot(self.context.placement.acting())?;
        if let Err(refusal) = self.require(request, Scope::Gateway, operation) {
            return Some(Err(refusal));
        }
        let metrics = self.context.metrics();
        metrics.requests_held.increment(1);
        let started = tokio::time::Instant::now();
        self.context.placement.freeze_over(vec![slot], started + HOLD_THROUGH_FREEZE).await;
        metrics.request_hold_seconds.record(started.elapsed().as_secs_f64());
        let owner = match self.context.placement.acting().check(user_id) {
            Err(ServiceError::NotOwner(not_owner)) if !not_owner.owner_addr.is_empty() => not_owner.owner_addr,
            _ => return None,
        };
        if request.metadata().contains_key(FORWARDED) {
            return None;
        }
        let batch = pb::LeaseBatch { batch_id: 0, items: vec![pb::LeaseItem { op: Some(item()) }] };
        let authorization = request.metadata().get("authorization").cloned();
        let answered = self.context.placement.forward_leases(&owner, batch, authorization).await;
        Some(answered.and_then(|results| match results.results.into_iter().next() {
            Some(pb::LeaseResult { code: 0, result: Some(result), .. }) => Ok(result),
            Some(refused) => Err(ServiceError::Peer {
                node: owner,
                status: Status::new(tonic::Code::from(refused.code as i32), refused.message),
            }),
            None => Err(ServiceError::PeerUnusable { node: owner, reason: "no result for the item sent".into() }),
        }))
    }
    /// A Snapshot of `user_ids` for `viewer`, answered here for this node's
    /// users and at their owners for the others', merged in request order.
    async fn snapshot_routed(
        &self,
        request: &Request<pb::SnapshotRequest>,
        viewer: Option<&str>,
        user_ids: &[CompactString],
    ) -> Result<Response<pb::SnapshotResponse>, ServiceError> {
        let forwarded = request.metadata().contains_key(FORWARDED);
        let context = &self.context;
        let stamp =
            self.cluster.as_ref().filter(|_| forwarded).and_then(|cluster| cluster.membership.owner_stamp(user_ids));
        let Some((cluster, routes)) = self.routes(user_ids, forwarded)? else {
            let shown = context.privacy.shown(viewer, user_ids)?;
            let users = context.released(user_ids, &shown, viewer.is_none()).await?;
            let mut response = Response::new(pb::SnapshotResponse { users });
            if let Some(stamp) = stamp {
                stamp.apply(response.metadata_mut());
            }
            return Ok(response);
        };
        let local: Vec<&CompactString> = routes.local.iter().map(|&index| &user_ids[index]).collect();
        let shown = context.privacy.shown(viewer, &local)?;
        let answered = context.released(&local, &shown, viewer.is_none()).await?;
        let authorization = request.metadata().get("authorization");
        let viewer_id = &request.get_ref().viewer_id;
        let users = routes
            .merged(answered, "Snapshot", |address, indices| {
                let ids = indices.iter().map(|&index| user_ids[index].to_string()).collect();
                cluster.membership.forward_snapshot(address, ids, viewer_id, authorization)
            })
            .await?;
        Ok(Response::new(pb::SnapshotResponse { users }))
    }

    /// Where each user's notification should go (A3, A4), answered here for
    /// this node's users and at their owners for the others', merged in
    /// request order.
    async fn notify_targets_routed(
        &self,
        request: &Request<pb::NotifyTargetsRequest>,
    ) -> Result<pb::NotifyTargetsResponse, ServiceError> {
        let input = wire::notify_targets_request(request.get_ref(), &self.context.notify_policy())?;
        let forwarded = request.metadata().contains_key(FORWARDED);
        let Some((cluster, routes)) = self.routes(&input.user_ids, forwarded)? else {
            let all: Vec<&CompactString> = input.user_ids.iter().collect();
            return Ok(pb::NotifyTargetsResponse { targets: self.notify_targets_here(&input, &all).await? });
        };
        let local: Vec<&CompactString> = routes.local.iter().map(|&index| &input.user_ids[index]).collect();
        let answered_here = self.notify_targets_here(&input, &local).await?;
        let authorization = request.metadata().get("authorization");
        let targets = routes
            .merged(answered_here, "NotifyTargets", |address, indices| {
                let user_ids = indices.iter().map(|&index| input.user_ids[index].to_string()).collect();
                let forwarded = pb::NotifyTargetsRequest { user_ids, ..request.get_ref().clone() };
                cluster.membership.forward_notify_targets(address, forwarded, authorization)
            })
            .await?;
        Ok(pb::NotifyTargetsResponse { targets })
    }

    /// NotifyTargets for `user_ids` of this node, [`NOTIFY_USERS_PER_TURN`] at
    /// a time, letting the other tasks of this connection thread run in
    /// between: a renewal that arrived on another connection of the thread
    /// waits for one turn at most, not for a whole batch of 1,000 users (the
    /// heartbeat first).
    async fn notify_targets_here(
        &self,
        input: &wire::NotifyTargetsInput<'_>,
        user_ids: &[&CompactString],
    ) -> Result<Vec<pb::NotifyTarget>, ServiceError> {
        let mut targets = Vec::with_capacity(user_ids.len());
        for (turn, chunk) in user_ids.chunks(NOTIFY_USERS_PER_TURN).enumerate() {
            if turn > 0 {
                tokio::task::yield_now().await;
            }
            let now = self.context.now();
            let decisions =
                self.context.store().notify_targets(now, chunk, input.room_id, input.urgency, &input.policy)?;
            targets
                .extend(chunk.iter().zip(decisions).map(|(user_id, decision)| wire::notify_target(user_id, decision)));
        }
        Ok(targets)
    }

    /// A read that meets a move (C7) waits for it where it arrived: made
    /// again each time this node's view of the owners changes, and every
    /// [`MOVE_RECHECK`] (the owner it asked may have moved on first), for
    /// at most [`HOLD_THROUGH_FREEZE`]; then its last refusal is the answer.
    /// A forwarded read is answered at once: the node that received it waits.
    async fn through_moves<T, R, F>(&self, request: &Request<T>, mut read: impl FnMut() -> F) -> Result<R, ServiceError>
    where
        F: std::future::Future<Output = Result<R, ServiceError>>,
    {
        let Some(cluster) = self.cluster.as_ref().filter(|_| !request.metadata().contains_key(FORWARDED)) else {
            return read().await;
        };
        let started = tokio::time::Instant::now();
        let deadline = started + HOLD_THROUGH_FREEZE;
        let mut held = false;
        loop {
            let mut changes = cluster.membership.changes();
            match read().await {
                Err(refusal) if refusal.may_pass_with_a_move() && tokio::time::Instant::now() < deadline => {
                    held = true;
                    tokio::select! {
                        () = changes.changed() => {}
                        () = tokio::time::sleep(MOVE_RECHECK) => {}
                        () = tokio::time::sleep_until(deadline) => {}
                    }
                }
                answered => {
                    if held {
                        let metrics = self.context.metrics();
                        metrics.requests_held.increment(1);
                        metrics.request_hold_seconds.record(started.elapsed().as_secs_f64());
                    }
                    return answered;
                }
            }
        }
    }
}

/// How often a read held through a move (C7) is made again when this node's
/// view does not change meanwhile: the owner it was sent to acts on the new
/// map a moment before or after this node does.
const MOVE_RECHECK: std::time::Duration = std::time::Duration::from_millis(10);

/// Users a NotifyTargets answers between two yields of its connection thread:
/// about 40 µs of the store's work (`benches/attention.rs`), so that a
/// renewal on another connection of the thread waits no longer than that.
const NOTIFY_USERS_PER_TURN: usize = 64;

/// The answer a node sent on to gave a lease item (C7), as the unary call's.
fn sent_on<T>(
    answered: Result<lease_result::Result, ServiceError>,
    unwrap: impl FnOnce(lease_result::Result) -> Option<T>,
) -> Answer<T> {
    answer(answered.and_then(|result| {
        unwrap(result).ok_or_else(|| ServiceError::Internal("the owner answered another operation".to_owned()))
    }))
}

#[tonic::async_trait]
impl PresenceApi for PresenceService {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Answer<pb::RegisterResponse> {
        let item = || lease_item::Op::Register(request.get_ref().clone());
        if let Some(answered) = self.through_freeze(&request, "Register", &request.get_ref().user_id, item).await {
            return sent_on(answered, |result| match result {
                lease_result::Result::Register(registered) => Some(registered),
                _ => None,
            });
        }
        answer((|| {
            self.require(&request, Scope::Gateway, "Register")?;
            let _owned = self.owns(&request.get_ref().user_id)?;
            let input = wire::register_request(request.get_ref())?;
            let metrics = self.context.metrics();
            let registered =
                self.context.apply(|store, now, changes| ops::register(store, metrics, now, &input, changes))?;
            Ok(wire::register_response(input.user_id(), &registered))
        })())
    }

    async fn renew(&self, request: Request<pb::RenewRequest>) -> Answer<pb::RenewResponse> {
        let item = || lease_item::Op::Renew(request.get_ref().clone());
        if let Some(answered) = self.through_freeze(&request, "Renew", &request.get_ref().user_id, item).await {
            return sent_on(answered, |result| match result {
                lease_result::Result::Renew(renewed) => Some(renewed),
                _ => None,
            });
        }
        answer((|| {
            self.require(&request, Scope::Gateway, "Renew")?;
            let metrics = self.context.metrics();
            let _owned = match self.owns(&request.get_ref().user_id) {
                Ok(owned) => owned,
                Err(refusal) => {
                    metrics.renewals(RenewResult::NotOwner, 1);
                    return Err(refusal);
                }
            };
            if self.leases.is_overloaded() {
                metrics.renewals(RenewResult::Shed, 1);
                metrics.shed.increment(1);
                return Err(ServiceError::RenewalShed);
            }
            let started = std::time::Instant::now();
            let input = match wire::renew_request(request.get_ref()) {
                Ok(input) => input,
                Err(refusal) => {
                    metrics.renewals(RenewResult::Invalid, 1);
                    return Err(refusal);
                }
            };
            let renewed = self.context.apply(|store, now, changes| {
                let renewal = &input.renewal;
                if input.attention.is_empty() {
                    store.renew(now, renewal.user_id, renewal.session_id, renewal.generation, renewal.ttl_ms, changes)
                } else {
                    ops::renew_with_attention(store, now, &input, changes)
                }
            });
            metrics.renewal_seconds.record(started.elapsed().as_secs_f64());
            metrics.renewals(ops::renew_result(&renewed), 1);
            Ok(wire::renew_response(&renewed?))
        })())
    }

    async fn unregister(&self, request: Request<pb::UnregisterRequest>) -> Answer<pb::UnregisterResponse> {
        let item = || lease_item::Op::Unregister(request.get_ref().clone());
        if let Some(answered) = self.through_freeze(&request, "Unregister", &request.get_ref().user_id, item).await {
            return sent_on(answered, |result| match result {
                lease_result::Result::Unregister(unregistered) => Some(unregistered),
                _ => None,
            });
        }
        answer((|| {
            self.require(&request, Scope::Gateway, "Unregister")?;
            let _owned = self.owns(&request.get_ref().user_id)?;
            let input = wire::unregister_request(request.get_ref());
            let metrics = self.context.metrics();
            let unregistered =
                self.context.apply(|store, now, changes| ops::unregister(store, metrics, now, input, changes))?;
            Ok(wire::unregister_response(input.user_id, &unregistered))
        })())
    }

    async fn revoke(&self, request: Request<pb::RevokeRequest>) -> Answer<pb::RevokeResponse> {
        let call = request.get_ref();
        let args = json!({ "user_id": call.user_id, "session_id": call.session_id });
        self.audited(&request, "Revoke", args).done(answer((|| {
            self.require(&request, Scope::Admin, "Revoke")?;
            let request = request.get_ref();
            let _owned = self.owns(&request.user_id)?;
            let session_id = (!request.session_id.is_empty()).then_some(request.session_id.as_str());
            let revoked =
                self.context.apply(|store, now, changes| store.revoke(now, &request.user_id, session_id, changes))?;
            Ok(wire::revoke_response(&request.user_id, &revoked))
        })()))
    }

    type LeasesStream = CredentialBound<LeasesStream>;

    async fn leases(&self, request: Request<Streaming<LeaseBatchFrame>>) -> Answer<Self::LeasesStream> {
        let caller = self.require(&request, Scope::Gateway, "Leases")?;
        let credentials = StreamCredentials::of(&self.auth, &request, caller, Some(Scope::Gateway));
        let caller = leases::Caller {
            authorization: request.metadata().get("authorization").cloned(),
            forwarded: request.metadata().contains_key(FORWARDED),
        };
        Ok(Response::new(credentials.bind(leases::open(self.leases.clone(), request.into_inner(), caller))))
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Answer<pb::SnapshotResponse> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let viewer = self.acting_viewer(&request, &request.get_ref().viewer_id, "Snapshot")?;
        let user_ids = wire::user_ids("user_ids", &request.get_ref().user_ids)?;
        let answered = self.through_moves(&request, || self.snapshot_routed(&request, viewer.as_deref(), &user_ids));
        Ok(answered.await?)
    }

    async fn notify_targets(&self, request: Request<pb::NotifyTargetsRequest>) -> Answer<pb::NotifyTargetsResponse> {
        // A service's call: it reads every session's true attention, which no viewer may.
        self.require(&request, Scope::Read, "NotifyTargets")?;
        let answered = self.through_moves(&request, || self.notify_targets_routed(&request));
        Ok(Response::new(answered.await?))
    }

    type WatchStream = CredentialBound<WatchStream>;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Answer<Self::WatchStream> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let (caller, viewer) = self.reader(&request, &request.get_ref().viewer_id, "Watch")?;
        let needs = Self::read_scope(&caller, &viewer);
        let credentials = StreamCredentials::of(&self.auth, &request, caller, needs);
        let request_metadata = request.metadata();
        let request = request.get_ref();
        let user_ids = wire::user_ids("user_ids", &request.user_ids)?;
        let forwarded = request_metadata.contains_key(FORWARDED);
        let routes = self.routes(&user_ids, forwarded)?;
        let batch_window = wire::batch_window(request.batch_window_ms)?;
        let known_versions = wire::known_versions(&request.known_versions)?;
        let options = watch::WatchOptions { viewer, batch_window, known_versions };
        let Some((cluster, routes)) = routes else {
            // A cluster node's own Watch is guarded by its ownership; a single node's needs nothing.
            let guarded = self.cluster.as_ref().map(|cluster| (Arc::clone(cluster), user_ids.clone()));
            let stream = watch::open(Arc::clone(&self.context), user_ids, options).await?;
            return Ok(Response::new(credentials.bind(match guarded {
                Some((cluster, users)) => fanin::guarded(cluster, users, stream),
                None => stream,
            })));
        };
        // Users of other nodes: watched at their owners, merged here.
        let local = routes.local.iter().map(|&index| user_ids[index].clone()).collect();
        let users = routes
            .remote
            .into_iter()
            .map(|(address, indices)| (address, indices.into_iter().map(|index| user_ids[index].clone()).collect()))
            .collect();
        let authorization = request_metadata.get("authorization");
        let remote = fanin::Remote { users, request, authorization };
        Ok(Response::new(
            credentials.bind(fanin::open(Arc::clone(&self.context), cluster, local, options, remote).await?),
        ))
    }

    async fn update_watch(&self, request: Request<pb::UpdateWatchRequest>) -> Answer<pb::UpdateWatchResponse> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let viewer = self.acting_viewer(&request, &request.get_ref().viewer_id, "UpdateWatch")?;
        let request = request.get_ref();
        let update = WatchUpdate {
            add: wire::user_ids("add_user_ids", &request.add_user_ids)?,
            remove: wire::user_ids("remove_user_ids", &request.remove_user_ids)?,
        };
        {
            // Checked apart: a cluster node's view is never held across an await.
            let acting = self.context.placement.acting();
            update.add.iter().try_for_each(|user_id| acting.check(user_id))?;
        }
        self.context.watches.update(&request.watch_id, viewer.as_deref(), update).await?;
        Ok(Response::new(pb::UpdateWatchResponse {}))
    }

    async fn join(&self, request: Request<pb::JoinRequest>) -> Answer<pb::JoinResponse> {
        let (call, metrics) = (request.get_ref(), self.context.metrics());
        let (mut joined, version) = self
            .room_item(&request, "Join", &call.user_id, &call.room_id, |store, now, changes| {
                ops::join(store, metrics, now, &wire::join_request(call), changes)
            })
            .await?;
        joined.room_version = version.unwrap_or(joined.room_version);
        Ok(Response::new(joined))
    }

    async fn leave(&self, request: Request<pb::LeaveRequest>) -> Answer<pb::LeaveResponse> {
        let call = request.get_ref();
        let (mut left, version) = self
            .room_item(&request, "Leave", &call.user_id, &call.room_id, |store, now, changes| {
                ops::leave(store, now, &wire::leave_request(call), changes)
            })
            .await?;
        left.room_version = version.unwrap_or(left.room_version);
        Ok(Response::new(left))
    }

    async fn signal(&self, request: Request<pb::SignalRequest>) -> Answer<pb::SignalResponse> {
        let (call, metrics) = (request.get_ref(), self.context.metrics());
        let (mut signalled, version) = self
            .room_item(&request, "Signal", &call.user_id, &call.room_id, |store, now, changes| {
                ops::signal(store, metrics, now, &wire::signal_request(call), changes)
            })
            .await?;
        signalled.room_version = version.unwrap_or(signalled.room_version);
        Ok(Response::new(signalled))
    }

    async fn room_snapshot(&self, request: Request<pb::RoomSnapshotRequest>) -> Answer<pb::RoomSnapshot> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let room =
            self.room_request(&request, &request.get_ref().room_id, &request.get_ref().viewer_id, "RoomSnapshot")?;
        let answered = self.through_moves(&request, || async {
            match self.room_place(&request, &room.room_id)? {
                RoomAt::Here => {
                    let mut lens = rooms::MemberLens::new(&room);
                    rooms::snapshot(&self.context, &room, &mut lens).await
                }
                RoomAt::Owner(cluster, address) => {
                    let authorization = request.metadata().get("authorization");
                    cluster.membership.forward_room_snapshot(&address, request.get_ref().clone(), authorization).await
                }
            }
        });
        Ok(Response::new(answered.await?))
    }

    type WatchRoomStream = CredentialBound<RoomStream>;

    async fn watch_room(&self, request: Request<pb::WatchRoomRequest>) -> Answer<Self::WatchRoomStream> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let (caller, viewer) = self.reader(&request, &request.get_ref().viewer_id, "WatchRoom")?;
        let credentials =
            StreamCredentials::of(&self.auth, &request, caller.clone(), Self::read_scope(&caller, &viewer));
        let room = rooms::RoomRequest { room_id: wire::id("room_id", &request.get_ref().room_id)?, viewer };
        let count_interval = wire::room_watch_mode(request.get_ref().mode, request.get_ref().count_interval_ms)?;
        let place = self.room_place(&request, &room.room_id)?;
        match place {
            RoomAt::Here => Ok(Response::new(
                credentials.bind(rooms::watch(Arc::clone(&self.context), room, count_interval).await?),
            )),
            RoomAt::Owner(cluster, address) => {
                let authorization = request.metadata().get("authorization");
                let upstream =
                    cluster.membership.forward_watch_room(&address, request.get_ref().clone(), authorization).await?;
                Ok(Response::new(credentials.bind(fanin::relay(Arc::clone(&self.context), address, upstream))))
            }
        }
    }

    async fn room_counts(&self, request: Request<pb::RoomCountsRequest>) -> Answer<pb::RoomCounts> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let viewer = self.acting_viewer(&request, &request.get_ref().viewer_id, "RoomCounts")?;
        let rooms = wire::counted_room_ids(&request.get_ref().room_ids)?;
        let answered = self.through_moves(&request, || room_counts::read(&self.context, viewer.as_deref(), &rooms));
        Ok(Response::new(answered.await?))
    }

    type WatchRoomCountsStream = CredentialBound<RoomCountsStream>;

    async fn watch_room_counts(
        &self,
        request: Request<pb::WatchRoomCountsRequest>,
    ) -> Answer<Self::WatchRoomCountsStream> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let (caller, viewer) = self.reader(&request, &request.get_ref().viewer_id, "WatchRoomCounts")?;
        let credentials =
            StreamCredentials::of(&self.auth, &request, caller.clone(), Self::read_scope(&caller, &viewer));
        let rooms = wire::counted_room_ids(&request.get_ref().room_ids)?;
        let interval = wire::count_interval(request.get_ref().count_interval_ms)?;
        let stream = room_counts::watch(Arc::clone(&self.context), viewer, rooms, interval).await?;
        Ok(Response::new(credentials.bind(stream)))
    }

    async fn update_watch_room_counts(
        &self,
        request: Request<pb::UpdateWatchRoomCountsRequest>,
    ) -> Answer<pb::UpdateWatchRoomCountsResponse> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let viewer = self.acting_viewer(&request, &request.get_ref().viewer_id, "UpdateWatchRoomCounts")?;
        let request = request.get_ref();
        let update = WatchUpdate {
            add: wire::user_ids("add_room_ids", &request.add_room_ids)?,
            remove: wire::user_ids("remove_room_ids", &request.remove_room_ids)?,
        };
        self.context.room_count_watches.update(&request.watch_id, viewer.as_deref(), update).await?;
        Ok(Response::new(pb::UpdateWatchRoomCountsResponse {}))
    }

    async fn set_room_access(&self, request: Request<pb::SetRoomAccessRequest>) -> Answer<pb::SetRoomAccessResponse> {
        let call = request.get_ref();
        let args = json!({ "room_id": call.room_id, "access": call.access });
        let entry = self.audited(&request, "SetRoomAccess", args);
        entry.done(self.set_room_access_audited(request).await)
    }

    async fn list_sessions(&self, request: Request<pb::ListSessionsRequest>) -> Answer<pb::ListSessionsResponse> {
        answer((|| {
            self.require(&request, Scope::Admin, "ListSessions")?;
            let _owned = self.owns(&request.get_ref().user_id)?;
            let now = self.context.now();
            let sessions = self.context.store().sessions(now, &request.get_ref().user_id)?;
            Ok(wire::list_sessions_response(&sessions, now))
        })())
    }

    async fn stats(&self, request: Request<pb::StatsRequest>) -> Answer<pb::StatsResponse> {
        self.require(&request, Scope::Admin, "Stats")?;
        let context = &self.context;
        let store = context.store();
        Ok(Response::new(wire::stats_response(wire::StatsReading {
            store: store.stats(),
            config: store.config(),
            totals: context.metrics().totals(),
            uptime: context.started.elapsed(),
            now: context.now(),
        })))
    }

    async fn set_status(&self, request: Request<pb::SetStatusRequest>) -> Answer<pb::SetStatusResponse> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        let user_id = wire::id("user_id", &request.user_id)?;
        caller.require_self_or(&user_id, Scope::Gateway, "SetStatus")?;
        let _durable = self.context.hold_for_durable_write().await;
        self.owns(&user_id)?;
        let context = &self.context;
        let status = request.status.map(|status| wire::status(status, context.now())).transpose()?;
        let view = context.privacy.set_status(&user_id, status).await?;
        let presence = context.released(&[user_id], &[Shown { view, visible: true }], false).await?.pop();
        Ok(Response::new(pb::SetStatusResponse { presence }))
    }

    async fn set_visibility(&self, request: Request<pb::SetVisibilityRequest>) -> Answer<pb::SetVisibilityResponse> {
        self.auth.fetch_unknown_kid(request.metadata()).await;
        let entry = self.audited(
            &request,
            "SetVisibility",
            json!({
                "user_id": request.get_ref().user_id,
                "visibility": request.get_ref().visibility,
                "share_activity": request.get_ref().share_activity,
            }),
        );
        let answered: Answer<pb::SetVisibilityResponse> = async {
            let caller = self.caller(&request)?;
            let request = request.get_ref();
            let user = wire::id("user_id", &request.user_id)?;
            caller.require_self_or(&user, Scope::Admin, "SetVisibility")?;
            let _durable = self.context.hold_for_durable_write().await;
            self.owns(&user)?;
            for change in wire::visibility_changes(user, request)? {
                self.context.privacy.change(change).await?;
            }
            Ok(Response::new(pb::SetVisibilityResponse {}))
        }
        .await;
        entry.done(answered)
    }

    async fn grant_audience(&self, request: Request<pb::AudienceRequest>) -> Answer<pb::AudienceResponse> {
        let args = json!({ "user_id": request.get_ref().user_id, "viewer_ids": request.get_ref().viewer_ids });
        let entry = self.audited(&request, "GrantAudience", args);
        entry.done(self.change_audience(request, true).await)
    }

    async fn revoke_audience(&self, request: Request<pb::AudienceRequest>) -> Answer<pb::AudienceResponse> {
        let args = json!({ "user_id": request.get_ref().user_id, "viewer_ids": request.get_ref().viewer_ids });
        let entry = self.audited(&request, "RevokeAudience", args);
        entry.done(self.change_audience(request, false).await)
    }

    async fn join_group(&self, request: Request<pb::GroupRequest>) -> Answer<pb::GroupResponse> {
        let args = json!({ "group_id": request.get_ref().group_id, "user_ids": request.get_ref().user_ids });
        let entry = self.audited(&request, "JoinGroup", args);
        entry.done(self.change_group(request, true).await)
    }

    async fn leave_group(&self, request: Request<pb::GroupRequest>) -> Answer<pb::GroupResponse> {
        let args = json!({ "group_id": request.get_ref().group_id, "user_ids": request.get_ref().user_ids });
        let entry = self.audited(&request, "LeaveGroup", args);
        entry.done(self.change_group(request, false).await)
    }

    async fn touch(&self, request: Request<pb::TouchRequest>) -> Answer<pb::TouchResponse> {
        self.require(&request, Scope::Gateway, "Touch")?;
        let user_id = wire::id("user_id", &request.get_ref().user_id)?;
        let _durable = self.context.hold_for_durable_write().await;
        self.owns(&user_id)?;
        let context = &self.context;
        let last_active_at = context.activity.touch(&user_id, context.now()).await.map_err(ServiceError::from)?;
        Ok(Response::new(pb::TouchResponse { last_active_at_ms: wire::unix_ms(last_active_at) }))
    }

    async fn put_setting(&self, request: Request<pb::PutSettingRequest>) -> Answer<pb::PutSettingResponse> {
        let entry = self.audited(&request, "PutSetting", json!({ "user_id": request.get_ref().user_id, "name": request.get_ref().name, "value_bytes": request.get_ref().value.len() }));
        let answered: Answer<pb::PutSettingResponse> = async {
            self.require(&request, Scope::Admin, "PutSetting")?;
            let request = request.into_inner();
            wire::id("user_id", &request.user_id)?;
            let _durable = self.context.hold_for_durable_write().await;
            self.owns(&request.user_id)?;
            if request.name.is_empty() || request.name.len() > MAX_SETTING_NAME_BYTES {
                return Err(
                    ServiceError::invalid("name", format!("must be 1 to {MAX_SETTING_NAME_BYTES} bytes")).into()
                );
            }
            if request.value.len() > MAX_SETTING_VALUE_BYTES {
                let reason = format!("{} bytes, more than the limit of {MAX_SETTING_VALUE_BYTES}", request.value.len());
                return Err(ServiceError::invalid("value", reason).into());
            }
            let user_id = request.user_id.clone();
            let put = self.context.settings.put(request.user_id, request.name, request.value).await;
            if !put.map_err(ServiceError::from)? {
                return Err(ServiceError::TooManySettings { user_id, most: MAX_SETTINGS_PER_USER }.into());
            }
            Ok(Response::new(pb::PutSettingResponse {}))
        }
        .await;
        entry.done(answered)
    }

    async fn get_settings(&self, request: Request<pb::GetSettingsRequest>) -> Answer<pb::GetSettingsResponse> {
        self.require(&request, Scope::Admin, "GetSettings")?;
        let request = request.into_inner();
        wire::id("user_id", &request.user_id)?;
        self.owns(&request.user_id)?;
        let settings = self.context.settings.get(request.user_id).await.map_err(ServiceError::from)?;
        Ok(Response::new(pb::GetSettingsResponse { settings: settings.into_iter().collect() }))
    }

    async fn export_user(&self, request: Request<pb::ExportUserRequest>) -> Answer<pb::ExportUserResponse> {
        let entry = self.audited(&request, "ExportUser", json!({ "user_id": request.get_ref().user_id }));
        entry.done(self.export_user_audited(request).await)
    }

    type BackupStream = tokio_stream::wrappers::ReceiverStream<Result<pb::BackupChunk, Status>>;

    async fn backup(&self, request: Request<pb::BackupRequest>) -> Answer<Self::BackupStream> {
        let entry = self.audited(&request, "Backup", json!({}));
        entry.done(self.backup_audited(request).await)
    }

    async fn erase_user(&self, request: Request<pb::EraseUserRequest>) -> Answer<pb::EraseUserResponse> {
        let entry = self.audited(&request, "EraseUser", json!({ "user_id": request.get_ref().user_id }));
        entry.done(self.erase_user_audited(request).await)
    }

    type ChangesStream = CredentialBound<ChangesStream>;

    async fn changes(&self, request: Request<pb::ChangesRequest>) -> Answer<Self::ChangesStream> {
        let caller = self.require(&request, Scope::Feed, "Changes")?;
        let Some(feed) = &self.context.feed else {
            return Err(ServiceError::NoFeed.into());
        };
        let credentials = StreamCredentials::of(&self.auth, &request, caller, Some(Scope::Feed));
        let stream = match &self.cluster {
            // Every node's part, merged (F3).
            Some(cluster) => crate::cluster::feed::merged(&self.context, cluster, feed, request.get_ref())?,
            None => {
                let (from, filter) = crate::node::feed::wire::changes_request(request.get_ref(), feed.slots())?;
                feed.changes(from, filter, self.context.stopping.clone())?
            }
        };
        Ok(Response::new(credentials.bind(stream)))
    }
}

impl PresenceService {
    /// A backup of this node (D3), made on a background thread and streamed a
    /// frame at a time through a short queue, so that a slow reader holds
    /// back the writing instead of the server buffering the whole file.
    async fn backup_audited(&self, request: Request<pb::BackupRequest>) -> Answer<<Self as PresenceApi>::BackupStream> {
        self.require(&request, Scope::Admin, "Backup")?;
        // Activity is written to disk at most once a minute per user: what is
        // still in memory goes first, so that the backup has it.
        self.context.activity.flush(self.context.now(), true).await.map_err(ServiceError::from)?;
        let slots = self.cluster.as_ref().map_or(0, |cluster| cluster.membership.slot_count());
        let (sender, receiver) = tokio::sync::mpsc::channel(4);
        let store = Arc::clone(self.context.store());
        let durable = self.context.durable.clone();
        let now = self.context.now();
        let writing = move || {
            let mut out =
                |data: Vec<u8>| sender.blocking_send(Ok(pb::BackupChunk { data, ..Default::default() })).is_ok();
            let last = match backup::write(&store, durable.as_deref(), slots, now, &mut out) {
                Ok(summary) => Ok(pb::BackupChunk {
                    data: Vec::new(),
                    last: true,
                    users: summary.users,
                    sessions: summary.sessions,
                    durable_rows: summary.durable_rows,
                }),
                Err(err) => Err(Status::from(ServiceError::from(err))),
            };
            let _ = sender.blocking_send(last);
        };
        background::spawn("presenced-backup", writing)
            .map_err(|err| ServiceError::Internal(format!("cannot start a thread for the backup: {err}")))?;
        Ok(Response::new(tokio_stream::wrappers::ReceiverStream::new(receiver)))
    }

    async fn export_user_audited(&self, request: Request<pb::ExportUserRequest>) -> Answer<pb::ExportUserResponse> {
        self.require(&request, Scope::Admin, "ExportUser")?;
        let user = wire::id("user_id", &request.get_ref().user_id)?;
        if let Some((cluster, address)) = self.owner_elsewhere(&request, &user)? {
            let authorization = request.metadata().get("authorization");
            let forwarded = cluster.membership.forward_export_user(&address, request.get_ref().clone(), authorization);
            return Ok(Response::new(forwarded.await?));
        }
        self.owns(&user)?;
        let mut exported = erase::export(&self.context, &user).await?;
        if let Some(cluster) = &self.cluster {
            let elsewhere = held_elsewhere(&cluster.membership, "ExportUser", &user, false).await?;
            exported.in_audience_of.extend(elsewhere);
            exported.in_audience_of.sort_unstable();
            exported.in_audience_of.dedup();
            exported.held = erase::holds_anything(&exported);
        }
        Ok(Response::new(exported))
    }

    async fn erase_user_audited(&self, request: Request<pb::EraseUserRequest>) -> Answer<pb::EraseUserResponse> {
        self.require(&request, Scope::Admin, "EraseUser")?;
        let user = wire::id("user_id", &request.get_ref().user_id)?;
        if let Some((cluster, address)) = self.owner_elsewhere(&request, &user)? {
            let authorization = request.metadata().get("authorization");
            let forwarded = cluster.membership.forward_erase_user(&address, request.get_ref().clone(), authorization);
            return Ok(Response::new(forwarded.await?));
        }
        let erased = {
            let _durable = self.context.hold_for_durable_write().await;
            self.owns(&user)?;
            erase::erase(&self.context, &user).await?
        };
        let mut granted_by: Vec<String> = erased.here.granted_by.iter().map(ToString::to_string).collect();
        if let Some(cluster) = &self.cluster {
            // Every node holds every membership: the leaves go to all of
            // them, and the group catch-up brings them to one that is away.
            // Meanwhile each node takes the user out of its users' audiences.
            let membership = &cluster.membership;
            let leaves = &erased.here.group_leaves;
            let left = async {
                if !leaves.is_empty() {
                    group_sync::send_to_the_others(membership, leaves).await;
                }
            };
            let ((), elsewhere) = tokio::join!(left, held_elsewhere(membership, "EraseUser", &user, true));
            granted_by.extend(elsewhere?);
            granted_by.sort_unstable();
            granted_by.dedup();
        }
        Ok(Response::new(erased.response(granted_by.len())))
    }

    async fn set_room_access_audited(
        &self,
        request: Request<pb::SetRoomAccessRequest>,
    ) -> Answer<pb::SetRoomAccessResponse> {
        self.require(&request, Scope::Admin, "SetRoomAccess")?;
        let access = wire::room_access(request.get_ref().access)?;
        let room_id = wire::id("room_id", &request.get_ref().room_id)?;
        let context = &self.context;
        let Some(cluster) = &self.cluster else {
            context.store().set_room_access(&room_id, access).map_err(ServiceError::from)?;
            context.rooms().access_changed(&room_id);
            return Ok(Response::new(pb::SetRoomAccessResponse {}));
        };
        // The room's owner sets it, and every node keeps it (C1).
        let forwarded = request.metadata().contains_key(FORWARDED);
        let membership = &cluster.membership;
        match room_sync::place_of(cluster, &room_id, forwarded)? {
            RoomPlace::Here => {
                let stamp = context.store().set_room_access_stamped(context.now(), &room_id, access);
                let stamp = stamp.map_err(ServiceError::from)?;
                context.rooms().access_changed(&room_id);
                room_sync::send_access_to_the_others(membership, (room_id, access, stamp)).await;
            }
            RoomPlace::At(address) => {
                let authorization = request.metadata().get("authorization");
                let forwarded = membership.forward_set_room_access(&address, request.get_ref().clone(), authorization);
                forwarded.await?;
            }
        }
        Ok(Response::new(pb::SetRoomAccessResponse {}))
    }

    async fn change_audience(
        &self,
        request: Request<pb::AudienceRequest>,
        grant: bool,
    ) -> Answer<pb::AudienceResponse> {
        self.require(&request, Scope::Admin, if grant { "GrantAudience" } else { "RevokeAudience" })?;
        let request = request.get_ref();
        let user = wire::id("user_id", &request.user_id)?;
        let _durable = self.context.hold_for_durable_write().await;
        self.owns(&user)?;
        let viewers = wire::nonempty_ids("viewer_ids", &request.viewer_ids)?;
        self.context.privacy.change(RelationChange::Audience { user, viewers, grant }).await?;
        Ok(Response::new(pb::AudienceResponse {}))
    }

    async fn change_group(&self, request: Request<pb::GroupRequest>, join: bool) -> Answer<pb::GroupResponse> {
        let operation = if join { "JoinGroup" } else { "LeaveGroup" };
        self.require(&request, Scope::Admin, operation)?;
        let request = request.get_ref();
        let group = wire::id("group_id", &request.group_id)?;
        let users = wire::nonempty_ids("user_ids", &request.user_ids)?;
        let written = self.context.privacy.change_groups(group, users, join).await?;
        if let (Some(cluster), false) = (&self.cluster, written.is_empty()) {
            group_sync::send_to_the_others(&cluster.membership, &written).await;
        }
        Ok(Response::new(pb::GroupResponse {}))
    }
}
