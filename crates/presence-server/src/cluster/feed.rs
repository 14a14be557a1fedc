//! The change feed across a cluster (F3): one `Changes` stream at any node,
//! merged from every live node's part.
//!
//! Each node records the changes of the slots it owns in its own feed
//! (`node/feed/`); a planned move hands a slot's entries to its next
//! owner, which raises its feed above the positions the old owner gave
//! (`handover.rs`), and a takeover from a copy records a gap of the slot
//! (`replica.rs`). So every slot's entries, wherever they are, are in
//! position order, and a cursor `(position, slot)` orders the whole
//! cluster's feed.
//!
//! The node a consumer calls opens every live node's part (`NodeChanges`,
//! its own locally) from the consumer's cursor, and sends an entry on only
//! once every part has passed it: each part sends its entries in cursor
//! order and says how far it got (`progress`) every 50 ms, so the least of
//! the parts' cursors (the watermark) is a point before which no part will
//! send anything more. Entries come out in cursor order, each once (two
//! nodes may both hold an entry handed over: the second is dropped by its
//! cursor).
//!
//! When a node leaves the live set (it stopped after handing its slots
//! over, or died and its slots were taken over), its part is dropped and
//! every other part is opened again from the merged cursor: entries it
//! handed over before it went are read again from their new holders, and
//! what it took with it is a gap its slots' new owners recorded. A part
//! that fails is opened again with backoff; meanwhile the stream waits for
//! it (it may hold the next entry), as it does for a node that joins.

use std::collections::{BTreeMap, VecDeque};
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use presence_feed::Cursor;
use presence_proto::v1 as pb;
use presence_proto::v1::change_event;
use tokio::sync::mpsc;
use tokio::time::Instant;
use tokio_stream::{Stream, StreamExt, StreamMap};
use tokio_util::sync::CancellationToken;
use tonic::{Code, Status};

use crate::cluster::ClusterNode;
use crate::cluster::forward::with_credential;
use crate::error::{ServiceError, feed_out_of_range_oldest};
use crate::node::context::Context;
use crate::node::feed::wire::{self, ChangesFilter, ChangesFrom};
use crate::node::feed::{ChangesStream, Feed, PROGRESS_EVERY};

/// Entries held for one part ahead of the watermark before the merge stops
/// reading it (the slowest part holds the others back).
const PART_BUFFER: usize = 16_384;
/// Most events sent to the consumer in one batch.
const BATCH: usize = 1_024;
/// The first wait before a failed part is opened again; doubled to
/// [`RETRY_MAX`].
const RETRY_FIRST: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// One node's part of the feed, as its stream of events.
type PartStream = Pin<Box<dyn Stream<Item = Result<pb::ChangeEvent, Status>> + Send>>;

/// Serves another node's request for this node's part (`NodeChanges`).
pub(crate) fn node_part(context: &Context, request: &pb::ChangesRequest) -> Result<ChangesStream, ServiceError> {
    let feed = context.feed.as_ref().ok_or(ServiceError::NoFeed)?;
    let (from, filter) = wire::changes_request(request, feed.slots())?;
    feed.node_part(from, filter, context.stopping.clone())
}

/// Opens a consumer's `Changes` at this cluster node: every node's part,
/// merged (see the module).
pub(crate) fn merged(
    context: &Arc<Context>,
    cluster: &Arc<ClusterNode>,
    feed: &Arc<Feed>,
    request: &pb::ChangesRequest,
) -> Result<ChangesStream, ServiceError> {
    let (from, filter) = wire::changes_request(request, feed.slots())?;
    // The cluster's cursor "now" is this node's: every other node's clock
    // is close to it, and its part waits for a cursor ahead of it.
    let (merged, from_oldest) = match from {
        ChangesFrom::Now => (feed.cursor_now(), false),
        ChangesFrom::Cursor(cursor) => (cursor, false),
        ChangesFrom::Oldest => (Cursor::START, true),
    };
    let (sender, receiver) = mpsc::channel(1);
    let merge = Merge {
        context: Arc::clone(context),
        cluster: Arc::clone(cluster),
        feed: Arc::clone(feed),
        request: pb::ChangesRequest { from: 0, cursor: Vec::new(), ..request.clone() },
        filter,
        from_oldest,
        merged,
        parts: BTreeMap::new(),
        streams: StreamMap::new(),
        paused: BTreeMap::new(),
        sender,
    };
    tokio::spawn(merge.run(context.stopping.clone()));
    Ok(ChangesStream::of(receiver))
}

