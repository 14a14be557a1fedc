//! Unit tests of the store: the contract rules and the seed scenarios, on simulated time.
//!
//! Every test drives time by hand (no sleeps) and names the rule it checks. Time never goes
//! back within one test. `drive` plays the expiry driver of the server: it sleeps until
//! [`Store::next_deadline`] and drains [`Store::expire`] there, so a test sees exactly what the
//! driver would publish and when.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

use crate::{
    Changes, Imported, LeaseError, LeaseView, Presence, PresenceChange, Registered, Registration, Revoked, RoomRef,
    ScanTakenFor, SlotSet, StampedRoomFact, State, Store, StoreConfig, StoreStats, Tick, UnregisterOutcome,
    Unregistered,
};

/// A realistic Unix-millisecond start, so that stamps are far from zero.
const T0: Tick = 1_700_000_000_000;
const NO_METADATA: &[(String, String)] = &[];

/// `T0 + seconds`.
fn sec(seconds: u64) -> Tick {
    T0 + seconds * 1_000
}

/// The default configuration: TTL 45 s within [1 s, 1 h], 64 shards.
fn store() -> Store {
    Store::new(StoreConfig::default(), T0).expect("valid config")
}

/// Small TTLs (10/50/200 ms) and 4 shards, so that users share shards.
fn small_config() -> StoreConfig {
    StoreConfig {
        shards: 4,
        min_ttl_ms: 10,
        default_ttl_ms: 50,
        max_ttl_ms: 200,
        min_renew_interval_ms: 0,
        ..StoreConfig::default()
    }
}

fn small_store() -> Store {
    Store::new(small_config(), T0).expect("valid config")
}

fn reg<'a>(user_id: &'a str, session_id: &'a str, gateway_id: &'a str, ttl_ms: u32) -> Registration<'a> {
    Registration { user_id, session_id, gateway_id, ttl_ms, metadata: NO_METADATA }
}

/// Registers and asserts that it succeeded.
fn register(store: &Store, now: Tick, registration: Registration<'_>, changes: &mut Changes) -> Registered {
    store.register(now, &registration, changes).expect("register accepted")
}

/// Drains every expiry due at `now` with the given budget; panics if it never stops.
fn drain(store: &Store, now: Tick, budget: usize) -> Changes {
    let mut changes = Changes::default();
    let mut calls = 0;
    while store.expire(now, budget, &mut changes) {
        calls += 1;
        assert!(calls < 1_000_000, "expire keeps reporting more work at {now}");
    }
    changes
}

/// Plays the driver to the end of the forget window of users that went idle
/// at `last_idle` or before, and checks that it publishes nothing, leaves no
/// user and no timer: nothing but forgetting (B6) was left to do.
fn assert_only_forgets_left(store: &Store, now: Tick, last_idle: Tick) {
    let window = store.config().forget_offline_after_ms;
    assert!(drive(store, now, last_idle + window).is_empty(), "only forgetting was left");
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 0, ..StoreStats::default() });
    assert_eq!(store.next_deadline(), None, "no timer is left behind");
}

/// Plays the expiry driver from `from` to `until`: drain at the current time, sleep to the next
/// deadline the store reports, repeat. Returns what it would have published.
fn drive(store: &Store, from: Tick, until: Tick) -> Changes {
    let mut changes = Changes::default();
    let mut now = from;
    loop {
        let drained = drain(store, now, 64);
        changes.users.extend(drained.users);
        changes.rooms.extend(drained.rooms);
        match store.next_deadline() {
            Some(next) if next <= until => {
                assert!(next > now, "after draining at {now}, next_deadline {next} is not in the future");
                now = next;
            }
            _ => return changes,
        }
    }
}

fn presence(store: &Store, now: Tick, user_id: &str) -> Presence {
    let mut changes = Changes::default();
    let presence = store.snapshot(now, &[user_id], &mut changes).expect("valid id")[0];
    assert!(changes.users.is_empty(), "reading {user_id} at {now} settled something: {changes:?}");
    presence
}

fn leases(store: &Store, now: Tick, user_id: &str) -> Vec<LeaseView> {
    let mut changes = Changes::default();
    let mut leases = store.leases(now, user_id, &mut changes).expect("valid id");
    assert!(changes.users.is_empty(), "listing {user_id} at {now} settled something: {changes:?}");
    leases.sort_by(|a, b| a.session_id.cmp(&b.session_id));
    leases
}

fn online(version: u64) -> Presence {
    Presence::new(State::Online, version)
}

fn offline(version: u64) -> Presence {
    Presence::new(State::Offline, version)
}

/// Asserts one flip: who, which state, when and (for expiries) which deadline.
#[track_caller]
fn assert_flip(change: &PresenceChange, user_id: &str, state: State, at: Tick, deadline: Option<Tick>) {
    assert_eq!(change.user_id, user_id, "{change:?}");
    assert_eq!(change.presence.state, state, "{change:?}");
    assert_eq!(change.at, at, "{change:?}");
    assert_eq!(change.deadline, deadline, "{change:?}");
}

fn field_of<T: std::fmt::Debug>(result: Result<T, LeaseError>) -> &'static str {
    match result {
        Err(LeaseError::InvalidArgument { field, .. }) => field,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Seed 000: user 42, a phone on gateway A and a laptop on gateway B.

/// Timeline 1 (M2, E1, L3): the second device adds nothing visible, and closing one of two
/// devices removes only its lease and changes nothing visible.
#[test]
fn seed000_t1_closing_one_of_two_devices_changes_nothing_visible() {
    let store = store();
    let mut published = Changes::default();

    let phone = register(&store, sec(0), reg("42", "phone", "gw-a", 0), &mut published);
    assert!(phone.changed && !phone.replaced);
    assert_eq!(phone.presence.state, State::Online);
    assert_eq!(published.users.len(), 1);
    assert_flip(&published.users[0], "42", State::Online, sec(0), None);
    assert_eq!(published.users[0].presence, phone.presence);

    let laptop = register(&store, sec(5), reg("42", "laptop", "gw-b", 0), &mut published);
    assert!(!laptop.changed && !laptop.replaced);
    assert_eq!(laptop.presence, phone.presence, "an extra session leaves the version alone (M3)");

    let closed = store.unregister(sec(10), "42", "phone", phone.generation, 0, &mut published).unwrap();
    assert_eq!(closed, Unregistered { outcome: UnregisterOutcome::Removed, changed: false, presence: phone.presence });

    assert_eq!(published.users.len(), 1, "only the first ONLINE is visible: {published:?}");
    assert_eq!(presence(&store, sec(10), "42"), phone.presence);
    let left = leases(&store, sec(10), "42");
    assert_eq!(left.len(), 1);
    assert_eq!((left[0].session_id.as_str(), left[0].gateway_id.as_str()), ("laptop", "gw-b"));
    assert_eq!(left[0].generation, laptop.generation);
    assert!(drive(&store, sec(10), sec(49)).is_empty(), "the laptop lease runs until 50 s");
}

/// Timeline 2 (L4, E1, L5): the phone stops renewing and its lease runs out at 60 s with nothing
/// published; the laptop, renewed every 15 s from 20 s to 95 s, dies silently. Exactly one
/// OFFLINE comes out, from the expiry driver, between the deadline (140 s) and one tick later,
/// and nothing before it.
#[test]
fn seed000_t2_silent_death_of_last_device_gives_exactly_one_offline_from_expire() {
    let store = store();
    let mut published = Changes::default();
    let mut now = sec(0);
    let mut at = |store: &Store, t: Tick, published: &mut Changes| {
        published.users.extend(drive(store, now, t).users);
        now = t;
    };

    let phone = register(&store, sec(0), reg("42", "phone", "gw-a", 0), &mut published);
    at(&store, sec(15), &mut published);
    let renewed = store.renew(sec(15), "42", "phone", phone.generation, 0, &mut published).unwrap();
    assert_eq!(renewed.expires_at, sec(60));
    at(&store, sec(20), &mut published);
    let laptop = register(&store, sec(20), reg("42", "laptop", "gw-b", 0), &mut published);
    assert!(!laptop.changed);
    for t in [35, 50, 65, 80, 95] {
        at(&store, sec(t), &mut published);
        let renewed = store.renew(sec(t), "42", "laptop", laptop.generation, 0, &mut published).unwrap();
        assert_eq!(renewed.expires_at, sec(t + 45));
    }
    // The phone lease ran out at 60 s and the driver collected it without publishing anything
    // (stats do not settle, so this shows the timer did the work, not a read).
    assert_eq!(store.stats(), StoreStats { sessions: 1, online_users: 1, users: 1, ..StoreStats::default() });
    assert_eq!(published.users.len(), 1, "{published:?}");

    // Silence from 95 s: nothing happens up to one tick before the deadline.
    at(&store, sec(140) - 1, &mut published);
    assert_eq!(published.users.len(), 1, "OFFLINE published before the deadline: {published:?}");
    assert_eq!(store.stats().online_users, 1);
    assert!(store.next_deadline().is_some_and(|next| next <= sec(140)), "the driver would sleep past the deadline");

    at(&store, sec(140) + 1, &mut published);
    assert_eq!(published.users.len(), 2, "{published:?}");
    let offline_change = published.users[1].clone();
    assert_eq!(offline_change.user_id, "42");
    assert_eq!(offline_change.presence.state, State::Offline);
    assert_eq!(offline_change.deadline, Some(sec(140)));
    assert!((sec(140)..=sec(140) + 1).contains(&offline_change.at), "lag too large: {offline_change:?}");
    assert!(offline_change.presence.version > published.users[0].presence.version);

    // Two events for two devices and a dozen lease operations; nothing more later.
    at(&store, sec(700), &mut published);
    assert_eq!(published.users.len(), 2);
    assert_eq!(presence(&store, sec(700), "42"), offline_change.presence);
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 1, ..StoreStats::default() });
    // Ten minutes after going offline the user is forgotten (B6), silently.
    at(&store, sec(1_000), &mut published);
    assert_eq!(published.users.len(), 2);
    assert_eq!(presence(&store, sec(1_000), "42"), Presence::UNKNOWN);
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 0, ..StoreStats::default() });
    assert_eq!(store.next_deadline(), None);
}

/// Timeline 3 (L1, L3, L2): the phone reconnects through gateway B with the same session id;
/// the delayed close (and a late heartbeat) of the old socket carries the old generation, is
/// refused as stale, and the user stays online.
#[test]
fn seed000_t3_l3_late_close_after_reconnect_changes_nothing() {
    for linger_ms in [0, 5_000] {
        let store = store();
        let mut published = Changes::default();
        let old = register(&store, sec(0), reg("42", "phone", "gw-a", 0), &mut published);
        let new = register(&store, sec(1), reg("42", "phone", "gw-b", 0), &mut published);
        assert!(new.generation > old.generation, "L1");
        assert!(new.replaced && !new.changed);
        assert_eq!(new.presence, old.presence);
        assert_eq!(new.expires_at, sec(46));

        let late = store.unregister(sec(20), "42", "phone", old.generation, linger_ms, &mut published).unwrap();
        assert_eq!(
            late,
            Unregistered {
                outcome: UnregisterOutcome::StaleGeneration { current: new.generation },
                changed: false,
                presence: new.presence,
            }
        );
        let late_beat = store.renew(sec(21), "42", "phone", old.generation, 0, &mut published);
        assert_eq!(
            late_beat,
            Err(LeaseError::StaleGeneration {
                user_id: "42".into(),
                session_id: "phone".into(),
                given: old.generation,
                current: new.generation,
            })
        );

        assert_eq!(published.users.len(), 1, "only the first ONLINE: {published:?}");
        assert_eq!(presence(&store, sec(21), "42"), new.presence);
        let lease = &leases(&store, sec(21), "42")[0];
        assert_eq!((lease.gateway_id.as_str(), lease.generation), ("gw-b", new.generation));
        assert_eq!((lease.expires_at, lease.closing, lease.last_heartbeat_at), (sec(46), false, sec(1)));
        // The new socket still works.
        assert!(store.renew(sec(30), "42", "phone", new.generation, 0, &mut published).is_ok());
        assert_eq!(published.users.len(), 1);
    }
}

/// Timeline 4 (L6, L2): after a revoke, a renewal of the revoked lease is refused as NotFound
/// and revives nothing.
#[test]
fn seed000_t4_renewal_after_revoke_is_not_found_and_revives_nothing() {
    let store = store();
    let mut published = Changes::default();
    let phone = register(&store, sec(0), reg("42", "phone", "gw-a", 0), &mut published);
    let revoked = store.revoke(sec(10), "42", Some("phone"), &mut published).unwrap();
    assert_eq!(revoked.count, 1);
    assert!(revoked.changed);
    assert_eq!(revoked.presence.state, State::Offline);
    assert!(revoked.presence.version > phone.presence.version);
    assert_eq!(published.users.len(), 2);
    assert_flip(&published.users[1], "42", State::Offline, sec(10), None);
    assert_eq!(published.users[1].presence, revoked.presence);

    let renewal = store.renew(sec(11), "42", "phone", phone.generation, 0, &mut published);
    assert_eq!(renewal, Err(LeaseError::NotFound { user_id: "42".into(), session_id: "phone".into() }));
    assert_eq!(published.users.len(), 2, "{published:?}");
    assert_eq!(presence(&store, sec(11), "42"), revoked.presence);
    assert!(leases(&store, sec(11), "42").is_empty());
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 1, ..StoreStats::default() });
}

// ---------------------------------------------------------------------------------------------
// L1 Register.

#[test]
fn l1_generations_strictly_increase_across_reconnects() {
    let store = small_store();
    let mut changes = Changes::default();
    let mut last = 0;
    // Reconnects within one millisecond, across milliseconds, after a clean close, after a
    // revoke and after an expiry: every generation is greater than all before it.
    let mut now = T0;
    for round in 0..40u64 {
        let r = register(&store, now, reg("u", "s", ["gw-a", "gw-b", "gw-c"][round as usize % 3], 0), &mut changes);
        assert!(r.generation > last, "round {round}: {} <= {last}", r.generation);
        last = r.generation;
        match round % 5 {
            0 => {}
            1 => now += 1,
            2 => {
                store.unregister(now, "u", "s", r.generation, 0, &mut changes).unwrap();
            }
            3 => {
                store.revoke(now, "u", None, &mut changes).unwrap();
            }
            _ => {
                now += 50;
                drain(&store, now, 1);
            }
        }
    }
    // Another session of the same user gets its own, also fresh, generation.
    let other = register(&store, now, reg("u", "t", "gw-a", 0), &mut changes);
    assert!(other.generation > last);
}

#[test]
fn l1_generation_increases_even_when_a_callers_clock_lags() {
    let store = small_store();
    let mut changes = Changes::default();
    let first = register(&store, T0 + 100, reg("u", "s", "gw-a", 0), &mut changes);
    // A second gateway read the clock earlier but took the lock later.
    let second = register(&store, T0 + 90, reg("u", "s", "gw-b", 0), &mut changes);
    assert!(second.generation > first.generation);
    assert!(second.replaced && !second.changed);
    // Time does not go back in the shard: the lease counts from the later time.
    assert_eq!(second.expires_at, T0 + 150);
}

#[test]
fn l1_register_reports_changed_replaced_and_presence() {
    let store = small_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 0), &mut changes);
    assert_eq!((a.changed, a.replaced, a.expires_at), (true, false, T0 + 50));
    let b = register(&store, T0 + 1, reg("u", "b", "gw-a", 10), &mut changes);
    assert_eq!((b.changed, b.replaced, b.expires_at), (false, false, T0 + 11));
    let a2 = register(&store, T0 + 2, reg("u", "a", "gw-b", 200), &mut changes);
    assert_eq!((a2.changed, a2.replaced, a2.expires_at), (false, true, T0 + 202));
    assert_eq!(a.presence, b.presence);
    assert_eq!(a.presence, a2.presence);
    assert_eq!(changes.users.len(), 1);
}

/// L1, E1: a register that finds all of the user's leases expired (nobody ran the driver)
/// first settles them, publishing the OFFLINE that happened at the deadline, and then flips the
/// user ONLINE again: two flips, in order, with increasing versions, and no lease replaced.
#[test]
fn l1_register_after_an_unnoticed_expiry_publishes_offline_then_online() {
    let store = small_store();
    let mut changes = Changes::default();
    let first = register(&store, T0, reg("u", "s", "gw-a", 10), &mut changes);
    changes.users.clear();
    let again = register(&store, T0 + 30, reg("u", "s", "gw-b", 10), &mut changes);
    assert!(again.changed && !again.replaced);
    assert_eq!(changes.users.len(), 2, "{changes:?}");
    assert_flip(&changes.users[0], "u", State::Offline, T0 + 30, Some(T0 + 10));
    assert_flip(&changes.users[1], "u", State::Online, T0 + 30, None);
    assert!(first.presence.version < changes.users[0].presence.version);
    assert!(changes.users[0].presence.version < changes.users[1].presence.version);
    assert_eq!(again.presence, changes.users[1].presence);
    assert!(again.generation > first.generation);
}

/// M1: the lease carries what was registered; a reconnect replaces gateway and metadata.
#[test]
fn m1_lease_view_shows_what_was_registered() {
    let store = small_store();
    let mut changes = Changes::default();
    let metadata = vec![("device".to_string(), "phone".to_string()), ("app".to_string(), "1.2".to_string())];
    let r = store
        .register(
            T0,
            &Registration { user_id: "u", session_id: "s", gateway_id: "gw-a", ttl_ms: 100, metadata: &metadata },
            &mut changes,
        )
        .unwrap();
    assert_eq!(
        leases(&store, T0 + 1, "u"),
        vec![LeaseView {
            session_id: "s".into(),
            gateway_id: "gw-a".into(),
            generation: r.generation,
            last_heartbeat_at: T0,
            expires_at: T0 + 100,
            closing: false,
            metadata: metadata.clone(),
        }]
    );
    store.renew(T0 + 5, "u", "s", r.generation, 20, &mut changes).unwrap();
    let view = &leases(&store, T0 + 6, "u")[0];
    assert_eq!((view.last_heartbeat_at, view.expires_at, view.metadata.len()), (T0 + 5, T0 + 25, 2));
    let r2 = register(&store, T0 + 7, reg("u", "s", "gw-b", 0), &mut changes);
    let view = &leases(&store, T0 + 8, "u")[0];
    assert_eq!(view.gateway_id, "gw-b");
    assert_eq!(view.generation, r2.generation);
    assert!(view.metadata.is_empty());
}

// ---------------------------------------------------------------------------------------------
// L2 Renew.

#[test]
fn l2_renewal_with_current_generation_moves_the_deadline() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 0), &mut changes);
    for (t, ttl, expected) in [(T0 + 10, 0, T0 + 60), (T0 + 20, 200, T0 + 220), (T0 + 30, 10, T0 + 40)] {
        let renewed = store.renew(t, "u", "s", r.generation, ttl, &mut changes).unwrap();
        assert_eq!(renewed.expires_at, expected);
        let lease = &leases(&store, t, "u")[0];
        assert_eq!((lease.expires_at, lease.last_heartbeat_at, lease.generation), (expected, t, r.generation));
    }
    assert_eq!(changes.users.len(), 1, "renewals publish nothing");
}

/// L2, L4: a renewal with a TTL shorter than the time left moves the deadline earlier, and the
/// expiry timer follows it (the driver publishes at the new deadline, not the old one).
#[test]
fn l2_renewal_with_a_shorter_ttl_expires_at_the_new_deadline() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 200), &mut changes);
    store.renew(T0 + 1, "u", "s", r.generation, 10, &mut changes).unwrap();
    assert!(store.next_deadline().is_some_and(|next| next <= T0 + 11));
    assert!(drive(&store, T0 + 1, T0 + 10).is_empty());
    let published = drive(&store, T0 + 10, T0 + 11);
    assert_eq!(published.users.len(), 1, "{published:?}");
    assert_flip(&published.users[0], "u", State::Offline, T0 + 11, Some(T0 + 11));
}

