//! Every refusal the service gives, and the one table from them to gRPC
//! statuses.
//!
//! Handlers, the Leases path, authentication and the durable store all fail
//! with a [`ServiceError`]; only [`From<ServiceError> for tonic::Status`]
//! decides which code a caller sees, so a refusal reads the same whichever way
//! it was reached (a unary call or an item of a batch). A refused field is
//! named twice: in the message, for people, and as a `google.rpc.BadRequest`
//! field violation in the status details, for programs.

use std::borrow::Cow;

use presence_core::{CompactString, LeaseError};
use tonic::{Code, Status};
use tonic_types::{ErrorDetails, StatusExt};

use presence_proto::v1 as pb;
use prost::Message as _;

use crate::node::storage::durable::DurableError;

/// A refusal's pointer to a slot's owner (`presence.v1.NotOwner`): what a
/// node that does not act for a user says of the node that does (C2).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct NotOwner {
    pub(crate) slot: u32,
    pub(crate) epoch: i64,
    pub(crate) owner_id: String,
    pub(crate) owner_addr: String,
    /// The slot is this node's, frozen for the last step of a move (C7): a
    /// request may wait the freeze out here instead of being refused.
    pub(crate) frozen: bool,
}

/// Why the service refused a request. Every refusal changed nothing.
#[derive(Debug, thiserror::Error)]
pub(crate) enum ServiceError {
    /// A request field is malformed or out of bounds (B1).
    #[error("{field}: {reason}")]
    InvalidArgument {
        /// The field at fault as the API names it, with an index into a list
        /// where it helps (`user_ids[3]`).
        field: Cow<'static, str>,
        /// What is wrong with it.
        reason: String,
    },
    /// The store refused a lease operation (L2, L3): no live lease
    /// (`NOT_FOUND`), or an older generation than the session's
    /// (`FAILED_PRECONDITION`). Never `LeaseError::InvalidArgument`, which
    /// converts into [`ServiceError::InvalidArgument`].
    #[error(transparent)]
    Lease(LeaseError),
    /// The caller is authenticated but may not do this (P1).
    #[error("{operation}: {reason}")]
    PermissionDenied {
        /// The RPC refused.
        operation: &'static str,
        /// Why.
        reason: &'static str,
    },
    /// A service credential without the scope the call needs (T3).
    #[error("{operation} needs the `{scope}` scope; credential {credential:?} has {scopes}")]
    MissingScope {
        /// The RPC refused.
        operation: &'static str,
        /// The scope it needs.
        scope: crate::auth::scopes::Scope,
        /// The credential's name (never its token).
        credential: std::sync::Arc<str>,
        /// The scopes it has.
        scopes: crate::auth::scopes::Scopes,
    },
    /// A stream's viewer token passed its `exp` plus the leeway (T3): the
    /// client opens it again with a fresh token.
    #[error("credentials expired: the token's exp has passed; open the stream again with a fresh token")]
    CredentialsExpired,
    /// A stream's credential was removed, or the key of its token rotated
    /// out (T3).
    #[error("credentials no longer accepted: the credential was removed or its signing key rotated out")]
    CredentialsRevoked,
    /// The caller's credentials are missing or not accepted (P1). The reason
    /// never tells which tokens or keys exist.
    #[error("{0}")]
    Unauthenticated(Cow<'static, str>),
    /// A new setting of a user that has as many as one may have.
    #[error("PutSetting: user {user_id} has {most} settings, the most one user may have; replace one of them")]
    TooManySettings {
        /// The user.
        user_id: String,
        /// The limit.
        most: usize,
    },
    /// A renewal shed under overload (B2): the next heartbeat carries the same information.
    #[error("renewal shed: the server is overloaded; the next heartbeat carries the same information")]
    RenewalShed,
    /// The durable store failed; nothing was acknowledged (B4).
    #[error("{0}; nothing was changed, retry")]
    Durable(#[from] DurableError),
    /// No open Watch of this caller has this id (E7): it ended, it never
    /// existed, or another caller opened it, which reads the same.
    #[error("watch_id: no open watch {watch_id:?} of this caller")]
    WatchNotFound {
        /// The id asked for.
        watch_id: CompactString,
    },
    /// The room does not exist or the caller may not read it (R4): the two read alike.
    #[error("room_id: no room {room_id:?} this caller may read")]
    RoomNotFound {
        /// The room asked for.
        room_id: CompactString,
    },
    /// A member list of a room past the member cap (R6).
    #[error(
        "room {room_id:?} has more than {cap} members (--room-member-cap): watch it in count mode (ROOM_WATCH_COUNT)"
    )]
    RoomTooLarge {
        /// The room asked for.
        room_id: CompactString,
        /// The server's member cap.
        cap: usize,
    },
    /// The server is shutting down; the client reconnects.
    #[error("presenced is shutting down; reconnect")]
    ShuttingDown,
    /// A cluster node that may not act for the request's user (C2): the
    /// detail names the owner to go to.
    #[error("{}", not_owner_message(.0))]
    NotOwner(NotOwner),
    /// Another node refused or failed a request forwarded to it (C2): its
    /// code, and its message with the node named.
    #[error("node at {node}: {}", .status.message())]
    Peer {
        /// The node's address.
        node: String,
        /// Its answer.
        status: tonic::Status,
    },
    /// Another node said nothing, or not all it owed, within this node's
    /// wait. The wait is bounded here, not by a grpc-timeout (which tonic
    /// reports as CANCELLED), so that the caller reads DEADLINE_EXCEEDED.
    #[error("node at {node}: no {awaited} within {within:?}")]
    PeerTimedOut {
        /// The node's address (or id).
        node: String,
        /// What was awaited: `answer`, `opening snapshot`...
        awaited: &'static str,
        /// How long.
        within: std::time::Duration,
    },
    /// Another node ended its answer before it was whole: a node stopping,
    /// which another try meets no more.
    #[error("node at {node}: its answer ended without {awaited}")]
    PeerEnded {
        /// The node's address.
        node: String,
        /// What never came.
        awaited: &'static str,
    },
    /// Another node's address, or an answer of it, that this node cannot
    /// use: a fault of the cluster's, not of the caller's request.
    #[error("node at {node}: {reason}")]
    PeerUnusable {
        /// The node's address (or id).
        node: String,
        /// What is wrong.
        reason: String,
    },
    /// Another node speaks a major version of the node-to-node protocol
    /// this node cannot read (D1).
    #[error(
        "a node running presenced {their_version} speaks node-to-node protocol {theirs}, which this node \
         (presenced {}, protocol {ours}) cannot read: the nodes of a cluster must share the protocol's major version",
        env!("CARGO_PKG_VERSION")
    )]
    ProtocolMismatch {
        /// The sender's protocol.
        theirs: String,
        /// The sender's presenced version.
        their_version: String,
        /// This node's protocol.
        ours: String,
    },
    /// A room's owner did not take a change of its members (C1): the
    /// member's own state changed, and the call may be made again.
    #[error("the owner of the room ({node}) did not take the change yet; the call may be made again")]
    RoomOwnerUnreachable {
        /// The room's owner, as this node saw it.
        node: String,
    },
    /// Room facts, or a room read, reached a node that does not own the room.
    #[error("room {room_id:?}: this node does not own its slot")]
    RoomsNotHere {
        /// The room.
        room_id: String,
    },
    /// Counts of rooms (R7) whose owners could not answer now: moving, or unreachable.
    #[error("room {room_id:?} (and {more} more): its owner could not answer now; try again shortly")]
    RoomCountsUnanswered {
        /// The first such room asked for.
        room_id: String,
        /// How many more.
        more: usize,
    },
    /// A room whose slot this node just gained and whose members it is
    /// still gathering from the other nodes.
    #[error("room {room_id:?}: its slot came to this node and its members are being gathered; try again shortly")]
    RoomRebuilding {
        /// The room.
        room_id: String,
    },
    /// Some nodes of the cluster did not take their part of a call that
    /// needs every node (P7: an erase removes the user from the audiences
    /// each node holds; an export lists them). What could be done was done;
    /// the call is idempotent and may be made again.
    #[error("{operation}: {} did not answer: {}; call again", .nodes.join(", "), .reason)]
    NodesUnreached {
        /// The RPC.
        operation: &'static str,
        /// Each node that did not answer, by id and address.
        nodes: Vec<String>,
        /// What was done regardless, and what the first failure said.
        reason: String,
    },
    /// A Changes cursor the feed cannot resume from (F2): older than what
    /// it retains, or not one of its own. The detail carries the oldest
    /// cursor it can resume from.
    #[error("cursor: {why}; resync from a Snapshot, then resume from the oldest cursor (the ChangesOutOfRange detail)")]
    FeedOutOfRange {
        /// Resumes at the oldest change the feed holds.
        oldest: presence_feed::Cursor,
        /// What is wrong with the cursor.
        why: &'static str,
    },
    /// A node that keeps no change feed: turned off.
    #[error("Changes: this node keeps no change feed (it is turned off with --feed-retention-bytes 0)")]
    NoFeed,
    /// A task of the server's own failed.
    #[error("{0}")]
    Internal(String),
    /// A Cluster RPC at a node that is not one of a cluster.
    #[error("{operation}: this node is not one of a cluster (serve --etcd)")]
    NotClustered {
        /// The RPC refused.
        operation: &'static str,
    },
    /// A planned move that cannot be made as asked (C3): nothing changed.
    #[error("{0}")]
    MoveRefused(String),
    /// A planned move that failed part-way (C3): the slots it names stayed
    /// where they were, with their state.
    #[error("{0}")]
    MoveAborted(String),
    /// etcd could not be reached, or refused a step.
    #[error("etcd: {0}")]
    Etcd(String),
    /// A stream that cannot go on as it is (a part of a merged Watch ended
    /// or resynced, this node stopped acting for a watched user, a room's
    /// owner ended its relayed watch): the client opens it again, resuming
    /// with the versions it holds (E8).
    #[error("{0}")]
    Reopen(String),
}

