//! The slot map: which node owns each of the fixed slots, with the epoch of
//! that ownership, as etcd holds it.
//!
//! Keys, under the cluster's prefix (for instance `/presenced/prod/`):
//! - `nodes/<node id>`: the node's advertised address, bound to its
//!   [`NodeLease`](crate::NodeLease), so it goes when the node does;
//! - `addresses/<node id>`: the same address, bound to no lease, so that a
//!   coordinator can reach a node whose registration is gone (C6);
//! - `slots/<slot>`: the owner's node id. The key's `mod_revision` is the
//!   ownership's **epoch**: etcd's revisions only grow, so every change of
//!   owner has a larger epoch than the one before, whoever makes it, and a
//!   change is made only by compare-and-swap on the epoch the changer saw
//!   ([`claim_slot`]), so two nodes can never both believe they were given a
//!   slot at the same epoch.

use std::sync::Arc;

use tokio::sync::watch;

use crate::api::etcdserverpb::{
    Compare, PutRequest, RangeRequest, RequestOp, TxnRequest, compare, request_op, response_op,
};
use crate::api::mvccpb::KeyValue;
use crate::follow::{Followed, View};
use crate::{Error, Etcd};

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

    /// The map as etcd holds it now (one linearizable read).
    pub async fn load(etcd: &Etcd, prefix: &str, slots: u32) -> Result<SlotMap, Error> {
        crate::follow::load(etcd, &slots_prefix(prefix), SlotMap::empty(slots)).await
    }

    /// The epoch of the latest ownership in the map: a view of the map whose
    /// [`SlotMap::revision`] is at least this has seen every change in it.
    pub fn latest_epoch(&self) -> i64 {
        self.owners.iter().flatten().map(|owner| owner.epoch).max().unwrap_or(0)
    }

    /// Every node that owns a slot, ascending, each once.
    pub fn owners(&self) -> std::collections::BTreeSet<&str> {
        self.owners.iter().flatten().map(|owner| owner.node.as_str()).collect()
    }

    /// The slots `node` owns, ascending.
    pub fn owned_by<'a>(&'a self, node: &'a str) -> impl Iterator<Item = u32> + 'a {
        self.owners
            .iter()
            .enumerate()
            .filter(move |(_, owner)| owner.as_ref().is_some_and(|owner| owner.node == node))
            .map(|(slot, _)| slot as u32)
    }
}

fn slots_prefix(prefix: &str) -> String {
    format!("{prefix}slots/")
}

fn slot_key(prefix: &str, slot: u32) -> Vec<u8> {
    format!("{prefix}slots/{slot}").into_bytes()
}

fn owner_of(kv: &KeyValue) -> Option<SlotOwner> {
    let node = String::from_utf8(kv.value.clone()).ok()?;
    Some(SlotOwner { node, epoch: kv.mod_revision })
}

/// Advertises `node` at `address` under `prefix`, for as long as `lease`
/// lives; returns the etcd revision of the registration.
pub async fn register_node(etcd: &Etcd, prefix: &str, node: &str, address: &str, lease: i64) -> Result<i64, Error> {
    // The address again, bound to no lease: a coordinator that never saw
    // this node registered finds it there when it must ask the node to stop
    // acting before giving its slots away (C6).
    let lasting =
        PutRequest { key: address_key(prefix, node), value: address.as_bytes().to_vec(), ..Default::default() };
    etcd.kv.clone().put(lasting).await.map_err(Error::refused("Put"))?;
    let put = PutRequest {
        key: node_key(prefix, node),
        value: address.as_bytes().to_vec(),
        lease,
        prev_kv: false,
        ignore_value: false,
        ignore_lease: false,
    };
    let answer = etcd.kv.clone().put(put).await.map_err(Error::refused("Put"))?.into_inner();
    Ok(answer.header.map_or(0, |header| header.revision))
}

fn node_key(prefix: &str, node: &str) -> Vec<u8> {
    format!("{prefix}nodes/{node}").into_bytes()
}

fn address_key(prefix: &str, node: &str) -> Vec<u8> {
    format!("{prefix}addresses/{node}").into_bytes()
}

