//! Fan-out of presence changes to the viewers of this process (E5), and the
//! privacy filter in front of every viewer (P3, P4).
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
//! Each mailbox also knows its viewer and which of its watched users that
//! viewer may not see: a change of a hidden user never enters the mailbox.
//! When relations change, [`Hub::reconcile`] finds the mailboxes whose view
//! changed and tells each, as an ordinary update with a new version, that a
//! user now looks offline (hidden) or what it really is (revealed).
//!
//! Topics appear with their first subscriber and disappear with their last:
//! a [`Subscription`] unsubscribes in `Drop`, so a viewer that goes away for
//! any reason leaves nothing behind.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use hashbrown::HashSet;
use indexmap::IndexMap;
use parking_lot::Mutex;
use presence_core::{CompactString, Presence, PresenceChange, Status};
use tokio::sync::Notify;

/// The topics of one process.
#[derive(Debug, Default)]
pub struct Hub {
    /// Viewers' mailboxes by watched user.
    topics: DashMap<CompactString, Vec<Arc<Mailbox>>>,
    /// Mailboxes by viewer, for changes of what a viewer may see.
    viewers: DashMap<CompactString, Vec<Arc<Mailbox>>>,
    next_mailbox_id: AtomicU64,
}

/// One change waiting in a mailbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Pending {
    /// State and version to show.
    pub presence: Presence,
    /// Status to show.
    pub status: Option<Arc<Status>>,
    /// The user just became hidden from this viewer: show it exactly as a user
    /// never seen, but for the version, which tells the viewer to replace what it holds.
    pub hidden: bool,
}

/// One viewer's pending changes, conflated per user, in the order their users
/// first changed (so a viewer sees changes in publication order, less the ones
/// a newer change of the same user replaced).
#[derive(Debug)]
pub struct Mailbox {
    id: u64,
    /// The viewer the mailbox serves; `None` sees everyone.
    viewer: Option<CompactString>,
    /// The distinct users watched, in order of first mention.
    users: Vec<CompactString>,
    state: Mutex<MailboxState>,
    /// Most users `changes` may hold before the viewer is resynced instead.
    capacity: usize,
    /// Wakes the viewer's stream; a permit is kept when it is not waiting, so no change is missed.
    ready: Notify,
}

/// Pending changes by user, in the order the users first changed. A fast
/// hasher: every change to every viewer is hashed here, and user ids are not
/// chosen by an attacker who could aim at collisions of one viewer's map.
pub(crate) type PendingChanges = IndexMap<CompactString, Pending, hashbrown::DefaultHashBuilder>;

#[derive(Debug, Default)]
struct MailboxState {
    /// The newest undelivered change of each user.
    changes: PendingChanges,
    /// The viewer fell too far behind: it gets a fresh snapshot instead of `changes`.
    resync: bool,
    /// Watched users this viewer may not see.
    hidden: HashSet<CompactString>,
}

/// What a viewer's stream takes from its mailbox.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Changes to send, oldest first.
    Changes(PendingChanges),
    /// Too much was missed: send a fresh snapshot of every watched user.
    Resync,
}

/// A viewer's view of one user changed with the relations.
#[derive(Debug)]
pub(crate) struct Transition {
    pub(crate) mailbox: Arc<Mailbox>,
    pub(crate) user_id: CompactString,
    pub(crate) visible: bool,
}

impl Mailbox {
    /// Returns whether the change was kept (false when the user is hidden from
    /// this viewer, conflated away, or covered by a coming resync).
    fn post(&self, user_id: &CompactString, change: Pending, even_if_hidden: bool) -> bool {
        {
            let mut state = self.state.lock();
            if state.resync || (!even_if_hidden && state.hidden.contains(user_id)) {
                return false;
            }
            let full = state.changes.len() >= self.capacity;
            match state.changes.entry(user_id.clone()) {
                indexmap::map::Entry::Occupied(held) if held.get().presence.version >= change.presence.version => {
                    return false;
                }
                indexmap::map::Entry::Occupied(mut held) => *held.get_mut() = change,
                indexmap::map::Entry::Vacant(_) if full => {
                    state.changes = PendingChanges::default();
                    state.resync = true;
                }
                indexmap::map::Entry::Vacant(slot) => {
                    slot.insert(change);
                }
            }
        }
        self.ready.notify_one();
        true
    }

    /// Takes what is pending.
    pub fn take(&self) -> Delivery {
        let mut state = self.state.lock();
        if std::mem::take(&mut state.resync) {
            Delivery::Resync
        } else {
            // Sized for as many as last time, so a busy viewer's map does not grow step by step again.
            let sized = PendingChanges::with_capacity_and_hasher(state.changes.len(), Default::default());
            Delivery::Changes(std::mem::replace(&mut state.changes, sized))
        }
    }

    /// Completes when changes may be pending.
    pub async fn ready(&self) {
        self.ready.notified().await;
    }

