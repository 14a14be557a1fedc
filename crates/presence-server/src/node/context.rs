//! What every request handler and background task of one server shares.
//!
//! The context is a handful of handles, each owning one idea: the store and
//! the way its changes are published, who may see whom, activity, settings.
//! Handlers reach the store through [`Context::apply`], which publishes what
//! an operation changed whatever it answered.

use std::sync::Arc;
use std::time::{Duration, Instant};

use hashbrown::HashMap;
use presence_core::{Changes, Store};
use presence_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use crate::error::ServiceError;
use crate::metrics::Metrics;
use crate::node::activity::Activity;
use crate::node::clock::StoreClock;
use crate::node::feed::Feed;
use crate::node::placement::{FORWARD_TIMEOUT, Placement, SingleNode};
use crate::node::privacy::{Privacy, Shown, Visibility};
use crate::node::publish::{Publisher, RoomAnswer};
use crate::node::room_hub::RoomHub;
use crate::node::settings::Settings;
use crate::node::storage::durable::DurableStore;
use crate::node::watches::Watches;
use crate::node::wire;
use presence_core::attention::NotifyPolicy;

/// The settings one node reads: the server's, less what only the process
/// around the node (the network, the tasks, the cluster) needs.
#[derive(Debug, Clone)]
pub(crate) struct NodeConfig {
    /// Most distinct users a viewer's mailbox holds before the viewer is resynced (E4).
    pub(crate) watch_buffer: usize,
    /// The delivery tick of busy Watch streams without a batch window (E3); zero: none.
    pub(crate) watch_delivery_tick: Duration,
    /// Most members a member-mode room snapshot or watch lists (R6).
    pub(crate) room_member_cap: usize,
    /// How often at most a user's activity is written to disk.
    pub(crate) activity_write_interval: Duration,
    /// The store's `forget_offline_after_ms`: activity held in memory is
    /// forgotten after as long, as the store forgets long-offline users (B6).
    pub(crate) forget_offline_after_ms: u64,
    /// The visibility of a user that chose none.
    pub(crate) default_visibility: Visibility,
    /// Last seen is released rounded down to this (P5).
    pub(crate) last_seen_granularity: Duration,
    /// Where notifications go (A3): the hand-off delay a call that names none takes.
    pub(crate) notify_policy: NotifyPolicy,
}

impl Default for NodeConfig {
    /// The server's defaults for these settings.
    fn default() -> Self {
        NodeConfig {
            watch_buffer: 4_096,
            watch_delivery_tick: Duration::from_millis(10),
            room_member_cap: 1_000,
            activity_write_interval: Duration::from_secs(60),
            forget_offline_after_ms: presence_core::StoreConfig::default().forget_offline_after_ms,
            default_visibility: Visibility::Audience,
            last_seen_granularity: Duration::from_secs(300),
            notify_policy: NotifyPolicy::default(),
        }
    }
}

/// The shared state of one running server.
#[derive(Debug)]
pub(crate) struct Context {
    /// The store, the hub its changes go to, the clock and the counts of
    /// what was published.
    pub(crate) publisher: Publisher,
    /// Who may see whom, and the one writer of relations and statuses.
    pub(crate) privacy: Privacy,
    /// Users' last meaningful activity (S2).
    pub(crate) activity: Arc<Activity>,
    /// Durable per-user settings.
    pub(crate) settings: Settings,
    /// Most distinct users a viewer's mailbox holds before the viewer is resynced (E4).
    pub(crate) watch_buffer: usize,
    /// The delivery tick of busy Watch streams without a batch window (E3); zero: none.
    pub(crate) watch_delivery_tick: Duration,
    /// The open Watch streams, for `UpdateWatch` (E7).
    pub(crate) watches: Watches,
    /// The open WatchRoomCounts streams, for `UpdateWatchRoomCounts` (R7).
    pub(crate) room_count_watches: Watches,
    /// Most members a member-mode room snapshot or watch lists (R6).
    pub(crate) room_member_cap: usize,
    /// Cancelled when the server shuts down: ends Watch and Leases streams.
    pub(crate) stopping: CancellationToken,
    /// When the server was made, for the uptime `Stats` reports.
    pub(crate) started: Instant,
    /// Which users and rooms this node answers for: all of them on a single
    /// node, its slots' on a cluster node (C1).
    pub(crate) placement: Arc<dyn Placement>,
    /// The data directory's durable store, for backups (D3); `None`: memory only.
    pub(crate) durable: Option<Arc<DurableStore>>,
    /// The change feed (F1); `None` when it is turned off.
    pub(crate) feed: Option<Arc<Feed>>,
    /// Where notifications go, when a call does not say otherwise (A3).
    notify_policy: NotifyPolicy,
}

impl Context {
    /// The context of a single node over `store`, with `durable` as its data
    /// directory's store (or none: memory only) and `feed` as its change feed
    /// (or none: turned off), which the store's changes already go to.
    /// Relations kept on disk are loaded separately (`Privacy::load`).
    pub(crate) fn new(
        store: Arc<Store>,
        clock: StoreClock,
        durable: Option<Arc<DurableStore>>,
        feed: Option<Arc<Feed>>,
        config: &NodeConfig,
        stopping: CancellationToken,
    ) -> Self {
        Context::placed(store, clock, durable, feed, config, stopping, Arc::new(SingleNode))
    }

