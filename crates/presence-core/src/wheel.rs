//! A hierarchical timer wheel: the lease store's schedule of expiry deadlines.
//!
//! This module owns the data structure that answers "which leases have expired by time `now`?"
//! and nothing else. It does no I/O, never reads a clock and spawns nothing: time is a plain
//! [`Tick`] (milliseconds) supplied by the caller, who decides when to sleep and when to
//! [`poll`](TimerWheel::poll). It knows nothing about what the scheduled items mean.
//!
//! # Layout
//!
//! The wheel has six levels of 64 slots. A slot at level `L` is `64^L` ms wide, so each level
//! spans 64 times the previous one:
//!
//! | level | slot width      | level span (64 slots)  |
//! |-------|-----------------|------------------------|
//! | 0     | 1 ms            | 64 ms                  |
//! | 1     | 64 ms           | ~4.1 s (4 096 ms)      |
//! | 2     | ~4.1 s          | ~4.4 min (2^18 ms)     |
//! | 3     | ~4.4 min        | ~4.7 h (2^24 ms)       |
//! | 4     | ~4.7 h          | ~12.4 days (2^30 ms)   |
//! | 5     | ~12.4 days      | ~2.2 years (2^36 ms)   |
//!
//! An entry is filed at the level of the highest bit in which its deadline differs from
//! [`elapsed`](TimerWheel::elapsed) (as tokio's runtime timer does), in the slot that its
//! deadline falls into. That slot is the first one the wheel reaches at which the entry may need
//! attention. When the wheel reaches a slot above level 0 it *cascades*: every entry in it is
//! filed again relative to the new time, landing in a lower level (or in the due list). A level 0
//! slot is exactly one millisecond, so everything in it is due.
//!
//! Deadlines beyond the wheel's span (a different 2^36 ms block than `elapsed`) are parked in
//! the top level's slot 0, the last slot the wheel reaches before its next rotation, and are
//! re-filed when that rotation starts. They are therefore visited once per ~2.2 years of
//! simulated time until they come into range, and never handed out early.
//!
//! Entries live in a slab indexed by [`TimerKey`]; each slot is an intrusive doubly linked list
//! through slab indices, and each level keeps a 64-bit occupancy bitmap, so insert, remove and
//! [`next_deadline`](TimerWheel::next_deadline) are O(1) (O(levels) for the latter) and polling
//! costs O(1) amortised per entry per level it cascades through.
//!
//! Reference: G. Varghese and T. Lauck, "Hashed and Hierarchical Timing Wheels: Data Structures
//! for the Efficient Implementation of a Timer Facility", SOSP 1987 (scheme 7, hierarchical
//! wheels).

use std::fmt;
use std::mem;

/// Milliseconds on the store's clock.
pub type Tick = u64;

/// log2 of the number of slots per level.
const LEVEL_BITS: u32 = 6;
/// Slots per level; 64 so that one `u64` bitmap covers a level.
const SLOTS: usize = 1 << LEVEL_BITS;
/// Number of levels.
const LEVELS: usize = 6;
/// Mask selecting a slot index out of shifted time.
const SLOT_MASK: u64 = SLOTS as u64 - 1;
/// log2 of the whole wheel's span (2^36 ms, ~2.2 years).
const WHEEL_BITS: u32 = LEVEL_BITS * LEVELS as u32;
/// The top level.
const TOP: Level = Level::L5;
/// Top-level slot where deadlines beyond the wheel's span are parked. Nothing in range can live
/// there: an in-range top-level entry's slot is strictly after elapsed's top-level slot.
const OVERFLOW_SLOT: u8 = 0;
/// `level` marker of an entry sitting in the due list rather than in a wheel slot.
const DUE: Level = Level::Due;
/// "No entry" in the intrusive links and list heads.
const NIL: u32 = u32::MAX;

/// Handle to a scheduled entry, returned by insert; valid until the entry is removed or polled.
///
/// Keys are slab indices and are reused once their entry is gone, so a stale key may name a
/// different, newer entry: the caller must drop a key when its entry leaves the wheel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TimerKey(std::num::NonZeroU32);

impl TimerKey {
    /// Keys store the slab index plus one, so that `Option<TimerKey>` is as small as a `u32`.
    fn new(index: u32) -> Self {
        TimerKey(std::num::NonZeroU32::new(index + 1).expect("fewer than u32::MAX entries"))
    }

    fn index(self) -> u32 {
        self.0.get() - 1
    }
}

/// Which list an entry is on: a wheel level, or the due list.
///
/// An enum rather than a bare `u8` so that its unused values give [`Node`] a niche for its
/// discriminant: `Node<u64>` stays 32 bytes instead of 40.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Level {
    L0,
    L1,
    L2,
    L3,
    L4,
    L5,
    Due,
}

