//! Network faults: the server runs in a [`NetLab`] namespace and each client
//! group leaves from its own host address, so that loss or a partition can
//! hit some clients and spare the others.
//!
//! Groups: gateway `g` is group `g`, the viewers are group `G` (G gateways),
//! and the runner's own calls (barriers, the final snapshot) are group
//! `G + 1`, which no fault touches: the barriers that end the recovery need
//! the server reachable.

use std::collections::{HashMap, HashSet};
use std::net::SocketAddr;
use std::time::Duration;

use presence_faults::{DelayProxy, NetLab};

use crate::checker::{Allowances, Analysis, Expectation, Violation};
use crate::clients::Target;
use crate::faults::{Client, Fault, FaultCx, Plan, no_change_in_window, window_changes};
use crate::history::{Op, Outcome, Record, SessionState};
use crate::server::Launch;

/// The lab a network fault runs the server in.
#[derive(Debug, Default)]
pub struct Lab {
    lab: Option<NetLab>,
    gateways: usize,
}

impl Lab {
    /// Makes the namespace and moves the server into it, on the same port.
    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        let lab = NetLab::new(plan.gateways + 2).map_err(|e| e.to_string())?;
        let port = launch.listen.rsplit(':').next().unwrap_or("0").to_owned();
        launch.prefix = ["ip", "netns", "exec", lab.namespace()].iter().map(|w| w.to_string()).collect();
        launch.listen = format!("{}:{port}", lab.server_ip());
        // Without credentials presenced listens only on loopback; the lab is
        // a private namespace reached only by this run's clients.
        launch.args.push("--insecure".to_owned());
        self.gateways = plan.gateways;
        self.lab = Some(lab);
        Ok(())
    }

    fn lab(&self) -> Result<&NetLab, String> {
        self.lab.as_ref().ok_or_else(|| "the lab is not configured".to_owned())
    }

    fn group(&self, client: Client) -> usize {
        match client {
            Client::Gateway(g) => g,
            Client::Viewer(_) => self.gateways,
            Client::Admin => self.gateways + 1,
        }
    }

    /// `default` (the server's URL in the lab), leaving from `client`'s group address.
    fn route(&self, client: Client, default: &Target) -> Target {
        let bind = self.lab.as_ref().map(|lab| lab.group_ip(self.group(client)));
        Target { url: default.url.clone(), bind }
    }

    /// The server's address in the lab, once configured.
    fn server_addr(&self, launch: &Launch) -> Result<SocketAddr, String> {
        launch.listen.parse().map_err(|e| format!("{}: {e}", launch.listen))
    }
}

/// A gateway's number from its client name (`gw3` → 3).
fn gateway_of(client: &str) -> Option<usize> {
    client.strip_prefix("gw")?.parse().ok()
}

/// Per user, the sessions held: (session, gateway).
type HeldSessions = HashMap<String, Vec<(String, usize)>>;

/// The sessions held at `at_us` (an acknowledged register not followed by a
/// close), by user: (session, gateway). A user with a close under way or
/// unacknowledged at `at_us` is in the second set (its state is not known).
fn held_at(a: &Analysis<'_>, at_us: u64) -> (HeldSessions, HashSet<String>) {
    let mut held: HashMap<(String, String), usize> = HashMap::new();
    let mut unknown = HashSet::new();
    for record in a.records {
        let Record::Call(call) = record else { continue };
        if call.start_us > at_us {
            continue;
        }
        let key = (call.user.clone(), call.session.clone());
        let answered = call.end_us <= at_us;
        match (&call.outcome, call.op.is_register(), call.op.is_close()) {
            (Outcome::Ok { .. }, true, _) if answered => {
                held.insert(key, gateway_of(&call.client).unwrap_or(usize::MAX));
            }
            (Outcome::Ok { .. }, _, true) if answered => {
                held.remove(&key);
            }
            (_, true, _) | (_, _, true) if !answered || !call.outcome.is_definite() => {
                unknown.insert(call.user.clone());
            }
            _ => {}
        }
    }
    let mut by_user: HeldSessions = HashMap::new();
    for ((user, session), gateway) in held {
        by_user.entry(user).or_default().push((session, gateway));
    }
    (by_user, unknown)
}

