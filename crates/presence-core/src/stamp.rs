//! Generations and versions: hybrid stamps that never go back.
//!
//! Both a session's generation (L1) and a user's version (M3) must only ever
//! grow, also across a restart that lost the in-memory counters (M4). A bare
//! counter restarts at zero; a wall clock can repeat within a millisecond. A
//! stamp is both: the store time in milliseconds shifted left by
//! [`COUNTER_BITS`], or one more than the last stamp issued, whichever is
//! greater. While fewer than 2^20 stamps per millisecond are issued (a shard
//! issues far fewer), stamps stay within a millisecond of the clock, so a
//! restarted store whose clock reads later than at the crash issues stamps
//! greater than any it issued before. This assumes the store clock is Unix time
//! that does not step back across a restart by more than the stamps ran ahead.

use crate::wheel::Tick;

/// Low bits of a stamp that count within one millisecond.
pub const COUNTER_BITS: u32 = 20;

/// The largest store time a stamp can carry (about the year 2248 in Unix ms).
pub const MAX_TICK: Tick = u64::MAX >> (COUNTER_BITS + 1);

/// The largest stamp a checkpoint may carry. Stamps of ticks up to
/// [`MAX_TICK`] stay below it by 2^20 stamps per millisecond, and counting up
/// from it cannot overflow: a restored stamp above it is damage, never a
/// stamp this store issued.
pub const MAX_STAMP: u64 = u64::MAX >> 1;

/// Issues strictly increasing stamps.
#[derive(Debug, Clone, Default)]
pub struct StampClock {
    /// The last stamp issued; every later one is greater.
    last: u64,
}

impl StampClock {
    /// The last stamp issued.
    pub fn last(&self) -> u64 {
        self.last
    }

    /// Makes every later stamp greater than `stamp` (a restored checkpoint's,
    /// at most [`MAX_STAMP`]).
    pub fn raise_to(&mut self, stamp: u64) {
        debug_assert!(stamp <= MAX_STAMP, "a restored stamp {stamp} beyond any a store issues");
        self.last = self.last.max(stamp);
    }

    /// A stamp greater than every earlier one and not below `now`'s floor.
    pub fn next(&mut self, now: Tick) -> u64 {
        let floor = now.min(MAX_TICK) << COUNTER_BITS;
        self.last = floor.max(self.last + 1);
        self.last
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stamps_strictly_increase_within_and_across_milliseconds() {
        let mut clock = StampClock::default();
        let a = clock.next(1_000);
        let b = clock.next(1_000);
        let c = clock.next(999);
        let d = clock.next(1_001);
        assert!(a < b && b < c && c < d);
        assert_eq!(a, 1_000 << COUNTER_BITS);
        assert_eq!(d, 1_001 << COUNTER_BITS);
    }

    #[test]
    fn a_restarted_clock_issues_greater_stamps_than_before_the_restart() {
        let mut before = StampClock::default();
        let mut last = 0;
        for _ in 0..10_000 {
            last = before.next(5_000);
        }
        let mut after = StampClock::default();
        assert!(after.next(5_001) > last);
    }
}
