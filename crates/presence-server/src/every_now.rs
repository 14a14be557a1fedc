//! A warning logged at most once per period: a flood of one event (refused
//! connections, refused handshakes, refused certificates) logs a line a
//! period with its count, not a line an event.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// A warning logged at most once per period, with how many times it
/// happened since the last one: a flood of the same event logs a line a
/// period, not a line an event.
#[derive(Debug)]
pub(crate) struct EveryNow {
    period: Duration,
    last: parking_lot::Mutex<Option<std::time::Instant>>,
    unlogged: AtomicU64,
}

impl EveryNow {
    pub(crate) fn new(period: Duration) -> Self {
        EveryNow { period, last: parking_lot::Mutex::new(None), unlogged: AtomicU64::new(0) }
    }

    /// Notes one more event; `Some(how many since the last line)` when it is
    /// time to log one.
    pub(crate) fn note(&self) -> Option<u64> {
        self.unlogged.fetch_add(1, Ordering::Relaxed);
        let mut last = self.last.lock();
        let now = std::time::Instant::now();
        if last.is_some_and(|at| now.duration_since(at) < self.period) {
            return None;
        }
        *last = Some(now);
        Some(self.unlogged.swap(0, Ordering::Relaxed))
    }
}
