//! The rooms' side of memberships: who is in each room, with which shown
//! metadata and how many sessions, and who signals what (R1, R2, R5, S3).
//!
//! A room shard owns the rooms whose ids hash to it and nothing of any
//! session: it is fed per-user facts ([`RoomFact`]: "user U is in room R with
//! n sessions showing M", "U left R", "U signals K in R, or no longer does")
//! that the user's shard derives from its sessions, and turns them into the
//! room versions and changes that watchers see. It must not reach into a user
//! shard, so that rooms can later be owned by one node while their members'
//! sessions live on others (R5); the store hands it the facts of one user
//! while holding that user's shard lock, so a user's facts arrive in the
//! order they were made. Lock order: a user shard, then one room shard;
//! never the reverse, never two room shards.
//!
//! Every fact costs O(1) whatever the room's size (a signal fact O(users
//! signalling that kind)): members are a table by user id, counts are kept
//! as they change, and nothing scans the members on a change.

use compact_str::CompactString;
use hashbrown::HashMap;

use crate::checkpoint::CheckpointWriter;
use crate::stamp::StampClock;
use crate::types::{
    RoomAccess, RoomChange, RoomChangeKind, RoomEventBody, RoomMember, RoomMetadata, RoomView, SIGNAL_SET_CAP,
};
use crate::wheel::Tick;

/// What a user's shard tells the room side about one of its users.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum RoomFact {
    /// The user has `sessions` sessions in the room (at least one) and shows `metadata`.
    Member { room_id: CompactString, user_id: CompactString, sessions: u32, metadata: RoomMetadata },
    /// The user has no session in the room any more.
    Left { room_id: CompactString, user_id: CompactString },
    /// At least one of the user's sessions signals `kind` in the room (`on`), or none does any more.
    Signal { room_id: CompactString, user_id: CompactString, kind: CompactString, on: bool },
}

impl RoomFact {
    /// The room the fact is about, which picks its room shard.
    pub(crate) fn room_id(&self) -> &str {
        match self {
            RoomFact::Member { room_id, .. } | RoomFact::Left { room_id, .. } | RoomFact::Signal { room_id, .. } => {
                room_id
            }
        }
    }
}

/// One member of a room.
#[derive(Debug)]
struct Member {
    /// What the member shows: its most recent session's metadata.
    metadata: RoomMetadata,
    /// Its sessions in the room, for counts.
    sessions: u32,
}

/// The users signalling one kind in a room.
#[derive(Debug)]
struct SignalSet {
    kind: CompactString,
    /// In the order they started; few at a time (a typing indicator).
    users: Vec<CompactString>,
}

impl SignalSet {
    fn listed(&self) -> (Vec<CompactString>, u32) {
        (self.users.iter().take(SIGNAL_SET_CAP).cloned().collect(), self.users.len() as u32)
    }
}

/// One room.
#[derive(Debug, Default)]
struct Room {
    /// A stamp of the room shard's clock, moved by every change of membership,
    /// shown metadata or signal set (R6).
    version: u64,
    /// Sessions of all members, kept as members change.
    sessions: u32,
    /// Who may see it; a room with non-default access is kept while empty.
    access: RoomAccess,
    members: HashMap<CompactString, Member>,
    /// One set per kind with at least one user signalling it.
    signals: Vec<SignalSet>,
}

impl Room {
    /// Whether the room holds nothing worth keeping: no member, default access.
    fn is_empty(&self) -> bool {
        self.members.is_empty() && self.signals.is_empty() && self.access == RoomAccess::default()
    }
}

/// The rooms whose ids hash to one shard, and their clock.
#[derive(Debug)]
pub(crate) struct RoomShard {
    /// The latest time a fact brought; never goes back.
    now: Tick,
    /// Source of room versions: stamps keep growing while a room is dropped
    /// and made again, so a room that empties and fills goes on with larger versions.
    stamps: StampClock,
    rooms: HashMap<CompactString, Room>,
}

