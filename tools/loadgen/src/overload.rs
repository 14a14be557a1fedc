//! `overload` (presenced): renewals at twice what the server can apply, beside a steady
//! stream of registers, unregisters and revokes. B2 says only renewals may be shed: a
//! renewal-only batch and a unary Renew are answered `RESOURCE_EXHAUSTED`, a batch with
//! registers or unregisters waits for room (its renewals shed), and unary Register,
//! Unregister and Revoke never go through the queue. So none of those may be lost.
//!
//! 1. Setup: `--renew-sessions` users to renew, and the users the unregisters and revokes
//!    will remove, registered in `Leases` batches (one session per user throughout, so a
//!    Snapshot shows each operation's effect).
//! 2. Capacity: a short ramp of closed-loop renewal-only batches, `--ramp` batches in
//!    flight at each step; the capacity is the best rate of renewals applied (the
//!    server's `presenced_renewals_total{result="ok"}`). The ramp and the flood are sent
//!    by h2load, one `Leases` stream per batch: a generator in Rust building and decoding
//!    every batch costs about what the server does per item, so on the same machine it
//!    could not offer twice what the server applies.
//! 3. Quiet phase (`--phase`): registers, unregisters and revokes at `--ops-rate` each, half
//!    of the registers and unregisters unary and half in `Leases` batches of `--ops-batch`
//!    registers, as many unregisters and two renewals; revokes are unary (there is no
//!    revoke item).
//! 4. Shedding phase (`--phase`): the same, while renewals are offered open loop at
//!    `--factor` times the capacity (h2load's `--rps`), up to `--flood-streams` batches at
//!    a time (more than the server's lease queue holds, or it never fills), plus unary
//!    Renews at `--unary-renew-rate`. The flood's applied and shed renewals are the
//!    server's counts less those of the renewals the generator sent itself.
//! 5. Check: every register, unregister and revoke sent must have been answered OK and
//!    its effect be visible in a Snapshot (registered users ONLINE, removed ones OFFLINE).

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use presence_client::pb::{self, lease_item, lease_result, presence_client::PresenceClient};
use presence_client::{LeaseChannel, LeaseChannelConfig, lease_result as split_result};
use serde_json::{Value, json};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tonic::transport::Channel;

use crate::cli::OverloadArgs;
use crate::conn::{
    ConnSpec, Endpoints, GenItem, Mode, Naming, RegItem, TargetKind, register_request, renew_request,
    unregister_request,
};
use crate::ids::{Generations, Population};
use crate::phase::{Shared, register_everyone};
use crate::progress::Progress;
use crate::report::Report;
use crate::server::{Server, loadavg_line};
use crate::stats::{Recorder, code_name, fmt_ns};

const SHED_METRIC: &str = "presenced_renewals_shed_total";
const RENEWALS_OK: &str = "presenced_renewals_total{result=\"ok\"}";
const QUEUE_DEPTH: &str = "presenced_lease_queue_depth";

/// The operations that must never be lost.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Register,
    Unregister,
    Revoke,
}

const OPS: [Op; 3] = [Op::Register, Op::Unregister, Op::Revoke];

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::Register => "register",
            Op::Unregister => "unregister",
            Op::Revoke => "revoke",
        }
    }
}

/// How an operation went out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    Unary,
    Batch,
}

/// One target's fate.
const NOT_SENT: u8 = 0;
const SENT: u8 = 1;
const ACKED: u8 = 2;
const REFUSED: u8 = 3;

/// The users one operation acts on, and what happened to each.
struct Targets {
    op: Op,
    shared: Arc<Shared>,
    fate: Vec<AtomicU8>,
}

impl Targets {
    fn new(op: Op, shared: Arc<Shared>) -> Targets {
        let n = shared.naming.pop.sessions;
        Targets { op, shared, fate: (0..n).map(|_| AtomicU8::new(NOT_SENT)).collect() }
    }

    /// Target `k` goes out unary (even) or in a batch (odd); revokes are all unary.
    fn via(&self, k: u64) -> Via {
        if self.op == Op::Revoke || k.is_multiple_of(2) { Via::Unary } else { Via::Batch }
    }
}

/// Latencies and counts of one operation sent one way in one phase.
#[derive(Debug, Default, Clone)]
struct Tally {
    rec: Recorder,
}

