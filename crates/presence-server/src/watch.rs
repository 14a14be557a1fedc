//! One viewer's Watch stream (E3).
//!
//! Order of operations is what makes the stream gap-free: subscribe first,
//! then read the snapshot, then forward only changes newer than what the
//! viewer holds. A change made before the snapshot is in it (and its late
//! delivery is dropped as not newer); a change made after it is published
//! after the subscription existed, so it reaches the mailbox.

use std::sync::Arc;

use hashbrown::HashMap;
use presence_core::{CompactString, Store};
use presence_proto::v1::{Snapshot, WatchEvent, watch_event};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::Status;

use crate::clock::StoreClock;
use crate::hub::{Hub, Subscription};
use crate::service::user_presence;

/// Items the gRPC layer has not yet sent; the viewer's mailbox conflates the rest.
const STREAM_BUFFER: usize = 64;

/// The stream type the Watch RPC returns.
pub type WatchStream = tokio_stream::wrappers::ReceiverStream<Result<WatchEvent, Status>>;

/// Opens a watch of `user_ids` and spawns the task that feeds it.
pub(crate) fn open(
    store: Arc<Store>,
    hub: Arc<Hub>,
    clock: StoreClock,
    user_ids: Vec<CompactString>,
    shutdown: CancellationToken,
) -> Result<WatchStream, Status> {
    presence_core::validate_user_ids(&user_ids).map_err(crate::status::status_of)?;
    let subscription = hub.subscribe(user_ids);
    let mut changes = Vec::new();
    let snapshot = store.snapshot(clock.now(), subscription.users(), &mut changes).map_err(crate::status::status_of)?;
    hub.publish_all(&changes);

    let held: HashMap<CompactString, u64> =
        subscription.users().iter().cloned().zip(snapshot.iter().map(|presence| presence.version)).collect();
    let first = WatchEvent {
        event: Some(watch_event::Event::Snapshot(Snapshot {
            users: subscription.users().iter().zip(&snapshot).map(|(id, p)| user_presence(id, *p)).collect(),
        })),
    };
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tx.try_send(Ok(first)).expect("a new channel has room");
    tokio::spawn(forward(subscription, held, tx, shutdown));
    Ok(WatchStream::new(rx))
}

/// Forwards the mailbox to the stream until the viewer leaves or the server shuts down.
async fn forward(
    subscription: Subscription,
    mut held: HashMap<CompactString, u64>,
    tx: mpsc::Sender<Result<WatchEvent, Status>>,
    shutdown: CancellationToken,
) {
    'stream: loop {
        tokio::select! {
            () = subscription.mailbox().ready() => {}
            () = tx.closed() => return,
            () = shutdown.cancelled() => break 'stream,
        }
        for (user_id, presence) in subscription.mailbox().take() {
            let version = held.entry(user_id.clone()).or_insert(0);
            if presence.version <= *version {
                continue; // already delivered, or older than the snapshot
            }
            *version = presence.version;
            let update = WatchEvent { event: Some(watch_event::Event::Update(user_presence(&user_id, presence))) };
            tokio::select! {
                sent = tx.send(Ok(update)) => if sent.is_err() { return },
                () = shutdown.cancelled() => break 'stream,
            }
        }
    }
    let _ = tx.try_send(Err(Status::unavailable("presenced is shutting down; reconnect and watch again")));
}
