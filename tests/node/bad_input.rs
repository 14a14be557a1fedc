//! B1: bad input gets INVALID_ARGUMENT naming the field, and leaves every
//! other piece of state exactly as it was.

use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tonic::transport::Channel;
use tonic::{Code, Status};

/// The wire shape of RegisterRequest with its strings as raw bytes, so that a
/// test can send what no well-behaved client would: invalid UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
struct RawRegisterRequest {
    #[prost(bytes = "vec", tag = "1")]
    user_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "2")]
    session_id: Vec<u8>,
    #[prost(bytes = "vec", tag = "3")]
    gateway_id: Vec<u8>,
    #[prost(uint32, tag = "4")]
    ttl_ms: u32,
}

async fn raw_register(server: &TestServer, request: RawRegisterRequest) -> Result<pb::RegisterResponse, Status> {
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<RawRegisterRequest, pb::RegisterResponse>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/presence.v1.Presence/Register");
    grpc.unary(tonic::Request::new(request), path, codec).await.map(tonic::Response::into_inner)
}

fn assert_invalid(result: Result<impl std::fmt::Debug, Status>, field: &str) {
    let status = result.expect_err("bad input must be refused");
    assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
    assert!(status.message().contains(field), "the message must name {field}: {:?}", status.message());
}

/// Everything a client can observe about the users of these tests.
async fn observable(client: &mut PresenceClient<Channel>) -> Vec<pb::UserPresence> {
    snapshot(client, &["u1", "u2", "u3"]).await
}

#[tokio::test]
async fn b1_each_bad_field_is_named_and_nothing_else_changes() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u1", "u2", "u3", "sentinel"]).await;

    let u1 = client.register(register("u1", "s1", "gw", 60_000)).await.unwrap().into_inner();
    let u2 = client.register(register("u2", "s1", "gw", 60_000)).await.unwrap().into_inner();
    client.unregister(unregister("u2", "s1", u2.generation, 0)).await.unwrap();
    let before = observable(&mut client).await;
    viewer.barrier(&mut client, "sentinel").await;
    let updates_before = viewer.updates.len();

    let long = "x".repeat(129);
    let max = "y".repeat(128);
    // Register
    assert_invalid(client.register(register("", "s", "gw", 0)).await, "user_id");
    assert_invalid(client.register(register(&long, "s", "gw", 0)).await, "user_id");
    assert_invalid(client.register(register("u1", "", "gw", 0)).await, "session_id");
    assert_invalid(client.register(register("u1", &long, "gw", 0)).await, "session_id");
    assert_invalid(client.register(register("u1", "s9", "", 0)).await, "gateway_id");
    assert_invalid(client.register(register("u1", "s9", &long, 0)).await, "gateway_id");
    assert_invalid(client.register(register("u3", "s", "gw", 19)).await, "ttl_ms");
    assert_invalid(client.register(register("u3", "s", "gw", 60_001)).await, "ttl_ms");
    let mut big_metadata = register("u3", "s", "gw", 0);
    big_metadata.metadata.insert("k".into(), "v".repeat(10_000));
    assert_invalid(client.register(big_metadata).await, "metadata");
    // Renew
    assert_invalid(client.renew(renew("", "s1", u1.generation, 0)).await, "user_id");
    assert_invalid(client.renew(renew("u1", &long, u1.generation, 0)).await, "session_id");
    assert_invalid(client.renew(renew("u1", "s1", u1.generation, 5)).await, "ttl_ms");
    // Unregister and Revoke
    assert_invalid(client.unregister(unregister(&long, "s1", u1.generation, 0)).await, "user_id");
    assert_invalid(client.unregister(unregister("u1", "", u1.generation, 0)).await, "session_id");
    let revoke =
        |user_id: &str, session_id: &str| pb::RevokeRequest { user_id: user_id.into(), session_id: session_id.into() };
    assert_invalid(client.revoke(revoke("", "")).await, "user_id");
    assert_invalid(client.revoke(revoke("u1", &long)).await, "session_id");
    // Snapshot and Watch
    let ids = |ids: Vec<String>| pb::SnapshotRequest { user_ids: ids, ..Default::default() };
    assert_invalid(client.snapshot(ids(vec!["u1".into(), String::new()])).await, "user_ids");
    assert_invalid(client.snapshot(ids(vec![long.clone()])).await, "user_ids");
    assert_invalid(client.snapshot(ids((0..10_001).map(|i| i.to_string()).collect())).await, "user_ids");
    let watch = |ids: Vec<String>| pb::WatchRequest { user_ids: ids, ..Default::default() };
    assert_invalid(client.watch(watch(vec![long.clone()])).await, "user_ids");
    assert_invalid(client.watch(watch((0..10_001).map(|i| i.to_string()).collect())).await, "user_ids");
    let batched = pb::WatchRequest { user_ids: vec!["u1".into()], batch_window_ms: 1_001, ..Default::default() };
    assert_invalid(client.watch(batched).await, "batch_window_ms");
    // Undecodable bytes: invalid UTF-8 in a string field.
    let raw = |user_id: Vec<u8>| RawRegisterRequest {
        user_id,
        session_id: b"s".to_vec(),
        gateway_id: b"gw".to_vec(),
        ttl_ms: 0,
    };
    assert_invalid(raw_register(&server, raw(vec![0xff, 0xfe, b'u'])).await, "user_id");
    // A 128-byte id is still fine, and a well-formed raw request works: the refusals above were about the bytes.
    client.register(register(&max, "s", "gw", 0)).await.expect("128 bytes is within the limit");
    raw_register(&server, raw(b"u3".to_vec())).await.expect("valid bytes register");

    // Oversized messages are refused before they are decoded.
    let huge = pb::SnapshotRequest { user_ids: vec!["z".repeat(100); 50_000], ..Default::default() };
    let refused = client.snapshot(huge).await.expect_err("a 5 MB request is refused");
    assert!(
        matches!(refused.code(), Code::OutOfRange | Code::ResourceExhausted | Code::InvalidArgument),
        "{refused:?}"
    );

    // Nothing about u1 and u2 changed, and u1's lease still renews with its generation.
    let mut after = observable(&mut client).await;
    assert_eq!(after[..2], before[..2]);
    assert_eq!(state_of(&after.pop().unwrap()), pb::State::Online, "u3 registered by the valid raw request");
    client.renew(renew("u1", "s1", u1.generation, 0)).await.expect("u1's lease is intact");
    viewer.barrier(&mut client, "sentinel").await;
    let mut new_updates: Vec<_> = viewer.updates[updates_before..].iter().map(|u| u.user_id.as_str()).collect();
    // A mailbox keeps each user's newest change (E4): the sentinel's ONLINE
    // reaches a viewer on its own or replaced by its OFFLINE.
    new_updates.dedup();
    assert_eq!(new_updates, ["u3", "sentinel"], "the only flips are the valid register's and the barrier's");
    server.stop().await;
}

