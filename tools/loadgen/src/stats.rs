//! Latency and outcome recording, and its conversion to ghz's report fields.
//!
//! Each worker owns a [`Recorder`] (no sharing on the hot path); the phase merges them at
//! the end. Latencies go to an HdrHistogram in nanoseconds with three significant digits.
//! As in ghz, `average` covers every call while `fastest`, `slowest`, the latency
//! distribution and the histogram cover the successful calls only.

use std::collections::BTreeMap;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

/// Lowest and highest latency the histograms track, in nanoseconds (100 ns to 1 hour).
const LOWEST_NS: u64 = 100;
const HIGHEST_NS: u64 = 3_600_000_000_000;
/// Distinct error messages kept per recorder; the rest are counted under one key.
const MAX_ERROR_KINDS: usize = 64;

/// ghz's latency distribution percentages.
pub(crate) const GHZ_PERCENTAGES: [u32; 7] = [10, 25, 50, 75, 90, 95, 99];

/// A histogram of nanosecond values.
pub(crate) fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(LOWEST_NS, HIGHEST_NS, 3).expect("static histogram bounds are valid")
}

/// Outcomes and latencies of one worker or one phase.
#[derive(Debug, Clone)]
pub(crate) struct Recorder {
    ok: Histogram<u64>,
    count: u64,
    sum_ns: u128,
    fastest_ok_ns: u64,
    slowest_ok_ns: u64,
    statuses: BTreeMap<String, u64>,
    errors: BTreeMap<String, u64>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            ok: new_histogram(),
            count: 0,
            sum_ns: 0,
            fastest_ok_ns: u64::MAX,
            slowest_ok_ns: 0,
            statuses: BTreeMap::new(),
            errors: BTreeMap::new(),
        }
    }
}

fn clamp_ns(d: Duration) -> u64 {
    (d.as_nanos().min(u128::from(HIGHEST_NS)) as u64).max(LOWEST_NS)
}

impl Recorder {
    /// Records `n` successful items that took `latency` each (a batch's items share the
    /// batch's round trip).
    pub(crate) fn ok(&mut self, latency: Duration, n: u64) {
        if n == 0 {
            return;
        }
        let ns = clamp_ns(latency);
        self.ok.saturating_record_n(ns, n);
        self.count += n;
        self.sum_ns += u128::from(ns) * u128::from(n);
        self.fastest_ok_ns = self.fastest_ok_ns.min(ns);
        self.slowest_ok_ns = self.slowest_ok_ns.max(ns);
        *self.statuses.entry("OK".to_owned()).or_default() += n;
    }

    /// Records one failed item: its status name (ghz's spelling of gRPC codes) and message.
    pub(crate) fn err(&mut self, latency: Duration, status: &str, message: &str) {
        self.count += 1;
        self.sum_ns += u128::from(clamp_ns(latency));
        *self.statuses.entry(status.to_owned()).or_default() += 1;
        let key = format!("rpc error: code = {status} desc = {message}");
        if self.errors.len() < MAX_ERROR_KINDS || self.errors.contains_key(&key) {
            *self.errors.entry(key).or_default() += 1;
        } else {
            *self.errors.entry("(other errors)".to_owned()).or_default() += 1;
        }
    }

    /// Adds another recorder's contents to this one.
    pub(crate) fn merge(&mut self, other: &Recorder) {
        self.ok.add(&other.ok).expect("histograms share their bounds");
        self.count += other.count;
        self.sum_ns += other.sum_ns;
        self.fastest_ok_ns = self.fastest_ok_ns.min(other.fastest_ok_ns);
        self.slowest_ok_ns = self.slowest_ok_ns.max(other.slowest_ok_ns);
        for (k, v) in &other.statuses {
            *self.statuses.entry(k.clone()).or_default() += v;
        }
        for (k, v) in &other.errors {
            *self.errors.entry(k.clone()).or_default() += v;
        }
    }

    /// Every recorded item, successful or not.
    pub(crate) fn count(&self) -> u64 {
        self.count
    }

    /// Successful items.
    pub(crate) fn ok_count(&self) -> u64 {
        self.ok.len()
    }

    /// Items per status name.
    pub(crate) fn statuses(&self) -> &BTreeMap<String, u64> {
        &self.statuses
    }

    /// Items per error message.
    pub(crate) fn errors(&self) -> &BTreeMap<String, u64> {
        &self.errors
    }

    /// Mean latency over every item, in ns.
    pub(crate) fn average_ns(&self) -> u64 {
        if self.count == 0 { 0 } else { (self.sum_ns / u128::from(self.count)) as u64 }
    }

