//! The open Watch streams of one server, by `watch_id`, through which
//! `UpdateWatch` hands a stream's task a change of its users (E7). The
//! streams themselves are in `watch.rs`.

use std::hash::BuildHasher;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use presence_core::CompactString;
use tokio::sync::{mpsc, oneshot};

use crate::error::ServiceError;

/// `UpdateWatch` calls one stream may have waiting for its task; more wait to hand theirs over.
const PENDING_UPDATES: usize = 4;

/// A change of a Watch's users (E7), validated.
#[derive(Debug)]
pub(crate) struct WatchUpdate {
    pub(crate) add: Vec<CompactString>,
    pub(crate) remove: Vec<CompactString>,
}

/// The open Watch streams of one server, by `watch_id`, for `UpdateWatch`.
#[derive(Debug)]
pub(crate) struct Watches {
    open: Arc<DashMap<CompactString, WatchHandle>>,
    /// Differs from one process to the next, so a watch id names one stream of one run.
    run: u64,
    next: AtomicU64,
}

/// A change handed to a Watch's task, and where to answer it.
pub(crate) type UpdateRequest = (WatchUpdate, oneshot::Sender<Result<(), ServiceError>>);

#[derive(Debug)]
struct WatchHandle {
    /// The viewer the Watch belongs to (`None`: a service's, for no viewer).
    owner: Option<CompactString>,
    updates: mpsc::Sender<UpdateRequest>,
}

impl Default for Watches {
    fn default() -> Self {
        Watches {
            open: Arc::default(),
            run: std::collections::hash_map::RandomState::new().hash_one(0u8),
            next: AtomicU64::new(1),
        }
    }
}

impl Watches {
    /// Hands `update` to the Watch `watch_id` of `caller` and waits until it
    /// is applied. A watch of another caller is answered exactly as one that
    /// does not exist.
    pub(crate) async fn update(
        &self,
        watch_id: &str,
        caller: Option<&str>,
        update: WatchUpdate,
    ) -> Result<(), ServiceError> {
        let not_found = || ServiceError::WatchNotFound { watch_id: watch_id.into() };
        let updates = match self.open.get(watch_id) {
            Some(handle) if handle.owner.as_deref() == caller => handle.updates.clone(),
            _ => return Err(not_found()),
        };
        let (reply, applied) = oneshot::channel();
        updates.send((update, reply)).await.map_err(|_| not_found())?;
        applied.await.map_err(|_| not_found())?
    }

    /// Registers a Watch of `owner`: its entry, and where its changes arrive.
    pub(crate) fn register(&self, owner: Option<CompactString>) -> (WatchRegistration, mpsc::Receiver<UpdateRequest>) {
        let id = CompactString::from(format!("{:016x}{:x}", self.run, self.next.fetch_add(1, Ordering::Relaxed)));
        let (updates, received) = mpsc::channel(PENDING_UPDATES);
        self.open.insert(id.clone(), WatchHandle { owner, updates });
        (WatchRegistration { open: Arc::clone(&self.open), id }, received)
    }
}

/// A Watch's entry among the open ones; leaves when dropped.
pub(crate) struct WatchRegistration {
    open: Arc<DashMap<CompactString, WatchHandle>>,
    /// The `watch_id` `UpdateWatch` names it by.
    pub(crate) id: CompactString,
}

impl Drop for WatchRegistration {
    fn drop(&mut self) {
        self.open.remove(&self.id);
    }
}
