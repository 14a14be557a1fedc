//! What every request handler and background task of one server shares.

use std::sync::Arc;

use presence_core::{PresenceChange, Store};
use tokio_util::sync::CancellationToken;

use crate::activity::Activity;
use crate::clock::StoreClock;
use crate::hub::Hub;
use crate::metrics::Metrics;
use crate::settings::Settings;

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
    /// Users' last meaningful activity.
    pub(crate) activity: Arc<Activity>,
    /// Durable per-user settings.
    pub(crate) settings: Settings,
}

impl Context {
    /// The wire form of users' presence, with their last activity.
    pub(crate) async fn presences<S: AsRef<str>>(
        &self,
        user_ids: &[S],
        presences: &[presence_core::Presence],
    ) -> Result<Vec<presence_proto::v1::UserPresence>, tonic::Status> {
        let active = self.activity.last_active_at(user_ids).await.map_err(unavailable)?;
        Ok(user_ids
            .iter()
            .zip(presences)
            .zip(active)
            .map(|((user_id, presence), last_active_at)| {
                let mut wire = crate::ops::user_presence(user_id.as_ref(), *presence);
                wire.last_active_at_ms = i64::try_from(last_active_at).unwrap_or(i64::MAX);
                wire
            })
            .collect())
    }

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

/// A durable-store failure, as the caller sees it: retry later.
pub(crate) fn unavailable(err: crate::durable::DurableError) -> tonic::Status {
    tracing::error!(%err, "durable store failure");
    tonic::Status::unavailable(format!("{err}; nothing was changed, retry"))
}
