//! One shard of the lease store: the users that hash to it, their leases and
//! the timer wheel of their deadlines.
//!
//! A shard is a plain struct with `&mut self` methods; the store wraps each one
//! in a lock in exactly one place. Every operation first *settles* the user it
//! touches (drops the leases whose deadline has passed, flipping the user
//! OFFLINE if none is left), so an answer never depends on whether the expiry
//! driver happened to run before the request: the state is a function of the
//! operations and their times alone. The wheel makes sure settling also
//! happens, on time, for users nobody touches (L4).
//!
//! The wheel holds one entry per user with leases, at or before the user's
//! earliest lease deadline. A renewal only moves a lease's deadline later, so
//! it leaves the wheel alone; when the entry fires, the user is settled and a
//! new entry is made at the earliest remaining deadline. A heartbeat therefore
//! costs no wheel work, and a lease that is renewed every 15 s against a 45 s
//! TTL costs one wheel entry per 30 s or so.
//!
//! A user that is OFFLINE with no lease and no status is *idle*, and the same
//! wheel entry then counts down to forgetting it (B6): every change that makes
//! a user idle replaces its entry with one at exactly `now + forget window`,
//! so an idle user's entry always says when it became idle; when it fires on
//! a user that is still idle, the user is removed from the shard altogether
//! (record, index entry, wheel entry) and is answered from then on like a user
//! never seen. A user that came back meanwhile is not idle when it fires, and
//! one that came back and left again has a newer entry. Versions and
//! generations come from the shard's stamp clock, which is not forgotten, so
//! a user that returns gets a version above any it had (M4).
//!
//! Memory is the point of the layout: one small machine must hold millions of
//! sessions. Leases live in one slab per shard, each user's threaded on an
//! intrusive list (a user has a handful at most), so a user costs no vector
//! header and no allocation of its own; metadata and statuses, which most
//! leases and users lack, live in side tables; a lease's gateway and the
//! offset of its last write from its deadline are one interned origin
//! (`interner.rs`), and the flags of a lease or a user ride in the top bits of
//! its list link; the wheel keeps a timer per user slot, with no handle in the
//! record. A lease is 48 bytes and a user 40, plus 16 of wheel and about 12 of
//! index; the size tests at the bottom hold the line. Records,
//! leases, the index and the wheel all shrink when they become mostly empty
//! (below a quarter used, to half used), and once a wave of forgetting is
//! over they are tidied to what they hold and an eighth more, so that the
//! memory of forgotten users comes back, while a user coming and going at a
//! boundary does not make them resize back and forth.

use std::sync::Arc;

use compact_str::CompactString;
use hashbrown::{DefaultHashBuilder, HashMap, HashSet};
use std::hash::BuildHasher;
use std::hint::black_box;

use crate::attention::{Activity, AttentionChange, SessionAttention, derive_activity};
use crate::checkpoint::{CheckpointWriter, MembershipOut, UserRecord};
use crate::config::StoreConfig;
use crate::error::LeaseError;
use crate::interner::{OriginRef, Origins};
use crate::room_names::{RoomName, RoomNames};
use crate::rooms::{MemberMetadata, MetadataSlots, NO_METADATA, RoomFact};
use crate::slots::SlotSet;
use crate::stamp::StampClock;
use crate::types::{
    ChangeKind, Erased, Imported, Presence, PresenceChange, Registered, Registration, Renewal, Renewed, Revoked,
    RoomMetadata, RoomRef, State, Status, UnregisterOutcome, Unregistered, UserView,
};

/// What a shard operation appends its users' changes to; the room changes
/// its facts cause are the store's to make.
type Changes = Vec<PresenceChange>;
use crate::user_index::UserIndex;
use crate::wheel::{Tick, TimerWheel};

/// A container shrinks only above this many cells: below, the memory is not worth the copy.
const SHRINK_ABOVE: usize = 64;

/// While a checkpoint is part-way through a shard, a forget that would move an
/// unwritten user below the checkpoint's cursor waits this long instead.
const FORGET_RETRY_MS: Tick = 1_000;

/// How far on the timer of a user whose slot is being handed over is put
/// back: a handover takes milliseconds, and the user is gone from this
/// node once it is done.
const PAUSED_RETRY_MS: Tick = 1_000;

/// Whether a container of `len` used cells out of `cells` should shrink: fewer
/// than a quarter used. It then shrinks to about twice `len`, so that it must
/// fill up past half again, or empty to below a quarter, before it resizes again.
fn mostly_empty(len: usize, cells: usize) -> bool {
    cells > SHRINK_ABOVE && len * 4 < cells
}

/// The size a container is tidied to once a wave of forgetting is over: what
/// it holds and an eighth more.
fn tidy_size(len: usize) -> usize {
    len + len / 8
}

/// Renewals of a batch whose lookups a shard starts together: enough to keep
/// the processor's outstanding memory loads busy, few enough that the first
/// loads are still in the cache when their renewals run.
const RENEWALS_IN_FLIGHT: usize = 16;

/// Bits of a [`Link`] (a lease's `next`, a user's first lease) that hold a slab
/// index; the three above hold flags of the record the link is in, so that the
/// flags cost no byte of their own.
const INDEX_BITS: u32 = 29;

/// "No lease" in the intrusive lists: the largest index a link can hold.
const NIL: u32 = (1 << INDEX_BITS) - 1;

/// A slab index (or `NIL`) and the three flags of the record it is in, in 32 bits.
#[derive(Debug, Clone, Copy)]
struct Link(u32);

impl Link {
    /// The two flag bits.
    const FLAG_A: u32 = 1 << INDEX_BITS;
    const FLAG_B: u32 = 1 << (INDEX_BITS + 1);
    const FLAG_C: u32 = 1 << (INDEX_BITS + 2);

    /// `NIL`, no flag set.
    const NONE: Link = Link(NIL);

    fn index(self) -> u32 {
        self.0 & NIL
    }

    fn set_index(&mut self, index: u32) {
        debug_assert!(index <= NIL);
        self.0 = (self.0 & !NIL) | index;
    }

    fn flag(self, flag: u32) -> bool {
        self.0 & flag != 0
    }

    fn set_flag(&mut self, flag: u32, on: bool) {
        if on {
            self.0 |= flag;
        } else {
            self.0 &= !flag;
        }
    }
}

/// The session id of a hold (see [`Lease::restart_hold`] and
/// [`Lease::grace_hold`]), and of its gateway: empty, which no client's id can
/// be. Checkpoints store restart holds under it, so it is part of the
/// checkpoint format.
const RESTART_HOLD_SESSION_ID: &str = "";

/// The generation of a [`Lease::grace_hold`]; a restart hold's is 0. Stamps
/// are far above both, and no checkpoint holds a grace hold.
const GRACE_HOLD_GENERATION: u64 = 1;

/// One session's lease (M1). 48 bytes: the layout is the memory budget (see
/// the size test at the bottom).
#[derive(Debug)]
struct Lease {
    session_id: CompactString,
    /// Bumped on every register of the session; renewals and unregisters must carry it.
    generation: u64,
    /// The lease is live while `now < expires_at`.
    expires_at: Tick,
    /// The gateway that wrote it and how long before `expires_at` it was last
    /// written, which the shard's [`Origins`] hold for all its leases.
    origin: OriginRef,
    /// The next lease of the same user (or `NIL`), and the flags
    /// [`Lease::closing`], [`Lease::has_metadata`] and [`Lease::has_rooms`].
    link: Link,
}

/// Set by an unregister with linger: the lease stays live until its
/// shortened deadline but accepts no more renewals.
const CLOSING: u32 = Link::FLAG_A;
/// The shard's metadata table holds an entry for this lease.
const HAS_METADATA: u32 = Link::FLAG_B;
/// The session is in at least one room (R1): its user's list of memberships
/// holds some of its own, which a session in no room need not look for.
const HAS_ROOMS: u32 = Link::FLAG_C;

impl Lease {
    /// A lease of `origin` until `expires_at`, on no list yet.
    fn new(session_id: &str, generation: u64, expires_at: Tick, origin: OriginRef, closing: bool) -> Lease {
        let mut link = Link::NONE;
        link.set_flag(CLOSING, closing);
        Lease { session_id: CompactString::from(session_id), generation, expires_at, origin, link }
    }

    /// A restart hold: after a checkpoint restore, keeps a user that was online
    /// online until `until`, so that it does not flip merely because its
    /// gateway has not been heard from yet (B3). It is a lease so that it costs
    /// no field in every user record and takes part in settling, expiry and
    /// checkpoints like any other; no client can name it, because its session
    /// id is empty and every session id a client sends is 1 to 128 bytes, and
    /// it is closing, so nothing renews it. `origin` is the hold's gateway's,
    /// written [`before_expiry`] of `now` and `until`.
    fn restart_hold(origin: OriginRef, until: Tick) -> Lease {
        Lease::new(RESTART_HOLD_SESSION_ID, 0, until, origin, true)
    }

    /// A grace hold: keeps a user whose last lease ended by expiry or
    /// unregister ONLINE until `until`, the end of its flap-damping window
    /// (E6). Like a restart hold it is a lease nobody can name, so that it
    /// costs no field in every user record and expires through the same
    /// settling as any lease: when it runs out the user flips OFFLINE with the
    /// window's end as the deadline, and a register before then removes it
    /// and publishes nothing.
    fn grace_hold(origin: OriginRef, until: Tick) -> Lease {
        let mut hold = Lease::restart_hold(origin, until);
        hold.generation = GRACE_HOLD_GENERATION;
        hold
    }

    /// Whether this is a hold of either kind rather than a session's lease.
    fn is_hold(&self) -> bool {
        self.session_id == RESTART_HOLD_SESSION_ID
    }

    /// Whether this is a [`Lease::restart_hold`].
    fn is_restart_hold(&self) -> bool {
        self.is_hold() && self.generation != GRACE_HOLD_GENERATION
    }

    /// Whether this is a [`Lease::grace_hold`].
    fn is_grace_hold(&self) -> bool {
        self.is_hold() && self.generation == GRACE_HOLD_GENERATION
    }

    fn next(&self) -> u32 {
        self.link.index()
    }

    fn closing(&self) -> bool {
        self.link.flag(CLOSING)
    }

    fn has_metadata(&self) -> bool {
        self.link.flag(HAS_METADATA)
    }

    fn has_rooms(&self) -> bool {
        self.link.flag(HAS_ROOMS)
    }
}

/// The most rooms one session may be in at once, so that no client can grow
/// a session's memberships without bound.
pub const MAX_ROOMS_PER_SESSION: usize = 256;

/// Set changes one session may cause per second of store time (S3): a
/// typing indicator changes a few times a second at most; beyond this a
/// signal is refused (`SignalRateExceeded`). Counted in fixed windows of a
/// second, each starting at the first change after the last one ended.
pub const SIGNAL_CHANGES_PER_SECOND: u32 = 10;

/// One session's membership of one room (R1), kept on the sessions' side so
/// that it ends with the lease. 24 bytes (see the size test). A user's
/// memberships, of all its sessions, are one list from [`User::rooms`]: the
/// list's head fills what was padding in the user record, so that no table
/// keyed by lease is needed to find a session's memberships.
#[derive(Debug)]
struct Membership {
    /// The room; the membership holds a reference to the name.
    room: RoomName,
    /// The session's own metadata in the room, a slot in [`Shard::room_metadata`];
    /// the user shows its most recent session's.
    metadata: u32,
    /// A stamp of the join or last update, which says which session is the most recent (R6).
    order: u64,
    /// The user's next membership, or `NIL`.
    next: u32,
    /// The lease (slab index) whose membership this is; [`FREE`] in a free slot.
    lease: u32,
}

/// The `lease` of a free slot of the membership slab.
const FREE: u32 = u32::MAX;

impl Membership {
    /// What a free slot holds.
    const FREE: Membership =
        Membership { room: RoomName::NONE, metadata: NO_METADATA, order: 0, next: NIL, lease: FREE };

    fn is_free(&self) -> bool {
        self.lease == FREE
    }
}

/// A signal one session sends into a room it is in (S3).
#[derive(Debug)]
struct ActiveSignal {
    /// Held by the session's membership of the room, which the signal never outlives.
    room: RoomName,
    kind: CompactString,
    /// Ends here, through the wheel.
    deadline: Tick,
}

/// The signals of one session, and its rate window (S3).
#[derive(Debug)]
struct SessionSignals {
    /// When the current one-second window started.
    window_start: Tick,
    /// Set changes caused in it.
    window_changes: u32,
    active: Vec<ActiveSignal>,
}

/// The first index of an intrusive list that `is` picks, with the one before
/// it in the list (or `NIL`), so that it can be unlinked.
fn find_in_list(list: impl Iterator<Item = u32>, mut is: impl FnMut(u32) -> bool) -> Option<(u32, u32)> {
    let mut previous = NIL;
    for index in list {
        if is(index) {
            return Some((previous, index));
        }
        previous = index;
    }
    None
}

/// How long before `expires_at` a lease written at `last_heartbeat_at` was
/// written: a TTL at most (or a restart grace), so 32 bits hold it.
fn before_expiry(last_heartbeat_at: Tick, expires_at: Tick) -> u32 {
    debug_assert!(last_heartbeat_at <= expires_at);
    u32::try_from(expires_at - last_heartbeat_at).unwrap_or(u32::MAX)
}

/// A user the shard holds a record for. 40 bytes (see the size test).
#[derive(Debug)]
struct User {
    id: CompactString,
    /// The version of the user's last flip; kept while the user is offline so
    /// that versions never go back (M3).
    version: u64,
    /// The user's first lease in the slab (or `NIL`), and the flags
    /// [`User::online`] and [`User::has_status`].
    link: Link,
    /// The first of its sessions' room memberships (or `NIL`), the most
    /// recently joined, and the flags of the availability last shown to
    /// viewers (A2): [`SHOWN_ACTIVE`] and [`SHOWN_AWAY`].
    rooms: Link,
}

