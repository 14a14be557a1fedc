//! D2: `/livez` and `/readyz` on the metrics port, probed as an orchestrator
//! probes them, on node processes: a node joining is not ready until it holds
//! its share of the slots; a node told to stop is not ready before it refuses
//! anything.

use super::*;
use crate::common::scrape::probe;

/// A node process with its metrics port; its metrics address.
fn node_process(etcd: &EtcdServer, node: &str) -> (daemon::Daemon, String) {
    let advertise = format!("127.0.0.1:{}", daemon::free_port());
    let metrics = format!("127.0.0.1:{}", daemon::free_port());
    let mut args = node_process_args(etcd, node, &advertise);
    args.extend(["--metrics-listen".to_owned(), metrics.clone()]);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    (daemon::Daemon::start_on(&advertise, &args, &[], None), metrics)
}

/// Probes `/readyz` until it answers 200; its body then.
async fn until_ready(metrics: &str) -> String {
    until_ready_seeing(metrics).await.0
}

/// Probes `/readyz` until it answers 200: its body then, and every line of
/// a failed check it said before.
async fn until_ready_seeing(metrics: &str) -> (String, std::collections::BTreeSet<String>) {
    let deadline = Instant::now() + PATIENCE;
    let mut failed = std::collections::BTreeSet::new();
    loop {
        let (status, body) = probe(metrics, "/readyz");
        if status == 200 {
            return (body, failed);
        }
        failed.extend(body.lines().filter(|line| line.starts_with("[-]")).map(str::to_owned));
        assert!(Instant::now() < deadline, "not ready within {PATIENCE:?}:\n{body}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn d2_a_joining_node_is_ready_once_it_holds_its_share_and_a_stopping_one_is_not_ready_before_it_refuses() {
    let etcd = EtcdServer::start().await;
    let (node_a, metrics_a) = node_process(&etcd, "node-a");
    let (node_b, metrics_b) = node_process(&etcd, "node-b");
    for metrics in [&metrics_a, &metrics_b] {
        let body = until_ready(metrics).await;
        for check in ["started", "not-draining", "slot-map", "share", "rooms"] {
            assert!(body.contains(&format!("[+]{check} ok")), "{body}");
        }
        assert_eq!(probe(metrics, "/livez"), (200, "ok\n".to_owned()));
    }

    // 20,000 users' sessions, so that moving a share of the slots takes a while.
    let mut generations = Vec::new();
    for part in 0..2 {
        let users: Vec<String> = (0..10_000).map(|i| format!("ready-{part}-{i}")).collect();
        generations.extend(register_all_at(&node_a.url(), &users).await.1);
    }

    // node-c joins a cluster whose slots are all given out: it owns none
    // until the coordinator's moves bring it its share.
    let (node_c, metrics_c) = node_process(&etcd, "node-c");
    let (status, body) = probe(&metrics_c, "/readyz");
    assert_eq!(status, 503, "{body}");
    assert!(body.ends_with("not ready\n") && body.contains("[-]"), "{body}");
    assert_eq!(probe(&metrics_c, "/livez").0, 200, "alive while not ready");
    let (_, failed) = until_ready_seeing(&metrics_c).await;
    assert!(failed.iter().any(|line| line.starts_with("[-]share failed: owns ")), "{failed:?}");
    let map = map_where(&etcd.client().await, "the map once node-c is ready", |_| true).await;
    let (share, slack) = presence_cluster::even_share(SLOTS, 3);
    let owned = map.owned_by("node-c").count();
    assert!(owned + slack >= share, "ready owning {owned} slots of a share of {share}");

    // One of node-b's users, renewed straight at node-b (a forwarded request,
    // so that it refuses what it no longer owns), again and again, until
    // node-b refuses it: the slot moves in the drain's first handover at
    // the latest, and every slot that moves is refused from its start.
    let (user, generation) =
        generations.iter().find(|(user, _)| map.owner(slot_of(user, SLOTS)).unwrap().node == "node-b").unwrap();
    node_b_refuses_only_after_it_is_not_ready(&node_b, &metrics_b, user, *generation).await;
    drop((node_a, node_c));
}

/// SIGTERMs node-b while renewing `user`'s session there, and asserts that
/// the first refusal came after node-b stopped being ready: `/readyz`,
/// asked right after the refusal, says `not-draining` failed.
async fn node_b_refuses_only_after_it_is_not_ready(
    node_b: &daemon::Daemon,
    metrics_b: &str,
    user: &str,
    generation: u64,
) {
    let mut at_b = PresenceClient::connect(node_b.url()).await.unwrap();
    let items = || vec![renew(user, generation, 30_000)];
    let results = lease_batch_forwarded(&mut at_b, items()).await;
    assert!(results.iter().all(|result| result.code == 0), "renewed at node-b before its stop");
    assert_eq!(probe(metrics_b, "/readyz").0, 200);
    let status = std::process::Command::new("kill").args(["-TERM", &node_b.child.id().to_string()]).status();
    assert!(status.unwrap().success());
    let deadline = Instant::now() + PATIENCE;
    loop {
        let refused = match tokio::time::timeout(PATIENCE, lease_batch_forwarded_result(&mut at_b, items())).await {
            Ok(Ok(results)) => results.iter().any(|result| result.code != 0),
            Ok(Err(_)) | Err(_) => true,
        };
        if refused {
            break;
        }
        assert!(Instant::now() < deadline, "node-b went on answering after its SIGTERM");
    }
    let (status, body) = probe(metrics_b, "/readyz");
    assert_eq!(status, 503, "node-b refused a renewal while ready:\n{body}");
    assert!(body.contains("[-]not-draining failed: shutting down"), "{body}");
}

/// A `Leases` batch at one node, marked forwarded so that it refuses users
/// it does not own instead of passing them on.
async fn lease_batch_forwarded(
    client: &mut PresenceClient<Channel>,
    items: Vec<pb::LeaseItem>,
) -> Vec<pb::LeaseResult> {
    lease_batch_forwarded_result(client, items).await.unwrap()
}

async fn lease_batch_forwarded_result(
    client: &mut PresenceClient<Channel>,
    items: Vec<pb::LeaseItem>,
) -> Result<Vec<pb::LeaseResult>, tonic::Status> {
    let mut request = tonic::Request::new(tokio_stream::iter([pb::LeaseBatch { batch_id: 1, items }]));
    request.metadata_mut().insert("presenced-forwarded", "1".parse().unwrap());
    let mut answers = client.leases(request).await?.into_inner();
    let batch = answers.message().await?.ok_or_else(|| tonic::Status::unavailable("the stream ended"))?;
    Ok(batch.results)
}
