//! The checker: what every history must satisfy, whatever the fault.
//!
//! It reads only the recorded history (the server is a black box). Its
//! rules, per user (each is an [`Expectation`]):
//!
//! - **E1, one state per version**: every observation of `(user, version)`,
//!   by any viewer and in any call's answer, says the same state.
//! - **Versions increase**: per viewer and user, across reconnects, every
//!   update is newer than every version the viewer received before, and a
//!   snapshot entry is never older than what the viewer held (it may repeat
//!   it). A fault may allow named exceptions (a restore from a checkpoint).
//! - **One event per flip**: take the union of every version observed of a
//!   user (all viewers, all answers), in version order. Conflation in a
//!   mailbox (E4) may hide a change from one viewer, so a viewer may see
//!   ONLINE, ONLINE; but two *consecutive* versions of the union with the same
//!   state mean a change no observer saw, which without a hidden cause is a
//!   duplicate flip. The hidden causes a history can show are: a call whose
//!   outcome is unknown, a lease that expired (a renewal answered
//!   `NOT_FOUND`, a `Session` that reported `Lost` or re-registered), and a
//!   fault window. A same-state pair with none of them around it is a
//!   violation; one with any of them is excused (sound: never a false
//!   alarm, and a duplicate flip in calm times is caught).
//! - **Convergence**: after the final settle, what each viewer holds equals a
//!   fresh `Snapshot`, user by user (state and version).
//! - **No acknowledged write lost**: after the settle (a TTL and the expiry
//!   lag since the last register or unregister), a user is ONLINE in the
//!   fresh snapshot exactly when a gateway holds a registered, renewing
//!   session of it. So an acknowledged register whose session is still held
//!   is ONLINE, and a user all of whose sessions were closed (acknowledged
//!   or not: an unacknowledged lease has expired by then) is OFFLINE.
//! - **OFFLINE follows an acknowledged unregister**: outside fault windows,
//!   an unregister answered `changed` (it closed the user's last session) is
//!   followed, at every viewer of the user with an open stream, by that
//!   OFFLINE version or a later one within the delivery bound.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::clients::SENTINEL;
use crate::history::{EventKind, Outcome, Record, SessionState};

/// The bounds the checker works with.
#[derive(Debug, Clone, Copy)]
pub struct CheckConfig {
    /// The lease TTL the gateways asked for.
    pub ttl_ms: u64,
    /// Their renewal interval.
    pub heartbeat_ms: u64,
    /// How late a viewer may receive an OFFLINE after the unregister's answer.
    pub delivery_bound_ms: u64,
}

/// One broken rule, with the history that shows it.
#[derive(Debug, Clone)]
pub struct Violation {
    /// The user.
    pub user: String,
    /// What went wrong, in one line.
    pub what: String,
    /// The records involved: a minimal excerpt of the history.
    pub excerpt: Vec<Record>,
}

/// A statement written down before the run, and what the run showed.
#[derive(Debug, Clone)]
pub struct Expectation {
    /// Short name (`e1-one-state-per-version`).
    pub name: String,
    /// What is expected, in a sentence.
    pub statement: String,
    /// How many cases were checked.
    pub checked: usize,
    /// The cases that broke it.
    pub violations: Vec<Violation>,
}

impl Expectation {
    /// An expectation to fill.
    pub fn new(name: &str, statement: &str) -> Self {
        Expectation { name: name.to_owned(), statement: statement.to_owned(), checked: 0, violations: Vec::new() }
    }

    /// Whether it held.
    pub fn held(&self) -> bool {
        self.violations.is_empty()
    }
}

/// One observation of a user's presence.
#[derive(Debug, Clone, Copy)]
pub struct Obs {
    /// The version.
    pub version: u64,
    /// The state.
    pub online: bool,
    /// When it was known (the event's arrival, the answer's arrival).
    pub at_us: u64,
    /// The record it comes from.
    pub index: usize,
    /// Only in a snapshot (a restore may show an old version there).
    pub snapshot: bool,
}

