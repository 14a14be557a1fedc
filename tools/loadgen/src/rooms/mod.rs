//! The room scenarios (presenced only: the Redis design of seed 000 has no rooms, no
//! signals and no flap damping): `room-count` (one huge room watched in count mode),
//! `room-counts` (the counts of many rooms on `WatchRoomCounts` streams, and batched
//! `RoomCounts` reads), `room-members` (many small rooms watched in member mode),
//! `typing` (signals).
//!
//! This module owns what they share: which room item each session sends ([`Plan`],
//! driven by [`crate::phase::run_phase`] like registers and renewals), the setup that
//! registers users and puts them in rooms, a pool of watch streams, the bystander
//! gateway, and the pure bookkeeping of what the watchers received. Session `k` is
//! user `k`'s only session; room `n` is `r<n>`.

pub(crate) mod count;
pub(crate) mod counts;
pub(crate) mod members;
pub(crate) mod typing;

use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient};
use serde_json::{Value, json};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};
use tonic::transport::Channel;

use crate::cli::{Common, GatewayArgs, LeaseDrive};
use crate::conn::{Conn, ConnSpec, Endpoints, Naming, RoomItem, RoomOp, SENT_NS_KEY};
use crate::gateway::{self, GatewayResult, GatewaySpec};
use crate::ids::{Generations, Population, room_id};
use crate::phase::{Bound, PhaseResult, PhaseSpec, RoomPlan, Shared, Work, register_everyone, run_phase};
use crate::progress::Progress;
use crate::redis_seed::now_ms;
use crate::report::Report;
use crate::stats::{Recorder, fmt_ns};

/// Which room item each session sends on each pass.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Plan {
    /// Session `k` sends `op` into room `k % rooms`, every pass.
    Spread {
        /// Rooms the sessions are spread over.
        rooms: u64,
        /// What each sends.
        op: RoomOp,
    },
    /// Every session joins `room` on even passes and leaves it on odd ones.
    Toggle {
        /// The room.
        room: u64,
    },
    /// Session `k` joins room `k % rooms` on even passes and leaves it on odd ones.
    ToggleSpread {
        /// Rooms the sessions are spread over.
        rooms: u64,
    },
    /// Session `k` sets `typing` in room `k % rooms` with `ttl_ms` (or renews it), but
    /// every `pause_every`-th pass of it (staggered by session) clears it instead;
    /// `pause_every` 0 never clears.
    Typing {
        /// Rooms the sessions are spread over.
        rooms: u64,
        /// The signal's TTL.
        ttl_ms: u32,
        /// Every how many passes a session clears its signal.
        pause_every: u64,
    },
}

impl RoomPlan for Plan {
    fn item(&self, session: u64, pass: u64) -> RoomItem {
        let (room, op) = match *self {
            Plan::Spread { rooms, op } => (session % rooms.max(1), op),
            Plan::Toggle { room } => (room, toggle(pass)),
            Plan::ToggleSpread { rooms } => (session % rooms.max(1), toggle(pass)),
            Plan::Typing { rooms, ttl_ms, pause_every } => {
                let pause = pause_every > 0 && (pass + session) % pause_every == pause_every - 1;
                (session % rooms.max(1), RoomOp::Typing { ttl_ms: if pause { 0 } else { ttl_ms } })
            }
        };
        RoomItem { session, generation: 0, room, op }
    }
}

/// A toggling session's op on its `pass`-th turn: a join on even ones, a leave on odd ones.
fn toggle(pass: u64) -> RoomOp {
    if pass.is_multiple_of(2) { RoomOp::Join { stamped: false } } else { RoomOp::Leave }
}

/// A phase that sends `plan`'s items, `per_call` to a batch: once for each of `sessions`
/// as fast as they go (`for_duration` `None`), or cycling over them at `rate` items per
/// second for a duration.
pub(crate) fn room_phase(
    title: &str,
    plan: Plan,
    per_call: u64,
    sessions: Range<u64>,
    rate: f64,
    for_duration: Option<Duration>,
) -> PhaseSpec {
    let bound = match for_duration {
        None => Bound::Sessions(sessions),
        Some(duration) => Bound::For { first: sessions.start, sessions: sessions.end - sessions.start, duration },
    };
    PhaseSpec { title: title.into(), work: Work::Room(Arc::new(plan)), items_per_call: per_call.max(1), bound, rate }
}

