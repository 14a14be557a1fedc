//! The lease operations, shared by the unary RPCs and the items of a Leases
//! batch so that both answer and count alike.
//!
//! Each takes a core input (see `node/wire.rs` for where requests become inputs),
//! runs one store operation at `now`, appends the changes it caused to
//! `changes` (the caller publishes them, whatever the result) and counts the
//! outcome.

use presence_core::{Changes, LeaseError, Registered, Renewed, RoomRef, Store, UnregisterOutcome, Unregistered};
use presence_proto::v1 as pb;

use crate::error::ServiceError;
use crate::metrics::{Metrics, RenewResult};
use crate::node::wire::{self, JoinInput, RegisterInput, RenewInput, SignalInput, UnregisterInput};

pub(crate) fn register(
    store: &Store,
    metrics: &Metrics,
    now: u64,
    input: &RegisterInput<'_>,
    changes: &mut Changes,
) -> Result<Registered, ServiceError> {
    match store.register_attending(now, &input.registration(), &input.attention, changes) {
        Ok(registered) => {
            metrics.registers_ok.increment(1);
            if registered.replaced {
                metrics.reconnects.increment(1);
            }
            Ok(registered)
        }
        Err(err) => {
            metrics.registers_invalid.increment(1);
            Err(err.into())
        }
    }
}

/// A renewal that reports a change of its session's attention (A1): the
/// renewal, then the change to the lease it renewed. Renewals without one
/// never come here (they go to the store together, as they always did).
pub(crate) fn renew_with_attention(
    store: &Store,
    now: u64,
    input: &RenewInput<'_>,
    changes: &mut Changes,
) -> Result<Renewed, LeaseError> {
    let renewal = &input.renewal;
    let renewed = store.renew(now, renewal.user_id, renewal.session_id, renewal.generation, renewal.ttl_ms, changes)?;
    store.set_attention(now, (renewal.user_id, renewal.session_id, renewal.generation), &input.attention, changes)?;
    Ok(renewed)
}

/// How a renewal's answer is counted; a batch counts its renewals once.
pub(crate) fn renew_result(renewed: &Result<Renewed, LeaseError>) -> RenewResult {
    match renewed {
        Ok(renewed) if renewed.throttled => RenewResult::Throttled,
        Ok(_) => RenewResult::Ok,
        Err(LeaseError::NotFound { .. }) => RenewResult::NotFound,
        Err(LeaseError::StaleGeneration { .. }) => RenewResult::StaleGeneration,
        Err(LeaseError::InvalidArgument { .. }) => RenewResult::Invalid,
        // A renewal is refused for none of these.
        Err(LeaseError::NotInRoom { .. } | LeaseError::SignalRateExceeded { .. }) => RenewResult::Invalid,
    }
}

pub(crate) fn unregister(
    store: &Store,
    metrics: &Metrics,
    now: u64,
    input: UnregisterInput<'_>,
    changes: &mut Changes,
) -> Result<Unregistered, ServiceError> {
    let unregistered =
        store.unregister(now, input.user_id, input.session_id, input.generation, input.linger_ms, changes)?;
    let counter = match unregistered.outcome {
        UnregisterOutcome::Removed => &metrics.unregisters_removed,
        UnregisterOutcome::Lingering { .. } => &metrics.unregisters_lingering,
        UnregisterOutcome::StaleGeneration { .. } => &metrics.unregisters_stale,
        UnregisterOutcome::NotFound => &metrics.unregisters_not_found,
    };
    counter.increment(1);
    Ok(unregistered)
}

/// Puts a session in a room (R1), answered as the wire says.
pub(crate) fn join(
    store: &Store,
    metrics: &Metrics,
    now: u64,
    input: &JoinInput<'_>,
    changes: &mut Changes,
) -> Result<pb::JoinResponse, ServiceError> {
    let joined = store.join(now, &input.room, &input.metadata, changes)?;
    metrics.room_joins.increment(1);
    Ok(wire::join_response(&joined))
}

/// Takes a session out of a room.
pub(crate) fn leave(
    store: &Store,
    now: u64,
    room: &RoomRef<'_>,
    changes: &mut Changes,
) -> Result<pb::LeaveResponse, ServiceError> {
    Ok(wire::leave_response(&store.leave(now, room, changes)?))
}

/// Sets, extends or clears a session's signal in a room (S3).
pub(crate) fn signal(
    store: &Store,
    metrics: &Metrics,
    now: u64,
    input: &SignalInput<'_>,
    changes: &mut Changes,
) -> Result<pb::SignalResponse, ServiceError> {
    let signalled = store.signal(now, &input.room, input.kind, input.ttl_ms, changes)?;
    metrics.signals.increment(1);
    Ok(wire::signal_response(&signalled))
}
