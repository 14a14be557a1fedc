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
//!
//! Memory is sized by members (R5): a member is 24 bytes in a dense vector
//! (its id, kept once and inline up to 14 bytes, the slot of its shown
//! metadata in the room's side table, where a member showing none costs
//! nothing, and its session count), found through a table of 4-byte
//! positions keyed by a hash of the id, rather than a map whose every bucket
//! holds a key and a value. The vector grows by a quarter at a time, which
//! keeps a room's slack small where doubling would leave up to half of it unused.

use std::hash::BuildHasher;
use std::sync::Arc;

use compact_str::CompactString;
use hashbrown::{DefaultHashBuilder, HashMap, HashTable};

use crate::checkpoint::CheckpointWriter;
use crate::room_intake::{Admitted, RoomIntake, StampedRoomFact};
use crate::stamp::StampClock;
use crate::types::{
    RoomAccess, RoomChange, RoomChangeKind, RoomEventBody, RoomMember, RoomMetadata, RoomView, SIGNAL_SET_CAP,
};
use crate::wheel::Tick;

/// A session's or a member's room metadata in 8 bytes: `None` for none, the
/// common case, which then costs nothing more; otherwise one allocation,
/// shared by the sessions' side and the room's, holding the [`RoomMetadata`]
/// that changes and views hand out, so that handing it out copies nothing.
#[derive(Debug, Clone, Default)]
pub struct MemberMetadata(Option<Arc<RoomMetadata>>);

impl MemberMetadata {
    /// No metadata.
    pub(crate) const NONE: MemberMetadata = MemberMetadata(None);

    /// Metadata of `entries` (none when empty).
    pub fn new(entries: &[(String, String)]) -> Self {
        MemberMetadata((!entries.is_empty()).then(|| Arc::new(Arc::from(entries))))
    }

    /// The entries, in the order they were given.
    pub fn entries(&self) -> &[(String, String)] {
        self.0.as_deref().map_or(&[], |entries| entries)
    }

    /// The metadata as the public types carry it.
    pub(crate) fn shared(&self) -> RoomMetadata {
        static NONE: std::sync::LazyLock<RoomMetadata> = std::sync::LazyLock::new(|| Arc::from(Vec::new()));
        self.0.as_deref().unwrap_or(&NONE).clone()
    }
}

/// Metadata of members or memberships that have any, by 4-byte slot: a
/// record with none holds [`NO_METADATA`] and costs nothing here.
#[derive(Debug, Default)]
pub(crate) struct MetadataSlots {
    /// Free slots hold none and are listed in `free`.
    slots: Vec<MemberMetadata>,
    free: Vec<u32>,
}

/// The slot of a record with no metadata.
pub(crate) const NO_METADATA: u32 = u32::MAX;

impl MetadataSlots {
    /// What the record whose slot is `slot` has.
    pub(crate) fn get(&self, slot: u32) -> &MemberMetadata {
        self.slots.get(slot as usize).unwrap_or(&MemberMetadata::NONE)
    }

    /// Gives the record whose slot is `*slot` `metadata`, taking or freeing
    /// a slot as needed; returns what it had.
    pub(crate) fn set(&mut self, slot: &mut u32, metadata: MemberMetadata) -> MemberMetadata {
        match (*slot, metadata.0.is_some()) {
            (NO_METADATA, false) => metadata,
            (NO_METADATA, true) => {
                *slot = match self.free.pop() {
                    Some(free) => {
                        self.slots[free as usize] = metadata;
                        free
                    }
                    None => {
                        self.slots.push(metadata);
                        u32::try_from(self.slots.len() - 1).ok().filter(|&at| at != NO_METADATA).expect("fewer slots")
                    }
                };
                MemberMetadata::NONE
            }
            (at, true) => std::mem::replace(&mut self.slots[at as usize], metadata),
            (at, false) => {
                *slot = NO_METADATA;
                let had = std::mem::take(&mut self.slots[at as usize]);
                self.free.push(at);
                if self.free.len() == self.slots.len() {
                    // None left: the memory goes back.
                    (self.slots, self.free) = (Vec::new(), Vec::new());
                }
                had
            }
        }
    }
}

