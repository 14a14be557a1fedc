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
use presence_proto::v1::{Snapshot, UpdateBatch, UserPresence, WatchEvent, watch_event};
use tokio::sync::mpsc;
use tonic::Status;

use crate::context::{Context, Shown, unavailable};
use crate::hub::{Delivery, Pending, PendingChanges, Subscription};
use crate::ops::user_presence;
use crate::status::status_of;

/// Items the gRPC layer has not yet sent; the viewer's mailbox conflates the rest.
const STREAM_BUFFER: usize = 64;

/// The longest batch window a viewer may ask for: a second is already a visibly late dot.
pub(crate) const MAX_BATCH_WINDOW_MS: u32 = 1_000;

/// The batch window a Watch request asks for (`None`: one event per change).
pub(crate) fn batch_window(batch_window_ms: u32) -> Result<Option<Duration>, Status> {
    match batch_window_ms {
        0 => Ok(None),
        ms if ms <= MAX_BATCH_WINDOW_MS => Ok(Some(Duration::from_millis(u64::from(ms)))),
        ms => Err(Status::invalid_argument(format!(
            "batch_window_ms: {ms} is longer than the limit of {MAX_BATCH_WINDOW_MS} ms"
        ))),
    }
}

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
) -> Result<WatchStream, Status> {
    presence_core::validate_user_ids(&user_ids).map_err(status_of)?;
    let (subscription, shown) = {
        let relations = context.relations.read();
        let lens = relations.lens(viewer.as_deref());
        let subscription =
            context.hub.subscribe(user_ids, context.watch_buffer, viewer.clone(), |user| !lens.can_see(user));
        let shown = read(&context, &subscription)?;
        (subscription, shown)
    };
    let exact_activity = viewer.is_none();
    let (held, first) = snapshot_event(&context, &subscription, &shown, exact_activity).await?;
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tx.try_send(Ok(first)).expect("a new channel has room");
    context.metrics.viewers.increment(1.0);
    tokio::spawn(async move {
        forward(&context, &subscription, held, &tx, exact_activity, batch_window).await;
        context.metrics.viewers.decrement(1.0);
    });
    Ok(WatchStream::new(rx))
}

/// Reads the watched users as the mailbox's viewer may see them. The caller
/// holds the relations lock, so the mailbox's hidden set is current.
fn read(context: &Context, subscription: &Subscription) -> Result<Vec<Shown>, Status> {
    let mut changes = Vec::new();
    let views = context.store.view(context.clock.now(), subscription.users(), &mut changes);
    context.publish(&changes);
    let views = views.map_err(status_of)?;
    let mailbox = subscription.mailbox();
    Ok(subscription
        .users()
        .iter()
        .zip(views)
        .map(|(user_id, view)| Shown { visible: !mailbox.is_hidden(user_id), view })
        .collect())
}

/// The snapshot event, and the versions the viewer holds once it has it
/// (0 for hidden users, as for users never seen).
async fn snapshot_event(
    context: &Context,
    subscription: &Subscription,
    shown: &[Shown],
    exact_activity: bool,
) -> Result<(HashMap<CompactString, u64>, WatchEvent), Status> {
    let held = subscription
        .users()
        .iter()
        .zip(shown)
        .map(|(user_id, shown)| (user_id.clone(), if shown.visible { shown.view.presence.version } else { 0 }))
        .collect();
    let users = context.wire(subscription.users(), shown, exact_activity).await?;
    Ok((held, WatchEvent { event: Some(watch_event::Event::Snapshot(Snapshot { users })) }))
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
            let _ = unavailable(err); // logged; the updates go out without last seen
            HashMap::new()
        }
    };
    fresh
        .iter()
        .map(|(user_id, pending)| {
            if pending.hidden {
                user_presence(user_id, pending.presence)
            } else {
                let view = presence_core::UserView { presence: pending.presence, status: pending.status.clone() };
                context.visible_wire(user_id, &view, active.get(user_id.as_str()).copied().unwrap_or(0), false)
            }
        })
        .collect()
}

/// The events that carry `updates`: one each, or all in one batch.
fn update_events(updates: Vec<UserPresence>, batched: bool) -> Vec<WatchEvent> {
    if batched {
        if updates.is_empty() {
            return Vec::new();
        }
        return vec![WatchEvent { event: Some(watch_event::Event::Updates(UpdateBatch { users: updates })) }];
    }
    updates.into_iter().map(|update| WatchEvent { event: Some(watch_event::Event::Update(update)) }).collect()
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
            Delivery::Resync => {
                let shown = {
                    let _relations = context.relations.read();
                    read(context, subscription)
                };
                match shown {
                    Ok(shown) => match snapshot_event(context, subscription, &shown, exact_activity).await {
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
                    Err(status) => {
                        let _ = tx.send(Err(status)).await;
                        return;
                    }
                }
            }
            Delivery::Changes(changes) => {
                let updates = updates(context, changes, &mut held).await;
                delivered = updates.len() as u64;
                update_events(updates, batch_window.is_some())
            }
        };
        for event in events {
            tokio::select! {
                sent = tx.send(Ok(event)) => if sent.is_err() { return },
                () = context.stopping.cancelled() => break 'stream,
            }
        }
        context.metrics.watch_updates.increment(delivered);
    }
    let _ = tx.try_send(Err(Status::unavailable("presenced is shutting down; reconnect and watch again")));
}
