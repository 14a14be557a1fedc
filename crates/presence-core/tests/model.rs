//! Property test: the lease store against a naive reference model, through its public API.
//!
//! Each `cargo test` run covers over a million store operations (the core and proptest are
//! optimised in test builds for it); `PRESENCE_MODEL_CASES` sets the number of cases for a long
//! run (see `docs/reliability.md`). A failure is shrunk to a minimal sequence, which is printed
//! and saved in `proptest-regressions/model.txt` to be replayed first by every later run.
//!
//! The model keeps every user's leases in ordered maps and applies the documented semantics
//! directly: every operation first settles the user it touches (drops the leases whose deadline
//! has passed and flips the user OFFLINE if none is left), a lease is live while
//! `now < expires_at`, and `changed` means the operation's own action flipped the user.
//! Generations and versions are stamps whose exact values the model does not predict: it
//! records what the store hands out and checks that they strictly increase (L1, M3) and that
//! versions move only with a flip.
//!
//! Random sequences over a handful of users, sessions and gateways (so that reconnects,
//! collisions and shared shards are common) compare every answer and every published change
//! with the model, and check the invariants after every step:
//! - stats (which do not settle) match the model's unsettled leases and online users;
//! - a timer exists exactly while a lease does, never after the earliest lease deadline, and
//!   none is due after `expire` was drained;
//! - after draining `expire(now)` no lease with `expires_at <= now` is left anywhere (L4);
//! - a user is ONLINE iff it holds a live lease (M2), in snapshots and lease listings alike;
//! - exactly one change per flip (E1), none for anything else, and versions strictly increase,
//!   also past forgetting: a user that comes back gets a version above any it had (M4);
//! - a user that has been OFFLINE with no lease for the forget window is forgotten by the
//!   driver and from then on answered like a user never seen (B6, P3): the model forgets it
//!   too, and every answer still matches;
//! - with flap damping (E6, some cases only), a user whose last lease ends by expiry or
//!   unregister stays ONLINE for the window after it ended, a register within it cancels the
//!   flip with no change and no new version, the OFFLINE comes at its end through the wheel
//!   (its deadline the window's end), and a revoke is never damped.
//!
//! Sessions also join and leave rooms (with small random metadata) and signal in them (R1, R2,
//! R6, S3). The model keeps each lease's memberships and signals on the lease, so that they end
//! with it (expiry, unregister, revoke, reconnect), and derives every room from them: its
//! members, each member's session count and shown metadata (that of its session in the room
//! that joined or updated last), and per kind the users signalling it. After every operation:
//! - each room as read is the model's, before and after reads settle everyone; after a drain
//!   nothing is left to settle, so signals and memberships ended through the wheel;
//! - a watcher of each room applies the published changes and must end up with the model's
//!   room, and each change must be one a watcher may see: `Joined` only when the user entered
//!   the room in the operation, `Left` only when it left, `Updated` only when its shown
//!   metadata changed, at most one of them per user and room, `Sessions` only when the count
//!   changed and with the room's version unmoved, `Signals` only when that kind's set changed;
//!   room versions strictly increase per room, also across a room that empties and fills again;
//! - the answers of join, leave and signal (errors, `changed`, `removed`, the room version)
//!   are the model's, the signal rate bound included.
//!
//! The store records its change feed (F1) in an intake that is drained after every step: its
//! positions strictly increase, it holds exactly the published changes of users and the
//! rooms' occupancy changes, in the order they were made, and a reader that applies it holds,
//! for every user the model knows, the model's state and version, and for every room whether
//! the model's room has members.

use std::collections::{BTreeMap, BTreeSet};

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use presence_core::{
    Changes, FeedEvent, FeedIntake, LeaseError, LeaseView, Presence, PresenceChange, Registration, Revoked, RoomChange,
    RoomChangeKind, RoomEventBody, RoomRef, SIGNAL_CHANGES_PER_SECOND, State, Store, StoreConfig, StoreStats, Tick,
    UnregisterOutcome, Unregistered,
};
use proptest::prelude::*;
use proptest::test_runner::{FileFailurePersistence, RngSeed, TestRunner};

const USERS: [&str; 5] = ["alice", "bob", "carol", "dave", "erin"];
/// Asked about in snapshots, never registered.
const UNKNOWN_USER: &str = "nobody";
const SESSIONS: [&str; 4] = ["phone", "laptop", "tab-1", "tab-2"];
const GATEWAYS: [&str; 3] = ["gw-a", "gw-b", "gw-c"];
const MIN_TTL: u32 = 10;
const DEFAULT_TTL: u32 = 50;
const MAX_TTL: u32 = 200;
/// The shortest forget window the store accepts, so that sequences reach it.
const FORGET_AFTER: Tick = 1_000;
const ROOMS: [&str; 3] = ["lobby", "doc-1", "doc-2"];
const KINDS: [&str; 2] = ["typing", "speaking"];
/// The room metadata a join may carry, by index: none (the common case), or one of a few sets.
const ROOM_METADATA: [&[(&str, &str)]; 4] =
    [&[], &[("device", "phone")], &[("device", "laptop")], &[("device", "phone"), ("mic", "on")]];
/// The store's active window (A2).
const ACTIVE_WINDOW: Tick = 60_000;
/// Lists a room's members and signals, more than the model ever has.
const MEMBER_CAP: usize = 100;

/// `offline_grace_ms` 0 turns flap damping off.
fn config(offline_grace_ms: Tick) -> StoreConfig {
    StoreConfig {
        shards: 4,
        min_ttl_ms: MIN_TTL,
        default_ttl_ms: DEFAULT_TTL,
        max_ttl_ms: MAX_TTL,
        min_renew_interval_ms: 0,
        forget_offline_after_ms: FORGET_AFTER,
        offline_grace_ms,
        active_window_ms: ACTIVE_WINDOW,
    }
}

fn metadata(with: bool) -> Vec<(String, String)> {
    if with { vec![("device".to_string(), "phone".to_string())] } else { Vec::new() }
}

fn room_metadata(pick: usize) -> Vec<(String, String)> {
    ROOM_METADATA[pick].iter().map(|&(key, value)| (key.to_string(), value.to_string())).collect()
}

/// The index of a model user, room or kind named in a store answer.
fn index_of(names: &[&str], name: &str) -> usize {
    names.iter().position(|n| *n == name).unwrap_or_else(|| panic!("{name:?} is none of {names:?}"))
}

/// Which generation a renew or unregister carries.
#[derive(Clone, Copy, Debug)]
enum Gen {
    /// The lease's current one (or, with no lease, the last one issued to the session).
    Current,
    /// One issued to the session earlier (a dead socket's), picked by index.
    Older(usize),
    /// One more than the current one: never issued.
    Newer,
    /// Zero: older than anything.
    Zero,
}

/// Which session an operation names.
#[derive(Clone, Copy, Debug)]
enum Target {
    /// One the model holds a lease for (live or not yet settled), picked by index; any session
    /// when there is none. Keeps renewals, reconnects and closes of real leases common.
    Held(usize),
    /// Indices into USERS and SESSIONS.
    Any(usize, usize),
    /// A held session whose user has another session in a room, picked by index (a second
    /// tab); any held one when there is none.
    Tab(usize),
}

#[derive(Clone, Debug)]
enum Op {
    Register {
        target: Target,
        gateway: usize,
        ttl: u32,
        with_metadata: bool,
    },
    Renew {
        target: Target,
        generation: Gen,
        ttl: u32,
    },
    Unregister {
        target: Target,
        generation: Gen,
        linger: u32,
    },
    /// One session, or with `all` every session of the target's user.
    Revoke {
        target: Target,
        all: bool,
    },
    /// Indices into USERS; `USERS.len()` stands for an unknown user.
    Snapshot {
        users: Vec<usize>,
    },
    /// Joins a room, or updates the session's metadata there; `metadata` indexes ROOM_METADATA.
    Join {
        target: Target,
        generation: Gen,
        room: RoomPick,
        metadata: usize,
    },
    Leave {
        target: Target,
        generation: Gen,
        room: RoomPick,
    },
    /// Sets or extends (`ttl` 1 to 10000) or clears (0) a signal of KINDS[kind].
    Signal {
        target: Target,
        generation: Gen,
        room: RoomPick,
        kind: usize,
        ttl: u32,
    },
}

