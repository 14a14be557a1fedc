//! The `presence.v1.Presence` gRPC service: requests in, store operations, flips published.
//!
//! Each handler reads the clock once, runs one store operation, publishes the
//! flips that operation caused (even when it refused the request: a refused
//! renewal may have found an expired lease) and answers.

use std::sync::Arc;

use presence_core::CompactString;
use presence_proto::lease_frames::LeaseBatchFrame;
use presence_proto::v1::{self as pb, presence_server::Presence as PresenceApi};
use tonic::{Request, Response, Status, Streaming};

use crate::auth::Caller;
use crate::context::{Context, Shown, unavailable};
use crate::durable::{RelationWrite, run_blocking};
use crate::leases::{self, LeaseQueue, LeasesStream};
use crate::metrics::RenewResult;
use crate::ops::{self, user_presence};
use crate::privacy::{RelationChange, Visibility};
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

impl PresenceService {
    fn caller<T>(&self, request: &Request<T>) -> Result<Caller, Status> {
        self.context.auth.caller(request.metadata())
    }

    /// Authenticates a caller that must be a service.
    fn service_only<T>(&self, request: &Request<T>, operation: &str) -> Result<(), Status> {
        self.caller(request)?.require_service(operation)
    }

    /// Who a Snapshot or Watch answers for: the viewer itself, or the viewer a
    /// service names; `None` is a service acting for no viewer.
    fn acting_viewer<T>(&self, request: &Request<T>, viewer_id: &str) -> Result<Option<CompactString>, Status> {
        let viewer = self.caller(request)?.acting_viewer(viewer_id);
        if let Some(viewer) = &viewer {
            check_id("viewer_id", viewer)?;
        }
        Ok(viewer.map(CompactString::from))
    }
}

/// An id field: 1 to 128 bytes.
fn check_id(field: &str, id: &str) -> Result<(), Status> {
    if id.is_empty() || id.len() > presence_core::MAX_ID_BYTES {
        return Err(Status::invalid_argument(format!(
            "{field}: must be 1 to {} bytes, got {}",
            presence_core::MAX_ID_BYTES,
            id.len()
        )));
    }
    Ok(())
}

/// A list of ids: 1 to [`MAX_USERS_PER_REQUEST`] of them, each 1 to 128 bytes.
fn check_ids(field: &str, ids: &[String]) -> Result<Vec<CompactString>, Status> {
    if ids.is_empty() {
        return Err(Status::invalid_argument(format!("{field}: must name at least one id")));
    }
    check_user_count_named(field, ids.len())?;
    for (index, id) in ids.iter().enumerate() {
        check_id(&format!("{field}[{index}]"), id)?;
    }
    Ok(ids.iter().map(CompactString::from).collect())
}