/// The history, indexed for the rules.
#[derive(Debug)]
pub struct Analysis<'a> {
    /// Every record.
    pub records: &'a [Record],
    /// The bounds.
    pub config: CheckConfig,
    /// Phase marks in order: (name, time).
    pub phases: Vec<(String, u64)>,
    /// Per user, every observation, in record order.
    pub observations: HashMap<String, Vec<Obs>>,
    /// Per user, the record indices about it (calls, session reports, events).
    pub by_user: HashMap<String, Vec<usize>>,
    /// Per viewer, the users it watches.
    pub watching: HashMap<usize, HashSet<String>>,
    /// The fresh snapshot at the end, by user.
    pub fresh: Option<HashMap<String, (bool, u64)>>,
    /// The fault window: from the `quiet` mark to the `churn` mark.
    pub fault_window: Option<(u64, u64)>,
}

impl<'a> Analysis<'a> {
    /// Indexes `records`.
    pub fn new(records: &'a [Record], config: CheckConfig) -> Self {
        let mut phases = Vec::new();
        let mut observations: HashMap<String, Vec<Obs>> = HashMap::new();
        let mut by_user: HashMap<String, Vec<usize>> = HashMap::new();
        let mut watching = HashMap::new();
        let mut fresh = None;
        for (index, record) in records.iter().enumerate() {
            if let Some(user) = record.user() {
                by_user.entry(user.to_owned()).or_default().push(index);
            }
            match record {
                Record::Phase { at_us, name } => phases.push((name.clone(), *at_us)),
                Record::Watching { viewer, users } => {
                    watching.insert(*viewer, users.iter().cloned().collect::<HashSet<_>>());
                }
                Record::Event { at_us, kind, presence, .. } => {
                    observations.entry(presence.user.clone()).or_default().push(Obs {
                        version: presence.version,
                        online: presence.online,
                        at_us: *at_us,
                        index,
                        snapshot: kind.is_snapshot(),
                    });
                }
                Record::Call(call) => {
                    if let Outcome::Ok { presence: Some(p), .. } = &call.outcome {
                        observations.entry(p.user.clone()).or_default().push(Obs {
                            version: p.version,
                            online: p.online,
                            at_us: call.end_us,
                            index,
                            snapshot: false,
                        });
                    }
                }
                Record::Final { viewer: None, users, .. } => {
                    fresh = Some(users.iter().map(|p| (p.user.clone(), (p.online, p.version))).collect());
                }
                _ => {}
            }
        }
        let mark = |name: &str| phases.iter().find(|(n, _)| n == name).map(|(_, at)| *at);
        let fault_window = mark("quiet").zip(mark("churn"));
        Analysis { records, config, phases, observations, by_user, watching, fresh, fault_window }
    }

    /// The time of the first mark named `name`.
    pub fn mark(&self, name: &str) -> Option<u64> {
        self.phases.iter().find(|(n, _)| n == name).map(|(_, at)| *at)
    }

    /// Whether `[from, to]` meets the fault window (widened by the delivery bound).
    pub fn in_fault_window(&self, from: u64, to: u64) -> bool {
        let slack = self.config.delivery_bound_ms * 1_000;
        self.fault_window.is_some_and(|(start, end)| from <= end + slack && to + slack >= start)
    }

    /// Per user, every distinct version observed with its state and when it
    /// was first observed, in version order.
    pub fn union(&self, user: &str) -> BTreeMap<u64, Obs> {
        let mut union: BTreeMap<u64, Obs> = BTreeMap::new();
        for obs in self.observations.get(user).into_iter().flatten() {
            union.entry(obs.version).and_modify(|o| o.snapshot &= obs.snapshot).or_insert(*obs);
        }
        union
    }