    /// The viewer this mailbox serves.
    pub fn viewer(&self) -> Option<&str> {
        self.viewer.as_deref()
    }

    /// Whether `user_id` is hidden from this viewer.
    pub fn is_hidden(&self, user_id: &str) -> bool {
        self.state.lock().hidden.contains(user_id)
    }

    pub(crate) fn set_hidden(&self, user_id: &CompactString, hidden: bool) {
        let mut state = self.state.lock();
        if hidden {
            state.hidden.insert(user_id.clone());
        } else {
            state.hidden.remove(user_id);
        }
    }

    /// Delivers a change that relations made (a user hidden or revealed),
    /// whether or not the user is hidden from the viewer.
    pub(crate) fn post_transition(&self, user_id: &CompactString, change: Pending) {
        self.post(user_id, change, true);
    }
}

impl Hub {
    /// Subscribes a new mailbox of `capacity` users to `user_ids` (repeats are
    /// ignored, the order of first mention kept) for `viewer`, with `hidden`
    /// the watched users it may not see. Changes published from now on reach
    /// it; the subscription ends when dropped.
    pub fn subscribe(
        self: &Arc<Self>,
        user_ids: impl IntoIterator<Item = CompactString>,
        capacity: usize,
        viewer: Option<CompactString>,
        hidden: impl Fn(&str) -> bool,
    ) -> Subscription {
        let mut seen = HashSet::new();
        let users: Vec<CompactString> = user_ids.into_iter().filter(|user_id| seen.insert(user_id.clone())).collect();
        let hidden = users.iter().filter(|user_id| hidden(user_id)).cloned().collect();
        let mailbox = Arc::new(Mailbox {
            id: self.next_mailbox_id.fetch_add(1, Ordering::Relaxed),
            viewer: viewer.clone(),
            users,
            state: Mutex::new(MailboxState { hidden, ..MailboxState::default() }),
            capacity: capacity.max(1),
            ready: Notify::new(),
        });
        for user_id in &mailbox.users {
            self.topics.entry(user_id.clone()).or_default().push(Arc::clone(&mailbox));
        }
        if let Some(viewer) = viewer {
            self.viewers.entry(viewer).or_default().push(Arc::clone(&mailbox));
        }
        Subscription { hub: Arc::clone(self), mailbox }
    }

    /// Delivers a change to every mailbox subscribed to its user whose viewer
    /// may see it; returns how many took it.
    pub fn publish(&self, change: &PresenceChange) -> usize {
        match self.topics.get(&change.user_id) {
            Some(mailboxes) => {
                let pending = Pending { presence: change.presence, status: change.status.clone(), hidden: false };
                mailboxes.iter().filter(|mailbox| mailbox.post(&change.user_id, pending.clone(), false)).count()
            }
            None => 0,
        }
    }

    /// Number of users with at least one subscriber in this process.
    pub fn topics(&self) -> usize {
        self.topics.len()
    }

    /// After a change of relations: the mailboxes whose view of a user no longer
    /// matches `can_see`, among those watching `users` and those of `viewers`
    /// (for every user they watch). Hidden sets are not changed here: the
    /// caller orders that against the version bump (see privacy notes in watch.rs).
    pub(crate) fn reconcile(
        &self,
        users: &[CompactString],
        viewers: &[CompactString],
        can_see: impl Fn(Option<&str>, &str) -> bool,
    ) -> Vec<Transition> {
        let mut transitions = Vec::new();
        let mut check = |mailbox: &Arc<Mailbox>, user_id: &CompactString| {
            let visible = can_see(mailbox.viewer(), user_id);
            if visible == mailbox.is_hidden(user_id) {
                transitions.push(Transition { mailbox: Arc::clone(mailbox), user_id: user_id.clone(), visible });
            }
        };
        for user_id in users {
            if let Some(mailboxes) = self.topics.get(user_id) {
                mailboxes.iter().for_each(|mailbox| check(mailbox, user_id));
            }
        }
        for viewer in viewers {
            let Some(mailboxes) = self.viewers.get(viewer).map(|entry| entry.value().clone()) else { continue };
            for mailbox in &mailboxes {
                mailbox.users.iter().for_each(|user_id| check(mailbox, user_id));
            }
        }
        // A mailbox reached both as a watcher of a user and as its viewer's must change once.
        transitions.sort_by(|a, b| (a.mailbox.id, &a.user_id).cmp(&(b.mailbox.id, &b.user_id)));
        transitions.dedup_by(|a, b| a.mailbox.id == b.mailbox.id && a.user_id == b.user_id);
        transitions
    }

    fn unsubscribe(&self, mailbox: &Mailbox) {
        for user_id in &mailbox.users {
            if let dashmap::Entry::Occupied(mut topic) = self.topics.entry(user_id.clone()) {
                topic.get_mut().retain(|other| other.id != mailbox.id);
                if topic.get().is_empty() {
                    topic.remove();
                }
            }
        }
        if let Some(viewer) = &mailbox.viewer
            && let dashmap::Entry::Occupied(mut mailboxes) = self.viewers.entry(viewer.clone())
        {
            mailboxes.get_mut().retain(|other| other.id != mailbox.id);
            if mailboxes.get().is_empty() {
                mailboxes.remove();
            }
        }
    }
}

