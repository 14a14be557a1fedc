//! Cluster mode against a real etcd (C1, C2, C5): three presenced nodes in
//! this process, on loopback, joined through one etcd the test starts
//! (`etcd` from PATH or `PRESENCED_ETCD_BIN`; `.ci/install-etcd`).

// Protobuf literals end in `..Default::default()` so that they keep compiling as messages gain fields.
#![allow(clippy::needless_update)]

mod common;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use common::cluster::*;
use common::daemon;
use presence_client::{ClusterLeases, LeaseChannelConfig, Session, SessionConfig, SessionState, lease_result};
use presence_cluster::testing::EtcdServer;
use presence_cluster::{Etcd, slot_of};
use presence_faults::DelayProxy;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::ServerConfig;
use presence_server::testing::{TestServer, fast_config};
use prost::Message as _;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

/// `presenced cluster status --etcd ... EXTRA` against the test's cluster.
fn cluster_status_output(etcd: &EtcdServer, extra: &[&str]) -> std::process::Output {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .args(["cluster", "status", "--etcd", &etcd.endpoint, "--etcd-prefix", PREFIX, "--slots", &SLOTS.to_string()])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    output
}

/// `presenced cluster status --json`, parsed.
fn cluster_status(etcd: &EtcdServer, extra: &[&str]) -> serde_json::Value {
    serde_json::from_slice(&cluster_status_output(etcd, extra).stdout).unwrap()
}

/// The `presence.v1.NotOwner` in a refusal's details.
fn not_owner_of(status: &tonic::Status) -> pb::NotOwner {
    let details = tonic_types::Status::decode(status.details()).expect("google.rpc.Status details");
    let any = details
        .details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/presence.v1.NotOwner")
        .unwrap_or_else(|| panic!("no NotOwner in {status:?}"));
    pb::NotOwner::decode(any.value.as_slice()).unwrap()
}

fn register(user: &str) -> pb::LeaseItem {
    pb::LeaseItem {
        op: Some(pb::lease_item::Op::Register(pb::RegisterRequest {
            user_id: user.into(),
            session_id: "s".into(),
            gateway_id: "gw".into(),
            ttl_ms: 30_000,
            ..Default::default()
        })),
    }
}

/// A gateway's `ClusterLeases` entering at `entry`, and the generation of
/// each of `users`' sessions, registered through it.
async fn register_all(entry: &TestServer, users: &[String]) -> (std::sync::Arc<ClusterLeases>, Vec<(String, u64)>) {
    register_all_at(&entry.url(), users).await
}

/// [`register_all`] entering at the node at `url`.
async fn register_all_at(url: &str, users: &[String]) -> (std::sync::Arc<ClusterLeases>, Vec<(String, u64)>) {
    let leases = std::sync::Arc::new(ClusterLeases::new(url, SLOTS, LeaseChannelConfig::default()).unwrap());
    let registered = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
    let mut generations = Vec::new();
    for (user, result) in users.iter().zip(registered) {
        match lease_result(result.clone()) {
            Ok(pb::lease_result::Result::Register(done)) => generations.push((user.clone(), done.generation)),
            other => panic!("{user}: {other:?}"),
        }
    }
    (leases, generations)
}

/// Asserts that `viewer` sees every one of `users` ONLINE at the version `before` held (M4: no flip, no new version).
async fn assert_online_at_the_versions_before(
    viewer: &mut PresenceClient<Channel>,
    users: &[String],
    before: &HashMap<String, pb::UserPresence>,
) {
    let after = presences(viewer, users).await;
    for user in users {
        assert_eq!(
            (after[user].state, after[user].version),
            (pb::State::Online as i32, before[user].version),
            "{user}: online at the version it had"
        );
    }
}

async fn snapshot(client: &mut PresenceClient<Channel>, user: &str) -> Result<pb::UserPresence, tonic::Status> {
    let request = pb::SnapshotRequest { user_ids: vec![user.into()], ..Default::default() };
    Ok(client.snapshot(request).await?.into_inner().users.remove(0))
}

