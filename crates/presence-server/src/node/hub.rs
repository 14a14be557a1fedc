//! Fan-out of presence changes to the viewers of this process (E5), and the
//! privacy filter in front of every viewer (P3, P4).
//!
//! The hub keeps one topic per watched user, however many viewers watch it,
//! and each topic lists the mailboxes of the viewers that watch the user, each
//! with the user's slot in that mailbox. A publisher (a request handler or the
//! expiry driver) drops a change into each mailbox and moves on: it never
//! waits for a viewer (E4). A slot holds the version its viewer already has
//! and at most one pending change, the newest, so posting a change is an index
//! and a comparison, not a lookup; and a mailbox holds at most `capacity`
//! pending users: when a viewer falls so far behind that more users than that
//! have changed, the mailbox drops what it holds and marks the viewer for a
//! resync, a fresh snapshot that replaces everything it shows. A slow viewer
//! therefore costs a bounded amount of memory and never a silent gap.
//!
//! Each mailbox also knows its viewer and which of its watched users that
//! viewer may not see: a change of a hidden user never enters the mailbox.
//! When relations change, [`Hub::reconcile`] finds the mailboxes whose view
//! changed and tells each, as an ordinary update with a new version, that a
//! user now looks offline (hidden) or what it really is (revealed).
//!
//! The watched set of a mailbox can change while it is open (E7): an added
//! user takes a free slot and joins its topic; a removed one leaves its topic
//! first, so no publisher can reach its slot any more, and then frees the slot.
//! A post names the user as well as the slot and is dropped when they no
//! longer match, so a slot reused for another user never takes a change meant
//! for the one before.
//!
//! Topics appear with their first subscriber and disappear with their last:
//! a [`Subscription`] unsubscribes in `Drop`, so a viewer that goes away for
//! any reason leaves nothing behind.

use std::sync::{Arc, OnceLock};

use hashbrown::{HashMap, HashSet};
use presence_core::{CompactString, Presence, PresenceChange, Status};

use crate::node::sync::{AtomicU64, DashMap, Entry, Mutex, Notify, Ordering};

/// The topics of one process.
#[derive(Debug, Default)]
pub(crate) struct Hub {
    /// Viewers' mailboxes (and the user's slot in each) by watched user.
    topics: DashMap<CompactString, Vec<Watcher>>,
    /// Mailboxes by viewer, for changes of what a viewer may see.
    viewers: DashMap<CompactString, Vec<Arc<Mailbox>>>,
    next_mailbox_id: AtomicU64,
}

/// One mailbox watching a user, and the user's slot in it.
#[derive(Debug, Clone)]
struct Watcher {
    mailbox: Arc<Mailbox>,
    slot: u32,
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
    /// The update as it is sent, shared by every viewer posted the same
    /// published change: the first delivery encodes it, the others copy it
    /// (E5). `None` for a change of one viewer's view (a transition).
    pub encoded: Option<SharedEncoding>,
}

/// A published change's `update` event, encoded once for all its viewers.
pub(crate) type SharedEncoding = Arc<OnceLock<bytes::Bytes>>;

impl Pending {
    /// A change of one viewer's view, encoded for that viewer alone.
    pub(crate) fn alone(presence: Presence, status: Option<Arc<Status>>, hidden: bool) -> Self {
        Pending { presence, status, hidden, encoded: None }
    }
}

/// One viewer's watched users and their pending changes, conflated per user,
/// in the order their users first changed (so a viewer sees changes in
/// publication order, less the ones a newer change of the same user replaced).
#[derive(Debug)]
pub struct Mailbox {
    id: u64,
    /// The viewer the mailbox serves; `None` sees everyone.
    viewer: Option<CompactString>,
    state: Mutex<MailboxState>,
    /// Most users with a pending change before the viewer is resynced instead.
    capacity: usize,
    /// Wakes the viewer's stream; a permit is kept when it is not waiting, so no change is missed.
    ready: Notify,
}

#[derive(Debug, Default)]
struct MailboxState {
    /// Watched users by slot; a removed user's slot is empty until reused.
    slots: Vec<Slot>,
    /// Slot of each watched user.
    index: HashMap<CompactString, u32>,
    /// Empty slots, reused first.
    free: Vec<u32>,
    /// Slots with a pending change, in the order they first changed.
    queue: Vec<u32>,
    /// The viewer fell too far behind: it gets a fresh snapshot instead of `queue`.
    resync: bool,
    /// Whatever fed the mailbox can no longer: why. Its stream asks for a
    /// resync, which its source refuses with this reason.
    ended: Option<String>,
}

