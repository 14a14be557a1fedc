//! The room watchers' topics (R3, R5): one per watched room in this process,
//! however many watch it, and each member-mode watcher's mailbox.
//!
//! A publisher drops each change into the watchers' mailboxes and moves on;
//! a mailbox conflates per member (the newest change, a join followed by an
//! update staying a join, a join followed by a leave cancelling out) and per
//! signal kind, and keeps changes in version order. A watcher with more than
//! its capacity pending is resynced with a fresh snapshot, and never slows a
//! gateway. The streams that read the mailboxes are in `rooms.rs`.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use hashbrown::HashMap;
use parking_lot::Mutex;
use presence_core::{CompactString, RoomChange, RoomChangeKind, RoomEventBody};
use tokio::sync::Notify;

use crate::node::count_board::CountBoard;

/// The room topics of one process.
#[derive(Debug, Default)]
pub(crate) struct RoomHub {
    topics: DashMap<CompactString, Vec<Arc<RoomMailbox>>>,
    next_id: AtomicU64,
    /// The rooms count streams watch, touched by all that may change a count (R7).
    pub(crate) counts: CountBoard,
}

/// One member-mode watcher's pending room changes.
#[derive(Debug)]
pub(crate) struct RoomMailbox {
    id: u64,
    /// The viewer it serves; `None`: a service acting for no viewer.
    viewer: Option<CompactString>,
    state: Mutex<RoomPending>,
    capacity: usize,
    /// Woken when something is pending.
    pub(crate) ready: Notify,
}

#[derive(Debug, Default)]
struct RoomPending {
    /// In publication order; a conflated-away change leaves a `None`.
    changes: Vec<Option<RoomChange>>,
    /// Live entries of `changes`.
    live: usize,
    /// The position in `changes` of each member's or signal kind's pending change.
    positions: HashMap<Key, usize>,
    /// The version of the last change delivered for each member or kind:
    /// publishers race after the store's lock, so a change may arrive after
    /// a newer one of the same member and must then be dropped.
    delivered: HashMap<Key, u64>,
    /// The version of the snapshot the watcher holds: anything not newer is in it.
    floor: u64,
    /// Too much is pending: the watcher gets a fresh snapshot instead.
    resync: bool,
    /// Who may read the room may have changed: check before sending more.
    recheck: bool,
}

/// What a member watcher takes from its mailbox.
pub(crate) enum RoomDelivery {
    /// In version order.
    Changes(Vec<RoomChange>),
    Resync,
}

/// What conflates: one member's changes, or one kind's signal sets.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Key {
    Member(CompactString),
    Signal(CompactString),
}

impl Key {
    fn of(change: &RoomChange) -> Option<Key> {
        match &change.body {
            // Member mode shows sessions only in snapshots.
            RoomEventBody::Sessions => None,
            RoomEventBody::Member { member, .. } => Some(Key::Member(member.user_id.clone())),
            RoomEventBody::Signals { kind, .. } => Some(Key::Signal(kind.clone())),
        }
    }
}

impl RoomPending {
    /// Starts over: nothing pending, nothing delivered.
    fn reset(&mut self, resync: bool) {
        let recheck = self.recheck;
        *self = RoomPending { resync, recheck, ..RoomPending::default() };
    }
}

impl RoomMailbox {
    /// Keeps the change (conflated) and wakes the stream; false if it was dropped.
    fn post(&self, change: &RoomChange) -> bool {
        let Some(key) = Key::of(change) else { return false };
        let wake = {
            let mut pending = self.state.lock();
            let newest = pending.delivered.get(&key).copied().unwrap_or(0).max(pending.floor);
            if pending.resync || change.version <= newest {
                return false;
            }
            let mut change = change.clone();
            if let Some(&at) = pending.positions.get(&key) {
                let held = pending.changes[at].as_ref().expect("positions point at live entries");
                if held.version >= change.version {
                    return false;
                }
                let earlier = pending.changes[at].take().expect("positions point at live entries");
                pending.positions.remove(&key);
                pending.live -= 1;
                if let (
                    RoomEventBody::Member { kind: RoomChangeKind::Joined, .. },
                    RoomEventBody::Member { kind: later, .. },
                ) = (&earlier.body, &mut change.body)
                {
                    match later {
                        // The watcher never saw the join: nothing to tell.
                        RoomChangeKind::Left => return false,
                        RoomChangeKind::Updated => *later = RoomChangeKind::Joined,
                        RoomChangeKind::Joined => {}
                    }
                }
            }
            if pending.live >= self.capacity {
                pending.reset(true);
            } else {
                let at = pending.changes.len();
                pending.changes.push(Some(change));
                pending.live += 1;
                pending.positions.insert(key, at);
            }
            pending.live == 1 || pending.resync
        };
        if wake {
            self.ready.notify_one();
        }
        true
    }

