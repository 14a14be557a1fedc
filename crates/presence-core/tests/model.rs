//! Property test: the lease store against a naive reference model, through its public API.
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
//!   too, and every answer still matches.

use std::collections::BTreeMap;

use presence_core::{
    Changes, LeaseError, LeaseView, Presence, PresenceChange, Registration, Revoked, State, Store, StoreConfig,
    StoreStats, Tick, UnregisterOutcome, Unregistered,
};
use proptest::prelude::*;

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

fn config() -> StoreConfig {
    StoreConfig {
        shards: 4,
        min_ttl_ms: MIN_TTL,
        default_ttl_ms: DEFAULT_TTL,
        max_ttl_ms: MAX_TTL,
        min_renew_interval_ms: 0,
        forget_offline_after_ms: FORGET_AFTER,
        offline_grace_ms: 0,
    }
}

fn metadata(with: bool) -> Vec<(String, String)> {
    if with { vec![("device".to_string(), "phone".to_string())] } else { Vec::new() }
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

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
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
}

#[derive(Debug, Default)]
struct RefUser {
    leases: BTreeMap<usize, RefLease>,
    online: bool,
    version: u64,
    /// When it last went OFFLINE: forgotten once offline, with no lease, from then for the window.
    offline_since: Tick,
}

impl RefUser {
    /// When the driver forgets it, if nothing changes meanwhile.
    fn forget_at(&self) -> Option<Tick> {
        (!self.online && self.leases.is_empty()).then_some(self.offline_since + FORGET_AFTER)
    }
}

