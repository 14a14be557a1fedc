//! `room-counts`: the counts of many rooms (R7). `--rooms` rooms (`r0` ..) hold
//! `--members` users spread over them; `--streams` `WatchRoomCounts` streams each
//! watch every room at `--count-interval-ms`, while `--churn-sessions` other sessions
//! join and leave rooms across the set in turn (session `k` room `k % rooms`) at
//! `--churn-rate` items per second (Leases batches), and a gateway renews other
//! sessions at a steady rate, quiet first and then through the churn. Then batched
//! `RoomCounts` reads of `--read-batch` rooms, `--read-concurrency` calls in flight,
//! for `--read-duration`, the gateway renewing through them too.
//!
//! A stream's first message holds every room; after it a stream is owed at most one
//! message per interval, holding only the rooms whose counts changed. The report gives
//! the rooms of each first message, each stream's messages per interval over the churn
//! (mean and max over the streams, the most within one interval less 10% for the
//! transport's jitter, the shortest gap), the rooms the later messages carried, the
//! churn achieved and, with `--server-pid`, the server's CPU over it; the reads' rooms
//! per second and call p50/p99; the gateway's p99 quiet, during the churn and during
//! the reads; the generator's own share of the machine.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient};
use serde_json::json;
use tokio::task::JoinSet;
use tonic::transport::Channel;

use super::{
    Cadence, Plan, churn_json, churn_line, gateway_result, one_session_each, per_second, presenced_report,
    quiet_gateway, register_and_join, room_phase, watch_streams,
};
use crate::cli::RoomCountsArgs;
use crate::conn::{Endpoints, RoomOp};
use crate::gateway::{self, GatewayResult, renew_line};
use crate::ids::room_id;
use crate::phase::run_phase;
use crate::progress::{Progress, Ticker};
use crate::redis_seed::now_ms;
use crate::report::{Report, cpus};
use crate::server_cpu::CpuMark;
use crate::stats::{Recorder, code_name, fmt_ns};

/// What one `WatchRoomCounts` stream received.
#[derive(Debug, Default)]
struct Received {
    /// Rooms in its first message, and whether that message named the stream (`watch_id`).
    first: Option<(usize, bool)>,
    /// When each later message arrived.
    times: Vec<Instant>,
    /// Rooms in each later message.
    rooms: Vec<usize>,
}

impl Received {
    fn fold(&mut self, message: pb::RoomCounts) {
        if self.first.is_none() {
            self.first = Some((message.counts.len(), !message.watch_id.is_empty()));
        } else {
            self.times.push(Instant::now());
            self.rooms.push(message.counts.len());
        }
    }
}

/// What the batched reads measured: one sample per call.
#[derive(Debug, Default)]
struct Reads {
    /// Each call's round trip; an answer of other rooms than asked is an error.
    calls: Recorder,
    /// Rooms answered.
    rooms: u64,
}

/// The read phase: `RoomCounts` calls of `batch` rooms, cycling over rooms `0..rooms`,
/// `concurrency` in flight over `connections` HTTP/2 connections, for `duration`.
#[derive(Debug, Clone, Copy)]
struct ReadSpec {
    rooms: u64,
    batch: u64,
    concurrency: u64,
    connections: u64,
    duration: Duration,
}