    /// Takes what is pending (and whether to check the right to read first).
    pub(crate) fn take(&self) -> (RoomDelivery, bool) {
        let mut pending = self.state.lock();
        let recheck = std::mem::take(&mut pending.recheck);
        if pending.resync {
            pending.reset(false);
            return (RoomDelivery::Resync, recheck);
        }
        let floor = pending.floor;
        let mut changes: Vec<RoomChange> = std::mem::take(&mut pending.changes)
            .into_iter()
            .flatten()
            .filter(|change| change.version > floor)
            .collect();
        pending.positions.clear();
        pending.live = 0;
        changes.sort_unstable_by_key(|change| change.version);
        for change in &changes {
            if let Some(key) = Key::of(change) {
                pending.delivered.insert(key, change.version);
            }
        }
        (RoomDelivery::Changes(changes), recheck)
    }

    /// The watcher now holds a snapshot of `version`.
    pub(crate) fn hold(&self, version: u64) {
        let mut pending = self.state.lock();
        pending.delivered.clear();
        pending.floor = version;
    }

    fn mark(&self, resync: bool) {
        {
            let mut pending = self.state.lock();
            if resync {
                pending.reset(true);
            }
            pending.recheck = true;
        }
        self.ready.notify_one();
    }
}

/// A member watcher's place in its room's topic; leaves it when dropped.
pub(crate) struct RoomSubscription {
    hub: Arc<RoomHub>,
    room_id: CompactString,
    pub(crate) mailbox: Arc<RoomMailbox>,
}

impl Drop for RoomSubscription {
    fn drop(&mut self) {
        if let dashmap::Entry::Occupied(mut topic) = self.hub.topics.entry(self.room_id.clone()) {
            topic.get_mut().retain(|other| other.id != self.mailbox.id);
            if topic.get().is_empty() {
                topic.remove();
            }
        }
    }
}

impl RoomHub {
    /// A member watcher of `room_id` for `viewer`, pending at most `capacity` changes.
    pub(crate) fn subscribe(
        self: &Arc<Self>,
        room_id: &CompactString,
        viewer: Option<CompactString>,
        capacity: usize,
    ) -> RoomSubscription {
        let mailbox = Arc::new(RoomMailbox {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            viewer,
            state: Mutex::default(),
            capacity: capacity.max(1),
            ready: Notify::new(),
        });
        self.topics.entry(room_id.clone()).or_default().push(Arc::clone(&mailbox));
        RoomSubscription { hub: Arc::clone(self), room_id: room_id.clone(), mailbox }
    }

    /// Delivers a room change to the room's member watchers; returns how many took it.
    pub(crate) fn publish(&self, change: &RoomChange) -> usize {
        self.counts.touch(&change.room_id);
        let Some(watchers) = self.topics.get(&change.room_id) else { return 0 };
        // A member leaving may end a viewer's right to read the room.
        let leaving = match &change.body {
            RoomEventBody::Member { kind: RoomChangeKind::Left, member } => Some(&member.user_id),
            _ => None,
        };
        let mut delivered = 0;
        for mailbox in watchers.iter() {
            if leaving.is_some() && mailbox.viewer.as_ref() == leaving {
                mailbox.mark(false);
            }
            delivered += usize::from(mailbox.post(change));
        }
        delivered
    }

    /// This node no longer answers for the rooms `rooms` accepts (their slot
    /// moved, C1): their watchers check, and end.
    pub(crate) fn end_rooms(&self, rooms: &dyn Fn(&str) -> bool) {
        for topic in self.topics.iter().filter(|topic| rooms(topic.key())) {
            topic.value().iter().for_each(|mailbox| mailbox.mark(false));
        }
    }

    /// The room's access changed: its watchers check whether they may still read it.
    pub(crate) fn access_changed(&self, room_id: &str) {
        self.counts.touch(room_id);
        if let Some(watchers) = self.topics.get(room_id) {
            watchers.iter().for_each(|mailbox| mailbox.mark(false));
        }
    }