/// L8 and B1 over the wire: a Leases batch whose items carry bytes that are not
/// UTF-8 (what the generated client cannot even send) gets those items refused,
/// naming the field, and every other item answered; the stream stays open.
#[tokio::test]
async fn l8_items_with_undecodable_text_are_refused_alone_and_the_stream_goes_on() {
    use presence_proto::lease_frames::{LeaseBatchFrame, LeaseItemFrame, LeaseOpFrame, RegisterFrame, RenewFrame};

    let server = TestServer::start(fast_config()).await;
    let text = |text: &'static str| bytes::Bytes::from_static(text.as_bytes());
    let not_utf8 = bytes::Bytes::from_static(&[0xff, 0xfe, b'u']);
    let register = |user_id: bytes::Bytes, gateway_id: bytes::Bytes| LeaseItemFrame {
        op: Some(LeaseOpFrame::Register(RegisterFrame {
            user_id,
            session_id: text("s"),
            gateway_id,
            ttl_ms: 60_000,
            ..RegisterFrame::default()
        })),
    };
    let renew = |user_id: bytes::Bytes, generation: u64| LeaseItemFrame {
        op: Some(LeaseOpFrame::Renew(RenewFrame {
            user_id,
            session_id: text("s"),
            generation,
            ttl_ms: 60_000,
            ..RenewFrame::default()
        })),
    };
    let (outbound, rx) = tokio::sync::mpsc::channel(4);
    let channel = Channel::from_shared(format!("http://{}", server.addr)).unwrap().connect().await.unwrap();
    let mut grpc = tonic::client::Grpc::new(channel);
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<LeaseBatchFrame, pb::LeaseResults>::default();
    let path = tonic::codegen::http::uri::PathAndQuery::from_static("/presence.v1.Presence/Leases");
    outbound
        .send(LeaseBatchFrame {
            batch_id: 1,
            items: vec![
                register(not_utf8.clone(), text("gw")),
                register(text("l8a"), text("gw")),
                register(text("l8b"), not_utf8.clone()),
            ],
            ..Default::default()
        })
        .await
        .unwrap();
    let request = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(rx));
    let mut results = grpc.streaming(request, path, codec).await.expect("the stream opens").into_inner();
    let first = results.message().await.expect("answered").expect("a batch of results");
    let codes: Vec<Code> = first.results.iter().map(|r| Code::from(r.code as i32)).collect();
    assert_eq!(codes, [Code::InvalidArgument, Code::Ok, Code::InvalidArgument]);
    assert!(first.results[0].message.starts_with("user_id:"), "{:?}", first.results[0]);
    assert!(first.results[2].message.starts_with("gateway_id:"), "{:?}", first.results[2]);
    let Some(pb::lease_result::Result::Register(l8a)) = &first.results[1].result else { panic!("{first:?}") };

    // The same stream goes on: a renewal with a bad id beside a good one.
    outbound
        .send(LeaseBatchFrame {
            batch_id: 2,
            items: vec![renew(not_utf8, 1), renew(text("l8a"), l8a.generation)],
            ..Default::default()
        })
        .await
        .unwrap();
    let second = results.message().await.expect("answered").expect("a batch of results");
    let codes: Vec<Code> = second.results.iter().map(|r| Code::from(r.code as i32)).collect();
    assert_eq!(codes, [Code::InvalidArgument, Code::Ok]);
    let mut client = server.client().await;
    let states: Vec<pb::State> = snapshot(&mut client, &["l8a", "l8b"]).await.iter().map(state_of).collect();
    assert_eq!(states, [pb::State::Online, pb::State::Offline], "only the good register took effect");
    server.stop().await;
}