/// Whether `user` has a recorded hidden cause for a change in `[from, to]`:
/// a call failed in transit, a renewal answered NOT_FOUND, a `Session`
/// reporting its lease lost or re-registered.
fn lease_trouble(a: &Analysis<'_>, user: &str, from: u64, to: u64) -> bool {
    a.by_user.get(user).into_iter().flatten().any(|&i| match &a.records[i] {
        Record::Call(call) => {
            call.start_us <= to
                && call.end_us >= from
                && (!call.outcome.is_definite() || call.outcome.code() == Some("NotFound"))
        }
        Record::Session { at_us, state: SessionState::Lost | SessionState::Reregistered, .. } => {
            *at_us >= from && *at_us <= to
        }
        _ => false,
    })
}

/// The `p`-quantile of the durations (ms) of the unary renewals that
/// succeeded in `[from, to]`, and how many there were.
pub(crate) fn renew_quantile(a: &Analysis<'_>, from: u64, to: u64, p: f64) -> (f64, usize) {
    let mut ms: Vec<f64> = a
        .records
        .iter()
        .filter_map(|r| match r {
            Record::Call(c)
                if c.op == Op::Renew && c.start_us >= from && c.end_us <= to && c.outcome.code().is_none() =>
            {
                Some((c.end_us - c.start_us) as f64 / 1_000.0)
            }
            _ => None,
        })
        .collect();
    if ms.is_empty() {
        return (0.0, 0);
    }
    ms.sort_by(f64::total_cmp);
    let index = ((ms.len() as f64 * p).ceil() as usize).clamp(1, ms.len()) - 1;
    (ms[index], ms.len())
}

/// Every gateway call or `Session` report in `[from, to]` that shows lease
/// trouble, as violations (for faults that must not touch the gateways).
pub(crate) fn gateway_trouble(a: &Analysis<'_>, from: u64, to: u64) -> Vec<Violation> {
    let mut out = Vec::new();
    for (index, record) in a.records.iter().enumerate() {
        let (user, what) = match record {
            Record::Call(c)
                if c.start_us <= to
                    && c.end_us >= from
                    && (!c.outcome.is_definite() || c.outcome.code() == Some("NotFound")) =>
            {
                (&c.user, format!("{:?} by {} ended {:?}", c.op, c.client, c.outcome.code()))
            }
            Record::Session {
                user, at_us, state: state @ (SessionState::Lost | SessionState::Reregistered), ..
            } if *at_us >= from && *at_us <= to => (user, format!("a Session reported {state:?}")),
            _ => continue,
        };
        out.push(Violation { user: user.clone(), what, excerpt: vec![a.records[index].clone()] });
    }
    out
}

/// Random loss between every client (gateways and viewers) and the server.
#[derive(Debug, Default)]
pub struct Loss {
    lab: Lab,
}

/// The loss probability of the `loss` fault, each direction.
const LOSS: f64 = 0.25;

impl Allowances for Loss {}

