//! Group memberships as a ledger every node of a cluster holds whole (P2,
//! P4 across nodes).
//!
//! A viewer sees a user of AUDIENCE visibility when they share a group, and
//! that is decided at the user's owner, which may be any node, about a
//! viewer that may be any user: so every node keeps every membership. Each
//! (group, user) has one entry, a member or not, stamped where the
//! JoinGroup or LeaveGroup that wrote it was served; between two entries of
//! one pair the one with the greater stamp wins, and on equal stamps the
//! leave. That order does not depend on the order in which entries arrive,
//! so nodes that have merged the same entries, in any order and any number of
//! times, hold the same memberships: a node sends what it wrote to every
//! other node at once, and every few seconds compares a digest of its
//! ledger with one other node's and merges that node's whole ledger when
//! they differ (`group_sync.rs`). A leave is kept as an entry (a tombstone)
//! so that an older join arriving late cannot bring the member back; in a
//! cluster, tombstones are forgotten after [`TOMBSTONE_HORIZON_MS`], which
//! bounds how long a node may be away and still be caught up by merging
//! (docs/cluster.md, "Limits"). A single node keeps none.
//!
//! Stamps are hybrid stamps of the node's store clock (`presence_core::stamp`),
//! so a later write anywhere has a greater stamp while the nodes' clocks
//! agree to within the time between the two writes.

use std::hash::{Hash, Hasher};

use std::collections::BTreeSet;

use hashbrown::HashMap;
use presence_core::CompactString;
use presence_core::stamp::{COUNTER_BITS, StampClock};

/// How long a cluster keeps a leave (store ms): a node away from the
/// cluster for longer may bring back memberships left meanwhile, and should
/// start with an empty data directory.
pub(crate) const TOMBSTONE_HORIZON_MS: u64 = 24 * 60 * 60 * 1000;

/// One (group, user) as last written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct GroupEntry {
    pub(crate) group: CompactString,
    pub(crate) user: CompactString,
    /// The stamp of the write, where it was served.
    pub(crate) stamp: u64,
    /// False: the user left the group (a tombstone).
    pub(crate) member: bool,
}

impl GroupEntry {
    /// Whether this entry wins over `(stamp, member)`: a newer stamp, or
    /// the same stamp and a leave over a join.
    pub(crate) fn beats(&self, stamp: u64, member: bool) -> bool {
        (self.stamp, !self.member) > (stamp, !member)
    }

    /// This entry's share of a ledger's digest: the same on every node.
    fn digest(&self) -> u64 {
        // SipHash with fixed keys: the same on every node of one build. Nodes
        // of different builds may differ, which costs only a merge that
        // changes nothing.
        #[allow(deprecated)]
        let mut hasher = std::hash::SipHasher::new();
        (self.group.as_str(), self.user.as_str(), self.stamp, self.member).hash(&mut hasher);
        hasher.finish()
    }
}

/// What merging an entry changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Merged {
    /// The entry was not newer than the one held: nothing changed.
    Stale,
    /// The entry replaced the one held, and the user's membership is as it was.
    Restamped,
    /// The user joined (`true`) or left (`false`) the group.
    Membership(bool),
}

/// How many parts a ledger's digest has: two nodes compare the parts and
/// send each other only the entries of the parts that differ.
pub(crate) const DIGEST_PARTS: usize = 256;

/// The horizon moves in steps of this much, so that nodes whose clocks
/// agree forget the same tombstones and their digests agree again.
const HORIZON_STEP_MS: u64 = 60 * 60 * 1000;

/// The digest part of a (group, user) pair: the same on every node of one build.
fn part_of(group: &str, user: &str) -> usize {
    #[allow(deprecated)]
    let mut hasher = std::hash::SipHasher::new();
    (group, user).hash(&mut hasher);
    (hasher.finish() % DIGEST_PARTS as u64) as usize
}

/// Every (group, user) entry this node holds, members and tombstones.
#[derive(Debug)]
pub(crate) struct GroupLedger {
    entries: HashMap<(CompactString, CompactString), (u64, bool)>,
    /// Per part, the XOR of its entries' digests, kept as they change: two
    /// ledgers holding the same entries have the same digests.
    digests: Vec<u64>,
    /// The tombstones held, oldest first, to forget them without a scan.
    tombstones: BTreeSet<(u64, CompactString, CompactString)>,
    /// Tombstones older than this stamp are forgotten, and not taken in again.
    forgotten_below: u64,
    clock: StampClock,
    /// Whether leaves are kept as tombstones (in a cluster).
    keep_tombstones: bool,
}

