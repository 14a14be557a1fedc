//! P4 across nodes: group memberships held by every node, and caught up.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_group_memberships_written_at_any_node_hold_at_every_node_and_a_node_that_joins_later_catches_up() {
    let etcd = EtcdServer::start().await;
    let mut servers = Vec::new();
    for node in &NODES[..2] {
        servers.push(TestServer::start_with(|addr| node_config(&etcd, node, addr)).await);
    }
    let client = etcd.client().await;
    let map = map_where(&client, "node-a and node-b share the slots", |map| {
        NODES[..2].iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    // Users shown to their audience only, online, spread over both nodes.
    let users: Vec<String> = (0..60).map(|i| format!("member-{i}")).collect();
    let (_leases, _) = register_all(&servers[0], &users).await;
    let owner_index = |map: &presence_cluster::SlotMap, user: &str| {
        let owner = map.owner(slot_of(user, SLOTS)).unwrap().node.clone();
        NODES.iter().position(|node| *node == owner).unwrap()
    };
    for user in &users {
        let request = pb::SetVisibilityRequest {
            user_id: user.clone(),
            visibility: pb::Visibility::Audience as i32,
            ..Default::default()
        };
        servers[owner_index(&map, user)].client().await.set_visibility(request).await.unwrap();
    }
    let ann = users.iter().find(|user| owner_index(&map, user) == 0).unwrap().clone();
    let (mut at_a, mut at_b) = (servers[0].client().await, servers[1].client().await);

    // bob watches ann (owned by node-a) through node-b: hidden, so offline.
    let watch = pb::WatchRequest { user_ids: vec![ann.clone()], viewer_id: "bob".into(), ..Default::default() };
    let mut stream = at_b.watch(watch).await.unwrap().into_inner();
    let Some(pb::watch_event::Event::Snapshot(first)) = next_event(&mut stream).await.unwrap().event else {
        panic!("a watch opens with a snapshot")
    };
    assert_eq!(first.users[0].state, pb::State::Offline as i32, "hidden from bob: {first:?}");

    // Joined at node-b, a node that owns neither: node-a shows ann to bob
    // as soon as the call returns, and bob's open stream shows her online.
    at_b.join_group(group("team", &[&ann, "bob"])).await.unwrap();
    assert!(sees_online(&mut at_a, "bob", &ann).await, "node-a took the join before the call returned");
    let update = next_event(&mut stream).await.unwrap();
    let Some(pb::watch_event::Event::Update(shown)) = update.event else { panic!("an update: {update:?}") };
    assert_eq!((shown.user_id.as_str(), shown.state), (ann.as_str(), pb::State::Online as i32));

    // Left at node-a, another node than the join's: hidden again at once, everywhere.
    at_a.leave_group(group("team", &["bob"])).await.unwrap();
    for client in [&mut at_a, &mut at_b] {
        assert!(!sees_online(client, "bob", &ann).await, "bob left the group");
    }
    let update = next_event(&mut stream).await.unwrap();
    let Some(pb::watch_event::Event::Update(hidden)) = update.event else { panic!("an update: {update:?}") };
    assert_eq!((hidden.user_id.as_str(), hidden.state), (ann.as_str(), pb::State::Offline as i32));
    assert!(hidden.version > shown.version, "versions never go back (M4)");

    // Joins and leaves of the same pairs at both nodes at once end the same at both.
    let mut racing = tokio::task::JoinSet::new();
    for i in 0..20 {
        let (mut at_a, mut at_b) = (at_a.clone(), at_b.clone());
        racing.spawn(async move {
            let (user, crew) = (format!("member-{i}"), format!("crew-{}", i % 3));
            let (joined, left) = tokio::join!(
                at_a.join_group(group(&crew, &[&user, "dave"])),
                at_b.leave_group(group(&crew, &[&user])),
            );
            joined.unwrap();
            left.unwrap();
        });
    }
    while let Some(raced) = racing.join_next().await {
        raced.unwrap();
    }

    // All the users and dave in "crowd", before node-c exists.
    let everyone: Vec<&str> = users.iter().map(String::as_str).chain(["dave"]).collect();
    at_a.join_group(group("crowd", &everyone)).await.unwrap();
    let ledger = group_ledger(&servers[0]).await;
    assert_eq!(group_ledger(&servers[1]).await, ledger, "node-a and node-b hold the same ledger");
    assert!(ledger.iter().any(|(group, _, _, member)| group == "team" && !member), "the leave is kept as an entry");

    // node-c joins and is given slots with their users: it catches up with
    // the ledger, so it shows its users to dave (crowd) and not to erin.
    servers.push(TestServer::start_with(|addr| node_config(&etcd, "node-c", addr)).await);
    let map = map_where(&client, "node-c owns its share", |map| map.owned_by("node-c").count() >= 20).await;
    let deadline = Instant::now() + PATIENCE;
    while group_ledger(&servers[2]).await != ledger {
        assert!(Instant::now() < deadline, "node-c caught up with the ledger within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let mut at_c = servers[2].client().await;
    let on_c: Vec<&String> = users.iter().filter(|user| owner_index(&map, user) == 2).collect();
    assert!(on_c.len() >= 5, "node-c owns {} of the users", on_c.len());
    for user in on_c {
        assert!(sees_online(&mut at_c, "dave", user).await, "{user} is in dave's crowd");
        assert!(!sees_online(&mut at_c, "erin", user).await, "{user} shares no group with erin");
    }
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p4_a_node_back_on_its_data_directory_after_missing_a_leave_takes_the_leave_and_nobody_brings_it_back() {
    let etcd = EtcdServer::start().await;
    let dir = daemon::scratch_dir("cluster-groups");
    let with_disk = |addr| ServerConfig { data_dir: Some(dir.clone()), ..node_config(&etcd, "node-a", addr) };
    let mut servers = vec![TestServer::start_with(with_disk).await];
    for node in &NODES[1..] {
        servers.push(TestServer::start_with(|addr| node_config(&etcd, node, addr)).await);
    }
    let client = etcd.client().await;
    let map =
        map_where(&client, "every node owns slots", |map| NODES.iter().all(|node| map.owned_by(node).count() > 0))
            .await;
    // ann, online and shown to her audience only, owned by node-b or node-c.
    let ann = (0..)
        .map(|i| format!("ann-{i}"))
        .find(|user| map.owner(slot_of(user, SLOTS)).unwrap().node != "node-a")
        .unwrap();
    let (_leases, _) = register_all(&servers[1], std::slice::from_ref(&ann)).await;
    let visibility = pb::SetVisibilityRequest {
        user_id: ann.clone(),
        visibility: pb::Visibility::Audience as i32,
        ..Default::default()
    };
    let owner = NODES.iter().position(|node| *node == map.owner(slot_of(&ann, SLOTS)).unwrap().node).unwrap();
    servers[owner].client().await.set_visibility(visibility).await.unwrap();
    let mut at_b = servers[1].client().await;
    at_b.join_group(group("team", &[&ann, "bob"])).await.unwrap();
    assert!(group_ledger(&servers[0]).await.iter().any(|(_, user, _, member)| user == "bob" && *member));

    // node-a stops with bob a member on its disk; bob leaves while it is away.
    let addr = servers[0].addr;
    servers.remove(0).stop().await;
    at_b.leave_group(group("team", &["bob"])).await.unwrap();
    assert!(!sees_online(&mut at_b, "bob", &ann).await, "bob left the group");

    // Back on its data directory, node-a catches up with the leave: every
    // node ends with the same ledger, bob a member at none of them.
    servers.insert(0, TestServer::start_on(addr, with_disk(addr)).await);
    let deadline = Instant::now() + PATIENCE;
    loop {
        let ledgers =
            [group_ledger(&servers[0]).await, group_ledger(&servers[1]).await, group_ledger(&servers[2]).await];
        if ledgers.iter().all(|ledger| *ledger == ledgers[0]) {
            let bob: Vec<_> = ledgers[0].iter().filter(|(_, user, _, _)| user == "bob").collect();
            assert!(bob.len() == 1 && !bob[0].3, "bob's leave is the entry every node keeps: {bob:?}");
            break;
        }
        assert!(Instant::now() < deadline, "the nodes' ledgers agree within {PATIENCE:?}: {ledgers:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Two catch-up rounds later (one every 5 s), still nobody shows ann to bob.
    tokio::time::sleep(Duration::from_secs(10)).await;
    for server in &servers {
        assert!(!sees_online(&mut server.client().await, "bob", &ann).await, "bob left the group, at {}", server.addr);
    }
    for server in servers {
        server.stop().await;
    }
}