/// Which room a room operation names.
#[derive(Clone, Copy, Debug)]
enum RoomPick {
    /// An index into ROOMS.
    Any(usize),
    /// One the target's user is in, picked by index (any room when it is in none): keeps
    /// second tabs, updates, leaves and signals of members common.
    Users(usize),
}

#[derive(Clone, Debug)]
enum Step {
    Op(Op),
    /// Time passes and the expiry driver drains `expire(now)` with this budget.
    Advance {
        by: Tick,
        budget: usize,
    },
    /// Time passes without the driver, then a request touches a user (settle on touch). The
    /// request carries a time read `lag` ms earlier, as from a gateway whose clock read lags:
    /// the store acts at its own latest time instead, for time never goes back in a shard.
    AdvanceThen {
        by: Tick,
        lag: Tick,
        op: Op,
    },
    /// A session sets and clears a signal `times` times in a row, at one time, as a client
    /// flapping its typing indicator does: past the rate bound they are refused (S3).
    SignalFlap {
        target: Target,
        room: RoomPick,
        kind: usize,
        times: u32,
    },
}

fn ttl() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => Just(0),
        1 => Just(MIN_TTL),
        1 => Just(30),
        2 => Just(DEFAULT_TTL),
        3 => Just(MAX_TTL),
        1 => prop_oneof![Just(MIN_TTL - 1), Just(MAX_TTL + 1), Just(1)],
    ]
}

fn generation() -> impl Strategy<Value = Gen> {
    prop_oneof![
        6 => Just(Gen::Current),
        3 => any::<usize>().prop_map(Gen::Older),
        1 => Just(Gen::Newer),
        1 => Just(Gen::Zero),
    ]
}

/// Mostly a held lease for renewals and closes; registers split between new sessions and
/// reconnects.
fn target(held: u32) -> impl Strategy<Value = Target> {
    prop_oneof![
        held => any::<usize>().prop_map(Target::Held),
        10 - held => (0..USERS.len(), 0..SESSIONS.len()).prop_map(|(user, session)| Target::Any(user, session)),
    ]
}

/// Signal TTLs: clears, short ones the sequences outlive, long ones their leases end first,
/// and now and then one above the bound.
fn signal_ttl() -> impl Strategy<Value = u32> {
    prop_oneof![
        3 => Just(0u32),
        3 => 1..=30u32,
        2 => 31..=300u32,
        1 => prop_oneof![1..=10_000u32, Just(10_000)],
        1 => Just(10_001u32),
    ]
}

/// Mostly the current generation: room operations are about rooms, the refusals are few.
fn room_generation() -> impl Strategy<Value = Gen> {
    prop_oneof![12 => Just(Gen::Current), 1 => generation()]
}

/// A room the user is in, `users` times in 5.
fn room_pick(users: u32) -> impl Strategy<Value = RoomPick> {
    prop_oneof![
        5 - users => (0..ROOMS.len()).prop_map(RoomPick::Any),
        users => any::<usize>().prop_map(RoomPick::Users),
    ]
}

/// Half of the joins carry no metadata, the common case.
fn room_metadata_pick() -> impl Strategy<Value = usize> {
    prop_oneof![3 => Just(0usize), 3 => 1..ROOM_METADATA.len()]
}

fn room_op() -> BoxedStrategy<Op> {
    prop_oneof![
        3 => (target(9), room_generation(), room_pick(2), room_metadata_pick())
            .prop_map(|(target, generation, room, metadata)| Op::Join { target, generation, room, metadata }),
        // A second tab joining where its user is, mostly with the same (no) metadata: a count.
        2 => (any::<usize>(), any::<usize>(), prop_oneof![3 => Just(0usize), 1 => 1..ROOM_METADATA.len()]).prop_map(|(tab, room, metadata)| Op::Join {
            target: Target::Tab(tab),
            generation: Gen::Current,
            room: RoomPick::Users(room),
            metadata
        }),
        2 => (target(9), room_generation(), room_pick(4))
            .prop_map(|(target, generation, room)| Op::Leave { target, generation, room }),
        6 => (target(9), room_generation(), room_pick(4), 0..KINDS.len(), signal_ttl())
            .prop_map(|(target, generation, room, kind, ttl)| Op::Signal { target, generation, room, kind, ttl }),
    ]
    .boxed()
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        10 => room_op(),
        6 => (target(4), 0..GATEWAYS.len(), ttl(), prop::bool::weighted(0.2)).prop_map(
            |(target, gateway, ttl, with_metadata)| Op::Register { target, gateway, ttl, with_metadata }
        ),
        6 => (target(8), generation(), ttl())
            .prop_map(|(target, generation, ttl)| Op::Renew { target, generation, ttl }),
        3 => (target(8), generation(), prop_oneof![Just(0u32), Just(5), Just(20), Just(300)])
            .prop_map(|(target, generation, linger)| Op::Unregister { target, generation, linger }),
        1 => (target(8), prop::bool::weighted(0.3)).prop_map(|(target, all)| Op::Revoke { target, all }),
        1 => prop::collection::vec(0..=USERS.len(), 0..6).prop_map(|users| Op::Snapshot { users }),
    ]
}

fn advance() -> impl Strategy<Value = Tick> {
    prop_oneof![
        30 => Just(0u64),
        80 => 1..=20u64,
        30 => 1..=80u64,
        10 => 1..=(3 * u64::from(MAX_TTL)),
        1 => 1..=(1u64 << 32),
    ]
}

/// Where the store's clock starts: the wheel's level boundaries fall differently for each.
fn start() -> impl Strategy<Value = Tick> {
    prop_oneof![
        Just(0u64),
        Just(1_000_000u64),
        Just(1_700_000_000_000u64),
        ((1u64 << 36) - 300)..((1u64 << 36) + 300),
        0..(1u64 << 42),
    ]
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        10 => op().prop_map(Step::Op),
        4 => (advance(), prop_oneof![Just(1usize), 1..4usize, Just(1_000usize)])
            .prop_map(|(by, budget)| Step::Advance { by, budget }),
        2 => (advance(), prop_oneof![3 => Just(0u64), 1 => 1..100u64], op())
            .prop_map(|(by, lag, op)| Step::AdvanceThen { by, lag, op }),
        1 => (target(9), room_pick(4), 0..KINDS.len(), 2..=14u32)
            .prop_map(|(target, room, kind, times)| Step::SignalFlap { target, room, kind, times }),
    ]
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct RefLease {
    generation: u64,
    gateway: usize,
    last_heartbeat_at: Tick,
    expires_at: Tick,
    closing: bool,
    with_metadata: bool,
    /// The session's rooms: the metadata it joined with (an index into ROOM_METADATA) and the
    /// order of its join or last update, which says which session a member shows (R6).
    rooms: BTreeMap<usize, (usize, u64)>,
    /// Its signals by room and kind, with their deadlines (S3).
    signals: BTreeMap<(usize, usize), Tick>,
    /// Its signal rate window: when it started and the set changes counted in it. Kept while
    /// the session is in a room, as the store keeps it.
    rate: Option<(Tick, u32)>,
}

impl RefLease {
    fn new(generation: u64, gateway: usize, now: Tick, expires_at: Tick, with_metadata: bool) -> Self {
        RefLease {
            generation,
            gateway,
            last_heartbeat_at: now,
            expires_at,
            closing: false,
            with_metadata,
            rooms: BTreeMap::new(),
            signals: BTreeMap::new(),
            rate: None,
        }
    }
}

#[derive(Debug, Default)]
struct RefUser {
    leases: BTreeMap<usize, RefLease>,
    online: bool,
    version: u64,
    /// When it last went OFFLINE: forgotten once offline, with no lease, from then for the window.
    offline_since: Tick,
    /// Flap damping holds it ONLINE until then, with no lease (E6).
    grace_until: Option<Tick>,
}

