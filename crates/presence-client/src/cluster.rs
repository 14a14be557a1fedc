//! Lease batches routed over a cluster's nodes (C2).
//!
//! In a cluster every user belongs to one of a fixed number of slots
//! (`slot = FNV-1a-32(user id) mod slots`), and one node at a time owns each
//! slot. A node that does not own an item's user refuses it with
//! `UNAVAILABLE` and a `presence.v1.NotOwner` naming the slot, the epoch of
//! the ownership it knows and the owner's address. [`ClusterLeases`] learns
//! the slot map from those refusals: it sends each item to the node it last
//! learned owns the item's slot (at first, to the node it was given), splits
//! a batch by node, and sends refused items again to the owner named, a few
//! hops at most. A refusal that names no owner (the slot has none that may act
//! right now: it is moving, or a node is being replaced) is retried after a
//! short backoff, again and again for up to [`MOVE_WAIT`]: a move is waited
//! out by time, not by a count of tries.
//!
//! Of two routes for one slot it keeps the one of the higher epoch: etcd's
//! revisions only grow, so a node that still believes in an older ownership
//! cannot send it back. Such a refusal, from the node the newer epoch names,
//! means that node has not yet seen its ownership in etcd (its watch is a
//! moment behind, as just after etcd came back): retried after the backoff.
//!
//! Given etcd ([`ClusterLeases::follow_etcd`]), it also keeps the routes
//! current by watching the slot map and the node registrations there, as the
//! nodes do: an item then goes straight to its owner, even the first one, and
//! after a move or a takeover the new owner is known as soon as etcd says so.
//! Refusals are still followed (the watch may be a moment behind, or etcd
//! away): a route is only ever replaced by one of a higher or equal epoch,
//! whichever of the two told it first.
//!
//! A node that cannot be reached (it stopped, it died) is forgotten: its
//! users' items go to the node given (or, if that is the one gone, to another
//! node learned), which names their new owner. Items that never reached it
//! are all sent there; of a batch it may have applied before its stream
//! broke, only the renewals, which are the same applied once or twice.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use presence_cluster::{NodeSet, NodeSetWatch, SlotMap, SlotMapWatch};
use presence_core::slot_of;
use presence_proto::v1::{self as pb, lease_item, lease_result};
use tonic::{Code, Status};

use crate::error::ClientError;
use crate::lease_channel::{LeaseChannel, LeaseChannelConfig, lease_item_calls, lease_result};

/// How many times one item is sent on to an owner a refusal named before
/// its last refusal is its result.
const MAX_HOPS: usize = 5;

/// How long items whose slot has no owner that may act are sent again, a
/// backoff apart, before their last refusal is their result: longer than a
/// planned move or a takeover keeps a slot without one (C7, C4), well
/// within a session's TTL.
const MOVE_WAIT: Duration = Duration::from_secs(3);

/// The first wait before an item whose slot has no owner is sent again; it
/// doubles per try, up to [`MAX_NO_OWNER_BACKOFF`].
const NO_OWNER_BACKOFF: Duration = Duration::from_millis(25);
const MAX_NO_OWNER_BACKOFF: Duration = Duration::from_millis(200);

/// How long a node that could not be reached is not routed to, whatever
/// refusals name it: until etcd's lease of a dead node expires, the other
/// nodes still name it as its slots' owner, and every item sent there would
/// wait out its stream's reconnect backoff instead of being refused at once.
/// An ownership given to it after it was found unreachable (a higher epoch
/// than any known then) ends this at once: etcd gives slots only to a live,
/// registered node, so it is back (a node restarted in a rolling upgrade
/// is given its share again within moments, D1).
const UNREACHABLE_FOR: Duration = Duration::from_secs(1);

/// A node that could not be reached: until when it is not routed to, and
/// the highest epoch known when it was found so.
#[derive(Debug, Clone, Copy)]
struct Shunned {
    until: std::time::Instant,
    epoch: i64,
}

