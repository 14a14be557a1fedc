//! E5 and C2 through a cluster: viewers at one node share one relay of each
//! other node's users, and see what the users' owner would show them (P2–P4).

use super::*;

async fn stats(server: &TestServer) -> pb::StatsResponse {
    server.client().await.stats(pb::StatsRequest::default()).await.unwrap().into_inner()
}

fn watch_as(viewer: &str, users: &[String]) -> pb::WatchRequest {
    pb::WatchRequest { user_ids: users.to_vec(), viewer_id: viewer.into(), ..Default::default() }
}

/// The opening snapshot of a watch, by user.
async fn opening(stream: &mut tonic::Streaming<pb::WatchEvent>) -> HashMap<String, pb::UserPresence> {
    match next_event(stream).await.unwrap().event {
        Some(pb::watch_event::Event::Snapshot(snapshot)) => {
            snapshot.users.into_iter().map(|user| (user.user_id.clone(), user)).collect()
        }
        other => panic!("a watch opens with a snapshot: {other:?}"),
    }
}

/// The next update of a watch.
async fn update(stream: &mut tonic::Streaming<pb::WatchEvent>) -> pb::UserPresence {
    match next_event(stream).await.unwrap().event {
        Some(pb::watch_event::Event::Update(update)) => update,
        other => panic!("an update: {other:?}"),
    }
}