/// Every operation's tallies: `[phase][op][via]`.
#[derive(Debug, Default)]
struct Tallies([[[Mutex<Tally>; 2]; 3]; 2]);

impl Tallies {
    fn record(&self, phase: usize, op: Op, via: Via, latency: Duration, result: Result<(), (&'static str, String)>) {
        let cell = &self.0[phase][op as usize][via as usize];
        let mut t = cell.lock().unwrap_or_else(|e| e.into_inner());
        match result {
            Ok(()) => t.rec.ok(latency, 1),
            Err((status, message)) => t.rec.err(latency, status, &message),
        }
    }

    fn get(&self, phase: usize, op: Op, via: Via) -> Tally {
        self.0[phase][op as usize][via as usize].lock().unwrap_or_else(|e| e.into_inner()).clone()
    }
}

/// Renewal outcomes of the flood (or the unary renewals).
#[derive(Debug, Default)]
struct Renewals {
    sent: AtomicU64,
    applied: AtomicU64,
    shed: AtomicU64,
    other: AtomicU64,
    /// Items the generator could not send on time (every stream busy).
    skipped: AtomicU64,
    rec: Mutex<Recorder>,
}

impl Renewals {
    fn count(&self, latency: Duration, results: impl IntoIterator<Item = Result<(), &'static str>>) {
        let mut rec = self.rec.lock().unwrap_or_else(|e| e.into_inner());
        for r in results {
            self.sent.fetch_add(1, Ordering::Relaxed);
            match r {
                Ok(()) => {
                    self.applied.fetch_add(1, Ordering::Relaxed);
                    rec.ok(latency, 1);
                }
                Err("ResourceExhausted") => {
                    self.shed.fetch_add(1, Ordering::Relaxed);
                }
                Err(status) => {
                    self.other.fetch_add(1, Ordering::Relaxed);
                    rec.err(latency, status, "");
                }
            }
        }
    }