fn not_owner_message(not_owner: &NotOwner) -> String {
    let NotOwner { slot, epoch, owner_id, owner_addr, frozen } = not_owner;
    if *frozen {
        format!(
            "slot {slot} is moving between nodes (epoch {epoch}) and stayed frozen longer than requests wait for it; \
             retry after a backoff"
        )
    } else if owner_id.is_empty() {
        format!("slot {slot} has no owner that may act now (epoch {epoch}); retry after a backoff")
    } else {
        format!(
            "slot {slot} is owned by node {owner_id} at {owner_addr} (epoch {epoch}); send its users' requests there"
        )
    }
}

/// `presence.v1.NotOwner`'s type URL in a status's details.
pub(crate) const NOT_OWNER_TYPE_URL: &str = "type.googleapis.com/presence.v1.NotOwner";
/// `presence.v1.ChangesOutOfRange`'s type URL in a status's details.
pub(crate) const CHANGES_OUT_OF_RANGE_TYPE_URL: &str = "type.googleapis.com/presence.v1.ChangesOutOfRange";

impl ServiceError {
    /// The `presence.v1.NotOwner` of a refusal by a node that does not own the user.
    pub(crate) fn not_owner(&self) -> Option<pb::NotOwner> {
        match self {
            ServiceError::NotOwner(not_owner) => Some(pb::NotOwner {
                slot: not_owner.slot,
                epoch: not_owner.epoch,
                owner_id: not_owner.owner_id.clone(),
                owner_addr: not_owner.owner_addr.clone(),
            }),
            _ => None,
        }
    }