    /// Relations changed for these users and viewers: the member watchers of
    /// the users' rooms, and the viewers' own, resync (what they may be shown changed).
    pub(crate) fn relations_changed(&self, rooms: &[CompactString], viewers: &[CompactString]) {
        for room_id in rooms {
            // Who is counted may have changed (R4).
            self.counts.touch(room_id);
            if let Some(watchers) = self.topics.get(room_id) {
                watchers.iter().filter(|mailbox| mailbox.viewer.is_some()).for_each(|mailbox| mailbox.mark(true));
            }
        }
        if viewers.is_empty() {
            return;
        }
        for topic in self.topics.iter() {
            for mailbox in topic.value() {
                if mailbox.viewer.as_ref().is_some_and(|viewer| viewers.contains(viewer)) {
                    mailbox.mark(true);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use presence_core::RoomMember;

    fn member_change(user: &str, kind: RoomChangeKind, version: u64, tab: &str) -> RoomChange {
        let metadata: presence_core::RoomMetadata = vec![("tab".to_string(), tab.to_string())].into();
        RoomChange {
            room_id: "room".into(),
            version,
            users: 1,
            sessions: 1,
            body: RoomEventBody::Member { kind, member: RoomMember { user_id: user.into(), metadata, sessions: 1 } },
        }
    }

    fn mailbox(capacity: usize) -> RoomMailbox {
        RoomMailbox { id: 0, viewer: None, state: Mutex::default(), capacity, ready: Notify::new() }
    }

    fn taken(mailbox: &RoomMailbox) -> Vec<(String, RoomChangeKind, u64)> {
        let (RoomDelivery::Changes(changes), _) = mailbox.take() else { panic!("unexpected resync") };
        changes
            .into_iter()
            .map(|change| match change.body {
                RoomEventBody::Member { kind, member } => (member.user_id.to_string(), kind, change.version),
                other => panic!("unexpected {other:?}"),
            })
            .collect()
    }

    #[test]
    fn r3_a_slow_watcher_gets_each_members_newest_change_in_version_order() {
        let mailbox = mailbox(16);
        mailbox.post(&member_change("a", RoomChangeKind::Joined, 10, "one"));
        mailbox.post(&member_change("b", RoomChangeKind::Joined, 11, "one"));
        mailbox.post(&member_change("a", RoomChangeKind::Updated, 12, "two"));
        mailbox.post(&member_change("c", RoomChangeKind::Joined, 13, "one"));
        mailbox.post(&member_change("c", RoomChangeKind::Left, 14, "one"));
        // A publisher that lost the race delivers an older change of b late.
        mailbox.post(&member_change("b", RoomChangeKind::Updated, 9, "old"));
        let changes = taken(&mailbox);
        assert_eq!(
            changes,
            [("b".into(), RoomChangeKind::Joined, 11), ("a".into(), RoomChangeKind::Joined, 12)],
            "a joined and updated: still a join (with the new metadata); c joined and left: nothing"
        );
        // Delivered versions hold: an older change arriving after them is dropped.
        assert!(!mailbox.post(&member_change("a", RoomChangeKind::Updated, 11, "stale")));
        assert!(taken(&mailbox).is_empty());
    }

    #[test]
    fn r3_nothing_not_newer_than_the_snapshot_is_sent_and_a_full_mailbox_resyncs() {
        let mailbox = mailbox(2);
        mailbox.post(&member_change("a", RoomChangeKind::Joined, 5, "one"));
        mailbox.hold(6);
        assert!(!mailbox.post(&member_change("b", RoomChangeKind::Joined, 6, "one")), "in the snapshot already");
        assert!(taken(&mailbox).is_empty(), "a change posted before the snapshot was read is in it");
        for (version, user) in [(7, "a"), (8, "b"), (9, "c")] {
            mailbox.post(&member_change(user, RoomChangeKind::Joined, version, "one"));
        }
        assert!(matches!(mailbox.take().0, RoomDelivery::Resync), "a third member past a capacity of 2");
        mailbox.hold(9);
        mailbox.post(&member_change("d", RoomChangeKind::Joined, 10, "one"));
        assert_eq!(taken(&mailbox), [("d".into(), RoomChangeKind::Joined, 10)]);
    }
}
