//! Whether gone nodes that do not answer could be riding an etcd outage out
//! (C4 made precise, C6).
//!
//! A node cut off from etcd acts past its lease only on the word "etcd
//! answers none of us either" from a majority of the cluster's nodes as it
//! last saw them (the registered nodes and the slot map's owners, itself
//! included); a node that etcd answers never gives that word, and each word
//! comes with a promise to take over no slot while it holds (the server's
//! `cluster::outage`). So before the coordinator waits a whole ride-out for
//! a silent gone owner, it asks every registered node to withhold its word
//! from the gone nodes for a ride-out, and to say whether it holds a promise.
//! Then, for every majority a gone node could be riding on:
//!
//! - every member gave its word within the last extension, so it holds a
//!   promise now, or is gone, or did not answer: it is *possibly a giver*;
//! - a node that vowed and holds no promise gave no word that is still in
//!   force and gives none from now on; if the gone node saw it registered
//!   before it lost etcd, it is in the gone node's count but never among its
//!   givers: *certainly not a giver*.
//!
//! With P the possible givers and C the certain non-givers, a gone node's
//! count N holds C and its givers M ⊆ P, so |N| ≥ |C| + |M|. When |P| ≤ |C|,
//! |N| ≥ |M| + |P| ≥ 2|M|: no majority, no ride-out, and the coordinator
//! takes over at once. Otherwise (a majority of the cluster could be cut off
//! together) it waits the ride-out as before.
//!
//! Which nodes a gone node saw: it last heard from etcd at most a lease TTL
//! (and etcd's expiry delay) before its registration went, unless etcd
//! elected a new leader since, which renews every lease in full. So a node
//! counts as seen by it only if this coordinator has seen it since before
//! that, with no change of etcd's raft term in between; a node this
//! coordinator saw registered or owning a slot at any time since then may
//! be in its count, and is a possible giver unless it vowed.

use std::collections::{BTreeSet, HashMap};
use std::time::Duration;

use tokio::time::Instant;

/// How much later than a lease TTL after its node's last keep-alive a
/// registration may be seen gone: etcd expires leases in a loop every half
/// second, and a gone node's view of the node set may lag its keep-alives
/// by a watch event's delivery. A coordinator that has not seen the cluster
/// for a TTL and this long before a node went waits that node out.
pub const EXPIRY_SLACK: Duration = Duration::from_secs(1);

/// What a registered node said to the coordinator's question.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Withheld {
    /// It gives the gone nodes no word for a ride-out; whether a promise it
    /// made earlier is still in force.
    Vowed {
        /// A promise (a word given) is in force.
        holds_promise: bool,
    },
    /// No answer, or a node of a version without the question.
    Unknown,
}

/// When this coordinator first and last saw a node.
#[derive(Debug, Clone, Copy)]
struct Seen {
    /// First seen registered or owning a slot, since [`Sightings::known_since`].
    first: Instant,
    /// Last seen registered or owning a slot.
    last: Instant,
    /// Last seen registered.
    last_registered: Option<Instant>,
}

/// The coordinator's sightings of the cluster's nodes.
#[derive(Debug)]
pub struct Sightings {
    seen: HashMap<String, Seen>,
    /// Since when the sightings are complete: the coordinator's start, or
    /// the last change of etcd's raft term (which renews every lease).
    known_since: Instant,
    raft_term: Option<u64>,
}

/// The count behind a verdict, for the log and the tests.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Tally {
    /// Nodes that may be giving a gone node its word.
    pub possible: BTreeSet<String>,
    /// Nodes in every gone node's count that give no word.
    pub certain: BTreeSet<String>,
}

impl Tally {
    /// Whether no gone node can hold a majority of words.
    pub fn no_majority(&self) -> bool {
        self.possible.len() <= self.certain.len()
    }
}

impl Sightings {
    /// Sightings from `now` on.
    pub fn new(now: Instant) -> Sightings {
        Sightings { seen: HashMap::new(), known_since: now, raft_term: None }
    }

