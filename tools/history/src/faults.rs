//! Faults: what the runner does to the server mid-run, what it expects to
//! happen, and how it checks that it did.
//!
//! A fault is a [`Fault`]: a name, its expected outcome (written down in code
//! and printed before the run), a hook to shape the server's launch (a data
//! directory, flags, a command prefix), `inject` and `heal` steps, how long
//! it lasts and how long the quiet recovery after it is, and its own checks
//! over the recorded history. The generic rules (`checker.rs`) apply to
//! every fault; a fault may allow named exceptions through
//! [`Allowances`]. Network and disk faults plug in the same way.

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::time::Duration;

use crate::checker::{Allowances, Analysis, Expectation, Obs, Violation};
use crate::clients::Target;
use crate::history::{CheckpointedUser, Op, Outcome, Record, Recorder, SessionState};
use crate::server::{Launch, Server};
use crate::{diskfaults, netfaults};

/// The run's shape, as the faults and the checker see it.
#[derive(Debug, Clone)]
pub struct Plan {
    /// Users.
    pub users: usize,
    /// Gateways.
    pub gateways: usize,
    /// Viewers.
    pub viewers: usize,
    /// The lease TTL the gateways ask for, and the server's default.
    pub ttl_ms: u32,
    /// The gateways' renewal interval.
    pub heartbeat_ms: u32,
    /// The whole run, before the final settle.
    pub duration: Duration,
    /// `--restart-grace-ms`.
    pub restart_grace_ms: u32,
    /// `--checkpoint-interval-ms`, for faults with a data directory.
    pub checkpoint_interval_ms: u32,
    /// How late a viewer may receive a change and still be on time.
    pub delivery_bound_ms: u32,
}

impl Plan {
    /// The TTL as a duration.
    pub fn ttl(&self) -> Duration {
        Duration::from_millis(u64::from(self.ttl_ms))
    }

    /// The delivery bound as a duration.
    pub fn bound(&self) -> Duration {
        Duration::from_millis(u64::from(self.delivery_bound_ms))
    }
}

/// What `inject` and `heal` may touch.
#[derive(Debug)]
pub struct FaultCx<'a> {
    /// The server process.
    pub server: &'a mut Server,
    /// The history (to record what the fault saw, e.g. a checkpoint).
    pub recorder: &'a Recorder,
    /// The run's shape.
    pub plan: &'a Plan,
}