/// The address `node` last registered with, kept after its registration is
/// gone; `None` for a node that never registered.
pub async fn last_address(etcd: &Etcd, prefix: &str, node: &str) -> Result<Option<String>, Error> {
    let kept = etcd.get(&address_key(prefix, node)).await?;
    Ok(kept.map(|kv| String::from_utf8_lossy(&kv.value).into_owned()))
}

/// The compare that holds while `node` has no registration: a claim of a
/// dead owner's slot is made only while its owner is still gone, so that an
/// owner that registers again (its lease was lost, etcd was away) finds in
/// the map every claim of its slots made before, and none is made after.
fn not_registered(prefix: &str, node: &str) -> Compare {
    Compare {
        result: compare::CompareResult::Equal as i32,
        target: compare::CompareTarget::Version as i32,
        key: node_key(prefix, node),
        range_end: Vec::new(),
        target_union: Some(compare::TargetUnion::Version(0)),
    }
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
    match claim(etcd, prefix, slot, node, seen_epoch, None, None).await? {
        FencedClaim::Claimed(claim) => Ok(claim),
        FencedClaim::Fenced => unreachable!("a claim without a fence is never fenced off"),
    }
}

/// A key that must still exist with this `create_revision` for a write to be
/// made: the coordinator's leadership, so that a coordinator that lost it
/// (its lease expired, another node was elected) writes nothing more.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Fence {
    pub(crate) key: Vec<u8>,
    pub(crate) create_revision: i64,
}

impl Fence {
    /// Whether the key still exists as it was created: the leadership it
    /// stands for is still this node's.
    pub(crate) async fn holds(&self, etcd: &Etcd) -> Result<bool, Error> {
        Ok(etcd.get(&self.key).await?.is_some_and(|kv| kv.create_revision == self.create_revision))
    }
}

/// What a fenced claim came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum FencedClaim {
    Claimed(Claim),
    /// The fence's key is gone or was made again: nothing was written.
    Fenced,
}

/// [`claim_slot`], written only while `fence` holds and, for a slot whose
/// owner is gone, while `gone_owner` has no registration.
pub(crate) async fn claim_fenced(
    etcd: &Etcd,
    prefix: &str,
    slot: u32,
    node: &str,
    seen_epoch: i64,
    fence: &Fence,
    gone_owner: Option<&str>,
) -> Result<FencedClaim, Error> {
    claim(etcd, prefix, slot, node, seen_epoch, Some(fence), gone_owner).await
}

/// Gives each of `claims` (slot, new owner, epoch seen) in one etcd
/// transaction, fenced by `fence` and made only while none of `gone_owners`
/// (the slots' owners that are gone) has registered again: all of them, at
/// one new revision (each slot's new epoch), or none. `None` when some slot
/// had changed, an owner is back or the fence no longer holds; the caller
/// then claims one by one to learn which.
/// etcd takes at most 128 operations in a transaction (`--max-txn-ops`):
/// callers send at most [`CLAIMS_PER_TXN`].
pub(crate) async fn claim_all_fenced(
    etcd: &Etcd,
    prefix: &str,
    claims: &[(u32, String, i64)],
    fence: &Fence,
    gone_owners: &[&str],
) -> Result<Option<i64>, Error> {
    claim_all(etcd, prefix, claims, Some(fence), gone_owners).await
}

/// Gives `slots` (each with the epoch its owner saw) to `node` in one etcd
/// transaction: all of them, at one new revision (their new epoch), or none
/// (`None`: some slot changed since). The last step of a planned move
/// (C3), taken by the node handing the slots over once `node` holds their
/// state; at most [`MOVES_PER_TXN`] slots at once.
pub async fn move_slots(etcd: &Etcd, prefix: &str, slots: &[(u32, i64)], node: &str) -> Result<Option<i64>, Error> {
    let claims: Vec<_> = slots.iter().map(|&(slot, seen)| (slot, node.to_owned(), seen)).collect();
    claim_all(etcd, prefix, &claims, None, &[]).await
}

/// The most slots [`move_slots`] moves in one transaction.
pub const MOVES_PER_TXN: usize = CLAIMS_PER_TXN;