impl Shunned {
    /// Whether an ownership of `epoch` naming the node still goes elsewhere at `now`.
    fn holds_against(&self, epoch: i64, now: std::time::Instant) -> bool {
        now < self.until && epoch <= self.epoch
    }
}

/// A slot's owner, as the highest-epoch refusal about it named it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Route {
    epoch: i64,
    address: String,
}

/// Lease batches to a cluster, each item sent to its user's owner. Cheap to clone.
#[derive(Debug, Clone)]
pub struct ClusterLeases {
    shared: Arc<Shared>,
}

#[derive(Debug)]
struct Shared {
    /// Where items go whose slot's owner is not known yet: the node given,
    /// or, once it could not be reached, another node learned.
    seed: Mutex<String>,
    /// `http://` or `https://`, as the seed was given: owners are advertised as host:port.
    scheme: &'static str,
    slots: u32,
    config: LeaseChannelConfig,
    routes: Mutex<Vec<Option<Route>>>,
    channels: Mutex<HashMap<String, LeaseChannel>>,
    /// Nodes that could not be reached, until when they are not routed to.
    unreachable: Mutex<HashMap<String, Shunned>>,
    /// How long refusals naming no owner are sent again ([`MOVE_WAIT`] unless set).
    move_wait: Duration,
}

impl ClusterLeases {
    /// Routes over the cluster of `slots` slots (the nodes' `--slots`) that
    /// the node at `seed` (`http://host:port`) belongs to. No connection is
    /// made until the first batch.
    pub fn new(seed: &str, slots: u32, config: LeaseChannelConfig) -> Result<Self, ClientError> {
        let scheme = if seed.starts_with("https://") { "https://" } else { "http://" };
        let channel = LeaseChannel::connect_lazy(seed, config.clone())?;
        let shared = Shared {
            seed: Mutex::new(seed.to_owned()),
            scheme,
            slots: slots.max(1),
            config,
            routes: Mutex::new(vec![None; slots.max(1) as usize]),
            channels: Mutex::new(HashMap::from([(seed.to_owned(), channel)])),
            unreachable: Mutex::new(HashMap::new()),
            move_wait: MOVE_WAIT,
        };
        Ok(ClusterLeases { shared: Arc::new(shared) })
    }

