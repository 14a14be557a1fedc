//! A node's etcd lease: granted once, kept alive, and the deadline until which
//! the node may act on what it owns.
//!
//! etcd expires a lease by its own clock, TTL after the last keep-alive it
//! received. The node cannot know when that was, only when it *sent* the
//! keep-alive that etcd answered: etcd received it no earlier. So the lease
//! holds at least until that send time plus the TTL etcd granted in the
//! answer, and the node stops acting a margin before then (clock rates
//! differ, and acting takes time). Nothing else extends it: a keep-alive that
//! is not answered, because etcd is down, slow or partitioned away, moves the
//! deadline nowhere, and the node lapses on its own.

use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::etcdserverpb::{LeaseGrantRequest, LeaseKeepAliveRequest, LeaseRevokeRequest};
use crate::{Error, Etcd};

/// Where a [`NodeLease`] stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// etcd answered a keep-alive recently enough: the node may act until this instant.
    ValidUntil(Instant),
    /// etcd answered that the lease is gone (it expired, or was revoked): the
    /// node must register anew, and owns nothing.
    Lost,
}

/// A node's etcd lease, kept alive by a background task until dropped.
#[derive(Debug)]
pub struct NodeLease {
    id: i64,
    ttl: Duration,
    state: watch::Receiver<LeaseState>,
    keeper: JoinHandle<()>,
    etcd: Etcd,
}

impl NodeLease {
    /// Grants a lease of `ttl` (whole seconds, at least one) and starts
    /// keeping it alive every third of it. `margin` is taken off every
    /// deadline [`NodeLease::state`] reports.
    pub async fn grant(etcd: &Etcd, ttl: Duration, margin: Duration) -> Result<NodeLease, Error> {
        let seconds = ttl.as_secs().max(1);
        let sent = Instant::now();
        let granted = etcd
            .lease
            .clone()
            .lease_grant(LeaseGrantRequest { ttl: seconds as i64, id: 0 })
            .await
            .map_err(Error::refused("LeaseGrant"))?
            .into_inner();
        let ttl = Duration::from_secs(granted.ttl.max(1) as u64);
        let (publish, state) = watch::channel(LeaseState::ValidUntil(deadline(sent, ttl, margin)));
        let keeper = tokio::spawn(keep_alive(etcd.clone(), granted.id, ttl, margin, publish));
        Ok(NodeLease { id: granted.id, ttl, state, keeper, etcd: etcd.clone() })
    }

    /// The lease's id in etcd, to bind keys to.
    pub fn id(&self) -> i64 {
        self.id
    }

    /// The TTL etcd granted.
    pub fn ttl(&self) -> Duration {
        self.ttl
    }

    /// Where the lease stands now.
    pub fn state(&self) -> LeaseState {
        *self.state.borrow()
    }

    /// Whether the node may act at `now`: the lease is not lost and its deadline has not passed.
    pub fn is_valid_at(&self, now: Instant) -> bool {
        matches!(self.state(), LeaseState::ValidUntil(until) if now < until)
    }

    /// Changes of [`NodeLease::state`], to wait on.
    pub fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.clone()
    }

    /// Stops keeping the lease alive and revokes it, so that the keys bound
    /// to it go at once (a planned stop) rather than a TTL later.
    pub async fn revoke(self) -> Result<(), Error> {
        self.keeper.abort();
        self.etcd
            .lease
            .clone()
            .lease_revoke(LeaseRevokeRequest { id: self.id })
            .await
            .map_err(Error::refused("LeaseRevoke"))?;
        Ok(())
    }
}

impl Drop for NodeLease {
    /// Keep-alives stop; etcd lets the lease expire a TTL later.
    fn drop(&mut self) {
        self.keeper.abort();
    }
}

fn deadline(sent: Instant, ttl: Duration, margin: Duration) -> Instant {
    sent + ttl.saturating_sub(margin)
}

/// Sends a keep-alive every third of the TTL on one stream, reopened after a
/// failure at the next beat; every answer moves the deadline to its
/// request's send time + the TTL granted − the margin.
async fn keep_alive(etcd: Etcd, id: i64, ttl: Duration, margin: Duration, publish: watch::Sender<LeaseState>) {
    let beat = (ttl / 3).max(Duration::from_millis(100));
    let mut next = Instant::now() + beat;
    loop {
        tokio::time::sleep_until(next).await;
        next = Instant::now() + beat;
        let (requests, stream) = mpsc::channel(1);
        // etcd sends the stream's headers with its first answer, and opening
        // the call waits for them: the first keep-alive goes before the call.
        let mut sent = Instant::now();
        if requests.send(LeaseKeepAliveRequest { id }).await.is_err() {
            continue;
        }
        let mut client = etcd.lease.clone();
        let opened = tokio::time::timeout(beat, client.lease_keep_alive(ReceiverStream::new(stream))).await;
        let Ok(Ok(answers)) = opened else {
            tracing::warn!(lease = id, "etcd keep-alive stream could not be opened; retrying");
            continue;
        };
        let mut answers = answers.into_inner();
        loop {
            match tokio::time::timeout(beat, answers.message()).await {
                Ok(Ok(Some(answer))) if answer.ttl > 0 => {
                    let granted = Duration::from_secs(answer.ttl as u64);
                    publish.send_replace(LeaseState::ValidUntil(deadline(sent, granted, margin)));
                }
                Ok(Ok(Some(_))) => {
                    tracing::error!(lease = id, "etcd says the node's lease is gone: the node owns nothing now");
                    publish.send_replace(LeaseState::Lost);
                    return;
                }
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                    tracing::warn!(lease = id, "etcd keep-alive unanswered; reopening the stream");
                    break;
                }
            }
            tokio::time::sleep_until(sent + beat).await;
            sent = Instant::now();
            if requests.send(LeaseKeepAliveRequest { id }).await.is_err() {
                break;
            }
        }
    }
}
