//! The JSON report, shaped like ghz's (`ghz -O json`), and the readable summary.
//!
//! The top-level fields and their types are ghz's `runner.Report`: `count`, and `total`,
//! `average`, `fastest`, `slowest` as nanoseconds, `rps`, `errorDistribution`,
//! `statusCodeDistribution`, `latencyDistribution` (`percentage`, `latency` in ns),
//! `histogram` (`mark` in seconds, `count`, `frequency`), `options`, `date`, `endReason`,
//! `tags`. ghz's `details` is its list of individual calls; the generator keeps
//! histograms rather than every call, so that list is always empty, and the scenario's
//! own figures (target, mode, batch, sessions, bytes per session, lag percentiles, ...)
//! go to an extra `scenario` object, which ghz's readers ignore.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde::Serialize;
use serde_json::Value;

use crate::stats::{Bucket, LatencyDistribution, Recorder, fmt_ns, ghz_buckets, latency_distribution};

/// ghz's `options` object: how the run was configured.
#[derive(Debug, Clone, Default, Serialize)]
pub(crate) struct Options {
    /// The server: `host:port` for presenced, the `redis://` URL for Redis.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) host: String,
    /// The call measured, ghz style (`presence.v1.Presence.Renew`), or the Redis command.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) call: String,
    /// Always plaintext.
    pub(crate) insecure: bool,
    /// Items requested, when the phase was bounded by a count.
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) total: u64,
    /// Calls in flight at once.
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) concurrency: u64,
    /// Items per second asked for (0 = as fast as possible).
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) qps: u64,
    /// Connections used.
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) connections: u64,
    /// Length of a duration-bounded phase, in ns.
    #[serde(skip_serializing_if = "is_zero")]
    pub(crate) duration: u64,
    /// Cores of the machine (shared by the generator and the server).
    #[serde(rename = "CPUs")]
    pub(crate) cpus: u64,
    /// The scenario.
    #[serde(skip_serializing_if = "String::is_empty")]
    pub(crate) name: String,
}

fn is_zero(v: &u64) -> bool {
    *v == 0
}

/// A report in ghz's shape, plus the `scenario` object.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Report {
    /// Name of the run (`load`, `memory`, `expiry`, `fanout`).
    pub(crate) name: String,
    /// ghz's end reason: `normal` for a count-bounded phase, `timeout` for a
    /// duration-bounded one.
    #[serde(rename = "endReason")]
    pub(crate) end_reason: String,
    /// How the run was configured.
    pub(crate) options: Options,
    /// When the report was made, RFC 3339.
    pub(crate) date: String,
    /// Items completed, successful or not.
    pub(crate) count: u64,
    /// Wall time of the measured phase, ns.
    pub(crate) total: u64,
    /// Mean latency of all items, ns.
    pub(crate) average: u64,
    /// Fastest successful item, ns.
    pub(crate) fastest: u64,
    /// Slowest successful item, ns.
    pub(crate) slowest: u64,
    /// Items per second: `count / total`.
    pub(crate) rps: f64,
    /// Failed items per error message.
    #[serde(rename = "errorDistribution")]
    pub(crate) error_distribution: BTreeMap<String, u64>,
    /// Items per status name (gRPC code names as ghz spells them).
    #[serde(rename = "statusCodeDistribution")]
    pub(crate) status_code_distribution: BTreeMap<String, u64>,
    /// Latency percentiles of the successful items.
    #[serde(rename = "latencyDistribution")]
    pub(crate) latency_distribution: Vec<LatencyDistribution>,
    /// Histogram of the successful items.
    pub(crate) histogram: Vec<Bucket>,
    /// ghz's per-call list; always empty here (see the module documentation).
    pub(crate) details: Vec<Value>,
    /// ghz's free-form tags: target, mode, batch and sizes as strings.
    pub(crate) tags: BTreeMap<String, String>,
    /// What the scenario measured beyond ghz's fields.
    pub(crate) scenario: Value,
}