/// The user is ONLINE.
const ONLINE: u32 = Link::FLAG_A;
/// The user has a status (S1), which the shard's status table holds: few
/// users set one, so it costs them a table entry rather than every user a field.
const HAS_STATUS: u32 = Link::FLAG_B;
/// The user was last shown `ACTIVE` (A2), in its rooms link; it is online.
const SHOWN_ACTIVE: u32 = Link::FLAG_A;
/// The user was last shown `AWAY` (A2), in its rooms link; it is online.
const SHOWN_AWAY: u32 = Link::FLAG_B;

impl User {
    fn new(id: &str) -> User {
        User { id: CompactString::from(id), version: 0, link: Link::NONE, rooms: Link::NONE }
    }

    fn first_lease(&self) -> u32 {
        self.link.index()
    }

    fn online(&self) -> bool {
        self.link.flag(ONLINE)
    }

    fn has_status(&self) -> bool {
        self.link.flag(HAS_STATUS)
    }

    /// The availability last shown to viewers (A2).
    fn activity(&self) -> Option<Activity> {
        if self.rooms.flag(SHOWN_ACTIVE) {
            Some(Activity::Active)
        } else if self.rooms.flag(SHOWN_AWAY) {
            Some(Activity::Away)
        } else {
            None
        }
    }

    fn set_activity(&mut self, activity: Option<Activity>) {
        self.rooms.set_flag(SHOWN_ACTIVE, activity == Some(Activity::Active));
        self.rooms.set_flag(SHOWN_AWAY, activity == Some(Activity::Away));
    }

    fn first_membership(&self) -> u32 {
        self.rooms.index()
    }

    fn presence(&self) -> Presence {
        Presence {
            state: if self.online() { State::Online } else { State::Offline },
            version: self.version,
            activity: self.activity(),
        }
    }
}

/// A read-only view of one lease, for inspection and checkpoints.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseView {
    /// The session the lease belongs to.
    pub session_id: CompactString,
    /// The gateway that registered it.
    pub gateway_id: CompactString,
    /// Its current generation.
    pub generation: u64,
    /// When it was last registered or renewed.
    pub last_heartbeat_at: Tick,
    /// Its deadline.
    pub expires_at: Tick,
    /// Whether it was unregistered with linger and now only runs out.
    pub closing: bool,
    /// Its metadata, as registered.
    pub metadata: Vec<(String, String)>,
}

/// One live session of a user with the rooms it is in, as an operator lists it (O4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SessionView {
    /// The session's lease.
    pub lease: LeaseView,
    /// The rooms the session is in, sorted.
    pub rooms: Vec<CompactString>,
    /// The session's own metadata in each of `rooms`, in the same order
    /// (what it joined or last updated with; a member shows its most recent
    /// session's).
    pub room_metadata: Vec<RoomMetadata>,
}

/// One shard's users, leases, timers and counters.
#[derive(Debug)]
pub(crate) struct Shard {
    /// The latest time any operation brought; time never goes back within a shard,
    /// even when two callers read the clock in one order and take the lock in the other.
    now: Tick,
    /// Every user held: online ones, and offline ones not yet forgotten (they
    /// keep their version meanwhile). A forgotten user's slot is filled by the
    /// last user, so that the vector stays dense and can shrink.
    users: Vec<User>,
    /// Index of `users` by user id.
    index: UserIndex,
    hasher: DefaultHashBuilder,
    /// Every lease of the shard; `None` slots are free and listed in `free_leases`.
    leases: Vec<Option<Lease>>,
    free_leases: Vec<u32>,
    /// Each lease slot's attention (A1), 8 bytes, by slot as `leases`; empty
    /// until a session first says what its human is doing, then as long as
    /// the slots that did. A freed slot's is reset.
    attention: Vec<SessionAttention>,
    /// Metadata of the leases that have any, by lease slot.
    metadata: HashMap<u32, Box<[(String, String)]>>,
    /// The users' timers, keyed by slot: one entry per user with leases, a
    /// status that expires, or a pending forget, at or before the earliest
    /// lease (or status) deadline while the user has leases (or a status that
    /// expires), and exactly when it is to be forgotten while it is idle (see
    /// the module docs).
    wheel: TimerWheel,
    /// Source of generations and versions.
    stamps: StampClock,
    /// The gateway and last write of every lease (see [`Lease::origin`]).
    origins: Origins,
    /// The status of each user that has one ([`User::has_status`]), by slot.
    statuses: HashMap<u32, Arc<Status>>,
    /// Leases held, holds included.
    sessions: usize,
    /// Holds among them, restart holds (B3) and grace holds (E6): no
    /// client's sessions, so not counted as ones.
    holds: usize,
    /// How long a user whose last lease ended stays ONLINE (E6); 0: not at all.
    offline_grace_ms: u64,
    /// Flips hidden by damping since the start: registers that found a grace hold.
    suppressed_flaps: u64,
    /// How long after its last activity a user is still shown `ACTIVE` (A2).
    active_window_ms: u64,
    /// The users of this shard's hash that do not share their availability
    /// (A2: viewers see ONLINE only), held or not: set by the node from the
    /// users' privacy settings, so that a record forgotten and made again
    /// still hides it, and few users are in it.
    activity_hidden: HashSet<CompactString>,
    /// Users online.
    online: usize,
    /// Operations applied, for per-shard load metrics.
    operations: u64,
    /// Renewals closer together than this are acknowledged without a write (L7).
    min_renew_interval_ms: u32,
    /// How long a user stays idle before it is forgotten (B6); 0 never forgets.
    forget_offline_after_ms: u64,
    /// Users forgotten since the containers were last tidied (see [`Shard::tidy`]).
    forgotten_since_tidy: usize,
    /// Users forgotten since the start.
    forgotten: u64,
    /// Where a checkpoint that is part-way through this shard continues (it
    /// writes users by slot, one lock hold at a time); `None` when none is.
    checkpoint_cursor: Option<usize>,
    /// Users an erase forgot while a checkpoint was part-way through the
    /// shard (P7, [`Shard::forget_idle`]): forgotten when their retry fires,
    /// whatever the forget window, unless they came back meanwhile.
    forget_when_due: HashSet<CompactString>,
    /// The earliest timer scheduled since the store last asked, so the store
    /// can wake the expiry driver when a new deadline is earlier than its alarm.
    earliest_new_timer: Option<Tick>,
    /// Every room membership of the shard's sessions; free slots are listed
    /// in `free_memberships`. A user's memberships are a list from
    /// [`User::rooms`] through [`Membership::next`], most recently joined first.
    memberships: Vec<Membership>,
    free_memberships: Vec<u32>,
    /// The metadata of the memberships that have any (most have none).
    room_metadata: MetadataSlots,
    /// References to room names that memberships held, or that a join did not
    /// keep, since the store last took them (see `room_names.rs`).
    released: Vec<RoomName>,
    /// The signals and rate window of each session that signalled, by lease slot (only leases in a room).
    signals: HashMap<u32, SessionSignals>,
    /// Facts about this shard's users for the room side, made under this
    /// shard's lock; the store hands them on before releasing it (see `rooms.rs`).
    facts: Vec<RoomFact<RoomName>>,
    /// The users whose state a follower does not have yet (C4): any change
    /// but a renewal's new deadline, since the last [`Shard::take_changed`].
    /// `None` unless the store is asked to track them.
    changed: Option<hashbrown::HashSet<CompactString>>,
    /// The users of the slots a move is copying (C7) that changed since the
    /// last [`Shard::take_moving_changed`]: every change, a renewal's new
    /// deadline included, for the move to send before it freezes them.
    /// `None` while no move copies slots out of this store.
    moving: Option<MovingSlots>,
}

/// The slots a move copies out of a shard, and their users changed since
/// the move last sent them (see [`Shard::moving`]).
#[derive(Debug)]
struct MovingSlots {
    slots: SlotSet,
    changed: hashbrown::HashSet<CompactString>,
}

impl Shard {
    pub(crate) fn new(now: Tick, config: &StoreConfig) -> Self {
        Shard {
            now,
            users: Vec::new(),
            index: UserIndex::default(),
            hasher: DefaultHashBuilder::default(),
            leases: Vec::new(),
            free_leases: Vec::new(),
            attention: Vec::new(),
            metadata: HashMap::new(),
            wheel: TimerWheel::new(now),
            stamps: StampClock::default(),
            origins: Origins::default(),
            statuses: HashMap::new(),
            sessions: 0,
            holds: 0,
            offline_grace_ms: config.offline_grace_ms,
            suppressed_flaps: 0,
            active_window_ms: config.active_window_ms,
            activity_hidden: HashSet::new(),
            online: 0,
            operations: 0,
            min_renew_interval_ms: config.min_renew_interval_ms,
            forget_offline_after_ms: config.forget_offline_after_ms,
            forgotten_since_tidy: 0,
            forgotten: 0,
            checkpoint_cursor: None,
            forget_when_due: HashSet::new(),
            earliest_new_timer: None,
            memberships: Vec::new(),
            free_memberships: Vec::new(),
            room_metadata: MetadataSlots::default(),
            released: Vec::new(),
            signals: HashMap::new(),
            facts: Vec::new(),
            changed: None,
            moving: None,
        }
    }

    /// Starts noting which users change, for [`Shard::take_changed`].
    pub(crate) fn track_changes(&mut self) {
        self.changed.get_or_insert_with(Default::default);
    }

    /// The users changed since the last call (see [`Shard::changed`]).
    pub(crate) fn take_changed(&mut self) -> Vec<CompactString> {
        self.changed.as_mut().map(|changed| changed.drain().collect()).unwrap_or_default()
    }

    /// Notes that the user in `slot` changed, when changes are tracked.
    fn note_changed(&mut self, slot: u32) {
        if let Some(changed) = &mut self.changed {
            let id = &self.users[slot as usize].id;
            if !changed.contains(id) {
                changed.insert(id.clone());
            }
        }
        self.note_moving(slot);
    }

    /// Starts noting which users of `slots` change in any way (a move copies
    /// them, C7), or stops with `None`; forgets what was noted before.
    pub(crate) fn track_moving(&mut self, slots: Option<&SlotSet>) {
        self.moving = slots.map(|slots| MovingSlots { slots: slots.clone(), changed: Default::default() });
    }

    /// The users of the moving slots changed since the last call, each once.
    pub(crate) fn take_moving_changed(&mut self) -> Vec<CompactString> {
        self.moving.as_mut().map(|moving| moving.changed.drain().collect()).unwrap_or_default()
    }

    /// Notes that the user in `slot` changed, when it is in a moving slot.
    #[inline]
    fn note_moving(&mut self, slot: u32) {
        if let Some(moving) = &mut self.moving {
            let id = &self.users[slot as usize].id;
            if moving.slots.holds(id.as_bytes()) && !moving.changed.contains(id) {
                moving.changed.insert(id.clone());
            }
        }
    }

    /// Registers a session (L1), with what its gateway says of its human's
    /// attention (A1; empty: nothing said), shown to viewers with the same
    /// change as the flip the register may make.
    pub(crate) fn register(
        &mut self,
        now: Tick,
        registration: &Registration<'_>,
        attention: &AttentionChange<'_>,
        ttl_ms: u32,
        changes: &mut Changes,
    ) -> Registered {
        let now = self.advance(now);
        let slot = self.find_or_insert(registration.user_id);
        self.settle(slot, now, changes);
        // A register within the damping window: the flip it would have
        // undone never happened (E6).
        if self.remove_leases_where(slot, Lease::is_grace_hold).0 > 0 {
            self.suppressed_flaps += 1;
        }

        let generation = self.stamps.next(now);
        let expires_at = now + u64::from(ttl_ms);
        let origin = self.origins.acquire(registration.gateway_id, ttl_ms);
        let (replaced, index) = match self.find_lease(slot, registration.session_id) {
            Some((_, index)) => {
                // A reconnect: the old connection's generation dies here, so its
                // late renewals and closes are refused from now on.
                let lease = self.lease_mut(index);
                let previous_origin = std::mem::replace(&mut lease.origin, origin);
                lease.generation = generation;
                lease.expires_at = expires_at;
                lease.link.set_flag(CLOSING, false);
                self.origins.release(previous_origin);
                self.set_metadata(index, registration.metadata);
                // The new connection joins again (R6), and says again what its human does (A1).
                self.drop_rooms(slot, index);
                if let Some(attention) = self.attention.get_mut(index as usize) {
                    *attention = SessionAttention::default();
                }
                (true, index)
            }
            None => {
                let mut lease = Lease::new(registration.session_id, generation, expires_at, origin, false);
                lease.link.set_index(self.users[slot as usize].first_lease());
                let index = self.allocate_lease(lease);
                self.users[slot as usize].link.set_index(index);
                self.set_metadata(index, registration.metadata);
                (false, index)
            }
        };
        if !attention.is_empty() {
            self.attention_mut(index).apply(attention, now);
        }
        self.note_changed(slot);
        let changed = !self.users[slot as usize].online();
        if changed {
            self.flip(slot, State::Online, now, None, changes);
        } else {
            self.refresh_activity(slot, now, changes);
        }
        self.schedule_no_later_than(slot, expires_at);
        Registered { generation, expires_at, changed, replaced, presence: self.users[slot as usize].presence() }
    }

    pub(crate) fn renew(
        &mut self,
        now: Tick,
        renewal: &Renewal<'_>,
        changes: &mut Changes,
    ) -> Result<Renewed, LeaseError> {
        let slot = self.find(renewal.user_id);
        self.renew_found(now, slot, renewal, changes)
    }