impl PartialEq for MemberMetadata {
    fn eq(&self, other: &Self) -> bool {
        self.entries() == other.entries()
    }
}

impl Eq for MemberMetadata {}

/// What a user's shard tells the room side about one of its users. A user
/// shard names the room by its [`RoomName`](crate::room_names::RoomName),
/// which the store turns into the room's id before the room side sees it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RoomFact<R = CompactString> {
    /// The user has `sessions` sessions in the room (at least one) and shows `metadata`.
    Member {
        /// The room.
        room_id: R,
        /// The user.
        user_id: CompactString,
        /// Its sessions in the room.
        sessions: u32,
        /// What it shows: its most recent session's metadata in the room.
        metadata: MemberMetadata,
    },
    /// The user has no session in the room any more.
    Left {
        /// The room.
        room_id: R,
        /// The user.
        user_id: CompactString,
    },
    /// At least one of the user's sessions signals `kind` in the room (`on`), or none does any more.
    Signal {
        /// The room.
        room_id: R,
        /// The user.
        user_id: CompactString,
        /// What it signals ("typing").
        kind: CompactString,
        /// Whether it does now.
        on: bool,
    },
}

impl<R> RoomFact<R> {
    /// The room the fact is about.
    pub fn room_id(&self) -> &R {
        match self {
            RoomFact::Member { room_id, .. } | RoomFact::Left { room_id, .. } | RoomFact::Signal { room_id, .. } => {
                room_id
            }
        }
    }

    /// The same fact, its room named by `name(room)`.
    pub(crate) fn naming<S>(self, name: impl FnOnce(&R) -> S) -> RoomFact<S> {
        let room_id = name(self.room_id());
        match self {
            RoomFact::Member { user_id, sessions, metadata, .. } => {
                RoomFact::Member { room_id, user_id, sessions, metadata }
            }
            RoomFact::Left { user_id, .. } => RoomFact::Left { room_id, user_id },
            RoomFact::Signal { user_id, kind, on, .. } => RoomFact::Signal { room_id, user_id, kind, on },
        }
    }

    /// The user the fact is about.
    pub fn user_id(&self) -> &CompactString {
        match self {
            RoomFact::Member { user_id, .. } | RoomFact::Left { user_id, .. } | RoomFact::Signal { user_id, .. } => {
                user_id
            }
        }
    }
}

/// A member's id in 16 bytes: inline up to 14 bytes, as most ids are, else boxed.
#[derive(Debug, Clone, PartialEq, Eq)]
enum MemberId {
    Inline { len: u8, bytes: [u8; 14] },
    Boxed(Box<CompactString>),
}

impl MemberId {
    fn new(id: &str) -> Self {
        let mut bytes = [0; 14];
        match bytes.get_mut(..id.len()) {
            Some(inline) => {
                inline.copy_from_slice(id.as_bytes());
                MemberId::Inline { len: id.len() as u8, bytes }
            }
            None => MemberId::Boxed(Box::new(id.into())),
        }
    }

    fn as_str(&self) -> &str {
        match self {
            MemberId::Inline { len, bytes } => {
                std::str::from_utf8(&bytes[..usize::from(*len)]).expect("made from a str")
            }
            MemberId::Boxed(id) => id,
        }
    }

    fn is(&self, id: &str) -> bool {
        match self {
            MemberId::Inline { len, bytes } => &bytes[..usize::from(*len)] == id.as_bytes(),
            MemberId::Boxed(boxed) => *boxed.as_str() == *id,
        }
    }
}