impl Report {
    /// A report of a phase whose items were recorded in `rec` over `total` wall time.
    pub(crate) fn from_recorder(name: &str, rec: &Recorder, total: Duration, end_reason: &str) -> Report {
        let total_ns = total.as_nanos().min(u128::from(u64::MAX)) as u64;
        let secs = total.as_secs_f64();
        Report {
            name: name.to_owned(),
            end_reason: end_reason.to_owned(),
            options: Options { insecure: true, cpus: cpus(), name: name.to_owned(), ..Options::default() },
            date: rfc3339(SystemTime::now()),
            count: rec.count(),
            total: total_ns,
            average: rec.average_ns(),
            fastest: rec.fastest_ns(),
            slowest: rec.slowest_ns(),
            rps: if secs > 0.0 { rec.count() as f64 / secs } else { 0.0 },
            error_distribution: rec.errors().clone(),
            status_code_distribution: rec.statuses().clone(),
            latency_distribution: latency_distribution(rec.histogram())
                .into_iter()
                .map(|mut d| {
                    d.latency = d.latency.min(rec.slowest_ns());
                    d
                })
                .collect(),
            histogram: ghz_buckets(rec.histogram(), rec.fastest_ns(), rec.slowest_ns()),
            details: Vec::new(),
            tags: BTreeMap::new(),
            scenario: Value::Object(serde_json::Map::new()),
        }
    }

    /// Adds a tag.
    pub(crate) fn tag(&mut self, key: &str, value: impl ToString) {
        self.tags.insert(key.to_owned(), value.to_string());
    }

    /// Sets a field of the `scenario` object.
    pub(crate) fn set(&mut self, key: &str, value: impl Serialize) {
        if let Value::Object(map) = &mut self.scenario {
            map.insert(key.to_owned(), serde_json::to_value(value).unwrap_or(Value::Null));
        }
    }

    /// Writes the report as pretty JSON.
    pub(crate) fn write(&self, path: &Path) -> std::io::Result<()> {
        let mut text = serde_json::to_string_pretty(self).map_err(std::io::Error::other)?;
        text.push('\n');
        std::fs::write(path, text)
    }

    /// The summary in ghz's layout.
    pub(crate) fn summary(&self, title: &str) -> String {
        use std::fmt::Write as _;
        let mut s = String::new();
        let _ = writeln!(s, "{title}");
        let _ = writeln!(s, "  Count:        {}", self.count);
        let _ = writeln!(s, "  Total:        {}", fmt_ns(self.total));
        let _ = writeln!(s, "  Slowest:      {}", fmt_ns(self.slowest));
        let _ = writeln!(s, "  Fastest:      {}", fmt_ns(self.fastest));
        let _ = writeln!(s, "  Average:      {}", fmt_ns(self.average));
        let _ = writeln!(s, "  Requests/sec: {:.2}", self.rps);
        if !self.histogram.is_empty() {
            let _ = writeln!(s, "\nResponse time histogram:");
            let max = self.histogram.iter().map(|b| b.count).max().unwrap_or(1).max(1);
            for b in &self.histogram {
                let bar = "∎".repeat(((b.count * 40).div_ceil(max)) as usize);
                let _ = writeln!(s, "  {:>10.3} [{}]\t|{}", b.mark * 1e3, b.count, bar);
            }
        }
        if !self.latency_distribution.is_empty() {
            let _ = writeln!(s, "\nLatency distribution:");
            for d in &self.latency_distribution {
                let _ = writeln!(s, "  {}% in {}", d.percentage, fmt_ns(d.latency));
            }
        }
        let _ = writeln!(s, "\nStatus code distribution:");
        for (k, v) in &self.status_code_distribution {
            let _ = writeln!(s, "  [{k}]\t{v} responses");
        }
        if !self.error_distribution.is_empty() {
            let _ = writeln!(s, "\nError distribution:");
            for (k, v) in &self.error_distribution {
                let _ = writeln!(s, "  [{v}]\t{k}");
            }
        }
        s
    }
}