#[derive(Debug, Default)]
struct Slot {
    /// The watched user; `None` for an empty slot.
    user_id: Option<CompactString>,
    /// The viewer may not see the user.
    hidden: bool,
    /// The version the viewer holds (0 for hidden users, as for users never seen):
    /// a change not newer than it is never delivered.
    held: u64,
    /// The newest undelivered change.
    pending: Option<Pending>,
}

/// Changes taken from a mailbox: each user's newest, oldest first.
pub(crate) type PendingChanges = Vec<(CompactString, Pending)>;

/// What a viewer's stream takes from its mailbox.
#[derive(Debug, PartialEq, Eq)]
pub enum Delivery {
    /// Changes to send, oldest first, each newer than what the viewer holds;
    /// taking them records their versions as held.
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
    /// Returns whether the change was kept (false when the user is no longer
    /// in `slot`, hidden from this viewer, conflated away, not newer than what
    /// the viewer holds, or covered by a coming resync).
    fn post(&self, slot: u32, user_id: &str, change: Pending, even_if_hidden: bool) -> bool {
        // The stream is woken only when its mailbox had nothing for it: a
        // mailbox that already holds changes has woken it already, and its
        // next `take` empties the queue under this lock, so nothing waits
        // unseen. Under load this spares most posts a wake-up.
        let wake = {
            let mut state = self.state.lock();
            let MailboxState { slots, queue, resync, .. } = &mut *state;
            if *resync {
                return false;
            }
            let Some(held) = slots.get_mut(slot as usize) else { return false };
            if held.user_id.as_deref() != Some(user_id) || (held.hidden && !even_if_hidden) {
                return false;
            }
            let version = change.presence.version;
            if version <= held.held {
                return false;
            }
            match &mut held.pending {
                Some(pending) if pending.presence.version >= version => return false,
                Some(pending) => {
                    *pending = change;
                    false
                }
                None if queue.len() >= self.capacity => {
                    for slot in queue.drain(..) {
                        slots[slot as usize].pending = None;
                    }
                    *resync = true;
                    true
                }
                None => {
                    held.pending = Some(change);
                    queue.push(slot);
                    queue.len() == 1
                }
            }
        };
        if wake {
            self.ready.notify_one();
        }
        true
    }

    /// Takes what is pending, and records the versions taken as held.
    pub fn take(&self) -> Delivery {
        let mut state = self.state.lock();
        if std::mem::take(&mut state.resync) {
            return Delivery::Resync;
        }
        let MailboxState { slots, queue, .. } = &mut *state;
        let mut changes = Vec::with_capacity(queue.len());
        for slot in queue.drain(..) {
            let slot = &mut slots[slot as usize];
            let (Some(pending), Some(user_id)) = (slot.pending.take(), &slot.user_id) else { continue };
            // A change posted before the viewer's snapshot was read may be older than it.
            if pending.presence.version > slot.held {
                slot.held = pending.presence.version;
                changes.push((user_id.clone(), pending));
            }
        }
        Delivery::Changes(changes)
    }