impl Level {
    const WHEEL: [Level; LEVELS] = [Level::L0, Level::L1, Level::L2, Level::L3, Level::L4, Level::L5];

    /// The wheel level with index `i < LEVELS`.
    fn wheel(i: usize) -> Self {
        Self::WHEEL[i]
    }

    /// Index into the per-level arrays (`LEVELS` for the due list, which has none).
    fn index(self) -> usize {
        self as usize
    }
}

/// One scheduled item. Kept small (one per online user): the list position is two `u32` links
/// plus the `(level, slot)` pair needed to find the list head on removal.
struct Entry<T> {
    deadline: Tick,
    item: T,
    prev: u32,
    next: u32,
    /// A wheel level, or [`DUE`] for the due list (then `slot` is unused).
    level: Level,
    slot: u8,
}

/// A slab cell: a live entry or a link in the free list.
enum Node<T> {
    Occupied(Entry<T>),
    Vacant { next_free: u32 },
}

/// The next slot the wheel has to visit and the time at which it starts.
#[derive(Clone, Copy, Debug)]
struct Expiration {
    level: Level,
    slot: u8,
    start: Tick,
}

/// A hierarchical timer wheel of items of type `T`, keyed by [`TimerKey`].
///
/// See the [module documentation](self) for the layout and costs.
pub struct TimerWheel<T> {
    /// Time up to which the wheel has been advanced. Every scheduled entry has a deadline after
    /// it; entries in the due list have a deadline equal to it.
    elapsed: Tick,
    nodes: Vec<Node<T>>,
    free_head: u32,
    /// Live entries (scheduled plus due).
    len: usize,
    /// Head of each slot's list, `NIL` when empty.
    heads: [[u32; SLOTS]; LEVELS],
    /// Bit `s` of `occupied[l]` is set iff `heads[l][s] != NIL`.
    occupied: [u64; LEVELS],
    /// Entries already found due but not yet handed out: poll hands out one per call so that a
    /// caller can bound the work done per call.
    due_head: u32,
}

impl<T> fmt::Debug for TimerWheel<T> {
    // Manual so that it needs no `T: Debug` and does not dump 384 list heads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TimerWheel")
            .field("elapsed", &self.elapsed)
            .field("len", &self.len)
            .field("occupied", &self.occupied)
            .field("has_due", &(self.due_head != NIL))
            .finish_non_exhaustive()
    }
}

impl<T> TimerWheel<T> {
    /// An empty wheel whose clock starts at `now` (nothing at or before `now` can be scheduled).
    pub fn new(now: Tick) -> Self {
        Self {
            elapsed: now,
            nodes: Vec::new(),
            free_head: NIL,
            len: 0,
            heads: [[NIL; SLOTS]; LEVELS],
            occupied: [0; LEVELS],
            due_head: NIL,
        }
    }

    /// The time up to which the wheel has been polled: every entry with deadline <= elapsed has
    /// been handed out, except those already taken off the wheel and waiting to be handed out
    /// one per [`poll`](Self::poll) call (their deadline equals `elapsed`).
    pub fn elapsed(&self) -> Tick {
        self.elapsed
    }

    /// Number of entries in the wheel, including due ones not yet handed out.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the wheel holds no entries.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Schedules `item` at `deadline`. A deadline that is already due (deadline <= elapsed) is
    /// not scheduled: the item is handed back as `Err(item)`, never dropped. O(1).
    ///
    /// # Panics
    ///
    /// If the wheel already holds `u32::MAX` entries.
    pub fn insert(&mut self, deadline: Tick, item: T) -> Result<TimerKey, T> {
        if deadline <= self.elapsed {
            return Err(item);
        }
        let (level, slot) = self.place(deadline);
        let idx = self.alloc(Entry { deadline, item, prev: NIL, next: NIL, level, slot });
        self.link(idx, level, slot);
        self.len += 1;
        Ok(TimerKey::new(idx))
    }

    /// Cancels a scheduled entry and returns `(deadline, item)`. O(1).
    ///
    /// # Panics
    ///
    /// If `key` does not name a live entry (it was already removed or polled and not reused).
    pub fn remove(&mut self, key: TimerKey) -> (Tick, T) {
        assert!(
            matches!(self.nodes.get(key.index() as usize), Some(Node::Occupied(_))),
            "TimerWheel::remove: {key:?} is not a live entry"
        );
        self.take(key.index())
    }

    /// The deadline the entry was scheduled at.
    ///
    /// # Panics
    ///
    /// If `key` does not name a live entry.
    pub fn deadline(&self, key: TimerKey) -> Tick {
        match self.nodes.get(key.index() as usize) {
            Some(Node::Occupied(e)) => e.deadline,
            _ => panic!("TimerWheel::deadline: {key:?} is not a live entry"),
        }
    }

