//! L8, L7 and B1 on the Leases stream, over real gRPC: batches of mixed items,
//! one result per item in order, refusals that fail only their item, and a
//! stream that survives them.

use crate::common::*;
use presence_proto::v1::{self as pb, lease_item, lease_result};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Code;

fn item(op: lease_item::Op) -> pb::LeaseItem {
    pb::LeaseItem { op: Some(op) }
}

fn code(result: &pb::LeaseResult) -> Code {
    Code::from(result.code as i32)
}

/// A gateway's open Leases stream.
struct Gateway {
    outbound: mpsc::Sender<pb::LeaseBatch>,
    inbound: tonic::Streaming<pb::LeaseResults>,
    next_batch: u64,
}

impl Gateway {
    async fn open(server: &TestServer) -> Gateway {
        let (outbound, rx) = mpsc::channel(4);
        let inbound = server.client().await.leases(ReceiverStream::new(rx)).await.unwrap().into_inner();
        Gateway { outbound, inbound, next_batch: 1 }
    }

    async fn send(&mut self, items: Vec<pb::LeaseItem>) -> Vec<pb::LeaseResult> {
        let batch_id = self.next_batch;
        self.next_batch += 1;
        self.outbound.send(pb::LeaseBatch { batch_id, items }).await.unwrap();
        let results = self.inbound.message().await.expect("a healthy stream").expect("an open stream");
        assert_eq!(results.batch_id, batch_id);
        results.results
    }
}

fn generation_of(result: &pb::LeaseResult) -> u64 {
    match &result.result {
        Some(lease_result::Result::Register(response)) => response.generation,
        other => panic!("expected a register result, got {other:?}"),
    }
}

#[tokio::test]
async fn l8_one_result_per_item_in_order_and_a_bad_item_fails_alone() {
    let server = TestServer::start(fast_config()).await;
    let mut gateway = Gateway::open(&server).await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u1", "u2", "u3", "sentinel"]).await;

    let registered = gateway
        .send(vec![
            item(lease_item::Op::Register(register("u1", "s1", "gw", 0))),
            item(lease_item::Op::Register(register("", "s1", "gw", 0))),
            item(lease_item::Op::Register(register("u2", "s1", "gw", 0))),
            item(lease_item::Op::Register(register("u3", "s1", "gw", 5))),
        ])
        .await;
    let codes: Vec<Code> = registered.iter().map(code).collect();
    assert_eq!(codes, [Code::Ok, Code::InvalidArgument, Code::Ok, Code::InvalidArgument]);
    assert!(registered[1].message.contains("user_id"), "{:?}", registered[1].message);
    assert!(registered[3].message.contains("ttl_ms"), "{:?}", registered[3].message);
    let (g1, g2) = (generation_of(&registered[0]), generation_of(&registered[2]));
    // u2's ONLINE reaches the viewer before its unregister is sent: otherwise
    // a viewer that reads late may get the two flips conflated into the
    // newest (E4), and this test is about each item's own result.
    viewer.until_state("u2", pb::State::Online).await;

    // A renewal of an unknown lease is a per-item NOT_FOUND, not the end of the stream.
    let renewed = gateway
        .send(vec![
            item(lease_item::Op::Renew(renew("u1", "s1", g1, 0))),
            item(lease_item::Op::Renew(renew("nobody", "s1", 1, 0))),
            item(lease_item::Op::Renew(renew("u2", "s1", g2 - 1, 0))),
            item(lease_item::Op::Unregister(unregister("u2", "s1", g2, 0))),
        ])
        .await;
    let codes: Vec<Code> = renewed.iter().map(code).collect();
    assert_eq!(codes, [Code::Ok, Code::NotFound, Code::FailedPrecondition, Code::Ok]);
    match &renewed[3].result {
        Some(lease_result::Result::Unregister(response)) => assert!(response.removed && response.changed),
        other => panic!("{other:?}"),
    }

    // The stream is still healthy, and the flips reached the viewer.
    let again = gateway.send(vec![item(lease_item::Op::Renew(renew("u1", "s1", g1, 0)))]).await;
    assert_eq!(code(&again[0]), Code::Ok);
    viewer.barrier(&mut server.client().await, "sentinel").await;
    assert_eq!(viewer.updates_of("u1").len(), 1);
    assert_eq!(
        viewer.updates_of("u2").iter().map(|(state, _)| *state).collect::<Vec<_>>(),
        [pb::State::Online, pb::State::Offline]
    );
    assert!(viewer.updates_of("u3").is_empty());
    server.stop().await;
}

#[tokio::test]
async fn l8_batches_of_many_sessions_apply_in_order_within_one_stream() {
    let server = TestServer::start(fast_config()).await;
    let mut gateway = Gateway::open(&server).await;
    // Register, renew and unregister 2,000 sessions, one batch each, back to back:
    // a renewal can only succeed if its register was applied first.
    let sessions = 2_000;
    let users: Vec<String> = (0..sessions).map(|i| format!("user{}", i / 2)).collect();
    let session = |i: usize| format!("sess_{i:012}");
    let registers = (0..sessions).map(|i| item(lease_item::Op::Register(register(&users[i], &session(i), "gw", 0))));
    let results = gateway.send(registers.collect()).await;
    let generations: Vec<u64> = results.iter().map(generation_of).collect();
    let renewals = (0..sessions).map(|i| item(lease_item::Op::Renew(renew(&users[i], &session(i), generations[i], 0))));
    assert!(gateway.send(renewals.collect()).await.iter().all(|r| code(r) == Code::Ok));
    let unregisters =
        (0..sessions).map(|i| item(lease_item::Op::Unregister(unregister(&users[i], &session(i), generations[i], 0))));
    let results = gateway.send(unregisters.collect()).await;
    assert_eq!(results.iter().filter(|r| code(r) == Code::Ok).count(), sessions);
    let mut client = server.client().await;
    let now = snapshot(&mut client, &["user0", "user999"]).await;
    assert!(now.iter().all(|p| state_of(p) == pb::State::Offline));
    server.stop().await;
}

#[tokio::test]
async fn b1_an_oversized_batch_ends_the_stream_with_invalid_argument_and_changes_nothing() {
    let server = TestServer::start(fast_config()).await;
    let mut gateway = Gateway::open(&server).await;
    let items: Vec<_> = (0..presence_server::MAX_BATCH_ITEMS + 1)
        .map(|i| item(lease_item::Op::Register(register(&format!("u{i}"), "s", "gw", 0))))
        .collect();
    gateway.outbound.send(pb::LeaseBatch { batch_id: 1, items }).await.unwrap();
    let refused = gateway.inbound.message().await.expect_err("the batch is refused");
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert!(refused.message().contains("items"), "{refused:?}");
    let mut client = server.client().await;
    assert_eq!(state_of(&snapshot(&mut client, &["u0"]).await[0]), pb::State::Offline);
    server.stop().await;
}

#[tokio::test]
async fn l7_renewals_within_the_minimum_interval_are_acknowledged_without_a_write() {
    let mut config = fast_config();
    config.store.min_renew_interval_ms = 60_000;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let registered = client.register(register("u1", "s1", "gw", 10_000)).await.unwrap().into_inner();
    for _ in 0..3 {
        let renewed = client.renew(renew("u1", "s1", registered.generation, 10_000)).await.unwrap().into_inner();
        assert!(renewed.throttled);
        assert_eq!(renewed.expires_at_ms, registered.expires_at_ms, "a throttled renewal moves nothing");
    }
    // The throttle never lets a stale generation through.
    let stale = client.renew(renew("u1", "s1", registered.generation - 1, 10_000)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
    server.stop().await;
}
