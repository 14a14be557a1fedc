//! The sharded lease store: the only place where shards meet their locks.
//!
//! Users map to shards by a fixed hash of the user id, so every transition of
//! one user happens under one shard lock and is atomic with the recomputation
//! of its derived state (E1: two gateways or an expiry racing on one user
//! cannot both publish the same flip). Locks are held for the operation only:
//! never across an `.await`, never while waking anyone.

use std::hash::BuildHasher;
use std::sync::Arc;

use compact_str::CompactString;

use crate::attention::{
    AttentionChange, MAX_NOTIFY_USERS, NotifyDecision, NotifyPolicy, Urgency, notify_target, room_hash,
};
use crate::checkpoint::{self, Checkpoint, CheckpointError, CheckpointWriter, UserRecord};
use crate::config::{ConfigError, StoreConfig};
use crate::error::LeaseError;
use crate::feed::FeedIntake;
use crate::room_intake::{RoomFactScan, ScanTakenFor, StampedRoomFact};
use crate::room_names::{RoomName, RoomNames};
use crate::rooms::RoomShard;
use crate::shard::{LeaseView, SessionView, Shard};
use crate::slots::SlotSet;
use crate::sync::{AtomicBool, AtomicU64, Mutex, Ordering};
use crate::types::{
    Changes, Erased, Imported, Joined, Left, Presence, PresenceChange, Registered, Registration, Renewal, Renewed,
    Replaced, Revoked, RoomAccess, RoomChange, RoomRef, RoomView, Signalled, Status, StoreStats, Unregistered,
    UserView,
};
use crate::validate;
use crate::wheel::Tick;

/// Users a checkpoint encodes per shard-lock hold: a few hundred microseconds of work.
pub(crate) const CHECKPOINT_USERS_PER_LOCK: usize = 1_024;

/// Called when an operation schedules a deadline earlier than the one the expiry
/// driver is sleeping towards.
type ExpiryWaker = Box<dyn Fn() + Send + Sync>;

/// The lease store. Every method takes `now`, the store time in milliseconds
/// (the server passes Unix milliseconds from a monotonic clock; tests pass
/// whatever they simulate), and puts the flips it causes in `changes` for the
/// caller to publish.
pub struct Store {
    config: StoreConfig,
    /// Lock order: one shard at a time; no method holds two shard locks. A
    /// user shard's lock may be held while one room shard's, or one part of
    /// `names`, is taken, never the reverse nor both at once.
    shards: Box<[Mutex<Shard>]>,
    /// The rooms, by a hash of the room id (see `rooms.rs`): fed facts by the
    /// user shards, under the user shard's lock, one room shard at a time.
    rooms: Box<[Mutex<RoomShard>]>,
    /// The ids of the rooms the user shards' sessions are in, which they hold
    /// as 4-byte names (see `room_names.rs`); its locks come after a user
    /// shard's, never with a room shard's.
    names: RoomNames,
    /// The time the expiry driver will next wake at (`u64::MAX`: wake on any new timer).
    alarm: AtomicU64,
    waker: Option<ExpiryWaker>,
    /// Users forgotten since the start (B6), summed as [`Store::expire`] forgets
    /// them, so that reading it takes no shard lock.
    forgotten: AtomicU64,
    /// The cluster slots being handed over, whose users' timers wait (C3).
    expiry_paused: Mutex<Option<Arc<SlotSet>>>,
    /// Whether the user shards' room facts leave the store (a cluster node,
    /// where the rooms' owners take them in) rather than feed its room shards.
    room_facts_out: AtomicBool,
    /// Where the changes the change feed carries are recorded, under the
    /// lock that made them (see `feed.rs`); none without a feed.
    feed: Option<Arc<FeedIntake>>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store").field("config", &self.config).field("stats", &self.stats()).finish_non_exhaustive()
    }
}

impl Store {
    /// A store with no leases whose clock starts at `now`.
    pub fn new(config: StoreConfig, now: Tick) -> Result<Self, ConfigError> {
        config.validate()?;
        let shards = (0..config.shards).map(|_| Mutex::new(Shard::new(now, &config))).collect();
        let rooms = (0..config.shards).map(|_| Mutex::new(RoomShard::new(now))).collect();
        Ok(Store {
            names: RoomNames::new(config.shards),
            config,
            shards,
            rooms,
            alarm: AtomicU64::new(u64::MAX),
            expiry_paused: Mutex::new(None),
            waker: None,
            forgotten: AtomicU64::new(0),
            room_facts_out: AtomicBool::new(false),
            feed: None,
        })
    }

    /// Records every flip, status change and room occupancy change in
    /// `intake`, for the change feed (F1).
    pub fn with_feed(mut self, intake: Arc<FeedIntake>) -> Self {
        self.feed = Some(intake);
        self
    }

    /// Sets the function that wakes the expiry driver (see [`Store::set_alarm`]).
    pub fn with_expiry_waker(mut self, waker: impl Fn() + Send + Sync + 'static) -> Self {
        self.waker = Some(Box::new(waker));
        self
    }

    /// The configuration the store runs with.
    pub fn config(&self) -> &StoreConfig {
        &self.config
    }

    /// Creates or replaces a session's lease (L1).
    pub fn register(
        &self,
        now: Tick,
        registration: &Registration<'_>,
        changes: &mut Changes,
    ) -> Result<Registered, LeaseError> {
        self.register_attending(now, registration, &AttentionChange::default(), changes)
    }

    /// [`Store::register`], with what the session's gateway says of its
    /// human's attention (A1): kept with the new lease, and the availability
    /// it makes shown with the register's own change (A2).
    pub fn register_attending(
        &self,
        now: Tick,
        registration: &Registration<'_>,
        attention: &AttentionChange<'_>,
        changes: &mut Changes,
    ) -> Result<Registered, LeaseError> {
        validate::id("user_id", registration.user_id)?;
        validate::id("session_id", registration.session_id)?;
        validate::id("gateway_id", registration.gateway_id)?;
        let ttl_ms = validate::ttl(&self.config, registration.ttl_ms)?;
        validate::metadata(registration.metadata)?;
        validate_attention(attention)?;
        Ok(self.with_shard(registration.user_id, changes, |shard, changes| {
            shard.register(now, registration, attention, ttl_ms, changes)
        }))
    }

    /// Whether `user_id` shares its availability with viewers (A2); every
    /// user does until told otherwise. The node tells the store from the
    /// user's privacy settings, at its start and at each change; a change
    /// shows at once.
    pub fn set_shares_activity(
        &self,
        now: Tick,
        user_id: &str,
        shares: bool,
        changes: &mut Changes,
    ) -> Result<(), LeaseError> {
        validate::id("user_id", user_id)?;
        self.with_shard(user_id, changes, |shard, changes| shard.set_shares_activity(now, user_id, shares, changes));
        Ok(())
    }