/// A fault the runner can inject.
pub trait Fault: Allowances + Send {
    /// Its name on the command line.
    fn name(&self) -> &'static str;
    /// The expected outcome, one statement a line, written down before the run.
    fn expected_outcome(&self, plan: &Plan) -> Vec<String>;
    /// Whether the server needs a data directory (the runner makes a scratch one if none is given).
    fn needs_data_dir(&self) -> bool {
        false
    }
    /// Shapes the server's launch (data directory, flags, a command prefix).
    fn configure(&mut self, _launch: &mut Launch, _plan: &Plan) -> Result<(), String> {
        Ok(())
    }
    /// Whether churn stops, every call under way is answered and every viewer
    /// is caught up before `inject` (a calm start). False injects mid-churn:
    /// churn stops at the injection and the calls under way meet the fault.
    fn calm_before(&self) -> bool {
        true
    }
    /// How long the fault lasts, from `inject` to `heal`.
    fn lasts(&self, plan: &Plan) -> Duration;
    /// How long the clients stay quiet (renewals only) after `heal`, so that
    /// whatever the fault caused shows in its window.
    fn recovery(&self, plan: &Plan) -> Duration {
        plan.ttl() + plan.bound()
    }
    /// Whether gateways churn (register, unregister) from `inject` until
    /// just before `heal`, instead of only renewing.
    fn churn_during(&self) -> bool {
        false
    }
    /// Where `client` connects: the runner's target unless the fault
    /// routes it (its own source address in a `NetLab`, a proxy).
    fn route(&self, _client: Client, default: &Target) -> Target {
        default.clone()
    }
    /// Injects it.
    fn inject(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String>;
    /// Ends it.
    fn heal(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String>;
    /// Its own expectations, checked over the history.
    fn check(&self, analysis: &Analysis<'_>) -> Vec<Expectation>;
}

/// A client of the run, for [`Fault::route`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Client {
    /// Gateway number n.
    Gateway(usize),
    /// Viewer number n.
    Viewer(usize),
    /// The runner's own calls: barriers and the final snapshot.
    Admin,
}

/// The fault named `name`, if there is one.
pub fn by_name(name: &str) -> Option<Box<dyn Fault>> {
    match name {
        "none" => Some(Box::new(NoFault)),
        "kill9" => Some(Box::new(Kill9::default())),
        "stop" => Some(Box::new(Stop)),
        "loss" => Some(Box::new(netfaults::Loss::default())),
        "partition-gateways" => Some(Box::new(netfaults::PartitionGateways::default())),
        "partition-viewers" => Some(Box::new(netfaults::PartitionViewers::default())),
        "delay" => Some(Box::new(netfaults::Delay::default())),
        "disk-full" => Some(Box::new(diskfaults::DiskFull::default())),
        "slow-disk" => Some(Box::new(diskfaults::SlowDiskFault::default())),
        _ => None,
    }
}

/// The names [`by_name`] knows.
pub const NAMES: &[&str] =
    &["none", "kill9", "stop", "loss", "partition-gateways", "partition-viewers", "delay", "disk-full", "slow-disk"];

/// The changes first observed in the fault window, counted by state.
pub(crate) fn window_changes(a: &Analysis<'_>) -> Vec<(String, crate::checker::Obs)> {
    match a.fault_window {
        Some((from, to)) => a.new_changes_between(from, to),
        None => Vec::new(),
    }
}

pub(crate) fn no_change_in_window(a: &Analysis<'_>, name: &str, statement: &str, offline_only: bool) -> Expectation {
    let mut e = Expectation::new(name, statement);
    let (from, to) = a.fault_window.unwrap_or_default();
    let changes = window_changes(a);
    e.checked = changes.len();
    for (user, obs) in changes {
        if offline_only && obs.online {
            continue;
        }
        e.violations.push(Violation {
            user: user.clone(),
            what: format!(
                "{} at version {} in the fault window",
                if obs.online { "ONLINE" } else { "OFFLINE" },
                obs.version
            ),
            excerpt: a.excerpt(&user, from.saturating_sub(2_000_000), to, 8),
        });
    }
    e
}

/// The baseline: nothing is done to the server.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoFault;

impl Allowances for NoFault {}

impl Fault for NoFault {
    fn name(&self) -> &'static str {
        "none"
    }

    fn expected_outcome(&self, _plan: &Plan) -> Vec<String> {
        vec![
            "every generic rule holds, with 0 violations".into(),
            "quiet-window-calm: while gateways only renew (the quiet window), no user changes at all".into(),
        ]
    }

    fn lasts(&self, _plan: &Plan) -> Duration {
        Duration::ZERO
    }

    fn recovery(&self, plan: &Plan) -> Duration {
        plan.ttl()
    }

    fn inject(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        Ok(())
    }

    fn heal(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        Ok(())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        vec![no_change_in_window(a, "quiet-window-calm", "no user changes while gateways only renew", false)]
    }
}

/// SIGSTOP the server for longer than a TTL, then SIGCONT.
#[derive(Debug, Clone, Copy, Default)]
pub struct Stop;

impl Allowances for Stop {}

impl Fault for Stop {
    fn name(&self) -> &'static str {
        "stop"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        vec![
            "every generic rule holds".into(),
            format!(
                "stop-no-offline: the server is stopped for {} ms (longer than the {} ms TTL) and continued; the time it was stopped is not counted against leases, so no user whose gateway resumes renewing right after SIGCONT (no renewal sent within a TTL after it fails in transit) flips: 0 OFFLINE (and 0 ONLINE) from the SIGSTOP to {} ms after the SIGCONT",
                self.lasts(plan).as_millis(),
                plan.ttl_ms,
                self.recovery(plan).as_millis()
            ),
        ]
    }

    fn lasts(&self, plan: &Plan) -> Duration {
        plan.ttl() + (plan.ttl() / 2).max(Duration::from_secs(1))
    }

    fn inject(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        cx.server.signal("STOP")
    }

