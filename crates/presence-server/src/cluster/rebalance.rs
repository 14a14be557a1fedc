//! Rebalancing (C3, a node joining): the coordinator evens the slots out
//! between the live nodes by planned moves, with their state.
//!
//! Repairs (the coordinator in `presence-cluster`) only give out slots
//! without a live owner; a node that joins an existing cluster, or comes
//! back after a drain, owns nothing until slots are moved to it. So, every
//! [`CHECK_EVERY`] while this node is the coordinator and etcd answers it,
//! it plans one move ([`rebalancing_move`]: at most a few slots, from the
//! node owning the most to the one owning the fewest, only past a slack)
//! and asks the giver to make it (`Cluster/MoveSlots`, as `presenced
//! cluster move` does), then plans the next as soon as the map shows the
//! move. Nobody flips: a handover moves leases, versions and statuses.

use std::sync::Arc;
use std::time::Duration;

use crate::cluster::forward::{call_peer, with_credential};
use crate::error::ServiceError;
use crate::node::context::Context;
use presence_cluster::rebalancing_move;
use presence_proto::v1 as pb;

/// How often the coordinator looks for an uneven map.
const CHECK_EVERY: Duration = Duration::from_secs(1);

/// How long a move may take before the coordinator stops waiting for it.
const MOVE_TIMEOUT: Duration = Duration::from_secs(30);

/// How long the coordinator waits after a move failed before it plans again.
const AFTER_FAILURE: Duration = Duration::from_secs(5);

/// Evens the slots out while this node coordinates; until the server stops
/// (started only with `rebalance` on).
pub(crate) async fn rebalance(context: Arc<Context>, cluster: Arc<crate::cluster::ClusterNode>) {
    let membership = &cluster.membership;
    let mut ticks = tokio::time::interval(CHECK_EVERY);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = ticks.tick() => {}
            () = context.stopping.cancelled() => return,
        }
        while membership.is_coordinator() && membership.etcd_answers() && membership.acting_now() {
            let Some((from, to, slots)) = rebalancing_move(&membership.map(), &membership.nodes().ids()) else {
                break;
            };
            match move_at(&context, &cluster, &from, &to, &slots).await {
                Ok(epoch) => {
                    tracing::info!(from, to, slots = slots.len(), epoch, "rebalancing: slots moved");
                    // Plan the next on a map that shows this move.
                    let mut map = membership.map_changes();
                    while map.borrow_and_update().revision() < epoch {
                        tokio::select! {
                            changed = map.changed() => if changed.is_err() { return },
                            () = context.stopping.cancelled() => return,
                        }
                    }
                }
                Err(error) => {
                    tracing::warn!(from, to, slots = slots.len(), %error, "rebalancing: a move failed; planning again later");
                    tokio::select! {
                        () = tokio::time::sleep(AFTER_FAILURE) => {}
                        () = context.stopping.cancelled() => return,
                    }
                    break;
                }
            }
        }
    }
}

/// Has `from` hand `slots` over to `to`: here, or by asking `from`. Returns the new epoch.
async fn move_at(
    context: &Arc<Context>,
    cluster: &Arc<crate::cluster::ClusterNode>,
    from: &str,
    to: &str,
    slots: &[u32],
) -> Result<i64, ServiceError> {
    let membership = &cluster.membership;
    if from == membership.node() {
        return Ok(crate::cluster::handover::move_slots(context, cluster, slots, to, membership.peer_token())
            .await?
            .epoch);
    }
    let Some(address) = membership.nodes().address(from).map(str::to_owned) else {
        return Err(ServiceError::MoveRefused(format!("node {from} is not registered any more")));
    };
    let request = with_credential(
        pb::MoveSlotsRequest { slots: slots.to_vec(), to_node: to.to_owned() },
        membership.peer_token(),
    );
    let mut client = membership.cluster_client(&address)?;
    Ok(call_peer(from, MOVE_TIMEOUT, client.move_slots(request)).await?.epoch)
}
