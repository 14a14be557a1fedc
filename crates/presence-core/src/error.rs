//! The one error type of the lease core.

use compact_str::CompactString;
use thiserror::Error;

/// Why the lease store refused an operation. Every refusal changes nothing.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LeaseError {
    /// A request field is malformed or out of bounds; `field` is its wire name
    /// (`user_id`, `ttl_ms`, ...), so a caller can see which one to fix.
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// The request field at fault, as named in the API.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The session holds no live lease: it was never registered, or it expired,
    /// was revoked or was unregistered. The caller must register again.
    #[error("no live lease for session {session_id:?} of user {user_id:?}")]
    NotFound {
        /// The user named in the request.
        user_id: CompactString,
        /// The session named in the request.
        session_id: CompactString,
    },
    /// The request carries an older generation than the session's current one:
    /// a newer connection owns the session, and this caller must stop using it.
    #[error(
        "generation {given} of session {session_id:?} of user {user_id:?} is older than the current generation {current}"
    )]
    StaleGeneration {
        /// The user named in the request.
        user_id: CompactString,
        /// The session named in the request.
        session_id: CompactString,
        /// The generation the request carried.
        given: u64,
        /// The session's current generation.
        current: u64,
    },
    /// The session named is not in the room: it never joined, left, or the
    /// lease it joined with was replaced (R6, S3).
    #[error("session {session_id:?} of user {user_id:?} is not in room {room_id:?}")]
    NotInRoom {
        /// The user named in the request.
        user_id: CompactString,
        /// The session named in the request.
        session_id: CompactString,
        /// The room named in the request.
        room_id: CompactString,
    },
    /// The session changed signal sets more often than
    /// [`SIGNAL_CHANGES_PER_SECOND`](crate::SIGNAL_CHANGES_PER_SECOND) allows (S3).
    #[error("session {session_id:?} of user {user_id:?} changed signals more than {per_second} times in a second")]
    SignalRateExceeded {
        /// The user named in the request.
        user_id: CompactString,
        /// The session named in the request.
        session_id: CompactString,
        /// The bound it ran into.
        per_second: u32,
    },
}

impl LeaseError {
    pub(crate) fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        LeaseError::InvalidArgument { field, reason: reason.into() }
    }
}