/// Whether a watch stays quiet for a while.
async fn quiet(stream: &mut tonic::Streaming<pb::WatchEvent>) -> bool {
    tokio::time::timeout(Duration::from_millis(300), stream.message()).await.is_err()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_viewers_at_one_node_share_one_relay_of_each_owner_and_see_what_the_owner_would_show_them() {
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes(&etcd).await;
    let owned_by = |node: &'static str| {
        let map = map.clone();
        move |user: &String| map.owner(slot_of(user, SLOTS)).unwrap().node == node
    };
    let at_b: Vec<String> = (0..).map(|i| format!("relayed-{i}")).filter(owned_by("node-b")).take(10).collect();
    let at_a: Vec<String> = (0..).map(|i| format!("local-{i}")).filter(owned_by("node-a")).take(2).collect();
    let (everyone, contact, invisible) = (&at_b[..8], &at_b[8], &at_b[9]);
    let mut owner = servers[1].client().await;
    for user in at_b.iter().chain(&at_a) {
        let visibility = match user {
            user if user == contact => pb::Visibility::Audience,
            user if user == invisible => pb::Visibility::Nobody,
            _ => pb::Visibility::Everyone,
        };
        let request =
            pb::SetVisibilityRequest { user_id: user.clone(), visibility: visibility as i32, ..Default::default() };
        let index = if at_a.contains(user) { 0 } else { 1 };
        servers[index].client().await.set_visibility(request).await.unwrap();
    }
    let grant = pb::AudienceRequest { user_id: contact.clone(), viewer_ids: vec!["viewer-0".into()] };
    owner.grant_audience(grant).await.unwrap();
    let watched: Vec<String> = at_b.iter().chain(&at_a).cloned().collect();
    let (_leases, generations) = register_all(&servers[1], &watched).await;

    // Twenty viewers at node-a, each watching node-b's ten users and two of node-a's.
    let mut viewer_client = servers[0].client().await;
    let mut streams = Vec::new();
    for i in 0..20 {
        let mut stream = viewer_client.watch(watch_as(&format!("viewer-{i}"), &watched)).await.unwrap().into_inner();
        let shown = opening(&mut stream).await;
        assert_eq!(shown.len(), watched.len(), "every watched user in the opening snapshot");
        for user in everyone.iter().chain(&at_a) {
            let seen = &shown[user];
            assert!(seen.state == pb::State::Online as i32 && seen.version > 0, "viewer-{i} sees {user}: {seen:?}");
        }
        assert_eq!(shown[contact].version > 0, i == 0, "only viewer-0 is granted: {:?}", shown[contact]);
        assert_eq!(shown[invisible].version, 0, "nobody sees an invisible user, as a user never seen");
        streams.push(stream);
    }
    // One relay, however many viewers: the owner keeps no stream per viewer.
    let (at_node_a, at_node_b) = (stats(&servers[0]).await, stats(&servers[1]).await);
    assert_eq!((at_node_a.relay_links, at_node_a.relayed_users), (1, 10), "{at_node_a:?}");
    assert_eq!((at_node_b.relay_sessions, at_node_b.viewers), (1, 0), "{at_node_b:?}");

    // A flip at the owner reaches every viewer once, with the owner's version.
    let (user, generation) = generations.iter().find(|(user, _)| user == &everyone[0]).unwrap();
    let request = pb::UnregisterRequest {
        user_id: user.clone(),
        session_id: "s".into(),
        generation: *generation,
        ..Default::default()
    };
    owner.unregister(request).await.unwrap();
    let at_owner = forwarded_snapshot(&mut owner, user).await.unwrap();
    for stream in &mut streams {
        let flipped = update(stream).await;
        assert_eq!((&flipped.user_id, flipped.state), (user, pb::State::Offline as i32));
        assert_eq!(flipped.version, at_owner.version, "the owner's version");
    }

    // A revoke at the owner hides the contact from viewer-0 alone, with a new version.
    let shown_before = at_owner_version(&mut owner, contact).await;
    let revoke = pb::AudienceRequest { user_id: contact.clone(), viewer_ids: vec!["viewer-0".into()] };
    owner.revoke_audience(revoke).await.unwrap();
    let hidden = update(&mut streams[0]).await;
    assert_eq!((&hidden.user_id, hidden.state), (contact, pb::State::Offline as i32), "{hidden:?}");
    assert!(hidden.version > shown_before, "a version above the one shown: {hidden:?}");
    // A grant reveals it to viewer-1, as it is.
    let grant = pb::AudienceRequest { user_id: contact.clone(), viewer_ids: vec!["viewer-1".into()] };
    owner.grant_audience(grant).await.unwrap();
    let revealed = update(&mut streams[1]).await;
    assert_eq!((&revealed.user_id, revealed.state), (contact, pb::State::Online as i32), "{revealed:?}");
    assert!(revealed.version > hidden.version, "{revealed:?}");
    for stream in &mut streams[2..] {
        assert!(quiet(stream).await, "nothing changed for the other viewers");
    }
    // Hidden from viewer-0, the contact's changes no longer reach it.
    let (_, contact_generation) = generations.iter().find(|(user, _)| user == contact).unwrap();
    let request = pb::UnregisterRequest {
        user_id: contact.clone(),
        session_id: "s".into(),
        generation: *contact_generation,
        ..Default::default()
    };
    owner.unregister(request).await.unwrap();
    let offline = update(&mut streams[1]).await;
    assert_eq!((&offline.user_id, offline.state), (contact, pb::State::Offline as i32));
    assert!(quiet(&mut streams[0]).await, "viewer-0 may no longer see the contact change");

    // Viewers gone, the relay stops carrying their users.
    drop(streams);
    let deadline = Instant::now() + PATIENCE;
    while stats(&servers[0]).await.relayed_users > 0 {
        assert!(Instant::now() < deadline, "node-a stopped relaying unwatched users within {PATIENCE:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for server in servers {
        server.stop().await;
    }
}

async fn at_owner_version(owner: &mut PresenceClient<Channel>, user: &str) -> u64 {
    forwarded_snapshot(owner, user).await.unwrap().version
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c2_a_relayed_users_slot_moving_ends_the_merged_watch_and_the_reopened_one_follows_the_new_owner() {
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes(&etcd).await;
    let at = |node: &'static str| {
        let map = map.clone();
        move |user: &String| map.owner(slot_of(user, SLOTS)).unwrap().node == node
    };
    let moving = (0..).map(|i| format!("moving-{i}")).find(at("node-b")).unwrap();
    let staying = (0..).map(|i| format!("staying-{i}")).find(at("node-c")).unwrap();
    let watched = vec![moving.clone(), staying.clone()];
    let (leases, generations) = register_all(&servers[1], &watched).await;
    let mut viewer = servers[0].client().await;
    let mut stream = viewer.watch(watch_as("", &watched)).await.unwrap().into_inner();
    let before = opening(&mut stream).await;
    assert!(watched.iter().all(|user| before[user].state == pb::State::Online as i32), "{before:?}");

    // The moving user's slot goes from node-b to node-c: node-a's relay of it
    // from node-b can no longer hear it, so the merged stream ends, saying so.
    let slot = slot_of(&moving, SLOTS);
    let mut at_b = presence_proto::v1::cluster_client::ClusterClient::connect(servers[1].url()).await.unwrap();
    at_b.move_slots(pb::MoveSlotsRequest { slots: vec![slot], to_node: "node-c".into() }).await.unwrap();
    map_where(&etcd.client().await, "the slot at node-c", |map| map.owner(slot).unwrap().node == "node-c").await;
    let ended = updates_until_unavailable(&mut stream).await;
    assert!(ended.message().contains("moved"), "{ended:?}");

    // Reopened at node-a: the same versions (nobody flipped), and the new owner's flips.
    let mut stream = viewer.watch(watch_as("", &watched)).await.unwrap().into_inner();
    let after = opening(&mut stream).await;
    for user in &watched {
        assert_eq!((after[user].state, after[user].version), (before[user].state, before[user].version), "{user}");
    }
    let (_, generation) = generations.iter().find(|(user, _)| *user == moving).unwrap();
    let unregister = pb::LeaseItem {
        op: Some(pb::lease_item::Op::Unregister(pb::UnregisterRequest {
            user_id: moving.clone(),
            session_id: "s".into(),
            generation: *generation,
            ..Default::default()
        })),
    };
    let results = leases.submit_batch(vec![unregister]).await;
    assert_eq!(results[0].code, 0, "{results:?}");
    let flipped = update(&mut stream).await;
    assert_eq!((&flipped.user_id, flipped.state), (&moving, pb::State::Offline as i32));
    assert!(flipped.version > before[&moving].version, "{flipped:?}");
    let at_node_a = stats(&servers[0]).await;
    assert_eq!(at_node_a.relayed_users, 2, "both users relayed again, from node-c: {at_node_a:?}");
    for server in servers {
        server.stop().await;
    }
}

/// E5's fallback: an owner of a build from before the relay answers
/// `Cluster/Relay` `UNIMPLEMENTED`; the node the viewers are at then forwards
/// their watches of its users to it viewer by viewer, as before the relay,
/// and they see what the owner would show them, opening snapshot and updates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e5_viewers_of_an_owner_that_relays_nothing_are_watched_there_one_by_one() {
    let etcd = EtcdServer::start().await;
    let mut servers = Vec::new();
    for node in NODES {
        servers.push(
            TestServer::start_with(|addr| {
                let mut config = node_config(&etcd, node, addr);
                // node-b is of a build from before the relay.
                config.cluster.as_mut().expect("a cluster node").serves_relay = node != "node-b";
                config
            })
            .await,
        );
    }
    let map = map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    let at_b: Vec<String> = (0..)
        .map(|i| format!("older-{i}"))
        .filter(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-b")
        .take(3)
        .collect();
    for user in &at_b {
        let everyone = pb::Visibility::Everyone as i32;
        let request = pb::SetVisibilityRequest { user_id: user.clone(), visibility: everyone, ..Default::default() };
        servers[1].client().await.set_visibility(request).await.unwrap();
    }
    let (_leases, generations) = register_all(&servers[1], &at_b).await;
    let mut viewer_client = servers[0].client().await;
    let mut streams = Vec::new();
    for i in 0..2 {
        let mut stream = viewer_client.watch(watch_as(&format!("viewer-{i}"), &at_b)).await.unwrap().into_inner();
        let shown = opening(&mut stream).await;
        for user in &at_b {
            let seen = &shown[user];
            assert!(seen.state == pb::State::Online as i32 && seen.version > 0, "viewer-{i} sees {user}: {seen:?}");
        }
        streams.push(stream);
    }
    // Nothing is relayed; node-b serves each viewer's watch itself.
    let (at_node_a, at_node_b) = (stats(&servers[0]).await, stats(&servers[1]).await);
    assert_eq!(at_node_a.relayed_users, 0, "{at_node_a:?}");
    assert_eq!(at_node_b.relay_sessions, 0, "{at_node_b:?}");
    assert!(at_node_b.viewers >= 2, "a watch per viewer at the owner: {at_node_b:?}");

    let (user, generation) = &generations[0];
    let request = pb::UnregisterRequest {
        user_id: user.clone(),
        session_id: "s".into(),
        generation: *generation,
        ..Default::default()
    };
    let mut owner = servers[1].client().await;
    owner.unregister(request).await.unwrap();
    let at_owner = forwarded_snapshot(&mut owner, user).await.unwrap();
    for stream in &mut streams {
        let flipped = update(stream).await;
        assert_eq!((&flipped.user_id, flipped.state), (user, pb::State::Offline as i32));
        assert_eq!(flipped.version, at_owner.version, "the owner's version");
    }
    for server in servers {
        server.stop().await;
    }
}
