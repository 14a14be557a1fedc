//! What privacy filtering costs (issue: under 20 percent): the same Snapshot
//! and Watch fan-out workloads against an open server and against one with
//! credentials and audiences, in one process, back to back.
//!
//! - Snapshot: 500 users per call, 4 callers, 2,000 calls; calls per second.
//! - Fan-out: 100 viewers each watching 500 of 5,000 online users; 20 rounds
//!   of 1,000 flips; updates delivered per second until every viewer holds the
//!   final state.
//!
//! In the secured run the viewers are real viewers (JWTs) and every watched
//! user is visible to them through a shared group, so both runs deliver the
//! same updates and the difference is the filtering itself. Run with
//! `cargo bench --bench privacy_cost`; figures in docs/benchmarks.md.

use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use presence_proto::v1::{self as pb, lease_item, presence_client::PresenceClient, watch_event};
use presence_server::{AuthConfig, ServerConfig};
use tokio::net::TcpListener;
use tonic::transport::Channel;

const USERS: usize = 5_000;
const VIEWERS: usize = 100;
const WATCHED: usize = 500;
const ROUNDS: usize = 20;
const FLIPS_PER_ROUND: usize = 1_000;
const SERVICE: &str = "bench-service-token";
const SECRET: &str = "bench-only-hs256-secret-at-least-32-bytes!";

fn request<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().unwrap());
    }
    request
}

fn viewer_token(viewer: &str) -> String {
    let exp = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_secs() + 3_600;
    let claims = serde_json::json!({ "sub": viewer, "exp": exp });
    let key = jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
    jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims, &key).unwrap()
}

fn user(index: usize) -> String {
    format!("u{index}")
}

/// Watched users of viewer `v`: 500 users spread over the population.
fn watched(viewer: usize) -> Vec<String> {
    (0..WATCHED).map(|i| user((viewer * 37 + i * 10) % USERS)).collect()
}

async fn lease_batch(
    client: &mut PresenceClient<Channel>,
    items: Vec<pb::LeaseItem>,
    token: Option<&str>,
) -> Vec<pb::LeaseResult> {
    let batch = pb::LeaseBatch { batch_id: 1, items };
    let mut results = client.leases(request(tokio_stream::iter([batch]), token)).await.unwrap().into_inner();
    results.message().await.unwrap().unwrap().results
}

fn register(user: &str) -> pb::LeaseItem {
    let request = pb::RegisterRequest {
        user_id: user.into(),
        session_id: "s".into(),
        gateway_id: "gw".into(),
        ttl_ms: 600_000,
        ..Default::default()
    };
    pb::LeaseItem { op: Some(lease_item::Op::Register(request)) }
}

fn unregister(user: &str, generation: u64) -> pb::LeaseItem {
    let request = pb::UnregisterRequest { user_id: user.into(), session_id: "s".into(), generation, linger_ms: 0 };
    pb::LeaseItem { op: Some(lease_item::Op::Unregister(request)) }
}

fn generation(result: &pb::LeaseResult) -> u64 {
    match &result.result {
        Some(pb::lease_result::Result::Register(response)) => response.generation,
        other => panic!("register refused: {} {other:?}", result.message),
    }
}

struct Figures {
    snapshots_per_sec: f64,
    updates: usize,
    fanout_secs: f64,
}