    /// Fastest successful item, in ns (0 without one).
    pub(crate) fn fastest_ns(&self) -> u64 {
        if self.ok.is_empty() { 0 } else { self.fastest_ok_ns }
    }

    /// Slowest successful item, in ns (0 without one).
    pub(crate) fn slowest_ns(&self) -> u64 {
        if self.ok.is_empty() { 0 } else { self.slowest_ok_ns }
    }

    /// The histogram of successful items.
    pub(crate) fn histogram(&self) -> &Histogram<u64> {
        &self.ok
    }

    /// The successful latency at `percent` (0 to 100), in ns, never above the slowest
    /// (a histogram bucket reports its highest equivalent value).
    pub(crate) fn percentile_ns(&self, percent: f64) -> u64 {
        percentile_ns(&self.ok, percent).min(self.slowest_ns())
    }
}

/// The value at `percent` (0 to 100) of a histogram, 0 when empty.
pub(crate) fn percentile_ns(h: &Histogram<u64>, percent: f64) -> u64 {
    if h.is_empty() { 0 } else { h.value_at_quantile(percent / 100.0) }
}

/// One entry of ghz's `latencyDistribution`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub(crate) struct LatencyDistribution {
    /// The percentile, 10 to 99.
    pub(crate) percentage: u32,
    /// The latency at that percentile, in nanoseconds.
    pub(crate) latency: u64,
}

/// One bucket of ghz's `histogram`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub(crate) struct Bucket {
    /// Upper bound of the bucket, in seconds.
    pub(crate) mark: f64,
    /// Successful calls with a latency up to the mark (and above the previous one).
    pub(crate) count: u64,
    /// `count` over all successful calls.
    pub(crate) frequency: f64,
}

/// ghz's `latencyDistribution`: the 10, 25, 50, 75, 90, 95 and 99th percentiles in ns,
/// empty when nothing succeeded.
pub(crate) fn latency_distribution(h: &Histogram<u64>) -> Vec<LatencyDistribution> {
    if h.is_empty() {
        return Vec::new();
    }
    GHZ_PERCENTAGES
        .iter()
        .map(|&p| LatencyDistribution { percentage: p, latency: h.value_at_quantile(f64::from(p) / 100.0) })
        .collect()
}

/// ghz's `histogram`: 11 marks evenly spaced from the fastest to the slowest call (in
/// seconds), each counting the calls above the previous mark and up to its own.
pub(crate) fn ghz_buckets(h: &Histogram<u64>, fastest_ns: u64, slowest_ns: u64) -> Vec<Bucket> {
    if h.is_empty() {
        return Vec::new();
    }
    const BUCKETS: usize = 10;
    let (lo, hi) = (fastest_ns as f64, slowest_ns.max(fastest_ns) as f64);
    let step = (hi - lo) / BUCKETS as f64;
    let marks: Vec<f64> = (0..=BUCKETS).map(|i| if i == BUCKETS { hi } else { lo + step * i as f64 }).collect();
    let mut counts = [0u64; BUCKETS + 1];
    for v in h.iter_recorded() {
        // The lowest value the bucket stands for, clamped into the exact [fastest, slowest].
        let value = (h.lowest_equivalent(v.value_iterated_to()) as f64).clamp(lo, hi);
        let i = marks.iter().position(|&m| value <= m).unwrap_or(BUCKETS);
        counts[i] += v.count_at_value();
    }
    let total = h.len() as f64;
    marks.iter().zip(counts).map(|(&m, c)| Bucket { mark: m / 1e9, count: c, frequency: c as f64 / total }).collect()
}

/// ghz's name of a gRPC status code (Go's `codes.Code.String()`).
pub(crate) fn code_name(code: i32) -> &'static str {
    match code {
        0 => "OK",
        1 => "Canceled",
        2 => "Unknown",
        3 => "InvalidArgument",
        4 => "DeadlineExceeded",
        5 => "NotFound",
        6 => "AlreadyExists",
        7 => "PermissionDenied",
        8 => "ResourceExhausted",
        9 => "FailedPrecondition",
        10 => "Aborted",
        11 => "OutOfRange",
        12 => "Unimplemented",
        13 => "Internal",
        14 => "Unavailable",
        15 => "DataLoss",
        16 => "Unauthenticated",
        _ => "Unknown",
    }
}