fn check_user_count_named(field: &str, count: usize) -> Result<(), Status> {
    if count > MAX_USERS_PER_REQUEST {
        return Err(Status::invalid_argument(format!(
            "{field}: {count} ids, more than the limit of {MAX_USERS_PER_REQUEST} per request"
        )));
    }
    Ok(())
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
        self.service_only(&request, "Register")?;
        let context = &self.context;
        let mut changes = Vec::new();
        let result =
            ops::register(&context.store, &context.metrics, context.clock.now(), request.get_ref(), &mut changes);
        context.publish(&changes);
        result.map(Response::new)
    }

    async fn renew(&self, request: Request<pb::RenewRequest>) -> Result<Response<pb::RenewResponse>, Status> {
        self.service_only(&request, "Renew")?;
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
        self.service_only(&request, "Unregister")?;
        let context = &self.context;
        let mut changes = Vec::new();
        let result =
            ops::unregister(&context.store, &context.metrics, context.clock.now(), request.get_ref(), &mut changes);
        context.publish(&changes);
        result.map(Response::new)
    }

    async fn revoke(&self, request: Request<pb::RevokeRequest>) -> Result<Response<pb::RevokeResponse>, Status> {
        self.service_only(&request, "Revoke")?;
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
        request: Request<Streaming<LeaseBatchFrame>>,
    ) -> Result<Response<Self::LeasesStream>, Status> {
        self.service_only(&request, "Leases")?;
        Ok(Response::new(leases::open(self.leases.clone(), request.into_inner())))
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<pb::SnapshotResponse>, Status> {
        let viewer = self.acting_viewer(&request, &request.get_ref().viewer_id)?;
        let request = request.into_inner();
        check_user_count(request.user_ids.len())?;
        let context = &self.context;
        let shown = context.shown(viewer.as_deref(), &request.user_ids)?;
        let users = context.wire(&request.user_ids, &shown, viewer.is_none()).await?;
        Ok(Response::new(pb::SnapshotResponse { users }))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let viewer = self.acting_viewer(&request, &request.get_ref().viewer_id)?;
        let request = request.into_inner();
        check_user_count(request.user_ids.len())?;
        let batch_window = watch::batch_window(request.batch_window_ms)?;
        let user_ids: Vec<CompactString> = request.user_ids.iter().map(CompactString::from).collect();
        watch::open(Arc::clone(&self.context), user_ids, viewer, batch_window).await.map(Response::new)
    }

    async fn set_status(
        &self,
        request: Request<pb::SetStatusRequest>,
    ) -> Result<Response<pb::SetStatusResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        check_id("user_id", &request.user_id)?;
        caller.require_self_or_service(&request.user_id, "SetStatus")?;
        let context = &self.context;
        let now = context.clock.now();
        let status = match request.status {
            None => None,
            Some(status) => Some(status_from_wire(status, now)?),
        };
        let _writer = context.relations_writer.lock().await;
        if let Some(durable) = &context.durable {
            let durable = Arc::clone(durable);
            let user_id = request.user_id.clone();
            let stored = status.as_ref().map(|s: &presence_core::Status| {
                (availability_code(s.availability), s.expires_at.unwrap_or(0), s.text.clone())
            });
            run_blocking(move || {
                let stored = stored.as_ref().map(|(code, expires_at, text)| (*code, *expires_at, text.as_str()));
                durable.write_relations(&RelationWrite::Status(&user_id, stored))
            })
            .await
            .map_err(unavailable)?;
        }
        let mut changes = Vec::new();
        let result = context.store.set_status(context.clock.now(), &request.user_id, status, &mut changes);
        context.publish(&changes);
        let view = result.map_err(status_of)?;
        let shown = [Shown { view, visible: true }];
        let presence = context.wire(&[request.user_id.as_str()], &shown, false).await?.pop();
        Ok(Response::new(pb::SetStatusResponse { presence }))
    }

    async fn set_visibility(
        &self,
        request: Request<pb::SetVisibilityRequest>,
    ) -> Result<Response<pb::SetVisibilityResponse>, Status> {
        let caller = self.caller(&request)?;
        let request = request.into_inner();
        check_id("user_id", &request.user_id)?;
        caller.require_self_or_service(&request.user_id, "SetVisibility")?;
        let visibility = Visibility::from_code(i64::from(request.visibility)).ok_or_else(|| {
            Status::invalid_argument(
                "visibility: must be VISIBILITY_EVERYONE, VISIBILITY_AUDIENCE or VISIBILITY_NOBODY",
            )
        })?;
        let change = RelationChange::Visibility { user: request.user_id.as_str().into(), visibility };
        self.context.change_relations(change).await?;
        Ok(Response::new(pb::SetVisibilityResponse {}))
    }

    async fn grant_audience(
        &self,
        request: Request<pb::AudienceRequest>,
    ) -> Result<Response<pb::AudienceResponse>, Status> {
        self.change_audience(request, true).await
    }

    async fn revoke_audience(
        &self,
        request: Request<pb::AudienceRequest>,
    ) -> Result<Response<pb::AudienceResponse>, Status> {
        self.change_audience(request, false).await
    }

    async fn join_group(&self, request: Request<pb::GroupRequest>) -> Result<Response<pb::GroupResponse>, Status> {
        self.change_group(request, true).await
    }

    async fn leave_group(&self, request: Request<pb::GroupRequest>) -> Result<Response<pb::GroupResponse>, Status> {
        self.change_group(request, false).await
    }

    async fn touch(&self, request: Request<pb::TouchRequest>) -> Result<Response<pb::TouchResponse>, Status> {
        self.service_only(&request, "Touch")?;
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
        self.service_only(&request, "PutSetting")?;
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
        self.service_only(&request, "GetSettings")?;
        let request = request.into_inner();
        presence_core::validate_user_ids(std::slice::from_ref(&request.user_id))
            .map_err(|_| Status::invalid_argument("user_id: must be 1 to 128 bytes"))?;
        let settings = self.context.settings.get(request.user_id).await.map_err(unavailable)?;
        Ok(Response::new(pb::GetSettingsResponse { settings: settings.into_iter().collect() }))
    }
}

