//! The values the lease store hands back to its callers.

use std::sync::Arc;

use compact_str::CompactString;

use crate::attention::Activity;
use crate::wheel::Tick;

/// A user's derived connectivity state (contract M2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum State {
    /// No live lease.
    Offline,
    /// At least one live lease.
    Online,
}

/// A user's state and the version that orders its changes (contract M3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Presence {
    /// Derived from the user's leases.
    pub state: State,
    /// Moves forward on every change viewers see (a flip, a status, an
    /// availability) and only then; 0 for a user the store holds nothing about.
    pub version: u64,
    /// Derived from the attention of the user's sessions (A2): `None` while
    /// it is offline, when none of its sessions says what its human does,
    /// and when the user does not share it.
    pub activity: Option<Activity>,
}

impl Presence {
    /// What the store answers for a user it holds nothing about.
    pub const UNKNOWN: Presence = Presence::new(State::Offline, 0);

    /// A state at a version, with no availability.
    pub const fn new(state: State, version: u64) -> Presence {
        Presence { state, version, activity: None }
    }
}

/// What a user chose to show beside its derived state (contract S1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Availability {
    /// Ready to talk.
    Available,
    /// Not at the keyboard.
    Away,
    /// Present, but not to be disturbed.
    DoNotDisturb,
}

/// A user-chosen status: ordinary data stored beside the derived state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Status {
    /// The chosen availability.
    pub availability: Availability,
    /// A short free text (validated by [`crate::validate_status_text`]).
    pub text: String,
    /// When the status clears by itself; `None` keeps it until replaced.
    pub expires_at: Option<Tick>,
}

/// A user's presence together with its status, as read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UserView {
    /// State and version.
    pub presence: Presence,
    /// The user's status, if it set one that has not expired.
    pub status: Option<Arc<Status>>,
}

/// What a published change is: metrics count flips and other changes apart,
/// and only a flip is what E1 speaks of.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChangeKind {
    /// The user's ONLINE/OFFLINE state flipped.
    Flip,
    /// The user's status changed (set, cleared or expired); the state did not.
    Status,
    /// The user's availability changed (A2); the state did not.
    Activity,
}

/// One change of one user that viewers see: a flip of its state, or a change
/// of its status. The only thing the store publishes (contract E1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PresenceChange {
    /// The user that changed.
    pub user_id: CompactString,
    /// A flip, or a change of status with the same state.
    pub kind: ChangeKind,
    /// The state and the version that the change produced.
    pub presence: Presence,
    /// The user's status after the change.
    pub status: Option<Arc<Status>>,
    /// The store time at which the flip was made (for expiries: when the
    /// expiry was processed; compare with `deadline` for the lag).
    pub at: Tick,
    /// For a flip caused by lease expiry, the deadline of the last lease that
    /// ran out; `None` for flips caused by a request.
    pub deadline: Option<Tick>,
}

/// Where a store operation puts the changes it caused: of users (flips and
/// statuses) and of rooms. The caller publishes them after the operation
/// returns, whatever the operation's own result: a refused renewal may still
/// have found an expired lease and flipped its user, and ended its rooms.
#[derive(Debug, Default)]
pub struct Changes {
    /// Changes of users, in the order they were made.
    pub users: Vec<PresenceChange>,
    /// Changes of rooms, in the order they were made (each room's in version order).
    pub rooms: Vec<RoomChange>,
    /// On a store that sends its room facts out (a cluster node), the facts
    /// its user shards made, in the order they were made, for the rooms'
    /// owners (see `room_intake.rs`); empty otherwise.
    pub room_facts: Vec<crate::room_intake::StampedRoomFact>,
}

impl Changes {
    /// Whether the operation changed nothing anyone sees.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty() && self.rooms.is_empty() && self.room_facts.is_empty()
    }
}

/// A session named in a room operation (R6), like a renewal names its lease.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoomRef<'a> {
    /// The session's user.
    pub user_id: &'a str,
    /// The session.
    pub session_id: &'a str,
    /// The generation the gateway holds: an older one is refused and changes nothing.
    pub generation: u64,
    /// 1 to 128 bytes.
    pub room_id: &'a str,
}