    fn heal(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        cx.server.signal("CONT")
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let mut offline = no_change_in_window(
            a,
            "stop-no-offline",
            "no OFFLINE from the SIGSTOP to the end of the recovery after SIGCONT",
            true,
        );
        // Only users whose gateways resumed renewing right after SIGCONT: a
        // renewal sent within a TTL after it that failed in transit (not
        // NOT_FOUND: that is the symptom), or a Session still
        // reporting its lease lost then, means this gateway did not.
        let heal = a.mark("heal").unwrap_or_default();
        let soon = heal + a.config.ttl_ms * 1_000;
        let not_resumed: HashSet<&str> = a
            .records
            .iter()
            .filter_map(|r| match r {
                Record::Call(c) if c.start_us >= heal && c.start_us <= soon && !c.outcome.is_definite() => {
                    Some(c.user.as_str())
                }
                Record::Session { user, at_us, state: SessionState::Lost, .. } if *at_us >= heal && *at_us <= soon => {
                    Some(user.as_str())
                }
                _ => None,
            })
            .collect();
        offline.violations.retain(|v| !not_resumed.contains(v.user.as_str()));
        let online =
            no_change_in_window(a, "stop-no-flip", "no ONLINE either (nothing went OFFLINE to come back)", false);
        // The ONLINE half is reported apart, so that the OFFLINE count stands alone.
        let onlines: Vec<Violation> = online
            .violations
            .into_iter()
            .filter(|v| v.what.starts_with("ONLINE") && !not_resumed.contains(v.user.as_str()))
            .collect();
        let mut flips = Expectation::new("stop-no-flip", "no ONLINE either (nothing went OFFLINE to come back)");
        flips.checked = online.checked;
        flips.violations = onlines;
        offline.checked = online.checked;
        vec![offline, flips]
    }
}

/// `kill -9` mid-run, then a restart on the same data directory and port (B3).
#[derive(Debug, Default)]
pub struct Kill9 {
    /// The data directory (set by `configure`).
    dir: Option<PathBuf>,
    /// What the last checkpoint held when the process died, by user.
    checkpoint: HashMap<String, CheckpointedUser>,
    /// When the signal was sent: the process may die, and its connections
    /// break, from then on.
    kill_sent_at: u64,
    /// When it was dead (its exit reaped) and when it was back, on the history clock.
    pub(crate) killed_at: u64,
    restarted_at: u64,
}

impl Kill9 {
    fn checkpointed_version(&self, user: &str) -> u64 {
        self.checkpoint.get(user).map_or(0, |u| u.version)
    }
}

impl Allowances for Kill9 {
    /// B3/M4: a restore answers a user at its checkpointed version (0 for a
    /// user the checkpoint does not hold), which is older than a version
    /// viewers saw when the user flipped after the checkpoint.
    fn version_may_go_back(&self, user: &str, version: u64, at_us: u64) -> bool {
        self.killed_at > 0 && at_us > self.killed_at && version == self.checkpointed_version(user)
    }
}

