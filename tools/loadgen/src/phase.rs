//! The gateway phases: `concurrency` workers, each with its own [`Conn`], take
//! consecutive session numbers from one shared cursor, `items_per_call` at a time, send
//! them, and record each item's latency (a batch's round trip for each of its items).
//!
//! A phase is bounded either by a range of sessions (every session once: registers) or
//! by a duration (cycling over every session: heartbeats). With `rate > 0` call `i`
//! (counted in items) is not sent before `start + i / rate`; latency is still measured
//! from the actual send, as ghz does.

use std::ops::Range;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use crate::conn::{Conn, ConnSpec, GenItem, ItemErr, Naming, RegItem, RoomItem, open_conns};
use crate::ids::{Generations, Slots};
use crate::progress::{Progress, Ticker};
use crate::redis_seed::now_ms;
use crate::stats::Recorder;

/// What the workers send.
#[derive(Debug, Clone)]
pub(crate) enum Work {
    /// Register each session; keep its generation (and deadline when `deadlines` is set).
    Register(TtlPlan),
    /// Renew each session with the generation kept from its register.
    Renew {
        /// TTL sent with each renewal.
        ttl_ms: u32,
    },
    /// Room items (joins, leaves, signals) as the plan says, with the generation kept
    /// from each session's register.
    Room(Arc<dyn RoomPlan>),
}

/// Which room item a session sends each time a phase reaches it.
pub(crate) trait RoomPlan: std::fmt::Debug + Send + Sync {
    /// The item for `session` the `pass`-th time the phase reaches it (0 the first
    /// time; a phase bounded by a duration cycles over its sessions, each cycle a pass).
    fn item(&self, session: u64, pass: u64) -> RoomItem;
}

/// The TTL of each register.
#[derive(Debug, Clone, Copy)]
pub(crate) enum TtlPlan {
    /// The same TTL for every session.
    Fixed(u32),
    /// Deadlines spread evenly over `[first_deadline_ms, first_deadline_ms + window_ms)`
    /// by session number: session `k` of `count` asks for the TTL that makes its lease
    /// end at `first + k * window / count`, computed when it is sent (never below
    /// `min_ttl_ms`).
    Arranged {
        /// Deadline of session 0, Unix ms.
        first_deadline_ms: i64,
        /// Width of the window.
        window_ms: i64,
        /// Sessions spread over the window.
        count: u64,
        /// The server's lowest TTL.
        min_ttl_ms: u32,
    },
}

impl TtlPlan {
    /// The TTL to send for session `k` at `now_ms`, and whether it had to be raised to
    /// the minimum (the session was sent too late for its slot).
    pub(crate) fn ttl(&self, k: u64, now_ms: i64) -> (u32, bool) {
        match *self {
            TtlPlan::Fixed(ttl) => (ttl, false),
            TtlPlan::Arranged { first_deadline_ms, window_ms, count, min_ttl_ms } => {
                let slot =
                    first_deadline_ms + (i128::from(k) * i128::from(window_ms) / i128::from(count.max(1))) as i64;
                let want = slot - now_ms;
                if want < i64::from(min_ttl_ms) {
                    (min_ttl_ms, true)
                } else {
                    (u32::try_from(want).unwrap_or(u32::MAX), false)
                }
            }
        }
    }
}

/// Which sessions a phase covers and when it stops.
#[derive(Debug, Clone)]
pub(crate) enum Bound {
    /// Each session in the range once.
    Sessions(Range<u64>),
    /// Cycle over sessions `first..first + sessions` for this long.
    For {
        /// First session.
        first: u64,
        /// Sessions to cycle over.
        sessions: u64,
        /// How long.
        duration: Duration,
    },
}

/// State the phases share: names, and what registers returned.
#[derive(Debug)]
pub(crate) struct Shared {
    /// Population and gateway id.
    pub(crate) naming: Naming,
    /// Generation per session.
    pub(crate) gens: Generations,
    /// Lease deadline per session (Unix ms), when a scenario needs them.
    pub(crate) deadlines: Option<Slots>,
}

/// A phase to run.
#[derive(Debug, Clone)]
pub(crate) struct PhaseSpec {
    /// Progress bar title.
    pub(crate) title: String,
    /// What to send.
    pub(crate) work: Work,
    /// Items per call (1, or the batch size).
    pub(crate) items_per_call: u64,
    /// Which sessions, for how long.
    pub(crate) bound: Bound,
    /// Items per second, 0 = as fast as possible.
    pub(crate) rate: f64,
}