    /// The item of a live entry, to change in place (its owner moved, say).
    ///
    /// # Panics
    ///
    /// If `key` does not name a live entry.
    pub fn item_mut(&mut self, key: TimerKey) -> &mut T {
        match self.nodes.get_mut(key.index() as usize) {
            Some(Node::Occupied(e)) => &mut e.item,
            _ => panic!("TimerWheel::item_mut: {key:?} is not a live entry"),
        }
    }

    /// Cells in the slab, live or free: what the wheel's entries cost in memory.
    pub fn slab_len(&self) -> usize {
        self.nodes.len()
    }

    /// Moves every live entry to the front of a new, smaller slab and frees
    /// the old one, so that a wheel that once held many more entries than it
    /// does now gives the memory back. Keys change: `moved(item, key)` is
    /// called with the new key of every entry whose key changed, and every
    /// other key handed out before stays valid. Deadlines, order and due
    /// entries are kept. O(slab cells).
    pub fn compact(&mut self, mut moved: impl FnMut(&T, TimerKey)) {
        let old = mem::take(&mut self.nodes);
        let mut remap = vec![NIL; old.len()];
        let mut live = 0u32;
        for (cell, node) in remap.iter_mut().zip(&old) {
            if matches!(node, Node::Occupied(_)) {
                *cell = live;
                live += 1;
            }
        }
        let map = |index: u32| if index == NIL { NIL } else { remap[index as usize] };
        // An eighth more than held: room for a little growth without a reallocation.
        let mut nodes = Vec::with_capacity(self.len + self.len / 8);
        for (index, node) in old.into_iter().enumerate() {
            if let Node::Occupied(mut entry) = node {
                entry.prev = map(entry.prev);
                entry.next = map(entry.next);
                let new_index = remap[index];
                if new_index != index as u32 {
                    moved(&entry.item, TimerKey::new(new_index));
                }
                nodes.push(Node::Occupied(entry));
            }
        }
        for head in self.heads.iter_mut().flatten() {
            *head = map(*head);
        }
        self.due_head = map(self.due_head);
        self.free_head = NIL;
        self.nodes = nodes;
    }

    /// A time at or before the earliest scheduled deadline at which `poll` may have work
    /// (exact for entries in the lowest level; the start of the slot for higher levels, so a
    /// caller that sleeps until it and polls will cascade and then ask again). `None` when empty.
    ///
    /// O(levels): it reads the per-level occupancy bitmaps and never scans entries.
    pub fn next_deadline(&self) -> Option<Tick> {
        if self.due_head != NIL {
            // Due entries all carry the deadline `elapsed`; report it exactly.
            return Some(self.entry(self.due_head).deadline);
        }
        self.next_expiration().map(|e| e.start)
    }

    /// Hands out one entry whose deadline <= `now`, as `(deadline, item)`, advancing the wheel
    /// and cascading higher-level slots as needed.
    ///
    /// Entries come out in non-decreasing deadline order across calls with the same or
    /// increasing `now` (entries with the same deadline in any order). Returns `None` when no
    /// entry is due at `now`; by then `elapsed() == max(previous elapsed, now)`. A `now` smaller
    /// than `elapsed()` is treated as `elapsed()` (time never goes back).
    ///
    /// Due entries are handed out one per call, so a caller can stop after a budget and call
    /// again later. A call that reaches a higher-level slot re-files that whole slot at once
    /// (O(1) per entry in it, no allocation) before handing anything out.
    pub fn poll(&mut self, now: Tick) -> Option<(Tick, T)> {
        let now = now.max(self.elapsed);
        loop {
            if self.due_head != NIL {
                let idx = self.due_head;
                let out = self.take(idx);
                debug_assert!(out.0 <= now);
                return Some(out);
            }
            match self.next_expiration() {
                Some(exp) if exp.start <= now => self.process(exp),
                _ => {
                    // Nothing starts at or before `now`: every entry is later, so the wheel can
                    // jump straight there without touching any slot.
                    self.elapsed = now;
                    return None;
                }
            }
        }
    }

    /// Where an entry with `deadline` belongs relative to the current `elapsed`:
    /// `(level, slot)`.
    fn place(&self, deadline: Tick) -> (Level, u8) {
        debug_assert!(deadline > self.elapsed);
        let diff = self.elapsed ^ deadline;
        if diff >> WHEEL_BITS != 0 {
            // Beyond this rotation of the top level: park until the next rotation starts.
            return (TOP, OVERFLOW_SLOT);
        }
        // Or-ing in the slot mask makes a difference confined to the lowest 6 bits land on
        // level 0 (tokio's `level_for`).
        let significant = 63 - (diff | SLOT_MASK).leading_zeros();
        let level = significant / LEVEL_BITS;
        let slot = (deadline >> (level * LEVEL_BITS)) & SLOT_MASK;
        debug_assert!(level < LEVELS as u32);
        debug_assert!(level != TOP.index() as u32 || slot != u64::from(OVERFLOW_SLOT));
        (Level::wheel(level as usize), slot as u8)
    }