impl Default for GroupLedger {
    fn default() -> Self {
        GroupLedger::new(false)
    }
}

impl GroupLedger {
    pub(crate) fn new(keep_tombstones: bool) -> Self {
        GroupLedger {
            entries: HashMap::new(),
            digests: vec![0; DIGEST_PARTS],
            tombstones: BTreeSet::new(),
            forgotten_below: 0,
            clock: StampClock::default(),
            keep_tombstones,
        }
    }

    /// Entries for a write served here at store time `now`: `users` join
    /// (`member`) or leave `group`, stamped above every entry held.
    pub(crate) fn stamp(
        &mut self,
        now: u64,
        group: &CompactString,
        users: &[CompactString],
        member: bool,
    ) -> Vec<GroupEntry> {
        users
            .iter()
            .map(|user| GroupEntry { group: group.clone(), user: user.clone(), stamp: self.clock.next(now), member })
            .collect()
    }

    /// Whether a leave stamped `stamp` is kept as a tombstone.
    fn keeps_tombstone(&self, stamp: u64) -> bool {
        self.keep_tombstones && stamp >= self.forgotten_below
    }

    /// Whether the ledger holds a row for `entry` once it is merged (else
    /// the pair's row goes): on disk as in memory.
    pub(crate) fn keeps_row(&self, entry: &GroupEntry) -> bool {
        entry.member || self.keeps_tombstone(entry.stamp)
    }

    /// Whether `entry` would change what is held.
    pub(crate) fn is_newer(&self, entry: &GroupEntry) -> bool {
        match self.entries.get(&(entry.group.clone(), entry.user.clone())) {
            Some(&(stamp, member)) => entry.beats(stamp, member),
            // A leave of a pair never held changes nothing, but is kept in a
            // cluster, where a join it beats may still be on its way, unless
            // it is past the horizon (then forgotten everywhere).
            None => entry.member || self.keeps_tombstone(entry.stamp),
        }
    }

    /// Takes `entry` in if it is newer than the one held.
    pub(crate) fn merge(&mut self, entry: &GroupEntry) -> Merged {
        if !self.is_newer(entry) {
            return Merged::Stale;
        }
        self.clock.raise_to(entry.stamp);
        let key = (entry.group.clone(), entry.user.clone());
        let part = part_of(&key.0, &key.1);
        let was_member = match self.entries.remove(&key) {
            Some((stamp, member)) => {
                let held = GroupEntry { group: key.0.clone(), user: key.1.clone(), stamp, member };
                self.digests[part] ^= held.digest();
                if !member {
                    self.tombstones.remove(&(stamp, key.0.clone(), key.1.clone()));
                }
                member
            }
            None => false,
        };
        if self.keeps_row(entry) {
            self.digests[part] ^= entry.digest();
            if !entry.member {
                self.tombstones.insert((entry.stamp, key.0.clone(), key.1.clone()));
            }
            self.entries.insert(key, (entry.stamp, entry.member));
        }
        if was_member == entry.member { Merged::Restamped } else { Merged::Membership(entry.member) }
    }

    /// The digest of each part of the ledger.
    pub(crate) fn digests(&self) -> Vec<u64> {
        self.digests.clone()
    }

    /// The entries held, members and tombstones, of the parts whose digest
    /// differs from `theirs`; every entry when `theirs` is not a digest of
    /// [`DIGEST_PARTS`] parts.
    pub(crate) fn entries_differing(&self, theirs: &[u64]) -> Vec<GroupEntry> {
        let whole = theirs.len() != DIGEST_PARTS;
        self.entries
            .iter()
            .filter(|((group, user), _)| {
                whole || {
                    let part = part_of(group, user);
                    theirs[part] != self.digests[part]
                }
            })
            .map(|((group, user), &(stamp, member))| GroupEntry {
                group: group.clone(),
                user: user.clone(),
                stamp,
                member,
            })
            .collect()
    }

