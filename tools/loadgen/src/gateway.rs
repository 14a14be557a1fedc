//! A bystander gateway: sessions renewed one unary call each at a steady rate, first in
//! a quiet phase and then while a scenario loads the server (a wave of expiries, room
//! churn). The ratio of the two p99s says how much that load costs the gateways that
//! keep renewing through it.
//!
//! It runs on a thread of its own with its own single-threaded runtime: on the
//! generator's runtime its answers would wait behind the tasks that decode the
//! scenario's events, and its p99 would measure the generator, not the server.

use std::sync::Arc;
use std::time::Duration;

use serde_json::{Value, json};
use tokio::task::JoinHandle;

use crate::conn::{ConnSpec, Endpoints, Mode, open_conns};
use crate::fanout::renew_summary;
use crate::phase::{Bound, PhaseResult, PhaseSpec, Shared, Work, run_phase};
use crate::progress::Progress;
use crate::redis_seed::now_ms;
use crate::stats::fmt_ns;

/// Which sessions the gateway renews, and how.
#[derive(Debug, Clone)]
pub(crate) struct GatewaySpec {
    /// The target.
    pub(crate) endpoints: Endpoints,
    /// First session renewed.
    pub(crate) first: u64,
    /// Sessions renewed, `first..first + sessions`, cycled over.
    pub(crate) sessions: u64,
    /// Renewals per second.
    pub(crate) rate: f64,
    /// Renewals in flight (they share one HTTP/2 connection).
    pub(crate) concurrency: u64,
    /// TTL sent with each renewal.
    pub(crate) ttl_ms: u32,
}

/// The gateway's two phases.
#[derive(Debug)]
pub(crate) struct GatewayResult {
    /// Until the load starts (`None` when the load started before the gateway could).
    pub(crate) quiet: Option<PhaseResult>,
    /// While the load runs.
    pub(crate) busy: PhaseResult,
}

impl GatewayResult {
    /// p99 under load over p99 in the quiet phase; `None` without samples in both.
    pub(crate) fn ratio(&self) -> Option<f64> {
        self.quiet.as_ref().and_then(|quiet| p99_ratio(quiet, &self.busy))
    }

    /// The report's `gateway` object; the busy phase is named `busy_name`.
    pub(crate) fn summary(&self, spec: &GatewaySpec, busy_name: &str) -> Value {
        let mut v = json!({
            "sessions": spec.sessions,
            "rate": spec.rate,
            "concurrency": spec.concurrency,
            "mode": Mode::Unary.label(spec.endpoints.target),
            "quiet": self.quiet.as_ref().map(renew_summary),
            "quiet_ms": self.quiet.as_ref().map(|q| q.elapsed.as_millis() as u64),
            "p99_during_over_quiet": self.ratio(),
        });
        v[busy_name] = renew_summary(&self.busy);
        v[format!("{busy_name}_ms")] = json!(self.busy.elapsed.as_millis() as u64);
        v
    }

    /// Two lines for people, the busy phase named `busy_title`, and the ratio.
    pub(crate) fn print(&self, busy_title: &str) {
        let quiet = self.quiet.as_ref().map_or_else(|| "none".into(), renew_line);
        println!("  gateway renew, quiet: {quiet}\n  gateway renew, {busy_title}: {}", renew_line(&self.busy));
        if let Some(r) = self.ratio() {
            println!("  gateway renew p99 {busy_title} / quiet: x{r:.2}");
        }
    }
}

/// A gateway phase's renewals for people: p50, p99, count, rate, errors.
pub(crate) fn renew_line(p: &PhaseResult) -> String {
    format!(
        "p50 {} p99 {} ({} renewals, {:.0}/s, {} errors)",
        fmt_ns(p.rec.percentile_ns(50.0)),
        fmt_ns(p.rec.percentile_ns(99.0)),
        p.rec.count(),
        p.rate(),
        p.rec.count() - p.rec.ok_count()
    )
}

/// p99 under load over p99 in the quiet phase; `None` without samples in both.
pub(crate) fn p99_ratio(quiet: &PhaseResult, busy: &PhaseResult) -> Option<f64> {
    let (q, b) = (quiet.rec.percentile_ns(99.0), busy.rec.percentile_ns(99.0));
    (quiet.rec.ok_count() > 0 && busy.rec.ok_count() > 0 && q > 0).then(|| b as f64 / q as f64)
}

