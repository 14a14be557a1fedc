//! One viewer's Watch stream (E3, E4, P3, P4).
//!
//! Order of operations is what makes the stream gap-free: subscribe first,
//! then read the snapshot, then forward only changes newer than what the
//! viewer holds. A change made before the snapshot is in it (and its late
//! delivery is dropped as not newer); a change made after it is published
//! after the subscription existed, so it reaches the mailbox. A resync repeats
//! the same steps on the live subscription: the mailbox was emptied before the
//! fresh snapshot is read, so again nothing falls between them.
//!
//! Batching: with a batch window, the stream waits that long after a change
//! becomes pending before it takes the mailbox, and sends what it took as one
//! `updates` event. Conflation and resyncs work as without it; the window only
//! decides how often the mailbox is emptied.
//!
//! Privacy: the subscription and the snapshot are made under the relations
//! lock, so the users hidden from the viewer in the mailbox are exactly those
//! hidden in the snapshot; from then on the mailbox keeps hidden users'
//! changes out, and changes of relations arrive as ordinary updates.

use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;
use presence_core::{CompactString, State};
use presence_proto::v1::{UserPresence, WatchEvent};
use tokio::sync::mpsc;
use tonic::Status;

use crate::context::Context;
use crate::error::ServiceError;
use crate::hub::{Delivery, Pending, PendingChanges, Subscription};
use crate::privacy::Shown;
use crate::wire;

/// Items the gRPC layer has not yet sent; the viewer's mailbox conflates the rest.
const STREAM_BUFFER: usize = 64;

/// The stream type the Watch RPC returns.
pub type WatchStream = tokio_stream::wrappers::ReceiverStream<Result<WatchEvent, Status>>;

/// Opens a watch of `user_ids` for `viewer` (`None`: a service acting for no
/// viewer) and spawns the task that feeds it; with a `batch_window`, changes
/// go out in batches gathered over that window.
pub(crate) async fn open(
    context: Arc<Context>,
    user_ids: Vec<CompactString>,
    viewer: Option<CompactString>,
    batch_window: Option<Duration>,
) -> Result<WatchStream, ServiceError> {
    let (subscription, shown) = context.privacy.subscribe(user_ids, context.watch_buffer, viewer.clone())?;
    let exact_activity = viewer.is_none();
    let (held, first) = snapshot_event(&context, &subscription, &shown, exact_activity).await?;
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tx.try_send(Ok(first)).expect("a new channel has room");
    tokio::spawn(async move {
        let _viewer = ViewerGauge::open(&context);
        forward(&context, &subscription, held, &tx, exact_activity, batch_window).await;
    });
    Ok(WatchStream::new(rx))
}

/// Counts an open Watch in the viewers gauge for as long as its task lives,
/// so a task dropped at runtime shutdown is counted out too.
struct ViewerGauge(metrics::Gauge);

impl ViewerGauge {
    fn open(context: &Context) -> Self {
        let gauge = context.metrics().viewers.clone();
        gauge.increment(1.0);
        ViewerGauge(gauge)
    }
}

impl Drop for ViewerGauge {
    fn drop(&mut self) {
        self.0.decrement(1.0);
    }
}

/// The snapshot event, and the versions the viewer holds once it has it
/// (0 for hidden users, as for users never seen).
async fn snapshot_event(
    context: &Context,
    subscription: &Subscription,
    shown: &[Shown],
    exact_activity: bool,
) -> Result<(HashMap<CompactString, u64>, WatchEvent), ServiceError> {
    let held = subscription
        .users()
        .iter()
        .zip(shown)
        .map(|(user_id, shown)| (user_id.clone(), if shown.visible { shown.view.presence.version } else { 0 }))
        .collect();
    let users = context.released(subscription.users(), shown, exact_activity).await?;
    Ok((held, wire::snapshot_event(users)))
}

