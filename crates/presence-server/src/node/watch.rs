//! One viewer's Watch stream (E3, E4, E7, E8, P3, P4).
//!
//! Order of operations is what makes the stream gap-free: subscribe first,
//! then read the snapshot, then forward only changes newer than what the
//! viewer holds. A change made before the snapshot is in it (and its late
//! delivery is dropped as not newer); a change made after it is published
//! after the subscription existed, so it reaches the mailbox. A resync repeats
//! the same steps on the live subscription: the mailbox was emptied before the
//! fresh snapshot is read, so again nothing falls between them. The versions
//! the viewer holds live in its mailbox, which drops what is not newer.
//!
//! Changing the watched set (E7) follows the same order, for the added users
//! only, and is done by the stream's own task: `UpdateWatch` hands it the
//! change and waits for it, so the `added` event goes out after every update
//! taken before the change and before any update of an added user. Removed
//! users leave their topics before their slots empty, so nothing of them
//! arrives afterwards; users that stay keep their slots and lose nothing.
//!
//! Resume (E8): with `known_versions`, the opening snapshot leaves out every
//! user whose version, as this viewer may see it, is the one the viewer says
//! it holds. A hidden user is seen at version 0, exactly as a user never seen
//! (P3), so leaving it out or sending it tells nothing a user never seen would not.
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

use bytes::Bytes;
use futures_util::future::BoxFuture;
use hashbrown::HashMap;
use presence_core::{CompactString, State};
use presence_proto::prepared::WatchFrame;
use presence_proto::v1::WatchEvent;
use tokio::sync::{mpsc, oneshot};
use tonic::Status;

use crate::error::ServiceError;
use crate::metrics::OpenGauge;
use crate::node::context::Context;
use crate::node::hub::{Delivery, Pending, PendingChanges, Subscription};
use crate::node::privacy::Shown;
use crate::node::watches::{UpdateRequest, WatchUpdate};
use crate::node::wire::{self, MAX_USERS_PER_REQUEST};

/// Items the gRPC layer has not yet sent; the viewer's mailbox conflates the rest.
const STREAM_BUFFER: usize = 64;

/// The stream type the Watch RPC returns: a viewer's stream, or, through a
/// cluster, streams merged in place (`cluster/fanin.rs`).
pub(crate) type WatchStream = std::pin::Pin<Box<dyn tokio_stream::Stream<Item = Result<WatchFrame, Status>> + Send>>;

/// What a Watch is opened with.
#[derive(Debug)]
pub(crate) struct WatchOptions {
    /// Who it is for; `None`: a service acting for no viewer.
    pub(crate) viewer: Option<CompactString>,
    /// With a window, changes go out in batches gathered over it.
    pub(crate) batch_window: Option<Duration>,
    /// The versions the viewer holds (E8).
    pub(crate) known_versions: HashMap<CompactString, u64>,
}

/// Users read for a Watch, in order, with how each is shown.
pub(crate) type ReadUsers = (Vec<CompactString>, Vec<Shown>);

/// A new subscription, and how its users are shown, by slot.
pub(crate) type Subscribed = (Subscription, Vec<Shown>);

/// Where a Watch reads the users it shows and follows their changes: this
/// node's store and relations (`Context`), or, at a cluster node, the relay
/// of other nodes' users (`cluster/relay.rs`). Each reads under whatever
/// keeps its mailbox's hidden marks and what it reads in step (P3, P4).
pub(crate) trait WatchSource: Send + Sync {
    /// Subscribes a mailbox of `capacity` users for `viewer` (`None`: a
    /// service acting for no viewer) to `users`, and reads them as the
    /// viewer may see them: the users subscribed, in order, with how each is
    /// shown. Changes published after the read reach the mailbox.
    fn subscribe(
        &self,
        users: Vec<CompactString>,
        capacity: usize,
        viewer: Option<CompactString>,
    ) -> BoxFuture<'_, Result<Subscribed, ServiceError>>;

    /// Reads a subscription's users again for a resync (E4).
    fn resync<'a>(&'a self, subscription: &'a Subscription) -> BoxFuture<'a, Result<ReadUsers, ServiceError>>;

    /// Adds users to an open subscription (E7) and reads them: the users
    /// added, with how each is shown.
    fn add<'a>(
        &'a self,
        subscription: &'a Subscription,
        users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<ReadUsers, ServiceError>>;

    /// Each of `users`' last activity (store ms; 0: none known).
    fn last_active_at<'a>(&'a self, users: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<u64>, ServiceError>>;
}

