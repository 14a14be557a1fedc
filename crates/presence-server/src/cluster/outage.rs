//! Serving through an etcd outage, and only through an outage.
//!
//! A node acts on its slots while etcd confirms its lease (see
//! `membership.rs`). When its keep-alives go unanswered, the node cannot
//! tell by itself whether etcd is down or it alone is cut off from etcd.
//! The first is safe to serve through: etcd being down, nobody can change
//! the slot map, so no other node can be given this node's slots. The
//! second is not: etcd will expire this node's lease and the coordinator
//! give its slots away.
//!
//! So a node whose keep-alives go unanswered asks every other node it knows
//! (`Cluster/EtcdReach`), every [`ROUND`], whether etcd answers them (each
//! asks etcd there and then):
//!
//! - When a majority of the cluster's nodes as this node last saw them (the
//!   registered nodes and the slot map's owners, itself included) say no,
//!   and none says yes, etcd is down for the cluster as far as it can tell,
//!   and the node may act for [`EXTENSION`] from the moment it sent the
//!   round, past its lease's deadline. Each node that said no (gave its
//!   word) promised to take over no other node's slots for [`PROMISE`] from
//!   its answer, longer than the extension: should etcd come back and give
//!   this node's slots to one of them, it acts on them only after this node
//!   has stopped.
//! - When one of them says yes, this node is the one cut off; when fewer
//!   than a majority say no (the others do not answer in time, refuse the
//!   connection or withhold their word), it may be. Either way it gets no
//!   extension and stops at its lease's deadline, before etcd could expire
//!   the lease (as without this module).
//!
//! A majority, not every node: one node that stops without a word (a host
//! gone, a frozen process) must neither stop the others riding a real
//! outage out nor, alone or with any minority, be able to ride one out
//! itself, so that the coordinator can take it over within its lease TTL
//! and a second (C4 made precise; `presence_cluster::silence` says why the
//! coordinator's count and this one agree).
//!
//! When etcd answers again, the lease's own deadline takes over; etcd
//! renews every lease in full when it comes back up, so nobody's lapses for
//! the outage. Planned moves are refused meanwhile (they need etcd).
//!
//! The state this keeps (the extension, the promises, the vows) is an
//! [`Outage`], which the membership holds and reads at every ownership
//! check. This module asks and answers, reaching the membership through the
//! [`ClusterNode`] it is given: the membership holds the state and the
//! [`Fencer`] without the two modules naming each other.
//!
//! What the others' word cannot see: a node that joined after every node
//! it asks lost etcd is not asked, and etcd may answer it alone and let
//! this node's lease go. Bounds close that (C6): a node acts past its lease
//! for at most `--etcd-ride-out-ms` (the cap in [`ride_out`]); and the
//! coordinator, before it gives a gone node's slots away, asks every
//! registered node to withhold its word from the gone nodes ([`Fencer`]'s
//! `withhold`) and takes them over at once if no majority could be giving
//! it; otherwise it asks each gone node to stand down (answered in
//! [`answer`]) and, when it cannot reach one, waits until the node's
//! registration has been gone that long (`presence_cluster::Coordinator`).

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use crate::cluster::ClusterNode;
use crate::cluster::forward::{call_peer, with_credential};
use crate::cluster::peers::Peers;
use crate::node::context::Context;
use parking_lot::Mutex;
use presence_cluster::{LeaseState, StoodDown, Withheld};
use presence_proto::v1::{self as pb, cluster_client::ClusterClient};
use tokio::task::JoinSet;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};

/// How long past the send time of a round that every other node answered
/// "etcd does not answer me either" the node may act.
pub(crate) const EXTENSION: Duration = Duration::from_millis(1_000);

/// How long a node that answered "etcd does not answer me" takes over no
/// other node's slots: the extension and a margin for clock rates.
pub(crate) const PROMISE: Duration = Duration::from_millis(1_500);

/// A node's part in riding out etcd outages.
#[derive(Debug)]
pub(crate) struct Outage {
    /// Until when the others' answers let this node act past its lease.
    extended_until: tokio::sync::watch::Sender<Option<Instant>>,
    /// Until when this node promised the others to take over no slot.
    no_takeover_before: Mutex<Option<Instant>>,
    /// Set when the coordinator, which etcd answers, asked this node to
    /// stand down: no extension until etcd answers this node again.
    stood_down: AtomicBool,
    /// Gone nodes the coordinator is about to take over, each with until
    /// when this node gives it no word that etcd does not answer here, and
    /// the revision of this node's view of the node set then: a
    /// registration made after it is the node joined again, which acts
    /// only on its new lease, and the vow is over.
    withheld: Mutex<HashMap<String, (Instant, i64)>>,
}