/// Runs the read phase; gives what it measured and how long it took.
async fn read_counts(endpoints: &Endpoints, spec: ReadSpec, progress: Progress) -> Result<(Reads, Duration), String> {
    let ReadSpec { rooms, batch, concurrency, connections, duration } = spec;
    let mut clients: Vec<PresenceClient<Channel>> = Vec::new();
    for _ in 0..connections.max(1) {
        clients.push(PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20));
    }
    let ids: Arc<Vec<String>> = Arc::new((0..rooms).map(room_id).collect());
    let (cursor, done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let bar = progress.timed("reads", duration);
    let start = Instant::now();
    let _ticker = Ticker::start(bar.clone(), Arc::clone(&done), start, "rooms");
    let mut tasks = JoinSet::new();
    for worker in 0..concurrency.max(1) as usize {
        let mut client = clients[worker % clients.len()].clone();
        let (ids, cursor, done) = (Arc::clone(&ids), Arc::clone(&cursor), Arc::clone(&done));
        tasks.spawn(async move {
            let mut out = Reads::default();
            while start.elapsed() < duration {
                let from = cursor.fetch_add(batch, Ordering::Relaxed);
                let room_ids = (from..from + batch).map(|i| ids[(i % rooms) as usize].clone()).collect();
                let sent = Instant::now();
                let answer = client.room_counts(pb::RoomCountsRequest { room_ids, viewer_id: String::new() }).await;
                let latency = sent.elapsed();
                match answer {
                    Ok(answer) => {
                        let counts = answer.into_inner().counts;
                        let as_asked = counts.len() as u64 == batch
                            && counts.iter().zip(from..).all(|(c, i)| c.room_id == ids[(i % rooms) as usize]);
                        if as_asked {
                            out.calls.ok(latency, 1);
                        } else {
                            out.calls.err(latency, "Unknown", "the answer's rooms are not the request's");
                        }
                        out.rooms += counts.len() as u64;
                        done.fetch_add(counts.len() as u64, Ordering::Relaxed);
                    }
                    Err(status) => out.calls.err(latency, code_name(status.code() as i32), status.message()),
                }
            }
            out
        });
    }
    let mut reads = Reads::default();
    while let Some(out) = tasks.join_next().await {
        let out = out.map_err(|e| format!("a reader failed: {e}"))?;
        reads.calls.merge(&out.calls);
        reads.rooms += out.rooms;
    }
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    Ok((reads, elapsed))
}

