//! Cluster coordination against a real etcd, started by each test on
//! loopback ports with its own data directory (`etcd` from PATH, or
//! `PRESENCED_ETCD_BIN`; `.ci/install-etcd` installs Debian's).

use std::time::Duration;

use std::collections::BTreeMap;

use presence_cluster::testing::EtcdServer;
use presence_cluster::{
    Campaigner, Claim, Coordinator, Etcd, LeaseState, NodeLease, SlotMap, SlotMapWatch, SlotOwner, claim_slot,
    follower_of, register_node,
};
use tokio::time::Instant;

use presence_cluster::testing::PATIENCE;

/// Waits for `condition` to hold, polling, for at most [`PATIENCE`].
async fn until(what: &str, mut condition: impl AsyncFnMut() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !condition().await {
        assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// `node` campaigning with no settle time and no outage seen.
fn campaigner(node: &str) -> Campaigner {
    campaigner_seeing(node, tokio::sync::watch::channel(None).1, Duration::ZERO)
}

/// `node` campaigning with no settle time, seeing etcd come back at the
/// instants `etcd_back` carries, and holding a gone owner's slots for `rejoin_grace` after.
fn campaigner_seeing(
    node: &str,
    etcd_back: tokio::sync::watch::Receiver<Option<Instant>>,
    rejoin_grace: Duration,
) -> Campaigner {
    Campaigner {
        node: node.to_owned(),
        settle: Duration::ZERO,
        etcd_back,
        rejoin_grace,
        ride_out: Duration::ZERO,
        lease_ttl: Duration::ZERO,
        fencing: None,
    }
}

/// Every slot's owner, in slot order.
fn owners(map: &SlotMap) -> Vec<Option<SlotOwner>> {
    (0..map.slots()).map(|slot| map.owner(slot).cloned()).collect()
}

async fn node_registered(etcd: &Etcd, prefix: &str, node: &str) -> bool {
    etcd.get(format!("{prefix}nodes/{node}").as_bytes()).await.unwrap().is_some()
}

#[tokio::test]
async fn c1_a_node_registration_lives_as_long_as_its_lease_is_kept_alive() {
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let lease = NodeLease::grant(&etcd, Duration::from_secs(1), Duration::from_millis(200)).await.unwrap();
    register_node(&etcd, "/c1/", "node-a", "127.0.0.1:7001", lease.id()).await.unwrap();
    // Three TTLs later it is still there: the keep-alives hold it.
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(node_registered(&etcd, "/c1/", "node-a").await, "kept alive past three TTLs");
    assert!(lease.is_valid_at(Instant::now()), "{:?}", lease.state());
    // Keep-alives stop (the node died): etcd drops the registration within about a TTL.
    let dropped_at = Instant::now();
    drop(lease);
    until("the registration goes with the lease", async || !node_registered(&etcd, "/c1/", "node-a").await).await;
    // etcd checks for expired leases twice a second; the bound leaves room for a loaded machine.
    let gone_after = dropped_at.elapsed();
    assert!(gone_after <= Duration::from_secs(4), "gone {gone_after:?} after the keep-alives stopped (TTL 1 s)");
}

#[tokio::test]
async fn c1_a_revoked_lease_takes_its_registration_at_once() {
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let lease = NodeLease::grant(&etcd, Duration::from_secs(30), Duration::from_secs(1)).await.unwrap();
    register_node(&etcd, "/c1r/", "node-a", "127.0.0.1:7001", lease.id()).await.unwrap();
    assert!(node_registered(&etcd, "/c1r/", "node-a").await);
    lease.revoke().await.unwrap();
    assert!(!node_registered(&etcd, "/c1r/", "node-a").await, "gone as soon as the revoke is answered");
}

#[tokio::test]
async fn c4_a_node_cut_off_from_etcd_lapses_before_its_lease_could_have_expired() {
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let ttl = Duration::from_secs(2);
    let granted_at = Instant::now();
    let lease = NodeLease::grant(&etcd, ttl, Duration::from_millis(300)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let LeaseState::ValidUntil(before) = lease.state() else { panic!("{:?}", lease.state()) };
    assert!(before >= granted_at + ttl, "keep-alives moved the deadline on from the grant's");
    // etcd stops answering (as under a partition): the deadline moves no further.
    server.signal("-STOP");
    let stopped_at = Instant::now();
    until("the node's lease lapses", async || !lease.is_valid_at(Instant::now())).await;
    let lapsed_after = stopped_at.elapsed();
    server.signal("-CONT");
    assert!(matches!(lease.state(), LeaseState::ValidUntil(until) if until <= before + ttl), "{:?}", lease.state());
    // etcd could have expired it no earlier than TTL after the last keep-alive
    // it answered, which was sent before the stop: the node lapsed before that.
    assert!(lapsed_after < ttl, "lapsed {lapsed_after:?} after etcd went silent; the TTL is {ttl:?}");
}

#[tokio::test]
async fn c1_slots_change_owner_only_by_compare_and_swap_on_the_epoch_and_the_map_follows() {
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let map = SlotMapWatch::start(&etcd, "/c1s/", 8).await.unwrap();
    assert!((0..8).all(|slot| map.current().owner(slot).is_none()));

    let Claim::Won { epoch: first } = claim_slot(&etcd, "/c1s/", 3, "node-a", 0).await.unwrap() else {
        panic!("an unowned slot is claimed")
    };
    // A second claim on what it saw as unowned is stale: the slot has an owner now.
    let stale = claim_slot(&etcd, "/c1s/", 3, "node-b", 0).await.unwrap();
    assert_eq!(stale, Claim::Stale { current: Some(SlotOwner { node: "node-a".into(), epoch: first }) });
    until("the map shows node-a at the first epoch", async || {
        map.current().owner(3) == Some(&SlotOwner { node: "node-a".into(), epoch: first })
    })
    .await;

    // Moving it on from the epoch seen gives a larger epoch.
    let Claim::Won { epoch: second } = claim_slot(&etcd, "/c1s/", 3, "node-b", first).await.unwrap() else {
        panic!("a move from the seen epoch")
    };
    assert!(second > first, "epochs grow: {first} then {second}");
    assert!(
        matches!(claim_slot(&etcd, "/c1s/", 3, "node-c", first).await.unwrap(), Claim::Stale { .. }),
        "the old epoch is spent"
    );
    until("the map follows the move", async || map.current().owner(3).map(|owner| owner.epoch) == Some(second)).await;
    assert_eq!(map.current().owned_by("node-b").collect::<Vec<_>>(), vec![3]);
    assert!(map.current().revision() >= second);
}

#[tokio::test]
async fn c5_the_slot_map_is_kept_while_etcd_is_away_and_catches_up_when_it_returns() {
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let map = SlotMapWatch::start(&etcd, "/c5/", 4).await.unwrap();
    let Claim::Won { epoch } = claim_slot(&etcd, "/c5/", 1, "node-a", 0).await.unwrap() else { panic!() };
    until("the map shows the claim", async || map.current().owner(1).is_some()).await;

    server.signal("-STOP");
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(map.current().owner(1), Some(&SlotOwner { node: "node-a".into(), epoch }), "kept while etcd is away");
    server.signal("-CONT");

    // A change made once etcd is back reaches the map, whether its watch
    // survived the pause or was loaded afresh.
    let other = server.client().await;
    let Claim::Won { epoch: moved } = claim_slot(&other, "/c5/", 1, "node-b", epoch).await.unwrap() else { panic!() };
    until("the map catches up", async || map.current().owner(1).map(|owner| owner.epoch) == Some(moved)).await;
}

/// Slots per owner, for every slot that has one.
fn loads(map: &SlotMap) -> BTreeMap<String, usize> {
    let mut loads = BTreeMap::new();
    for slot in 0..map.slots() {
        if let Some(owner) = map.owner(slot) {
            *loads.entry(owner.node.clone()).or_default() += 1;
        }
    }
    loads
}

#[tokio::test]
async fn c4_the_elected_coordinator_gives_every_slot_a_live_owner_and_a_dead_nodes_slots_to_the_others() {
    const SLOTS: u32 = 64;
    const TTL: Duration = Duration::from_secs(1);
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    // All three register before any campaigns: repairs give slots only to
    // the nodes there are (a node that joins later gets slots by a planned
    // move, not by repair).
    let mut leases = Vec::new();
    for (index, node) in ["a", "b", "c"].into_iter().enumerate() {
        let lease = NodeLease::grant(&etcd, TTL, Duration::from_millis(200)).await.unwrap();
        register_node(&etcd, "/c4/", node, &format!("127.0.0.1:{}", 7001 + index), lease.id()).await.unwrap();
        leases.push((node, lease));
    }
    let mut nodes = BTreeMap::new();
    for (node, lease) in leases {
        let coordinator = Coordinator::start(&etcd, "/c4/", SLOTS, &lease, campaigner(node));
        nodes.insert(node, (lease, coordinator));
    }
    let map = SlotMapWatch::start(&etcd, "/c4/", SLOTS).await.unwrap();
    until("every slot has an owner, spread evenly", async || {
        let loads = loads(&map.current());
        loads.values().sum::<usize>() == SLOTS as usize
            && loads.len() == 3
            && loads.values().all(|&n| (21..=22).contains(&n))
    })
    .await;
    until("one coordinator", async || nodes.values().filter(|(_, coordinator)| coordinator.is_leading()).count() == 1)
        .await;
    let before = map.current();

    // The coordinator's node dies: its lease runs out, another node is
    // elected, and it gives the dead node's slots to the two that are left.
    let dead = *nodes.iter().find(|(_, (_, coordinator))| coordinator.is_leading()).unwrap().0;
    let died_at = Instant::now();
    nodes.remove(dead);
    until("the dead node's slots have live owners", async || {
        let loads = loads(&map.current());
        !loads.contains_key(dead) && loads.values().sum::<usize>() == SLOTS as usize
    })
    .await;
    let taken_over = died_at.elapsed();
    assert!(taken_over <= TTL + Duration::from_secs(2), "taken over {taken_over:?} after the node died (TTL {TTL:?})");
    until("one coordinator again", async || {
        nodes.values().filter(|(_, coordinator)| coordinator.is_leading()).count() == 1
    })
    .await;

    let after = map.current();
    let live: Vec<String> = nodes.keys().map(|node| (*node).to_owned()).collect();
    let mut gained = BTreeMap::<&str, usize>::new();
    for slot in 0..SLOTS {
        let (was, now) = (before.owner(slot).unwrap(), after.owner(slot).unwrap());
        if was.node == dead {
            assert!(now.epoch > was.epoch, "slot {slot}: a new owner, a new and larger epoch ({was:?} -> {now:?})");
            // The node that kept a copy of the slot's users takes it (C4).
            let follower = follower_of(slot, dead, &live).unwrap();
            assert_eq!(now.node, follower, "slot {slot}: the dead owner's follower takes it");
            *gained.entry(follower).or_default() += 1;
        } else {
            assert_eq!(now, was, "slot {slot}: a live owner keeps its slot and its epoch");
        }
    }
    // Rendezvous spreads the followers: both survivors take a share.
    assert_eq!(gained.len(), 2, "the dead node's slots go to both others: {gained:?}");
}

/// Nodes "a" and "b" registered under `prefix` on leases of `ttl` (less
/// `margin`), each campaigning: "a" elected, then "b" in line behind it.
async fn elected_and_next_in_line(
    etcd: &Etcd,
    prefix: &str,
    slots: u32,
    ttl: Duration,
    margin: Duration,
) -> ((NodeLease, Coordinator), (NodeLease, Coordinator)) {
    let (a, b) =
        (NodeLease::grant(etcd, ttl, margin).await.unwrap(), NodeLease::grant(etcd, ttl, margin).await.unwrap());
    register_node(etcd, prefix, "a", "127.0.0.1:7001", a.id()).await.unwrap();
    register_node(etcd, prefix, "b", "127.0.0.1:7002", b.id()).await.unwrap();
    let first = Coordinator::start(etcd, prefix, slots, &a, campaigner("a"));
    until("a is elected", async || first.is_leading()).await;
    let second = Coordinator::start(etcd, prefix, slots, &b, campaigner("b"));
    ((a, first), (b, second))
}

#[tokio::test]
async fn c1_a_coordinator_that_lost_its_election_is_fenced_off_and_steps_down() {
    const SLOTS: u32 = 8;
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let ((a, first), (_b, second)) =
        elected_and_next_in_line(&etcd, "/fence/", SLOTS, Duration::from_secs(5), Duration::from_secs(1)).await;
    let map = SlotMapWatch::start(&etcd, "/fence/", SLOTS).await.unwrap();
    until("every slot has an owner", async || loads(&map.current()).values().sum::<usize>() == SLOTS as usize).await;

    // a's leadership goes without a knowing (as when a was paused past its
    // lease): its election key is deleted, and b, next in line, is elected.
    let key = format!("/fence/coordinator/{:x}", a.id());
    assert!(etcd.delete(key.as_bytes()).await.unwrap(), "the election key is {key}");
    until("b is elected", async || second.is_leading()).await;
    // Both now believe they lead. A slot loses its owner: both try to repair
    // it, and a's claim is refused by the fence, so a steps down.
    assert!(etcd.delete(b"/fence/slots/0").await.unwrap());
    until("a steps down", async || !first.is_leading()).await;
    until("the slot has an owner again", async || map.current().owner(0).is_some()).await;
    assert!(second.is_leading());
}

#[tokio::test]
async fn c1_campaigns_from_before_etcd_let_every_lease_go_lead_nothing_after() {
    const SLOTS: u32 = 8;
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let ttl = Duration::from_secs(1);
    let ((a, first), (b, second)) =
        elected_and_next_in_line(&etcd, "/stale/", SLOTS, ttl, Duration::from_millis(200)).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert!(!second.is_leading(), "b waits in line behind a");

    // etcd freezes past the TTL; at the thaw it lets both leases go, with
    // both election keys, and answers b's waiting campaign: b's key is gone
    // too, so that campaign is stale and b leads nothing.
    server.signal("-STOP");
    tokio::time::sleep(ttl * 2 + Duration::from_millis(500)).await;
    server.signal("-CONT");
    until("etcd says both leases are gone", async || a.state() == LeaseState::Lost && b.state() == LeaseState::Lost)
        .await;
    let watched = Instant::now();
    while watched.elapsed() < Duration::from_millis(1_500) {
        assert!(!first.is_leading() && !second.is_leading(), "a coordinator on a lease etcd let go");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert_eq!(etcd.leader(&presence_cluster::election_name("/stale/")).await.unwrap(), None, "nobody campaigns");
}

#[tokio::test]
async fn c4_after_etcd_came_back_a_gone_owners_slots_wait_for_the_rejoin_grace_and_a_node_back_within_it_keeps_them() {
    const SLOTS: u32 = 64;
    const GRACE: Duration = Duration::from_secs(2);
    let server = EtcdServer::start().await;
    let etcd = server.client().await;
    let ttl = Duration::from_secs(5);
    let mut leases = BTreeMap::new();
    for (index, node) in ["a", "b", "c"].into_iter().enumerate() {
        let lease = NodeLease::grant(&etcd, ttl, Duration::from_millis(200)).await.unwrap();
        register_node(&etcd, "/grace/", node, &format!("127.0.0.1:{}", 7001 + index), lease.id()).await.unwrap();
        leases.insert(node, lease);
    }
    let (etcd_back, seen_back) = tokio::sync::watch::channel(None);
    let coordinator =
        Coordinator::start(&etcd, "/grace/", SLOTS, &leases["a"], campaigner_seeing("a", seen_back, GRACE));
    let map = SlotMapWatch::start(&etcd, "/grace/", SLOTS).await.unwrap();
    until("every node owns slots", async || loads(&map.current()).len() == 3).await;
    assert!(coordinator.is_leading());
    let before = map.current();

    // etcd comes back after an outage (as a's lease saw it), having let b's
    // and c's leases go; b joins again 300 ms later, c never does.
    let back = Instant::now();
    etcd_back.send_replace(Some(back));
    leases.remove("b").unwrap().revoke().await.unwrap();
    leases.remove("c").unwrap().revoke().await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    let b_again = NodeLease::grant(&etcd, ttl, Duration::from_millis(200)).await.unwrap();
    register_node(&etcd, "/grace/", "b", "127.0.0.1:7002", b_again.id()).await.unwrap();
    // Within the grace nothing moves, not even c's slots.
    while back.elapsed() < GRACE - Duration::from_millis(200) {
        assert_eq!(owners(&map.current()), owners(&before), "a slot moved {:?} into the grace", back.elapsed());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // Past it, c's slots go to their followers; b keeps its own, at their epochs.
    until("c's slots have live owners", async || !loads(&map.current()).contains_key("c")).await;
    assert!(back.elapsed() >= GRACE, "c's slots moved {:?} after etcd came back", back.elapsed());
    let after = map.current();
    let live = vec!["a".to_owned(), "b".to_owned()];
    for slot in 0..SLOTS {
        let (was, now) = (before.owner(slot).unwrap(), after.owner(slot).unwrap());
        if was.node == "c" {
            assert_eq!(Some(now.node.as_str()), follower_of(slot, "c", &live), "slot {slot}");
        } else {
            assert_eq!(now, was, "slot {slot}: its owner, back within the grace, keeps it");
        }
    }
}