    /// This client, sending items refused for a slot with no owner that may
    /// act again for up to `wait` instead of [`MOVE_WAIT`]; `Duration::ZERO`
    /// never sends them again, as a gateway that waits for its next
    /// heartbeat would not (their refusal is their result). Refusals that
    /// name an owner are still followed there: that is routing, not a retry.
    /// Call before the first batch and before cloning.
    pub fn with_move_wait(mut self, wait: Duration) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.move_wait = wait;
        }
        self
    }

    /// The node (its URL) this client sends `user_id`'s items to now.
    pub fn route_of(&self, user_id: &str) -> String {
        let routes = self.shared.routes.lock().expect("routes lock");
        let seed = self.shared.seed.lock().expect("seed lock");
        self.shared.route_in(&routes, &seed, user_id).to_owned()
    }

    /// How many slots have a learned owner.
    pub fn known_slots(&self) -> usize {
        self.shared.routes.lock().expect("routes lock").iter().filter(|route| route.is_some()).count()
    }

    /// Keeps the routes current from the slot map in etcd (`endpoints`, the
    /// nodes' `--etcd`; `prefix`, their key prefix, `/presenced/` unless set
    /// otherwise): loaded now, then followed through a watch until this
    /// client (every clone of it) is dropped. Fails if etcd cannot be reached
    /// now; once following, an etcd that goes away leaves the routes as they
    /// were and refusals keep them current until it is back.
    pub async fn follow_etcd(&self, endpoints: &[String], prefix: &str) -> Result<(), ClientError> {
        let etcd_error = |source: presence_cluster::Error| ClientError::Etcd { endpoints: endpoints.join(","), source };
        let etcd = presence_cluster::Etcd::connect_any(endpoints, None).await.map_err(etcd_error)?;
        let slots = SlotMapWatch::start(&etcd, prefix, self.shared.slots).await.map_err(etcd_error)?;
        let nodes = NodeSetWatch::start(&etcd, prefix).await.map_err(etcd_error)?;
        self.shared.follow(&slots.current(), &nodes.current());
        let shared = Arc::downgrade(&self.shared);
        tokio::spawn(async move {
            let (mut map_changes, mut node_changes) = (slots.subscribe(), nodes.subscribe());
            loop {
                tokio::select! {
                    changed = map_changes.changed() => if changed.is_err() { break },
                    changed = node_changes.changed() => if changed.is_err() { break },
                }
                let Some(shared) = shared.upgrade() else { break };
                shared.follow(&slots.current(), &nodes.current());
            }
        });
        Ok(())
    }

    // register, renew, unregister, join, leave and signal, each at its user's owner.
    lease_item_calls!();

    /// The settings each node's channel is opened with.
    pub fn config(&self) -> &LeaseChannelConfig {
        &self.shared.config
    }

    async fn submit_item(&self, op: lease_item::Op) -> Result<lease_result::Result, Status> {
        let mut results = self.submit_batch(vec![pb::LeaseItem { op: Some(op), ..Default::default() }]).await;
        lease_result(results.pop().unwrap_or_else(|| unavailable("no result")))
    }

    /// Sends `items`, each to its user's owner, and answers one result per
    /// item in item order. Items of one user keep their order (they travel
    /// together); items of users on different nodes go in parallel. An item
    /// whose node could not be reached is answered `UNAVAILABLE` (it may or
    /// may not have been applied), like an item of a broken stream.
    pub async fn submit_batch(&self, items: Vec<pb::LeaseItem>) -> Vec<pb::LeaseResult> {
        let mut results: Vec<Option<pb::LeaseResult>> = vec![None; items.len()];
        let mut pending: Vec<usize> = (0..items.len()).collect();
        let mut backoff = NO_OWNER_BACKOFF;
        let give_up_at = tokio::time::Instant::now() + self.shared.move_wait;
        let mut hops = 0;
        loop {
            let mut by_node: HashMap<String, Vec<usize>> = HashMap::new();
            {
                // One look at the routes for the whole hop.
                let routes = self.shared.routes.lock().expect("routes lock");
                let seed = self.shared.seed.lock().expect("seed lock");
                for &index in &pending {
                    let node = self.shared.route_in(&routes, &seed, user_of(&items[index]));
                    match by_node.get_mut(node) {
                        Some(indices) => indices.push(index),
                        None => {
                            by_node.insert(node.to_owned(), vec![index]);
                        }
                    }
                }
            }
            let mut sends = tokio::task::JoinSet::new();
            for (node, indices) in by_node {
                let batch: Vec<pb::LeaseItem> = indices.iter().map(|&index| items[index].clone()).collect();
                let channel = self.channel(&node);
                sends.spawn(async move {
                    let answered = match channel {
                        Ok(channel) => channel.submit_batch(batch).await,
                        Err(error) => Err(Status::unavailable(error.to_string())),
                    };
                    (node, indices, answered)
                });
            }
            let mut again = Vec::new();
            let mut ownerless = false;
            while let Some(joined) = sends.join_next().await {
                // A send that panicked leaves its items unanswered: "not sent" below.
                let Ok((node, indices, answered)) = joined else { continue };
                match answered {
                    Ok(answers) => {
                        for (index, result) in indices.into_iter().zip(answers) {
                            if let Some(not_owner) = result.not_owner.as_ref().filter(|_| is_refusal(&result)) {
                                let behind = !self.learn(not_owner);
                                ownerless |= not_owner.owner_addr.is_empty() || behind;
                                again.push(index);
                            }
                            results[index] = Some(result);
                        }
                    }
                    Err(status) => {
                        // Nothing reached a node that could not be reached:
                        // its items go elsewhere, which names their owner. Of a
                        // stream that broke (the node stopped with the batch in
                        // flight), only renewals are sent again: they may have
                        // been applied, and a renewal applied twice is one.
                        let unsent = is_unsent(&status);
                        if self.forget(&node) {
                            again.extend(indices.iter().filter(|&&index| unsent || is_renewal(&items[index])));
                        }
                        for index in indices {
                            results[index] = Some(unavailable(status.message()));
                        }
                    }
                }
            }
            if again.is_empty() {
                break;
            }
            pending = again;
            if ownerless {
                // A slot without an owner that may act: waited out by time.
                if tokio::time::Instant::now() + backoff > give_up_at {
                    break;
                }
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(MAX_NO_OWNER_BACKOFF);
            } else {
                hops += 1;
                if hops == MAX_HOPS {
                    break;
                }
            }
        }
        results.into_iter().map(|result| result.unwrap_or_else(|| unavailable("not sent"))).collect()
    }

    /// Keeps the route a refusal names, unless one of a higher epoch is
    /// known; returns false for a refusal that names an older epoch than
    /// the route known (the node refusing is behind etcd).
    fn learn(&self, not_owner: &pb::NotOwner) -> bool {
        if not_owner.owner_addr.is_empty() || not_owner.slot >= self.shared.slots {
            return true;
        }
        let address = format!("{}{}", self.shared.scheme, not_owner.owner_addr);
        let shunned = self.shared.unreachable.lock().expect("unreachable lock").get(&address).copied();
        if shunned.is_some_and(|shunned| shunned.holds_against(not_owner.epoch, std::time::Instant::now())) {
            return true;
        }
        let mut routes = self.shared.routes.lock().expect("routes lock");
        let route = &mut routes[not_owner.slot as usize];
        if route.as_ref().is_none_or(|known| known.epoch <= not_owner.epoch) {
            *route = Some(Route { epoch: not_owner.epoch, address });
            return true;
        }
        false
    }

    /// Forgets `node`, which could not be reached: the routes to it, and if
    /// it is where unrouted items go, it stops being so for another node
    /// learned. Returns whether its items have somewhere else to go.
    fn forget(&self, node: &str) -> bool {
        let until = std::time::Instant::now() + UNREACHABLE_FOR;
        // A new stream, when the node is routed to again, starts without the backoff this one ran up.
        self.shared.channels.lock().expect("channels lock").remove(node);
        let mut routes = self.shared.routes.lock().expect("routes lock");
        let epoch = routes.iter().flatten().map(|route| route.epoch).max().unwrap_or(0);
        self.shared.unreachable.lock().expect("unreachable lock").insert(node.to_owned(), Shunned { until, epoch });
        for route in routes.iter_mut() {
            if route.as_ref().is_some_and(|route| route.address == node) {
                *route = None;
            }
        }
        let mut seed = self.shared.seed.lock().expect("seed lock");
        if *seed != node {
            return true;
        }
        let other = routes.iter().flatten().map(|route| route.address.clone()).next();
        match other {
            Some(other) => {
                *seed = other;
                true
            }
            None => false,
        }
    }

    /// The channel to `node`, opened (lazily) the first time.
    fn channel(&self, node: &str) -> Result<LeaseChannel, ClientError> {
        let mut channels = self.shared.channels.lock().expect("channels lock");
        if let Some(channel) = channels.get(node) {
            return Ok(channel.clone());
        }
        let channel = LeaseChannel::connect_lazy(node, self.shared.config.clone())?;
        channels.insert(node.to_owned(), channel.clone());
        Ok(channel)
    }
}