/// What the setup did.
#[derive(Debug)]
pub(crate) struct Setup {
    /// Registering every session.
    pub(crate) register: PhaseResult,
    /// Putting the members in their rooms.
    pub(crate) join: PhaseResult,
}

/// Registers sessions `0..sessions` with `ttl_ms`, then joins `members` of them as
/// `join` says, in `spec`'s Leases batches. Fails unless every item succeeded: a
/// scenario on a half-built population would measure something else.
pub(crate) async fn register_and_join(
    spec: &ConnSpec,
    shared: &Arc<Shared>,
    ttl_ms: u32,
    sessions: u64,
    members: Range<u64>,
    join: Plan,
    progress: Progress,
) -> Result<(Setup, Vec<Conn>), String> {
    let (register, conns) = register_everyone(spec, shared, ttl_ms, 0..sessions, progress).await?;
    all_ok("registers", &register, sessions)?;
    if register.flips < sessions {
        println!(
            "warning: {} users were already ONLINE before this run (an earlier run on this server). Use a fresh server.",
            sessions - register.flips
        );
    }
    let want = members.end - members.start;
    let (joined, conns) =
        run_phase(conns, Arc::clone(shared), room_phase("join", join, spec.batch, members, 0.0, None), progress).await;
    all_ok("joins", &joined, want)?;
    println!(
        "setup: {sessions} sessions registered in {:.1} s ({:.0}/s), {want} joins in {:.1} s ({:.0}/s)",
        register.elapsed.as_secs_f64(),
        register.rate(),
        joined.elapsed.as_secs_f64(),
        joined.rate()
    );
    Ok((Setup { register, join: joined }, conns))
}

/// `n` items of a phase that ran for `duration` per second. A worker that took the
/// ticket past the end sleeps until it is due before it stops: the phase's own elapsed
/// time runs on past the sending, and would understate the rate.
pub(crate) fn per_second(n: u64, phase: &PhaseResult, duration: Duration) -> f64 {
    n as f64 / phase.elapsed.min(duration).as_secs_f64().max(1e-9)
}

/// State for `sessions` sessions, session `k` the only one of user `k`.
pub(crate) fn one_session_each(gateway_id: &str, sessions: u64) -> Arc<Shared> {
    Arc::new(Shared {
        naming: Naming::new(Population { users: sessions, sessions }, gateway_id.to_owned()),
        gens: Generations::new(sessions),
        deadlines: None,
    })
}

/// `rooms` rooms of `per_room` members, each a user with one session (session `k` in
/// room `k % rooms`), registered and joined in `drive`'s Leases batches.
pub(crate) async fn small_rooms(
    common: &Common,
    drive: &LeaseDrive,
    rooms: u64,
    per_room: u64,
    ttl_ms: u32,
    progress: Progress,
) -> Result<(Arc<Shared>, Setup, Vec<Conn>), String> {
    let sessions = rooms * per_room;
    let shared = one_session_each(&common.gateway_id, sessions);
    let spec = drive.conn_spec(common, drive.batch);
    let join = Plan::Spread { rooms, op: RoomOp::Join { stamped: false } };
    let (setup, conns) = register_and_join(&spec, &shared, ttl_ms, sessions, 0..sessions, join, progress).await?;
    Ok((shared, setup, conns))
}

/// A member-mode watch of room `room`.
pub(crate) fn members_of(room: u64) -> pb::WatchRoomRequest {
    pb::WatchRoomRequest {
        room_id: room_id(room),
        mode: pb::RoomWatchMode::RoomWatchMembers as i32,
        ..Default::default()
    }
}

/// A presenced-only scenario's report: `rec` over `elapsed`, naming the `call` measured
/// and the measured phase's `duration`.
pub(crate) fn presenced_report(
    name: &str,
    rec: &Recorder,
    elapsed: Duration,
    endpoints: &Endpoints,
    call: &str,
    duration: Duration,
) -> Report {
    let mut report = Report::from_recorder(name, rec, elapsed, "timeout");
    report.options.host = endpoints.host();
    report.options.call = call.into();
    report.options.duration = duration.as_nanos() as u64;
    report.tag("target", "presenced");
    report.set("target", "presenced");
    report
}

fn all_ok(what: &str, phase: &PhaseResult, want: u64) -> Result<(), String> {
    if phase.rec.ok_count() < want {
        return Err(format!("only {} of {want} {what} succeeded: {:?}", phase.rec.ok_count(), phase.rec.errors()));
    }
    Ok(())
}

