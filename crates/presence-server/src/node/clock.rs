//! The store clock: the one place that reads time and turns it into ticks.
//!
//! Ticks are Unix milliseconds, so that a lease's deadline is also the
//! `expires_at_ms` the API returns, but they advance with the monotonic clock:
//! the wall clock is read once, at start, so a wall-clock step while running
//! never makes leases expire early or late.
//!
//! **Time the process did not run does not count (L4).** When the process is
//! stopped (SIGSTOP, a paused VM, a machine starved for seconds), no gateway
//! could renew, so counting that time against their leases would turn the
//! service's own pause into a mass OFFLINE, then a mass ONLINE as the gateways
//! re-register. The server reads the clock at least every [`KEEPALIVE`] (and
//! every request reads it too), so a gap of more than [`STALL`] between two
//! readings means the process was not running; the first reading after the
//! gap takes all of it but [`STALL`] out of store time. Leases then carry on
//! where they were and gateways renew as if nothing happened; and the server
//! holds online users for the restart grace, as after a restart, for gateways
//! slower to come back than their leases (`keep_reading`'s `after_stall`). The price: store
//! time (and so `last_seen_ms` and deadlines) runs behind the wall clock by the
//! total excluded, which each stall logs and `presenced_clock_stalled_ms_total`
//! counts; a restart reads the wall clock afresh.
//!
//! The monotonic clock is tokio's, so that a test on a paused runtime drives
//! the server's time (leases, expiry, the expiry driver's sleeps) exactly and
//! at full speed; outside such a test it is the system's monotonic clock.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use metrics::{Counter, counter};
use parking_lot::Mutex;
use presence_core::Tick;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

/// A gap between two readings longer than this is a stall: the process did not run.
pub(crate) const STALL: Duration = Duration::from_millis(1_000);
/// How often the server reads the clock when nothing else does, so that a quiet server is not taken for a stalled one.
pub(crate) const KEEPALIVE: Duration = Duration::from_millis(100);
/// A reading is recorded as the latest one only this much after the last, so that readings rarely write.
const RECORD_EVERY_MS: u64 = 10;

/// Converts between `Instant`s and store ticks, leaving out the time the process was stopped.
#[derive(Debug, Clone)]
pub(crate) struct StoreClock {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    origin: Instant,
    origin_unix_ms: u64,
    /// Milliseconds since `origin` at the latest recorded reading.
    last_read_ms: AtomicU64,
    /// Milliseconds since `origin` that store time leaves out: the stalls, each but [`STALL`].
    excluded_ms: AtomicU64,
    /// Serialises taking a stall out, the only writer of `excluded_ms`.
    stall: Mutex<()>,
    /// Stalls taken out so far.
    stalls_seen: AtomicU64,
    stalls: Counter,
    stalled_ms: Counter,
}

impl StoreClock {
    /// A clock reading the wall clock now and the monotonic clock from then on.
    pub(crate) fn start() -> Self {
        let unix = SystemTime::now().duration_since(UNIX_EPOCH).unwrap_or(Duration::ZERO);
        StoreClock::from(Instant::now(), u64::try_from(unix.as_millis()).unwrap_or(u64::MAX))
    }

    /// A clock whose tick is `origin_unix_ms` at `origin`.
    fn from(origin: Instant, origin_unix_ms: Tick) -> Self {
        StoreClock {
            inner: Arc::new(Inner {
                origin,
                origin_unix_ms,
                last_read_ms: AtomicU64::new(0),
                excluded_ms: AtomicU64::new(0),
                stall: Mutex::new(()),
                stalls_seen: AtomicU64::new(0),
                stalls: counter!(crate::metrics::names::CLOCK_STALLS),
                stalled_ms: counter!(crate::metrics::names::CLOCK_STALLED_MS),
            }),
        }
    }

