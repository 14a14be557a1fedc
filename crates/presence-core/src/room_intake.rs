//! Rooms across nodes (C1, R5): the facts a node's user shards make, stamped
//! to leave it, and the room owner's intake of them.
//!
//! On a cluster node the user shards do not feed the local room shards: each
//! fact leaves the store stamped by its user shard's clock
//! ([`StampedRoomFact`]), for the server to send to the node that owns the
//! room's slot, whose store takes it in here. A fact is absolute ("U is in R
//! with n sessions showing M", "U left R", "U signals K in R, or no longer
//! does"), so taking one in twice changes nothing, and one node's facts
//! arrive in the order it made them. What that order cannot settle is a user
//! that changes node (its slot handed over or taken over): facts of its old
//! node may still be on their way when those of the new one arrive. The
//! stamps settle it. A node that takes users in raises its clocks above the
//! last stamp it took in (M4), so the new node's facts carry greater stamps
//! than the old one's; the intake keeps, per room and user, the stamp of the
//! last fact it took in and refuses older ones. A user that left is kept in
//! mind for [`LEFT_KEPT_MS`], so that a late, older fact cannot bring it back.
//!
//! Facts can also be lost: a node that could not reach the owner for a while,
//! an owner new to the room's slot. The node then re-asserts where its users
//! stand ([`RoomFactScan`]); a member the intake last heard of from that node
//! and that the scan leaves out has left, as of the scan.

use std::collections::VecDeque;

use compact_str::CompactString;
use hashbrown::HashMap;

use crate::rooms::RoomFact;
use crate::wheel::Tick;

/// How long the intake keeps the stamp of a user that left a room: far
/// longer than a fact takes between two nodes, or a handover takes.
pub const LEFT_KEPT_MS: Tick = 60_000;

/// A fact about a user in a room, stamped by the clock of the user shard
/// that made it; a greater stamp is a later fact of that user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StampedRoomFact {
    /// When its user shard made it.
    pub stamp: u64,
    /// What it says.
    pub fact: RoomFact,
    /// For a `Member` fact: the user's own node holds it invisible, so that
    /// the room's counts leave it out (R4). The store makes every fact with
    /// `false`; the node that sends it knows the user's visibility.
    pub invisible: bool,
}

impl StampedRoomFact {
    /// A fact made at `stamp`, of a user not known to be invisible.
    pub fn new(stamp: u64, fact: RoomFact) -> Self {
        StampedRoomFact { stamp, fact, invisible: false }
    }
}

/// Where a node's users stand in the rooms asked about: a `Member` fact for
/// each user and room it is in, a `Signal` fact for each kind it sends there.
/// Each fact carries the stamp its user shard took when it was read, which
/// every later fact of that shard exceeds; `shard_stamps` are those stamps by
/// user shard, so that the owner knows as of when each user was left out.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoomFactScan {
    /// The facts, each stamped as of the scan of its user's shard.
    pub facts: Vec<StampedRoomFact>,
    /// The stamp of each user shard's scan, by shard.
    pub shard_stamps: Vec<u64>,
}

/// Why a room owner takes in a scan, which decides what the change feed
/// records of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScanTakenFor {
    /// Mending rooms it holds from a node's view of its users: what changes
    /// is recorded.
    Mending,
    /// Rebuilding the rooms of slots it just gained (C1): their members did
    /// not change, so the feed records nothing (F3); a room whose last owner
    /// died is covered by the gap its slot's takeover recorded.
    Rebuilding,
}

/// What a room owner holds of each (room, user) whose facts it took in.
#[derive(Debug, Default)]
pub(crate) struct RoomIntake {
    /// By (room, user).
    registers: HashMap<(CompactString, CompactString), Register>,
    /// The nodes facts came from, by the index registers hold.
    sources: Vec<CompactString>,
    /// Users that left, oldest first: each register is dropped once its
    /// time is up, unless a later fact has come since.
    left: VecDeque<(Tick, CompactString, CompactString, u64)>,
}

/// What [`RoomIntake::admit`] made of a fact.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Admitted {
    /// A fact at least as new was taken in before: it is dropped.
    Stale,
    /// The newest fact of its user in its room.
    Newer,
    /// The newest, from another node than the last one, which held the
    /// member: the user moved, and its signals did not move with it (C3).
    FromAnotherNode,
}