    /// Records what a snapshot just showed the viewer: for each of `users`, the
    /// version it now holds. Pending changes not newer than it will be dropped.
    pub(crate) fn hold(&self, users: &[CompactString], versions: impl IntoIterator<Item = u64>) {
        let mut state = self.state.lock();
        let MailboxState { slots, index, .. } = &mut *state;
        for (user_id, version) in users.iter().zip(versions) {
            if let Some(&slot) = index.get(user_id) {
                slots[slot as usize].held = version;
            }
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

    /// Ends the mailbox: nothing more is kept in it, and its stream's next
    /// delivery is a resync, which the stream's source refuses with
    /// `reason` (see [`Mailbox::ended`]).
    pub(crate) fn end(&self, reason: String) {
        {
            let mut state = self.state.lock();
            let MailboxState { slots, queue, resync, ended, .. } = &mut *state;
            for slot in queue.drain(..) {
                slots[slot as usize].pending = None;
            }
            *resync = true;
            ended.get_or_insert(reason);
        }
        self.ready.notify_one();
    }

    /// Why the mailbox was ended, if it was.
    pub(crate) fn ended(&self) -> Option<String> {
        self.state.lock().ended.clone()
    }

    /// Whether `user_id` is watched here and hidden from this viewer.
    pub fn is_hidden(&self, user_id: &str) -> bool {
        let state = self.state.lock();
        state.index.get(user_id).is_some_and(|&slot| state.slots[slot as usize].hidden)
    }

    /// Whether `user_id` is watched.
    pub(crate) fn watches(&self, user_id: &str) -> bool {
        self.state.lock().index.contains_key(user_id)
    }

    /// The watched users, by slot.
    pub fn users(&self) -> Vec<CompactString> {
        self.state.lock().slots.iter().filter_map(|slot| slot.user_id.clone()).collect()
    }

    /// How many users are watched.
    pub fn len(&self) -> usize {
        self.state.lock().index.len()
    }

    /// How many distinct users of `users` are not watched.
    pub fn unwatched(&self, users: &[CompactString]) -> usize {
        let state = self.state.lock();
        let mut seen = HashSet::new();
        users.iter().filter(|user_id| !state.index.contains_key(*user_id) && seen.insert(*user_id)).count()
    }

    /// Whether no user is watched.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub(crate) fn set_hidden(&self, user_id: &str, hidden: bool) {
        let mut state = self.state.lock();
        if let Some(&slot) = state.index.get(user_id) {
            state.slots[slot as usize].hidden = hidden;
        }
    }

    /// Delivers a change that relations made (a user hidden or revealed),
    /// whether or not the user is hidden from the viewer.
    pub(crate) fn post_transition(&self, user_id: &str, change: Pending) {
        let slot = self.state.lock().index.get(user_id).copied();
        if let Some(slot) = slot {
            self.post(slot, user_id, change, true);
        }
    }

    /// Takes a slot for each of `users` not yet watched, marked hidden as
    /// `hidden` says; returns the users added, with their slots.
    fn add(&self, users: &[CompactString], hidden: &impl Fn(&str) -> bool) -> Vec<(CompactString, u32)> {
        let mut state = self.state.lock();
        let mut added = Vec::new();
        for user_id in users {
            if state.index.contains_key(user_id) {
                continue;
            }
            let slot = match state.free.pop() {
                Some(slot) => slot,
                None => {
                    state.slots.push(Slot::default());
                    u32::try_from(state.slots.len() - 1).expect("a watch holds far fewer than 2^32 users")
                }
            };
            state.slots[slot as usize] =
                Slot { user_id: Some(user_id.clone()), hidden: hidden(user_id), held: 0, pending: None };
            state.index.insert(user_id.clone(), slot);
            added.push((user_id.clone(), slot));
        }
        added
    }

    /// Empties the slots of `users` (already out of their topics) for reuse.
    fn remove(&self, users: &[(CompactString, u32)]) {
        let mut state = self.state.lock();
        let MailboxState { slots, index, free, queue, .. } = &mut *state;
        for (user_id, slot) in users {
            index.remove(user_id);
            if slots[*slot as usize].pending.is_some() {
                queue.retain(|queued| queued != slot);
            }
            slots[*slot as usize] = Slot::default();
            free.push(*slot);
        }
    }

    /// The slots of those of `users` that are watched.
    fn slots_of(&self, users: &[CompactString]) -> Vec<(CompactString, u32)> {
        let state = self.state.lock();
        let mut slots: Vec<(CompactString, u32)> =
            users.iter().filter_map(|user_id| state.index.get(user_id).map(|&slot| (user_id.clone(), slot))).collect();
        slots.sort_unstable_by_key(|(_, slot)| *slot);
        slots.dedup_by_key(|(_, slot)| *slot);
        slots
    }
}

impl Hub {
    /// Subscribes a new mailbox of `capacity` users to `user_ids` (repeats are
    /// ignored, the order of first mention kept) for `viewer`, with `hidden`
    /// the watched users it may not see. Changes published from now on reach
    /// it; the subscription ends when dropped.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        user_ids: impl IntoIterator<Item = CompactString>,
        capacity: usize,
        viewer: Option<CompactString>,
        hidden: impl Fn(&str) -> bool,
    ) -> Subscription {
        let mailbox = Arc::new(Mailbox {
            id: self.next_mailbox_id.fetch_add(1, Ordering::Relaxed),
            viewer: viewer.clone(),
            state: Mutex::new(MailboxState::default()),
            capacity: capacity.max(1),
            ready: Notify::new(),
        });
        let subscription = Subscription { hub: Arc::clone(self), mailbox };
        subscription.add(user_ids, hidden);
        if let Some(viewer) = viewer {
            self.viewers.entry(viewer).or_default().push(Arc::clone(&subscription.mailbox));
        }
        subscription
    }