impl Fault for Kill9 {
    fn name(&self) -> &'static str {
        "kill9"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        let grace = plan.restart_grace_ms;
        vec![
            "every generic rule holds, with this exception to versions-increase: the first snapshot after the restart may show a user at exactly its checkpointed version (0 if the checkpoint does not hold it), older than one seen before the kill".into(),
            "b3-checkpointed-sessions-carry-on: a renewal after the restart of a session at the generation the checkpoint holds, with a checkpointed deadline still ahead, is never NOT_FOUND (and such a Session never re-registers)".into(),
            format!(
                "b3-only-users-changed-after-the-checkpoint-flip: from the kill to {} ms after the restart (TTL + restart grace + delivery bound), only users whose version moved after the last checkpoint flip, each at most once OFFLINE and once ONLINE; every other user shows nothing",
                self.recovery(plan).as_millis()
            ),
            format!(
                "b3-undone-unregisters-end: a user whose last session was acknowledged unregistered after the checkpoint (the checkpoint still holds a lease) may show ONLINE after the restart, but is OFFLINE again by max(the lease's checkpointed deadline, restart + {grace} ms restart grace) + {} ms",
                plan.delivery_bound_ms
            ),
        ]
    }

    fn needs_data_dir(&self) -> bool {
        true
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        let dir = launch.data_dir.clone().ok_or("kill9 needs a data directory")?;
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        self.dir = Some(dir);
        launch.args.extend(["--checkpoint-interval-ms".to_owned(), plan.checkpoint_interval_ms.to_string()]);
        Ok(())
    }

    fn calm_before(&self) -> bool {
        // Mid-churn, so that the last checkpoint misses registers and unregisters.
        false
    }

    fn lasts(&self, _plan: &Plan) -> Duration {
        Duration::from_millis(200)
    }

    fn recovery(&self, plan: &Plan) -> Duration {
        plan.ttl() + Duration::from_millis(u64::from(plan.restart_grace_ms)) + plan.bound()
    }

    fn inject(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.kill_sent_at = cx.recorder.now_us();
        cx.server.kill9()?;
        self.killed_at = cx.recorder.now_us();
        let dir = self.dir.as_ref().ok_or("not configured")?;
        let path = dir.join("leases.checkpoint");
        let bytes = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        let checkpoint = presence_core::checkpoint::decode(&bytes).map_err(|e| format!("{}: {e}", path.display()))?;
        let users: Vec<CheckpointedUser> = checkpoint
            .users
            .iter()
            .map(|u| CheckpointedUser {
                user: u.user_id.to_string(),
                version: u.version,
                online: u.online,
                leases: u
                    .leases
                    .iter()
                    .map(|l| (l.session_id.to_string(), l.generation, cx.recorder.unix_ms_to_us(l.expires_at)))
                    .collect(),
            })
            .collect();
        self.checkpoint = users.iter().map(|u| (u.user.clone(), u.clone())).collect();
        cx.recorder.push(Record::Checkpoint { at_us: self.killed_at, users });
        Ok(())
    }

    fn heal(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        cx.server.restart()?;
        self.restarted_at = cx.recorder.now_us();
        Ok(())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        vec![self.carry_on(a), self.only_changed_users_flip(a), self.undone_unregisters_end(a)]
    }
}

impl Kill9 {
    /// Per (user, session) in the checkpoint: (generation, deadline µs).
    fn leases(&self) -> HashMap<(&str, &str), (u64, u64)> {
        self.checkpoint
            .values()
            .flat_map(|u| u.leases.iter().map(move |(s, g, d)| ((u.user.as_str(), s.as_str()), (*g, *d))))
            .collect()
    }

    fn carry_on(&self, a: &Analysis<'_>) -> Expectation {
        let mut e = Expectation::new(
            "b3-checkpointed-sessions-carry-on",
            "no NOT_FOUND after the restart for a session at its checkpointed generation and deadline",
        );
        let leases = self.leases();
        // The generation each Session renews with, from its reports and its register.
        let mut current: HashMap<(&str, &str), u64> = HashMap::new();
        let margin = 100_000; // a renewal sent within 100 ms of the deadline may arrive after it
        for (index, record) in a.records.iter().enumerate() {
            match record {
                Record::Call(call) => {
                    if let (Op::SessionRegister, Outcome::Ok { generation, .. }) = (call.op, &call.outcome) {
                        current.insert((&call.user, &call.session), *generation);
                    }
                    if call.op != Op::Renew || call.start_us < self.restarted_at {
                        continue;
                    }
                    let Some(&(generation, deadline)) = leases.get(&(call.user.as_str(), call.session.as_str())) else {
                        continue;
                    };
                    if call.sent_generation != generation || call.start_us + margin >= deadline {
                        continue;
                    }
                    e.checked += 1;
                    if call.outcome.code() == Some("NotFound") {
                        e.violations.push(Violation {
                            user: call.user.clone(),
                            what: format!(
                                "renewal of {} at checkpointed generation {generation} refused NOT_FOUND before its deadline",
                                call.session
                            ),
                            excerpt: vec![record.clone()],
                        });
                    }
                }
                Record::Session { user, session, at_us, state, generation, .. } => {
                    let key = (user.as_str(), session.as_str());
                    let before = current.get(&key).copied();
                    if *generation != 0 {
                        current.insert(key, *generation);
                    }
                    if *state != SessionState::Reregistered || *at_us < self.restarted_at {
                        continue;
                    }
                    let Some(&(checkpointed, deadline)) = leases.get(&key) else { continue };
                    // The renewal refused NOT_FOUND was sent before this
                    // report, after a backoff of unknown length (a channel
                    // reconnecting to the restarted process can wait most
                    // of a heartbeat), so only a deadline still ahead at the
                    // report itself was surely ahead when it was refused.
                    if before != Some(checkpointed) || *at_us + margin >= deadline {
                        continue;
                    }
                    e.checked += 1;
                    e.violations.push(Violation {
                        user: user.clone(),
                        what: format!(
                            "Session {session} at checkpointed generation {checkpointed} re-registered after the restart"
                        ),
                        excerpt: a.excerpt(user, self.killed_at, *at_us, 6).into_iter().chain([a.records[index].clone()]).collect(),
                    });
                }
                _ => {}
            }
        }
        e
    }