async fn claim_all(
    etcd: &Etcd,
    prefix: &str,
    claims: &[(u32, String, i64)],
    fence: Option<&Fence>,
    gone_owners: &[&str],
) -> Result<Option<i64>, Error> {
    let mut compare: Vec<Compare> = fence
        .map(|fence| Compare {
            result: compare::CompareResult::Equal as i32,
            target: compare::CompareTarget::Create as i32,
            key: fence.key.clone(),
            range_end: Vec::new(),
            target_union: Some(compare::TargetUnion::CreateRevision(fence.create_revision)),
        })
        .into_iter()
        .chain(gone_owners.iter().map(|owner| not_registered(prefix, owner)))
        .collect();
    let mut success = Vec::with_capacity(claims.len());
    for (slot, node, seen_epoch) in claims {
        let key = slot_key(prefix, *slot);
        compare.push(Compare {
            result: compare::CompareResult::Equal as i32,
            target: compare::CompareTarget::Mod as i32,
            key: key.clone(),
            range_end: Vec::new(),
            target_union: Some(compare::TargetUnion::ModRevision(*seen_epoch)),
        });
        success.push(RequestOp {
            request: Some(request_op::Request::RequestPut(PutRequest {
                key,
                value: node.as_bytes().to_vec(),
                ..PutRequest::default()
            })),
        });
    }
    let answer = etcd
        .kv
        .clone()
        .txn(TxnRequest { compare, success, failure: Vec::new() })
        .await
        .map_err(Error::refused("Txn"))?
        .into_inner();
    // The puts are the transaction's writes: its revision is every key's new mod_revision.
    Ok(answer.succeeded.then(|| answer.header.map_or(0, |header| header.revision)))
}

/// The most claims [`claim_all_fenced`] sends at once: under etcd's default
/// limit of 128 operations per transaction, with the fence's compare and
/// those of the owners gone (a handful).
pub(crate) const CLAIMS_PER_TXN: usize = 100;

async fn claim(
    etcd: &Etcd,
    prefix: &str,
    slot: u32,
    node: &str,
    seen_epoch: i64,
    fence: Option<&Fence>,
    gone_owner: Option<&str>,
) -> Result<FencedClaim, Error> {
    let key = slot_key(prefix, slot);
    let fenced = fence.map(|fence| Compare {
        result: compare::CompareResult::Equal as i32,
        target: compare::CompareTarget::Create as i32,
        key: fence.key.clone(),
        range_end: Vec::new(),
        target_union: Some(compare::TargetUnion::CreateRevision(fence.create_revision)),
    });
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
    let read = |key: Vec<u8>| RequestOp {
        request: Some(request_op::Request::RequestRange(RangeRequest { key, ..RangeRequest::default() })),
    };
    let mut failure = vec![read(key)];
    failure.extend(fence.map(|fence| read(fence.key.clone())));
    let compare =
        [unchanged].into_iter().chain(fenced).chain(gone_owner.map(|owner| not_registered(prefix, owner))).collect();
    let answer = etcd
        .kv
        .clone()
        .txn(TxnRequest { compare, success: vec![put], failure })
        .await
        .map_err(Error::refused("Txn"))?
        .into_inner();
    if answer.succeeded {
        // The put is the transaction's only write: its revision is the key's new mod_revision.
        let epoch = answer.header.map_or(0, |header| header.revision);
        return Ok(FencedClaim::Claimed(Claim::Won { epoch }));
    }
    // The failure branch read the slot, then the fence's key.
    let mut read_back = answer.responses.into_iter().map(|op| match op.response {
        Some(response_op::Response::ResponseRange(range)) => range.kvs.into_iter().next(),
        _ => None,
    });
    let current = read_back.next().flatten();
    if let Some(fence) = fence {
        let held = read_back.next().flatten().is_some_and(|kv| kv.create_revision == fence.create_revision);
        if !held {
            return Ok(FencedClaim::Fenced);
        }
    }
    Ok(FencedClaim::Claimed(Claim::Stale { current: current.as_ref().and_then(owner_of) }))
}