    /// Changes first observed in `(from, to]` and newer than every version of
    /// their user observed by `from`: (user, first observation).
    pub fn new_changes_between(&self, from: u64, to: u64) -> Vec<(String, Obs)> {
        let mut changes = Vec::new();
        for (user, observations) in &self.observations {
            if user == SENTINEL {
                continue;
            }
            let before = observations.iter().filter(|o| o.at_us <= from).map(|o| o.version).max().unwrap_or(0);
            let mut seen = HashSet::new();
            for obs in observations {
                if obs.at_us > from && obs.at_us <= to && obs.version > before && seen.insert(obs.version) {
                    changes.push((user.clone(), *obs));
                }
            }
        }
        changes.sort_by_key(|(_, o)| o.at_us);
        changes
    }

    /// The records about `user` from `from_us` to `to_us`, at most `limit` (the last ones).
    pub fn excerpt(&self, user: &str, from_us: u64, to_us: u64, limit: usize) -> Vec<Record> {
        let indices = self.by_user.get(user).map(Vec::as_slice).unwrap_or_default();
        let picked: Vec<&Record> = indices
            .iter()
            .map(|&i| &self.records[i])
            .filter(|r| r.at_us().is_none_or(|at| at >= from_us && at <= to_us))
            .collect();
        picked[picked.len().saturating_sub(limit)..].iter().map(|r| (*r).clone()).collect()
    }

    /// Times around which a change of `user` may have been hidden from every
    /// observer (see the module doc): (from, to) in µs.
    pub fn uncertainty(&self, user: &str) -> Vec<(u64, u64)> {
        let ttl = (self.config.ttl_ms + self.config.heartbeat_ms) * 1_000;
        let mut spans = Vec::new();
        for &i in self.by_user.get(user).map(Vec::as_slice).unwrap_or_default() {
            match &self.records[i] {
                Record::Call(call) if call.outcome.code() == Some("NotFound") => {
                    spans.push((call.start_us.saturating_sub(ttl), call.end_us));
                }
                Record::Call(call) if !call.outcome.is_definite() => {
                    spans.push((call.start_us, call.end_us + ttl));
                }
                Record::Session { at_us, state: SessionState::Lost | SessionState::Superseded, .. } => {
                    spans.push((at_us.saturating_sub(ttl), at_us + ttl));
                }
                Record::Session { at_us, state: SessionState::Reregistered, .. } => {
                    spans.push((at_us.saturating_sub(ttl), *at_us));
                }
                _ => {}
            }
        }
        spans
    }
}

/// What a fault may allow that the generic rules otherwise forbid.
pub trait Allowances {
    /// Whether a snapshot entry of `user` at `version`, older than what the
    /// viewer held, is expected (a restore from a checkpoint, B3).
    fn version_may_go_back(&self, _user: &str, _version: u64, _at_us: u64) -> bool {
        false
    }
}

/// No allowances: the rules as stated.
#[derive(Debug, Clone, Copy, Default)]
pub struct Strict;

impl Allowances for Strict {}

/// The generic rules, each as an expectation.
pub fn check(analysis: &Analysis<'_>, allowances: &dyn Allowances) -> Vec<Expectation> {
    vec![
        one_state_per_version(analysis),
        versions_increase(analysis, allowances),
        one_event_per_flip(analysis),
        convergence(analysis),
        no_write_lost(analysis),
        offline_follows_unregister(analysis),
    ]
}

/// The statements of [`check`]'s rules, for printing before the run.
pub fn statements() -> Vec<(&'static str, &'static str)> {
    vec![
        ("e1-one-state-per-version", "every observation of (user, version), by any viewer or answer, has one state"),
        (
            "versions-increase",
            "per viewer and user, across reconnects, every update is newer than all it received before, and no snapshot entry is older than what it held",
        ),
        (
            "one-event-per-flip",
            "consecutive versions of a user (union of all observers) differ in state, unless a hidden cause (unknown outcome, expiry, fault) lies between them",
        ),
        ("converges", "after the settle, every viewer holds exactly what a fresh Snapshot says, user by user"),
        (
            "no-acknowledged-write-lost",
            "after the settle a user is ONLINE exactly when a gateway holds a registered, renewing session of it",
        ),
        (
            "offline-follows-unregister",
            "outside fault windows, an unregister answered `changed` reaches every viewer of the user as that OFFLINE (or later) within the delivery bound",
        ),
    ]
}