/// One member of a room. 24 bytes (see the size test).
#[derive(Debug)]
struct Member {
    /// The room side's own copy of the id (R5: it never reads a user shard's).
    user_id: MemberId,
    /// What the member shows, its most recent session's metadata: a slot in
    /// [`Room::metadata`].
    metadata: u32,
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
    /// On a cluster node, the stamp of the room owner's clock `access` was
    /// set at, which orders the settings every node is sent (0: set here,
    /// or restored).
    access_stamp: u64,
    /// Dense: a member that leaves is replaced by the last one.
    members: Vec<Member>,
    /// Positions in `members`, by the hash of the member's id.
    index: HashTable<u32>,
    /// The shown metadata of the members that show any.
    metadata: MetadataSlots,
    /// One set per kind with at least one user signalling it.
    signals: Vec<SignalSet>,
    /// Of the members and their sessions, those whose own node holds them
    /// invisible (a room taken in from other nodes, R4): counted by nobody.
    invisible: (u32, u32),
}

impl Room {
    /// Whether the room holds nothing worth keeping: no member, default access.
    fn is_empty(&self) -> bool {
        self.members.is_empty() && self.signals.is_empty() && self.access == RoomAccess::default()
    }

    /// The member's position in `members`; `hash` is its id's.
    fn find(&self, hash: u64, user_id: &str) -> Option<usize> {
        let members = &self.members;
        self.index.find(hash, |&at| members[at as usize].user_id.is(user_id)).map(|&at| at as usize)
    }

    /// Adds a member (not in the room yet) with no metadata.
    fn insert(&mut self, hasher: &DefaultHashBuilder, hash: u64, user_id: &str, sessions: u32) -> usize {
        if self.members.len() == self.members.capacity() {
            // A quarter more (not double): O(1) amortised, with little slack.
            self.members.reserve_exact((self.members.len() / 4).max(4));
        }
        let members = &self.members;
        let at = members.len();
        self.index.insert_unique(hash, at as u32, |&at| hasher.hash_one(members[at as usize].user_id.as_str()));
        self.members.push(Member { user_id: MemberId::new(user_id), metadata: NO_METADATA, sessions });
        at
    }

    /// Takes the member at `at` out, with its metadata; the last member takes its position.
    fn remove(&mut self, hasher: &DefaultHashBuilder, hash: u64, at: usize) -> (Member, MemberMetadata) {
        let entry = self.index.find_entry(hash, |&position| position as usize == at);
        entry.expect("a member is indexed").remove();
        let metadata = self.set_metadata(at, MemberMetadata::default());
        let member = self.members.swap_remove(at);
        if let Some(moved) = self.members.get(at) {
            let last = self.members.len() as u32;
            let position = self.index.find_mut(hasher.hash_one(moved.user_id.as_str()), |&position| position == last);
            *position.expect("a member is indexed") = at as u32;
        }
        if self.members.capacity() > 64 && self.members.len() * 4 < self.members.capacity() {
            self.members.shrink_to(self.members.len() * 2);
            let members = &self.members;
            self.index.shrink_to(members.len(), |&at| hasher.hash_one(members[at as usize].user_id.as_str()));
        }
        (member, metadata)
    }

    /// What the member at `at` shows.
    fn metadata(&self, at: usize) -> &MemberMetadata {
        self.metadata.get(self.members[at].metadata)
    }

    /// Makes the member at `at` show `metadata`; returns what it showed.
    fn set_metadata(&mut self, at: usize, metadata: MemberMetadata) -> MemberMetadata {
        self.metadata.set(&mut self.members[at].metadata, metadata)
    }

    /// The member at `at` as listed.
    fn listed(&self, at: usize) -> RoomMember {
        let member = &self.members[at];
        RoomMember {
            user_id: member.user_id.as_str().into(),
            metadata: self.metadata(at).shared(),
            sessions: member.sessions,
        }
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
    /// Hashes the members' ids for every room's index.
    hasher: DefaultHashBuilder,
    /// On a cluster node, what the shard took in of other nodes' facts
    /// (see `room_intake.rs`); empty elsewhere.
    intake: RoomIntake,
}

impl RoomShard {
    pub(crate) fn new(now: Tick) -> Self {
        RoomShard {
            now,
            stamps: StampClock::default(),
            rooms: HashMap::new(),
            hasher: DefaultHashBuilder::default(),
            intake: RoomIntake::default(),
        }
    }