impl RefUser {
    fn presence(&self) -> Presence {
        Presence { state: if self.online { State::Online } else { State::Offline }, version: self.version }
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
}

impl Harness {
    fn new(start: Tick) -> Self {
        Harness {
            store: Store::new(config(), start).unwrap(),
            now: start,
            users: BTreeMap::new(),
            issued: BTreeMap::new(),
            highest: BTreeMap::new(),
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

    /// The model's settle: drops expired leases, flips OFFLINE when none is left.
    fn settle(&mut self, user: usize, flips: &mut Vec<Flip>) {
        let now = self.now;
        let Some(u) = self.users.get_mut(&user) else { return };
        let mut last_deadline = None;
        u.leases.retain(|_, lease| {
            let live = lease.expires_at > now;
            if !live {
                last_deadline = last_deadline.max(Some(lease.expires_at));
            }
            live
        });
        if last_deadline.is_some() && u.leases.is_empty() && u.online {
            u.online = false;
            u.offline_since = now;
            flips.push(Flip { user, state: State::Offline, deadline: last_deadline });
        }
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
        let now = self.now;
        let mut changes = Changes::default();
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
                let result = self.store.register(issued, &registration, &mut changes);
                let Some(ttl) = Self::resolve_ttl(ttl) else {
                    return refused_for_ttl(&result, &changes);
                };
                let registered = match result {
                    Ok(registered) => registered,
                    Err(err) => return Err(TestCaseError::fail(format!("register refused: {err:?}"))),
                };
                self.users.entry(user).or_default();
                self.settle(user, &mut flips);
                let u = self.users.get_mut(&user).unwrap();
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
                u.leases.insert(
                    session,
                    RefLease {
                        generation: registered.generation,
                        gateway,
                        last_heartbeat_at: now,
                        expires_at,
                        closing: false,
                        with_metadata,
                    },
                );
                prop_assert_eq!(registered.expires_at, expires_at);
                prop_assert_eq!(registered.changed, changed);
                prop_assert_eq!(registered.replaced, replaced);
                self.take_changes(flips, &changes.users, true)?;
                prop_assert_eq!(registered.presence, self.presence(user));
            }
            Op::Renew { target, generation, ttl } => {
                let (user, session) = self.resolve(target);
                let given = self.pick_generation(user, session, generation);
                let result = self.store.renew(issued, USERS[user], SESSIONS[session], given, ttl, &mut changes);
                let Some(ttl) = Self::resolve_ttl(ttl) else {
                    return refused_for_ttl(&result, &changes);
                };
                let not_found =
                    LeaseError::NotFound { user_id: USERS[user].into(), session_id: SESSIONS[session].into() };
                self.settle(user, &mut flips);
                let lease = self.users.get_mut(&user).and_then(|u| u.leases.get_mut(&session));
                let expected = match lease {
                    None => Err(not_found),
                    Some(lease) if lease.closing => Err(not_found),
                    Some(lease) if given < lease.generation => Err(LeaseError::StaleGeneration {
                        user_id: USERS[user].into(),
                        session_id: SESSIONS[session].into(),
                        given,
                        current: lease.generation,
                    }),
                    Some(lease) if given > lease.generation => Err(not_found),
                    Some(lease) => {
                        lease.expires_at = now + u64::from(ttl);
                        lease.last_heartbeat_at = now;
                        Ok(lease.expires_at)
                    }
                };
                prop_assert_eq!(result.map(|renewed| renewed.expires_at), expected);
                self.take_changes(flips, &changes.users, true)?;
            }
            Op::Unregister { target, generation, linger } => {
                let (user, session) = self.resolve(target);
                let given = self.pick_generation(user, session, generation);
                let result = self.store.unregister(issued, USERS[user], SESSIONS[session], given, linger, &mut changes);
                let result = match result {
                    Ok(result) => result,
                    Err(err) => return Err(TestCaseError::fail(format!("unregister refused: {err:?}"))),
                };
                self.settle(user, &mut flips);
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
                            let changed = u.leases.is_empty() && u.online;
                            if changed {
                                u.online = false;
                                u.offline_since = now;
                                flips.push(Flip { user, state: State::Offline, deadline: None });
                            }
                            (UnregisterOutcome::Removed, changed)
                        }
                    },
                };
                self.take_changes(flips, &changes.users, true)?;
                prop_assert_eq!(result, Unregistered { outcome, changed, presence: self.presence(user) });
            }
            Op::Revoke { target, all } => {
                let (user, session) = self.resolve(target);
                let session = (!all).then_some(session);
                let result = self.store.revoke(issued, USERS[user], session.map(|s| SESSIONS[s]), &mut changes);
                let result = match result {
                    Ok(result) => result,
                    Err(err) => return Err(TestCaseError::fail(format!("revoke refused: {err:?}"))),
                };
                self.settle(user, &mut flips);
                let (count, changed) = match self.users.get_mut(&user) {
                    None => (0, false),
                    Some(u) => {
                        let before = u.leases.len();
                        u.leases.retain(|&s, _| session.is_some_and(|revoked| revoked != s));
                        let count = before - u.leases.len();
                        let changed = count > 0 && u.leases.is_empty() && u.online;
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
                let result = self.store.snapshot(issued, &ids, &mut changes);
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
        }
        Ok(())
    }

    /// The expiry driver: drains `expire(now)` with a budget; every due user is settled.
    fn drain(&mut self, budget: usize) -> TestResult {
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
        // B6: the driver forgot every user whose window ended by now, and only those.
        let now = self.now;
        self.users.retain(|_, u| u.forget_at().is_none_or(|at| at > now));
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
        let expected = StoreStats {
            sessions: self.total_leases(),
            online_users: self.users.values().filter(|u| u.online).count(),
            users: self.users.len(),
            ..StoreStats::default()
        };
        // After a drain the model holds no expired lease, so this is also L4: the store has none
        // left either (stats count leases nobody has settled yet).
        prop_assert_eq!(stats, expected, "stats");
        // A timer exists exactly while a lease or a pending forget does, at or before the
        // earliest of their deadlines.
        let leases = self.users.values().flat_map(|u| u.leases.values()).map(|l| l.expires_at);
        let earliest = leases.chain(self.users.values().filter_map(RefUser::forget_at)).min();
        match (self.store.next_deadline(), earliest) {
            (None, None) => {}
            (Some(next), Some(earliest)) => {
                prop_assert!(next <= earliest, "next_deadline {} after the earliest deadline {}", next, earliest)
            }
            (next, earliest) => prop_assert!(false, "next_deadline {:?} with earliest deadline {:?}", next, earliest),
        }

        // Snapshot of everyone, plus an unknown user.
        let mut ids: Vec<&str> = USERS.to_vec();
        ids.push(UNKNOWN_USER);
        let mut changes = Changes::default();
        let snapshot = self.store.snapshot(now, &ids, &mut changes).unwrap();
        if drained {
            prop_assert!(changes.users.is_empty(), "a read after draining settled something: {:?}", changes);
        }
        let mut flips = Vec::new();
        for user in 0..USERS.len() {
            self.settle(user, &mut flips);
        }
        self.take_changes(flips, &changes.users, true)?;
        for (user, presence) in snapshot.iter().enumerate() {
            prop_assert_eq!(*presence, self.presence(user), "snapshot of {}", ids[user]);
        }

        // M2: online iff a live lease, and the leases are the model's.
        let mut total = 0;
        for (user, id) in USERS.iter().enumerate() {
            let mut changes = Changes::default();
            let mut leases = self.store.leases(now, id, &mut changes).unwrap();
            prop_assert!(changes.users.is_empty(), "listing leases after a snapshot settled something: {:?}", changes);
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
            prop_assert_eq!(
                snapshot[user].state == State::Online,
                !leases.is_empty(),
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
        };
        self.check(drained)
    }
}

type TestResult = Result<(), TestCaseError>;

/// A request with a TTL outside the bounds is refused naming `ttl_ms`, and settles nothing.
fn refused_for_ttl<T: std::fmt::Debug>(result: &Result<T, LeaseError>, changes: &Changes) -> TestResult {
    prop_assert!(matches!(result, Err(LeaseError::InvalidArgument { field: "ttl_ms", .. })), "{:?}", result);
    prop_assert!(changes.users.is_empty(), "a refused request settled something: {:?}", changes);
    Ok(())
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    #[test]
    fn store_matches_reference_model(start in start(), steps in prop::collection::vec(step(), 1..150)) {
        let mut harness = Harness::new(start);
        for step in &steps {
            harness.run(step)?;
        }
        // Finally, the driver alone takes everyone offline, one change per online user.
        let online = harness.users.values().filter(|u| u.online).count();
        let versions: BTreeMap<usize, u64> = harness.users.iter().map(|(&user, u)| (user, u.version)).collect();
        harness.run(&Step::Advance { by: u64::from(MAX_TTL) + 1, budget: 1 })?;
        prop_assert_eq!(harness.store.stats(), StoreStats { sessions: 0, online_users: 0, users: harness.users.len(), ..StoreStats::default() });
        // (Users offline long enough are forgotten by this advance; those that flip are not.)
        let moved = versions.iter().filter(|&(user, v)| harness.users.get(user).is_some_and(|u| u.version != *v)).count();
        prop_assert_eq!(moved, online);
        // And after the forget window, everyone is forgotten and no timer is left (B6).
        harness.run(&Step::Advance { by: FORGET_AFTER, budget: 1 })?;
        prop_assert_eq!(harness.store.stats(), StoreStats::default());
        prop_assert_eq!(harness.store.next_deadline(), None);
    }
}
