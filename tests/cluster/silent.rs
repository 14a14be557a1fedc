//! C4 made precise: a node that stops without a word (a frozen process, a
//! host cut off alone, a minority cut off together) is taken over within
//! its lease TTL and a second, like one that died; only nodes that could
//! together be riding an etcd outage out (a majority of the cluster, cut
//! off from etcd but not from each other) are waited out, as C6 needs.
//!
//! Each test goes through `PRESENCED_SILENT_ROUNDS` rounds (docs/cluster.md
//! reports 20) and prints every takeover's time.

use super::*;
use crate::common::within;
use presence_faults::NetLab;

/// The nodes' etcd lease TTL in these tests (`node_process_args`, `node_config`).
const TTL: Duration = Duration::from_secs(2);

/// Waits until the cluster has run long enough for a coordinator to know
/// what a node that goes silent now saw of it: a lease TTL and etcd's
/// expiry slack (`presence_cluster::EXPIRY_SLACK`), as any cluster that has
/// run a while. A node that goes silent sooner is waited a ride-out out.
async fn until_seen_long_enough(started: Instant) {
    tokio::time::sleep_until(started + TTL + presence_cluster::EXPIRY_SLACK + Duration::from_millis(500)).await;
}

/// How many rounds a test goes through: `PRESENCED_SILENT_ROUNDS`, or `default`.
fn silent_rounds(default: usize) -> usize {
    std::env::var("PRESENCED_SILENT_ROUNDS").ok().and_then(|rounds| rounds.parse().ok()).unwrap_or(default)
}

/// Prints the takeover times of `what`: each, the median and the longest.
fn report(what: &str, times: &[Duration]) {
    let mut sorted = times.to_vec();
    sorted.sort();
    let median = sorted[sorted.len() / 2];
    let longest = sorted[sorted.len() - 1];
    eprintln!("{what}: {} takeovers, p50 {median:?}, max {longest:?}: {times:?}", times.len());
}

/// Up to five of `users` whose slots `node` owns in `map`.
fn users_of(map: &presence_cluster::SlotMap, node: &str, users: &[String]) -> Vec<String> {
    users.iter().filter(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == node).take(5).cloned().collect()
}

/// Asserts that `client`, at a node that was silent, answers for none of
/// `users` under the ownership it had before (`before`, the map then): a
/// node that joined again may own a slot again already (the coordinator
/// gives a node back its share within a second of its return), and then
/// answers under the new epoch it was given, which its answer names.
async fn assert_serves_none_of(
    client: &mut PresenceClient<Channel>,
    node: &str,
    users: &[String],
    before: &presence_cluster::SlotMap,
) {
    for user in users {
        let mut request =
            tonic::Request::new(pb::SnapshotRequest { user_ids: vec![user.clone()], ..Default::default() });
        request.metadata_mut().insert("presenced-forwarded", "1".parse().unwrap());
        let Ok(answered) = client.snapshot(request).await else { continue };
        let epoch = answered.metadata().get("presenced-epochs").and_then(|value| value.to_str().ok()?.parse().ok());
        let old_epoch = before.owner(slot_of(user, SLOTS)).unwrap().epoch;
        assert!(
            epoch.is_some_and(|epoch: i64| epoch > old_epoch),
            "{node} answered for {user} under the ownership it had before (epoch {old_epoch}), not a new one \
             ({epoch:?}): {answered:?}"
        );
    }
}

