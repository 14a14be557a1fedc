//! The expiry driver: the task that turns the store's timer wheel into events (L4).
//!
//! It sleeps until the store's next deadline or until a request schedules an
//! earlier one, expires what is due in bounded batches (releasing each shard
//! lock between batches), and publishes the resulting flips. No polling scans.
//!
//! The store forgets users through the same wheel (B6), and after a large
//! forget the driver asks glibc's malloc to hand the freed memory back to the
//! operating system: the store shrinks its tables, but malloc keeps most freed
//! heap pages mapped until trimmed (presence-core's `forget_memory` bench: 10M
//! users forgotten left RSS at 2x the start, 0.94x after a trim).

use std::sync::Arc;

use presence_core::{Store, Tick};
use tokio::sync::Notify;

use crate::node::context::Context;

/// Users forgotten after which the driver trims the allocator: a few MiB of
/// records, worth a trim (measured: 1.2 ms after 1M users forgotten, 54 ms
/// after 10M, which is why it runs on a blocking thread).
const TRIM_AFTER_FORGOTTEN: u64 = 65_536;

/// Says when enough users were forgotten since the last trim.
#[derive(Debug)]
struct TrimAfterForgetting {
    /// The store's count of forgotten users at the last trim.
    at_last_trim: u64,
}

impl TrimAfterForgetting {
    /// Whether to trim now that `forgotten` users were forgotten since the start.
    fn due(&mut self, forgotten: u64) -> bool {
        let due = forgotten - self.at_last_trim >= TRIM_AFTER_FORGOTTEN;
        if due {
            self.at_last_trim = forgotten;
        }
        due
    }
}

/// Hands freed heap memory back to the operating system, on a blocking thread
/// (a trim walks the allocator's arenas under their locks).
fn release_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    drop(tokio::task::spawn_blocking(|| {
        // SAFETY: malloc_trim has no preconditions; it takes only malloc's own locks.
        unsafe { libc::malloc_trim(0) };
    }));
}

/// Tells the store when the driver, about to sleep, will wake next, and
/// returns that time (`None`: only when woken). Any deadline scheduled while
/// it looks for the next one must wake it, hence the alarm set to wake on
/// every new deadline first.
pub(crate) fn arm(store: &Store) -> Option<Tick> {
    store.set_alarm(u64::MAX);
    let next = store.next_deadline();
    store.set_alarm(next.unwrap_or(u64::MAX));
    next
}

/// Runs until the server stops.
pub(crate) async fn run(context: Arc<Context>, wake: Arc<Notify>, batch: usize) {
    let store = context.store();
    let clock = context.publisher.clock.clone();
    let mut trim = TrimAfterForgetting { at_last_trim: store.forgotten_users() };
    loop {
        let more = context.apply(|store, now, changes| store.expire(now, batch, changes));
        if more {
            // Let request handlers at the shards between two batches of a mass expiry.
            tokio::task::yield_now().await;
            continue;
        }
        if trim.due(store.forgotten_users()) {
            release_freed_memory();
        }
        let next = arm(store);
        let sleep = async {
            match next {
                Some(tick) => tokio::time::sleep_until(clock.instant_at(tick)).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            () = sleep => {}
            () = wake.notified() => {}
            () = context.stopping.cancelled() => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use presence_core::{Registration, State, Store, StoreConfig};
    use tokio_util::sync::CancellationToken;

    use crate::node::clock::StoreClock;
    use crate::node::context::NodeConfig;
    use crate::node::hub::Delivery;

    /// Seed 000's timeline 2 on the server's own clock, paused: the last
    /// device heartbeats, then dies silently right after a beat. The OFFLINE
    /// is published by the expiry driver at the lease's deadline to the
    /// millisecond, never before, and it is the only event.
    #[tokio::test(start_paused = true)]
    async fn l4_the_expiry_driver_publishes_offline_at_the_deadline_to_the_millisecond() {
        const TTL_MS: u32 = 300;
        let clock = StoreClock::start();
        let wake = Arc::new(Notify::new());
        let config = StoreConfig { min_renew_interval_ms: 0, min_ttl_ms: 20, ..StoreConfig::default() };
        let store = Store::new(config, clock.now()).unwrap().with_expiry_waker({
            let wake = Arc::clone(&wake);
            move || wake.notify_one()
        });
        let stopping = CancellationToken::new();
        let context =
            Arc::new(Context::new(Arc::new(store), clock, None, None, &NodeConfig::default(), stopping.clone()));
        let driver = tokio::spawn(run(Arc::clone(&context), wake, 1_024));
        let (viewer, _) = context.privacy.subscribe(vec!["u42".into()], 16, None).unwrap();

        let laptop =
            Registration { user_id: "u42", session_id: "laptop", gateway_id: "gw", ttl_ms: TTL_MS, metadata: &[] };
        let registered = context.apply(|store, now, changes| store.register(now, &laptop, changes)).unwrap();
        let mut deadline = registered.expires_at;
        for _ in 0..5 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let renewed = context
                .apply(|store, now, changes| store.renew(now, "u42", "laptop", registered.generation, TTL_MS, changes))
                .unwrap();
            assert_eq!(renewed.expires_at, context.now() + u64::from(TTL_MS));
            deadline = renewed.expires_at;
        }
        let Delivery::Changes(online) = viewer.mailbox().take() else { panic!("no resync expected") };
        assert_eq!(online.iter().map(|(_, p)| p.presence.state).collect::<Vec<_>>(), [State::Online]);

        // The network drops now: nothing renews any more.
        let offline = loop {
            viewer.mailbox().ready().await; // a wake-up may be left over from the ONLINE
            match viewer.mailbox().take() {
                Delivery::Changes(changes) if changes.is_empty() => continue,
                Delivery::Changes(changes) => break changes,
                Delivery::Resync => panic!("no resync expected"),
            }
        };
        assert_eq!(context.now(), deadline, "published at the deadline, not a millisecond later or earlier");
        let offline: Vec<_> = offline.iter().map(|(_, p)| (p.presence.state, p.presence.version)).collect();
        assert_eq!(offline.len(), 1, "one event for the expiry: {offline:?}");
        assert_eq!(offline[0].0, State::Offline);
        assert!(offline[0].1 > registered.presence.version);

        tokio::time::sleep(Duration::from_secs(60)).await;
        assert!(matches!(viewer.mailbox().take(), Delivery::Changes(rest) if rest.is_empty()), "nothing else");
        stopping.cancel();
        driver.await.unwrap();
    }

    #[test]
    fn b6_the_allocator_is_trimmed_once_per_large_forget() {
        let mut trim = TrimAfterForgetting { at_last_trim: 10 };
        assert!(!trim.due(10));
        assert!(!trim.due(10 + TRIM_AFTER_FORGOTTEN - 1));
        assert!(trim.due(10 + TRIM_AFTER_FORGOTTEN));
        assert!(!trim.due(10 + TRIM_AFTER_FORGOTTEN + 1), "counted from the last trim");
        assert!(trim.due(10 + 3 * TRIM_AFTER_FORGOTTEN));
    }
}
