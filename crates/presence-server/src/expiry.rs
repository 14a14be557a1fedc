//! The expiry driver: the task that turns the store's timer wheel into events (L4).
//!
//! It sleeps until the store's next deadline or until a request schedules an
//! earlier one, expires what is due in bounded batches (releasing each shard
//! lock between batches), and publishes the resulting flips. No polling scans.

use std::sync::Arc;

use presence_core::Store;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::clock::StoreClock;
use crate::hub::Hub;

/// Runs until `shutdown` is cancelled.
pub(crate) async fn run(
    store: Arc<Store>,
    hub: Arc<Hub>,
    clock: StoreClock,
    wake: Arc<Notify>,
    batch: usize,
    shutdown: CancellationToken,
) {
    let mut changes = Vec::new();
    loop {
        let more = store.expire(clock.now(), batch, &mut changes);
        hub.publish_all(&changes);
        for change in changes.drain(..) {
            tracing::debug!(user_id = %change.user_id, version = change.presence.version, "lease expiry flipped user offline");
        }
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
            () = shutdown.cancelled() => return,
        }
    }
}