    /// Whether this refusal may be a move's (C7) seen from one side: a slot
    /// with no owner that may act here yet, a user this node does not own
    /// (for a request forwarded to it), or a node asked that does not own
    /// its users any more or does not answer; a moment later, with the map
    /// acted on everywhere, the same request may be answered.
    pub(crate) fn may_pass_with_a_move(&self) -> bool {
        match self {
            ServiceError::NotOwner(_) | ServiceError::PeerEnded { .. } | ServiceError::RoomCountsUnanswered { .. } => {
                true
            }
            ServiceError::Peer { status, .. } => status.code() == Code::Unavailable,
            _ => false,
        }
    }

    /// A refusal of `field`.
    pub(crate) fn invalid(field: impl Into<Cow<'static, str>>, reason: impl Into<String>) -> Self {
        ServiceError::InvalidArgument { field: field.into(), reason: reason.into() }
    }

    /// The gRPC code of this refusal: the one table.
    pub(crate) fn code(&self) -> Code {
        match self {
            ServiceError::InvalidArgument { .. } => Code::InvalidArgument,
            ServiceError::Lease(LeaseError::NotFound { .. }) | ServiceError::WatchNotFound { .. } => Code::NotFound,
            ServiceError::Lease(LeaseError::StaleGeneration { .. } | LeaseError::NotInRoom { .. }) => {
                Code::FailedPrecondition
            }
            ServiceError::Lease(LeaseError::SignalRateExceeded { .. }) => Code::ResourceExhausted,
            ServiceError::Lease(LeaseError::InvalidArgument { .. }) => Code::InvalidArgument,
            ServiceError::PermissionDenied { .. } | ServiceError::MissingScope { .. } => Code::PermissionDenied,
            ServiceError::CredentialsExpired | ServiceError::CredentialsRevoked => Code::Unauthenticated,
            ServiceError::Unauthenticated(_) => Code::Unauthenticated,
            ServiceError::RenewalShed | ServiceError::TooManySettings { .. } => Code::ResourceExhausted,
            ServiceError::RoomNotFound { .. } => Code::NotFound,
            ServiceError::RoomTooLarge { .. } => Code::FailedPrecondition,
            ServiceError::Durable(_) | ServiceError::ShuttingDown | ServiceError::NotOwner(_) => Code::Unavailable,
            ServiceError::RoomOwnerUnreachable { .. }
            | ServiceError::RoomsNotHere { .. }
            | ServiceError::RoomCountsUnanswered { .. }
            | ServiceError::RoomRebuilding { .. } => Code::Unavailable,
            ServiceError::Internal(_) => Code::Internal,
            ServiceError::FeedOutOfRange { .. } => Code::OutOfRange,
            ServiceError::NoFeed => Code::FailedPrecondition,
            ServiceError::NotClustered { .. }
            | ServiceError::MoveRefused(_)
            | ServiceError::ProtocolMismatch { .. } => Code::FailedPrecondition,
            ServiceError::MoveAborted(_) => Code::Aborted,
            ServiceError::Etcd(_) | ServiceError::Reopen(_) | ServiceError::NodesUnreached { .. } => Code::Unavailable,
            ServiceError::PeerTimedOut { .. } => Code::DeadlineExceeded,
            ServiceError::PeerEnded { .. } => Code::Unavailable,
            ServiceError::PeerUnusable { .. } => Code::Internal,
            ServiceError::Peer { status, .. } => status.code(),
        }
    }
}