/// Formats nanoseconds for people: `812 ns`, `153.21 µs`, `4.20 ms`, `1.53 s`.
pub(crate) fn fmt_ns(ns: u64) -> String {
    let f = ns as f64;
    if ns < 1_000 {
        format!("{ns} ns")
    } else if ns < 1_000_000 {
        format!("{:.2} µs", f / 1e3)
    } else if ns < 1_000_000_000 {
        format!("{:.2} ms", f / 1e6)
    } else {
        format!("{:.2} s", f / 1e9)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn recorder_follows_ghz_semantics() {
        let mut r = Recorder::default();
        for i in 1..=100 {
            r.ok(ms(i), 1);
        }
        r.err(ms(1000), "NotFound", "no live lease");
        assert_eq!(r.count(), 101);
        assert_eq!(r.ok_count(), 100);
        // Fastest and slowest only count successes; the average counts everything.
        assert_eq!(r.fastest_ns(), 1_000_000);
        assert_eq!(r.slowest_ns(), 100_000_000);
        assert_eq!(r.average_ns(), (5050 + 1000) * 1_000_000 / 101);
        assert_eq!(r.statuses()["OK"], 100);
        assert_eq!(r.statuses()["NotFound"], 1);
        assert_eq!(r.errors()["rpc error: code = NotFound desc = no live lease"], 1);
    }

    #[test]
    fn batches_count_per_item() {
        let mut r = Recorder::default();
        r.ok(ms(2), 100);
        assert_eq!((r.count(), r.ok_count()), (100, 100));
        assert_eq!(r.average_ns(), 2_000_000);
    }

    #[test]
    fn latency_distribution_has_ghz_percentiles() {
        let mut r = Recorder::default();
        for i in 1..=1000 {
            r.ok(Duration::from_micros(i), 1);
        }
        let d = latency_distribution(r.histogram());
        assert_eq!(d.iter().map(|e| e.percentage).collect::<Vec<_>>(), GHZ_PERCENTAGES);
        for e in &d {
            let want = u64::from(e.percentage) * 10_000; // p% of 1..=1000 µs, in ns
            let err = (e.latency as f64 - want as f64).abs() / want as f64;
            assert!(err < 0.002, "p{} = {} want {}", e.percentage, e.latency, want);
        }
        assert!(d.windows(2).all(|w| w[0].latency <= w[1].latency));
        assert!(latency_distribution(&new_histogram()).is_empty());
    }

    #[test]
    fn buckets_span_fastest_to_slowest() {
        let mut r = Recorder::default();
        for i in 1..=100 {
            r.ok(ms(i), 1);
        }
        let b = ghz_buckets(r.histogram(), r.fastest_ns(), r.slowest_ns());
        assert_eq!(b.len(), 11);
        assert!((b[0].mark - 0.001).abs() < 1e-9);
        assert!((b[10].mark - 0.1).abs() < 1e-9);
        assert_eq!(b.iter().map(|x| x.count).sum::<u64>(), 100);
        assert!((b.iter().map(|x| x.frequency).sum::<f64>() - 1.0).abs() < 1e-9);
        assert_eq!(b[0].count, 1, "only the fastest call sits at the first mark");
    }

    #[test]
    fn percentiles_never_exceed_the_slowest() {
        let mut r = Recorder::default();
        r.ok(Duration::from_nanos(17_461_000_123), 1);
        assert_eq!(r.percentile_ns(99.0), 17_461_000_123);
        assert!(percentile_ns(r.histogram(), 99.0) >= 17_461_000_123, "the bucket's top is higher");
    }

    #[test]
    fn merge_adds_up() {
        let mut a = Recorder::default();
        a.ok(ms(1), 3);
        let mut b = Recorder::default();
        b.ok(ms(5), 1);
        b.err(ms(1), "Unavailable", "down");
        a.merge(&b);
        assert_eq!((a.count(), a.ok_count()), (5, 4));
        assert_eq!((a.fastest_ns(), a.slowest_ns()), (1_000_000, 5_000_000));
        assert_eq!(a.statuses()["Unavailable"], 1);
    }

    #[test]
    fn code_names_match_go() {
        assert_eq!(code_name(0), "OK");
        assert_eq!(code_name(1), "Canceled");
        assert_eq!(code_name(5), "NotFound");
        assert_eq!(code_name(9), "FailedPrecondition");
        assert_eq!(code_name(14), "Unavailable");
        assert_eq!(code_name(99), "Unknown");
    }

    #[test]
    fn human_durations() {
        assert_eq!(fmt_ns(812), "812 ns");
        assert_eq!(fmt_ns(153_210), "153.21 µs");
        assert_eq!(fmt_ns(4_200_000), "4.20 ms");
        assert_eq!(fmt_ns(1_530_000_000), "1.53 s");
    }
}