    /// Applies a fact a node sent, made at `stamp`, unless the shard took in
    /// a fact of its user in its room at least as new (see `room_intake.rs`).
    /// Returns whether it was taken in.
    pub(crate) fn take_in(
        &mut self,
        now: Tick,
        source: &str,
        fact: StampedRoomFact,
        changes: &mut Vec<RoomChange>,
    ) -> bool {
        self.now = self.now.max(now);
        let (room_id, user_id) = (fact.fact.room_id().clone(), fact.fact.user_id().clone());
        let hidden_before = self.hidden_sessions(&room_id, &user_id);
        let admitted = self.admit_and_apply(now, source, fact, changes);
        let hidden_after = self.hidden_sessions(&room_id, &user_id);
        if hidden_before != hidden_after
            && let Some(room) = self.rooms.get_mut(room_id.as_str())
        {
            let (users, sessions) = &mut room.invisible;
            *users = *users + u32::from(hidden_after.is_some()) - u32::from(hidden_before.is_some());
            *sessions = *sessions + hidden_after.unwrap_or(0) - hidden_before.unwrap_or(0);
        }
        admitted
    }

    /// The sessions in the room of a member its node holds invisible; `None` for any other user.
    fn hidden_sessions(&self, room_id: &str, user_id: &str) -> Option<u32> {
        self.intake.is_invisible(room_id, user_id).then(|| self.member_sessions(room_id, user_id))
    }

    fn admit_and_apply(
        &mut self,
        now: Tick,
        source: &str,
        StampedRoomFact { stamp, fact, invisible }: StampedRoomFact,
        changes: &mut Vec<RoomChange>,
    ) -> bool {
        match self.intake.admit(self.now, source, stamp, &fact, invisible) {
            Admitted::Stale => return false,
            Admitted::Newer => {}
            Admitted::FromAnotherNode => {
                // Its new node sends the signals it has; the old node's end here.
                self.end_signals_of(now, fact.room_id(), fact.user_id(), &[], changes);
            }
        }
        self.apply(now, fact, changes);
        true
    }

    /// Ends the member's signals in the room but those of `kinds`.
    fn end_signals_of(
        &mut self,
        now: Tick,
        room_id: &CompactString,
        user_id: &CompactString,
        kinds: &[CompactString],
        changes: &mut Vec<RoomChange>,
    ) {
        let sent: Vec<CompactString> = self.rooms.get(room_id.as_str()).map_or(Vec::new(), |room| {
            room.signals
                .iter()
                .filter(|set| set.users.contains(user_id) && !kinds.contains(&set.kind))
                .map(|set| set.kind.clone())
                .collect()
        });
        for kind in sent {
            let fact = RoomFact::Signal { room_id: room_id.clone(), user_id: user_id.clone(), kind, on: false };
            self.apply(now, fact, changes);
        }
    }

    /// The room's version and its counts of users and sessions but those
    /// whose own node holds them invisible (see [`RoomShard::take_in`]).
    pub(crate) fn visible_tally(&self, room_id: &str) -> (u64, u32, u32) {
        self.rooms.get(room_id).map_or((0, 0, 0), |room| {
            let (users, sessions) = room.invisible;
            (room.version, room.members.len() as u32 - users, room.sessions - sessions)
        })
    }