    /// The earliest slot the wheel must visit, following tokio's `next_expiration`: the lowest
    /// non-empty level always holds the earliest work, because every entry of a level shares
    /// all higher-level bits with `elapsed` while entries of higher levels differ there.
    fn next_expiration(&self) -> Option<Expiration> {
        for level in 0..LEVELS {
            let occupied = self.occupied[level];
            if occupied == 0 {
                continue;
            }
            let shift = level as u32 * LEVEL_BITS;
            let now_slot = ((self.elapsed >> shift) & SLOT_MASK) as u32;
            let level_start = self.elapsed & !((1u64 << (shift + LEVEL_BITS)) - 1);
            // Every in-range entry's slot starts after `elapsed`, so only slots strictly after
            // the current one are candidates.
            let ahead = occupied & u64::MAX.checked_shl(now_slot + 1).unwrap_or(0);
            if ahead != 0 {
                let slot = ahead.trailing_zeros();
                return Some(Expiration {
                    level: Level::wheel(level),
                    slot: slot as u8,
                    start: level_start + (u64::from(slot) << shift),
                });
            }
            // Only the top level's overflow slot can sit at or behind the current position; it
            // is visited when the next rotation starts. No overflow: an overflow entry's deadline
            // lies in a later 2^36 block than `elapsed`, so that block's start fits in a u64.
            debug_assert_eq!(level, TOP.index());
            debug_assert_eq!(occupied, 1 << OVERFLOW_SLOT);
            return Some(Expiration { level: TOP, slot: OVERFLOW_SLOT, start: level_start + (1u64 << WHEEL_BITS) });
        }
        None
    }

    /// Advances `elapsed` to the slot's start and empties the slot: due entries go to the due
    /// list, the rest are re-filed (cascaded) relative to the new `elapsed`.
    fn process(&mut self, exp: Expiration) {
        debug_assert_eq!(self.due_head, NIL);
        debug_assert!(exp.start > self.elapsed);
        let (level, slot) = (exp.level.index(), usize::from(exp.slot));
        let mut idx = mem::replace(&mut self.heads[level][slot], NIL);
        self.occupied[level] &= !(1u64 << slot);
        self.elapsed = exp.start;
        while idx != NIL {
            let (next, deadline) = {
                let e = self.entry(idx);
                (e.next, e.deadline)
            };
            // An in-range entry's deadline is within the slot; a parked one's is later still.
            debug_assert!(deadline >= exp.start);
            debug_assert!(level != 0 || deadline == exp.start);
            if deadline <= self.elapsed {
                self.link(idx, DUE, 0);
            } else {
                let (new_level, new_slot) = self.place(deadline);
                // Cascading only ever moves down, except out of the overflow slot.
                debug_assert!(new_level.index() < level || (exp.level, exp.slot) == (TOP, OVERFLOW_SLOT));
                self.link(idx, new_level, new_slot);
            }
            idx = next;
        }
    }

    /// Unlinks and frees entry `idx`, returning its contents.
    fn take(&mut self, idx: u32) -> (Tick, T) {
        self.unlink(idx);
        let node = mem::replace(&mut self.nodes[idx as usize], Node::Vacant { next_free: self.free_head });
        self.free_head = idx;
        self.len -= 1;
        match node {
            Node::Occupied(e) => (e.deadline, e.item),
            Node::Vacant { .. } => unreachable!("take of a vacant slab cell"),
        }
    }

    /// Stores `entry` in the slab (reusing a free cell first) and returns its index.
    fn alloc(&mut self, entry: Entry<T>) -> u32 {
        if self.free_head != NIL {
            let idx = self.free_head;
            let cell = &mut self.nodes[idx as usize];
            match *cell {
                Node::Vacant { next_free } => self.free_head = next_free,
                Node::Occupied(_) => unreachable!("free list points at a live entry"),
            }
            *cell = Node::Occupied(entry);
            idx
        } else {
            let idx = u32::try_from(self.nodes.len())
                .ok()
                .filter(|&i| i != NIL)
                .expect("TimerWheel: more than u32::MAX - 1 entries");
            self.nodes.push(Node::Occupied(entry));
            idx
        }
    }

    fn entry(&self, idx: u32) -> &Entry<T> {
        match &self.nodes[idx as usize] {
            Node::Occupied(e) => e,
            Node::Vacant { .. } => unreachable!("link to a vacant slab cell"),
        }
    }

    fn entry_mut(&mut self, idx: u32) -> &mut Entry<T> {
        match &mut self.nodes[idx as usize] {
            Node::Occupied(e) => e,
            Node::Vacant { .. } => unreachable!("link to a vacant slab cell"),
        }
    }

