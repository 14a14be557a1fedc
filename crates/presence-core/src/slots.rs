//! Which of a cluster's fixed slots a user or a room falls in (C1).
//!
//! Pure, and here rather than in the cluster crate because every side needs
//! it: the server to check that it owns a request's slot, the clients to send
//! each user's items to its owner.

/// Which of `slots` slots `id` (a user id, or a room id) falls in:
/// 32-bit FNV-1a over the id's UTF-8 bytes (as received: a Leases frame's
/// id is hashed before it is checked to be UTF-8), modulo `slots`. Chosen because
/// every client can compute it in a few lines (the TypeScript client with
/// `Math.imul`); the tests pin it with fixed vectors that other
/// implementations must reproduce.
pub fn slot_of(id: impl AsRef<[u8]>, slots: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let hash = id.as_ref().iter().copied().fold(OFFSET, |hash, byte| (hash ^ u32::from(byte)).wrapping_mul(PRIME));
    hash % slots.max(1)
}

/// Some of a cluster's `slots` slots: the ones a handover moves (C3), as a bitmap.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotSet {
    slots: u32,
    bits: Vec<u64>,
}

impl SlotSet {
    /// No slot of a cluster of `slots`.
    pub fn new(slots: u32) -> Self {
        let slots = slots.max(1);
        SlotSet { slots, bits: vec![0; slots.div_ceil(64) as usize] }
    }

    /// The set of the given slots (those at or past the count are left out).
    pub fn of(slots: u32, members: impl IntoIterator<Item = u32>) -> Self {
        let mut set = SlotSet::new(slots);
        members.into_iter().for_each(|slot| set.insert(slot));
        set
    }

    /// The cluster's slot count.
    pub fn slots(&self) -> u32 {
        self.slots
    }

    /// Adds `slot`, if the cluster has it.
    pub fn insert(&mut self, slot: u32) {
        if slot < self.slots {
            self.bits[(slot / 64) as usize] |= 1 << (slot % 64);
        }
    }

    /// Takes `slot` out.
    pub fn remove(&mut self, slot: u32) {
        if slot < self.slots {
            self.bits[(slot / 64) as usize] &= !(1 << (slot % 64));
        }
    }

    /// Whether `slot` is in the set.
    pub fn contains(&self, slot: u32) -> bool {
        slot < self.slots && self.bits[(slot / 64) as usize] & (1 << (slot % 64)) != 0
    }

    /// Whether the user (or room) `id` falls in one of the set's slots.
    pub fn holds(&self, id: impl AsRef<[u8]>) -> bool {
        self.contains(slot_of(id, self.slots))
    }

    /// The slots in the set, ascending.
    pub fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.slots).filter(|&slot| self.contains(slot))
    }

    /// How many slots are in the set.
    pub fn len(&self) -> usize {
        self.bits.iter().map(|word| word.count_ones() as usize).sum()
    }

    /// Whether no slot is in the set.
    pub fn is_empty(&self) -> bool {
        self.bits.iter().all(|&word| word == 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed vectors: any other implementation of the slot function (the
    /// TypeScript client's) must give the same slots.
    #[test]
    fn slots_are_fnv1a_of_the_id_modulo_the_slot_count() {
        // Computed with an independent implementation (Python) of 32-bit FNV-1a.
        let vectors = [("", 453), ("a", 300), ("alice", 999), ("user-42", 939), ("ユーザー", 766), ("room:doc-7", 330)];
        for (id, slot) in vectors {
            assert_eq!(slot_of(id, 1024), slot, "{id:?}");
        }
        assert_eq!(slot_of("alice", u32::MAX), 0x8722_13e7, "the whole hash, below u32::MAX");
        assert_eq!(slot_of("alice", 1), 0);
        assert_eq!(slot_of("alice", 0), 0, "no slots is taken as one, not a division by zero");
    }

    #[test]
    fn a_slot_set_holds_the_users_of_its_slots_only() {
        let set = SlotSet::of(1024, [999, 0, 1023, 5000]);
        assert_eq!(set.iter().collect::<Vec<_>>(), [0, 999, 1023], "5000 is past the count: left out");
        assert_eq!(set.len(), 3);
        assert!(set.holds("alice"), "alice is in slot 999");
        assert!(!set.holds("a"), "a is in slot 300");
        assert!(!set.contains(5000) && !SlotSet::new(1024).holds("alice") && SlotSet::new(8).is_empty());
        let mut set = set;
        set.remove(999);
        assert_eq!(set.iter().collect::<Vec<_>>(), [0, 1023]);
    }

    #[test]
    fn slots_spread_evenly() {
        let mut counts = vec![0u32; 1024];
        for i in 0..1_024_000 {
            counts[slot_of(format!("user-{i}"), 1024) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*min > 800 && *max < 1200, "slot loads between {min} and {max} for 1,000 ids per slot on average");
    }
}
