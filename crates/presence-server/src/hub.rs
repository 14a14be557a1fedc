//! Fan-out of presence changes to the viewers of this process (E5).
//!
//! The hub keeps one topic per watched user, however many viewers watch it,
//! and each topic lists the mailboxes of the viewers that watch the user. A
//! publisher (a request handler or the expiry driver) drops a change into each
//! mailbox and moves on: it never waits for a viewer (E4). A mailbox holds at
//! most one pending change per user, the newest, and at most `capacity` users:
//! when a viewer falls so far behind that more users than that have changed,
//! the mailbox drops what it holds and marks the viewer for a resync, a fresh
//! snapshot that replaces everything it shows. A slow viewer therefore costs a
//! bounded amount of memory and never a silent gap.
//!
//! Topics appear with their first subscriber and disappear with their last:
//! a [`Subscription`] unsubscribes in `Drop`, so a viewer that goes away for
//! any reason leaves nothing behind.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use indexmap::IndexMap;
use parking_lot::Mutex;
use presence_core::{CompactString, Presence, PresenceChange};
use tokio::sync::Notify;

/// The topics of one process.
#[derive(Debug, Default)]
pub struct Hub {
    /// Viewers' mailboxes by watched user.
    topics: DashMap<CompactString, Vec<Arc<Mailbox>>>,
    next_mailbox_id: AtomicU64,
}

/// One viewer's pending changes, conflated per user, in the order their users
/// first changed (so a viewer sees changes in publication order, less the ones
/// a newer change of the same user replaced).
#[derive(Debug)]
pub struct Mailbox {
    id: u64,
    pending: Mutex<Pending>,
    /// Most users `pending` may hold before the viewer is resynced instead.
    capacity: usize,
    /// Wakes the viewer's stream; a permit is kept when it is not waiting, so no change is missed.
    ready: Notify,
}

#[derive(Debug, Default)]
struct Pending {
    /// The newest undelivered change of each user.
    changes: IndexMap<CompactString, Presence>,
    /// The viewer fell too far behind: it gets a fresh snapshot instead of `changes`.
    resync: bool,
}

/// What a viewer's stream takes from its mailbox.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Changes to send, oldest first.
    Changes(IndexMap<CompactString, Presence>),
    /// Too much was missed: send a fresh snapshot of every watched user.
    Resync,
}

impl Mailbox {
    /// Returns whether the change was kept (false when conflated away or covered by a resync).
    fn post(&self, user_id: &CompactString, presence: Presence) -> bool {
        {
            let mut pending = self.pending.lock();
            if pending.resync {
                return false; // the coming snapshot will show it
            }
            let full = pending.changes.len() >= self.capacity;
            match pending.changes.get_mut(user_id) {
                Some(held) if held.version >= presence.version => return false,
                Some(held) => *held = presence,
                None if full => {
                    pending.changes = IndexMap::new();
                    pending.resync = true;
                }
                None => {
                    pending.changes.insert(user_id.clone(), presence);
                }
            }
        }
        self.ready.notify_one();
        true
    }

    /// Takes what is pending.
    pub fn take(&self) -> Delivery {
        let mut pending = self.pending.lock();
        if std::mem::take(&mut pending.resync) {
            Delivery::Resync
        } else {
            Delivery::Changes(std::mem::take(&mut pending.changes))
        }
    }

    /// Completes when changes may be pending.
    pub async fn ready(&self) {
        self.ready.notified().await;
    }
}

impl Hub {
    /// Subscribes a new mailbox of `capacity` users to `user_ids` (repeats are
    /// ignored, the order of first mention kept). Changes published from now on
    /// reach it; the subscription ends when dropped.
    pub fn subscribe(
        self: &Arc<Self>,
        user_ids: impl IntoIterator<Item = CompactString>,
        capacity: usize,
    ) -> Subscription {
        let mailbox = Arc::new(Mailbox {
            id: self.next_mailbox_id.fetch_add(1, Ordering::Relaxed),
            pending: Mutex::new(Pending::default()),
            capacity: capacity.max(1),
            ready: Notify::new(),
        });
        let mut seen = hashbrown::HashSet::new();
        let users: Vec<CompactString> = user_ids.into_iter().filter(|user_id| seen.insert(user_id.clone())).collect();
        for user_id in &users {
            self.topics.entry(user_id.clone()).or_default().push(Arc::clone(&mailbox));
        }
        Subscription { hub: Arc::clone(self), mailbox, users }
    }

    /// Delivers a change to every mailbox subscribed to its user; returns how
    /// many took it.
    pub fn publish(&self, change: &PresenceChange) -> usize {
        match self.topics.get(&change.user_id) {
            Some(mailboxes) => {
                mailboxes.iter().filter(|mailbox| mailbox.post(&change.user_id, change.presence)).count()
            }
            None => 0,
        }
    }

