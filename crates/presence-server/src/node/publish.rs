//! The one way changes leave the store: into the hub's mailboxes, counted.
//!
//! Every store operation appends the changes it caused to a `Vec`, and the
//! caller hands that `Vec` here once the shard lock is released, whatever the
//! operation's own answer (a refused renewal may have found an expired lease
//! and flipped its user). [`Publisher::apply`] owns that pattern, so no handler
//! can forget it. On a cluster node room facts also leave here, for their
//! rooms' owners, through a [`RoomFactSink`].

use std::fmt::Debug;
use std::sync::{Arc, OnceLock};

use hashbrown::HashMap;
use presence_core::{Changes, CompactString, PresenceChange, RoomChange, StampedRoomFact, Store};
use tokio::sync::oneshot;

use crate::metrics::Metrics;
#[cfg(test)]
use crate::metrics::names;
use crate::node::clock::StoreClock;
use crate::node::hub::Hub;
use crate::node::room_hub::RoomHub;

/// The room version of each room a batch of facts touched, after them.
pub(crate) type RoomVersions = HashMap<CompactString, u64>;

/// What the owners answered for a batch: the versions, or the owner that did not take it.
pub(crate) type RoomAnswer = Result<RoomVersions, String>;

/// Where room facts leave this node's store: to their rooms' owners. Only a
/// cluster node installs one ([`Publisher::install_room_facts`]).
pub(crate) trait RoomFactSink: Debug + Send + Sync {
    /// Sends an operation's facts; `answer` hears the owners' room versions.
    fn send(&self, facts: Vec<StampedRoomFact>, answer: Option<oneshot::Sender<RoomAnswer>>);

    /// Tells the owners of `rooms` that a member's relations changed here
    /// (P4): their viewers' watches start over.
    fn send_relations_changed(&self, rooms: Vec<CompactString>);
}

/// Publishes changes to the viewers of this process.
#[derive(Debug, Clone)]
pub(crate) struct Publisher {
    /// The store whose changes these are.
    pub(crate) store: Arc<Store>,
    /// The viewers' mailboxes.
    pub(crate) hub: Arc<Hub>,
    /// The room watchers' mailboxes.
    pub(crate) rooms: Arc<RoomHub>,
    /// Reads `now` for every operation.
    pub(crate) clock: StoreClock,
    /// Counts what was published.
    pub(crate) metrics: Metrics,
    /// On a cluster node, where the store's room facts go: to their rooms'
    /// owners. Installed once, as the node starts routing them
    /// ([`Publisher::install_room_facts`]); a single node has none.
    room_facts: Arc<OnceLock<Arc<dyn RoomFactSink>>>,
}

impl Publisher {
    /// A publisher of `store`'s changes to no watcher yet, reading `clock`.
    pub(crate) fn new(store: Arc<Store>, clock: StoreClock) -> Self {
        Publisher {
            store,
            hub: Arc::new(Hub::default()),
            rooms: Arc::default(),
            clock,
            metrics: Metrics::new(),
            room_facts: Arc::default(),
        }
    }

    /// From now on, the store's room facts go to `sink`. Only the first sink
    /// installed is kept: facts have one way out.
    pub(crate) fn install_room_facts(&self, sink: Arc<dyn RoomFactSink>) {
        if self.room_facts.set(sink).is_err() {
            tracing::error!("room facts already have a way out; the second one is not installed");
        }
    }

    /// Whether the store's room facts leave for their rooms' owners, who
    /// then answer the rooms' versions (a cluster node).
    pub(crate) fn sends_room_facts(&self) -> bool {
        self.room_facts.get().is_some()
    }

    /// Runs one store operation at the current tick and publishes the changes
    /// it caused, whatever it answers.
    pub(crate) fn apply<T>(&self, operation: impl FnOnce(&Store, u64, &mut Changes) -> T) -> T {
        self.apply_hearing_rooms(operation, None)
    }

    /// [`Publisher::apply`], and the room facts the operation made, if any,
    /// are sent to their rooms' owners with `answer` to hear what they
    /// answered (dropped, unanswered, when there were none).
    pub(crate) fn apply_hearing_rooms<T>(
        &self,
        operation: impl FnOnce(&Store, u64, &mut Changes) -> T,
        answer: Option<oneshot::Sender<RoomAnswer>>,
    ) -> T {
        let mut changes = Changes::default();
        let answered = operation(&self.store, self.clock.now(), &mut changes);
        self.publish(&changes.users);
        self.publish_rooms(&changes.rooms);
        if !changes.room_facts.is_empty()
            && let Some(queue) = self.room_facts.get()
        {
            queue.send(changes.room_facts, answer);
        }
        answered
    }