    /// Takes in the part of a node's scan that falls in this shard (see
    /// [`RoomFactScan`](crate::room_intake::RoomFactScan)): its facts, then,
    /// for each member in rooms `rooms` accepts whose last fact came from
    /// `source` and is not newer than the scan of its user (`scanned_at`,
    /// `None`: the scan leaves the user out), what the scan leaves out: the
    /// member left, or stopped signalling the kinds it does not list.
    pub(crate) fn take_in_scan(
        &mut self,
        now: Tick,
        source: &str,
        facts: Vec<StampedRoomFact>,
        rooms: &dyn Fn(&str) -> bool,
        scanned_at: &dyn Fn(&str) -> u64,
        changes: &mut Vec<RoomChange>,
    ) {
        let mut asserted: HashMap<(CompactString, CompactString), Vec<CompactString>> = HashMap::new();
        for fact in facts {
            let key = (fact.fact.room_id().clone(), fact.fact.user_id().clone());
            let kinds = asserted.entry(key).or_default();
            if let RoomFact::Signal { kind, .. } = &fact.fact {
                kinds.push(kind.clone());
            }
            self.take_in(now, source, fact, changes);
        }
        for (room_id, user_id) in self.intake.members_from(source, rooms) {
            let at = scanned_at(&user_id);
            if self.intake.stamp(&room_id, &user_id).is_some_and(|stamp| stamp > at) {
                continue;
            }
            match asserted.get(&(room_id.clone(), user_id.clone())) {
                None => {
                    let left = StampedRoomFact::new(at.max(1), RoomFact::Left { room_id, user_id });
                    self.take_in(now, source, left, changes);
                }
                Some(kinds) => {
                    let kinds = kinds.clone();
                    self.end_signals_of(now, &room_id, &user_id, &kinds, changes);
                }
            }
        }
    }

    /// Takes every member whose last fact `source` sent for one that left,
    /// just after that fact: a node gone from the cluster, whose users that
    /// live on were taken in since by other nodes, with later facts.
    pub(crate) fn forget_source(&mut self, now: Tick, source: &str, changes: &mut Vec<RoomChange>) {
        for (room_id, user_id) in self.intake.members_from(source, &|_| true) {
            let stamp = self.intake.stamp(&room_id, &user_id).unwrap_or(0) + 1;
            self.take_in(now, source, StampedRoomFact::new(stamp, RoomFact::Left { room_id, user_id }), changes);
        }
    }

    /// The nodes that sent the last fact of some member here.
    pub(crate) fn fact_sources(&self) -> Vec<CompactString> {
        self.intake.sources()
    }

    /// Forgets the members and signals of the rooms `rooms` accepts, and what
    /// the intake holds of them, publishing nothing: another node owns them
    /// now. Their access stays, for when they come back.
    pub(crate) fn forget_rooms(&mut self, rooms: &dyn Fn(&str) -> bool) {
        self.intake.forget_rooms(rooms);
        for (room_id, room) in self.rooms.iter_mut() {
            if rooms(room_id) {
                let (access, access_stamp) = (room.access, room.access_stamp);
                *room = Room { version: room.version, access, access_stamp, ..Room::default() };
            }
        }
        self.rooms.retain(|_, room| !room.is_empty());
    }

