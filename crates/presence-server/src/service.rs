//! The `presence.v1.Presence` gRPC service: requests in, store operations, flips published.
//!
//! Each handler reads the clock once, runs one store operation, publishes the
//! flips that operation caused (even when it refused the request: a refused
//! renewal may have found an expired lease) and answers.

use std::sync::Arc;

use presence_core::CompactString;
use presence_proto::v1::{self as pb, presence_server::Presence as PresenceApi};
use tonic::{Request, Response, Status, Streaming};

use crate::context::{Context, unavailable};
use crate::leases::{self, LeaseQueue, LeasesStream};
use crate::metrics::RenewResult;
use crate::ops::{self, user_presence};
use crate::settings::{MAX_SETTING_NAME_BYTES, MAX_SETTING_VALUE_BYTES};
use crate::status::status_of;
use crate::watch::{self, WatchStream};

/// Most users one Snapshot or Watch may name.
pub const MAX_USERS_PER_REQUEST: usize = 10_000;

/// The `presence.v1.Presence` service of one server.
#[derive(Debug, Clone)]
pub struct PresenceService {
    context: Arc<Context>,
    leases: LeaseQueue,
}

impl PresenceService {
    pub(crate) fn new(context: Arc<Context>, leases: LeaseQueue) -> Self {
        PresenceService { context, leases }
    }
}

fn check_user_count(count: usize) -> Result<(), Status> {
    if count > MAX_USERS_PER_REQUEST {
        return Err(Status::invalid_argument(format!(
            "user_ids: {count} users, more than the limit of {MAX_USERS_PER_REQUEST} per request"
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl PresenceApi for PresenceService {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let context = &self.context;
        let mut changes = Vec::new();
        let result =
            ops::register(&context.store, &context.metrics, context.clock.now(), request.get_ref(), &mut changes);
        context.publish(&changes);
        result.map(Response::new)
    }

    async fn renew(&self, request: Request<pb::RenewRequest>) -> Result<Response<pb::RenewResponse>, Status> {
        let context = &self.context;
        if self.leases.is_overloaded() {
            context.metrics.renewals(RenewResult::Shed, 1);
            context.metrics.shed.increment(1);
            return Err(Status::resource_exhausted(
                "renewal shed: the server is overloaded; the next heartbeat carries the same information",
            ));
        }
        let started = std::time::Instant::now();
        let mut changes = Vec::new();
        let (counted, result) = ops::renew(&context.store, context.clock.now(), request.get_ref(), &mut changes);
        context.metrics.renewal_seconds.record(started.elapsed().as_secs_f64());
        context.metrics.renewals(counted, 1);
        context.publish(&changes);
        result.map(Response::new)
    }

    async fn unregister(
        &self,
        request: Request<pb::UnregisterRequest>,
    ) -> Result<Response<pb::UnregisterResponse>, Status> {
        let context = &self.context;
        let mut changes = Vec::new();
        let result =
            ops::unregister(&context.store, &context.metrics, context.clock.now(), request.get_ref(), &mut changes);
        context.publish(&changes);
        result.map(Response::new)
    }

    async fn revoke(&self, request: Request<pb::RevokeRequest>) -> Result<Response<pb::RevokeResponse>, Status> {
        let context = &self.context;
        let request = request.into_inner();
        let session_id = (!request.session_id.is_empty()).then_some(request.session_id.as_str());
        let mut changes = Vec::new();
        let result = context.store.revoke(context.clock.now(), &request.user_id, session_id, &mut changes);
        context.publish(&changes);
        let revoked = result.map_err(status_of)?;
        Ok(Response::new(pb::RevokeResponse {
            revoked: revoked.count,
            changed: revoked.changed,
            presence: Some(user_presence(&request.user_id, revoked.presence)),
        }))
    }

    type LeasesStream = LeasesStream;

    async fn leases(
        &self,
        request: Request<Streaming<pb::LeaseBatch>>,
    ) -> Result<Response<Self::LeasesStream>, Status> {
        Ok(Response::new(leases::open(self.leases.clone(), request.into_inner())))
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<pb::SnapshotResponse>, Status> {
        let context = &self.context;
        let request = request.into_inner();
        check_user_count(request.user_ids.len())?;
        let mut changes = Vec::new();
        let result = context.store.snapshot(context.clock.now(), &request.user_ids, &mut changes);
        context.publish(&changes);
        let presences = result.map_err(status_of)?;
        let users = context.presences(&request.user_ids, &presences).await?;
        Ok(Response::new(pb::SnapshotResponse { users }))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let request = request.into_inner();
        check_user_count(request.user_ids.len())?;
        let user_ids: Vec<CompactString> = request.user_ids.iter().map(CompactString::from).collect();
        watch::open(Arc::clone(&self.context), user_ids).await.map(Response::new)
    }

    async fn touch(&self, request: Request<pb::TouchRequest>) -> Result<Response<pb::TouchResponse>, Status> {
        let request = request.into_inner();
        presence_core::validate_user_ids(std::slice::from_ref(&request.user_id))
            .map_err(|_| Status::invalid_argument("user_id: must be 1 to 128 bytes"))?;
        let context = &self.context;
        let last_active_at =
            context.activity.touch(&request.user_id, context.clock.now()).await.map_err(unavailable)?;
        Ok(Response::new(pb::TouchResponse { last_active_at_ms: i64::try_from(last_active_at).unwrap_or(i64::MAX) }))
    }

    async fn put_setting(
        &self,
        request: Request<pb::PutSettingRequest>,
    ) -> Result<Response<pb::PutSettingResponse>, Status> {
        let request = request.into_inner();
        presence_core::validate_user_ids(std::slice::from_ref(&request.user_id))
            .map_err(|_| Status::invalid_argument("user_id: must be 1 to 128 bytes"))?;
        if request.name.is_empty() || request.name.len() > MAX_SETTING_NAME_BYTES {
            return Err(Status::invalid_argument(format!("name: must be 1 to {MAX_SETTING_NAME_BYTES} bytes")));
        }
        if request.value.len() > MAX_SETTING_VALUE_BYTES {
            return Err(Status::invalid_argument(format!(
                "value: {} bytes, more than the limit of {MAX_SETTING_VALUE_BYTES}",
                request.value.len()
            )));
        }
        self.context.settings.put(request.user_id, request.name, request.value).await.map_err(unavailable)?;
        Ok(Response::new(pb::PutSettingResponse {}))
    }

    async fn get_settings(
        &self,
        request: Request<pb::GetSettingsRequest>,
    ) -> Result<Response<pb::GetSettingsResponse>, Status> {
        let request = request.into_inner();
        presence_core::validate_user_ids(std::slice::from_ref(&request.user_id))
            .map_err(|_| Status::invalid_argument("user_id: must be 1 to 128 bytes"))?;
        let settings = self.context.settings.get(request.user_id).await.map_err(unavailable)?;
        Ok(Response::new(pb::GetSettingsResponse { settings: settings.into_iter().collect() }))
    }
}