impl Fault for Loss {
    fn name(&self) -> &'static str {
        "loss"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        vec![
            "every generic rule holds".into(),
            format!(
                "loss-flips-grounded: {:.0}% of packets each way between every gateway and viewer and the server are dropped for {} ms (two TTLs). A lease starves only if none of a session's renewals (one every {} ms) lands for a whole {} ms TTL; over TCP that takes one segment lost about four times in a row (0.25^4 = 0.4%, RTO backoff 0.2 + 0.4 + 0.8 + 1.6 s), rare but possible on a connection shared by a gateway's sessions. So a user may flip in the fault window (inject to {} ms after heal) only if a call or Session of it shows lease trouble then (failed in transit, NOT_FOUND, Lost, Reregistered); every other user shows nothing",
                LOSS * 100.0,
                self.lasts(plan).as_millis(),
                plan.heartbeat_ms,
                plan.ttl_ms,
                self.recovery(plan).as_millis()
            ),
            "loss-viewers-converge: after the heal every viewer catches up (the barrier after the recovery) and converges (generic)".into(),
        ]
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        self.lab.configure(launch, plan)
    }

    fn route(&self, client: Client, default: &Target) -> Target {
        self.lab.route(client, default)
    }

    fn lasts(&self, plan: &Plan) -> Duration {
        plan.ttl() * 2
    }

    fn inject(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        let lab = self.lab.lab()?;
        for group in 0..=self.lab.gateways {
            lab.loss(group, LOSS).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn heal(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.lab.lab()?.heal_all().map_err(|e| e.to_string())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let mut e = Expectation::new("loss-flips-grounded", "a user flips under loss only with recorded lease trouble");
        let (from, to) = a.fault_window.unwrap_or_default();
        let changes = window_changes(a);
        e.checked = changes.len();
        let trouble: usize = a.observations.keys().filter(|u| lease_trouble(a, u, from, to)).count();
        e.statement = format!("{}; {} users had recorded lease trouble", e.statement, trouble);
        for (user, obs) in changes {
            if !lease_trouble(a, &user, from, to) {
                e.violations.push(Violation {
                    user: user.clone(),
                    what: format!("{} at version {} with no recorded lease trouble", online(obs.online), obs.version),
                    excerpt: a.excerpt(&user, from, to, 8),
                });
            }
        }
        vec![e]
    }
}

fn online(online: bool) -> &'static str {
    if online { "ONLINE" } else { "OFFLINE" }
}

/// One tick of the server's clock, in µs.
const TICK_US: u64 = 1_000;

/// Half the gateways partitioned from the server for two TTLs.
#[derive(Debug, Default)]
pub struct PartitionGateways {
    lab: Lab,
}

impl PartitionGateways {
    /// The partitioned gateways: the first half, so both client paths (even
    /// gateways hold `Session`s, odd ones make unary calls) are among them.
    fn partitioned(gateways: usize) -> std::ops::Range<usize> {
        0..gateways / 2
    }
}

impl Allowances for PartitionGateways {}

