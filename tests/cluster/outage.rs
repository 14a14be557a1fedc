//! etcd outages: serving through one (C5), joining again after a lost
//! lease, and the thaw with nodes back at different moments (C4, M4).

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c5_through_an_etcd_outage_nodes_serve_on_the_map_they_have_move_nothing_and_carry_on_when_it_returns() {
    let mut etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes(&etcd).await;
    let users: Vec<String> = (0..300).map(|i| format!("steady-{i}")).collect();
    let (leases, generations) = register_all(&servers[0], &users).await;
    let mut viewer = servers[1].client().await;
    let before = presences(&mut viewer, &users).await;
    let (stop_watching, watcher) = watch_through_failures(servers[1].url(), users.clone());
    let (stop_renewing, renewer) = keep_renewing_by_round(std::sync::Arc::clone(&leases), generations, 1_500);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // etcd goes down for three lease TTLs (2 s each).
    etcd.kill().await;
    let down = Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    // The nodes still act: a new session registers at its owner...
    let newcomer = leases.submit_batch(vec![register("newcomer")]).await;
    assert_eq!(newcomer[0].code, 0, "a register during the outage: {:?}", newcomer[0]);
    // ...but no slot moves, and the refusal says why.
    let slot = map.owned_by("node-a").next().unwrap();
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    let move_one = || pb::MoveSlotsRequest { slots: vec![slot], to_node: "node-b".into() };
    let refused = at_a.move_slots(move_one()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("etcd does not answer"), "{refused:?}");
    tokio::time::sleep_until(down + Duration::from_secs(6)).await;

    // etcd is back with what it held: the slot map is as it was, and moves work again.
    etcd.restart().await;
    assert_eq!(map_where(&etcd.client().await, "the map after the outage", |_| true).await, map);
    let deadline = Instant::now() + PATIENCE;
    let moved = loop {
        match at_a.move_slots(move_one()).await {
            Ok(moved) => break moved.into_inner(),
            Err(status) if Instant::now() < deadline && status.message().contains("etcd") => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(status) => panic!("the move after the outage: {status:?}"),
        }
    };
    assert!(moved.epoch > map.owner(slot).unwrap().epoch, "{moved:?}");
    tokio::time::sleep(Duration::from_millis(1_000)).await;

    // Not one renewal failed, before, during or after the outage, and nobody flipped.
    let _ = stop_renewing.send(());
    let rounds = renewer.await.unwrap();
    let during = rounds.iter().filter(|(started, _)| *started > down && *started < down + Duration::from_secs(6));
    assert!(during.count() >= 20, "renewals went on during the outage: {} rounds in all", rounds.len());
    let failed: Vec<&String> = rounds.iter().flat_map(|(_, failed)| failed).collect();
    assert!(failed.is_empty(), "{} renewals failed, first {:?}", failed.len(), failed.first());
    let _ = stop_watching.send(());
    let seen = watcher.await.unwrap();
    assert_no_offline_and_no_version_back(&seen, "no OFFLINE through the outage");
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_nodes_whose_leases_etcd_let_go_while_it_was_frozen_join_again_and_nobody_flips() {
    let etcd = EtcdServer::start().await;
    let (servers, _) = three_nodes(&etcd).await;
    let users: Vec<String> = (0..300).map(|i| format!("frozen-{i}")).collect();
    let (leases, generations) = register_all(&servers[0], &users).await;
    let before_leases = registrations(&etcd.client().await).await;
    let mut viewer = servers[1].client().await;
    let before = presences(&mut viewer, &users).await;
    let (stop_watching, watcher) = watch_through_failures(servers[1].url(), users.clone());
    // Sessions of a 3 s TTL, renewed every 200 ms.
    let (stop_renewing, renewer) = keep_renewing_by_round(std::sync::Arc::clone(&leases), generations, 3_000);
    tokio::time::sleep(Duration::from_millis(500)).await;

    // etcd freezes for twice the lease TTL: the nodes ride it out on each
    // other's word; when it thaws, it finds every lease past its TTL and
    // lets them go, with the registrations and the coordinator's key.
    etcd.signal("-STOP");
    let frozen = Instant::now();
    tokio::time::sleep(Duration::from_secs(4)).await;
    etcd.signal("-CONT");
    let thawed = Instant::now();
    let client = etcd.client().await;
    let deadline = Instant::now() + PATIENCE;
    let after_leases = loop {
        let now = registrations(&client).await;
        if now.len() == NODES.len() && now.iter().all(|(node, lease)| before_leases[node] != *lease) {
            break now;
        }
        assert!(Instant::now() < deadline, "the nodes did not all join again under new leases: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let rejoined = thawed.elapsed();
    let map = map_where(&client, "every slot has a registered owner", |map| {
        (0..SLOTS).all(|slot| after_leases.contains_key(&map.owner(slot).unwrap().node))
    })
    .await;
    // Renewals go on at whichever node the map gives each user now.
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let _ = stop_renewing.send(());
    let rounds = renewer.await.unwrap();
    let during = rounds.iter().filter(|(started, _)| *started > frozen && *started < thawed);
    let failed_during: Vec<&String> = during.flat_map(|(_, failed)| failed).collect();
    assert!(failed_during.is_empty(), "renewals failed while etcd was frozen: {failed_during:?}");
    let settled = rounds.iter().rev().take(3).flat_map(|(_, failed)| failed).collect::<Vec<_>>();
    assert!(settled.is_empty(), "the last rounds, {rejoined:?} after the thaw: {settled:?}");
    let _ = stop_watching.send(());
    let seen = watcher.await.unwrap();
    assert_no_offline_and_no_version_back(&seen, "no OFFLINE");
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
    // Each user is at one node only: the owner the map names.
    for user in &users {
        let owner = &map.owner(slot_of(user, SLOTS)).unwrap().node;
        for (node, server) in NODES.iter().zip(&servers) {
            let answered = forwarded_snapshot(&mut server.client().await, user).await;
            assert_eq!(answered.is_ok(), node == owner, "{user} at {node} (owner {owner}): {answered:?}");
        }
    }
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_nodes_that_come_back_from_an_etcd_freeze_at_different_moments_keep_their_slots_and_nobody_flips() {
    // One node free at the thaw, one held back 40 ms, one 300 ms; which is
    // which turns with each outage.
    let steps = [0, 40, 300].map(Duration::from_millis);
    staggered_thaws("thaw-staggered", thaw_rounds(3), |round, _| {
        [0, 1, 2].map(|node| steps[(node + round) % steps.len()])
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_a_coordinator_that_comes_back_from_an_etcd_freeze_last_takes_nothing_and_nobody_flips() {
    // The coordinator of the moment is held back 600 ms, the others 0 and 40 ms.
    staggered_thaws("thaw-coordinator-last", thaw_rounds(3), |round, coordinator| {
        let others = [0, 40].map(Duration::from_millis);
        let mut others = others.iter().cycle().skip(round);
        [0, 1, 2].map(|node| if node == coordinator { Duration::from_millis(600) } else { *others.next().unwrap() })
    })
    .await;
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_a_node_cut_off_from_etcd_alone_past_the_lease_ttl_is_taken_over_and_joins_again_and_nobody_flips() {
    // node-a runs in a network namespace of its own; etcd listens on the
    // host's group 1 address, node-b, node-c, the gateway and the viewer on
    // group 0's. Cutting group 1 off cuts node-a from etcd alone: it still
    // hears the other nodes, which tell it that etcd answers them.
    let name = "cut-off-alone";
    let logs = daemon::scratch_dir(name);
    let lab = presence_faults::NetLab::new(2).expect("a network namespace (root, ip, nft)");
    let etcd = EtcdServer::start_on(lab.group_ip(1)).await;
    let advertise = format!("{}:{}", lab.server_ip(), daemon::free_port());
    let mut args = node_process_args(&etcd, "node-a", &advertise);
    // Open, on an address other than loopback: the lab's own network.
    args.push("--insecure".to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let log = logs.join("node-a.log");
    let prefix = ["ip", "netns", "exec", lab.namespace()];
    let node_a = daemon::Daemon::start_through(&prefix, &advertise, &args, &[("RUST_LOG", "info")], Some(&log));
    let mut servers = Vec::new();
    for node in &NODES[1..] {
        // Holding what they take over for as long as the default TTL in
        // production: well past the time the gateway's client takes to find the new owners.
        let held = || ServerConfig { restart_grace: Some(Duration::from_secs(5)), ..fast_config() };
        servers
            .push(TestServer::start_with_at(lab.group_ip(0), |addr| node_config_with(&etcd, node, addr, held())).await);
    }
    let client = etcd.client().await;
    let a_owns_slots = |map: &presence_cluster::SlotMap| NODES.iter().all(|node| map.owned_by(node).count() > 0);
    map_where(&client, "every node owns slots", a_owns_slots).await;
    let mut traffic = Traffic::start(name, &servers[0].url(), &servers[0].url()).await;
    for round in 0..thaw_rounds(2) {
        let before = registrations(&client).await["node-a"];
        traffic.outage(Instant::now(), format!("cut {round}"));
        lab.partition(1).unwrap();
        // node-a stops acting when its lease lapses; etcd expires the lease,
        // and the coordinator gives its slots to their followers at once
        // (etcd answered it throughout), which take them over from their copies.
        map_where(&client, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        lab.heal(1).unwrap();
        // node-a joins again under a new lease, and is given slots back by planned moves.
        let deadline = Instant::now() + PATIENCE;
        while registrations(&client).await.get("node-a").is_none_or(|lease| *lease == before) {
            assert!(Instant::now() < deadline, "node-a did not join again");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        map_where(&client, "node-a owns slots again", a_owns_slots).await;
        // The coordinator goes on moving slots to node-a a few at a time
        // until the map is even: the next cut (or the end) comes after that,
        // as it would in production, where cuts are minutes apart.
        let live: Vec<String> = NODES.iter().map(|node| node.to_string()).collect();
        map_where(&client, "the slots even again", |map| presence_cluster::rebalancing_move(map, &live).is_none())
            .await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    traffic.finish(&logs).await;
    node_a.stop().await;
    for server in servers {
        server.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}
