//! The expiry driver: the task that turns the store's timer wheel into events (L4).
//!
//! It sleeps until the store's next deadline or until a request schedules an
//! earlier one, expires what is due in bounded batches (releasing each shard
//! lock between batches), and publishes the resulting flips. No polling scans.

use std::sync::Arc;

use tokio::sync::Notify;

use crate::context::Context;

/// Runs until the server stops.
pub(crate) async fn run(context: Arc<Context>, wake: Arc<Notify>, batch: usize) {
    let store = context.store();
    let clock = context.publisher.clock;
    loop {
        let more = context.apply(|store, now, changes| store.expire(now, batch, changes));
        if more {
            // Let request handlers at the shards between two batches of a mass expiry.
            tokio::task::yield_now().await;
            continue;
        }
        // Any deadline scheduled while we look for the next one must wake us.
        store.set_alarm(u64::MAX);
        let next = store.next_deadline();
        store.set_alarm(next.unwrap_or(u64::MAX));
        let sleep = async {
            match next {
                Some(tick) => tokio::time::sleep_until(clock.instant_at(tick).into()).await,
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
