//! A shard's index of its users by id: an open-addressing table of
//! `(hash tag, user slot)` pairs with linear probing.
//!
//! Written here rather than taken from hashbrown for one reason: a batch of
//! lookups wants to know where each lookup will land *before* making it, so it
//! can start the memory loads of many lookups at once and pay for their cache
//! misses side by side instead of one after another ([`UserIndex::probe_start`]).
//! hashbrown keeps that address to itself. The rest is deliberately small. A
//! shard forgets users that stayed offline long enough (B6), so entries are
//! removed too: by backward-shift deletion, which closes the gap in the probe
//! run at once and so needs no tombstones; and the table halves (or more)
//! when it falls below a quarter full, so that a wave of forgotten users gives
//! its memory back.
//!
//! An entry packs the upper 32 bits of the user's hash (the tag) and the
//! user's slot in one `u64`. The probe position comes from the tag alone, so
//! the table grows without recomputing any hash; what the position does not
//! use of the tag still filters out almost every wrong candidate before the
//! caller compares ids.
//!
//! The table's size is any number, not a power of two: a tag is mapped onto
//! it by multiplication (the high half of `tag * size`), so that it can grow
//! by a quarter at a time. Doubling would leave it between three eighths and
//! three quarters full, which at millions of users is up to 8 bytes more per
//! user for nothing; growing by a quarter keeps it between 60% and 75% full,
//! for a few more moves per insert (each entry is moved about 5 times over the
//! table's growth instead of 2).

/// The slot value of an empty entry; no user has it (a shard holds fewer than 2^32 − 1 users).
const EMPTY: u64 = u32::MAX as u64;

/// Entries per user at most, as a fraction: the table grows when more than
/// three quarters full, which keeps probe runs short.
const MAX_LOAD_NUMERATOR: usize = 3;
const MAX_LOAD_DENOMINATOR: usize = 4;

/// The table grows by this fraction of its size (see the module docs).
const GROW_BY_ONE_IN: usize = 4;

/// The table shrinks when fewer than one entry in this many is used, to a size
/// at most half full: between the two thresholds a user that comes and goes
/// at a boundary never resizes the table back and forth.
const SHRINK_BELOW_ONE_IN: usize = 4;

/// The smallest table, and the size of a new one.
const MIN_ENTRIES: usize = 16;

/// The index; see the module documentation.
#[derive(Debug, Clone)]
pub(crate) struct UserIndex {
    /// `tag << 32 | slot`, or `EMPTY`.
    entries: Vec<u64>,
    len: usize,
}

impl Default for UserIndex {
    fn default() -> Self {
        UserIndex { entries: vec![EMPTY; MIN_ENTRIES], len: 0 }
    }
}

fn tag_of(hash: u64) -> u32 {
    (hash >> 32) as u32
}

fn slot_of(entry: u64) -> u32 {
    entry as u32
}

impl UserIndex {
    /// Where the probe run of `tag` starts: `tag` scaled onto the table.
    fn home(&self, tag: u32) -> usize {
        ((u64::from(tag) * self.entries.len() as u64) >> 32) as usize
    }

    /// The position after `position`, wrapping around the end.
    fn after(&self, position: usize) -> usize {
        if position + 1 == self.entries.len() { 0 } else { position + 1 }
    }

