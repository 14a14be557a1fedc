//! The slot map: which node owns each of the fixed slots, with the epoch of
//! that ownership, as etcd holds it.
//!
//! Keys, under the cluster's prefix (for instance `/presenced/prod/`):
//! - `nodes/<node id>`: the node's advertised address, bound to its
//!   [`NodeLease`](crate::NodeLease), so it goes when the node does;
//! - `slots/<slot>`: the owner's node id. The key's `mod_revision` is the
//!   ownership's **epoch**: etcd's revisions only grow, so every change of
//!   owner has a larger epoch than the one before, whoever makes it, and a
//!   change is made only by compare-and-swap on the epoch the changer saw
//!   ([`claim_slot`]), so two nodes can never both believe they were given a
//!   slot at the same epoch.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::api::etcdserverpb::{
    Compare, PutRequest, RangeRequest, RequestOp, TxnRequest, WatchCreateRequest, WatchRequest, compare, request_op,
    response_op, watch_request,
};
use crate::api::mvccpb::{KeyValue, event::EventType};
use crate::etcd::prefix_end;
use crate::{Error, Etcd};

/// Which of `slots` slots `id` (a user id, or a room id) falls in:
/// 32-bit FNV-1a over the id's UTF-8 bytes, modulo `slots`. Chosen because
/// every client can compute it in a few lines (the TypeScript client with
/// `Math.imul`); the tests pin it with fixed vectors that other
/// implementations must reproduce.
pub fn slot_of(id: &str, slots: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let hash = id.bytes().fold(OFFSET, |hash, byte| (hash ^ u32::from(byte)).wrapping_mul(PRIME));
    hash % slots.max(1)
}

/// A slot's owner and the epoch of its ownership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotOwner {
    /// The owning node's id.
    pub node: String,
    /// The `mod_revision` of the slot's key when it was given to `node`.
    pub epoch: i64,
}

/// Every slot's owner, as of one etcd revision.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SlotMap {
    owners: Vec<Option<SlotOwner>>,
    revision: i64,
}

impl SlotMap {
    fn empty(slots: u32) -> SlotMap {
        SlotMap { owners: vec![None; slots as usize], revision: 0 }
    }

    /// The number of slots.
    pub fn slots(&self) -> u32 {
        self.owners.len() as u32
    }

    /// `slot`'s owner, if it has one.
    pub fn owner(&self, slot: u32) -> Option<&SlotOwner> {
        self.owners.get(slot as usize).and_then(Option::as_ref)
    }

    /// The etcd revision this map is as of.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The slots `node` owns, ascending.
    pub fn owned_by<'a>(&'a self, node: &'a str) -> impl Iterator<Item = u32> + 'a {
        self.owners
            .iter()
            .enumerate()
            .filter(move |(_, owner)| owner.as_ref().is_some_and(|owner| owner.node == node))
            .map(|(slot, _)| slot as u32)
    }

    /// Applies one key's new state (`None`: deleted); keys that are not a
    /// slot of this map are left alone (and said so).
    fn apply(&mut self, prefix: &str, key: &[u8], owner: Option<SlotOwner>) {
        match parse_slot(prefix, key).filter(|&slot| slot < self.slots()) {
            Some(slot) => self.owners[slot as usize] = owner,
            None => {
                tracing::warn!(key = %String::from_utf8_lossy(key), "a key under the slot prefix that names no slot; ignored")
            }
        }
    }
}

fn slots_prefix(prefix: &str) -> String {
    format!("{prefix}slots/")
}

fn slot_key(prefix: &str, slot: u32) -> Vec<u8> {
    format!("{prefix}slots/{slot}").into_bytes()
}

fn parse_slot(prefix: &str, key: &[u8]) -> Option<u32> {
    let rest = key.strip_prefix(slots_prefix(prefix).as_bytes())?;
    std::str::from_utf8(rest).ok()?.parse().ok()
}

fn owner_of(kv: &KeyValue) -> Option<SlotOwner> {
    let node = String::from_utf8(kv.value.clone()).ok()?;
    Some(SlotOwner { node, epoch: kv.mod_revision })
}

