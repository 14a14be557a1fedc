//! C6: one owner at a time, even through an etcd outage that etcd is not
//! in for every node. node-a, node-b and node-c lose etcd together (etcd
//! still runs, for others), ride the outage out on each other's word, and
//! node-d, which joined after they lost etcd and so is not one they ask,
//! is elected and given their slots. The three must have stopped acting
//! before node-d answers for any of them.

use super::*;

/// One answer to a forwarded Snapshot of one probe user: the node asked,
/// the user's slot, when the call was sent and answered, and, when the node
/// answered as the slot's owner, the node and epoch its reply names.
#[derive(Debug, Clone)]
struct Answer {
    asked: &'static str,
    slot: u32,
    sent: Instant,
    replied: Instant,
    owner: Option<(String, i64)>,
}

/// Asks `url` (node `node`) for each of `probes` every 30 ms until told to stop.
fn probe_node(node: &'static str, url: String, probes: Vec<String>) -> Running<Vec<Answer>> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let channel = tonic::transport::Endpoint::from_shared(url).unwrap().connect_lazy();
        let mut answers = Vec::new();
        loop {
            let asked = probes.iter().map(|user| {
                let mut client = PresenceClient::new(channel.clone());
                let mut request =
                    tonic::Request::new(pb::SnapshotRequest { user_ids: vec![user.clone()], ..Default::default() });
                request.metadata_mut().insert("presenced-forwarded", "1".parse().unwrap());
                request.set_timeout(Duration::from_secs(2));
                let slot = slot_of(user, SLOTS);
                async move {
                    let sent = Instant::now();
                    let answered = client.snapshot(request).await;
                    let replied = Instant::now();
                    // An owner's answer names its node and epoch (one taken
                    // the instant the node gained the slot may not: it is
                    // left out).
                    let owner = answered.ok().and_then(|response| {
                        let header = |name| {
                            response.metadata().get(name).and_then(|value| value.to_str().ok()).map(str::to_owned)
                        };
                        let epoch = header("presenced-epochs")?.parse::<i64>().expect("one epoch");
                        Some((header("presenced-node")?, epoch))
                    });
                    Answer { asked: node, slot, sent, replied, owner }
                }
            });
            answers.extend(asked.collect::<tokio::task::JoinSet<_>>().join_all().await);
            tokio::select! {
                _ = &mut stopped => return answers,
                () = tokio::time::sleep(Duration::from_millis(30)) => {}
            }
        }
    });
    (stop, task)
}

