//! The room scenarios (presenced only: the Redis design of seed 000 has no rooms, no
//! signals and no flap damping): `room-count` (one huge room watched in count mode),
//! `room-members` (many small rooms watched in member mode), `typing` (signals).
//!
//! This module owns what they share: which room item each session sends ([`Plan`],
//! driven by [`crate::phase::run_phase`] like registers and renewals), the setup that
//! registers users and puts them in rooms, a pool of `WatchRoom` streams, and the pure
//! bookkeeping of what the watchers received. Session `k` is user `k`'s only session;
//! room `n` is `r<n>`.

pub(crate) mod count;
pub(crate) mod members;
pub(crate) mod typing;

use std::ops::Range;
use std::sync::Arc;
use std::time::Duration;

use presence_client::pb::{self, presence_client::PresenceClient};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

use crate::cli::{Common, LeaseDrive};
use crate::conn::{Conn, ConnSpec, Endpoints, Naming, RoomItem, RoomOp, SENT_NS_KEY};
use crate::ids::{Generations, Population, room_id};
use crate::phase::{Bound, PhaseResult, PhaseSpec, RoomPlan, Shared, Work, register_everyone, run_phase};
use crate::progress::Progress;
use crate::report::Report;
use crate::stats::Recorder;

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
            Plan::Toggle { room } => {
                (room, if pass.is_multiple_of(2) { RoomOp::Join { stamped: false } } else { RoomOp::Leave })
            }
            Plan::Typing { rooms, ttl_ms, pause_every } => {
                let pause = pause_every > 0 && (pass + session) % pause_every == pause_every - 1;
                (session % rooms.max(1), RoomOp::Typing { ttl_ms: if pause { 0 } else { ttl_ms } })
            }
        };
        RoomItem { session, generation: 0, room, op }
    }
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

/// Open `WatchRoom` streams, each read by a task of its own that folds its events into
/// a `T` until stopped.
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

/// Opens one stream per request, `per_connection` streams per HTTP/2 connection, and
/// returns once all are open. Every event of a stream goes to `fold` with that stream's
/// state. A refused stream is counted, not fatal: the report says how many were open.
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
    let (stop, stop_rx) = watch::channel(false);
    let fold = Arc::new(fold);
    let bar = progress.items("watchers", requests.len() as u64);
    let mut groups: Vec<Vec<pb::WatchRoomRequest>> = Vec::new();
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
            let (endpoints, fold, stop_rx, bar) = (endpoints.clone(), Arc::clone(&fold), stop_rx.clone(), bar.clone());
            opening.spawn(async move {
                let client = PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20);
                let mut tasks = Vec::with_capacity(group.len());
                let mut refused = (0u64, None);
                for request in group {
                    bar.inc(1);
                    let mut stream = match client.clone().watch_room(request).await {
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
                                event = stream.message() => match event {
                                    Ok(Some(event)) => fold(&mut state, event),
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
