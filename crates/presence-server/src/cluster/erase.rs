//! Export and erase across a cluster (P7): what nodes other than a user's
//! owner hold of it.
//!
//! A user's own data lives at its owner (`node/erase.rs`), but other nodes
//! hold two things about it: the audiences of their own users, which may
//! name it, and, on its slot's follower, a copy of it (C4). The owner asks
//! every other live node ([`held_elsewhere`], `Cluster/HeldElsewhere`) for
//! the users that granted it, and for an erase has them remove it first,
//! on disk, and drop their copy. There is no catch-up for this: a node that
//! does not answer makes the call fail with `UNAVAILABLE` naming it, after
//! everything else was done, and the caller calls again (an erase is
//! idempotent). A node that is down long enough to leave the cluster has
//! its slots taken over from copies the erase reached; one that comes back
//! later on its data directory takes its slots back by handovers, which
//! carry their owners' audiences. Group memberships are not asked here:
//! every node holds every one, and the owner's group leaves reach the
//! others through `group_sync.rs`, whose catch-up carries them to a node
//! that was away.

use presence_core::CompactString;
use presence_proto::v1 as pb;
use tokio::task::JoinSet;

use crate::cluster::ClusterNode;
use crate::cluster::forward::{FORWARD_TIMEOUT, call_peer, with_credential};
use crate::cluster::membership::Membership;
use crate::error::ServiceError;
use crate::node::context::Context;
use crate::node::erase;
use crate::node::wire;

/// The users of every other node whose audience `user_id` is in (with
/// `erase`: that it left), sorted, each once. `operation` names the call
/// a node that does not answer fails.
pub(crate) async fn held_elsewhere(
    membership: &Membership,
    operation: &'static str,
    user_id: &str,
    erase: bool,
) -> Result<Vec<String>, ServiceError> {
    let mut asked = JoinSet::new();
    for (node, address) in membership.others() {
        let client = membership.cluster_client(&address);
        let request =
            with_credential(pb::HeldElsewhereRequest { user_id: user_id.to_owned(), erase }, membership.peer_token());
        asked.spawn(async move {
            let answered = match client {
                Ok(mut client) => call_peer(&address, FORWARD_TIMEOUT, client.held_elsewhere(request)).await,
                Err(err) => Err(err),
            };
            (format!("{node} ({address})"), answered)
        });
    }
    let (mut granted_by, mut unreached, mut first_failure) = (Vec::new(), Vec::new(), None);
    while let Some(done) = asked.join_next().await {
        match done {
            Ok((_, Ok(answer))) => granted_by.extend(answer.granted_by),
            Ok((node, Err(err))) => {
                first_failure.get_or_insert_with(|| err.to_string());
                unreached.push(node);
            }
            Err(err) => {
                first_failure.get_or_insert_with(|| err.to_string());
                unreached.push("a node".to_owned());
            }
        }
    }
    if !unreached.is_empty() {
        unreached.sort();
        let done = if erase { "the user's own data is erased at its owner" } else { "nothing was changed" };
        let reason = format!("{done}; {}", first_failure.unwrap_or_default());
        return Err(ServiceError::NodesUnreached { operation, nodes: unreached, reason });
    }
    granted_by.sort_unstable();
    granted_by.dedup();
    Ok(granted_by)
}

/// What the called node answers to [`held_elsewhere`].
pub(crate) async fn answer(
    context: &Context,
    cluster: &ClusterNode,
    request: &pb::HeldElsewhereRequest,
) -> Result<pb::HeldElsewhereResponse, ServiceError> {
    let user: CompactString = wire::id("user_id", &request.user_id)?;
    let granted_by = erase::held_here(context, &user, request.erase).await?;
    if request.erase {
        cluster.replica.drop_user(context.now(), &user);
    }
    Ok(pb::HeldElsewhereResponse { granted_by: granted_by.iter().map(ToString::to_string).collect() })
}