    /// Notes the nodes `registered` and those owning a slot at `now`.
    pub fn note<'a>(&mut self, now: Instant, registered: &[String], owners: impl IntoIterator<Item = &'a str>) {
        for node in registered {
            let seen = self.seen.entry(node.clone()).or_insert(Seen { first: now, last: now, last_registered: None });
            seen.last = now;
            seen.last_registered = Some(now);
        }
        for node in owners {
            let seen =
                self.seen.entry(node.to_owned()).or_insert(Seen { first: now, last: now, last_registered: None });
            seen.last = now;
        }
    }

    /// Notes etcd's raft term as read at `now`: a new one renewed every
    /// lease, so nothing seen before it tells what a gone node saw.
    pub fn note_raft_term(&mut self, now: Instant, term: u64) {
        if self.raft_term.is_some_and(|known| known != term) {
            self.gap(now);
        }
        self.raft_term = Some(term);
    }

    /// Notes that etcd went unheard until `now` (a failed read): what
    /// changed meanwhile was not seen, so the sightings start again here.
    pub fn gap(&mut self, now: Instant) {
        self.known_since = now;
        for seen in self.seen.values_mut() {
            seen.first = seen.first.max(now);
        }
    }

    /// The earliest moment any of `gone` may have last heard from etcd,
    /// for a lease TTL of `lease_ttl`; `None` when the sightings do not
    /// reach back that far (a new coordinator, an etcd leader change) or a
    /// gone node was never seen registered.
    pub fn horizon(&self, gone: &[String], lease_ttl: Duration) -> Option<Instant> {
        let mut horizon: Option<Instant> = None;
        for node in gone {
            let last_registered = self.seen.get(node)?.last_registered?;
            let heard = last_registered.checked_sub(lease_ttl + EXPIRY_SLACK)?;
            horizon = Some(horizon.map_or(heard, |earliest| earliest.min(heard)));
        }
        horizon.filter(|&horizon| self.known_since <= horizon)
    }

    /// The count for gone nodes that last heard from etcd no earlier than
    /// `horizon`, given what the registered nodes said.
    pub fn tally(&self, horizon: Instant, said: &HashMap<String, Withheld>) -> Tally {
        let mut tally = Tally::default();
        for (node, seen) in &self.seen {
            if seen.last < horizon {
                // Gone from etcd before any of them last heard from it.
                continue;
            }
            match said.get(node) {
                Some(Withheld::Vowed { holds_promise: false }) => {
                    if seen.first <= horizon {
                        tally.certain.insert(node.clone());
                    }
                }
                _ => {
                    tally.possible.insert(node.clone());
                }
            }
        }
        tally
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(nodes: &[&str]) -> Vec<String> {
        nodes.iter().map(|node| (*node).to_owned()).collect()
    }

    const TTL: Duration = Duration::from_secs(2);

    /// Three nodes seen for a while; then `gone` vanish at `vanish`.
    fn cluster(nodes: &[&str], gone: &[&str]) -> (Sightings, Instant) {
        let start = Instant::now();
        let mut sightings = Sightings::new(start);
        sightings.note(start, &ids(nodes), nodes.iter().copied());
        let later = start + Duration::from_secs(10);
        sightings.note(later, &ids(nodes), nodes.iter().copied());
        let after = later + Duration::from_millis(100);
        let live: Vec<&str> = nodes.iter().copied().filter(|node| !gone.contains(node)).collect();
        sightings.note(after, &ids(&live), nodes.iter().copied());
        (sightings, after)
    }

    fn vowed(nodes: &[&str]) -> HashMap<String, Withheld> {
        nodes.iter().map(|node| ((*node).to_owned(), Withheld::Vowed { holds_promise: false })).collect()
    }

    #[test]
    fn one_silent_node_of_three_whose_peers_vow_has_no_majority() {
        let (sightings, _) = cluster(&["a", "b", "c"], &["c"]);
        let horizon = sightings.horizon(&ids(&["c"]), TTL).expect("seen long enough");
        let tally = sightings.tally(horizon, &vowed(&["a", "b"]));
        assert_eq!(tally.possible, ["c".to_owned()].into());
        assert_eq!(tally.certain, ["a".to_owned(), "b".to_owned()].into());
        assert!(tally.no_majority());
    }

    #[test]
    fn two_silent_nodes_of_three_could_be_a_majority() {
        let (sightings, _) = cluster(&["a", "b", "c"], &["b", "c"]);
        let horizon = sightings.horizon(&ids(&["b", "c"]), TTL).unwrap();
        assert!(!sightings.tally(horizon, &vowed(&["a"])).no_majority());
    }

    #[test]
    fn two_silent_nodes_of_five_are_a_minority() {
        let (sightings, _) = cluster(&["a", "b", "c", "d", "e"], &["d", "e"]);
        let horizon = sightings.horizon(&ids(&["d", "e"]), TTL).unwrap();
        assert!(sightings.tally(horizon, &vowed(&["a", "b", "c"])).no_majority());
    }

    #[test]
    fn a_peer_holding_a_promise_or_not_answering_may_be_a_giver() {
        let (sightings, _) = cluster(&["a", "b", "c"], &["c"]);
        let horizon = sightings.horizon(&ids(&["c"]), TTL).unwrap();
        let mut said = vowed(&["a"]);
        said.insert("b".into(), Withheld::Vowed { holds_promise: true });
        assert!(!sightings.tally(horizon, &said).no_majority(), "b gave a word still in force");
        said.insert("b".into(), Withheld::Unknown);
        assert!(!sightings.tally(horizon, &said).no_majority(), "b did not answer");
        said.remove("b");
        assert!(!sightings.tally(horizon, &said).no_majority(), "b was not asked");
    }

    #[test]
    fn nodes_that_joined_after_a_gone_node_lost_etcd_count_for_nothing() {
        // a, b, c run; b and c are cut off; d and e join before their
        // registrations go. b and c count a, b, c: they are a majority.
        let start = Instant::now();
        let mut sightings = Sightings::new(start);
        let all = ["a", "b", "c"];
        sightings.note(start, &ids(&all), all);
        let joined = start + Duration::from_secs(9);
        sightings.note(joined, &ids(&["a", "b", "c", "d", "e"]), all);
        let vanish = joined + Duration::from_millis(500);
        sightings.note(vanish, &ids(&["a", "d", "e"]), all);
        let horizon = sightings.horizon(&ids(&["b", "c"]), TTL).unwrap();
        let tally = sightings.tally(horizon, &vowed(&["a", "d", "e"]));
        assert_eq!(tally.certain, ["a".to_owned()].into(), "d and e are not in b's and c's count");
        assert!(!tally.no_majority());
    }

    #[test]
    fn a_node_gone_since_a_silent_node_last_heard_from_etcd_may_be_a_giver() {
        // d went a second before c: c may have seen it and had its word.
        let start = Instant::now();
        let mut sightings = Sightings::new(start);
        let all = ["a", "b", "c", "d"];
        sightings.note(start, &ids(&all), all);
        let d_gone = start + Duration::from_secs(10);
        sightings.note(d_gone, &ids(&["a", "b", "c"]), all);
        let c_gone = d_gone + Duration::from_secs(1);
        sightings.note(c_gone, &ids(&["a", "b"]), ["a", "b", "c"]);
        let horizon = sightings.horizon(&ids(&["c"]), TTL).unwrap();
        let tally = sightings.tally(horizon, &vowed(&["a", "b"]));
        assert_eq!(tally.possible, ["c".to_owned(), "d".to_owned()].into());
        assert!(tally.no_majority(), "two possible givers against two certain non-givers");
        // Gone long before: not in c's count.
        let mut sightings = Sightings::new(start);
        sightings.note(start, &ids(&all), all);
        sightings.note(start + Duration::from_secs(1), &ids(&["a", "b", "c"]), ["a", "b", "c"]);
        let c_gone = start + Duration::from_secs(20);
        sightings.note(c_gone - Duration::from_millis(100), &ids(&["a", "b", "c"]), ["a", "b", "c"]);
        sightings.note(c_gone, &ids(&["a", "b"]), ["a", "b", "c"]);
        let horizon = sightings.horizon(&ids(&["c"]), TTL).unwrap();
        assert_eq!(sightings.tally(horizon, &vowed(&["a", "b"])).possible, ["c".to_owned()].into());
    }

    #[test]
    fn no_verdict_without_sightings_from_before_a_gone_node_last_heard_from_etcd() {
        // A coordinator elected a moment ago knows nothing of what c saw.
        let start = Instant::now();
        let mut sightings = Sightings::new(start);
        sightings.note(start, &ids(&["a", "b", "c"]), ["a", "b", "c"]);
        sightings.note(start + Duration::from_secs(1), &ids(&["a", "b"]), ["a", "b", "c"]);
        assert_eq!(sightings.horizon(&ids(&["c"]), TTL), None);
        // Nor after etcd elected a new leader, which renewed every lease.
        let (mut sightings, now) = cluster(&["a", "b", "c"], &["c"]);
        sightings.note_raft_term(now - Duration::from_secs(9), 2);
        assert!(sightings.horizon(&ids(&["c"]), TTL).is_some());
        sightings.note_raft_term(now - Duration::from_secs(1), 3);
        assert_eq!(sightings.horizon(&ids(&["c"]), TTL), None);
        // Nor for a node never seen registered.
        let (sightings, _) = cluster(&["a", "b", "c"], &["c"]);
        assert_eq!(sightings.horizon(&ids(&["x"]), TTL), None);
    }
}
