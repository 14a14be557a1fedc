//! `notify-targets`: where notifications go (A3, A4), over gRPC, and what
//! answering costs the heartbeat. `--users` users with one session each are
//! registered (Leases batches), and each says what its human does in a unary
//! Renew of its own: a quarter active on a desktop, the rest in the background
//! on a phone (the shape of a chat's evening). A gateway renews other sessions
//! at a steady rate, quiet first; then `--callers` callers ask
//! `NotifyTargets` for `--users-per-call` users at a time, cycling over all of them,
//! for `--duration`, the gateway renewing through it.
//!
//! The report gives users answered per second, the call's p50 and p99, the
//! server's CPU per user answered (with `--server-pid`), the gateway's p99
//! quiet and during, and the generator's own share of the machine.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient};
use serde_json::json;
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::cli::NotifyTargetsArgs;
use crate::conn::Endpoints;
use crate::phase::{Shared, register_everyone};
use crate::progress::{Progress, Ticker};
use crate::report::Report;
use crate::rooms::{gateway_result, one_session_each, presenced_report, quiet_gateway};
use crate::server_cpu::CpuMark;
use crate::stats::{Recorder, code_name};

/// What session `k` says of its human: a quarter active on a desktop, the rest
/// in the background on a phone.
fn said_by(k: u64) -> (pb::Attention, pb::DeviceKind) {
    if k.is_multiple_of(4) {
        (pb::Attention::Active, pb::DeviceKind::DeviceDesktop)
    } else {
        (pb::Attention::Background, pb::DeviceKind::DeviceMobile)
    }
}