/// The claims that give every slot a live owner. A slot whose owner is not
/// among `live` goes to its follower ([`follower_of`]): the node that holds
/// a copy of its users (C4). A slot that never had an owner (a new cluster)
/// goes to the live node owning the fewest slots at that point (ties to the
/// first in `live`'s order). Slots of live owners stay where they are:
/// moving them is a planned move's business, not repair's. Returns (slot,
/// new owner, epoch seen).
pub fn repairs(map: &SlotMap, live: &[String]) -> Vec<(u32, String, i64)> {
    if live.is_empty() {
        return Vec::new();
    }
    let mut load: Vec<usize> = live.iter().map(|node| map.owned_by(node).count()).collect();
    let mut claims = Vec::new();
    for slot in 0..map.slots() {
        let owner = map.owner(slot);
        let index = match owner {
            Some(owner) if live.contains(&owner.node) => continue,
            Some(owner) => {
                let follower = follower_of(slot, &owner.node, live).expect("a node other than the dead owner");
                live.iter().position(|node| node == follower).expect("the follower is live")
            }
            None => load.iter().enumerate().min_by_key(|&(index, count)| (*count, index)).expect("live is not empty").0,
        };
        load[index] += 1;
        claims.push((slot, live[index].clone(), owner.map_or(0, |owner| owner.epoch)));
    }
    claims
}

/// The most slots one rebalancing move hands over. A move copies its slots
/// while they are served and freezes them only for their last changes (C7),
/// so its size is how much CPU it takes at once, not how long a slot is
/// refused: 64 slots (a quarter of a node's share of 1,024 in four nodes)
/// bring a node that comes back its share in four moves instead of sixteen.
pub const REBALANCE_SLOTS_PER_MOVE: usize = 64;

/// Each of `live` nodes' even share of `slots` slots, and the slack below
/// it that rebalancing leaves alone (1/20 of the share, at least one slot):
/// a node owning `share - slack` or more holds its share.
pub fn even_share(slots: u32, live: usize) -> (usize, usize) {
    let share = slots as usize / live.max(1);
    (share, (share / 20).max(1))
}

/// One planned move that evens the slots out between live nodes (C3, a node
/// joining): `(from, to, slots)`, the slots the highest of `from`'s. `None`
/// when the map needs repairs first (a slot without a live owner), or when
/// every live node owns at least its even share less a slack of 1/20 of it
/// (at least one slot), so that nodes are not kept busy over a slot or two.
/// The move goes from the node owning the most to the one owning the
/// fewest, at most [`REBALANCE_SLOTS_PER_MOVE`] slots, and never so many
/// that the receiver ends above the even share or the giver below it.
pub fn rebalancing_move(map: &SlotMap, live: &[String]) -> Option<(String, String, Vec<u32>)> {
    if live.len() < 2 || (0..map.slots()).any(|slot| map.owner(slot).is_none_or(|owner| !live.contains(&owner.node))) {
        return None;
    }
    let (share, slack) = even_share(map.slots(), live.len());
    let loads: Vec<(usize, &String)> = live.iter().map(|node| (map.owned_by(node).count(), node)).collect();
    let &(fewest, to) = loads.iter().min_by_key(|(count, node)| (*count, *node))?;
    let &(most, from) = loads.iter().max_by_key(|(count, node)| (*count, std::cmp::Reverse(*node)))?;
    if fewest + slack >= share || most <= share {
        return None;
    }
    let count = (share - fewest).min(most - share).min(REBALANCE_SLOTS_PER_MOVE);
    let mut slots: Vec<u32> = map.owned_by(from).collect();
    let slots = slots.split_off(slots.len() - count);
    Some((from.clone(), to.clone(), slots))
}

/// The node that follows `slot` while `owner` owns it (C4): of the nodes in
/// `nodes` other than `owner`, the one whose hash with the slot is highest
/// (rendezvous hashing). Every node computes it alike from the slot map and
/// the node set; a dead owner's slot goes to it, since the owner's absence
/// from `nodes` changes nothing for the others; and a node joining or
/// leaving changes the followers of about its share of slots only.
pub fn follower_of<'a>(slot: u32, owner: &str, nodes: &'a [String]) -> Option<&'a str> {
    nodes
        .iter()
        .filter(|node| node.as_str() != owner)
        .max_by_key(|node| (rendezvous_weight(slot, node), node.as_str()))
        .map(String::as_str)
}