    /// Whether what `o` shows was made by the process that was killed: seen
    /// by the kill, or answered to a call sent before it. The answer to such
    /// a call may already sit in the socket's buffers and be read after the
    /// kill was stamped; the process applied it all the same.
    fn made_before_kill(&self, a: &Analysis<'_>, o: &Obs) -> bool {
        o.at_us <= self.killed_at
            || matches!(&a.records[o.index], Record::Call(call) if call.start_us <= self.killed_at)
    }

    /// Users that changed after the checkpoint: their highest version made
    /// before the kill is above the checkpointed one, or a call of theirs was
    /// under way when the process died (applied or not, nobody knows): sent
    /// before its exit was reaped and failed with no definite outcome once the
    /// signal was sent (a connection broken by the death may be seen before
    /// the exit is reaped).
    fn changed_after_checkpoint(&self, a: &Analysis<'_>) -> HashSet<String> {
        let mut changed: HashSet<String> = a
            .observations
            .iter()
            .filter(|(user, observations)| {
                let before = observations.iter().filter(|o| self.made_before_kill(a, o)).map(|o| o.version).max();
                before.unwrap_or(0) > self.checkpointed_version(user)
            })
            .map(|(user, _)| user.clone())
            .collect();
        for record in a.records {
            if let Record::Call(call) = record
                && call.start_us <= self.killed_at
                && call.end_us >= self.kill_sent_at
                && !call.outcome.is_definite()
            {
                changed.insert(call.user.clone());
            }
        }
        changed
    }

    fn only_changed_users_flip(&self, a: &Analysis<'_>) -> Expectation {
        let mut e = Expectation::new(
            "b3-only-users-changed-after-the-checkpoint-flip",
            "in the fault window only users changed after the checkpoint flip, at most once each way",
        );
        let changed = self.changed_after_checkpoint(a);
        let (from, to) = a.fault_window.unwrap_or_default();
        let mut per_user: HashMap<String, (usize, usize)> = HashMap::new();
        // From the kill on (calls under way between the quiet mark and the kill
        // still changed users before it); a restore shows checkpointed
        // versions, so only newer ones are flips after it.
        let made_before_kill = |user: &str| {
            let observations = a.observations.get(user).into_iter().flatten();
            observations.filter(|o| self.made_before_kill(a, o)).map(|o| o.version).max().unwrap_or(0)
        };
        let restart_flips = a
            .new_changes_between(self.killed_at, to)
            .into_iter()
            .filter(|(u, o)| o.version > self.checkpointed_version(u) && o.version > made_before_kill(u));
        for (user, obs) in restart_flips {
            let count = per_user.entry(user).or_default();
            if obs.online {
                count.0 += 1;
            } else {
                count.1 += 1;
            }
        }
        e.checked = changed.len();
        for (user, (on, off)) in per_user {
            let why = if !changed.contains(&user) {
                Some("flipped though its version did not move after the checkpoint")
            } else if on > 1 || off > 1 {
                Some("flipped more than once each way")
            } else {
                None
            };
            if let Some(why) = why {
                e.violations.push(Violation {
                    user: user.clone(),
                    what: format!("{why}: {on} ONLINE and {off} OFFLINE in the fault window"),
                    excerpt: a.excerpt(&user, from, to, 10),
                });
            }
        }
        e
    }