fn expectation(name: &str) -> Expectation {
    let statement = statements().into_iter().find(|(n, _)| *n == name).map(|(_, s)| s).unwrap_or_default();
    Expectation::new(name, statement)
}

fn one_state_per_version(a: &Analysis<'_>) -> Expectation {
    let mut e = expectation("e1-one-state-per-version");
    for (user, observations) in &a.observations {
        let mut first: HashMap<u64, Obs> = HashMap::new();
        for obs in observations {
            e.checked += 1;
            match first.get(&obs.version) {
                None => {
                    first.insert(obs.version, *obs);
                }
                Some(earlier) if earlier.online != obs.online => {
                    e.violations.push(Violation {
                        user: user.clone(),
                        what: format!(
                            "version {} seen {} and {}",
                            obs.version,
                            state(earlier.online),
                            state(obs.online)
                        ),
                        excerpt: vec![a.records[earlier.index].clone(), a.records[obs.index].clone()],
                    });
                }
                Some(_) => {}
            }
        }
    }
    e
}

fn state(online: bool) -> &'static str {
    if online { "ONLINE" } else { "OFFLINE" }
}

fn versions_increase(a: &Analysis<'_>, allowances: &dyn Allowances) -> Expectation {
    let mut e = expectation("versions-increase");
    // Per (viewer, user): the version held, the highest received, and the record of each.
    let mut held: HashMap<(usize, &str), (u64, u64, usize)> = HashMap::new();
    for (index, record) in a.records.iter().enumerate() {
        let Record::Event { viewer, kind, presence, at_us, .. } = record else { continue };
        e.checked += 1;
        let key = (*viewer, presence.user.as_str());
        let v = presence.version;
        let Some(&(holding, highest, last)) = held.get(&key) else {
            held.insert(key, (v, v, index));
            continue;
        };
        let ok = match kind {
            EventKind::Update => v > highest,
            EventKind::Opening { partial: true } => {
                v != holding && (v > holding || back_ok(allowances, presence, *at_us))
            }
            EventKind::Opening { partial: false } | EventKind::Resync => {
                v >= holding || back_ok(allowances, presence, *at_us)
            }
        };
        if !ok {
            e.violations.push(Violation {
                user: presence.user.clone(),
                what: format!(
                    "viewer {viewer} held version {holding} (highest {highest}) and then received {v} in {kind:?}"
                ),
                excerpt: vec![a.records[last].clone(), record.clone()],
            });
        }
        let holding = if kind.is_snapshot() || v > holding { v } else { holding };
        held.insert(key, (holding, highest.max(v), index));
    }
    e
}

fn back_ok(allowances: &dyn Allowances, presence: &crate::history::Presence, at_us: u64) -> bool {
    allowances.version_may_go_back(&presence.user, presence.version, at_us)
}

fn one_event_per_flip(a: &Analysis<'_>) -> Expectation {
    let mut e = expectation("one-event-per-flip");
    let slack = a.config.delivery_bound_ms * 1_000;
    for user in a.observations.keys() {
        if user == SENTINEL {
            continue;
        }
        let union: Vec<Obs> = a.union(user).into_values().filter(|o| o.version != 0).collect();
        let spans = a.uncertainty(user);
        for pair in union.windows(2) {
            let (first, second) = (pair[0], pair[1]);
            e.checked += 1;
            if first.online != second.online {
                continue;
            }
            let (from, to) = (first.at_us.min(second.at_us).saturating_sub(slack), first.at_us.max(second.at_us));
            let excused = a.in_fault_window(from, to) || spans.iter().any(|&(start, end)| start <= to && end >= from);
            if !excused {
                e.violations.push(Violation {
                    user: user.clone(),
                    what: format!(
                        "versions {} and {} are both {} with no version between them and no hidden cause",
                        first.version,
                        second.version,
                        state(first.online)
                    ),
                    excerpt: {
                        let mut excerpt = vec![a.records[first.index].clone(), a.records[second.index].clone()];
                        excerpt.extend(a.excerpt(user, from, to, 6));
                        excerpt
                    },
                });
            }
        }
    }
    e
}

