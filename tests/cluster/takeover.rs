//! C4: a dead node's slots taken over by their followers with their copies.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_a_node_killed_with_kill_9_is_taken_over_by_its_followers_and_nobody_flips() {
    let etcd = EtcdServer::start().await;
    // node-a is a process of its own, to be killed; node-b and node-c run here.
    // The restart grace, for which a follower holds what it takes over, as
    // long as the default TTL in production; here well past the time the
    // gateway's client takes to find the new owners.
    let (node_a, servers, map) = node_a_apart(&etcd, Duration::from_secs(5)).await;
    let users: Vec<String> = (0..600).map(|i| format!("survivor-{i}")).collect();
    let (leases, generations) = register_all(&servers[1], &users).await;
    let on_a: Vec<&String> =
        users.iter().filter(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-a").collect();
    assert!(on_a.len() > 100, "node-a owns {} of the users", on_a.len());
    // One of node-a's users shows a status to its audience only.
    let private = on_a[0].clone();
    show_lunch_to_friend_only(&mut PresenceClient::connect(node_a.url()).await.unwrap(), &private).await;
    let touched = touch_and_set_locale(&mut PresenceClient::connect(node_a.url()).await.unwrap(), &private).await;
    let mut viewer = servers[1].client().await;
    let before = presences(&mut viewer, &users).await;
    assert!(before.values().all(|presence| presence.state == pb::State::Online as i32));

    let (stop_watching, watcher) = watch_through_failures(servers[1].url(), users.clone());
    let (stop_renewing, renewer) = keep_renewing_by_round(std::sync::Arc::clone(&leases), generations.clone(), 1_500);
    // The followers' copies are at most an interval behind; give them a few.
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let killed = Instant::now();
    node_a.kill9();
    let taken =
        map_where(&etcd.client().await, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
    let takeover = killed.elapsed();
    assert!(takeover <= Duration::from_secs(3), "taken over within the lease TTL (2 s) + 1 s: {takeover:?}");
    // Each slot went to its follower, which had the copy.
    let live = vec!["node-b".to_owned(), "node-c".to_owned()];
    for slot in map.owned_by("node-a") {
        assert_eq!(
            Some(taken.owner(slot).unwrap().node.as_str()),
            presence_cluster::follower_of(slot, "node-a", &live),
            "slot {slot}"
        );
    }
    // Renewals carry on at the new owners, with the generations the gateway holds.
    let answering = Instant::now();
    tokio::time::sleep(Duration::from_millis(2_000)).await;
    let _ = stop_renewing.send(());
    let rounds = renewer.await.unwrap();
    let late: Vec<&String> = rounds
        .iter()
        .filter(|(started, _)| *started > answering + Duration::from_millis(500))
        .flat_map(|(_, failed)| failed)
        .collect();
    assert!(rounds.iter().filter(|(started, _)| *started > answering).count() >= 3, "{} rounds", rounds.len());
    assert!(
        late.is_empty(),
        "every renewal after the takeover succeeded: {} failed, first {:?}",
        late.len(),
        late.first()
    );
    let not_found: Vec<&String> =
        rounds.iter().flat_map(|(_, failed)| failed).filter(|failure| failure.contains("code: 5,")).collect();
    assert!(not_found.is_empty(), "no session was unknown at its new owner: {not_found:?}");

    // Nobody flipped, and no viewer saw a version go back.
    let _ = stop_watching.send(());
    let seen = watcher.await.unwrap();
    assert_no_offline_and_no_version_back(&seen, "no OFFLINE for users whose gateway kept renewing");
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
    // Its status, visibility, audience, activity and settings were in the copy.
    assert_lunch_shown_to_friend_only(&mut viewer, &private).await;
    assert_activity_and_locale_kept(&mut viewer, &private, touched).await;
    // The gateway's unregister with the generation it holds removes the session.
    let generation = generations.iter().find(|(user, _)| *user == private).unwrap().1;
    let request =
        pb::UnregisterRequest { user_id: private.clone(), session_id: "s".into(), generation, ..Default::default() };
    let unregistered = leases.unregister(request).await.unwrap();
    assert!(unregistered.removed && unregistered.changed, "{unregistered:?}");
    for server in servers {
        server.stop().await;
    }
}