/// Advertises `node` at `address` under `prefix`, for as long as `lease` lives.
pub async fn register_node(etcd: &Etcd, prefix: &str, node: &str, address: &str, lease: i64) -> Result<(), Error> {
    let put = PutRequest {
        key: format!("{prefix}nodes/{node}").into_bytes(),
        value: address.as_bytes().to_vec(),
        lease,
        prev_kv: false,
        ignore_value: false,
        ignore_lease: false,
    };
    etcd.kv.clone().put(put).await.map_err(Error::refused("Put"))?;
    Ok(())
}

/// What a [`claim_slot`] came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// The slot is the claimer's, from this epoch on.
    Won {
        /// The new ownership's epoch.
        epoch: i64,
    },
    /// The slot had changed since the epoch the claimer saw: nothing was written.
    Stale {
        /// Who owns it now (`None`: nobody).
        current: Option<SlotOwner>,
    },
}

/// Gives `slot` to `node` if its ownership is still at `seen_epoch` (0: the
/// slot has no owner), in one etcd transaction.
pub async fn claim_slot(etcd: &Etcd, prefix: &str, slot: u32, node: &str, seen_epoch: i64) -> Result<Claim, Error> {
    let key = slot_key(prefix, slot);
    let unchanged = Compare {
        result: compare::CompareResult::Equal as i32,
        target: compare::CompareTarget::Mod as i32,
        key: key.clone(),
        range_end: Vec::new(),
        target_union: Some(compare::TargetUnion::ModRevision(seen_epoch)),
    };
    let put = RequestOp {
        request: Some(request_op::Request::RequestPut(PutRequest {
            key: key.clone(),
            value: node.as_bytes().to_vec(),
            ..PutRequest::default()
        })),
    };
    let read =
        RequestOp { request: Some(request_op::Request::RequestRange(RangeRequest { key, ..RangeRequest::default() })) };
    let answer = etcd
        .kv
        .clone()
        .txn(TxnRequest { compare: vec![unchanged], success: vec![put], failure: vec![read] })
        .await
        .map_err(Error::refused("Txn"))?
        .into_inner();
    if answer.succeeded {
        // The put is the transaction's only write: its revision is the key's new mod_revision.
        let epoch = answer.header.map_or(0, |header| header.revision);
        return Ok(Claim::Won { epoch });
    }
    let current = answer.responses.into_iter().find_map(|op| match op.response {
        Some(response_op::Response::ResponseRange(range)) => range.kvs.first().and_then(owner_of),
        _ => None,
    });
    Ok(Claim::Stale { current })
}

/// The slot map, loaded from etcd and followed through a watch: each change
/// is applied in etcd's order, so the map moves from one revision to a later
/// one and never back. A broken watch (etcd down, a compaction) is followed
/// by a fresh load, retried every second until etcd answers; meanwhile the
/// map stays as it was, which is what a node serves by while etcd is away.
#[derive(Debug)]
pub struct SlotMapWatch {
    map: watch::Receiver<Arc<SlotMap>>,
    follower: JoinHandle<()>,
}

impl SlotMapWatch {
    /// Loads the map of `slots` slots under `prefix`, then follows it.
    pub async fn start(etcd: &Etcd, prefix: &str, slots: u32) -> Result<SlotMapWatch, Error> {
        let loaded = load(etcd, prefix, slots).await?;
        let (publish, map) = watch::channel(Arc::new(loaded));
        let follower = tokio::spawn(follow(etcd.clone(), prefix.to_owned(), slots, publish));
        Ok(SlotMapWatch { map, follower })
    }

    /// The map as last seen.
    pub fn current(&self) -> Arc<SlotMap> {
        Arc::clone(&self.map.borrow())
    }

    /// Changes of the map, to wait on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<SlotMap>> {
        self.map.clone()
    }
}

impl Drop for SlotMapWatch {
    fn drop(&mut self) {
        self.follower.abort();
    }
}

async fn load(etcd: &Etcd, prefix: &str, slots: u32) -> Result<SlotMap, Error> {
    let start = slots_prefix(prefix).into_bytes();
    let range = RangeRequest { range_end: prefix_end(&start), key: start, ..RangeRequest::default() };
    let answer = etcd.kv.clone().range(range).await.map_err(Error::refused("Range"))?.into_inner();
    let mut map = SlotMap::empty(slots);
    for kv in &answer.kvs {
        map.apply(prefix, &kv.key, owner_of(kv));
    }
    map.revision = answer.header.map_or(0, |header| header.revision);
    Ok(map)
}