impl RoomShard {
    pub(crate) fn new(now: Tick) -> Self {
        RoomShard { now, stamps: StampClock::default(), rooms: HashMap::new() }
    }

    /// Applies one user's fact, appending the change watchers see, if any.
    pub(crate) fn apply(&mut self, now: Tick, fact: RoomFact, changes: &mut Vec<RoomChange>) {
        self.now = self.now.max(now);
        let now = self.now;
        match fact {
            RoomFact::Member { room_id, user_id, sessions, metadata } => {
                let room = self.rooms.entry_ref(room_id.as_str()).or_default();
                let body = match room.members.get_mut(&user_id) {
                    None => {
                        room.sessions += sessions;
                        room.members.insert(user_id.clone(), Member { metadata: metadata.clone(), sessions });
                        room.version = self.stamps.next(now);
                        Some(RoomChangeKind::Joined)
                    }
                    Some(member) => {
                        room.sessions = room.sessions - member.sessions + sessions;
                        let counted = std::mem::replace(&mut member.sessions, sessions);
                        if member.metadata != metadata {
                            member.metadata = metadata.clone();
                            room.version = self.stamps.next(now);
                            Some(RoomChangeKind::Updated)
                        } else if counted == sessions {
                            return;
                        } else {
                            None
                        }
                    }
                };
                let body = match body {
                    Some(kind) => RoomEventBody::Member { kind, member: RoomMember { user_id, metadata, sessions } },
                    None => RoomEventBody::Sessions,
                };
                changes.push(change(room_id, room, body));
            }
            RoomFact::Left { room_id, user_id } => {
                let Some(room) = self.rooms.get_mut(room_id.as_str()) else { return };
                let Some(member) = room.members.remove(&user_id) else { return };
                room.sessions -= member.sessions;
                // The sessions' side ends a member's signals before it leaves;
                // a set that still names it is mended here all the same.
                let mut i = 0;
                while i < room.signals.len() {
                    if let Some(at) = room.signals[i].users.iter().position(|u| *u == user_id) {
                        room.signals[i].users.remove(at);
                        room.version = self.stamps.next(now);
                        let (user_ids, count) = room.signals[i].listed();
                        let kind = room.signals[i].kind.clone();
                        if room.signals[i].users.is_empty() {
                            room.signals.swap_remove(i);
                        } else {
                            i += 1;
                        }
                        changes.push(change(room_id.clone(), room, RoomEventBody::Signals { kind, user_ids, count }));
                    } else {
                        i += 1;
                    }
                }
                room.version = self.stamps.next(now);
                let member = RoomMember { user_id, metadata: member.metadata, sessions: 0 };
                let body = RoomEventBody::Member { kind: RoomChangeKind::Left, member };
                changes.push(change(room_id.clone(), room, body));
                if room.is_empty() {
                    self.rooms.remove(room_id.as_str());
                }
            }
            RoomFact::Signal { room_id, user_id, kind, on } => {
                let room = self.rooms.entry_ref(room_id.as_str()).or_default();
                let at = room.signals.iter().position(|set| set.kind == kind);
                let at = match (at, on) {
                    (Some(at), true) if room.signals[at].users.contains(&user_id) => return,
                    (Some(at), true) => {
                        room.signals[at].users.push(user_id);
                        at
                    }
                    (None, true) => {
                        room.signals.push(SignalSet { kind: kind.clone(), users: vec![user_id] });
                        room.signals.len() - 1
                    }
                    (Some(at), false) => {
                        let Some(position) = room.signals[at].users.iter().position(|u| *u == user_id) else { return };
                        room.signals[at].users.remove(position);
                        at
                    }
                    (None, false) => return,
                };
                room.version = self.stamps.next(now);
                let (user_ids, count) = room.signals[at].listed();
                if count == 0 {
                    room.signals.swap_remove(at);
                }
                changes.push(change(room_id, room, RoomEventBody::Signals { kind, user_ids, count }));
            }
        }
    }