/// Open watch streams (`WatchRoom`, `WatchRoomCounts`), each read by a task of its own
/// that folds its messages into a `T` until stopped.
pub(crate) struct RoomWatchers<T> {
    stop: watch::Sender<bool>,
    tasks: Vec<JoinHandle<T>>,
    /// Streams the server refused, with the first refusal.
    pub(crate) refused: (u64, Option<String>),
}

impl<T> RoomWatchers<T> {
    /// Streams open.
    pub(crate) fn open(&self) -> u64 {
        self.tasks.len() as u64
    }

    /// Stops every reader and returns what each gathered.
    pub(crate) async fn stop(self) -> Vec<T> {
        let _ = self.stop.send(true);
        let mut out = Vec::with_capacity(self.tasks.len());
        for task in self.tasks {
            if let Ok(t) = task.await {
                out.push(t);
            }
        }
        out
    }
}

/// Connections opened at once while the watchers are set up.
const OPENING_CONNECTIONS: usize = 16;

/// Opens one `WatchRoom` stream per request (see [`watch_streams`]).
pub(crate) async fn watch_rooms<T, F>(
    endpoints: &Endpoints,
    requests: Vec<pb::WatchRoomRequest>,
    per_connection: u64,
    progress: Progress,
    fold: F,
) -> Result<RoomWatchers<T>, String>
where
    T: Default + Send + 'static,
    F: Fn(&mut T, pb::RoomEvent) + Send + Sync + 'static,
{
    let open = |mut client: PresenceClient<Channel>, request| async move { client.watch_room(request).await };
    watch_streams(endpoints, requests, per_connection, progress, open, fold).await
}

/// Opens one stream per request, `per_connection` streams per HTTP/2 connection, and
/// returns once all are open: `open` makes the call on a connection's client. Every
/// message of a stream goes to `fold` with that stream's state. A refused stream is
/// counted, not fatal: the report says how many were open.
pub(crate) async fn watch_streams<R, M, T, O, Fut, F>(
    endpoints: &Endpoints,
    requests: Vec<R>,
    per_connection: u64,
    progress: Progress,
    open: O,
    fold: F,
) -> Result<RoomWatchers<T>, String>
where
    R: Send + 'static,
    M: Send + 'static,
    T: Default + Send + 'static,
    O: Fn(PresenceClient<Channel>, R) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<tonic::Response<tonic::Streaming<M>>, tonic::Status>> + Send + 'static,
    F: Fn(&mut T, M) + Send + Sync + 'static,
{
    let (stop, stop_rx) = watch::channel(false);
    let (open, fold) = (Arc::new(open), Arc::new(fold));
    let bar = progress.items("watchers", requests.len() as u64);
    let mut groups: Vec<Vec<R>> = Vec::new();
    let per_connection = per_connection.max(1) as usize;
    let mut requests = requests.into_iter().peekable();
    while requests.peek().is_some() {
        groups.push(requests.by_ref().take(per_connection).collect());
    }
    let mut opening = JoinSet::new();
    let mut tasks = Vec::new();
    let mut refused = (0u64, None);
    let mut groups = groups.into_iter();
    loop {
        while opening.len() < OPENING_CONNECTIONS {
            let Some(group) = groups.next() else { break };
            let (endpoints, open, fold, stop_rx, bar) =
                (endpoints.clone(), Arc::clone(&open), Arc::clone(&fold), stop_rx.clone(), bar.clone());
            opening.spawn(async move {
                let client = PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20);
                let mut tasks = Vec::with_capacity(group.len());
                let mut refused = (0u64, None);
                for request in group {
                    bar.inc(1);
                    let mut stream = match open(client.clone(), request).await {
                        Ok(stream) => stream.into_inner(),
                        Err(status) => {
                            refused.0 += 1;
                            refused.1.get_or_insert_with(|| status.to_string());
                            continue;
                        }
                    };
                    let (fold, mut stop_rx) = (Arc::clone(&fold), stop_rx.clone());
                    tasks.push(tokio::spawn(async move {
                        let mut state = T::default();
                        loop {
                            tokio::select! {
                                message = stream.message() => match message {
                                    Ok(Some(message)) => fold(&mut state, message),
                                    Ok(None) | Err(_) => break,
                                },
                                _ = stop_rx.changed() => break,
                            }
                        }
                        state
                    }));
                }
                Ok::<_, String>((tasks, refused))
            });
        }
        let Some(opened) = opening.join_next().await else { break };
        let (opened, group_refused) = opened.map_err(|e| e.to_string())??;
        tasks.extend(opened);
        refused.0 += group_refused.0;
        if refused.1.is_none() {
            refused.1 = group_refused.1;
        }
    }
    bar.finish_and_clear();
    Ok(RoomWatchers { stop, tasks, refused })
}

