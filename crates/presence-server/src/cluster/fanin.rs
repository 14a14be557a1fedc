//! A Watch of users on several cluster nodes (C2): one stream, fed by this
//! node's own Watch of its users and a Watch of the other nodes' users read
//! from this node's relays (`relay.rs`), which carry each watched user once
//! per owner whatever the number of viewers, and apply each viewer's view
//! here with the owner's word (P1–P5). Each part keeps the rules of a Watch
//! (E2, E3, E4). The merged stream opens with one snapshot made of every
//! part's opening snapshot, then carries each part's updates as they come:
//! per user they come from one owner only, so each user's updates stay in
//! order and newer than what was sent before.
//!
//! An owner of an earlier version has no relay: its users are watched there
//! for the caller, with the caller's credentials, a stream per viewer.
//!
//! What a merged stream cannot carry faithfully ends it with `UNAVAILABLE`,
//! which clients answer by reopening (resuming with the versions they hold,
//! E8): a part that ends or fails, and a part's resync (its snapshot holds
//! only that part's users, and a viewer takes a later snapshot as the whole
//! watch). Its opening snapshot names no `watch_id`, so `UpdateWatch` does not
//! reach it (`NOT_FOUND`, on which the clients reopen with the new set).

use std::collections::BTreeMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use presence_core::CompactString;
use presence_proto::prepared::WatchFrame;
use presence_proto::v1::{self as pb, watch_event};
use tokio::sync::mpsc;
use tokio_stream::{Stream, StreamExt, StreamMap};
use tonic::Status;

use crate::cluster::ClusterNode;
use crate::cluster::forward::FORWARD_TIMEOUT;
use crate::cluster::membership::OwnershipChanges;
use crate::cluster::peers::PeerStream;
use crate::cluster::relay::{self, Relay};
use crate::error::ServiceError;
use crate::error::relayed;
use crate::node::context::Context;
use crate::node::rooms::RoomStream;
use crate::node::watch::{self, WatchOptions, WatchStream};

/// Items the gRPC layer has not yet sent; past them the parts wait, and
/// their owners' mailboxes conflate or resync as for any slow viewer (E4).
const STREAM_BUFFER: usize = 64;

/// One part's events.
type Part = Pin<Box<dyn Stream<Item = Result<WatchFrame, Status>> + Send>>;

/// What the merged Watch asks of the other owners.
pub(crate) struct Remote<'a> {
    /// The users of each other owner, by its advertised address.
    pub(crate) users: BTreeMap<String, Vec<CompactString>>,
    /// The request as the caller made it (its `viewer_id`, window and known versions).
    pub(crate) request: &'a pb::WatchRequest,
    /// The caller's credentials, passed on.
    pub(crate) authorization: Option<&'a tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
}

/// Opens the parts (this node's users `local`, and each remote owner's) and
/// merges them into one stream.
pub(crate) async fn open(
    context: Arc<Context>,
    cluster: &Arc<ClusterNode>,
    local: Vec<CompactString>,
    options: WatchOptions,
    remote: Remote<'_>,
) -> Result<WatchStream, ServiceError> {
    let mut parts: Vec<Part> = Vec::new();
    let relayed_options = WatchOptions {
        viewer: options.viewer.clone(),
        batch_window: options.batch_window,
        known_versions: options.known_versions.clone(),
    };
    if !local.is_empty() {
        let opened = watch::open(Arc::clone(&context), local.clone(), options).await?;
        let stream = guarded(Arc::clone(cluster), local, opened);
        parts.push(ending(stream, "this node"));
    }
    if remote.users.is_empty() {
        return merged(context, parts).await;
    }
    // Other nodes' users come through this node's relays, shared by every viewer here.
    let users: Vec<CompactString> = remote.users.values().flatten().cloned().collect();
    let source = Relay::source(cluster, &context);
    match watch::open_from(Arc::clone(&context), source, users, relayed_options).await {
        Ok(stream) => {
            parts.push(ending(stream, "this node's relay of other nodes' users"));
            return merged(context, parts).await;
        }
        Err(err) if relay::is_older_node(&err) => {
            tracing::debug!(%err, "a node of an earlier version relays no users: its users' watches are forwarded");
        }
        Err(err) => return Err(err),
    }
    for (address, users) in remote.users {
        let known_versions = users
            .iter()
            .filter_map(|user| remote.request.known_versions.get(user.as_str()).map(|v| (user.to_string(), *v)))
            .collect();
        let request = pb::WatchRequest {
            user_ids: users.iter().map(ToString::to_string).collect(),
            viewer_id: remote.request.viewer_id.clone(),
            batch_window_ms: remote.request.batch_window_ms,
            known_versions,
        };
        let stream = cluster.membership.forward_watch(&address, request, remote.authorization).await?;
        let label = format!("node at {address}");
        let stream = stream.map(move |event| event.map(WatchFrame::from).map_err(|status| relayed(&label, &status)));
        parts.push(ending(stream, &address));
    }
    merged(context, parts).await
}

