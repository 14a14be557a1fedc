//! The change feed's intake (F1): every change a backend's feed carries,
//! given its position in the feed under the lock that made it.
//!
//! Viewers may skip changes (a Watch sends the newest version of a user and
//! ignores anything older), but a feed consumer must see every flip, in each
//! user's version order, and a consumer resuming from a position must see
//! everything after it exactly once. Both hold only if the order in which
//! changes enter the feed is the order in which they were made: two
//! operations on one user run one after the other under its shard's lock,
//! but publish after releasing it, in either order. So a change is recorded
//! here while the lock that made it is still held: a user's under its user
//! shard's lock, a room's under its room shard's. Lock order: a shard's lock,
//! then the intake's, never the reverse.
//!
//! A position is a stamp ([`crate::stamp`]) of one clock per store: it grows
//! with every entry, stays within a millisecond of the store time, and so
//! goes on above the positions of an earlier process once the server raises
//! the clock to the last position its log holds. Whatever takes entries out
//! ([`FeedIntake::drain`]) takes every entry up to a position and none
//! after it, so a log appended in drain order is in position order.
//!
//! The intake never blocks the store on its reader: past `capacity` pending
//! entries it drops what comes next, keeping only the range of positions it
//! dropped, which the reader turns into an explicit gap (F2).

use std::sync::Arc;

use compact_str::CompactString;

use crate::stamp::StampClock;
use crate::sync::Mutex;
use crate::types::{PresenceChange, RoomChange, RoomChangeKind, RoomEventBody};
use crate::wheel::Tick;

/// A room that became occupied (its first member) or empty (its last left).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoomOccupancy {
    /// The room.
    pub room_id: CompactString,
    /// Whether it has members now.
    pub occupied: bool,
    /// The room's version after the change (R2).
    pub version: u64,
    /// The store time of the change.
    pub at: Tick,
}

/// What a feed entry says happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FeedEvent {
    /// A user's flip or status change, as viewers are sent it.
    User(PresenceChange),
    /// A room became occupied or empty.
    Room(RoomOccupancy),
    /// A cluster node took `slot` over from its copy of a node that is gone
    /// (C4): what the gone node recorded for the slot and did not hand on
    /// is lost to the feed, which says so with a gap for the slot (F3).
    TakenOver {
        /// The slot taken over.
        slot: u32,
        /// The store time of the takeover.
        at: Tick,
    },
}

impl FeedEvent {
    /// The user's or the room's id.
    pub fn id(&self) -> &str {
        match self {
            FeedEvent::User(change) => &change.user_id,
            FeedEvent::Room(room) => &room.room_id,
            FeedEvent::TakenOver { .. } => "",
        }
    }

    /// The store time of the change.
    pub fn at(&self) -> Tick {
        match self {
            FeedEvent::User(change) => change.at,
            FeedEvent::Room(room) => room.at,
            FeedEvent::TakenOver { at, .. } => *at,
        }
    }
}

/// One change in the feed, with its position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FeedEntry {
    /// Greater than every earlier entry's of this store.
    pub position: u64,
    /// What happened.
    pub event: FeedEvent,
}

/// Positions the intake gave to entries it dropped, full (see the module).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dropped {
    /// The first dropped entry's position.
    pub first: u64,
    /// The last dropped entry's position.
    pub last: u64,
    /// How many were dropped.
    pub count: u64,
}

/// What one [`FeedIntake::drain`] took out.
#[derive(Debug, Default)]
pub struct Drained {
    /// Every entry recorded since the last drain and kept, in position order.
    pub entries: Vec<FeedEntry>,
    /// The entries dropped since the last drain, all after `entries`.
    pub dropped: Option<Dropped>,
    /// Every entry recorded after this drain has a greater position: the
    /// feed is complete up to here.
    pub through: u64,
}

#[derive(Debug, Default)]
struct Pending {
    clock: StampClock,
    entries: Vec<FeedEntry>,
    dropped: Option<Dropped>,
}

/// Where the store records the changes its feed carries (see the module).
#[derive(Debug)]
pub struct FeedIntake {
    pending: Mutex<Pending>,
    capacity: usize,
}

impl FeedIntake {
    /// An intake that holds at most `capacity` entries between drains, whose
    /// positions start above `after` (the last position an earlier process
    /// wrote, or 0).
    pub fn new(capacity: usize, after: u64) -> Arc<Self> {
        let mut clock = StampClock::default();
        clock.raise_to(after.min(crate::stamp::MAX_STAMP));
        Arc::new(FeedIntake { pending: Mutex::new(Pending { clock, ..Pending::default() }), capacity: capacity.max(1) })
    }

    /// Records the changes of users an operation made (flips and statuses),
    /// called under the lock of their shard.
    pub(crate) fn record_users(&self, changes: &[PresenceChange]) {
        if changes.is_empty() {
            return;
        }
        let mut pending = self.pending.lock();
        for change in changes {
            self.push(&mut pending, change.at, || FeedEvent::User(change.clone()));
        }
    }