    /// Delivers a change to every mailbox subscribed to its user whose viewer
    /// may see it; returns how many took it.
    pub(crate) fn publish(&self, change: &PresenceChange) -> usize {
        match self.topics.get(&change.user_id) {
            Some(watchers) => {
                let pending = Pending {
                    presence: change.presence,
                    status: change.status.clone(),
                    hidden: false,
                    encoded: Some(SharedEncoding::default()),
                };
                watchers
                    .iter()
                    .filter(|watcher| watcher.mailbox.post(watcher.slot, &change.user_id, pending.clone(), false))
                    .count()
            }
            None => 0,
        }
    }

    /// Whether `user_id` has a subscriber.
    pub(crate) fn is_watched(&self, user_id: &CompactString) -> bool {
        self.topics.get(user_id).is_some()
    }

    /// The mailboxes watching `user_id`.
    pub(crate) fn watchers_of(&self, user_id: &CompactString) -> Vec<Arc<Mailbox>> {
        self.topics
            .get(user_id)
            .map(|watchers| watchers.iter().map(|watcher| Arc::clone(&watcher.mailbox)).collect())
            .unwrap_or_default()
    }

    /// The mailboxes of `viewer`.
    pub(crate) fn mailboxes_of(&self, viewer: &CompactString) -> Vec<Arc<Mailbox>> {
        self.viewers.get(viewer).map(|mailboxes| mailboxes.value().clone()).unwrap_or_default()
    }

    /// Number of users with at least one subscriber in this process.
    #[cfg(test)]
    pub(crate) fn topics(&self) -> usize {
        self.topics.len()
    }

