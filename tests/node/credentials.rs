//! T3, P6 and the audit part of P7: credentials with scopes from a
//! credentials file that is read again when it changes, streams that end
//! with their credentials, and the audit log of privileged calls.
//!
//! Every RPC is called with a credential of each scope: a credential without
//! the scope the call needs is refused with `PERMISSION_DENIED` naming it,
//! and one with it is let through (whatever the call then answers).

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use crate::common::auth::{SECRET, unix_secs};
use crate::common::daemon::scratch_dir;
use crate::common::*;
use bytes::BufMut;
use presence_proto::v1 as pb;
use presence_server::ServerConfig;
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;
use tonic_types::StatusExt;

/// A request as bytes already encoded, so that one table can hold every RPC's.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct Raw(pub(crate) Vec<u8>);

impl Message for Raw {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        buf.put_slice(&self.0);
    }
    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        prost::encoding::skip_field(wire_type, tag, buf, ctx)
    }
    fn encoded_len(&self) -> usize {
        self.0.len()
    }
    fn clear(&mut self) {
        self.0.clear();
    }
}

/// How an RPC is called.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Shape {
    Unary,
    ServerStream,
    BidiStream,
}

/// One RPC, a valid request of it, and the scope it needs.
#[derive(Debug, Clone)]
pub(crate) struct ScopeCase {
    pub(crate) service: &'static str,
    pub(crate) method: &'static str,
    pub(crate) request: Raw,
    pub(crate) shape: Shape,
    pub(crate) scope: &'static str,
}

fn case(method: &'static str, request: impl Message, shape: Shape, scope: &'static str) -> ScopeCase {
    ScopeCase { service: "presence.v1.Presence", method, request: Raw(request.encode_to_vec()), shape, scope }
}