/// A room as the model derives it from the leases.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct RefRoom {
    /// Per member: its sessions in the room and its shown metadata (an index into ROOM_METADATA).
    members: BTreeMap<usize, (u32, usize)>,
    /// Per kind with anyone signalling it: who does.
    signals: BTreeMap<usize, BTreeSet<usize>>,
}

impl RefRoom {
    fn sessions(&self) -> u32 {
        self.members.values().map(|&(sessions, _)| sessions).sum()
    }

    /// The store drops such a room (its access is never set here) and answers version 0.
    fn is_empty(&self) -> bool {
        self.members.is_empty() && self.signals.is_empty()
    }
}

/// A watcher of one room: what the changes published so far say of it.
#[derive(Debug, Default)]
struct Watcher {
    /// The last version published; never reset, so a room that fills again must go on above it.
    version: u64,
    sessions: u32,
    /// Per member, its shown metadata.
    members: BTreeMap<usize, Vec<(String, String)>>,
    signals: BTreeMap<usize, BTreeSet<usize>>,
}

impl RefUser {
    /// When the driver forgets it, if nothing changes meanwhile.
    fn forget_at(&self) -> Option<Tick> {
        (!self.online && self.leases.is_empty()).then_some(self.offline_since + FORGET_AFTER)
    }
}

impl RefUser {
    fn presence(&self) -> Presence {
        Presence::new(if self.online { State::Online } else { State::Offline }, self.version)
    }
}

/// A flip the model expects; the version comes from the store and is checked separately.
#[derive(Debug, PartialEq, Eq)]
struct Flip {
    user: usize,
    state: State,
    deadline: Option<Tick>,
}

struct Harness {
    store: Store,
    now: Tick,
    users: BTreeMap<usize, RefUser>,
    /// Every generation the store issued to a session, in order (kept after the lease is gone).
    issued: BTreeMap<(usize, usize), Vec<u64>>,
    /// The highest version each user ever had, kept after the user is forgotten (M4).
    highest: BTreeMap<usize, u64>,
    /// The store's `offline_grace_ms` (E6).
    grace: Tick,
    /// Registers that found their user held by damping, for `StoreStats::suppressed_flaps`.
    suppressed: u64,
    /// Orders joins and updates of memberships, like the store's stamps.
    joins: u64,
    /// One per room.
    watchers: Vec<Watcher>,
    /// The rooms once the user an operation touches is settled, before it acts.
    settled: Option<Vec<RefRoom>>,
    /// The store's change feed, and what a reader of it holds.
    feed: Arc<FeedIntake>,
    feed_reader: FeedReader,
}

/// A consumer of the change feed: the last position, each user's state and version, each
/// room's occupancy.
#[derive(Debug, Default)]
struct FeedReader {
    position: u64,
    users: BTreeMap<String, Presence>,
    occupied: BTreeMap<String, (bool, u64)>,
}

impl Harness {
    fn new(start: Tick, grace: Tick) -> Self {
        let feed = FeedIntake::new(1 << 16, 0);
        Harness {
            store: Store::new(config(grace), start).unwrap().with_feed(feed.clone()),
            feed,
            feed_reader: FeedReader::default(),
            now: start,
            users: BTreeMap::new(),
            issued: BTreeMap::new(),
            highest: BTreeMap::new(),
            grace,
            suppressed: 0,
            joins: 0,
            watchers: ROOMS.iter().map(|_| Watcher::default()).collect(),
            settled: None,
        }
    }

    fn presence(&self, user: usize) -> Presence {
        self.users.get(&user).map_or(Presence::UNKNOWN, RefUser::presence)
    }

    fn resolve_ttl(ttl: u32) -> Option<u32> {
        match ttl {
            0 => Some(DEFAULT_TTL),
            MIN_TTL..=MAX_TTL => Some(ttl),
            _ => None,
        }
    }

    /// The model's settle: drops expired leases (with their rooms) and signals, and when no
    /// lease is left either holds the user ONLINE until the damping window after the last
    /// deadline ends, or flips it OFFLINE (with that window's end as the deadline).
    fn settle(&mut self, user: usize, flips: &mut Vec<Flip>) {
        let (now, grace) = (self.now, self.grace);
        let Some(u) = self.users.get_mut(&user) else { return };
        let damped = u.grace_until.is_some();
        let mut last_deadline = None;
        u.leases.retain(|_, lease| {
            let live = lease.expires_at > now;
            if !live {
                last_deadline = last_deadline.max(Some(lease.expires_at));
            }
            live
        });
        if let Some(until) = u.grace_until.filter(|&until| until <= now) {
            u.grace_until = None;
            last_deadline = last_deadline.max(Some(until));
        }
        for lease in u.leases.values_mut() {
            lease.signals.retain(|_, deadline| *deadline > now);
        }
        let Some(last_deadline) = last_deadline else { return };
        if u.leases.is_empty() && u.grace_until.is_none() && u.online {
            let window_end = if damped { last_deadline } else { last_deadline + grace };
            if !damped && window_end > now {
                u.grace_until = Some(window_end);
            } else {
                u.online = false;
                u.offline_since = now;
                flips.push(Flip { user, state: State::Offline, deadline: Some(window_end) });
            }
        }
    }

    /// Settles the one user an operation touches, before it acts, and notes the rooms then.
    fn settle_touched(&mut self, user: usize, flips: &mut Vec<Flip>) {
        self.settle(user, flips);
        self.settled = Some(self.rooms());
    }

    /// The live lease a renewal or a room operation names, or why there is none (L2, R6).
    fn named(&mut self, user: usize, session: usize, given: u64) -> Result<&mut RefLease, LeaseError> {
        let not_found = || LeaseError::NotFound { user_id: USERS[user].into(), session_id: SESSIONS[session].into() };
        let lease = self.users.get_mut(&user).and_then(|u| u.leases.get_mut(&session)).ok_or_else(not_found)?;
        if lease.closing || given > lease.generation {
            return Err(not_found());
        }
        if given < lease.generation {
            return Err(LeaseError::StaleGeneration {
                user_id: USERS[user].into(),
                session_id: SESSIONS[session].into(),
                given,
                current: lease.generation,
            });
        }
        Ok(lease)
    }

    /// Whether any session of the user is in the room.
    fn in_room(&self, user: usize, room: usize) -> bool {
        self.users.get(&user).is_some_and(|u| u.leases.values().any(|lease| lease.rooms.contains_key(&room)))
    }

    /// Every room, as the model's leases make it.
    fn rooms(&self) -> Vec<RefRoom> {
        let mut rooms = vec![RefRoom::default(); ROOMS.len()];
        for (&user, u) in &self.users {
            // Per room: sessions, and the most recent join's order and metadata.
            let mut memberships: BTreeMap<usize, (u32, u64, usize)> = BTreeMap::new();
            for lease in u.leases.values() {
                for (&room, &(metadata, order)) in &lease.rooms {
                    let entry = memberships.entry(room).or_insert((0, order, metadata));
                    entry.0 += 1;
                    if order > entry.1 {
                        (entry.1, entry.2) = (order, metadata);
                    }
                }
                for &(room, kind) in lease.signals.keys() {
                    rooms[room].signals.entry(kind).or_default().insert(user);
                }
            }
            for (room, (sessions, _, metadata)) in memberships {
                rooms[room].members.insert(user, (sessions, metadata));
            }
        }
        rooms
    }