async fn run(secured: bool) -> Figures {
    let mut config = ServerConfig::default();
    config.store.min_renew_interval_ms = 0;
    let service = secured.then_some(SERVICE);
    if secured {
        config.auth = AuthConfig {
            service_tokens: vec![SERVICE.into()],
            viewer_jwt_hs256_secret: Some(SECRET.into()),
            ..AuthConfig::default()
        };
    }
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(presence_server::serve(listener, config, async {
        let _ = stopped.await;
    }));
    let mut client = PresenceClient::connect(url.clone()).await.unwrap();

    let users: Vec<String> = (0..USERS).map(user).collect();
    let mut generations = Vec::with_capacity(USERS);
    for chunk in users.chunks(1_000) {
        let results = lease_batch(&mut client, chunk.iter().map(|u| register(u)).collect(), service).await;
        generations.extend(results.iter().map(generation));
    }
    let viewer_ids: Vec<String> = (0..VIEWERS).map(|v| format!("v{v}")).collect();
    if secured {
        // Everyone visible to every viewer through one shared group: the same updates as the open run.
        let members: Vec<String> = users.iter().chain(&viewer_ids).cloned().collect();
        let join = pb::GroupRequest { group_id: "everyone".into(), user_ids: members };
        client.join_group(request(join, service)).await.unwrap();
    }
    let tokens: Vec<Option<String>> = viewer_ids.iter().map(|v| secured.then(|| viewer_token(v))).collect();

    // Snapshot: 4 callers, 500 users each call.
    let started = Instant::now();
    let callers: Vec<_> = (0..4)
        .map(|caller| {
            let (url, token) = (url.clone(), tokens[caller].clone());
            tokio::spawn(async move {
                let mut client = PresenceClient::connect(url).await.unwrap();
                for call in 0..500 {
                    let ids = watched(caller * 7 + call % 10);
                    let snapshot = pb::SnapshotRequest { user_ids: ids, viewer_id: String::new() };
                    let users = client.snapshot(request(snapshot, token.as_deref())).await.unwrap().into_inner().users;
                    assert!(
                        users.iter().all(|u| u.state == pb::State::Online as i32),
                        "every user is visible and online"
                    );
                }
            })
        })
        .collect();
    for caller in callers {
        caller.await.unwrap();
    }
    let snapshots_per_sec = 2_000.0 / started.elapsed().as_secs_f64();

    // Fan-out: viewers follow their users while a gateway flips them.
    let viewers: Vec<_> = (0..VIEWERS)
        .map(|v| {
            let (url, token) = (url.clone(), tokens[v].clone());
            tokio::spawn(async move {
                let mut client = PresenceClient::connect(url).await.unwrap();
                let watch = pb::WatchRequest { user_ids: watched(v), ..Default::default() };
                let mut stream = client.watch(request(watch, token.as_deref())).await.unwrap().into_inner();
                let mut held: HashMap<String, (i32, u64)> = HashMap::new();
                let mut updates = 0usize;
                let mut last = Instant::now();
                // Until the stream has been quiet for a while after the churn.
                while let Ok(Ok(Some(event))) = tokio::time::timeout(Duration::from_secs(3), stream.message()).await {
                    match event.event.unwrap() {
                        watch_event::Event::Snapshot(snapshot) => {
                            held = snapshot.users.into_iter().map(|u| (u.user_id, (u.state, u.version))).collect();
                        }
                        watch_event::Event::Update(u) => {
                            updates += 1;
                            last = Instant::now();
                            held.insert(u.user_id, (u.state, u.version));
                        }
                        watch_event::Event::Updates(_) => unreachable!("this watch asked for no batch window"),
                        watch_event::Event::Added(_) => unreachable!("this watch is never changed"),
                    }
                }
                (updates, last, held)
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(500)).await; // every watch open
    let churn_started = Instant::now();
    for round in 0..ROUNDS {
        let flipped: Vec<usize> = (0..FLIPS_PER_ROUND).map(|i| (round * 131 + i * 5) % USERS).collect();
        let offs = flipped.iter().map(|&i| unregister(&users[i], generations[i])).collect();
        lease_batch(&mut client, offs, service).await;
        let ons = lease_batch(&mut client, flipped.iter().map(|&i| register(&users[i])).collect(), service).await;
        for (&i, result) in flipped.iter().zip(&ons) {
            generations[i] = generation(result);
        }
    }
    let mut updates = 0;
    let mut finished = churn_started;
    for viewer in viewers {
        let (count, last, held) = viewer.await.unwrap();
        updates += count;
        finished = finished.max(last);
        assert!(held.values().all(|(state, _)| *state == pb::State::Online as i32), "every viewer ends on the truth");
    }
    let _ = stop.send(());
    let _ = server.await;
    Figures { snapshots_per_sec, updates, fanout_secs: (finished - churn_started).as_secs_f64() }
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let open = run(false).await;
    let secured = run(true).await;
    for (name, figures) in [("open", &open), ("privacy", &secured)] {
        println!(
            "privacy_cost: {name:>7}: snapshot(500 users) {:.0} calls/s; fan-out {} updates in {:.2} s = {:.0} updates/s",
            figures.snapshots_per_sec,
            figures.updates,
            figures.fanout_secs,
            figures.updates as f64 / figures.fanout_secs
        );
    }
    println!(
        "privacy_cost: filtering costs {:.1}% of snapshot throughput and {:.1}% of fan-out throughput",
        100.0 * (1.0 - secured.snapshots_per_sec / open.snapshots_per_sec),
        100.0 * (1.0 - (secured.updates as f64 / secured.fanout_secs) / (open.updates as f64 / open.fanout_secs))
    );
}