/// The share of an interval two count messages may arrive closer than it and still
/// count as one per interval: their receive times carry the transport's jitter, not
/// only the server's spacing (`min_gap_ms` in the report shows the closest pair as it
/// came).
pub(crate) const JITTER: f64 = 0.1;

/// How often count messages (frames) reached each stream over a measured phase, and
/// the phase's last interval after it (the messages of its last changes).
#[derive(Debug, Clone, Default)]
pub(crate) struct Cadence {
    /// Messages in the window, all streams.
    pub(crate) total: u64,
    /// Intervals the window spans.
    pub(crate) intervals: f64,
    /// Messages per stream per interval: mean over the streams.
    pub(crate) mean: f64,
    /// ... and the largest.
    pub(crate) max: f64,
    /// The most messages any stream got within one interval less [`JITTER`].
    pub(crate) most: usize,
    /// The shortest gap between two messages of a stream.
    pub(crate) min_gap: Option<Duration>,
}

impl Cadence {
    /// The cadence of `streams` (each one's receive times, in order) over the
    /// `elapsed` from `start`, and one `interval` after it.
    pub(crate) fn of<'a>(
        streams: impl IntoIterator<Item = &'a [Instant]>,
        start: Instant,
        elapsed: Duration,
        interval: Duration,
    ) -> Cadence {
        let window_end = start + elapsed + interval;
        let intervals = (elapsed + interval).as_secs_f64() / interval.as_secs_f64();
        let mut per_interval = Vec::new();
        let mut out = Cadence { intervals, ..Cadence::default() };
        for times in streams {
            let times: Vec<Duration> =
                times.iter().filter(|&&t| t >= start && t <= window_end).map(|&t| t - start).collect();
            out.total += times.len() as u64;
            per_interval.push(times.len() as f64 / intervals);
            out.most = out.most.max(most_within(&times, interval.mul_f64(1.0 - JITTER)));
            for pair in times.windows(2) {
                let gap = pair[1] - pair[0];
                out.min_gap = Some(out.min_gap.map_or(gap, |m| m.min(gap)));
            }
        }
        out.mean = per_interval.iter().sum::<f64>() / per_interval.len().max(1) as f64;
        out.max = per_interval.iter().copied().fold(0.0, f64::max);
        out
    }

    /// The report's object; the per-stream figures are named for `each` (`watcher`, `stream`).
    pub(crate) fn json(&self, each: &str) -> Value {
        let mut v = json!({
            "total": self.total,
            "intervals": self.intervals,
            "most_within_one_interval": self.most,
            "min_gap_ms": self.min_gap.map(|g| g.as_secs_f64() * 1e3),
        });
        v[format!("per_{each}_per_interval_mean")] = json!(self.mean);
        v[format!("per_{each}_per_interval_max")] = json!(self.max);
        v
    }

    /// The figures for people, per `each`.
    pub(crate) fn describe(&self, each: &str) -> String {
        format!(
            "per {each} per interval mean {:.3}, max {:.3} (rule: <= 1); most within one interval {}; shortest gap {}",
            self.mean,
            self.max,
            self.most,
            self.min_gap.map_or_else(|| "-".into(), |g| format!("{:.1} ms", g.as_secs_f64() * 1e3))
        )
    }
}

/// A churn phase's report object: `sessions` toggling at `rate_asked` items per second
/// in batches of `batch`, `per_s` achieved.
pub(crate) fn churn_json(churn: &PhaseResult, sessions: u64, rate_asked: f64, batch: u64, per_s: f64) -> Value {
    json!({
        "sessions": sessions,
        "rate_asked": rate_asked,
        "batch": batch,
        "items": churn.rec.count(),
        "ok": churn.rec.ok_count(),
        "changed": churn.flips,
        "errors": churn.rec.count() - churn.rec.ok_count(),
        "per_s": per_s,
        "behind_schedule": churn.behind_schedule,
        "batch_p50_ns": churn.rec.percentile_ns(50.0),
        "batch_p99_ns": churn.rec.percentile_ns(99.0),
    })
}