    /// [`Context::new`] for a node whose users and rooms `placement` places.
    pub(crate) fn placed(
        store: Arc<Store>,
        clock: StoreClock,
        durable: Option<Arc<DurableStore>>,
        feed: Option<Arc<Feed>>,
        config: &NodeConfig,
        stopping: CancellationToken,
        placement: Arc<dyn Placement>,
    ) -> Self {
        let publisher = Publisher::new(store, clock);
        let granularity_ms = u64::try_from(config.last_seen_granularity.as_millis()).unwrap_or(u64::MAX);
        Context {
            privacy: Privacy::new(config.default_visibility, durable.clone(), publisher.clone(), granularity_ms),
            publisher,
            activity: Arc::new(Activity::new(
                durable.clone(),
                config.activity_write_interval,
                config.forget_offline_after_ms,
            )),
            settings: Settings::new(durable.clone()),
            durable,
            watch_buffer: config.watch_buffer,
            watch_delivery_tick: config.watch_delivery_tick,
            watches: Watches::default(),
            room_count_watches: Watches::default(),
            room_member_cap: config.room_member_cap,
            stopping,
            started: Instant::now(),
            placement,
            feed,
            notify_policy: config.notify_policy,
        }
    }

    /// The notification policy's defaults (A3: `--push-handoff-ms`).
    pub(crate) fn notify_policy(&self) -> NotifyPolicy {
        self.notify_policy
    }

    /// Held by a request whose write awaits the disk, from before its check
    /// of [`Placement::acting`] to the end of its write (C3): a handover of
    /// its user's slot waits for it. Nothing on a single node.
    pub(crate) async fn hold_for_durable_write(&self) -> Option<tokio::sync::RwLockReadGuard<'_, ()>> {
        match self.placement.durable_gate() {
            Some(gate) => Some(gate.read().await),
            None => None,
        }
    }

    /// The lease store.
    pub(crate) fn store(&self) -> &Arc<Store> {
        &self.publisher.store
    }

    /// The room watchers' topics.
    pub(crate) fn rooms(&self) -> &Arc<RoomHub> {
        &self.publisher.rooms
    }

    /// The metrics handles.
    pub(crate) fn metrics(&self) -> &Metrics {
        &self.publisher.metrics
    }

    /// The current store tick.
    pub(crate) fn now(&self) -> u64 {
        self.publisher.clock.now()
    }

    /// Runs one store operation now and publishes what it changed.
    pub(crate) fn apply<T>(&self, operation: impl FnOnce(&Store, u64, &mut Changes) -> T) -> T {
        self.publisher.apply(operation)
    }

    /// [`Context::apply`] for an operation on rooms: on a cluster node, the
    /// room facts it made go to their rooms' owners, whose answer (the room
    /// versions after it) [`hear_rooms`] waits for.
    pub(crate) fn apply_to_rooms<T>(
        &self,
        operation: impl FnOnce(&Store, u64, &mut Changes) -> T,
    ) -> (T, tokio::sync::oneshot::Receiver<RoomAnswer>) {
        let (answer, answered) = tokio::sync::oneshot::channel();
        (self.publisher.apply_hearing_rooms(operation, Some(answer)), answered)
    }

    /// The wire form of users as read for one caller: hidden users exactly as
    /// users never seen (P3), visible ones with their status and, offline,
    /// their coarse last seen (P5); exact activity times only for a service
    /// acting for no viewer.
    pub(crate) async fn released<S: AsRef<str>>(
        &self,
        user_ids: &[S],
        shown: &[Shown],
        exact_activity: bool,
    ) -> Result<Vec<pb::UserPresence>, ServiceError> {
        // Activity is looked up only for users the caller may see.
        let visible: Vec<&str> =
            user_ids.iter().zip(shown).filter(|(_, shown)| shown.visible).map(|(id, _)| id.as_ref()).collect();
        let active: HashMap<&str, u64> =
            visible.iter().copied().zip(self.activity.last_active_at(&visible).await?).collect();
        Ok(user_ids
            .iter()
            .zip(shown)
            .map(|(user_id, shown)| {
                let user_id = user_id.as_ref();
                let last_active_at = active.get(user_id).copied().unwrap_or(0);
                wire::released(user_id, &self.privacy.release(shown, last_active_at, exact_activity))
            })
            .collect())
    }
}

/// What the rooms' owners answered for an operation of
/// [`Context::apply_to_rooms`], heard within the forwarding time: `None` when
/// the operation made no room fact or the node sends none (a single node,
/// whose store answered the versions itself).
pub(crate) async fn hear_rooms(answered: tokio::sync::oneshot::Receiver<RoomAnswer>) -> Option<RoomAnswer> {
    match tokio::time::timeout(FORWARD_TIMEOUT, answered).await {
        Ok(Ok(heard)) => Some(heard),
        // Dropped unanswered: no fact was made, or none leaves this store.
        Ok(Err(_)) => None,
        Err(_) => Some(Err("the room's owner".into())),
    }
}

/// The version of `room_id` after an operation of [`Context::apply_to_rooms`]:
/// the one its owner answered, or, when the operation made no fact of that
/// room, the one the owner holds (`None` on a single node, whose store
/// answered it already).
pub(crate) async fn room_version_after(
    context: &Context,
    heard: &Option<RoomAnswer>,
    room_id: &str,
) -> Result<Option<u64>, ServiceError> {
    match heard {
        Some(Ok(versions)) if versions.contains_key(room_id) => Ok(versions.get(room_id).copied()),
        Some(Err(node)) => Err(ServiceError::RoomOwnerUnreachable { node: node.clone() }),
        _ => context.placement.room_version(context.store(), room_id).await,
    }
}
