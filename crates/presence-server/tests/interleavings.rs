//! The concurrency checker: shuttle runs the real store, publish path, hub,
//! Watch opening and resync on threads whose order it chooses, schedule after
//! schedule, and each test checks the contract's rules on the outcome.
//!
//! Run with `cargo test -p presence-server --features shuttle --test interleavings`.
//! Each test runs `INTERLEAVINGS_ITERATIONS` schedules (default 300) under the
//! random scheduler and as many under PCT (depth 3), from the fixed seed
//! `SHUTTLE_RANDOM_SEED` overrides. A failure prints the failing schedule;
//! `INTERLEAVINGS_REPLAY='<schedule>' cargo test ... <test name>` runs that
//! one again (the schedule as printed, quotes and line breaks included or not).

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use presence_core::{Changes, CompactString, Presence, PresenceChange, Registration, State, Store, StoreConfig, Tick};
use presence_server::checker::{Node, Snapshot};
use presence_server::{Delivery, Subscription};
use shuttle::rand::{Rng, thread_rng};
use shuttle::scheduler::{PctScheduler, RandomScheduler};
use shuttle::sync::atomic::{AtomicBool, Ordering};
use shuttle::{Config, Runner, thread};

/// The store time every request runs at (Unix ms); expiries run later.
const T0: Tick = 1_000_000;
/// The TTL of every lease: an expiry at `T0 + 2 * TTL` ends those taken at `T0`.
const TTL_MS: u32 = 1_000;
/// Resyncs taken over all schedules of the process: a test of the resync
/// path checks that its schedules reached it (a std atomic: shuttle's
/// would be one more place to switch threads, for a count no thread reads).
static RESYNCS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
/// The user whose ONLINE, published after every writer finished, tells a viewer to stop.
const END: &str = "end";

/// Runs `test` under both schedulers, says how many schedules it explored
/// and returns that (0: one schedule was replayed).
fn check(name: &str, test: impl Fn() + Send + Sync + 'static) -> usize {
    let test = Arc::new(test);
    if let Ok(schedule) = std::env::var("INTERLEAVINGS_REPLAY") {
        // As printed, the schedule is quoted and wrapped over lines.
        let schedule: String = schedule.chars().filter(|c| !c.is_whitespace() && *c != '"').collect();
        shuttle::replay(move || test(), &schedule);
        return 0;
    }
    let iterations = std::env::var("INTERLEAVINGS_ITERATIONS")
        .map_or(300, |n| n.parse().expect("INTERLEAVINGS_ITERATIONS: a count"));
    let started = Instant::now();
    let random = RandomScheduler::new_from_seed(0x7072_6573, iterations);
    let explored = Runner::new(random, Config::default()).run({
        let test = Arc::clone(&test);
        move || test()
    });
    let pct = PctScheduler::new_from_seed(0x656e_6365, 3, iterations);
    let explored = explored + Runner::new(pct, Config::default()).run(move || test());
    let elapsed = started.elapsed();
    eprintln!(
        "{name}: {explored} schedules in {elapsed:.2?} ({:.0}/s)",
        explored as f64 / elapsed.as_secs_f64().max(1e-9)
    );
    explored
}

/// A store of `shards` shards whose renewals always write (no throttle).
fn node(shards: usize) -> Arc<Node> {
    Arc::new(Node::new(store(shards), T0))
}

fn store(shards: usize) -> Store {
    let config = StoreConfig { shards, min_ttl_ms: 100, min_renew_interval_ms: 0, ..StoreConfig::default() };
    Store::new(config, T0).expect("a valid configuration")
}

fn ids(users: &[&str]) -> Vec<CompactString> {
    users.iter().map(|&user| user.into()).collect()
}

/// Every change the store made, as published, in no particular order.
///
/// A std mutex: held for a push only, with no shuttle operation inside, so
/// shuttle never switches while it is held.
type Log = Arc<std::sync::Mutex<Vec<PresenceChange>>>;

/// Runs `operation` through the publish path and logs the changes it made.
fn apply<T>(node: &Node, log: &Log, at: Tick, operation: impl FnOnce(&Store, Tick, &mut Changes) -> T) -> T {
    node.apply(|store, _, changes| {
        let from = changes.users.len();
        let answer = operation(store, at, changes);
        log.lock().unwrap().extend_from_slice(&changes.users[from..]);
        answer
    })
}

