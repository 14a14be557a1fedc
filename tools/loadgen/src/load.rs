//! `load`: the gateway workload. Registers U×S sessions (measuring registers/s), then
//! renews them, cycling over every session with the generation its register returned,
//! for `--duration` (measuring heartbeats/s and per-item latency).

use std::sync::Arc;
use std::time::Duration;

use serde_json::json;

use crate::cli::LoadArgs;
use crate::conn::{Naming, open_conns};
use crate::ids::{Generations, Population};
use crate::phase::{Bound, PhaseResult, PhaseSpec, Shared, Work, register_everyone, run_phase};
use crate::progress::Progress;
use crate::report::Report;
use crate::stats::fmt_ns;

/// The call the report names for a phase.
pub(crate) fn call_name(target: crate::conn::TargetKind, mode: crate::conn::Mode, op: &str) -> String {
    use crate::conn::{Mode, TargetKind};
    match (target, mode) {
        (TargetKind::Presenced, Mode::Unary) => format!("presence.v1.Presence.{op}"),
        (TargetKind::Presenced, _) => format!("presence.v1.Presence.Leases ({op} items)"),
        (TargetKind::Redis, _) => {
            let script = if op == "Register" { "presence_register" } else { "presence_heartbeat" };
            format!("EVALSHA {script}")
        }
    }
}

/// A phase as a ghz-shaped report.
pub(crate) fn phase_report(name: &str, p: &PhaseResult, end_reason: &str) -> Report {
    Report::from_recorder(name, &p.rec, p.elapsed, end_reason)
}