impl WatchSource for Context {
    fn subscribe(
        &self,
        users: Vec<CompactString>,
        capacity: usize,
        viewer: Option<CompactString>,
    ) -> BoxFuture<'_, Result<Subscribed, ServiceError>> {
        Box::pin(std::future::ready(self.privacy.subscribe(users, capacity, viewer)))
    }

    fn resync<'a>(&'a self, subscription: &'a Subscription) -> BoxFuture<'a, Result<ReadUsers, ServiceError>> {
        Box::pin(std::future::ready(self.privacy.resync(subscription)))
    }

    fn add<'a>(
        &'a self,
        subscription: &'a Subscription,
        users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<ReadUsers, ServiceError>> {
        Box::pin(std::future::ready(self.privacy.add(subscription, users)))
    }

    fn last_active_at<'a>(&'a self, users: &'a [&'a str]) -> BoxFuture<'a, Result<Vec<u64>, ServiceError>> {
        Box::pin(async move { Ok(self.activity.last_active_at(users).await?) })
    }
}

/// Opens a watch of `user_ids`, this node's, and spawns the task that feeds it.
pub(crate) async fn open(
    context: Arc<Context>,
    user_ids: Vec<CompactString>,
    options: WatchOptions,
) -> Result<WatchStream, ServiceError> {
    let source: Arc<dyn WatchSource> = Arc::clone(&context) as Arc<dyn WatchSource>;
    open_from(context, source, user_ids, options).await
}

/// Opens a watch of `user_ids` read from `source`, and spawns the task that feeds it.
pub(crate) async fn open_from(
    context: Arc<Context>,
    source: Arc<dyn WatchSource>,
    user_ids: Vec<CompactString>,
    options: WatchOptions,
) -> Result<WatchStream, ServiceError> {
    let WatchOptions { viewer, batch_window, known_versions } = options;
    let (subscription, shown) = source.subscribe(user_ids, context.watch_buffer, viewer.clone()).await?;
    let exact_activity = viewer.is_none();
    let (registration, updates) = context.watches.register(viewer);
    let users = subscription.users();
    let mut first =
        snapshot_event(&context, &*source, &subscription, &users, &shown, exact_activity, &known_versions).await?;
    wire::set_watch_id(&mut first, &registration.id);
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tx.try_send(Ok(first.into())).expect("a new channel has room");
    tokio::spawn(async move {
        let _viewer = OpenGauge::open(&context.metrics().viewers);
        let stream = Stream {
            context: &context,
            source: &*source,
            subscription: &subscription,
            tx: &tx,
            exact_activity,
            batch_window,
        };
        stream.forward(updates, &registration.id).await;
    });
    Ok(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx)))
}

/// A snapshot event of `users` (shown as `shown`), leaving out those whose
/// version as shown is the one `known` gives; the mailbox records what the
/// viewer then holds (0 for hidden users, as for users never seen).
async fn snapshot_event(
    context: &Context,
    source: &dyn WatchSource,
    subscription: &Subscription,
    users: &[CompactString],
    shown: &[Shown],
    exact_activity: bool,
    known: &HashMap<CompactString, u64>,
) -> Result<WatchEvent, ServiceError> {
    hold(subscription, users, shown);
    let (sent_users, sent): (Vec<CompactString>, Vec<Shown>) = users
        .iter()
        .zip(shown)
        .filter(|(user_id, shown)| known.get(*user_id) != Some(&seen(shown)))
        .map(|(user_id, shown)| (user_id.clone(), shown.clone()))
        .unzip();
    let partial = sent_users.len() < users.len();
    // Activity is looked up only for users the caller may see.
    let visible: Vec<&str> =
        sent_users.iter().zip(&sent).filter(|(_, shown)| shown.visible).map(|(id, _)| id.as_str()).collect();
    let active: HashMap<&str, u64> = visible.iter().copied().zip(source.last_active_at(&visible).await?).collect();
    let released = sent_users
        .iter()
        .zip(&sent)
        .map(|(user_id, shown)| {
            let last_active_at = active.get(user_id.as_str()).copied().unwrap_or(0);
            wire::released(user_id, &context.privacy.release(shown, last_active_at, exact_activity))
        })
        .collect();
    Ok(wire::snapshot_event(released, partial))
}

/// The version the viewer holds of a user shown as `shown`: 0 for a hidden
/// user, as for a user never seen.
fn seen(shown: &Shown) -> u64 {
    if shown.visible { shown.view.presence.version } else { 0 }
}

/// Records in the mailbox what a snapshot of `users` (shown as `shown`) gives
/// the viewer, before the snapshot goes out and before anything is taken from
/// the mailbox: what it holds pending that is not newer is dropped (E3).
pub(crate) fn hold(subscription: &Subscription, users: &[CompactString], shown: &[Shown]) {
    subscription.mailbox().hold(users, shown.iter().map(seen));
}

