//! The seam between one node and the cluster it may be part of.
//!
//! One node's code asks [`Placement`] the few things a cluster changes: which
//! users it may act for now, what a write that awaits the disk holds while it
//! does, whether a room is answered here, a room's version at its owner, how
//! a room is counted and which members a viewer may see. [`SingleNode`]
//! answers "everything is here" without allocating; `cluster::ClusterNode`
//! answers from the slot map. Room facts leave the store through the
//! publisher's sink (`publish::RoomFactSink`), which only a cluster node
//! installs. `node/` declares both and names nothing of `cluster/`, which
//! implements them (the direction `api → cluster → node`).

use std::fmt::Debug;
use std::time::Duration;

use futures_util::future::BoxFuture;
use hashbrown::HashMap;
use presence_core::{CompactString, Store};
use presence_proto::v1 as pb;
use tonic::metadata::{Ascii, MetadataValue};

use crate::error::ServiceError;
use crate::node::privacy::Privacy;

/// How long a node waits for another node's answer to a call made for a
/// request (a forwarded read, room facts and versions) before it gives up.
pub(crate) const FORWARD_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a request for a slot in the last step of a move out of this node
/// waits here for the move to end before it is refused (C7): far above a
/// freeze (milliseconds), far below a heartbeat.
pub(crate) const HOLD_THROUGH_FREEZE: Duration = Duration::from_millis(250);

/// Which users this node may act for, at one instant.
pub(crate) enum Acting<'a> {
    /// Every user (a single node): nothing to check.
    Everyone,
    /// The users the check lets through (a cluster node's view of its slots,
    /// held until it is dropped).
    Some(Box<dyn UserCheck + 'a>),
}

impl Acting<'_> {
    /// `Ok` when this node may act for `user_id` now; else the refusal that
    /// names the owner (`NotOwner`, C1).
    #[inline]
    pub(crate) fn check(&self, user_id: impl AsRef<[u8]>) -> Result<(), ServiceError> {
        match self {
            Acting::Everyone => Ok(()),
            Acting::Some(check) => check.check(user_id.as_ref()),
        }
    }
}

/// A check of one user against what this node may act for.
pub(crate) trait UserCheck {
    /// `Ok`, or the refusal naming the owner.
    fn check(&self, user_id: &[u8]) -> Result<(), ServiceError>;
}

/// What one node asks of where users and rooms live.
pub(crate) trait Placement: Debug + Send + Sync {
    /// What this node may act for now (C1, C3). A cluster node's answer holds
    /// off a handover of the slots it lets through until it is dropped.
    fn acting(&self) -> Acting<'_>;

    /// The lock a write that awaits the disk holds (read) from before its
    /// check of [`Placement::acting`] to its end, so that a handover (which
    /// takes it to write) sees it done (C3); `None` when nothing moves away.
    fn durable_gate(&self) -> Option<&tokio::sync::RwLock<()>>;

    /// Returns once none of `slots` is frozen for a move out of this node
    /// (C7), or at `deadline`; whether some still is then.
    fn freeze_over<'a>(&'a self, slots: Vec<u32>, deadline: tokio::time::Instant) -> BoxFuture<'a, bool>;

    /// Sends lease items to the node at `address`, which owns their users
    /// now, as the caller (`authorization`) would (C7: a request held
    /// through a freeze is answered by the slot's new owner).
    fn forward_leases<'a>(
        &'a self,
        address: &'a str,
        batch: pb::LeaseBatch,
        authorization: Option<MetadataValue<Ascii>>,
    ) -> BoxFuture<'a, Result<pb::LeaseResults, ServiceError>>;

    /// `Ok` when this node still answers for `room_id` (an open room read
    /// checks it as it goes on); else the refusal naming its owner.
    fn room_here(&self, room_id: &str) -> Result<(), ServiceError>;

    /// The version of `room_id` at its owner, for a Join, Leave or Signal
    /// whose owner answered none (it made no fact of the room); `None` when
    /// `store` holds the room and answered its version with the operation.
    fn room_version<'a>(
        &'a self,
        store: &'a Store,
        room_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<u64>, ServiceError>>;

    /// Which of `users` `viewer` may see by their own nodes' relations (R4),
    /// for the caller to keep while it shows them; a user left out is shown
    /// as `privacy`, the relations here, has it when it is shown.
    fn may_view<'a>(
        &'a self,
        privacy: &'a Privacy,
        viewer: &'a str,
        users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<HashMap<CompactString, bool>, ServiceError>>;

    /// `room_id`'s version, and its users and sessions as counted for
    /// anyone: invisible members are counted by nobody (R4).
    fn room_counts(&self, store: &Store, privacy: &Privacy, room_id: &str) -> (u64, u32, u32);

    /// The counts of `rooms`, none of which [`Placement::room_here`] lets
    /// through, as `viewer` may read them (R4, R7), asked of their owners;
    /// in order, `None` for a room whose owner could not answer now (it is
    /// moving, or unreachable).
    fn counts_elsewhere<'a>(
        &'a self,
        viewer: Option<&'a str>,
        rooms: Vec<CompactString>,
    ) -> BoxFuture<'a, Vec<Option<pb::RoomCount>>>;
}

/// A node on its own (no `--etcd`): every user and every room is here.
#[derive(Debug, Default)]
pub(crate) struct SingleNode;

impl Placement for SingleNode {
    #[inline]
    fn acting(&self) -> Acting<'_> {
        Acting::Everyone
    }

    fn durable_gate(&self) -> Option<&tokio::sync::RwLock<()>> {
        None
    }

    fn freeze_over<'a>(&'a self, _slots: Vec<u32>, _deadline: tokio::time::Instant) -> BoxFuture<'a, bool> {
        // Nothing moves away from a node on its own.
        Box::pin(std::future::ready(false))
    }

    fn forward_leases<'a>(
        &'a self,
        address: &'a str,
        _batch: pb::LeaseBatch,
        _authorization: Option<MetadataValue<Ascii>>,
    ) -> BoxFuture<'a, Result<pb::LeaseResults, ServiceError>> {
        let refusal =
            ServiceError::Internal(format!("a node on its own forwards nothing (asked to send to {address})"));
        Box::pin(std::future::ready(Err(refusal)))
    }

    fn room_here(&self, _room_id: &str) -> Result<(), ServiceError> {
        Ok(())
    }

    fn room_version<'a>(
        &'a self,
        _store: &'a Store,
        _room_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<u64>, ServiceError>> {
        // The store answered the version with the operation.
        Box::pin(std::future::ready(Ok(None)))
    }

    fn may_view<'a>(
        &'a self,
        _privacy: &'a Privacy,
        _viewer: &'a str,
        _users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<HashMap<CompactString, bool>, ServiceError>> {
        // Every user's relations are here, read as each is shown: a change
        // of them shows at once.
        Box::pin(std::future::ready(Ok(HashMap::new())))
    }

    fn room_counts(&self, store: &Store, privacy: &Privacy, room_id: &str) -> (u64, u32, u32) {
        let (version, users, sessions) = store.room_tally(room_id);
        let (users, sessions) = privacy.counted(store, room_id, users, sessions);
        (version, users, sessions)
    }

    fn counts_elsewhere<'a>(
        &'a self,
        _viewer: Option<&'a str>,
        rooms: Vec<CompactString>,
    ) -> BoxFuture<'a, Vec<Option<pb::RoomCount>>> {
        // Every room is here: never asked for one.
        Box::pin(std::future::ready(vec![None; rooms.len()]))
    }
}