/// One stream of `parts`, each opening with its snapshot.
async fn merged(context: Arc<Context>, mut parts: Vec<Part>) -> Result<WatchStream, ServiceError> {
    // Every part opens with its snapshot: together, the merged opening one.
    let mut opening = pb::Snapshot::default();
    for part in &mut parts {
        let first = tokio::time::timeout(FORWARD_TIMEOUT, part.next()).await;
        let first = first.map_err(|_| ServiceError::PeerTimedOut {
            node: "a watched owner".into(),
            awaited: "opening snapshot",
            within: FORWARD_TIMEOUT,
        })?;
        match first {
            Some(Ok(WatchFrame::Event(pb::WatchEvent { event: Some(watch_event::Event::Snapshot(snapshot)) }))) => {
                opening.partial |= snapshot.partial;
                opening.users.extend(snapshot.users);
            }
            Some(Err(status)) => return Err(ServiceError::Peer { node: "a watched owner".into(), status }),
            _ => {
                return Err(ServiceError::PeerUnusable {
                    node: "a watched owner".into(),
                    reason: "no opening snapshot".into(),
                });
            }
        }
    }
    let opening = pb::WatchEvent { event: Some(watch_event::Event::Snapshot(opening)) }.into();
    Ok(Box::pin(Merged {
        opening: Some(opening),
        parts: parts.into_iter().enumerate().collect(),
        stopping: Box::pin(context.stopping.clone().cancelled_owned()),
        ended: false,
    }))
}

/// A merged Watch: its opening snapshot, then each part's events as the
/// gRPC layer asks for them. Polled in place, with no task or channel of its
/// own between the parts and the viewer: one hop less for every event.
struct Merged {
    opening: Option<WatchFrame>,
    parts: StreamMap<usize, Part>,
    stopping: Pin<Box<tokio_util::sync::WaitForCancellationFutureOwned>>,
    ended: bool,
}

impl Merged {
    fn end(&mut self, status: Status) -> Poll<Option<Result<WatchFrame, Status>>> {
        self.ended = true;
        Poll::Ready(Some(Err(status)))
    }
}

impl Stream for Merged {
    type Item = Result<WatchFrame, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        if let Some(opening) = this.opening.take() {
            return Poll::Ready(Some(Ok(opening)));
        }
        if this.stopping.as_mut().poll(cx).is_ready() {
            return this.end(ServiceError::ShuttingDown.into());
        }
        match std::task::ready!(Pin::new(&mut this.parts).poll_next(cx)) {
            Some((_, Ok(WatchFrame::Event(pb::WatchEvent { event: Some(watch_event::Event::Snapshot(_)) })))) => {
                let resynced = "a watched owner resynced its part of this watch; reopen to resync it all";
                this.end(ServiceError::Reopen(resynced.into()).into())
            }
            Some((_, Ok(event))) => Poll::Ready(Some(Ok(event))),
            Some((_, Err(status))) => this.end(status),
            None => this.end(ServiceError::Reopen("every part of this watch ended; reopen".into()).into()),
        }
    }
}