fn convergence(a: &Analysis<'_>) -> Expectation {
    let mut e = expectation("converges");
    let Some(fresh) = &a.fresh else {
        e.violations.push(Violation {
            user: String::new(),
            what: "the history has no final snapshot".into(),
            excerpt: Vec::new(),
        });
        return e;
    };
    for record in a.records {
        let Record::Final { viewer: Some(viewer), users, at_us } = record else { continue };
        let held: HashMap<&str, (bool, u64)> = users.iter().map(|p| (p.user.as_str(), (p.online, p.version))).collect();
        for user in a.watching.get(viewer).into_iter().flatten() {
            e.checked += 1;
            let expected = fresh.get(user.as_str()).copied();
            let got = held.get(user.as_str()).copied();
            if expected != got {
                e.violations.push(Violation {
                    user: user.clone(),
                    what: format!("viewer {viewer} holds {got:?}, a fresh snapshot says {expected:?} (state, version)"),
                    excerpt: a.excerpt(user, 0, *at_us, 8),
                });
            }
        }
    }
    e
}

fn no_write_lost(a: &Analysis<'_>) -> Expectation {
    let mut e = expectation("no-acknowledged-write-lost");
    let Some(fresh) = &a.fresh else { return e };
    let held: HashSet<&str> = a
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Held { user, .. } => Some(user.as_str()),
            _ => None,
        })
        .collect();
    let end = a.mark("check").unwrap_or(u64::MAX);
    for (user, (online, version)) in fresh {
        if user == SENTINEL {
            continue;
        }
        e.checked += 1;
        let expected = held.contains(user.as_str());
        if *online != expected {
            e.violations.push(Violation {
                user: user.clone(),
                what: format!(
                    "{} at version {version} after the settle, but {}",
                    state(*online),
                    if expected {
                        "a gateway holds a registered, renewing session (an acknowledged register lost)"
                    } else {
                        "no gateway holds a session (an acknowledged unregister undone)"
                    }
                ),
                excerpt: a.excerpt(user, 0, end, 10),
            });
        }
    }
    e
}

fn offline_follows_unregister(a: &Analysis<'_>) -> Expectation {
    let mut e = expectation("offline-follows-unregister");
    let bound = a.config.delivery_bound_ms * 1_000;
    // Per viewer: when its streams ended.
    let mut ends: HashMap<usize, Vec<u64>> = HashMap::new();
    for record in a.records {
        if let Record::Stream { viewer, at_us, opened: false, .. } = record {
            ends.entry(*viewer).or_default().push(*at_us);
        }
    }
    let start_of_check = a.mark("check").unwrap_or(u64::MAX);
    for (index, record) in a.records.iter().enumerate() {
        let Record::Call(call) = record else { continue };
        let Outcome::Ok { changed: Some(true), presence: Some(p), .. } = &call.outcome else { continue };
        let in_fault = a.fault_window.is_some_and(|(start, end)| call.end_us + bound >= start && call.start_us <= end);
        if !call.op.is_close() || p.online || in_fault {
            continue;
        }
        if call.end_us + bound > start_of_check {
            continue;
        }
        for (viewer, users) in &a.watching {
            if !users.contains(&call.user) {
                continue;
            }
            let broke =
                ends.get(viewer).into_iter().flatten().any(|&t| t + bound >= call.start_us && t <= call.end_us + bound);
            if broke {
                continue;
            }
            e.checked += 1;
            let seen = a.observations.get(&call.user).into_iter().flatten().find(|o| {
                o.version >= p.version && matches!(&a.records[o.index], Record::Event { viewer: v, .. } if v == viewer)
            });
            let late = match seen {
                Some(o) => o.at_us > call.end_us + bound,
                None => true,
            };
            if late {
                let mut excerpt = vec![a.records[index].clone()];
                if let Some(o) = seen {
                    excerpt.push(a.records[o.index].clone());
                }
                e.violations.push(Violation {
                    user: call.user.clone(),
                    what: format!(
                        "viewer {viewer} {} the OFFLINE at version {} within {} ms of the unregister's answer",
                        if seen.is_some() { "received late" } else { "never received" },
                        p.version,
                        a.config.delivery_bound_ms
                    ),
                    excerpt,
                });
            }
        }
    }
    e
}