/// The encoded update events for changes taken from the mailbox: a change
/// another viewer was sent already is copied from its encoding (E5).
async fn updates(context: &Context, source: &dyn WatchSource, changes: PendingChanges) -> Vec<Bytes> {
    // Last seen travels with OFFLINE updates of users the viewer may see,
    // read for the changes not encoded yet.
    let offline: Vec<&str> = changes
        .iter()
        .filter(|(_, pending)| !pending.hidden && pending.presence.state == State::Offline)
        .filter(|(_, pending)| pending.encoded.as_ref().is_none_or(|encoded| encoded.get().is_none()))
        .map(|(user_id, _)| user_id.as_str())
        .collect();
    let active: HashMap<&str, u64> = if offline.is_empty() {
        HashMap::new()
    } else {
        match source.last_active_at(&offline).await {
            Ok(active) => offline.iter().copied().zip(active).collect(),
            Err(err) => {
                tracing::warn!(%err, "cannot read activity; the updates go out without last seen");
                HashMap::new()
            }
        }
    };
    changes
        .iter()
        .map(|(user_id, pending)| {
            if pending.hidden {
                return wire::update_event(&wire::presence(user_id, pending.presence));
            }
            let encode = || {
                let last_active_at = active.get(user_id.as_str()).copied().unwrap_or(0);
                // Released as to any viewer: what a viewer is shown of a user it
                // may see does not depend on the viewer (P5's coarse last seen included).
                wire::update_event(&wire::released(
                    user_id,
                    &context.privacy.release(&shown(pending), last_active_at, false),
                ))
            };
            match &pending.encoded {
                Some(encoded) => encoded.get_or_init(encode).clone(),
                None => encode(),
            }
        })
        .collect()
}

/// A visible user's pending change, as shown.
fn shown(pending: &Pending) -> Shown {
    Shown {
        view: presence_core::UserView { presence: pending.presence, status: pending.status.clone() },
        visible: true,
    }
}

/// The next delivery tick after now: a multiple of `tick` (the server's
/// `--watch-delivery-tick-ms`, not zero) since `epoch`, the same instant for
/// every stream of the process.
fn next_delivery_tick(epoch: std::time::Instant, tick: Duration) -> tokio::time::Instant {
    let epoch = tokio::time::Instant::from_std(epoch);
    let since = tokio::time::Instant::now().saturating_duration_since(epoch);
    let tick = tick.as_nanos();
    epoch + Duration::from_nanos(u64::try_from((since.as_nanos() / tick + 1) * tick).unwrap_or(u64::MAX))
}

/// What feeds one Watch stream.
struct Stream<'a> {
    context: &'a Context,
    source: &'a dyn WatchSource,
    subscription: &'a Subscription,
    tx: &'a mpsc::Sender<Result<WatchFrame, Status>>,
    exact_activity: bool,
    batch_window: Option<Duration>,
}

/// Why a stream's task stops.
enum End {
    /// The viewer left.
    Gone,
    /// The server is shutting down: the viewer is told so.
    Stopping,
}

