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
//!
//! Beside the deadline, a lease says whether etcd is answering it now
//! ([`NodeLease::answering`]): false from the first keep-alive left without
//! an answer for [`ANSWER_WAIT`] (or a stream that cannot be opened) until
//! the next answer. A node asks the others this when its own keep-alives go
//! unanswered, to tell etcd being down from being cut off from it (see the
//! server's `outage` module).

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

/// How long a keep-alive may go unanswered before etcd counts as not
/// answering (half a beat, if that is shorter): etcd answers one in
/// milliseconds, and the node must have asked the others about an outage
/// well before a lease of a few seconds lapses.
pub const ANSWER_WAIT: Duration = Duration::from_millis(500);

/// A node's etcd lease, kept alive by a background task until dropped.
#[derive(Debug)]
pub struct NodeLease {
    id: i64,
    ttl: Duration,
    state: watch::Receiver<LeaseState>,
    answering: watch::Receiver<bool>,
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
        let (answers, answering) = watch::channel(true);
        let keeper = tokio::spawn(keep_alive(etcd.clone(), granted.id, ttl, margin, publish, answers));
        Ok(NodeLease { id: granted.id, ttl, state, answering, keeper, etcd: etcd.clone() })
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

    /// Whether etcd answered the latest keep-alive in time (see the
    /// module's description), and its changes.
    pub fn answering(&self) -> watch::Receiver<bool> {
        self.answering.clone()
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
/// request's send time + the TTL granted − the margin, and says etcd is
/// answering; a keep-alive unanswered for [`ANSWER_WAIT`] says it is not.
async fn keep_alive(
    etcd: Etcd,
    id: i64,
    ttl: Duration,
    margin: Duration,
    publish: watch::Sender<LeaseState>,
    answering: watch::Sender<bool>,
) {
    let beat = (ttl / 3).max(Duration::from_millis(100));
    let wait = ANSWER_WAIT.min(beat / 2);
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
        let opened = tokio::time::timeout(wait, client.lease_keep_alive(ReceiverStream::new(stream))).await;
        let Ok(Ok(answers)) = opened else {
            answering.send_if_modified(|answering| std::mem::replace(answering, false));
            tracing::warn!(lease = id, "etcd keep-alive stream could not be opened; retrying");
            continue;
        };
        let mut answers = answers.into_inner();
        loop {
            match tokio::time::timeout(wait, answers.message()).await {
                Ok(Ok(Some(answer))) if answer.ttl > 0 => {
                    let granted = Duration::from_secs(answer.ttl as u64);
                    publish.send_replace(LeaseState::ValidUntil(deadline(sent, granted, margin)));
                    answering.send_if_modified(|answering| !std::mem::replace(answering, true));
                }
                Ok(Ok(Some(_))) => {
                    tracing::error!(lease = id, "etcd says the node's lease is gone: the node owns nothing now");
                    publish.send_replace(LeaseState::Lost);
                    answering.send_if_modified(|answering| !std::mem::replace(answering, true));
                    return;
                }
                Ok(Ok(None)) | Ok(Err(_)) | Err(_) => {
                    answering.send_if_modified(|answering| std::mem::replace(answering, false));
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