/// Every RPC family, each with the scope it needs (see `docs/security.md`).
pub(crate) fn scope_cases() -> Vec<ScopeCase> {
    use Shape::*;
    let users = || vec!["u1".to_owned()];
    vec![
        case("Register", register("u1", "s1", "gw", 60_000), Unary, "gateway"),
        case("Renew", renew("u1", "s1", 1, 60_000), Unary, "gateway"),
        case("Unregister", unregister("u1", "s9", 1, 0), Unary, "gateway"),
        case("Leases", (), BidiStream, "gateway"),
        case(
            "Join",
            pb::JoinRequest {
                user_id: "u1".into(),
                session_id: "s1".into(),
                room_id: "r1".into(),
                ..Default::default()
            },
            Unary,
            "gateway",
        ),
        case(
            "Leave",
            pb::LeaveRequest {
                user_id: "u1".into(),
                session_id: "s1".into(),
                room_id: "r1".into(),
                ..Default::default()
            },
            Unary,
            "gateway",
        ),
        case(
            "Signal",
            pb::SignalRequest {
                user_id: "u1".into(),
                session_id: "s1".into(),
                room_id: "r1".into(),
                ..Default::default()
            },
            Unary,
            "gateway",
        ),
        case("Touch", pb::TouchRequest { user_id: "u1".into() }, Unary, "gateway"),
        case("SetStatus", pb::SetStatusRequest { user_id: "u1".into(), status: None }, Unary, "gateway"),
        case("Snapshot", pb::SnapshotRequest { user_ids: users(), ..Default::default() }, Unary, "read"),
        case("NotifyTargets", pb::NotifyTargetsRequest { user_ids: users(), ..Default::default() }, Unary, "read"),
        case("Watch", pb::WatchRequest { user_ids: users(), ..Default::default() }, ServerStream, "read"),
        case("RoomSnapshot", pb::RoomSnapshotRequest { room_id: "r1".into(), ..Default::default() }, Unary, "read"),
        case("WatchRoom", pb::WatchRoomRequest { room_id: "r1".into(), ..Default::default() }, ServerStream, "read"),
        case("RoomCounts", pb::RoomCountsRequest { room_ids: vec!["r1".into()], ..Default::default() }, Unary, "read"),
        case(
            "WatchRoomCounts",
            pb::WatchRoomCountsRequest { room_ids: vec!["r1".into()], ..Default::default() },
            ServerStream,
            "read",
        ),
        case(
            "UpdateWatchRoomCounts",
            pb::UpdateWatchRoomCountsRequest { watch_id: "w1".into(), ..Default::default() },
            Unary,
            "read",
        ),
        case(
            "RoomCounts",
            pb::RoomCountsRequest { room_ids: vec!["r1".into()], viewer_id: "v1".into() },
            Unary,
            "read-as-viewer",
        ),
        case(
            "WatchRoomCounts",
            pb::WatchRoomCountsRequest { room_ids: vec!["r1".into()], viewer_id: "v1".into(), ..Default::default() },
            ServerStream,
            "read-as-viewer",
        ),
        case("Snapshot", pb::SnapshotRequest { user_ids: users(), viewer_id: "v1".into() }, Unary, "read-as-viewer"),
        case(
            "Watch",
            pb::WatchRequest { user_ids: users(), viewer_id: "v1".into(), ..Default::default() },
            ServerStream,
            "read-as-viewer",
        ),
        case(
            "RoomSnapshot",
            pb::RoomSnapshotRequest { room_id: "r1".into(), viewer_id: "v1".into() },
            Unary,
            "read-as-viewer",
        ),
        case("Revoke", pb::RevokeRequest { user_id: "u2".into(), session_id: String::new() }, Unary, "admin"),
        case("ListSessions", pb::ListSessionsRequest { user_id: "u1".into() }, Unary, "admin"),
        case("Stats", pb::StatsRequest {}, Unary, "admin"),
        case(
            "SetVisibility",
            pb::SetVisibilityRequest {
                user_id: "u1".into(),
                visibility: pb::Visibility::Everyone as i32,
                ..Default::default()
            },
            Unary,
            "admin",
        ),
        case(
            "GrantAudience",
            pb::AudienceRequest { user_id: "u1".into(), viewer_ids: vec!["v1".into()] },
            Unary,
            "admin",
        ),
        case(
            "RevokeAudience",
            pb::AudienceRequest { user_id: "u1".into(), viewer_ids: vec!["v2".into()] },
            Unary,
            "admin",
        ),
        case("JoinGroup", pb::GroupRequest { group_id: "g1".into(), user_ids: users() }, Unary, "admin"),
        case("LeaveGroup", pb::GroupRequest { group_id: "g2".into(), user_ids: users() }, Unary, "admin"),
        case(
            "SetRoomAccess",
            pb::SetRoomAccessRequest { room_id: "r2".into(), access: pb::RoomAccess::Members as i32 },
            Unary,
            "admin",
        ),
        case(
            "PutSetting",
            pb::PutSettingRequest { user_id: "u1".into(), name: "theme".into(), value: b"dark".to_vec() },
            Unary,
            "admin",
        ),
        case("GetSettings", pb::GetSettingsRequest { user_id: "u1".into() }, Unary, "admin"),
        case("ExportUser", pb::ExportUserRequest { user_id: "u1".into() }, Unary, "admin"),
        case("EraseUser", pb::EraseUserRequest { user_id: "u9".into() }, Unary, "admin"),
        case("Backup", pb::BackupRequest {}, ServerStream, "admin"),
        case(
            "Changes",
            pb::ChangesRequest { from: pb::ChangesFrom::Now as i32, ..Default::default() },
            ServerStream,
            "feed",
        ),
        ScopeCase {
            service: "presence.v1.Cluster",
            method: "MergeGroups",
            request: Raw(pb::GroupEntries::default().encode_to_vec()),
            shape: Shape::Unary,
            scope: "cluster",
        },
        ScopeCase {
            service: "presence.v1.Cluster",
            method: "BumpVersions",
            request: Raw(pb::BumpVersionsRequest { user_ids: vec!["u1".into()] }.encode_to_vec()),
            shape: Shape::Unary,
            scope: "cluster",
        },
        ScopeCase {
            service: "presence.v1.Cluster",
            method: "Relay",
            request: Raw(Vec::new()),
            shape: Shape::BidiStream,
            scope: "cluster",
        },
        ScopeCase {
            service: "presence.v1.Cluster",
            method: "MoveSlots",
            request: Raw(pb::MoveSlotsRequest { slots: vec![1], to_node: "b".into() }.encode_to_vec()),
            shape: Shape::Unary,
            scope: "admin",
        },
    ]
}