/// A churn phase's line for people; `changed` says what an item that changed something changed.
pub(crate) fn churn_line(churn: &PhaseResult, rate_asked: f64, per_s: f64, changed: &str) -> String {
    format!(
        "churn: {per_s:.0} joins + leaves/s achieved of {rate_asked} asked ({} {changed}, {} errors), batch p50 {} \
         p99 {}",
        churn.flips,
        churn.rec.count() - churn.rec.ok_count(),
        fmt_ns(churn.rec.percentile_ns(50.0)),
        fmt_ns(churn.rec.percentile_ns(99.0)),
    )
}

/// A room scenario's bystander gateway, running on its own thread.
pub(crate) type GatewayTask = JoinHandle<Result<GatewayResult, String>>;

/// Starts `args`' gateway (none without gateway sessions) on sessions `first..`: quiet
/// for `--quiet-phase`, then busy for `busy`. Returns once the quiet phase is over,
/// when the scenario's load may start.
pub(crate) async fn quiet_gateway(
    args: &GatewayArgs,
    endpoints: &Endpoints,
    shared: &Arc<Shared>,
    first: u64,
    ttl_ms: u32,
    busy: Duration,
) -> Result<(GatewaySpec, Option<GatewayTask>), String> {
    let spec = GatewaySpec {
        endpoints: endpoints.clone(),
        first,
        sessions: args.gateway_sessions.max(1),
        rate: args.gateway_rate,
        concurrency: args.gateway_concurrency,
        ttl_ms,
    };
    let quiet_end = now_ms() + args.quiet_phase.as_millis() as i64;
    let busy_end = quiet_end + busy.as_millis() as i64;
    let task = if args.gateway_sessions > 0 { Some(gateway::start(&spec, shared, quiet_end, busy_end)?) } else { None };
    tokio::time::sleep(Duration::from_millis((quiet_end - now_ms()).max(0) as u64)).await;
    Ok((spec, task))
}

/// What a started gateway measured, once it is done.
pub(crate) async fn gateway_result(task: Option<GatewayTask>) -> Result<Option<GatewayResult>, String> {
    match task {
        Some(task) => Ok(Some(task.await.map_err(|e| format!("the gateway task failed: {e}"))??)),
        None => Ok(None),
    }
}

/// The most of `times` (sorted) that fall within any span shorter than `window`: 1
/// when no two are closer than `window`.
pub(crate) fn most_within(times: &[Duration], window: Duration) -> usize {
    let mut most = 0;
    let mut first = 0;
    for (last, &t) in times.iter().enumerate() {
        while t - times[first] >= window {
            first += 1;
        }
        most = most.max(last - first + 1);
    }
    most
}

