//! A hierarchical timer wheel: the lease store's schedule of expiry deadlines.
//!
//! This module owns the data structure that answers "which keys are due by time `now`?" and
//! nothing else. It does no I/O, never reads a clock and spawns nothing: time is a plain
//! [`Tick`] (milliseconds) supplied by the caller, who decides when to sleep and when to
//! [`poll`](TimerWheel::poll). It knows nothing about what the scheduled keys mean.
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
//! # Keys
//!
//! What is scheduled is a *key*: a small integer the caller chooses, at most one entry per key
//! (the lease store's keys are its user slots, which are dense). The wheel keeps one 16-byte
//! node per key, indexed by the key, scheduled or not: the deadline and two links. So an entry
//! costs no handle for the caller to store and no item for the wheel to store, which matters at
//! one entry per user of a store holding millions. Each slot is an intrusive doubly linked list
//! through the nodes, and each level keeps a 64-bit occupancy bitmap, so insert, remove and
//! [`next_deadline`](TimerWheel::next_deadline) are O(1) (O(levels) for the latter) and polling
//! costs O(1) amortised per entry per level it cascades through.
//!
//! A node does not record which list it is on: its deadline says. An entry whose deadline is at
//! or before `elapsed` is on the due list (the wheel does not move while entries wait there), and
//! any other is in the slot its deadline is filed in relative to `elapsed` now, because
//! `elapsed` only moves within the span that keeps it there, or to the start of the slot, which
//! then is emptied.
//!
//! Reference: G. Varghese and T. Lauck, "Hashed and Hierarchical Timing Wheels: Data Structures
//! for the Efficient Implementation of a Timer Facility", SOSP 1987 (scheme 7, hierarchical
//! wheels).

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
/// The list of entries sitting in the due list rather than in a wheel slot.
const DUE: Level = Level::Due;
/// "No entry" in the intrusive links and list heads.
const NIL: u32 = u32::MAX;
/// The `prev` of a key that is not scheduled; no key can be a link to it.
const UNSCHEDULED: u32 = u32::MAX - 1;

/// Which list an entry is on: a wheel level, or the due list.
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

/// The schedule of one key: its deadline and its place in a list while it is scheduled.
#[derive(Clone, Copy)]
struct Node {
    deadline: Tick,
    /// `UNSCHEDULED` when the key is not scheduled.
    prev: u32,
    next: u32,
}

impl Node {
    const UNSCHEDULED: Node = Node { deadline: 0, prev: UNSCHEDULED, next: NIL };

    fn is_scheduled(&self) -> bool {
        self.prev != UNSCHEDULED
    }
}

/// The next slot the wheel has to visit and the time at which it starts.
#[derive(Clone, Copy, Debug)]
struct Expiration {
    level: Level,
    slot: u8,
    start: Tick,
}

/// A hierarchical timer wheel of keys (see the [module documentation](self) for the layout and
/// costs).
pub struct TimerWheel {
    /// Time up to which the wheel has been advanced. Every scheduled entry has a deadline after
    /// it; entries in the due list have a deadline equal to it.
    elapsed: Tick,
    /// One per key up to the highest one scheduled since the last [`truncate`](Self::truncate).
    nodes: Vec<Node>,
    /// Scheduled keys (in slots plus due).
    len: usize,
    /// Head of each slot's list, `NIL` when empty.
    heads: [[u32; SLOTS]; LEVELS],
    /// Bit `s` of `occupied[l]` is set iff `heads[l][s] != NIL`.
    occupied: [u64; LEVELS],
    /// Entries already found due but not yet handed out: poll hands out one per call so that a
    /// caller can bound the work done per call.
    due_head: u32,
}

impl std::fmt::Debug for TimerWheel {
    // Manual so that it does not dump 384 list heads and a node per key.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimerWheel")
            .field("elapsed", &self.elapsed)
            .field("len", &self.len)
            .field("occupied", &self.occupied)
            .field("has_due", &(self.due_head != NIL))
            .finish_non_exhaustive()
    }
}

