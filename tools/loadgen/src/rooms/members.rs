//! `room-members`: `--rooms` rooms of `--members` members each (distinct users, one
//! session each: session `k` is in room `k % rooms`, so 500,000 memberships are 500,000
//! users at the defaults), `--watchers-per-room` member-mode `WatchRoom` streams per
//! room, `--watchers-per-connection` of them per HTTP/2 connection. Then members update
//! their room metadata at `--churn-rate` (a join of a session already in the room, with
//! its send time in the metadata), cycling over every membership.
//!
//! Reported: room changes delivered per second (change events the watchers received)
//! and the latency from each update's send to each watcher's receipt, read from the
//! stamp the change carries. A watcher's mailbox conflates a member's changes, so a
//! slow watcher receives fewer, newer ones rather than all of them late.

use std::sync::Arc;
use std::time::{Duration, Instant};

use presence_client::pb::{self, room_event};
use serde_json::json;

use super::{Plan, members_of, per_second, presenced_report, room_phase, small_rooms, stamp_lag_ns, watch_rooms};
use crate::cli::RoomMembersArgs;
use crate::conn::RoomOp;
use crate::expiry::unix_ns;
use crate::phase::run_phase;
use crate::progress::Progress;
use crate::report::Report;
use crate::stats::{Recorder, fmt_ns};

/// What one member watcher received.
#[derive(Debug, Default)]
struct Received {
    /// Member changes.
    changes: u64,
    /// Latency of each stamped change, ns.
    lags_ns: Vec<u64>,
    /// Snapshots after the first: resyncs.
    resyncs: u64,
    snapshots: u64,
}

/// Runs the scenario.
pub(crate) async fn run(args: RoomMembersArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let endpoints = common.endpoints();
    let (rooms, per_room) = (args.rooms.max(1), args.members.max(1));
    let sessions = rooms * per_room;
    let watchers = rooms * args.watchers_per_room;
    println!(
        "room-members: {rooms} rooms x {per_room} members ({sessions} users, one session each), {} member watchers \
         per room ({watchers} streams, {} per connection), {} metadata updates/s for {:.0} s, on {}",
        args.watchers_per_room,
        args.run.watchers_per_connection,
        args.churn_rate,
        args.run.duration.as_secs_f64(),
        endpoints.host()
    );
    let (shared, setup, conns) = small_rooms(common, &args.drive, rooms, per_room, args.run.ttl_ms, progress).await?;

    let requests: Vec<pb::WatchRoomRequest> = (0..watchers).map(|w| members_of(w % rooms)).collect();
    let opening = Instant::now();
    let watching =
        watch_rooms(&endpoints, requests, args.run.watchers_per_connection, progress, |got: &mut Received, event| {
            match event.event {
                Some(room_event::Event::Change(change)) => {
                    got.changes += 1;
                    if let Some(lag) = change.member.as_ref().and_then(|m| stamp_lag_ns(m, unix_ns())) {
                        got.lags_ns.push(lag);
                    }
                }
                Some(room_event::Event::Snapshot(_)) => {
                    got.snapshots += 1;
                    got.resyncs += u64::from(got.snapshots > 1);
                }
                _ => {}
            }
        })
        .await?;
    let opened_in = opening.elapsed();
    println!(
        "{} member watchers open in {:.1} s ({} refused{})",
        watching.open(),
        opened_in.as_secs_f64(),
        watching.refused.0,
        watching.refused.1.as_deref().map_or_else(String::new, |m| format!(": {m}"))
    );

    let churn_spec = room_phase(
        "updates",
        Plan::Spread { rooms, op: RoomOp::Join { stamped: true } },
        args.churn_batch,
        0..sessions,
        args.churn_rate,
        Some(args.run.duration),
    );
    let (churn, _conns) = run_phase(conns, Arc::clone(&shared), churn_spec, progress).await;
    // Let the last changes arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (open, refused) = (watching.open(), watching.refused.clone());
    let received = watching.stop().await;

    let mut lags = Recorder::default();
    let (mut events, mut resyncs) = (0u64, 0u64);
    for got in &received {
        events += got.changes;
        resyncs += got.resyncs;
        for &lag in &got.lags_ns {
            lags.ok(Duration::from_nanos(lag), 1);
        }
    }
    let updates_per_s = per_second(churn.rec.ok_count(), &churn, args.run.duration);
    let events_per_s = per_second(events, &churn, args.run.duration);
    let expected = churn.rec.ok_count() * args.watchers_per_room;

    let call = "presence.v1.Presence.WatchRoom (member changes, all watchers)";
    let mut report = presenced_report("room-members", &lags, churn.elapsed, &endpoints, call, args.run.duration);
    report.count = events;
    report.rps = events_per_s;
    report.tag("rooms", rooms);
    report.tag("members", per_room);
    report.set("rooms", rooms);
    report.set("members_per_room", per_room);
    report.set("memberships", sessions);
    report.set("users", sessions);
    report.set("watchers_per_room", args.watchers_per_room);
    report.set("watchers", watchers);
    report.set("watchers_open", open);
    report.set("watchers_refused", refused.0);
    report.set("watch_refusal", refused.1);
    report.set("watchers_per_connection", args.run.watchers_per_connection);
    report.set("watchers_opened_in_ms", opened_in.as_millis() as u64);
    report.set("setup_registers_per_s", setup.register.rate());
    report.set("setup_joins_per_s", setup.join.rate());
    report.set(
        "updates",
        json!({
            "rate_asked": args.churn_rate,
            "batch": args.churn_batch,
            "ok": churn.rec.ok_count(),
            "errors": churn.rec.count() - churn.rec.ok_count(),
            "per_s": updates_per_s,
            "behind_schedule": churn.behind_schedule,
            "batch_p99_ns": churn.rec.percentile_ns(99.0),
        }),
    );
    report.set("events", events);
    report.set("events_expected", expected);
    report.set("events_per_s", events_per_s);
    report.set("stamped_events", lags.ok_count());
    report.set("resyncs", resyncs);
    report.set("delivery_p50_ns", lags.percentile_ns(50.0));
    report.set("delivery_p99_ns", lags.percentile_ns(99.0));
    report.set("delivery_max_ns", lags.slowest_ns());
    println!(
        "\nupdates: {updates_per_s:.0}/s achieved of {} asked ({} errors); room changes delivered: {events} \
         ({events_per_s:.0}/s; {expected} if none were conflated), {resyncs} resyncs",
        args.churn_rate,
        churn.rec.count() - churn.rec.ok_count()
    );
    println!(
        "change -> watcher: p50 {} p99 {} max {}",
        fmt_ns(lags.percentile_ns(50.0)),
        fmt_ns(lags.percentile_ns(99.0)),
        fmt_ns(lags.slowest_ns())
    );
    println!("  (the generator and the server share this machine's {} cores)", crate::report::cpus());
    Ok(report)
}
