//! Fan-out of presence changes to the viewers of this process (E5).
//!
//! The hub keeps one topic per watched user, however many viewers watch it,
//! and each topic lists the mailboxes of the viewers that watch the user. A
//! publisher (a request handler or the expiry driver) drops a change into each
//! mailbox and moves on: it never waits for a viewer (E4). A mailbox holds at
//! most one pending change per user, the newest, so its size is bounded by the
//! number of users its viewer watches, however slow the viewer is.
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
    /// The newest undelivered change of each user.
    pending: Mutex<IndexMap<CompactString, Presence>>,
    /// Wakes the viewer's stream; a permit is kept when it is not waiting, so no change is missed.
    ready: Notify,
}

impl Mailbox {
    fn post(&self, user_id: &CompactString, presence: Presence) {
        {
            let mut pending = self.pending.lock();
            match pending.get_mut(user_id) {
                Some(held) if held.version >= presence.version => return,
                Some(held) => *held = presence,
                None => {
                    pending.insert(user_id.clone(), presence);
                }
            }
        }
        self.ready.notify_one();
    }

    /// Takes every pending change.
    pub fn take(&self) -> IndexMap<CompactString, Presence> {
        std::mem::take(&mut *self.pending.lock())
    }

    /// Completes when changes may be pending.
    pub async fn ready(&self) {
        self.ready.notified().await;
    }
}

impl Hub {
    /// Subscribes a new mailbox to `user_ids` (repeats are ignored, the order of
    /// first mention kept). Changes
    /// published from now on reach it; the subscription ends when dropped.
    pub fn subscribe(self: &Arc<Self>, user_ids: impl IntoIterator<Item = CompactString>) -> Subscription {
        let mailbox = Arc::new(Mailbox {
            id: self.next_mailbox_id.fetch_add(1, Ordering::Relaxed),
            pending: Mutex::new(IndexMap::new()),
            ready: Notify::new(),
        });
        let mut seen = hashbrown::HashSet::new();
        let users: Vec<CompactString> = user_ids.into_iter().filter(|user_id| seen.insert(user_id.clone())).collect();
        for user_id in &users {
            self.topics.entry(user_id.clone()).or_default().push(Arc::clone(&mailbox));
        }
        Subscription { hub: Arc::clone(self), mailbox, users }
    }

    /// Delivers a change to every mailbox subscribed to its user.
    pub fn publish(&self, change: &PresenceChange) {
        if let Some(mailboxes) = self.topics.get(&change.user_id) {
            for mailbox in mailboxes.iter() {
                mailbox.post(&change.user_id, change.presence);
            }
        }
    }

    /// Publishes changes in order.
    pub fn publish_all<'a>(&self, changes: impl IntoIterator<Item = &'a PresenceChange>) {
        for change in changes {
            self.publish(change);
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

    fn change(user: &str, state: State, version: u64) -> PresenceChange {
        PresenceChange { user_id: user.into(), presence: Presence { state, version }, at: 0, deadline: None }
    }

    #[test]
    fn e5_one_topic_per_watched_user_whatever_the_number_of_viewers() {
        let hub = Arc::new(Hub::default());
        let viewers: Vec<_> = (0..100).map(|_| hub.subscribe(["alice".into(), "bob".into(), "alice".into()])).collect();
        assert_eq!(hub.topics(), 2);
        hub.publish(&change("alice", State::Online, 5));
        for viewer in &viewers {
            let pending = viewer.mailbox().take();
            assert_eq!(pending.len(), 1);
            assert_eq!(pending["alice"], Presence { state: State::Online, version: 5 });
        }
        drop(viewers);
        assert_eq!(hub.topics(), 0, "topics leave with their last subscriber");
    }

    #[test]
    fn e4_pending_changes_conflate_to_the_newest_and_never_go_back() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["alice".into()]);
        hub.publish(&change("alice", State::Online, 5));
        hub.publish(&change("alice", State::Offline, 7));
        // A publisher that lost the race delivers an older change late: it must not win.
        hub.publish(&change("alice", State::Online, 6));
        let pending = viewer.mailbox().take();
        assert_eq!(pending["alice"], Presence { state: State::Offline, version: 7 });
        assert!(viewer.mailbox().take().is_empty());
    }

    #[test]
    fn changes_of_unwatched_users_go_nowhere() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["alice".into()]);
        hub.publish(&change("bob", State::Online, 1));
        assert!(viewer.mailbox().take().is_empty());
        assert_eq!(hub.topics(), 1);
    }

    #[test]
    fn pending_changes_keep_the_order_their_users_first_changed() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["a".into(), "b".into(), "c".into()]);
        for (user, version) in [("c", 1), ("a", 2), ("b", 3), ("c", 4)] {
            hub.publish(&change(user, State::Online, version));
        }
        let order: Vec<_> = viewer.mailbox().take().into_iter().map(|(user, p)| (user, p.version)).collect();
        assert_eq!(order, [("c".into(), 4), ("a".into(), 2), ("b".into(), 3)]);
    }
}