impl PhaseSpec {
    /// Registers `sessions` with a fixed TTL, as fast as possible: the setup of every scenario.
    pub(crate) fn register_all(ttl_ms: u32, items_per_call: u64, sessions: std::ops::Range<u64>) -> Self {
        PhaseSpec {
            title: "register".into(),
            work: Work::Register(TtlPlan::Fixed(ttl_ms)),
            items_per_call,
            bound: Bound::Sessions(sessions),
            rate: 0.0,
        }
    }
}

/// What a phase measured.
#[derive(Debug, Clone, Default)]
pub(crate) struct PhaseResult {
    /// Every item's outcome and latency.
    pub(crate) rec: Recorder,
    /// Wall time from the first send to the last answer.
    pub(crate) elapsed: Duration,
    /// Renewals acknowledged without a store write.
    pub(crate) throttled: u64,
    /// Registers that changed the user's state (room items: that changed the room).
    pub(crate) flips: u64,
    /// Arranged registers sent too late for their slot.
    pub(crate) late: u64,
    /// Calls sent after their scheduled time (rate-limited phases).
    pub(crate) behind_schedule: u64,
}

impl PhaseResult {
    /// Items per second.
    pub(crate) fn rate(&self) -> f64 {
        self.rec.count() as f64 / self.elapsed.as_secs_f64().max(1e-9)
    }
}

/// Opens `spec`'s connections and registers `sessions` through them with a fixed
/// TTL, as fast as they go: the setup of every scenario. Gives the
/// connections back for the phases that follow.
pub(crate) async fn register_everyone(
    spec: &ConnSpec,
    shared: &Arc<Shared>,
    ttl_ms: u32,
    sessions: Range<u64>,
    progress: Progress,
) -> Result<(PhaseResult, Vec<Conn>), String> {
    let conns = open_conns(spec).await?;
    let items_per_call = spec.mode.items_per_call(spec.batch);
    Ok(run_phase(conns, Arc::clone(shared), PhaseSpec::register_all(ttl_ms, items_per_call, sessions), progress).await)
}

/// Runs a phase on `conns` (one worker each) and gives the connections back.
pub(crate) async fn run_phase(
    conns: Vec<Conn>,
    shared: Arc<Shared>,
    spec: PhaseSpec,
    progress: Progress,
) -> (PhaseResult, Vec<Conn>) {
    let spec = Arc::new(spec);
    let cursor = Arc::new(AtomicU64::new(0));
    let done = Arc::new(AtomicU64::new(0));
    let start = Instant::now();
    let (bar, _ticker) = match &spec.bound {
        Bound::Sessions(r) => (progress.items(&spec.title, r.end - r.start), None),
        Bound::For { duration, .. } => {
            let bar = progress.timed(&spec.title, *duration);
            let ticker = Ticker::start(bar.clone(), Arc::clone(&done), start, "items");
            (bar, Some(ticker))
        }
    };
    let mut tasks = Vec::with_capacity(conns.len());
    for conn in conns {
        let (shared, spec, cursor, done, bar) =
            (Arc::clone(&shared), Arc::clone(&spec), Arc::clone(&cursor), Arc::clone(&done), bar.clone());
        tasks.push(tokio::spawn(async move {
            let mut conn = conn;
            let out = worker(&mut conn, &shared, &spec, &cursor, &done, &bar, start).await;
            (out, conn)
        }));
    }
    let mut result = PhaseResult::default();
    let mut conns = Vec::with_capacity(tasks.len());
    for t in tasks {
        let Ok((out, conn)) = t.await else { continue };
        result.rec.merge(&out.rec);
        result.throttled += out.throttled;
        result.flips += out.flips;
        result.late += out.late;
        result.behind_schedule += out.behind_schedule;
        conns.push(conn);
    }
    result.elapsed = start.elapsed();
    bar.finish_and_clear();
    (result, conns)
}