impl Stream<'_> {
    /// Forwards the mailbox (and applies `UpdateWatch` changes) until the
    /// viewer leaves or the server shuts down.
    async fn forward(&self, mut updates: mpsc::Receiver<UpdateRequest>, watch_id: &str) {
        let mut last_delivery = tokio::time::Instant::now() - self.context.watch_delivery_tick;
        let end = loop {
            tokio::select! {
                () = self.subscription.mailbox().ready() => {}
                Some((update, reply)) = updates.recv() => match self.change(update, reply).await {
                    Ok(()) => continue,
                    Err(end) => break end,
                },
                () = self.tx.closed() => break End::Gone,
                () = self.context.stopping.cancelled() => break End::Stopping,
            }
            // Let the batch gather; changes that come meanwhile join it (the
            // mailbox keeps the wake-up permit, so nothing is lost by not waiting
            // on it). Without a window, a stream that delivered within the last
            // tick waits for the next delivery tick, which every stream of this
            // process shares: under load the streams of one connection then hand
            // it their changes in one turn of its thread, and it writes them with
            // one system call, not one per stream (E5). A change after a quiet
            // tick goes out at once.
            let tick = self.context.watch_delivery_tick;
            let gathered = match self.batch_window {
                Some(window) => Some(tokio::time::Instant::now() + window),
                None if last_delivery.elapsed() < tick => Some(next_delivery_tick(self.context.started, tick)),
                None => None,
            };
            if let Some(gathered) = gathered {
                tokio::select! {
                    () = tokio::time::sleep_until(gathered) => {}
                    () = self.tx.closed() => break End::Gone,
                    () = self.context.stopping.cancelled() => break End::Stopping,
                }
            }
            last_delivery = tokio::time::Instant::now();
            if let Err(end) = self.deliver(watch_id).await {
                break end;
            }
        };
        if let End::Stopping = end {
            let _ = self.tx.try_send(Err(ServiceError::ShuttingDown.into()));
        }
    }

    /// Sends what the mailbox holds: changes, or a resync.
    async fn deliver(&self, watch_id: &str) -> Result<(), End> {
        let context = self.context;
        let mut delivered = 0;
        let frames: Vec<WatchFrame> = match self.subscription.mailbox().take() {
            Delivery::Resync => match self.resync(watch_id).await {
                Ok(event) => {
                    context.metrics().resyncs.increment(1);
                    vec![event.into()]
                }
                Err(err) => {
                    let _ = self.tx.send(Err(err.into())).await;
                    return Err(End::Gone);
                }
            },
            Delivery::Changes(changes) if changes.is_empty() => return Ok(()),
            Delivery::Changes(changes) => {
                let updates = updates(context, self.source, changes).await;
                delivered = updates.len() as u64;
                wire::update_frames(updates, self.batch_window.is_some())
            }
        };
        for frame in frames {
            self.send(frame).await?;
        }
        context.metrics().watch_updates.increment(delivered);
        Ok(())
    }

    async fn send(&self, frame: impl Into<WatchFrame>) -> Result<(), End> {
        tokio::select! {
            sent = self.tx.send(Ok(frame.into())) => sent.map_err(|_| End::Gone),
            () = self.context.stopping.cancelled() => Err(End::Stopping),
        }
    }

    /// A fresh snapshot for a viewer that fell behind (E4).
    async fn resync(&self, watch_id: &str) -> Result<WatchEvent, ServiceError> {
        let (users, shown) = self.source.resync(self.subscription).await?;
        let (context, source, subscription) = (self.context, self.source, self.subscription);
        let mut event =
            snapshot_event(context, source, subscription, &users, &shown, self.exact_activity, &HashMap::new()).await?;
        wire::set_watch_id(&mut event, watch_id);
        Ok(event)
    }

    /// Applies one `UpdateWatch` (E7) and answers it: removals first, then
    /// additions, whose current presence goes out as one `added` event.
    async fn change(&self, update: WatchUpdate, reply: oneshot::Sender<Result<(), ServiceError>>) -> Result<(), End> {
        let subscription = self.subscription;
        subscription.remove(&update.remove);
        let watched = subscription.mailbox().len();
        let new = subscription.mailbox().unwatched(&update.add);
        if watched + new > MAX_USERS_PER_REQUEST {
            let reason = format!(
                "the watch would follow {} users, more than the limit of {MAX_USERS_PER_REQUEST}",
                watched + new
            );
            let _ = reply.send(Err(ServiceError::invalid("add_user_ids", reason)));
            return Ok(());
        }
        let added = match self.source.add(subscription, update.add).await {
            Ok(added) => added,
            Err(err) => {
                let _ = reply.send(Err(err));
                return Ok(());
            }
        };
        let (users, shown) = added;
        if !users.is_empty() {
            let (context, source) = (self.context, self.source);
            match snapshot_event(context, source, subscription, &users, &shown, self.exact_activity, &HashMap::new())
                .await
            {
                Ok(event) => self.send(wire::added_event(event)).await?,
                Err(err) => {
                    // The users stay watched; their changes reach the viewer from now on.
                    let _ = reply.send(Err(err));
                    return Ok(());
                }
            }
        }
        let _ = reply.send(Ok(()));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn e5_every_stream_waits_for_the_same_next_tick_and_never_a_whole_tick_more() {
        let tick = Duration::from_millis(10);
        let epoch = std::time::Instant::now();
        let since_epoch = |at: tokio::time::Instant| at.duration_since(tokio::time::Instant::from_std(epoch));
        tokio::time::advance(Duration::from_millis(23)).await;
        let next = next_delivery_tick(epoch, tick);
        assert_eq!(since_epoch(next), Duration::from_millis(30), "the next multiple of the tick");
        tokio::time::advance(Duration::from_millis(4)).await;
        assert_eq!(next_delivery_tick(epoch, tick), next, "a stream woken later in the tick waits for the same one");
        tokio::time::advance(Duration::from_millis(4)).await;
        assert_eq!(since_epoch(next_delivery_tick(epoch, tick)), Duration::from_millis(40), "past it: the next");
    }
}