impl Default for Outage {
    fn default() -> Self {
        Outage {
            extended_until: tokio::sync::watch::Sender::new(None),
            no_takeover_before: Mutex::new(None),
            stood_down: AtomicBool::new(false),
            withheld: Mutex::new(HashMap::new()),
        }
    }
}

impl Outage {
    /// Until when the others' answers let this node act past its lease.
    pub(crate) fn extended_until(&self) -> Option<Instant> {
        *self.extended_until.borrow()
    }

    /// Changes of [`Outage::extended_until`], to wait on.
    pub(crate) fn extensions(&self) -> tokio::sync::watch::Receiver<Option<Instant>> {
        self.extended_until.subscribe()
    }

    pub(crate) fn extend_to(&self, until: Instant) {
        self.extended_until.send_if_modified(|extended| {
            // Checked under the channel's lock, which `stand_down` takes
            // too: no extension lands after a stand-down.
            if self.stood_down.load(Ordering::Acquire) {
                return false;
            }
            let later = extended.is_none_or(|extended| extended < until);
            if later {
                *extended = Some(until);
            }
            later
        });
    }

    /// Ends any extension, and refuses new ones until [`Outage::resume`].
    pub(crate) fn stand_down(&self) {
        self.extended_until.send_modify(|extended| {
            self.stood_down.store(true, Ordering::Release);
            *extended = None;
        });
    }

    /// Whether a coordinator asked this node to stand down since etcd last answered it.
    pub(crate) fn stood_down(&self) -> bool {
        self.stood_down.load(Ordering::Acquire)
    }

    /// etcd answers this node again: a later outage may be ridden out.
    pub(crate) fn resume(&self) {
        self.stood_down.store(false, Ordering::Release);
    }

    /// Promises to take over no slot of another node until `now` + [`PROMISE`].
    pub(crate) fn promise(&self, now: Instant) {
        let until = now + PROMISE;
        let mut promised = self.no_takeover_before.lock();
        if promised.is_none_or(|promised| promised < until) {
            *promised = Some(until);
        }
    }

    /// Whether a promise this node made is in force at `now`.
    pub(crate) fn holds_promise(&self, now: Instant) -> bool {
        self.no_takeover_before.lock().is_some_and(|until| now < until)
    }

    /// Gives `nodes` no word that etcd does not answer this node until
    /// `until` (the coordinator's question before a takeover, C4), and
    /// returns whether a promise this node made is in force. An earlier vow
    /// never shortens a later one. Under the same lock as
    /// [`Outage::give_word`]: a word is either given before the vow, and its
    /// promise counted here, or refused after it.
    pub(crate) fn withhold(&self, nodes: &[String], until: Instant, view_revision: i64) -> bool {
        let mut withheld = self.withheld.lock();
        let now = Instant::now();
        withheld.retain(|_, (vowed, _)| now < *vowed);
        for node in nodes {
            let (vowed, revision) = withheld.entry(node.clone()).or_insert((until, view_revision));
            *vowed = (*vowed).max(until);
            *revision = (*revision).max(view_revision);
        }
        self.holds_promise(now)
    }

    /// Gives `node` the word that etcd does not answer this node, with the
    /// promise that comes with it ([`Outage::promise`]), unless this node
    /// vowed not to and `node` has not registered again since
    /// (`registered_at`, the revision of its registration in this node's
    /// view); returns whether it did.
    pub(crate) fn give_word(&self, node: &str, registered_at: Option<i64>) -> bool {
        let withheld = self.withheld.lock();
        let now = Instant::now();
        let vowed = withheld.get(node).is_some_and(|&(until, revision)| {
            now < until && registered_at.is_none_or(|registered| registered <= revision)
        });
        if vowed {
            return false;
        }
        self.promise(now);
        true
    }

    /// Returns once every promise this node made has run out.
    pub(crate) async fn promises_kept(&self) {
        loop {
            let until = *self.no_takeover_before.lock();
            match until {
                Some(until) if Instant::now() < until => tokio::time::sleep_until(until).await,
                _ => return,
            }
        }
    }
}

/// How often a node whose keep-alives go unanswered asks the others, and
/// how long it waits for their answers.
pub(crate) const ROUND: Duration = Duration::from_millis(250);