/// The result of a join (R1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Joined {
    /// Whether the user joined: none of its sessions was in the room before.
    pub changed: bool,
    /// The room's version after the join.
    pub room_version: u64,
}

/// The result of a leave (R1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    /// Whether the session was in the room.
    pub removed: bool,
    /// Whether the user left: it has no session in the room any more.
    pub changed: bool,
    /// The room's version after the leave.
    pub room_version: u64,
}

/// The result of a signal (S3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Signalled {
    /// Whether the room's set of users signalling that kind changed.
    pub changed: bool,
    /// The room's version after the signal.
    pub room_version: u64,
}

/// Who may see a room (R4).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum RoomAccess {
    /// Only its members and service callers.
    #[default]
    Members,
    /// Any authenticated caller.
    Public,
}

/// A member's metadata in a room, shared by whatever holds it.
pub type RoomMetadata = Arc<[(String, String)]>;

/// A user in a room, as listed (R1, R6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomMember {
    /// The member.
    pub user_id: CompactString,
    /// Its shown metadata: that of its session in the room that joined or updated last.
    pub metadata: RoomMetadata,
    /// How many of its sessions are in the room (0 in a `Left` change).
    pub sessions: u32,
}

/// What kind of member change a room published (R2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RoomChangeKind {
    /// A user with no session in the room now has one.
    Joined,
    /// A user's last session in the room left it.
    Left,
    /// A member's shown metadata changed.
    Updated,
}

/// What changed in a room.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomEventBody {
    /// A member joined, left (the member as it was, with 0 sessions) or was updated.
    Member {
        /// Which of the three.
        kind: RoomChangeKind,
        /// The member after the change.
        member: RoomMember,
    },
    /// Only the session count changed (a second tab): no version move, for count watchers.
    Sessions,
    /// The set of users signalling `kind` changed (S3): the whole set now.
    Signals {
        /// The signal's kind.
        kind: CompactString,
        /// Who signals it, at most [`SIGNAL_SET_CAP`] of them.
        user_ids: Vec<CompactString>,
        /// How many signal it, exactly.
        count: u32,
    },
}

/// The most users a [`RoomEventBody::Signals`] or a [`RoomView`] lists per kind; its count is exact.
pub const SIGNAL_SET_CAP: usize = 100;

/// One change of one room that its watchers see (R2, S3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomChange {
    /// The room.
    pub room_id: CompactString,
    /// The room's version after the change (unchanged for [`RoomEventBody::Sessions`]).
    pub version: u64,
    /// Members after the change.
    pub users: u32,
    /// Sessions in the room after the change.
    pub sessions: u32,
    /// What changed.
    pub body: RoomEventBody,
}

/// A room as read (R3, R6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomView {
    /// The room.
    pub room_id: CompactString,
    /// Its version; 0 for a room the store holds nothing about.
    pub version: u64,
    /// Members.
    pub users: u32,
    /// Sessions in the room.
    pub sessions: u32,
    /// Who may see it.
    pub access: RoomAccess,
    /// Every member, or `None` when there are more than the cap asked for.
    pub members: Option<Vec<RoomMember>>,
    /// Per signal kind: who signals it (at most [`SIGNAL_SET_CAP`]) and how many do.
    pub signals: Vec<(CompactString, Vec<CompactString>, u32)>,
}

/// What to register (contract L1). Ids are borrowed; the store copies what it keeps.
#[derive(Debug, Clone, Copy)]
pub struct Registration<'a> {
    /// 1 to 128 bytes.
    pub user_id: &'a str,
    /// 1 to 128 bytes; unique within the user.
    pub session_id: &'a str,
    /// 1 to 128 bytes: the gateway process holding the session's socket.
    pub gateway_id: &'a str,
    /// 0 takes the configured default; otherwise within `[min_ttl_ms, max_ttl_ms]`.
    pub ttl_ms: u32,
    /// Small opaque key/value pairs kept with the lease.
    pub metadata: &'a [(String, String)],
}