    /// Checks the room changes one operation published against the model's rooms before and
    /// after it, and applies them to the watchers, which must then hold the model's rooms.
    ///
    /// An operation first settles the user it touches, then acts: the changes of the settling
    /// (a lease that ran out leaves its rooms) come first, and each phase is checked on its
    /// own, so that a session that expired unnoticed and another that joins at once are a leave
    /// and a join, truthfully, while within a phase a user has at most one member change per room.
    fn take_room_changes(&mut self, before: &[RefRoom], changes: &[RoomChange]) -> TestResult {
        let after = self.rooms();
        let settled = self.settled.take();
        let phases: Vec<&[RefRoom]> = match &settled {
            Some(settled) if settled.as_slice() != before => vec![before, settled, &after],
            _ => vec![before, &after],
        };
        let mut phase = 0;
        let mut member_changes = BTreeSet::new();
        for change in changes {
            let room = index_of(&ROOMS, &change.room_id);
            let mut explained = explains(&phases[phase][room], &phases[phase + 1][room], change);
            if explained.is_err() && phase + 2 < phases.len() {
                phase += 1;
                member_changes.clear();
                explained = explains(&phases[phase][room], &phases[phase + 1][room], change);
            }
            if let Err(why) = explained {
                prop_assert!(false, "{}: {:?} in {:?}", why, change, changes);
            }
            let watcher = &mut self.watchers[room];
            match &change.body {
                RoomEventBody::Member { kind, member } => {
                    let user = index_of(&USERS, &member.user_id);
                    prop_assert!(
                        member_changes.insert((room, user)),
                        "R2: a second member change of {} in {} in one step: {:?}",
                        USERS[user],
                        ROOMS[room],
                        changes
                    );
                    prop_assert!(change.version > watcher.version, "R2: room version does not move: {:?}", change);
                    let metadata = member.metadata.to_vec();
                    let previous = match kind {
                        RoomChangeKind::Left => watcher.members.remove(&user),
                        _ => watcher.members.insert(user, metadata.clone()),
                    };
                    match kind {
                        RoomChangeKind::Joined => prop_assert_eq!(previous, None, "Joined twice"),
                        RoomChangeKind::Left => prop_assert_eq!(previous, Some(metadata), "Left, not shown as it was"),
                        RoomChangeKind::Updated => {
                            prop_assert!(previous.is_some_and(|previous| previous != metadata), "Updated to the same")
                        }
                    }
                }
                RoomEventBody::Sessions => {
                    prop_assert!(
                        watcher.version > 0 && change.version == watcher.version,
                        "R2: {:?} moved the version",
                        change
                    );
                    prop_assert_ne!(change.sessions, watcher.sessions, "R2: a session count that did not change");
                }
                RoomEventBody::Signals { kind, user_ids, count } => {
                    let kind = index_of(&KINDS, kind);
                    prop_assert!(change.version > watcher.version, "S3: room version does not move: {:?}", change);
                    let set: BTreeSet<usize> = user_ids.iter().map(|user| index_of(&USERS, user)).collect();
                    prop_assert_eq!(*count as usize, set.len());
                    let previous = if set.is_empty() {
                        watcher.signals.remove(&kind)
                    } else {
                        watcher.signals.insert(kind, set.clone())
                    };
                    prop_assert_ne!(previous.unwrap_or_default(), set, "S3: a set published again unchanged");
                }
            }
            watcher.version = change.version;
            watcher.sessions = change.sessions;
            prop_assert_eq!(change.users as usize, watcher.members.len(), "users of {:?}", change);
        }
        for (room, (watcher, model)) in self.watchers.iter().zip(&after).enumerate() {
            let members: BTreeMap<usize, Vec<(String, String)>> =
                model.members.iter().map(|(&user, &(_, metadata))| (user, room_metadata(metadata))).collect();
            prop_assert_eq!(&watcher.members, &members, "a watcher's members of {}", ROOMS[room]);
            prop_assert_eq!(watcher.sessions, model.sessions(), "a watcher's sessions of {}", ROOMS[room]);
            prop_assert_eq!(&watcher.signals, &model.signals, "a watcher's signals of {}", ROOMS[room]);
        }
        Ok(())
    }

    /// The version a room operation answers: its room's last published one, or 0 for a room
    /// the store holds nothing about and that did not change.
    fn room_version(&self, room: usize, changes: &[RoomChange]) -> u64 {
        let changed = changes.iter().any(|change| change.room_id == ROOMS[room]);
        if changed || !self.rooms()[room].is_empty() { self.watchers[room].version } else { 0 }
    }

    /// Each room as read, each user's rooms and memberships, against the model.
    fn check_rooms(&self) -> TestResult {
        for (room, model) in self.rooms().iter().enumerate() {
            let view = self.store.room(ROOMS[room], MEMBER_CAP);
            let version = if model.is_empty() { 0 } else { self.watchers[room].version };
            prop_assert_eq!(view.version, version, "version of {}", ROOMS[room]);
            prop_assert_eq!((view.users as usize, view.sessions), (model.members.len(), model.sessions()));
            let mut members: Vec<_> = view
                .members
                .expect("under the cap")
                .into_iter()
                .map(|member| (index_of(&USERS, &member.user_id), (member.sessions, member.metadata.to_vec())))
                .collect();
            members.sort();
            let expected: Vec<_> = model
                .members
                .iter()
                .map(|(&user, &(sessions, metadata))| (user, (sessions, room_metadata(metadata))))
                .collect();
            prop_assert_eq!(members, expected, "R1/R6: members of {}", ROOMS[room]);
            let signals: BTreeMap<usize, BTreeSet<usize>> = view
                .signals
                .iter()
                .map(|(kind, user_ids, count)| {
                    assert_eq!(*count as usize, user_ids.len());
                    (index_of(&KINDS, kind), user_ids.iter().map(|user| index_of(&USERS, user)).collect())
                })
                .collect();
            prop_assert_eq!(&signals, &model.signals, "S3: signals of {}", ROOMS[room]);
            for (user, id) in USERS.iter().enumerate() {
                prop_assert_eq!(self.store.is_member(ROOMS[room], id), model.members.contains_key(&user));
            }
        }
        for (user, id) in USERS.iter().enumerate() {
            let rooms: Vec<&str> =
                (0..ROOMS.len()).filter(|&room| self.in_room(user, room)).map(|room| ROOMS[room]).collect();
            let mut expected = rooms;
            expected.sort_unstable();
            prop_assert_eq!(self.store.rooms_of(id), expected, "rooms of {}", id);
        }
        Ok(())
    }

    /// Compares the changes the store published with the flips the model expects, in order (or
    /// by user, for an expiry drain), and takes the versions: each strictly greater than the
    /// user's previous one.
    fn take_changes(&mut self, mut expected: Vec<Flip>, actual: &[PresenceChange], ordered: bool) -> TestResult {
        let mut actual: Vec<&PresenceChange> = actual.iter().collect();
        if !ordered {
            expected.sort_by_key(|flip| flip.user);
            actual.sort_by(|a, b| a.user_id.cmp(&b.user_id));
        }
        let described: Vec<_> =
            actual.iter().map(|c| (c.user_id.to_string(), c.presence.state, c.deadline, c.at)).collect();
        prop_assert_eq!(actual.len(), expected.len(), "changes {:?}, expected {:?}", described, expected);
        for (change, flip) in actual.iter().zip(&expected) {
            prop_assert_eq!(change.user_id.as_str(), USERS[flip.user]);
            prop_assert_eq!(change.presence.state, flip.state, "{:?} vs {:?}", change, flip);
            prop_assert_eq!(change.deadline, flip.deadline, "{:?} vs {:?}", change, flip);
            prop_assert_eq!(change.at, self.now, "{:?}", change);
            let user = self.users.get_mut(&flip.user).expect("a user that flipped is known");
            prop_assert!(
                change.presence.version > user.version,
                "version {} of {} does not move past {} (M3)",
                change.presence.version,
                USERS[flip.user],
                user.version
            );
            user.version = change.presence.version;
            let highest = self.highest.entry(flip.user).or_default();
            prop_assert!(
                change.presence.version > *highest,
                "version {} of {} is not above {}, which it had before it was forgotten (M4)",
                change.presence.version,
                USERS[flip.user],
                highest
            );
            *highest = change.presence.version;
        }
        // Each flip's version is the user's final one unless the user flipped again later.
        for (index, change) in actual.iter().enumerate() {
            let later = actual[index + 1..].iter().any(|c| c.user_id == change.user_id);
            if !later {
                let user = USERS.iter().position(|u| *u == change.user_id).unwrap();
                prop_assert_eq!(change.presence, self.presence(user), "the last flip is the user's presence");
            }
        }
        Ok(())
    }

