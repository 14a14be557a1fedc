//! The coordinator: one node at a time, elected through etcd's election API
//! on the node's lease, gives every slot without a live owner to a live node.
//!
//! Leadership is a key etcd's election service makes under the node's lease:
//! when the node dies (its lease expires) or resigns, the next campaigner
//! is elected. Every slot the coordinator writes is written in a
//! transaction that also checks its leadership key still exists as it was
//! created, so a coordinator that lost the election (and does not know yet)
//! writes nothing; and on the slot's epoch, so it never overwrites a change
//! it did not see.
//!
//! A campaign belongs to one lease: when etcd says the lease is gone the
//! campaign ends, and a node that joins again campaigns anew. etcd answers a
//! waiting campaign once every key before it in line is gone, even when its
//! own key went with them (every lease let go at once, as when etcd thaws
//! after an outage): a campaign whose key is gone is stale and leads nothing.
//!
//! After an etcd outage, the nodes whose leases etcd let go join again one by
//! one, each at its own next keep-alive. Until every one of them could have,
//! a gone owner looks the same as one still serving that has not joined
//! again yet; so for [`Coordinator::start`]'s `rejoin_grace` after this node
//! saw etcd come back, the coordinator gives no gone owner's slot away.
//!
//! A gone owner may still act: cut off from etcd together with every node
//! it knows, it rides the outage out on their word (the server's
//! `cluster::outage`), while etcd, answering nodes that joined since, let
//! its lease go. So before claiming a gone owner's slot the coordinator
//! makes sure the owner no longer acts (C6): no majority of the cluster
//! could be giving it the word it rides on (`silence`, asked of every
//! registered node through [`Fencing::withhold`]), or the owner said so when
//! asked ([`Fencing::stand_down`]), or nothing listens at its address any
//! more, or its registration has been gone for longer than any node rides an
//! outage out ([`Campaigner::ride_out`]). The first is what lets a node that
//! stops without a word (a host gone, a frozen process, a node cut off
//! alone) be taken over within its lease TTL and a second (C4).

use std::collections::{HashMap, HashSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::v3electionpb::CampaignRequest;
use crate::silence::{Sightings, Withheld};
use crate::slots::{
    CLAIMS_PER_TXN, Fence, FencedClaim, NodeSetWatch, SlotMapWatch, claim_all_fenced, claim_fenced, repairs,
};
use crate::{Claim, Error, Etcd, LeaseState, NodeLease, NodeSet};

/// What a gone owner said when asked to stop acting.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoodDown {
    /// It stopped acting past its lease, and said so once every request it
    /// was serving had answered.
    Confirmed,
    /// Its address refuses connections: nothing runs there, nothing acts.
    NotRunning,
    /// No answer (a host down, a network cut): no telling.
    NoAnswer,
}

/// How the coordinator asks a node whose registration is gone to stop
/// acting: the node-to-node call is the server's.
pub trait Fencing: Send + Sync + std::fmt::Debug {
    /// Asks `node`, last registered at `address`, to stop riding out an etcd
    /// outage, and waits a bounded time for its answer.
    fn stand_down(&self, node: String, address: String) -> Pin<Box<dyn Future<Output = StoodDown> + Send>>;

    /// Asks the registered `node` at `address` to give none of `gone` the
    /// word that etcd does not answer it for `vow`, and whether a promise
    /// it made is in force; waits a bounded time for its answer.
    fn withhold(
        &self,
        node: String,
        address: String,
        gone: Vec<String>,
        vow: Duration,
    ) -> Pin<Box<dyn Future<Output = Withheld> + Send>>;
}

/// A node's part in the election, and while elected, the coordinator's work.
#[derive(Debug)]
pub struct Coordinator {
    leading: watch::Receiver<bool>,
    /// The state of the lease it campaigns on.
    lease_state: watch::Receiver<LeaseState>,
    task: JoinHandle<()>,
}

/// How often the coordinator looks again even if nothing changed: claims
/// that failed for etcd's reasons are retried by it.
const RECHECK: Duration = Duration::from_secs(1);