impl TimerWheel {
    /// An empty wheel whose clock starts at `now` (nothing at or before `now` can be scheduled).
    pub fn new(now: Tick) -> Self {
        Self {
            elapsed: now,
            nodes: Vec::new(),
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

    /// Number of keys scheduled, including due ones not yet handed out.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether no key is scheduled.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Schedules `key` at `deadline`. A deadline that is already due (deadline <= elapsed) is
    /// not scheduled: the key is handed back as `Err(key)`. O(1), plus growing the nodes to
    /// `key` the first time a key that high is scheduled.
    ///
    /// # Panics
    ///
    /// If `key` is scheduled already, or is `u32::MAX - 1` or more.
    pub fn insert(&mut self, key: u32, deadline: Tick) -> Result<(), u32> {
        if deadline <= self.elapsed {
            return Err(key);
        }
        assert!(key < UNSCHEDULED, "TimerWheel::insert: key {key} is out of range");
        if key as usize >= self.nodes.len() {
            self.nodes.resize(key as usize + 1, Node::UNSCHEDULED);
        }
        assert!(!self.nodes[key as usize].is_scheduled(), "TimerWheel::insert: key {key} is scheduled already");
        self.nodes[key as usize].deadline = deadline;
        let (level, slot) = self.place(deadline);
        self.link(key, level, slot);
        self.len += 1;
        Ok(())
    }

    /// Cancels `key`'s entry and returns its deadline; `None` if it was not scheduled. O(1).
    pub fn remove(&mut self, key: u32) -> Option<Tick> {
        self.deadline(key)?;
        Some(self.take(key))
    }

    /// The deadline `key` is scheduled at, if it is.
    pub fn deadline(&self, key: u32) -> Option<Tick> {
        self.nodes.get(key as usize).filter(|node| node.is_scheduled()).map(|node| node.deadline)
    }

    /// Moves `from`'s entry, if it has one, to `to`, which must have none: the caller's record
    /// moved from one key to the other. O(1).
    ///
    /// # Panics
    ///
    /// If `to` is scheduled, or out of range.
    pub fn relocate(&mut self, from: u32, to: u32) {
        if self.deadline(from).is_none() {
            return;
        }
        assert!(to < UNSCHEDULED, "TimerWheel::relocate: key {to} is out of range");
        if to as usize >= self.nodes.len() {
            self.nodes.resize(to as usize + 1, Node::UNSCHEDULED);
        }
        assert!(!self.nodes[to as usize].is_scheduled(), "TimerWheel::relocate: key {to} is scheduled already");
        let node = mem::replace(&mut self.nodes[from as usize], Node::UNSCHEDULED);
        self.nodes[to as usize] = node;
        if node.prev == NIL {
            let (level, slot) = self.list_of(node.deadline);
            *self.head_mut(level, slot) = to;
        } else {
            self.nodes[node.prev as usize].next = to;
        }
        if node.next != NIL {
            self.nodes[node.next as usize].prev = to;
        }
    }

    /// Forgets the nodes of keys `keys` and above, none of which may be scheduled: the caller
    /// has no such keys any more. Keeps the memory; see [`shrink_to`](Self::shrink_to).
    pub fn truncate(&mut self, keys: usize) {
        debug_assert!(self.nodes.iter().skip(keys).all(|node| !node.is_scheduled()));
        self.nodes.truncate(keys);
    }

    /// Gives back the memory of nodes beyond `keys` (at least those in use are kept), so that a
    /// wheel whose caller once had many more keys than now gives it back.
    pub fn shrink_to(&mut self, keys: usize) {
        self.nodes.shrink_to(keys);
    }

    /// Nodes the wheel has memory for: what its keys cost.
    pub fn capacity(&self) -> usize {
        self.nodes.capacity()
    }

    /// A time at or before the earliest scheduled deadline at which `poll` may have work
    /// (exact for entries in the lowest level; the start of the slot for higher levels, so a
    /// caller that sleeps until it and polls will cascade and then ask again). `None` when empty.
    ///
    /// O(levels): it reads the per-level occupancy bitmaps and never scans entries.
    pub fn next_deadline(&self) -> Option<Tick> {
        if self.due_head != NIL {
            // Due entries all carry the deadline `elapsed`; report it exactly.
            return Some(self.nodes[self.due_head as usize].deadline);
        }
        self.next_expiration().map(|e| e.start)
    }

    /// Hands out one key whose deadline <= `now`, as `(deadline, key)`, advancing the wheel
    /// and cascading higher-level slots as needed; the key is no longer scheduled.
    ///
    /// Entries come out in non-decreasing deadline order across calls with the same or
    /// increasing `now` (entries with the same deadline in any order). Returns `None` when no
    /// entry is due at `now`; by then `elapsed() == max(previous elapsed, now)`. A `now` smaller
    /// than `elapsed()` is treated as `elapsed()` (time never goes back).
    ///
    /// Due entries are handed out one per call, so a caller can stop after a budget and call
    /// again later. A call that reaches a higher-level slot re-files that whole slot at once
    /// (O(1) per entry in it, no allocation) before handing anything out.
    pub fn poll(&mut self, now: Tick) -> Option<(Tick, u32)> {
        let now = now.max(self.elapsed);
        loop {
            if self.due_head != NIL {
                let key = self.due_head;
                let deadline = self.take(key);
                debug_assert!(deadline <= now);
                return Some((deadline, key));
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

    /// The list an entry with `deadline` is on now (see the module documentation).
    fn list_of(&self, deadline: Tick) -> (Level, u8) {
        if deadline <= self.elapsed { (DUE, 0) } else { self.place(deadline) }
    }

    /// Advances `elapsed` to the slot's start and empties the slot: due entries go to the due
    /// list, the rest are re-filed (cascaded) relative to the new `elapsed`.
    fn process(&mut self, exp: Expiration) {
        debug_assert_eq!(self.due_head, NIL);
        debug_assert!(exp.start > self.elapsed);
        let (level, slot) = (exp.level.index(), usize::from(exp.slot));
        let mut key = mem::replace(&mut self.heads[level][slot], NIL);
        self.occupied[level] &= !(1u64 << slot);
        self.elapsed = exp.start;
        while key != NIL {
            let Node { deadline, next, .. } = self.nodes[key as usize];
            // An in-range entry's deadline is within the slot; a parked one's is later still.
            debug_assert!(deadline >= exp.start);
            debug_assert!(level != 0 || deadline == exp.start);
            if deadline <= self.elapsed {
                self.link(key, DUE, 0);
            } else {
                let (new_level, new_slot) = self.place(deadline);
                // Cascading only ever moves down, except out of the overflow slot.
                debug_assert!(new_level.index() < level || (exp.level, exp.slot) == (TOP, OVERFLOW_SLOT));
                self.link(key, new_level, new_slot);
            }
            key = next;
        }
    }

    /// Unlinks `key`'s entry and marks the key unscheduled; returns the entry's deadline.
    fn take(&mut self, key: u32) -> Tick {
        self.unlink(key);
        self.len -= 1;
        mem::replace(&mut self.nodes[key as usize], Node::UNSCHEDULED).deadline
    }

    fn head_mut(&mut self, level: Level, slot: u8) -> &mut u32 {
        if level == DUE { &mut self.due_head } else { &mut self.heads[level.index()][usize::from(slot)] }
    }

    /// Pushes `key`'s entry at the front of list `(level, slot)`.
    fn link(&mut self, key: u32, level: Level, slot: u8) {
        let old_head = mem::replace(self.head_mut(level, slot), key);
        let node = &mut self.nodes[key as usize];
        node.prev = NIL;
        node.next = old_head;
        if old_head != NIL {
            self.nodes[old_head as usize].prev = key;
        }
        if level != DUE {
            self.occupied[level.index()] |= 1u64 << slot;
        }
    }

    /// Removes `key`'s entry from whichever list holds it, clearing the slot's bit if it empties.
    fn unlink(&mut self, key: u32) {
        let Node { deadline, prev, next } = self.nodes[key as usize];
        let (level, slot) = self.list_of(deadline);
        if prev == NIL {
            let head = self.head_mut(level, slot);
            debug_assert_eq!(*head, key);
            *head = next;
        } else {
            self.nodes[prev as usize].next = next;
        }
        if next != NIL {
            self.nodes[next as usize].prev = prev;
        }
        if level != DUE && prev == NIL && next == NIL {
            self.occupied[level.index()] &= !(1u64 << slot);
        }
    }

    /// Full structural check, O(keys). Test-only: too slow for every operation.
    #[cfg(test)]
    fn check_invariants(&self) {
        let mut seen = 0usize;
        let mut check_list = |head: u32, level: Level, slot: u8| {
            let mut prev = NIL;
            let mut key = head;
            while key != NIL {
                let node = self.nodes[key as usize];
                assert!(node.is_scheduled(), "a list reaches an unscheduled key");
                assert_eq!(node.prev, prev);
                if level == DUE {
                    assert_eq!(node.deadline, self.elapsed, "due entry not at elapsed");
                } else {
                    // Every scheduled entry sits exactly where it would be filed now, which is
                    // what lets a node go without recording its list.
                    assert!(node.deadline > self.elapsed);
                    assert_eq!(self.place(node.deadline), (level, slot), "misfiled entry");
                }
                seen += 1;
                prev = key;
                key = node.next;
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
        assert_eq!(self.nodes.iter().filter(|node| node.is_scheduled()).count(), self.len);
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
    fn drain(w: &mut TimerWheel, now: Tick) -> Vec<(Tick, u32)> {
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
    fn sleep_and_poll(w: &mut TimerWheel) -> (Tick, Tick, usize) {
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
    fn a_node_stays_small() {
        // A deadline and two links: one per user of a shard, scheduled or not.
        assert_eq!(mem::size_of::<Node>(), 16);
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
                w.insert(7, deadline).unwrap();
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
                w.insert(7, deadline).unwrap();
                let (at, got, wakeups) = sleep_and_poll(&mut w);
                assert_eq!((at, got), (deadline, deadline));
                assert!(wakeups <= LEVELS + 1 + (delta >> WHEEL_BITS) as usize);

                // Jumping far past it hands it out too.
                let mut w = TimerWheel::new(start);
                w.insert(7, deadline).unwrap();
                assert_eq!(w.poll(deadline + 10 * YEAR), Some((deadline, 7)));
            }
        }
    }

    #[test]
    fn lowest_level_next_deadline_is_exact() {
        let mut w = TimerWheel::new(100);
        // 100 and 120 share the 64 ms block 64..128: level 0, exact.
        w.insert(1, 120).unwrap();
        w.insert(2, 5000).unwrap();
        assert_eq!(w.next_deadline(), Some(120));
        w.remove(1);
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
    fn already_due_insert_returns_the_key_unscheduled() {
        let mut w = TimerWheel::new(100);
        assert_eq!(w.insert(1, 100), Err(1));
        assert_eq!(w.insert(2, 0), Err(2));
        assert_eq!(w.deadline(1), None);
        assert!(w.insert(3, 101).is_ok());
        assert_eq!(w.poll(200), Some((101, 3)));
        assert_eq!(w.poll(200), None);
        assert_eq!(w.insert(4, 150), Err(4));
        assert_eq!(w.insert(5, 200), Err(5));
        assert!(w.insert(6, 201).is_ok());
        assert_eq!(w.len(), 1);
        w.check_invariants();
    }

    #[test]
    #[should_panic(expected = "scheduled already")]
    fn a_key_is_scheduled_once_at_most() {
        let mut w = TimerWheel::new(0);
        w.insert(3, 10).unwrap();
        let _ = w.insert(3, 20);
    }

    #[test]
    fn remove_then_poll_never_yields_it() {
        let mut w = TimerWheel::new(0);
        w.insert(1, 50).unwrap();
        w.insert(2, 5000).unwrap();
        w.insert(3, 1 << 38).unwrap();
        w.insert(4, 5000).unwrap();
        assert_eq!(w.remove(1), Some(50));
        assert_eq!(w.remove(2), Some(5000));
        assert_eq!(w.remove(3), Some(1 << 38));
        assert_eq!(w.remove(3), None, "removed already");
        assert_eq!(w.remove(99), None, "never scheduled");
        w.check_invariants();
        assert_eq!(w.deadline(4), Some(5000));
        assert_eq!(drain(&mut w, u64::MAX), vec![(5000, 4)]);
        assert!(w.is_empty());
    }

    #[test]
    fn remove_from_due_list() {
        let mut w = TimerWheel::new(0);
        for key in 0..5 {
            w.insert(key, 4096).unwrap();
        }
        // Cascading the level-2 slot moves all five to the due list; one comes out.
        let (d, first) = w.poll(5000).unwrap();
        assert_eq!(d, 4096);
        w.check_invariants();
        let rest: Vec<u32> = (0..5).filter(|&key| key != first).collect();
        assert_eq!(w.remove(rest[1]), Some(4096));
        assert_eq!(w.next_deadline(), Some(4096));
        w.check_invariants();
        let mut out: Vec<_> = drain(&mut w, 5000).into_iter().map(|x| x.1).collect();
        out.sort_unstable();
        let want: Vec<u32> = rest.iter().copied().filter(|&key| key != rest[1]).collect();
        assert_eq!(out, want);
    }

    #[test]
    fn b6_an_entry_relocated_to_another_key_keeps_its_deadline_and_its_place_in_line() {
        let mut w = TimerWheel::new(0);
        // Keys 0..100: some in slots of every level, some heads of their lists, some due.
        let deadline = |key: u32| if key >= 90 { 1 } else { u64::from(key) * 7919 + 2 };
        for key in 0..100 {
            w.insert(key, deadline(key)).unwrap();
        }
        let (_, first) = w.poll(1).unwrap();
        // The caller's records 50..100 move down to the keys 0..50 of records it dropped:
        // it removes the dropped ones' entries, relocates, and truncates.
        let mut expected: Vec<(Tick, u32)> = Vec::new();
        for key in 0..50u32 {
            w.remove(key);
            let from = key + 50;
            w.relocate(from, key);
            if from != first {
                expected.push((deadline(from), key));
            }
            w.check_invariants();
        }
        w.truncate(50);
        w.shrink_to(50);
        assert!(w.capacity() < 100, "{} nodes kept", w.capacity());
        assert_eq!(w.deadline(first - 50), None, "a key handed out stays unscheduled when moved");
        let mut out = drain(&mut w, u64::MAX);
        out.sort_unstable();
        expected.sort_unstable();
        assert_eq!(out, expected);
    }

    #[test]
    fn keys_can_be_scheduled_again_once_removed_or_polled() {
        let mut w = TimerWheel::new(0);
        w.insert(1, 10).unwrap();
        w.insert(2, 20).unwrap();
        w.remove(1);
        w.insert(1, 3000).unwrap();
        assert_eq!(w.deadline(1), Some(3000));
        assert_eq!(w.deadline(2), Some(20));
        assert_eq!(w.poll(25), Some((20, 2)));
        assert_eq!(w.deadline(2), None);
        w.insert(2, 30).unwrap();
        w.check_invariants();
        assert_eq!(drain(&mut w, 10_000), vec![(30, 2), (3000, 1)]);
    }

    #[test]
    fn poll_with_now_going_back() {
        let mut w = TimerWheel::new(1000);
        w.insert(1, 1500).unwrap();
        w.insert(2, 3000).unwrap();
        assert_eq!(w.poll(2000), Some((1500, 1)));
        assert_eq!(w.poll(2000), None);
        assert_eq!(w.elapsed(), 2000);
        assert_eq!(w.poll(10), None);
        assert_eq!(w.elapsed(), 2000);
        assert_eq!(w.insert(3, 1999), Err(3));
        assert_eq!(w.poll(2999), None);
        assert_eq!(w.poll(2500), None);
        assert_eq!(w.elapsed(), 2999);
        assert_eq!(w.poll(3000), Some((3000, 2)));
        w.check_invariants();
    }

    #[test]
    fn next_deadline_empty_and_after_remove() {
        let mut w = TimerWheel::new(5);
        assert_eq!(w.next_deadline(), None);
        w.insert(1, 1 << 20).unwrap();
        assert!(w.next_deadline().unwrap() <= 1 << 20);
        w.remove(1);
        assert_eq!(w.next_deadline(), None);
        w.insert(1, 3 * YEAR).unwrap();
        let nd = w.next_deadline().unwrap();
        assert!(nd > 5 && nd <= 3 * YEAR);
        w.remove(1);
        assert_eq!(w.next_deadline(), None);
        assert_eq!(w.poll(u64::MAX), None);
        assert_eq!(w.elapsed(), u64::MAX);
        assert_eq!(w.insert(1, u64::MAX), Err(1));
    }

    #[test]
    fn many_entries_in_one_slot_come_out_one_per_poll() {
        let mut w = TimerWheel::new(0);
        for key in 0..1000 {
            w.insert(key, 777).unwrap();
        }
        let mut got = Vec::new();
        for left in (0..1000).rev() {
            let (d, key) = w.poll(777).unwrap();
            assert_eq!(d, 777);
            assert_eq!(w.len(), left);
            got.push(key);
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
        for (key, &d) in deadlines.iter().enumerate() {
            w.insert(key as u32, d).unwrap();
        }
        let out: Vec<_> = drain(&mut w, 1 << 20).into_iter().map(|x| x.0).collect();
        let mut want = deadlines.to_vec();
        want.sort_unstable();
        assert_eq!(out, want);
    }

    #[test]
    fn budgeted_polls_resume_where_they_stopped() {
        let mut w = TimerWheel::new(0);
        for key in 0..300u32 {
            w.insert(key, 1 + u64::from(key % 7) * 1000).unwrap();
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
        for key in 0..5000u32 {
            let range = [100, 10_000, 1_000_000, 1 << 40][rnd(4) as usize];
            let d = now + 1 + rnd(range);
            w.insert(key, d).unwrap();
            pending.insert((d, key), ());
            if rnd(3) == 0 {
                let step = [50, 5000, 1 << 30][rnd(3) as usize];
                now += rnd(step);
                for (d, key) in drain(&mut w, now) {
                    let (&(first, _), _) = pending.first_key_value().unwrap();
                    assert_eq!(d, first, "out of order or early");
                    assert!(d <= now);
                    pending.remove(&(d, key)).expect("unknown key");
                }
                if let Some((&(first, _), _)) = pending.first_key_value() {
                    assert!(first > now, "late");
                    assert!(w.next_deadline().unwrap() <= first);
                }
            }
        }
        for (d, key) in drain(&mut w, u64::MAX) {
            pending.remove(&(d, key)).unwrap();
        }
        assert!(pending.is_empty());
    }

    #[test]
    fn debug_is_short() {
        let mut w = TimerWheel::new(0);
        assert!(w.insert(5, 5).is_ok());
        let s = format!("{w:?}");
        assert!(s.contains("TimerWheel") && s.contains("len: 1"));
    }

    #[derive(Clone, Debug)]
    enum Op {
        Insert(Tick),
        Remove(usize),
        Relocate(usize),
        Poll { advance: Tick, budget: usize },
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => prop_oneof![0..200u64, 0..100_000u64, 0..=(1u64 << 40)].prop_map(Op::Insert),
            2 => any::<usize>().prop_map(Op::Remove),
            1 => any::<usize>().prop_map(Op::Relocate),
            3 => (prop_oneof![9 => 0..=5000u64, 1 => 0..=(1u64 << 40)], 1..50usize)
                .prop_map(|(advance, budget)| Op::Poll { advance, budget }),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]

        /// Internal structure stays consistent (every entry filed where `place` says, bitmaps
        /// match list heads, every scheduled key on exactly one list) through random operation
        /// sequences, relocations to fresh keys included.
        #[test]
        fn structure_stays_consistent(start in 0u64..(1 << 45), ops in prop::collection::vec(op(), 1..120)) {
            let mut w = TimerWheel::new(start);
            let mut live: Vec<u32> = Vec::new();
            let mut now = start;
            let mut fresh = 0u32;
            for op in ops {
                match op {
                    Op::Insert(delta) => {
                        fresh += 1;
                        if w.insert(fresh, now + delta).is_ok() {
                            live.push(fresh);
                        }
                    }
                    Op::Remove(i) if !live.is_empty() => {
                        let key = live.swap_remove(i % live.len());
                        prop_assert!(w.remove(key).is_some());
                    }
                    Op::Relocate(i) if !live.is_empty() => {
                        let i = i % live.len();
                        fresh += 1;
                        let deadline = w.deadline(live[i]);
                        w.relocate(live[i], fresh);
                        prop_assert_eq!(w.deadline(live[i]), None);
                        prop_assert_eq!(w.deadline(fresh), deadline);
                        live[i] = fresh;
                    }
                    Op::Remove(_) | Op::Relocate(_) => {}
                    Op::Poll { advance, budget } => {
                        now += advance;
                        for _ in 0..budget {
                            if w.poll(now).is_none() {
                                break;
                            }
                        }
                        // Polled keys are no longer scheduled.
                        live.retain(|&key| w.deadline(key).is_some());
                    }
                }
                w.check_invariants();
                prop_assert_eq!(w.len(), live.len());
            }
        }
    }
}
