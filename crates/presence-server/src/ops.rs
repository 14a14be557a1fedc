//! The lease operations, from wire request to wire response, shared by the
//! unary RPCs and the items of a Leases batch so that both answer alike.
//!
//! Each function runs one store operation at `now`, appends the flips it
//! caused to `changes` (the caller publishes them, whatever the result) and
//! counts the outcome.

use presence_core::{LeaseError, Presence, Registration, State, Store, UnregisterOutcome};
use presence_proto::v1 as pb;
use tonic::Status;

use crate::metrics::{Metrics, RenewResult};
use crate::status::status_of;

/// The wire form of a user's presence.
pub(crate) fn user_presence(user_id: &str, presence: Presence) -> pb::UserPresence {
    pb::UserPresence {
        user_id: user_id.to_owned(),
        state: match presence.state {
            State::Online => pb::State::Online,
            State::Offline => pb::State::Offline,
        } as i32,
        version: presence.version,
        ..pb::UserPresence::default()
    }
}

/// The wire form of a status.
pub(crate) fn status_wire(status: &presence_core::Status) -> pb::Status {
    pb::Status {
        availability: match status.availability {
            presence_core::Availability::Available => pb::Availability::Available,
            presence_core::Availability::Away => pb::Availability::Away,
            presence_core::Availability::DoNotDisturb => pb::Availability::DoNotDisturb,
        } as i32,
        text: status.text.clone(),
        expires_at_ms: status.expires_at.map_or(0, unix_ms),
    }
}

/// A store tick as the API's `int64` Unix milliseconds.
fn unix_ms(tick: u64) -> i64 {
    i64::try_from(tick).unwrap_or(i64::MAX)
}

pub(crate) fn register(
    store: &Store,
    metrics: &Metrics,
    now: u64,
    request: &pb::RegisterRequest,
    changes: &mut presence_core::Changes,
) -> Result<pb::RegisterResponse, Status> {
    let mut metadata: Vec<(String, String)> =
        request.metadata.iter().map(|(key, value)| (key.clone(), value.clone())).collect();
    metadata.sort_unstable();
    let registration = Registration {
        user_id: &request.user_id,
        session_id: &request.session_id,
        gateway_id: &request.gateway_id,
        ttl_ms: request.ttl_ms,
        metadata: &metadata,
    };
    match store.register(now, &registration, changes) {
        Ok(registered) => {
            metrics.registers_ok.increment(1);
            if registered.replaced {
                metrics.reconnects.increment(1);
            }
            Ok(pb::RegisterResponse {
                generation: registered.generation,
                changed: registered.changed,
                presence: Some(user_presence(&request.user_id, registered.presence)),
                expires_at_ms: unix_ms(registered.expires_at),
            })
        }
        Err(err) => {
            metrics.registers_invalid.increment(1);
            Err(status_of(err))
        }
    }
}

/// Applies a renewal; returns how it is counted beside the answer, so that a
/// batch can count its renewals once.
pub(crate) fn renew(
    store: &Store,
    now: u64,
    request: &pb::RenewRequest,
    changes: &mut presence_core::Changes,
) -> (RenewResult, Result<pb::RenewResponse, Status>) {
    renew_answer(store.renew(now, &request.user_id, &request.session_id, request.generation, request.ttl_ms, changes))
}

/// A renewal's answer on the wire, and how it is counted.
pub(crate) fn renew_answer(
    renewed: Result<presence_core::Renewed, LeaseError>,
) -> (RenewResult, Result<pb::RenewResponse, Status>) {
    match renewed {
        Ok(renewed) => (
            if renewed.throttled { RenewResult::Throttled } else { RenewResult::Ok },
            Ok(pb::RenewResponse { expires_at_ms: unix_ms(renewed.expires_at), throttled: renewed.throttled }),
        ),
        Err(err) => {
            let result = match err {
                LeaseError::NotFound { .. } => RenewResult::NotFound,
                LeaseError::StaleGeneration { .. } => RenewResult::StaleGeneration,
                LeaseError::InvalidArgument { .. } => RenewResult::Invalid,
            };
            (result, Err(status_of(err)))
        }
    }
}

pub(crate) fn unregister(
    store: &Store,
    metrics: &Metrics,
    now: u64,
    request: &pb::UnregisterRequest,
    changes: &mut presence_core::Changes,
) -> Result<pb::UnregisterResponse, Status> {
    let unregistered = store
        .unregister(now, &request.user_id, &request.session_id, request.generation, request.linger_ms, changes)
        .map_err(status_of)?;
    let (removed, outcome, counter) = match unregistered.outcome {
        UnregisterOutcome::Removed => (true, pb::UnregisterOutcome::Removed, &metrics.unregisters_removed),
        UnregisterOutcome::Lingering { .. } => (true, pb::UnregisterOutcome::Lingering, &metrics.unregisters_lingering),
        UnregisterOutcome::StaleGeneration { .. } => {
            (false, pb::UnregisterOutcome::StaleGeneration, &metrics.unregisters_stale)
        }
        UnregisterOutcome::NotFound => (false, pb::UnregisterOutcome::NotFound, &metrics.unregisters_not_found),
    };
    counter.increment(1);
    Ok(pb::UnregisterResponse {
        removed,
        changed: unregistered.changed,
        presence: Some(user_presence(&request.user_id, unregistered.presence)),
        outcome: outcome as i32,
    })
}
