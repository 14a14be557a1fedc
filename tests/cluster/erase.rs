//! P7 across nodes: an export or an erase asked at any node is answered by
//! the user's owner; an erase reaches every node that holds the user in its
//! users' audiences and every node's group ledger, and a node that does not
//! answer makes it UNAVAILABLE, naming that node, until it is called again.

use super::*;
use crate::common::export_shape;

fn service_export(user: &str) -> pb::ExportUserRequest {
    pb::ExportUserRequest { user_id: user.into() }
}

/// The export of `user`, asked at `client`'s node.
async fn export(client: &mut PresenceClient<Channel>, user: &str) -> pb::ExportUserResponse {
    client
        .export_user(service_export(user))
        .await
        .unwrap_or_else(|refused| panic!("export {user}: {refused:?}"))
        .into_inner()
}

/// The first user id `name-N` whose slot `map` gives `node`.
fn user_of(map: &presence_cluster::SlotMap, name: &str, node: &str) -> String {
    (0..).map(|i| format!("{name}-{i}")).find(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == node).unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_an_erase_asked_at_any_node_reaches_the_owner_every_audience_and_every_ledger_and_names_a_node_that_is_away()
{
    let etcd = EtcdServer::start().await;
    // node-c is reached by the others through a proxy that the test can turn into a black hole.
    let c_addr: SocketAddr = format!("127.0.0.1:{}", daemon::free_port()).parse().unwrap();
    let proxy = DelayProxy::start("127.0.0.1:0".parse().unwrap(), c_addr, Duration::ZERO).await.unwrap();
    let c_advertised = proxy.local_addr();
    let mut servers = Vec::new();
    for node in &NODES[..2] {
        servers.push(TestServer::start_with(|addr| node_config(&etcd, node, addr)).await);
    }
    let mut c_config = node_config(&etcd, "node-c", c_addr);
    c_config.cluster.as_mut().unwrap().advertise = c_advertised.to_string();
    servers.push(TestServer::start_on(c_addr, c_config).await);
    let map = map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    let clients = [servers[0].client().await, servers[1].client().await, servers[2].client().await];
    let [mut at_a, mut at_b, mut at_c] = clients.clone();

    // ann (node-a's) is online, with a status, an audience, a group, activity
    // and a setting; ben (node-b's) and cal (node-c's) granted her.
    let (ann, ben, cal, tia) = (
        user_of(&map, "ann", "node-a"),
        user_of(&map, "ben", "node-b"),
        user_of(&map, "cal", "node-c"),
        user_of(&map, "tia", "node-c"),
    );
    let (_leases, _) = register_all(&servers[0], std::slice::from_ref(&ann)).await;
    show_lunch_to_friend_only(&mut at_a, &ann).await;
    touch_and_set_locale(&mut at_a, &ann).await;
    at_b.grant_audience(pb::AudienceRequest { user_id: ben.clone(), viewer_ids: vec![ann.clone(), "bob".into()] })
        .await
        .unwrap();
    at_c.grant_audience(pb::AudienceRequest { user_id: cal.clone(), viewer_ids: vec![ann.clone()] }).await.unwrap();
    at_b.join_group(group("team", &[&ann, &tia])).await.unwrap();

    // Asked at node-b, which does not own her: forwarded to node-a, with the
    // other direction of her audience gathered from every node.
    let exported = export(&mut at_b, &ann).await;
    assert!(exported.held);
    assert_eq!(exported.presence.as_ref().unwrap().state, pb::State::Online as i32);
    assert_eq!(exported.sessions.len(), 1);
    assert_eq!(exported.audience, ["friend"]);
    let mut granted_by = vec![ben.clone(), cal.clone()];
    granted_by.sort();
    assert_eq!(exported.in_audience_of, granted_by);
    assert_eq!(exported.groups, ["team"]);
    assert_eq!(exported.settings, HashMap::from([("locale".to_owned(), b"fr".to_vec())]));
    assert_eq!(export(&mut at_c, &ann).await.in_audience_of, granted_by, "the same asked at node-c");

    // friend watches her through node-c.
    let watch = pb::WatchRequest { user_ids: vec![ann.clone()], viewer_id: "friend".into(), ..Default::default() };
    let mut stream = at_c.watch(watch).await.unwrap().into_inner();
    let Some(pb::watch_event::Event::Snapshot(first)) = next_event(&mut stream).await.unwrap().event else {
        panic!("a watch opens with a snapshot")
    };
    assert_eq!(first.users[0].state, pb::State::Online as i32);

    // node-c stops answering the others, though it keeps its place in etcd:
    // the erase, asked at node-b, is done at node-a and node-b, and says
    // node-c did not take its part.
    proxy.set_delay(Duration::from_secs(3_600));
    let refused = at_b.erase_user(pb::EraseUserRequest { user_id: ann.clone() }).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("node-c"), "names the node: {refused:?}");
    let gone = snapshot(&mut at_a, &ann).await.unwrap();
    assert_eq!((gone.state, gone.version), (pb::State::Offline as i32, 0), "node-a forgot her: {gone:?}");

    // node-c answers again; the erase, called again (at node-c this time), completes.
    let address = proxy.local_addr();
    drop(proxy);
    let deadline = Instant::now() + PATIENCE;
    let _healed = loop {
        match DelayProxy::start(address, c_addr, Duration::ZERO).await {
            Ok(healed) => break healed,
            Err(_) if Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(error) => panic!("listening on {address} again: {error}"),
        }
    };
    let deadline = Instant::now() + PATIENCE;
    let erased = loop {
        match at_c.erase_user(pb::EraseUserRequest { user_id: ann.clone() }).await {
            Ok(erased) => break erased.into_inner(),
            Err(refused) if refused.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(refused) => panic!("erase again: {refused:?}"),
        }
    };
    assert_eq!(erased.removed_from_audiences, 1, "cal's audience, at node-c: {erased:?}");
    assert_eq!(erased.sessions_revoked, 0, "her own data went with the first call: {erased:?}");

    // friend's stream saw her go; every node answers for her as for a user never seen.
    let mut went_offline = false;
    while let Ok(event) = next_event(&mut stream).await {
        if let Some(pb::watch_event::Event::Update(update)) = event.event {
            went_offline |= update.user_id == ann && update.state == pb::State::Offline as i32;
        }
        if went_offline {
            break;
        }
    }
    assert!(went_offline, "friend's watch showed her OFFLINE");
    let never = user_of(&map, "never", "node-a");
    for client in [&mut at_a, &mut at_b, &mut at_c] {
        let exported = export(client, &ann).await;
        assert!(!exported.held, "{exported:?}");
        assert_eq!(export_shape(&exported), export_shape(&export(client, &never).await));
        assert!(!export(client, &ben).await.audience.contains(&ann));
        assert!(!export(client, &cal).await.audience.contains(&ann));
        assert_eq!(export(client, &tia).await.groups, ["team"], "tia stays in the team");
    }
    // Every node's ledger keeps her leave, and none her membership: node-c,
    // which the leave did not reach, through the group catch-up.
    for server in &servers {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let ledger = group_ledger(server).await;
            let hers: Vec<_> = ledger.iter().filter(|(_, user, _, _)| *user == ann).collect();
            if hers.len() == 1 && !hers[0].3 {
                break;
            }
            assert!(Instant::now() < deadline, "a leave of the team at {} within {PATIENCE:?}: {hers:?}", server.addr);
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    for server in servers {
        server.stop().await;
    }
}