/// Where one node's part stands.
#[derive(Debug)]
struct Part {
    /// Where to reach it (empty: this node).
    address: String,
    /// It will send nothing at or before this.
    watermark: Cursor,
    /// What it sent after the merged cursor, in cursor order.
    buffer: VecDeque<(Cursor, pb::ChangeEvent)>,
    /// When to open it again, while it is not open.
    retry_at: Option<Instant>,
    /// The wait before the next retry.
    backoff: Duration,
}

/// One consumer's merged stream: every live node's part, and where the
/// merge stands.
struct Merge {
    context: Arc<Context>,
    cluster: Arc<ClusterNode>,
    feed: Arc<Feed>,
    /// The consumer's request, less where it starts.
    request: pb::ChangesRequest,
    filter: ChangesFilter,
    /// The consumer asked for the oldest entries, and none has come yet.
    from_oldest: bool,
    /// Everything at or before it was sent (or is not for this consumer).
    merged: Cursor,
    parts: BTreeMap<String, Part>,
    streams: StreamMap<String, PartStream>,
    /// Parts not read until their buffer drains.
    paused: BTreeMap<String, PartStream>,
    sender: mpsc::Sender<Result<Vec<pb::ChangeEvent>, ServiceError>>,
}

impl Merge {
    async fn run(mut self, stopping: CancellationToken) {
        let mut nodes = self.cluster.membership.node_changes();
        if let Err(error) = self.reconcile().await {
            let _ = self.sender.send(Err(error)).await;
            return;
        }
        let mut reported = self.merged;
        let mut last_sent = Instant::now();
        loop {
            let batch = self.take_ready();
            if !batch.is_empty() {
                reported = self.merged;
                last_sent = Instant::now();
                if self.sender.send(Ok(batch)).await.is_err() {
                    return;
                }
                continue;
            }
            if self.merged > reported && last_sent.elapsed() >= PROGRESS_EVERY {
                reported = self.merged;
                last_sent = Instant::now();
                if self.sender.send(Ok(vec![wire::progress_event(self.merged)])).await.is_err() {
                    return;
                }
            }
            self.resume_paused();
            let retry_at = self.parts.values().filter_map(|part| part.retry_at).min();
            let progress_at = (self.merged > reported).then(|| last_sent + PROGRESS_EVERY);
            let wake_at = [retry_at, progress_at].into_iter().flatten().min();
            let step = tokio::select! {
                item = self.streams.next(), if !self.streams.is_empty() => match item {
                    Some((node, item)) => self.take(node, item),
                    None => Ok(()),
                },
                changed = nodes.changed() => match changed {
                    Ok(()) => self.reconcile().await,
                    Err(_) => return,
                },
                () = sleep_until(wake_at) => self.retry_due().await,
                () = self.sender.closed() => return,
                () = stopping.cancelled() => return,
            };
            if let Err(error) = step {
                let _ = self.sender.send(Err(error)).await;
                return;
            }
        }
    }

    /// The live nodes, by id, with their addresses (empty: this node).
    fn live(&self) -> BTreeMap<String, String> {
        let membership = &self.cluster.membership;
        let mut live: BTreeMap<String, String> = membership.others().into_iter().collect();
        live.insert(membership.node().to_owned(), String::new());
        live
    }