impl Shared {
    /// Takes every route of `map` whose owner is registered in `nodes` and
    /// whose epoch is not older than the route known. An owner etcd no longer
    /// registers (it died, its slots are being taken over) keeps the route
    /// known: the refusals name the new owner as soon as there is one.
    fn follow(&self, map: &SlotMap, nodes: &NodeSet) {
        let now = std::time::Instant::now();
        let unreachable = self.unreachable.lock().expect("unreachable lock").clone();
        let mut routes = self.routes.lock().expect("routes lock");
        for (slot, route) in routes.iter_mut().enumerate() {
            let Some(owner) = map.owner(slot as u32) else { continue };
            let Some(address) = nodes.address(&owner.node) else { continue };
            let address = format!("{}{address}", self.scheme);
            if unreachable.get(&address).is_some_and(|shunned| shunned.holds_against(owner.epoch, now)) {
                continue;
            }
            if route.as_ref().is_none_or(|known| known.epoch <= owner.epoch) {
                *route = Some(Route { epoch: owner.epoch, address });
            }
        }
    }

    /// Where `user_id`'s items go, in `routes`: its slot's learned owner, or the seed.
    fn route_in<'a>(&self, routes: &'a [Option<Route>], seed: &'a str, user_id: &str) -> &'a str {
        let slot = slot_of(user_id, self.slots) as usize;
        routes[slot].as_ref().map_or(seed, |route| route.address.as_str())
    }
}