    fn resolve(&self, target: Target) -> (usize, usize) {
        match target {
            Target::Any(user, session) => (user, session),
            Target::Held(index) => {
                let held: Vec<(usize, usize)> = self
                    .users
                    .iter()
                    .flat_map(|(&user, u)| u.leases.keys().map(move |&session| (user, session)))
                    .collect();
                if held.is_empty() {
                    (index % USERS.len(), index / USERS.len() % SESSIONS.len())
                } else {
                    held[index % held.len()]
                }
            }
            Target::Tab(index) => {
                let tabs: Vec<(usize, usize)> = self
                    .users
                    .iter()
                    .flat_map(|(&user, u)| {
                        let others_in_a_room = |session: usize| {
                            u.leases.iter().any(|(&other, lease)| other != session && !lease.rooms.is_empty())
                        };
                        u.leases
                            .keys()
                            .filter(move |&&session| others_in_a_room(session))
                            .map(move |&session| (user, session))
                    })
                    .collect();
                if tabs.is_empty() { self.resolve(Target::Held(index)) } else { tabs[index % tabs.len()] }
            }
        }
    }

    fn pick_generation(&self, user: usize, session: usize, pick: Gen) -> u64 {
        let issued = self.issued.get(&(user, session)).map_or(&[][..], Vec::as_slice);
        let current =
            self.users.get(&user).and_then(|u| u.leases.get(&session)).map(|l| l.generation).or(issued.last().copied());
        match pick {
            Gen::Current => current.unwrap_or(1),
            Gen::Older(index) => {
                let older: Vec<u64> = issued.iter().copied().filter(|&g| Some(g) < current).collect();
                if older.is_empty() { 1 } else { older[index % older.len()] }
            }
            Gen::Newer => current.map_or(u64::MAX, |g| g + 1),
            Gen::Zero => 0,
        }
    }

    /// Runs `op` on the store with the time `issued` and on the model at `self.now`, the time
    /// the store acts at (`issued`, or later if a shard's clock is already past it).
    fn apply(&mut self, op: &Op, issued: Tick) -> TestResult {
        let before = self.rooms();
        let mut changes = Changes::default();
        let answered = self.apply_op(op, issued, &mut changes)?;
        self.take_room_changes(&before, &changes.rooms)?;
        self.take_feed(&changes)?;
        if let Some((room, version)) = answered {
            prop_assert_eq!(
                version,
                self.room_version(room, &changes.rooms),
                "the room version answered for {}",
                ROOMS[room]
            );
        }
        Ok(())
    }

    /// [`Harness::apply`] but for the room changes, which it checks once they are all in:
    /// returns the room version a room operation answered, and its room.
    fn apply_op(
        &mut self,
        op: &Op,
        issued: Tick,
        changes: &mut Changes,
    ) -> Result<Option<(usize, u64)>, TestCaseError> {
        let now = self.now;
        let mut flips = Vec::new();
        match *op {
            Op::Register { target, gateway, ttl, with_metadata } => {
                let (user, session) = self.resolve(target);
                let metadata = metadata(with_metadata);
                let registration = Registration {
                    user_id: USERS[user],
                    session_id: SESSIONS[session],
                    gateway_id: GATEWAYS[gateway],
                    ttl_ms: ttl,
                    metadata: &metadata,
                };
                let result = self.store.register(issued, &registration, changes);
                let Some(ttl) = Self::resolve_ttl(ttl) else {
                    return refused_for_ttl(&result, changes).map(|()| None);
                };
                let registered = match result {
                    Ok(registered) => registered,
                    Err(err) => return Err(TestCaseError::fail(format!("register refused: {err:?}"))),
                };
                self.users.entry(user).or_default();
                self.settle_touched(user, &mut flips);
                let u = self.users.get_mut(&user).unwrap();
                // A register within the damping window: no flip at all (E6).
                if u.grace_until.take().is_some() {
                    self.suppressed += 1;
                }
                let replaced = u.leases.contains_key(&session);
                let changed = !u.online;
                if changed {
                    u.online = true;
                    flips.push(Flip { user, state: State::Online, deadline: None });
                }
                let issued = self.issued.entry((user, session)).or_default();
                if let Some(&last) = issued.last() {
                    prop_assert!(
                        registered.generation > last,
                        "L1: generation {} after {}",
                        registered.generation,
                        last
                    );
                }
                issued.push(registered.generation);
                let expires_at = now + u64::from(ttl);
                // A reconnect's new lease is in no room (R6).
                u.leases.insert(session, RefLease::new(registered.generation, gateway, now, expires_at, with_metadata));
                prop_assert_eq!(registered.expires_at, expires_at);
                prop_assert_eq!(registered.changed, changed);
                prop_assert_eq!(registered.replaced, replaced);
                self.take_changes(flips, &changes.users, true)?;
                prop_assert_eq!(registered.presence, self.presence(user));
            }
            Op::Renew { target, generation, ttl } => {
                let (user, session) = self.resolve(target);
                let given = self.pick_generation(user, session, generation);
                let result = self.store.renew(issued, USERS[user], SESSIONS[session], given, ttl, changes);
                let Some(ttl) = Self::resolve_ttl(ttl) else {
                    return refused_for_ttl(&result, changes).map(|()| None);
                };
                self.settle_touched(user, &mut flips);
                let expected = self.named(user, session, given).map(|lease| {
                    lease.expires_at = now + u64::from(ttl);
                    lease.last_heartbeat_at = now;
                    lease.expires_at
                });
                prop_assert_eq!(result.map(|renewed| renewed.expires_at), expected);
                self.take_changes(flips, &changes.users, true)?;
            }
            Op::Unregister { target, generation, linger } => {
                let (user, session) = self.resolve(target);
                let given = self.pick_generation(user, session, generation);
                let result = self.store.unregister(issued, USERS[user], SESSIONS[session], given, linger, changes);
                let result = match result {
                    Ok(result) => result,
                    Err(err) => return Err(TestCaseError::fail(format!("unregister refused: {err:?}"))),
                };
                self.settle_touched(user, &mut flips);
                let (outcome, changed) = match self.users.get_mut(&user) {
                    None => (UnregisterOutcome::NotFound, false),
                    Some(u) => match u.leases.get_mut(&session) {
                        None => (UnregisterOutcome::NotFound, false),
                        Some(lease) if given < lease.generation => {
                            (UnregisterOutcome::StaleGeneration { current: lease.generation }, false)
                        }
                        Some(lease) if given > lease.generation => (UnregisterOutcome::NotFound, false),
                        Some(lease) if linger > 0 => {
                            lease.closing = true;
                            lease.expires_at = lease.expires_at.min(now + u64::from(linger));
                            (UnregisterOutcome::Lingering { until: lease.expires_at }, false)
                        }
                        Some(_) => {
                            u.leases.remove(&session);
                            let last = u.leases.is_empty() && u.online;
                            // The last lease ended by unregister: damped, if damping is on (E6).
                            if last && self.grace > 0 {
                                u.grace_until = Some(now + self.grace);
                            } else if last {
                                u.online = false;
                                u.offline_since = now;
                                flips.push(Flip { user, state: State::Offline, deadline: None });
                            }
                            (UnregisterOutcome::Removed, last && self.grace == 0)
                        }
                    },
                };
                self.take_changes(flips, &changes.users, true)?;
                prop_assert_eq!(result, Unregistered { outcome, changed, presence: self.presence(user) });
            }
            Op::Revoke { target, all } => {
                let (user, session) = self.resolve(target);
                let session = (!all).then_some(session);
                let result = self.store.revoke(issued, USERS[user], session.map(|s| SESSIONS[s]), changes);
                let result = match result {
                    Ok(result) => result,
                    Err(err) => return Err(TestCaseError::fail(format!("revoke refused: {err:?}"))),
                };
                self.settle_touched(user, &mut flips);
                let (count, changed) = match self.users.get_mut(&user) {
                    None => (0, false),
                    Some(u) => {
                        let before = u.leases.len();
                        u.leases.retain(|&s, _| session.is_some_and(|revoked| revoked != s));
                        let count = before - u.leases.len();
                        // Never damped, and it ends a damping that holds the user (E6).
                        let undamped = u.grace_until.take().is_some();
                        let changed = (count > 0 || undamped) && u.leases.is_empty() && u.online;
                        if changed {
                            u.online = false;
                            u.offline_since = now;
                            flips.push(Flip { user, state: State::Offline, deadline: None });
                        }
                        (count as u32, changed)
                    }
                };
                self.take_changes(flips, &changes.users, true)?;
                prop_assert_eq!(result, Revoked { count, changed, presence: self.presence(user) });
            }
            Op::Snapshot { ref users } => {
                let ids: Vec<&str> = users.iter().map(|&u| USERS.get(u).copied().unwrap_or(UNKNOWN_USER)).collect();
                let result = self.store.snapshot(issued, &ids, changes);
                let result = match result {
                    Ok(result) => result,
                    Err(err) => return Err(TestCaseError::fail(format!("snapshot refused: {err:?}"))),
                };
                for &user in users {
                    self.settle(user, &mut flips);
                }
                self.take_changes(flips, &changes.users, true)?;
                let expected: Vec<Presence> = users.iter().map(|&u| self.presence(u)).collect();
                prop_assert_eq!(result, expected, "E2: snapshot of {:?}", ids);
            }
            Op::Join { target, generation, room, metadata } => {
                let (user, session, given, room, at) = self.room_ref(target, generation, room);
                let result = self.store.join(issued, &at, &room_metadata(metadata), changes);
                self.settle_touched(user, &mut flips);
                let joined = !self.in_room(user, room);
                self.joins += 1;
                let order = self.joins;
                let expected = self.named(user, session, given).map(|lease| {
                    lease.rooms.insert(room, (metadata, order));
                    joined
                });
                self.take_changes(flips, &changes.users, true)?;
                return room_answer(result.map(|joined| (joined.changed, joined.room_version)), expected, room);
            }
            Op::Leave { target, generation, room } => {
                let (user, session, given, room, at) = self.room_ref(target, generation, room);
                let result = self.store.leave(issued, &at, changes);
                self.settle_touched(user, &mut flips);
                let removed = self.named(user, session, given).map(|lease| {
                    let removed = lease.rooms.remove(&room).is_some();
                    lease.signals.retain(|&(signal_room, _), _| signal_room != room);
                    if lease.rooms.is_empty() {
                        lease.rate = None;
                    }
                    removed
                });
                let expected = removed.map(|removed| (removed, removed && !self.in_room(user, room)));
                self.take_changes(flips, &changes.users, true)?;
                return room_answer(
                    result.map(|left| ((left.removed, left.changed), left.room_version)),
                    expected,
                    room,
                );
            }
            Op::Signal { target, generation, room, kind, ttl } => {
                let (user, session, given, room, at) = self.room_ref(target, generation, room);
                let result = self.store.signal(issued, &at, KINDS[kind], ttl, changes);
                if ttl > presence_core::MAX_SIGNAL_TTL_MS {
                    return refused_for_ttl(&result, changes).map(|()| None);
                }
                self.settle_touched(user, &mut flips);
                let expected = self.signal(user, session, given, room, kind, ttl);
                self.take_changes(flips, &changes.users, true)?;
                let answered = result.map(|signalled| (signalled.changed, signalled.room_version));
                return room_answer(answered, expected, room);
            }
        }
        Ok(None)
    }