    /// The room's version; 0 for a room this shard holds nothing about.
    pub(crate) fn version(&self, room_id: &str) -> u64 {
        self.rooms.get(room_id).map_or(0, |room| room.version)
    }

    /// The room as it is, its members listed unless there are more than `member_cap`.
    pub(crate) fn view(&self, room_id: &str, member_cap: usize) -> RoomView {
        let Some(room) = self.rooms.get(room_id) else {
            return RoomView {
                room_id: room_id.into(),
                version: 0,
                users: 0,
                sessions: 0,
                access: RoomAccess::default(),
                members: Some(Vec::new()),
                signals: Vec::new(),
            };
        };
        let members = (room.members.len() <= member_cap).then(|| {
            room.members
                .iter()
                .map(|(user_id, member)| RoomMember {
                    user_id: user_id.clone(),
                    metadata: member.metadata.clone(),
                    sessions: member.sessions,
                })
                .collect()
        });
        let signals = room
            .signals
            .iter()
            .map(|set| {
                let (user_ids, count) = set.listed();
                (set.kind.clone(), user_ids, count)
            })
            .collect();
        RoomView {
            room_id: room_id.into(),
            version: room.version,
            users: room.members.len() as u32,
            sessions: room.sessions,
            access: room.access,
            members,
            signals,
        }
    }

    /// Sets who may see the room; a room with non-default access is kept while empty.
    pub(crate) fn set_access(&mut self, room_id: &str, access: RoomAccess) {
        let room = self.rooms.entry_ref(room_id).or_default();
        room.access = access;
        if room.is_empty() {
            self.rooms.remove(room_id);
        }
    }

    pub(crate) fn is_member(&self, room_id: &str, user_id: &str) -> bool {
        self.member_sessions(room_id, user_id) > 0
    }

    /// Rooms held, and users in them counted once per room.
    pub(crate) fn counts(&self) -> (usize, usize) {
        (self.rooms.len(), self.rooms.values().map(|room| room.members.len()).sum())
    }

    /// Who may read the room (the default for a room this shard holds nothing about).
    pub(crate) fn access(&self, room_id: &str) -> RoomAccess {
        self.rooms.get(room_id).map_or(RoomAccess::default(), |room| room.access)
    }

    /// How many of the user's sessions are in the room (0: it is not a member).
    pub(crate) fn member_sessions(&self, room_id: &str, user_id: &str) -> u32 {
        self.rooms.get(room_id).and_then(|room| room.members.get(user_id)).map_or(0, |member| member.sessions)
    }

    /// Writes the shard's clock, the floor of every room version to come, and
    /// the rooms with non-default access: members come back with their
    /// sessions' leases, signals never (S3).
    pub(crate) fn checkpoint(&self, writer: &mut CheckpointWriter) {
        writer.clock(self.stamps.last());
        for (room_id, room) in &self.rooms {
            if room.access != RoomAccess::default() {
                writer.room(room_id, room.access);
            }
        }
    }

    /// Makes every room version from now on greater than `last_stamp`.
    pub(crate) fn restore_clock(&mut self, last_stamp: u64) {
        self.stamps.raise_to(last_stamp);
    }

    /// Gives every restored room a version above every one it had before the
    /// restart: called once every clock of the checkpoint is restored, since
    /// the facts of restored members may come before the clocks.
    pub(crate) fn finish_restore(&mut self, now: Tick) {
        self.now = self.now.max(now);
        for room in self.rooms.values_mut() {
            room.version = self.stamps.next(self.now);
        }
    }
}

fn change(room_id: CompactString, room: &Room, body: RoomEventBody) -> RoomChange {
    RoomChange { room_id, version: room.version, users: room.members.len() as u32, sessions: room.sessions, body }
}
