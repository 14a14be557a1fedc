//! The sessions' side's names for rooms: every room id that a session is in,
//! kept once in the store, and a 4-byte [`RoomName`] for it that the
//! memberships and signals of the user shards hold instead of a copy of the
//! id (a copy was 24 bytes per membership, and the members of one room are
//! spread over every user shard).
//!
//! A name is counted: each membership and each signal holding it is one
//! reference, and the name is freed with the last. The store takes and drops
//! references for the shards, which only ever see names: it takes one for a
//! join before the shard acts and drops the ones the shard hands back after
//! it has turned the shard's facts into room ids. The table is split like the
//! room shards, by the same hash of the room id, each part behind its own
//! lock, which is taken after a user shard's and never with another lock of
//! its own kind or a room shard's. It says nothing about the rooms themselves:
//! the room shards keep their own ids, so that rooms can be owned elsewhere (R5).

use std::hash::BuildHasher;

use compact_str::CompactString;
use hashbrown::HashTable;

use crate::sync::Mutex;

/// A room id as the user shards hold it: the part of the table it is in
/// (the low bits) and its slot there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct RoomName(u32);

impl RoomName {
    /// Names no room: what a free slot of a membership slab holds.
    pub(crate) const NONE: RoomName = RoomName(u32::MAX);
}

/// One part of the table.
#[derive(Debug, Default)]
struct Part {
    /// The id of each slot, and the references to it; a free slot has none.
    ids: Vec<(CompactString, u32)>,
    free: Vec<u32>,
    /// The slots in use, by a hash of their id.
    index: HashTable<u32>,
}

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct RoomNames {
    parts: Box<[Mutex<Part>]>,
    /// Bits of a name that pick its part.
    part_bits: u32,
    hasher: foldhash::fast::FixedState,
}

impl RoomNames {
    /// A table in `parts` parts, a power of two.
    pub(crate) fn new(parts: usize) -> Self {
        debug_assert!(parts.is_power_of_two());
        RoomNames {
            parts: (0..parts).map(|_| Mutex::new(Part::default())).collect(),
            part_bits: parts.trailing_zeros(),
            hasher: foldhash::fast::FixedState::with_seed(0x726f_6f6d_6e61_6d65),
        }
    }

    fn part_of(&self, hash: u64) -> usize {
        (hash >> 32) as usize & (self.parts.len() - 1)
    }

    /// The room's name, with one more reference to it.
    pub(crate) fn acquire(&self, room_id: &str) -> RoomName {
        let hash = self.hasher.hash_one(room_id);
        let part_index = self.part_of(hash);
        let mut part = self.parts[part_index].lock();
        let part = &mut *part;
        let found = part.index.find(hash, |&slot| part.ids[slot as usize].0 == room_id).copied();
        let slot = match found {
            Some(slot) => slot,
            None => {
                let slot = match part.free.pop() {
                    Some(slot) => {
                        part.ids[slot as usize].0 = room_id.into();
                        slot
                    }
                    None => {
                        part.ids.push((room_id.into(), 0));
                        u32::try_from(part.ids.len() - 1).expect("fewer than 2^32 rooms")
                    }
                };
                let (ids, hasher) = (&part.ids, &self.hasher);
                part.index.insert_unique(hash, slot, |&slot| hasher.hash_one(ids[slot as usize].0.as_str()));
                slot
            }
        };
        part.ids[slot as usize].1 += 1;
        // Also keeps every name below RoomName::NONE.
        assert!(slot < u32::MAX >> self.part_bits, "fewer than 2^(32 - part bits) - 1 rooms per part");
        RoomName(slot << self.part_bits | part_index as u32)
    }

    /// The room's name, if any session is in it.
    pub(crate) fn find(&self, room_id: &str) -> Option<RoomName> {
        let hash = self.hasher.hash_one(room_id);
        let part_index = self.part_of(hash);
        let part = self.parts[part_index].lock();
        let slot = part.index.find(hash, |&slot| part.ids[slot as usize].0 == room_id)?;
        Some(RoomName(slot << self.part_bits | part_index as u32))
    }

    /// The id a name stands for; the caller holds a reference to it.
    pub(crate) fn id(&self, name: RoomName) -> CompactString {
        let (part, slot) = self.split(name);
        let part = self.parts[part].lock();
        debug_assert!(part.ids[slot].1 > 0, "a name in use");
        part.ids[slot].0.clone()
    }

    /// Drops one reference to the name, and the name with the last.
    pub(crate) fn release(&self, name: RoomName) {
        let (part_index, slot) = self.split(name);
        let mut part = self.parts[part_index].lock();
        let part = &mut *part;
        let references = &mut part.ids[slot].1;
        *references -= 1;
        if *references == 0 {
            let id = std::mem::take(&mut part.ids[slot].0);
            let hash = self.hasher.hash_one(id.as_str());
            part.index.find_entry(hash, |&used| used as usize == slot).expect("a name in use is indexed").remove();
            part.free.push(slot as u32);
        }
    }

    /// Names in use.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.parts.iter().map(|part| part.lock().index.len()).sum()
    }

    fn split(&self, name: RoomName) -> (usize, usize) {
        ((name.0 & ((1 << self.part_bits) - 1)) as usize, (name.0 >> self.part_bits) as usize)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A name lives while it is referenced, and its slot serves another room after.
    #[test]
    fn a_name_lives_while_referenced() {
        let names = RoomNames::new(4);
        let lobby = names.acquire("lobby");
        assert_eq!(names.acquire("lobby"), lobby);
        assert_eq!((names.find("lobby"), names.id(lobby).as_str()), (Some(lobby), "lobby"));
        names.release(lobby);
        assert_eq!(names.find("lobby"), Some(lobby));
        names.release(lobby);
        assert_eq!(names.find("lobby"), None);
        let other = names.acquire("lobby-2");
        assert_eq!(names.id(other).as_str(), "lobby-2");
    }
}