/// Sessions `0..users` say their attention, `concurrency` unary Renews in flight.
async fn say_attention(endpoints: &Endpoints, shared: &Arc<Shared>, users: u64, ttl_ms: u32) -> Result<(), String> {
    let client = PresenceClient::new(endpoints.grpc_channel().await?);
    let next = Arc::new(AtomicU64::new(0));
    let mut tasks = JoinSet::new();
    for _ in 0..64 {
        let (mut client, next, shared) = (client.clone(), Arc::clone(&next), Arc::clone(shared));
        tasks.spawn(async move {
            loop {
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= users {
                    return Ok::<(), String>(());
                }
                let (user_id, session_id) = shared.naming.ids(k);
                let (attention, _) = said_by(k);
                let request = pb::RenewRequest {
                    user_id,
                    session_id,
                    generation: shared.gens.get(k),
                    ttl_ms,
                    attention: Some(attention as i32),
                    ..Default::default()
                };
                client.renew(request).await.map_err(|status| format!("a renewal with attention failed: {status}"))?;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done.map_err(|e| format!("a task failed: {e}"))??;
    }
    Ok(())
}

/// What the callers measured: one sample per call.
#[derive(Debug, Default)]
struct Asked {
    calls: Recorder,
    users: u64,
}

/// `--callers` callers over `--call-connections` connections, each asking for
/// `--users-per-call` users at a time, cycling over `0..users`, for `duration`.
async fn ask(
    endpoints: &Endpoints,
    shared: &Arc<Shared>,
    args: &NotifyTargetsArgs,
    progress: Progress,
) -> Result<(Asked, Duration), String> {
    let mut clients: Vec<PresenceClient<Channel>> = Vec::new();
    for _ in 0..args.call_connections.max(1) {
        clients.push(PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20));
    }
    let (users, batch, duration) = (args.users.max(1), args.users_per_call.max(1), args.duration);
    let ids: Arc<Vec<String>> = Arc::new((0..users).map(|k| shared.naming.ids(k).0).collect());
    let (cursor, done) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let bar = progress.timed("NotifyTargets", duration);
    let start = Instant::now();
    let _ticker = Ticker::start(bar.clone(), Arc::clone(&done), start, "users");
    let mut tasks = JoinSet::new();
    for worker in 0..args.callers.max(1) as usize {
        let mut client = clients[worker % clients.len()].clone();
        let (ids, cursor, done) = (Arc::clone(&ids), Arc::clone(&cursor), Arc::clone(&done));
        tasks.spawn(async move {
            let mut out = Asked::default();
            while start.elapsed() < duration {
                let from = cursor.fetch_add(batch, Ordering::Relaxed);
                let user_ids = (from..from + batch).map(|i| ids[(i % users) as usize].clone()).collect();
                let request = pb::NotifyTargetsRequest { user_ids, ..Default::default() };
                let sent = Instant::now();
                let answer = client.notify_targets(request).await;
                let latency = sent.elapsed();
                match answer {
                    Ok(answer) => {
                        let targets = answer.into_inner().targets;
                        // Session k of a quarter is active: in-app, push held; the rest pushed now.
                        let right = targets.len() as u64 == batch
                            && targets.iter().zip(from..).all(|(target, i)| {
                                target.user_id == ids[(i % users) as usize]
                                    && target.push_now == (said_by(i % users).0 != pb::Attention::Active)
                            });
                        if right {
                            out.calls.ok(latency, 1);
                        } else {
                            out.calls.err(latency, "Unknown", "an answer other than the sessions said");
                        }
                        out.users += targets.len() as u64;
                        done.fetch_add(targets.len() as u64, Ordering::Relaxed);
                    }
                    Err(status) => out.calls.err(latency, code_name(status.code() as i32), status.message()),
                }
            }
            out
        });
    }
    let mut asked = Asked::default();
    while let Some(out) = tasks.join_next().await {
        let out = out.map_err(|e| format!("a caller failed: {e}"))?;
        asked.calls.merge(&out.calls);
        asked.users += out.users;
    }
    let elapsed = start.elapsed();
    bar.finish_and_clear();
    Ok((asked, elapsed))
}

/// Runs the scenario.
pub(crate) async fn run(args: NotifyTargetsArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let endpoints = common.endpoints();
    let (users, gateway_sessions) = (args.users.max(1), args.gateway.gateway_sessions);
    println!(
        "notify-targets: {users} users (a quarter active on a desktop, the rest in the background on a phone), \
         NotifyTargets of {} users x {} in flight for {:.0} s; gateway renewing {gateway_sessions} sessions at {}/s, \
         on {}",
        args.users_per_call,
        args.callers,
        args.duration.as_secs_f64(),
        args.gateway.gateway_rate,
        endpoints.host()
    );
    // Sessions 0..users say their attention, then the gateway's.
    let shared = one_session_each(&common.gateway_id, users + gateway_sessions);
    let spec = args.drive.conn_spec(common, args.drive.batch);
    let setup = Instant::now();
    let (registered, _conns) =
        register_everyone(&spec, &shared, args.ttl_ms, 0..users + gateway_sessions, progress).await?;
    if registered.rec.ok_count() < users + gateway_sessions {
        return Err(format!("only {} registers succeeded: {:?}", registered.rec.ok_count(), registered.rec.errors()));
    }
    say_attention(&endpoints, &shared, users, args.ttl_ms).await?;
    println!(
        "setup: {} sessions registered and {users} said their attention in {:.1} s",
        users + gateway_sessions,
        setup.elapsed().as_secs_f64()
    );

    let (gateway_spec, gateway) =
        quiet_gateway(&args.gateway, &endpoints, &shared, users, args.ttl_ms, args.duration).await?;
    let mark = CpuMark::now(args.server_pid)?;
    let (asked, elapsed) = ask(&endpoints, &shared, &args, progress).await?;
    let cpu = mark.spent(args.server_pid, asked.users)?;
    let gateway = gateway_result(gateway).await?;

    let per_s = asked.users as f64 / elapsed.as_secs_f64().max(1e-9);
    let call = "presence.v1.Presence.NotifyTargets";
    let mut report = presenced_report("notify-targets", &asked.calls, elapsed, &endpoints, call, args.duration);
    report.options.concurrency = args.callers;
    report.options.connections = args.call_connections;
    report.tag("users", users);
    report.set(
        "notify",
        json!({
            "users": users,
            "batch": args.users_per_call,
            "concurrency": args.callers,
            "connections": args.call_connections,
            "calls": asked.calls.count(),
            "errors": asked.calls.count() - asked.calls.ok_count(),
            "users_answered": asked.users,
            "users_per_s": per_s,
            "call_p50_ns": asked.calls.percentile_ns(50.0),
            "call_p99_ns": asked.calls.percentile_ns(99.0),
            "cpu": cpu.json("user"),
        }),
    );
    if let Some(gw) = &gateway {
        report.set("gateway", gw.summary(&gateway_spec, "during_notify"));
    }
    println!(
        "\nNotifyTargets: {} users answered in {:.1} s: {per_s:.0} users/s; call p50 {} p99 {} ({} calls, {} errors)",
        asked.users,
        elapsed.as_secs_f64(),
        crate::stats::fmt_ns(asked.calls.percentile_ns(50.0)),
        crate::stats::fmt_ns(asked.calls.percentile_ns(99.0)),
        asked.calls.count(),
        asked.calls.count() - asked.calls.ok_count()
    );
    println!("{}", cpu.line("the calls", "user answered"));
    if let Some(gw) = &gateway {
        gw.print("during NotifyTargets");
    }
    println!("  the generator's share of the machine: {:.0}%", cpu.generator_share() * 100.0);
    Ok(report)
}
