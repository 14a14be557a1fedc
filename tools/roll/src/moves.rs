//! What the nodes say of moves (C7), read from their metrics: requests held
//! through a freeze and how long they waited, freezes and how long they
//! lasted, and freezes given up. A node's counts die with its process, so
//! each process is read until it exits and what it last said is kept.

use std::collections::BTreeMap;

/// The move metrics of one node's process, or summed over several.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct MoveMetrics {
    pub(crate) requests_held: u64,
    pub(crate) freezes_aborted: u64,
    /// `presenced_request_hold_seconds`: count per bucket bound (seconds, as printed).
    hold: Buckets,
    /// `presenced_move_freeze_seconds`.
    freeze: Buckets,
}

/// A histogram's cumulative counts by bucket bound, as the exporter prints them.
#[derive(Debug, Clone, Default, PartialEq)]
struct Buckets(BTreeMap<String, u64>);

impl Buckets {
    fn add(&mut self, other: &Buckets) {
        for (bound, count) in &other.0 {
            *self.0.entry(bound.clone()).or_default() += count;
        }
    }

    /// `(bound in ms, cumulative count)`, ascending, `+Inf` last.
    fn sorted(&self) -> Vec<(f64, u64)> {
        let mut sorted: Vec<(f64, u64)> =
            self.0.iter().map(|(bound, count)| (bound.parse::<f64>().unwrap_or(f64::INFINITY) * 1e3, *count)).collect();
        sorted.sort_by(|a, b| a.0.total_cmp(&b.0));
        sorted
    }

    /// How many observations.
    fn count(&self) -> u64 {
        self.sorted().last().map_or(0, |&(_, count)| count)
    }

    /// The bucket bound (ms) at or below which a `q` share of the observations fall.
    fn quantile_ms(&self, q: f64) -> f64 {
        let sorted = self.sorted();
        let total = sorted.last().map_or(0, |&(_, count)| count);
        if total == 0 {
            return 0.0;
        }
        let wanted = (q * total as f64).ceil() as u64;
        sorted.iter().find(|&&(_, count)| count >= wanted).map_or(f64::INFINITY, |&(bound, _)| bound)
    }
}

impl MoveMetrics {
    /// Reads the metrics page's move lines.
    pub(crate) fn parse(page: &str) -> MoveMetrics {
        let mut metrics = MoveMetrics::default();
        for line in page.lines().filter(|line| !line.starts_with('#')) {
            let Some((name, value)) = line.rsplit_once(' ') else { continue };
            let Ok(value) = value.parse::<f64>() else { continue };
            let value = value as u64;
            let bound = || name.split("le=\"").nth(1).and_then(|rest| rest.split('"').next()).map(str::to_owned);
            if name == "presenced_requests_held_total" {
                metrics.requests_held = value;
            } else if name == "presenced_move_freezes_aborted_total" {
                metrics.freezes_aborted = value;
            } else if name.starts_with("presenced_request_hold_seconds_bucket") {
                metrics.hold.0.insert(bound().unwrap_or_default(), value);
            } else if name.starts_with("presenced_move_freeze_seconds_bucket") {
                metrics.freeze.0.insert(bound().unwrap_or_default(), value);
            }
        }
        metrics
    }

    pub(crate) fn add(&mut self, other: &MoveMetrics) {
        self.requests_held += other.requests_held;
        self.freezes_aborted += other.freezes_aborted;
        self.hold.add(&other.hold);
        self.freeze.add(&other.freeze);
    }

    /// The held requests' wait, p50 and p99 (ms, bucket bounds).
    pub(crate) fn hold_ms(&self) -> [f64; 2] {
        [self.hold.quantile_ms(0.5), self.hold.quantile_ms(0.99)]
    }

    /// How many freezes, and how long: p50, p99, max (ms, bucket bounds).
    pub(crate) fn freezes(&self) -> (u64, [f64; 3]) {
        let freeze = &self.freeze;
        (freeze.count(), [freeze.quantile_ms(0.5), freeze.quantile_ms(0.99), freeze.quantile_ms(1.0)])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_page_is_read_and_two_processes_add_up() {
        let page = "# TYPE presenced_requests_held_total counter\n\
            presenced_requests_held_total 7\n\
            presenced_move_freezes_aborted_total 1\n\
            presenced_move_freeze_seconds_bucket{le=\"0.005\"} 1\n\
            presenced_move_freeze_seconds_bucket{le=\"0.01\"} 2\n\
            presenced_move_freeze_seconds_bucket{le=\"+Inf\"} 2\n\
            presenced_request_hold_seconds_bucket{le=\"0.005\"} 7\n\
            presenced_request_hold_seconds_bucket{le=\"+Inf\"} 7\n";
        let one = MoveMetrics::parse(page);
        assert_eq!((one.requests_held, one.freezes_aborted), (7, 1));
        assert_eq!(one.freezes(), (2, [5.0, 10.0, 10.0]));
        let mut both = one.clone();
        both.add(&one);
        assert_eq!(both.requests_held, 14);
        assert_eq!(both.freezes().0, 4);
        assert_eq!(both.hold_ms(), [5.0, 5.0]);
    }
}