/// A mailbox's membership in the hub's topics; leaves them when dropped.
#[derive(Debug)]
pub struct Subscription {
    hub: Arc<Hub>,
    mailbox: Arc<Mailbox>,
}

impl Subscription {
    /// The mailbox changes arrive in.
    pub fn mailbox(&self) -> &Mailbox {
        &self.mailbox
    }

    /// The distinct users subscribed to, in order of first mention.
    pub fn users(&self) -> &[CompactString] {
        &self.mailbox.users
    }
}

impl Drop for Subscription {
    fn drop(&mut self) {
        self.hub.unsubscribe(&self.mailbox);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use presence_core::State;

    fn changes(viewer: &Subscription) -> IndexMap<CompactString, Presence> {
        match viewer.mailbox().take() {
            Delivery::Changes(changes) => changes.into_iter().map(|(user, pending)| (user, pending.presence)).collect(),
            Delivery::Resync => panic!("unexpected resync"),
        }
    }

    fn change(user: &str, state: State, version: u64) -> PresenceChange {
        PresenceChange {
            user_id: user.into(),
            kind: presence_core::ChangeKind::Flip,
            presence: Presence { state, version },
            status: None,
            at: 0,
            deadline: None,
        }
    }

    /// Subscribes a service viewer (sees everyone).
    fn watch(hub: &Arc<Hub>, users: Vec<CompactString>, capacity: usize) -> Subscription {
        hub.subscribe(users, capacity, None, |_| false)
    }

    #[test]
    fn e5_one_topic_per_watched_user_whatever_the_number_of_viewers() {
        let hub = Arc::new(Hub::default());
        let viewers: Vec<_> = (0..100)
            .map(|_| watch(&hub, ["alice".into(), "bob".into(), "alice".into()].into_iter().collect(), 16))
            .collect();
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
        let viewer = watch(&hub, ["alice".into()].into_iter().collect(), 16);
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
        let viewer = watch(&hub, ["alice".into()].into_iter().collect(), 16);
        assert_eq!(hub.publish(&change("bob", State::Online, 1)), 0);
        assert!(changes(&viewer).is_empty());
        assert_eq!(hub.topics(), 1);
    }

    #[test]
    fn pending_changes_keep_the_order_their_users_first_changed() {
        let hub = Arc::new(Hub::default());
        let viewer = watch(&hub, ["a".into(), "b".into(), "c".into()].into_iter().collect(), 16);
        for (user, version) in [("c", 1), ("a", 2), ("b", 3), ("c", 4)] {
            hub.publish(&change(user, State::Online, version));
        }
        let order: Vec<_> = changes(&viewer).into_iter().map(|(user, p)| (user, p.version)).collect();
        assert_eq!(order, [("c".into(), 4), ("a".into(), 2), ("b".into(), 3)]);
    }

    #[test]
    fn p3_changes_of_hidden_users_never_enter_the_mailbox_and_reconcile_finds_changed_views() {
        let hub = Arc::new(Hub::default());
        let viewer = hub.subscribe(["alice".into(), "bob".into()], 16, Some("carol".into()), |user| user == "alice");
        assert_eq!(hub.publish(&change("alice", State::Online, 5)), 0, "alice is hidden from carol");
        assert_eq!(hub.publish(&change("bob", State::Online, 6)), 1);
        assert_eq!(changes(&viewer).keys().collect::<Vec<_>>(), ["bob"]);

        // Alice's audience now includes carol: one transition, to visible.
        let transitions = hub.reconcile(&["alice".into()], &[], |_, _| true);
        assert_eq!(transitions.len(), 1);
        assert!(transitions[0].visible && transitions[0].user_id == "alice");
        // Carol's view of everyone changes (say she left a group): bob is now hidden too.
        let transitions = hub.reconcile(&[], &["carol".into()], |_, user| user != "bob" && user != "alice");
        let changed: Vec<(&str, bool)> = transitions.iter().map(|t| (t.user_id.as_str(), t.visible)).collect();
        assert_eq!(changed, [("bob", false)]);
        drop(viewer);
        assert!(hub.viewers.is_empty(), "the viewer index empties with its last mailbox");
    }

    #[test]
    fn e4_a_viewer_too_far_behind_is_resynced_instead_of_buffering_without_bound() {
        let hub = Arc::new(Hub::default());
        let users: Vec<CompactString> = (0..10).map(|i| CompactString::from(format!("u{i}"))).collect();
        let slow = watch(&hub, users.clone().into_iter().collect(), 4);
        let fast = watch(&hub, users.clone().into_iter().collect(), 16);
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