    /// The session a room operation names, the generation it carries, the room, and the reference.
    fn room_ref(
        &self,
        target: Target,
        generation: Gen,
        room: RoomPick,
    ) -> (usize, usize, u64, usize, RoomRef<'static>) {
        let (user, session) = self.resolve(target);
        let room = match room {
            RoomPick::Any(room) => room,
            RoomPick::Users(index) => {
                let rooms: Vec<usize> = (0..ROOMS.len()).filter(|&room| self.in_room(user, room)).collect();
                if rooms.is_empty() { index % ROOMS.len() } else { rooms[index % rooms.len()] }
            }
        };
        let given = self.pick_generation(user, session, generation);
        let at =
            RoomRef { user_id: USERS[user], session_id: SESSIONS[session], generation: given, room_id: ROOMS[room] };
        (user, session, given, room, at)
    }

    /// The model's signal, on a settled user: whether the room's set changed, or why it is refused.
    fn signal(
        &mut self,
        user: usize,
        session: usize,
        given: u64,
        room: usize,
        kind: usize,
        ttl: u32,
    ) -> Result<bool, LeaseError> {
        let now = self.now;
        let others = self.users.get(&user).is_some_and(|u| {
            u.leases.iter().any(|(&other, lease)| other != session && lease.signals.contains_key(&(room, kind)))
        });
        let lease = self.named(user, session, given)?;
        if !lease.rooms.contains_key(&room) {
            return Err(LeaseError::NotInRoom {
                user_id: USERS[user].into(),
                session_id: SESSIONS[session].into(),
                room_id: ROOMS[room].into(),
            });
        }
        let own = lease.signals.contains_key(&(room, kind));
        match (own, ttl) {
            // A renewal: a new deadline (even an earlier one), nothing to publish.
            (true, 1..) => {
                lease.signals.insert((room, kind), now + u64::from(ttl));
                return Ok(false);
            }
            (false, 0) => return Ok(false),
            _ => {}
        }
        // Only a change of the user's part in the set is rationed, in windows of a second
        // from the first change after the last window ended.
        let rate = lease.rate.get_or_insert((now, 0));
        if !others {
            if now >= rate.0 + 1_000 {
                *rate = (now, 0);
            }
            if rate.1 >= SIGNAL_CHANGES_PER_SECOND {
                return Err(LeaseError::SignalRateExceeded {
                    user_id: USERS[user].into(),
                    session_id: SESSIONS[session].into(),
                    per_second: SIGNAL_CHANGES_PER_SECOND,
                });
            }
            rate.1 += 1;
        }
        if own {
            lease.signals.remove(&(room, kind));
        } else {
            lease.signals.insert((room, kind), now + u64::from(ttl));
        }
        Ok(!others)
    }

    /// The expiry driver: drains `expire(now)` with a budget; every due user is settled.
    fn drain(&mut self, budget: usize) -> TestResult {
        let before = self.rooms();
        let mut changes = Changes::default();
        let mut calls = 0;
        while self.store.expire(self.now, budget, &mut changes) {
            calls += 1;
            prop_assert!(calls < 10_000, "expire keeps reporting more work");
        }
        if let Some(next) = self.store.next_deadline() {
            prop_assert!(next > self.now, "a timer is still due at {} after draining: {}", self.now, next);
        }
        let mut flips = Vec::new();
        let users: Vec<usize> = self.users.keys().copied().collect();
        for user in users {
            self.settle(user, &mut flips);
        }
        self.take_changes(flips, &changes.users, false)?;
        self.take_room_changes(&before, &changes.rooms)?;
        self.take_feed(&changes)?;
        // B6: the driver forgot every user whose window ended by now, and only those.
        let now = self.now;
        self.users.retain(|_, u| u.forget_at().is_none_or(|at| at > now));
        Ok(())
    }