impl Fault for PartitionGateways {
    fn name(&self) -> &'static str {
        "partition-gateways"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        let p = Self::partitioned(plan.gateways);
        vec![
            "every generic rule holds".into(),
            format!(
                "partitioned-users-offline-once: gateways {p:?} are partitioned from the server for {} ms (two {} ms TTLs); each user ONLINE at the partition all of whose held sessions are on those gateways goes OFFLINE exactly once, not before its last acknowledged renewal (unary) + TTL and by partition + TTL + {} ms (delivery bound)",
                self.lasts(plan).as_millis(),
                plan.ttl_ms,
                plan.delivery_bound_ms
            ),
            format!(
                "partitioned-users-back-once: after the heal the partitioned gateways' renewals are answered NOT_FOUND (or their Sessions re-register) and those users come back ONLINE exactly once, within the {} ms recovery",
                self.recovery(plan).as_millis()
            ),
            "others-no-flip: every other user (a held session on a healthy gateway, or none held) shows no change from the partition to the end of the recovery".into(),
            "viewers converge (generic)".into(),
        ]
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        self.lab.configure(launch, plan)
    }

    fn route(&self, client: Client, default: &Target) -> Target {
        self.lab.route(client, default)
    }

    fn lasts(&self, plan: &Plan) -> Duration {
        plan.ttl() * 2
    }

    /// Two TTLs and the delivery bound: a connection stalled by the
    /// partition resumes at its next TCP retransmission, which the backoff
    /// may put up to a few seconds after the heal, and then the gateway
    /// still has to meet NOT_FOUND and register again.
    fn recovery(&self, plan: &Plan) -> Duration {
        plan.ttl() * 2 + plan.bound()
    }

    fn inject(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        let lab = self.lab.lab()?;
        for g in Self::partitioned(self.lab.gateways) {
            lab.partition(g).map_err(|e| e.to_string())?;
        }
        Ok(())
    }

    fn heal(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.lab.lab()?.heal_all().map_err(|e| e.to_string())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let inject = a.mark("inject").unwrap_or_default();
        let heal = a.mark("heal").unwrap_or_default();
        let (_, to) = a.fault_window.unwrap_or_default();
        let ttl = a.config.ttl_ms * 1_000;
        let bound = a.config.delivery_bound_ms * 1_000;
        let partitioned: HashSet<usize> = Self::partitioned(self.lab.gateways).collect();
        let (held, unknown) = held_at(a, inject);
        let cut: HashSet<&str> = held
            .iter()
            .filter(|(_, sessions)| sessions.iter().all(|(_, g)| partitioned.contains(g)))
            .map(|(user, _)| user.as_str())
            .collect();
        let mut changes: HashMap<&str, Vec<crate::checker::Obs>> = HashMap::new();
        let window = window_changes(a);
        for (user, obs) in &window {
            changes.entry(user.as_str()).or_default().push(*obs);
        }

        let mut offline = Expectation::new(
            "partitioned-users-offline-once",
            "each user cut off by the partition goes OFFLINE once, on time",
        );
        let mut back = Expectation::new("partitioned-users-back-once", "and comes back ONLINE once after the heal");
        for &user in &cut {
            offline.checked += 1;
            back.checked += 1;
            let seen = changes.get(user).cloned().unwrap_or_default();
            let excerpt = || a.excerpt(user, inject.saturating_sub(2 * ttl), to, 10);
            // The last renewal (or register) a unary gateway had acknowledged before the partition.
            let last_ack = a
                .by_user
                .get(user)
                .into_iter()
                .flatten()
                .filter_map(|&i| match &a.records[i] {
                    Record::Call(c) if c.op == Op::Renew || c.op == Op::Register => {
                        (c.end_us <= inject && c.outcome.code().is_none()).then_some(c.start_us)
                    }
                    _ => None,
                })
                .max();
            let offs: Vec<_> = seen.iter().filter(|o| !o.online).collect();
            let ons: Vec<_> = seen.iter().filter(|o| o.online).collect();
            let what = match offs.as_slice() {
                [off] if off.at_us > inject + ttl + bound => {
                    Some(format!("OFFLINE only {} ms after the partition", (off.at_us - inject) / 1_000))
                }
                // The server's clock counts whole milliseconds, rounding down
                // (`crates/presence-server/src/node/clock.rs`), so a renewal's
                // deadline may lie up to one tick (1 ms) before receipt + TTL.
                [off] if last_ack.is_some_and(|ack| off.at_us + TICK_US < ack + ttl) => Some(format!(
                    "OFFLINE {} ms after the last acknowledged renewal, before a TTL",
                    (off.at_us - last_ack.unwrap_or(0)) / 1_000
                )),
                [_] => None,
                _ => Some(format!("{} OFFLINE in the fault window", offs.len())),
            };
            if let Some(what) = what {
                offline.violations.push(Violation { user: user.to_owned(), what, excerpt: excerpt() });
            }
            let re_registered = lease_trouble(a, user, heal, to);
            let what = match ons.as_slice() {
                [on] if offs.first().is_some_and(|off| on.at_us < off.at_us) => {
                    Some("ONLINE before its OFFLINE".to_owned())
                }
                [on] if on.at_us < heal => Some("ONLINE again before the heal".to_owned()),
                [_] if !re_registered => {
                    Some("ONLINE with no NOT_FOUND or re-register recorded after the heal".to_owned())
                }
                [_] => None,
                _ => Some(format!("{} ONLINE in the fault window", ons.len())),
            };
            if let Some(what) = what {
                back.violations.push(Violation { user: user.to_owned(), what, excerpt: excerpt() });
            }
        }

        let mut others = Expectation::new("others-no-flip", "no other user changes in the fault window");
        for (user, obs) in &window {
            if cut.contains(user.as_str()) {
                continue;
            }
            others.checked += 1;
            if unknown.contains(user) {
                continue;
            }
            others.violations.push(Violation {
                user: user.clone(),
                what: format!("{} at version {} though not cut off", online(obs.online), obs.version),
                excerpt: a.excerpt(user, inject.saturating_sub(2 * ttl), to, 10),
            });
        }
        others.statement = format!(
            "{} ({} users cut off, {} held a session on a healthy gateway or none)",
            others.statement,
            cut.len(),
            a.observations.len().saturating_sub(cut.len() + 1)
        );
        vec![offline, back, others]
    }
}