/// A refused field reaches the client as data too: a `google.rpc.BadRequest`
/// field violation, on a unary call and whichever RPC it was.
#[tokio::test]
async fn b1_a_refused_field_travels_as_a_bad_request_detail() {
    use tonic_types::StatusExt;
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let violation = |status: Status| {
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        let details = status.get_details_bad_request().expect("a BadRequest detail");
        assert_eq!(details.field_violations.len(), 1, "{details:?}");
        let violation = &details.field_violations[0];
        assert!(status.message().starts_with(&format!("{}: ", violation.field)), "{status:?}");
        (violation.field.clone(), violation.description.clone())
    };
    let refused = client.register(register("", "s", "gw", 0)).await.unwrap_err();
    assert_eq!(violation(refused), ("user_id".to_string(), "must not be empty".to_string()));
    let refused = client.renew(renew("u", "s", 1, 5)).await.unwrap_err();
    assert_eq!(violation(refused).0, "ttl_ms");
    let snapshot = pb::SnapshotRequest { user_ids: vec!["a".into(), String::new()], ..Default::default() };
    let refused = client.snapshot(snapshot).await.unwrap_err();
    assert_eq!(violation(refused), ("user_ids".to_string(), "entry 1 must not be empty".to_string()));
    let status = pb::SetStatusRequest { user_id: "u".into(), status: Some(pb::Status::default()) };
    assert_eq!(violation(client.set_status(status).await.unwrap_err()).0, "status.availability");
    server.stop().await;
}

#[tokio::test]
async fn b4_a_user_has_at_most_256_settings_and_replacing_one_is_always_allowed() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let put = |name: String, value: &[u8]| pb::PutSettingRequest { user_id: "ann".into(), name, value: value.to_vec() };
    for i in 0..presence_server::MAX_SETTINGS_PER_USER {
        client.put_setting(put(format!("s{i}"), b"v")).await.unwrap();
    }
    let refused = client.put_setting(put("one-more".into(), b"v")).await.unwrap_err();
    assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
    assert!(refused.message().contains("256 settings"), "{refused:?}");
    client.put_setting(put("s0".into(), b"replaced")).await.expect("a name held is replaced");
    let other = pb::PutSettingRequest { user_id: "bob".into(), name: "one-more".into(), value: b"v".to_vec() };
    client.put_setting(other).await.expect("the limit is per user");
    let settings = client.get_settings(pb::GetSettingsRequest { user_id: "ann".into() }).await.unwrap().into_inner();
    assert_eq!(settings.settings.len(), 256);
    assert_eq!(settings.settings["s0"], b"replaced");
    assert!(!settings.settings.contains_key("one-more"));
    server.stop().await;
}

#[tokio::test]
async fn d1_a_request_of_another_major_node_to_node_protocol_is_refused_naming_both_versions_before_it_is_read() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let from_a_node = |protocol: &'static str| {
        let mut request =
            tonic::Request::new(pb::SnapshotRequest { user_ids: vec!["u1".into()], ..Default::default() });
        request.metadata_mut().insert("presenced-cluster-protocol", protocol.parse().unwrap());
        request.metadata_mut().insert("presenced-version", "9.0.0".parse().unwrap());
        request
    };
    // A later minor of this major is read as this version reads it.
    client.snapshot(from_a_node("1.9")).await.expect("a later minor only adds fields");
    let refused = client.snapshot(from_a_node("2.0")).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(
        refused.message().starts_with(
            "a node running presenced 9.0.0 speaks node-to-node protocol 2.0, which this node (presenced "
        ) && refused.message().ends_with("must share the protocol's major version"),
        "{refused:?}"
    );
    let malformed = client.snapshot(from_a_node("two")).await.unwrap_err();
    assert_eq!(malformed.code(), Code::InvalidArgument);
    assert!(malformed.message().contains("presenced-cluster-protocol"), "{malformed:?}");
    server.stop().await;
}