    fn head_mut(&mut self, level: Level, slot: u8) -> &mut u32 {
        if level == DUE { &mut self.due_head } else { &mut self.heads[level.index()][usize::from(slot)] }
    }

    /// Pushes entry `idx` at the front of list `(level, slot)`.
    fn link(&mut self, idx: u32, level: Level, slot: u8) {
        let old_head = mem::replace(self.head_mut(level, slot), idx);
        let e = self.entry_mut(idx);
        e.prev = NIL;
        e.next = old_head;
        e.level = level;
        e.slot = slot;
        if old_head != NIL {
            self.entry_mut(old_head).prev = idx;
        }
        if level != DUE {
            self.occupied[level.index()] |= 1u64 << slot;
        }
    }

    /// Removes entry `idx` from whichever list holds it, clearing the slot's bit if it empties.
    fn unlink(&mut self, idx: u32) {
        let (prev, next, level, slot) = {
            let e = self.entry(idx);
            (e.prev, e.next, e.level, e.slot)
        };
        if prev == NIL {
            let head = self.head_mut(level, slot);
            debug_assert_eq!(*head, idx);
            *head = next;
        } else {
            self.entry_mut(prev).next = next;
        }
        if next != NIL {
            self.entry_mut(next).prev = prev;
        }
        if level != DUE && prev == NIL && next == NIL {
            self.occupied[level.index()] &= !(1u64 << slot);
        }
    }