async fn worker(
    conn: &mut Conn,
    shared: &Shared,
    spec: &PhaseSpec,
    cursor: &AtomicU64,
    done: &AtomicU64,
    bar: &indicatif::ProgressBar,
    start: Instant,
) -> PhaseResult {
    let mut out = PhaseResult::default();
    let k = spec.items_per_call.max(1);
    let mut sessions: Vec<u64> = Vec::with_capacity(k as usize);
    loop {
        let ticket = cursor.fetch_add(k, Ordering::Relaxed);
        sessions.clear();
        match &spec.bound {
            Bound::Sessions(r) => {
                let from = r.start.saturating_add(ticket);
                if from >= r.end {
                    break;
                }
                sessions.extend(from..(from + k).min(r.end));
            }
            Bound::For { first, sessions: n, duration } => {
                if start.elapsed() >= *duration {
                    break;
                }
                let n = (*n).max(1);
                sessions.extend((ticket..ticket + k).map(|t| first + t % n));
            }
        }
        if spec.rate > 0.0 {
            let due = start + Duration::from_secs_f64(ticket as f64 / spec.rate);
            let now = Instant::now();
            if due > now {
                tokio::time::sleep_until(due.into()).await;
                if let Bound::For { duration, .. } = &spec.bound
                    && start.elapsed() >= *duration
                {
                    break;
                }
            } else if now - due > Duration::from_millis(10) {
                out.behind_schedule += 1;
            }
        }
        let n = sessions.len() as u64;
        match &spec.work {
            &Work::Register(plan) => {
                let now = now_ms();
                let items: Vec<RegItem> = sessions
                    .iter()
                    .map(|&s| {
                        let (ttl_ms, late) = plan.ttl(s, now);
                        out.late += u64::from(late);
                        RegItem { session: s, ttl_ms }
                    })
                    .collect();
                let sent = Instant::now();
                let results = conn.register(&shared.naming, &items, shared.deadlines.is_some()).await;
                let latency = sent.elapsed();
                let mut ok = 0;
                for (item, r) in items.iter().zip(results) {
                    match r {
                        Ok(reg) => {
                            ok += 1;
                            out.flips += u64::from(reg.changed);
                            shared.gens.set(item.session, reg.generation);
                            if let Some(d) = &shared.deadlines {
                                d.set(item.session, reg.deadline_ms);
                            }
                        }
                        Err(e) => out.rec.err(latency, e.status, &e.message),
                    }
                }
                out.rec.ok(latency, ok);
            }
            &Work::Renew { ttl_ms } => {
                let items: Vec<GenItem> =
                    sessions.iter().map(|&s| GenItem { session: s, generation: shared.gens.get(s), ttl_ms }).collect();
                let sent = Instant::now();
                let results = conn.renew(&shared.naming, &items).await;
                tally(&mut out, sent.elapsed(), results, |out, r| out.throttled += u64::from(r.throttled));
            }
            Work::Room(plan) => {
                let cycle = match &spec.bound {
                    Bound::For { sessions: n, .. } => (*n).max(1),
                    Bound::Sessions(_) => u64::MAX,
                };
                let items: Vec<RoomItem> = sessions
                    .iter()
                    .zip(ticket..)
                    .map(|(&s, t)| RoomItem { generation: shared.gens.get(s), ..plan.item(s, t / cycle) })
                    .collect();
                let sent = Instant::now();
                let results = conn.rooms(&shared.naming, &items).await;
                tally(&mut out, sent.elapsed(), results, |out, r| out.flips += u64::from(r.changed));
            }
        }
        done.fetch_add(n, Ordering::Relaxed);
        if matches!(spec.bound, Bound::Sessions(_)) {
            bar.inc(n);
        }
    }
    out
}

/// Records a call's item results, all at its round trip `latency`, and hands each
/// success to `on_ok`.
fn tally<T>(
    out: &mut PhaseResult,
    latency: Duration,
    results: Vec<Result<T, ItemErr>>,
    mut on_ok: impl FnMut(&mut PhaseResult, T),
) {
    let mut ok = 0;
    for r in results {
        match r {
            Ok(r) => {
                ok += 1;
                on_ok(out, r);
            }
            Err(e) => out.rec.err(latency, e.status, &e.message),
        }
    }
    out.rec.ok(latency, ok);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arranged_ttls_spread_deadlines_over_the_window() {
        let plan = TtlPlan::Arranged { first_deadline_ms: 10_000, window_ms: 1_000, count: 100, min_ttl_ms: 1_000 };
        assert_eq!(plan.ttl(0, 5_000), (5_000, false));
        assert_eq!(plan.ttl(50, 5_000), (5_500, false));
        assert_eq!(plan.ttl(99, 5_000), (5_990, false));
        // Too late for its slot: raised to the server's minimum, and counted.
        assert_eq!(plan.ttl(0, 9_500), (1_000, true));
        assert_eq!(TtlPlan::Fixed(45_000).ttl(3, 0), (45_000, false));
    }
}
