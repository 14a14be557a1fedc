//! `typing`: `--rooms` rooms of `--members` members (distinct users, one session each,
//! session `k` in room `k % rooms`), one member-mode `WatchRoom` per room. Every member
//! sends a `typing` signal with `--signal-ttl-ms` every `--renew-every-ms` (Leases
//! `signal` items): the first sets it, the next renew it before it runs out, and every
//! `--pause-every`-th is a clear, so that members stop typing and start again as people
//! do (a signal that only ever renews changes no set, and nothing would be delivered).
//!
//! Reported: signals accepted per second (and refused), signals that changed a room's
//! set, and the signal sets (`SignalSet` events) the watchers received per second.

use std::sync::Arc;
use std::time::Duration;

use presence_client::pb::{self, room_event};
use serde_json::json;

use super::{Plan, members_of, per_second, presenced_report, room_phase, small_rooms, watch_rooms};
use crate::cli::TypingArgs;
use crate::phase::run_phase;
use crate::progress::Progress;
use crate::report::Report;
use crate::stats::fmt_ns;

/// What one room's watcher received.
#[derive(Debug, Default)]
struct Received {
    signal_sets: u64,
    snapshots: u64,
}

/// Runs the scenario.
pub(crate) async fn run(args: TypingArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let endpoints = common.endpoints();
    let (rooms, per_room) = (args.rooms.max(1), args.members.max(1));
    let sessions = rooms * per_room;
    let rate = sessions as f64 * 1e3 / args.renew_every_ms.max(1) as f64;
    println!(
        "typing: {rooms} rooms x {per_room} members, one member watcher per room, every member signalling `typing` \
         (ttl {} ms) every {} ms ({rate:.0} signals/s, every {} a clear) for {:.0} s, on {}",
        args.signal_ttl_ms,
        args.renew_every_ms,
        args.pause_every,
        args.run.duration.as_secs_f64(),
        endpoints.host()
    );
    let (shared, setup, conns) = small_rooms(common, &args.drive, rooms, per_room, args.run.ttl_ms, progress).await?;

    let requests: Vec<pb::WatchRoomRequest> = (0..rooms).map(members_of).collect();
    let watching =
        watch_rooms(&endpoints, requests, args.run.watchers_per_connection, progress, |got: &mut Received, event| {
            match event.event {
                Some(room_event::Event::Signals(_)) => got.signal_sets += 1,
                Some(room_event::Event::Snapshot(_)) => got.snapshots += 1,
                _ => {}
            }
        })
        .await?;
    println!("{} room watchers open ({} refused)", watching.open(), watching.refused.0);

    let plan = Plan::Typing { rooms, ttl_ms: args.signal_ttl_ms, pause_every: args.pause_every };
    let signalling = room_phase("signals", plan, args.signal_batch, 0..sessions, rate, Some(args.run.duration));
    let (signals, _conns) = run_phase(conns, Arc::clone(&shared), signalling, progress).await;
    // Let the last sets arrive.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let (open, refused) = (watching.open(), watching.refused.clone());
    let received = watching.stop().await;
    let sets: u64 = received.iter().map(|got| got.signal_sets).sum();
    let resyncs: u64 = received.iter().map(|got| got.snapshots.saturating_sub(1)).sum();
    let accepted = signals.rec.ok_count();
    let (accepted_per_s, sets_per_s) =
        (per_second(accepted, &signals, args.run.duration), per_second(sets, &signals, args.run.duration));
    let refused_signals = signals.rec.count() - accepted;

    let call = "presence.v1.Presence.Leases (signal items)";
    let mut report = presenced_report("typing", &signals.rec, signals.elapsed, &endpoints, call, args.run.duration);
    report.tag("rooms", rooms);
    report.tag("members", per_room);
    report.set("rooms", rooms);
    report.set("members_per_room", per_room);
    report.set("watchers_open", open);
    report.set("watchers_refused", refused.0);
    report.set("signal_ttl_ms", args.signal_ttl_ms);
    report.set("renew_every_ms", args.renew_every_ms);
    report.set("pause_every", args.pause_every);
    report.set("setup_joins_per_s", setup.join.rate());
    report.set(
        "signals",
        json!({
            "rate_asked": rate,
            "sent": signals.rec.count(),
            "accepted": accepted,
            "refused": refused_signals,
            "changed_a_set": signals.flips,
            "accepted_per_s": accepted_per_s,
            "behind_schedule": signals.behind_schedule,
            "batch_p50_ns": signals.rec.percentile_ns(50.0),
            "batch_p99_ns": signals.rec.percentile_ns(99.0),
        }),
    );
    report.set("signal_sets_delivered", sets);
    report.set("signal_sets_per_s", sets_per_s);
    report.set("resyncs", resyncs);
    println!(
        "\nsignals: {accepted_per_s:.0}/s accepted of {rate:.0} asked ({refused_signals} refused, {} changed a room's \
         set), batch p50 {} p99 {}",
        signals.flips,
        fmt_ns(signals.rec.percentile_ns(50.0)),
        fmt_ns(signals.rec.percentile_ns(99.0)),
    );
    println!("signal sets delivered to watchers: {sets} ({sets_per_s:.0}/s), {resyncs} resyncs");
    println!("  (the generator and the server share this machine's {} cores)", crate::report::cpus());
    Ok(report)
}