const RELOAD_AFTER: Duration = Duration::from_secs(1);

async fn follow(etcd: Etcd, prefix: String, slots: u32, publish: watch::Sender<Arc<SlotMap>>) {
    loop {
        let from = publish.borrow().revision + 1;
        match watch_from(&etcd, &prefix, from, &publish).await {
            Ok(()) => {}
            Err(error) => tracing::warn!(%error, "the slot map's watch broke; reloading"),
        }
        // Whatever broke the watch, the map is loaded again before it is followed again.
        loop {
            tokio::time::sleep(RELOAD_AFTER).await;
            match load(&etcd, &prefix, slots).await {
                Ok(map) => {
                    if map.revision >= publish.borrow().revision {
                        publish.send_replace(Arc::new(map));
                    }
                    break;
                }
                Err(error) => tracing::warn!(%error, "the slot map could not be loaded; keeping the last one"),
            }
        }
    }
}

/// Applies the changes after revision `from - 1` until the watch ends.
async fn watch_from(etcd: &Etcd, prefix: &str, from: i64, publish: &watch::Sender<Arc<SlotMap>>) -> Result<(), Error> {
    let key = slots_prefix(prefix).into_bytes();
    let create = WatchRequest {
        request_union: Some(watch_request::RequestUnion::CreateRequest(WatchCreateRequest {
            range_end: prefix_end(&key),
            key,
            start_revision: from,
            ..WatchCreateRequest::default()
        })),
    };
    let (requests, stream) = mpsc::channel(1);
    requests.send(create).await.map_err(|_| Error::StreamEnded("Watch"))?;
    let mut events =
        etcd.watch.clone().watch(ReceiverStream::new(stream)).await.map_err(Error::refused("Watch"))?.into_inner();
    while let Some(answer) = events.message().await.map_err(Error::refused("Watch"))? {
        if answer.canceled {
            // A compaction past `from`, or etcd cancelling: load afresh.
            return Err(Error::StreamEnded("Watch"));
        }
        if answer.events.is_empty() {
            continue;
        }
        let mut map = SlotMap::clone(&publish.borrow());
        for event in &answer.events {
            let Some(kv) = &event.kv else { continue };
            let owner = if event.r#type == EventType::Delete as i32 { None } else { owner_of(kv) };
            map.apply(prefix, &kv.key, owner);
            map.revision = map.revision.max(kv.mod_revision);
        }
        publish.send_replace(Arc::new(map));
    }
    drop(requests);
    Err(Error::StreamEnded("Watch"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed vectors: any other implementation of the slot function (the
    /// TypeScript client's) must give the same slots.
    #[test]
    fn slots_are_fnv1a_of_the_id_modulo_the_slot_count() {
        // Computed with an independent implementation (Python) of 32-bit FNV-1a.
        let vectors = [("", 453), ("a", 300), ("alice", 999), ("user-42", 939), ("ユーザー", 766), ("room:doc-7", 330)];
        for (id, slot) in vectors {
            assert_eq!(slot_of(id, 1024), slot, "{id:?}");
        }
        assert_eq!(slot_of("alice", u32::MAX), 0x8722_13e7, "the whole hash, below u32::MAX");
        assert_eq!(slot_of("alice", 1), 0);
        assert_eq!(slot_of("alice", 0), 0, "no slots is taken as one, not a division by zero");
    }

    #[test]
    fn slots_spread_evenly() {
        let mut counts = vec![0u32; 1024];
        for i in 0..1_024_000 {
            counts[slot_of(&format!("user-{i}"), 1024) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*min > 800 && *max < 1200, "slot loads between {min} and {max} for 1,000 ids per slot on average");
    }

    #[test]
    fn slot_keys_parse_back_and_others_do_not() {
        let key = slot_key("/p/", 17);
        assert_eq!(key, b"/p/slots/17");
        assert_eq!(parse_slot("/p/", &key), Some(17));
        assert_eq!(parse_slot("/p/", b"/p/slots/x"), None);
        assert_eq!(parse_slot("/p/", b"/q/slots/1"), None);
    }
}