/// The result of a register.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Registered {
    /// Strictly greater than every earlier generation of this session.
    pub generation: u64,
    /// The new lease's deadline.
    pub expires_at: Tick,
    /// Whether this register flipped the user ONLINE.
    pub changed: bool,
    /// Whether the session already held a live lease that this one replaced (a reconnect).
    pub replaced: bool,
    /// The user's presence after the register.
    pub presence: Presence,
}

/// One renewal: the lease of `session_id` of `user_id`, held at `generation`,
/// extended by `ttl_ms` (0: the default TTL).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewal<'a> {
    /// The user.
    pub user_id: &'a str,
    /// The session whose lease is renewed.
    pub session_id: &'a str,
    /// The generation the gateway holds.
    pub generation: u64,
    /// The new TTL.
    pub ttl_ms: u32,
}

/// The result of an accepted renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Renewed {
    /// The lease's deadline after the renewal.
    pub expires_at: Tick,
    /// The renewal came within the minimum renewal interval of the previous
    /// write (L7): it was acknowledged without a store write, and `expires_at`
    /// is the deadline the previous write set.
    pub throttled: bool,
}

/// What an unregister did (contract L3). Only `Removed` and `Lingering` change anything.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnregisterOutcome {
    /// The lease was deleted.
    Removed,
    /// The lease was shortened to end at `until` and accepts no more renewals.
    Lingering {
        /// The lease's new deadline.
        until: Tick,
    },
    /// A newer generation owns the session (a late close of a dead socket): nothing changed.
    StaleGeneration {
        /// The session's current generation.
        current: u64,
    },
    /// The session holds no live lease: nothing changed.
    NotFound,
}

/// The result of an unregister.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Unregistered {
    /// What happened to the lease.
    pub outcome: UnregisterOutcome,
    /// Whether this unregister flipped the user OFFLINE.
    pub changed: bool,
    /// The user's presence after the unregister.
    pub presence: Presence,
}

/// The result of a revoke (contract L6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Revoked {
    /// How many leases were deleted.
    pub count: u32,
    /// Whether this revoke flipped the user OFFLINE.
    pub changed: bool,
    /// The user's presence after the revoke.
    pub presence: Presence,
}

/// What [`Store::erase`](crate::Store::erase) ended of a user (P7).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Erased {
    /// Its sessions (leases other than restart and grace holds) deleted.
    pub sessions: u32,
    /// The rooms its sessions were in, each once.
    pub rooms: u32,
    /// Whether it had a status, now cleared.
    pub status: bool,
    /// Whether the erase flipped it OFFLINE.
    pub flipped: bool,
}

/// Counts over the whole store, for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Leases held, live or lingering (expired ones not yet collected included).
    pub sessions: usize,
    /// Users currently ONLINE.
    pub online_users: usize,
    /// Users the store holds a record for: online, or offline and not yet
    /// forgotten (see [`crate::StoreConfig::forget_offline_after_ms`]).
    pub users: usize,
    /// Flips hidden by flap damping since the start (E6): registers that came
    /// within a user's grace window, so that neither its OFFLINE nor the
    /// ONLINE after it was published. A running total, for a metric.
    pub suppressed_flaps: u64,
    /// Rooms held: with at least one member, or with non-default access.
    pub rooms: usize,
    /// Users in rooms, counted once per room they are in.
    pub room_memberships: usize,
}

/// What [`Store::import`](crate::Store::import) took over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Imported {
    /// Users handed over.
    pub users: usize,
    /// Their sessions.
    pub sessions: usize,
}

/// What [`Store::replace_users`](crate::Store::replace_users) did: the users
/// (and their sessions) it dropped, and those it took in their place.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Replaced {
    /// What this store held of the users named, dropped.
    pub dropped: Imported,
    /// What it took.
    pub taken: Imported,
}