    /// Forgets the tombstones older than the horizon at store time `now`
    /// ([`TOMBSTONE_HORIZON_MS`] back, in steps of an hour, so that nodes
    /// forget the same ones); returns them, to forget on disk too.
    pub(crate) fn forget_old_tombstones(&mut self, now: u64) -> Vec<GroupEntry> {
        let step = now - now % HORIZON_STEP_MS;
        let horizon = step.saturating_sub(TOMBSTONE_HORIZON_MS) << COUNTER_BITS;
        self.forgotten_below = self.forgotten_below.max(horizon);
        let mut old = Vec::new();
        while let Some(first) = self.tombstones.first().filter(|(stamp, _, _)| *stamp < horizon) {
            let (stamp, group, user) = first.clone();
            self.tombstones.pop_first();
            self.entries.remove(&(group.clone(), user.clone()));
            let entry = GroupEntry { group, user, stamp, member: false };
            self.digests[part_of(&entry.group, &entry.user)] ^= entry.digest();
            old.push(entry);
        }
        old
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(group: &str, user: &str, stamp: u64, member: bool) -> GroupEntry {
        GroupEntry { group: group.into(), user: user.into(), stamp, member }
    }

    fn held(ledger: &GroupLedger) -> Vec<GroupEntry> {
        let mut entries = ledger.entries_differing(&[]);
        entries.sort_by(|a, b| (&a.group, &a.user).cmp(&(&b.group, &b.user)));
        entries
    }

    /// P2 across nodes: the same entries merged in any order, any number of
    /// times, leave the same memberships and the same digest.
    #[test]
    fn p2_ledgers_that_merged_the_same_entries_in_any_order_hold_the_same() {
        let writes = [
            entry("team", "ann", 10, true),
            entry("team", "ann", 12, false),
            entry("team", "bob", 11, true),
            entry("team", "bob", 11, false), // the same stamp: the leave wins
            entry("team", "cid", 13, true),
            entry("ops", "ann", 9, false),
            entry("ops", "ann", 14, true),
        ];
        let mut forward = GroupLedger::new(true);
        for write in &writes {
            forward.merge(write);
        }
        let mut backward = GroupLedger::new(true);
        for write in writes.iter().rev().chain(writes.iter()) {
            backward.merge(write);
        }
        assert_eq!(held(&forward), held(&backward));
        assert_eq!(forward.digests(), backward.digests());
        let members: Vec<(String, String)> = held(&forward)
            .into_iter()
            .filter(|entry| entry.member)
            .map(|entry| (entry.group.to_string(), entry.user.to_string()))
            .collect();
        assert_eq!(members, [("ops".into(), "ann".into()), ("team".into(), "cid".into())]);
        assert_ne!(
            forward.digests(),
            GroupLedger::new(true).digests(),
            "a ledger holding entries has a digest of them"
        );
        // A ledger that lacks one entry is sent the entries of that entry's part only.
        let mut lacking = GroupLedger::new(true);
        for write in writes.iter().filter(|write| write.user != "cid") {
            lacking.merge(write);
        }
        let sent = forward.entries_differing(&lacking.digests());
        assert!(
            sent.contains(&entry("team", "cid", 13, true)) && sent.len() < forward.entries_differing(&[]).len(),
            "{sent:?}"
        );
        for entry in &sent {
            lacking.merge(entry);
        }
        assert_eq!(lacking.digests(), forward.digests());
        assert!(forward.entries_differing(&forward.digests()).is_empty());
    }

    proptest::proptest! {
        /// P2 across nodes, for any writes: two cluster nodes that take in
        /// the same entries in different orders, one of them some twice, hold
        /// the same entries and digest, and the memberships of the writes
        /// that win. (A single node keeps no tombstones, so is not order-free:
        /// it needs not be, taking in only its own writes, in stamp order.)
        #[test]
        fn p2_any_entries_merged_in_any_two_orders_converge(
            writes in proptest::collection::vec((0u8..3, 0u8..4, 0u64..40, proptest::bool::ANY), 0..60),
            shuffle in proptest::collection::vec(proptest::num::usize::ANY, 60),
        ) {
            let writes: Vec<GroupEntry> = writes
                .into_iter()
                .map(|(group, user, stamp, member)| entry(&format!("g{group}"), &format!("u{user}"), stamp, member))
                .collect();
            let mut reordered = writes.clone();
            for (at, pick) in shuffle.iter().enumerate().take(reordered.len()) {
                let len = reordered.len();
                reordered.swap(at, at + pick % (len - at));
            }
            let (mut one, mut other) = (GroupLedger::new(true), GroupLedger::new(true));
            for write in &writes {
                one.merge(write);
            }
            for write in reordered.iter().chain(writes.iter().step_by(2)) {
                other.merge(write);
            }
            proptest::prop_assert_eq!(held(&one), held(&other));
            proptest::prop_assert_eq!(one.digests(), other.digests());
            // Each pair ends as its winning write says.
            for write in &writes {
                let winner = writes
                    .iter()
                    .filter(|other| other.group == write.group && other.user == write.user)
                    .fold(write, |best, other| if other.beats(best.stamp, best.member) { other } else { best });
                let member = held(&one).iter().any(|held| held.group == write.group && held.user == write.user && held.member);
                proptest::prop_assert_eq!(member, winner.member, "{:?}", winner);
            }
        }
    }

    /// A late join older than the leave held does not bring the member back;
    /// merging says exactly when the membership changed.
    #[test]
    fn p4_a_late_older_join_does_not_undo_a_leave() {
        let mut ledger = GroupLedger::new(true);
        assert_eq!(
            ledger.merge(&entry("team", "ann", 20, false)),
            Merged::Restamped,
            "a tombstone for a pair never held"
        );
        assert_eq!(ledger.merge(&entry("team", "ann", 10, true)), Merged::Stale);
        assert_eq!(ledger.merge(&entry("team", "ann", 30, true)), Merged::Membership(true));
        assert_eq!(ledger.merge(&entry("team", "ann", 31, true)), Merged::Restamped);
        assert_eq!(ledger.merge(&entry("team", "ann", 31, true)), Merged::Stale, "the same entry again");
        assert_eq!(ledger.merge(&entry("team", "ann", 32, false)), Merged::Membership(false));
    }

    /// Stamps made here are above every stamp merged, so a write served here
    /// after a merge wins over it.
    #[test]
    fn p4_a_write_served_after_a_merge_wins_over_it() {
        let mut ledger = GroupLedger::new(true);
        let far_ahead = (5_000 << COUNTER_BITS) + 7;
        ledger.merge(&entry("team", "ann", far_ahead, true));
        let leave = ledger.stamp(1_000, &"team".into(), &["ann".into()], false);
        assert!(leave[0].stamp > far_ahead);
        assert_eq!(ledger.merge(&leave[0]), Merged::Membership(false));
    }

    /// A single node keeps no tombstones; a cluster forgets them after the horizon.
    #[test]
    fn b6_tombstones_are_kept_only_in_a_cluster_and_only_for_the_horizon() {
        let mut single = GroupLedger::new(false);
        single.merge(&entry("team", "ann", 10, true));
        single.merge(&entry("team", "ann", 11, false));
        assert!(single.entries_differing(&[]).is_empty());
        assert!(single.digests().iter().all(|&digest| digest == 0));

        let mut cluster = GroupLedger::new(true);
        let (day, hour) = (TOMBSTONE_HORIZON_MS, HORIZON_STEP_MS);
        cluster.merge(&entry("team", "ann", 1_000 << COUNTER_BITS, false));
        cluster.merge(&entry("team", "bob", (day + 1_000) << COUNTER_BITS, false));
        cluster.merge(&entry("team", "cid", 500 << COUNTER_BITS, true));
        assert!(cluster.forget_old_tombstones(day + hour - 1).is_empty(), "the horizon moves by the hour");
        let forgotten = cluster.forget_old_tombstones(day + hour);
        assert_eq!(forgotten, [entry("team", "ann", 1_000 << COUNTER_BITS, false)]);
        assert_eq!(held(&cluster).len(), 2, "a member, however old, and the newer tombstone stay");
        assert_eq!(
            cluster.merge(&entry("team", "ann", 1_000 << COUNTER_BITS, false)),
            Merged::Stale,
            "a tombstone past the horizon, sent by a node that has not forgotten it yet, is not taken in again"
        );
        assert_eq!(
            cluster.merge(&entry("team", "cid", 900 << COUNTER_BITS, false)),
            Merged::Membership(false),
            "but it still ends an older membership"
        );
        assert_eq!(held(&cluster).len(), 1);
        let mut fresh = GroupLedger::new(true);
        for entry in cluster.entries_differing(&[]) {
            fresh.merge(&entry);
        }
        assert_eq!(fresh.digests(), cluster.digests(), "the digest follows what is forgotten");
    }
}
