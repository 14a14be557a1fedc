//! Exponential backoff with full jitter, for reconnects and retries.
//!
//! A fleet of gateways restarted together must not come back in lockstep
//! (seed 000, "Two classic production failures"): every delay is drawn
//! uniformly from `[0, cap(attempt)]` ("full jitter"), where the cap grows by
//! `factor` per attempt up to `max`. This module only computes delays; it never
//! sleeps.

use std::time::Duration;

/// Exponential backoff with full jitter: attempt `n` waits a uniformly random
/// time in `[0, min(max, initial * factor^n)]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    /// The cap of the first attempt (attempt 0).
    pub initial: Duration,
    /// No delay is ever longer than this.
    pub max: Duration,
    /// How much the cap grows per attempt; values below 1 (or NaN) are taken as 1.
    pub factor: f64,
}

impl Default for Backoff {
    /// 50 ms, doubling, at most 5 s.
    fn default() -> Self {
        Backoff { initial: Duration::from_millis(50), max: Duration::from_secs(5), factor: 2.0 }
    }
}

impl Backoff {
    /// The longest delay of attempt `attempt` (0-based): `min(max, initial * factor^attempt)`.
    pub fn cap(&self, attempt: u32) -> Duration {
        let factor = if self.factor >= 1.0 { self.factor } else { 1.0 };
        let max = self.max.as_secs_f64();
        let exponent = i32::try_from(attempt).unwrap_or(i32::MAX);
        let grown = self.initial.as_secs_f64() * factor.powi(exponent);
        // `min` also absorbs an infinite product; `try_from` refuses what remains out of range.
        Duration::try_from_secs_f64(grown.min(max)).unwrap_or(self.max)
    }

    /// A delay for attempt `attempt` (0-based), drawn uniformly from `[0, cap(attempt)]`.
    pub fn delay(&self, attempt: u32) -> Duration {
        self.delay_at(attempt, fastrand::f64())
    }

    /// The delay at position `unit` (in `[0, 1]`) of attempt `attempt`'s range:
    /// `delay` with the randomness passed in, for tests.
    pub fn delay_at(&self, attempt: u32, unit: f64) -> Duration {
        let unit = if unit.is_nan() { 0.0 } else { unit.clamp(0.0, 1.0) };
        self.cap(attempt).mul_f64(unit)
    }
}

/// A uniformly random duration in `[0, span)` (or zero for an empty span): the
/// first-beat jitter that keeps sessions registered together from renewing in
/// lockstep.
pub(crate) fn jitter(span: Duration) -> Duration {
    span.mul_f64(fastrand::f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backoff() -> Backoff {
        Backoff { initial: Duration::from_millis(50), max: Duration::from_secs(5), factor: 2.0 }
    }

    #[test]
    fn cap_grows_by_the_factor_until_the_max() {
        let b = backoff();
        let caps: Vec<u128> = (0..10).map(|n| b.cap(n).as_millis()).collect();
        assert_eq!(caps, [50, 100, 200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    }

    #[test]
    fn cap_survives_huge_attempts_and_odd_factors() {
        let b = backoff();
        assert_eq!(b.cap(u32::MAX), b.max);
        assert_eq!(b.cap(10_000), b.max);
        let flat = Backoff { factor: 0.5, ..b };
        assert_eq!(flat.cap(7), b.initial, "a factor below 1 never shrinks the delay");
        let nan = Backoff { factor: f64::NAN, ..b };
        assert_eq!(nan.cap(7), b.initial);
        let tiny_max = Backoff { max: Duration::from_millis(10), ..b };
        assert_eq!(tiny_max.cap(0), Duration::from_millis(10), "max wins even over initial");
    }

    #[test]
    fn jittered_delays_stay_within_zero_and_the_cap() {
        let b = backoff();
        for attempt in 0..12 {
            let cap = b.cap(attempt);
            let mut low = cap;
            let mut high = Duration::ZERO;
            for _ in 0..2_000 {
                let delay = b.delay(attempt);
                assert!(delay <= cap, "attempt {attempt}: {delay:?} > {cap:?}");
                low = low.min(delay);
                high = high.max(delay);
            }
            // Full jitter spreads over the whole range, not just near the cap.
            assert!(low < cap / 10, "attempt {attempt}: lowest {low:?} of cap {cap:?}");
            assert!(high > cap * 9 / 10, "attempt {attempt}: highest {high:?} of cap {cap:?}");
        }
    }

    #[test]
    fn delay_at_maps_the_unit_interval_onto_the_range() {
        let b = backoff();
        assert_eq!(b.delay_at(3, 0.0), Duration::ZERO);
        assert_eq!(b.delay_at(3, 1.0), Duration::from_millis(400));
        assert_eq!(b.delay_at(3, 0.5), Duration::from_millis(200));
        assert_eq!(b.delay_at(3, 7.0), Duration::from_millis(400), "clamped");
        assert_eq!(b.delay_at(3, f64::NAN), Duration::ZERO);
    }

    #[test]
    fn first_beat_jitter_stays_below_the_span() {
        let span = Duration::from_millis(15);
        assert!((0..1_000).map(|_| jitter(span)).all(|d| d < span || span.is_zero()));
        assert_eq!(jitter(Duration::ZERO), Duration::ZERO);
    }
}
