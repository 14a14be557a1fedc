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

use std::time::Duration;

use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::api::v3electionpb::CampaignRequest;
use crate::slots::{
    CLAIMS_PER_TXN, Fence, FencedClaim, NodeSetWatch, SlotMapWatch, claim_all_fenced, claim_fenced, repairs,
};
use crate::{Claim, Error, Etcd};

/// A node's part in the election, and while elected, the coordinator's work.
#[derive(Debug)]
pub struct Coordinator {
    leading: watch::Receiver<bool>,
    task: JoinHandle<()>,
}

/// How often the coordinator looks again even if nothing changed: claims
/// that failed for etcd's reasons are retried by it.
const RECHECK: Duration = Duration::from_secs(1);

impl Coordinator {
    /// Campaigns for `node` (on its etcd lease `lease`) to coordinate the
    /// `slots` slots under `prefix`, and coordinates while elected.
    ///
    /// A new cluster (no slot has an owner yet) is given its slots only once
    /// no node has joined for `settle`, so that nodes started together share
    /// them from the start instead of the first one taking all (repairs never
    /// move a live owner's slots): the initial delay Kafka's group
    /// coordinator calls `group.initial.rebalance.delay.ms`.
    pub fn start(etcd: &Etcd, prefix: &str, slots: u32, node: &str, lease: i64, settle: Duration) -> Coordinator {
        let (publish, leading) = watch::channel(false);
        let task =
            tokio::spawn(campaign(etcd.clone(), prefix.to_owned(), slots, node.to_owned(), lease, settle, publish));
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

async fn campaign(
    etcd: Etcd,
    prefix: String,
    slots: u32,
    node: String,
    lease: i64,
    settle: Duration,
    leading: watch::Sender<bool>,
) {
    let name = election_name(&prefix);
    loop {
        let request = CampaignRequest { name: name.clone(), lease, value: node.as_bytes().to_vec() };
        // Answers once this node is elected; meanwhile it waits in line.
        let elected = etcd.election.clone().campaign(request).await;
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
        tracing::info!(node, "elected coordinator");
        leading.send_replace(true);
        let ended = coordinate(&etcd, &prefix, slots, settle, &fence).await;
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
/// leadership is found gone (a fenced claim): `Ok` then.
async fn coordinate(etcd: &Etcd, prefix: &str, slots: u32, settle: Duration, fence: &Fence) -> Result<(), Error> {
    let nodes = NodeSetWatch::start(etcd, prefix).await?;
    let map = SlotMapWatch::start(etcd, prefix, slots).await?;
    let (mut nodes_changed, mut map_changed) = (nodes.subscribe(), map.subscribe());
    if (0..slots).all(|slot| map.current().owner(slot).is_none()) {
        // A new cluster: wait for the nodes starting with this one.
        while let Ok(Ok(())) = tokio::time::timeout(settle, nodes_changed.changed()).await {}
        tracing::info!(nodes = nodes.current().ids().len(), "a new cluster: giving out its slots");
    }
    loop {
        let live = nodes.current().ids();
        let current = map.current();
        let mut given = 0usize;
        let mut one_by_one = Vec::new();
        // Many slots at once in a transaction each (a dead node's hundreds
        // of slots must move within a second); a chunk that fails as a whole
        // is claimed slot by slot, which says which changed.
        // A dead owner's slot is claimed only while its owner is still gone
        // (the claims compare its registration's absence): a node that
        // registers again finds every claim of its slots in the map.
        let gone_owner = |slot: u32| current.owner(slot).map(|owner| owner.node.as_str());
        for chunk in repairs(&current, &live).chunks(CLAIMS_PER_TXN) {
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
        tokio::select! {
            _ = nodes_changed.changed() => {}
            _ = map_changed.changed() => {}
            () = tokio::time::sleep(RECHECK) => {}
        }
    }
}