fn register(node: &Node, log: &Log, user: &str, session: &str, at: Tick) -> u64 {
    let registration =
        Registration { user_id: user, session_id: session, gateway_id: "gw", ttl_ms: TTL_MS, metadata: &[] };
    apply(node, log, at, |store, now, changes| store.register(now, &registration, changes)).expect("valid").generation
}

/// What the store holds of `users` now (read at `T0`, which never expires
/// anything: every deadline is past the clock of its shard).
fn store_view(node: &Node, log: &Log, users: &[CompactString]) -> Vec<Presence> {
    apply(node, log, T0, |store, now, changes| store.snapshot(now, users, changes)).expect("valid")
}

/// One gateway's session `s{gateway}`, doing `steps` random operations on
/// random users among `users`: register, renew, unregister, revoke, or the
/// expiry driver's pass at a later time.
fn gateway(node: Arc<Node>, log: Log, gateway: usize, users: &'static [&'static str], steps: usize) {
    let session = format!("s{gateway}");
    let mut generations: HashMap<&str, u64> = HashMap::new();
    let mut rng = thread_rng();
    for _ in 0..steps {
        let user = users[rng.gen_range(0..users.len())];
        let generation = generations.get(user).copied().unwrap_or(1);
        match rng.gen_range(0..5) {
            0 => {
                generations.insert(user, register(&node, &log, user, &session, T0));
            }
            1 => {
                let _ = apply(&node, &log, T0, |store, now, changes| {
                    store.renew(now, user, &session, generation, TTL_MS, changes)
                });
            }
            2 => {
                let _ = apply(&node, &log, T0, |store, now, changes| {
                    store.unregister(now, user, &session, generation, 0, changes)
                });
            }
            3 => {
                let _ = apply(&node, &log, T0, |store, now, changes| store.revoke(now, user, None, changes));
            }
            _ => {
                let later = T0 + 2 * u64::from(TTL_MS);
                apply(&node, &log, later, |store, now, changes| store.expire(now, 1_024, changes));
            }
        }
    }
}

/// A viewer's stream: what it was shown of each watched user, checked as it
/// is sent (E3, E4): no change not newer than what it holds, no change of a
/// user it does not watch, nothing that was never published.
struct Viewer {
    node: Arc<Node>,
    log: Log,
    subscription: Subscription,
    view: HashMap<CompactString, Presence>,
}

impl Viewer {
    fn open(node: &Arc<Node>, log: &Log, users: &[&str], capacity: usize) -> Viewer {
        let (subscription, snapshot) = node.watch(ids(users), capacity);
        Viewer { node: Arc::clone(node), log: Arc::clone(log), subscription, view: snapshot.into_iter().collect() }
    }

    /// Takes what the mailbox holds, as the stream does when woken.
    fn take(&mut self) {
        match self.subscription.mailbox().take() {
            Delivery::Changes(changes) => {
                for (user, pending) in changes {
                    let Some(held) = self.view.get(&user) else {
                        panic!("a change of {user}, who is not watched: {pending:?}");
                    };
                    assert!(
                        pending.presence.version > held.version,
                        "{user}: sent {:?} while holding {held:?}",
                        pending.presence
                    );
                    let published = self
                        .log
                        .lock()
                        .unwrap()
                        .iter()
                        .any(|change| change.user_id == user && change.presence == pending.presence);
                    assert!(published, "{user}: sent {:?}, which the store never published", pending.presence);
                    self.view.insert(user, pending.presence);
                }
            }
            Delivery::Resync => {
                RESYNCS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let snapshot = self.node.resync(&self.subscription);
                self.replace(snapshot);
            }
        }
    }

    /// A snapshot replaces the view; it may only move each user forward.
    fn replace(&mut self, snapshot: Snapshot) {
        for (user, presence) in &snapshot {
            if let Some(held) = self.view.get(user) {
                assert!(presence.version >= held.version, "{user}: a snapshot of {presence:?} after {held:?}");
            }
        }
        self.view = snapshot.into_iter().collect();
    }

    /// Waits for the mailbox's wake-up and takes what it holds.
    fn wait(&mut self) {
        shuttle::future::block_on(self.subscription.mailbox().ready());
        self.take();
    }

