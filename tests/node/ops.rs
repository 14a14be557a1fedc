//! O4, the operator's API over real gRPC: `ListSessions` shows a user's live
//! sessions with their rooms and deadlines, `Stats` the service's own
//! figures, and both are for service callers only.

use std::time::Duration;

use crate::common::auth::{SERVICE, secured_config, viewer_token};
use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

async fn list_sessions(client: &mut PresenceClient<Channel>, user_id: &str) -> pb::ListSessionsResponse {
    client.list_sessions(pb::ListSessionsRequest { user_id: user_id.into() }).await.unwrap().into_inner()
}

async fn stats(client: &mut PresenceClient<Channel>) -> pb::StatsResponse {
    client.stats(pb::StatsRequest {}).await.unwrap().into_inner()
}

#[tokio::test]
async fn o4_list_sessions_shows_each_live_session_with_its_gateway_deadline_and_rooms() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let mut phone = register("u1", "phone", "gw-a", 10_000);
    phone.metadata.insert("device".into(), "ios".into());
    let phone = client.register(phone).await.unwrap().into_inner();
    let laptop = client.register(register("u1", "laptop", "gw-b", 20_000)).await.unwrap().into_inner();
    let join = pb::JoinRequest {
        user_id: "u1".into(),
        session_id: "phone".into(),
        generation: phone.generation,
        room_id: "doc-7".into(),
        metadata: Default::default(),
    };
    client.join(join).await.unwrap();

    let listed = list_sessions(&mut client, "u1").await;
    let sessions: Vec<_> = listed
        .sessions
        .iter()
        .map(|s| (s.session_id.as_str(), s.gateway_id.as_str(), s.generation, s.expires_at_ms, s.rooms.clone()))
        .collect();
    assert_eq!(
        sessions,
        [
            ("laptop", "gw-b", laptop.generation, laptop.expires_at_ms, Vec::<String>::new()),
            ("phone", "gw-a", phone.generation, phone.expires_at_ms, vec!["doc-7".to_string()]),
        ],
        "the newest first, deadlines as Register answered them"
    );
    let phone_listed = &listed.sessions[1];
    assert_eq!(phone_listed.metadata.get("device").map(String::as_str), Some("ios"));
    assert!(!phone_listed.lingering);
    // The server's own time, in the same Unix ms as the deadlines.
    assert!(listed.now_ms >= phone_listed.last_renewed_at_ms && listed.now_ms < phone.expires_at_ms, "{listed:?}");
    assert_eq!(phone.expires_at_ms - phone_listed.last_renewed_at_ms, 10_000);

    client.unregister(unregister("u1", "laptop", laptop.generation, 5_000)).await.unwrap();
    let laptop_listed = list_sessions(&mut client, "u1").await.sessions.remove(0);
    assert!(laptop_listed.lingering, "a lingering lease is listed as such until it runs out");
    client.revoke(pb::RevokeRequest { user_id: "u1".into(), session_id: String::new() }).await.unwrap();
    assert!(list_sessions(&mut client, "u1").await.sessions.is_empty());
    assert!(list_sessions(&mut client, "never-seen").await.sessions.is_empty());
}

#[tokio::test]
async fn o4_list_sessions_names_a_bad_user_id() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    for user_id in [String::new(), "x".repeat(129)] {
        let refused = client.list_sessions(pb::ListSessionsRequest { user_id }).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
        assert!(refused.message().starts_with("user_id: "), "{:?}", refused.message());
        let details = refused.get_details_bad_request().expect("a BadRequest detail");
        assert_eq!(details.field_violations[0].field, "user_id");
    }
}

#[tokio::test]
async fn o4_the_operators_rpcs_are_for_services_only() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let viewer = viewer_token("v1", false);
    for token in [None, Some(viewer.as_str()), Some(SERVICE)] {
        let listed = client.list_sessions(with_token(pb::ListSessionsRequest { user_id: "u1".into() }, token)).await;
        let read = client.stats(with_token(pb::StatsRequest {}, token)).await;
        let expected = match token {
            None => Some(Code::Unauthenticated),
            Some(SERVICE) => None,
            Some(_) => Some(Code::PermissionDenied),
        };
        assert_eq!(listed.err().map(|status| status.code()), expected, "ListSessions with {token:?}");
        assert_eq!(read.err().map(|status| status.code()), expected, "Stats with {token:?}");
    }
}

#[tokio::test]
async fn o4_stats_reports_what_the_service_holds_and_what_it_counted() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let first = stats(&mut client).await;
    assert_eq!(first.version, env!("CARGO_PKG_VERSION"));
    let ttl = first.ttl.expect("the TTL settings");
    assert_eq!(
        (ttl.min_ttl_ms, ttl.default_ttl_ms, ttl.max_ttl_ms, ttl.suggested_heartbeat_ms, ttl.min_renew_interval_ms),
        (20, 300, 60_000, 100, 0),
        "the fast configuration's"
    );
    let lag = first.expiry_lag.clone().expect("the expiry lag histogram");
    assert_eq!(lag.bounds_seconds, presence_server::metrics::LATENCY_BUCKETS, "the Prometheus metric's buckets");
    assert_eq!((lag.counts.len(), lag.count), (lag.bounds_seconds.len() + 1, 0));

    let mut viewer = Viewer::open(&mut server.client().await, &["u1", "u2"]).await;
    let kept = client.register(register("u1", "s", "gw", 10_000)).await.unwrap().into_inner();
    for _ in 0..2 {
        client.renew(renew("u1", "s", kept.generation, 10_000)).await.unwrap();
    }
    client.register(register("u2", "s", "gw", 50)).await.unwrap();
    viewer.until_state("u2", pb::State::Offline).await;
    let held = stats(&mut client).await;
    assert_eq!(
        (held.sessions, held.online_users, held.users, held.viewers, held.room_watchers),
        (1, 1, 2, 1, 0),
        "{held:?}"
    );
    assert_eq!(
        (held.registers_total, held.renewals_total, held.renewals_shed_total, held.unregisters_total),
        (2, 2, 0, 0)
    );
    assert_eq!(held.expiries_total, 1);
    let lag = held.expiry_lag.expect("the expiry lag histogram");
    assert_eq!((lag.count, lag.counts.iter().sum::<u64>()), (1, 1), "one expiry, one lag observed: {lag:?}");
    assert!(held.uptime_ms >= first.uptime_ms && held.now_ms >= first.now_ms);

    client.unregister(unregister("u1", "s", kept.generation, 0)).await.unwrap();
    drop(viewer);
    // The watch's end reaches the server when its stream is dropped there.
    let deadline = tokio::time::Instant::now() + PATIENCE;
    let after = loop {
        let after = stats(&mut client).await;
        if after.viewers == 0 {
            break after;
        }
        assert!(tokio::time::Instant::now() < deadline, "the closed watch is still counted: {after:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    assert_eq!((after.sessions, after.online_users, after.unregisters_total), (0, 0, 1));
}