/// The credentials of the scope tests: one per scope, named after it, and
/// its token.
pub(crate) const SCOPED: [(&str, &str); 6] = [
    ("gateway", "test-only-token-of-the-gateway-scope"),
    ("read", "test-only-token-of-the-read-scope"),
    ("read-as-viewer", "test-only-token-of-the-read-as-viewer-scope"),
    ("admin", "test-only-token-of-the-admin-scope"),
    ("feed", "test-only-token-of-the-feed-scope"),
    ("cluster", "test-only-token-of-the-cluster-scope"),
];

/// Whether a credential of `held` may make a call that needs `needed`.
pub(crate) fn allows(held: &str, needed: &str) -> bool {
    held == needed || (held == "read" && needed == "read-as-viewer")
}

/// A credentials file entry, as `presenced token new` writes one.
pub(crate) fn entry(name: &str, scopes: &[&str], token: &str) -> String {
    let scopes = presence_server::Scope::ALL.into_iter().filter(|scope| scopes.contains(&scope.name()));
    presence_server::entry_for(name, &scopes.collect::<Vec<_>>(), token).unwrap()
}

/// A credentials file with the [`SCOPED`] credentials, and `more`.
pub(crate) fn scoped_credentials(dir: &Path, more: &str) -> PathBuf {
    let path = dir.join("credentials.toml");
    let mut text: String = SCOPED.iter().map(|(scope, token)| entry(scope, &[scope], token)).collect();
    text.push_str(more);
    std::fs::write(&path, text).unwrap();
    path
}

/// Replaces the credentials file by a rename, as an editor or a config
/// management tool does, so that no reader sees it half written.
fn rewrite(path: &Path, text: &str) {
    let next = path.with_extension("next");
    std::fs::write(&next, text).unwrap();
    std::fs::rename(&next, path).unwrap();
}

/// A server requiring credentials from `credentials` (and viewer JWTs of
/// the test secret), recording its audit log in `audit`.
pub(crate) fn credentials_config(credentials: &Path, audit: Option<&Path>) -> ServerConfig {
    let mut config = fast_config();
    config.auth.credentials_file = Some(credentials.to_owned());
    config.auth.viewer_jwt_hs256_secret = Some(SECRET.into());
    config.audit_log = audit.map(Path::to_owned);
    config
}

/// Calls `case` over gRPC as `token`: its status code (`Ok` for an answer).
async fn call(channel: &Channel, case: &ScopeCase, token: &str) -> (Code, String) {
    let mut grpc = tonic::client::Grpc::new(channel.clone());
    grpc.ready().await.unwrap();
    let codec = tonic_prost::ProstCodec::<Raw, ()>::default();
    let path: tonic::codegen::http::uri::PathAndQuery = format!("/{}/{}", case.service, case.method).parse().unwrap();
    let outcome = match case.shape {
        Shape::Unary => grpc.unary(with_token(case.request.clone(), Some(token)), path, codec).await.map(|_| ()),
        Shape::ServerStream => {
            grpc.server_streaming(with_token(case.request.clone(), Some(token)), path, codec).await.map(|_| ())
        }
        Shape::BidiStream => {
            let requests = with_token(tokio_stream::iter(Vec::<Raw>::new()), Some(token));
            grpc.streaming(requests, path, codec).await.map(|_| ())
        }
    };
    match outcome {
        Ok(()) => (Code::Ok, String::new()),
        Err(status) => (status.code(), status.message().to_owned()),
    }
}

/// Checks one call's outcome against the scope rule; `how` names the transport.
pub(crate) fn check_scope(how: &str, case: &ScopeCase, held: &str, (code, message): (Code, String)) {
    let what = format!("{how} {}/{} with a `{held}` credential", case.service, case.method);
    if allows(held, case.scope) {
        assert!(
            !matches!(code, Code::PermissionDenied | Code::Unauthenticated),
            "{what} needs `{}`, which it has: {code:?} {message}",
            case.scope
        );
    } else {
        assert_eq!(code, Code::PermissionDenied, "{what}: {message}");
        let expected = format!("{} needs the `{}` scope; credential \"{held}\" has {held}", case.method, case.scope);
        assert_eq!(message, expected, "{what}");
    }
}