    /// Records the occupancy changes among room changes an operation made,
    /// called under the lock of their room shard.
    pub(crate) fn record_rooms(&self, now: Tick, changes: &[RoomChange]) {
        let mut pending = None;
        for change in changes {
            let occupied = match &change.body {
                RoomEventBody::Member { kind: RoomChangeKind::Joined, .. } if change.users == 1 => true,
                RoomEventBody::Member { kind: RoomChangeKind::Left, .. } if change.users == 0 => false,
                _ => continue,
            };
            let pending = pending.get_or_insert_with(|| self.pending.lock());
            self.push(pending, now, || {
                FeedEvent::Room(RoomOccupancy {
                    room_id: change.room_id.clone(),
                    occupied,
                    version: change.version,
                    at: now,
                })
            });
        }
    }

    fn push(&self, pending: &mut Pending, at: Tick, event: impl FnOnce() -> FeedEvent) {
        let position = pending.clock.next(at);
        if pending.dropped.is_none() && pending.entries.len() < self.capacity {
            pending.entries.push(FeedEntry { position, event: event() });
            return;
        }
        let dropped = pending.dropped.get_or_insert(Dropped { first: position, last: position, count: 0 });
        dropped.last = position;
        dropped.count += 1;
    }

    /// Records that `slots` were taken over (see [`FeedEvent::TakenOver`]),
    /// before anything the takeover itself changes is recorded.
    pub fn record_taken_over(&self, slots: impl IntoIterator<Item = u32>, now: Tick) {
        let mut pending = self.pending.lock();
        for slot in slots {
            self.push(&mut pending, now, || FeedEvent::TakenOver { slot, at: now });
        }
    }

    /// Gives every later entry a position above `position`: a cluster node
    /// taking slots over from another raises its feed to the positions the
    /// other gave their entries, so that each slot's entries stay in
    /// position order across the move (F3).
    pub fn raise_to(&self, position: u64) {
        self.pending.lock().clock.raise_to(position.min(crate::stamp::MAX_STAMP));
    }

    /// Takes every entry recorded so far, and raises the clock to `now`, so
    /// that a feed with nothing new is known complete up to the present.
    pub fn drain(&self, now: Tick) -> Drained {
        self.drain_reusing(now, Vec::new())
    }

    /// As [`FeedIntake::drain`], leaving `spare` (emptied) to take the
    /// entries recorded next: a writer that hands back each batch's vector
    /// keeps the intake from growing a new one from nothing every batch
    /// (under a flood of flips, a few megabytes each time, which the
    /// allocator then scatters among the store's own memory).
    pub fn drain_reusing(&self, now: Tick, mut spare: Vec<FeedEntry>) -> Drained {
        spare.clear();
        let mut pending = self.pending.lock();
        let floor = now.min(crate::stamp::MAX_TICK) << crate::stamp::COUNTER_BITS;
        pending.clock.raise_to(floor);
        let entries = std::mem::replace(&mut pending.entries, spare);
        Drained { entries, dropped: pending.dropped.take(), through: pending.clock.last() }
    }

    /// The last position given to an entry (or reached by a drain).
    pub fn last_position(&self) -> u64 {
        self.pending.lock().clock.last()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ChangeKind, Presence, State};

    fn flip(user: &str, version: u64, at: Tick) -> PresenceChange {
        PresenceChange {
            user_id: user.into(),
            kind: ChangeKind::Flip,
            presence: Presence::new(State::Online, version),
            status: None,
            at,
            deadline: None,
        }
    }

    #[test]
    fn positions_grow_and_start_above_the_last_of_an_earlier_process() {
        let intake = FeedIntake::new(10, 5_000 << 20);
        intake.record_users(&[flip("a", 1, 1_000), flip("b", 2, 1_000)]);
        let drained = intake.drain(1_000);
        let positions: Vec<u64> = drained.entries.iter().map(|entry| entry.position).collect();
        assert_eq!(positions, [(5_000 << 20) + 1, (5_000 << 20) + 2]);
        assert_eq!(drained.through, positions[1]);
        intake.record_users(&[flip("a", 3, 6_000)]);
        assert_eq!(intake.drain(6_000).entries[0].position, 6_000 << 20);
    }

    #[test]
    fn a_drain_with_nothing_new_still_moves_the_feed_to_now() {
        let intake = FeedIntake::new(10, 0);
        let drained = intake.drain(7);
        assert!(drained.entries.is_empty());
        assert_eq!(drained.through, 7 << 20);
        intake.record_users(&[flip("a", 1, 7)]);
        assert!(intake.drain(7).entries[0].position > 7 << 20);
    }

    #[test]
    fn past_its_capacity_the_intake_keeps_only_the_range_it_dropped() {
        let intake = FeedIntake::new(2, 0);
        let changes: Vec<PresenceChange> = (1..=5).map(|version| flip("a", version, 1)).collect();
        intake.record_users(&changes);
        let drained = intake.drain(1);
        assert_eq!(drained.entries.len(), 2);
        let dropped = drained.dropped.unwrap();
        assert_eq!((dropped.first, dropped.last, dropped.count), ((1 << 20) + 2, (1 << 20) + 4, 3));
        assert!(dropped.first > drained.entries[1].position);
        intake.record_users(&changes[..1]);
        let again = intake.drain(1);
        assert_eq!((again.entries.len(), again.dropped), (1, None), "room again after a drain");
    }
}
