//! The CPU time a server process spent, from `/proc/<pid>/stat`, so that a scenario can
//! report server CPU per operation beside its rate: a rate alone hides a server that
//! buys throughput with more cores.

use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::report::cpus;

/// User + system CPU time of a process and all its threads, in nanoseconds.
pub(crate) fn cpu_ns(pid: u32) -> Result<u64, String> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .map_err(|e| format!("cannot read /proc/{pid}/stat: {e}"))?;
    let ticks = parse_cpu_ticks(&stat).ok_or_else(|| format!("cannot parse /proc/{pid}/stat"))?;
    Ok(ticks * 1_000_000_000 / clock_ticks_per_second())
}

/// `utime + stime` of a stat line, in clock ticks. The command name (field 2) is in
/// parentheses and may itself hold spaces or parentheses, so fields are counted from the
/// last `)`.
pub(crate) fn parse_cpu_ticks(stat: &str) -> Option<u64> {
    let after_name = &stat[stat.rfind(')')? + 1..];
    // After the name: state (3), ppid (4), ... utime is field 14, stime field 15.
    let mut fields = after_name.split_whitespace().skip(14 - 3);
    let utime: u64 = fields.next()?.parse().ok()?;
    let stime: u64 = fields.next()?.parse().ok()?;
    Some(utime + stime)
}

/// `sysconf(_SC_CLK_TCK)`: 100 on every Linux this runs on; read from `getconf` rather
/// than assumed, and 100 if that is missing.
fn clock_ticks_per_second() -> u64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|out| String::from_utf8(out.stdout).ok())
        .and_then(|s| s.trim().parse().ok())
        .filter(|&n| n > 0)
        .unwrap_or(100)
}

/// Server CPU time per operation over a phase, in microseconds.
pub(crate) fn us_per_op(cpu_before_ns: u64, cpu_after_ns: u64, ops: u64) -> f64 {
    cpu_after_ns.saturating_sub(cpu_before_ns) as f64 / 1e3 / ops.max(1) as f64
}

/// The CPU time spent so far by the server (with `--server-pid`) and by the generator.
#[derive(Debug)]
pub(crate) struct CpuMark {
    server_ns: Option<u64>,
    own_ns: u64,
    pub(crate) at: Instant,
}

impl CpuMark {
    pub(crate) fn now(server_pid: Option<u32>) -> Result<CpuMark, String> {
        Ok(CpuMark {
            server_ns: server_pid.map(cpu_ns).transpose()?,
            own_ns: cpu_ns(std::process::id())?,
            at: Instant::now(),
        })
    }

    /// What was spent since this mark, over `ops` operations.
    pub(crate) fn spent(&self, server_pid: Option<u32>, ops: u64) -> Result<CpuSpent, String> {
        let elapsed = self.at.elapsed();
        let server_ns = match (server_pid, self.server_ns) {
            (Some(pid), Some(before)) => Some(cpu_ns(pid)?.saturating_sub(before)),
            _ => None,
        };
        let own_ns = cpu_ns(std::process::id())?.saturating_sub(self.own_ns);
        Ok(CpuSpent { server_ns, own_ns, elapsed, ops })
    }
}

/// CPU over a phase: the server's (user + system, all threads) and the generator's.
#[derive(Debug)]
pub(crate) struct CpuSpent {
    server_ns: Option<u64>,
    own_ns: u64,
    pub(crate) elapsed: Duration,
    ops: u64,
}

impl CpuSpent {
    /// The server's CPU as a share of one core.
    pub(crate) fn server_cores(&self) -> Option<f64> {
        self.server_ns.map(|ns| ns as f64 / (self.elapsed.as_nanos() as f64).max(1.0))
    }

    /// The server's CPU per operation, µs.
    pub(crate) fn server_us_per_op(&self) -> Option<f64> {
        self.server_ns.map(|ns| ns as f64 / 1e3 / self.ops.max(1) as f64)
    }

    /// The generator's share of all the machine's cores, as `load` computes it.
    pub(crate) fn generator_share(&self) -> f64 {
        self.own_ns as f64 / (self.elapsed.as_nanos() as f64 * cpus() as f64).max(1.0)
    }

    pub(crate) fn json(&self, per: &str) -> Value {
        let mut v = json!({
            "elapsed_ms": self.elapsed.as_millis() as u64,
            "server_cpu_s": self.server_ns.map(|ns| ns as f64 / 1e9),
            "server_cores": self.server_cores(),
            "generator_cpu_share": self.generator_share(),
        });
        v[format!("server_us_per_{per}")] = json!(self.server_us_per_op());
        v
    }

    pub(crate) fn line(&self, phase: &str, per: &str) -> String {
        match (self.server_ns, self.server_cores(), self.server_us_per_op()) {
            (Some(ns), Some(cores), Some(us)) => format!(
                "  server CPU over {phase}: {:.2} s in {:.1} s, {:.0}% of one core, {us:.2} us per {per} (user + \
                 system, all threads: the streams and the gateway included)",
                ns as f64 / 1e9,
                self.elapsed.as_secs_f64(),
                cores * 100.0
            ),
            _ => format!("  server CPU over {phase}: not measured (give --server-pid)"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utime_and_stime_are_read_after_a_name_with_spaces_and_parentheses() {
        let stat = "4242 (presenced (x) y) S 1 4242 4242 0 -1 4194560 2000 0 0 0 731 269 0 0 20 0 5 0 100 0 0";
        assert_eq!(parse_cpu_ticks(stat), Some(731 + 269));
    }

    #[test]
    fn this_process_has_spent_some_cpu() {
        let busy: u64 = (0..5_000_000u64).fold(0, |a, b| a.wrapping_mul(31).wrapping_add(b));
        assert!(busy != 1);
        assert!(cpu_ns(std::process::id()).unwrap() > 0);
    }

    #[test]
    fn cpu_per_op_divides_the_phase_difference() {
        assert_eq!(us_per_op(1_000_000, 9_000_000, 1_000), 8.0);
        assert_eq!(us_per_op(5, 5, 0), 0.0);
    }
}