/// A Snapshot as a node forwards it: answered by the owner alone.
async fn forwarded_snapshot(
    client: &mut PresenceClient<Channel>,
    user: &str,
) -> Result<pb::UserPresence, tonic::Status> {
    let mut request = tonic::Request::new(pb::SnapshotRequest { user_ids: vec![user.into()], ..Default::default() });
    request.metadata_mut().insert("presenced-forwarded", "1".parse().unwrap());
    Ok(client.snapshot(request).await?.into_inner().users.remove(0))
}

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

/// Every answer one node gave for `user`, asked directly (a forwarded
/// request, so that a non-owner refuses rather than forwards) every 20 ms
/// until told to stop: `(when, Ok(()) or the refusal)`.
fn ask_repeatedly(url: String, user: String) -> Asked {
    ask_repeatedly_at(tonic::transport::Endpoint::from_shared(url).unwrap(), user)
}

/// [`ask_repeatedly`] through `endpoint` (from a chosen local address).
fn ask_repeatedly_at(endpoint: tonic::transport::Endpoint, user: String) -> Asked {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut client = PresenceClient::new(endpoint.connect().await.unwrap());
        let mut answers = Vec::new();
        loop {
            let asked = Instant::now();
            let answer = forwarded_snapshot(&mut client, &user).await.map(drop);
            answers.push((asked, answer));
            tokio::select! {
                _ = &mut stopped => return answers,
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    });
    (stop, task)
}

/// Answers to a Snapshot asked again and again, as [`ask_repeatedly`] gathers them.
type Asked = Running<Vec<(Instant, Result<(), tonic::Status>)>>;