    fn undone_unregisters_end(&self, a: &Analysis<'_>) -> Expectation {
        let mut e = Expectation::new(
            "b3-undone-unregisters-end",
            "a user closed after the checkpoint and restored ONLINE is OFFLINE by its deadline or the grace's end",
        );
        // Sessions held at the kill, from the calls and the Session reports.
        let mut held: HashMap<(&str, &str), bool> = HashMap::new();
        for record in a.records {
            match record {
                Record::Call(call) if call.start_us <= self.killed_at => {
                    if call.op.is_register() && call.outcome.code().is_none() {
                        held.insert((&call.user, &call.session), true);
                    } else if call.op.is_close() {
                        held.insert((&call.user, &call.session), false);
                    }
                }
                _ => {}
            }
        }
        let grace_end = self.restarted_at + self.grace_ms(a) * 1_000;
        let bound = a.config.delivery_bound_ms * 1_000;
        for user in self.checkpoint.values().filter(|u| u.online) {
            let still_held = held.iter().any(|((u, _), h)| *u == user.user && *h);
            if still_held || user.user == crate::clients::SENTINEL {
                continue;
            }
            let closed_after = a.observations.get(&user.user).is_some_and(|obs| {
                obs.iter().any(|o| self.made_before_kill(a, o) && o.version > user.version && !o.online)
            });
            if !closed_after {
                continue;
            }
            e.checked += 1;
            let deadline = user.leases.iter().map(|(_, _, d)| *d).max().unwrap_or(0);
            let due = deadline.max(grace_end) + bound;
            let offline_at = a
                .observations
                .get(&user.user)
                .into_iter()
                .flatten()
                .filter(|o| {
                    o.at_us > self.restarted_at && !o.online && matches!(a.records[o.index], Record::Event { .. })
                })
                .map(|o| o.at_us)
                .min();
            let restored_online = a
                .observations
                .get(&user.user)
                .into_iter()
                .flatten()
                .any(|o| o.at_us > self.killed_at && o.online && o.version == user.version);
            match offline_at {
                Some(at) if at <= due => {}
                _ if !restored_online => {}
                other => e.violations.push(Violation {
                    user: user.user.clone(),
                    what: format!(
                        "restored ONLINE (checkpointed version {}) after an acknowledged close; OFFLINE due by {} ms, seen at {:?} ms",
                        user.version,
                        due / 1_000,
                        other.map(|t| t / 1_000)
                    ),
                    excerpt: a.excerpt(&user.user, self.killed_at.saturating_sub(2_000_000), due + 2_000_000, 10),
                }),
            }
        }
        e
    }

    fn grace_ms(&self, a: &Analysis<'_>) -> u64 {
        // The runner sets the restart grace to the TTL (see `runner::server_args`).
        a.config.ttl_ms
    }
}