/// Runs the scenario.
pub(crate) async fn run(args: RoomCountsArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let endpoints = common.endpoints();
    let (rooms, members, churners, gateway_sessions) =
        (args.rooms.max(1), args.members.max(1), args.churn_sessions.max(1), args.gateway.gateway_sessions);
    // Sessions 0..members are in the rooms, then the churners, then the gateway's.
    let sessions = members + churners + gateway_sessions;
    let shared = one_session_each(&common.gateway_id, sessions);
    let interval = Duration::from_millis(u64::from(args.count_interval_ms.max(1)));
    let churned_rooms = churners.min(rooms);
    println!(
        "room-counts: {rooms} rooms, {members} members, {} WatchRoomCounts streams of every room (every {} ms), {} \
         joins + leaves/s by {churners} other sessions across {churned_rooms} rooms for {:.0} s, then RoomCounts of \
         {} rooms x {} in flight for {:.0} s; gateway renewing {gateway_sessions} sessions at {}/s, on {}",
        args.streams,
        args.count_interval_ms,
        args.churn_rate,
        args.run.duration.as_secs_f64(),
        args.read_batch,
        args.read_concurrency,
        args.read_duration.as_secs_f64(),
        args.gateway.gateway_rate,
        endpoints.host()
    );
    let spec = args.drive.conn_spec(common, args.drive.batch);
    let join = Plan::Spread { rooms, op: RoomOp::Join { stamped: false } };
    let (setup, conns) =
        register_and_join(&spec, &shared, args.run.ttl_ms, sessions, 0..members, join, progress).await?;

    let request = pb::WatchRoomCountsRequest {
        room_ids: (0..rooms).map(room_id).collect(),
        viewer_id: String::new(),
        count_interval_ms: args.count_interval_ms,
    };
    let requests = vec![request; args.streams as usize];
    let open = |mut client: PresenceClient<Channel>, request| async move { client.watch_room_counts(request).await };
    let opening = Instant::now();
    let streams = watch_streams(
        &endpoints,
        requests,
        args.run.watchers_per_connection,
        progress,
        open,
        |got: &mut Received, message| got.fold(message),
    )
    .await?;
    println!(
        "{} streams open in {:.1} s ({} refused{})",
        streams.open(),
        opening.elapsed().as_secs_f64(),
        streams.refused.0,
        streams.refused.1.as_ref().map_or_else(String::new, |r| format!(": {r}"))
    );

    let (gateway_spec, gateway) =
        quiet_gateway(&args.gateway, &endpoints, &shared, members + churners, args.run.ttl_ms, args.run.duration)
            .await?;
    let churn_mark = CpuMark::now(args.server_pid)?;
    let churn_spec = room_phase(
        "churn",
        Plan::ToggleSpread { rooms },
        args.churn_batch,
        members..members + churners,
        args.churn_rate,
        Some(args.run.duration),
    );
    let (churn, _conns) = run_phase(conns, Arc::clone(&shared), churn_spec, progress).await;
    let churn_cpu = churn_mark.spent(args.server_pid, churn.rec.count())?;
    let churn_start = churn_mark.at;
    let churn_elapsed = churn_cpu.elapsed;
    let gateway = gateway_result(gateway).await?;
    // Messages sent for the churn's last changes arrive up to an interval later.
    tokio::time::sleep(interval).await;
    let (open, refused) = (streams.open(), streams.refused.clone());
    let logs = streams.stop().await;

    let cadence = Cadence::of(logs.iter().map(|r| r.times.as_slice()), churn_start, churn_elapsed, interval);
    let firsts: Vec<(usize, bool)> = logs.iter().filter_map(|r| r.first).collect();
    let first_min = firsts.iter().map(|f| f.0).min().unwrap_or(0);
    let first_max = firsts.iter().map(|f| f.0).max().unwrap_or(0);
    let first_whole = firsts.iter().filter(|f| f.0 as u64 == rooms).count();
    let named = firsts.iter().filter(|f| f.1).count();
    let later: u64 = logs.iter().map(|r| r.rooms.len() as u64).sum();
    let carried: u64 = logs.iter().flat_map(|r| &r.rooms).map(|&n| n as u64).sum();
    let largest = logs.iter().flat_map(|r| &r.rooms).copied().max().unwrap_or(0);
    let churn_per_s = per_second(churn.rec.ok_count(), &churn, args.run.duration);

    // The reads, the gateway renewing through them with no quiet phase of its own.
    let read = if args.read_duration.is_zero() {
        None
    } else {
        let reads_end = now_ms() + args.read_duration.as_millis() as i64;
        let gateway = if gateway_sessions > 0 {
            Some(gateway::start(&gateway_spec, &shared, now_ms(), reads_end)?)
        } else {
            None
        };
        let mark = CpuMark::now(args.server_pid)?;
        let spec = ReadSpec {
            rooms,
            batch: args.read_batch.max(1),
            concurrency: args.read_concurrency,
            connections: args.read_connections,
            duration: args.read_duration,
        };
        let (reads, elapsed) = read_counts(&endpoints, spec, progress).await?;
        let cpu = mark.spent(args.server_pid, reads.rooms)?;
        let gateway = gateway_result(gateway).await?;
        Some((reads, elapsed, cpu, gateway))
    };

    let call = "presence.v1.Presence.Leases (join and leave items)";
    let mut report = presenced_report("room-counts", &churn.rec, churn.elapsed, &endpoints, call, args.run.duration);
    report.tag("rooms", rooms);
    report.tag("streams", args.streams);
    report.set("rooms", rooms);
    report.set("members", members);
    report.set("streams", args.streams);
    report.set("streams_open", open);
    report.set("streams_refused", refused.0);
    report.set("stream_refusal", refused.1);
    report.set("count_interval_ms", args.count_interval_ms);
    report.set("setup_registers_per_s", setup.register.rate());
    report.set("setup_joins_per_s", setup.join.rate());
    report.set(
        "first_messages",
        json!({
            "received": firsts.len(),
            "rooms_min": first_min,
            "rooms_max": first_max,
            "with_every_room": first_whole,
            "with_watch_id": named,
        }),
    );
    let mut churn_report = churn_json(&churn, churners, args.churn_rate, args.churn_batch, churn_per_s);
    churn_report["rooms"] = json!(churned_rooms);
    churn_report["cpu"] = churn_cpu.json("join_or_leave");
    report.set("churn", churn_report);
    let mut messages = cadence.json("stream");
    messages["after_first"] = json!(later);
    messages["rooms_after_first"] = json!(carried);
    messages["rooms_per_message_mean"] = json!(carried as f64 / later.max(1) as f64);
    messages["rooms_per_message_max"] = json!(largest);
    report.set("messages", messages);
    let mut gateway_report = gateway.as_ref().map(|gw| gw.summary(&gateway_spec, "during_churn"));
    if let Some((reads, elapsed, cpu, reads_gateway)) = &read {
        let mut phase = Report::from_recorder("room-counts reads", &reads.calls, *elapsed, "timeout");
        phase.options.call = "presence.v1.Presence.RoomCounts".into();
        phase.options.concurrency = args.read_concurrency;
        phase.options.connections = args.read_connections;
        report.set(
            "reads",
            json!({
                "batch": args.read_batch,
                "concurrency": args.read_concurrency,
                "connections": args.read_connections,
                "calls": reads.calls.count(),
                "errors": reads.calls.count() - reads.calls.ok_count(),
                "rooms": reads.rooms,
                "rooms_per_s": reads.rooms as f64 / elapsed.as_secs_f64().max(1e-9),
                "call_p50_ns": reads.calls.percentile_ns(50.0),
                "call_p99_ns": reads.calls.percentile_ns(99.0),
                "cpu": cpu.json("room"),
                "phase": phase,
            }),
        );
        if let (Some(gw), Some(busy)) = (gateway_report.as_mut(), reads_gateway) {
            let combined =
                GatewayResult { quiet: gateway.as_ref().and_then(|g| g.quiet.clone()), busy: busy.busy.clone() };
            let v = combined.summary(&gateway_spec, "during_reads");
            gw["during_reads"] = v["during_reads"].clone();
            gw["during_reads_ms"] = v["during_reads_ms"].clone();
            gw["p99_during_reads_over_quiet"] = v["p99_during_over_quiet"].clone();
        }
    }
    if let Some(gw) = gateway_report {
        report.set("gateway", gw);
    }
    report.set("generator_cpu_share_churn", churn_cpu.generator_share());

    println!(
        "first messages: {} of {open} streams, {first_min}..{first_max} rooms each ({first_whole} with all {rooms}), {named} \
         with a watch_id",
        firsts.len()
    );
    println!("\n{}", churn_line(&churn, args.churn_rate, churn_per_s, "changed a room"));
    println!("{}", churn_cpu.line("the churn", "join/leave"));
    println!(
        "count messages: {} to {open} streams over {:.1} intervals: {}",
        cadence.total,
        cadence.intervals,
        cadence.describe("stream")
    );
    println!(
        "  rooms carried after the first messages: {carried} in {later} messages ({:.0} per message, at most {largest})",
        carried as f64 / later.max(1) as f64
    );
    if let Some(gw) = &gateway {
        gw.print("during the churn");
    }
    let mut shares = format!("{:.0}% during the churn", churn_cpu.generator_share() * 100.0);
    if let Some((reads, elapsed, cpu, reads_gateway)) = &read {
        println!(
            "\nreads: {:.0} rooms/s ({} calls of {} rooms, {} in flight on {} connections, {} errors), call p50 {} p99 {}",
            reads.rooms as f64 / elapsed.as_secs_f64().max(1e-9),
            reads.calls.count(),
            args.read_batch,
            args.read_concurrency,
            args.read_connections,
            reads.calls.count() - reads.calls.ok_count(),
            fmt_ns(reads.calls.percentile_ns(50.0)),
            fmt_ns(reads.calls.percentile_ns(99.0)),
        );
        if let Some(e) = reads.calls.errors().iter().next() {
            println!("  first error: {} (x{})", e.0, e.1);
        }
        println!("{}", cpu.line("the reads", "room read"));
        if let Some(busy) = reads_gateway {
            println!("  gateway renew, during the reads: {}", renew_line(&busy.busy));
            let quiet = gateway.as_ref().and_then(|g| g.quiet.as_ref());
            if let Some(r) = quiet.and_then(|q| gateway::p99_ratio(q, &busy.busy)) {
                println!("  gateway renew p99 during the reads / quiet: x{r:.2}");
            }
        }
        shares.push_str(&format!(", {:.0}% during the reads", cpu.generator_share() * 100.0));
        report.set("generator_cpu_share_reads", cpu.generator_share());
    }
    println!("  (the generator and the server share this machine's {} cores; the generator used {shares})", cpus());
    Ok(report)
}
