//! E4 over real gRPC: a viewer that stops reading neither blocks gateways nor
//! other viewers, and when it reads again it is resynced with a fresh
//! snapshot, never left with a silent gap.

use crate::common::*;
use presence_proto::v1::{self as pb, lease_item};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

const USERS: usize = 200;
const ROUNDS: usize = 40;
const BUFFER: usize = 16;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn e4_a_stalled_viewer_blocks_nobody_and_is_resynced_when_it_reads_again() {
    let mut config = fast_config();
    config.watch_buffer = BUFFER;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let users: Vec<String> = (0..USERS).map(|i| format!("u{i}")).collect();
    let user_refs: Vec<&str> = users.iter().map(String::as_str).collect();

    // The stalled viewer watches more users than its buffer holds; the attentive one fewer,
    // so that it can never need a resync, whatever the bursts.
    let mut stalled = Viewer::open(&mut client, &user_refs).await;
    let mut attentive = Viewer::open(&mut client, &user_refs[..BUFFER]).await;

    // A gateway flips every user ROUNDS times in batches, while `stalled` reads nothing.
    let (outbound, rx) = mpsc::channel(4);
    let mut inbound = client.leases(ReceiverStream::new(rx)).await.unwrap().into_inner();
    let gateway_users = users.clone();
    let gateway = tokio::spawn(async move {
        let users = gateway_users;
        for round in 0..ROUNDS {
            let registers = users
                .iter()
                .map(|user| pb::LeaseItem { op: Some(lease_item::Op::Register(register(user, "s", "gw", 60_000))) })
                .collect();
            outbound.send(pb::LeaseBatch { batch_id: round as u64 * 2, items: registers }).await.unwrap();
            let results = inbound.message().await.unwrap().unwrap().results;
            let unregisters = users
                .iter()
                .zip(results)
                .map(|(user, result)| {
                    let Some(pb::lease_result::Result::Register(registered)) = result.result else {
                        panic!("register refused: {result:?}")
                    };
                    pb::LeaseItem {
                        op: Some(lease_item::Op::Unregister(unregister(user, "s", registered.generation, 0))),
                    }
                })
                .collect();
            outbound.send(pb::LeaseBatch { batch_id: round as u64 * 2 + 1, items: unregisters }).await.unwrap();
            inbound.message().await.unwrap().unwrap();
        }
    });

    // The attentive viewer keeps up while the other one stalls; the gateway finishes.
    tokio::pin!(gateway);
    loop {
        tokio::select! {
            finished = &mut gateway => { finished.unwrap(); break; }
            _ = attentive.step() => {}
        }
    }
    let final_state = snapshot(&mut client, &user_refs).await;
    attentive.until_equal(&final_state[..BUFFER]).await;
    assert_eq!(attentive.resyncs, 0, "a viewer within its buffer is never resynced");
    // It followed the churn live (conflation may merge a user's flips it had not yet taken).
    let followed = attentive.updates.len();
    assert!(followed > BUFFER * 2 && followed <= BUFFER * ROUNDS * 2, "{followed} updates");

    // The stalled viewer reads again: it was resynced, and ends equal to the truth with no stale update.
    stalled.until_equal(&final_state).await;
    assert!(stalled.resyncs >= 1, "{USERS} users changed {ROUNDS} times past a 16-user buffer: expected a resync");
    server.stop().await;
}
