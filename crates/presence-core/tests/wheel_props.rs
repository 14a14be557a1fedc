//! Property test: the timer wheel against a naive ordered-map reference, through its public API.

use std::collections::{BTreeMap, HashMap};

use presence_core::wheel::{Tick, TimerWheel};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    /// Schedule at `clock + delta`.
    Insert(Tick),
    /// Cancel the live entry at this index (modulo the number of live entries).
    Remove(usize),
    /// Move the caller's clock forward without polling.
    Advance(Tick),
    /// Poll until `None` at `clock - back` (time going back when `back > 0`).
    PollAll { back: Tick },
    /// Poll at most `max` entries at `clock - back`.
    PollSome { back: Tick, max: usize },
}

fn op() -> impl Strategy<Value = Op> {
    let insert_delta = prop_oneof![
        4 => 0..200u64,
        3 => 0..100_000u64,
        1 => 0..=(1u64 << 40),
    ];
    let advance = prop_oneof![
        12 => 0..=5000u64,
        1 => 0..=(1u64 << 40),
    ];
    let back = prop_oneof![6 => Just(0u64), 1 => 0..10_000u64];
    prop_oneof![
        6 => insert_delta.prop_map(Op::Insert),
        2 => any::<usize>().prop_map(Op::Remove),
        3 => advance.prop_map(Op::Advance),
        2 => back.clone().prop_map(|back| Op::PollAll { back }),
        2 => (back, 0..20usize).prop_map(|(back, max)| Op::PollSome { back, max }),
    ]
}

fn start() -> impl Strategy<Value = Tick> {
    prop_oneof![Just(0u64), 0..1_000_000u64, ((1u64 << 36) - 10_000)..((1u64 << 36) + 10_000), 0..(1u64 << 50),]
}

/// The reference: live entries ordered by (deadline, key), plus each key's deadline. Every
/// insert takes a key never used before.
struct Model {
    wheel: TimerWheel,
    order: BTreeMap<(Tick, u32), ()>,
    keys: HashMap<u32, Tick>,
    /// Live keys, for picking a random one to remove.
    live: Vec<u32>,
    next_id: u32,
    /// Deadline of the last entry handed out: output is non-decreasing over the whole run.
    last_out: Tick,
}

impl Model {
    fn new(start: Tick) -> Self {
        Model {
            wheel: TimerWheel::new(start),
            order: BTreeMap::new(),
            keys: HashMap::new(),
            live: Vec::new(),
            next_id: 0,
            last_out: 0,
        }
    }

    fn min_deadline(&self) -> Option<Tick> {
        self.order.keys().next().map(|&(d, _)| d)
    }

    fn forget(&mut self, id: u32, deadline: Tick) {
        self.order.remove(&(deadline, id)).expect("id in order");
        self.keys.remove(&id).expect("id in keys");
        let pos = self.live.iter().position(|&x| x == id).expect("id live");
        self.live.swap_remove(pos);
    }

    fn insert(&mut self, deadline: Tick) -> Result<(), TestCaseError> {
        let id = self.next_id;
        self.next_id += 1;
        let elapsed = self.wheel.elapsed();
        match self.wheel.insert(id, deadline) {
            Ok(()) => {
                prop_assert!(deadline > elapsed, "accepted already-due {deadline} <= {elapsed}");
                self.order.insert((deadline, id), ());
                self.keys.insert(id, deadline);
                self.live.push(id);
            }
            Err(back) => {
                prop_assert_eq!(back, id, "a different key came back");
                prop_assert_eq!(self.wheel.deadline(id), None, "a refused key is not scheduled");
                prop_assert!(deadline <= elapsed, "refused future {deadline} > {elapsed}");
            }
        }
        Ok(())
    }

    fn remove(&mut self, pick: usize) -> Result<(), TestCaseError> {
        if self.live.is_empty() {
            return Ok(());
        }
        let id = self.live[pick % self.live.len()];
        let deadline = self.keys[&id];
        prop_assert_eq!(self.wheel.remove(id), Some(deadline));
        prop_assert_eq!(self.wheel.remove(id), None, "removed twice");
        self.forget(id, deadline);
        Ok(())
    }

    /// Polls at `now` up to `max` times; returns whether the wheel reported nothing more due.
    fn poll(&mut self, now: Tick, max: usize) -> Result<bool, TestCaseError> {
        let before = self.wheel.elapsed();
        for _ in 0..max {
            match self.wheel.poll(now) {
                Some((deadline, id)) => {
                    // Never early, and always an earliest live entry (so in order, never late
                    // relative to anything still waiting).
                    prop_assert!(deadline <= now.max(before), "early: {deadline} > {now}");
                    prop_assert_eq!(Some(deadline), self.min_deadline(), "not the earliest");
                    prop_assert!(deadline >= self.last_out, "out of order");
                    prop_assert_eq!(self.keys.get(&id).copied(), Some(deadline));
                    prop_assert_eq!(self.wheel.deadline(id), None, "a polled key is no longer scheduled");
                    self.last_out = deadline;
                    self.forget(id, deadline);
                }
                None => {
                    prop_assert_eq!(self.wheel.elapsed(), before.max(now));
                    if let Some(min) = self.min_deadline() {
                        prop_assert!(min > now, "late: {min} <= {now} still scheduled");
                    }
                    return Ok(true);
                }
            }
        }
        Ok(false)
    }

    fn check(&self) -> Result<(), TestCaseError> {
        prop_assert_eq!(self.wheel.len(), self.order.len());
        prop_assert_eq!(self.wheel.is_empty(), self.order.is_empty());
        match (self.wheel.next_deadline(), self.min_deadline()) {
            (None, None) => {}
            (Some(next), Some(min)) => {
                prop_assert!(next <= min, "next_deadline {next} after earliest {min}");
                // Either a future slot start, or (due entries pending) exactly their deadline.
                prop_assert!(next > self.wheel.elapsed() || next == min);
            }
            (next, min) => prop_assert!(false, "next_deadline {next:?} vs earliest {min:?}"),
        }
        for (&id, &deadline) in &self.keys {
            prop_assert_eq!(self.wheel.deadline(id), Some(deadline), "deadline of {}", id);
        }
        Ok(())
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn wheel_matches_reference(start in start(), ops in prop::collection::vec(op(), 1..200)) {
        let mut m = Model::new(start);
        let mut clock = start;
        for op in ops {
            match op {
                Op::Insert(delta) => m.insert(clock + delta)?,
                Op::Remove(pick) => m.remove(pick)?,
                Op::Advance(delta) => clock += delta,
                Op::PollAll { back } => {
                    prop_assert!(m.poll(clock.saturating_sub(back), usize::MAX)?);
                }
                Op::PollSome { back, max } => {
                    m.poll(clock.saturating_sub(back), max)?;
                }
            }
            m.check()?;
        }
        // A caller that only sleeps until next_deadline and polls there drains everything, in
        // order, with a bounded number of empty wake-ups.
        let mut wakeups = 0usize;
        // Each entry cascades through at most 6 levels; parked far entries share one top-level
        // slot visited once per 2^36 ms rotation.
        let span = m.order.keys().next_back().map_or(0, |&(d, _)| d - m.wheel.elapsed());
        let budget = 7 * (m.order.len() + 1) + (span >> 36) as usize + 2;
        while let Some(at) = m.wheel.next_deadline() {
            wakeups += 1;
            prop_assert!(wakeups <= budget, "next_deadline does not converge");
            m.poll(at, usize::MAX)?;
            m.check()?;
        }
        prop_assert!(m.order.is_empty());
    }
}
