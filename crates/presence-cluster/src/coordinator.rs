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

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use crate::api::v3electionpb::CampaignRequest;
use crate::slots::{
    CLAIMS_PER_TXN, Fence, FencedClaim, NodeSetWatch, SlotMapWatch, claim_all_fenced, claim_fenced, repairs,
};
use crate::{Claim, Error, Etcd, LeaseState, NodeLease};

/// A node's part in the election, and while elected, the coordinator's work.
#[derive(Debug)]
pub struct Coordinator {
    leading: watch::Receiver<bool>,
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
}

impl Coordinator {
    /// Campaigns for `campaigner` on its etcd lease `lease` to coordinate
    /// the `slots` slots under `prefix`, and coordinates while elected,
    /// until the lease is gone.
    pub fn start(etcd: &Etcd, prefix: &str, slots: u32, lease: &NodeLease, campaigner: Campaigner) -> Coordinator {
        let (publish, leading) = watch::channel(false);
        let held = Held { lease: lease.id(), lease_state: lease.subscribe(), campaigner };
        let task = tokio::spawn(campaign(etcd.clone(), prefix.to_owned(), slots, held, publish));
        Coordinator { leading, task }
    }

    /// Whether this node is the coordinator, as far as it knows.
    pub fn is_leading(&self) -> bool {
        *self.leading.borrow()
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

async fn campaign(etcd: Etcd, prefix: String, slots: u32, mut held: Held, leading: watch::Sender<bool>) {
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
            ended = coordinate(&etcd, &prefix, slots, &held.campaigner, &fence) => ended,
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
    loop {
        let live = nodes.current().ids();
        let current = map.current();
        let held_until = etcd_back.borrow_and_update().map(|back| back + campaigner.rejoin_grace);
        let held_until = held_until.filter(|&until| Instant::now() < until);
        let all = repairs(&current, &live);
        let wanted = all.len();
        // While held, only slots that never had an owner are given out.
        let claims: Vec<_> =
            all.into_iter().filter(|&(slot, _, _)| held_until.is_none() || current.owner(slot).is_none()).collect();
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
        tokio::select! {
            _ = nodes_changed.changed() => {}
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