    /// Extends a live lease held at the current generation (L2), or, within the
    /// minimum renewal interval of the previous write, acknowledges it without
    /// a write (L7).
    pub fn renew(
        &self,
        now: Tick,
        user_id: &str,
        session_id: &str,
        generation: u64,
        ttl_ms: u32,
        changes: &mut Changes,
    ) -> Result<Renewed, LeaseError> {
        let renewal = self.validate_renewal(&Renewal { user_id, session_id, generation, ttl_ms })?;
        self.with_shard(user_id, changes, |shard, changes| shard.renew(now, &renewal, changes))
    }

    /// Applies many renewals at one `now` and answers each as [`Store::renew`]
    /// would, in the order given.
    ///
    /// The renewals of one user apply in the order given; those of different
    /// users share nothing, so the order between them is not observable, and
    /// they are applied shard by shard: each shard's lock is taken once, and
    /// the memory loads of a shard's renewals are started together rather than
    /// one renewal after another (the cost of a renewal in a large store is
    /// mostly waiting for memory).
    pub fn renew_batch(
        &self,
        now: Tick,
        renewals: &[Renewal<'_>],
        changes: &mut Changes,
    ) -> Vec<Result<Renewed, LeaseError>> {
        let mut answers: Vec<Option<Result<Renewed, LeaseError>>> = Vec::with_capacity(renewals.len());
        // The renewals with their TTLs resolved; a refused one keeps its place
        // (and is never picked), so that positions here are positions in `renewals`.
        let mut checked = Vec::with_capacity(renewals.len());
        // Each valid renewal's shard, then the renewals grouped by shard with
        // their order kept (a counting sort).
        let mut shard_of = Vec::with_capacity(renewals.len());
        let mut per_shard = vec![0u32; self.shards.len() + 1];
        for renewal in renewals {
            match self.validate_renewal(renewal) {
                Ok(resolved) => {
                    let shard = self.shard_of(renewal.user_id);
                    per_shard[shard + 1] += 1;
                    shard_of.push(shard as u32);
                    answers.push(None);
                    checked.push(resolved);
                }
                Err(refusal) => {
                    shard_of.push(u32::MAX);
                    answers.push(Some(Err(refusal)));
                    checked.push(*renewal);
                }
            }
        }
        for shard in 1..per_shard.len() {
            per_shard[shard] += per_shard[shard - 1];
        }
        let mut next = per_shard.clone();
        let mut picks = vec![0u32; per_shard[self.shards.len()] as usize];
        for (index, &shard) in shard_of.iter().enumerate().filter(|&(_, &shard)| shard != u32::MAX) {
            picks[next[shard as usize] as usize] = index as u32;
            next[shard as usize] += 1;
        }
        for shard in 0..self.shards.len() {
            let picked = &picks[per_shard[shard] as usize..per_shard[shard + 1] as usize];
            if !picked.is_empty() {
                self.with_shard_at(shard, changes, |locked, changes| {
                    locked.renew_picked(now, &checked, picked, &mut answers, changes)
                });
            }
        }
        answers.into_iter().map(|answer| answer.expect("every renewal is answered")).collect()
    }

    /// The renewal with its TTL resolved (0: the default), or why it is refused.
    fn validate_renewal<'a>(&self, renewal: &Renewal<'a>) -> Result<Renewal<'a>, LeaseError> {
        validate::id("user_id", renewal.user_id)?;
        validate::id("session_id", renewal.session_id)?;
        let ttl_ms = validate::ttl(&self.config, renewal.ttl_ms)?;
        Ok(Renewal { ttl_ms, ..*renewal })
    }

    /// Deletes (or, with `linger_ms > 0`, shortens) a lease if `generation` is current (L3).
    pub fn unregister(
        &self,
        now: Tick,
        user_id: &str,
        session_id: &str,
        generation: u64,
        linger_ms: u32,
        changes: &mut Changes,
    ) -> Result<Unregistered, LeaseError> {
        validate::id("user_id", user_id)?;
        validate::id("session_id", session_id)?;
        Ok(self.with_shard(user_id, changes, |shard, changes| {
            shard.unregister(now, user_id, session_id, generation, linger_ms, changes)
        }))
    }

    /// Deletes one session's lease, or all of the user's with `session_id: None` (L6).
    pub fn revoke(
        &self,
        now: Tick,
        user_id: &str,
        session_id: Option<&str>,
        changes: &mut Changes,
    ) -> Result<Revoked, LeaseError> {
        validate::id("user_id", user_id)?;
        if let Some(session_id) = session_id {
            validate::id("session_id", session_id)?;
        }
        Ok(self.with_shard(user_id, changes, |shard, changes| shard.revoke(now, user_id, session_id, changes)))
    }

    /// Ends everything the store holds of a user but its record (P7): every
    /// lease (restart and grace holds too) with its room memberships, and its
    /// status, publishing the OFFLINE flip and the room leaves a Revoke
    /// publishes (or, for a user already OFFLINE, its status cleared). The
    /// user is left idle, with its version; [`Store::forget_idle`] forgets it.
    pub fn erase(&self, now: Tick, user_id: &str, changes: &mut Changes) -> Result<Erased, LeaseError> {
        validate::id("user_id", user_id)?;
        Ok(self.with_shard(user_id, changes, |shard, changes| shard.erase(now, user_id, changes)))
    }

    /// Forgets a user now if it is idle (offline, no lease, no status),
    /// publishing nothing, as the forget window would (B6): from then on it
    /// is answered as a user never seen, and if it comes back its versions
    /// are above any it had (M4). Returns whether it was held and idle. While
    /// a checkpoint is part-way through the user's shard, the forget happens
    /// once it is past, within a second.
    pub fn forget_idle(&self, now: Tick, user_id: &str) -> Result<bool, LeaseError> {
        validate::id("user_id", user_id)?;
        Ok(self.with_shard(user_id, &mut Changes::default(), |shard, _| shard.forget_idle(now, user_id)))
    }

    /// The presence of each user, in order; O(k) in the number of users (E2).
    /// Unknown users are OFFLINE at version 0.
    pub fn snapshot<S: AsRef<str>>(
        &self,
        now: Tick,
        user_ids: &[S],
        changes: &mut Changes,
    ) -> Result<Vec<Presence>, LeaseError> {
        validate::user_ids(user_ids)?;
        Ok(user_ids
            .iter()
            .map(|user_id| {
                let user_id = user_id.as_ref();
                self.with_shard(user_id, changes, |shard, changes| shard.presence(now, user_id, changes))
            })
            .collect())
    }

    /// The presence and status of each user, in order; O(k) (E2). Unknown
    /// users are OFFLINE at version 0, with no status.
    pub fn view<S: AsRef<str>>(
        &self,
        now: Tick,
        user_ids: &[S],
        changes: &mut Changes,
    ) -> Result<Vec<UserView>, LeaseError> {
        validate::user_ids(user_ids)?;
        Ok(user_ids
            .iter()
            .map(|user_id| {
                let user_id = user_id.as_ref();
                self.with_shard(user_id, changes, |shard, changes| shard.view(now, user_id, changes))
            })
            .collect())
    }

    /// Sets or clears a user's status (S1): a change with a new version, which
    /// the caller publishes; a status with an expiry clears itself through the wheel.
    pub fn set_status(
        &self,
        now: Tick,
        user_id: &str,
        status: Option<Status>,
        changes: &mut Changes,
    ) -> Result<UserView, LeaseError> {
        validate::id("user_id", user_id)?;
        if let Some(status) = &status {
            validate::status_text(&status.text)?;
            if status.expires_at.is_some_and(|at| at <= now) {
                return Err(LeaseError::invalid("expires_at_ms", "must be in the future"));
            }
        }
        Ok(self.with_shard(user_id, changes, |shard, changes| shard.set_status(now, user_id, status, changes)))
    }

    /// Puts back a status kept elsewhere, after a restart: no change, no new version.
    pub fn restore_status(&self, now: Tick, user_id: &str, status: Status) -> Result<(), LeaseError> {
        validate::id("user_id", user_id)?;
        self.with_shard(user_id, &mut Changes::default(), |shard, _| shard.restore_status(now, user_id, status));
        Ok(())
    }

    /// A new version for the user, publishing nothing: for a change made outside
    /// the store that some viewers see (a change of its audience).
    pub fn bump_version(&self, now: Tick, user_id: &str, changes: &mut Changes) -> Result<UserView, LeaseError> {
        validate::id("user_id", user_id)?;
        Ok(self.with_shard(user_id, changes, |shard, changes| shard.bump_version(now, user_id, changes)))
    }

    /// A new version for the user, publishing nothing, as [`Store::bump_version`]
    /// gives one; a user the store does not hold (forgotten, erased) gets a
    /// version above every one issued and is not taken in: what a node
    /// relaying the user asks for when a viewer's view of it changed after
    /// the user went.
    pub fn bump_version_if_held(
        &self,
        now: Tick,
        user_id: &str,
        changes: &mut Changes,
    ) -> Result<UserView, LeaseError> {
        validate::id("user_id", user_id)?;
        Ok(self.with_shard(user_id, changes, |shard, changes| shard.bump_version_if_held(now, user_id, changes)))
    }

    /// The leases a user holds at `now`.
    pub fn leases(&self, now: Tick, user_id: &str, changes: &mut Changes) -> Result<Vec<LeaseView>, LeaseError> {
        validate::id("user_id", user_id)?;
        Ok(self.with_shard(user_id, changes, |shard, changes| shard.leases(now, user_id, changes)))
    }

    /// Expires the leases due at `now`, and forgets the users whose forget
    /// window ended (B6), at most `budget` users per shard per lock hold (plus,
    /// rarely, one shrink of a shard's tables after most of its users left,
    /// O(1) per user removed, amortised). Returns whether more may be due
    /// (call again, after publishing).
    pub fn expire(&self, now: Tick, budget: usize, changes: &mut Changes) -> bool {
        let mut more = false;
        let paused = self.expiry_paused.lock().clone();
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let forgotten = shard.forgotten();
            let from = changes.users.len();
            more |= shard.expire(now, budget.max(1), paused.as_deref(), &mut changes.users);
            self.record_users(&changes.users[from..]);
            self.hand_facts_on(&mut shard, changes);
            self.forgotten.fetch_add(shard.forgotten() - forgotten, Ordering::Relaxed);
            // The driver computes its next wake-up itself after this call, so
            // the timers it rescheduled here must not wake it again later.
            shard.take_earliest_new_timer();
        }
        more
    }

    /// Puts the session in the room, or updates its metadata there if it is
    /// in already (R1, R6). A second session of a user already in the room
    /// changes only the room's session count.
    pub fn join(
        &self,
        now: Tick,
        room: &RoomRef<'_>,
        metadata: &[(String, String)],
        changes: &mut Changes,
    ) -> Result<Joined, LeaseError> {
        validate_room_ref(room)?;
        validate::metadata(metadata)?;
        let from = changes.rooms.len();
        let changed = self.with_shard(room.user_id, changes, |shard, changes| {
            shard.join(now, room, self.names.acquire(room.room_id), metadata, changes)
        })?;
        Ok(Joined { changed, room_version: self.room_version(room.room_id, changes, from) })
    }

    /// Takes the session out of the room and ends its signals there (R1, R6).
    pub fn leave(&self, now: Tick, room: &RoomRef<'_>, changes: &mut Changes) -> Result<Left, LeaseError> {
        validate_room_ref(room)?;
        let from = changes.rooms.len();
        let (removed, changed) = self.with_shard(room.user_id, changes, |shard, changes| {
            shard.leave(now, room, self.names.find(room.room_id), changes)
        })?;
        Ok(Left { removed, changed, room_version: self.room_version(room.room_id, changes, from) })
    }

    /// Sets or extends (`ttl_ms` 1 to 10000) or clears (0) the session's
    /// signal of `kind` in a room it is in (S3). Only a change of the room's
    /// set of signalling users is published, and those are bounded per
    /// session ([`SIGNAL_CHANGES_PER_SECOND`](crate::SIGNAL_CHANGES_PER_SECOND)).
    pub fn signal(
        &self,
        now: Tick,
        room: &RoomRef<'_>,
        kind: &str,
        ttl_ms: u32,
        changes: &mut Changes,
    ) -> Result<Signalled, LeaseError> {
        validate_room_ref(room)?;
        validate::signal(kind, ttl_ms)?;
        let from = changes.rooms.len();
        let changed = self.with_shard(room.user_id, changes, |shard, changes| {
            shard.signal(now, room, self.names.find(room.room_id), kind, ttl_ms, changes)
        })?;
        Ok(Signalled { changed, room_version: self.room_version(room.room_id, changes, from) })
    }

    /// The room as it is: version, counts, access, signals, and its members
    /// unless there are more than `member_cap`. An unknown room is empty at
    /// version 0 with the default access.
    pub fn room(&self, room_id: &str, member_cap: usize) -> RoomView {
        self.room_shard(room_id).lock().view(room_id, member_cap)
    }

    /// Sets who may see the room (R4); a room with non-default access is kept while empty.
    pub fn set_room_access(&self, room_id: &str, access: RoomAccess) -> Result<(), LeaseError> {
        validate::id("room_id", room_id)?;
        self.room_shard(room_id).lock().set_access(room_id, access);
        Ok(())
    }

    /// Sets who may see the room as its owner does on a cluster (C1, R4):
    /// stamped by the room shard's clock, for every other node to take in
    /// with [`Store::take_room_access`]. Returns the stamp.
    pub fn set_room_access_stamped(&self, now: Tick, room_id: &str, access: RoomAccess) -> Result<u64, LeaseError> {
        validate::id("room_id", room_id)?;
        let mut shard = self.room_shard(room_id).lock();
        let stamp = shard.access_stamp(now);
        shard.set_access_stamped(room_id, access, stamp);
        Ok(stamp)
    }

    /// Takes in a room's access as its owner set it at `stamp`, unless a later
    /// setting is held here; returns whether it was taken.
    pub fn take_room_access(&self, room_id: &str, access: RoomAccess, stamp: u64) -> bool {
        self.room_shard(room_id).lock().set_access_stamped(room_id, access, stamp)
    }

    /// The access of the rooms `rooms` accepts that is not the default or
    /// was set by a room's owner, with its stamp: what a node tells a room's
    /// new owner.
    pub fn room_accesses(&self, rooms: &dyn Fn(&str) -> bool) -> Vec<(CompactString, RoomAccess, u64)> {
        self.rooms.iter().flat_map(|shard| shard.lock().accesses(rooms)).collect()
    }

    /// Whether the user has a session in the room.
    pub fn is_member(&self, room_id: &str, user_id: &str) -> bool {
        self.room_shard(room_id).lock().is_member(room_id, user_id)
    }

    /// The room's version and its counts of users and sessions, without
    /// reading its members: what a count watcher needs, once per interval.
    pub fn room_tally(&self, room_id: &str) -> (u64, u32, u32) {
        self.room_shard(room_id).lock().tally(room_id)
    }

    /// The room's version and counts of users and sessions but the members
    /// their own nodes hold invisible (C1, R4): a room taken in from nodes'
    /// facts counts what its viewers may count.
    pub fn room_visible_tally(&self, room_id: &str) -> (u64, u32, u32) {
        self.room_shard(room_id).lock().visible_tally(room_id)
    }

    /// Who may read the room (R4).
    pub fn room_access(&self, room_id: &str) -> RoomAccess {
        self.room_shard(room_id).lock().access(room_id)
    }

    /// How many of the user's sessions are in the room (0: it is not a member).
    pub fn member_sessions(&self, room_id: &str, user_id: &str) -> u32 {
        self.room_shard(room_id).lock().member_sessions(room_id, user_id)
    }

    /// The rooms the user's sessions are in, sorted (as of the last
    /// operation on the user: this reads no clock and settles nothing).
    pub fn rooms_of(&self, user_id: &str) -> Vec<CompactString> {
        // Under the shard's lock, which keeps the names' references held.
        let shard = self.shards[self.shard_of(user_id)].lock();
        self.room_ids(shard.rooms_of(user_id))
    }

    /// Applies a change of a session's attention (A1), named by its lease as
    /// a renewal names it: what a register, renewal or lease item carried
    /// beside the lease. Returns whether anything changed; an empty change
    /// only checks the lease. The attention ends with the lease.
    pub fn set_attention(
        &self,
        now: Tick,
        lease: (&str, &str, u64),
        change: &AttentionChange<'_>,
        changes: &mut Changes,
    ) -> Result<bool, LeaseError> {
        let (user_id, session_id, _) = lease;
        validate::id("user_id", user_id)?;
        validate::id("session_id", session_id)?;
        validate_attention(change)?;
        self.with_shard(user_id, changes, |shard, changes| shard.set_attention(now, lease, change, changes))
    }

    /// Where a notification for each user should go at `now` (A3, A4), in
    /// request order: from the attention of each user's live sessions, for
    /// the room `room_id` if it is about one. O(k) in the users and their
    /// sessions; a pure read. At most [`MAX_NOTIFY_USERS`] users.
    pub fn notify_targets<S: AsRef<str>>(
        &self,
        now: Tick,
        user_ids: &[S],
        room_id: Option<&str>,
        urgency: Urgency,
        policy: &NotifyPolicy,
    ) -> Result<Vec<NotifyDecision<CompactString>>, LeaseError> {
        validate::user_ids(user_ids)?;
        if user_ids.len() > MAX_NOTIFY_USERS {
            let reason = format!("at most {MAX_NOTIFY_USERS} users per call, not {}", user_ids.len());
            return Err(LeaseError::InvalidArgument { field: "user_ids", reason });
        }
        if let Some(room_id) = room_id {
            validate::id("room_id", room_id)?;
        }
        let room = room_id.map(room_hash);
        Ok(user_ids
            .iter()
            .map(|user_id| {
                let user_id = user_id.as_ref();
                let sessions = self.shards[self.shard_of(user_id)].lock().attention_of(now, user_id);
                notify_target(&sessions, room, urgency, now, policy)
            })
            .collect())
    }

    /// The user's live sessions at `now`, the most recently created first,
    /// each with the rooms it is in: what an operator lists (O4). A pure read:
    /// nothing is settled, published or counted, and a lease whose deadline
    /// has passed is left out even if the expiry driver has not collected it
    /// yet, as any request would find it gone.
    pub fn sessions(&self, now: Tick, user_id: &str) -> Result<Vec<SessionView>, LeaseError> {
        validate::id("user_id", user_id)?;
        // Under the shard's lock, which keeps the names' references held.
        let shard = self.shards[self.shard_of(user_id)].lock();
        let sessions = shard.live_sessions(now, user_id);
        Ok(sessions
            .into_iter()
            .map(|(lease, mut rooms)| {
                rooms.sort_unstable_by_key(|&(name, _)| self.names.id(name));
                let (rooms, room_metadata) =
                    rooms.into_iter().map(|(name, metadata)| (self.names.id(name), metadata)).unzip();
                SessionView { lease, rooms, room_metadata }
            })
            .collect())
    }

    /// Room names as ids, sorted; called under the lock of the shard that
    /// holds references to them.
    fn room_ids(&self, names: Vec<RoomName>) -> Vec<CompactString> {
        let mut rooms: Vec<CompactString> = names.into_iter().map(|name| self.names.id(name)).collect();
        rooms.sort_unstable();
        rooms
    }

    /// The room's version after an operation that appended its room changes
    /// to `changes` from `from` on: its last change's (the room may have been
    /// dropped since, empty), or the room's own if it did not change.
    fn room_version(&self, room_id: &str, changes: &Changes, from: usize) -> u64 {
        match changes.rooms[from..].iter().rev().find(|change| change.room_id == room_id) {
            Some(change) => change.version,
            None => self.room_shard(room_id).lock().version(room_id),
        }
    }

    fn room_shard(&self, room_id: &str) -> &Mutex<RoomShard> {
        &self.rooms[self.room_shard_of(room_id)]
    }

    /// Which room shard a room lives in: the same hash as users', on the room id (C1).
    fn room_shard_of(&self, room_id: &str) -> usize {
        shard_index(room_id, self.rooms.len())
    }

    /// Applies the facts the user shard made to the room shards, one room
    /// shard lock at a time, while the caller still holds the user shard's;
    /// or, on a store that sends them out, stamps them for the rooms' owners.
    fn hand_facts_on(&self, shard: &mut Shard, changes: &mut Changes) {
        let now = shard.now();
        let out = self.room_facts_out.load(Ordering::Relaxed);
        for fact in shard.take_facts() {
            let fact = fact.naming(|&name| self.names.id(name));
            if out {
                changes.room_facts.push(StampedRoomFact::new(shard.fact_stamp(), fact));
            } else {
                let mut rooms = self.rooms[self.room_shard_of(fact.room_id())].lock();
                let from = changes.rooms.len();
                rooms.apply(now, fact, &mut changes.rooms);
                self.record_rooms(now, &changes.rooms[from..]);
            }
        }
        // Only now, with every fact named: a fact may name a room whose last
        // reference its operation released.
        for name in shard.take_released() {
            self.names.release(name);
        }
    }

    /// Makes the user shards' room facts leave the store, stamped, in
    /// [`Changes::room_facts`], for the rooms' owners to take in (C1, see
    /// `room_intake.rs`), rather than feed this store's room shards, which
    /// then hold only what [`Store::take_in_room_facts`] brings. A cluster
    /// node calls it before it serves. What the room shards held (members a
    /// restored checkpoint brought) is forgotten: the rooms' owners take those
    /// members in from this node's scans.
    pub fn send_room_facts_out(&self) {
        self.room_facts_out.store(true, Ordering::Relaxed);
        self.forget_rooms(&|_| true);
    }

    /// Takes in room facts a node (`source`) sent, this node owning their
    /// rooms (C1): each is applied unless a fact of its user in its room at
    /// least as new was taken in before. Returns each fact's room version
    /// after it, in the order given.
    pub fn take_in_room_facts(
        &self,
        now: Tick,
        source: &str,
        facts: Vec<StampedRoomFact>,
        changes: &mut Changes,
    ) -> Vec<u64> {
        facts
            .into_iter()
            .map(|fact| {
                let room_id = fact.fact.room_id().clone();
                let mut rooms = self.room_shard(&room_id).lock();
                let from = changes.rooms.len();
                rooms.take_in(now, source, fact, &mut changes.rooms);
                self.record_rooms(now, &changes.rooms[from..]);
                rooms.version(&room_id)
            })
            .collect()
    }

    /// Where the users `users` accepts stand in the rooms `rooms` accepts
    /// (see [`RoomFactScan`]): what a node re-asserts to a room's owner that
    /// may have missed some of its facts. One user shard lock at a time.
    pub fn room_facts_held(
        &self,
        now: Tick,
        users: &dyn Fn(&str) -> bool,
        rooms: &dyn Fn(&str) -> bool,
    ) -> RoomFactScan {
        let mut scan = RoomFactScan::default();
        let mut facts = Vec::new();
        for shard in self.shards.iter() {
            let mut shard = shard.lock();
            let stamp = shard.room_facts_held(now, users, &mut facts);
            for fact in facts.drain(..) {
                let fact = fact.naming(|&name| self.names.id(name));
                if rooms(fact.room_id()) {
                    scan.facts.push(StampedRoomFact::new(stamp, fact));
                }
            }
            scan.shard_stamps.push(stamp);
        }
        scan
    }

    /// Where one user stands in each room it is in, stamped now: what its
    /// node says again when something the facts carry changed (C1: its
    /// visibility, which the rooms' counts follow).
    pub fn room_facts_of(&self, now: Tick, user_id: &str) -> Vec<StampedRoomFact> {
        let mut shard = self.shards[self.shard_of(user_id)].lock();
        let mut facts = Vec::new();
        let stamp = shard.room_facts_of(now, user_id, &mut facts);
        facts.into_iter().map(|fact| StampedRoomFact::new(stamp, fact.naming(|&name| self.names.id(name)))).collect()
    }

    /// Takes in a node's scan of the rooms `rooms` accepts (see
    /// [`RoomFactScan`]): its facts, and, for each member whose last fact
    /// came from `source` and that the scan leaves out, a leave as of the
    /// scan of its user's shard (a signal it leaves out ends likewise).
    /// What it changes is recorded in the change feed unless `taken_for`
    /// says the rooms are being rebuilt.
    pub fn take_in_room_scan(
        &self,
        now: Tick,
        source: &str,
        rooms: &dyn Fn(&str) -> bool,
        scan: RoomFactScan,
        taken_for: ScanTakenFor,
        changes: &mut Changes,
    ) {
        let mut by_shard: Vec<Vec<StampedRoomFact>> = (0..self.rooms.len()).map(|_| Vec::new()).collect();
        for fact in scan.facts {
            by_shard[self.room_shard_of(fact.fact.room_id())].push(fact);
        }
        let stamps = scan.shard_stamps;
        let scanned_at = |user_id: &str| stamps.get(shard_index(user_id, stamps.len())).copied().unwrap_or(0);
        for (shard, facts) in self.rooms.iter().zip(by_shard) {
            let mut shard = shard.lock();
            let from = changes.rooms.len();
            shard.take_in_scan(now, source, facts, rooms, &scanned_at, &mut changes.rooms);
            if taken_for == ScanTakenFor::Mending {
                self.record_rooms(now, &changes.rooms[from..]);
            }
        }
    }

    /// The nodes whose facts hold some member of this store's rooms (C1).
    pub fn room_fact_sources(&self) -> Vec<CompactString> {
        let mut sources: Vec<CompactString> = self.rooms.iter().flat_map(|shard| shard.lock().fact_sources()).collect();
        sources.sort_unstable();
        sources.dedup();
        sources
    }

    /// Takes every member whose last fact node `source` sent for one that
    /// left (C1): `source` is gone from the cluster, and the users of it that
    /// live on were taken over by other nodes, whose later facts hold them.
    pub fn forget_room_fact_source(&self, now: Tick, source: &str, changes: &mut Changes) {
        for shard in self.rooms.iter() {
            let mut shard = shard.lock();
            let from = changes.rooms.len();
            shard.forget_source(now, source, &mut changes.rooms);
            self.record_rooms(now, &changes.rooms[from..]);
        }
    }

    /// The greatest room version stamp this store issued: what a node hands
    /// a room's next owner, whose versions then go on above it (M4).
    pub fn room_clock(&self) -> u64 {
        self.rooms.iter().map(|shard| shard.lock().last_stamp()).max().unwrap_or(0)
    }

    /// Makes every room version from now on greater than `stamp` (another
    /// node's [`Store::room_clock`], at most [`MAX_STAMP`](crate::stamp::MAX_STAMP)).
    pub fn raise_room_clocks(&self, stamp: u64) {
        let stamp = stamp.min(crate::stamp::MAX_STAMP);
        self.rooms.iter().for_each(|shard| shard.lock().restore_clock(stamp));
    }

    /// Forgets, publishing nothing, the members and signals of the rooms
    /// `rooms` accepts, which another node owns now (C1); their access stays.
    pub fn forget_rooms(&self, rooms: &dyn Fn(&str) -> bool) {
        for shard in self.rooms.iter() {
            shard.lock().forget_rooms(rooms);
        }
    }

    /// A time at or before the earliest deadline (a lease's, a status's, or the
    /// end of an offline user's forget window), when [`Store::expire`] may have
    /// work; `None` when there is none.
    pub fn next_deadline(&self) -> Option<Tick> {
        self.shards.iter().filter_map(|shard| shard.lock().next_deadline()).min()
    }

    /// Tells the store when the expiry driver will next wake: an operation that
    /// schedules an earlier deadline calls the waker. `u64::MAX` makes every new
    /// deadline wake it; set that before computing [`Store::next_deadline`], then
    /// the result, so that no deadline scheduled in between is missed.
    pub fn set_alarm(&self, at: Tick) {
        self.alarm.store(at, Ordering::SeqCst);
    }

    /// Holds every user ONLINE now online until `until`, as a restart does
    /// (B3), for a service that did not run for a while (stopped, paused,
    /// starved): a user whose gateway could not renew meanwhile does not flip,
    /// its gateway re-registers a session that ran out, and a user nobody
    /// renews goes OFFLINE when the hold ends. At most
    /// [`CHECKPOINT_USERS_PER_LOCK`] users per shard-lock hold. Publishes
    /// nothing; returns how many users were held.
    pub fn hold_online_users(&self, now: Tick, until: Tick) -> usize {
        let mut held = 0;
        for shard in self.shards.iter() {
            let mut from = Some(0);
            while let Some(slot) = from {
                let (count, next) = shard.lock().hold_online_users(now, until, slot, CHECKPOINT_USERS_PER_LOCK);
                held += count;
                from = next;
            }
        }
        held
    }

    /// Counts over all shards.
    pub fn stats(&self) -> StoreStats {
        let mut stats = StoreStats::default();
        for shard in self.shards.iter() {
            let shard = shard.lock();
            stats.sessions += shard.sessions();
            stats.online_users += shard.online_users();
            stats.users += shard.users();
            stats.suppressed_flaps += shard.suppressed_flaps();
        }
        for rooms in self.rooms.iter() {
            let (held, memberships) = rooms.lock().counts();
            stats.rooms += held;
            stats.room_memberships += memberships;
        }
        stats
    }

    /// Users forgotten since the start (B6): a caller that sees many go can ask
    /// its allocator to hand their memory back to the operating system.
    pub fn forgotten_users(&self) -> u64 {
        self.forgotten.load(Ordering::Relaxed)
    }

    /// Operations applied to each shard since the start, in shard order.
    pub fn shard_operations(&self) -> Vec<u64> {
        self.shards.iter().map(|shard| shard.lock().operations()).collect()
    }

    /// Number of shards (each checkpointed under its own lock).
    pub fn shard_count(&self) -> usize {
        self.shards.len()
    }

    /// Appends shard `index`'s users and leases to a checkpoint, taking the
    /// shard's lock for at most [`CHECKPOINT_USERS_PER_LOCK`] users at a time,
    /// so that requests to the shard wait for a short slice, never for the
    /// whole shard. Each user is captured whole, under one lock hold, with
    /// its sessions' room memberships. Then room shard `index`'s clock and
    /// access settings, under its own lock (there are as many room shards as
    /// user shards).
    pub fn checkpoint_shard(&self, index: usize, writer: &mut CheckpointWriter) {
        let mut from = 0;
        while let Some(next) =
            self.shards[index].lock().checkpoint(writer, from, CHECKPOINT_USERS_PER_LOCK, None, &self.names)
        {
            from = next;
        }
        self.rooms[index].lock().checkpoint(writer);
    }

    /// Holds back the expiry of the users of `slots` (none: of nobody) while
    /// they are handed over to another node (C3): the node taking them over
    /// expires them from the same deadlines, and nothing this node publishes
    /// for them after their state left could reach a viewer with a version
    /// the other node would then go below. Their timers are put back, not
    /// lost: should the handover fail, they fire a second later.
    pub fn pause_expiry(&self, slots: Option<Arc<SlotSet>>) {
        *self.expiry_paused.lock() = slots;
    }

    /// The state of the users of `slots`, to hand over to another node (C3):
    /// a checkpoint (`checkpoint.rs`) of those users only, with every
    /// shard's stamp clock, so that the node taking them over issues stamps
    /// above any these users have (M4). Taken a slice of each shard at a
    /// time, as [`Store::checkpoint_shard`] is. Room access settings are
    /// not part of it: rooms are per node in a cluster.
    pub fn export_slots(&self, slots: &SlotSet, at: Tick) -> Vec<u8> {
        let mut writer = CheckpointWriter::new(at);
        let mut bytes = Vec::new();
        for shard in self.shards.iter() {
            let mut from = 0;
            while let Some(next) =
                shard.lock().checkpoint(&mut writer, from, CHECKPOINT_USERS_PER_LOCK, Some(slots), &self.names)
            {
                from = next;
            }
            bytes.extend(writer.take_chunk());
        }
        bytes.extend(writer.finish());
        bytes
    }

    /// Takes over users another node handed over ([`Store::export_slots`]'s
    /// bytes): each replaces whatever this store held of it, keeping its
    /// version and its leases' generations and deadlines, and every stamp
    /// this store issues from now on is above the other node's (M4). Nothing
    /// is published for them but the OFFLINE of a user handed over online
    /// with no lease left. The bytes are checked whole before anything is
    /// taken: refused ones change nothing.
    pub fn import(&self, now: Tick, bytes: &[u8], changes: &mut Changes) -> Result<Imported, CheckpointError> {
        let handed = self.decode_raising_clocks(bytes)?;
        Ok(self.import_decoded(now, &handed, changes))
    }

    /// [`Store::import`] in place of whatever this store holds of `slots`:
    /// their users are dropped (as [`Store::release_slots`] does) once the
    /// bytes are checked whole, then the bytes' users taken in. A follower's
    /// copy of slots starting afresh (C4).
    pub fn replace_slots(
        &self,
        now: Tick,
        slots: &SlotSet,
        bytes: &[u8],
        changes: &mut Changes,
    ) -> Result<Imported, CheckpointError> {
        let handed = self.decode_raising_clocks(bytes)?;
        self.release_slots(now, slots);
        Ok(self.import_decoded(now, &handed, changes))
    }

    /// Takes in every user of a decoded handover (see [`Store::import`]).
    fn import_decoded(&self, now: Tick, handed: &Checkpoint, changes: &mut Changes) -> Imported {
        let mut imported = Imported::default();
        for user in &handed.users {
            let record = user.as_record();
            imported.users += 1;
            imported.sessions += user.leases.len();
            self.with_shard(user.user_id.as_str(), changes, |shard, users| {
                shard.import_user(now, &record, &self.names, users);
            });
        }
        imported
    }

    /// Another node's users' state, checked whole, once every clock here is
    /// raised above the last stamp it carries: what is taken in from it keeps
    /// its versions, and whatever this store issues from now on is above (M4).
    fn decode_raising_clocks(&self, bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
        let decoded = checkpoint::decode(bytes)?;
        for shard in self.shards.iter() {
            shard.lock().restore_clock(decoded.last_stamp);
        }
        for rooms in self.rooms.iter() {
            rooms.lock().restore_clock(decoded.last_stamp);
        }
        Ok(decoded)
    }

    /// The statuses of the users of `slots` (C3): they go with the users'
    /// state, kept as the rest of a user's durable data is.
    pub fn statuses_in(&self, slots: &SlotSet) -> Vec<(CompactString, Status)> {
        self.shards.iter().flat_map(|shard| shard.lock().statuses_in(slots)).collect()
    }

    /// The user's status as held, settling nothing (C4: sent to its follower).
    pub fn status_of(&self, user_id: &str) -> Option<Status> {
        self.shards[self.shard_of(user_id)].lock().status_named(user_id)
    }

    /// Drops, publishing nothing, the users of `slots` once another node has
    /// taken them over (C3). Returns how many users were dropped.
    pub fn release_slots(&self, now: Tick, slots: &SlotSet) -> usize {
        // Room changes of the sessions dropped are not published either:
        // the rooms' viewers are at the nodes that own the users now.
        let mut unpublished = Changes::default();
        let mut released = 0;
        for index in 0..self.shards.len() {
            // A slice of the shard's users per lock hold, as a checkpoint
            // takes them: renewals of the shard's other users wait for a
            // slice at most, not for the whole shard.
            let mut below = None;
            loop {
                let (dropped, next) = self.with_shard_at(index, &mut unpublished, |shard, _| {
                    shard.release(now, slots, below, CHECKPOINT_USERS_PER_LOCK)
                });
                released += dropped;
                match next {
                    Some(next) => below = Some(next),
                    None => break,
                }
            }
        }
        released
    }

    /// Starts noting which users change (C4): every change to a user's
    /// state but a renewal's new deadline, for [`Store::take_changed`]. A
    /// cluster node does, so that each slot's follower is sent what changed.
    pub fn track_changes(&self) {
        self.shards.iter().for_each(|shard| shard.lock().track_changes());
    }

    /// The users changed since the last call (none unless
    /// [`Store::track_changes`] was called), each once.
    pub fn take_changed(&self) -> Vec<CompactString> {
        self.shards.iter().flat_map(|shard| shard.lock().take_changed()).collect()
    }

    /// Starts noting every change to the users of `slots` (a move copies
    /// them while they are served, C7), renewals' new deadlines included,
    /// for [`Store::take_moving_changed`]; `None` stops. One move at a time:
    /// a call forgets what the last one noted.
    pub fn track_moving(&self, slots: Option<&SlotSet>) {
        self.shards.iter().for_each(|shard| shard.lock().track_moving(slots));
    }

    /// The users of the moving slots that changed since the last call, each
    /// once: what a move sends again before it freezes the slots.
    pub fn take_moving_changed(&self) -> Vec<CompactString> {
        self.shards.iter().flat_map(|shard| shard.lock().take_moving_changed()).collect()
    }

    /// Takes in a move's later state of some users (C7): each user `bytes`
    /// holds (as [`Store::export_users`] writes it) replaces what this store
    /// holds of it, and each of `absent` (users the source no longer holds)
    /// is dropped. Publishes no change; the room facts of the users taken are
    /// put in `changes`, as [`Store::import`] does.
    pub fn replace_users(
        &self,
        now: Tick,
        bytes: &[u8],
        absent: &[CompactString],
        changes: &mut Changes,
    ) -> Result<Replaced, CheckpointError> {
        let handed = self.decode_raising_clocks(bytes)?;
        let mut replaced: Vec<CompactString> =
            handed.users.iter().map(|user| CompactString::from(user.user_id.as_str())).collect();
        replaced.extend(absent.iter().cloned());
        let dropped = self.drop_users(now, &replaced);
        Ok(Replaced { dropped, taken: self.import_decoded(now, &handed, changes) })
    }

    /// The state of the users named, as [`Store::export_slots`] writes it,
    /// and the ones this store does not hold (forgotten, or never seen).
    pub fn export_users(&self, user_ids: &[CompactString], at: Tick) -> (Vec<u8>, Vec<CompactString>) {
        let mut by_shard: Vec<Vec<CompactString>> = vec![Vec::new(); self.shards.len()];
        for user_id in user_ids {
            by_shard[self.shard_of(user_id)].push(user_id.clone());
        }
        let mut writer = CheckpointWriter::new(at);
        let (mut bytes, mut absent) = (Vec::new(), Vec::new());
        for (shard, ids) in self.shards.iter().zip(&by_shard) {
            for part in ids.chunks(CHECKPOINT_USERS_PER_LOCK) {
                absent.extend(shard.lock().checkpoint_users(&mut writer, part, &self.names));
                bytes.extend(writer.take_chunk());
            }
        }
        bytes.extend(writer.finish());
        (bytes, absent)
    }

    /// Drops, publishing nothing, the users named (a follower's copy of users
    /// its owner no longer holds). Returns how many were held.
    pub fn release_users(&self, now: Tick, user_ids: &[CompactString]) -> usize {
        self.drop_users(now, user_ids).users
    }

    /// [`Store::release_users`], answering the users and sessions dropped.
    fn drop_users(&self, now: Tick, user_ids: &[CompactString]) -> Imported {
        let mut by_shard: Vec<Vec<CompactString>> = vec![Vec::new(); self.shards.len()];
        for user_id in user_ids {
            by_shard[self.shard_of(user_id)].push(user_id.clone());
        }
        let mut unpublished = Changes::default();
        by_shard
            .iter()
            .enumerate()
            .filter(|(_, ids)| !ids.is_empty())
            .flat_map(|(index, ids)| ids.chunks(CHECKPOINT_USERS_PER_LOCK).map(move |part| (index, part)))
            .map(|(index, ids)| self.with_shard_at(index, &mut unpublished, |shard, _| shard.release_users(now, ids)))
            .fold(Imported::default(), |all, shard| Imported {
                users: all.users + shard.users,
                sessions: all.sessions + shard.sessions,
            })
    }

    /// Takes over users a follower kept of a dead node (C4; the bytes of
    /// [`Store::export_slots`] of its copy): as [`Store::import`], except that
    /// what the dead node did after the copy was made is unknown, so each
    /// user it knew online is held online until `hold_until` (as after a
    /// restart, B3) and each lease lives until then at least, for its gateway
    /// to renew it or register it again. Publishes no change; on a store that
    /// sends its room facts out, the taken users' room facts are put in
    /// `changes` (their rooms' owners then hear the users from this node, and
    /// end the signals the dead node's users sent there).
    pub fn take_over(
        &self,
        now: Tick,
        bytes: &[u8],
        hold_until: Tick,
        changes: &mut Changes,
    ) -> Result<Imported, CheckpointError> {
        let copy = self.decode_raising_clocks(bytes)?;
        let mut imported = Imported::default();
        // Room changes are not published either: nobody watches rooms by
        // these users at this node yet.
        let mut unpublished = Changes::default();
        for user in &copy.users {
            let record = user.as_record();
            imported.users += 1;
            imported.sessions += user.leases.len();
            self.with_shard(user.user_id.as_str(), &mut unpublished, |shard, users| {
                shard.take_over_user(now, &record, hold_until, &self.names, users);
            });
        }
        changes.room_facts.append(&mut unpublished.room_facts);
        Ok(imported)
    }

    /// A store holding what `checkpoint` held (B3): leases keep their
    /// generations and deadlines, users their versions, and every stamp issued
    /// from now on is greater than any the checkpointed store issued (M4).
    /// Users that were online are held online until `hold_until` even if no
    /// lease of theirs survives, so that gateways have time to be heard from.
    ///
    /// For a checkpoint already decoded; a file is better loaded with a
    /// [`StoreLoader`](crate::checkpoint::StoreLoader), which restores the
    /// same way without decoding the whole file first.
    pub fn restore(
        config: StoreConfig,
        now: Tick,
        checkpoint: &Checkpoint,
        hold_until: Tick,
    ) -> Result<Self, ConfigError> {
        let mut store = Store::new(config, now)?;
        store.restore_clock(checkpoint.last_stamp);
        let offline_due: Vec<_> =
            checkpoint.users.iter().filter_map(|user| store.restore_user(now, &user.as_record(), hold_until)).collect();
        for room in &checkpoint.rooms {
            store.restore_room(&room.room_id, room.access);
        }
        Ok(store.finish_restore(now, &offline_due))
    }

    /// Makes every stamp any shard issues from now on greater than `last_stamp`
    /// (a checkpointed shard's): a user may come back in any shard.
    ///
    /// This and the other restore steps take the store by `&mut`: nobody else
    /// can reach a store being restored, so its shards are reached without
    /// their locks (a lock and an unlock per user is a tenth of a load).
    pub(crate) fn restore_clock(&mut self, last_stamp: u64) {
        for shard in self.shards.iter_mut() {
            shard.get_mut().restore_clock(last_stamp);
        }
        // Room versions are stamps of the room shards' clocks, checkpointed
        // in the same records: a floor for both is a floor for each.
        for rooms in self.rooms.iter_mut() {
            rooms.get_mut().restore_clock(last_stamp);
        }
    }

    /// Puts back a room's access setting (R4).
    pub(crate) fn restore_room(&mut self, room_id: &str, access: RoomAccess) {
        let index = self.room_shard_of(room_id);
        self.rooms[index].get_mut().set_access(room_id, access);
    }

    /// Puts back one checkpointed user (see [`Store::restore`]). A user that
    /// was online with nothing left to hold it is due to go OFFLINE; that
    /// flip takes a stamp, which must wait until every shard's clock is
    /// restored, so its shard and slot are returned for
    /// [`Store::finish_restore`] instead.
    pub(crate) fn restore_user(&mut self, now: Tick, user: &UserRecord<'_>, hold_until: Tick) -> Option<(u32, u32)> {
        let shard = self.shard_of(user.user_id);
        let locked = self.shards[shard].get_mut();
        let slot = locked.restore_user(now, user, hold_until, 0, &self.names);
        // Its sessions' memberships, for the rooms; nobody watches a store
        // being restored, so what changes in them is not published.
        let (facts, released) = (locked.take_facts(), locked.take_released());
        for fact in facts {
            let fact = fact.naming(|&name| self.names.id(name));
            let index = self.room_shard_of(fact.room_id());
            self.rooms[index].get_mut().apply(now, fact, &mut Vec::new());
        }
        for name in released {
            self.names.release(name);
        }
        Some((shard as u32, slot?))
    }

    /// Ends a restore: flips OFFLINE the users [`Store::restore_user`] left due.
    pub(crate) fn finish_restore(mut self, now: Tick, offline_due: &[(u32, u32)]) -> Self {
        for &(shard, slot) in offline_due {
            self.shards[shard as usize].get_mut().finish_restore(now, slot);
        }
        for rooms in self.rooms.iter_mut() {
            rooms.get_mut().finish_restore(now);
        }
        self
    }

    /// Room names in use, for tests of their lifetime.
    #[cfg(test)]
    pub(crate) fn room_names_in_use(&self) -> usize {
        self.names.len()
    }

    /// Which shard a user lives in.
    pub fn shard_of(&self, user_id: &str) -> usize {
        // The high bits: foldhash mixes them best.
        shard_index(user_id, self.shards.len())
    }

    /// Runs `op` on the user's shard under its lock, then wakes the expiry
    /// driver, with the lock released, if `op` scheduled an earlier deadline.
    fn with_shard<R>(
        &self,
        user_id: &str,
        changes: &mut Changes,
        op: impl FnOnce(&mut Shard, &mut Vec<PresenceChange>) -> R,
    ) -> R {
        self.with_shard_at(self.shard_of(user_id), changes, op)
    }

    /// [`Store::with_shard`] by shard index.
    fn with_shard_at<R>(
        &self,
        index: usize,
        changes: &mut Changes,
        op: impl FnOnce(&mut Shard, &mut Vec<PresenceChange>) -> R,
    ) -> R {
        let mut shard = self.shards[index].lock();
        let from = changes.users.len();
        let result = op(&mut shard, &mut changes.users);
        self.record_users(&changes.users[from..]);
        self.hand_facts_on(&mut shard, changes);
        let earliest_new_timer = shard.take_earliest_new_timer();
        drop(shard);
        if let (Some(deadline), Some(waker)) = (earliest_new_timer, &self.waker)
            && deadline < self.alarm.load(Ordering::SeqCst)
        {
            waker();
        }
        result
    }
}