/// FNV-1a-64 of the slot's bytes and the node's id, mixed (splitmix64's
/// finaliser) so that nearby slots spread.
fn rendezvous_weight(slot: u32, node: &str) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for byte in slot.to_le_bytes().iter().chain(node.as_bytes()) {
        hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash ^= hash >> 30;
    hash = hash.wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash ^= hash >> 27;
    hash = hash.wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// The slot map, loaded from etcd and followed through a watch (see
/// `follow.rs`): kept while etcd is away, caught up when it returns.
#[derive(Debug)]
pub struct SlotMapWatch(Followed<SlotMap>);

impl SlotMapWatch {
    /// Loads the map of `slots` slots under `prefix`, then follows it.
    pub async fn start(etcd: &Etcd, prefix: &str, slots: u32) -> Result<SlotMapWatch, Error> {
        Ok(SlotMapWatch(Followed::start(etcd, slots_prefix(prefix), SlotMap::empty(slots)).await?))
    }

    /// The map as last seen.
    pub fn current(&self) -> Arc<SlotMap> {
        self.0.current()
    }

    /// Changes of the map, to wait on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<SlotMap>> {
        self.0.subscribe()
    }
}

impl View for SlotMap {
    fn apply(&mut self, name: &[u8], kv: Option<&KeyValue>) {
        let slot = std::str::from_utf8(name)
            .ok()
            .and_then(|name| name.parse::<u32>().ok())
            .filter(|&slot| slot < self.slots());
        match slot {
            Some(slot) => self.owners[slot as usize] = kv.and_then(owner_of),
            None => {
                tracing::warn!(key = %String::from_utf8_lossy(name), "a key under the slot prefix that names no slot; ignored")
            }
        }
    }

    fn revision(&self) -> i64 {
        self.revision
    }

    fn set_revision(&mut self, revision: i64) {
        self.revision = revision;
    }
}

/// The nodes registered under a prefix: id → advertised address.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct NodeSet {
    nodes: std::collections::BTreeMap<String, String>,
    /// The etcd revision each registration was made at.
    registered_at: std::collections::BTreeMap<String, i64>,
    revision: i64,
}

impl NodeSet {
    /// The etcd revision `node`'s registration was made at, if it is registered.
    pub fn registered_at(&self, node: &str) -> Option<i64> {
        self.registered_at.get(node).copied()
    }

    /// The etcd revision this view is as of.
    pub fn revision(&self) -> i64 {
        self.revision
    }

    /// The live nodes' ids, ascending.
    pub fn ids(&self) -> Vec<String> {
        self.nodes.keys().cloned().collect()
    }

    /// Where `node` is reached, if it is registered.
    pub fn address(&self, node: &str) -> Option<&str> {
        self.nodes.get(node).map(String::as_str)
    }
}

impl View for NodeSet {
    fn apply(&mut self, name: &[u8], kv: Option<&KeyValue>) {
        let Ok(node) = std::str::from_utf8(name) else { return };
        match kv.and_then(|kv| String::from_utf8(kv.value.clone()).ok().map(|address| (address, kv.create_revision))) {
            Some((address, created)) => {
                self.registered_at.insert(node.to_owned(), created);
                self.nodes.insert(node.to_owned(), address)
            }
            None => {
                self.registered_at.remove(node);
                self.nodes.remove(node)
            }
        };
    }

    fn revision(&self) -> i64 {
        self.revision
    }

    fn set_revision(&mut self, revision: i64) {
        self.revision = revision;
    }
}

/// The registered nodes, followed as [`SlotMapWatch`] follows the slots.
#[derive(Debug)]
pub struct NodeSetWatch(Followed<NodeSet>);

impl NodeSetWatch {
    /// Loads the nodes registered under `prefix`, then follows them.
    pub async fn start(etcd: &Etcd, prefix: &str) -> Result<NodeSetWatch, Error> {
        Ok(NodeSetWatch(Followed::start(etcd, format!("{prefix}nodes/"), NodeSet::default()).await?))
    }

    /// The nodes as last seen.
    pub fn current(&self) -> Arc<NodeSet> {
        self.0.current()
    }

