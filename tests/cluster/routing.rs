//! C1 and C2: which node answers for whom, refusals that name the owner,
//! reads and watches across nodes, a node cut off from etcd.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_batch_sent_to_one_node_reaches_every_owner_and_any_node_answers_a_snapshot_of_everyone() {
    let etcd = EtcdServer::start().await;
    let (mut servers, map) = three_nodes(&etcd).await;
    let nodes = NODES;
    let address: HashMap<&str, SocketAddr> = nodes.iter().copied().zip(servers.iter().map(|s| s.addr)).collect();

    // `presenced cluster status` reads the same map from etcd.
    let status = cluster_status(&etcd, &["--json"]);
    assert_eq!((status["slots"].as_u64(), status["unowned"].as_u64()), (Some(u64::from(SLOTS)), Some(0)), "{status}");
    assert!(nodes.contains(&status["coordinator"].as_str().unwrap()), "{status}");
    for node in status["nodes"].as_array().unwrap() {
        let id = node["id"].as_str().unwrap();
        assert_eq!(node["slots"].as_u64(), Some(map.owned_by(id).count() as u64), "{status}");
        assert_eq!(node["address"].as_str(), Some(address[id].to_string().as_str()), "{status}");
    }
    let unreachable = std::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .args(["cluster", "status", "--etcd", "http://127.0.0.1:1"])
        .output()
        .unwrap();
    assert_eq!(unreachable.status.code(), Some(3), "{}", String::from_utf8_lossy(&unreachable.stderr));
    let table = String::from_utf8(cluster_status_output(&etcd, &[]).stdout).unwrap();
    assert!(table.starts_with("NODE") && table.contains(&format!("{SLOTS} slots, 0 without an owner")), "{table}");

    let leases = ClusterLeases::new(&servers[0].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    let users: Vec<String> = (0..300).map(|i| format!("user-{i}")).collect();
    let results = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
    let mut generations = HashMap::new();
    for (user, result) in users.iter().zip(results) {
        match lease_result(result.clone()) {
            Ok(pb::lease_result::Result::Register(registered)) => {
                generations.insert(user.clone(), registered.generation)
            }
            other => panic!("{user}: {other:?} ({result:?})"),
        };
    }
    assert!(leases.known_slots() > 0, "the client learned owners from the refusals");

    let mut clients: HashMap<&str, PresenceClient<Channel>> = HashMap::new();
    for (node, server) in nodes.iter().zip(&servers) {
        clients.insert(node, server.client().await);
    }
    for user in &users {
        let owner = map.owner(slot_of(user, SLOTS)).unwrap();
        // The owner holds it, and the client routes it there now.
        let at_owner = snapshot(clients.get_mut(owner.node.as_str()).unwrap(), user).await.unwrap();
        assert_eq!(at_owner.state, pb::State::Online as i32, "{user} online at its owner {}", owner.node);
        assert_eq!(leases.route_of(user), format!("http://{}", address[owner.node.as_str()]), "{user}");
        for other in nodes.iter().filter(|node| **node != owner.node) {
            // Any node answers a Snapshot of it, asking the owner.
            let through = snapshot(clients.get_mut(other).unwrap(), user).await.unwrap();
            assert_eq!(through, at_owner, "{user} through {other}");
            // A request another node forwarded is answered only by the
            // owner: every other node refuses it, naming the owner and its epoch.
            let refused = forwarded_snapshot(clients.get_mut(other).unwrap(), user).await.unwrap_err();
            assert_eq!(refused.code(), Code::Unavailable, "{user} at {other}: {refused:?}");
            let named = not_owner_of(&refused);
            assert_eq!(named.slot, slot_of(user, SLOTS));
            assert_eq!((named.owner_id.as_str(), named.epoch), (owner.node.as_str(), owner.epoch), "{user}");
            assert_eq!(named.owner_addr, address[owner.node.as_str()].to_string());
        }
    }

    // Renewals and unregisters follow the learned routes, each to its owner.
    let renewals = users
        .iter()
        .map(|user| pb::LeaseItem {
            op: Some(pb::lease_item::Op::Renew(pb::RenewRequest {
                user_id: user.clone(),
                session_id: "s".into(),
                generation: generations[user],
                ttl_ms: 30_000,
                ..Default::default()
            })),
        })
        .collect();
    for (user, result) in users.iter().zip(leases.submit_batch(renewals).await) {
        assert_eq!(result.code, 0, "{user}: {result:?}");
    }
    let half: Vec<&String> = users.iter().step_by(2).collect();
    for user in &half {
        let request = pb::UnregisterRequest {
            user_id: (*user).clone(),
            session_id: "s".into(),
            generation: generations[*user],
            ..Default::default()
        };
        assert!(leases.unregister(request).await.unwrap().changed, "{user}");
    }
    // One Snapshot of every user, from one node: each answered by its owner, in request order.
    let request = pb::SnapshotRequest { user_ids: users.clone(), ..Default::default() };
    let everyone = clients.get_mut("node-b").unwrap().snapshot(request).await.unwrap().into_inner().users;
    assert_eq!(everyone.len(), users.len());
    for (user, presence) in users.iter().zip(&everyone) {
        assert_eq!(&presence.user_id, user);
        let online = presence.state == pb::State::Online as i32;
        assert_eq!(online, !half.contains(&user), "{user}");
        let owner = &map.owner(slot_of(user, SLOTS)).unwrap().node;
        let at_owner = snapshot(clients.get_mut(owner.as_str()).unwrap(), user).await.unwrap();
        assert_eq!(presence, &at_owner, "{user}: the owner's answer, version and all");
    }

    // A4: where notifications go, for every user, from one node. users[1]
    // reports it is active (a renewal item carrying the change, routed to
    // its owner); the others said nothing, or are gone.
    let active = pb::RenewRequest {
        user_id: users[1].clone(),
        session_id: "s".into(),
        generation: generations[&users[1]],
        ttl_ms: 30_000,
        attention: Some(pb::Attention::Active as i32),
        ..Default::default()
    };
    let said = leases.submit_batch(vec![pb::LeaseItem { op: Some(pb::lease_item::Op::Renew(active)) }]).await;
    assert_eq!(said[0].code, 0, "{said:?}");
    let asker = nodes.iter().find(|node| **node != map.owner(slot_of(&users[1], SLOTS)).unwrap().node).unwrap();
    let request = pb::NotifyTargetsRequest { user_ids: users.clone(), ..Default::default() };
    let targets = clients.get_mut(asker).unwrap().notify_targets(request).await.unwrap().into_inner().targets;
    assert_eq!(targets.len(), users.len());
    for (index, (user, target)) in users.iter().zip(&targets).enumerate() {
        assert_eq!(&target.user_id, user, "in request order");
        let expected = match index {
            1 => pb::NotifyReason::AttendedElsewhere,
            _ if half.contains(&user) => pb::NotifyReason::Offline,
            _ => pb::NotifyReason::UnknownFailOpen,
        };
        assert_eq!(target.reason, expected as i32, "{user} asked of {asker}: {target:?}");
    }

    // A unary call to a non-owner is refused too, and changes nothing there.
    let user = &users[1];
    let owner = &map.owner(slot_of(user, SLOTS)).unwrap().node;
    let other = nodes.iter().find(|node| *node != owner).unwrap();
    let register = pb::RegisterRequest {
        user_id: user.clone(),
        session_id: "t".into(),
        gateway_id: "gw".into(),
        ..Default::default()
    };
    let refused = clients.get_mut(other).unwrap().register(register).await.unwrap_err();
    assert_eq!((refused.code(), not_owner_of(&refused).owner_id), (Code::Unavailable, owner.clone()));

    // A planned stop revokes the node's lease: its slots go to the others at
    // once, well before the lease's TTL (2 s) would have expired it.
    let third = servers.pop().unwrap();
    let stopped = Instant::now();
    third.stop().await;
    map_where(&etcd.client().await, "node-c's slots given to the others", |map| map.owned_by("node-c").count() == 0)
        .await;
    let status = cluster_status(&etcd, &["--json"]);
    let listed: Vec<&str> =
        status["nodes"].as_array().unwrap().iter().map(|node| node["id"].as_str().unwrap()).collect();
    assert_eq!(listed, ["node-a", "node-b"], "a node that left is not listed: {status}");
    assert!(
        stopped.elapsed() < Duration::from_millis(1_900),
        "took {:?}: the lease was not revoked",
        stopped.elapsed()
    );
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_a_node_cut_off_from_etcd_that_answers_the_others_stops_acting_before_its_slots_are_taken_over() {
    let etcd = EtcdServer::start().await;
    // node-a reaches etcd through a proxy, which the test turns into a black
    // hole; node-b and node-c reach it directly.
    let upstream: SocketAddr = etcd.endpoint.trim_start_matches("http://").parse().unwrap();
    let proxy = DelayProxy::start("127.0.0.1:0".parse().unwrap(), upstream, Duration::ZERO).await.unwrap();
    let through_proxy = format!("http://{}", proxy.local_addr());
    let mut servers = Vec::new();
    for node in NODES {
        servers.push(
            TestServer::start_with(|addr| {
                let mut config = node_config(&etcd, node, addr);
                if node == "node-a" {
                    config.cluster.as_mut().unwrap().etcd = vec![through_proxy.clone()];
                }
                config
            })
            .await,
        );
    }
    let map = map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    let user = (0..).map(|i| format!("cut-{i}")).find(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-a");
    let user = user.unwrap();
    let slot = slot_of(&user, SLOTS);
    let old_epoch = map.owner(slot).unwrap().epoch;
    let others = ["node-b".to_owned(), "node-c".to_owned()];
    let follower_name = presence_cluster::follower_of(slot, "node-a", &others).unwrap();
    let follower = &servers[NODES.iter().position(|node| *node == follower_name).unwrap()];
    let mut at_a = servers[0].client().await;
    // The map read above is etcd's; node-a, which reads etcd through the
    // proxy, acts on it a moment later (until then its slots have no owner
    // that may act, and it says so): the register is awaited, not assumed.
    let register = pb::RegisterRequest {
        user_id: user.clone(),
        session_id: "s".into(),
        gateway_id: "gw".into(),
        ttl_ms: 30_000,
        ..Default::default()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match at_a.register(register.clone()).await {
            Ok(_) => break,
            Err(refused) if refused.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(refused) => panic!("node-a acts while etcd confirms its lease: {refused:?}"),
        }
    }
    let request = pb::WatchRequest { user_ids: vec![user.clone()], ..Default::default() };
    let mut watch = at_a.watch(request).await.unwrap().into_inner();
    assert!(matches!(next_event(&mut watch).await.unwrap().event, Some(pb::watch_event::Event::Snapshot(_))));
    // The follower has had the copy for a few of the owner's intervals.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let (stop_a, answers_a) = ask_repeatedly(servers[0].url(), user.clone());
    let (stop_follower, answers_follower) = ask_repeatedly(follower.url(), user.clone());
    proxy.set_delay(Duration::from_secs(3_600));
    let cut = Instant::now();
    // node-a's keep-alives go unanswered; the others tell it that etcd
    // answers them, so it stops acting when its lease lapses (TTL 2 s less
    // the margin); etcd expires the lease, and the coordinator gives its
    // slots to their followers, which take them over with their copies.
    let asked = [(stop_a, answers_a), (stop_follower, answers_follower)];
    assert_taken_over_by_one_owner_at_a_time(&etcd, follower, &user, old_epoch, cut, asked).await;
    // node-a's Watch ended when it stopped acting, so that its viewer reopens elsewhere.
    let ended = next_event(&mut watch).await.unwrap_err();
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    // The follower took the session over with its copy.
    let sessions = follower
        .client()
        .await
        .list_sessions(pb::ListSessionsRequest { user_id: user.clone(), ..Default::default() })
        .await
        .unwrap()
        .into_inner()
        .sessions;
    assert_eq!(sessions.len(), 1, "{sessions:?}");

    // node-a reaches etcd again. Its lease is gone, so it joins again under
    // a new one, owning nothing: what it held of its old slots is dropped,
    // and it answers for the user by asking the follower.
    let address = proxy.local_addr();
    drop(proxy);
    let deadline = Instant::now() + PATIENCE;
    let _healed = loop {
        // The old proxy's listener closes as its task ends.
        match DelayProxy::start(address, upstream, Duration::ZERO).await {
            Ok(healed) => break healed,
            Err(_) if Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(error) => panic!("listening on {address} again: {error}"),
        }
    };
    let deadline = Instant::now() + PATIENCE;
    let through_a = loop {
        match snapshot(&mut at_a, &user).await {
            Ok(presence) => break presence,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
            Err(status) => panic!("node-a did not serve again after etcd came back: {status:?}"),
        }
    };
    assert_eq!(through_a.state, pb::State::Online as i32, "{through_a:?}");
    let refused = forwarded_snapshot(&mut at_a, &user).await.unwrap_err();
    assert_eq!(not_owner_of(&refused).owner_id, follower_name, "node-a names the new owner");
    sessions_dropped(&mut at_a).await;
    for server in servers {
        server.stop().await;
    }
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_an_owner_partitioned_from_etcd_and_the_other_nodes_stops_acting_before_its_slots_are_taken_over() {
    // node-a runs in a network namespace of its own, reached over a veth
    // pair: etcd, node-b and node-c listen on the host's end (group 0's
    // address), the test's probe of node-a comes from group 1's. The
    // partition drops every packet between node-a and group 0, both ways.
    let lab = presence_faults::NetLab::new(2).expect("a network namespace (root, ip, nft)");
    let host = lab.group_ip(0);
    let etcd = EtcdServer::start_on(host).await;
    let advertise = format!("{}:{}", lab.server_ip(), daemon::free_port());
    let mut args = node_process_args(&etcd, "node-a", &advertise);
    // Open, on an address other than loopback: the lab's own network.
    args.push("--insecure".to_owned());
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let node_a = daemon::Daemon::start_through(&["ip", "netns", "exec", lab.namespace()], &advertise, &args, &[], None);
    let mut servers = Vec::new();
    for node in &NODES[1..] {
        servers.push(TestServer::start_with_at(host, |addr| node_config(&etcd, node, addr)).await);
    }
    let map = map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    let user =
        (0..).map(|i| format!("parted-{i}")).find(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-a");
    let user = user.unwrap();
    let slot = slot_of(&user, SLOTS);
    let old_epoch = map.owner(slot).unwrap().epoch;
    let others = ["node-b".to_owned(), "node-c".to_owned()];
    let follower_name = presence_cluster::follower_of(slot, "node-a", &others).unwrap();
    let follower = &servers[NODES[1..].iter().position(|node| *node == follower_name).unwrap()];
    let (leases, _) = register_all(follower, std::slice::from_ref(&user)).await;
    assert_eq!(leases.route_of(&user), format!("http://{advertise}"), "registered at node-a");
    // The follower has had the copy for a few of the owner's intervals.
    tokio::time::sleep(Duration::from_millis(500)).await;

    let probe = lab.endpoint(1, probe_port(&advertise));
    let (stop_a, answers_a) = ask_repeatedly_at(probe, user.clone());
    let (stop_follower, answers_follower) = ask_repeatedly(follower.url(), user.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    lab.partition(0).unwrap();
    let cut = Instant::now();
    // node-a hears neither etcd nor the other nodes: it cannot tell an etcd
    // outage from its own cut, so it stops at its lease's end; etcd expires
    // the lease and the follower takes the slot over from its copy.
    let asked = [(stop_a, answers_a), (stop_follower, answers_follower)];
    assert_taken_over_by_one_owner_at_a_time(&etcd, follower, &user, old_epoch, cut, asked).await;

    // The partition heals: node-a joins again, drops what it held and names the new owner.
    lab.heal(0).unwrap();
    let mut at_a = PresenceClient::new(lab.endpoint(0, probe_port(&advertise)).connect().await.unwrap());
    let deadline = Instant::now() + PATIENCE;
    loop {
        match forwarded_snapshot(&mut at_a, &user).await {
            Err(refused) if not_owner_of(&refused).owner_id == follower_name => break,
            other => assert!(Instant::now() < deadline, "node-a after the partition: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    sessions_dropped(&mut at_a).await;
    node_a.stop().await;
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_watch_at_one_node_carries_the_changes_of_users_on_every_node_and_ends_when_a_part_does() {
    let etcd = EtcdServer::start().await;
    let (mut servers, map) = three_nodes(&etcd).await;
    let users: Vec<String> = (0..30).map(|i| format!("watched-{i}")).collect();
    let owner_of = |user: &str| map.owner(slot_of(user, SLOTS)).unwrap().node.clone();
    assert!(NODES.iter().all(|node| users.iter().any(|user| owner_of(user) == *node)), "users on every node");

    let mut viewer = servers[0].client().await;
    let request = pb::WatchRequest { user_ids: users.clone(), ..Default::default() };
    let mut stream = viewer.watch(request).await.unwrap().into_inner();
    let Some(pb::watch_event::Event::Snapshot(opening)) = next_event(&mut stream).await.unwrap().event else {
        panic!("a watch opens with a snapshot")
    };
    let mut opened: Vec<&str> = opening.users.iter().map(|user| user.user_id.as_str()).collect();
    opened.sort_unstable();
    let mut expected: Vec<&str> = users.iter().map(String::as_str).collect();
    expected.sort_unstable();
    assert_eq!(opened, expected, "one opening snapshot of every watched user, wherever it lives");
    assert!(opening.users.iter().all(|user| user.state == pb::State::Offline as i32 && user.version == 0));

    // Every user goes ONLINE at its owner: the one stream carries each change.
    let leases = ClusterLeases::new(&servers[1].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    let results = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
    assert!(results.iter().all(|result| result.code == 0), "{results:?}");
    let mut online: HashMap<String, u64> = HashMap::new();
    while online.len() < users.len() {
        match next_event(&mut stream).await.unwrap().event {
            Some(pb::watch_event::Event::Update(update)) => {
                assert_eq!(update.state, pb::State::Online as i32, "{update:?}");
                assert!(online.insert(update.user_id.clone(), update.version).is_none(), "one flip each: {update:?}");
            }
            other => panic!("only updates after the opening: {other:?}"),
        }
    }
    // The versions are the owners' own.
    let mut at_owners = Vec::new();
    for user in &users {
        let index = NODES.iter().position(|node| *node == owner_of(user)).unwrap();
        at_owners.push(forwarded_snapshot(&mut servers[index].client().await, user).await.unwrap());
    }
    for presence in at_owners {
        assert_eq!(online[&presence.user_id], presence.version, "{}", presence.user_id);
    }

    // A revoke at one owner reaches the stream as that user's OFFLINE.
    let gone = users.iter().find(|user| owner_of(user) == "node-c").unwrap();
    let revoke = pb::RevokeRequest { user_id: gone.clone(), ..Default::default() };
    let index = NODES.iter().position(|node| *node == "node-c").unwrap();
    servers[index].client().await.revoke(revoke).await.unwrap();
    match next_event(&mut stream).await.unwrap().event {
        Some(pb::watch_event::Event::Update(update)) => {
            assert_eq!((&update.user_id, update.state), (gone, pb::State::Offline as i32));
            assert!(update.version > online[gone], "newer than the ONLINE it follows");
        }
        other => panic!("the revoked user's OFFLINE: {other:?}"),
    }

    // The owner of a part stops: the merged stream ends UNAVAILABLE, for the viewer to reopen.
    servers.remove(index).stop().await;
    updates_until_unavailable(&mut stream).await;
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_merged_watch_ends_when_a_part_resyncs_since_its_snapshot_holds_that_part_only() {
    let etcd = EtcdServer::start().await;
    // A mailbox of 4 users at most: a viewer that falls behind is resynced (E4).
    let (servers, map) = three_nodes_with(&etcd, || ServerConfig { watch_buffer: 4, ..fast_config() }, true).await;
    let users: Vec<String> = (0..40).map(|i| format!("busy-{i}")).collect();
    let owned_by =
        |node: &str| users.iter().filter(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == node).count();
    assert!(NODES.iter().all(|node| owned_by(node) > 4), "more busy users on every node than its mailbox holds");

    let mut viewer = servers[0].client().await;
    let request = pb::WatchRequest { user_ids: users.clone(), ..Default::default() };
    let mut stream = viewer.watch(request).await.unwrap().into_inner();
    assert!(matches!(next_event(&mut stream).await.unwrap().event, Some(pb::watch_event::Event::Snapshot(_))));

    // The viewer reads nothing while every user flips again and again: the
    // merged stream's buffer fills, then each part's, then the owners' mailboxes.
    let leases = ClusterLeases::new(&servers[1].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    for _ in 0..150 {
        let registered = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
        let unregisters = users
            .iter()
            .zip(&registered)
            .map(|(user, result)| {
                let Some(pb::lease_result::Result::Register(registered)) = &result.result else { panic!("{result:?}") };
                pb::LeaseItem {
                    op: Some(pb::lease_item::Op::Unregister(pb::UnregisterRequest {
                        user_id: user.clone(),
                        session_id: "s".into(),
                        generation: registered.generation,
                        ..Default::default()
                    })),
                }
            })
            .collect();
        let unregistered = leases.submit_batch(unregisters).await;
        assert!(unregistered.iter().all(|result| result.code == 0), "{unregistered:?}");
    }
    // Reading now: updates, then the end, UNAVAILABLE (never a part's snapshot passed on as the whole watch's).
    let ended = updates_until_unavailable(&mut stream).await;
    assert!(ended.message().contains("resynced"), "{ended:?}");
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_read_forwarded_to_an_owner_that_never_answers_fails_in_time_naming_it() {
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes(&etcd).await;
    // An "owner" that accepts connections and says nothing, given one slot.
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let silent_addr = silent.local_addr().unwrap();
    let _accepting = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket);
        }
    });
    let client = etcd.client().await;
    let lease =
        presence_cluster::NodeLease::grant(&client, Duration::from_secs(5), Duration::from_millis(500)).await.unwrap();
    presence_cluster::register_node(&client, PREFIX, "silent", &silent_addr.to_string(), lease.id()).await.unwrap();
    let user = "held-by-silence";
    let slot = slot_of(user, SLOTS);
    let seen = map.owner(slot).unwrap().epoch;
    let claimed = presence_cluster::claim_slot(&client, PREFIX, slot, "silent", seen).await.unwrap();
    assert!(matches!(claimed, presence_cluster::Claim::Won { .. }), "{claimed:?}");
    map_where(&client, "the map names the silent owner", |map| map.owner(slot).unwrap().node == "silent").await;

    let mut viewer = servers[0].client().await;
    let started = Instant::now();
    let request = pb::SnapshotRequest { user_ids: vec![user.into(), "someone-else".into()], ..Default::default() };
    let failed = viewer.snapshot(request).await.unwrap_err();
    assert_eq!(failed.code(), Code::DeadlineExceeded, "{failed:?}");
    assert!(failed.message().contains(&silent_addr.to_string()), "the node is named: {failed:?}");
    assert!(started.elapsed() < Duration::from_secs(8), "within the forwarding timeout: {:?}", started.elapsed());
    let request = pb::WatchRequest { user_ids: vec![user.into()], ..Default::default() };
    let failed = viewer.watch(request).await.unwrap_err();
    assert_eq!(failed.code(), Code::DeadlineExceeded, "{failed:?}");
    // Gone before the nodes stop, so that their drains do not wait on it.
    lease.revoke().await.unwrap();
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_client_following_etcd_routes_to_every_owner_before_any_refusal_and_learns_a_move_from_etcd() {
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let address: HashMap<&str, String> = NODES.iter().copied().zip(servers.iter().map(|s| s.url())).collect();
    let leases = ClusterLeases::new(&servers[0].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    leases.follow_etcd(std::slice::from_ref(&etcd.endpoint), PREFIX).await.unwrap();
    assert_eq!(leases.known_slots(), SLOTS as usize, "every owner known from etcd, before any batch");
    let users: Vec<String> = (0..200).map(|i| format!("follower-{i}")).collect();
    for user in &users {
        let owner = map.owner(slot_of(user, SLOTS)).unwrap();
        assert_eq!(leases.route_of(user), address[owner.node.as_str()], "{user}");
    }
    let results = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
    assert!(results.iter().all(|result| result.code == 0), "{results:?}");

    // A move is learned from etcd, with no item sent meanwhile.
    let slot = map.owned_by("node-a").next().unwrap();
    let user = (0..).map(|i| format!("moved-{i}")).find(|user| slot_of(user, SLOTS) == slot).unwrap();
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    at_a.move_slots(pb::MoveSlotsRequest { slots: vec![slot], to_node: "node-b".into() }).await.unwrap();
    let deadline = Instant::now() + PATIENCE;
    while leases.route_of(&user) != address["node-b"] {
        assert!(Instant::now() < deadline, "the move reached the client within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    // No etcd to follow is a clear error naming where it was looked for.
    let alone = ClusterLeases::new(&servers[0].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    let error = alone.follow_etcd(&["http://127.0.0.1:1".to_owned()], PREFIX).await.unwrap_err();
    assert!(error.to_string().contains("etcd at http://127.0.0.1:1"), "{error}");
    assert_eq!(alone.known_slots(), 0);
    for server in servers {
        server.stop().await;
    }
}

/// C2, B5: a node relays to an owner more viewers' watches than one
/// connection between them allows: every Watch and WatchRoom opens with its
/// snapshot, carries the owner's changes, and a forwarded read still answers
/// beside them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_node_relays_more_watches_to_an_owner_than_one_connection_between_them_carries() {
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes_with(&etcd, few_streams_config, false).await;
    let at_b = |id: &String| map.owner(slot_of(id, SLOTS)).unwrap().node == "node-b";
    let user = (0..).map(|i| format!("watched-{i}")).find(at_b).unwrap();
    let room = (0..).map(|i| format!("room-{i}")).find(at_b).unwrap();
    // 24 of each from node-a, 8 streams a viewer connection: 48 streams
    // node-a keeps open at node-b, three times what a connection allows.
    let (mut watches, mut room_watches) = (Vec::new(), Vec::new());
    for _ in 0..6 {
        let mut viewer = servers[0].client().await;
        for _ in 0..4 {
            let request = pb::WatchRequest { user_ids: vec![user.clone()], ..Default::default() };
            let mut stream = viewer.watch(request).await.expect("a Watch forwarded to node-b").into_inner();
            let opening = next_event(&mut stream).await.expect("an opening snapshot");
            assert!(matches!(opening.event, Some(pb::watch_event::Event::Snapshot(_))), "{opening:?}");
            watches.push(stream);
            let request = pb::WatchRoomRequest {
                room_id: room.clone(),
                mode: pb::RoomWatchMode::RoomWatchMembers as i32,
                ..Default::default()
            };
            let mut stream = viewer.watch_room(request).await.expect("a WatchRoom forwarded to node-b").into_inner();
            let opening = tokio::time::timeout(PATIENCE, stream.message()).await.expect("in time").unwrap().unwrap();
            assert!(matches!(opening.event, Some(pb::room_event::Event::Snapshot(_))), "{opening:?}");
            room_watches.push(stream);
        }
    }
    assert_eq!((watches.len(), room_watches.len()), (24, 24));
    let mut viewer = servers[0].client().await;
    assert_eq!(snapshot(&mut viewer, &user).await.unwrap().state, pb::State::Offline as i32);

    // The user goes ONLINE and joins the room at node-b: every stream carries it.
    let mut owner = servers[1].client().await;
    let Some(pb::lease_item::Op::Register(request)) = register(&user).op else { unreachable!() };
    let generation = owner.register(request).await.unwrap().into_inner().generation;
    let join = pb::JoinRequest {
        user_id: user.clone(),
        session_id: "s".into(),
        generation,
        room_id: room.clone(),
        ..Default::default()
    };
    owner.join(join).await.unwrap();
    for stream in &mut watches {
        let update = next_event(stream).await.expect("the user's flip");
        assert!(
            matches!(&update.event, Some(pb::watch_event::Event::Update(u)) if u.state == pb::State::Online as i32),
            "{update:?}"
        );
    }
    for stream in &mut room_watches {
        let change = tokio::time::timeout(PATIENCE, stream.message()).await.expect("in time").unwrap().unwrap();
        assert!(matches!(change.event, Some(pb::room_event::Event::Change(_))), "{change:?}");
    }
    for server in servers {
        server.stop().await;
    }
}

/// Waits until the node behind `client` holds no session: a node that acts
/// on a map giving its slots away drops their users after, off its runtime
/// at a lower priority (H1), so a moment after it first names the new owner.
async fn sessions_dropped(client: &mut PresenceClient<Channel>) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let stats = client.stats(pb::StatsRequest::default()).await.unwrap().into_inner();
        if stats.sessions == 0 {
            return;
        }
        assert!(Instant::now() < deadline, "node-a did not drop the sessions of the slots given away: {stats:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