/// `stream` of a Watch of `users` on a cluster node, ended `UNAVAILABLE` as
/// soon as this node may no longer act for one of them (its slot moved, or
/// the node's lease lapsed), so that the viewer reopens at the new owner
/// instead of missing its changes.
pub(crate) fn guarded(cluster: Arc<ClusterNode>, users: Vec<CompactString>, stream: WatchStream) -> WatchStream {
    let changes = cluster.membership.changes();
    Box::pin(Guarded { stream, changed: changed(changes), cluster, users, ended: false })
}

/// The changes of ownership, once they changed.
fn changed(mut changes: OwnershipChanges) -> Pin<Box<dyn Future<Output = OwnershipChanges> + Send>> {
    Box::pin(async move {
        changes.changed().await;
        changes
    })
}

/// See [`guarded`]: polled in place, as [`Merged`] is.
struct Guarded {
    stream: WatchStream,
    changed: Pin<Box<dyn Future<Output = OwnershipChanges> + Send>>,
    cluster: Arc<ClusterNode>,
    users: Vec<CompactString>,
    ended: bool,
}

impl Stream for Guarded {
    type Item = Result<WatchFrame, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        let this = &mut *self;
        if this.ended {
            return Poll::Ready(None);
        }
        while let Poll::Ready(changes) = this.changed.as_mut().poll(cx) {
            // Checked apart: the view's gate is never held across an await.
            let refused = this.cluster.membership.view().check_all(&this.users).err();
            if let Some(refusal) = refused {
                this.ended = true;
                let moved = format!("this node no longer acts for every watched user ({refusal}); reopen");
                return Poll::Ready(Some(Err(ServiceError::Reopen(moved).into())));
            }
            this.changed = changed(changes);
        }
        this.stream.as_mut().poll_next(cx)
    }
}

/// `stream`, then an `UNAVAILABLE` naming `whose` part ended: the merged
/// stream cannot carry on without it.
fn ending(stream: impl Stream<Item = Result<WatchFrame, Status>> + Send + 'static, whose: &str) -> Part {
    let ended = ServiceError::Reopen(format!("the part of this watch at {whose} ended; reopen")).into();
    Box::pin(stream.chain(tokio_stream::once(Err(ended))))
}

/// A WatchRoom opened at the room's owner at `owner`, relayed to the caller
/// as it comes (C1). It ends as the owner's stream ends: with the owner's
/// status when the owner ended it; `UNAVAILABLE` naming the owner when the
/// connection broke or the stream stopped without one (the owner died or
/// stopped: the caller opens it again, at the room's next owner).
pub(crate) fn relay(context: Arc<Context>, owner: String, mut upstream: PeerStream<pb::RoomEvent>) -> RoomStream {
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    tokio::spawn(async move {
        let _watcher = crate::metrics::OpenGauge::open(&context.metrics().room_watchers);
        let ended = loop {
            let event = tokio::select! {
                event = upstream.message() => event,
                () = tx.closed() => return,
                () = context.stopping.cancelled() => break ServiceError::ShuttingDown.into(),
            };
            match event {
                Ok(Some(event)) => {
                    if tx.send(Ok(event)).await.is_err() {
                        return;
                    }
                }
                Ok(None) => {
                    break ServiceError::Reopen(format!("the room's owner at {owner} ended the watch; reopen")).into();
                }
                Err(status) if matches!(status.code(), tonic::Code::Unknown | tonic::Code::Cancelled) => {
                    let stopped =
                        format!("the room's owner at {owner} stopped answering ({}); reopen", status.message());
                    break ServiceError::Reopen(stopped).into();
                }
                Err(status) => break relayed(&owner, &status),
            }
        };
        let _ = tx.send(Err(ended)).await;
    });
    RoomStream::new(rx)
}