/// Runs the scenario.
pub(crate) async fn run(args: LoadArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let pop = Population::new(args.users, args.sessions_per_user);
    let shared = Arc::new(Shared {
        naming: Naming::offset(pop, common.gateway_id.clone(), args.first_user, args.first_user * 16),
        gens: Generations::new(pop.sessions),
        deadlines: None,
    });
    let target = common.target;
    let register_mode = args.register_mode.unwrap_or(args.drive.mode);
    println!(
        "load: {} users x {} = {} sessions on {} ({}), heartbeats in {} mode, batch {}, concurrency {}",
        pop.users,
        args.sessions_per_user,
        pop.sessions,
        common.endpoints().host(),
        format!("{target:?}").to_lowercase(),
        args.drive.mode.label(target),
        args.drive.batch,
        args.drive.concurrency,
    );

    let mut reg_spec = args.drive.conn_spec(common);
    reg_spec.mode = register_mode;
    let (reg, conns) = register_everyone(&reg_spec, &shared, args.ttl_ms, 0..pop.sessions, progress).await?;
    let mut reg_report = phase_report("register", &reg, "normal");
    reg_report.options.call = call_name(target, register_mode, "Register");
    print!("{}", reg_report.summary("Register phase:"));
    println!("  users flipped ONLINE: {}\n", reg.flips);
    if reg.elapsed > Duration::from_millis(u64::from(args.ttl_ms)) {
        println!(
            "warning: registering took {:.1} s, longer than the {} ms TTL: the first leases expired before the \
             heartbeats began (expect NotFound)",
            reg.elapsed.as_secs_f64(),
            args.ttl_ms
        );
    }

    let conns = if register_mode == args.drive.mode {
        conns
    } else {
        drop(conns);
        open_conns(&args.drive.conn_spec(common)).await?
    };
    let interval = Duration::from_millis(args.heartbeat_interval_ms.max(1));
    let rate = args.drive.rate.resolve(pop.sessions, interval);
    let server_cpu = |pid| crate::server_cpu::cpu_ns(pid);
    let cpu_before = args.server_pid.map(server_cpu).transpose()?;
    let own_cpu_before = server_cpu(std::process::id())?;
    let (hb, _conns) = run_phase(
        conns,
        Arc::clone(&shared),
        PhaseSpec {
            title: "heartbeat".into(),
            work: Work::Renew { ttl_ms: args.ttl_ms },
            items_per_call: args.drive.mode.items_per_call(args.drive.batch),
            bound: Bound::For { first: 0, sessions: pop.sessions, duration: args.duration },
            rate,
        },
        progress,
    )
    .await;

    // The generator's own share of the machine's cores over the phase: what
    // the server was left with, when both share one machine.
    let own_cpu_ns = server_cpu(std::process::id())?.saturating_sub(own_cpu_before);
    let generator_share = own_cpu_ns as f64 / (hb.elapsed.as_nanos() as f64 * crate::report::cpus() as f64).max(1.0);
    let cpu_per_heartbeat_us = match (args.server_pid, cpu_before) {
        (Some(pid), Some(before)) => Some(crate::server_cpu::us_per_op(before, server_cpu(pid)?, hb.rec.count())),
        _ => None,
    };
    let required = pop.sessions as f64 / interval.as_secs_f64();
    let achieved = hb.rate();
    let cycle_s = pop.sessions as f64 / achieved.max(1e-9);
    let mut report = phase_report("load", &hb, "timeout");
    report.options.host = common.endpoints().host();
    report.options.call = call_name(target, args.drive.mode, "Renew");
    report.options.concurrency = args.drive.concurrency;
    report.options.connections =
        if target == crate::conn::TargetKind::Redis { args.drive.concurrency } else { args.drive.connections };
    report.options.qps = rate as u64;
    report.options.duration = args.duration.as_nanos() as u64;
    let mode = args.drive.mode.label(target);
    report.tag("target", format!("{target:?}").to_lowercase());
    report.tag("mode", mode);
    report.tag("batch", args.drive.mode.items_per_call(args.drive.batch));
    report.tag("sessions", pop.sessions);
    report.set("target", format!("{target:?}").to_lowercase());
    report.set("mode", mode);
    report.set("register_mode", register_mode.label(target));
    report.set("batch", args.drive.mode.items_per_call(args.drive.batch));
    report.set("users", pop.users);
    report.set("sessions", pop.sessions);
    report.set("sessions_per_user", args.sessions_per_user);
    report.set("ttl_ms", args.ttl_ms);
    report.set("heartbeat_interval_ms", args.heartbeat_interval_ms);
    report.set("rate_limit", rate);
    report.set("heartbeats_per_s", achieved);
    report.set("required_heartbeats_per_s", required);
    report.set("headroom", achieved / required.max(1e-9));
    report.set("cycle_s", cycle_s);
    report.set("throttled", hb.throttled);
    report.set("behind_schedule_calls", hb.behind_schedule);
    if let Some(us) = cpu_per_heartbeat_us {
        report.set("server_cpu_us_per_heartbeat", us);
    }
    report.set("generator_cpu_share", generator_share);
    report.set("registers_per_s", reg.rate());
    report.set("register_flips", reg.flips);
    report.set("register_phase", &reg_report);
    report.set(
        "percentiles_ns",
        json!({
            "p50": hb.rec.percentile_ns(50.0),
            "p90": hb.rec.percentile_ns(90.0),
            "p99": hb.rec.percentile_ns(99.0),
            "p999": hb.rec.percentile_ns(99.9),
            "max": hb.rec.slowest_ns(),
        }),
    );
    print!("{}", report.summary("Heartbeat phase:"));
    println!(
        "\n  heartbeats/s {achieved:.0}; a fleet of {} sessions at one beat per {} ms needs {required:.0}/s \
         (headroom x{:.2}); every session renewed every {cycle_s:.1} s; p99.9 {}",
        pop.sessions,
        args.heartbeat_interval_ms,
        achieved / required.max(1e-9),
        fmt_ns(hb.rec.percentile_ns(99.9))
    );
    if let Some(us) = cpu_per_heartbeat_us {
        println!("  server CPU: {us:.2} us per heartbeat (user + system, all threads)");
    }
    if hb.throttled > 0 {
        println!(
            "  note: {} renewals were throttled by the server (start presenced with --min-renew-interval-ms 0 to \
             measure store writes)",
            hb.throttled
        );
    }
    println!(
        "  (the generator and the server share this machine's {} cores; the generator used {:.0}% of them)",
        crate::report::cpus(),
        generator_share * 100.0
    );
    Ok(report)
}