/// One owner at a time, from the replies: an epoch is only ever one
/// node's, and no answer at an older epoch of a slot was sent after an
/// answer at a newer one had come back (two owners would answer in turns).
/// Answers whose windows overlap across a planned move are not told apart:
/// the old owner may have decided before the new one acted. Returns how
/// many answers were checked.
fn assert_one_owner_per_slot_at_a_time(answers: &[Answer], start: Instant) -> usize {
    let mut by_slot: HashMap<u32, Vec<(i64, &Answer)>> = HashMap::new();
    let mut epochs: HashMap<(u32, i64), &str> = HashMap::new();
    for answer in answers {
        let Some((node, epoch)) = &answer.owner else { continue };
        assert_eq!(node, answer.asked, "the node asked is the node that answered: {answer:?}");
        let first = *epochs.entry((answer.slot, *epoch)).or_insert(answer.asked);
        assert_eq!(first, answer.asked, "slot {} epoch {epoch} answered by two nodes", answer.slot);
        by_slot.entry(answer.slot).or_default().push((*epoch, answer));
    }
    let mut checked = 0;
    for (slot, mut answers) in by_slot {
        checked += answers.len();
        // Newest epoch first: each answer is held against the earliest reply
        // of every newer epoch.
        answers.sort_by_key(|(epoch, _)| std::cmp::Reverse(*epoch));
        let mut newer: Option<&Answer> = None;
        let mut at = 0;
        while at < answers.len() {
            let epoch = answers[at].0;
            let same: Vec<&Answer> = answers[at..].iter().take_while(|(e, _)| *e == epoch).map(|(_, a)| *a).collect();
            if let Some(newer) = newer {
                for answer in &same {
                    assert!(
                        answer.sent < newer.replied,
                        "slot {slot}: {} answered at epoch {epoch} from {:?} after the start, when {} had answered \
                         at epoch {:?} by {:?}",
                        answer.asked,
                        answer.sent - start,
                        newer.asked,
                        newer.owner,
                        newer.replied - start,
                    );
                }
            }
            let earliest = same.iter().min_by_key(|answer| answer.replied).copied();
            newer = match (newer, earliest) {
                (Some(newer), Some(earliest)) if newer.replied <= earliest.replied => Some(newer),
                (_, earliest) => earliest.or(newer),
            };
            at += same.len();
        }
    }
    checked
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c6_nodes_riding_out_an_outage_stand_down_before_a_node_etcd_answers_takes_their_slots() {
    // node-a, node-b and node-c run in a network namespace; etcd listens on
    // the host's group 1 address, node-d and the clients on group 0's. Cutting
    // group 1 off cuts the three from etcd, and from nothing else.
    let name = "fencing";
    let logs = daemon::scratch_dir(name);
    let lab = presence_faults::NetLab::new(2).expect("a network namespace (root, ip, nft)");
    let etcd = EtcdServer::start_on(lab.group_ip(1)).await;
    // A ride-out far longer than the test: only the coordinator's asking
    // can make the three stop acting in time.
    let ride_out = Duration::from_secs(60);
    let prefix = ["ip", "netns", "exec", lab.namespace()];
    let mut nodes = Vec::new();
    for node in NODES {
        let advertise = format!("{}:{}", lab.server_ip(), daemon::free_port());
        let mut args = node_process_args(&etcd, node, &advertise);
        args.extend(["--insecure".to_owned(), "--etcd-ride-out-ms".to_owned(), ride_out.as_millis().to_string()]);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = logs.join(format!("{node}.log"));
        nodes.push(daemon::Daemon::start_through(&prefix, &advertise, &args, &[("RUST_LOG", "info")], Some(&log)));
    }
    let client = etcd.client().await;
    let map =
        map_where(&client, "every node owns slots", |map| NODES.iter().all(|node| map.owned_by(node).count() > 0))
            .await;
    let users: Vec<String> = (0..200).map(|i| format!("fenced-{i}")).collect();
    let (leases, generations) = register_all_at(&nodes[0].url(), &users).await;
    // Four probe users of each node's slots.
    let probes: Vec<String> = NODES
        .iter()
        .flat_map(|node| {
            let owned = |user: &&String| map.owner(slot_of(user, SLOTS)).unwrap().node == *node;
            users.iter().filter(owned).take(4).cloned().collect::<Vec<_>>()
        })
        .collect();
    let (stop_renewing, renewer) = keep_renewing_by_round(std::sync::Arc::clone(&leases), generations, 3_000);
    let start = Instant::now();
    let mut probing: Vec<Running<Vec<Answer>>> =
        NODES.iter().zip(&nodes).map(|(node, daemon)| probe_node(node, daemon.url(), probes.clone())).collect();
    tokio::time::sleep(Duration::from_millis(500)).await;

    // etcd is cut off from the three; it runs on, for node-d, which joins now.
    lab.partition(1).unwrap();
    let cut = Instant::now();
    let node_d = TestServer::start_with_at(lab.group_ip(0), |addr| {
        let mut config = node_config_with(&etcd, "node-d", addr, fast_config());
        config.cluster.as_mut().expect("a cluster node").ride_out = ride_out;
        config
    })
    .await;
    probing.push(probe_node("node-d", node_d.url(), probes.clone()));
    // etcd lets the three's leases go; node-d is elected and given every slot.
    map_where(&client, "node-d owns every slot", |map| map.owned_by("node-d").count() == SLOTS as usize).await;
    let given = cut.elapsed();
    let deadline = Instant::now() + PATIENCE;
    for user in &probes {
        while forwarded_snapshot(&mut node_d.client().await, user).await.is_err() {
            assert!(Instant::now() < deadline, "node-d does not answer for {user}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    let answering = cut.elapsed();
    // A while longer with node-d answering and the three still cut off.
    tokio::time::sleep(Duration::from_secs(2)).await;

    // The cut heals: the three hear etcd again, find their leases gone and
    // join again, and are given slots back by planned moves.
    lab.heal(1).unwrap();
    let all: Vec<String> = NODES.iter().map(|node| node.to_string()).chain(["node-d".to_owned()]).collect();
    map_where(&client, "every node owns slots again, evenly", |map| {
        all.iter().all(|node| map.owned_by(node).count() > 0) && presence_cluster::rebalancing_move(map, &all).is_none()
    })
    .await;
    let healed = cut.elapsed();
    tokio::time::sleep(Duration::from_secs(1)).await;
    let mut answers = Vec::new();
    for (stop, task) in probing {
        let _ = stop.send(());
        answers.extend(task.await.unwrap());
    }
    let _ = stop_renewing.send(());
    let rounds = renewer.await.unwrap();

    let checked = assert_one_owner_per_slot_at_a_time(&answers, start);
    // The three did ride the outage out on each other's word, and stood down
    // when node-d's coordinator asked.
    for node in NODES {
        let log = std::fs::read_to_string(logs.join(format!("{node}.log"))).unwrap();
        assert!(log.contains("etcd answers none of the other nodes either"), "{node} did not ride the outage out");
        assert!(log.contains("acting past the lease no more"), "{node} was not asked to stand down");
    }
    let owned_by = |node: &str| answers.iter().filter(|answer| answer.owner.is_some() && answer.asked == node).count();
    assert!(owned_by("node-d") > 0 && NODES.iter().all(|node| owned_by(node) > 0), "every node answered");
    let last_failed = rounds.iter().rev().take(2).flat_map(|(_, failed)| failed).count();
    eprintln!(
        "C6: {checked} owners' answers checked; node-d given every slot {given:?} after the cut, answering for \
         every probe {answering:?} after; healed and even {healed:?} after; renewals failed in the last rounds: \
         {last_failed}"
    );
    node_d.stop().await;
    for node in nodes {
        node.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}