    /// Opens a part for each live node that has none, and drops the parts
    /// of nodes that are gone and whose stream failed or ended, opening
    /// every other part again from the merged cursor (see the module). A
    /// node missing from the live set whose part still streams keeps it: it
    /// may be joining again after etcd let its lease go, still serving.
    async fn reconcile(&mut self) -> Result<(), ServiceError> {
        let live = self.live();
        let gone: Vec<String> = self
            .parts
            .keys()
            .filter(|node| {
                !live.contains_key(*node) && !self.streams.contains_key(*node) && !self.paused.contains_key(*node)
            })
            .cloned()
            .collect();
        for node in &gone {
            tracing::debug!(node, "a node is gone: its part of the change feed is dropped, the others reopened");
            self.parts.remove(node);
        }
        let reopen: Vec<String> = if gone.is_empty() {
            live.keys().filter(|node| !self.parts.contains_key(*node)).cloned().collect()
        } else {
            self.parts
                .keys()
                .cloned()
                .chain(live.keys().cloned())
                .collect::<std::collections::BTreeSet<_>>()
                .into_iter()
                .collect()
        };
        for node in reopen {
            let address = live
                .get(&node)
                .cloned()
                .or_else(|| self.parts.get(&node).map(|part| part.address.clone()))
                .unwrap_or_default();
            self.parts.insert(
                node.clone(),
                Part { address, watermark: self.merged, buffer: VecDeque::new(), retry_at: None, backoff: RETRY_FIRST },
            );
            self.open(&node).await?;
        }
        Ok(())
    }

    /// Opens `node`'s part from the merged cursor; a failure to reach it is
    /// retried later, a refusal ends the merged stream.
    async fn open(&mut self, node: &str) -> Result<(), ServiceError> {
        self.streams.remove(node);
        self.paused.remove(node);
        let Some(part) = self.parts.get_mut(node) else { return Ok(()) };
        part.buffer.clear();
        part.watermark = self.merged;
        // Until an entry has come, a consumer from the oldest asks each part for its oldest.
        let from = if self.from_oldest { ChangesFrom::Oldest } else { ChangesFrom::Cursor(self.merged) };
        let mut request = self.request.clone();
        (request.from, request.cursor) = wire::changes_from_fields(from);
        let opened: Result<PartStream, Status> = if part.address.is_empty() {
            Ok(Box::pin(self.feed.node_part(from, self.filter.clone(), self.context.stopping.clone())?))
        } else {
            let membership = &self.cluster.membership;
            match membership.cluster_client(&part.address) {
                Ok(mut client) => {
                    let call = client.node_changes(with_credential(request, membership.peer_token()));
                    match tokio::time::timeout(crate::cluster::forward::FORWARD_TIMEOUT, call).await {
                        Ok(Ok(response)) => Ok(Box::pin(response.into_inner())),
                        Ok(Err(status)) => Err(status),
                        Err(_) => Err(Status::deadline_exceeded("no answer to NodeChanges")),
                    }
                }
                Err(error) => Err(Status::unavailable(error.to_string())),
            }
        };
        match opened {
            Ok(stream) => {
                part.retry_at = None;
                // A part that ends says so: the merge opens it again, or drops it if its node is gone.
                let ended = tokio_stream::once(Err(Status::unavailable("the node ended its part of the feed")));
                self.streams.insert(node.to_owned(), Box::pin(stream.chain(ended)));
                Ok(())
            }
            Err(status) => self.failed(node.to_owned(), status),
        }
    }