/// How long a node asked may wait for etcd's answer: well within a round.
const PROBE: Duration = Duration::from_millis(150);

/// How long a connect to a node that did not answer may take to be refused.
const REFUSED_WITHIN: Duration = Duration::from_millis(200);

/// The answer to another node's `Cluster/EtcdReach`: whether etcd answers
/// this node now, found by asking it (within [`PROBE`]) rather than from
/// this node's last keep-alive, which may be a beat old.
pub(crate) async fn answer(cluster: &ClusterNode, request: &pb::EtcdReachRequest) -> pb::EtcdReachResponse {
    let membership = &cluster.membership;
    let refused = pb::EtcdReachResponse { etcd_answers: true, stood_down: true, ..Default::default() };
    if !request.withhold_from.is_empty() {
        let vow = Duration::from_millis(u64::from(request.withhold_ms)).min(MAX_VOW);
        let view = membership.nodes().revision();
        let holds_promise = membership.outage().withhold(&request.withhold_from, Instant::now() + vow, view);
        tracing::debug!(
            coordinator = request.from_node,
            gone = ?request.withhold_from,
            holds_promise,
            "giving gone nodes no word that etcd does not answer here, while the coordinator takes them over"
        );
        let etcd_answers = *membership.etcd_answering().borrow();
        return pb::EtcdReachResponse { etcd_answers, withheld: true, holds_promise, ..Default::default() };
    }
    if request.stand_down {
        tracing::warn!(
            coordinator = request.from_node,
            "the coordinator, which etcd answers, gives this node's slots away: acting past the lease no more"
        );
        membership.stand_down().await;
        return refused;
    }
    if membership.outage().stood_down() {
        // A node etcd answers said so: the node asking is no safer riding
        // the outage out than this one.
        return refused;
    }
    let etcd_answers = membership.etcd.answers_within(PROBE).await;
    if etcd_answers {
        return pb::EtcdReachResponse { etcd_answers, ..Default::default() };
    }
    let registered_at = membership.nodes().registered_at(&request.from_node);
    if !membership.outage().give_word(&request.from_node, registered_at) {
        // The coordinator is taking the node asking over: it gets no word.
        return refused;
    }
    pb::EtcdReachResponse { etcd_answers, promise_ms: PROMISE.as_millis() as u32, ..Default::default() }
}

/// The longest vow a node makes at the coordinator's word, whatever it asks:
/// longer than any ride-out `--etcd-ride-out-ms` allows.
const MAX_VOW: Duration = Duration::from_secs(600);

/// What the other nodes said in one round.
#[derive(Debug, PartialEq, Eq)]
enum Verdict {
    /// etcd answers none of them: it is down.
    EtcdDown,
    /// etcd answers `node`: this node is the one cut off.
    CutOff { node: String },
    /// Fewer than a majority of the cluster's nodes said etcd answers none
    /// of them (only `words` of `count` gave their word): no telling.
    NoMajority { words: usize, count: usize },
}

/// Asks the others every [`ROUND`] while etcd does not answer this node,
/// and extends its right to act while every one of them is in the same
/// case; until the server stops.
pub(crate) async fn ride_out(context: Arc<Context>, cluster: Arc<ClusterNode>) {
    let membership = &cluster.membership;
    let (mut answering, mut lease) = (membership.etcd_answering(), membership.lease_changes());
    loop {
        // Until etcd leaves a lease this node holds unanswered: a node whose
        // lease etcd let go joins again instead (`membership.rs`).
        while *answering.borrow_and_update() || membership.lease_lost() {
            lease.mark_unchanged();
            tokio::select! {
                changed = answering.changed() => if changed.is_err() { return },
                changed = lease.changed() => if changed.is_err() { return },
                () = context.stopping.cancelled() => return,
            }
        }
        tracing::warn!("etcd does not answer this node: asking the other nodes whether it answers them");
        let mut said: Option<Verdict> = None;
        let mut rounds = tokio::time::interval(ROUND);
        while !*answering.borrow() && !membership.lease_lost() {
            tokio::select! {
                _ = rounds.tick() => {}
                _ = answering.changed() => continue,
                () = context.stopping.cancelled() => return,
            }
            let sent = Instant::now();
            let verdict = ask_the_others(&cluster).await;
            if verdict == Verdict::EtcdDown {
                // Never past the lease by more than the ride-out: however
                // long this goes on, a coordinator that cannot reach this
                // node gives its slots away only after that (C6).
                if let LeaseState::ValidUntil(until) = *membership.lease_changes().borrow() {
                    membership.outage().extend_to((sent + EXTENSION).min(until + membership.ride_out));
                }
            }
            if said.as_ref() != Some(&verdict) {
                match &verdict {
                    Verdict::EtcdDown => tracing::warn!(
                        "etcd answers none of the other nodes either: serving on the slot map as it was, \
                         moving no slot, until it is back"
                    ),
                    Verdict::CutOff { node } => tracing::warn!(
                        node,
                        "etcd answers another node: this node is cut off from it, and stops acting \
                         when its lease lapses"
                    ),
                    Verdict::NoMajority { words, count } => tracing::warn!(
                        words,
                        count,
                        "fewer than a majority of the cluster's nodes say etcd answers none of them: no acting \
                         past the lease"
                    ),
                }
                said = Some(verdict);
            }
        }
        membership.outage().resume();
        tracing::info!("etcd answers this node again");
    }
}

