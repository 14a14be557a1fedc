//! `room-count`: one room of `--members` users, watched by `--watchers` count-mode
//! `WatchRoom` streams, while `--churn-sessions` other sessions join and leave it in
//! turn at `--churn-rate` items per second (Leases batches), and a gateway renews
//! other sessions at a steady rate, quiet first and then through the churn.
//!
//! A count watcher is owed at most one frame per `count_interval_ms`, and one only when
//! the counts changed: the report gives, for the churn phase, each watcher's frames per
//! interval (mean and max over watchers), the most frames any watcher got within one
//! interval (less 10% for the transport's jitter: these are receive times) and the
//! shortest gap between two frames, beside the churn rate achieved and the gateway's p99 quiet and
//! during the churn.

use std::sync::Arc;
use std::time::{Duration, Instant};

use presence_client::pb::{self, room_event};

use super::{
    Cadence, Plan, churn_json, churn_line, gateway_result, one_session_each, per_second, presenced_report,
    quiet_gateway, register_and_join, room_phase, watch_rooms,
};
use crate::cli::RoomCountArgs;
use crate::conn::RoomOp;
use crate::ids::room_id;
use crate::phase::run_phase;
use crate::progress::Progress;
use crate::report::Report;

/// The room every member is in.
const ROOM: u64 = 0;

/// What one count watcher received: when each count frame arrived.
#[derive(Debug, Default)]
struct Frames(Vec<Instant>);

/// Runs the scenario.
pub(crate) async fn run(args: RoomCountArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let endpoints = common.endpoints();
    let (members, churners, gateway_sessions) =
        (args.members.max(1), args.churn_sessions.max(1), args.gateway.gateway_sessions);
    // Sessions 0..members are in the room, then the churners, then the gateway's.
    let sessions = members + churners + gateway_sessions;
    let shared = one_session_each(&common.gateway_id, sessions);
    let interval = Duration::from_millis(u64::from(args.count_interval_ms.max(1)));
    println!(
        "room-count: one room of {members} members, {} count watchers (every {} ms), {} joins + leaves/s by {churners} \
         other sessions for {:.0} s, gateway renewing {gateway_sessions} sessions at {}/s, on {}",
        args.watchers,
        args.count_interval_ms,
        args.churn_rate,
        args.run.duration.as_secs_f64(),
        args.gateway.gateway_rate,
        endpoints.host()
    );
    let spec = args.drive.conn_spec(common, args.drive.batch);
    let join = Plan::Spread { rooms: 1, op: RoomOp::Join { stamped: false } };
    let (setup, conns) =
        register_and_join(&spec, &shared, args.run.ttl_ms, sessions, 0..members, join, progress).await?;

    let request = pb::WatchRoomRequest {
        room_id: room_id(ROOM),
        mode: pb::RoomWatchMode::RoomWatchCount as i32,
        count_interval_ms: args.count_interval_ms,
        ..Default::default()
    };
    let requests = vec![request; args.watchers as usize];
    let watchers =
        watch_rooms(&endpoints, requests, args.run.watchers_per_connection, progress, |frames: &mut Frames, event| {
            if let Some(room_event::Event::Count(_)) = event.event {
                frames.0.push(Instant::now());
            }
        })
        .await?;
    println!("{} count watchers open ({} refused)", watchers.open(), watchers.refused.0);

    let (gateway_spec, gateway) =
        quiet_gateway(&args.gateway, &endpoints, &shared, members + churners, args.run.ttl_ms, args.run.duration)
            .await?;

    let churn_start = Instant::now();
    let churn_spec = room_phase(
        "churn",
        Plan::Toggle { room: ROOM },
        args.churn_batch,
        members..members + churners,
        args.churn_rate,
        Some(args.run.duration),
    );
    let (churn, _conns) = run_phase(conns, Arc::clone(&shared), churn_spec, progress).await;
    let churn_elapsed = churn_start.elapsed();
    let gateway = gateway_result(gateway).await?;
    // Frames sent for the churn's last changes arrive up to an interval later.
    tokio::time::sleep(interval).await;
    let (open, refused) = (watchers.open(), watchers.refused.clone());
    let logs = watchers.stop().await;

    let frames = Cadence::of(logs.iter().map(|Frames(times)| times.as_slice()), churn_start, churn_elapsed, interval);
    let churn_per_s = per_second(churn.rec.ok_count(), &churn, args.run.duration);

    let call = "presence.v1.Presence.Leases (join and leave items)";
    let mut report = presenced_report("room-count", &churn.rec, churn.elapsed, &endpoints, call, args.run.duration);
    report.tag("members", members);
    report.tag("watchers", args.watchers);
    report.set("members", members);
    report.set("watchers", args.watchers);
    report.set("watchers_open", open);
    report.set("watchers_refused", refused.0);
    report.set("watch_refusal", refused.1);
    report.set("count_interval_ms", args.count_interval_ms);
    report.set("setup_registers_per_s", setup.register.rate());
    report.set("setup_joins_per_s", setup.join.rate());
    report.set("churn", churn_json(&churn, churners, args.churn_rate, args.churn_batch, churn_per_s));
    report.set("frames", frames.json("watcher"));
    if let Some(gw) = &gateway {
        report.set("gateway", gw.summary(&gateway_spec, "during_churn"));
    }
    println!("\n{}", churn_line(&churn, args.churn_rate, churn_per_s, "changed the room"));
    println!(
        "count frames: {} to {open} watchers over {:.1} intervals: {}",
        frames.total,
        frames.intervals,
        frames.describe("watcher")
    );
    if let Some(gw) = &gateway {
        gw.print("during the churn");
    }
    println!("  (the generator and the server share this machine's {} cores)", crate::report::cpus());
    Ok(report)
}