/// The default data directory for a run that needs one.
pub fn scratch_dir(name: &str) -> PathBuf {
    std::env::temp_dir().join(format!("presence-history-{name}-{}", std::process::id()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checker::CheckConfig;
    use crate::history::{Call, EventKind, Presence};

    const CONFIG: CheckConfig = CheckConfig { ttl_ms: 1_200, heartbeat_ms: 400, delivery_bound_ms: 2_000 };

    fn presence(user: &str, online: bool, version: u64) -> Presence {
        Presence { user: user.into(), online, version }
    }

    fn call(op: Op, user: &str, (start_us, end_us): (u64, u64), online: bool, version: u64) -> Record {
        Record::Call(Call {
            client: "gw0".into(),
            op,
            user: user.into(),
            session: "s".into(),
            sent_generation: if op.is_register() { 0 } else { 7 },
            start_us,
            end_us,
            outcome: Outcome::Ok {
                changed: Some(true),
                presence: Some(presence(user, online, version)),
                generation: 7,
            },
        })
    }

    fn event(at_us: u64, kind: EventKind, user: &str, online: bool, version: u64) -> Record {
        Record::Event { viewer: 0, stream: 2, at_us, kind, presence: presence(user, online, version) }
    }

    fn checkpointed(user: &str, version: u64) -> (String, CheckpointedUser) {
        let leases = vec![("s".to_owned(), 7, 5_000_000)];
        (user.to_owned(), CheckpointedUser { user: user.into(), version, online: true, leases })
    }

    /// The process is killed at 3.605 s, checkpointed with `a` ONLINE at 10
    /// and `b` ONLINE at 20, and restarted at 3.8 s.
    fn killed() -> Kill9 {
        let checkpoint = [checkpointed("a", 10), checkpointed("b", 20)].into_iter().collect();
        Kill9 { dir: None, checkpoint, kill_sent_at: 3_604_000, killed_at: 3_605_000, restarted_at: 3_800_000 }
    }

    /// `a` is closed by a call sent before the kill whose answer is read
    /// after it; the restore brings back the checkpointed lease, which
    /// expires at its deadline. `b` did nothing.
    fn history(b_flips: bool) -> Vec<Record> {
        let mut h = vec![
            Record::Phase { at_us: 1_000_000, name: "quiet".into() },
            call(Op::Register, "a", (400_000, 410_000), true, 10),
            call(Op::Register, "b", (420_000, 430_000), true, 20),
            call(Op::Unregister, "a", (3_602_925, 3_611_245), false, 11),
            event(3_900_000, EventKind::Opening { partial: false }, "a", true, 10),
            event(3_900_000, EventKind::Opening { partial: false }, "b", true, 20),
            event(5_021_817, EventKind::Update, "a", false, 12),
        ];
        if b_flips {
            h.push(event(5_100_000, EventKind::Update, "b", false, 21));
        }
        h.push(Record::Phase { at_us: 9_000_000, name: "churn".into() });
        h
    }

    #[test]
    fn b3_a_close_answered_after_the_kill_was_applied_before_it() {
        let records = history(false);
        let analysis = Analysis::new(&records, CONFIG);
        let fault = killed();
        let flips = fault.only_changed_users_flip(&analysis);
        assert!(flips.violations.is_empty(), "{:?}", flips.violations);
        assert_eq!(flips.checked, 1, "a changed after the checkpoint, b did not");
        let undone = fault.undone_unregisters_end(&analysis);
        assert_eq!((undone.checked, undone.violations.len()), (1, 0), "{:?}", undone.violations);
    }

    /// `b` is closed by a call whose stream broke with the process (no
    /// definite outcome), seen between the signal and the reaped exit, and
    /// `b` then flips OFFLINE after the restart: the close was under way
    /// when the process died, so `b` may have changed. The same broken call
    /// ended before the signal was sent excuses nothing.
    fn broken_close_of_b(start_us: u64, end_us: u64) -> Vec<Record> {
        let mut h = history(true);
        let broken = Record::Call(Call {
            client: "gw1".into(),
            op: Op::Unregister,
            user: "b".into(),
            session: "s".into(),
            sent_generation: 7,
            start_us,
            end_us,
            outcome: Outcome::Err { code: "Unavailable".into(), message: "the lease stream broke".into() },
        });
        h.insert(4, broken);
        h
    }

    #[test]
    fn b3_a_close_broken_by_the_death_may_have_changed_its_user() {
        let records = broken_close_of_b(3_603_500, 3_604_500);
        let flips = killed().only_changed_users_flip(&Analysis::new(&records, CONFIG));
        assert!(flips.violations.is_empty(), "{:?}", flips.violations);
        assert_eq!(flips.checked, 2, "a and b may have changed after the checkpoint");

        let records = broken_close_of_b(3_600_000, 3_603_000);
        let flips = killed().only_changed_users_flip(&Analysis::new(&records, CONFIG));
        let flagged: Vec<&str> = flips.violations.iter().map(|v| v.user.as_str()).collect();
        assert_eq!(flagged, ["b"], "broken before the signal: {:?}", flips.violations);
    }

    #[test]
    fn b3_a_user_unchanged_since_the_checkpoint_that_flips_is_flagged() {
        let records = history(true);
        let analysis = Analysis::new(&records, CONFIG);
        let flips = killed().only_changed_users_flip(&analysis);
        let flagged: Vec<&str> = flips.violations.iter().map(|v| v.user.as_str()).collect();
        assert_eq!(flagged, ["b"], "{:?}", flips.violations);
    }
}