    /// F1: drains the feed after one step whose published changes are `changes` (already
    /// checked against the model), and checks it and its reader against the model.
    fn take_feed(&mut self, changes: &Changes) -> TestResult {
        let drained = self.feed.drain(self.now);
        prop_assert_eq!(drained.dropped, None, "the feed dropped entries");
        let reader = &mut self.feed_reader;
        let mut users = Vec::new();
        let mut rooms = Vec::new();
        for entry in &drained.entries {
            prop_assert!(entry.position > reader.position, "F1: a position that does not grow: {:?}", entry);
            reader.position = entry.position;
            match &entry.event {
                FeedEvent::User(change) => {
                    let seen = reader.users.insert(change.user_id.to_string(), change.presence);
                    prop_assert!(
                        seen.is_none_or(|seen| seen.version < change.presence.version),
                        "F1: {:?} after {:?}",
                        change,
                        seen
                    );
                    users.push(change.clone());
                }
                FeedEvent::Room(room) => {
                    let seen = reader.occupied.insert(room.room_id.to_string(), (room.occupied, room.version));
                    prop_assert!(
                        seen.is_none_or(|(occupied, version)| occupied != room.occupied && version < room.version),
                        "F1: {:?} after {:?}",
                        room,
                        seen
                    );
                    rooms.push((room.room_id.clone(), room.occupied, room.version));
                }
                FeedEvent::TakenOver { .. } => prop_assert!(false, "a single store takes no slot over"),
            }
        }
        prop_assert!(drained.through >= reader.position);
        reader.position = drained.through;
        prop_assert_eq!(&users, &changes.users, "F1: the feed's users are the published changes");
        let occupancy: Vec<_> = changes
            .rooms
            .iter()
            .filter_map(|change| match &change.body {
                RoomEventBody::Member { kind: RoomChangeKind::Joined, .. } if change.users == 1 => {
                    Some((change.room_id.clone(), true, change.version))
                }
                RoomEventBody::Member { kind: RoomChangeKind::Left, .. } if change.users == 0 => {
                    Some((change.room_id.clone(), false, change.version))
                }
                _ => None,
            })
            .collect();
        prop_assert_eq!(&rooms, &occupancy, "F1: the feed's rooms are the occupancy changes");
        for (&user, model) in &self.users {
            let fed = self.feed_reader.users.get(USERS[user]).copied().unwrap_or(Presence::UNKNOWN);
            prop_assert_eq!(fed, model.presence(), "F1: {} as the feed has it", USERS[user]);
        }
        for (room, model) in self.rooms().iter().enumerate() {
            let occupied = self.feed_reader.occupied.get(ROOMS[room]).is_some_and(|&(occupied, _)| occupied);
            prop_assert_eq!(occupied, !model.members.is_empty(), "F1: {} occupied as the feed has it", ROOMS[room]);
        }
        Ok(())
    }

    fn total_leases(&self) -> usize {
        self.users.values().map(|u| u.leases.len()).sum()
    }

    /// Everything observable, checked against the model. Reads settle, so the order matters:
    /// counts first, then a snapshot of everyone (which settles them all), then the leases.
    fn check(&mut self, drained: bool) -> TestResult {
        let now = self.now;
        // Stats do not settle: they count the model's leases before settling.
        let stats = self.store.stats();
        let rooms = self.rooms();
        let expected = StoreStats {
            sessions: self.total_leases(),
            online_users: self.users.values().filter(|u| u.online).count(),
            users: self.users.len(),
            suppressed_flaps: self.suppressed,
            rooms: rooms.iter().filter(|room| !room.members.is_empty()).count(),
            room_memberships: rooms.iter().map(|room| room.members.len()).sum(),
        };
        // After a drain the model holds no expired lease, so this is also L4: the store has none
        // left either (stats count leases nobody has settled yet).
        prop_assert_eq!(stats, expected, "stats");
        // A timer exists exactly while a lease, a damping hold or a pending forget does, at or
        // before the earliest of their deadlines and of the signals' (S3: through the wheel).
        let leases = self.users.values().flat_map(|u| u.leases.values());
        let deadlines = leases.flat_map(|l| l.signals.values().copied().chain([l.expires_at]));
        let holds = self.users.values().filter_map(|u| u.grace_until);
        let earliest = deadlines.chain(holds).chain(self.users.values().filter_map(RefUser::forget_at)).min();
        match (self.store.next_deadline(), earliest) {
            (None, None) => {}
            (Some(next), Some(earliest)) => {
                prop_assert!(next <= earliest, "next_deadline {} after the earliest deadline {}", next, earliest)
            }
            (next, earliest) => prop_assert!(false, "next_deadline {:?} with earliest deadline {:?}", next, earliest),
        }

        // The rooms as nobody settled them: after a drain, the wheel ended what had to end.
        self.check_rooms()?;

        // Snapshot of everyone, plus an unknown user.
        let mut ids: Vec<&str> = USERS.to_vec();
        ids.push(UNKNOWN_USER);
        let mut changes = Changes::default();
        let before = self.rooms();
        let snapshot = self.store.snapshot(now, &ids, &mut changes).unwrap();
        if drained {
            prop_assert!(changes.is_empty(), "a read after draining settled something: {:?}", changes);
        }
        let mut flips = Vec::new();
        for user in 0..USERS.len() {
            self.settle(user, &mut flips);
        }
        self.take_changes(flips, &changes.users, true)?;
        self.take_room_changes(&before, &changes.rooms)?;
        self.take_feed(&changes)?;
        self.check_rooms()?;
        for (user, presence) in snapshot.iter().enumerate() {
            prop_assert_eq!(*presence, self.presence(user), "snapshot of {}", ids[user]);
        }

        // M2: online iff a live lease, and the leases are the model's.
        let mut total = 0;
        for (user, id) in USERS.iter().enumerate() {
            let mut changes = Changes::default();
            let mut leases = self.store.leases(now, id, &mut changes).unwrap();
            prop_assert!(changes.is_empty(), "listing leases after a snapshot settled something: {:?}", changes);
            leases.sort_by(|a, b| a.session_id.cmp(&b.session_id));
            let mut expected: Vec<LeaseView> = self
                .users
                .get(&user)
                .map(|u| {
                    u.leases
                        .iter()
                        .map(|(&session, lease)| LeaseView {
                            session_id: SESSIONS[session].into(),
                            gateway_id: GATEWAYS[lease.gateway].into(),
                            generation: lease.generation,
                            last_heartbeat_at: lease.last_heartbeat_at,
                            expires_at: lease.expires_at,
                            closing: lease.closing,
                            metadata: metadata(lease.with_metadata),
                        })
                        .collect()
                })
                .unwrap_or_default();
            expected.sort_by(|a, b| a.session_id.cmp(&b.session_id));
            prop_assert_eq!(&leases, &expected, "leases of {}", id);
            prop_assert!(leases.iter().all(|l| l.expires_at > now), "an expired lease is listed for {}", id);
            let held = self.users.get(&user).is_some_and(|u| u.grace_until.is_some());
            prop_assert_eq!(
                snapshot[user].state == State::Online,
                !leases.is_empty() || held,
                "M2: {} is {:?} with leases {:?}",
                id,
                snapshot[user].state,
                leases
            );
            total += leases.len();
        }
        prop_assert_eq!(snapshot[USERS.len()], Presence::UNKNOWN);
        prop_assert_eq!(self.store.stats().sessions, total);
        Ok(())
    }

    fn run(&mut self, step: &Step) -> TestResult {
        let drained = match step {
            Step::Op(op) => {
                self.apply(op, self.now)?;
                false
            }
            Step::Advance { by, budget } => {
                self.now += by;
                self.drain(*budget)?;
                true
            }
            Step::AdvanceThen { by, lag, op } => {
                // Every shard holding a user was brought to `self.now` by the last check.
                let before = self.now;
                self.now += by;
                let issued = self.now.saturating_sub(*lag);
                let latest = self.now;
                self.now = issued.max(before);
                let result = self.apply(op, issued);
                self.now = latest;
                result?;
                false
            }
            &Step::SignalFlap { target, room, kind, times } => {
                for time in 0..times {
                    let ttl = if time % 2 == 0 { 5_000 } else { 0 };
                    self.apply(&Op::Signal { target, generation: Gen::Current, room, kind, ttl }, self.now)?;
                }
                false
            }
        };
        self.check(drained)
    }
}

type TestResult = Result<(), TestCaseError>;

/// Compares a room operation's answer (and the room version it carries) with the model's, and
/// hands back the version with its room, for [`Harness::apply`] to check once the changes are in.
fn room_answer<A: PartialEq + std::fmt::Debug>(
    answered: Result<(A, u64), LeaseError>,
    expected: Result<A, LeaseError>,
    room: usize,
) -> Result<Option<(usize, u64)>, TestCaseError> {
    let (answer, version) = match answered {
        Ok((answer, version)) => (Ok(answer), Some((room, version))),
        Err(refusal) => (Err(refusal), None),
    };
    prop_assert_eq!(answer, expected, "the answer of a room operation in {}", ROOMS[room]);
    Ok(version)
}

