//! One viewer's Watch stream (E3, E4).
//!
//! Order of operations is what makes the stream gap-free: subscribe first,
//! then read the snapshot, then forward only changes newer than what the
//! viewer holds. A change made before the snapshot is in it (and its late
//! delivery is dropped as not newer); a change made after it is published
//! after the subscription existed, so it reaches the mailbox. A resync repeats
//! the same steps on the live subscription: the mailbox was emptied before the
//! fresh snapshot is read, so again nothing falls between them.

use std::sync::Arc;

use hashbrown::HashMap;
use presence_core::{CompactString, Presence};
use presence_proto::v1::{Snapshot, WatchEvent, watch_event};
use tokio::sync::mpsc;
use tonic::Status;

use crate::context::Context;
use crate::hub::{Delivery, Subscription};
use crate::ops::user_presence;
use crate::status::status_of;

/// Items the gRPC layer has not yet sent; the viewer's mailbox conflates the rest.
const STREAM_BUFFER: usize = 64;

/// The stream type the Watch RPC returns.
pub type WatchStream = tokio_stream::wrappers::ReceiverStream<Result<WatchEvent, Status>>;

/// Opens a watch of `user_ids` and spawns the task that feeds it.
pub(crate) async fn open(context: Arc<Context>, user_ids: Vec<CompactString>) -> Result<WatchStream, Status> {
    presence_core::validate_user_ids(&user_ids).map_err(status_of)?;
    let subscription = context.hub.subscribe(user_ids, context.watch_buffer);
    let (held, first) = snapshot(&context, &subscription).await?;
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tx.try_send(Ok(first)).expect("a new channel has room");
    context.metrics.viewers.increment(1.0);
    tokio::spawn(async move {
        forward(&context, &subscription, held, &tx).await;
        context.metrics.viewers.decrement(1.0);
    });
    Ok(WatchStream::new(rx))
}

/// Reads the watched users' presence now: what the viewer will hold, and the event that shows it.
async fn snapshot(
    context: &Context,
    subscription: &Subscription,
) -> Result<(HashMap<CompactString, u64>, WatchEvent), Status> {
    let mut changes = Vec::new();
    let presences = context.store.snapshot(context.clock.now(), subscription.users(), &mut changes);
    context.publish(&changes);
    let presences: Vec<Presence> = presences.map_err(status_of)?;
    let held = subscription.users().iter().cloned().zip(presences.iter().map(|p| p.version)).collect();
    let users = context.presences(subscription.users(), &presences).await?;
    Ok((held, WatchEvent { event: Some(watch_event::Event::Snapshot(Snapshot { users })) }))
}

/// Forwards the mailbox to the stream until the viewer leaves or the server shuts down.
async fn forward(
    context: &Context,
    subscription: &Subscription,
    mut held: HashMap<CompactString, u64>,
    tx: &mpsc::Sender<Result<WatchEvent, Status>>,
) {
    'stream: loop {
        tokio::select! {
            () = subscription.mailbox().ready() => {}
            () = tx.closed() => return,
            () = context.stopping.cancelled() => break 'stream,
        }
        let events: Vec<WatchEvent> = match subscription.mailbox().take() {
            Delivery::Resync => match snapshot(context, subscription).await {
                Ok((fresh, event)) => {
                    context.metrics.resyncs.increment(1);
                    held = fresh;
                    vec![event]
                }
                Err(status) => {
                    let _ = tx.send(Err(status)).await;
                    return;
                }
            },
            Delivery::Changes(changes) => changes
                .into_iter()
                .filter_map(|(user_id, presence)| {
                    let version = held.entry(user_id.clone()).or_insert(0);
                    // Already delivered, or older than the snapshot.
                    (presence.version > *version).then(|| {
                        *version = presence.version;
                        WatchEvent { event: Some(watch_event::Event::Update(user_presence(&user_id, presence))) }
                    })
                })
                .collect(),
        };
        let updates = events.len() as u64;
        for event in events {
            tokio::select! {
                sent = tx.send(Ok(event)) => if sent.is_err() { return },
                () = context.stopping.cancelled() => break 'stream,
            }
        }
        context.metrics.watch_updates.increment(updates);
    }
    let _ = tx.try_send(Err(Status::unavailable("presenced is shutting down; reconnect and watch again")));
}