    /// A clock that reads `tick` now, for the concurrency checker, whose
    /// store runs at ticks of the checker's choosing: the clock only moves
    /// with the real time a schedule takes, far less than any TTL.
    #[cfg(feature = "shuttle")]
    pub(crate) fn starting_at(tick: Tick) -> Self {
        StoreClock::from(Instant::now(), tick)
    }

    /// A clock that stays at `unix_ms` (for a year: its origin is that far
    /// ahead, and earlier instants count as the origin), so that a fuzzed
    /// input meets the same ticks, and so the same generations, each time.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn frozen_at(unix_ms: u64) -> Self {
        StoreClock::from(Instant::now() + Duration::from_secs(365 * 86_400), unix_ms)
    }

    /// The current tick. Rounds down, so a deadline tick has fully passed when `now()` reaches it.
    ///
    /// Ticks never go back, across threads too: a stall is taken out only down to
    /// [`STALL`] past the last reading before it, which no reading before it exceeds.
    pub(crate) fn now(&self) -> Tick {
        let inner = &*self.inner;
        loop {
            // `excluded_ms` is read first and checked again last: a stall taken out
            // meanwhile (it writes `excluded_ms` before `last_read_ms`) makes us read again.
            let excluded = inner.excluded_ms.load(Ordering::Acquire);
            let last = inner.last_read_ms.load(Ordering::Acquire);
            let elapsed = self.elapsed_ms(Instant::now());
            if elapsed > last + STALL.as_millis() as u64 {
                self.take_out_stall();
                continue;
            }
            if elapsed >= last + RECORD_EVERY_MS {
                inner.last_read_ms.fetch_max(elapsed, Ordering::AcqRel);
            }
            if inner.excluded_ms.load(Ordering::Acquire) == excluded {
                return inner.origin_unix_ms + (elapsed - excluded);
            }
        }
    }

    /// The instant at which `tick` begins, as things stand: a stall taken out later moves it later.
    pub(crate) fn instant_at(&self, tick: Tick) -> Instant {
        let excluded = self.inner.excluded_ms.load(Ordering::Acquire);
        self.inner.origin + Duration::from_millis(tick.saturating_sub(self.inner.origin_unix_ms) + excluded)
    }

    /// Stalls taken out of store time so far.
    pub(crate) fn stalls(&self) -> u64 {
        self.inner.stalls_seen.load(Ordering::Acquire)
    }

    /// Milliseconds left out of store time so far.
    #[cfg(test)]
    pub(crate) fn excluded(&self) -> Duration {
        Duration::from_millis(self.inner.excluded_ms.load(Ordering::Acquire))
    }

    fn elapsed_ms(&self, instant: Instant) -> u64 {
        u64::try_from(instant.saturating_duration_since(self.inner.origin).as_millis()).unwrap_or(u64::MAX)
    }

    /// Takes the gap since the last reading, all of it but [`STALL`], out of store time.
    #[cold]
    fn take_out_stall(&self) {
        let inner = &*self.inner;
        let _one_at_a_time = inner.stall.lock();
        let last = inner.last_read_ms.load(Ordering::Acquire);
        let elapsed = self.elapsed_ms(Instant::now());
        let Some(stalled) = elapsed.checked_sub(last + STALL.as_millis() as u64).filter(|&ms| ms > 0) else {
            return; // Another reader took it out first.
        };
        inner.excluded_ms.fetch_add(stalled, Ordering::AcqRel);
        inner.last_read_ms.fetch_max(elapsed, Ordering::AcqRel);
        inner.stalls_seen.fetch_add(1, Ordering::AcqRel);
        inner.stalls.increment(1);
        inner.stalled_ms.increment(stalled);
        tracing::warn!(
            stalled_ms = stalled,
            excluded_total_ms = inner.excluded_ms.load(Ordering::Relaxed),
            "the process did not run for {} ms (stopped, paused or starved); that time does not count against leases",
            stalled + STALL.as_millis() as u64,
        );
    }
}

