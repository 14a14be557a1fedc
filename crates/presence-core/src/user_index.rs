//! A shard's index of its users by id: an open-addressing table of
//! `(hash tag, user slot)` pairs with linear probing.
//!
//! Written here rather than taken from hashbrown for one reason: a batch of
//! lookups wants to know where each lookup will land *before* making it, so it
//! can start the memory loads of many lookups at once and pay for their cache
//! misses side by side instead of one after another ([`UserIndex::probe_start`]).
//! hashbrown keeps that address to itself. The rest is deliberately small: a
//! shard never forgets a user (offline users keep their versions), so the table
//! is insert-only and needs no tombstones.
//!
//! An entry packs the upper 32 bits of the user's hash (the tag) and the
//! user's slot in one `u64`. The probe position comes from the tag alone, so
//! the table grows without recomputing any hash; what the position does not
//! use of the tag still filters out almost every wrong candidate before the
//! caller compares ids.

/// The slot value of an empty entry; no user has it (a shard holds fewer than 2^32 − 1 users).
const EMPTY: u64 = u32::MAX as u64;

/// Entries per user at most, as a fraction: the table grows when more than
/// three quarters full, which keeps probe runs short.
const MAX_LOAD_NUMERATOR: usize = 3;
const MAX_LOAD_DENOMINATOR: usize = 4;

/// The index; see the module documentation.
#[derive(Debug, Clone)]
pub(crate) struct UserIndex {
    /// `tag << 32 | slot`, or `EMPTY`; the length is a power of two.
    entries: Vec<u64>,
    len: usize,
}

impl Default for UserIndex {
    fn default() -> Self {
        UserIndex { entries: vec![EMPTY; 16], len: 0 }
    }
}

fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

fn slot_of(entry: u64) -> u32 {
    entry as u32
}

impl UserIndex {
    fn mask(&self) -> usize {
        self.entries.len() - 1
    }

    fn home(&self, tag: u32) -> usize {
        tag as usize & self.mask()
    }

    /// Loads the entry where a lookup of `hash` starts and returns it, so that
    /// a caller about to look up many users can bring their entries into the
    /// cache together. The value means nothing to the caller.
    pub(crate) fn probe_start(&self, hash: u64) -> u64 {
        self.entries[self.home(tag_of(hash))]
    }

    /// The slot of the first entry in `hash`'s probe run with its tag: most
    /// likely the user's, for a caller that wants to start loading the user's
    /// record before it can compare ids.
    pub(crate) fn candidate(&self, hash: u64) -> Option<u32> {
        self.find(hash, |_| true)
    }

    /// The slot of the user whose hash is `hash` and for whose slot `is_user` holds.
    pub(crate) fn find(&self, hash: u64, is_user: impl Fn(u32) -> bool) -> Option<u32> {
        let tag = tag_of(hash);
        let mut position = self.home(tag);
        loop {
            let entry = self.entries[position];
            if entry == EMPTY {
                return None;
            }
            if tag_of(entry) == tag && is_user(slot_of(entry)) {
                return Some(slot_of(entry));
            }
            position = (position + 1) & self.mask();
        }
    }

    /// Adds a user the index does not hold.
    pub(crate) fn insert(&mut self, hash: u64, slot: u32) {
        debug_assert_ne!(u64::from(slot), EMPTY, "the empty marker is not a slot");
        if (self.len + 1) * MAX_LOAD_DENOMINATOR > self.entries.len() * MAX_LOAD_NUMERATOR {
            self.grow();
        }
        self.place(u64::from(tag_of(hash)) << 32 | u64::from(slot));
        self.len += 1;
    }

    /// Puts an entry at the first empty position of its probe run.
    fn place(&mut self, entry: u64) {
        let mut position = self.home(tag_of(entry));
        while self.entries[position] != EMPTY {
            position = (position + 1) & self.mask();
        }
        self.entries[position] = entry;
    }

    fn grow(&mut self) {
        let doubled = vec![EMPTY; self.entries.len() * 2];
        let old = std::mem::replace(&mut self.entries, doubled);
        for entry in old.into_iter().filter(|&entry| entry != EMPTY) {
            self.place(entry);
        }
    }

    /// Users held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hash whose tag is `tag`, so tests can force collisions.
    fn hash(tag: u32, low: u32) -> u64 {
        u64::from(tag) << 32 | u64::from(low)
    }

    #[test]
    fn finds_what_was_inserted_and_nothing_else_across_growth() {
        let mut index = UserIndex::default();
        // Hashes spread like foldhash's, and ids (slots) that only the `is_user` check tells apart.
        let hashes: Vec<u64> = (0..10_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        for (slot, &h) in hashes.iter().enumerate() {
            assert_eq!(index.find(h, |s| s as usize == slot), None);
            index.insert(h, slot as u32);
        }
        assert_eq!(index.len(), hashes.len());
        for (slot, &h) in hashes.iter().enumerate() {
            assert_eq!(index.find(h, |s| s as usize == slot), Some(slot as u32), "user {slot}");
        }
        assert_eq!(index.find(hashes[5], |_| false), None, "a tag match is not a user match");
        // Growth kept the load at most three quarters.
        assert!(index.entries.len() * 3 >= index.len() * 4);
    }

    #[test]
    fn equal_tags_and_runs_that_wrap_around_the_end_are_told_apart_by_the_caller() {
        let mut index = UserIndex::default();
        let last = (index.entries.len() - 1) as u32;
        // Five users with the same tag, homed at the last position: the run wraps to the start.
        for slot in 0..5 {
            index.insert(hash(last, slot), slot);
        }
        for slot in 0..5 {
            assert_eq!(index.find(hash(last, 99), |s| s == slot), Some(slot));
        }
        assert_eq!(index.find(hash(last, 0), |s| s == 7), None);
        // And a user homed inside that run is still found.
        index.insert(hash(0, 0), 42);
        assert_eq!(index.find(hash(0, 0), |s| s == 42), Some(42));
        assert_eq!(index.candidate(hash(last, 0)), Some(0), "the first slot of the run with the tag");
        assert_eq!(index.candidate(hash(0, 0)), Some(42));
        assert_eq!(index.candidate(hash(1, 0)), None, "no entry with that tag in its run");
    }
}