    /// How many positions `to` lies after `from`, wrapping around the end.
    fn distance(&self, from: usize, to: usize) -> usize {
        if to >= from { to - from } else { to + self.entries.len() - from }
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
            position = self.after(position);
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

    /// The position of the entry of the user at `slot`, whose hash is `hash`.
    fn position_of(&self, hash: u64, slot: u32) -> usize {
        let tag = tag_of(hash);
        let mut position = self.home(tag);
        loop {
            let entry = self.entries[position];
            assert_ne!(entry, EMPTY, "the index holds every user of the shard");
            if tag_of(entry) == tag && slot_of(entry) == slot {
                return position;
            }
            position = self.after(position);
        }
    }

    /// Points the entry of the user whose hash is `hash` from slot `from` to
    /// slot `to`: the user's record moved.
    pub(crate) fn relocate(&mut self, hash: u64, from: u32, to: u32) {
        let position = self.position_of(hash, from);
        self.entries[position] = u64::from(tag_of(hash)) << 32 | u64::from(to);
    }

    /// Removes the user at `slot`, whose hash is `hash`, and shrinks the table
    /// if it is now mostly empty.
    pub(crate) fn remove(&mut self, hash: u64, slot: u32) {
        let mut hole = self.position_of(hash, slot);
        // Backward shift: an entry further along the run moves into the hole
        // when the hole lies between its home and where it sits, so that
        // every remaining entry stays reachable from its home without a gap.
        let mut position = self.after(hole);
        loop {
            let entry = self.entries[position];
            if entry == EMPTY {
                break;
            }
            let home = self.home(tag_of(entry));
            if self.distance(home, position) >= self.distance(hole, position) {
                self.entries[hole] = entry;
                hole = position;
            }
            position = self.after(position);
        }
        self.entries[hole] = EMPTY;
        self.len -= 1;
        if self.entries.len() > MIN_ENTRIES && self.len * SHRINK_BELOW_ONE_IN < self.entries.len() {
            self.resize((self.len * 2).max(MIN_ENTRIES));
        }
    }

    /// Shrinks the table to the smallest size that holds its users at most
    /// three quarters full, if it is larger.
    pub(crate) fn shrink_to_fit(&mut self) {
        let size = (self.len * MAX_LOAD_DENOMINATOR).div_ceil(MAX_LOAD_NUMERATOR).max(MIN_ENTRIES);
        if size < self.entries.len() {
            self.resize(size);
        }
        self.entries.shrink_to_fit();
    }

    /// Puts an entry at the first empty position of its probe run.
    fn place(&mut self, entry: u64) {
        let mut position = self.home(tag_of(entry));
        while self.entries[position] != EMPTY {
            position = self.after(position);
        }
        self.entries[position] = entry;
    }

    fn grow(&mut self) {
        self.resize(self.entries.len() + self.entries.len() / GROW_BY_ONE_IN);
    }

    /// Moves every entry to a new table of `size` positions.
    fn resize(&mut self, size: usize) {
        debug_assert!(size * MAX_LOAD_NUMERATOR >= self.len * MAX_LOAD_DENOMINATOR);
        let old = std::mem::replace(&mut self.entries, vec![EMPTY; size]);
        for entry in old.into_iter().filter(|&entry| entry != EMPTY) {
            self.place(entry);
        }
    }

    /// Users held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Positions in the table, used or not.
    #[cfg(test)]
    pub(crate) fn capacity(&self) -> usize {
        self.entries.len()
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
            // Growing by a quarter keeps the table between 60% and 75% full.
            let (used, size) = (index.len(), index.capacity());
            assert!(used * 4 <= size * 3, "{used} of {size}");
            assert!(used < 100 || used * 100 >= size * 59, "{used} of {size}");
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
    fn b6_removed_users_are_gone_the_rest_stay_found_and_the_table_shrinks_without_thrashing() {
        let mut index = UserIndex::default();
        let hashes: Vec<u64> = (0..10_000u64).map(|i| i.wrapping_mul(0x9e37_79b9_7f4a_7c15)).collect();
        for (slot, &h) in hashes.iter().enumerate() {
            index.insert(h, slot as u32);
        }
        let full = index.capacity();
        // Remove every user but one in sixteen: what is left is still found,
        // what was removed is not, and the table shrank.
        for (slot, &h) in hashes.iter().enumerate().filter(|(slot, _)| slot % 16 != 0) {
            index.remove(h, slot as u32);
        }
        for (slot, &h) in hashes.iter().enumerate() {
            let found = index.find(h, |s| s as usize == slot);
            assert_eq!(found, (slot % 16 == 0).then_some(slot as u32), "user {slot}");
        }
        assert_eq!(index.len(), 625);
        assert!(index.capacity() * 4 <= full, "{} positions left of {full}", index.capacity());
        assert!(index.capacity() * 3 >= index.len() * 4, "still at most three quarters full");
        // One user coming and going at the size the table settled at resizes nothing.
        let settled = index.capacity();
        for round in 0..100u32 {
            index.insert(hashes[1], 1);
            assert_eq!(index.capacity(), settled, "round {round}");
            index.remove(hashes[1], 1);
            assert_eq!(index.capacity(), settled, "round {round}");
        }
        // A relocated user is found at its new slot only.
        index.relocate(hashes[16], 16, 7_777);
        assert_eq!(index.find(hashes[16], |s| s == 7_777), Some(7_777));
        assert_eq!(index.find(hashes[16], |s| s == 16), None);
    }

    #[test]
    fn b6_removal_inside_a_run_that_wraps_around_keeps_the_rest_reachable() {
        let mut index = UserIndex::default();
        // The largest tag is homed at the last position.
        let last = u32::MAX;
        assert_eq!(index.home(last), index.entries.len() - 1);
        // A run from the last position around to the start, with entries homed
        // at the last position and at position 0 mixed in it.
        for slot in 0..3 {
            index.insert(hash(last, slot), slot);
        }
        index.insert(hash(0, 0), 10);
        index.insert(hash(last, 3), 3);
        index.remove(hash(last, 0), 0);
        index.remove(hash(0, 0), 10);
        for slot in 1..4 {
            assert_eq!(index.find(hash(last, 99), |s| s == slot), Some(slot), "slot {slot}");
        }
        assert_eq!(index.find(hash(0, 0), |s| s == 10), None);
        assert_eq!(index.len(), 3);
    }

    #[test]
    fn equal_tags_and_runs_that_wrap_around_the_end_are_told_apart_by_the_caller() {
        let mut index = UserIndex::default();
        // The largest tag is homed at the last position.
        let last = u32::MAX;
        assert_eq!(index.home(last), index.entries.len() - 1);
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