/// The run's figures, from the history.
#[derive(Debug, Clone, Default)]
pub struct Figures {
    /// Calls made, and how many failed (any error).
    pub calls: usize,
    /// Failed calls.
    pub calls_failed: usize,
    /// `NOT_FOUND` answers (leases the server did not have).
    pub not_found: usize,
    /// Events received (snapshot entries and updates).
    pub events: usize,
    /// Updates only.
    pub updates: usize,
    /// Viewer streams opened.
    pub streams: usize,
    /// Distinct changes observed (user, version) other than version 0.
    pub flips: usize,
    /// Per phase: (name, ONLINE changes, OFFLINE changes) first observed in it.
    pub per_phase: Vec<(String, usize, usize)>,
    /// Longest wait from an acknowledged unregister to a viewer's OFFLINE, in ms.
    pub max_offline_delivery_ms: f64,
}

/// Counts the figures of a history.
pub fn figures(a: &Analysis<'_>) -> Figures {
    let mut f = Figures::default();
    for record in a.records {
        match record {
            Record::Call(call) => {
                f.calls += 1;
                f.calls_failed += usize::from(call.outcome.code().is_some());
                f.not_found += usize::from(call.outcome.code() == Some("NotFound"));
            }
            Record::Event { kind, .. } => {
                f.events += 1;
                f.updates += usize::from(!kind.is_snapshot());
            }
            Record::Stream { opened: true, .. } => f.streams += 1,
            _ => {}
        }
    }
    let mut firsts = Vec::new();
    for user in a.observations.keys() {
        if user == SENTINEL {
            continue;
        }
        for obs in a.union(user).values() {
            if obs.version != 0 {
                firsts.push(*obs);
            }
        }
    }
    f.flips = firsts.len();
    let mut marks = vec![("start".to_owned(), 0u64)];
    marks.extend(a.phases.iter().cloned());
    for (i, (name, from)) in marks.iter().enumerate() {
        let to = marks.get(i + 1).map_or(u64::MAX, |(_, at)| *at);
        let here = firsts.iter().filter(|o| o.at_us > *from && o.at_us <= to && !o.snapshot);
        let (on, off) = here.fold((0, 0), |(on, off), o| if o.online { (on + 1, off) } else { (on, off + 1) });
        f.per_phase.push((name.clone(), on, off));
    }
    for record in a.records {
        let Record::Call(call) = record else { continue };
        let Outcome::Ok { changed: Some(true), presence: Some(p), .. } = &call.outcome else { continue };
        if !call.op.is_close() || p.online {
            continue;
        }
        for obs in a.observations.get(&call.user).into_iter().flatten() {
            if obs.version == p.version && matches!(a.records[obs.index], Record::Event { .. }) {
                let lag = obs.at_us.saturating_sub(call.end_us) as f64 / 1_000.0;
                f.max_offline_delivery_ms = f.max_offline_delivery_ms.max(lag);
            }
        }
    }
    f
}