    /// Applies renewals of this shard's users, `batch[i]` for each `i` of
    /// `picks` in that order, each exactly as [`Shard::renew`] would, and puts
    /// each answer in `answers[i]`.
    ///
    /// The point is memory-level parallelism: a renewal in a large store is
    /// three or four cache misses in a chain (the index entry, the user
    /// record, the lease), each waiting for the one before. Here the chains of
    /// `RENEWALS_IN_FLIGHT` renewals advance one link at a time side by side,
    /// by loading each link for all of them before anything uses it; the
    /// renewals themselves then run on warm lines. A user's records are only
    /// read ahead, never changed, and a shard forgets users (which moves
    /// slots) only in [`Shard::expire`], never during a batch, so a slot found
    /// ahead stays right while the renewals before it run.
    pub(crate) fn renew_picked(
        &mut self,
        now: Tick,
        batch: &[Renewal<'_>],
        picks: &[u32],
        answers: &mut [Option<Result<Renewed, LeaseError>>],
        changes: &mut Changes,
    ) {
        for group in picks.chunks(RENEWALS_IN_FLIGHT) {
            let mut hashes = [0u64; RENEWALS_IN_FLIGHT];
            let mut slots = [None; RENEWALS_IN_FLIGHT];
            for (hash, &pick) in hashes.iter_mut().zip(group) {
                *hash = self.hash(batch[pick as usize].user_id);
                black_box(self.index.probe_start(*hash));
            }
            for hash in &hashes[..group.len()] {
                if let Some(candidate) = self.index.candidate(*hash) {
                    black_box(self.users[candidate as usize].link.0);
                }
            }
            let mut leases = [NIL; RENEWALS_IN_FLIGHT];
            for ((slot, hash), (lease, &pick)) in slots.iter_mut().zip(&hashes).zip(leases.iter_mut().zip(group)) {
                *slot = self.find_hashed(*hash, batch[pick as usize].user_id);
                if let Some(slot) = *slot {
                    *lease = self.users[slot as usize].first_lease();
                }
            }
            // Each user's leases, one link of every user's list at a time (the
            // renewal settles them all before it finds its own).
            while leases.iter().any(|&lease| lease != NIL) {
                for lease in leases.iter_mut().filter(|lease| **lease != NIL) {
                    *lease = black_box(self.lease(*lease).next());
                }
            }
            for (&slot, &pick) in slots.iter().zip(group) {
                answers[pick as usize] = Some(self.renew_found(now, slot, &batch[pick as usize], changes));
            }
        }
    }

    /// [`Shard::renew`] once the user's slot is known (`None`: no such user).
    fn renew_found(
        &mut self,
        now: Tick,
        slot: Option<u32>,
        renewal: &Renewal<'_>,
        changes: &mut Changes,
    ) -> Result<Renewed, LeaseError> {
        let &Renewal { user_id, session_id, generation, ttl_ms } = renewal;
        let now = self.advance(now);
        let (slot, index) = self.named_lease(now, slot, user_id, session_id, generation, changes)?;
        let min_renew_interval_ms = self.min_renew_interval_ms;
        let last_heartbeat_at = self.last_heartbeat_at(index);
        let lease = self.lease(index);
        // L7: a renewal soon after the previous write carries no news, so it is
        // acknowledged without one. The window is capped at half the TTL, so a
        // throttled lease always has at least half its TTL left.
        let throttle_window = u64::from(min_renew_interval_ms.min(ttl_ms / 2));
        if now < last_heartbeat_at + throttle_window {
            return Ok(Renewed { expires_at: lease.expires_at, throttled: true });
        }
        let expires_at = now + u64::from(ttl_ms);
        let previous_deadline = lease.expires_at;
        self.set_times(index, now, expires_at);
        self.note_moving(slot);
        // The user's timer is at or before this lease's previous deadline, so a
        // renewal that moves the deadline later leaves it right, and the wheel
        // is not even read. Only a shorter TTL than the time left can need an
        // earlier timer.
        if expires_at < previous_deadline {
            self.schedule_no_later_than(slot, expires_at);
        }
        Ok(Renewed { expires_at, throttled: false })
    }

    /// The live lease that a request names by session and generation, as a
    /// renewal or a room operation does (L2, R6), with its user's slot. The
    /// user is settled first, so an expired lease is never revived.
    fn named_lease(
        &mut self,
        now: Tick,
        slot: Option<u32>,
        user_id: &str,
        session_id: &str,
        generation: u64,
        changes: &mut Changes,
    ) -> Result<(u32, u32), LeaseError> {
        let not_found = || LeaseError::NotFound { user_id: user_id.into(), session_id: session_id.into() };
        let slot = slot.ok_or_else(not_found)?;
        self.settle(slot, now, changes);
        let (_, index) = self.find_lease(slot, session_id).ok_or_else(not_found)?;
        let lease = self.lease(index);
        if lease.closing() {
            return Err(not_found());
        }
        if generation < lease.generation {
            return Err(LeaseError::StaleGeneration {
                user_id: user_id.into(),
                session_id: session_id.into(),
                given: generation,
                current: lease.generation,
            });
        }
        if generation > lease.generation {
            // Never issued for this lease (for instance, issued before a restart
            // that lost it): there is no lease with that generation.
            return Err(not_found());
        }
        Ok((slot, index))
    }

    /// Puts the session in the room, or updates its metadata there if it is
    /// in already (R1). Returns whether the user joined (none of its sessions
    /// was in the room). `name` is the room's, with a reference that a new
    /// membership keeps; otherwise it is handed back with the released ones.
    pub(crate) fn join(
        &mut self,
        now: Tick,
        room: &RoomRef<'_>,
        name: RoomName,
        metadata: &[(String, String)],
        changes: &mut Changes,
    ) -> Result<bool, LeaseError> {
        let now = self.advance(now);
        let user = self.find(room.user_id);
        let named = self.named_lease(now, user, room.user_id, room.session_id, room.generation, changes);
        let (slot, index) = named.inspect_err(|_| self.released.push(name))?;
        let found = self.find_membership(slot, index, name);
        if found.is_none() && self.membership_indices(slot, index).count() >= MAX_ROOMS_PER_SESSION {
            self.released.push(name);
            return Err(LeaseError::invalid(
                "room_id",
                format!("the session is in {MAX_ROOMS_PER_SESSION} rooms already, the most one may be in"),
            ));
        }
        let joined = self.user_in_room(slot, name).0 == 0;
        let metadata = MemberMetadata::new(metadata);
        let order = self.stamps.next(now);
        match found {
            Some((_, at)) => {
                let membership = &mut self.memberships[at as usize];
                self.room_metadata.set(&mut membership.metadata, metadata);
                membership.order = order;
                // The membership holds a reference already.
                self.released.push(name);
            }
            None => self.push_membership(slot, index, name, metadata, order),
        }
        self.report_member(slot, name);
        Ok(joined)
    }

    /// Takes the session out of the room, ending its signals there (R1, S3).
    /// Returns whether it was in the room, and whether the user left it.
    /// `name` is the room's, if any session is in it.
    pub(crate) fn leave(
        &mut self,
        now: Tick,
        room: &RoomRef<'_>,
        name: Option<RoomName>,
        changes: &mut Changes,
    ) -> Result<(bool, bool), LeaseError> {
        let now = self.advance(now);
        let user = self.find(room.user_id);
        let (slot, index) = self.named_lease(now, user, room.user_id, room.session_id, room.generation, changes)?;
        let found = name.and_then(|name| Some((name, self.find_membership(slot, index, name)?)));
        let Some((name, (previous, at))) = found else { return Ok((false, false)) };
        self.end_signals(slot, index, Some(name));
        self.unlink_membership(slot, previous, at);
        self.free_membership(at);
        if self.membership_indices(slot, index).next().is_none() {
            self.lease_mut(index).link.set_flag(HAS_ROOMS, false);
            self.signals.remove(&index);
        }
        self.report_member(slot, name);
        Ok((true, self.user_in_room(slot, name).0 == 0))
    }

    /// Sets, extends (`ttl_ms > 0`) or clears (0) the session's signal of
    /// `kind` in a room it is in (S3). Returns whether the room's set of
    /// users signalling that kind changed.
    /// `name` is the room's, if any session is in it.
    pub(crate) fn signal(
        &mut self,
        now: Tick,
        room: &RoomRef<'_>,
        name: Option<RoomName>,
        kind: &str,
        ttl_ms: u32,
        changes: &mut Changes,
    ) -> Result<bool, LeaseError> {
        let now = self.advance(now);
        let user = self.find(room.user_id);
        let (slot, index) = self.named_lease(now, user, room.user_id, room.session_id, room.generation, changes)?;
        let Some(name) = name.filter(|&name| self.find_membership(slot, index, name).is_some()) else {
            return Err(LeaseError::NotInRoom {
                user_id: room.user_id.into(),
                session_id: room.session_id.into(),
                room_id: room.room_id.into(),
            });
        };
        let own = self
            .signals
            .get(&index)
            .and_then(|signals| signals.active.iter().position(|signal| signal.room == name && signal.kind == kind));
        let deadline = now + u64::from(ttl_ms);
        match (own, ttl_ms) {
            (Some(at), 1..) => {
                // A renewal of a signal already set: a longer life, nothing to publish.
                self.signals.get_mut(&index).expect("found above").active[at].deadline = deadline;
                self.schedule_no_later_than(slot, deadline);
                return Ok(false);
            }
            (None, 0) => return Ok(false),
            _ => {}
        }
        // Setting a signal no other session of the user sends, or clearing
        // the last one, changes the room's set: that is what is rationed.
        let others = self.user_signals(slot, index, name, kind);
        if !others {
            self.spend_signal_change(index, now, room)?;
        }
        let signals = self.signals.entry(index).or_insert_with(|| SessionSignals {
            window_start: now,
            window_changes: 0,
            active: Vec::new(),
        });
        match own {
            Some(at) => {
                signals.active.swap_remove(at);
            }
            None => {
                signals.active.push(ActiveSignal { room: name, kind: kind.into(), deadline });
                self.schedule_no_later_than(slot, deadline);
            }
        }
        if !others {
            self.facts.push(RoomFact::Signal {
                room_id: name,
                user_id: self.users[slot as usize].id.clone(),
                kind: kind.into(),
                on: own.is_none(),
            });
        }
        Ok(!others)
    }

    /// Counts one set change against the session's rate (S3), or refuses it.
    fn spend_signal_change(&mut self, index: u32, now: Tick, room: &RoomRef<'_>) -> Result<(), LeaseError> {
        let signals = self.signals.entry(index).or_insert_with(|| SessionSignals {
            window_start: now,
            window_changes: 0,
            active: Vec::new(),
        });
        if now >= signals.window_start + 1_000 {
            signals.window_start = now;
            signals.window_changes = 0;
        }
        if signals.window_changes >= SIGNAL_CHANGES_PER_SECOND {
            return Err(LeaseError::SignalRateExceeded {
                user_id: room.user_id.into(),
                session_id: room.session_id.into(),
                per_second: SIGNAL_CHANGES_PER_SECOND,
            });
        }
        signals.window_changes += 1;
        Ok(())
    }

    /// The rooms the user's sessions are in, each once, in no particular order.
    pub(crate) fn rooms_of(&self, user_id: &str) -> Vec<RoomName> {
        let Some(slot) = self.find(user_id) else { return Vec::new() };
        let mut rooms: Vec<RoomName> = self.user_memberships(slot).map(|at| self.membership(at).room).collect();
        rooms.sort_unstable();
        rooms.dedup();
        rooms
    }

    /// Where each user `users` accepts stands in each room it is in now: a
    /// `Member` fact per room and a `Signal` fact per kind it sends there, as
    /// of the stamp returned, which every fact the shard makes later exceeds
    /// (C1: a node re-asserting its users to the rooms' owners).
    pub(crate) fn room_facts_held(
        &mut self,
        now: Tick,
        users: &dyn Fn(&str) -> bool,
        out: &mut Vec<RoomFact<RoomName>>,
    ) -> u64 {
        let now = self.advance(now);
        for slot in 0..self.users.len() as u32 {
            let user = &self.users[slot as usize];
            if user.first_membership() != NIL && users(&user.id) {
                self.user_room_facts(slot, out);
            }
        }
        self.stamps.next(now)
    }

    /// [`Shard::room_facts_held`] of one user.
    pub(crate) fn room_facts_of(&mut self, now: Tick, user_id: &str, out: &mut Vec<RoomFact<RoomName>>) -> u64 {
        let now = self.advance(now);
        if let Some(slot) = self.find(user_id) {
            self.user_room_facts(slot, out);
        }
        self.stamps.next(now)
    }

    /// Where the user in `slot` stands in each room it is in.
    fn user_room_facts(&self, slot: u32, out: &mut Vec<RoomFact<RoomName>>) {
        let user_id = self.users[slot as usize].id.clone();
        let mut rooms: Vec<RoomName> = self.user_memberships(slot).map(|at| self.membership(at).room).collect();
        rooms.sort_unstable();
        rooms.dedup();
        for room in rooms {
            let (sessions, shown) = self.user_in_room(slot, room);
            let metadata = shown.cloned().unwrap_or_default();
            out.push(RoomFact::Member { room_id: room, user_id: user_id.clone(), sessions, metadata });
        }
        let mut signals: Vec<(RoomName, CompactString)> = self
            .lease_indices(slot)
            .filter_map(|index| self.signals.get(&index))
            .flat_map(|signals| signals.active.iter().map(|signal| (signal.room, signal.kind.clone())))
            .collect();
        signals.sort_unstable();
        signals.dedup();
        for (room, kind) in signals {
            out.push(RoomFact::Signal { room_id: room, user_id: user_id.clone(), kind, on: true });
        }
    }

    /// A stamp for a fact leaving the shard (see `room_intake.rs`): greater
    /// than every stamp the shard issued before.
    pub(crate) fn fact_stamp(&mut self) -> u64 {
        self.stamps.next(self.now)
    }

    /// Hands over the facts made for the room side since the last call.
    pub(crate) fn take_facts(&mut self) -> Vec<RoomFact<RoomName>> {
        std::mem::take(&mut self.facts)
    }

    /// Hands over the references to room names released since the last call,
    /// which the store drops once it has handed the facts on.
    pub(crate) fn take_released(&mut self) -> Vec<RoomName> {
        std::mem::take(&mut self.released)
    }

    /// The shard's time: the latest any operation brought.
    pub(crate) fn now(&self) -> Tick {
        self.now
    }

    pub(crate) fn unregister(
        &mut self,
        now: Tick,
        user_id: &str,
        session_id: &str,
        generation: u64,
        linger_ms: u32,
        changes: &mut Changes,
    ) -> Unregistered {
        let now = self.advance(now);
        let Some(slot) = self.find(user_id) else {
            return Unregistered { outcome: UnregisterOutcome::NotFound, changed: false, presence: Presence::UNKNOWN };
        };
        self.settle(slot, now, changes);
        let unchanged = |shard: &Self, outcome| Unregistered {
            outcome,
            changed: false,
            presence: shard.users[slot as usize].presence(),
        };
        let Some((previous, index)) = self.find_lease(slot, session_id) else {
            return unchanged(self, UnregisterOutcome::NotFound);
        };
        let current = self.lease(index).generation;
        if generation < current {
            // The delayed close of a socket that a reconnect has replaced (seed 000).
            return unchanged(self, UnregisterOutcome::StaleGeneration { current });
        }
        if generation > current {
            return unchanged(self, UnregisterOutcome::NotFound);
        }
        if linger_ms > 0 {
            let last_heartbeat_at = self.last_heartbeat_at(index);
            let lease = self.lease_mut(index);
            lease.link.set_flag(CLOSING, true);
            let until = lease.expires_at.min(now + u64::from(linger_ms));
            self.note_changed(slot);
            self.set_times(index, last_heartbeat_at.min(until), until);
            self.schedule_no_later_than(slot, until);
            self.end_hold_once_every_session_closed(slot);
            // A closing session attends to nothing (A2).
            self.refresh_activity(slot, now, changes);
            return unchanged(self, UnregisterOutcome::Lingering { until });
        }
        self.unlink(slot, previous, index);
        self.free_lease(slot, index);
        self.end_hold_once_every_session_closed(slot);
        let changed = !self.hold_for_grace(slot, now + self.offline_grace_ms) && self.after_removal(slot, now, changes);
        Unregistered { outcome: UnregisterOutcome::Removed, changed, presence: self.users[slot as usize].presence() }
    }

    pub(crate) fn revoke(
        &mut self,
        now: Tick,
        user_id: &str,
        session_id: Option<&str>,
        changes: &mut Changes,
    ) -> Revoked {
        let now = self.advance(now);
        let Some(slot) = self.find(user_id) else {
            return Revoked { count: 0, changed: false, presence: Presence::UNKNOWN };
        };
        self.settle(slot, now, changes);
        // A restart hold is no session: it is not revoked by id nor counted,
        // but it ends once no open session is left (see below).
        let doomed = |lease: &Lease| !lease.is_hold() && session_id.is_none_or(|id| lease.session_id == id);
        let count = self.remove_leases_where(slot, doomed).0;
        if count > 0 {
            self.end_hold_once_every_session_closed(slot);
        }
        // Revoke is never damped, and ends a damping already holding the user (E6).
        let undamped = self.remove_leases_where(slot, Lease::is_grace_hold).0 > 0;
        let changed = (count > 0 || undamped) && self.after_removal(slot, now, changes);
        Revoked {
            count: u32::try_from(count).unwrap_or(u32::MAX),
            changed,
            presence: self.users[slot as usize].presence(),
        }
    }

    /// Ends everything the store holds of the user but its record (P7):
    /// every lease, restart and grace holds included, with the rooms they
    /// were in (published as a Revoke's leaves are), and its status. Viewers
    /// are told once: the OFFLINE flip a Revoke publishes (carrying no
    /// status), or, for a user already OFFLINE that had a status, the status
    /// cleared. The user is left offline and idle, with its version, for
    /// [`Shard::forget_idle`] to forget.
    pub(crate) fn erase(&mut self, now: Tick, user_id: &str, changes: &mut Changes) -> Erased {
        let now = self.advance(now);
        let Some(slot) = self.find(user_id) else { return Erased::default() };
        self.settle(slot, now, changes);
        let sessions = self.lease_indices(slot).filter(|&index| !self.lease(index).is_hold()).count();
        let mut rooms: Vec<RoomName> = self.user_memberships(slot).map(|at| self.membership(at).room).collect();
        rooms.sort_unstable();
        rooms.dedup();
        let status = self.status(slot).is_some();
        if status {
            // Cleared before the flip, so that the flip carries none.
            self.set_user_status(slot, None);
        }
        self.remove_leases_where(slot, |_| true);
        let flipped = self.after_removal(slot, now, changes);
        if status && !flipped {
            self.announce(slot, now, changes);
        }
        Erased {
            sessions: u32::try_from(sessions).unwrap_or(u32::MAX),
            rooms: u32::try_from(rooms.len()).unwrap_or(u32::MAX),
            status,
            flipped,
        }
    }

    /// Forgets the user now if it is idle (offline, no lease, no status),
    /// version and all, as the forget window would (B6): from then on it is
    /// answered as a user never seen. Returns whether it was held and idle.
    /// While a checkpoint is part-way through this shard the forget waits
    /// until it is past (see [`Shard::forget`]): a second at most.
    pub(crate) fn forget_idle(&mut self, now: Tick, user_id: &str) -> bool {
        let now = self.advance(now);
        let Some(slot) = self.find(user_id) else { return false };
        if !self.is_idle(slot) {
            return false;
        }
        self.cancel_timer(slot);
        if !self.forget(slot, now) {
            self.forget_when_due.insert(self.users[slot as usize].id.clone());
        }
        true
    }

    /// The user's presence at `now`, settling it first.
    pub(crate) fn presence(&mut self, now: Tick, user_id: &str, changes: &mut Changes) -> Presence {
        let now = self.advance(now);
        match self.find(user_id) {
            Some(slot) => {
                self.settle(slot, now, changes);
                self.users[slot as usize].presence()
            }
            None => Presence::UNKNOWN,
        }
    }

    /// The user's presence and status at `now`, settling it first.
    pub(crate) fn view(&mut self, now: Tick, user_id: &str, changes: &mut Changes) -> UserView {
        let now = self.advance(now);
        match self.find(user_id) {
            Some(slot) => {
                self.settle(slot, now, changes);
                self.view_of(slot)
            }
            None => UserView { presence: Presence::UNKNOWN, status: None },
        }
    }

    /// Sets (or, with `None`, clears) the user's status: a change viewers see,
    /// with a new version, whatever the state. A status with an expiry clears
    /// itself through the wheel.
    pub(crate) fn set_status(
        &mut self,
        now: Tick,
        user_id: &str,
        status: Option<Status>,
        changes: &mut Changes,
    ) -> UserView {
        let now = self.advance(now);
        let slot = self.find_or_insert(user_id);
        self.settle(slot, now, changes);
        let deadline = status.as_ref().and_then(|status| status.expires_at);
        self.set_user_status(slot, status.map(Arc::new));
        if let Some(deadline) = deadline {
            self.schedule_no_later_than(slot, deadline);
        }
        self.announce(slot, now, changes);
        // Clearing the status of an offline user leaves it idle from now on.
        self.arm_forget(slot, now);
        self.view_of(slot)
    }

    /// Puts back a status kept elsewhere (after a restart) without a change or a new version.
    pub(crate) fn restore_status(&mut self, now: Tick, user_id: &str, status: Status) {
        self.advance(now);
        let slot = self.find_or_insert(user_id);
        let deadline = status.expires_at;
        self.set_user_status(slot, Some(Arc::new(status)));
        if let Some(deadline) = deadline {
            self.schedule_no_later_than(slot, deadline);
        }
    }

    /// Gives the user a new version without publishing anything: for changes
    /// outside the store that some viewers see (who may see the user), so that
    /// what they are told next is newer than anything they hold.
    pub(crate) fn bump_version(&mut self, now: Tick, user_id: &str, changes: &mut Changes) -> UserView {
        let now = self.advance(now);
        let slot = self.find_or_insert(user_id);
        self.settle(slot, now, changes);
        self.bump(slot, now);
        // A change viewers see counts as being seen: an idle user's window starts again.
        self.arm_forget(slot, now);
        self.view_of(slot)
    }

    /// As [`Shard::bump_version`] for a user the shard holds; a user it does
    /// not hold (never seen, forgotten, erased) is given a version above
    /// every one the shard issued and stays unheld: shown OFFLINE with it.
    pub(crate) fn bump_version_if_held(&mut self, now: Tick, user_id: &str, changes: &mut Changes) -> UserView {
        if self.find(user_id).is_some() {
            return self.bump_version(now, user_id, changes);
        }
        let now = self.advance(now);
        let version = self.stamps.next(now);
        UserView { presence: Presence::new(State::Offline, version), status: None }
    }

    /// The user's leases at `now`, settling it first; the most recently created first.
    pub(crate) fn leases(&mut self, now: Tick, user_id: &str, changes: &mut Changes) -> Vec<LeaseView> {
        let now = self.advance(now);
        let Some(slot) = self.find(user_id) else { return Vec::new() };
        self.settle(slot, now, changes);
        self.lease_indices(slot)
            .filter(|&index| !self.lease(index).is_hold()) // a hold is no session
            .map(|index| self.lease_view(index))
            .collect()
    }

    /// The user's live sessions at `now`, the most recently created first,
    /// each with the rooms it is in (interned names, in no particular order).
    /// A pure read for operators (O4): it settles nothing, counts no
    /// operation and leaves the shard's time alone, so listing a user can
    /// change nothing about it. A lease whose deadline has passed is left out,
    /// as settling would drop it; time is the later of `now` and the shard's,
    /// which never goes back.
    pub(crate) fn live_sessions(&self, now: Tick, user_id: &str) -> Vec<(LeaseView, Vec<(RoomName, RoomMetadata)>)> {
        let now = self.now.max(now);
        let Some(slot) = self.find(user_id) else { return Vec::new() };
        self.lease_indices(slot)
            .filter(|&index| {
                let lease = self.lease(index);
                !lease.is_hold() && lease.expires_at > now
            })
            .map(|index| {
                let rooms = self
                    .membership_indices(slot, index)
                    .map(|at| {
                        let membership = self.membership(at);
                        (membership.room, self.room_metadata.get(membership.metadata).shared())
                    })
                    .collect();
                (self.lease_view(index), rooms)
            })
            .collect()
    }

    /// Applies a change of the attention of the lease a gateway names (A1);
    /// returns whether anything changed. Named as a renewal names its lease
    /// (L2): a closing, stale or unknown one is refused.
    pub(crate) fn set_attention(
        &mut self,
        now: Tick,
        lease: (&str, &str, u64),
        change: &AttentionChange<'_>,
        changes: &mut Changes,
    ) -> Result<bool, LeaseError> {
        let (user_id, session_id, generation) = lease;
        let now = self.advance(now);
        let slot = self.find(user_id);
        let (slot, index) = self.named_lease(now, slot, user_id, session_id, generation, changes)?;
        if change.is_empty() || !self.attention_mut(index).apply(change, now) {
            return Ok(false);
        }
        self.refresh_activity(slot, now, changes);
        Ok(true)
    }

    /// Whether the user shares its availability with viewers (A2); it does
    /// unless told otherwise. A change shows at once, as a change of the
    /// user (a new version) if it is held and online: hidden is shown as a
    /// user whose sessions never said what their humans do.
    pub(crate) fn set_shares_activity(&mut self, now: Tick, user_id: &str, shares: bool, changes: &mut Changes) {
        let now = self.advance(now);
        let changed = if shares {
            self.activity_hidden.remove(user_id)
        } else {
            self.activity_hidden.insert(CompactString::from(user_id))
        };
        if let Some(slot) = self.find(user_id).filter(|_| changed) {
            self.settle(slot, now, changes);
            self.refresh_activity(slot, now, changes);
        }
    }

    fn attention_mut(&mut self, index: u32) -> &mut SessionAttention {
        if self.attention.len() <= index as usize {
            self.attention.resize(self.leases.len(), SessionAttention::default());
        }
        &mut self.attention[index as usize]
    }

    /// What the user's sessions make its availability at `now`, as viewers
    /// may see it (A2), and when an `ACTIVE` through the window ends: none
    /// while it is offline or does not share it. A grace hold (E6) is no
    /// session, nor is one closing: a user held online by either alone has none.
    fn derived_activity(&self, slot: u32, now: Tick) -> (Option<Activity>, Option<Tick>) {
        let user = &self.users[slot as usize];
        if !user.online() || (!self.activity_hidden.is_empty() && self.activity_hidden.contains(user.id.as_str())) {
            return (None, None);
        }
        derive_activity(self.attending(slot, now).map(|(_, attention)| attention), now, self.active_window_ms)
    }

    /// Shows the user's availability as its sessions now make it (A2): a
    /// change of it is a change of the user, with a new version (M3); an
    /// `ACTIVE` that lasts through the window is given a timer for its end.
    fn refresh_activity(&mut self, slot: u32, now: Tick, changes: &mut Changes) {
        let (activity, until) = self.derived_activity(slot, now);
        if let Some(until) = until {
            self.schedule_no_later_than(slot, until);
        }
        if activity != self.users[slot as usize].activity() {
            self.users[slot as usize].set_activity(activity);
            self.publish_change(slot, ChangeKind::Activity, now, None, changes);
        }
    }

    /// The attention of each of the user's live sessions at `now` (a pure
    /// read, as [`Shard::live_sessions`]): sessions lingering after a close
    /// are gone for this.
    pub(crate) fn attention_of(&self, now: Tick, user_id: &str) -> Vec<(CompactString, SessionAttention)> {
        let now = self.now.max(now);
        let Some(slot) = self.find(user_id) else { return Vec::new() };
        self.attending(slot, now).map(|(index, attention)| (self.lease(index).session_id.clone(), attention)).collect()
    }

    /// The user's sessions whose attention counts at `now` (A2, A3), with
    /// it: live ones, not a hold (no session), not closing (its socket is gone).
    fn attending(&self, slot: u32, now: Tick) -> impl Iterator<Item = (u32, SessionAttention)> + '_ {
        self.lease_indices(slot).filter_map(move |index| {
            let lease = self.lease(index);
            let counts = !lease.is_hold() && !lease.closing() && lease.expires_at > now;
            counts.then(|| (index, self.attention.get(index as usize).copied().unwrap_or_default()))
        })
    }