/// Starts the gateway: quiet until `quiet_end_ms`, then busy until `busy_end_ms` (Unix ms).
pub(crate) fn start(
    spec: &GatewaySpec,
    shared: &Arc<Shared>,
    quiet_end_ms: i64,
    busy_end_ms: i64,
) -> Result<JoinHandle<Result<GatewayResult, String>>, String> {
    // Unary whatever mode the scenario's own items go in: a gateway heartbeating one
    // socket per call is the one whose latency the load would show.
    let conn_spec = ConnSpec {
        endpoints: spec.endpoints.clone(),
        mode: Mode::Unary,
        concurrency: spec.concurrency.max(1),
        connections: 1,
        batch: 1,
        max_delay: Duration::from_millis(1),
    };
    let (shared, first, sessions, rate, ttl_ms) =
        (Arc::clone(shared), spec.first, spec.sessions, spec.rate, spec.ttl_ms);
    let phase = move |title: &str, duration: Duration| PhaseSpec {
        title: title.into(),
        work: Work::Renew { ttl_ms },
        items_per_call: 1,
        bound: Bound::For { first, sessions, duration },
        rate,
    };
    // Its phases run beside the scenario's own progress: no bars of their own.
    let hidden = Progress::new(true);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the gateway's runtime: {e}"))?;
    let thread = std::thread::Builder::new().name("gateway".into()).spawn(move || {
        // The connections belong to the runtime that opens them: open them here.
        runtime.block_on(async move {
            let conns = open_conns(&conn_spec).await?;
            let quiet_ms = quiet_end_ms - now_ms();
            let (quiet, conns) = if quiet_ms > 0 {
                let quiet = phase("gateway quiet", Duration::from_millis(quiet_ms as u64));
                let (r, conns) = run_phase(conns, Arc::clone(&shared), quiet, hidden).await;
                (Some(r), conns)
            } else {
                (None, conns)
            };
            let busy_ms = (busy_end_ms - now_ms()).max(1) as u64;
            let (busy, _conns) =
                run_phase(conns, shared, phase("gateway busy", Duration::from_millis(busy_ms)), hidden).await;
            Ok(GatewayResult { quiet, busy })
        })
    });
    let thread = thread.map_err(|e| format!("cannot start the gateway's thread: {e}"))?;
    // Joined from a blocking task, so that waiting for it holds no runtime thread.
    Ok(tokio::task::spawn_blocking(move || thread.join().unwrap_or_else(|_| Err("the gateway panicked".into()))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_is_p99_busy_over_quiet() {
        let phase = |ms: &[u64]| {
            let mut p = PhaseResult::default();
            for &m in ms {
                p.rec.ok(Duration::from_millis(m), 1);
            }
            p
        };
        // 100 samples each: p99 is the 99th smallest, so one outlier in 100 is above it.
        let quiet: Vec<u64> = (1..=100).map(|i| if i == 100 { 50 } else { 1 }).collect();
        let during: Vec<u64> = (1..=100).map(|i| if i == 100 { 80 } else { 1 }).collect();
        assert_eq!(p99_ratio(&phase(&quiet), &phase(&during)), Some(1.0), "one outlier is above p99");
        // Two are not.
        let during: Vec<u64> = (1..=100).map(|i| if i >= 99 { 3 } else { 1 }).collect();
        let ratio = p99_ratio(&phase(&quiet), &phase(&during)).unwrap();
        assert!((ratio - 3.0).abs() < 0.01, "{ratio}");
        assert_eq!(p99_ratio(&PhaseResult::default(), &phase(&during)), None, "no quiet samples, no ratio");
        // Errors alone are no samples either.
        let mut failed = PhaseResult::default();
        failed.rec.err(Duration::from_millis(1), "NotFound", "gone");
        assert_eq!(p99_ratio(&phase(&quiet), &failed), None);
        let result = GatewayResult { quiet: Some(phase(&quiet)), busy: phase(&during) };
        assert!((result.ratio().unwrap() - 3.0).abs() < 0.01);
        assert_eq!(GatewayResult { quiet: None, busy: phase(&during) }.ratio(), None);
    }
}