/// L2: the refusals for an unknown, expired, revoked, unregistered or never-issued lease
/// (NotFound) are told apart from the refusal of an older generation (StaleGeneration), and
/// none of them changes the lease or revives anything.
#[test]
fn l2_expired_and_stale_renewals_are_told_apart_and_change_nothing() {
    enum Setup {
        UnknownUser,
        UnknownSession,
        Expired,
        Revoked,
        Unregistered,
        NewerGeneration,
        OlderGeneration,
        ZeroGeneration,
    }
    for (name, setup) in [
        ("unknown user", Setup::UnknownUser),
        ("unknown session", Setup::UnknownSession),
        ("expired", Setup::Expired),
        ("revoked", Setup::Revoked),
        ("unregistered", Setup::Unregistered),
        ("newer generation", Setup::NewerGeneration),
        ("older generation", Setup::OlderGeneration),
        ("zero generation", Setup::ZeroGeneration),
    ] {
        let store = small_store();
        let mut changes = Changes::default();
        let old = register(&store, T0, reg("u", "s", "gw-a", 50), &mut changes);
        let current = register(&store, T0 + 1, reg("u", "s", "gw-a", 50), &mut changes);
        // A second user in the same store must be untouched by all of this.
        register(&store, T0, reg("bystander", "s", "gw-b", 200), &mut changes);
        let (user, session, generation, now) = match setup {
            Setup::UnknownUser => ("nobody", "s", current.generation, T0 + 10),
            Setup::UnknownSession => ("u", "other", current.generation, T0 + 10),
            Setup::Expired => ("u", "s", current.generation, T0 + 51),
            Setup::Revoked => {
                store.revoke(T0 + 5, "u", Some("s"), &mut changes).unwrap();
                ("u", "s", current.generation, T0 + 10)
            }
            Setup::Unregistered => {
                store.unregister(T0 + 5, "u", "s", current.generation, 0, &mut changes).unwrap();
                ("u", "s", current.generation, T0 + 10)
            }
            Setup::NewerGeneration => ("u", "s", current.generation + 1, T0 + 10),
            Setup::OlderGeneration => ("u", "s", old.generation, T0 + 10),
            Setup::ZeroGeneration => ("u", "s", 0, T0 + 10),
        };
        let stale = matches!(setup, Setup::OlderGeneration | Setup::ZeroGeneration);
        let expired = matches!(setup, Setup::Expired);
        // What an observer sees just before, at a time that settles nothing new.
        let before_at = if expired { T0 + 40 } else { now };
        let presence_before = presence(&store, before_at, "u");
        let leases_before = leases(&store, before_at, "u");
        let bystander_before = (presence(&store, before_at, "bystander"), leases(&store, before_at, "bystander"));
        let stats_before = store.stats();

        changes.users.clear();
        let result = store.renew(now, user, session, generation, 200, &mut changes);
        let expected = if stale {
            LeaseError::StaleGeneration {
                user_id: user.into(),
                session_id: session.into(),
                given: generation,
                current: current.generation,
            }
        } else {
            LeaseError::NotFound { user_id: user.into(), session_id: session.into() }
        };
        assert_eq!(result, Err(expected), "{name}");

        if expired {
            // The renewal found the lease expired: it settled it (one OFFLINE, stamped with the
            // deadline) and did not revive it.
            assert_eq!(changes.users.len(), 1, "{name}: {changes:?}");
            assert_flip(&changes.users[0], "u", State::Offline, now, Some(T0 + 51));
            assert!(leases(&store, now, "u").is_empty(), "{name}");
            assert_eq!(presence(&store, now, "u"), changes.users[0].presence, "{name}");
            assert!(changes.users[0].presence.version > presence_before.version);
        } else {
            assert!(changes.users.is_empty(), "{name}: {changes:?}");
            assert_eq!(store.stats(), stats_before, "{name}");
            assert_eq!(presence(&store, now, "u"), presence_before, "{name}");
            assert_eq!(leases(&store, now, "u"), leases_before, "{name}");
        }
        assert_eq!((presence(&store, now, "bystander"), leases(&store, now, "bystander")), bystander_before, "{name}");
    }
}

// ---------------------------------------------------------------------------------------------
// L3 Unregister.

#[test]
fn l3_unregister_of_the_last_lease_flips_offline_once() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 0), &mut changes);
    let u = store.unregister(T0 + 5, "u", "s", r.generation, 0, &mut changes).unwrap();
    assert_eq!(u.outcome, UnregisterOutcome::Removed);
    assert!(u.changed);
    assert_eq!(u.presence.state, State::Offline);
    assert_eq!(changes.users.len(), 2);
    assert_flip(&changes.users[1], "u", State::Offline, T0 + 5, None);
    assert_eq!(changes.users[1].presence, u.presence);
    // The same close delivered twice: nothing more.
    let again = store.unregister(T0 + 6, "u", "s", r.generation, 0, &mut changes).unwrap();
    assert_eq!(again, Unregistered { outcome: UnregisterOutcome::NotFound, changed: false, presence: u.presence });
    assert_eq!(changes.users.len(), 2);
    assert!(drive(&store, T0 + 6, T0 + 1_000).is_empty(), "no timer left behind");
    assert_only_forgets_left(&store, T0 + 1_000, T0 + 5);
}

#[test]
fn l3_unregister_with_an_unknown_or_newer_generation_is_not_found_and_changes_nothing() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 0), &mut changes);
    let before = leases(&store, T0, "u");
    for (user, session, generation, expected_presence) in [
        ("u", "s", r.generation + 1, r.presence),
        ("u", "s", u64::MAX, r.presence),
        ("u", "other", r.generation, r.presence),
        ("nobody", "s", r.generation, Presence::UNKNOWN),
    ] {
        for linger in [0, 20] {
            let u = store.unregister(T0 + 1, user, session, generation, linger, &mut changes).unwrap();
            assert_eq!(
                u,
                Unregistered { outcome: UnregisterOutcome::NotFound, changed: false, presence: expected_presence }
            );
        }
    }
    let stale = store.unregister(T0 + 1, "u", "s", 0, 20, &mut changes).unwrap();
    assert_eq!(stale.outcome, UnregisterOutcome::StaleGeneration { current: r.generation });
    assert_eq!(changes.users.len(), 1);
    assert_eq!(leases(&store, T0 + 1, "u"), before);
}

/// L3: a close with linger keeps the user online until `now + linger`; a re-register of the
/// same session within that time replaces the lease and publishes no OFFLINE/ONLINE pair.
#[test]
fn l3_reregister_within_linger_publishes_no_offline_online_pair() {
    let store = store();
    let mut published = Changes::default();
    let first = register(&store, sec(0), reg("42", "tab", "gw-a", 0), &mut published);
    let closed = store.unregister(sec(10), "42", "tab", first.generation, 3_000, &mut published).unwrap();
    assert_eq!(
        closed,
        Unregistered {
            outcome: UnregisterOutcome::Lingering { until: sec(13) },
            changed: false,
            presence: first.presence
        }
    );
    let view = &leases(&store, sec(10), "42")[0];
    assert!(view.closing);
    assert_eq!(view.expires_at, sec(13));
    published.users.extend(drive(&store, sec(10), sec(12)).users);
    // The page reload comes back through another gateway within the linger.
    let back = register(&store, sec(12), reg("42", "tab", "gw-b", 0), &mut published);
    assert!(back.replaced && !back.changed);
    assert!(back.generation > first.generation);
    assert_eq!(back.presence, first.presence);
    let view = &leases(&store, sec(12), "42")[0];
    assert!(!view.closing);
    assert_eq!(view.expires_at, sec(57));
    published.users.extend(drive(&store, sec(12), sec(56)).users);
    assert_eq!(published.users.len(), 1, "no OFFLINE/ONLINE pair: {published:?}");
    // And the new lease renews normally.
    assert!(store.renew(sec(56), "42", "tab", back.generation, 0, &mut published).is_ok());
    assert_eq!(published.users.len(), 1);
}

/// L3: without a re-register, the lingering lease ends at `now + linger` and the driver
/// publishes exactly one OFFLINE there, not before.
#[test]
fn l3_linger_without_reregister_gives_one_offline_at_now_plus_linger() {
    let store = store();
    let mut published = Changes::default();
    let r = register(&store, sec(0), reg("42", "tab", "gw-a", 0), &mut published);
    store.unregister(sec(10), "42", "tab", r.generation, 3_000, &mut published).unwrap();
    published.users.extend(drive(&store, sec(10), sec(13) - 1).users);
    assert_eq!(published.users.len(), 1, "{published:?}");
    assert_eq!(presence(&store, sec(13) - 1, "42"), r.presence);
    published.users.extend(drive(&store, sec(13) - 1, sec(13) + 1).users);
    assert_eq!(published.users.len(), 2, "{published:?}");
    assert_eq!(published.users[1].presence.state, State::Offline);
    assert_eq!(published.users[1].deadline, Some(sec(13)));
    assert!((sec(13)..=sec(13) + 1).contains(&published.users[1].at));
    published.users.extend(drive(&store, sec(13) + 1, sec(100)).users);
    assert_eq!(published.users.len(), 2);
}

/// L3, L2: a lingering lease accepts no renewal (NotFound, even with its own generation), and
/// the refusal leaves its shortened deadline alone.
#[test]
fn l3_renewal_of_a_lingering_lease_is_not_found() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 0), &mut changes);
    store.unregister(T0 + 5, "u", "s", r.generation, 10, &mut changes).unwrap();
    for generation in [r.generation, 0, r.generation + 1] {
        let renewal = store.renew(T0 + 6, "u", "s", generation, 0, &mut changes);
        assert_eq!(renewal, Err(LeaseError::NotFound { user_id: "u".into(), session_id: "s".into() }));
    }
    let view = &leases(&store, T0 + 6, "u")[0];
    assert_eq!((view.expires_at, view.closing, view.last_heartbeat_at), (T0 + 15, true, T0));
    assert_eq!(changes.users.len(), 1);
}

/// L3: linger only ever shortens a lease; a linger longer than the time left keeps the deadline,
/// and a second close may shorten it further.
#[test]
fn l3_linger_never_extends_a_lease() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 20), &mut changes);
    let u = store.unregister(T0 + 5, "u", "s", r.generation, 1_000_000, &mut changes).unwrap();
    assert_eq!(u.outcome, UnregisterOutcome::Lingering { until: T0 + 20 });
    let u = store.unregister(T0 + 6, "u", "s", r.generation, 4, &mut changes).unwrap();
    assert_eq!(u.outcome, UnregisterOutcome::Lingering { until: T0 + 10 });
    // A close without linger deletes the lingering lease at once.
    let u = store.unregister(T0 + 7, "u", "s", r.generation, 0, &mut changes).unwrap();
    assert_eq!(u.outcome, UnregisterOutcome::Removed);
    assert!(u.changed);
    assert_eq!(changes.users.len(), 2);
}

/// L3 with two devices: lingering the one device and then letting it run out changes nothing
/// visible while the other is live.
#[test]
fn l3_lingering_lease_of_one_device_runs_out_silently_while_another_is_live() {
    let store = small_store();
    let mut published = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 200), &mut published);
    register(&store, T0, reg("u", "b", "gw-b", 200), &mut published);
    store.unregister(T0 + 10, "u", "a", a.generation, 5, &mut published).unwrap();
    published.users.extend(drive(&store, T0 + 10, T0 + 199).users);
    assert_eq!(published.users.len(), 1);
    assert_eq!(store.stats().sessions, 1, "the lingering lease was collected at T0 + 15");
    published.users.extend(drive(&store, T0 + 199, T0 + 201).users);
    assert_eq!(published.users.len(), 2);
    assert_eq!(published.users[1].deadline, Some(T0 + 200));
}

// ---------------------------------------------------------------------------------------------
// L5 TTL bounds.

#[test]
fn l5_ttl_zero_takes_the_default_and_bounds_are_inclusive() {
    let store = small_store();
    let mut changes = Changes::default();
    let mut now = T0;
    for (ttl, expected) in [(0, 50), (10, 10), (200, 200), (123, 123)] {
        let r = register(&store, now, reg("u", "s", "gw-a", ttl), &mut changes);
        assert_eq!(r.expires_at, now + expected, "register ttl {ttl}");
        let renewed = store.renew(now + 1, "u", "s", r.generation, ttl, &mut changes).unwrap();
        assert_eq!(renewed.expires_at, now + 1 + expected, "renew ttl {ttl}");
        now += 2;
    }
}

#[test]
fn l5_ttl_outside_bounds_is_invalid_ttl_ms_and_changes_nothing() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 0), &mut changes);
    changes.users.clear();
    let before = (store.stats(), leases(&store, T0, "u"));
    for ttl in [1, 9, 201, 45_000, u32::MAX] {
        assert_eq!(field_of(store.register(T0 + 1, &reg("u", "s", "gw-b", ttl), &mut changes)), "ttl_ms");
        assert_eq!(field_of(store.register(T0 + 1, &reg("new", "s", "gw-b", ttl), &mut changes)), "ttl_ms");
        assert_eq!(field_of(store.renew(T0 + 1, "u", "s", r.generation, ttl, &mut changes)), "ttl_ms");
    }
    assert!(changes.users.is_empty());
    assert_eq!((store.stats(), leases(&store, T0 + 1, "u")), before);
    assert_eq!(presence(&store, T0 + 1, "new"), Presence::UNKNOWN);
}

// ---------------------------------------------------------------------------------------------
// L6 Revoke.

#[test]
fn l6_revoke_one_session_keeps_the_user_online() {
    let store = small_store();
    let mut changes = Changes::default();
    let phone = register(&store, T0, reg("u", "phone", "gw-a", 0), &mut changes);
    let laptop = register(&store, T0, reg("u", "laptop", "gw-b", 0), &mut changes);
    let revoked = store.revoke(T0 + 1, "u", Some("phone"), &mut changes).unwrap();
    assert_eq!(revoked, Revoked { count: 1, changed: false, presence: phone.presence });
    assert_eq!(changes.users.len(), 1);
    let renewal = store.renew(T0 + 2, "u", "phone", phone.generation, 0, &mut changes);
    assert!(matches!(renewal, Err(LeaseError::NotFound { .. })), "{renewal:?}");
    assert!(store.renew(T0 + 2, "u", "laptop", laptop.generation, 0, &mut changes).is_ok());
    let left = leases(&store, T0 + 2, "u");
    assert_eq!(left.len(), 1);
    assert_eq!(left[0].session_id, "laptop");
    // Revoking a session that is not there changes nothing.
    let none = store.revoke(T0 + 3, "u", Some("phone"), &mut changes).unwrap();
    assert_eq!(none, Revoked { count: 0, changed: false, presence: phone.presence });
    assert_eq!(changes.users.len(), 1);
}

#[test]
fn l6_revoke_all_deletes_every_lease_flips_offline_once_and_blocks_renewals() {
    let store = small_store();
    let mut changes = Changes::default();
    let sessions = ["phone", "laptop", "tab-1"];
    let generations: Vec<u64> = sessions
        .iter()
        .map(|session| register(&store, T0, reg("u", session, "gw-a", 0), &mut changes).generation)
        .collect();
    // One of them lingering still counts as a lease to revoke.
    store.unregister(T0 + 1, "u", "tab-1", generations[2], 30, &mut changes).unwrap();
    register(&store, T0 + 1, reg("bystander", "phone", "gw-a", 0), &mut changes);
    changes.users.clear();

    let revoked = store.revoke(T0 + 2, "u", None, &mut changes).unwrap();
    assert_eq!(revoked.count, 3);
    assert!(revoked.changed);
    assert_eq!(changes.users.len(), 1, "one OFFLINE for three leases: {changes:?}");
    assert_flip(&changes.users[0], "u", State::Offline, T0 + 2, None);
    assert_eq!(changes.users[0].presence, revoked.presence);
    for (session, generation) in sessions.iter().zip(&generations) {
        let renewal = store.renew(T0 + 3, "u", session, *generation, 0, &mut changes);
        assert!(matches!(renewal, Err(LeaseError::NotFound { .. })), "{session}: {renewal:?}");
    }
    let again = store.revoke(T0 + 4, "u", None, &mut changes).unwrap();
    assert_eq!(again, Revoked { count: 0, changed: false, presence: revoked.presence });
    let unknown = store.revoke(T0 + 4, "nobody", None, &mut changes).unwrap();
    assert_eq!(unknown, Revoked { count: 0, changed: false, presence: Presence::UNKNOWN });
    assert_eq!(changes.users.len(), 1);
    assert_eq!(store.stats(), StoreStats { sessions: 1, online_users: 1, users: 2, ..StoreStats::default() });
    assert!(drive(&store, T0 + 4, T0 + 50).is_empty(), "no timer of u left to fire");
    assert_eq!(presence(&store, T0 + 50, "bystander").state, State::Online);
}

/// P7: an erase ends every lease (a restart hold too) and the status, publishing
/// one OFFLINE without a status and the room leaves; forgetting then answers the
/// user as never seen, and a user that comes back gets a version above its old one
/// (M4). An erase of a user never seen, or already erased, does nothing.
#[test]
fn p7_erase_ends_every_lease_and_the_status_publishes_one_offline_and_forgetting_leaves_no_trace() {
    let store = small_store();
    let mut changes = Changes::default();
    let phone = register(&store, T0, reg("u", "phone", "gw-a", 0), &mut changes).generation;
    let laptop = register(&store, T0, reg("u", "laptop", "gw-b", 0), &mut changes).generation;
    store.join(T0, &room("u", "phone", phone, "doc"), &meta("phone"), &mut changes).unwrap();
    store.join(T0, &room("u", "laptop", laptop, "doc"), &meta("laptop"), &mut changes).unwrap();
    store.join(T0, &room("u", "laptop", laptop, "lobby"), &[], &mut changes).unwrap();
    let lunch = crate::Status { availability: crate::Availability::Away, text: "lunch".into(), expires_at: None };
    store.set_status(T0, "u", Some(lunch), &mut changes).unwrap();
    let sessions = store.sessions(T0, "u").unwrap();
    let laptop_view = sessions.iter().find(|session| session.lease.session_id == "laptop").unwrap();
    assert_eq!(laptop_view.rooms, ["doc", "lobby"]);
    assert_eq!(
        laptop_view.room_metadata.iter().map(|entries| entries.to_vec()).collect::<Vec<_>>(),
        [meta("laptop"), vec![]]
    );
    let before = presence(&store, T0, "u").version;
    changes = Changes::default();

    let erased = store.erase(T0 + 1, "u", &mut changes).unwrap();
    assert_eq!(erased, crate::Erased { sessions: 2, rooms: 2, status: true, flipped: true });
    assert_eq!(changes.users.len(), 1, "one change for two sessions and a status: {changes:?}");
    assert_flip(&changes.users[0], "u", State::Offline, T0 + 1, None);
    assert_eq!(changes.users[0].status, None, "the OFFLINE carries no status");
    let mut left: Vec<&str> = changes.rooms.iter().map(|change| change.room_id.as_str()).collect();
    left.sort_unstable();
    assert_eq!(left, ["doc", "lobby"], "one leave per room: {:?}", room_events(&changes));
    assert!(store.sessions(T0 + 1, "u").unwrap().is_empty());
    assert_eq!(store.status_of("u"), None);

    assert!(store.forget_idle(T0 + 2, "u").unwrap());
    assert_eq!(presence(&store, T0 + 2, "u"), Presence::UNKNOWN, "answered as never seen");
    assert_eq!(store.stats().users, 0);
    assert!(drive(&store, T0 + 2, T0 + 10 * 60 * 1_000).is_empty(), "no timer of u left to fire");
    changes = Changes::default();
    assert_eq!(store.erase(T0 + 3, "u", &mut changes).unwrap(), crate::Erased::default());
    assert!(!store.forget_idle(T0 + 3, "u").unwrap());
    assert!(changes.users.is_empty() && changes.rooms.is_empty());
    let again = register(&store, T0 + 4, reg("u", "phone", "gw-a", 0), &mut changes);
    assert!(again.presence.version > before, "versions never go back (M4)");
    // Busy users are not forgotten.
    assert!(!store.forget_idle(T0 + 4, "u").unwrap());
    assert_eq!(presence(&store, T0 + 4, "u").state, State::Online);
}

/// L6, E1: a revoke that finds the leases already expired settles them (one OFFLINE, stamped
/// with the deadline) and then has nothing left to revoke.
#[test]
fn l6_revoke_after_an_unnoticed_expiry_counts_nothing_and_publishes_one_offline() {
    let store = small_store();
    let mut changes = Changes::default();
    register(&store, T0, reg("u", "s", "gw-a", 10), &mut changes);
    changes.users.clear();
    let revoked = store.revoke(T0 + 20, "u", None, &mut changes).unwrap();
    assert_eq!(changes.users.len(), 1);
    assert_flip(&changes.users[0], "u", State::Offline, T0 + 20, Some(T0 + 10));
    assert_eq!(revoked, Revoked { count: 0, changed: false, presence: changes.users[0].presence });
}

// ---------------------------------------------------------------------------------------------
// M3 Per-user version.

#[test]
fn m3_version_moves_only_on_flips() {
    let store = small_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 0), &mut changes);
    let v1 = a.presence.version;
    assert!(v1 > 0);
    let b = register(&store, T0 + 1, reg("u", "b", "gw-b", 0), &mut changes);
    assert_eq!(b.presence.version, v1, "extra session");
    store.renew(T0 + 2, "u", "a", a.generation, 0, &mut changes).unwrap();
    let a2 = register(&store, T0 + 3, reg("u", "a", "gw-c", 0), &mut changes);
    assert_eq!(a2.presence.version, v1, "reconnect");
    let _ = store.renew(T0 + 4, "u", "a", a.generation, 0, &mut changes);
    let stale = store.unregister(T0 + 4, "u", "a", a.generation, 0, &mut changes).unwrap();
    assert_eq!(stale.presence.version, v1, "stale close");
    let linger = store.unregister(T0 + 5, "u", "b", b.generation, 10, &mut changes).unwrap();
    assert_eq!(linger.presence.version, v1, "lingering close");
    drain(&store, T0 + 15, 1);
    assert_eq!(presence(&store, T0 + 15, "u").version, v1, "lingering lease ran out, another is live");
    let revoke_missing = store.revoke(T0 + 16, "u", Some("b"), &mut changes).unwrap();
    assert_eq!(revoke_missing.presence.version, v1);
    assert_eq!(changes.users.len(), 1, "{changes:?}");

    let gone = store.unregister(T0 + 20, "u", "a", a2.generation, 0, &mut changes).unwrap();
    assert!(gone.changed);
    let v2 = gone.presence.version;
    assert!(v2 > v1);
    let back = register(&store, T0 + 20, reg("u", "a", "gw-a", 0), &mut changes);
    let v3 = back.presence.version;
    assert!(v3 > v2, "a flip in the same millisecond still moves the version");
    assert_eq!(changes.users.iter().map(|c| c.presence.version).collect::<Vec<_>>(), vec![v1, v2, v3]);
    // Offline users keep their version.
    store.revoke(T0 + 21, "u", None, &mut changes).unwrap();
    let v4 = changes.users.last().unwrap().presence.version;
    assert!(v4 > v3);
    drain(&store, T0 + 1_000, 1);
    assert_eq!(presence(&store, T0 + 1_000, "u"), offline(v4));
}

// ---------------------------------------------------------------------------------------------
// E1 One event per flip.