    fn lease_view(&self, index: u32) -> LeaseView {
        let lease = self.lease(index);
        LeaseView {
            session_id: lease.session_id.clone(),
            gateway_id: self.origins.gateway_id(lease.origin).into(),
            generation: lease.generation,
            last_heartbeat_at: self.last_heartbeat_at(index),
            expires_at: lease.expires_at,
            closing: lease.closing(),
            metadata: self.metadata.get(&index).map(|entries| entries.to_vec()).unwrap_or_default(),
        }
    }

    /// Settles up to `budget` users whose timers are due at `now`. Returns
    /// whether more may be due, so that the caller can release the lock between
    /// batches and a mass expiry never holds the shard for long.
    ///
    /// Users in `paused` slots (a handover is moving them, C3) are not
    /// settled: their timers are put back [`PAUSED_RETRY_MS`] on, so that
    /// the node handing them over publishes nothing for them while the node
    /// taking them over expires them from the same deadlines.
    pub(crate) fn expire(&mut self, now: Tick, budget: usize, paused: Option<&SlotSet>, changes: &mut Changes) -> bool {
        let now = self.advance(now);
        let mut more = true;
        for _ in 0..budget {
            let Some((_, slot)) = self.wheel.poll(now) else {
                more = false;
                break;
            };
            if paused.is_some_and(|paused| paused.holds(self.users[slot as usize].id.as_bytes())) {
                self.schedule_no_later_than(slot, now + PAUSED_RETRY_MS);
                continue;
            }
            self.settle(slot, now, changes);
            let leases = self.lease_indices(slot).map(|index| self.lease(index).expires_at);
            // An ACTIVE through the window has its timer from settling (`refresh_activity`).
            let earliest = leases.chain(self.status_deadline(slot)).chain(self.signal_deadlines(slot)).min();
            // An erased user whose forget waited for a checkpoint (or that came back since).
            let erased =
                !self.forget_when_due.is_empty() && self.forget_when_due.remove(self.users[slot as usize].id.as_str());
            if let Some(earliest) = earliest {
                self.schedule_no_later_than(slot, earliest);
            } else if (erased || self.forget_offline_after_ms > 0)
                && self.wheel.deadline(slot).is_none()
                && self.is_idle(slot)
            {
                // Idle before the entry fired (settling made nothing idle, or it
                // would have set a new entry): this was the entry set when the
                // user became idle, a whole window ago.
                if !self.forget(slot, now) && erased {
                    self.forget_when_due.insert(self.users[slot as usize].id.clone());
                }
            }
        }
        self.shrink_if_mostly_empty();
        let more = more && self.wheel.next_deadline().is_some_and(|next| next <= now);
        if !more && self.forgotten_since_tidy > 0 && self.forgotten_since_tidy * 4 >= self.users.len() {
            self.tidy();
        }
        more
    }