    /// Follows the stream until [`END`] is ONLINE, then takes what is left:
    /// every change published before END's is then taken or in a snapshot.
    /// (A snapshot reads its users one at a time, so one that shows END may
    /// miss a change of a user read before it; that change is in the
    /// mailbox, and a stream would take it on its next wake-up.) A lost
    /// wake-up leaves the viewer waiting forever, which shuttle reports as a
    /// deadlock.
    fn until_end(&mut self) {
        while self.view.get(END).is_none_or(|end| end.state != State::Online) {
            self.wait();
        }
        self.take();
    }

    /// The view equals what the store holds.
    fn assert_converged(&self) {
        let mut users: Vec<CompactString> = self.view.keys().cloned().collect();
        users.sort_unstable();
        let store = store_view(&self.node, &self.log, &users);
        let view: Vec<Presence> = users.iter().map(|user| self.view[user]).collect();
        assert_eq!(view, store, "the viewer's view of {users:?} differs from the store's");
    }
}

/// E1: the published changes of each user, ordered by version, are flips
/// that alternate from ONLINE, one per version, ending at what the store holds.
fn assert_each_flip_published_once(node: &Node, log: &Log, users: &[&str]) {
    let users = ids(users);
    let store = store_view(node, log, &users);
    let log = log.lock().unwrap();
    for (user, now) in users.iter().zip(store) {
        let mut flips: Vec<Presence> =
            log.iter().filter(|change| change.user_id == *user).map(|change| change.presence).collect();
        flips.sort_unstable_by_key(|presence| presence.version);
        let mut state = State::Offline;
        for (i, flip) in flips.iter().enumerate() {
            assert!(i == 0 || flips[i - 1].version < flip.version, "{user}: two changes at one version: {flips:?}");
            assert_ne!(flip.state, state, "{user}: a flip to the state it was in: {flips:?}");
            state = flip.state;
        }
        let last = flips.last().copied().unwrap_or(Presence::new(State::Offline, 0));
        assert_eq!(last, now, "{user}: the last change published is not what the store holds: {flips:?}");
    }
}

/// Gateways `0..gateways`, each doing `steps` random operations on `users`
/// on its own thread, against a viewer that `follow` runs on another and
/// returns; once every gateway is done, END goes ONLINE. Returns the viewer.
fn race(
    node: &Arc<Node>,
    log: &Log,
    users: &'static [&'static str],
    (gateways, steps): (usize, usize),
    follow: impl FnOnce() -> Viewer + Send + 'static,
) -> Viewer {
    let gateways: Vec<_> = (0..gateways)
        .map(|gateway| {
            let (node, log) = (Arc::clone(node), Arc::clone(log));
            thread::spawn(move || self::gateway(node, log, gateway, users, steps))
        })
        .collect();
    let follower = thread::spawn(follow);
    for gateway in gateways {
        gateway.join().unwrap();
    }
    register(node, log, END, "s", T0);
    follower.join().unwrap()
}

/// Gateways race on the same users (register, renew, unregister, revoke,
/// expiry) through the shard locks and the publish path, with a viewer
/// watching: each flip is published once, and the viewer, sent only newer
/// versions, ends at the store's state.
#[test]
fn e1_racing_gateways_publish_each_flip_once_and_the_viewer_ends_at_the_store_state() {
    const USERS: &[&str] = &["u0", "u1"];
    check("e1_racing_gateways", || {
        let (node, log) = (node(2), Log::default());
        let mut viewer = Viewer::open(&node, &log, &[USERS, &[END]].concat(), 16);
        let viewer = race(&node, &log, USERS, (3, 3), move || {
            viewer.until_end();
            viewer
        });
        assert_each_flip_published_once(&node, &log, USERS);
        viewer.assert_converged();
    });
}

/// E3: a Watch opens while gateways flip its users: whenever it subscribes
/// and reads, it is sent nothing older than its snapshot and ends at the
/// store's state.
#[test]
fn e3_a_watch_opened_during_flips_misses_nothing_and_never_goes_back() {
    const USERS: &[&str] = &["u0", "u1", "u2"];
    check("e3_watch_opening", || {
        let (node, log) = (node(2), Log::default());
        let viewer = race(&node, &log, USERS, (2, 4), {
            let (node, log) = (Arc::clone(&node), Arc::clone(&log));
            move || {
                let mut viewer = Viewer::open(&node, &log, &[USERS, &[END]].concat(), 16);
                viewer.until_end();
                viewer
            }
        });
        viewer.assert_converged();
    });
}