/// What a coordinator needs to know of its node beyond etcd.
#[derive(Debug, Clone)]
pub struct Campaigner {
    /// The node's id, the value it campaigns with.
    pub node: String,
    /// How long a new cluster (no slot has an owner yet) waits for no more
    /// nodes to join before it gives its slots out, so that nodes started
    /// together share them from the start instead of the first one taking
    /// all (repairs never move a live owner's slots): the initial delay
    /// Kafka's group coordinator calls `group.initial.rebalance.delay.ms`.
    pub settle: Duration,
    /// When this node last saw etcd come back after an outage (its
    /// keep-alives went unanswered, or etcd let its lease go), if ever.
    pub etcd_back: watch::Receiver<Option<Instant>>,
    /// For how long after `etcd_back` no gone owner's slot is given away:
    /// the time a node whose lease etcd let go takes to learn it and join
    /// again (at most a keep-alive beat, a third of the TTL; the lease's
    /// TTL leaves room for a node held up a while).
    pub rejoin_grace: Duration,
    /// How long past its lease any node may act riding out an etcd outage:
    /// a gone owner that does not answer is taken for one that no longer
    /// acts only once its registration has been gone this long.
    pub ride_out: Duration,
    /// The TTL of the nodes' etcd leases: a gone node last heard from etcd
    /// at most about this long before its registration went.
    pub lease_ttl: Duration,
    /// How to ask a gone owner to stop acting; `None`: nobody rides an
    /// outage out beyond `ride_out`, so only that wait applies.
    pub fencing: Option<Arc<dyn Fencing>>,
}

impl Coordinator {
    /// Campaigns for `campaigner` on its etcd lease `lease` to coordinate
    /// the `slots` slots under `prefix`, and coordinates while elected,
    /// until the lease is gone.
    pub fn start(etcd: &Etcd, prefix: &str, slots: u32, lease: &NodeLease, campaigner: Campaigner) -> Coordinator {
        let (publish, leading) = watch::channel(false);
        let held = Held { lease: lease.id(), lease_state: lease.subscribe(), campaigner };
        let task = tokio::spawn(campaign(etcd.clone(), prefix.to_owned(), slots, held, publish));
        Coordinator { leading, lease_state: lease.subscribe(), task }
    }

    /// Whether this node is the coordinator, as far as it knows: never once
    /// etcd said its lease is gone, even before the campaign's task (which
    /// may not have run since, on a busy machine) has stepped down.
    pub fn is_leading(&self) -> bool {
        *self.leading.borrow() && !matches!(*self.lease_state.borrow(), LeaseState::Lost)
    }
}