/// Another node's `status`, passed on to this node's caller with the node
/// (`whose`) named: its code, and its message after the name.
pub(crate) fn relayed(whose: &str, status: &Status) -> Status {
    Status::new(status.code(), format!("{whose}: {}", status.message()))
}

/// The `google.rpc.ErrorInfo` domain of presenced's own reasons.
pub(crate) const ERROR_DOMAIN: &str = "presenced";
/// The `ErrorInfo` reason of a stream ended at its token's expiry: fetch a
/// fresh token and open it again.
pub(crate) const CREDENTIALS_EXPIRED: &str = "CREDENTIALS_EXPIRED";
/// The `ErrorInfo` reason of a stream whose credential was removed or whose
/// key rotated out.
pub(crate) const CREDENTIALS_REVOKED: &str = "CREDENTIALS_REVOKED";

impl From<LeaseError> for ServiceError {
    fn from(err: LeaseError) -> Self {
        match err {
            LeaseError::InvalidArgument { field, reason } => ServiceError::invalid(field, reason),
            refused => ServiceError::Lease(refused),
        }
    }
}

impl From<ServiceError> for Status {
    fn from(err: ServiceError) -> Self {
        if let ServiceError::Durable(durable) = &err {
            tracing::error!(err = %durable, "durable store failure");
        }
        let message = err.to_string();
        match &err {
            ServiceError::InvalidArgument { field, reason } => Status::with_error_details(
                Code::InvalidArgument,
                message,
                ErrorDetails::with_bad_request_violation(field.as_ref(), reason.as_str()),
            ),
            ServiceError::NotOwner(_) => {
                let detail = err.not_owner().expect("a NotOwner refusal").encode_to_vec();
                with_detail(Code::Unavailable, message, NOT_OWNER_TYPE_URL, detail)
            }
            ServiceError::FeedOutOfRange { oldest, .. } => {
                let detail = pb::ChangesOutOfRange { oldest_cursor: oldest.encode().to_vec() }.encode_to_vec();
                with_detail(Code::OutOfRange, message, CHANGES_OUT_OF_RANGE_TYPE_URL, detail)
            }
            ServiceError::CredentialsExpired | ServiceError::CredentialsRevoked => {
                let reason = if matches!(err, ServiceError::CredentialsExpired) {
                    CREDENTIALS_EXPIRED
                } else {
                    CREDENTIALS_REVOKED
                };
                let info = ErrorDetails::with_error_info(reason, ERROR_DOMAIN, std::collections::HashMap::new());
                Status::with_error_details(Code::Unauthenticated, message, info)
            }
            _ => Status::new(err.code(), message),
        }
    }
}

/// A status with one detail of presenced's own messages.
/// The oldest cursor an `OUT_OF_RANGE` of the change feed carries (as
/// [`ServiceError::FeedOutOfRange`] makes it): how a cluster node reads
/// another node's refusal of its part of a merged feed (F3).
pub(crate) fn feed_out_of_range_oldest(status: &Status) -> Option<presence_feed::Cursor> {
    if status.code() != Code::OutOfRange {
        return None;
    }
    let details = tonic_types::Status::decode(status.details()).ok()?;
    let detail = details.details.iter().find(|detail| detail.type_url == CHANGES_OUT_OF_RANGE_TYPE_URL)?;
    let out = pb::ChangesOutOfRange::decode(detail.value.as_slice()).ok()?;
    presence_feed::Cursor::decode(&out.oldest_cursor).ok()
}

