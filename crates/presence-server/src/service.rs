//! The `presence.v1.Presence` gRPC service: requests in, store operations, flips published.
//!
//! Each handler reads the clock once, runs one store operation, publishes the
//! flips that operation caused (even when it refused the request: a refused
//! renewal may have found an expired lease) and answers.

use std::sync::Arc;

use presence_core::{CompactString, Presence, PresenceChange, Registration, State, Store, UnregisterOutcome};
use presence_proto::v1::{self as pb, presence_server::Presence as PresenceApi};
use tokio_util::sync::CancellationToken;
use tonic::{Request, Response, Status};

use crate::clock::StoreClock;
use crate::hub::Hub;
use crate::status::status_of;
use crate::watch::{self, WatchStream};

/// Most users one Snapshot or Watch may name.
pub const MAX_USERS_PER_REQUEST: usize = 10_000;

/// The service state shared by all requests.
#[derive(Debug, Clone)]
pub struct PresenceService {
    store: Arc<Store>,
    hub: Arc<Hub>,
    clock: StoreClock,
    /// Cancelled when the server shuts down, to end Watch streams.
    shutdown: CancellationToken,
}

impl PresenceService {
    pub(crate) fn new(store: Arc<Store>, hub: Arc<Hub>, clock: StoreClock, shutdown: CancellationToken) -> Self {
        PresenceService { store, hub, clock, shutdown }
    }

    fn publish(&self, changes: &[PresenceChange]) {
        self.hub.publish_all(changes);
        for change in changes {
            tracing::debug!(user_id = %change.user_id, state = ?change.presence.state, version = change.presence.version, "flip");
        }
    }
}

/// The wire form of a user's presence.
pub(crate) fn user_presence(user_id: &str, presence: Presence) -> pb::UserPresence {
    pb::UserPresence {
        user_id: user_id.to_owned(),
        state: match presence.state {
            State::Online => pb::State::Online,
            State::Offline => pb::State::Offline,
        } as i32,
        version: presence.version,
    }
}

/// A store tick as the API's `int64` Unix milliseconds.
fn unix_ms(tick: u64) -> i64 {
    i64::try_from(tick).unwrap_or(i64::MAX)
}

fn check_user_count(field: &str, count: usize) -> Result<(), Status> {
    if count > MAX_USERS_PER_REQUEST {
        return Err(Status::invalid_argument(format!(
            "{field}: {count} users, more than the limit of {MAX_USERS_PER_REQUEST} per request"
        )));
    }
    Ok(())
}

#[tonic::async_trait]
impl PresenceApi for PresenceService {
    async fn register(&self, request: Request<pb::RegisterRequest>) -> Result<Response<pb::RegisterResponse>, Status> {
        let request = request.into_inner();
        let mut metadata: Vec<(String, String)> = request.metadata.into_iter().collect();
        metadata.sort_unstable();
        let registration = Registration {
            user_id: &request.user_id,
            session_id: &request.session_id,
            gateway_id: &request.gateway_id,
            ttl_ms: request.ttl_ms,
            metadata: &metadata,
        };
        let mut changes = Vec::new();
        let result = self.store.register(self.clock.now(), &registration, &mut changes);
        self.publish(&changes);
        let registered = result.map_err(status_of)?;
        Ok(Response::new(pb::RegisterResponse {
            generation: registered.generation,
            changed: registered.changed,
            presence: Some(user_presence(&request.user_id, registered.presence)),
            expires_at_ms: unix_ms(registered.expires_at),
        }))
    }

    async fn renew(&self, request: Request<pb::RenewRequest>) -> Result<Response<pb::RenewResponse>, Status> {
        let request = request.into_inner();
        let mut changes = Vec::new();
        let result = self.store.renew(
            self.clock.now(),
            &request.user_id,
            &request.session_id,
            request.generation,
            request.ttl_ms,
            &mut changes,
        );
        self.publish(&changes);
        let renewed = result.map_err(status_of)?;
        Ok(Response::new(pb::RenewResponse { expires_at_ms: unix_ms(renewed.expires_at) }))
    }

    async fn unregister(
        &self,
        request: Request<pb::UnregisterRequest>,
    ) -> Result<Response<pb::UnregisterResponse>, Status> {
        let request = request.into_inner();
        let mut changes = Vec::new();
        let result = self.store.unregister(
            self.clock.now(),
            &request.user_id,
            &request.session_id,
            request.generation,
            request.linger_ms,
            &mut changes,
        );
        self.publish(&changes);
        let unregistered = result.map_err(status_of)?;
        let (removed, outcome) = match unregistered.outcome {
            UnregisterOutcome::Removed => (true, pb::UnregisterOutcome::Removed),
            UnregisterOutcome::Lingering { .. } => (true, pb::UnregisterOutcome::Lingering),
            UnregisterOutcome::StaleGeneration { .. } => (false, pb::UnregisterOutcome::StaleGeneration),
            UnregisterOutcome::NotFound => (false, pb::UnregisterOutcome::NotFound),
        };
        Ok(Response::new(pb::UnregisterResponse {
            removed,
            changed: unregistered.changed,
            presence: Some(user_presence(&request.user_id, unregistered.presence)),
            outcome: outcome as i32,
        }))
    }

    async fn revoke(&self, request: Request<pb::RevokeRequest>) -> Result<Response<pb::RevokeResponse>, Status> {
        let request = request.into_inner();
        let session_id = (!request.session_id.is_empty()).then_some(request.session_id.as_str());
        let mut changes = Vec::new();
        let result = self.store.revoke(self.clock.now(), &request.user_id, session_id, &mut changes);
        self.publish(&changes);
        let revoked = result.map_err(status_of)?;
        Ok(Response::new(pb::RevokeResponse {
            revoked: revoked.count,
            changed: revoked.changed,
            presence: Some(user_presence(&request.user_id, revoked.presence)),
        }))
    }

    async fn snapshot(&self, request: Request<pb::SnapshotRequest>) -> Result<Response<pb::SnapshotResponse>, Status> {
        let request = request.into_inner();
        check_user_count("user_ids", request.user_ids.len())?;
        let mut changes = Vec::new();
        let result = self.store.snapshot(self.clock.now(), &request.user_ids, &mut changes);
        self.publish(&changes);
        let presences = result.map_err(status_of)?;
        let users = request.user_ids.iter().zip(presences).map(|(id, presence)| user_presence(id, presence)).collect();
        Ok(Response::new(pb::SnapshotResponse { users }))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<pb::WatchRequest>) -> Result<Response<Self::WatchStream>, Status> {
        let request = request.into_inner();
        check_user_count("user_ids", request.user_ids.len())?;
        let user_ids: Vec<CompactString> = request.user_ids.iter().map(CompactString::from).collect();
        let stream =
            watch::open(Arc::clone(&self.store), Arc::clone(&self.hub), self.clock, user_ids, self.shutdown.clone())?;
        Ok(Response::new(stream))
    }
}