/// Once node-a was cut off at `cut`: waits until etcd has given all its
/// slots away and `follower` answers for `user`, stops the two askers (of
/// node-a, then of the follower) and asserts [`assert_one_owner_at_a_time`].
async fn assert_taken_over_by_one_owner_at_a_time(
    etcd: &EtcdServer,
    follower: &TestServer,
    user: &str,
    old_epoch: i64,
    cut: Instant,
    [(stop_a, answers_a), (stop_follower, answers_follower)]: [Asked; 2],
) {
    let taken =
        map_where(&etcd.client().await, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
    let new_epoch = taken.owner(slot_of(user, SLOTS)).unwrap().epoch;
    let deadline = Instant::now() + PATIENCE;
    while forwarded_snapshot(&mut follower.client().await, user).await.is_err() {
        assert!(Instant::now() < deadline, "the follower did not take the slot over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The askers hear the follower's answers too before they stop.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, _) = (stop_a.send(()), stop_follower.send(()));
    let (answers_a, answers_follower) = (answers_a.await.unwrap(), answers_follower.await.unwrap());
    assert_one_owner_at_a_time(&answers_a, &answers_follower, cut, (old_epoch, new_epoch));
}

/// The answers of node-a (cut off at `cut`) and of its slot's follower,
/// asked all along, show one owner at a time (C1): node-a's last answer came
/// before the follower's first, within node-a's lease of the cut; node-a's
/// refusals after it name its own lapsed epoch and no owner; the follower's
/// before it took over name node-a at that epoch; its ownership comes with a
/// later one.
fn assert_one_owner_at_a_time(
    answers_a: &[(Instant, Result<(), tonic::Status>)],
    answers_follower: &[(Instant, Result<(), tonic::Status>)],
    cut: Instant,
    (old_epoch, new_epoch): (i64, i64),
) {
    let last_a = answers_a.iter().filter(|(_, answer)| answer.is_ok()).map(|(at, _)| *at).max().unwrap();
    let first_follower = answers_follower.iter().find(|(_, answer)| answer.is_ok()).map(|(at, _)| *at);
    let first_follower = first_follower.expect("the follower answered once it took over");
    assert!(
        last_a < first_follower,
        "node-a answered at {:?}, after the follower at {:?}",
        last_a - cut,
        first_follower - cut
    );
    assert!(last_a - cut < Duration::from_secs(2), "node-a acted {:?} after the cut, past its lease", last_a - cut);
    for (at, answer) in answers_a.iter().filter(|(at, _)| *at > last_a) {
        let refusal = answer.as_ref().unwrap_err();
        assert_eq!(refusal.code(), Code::Unavailable, "{:?}: {refusal:?}", *at - cut);
        let named = not_owner_of(refusal);
        assert_eq!((named.owner_id.as_str(), named.epoch), ("", old_epoch), "{named:?}");
    }
    for (_, answer) in answers_follower.iter().filter(|(at, _)| *at < first_follower) {
        let named = not_owner_of(answer.as_ref().unwrap_err());
        assert_eq!((named.owner_id.as_str(), named.epoch), ("node-a", old_epoch), "{named:?}");
    }
    assert!(new_epoch > old_epoch, "the takeover's epoch {new_epoch} follows node-a's {old_epoch}");
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
    at_a.register(pb::RegisterRequest {
        user_id: user.clone(),
        session_id: "s".into(),
        gateway_id: "gw".into(),
        ttl_ms: 30_000,
        ..Default::default()
    })
    .await
    .expect("node-a acts while etcd confirms its lease");
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
    let stats = at_a.stats(pb::StatsRequest::default()).await.unwrap().into_inner();
    assert_eq!(stats.sessions, 0, "node-a dropped the sessions of the slots given away: {stats:?}");
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
    let stats = at_a.stats(pb::StatsRequest::default()).await.unwrap().into_inner();
    assert_eq!(stats.sessions, 0, "node-a dropped the sessions of the slots given away: {stats:?}");
    node_a.stop().await;
    for server in servers {
        server.stop().await;
    }
}

/// The port of `host:port`.
fn probe_port(address: &str) -> u16 {
    address.rsplit(':').next().unwrap().parse().unwrap()
}

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

/// The etcd lease each node's registration is bound to.
async fn registrations(etcd: &Etcd) -> HashMap<String, i64> {
    let mut leases = HashMap::new();
    for node in NODES {
        if let Some(kv) = etcd.get(format!("{PREFIX}nodes/{node}").as_bytes()).await.unwrap() {
            leases.insert(node.to_owned(), kv.lease);
        }
    }
    leases
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

/// The next event of a stream, within the patience.
async fn next_event(stream: &mut tonic::Streaming<pb::WatchEvent>) -> Result<pb::WatchEvent, tonic::Status> {
    let next = tokio::time::timeout(PATIENCE, stream.message()).await.expect("an event within the patience");
    next.and_then(|event| event.ok_or_else(|| tonic::Status::cancelled("the stream ended")))
}

/// Reads updates until the stream ends, which must be `UNAVAILABLE`; anything
/// but an update before it (a part's snapshot above all) fails the test.
async fn updates_until_unavailable(stream: &mut tonic::Streaming<pb::WatchEvent>) -> tonic::Status {
    let ended = loop {
        match next_event(stream).await {
            Ok(pb::WatchEvent { event: Some(pb::watch_event::Event::Update(_)) }) => continue,
            Ok(other) => panic!("only updates before the end: {other:?}"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
    ended
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

fn renew(user: &str, generation: u64, ttl_ms: u32) -> pb::LeaseItem {
    pb::LeaseItem {
        op: Some(pb::lease_item::Op::Renew(pb::RenewRequest {
            user_id: user.into(),
            session_id: "s".into(),
            generation,
            ttl_ms,
            ..Default::default()
        })),
    }
}

/// Renews every user's session every 200 ms through `leases` until told to
/// stop; returns how many rounds ran and every renewal that failed.
fn keep_renewing(
    leases: std::sync::Arc<ClusterLeases>,
    generations: Vec<(String, u64)>,
    ttl_ms: u32,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<(usize, Vec<String>)>) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let (mut rounds, mut failed) = (0, Vec::new());
        loop {
            let items = generations.iter().map(|(user, generation)| renew(user, *generation, ttl_ms)).collect();
            for ((user, _), result) in generations.iter().zip(leases.submit_batch(items).await) {
                if result.code != 0 {
                    failed.push(format!("{user}: {result:?}"));
                }
            }
            rounds += 1;
            tokio::select! {
                _ = &mut stopped => return (rounds, failed),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    });
    (stop, task)
}

/// Every user's presence, read through `client`.
async fn presences(client: &mut PresenceClient<Channel>, users: &[String]) -> HashMap<String, pb::UserPresence> {
    let request = pb::SnapshotRequest { user_ids: users.to_vec(), ..Default::default() };
    let answer = client.snapshot(request).await.unwrap().into_inner().users;
    answer.into_iter().map(|presence| (presence.user_id.clone(), presence)).collect()
}

/// The events a watch delivers until it ends (UNAVAILABLE, as a moved part
/// ends it) or stays quiet for a second.
async fn events_until_quiet_or_ended(stream: &mut tonic::Streaming<pb::WatchEvent>) -> Vec<pb::WatchEvent> {
    let mut events = Vec::new();
    while let Ok(Ok(Some(event))) = tokio::time::timeout(Duration::from_secs(1), stream.message()).await {
        events.push(event);
    }
    events
}

/// `user` (at its owner, through `client`) shows the status "lunch", to its audience ("friend") only.
async fn show_lunch_to_friend_only(client: &mut PresenceClient<Channel>, user: &str) {
    let status = pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), ..Default::default() };
    let request = pb::SetStatusRequest { user_id: user.into(), status: Some(status), ..Default::default() };
    client.set_status(request).await.unwrap();
    let audience =
        pb::AudienceRequest { user_id: user.into(), viewer_ids: vec!["friend".into()], ..Default::default() };
    client.grant_audience(audience).await.unwrap();
    let visibility = pb::SetVisibilityRequest {
        user_id: user.into(),
        visibility: pb::Visibility::Audience as i32,
        ..Default::default()
    };
    client.set_visibility(visibility).await.unwrap();
}

/// Touches `user` and gives it the setting locale=fr, at its owner
/// (`client`); answers the activity time the owner recorded.
async fn touch_and_set_locale(client: &mut PresenceClient<Channel>, user: &str) -> i64 {
    let touched = client.touch(pb::TouchRequest { user_id: user.into(), ..Default::default() }).await.unwrap();
    let setting = pb::PutSettingRequest { user_id: user.into(), name: "locale".into(), value: b"fr".to_vec() };
    client.put_setting(setting).await.unwrap();
    touched.into_inner().last_active_at_ms
}

/// Asserts that `user`'s owner, asked through `client`'s node, holds the
/// activity time and the setting [`touch_and_set_locale`] left.
async fn assert_activity_and_locale_kept(client: &mut PresenceClient<Channel>, user: &str, last_active_at_ms: i64) {
    let request = pb::SnapshotRequest { user_ids: vec![user.into()], ..Default::default() };
    let seen = client.snapshot(request).await.unwrap().into_inner().users.remove(0);
    assert_eq!(seen.last_active_at_ms, last_active_at_ms, "{user}'s last activity went with it: {seen:?}");
    // Settings are read at the owner: follow the refusal there.
    let request = pb::GetSettingsRequest { user_id: user.into() };
    let settings = match client.get_settings(request.clone()).await {
        Ok(answer) => answer.into_inner(),
        Err(refused) => {
            let owner = not_owner_of(&refused).owner_addr;
            let mut at_owner = PresenceClient::connect(format!("http://{owner}")).await.unwrap();
            at_owner.get_settings(request).await.unwrap().into_inner()
        }
    };
    assert_eq!(
        settings.settings,
        HashMap::from([("locale".to_owned(), b"fr".to_vec())]),
        "{user}'s settings went with it"
    );
}

/// Asserts, through `viewer`, that "friend" sees `user` online with its "lunch" status and a stranger sees nothing.
async fn assert_lunch_shown_to_friend_only(viewer: &mut PresenceClient<Channel>, user: &str) {
    for (who, sees) in [("friend", true), ("stranger", false)] {
        let request = pb::SnapshotRequest { user_ids: vec![user.into()], viewer_id: who.into(), ..Default::default() };
        let seen = viewer.snapshot(request).await.unwrap().into_inner().users.remove(0);
        let shown = (seen.state == pb::State::Online as i32, seen.status.as_ref().map(|status| status.text.as_str()));
        assert_eq!(shown, if sees { (true, Some("lunch")) } else { (false, None) }, "{who}: {seen:?}");
    }
}

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

/// The answer to `item` once it is not refused for want of an owner: a
/// gateway sends a refused write again, as `ClusterLeases` does a few hops.
async fn until_not_refused(leases: &ClusterLeases, item: pb::LeaseItem) -> pb::LeaseResult {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let result = leases.submit_batch(vec![item.clone()]).await.remove(0);
        if result.code != Code::Unavailable as u32 || Instant::now() > deadline {
            return result;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `q`-quantile of `durations` (sorted here), in ms.
fn quantile_ms(durations: &mut [Duration], q: f64) -> f64 {
    durations.sort();
    let index = ((durations.len() as f64 * q).ceil() as usize).clamp(1, durations.len()) - 1;
    durations[index].as_secs_f64() * 1_000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_every_slot_of_a_node_moves_while_100k_sessions_renew_and_nobody_flips_or_loses_a_write() {
    const SESSIONS: usize = 100_000;
    const CHUNK: usize = 2_000;
    const TTL_MS: u32 = 10_000;
    // The users that leave or arrive are not renewed: their leases outlast
    // the churn, however slowly it runs one at a time (60 s: the most a
    // lease may ask for here).
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
                answers.push((gone.clone(), until_not_refused(&leases, item).await));
                answers.push((new.clone(), until_not_refused(&leases, with_ttl(register(new), CHURN_TTL_MS)).await));
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
    assert!(moved.sessions as usize >= on_a, "every steady session of node-a moved: {moved:?}, {on_a} on node-a");
    let move_ended = Instant::now();
    let churned = churn.await.unwrap();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let _ = stop_renewing.send(());
    let chunks = renewer.await.unwrap();

    // No write was lost: every unregister and register was applied.
    for (user, result) in &churned {
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
    let new = presences(&mut viewer, &arriving).await;
    assert!(new.values().all(|presence| presence.state == pb::State::Online as i32), "every arriving user arrived");
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

/// A task running until told to stop, and what it comes to.
type Running<T> = (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<T>);

/// Renews every user's session every 200 ms through `leases` until told to
/// stop, as a gateway does: each round is sent on time, whether or not the
/// ones before were answered (a part waiting for a dead node's slots to get
/// a new owner holds up no other user). Returns, per round, when it started
/// and the renewals that failed.
fn keep_renewing_by_round(
    leases: std::sync::Arc<ClusterLeases>,
    generations: Vec<(String, u64)>,
    ttl_ms: u32,
) -> Running<Vec<(Instant, Vec<String>)>> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let generations = std::sync::Arc::new(generations);
    let task = tokio::spawn(async move {
        let mut rounds = Vec::new();
        loop {
            let (leases, generations) = (std::sync::Arc::clone(&leases), std::sync::Arc::clone(&generations));
            let started = Instant::now();
            rounds.push((
                started,
                tokio::spawn(async move {
                    let items = generations.iter().map(|(user, generation)| renew(user, *generation, ttl_ms)).collect();
                    let results = leases.submit_batch(items).await;
                    generations
                        .iter()
                        .zip(results)
                        .filter(|(_, result)| result.code != 0)
                        .map(|((user, _), result)| format!("{user}: {result:?}"))
                        .collect::<Vec<String>>()
                }),
            ));
            tokio::select! {
                _ = &mut stopped => break,
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
        let mut answered = Vec::new();
        for (started, round) in rounds {
            answered.push((started, round.await.unwrap()));
        }
        answered
    });
    (stop, task)
}

/// Every event a viewer at `url` is sent for `users` until told to stop,
/// reopening (with the versions it holds, E8) whenever the stream ends or
/// cannot be opened, as a browser does: `(user, state, version)` in order.
fn watch_through_failures(url: String, users: Vec<String>) -> Running<Vec<(String, i32, u64)>> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut seen: Vec<(String, i32, u64)> = Vec::new();
        let mut held: HashMap<String, u64> = HashMap::new();
        loop {
            let opened = async {
                let mut client = PresenceClient::connect(url.clone()).await.ok()?;
                let request =
                    pb::WatchRequest { user_ids: users.clone(), known_versions: held.clone(), ..Default::default() };
                client.watch(request).await.ok().map(tonic::Response::into_inner)
            };
            let stream = tokio::select! {
                _ = &mut stopped => return seen,
                stream = opened => stream,
            };
            if let Some(mut stream) = stream {
                loop {
                    let event = tokio::select! {
                        _ = &mut stopped => return seen,
                        event = stream.message() => event,
                    };
                    let presences = match event {
                        Ok(Some(pb::WatchEvent { event: Some(pb::watch_event::Event::Snapshot(snapshot)) })) => {
                            snapshot.users
                        }
                        Ok(Some(pb::WatchEvent { event: Some(pb::watch_event::Event::Update(update)) })) => {
                            vec![update]
                        }
                        Ok(Some(_)) => continue,
                        _ => break,
                    };
                    for presence in presences {
                        held.insert(presence.user_id.clone(), presence.version);
                        seen.push((presence.user_id, presence.state, presence.version));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (stop, task)
}

/// Asserts that a viewer's events (`watch_through_failures`) hold no
/// OFFLINE (`what` says which) and no user's version going back (M4).
fn assert_no_offline_and_no_version_back(seen: &[(String, i32, u64)], what: &str) {
    let offline: Vec<_> = seen.iter().filter(|(_, state, _)| *state != pb::State::Online as i32).collect();
    assert!(offline.is_empty(), "{what}: {offline:?}");
    let mut last: HashMap<&str, u64> = HashMap::new();
    for (user, _, version) in seen {
        let previous = last.insert(user.as_str(), *version).unwrap_or(0);
        assert!(*version >= previous, "{user}: version {version} after {previous}");
    }
}

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

/// Whether `viewer` sees `user` ONLINE, asked at `client`'s node; a refusal
/// while the user's slot is being taken in there is asked again.
async fn sees_online(client: &mut PresenceClient<Channel>, viewer: &str, user: &str) -> bool {
    let request = pb::SnapshotRequest { user_ids: vec![user.into()], viewer_id: viewer.into() };
    let deadline = Instant::now() + PATIENCE;
    loop {
        match client.snapshot(request.clone()).await {
            Ok(answer) => return answer.into_inner().users[0].state == pb::State::Online as i32,
            Err(refused) if refused.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(refused) => panic!("Snapshot of {user} for {viewer}: {refused:?}"),
        }
    }
}

/// The group ledger a node holds, sorted.
async fn group_ledger(server: &TestServer) -> Vec<(String, String, u64, bool)> {
    let mut cluster = presence_proto::v1::cluster_client::ClusterClient::connect(server.url()).await.unwrap();
    let mut pieces = cluster.group_ledger(pb::GroupLedgerRequest { digests: Vec::new() }).await.unwrap().into_inner();
    let mut entries = Vec::new();
    while let Some(piece) = pieces.message().await.unwrap() {
        entries
            .extend(piece.entries.into_iter().map(|entry| (entry.group_id, entry.user_id, entry.stamp, entry.member)));
    }
    entries.sort();
    entries
}

fn group(group: &str, users: &[&str]) -> pb::GroupRequest {
    pb::GroupRequest { group_id: group.into(), user_ids: users.iter().map(|user| (*user).into()).collect() }
}

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

/// Nodes that allow 16 streams a connection (`--max-streams-per-connection`).
fn few_streams_config() -> ServerConfig {
    ServerConfig { max_streams_per_connection: 16, ..fast_config() }
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

// etcd outages longer than the lease TTL, with the nodes coming back at
// different moments, as real nodes do (C3, C4, M4): at the thaw etcd lets
// every node's lease go at once, and each node learns it at its own next
// keep-alive. Each test goes through several outages on one cluster;
// `PRESENCED_THAW_ROUNDS` sets how many (the soak in docs/cluster.md runs 50).

/// How many outages a thaw test goes through: `PRESENCED_THAW_ROUNDS`, or `default`.
fn thaw_rounds(default: usize) -> usize {
    std::env::var("PRESENCED_THAW_ROUNDS").ok().and_then(|rounds| rounds.parse().ok()).unwrap_or(default)
}

/// The three nodes as processes of their own, so that one can be held back
/// with SIGSTOP, each logging at info to `<node>.log` in `logs`; and the slot
/// map once every node owns slots.
async fn three_node_processes(etcd: &EtcdServer, logs: &std::path::Path) -> Vec<daemon::Daemon> {
    let mut nodes = Vec::new();
    for node in NODES {
        let advertise = format!("127.0.0.1:{}", daemon::free_port());
        let args = node_process_args(etcd, node, &advertise);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = logs.join(format!("{node}.log"));
        nodes.push(daemon::Daemon::start_on(&advertise, &args, &[("RUST_LOG", "info")], Some(&log)));
    }
    map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    nodes
}

/// Which node coordinates now, by etcd's election.
async fn coordinator(etcd: &Etcd) -> String {
    let leader = etcd.leader(&presence_cluster::election_name(PREFIX)).await.unwrap();
    String::from_utf8(leader.expect("a coordinator")).unwrap()
}

/// Freezes etcd (SIGSTOP) for twice the nodes' lease TTL, then thaws it
/// with each node held back (SIGSTOP from 100 ms before the thaw) until
/// `holds[i]` after it (`ZERO`: not held). Returns once every node is
/// registered again under a new lease and every slot has a registered owner.
async fn freeze_and_thaw_staggered(etcd: &EtcdServer, nodes: &[daemon::Daemon], holds: [Duration; 3]) {
    let client = etcd.client().await;
    let before = registrations(&client).await;
    assert_eq!(before.len(), NODES.len(), "every node is registered before the outage: {before:?}");
    etcd.signal("-STOP");
    tokio::time::sleep(Duration::from_millis(3_900)).await;
    let held: Vec<usize> = (0..nodes.len()).filter(|&node| !holds[node].is_zero()).collect();
    held.iter().for_each(|&node| nodes[node].pause());
    tokio::time::sleep(Duration::from_millis(100)).await;
    etcd.signal("-CONT");
    let thawed = Instant::now();
    let mut by_hold = held.clone();
    by_hold.sort_by_key(|&node| holds[node]);
    for node in by_hold {
        tokio::time::sleep_until(thawed + holds[node]).await;
        nodes[node].resume();
    }
    let deadline = Instant::now() + PATIENCE;
    let after = loop {
        let now = registrations(&client).await;
        if now.len() == NODES.len() && now.iter().all(|(node, lease)| before[node] != *lease) {
            break now;
        }
        assert!(Instant::now() < deadline, "the nodes did not all join again under new leases: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    map_where(&client, "every slot has a registered owner", |map| {
        (0..SLOTS).all(|slot| after.contains_key(&map.owner(slot).unwrap().node))
    })
    .await;
}

/// A gateway renewing 300 users' sessions every 200 ms through the routing
/// client, and a viewer watching them at one node, reopening with the
/// versions it holds, while a test breaks things; [`Traffic::finish`]
/// asserts that nothing showed.
struct Traffic {
    users: Vec<String>,
    viewer_url: String,
    before: HashMap<String, pb::UserPresence>,
    renewing: Running<Vec<(Instant, Vec<String>)>>,
    watching: Running<Vec<(String, i32, u64)>>,
    /// When each outage began, and what it was.
    outages: Vec<(Instant, String)>,
}

impl Traffic {
    /// Registers `name-0` … `name-299` entering at `entry`, and watches them at `viewer_url`.
    async fn start(name: &str, entry: &str, viewer_url: &str) -> Traffic {
        let users: Vec<String> = (0..300).map(|i| format!("{name}-{i}")).collect();
        let (leases, generations) = register_all_at(entry, &users).await;
        let mut viewer = PresenceClient::connect(viewer_url.to_owned()).await.unwrap();
        let before = presences(&mut viewer, &users).await;
        let watching = watch_through_failures(viewer_url.to_owned(), users.clone());
        // Sessions of a 3 s TTL, renewed every 200 ms.
        let renewing = keep_renewing_by_round(leases, generations, 3_000);
        tokio::time::sleep(Duration::from_millis(500)).await;
        Traffic { users, viewer_url: viewer_url.to_owned(), before, renewing, watching, outages: Vec::new() }
    }

    /// Notes that an outage described by `what` began at `started`.
    fn outage(&mut self, started: Instant, what: String) {
        self.outages.push((started, what));
    }

    /// Stops, and asserts what C4 and M4 promise: no session lost (no
    /// renewal answered `NOT_FOUND`, naming the outage it was lost in),
    /// the last renewals all answered, nobody shown OFFLINE, no version
    /// going back at the viewer, and every user online at the version it
    /// had. `logs` says where the nodes' logs are.
    async fn finish(self, logs: &std::path::Path) {
        let Traffic { users, viewer_url, before, renewing, watching, outages } = self;
        let _ = renewing.0.send(());
        let rounds = renewing.1.await.unwrap();
        let _ = watching.0.send(());
        let seen = watching.1.await.unwrap();
        let lost: Vec<String> = rounds
            .iter()
            .flat_map(|(at, failed)| failed.iter().map(move |failure| (*at, failure)))
            .filter(|(_, failure)| failure.contains("code: 5,"))
            .map(|(at, failure)| {
                let outage =
                    outages.iter().rev().find(|(started, _)| *started <= at).map_or("before", |(_, what)| what);
                format!("{outage}: {failure}")
            })
            .collect();
        let logs = logs.display();
        assert!(lost.is_empty(), "{} renewals met NOT_FOUND (logs in {logs}), first {:?}", lost.len(), lost.first());
        let settled = rounds.iter().rev().take(3).flat_map(|(_, failed)| failed).collect::<Vec<_>>();
        assert!(settled.is_empty(), "the last rounds of renewals failed (logs in {logs}): {settled:?}");
        assert_no_offline_and_no_version_back(&seen, "no OFFLINE through the outages");
        let mut viewer = PresenceClient::connect(viewer_url).await.unwrap();
        assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
    }
}

/// Runs `rounds` etcd outages on three node processes under [`Traffic`]
/// entering at node-a and watched at node-b; each outage's thaw holds the
/// nodes back as `holds(round, coordinator)` says (by index into `NODES`).
/// Then asserts that nothing showed, and that every user is at one node only.
async fn staggered_thaws(name: &str, rounds: usize, holds: impl Fn(usize, usize) -> [Duration; 3]) {
    let logs = daemon::scratch_dir(name);
    let etcd = EtcdServer::start().await;
    let nodes = three_node_processes(&etcd, &logs).await;
    let mut traffic = Traffic::start(name, &nodes[0].url(), &nodes[1].url()).await;
    let client = etcd.client().await;
    for round in 0..rounds {
        let coordinator = coordinator(&client).await;
        let coordinator = NODES.iter().position(|node| *node == coordinator).unwrap();
        let holds = holds(round, coordinator);
        traffic.outage(Instant::now(), format!("outage {round} (coordinator {}, holds {holds:?})", NODES[coordinator]));
        freeze_and_thaw_staggered(&etcd, &nodes, holds).await;
        // Renewals go on at whichever node the map gives each user now.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    let users = traffic.users.clone();
    traffic.finish(&logs).await;
    // Each node joined again once per lease etcd let go.
    for node in NODES {
        let log = std::fs::read_to_string(logs.join(format!("{node}.log"))).unwrap();
        let joined = log.matches("joined the cluster again").count();
        assert_eq!(
            joined,
            rounds,
            "{node} joined again {joined} times in {rounds} outages (logs in {})",
            logs.display()
        );
    }
    let map = map_where(&client, "the map after the outages", |_| true).await;
    for user in &users {
        let owner = &map.owner(slot_of(user, SLOTS)).unwrap().node;
        for (node, process) in NODES.iter().zip(&nodes) {
            let mut client = PresenceClient::connect(process.url()).await.unwrap();
            let answered = forwarded_snapshot(&mut client, user).await;
            assert_eq!(answered.is_ok(), node == owner, "{user} at {node} (owner {owner}): {answered:?}");
        }
    }
    for node in nodes {
        node.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
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
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    traffic.finish(&logs).await;
    node_a.stop().await;
    for server in servers {
        server.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}