    /// Changes of the set, to wait on.
    pub fn subscribe(&self) -> watch::Receiver<Arc<NodeSet>> {
        self.0.subscribe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_keys_name_their_slot_and_others_change_nothing() {
        assert_eq!(slot_key("/p/", 17), b"/p/slots/17");
        let owned = |node: &str, epoch| KeyValue {
            value: node.as_bytes().to_vec(),
            mod_revision: epoch,
            ..KeyValue::default()
        };
        let mut map = SlotMap::empty(32);
        map.apply(b"17", Some(&owned("a", 5)));
        map.apply(b"x", Some(&owned("b", 6)));
        map.apply(b"32", Some(&owned("b", 7)));
        assert_eq!(map.owner(17), Some(&SlotOwner { node: "a".into(), epoch: 5 }));
        assert_eq!(map.owned_by("b").count(), 0, "no slot named x, and 32 is past the last");
        map.apply(b"17", None);
        assert_eq!(map.owner(17), None);
    }

    fn map_of(owners: &[Option<(&str, i64)>]) -> SlotMap {
        let owners =
            owners.iter().map(|owner| owner.map(|(node, epoch)| SlotOwner { node: node.into(), epoch })).collect();
        SlotMap { owners, revision: 0 }
    }

    #[test]
    fn repairs_give_every_slot_a_live_owner_evenly_and_leave_live_owners_alone() {
        let live = |nodes: &[&str]| nodes.iter().map(|node| (*node).to_owned()).collect::<Vec<_>>();
        // From nothing: an even spread, every claim from epoch 0.
        let claims = repairs(&SlotMap::empty(64), &live(&["a", "b", "c"]));
        assert_eq!(claims.len(), 64);
        assert!(claims.iter().all(|(_, _, seen)| *seen == 0));
        let count = |node: &str| claims.iter().filter(|(_, owner, _)| owner == node).count();
        assert_eq!((count("a"), count("b"), count("c")), (22, 21, 21));
        // A dead owner's slots go to their followers, from the epoch they
        // were at; a slot never owned to the least loaded; the live keep theirs.
        let map =
            map_of(&[Some(("a", 3)), Some(("b", 4)), Some(("dead", 9)), Some(("dead", 10)), None, Some(("a", 5))]);
        let nodes = live(&["a", "b"]);
        let follower = |slot| follower_of(slot, "dead", &nodes).unwrap().to_owned();
        let load = |node: &str| [2, 3].iter().filter(|&&slot| follower(slot) == node).count();
        let least_loaded = if 2 + load("a") <= 1 + load("b") { "a" } else { "b" };
        assert_eq!(
            repairs(&map, &nodes),
            vec![(2, follower(2), 9), (3, follower(3), 10), (4, least_loaded.to_owned(), 0)]
        );
        assert!(repairs(&map, &[]).is_empty(), "no live node: nothing to give slots to");
    }

    #[test]
    fn c3_rebalancing_moves_a_few_slots_at_a_time_from_the_fullest_node_to_the_emptiest_until_even() {
        let nodes = |ids: &[&str]| ids.iter().map(|node| (*node).to_owned()).collect::<Vec<_>>();
        // Two nodes share 64 slots; a third joins with none.
        let mut owners: Vec<Option<(&str, i64)>> = (0..64).map(|slot| Some((["a", "b"][slot % 2], 1))).collect();
        let live = nodes(&["a", "b", "c"]);
        let mut moves = 0;
        while let Some((from, to, slots)) = rebalancing_move(&map_of(&owners), &live) {
            assert_eq!(to, "c", "the node with none receives");
            assert!(!slots.is_empty() && slots.len() <= REBALANCE_SLOTS_PER_MOVE, "{slots:?}");
            for slot in slots {
                assert_eq!(owners[slot as usize].map(|(owner, _)| owner), Some(from.as_str()), "a slot of the giver's");
                owners[slot as usize] = Some(("c", 2));
            }
            moves += 1;
            assert!(moves < 10, "converges");
        }
        let map = map_of(&owners);
        let mut counts: Vec<usize> = ["a", "b", "c"].iter().map(|node| map.owned_by(node).count()).collect();
        counts.sort_unstable();
        assert_eq!(counts, vec![21, 21, 22], "even, to the slot");
        // Within the slack nothing moves; nor before repairs, nor with one node.
        let mut uneven = owners.clone();
        uneven[0] = Some(("c", 3));
        assert_eq!(rebalancing_move(&map_of(&uneven), &live), None, "one slot off is within the slack");
        let mut dead = owners.clone();
        dead[5] = Some(("gone", 1));
        let lopsided = map_of(&(0..64).map(|_| Some(("a", 1))).collect::<Vec<_>>());
        assert!(rebalancing_move(&lopsided, &live).is_some());
        dead.iter_mut().take(40).for_each(|owner| *owner = Some(("a", 1)));
        dead[50] = Some(("gone", 1));
        assert_eq!(rebalancing_move(&map_of(&dead), &live), None, "repairs come first");
        assert_eq!(rebalancing_move(&lopsided, &nodes(&["a"])), None, "a lone node keeps everything");
    }

    #[test]
    fn c4_a_slots_follower_is_another_node_the_same_for_everyone_and_spread_evenly() {
        let nodes: Vec<String> = ["n1", "n2", "n3", "n4"].iter().map(|node| (*node).to_owned()).collect();
        let mut counts = std::collections::BTreeMap::<&str, usize>::new();
        for slot in 0..1024 {
            let follower = follower_of(slot, "n1", &nodes).expect("three others");
            assert_ne!(follower, "n1", "an owner never follows itself");
            // The owner's death changes no slot's follower.
            assert_eq!(follower_of(slot, "n1", &nodes[1..]), Some(follower), "slot {slot}");
            *counts.entry(follower).or_default() += 1;
        }
        assert_eq!(counts.len(), 3);
        assert!(counts.values().all(|&count| (300..=383).contains(&count)), "about a third each: {counts:?}");
        // A fifth node takes over as follower of about its share of slots only.
        let more: Vec<String> = nodes.iter().cloned().chain(["n5".to_owned()]).collect();
        let changed =
            (0..1024).filter(|&slot| follower_of(slot, "n1", &nodes) != follower_of(slot, "n1", &more)).count();
        assert!((180..=330).contains(&changed), "about a quarter: {changed}");
        assert_eq!(follower_of(0, "n1", &nodes[..1]), None, "a lone node has no follower");
    }

    #[cfg(feature = "testing")]
    #[tokio::test]
    async fn c4_a_gone_owners_slot_is_claimed_only_while_the_owner_is_still_gone() {
        let server = crate::testing::EtcdServer::start().await;
        let etcd = server.client().await;
        let Claim::Won { epoch } = claim_slot(&etcd, "/gone/", 0, "a", 0).await.unwrap() else { panic!() };
        // A coordinator's leadership key, as the fence.
        let put = PutRequest { key: b"/gone/coordinator/1".to_vec(), ..PutRequest::default() };
        etcd.kv.clone().put(put).await.unwrap();
        let leader = etcd.get(b"/gone/coordinator/1").await.unwrap().unwrap();
        let fence = Fence { key: leader.key, create_revision: leader.create_revision };
        // "a" registers again before the coordinator's claims land: they fail, and the slot stays a's.
        let lease =
            crate::NodeLease::grant(&etcd, std::time::Duration::from_secs(5), std::time::Duration::ZERO).await.unwrap();
        register_node(&etcd, "/gone/", "a", "127.0.0.1:1", lease.id()).await.unwrap();
        let one = claim_fenced(&etcd, "/gone/", 0, "b", epoch, &fence, Some("a")).await.unwrap();
        let kept = SlotOwner { node: "a".to_owned(), epoch };
        assert_eq!(one, FencedClaim::Claimed(Claim::Stale { current: Some(kept) }));
        let claims = [(0, "b".to_owned(), epoch)];
        assert_eq!(claim_all_fenced(&etcd, "/gone/", &claims, &fence, &["a"]).await.unwrap(), None);
        // Gone again: the claim is made.
        lease.revoke().await.unwrap();
        let Some(moved) = claim_all_fenced(&etcd, "/gone/", &claims, &fence, &["a"]).await.unwrap() else {
            panic!("a gone owner's slot is claimed")
        };
        assert!(moved > epoch);
    }
}