fn is_renewal(item: &pb::LeaseItem) -> bool {
    matches!(item.op, Some(lease_item::Op::Renew(_)))
}

/// Whether a batch's failure says nothing of it reached the node.
fn is_unsent(status: &Status) -> bool {
    status.metadata().contains_key(crate::lease_channel::UNSENT)
}

fn is_refusal(result: &pb::LeaseResult) -> bool {
    result.code == Code::Unavailable as u32
}

fn unavailable(message: &str) -> pb::LeaseResult {
    pb::LeaseResult { code: Code::Unavailable as u32, message: message.to_owned(), ..Default::default() }
}

/// The user an item acts for.
fn user_of(item: &pb::LeaseItem) -> &str {
    match &item.op {
        Some(lease_item::Op::Register(request)) => &request.user_id,
        Some(lease_item::Op::Renew(request)) => &request.user_id,
        Some(lease_item::Op::Unregister(request)) => &request.user_id,
        Some(lease_item::Op::Join(request)) => &request.user_id,
        Some(lease_item::Op::Leave(request)) => &request.user_id,
        Some(lease_item::Op::Signal(request)) => &request.user_id,
        None => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A user of `slot` among `slots`.
    fn user_in(slot: u32, slots: u32) -> String {
        (0..).map(|i| format!("user-{i}")).find(|user| slot_of(user, slots) == slot).expect("some user")
    }

    fn not_owner(slot: u32, epoch: i64, owner_addr: &str) -> pb::NotOwner {
        pb::NotOwner { slot, epoch, owner_id: String::new(), owner_addr: owner_addr.to_owned() }
    }

    #[tokio::test]
    async fn d1_a_node_found_unreachable_is_routed_to_again_once_it_is_given_a_slot_after_that() {
        let leases = ClusterLeases::new("http://127.0.0.1:1", 64, LeaseChannelConfig::default()).unwrap();
        let (mine, other) = (user_in(3, 64), user_in(4, 64));
        assert!(leases.learn(&not_owner(3, 10, "127.0.0.1:2")));
        assert!(leases.learn(&not_owner(4, 12, "127.0.0.1:3")));
        assert_eq!(leases.route_of(&mine), "http://127.0.0.1:2");
        // The node stops (its stream broke): not routed to for a while,
        // whatever refusals of the ownerships known then say.
        assert!(leases.forget("http://127.0.0.1:2"));
        leases.learn(&not_owner(3, 10, "127.0.0.1:2"));
        leases.learn(&not_owner(3, 12, "127.0.0.1:2"));
        assert_eq!(leases.route_of(&mine), "http://127.0.0.1:1", "still shunned for an ownership known before");
        // It is back and etcd gave it a slot since (a higher epoch than any
        // known when it was shunned): routed to at once.
        assert!(leases.learn(&not_owner(3, 13, "127.0.0.1:2")));
        assert_eq!(leases.route_of(&mine), "http://127.0.0.1:2");
        assert_eq!(leases.route_of(&other), "http://127.0.0.1:3");
    }
}