/// One round: every other node of the last node set seen, at once.
async fn ask_the_others(cluster: &ClusterNode) -> Verdict {
    let membership = &cluster.membership;
    // The cluster's nodes as this node last saw them: a majority of them,
    // this node included, must give their word.
    let count = {
        let map = membership.map();
        let mut nodes: std::collections::BTreeSet<String> = map.owners().into_iter().map(str::to_owned).collect();
        nodes.extend(membership.live_ids());
        nodes.len()
    };
    let mut asked = JoinSet::new();
    for (node, address) in membership.others() {
        let client = membership.cluster_client(&address);
        let request = with_credential(
            pb::EtcdReachRequest { from_node: membership.node().to_owned(), ..Default::default() },
            membership.peer_token(),
        );
        asked.spawn(async move {
            let Ok(mut client) = client else { return (node, None) };
            match call_peer(&node, ROUND, client.etcd_reach(request)).await {
                // A node that stood down or withholds its word says etcd
                // answers it, as far as this node's riding goes.
                Ok(answer) => (node, Some(answer.etcd_answers)),
                // No answer (a node not running, a host gone, a network
                // cut): no word.
                _ => (node, None),
            }
        });
    }
    let mut words = 1; // this node's own
    while let Some(answered) = asked.join_next().await {
        match answered {
            Ok((node, Some(true))) => return Verdict::CutOff { node },
            Ok((_, Some(false))) => words += 1,
            _ => {}
        }
    }
    if words * 2 > count { Verdict::EtcdDown } else { Verdict::NoMajority { words, count } }
}

/// How the coordinator asks a gone node to stand down (C6): `Cluster/EtcdReach`
/// with `stand_down`, on the node's own connections and credential.
#[derive(Debug)]
pub(crate) struct Fencer {
    pub(crate) node: String,
    pub(crate) peers: Arc<Peers>,
    pub(crate) peer_token: Option<MetadataValue<Ascii>>,
}

/// How long a gone node is given to stand down.
const STAND_DOWN_WAIT: Duration = Duration::from_millis(500);

impl presence_cluster::Fencing for Fencer {
    fn stand_down(&self, node: String, address: String) -> Pin<Box<dyn Future<Output = StoodDown> + Send>> {
        let client = self.peers.channel(&address).map(ClusterClient::new);
        let request = with_credential(
            pb::EtcdReachRequest { from_node: self.node.clone(), stand_down: true, ..Default::default() },
            self.peer_token.as_ref(),
        );
        Box::pin(async move {
            if let Ok(mut client) = client
                && let Ok(answer) = call_peer(&node, STAND_DOWN_WAIT, client.etcd_reach(request)).await
                && answer.stood_down
            {
                return StoodDown::Confirmed;
            }
            // A node of a version without the stand-down answers without
            // `stood_down`: it is waited out like one that does not answer.
            if refuses_connections(&address).await { StoodDown::NotRunning } else { StoodDown::NoAnswer }
        })
    }

    fn withhold(
        &self,
        node: String,
        address: String,
        gone: Vec<String>,
        vow: Duration,
    ) -> Pin<Box<dyn Future<Output = Withheld> + Send>> {
        let client = self.peers.channel(&address).map(ClusterClient::new);
        let request = with_credential(
            pb::EtcdReachRequest {
                from_node: self.node.clone(),
                withhold_from: gone,
                withhold_ms: u32::try_from(vow.as_millis()).unwrap_or(u32::MAX),
                ..Default::default()
            },
            self.peer_token.as_ref(),
        );
        Box::pin(async move {
            let Ok(mut client) = client else { return Withheld::Unknown };
            match call_peer(&node, STAND_DOWN_WAIT, client.etcd_reach(request)).await {
                Ok(answer) if answer.withheld => Withheld::Vowed { holds_promise: answer.holds_promise },
                // A node of a version without the question, or no answer.
                _ => Withheld::Unknown,
            }
        })
    }
}