    /// Tells the rooms' owners again where `user` stands in its rooms, which
    /// the sink marks as its visibility now says, so that they count it so
    /// (R4); nothing when room facts do not leave this store.
    pub(crate) fn restate_rooms_of(&self, user: &str) {
        if let Some(sink) = self.room_facts.get() {
            sink.send(self.store.room_facts_of(self.clock.now(), user), None);
        }
    }

    /// Relations changed for the members of `rooms` and for `viewers`: the
    /// room watchers here that may see them differently start over (P4),
    /// and so, told, do those at the rooms' owners.
    pub(crate) fn relations_changed(&self, rooms: Vec<CompactString>, viewers: &[CompactString]) {
        self.rooms.relations_changed(&rooms, viewers);
        if let Some(sink) = self.room_facts.get() {
            sink.send_relations_changed(rooms);
        }
    }

    /// Publishes room changes to the room watchers of this process, in order, and counts them.
    pub(crate) fn publish_rooms(&self, changes: &[RoomChange]) {
        for change in changes {
            let delivered = self.rooms.publish(change);
            self.metrics.room_fanned_out.increment(delivered as u64);
            self.metrics.room_change(change);
        }
    }

    /// Publishes changes to the viewers of this process, in order, and counts them.
    pub(crate) fn publish(&self, changes: &[PresenceChange]) {
        if changes.is_empty() {
            return;
        }
        let now = self.clock.now();
        for change in changes {
            let delivered = self.hub.publish(change);
            self.metrics.fanned_out.increment(delivered as u64);
            self.metrics.change(change, now);
            tracing::debug!(
                user_id = %change.user_id,
                kind = ?change.kind,
                state = ?change.presence.state,
                version = change.presence.version,
                expired = change.deadline.is_some(),
                "change"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use metrics_util::debugging::{DebugValue, DebuggingRecorder};
    use presence_core::{Availability, Registration, Status, StoreConfig};

    /// The counter `name` with the label `state` (or none), as recorded.
    fn counter(entries: &[(String, Option<String>, u64)], name: &str, state: Option<&str>) -> u64 {
        entries
            .iter()
            .filter(|(key, label, _)| key == name && label.as_deref() == state)
            .map(|(_, _, value)| *value)
            .sum()
    }

    #[test]
    fn o1_flips_are_counted_as_flips_and_status_changes_apart() {
        let recorder = DebuggingRecorder::new();
        let snapshotter = recorder.snapshotter();
        metrics::with_local_recorder(&recorder, || {
            let clock = StoreClock::start();
            let store = Arc::new(Store::new(StoreConfig::default(), clock.now()).unwrap());
            let publisher = Publisher::new(store, clock);
            let registration =
                Registration { user_id: "u", session_id: "s", gateway_id: "gw", ttl_ms: 0, metadata: &[] };
            publisher.apply(|store, now, changes| store.register(now, &registration, changes)).unwrap();
            let away = Status { availability: Availability::Away, text: "lunch".into(), expires_at: None };
            publisher.apply(|store, now, changes| store.set_status(now, "u", Some(away), changes)).unwrap();
            publisher.apply(|store, now, changes| store.set_status(now, "u", None, changes)).unwrap();
            publisher.apply(|store, now, changes| store.revoke(now, "u", None, changes)).unwrap();
        });
        let entries: Vec<(String, Option<String>, u64)> = snapshotter
            .snapshot()
            .into_vec()
            .into_iter()
            .filter_map(|(key, _, _, value)| match value {
                DebugValue::Counter(value) => {
                    let key = key.key();
                    let state = key.labels().find(|label| label.key() == "state").map(|label| label.value().to_owned());
                    Some((key.name().to_owned(), state, value))
                }
                _ => None,
            })
            .collect();
        assert_eq!(counter(&entries, names::FLIPS, Some("online")), 1, "{entries:?}");
        assert_eq!(counter(&entries, names::FLIPS, Some("offline")), 1, "{entries:?}");
        assert_eq!(counter(&entries, names::STATUS_CHANGES, None), 2, "{entries:?}");
    }
}