impl PresenceService {
    async fn change_audience(
        &self,
        request: Request<pb::AudienceRequest>,
        grant: bool,
    ) -> Result<Response<pb::AudienceResponse>, Status> {
        self.service_only(&request, if grant { "GrantAudience" } else { "RevokeAudience" })?;
        let request = request.into_inner();
        check_id("user_id", &request.user_id)?;
        let viewers = check_ids("viewer_ids", &request.viewer_ids)?;
        let change = RelationChange::Audience { user: request.user_id.as_str().into(), viewers, grant };
        self.context.change_relations(change).await?;
        Ok(Response::new(pb::AudienceResponse {}))
    }

    async fn change_group(
        &self,
        request: Request<pb::GroupRequest>,
        join: bool,
    ) -> Result<Response<pb::GroupResponse>, Status> {
        self.service_only(&request, if join { "JoinGroup" } else { "LeaveGroup" })?;
        let request = request.into_inner();
        check_id("group_id", &request.group_id)?;
        let users = check_ids("user_ids", &request.user_ids)?;
        let change = RelationChange::Membership { group: request.group_id.as_str().into(), users, join };
        self.context.change_relations(change).await?;
        Ok(Response::new(pb::GroupResponse {}))
    }
}

/// The code a status's availability is stored under.
pub(crate) fn availability_code(availability: presence_core::Availability) -> u8 {
    match availability {
        presence_core::Availability::Available => 1,
        presence_core::Availability::Away => 2,
        presence_core::Availability::DoNotDisturb => 3,
    }
}

/// The availability of a stored or wire code.
pub(crate) fn availability_from_code(code: i64) -> Option<presence_core::Availability> {
    match code {
        1 => Some(presence_core::Availability::Available),
        2 => Some(presence_core::Availability::Away),
        3 => Some(presence_core::Availability::DoNotDisturb),
        _ => None,
    }
}

/// A status from the wire; refusals name the field.
fn status_from_wire(status: pb::Status, now: u64) -> Result<presence_core::Status, Status> {
    let availability = availability_from_code(i64::from(status.availability)).ok_or_else(|| {
        Status::invalid_argument(
            "status.availability: must be AVAILABILITY_AVAILABLE, AVAILABILITY_AWAY or AVAILABILITY_DO_NOT_DISTURB",
        )
    })?;
    presence_core::validate_status_text(&status.text)
        .map_err(|err| Status::invalid_argument(format!("status.{err}")))?;
    let expires_at = match status.expires_at_ms {
        0 => None,
        at if at < 0 || (at as u64) <= now => {
            return Err(Status::invalid_argument("status.expires_at_ms: must be in the future (or 0: never)"));
        }
        at => Some(at as u64),
    };
    Ok(presence_core::Status { availability, text: status.text, expires_at })
}