/// E4: a mailbox of one pending user, behind gateways flipping four: it
/// overflows and asks for resyncs at any point, and the viewer still ends at
/// the store's state, never sent anything older than it holds.
#[test]
fn e4_an_overflowing_mailbox_resyncs_and_the_viewer_converges() {
    const USERS: &[&str] = &["u0", "u1", "u2", "u3"];
    let explored = check("e4_overflow_resync", || {
        let (node, log) = (node(2), Log::default());
        let mut viewer = Viewer::open(&node, &log, &[USERS, &[END]].concat(), 1);
        let viewer = race(&node, &log, USERS, (2, 4), move || {
            viewer.until_end();
            viewer
        });
        viewer.assert_converged();
    });
    let resyncs = RESYNCS.load(std::sync::atomic::Ordering::Relaxed);
    assert!(explored == 0 || resyncs > 0, "no schedule overflowed the mailbox");
}

/// E7 and the hub's slots: the viewer's own stream removes and adds users
/// (freed slots are reused by the next users added) while gateways flip
/// them: it is never sent a change of a user it does not watch or one that
/// was never published, nothing older than it holds, and it ends at the
/// store's state for the users it watches then.
#[test]
fn e7_posts_racing_unsubscribe_and_slot_reuse_reach_only_the_users_watched() {
    const USERS: &[&str] = &["a", "b", "c"];
    check("e7_slot_reuse", || {
        let (node, log) = (node(2), Log::default());
        let mut viewer = Viewer::open(&node, &log, &["a", "b", END], 16);
        let viewer = race(&node, &log, USERS, (2, 4), move || {
            // b's slot goes to c, then a's to b: each user comes back in another's slot.
            for (remove, add) in [("b", "c"), ("a", "b")] {
                viewer.take();
                assert_eq!(viewer.subscription.remove(&ids(&[remove])), 1);
                viewer.view.remove(remove);
                let added = viewer.node.add(&viewer.subscription, ids(&[add]));
                viewer.view.extend(added);
            }
            viewer.until_end();
            viewer
        });
        let mut watched = viewer.subscription.users();
        watched.sort_unstable();
        assert_eq!(watched, ids(&["b", "c", END]));
        viewer.assert_converged();
    });
}

/// The expiry alarm: the driver arms itself (after expiring what was due)
/// while a gateway schedules a deadline: either the driver is woken, or it
/// sleeps until no later than the store's earliest deadline.
#[test]
fn l4_a_deadline_scheduled_while_the_expiry_driver_arms_is_never_slept_past() {
    check("l4_expiry_alarm", || {
        let woken = Arc::new(AtomicBool::new(false));
        let store = store(1).with_expiry_waker({
            let woken = Arc::clone(&woken);
            move || woken.store(true, Ordering::SeqCst)
        });
        let node = Arc::new(Node::new(store, T0));
        let log = Log::default();
        // The driver sleeps towards the first lease's deadline.
        register(&node, &log, "u0", "s", T0);
        node.arm_expiry();
        let gateway = thread::spawn({
            let (node, log) = (Arc::clone(&node), Arc::clone(&log));
            move || {
                let registration = Registration {
                    user_id: "u1",
                    session_id: "s",
                    gateway_id: "gw",
                    ttl_ms: 3 * TTL_MS,
                    metadata: &[],
                };
                apply(&node, &log, T0, |store, now, changes| store.register(now, &registration, changes)).unwrap();
            }
        });
        // Woken at that deadline (a wake-up from now on is kept for its next
        // wait), it expires the first lease and arms again.
        woken.store(false, Ordering::SeqCst);
        let later = T0 + u64::from(TTL_MS) + 500;
        apply(&node, &log, later, |store, now, changes| store.expire(now, 1_024, changes));
        let armed = node.arm_expiry().unwrap_or(u64::MAX);
        gateway.join().unwrap();
        let earliest = node.store().next_deadline().unwrap_or(u64::MAX);
        assert!(
            woken.load(Ordering::SeqCst) || earliest >= armed,
            "the driver sleeps until {armed}, past the deadline at {earliest}, and nobody wakes it"
        );
    });
}