    /// Applies one user's fact, appending the change watchers see, if any.
    pub(crate) fn apply(&mut self, now: Tick, fact: RoomFact, changes: &mut Vec<RoomChange>) {
        self.now = self.now.max(now);
        let now = self.now;
        match fact {
            RoomFact::Member { room_id, user_id, sessions, metadata } => {
                let room = self.rooms.entry_ref(room_id.as_str()).or_default();
                let hash = self.hasher.hash_one(&user_id);
                let body = match room.find(hash, &user_id) {
                    None => {
                        room.sessions += sessions;
                        let at = room.insert(&self.hasher, hash, &user_id, sessions);
                        room.set_metadata(at, metadata.clone());
                        room.version = self.stamps.next(now);
                        Some(RoomChangeKind::Joined)
                    }
                    Some(at) => {
                        let member = &mut room.members[at];
                        room.sessions = room.sessions - member.sessions + sessions;
                        let counted = std::mem::replace(&mut member.sessions, sessions);
                        if *room.metadata(at) != metadata {
                            room.set_metadata(at, metadata.clone());
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
                    Some(kind) => RoomEventBody::Member {
                        kind,
                        member: RoomMember { user_id, metadata: metadata.shared(), sessions },
                    },
                    None => RoomEventBody::Sessions,
                };
                changes.push(change(room_id, room, body));
            }
            RoomFact::Left { room_id, user_id } => {
                let Some(room) = self.rooms.get_mut(room_id.as_str()) else { return };
                let hash = self.hasher.hash_one(&user_id);
                let Some(at) = room.find(hash, &user_id) else { return };
                let (member, metadata) = room.remove(&self.hasher, hash, at);
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
                let member = RoomMember { user_id, metadata: metadata.shared(), sessions: 0 };
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

    /// The room's version and its counts of users and sessions (all 0 for a room this shard holds nothing about).
    pub(crate) fn tally(&self, room_id: &str) -> (u64, u32, u32) {
        self.rooms.get(room_id).map_or((0, 0, 0), |room| (room.version, room.members.len() as u32, room.sessions))
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
        let members =
            (room.members.len() <= member_cap).then(|| (0..room.members.len()).map(|at| room.listed(at)).collect());
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

    /// Sets who may see the room as the room's owner decided at `stamp` (C1),
    /// unless a later setting is held; returns whether it was taken.
    pub(crate) fn set_access_stamped(&mut self, room_id: &str, access: RoomAccess, stamp: u64) -> bool {
        if self.rooms.get(room_id).is_some_and(|room| room.access_stamp >= stamp) {
            return false;
        }
        self.set_access(room_id, access);
        if let Some(room) = self.rooms.get_mut(room_id) {
            room.access_stamp = stamp;
        }
        true
    }

    /// A stamp for a room's access set now (see [`RoomShard::set_access_stamped`]).
    pub(crate) fn access_stamp(&mut self, now: Tick) -> u64 {
        self.now = self.now.max(now);
        self.stamps.next(self.now)
    }

    /// The rooms `rooms` accepts whose access is not the default or was set
    /// by a room's owner, with the stamp it was set at.
    pub(crate) fn accesses(&self, rooms: &dyn Fn(&str) -> bool) -> Vec<(CompactString, RoomAccess, u64)> {
        self.rooms
            .iter()
            .filter(|(room_id, room)| (room.access != RoomAccess::default() || room.access_stamp > 0) && rooms(room_id))
            .map(|(room_id, room)| (room_id.clone(), room.access, room.access_stamp))
            .collect()
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
        let Some(room) = self.rooms.get(room_id) else { return 0 };
        room.find(self.hasher.hash_one(user_id), user_id).map_or(0, |at| room.members[at].sessions)
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

    /// The last room version stamp the shard issued.
    pub(crate) fn last_stamp(&self) -> u64 {
        self.stamps.last()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// An id is kept inline up to 14 bytes, boxed beyond, and is the same id either way.
    #[test]
    fn member_ids_of_every_length_read_back() {
        for len in [1, 13, 14, 15, 24, 25, 128] {
            let id = "é".repeat(len / 2) + &"x".repeat(len % 2);
            let member = MemberId::new(&id);
            assert_eq!(member.as_str(), id);
            assert!(member.is(&id) && !member.is(&format!("{id}!")));
            assert_eq!(matches!(member, MemberId::Inline { .. }), id.len() <= 14, "{len}");
        }
    }

    /// The memory per membership rests on these sizes (see the module docs).
    #[test]
    fn members_stay_small() {
        assert_eq!(std::mem::size_of::<Member>(), 24);
        assert_eq!(std::mem::size_of::<MemberId>(), 16);
        assert_eq!(std::mem::size_of::<MemberMetadata>(), 8);
    }
}
