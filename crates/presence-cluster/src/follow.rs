//! Following a key prefix in etcd: loaded once, then kept current through a
//! watch from the revision after the load, so that every change is applied
//! in etcd's order and the view moves from one revision to a later one,
//! never back. A broken watch (etcd down, a compaction) is followed by a
//! fresh load, retried every second until etcd answers; meanwhile the view
//! stays as it was, which is what a node serves by while etcd is away.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::etcdserverpb::{RangeRequest, WatchCreateRequest, WatchRequest, watch_request};
use crate::api::mvccpb::{KeyValue, event::EventType};
use crate::etcd::prefix_end;
use crate::{Error, Etcd};

/// A view built from the keys under one prefix.
pub(crate) trait View: Clone + Send + Sync + 'static {
    /// The key `name` (the key less the prefix) now holds `kv`, or was deleted (`None`).
    fn apply(&mut self, name: &[u8], kv: Option<&KeyValue>);
    /// The etcd revision the view is as of.
    fn revision(&self) -> i64;
    fn set_revision(&mut self, revision: i64);
}

/// A [`View`] kept current by a background task until dropped.
#[derive(Debug)]
pub(crate) struct Followed<T> {
    view: watch::Receiver<Arc<T>>,
    follower: JoinHandle<()>,
}

impl<T: View> Followed<T> {
    /// Loads the keys under `prefix` into `empty`, then follows them.
    pub(crate) async fn start(etcd: &Etcd, prefix: String, empty: T) -> Result<Followed<T>, Error> {
        let loaded = load(etcd, &prefix, empty.clone()).await?;
        let (publish, view) = watch::channel(Arc::new(loaded));
        let follower = tokio::spawn(follow(etcd.clone(), prefix, empty, publish));
        Ok(Followed { view, follower })
    }

    pub(crate) fn current(&self) -> Arc<T> {
        Arc::clone(&self.view.borrow())
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<Arc<T>> {
        self.view.clone()
    }
}

impl<T> Drop for Followed<T> {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

/// The keys under `prefix` applied to `view`, as of one linearizable read.
pub(crate) async fn load<T: View>(etcd: &Etcd, prefix: &str, mut view: T) -> Result<T, Error> {
    let start = prefix.as_bytes().to_vec();
    let range = RangeRequest { range_end: prefix_end(&start), key: start, ..RangeRequest::default() };
    let answer = etcd.kv.clone().range(range).await.map_err(Error::refused("Range"))?.into_inner();
    for kv in &answer.kvs {
        view.apply(&kv.key[prefix.len()..], Some(kv));
    }
    view.set_revision(answer.header.map_or(0, |header| header.revision));
    Ok(view)
}

/// How soon a broken watch is loaded afresh, and again while etcd does not
/// answer: a node's view must catch up within a moment of etcd's return,
/// since a planned move may then give it slots.
const RELOAD_AFTER: Duration = Duration::from_millis(250);

async fn follow<T: View>(etcd: Etcd, prefix: String, empty: T, publish: watch::Sender<Arc<T>>) {
    loop {
        let from = publish.borrow().revision() + 1;
        let error = watch_from(&etcd, &prefix, from, &publish).await;
        tracing::warn!(%error, prefix, "a watch on etcd broke; loading afresh");
        // Whatever broke the watch, the view is loaded again before it is followed again.
        let mut failed = 0u64;
        loop {
            tokio::time::sleep(RELOAD_AFTER).await;
            match load(&etcd, &prefix, empty.clone()).await {
                Ok(view) => {
                    if view.revision() >= publish.borrow().revision() {
                        publish.send_replace(Arc::new(view));
                    }
                    if failed > 0 {
                        tracing::info!(prefix, failed, "loaded from etcd again");
                    }
                    break;
                }
                Err(error) if failed == 0 => {
                    tracing::warn!(%error, prefix, "could not load from etcd; keeping the last view, trying again");
                    failed += 1;
                }
                Err(_) => failed += 1,
            }
        }
    }
}

/// Applies the changes from revision `from` on, until the watch ends (with why).
async fn watch_from<T: View>(etcd: &Etcd, prefix: &str, from: i64, publish: &watch::Sender<Arc<T>>) -> Error {
    let key = prefix.as_bytes().to_vec();
    let create = WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(WatchCreateRequest {
            range_end: prefix_end(&key),
            key,
            start_revision: from,
            ..WatchCreateRequest::default()
        })),
    };
    // etcd answers the call's headers with its first message: the request goes first.
    let (requests, stream) = mpsc::channel(1);
    if requests.send(create).await.is_err() {
        return Error::StreamEnded("Watch");
    }
    let mut events = match etcd.watch.clone().watch(ReceiverStream::new(stream)).await {
        Ok(events) => events.into_inner(),
        Err(status) => return Error::Refused { rpc: "Watch", status },
    };
    loop {
        let answer = match events.message().await {
            Ok(Some(answer)) => answer,
            Ok(None) => return Error::StreamEnded("Watch"),
            Err(status) => return Error::Refused { rpc: "Watch", status },
        };
        if answer.canceled {
            // A compaction past `from`, or etcd cancelling: load afresh.
            return Error::StreamEnded("Watch");
        }
        if answer.events.is_empty() {
            continue;
        }
        let mut view = T::clone(&publish.borrow());
        for event in &answer.events {
            let Some(kv) = &event.kv else { continue };
            let name = &kv.key[prefix.len().min(kv.key.len())..];
            view.apply(name, (event.r#type != EventType::Delete as i32).then_some(kv));
            view.set_revision(view.revision().max(kv.mod_revision));
        }
        publish.send_replace(Arc::new(view));
    }
}