/// Whether a TCP connect to `address` is refused outright.
async fn refuses_connections(address: &str) -> bool {
    matches!(
        tokio::time::timeout(REFUSED_WITHIN, tokio::net::TcpStream::connect(address)).await,
        Ok(Err(error)) if error.kind() == std::io::ErrorKind::ConnectionRefused
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_promise_holds_back_takeovers_for_its_length_and_a_later_one_extends_it() {
        let outage = Outage::default();
        let start = Instant::now();
        outage.promises_kept().await;
        assert_eq!(Instant::now(), start, "no promise made: nothing to wait for");
        outage.promise(start);
        tokio::time::advance(Duration::from_millis(1_000)).await;
        outage.promise(Instant::now());
        // An earlier promise never shortens a later one.
        outage.promise(start);
        outage.promises_kept().await;
        assert_eq!(Instant::now(), start + Duration::from_millis(1_000) + PROMISE);
        assert!(PROMISE > EXTENSION, "a promise outlasts the extension it allows");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stand_down_ends_the_extension_and_refuses_more_until_etcd_answers_again() {
        let outage = Outage::default();
        let now = Instant::now();
        outage.extend_to(now + EXTENSION);
        outage.stand_down();
        assert_eq!(outage.extended_until(), None, "a stand-down ends the extension at once");
        outage.extend_to(now + 2 * EXTENSION);
        assert_eq!(outage.extended_until(), None, "no extension after a stand-down");
        outage.resume();
        outage.extend_to(now + EXTENSION);
        assert_eq!(outage.extended_until(), Some(now + EXTENSION));
    }

    #[tokio::test(start_paused = true)]
    async fn c4_a_vow_refuses_the_word_to_a_gone_node_until_it_ends_or_the_node_registers_again() {
        let outage = Outage::default();
        let vow_ends = Instant::now() + Duration::from_secs(10);
        assert!(!outage.withhold(&["node-b".to_owned()], vow_ends, 40), "no promise made yet");
        assert!(!outage.give_word("node-b", None), "gone: no word");
        assert!(!outage.give_word("node-b", Some(12)), "its old registration, in a view behind: no word");
        assert!(outage.give_word("node-c", None), "another node gets its word");
        assert!(outage.holds_promise(Instant::now()), "a word comes with a promise");
        assert!(outage.give_word("node-b", Some(41)), "registered again since the vow: the vow is over");
        tokio::time::advance(Duration::from_secs(10)).await;
        assert!(outage.give_word("node-b", None), "past the vow");
    }

    /// C4: the coordinator's vows only ever lengthen, and each asks whether
    /// a promise of this node's is in force (the takeover waits it out).
    #[tokio::test(start_paused = true)]
    async fn c4_a_vow_is_never_shortened_and_reports_a_promise_in_force() {
        let outage = Outage::default();
        let start = Instant::now();
        let gone = ["node-b".to_owned()];
        assert!(!outage.withhold(&gone, start + Duration::from_secs(10), 40));
        assert!(!outage.withhold(&gone, start + Duration::from_secs(1), 40), "an earlier vow changes nothing");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(!outage.give_word("node-b", None), "still vowed: the later end holds");
        assert!(outage.give_word("node-c", None), "node-c was never withheld");
        assert!(outage.withhold(&gone, start + Duration::from_secs(10), 40), "the word to node-c came with a promise");
        tokio::time::advance(PROMISE).await;
        assert!(!outage.withhold(&gone, start + Duration::from_secs(10), 40), "that promise ran out");
        tokio::time::advance(Duration::from_secs(5)).await;
        assert!(outage.give_word("node-b", None), "the vow ran out at its later end");
    }

    #[tokio::test(start_paused = true)]
    async fn an_extension_only_ever_moves_later() {
        let outage = Outage::default();
        let mut extensions = outage.extensions();
        let now = Instant::now();
        outage.extend_to(now + EXTENSION);
        assert!(extensions.has_changed().unwrap());
        extensions.mark_unchanged();
        outage.extend_to(now);
        assert_eq!(outage.extended_until(), Some(now + EXTENSION));
        assert!(!extensions.has_changed().unwrap(), "an earlier extension changes nothing");
    }
}