#[derive(Debug, Clone, Copy)]
struct Register {
    /// The stamp of the last fact taken in.
    stamp: u64,
    /// The node it came from.
    source: u16,
    /// Whether the user is in the room.
    member: bool,
    /// Whether its node holds it invisible.
    invisible: bool,
}

impl RoomIntake {
    /// Whether `fact`, made at `stamp` and sent by `source`, is newer than
    /// every fact of its user in its room taken in so far; if so it is
    /// recorded, for the caller to apply. A signal of a user that is not in
    /// the room is refused: it can only be a fact whose membership was lost.
    pub(crate) fn admit(&mut self, now: Tick, source: &str, stamp: u64, fact: &RoomFact, invisible: bool) -> Admitted {
        self.forget_left(now);
        let key = (fact.room_id().clone(), fact.user_id().clone());
        let held = self.registers.get(&key).copied();
        if held.is_some_and(|held| held.stamp >= stamp) {
            return Admitted::Stale;
        }
        let member = match fact {
            RoomFact::Member { .. } => true,
            RoomFact::Left { .. } => false,
            RoomFact::Signal { .. } if held.is_some_and(|held| held.member) => true,
            RoomFact::Signal { .. } => return Admitted::Stale,
        };
        let source = self.source_index(source);
        if !member {
            self.left.push_back((now, key.0.clone(), key.1.clone(), stamp));
        }
        let invisible = match fact {
            RoomFact::Member { .. } => invisible,
            // A signal says nothing of visibility: it stays as the membership said.
            RoomFact::Signal { .. } => held.is_some_and(|held| held.invisible),
            RoomFact::Left { .. } => false,
        };
        self.registers.insert(key, Register { stamp, source, member, invisible });
        match held {
            Some(held) if held.member && held.source != source => Admitted::FromAnotherNode,
            _ => Admitted::Newer,
        }
    }

    /// Whether `user_id` is a member of `room_id` its node holds invisible.
    pub(crate) fn is_invisible(&self, room_id: &str, user_id: &str) -> bool {
        let key = (CompactString::from(room_id), CompactString::from(user_id));
        self.registers.get(&key).is_some_and(|held| held.member && held.invisible)
    }

    /// The stamp of the last fact of `user_id` in `room_id` taken in.
    pub(crate) fn stamp(&self, room_id: &str, user_id: &str) -> Option<u64> {
        self.registers.get(&(CompactString::from(room_id), CompactString::from(user_id))).map(|held| held.stamp)
    }

    /// The members, in rooms `rooms` accepts, whose last fact `source` sent.
    pub(crate) fn members_from(
        &self,
        source: &str,
        rooms: &dyn Fn(&str) -> bool,
    ) -> Vec<(CompactString, CompactString)> {
        let Some(source) = self.sources.iter().position(|known| known == source) else { return Vec::new() };
        self.registers
            .iter()
            .filter(|((room_id, _), held)| held.member && usize::from(held.source) == source && rooms(room_id))
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// The nodes that sent the last fact of some member.
    pub(crate) fn sources(&self) -> Vec<CompactString> {
        let mut sending = vec![false; self.sources.len()];
        for held in self.registers.values().filter(|held| held.member) {
            sending[usize::from(held.source)] = true;
        }
        self.sources.iter().zip(sending).filter(|(_, sending)| *sending).map(|(source, _)| source.clone()).collect()
    }

    /// Forgets everything of the rooms `rooms` accepts.
    pub(crate) fn forget_rooms(&mut self, rooms: &dyn Fn(&str) -> bool) {
        self.registers.retain(|(room_id, _), _| !rooms(room_id));
        self.left.retain(|(_, room_id, _, _)| !rooms(room_id));
    }

    fn source_index(&mut self, source: &str) -> u16 {
        let at = match self.sources.iter().position(|known| known == source) {
            Some(at) => at,
            None => {
                self.sources.push(source.into());
                self.sources.len() - 1
            }
        };
        u16::try_from(at).expect("fewer than 65536 nodes")
    }

    /// Drops the registers of users that left more than [`LEFT_KEPT_MS`] ago.
    fn forget_left(&mut self, now: Tick) {
        while let Some((at, ..)) = self.left.front()
            && at + LEFT_KEPT_MS <= now
        {
            let (_, room_id, user_id, stamp) = self.left.pop_front().expect("looked at");
            let key = (room_id, user_id);
            if self.registers.get(&key).is_some_and(|held| held.stamp == stamp) {
                self.registers.remove(&key);
            }
        }
    }
}