    fn json(&self) -> Value {
        let rec = self.rec.lock().unwrap_or_else(|e| e.into_inner());
        json!({
            "sent": self.sent.load(Ordering::Relaxed), "applied": self.applied.load(Ordering::Relaxed),
            "shed": self.shed.load(Ordering::Relaxed), "other_errors": self.other.load(Ordering::Relaxed),
            "skipped_by_generator": self.skipped.load(Ordering::Relaxed),
            "applied_p99_ns": rec.percentile_ns(99.0), "errors": rec.errors(),
        })
    }
}

/// What the operation senders share.
struct Ops {
    targets: [Targets; 3],
    tallies: Tallies,
    /// Renewals carried in the operations' own batches.
    mixed_renewals: Renewals,
    renew: Arc<Shared>,
    per_phase: u64,
    ttl_ms: u32,
}

/// Runs the scenario.
pub(crate) async fn run(args: OverloadArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    if common.target != TargetKind::Presenced {
        return Err("overload drives presenced only".into());
    }
    let server = Server::start(&args.server, &common.addr)?;
    let endpoints = Endpoints { addr: server.addr.clone(), ..common.endpoints() };
    let per_phase = (args.ops_rate * args.phase.as_secs_f64()).ceil() as u64;
    let n_targets = 2 * per_phase;
    let gw = common.gateway_id.clone();
    let one_each = |n: u64| Population { users: n.max(1), sessions: n.max(1) };
    let r = args.renew_sessions.max(1);
    let shared = |n: u64, first: u64| {
        Arc::new(Shared {
            naming: Naming::offset(one_each(n), gw.clone(), first, first),
            gens: Generations::new(n.max(1)),
            deadlines: None,
        })
    };
    let renew = shared(r, 0);
    let ops = Arc::new(Ops {
        targets: [
            Targets::new(Op::Register, shared(n_targets, r)),
            Targets::new(Op::Unregister, shared(n_targets, r + n_targets)),
            Targets::new(Op::Revoke, shared(n_targets, r + 2 * n_targets)),
        ],
        tallies: Tallies::default(),
        mixed_renewals: Renewals::default(),
        renew: Arc::clone(&renew),
        per_phase,
        ttl_ms: args.ttl_ms,
    });
    println!(
        "overload: {r} renewed users, {} registers, unregisters and revokes a second each, on {} (machine load {})",
        args.ops_rate,
        endpoints.host(),
        loadavg_line()
    );

    // 1. Setup.
    let setup_spec = ConnSpec {
        endpoints: endpoints.clone(),
        mode: Mode::Leases,
        concurrency: 8,
        connections: 2,
        batch: 500,
        max_delay: Duration::from_millis(1),
    };
    for shared in [&renew, &ops.targets[1].shared, &ops.targets[2].shared] {
        let n = shared.naming.pop.sessions;
        let (reg, _) = register_everyone(&setup_spec, shared, args.ttl_ms, 0..n, progress).await?;
        if reg.rec.ok_count() < n {
            return Err(format!(
                "setup: only {} of {n} registers succeeded: {:?}",
                reg.rec.ok_count(),
                reg.rec.errors()
            ));
        }
    }

    // 2. Capacity, with the flood's own client and batch.
    let metrics =
        server.metrics_addr.clone().ok_or("overload needs the server's metrics (--metrics-addr or --server-bin)")?;
    let frame = flood_frame(&renew, args.batch.max(1), args.ttl_ms)?;
    let flood_items = args.batch.max(1).min(r);
    println!("\ncapacity ramp (h2load, renewal-only batches of {flood_items}, closed loop):");
    println!("  {:>9} {:>12} {:>10} {:>12}", "in flight", "applied/s", "shed/s", "mean batch");
    let mut capacity = 0.0f64;
    let mut ramp = Vec::new();
    for &streams in &args.ramp {
        let clients = streams.clamp(1, 4);
        let before = server.sample().await;
        let out =
            h2load(&args.h2load, &endpoints, &frame, clients, streams.div_ceil(clients), args.ramp_step, None).await?;
        let after = server.sample().await;
        let secs = after.at.duration_since(before.at).as_secs_f64().max(1e-9);
        let applied = after.delta(&before, RENEWALS_OK).unwrap_or(0.0) / secs;
        let shed = after.delta(&before, SHED_METRIC).unwrap_or(0.0) / secs;
        let mean = out.time_for_request_ns.map_or(0, |t| t[2]);
        println!("  {streams:>9} {applied:>12.0} {shed:>10.0} {:>12}", fmt_ns(mean));
        ramp.push(json!({"in_flight": streams, "applied_per_s": applied, "shed_per_s": shed, "mean_batch_ns": mean}));
        capacity = capacity.max(applied);
    }
    let offered = capacity * args.factor;
    println!("capacity: {capacity:.0} renewals/s; the shedding phase offers {offered:.0}/s (x{})", args.factor);

    // 3. Quiet phase.
    let unary = grpc(&endpoints).await?;
    let ops_channel = LeaseChannel::from_channel(grpc(&endpoints).await?, LeaseChannelConfig::default());
    println!("\nquiet phase: {:.0} s of registers, unregisters and revokes", args.phase.as_secs_f64());
    let quiet_before = server.sample().await;
    send_ops(&ops, 0, args.ops_rate, args.ops_batch, &unary, &ops_channel).await;
    let quiet_after = server.sample().await;

    // 4. Shedding phase.
    println!(
        "\nshedding phase: {:.0} s, renewals offered at {offered:.0}/s over {} streams, {} unary Renews/s",
        args.phase.as_secs_f64(),
        args.flood_streams,
        args.unary_renew_rate
    );
    let unary_renewals = Arc::new(Renewals::default());
    let shed_before = server.sample().await;
    // The flood starts half a second before the operations and ends half a second after
    // them, so that every one of them meets a full queue.
    let lead = Duration::from_millis(500);
    let flood_for = args.phase + 2 * lead;
    let flood_task = {
        let (endpoints, frame, h2load_bin) = (endpoints.clone(), frame.clone(), args.h2load.clone());
        let clients = args.flood_connections.max(1);
        let per_client = args.flood_streams.div_ceil(clients);
        // h2load's --rps is per client, in requests (batches).
        let rps = offered / flood_items as f64 / clients as f64;
        tokio::spawn(
            async move { h2load(&h2load_bin, &endpoints, &frame, clients, per_client, flood_for, Some(rps)).await },
        )
    };
    let unary_task = {
        let (unary, renew, counts) = (unary.clone(), Arc::clone(&renew), Arc::clone(&unary_renewals));
        let (rate, duration, ttl_ms) = (args.unary_renew_rate, flood_for, args.ttl_ms);
        tokio::spawn(async move { unary_renew(unary, renew, counts, rate, duration, ttl_ms).await })
    };
    let watch_task = tokio::spawn(async move { watch_progress(metrics, flood_for).await });
    tokio::time::sleep(lead).await;
    send_ops(&ops, 1, args.ops_rate, args.ops_batch, &unary, &ops_channel).await;
    let flood = flood_task.await.map_err(|e| format!("the flood failed: {e}"))??;
    let _ = unary_task.await;
    let max_depth = watch_task.await.unwrap_or(0.0);
    let shed_after = server.sample().await;

    // 5. Check.
    let check = check_effects(&ops, &unary).await?;

    // Summary. The flood's outcomes are the server's counts less those of the renewals
    // the generator sent itself (unary, and in the operations' batches).
    let server_shed = shed_after.delta(&shed_before, SHED_METRIC).unwrap_or(0.0) as u64;
    let server_ok = shed_after.delta(&shed_before, RENEWALS_OK).unwrap_or(0.0) as u64;
    let own = |f: fn(&Renewals) -> &AtomicU64| {
        f(&unary_renewals).load(Ordering::Relaxed) + f(&ops.mixed_renewals).load(Ordering::Relaxed)
    };
    let flood_secs = flood.finished_s.unwrap_or(flood_for.as_secs_f64()).max(1e-9);
    let flood_done = flood.requests.get("done").copied().unwrap_or(0) * flood_items;
    let flood_shed = server_shed.saturating_sub(own(|r| &r.shed));
    let flood_applied = server_ok.saturating_sub(own(|r| &r.applied));
    let phase_names = ["quiet", "shedding"];
    let mut rows = Vec::new();
    println!("\nRenewals (shedding phase):");
    println!(
        "  {:<30} offered {:>10.0} answered {:>10} applied {:>10} shed {:>10} (h2load: {:?})",
        "flood (Leases, renewal-only)",
        offered * flood_secs,
        flood_done,
        flood_applied,
        flood_shed,
        flood.requests
    );
    for (name, r) in [("unary Renew", &*unary_renewals), ("in the operations' batches", &ops.mixed_renewals)] {
        println!(
            "  {name:<30} sent {:>10} applied {:>10} shed {:>10} other {:>4} not sent {:>8}",
            r.sent.load(Ordering::Relaxed),
            r.applied.load(Ordering::Relaxed),
            r.shed.load(Ordering::Relaxed),
            r.other.load(Ordering::Relaxed),
            r.skipped.load(Ordering::Relaxed),
        );
    }
    println!(
        "  flood: offered {offered:.0}/s (x{:.2} capacity), answered {:.0}/s (x{:.2}), applied {:.0}/s, shed {:.0}/s; \
         lease queue depth up to {max_depth:.0}",
        args.factor,
        flood_done as f64 / flood_secs,
        flood_done as f64 / flood_secs / capacity.max(1e-9),
        flood_applied as f64 / flood_secs,
        flood_shed as f64 / flood_secs,
    );
    println!("\nRegisters, unregisters and revokes:");
    println!(
        "  {:<10} {:<6} {:>7} {:>7} {:>7} {:>5} {:>12} {:>12} {:>12} {:>12}",
        "op", "via", "sent", "acked", "refused", "lost", "p99 quiet", "p99 shedding", "p50 quiet", "p50 shedding"
    );
    let mut total_lost = 0;
    for op in OPS {
        for via in [Via::Unary, Via::Batch] {
            if op == Op::Revoke && via == Via::Batch {
                continue;
            }
            let (q, s) = (ops.tallies.get(0, op, via), ops.tallies.get(1, op, via));
            let c = &check[op as usize][via as usize];
            total_lost += c.lost;
            let via_name = if via == Via::Unary { "unary" } else { "batch" };
            println!(
                "  {:<10} {:<6} {:>7} {:>7} {:>7} {:>5} {:>12} {:>12} {:>12} {:>12}",
                op.name(),
                via_name,
                c.sent,
                c.acked,
                c.refused,
                c.lost,
                fmt_ns(q.rec.percentile_ns(99.0)),
                fmt_ns(s.rec.percentile_ns(99.0)),
                fmt_ns(q.rec.percentile_ns(50.0)),
                fmt_ns(s.rec.percentile_ns(50.0)),
            );
            rows.push(json!({
                "op": op.name(), "via": via_name, "sent": c.sent, "acked": c.acked, "refused": c.refused,
                "unanswered": c.unanswered, "effect_missing": c.effect_missing, "lost": c.lost,
                "p99_quiet_ns": q.rec.percentile_ns(99.0), "p99_shedding_ns": s.rec.percentile_ns(99.0),
                "p50_quiet_ns": q.rec.percentile_ns(50.0), "p50_shedding_ns": s.rec.percentile_ns(50.0),
                "errors_quiet": q.rec.errors(), "errors_shedding": s.rec.errors(),
            }));
            if c.refused + c.unanswered + c.effect_missing > 0 {
                println!(
                    "    refused {} unanswered {} acknowledged without effect {}; errors {:?} {:?}",
                    c.refused,
                    c.unanswered,
                    c.effect_missing,
                    q.rec.errors(),
                    s.rec.errors()
                );
            }
        }
    }
    println!("  lost in all: {total_lost}; machine load (1/5/15 min) {}", loadavg_line());

    let mut all = Recorder::default();
    for p in 0..2 {
        for op in OPS {
            for via in [Via::Unary, Via::Batch] {
                all.merge(&ops.tallies.get(p, op, via).rec);
            }
        }
    }
    let mut report = Report::from_recorder("overload", &all, args.phase * 2, "normal");
    report.options.host = endpoints.host();
    report.options.call = "presence.v1.Presence.{Register,Unregister,Revoke} and Leases".into();
    report.tag("target", "presenced");
    report.set("target", "presenced");
    report.set("phases", phase_names);
    report.set("ramp", ramp);
    report.set("capacity_renewals_per_s", capacity);
    report.set("factor", args.factor);
    report.set("offered_renewals_per_s", offered);
    report.set(
        "flood",
        json!({
            "seconds": flood_secs, "answered": flood_done, "applied": flood_applied, "shed": flood_shed,
            "answered_per_s": flood_done as f64 / flood_secs, "applied_per_s": flood_applied as f64 / flood_secs,
            "shed_per_s": flood_shed as f64 / flood_secs, "h2load_requests": flood.requests,
            "h2load_status_codes": flood.status_codes, "h2load_time_for_request_ns": flood.time_for_request_ns,
        }),
    );
    report.set("unary_renewals", unary_renewals.json());
    report.set("mixed_batch_renewals", ops.mixed_renewals.json());
    report.set("server_shed", server_shed);
    report.set("server_renewals_ok", server_ok);
    report.set("max_lease_queue_depth", max_depth);
    report.set("server_cores_quiet", quiet_after.cores_since(&quiet_before));
    report.set("server_cores_shedding", shed_after.cores_since(&shed_before));
    report.set("ops", rows);
    report.set("lost", total_lost);
    report.set("loadavg_end", loadavg_line());
    Ok(report)
}

/// One HTTP/2 connection.
async fn grpc(endpoints: &Endpoints) -> Result<Channel, String> {
    endpoints.grpc_channel().await
}

/// The operations of phase `phase`: targets `phase * per_phase ..` of each, at `rate` each
/// (`per_phase` is `rate` times the phase's length).
async fn send_ops(ops: &Arc<Ops>, phase: usize, rate: f64, batch: u64, unary: &Channel, channel: &LeaseChannel) {
    let first = phase as u64 * ops.per_phase;
    let count = ops.per_phase;
    let in_flight = Arc::new(Semaphore::new(256));
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let mut next = 0u64;
    let mut pending: [Vec<u64>; 2] = [Vec::new(), Vec::new()];
    let mut renew_cursor = 0u64;
    loop {
        let done = next >= count;
        if !done {
            let due = ((start.elapsed().as_secs_f64() * rate) as u64).min(count);
            for k in next..due {
                for target in &ops.targets {
                    let t = first + k;
                    target.fate[t as usize].store(SENT, Ordering::Relaxed);
                    match target.via(t) {
                        Via::Unary => {
                            let permit = Arc::clone(&in_flight).acquire_owned().await.ok();
                            let (ops, client) = (Arc::clone(ops), PresenceClient::new(unary.clone()));
                            let op = target.op;
                            tasks.spawn(async move {
                                unary_op(&ops, phase, op, t, client).await;
                                drop(permit);
                            });
                        }
                        Via::Batch => pending[target.op as usize].push(t),
                    }
                }
            }
            next = due;
        }
        let flush = done || next >= count;
        while pending[0].len() >= batch as usize
            || pending[1].len() >= batch as usize
            || (flush && !(pending[0].is_empty() && pending[1].is_empty()))
        {
            let take = |v: &mut Vec<u64>| v.drain(..v.len().min(batch as usize)).collect::<Vec<u64>>();
            let (regs, unregs) = (take(&mut pending[0]), take(&mut pending[1]));
            let renewals = [renew_cursor, renew_cursor + 1].map(|s| s % ops.renew.naming.pop.sessions);
            renew_cursor += 2;
            let (ops, channel) = (Arc::clone(ops), channel.clone());
            tasks.spawn(async move { batch_ops(&ops, phase, &regs, &unregs, &renewals, &channel).await });
        }
        if done {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while tasks.join_next().await.is_some() {}
    let secs = start.elapsed().as_secs_f64();
    println!("  {} of each operation in {secs:.1} s", count);
}

fn status_of(s: &tonic::Status) -> (&'static str, String) {
    (code_name(s.code() as i32), s.message().to_owned())
}

/// One unary register, unregister or revoke of target `t`.
async fn unary_op(ops: &Ops, phase: usize, op: Op, t: u64, mut client: PresenceClient<Channel>) {
    let target = &ops.targets[op as usize];
    let naming = &target.shared.naming;
    let sent = Instant::now();
    let result = match op {
        Op::Register => client
            .register(register_request(naming, &RegItem { session: t, ttl_ms: ops.ttl_ms }))
            .await
            .map(|r| target.shared.gens.set(t, r.get_ref().generation)),
        Op::Unregister => {
            let item = GenItem { session: t, generation: target.shared.gens.get(t), ttl_ms: 0 };
            client.unregister(unregister_request(naming, &item)).await.map(|_| ())
        }
        Op::Revoke => {
            let (user_id, session_id) = naming.ids(t);
            client.revoke(pb::RevokeRequest { user_id, session_id }).await.map(|_| ())
        }
    };
    let latency = sent.elapsed();
    let fate = if result.is_ok() { ACKED } else { REFUSED };
    target.fate[t as usize].store(fate, Ordering::Relaxed);
    ops.tallies.record(phase, op, Via::Unary, latency, result.map_err(|s| status_of(&s)));
}

/// One Leases batch: registers, unregisters and two renewals.
async fn batch_ops(ops: &Ops, phase: usize, regs: &[u64], unregs: &[u64], renewals: &[u64], channel: &LeaseChannel) {
    let (reg_t, unreg_t) = (&ops.targets[Op::Register as usize], &ops.targets[Op::Unregister as usize]);
    let mut items = Vec::with_capacity(regs.len() + unregs.len() + renewals.len());
    for &t in regs {
        let request = register_request(&reg_t.shared.naming, &RegItem { session: t, ttl_ms: ops.ttl_ms });
        items.push(pb::LeaseItem { op: Some(lease_item::Op::Register(request)) });
    }
    for &t in unregs {
        let item = GenItem { session: t, generation: unreg_t.shared.gens.get(t), ttl_ms: 0 };
        items.push(pb::LeaseItem {
            op: Some(lease_item::Op::Unregister(unregister_request(&unreg_t.shared.naming, &item))),
        });
    }
    for &s in renewals {
        let item = GenItem { session: s, generation: ops.renew.gens.get(s), ttl_ms: ops.ttl_ms };
        items.push(pb::LeaseItem { op: Some(lease_item::Op::Renew(renew_request(&ops.renew.naming, &item))) });
    }
    let sent = Instant::now();
    let answer = channel.submit_batch(items).await;
    let latency = sent.elapsed();
    let n = regs.len() + unregs.len() + renewals.len();
    let results: Vec<Result<lease_result::Result, (&'static str, String)>> = match answer {
        Ok(results) if results.len() == n => {
            results.into_iter().map(|r| split_result(r).map_err(|s| status_of(&s))).collect()
        }
        Ok(results) => (0..n).map(|_| Err(("Internal", format!("{} results for {n} items", results.len())))).collect(),
        Err(s) => (0..n).map(|_| Err(status_of(&s))).collect(),
    };
    let mut results = results.into_iter();
    for (&t, r) in regs.iter().zip(results.by_ref()) {
        if let Ok(lease_result::Result::Register(reg)) = &r {
            reg_t.shared.gens.set(t, reg.generation);
        }
        reg_t.fate[t as usize].store(if r.is_ok() { ACKED } else { REFUSED }, Ordering::Relaxed);
        ops.tallies.record(phase, Op::Register, Via::Batch, latency, r.map(|_| ()));
    }
    for (&t, r) in unregs.iter().zip(results.by_ref()) {
        unreg_t.fate[t as usize].store(if r.is_ok() { ACKED } else { REFUSED }, Ordering::Relaxed);
        ops.tallies.record(phase, Op::Unregister, Via::Batch, latency, r.map(|_| ()));
    }
    ops.mixed_renewals.count(latency, results.map(|r| r.map(|_| ()).map_err(|(status, _)| status)));
}

/// The flood's request body: one `LeaseBatch` of renewals of the first `batch` renewed
/// sessions, as one gRPC message frame in a file (h2load sends the same body each time).
fn flood_frame(renew: &Shared, batch: u64, ttl_ms: u32) -> Result<std::path::PathBuf, String> {
    let n = renew.naming.pop.sessions;
    let items = (0..batch.min(n))
        .map(|s| {
            let item = GenItem { session: s, generation: renew.gens.get(s), ttl_ms };
            pb::LeaseItem { op: Some(lease_item::Op::Renew(renew_request(&renew.naming, &item))) }
        })
        .collect();
    let frame = crate::h2load::grpc_frame(&pb::LeaseBatch { batch_id: 1, items });
    let path = std::env::temp_dir().join(format!("presence-overload-{}.frame", std::process::id()));
    std::fs::write(&path, frame).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    Ok(path)
}

/// Runs h2load against the Leases method: each request is a stream carrying one batch.
/// `clients` connections, `streams` concurrent streams each, for `duration`; with `rps`,
/// at most that many requests per second per connection.
async fn h2load(
    bin: &std::path::Path,
    endpoints: &Endpoints,
    frame: &std::path::Path,
    clients: u64,
    streams: u64,
    duration: Duration,
    rps: Option<f64>,
) -> Result<crate::h2load::H2loadSummary, String> {
    let mut command = std::process::Command::new(bin);
    command
        .arg("-c")
        .arg(clients.to_string())
        .arg("-m")
        .arg(streams.max(1).to_string())
        .arg("-t")
        .arg("1")
        .arg("-D")
        // Whole seconds: h2load takes no fractions.
        .arg(duration.as_secs_f64().round().max(1.0).to_string())
        .arg("-d")
        .arg(frame)
        .arg("-H")
        .arg("content-type: application/grpc")
        .arg("-H")
        .arg("te: trailers");
    if let Some(rps) = rps {
        command.arg(format!("--rps={}", rps.ceil().max(1.0)));
    }
    command.arg(format!("{}/presence.v1.Presence/Leases", endpoints.presenced_uri()));
    let output = tokio::task::spawn_blocking(move || command.output())
        .await
        .map_err(|e| format!("h2load: {e}"))?
        .map_err(|e| format!("cannot run {}: {e}", bin.display()))?;
    if !output.status.success() {
        return Err(format!("h2load failed: {}", String::from_utf8_lossy(&output.stderr)));
    }
    Ok(crate::h2load::parse_h2load_output(&String::from_utf8_lossy(&output.stdout)))
}

/// Unary Renews at `rate` for `duration`, cycling over the renewed sessions from the end.
async fn unary_renew(
    unary: Channel,
    renew: Arc<Shared>,
    counts: Arc<Renewals>,
    rate: f64,
    duration: Duration,
    ttl_ms: u32,
) {
    if rate <= 0.0 {
        return;
    }
    let n = renew.naming.pop.sessions;
    let in_flight = Arc::new(Semaphore::new(64));
    let mut tasks = JoinSet::new();
    let start = Instant::now();
    let mut next = 0u64;
    while start.elapsed() < duration {
        let due = (start.elapsed().as_secs_f64() * rate) as u64;
        for k in next..due {
            let Ok(permit) = Arc::clone(&in_flight).try_acquire_owned() else {
                counts.skipped.fetch_add(1, Ordering::Relaxed);
                continue;
            };
            let s = n - 1 - (k % n);
            let (renew, counts, mut client) =
                (Arc::clone(&renew), Arc::clone(&counts), PresenceClient::new(unary.clone()));
            tasks.spawn(async move {
                let item = GenItem { session: s, generation: renew.gens.get(s), ttl_ms };
                let sent = Instant::now();
                let r = client.renew(renew_request(&renew.naming, &item)).await;
                counts.count(sent.elapsed(), [r.map(|_| ()).map_err(|s| code_name(s.code() as i32))]);
                drop(permit);
            });
        }
        next = due;
        while tasks.try_join_next().is_some() {}
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    while tasks.join_next().await.is_some() {}
}

/// A line every 5 s while the flood runs (the server's counts); returns the deepest
/// lease queue seen.
async fn watch_progress(metrics: String, duration: Duration) -> f64 {
    let start = Instant::now();
    let mut max_depth = 0.0f64;
    let read = |text: &str| {
        let m = crate::h2load::parse_prometheus(text);
        let get = |k: &str| m.get(k).copied().unwrap_or(0.0);
        (get(RENEWALS_OK), get(SHED_METRIC), get(QUEUE_DEPTH), Instant::now())
    };
    let mut last = match crate::server::scrape(&metrics).await {
        Ok(text) => read(&text),
        Err(_) => return 0.0,
    };
    let mut next_line = Duration::from_secs(5);
    while start.elapsed() < duration {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let Ok(text) = crate::server::scrape(&metrics).await else { continue };
        let now = read(&text);
        max_depth = max_depth.max(now.2);
        if start.elapsed() >= next_line {
            next_line += Duration::from_secs(5);
            let secs = now.3.duration_since(last.3).as_secs_f64().max(1e-9);
            println!(
                "  {:>4.0} s: applied {:.0}/s, shed {:.0}/s, lease queue depth up to {max_depth:.0}",
                start.elapsed().as_secs_f64(),
                (now.0 - last.0) / secs,
                (now.1 - last.1) / secs,
            );
            last = now;
        }
    }
    max_depth
}

/// The fates of one operation sent one way, after the Snapshot.
#[derive(Debug, Default, Clone, Copy)]
struct Checked {
    sent: u64,
    acked: u64,
    refused: u64,
    unanswered: u64,
    effect_missing: u64,
    lost: u64,
}

/// Snapshots every target: a register's user must be ONLINE, an unregister's or a
/// revoke's OFFLINE (one session per user, and nothing else touches them).
async fn check_effects(ops: &Ops, unary: &Channel) -> Result<[[Checked; 2]; 3], String> {
    let mut client = PresenceClient::new(unary.clone()).max_decoding_message_size(64 << 20);
    let mut out = [[Checked::default(); 2]; 3];
    for target in &ops.targets {
        let n = target.shared.naming.pop.sessions;
        let want = if target.op == Op::Register { pb::State::Online } else { pb::State::Offline } as i32;
        for chunk in (0..n).collect::<Vec<_>>().chunks(1_000) {
            let user_ids: Vec<String> = chunk.iter().map(|&t| target.shared.naming.ids(t).0).collect();
            let snapshot = client
                .snapshot(pb::SnapshotRequest { user_ids, viewer_id: String::new() })
                .await
                .map_err(|s| format!("Snapshot: {s}"))?
                .into_inner();
            let states: std::collections::HashMap<&str, i32> =
                snapshot.users.iter().map(|u| (u.user_id.as_str(), u.state)).collect();
            for &t in chunk {
                let state = states.get(target.shared.naming.ids(t).0.as_str()).copied();
                let fate = target.fate[t as usize].load(Ordering::Relaxed);
                if fate == NOT_SENT {
                    continue;
                }
                let c = &mut out[target.op as usize][target.via(t) as usize];
                c.sent += 1;
                let visible = state == Some(want);
                match fate {
                    ACKED => c.acked += 1,
                    REFUSED => c.refused += 1,
                    _ => c.unanswered += 1,
                }
                if fate == ACKED && !visible {
                    c.effect_missing += 1;
                }
                if fate != ACKED || !visible {
                    c.lost += 1;
                }
            }
        }
    }
    Ok(out)
}