/// Reads the clock every [`KEEPALIVE`] until `stop`, so that only a real stall
/// leaves a gap, and calls `after_stall` with the current tick once after each
/// stall it finds taken out (by this reading or any other).
pub(crate) async fn keep_reading(clock: StoreClock, stop: CancellationToken, after_stall: impl Fn(Tick)) {
    let mut every = tokio::time::interval(KEEPALIVE);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut stalls_seen = clock.stalls();
    loop {
        tokio::select! {
            _ = every.tick() => {}
            () = stop.cancelled() => return,
        }
        let now = clock.now();
        let stalls = clock.stalls();
        if stalls != stalls_seen {
            stalls_seen = stalls;
            after_stall(now);
        }
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
        tokio::time::advance(Duration::from_millis(734)).await;
        assert_eq!(clock.now(), start + 734, "a tick is a millisecond of the monotonic clock");
        tokio::time::advance(Duration::from_micros(999)).await;
        assert_eq!(clock.now(), start + 734, "rounded down");
        let tick = start + 5_000;
        assert_eq!(clock.instant_at(tick), clock.inner.origin + Duration::from_millis(5_000));
    }

    #[tokio::test(start_paused = true)]
    async fn l4_time_the_process_did_not_run_is_left_out_of_store_time() {
        let clock = StoreClock::start();
        let start = clock.now();
        // Read often, as the server does: nothing is left out.
        for _ in 0..30 {
            tokio::time::advance(Duration::from_millis(100)).await;
            clock.now();
        }
        assert_eq!(clock.now(), start + 3_000);
        assert_eq!(clock.excluded(), Duration::ZERO);
        // Stopped for 45 s: store time moves by the stall threshold only.
        tokio::time::advance(Duration::from_secs(45)).await;
        assert_eq!(clock.now(), start + 3_000 + STALL.as_millis() as u64);
        assert_eq!(clock.excluded(), Duration::from_secs(44));
        // And runs on normally afterwards, instants included.
        tokio::time::advance(Duration::from_millis(200)).await;
        let now = clock.now();
        assert_eq!(now, start + 4_200);
        assert_eq!(clock.instant_at(now), Instant::now());
    }

    #[tokio::test(start_paused = true)]
    async fn l4_a_gap_up_to_the_threshold_counts_in_full() {
        let clock = StoreClock::start();
        let start = clock.now();
        tokio::time::advance(STALL).await;
        assert_eq!(clock.now(), start + STALL.as_millis() as u64);
        assert_eq!(clock.excluded(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn the_keepalive_keeps_a_quiet_server_from_looking_stalled_and_reports_a_real_stall_once() {
        let clock = StoreClock::start();
        let start = clock.now();
        let stop = CancellationToken::new();
        let stalls = Arc::new(AtomicU64::new(0));
        let reader = tokio::spawn(keep_reading(clock.clone(), stop.clone(), {
            let stalls = Arc::clone(&stalls);
            move |_| {
                stalls.fetch_add(1, Ordering::Relaxed);
            }
        }));
        // Auto-advancing paused time: the keepalive's timer fires every 100 ms on the way.
        tokio::time::sleep(Duration::from_secs(60)).await;
        assert_eq!(clock.now(), start + 60_000);
        assert_eq!(clock.excluded(), Duration::ZERO);
        assert_eq!(stalls.load(Ordering::Relaxed), 0);
        // A real stall: the keepalive reports it once.
        tokio::time::advance(Duration::from_secs(30)).await;
        tokio::time::sleep(KEEPALIVE * 3).await;
        assert_eq!((clock.stalls(), stalls.load(Ordering::Relaxed)), (1, 1));
        stop.cancel();
        reader.await.unwrap();
    }

    #[test]
    fn ticks_never_go_back_across_threads() {
        let clock = StoreClock::start();
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let clock = clock.clone();
                std::thread::spawn(move || {
                    let mut last = 0;
                    for _ in 0..200_000 {
                        let now = clock.now();
                        assert!(now >= last, "{now} after {last}");
                        last = now;
                    }
                })
            })
            .collect();
        for thread in threads {
            thread.join().unwrap();
        }
    }
}