    /// Full structural check, O(entries). Test-only: too slow for every operation.
    #[cfg(test)]
    fn check_invariants(&self) {
        let mut seen = 0usize;
        let mut check_list = |head: u32, level: Level, slot: u8| {
            let mut prev = NIL;
            let mut idx = head;
            while idx != NIL {
                let e = self.entry(idx);
                assert_eq!(e.prev, prev);
                assert_eq!((e.level, e.slot), (level, slot));
                if level == DUE {
                    assert_eq!(e.deadline, self.elapsed, "due entry not at elapsed");
                } else {
                    // Every scheduled entry sits exactly where it would be filed now.
                    assert_eq!(self.place(e.deadline), (level, slot), "misfiled entry");
                }
                seen += 1;
                prev = idx;
                idx = e.next;
            }
        };
        for level in 0..LEVELS {
            for slot in 0..SLOTS {
                let head = self.heads[level][slot];
                assert_eq!(head != NIL, self.occupied[level] & (1 << slot) != 0);
                check_list(head, Level::wheel(level), slot as u8);
            }
        }
        check_list(self.due_head, DUE, 0);
        assert_eq!(seen, self.len);
        let mut free = 0usize;
        let mut idx = self.free_head;
        while idx != NIL {
            match self.nodes[idx as usize] {
                Node::Vacant { next_free } => idx = next_free,
                Node::Occupied(_) => panic!("free list reaches a live entry"),
            }
            free += 1;
        }
        assert_eq!(free + self.len, self.nodes.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeMap;

    const DAY: Tick = 24 * 60 * 60 * 1000;
    const YEAR: Tick = 365 * DAY;

    /// Polls everything due at `now`, checking invariants after each step.
    fn drain(w: &mut TimerWheel<u32>, now: Tick) -> Vec<(Tick, u32)> {
        let mut out = Vec::new();
        while let Some(x) = w.poll(now) {
            w.check_invariants();
            out.push(x);
        }
        w.check_invariants();
        out
    }

    /// Behaves like a caller that sleeps until `next_deadline` and polls; returns the time the
    /// single entry came out and how many wake-ups it took.
    fn sleep_and_poll(w: &mut TimerWheel<u32>) -> (Tick, Tick, usize) {
        let mut wakeups = 0;
        loop {
            let at = w.next_deadline().expect("entry still scheduled");
            wakeups += 1;
            assert!(wakeups < 100, "next_deadline does not converge");
            if let Some((deadline, _)) = w.poll(at) {
                w.check_invariants();
                return (at, deadline, wakeups);
            }
            w.check_invariants();
            assert_eq!(w.elapsed(), at);
        }
    }

    #[test]
    fn entry_stays_small() {
        // deadline + two links + level/slot, padded: the item is the only other cost.
        assert!(mem::size_of::<Node<u64>>() <= 32);
        assert!(mem::size_of::<Node<u32>>() <= 24);
    }

    #[test]
    fn exact_deadlines_on_level_boundaries() {
        let deltas = [
            1,
            2,
            63,
            64,
            65,
            127,
            128,
            4095,
            4096,
            4097,
            (1 << 18) - 1,
            1 << 18,
            (1 << 18) + 1,
            DAY,
            DAY + 12_345,
            (1 << 30) + 7,
            (1 << 36) - 1,
            1 << 36,
            (1 << 36) + 1,
            3 * YEAR,
            3 * YEAR + 1,
            1 << 40,
        ];
        let starts = [0, 1, 63, 64, 1000, (1 << 36) - 5, (1 << 36) + 77, 1 << 50, 0x1234_5678_9abc];
        for &start in &starts {
            for &delta in &deltas {
                let deadline = start + delta;
                // Polling right up to the deadline never yields it...
                let mut w = TimerWheel::new(start);
                w.insert(deadline, 7).unwrap();
                assert!(w.next_deadline().unwrap() <= deadline);
                assert_eq!(w.poll(deadline - 1), None, "early: {start}+{delta}");
                w.check_invariants();
                assert_eq!(w.elapsed(), deadline - 1);
                assert_eq!(w.len(), 1);
                // ...and polling at it does, exactly once.
                assert_eq!(w.poll(deadline), Some((deadline, 7)), "late: {start}+{delta}");
                assert_eq!(w.poll(deadline), None);
                assert!(w.is_empty());
                assert_eq!(w.next_deadline(), None);

                // A caller driven only by next_deadline wakes up at most a few times and gets
                // the entry exactly at its deadline.
                let mut w = TimerWheel::new(start);
                w.insert(deadline, 7).unwrap();
                let (at, got, wakeups) = sleep_and_poll(&mut w);
                assert_eq!((at, got), (deadline, deadline));
                assert!(wakeups <= LEVELS + 1 + (delta >> WHEEL_BITS) as usize);

                // Jumping far past it hands it out too.
                let mut w = TimerWheel::new(start);
                w.insert(deadline, 7).unwrap();
                assert_eq!(w.poll(deadline + 10 * YEAR), Some((deadline, 7)));
            }
        }
    }

    #[test]
    fn lowest_level_next_deadline_is_exact() {
        let mut w = TimerWheel::new(100);
        // 100 and 120 share the 64 ms block 64..128: level 0, exact.
        w.insert(120, 1).unwrap();
        w.insert(5000, 2).unwrap();
        assert_eq!(w.next_deadline(), Some(120));
        w.remove(TimerKey::new(0));
        // 5000 differs from 100 in bit 12: level 2, whose slot starts at 4096. Reaching it
        // cascades to level 1 (slot start 4992), then to level 0 (exact).
        assert_eq!(w.next_deadline(), Some(4096));
        assert_eq!(w.poll(4096), None);
        assert_eq!(w.next_deadline(), Some(4992));
        assert_eq!(w.poll(4992), None);
        assert_eq!(w.next_deadline(), Some(5000));
        assert_eq!(w.poll(5000), Some((5000, 2)));
    }

    #[test]
    fn already_due_insert_returns_item() {
        let mut w = TimerWheel::new(100);
        assert_eq!(w.insert(100, 1), Err(1));
        assert_eq!(w.insert(0, 2), Err(2));
        assert!(w.insert(101, 3).is_ok());
        assert_eq!(w.poll(200), Some((101, 3)));
        assert_eq!(w.poll(200), None);
        assert_eq!(w.insert(150, 4), Err(4));
        assert_eq!(w.insert(200, 5), Err(5));
        assert!(w.insert(201, 6).is_ok());
        assert_eq!(w.len(), 1);
        w.check_invariants();
    }

    #[test]
    fn items_are_never_dropped_on_err() {
        use std::rc::Rc;
        let token = Rc::new(());
        let mut w = TimerWheel::new(10);
        let back = w.insert(5, Rc::clone(&token)).unwrap_err();
        assert_eq!(Rc::strong_count(&token), 2);
        drop(back);
        assert_eq!(Rc::strong_count(&token), 1);
    }

    #[test]
    fn remove_then_poll_never_yields_it() {
        let mut w = TimerWheel::new(0);
        let a = w.insert(50, 1).unwrap();
        let b = w.insert(5000, 2).unwrap();
        let c = w.insert(1 << 38, 3).unwrap();
        let d = w.insert(5000, 4).unwrap();
        assert_eq!(w.remove(a), (50, 1));
        assert_eq!(w.remove(b), (5000, 2));
        assert_eq!(w.remove(c), (1 << 38, 3));
        w.check_invariants();
        assert_eq!(w.deadline(d), 5000);
        assert_eq!(drain(&mut w, u64::MAX), vec![(5000, 4)]);
        assert!(w.is_empty());
    }

    #[test]
    fn remove_from_due_list() {
        let mut w = TimerWheel::new(0);
        let keys: Vec<_> = (0..5).map(|i| w.insert(4096, i).unwrap()).collect();
        // Cascading the level-2 slot moves all five to the due list; one comes out.
        let (d, first) = w.poll(5000).unwrap();
        assert_eq!(d, 4096);
        w.check_invariants();
        let rest: Vec<_> = keys.iter().copied().filter(|k| k.index() != first).collect();
        assert_eq!(w.remove(rest[1]), (4096, rest[1].index()));
        assert_eq!(w.next_deadline(), Some(4096));
        w.check_invariants();
        let mut out: Vec<_> = drain(&mut w, 5000).into_iter().map(|x| x.1).collect();
        out.sort_unstable();
        let mut want: Vec<_> = rest.iter().map(|k| k.index()).filter(|&i| i != rest[1].index()).collect();
        want.sort_unstable();
        assert_eq!(out, want);
    }

    #[test]
    fn b6_compaction_keeps_every_entry_and_deadline_and_reports_moved_keys() {
        let mut w = TimerWheel::new(0);
        let deadline = |item: u32| if item >= 1_000 { 1 } else { u64::from(item) * 7 + 1 };
        let mut keys: Vec<Option<TimerKey>> = (0..1_003u32).map(|i| Some(w.insert(deadline(i), i).unwrap())).collect();
        for (i, key) in keys.iter_mut().enumerate().take(1_000) {
            if i % 10 != 0 {
                w.remove(key.take().unwrap());
            }
        }
        // Three entries fall due at 1 and one is handed out: two wait in the
        // due list while the slab moves.
        let (_, first) = w.poll(1).unwrap();
        keys[first as usize] = None;
        let before = w.slab_len();
        w.compact(|&item, key| keys[item as usize] = Some(key));
        assert_eq!(w.slab_len(), w.len());
        assert!(w.slab_len() * 8 < before, "{} cells of {before}", w.slab_len());
        w.check_invariants();
        for (item, key) in keys.iter().enumerate() {
            if let Some(key) = key {
                assert_eq!(w.deadline(*key), deadline(item as u32), "item {item}");
                assert_eq!(*w.item_mut(*key) as usize, item);
            }
        }
        let mut out = drain(&mut w, 10_000);
        out.sort_unstable();
        let mut want: Vec<(Tick, u32)> =
            (0..1_003u32).filter(|&i| (i >= 1_000 || i % 10 == 0) && i != first).map(|i| (deadline(i), i)).collect();
        want.sort_unstable();
        assert_eq!(out, want);
    }

    #[test]
    fn keys_reused_after_removal() {
        let mut w = TimerWheel::new(0);
        let a = w.insert(10, 1).unwrap();
        let b = w.insert(20, 2).unwrap();
        w.remove(a);
        let c = w.insert(3000, 3).unwrap();
        assert_eq!(c, a, "freed cell reused");
        assert_eq!(w.deadline(c), 3000);
        assert_eq!(w.deadline(b), 20);
        assert_eq!(w.poll(25), Some((20, 2)));
        let d = w.insert(30, 4).unwrap();
        assert_eq!(d, b, "polled cell reused");
        w.check_invariants();
        assert_eq!(drain(&mut w, 10_000), vec![(30, 4), (3000, 3)]);
    }

    #[test]
    fn poll_with_now_going_back() {
        let mut w = TimerWheel::new(1000);
        w.insert(1500, 1).unwrap();
        w.insert(3000, 2).unwrap();
        assert_eq!(w.poll(2000), Some((1500, 1)));
        assert_eq!(w.poll(2000), None);
        assert_eq!(w.elapsed(), 2000);
        assert_eq!(w.poll(10), None);
        assert_eq!(w.elapsed(), 2000);
        assert_eq!(w.insert(1999, 3), Err(3));
        assert_eq!(w.poll(2999), None);
        assert_eq!(w.poll(2500), None);
        assert_eq!(w.elapsed(), 2999);
        assert_eq!(w.poll(3000), Some((3000, 2)));
        w.check_invariants();
    }

    #[test]
    fn next_deadline_empty_and_after_remove() {
        let mut w = TimerWheel::<u32>::new(5);
        assert_eq!(w.next_deadline(), None);
        let k = w.insert(1 << 20, 1).unwrap();
        assert!(w.next_deadline().unwrap() <= 1 << 20);
        w.remove(k);
        assert_eq!(w.next_deadline(), None);
        let k = w.insert(3 * YEAR, 1).unwrap();
        let nd = w.next_deadline().unwrap();
        assert!(nd > 5 && nd <= 3 * YEAR);
        w.remove(k);
        assert_eq!(w.next_deadline(), None);
        assert_eq!(w.poll(u64::MAX), None);
        assert_eq!(w.elapsed(), u64::MAX);
        assert_eq!(w.insert(u64::MAX, 1), Err(1));
    }

    #[test]
    fn many_entries_in_one_slot_come_out_one_per_poll() {
        let mut w = TimerWheel::new(0);
        for i in 0..1000 {
            w.insert(777, i).unwrap();
        }
        let mut got = Vec::new();
        for left in (0..1000).rev() {
            let (d, i) = w.poll(777).unwrap();
            assert_eq!(d, 777);
            assert_eq!(w.len(), left);
            got.push(i);
        }
        assert_eq!(w.poll(777), None);
        got.sort_unstable();
        assert_eq!(got, (0..1000).collect::<Vec<_>>());
    }

    #[test]
    fn higher_level_slot_comes_out_in_deadline_order() {
        // All of these share one level-2 slot; cascading must still order them.
        let mut w = TimerWheel::new(0);
        let deadlines = [8000, 4200, 4097, 4100, 7999, 4100, 5000, 4097];
        for (i, &d) in deadlines.iter().enumerate() {
            w.insert(d, i as u32).unwrap();
        }
        let out: Vec<_> = drain(&mut w, 1 << 20).into_iter().map(|x| x.0).collect();
        let mut want = deadlines.to_vec();
        want.sort_unstable();
        assert_eq!(out, want);
    }

    #[test]
    fn budgeted_polls_resume_where_they_stopped() {
        let mut w = TimerWheel::new(0);
        for i in 0..300u32 {
            w.insert(1 + u64::from(i % 7) * 1000, i).unwrap();
        }
        let mut last = 0;
        let mut total = 0;
        loop {
            let mut n = 0;
            while n < 13 {
                match w.poll(10_000) {
                    Some((d, _)) => {
                        assert!(d >= last);
                        last = d;
                        n += 1;
                    }
                    None => break,
                }
            }
            w.check_invariants();
            total += n;
            if n < 13 {
                break;
            }
        }
        assert_eq!(total, 300);
    }

    #[test]
    fn never_early_never_late() {
        // Deterministic pseudo-random deadlines and poll times.
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        let mut rnd = move |m: u64| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed % m
        };
        let mut w = TimerWheel::new(12_345);
        let mut pending: BTreeMap<(Tick, u32), ()> = BTreeMap::new();
        let mut now = 12_345;
        for i in 0..5000u32 {
            let range = [100, 10_000, 1_000_000, 1 << 40][rnd(4) as usize];
            let d = now + 1 + rnd(range);
            w.insert(d, i).unwrap();
            pending.insert((d, i), ());
            if rnd(3) == 0 {
                let step = [50, 5000, 1 << 30][rnd(3) as usize];
                now += rnd(step);
                for (d, i) in drain(&mut w, now) {
                    let (&(first, _), _) = pending.first_key_value().unwrap();
                    assert_eq!(d, first, "out of order or early");
                    assert!(d <= now);
                    pending.remove(&(d, i)).expect("unknown item");
                }
                if let Some((&(first, _), _)) = pending.first_key_value() {
                    assert!(first > now, "late");
                    assert!(w.next_deadline().unwrap() <= first);
                }
            }
        }
        for (d, i) in drain(&mut w, u64::MAX) {
            pending.remove(&(d, i)).unwrap();
        }
        assert!(pending.is_empty());
    }

    #[test]
    fn debug_does_not_need_item_debug() {
        struct Opaque;
        let mut w = TimerWheel::new(0);
        assert!(w.insert(5, Opaque).is_ok());
        let s = format!("{w:?}");
        assert!(s.contains("TimerWheel") && s.contains("len: 1"));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(Tick),
        Remove(usize),
        Poll { advance: Tick, budget: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => prop_oneof![0..200u64, 0..100_000u64, 0..=(1u64 << 40)].prop_map(Op::Insert),
            2 => any::<usize>().prop_map(Op::Remove),
            3 => (prop_oneof![9 => 0..=5000u64, 1 => 0..=(1u64 << 40)], 1..50usize)
                .prop_map(|(advance, budget)| Op::Poll { advance, budget }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Internal structure stays consistent (every entry filed where `place` says, bitmaps
        /// match list heads, free list complete) through random operation sequences.
        #[test]
        fn structure_stays_consistent(start in 0u64..(1 << 45), ops in prop::collection::vec(op(), 1..120)) {
            let mut w = TimerWheel::new(start);
            let mut live: Vec<TimerKey> = Vec::new();
            let mut now = start;
            let mut seq = 0u32;
            for op in ops {
                match op {
                    Op::Insert(delta) => {
                        seq += 1;
                        if let Ok(k) = w.insert(now + delta, seq) {
                            live.push(k);
                        }
                    }
                    Op::Remove(i) if !live.is_empty() => {
                        let k = live.swap_remove(i % live.len());
                        w.remove(k);
                    }
                    Op::Remove(_) => {}
                    Op::Poll { advance, budget } => {
                        now += advance;
                        for _ in 0..budget {
                            if w.poll(now).is_none() {
                                break;
                            }
                        }
                        // Keys of polled entries are gone: rebuild from the slab.
                        live.retain(|k| matches!(w.nodes[k.index() as usize], Node::Occupied(_)));
                    }
                }
                w.check_invariants();
                prop_assert_eq!(w.len(), live.len());
            }
        }
    }
}