/// Whether a room change is one a watcher may see when the room goes from `was` to `is`: a
/// member change of a user that entered, left, or changed its shown metadata; a set of
/// signalling users that changed; a count of sessions (checked against what came before it).
fn explains(was: &RefRoom, is: &RefRoom, change: &RoomChange) -> Result<(), String> {
    match &change.body {
        RoomEventBody::Member { kind, member } => {
            let user = index_of(&USERS, &member.user_id);
            let (was_in, is_in) = (was.members.get(&user), is.members.get(&user));
            let shown = |member: Option<&(u32, usize)>| member.map(|&(_, metadata)| room_metadata(metadata));
            let (sessions, metadata) = (member.sessions, member.metadata.to_vec());
            let fits = match kind {
                RoomChangeKind::Joined => was_in.is_none() && is_in.is_some_and(|&(n, _)| n == sessions),
                RoomChangeKind::Left => was_in.is_some() && is_in.is_none() && sessions == 0,
                RoomChangeKind::Updated => was_in.is_some() && is_in.is_some() && shown(was_in) != shown(is_in),
            };
            let shows = match kind {
                RoomChangeKind::Left => shown(was_in),
                _ => shown(is_in),
            };
            if !fits || shows != Some(metadata) {
                return Err(format!("R2: no {kind:?} from {was_in:?} to {is_in:?}"));
            }
        }
        RoomEventBody::Sessions => {}
        RoomEventBody::Signals { kind, .. } => {
            let kind = index_of(&KINDS, kind);
            if was.signals.get(&kind) == is.signals.get(&kind) {
                return Err(format!("S3: the set of {} did not change", KINDS[kind]));
            }
        }
    }
    Ok(())
}

/// A request with a TTL outside the bounds is refused naming `ttl_ms`, and settles nothing.
fn refused_for_ttl<T: std::fmt::Debug>(result: &Result<T, LeaseError>, changes: &Changes) -> TestResult {
    prop_assert!(matches!(result, Err(LeaseError::InvalidArgument { field: "ttl_ms", .. })), "{:?}", result);
    prop_assert!(changes.is_empty(), "a refused request settled something: {:?}", changes);
    Ok(())
}

/// Store operations one step stands for: a request, a drain of the expiry driver, or each
/// signal of a flapping session.
fn operations_in(step: &Step) -> u64 {
    match step {
        Step::Op(_) | Step::Advance { .. } | Step::AdvanceThen { .. } => 1,
        Step::SignalFlap { times, .. } => u64::from(*times),
    }
}

/// Runs one random sequence against a fresh store and model, then lets the driver alone take
/// everyone offline and forget them.
fn run_case(start: Tick, grace: Tick, steps: &[Step]) -> TestResult {
    let mut harness = Harness::new(start, grace);
    for step in steps {
        harness.run(step)?;
    }
    // Finally, the driver alone takes everyone offline, one change per online user.
    let online = harness.users.values().filter(|u| u.online).count();
    let versions: BTreeMap<usize, u64> = harness.users.iter().map(|(&user, u)| (user, u.version)).collect();
    harness.run(&Step::Advance { by: u64::from(MAX_TTL) + 1 + grace, budget: 1 })?;
    prop_assert_eq!(
        harness.store.stats(),
        StoreStats {
            sessions: 0,
            online_users: 0,
            users: harness.users.len(),
            suppressed_flaps: harness.suppressed,
            ..StoreStats::default()
        }
    );
    // (Users offline long enough are forgotten by this advance; those that flip are not.)
    let moved = versions.iter().filter(|&(user, v)| harness.users.get(user).is_some_and(|u| u.version != *v)).count();
    prop_assert_eq!(moved, online);
    // And after the forget window, everyone is forgotten and no timer is left (B6).
    harness.run(&Step::Advance { by: FORGET_AFTER, budget: 1 })?;
    prop_assert_eq!(
        harness.store.stats(),
        StoreStats { suppressed_flaps: harness.suppressed, ..StoreStats::default() }
    );
    prop_assert_eq!(harness.store.next_deadline(), None);
    prop_assert!(harness.rooms().iter().all(RefRoom::is_empty));
    Ok(())
}

/// A whole number from the environment, or `default`.
fn from_env(name: &str, default: u64) -> u64 {
    match std::env::var(name) {
        Ok(value) => value.parse().unwrap_or_else(|_| panic!("{name} must be a whole number, got {value:?}")),
        Err(_) => default,
    }
}

/// Cases of the default run: with up to [`DEFAULT_STEPS`] steps each, over a million operations.
const DEFAULT_CASES: u64 = 3_200;
/// The longest sequence of the default run.
const DEFAULT_STEPS: u64 = 500;
/// What every `cargo test` run must cover at least.
const DEFAULT_MIN_OPERATIONS: u64 = 1_000_000;

/// The store against the model over random sequences: `PRESENCE_MODEL_CASES` cases (3,200)
/// of up to `PRESENCE_MODEL_STEPS` steps (500), over a million store operations in all by
/// default; `PRESENCE_MODEL_CASES=300000` is the long mode of over 100 million. A failure is
/// shrunk to a minimal sequence, printed in full, and saved in `proptest-regressions/` so that
/// every later run replays it first.
///
/// The cases are shared among one runner per core, each with a seed of its own: the test is
/// alone in its binary, so one runner would leave every other core idle while it runs.
#[test]
fn store_matches_reference_model() {
    let cases = from_env("PRESENCE_MODEL_CASES", DEFAULT_CASES);
    let max_steps = from_env("PRESENCE_MODEL_STEPS", DEFAULT_STEPS).max(2) as usize;
    let cases_u32 = u32::try_from(cases).expect("PRESENCE_MODEL_CASES fits in 32 bits");
    let config = ProptestConfig {
        source_file: Some(file!()),
        // Relative to the package, where `cargo test` runs the test: beside the other suites' files.
        failure_persistence: Some(Box::new(FileFailurePersistence::Direct("proptest-regressions/model.txt"))),
        ..ProptestConfig::default()
    };
    let runners = std::thread::available_parallelism().map_or(1, |cores| cores.get() as u32).clamp(1, cases_u32.max(1));
    let operations = AtomicU64::new(0);
    let started = std::time::Instant::now();
    let outcomes: Vec<_> = std::thread::scope(|scope| {
        let handles: Vec<_> = (0..runners)
            .map(|runner| {
                let mut config = config.clone();
                // Runner 0 takes the remainder; every runner replays the saved failures first.
                config.cases = cases_u32 / runners + if runner == 0 { cases_u32 % runners } else { 0 };
                if let RngSeed::Fixed(seed) = config.rng_seed {
                    // PROPTEST_RNG_SEED repeats a run: each runner still needs its own sequence.
                    config.rng_seed = RngSeed::Fixed(seed.wrapping_add(u64::from(runner)));
                }
                let operations = &operations;
                scope.spawn(move || {
                    let grace = prop_oneof![2 => Just(0u64), 1 => 1..=60u64, 1 => Just(150u64)];
                    let strategy = (start(), grace, prop::collection::vec(step(), 1..max_steps));
                    TestRunner::new(config).run(&strategy, |(start, grace, steps)| {
                        operations.fetch_add(steps.iter().map(operations_in).sum::<u64>(), Ordering::Relaxed);
                        run_case(start, grace, &steps)
                    })
                })
            })
            .collect();
        handles.into_iter().map(|handle| handle.join().expect("a model runner panicked outside a case")).collect()
    });
    for outcome in outcomes {
        if let Err(error) = outcome {
            // The runner has shrunk the failure: print the minimal sequence whole.
            panic!("the store and the model disagree.\n{error}");
        }
    }
    let operations = operations.into_inner();
    eprintln!(
        "model: {operations} store operations in {cases} cases of up to {max_steps} steps on {runners} runners, {:.1} s",
        started.elapsed().as_secs_f64()
    );
    if cases == DEFAULT_CASES && max_steps as u64 == DEFAULT_STEPS {
        assert!(operations >= DEFAULT_MIN_OPERATIONS, "the default run covers {operations} operations only");
    }
}