/// E1, L4: many users expiring at once, drained with a budget of 1 user per shard per call,
/// give exactly one OFFLINE each; users with a live lease left give none.
#[test]
fn e1_one_event_per_flip_when_many_users_expire_at_once_with_budget_one() {
    let store = small_store();
    let mut changes = Changes::default();
    let users: Vec<String> = (0..50).map(|i| format!("user-{i}")).collect();
    for (i, user) in users.iter().enumerate() {
        register(&store, T0, reg(user, "phone", "gw-a", 20), &mut changes);
        if i % 5 == 0 {
            // A device that outlives the expiry: no OFFLINE.
            register(&store, T0, reg(user, "tab", "gw-c", 100), &mut changes);
        }
    }
    for user in users.iter().step_by(2) {
        // A second device that is also dying at the same time: still one OFFLINE.
        register(&store, T0 + 5, reg(user, "laptop", "gw-b", 15), &mut changes);
    }
    let expected: Vec<&String> = users.iter().enumerate().filter(|(i, _)| i % 5 != 0).map(|(_, u)| u).collect();
    changes.users.clear();
    let shards = store.config().shards;
    let mut calls = 0;
    loop {
        let mut batch = Changes::default();
        let more = store.expire(T0 + 20, 1, &mut batch);
        calls += 1;
        assert!(batch.users.len() <= shards, "budget 1 per shard: call {calls} flipped {}", batch.users.len());
        changes.users.extend(batch.users);
        if !more {
            break;
        }
        assert!(calls <= 1_000);
    }
    assert!(calls >= expected.len() / shards, "{calls} calls");
    let mut flipped: Vec<&str> = changes.users.iter().map(|c| c.user_id.as_str()).collect();
    flipped.sort_unstable();
    let mut expected_sorted: Vec<&str> = expected.iter().map(|u| u.as_str()).collect();
    expected_sorted.sort_unstable();
    assert_eq!(flipped, expected_sorted);
    for change in &changes.users {
        assert_eq!(change.presence.state, State::Offline);
        assert_eq!(change.at, T0 + 20);
        assert_eq!(change.deadline, Some(T0 + 20), "{change:?}");
    }
    // Nothing more when asked again, at the same time or later.
    assert!(drain(&store, T0 + 20, 1).is_empty());
    assert!(drain(&store, T0 + 99, 1).is_empty());
    assert_eq!(store.stats().online_users, 10);
    let last = drain(&store, T0 + 100, 1).users;
    assert_eq!(last.len(), 10);
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 50, ..StoreStats::default() });
}

/// E1: an expiry racing a request on one user publishes one OFFLINE, whichever runs first.
#[test]
fn e1_expiry_racing_a_request_on_one_user_publishes_one_offline() {
    for request_first in [true, false] {
        let store = small_store();
        let mut changes = Changes::default();
        let r = register(&store, T0, reg("u", "s", "gw-a", 10), &mut changes);
        changes.users.clear();
        let refused_renewal = |changes: &mut Changes| {
            let renewal = store.renew(T0 + 10, "u", "s", r.generation, 0, changes);
            assert!(matches!(renewal, Err(LeaseError::NotFound { .. })), "{renewal:?}");
        };
        if request_first {
            refused_renewal(&mut changes);
            changes.users.extend(drain(&store, T0 + 10, 1).users);
        } else {
            changes.users.extend(drain(&store, T0 + 10, 1).users);
            refused_renewal(&mut changes);
        }
        let mut snapshot_changes = Changes::default();
        store.snapshot(T0 + 11, &["u", "u"], &mut snapshot_changes).unwrap();
        assert!(snapshot_changes.users.is_empty());
        assert_eq!(changes.users.len(), 1, "request first: {request_first}: {changes:?}");
        assert_flip(&changes.users[0], "u", State::Offline, T0 + 10, Some(T0 + 10));
    }
}

/// E1: changes are appended to the caller's Vec, never replacing what is in it.
#[test]
fn e1_changes_are_appended_to_the_callers_vec() {
    let store = small_store();
    let mut changes = Changes::default();
    register(&store, T0, reg("a", "s", "gw-a", 0), &mut changes);
    register(&store, T0, reg("b", "s", "gw-a", 0), &mut changes);
    store.revoke(T0 + 1, "a", None, &mut changes).unwrap();
    let users: Vec<(&str, State)> = changes.users.iter().map(|c| (c.user_id.as_str(), c.presence.state)).collect();
    assert_eq!(users, vec![("a", State::Online), ("b", State::Online), ("a", State::Offline)]);
}

/// E1 under real concurrency: four gateway threads and an expiry driver race on the same few
/// users (the gateways with clocks that lag each other). Every flip is published exactly once:
/// ordered by version, each user's changes alternate ONLINE/OFFLINE with no version repeated,
/// and the last one is what a snapshot answers.
#[test]
fn e1_racing_gateways_and_expiry_publish_each_flip_exactly_once() {
    const USERS: [&str; 3] = ["a", "b", "c"];
    const SESSIONS: [&str; 2] = ["s0", "s1"];
    let store = Arc::new(small_store());
    let clock = Arc::new(AtomicU64::new(T0));
    let stop = Arc::new(AtomicBool::new(false));

    let gateways: Vec<_> = (0..4u64)
        .map(|id| {
            let (store, clock) = (Arc::clone(&store), Arc::clone(&clock));
            std::thread::spawn(move || {
                let gateway = ["gw-a", "gw-b", "gw-c", "gw-d"][id as usize];
                let mut seed = 0x9e37_79b9_7f4a_7c15_u64 ^ (id + 1);
                let mut random = move || {
                    seed ^= seed << 13;
                    seed ^= seed >> 7;
                    seed ^= seed << 17;
                    seed
                };
                let mut generations = std::collections::HashMap::new();
                let mut published = Changes::default();
                for _ in 0..3_000 {
                    let now = clock.fetch_add(random() % 2, Ordering::SeqCst);
                    let (user, session) = (USERS[random() as usize % 3], SESSIONS[random() as usize % 2]);
                    let generation = generations.get(&(user, session)).copied().unwrap_or(1);
                    match random() % 8 {
                        0..=2 => {
                            let ttl = [10, 20, 50][random() as usize % 3];
                            let r = store.register(now, &reg(user, session, gateway, ttl), &mut published).unwrap();
                            generations.insert((user, session), r.generation);
                        }
                        3 | 4 => {
                            let _ = store.renew(now, user, session, generation, 0, &mut published);
                        }
                        5 | 6 => {
                            let linger = [0, 5][random() as usize % 2];
                            store.unregister(now, user, session, generation, linger, &mut published).unwrap();
                        }
                        _ => {
                            store.revoke(now, user, (random() % 2 == 0).then_some(session), &mut published).unwrap();
                        }
                    }
                }
                published
            })
        })
        .collect();
    let driver = {
        let (store, clock, stop) = (Arc::clone(&store), Arc::clone(&clock), Arc::clone(&stop));
        std::thread::spawn(move || {
            let mut published = Changes::default();
            while !stop.load(Ordering::SeqCst) {
                while store.expire(clock.load(Ordering::SeqCst), 2, &mut published) {}
                std::thread::yield_now();
            }
            published
        })
    };
    let users = gateways.into_iter().flat_map(|gateway| gateway.join().unwrap().users).collect();
    let mut published = Changes { users, ..Changes::default() };
    stop.store(true, Ordering::SeqCst);
    published.users.extend(driver.join().unwrap().users);
    let end = clock.load(Ordering::SeqCst) + 1_000;
    published.users.extend(drain(&store, end, 2).users);
    assert_eq!(store.stats().online_users, 0);

    for user in USERS {
        let mut flips: Vec<Presence> =
            published.users.iter().filter(|c| c.user_id == user).map(|c| c.presence).collect();
        flips.sort_by_key(|presence| presence.version);
        assert!(flips.len() > 10, "{user}: too few flips to mean anything ({})", flips.len());
        for (index, pair) in flips.windows(2).enumerate() {
            assert!(pair[0].version < pair[1].version, "{user}: version {} published twice", pair[0].version);
            assert_ne!(pair[0].state, pair[1].state, "{user}: two {:?} in a row at flip {index}", pair[0].state);
        }
        assert_eq!(flips[0].state, State::Online, "{user}");
        assert_eq!(presence(&store, end, user), *flips.last().unwrap(), "{user}");
    }
}

// ---------------------------------------------------------------------------------------------
// E2 Snapshot.

#[test]
fn e2_snapshot_answers_unknown_users_offline_version_zero_in_request_order() {
    let store = small_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("a", "s", "gw-a", 0), &mut changes);
    let b = register(&store, T0, reg("b", "s", "gw-a", 10), &mut changes);
    let c = register(&store, T0, reg("c", "s", "gw-a", 0), &mut changes);
    store.revoke(T0 + 1, "c", None, &mut changes).unwrap();
    let c_offline = changes.users.last().unwrap().presence;
    assert!(c_offline.version > c.presence.version);
    changes.users.clear();
    assert_eq!(Presence::UNKNOWN, offline(0));

    // At T0 + 10, b's lease has just run out and nobody has collected it: the snapshot settles it.
    let requested = ["nobody", "c", "a", "b", "a", "nobody-else", "b"];
    let snapshot = store.snapshot(T0 + 10, &requested, &mut changes).unwrap();
    assert_eq!(changes.users.len(), 1, "{changes:?}");
    assert_flip(&changes.users[0], "b", State::Offline, T0 + 10, Some(T0 + 10));
    let b_offline = changes.users[0].presence;
    assert!(b_offline.version > b.presence.version);
    assert_eq!(
        snapshot,
        vec![Presence::UNKNOWN, c_offline, a.presence, b_offline, a.presence, Presence::UNKNOWN, b_offline]
    );
    assert_eq!(a.presence, online(a.presence.version));
    // Asking about unknown users creates no records.
    assert_eq!(store.stats().users, 3);
    assert!(store.snapshot::<&str>(T0 + 10, &[], &mut changes).unwrap().is_empty());
    // Owned strings work too.
    let owned = vec!["a".to_string()];
    assert_eq!(store.snapshot(T0 + 10, &owned, &mut changes).unwrap(), vec![a.presence]);
}

// ---------------------------------------------------------------------------------------------
// B1 Bad input.

