//! The store clock: the one place that reads time and turns it into ticks.
//!
//! Ticks are Unix milliseconds, so that a lease's deadline is also the
//! `expires_at_ms` the API returns, but they advance with the monotonic clock:
//! the wall clock is read once, at start, so a wall-clock step while running
//! never makes leases expire early or late.
//!
//! The monotonic clock is tokio's, so that a test on a paused runtime drives
//! the server's time (leases, expiry, the expiry driver's sleeps) exactly and
//! at full speed; outside such a test it is the system's monotonic clock.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use presence_core::Tick;
use tokio::time::Instant;

/// Converts between `Instant`s and store ticks.
#[derive(Debug, Clone, Copy)]
pub struct StoreClock {
    origin: Instant,
    origin_unix_ms: u64,
}

impl StoreClock {
    /// A clock reading the wall clock now and the monotonic clock from then on.
    pub fn start() -> Self {
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        StoreClock { origin: Instant::now(), origin_unix_ms: u64::try_from(unix.as_millis()).unwrap_or(u64::MAX) }
    }

    /// A clock that stays at `unix_ms` (for a year: its origin is that far
    /// ahead, and earlier instants count as the origin), so that a fuzzed
    /// input meets the same ticks, and so the same generations, each time.
    #[cfg(feature = "fuzzing")]
    pub(crate) fn frozen_at(unix_ms: u64) -> Self {
        StoreClock { origin: Instant::now() + Duration::from_secs(365 * 86_400), origin_unix_ms: unix_ms }
    }

    /// The current tick. Rounds down, so a deadline tick has fully passed when `now()` reaches it.
    pub fn now(&self) -> Tick {
        self.tick_at(Instant::now())
    }

    /// The tick of an instant.
    pub fn tick_at(&self, instant: Instant) -> Tick {
        let elapsed = instant.saturating_duration_since(self.origin);
        self.origin_unix_ms + u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
    }

    /// The instant at which `tick` begins.
    pub fn instant_at(&self, tick: Tick) -> Instant {
        self.origin + Duration::from_millis(tick.saturating_sub(self.origin_unix_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn ticks_follow_the_monotonic_clock_and_round_trip_with_instants() {
        let clock = StoreClock::start();
        let start = clock.now();
        let unix_now = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64;
        assert!(start.abs_diff(unix_now) < 60_000, "ticks are Unix milliseconds: {start} vs {unix_now}");
        tokio::time::advance(Duration::from_millis(1_234)).await;
        assert_eq!(clock.now(), start + 1_234, "a tick is a millisecond of the monotonic clock");
        tokio::time::advance(Duration::from_micros(999)).await;
        assert_eq!(clock.now(), start + 1_234, "rounded down");
        let tick = start + 5_000;
        assert_eq!(clock.tick_at(clock.instant_at(tick)), tick);
    }
}
