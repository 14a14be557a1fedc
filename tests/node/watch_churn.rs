//! E1/E3 under concurrency: several gateways churn the same users while viewers
//! watch; every update a viewer gets is newer than what it holds, and once the
//! churn stops every viewer ends equal to a fresh Snapshot.

use crate::common::*;
use presence_proto::v1 as pb;

const USERS: usize = 16;
const GATEWAYS: usize = 4;
const OPS_PER_GATEWAY: usize = 600;

/// A small deterministic generator, so a failure replays the same churn.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

fn user(index: usize) -> String {
    format!("churn-user-{index}")
}

/// One gateway: registers, renews, unregisters (sometimes with a stale
/// generation, sometimes lingering) and revokes, on users other gateways also touch.
async fn churn(server_addr: std::net::SocketAddr, gateway: usize) {
    let mut client =
        presence_proto::v1::presence_client::PresenceClient::connect(format!("http://{server_addr}")).await.unwrap();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ (gateway as u64 + 1));
    let mut generations: Vec<Option<(String, u64)>> = vec![None; USERS];
    let gateway_id = format!("gw-{gateway}");
    for _ in 0..OPS_PER_GATEWAY {
        let index = rng.below(USERS);
        let user_id = user(index);
        // Two sessions per user per gateway: collisions within and across gateways.
        let session = format!("{gateway_id}-s{}", rng.below(2));
        match rng.below(10) {
            0..=3 => {
                // Short TTLs so that expiries race with requests too.
                let ttl = [25, 60, 300][rng.below(3)];
                let registered =
                    client.register(register(&user_id, &session, &gateway_id, ttl)).await.unwrap().into_inner();
                generations[index] = Some((session, registered.generation));
            }
            4..=5 => {
                if let Some((session, generation)) = &generations[index] {
                    let _ = client.renew(renew(&user_id, session, *generation, 0)).await;
                }
            }
            6..=7 => {
                if let Some((session, generation)) = generations[index].take() {
                    let stale = rng.below(4) == 0;
                    let generation = if stale { generation.saturating_sub(1) } else { generation };
                    let linger = [0, 0, 30][rng.below(3)];
                    client.unregister(unregister(&user_id, &session, generation, linger)).await.unwrap();
                }
            }
            8 => {
                let session_id = if rng.below(2) == 0 { String::new() } else { session };
                client.revoke(pb::RevokeRequest { user_id: user_id.clone(), session_id }).await.unwrap();
            }
            _ => {
                let _ = snapshot(&mut client, &[&user_id]).await;
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e3_viewers_see_only_newer_versions_and_end_equal_to_a_snapshot() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let users: Vec<String> = (0..USERS).map(user).collect();
    let user_refs: Vec<&str> = users.iter().map(String::as_str).collect();

    let mut early = Viewer::open(&mut client, &user_refs).await;
    let gateways: Vec<_> = (0..GATEWAYS).map(|gateway| tokio::spawn(churn(server.addr, gateway))).collect();

    // Viewers that join mid-churn, and one that watches a subset.
    let mut late = Viewer::open(&mut client, &user_refs).await;
    let mut partial = Viewer::open(&mut client, &user_refs[..USERS / 2]).await;
    // And one that takes its changes in batches.
    let mut batched = Viewer::open_request(&mut client, tonic::Request::new(batched_watch(&users, 5))).await;
    // Consume while the churn runs, so the streams also see it live (each `step` checks E3).
    let churn_done = async {
        for gateway in gateways {
            gateway.await.unwrap();
        }
    };
    tokio::pin!(churn_done);
    loop {
        tokio::select! {
            () = &mut churn_done => break,
            _ = early.step() => {}
            _ = late.step() => {}
            _ = partial.step() => {}
            _ = batched.step() => {}
        }
    }
    let mut viewers = [&mut early, &mut late, &mut partial, &mut batched];

    // Leases left by the churn expire within their short TTLs; wait until none are live, so
    // that the final state is stable, then compare every viewer with a fresh snapshot.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let final_state = loop {
        let now = snapshot(&mut client, &user_refs).await;
        if now.iter().all(|p| state_of(p) == pb::State::Offline) {
            break now;
        }
        assert!(tokio::time::Instant::now() < deadline, "leases never ran out: {now:?}");
        // Leases still live: let a viewer take the next change (the expiry) rather than spin.
        viewers[0].step().await;
    };
    for viewer in viewers.iter_mut() {
        let watched: Vec<pb::UserPresence> =
            final_state.iter().filter(|p| viewer.held.contains_key(&p.user_id)).cloned().collect();
        viewer.until_equal(&watched).await;
        assert_eq!(viewer.resyncs, 0);
    }
    let updates = viewers[0].updates.len();
    assert!(updates >= USERS, "the churn flipped users many times ({updates} updates)");
    assert!(batched.batches.iter().any(|&len| len > 1), "a 5 ms window over this churn gathers: {:?}", batched.batches);
    server.stop().await;
}

fn batched_watch(users: &[String], batch_window_ms: u32) -> pb::WatchRequest {
    pb::WatchRequest { user_ids: users.to_vec(), batch_window_ms, ..Default::default() }
}

#[tokio::test]
async fn e4_a_batch_window_gathers_changes_into_one_event_and_conflates_within_it() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let users = ["bx".to_string(), "by".to_string()];
    // A long window: the three calls below land in it however slow the machine.
    let mut viewer = Viewer::open_request(&mut client, tonic::Request::new(batched_watch(&users, 1_000))).await;
    let x = client.register(register("bx", "s", "gw", 60_000)).await.unwrap().into_inner();
    client.register(register("by", "s", "gw", 60_000)).await.unwrap();
    client.unregister(unregister("bx", "s", x.generation, 0)).await.unwrap();

    let first = viewer.step().await.expect("an update");
    let second = viewer.step().await.expect("an update");
    assert_eq!(viewer.batches, [2], "one event for the window, bx's two changes conflated to the newest");
    assert_eq!((first.user_id.as_str(), state_of(&first)), ("bx", pb::State::Offline));
    assert_eq!((second.user_id.as_str(), state_of(&second)), ("by", pb::State::Online));
    let seen = |p: &pb::UserPresence| (p.user_id.clone(), state_of(p), p.version);
    let truth: Vec<_> = snapshot(&mut client, &["bx", "by"]).await.iter().map(seen).collect();
    assert_eq!(truth, [seen(&first), seen(&second)], "the batch carries the current truth");
    server.stop().await;
}