impl Drop for Coordinator {
    /// Stops campaigning and coordinating (the election key goes with the node's lease).
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The campaigning node, on one lease.
#[derive(Debug)]
struct Held {
    lease: i64,
    lease_state: watch::Receiver<LeaseState>,
    campaigner: Campaigner,
}

/// Returns once etcd has said the lease is gone.
async fn lease_lost(state: &mut watch::Receiver<LeaseState>) {
    while !matches!(*state.borrow_and_update(), LeaseState::Lost) {
        if state.changed().await.is_err() {
            // The lease's keeper stopped without saying: it was dropped.
            return;
        }
    }
}

/// Campaigns, and coordinates while elected, beside the node's sightings of
/// the cluster: kept from the campaign's start, so that a node elected when
/// the coordinator went silent knows what the gone nodes saw (`silence`).
async fn campaign(etcd: Etcd, prefix: String, slots: u32, held: Held, leading: watch::Sender<bool>) {
    let sightings = Arc::new(Mutex::new(Sightings::new(Instant::now())));
    tokio::select! {
        () = campaign_and_coordinate(&etcd, &prefix, slots, held, leading, &sightings) => {}
        () = keep_sighting(&etcd, &prefix, slots, &sightings) => {}
    }
}

/// Notes the registered nodes and the slot map's owners whenever either
/// changes, and etcd's raft term every [`RECHECK`]; never returns.
async fn keep_sighting(etcd: &Etcd, prefix: &str, slots: u32, sightings: &Mutex<Sightings>) {
    loop {
        let (nodes, map) =
            match (NodeSetWatch::start(etcd, prefix).await, SlotMapWatch::start(etcd, prefix, slots).await) {
                (Ok(nodes), Ok(map)) => (nodes, map),
                _ => {
                    tokio::time::sleep(RECHECK).await;
                    continue;
                }
            };
        let (mut nodes_changed, mut map_changed) = (nodes.subscribe(), map.subscribe());
        loop {
            let term = etcd.raft_term().await;
            {
                let now = Instant::now();
                let mut sightings = sightings.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
                match term {
                    Ok(term) => sightings.note_raft_term(now, term),
                    Err(_) => sightings.gap(now),
                }
                sightings.note(now, &nodes.current().ids(), map.current().owners());
            }
            tokio::select! {
                changed = nodes_changed.changed() => if changed.is_err() { break },
                changed = map_changed.changed() => if changed.is_err() { break },
                () = tokio::time::sleep(RECHECK) => {}
            }
        }
    }
}

async fn campaign_and_coordinate(
    etcd: &Etcd,
    prefix: &str,
    slots: u32,
    mut held: Held,
    leading: watch::Sender<bool>,
    sightings: &Mutex<Sightings>,
) {
    let etcd = etcd.clone();
    let prefix = prefix.to_owned();
    let name = election_name(&prefix);
    let node = held.campaigner.node.clone();
    loop {
        let request = CampaignRequest { name: name.clone(), lease: held.lease, value: node.as_bytes().to_vec() };
        // Answers once this node is elected; meanwhile it waits in line.
        let mut election = etcd.election.clone();
        let elected = tokio::select! {
            elected = election.campaign(request) => elected,
            () = lease_lost(&mut held.lease_state) => return,
        };
        let fence = match elected {
            Ok(answer) => match answer.into_inner().leader {
                Some(leader) => Fence { key: leader.key, create_revision: leader.rev },
                None => continue,
            },
            Err(status) => {
                tracing::warn!(%status, "campaigning for coordinator failed; again in a second");
                tokio::time::sleep(RECHECK).await;
                continue;
            }
        };
        match fence.holds(&etcd).await {
            Ok(true) => {}
            Ok(false) => {
                tracing::info!(node, "a campaign whose election key is gone was answered: not coordinating");
                tokio::time::sleep(RECHECK).await;
                continue;
            }
            Err(error) => {
                tracing::warn!(node, %error, "could not read the election key after a campaign; again in a second");
                tokio::time::sleep(RECHECK).await;
                continue;
            }
        }
        tracing::info!(node, "elected coordinator");
        leading.send_replace(true);
        let ended = tokio::select! {
            ended = coordinate(&etcd, &prefix, slots, &held.campaigner, &fence, sightings) => ended,
            () = lease_lost(&mut held.lease_state) => Ok(()),
        };
        leading.send_replace(false);
        match ended {
            Ok(()) => tracing::info!(node, "no longer the coordinator"),
            Err(error) => tracing::warn!(node, %error, "stopped coordinating"),
        }
        tokio::time::sleep(RECHECK).await;
    }
}

/// The name of the election of the coordinator of the cluster under `prefix`.
pub fn election_name(prefix: &str) -> Vec<u8> {
    format!("{prefix}coordinator").into_bytes()
}

/// Repairs the slot map whenever it or the set of nodes changes, until the
/// leadership is found gone (a fenced claim, or the key missing at a
/// recheck): `Ok` then.
async fn coordinate(
    etcd: &Etcd,
    prefix: &str,
    slots: u32,
    campaigner: &Campaigner,
    fence: &Fence,
    sightings: &Mutex<Sightings>,
) -> Result<(), Error> {
    let nodes = NodeSetWatch::start(etcd, prefix).await?;
    let map = SlotMapWatch::start(etcd, prefix, slots).await?;
    let (mut nodes_changed, mut map_changed) = (nodes.subscribe(), map.subscribe());
    let mut etcd_back = campaigner.etcd_back.clone();
    if (0..slots).all(|slot| map.current().owner(slot).is_none()) {
        // A new cluster: wait for the nodes starting with this one.
        while let Ok(Ok(())) = tokio::time::timeout(campaigner.settle, nodes_changed.changed()).await {}
        tracing::info!(nodes = nodes.current().ids().len(), "a new cluster: giving out its slots");
    }
    let mut said_held: Option<Instant> = None;
    let mut fenced = Fenced::new(sightings);
    loop {
        let registered = nodes.current();
        let live = registered.ids();
        let current = map.current();
        fenced.sightings().note(Instant::now(), &live, current.owners());
        let held_until = etcd_back.borrow_and_update().map(|back| back + campaigner.rejoin_grace);
        let held_until = held_until.filter(|&until| Instant::now() < until);
        let all = repairs(&current, &live);
        let wanted = all.len();
        // While held, only slots that never had an owner are given out.
        let claims: Vec<_> =
            all.into_iter().filter(|&(slot, _, _)| held_until.is_none() || current.owner(slot).is_none()).collect();
        // A gone owner's slots only once it no longer acts (C6).
        let owners = claims.iter().filter_map(|&(slot, _, _)| current.owner(slot).map(|owner| owner.node.clone()));
        fenced.ask(etcd, prefix, campaigner, &registered, owners.collect()).await;
        let claims: Vec<_> = claims
            .into_iter()
            .filter(|&(slot, _, _)| current.owner(slot).is_none_or(|owner| fenced.done.contains(&owner.node)))
            .collect();
        if let Some(until) = held_until
            && claims.len() < wanted
            && said_held != Some(until)
        {
            tracing::info!(
                slots = wanted - claims.len(),
                wait_ms = until.saturating_duration_since(Instant::now()).as_millis() as u64,
                "etcd came back from an outage: giving no gone node's slots away yet, while the nodes \
                 whose leases it let go join again"
            );
            said_held = Some(until);
        }
        let mut given = 0usize;
        let mut one_by_one = Vec::new();
        // Many slots at once in a transaction each (a dead node's hundreds
        // of slots must move within a second); a chunk that fails as a whole
        // is claimed slot by slot, which says which changed.
        // A dead owner's slot is claimed only while its owner is still gone
        // (the claims compare its registration's absence): a node that
        // registers again finds every claim of its slots in the map.
        let gone_owner = |slot: u32| current.owner(slot).map(|owner| owner.node.as_str());
        for chunk in claims.chunks(CLAIMS_PER_TXN) {
            let mut gone: Vec<&str> = chunk.iter().filter_map(|&(slot, _, _)| gone_owner(slot)).collect();
            gone.sort_unstable();
            gone.dedup();
            match claim_all_fenced(etcd, prefix, chunk, fence, &gone).await {
                Ok(Some(epoch)) => {
                    tracing::debug!(slots = chunk.len(), epoch, "slots given to live nodes");
                    given += chunk.len();
                }
                Ok(None) | Err(_) => one_by_one.extend_from_slice(chunk),
            }
        }
        for (slot, owner, seen) in one_by_one {
            match claim_fenced(etcd, prefix, slot, &owner, seen, fence, gone_owner(slot)).await {
                Ok(FencedClaim::Claimed(Claim::Won { epoch })) => {
                    tracing::debug!(slot, owner, epoch, "slot given to a live node");
                    given += 1;
                }
                // Someone else changed it: the next round sees the change.
                Ok(FencedClaim::Claimed(Claim::Stale { .. })) => {}
                Ok(FencedClaim::Fenced) => return Ok(()),
                Err(error) => tracing::warn!(slot, %error, "a slot claim failed; retried"),
            }
        }
        if given > 0 {
            tracing::info!(given, nodes = live.len(), "slots without a live owner given to live nodes");
        }
        let hold_ends = async {
            match held_until {
                Some(until) => tokio::time::sleep_until(until).await,
                None => std::future::pending().await,
            }
        };
        let waited_out = async {
            match fenced.next_deadline(campaigner.ride_out) {
                Some(at) => tokio::time::sleep_until(at).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            _ = nodes_changed.changed() => {}
            () = waited_out => {}
            _ = map_changed.changed() => {}
            _ = etcd_back.changed() => {}
            () = hold_ends => {}
            () = tokio::time::sleep(RECHECK) => {
                // Nothing changed: is this node still the one elected?
                if !fence.holds(etcd).await? {
                    return Ok(());
                }
            }
        }
    }
}

/// The coordinator's record of gone owners: since when each has been seen
/// gone, and which are known to act no more; and what it saw of the nodes.
#[derive(Debug)]
struct Fenced<'a> {
    gone_since: HashMap<String, Instant>,
    done: HashSet<String>,
    sightings: &'a Mutex<Sightings>,
}

/// How long the coordinator gives a gone owner to answer.
const ASK_WAIT: Duration = Duration::from_millis(500);

impl<'a> Fenced<'a> {
    fn new(sightings: &'a Mutex<Sightings>) -> Fenced<'a> {
        Fenced { gone_since: HashMap::new(), done: HashSet::new(), sightings }
    }

    fn sightings(&self) -> std::sync::MutexGuard<'a, Sightings> {
        self.sightings.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Notes every gone owner in `owners` that no longer acts: all of them
    /// when no majority of the cluster could be giving them the word to
    /// ride an outage out; otherwise each that says so when asked, at once.
    /// A node seen registered again is forgotten: should it go again, it is
    /// asked again.
    async fn ask(
        &mut self,
        etcd: &Etcd,
        prefix: &str,
        campaigner: &Campaigner,
        registered: &NodeSet,
        owners: Vec<String>,
    ) {
        let live = registered.ids();
        let mut owners = owners;
        owners.sort_unstable();
        owners.dedup();
        // Kept only while its slots wait to be claimed: a wait that starts
        // over is only ever longer.
        self.gone_since.retain(|node, _| owners.binary_search(node).is_ok());
        self.done.retain(|node| !live.contains(node));
        let waiting: Vec<String> = owners.iter().filter(|owner| !self.done.contains(*owner)).cloned().collect();
        if !waiting.is_empty() && self.no_majority(etcd, campaigner, registered, &waiting).await {
            tracing::info!(
                nodes = ?waiting,
                "gone nodes that no majority of the cluster could be giving the word to ride an etcd outage out \
                 act no more: their slots may be given away"
            );
            self.done.extend(waiting);
            return;
        }
        let now = Instant::now();
        let mut asked = tokio::task::JoinSet::new();
        for owner in owners {
            if self.done.contains(&owner) {
                continue;
            }
            // The registration has been gone at least since this coordinator
            // first saw it gone (it looks at least every `RECHECK`, far
            // within a lease TTL, so it sees a node that registers again).
            let since = *self.gone_since.entry(owner.clone()).or_insert(now);
            if now >= since + campaigner.ride_out {
                tracing::info!(node = owner, "a gone node's registration is older than any ride-out: it acts no more");
                self.done.insert(owner);
                continue;
            }
            let Some(fencing) = campaigner.fencing.clone() else { continue };
            let address = match crate::slots::last_address(etcd, prefix, &owner).await {
                Ok(Some(address)) => address,
                Ok(None) => continue,
                Err(error) => {
                    tracing::warn!(node = owner, %error, "could not read a gone node's address; asked again");
                    continue;
                }
            };
            asked.spawn(async move {
                let said = tokio::time::timeout(ASK_WAIT * 2, fencing.stand_down(owner.clone(), address)).await;
                (owner, said.unwrap_or(StoodDown::NoAnswer))
            });
            if asked.len() >= 64 {
                self.take_answers(&mut asked).await;
            }
        }
        self.take_answers(&mut asked).await;
    }

    /// Whether no majority of the cluster could be giving any of `gone` the
    /// word to act past its lease (`silence`): every registered node is
    /// asked to withhold it for a ride-out, at once.
    async fn no_majority(
        &mut self,
        etcd: &Etcd,
        campaigner: &Campaigner,
        registered: &NodeSet,
        gone: &[String],
    ) -> bool {
        let Some(fencing) = campaigner.fencing.clone() else { return false };
        let term = match etcd.raft_term().await {
            Ok(term) => term,
            Err(error) => {
                tracing::warn!(%error, "could not read etcd's raft term: waiting gone nodes out");
                self.sightings().gap(Instant::now());
                return false;
            }
        };
        let horizon = {
            let mut sightings = self.sightings();
            sightings.note_raft_term(Instant::now(), term);
            sightings.horizon(gone, campaigner.lease_ttl)
        };
        let Some(horizon) = horizon else {
            tracing::debug!(
                nodes = ?gone,
                "this coordinator has not seen the cluster since before these gone nodes may have lost etcd \
                 (a new coordinator, or a new etcd leader): waiting them out"
            );
            return false;
        };
        let mut asked = tokio::task::JoinSet::new();
        for node in registered.ids() {
            let Some(address) = registered.address(&node).map(str::to_owned) else { continue };
            let (fencing, gone) = (fencing.clone(), gone.to_vec());
            let vow = campaigner.ride_out;
            asked.spawn(async move {
                let said = tokio::time::timeout(ASK_WAIT, fencing.withhold(node.clone(), address, gone, vow)).await;
                (node, said.unwrap_or(Withheld::Unknown))
            });
        }
        let mut said = HashMap::new();
        while let Some(answered) = asked.join_next().await {
            if let Ok((node, answer)) = answered {
                said.insert(node, answer);
            }
        }
        let tally = self.sightings().tally(horizon, &said);
        tracing::debug!(?tally, "who could be giving gone nodes the word to ride an etcd outage out");
        tally.no_majority()
    }

    async fn take_answers(&mut self, asked: &mut tokio::task::JoinSet<(String, StoodDown)>) {
        while let Some(answered) = asked.join_next().await {
            let Ok((owner, said)) = answered else { continue };
            match said {
                StoodDown::Confirmed | StoodDown::NotRunning => {
                    tracing::info!(node = owner, ?said, "a gone node acts no more: its slots may be given away");
                    self.done.insert(owner);
                }
                StoodDown::NoAnswer => tracing::debug!(
                    node = owner,
                    "a gone node did not say it acts no more: its slots wait until its registration is older \
                     than any ride-out"
                ),
            }
        }
    }

    /// When the next gone owner not known to act no more will have been gone for `ride_out`.
    fn next_deadline(&self, ride_out: Duration) -> Option<Instant> {
        let waiting = self.gone_since.iter().filter(|(node, _)| !self.done.contains(*node));
        waiting.map(|(_, since)| *since + ride_out).min()
    }
}