    /// A time at or before the earliest deadline in the shard: a lease's, a
    /// status's, or a pending forget's.
    pub(crate) fn next_deadline(&self) -> Option<Tick> {
        self.wheel.next_deadline()
    }

    /// The earliest timer scheduled since the last call.
    pub(crate) fn take_earliest_new_timer(&mut self) -> Option<Tick> {
        self.earliest_new_timer.take()
    }

    pub(crate) fn sessions(&self) -> usize {
        self.sessions - self.holds
    }

    pub(crate) fn suppressed_flaps(&self) -> u64 {
        self.suppressed_flaps
    }

    pub(crate) fn online_users(&self) -> usize {
        self.online
    }

    pub(crate) fn operations(&self) -> u64 {
        self.operations
    }

    pub(crate) fn users(&self) -> usize {
        self.users.len()
    }

    pub(crate) fn forgotten(&self) -> u64 {
        self.forgotten
    }

    /// Appends up to `budget` users of the shard, from user slot `from`, with
    /// their leases, to a checkpoint; returns where to continue, or `None` when
    /// the shard is done. A shard written in several lock holds still holds
    /// every user once, each as it was at some instant: slots move only when a
    /// user is forgotten (the last user fills its slot), and while a
    /// checkpoint is part-way through, a forget that would move an unwritten
    /// user into the written part waits (see [`Shard::forget`]).
    ///
    /// With `only`, the users of those cluster slots alone are written: a
    /// handover's state (C3), in the checkpoint's format.
    pub(crate) fn checkpoint(
        &mut self,
        writer: &mut CheckpointWriter,
        from: usize,
        budget: usize,
        only: Option<&SlotSet>,
        names: &RoomNames,
    ) -> Option<usize> {
        if from == 0 {
            writer.clock(self.stamps.last());
        }
        let end = from.saturating_add(budget).min(self.users.len());
        for slot in from..end {
            let user = &self.users[slot];
            if only.is_some_and(|only| !only.holds(user.id.as_bytes())) {
                continue;
            }
            self.checkpoint_user(writer, slot as u32, names);
        }
        self.checkpoint_cursor = (end < self.users.len()).then_some(end);
        self.checkpoint_cursor
    }

    /// Writes the user in `slot` with its leases to a checkpoint.
    fn checkpoint_user(&self, writer: &mut CheckpointWriter, slot: u32, names: &RoomNames) {
        let user = &self.users[slot as usize];
        // A damped user is written with no lease for its grace hold: it
        // restores as any online user with no lease does (E6, B3).
        let leases: Vec<u32> = self.lease_indices(slot).filter(|&index| !self.lease(index).is_grace_hold()).collect();
        writer.user(&user.id, user.version, user.online(), u16::try_from(leases.len()).unwrap_or(u16::MAX));
        for index in leases.into_iter().take(usize::from(u16::MAX)) {
            let lease = self.lease(index);
            let metadata = self.metadata.get(&index).map_or(&[][..], |entries| &entries[..]);
            let room_ids: Vec<CompactString> =
                self.membership_indices(slot, index).map(|at| names.id(self.membership(at).room)).collect();
            let rooms: Vec<MembershipOut<'_>> = self
                .membership_indices(slot, index)
                .zip(&room_ids)
                .map(|(at, room_id)| {
                    let membership = self.membership(at);
                    (room_id.as_str(), membership.order, self.room_metadata.get(membership.metadata).entries())
                })
                .collect();
            writer.lease(
                &lease.session_id,
                self.origins.gateway_id(lease.origin),
                lease.generation,
                self.last_heartbeat_at(index),
                lease.expires_at,
                lease.closing(),
                metadata,
                &rooms,
            );
        }
    }

    /// Makes every stamp issued from now on greater than `last_stamp`.
    pub(crate) fn restore_clock(&mut self, last_stamp: u64) {
        self.stamps.raise_to(last_stamp);
    }

    /// Holds the users from slot `from` on, at most `budget` of them, online
    /// until `until` with a [`Lease::restart_hold`], as a restart does (B3):
    /// after the service did not run for a while, so that nobody flips merely
    /// because its gateway could not reach it meanwhile. Only users ONLINE
    /// with a session not closed get one, so that the hold never outlives an
    /// explicit close; a user already held as long is left alone. Publishes
    /// nothing. Returns how many were held and the slot to go on from, if any.
    pub(crate) fn hold_online_users(
        &mut self,
        now: Tick,
        until: Tick,
        from: u32,
        budget: usize,
    ) -> (usize, Option<u32>) {
        let now = self.advance(now);
        let end = (from as usize).saturating_add(budget).min(self.users.len());
        let mut held = 0;
        for slot in from..end as u32 {
            if until <= now || !self.users[slot as usize].online() {
                continue;
            }
            let (mut open, mut held_as_long) = (false, false);
            for index in self.lease_indices(slot) {
                let lease = self.lease(index);
                open |= !lease.is_hold() && !lease.closing();
                held_as_long |= lease.is_restart_hold() && lease.expires_at >= until;
            }
            if open && !held_as_long {
                let origin = self.origins.acquire(RESTART_HOLD_SESSION_ID, before_expiry(now, until));
                self.push_lease(slot, Lease::restart_hold(origin, until));
                held += 1;
            }
        }
        (held, (end < self.users.len()).then_some(end as u32))
    }

    /// Puts back a checkpointed user, its version and its leases, keeping their
    /// generations and deadlines. A user that was online is held online until
    /// `hold_until` by a [`Lease::restart_hold`], so that it does not flip
    /// merely because its gateway has not been heard from yet; leases whose
    /// deadline passed meanwhile expire through the wheel. Returns the user's
    /// slot if it was online with nothing to hold it: its OFFLINE is due now,
    /// by [`Shard::finish_restore`] once every clock is restored.
    ///
    /// Every lease's deadline is at least `lease_floor` (0 keeps them): a
    /// follower taking over a dead owner's slots knows the leases but not
    /// their last renewals (C4).
    pub(crate) fn restore_user(
        &mut self,
        now: Tick,
        user: &UserRecord<'_>,
        hold_until: Tick,
        lease_floor: Tick,
        names: &RoomNames,
    ) -> Option<u32> {
        let now = self.advance(now);
        let slot = self.find_or_insert(user.user_id);
        self.note_changed(slot);
        // A user written twice (forgotten and back while the checkpoint was
        // being written) is taken as its later record, which is the newer.
        self.remove_leases_where(slot, |_| true);
        self.cancel_timer(slot);
        let record = &mut self.users[slot as usize];
        if record.online() {
            record.link.set_flag(ONLINE, false);
            self.online -= 1;
        }
        record.version = user.version;
        // The shard's clock records carry its last stamp; should a record
        // carry a later one, later stamps still exceed it (M4).
        self.stamps.raise_to(user.version);
        if user.online {
            record.link.set_flag(ONLINE, true);
            self.online += 1;
        }
        // Leases are prepended: this restore's hold first, so that it sits at
        // the end of the list, then the leases last first so that the list
        // keeps its order. A hold written by an earlier restore comes back as
        // a hold: it is stored like a lease, under the hold's session id.
        if user.online && hold_until > now {
            let origin = self.origins.acquire(RESTART_HOLD_SESSION_ID, before_expiry(now, hold_until));
            self.push_lease(slot, Lease::restart_hold(origin, hold_until));
        }
        for lease in user.leases.iter().rev() {
            let expires_at = lease.expires_at.max(lease_floor);
            let last_heartbeat_at = lease.last_heartbeat_at.min(expires_at);
            let origin = self.origins.acquire(lease.gateway_id, before_expiry(last_heartbeat_at, expires_at));
            self.stamps.raise_to(lease.generation);
            let mut restored = Lease::new(lease.session_id, lease.generation, expires_at, origin, lease.closing);
            if restored.is_hold() {
                // Only restart holds are written; whatever a damaged file says, it is one.
                restored.generation = 0;
            }
            let index = self.push_lease(slot, restored);
            self.set_metadata(index, &lease.metadata);
            // Prepended too, last first, so that the list keeps its order.
            for room in lease.rooms.iter().rev() {
                self.stamps.raise_to(room.order);
                let metadata = MemberMetadata::new(&room.metadata);
                self.push_membership(slot, index, names.acquire(room.room_id), metadata, room.order);
            }
        }
        let rooms = self.user_memberships(slot).map(|at| self.membership(at).room).collect();
        self.report_members(slot, rooms);
        if self.users[slot as usize].online() && self.users[slot as usize].first_lease() == NIL {
            return Some(slot);
        }
        // Offline at the checkpoint: idle from the restore on (how long it had
        // been idle before is not stored, so its window starts again).
        self.arm_forget(slot, now);
        None
    }

    /// Takes over a user handed over by another node (C3): as
    /// [`Shard::restore_user`] with no hold, its leases keeping their
    /// generations and deadlines; a user handed over online with no lease left
    /// goes OFFLINE now, published, as it would have at the node it came from.
    pub(crate) fn import_user(&mut self, now: Tick, user: &UserRecord<'_>, names: &RoomNames, changes: &mut Changes) {
        if let Some(slot) = self.restore_user(now, user, 0, 0, names) {
            let now = self.advance(now);
            self.after_removal(slot, now, changes);
        }
    }

    /// Takes over a user a follower kept of a dead node (C4): as
    /// [`Shard::restore_user`], every lease living until `hold_until` at
    /// least and an online user held online until then.
    pub(crate) fn take_over_user(
        &mut self,
        now: Tick,
        user: &UserRecord<'_>,
        hold_until: Tick,
        names: &RoomNames,
        changes: &mut Changes,
    ) {
        if let Some(slot) = self.restore_user(now, user, hold_until, hold_until, names) {
            let now = self.advance(now);
            self.after_removal(slot, now, changes);
        }
    }

    /// The status the user holds, settling nothing.
    pub(crate) fn status_named(&self, user_id: &str) -> Option<Status> {
        self.find(user_id).and_then(|slot| self.status(slot)).map(|status| Status::clone(status))
    }

    /// The statuses of the users of `slots`, to hand over with them (C3).
    pub(crate) fn statuses_in(&self, slots: &SlotSet) -> Vec<(CompactString, Status)> {
        self.statuses
            .iter()
            .map(|(&slot, status)| (&self.users[slot as usize].id, status))
            .filter(|(id, _)| slots.holds(id.as_bytes()))
            .map(|(id, status)| (id.clone(), Status::clone(status)))
            .collect()
    }

    /// Drops, publishing nothing, every user of the `slots` another node has
    /// taken over (C3): their leases, memberships, signals and statuses, then
    /// the users themselves.
    ///
    /// Looks at most `visits` users, from the one below `below` (`None`:
    /// from the last) downwards, and answers where the next call goes on
    /// (`None`: done), with how many it dropped. Between calls the shard may change: a user dropped
    /// meanwhile moves the last user into its place, which the next calls
    /// see (again, at worst), and a user added goes last, which they do not:
    /// no user of `slots` is added once they are given away.
    pub(crate) fn release(
        &mut self,
        now: Tick,
        slots: &SlotSet,
        below: Option<u32>,
        visits: usize,
    ) -> (usize, Option<u32>) {
        let now = self.advance(now);
        let end = below.map_or(self.users.len(), |below| (below as usize).min(self.users.len()));
        let start = end.saturating_sub(visits);
        let mut released = 0;
        for slot in (start as u32..end as u32).rev() {
            if slots.holds(self.users[slot as usize].id.as_bytes()) {
                // Forgetting moves the last user here, which was seen already.
                self.drop_user(slot, now);
                released += 1;
            }
        }
        (released, (start > 0).then_some(start as u32))
    }