/// The viewers partitioned from the server for two TTLs while the gateways churn.
#[derive(Debug, Default)]
pub struct PartitionViewers {
    lab: Lab,
}

impl Allowances for PartitionViewers {}

impl Fault for PartitionViewers {
    fn name(&self) -> &'static str {
        "partition-viewers"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        vec![
            "every generic rule holds, versions-increase with no exception: no viewer ever receives an older version, across a reconnect too".into(),
            format!(
                "viewers-catch-up: the viewers are partitioned for {} ms (two {} ms TTLs) while the gateways churn; by the end of the {} ms recovery each viewer has received, for every user it watches, a version at least as new as every version answered to a gateway before the heal (whether its stream resumed or it reconnected with known_versions)",
                self.lasts(plan).as_millis(),
                plan.ttl_ms,
                self.recovery(plan).as_millis()
            ),
            "no-gateway-effect: no gateway call fails, none is answered NOT_FOUND and no Session loses its lease from the partition to the end of the recovery".into(),
            "viewers converge (generic)".into(),
        ]
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        self.lab.configure(launch, plan)
    }

    fn route(&self, client: Client, default: &Target) -> Target {
        self.lab.route(client, default)
    }

    fn churn_during(&self) -> bool {
        true
    }

    fn lasts(&self, plan: &Plan) -> Duration {
        plan.ttl() * 2
    }

    fn recovery(&self, plan: &Plan) -> Duration {
        // As for the gateways' partition: a stalled stream resumes at the next retransmission.
        plan.ttl() * 2 + plan.bound()
    }

    fn inject(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.lab.lab()?.partition(self.lab.gateways).map_err(|e| e.to_string())
    }

    fn heal(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.lab.lab()?.heal_all().map_err(|e| e.to_string())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let inject = a.mark("inject").unwrap_or_default();
        let heal = a.mark("heal").unwrap_or_default();
        let (_, to) = a.fault_window.unwrap_or_default();
        // The newest version answered to a gateway before the heal, by user.
        let mut answered: HashMap<&str, u64> = HashMap::new();
        for record in a.records {
            if let Record::Call(c) = record
                && c.end_us <= heal
                && let Outcome::Ok { presence: Some(p), .. } = &c.outcome
            {
                let v = answered.entry(p.user.as_str()).or_default();
                *v = (*v).max(p.version);
            }
        }
        // The newest version each viewer received by the end of the recovery.
        let mut received: HashMap<(usize, &str), u64> = HashMap::new();
        let mut reopened: HashSet<usize> = HashSet::new();
        for record in a.records {
            match record {
                Record::Event { viewer, at_us, presence, .. } if *at_us <= to => {
                    let v = received.entry((*viewer, presence.user.as_str())).or_default();
                    *v = (*v).max(presence.version);
                }
                Record::Stream { viewer, at_us, opened: true, .. } if *at_us > inject && *at_us <= to => {
                    reopened.insert(*viewer);
                }
                _ => {}
            }
        }
        let mut caught = Expectation::new("viewers-catch-up", "each viewer is caught up by the end of the recovery");
        let mut viewers: Vec<_> = a.watching.iter().collect();
        viewers.sort_by_key(|(v, _)| **v);
        for (viewer, users) in viewers {
            for user in users {
                let Some(&version) = answered.get(user.as_str()) else { continue };
                caught.checked += 1;
                let got = received.get(&(*viewer, user.as_str())).copied().unwrap_or(0);
                if got < version {
                    caught.violations.push(Violation {
                        user: user.clone(),
                        what: format!("viewer {viewer} had version {got} at the end of the recovery, gateways were answered {version}"),
                        excerpt: a.excerpt(user, inject, to, 8),
                    });
                }
            }
        }
        caught.statement = format!(
            "{} ({} of {} viewers opened a new stream during the partition or the recovery)",
            caught.statement,
            reopened.len(),
            a.watching.len()
        );
        let mut gateways = Expectation::new("no-gateway-effect", "no gateway call or Session shows lease trouble");
        gateways.checked =
            a.records.iter().filter(|r| matches!(r, Record::Call(c) if c.start_us >= inject && c.end_us <= to)).count();
        gateways.violations = gateway_trouble(a, inject, to);
        vec![caught, gateways]
    }
}

