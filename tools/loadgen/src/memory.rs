//! `memory`: registers N sessions and reports how much the server's resident set grew
//! per session (VmRSS of `/proc/<pid>/status`, before and after). On Redis it also reports
//! `INFO memory`'s `used_memory` growth per session, and the share of the global
//! `presence:due` set (`MEMORY USAGE presence:due`).

use std::sync::Arc;

use crate::cli::MemoryArgs;
use crate::conn::{Naming, TargetKind};
use crate::ids::{Generations, Population};
use crate::load::{call_name, phase_report};
use crate::phase::{Shared, register_everyone};
use crate::progress::Progress;
use crate::redis_seed::DUE_KEY;
use crate::report::Report;

/// VmRSS of a process in bytes, from `/proc/<pid>/status`.
pub(crate) fn rss_bytes(pid: u32) -> Result<u64, String> {
    let status =
        std::fs::read_to_string(format!("/proc/{pid}/status")).map_err(|e| format!("cannot read /proc/{pid}: {e}"))?;
    parse_vm_rss(&status).ok_or_else(|| format!("no VmRSS in /proc/{pid}/status"))
}

/// The `VmRSS:   1234 kB` line of a status file, in bytes.
pub(crate) fn parse_vm_rss(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let mut parts = line["VmRSS:".len()..].split_whitespace();
    let n: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") | None => Some(n * 1024),
        Some("mB") | Some("MB") => Some(n * 1024 * 1024),
        _ => None,
    }
}

/// A field of `INFO memory`.
pub(crate) fn info_field(info: &str, field: &str) -> Option<u64> {
    info.lines().find_map(|l| l.strip_prefix(field)?.strip_prefix(':')?.trim().parse().ok())
}

async fn redis_used_memory(conn: &mut redis::aio::MultiplexedConnection) -> Result<u64, String> {
    let info: String =
        redis::cmd("INFO").arg("memory").query_async(conn).await.map_err(|e| format!("INFO memory: {e}"))?;
    info_field(&info, "used_memory").ok_or_else(|| "INFO memory has no used_memory".to_owned())
}

/// Runs the scenario.
pub(crate) async fn run(args: MemoryArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let target = common.target;
    let pop = Population::from_sessions(args.sessions, args.sessions_per_user);
    let shared = Arc::new(Shared {
        naming: Naming::new(pop, common.gateway_id.clone()),
        gens: Generations::new(pop.sessions),
        deadlines: None,
    });
    println!(
        "memory: {} sessions of {} users on {} (pid {}), {} mode",
        pop.sessions,
        pop.users,
        common.endpoints().host(),
        args.pid,
        args.drive.mode.label(target)
    );
    let mut admin = match target {
        TargetKind::Redis => Some(common.endpoints().redis().await?),
        TargetKind::Presenced => None,
    };
    let rss_before = rss_bytes(args.pid)?;
    let used_before = match admin.as_mut() {
        Some(c) => Some(redis_used_memory(c).await?),
        None => None,
    };

    let spec = args.drive.conn_spec(common);
    let (reg, conns) = register_everyone(&spec, &shared, args.ttl_ms, 0..pop.sessions, progress).await?;
    drop(conns);
    let spinner = progress.spinner("settling");
    tokio::time::sleep(args.settle).await;
    spinner.finish_and_clear();

    let rss_after = rss_bytes(args.pid)?;
    let ok = reg.rec.ok_count().max(1);
    let growth = rss_after as i64 - rss_before as i64;
    let mut report = phase_report("memory", &reg, "normal");
    report.options.host = common.endpoints().host();
    report.options.call = call_name(target, args.drive.mode, "Register");
    report.options.total = pop.sessions;
    report.options.concurrency = args.drive.concurrency;
    report.tag("target", format!("{target:?}").to_lowercase());
    report.tag("sessions", pop.sessions);
    report.set("target", format!("{target:?}").to_lowercase());
    report.set("mode", args.drive.mode.label(target));
    report.set("sessions", pop.sessions);
    report.set("registered", reg.rec.ok_count());
    report.set("users", pop.users);
    report.set("sessions_per_user", args.sessions_per_user);
    report.set("pid", args.pid);
    report.set("rss_before_bytes", rss_before);
    report.set("rss_after_bytes", rss_after);
    report.set("rss_growth_bytes", growth);
    report.set("bytes_per_session", growth as f64 / ok as f64);
    report.set("registers_per_s", reg.rate());
    print!("{}", report.summary("Register phase:"));
    println!(
        "\n  resident set: {:.1} MiB -> {:.1} MiB, {:+.1} MiB = {:.0} B per session",
        rss_before as f64 / 1048576.0,
        rss_after as f64 / 1048576.0,
        growth as f64 / 1048576.0,
        growth as f64 / ok as f64
    );
    if let (Some(conn), Some(before)) = (admin.as_mut(), used_before) {
        let after = redis_used_memory(conn).await?;
        let due: Option<u64> =
            redis::cmd("MEMORY").arg("USAGE").arg(DUE_KEY).arg("SAMPLES").arg(0).query_async(conn).await.ok();
        let used = after as i64 - before as i64;
        let per = used as f64 / ok as f64;
        report.set("used_memory_before_bytes", before);
        report.set("used_memory_after_bytes", after);
        report.set("used_memory_per_session", per);
        report.set("due_set_bytes", due);
        let without_due = due.map(|d| (used - d as i64) as f64 / ok as f64);
        report.set("used_memory_per_session_without_due_set", without_due);
        println!(
            "  redis used_memory: {:+.1} MiB = {per:.0} B per session ({} B per session without the presence:due set)",
            used as f64 / 1048576.0,
            without_due.map_or("?".into(), |b| format!("{b:.0}"))
        );
    }
    println!("  (the generator and the server share this machine's {} cores)", crate::report::cpus());
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn vm_rss_parses() {
        let status = "Name:\tpresenced\nVmPeak:\t  200 kB\nVmRSS:\t   12345 kB\nThreads:\t4\n";
        assert_eq!(parse_vm_rss(status), Some(12345 * 1024));
        assert_eq!(parse_vm_rss("Name: x\n"), None);
        let me = rss_bytes(std::process::id()).unwrap();
        assert!(me > 0);
    }

    #[test]
    fn info_fields_parse() {
        let info = "# Memory\r\nused_memory:1048576\r\nused_memory_human:1.00M\r\nused_memory_rss:2000000\r\n";
        assert_eq!(info_field(info, "used_memory"), Some(1_048_576));
        assert_eq!(info_field(info, "used_memory_rss"), Some(2_000_000));
        assert_eq!(info_field(info, "maxmemory"), None);
    }
}