/// The time from a member's stamped send (its metadata's [`SENT_NS_KEY`]) to `now_ns`,
/// in ns; `None` for a member without a stamp (it joined in the setup).
pub(crate) fn stamp_lag_ns(member: &pb::RoomMember, now_ns: i64) -> Option<u64> {
    let sent: i64 = member.metadata.get(SENT_NS_KEY)?.parse().ok()?;
    Some((now_ns - sent).max(0) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn most_within_counts_the_densest_window() {
        assert_eq!(most_within(&[], ms(1000)), 0);
        assert_eq!(most_within(&[ms(5)], ms(1000)), 1);
        // One a second, exactly: never two in a window.
        let steady: Vec<Duration> = (0..10).map(|i| ms(i * 1000)).collect();
        assert_eq!(most_within(&steady, ms(1000)), 1);
        // Two 999 ms apart share a window; the next is 1 s after the second.
        assert_eq!(most_within(&[ms(0), ms(999), ms(1999)], ms(1000)), 2);
        assert_eq!(most_within(&[ms(0), ms(10), ms(20), ms(3000)], ms(1000)), 3);
        assert_eq!(most_within(&[ms(0), ms(10), ms(20), ms(3000)], ms(10)), 1);
    }

    #[test]
    fn cadence_counts_the_window_per_stream() {
        let start = Instant::now();
        let at = |ms_list: &[u64]| -> Vec<Instant> { ms_list.iter().map(|&m| start + ms(m)).collect() };
        // A 2 s phase and its last 1 s interval: 3 intervals. One stream a message a
        // second, the other two 50 ms apart and one after the window.
        let steady = at(&[500, 1500, 2500]);
        let bunched = at(&[500, 550, 3500]);
        let cadence = Cadence::of([steady.as_slice(), bunched.as_slice()], start, ms(2000), ms(1000));
        assert_eq!(cadence.total, 5);
        assert!((cadence.intervals - 3.0).abs() < 1e-9);
        assert!((cadence.mean - 2.5 / 3.0).abs() < 1e-9 && (cadence.max - 1.0).abs() < 1e-9);
        assert_eq!((cadence.most, cadence.min_gap), (2, Some(ms(50))));
        let v = cadence.json("stream");
        assert_eq!(v["per_stream_per_interval_max"], 1.0);
        assert_eq!(v["most_within_one_interval"], 2);
        assert!(cadence.describe("stream").contains("per stream per interval mean 0.833, max 1.000"));
        assert_eq!(Cadence::of([], start, ms(1000), ms(1000)).total, 0);
    }

    #[test]
    fn stamps_give_the_lag_and_unstamped_members_none() {
        let mut member = pb::RoomMember { user_id: "u1".into(), ..Default::default() };
        assert_eq!(stamp_lag_ns(&member, 5_000), None);
        member.metadata.insert(SENT_NS_KEY.into(), "1000".into());
        assert_eq!(stamp_lag_ns(&member, 4_000), Some(3_000));
        // Clocks of one machine; a receive "before" the send is rounding: 0, not negative.
        assert_eq!(stamp_lag_ns(&member, 900), Some(0));
        member.metadata.insert(SENT_NS_KEY.into(), "soon".into());
        assert_eq!(stamp_lag_ns(&member, 4_000), None);
    }

    #[test]
    fn plans_place_and_alternate_items() {
        let spread = Plan::Spread { rooms: 100, op: RoomOp::Join { stamped: true } };
        assert_eq!(
            spread.item(250, 0),
            RoomItem { session: 250, generation: 0, room: 50, op: RoomOp::Join { stamped: true } }
        );
        assert_eq!(spread.item(250, 7).room, 50, "a session stays in its room");
        let toggle = Plan::Toggle { room: 0 };
        let ops: Vec<RoomOp> = (0..4).map(|pass| toggle.item(3, pass).op).collect();
        assert_eq!(
            ops,
            [RoomOp::Join { stamped: false }, RoomOp::Leave, RoomOp::Join { stamped: false }, RoomOp::Leave]
        );
        let spread = Plan::ToggleSpread { rooms: 10 };
        assert_eq!(
            spread.item(23, 0),
            RoomItem { session: 23, generation: 0, room: 3, op: RoomOp::Join { stamped: false } }
        );
        assert_eq!(
            (spread.item(23, 1).room, spread.item(23, 1).op),
            (3, RoomOp::Leave),
            "it leaves the room it joined"
        );
        assert_eq!(spread.item(24, 2).room, 4, "the next session toggles the next room");
        let typing = Plan::Typing { rooms: 10, ttl_ms: 5_000, pause_every: 3 };
        let ttls: Vec<u32> = (0..6)
            .map(|pass| match typing.item(0, pass).op {
                RoomOp::Typing { ttl_ms } => ttl_ms,
                other => panic!("{other:?}"),
            })
            .collect();
        assert_eq!(ttls, [5_000, 5_000, 0, 5_000, 5_000, 0], "typing twice, then a pause");
        // Staggered: session 1 pauses one pass earlier than session 0.
        assert_eq!(typing.item(1, 1).op, RoomOp::Typing { ttl_ms: 0 });
        let never = Plan::Typing { rooms: 10, ttl_ms: 5_000, pause_every: 0 };
        assert!((0..10).all(|pass| never.item(4, pass).op == RoomOp::Typing { ttl_ms: 5_000 }));
    }

    #[test]
    fn phases_cycle_only_when_given_a_duration() {
        let plan = Plan::Toggle { room: 0 };
        let once = room_phase("join", plan, 100, 10..20, 0.0, None);
        assert!(matches!(once.bound, Bound::Sessions(ref r) if *r == (10..20)));
        let cycling = room_phase("churn", plan, 0, 10..20, 50.0, Some(ms(500)));
        assert!(matches!(cycling.bound, Bound::For { first: 10, sessions: 10, .. }));
        assert_eq!((cycling.items_per_call, cycling.rate), (1, 50.0));
    }
}