fn with_detail(code: Code, message: String, type_url: &str, detail: Vec<u8>) -> Status {
    let status = tonic_types::Status {
        code: code as i32,
        message: message.clone(),
        details: vec![prost_types::Any { type_url: type_url.to_owned(), value: detail }],
    };
    Status::with_details(code, message, status.encode_to_vec().into())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_refusal_has_its_code_and_a_bad_field_travels_as_data() {
        let invalid: Status =
            ServiceError::from(LeaseError::InvalidArgument { field: "user_id", reason: "must not be empty".into() })
                .into();
        assert_eq!(invalid.code(), Code::InvalidArgument);
        assert_eq!(invalid.message(), "user_id: must not be empty");
        let violations = invalid.get_details_bad_request().expect("a BadRequest detail").field_violations;
        assert_eq!(violations.len(), 1);
        assert_eq!(
            (violations[0].field.as_str(), violations[0].description.as_str()),
            ("user_id", "must not be empty")
        );

        let not_found = ServiceError::from(LeaseError::NotFound { user_id: "u".into(), session_id: "s".into() });
        assert_eq!(Status::from(not_found).code(), Code::NotFound);
        let stale = LeaseError::StaleGeneration { user_id: "u".into(), session_id: "s".into(), given: 1, current: 2 };
        assert_eq!(Status::from(ServiceError::from(stale)).code(), Code::FailedPrecondition);
        let denied = ServiceError::PermissionDenied { operation: "Renew", reason: "requires service credentials" };
        let denied = Status::from(denied);
        assert_eq!((denied.code(), denied.message()), (Code::PermissionDenied, "Renew: requires service credentials"));
        assert!(denied.get_details_bad_request().is_none(), "only a refused field carries a BadRequest");
        assert_eq!(Status::from(ServiceError::RenewalShed).code(), Code::ResourceExhausted);
        assert_eq!(Status::from(ServiceError::ShuttingDown).code(), Code::Unavailable);
        let reopen = Status::from(ServiceError::Reopen("every part of this watch ended; reopen".into()));
        assert_eq!((reopen.code(), reopen.message()), (Code::Unavailable, "every part of this watch ended; reopen"));
        let relayed = relayed("node at 10.0.0.2:4000", &Status::permission_denied("Watch: requires a viewer"));
        assert_eq!(
            (relayed.code(), relayed.message()),
            (Code::PermissionDenied, "node at 10.0.0.2:4000: Watch: requires a viewer")
        );
        assert_eq!(
            Status::from(ServiceError::Unauthenticated("invalid credentials".into())).code(),
            Code::Unauthenticated
        );
    }

    /// C2: what another node did reaches the caller with the code it had
    /// before these outcomes had names: a refusal keeps the node's code, a
    /// wait that ran out reads DEADLINE_EXCEEDED (not tonic's CANCELLED), an
    /// answer cut short UNAVAILABLE, and an address or answer this node
    /// cannot use INTERNAL; each names the node.
    #[test]
    fn a_peers_outcome_has_one_code_and_names_the_node() {
        let node = || "10.0.0.2:4000".to_owned();
        let within = std::time::Duration::from_secs(2);
        let outcomes = [
            (
                ServiceError::Peer { node: node(), status: Status::permission_denied("Watch: no") },
                Code::PermissionDenied,
            ),
            (ServiceError::Peer { node: node(), status: Status::unavailable("connection refused") }, Code::Unavailable),
            (ServiceError::PeerTimedOut { node: node(), awaited: "answer", within }, Code::DeadlineExceeded),
            (ServiceError::PeerEnded { node: node(), awaited: "results" }, Code::Unavailable),
            (ServiceError::PeerUnusable { node: node(), reason: "bad address: no port".into() }, Code::Internal),
        ];
        for (outcome, code) in outcomes {
            assert_eq!(outcome.code(), code, "{outcome:?}");
            let status = Status::from(outcome);
            assert_eq!(status.code(), code, "{status:?}");
            assert!(status.message().starts_with("node at 10.0.0.2:4000: "), "{status:?}");
        }
        let timed_out = Status::from(ServiceError::PeerTimedOut { node: node(), awaited: "answer", within });
        assert_eq!(timed_out.message(), "node at 10.0.0.2:4000: no answer within 2s");
    }
}
