//! C3: slots handed over with their state: planned moves, a node joining,
//! a drain; nobody flips.

use super::*;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_a_planned_move_hands_slots_over_with_their_sessions_and_nobody_flips() {
    let etcd = EtcdServer::start().await;
    // Every slot of node-a goes, by hand: nothing evens them out again meanwhile.
    let (servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let users: Vec<String> = (0..600).map(|i| format!("mover-{i}")).collect();
    let (leases, generations) = register_all(&servers[2], &users).await;
    // One user of node-a shows a status, to its audience only.
    let private = users.iter().find(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-a").unwrap().clone();
    show_lunch_to_friend_only(&mut servers[0].client().await, &private).await;
    let touched = touch_and_set_locale(&mut servers[0].client().await, &private).await;
    let mut viewer = servers[2].client().await;
    let before = presences(&mut viewer, &users).await;
    assert!(before.values().all(|presence| presence.state == pb::State::Online as i32));
    let watch = pb::WatchRequest { user_ids: users.clone(), ..Default::default() };
    let mut stream = viewer.watch(watch).await.unwrap().into_inner();
    assert!(matches!(next_event(&mut stream).await.unwrap().event, Some(pb::watch_event::Event::Snapshot(_))));

    // Sessions renewed with a 1.5 s TTL all along: a lease left behind would
    // be refused at the new owner (NOT_FOUND), and its user flip OFFLINE.
    let (stop_renewing, renewer) = keep_renewing(std::sync::Arc::clone(&leases), generations.clone(), 1_500);
    let moving: Vec<u32> = map.owned_by("node-a").collect();
    let on_a: Vec<&String> = users.iter().filter(|user| moving.contains(&slot_of(user, SLOTS))).collect();
    assert!(on_a.len() > 50, "node-a owns {} of the users", on_a.len());

    // One slot through the operator's command, the rest through the RPC it calls.
    let busiest =
        *moving.iter().max_by_key(|&&slot| on_a.iter().filter(|user| slot_of(user, SLOTS) == slot).count()).unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .args(["cluster", "move", &busiest.to_string(), "node-b", "--json"])
        .args(["--etcd", &etcd.endpoint, "--etcd-prefix", PREFIX, "--slots", &SLOTS.to_string()])
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    let moved: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    let in_busiest = on_a.iter().filter(|user| slot_of(user, SLOTS) == busiest).count() as u64;
    assert_eq!((moved["from"].as_str(), moved["to"].as_str()), (Some("node-a"), Some("node-b")), "{moved}");
    assert_eq!((moved["users"].as_u64(), moved["sessions"].as_u64()), (Some(in_busiest), Some(in_busiest)), "{moved}");
    assert!(moved["epoch"].as_i64().unwrap() > map.owner(busiest).unwrap().epoch, "a new epoch: {moved}");
    let mut cluster = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    let rest: Vec<u32> = moving.iter().copied().filter(|&slot| slot != busiest).collect();
    let request = pb::MoveSlotsRequest { slots: rest.clone(), to_node: "node-b".into() };
    let answer = cluster.move_slots(request).await.unwrap().into_inner();
    assert_eq!(answer.users + in_busiest, on_a.len() as u64, "{answer:?}");
    let after_move =
        map_where(&etcd.client().await, "node-a's slots at node-b", |map| map.owned_by("node-a").count() == 0).await;
    assert!(moving.iter().all(|&slot| after_move.owner(slot).unwrap().node == "node-b"));
    tokio::time::sleep(Duration::from_millis(1_000)).await; // renewals carry on at node-b

    // Nobody flipped: no OFFLINE reached the viewer, and every version is the one before.
    let events = events_until_quiet_or_ended(&mut stream).await;
    let offline: Vec<_> = events
        .iter()
        .filter(|event| matches!(&event.event, Some(pb::watch_event::Event::Update(update)) if update.state != pb::State::Online as i32))
        .collect();
    assert!(offline.is_empty(), "no OFFLINE during the move: {offline:?}");
    let after = presences(&mut viewer, &users).await;
    for user in &users {
        assert_eq!(after[user].state, pb::State::Online as i32, "{user}");
        assert_eq!(after[user].version, before[user].version, "{user}: no flip, so no new version (M4)");
    }
    // Its status, visibility, audience, activity and settings went with it.
    assert_lunch_shown_to_friend_only(&mut viewer, &private).await;
    assert_activity_and_locale_kept(&mut viewer, &private, touched).await;
    // The sessions kept their generations and run on the deadlines the renewals set.
    let mut at_b = servers[1].client().await;
    let sample = on_a[0];
    let sessions = at_b.list_sessions(pb::ListSessionsRequest { user_id: sample.clone(), ..Default::default() }).await;
    let sessions = sessions.unwrap().into_inner().sessions;
    let generation = generations.iter().find(|(user, _)| user == sample).unwrap().1;
    assert_eq!(sessions.len(), 1, "{sessions:?}");
    assert_eq!(sessions[0].generation, generation, "{sessions:?}");

    // The drain of node-b at its stop hands everything it owns to the others, with state too.
    let mut servers = servers;
    let b = servers.remove(1);
    b.stop().await;
    map_where(&etcd.client().await, "node-b drained", |map| map.owned_by("node-b").count() == 0).await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let _ = stop_renewing.send(());
    let (rounds, failed) = renewer.await.unwrap();
    assert!(rounds > 5, "{rounds} rounds of renewals");
    assert!(
        failed.is_empty(),
        "every renewal succeeded, if after a retry: {} failed, first {:?}",
        failed.len(),
        failed.first()
    );
    let mut viewer = servers[1].client().await;
    let drained = presences(&mut viewer, &users).await;
    for user in &users {
        assert_eq!(
            (drained[user].state, drained[user].version),
            (pb::State::Online as i32, before[user].version),
            "{user}"
        );
    }
    // And the gateway's unregister with the generation it holds still removes the session.
    let request =
        pb::UnregisterRequest { user_id: sample.clone(), session_id: "s".into(), generation, ..Default::default() };
    let unregistered = leases.unregister(request).await.unwrap();
    assert!(unregistered.removed && unregistered.changed, "{unregistered:?}");
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_a_node_that_joins_is_given_its_share_of_the_slots_with_their_sessions_and_nobody_flips() {
    let etcd = EtcdServer::start().await;
    let mut servers = Vec::new();
    for node in &NODES[..2] {
        servers.push(TestServer::start_with(|addr| node_config(&etcd, node, addr)).await);
    }
    let client = etcd.client().await;
    map_where(&client, "node-a and node-b share the slots", |map| {
        NODES[..2].iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    let users: Vec<String> = (0..400).map(|i| format!("joiner-{i}")).collect();
    let (leases, generations) = register_all(&servers[0], &users).await;
    let mut viewer = servers[1].client().await;
    let before = presences(&mut viewer, &users).await;
    let (stop_watching, watcher) = watch_through_failures(servers[1].url(), users.clone());
    let (stop_renewing, renewer) = keep_renewing_by_round(std::sync::Arc::clone(&leases), generations.clone(), 1_500);

    // node-c joins: the coordinator moves slots to it, a few at a time, with
    // their users, until each node owns its share (21 of 64) less the slack.
    servers.push(TestServer::start_with(|addr| node_config(&etcd, "node-c", addr)).await);
    let map = map_where(&client, "every node owns about a third", |map| {
        NODES.iter().all(|node| (20..=23).contains(&map.owned_by(node).count()))
    })
    .await;
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let _ = stop_renewing.send(());
    let rounds = renewer.await.unwrap();
    let failed: Vec<&String> = rounds.iter().flat_map(|(_, failed)| failed).collect();
    assert!(failed.is_empty(), "{} renewals failed, first {:?}", failed.len(), failed.first());
    let _ = stop_watching.send(());
    assert_no_offline_and_no_version_back(&watcher.await.unwrap(), "no OFFLINE as slots moved to node-c");
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
    // node-c holds its users' sessions, with the generations the gateway holds.
    let mut at_c = servers[2].client().await;
    let on_c: Vec<&(String, u64)> =
        generations.iter().filter(|(user, _)| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-c").collect();
    assert!(on_c.len() > 50, "node-c owns {} of the users", on_c.len());
    for (user, generation) in on_c {
        let request = pb::ListSessionsRequest { user_id: user.clone(), ..Default::default() };
        let sessions = at_c.list_sessions(request).await.unwrap().into_inner().sessions;
        assert_eq!(sessions.iter().map(|s| s.generation).collect::<Vec<_>>(), vec![*generation], "{user}");
    }
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_sessions_over_cluster_leases_renew_at_their_owners_and_carry_on_through_a_drain() {
    let etcd = EtcdServer::start().await;
    let (mut servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let leases = ClusterLeases::new(&servers[2].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    leases.follow_etcd(std::slice::from_ref(&etcd.endpoint), PREFIX).await.unwrap();
    // A gateway's sockets: one session per user, a third of them node-b's.
    let users: Vec<String> = (0..60).map(|i| format!("socket-{i}")).collect();
    let on_b: Vec<&String> =
        users.iter().filter(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-b").collect();
    assert!(!on_b.is_empty());
    let config = SessionConfig { ttl_ms: 1_500, ..SessionConfig::with_heartbeat(Duration::from_millis(300)) };
    let mut sessions = Vec::new();
    for user in &users {
        let session = Session::register(&leases, user.clone(), "tab", "gw", HashMap::new(), config.clone()).await;
        let session = session.unwrap();
        session.join("lobby", HashMap::from([("seat".to_owned(), user.clone())])).await.unwrap();
        sessions.push(session);
    }
    let mut viewer = servers[0].client().await;
    let before = presences(&mut viewer, &users).await;
    assert!(before.values().all(|presence| presence.state == pb::State::Online as i32));
    // Each session's lease and room membership are at its user's owner.
    let mut at_b = servers[1].client().await;
    let listed = at_b.list_sessions(pb::ListSessionsRequest { user_id: on_b[0].clone() }).await.unwrap();
    assert_eq!(listed.into_inner().sessions[0].rooms, ["lobby"]);

    // node-b drains on its stop; the sessions renew at the new owners,
    // with no re-register, over five TTLs.
    servers.remove(1).stop().await;
    map_where(&etcd.client().await, "node-b drained", |map| map.owned_by("node-b").count() == 0).await;
    tokio::time::sleep(Duration::from_millis(7_500)).await;
    for (user, session) in users.iter().zip(&sessions) {
        assert_eq!(
            session.state(),
            SessionState::Live { generation: session.generation() },
            "{user}: renewed all along, never registered again"
        );
    }
    let after = presences(&mut viewer, &users).await;
    for user in &users {
        assert_eq!(
            (after[user].state, after[user].version),
            (pb::State::Online as i32, before[user].version),
            "{user}"
        );
    }
    // Closing a session unregisters it at its owner, wherever that is now.
    let closed = sessions.remove(users.iter().position(|user| user == on_b[0]).unwrap()).close().await.unwrap();
    assert!(closed.removed && closed.changed, "{closed:?}");
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_every_slot_of_a_node_moves_while_100k_sessions_renew_and_nobody_flips_or_loses_a_write() {
    const SESSIONS: usize = 100_000;
    const CHUNK: usize = 2_000;
    // Every user is renewed every 2 s: a TTL of 30 s holds even on a machine
    // so loaded that renewals come several times later than sent (with
    // 10 s, runs beside two busy builds lost leases to their TTL).
    const TTL_MS: u32 = 30_000;
    // The users that leave or arrive are not renewed: their leases outlast
    // the churn unless it runs slower than a minute (60 s: the most a lease
    // may ask for here); an arrival whose lease may have run out since is
    // not checked.
    const CHURN_TTL_MS: u32 = 60_000;
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let leases =
        std::sync::Arc::new(ClusterLeases::new(&servers[2].url(), SLOTS, LeaseChannelConfig::default()).unwrap());
    leases.follow_etcd(std::slice::from_ref(&etcd.endpoint), PREFIX).await.unwrap();
    let with_ttl = |mut item: pb::LeaseItem, ttl_ms: u32| {
        if let Some(pb::lease_item::Op::Register(register)) = item.op.as_mut() {
            register.ttl_ms = ttl_ms;
        }
        item
    };
    let users: Vec<String> = (0..SESSIONS).map(|i| format!("steady-{i}")).collect();
    let mut generations: Vec<(String, u64)> = Vec::with_capacity(SESSIONS);
    for chunk in users.chunks(CHUNK) {
        let results = leases.submit_batch(chunk.iter().map(|user| with_ttl(register(user), TTL_MS)).collect()).await;
        for (user, result) in chunk.iter().zip(results) {
            match lease_result(result) {
                Ok(pb::lease_result::Result::Register(registered)) => {
                    generations.push((user.clone(), registered.generation))
                }
                other => panic!("{user}: {other:?}"),
            }
        }
    }
    // Users that leave during the move, and users that arrive during it.
    let leaving: Vec<String> = (0..1_000).map(|i| format!("leaving-{i}")).collect();
    let mut leaving_generations = Vec::new();
    for user in &leaving {
        match lease_result(until_not_refused(&leases, with_ttl(register(user), CHURN_TTL_MS)).await) {
            Ok(pb::lease_result::Result::Register(registered)) => leaving_generations.push(registered.generation),
            other => panic!("{user}: {other:?}"),
        }
    }
    let arriving: Vec<String> = (0..1_000).map(|i| format!("arriving-{i}")).collect();
    let mut viewer = servers[2].client().await;
    let mut before = HashMap::new();
    for chunk in users.chunks(10_000) {
        before.extend(presences(&mut viewer, chunk).await);
    }

    // Every user renews every 2 s, a chunk of 2,000 every 40 ms, each
    // chunk's answer timed from its send.
    let (stop_renewing, mut renewing_stopped) = tokio::sync::oneshot::channel::<()>();
    let renewer = {
        let (leases, generations) = (std::sync::Arc::clone(&leases), std::sync::Arc::new(generations));
        tokio::spawn(async move {
            let mut chunks = tokio::task::JoinSet::new();
            let mut tick = tokio::time::interval(Duration::from_millis(40));
            let mut next = 0;
            loop {
                tokio::select! {
                    _ = &mut renewing_stopped => break,
                    _ = tick.tick() => {}
                }
                let (leases, generations) = (std::sync::Arc::clone(&leases), std::sync::Arc::clone(&generations));
                let range = next..(next + CHUNK).min(generations.len());
                next = if range.end == generations.len() { 0 } else { range.end };
                chunks.spawn(async move {
                    let items =
                        generations[range.clone()].iter().map(|(user, generation)| renew(user, *generation, TTL_MS));
                    let sent = Instant::now();
                    let results = leases.submit_batch(items.collect()).await;
                    let failed: Vec<String> = generations[range]
                        .iter()
                        .zip(results)
                        .filter(|(_, result)| result.code != 0)
                        .map(|((user, _), result)| format!("{user}: {} {}", result.code, result.message))
                        .collect();
                    (sent, sent.elapsed(), failed)
                });
            }
            let mut answered = Vec::new();
            while let Some(chunk) = chunks.join_next().await {
                answered.push(chunk.unwrap());
            }
            answered
        })
    };
    tokio::time::sleep(Duration::from_secs(3)).await;

    // Every slot of node-a goes to node-b while the renewals, the leaving
    // users' unregisters and the arriving users' registers go on.
    let moving: Vec<u32> = map.owned_by("node-a").collect();
    let on_a = users.iter().filter(|user| moving.contains(&slot_of(user, SLOTS))).count();
    let churn = {
        let leases = std::sync::Arc::clone(&leases);
        let (leaving, arriving) = (leaving.clone(), arriving.clone());
        let leaving_generations = leaving_generations.clone();
        tokio::spawn(async move {
            let mut answers = Vec::new();
            for ((gone, generation), new) in leaving.iter().zip(leaving_generations).zip(&arriving) {
                let unregister = pb::UnregisterRequest {
                    user_id: gone.clone(),
                    session_id: "s".into(),
                    generation,
                    ..Default::default()
                };
                let item = pb::LeaseItem { op: Some(pb::lease_item::Op::Unregister(unregister)) };
                answers.push((gone.clone(), until_not_refused(&leases, item).await, Instant::now()));
                let sent = Instant::now();
                let registered = until_not_refused(&leases, with_ttl(register(new), CHURN_TTL_MS)).await;
                answers.push((new.clone(), registered, sent));
            }
            answers
        })
    };
    let move_started = Instant::now();
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    let answer =
        at_a.move_slots(pb::MoveSlotsRequest { slots: moving.clone(), to_node: "node-b".into() }).await.unwrap();
    let move_took = move_started.elapsed();
    let moved = answer.into_inner();
    // Beside the steady users, node-a's leaving and arriving ones of the moment.
    if (moved.sessions as usize) < on_a {
        let _ = stop_renewing.send(());
        let chunks = renewer.await.unwrap();
        let slowest = chunks.iter().map(|(_, took, _)| *took).max().unwrap_or_default();
        panic!(
            "every steady session of node-a moved: {moved:?}, {on_a} on node-a (the slowest renewal chunk was \
             answered after {slowest:?}; past the {TTL_MS} ms TTL, leases ran out before the move)"
        );
    }
    let move_ended = Instant::now();
    let churned = churn.await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_renewing.send(());
    let chunks = renewer.await.unwrap();

    // No write was lost: every unregister and register was applied.
    for (user, result, _) in &churned {
        assert_eq!(result.code, 0, "{user}: {result:?}");
    }
    let mut after = HashMap::new();
    for chunk in users.chunks(10_000) {
        after.extend(presences(&mut viewer, chunk).await);
    }
    for user in &users {
        let (was, is) = (&before[user], &after[user]);
        assert_eq!((is.state, is.version), (pb::State::Online as i32, was.version), "{user}: no flip, no new version");
    }
    let gone = presences(&mut viewer, &leaving).await;
    assert!(gone.values().all(|presence| presence.state == pb::State::Offline as i32), "every leaving user left");
    // An arrival whose lease may have run out by now is not checked (it is
    // answered, above); the others are all ONLINE.
    let live_window = Duration::from_millis(u64::from(CHURN_TTL_MS) - 5_000);
    let live: Vec<String> = churned
        .iter()
        .filter(|(user, _, sent)| user.starts_with("arriving-") && sent.elapsed() < live_window)
        .map(|(user, _, _)| user.clone())
        .collect();
    let new = presences(&mut viewer, &live).await;
    let absent: Vec<&String> =
        new.iter().filter(|(_, presence)| presence.state != pb::State::Online as i32).map(|(user, _)| user).collect();
    assert!(
        absent.is_empty(),
        "every arriving user arrived: {} of {} not ONLINE: {absent:?}",
        absent.len(),
        live.len()
    );
    // Every renewal was answered, if after a retry.
    let failed: Vec<&String> = chunks.iter().flat_map(|(_, _, failed)| failed).collect();
    assert!(failed.is_empty(), "{} renewals failed, first {:?}", failed.len(), failed.first());

    let (mut steady, mut during): (Vec<Duration>, Vec<Duration>) = (Vec::new(), Vec::new());
    for (sent, took, _) in &chunks {
        let overlaps = *sent <= move_ended && *sent + *took >= move_started;
        if overlaps { during.push(*took) } else { steady.push(*took) }
    }
    println!(
        "moved {} slots ({} users, {} sessions) of node-a to node-b in {move_took:?} under {SESSIONS} renewing sessions; \
         renewal chunks of {CHUNK}: p99 {:.1} ms during the move ({} chunks), {:.1} ms otherwise ({} chunks)",
        moving.len(),
        moved.users,
        moved.sessions,
        quantile_ms(&mut during, 0.99),
        during.len(),
        quantile_ms(&mut steady, 0.99),
        steady.len(),
    );
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_a_move_that_cannot_be_made_is_refused_saying_why_and_changes_nothing() {
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes(&etcd).await;
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    let of_a = map.owned_by("node-a").next().unwrap();
    let of_b = map.owned_by("node-b").next().unwrap();
    let refusal = |slots: Vec<u32>, to: &str| pb::MoveSlotsRequest { slots, to_node: to.into() };
    let cases = [
        (refusal(vec![of_b], "node-c"), Code::FailedPrecondition, "owned by node node-b"),
        (refusal(vec![of_a], "node-z"), Code::FailedPrecondition, "node node-z is not a live node"),
        (refusal(vec![of_a], "node-a"), Code::InvalidArgument, "is this node"),
        (refusal(vec![SLOTS], "node-b"), Code::InvalidArgument, "is not one of the cluster's 64 slots"),
        (refusal(vec![], "node-b"), Code::InvalidArgument, "at least one slot"),
    ];
    for (request, code, says) in cases {
        let refused = at_a.move_slots(request.clone()).await.unwrap_err();
        assert_eq!(refused.code(), code, "{request:?}: {refused:?}");
        assert!(refused.message().contains(says), "{request:?}: {refused:?}");
    }
    let unchanged = map_where(&etcd.client().await, "the map as it was", |_| true).await;
    assert_eq!(unchanged, map, "nothing moved");
    // A single node has no slots to move.
    let single = TestServer::start_with(|_| fast_config()).await;
    let mut alone = presence_proto::v1::cluster_client::ClusterClient::connect(single.url()).await.unwrap();
    let refused = alone.move_slots(refusal(vec![0], "node-b")).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    assert!(refused.message().contains("not one of a cluster"), "{refused:?}");
    single.stop().await;
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_cluster_leases_waits_out_a_move_to_a_target_that_answers_late_by_time_and_no_renewal_is_refused() {
    // The target of a move is frozen (SIGSTOP) for 1.2 s, within its lease
    // TTL: all that time the source refuses the moving slots' requests and
    // names no owner. ClusterLeases waits such refusals out by time (3 s),
    // not by a count of tries (five, about 0.75 s, before): the gateway
    // renewing every 200 ms sees no refusal, and nobody flips.
    let name = "slow-target";
    let logs = daemon::scratch_dir(name);
    let etcd = EtcdServer::start().await;
    let nodes = three_node_processes(&etcd, &logs).await;
    let client = etcd.client().await;
    let traffic = Traffic::start(name, &nodes[0].url(), &nodes[0].url()).await;
    let map = map_where(&client, "the map", |_| true).await;
    let moving: std::collections::BTreeSet<u32> = traffic
        .users
        .iter()
        .map(|user| slot_of(user, SLOTS))
        .filter(|&slot| map.owner(slot).unwrap().node == NODES[0])
        .take(8)
        .collect();
    assert!(!moving.is_empty(), "{} owns some of the users", NODES[0]);
    let mut at_source = presence_proto::v1::cluster_client::ClusterClient::connect(nodes[0].url()).await.unwrap();
    nodes[1].pause();
    let request = pb::MoveSlotsRequest { slots: moving.iter().copied().collect(), to_node: NODES[1].into() };
    let (moved, ()) = tokio::join!(at_source.move_slots(request), async {
        tokio::time::sleep(Duration::from_millis(1_200)).await;
        nodes[1].resume();
    });
    let moved = moved.expect("the move completes once the target answers").into_inner();
    assert!(moved.sessions > 0, "the slots held sessions: {moved:?}");
    map_where(&client, "the slots at the target", |map| {
        moving.iter().all(|&slot| map.owner(slot).is_some_and(|owner| owner.node == NODES[1]))
    })
    .await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    traffic.finish_seeing_nothing(&logs).await;
    for node in nodes {
        node.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}

/// Moves each of `moving` (node-a's slots) to node-b on its own, then all
/// of them back to node-a at once.
async fn each_to_node_b_then_all_back(servers: &[TestServer], moving: &[u32]) {
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    for &slot in moving {
        let request = pb::MoveSlotsRequest { slots: vec![slot], to_node: "node-b".into() };
        at_a.move_slots(request).await.unwrap_or_else(|status| panic!("slot {slot} to node-b: {status:?}"));
    }
    let mut at_b = presence_proto::v1::cluster_client::ClusterClient::connect(servers[1].url()).await.unwrap();
    let back = pb::MoveSlotsRequest { slots: moving.to_vec(), to_node: "node-a".into() };
    at_b.move_slots(back).await.expect("every slot back to node-a");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_slots_move_while_a_gateway_that_never_retries_renews_every_session_and_sees_no_refusal_and_nobody_flips() {
    // The gateway follows a refusal that names an owner (that is routing)
    // but never sends a refused item again: a refusal naming no owner is its
    // result, as for a gateway that waits for its next heartbeat. It is two
    // clients, one learning owners from refusals only, one from etcd too (it
    // may learn of a move before the target acts on it). Sessions are
    // renewed in small chunks every 5 ms, so that every freeze meets some.
    // Each of node-a's slots moves to node-b on its own, then all of them
    // move back at once: requests that meet a freeze wait at the node that
    // received them and are answered by the owner after it.
    const TTL_MS: u32 = 5_000;
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let users: Vec<String> = (0..1_200).map(|i| format!("steady-{i}")).collect();
    let never_retrying = || {
        ClusterLeases::new(&servers[2].url(), SLOTS, LeaseChannelConfig::default())
            .unwrap()
            .with_move_wait(Duration::ZERO)
    };
    let following_etcd = never_retrying();
    following_etcd.follow_etcd(std::slice::from_ref(&etcd.endpoint), PREFIX).await.unwrap();
    let gateways = std::sync::Arc::new(vec![never_retrying(), following_etcd]);
    let generations = register_through(&gateways[0], &users).await;
    let mut viewer = servers[2].client().await;
    let before = presences(&mut viewer, &users).await;
    let watching = watch_through_failures(servers[2].url(), users.clone());
    let renewing = renew_in_chunks(std::sync::Arc::clone(&gateways), generations, 30, TTL_MS);
    tokio::time::sleep(Duration::from_millis(500)).await;

    let moving: Vec<u32> = map.owned_by("node-a").collect();
    assert!(moving.len() > 5, "node-a owns {} slots", moving.len());
    each_to_node_b_then_all_back(&servers, &moving).await;
    tokio::time::sleep(Duration::from_millis(500)).await;

    let _ = renewing.0.send(());
    let (sent, refused) = renewing.1.await.unwrap();
    assert!(sent > 100, "renewals went on all along: {sent} chunks");
    assert!(refused.is_empty(), "{} renewals were refused to the gateway, first {:?}", refused.len(), refused.first());
    let _ = watching.0.send(());
    let seen = watching.1.await.unwrap();
    assert_no_offline_and_no_version_back(&seen, "no OFFLINE through the moves");
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_snapshots_through_a_third_node_while_slots_move_are_never_refused() {
    // A viewer reads every user through node-c, which owns none of the
    // moving slots and forwards their users to whoever it thinks owns them,
    // back to back, while each of node-a's slots moves to node-b on its own
    // and then all come back at once. node-c's view of the map lags etcd
    // and the two nodes' by a moment: a read it sends to the old owner in
    // that moment, or one that meets a freeze, waits for the owner after
    // the move instead of being refused (C7).
    let etcd = EtcdServer::start().await;
    let (servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let moving: Vec<u32> = map.owned_by("node-a").collect();
    let users: Vec<String> = (0..3_000)
        .map(|i| format!("read-{i}"))
        .filter(|user| moving.contains(&slot_of(user, SLOTS)))
        .take(300)
        .collect();
    assert!(users.len() == 300 && moving.len() > 5, "node-a owns {} slots", moving.len());
    let gateway = ClusterLeases::new(&servers[2].url(), SLOTS, LeaseChannelConfig::default()).unwrap();
    register_through(&gateway, &users).await;
    let mut viewer = servers[2].client().await;
    let before = presences(&mut viewer, &users).await;
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let reading = {
        let (mut viewer, users) = (servers[2].client().await, users.clone());
        tokio::spawn(async move {
            let (mut reads, mut refused) = (0, Vec::new());
            while stopped.try_recv().is_err() {
                let request = pb::SnapshotRequest { user_ids: users.clone(), ..Default::default() };
                if let Err(status) = viewer.snapshot(request).await {
                    refused.push(status);
                }
                reads += 1;
            }
            (reads, refused)
        })
    };
    each_to_node_b_then_all_back(&servers, &moving).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let _ = stop.send(());
    let (reads, refused) = reading.await.unwrap();
    assert!(reads > moving.len(), "reads went on all along: {reads}");
    assert!(refused.is_empty(), "{} of {reads} Snapshots were refused, first {:?}", refused.len(), refused.first());
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c7_a_freeze_past_its_bound_is_given_up_and_the_slots_answered_where_they_were_with_no_refusal() {
    // node-a gives every freeze up at once (its bound is 0): each round of
    // the move is copied, frozen, given up and made again, three times, and
    // the move fails saying why. Meanwhile a gateway that never retries
    // renews every session in small chunks: the requests held through each
    // freeze are answered at node-a, which still owns the slots.
    const TTL_MS: u32 = 5_000;
    let etcd = EtcdServer::start().await;
    let mut servers = Vec::new();
    for node in NODES {
        let server = TestServer::start_with(|addr| {
            let mut config = node_config_with(&etcd, node, addr, fast_config());
            let cluster = config.cluster.as_mut().expect("a cluster node");
            cluster.rebalance = false;
            if node == "node-a" {
                cluster.move_freeze_bound = Duration::ZERO;
            }
            config
        })
        .await;
        servers.push(server);
    }
    let client = etcd.client().await;
    let map =
        map_where(&client, "every node owns slots", |map| NODES.iter().all(|node| map.owned_by(node).count() > 0))
            .await;
    let users: Vec<String> = (0..600).map(|i| format!("held-{i}")).collect();
    let gateway = ClusterLeases::new(&servers[2].url(), SLOTS, LeaseChannelConfig::default())
        .unwrap()
        .with_move_wait(Duration::ZERO);
    let generations = register_through(&gateway, &users).await;
    let mut viewer = servers[2].client().await;
    let before = presences(&mut viewer, &users).await;
    let renewing = renew_in_chunks(std::sync::Arc::new(vec![gateway]), generations, 20, TTL_MS);
    let moving: Vec<u32> = map.owned_by("node-a").collect();
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    let refused = at_a
        .move_slots(pb::MoveSlotsRequest { slots: moving.clone(), to_node: "node-b".into() })
        .await
        .expect_err("every freeze is given up");
    assert_eq!(refused.code(), Code::Aborted, "{refused:?}");
    assert!(refused.message().contains("did not take the last changes"), "{refused:?}");
    let after = map_where(&client, "the map", |_| true).await;
    assert!(moving.iter().all(|&slot| after.owner(slot).unwrap().node == "node-a"), "the slots stayed at node-a");
    tokio::time::sleep(Duration::from_millis(300)).await;
    let _ = renewing.0.send(());
    let (_, refused) = renewing.1.await.unwrap();
    assert!(refused.is_empty(), "{} renewals were refused to the gateway, first {:?}", refused.len(), refused.first());
    assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
}