/// The updates for changes taken from the mailbox, newer than what the viewer holds.
async fn updates(
    context: &Context,
    changes: PendingChanges,
    held: &mut HashMap<CompactString, u64>,
) -> Vec<UserPresence> {
    let fresh: Vec<(CompactString, Pending)> = changes
        .into_iter()
        .filter(|(user_id, pending)| {
            let version = pending.presence.version;
            match held.get_mut(user_id) {
                // Already delivered, or older than the snapshot.
                Some(shown) if version <= *shown => false,
                Some(shown) => {
                    *shown = version;
                    true
                }
                None => {
                    held.insert(user_id.clone(), version);
                    true
                }
            }
        })
        .collect();
    // Last seen travels with OFFLINE updates of users the viewer may see.
    let offline: Vec<&str> = fresh
        .iter()
        .filter(|(_, pending)| !pending.hidden && pending.presence.state == State::Offline)
        .map(|(user_id, _)| user_id.as_str())
        .collect();
    let active: HashMap<&str, u64> = match context.activity.last_active_at(&offline).await {
        Ok(active) => offline.iter().copied().zip(active).collect(),
        Err(err) => {
            tracing::warn!(%err, "cannot read activity; the updates go out without last seen");
            HashMap::new()
        }
    };
    fresh
        .iter()
        .map(|(user_id, pending)| {
            if pending.hidden {
                return wire::presence(user_id, pending.presence);
            }
            let shown = Shown {
                view: presence_core::UserView { presence: pending.presence, status: pending.status.clone() },
                visible: true,
            };
            let last_active_at = active.get(user_id.as_str()).copied().unwrap_or(0);
            wire::released(user_id, &context.privacy.release(&shown, last_active_at, false))
        })
        .collect()
}

/// Forwards the mailbox to the stream until the viewer leaves or the server shuts down.
async fn forward(
    context: &Context,
    subscription: &Subscription,
    mut held: HashMap<CompactString, u64>,
    tx: &mpsc::Sender<Result<WatchEvent, Status>>,
    exact_activity: bool,
    batch_window: Option<Duration>,
) {
    'stream: loop {
        tokio::select! {
            () = subscription.mailbox().ready() => {}
            () = tx.closed() => return,
            () = context.stopping.cancelled() => break 'stream,
        }
        if let Some(window) = batch_window {
            // Let the batch gather; changes that come meanwhile join it (the
            // mailbox keeps the wake-up permit, so nothing is lost by not waiting on it).
            tokio::select! {
                () = tokio::time::sleep(window) => {}
                () = tx.closed() => return,
                () = context.stopping.cancelled() => break 'stream,
            }
        }
        let mut delivered = 0;
        let events: Vec<WatchEvent> = match subscription.mailbox().take() {
            Delivery::Resync => match resync(context, subscription, exact_activity).await {
                Ok((fresh, event)) => {
                    context.metrics().resyncs.increment(1);
                    held = fresh;
                    vec![event]
                }
                Err(err) => {
                    let _ = tx.send(Err(err.into())).await;
                    return;
                }
            },
            Delivery::Changes(changes) => {
                let updates = updates(context, changes, &mut held).await;
                delivered = updates.len() as u64;
                wire::update_events(updates, batch_window.is_some())
            }
        };
        for event in events {
            tokio::select! {
                sent = tx.send(Ok(event)) => if sent.is_err() { return },
                () = context.stopping.cancelled() => break 'stream,
            }
        }
        context.metrics().watch_updates.increment(delivered);
    }
    let _ = tx.try_send(Err(ServiceError::ShuttingDown.into()));
}

/// A fresh snapshot for a viewer that fell behind (E4).
async fn resync(
    context: &Context,
    subscription: &Subscription,
    exact_activity: bool,
) -> Result<(HashMap<CompactString, u64>, WatchEvent), ServiceError> {
    let shown = context.privacy.resync(subscription)?;
    snapshot_event(context, subscription, &shown, exact_activity).await
}