/// B1: for every operation, an empty or 129-byte id is refused with InvalidArgument naming the
/// field, before anything is touched: no settle (even past a deadline), no change, no record,
/// the shard's clock untouched, every lease and presence as before.
#[test]
fn b1_invalid_ids_name_the_field_and_leave_all_earlier_state_intact() {
    type Op = Box<dyn Fn(&Store, Tick, &mut Changes) -> Result<(), LeaseError>>;
    fn op(f: impl Fn(&Store, Tick, &mut Changes) -> Result<(), LeaseError> + 'static) -> Op {
        Box::new(f)
    }
    let long = "x".repeat(129);
    let long_utf8 = "€".repeat(43); // 129 bytes, 43 characters
    assert_eq!(long_utf8.len(), 129);
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "s", "gw-a", 10), &mut changes);
    register(&store, T0, reg("v", "s", "gw-b", 200), &mut changes);
    let generation = r.generation;

    let mut cases: Vec<(String, &'static str, Op)> = Vec::new();
    for bad in [String::new(), long.clone(), long_utf8.clone()] {
        let label = |op: &str| format!("{op} with {} bytes", bad.len());
        let b = bad.clone();
        cases.push((
            label("register user_id"),
            "user_id",
            op(move |s, t, c| s.register(t, &reg(&b, "s", "gw-a", 0), c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("register session_id"),
            "session_id",
            op(move |s, t, c| s.register(t, &reg("u", &b, "gw-a", 0), c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("register gateway_id"),
            "gateway_id",
            op(move |s, t, c| s.register(t, &reg("u", "s", &b, 0), c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("renew user_id"),
            "user_id",
            op(move |s, t, c| s.renew(t, &b, "s", generation, 0, c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("renew session_id"),
            "session_id",
            op(move |s, t, c| s.renew(t, "u", &b, generation, 0, c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("unregister user_id"),
            "user_id",
            op(move |s, t, c| s.unregister(t, &b, "s", generation, 0, c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("unregister session_id"),
            "session_id",
            op(move |s, t, c| s.unregister(t, "u", &b, generation, 5, c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((label("revoke user_id"), "user_id", op(move |s, t, c| s.revoke(t, &b, None, c).map(drop))));
        let b = bad.clone();
        cases.push((
            label("revoke session_id"),
            "session_id",
            op(move |s, t, c| s.revoke(t, "u", Some(&b), c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((
            label("snapshot user_ids"),
            "user_ids",
            op(move |s, t, c| s.snapshot(t, &["v", "u", b.as_str()], c).map(drop)),
        ));
        let b = bad.clone();
        cases.push((label("leases user_id"), "user_id", op(move |s, t, c| s.leases(t, &b, c).map(drop))));
    }
    // A bad field after good ones, and a bad TTL or metadata together with good ids.
    let too_much: Vec<(String, String)> = (0..17).map(|i| (format!("k{i}"), "v".to_string())).collect();
    cases.push((
        "register metadata".into(),
        "metadata",
        op(move |s, t, c| {
            s.register(
                t,
                &Registration { user_id: "u", session_id: "s", gateway_id: "gw-a", ttl_ms: 0, metadata: &too_much },
                c,
            )
            .map(drop)
        }),
    ));
    cases.push((
        "register ttl_ms".into(),
        "ttl_ms",
        op(|s, t, c| s.register(t, &reg("u", "s", "gw-a", 5), c).map(drop)),
    ));

    let before_stats = store.stats();
    let before_deadline = store.next_deadline();
    let observe = |s: &Store| {
        let mut c = Changes::default();
        let snapshot = s.snapshot(T0 + 1, &["u", "v", "w"], &mut c).unwrap();
        let u = s.leases(T0 + 1, "u", &mut c).unwrap();
        let v = s.leases(T0 + 1, "v", &mut c).unwrap();
        assert!(c.users.is_empty());
        (snapshot, u, v)
    };
    let state_before = observe(&store);
    for (name, field, op) in &cases {
        // Well past u's deadline (T0 + 10): a refusal must not settle it.
        let mut op_changes = Changes::default();
        let result = op(&store, T0 + 100, &mut op_changes);
        match result {
            Err(LeaseError::InvalidArgument { field: got, reason }) => {
                assert_eq!(got, *field, "{name}: {reason}");
                assert!(!reason.is_empty(), "{name}");
                if *field == "user_ids" {
                    assert!(reason.contains("entry 2"), "{name}: the reason names the entry: {reason}");
                }
            }
            other => panic!("{name}: expected InvalidArgument({field}), got {other:?}"),
        }
        assert!(op_changes.users.is_empty(), "{name}: {op_changes:?}");
        assert_eq!(store.stats(), before_stats, "{name}");
        assert_eq!(store.next_deadline(), before_deadline, "{name}");
    }
    // Read at T0 + 1: had any refused request reached a shard, its clock would read T0 + 100.
    assert_eq!(observe(&store), state_before);
    assert_eq!(state_before.0[2], Presence::UNKNOWN);
    // The refusals did not block anything: u's lease now expires normally.
    let published = drain(&store, T0 + 100, 1);
    assert_eq!(published.users.len(), 1);
    assert_flip(&published.users[0], "u", State::Offline, T0 + 100, Some(T0 + 10));
}

#[test]
fn b1_ids_of_exactly_128_bytes_are_accepted() {
    let store = small_store();
    let mut changes = Changes::default();
    let user = "u".repeat(128);
    let session = "é".repeat(64); // 128 bytes
    let gateway = "g".repeat(128);
    let r = register(&store, T0, reg(&user, &session, &gateway, 0), &mut changes);
    assert!(r.changed);
    store.renew(T0 + 1, &user, &session, r.generation, 0, &mut changes).unwrap();
    let view = &leases(&store, T0 + 1, &user)[0];
    assert_eq!((view.session_id.as_str(), view.gateway_id.as_str()), (session.as_str(), gateway.as_str()));
    assert_eq!(store.snapshot(T0 + 1, &[&user], &mut changes).unwrap(), vec![r.presence]);
    assert_eq!(store.revoke(T0 + 2, &user, Some(&session), &mut changes).unwrap().count, 1);
}

// ---------------------------------------------------------------------------------------------
// L4 Expiry driver support.

/// L4: an operation that schedules a deadline earlier than the driver's alarm wakes the driver;
/// one that schedules nothing new, or a later (or equal) deadline, does not.
#[test]
fn l4_expiry_waker_is_called_only_for_deadlines_earlier_than_the_alarm() {
    let wakes = Arc::new(AtomicUsize::new(0));
    let counter = Arc::clone(&wakes);
    let store = small_store().with_expiry_waker(move || {
        counter.fetch_add(1, Ordering::SeqCst);
    });
    let woken = || wakes.load(Ordering::SeqCst);
    let mut changes = Changes::default();

    // No alarm set yet (u64::MAX): any new timer wakes the driver.
    let a = register(&store, T0, reg("a", "s", "gw-a", 100), &mut changes);
    assert_eq!(woken(), 1, "first timer");

    // The driver now sleeps until T0 + 100.
    store.set_alarm(T0 + 100);
    register(&store, T0, reg("b", "s", "gw-a", 150), &mut changes);
    assert_eq!(woken(), 1, "later deadline");
    register(&store, T0, reg("c", "s", "gw-a", 100), &mut changes);
    assert_eq!(woken(), 1, "deadline equal to the alarm");
    store.renew(T0 + 1, "a", "s", a.generation, 200, &mut changes).unwrap();
    assert_eq!(woken(), 1, "a renewal that moves the deadline later schedules nothing");
    register(&store, T0 + 1, reg("a", "t", "gw-a", 10), &mut changes);
    assert_eq!(woken(), 2, "a second session with an earlier deadline than the alarm");
    store.set_alarm(T0 + 11);
    register(&store, T0 + 2, reg("a", "u", "gw-a", 10), &mut changes);
    assert_eq!(woken(), 2, "a second session whose deadline is after the user's timer");
    let _ = store.snapshot(T0 + 2, &["a", "b", "c", "nobody"], &mut changes);
    let _ = store.leases(T0 + 2, "a", &mut changes);
    assert_eq!(woken(), 2, "reads schedule nothing");

    register(&store, T0 + 2, reg("d", "s", "gw-a", 200), &mut changes);
    assert_eq!(woken(), 2);
    let d = leases(&store, T0 + 2, "d")[0].generation;
    store.renew(T0 + 3, "d", "s", d, 10, &mut changes).unwrap();
    assert_eq!(woken(), 2, "renewal to T0 + 13, after the alarm");
    store.renew(T0 + 4, "d", "s", d, 0, &mut changes).unwrap();
    store.unregister(T0 + 5, "d", "s", d, 3, &mut changes).unwrap();
    assert_eq!(woken(), 3, "a linger that moves the deadline (T0 + 8) before the alarm");
    store.unregister(T0 + 5, "b", "s", 0, 1, &mut changes).unwrap();
    assert_eq!(woken(), 3, "a stale close schedules nothing");
}

#[test]
fn l4_next_deadline_is_none_without_leases_and_never_after_the_earliest_deadline() {
    let store = small_store();
    let mut changes = Changes::default();
    assert_eq!(store.next_deadline(), None);
    let r = register(&store, T0, reg("a", "s", "gw-a", 200), &mut changes);
    assert!(store.next_deadline().is_some_and(|next| next <= T0 + 200));
    register(&store, T0 + 3, reg("b", "s", "gw-a", 17), &mut changes);
    assert!(store.next_deadline().is_some_and(|next| next <= T0 + 20));
    store.unregister(T0 + 4, "a", "s", r.generation, 0, &mut changes).unwrap();
    assert!(store.next_deadline().is_some_and(|next| next <= T0 + 20));
    store.revoke(T0 + 5, "b", None, &mut changes).unwrap();
    assert!(store.next_deadline().is_some_and(|next| next > T0 + 200), "only forget entries are left");
    assert_only_forgets_left(&store, T0 + 5, T0 + 5);
}

/// L4, E1: 10 000 users whose leases all end in the same millisecond are drained with a small
/// budget, each call bounded, into exactly 10 000 OFFLINE changes stamped with the deadline.
#[test]
fn l4_mass_expiry_of_10_000_users_at_one_ms_drains_fully_with_a_small_budget() {
    const USERS: usize = 10_000;
    const BUDGET: usize = 16;
    let store = store();
    let shards = store.config().shards;
    let mut changes = Changes::default();
    for i in 0..USERS {
        register(&store, T0, reg(&format!("user-{i}"), "s", "gw-a", 1_000), &mut changes);
    }
    assert_eq!(changes.users.len(), USERS);
    assert_eq!(
        store.stats(),
        StoreStats { sessions: USERS, online_users: USERS, users: USERS, ..StoreStats::default() }
    );
    assert!(drain(&store, T0 + 999, BUDGET).is_empty());

    let mut expired = Vec::new();
    let mut calls = 0;
    loop {
        let mut batch = Changes::default();
        let more = store.expire(T0 + 1_000, BUDGET, &mut batch);
        calls += 1;
        assert!(batch.users.len() <= BUDGET * shards, "call {calls} did {} flips", batch.users.len());
        expired.extend(batch.users);
        if !more {
            break;
        }
        assert!(calls < 100_000);
    }
    assert!(calls >= USERS / (BUDGET * shards), "{calls} calls");
    assert_eq!(expired.len(), USERS);
    let mut users: Vec<&str> = expired.iter().map(|c| c.user_id.as_str()).collect();
    users.sort_unstable();
    users.dedup();
    assert_eq!(users.len(), USERS, "one OFFLINE per user");
    for change in &expired {
        assert_eq!(change.presence.state, State::Offline);
        assert_eq!(change.deadline, Some(T0 + 1_000), "{change:?}");
        assert_eq!(change.at, T0 + 1_000);
    }
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: USERS, ..StoreStats::default() });
    assert!(store.next_deadline().is_some_and(|next| next > T0 + 2_000), "only forget entries are left");
    assert!(drain(&store, T0 + 2_000, BUDGET).is_empty());
    assert_only_forgets_left(&store, T0 + 2_000, T0 + 1_000);
}

/// L4: a timer placed at the first of a user's deadlines fires, finds the other lease still
/// live, and is moved to it: the second lease's end is published on time too.
#[test]
fn l4_expiry_reschedules_the_timer_at_the_next_remaining_deadline() {
    let store = small_store();
    let mut changes = Changes::default();
    let r = register(&store, T0, reg("u", "short", "gw-a", 10), &mut changes);
    register(&store, T0, reg("u", "long", "gw-a", 200), &mut changes);
    // Renewing the short lease past the long one leaves the timer at T0 + 10 (renewals do not
    // touch the wheel): the timer fires early, finds both live, and moves on.
    store.renew(T0 + 5, "u", "short", r.generation, 200, &mut changes).unwrap();
    changes.users.clear();
    assert!(drive(&store, T0 + 5, T0 + 199).is_empty());
    assert_eq!(store.stats().sessions, 2);
    let published = drive(&store, T0 + 199, T0 + 206);
    assert_eq!(published.users.len(), 1, "{published:?}");
    assert_flip(&published.users[0], "u", State::Offline, T0 + 205, Some(T0 + 205));
}

// ---------------------------------------------------------------------------------------------
// Stats.

#[test]
fn stats_count_sessions_online_users_and_known_users() {
    let store = small_store();
    let mut changes = Changes::default();
    assert_eq!(store.stats(), StoreStats::default());
    let a = register(&store, T0, reg("a", "phone", "gw-a", 10), &mut changes);
    register(&store, T0, reg("a", "laptop", "gw-b", 100), &mut changes);
    register(&store, T0, reg("b", "phone", "gw-a", 10), &mut changes);
    let c = register(&store, T0, reg("c", "phone", "gw-c", 200), &mut changes);
    register(&store, T0, reg("c", "phone", "gw-a", 200), &mut changes); // a reconnect adds no lease
    assert_eq!(store.stats(), StoreStats { sessions: 4, online_users: 3, users: 3, ..StoreStats::default() });

    store.unregister(T0 + 1, "a", "phone", a.generation, 5, &mut changes).unwrap();
    assert_eq!(
        store.stats(),
        StoreStats { sessions: 4, online_users: 3, users: 3, ..StoreStats::default() },
        "a lingering lease counts"
    );
    let _ = store.unregister(T0 + 1, "c", "phone", c.generation, 0, &mut changes);
    assert_eq!(
        store.stats(),
        StoreStats { sessions: 4, online_users: 3, users: 3, ..StoreStats::default() },
        "stale close"
    );

    // Expired but not yet collected leases still count, until something settles them.
    assert_eq!(store.stats(), StoreStats { sessions: 4, online_users: 3, users: 3, ..StoreStats::default() });
    drain(&store, T0 + 10, 1);
    assert_eq!(store.stats(), StoreStats { sessions: 2, online_users: 2, users: 3, ..StoreStats::default() });
    store.revoke(T0 + 11, "c", None, &mut changes).unwrap();
    assert_eq!(store.stats(), StoreStats { sessions: 1, online_users: 1, users: 3, ..StoreStats::default() });
    let _ = store.snapshot(T0 + 11, &["x", "y"], &mut changes);
    let _ = store.renew(T0 + 11, "z", "s", 1, 0, &mut changes);
    let _ = store.unregister(T0 + 11, "z", "s", 1, 0, &mut changes);
    let _ = store.revoke(T0 + 11, "z", None, &mut changes);
    assert_eq!(store.stats().users, 3, "requests about unknown users create no records");
    drain(&store, T0 + 100, 1);
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 3, ..StoreStats::default() });
}

/// L7: renewals within the minimum interval are acknowledged without a write.
#[test]
fn l7_renewals_within_the_minimum_interval_are_acknowledged_without_a_write() {
    let config = StoreConfig { min_renew_interval_ms: 5_000, ..StoreConfig::default() };
    let store = Store::new(config, T0).unwrap();
    let mut changes = Changes::default();
    let lease = register(&store, T0, reg("u42", "phone", "gw-a", 45_000), &mut changes);

    // A chatty client renews every second: only one renewal per 5 s reaches the lease.
    for second in 1..5 {
        let renewed = store.renew(sec(second), "u42", "phone", lease.generation, 45_000, &mut changes).unwrap();
        assert!(renewed.throttled, "renewal at {second} s");
        assert_eq!(renewed.expires_at, sec(45), "a throttled renewal leaves the deadline where the write put it");
        assert_eq!(leases(&store, sec(second), "u42")[0].last_heartbeat_at, T0);
    }
    let written = store.renew(sec(5), "u42", "phone", lease.generation, 45_000, &mut changes).unwrap();
    assert!(!written.throttled);
    assert_eq!(written.expires_at, sec(50));
    assert_eq!(leases(&store, sec(5), "u42")[0].last_heartbeat_at, sec(5));
    let again = store.renew(sec(6), "u42", "phone", lease.generation, 45_000, &mut changes).unwrap();
    assert!(again.throttled);
    assert_eq!(again.expires_at, sec(50));

    // The throttle never hides a rejection: a stale or unknown lease is refused as ever.
    let stale = store.renew(sec(6), "u42", "phone", lease.generation - 1, 45_000, &mut changes);
    assert!(matches!(stale, Err(LeaseError::StaleGeneration { .. })), "{stale:?}");
    assert!(changes.users.iter().all(|change| change.presence.state == State::Online));
}

/// L7: the throttle window is capped at half the TTL, so a short-TTL lease is never starved.
#[test]
fn l7_the_throttle_window_is_at_most_half_the_ttl() {
    let config = StoreConfig { min_renew_interval_ms: 5_000, min_ttl_ms: 100, ..StoreConfig::default() };
    let store = Store::new(config, T0).unwrap();
    let mut changes = Changes::default();
    let lease = register(&store, T0, reg("u42", "phone", "gw-a", 300), &mut changes);
    let soon = store.renew(T0 + 149, "u42", "phone", lease.generation, 300, &mut changes).unwrap();
    assert!(soon.throttled);
    let half = store.renew(T0 + 150, "u42", "phone", lease.generation, 300, &mut changes).unwrap();
    assert!(!half.throttled);
    assert_eq!(half.expires_at, T0 + 450);
    // Heartbeats every 100 ms against a 300 ms TTL keep the user online indefinitely.
    let mut now = T0 + 150;
    for _ in 0..50 {
        now += 100;
        store.renew(now, "u42", "phone", lease.generation, 300, &mut changes).unwrap();
        assert_eq!(presence(&store, now, "u42").state, State::Online);
    }
    assert_eq!(changes.users.len(), 1, "only the first ONLINE: {changes:?}");
}

fn status(availability: crate::Availability, text: &str, expires_at: Option<Tick>) -> crate::Status {
    crate::Status { availability, text: text.into(), expires_at }
}

/// S1: a status is data beside the state: setting it is one change with a new version, state unchanged.
#[test]
fn s1_setting_a_status_is_one_change_with_a_new_version_and_the_same_state() {
    let store = store();
    let mut changes = Changes::default();
    let registered = register(&store, T0, reg("u42", "phone", "gw-a", 0), &mut changes);
    changes.users.clear();
    let away = status(crate::Availability::Away, "lunch", None);
    let view = store.set_status(sec(1), "u42", Some(away.clone()), &mut changes).unwrap();
    assert_eq!(view.presence.state, State::Online);
    assert!(view.presence.version > registered.presence.version);
    assert_eq!(view.status.as_deref(), Some(&away));
    assert_eq!(changes.users.len(), 1);
    assert_eq!(changes.users[0].presence, view.presence);
    assert_eq!(changes.users[0].status.as_deref(), Some(&away));
    // Flips carry the status too.
    let mut later = Changes::default();
    store.unregister(sec(2), "u42", "phone", registered.generation, 0, &mut later).unwrap();
    assert_eq!(later.users[0].presence.state, State::Offline);
    assert_eq!(later.users[0].status.as_deref(), Some(&away), "an offline user keeps its status");
}

/// S1: a status with an expiry clears itself through the wheel, on time, as one change.
#[test]
fn s1_a_status_expires_through_the_wheel_as_one_change() {
    let store = store();
    let mut changes = Changes::default();
    let dnd = status(crate::Availability::DoNotDisturb, "focus", Some(sec(30)));
    let set = store.set_status(T0, "u42", Some(dnd), &mut changes).unwrap();
    assert_eq!(set.presence.state, State::Offline, "an offline user may set a status");
    assert!(drive(&store, T0, sec(30) - 1).is_empty(), "nothing before the expiry");
    let cleared = drive(&store, sec(30) - 1, sec(31)).users;
    assert_eq!(cleared.len(), 1);
    assert_eq!(cleared[0].status, None);
    assert!(cleared[0].presence.version > set.presence.version);
    assert_eq!(store.view(sec(31), &["u42"], &mut changes).unwrap()[0].status, None);
    assert_only_forgets_left(&store, sec(31), sec(30));
}

/// S1 and E1: a status expiring together with the last lease is still one change.
#[test]
fn s1_status_and_lease_expiring_together_are_one_change() {
    let store = store();
    let mut changes = Changes::default();
    register(&store, T0, reg("u42", "phone", "gw-a", 45_000), &mut changes);
    store.set_status(T0, "u42", Some(status(crate::Availability::Away, "", Some(sec(45)))), &mut changes).unwrap();
    let expired = drive(&store, T0, sec(46)).users;
    assert_eq!(expired.len(), 1, "{expired:?}");
    assert_eq!((expired[0].presence.state, expired[0].status.clone()), (State::Offline, None));
}

/// B1: a status text is validated and a past expiry is refused, changing nothing.
#[test]
fn s1_bad_status_text_and_past_expiry_are_refused() {
    let store = store();
    let mut changes = Changes::default();
    let long = status(crate::Availability::Away, &"x".repeat(129), None);
    assert!(matches!(
        store.set_status(T0, "u42", Some(long), &mut changes),
        Err(LeaseError::InvalidArgument { field: "text", .. })
    ));
    let past = status(crate::Availability::Away, "", Some(T0));
    assert!(matches!(
        store.set_status(T0, "u42", Some(past), &mut changes),
        Err(LeaseError::InvalidArgument { field: "expires_at_ms", .. })
    ));
    assert!(changes.users.is_empty());
    assert_eq!(store.stats().users, 0);
}

/// M3: an outside change some viewers see moves the version and publishes nothing itself.
#[test]
fn m3_bump_version_moves_the_version_without_a_change() {
    let store = store();
    let mut changes = Changes::default();
    let registered = register(&store, T0, reg("u42", "phone", "gw-a", 0), &mut changes);
    changes.users.clear();
    let bumped = store.bump_version(sec(1), "u42", &mut changes).unwrap();
    assert!(bumped.presence.version > registered.presence.version);
    assert_eq!(bumped.presence.state, State::Online);
    assert!(changes.users.is_empty());
    store.restore_status(sec(2), "u42", status(crate::Availability::Available, "back", None)).unwrap();
    let view = store.view(sec(2), &["u42"], &mut changes).unwrap();
    assert_eq!(view[0].presence.version, bumped.presence.version, "a restored status is no change");
    assert!(changes.users.is_empty());
}

/// M3 for a relay (P4 across nodes): a user the store holds is bumped as
/// `bump_version` does; one it does not hold gets a version above every one
/// issued and is not taken in (an erased user stays forgotten).
#[test]
fn m3_bump_version_if_held_never_takes_a_user_in() {
    let store = store();
    let mut changes = Changes::default();
    let registered = register(&store, T0, reg("u42", "phone", "gw-a", 0), &mut changes);
    changes.users.clear();
    let bumped = store.bump_version_if_held(sec(1), "u42", &mut changes).unwrap();
    assert!(bumped.presence.version > registered.presence.version);
    assert_eq!(bumped.presence.state, State::Online);
    let held = store.stats().users;
    let unheld = store.bump_version_if_held(sec(2), "gone", &mut changes).unwrap();
    assert_eq!(unheld.presence.state, State::Offline);
    assert!(unheld.presence.version > bumped.presence.version, "above every version issued");
    assert_eq!(store.stats().users, held, "not taken in");
    assert_eq!(store.view(sec(2), &["gone"], &mut changes).unwrap()[0].presence.version, 0);
    assert!(changes.users.is_empty());
}

mod renew_batch {
    //! `Store::renew_batch` answers and changes exactly what renewing one by one would.

    use proptest::prelude::*;

    use super::*;
    use crate::Renewal;

    const USERS: usize = 40;
    const SESSIONS: usize = 3;

    fn user(index: usize) -> String {
        format!("user-{index}")
    }

    fn session(index: usize) -> String {
        format!("session-{index}")
    }

    /// One renewal of a batch, by indices; `USERS` stands for a user never registered.
    #[derive(Debug, Clone)]
    struct Pick {
        user: usize,
        session: usize,
        /// 0: the current generation; 1: one older; 2: one newer; 3: zero.
        generation: u8,
        /// 0: the default; 1: too short; otherwise this TTL.
        ttl: u32,
        /// An empty session id (refused as bad input).
        bad_id: bool,
    }

    fn pick() -> impl Strategy<Value = Pick> {
        (
            0..=USERS,
            0..SESSIONS,
            prop_oneof![6 => Just(0u8), 1 => Just(1), 1 => Just(2), 1 => Just(3)],
            prop_oneof![Just(0u32), Just(1), Just(20), Just(200)],
            prop::bool::weighted(0.05),
        )
            .prop_map(|(user, session, generation, ttl, bad_id)| Pick {
                user,
                session,
                generation,
                ttl,
                bad_id,
            })
    }

    /// One user's changes: presence, time, deadline.
    type UserChanges = Vec<(Presence, Tick, Option<Tick>)>;

    /// Per user, the changes in the order they were made (different users' may interleave either way).
    fn per_user(changes: &[PresenceChange]) -> Vec<(String, UserChanges)> {
        let mut by_user: std::collections::BTreeMap<String, Vec<_>> = Default::default();
        for change in changes {
            by_user.entry(change.user_id.to_string()).or_default().push((change.presence, change.at, change.deadline));
        }
        by_user.into_iter().collect()
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        #[test]
        fn l2_a_batch_of_renewals_is_the_same_as_renewing_one_by_one(
            registered in prop::collection::vec((0..USERS, 0..SESSIONS, prop_oneof![Just(10u32), Just(50), Just(200)]), 1..80),
            rounds in prop::collection::vec((0..60u64, prop::collection::vec(pick(), 0..120)), 1..6),
        ) {
            let (batched, single) = (small_store(), small_store());
            let mut generations = std::collections::HashMap::new();
            let mut now = T0;
            for (step, &(u, s, ttl)) in registered.iter().enumerate() {
                now = T0 + step as u64;
                let (user_id, session_id) = (user(u), session(s));
                let registration = reg(&user_id, &session_id, "gw", ttl);
                let (a, b) = (register(&batched, now, registration, &mut Changes::default()), register(&single, now, registration, &mut Changes::default()));
                prop_assert_eq!(a, b);
                generations.insert((u, s), a.generation);
            }
            for (advance, picks) in rounds {
                // Time passes without the expiry driver: some leases are due and are settled by the renewals.
                now += advance;
                let names: Vec<(String, String)> =
                    picks.iter().map(|p| (user(p.user), if p.bad_id { String::new() } else { session(p.session) })).collect();
                let renewals: Vec<Renewal<'_>> = picks
                    .iter()
                    .zip(&names)
                    .map(|(p, (user_id, session_id))| {
                        let current = generations.get(&(p.user, p.session)).copied().unwrap_or(1);
                        let generation = match p.generation { 0 => current, 1 => current - 1, 2 => current + 1, _ => 0 };
                        Renewal { user_id, session_id, generation, ttl_ms: p.ttl }
                    })
                    .collect();
                let (mut batch_changes, mut single_changes) = (Changes::default(), Changes::default());
                let answers = batched.renew_batch(now, &renewals, &mut batch_changes);
                let one_by_one: Vec<_> = renewals
                    .iter()
                    .map(|r| single.renew(now, r.user_id, r.session_id, r.generation, r.ttl_ms, &mut single_changes))
                    .collect();
                prop_assert_eq!(&answers, &one_by_one);
                prop_assert_eq!(per_user(&batch_changes.users), per_user(&single_changes.users));
            }
            // And the stores ended alike: every user's presence and leases (reading settles what is due, alike too).
            let read = |store: &Store, user_id: &str| {
                let mut changes = Changes::default();
                let presence = store.snapshot(now, &[user_id], &mut changes).expect("valid id")[0];
                let mut leases = store.leases(now, user_id, &mut changes).expect("valid id");
                leases.sort_by(|a, b| a.session_id.cmp(&b.session_id));
                (presence, leases, changes.users)
            };
            for u in 0..=USERS {
                prop_assert_eq!(read(&batched, &user(u)), read(&single, &user(u)));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// B6 Bounded memory: users are forgotten.

/// Ten seconds, so that tests of forgetting stay short; small TTLs as in `small_store`.
const FORGET_AFTER: Tick = 10_000;

fn forgetting_store(forget_offline_after_ms: Tick) -> Store {
    Store::new(StoreConfig { forget_offline_after_ms, ..small_config() }, T0).expect("valid config")
}

/// One session comes and goes: the versions it made, and the register's generation.
fn come_and_go(store: &Store, at: Tick, user_id: &str) -> (Vec<u64>, u64) {
    let mut changes = Changes::default();
    let registered = register(store, at, reg(user_id, "s", "gw-a", 0), &mut changes);
    store.unregister(at + 1, user_id, "s", registered.generation, 0, &mut changes).unwrap();
    (changes.users.iter().map(|change| change.presence.version).collect(), registered.generation)
}

#[test]
fn b6_m4_a_forgotten_user_that_comes_back_gets_a_version_above_any_it_had() {
    let store = forgetting_store(FORGET_AFTER);
    let (mut versions, first_generation) = come_and_go(&store, T0, "u");
    let (more, _) = come_and_go(&store, T0 + 10, "u");
    versions.extend(more);
    assert_eq!(versions.len(), 4);
    assert_eq!(store.stats().users, 1);
    // Offline since T0 + 11: still held one ms before the window ends, gone at its end,
    // with nothing published either time.
    assert!(drive(&store, T0 + 11, T0 + 11 + FORGET_AFTER - 1).is_empty());
    assert_eq!(store.stats().users, 1);
    assert!(drive(&store, T0 + 11 + FORGET_AFTER - 1, T0 + 11 + FORGET_AFTER).is_empty());
    assert_eq!(store.stats(), StoreStats { sessions: 0, online_users: 0, users: 0, ..StoreStats::default() });
    assert_eq!(store.forgotten_users(), 1);
    assert_eq!(store.next_deadline(), None, "nothing is left of it, not even a timer");
    // It comes back, in the same millisecond as another user's flip in its shard
    // (a bare per-user counter would restart at 1 here).
    let mut changes = Changes::default();
    let now = T0 + 11 + FORGET_AFTER;
    let back = register(&store, now, reg("u", "s", "gw-a", 0), &mut changes);
    assert!(back.changed);
    let highest = *versions.iter().max().unwrap();
    assert!(back.presence.version > highest, "version {} after {highest} (M4)", back.presence.version);
    assert!(back.generation > first_generation, "generations never go back either (L1)");
    assert_eq!(store.stats().users, 1);
}

#[test]
fn b6_p3_a_forgotten_user_is_answered_exactly_like_one_never_seen() {
    let forgot = forgetting_store(FORGET_AFTER);
    come_and_go(&forgot, T0, "u");
    assert!(drive(&forgot, T0 + 1, T0 + 1 + FORGET_AFTER).is_empty());
    assert_eq!(forgot.stats().users, 0);
    let never = forgetting_store(FORGET_AFTER);
    let now = T0 + 2 * FORGET_AFTER;
    // Every read and every refusal, asked of both stores at the same time.
    let answers = |store: &Store| {
        let mut changes = Changes::default();
        let answers = format!(
            "{:?} {:?} {:?} {:?} {:?} {:?}",
            store.snapshot(now, &["u"], &mut changes),
            store.view(now, &["u"], &mut changes),
            store.leases(now, "u", &mut changes),
            store.renew(now, "u", "s", 1, 0, &mut changes),
            store.unregister(now, "u", "s", 1, 0, &mut changes),
            store.revoke(now, "u", None, &mut changes),
        );
        assert!(changes.users.is_empty());
        (answers, store.stats())
    };
    assert_eq!(answers(&forgot), answers(&never));
    assert_eq!(presence(&forgot, now, "u"), Presence::UNKNOWN);
}

#[test]
fn b6_a_user_that_comes_back_within_the_window_is_not_forgotten_by_the_old_deadline() {
    let store = forgetting_store(FORGET_AFTER);
    come_and_go(&store, T0, "u");
    // Back half a window later, and gone again: its window starts over.
    let half = T0 + FORGET_AFTER / 2;
    let (versions, _) = come_and_go(&store, half, "u");
    assert!(drive(&store, half + 1, T0 + 1 + FORGET_AFTER).is_empty());
    assert_eq!(store.stats().users, 1, "forgotten by the deadline of an earlier absence");
    assert_eq!(presence(&store, T0 + 1 + FORGET_AFTER, "u").version, versions[1], "it keeps its version");
    // Reads are not activity: they neither forget nor keep.
    assert!(drive(&store, T0 + 1 + FORGET_AFTER, half + FORGET_AFTER).is_empty());
    assert_eq!(store.stats().users, 1);
    assert!(drive(&store, half + FORGET_AFTER, half + 1 + FORGET_AFTER).is_empty());
    assert_eq!(store.stats().users, 0);
}

#[test]
fn b6_a_user_with_a_lease_or_a_status_is_not_forgotten() {
    let store = forgetting_store(FORGET_AFTER);
    let mut changes = Changes::default();
    // Online all along, renewed: never forgotten.
    let online = register(&store, T0, reg("online", "s", "gw-a", 200), &mut changes);
    // Offline with a status that does not expire: kept while the status is held.
    let away = status(crate::Availability::Away, "lunch", None);
    store.set_status(T0, "away", Some(away), &mut changes).unwrap();
    // Offline with a status that expires: kept until it does, then forgotten a window later.
    let dnd = status(crate::Availability::DoNotDisturb, "focus", Some(T0 + 5_000));
    store.set_status(T0, "dnd", Some(dnd), &mut changes).unwrap();
    let mut now = T0;
    while now < T0 + 3 * FORGET_AFTER {
        changes.users.extend(drive(&store, now, now + 100).users);
        now += 100;
        store.renew(now, "online", "s", online.generation, 200, &mut changes).unwrap();
    }
    let ids = |store: &Store| {
        let mut changes = Changes::default();
        let views = store.view(now, &["online", "away", "dnd"], &mut changes).unwrap();
        views.iter().map(|view| view.presence != Presence::UNKNOWN).collect::<Vec<_>>()
    };
    assert_eq!(ids(&store), [true, true, false], "dnd was forgotten a window after its status ran out");
    assert_eq!(store.stats().users, 2);
    // Clearing the status starts the window.
    store.set_status(now, "away", None, &mut changes).unwrap();
    assert!(drive(&store, now, now + FORGET_AFTER - 1).users.iter().all(|change| change.user_id == "online"));
    assert_eq!(store.stats().users, 2);
    drive(&store, now + FORGET_AFTER - 1, now + FORGET_AFTER);
    assert_eq!(store.stats().users, 1);
}

#[test]
fn b6_a_window_of_zero_never_forgets() {
    let store = forgetting_store(0);
    come_and_go(&store, T0, "u");
    assert!(drive(&store, T0 + 1, T0 + 100 * FORGET_AFTER).is_empty());
    assert_eq!(store.stats().users, 1);
    assert_eq!(store.next_deadline(), None, "and keeps no timer for it");
}

#[test]
fn b6_a_restored_offline_user_is_forgotten_a_window_after_the_restore_and_a_held_one_after_its_hold() {
    let store = forgetting_store(FORGET_AFTER);
    let mut changes = Changes::default();
    come_and_go(&store, T0, "offline");
    register(&store, T0, reg("online", "s", "gw-a", 200), &mut changes);
    let mut writer = crate::checkpoint::CheckpointWriter::new(T0 + 2);
    for shard in 0..store.shard_count() {
        store.checkpoint_shard(shard, &mut writer);
    }
    let bytes = [writer.take_chunk(), writer.finish()].concat();
    let checkpoint = crate::checkpoint::decode(&bytes).unwrap();
    let start = T0 + 1_000;
    let hold_until = start + 2 * FORGET_AFTER;
    let config = store.config().clone();
    let restored = Store::restore(config, start, &checkpoint, hold_until).unwrap();
    assert!(drive(&restored, start, start + FORGET_AFTER - 1).is_empty());
    assert_eq!(restored.stats().users, 2);
    assert!(drive(&restored, start + FORGET_AFTER - 1, start + FORGET_AFTER).is_empty());
    assert_eq!(restored.stats().users, 1, "the offline user, a window after the restore");
    // The held user goes OFFLINE when the hold ends, and is forgotten a window after that.
    let offline = drive(&restored, start + FORGET_AFTER, hold_until + FORGET_AFTER - 1);
    assert_eq!(offline.users.len(), 1);
    assert_eq!((offline.users[0].user_id.as_str(), offline.users[0].at), ("online", hold_until));
    assert_eq!(restored.stats().users, 1);
    drive(&restored, hold_until + FORGET_AFTER - 1, hold_until + FORGET_AFTER);
    assert_eq!(restored.stats(), StoreStats::default());
}

#[test]
fn b6_a_pending_forget_rechecks_on_firing_and_a_status_cleared_later_starts_a_new_window() {
    let store = forgetting_store(FORGET_AFTER);
    let mut changes = Changes::default();
    come_and_go(&store, T0, "u");
    come_and_go(&store, T0, "v");
    // Both idle from T0 + 1; half a window later both set a status that does
    // not expire, and `v` clears it again at once.
    let half = T0 + FORGET_AFTER / 2;
    let away = status(crate::Availability::Away, "lunch", None);
    store.set_status(half, "u", Some(away.clone()), &mut changes).unwrap();
    store.set_status(half, "v", Some(away), &mut changes).unwrap();
    store.set_status(half + 1, "v", None, &mut changes).unwrap();
    // `v` is idle from half + 1: the entry of its first absence must not forget it.
    assert!(drive(&store, half + 1, T0 + 1 + FORGET_AFTER).is_empty());
    assert!(presence(&store, T0 + 1 + FORGET_AFTER, "v") != Presence::UNKNOWN, "v forgotten too early");
    assert!(drive(&store, T0 + 1 + FORGET_AFTER, half + 1 + FORGET_AFTER).is_empty());
    assert_eq!(presence(&store, half + 1 + FORGET_AFTER, "v"), Presence::UNKNOWN);
    let store = forgetting_store(FORGET_AFTER);
    come_and_go(&store, T0, "u");
    store.set_status(half, "u", Some(status(crate::Availability::Away, "lunch", None)), &mut changes).unwrap();
    // The entry set when it went idle fires, and finds a status held: nothing is forgotten.
    assert!(drive(&store, half, T0 + 1 + FORGET_AFTER).is_empty());
    assert_eq!(store.stats().users, 1);
    assert!(store.view(T0 + 1 + FORGET_AFTER, &["u"], &mut changes).unwrap()[0].status.is_some());
    // Cleared a little later: idle again from then, for a whole window.
    let cleared = T0 + 2 + FORGET_AFTER;
    store.set_status(cleared, "u", None, &mut changes).unwrap();
    assert!(drive(&store, cleared, cleared + FORGET_AFTER - 1).is_empty());
    assert_eq!(store.stats().users, 1, "forgotten before a whole window had passed since the status was cleared");
    assert!(drive(&store, cleared + FORGET_AFTER - 1, cleared + FORGET_AFTER).is_empty());
    assert_eq!(store.stats().users, 0);
}

// ---------------------------------------------------------------------------------------------
// E6 Flap damping.

/// A grace window of 1 s; small TTLs as in `small_store`.
const GRACE: Tick = 1_000;

fn damping_store() -> Store {
    Store::new(StoreConfig { offline_grace_ms: GRACE, ..small_config() }, T0).expect("valid config")
}

/// E6: a lease that runs out, and one closed by unregister, then a register
/// within the window: nothing is published, the version does not move, the
/// register reports no change, and the flap is counted.
#[test]
fn e6_a_register_within_the_window_hides_the_flap_and_keeps_the_version() {
    for close in ["expiry", "unregister", "linger"] {
        let store = damping_store();
        let mut changes = Changes::default();
        let first = register(&store, T0, reg("u", "s", "gw-a", 100), &mut changes);
        assert_eq!(changes.users.len(), 1);
        let ended = match close {
            "expiry" => T0 + 100,
            "unregister" => {
                let closed = store.unregister(T0 + 40, "u", "s", first.generation, 0, &mut changes).unwrap();
                assert!(!closed.changed, "{close}: damped, so no flip");
                assert_eq!(closed.presence, first.presence, "{close}");
                T0 + 40
            }
            _ => {
                store.unregister(T0 + 40, "u", "s", first.generation, 20, &mut changes).unwrap();
                T0 + 60
            }
        };
        let quiet = drive(&store, T0 + 40, ended + GRACE - 1);
        assert!(quiet.is_empty() && changes.users.len() == 1, "{close}: a damped flap leaked: {quiet:?} {changes:?}");
        assert_eq!(presence(&store, ended + GRACE - 1, "u"), first.presence, "{close}: still ONLINE, same version");
        assert!(leases(&store, ended + GRACE - 1, "u").is_empty(), "{close}: the hold is no session");
        assert_eq!(store.stats().sessions, 0, "{close}");
        let again = register(&store, ended + GRACE - 1, reg("u", "s2", "gw-a", 100), &mut changes);
        assert!(!again.changed, "{close}");
        assert_eq!(again.presence, first.presence, "{close}: the version did not move");
        assert_eq!(changes.users.len(), 1, "{close}: nothing published: {changes:?}");
        assert_eq!(store.stats().suppressed_flaps, 1, "{close}");
        // And once it really goes, one OFFLINE.
        let gone = drive(&store, ended + GRACE - 1, ended + GRACE + 100 + GRACE).users;
        assert_eq!(gone.len(), 1, "{close}: {gone:?}");
    }
}

/// E6: without a register, OFFLINE comes at the end of the window, through
/// the wheel, with the window's end as its deadline; never before.
#[test]
fn e6_without_a_register_offline_comes_at_the_end_of_the_window_through_the_wheel() {
    let store = damping_store();
    let mut changes = Changes::default();
    register(&store, T0, reg("u", "s", "gw-a", 100), &mut changes);
    assert!(drive(&store, T0, T0 + 100 + GRACE - 1).is_empty());
    assert_eq!(presence(&store, T0 + 100 + GRACE - 1, "u").state, State::Online);
    let published = drive(&store, T0 + 100 + GRACE - 1, T0 + 100 + GRACE);
    assert_eq!(published.users.len(), 1, "{published:?}");
    assert_flip(&published.users[0], "u", State::Offline, T0 + 100 + GRACE, Some(T0 + 100 + GRACE));
    assert_eq!(store.stats().suppressed_flaps, 0);
    // Settled late by a read rather than on time by the driver: the same answer.
    let late = damping_store();
    register(&late, T0, reg("u", "s", "gw-a", 100), &mut changes);
    let mut read = Changes::default();
    let seen = late.snapshot(T0 + 10 * GRACE, &["u"], &mut read).unwrap()[0];
    assert_eq!(seen.state, State::Offline);
    assert_eq!(read.users.len(), 1);
    assert_eq!(read.users[0].deadline, Some(T0 + 100 + GRACE), "the window started when the lease ended");
}

/// E6: revoke is never damped, and a revoke of a user held by damping flips
/// it OFFLINE at once.
#[test]
fn e6_revoke_is_never_damped_and_ends_a_damping_hold_at_once() {
    let store = damping_store();
    let mut changes = Changes::default();
    register(&store, T0, reg("u", "s", "gw-a", 100), &mut changes);
    let revoked = store.revoke(T0 + 10, "u", None, &mut changes).unwrap();
    assert_eq!((revoked.count, revoked.changed, revoked.presence.state), (1, true, State::Offline));
    assert_eq!(changes.users.len(), 2);
    assert_flip(&changes.users[1], "u", State::Offline, T0 + 10, None);

    for session in [None, Some("s"), Some("other")] {
        let store = damping_store();
        let mut changes = Changes::default();
        let first = register(&store, T0, reg("u", "s", "gw-a", 100), &mut changes);
        store.unregister(T0 + 10, "u", "s", first.generation, 0, &mut changes).unwrap();
        assert_eq!(changes.users.len(), 1, "damped");
        let revoked = store.revoke(T0 + 20, "u", session, &mut changes).unwrap();
        assert_eq!((revoked.count, revoked.changed), (0, true), "{session:?}: the hold is no session, but ends");
        assert_eq!(changes.users.len(), 2, "{session:?}");
        assert_flip(&changes.users[1], "u", State::Offline, T0 + 20, None);
        assert!(drive(&store, T0 + 20, T0 + 20 + 2 * GRACE).is_empty(), "{session:?}: nothing at the window's end");
    }
}

/// E6 with L3: closing one of two devices starts no window; the window
/// starts when the last lease ends.
#[test]
fn e6_damping_only_starts_when_the_last_lease_ends() {
    let store = damping_store();
    let mut changes = Changes::default();
    let phone = register(&store, T0, reg("u", "phone", "gw-a", 50), &mut changes);
    register(&store, T0, reg("u", "laptop", "gw-a", 200), &mut changes);
    store.unregister(T0 + 1, "u", "phone", phone.generation, 0, &mut changes).unwrap();
    // The laptop ends at T0 + 200; the window after it, not after the phone.
    assert!(drive(&store, T0 + 1, T0 + 200 + GRACE - 1).is_empty());
    let published = drive(&store, T0 + 200 + GRACE - 1, T0 + 200 + GRACE);
    assert_eq!(published.users.len(), 1);
    assert_eq!(published.users[0].deadline, Some(T0 + 200 + GRACE));
    assert_eq!(changes.users.len(), 1);
}

// ---------------------------------------------------------------------------------------------
// R1, R2, R6 Rooms; S3 Signals.

fn room<'a>(user_id: &'a str, session_id: &'a str, generation: u64, room_id: &'a str) -> crate::RoomRef<'a> {
    crate::RoomRef { user_id, session_id, generation, room_id }
}

fn meta(value: &str) -> Vec<(String, String)> {
    vec![("device".to_string(), value.to_string())]
}

/// What the room changes say, in order: (kind of body, user, metadata value, version).
fn room_events(changes: &Changes) -> Vec<(String, u64)> {
    changes
        .rooms
        .iter()
        .map(|change| {
            let what = match &change.body {
                crate::RoomEventBody::Member { kind, member } => format!(
                    "{kind:?} {} {}",
                    member.user_id,
                    member.metadata.first().map_or("-", |(_, value)| value.as_str())
                ),
                crate::RoomEventBody::Sessions => format!("Sessions {}", change.sessions),
                crate::RoomEventBody::Signals { kind, user_ids, count } => {
                    format!("Signals {kind} {user_ids:?} {count}")
                }
            };
            (what, change.version)
        })
        .collect()
}

fn kinds(changes: &Changes) -> Vec<String> {
    room_events(changes).into_iter().map(|(what, _)| what).collect()
}

/// R1: a member's lease that ends ends its membership with no further call:
/// by expiry through the wheel, by unregister, by revoke, by a reconnect, and
/// at once even while flap damping holds the user ONLINE.
#[test]
fn r1_a_membership_ends_with_its_lease_with_no_further_call() {
    for end in ["expiry", "unregister", "revoke", "reconnect", "damped"] {
        let store = if end == "damped" { damping_store() } else { small_store() };
        let mut changes = Changes::default();
        let lease = register(&store, T0, reg("u", "s", "gw-a", 100), &mut changes);
        store.join(T0, &room("u", "s", lease.generation, "r"), &[], &mut changes).unwrap();
        assert!(store.is_member("r", "u"));
        changes = Changes::default();
        match end {
            "expiry" | "damped" => changes = drive(&store, T0, T0 + 100),
            "unregister" => drop(store.unregister(T0 + 1, "u", "s", lease.generation, 0, &mut changes).unwrap()),
            "revoke" => drop(store.revoke(T0 + 1, "u", None, &mut changes).unwrap()),
            _ => drop(register(&store, T0 + 1, reg("u", "s", "gw-b", 100), &mut changes)),
        }
        assert_eq!(kinds(&changes), ["Left u -"], "{end}");
        assert!(!store.is_member("r", "u"), "{end}: a member outlived its lease");
        assert!(store.rooms_of("u").is_empty(), "{end}");
        let view = store.room("r", 10);
        assert_eq!((view.users, view.sessions, view.members.map(|m| m.len())), (0, 0, Some(0)), "{end}");
        if end == "damped" {
            assert_eq!(presence(&store, T0 + 100, "u").state, State::Online, "damping holds the user, not its rooms");
        }
    }
}

/// R2: sessions of a member that end together (by expiry, or a revoke of
/// all) are one leave, not an update to another one's metadata first.
#[test]
fn r2_sessions_of_a_member_ending_together_are_one_leave() {
    for end in ["expiry", "revoke"] {
        let store = small_store();
        let mut changes = Changes::default();
        for (session, device) in [("a", "phone"), ("b", "laptop")] {
            let generation = register(&store, T0, reg("u", session, "gw-a", 100), &mut changes).generation;
            store.join(T0, &room("u", session, generation, "r"), &meta(device), &mut changes).unwrap();
        }
        changes = Changes::default();
        match end {
            "expiry" => changes = drive(&store, T0, T0 + 100),
            _ => drop(store.revoke(T0 + 1, "u", None, &mut changes).unwrap()),
        }
        assert_eq!(kinds(&changes), ["Left u laptop"], "{end}");
    }
}

/// R1, R5: a room's name lives as long as a session is in it, whatever ends
/// the membership, and a refused join keeps none.
#[test]
fn r1_room_names_go_with_the_last_membership() {
    let store = damping_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 100), &mut changes).generation;
    let b = register(&store, T0, reg("u", "b", "gw-a", 150), &mut changes).generation;
    let v = register(&store, T0, reg("v", "s", "gw-a", 200), &mut changes).generation;
    for (user, session, generation, room_id) in
        [("u", "a", a, "r1"), ("u", "a", a, "r2"), ("u", "b", b, "r1"), ("v", "s", v, "r3"), ("v", "s", v, "r1")]
    {
        store.join(T0, &room(user, session, generation, room_id), &meta("x"), &mut changes).unwrap();
    }
    store.signal(T0, &room("u", "a", a, "r2"), "typing", 10_000, &mut changes).unwrap();
    assert!(store.join(T0, &room("u", "a", a - 1, "r4"), &[], &mut changes).is_err());
    assert!(store.join(T0, &room("w", "s", 1, "r4"), &[], &mut changes).is_err());
    assert_eq!(store.room_names_in_use(), 3, "r1, r2, r3: a refused join names nothing");
    store.leave(T0 + 1, &room("v", "s", v, "r3"), &mut changes).unwrap();
    assert_eq!(store.room_names_in_use(), 2);
    // u's session a expires (r2 goes, r1 stays with b), then b reconnects, then v is revoked.
    changes = drive(&store, T0, T0 + 100);
    assert_eq!(store.room_names_in_use(), 1);
    register(&store, T0 + 101, reg("u", "b", "gw-a", 150), &mut changes);
    store.revoke(T0 + 102, "v", None, &mut changes).unwrap();
    assert_eq!(store.room_names_in_use(), 0);
    assert!(store.rooms_of("u").is_empty() && store.room("r1", 10).users == 0);
}

/// R2: a second tab of a member publishes nothing but a session count (no
/// version move, `changed == false`); its leaving likewise, the last one's a leave.
#[test]
fn r2_a_second_tab_publishes_only_a_session_count() {
    let store = small_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 200), &mut changes).generation;
    let b = register(&store, T0, reg("u", "b", "gw-a", 200), &mut changes).generation;
    let first = store.join(T0 + 1, &room("u", "a", a, "r"), &[], &mut changes).unwrap();
    let second = store.join(T0 + 2, &room("u", "b", b, "r"), &[], &mut changes).unwrap();
    assert!(first.changed && !second.changed);
    assert_eq!(second.room_version, first.room_version, "a second tab moves no version");
    assert_eq!(kinds(&changes), ["Joined u -", "Sessions 2"]);
    let view = store.room("r", 10);
    assert_eq!((view.users, view.sessions), (1, 2));
    assert_eq!(view.members.unwrap()[0].sessions, 2);
    let left = store.leave(T0 + 3, &room("u", "a", a, "r"), &mut changes).unwrap();
    assert!(left.removed && !left.changed);
    assert_eq!(left.room_version, first.room_version);
    let left = store.leave(T0 + 4, &room("u", "b", b, "r"), &mut changes).unwrap();
    assert!(left.removed && left.changed && left.room_version > first.room_version);
    assert_eq!(kinds(&changes), ["Joined u -", "Sessions 2", "Sessions 1", "Left u -"]);
}

/// R2, R6: a change of shown metadata is one update, never a leave and a
/// join: a session that joins again with other metadata, a second session
/// that joins later (it is shown), and its leaving (the first one is shown again).
#[test]
fn r2_a_metadata_change_is_an_update_never_a_leave_and_a_join() {
    let store = small_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 200), &mut changes).generation;
    let b = register(&store, T0, reg("u", "b", "gw-a", 200), &mut changes).generation;
    store.join(T0, &room("u", "a", a, "r"), &meta("phone"), &mut changes).unwrap();
    let again = store.join(T0 + 1, &room("u", "a", a, "r"), &meta("tablet"), &mut changes).unwrap();
    assert!(!again.changed);
    store.join(T0 + 2, &room("u", "a", a, "r"), &meta("tablet"), &mut changes).unwrap();
    store.join(T0 + 3, &room("u", "b", b, "r"), &meta("laptop"), &mut changes).unwrap();
    store.leave(T0 + 4, &room("u", "b", b, "r"), &mut changes).unwrap();
    assert_eq!(
        kinds(&changes),
        ["Joined u phone", "Updated u tablet", "Updated u laptop", "Updated u tablet"],
        "the same metadata again changes nothing"
    );
    let versions: Vec<u64> = room_events(&changes).iter().map(|(_, version)| *version).collect();
    assert!(versions.windows(2).all(|pair| pair[0] < pair[1]), "{versions:?}");
    assert_eq!(store.room("r", 10).members.unwrap()[0].metadata[0].1, "tablet");
}

/// R2, R6: room versions strictly increase, also across a room that empties
/// (and is dropped) and fills again; an unknown room is version 0.
#[test]
fn r2_room_versions_strictly_increase_also_when_a_room_empties_and_fills_again() {
    let store = small_store();
    let mut changes = Changes::default();
    assert_eq!(store.room("r", 10).version, 0);
    let g = register(&store, T0, reg("u", "s", "gw-a", 200), &mut changes).generation;
    let mut last = 0;
    for round in 0..3 {
        let joined = store.join(T0 + round, &room("u", "s", g, "r"), &[], &mut changes).unwrap();
        assert!(joined.room_version > last);
        let left = store.leave(T0 + round, &room("u", "s", g, "r"), &mut changes).unwrap();
        assert!(left.room_version > joined.room_version);
        last = left.room_version;
        assert_eq!(store.room("r", 10).version, 0, "an empty room with default access is dropped");
    }
    store.set_room_access("r", crate::RoomAccess::Public).unwrap();
    assert_eq!(store.room("r", 10).access, crate::RoomAccess::Public, "kept while empty");
}

/// R6: room operations name a session like a renewal does: an older
/// generation is refused and changes nothing, an unknown, expired or revoked
/// session is not found; a leave of a session not in the room removes nothing.
#[test]
fn r6_stale_and_unknown_sessions_are_refused_and_change_nothing() {
    let store = small_store();
    let mut changes = Changes::default();
    let old = register(&store, T0, reg("u", "s", "gw-a", 100), &mut changes).generation;
    let new = register(&store, T0 + 1, reg("u", "s", "gw-a", 100), &mut changes).generation;
    store.join(T0 + 1, &room("u", "s", new, "r"), &meta("phone"), &mut changes).unwrap();
    let before = (store.room("r", 10), Changes::default());
    let mut after = Changes::default();
    let stale = store.join(T0 + 2, &room("u", "s", old, "r"), &meta("evil"), &mut after);
    assert!(matches!(stale, Err(LeaseError::StaleGeneration { .. })), "{stale:?}");
    let stale = store.leave(T0 + 2, &room("u", "s", old, "r"), &mut after);
    assert!(matches!(stale, Err(LeaseError::StaleGeneration { .. })), "{stale:?}");
    let stale = store.signal(T0 + 2, &room("u", "s", old, "r"), "typing", 1_000, &mut after);
    assert!(matches!(stale, Err(LeaseError::StaleGeneration { .. })), "{stale:?}");
    assert!(after.is_empty() && store.room("r", 10) == before.0, "a stale call changed something");
    for (user, session) in [("u", "other"), ("nobody", "s")] {
        let unknown = store.join(T0 + 2, &room(user, session, new, "r"), &[], &mut after);
        assert!(matches!(unknown, Err(LeaseError::NotFound { .. })), "{unknown:?}");
    }
    let not_in = store.leave(T0 + 2, &room("u", "s", new, "elsewhere"), &mut after).unwrap();
    assert!(!not_in.removed && !not_in.changed);
    let not_in = store.signal(T0 + 2, &room("u", "s", new, "elsewhere"), "typing", 1_000, &mut after);
    assert!(matches!(not_in, Err(LeaseError::NotInRoom { .. })), "{not_in:?}");
    store.revoke(T0 + 3, "u", None, &mut after).unwrap();
    let revoked = store.join(T0 + 4, &room("u", "s", new, "r"), &[], &mut after);
    assert!(matches!(revoked, Err(LeaseError::NotFound { .. })), "{revoked:?}");
    // Bad input names the field.
    assert_eq!(field_of(store.join(T0, &room("u", "s", new, ""), &[], &mut after)), "room_id");
    assert_eq!(field_of(store.join(T0, &room("u", "s", new, &"x".repeat(129)), &[], &mut after)), "room_id");
    let too_much: Vec<(String, String)> = (0..17).map(|i| (format!("k{i}"), "v".to_string())).collect();
    assert_eq!(field_of(store.join(T0, &room("u", "s", new, "r"), &too_much, &mut after)), "metadata");
    assert_eq!(field_of(store.signal(T0, &room("u", "s", new, "r"), "", 1, &mut after)), "kind");
    assert_eq!(field_of(store.signal(T0, &room("u", "s", new, "r"), &"k".repeat(65), 1, &mut after)), "kind");
    assert_eq!(field_of(store.signal(T0, &room("u", "s", new, "r"), "typing", 10_001, &mut after)), "ttl_ms");
}

/// S3: a signal ends with its TTL, through the wheel, as one change of the
/// room's set; a renewal of a set signal extends it and publishes nothing.
#[test]
fn s3_a_signal_expires_through_the_wheel_and_a_renewal_publishes_nothing() {
    let store = small_store();
    let mut changes = Changes::default();
    let g = register(&store, T0, reg("u", "s", "gw-a", 200), &mut changes).generation;
    store.join(T0, &room("u", "s", g, "r"), &[], &mut changes).unwrap();
    changes = Changes::default();
    let set = store.signal(T0, &room("u", "s", g, "r"), "typing", 50, &mut changes).unwrap();
    assert!(set.changed);
    let renewed = store.signal(T0 + 40, &room("u", "s", g, "r"), "typing", 50, &mut changes).unwrap();
    assert!(!renewed.changed && renewed.room_version == set.room_version, "a renewal published");
    assert_eq!(kinds(&changes), [r#"Signals typing ["u"] 1"#]);
    assert!(drive(&store, T0 + 40, T0 + 89).is_empty(), "the renewal extended it to T0 + 90");
    let ended = drive(&store, T0 + 89, T0 + 90);
    assert_eq!(kinds(&ended), ["Signals typing [] 0"]);
    assert!(ended.rooms[0].version > set.room_version);
    assert!(store.room("r", 10).signals.is_empty());
}

/// S3: a signal ends with its session and with its membership; a second
/// session of the user keeps the user in the set.
#[test]
fn s3_a_signal_ends_with_its_session_and_its_membership() {
    for end in ["leave", "unregister", "expiry", "reconnect"] {
        let store = small_store();
        let mut changes = Changes::default();
        let a = register(&store, T0, reg("u", "a", "gw-a", 100), &mut changes).generation;
        let b = register(&store, T0, reg("u", "b", "gw-a", 200), &mut changes).generation;
        for (session, generation) in [("a", a), ("b", b)] {
            store.join(T0, &room("u", session, generation, "r"), &[], &mut changes).unwrap();
            store.signal(T0, &room("u", session, generation, "r"), "typing", 10_000, &mut changes).unwrap();
        }
        changes = Changes::default();
        let end_a = |changes: &mut Changes| match end {
            "leave" => drop(store.leave(T0 + 1, &room("u", "a", a, "r"), changes).unwrap()),
            "unregister" => drop(store.unregister(T0 + 1, "u", "a", a, 0, changes).unwrap()),
            "expiry" => *changes = drive(&store, T0, T0 + 100),
            _ => drop(register(&store, T0 + 1, reg("u", "a", "gw-a", 100), changes)),
        };
        end_a(&mut changes);
        assert_eq!(kinds(&changes), ["Sessions 1"], "{end}: b still signals, so the set is the same");
        store.leave(T0 + 101, &room("u", "b", b, "r"), &mut changes).unwrap();
        assert_eq!(kinds(&changes), ["Sessions 1", "Signals typing [] 0", "Left u -"], "{end}");
        assert!(drive(&store, T0 + 101, T0 + 20_000).rooms.is_empty(), "{end}: a signal outlived its session");
    }
}

/// S3: set changes one session causes are bounded per second; the refused
/// signal changes nothing, renewals are not counted, and the next second allows more.
#[test]
fn s3_set_changes_are_bounded_per_session_per_second() {
    let store = store();
    let mut changes = Changes::default();
    let g = register(&store, T0, reg("u", "s", "gw-a", 0), &mut changes).generation;
    store.join(T0, &room("u", "s", g, "r"), &[], &mut changes).unwrap();
    let at = room("u", "s", g, "r");
    for i in 0..crate::SIGNAL_CHANGES_PER_SECOND {
        let ttl = if i % 2 == 0 { 5_000 } else { 0 };
        assert!(store.signal(T0 + 1, &at, "typing", ttl, &mut changes).unwrap().changed, "change {i}");
    }
    // The last change cleared it: a renewal is not possible, a set is a change.
    let before = store.room("r", 10);
    let refused = store.signal(T0 + 2, &at, "typing", 5_000, &mut changes);
    assert!(matches!(refused, Err(LeaseError::SignalRateExceeded { .. })), "{refused:?}");
    assert_eq!(store.room("r", 10), before, "a refused signal changed something");
    assert!(store.signal(T0 + 1_001, &at, "typing", 5_000, &mut changes).unwrap().changed, "a new second");
    assert!(!store.signal(T0 + 1_002, &at, "typing", 5_000, &mut changes).unwrap().changed);
}

/// O4: an operator's listing shows each live session with its gateway,
/// generation, deadline, metadata and rooms, the newest first; a lease past
/// its deadline is left out before the driver has run, and the listing
/// settles, publishes and counts nothing, so the flip is still the next
/// request's to publish.
#[test]
fn o4_sessions_lists_live_sessions_with_their_rooms_and_settles_nothing() {
    let store = small_store();
    let mut changes = Changes::default();
    let a = register(&store, T0, reg("u", "a", "gw-a", 100), &mut changes);
    let metadata = meta("phone");
    let b = store
        .register(
            T0 + 1,
            &Registration { user_id: "u", session_id: "b", gateway_id: "gw-b", ttl_ms: 50, metadata: &metadata },
            &mut changes,
        )
        .unwrap();
    for (session, generation, room_id) in
        [("a", a.generation, "r2"), ("a", a.generation, "r1"), ("b", b.generation, "r1")]
    {
        store.join(T0 + 2, &room("u", session, generation, room_id), &[], &mut changes).unwrap();
    }
    let listed: Vec<_> = store
        .sessions(T0 + 2, "u")
        .unwrap()
        .into_iter()
        .map(|s| (s.lease.session_id, s.lease.gateway_id, s.lease.generation, s.lease.expires_at, s.rooms))
        .collect();
    let id = crate::CompactString::from;
    assert_eq!(
        listed,
        [
            (id("b"), id("gw-b"), b.generation, T0 + 51, vec![id("r1")]),
            (id("a"), id("gw-a"), a.generation, T0 + 100, vec![id("r1"), id("r2")]),
        ]
    );
    assert_eq!(store.sessions(T0 + 2, "u").unwrap()[0].lease.metadata, metadata);

    // A lingering lease is listed as closing until it runs out.
    store.unregister(T0 + 3, "u", "a", a.generation, 20, &mut changes).unwrap();
    let sessions = store.sessions(T0 + 4, "u").unwrap();
    assert_eq!(
        sessions.iter().map(|s| (s.lease.session_id.as_str(), s.lease.closing)).collect::<Vec<_>>(),
        [("b", false), ("a", true)]
    );
    let names = |now| store.sessions(now, "u").unwrap().into_iter().map(|s| s.lease.session_id).collect::<Vec<_>>();
    assert_eq!(names(T0 + 23), ["b"], "a lease at its deadline is gone");

    // Past every deadline, with no driver run: nothing listed, nothing settled.
    let operations = store.shard_operations();
    assert!(names(T0 + 51).is_empty());
    assert_eq!(store.shard_operations(), operations, "a listing counts no operation");
    assert_eq!(store.stats().online_users, 1, "the listing settled nothing");
    let mut changes = Changes::default();
    let now = store.snapshot(T0 + 51, &["u"], &mut changes).unwrap()[0];
    assert_eq!(now.state, State::Offline);
    assert_eq!(changes.users.len(), 1, "the flip is still the next request's to publish: {changes:?}");

    assert!(store.sessions(T0 + 52, "never-seen").unwrap().is_empty());
    assert!(matches!(store.sessions(T0 + 52, ""), Err(LeaseError::InvalidArgument { field: "user_id", .. })));
}

// ---------------------------------------------------------------------------------------------
// C3: handing a cluster slot's users over to another node's store.

/// Users `user-0..n`, each with one 30 s session registered at `now`, split by the slot they fall in.
fn users_in_and_out_of(slots: &SlotSet, store: &Store, now: Tick, n: usize) -> (Vec<String>, Vec<String>) {
    let mut changes = Changes::default();
    let (mut inside, mut outside) = (Vec::new(), Vec::new());
    for i in 0..n {
        let user = format!("user-{i}");
        register(store, now, reg(&user, "s", "gw", 30_000), &mut changes);
        if slots.holds(&user) { inside.push(user) } else { outside.push(user) }
    }
    assert!(!inside.is_empty() && !outside.is_empty(), "the set splits the users");
    (inside, outside)
}

#[test]
fn c3_a_handed_over_user_keeps_its_version_generations_deadlines_and_rooms() {
    let (from, to) = (store(), store());
    let slots = SlotSet::of(16, [3, 7]);
    let (inside, outside) = users_in_and_out_of(&slots, &from, sec(0), 64);
    let mut changes = Changes::default();
    let room = RoomRef {
        user_id: &inside[0],
        session_id: "s",
        generation: leases(&from, sec(1), &inside[0])[0].generation,
        room_id: "lobby",
    };
    from.join(sec(1), &room, &[("role".into(), "host".into())], &mut changes).expect("joined");
    let before: Vec<_> =
        inside.iter().map(|user| (presence(&from, sec(2), user), leases(&from, sec(2), user))).collect();

    let bytes = from.export_slots(&slots, sec(2));
    let mut published = Changes::default();
    let imported = to.import(sec(3), &bytes, &mut published).expect("a whole handover is taken");
    assert_eq!(imported, Imported { users: inside.len(), sessions: inside.len() });
    assert!(published.users.is_empty(), "users handed over online publish nothing: {published:?}");
    for (user, (presence_then, leases_then)) in inside.iter().zip(&before) {
        assert_eq!(presence(&to, sec(3), user), *presence_then, "{user}'s version came along (M4)");
        assert_eq!(leases(&to, sec(3), user), *leases_then, "{user}'s generation and deadline came along");
    }
    assert!(to.is_member("lobby", &inside[0]), "room memberships came along");
    for user in &outside {
        assert_eq!(presence(&to, sec(3), user), offline(0), "{user} is not in the slots and was not handed over");
    }
    // The gateway's renewal with the generation it holds carries on at the new node.
    let generation = before[0].1[0].generation;
    let renewed =
        to.renew(sec(10), &inside[0], "s", generation, 30_000, &mut changes).expect("the same generation renews");
    assert_eq!(renewed.expires_at, sec(40));
    // A new session there gets a generation above any the old node gave (L1, M4).
    let newest = before.iter().map(|(_, leases)| leases[0].generation).max().unwrap();
    let again = register(&to, sec(10), reg(&inside[1], "s2", "gw", 30_000), &mut changes);
    assert!(again.generation > newest, "{} after {newest}", again.generation);
    // And it expires at the deadline it had, at the new node, once.
    let expired = drive(&to, sec(10), sec(31));
    let offline_users: Vec<_> = expired.users.iter().map(|change| change.user_id.as_str()).collect();
    assert_eq!(offline_users.len(), inside.len() - 2, "all but the renewed and the re-registered: {offline_users:?}");
    assert!(expired.users.iter().all(|change| change.at == sec(30) && change.presence.version > newest));
}

#[test]
fn c3_a_released_slot_is_dropped_without_a_flip_and_the_rest_stays() {
    let store = store();
    let slots = SlotSet::of(16, [0, 1, 2]);
    let (inside, outside) = users_in_and_out_of(&slots, &store, sec(0), 64);
    let sessions_before = store.stats().sessions;
    assert_eq!(store.release_slots(sec(1), &slots), inside.len());
    assert_eq!(store.stats().sessions, sessions_before - inside.len());
    assert_eq!(store.stats().users, outside.len(), "the released users are gone");
    for user in &outside {
        assert_eq!(presence(&store, sec(1), user).state, State::Online, "{user} is not in the slots");
    }
    let later = drive(&store, sec(1), sec(29));
    assert!(later.users.is_empty(), "nothing is published for the released users: {later:?}");
}

#[test]
fn c3_a_release_of_shards_of_many_slices_drops_every_user_of_the_slots_and_no_other() {
    // 4 shards of about 2,500 users each: a release takes each in slices of
    // 1,024 users per lock hold, and must still find every user of the slots.
    let store = Store::new(StoreConfig { shards: 4, ..StoreConfig::default() }, T0).expect("valid config");
    let slots = SlotSet::of(16, [0, 5, 9]);
    let (inside, outside) = users_in_and_out_of(&slots, &store, sec(0), 10_000);
    assert_eq!(store.release_slots(sec(1), &slots), inside.len());
    assert_eq!(store.stats().users, outside.len());
    assert_eq!(store.stats().sessions, outside.len());
    for user in inside.iter().step_by(97) {
        assert_eq!(presence(&store, sec(1), user), offline(0), "{user} is in the slots: dropped");
    }
    for user in outside.iter().step_by(97) {
        assert_eq!(presence(&store, sec(1), user).state, State::Online, "{user} is not in the slots");
    }
}

#[test]
fn c3_a_paused_slots_users_do_not_expire_until_resumed() {
    let store = small_store();
    let slots = Arc::new(SlotSet::of(4, [1]));
    let mut changes = Changes::default();
    let users: Vec<String> = (0..32).map(|i| format!("u{i}")).collect();
    for user in &users {
        register(&store, T0, reg(user, "s", "gw", 10), &mut changes);
    }
    store.pause_expiry(Some(Arc::clone(&slots)));
    let due = drive(&store, T0, T0 + 500);
    assert!(!due.users.is_empty());
    assert!(due.users.iter().all(|change| !slots.holds(&change.user_id)), "no paused user expired: {due:?}");
    let others = users.iter().filter(|user| !slots.holds(user)).count();
    assert_eq!(due.users.len(), others);
    store.pause_expiry(None);
    let resumed = drive(&store, T0 + 500, T0 + 2_000);
    assert_eq!(resumed.users.len(), users.len() - others, "a failed handover's users expire a second later");
    assert!(resumed.users.iter().all(|change| slots.holds(&change.user_id) && change.presence.state == State::Offline));
}

#[test]
fn c3_a_damaged_handover_changes_nothing() {
    let (from, to) = (store(), store());
    let slots = SlotSet::of(4, [0]);
    users_in_and_out_of(&slots, &from, sec(0), 16);
    let mut bytes = from.export_slots(&slots, sec(1));
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0xff;
    assert!(to.import(sec(1), &bytes, &mut Changes::default()).is_err());
    assert_eq!(to.stats().users, 0, "nothing of a refused handover is taken");
}

// ---------------------------------------------------------------------------------------------
// C4: a follower's copy of a node's users, and taking them over when the node dies.

/// 4 shards, so that users share them; TTLs of 1 s to an hour; idle users forgotten after a minute.
fn c4_store() -> Store {
    let config =
        StoreConfig { shards: 4, min_renew_interval_ms: 0, forget_offline_after_ms: 60_000, ..StoreConfig::default() };
    Store::new(config, T0).expect("valid config")
}

/// The ids a store noted as changed, sorted.
fn changed(store: &Store) -> Vec<String> {
    let mut ids: Vec<String> = store.take_changed().into_iter().map(String::from).collect();
    ids.sort();
    ids
}

#[test]
fn c4_every_change_but_a_renewal_is_noted_for_the_follower_once() {
    let store = c4_store();
    let mut changes = Changes::default();
    register(&store, T0, reg("before", "s", "gw", 10_000), &mut changes);
    assert!(store.take_changed().is_empty(), "nothing is noted until asked");
    store.track_changes();
    let u1 = register(&store, T0, reg("u1", "s", "gw", 1_000), &mut changes);
    register(&store, T0, reg("u1", "s2", "gw", 1_000), &mut changes);
    register(&store, T0, reg("u2", "s", "gw", 10_000), &mut changes);
    assert_eq!(changed(&store), ["u1", "u2"], "each changed user once");
    assert!(changed(&store).is_empty(), "taken: nothing new");
    store.renew(T0 + 500, "u1", "s", u1.generation, 1_000, &mut changes).expect("renewed");
    assert!(changed(&store).is_empty(), "a renewal's new deadline is not sent to the follower");
    let room =
        RoomRef { user_id: "u2", session_id: "s", generation: leases(&store, T0, "u2")[0].generation, room_id: "r" };
    store.join(T0 + 500, &room, &[], &mut changes).expect("joined");
    store.set_status(T0 + 500, "before", Some(status(crate::Availability::Away, "", None)), &mut changes).expect("set");
    assert_eq!(changed(&store), ["before", "u2"], "a membership and a status are changes");
    // u1's second session expires at T0 + 1000: a change, though the user stays online.
    drive(&store, T0 + 500, T0 + 1_001);
    assert_eq!(changed(&store), ["u1"]);
    store.unregister(T0 + 1_100, "u1", "s", u1.generation, 0, &mut changes).expect("unregistered");
    assert_eq!(changed(&store), ["u1"]);
}

#[test]
fn c4_a_followers_copy_follows_the_owners_changes_and_drops_what_the_owner_forgot() {
    let (owner, copy) = (c4_store(), c4_store());
    owner.track_changes();
    let mut changes = Changes::default();
    for user in ["a", "b", "c"] {
        register(&owner, T0, reg(user, "s", "gw", 10_000), &mut changes);
    }
    let follow = |now| {
        let ids = owner.take_changed();
        let (bytes, absent) = owner.export_users(&ids, now);
        copy.import(now, &bytes, &mut Changes::default()).expect("a whole copy");
        copy.release_users(now, &absent);
    };
    follow(T0);
    let revoked = owner.revoke(T0 + 10, "b", None, &mut changes).expect("revoked");
    assert!(revoked.changed);
    follow(T0 + 10);
    for user in ["a", "b", "c"] {
        assert_eq!(presence(&copy, T0 + 10, user), presence(&owner, T0 + 10, user), "{user} as at the owner");
    }
    assert_eq!(leases(&copy, T0 + 10, "a"), leases(&owner, T0 + 10, "a"), "generation and deadline");
    // b goes idle and is forgotten at the owner: the copy forgets it too.
    drive(&owner, T0 + 10, T0 + 200_000);
    follow(T0 + 200_000);
    assert_eq!(owner.stats().users, 0, "every user is forgotten at the owner");
    assert_eq!(copy.stats().users, 0, "and in the copy: {:?}", copy.stats());
}

#[test]
fn c4_a_taken_over_user_stays_online_renews_its_sessions_and_keeps_its_version() {
    let (owner, copy, heir) = (c4_store(), c4_store(), c4_store());
    owner.track_changes();
    let mut changes = Changes::default();
    let renewed = register(&owner, T0, reg("renewed", "s", "gw", 1_000), &mut changes);
    let silent = register(&owner, T0, reg("silent", "s", "gw", 1_000), &mut changes);
    register(&owner, T0, reg("gone", "s", "gw", 1_000), &mut changes);
    owner.revoke(T0, "gone", None, &mut changes).expect("revoked");
    let ids = owner.take_changed();
    copy.import(T0, &owner.export_users(&ids, T0).0, &mut Changes::default()).expect("copied");
    // The owner renews for a while (not sent to the follower), then dies; the
    // heir takes over long after the copied deadlines.
    for at in (T0 + 500..T0 + 5_000).step_by(500) {
        owner.renew(at, "renewed", "s", renewed.generation, 1_000, &mut changes).expect("renewed");
    }
    let at = T0 + 10_000;
    let taken = heir
        .take_over(at, &copy.export_slots(&SlotSet::of(1, [0]), at), at + 3_000, &mut Changes::default())
        .expect("a whole copy is taken over");
    assert_eq!(taken, Imported { users: 3, sessions: 2 });
    for user in ["renewed", "silent", "gone"] {
        assert_eq!(presence(&heir, at, user), presence(&owner, T0, user), "{user}: the state and version copied");
    }
    // The gateway's next renewal, with its generation, is accepted (no NOT_FOUND, no re-register).
    let mut at_heir = Changes::default();
    let again = heir.renew(at + 100, "renewed", "s", renewed.generation, 5_000, &mut at_heir).expect("known session");
    assert_eq!(again.expires_at, at + 5_100);
    assert!(at_heir.users.is_empty(), "taking over published nothing: {at_heir:?}");
    // The user nobody renews goes OFFLINE once the hold ends, with a newer version.
    let ended = drive(&heir, at + 100, at + 3_001);
    assert_eq!(ended.users.len(), 1, "{ended:?}");
    assert_eq!(ended.users[0].user_id, "silent");
    assert!(ended.users[0].presence.version > silent.presence.version, "M4 across the takeover");
    // A register there issues a generation above every one the dead owner issued.
    let later = register(&heir, at + 3_100, reg("silent", "s", "gw", 1_000), &mut at_heir);
    assert!(later.generation > renewed.generation.max(silent.generation));
}

#[test]
fn c4_a_copy_started_afresh_replaces_its_slots_and_a_damaged_one_changes_nothing() {
    let (owner, copy) = (c4_store(), c4_store());
    let slots = SlotSet::of(16, [3, 7]);
    let (inside, outside) = users_in_and_out_of(&slots, &copy, sec(0), 64);
    let mut changes = Changes::default();
    register(&owner, sec(0), reg(&inside[0], "fresh", "gw", 30_000), &mut changes);
    let bytes = owner.export_slots(&slots, sec(1));
    let mut damaged = bytes.clone();
    let last = damaged.len() - 1;
    damaged[last] ^= 0xff;
    assert!(copy.replace_slots(sec(1), &slots, &damaged, &mut Changes::default()).is_err());
    assert_eq!(copy.stats().users, inside.len() + outside.len(), "a damaged update dropped nothing");
    let taken = copy.replace_slots(sec(1), &slots, &bytes, &mut Changes::default()).expect("a whole copy");
    assert_eq!(taken, Imported { users: 1, sessions: 1 });
    assert_eq!(copy.stats().users, outside.len() + 1, "the slots hold what the owner sent, nothing else");
    assert_eq!(leases(&copy, sec(1), &inside[0])[0].session_id, "fresh");
    for user in &outside {
        assert_eq!(presence(&copy, sec(1), user).state, State::Online, "{user} is not in the slots");
    }
}

// ---- Rooms across nodes (C1, R5): facts stamped out of one store, taken in by another ----

/// The session's current generation.
fn generation(store: &Store, user_id: &str, session_id: &str) -> u64 {
    let sessions = store.sessions(T0, user_id).expect("known user");
    sessions.iter().find(|view| view.lease.session_id == session_id).expect("known session").lease.generation
}

/// The session's room reference at its current generation.
fn at<'a>(store: &Store, user_id: &'a str, session_id: &'a str, room_id: &'a str) -> crate::RoomRef<'a> {
    room(user_id, session_id, generation(store, user_id, session_id), room_id)
}

/// A cluster node's store: its room facts leave it.
fn node_store() -> Store {
    let store = small_store();
    store.send_room_facts_out();
    store
}

/// A room's members (user, sessions, shown metadata) and signals (kind, users), sorted.
type RoomState = (Vec<(String, u32, Vec<(String, String)>)>, Vec<(String, Vec<String>)>);

/// Who is in the room, with sessions and shown metadata, and who signals what: a room as every viewer sees it, versions aside.
fn room_state(store: &Store, room_id: &str) -> RoomState {
    let view = store.room(room_id, usize::MAX);
    let mut members: Vec<_> = view
        .members
        .expect("listed")
        .into_iter()
        .map(|member| (member.user_id.to_string(), member.sessions, member.metadata.to_vec()))
        .collect();
    members.sort();
    let mut signals: Vec<_> = view
        .signals
        .into_iter()
        .map(|(kind, users, _)| {
            let mut users: Vec<String> = users.into_iter().map(|user| user.to_string()).collect();
            users.sort();
            (kind.to_string(), users)
        })
        .collect();
    signals.sort();
    (members, signals)
}

/// C1, R1, R2, S3: the room operations of users on two nodes, their facts
/// taken in by the room's owner, leave the owner's room as one store doing
/// them all would hold it, with a larger version after every change and the
/// nodes' own room shards untouched.
#[test]
fn c1_a_rooms_owner_taking_in_two_nodes_facts_holds_what_one_store_would() {
    let (a, b, owner, single) = (node_store(), node_store(), small_store(), small_store());
    let mut versions = Vec::new();
    let mut step = |node: &Store, name: &str, op: &dyn Fn(&Store, &mut Changes)| {
        let mut changes = Changes::default();
        op(node, &mut changes);
        assert!(changes.rooms.is_empty(), "a node's own room shards are not fed");
        let mut taken = Changes::default();
        versions.extend(owner.take_in_room_facts(T0, name, changes.room_facts, &mut taken));
        op(&single, &mut Changes::default());
    };
    let register_on = |user: &'static str, session: &'static str| {
        move |store: &Store, changes: &mut Changes| {
            store.register(T0, &reg(user, session, "g", 200), changes).unwrap();
        }
    };
    step(&a, "a", &register_on("u1", "s1"));
    step(&a, "a", &register_on("u1", "s2"));
    step(&b, "b", &register_on("u2", "s1"));
    let joins: &[(&str, &str, &str)] = &[("u1", "s1", "phone"), ("u1", "s2", "tablet"), ("u2", "s1", "web")];
    for &(user, session, device) in joins {
        let node = if user == "u1" { &a } else { &b };
        let name = if user == "u1" { "a" } else { "b" };
        step(node, name, &|store: &Store, changes: &mut Changes| {
            store.join(T0, &at(store, user, session, "r"), &meta(device), changes).unwrap();
        });
    }
    step(&b, "b", &|store: &Store, changes: &mut Changes| {
        store.signal(T0, &at(store, "u2", "s1", "r"), "typing", 5_000, changes).unwrap();
    });
    assert_eq!(room_state(&owner, "r"), room_state(&single, "r"));
    assert_eq!(room_state(&owner, "r").0.len(), 2);
    step(&a, "a", &|store: &Store, changes: &mut Changes| {
        store.leave(T0, &at(store, "u1", "s2", "r"), changes).unwrap();
    });
    step(&b, "b", &|store: &Store, changes: &mut Changes| {
        store.unregister(T0, "u2", "s1", generation(store, "u2", "s1"), 0, changes).unwrap();
    });
    assert_eq!(room_state(&owner, "r"), room_state(&single, "r"));
    assert_eq!(room_state(&owner, "r").0, vec![("u1".to_string(), 1, meta("phone"))]);
    assert!(versions.windows(2).all(|pair| pair[0] <= pair[1]), "{versions:?}");
    assert!(versions.last() > versions.first());
    assert_eq!(a.room("r", usize::MAX).users, 0, "the node holds no room of its own");
}

/// C3, M4: a user handed from node A to node B joins nothing anew: B's
/// facts carry greater stamps than every fact A made, so A's facts that
/// arrive late (a leave, a join) are refused, and the owner keeps B's word.
/// The user's signal did not move with it and ends.
#[test]
fn c3_a_moved_users_late_facts_from_its_old_node_are_refused() {
    let (a, b, owner) = (node_store(), node_store(), small_store());
    let mut early = Changes::default();
    register(&a, T0, reg("u", "s", "g", 200), &mut early);
    a.join(T0, &at(&a, "u", "s", "r"), &meta("phone"), &mut early).unwrap();
    a.signal(T0, &at(&a, "u", "s", "r"), "typing", 5_000, &mut early).unwrap();
    let mut late = Changes::default();
    a.leave(T0 + 1, &at(&a, "u", "s", "r"), &mut late).unwrap();
    a.join(T0 + 2, &at(&a, "u", "s", "r"), &meta("laptop"), &mut late).unwrap();
    owner.take_in_room_facts(T0, "a", early.room_facts, &mut Changes::default());
    assert!(owner.room("r", usize::MAX).signals.len() == 1);

    let (bytes, _) = a.export_users(&["u".into()], T0 + 3);
    let mut moved = Changes::default();
    b.import(T0 + 3, &bytes, &mut moved).unwrap();
    let mut seen = Changes::default();
    owner.take_in_room_facts(T0 + 3, "b", moved.room_facts, &mut seen);
    assert_eq!(room_state(&owner, "r").0, vec![("u".to_string(), 1, meta("laptop"))]);
    assert!(owner.room("r", usize::MAX).signals.is_empty(), "the signal stayed on node A");

    let mut after = Changes::default();
    let versions = owner.take_in_room_facts(T0 + 4, "a", late.room_facts, &mut after);
    assert!(after.rooms.is_empty(), "late facts of the old node change nothing: {:?}", after.rooms);
    assert_eq!(room_state(&owner, "r").0, vec![("u".to_string(), 1, meta("laptop"))]);
    assert!(versions.iter().all(|&version| version == owner.room("r", 0).version));
}

/// C1: a node that lost facts on their way re-asserts where its users stand:
/// the owner takes a member the scan leaves out for one that left and ends
/// signals it leaves out, keeps members other nodes sent, and keeps a join
/// made after the scan that reached it first.
#[test]
fn c1_a_nodes_scan_mends_the_facts_its_rooms_owner_missed() {
    let (a, b, owner) = (node_store(), node_store(), small_store());
    let mut sent = Changes::default();
    for user in ["u1", "u2"] {
        register(&a, T0, reg(user, "s", "g", 200), &mut sent);
        a.join(T0, &at(&a, user, "s", "r"), &[], &mut sent).unwrap();
        a.join(T0, &at(&a, user, "s", "other"), &[], &mut sent).unwrap();
    }
    a.signal(T0, &at(&a, "u1", "s", "r"), "typing", 5_000, &mut sent).unwrap();
    register(&b, T0, reg("w", "s", "g", 200), &mut sent);
    b.join(T0, &at(&b, "w", "s", "r"), &[], &mut sent).unwrap();
    let (from_a, from_b): (Vec<_>, Vec<_>) = sent.room_facts.into_iter().partition(|fact| fact.fact.user_id() != "w");
    owner.take_in_room_facts(T0, "a", from_a, &mut Changes::default());
    owner.take_in_room_facts(T0, "b", from_b, &mut Changes::default());

    let mut lost = Changes::default();
    a.leave(T0 + 1, &at(&a, "u2", "s", "r"), &mut lost).unwrap();
    a.signal(T0 + 1, &at(&a, "u1", "s", "r"), "typing", 0, &mut lost).unwrap();
    let only_r = |room_id: &str| room_id == "r";
    let scan = a.room_facts_held(T0 + 2, &|_| true, &only_r);
    assert!(scan.facts.iter().all(|fact| fact.fact.room_id() == "r"));
    let mut after_scan = Changes::default();
    register(&a, T0 + 3, reg("u3", "s", "g", 200), &mut after_scan);
    a.join(T0 + 3, &at(&a, "u3", "s", "r"), &[], &mut after_scan).unwrap();
    owner.take_in_room_facts(T0 + 3, "a", after_scan.room_facts, &mut Changes::default());

    let mut mended = Changes::default();
    owner.take_in_room_scan(T0 + 4, "a", &only_r, scan, ScanTakenFor::Mending, &mut mended);
    let users: Vec<String> = room_state(&owner, "r").0.into_iter().map(|(user, ..)| user).collect();
    assert_eq!(users, ["u1", "u3", "w"]);
    assert!(owner.room("r", usize::MAX).signals.is_empty());
    assert_eq!(owner.room("other", usize::MAX).users, 2, "a room the scan was not about is left alone");
    assert!(!mended.rooms.is_empty());
}

/// C1, C4: the members a node gone from the cluster last spoke for leave its
/// rooms when it is forgotten; a user of it that another node took in since,
/// and other nodes' members, stay.
#[test]
fn c4_a_gone_nodes_members_leave_but_those_taken_over_stay() {
    let (a, b, owner) = (node_store(), node_store(), small_store());
    let mut from_a = Changes::default();
    for user in ["lost", "saved"] {
        register(&a, T0, reg(user, "s", "g", 200), &mut from_a);
        a.join(T0, &at(&a, user, "s", "r"), &[], &mut from_a).unwrap();
    }
    let mut from_b = Changes::default();
    register(&b, T0, reg("w", "s", "g", 200), &mut from_b);
    b.join(T0, &at(&b, "w", "s", "r"), &[], &mut from_b).unwrap();
    owner.take_in_room_facts(T0, "a", from_a.room_facts, &mut Changes::default());
    owner.take_in_room_facts(T0, "b", from_b.room_facts, &mut Changes::default());
    // b takes "saved" over from its copy of a: its facts speak for it now.
    let (copy, _) = a.export_users(&["saved".into()], T0 + 1);
    let mut taken = Changes::default();
    b.take_over(T0 + 1, &copy, T0 + 3_000, &mut taken).unwrap();
    assert!(!taken.room_facts.is_empty(), "a take-over tells the rooms' owners");
    owner.take_in_room_facts(T0 + 1, "b", taken.room_facts, &mut Changes::default());
    assert_eq!(owner.room_fact_sources(), ["a", "b"]);

    let mut forgotten = Changes::default();
    owner.forget_room_fact_source(T0 + 2, "a", &mut forgotten);
    let users: Vec<String> = room_state(&owner, "r").0.into_iter().map(|(user, ..)| user).collect();
    assert_eq!(users, ["saved", "w"]);
    assert_eq!(forgotten.rooms.len(), 1, "one leave published: {:?}", forgotten.rooms);
    assert_eq!(owner.room_fact_sources(), ["b"]);
}

/// C1, R4: a room taken in from nodes' facts counts, for viewers, only the
/// members their own nodes do not hold invisible, sessions too, as their
/// visibility changes and they come and go.
#[test]
fn c1_a_rooms_visible_counts_leave_out_members_their_nodes_hold_invisible() {
    let (a, owner) = (node_store(), small_store());
    let mut sent = Changes::default();
    for (user, sessions) in [("shy", 2), ("open", 1)] {
        for session in ["s1", "s2"].into_iter().take(sessions) {
            register(&a, T0, reg(user, session, "g", 200), &mut sent);
            a.join(T0, &at(&a, user, session, "r"), &[], &mut sent).unwrap();
        }
    }
    let marked = |facts: Vec<StampedRoomFact>, shy: bool| -> Vec<StampedRoomFact> {
        facts
            .into_iter()
            .map(|mut fact| {
                fact.invisible = shy && fact.fact.user_id() == "shy";
                fact
            })
            .collect()
    };
    let counted = || {
        let (_, users, sessions) = owner.room_visible_tally("r");
        (users, sessions)
    };
    owner.take_in_room_facts(T0, "a", marked(sent.room_facts, true), &mut Changes::default());
    assert_eq!(counted(), (1, 1), "shy and its two sessions are counted by nobody");
    assert_eq!(owner.room("r", usize::MAX).users, 2, "though it is a member");

    // shy becomes visible at its node, which says so again.
    let scan = a.room_facts_held(T0 + 1, &|user| user == "shy", &|_| true);
    owner.take_in_room_facts(T0 + 1, "a", marked(scan.facts, false), &mut Changes::default());
    assert_eq!(counted(), (2, 3));
    // And invisible again; then one of its sessions leaves, then the other.
    let scan = a.room_facts_held(T0 + 2, &|user| user == "shy", &|_| true);
    owner.take_in_room_facts(T0 + 2, "a", marked(scan.facts, true), &mut Changes::default());
    let mut left = Changes::default();
    a.leave(T0 + 3, &at(&a, "shy", "s1", "r"), &mut left).unwrap();
    owner.take_in_room_facts(T0 + 3, "a", marked(left.room_facts, true), &mut Changes::default());
    assert_eq!(counted(), (1, 1));
    assert_eq!(owner.room("r", usize::MAX).sessions, 2);
    let mut left = Changes::default();
    a.leave(T0 + 4, &at(&a, "shy", "s2", "r"), &mut left).unwrap();
    owner.take_in_room_facts(T0 + 4, "a", marked(left.room_facts, true), &mut Changes::default());
    assert_eq!((counted(), owner.room("r", usize::MAX).users), ((1, 1), 1));
}

/// M4, C3: a room's new owner whose clock runs behind its old owner's
/// numbers versions above the old owner's once it raised its clocks to the
/// old owner's room clock, as a move's scan carries it.
#[test]
fn m4_a_rooms_new_owner_numbers_versions_above_the_old_owners_clock() {
    let (a, old_owner, new_owner) = (node_store(), small_store(), small_store());
    let mut sent = Changes::default();
    register(&a, T0, reg("u", "s", "g", 200), &mut sent);
    a.join(T0, &at(&a, "u", "s", "r"), &[], &mut sent).unwrap();
    // The old owner's clock is 10 s ahead of the new owner's.
    let facts = sent.room_facts;
    let before = *old_owner.take_in_room_facts(sec(10), "a", facts.clone(), &mut Changes::default()).last().unwrap();
    assert!(old_owner.room_clock() >= before);
    let behind = *small_store().take_in_room_facts(T0, "a", facts.clone(), &mut Changes::default()).last().unwrap();
    assert!(behind < before, "a clock behind numbers lower versions");
    new_owner.raise_room_clocks(old_owner.room_clock());
    let after = *new_owner.take_in_room_facts(T0, "a", facts, &mut Changes::default()).last().unwrap();
    assert!(after > before, "{after} after {before}");
}

/// C1: a room whose slot another node owns now is forgotten without a word,
/// its access kept for when it comes back.
#[test]
fn c1_rooms_given_up_are_forgotten_publishing_nothing() {
    let (a, owner) = (node_store(), small_store());
    let mut sent = Changes::default();
    register(&a, T0, reg("u", "s", "g", 200), &mut sent);
    a.join(T0, &at(&a, "u", "s", "r"), &[], &mut sent).unwrap();
    a.join(T0, &at(&a, "u", "s", "kept"), &[], &mut sent).unwrap();
    owner.take_in_room_facts(T0, "a", sent.room_facts, &mut Changes::default());
    owner.set_room_access("r", crate::RoomAccess::Public).unwrap();
    owner.forget_rooms(&|room_id| room_id == "r");
    let view = owner.room("r", usize::MAX);
    assert_eq!((view.users, view.access), (0, crate::RoomAccess::Public));
    assert_eq!(owner.room("kept", usize::MAX).users, 1);
}

/// C1, C3: however two nodes' fact streams interleave on their way to a
/// room's owner (each in the order its node made them), and wherever a user
/// moves from one node to the other on the way, the owner ends up holding the
/// rooms one store doing every operation would hold (the moved user's
/// signals end, as they do not move).
mod rooms_across_nodes {
    use proptest::prelude::*;

    use super::*;

    /// (user 0..4, session 0..2, action 0..5, room 0..2, metadata 0..2)
    type Op = (usize, usize, u8, usize, usize);

    fn run(store: &Store, now: Tick, (user, session, action, room_at, device): Op, changes: &mut Changes) {
        let (user, session) = (["u0", "u1", "u2", "u3"][user], ["s0", "s1"][session]);
        let room_id = ["r0", "r1"][room_at];
        let generation = store.sessions(now, user).ok().and_then(|sessions| {
            sessions.iter().find(|view| view.lease.session_id == session).map(|v| v.lease.generation)
        });
        let Some(generation) = generation else {
            store.register(now, &reg(user, session, "g", 200), changes).unwrap();
            return;
        };
        let target = room(user, session, generation, room_id);
        let _ = match action {
            0 | 1 => store.join(now, &target, &meta(["phone", "web"][device]), changes).map(|_| ()),
            2 => store.leave(now, &target, changes).map(|_| ()),
            3 => store.signal(now, &target, "typing", 100 * (device as u32), changes).map(|_| ()),
            _ => store.unregister(now, user, session, generation, 0, changes).map(|_| ()),
        };
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(128))]
        #[test]
        fn c1_any_interleaving_of_two_nodes_facts_converges(
            ops in prop::collection::vec((0..4usize, 0..2usize, 0..5u8, 0..2usize, 0..2usize), 1..60),
            order in prop::collection::vec(any::<bool>(), 0..400),
            move_at in 0..60usize,
        ) {
            let (a, b, owner, single) = (node_store(), node_store(), small_store(), small_store());
            let (mut from_a, mut from_b) = (Changes::default(), Changes::default());
            for (step, &op) in ops.iter().enumerate() {
                let now = T0 + step as Tick;
                if step == move_at {
                    let (bytes, _) = a.export_users(&["u0".into()], now);
                    b.import(now, &bytes, &mut from_b).unwrap();
                    a.release_users(now, &["u0".into()]);
                    for (session, room_id) in [("s0", "r0"), ("s0", "r1"), ("s1", "r0"), ("s1", "r1")] {
                        if let Ok(sessions) = single.sessions(now, "u0")
                            && let Some(view) = sessions.iter().find(|view| view.lease.session_id == session)
                        {
                            let target = room("u0", session, view.lease.generation, room_id);
                            let _ = single.signal(now, &target, "typing", 0, &mut Changes::default());
                        }
                    }
                }
                let on_a = op.0 == 1 || (op.0 == 0 && step < move_at);
                let (node, facts) = if on_a { (&a, &mut from_a) } else { (&b, &mut from_b) };
                run(node, now, op, facts);
                run(&single, now, op, &mut Changes::default());
            }
            let (mut from_a, mut from_b) = (from_a.room_facts.into_iter(), from_b.room_facts.into_iter());
            let mut order = order.into_iter();
            loop {
                let fact = match order.next() {
                    Some(true) => from_a.next().map(|fact| ("a", fact)).or_else(|| from_b.next().map(|fact| ("b", fact))),
                    _ => from_b.next().map(|fact| ("b", fact)).or_else(|| from_a.next().map(|fact| ("a", fact))),
                };
                let Some((source, fact)) = fact else { break };
                owner.take_in_room_facts(T0 + 100, source, vec![fact], &mut Changes::default());
            }
            for room_id in ["r0", "r1"] {
                prop_assert_eq!(room_state(&owner, room_id), room_state(&single, room_id));
            }
        }
    }
}

#[test]
fn c7_a_moves_copy_made_while_served_and_sent_its_changes_ends_equal_to_the_source() {
    let (source, target) = (c4_store(), c4_store());
    let slots = 4;
    let users: Vec<String> = (0..40).map(|n| format!("u{n}")).collect();
    let mut changes = Changes::default();
    let mut generations = std::collections::HashMap::new();
    for user in &users {
        generations.insert(user.clone(), register(&source, T0, reg(user, "s", "gw", 1_000), &mut changes).generation);
    }
    let moving = SlotSet::of(slots, [1]);
    let in_move: Vec<&String> = users.iter().filter(|user| moving.holds(user)).collect();
    assert!(in_move.len() > 3 && in_move.len() < users.len(), "some users in the slot, not all");
    source.track_moving(Some(&moving));
    // The copy, then the source serves on: renewals, an unregister, a new user, an expiry.
    target.import(T0, &source.export_slots(&moving, T0), &mut Changes::default()).expect("the copy");
    for user in &in_move[1..] {
        source.renew(T0 + 400, user, "s", generations[*user], 1_000, &mut changes).expect("renewed");
    }
    source.unregister(T0 + 400, in_move[1], "s", generations[in_move[1]], 0, &mut changes).expect("unregistered");
    let newcomer = users.iter().map(|user| format!("{user}-new")).find(|user| moving.holds(user)).expect("one");
    register(&source, T0 + 400, reg(&newcomer, "s", "gw", 1_000), &mut changes);
    let outside = users.iter().find(|user| !moving.holds(user)).expect("one outside");
    source.renew(T0 + 400, outside, "s", generations[outside], 1_000, &mut changes).expect("renewed");
    drive(&source, T0 + 400, T0 + 1_001);

    let mut changed = source.take_moving_changed();
    changed.sort();
    assert!(!changed.iter().any(|user| !moving.holds(user)), "only the moving slots' users: {changed:?}");
    assert_eq!(changed.len(), in_move.len() + 1, "every user of the slot changed, and the newcomer: {changed:?}");
    let (bytes, absent) = source.export_users(&changed, T0 + 1_001);
    target.replace_users(T0 + 1_001, &bytes, &absent, &mut Changes::default()).expect("the changes");
    for user in in_move.iter().map(|user| user.as_str()).chain([newcomer.as_str()]) {
        assert_eq!(presence(&target, T0 + 1_001, user), presence(&source, T0 + 1_001, user), "{user}");
        assert_eq!(leases(&target, T0 + 1_001, user), leases(&source, T0 + 1_001, user), "{user}'s deadlines");
    }
    assert!(source.take_moving_changed().is_empty(), "taken: nothing new");
    source.track_moving(None);
    source.renew(T0 + 1_200, in_move[2], "s", generations[in_move[2]], 1_000, &mut changes).expect("renewed");
    assert!(source.take_moving_changed().is_empty(), "nothing is noted once the move stopped tracking");
}

mod attention {
    use super::*;
    use crate::ChangeKind;
    use crate::attention::{
        Activity, Attention, AttentionChange, DeviceKind, MAX_NOTIFY_USERS, NotifyPolicy, NotifyReason, Urgency,
    };

    fn says(attention: Attention, device: Option<DeviceKind>) -> AttentionChange<'static> {
        AttentionChange { attention: Some(attention), device, focused_room_id: None }
    }

    fn decide(
        store: &Store,
        now: Tick,
        user_id: &str,
        room_id: Option<&str>,
    ) -> (Vec<String>, bool, u64, NotifyReason) {
        let policy = NotifyPolicy::default();
        let decision = store.notify_targets(now, &[user_id], room_id, Urgency::Normal, &policy).unwrap().remove(0);
        let in_app = decision.in_app.iter().map(ToString::to_string).collect();
        (in_app, decision.push_now, decision.push_after_ms, decision.reason)
    }

    /// A1, A3 through the store: attention is named by lease, ends with it, and
    /// a reconnect starts without it.
    #[test]
    fn a1_attention_is_the_leases_and_ends_with_it() {
        let store = store();
        let mut changes = Changes::default();
        let laptop = register(&store, sec(0), reg("ann", "laptop", "gw", 30_000), &mut changes).generation;
        let phone = register(&store, sec(0), reg("ann", "phone", "gw", 30_000), &mut changes).generation;
        let active = says(Attention::Active, Some(DeviceKind::Desktop));
        assert_eq!(store.set_attention(sec(1), ("ann", "laptop", laptop), &active, &mut changes), Ok(true));
        assert_eq!(store.set_attention(sec(1), ("ann", "laptop", laptop), &active, &mut changes), Ok(false));
        let background = says(Attention::Background, Some(DeviceKind::Mobile));
        assert_eq!(store.set_attention(sec(1), ("ann", "phone", phone), &background, &mut changes), Ok(true));
        assert_eq!(
            decide(&store, sec(2), "ann", None),
            (vec!["laptop".into()], false, 60_000, NotifyReason::AttendedElsewhere)
        );

        // A late change from a dead socket is refused as its renewal would be (L2).
        let stale = store.set_attention(sec(2), ("ann", "laptop", laptop - 1), &background, &mut changes);
        assert!(matches!(stale, Err(LeaseError::StaleGeneration { .. })), "{stale:?}");
        let unknown = store.set_attention(sec(2), ("ann", "tablet", 7), &background, &mut changes);
        assert!(matches!(unknown, Err(LeaseError::NotFound { .. })), "{unknown:?}");
        let bad = AttentionChange { focused_room_id: Some(&"r".repeat(129)), ..Default::default() };
        let refused = store.set_attention(sec(2), ("ann", "laptop", laptop), &bad, &mut changes);
        assert!(matches!(refused, Err(LeaseError::InvalidArgument { field: "focused_room_id", .. })), "{refused:?}");

        // The laptop reconnects: the new connection has said nothing yet.
        register(&store, sec(3), reg("ann", "laptop", "gw", 30_000), &mut changes);
        let (in_app, push_now, _, reason) = decide(&store, sec(3), "ann", None);
        assert_eq!((push_now, reason), (true, NotifyReason::NoAttendedSession), "the phone said, never active");
        assert_eq!(in_app, vec!["laptop".to_owned()]);

        // The laptop says it is active, then its session ends: the lease slot,
        // taken by ann's next session (same shard), starts with nothing.
        let sessions = store.sessions(sec(4), "ann").unwrap();
        let again = sessions.iter().find(|session| session.lease.session_id == "laptop").unwrap().lease.generation;
        store.set_attention(sec(4), ("ann", "laptop", again), &active, &mut changes).unwrap();
        assert_eq!(decide(&store, sec(4), "ann", None).3, NotifyReason::AttendedElsewhere);
        store.unregister(sec(4), "ann", "laptop", again, 0, &mut changes).unwrap();
        register(&store, sec(5), reg("ann", "tablet", "gw", 30_000), &mut changes);
        let (in_app, push_now, _, reason) = decide(&store, sec(5), "ann", None);
        assert_eq!((in_app, push_now, reason), (vec!["tablet".to_owned()], true, NotifyReason::NoAttendedSession));

        // The phone's lease expires: ann is offline, and a push goes at once.
        assert_eq!(decide(&store, sec(40), "ann", None).3, NotifyReason::Offline);
    }

    #[test]
    fn a4_a_batch_answers_in_order_and_has_a_cap() {
        let store = store();
        let mut changes = Changes::default();
        let generation = register(&store, sec(0), reg("cat", "desk", "gw", 30_000), &mut changes).generation;
        let focus =
            AttentionChange { attention: Some(Attention::Active), device: None, focused_room_id: Some("doc-7") };
        store.set_attention(sec(0), ("cat", "desk", generation), &focus, &mut changes).unwrap();
        let users = ["dan", "cat", "cat"];
        let policy = NotifyPolicy::default();
        let answers = store.notify_targets(sec(1), &users, Some("doc-7"), Urgency::Normal, &policy).unwrap();
        let reasons: Vec<NotifyReason> = answers.iter().map(|answer| answer.reason).collect();
        assert_eq!(reasons, [NotifyReason::Offline, NotifyReason::RoomOpen, NotifyReason::RoomOpen]);
        let urgent = store.notify_targets(sec(1), &users, Some("doc-7"), Urgency::Urgent, &policy).unwrap();
        assert!(urgent.iter().all(|answer| answer.push_now && answer.reason == NotifyReason::Urgent));

        let many: Vec<String> = (0..=MAX_NOTIFY_USERS).map(|i| format!("u{i}")).collect();
        let refused = store.notify_targets(sec(1), &many, None, Urgency::Normal, &policy);
        assert!(matches!(refused, Err(LeaseError::InvalidArgument { field: "user_ids", .. })), "{refused:?}");
        let bad_room = store.notify_targets(sec(1), &users, Some(""), Urgency::Normal, &policy);
        assert!(matches!(bad_room, Err(LeaseError::InvalidArgument { field: "room_id", .. })), "{bad_room:?}");
    }

    /// What the store shows viewers of `user_id` at `now`.
    fn shown(store: &Store, now: Tick, user_id: &str) -> (State, Option<Activity>, u64) {
        let presence = presence(store, now, user_id);
        (presence.state, presence.activity, presence.version)
    }

    /// The availability changes among `changes`, as (user, availability, at).
    fn activity_changes(changes: &Changes) -> Vec<(String, Option<Activity>, Tick)> {
        changes
            .users
            .iter()
            .filter(|change| change.kind == ChangeKind::Activity)
            .map(|change| (change.user_id.to_string(), change.presence.activity, change.at))
            .collect()
    }

    /// A2 through the store and its wheel: a register that says ACTIVE shows
    /// it with its flip (one change, one version); ACTIVE lasts the window
    /// after the last activity and then turns AWAY on time through the
    /// wheel, nobody touching the user; coming back is ACTIVE at once.
    #[test]
    fn a2_active_lasts_the_window_after_the_last_activity_then_away_through_the_wheel() {
        let store = store();
        let mut changes = Changes::default();
        let registration = reg("ann", "laptop", "gw", 300_000);
        let active = says(Attention::Active, Some(DeviceKind::Desktop));
        let laptop = store.register_attending(sec(0), &registration, &active, &mut changes).unwrap().generation;
        assert_eq!(changes.users.len(), 1, "one change: {changes:?}");
        assert_eq!(
            (changes.users[0].kind, changes.users[0].presence.activity),
            (ChangeKind::Flip, Some(Activity::Active))
        );
        let (_, _, flipped) = shown(&store, sec(1), "ann");

        // The screen locks at 10.4 s: still active, and nothing is published, until 71 s
        // (the moment kept rounded up to the second, so never early).
        let mut changes = Changes::default();
        let background = says(Attention::Background, None);
        assert_eq!(store.set_attention(sec(10) + 400, ("ann", "laptop", laptop), &background, &mut changes), Ok(true));
        assert!(changes.users.is_empty(), "within the window: {changes:?}");
        assert_eq!(shown(&store, sec(70), "ann"), (State::Online, Some(Activity::Active), flipped));
        let away = drive(&store, sec(11), sec(80));
        assert_eq!(activity_changes(&away), [("ann".to_owned(), Some(Activity::Away), sec(71))]);
        let (state, activity, version) = shown(&store, sec(80), "ann");
        assert_eq!((state, activity), (State::Online, Some(Activity::Away)));
        assert!(version > flipped, "a change viewers see is a new version (M3)");
        assert_eq!(version, away.users[0].presence.version);

        // Back at the keyboard: active at once.
        let mut changes = Changes::default();
        store.set_attention(sec(90), ("ann", "laptop", laptop), &active, &mut changes).unwrap();
        assert_eq!(activity_changes(&changes), [("ann".to_owned(), Some(Activity::Active), sec(90))]);
        assert!(changes.users[0].presence.version > version);
    }

    /// A2's damping: a quick switch of tabs publishes nothing and moves no
    /// version; idle is not active either; a window of 0 shows AWAY at once.
    #[test]
    fn a2_a_quick_tab_switch_never_shows_away() {
        let store = store();
        let mut changes = Changes::default();
        let tab = store
            .register_attending(sec(0), &reg("ann", "tab", "gw", 300_000), &says(Attention::Active, None), &mut changes)
            .unwrap()
            .generation;
        let before = shown(&store, sec(0), "ann");
        let mut changes = Changes::default();
        for (at, attention) in [(5, Attention::Background), (8, Attention::Active), (20, Attention::Idle)] {
            store.set_attention(sec(at), ("ann", "tab", tab), &says(attention, None), &mut changes).unwrap();
        }
        changes.users.extend(drive(&store, sec(20), sec(79)).users);
        assert!(changes.users.is_empty(), "nothing to publish: {changes:?}");
        assert_eq!(shown(&store, sec(79), "ann"), before);
        assert_eq!(activity_changes(&drive(&store, sec(79), sec(81))).len(), 1, "idle since 20 s: away at 80 s");

        let undamped = Store::new(StoreConfig { active_window_ms: 0, ..StoreConfig::default() }, T0).unwrap();
        let mut changes = Changes::default();
        let tab = undamped
            .register_attending(sec(0), &reg("bob", "tab", "gw", 30_000), &says(Attention::Active, None), &mut changes)
            .unwrap()
            .generation;
        let mut changes = Changes::default();
        undamped.set_attention(sec(1), ("bob", "tab", tab), &says(Attention::Background, None), &mut changes).unwrap();
        assert_eq!(activity_changes(&changes), [("bob".to_owned(), Some(Activity::Away), sec(1))]);
    }

    /// A2: availability is the live sessions': it ends with the session that
    /// made it (unregister, expiry, revoke, a reconnect that has not said yet),
    /// and an offline user has none; a user whose sessions say nothing has
    /// none, exactly as before attention existed.
    #[test]
    fn a2_availability_ends_with_the_sessions_that_made_it() {
        let store = store();
        let mut changes = Changes::default();
        let active = says(Attention::Active, Some(DeviceKind::Desktop));
        let background = says(Attention::Background, Some(DeviceKind::Mobile));
        let laptop =
            store.register_attending(sec(0), &reg("ann", "laptop", "gw", 300_000), &active, &mut changes).unwrap();
        store.register_attending(sec(0), &reg("ann", "phone", "gw", 30_000), &background, &mut changes).unwrap();
        let mut changes = Changes::default();
        store.unregister(sec(1), "ann", "laptop", laptop.generation, 0, &mut changes).unwrap();
        assert_eq!(activity_changes(&changes), [("ann".to_owned(), Some(Activity::Away), sec(1))]);
        // The laptop comes back and says nothing yet: the phone still says background.
        let laptop = register(&store, sec(2), reg("ann", "laptop", "gw", 300_000), &mut changes);
        assert_eq!(shown(&store, sec(2), "ann").1, Some(Activity::Away));
        store.set_attention(sec(3), ("ann", "laptop", laptop.generation), &active, &mut changes).unwrap();
        // The phone expires at 30 s: the laptop is active, nothing changes; a
        // reconnect of the laptop forgets what it said: none is left that says.
        let mut changes = drive(&store, sec(3), sec(31));
        assert!(activity_changes(&changes).is_empty(), "{changes:?}");
        register(&store, sec(40), reg("ann", "laptop", "gw", 300_000), &mut changes);
        assert_eq!(activity_changes(&changes).last(), Some(&("ann".to_owned(), None, sec(40))));
        // Revoked: the OFFLINE flip carries no availability.
        let mut changes = Changes::default();
        store
            .set_attention(
                sec(41),
                ("ann", "laptop", store.sessions(sec(41), "ann").unwrap()[0].lease.generation),
                &active,
                &mut changes,
            )
            .unwrap();
        store.revoke(sec(42), "ann", None, &mut changes).unwrap();
        let flip = changes.users.last().unwrap();
        assert_eq!((flip.kind, flip.presence.state, flip.presence.activity), (ChangeKind::Flip, State::Offline, None));

        // A gateway that says nothing of attention: no availability, no change beyond the flip.
        let mut changes = Changes::default();
        register(&store, sec(50), reg("bob", "tab", "gw", 30_000), &mut changes);
        assert_eq!(changes.users.len(), 1);
        assert_eq!(shown(&store, sec(51), "bob").1, None);
    }

    /// A2 with P3: a user that does not share its availability is shown as
    /// one whose sessions never said anything, at once and for as long as it
    /// does not, and shown again at once when it shares again.
    #[test]
    fn a2_a_user_that_does_not_share_it_is_shown_as_one_that_never_said() {
        let store = store();
        let mut changes = Changes::default();
        let active = says(Attention::Active, None);
        let ann =
            store.register_attending(sec(0), &reg("ann", "laptop", "gw", 300_000), &active, &mut changes).unwrap();
        register(&store, sec(0), reg("bob", "laptop", "gw", 300_000), &mut changes);
        let mut changes = Changes::default();
        store.set_shares_activity(sec(1), "ann", false, &mut changes).unwrap();
        assert_eq!(activity_changes(&changes), [("ann".to_owned(), None, sec(1))]);
        let (ann_shown, bob_shown) = (presence(&store, sec(2), "ann"), presence(&store, sec(2), "bob"));
        assert_eq!((ann_shown.state, ann_shown.activity), (bob_shown.state, bob_shown.activity));
        // Changes of its attention while hidden publish nothing and move no version.
        let mut changes = Changes::default();
        store
            .set_attention(sec(3), ("ann", "laptop", ann.generation), &says(Attention::Background, None), &mut changes)
            .unwrap();
        changes.users.extend(drive(&store, sec(3), sec(200)).users);
        assert!(changes.users.is_empty(), "{changes:?}");
        assert_eq!(presence(&store, sec(200), "ann"), ann_shown);
        // Hidden from a user the store does not hold yet, and kept past its forget.
        store.set_shares_activity(sec(200), "cid", false, &mut changes).unwrap();
        let cid = store.register_attending(sec(201), &reg("cid", "tab", "gw", 30_000), &active, &mut changes).unwrap();
        assert_eq!(cid.presence.activity, None);
        // Shared again: shown at once, as the sessions make it.
        let mut changes = Changes::default();
        store.set_shares_activity(sec(202), "ann", true, &mut changes).unwrap();
        assert_eq!(activity_changes(&changes), [("ann".to_owned(), Some(Activity::Away), sec(202))]);
        assert!(store.set_shares_activity(sec(202), "", true, &mut changes).is_err(), "the id is checked");
    }

    /// A2 and F1: an availability change is its own kind in the change feed,
    /// in the user's version order.
    #[test]
    fn a2_availability_changes_reach_the_feed_as_their_own_kind() {
        let feed = crate::FeedIntake::new(1_000, 0);
        let store = store().with_feed(feed.clone());
        let mut changes = Changes::default();
        let tab = store
            .register_attending(sec(0), &reg("ann", "tab", "gw", 300_000), &says(Attention::Active, None), &mut changes)
            .unwrap();
        store
            .set_attention(sec(1), ("ann", "tab", tab.generation), &says(Attention::Background, None), &mut changes)
            .unwrap();
        drive(&store, sec(1), sec(62));
        let kinds: Vec<(ChangeKind, Option<Activity>)> = feed
            .drain(sec(62))
            .entries
            .into_iter()
            .filter_map(|entry| match entry.event {
                crate::FeedEvent::User(change) => Some((change.kind, change.presence.activity)),
                _ => None,
            })
            .collect();
        assert_eq!(kinds, [(ChangeKind::Flip, Some(Activity::Active)), (ChangeKind::Activity, Some(Activity::Away))]);
    }
}