/// Waits until each of `nodes` is registered under a lease other than the
/// one `before` names, and the slots of every node in `all` are even again.
async fn until_joined_again_and_even(etcd: &Etcd, before: &HashMap<String, i64>, nodes: &[&str], all: &[&str]) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let now = registrations(etcd).await;
        if nodes.iter().all(|node| now.get(*node).is_some_and(|lease| Some(lease) != before.get(*node))) {
            break;
        }
        assert!(Instant::now() < deadline, "{nodes:?} did not join again: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let live: Vec<String> = all.iter().map(|node| node.to_string()).collect();
    map_where(etcd, "the slots even again", |map| {
        live.iter().all(|node| map.owned_by(node).count() > 0)
            && presence_cluster::rebalancing_move(map, &live).is_none()
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_a_node_frozen_with_sigstop_is_taken_over_within_its_lease_ttl_and_a_second_and_nobody_flips() {
    // Three node processes on loopback with the default ride-out (10 s): a
    // frozen node's sockets stay open and nothing answers on them, as with
    // a host that lost power or a VM its hypervisor paused.
    let name = "frozen";
    let logs = daemon::scratch_dir(name);
    let etcd = EtcdServer::start().await;
    let started = Instant::now();
    let nodes = three_node_processes(&etcd, &logs).await;
    let client = etcd.client().await;
    let leader = coordinator(&client).await;
    let leads = NODES.iter().position(|node| *node == leader).unwrap();
    // The gateway and the viewer at the coordinator, which stays up.
    let mut traffic = Traffic::start(name, &nodes[leads].url(), &nodes[leads].url()).await;
    let others: Vec<usize> = (0..NODES.len()).filter(|&node| node != leads).collect();
    until_seen_long_enough(started).await;
    let mut takeovers = Vec::new();
    for round in 0..silent_rounds(2) {
        let frozen = others[round % others.len()];
        let node = NODES[frozen];
        let before = registrations(&client).await;
        let map = map_where(&client, "the map before the freeze", |_| true).await;
        let theirs = users_of(&map, node, &traffic.users);
        assert!(!theirs.is_empty(), "{node} owns some of the users");
        traffic.outage(Instant::now(), format!("{node} frozen (round {round})"));
        let froze = Instant::now();
        nodes[frozen].pause();
        map_where(&client, "the frozen node's slots taken over", |map| map.owned_by(node).count() == 0).await;
        let took = froze.elapsed();
        takeovers.push(took);
        assert!(took <= TTL + Duration::from_secs(1), "round {round}: {node} taken over {took:?} after the freeze");
        // Its users renew at their new owners meanwhile (Traffic::finish).
        tokio::time::sleep(Duration::from_secs(1)).await;
        nodes[frozen].resume();
        let mut resumed = PresenceClient::connect(nodes[frozen].url()).await.unwrap();
        assert_serves_none_of(&mut resumed, node, &theirs, &map).await;
        until_joined_again_and_even(&client, &before, &[node], &NODES).await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    report("a node frozen with SIGSTOP (TTL 2 s, ride-out 10 s)", &takeovers);
    traffic.finish(&logs).await;
    for node in nodes {
        node.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}

/// `count` node processes in a network namespace, each at its own port of
/// the lab's server address, named `names`; logging at info to `<node>.log`.
fn processes_in_lab(
    lab: &NetLab,
    etcd: &EtcdServer,
    names: &[&str],
    ride_out: Duration,
    logs: &std::path::Path,
) -> Vec<daemon::Daemon> {
    let prefix = ["ip", "netns", "exec", lab.namespace()];
    names
        .iter()
        .map(|node| {
            let advertise = format!("{}:{}", lab.server_ip(), daemon::free_port());
            let mut args = node_process_args(etcd, node, &advertise);
            // Open, on an address other than loopback: the lab's own network.
            args.push("--insecure".to_owned());
            args.extend(["--etcd-ride-out-ms".to_owned(), ride_out.as_millis().to_string()]);
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            let log = logs.join(format!("{node}.log"));
            daemon::Daemon::start_through(&prefix, &advertise, &args, &[("RUST_LOG", "info")], Some(&log))
        })
        .collect()
}

/// Nodes in this process at the lab's group 0 address, named `names`, with
/// `ride_out`, each holding what it takes over for the restart grace of
/// production's defaults (the default TTL, 45 s), as the node processes
/// do: a gateway's client waits its response timeout (10 s) on a silent
/// owner before it sends that owner's renewals elsewhere.
async fn servers_on_the_host(lab: &NetLab, etcd: &EtcdServer, names: &[&str], ride_out: Duration) -> Vec<TestServer> {
    let mut servers = Vec::new();
    for node in names {
        let config = |addr| {
            let held = ServerConfig { restart_grace: Some(Duration::from_secs(45)), ..fast_config() };
            let mut config = node_config_with(etcd, node, addr, held);
            config.cluster.as_mut().expect("a cluster node").ride_out = ride_out;
            config
        };
        servers.push(TestServer::start_with_at(lab.group_ip(0), config).await);
    }
    servers
}

/// Cuts the lab's namespace off from the host's nodes (group 0) and from
/// etcd (group 1), or heals both.
fn cut_off(lab: &NetLab, cut: bool) {
    for group in [0, 1] {
        if cut { lab.partition(group) } else { lab.heal(group) }.unwrap();
    }
}

/// Runs [`silent_rounds`] cuts of `inside`, node processes in a network
/// namespace, from etcd and from `outside`, nodes in this process (the
/// first of which coordinates), under [`Traffic`] entering at the
/// coordinator; `during` checks each cut from its start and returns the
/// takeover's time. Asserts what [`Traffic::finish`] does, that a node of
/// `inside` serves none of its old users when the cut heals, and that each
/// of them rode the outage out if `rode_out`, and said it had no majority
/// and rode nothing out otherwise.
async fn cuts<F, Fut>(name: &str, inside: &[&str], outside: &[&str], ride_out: Duration, rode_out: bool, during: F)
where
    F: Fn(Etcd, Instant, Vec<String>) -> Fut,
    Fut: std::future::Future<Output = Duration>,
{
    let logs = daemon::scratch_dir(name);
    let lab = NetLab::new(2).expect("a network namespace (root, ip, nft)");
    let etcd = EtcdServer::start_on(lab.group_ip(1)).await;
    // The first node outside starts first and is elected coordinator; the
    // others start once it is (its start returns before it campaigns, and a
    // node of the lab could win the election on a busy machine otherwise).
    let started = Instant::now();
    let mut servers = servers_on_the_host(&lab, &etcd, &outside[..1], ride_out).await;
    let client = etcd.client().await;
    within(PATIENCE, "the first node started coordinates", async {
        while etcd_leader(&client).await.as_deref() != Some(outside[0]) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let nodes = processes_in_lab(&lab, &etcd, inside, ride_out, &logs);
    servers.extend(servers_on_the_host(&lab, &etcd, &outside[1..], ride_out).await);
    let all: Vec<&str> = inside.iter().chain(outside).copied().collect();
    map_where(&client, "every node owns slots", |map| all.iter().all(|node| map.owned_by(node).count() > 0)).await;
    assert_eq!(coordinator(&client).await, outside[0], "the first node started coordinates");
    // Sessions of 15 s: the gateway is cut off from the nodes inside too,
    // and its client reaches them again only up to its connect timeout (5 s)
    // and reconnect backoff (5 s) after the cut heals, while planned moves
    // give them slots back within a second (docs/cluster.md, "A node that
    // stops without a word": what gateways see).
    let mut traffic = Traffic::start_with_ttl(name, &servers[0].url(), &servers[0].url(), 15_000).await;
    until_seen_long_enough(started).await;
    let mut takeovers = Vec::new();
    for round in 0..silent_rounds(1) {
        let before = registrations(&client).await;
        let map = map_where(&client, "the map before the cut", |_| true).await;
        let theirs: Vec<(usize, Vec<String>)> =
            inside.iter().enumerate().map(|(at, node)| (at, users_of(&map, node, &traffic.users))).collect();
        traffic.outage(Instant::now(), format!("{inside:?} cut off (round {round})"));
        let cut = Instant::now();
        cut_off(&lab, true);
        let inside_ids: Vec<String> = inside.iter().map(|node| node.to_string()).collect();
        takeovers.push(during(client.clone(), cut, inside_ids).await);
        tokio::time::sleep(Duration::from_secs(1)).await;
        cut_off(&lab, false);
        for (at, users) in &theirs {
            let port = probe_port(nodes[*at].addr());
            let mut resumed = PresenceClient::new(lab.endpoint(0, port).connect().await.unwrap());
            assert_serves_none_of(&mut resumed, inside[*at], users, &map).await;
        }
        until_joined_again_and_even(&client, &before, inside, &all).await;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    report(name, &takeovers);
    if inside.len() == 1 {
        traffic.finish(&logs).await;
    } else {
        // A slot's one copy is at its follower: where that was the other
        // node cut off, its users went with the two (docs/cluster.md,
        // "Limits"); this test is about when their slots move.
        traffic.stop().await;
    }
    for node in inside {
        let log = std::fs::read_to_string(logs.join(format!("{node}.log"))).unwrap();
        let rode = log.contains("etcd answers none of the other nodes either");
        let said_no_majority = log.contains("fewer than a majority of the cluster's nodes");
        let logs = logs.display();
        assert_eq!(rode, rode_out, "{node} rode the outage out: {rode} (logs in {logs})");
        assert!(rode_out || said_no_majority, "{node} did not say it had no majority (logs in {logs})");
    }
    for node in nodes {
        node.stop().await;
    }
    for server in servers {
        server.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_a_node_cut_off_from_etcd_and_every_other_node_alone_is_taken_over_within_its_lease_ttl_and_a_second() {
    // node-a in a network namespace; node-b (the coordinator), node-c, etcd
    // and the gateway on the host. node-a hears nobody: it cannot tell a
    // network cut from an etcd outage, and gets no word to ride anything out.
    cuts("cut-off-alone-silent", &["node-a"], &["node-b", "node-c"], Duration::from_secs(10), false, {
        |etcd: Etcd, cut: Instant, _inside: Vec<String>| async move {
            map_where(&etcd, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
            let took = cut.elapsed();
            assert!(took <= TTL + Duration::from_secs(1), "node-a taken over {took:?} after the cut");
            took
        }
    })
    .await;
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_two_nodes_of_five_cut_off_together_are_a_minority_ride_nothing_out_and_are_taken_over_in_time() {
    // node-a and node-b in a network namespace hear each other and nobody
    // else; node-c (the coordinator), node-d, node-e and etcd on the host.
    // Two words of five are no majority: they stop at their leases' ends.
    let inside = ["node-a", "node-b"];
    let outside = ["node-c", "node-d", "node-e"];
    cuts("minority", &inside, &outside, Duration::from_secs(10), false, {
        |etcd: Etcd, cut: Instant, inside: Vec<String>| async move {
            map_where(&etcd, "the two's slots taken over", |map| {
                inside.iter().all(|node| map.owned_by(node).count() == 0)
            })
            .await;
            let took = cut.elapsed();
            assert!(took <= TTL + Duration::from_secs(1), "the two taken over {took:?} after the cut");
            took
        }
    })
    .await;
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_two_nodes_of_three_cut_off_together_ride_the_outage_out_and_the_coordinator_waits_it_out() {
    // node-a and node-b in a network namespace hear each other and nobody
    // else; node-c (the coordinator) and etcd on the host. Two words of
    // three are a majority: they ride the outage out, and node-c, which
    // cannot reach them, gives their slots away only after the ride-out.
    let inside = ["node-a", "node-b"];
    let ride_out = Duration::from_secs(4);
    cuts("majority", &inside, &["node-c"], ride_out, true, {
        |etcd: Etcd, cut: Instant, inside: Vec<String>| async move {
            // Their leases lapse at etcd within a TTL; their slots stay theirs a ride-out longer.
            tokio::time::sleep(TTL + Duration::from_secs(1)).await;
            let map = map_where(&etcd, "the map", |_| true).await;
            for node in &inside {
                assert!(map.owned_by(node).count() > 0, "{node}'s slots were given away while it could be riding out");
            }
            map_where(&etcd, "the two's slots taken over", |map| {
                inside.iter().all(|node| map.owned_by(node).count() == 0)
            })
            .await;
            let took = cut.elapsed();
            // At least the ride-out after their leases went, which they
            // last renewed at most a third of the TTL before the cut.
            assert!(took >= ride_out + TTL * 2 / 3, "taken over {took:?} after the cut, within the ride-out");
            took
        }
    })
    .await;
}
