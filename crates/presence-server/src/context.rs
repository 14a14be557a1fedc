//! What every request handler and background task of one server shares.

use std::sync::Arc;

use presence_core::{PresenceChange, Store};
use tokio_util::sync::CancellationToken;

use crate::clock::StoreClock;
use crate::hub::Hub;
use crate::metrics::Metrics;

/// The shared state of one running server.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) store: Arc<Store>,
    pub(crate) hub: Arc<Hub>,
    pub(crate) clock: StoreClock,
    pub(crate) metrics: Metrics,
    /// Most distinct users a viewer's mailbox holds before the viewer is resynced.
    pub(crate) watch_buffer: usize,
    /// Cancelled when the server shuts down: ends Watch and Leases streams.
    pub(crate) stopping: CancellationToken,
}

impl Context {
    /// Publishes flips to the viewers of this process, in order, and counts them.
    pub(crate) fn publish(&self, changes: &[PresenceChange]) {
        if changes.is_empty() {
            return;
        }
        let now = self.clock.now();
        for change in changes {
            let delivered = self.hub.publish(change);
            self.metrics.fanned_out.increment(delivered as u64);
            self.metrics.flip(change, now);
            tracing::debug!(
                user_id = %change.user_id,
                state = ?change.presence.state,
                version = change.presence.version,
                expired = change.deadline.is_some(),
                "flip"
            );
        }
    }
}