#[tokio::test]
async fn t3_each_scope_allows_its_calls_and_refuses_the_others_naming_the_scope() {
    let dir = scratch_dir("scopes-grpc");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), None)).await;
    let channel = Channel::from_shared(server.url()).unwrap().connect().await.unwrap();
    let cases = scope_cases();
    let families: std::collections::HashSet<&str> = cases.iter().map(|case| case.scope).collect();
    assert_eq!(families.len(), 6, "every scope has calls: {families:?}");
    for case in &cases {
        for (held, token) in SCOPED {
            check_scope("gRPC", case, held, call(&channel, case, token).await);
        }
    }
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn t3_service_tokens_keep_every_scope() {
    let dir = scratch_dir("scopes-service-token");
    let mut config = credentials_config(&scoped_credentials(&dir, ""), None);
    config.auth.service_tokens = vec![crate::common::auth::SERVICE.into()];
    let server = TestServer::start(config).await;
    let channel = Channel::from_shared(server.url()).unwrap().connect().await.unwrap();
    for case in scope_cases() {
        let (code, message) = call(&channel, &case, crate::common::auth::SERVICE).await;
        assert!(!matches!(code, Code::PermissionDenied | Code::Unauthenticated), "{}: {message}", case.method);
    }
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// A token's refusal: its code and its `ErrorInfo` reason, if any.
fn refusal(status: &tonic::Status) -> (Code, Option<String>) {
    (status.code(), status.get_details_error_info().map(|info| info.reason))
}

#[tokio::test]
async fn t3_t4_a_credential_removed_from_the_file_ends_its_streams_within_a_second_and_a_new_one_works() {
    let dir = scratch_dir("credential-removed");
    let watcher = "test-only-token-of-the-watcher";
    let gateway = "test-only-token-of-the-removed-gateway";
    let kept = entry("kept", &["read", "gateway"], "test-only-token-of-the-kept-reader");
    let text = format!("{kept}{}{}", entry("watcher", &["read"], watcher), entry("gw", &["gateway"], gateway));
    let path = dir.join("credentials.toml");
    std::fs::write(&path, &text).unwrap();
    let audit = dir.join("audit.log");
    let server = TestServer::start(credentials_config(&path, Some(&audit))).await;
    let mut client = server.client().await;

    let watch = pb::WatchRequest { user_ids: vec!["u1".into()], ..Default::default() };
    let mut removed = Viewer::open_request(&mut client, with_token(watch.clone(), Some(watcher))).await;
    let mut still =
        Viewer::open_request(&mut client, with_token(watch, Some("test-only-token-of-the-kept-reader"))).await;
    let (_batches, mut results) = {
        let (sender, receiver) = tokio::sync::mpsc::channel::<pb::LeaseBatch>(1);
        let stream = tokio_stream::wrappers::ReceiverStream::new(receiver);
        let opened = client.leases(with_token(stream, Some(gateway))).await.expect("the gateway's stream opens");
        (sender, opened.into_inner())
    };

    // A broken file changes nothing: the credentials in use stay. Nothing
    // happens to await, so the test gives the server three of its 250 ms polls.
    rewrite(&path, "[[credential]]\nname = 1\n");
    tokio::time::sleep(Duration::from_millis(750)).await;
    let stats = client
        .snapshot(with_token(pb::SnapshotRequest { user_ids: vec!["u1".into()], ..Default::default() }, Some(watcher)))
        .await;
    assert!(stats.is_ok(), "a broken file keeps the credentials in use: {stats:?}");

    let removed_at = Instant::now();
    rewrite(&path, &format!("{kept}{}", entry("newcomer", &["admin"], "test-only-token-of-the-newcomer")));
    let ended = removed.ended().await.expect_err("the removed credential's Watch ends with a status");
    let took = removed_at.elapsed();
    assert_eq!(refusal(&ended), (Code::Unauthenticated, Some("CREDENTIALS_REVOKED".into())), "{ended:?}");
    assert!(took < Duration::from_secs(1), "the stream ended {took:?} after the file changed");
    let lease_end = within(PATIENCE, "the gateway's Leases stream ends", results.message()).await;
    let lease_end = lease_end.expect_err("the removed gateway's Leases stream ends with a status");
    assert_eq!(refusal(&lease_end).0, Code::Unauthenticated, "{lease_end:?}");

    // The kept credential's stream carries on; the new one works; the removed one is refused.
    let stats = client.stats(with_token(pb::StatsRequest {}, Some("test-only-token-of-the-newcomer"))).await;
    assert!(stats.is_ok(), "a credential added to the file works at once: {stats:?}");
    let refused = client.stats(with_token(pb::StatsRequest {}, Some(watcher))).await.unwrap_err();
    assert_eq!(
        (refused.code(), refused.message()),
        (Code::Unauthenticated, "invalid credentials: neither a service token this server holds nor a viewer JWT")
    );
    let set = pb::SetVisibilityRequest {
        user_id: "u1".into(),
        visibility: pb::Visibility::Everyone as i32,
        ..Default::default()
    };
    client.set_visibility(with_token(set, Some("test-only-token-of-the-newcomer"))).await.unwrap();
    still.barrier_with(&mut client, "u1", Some("test-only-token-of-the-kept-reader")).await;

    // The reload is in the audit log, with the names and never a token.
    let lines = audit_lines(&audit);
    let reload = lines.iter().find(|line| line["action"] == "ReloadCredentials").expect("the reload is recorded");
    assert_eq!(reload["args"]["removed"], serde_json::json!(["watcher", "gw"]));
    assert_eq!(reload["args"]["added"], serde_json::json!(["newcomer"]));
    assert_eq!(reload["credential"], "presenced");
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// The audit log's records.
pub(crate) fn audit_lines(path: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    for secret in SCOPED.iter().map(|(_, token)| *token).chain([crate::common::auth::SERVICE, "test-only-token"]) {
        assert!(!text.contains(secret), "the audit log holds a token: {text}");
    }
    text.lines().map(|line| serde_json::from_str(line).expect("each line is one JSON object")).collect()
}

/// A viewer JWT of the test secret that expires `secs` from now.
fn expiring_token(subject: &str, secs: u64) -> String {
    let claims = serde_json::json!({ "sub": subject, "exp": unix_secs() + secs });
    let key = jsonwebtoken::EncodingKey::from_secret(SECRET.as_bytes()).unwrap();
    jsonwebtoken::encode(&jsonwebtoken::Header::new(jsonwebtoken::Algorithm::HS256), &claims, &key).unwrap()
}

#[tokio::test]
async fn t3_a_viewers_watch_and_room_watch_end_at_the_tokens_expiry_plus_leeway() {
    let dir = scratch_dir("stream-expiry");
    let mut config = credentials_config(&scoped_credentials(&dir, ""), None);
    config.auth.jwt_leeway_secs = 1;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let gateway = Some(SCOPED[0].1);
    let registered = client.register(with_token(register("alice", "s1", "gw", 60_000), gateway)).await.unwrap();
    let join = pb::JoinRequest {
        user_id: "alice".into(),
        session_id: "s1".into(),
        room_id: "r1".into(),
        generation: registered.into_inner().generation,
        ..Default::default()
    };
    client.join(with_token(join, gateway)).await.unwrap();
    let token = expiring_token("alice", 2);
    let exp = unix_secs() + 2; // the token's exp, give or take the second it was made in
    let watch = pb::WatchRequest { user_ids: vec!["alice".into()], ..Default::default() };
    let mut viewer = Viewer::open_request(&mut client, with_token(watch, Some(&token))).await;
    let room = pb::WatchRoomRequest { room_id: "r1".into(), ..Default::default() };
    let mut room_stream = client.watch_room(with_token(room, Some(&token))).await.unwrap().into_inner();

    let ended = viewer.ended().await.expect_err("the Watch ends with a status");
    let at = unix_secs();
    assert_eq!(refusal(&ended), (Code::Unauthenticated, Some("CREDENTIALS_EXPIRED".into())), "{ended:?}");
    assert!(ended.message().contains("expired"), "{ended:?}");
    assert!(at > exp, "not before exp plus the leeway: ended at {at}, exp {exp}");
    assert!(at <= exp + 3, "at exp plus the 1 s leeway: ended at {at}, exp {exp}");
    let room_end = within(PATIENCE, "the WatchRoom ends", async {
        loop {
            match room_stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the WatchRoom ended without a status"),
                Err(status) => return status,
            }
        }
    })
    .await;
    assert_eq!(refusal(&room_end), (Code::Unauthenticated, Some("CREDENTIALS_EXPIRED".into())), "{room_end:?}");
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn p7_privileged_calls_are_audited_with_the_credential_peer_and_arguments() {
    let dir = scratch_dir("audit");
    let audit = dir.join("audit.log");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), Some(&audit))).await;
    let mut client = server.client().await;
    let admin = SCOPED[3].1;
    let gateway = SCOPED[0].1;
    client.register(with_token(register("u1", "s1", "gw", 60_000), Some(gateway))).await.unwrap();
    client
        .revoke(with_token(pb::RevokeRequest { user_id: "u1".into(), session_id: "s1".into() }, Some(admin)))
        .await
        .unwrap();
    let denied = pb::AudienceRequest { user_id: "u1".into(), viewer_ids: vec!["v1".into()] };
    client.grant_audience(with_token(denied, Some(gateway))).await.unwrap_err();
    let setting = pb::PutSettingRequest { user_id: "u1".into(), name: "theme".into(), value: b"secret-value".to_vec() };
    client.put_setting(with_token(setting, Some(admin))).await.unwrap();
    client.register(with_token(register("u2", "s1", "gw", 60_000), Some(gateway))).await.unwrap();
    client.export_user(with_token(pb::ExportUserRequest { user_id: "u1".into() }, Some(admin))).await.unwrap();
    client.erase_user(with_token(pb::EraseUserRequest { user_id: "u1".into() }, Some(admin))).await.unwrap();
    let refused = client.erase_user(with_token(pb::EraseUserRequest { user_id: "u2".into() }, Some(SCOPED[1].1))).await;
    assert_eq!(refused.unwrap_err().code(), Code::PermissionDenied);

    let lines = audit_lines(&audit);
    let actions: Vec<&str> = lines.iter().map(|line| line["action"].as_str().unwrap()).collect();
    assert_eq!(
        actions,
        ["Revoke", "GrantAudience", "PutSetting", "ExportUser", "EraseUser", "EraseUser"],
        "lease calls are not privileged: {lines:?}"
    );
    assert_eq!(
        (&lines[4]["args"]["user_id"], &lines[4]["result"]),
        (&serde_json::json!("u1"), &serde_json::json!("OK"))
    );
    assert_eq!(
        (&lines[5]["credential"], &lines[5]["result"]),
        (&serde_json::json!("read"), &serde_json::json!("PERMISSION_DENIED"))
    );
    assert_eq!(lines[0]["credential"], "admin");
    assert_eq!(lines[0]["args"], serde_json::json!({ "user_id": "u1", "session_id": "s1" }));
    assert_eq!(lines[0]["result"], "OK");
    assert!(lines[0]["peer"].as_str().unwrap().starts_with("127.0.0.1:"), "{}", lines[0]);
    assert_eq!(lines[1]["credential"], "gateway");
    assert_eq!(lines[1]["result"], "PERMISSION_DENIED");
    assert!(lines[1]["message"].as_str().unwrap().contains("`admin` scope"), "{}", lines[1]);
    assert!(!std::fs::read_to_string(&audit).unwrap().contains("secret-value"), "a setting's value is never recorded");
    assert_eq!(lines[2]["args"]["value_bytes"], 12);
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn t3_token_new_prints_the_entry_on_stdout_and_the_token_apart_so_that_appending_it_lets_it_in_with_its_scopes() {
    use crate::common::daemon::{BINARY, Daemon};
    let dir = scratch_dir("token-new");
    let token_new = |name: &str, more: &[&str]| {
        let output = std::process::Command::new(BINARY)
            .args(["token", "new", name, "--scope", "read,read-as-viewer"])
            .args(more)
            .output()
            .unwrap();
        assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
        (String::from_utf8(output.stdout).unwrap(), String::from_utf8(output.stderr).unwrap())
    };
    // `token new ... >> credentials.toml`, after an entry already there: stdout is the entry alone.
    let (entry, printed_apart) = token_new("ops-reader", &[]);
    let token = printed_apart.trim();
    assert!(token.starts_with(presence_server::TOKEN_PREFIX), "the token is on stderr: {printed_apart}");
    assert!(entry.starts_with("[[credential]]\n") && !entry.contains(token), "stdout is the entry alone: {entry}");
    let path = dir.join("credentials.toml");
    let (other_entry, _) = token_new("other", &[]);
    std::fs::write(&path, format!("{other_entry}{entry}")).unwrap();

    // --token-file: the token alone in a file only its owner reads; never over a file that is there.
    let token_file = dir.join("ops-reader.token");
    let (entry_again, said) = token_new("ops-reader-2", &["--token-file", token_file.to_str().unwrap()]);
    assert!(said.is_empty() && entry_again.starts_with("[[credential]]"), "{said}{entry_again}");
    let written = std::fs::read_to_string(&token_file).unwrap();
    assert!(written.trim().starts_with(presence_server::TOKEN_PREFIX) && entry_again.lines().count() == 4);
    assert_eq!(
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&token_file).unwrap().permissions()) & 0o777,
        0o600
    );
    let again = std::process::Command::new(BINARY)
        .args(["token", "new", "x", "--scope", "read", "--token-file", token_file.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(again.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&again.stderr).contains("--token-file"), "{again:?}");
    assert_eq!(std::fs::read_to_string(&token_file).unwrap(), written, "the file there is left as it was");

    // A file holding a token, as an older `token new >>` left it: the start names its line.
    let leaked = dir.join("leaked.toml");
    std::fs::write(&leaked, format!("{other_entry}{token}\n{entry}")).unwrap();
    let said = start_refused_with(&leaked);
    assert!(said.contains("line 5: is a token, not an entry"), "{said}");
    assert!(!said.contains(token), "the refusal does not print the secret: {said}");

    let daemon = Daemon::start(&["--credentials", path.to_str().unwrap()], &[]);
    let mut client = presence_proto::v1::presence_client::PresenceClient::connect(daemon.url()).await.unwrap();
    let read = pb::SnapshotRequest { user_ids: vec!["u1".into()], ..Default::default() };
    client.snapshot(with_token(read, Some(token))).await.expect("the new token reads");
    let refused = client.register(with_token(register("u1", "s1", "gw", 1_000), Some(token))).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert_eq!(
        refused.message(),
        "Register needs the `gateway` scope; credential \"ops-reader\" has read, read-as-viewer"
    );

    let bad = std::process::Command::new(BINARY).args(["token", "new", "x", "--scope", "everything"]).output().unwrap();
    assert_eq!(bad.status.code(), Some(2));
    let said = String::from_utf8_lossy(&bad.stderr);
    assert!(said.contains("unknown scope \"everything\"; the scopes are gateway, read"), "{said}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn t3_a_bad_credentials_file_refuses_to_start_naming_the_entry() {
    let dir = scratch_dir("credentials-bad");
    let path = dir.join("credentials.toml");
    std::fs::write(&path, "[[credential]]\nname = \"gw\"\nscopes = [\"gateways\"]\ntoken_sha256 = \"00\"\n").unwrap();
    let said = start_refused_with(&path);
    let expected = format!(
        "presenced: --credentials {}: credential #1 (\"gw\"): scopes: unknown scope \"gateways\"",
        path.display()
    );
    assert!(said.starts_with(&expected), "{said}");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn t3_a_watcher_with_a_token_provider_reopens_at_each_expiry_and_misses_no_flip() {
    use presence_client::{Backoff, TokenProvider, Watcher, WatcherEvent};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = scratch_dir("token-provider");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), None)).await;
    let gateway = Some(SCOPED[0].1);
    let fetched = Arc::new(AtomicUsize::new(0));
    let provider: TokenProvider = {
        let fetched = Arc::clone(&fetched);
        Arc::new(move || {
            fetched.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(expiring_token("alice", 2)) })
        })
    };
    let watch = pb::WatchRequest { user_ids: vec!["alice".into()], ..Default::default() };
    let mut watcher =
        Watcher::open_with_token_provider(server.client().await, watch, Backoff::default(), provider).await.unwrap();

    // alice flips every 100 ms for five seconds: across two or three expiries.
    let mut gateway_client = server.client().await;
    let flips = tokio::spawn(async move {
        let started = Instant::now();
        while started.elapsed() < Duration::from_secs(5) {
            let registered = gateway_client.register(with_token(register("alice", "s1", "gw", 60_000), gateway)).await;
            let generation = registered.unwrap().into_inner().generation;
            tokio::time::sleep(Duration::from_millis(50)).await;
            let unregistered = with_token(unregister("alice", "s1", generation, 0), gateway);
            gateway_client.unregister(unregistered).await.unwrap();
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    let mut seen = Vec::new();
    let mut resyncs = 0;
    while !flips.is_finished() {
        match tokio::time::timeout(Duration::from_millis(200), watcher.next()).await {
            Ok(Some(WatcherEvent::Update(update))) => seen.push(update.version),
            Ok(Some(WatcherEvent::Resynced)) => {
                resyncs += 1;
                seen.extend(watcher.store().get("alice").map(|held| held.version));
            }
            Ok(None) => panic!("the watch ended: {:?}", watcher.last_error()),
            Err(_) => {}
        }
    }
    flips.await.unwrap();
    // The server's own view of alice, as a service reads it.
    let mut reader = server.client().await;
    let request = pb::SnapshotRequest { user_ids: vec!["alice".into()], ..Default::default() };
    let truth = reader.snapshot(with_token(request, Some(SCOPED[1].1))).await.unwrap().into_inner().users.remove(0);
    within(PATIENCE, "the watcher holds the server's last version of alice", async {
        while watcher.store().get("alice").map(|held| held.version) != Some(truth.version) {
            if let Some(WatcherEvent::Update(update)) = watcher.next().await {
                seen.push(update.version);
            }
        }
    })
    .await;
    assert_eq!(watcher.store().get("alice").unwrap().state, truth.state);
    assert!(seen.windows(2).all(|pair| pair[0] <= pair[1]), "versions never go back: {seen:?}");
    assert!(resyncs >= 2, "the watch reopened at each expiry: {resyncs} reopens");
    assert!(fetched.load(Ordering::SeqCst) >= 3, "a token for the opening and one per expiry");
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn t3_a_room_watcher_with_a_token_provider_outlives_its_tokens() {
    use presence_client::{Backoff, RoomWatcher, TokenProvider};
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let dir = scratch_dir("room-token-provider");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), None)).await;
    let (gateway, admin) = (Some(SCOPED[0].1), Some(SCOPED[3].1));
    let mut client = server.client().await;
    let join = |user: &str, generation: u64| pb::JoinRequest {
        user_id: user.into(),
        session_id: "s1".into(),
        room_id: "doc-9".into(),
        generation,
        ..Default::default()
    };
    let ann = client.register(with_token(register("ann", "s1", "gw", 60_000), gateway)).await.unwrap().into_inner();
    client.join(with_token(join("ann", ann.generation), gateway)).await.unwrap();
    let fetched = Arc::new(AtomicUsize::new(0));
    let provider: TokenProvider = {
        let fetched = Arc::clone(&fetched);
        Arc::new(move || {
            fetched.fetch_add(1, Ordering::SeqCst);
            Box::pin(async { Ok(expiring_token("ann", 1)) })
        })
    };
    let request = pb::WatchRoomRequest { room_id: "doc-9".into(), ..Default::default() };
    let mut watcher =
        RoomWatcher::open_with_token_provider(server.client().await, request, Backoff::default(), provider)
            .await
            .unwrap();
    assert!(watcher.view().member("ann").is_some());
    // Past the token's expiry, a newcomer is still seen.
    let open_until = Instant::now() + Duration::from_millis(2_500);
    while Instant::now() < open_until {
        if let Ok(event) = tokio::time::timeout(Duration::from_millis(100), watcher.next()).await {
            assert!(event.is_some(), "the room watch ended: {:?}", watcher.last_error());
        }
    }
    let everyone = pb::SetVisibilityRequest {
        user_id: "bob".into(),
        visibility: pb::Visibility::Everyone as i32,
        ..Default::default()
    };
    client.set_visibility(with_token(everyone, admin)).await.unwrap();
    let bob = client.register(with_token(register("bob", "s1", "gw", 60_000), gateway)).await.unwrap().into_inner();
    client.join(with_token(join("bob", bob.generation), gateway)).await.unwrap();
    within(PATIENCE, "bob's join, as a change or in a reopen's snapshot", async {
        while watcher.view().member("bob").is_none() {
            assert!(watcher.next().await.is_some(), "the room watch ended: {:?}", watcher.last_error());
        }
    })
    .await;
    assert!(fetched.load(Ordering::SeqCst) >= 2, "a token for the opening and a fresh one after the expiry");
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// What a start with the credentials file at `path` says as it refuses (exit 2).
fn start_refused_with(path: &std::path::Path) -> String {
    let output = std::process::Command::new(crate::common::daemon::BINARY)
        .args(["serve", "--listen", "127.0.0.1:0", "--credentials", path.to_str().unwrap()])
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2), "{output:?}");
    String::from_utf8_lossy(&output.stderr).into_owned()
}