    /// Number of users with at least one subscriber in this process.
    pub fn topics(&self) -> usize {
        self.topics.len()
    }

    fn unsubscribe(&self, mailbox: &Mailbox, users: &[CompactString]) {
        for user_id in users {
            if let dashmap::Entry::Occupied(mut topic) = self.topics.entry(user_id.clone()) {
                topic.get_mut().retain(|other| other.id != mailbox.id);
                if topic.get().is_empty() {
                    topic.remove();
                }
            }
        }
    }
}

/// A mailbox's membership in the hub's topics; leaves them when dropped.
#[derive(Debug)]
pub struct Subscription {
    hub: Arc<Hub>,
    mailbox: Arc<Mailbox>,
    /// The distinct users subscribed to, in order of first mention.
    users: Vec<CompactString>,
}

impl Subscription {
    /// The mailbox changes arrive in.
    pub fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    /// The distinct users subscribed to, in order of first mention.
    pub fn users(&self) -> &[CompactString] {
        &self.users
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.unsubscribe(&self.mailbox, &self.users);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use presence_core::State;

    fn changes(viewer: &Subscription) -> IndexMap<CompactString, Presence> {
        match viewer.mailbox().take() {
            Delivery::Changes(changes) => changes,
            Delivery::Resync => panic!("unexpected resync"),
        }
    }

    fn change(user: &str, state: State, version: u64) -> PresenceChange {
        PresenceChange { user_id: user.into(), presence: Presence { state, version }, at: 0, deadline: None }
    }

    #[test]
    fn e5_one_topic_per_watched_user_whatever_the_number_of_viewers() {
        let hub = Arc::new(Hub::default());
        let viewers: Vec<_> =
            (0..100).map(|_| hub.subscribe(["alice".into(), "bob".into(), "alice".into()], 16)).collect();
        assert_eq!(hub.topics(), 2);
        assert_eq!(hub.publish(&change("alice", State::Online, 5)), 100);
        for viewer in &viewers {
            let pending = changes(viewer);
            assert_eq!(pending.len(), 1);
            assert_eq!(pending["alice"], Presence { state: State::Online, version: 5 });
        }
        drop(viewers);
        assert_eq!(hub.topics(), 0, "topics leave with their last subscriber");
    }

    #[test]
    fn e4_pending_changes_conflate_to_the_newest_and_never_go_back() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["alice".into()], 16);
        hub.publish(&change("alice", State::Online, 5));
        hub.publish(&change("alice", State::Offline, 7));
        // A publisher that lost the race delivers an older change late: it must not win.
        hub.publish(&change("alice", State::Online, 6));
        let pending = changes(&viewer);
        assert_eq!(pending["alice"], Presence { state: State::Offline, version: 7 });
        assert!(changes(&viewer).is_empty());
    }

    #[test]
    fn changes_of_unwatched_users_go_nowhere() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["alice".into()], 16);
        assert_eq!(hub.publish(&change("bob", State::Online, 1)), 0);
        assert!(changes(&viewer).is_empty());
        assert_eq!(hub.topics(), 1);
    }

    #[test]
    fn pending_changes_keep_the_order_their_users_first_changed() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["a".into(), "b".into(), "c".into()], 16);
        for (user, version) in [("c", 1), ("a", 2), ("b", 3), ("c", 4)] {
            hub.publish(&change(user, State::Online, version));
        }
        let order: Vec<_> = changes(&viewer).into_iter().map(|(user, p)| (user, p.version)).collect();
        assert_eq!(order, [("c".into(), 4), ("a".into(), 2), ("b".into(), 3)]);
    }

    #[test]
    fn e4_a_viewer_too_far_behind_is_resynced_instead_of_buffering_without_bound() {
        let hub = Arc::new(Hub::default());
        let users: Vec<CompactString> = (0..10).map(|i| CompactString::from(format!("u{i}"))).collect();
        let slow = hub.subscribe(users.clone(), 4);
        let fast = hub.subscribe(users.clone(), 16);
        for (version, user) in users.iter().enumerate() {
            hub.publish(&change(user, State::Online, version as u64 + 1));
        }
        assert_eq!(slow.mailbox().take(), Delivery::Resync, "more than 4 users changed: the slow viewer resyncs");
        assert_eq!(changes(&fast).len(), 10, "the other viewer lost nothing");
        // After the resync the mailbox works as before.
        hub.publish(&change("u0", State::Offline, 20));
        assert_eq!(changes(&slow)["u0"].version, 20);
    }
}