impl Store {
    /// Records users' changes in the feed; the caller holds their shard's lock.
    fn record_users(&self, changes: &[PresenceChange]) {
        if let Some(feed) = &self.feed {
            feed.record_users(changes);
        }
    }

    /// Records rooms' changes in the feed; the caller holds their room shard's lock.
    fn record_rooms(&self, now: Tick, changes: &[RoomChange]) {
        if let Some(feed) = &self.feed {
            feed.record_rooms(now, changes);
        }
    }
}

/// The shard of `user_id` in a store of `shards` shards (a power of two), the
/// same in every store, so that a room owner knows which of a node's user
/// shards a user's facts come from. Its hash is independent of the shards'
/// own table hashers, so that the bits that pick a shard do not also cluster
/// the users inside it.
fn shard_index(user_id: &str, shards: usize) -> usize {
    const SHARD_HASHER: foldhash::fast::FixedState = foldhash::fast::FixedState::with_seed(0x7072_6573_656e_6365);
    (SHARD_HASHER.hash_one(user_id) >> 32) as usize & shards.saturating_sub(1)
}

/// A room operation's ids are valid (B1).
fn validate_room_ref(room: &RoomRef<'_>) -> Result<(), LeaseError> {
    validate::id("user_id", room.user_id)?;
    validate::id("session_id", room.session_id)?;
    validate::id("room_id", room.room_id)
}

/// Checks a change of attention (A1): a focused room is an id as any other.
fn validate_attention(change: &AttentionChange<'_>) -> Result<(), LeaseError> {
    if let Some(room_id) = change.focused_room_id.filter(|room_id| !room_id.is_empty()) {
        validate::id("focused_room_id", room_id)?;
    }
    Ok(())
}