    /// Drops, publishing nothing, the users named that this shard holds (a
    /// follower's copy of users its owner forgot or no longer has). Returns
    /// how many it held.
    pub(crate) fn release_users(&mut self, now: Tick, user_ids: &[CompactString]) -> Imported {
        let now = self.advance(now);
        let (mut users, mut sessions) = (0, 0);
        for user_id in user_ids {
            if let Some(slot) = self.find(user_id) {
                // A hold (through a stall, a restart or a takeover) is not a session.
                sessions += self.lease_indices(slot).filter(|&index| !self.lease(index).is_hold()).count();
                self.drop_user(slot, now);
                users += 1;
            }
        }
        Imported { users, sessions }
    }

    /// Drops the user in `slot` whole, publishing nothing; the last user takes its slot.
    fn drop_user(&mut self, slot: u32, now: Tick) {
        self.remove_leases_where(slot, |_| true);
        self.set_user_status(slot, None);
        let record = &mut self.users[slot as usize];
        if record.online() {
            record.link.set_flag(ONLINE, false);
            self.online -= 1;
        }
        self.cancel_timer(slot);
        self.forget(slot, now);
    }

    /// Writes the users named that this shard holds to a checkpoint, with
    /// the shard's stamp clock; returns the ones it does not hold (C4: a
    /// follower drops them).
    pub(crate) fn checkpoint_users(
        &mut self,
        writer: &mut CheckpointWriter,
        user_ids: &[CompactString],
        names: &RoomNames,
    ) -> Vec<CompactString> {
        writer.clock(self.stamps.last());
        let mut absent = Vec::new();
        for user_id in user_ids {
            match self.find(user_id) {
                Some(slot) => self.checkpoint_user(writer, slot, names),
                None => absent.push(user_id.clone()),
            }
        }
        absent
    }

    /// Flips OFFLINE a restored user that [`Shard::restore_user`] found online
    /// with nothing to hold it, if it still is (a user written twice may have
    /// been restored again since). Nobody watches a store being restored, so
    /// the change is not published; it only moves the version.
    pub(crate) fn finish_restore(&mut self, now: Tick, slot: u32) {
        let now = self.advance(now);
        let user = &self.users[slot as usize];
        if user.online() && user.first_lease() == NIL {
            let mut unpublished = Vec::new();
            self.after_removal(slot, now, &mut unpublished);
        }
    }

    /// Moves the shard's time forward to `now` (never back) and counts the operation.
    fn advance(&mut self, now: Tick) -> Tick {
        self.operations += 1;
        self.now = self.now.max(now);
        self.now
    }

    fn hash(&self, user_id: &str) -> u64 {
        self.hasher.hash_one(user_id)
    }

    fn find(&self, user_id: &str) -> Option<u32> {
        self.find_hashed(self.hash(user_id), user_id)
    }

    fn find_hashed(&self, hash: u64, user_id: &str) -> Option<u32> {
        self.index.find(hash, |slot| self.users[slot as usize].id == user_id)
    }

    fn find_or_insert(&mut self, user_id: &str) -> u32 {
        if let Some(slot) = self.find(user_id) {
            return slot;
        }
        let slot = u32::try_from(self.users.len()).expect("fewer than 2^32 users per shard");
        self.users.push(User::new(user_id));
        self.index.insert(self.hash(user_id), slot);
        slot
    }

    fn lease(&self, index: u32) -> &Lease {
        self.leases[index as usize].as_ref().expect("a listed lease is occupied")
    }

    fn lease_mut(&mut self, index: u32) -> &mut Lease {
        self.leases[index as usize].as_mut().expect("a listed lease is occupied")
    }

