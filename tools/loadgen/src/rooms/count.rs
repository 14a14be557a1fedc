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
use serde_json::json;

use super::{
    Plan, most_within, one_session_each, per_second, presenced_report, register_and_join, room_phase, watch_rooms,
};
use crate::cli::RoomCountArgs;
use crate::conn::RoomOp;
use crate::gateway::{self, GatewaySpec};
use crate::ids::room_id;
use crate::phase::run_phase;
use crate::progress::Progress;
use crate::redis_seed::now_ms;
use crate::report::Report;
use crate::stats::fmt_ns;

/// The room every member is in.
const ROOM: u64 = 0;

/// The share of an interval two frames may arrive closer than it and still count as
/// one per interval: their receive times carry the transport's jitter, not only the
/// server's spacing (`min_gap_ms` in the report shows the closest pair as it came).
const JITTER: f64 = 0.1;

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

    let gateway_spec = GatewaySpec {
        endpoints: endpoints.clone(),
        first: members + churners,
        sessions: gateway_sessions.max(1),
        rate: args.gateway.gateway_rate,
        concurrency: args.gateway.gateway_concurrency,
        ttl_ms: args.run.ttl_ms,
    };
    let quiet_end = now_ms() + args.gateway.quiet_phase.as_millis() as i64;
    let churn_end = quiet_end + args.run.duration.as_millis() as i64;
    let gateway =
        if gateway_sessions > 0 { Some(gateway::start(&gateway_spec, &shared, quiet_end, churn_end)?) } else { None };
    tokio::time::sleep(Duration::from_millis((quiet_end - now_ms()).max(0) as u64)).await;

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
    let gateway = match gateway {
        Some(task) => Some(task.await.map_err(|e| format!("the gateway task failed: {e}"))??),
        None => None,
    };
    // Frames sent for the churn's last changes arrive up to an interval later.
    tokio::time::sleep(interval).await;
    let (open, refused) = (watchers.open(), watchers.refused.clone());
    let logs = watchers.stop().await;

    let window_end = churn_start + churn_elapsed + interval;
    let intervals = (churn_elapsed + interval).as_secs_f64() / interval.as_secs_f64();
    let mut per_interval = Vec::with_capacity(logs.len());
    let (mut most, mut min_gap, mut total) = (0, None::<Duration>, 0u64);
    for Frames(times) in &logs {
        let times: Vec<Duration> =
            times.iter().filter(|&&t| t >= churn_start && t <= window_end).map(|&t| t - churn_start).collect();
        total += times.len() as u64;
        per_interval.push(times.len() as f64 / intervals);
        most = most.max(most_within(&times, interval.mul_f64(1.0 - JITTER)));
        for pair in times.windows(2) {
            let gap = pair[1] - pair[0];
            min_gap = Some(min_gap.map_or(gap, |m| m.min(gap)));
        }
    }
    let mean = per_interval.iter().sum::<f64>() / per_interval.len().max(1) as f64;
    let max = per_interval.iter().copied().fold(0.0, f64::max);
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
    report.set(
        "churn",
        json!({
            "sessions": churners,
            "rate_asked": args.churn_rate,
            "batch": args.churn_batch,
            "items": churn.rec.count(),
            "ok": churn.rec.ok_count(),
            "changed": churn.flips,
            "errors": churn.rec.count() - churn.rec.ok_count(),
            "per_s": churn_per_s,
            "behind_schedule": churn.behind_schedule,
            "batch_p50_ns": churn.rec.percentile_ns(50.0),
            "batch_p99_ns": churn.rec.percentile_ns(99.0),
        }),
    );
    report.set(
        "frames",
        json!({
            "total": total,
            "intervals": intervals,
            "per_watcher_per_interval_mean": mean,
            "per_watcher_per_interval_max": max,
            "most_within_one_interval": most,
            "min_gap_ms": min_gap.map(|g| g.as_secs_f64() * 1e3),
        }),
    );
    if let Some(gw) = &gateway {
        report.set("gateway", gw.summary(&gateway_spec, "during_churn"));
    }
    println!(
        "\nchurn: {churn_per_s:.0} joins + leaves/s achieved of {} asked ({} changed the room, {} errors), batch p50 {} \
         p99 {}",
        args.churn_rate,
        churn.flips,
        churn.rec.count() - churn.rec.ok_count(),
        fmt_ns(churn.rec.percentile_ns(50.0)),
        fmt_ns(churn.rec.percentile_ns(99.0)),
    );
    println!(
        "count frames: {total} to {open} watchers over {intervals:.1} intervals: per watcher per interval mean {mean:.3}, \
         max {max:.3} (rule: <= 1); most within one interval {most}; shortest gap {}",
        min_gap.map_or_else(|| "-".into(), |g| format!("{:.1} ms", g.as_secs_f64() * 1e3))
    );
    if let Some(gw) = &gateway {
        gw.print("during the churn");
    }
    println!("  (the generator and the server share this machine's {} cores)", crate::report::cpus());
    Ok(report)
}
