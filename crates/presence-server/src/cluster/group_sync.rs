//! Keeping every node's group ledger the same (P2 and P4 across a cluster;
//! the ledger itself is `groups.rs`).
//!
//! A node that serves a JoinGroup or LeaveGroup sends the entries it wrote
//! to every other node before it answers, so that a viewer on any node sees
//! the change once the call returns; a node that does not answer in time is
//! logged and left to the catch-up. The catch-up: as it starts, a node asks
//! every other node for its ledger, then every [`CATCH_UP_INTERVAL`] one
//! node at random, sending the digests of the 256 parts of its own; the node
//! asked answers the entries of the parts whose digests differ, which the
//! asker merges. Merging is order-free,
//! so what one node missed (it was down, cut off, or joined later) reaches
//! it from any node that has it, and every node that merged the same entries
//! holds the same memberships.

use std::sync::Arc;
use std::time::Duration;

use presence_proto::v1 as pb;
use tokio::task::JoinSet;

use crate::cluster::forward::{FORWARD_TIMEOUT, call_peer, with_credential};
use crate::cluster::membership::Membership;
use crate::cluster::wire as cluster_wire;
use crate::error::ServiceError;
use crate::metrics::names;
use crate::node::context::Context;
use crate::node::groups::GroupEntry;

/// How often a node compares its ledger with another node's.
pub(crate) const CATCH_UP_INTERVAL: Duration = Duration::from_secs(5);

/// Entries are sent in pieces of about this many bytes.
const PIECE_BYTES: usize = 1 << 20;

/// Sends entries this node wrote to every other node of the cluster, all at
/// once; a node that does not take them is logged and counted (the
/// catch-up will bring them there).
pub(crate) async fn send_to_the_others(membership: &Membership, entries: &[GroupEntry]) {
    // Cut and encoded once, whatever the number of nodes.
    let pieces = cluster_wire::group_entry_pieces(entries, PIECE_BYTES);
    let mut sent = JoinSet::new();
    for (node, address) in membership.others() {
        let client = membership.cluster_client(&address);
        let pieces: Vec<_> =
            pieces.iter().map(|piece| with_credential(piece.clone(), membership.peer_token())).collect();
        sent.spawn(async move {
            let mut client = client.map_err(|err| (node.clone(), err))?;
            for piece in pieces {
                call_peer(&node, FORWARD_TIMEOUT, client.merge_groups(piece))
                    .await
                    .map_err(|err| (node.clone(), err))?;
            }
            Ok::<_, (String, ServiceError)>(())
        });
    }
    while let Some(done) = sent.join_next().await {
        if let Ok(Err((node, err))) = done {
            tracing::warn!(node, %err, "a node did not take a group change; the catch-up will bring it");
            metrics::counter!(names::GROUP_SENDS_MISSED).increment(1);
        }
    }
}

/// Runs the catch-up for as long as the node serves.
pub(crate) async fn catch_up(context: Arc<Context>, cluster: Arc<crate::cluster::ClusterNode>) {
    let membership = &cluster.membership;
    let mut first = true;
    loop {
        let others = membership.others();
        let asked: Vec<(String, String)> = if first {
            others
        } else {
            others.get(fastrand::usize(..others.len().max(1))).cloned().into_iter().collect()
        };
        first = false;
        for (node, address) in asked {
            if let Err(err) = merge_ledger_of(&context, membership, &node, &address).await {
                tracing::debug!(node, %err, "group catch-up: no ledger from this node this round");
            }
        }
        // Every round: the oldest tombstones are found without a scan, and
        // nodes that forget the same ones soon after the hour agree again.
        match context.privacy.forget_old_group_tombstones().await {
            Ok(0) => {}
            Ok(forgotten) => tracing::info!(forgotten, "forgot group leaves past the horizon"),
            Err(err) => tracing::warn!(%err, "group leaves past the horizon not forgotten"),
        }
        tokio::select! {
            () = tokio::time::sleep(CATCH_UP_INTERVAL) => {}
            () = context.stopping.cancelled() => return,
        }
    }
}

/// Asks `node` for its ledger with this node's digest and merges what it answers.
async fn merge_ledger_of(
    context: &Context,
    membership: &Membership,
    node: &str,
    address: &str,
) -> Result<(), ServiceError> {
    let mut client = membership.cluster_client(address)?;
    let digests = context.privacy.group_digests();
    let request = with_credential(pb::GroupLedgerRequest { digests }, membership.peer_token());
    let mut pieces = call_peer(node, FORWARD_TIMEOUT, client.group_ledger(request)).await?;
    let (mut merged, mut newer) = (0, 0);
    loop {
        let piece =
            tokio::time::timeout(FORWARD_TIMEOUT, pieces.message()).await.map_err(|_| ServiceError::PeerTimedOut {
                node: node.to_owned(),
                awaited: "piece of the group ledger",
                within: FORWARD_TIMEOUT,
            })?;
        let piece = piece.map_err(|status| ServiceError::Peer { node: node.to_owned(), status })?;
        let Some(piece) = piece else { break };
        let entries = cluster_wire::group_entries(piece)?;
        merged += entries.len();
        let merged_newer = context.privacy.merge_groups(entries).await?.len();
        metrics::counter!(names::GROUP_ENTRIES_MERGED, "via" => "catch_up").increment(merged_newer as u64);
        newer += merged_newer;
    }
    if newer > 0 {
        tracing::info!(node, merged, newer, "group catch-up: merged another node's ledger");
    }
    Ok(())
}

/// What a node answers to [`merge_ledger_of`]: the entries of the parts of
/// its ledger whose digest differs from the asker's, in pieces.
pub(crate) fn ledger_pieces(context: &Context, digests: &[u64]) -> Vec<pb::GroupEntries> {
    cluster_wire::group_entry_pieces(&context.privacy.group_entries_differing(digests), PIECE_BYTES)
}