    /// The user's leases, as slab indices.
    fn lease_indices(&self, slot: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(self.users[slot as usize].first_lease()).filter(|&i| i != NIL), |&index| {
            Some(self.lease(index).next()).filter(|&next| next != NIL)
        })
    }

    /// The user's lease of `session_id`, with the lease before it in the user's list (or `NIL`).
    fn find_lease(&self, slot: u32, session_id: &str) -> Option<(u32, u32)> {
        find_in_list(self.lease_indices(slot), |index| self.lease(index).session_id == session_id)
    }

    /// Puts a lease at the front of the user's list and makes sure the user's
    /// timer fires by its deadline.
    fn push_lease(&mut self, slot: u32, mut lease: Lease) -> u32 {
        lease.link.set_index(self.users[slot as usize].first_lease());
        let deadline = lease.expires_at;
        let index = self.allocate_lease(lease);
        self.users[slot as usize].link.set_index(index);
        self.schedule_no_later_than(slot, deadline);
        index
    }

    fn allocate_lease(&mut self, lease: Lease) -> u32 {
        self.sessions += 1;
        if lease.is_hold() {
            self.holds += 1;
        }
        match self.free_leases.pop() {
            Some(index) => {
                self.leases[index as usize] = Some(lease);
                index
            }
            None => {
                let index = u32::try_from(self.leases.len()).ok().filter(|&index| index < NIL);
                let index = index.expect("fewer than 2^30 - 1 leases per shard");
                self.leases.push(Some(lease));
                index
            }
        }
    }

    /// Takes a lease out of its user's list.
    fn unlink(&mut self, slot: u32, previous: u32, index: u32) {
        let next = self.lease(index).next();
        if previous == NIL {
            self.users[slot as usize].link.set_index(next);
        } else {
            self.lease_mut(previous).link.set_index(next);
        }
    }

    /// Frees an unlinked lease's slot, origin, metadata and rooms.
    fn free_lease(&mut self, slot: u32, index: u32) -> Lease {
        self.note_changed(slot);
        self.drop_rooms(slot, index);
        let lease = self.leases[index as usize].take().expect("a freed lease is occupied");
        if lease.is_hold() {
            self.holds -= 1;
        }
        self.origins.release(lease.origin);
        if lease.has_metadata() {
            self.metadata.remove(&index);
        }
        if let Some(attention) = self.attention.get_mut(index as usize) {
            *attention = SessionAttention::default();
        }
        self.free_leases.push(index);
        self.sessions -= 1;
        lease
    }

    fn set_metadata(&mut self, index: u32, entries: &[(String, String)]) {
        let has_metadata = !entries.is_empty();
        if has_metadata {
            self.metadata.insert(index, entries.into());
        } else if self.lease(index).has_metadata() {
            self.metadata.remove(&index);
        }
        self.lease_mut(index).link.set_flag(HAS_METADATA, has_metadata);
    }

    /// When the lease was last written (registered, renewed; a linger keeps it).
    fn last_heartbeat_at(&self, index: u32) -> Tick {
        let lease = self.lease(index);
        lease.expires_at - u64::from(self.origins.before_expiry(lease.origin))
    }

    /// Sets the lease's last write and deadline.
    fn set_times(&mut self, index: u32, last_heartbeat_at: Tick, expires_at: Tick) {
        let lease = self.leases[index as usize].as_mut().expect("a listed lease is occupied");
        lease.expires_at = expires_at;
        lease.origin = self.origins.with_before_expiry(lease.origin, before_expiry(last_heartbeat_at, expires_at));
    }

    /// The room memberships of all the user's sessions, as slab indices, most recently joined first.
    fn user_memberships(&self, slot: u32) -> impl Iterator<Item = u32> + '_ {
        std::iter::successors(Some(self.users[slot as usize].first_membership()).filter(|&at| at != NIL), |&at| {
            Some(self.membership(at).next).filter(|&next| next != NIL)
        })
    }

    /// The room memberships of the user's lease `index`, most recently joined first.
    fn membership_indices(&self, slot: u32, index: u32) -> impl Iterator<Item = u32> + '_ {
        let has_rooms = self.lease(index).has_rooms();
        self.user_memberships(slot).filter(move |&at| has_rooms && self.membership(at).lease == index)
    }

    fn membership(&self, at: u32) -> &Membership {
        let membership = &self.memberships[at as usize];
        debug_assert!(!membership.is_free(), "a listed membership is occupied");
        membership
    }

    fn membership_mut(&mut self, at: u32) -> &mut Membership {
        let membership = &mut self.memberships[at as usize];
        debug_assert!(!membership.is_free(), "a listed membership is occupied");
        membership
    }

    /// The lease's membership of the room, with the one before it in the user's list (or `NIL`).
    fn find_membership(&self, slot: u32, index: u32, room: RoomName) -> Option<(u32, u32)> {
        if !self.lease(index).has_rooms() {
            return None;
        }
        find_in_list(self.user_memberships(slot), |at| {
            let membership = self.membership(at);
            membership.lease == index && membership.room == room
        })
    }

    /// Takes a membership out of its user's list, `previous` being the one before it (or `NIL`).
    fn unlink_membership(&mut self, slot: u32, previous: u32, at: u32) {
        let next = self.membership(at).next;
        match previous {
            NIL => self.users[slot as usize].rooms.set_index(next),
            previous => self.membership_mut(previous).next = next,
        }
    }

    /// Puts a membership of lease `index` at the front of its user's list.
    fn push_membership(&mut self, slot: u32, index: u32, room: RoomName, metadata: MemberMetadata, order: u64) {
        let next = self.users[slot as usize].first_membership();
        let mut membership = Membership { room, metadata: NO_METADATA, order, next, lease: index };
        self.room_metadata.set(&mut membership.metadata, metadata);
        let at = match self.free_memberships.pop() {
            Some(at) => {
                self.memberships[at as usize] = membership;
                at
            }
            None => {
                self.memberships.push(membership);
                u32::try_from(self.memberships.len() - 1).expect("fewer than 2^32 memberships per shard")
            }
        };
        self.users[slot as usize].rooms.set_index(at);
        self.lease_mut(index).link.set_flag(HAS_ROOMS, true);
    }

    /// Frees a membership's slot; the reference to its room's name is released.
    fn free_membership(&mut self, at: u32) -> Membership {
        let mut membership = std::mem::replace(&mut self.memberships[at as usize], Membership::FREE);
        debug_assert!(!membership.is_free(), "a freed membership is occupied");
        self.room_metadata.set(&mut membership.metadata, MemberMetadata::NONE);
        self.released.push(membership.room);
        self.free_memberships.push(at);
        if mostly_empty(self.memberships.len() - self.free_memberships.len(), self.memberships.len())
            && self.memberships.last().is_some_and(Membership::is_free)
        {
            // Only free slots at the end can go without renumbering anything.
            while self.memberships.last().is_some_and(Membership::is_free) {
                self.memberships.pop();
            }
            let len = self.memberships.len() as u32;
            self.free_memberships.retain(|&free| free < len);
            self.memberships.shrink_to(self.memberships.len() * 2);
        }
        membership
    }

    /// How many of the user's sessions are in the room, and the metadata of
    /// the one that joined or updated last, which the user shows (R6).
    fn user_in_room(&self, slot: u32, room: RoomName) -> (u32, Option<&MemberMetadata>) {
        let mut sessions = 0;
        let mut shown: Option<&Membership> = None;
        for at in self.user_memberships(slot) {
            let membership = self.membership(at);
            if membership.room == room {
                sessions += 1;
                if shown.is_none_or(|shown| shown.order < membership.order) {
                    shown = Some(membership);
                }
            }
        }
        (sessions, shown.map(|membership| self.room_metadata.get(membership.metadata)))
    }

    /// Tells the room side where the user stands in the room now.
    fn report_member(&mut self, slot: u32, room: RoomName) {
        self.note_changed(slot);
        let user_id = self.users[slot as usize].id.clone();
        let fact = match self.user_in_room(slot, room) {
            (0, _) => RoomFact::Left { room_id: room, user_id },
            (sessions, shown) => {
                RoomFact::Member { room_id: room, user_id, sessions, metadata: shown.cloned().unwrap_or_default() }
            }
        };
        self.facts.push(fact);
    }

    /// Whether a session of the user other than lease `except` signals `kind` in the room.
    fn user_signals(&self, slot: u32, except: u32, room: RoomName, kind: &str) -> bool {
        self.lease_indices(slot).filter(|&index| index != except && self.lease(index).has_rooms()).any(|index| {
            self.signals
                .get(&index)
                .is_some_and(|signals| signals.active.iter().any(|signal| signal.room == room && signal.kind == kind))
        })
    }

    /// Ends the lease's signals in the room (all of them with `None`), and
    /// tells the room side of every kind the user no longer signals there.
    fn end_signals(&mut self, slot: u32, index: u32, room: Option<RoomName>) {
        let Some(signals) = self.signals.get_mut(&index) else { return };
        let mut ended = Vec::new();
        signals.active.retain(|signal| {
            let ends = room.is_none_or(|room| signal.room == room);
            if ends {
                ended.push((signal.room, signal.kind.clone()));
            }
            !ends
        });
        self.report_signals_ended(slot, index, ended);
    }

    /// For each signal of lease `index` that ended, tells the room side if no
    /// other session of the user sends it.
    fn report_signals_ended(&mut self, slot: u32, index: u32, ended: Vec<(RoomName, CompactString)>) {
        for (room, kind) in ended {
            if !self.user_signals(slot, index, room, &kind) {
                let user_id = self.users[slot as usize].id.clone();
                self.facts.push(RoomFact::Signal { room_id: room, user_id, kind, on: false });
            }
        }
    }

    /// Ends every membership and signal of the lease (it ends, or a new
    /// generation replaces it), telling the room side (R1, R6, S3).
    fn drop_rooms(&mut self, slot: u32, index: u32) {
        let mut rooms = Vec::new();
        self.end_rooms(slot, index, &mut rooms);
        self.report_members(slot, rooms);
    }

    /// [`Shard::drop_rooms`], but for the member facts: the rooms the lease
    /// was in are appended to `rooms`, for the caller to report once every
    /// lease it ends is gone (its signals are reported at once).
    fn end_rooms(&mut self, slot: u32, index: u32, rooms: &mut Vec<RoomName>) {
        if !self.lease(index).has_rooms() {
            return;
        }
        self.end_signals(slot, index, None);
        self.signals.remove(&index);
        self.lease_mut(index).link.set_flag(HAS_ROOMS, false);
        let (mut previous, mut at) = (NIL, self.users[slot as usize].first_membership());
        while at != NIL {
            let next = self.membership(at).next;
            if self.membership(at).lease == index {
                self.unlink_membership(slot, previous, at);
                rooms.push(self.free_membership(at).room);
            } else {
                previous = at;
            }
            at = next;
        }
    }

    /// Tells the room side where the user stands in each of `rooms` now, once per room.
    fn report_members(&mut self, slot: u32, mut rooms: Vec<RoomName>) {
        rooms.sort_unstable();
        rooms.dedup();
        for room in rooms {
            self.report_member(slot, room);
        }
    }

    /// Ends the user's signals whose deadline has passed (S3).
    fn settle_signals(&mut self, slot: u32, now: Tick) {
        let leases: Vec<u32> = self.lease_indices(slot).filter(|&index| self.lease(index).has_rooms()).collect();
        for index in leases {
            let Some(signals) = self.signals.get_mut(&index) else { continue };
            if signals.active.iter().all(|signal| signal.deadline > now) {
                continue;
            }
            let mut ended = Vec::new();
            signals.active.retain(|signal| {
                let ends = signal.deadline <= now;
                if ends {
                    ended.push((signal.room, signal.kind.clone()));
                }
                !ends
            });
            self.report_signals_ended(slot, index, ended);
        }
    }

    /// The deadlines of the user's signals.
    fn signal_deadlines(&self, slot: u32) -> impl Iterator<Item = Tick> + '_ {
        self.lease_indices(slot)
            .filter(|&index| self.lease(index).has_rooms())
            .filter_map(|index| self.signals.get(&index))
            .flat_map(|signals| signals.active.iter().map(|signal| signal.deadline))
    }

    /// The user's status, if it has one.
    fn status(&self, slot: u32) -> Option<&Arc<Status>> {
        if self.users[slot as usize].has_status() { self.statuses.get(&slot) } else { None }
    }

    fn status_deadline(&self, slot: u32) -> Option<Tick> {
        self.status(slot).and_then(|status| status.expires_at)
    }

    fn set_user_status(&mut self, slot: u32, status: Option<Arc<Status>>) {
        self.note_changed(slot);
        let user = &mut self.users[slot as usize];
        user.link.set_flag(HAS_STATUS, status.is_some());
        match status {
            Some(status) => self.statuses.insert(slot, status),
            None => self.statuses.remove(&slot),
        };
    }

    fn view_of(&self, slot: u32) -> UserView {
        UserView { presence: self.users[slot as usize].presence(), status: self.status(slot).cloned() }
    }

    /// Removes the user's leases that `doomed` picks; returns how many, and the
    /// latest deadline among them. The rooms they were in are reported once
    /// all are gone: two sessions of a member ending together are one leave,
    /// not an update to the other one's metadata and then a leave (R2).
    fn remove_leases_where(&mut self, slot: u32, doomed: impl Fn(&Lease) -> bool) -> (usize, Tick) {
        let (mut removed, mut latest_deadline) = (0, 0);
        let mut rooms = Vec::new();
        let mut previous = NIL;
        let mut index = self.users[slot as usize].first_lease();
        while index != NIL {
            let lease = self.lease(index);
            let next = lease.next();
            if doomed(lease) {
                latest_deadline = latest_deadline.max(lease.expires_at);
                self.end_rooms(slot, index, &mut rooms);
                self.unlink(slot, previous, index);
                self.free_lease(slot, index);
                removed += 1;
            } else {
                previous = index;
            }
            index = next;
        }
        self.report_members(slot, rooms);
        (removed, latest_deadline)
    }

    /// Drops the user's leases whose deadline has passed, flipping it OFFLINE
    /// when none is left, and clears its status if that expired: one change
    /// (one version) for whatever of the two happened.
    fn settle(&mut self, slot: u32, now: Tick, changes: &mut Changes) {
        let first = self.users[slot as usize].first_lease();
        let damped = first != NIL && self.lease(first).is_grace_hold();
        let (removed, last_deadline) = self.remove_leases_where(slot, |lease| lease.expires_at <= now);
        self.settle_signals(slot, now);
        let status_expired = self.status_deadline(slot).is_some_and(|deadline| deadline <= now);
        if status_expired {
            self.set_user_status(slot, None);
        }
        let user = &self.users[slot as usize];
        let goes_offline = removed > 0 && user.first_lease() == NIL && user.online();
        // Only when something ran out: an idle user's timer is its forget
        // entry, which a mere read must leave alone.
        if (removed > 0 || status_expired) && user.first_lease() == NIL && self.status_deadline(slot).is_none() {
            self.cancel_timer(slot);
        }
        // The window starts when the last lease ended, at its deadline, so a
        // user settled late (nobody touched it, the driver lagged) goes
        // OFFLINE exactly when it would have on time (E6).
        let grace_end = if damped { last_deadline } else { last_deadline + self.offline_grace_ms };
        if goes_offline && !(grace_end > last_deadline && self.hold_for_grace(slot, grace_end)) {
            self.flip(slot, State::Offline, now, Some(grace_end), changes);
            return;
        }
        if status_expired {
            self.announce(slot, now, changes);
            self.arm_forget(slot, now);
        }
        // A session gone, or the window after the last activity over (only a
        // user shown ACTIVE has one, so a renewal of any other costs nothing
        // here). A user held by damping keeps what it showed until it flips.
        let user = &self.users[slot as usize];
        if (removed > 0 || user.rooms.flag(SHOWN_ACTIVE)) && user.online() && !self.held_for_grace_only(slot) {
            self.refresh_activity(slot, now, changes);
        }
    }

    /// Whether the user's only lease is a grace hold (E6).
    fn held_for_grace_only(&self, slot: u32) -> bool {
        let first = self.users[slot as usize].first_lease();
        first != NIL && self.lease(first).is_grace_hold() && self.lease(first).next() == NIL
    }

    /// After leases were deleted by a request: flips the user OFFLINE if none is
    /// left. Returns whether it flipped.
    /// Ends a user's restart hold once a gateway has closed (unregistered,
    /// revoked, or set lingering) every session the user has: the hold is
    /// there to keep a user online while its gateways reconnect after a
    /// restart, not to outlive an explicit close (M2).
    fn end_hold_once_every_session_closed(&mut self, slot: u32) {
        let open = self.lease_indices(slot).any(|index| {
            let lease = self.lease(index);
            !lease.is_restart_hold() && !lease.closing()
        });
        if !open {
            self.remove_leases_where(slot, Lease::is_restart_hold);
        }
    }

    /// Flap damping (E6): if the user is ONLINE with no lease left and `until`
    /// is still ahead, holds it ONLINE until then with a [`Lease::grace_hold`]
    /// instead of flipping it, and says so; publishes nothing either way.
    fn hold_for_grace(&mut self, slot: u32, until: Tick) -> bool {
        let user = &self.users[slot as usize];
        if self.offline_grace_ms == 0 || !user.online() || user.first_lease() != NIL || until <= self.now {
            return false;
        }
        let origin = self.origins.acquire(RESTART_HOLD_SESSION_ID, before_expiry(self.now, until));
        self.push_lease(slot, Lease::grace_hold(origin, until));
        true
    }

    fn after_removal(&mut self, slot: u32, now: Tick, changes: &mut Changes) -> bool {
        if self.users[slot as usize].first_lease() != NIL {
            if !self.held_for_grace_only(slot) {
                self.refresh_activity(slot, now, changes);
            }
            return false;
        }
        if self.status_deadline(slot).is_none() {
            self.cancel_timer(slot);
        }
        let flips = self.users[slot as usize].online();
        if flips {
            self.flip(slot, State::Offline, now, None, changes);
        }
        flips
    }

    fn flip(&mut self, slot: u32, state: State, now: Tick, deadline: Option<Tick>, changes: &mut Changes) {
        let user = &mut self.users[slot as usize];
        debug_assert_ne!(user.online(), state == State::Online, "a flip changes the state");
        user.link.set_flag(ONLINE, state == State::Online);
        user.set_activity(None);
        match state {
            State::Online => self.online += 1,
            State::Offline => self.online -= 1,
        }
        // The flip shows the availability the sessions make (A2) with it: one change, one version.
        let (activity, until) = self.derived_activity(slot, now);
        self.users[slot as usize].set_activity(activity);
        if let Some(until) = until {
            self.schedule_no_later_than(slot, until);
        }
        self.publish_change(slot, ChangeKind::Flip, now, deadline, changes);
        if state == State::Offline {
            self.arm_forget(slot, now);
        }
    }

    /// Publishes a change of the user that is not a flip (its status): a new version, the same state.
    fn announce(&mut self, slot: u32, now: Tick, changes: &mut Changes) {
        self.publish_change(slot, ChangeKind::Status, now, None, changes);
    }

    /// Gives the user a new version and appends what viewers now see of it.
    fn publish_change(
        &mut self,
        slot: u32,
        kind: ChangeKind,
        now: Tick,
        deadline: Option<Tick>,
        changes: &mut Changes,
    ) {
        self.bump(slot, now);
        let user = &self.users[slot as usize];
        changes.push(PresenceChange {
            user_id: user.id.clone(),
            kind,
            presence: user.presence(),
            status: self.status(slot).cloned(),
            at: now,
            deadline,
        });
    }

    fn bump(&mut self, slot: u32, now: Tick) -> u64 {
        self.note_changed(slot);
        let version = self.stamps.next(now);
        self.users[slot as usize].version = version;
        version
    }

    /// Makes sure the user's timer fires at or before `deadline`.
    fn schedule_no_later_than(&mut self, slot: u32, deadline: Tick) {
        // A deadline the wheel has already passed (a caller whose clock read lagged
        // the driver's) fires on the next tick instead.
        let deadline = deadline.max(self.wheel.elapsed() + 1);
        if let Some(current) = self.wheel.deadline(slot) {
            if current <= deadline {
                return;
            }
            self.wheel.remove(slot);
        }
        self.wheel.insert(slot, deadline).unwrap_or_else(|_| unreachable!("deadline is after elapsed"));
        self.earliest_new_timer = Some(self.earliest_new_timer.map_or(deadline, |earliest| earliest.min(deadline)));
    }

    /// Offline, with no lease (a restart hold is one) and no status: nothing
    /// the user would lose by being forgotten but its version, which the
    /// stamp clock makes unnecessary (M4).
    fn is_idle(&self, slot: u32) -> bool {
        let user = &self.users[slot as usize];
        !user.online() && user.first_lease() == NIL && !user.has_status()
    }

    /// If the user is idle, replaces its timer with its forget entry, a whole
    /// window from `now`. Called at every change that may leave a user idle,
    /// so that an idle user's entry always dates from its last change.
    fn arm_forget(&mut self, slot: u32, now: Tick) {
        if self.forget_offline_after_ms == 0 || !self.is_idle(slot) {
            return;
        }
        self.cancel_timer(slot);
        self.schedule_no_later_than(slot, now.saturating_add(self.forget_offline_after_ms));
    }

    /// Removes an idle user from the shard: its index entry and its record,
    /// whose slot the last user takes (the vector stays dense). Its wheel
    /// entry has just fired, and it has no lease and no status. Returns
    /// false when it must wait for a checkpoint part-way through the shard:
    /// a retry is then scheduled.
    fn forget(&mut self, slot: u32, now: Tick) -> bool {
        debug_assert!(self.is_idle(slot) && self.wheel.deadline(slot).is_none());
        // A follower forgets it too (absent, it reads as never seen).
        self.note_changed(slot);
        let last = self.users.len() - 1;
        if let Some(cursor) = self.checkpoint_cursor
            && (slot as usize) < cursor
            && last >= cursor
        {
            // The last user, not yet written, would land where the checkpoint
            // has been already and be left out of it. Try again later.
            self.schedule_no_later_than(slot, now + FORGET_RETRY_MS);
            return false;
        }
        let hash = self.hash(&self.users[slot as usize].id);
        self.index.remove(hash, slot);
        self.users.swap_remove(slot as usize);
        if let Some(moved) = self.users.get(slot as usize) {
            let hash = self.hash(&moved.id);
            self.index.relocate(hash, last as u32, slot);
            self.wheel.relocate(last as u32, slot);
            if moved.has_status() {
                let status = self.statuses.remove(&(last as u32)).expect("a user with a status has an entry");
                self.statuses.insert(slot, status);
            }
        }
        self.wheel.truncate(self.users.len());
        if mostly_empty(self.users.len(), self.users.capacity()) {
            self.users.shrink_to(self.users.len() * 2);
        }
        if mostly_empty(self.users.len(), self.wheel.capacity()) {
            self.wheel.shrink_to(self.users.len() * 2);
        }
        self.forgotten_since_tidy += 1;
        self.forgotten += 1;
        true
    }

    /// Shrinks every container to what it holds and an eighth more. Called when
    /// an expiry pass is over (nothing more is due) and at least a quarter as
    /// many users as are left were forgotten since the last tidy: the shrinking
    /// during a wave of forgetting stops at a quarter to half used, which
    /// would keep two to four times the memory the users left need, and the
    /// forgotten users pay for the copy (O(1) each, amortised). Registers and
    /// unregisters never tidy, so a user coming and going cannot make it thrash.
    fn tidy(&mut self) {
        self.forgotten_since_tidy = 0;
        self.users.shrink_to(tidy_size(self.users.len()));
        self.index.shrink_to_fit();
        self.wheel.shrink_to(tidy_size(self.users.len()));
        if self.leases.len() > tidy_size(self.sessions) {
            self.compact_leases();
        }
        self.free_leases.shrink_to_fit();
        self.metadata.shrink_to_fit();
        self.statuses.shrink_to_fit();
    }

    /// Gives back the memory of the lease slab when it is mostly empty (the
    /// wheel's, keyed by user slot, shrinks with the users in
    /// [`Shard::forget`]). Each pass is O(size), but only after the size fell
    /// to a quarter, and it leaves the slab half used, so it costs O(1) per
    /// removal amortised.
    fn shrink_if_mostly_empty(&mut self) {
        if mostly_empty(self.sessions, self.leases.len()) {
            self.compact_leases();
        }
    }

    /// Moves every lease to the front of a new slab, user by user, and frees
    /// the old one. Leases do not know their user, so the lists are walked
    /// from the users.
    fn compact_leases(&mut self) {
        let mut old = std::mem::replace(&mut self.leases, Vec::with_capacity(tidy_size(self.sessions)));
        let mut old_metadata = std::mem::take(&mut self.metadata);
        let mut old_signals = std::mem::take(&mut self.signals);
        // The leases in rooms of the user being moved, by old and new index.
        let mut moved = Vec::new();
        for user in &mut self.users {
            let mut index = user.first_lease();
            let mut previous = NIL;
            while index != NIL {
                let lease = old[index as usize].take().expect("a listed lease is occupied");
                let next = lease.next();
                let new_index = u32::try_from(self.leases.len()).expect("fewer leases than before");
                if lease.has_metadata()
                    && let Some(entries) = old_metadata.remove(&index)
                {
                    self.metadata.insert(new_index, entries);
                }
                if lease.has_rooms() {
                    moved.push((index, new_index));
                    if let Some(signals) = old_signals.remove(&index) {
                        self.signals.insert(new_index, signals);
                    }
                }
                self.leases.push(Some(lease));
                match previous {
                    NIL => user.link.set_index(new_index),
                    previous => self.leases[previous as usize].as_mut().expect("just pushed").link.set_index(new_index),
                }
                previous = new_index;
                index = next;
            }
            let mut at = user.first_membership();
            while at != NIL {
                let membership = &mut self.memberships[at as usize];
                let &(_, new_index) =
                    moved.iter().find(|&&(old, _)| old == membership.lease).expect("a lease in rooms");
                membership.lease = new_index;
                at = membership.next;
            }
            moved.clear();
        }
        debug_assert_eq!(self.leases.len(), self.sessions, "every lease is on its user's list");
        self.free_leases = Vec::new();
    }

    fn cancel_timer(&mut self, slot: u32) {
        self.wheel.remove(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: Tick = 1_700_000_000_000;
    const FORGET_AFTER: u64 = 10_000;

    fn shard_config() -> StoreConfig {
        StoreConfig { min_renew_interval_ms: 0, forget_offline_after_ms: FORGET_AFTER, ..StoreConfig::default() }
    }

    fn registration(user_id: &str) -> Registration<'_> {
        Registration { user_id, session_id: "s", gateway_id: "gw", ttl_ms: 1_000, metadata: &[] }
    }

    /// Registers each of `ids` with one session of 1 s; returns their generations.
    fn register_many(shard: &mut Shard, now: Tick, ids: impl Iterator<Item = String>) -> Vec<(String, u64)> {
        let mut changes = Vec::new();
        ids.map(|id| {
            let generation =
                shard.register(now, &registration(&id), &AttentionChange::default(), 1_000, &mut changes).generation;
            (id, generation)
        })
        .collect()
    }

    fn expire_all(shard: &mut Shard, now: Tick) {
        let mut changes = Vec::new();
        while shard.expire(now, 64, None, &mut changes) {}
    }

    /// B6: once most users are forgotten, the records, the index, the wheel
    /// and the lease slab are small again, and what is left still works.
    #[test]
    fn b6_containers_shrink_when_most_users_are_forgotten() {
        let mut shard = Shard::new(T0, &shard_config());
        let mut changes = Vec::new();
        let kept = register_many(&mut shard, T0, (0..100).map(|i| format!("kept-{i}")));
        let passing = register_many(&mut shard, T0, (0..20_000).map(|i| format!("passing-{i}")));
        let (users, index, wheel, leases) =
            (shard.users.capacity(), shard.index.capacity(), shard.wheel.capacity(), shard.leases.len());
        for (id, generation) in &passing {
            shard.unregister(T0 + 1, id, "s", *generation, 0, &mut changes);
        }
        // The kept users renew; the others have been offline for the window.
        let mut now = T0 + 1;
        while now < T0 + 1 + FORGET_AFTER {
            now += 500;
            for (id, generation) in &kept {
                let renewal = Renewal { user_id: id, session_id: "s", generation: *generation, ttl_ms: 1_000 };
                shard.renew(now, &renewal, &mut changes).unwrap();
            }
            expire_all(&mut shard, now);
        }
        assert_eq!(shard.users(), 100);
        assert_eq!(shard.online_users(), 100);
        assert!(shard.users.capacity() * 16 < users, "records: {} of {users}", shard.users.capacity());
        assert!(shard.index.capacity() * 16 < index, "index: {} of {index}", shard.index.capacity());
        assert!(shard.wheel.capacity() * 16 < wheel, "wheel: {} of {wheel}", shard.wheel.capacity());
        assert!(shard.leases.len() * 16 < leases, "leases: {} of {leases}", shard.leases.len());
        // Tidied once the wave was over: what is held and an eighth more, not
        // the quarter-to-half use the shrinking during the wave stops at.
        assert!(shard.users.capacity() <= tidy_size(100), "records: {}", shard.users.capacity());
        assert_eq!(shard.index.capacity(), 134, "the smallest table at most three quarters full");
        assert!(shard.wheel.capacity() <= tidy_size(100), "wheel: {}", shard.wheel.capacity());
        assert!(shard.leases.len() <= tidy_size(100), "leases: {}", shard.leases.len());
        // The users left were moved around and are all still found, with their leases.
        for (id, generation) in &kept {
            let renewal = Renewal { user_id: id, session_id: "s", generation: *generation, ttl_ms: 1_000 };
            assert!(shard.renew(now + 1, &renewal, &mut changes).is_ok(), "{id}");
        }
        assert!(shard.presence(now + 1, "passing-7", &mut changes) == Presence::UNKNOWN);
        // And their timers moved with them: they go OFFLINE on time, once each.
        let mut offline = Vec::new();
        while shard.expire(now + 1_001, 64, None, &mut offline) {}
        assert_eq!(offline.len(), 100);
        assert_eq!(shard.online_users(), 0);
    }

    /// B3 with B6: users forgotten while a checkpoint is part-way through a
    /// shard do not make it miss, or repeat, a user that is not forgotten.
    #[test]
    fn b6_forgetting_during_a_checkpoint_never_drops_an_unwritten_user() {
        let mut shard = Shard::new(T0, &shard_config());
        let mut changes = Vec::new();
        // The first 300 users go offline at once; the last 300 are online when
        // the first ones' window ends.
        let leaving = register_many(&mut shard, T0, (0..300).map(|i| format!("leaving-{i}")));
        for (id, generation) in &leaving {
            shard.unregister(T0 + 1, id, "s", *generation, 0, &mut changes);
        }
        let now = T0 + 1 + FORGET_AFTER;
        register_many(&mut shard, now - 1, (0..300).map(|i| format!("staying-{i}")));
        let mut writer = CheckpointWriter::new(now);
        let mut bytes = Vec::new();
        let mut from = 0;
        // One slice written, then the forget deadline of the leaving users passes, then the rest.
        let names = RoomNames::new(1);
        from = shard.checkpoint(&mut writer, from, 100, None, &names).unwrap();
        expire_all(&mut shard, now);
        while let Some(next) = shard.checkpoint(&mut writer, from, 100, None, &names) {
            from = next;
            expire_all(&mut shard, now);
        }
        bytes.extend(writer.take_chunk());
        bytes.extend(writer.finish());
        let checkpoint = crate::checkpoint::decode(&bytes).unwrap();
        let mut online: Vec<&str> =
            checkpoint.users.iter().filter(|user| user.online).map(|user| user.user_id.as_str()).collect();
        online.sort_unstable();
        let before = online.len();
        online.dedup();
        assert_eq!(online.len(), before, "no online user written twice");
        assert_eq!(online.len(), 300, "every online user written");
        // Forgetting caught up once the checkpoint was done.
        expire_all(&mut shard, now + FORGET_RETRY_MS);
        assert_eq!(shard.users(), 300);
    }

    /// A lease's gateway and last write live in the shard's origins: what a
    /// lease reports of them follows every write, and once the leases are gone
    /// no origin or gateway id is left behind.
    #[test]
    fn a_leases_origin_follows_its_writes_and_goes_with_it() {
        let mut shard = Shard::new(T0, &shard_config());
        let mut changes = Vec::new();
        let registration = |session_id, gateway_id| Registration {
            user_id: "u",
            session_id,
            gateway_id,
            ttl_ms: 45_000,
            metadata: &[],
        };
        let a = shard
            .register(T0, &registration("a", "gw-1"), &AttentionChange::default(), 45_000, &mut changes)
            .generation;
        let b = shard
            .register(T0, &registration("b", "gw-1"), &AttentionChange::default(), 45_000, &mut changes)
            .generation;
        assert_eq!(shard.origins.len(), (1, 1), "two leases of one gateway at one TTL share one origin");
        // Renewed at another TTL, then lingering: each write is reported exactly.
        let renewal = Renewal { user_id: "u", session_id: "a", generation: a, ttl_ms: 20_000 };
        shard.renew(T0 + 100, &renewal, &mut changes).unwrap();
        shard.unregister(T0 + 200, "u", "b", b, 7_000, &mut changes);
        let views = shard.leases(T0 + 300, "u", &mut changes);
        let times: Vec<_> =
            views.iter().map(|view| (view.session_id.as_str(), view.last_heartbeat_at, view.expires_at)).collect();
        assert_eq!(times, [("b", T0, T0 + 7_200), ("a", T0 + 100, T0 + 20_100)]);
        assert!(views.iter().all(|view| view.gateway_id == "gw-1"));
        assert_eq!(shard.origins.len(), (1, 2), "the lingering lease has its own origin, the same gateway");
        // A reconnect through another gateway takes the lease to that gateway's origin.
        shard.register(T0 + 400, &registration("a", "gw-2"), &AttentionChange::default(), 30_000, &mut changes);
        let views = shard.leases(T0 + 400, "u", &mut changes);
        assert_eq!((views[1].gateway_id.as_str(), views[1].last_heartbeat_at), ("gw-2", T0 + 400));
        shard.revoke(T0 + 500, "u", None, &mut changes);
        assert_eq!(shard.origins.len(), (0, 0));
    }

    /// B6 with S1: a user's status is kept by slot, and moves with the user
    /// when a forgotten user's slot is given to it.
    #[test]
    fn b6_a_status_moves_with_its_user_when_the_user_fills_a_forgotten_slot() {
        let mut shard = Shard::new(T0, &shard_config());
        let mut changes = Vec::new();
        let leaving = register_many(&mut shard, T0, (0..3).map(|i| format!("leaving-{i}")));
        let status = Status { availability: crate::Availability::Away, text: "lunch".into(), expires_at: None };
        shard.set_status(T0, "kept", Some(status.clone()), &mut changes);
        for (id, generation) in &leaving {
            shard.unregister(T0 + 1, id, "s", *generation, 0, &mut changes);
        }
        expire_all(&mut shard, T0 + 1 + FORGET_AFTER);
        assert_eq!(shard.users(), 1, "the leaving users were forgotten, the last user took a freed slot");
        let view = shard.view(T0 + 2 + FORGET_AFTER, "kept", &mut changes);
        assert_eq!(view.status.as_deref(), Some(&status));
        assert_eq!(shard.statuses.len(), 1);
    }

    /// Compacting the lease slab renumbers leases: the memberships of the
    /// leases left follow them (they name their lease by slab index).
    #[test]
    fn memberships_follow_their_leases_when_the_slab_is_compacted() {
        let mut shard = Shard::new(T0, &shard_config());
        let mut changes = Vec::new();
        let passing = register_many(&mut shard, T0, (0..1_000).map(|i| format!("passing-{i}")));
        let kept = register_many(&mut shard, T0, (0..10).map(|i| format!("kept-{i}")));
        let names = RoomNames::new(1);
        let at = |user_id, generation, room_id| RoomRef { user_id, session_id: "s", generation, room_id };
        for (id, generation) in passing.iter().chain(&kept) {
            for room_id in ["r1", "r2"] {
                shard.join(T0, &at(id, *generation, room_id), names.acquire(room_id), &[], &mut changes).unwrap();
            }
        }
        let rooms_of =
            |shard: &Shard, id| -> Vec<_> { shard.rooms_of(id).into_iter().map(|name| names.id(name)).collect() };
        for (id, generation) in &passing {
            shard.unregister(T0 + 1, id, "s", *generation, 0, &mut changes);
        }
        let slab = shard.leases.len();
        expire_all(&mut shard, T0 + 2);
        assert!(shard.leases.len() * 4 < slab, "compacted: {} of {slab}", shard.leases.len());
        for (id, generation) in &kept {
            let mut rooms = rooms_of(&shard, id);
            rooms.sort_unstable();
            assert_eq!(rooms, ["r1", "r2"]);
            let r2 = names.find("r2");
            assert_eq!(shard.leave(T0 + 3, &at(id, *generation, "r2"), r2, &mut changes).unwrap(), (true, true));
            assert_eq!(rooms_of(&shard, id), ["r1"]);
        }
    }

    /// The per-session memory budget rests on these sizes; a field added
    /// carelessly shows up here first.
    #[test]
    fn records_stay_small() {
        assert_eq!(std::mem::size_of::<Option<Lease>>(), 48);
        assert_eq!(std::mem::size_of::<User>(), 40);
        assert_eq!(std::mem::size_of::<Membership>(), 24);
    }
}