/// Every client reaches the server through a [`DelayProxy`].
#[derive(Debug, Default)]
pub struct Delay {
    lab: Lab,
    proxy: Option<DelayProxy>,
}

/// The one-way delay of the `delay` fault before and after the fault window, and in it.
const DELAY: Duration = Duration::from_millis(100);
const DELAY_RAISED: Duration = Duration::from_millis(200);

impl Allowances for Delay {}

impl Fault for Delay {
    fn name(&self) -> &'static str {
        "delay"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        vec![
            "every generic rule holds".into(),
            format!(
                "delay-no-flip: gateways and viewers reach the server through a proxy adding {} ms each way, raised to {} ms for {} ms in the middle of the run (a 400 ms round trip, against a {} ms TTL and {} ms heartbeat); no user changes in the fault window (renewals only)",
                DELAY.as_millis(),
                DELAY_RAISED.as_millis(),
                self.lasts(plan).as_millis(),
                plan.ttl_ms,
                plan.heartbeat_ms
            ),
            "delay-no-lease-trouble: in the whole run no call fails, none is answered NOT_FOUND, no Session loses its lease".into(),
            "delay-applied: the median unary renewal takes at least two delays (the round trip): 200 ms outside the window, 400 ms in it".into(),
        ]
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        self.lab.configure(launch, plan)?;
        let upstream = self.lab.server_addr(launch)?;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| e.to_string())?;
        listener.set_nonblocking(true).map_err(|e| e.to_string())?;
        let listener = tokio::net::TcpListener::from_std(listener).map_err(|e| e.to_string())?;
        self.proxy = Some(DelayProxy::serve(listener, upstream, DELAY).map_err(|e| e.to_string())?);
        Ok(())
    }

    /// Gateways and viewers through the proxy; the runner's own calls straight to the server.
    fn route(&self, client: Client, default: &Target) -> Target {
        match (&self.proxy, client) {
            (Some(proxy), Client::Gateway(_) | Client::Viewer(_)) => {
                Target { url: format!("http://{}", proxy.local_addr()), bind: None }
            }
            _ => self.lab.route(client, default),
        }
    }

    fn lasts(&self, plan: &Plan) -> Duration {
        plan.ttl() * 2
    }

    fn inject(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.proxy.as_ref().ok_or("no proxy")?.set_delay(DELAY_RAISED);
        Ok(())
    }

    fn heal(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.proxy.as_ref().ok_or("no proxy")?.set_delay(DELAY);
        Ok(())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let calm = no_change_in_window(a, "delay-no-flip", "no user changes in the fault window", false);
        let mut trouble = Expectation::new("delay-no-lease-trouble", "no lease trouble in the whole run");
        trouble.checked = a.records.iter().filter(|r| matches!(r, Record::Call(_))).count();
        trouble.violations = gateway_trouble(a, 0, u64::MAX);
        let inject = a.mark("inject").unwrap_or_default();
        let heal = a.mark("heal").unwrap_or_default();
        let (inside, n_in) = renew_quantile(a, inject + 500_000, heal, 0.5);
        let (outside, n_out) = renew_quantile(a, 0, inject, 0.5);
        let (p99_in, _) = renew_quantile(a, inject + 500_000, heal, 0.99);
        let mut applied = Expectation::new(
            "delay-applied",
            &format!(
                "median unary renewal {outside:.0} ms before the window ({n_out} renewals), {inside:.0} ms in it ({n_in}, p99 {p99_in:.0} ms)"
            ),
        );
        applied.checked = n_in + n_out;
        let round = |d: Duration| d.as_secs_f64() * 2_000.0;
        if n_out == 0 || outside < round(DELAY) || n_in == 0 || inside < round(DELAY_RAISED) {
            applied.violations.push(Violation {
                user: String::new(),
                what: "the renewals were not delayed as set".into(),
                excerpt: Vec::new(),
            });
        }
        vec![calm, trouble, applied]
    }
}