    /// A part's stream ended with `status`: a refusal the consumer must
    /// hear ends the merged stream; anything else is retried.
    fn failed(&mut self, node: String, status: Status) -> Result<(), ServiceError> {
        if let Some(oldest) = feed_out_of_range_oldest(&status) {
            let why = "older than the oldest change a node of the cluster retains";
            return Err(ServiceError::FeedOutOfRange { oldest, why });
        }
        // Refusals that another try would meet again: a node with its feed
        // off, a credential it does not take, a node that does not serve parts.
        if matches!(
            status.code(),
            Code::InvalidArgument
                | Code::FailedPrecondition
                | Code::Unauthenticated
                | Code::PermissionDenied
                | Code::Unimplemented
        ) {
            let part = self.parts.get(&node).map(|part| part.address.clone());
            let address = part.filter(|address| !address.is_empty()).unwrap_or(node);
            return Err(ServiceError::Peer { node: address, status });
        }
        self.streams.remove(&node);
        self.paused.remove(&node);
        if let Some(part) = self.parts.get_mut(&node) {
            tracing::debug!(node, %status, "a node's part of the change feed failed; opened again after a wait");
            part.retry_at = Some(Instant::now() + part.backoff);
            part.backoff = (part.backoff * 2).min(RETRY_MAX);
        }
        Ok(())
    }

    /// Drops the parts of nodes that are gone, then opens again the parts
    /// whose wait is over.
    async fn retry_due(&mut self) -> Result<(), ServiceError> {
        self.reconcile().await?;
        let now = Instant::now();
        let due: Vec<String> = self
            .parts
            .iter()
            .filter(|(_, part)| part.retry_at.is_some_and(|at| at <= now))
            .map(|(node, _)| node.clone())
            .collect();
        for node in due {
            self.open(&node).await?;
        }
        Ok(())
    }

    /// Takes what a part sent.
    fn take(&mut self, node: String, item: Result<pb::ChangeEvent, Status>) -> Result<(), ServiceError> {
        let event = match item {
            Ok(event) => event,
            Err(status) => return self.failed(node, status),
        };
        let cursor = Cursor::decode(&event.cursor)
            .map_err(|err| ServiceError::PeerUnusable { node: node.clone(), reason: err.to_string() })?;
        let merged = self.merged;
        let Some(part) = self.parts.get_mut(&node) else { return Ok(()) };
        part.backoff = RETRY_FIRST;
        part.watermark = part.watermark.max(cursor);
        if !matches!(event.event, Some(change_event::Event::Progress(_))) && cursor > merged {
            part.buffer.push_back((cursor, event));
            if part.buffer.len() >= PART_BUFFER
                && let Some(stream) = self.streams.remove(&node)
            {
                self.paused.insert(node, stream);
            }
        }
        Ok(())
    }

    /// Reads again the parts whose buffer drained to half.
    fn resume_paused(&mut self) {
        let ready: Vec<String> = self
            .paused
            .keys()
            .filter(|node| self.parts.get(*node).is_none_or(|part| part.buffer.len() < PART_BUFFER / 2))
            .cloned()
            .collect();
        for node in ready {
            if let Some(stream) = self.paused.remove(&node) {
                self.streams.insert(node, stream);
            }
        }
    }

    /// The buffered events no part can come before any more, in cursor
    /// order, each once; moves the merged cursor past them (and to the
    /// watermark once nothing before it is left).
    fn take_ready(&mut self) -> Vec<pb::ChangeEvent> {
        let Some(watermark) = self.parts.values().map(|part| part.watermark).min() else { return Vec::new() };
        let mut batch = Vec::new();
        while batch.len() < BATCH {
            let next = self
                .parts
                .values_mut()
                .filter(|part| part.buffer.front().is_some_and(|(cursor, _)| *cursor <= watermark))
                .min_by_key(|part| part.buffer.front().map(|(cursor, _)| *cursor));
            let Some(part) = next else { break };
            let Some((cursor, event)) = part.buffer.pop_front() else { break };
            if cursor > self.merged {
                self.merged = cursor;
                self.from_oldest = false;
                batch.push(event);
            }
        }
        if batch.len() < BATCH && watermark > self.merged {
            self.merged = watermark;
            self.from_oldest = false;
        }
        batch
    }
}

async fn sleep_until(at: Option<Instant>) {
    match at {
        Some(at) => tokio::time::sleep_until(at).await,
        None => std::future::pending().await,
    }
}