/// Cores available to this process.
pub(crate) fn cpus() -> u64 {
    std::thread::available_parallelism().map_or(1, |n| n.get() as u64)
}

/// `t` as an RFC 3339 UTC timestamp with second precision, as ghz writes `date`.
pub(crate) fn rfc3339(t: SystemTime) -> String {
    let secs = t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs()) as i64;
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Days since 1970-01-01 to a (year, month, day) in the proleptic Gregorian calendar
/// (Howard Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Report {
        let mut rec = Recorder::default();
        for i in 1..=10 {
            rec.ok(Duration::from_millis(i), 1);
        }
        rec.err(Duration::from_millis(1), "NotFound", "gone");
        let mut r = Report::from_recorder("load", &rec, Duration::from_secs(2), "timeout");
        r.tag("target", "presenced");
        r.set("batch", 100);
        r
    }

    #[test]
    fn json_uses_ghz_field_names_and_types() {
        let v = serde_json::to_value(sample()).unwrap();
        let obj = v.as_object().unwrap();
        for key in [
            "name",
            "endReason",
            "options",
            "date",
            "count",
            "total",
            "average",
            "fastest",
            "slowest",
            "rps",
            "errorDistribution",
            "statusCodeDistribution",
            "latencyDistribution",
            "histogram",
            "details",
            "tags",
        ] {
            assert!(obj.contains_key(key), "missing {key}");
        }
        assert_eq!(v["count"], 11);
        assert_eq!(v["total"], 2_000_000_000u64, "durations are nanoseconds");
        assert_eq!(v["fastest"], 1_000_000);
        assert_eq!(v["slowest"], 10_000_000);
        assert!((v["rps"].as_f64().unwrap() - 5.5).abs() < 1e-9);
        assert_eq!(v["statusCodeDistribution"]["OK"], 10);
        assert_eq!(v["statusCodeDistribution"]["NotFound"], 1);
        assert_eq!(v["errorDistribution"]["rpc error: code = NotFound desc = gone"], 1);
        let ld = v["latencyDistribution"].as_array().unwrap();
        assert_eq!(ld.len(), 7);
        assert_eq!(ld[0]["percentage"], 10);
        assert!(ld[0]["latency"].is_u64());
        let h = v["histogram"].as_array().unwrap();
        assert!(h[0]["mark"].is_f64() && h[0]["count"].is_u64() && h[0]["frequency"].is_f64());
        assert!(v["details"].as_array().unwrap().is_empty(), "ghz's details is a list of calls");
        assert_eq!(v["options"]["insecure"], true);
        assert!(v["options"]["CPUs"].is_u64());
        assert_eq!(v["tags"]["target"], "presenced");
        assert_eq!(v["scenario"]["batch"], 100);
        assert_eq!(v["endReason"], "timeout");
    }

    #[test]
    fn summary_is_readable() {
        let s = sample().summary("Heartbeats");
        assert!(s.contains("Count:        11"));
        assert!(s.contains("Requests/sec: 5.50"));
        assert!(s.contains("[NotFound]\t1 responses"));
        assert!(s.contains("50% in"));
    }

    #[test]
    fn dates_are_rfc3339() {
        assert_eq!(rfc3339(UNIX_EPOCH), "1970-01-01T00:00:00Z");
        let t = UNIX_EPOCH + Duration::from_secs(1_709_210_096); // 2024-02-29T12:34:56Z
        assert_eq!(rfc3339(t), "2024-02-29T12:34:56Z");
        let t = UNIX_EPOCH + Duration::from_secs(4_102_444_799); // 2099-12-31T23:59:59Z
        assert_eq!(rfc3339(t), "2099-12-31T23:59:59Z");
    }
}