    /// After a change of relations: the mailboxes whose view of a user no longer
    /// matches `can_see`, among those watching `users` and those of `viewers`
    /// (for every user they watch). Hidden marks are not changed here: the
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
            if let Some(watchers) = self.topics.get(user_id) {
                watchers.iter().for_each(|watcher| check(&watcher.mailbox, user_id));
            }
        }
        for viewer in viewers {
            let Some(mailboxes) = self.viewers.get(viewer).map(|entry| entry.value().clone()) else { continue };
            for mailbox in &mailboxes {
                mailbox.users().iter().for_each(|user_id| check(mailbox, user_id));
            }
        }
        // A mailbox reached both as a watcher of a user and as its viewer's must change once.
        transitions.sort_by(|a, b| (a.mailbox.id, &a.user_id).cmp(&(b.mailbox.id, &b.user_id)));
        transitions.dedup_by(|a, b| a.mailbox.id == b.mailbox.id && a.user_id == b.user_id);
        transitions
    }

    fn leave_topics(&self, mailbox: &Mailbox, users: &[(CompactString, u32)]) {
        for (user_id, _) in users {
            if let Entry::Occupied(mut topic) = self.topics.entry(user_id.clone()) {
                topic.get_mut().retain(|other| other.mailbox.id != mailbox.id);
                if topic.get().is_empty() {
                    topic.remove();
                }
            }
        }
    }

    fn unsubscribe(&self, mailbox: &Mailbox) {
        let users = mailbox.slots_of(&mailbox.users());
        self.leave_topics(mailbox, &users);
        if let Some(viewer) = &mailbox.viewer
            && let Entry::Occupied(mut mailboxes) = self.viewers.entry(viewer.clone())
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

    /// The users watched, by slot (for a subscription never changed: the
    /// distinct users subscribed to, in order of first mention).
    pub fn users(&self) -> Vec<CompactString> {
        self.mailbox.users()
    }

    /// Starts watching those of `user_ids` not yet watched (repeats ignored),
    /// `hidden` saying which the viewer may not see; changes published from
    /// now on reach the mailbox. Returns the users added, in order.
    pub fn add(
        &self,
        user_ids: impl IntoIterator<Item = CompactString>,
        hidden: impl Fn(&str) -> bool,
    ) -> Vec<CompactString> {
        let mut seen = HashSet::new();
        let users: Vec<CompactString> = user_ids.into_iter().filter(|user_id| seen.insert(user_id.clone())).collect();
        let added = self.mailbox.add(&users, &hidden);
        for (user_id, slot) in &added {
            let watcher = Watcher { mailbox: Arc::clone(&self.mailbox), slot: *slot };
            self.hub.topics.entry(user_id.clone()).or_default().push(watcher);
        }
        added.into_iter().map(|(user_id, _)| user_id).collect()
    }

    /// Stops watching those of `user_ids` that are watched: nothing more of
    /// them reaches the mailbox, and what of them was pending is dropped.
    /// Returns how many were removed.
    pub fn remove(&self, user_ids: &[CompactString]) -> usize {
        let users = self.mailbox.slots_of(user_ids);
        // Out of the topics first: once a topic no longer lists the slot, no publisher can post to it.
        self.hub.leave_topics(&self.mailbox, &users);
        self.mailbox.remove(&users);
        users.len()
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
    use indexmap::IndexMap;
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
            presence: Presence::new(state, version),
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
            assert_eq!(pending["alice"], Presence::new(State::Online, 5));
        }
        drop(viewers);
        assert_eq!(hub.topics(), 0, "topics leave with their last subscriber");
    }

    #[test]
    fn e5_every_viewer_posted_a_change_shares_one_encoding_of_it() {
        let hub = Arc::new(Hub::default());
        let viewers: Vec<_> = (0..3).map(|_| watch(&hub, vec!["alice".into()], 16)).collect();
        hub.publish(&change("alice", State::Online, 5));
        let taken: Vec<Pending> = viewers
            .iter()
            .map(|viewer| match viewer.mailbox().take() {
                Delivery::Changes(mut changes) => changes.pop().expect("alice's change").1,
                Delivery::Resync => panic!("unexpected resync"),
            })
            .collect();
        let first = taken[0].encoded.as_ref().expect("a published change carries its shared encoding");
        first.get_or_init(|| bytes::Bytes::from_static(b"encoded once"));
        for pending in &taken[1..] {
            let shared = pending.encoded.as_ref().expect("shared");
            assert!(Arc::ptr_eq(first, shared), "one encoding for every viewer");
            assert_eq!(shared.get().map(|bytes| &bytes[..]), Some(&b"encoded once"[..]));
        }
        hub.publish(&change("alice", State::Offline, 6));
        let Delivery::Changes(next) = viewers[0].mailbox().take() else { panic!("unexpected resync") };
        assert!(next[0].1.encoded.as_ref().is_some_and(|next| next.get().is_none()), "a new change, a new encoding");
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
        assert_eq!(pending["alice"], Presence::new(State::Offline, 7));
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

    #[test]
    fn e7_added_users_get_changes_removed_ones_none_and_the_others_lose_nothing() {
        let hub = Arc::new(Hub::default());
        let viewer = watch(&hub, vec!["a".into(), "b".into()], 16);
        hub.publish(&change("a", State::Online, 1));
        assert_eq!(viewer.add(["b".into(), "c".into(), "c".into()], |_| false), ["c"], "only new users are added");
        hub.publish(&change("c", State::Online, 2));
        assert_eq!(viewer.remove(&["b".into(), "b".into()]), 1);
        hub.publish(&change("b", State::Online, 3));
        let pending: Vec<_> = changes(&viewer).into_iter().map(|(user, p)| (user, p.version)).collect();
        assert_eq!(pending, [("a".into(), 1), ("c".into(), 2)], "a's change survived the update; b sent nothing");
        assert_eq!(hub.topics(), 2, "b's topic left with its only watcher");
        assert_eq!(viewer.users(), ["a", "c"]);
    }

    #[test]
    fn e7_a_reused_slot_never_takes_a_change_of_the_user_before() {
        let hub = Arc::new(Hub::default());
        let viewer = watch(&hub, vec!["a".into(), "b".into()], 16);
        hub.publish(&change("b", State::Online, 5));
        viewer.remove(&["b".into()]);
        viewer.add(["c".into()], |_| false);
        assert_eq!(viewer.users(), ["a", "c"], "c took b's slot");
        // A relation transition computed for b before its removal arrives late.
        viewer.mailbox().post(1, "b", Pending::alone(Presence::UNKNOWN, None, true), true);
        assert!(changes(&viewer).is_empty(), "b's pending change left with it, and the late one found c's slot");
        hub.publish(&change("c", State::Online, 6));
        assert_eq!(changes(&viewer)["c"].version, 6);
    }

    #[test]
    fn e3_changes_not_newer_than_the_snapshot_are_dropped_whenever_they_arrive() {
        let hub = Arc::new(Hub::default());
        let viewer = watch(&hub, vec!["a".into(), "b".into()], 16);
        // Published after the subscription, before the snapshot was read: already in it.
        hub.publish(&change("a", State::Online, 4));
        viewer.mailbox().hold(&["a".into(), "b".into()], [4, 9]);
        assert_eq!(hub.publish(&change("b", State::Offline, 8)), 0, "older than the snapshot: never posted");
        assert!(changes(&viewer).is_empty(), "the change already in the snapshot is not sent again");
        hub.publish(&change("a", State::Offline, 5));
        assert_eq!(changes(&viewer)["a"].version, 5);
    }
}
