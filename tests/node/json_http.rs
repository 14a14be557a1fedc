//! JSON over HTTP (the Connect protocol's unary form) on the service port:
//! every unary RPC of `presence.v1.Presence` answered as over gRPC, its
//! errors as Connect error JSON naming the field, the same credentials,
//! scopes, audit and CORS as gRPC-Web, the OpenAPI document, and the
//! README's `curl` line run as written.
//!
//! The client is what curl or PHP's HTTP client does: hyper's HTTP/1.1
//! client, the request as JSON text, the answer read whole.

use std::net::SocketAddr;

use crate::common::auth::{SERVICE, secured_config, viewer_token};
use crate::common::*;
use crate::node::credentials::{SCOPED, Shape, audit_lines, check_scope, credentials_config, scoped_credentials};
use crate::node::grpc_web::Page;
use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{Method, Request, StatusCode};
use http_body_util::Full;
use presence_proto::connect::{UNARY_METHODS, unary_method};
use presence_server::ServerConfig;
use serde_json::{Value, json};
use tonic::Code;

/// One HTTP/1.1 connection, as curl or a backend's HTTP client holds it.
struct Http {
    page: Page,
    /// Every method called, to check that a test called each.
    called: std::collections::BTreeSet<String>,
}

/// An answer: its HTTP status, headers and body as JSON.
#[derive(Debug)]
struct Answer {
    status: StatusCode,
    headers: http::HeaderMap,
    json: Value,
}

impl Answer {
    /// A successful answer's message.
    fn ok(self, what: &str) -> Value {
        assert_eq!(self.status, StatusCode::OK, "{what}: {self:?}");
        assert_eq!(self.headers[header::CONTENT_TYPE], "application/json", "{what}");
        self.json
    }

    /// A Connect error's code and message.
    fn error(&self) -> (&str, &str) {
        (self.json["code"].as_str().unwrap_or(""), self.json["message"].as_str().unwrap_or(""))
    }
}

impl Http {
    async fn connect(addr: SocketAddr) -> Http {
        Http { page: Page::connect(addr).await, called: Default::default() }
    }

    fn request(&self, method: Method, path: &str) -> http::request::Builder {
        self.page.request(method, path)
    }

    async fn send(&mut self, request: Request<Full<Bytes>>) -> Answer {
        let (head, body) = self.page.send(request).await;
        let json = if body.is_empty() { Value::Null } else { serde_json::from_slice(&body).unwrap_or(Value::Null) };
        Answer { status: head.status, headers: head.headers, json }
    }

    /// POSTs `body` (JSON text) to `method` as `token`, with more headers.
    async fn post_with(&mut self, method: &str, body: &str, token: Option<&str>, more: &[(&str, &str)]) -> Answer {
        self.called.insert(method.to_owned());
        let mut request = self
            .request(Method::POST, &format!("/presence.v1.Presence/{method}"))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        for (name, value) in more {
            request = request.header(HeaderName::from_bytes(name.as_bytes()).unwrap(), *value);
        }
        self.send(request.body(Full::new(Bytes::from(body.to_owned()))).unwrap()).await
    }

    async fn post(&mut self, method: &str, body: Value, token: Option<&str>) -> Answer {
        self.post_with(method, &body.to_string(), token, &[]).await
    }

    /// A call as the service that must succeed: its response.
    async fn service(&mut self, method: &str, body: Value) -> Value {
        let what = format!("{method} {body}");
        self.post(method, body, Some(SERVICE)).await.ok(&what)
    }
}

fn code_of(name: &str) -> Code {
    match name {
        "invalid_argument" => Code::InvalidArgument,
        "not_found" => Code::NotFound,
        "failed_precondition" => Code::FailedPrecondition,
        "permission_denied" => Code::PermissionDenied,
        "unauthenticated" => Code::Unauthenticated,
        "resource_exhausted" => Code::ResourceExhausted,
        "unavailable" => Code::Unavailable,
        "unimplemented" => Code::Unimplemented,
        "out_of_range" => Code::OutOfRange,
        "internal" => Code::Internal,
        other => panic!("a Connect code this test does not know: {other}"),
    }
}

/// T3 over JSON: each unary call of the Presence service is allowed to the
/// scope it needs and refused to every other, with the message gRPC gives;
/// and the scope cases name every method JSON over HTTP serves.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_each_scope_allows_its_unary_calls_and_refuses_the_others_over_json() {
    let dir = crate::common::daemon::scratch_dir("scopes-json");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), None)).await;
    let cases = crate::node::credentials::scope_cases();
    let unary: Vec<_> =
        cases.iter().filter(|case| case.shape == Shape::Unary && case.service == "presence.v1.Presence").collect();
    // UpdateWatch and UpdateWatchRoomCounts change a stream the caller
    // opened (and so passed its scope check); every-unary-rpc calls them.
    let on_a_stream = ["UpdateWatch", "UpdateWatchRoomCounts"];
    for method in UNARY_METHODS.iter().filter(|method| !on_a_stream.contains(&method.name)) {
        assert!(unary.iter().any(|case| case.method == method.name), "{} has a scope case", method.name);
    }
    let mut http = Http::connect(server.addr).await;
    for case in unary {
        let method = unary_method(&format!("/presence.v1.Presence/{}", case.method)).expect("a unary method");
        let body = String::from_utf8((method.request_to_json)(&case.request.0).unwrap()).unwrap();
        for (held, token) in SCOPED {
            let answer = http.post_with(case.method, &body, Some(token), &[]).await;
            let outcome = match answer.status {
                StatusCode::OK => (Code::Ok, String::new()),
                _ => {
                    let (code, message) = answer.error();
                    (code_of(code), message.to_owned())
                }
            };
            check_scope("JSON", case, held, outcome);
        }
    }
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// Every unary RPC answers over JSON as it would over gRPC: a gateway's
/// life of a session (rooms, signals, status, settings), a viewer's reads,
/// privacy, and the operator's calls, each checked in what it answers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o5_every_unary_rpc_answers_json_as_over_grpc() {
    let server = TestServer::start(secured_config()).await;
    let mut http = Http::connect(server.addr).await;
    let registered = http
        .service("Register", json!({"userId": "alice", "sessionId": "s1", "gatewayId": "gw", "ttlMs": 60000}))
        .await;
    assert_eq!(registered["changed"], true, "{registered}");
    let generation = registered["generation"].as_str().expect("a 64-bit integer is a string").to_owned();
    let version = registered["presence"]["version"].as_str().unwrap().to_owned();
    assert_eq!(registered["presence"]["state"], "STATE_ONLINE");
    let renewed = http
        .service("Renew", json!({"userId": "alice", "sessionId": "s1", "generation": generation, "ttlMs": 60000}))
        .await;
    assert!(renewed.is_object(), "{renewed}");
    // Proto field names are read too.
    let second = http.service(
        "Register",
        json!({"user_id": "alice", "session_id": "s2", "gateway_id": "gw", "ttl_ms": 60000, "metadata": {"device": "phone"}}),
    )
    .await;
    let second_generation: u64 = second["generation"].as_str().unwrap().parse().unwrap();
    // Where a notification goes (A3): neither session said what its human does.
    let targets = http.service("NotifyTargets", json!({"userIds": ["alice", "nobody"], "roomId": "r1"})).await;
    assert_eq!(targets["targets"][0]["reason"], "NOTIFY_REASON_UNKNOWN_FAIL_OPEN", "{targets}");
    assert_eq!(targets["targets"][0]["inAppSessionIds"], json!(["s2", "s1"]), "{targets}");
    assert_eq!(targets["targets"][1]["reason"], "NOTIFY_REASON_OFFLINE", "{targets}");

    // Over gRPC the same user is at the same version.
    let mut grpc = server.client().await;
    let seen = grpc
        .snapshot(with_token(
            presence_proto::v1::SnapshotRequest { user_ids: vec!["alice".into()], ..Default::default() },
            Some(SERVICE),
        ))
        .await
        .unwrap()
        .into_inner();
    assert_eq!(seen.users[0].version.to_string(), version);
    let snapshot = http.service("Snapshot", json!({"userIds": ["alice", "nobody"]})).await;
    assert_eq!(snapshot["users"][0]["userId"], "alice");
    assert_eq!(snapshot["users"][0]["version"], version.as_str());
    assert_eq!(snapshot["users"][1]["state"], "STATE_OFFLINE", "{snapshot}");

    http.service("Touch", json!({"userId": "alice"})).await;
    http.service(
        "SetStatus",
        json!({"userId": "alice", "status": {"availability": "AVAILABILITY_DO_NOT_DISTURB", "text": "in a call"}}),
    )
    .await;
    let status = http.service("Snapshot", json!({"userIds": ["alice"]})).await;
    assert_eq!(status["users"][0]["status"]["text"], "in a call", "{status}");
    http.service("PutSetting", json!({"userId": "alice", "name": "theme", "value": "ZGFyaw=="})).await;
    let settings = http.service("GetSettings", json!({"userId": "alice"})).await;
    assert_eq!(settings["settings"]["theme"], "ZGFyaw==", "bytes are base64: {settings}");

    // Privacy: alice hides from everyone but bob's audience and a group.
    http.service("SetVisibility", json!({"userId": "alice", "visibility": "VISIBILITY_AUDIENCE"})).await;
    http.service("GrantAudience", json!({"userId": "alice", "viewerIds": ["bob", "carol"]})).await;
    http.service("RevokeAudience", json!({"userId": "alice", "viewerIds": ["carol"]})).await;
    let bob = viewer_token("bob", false);
    let carol = viewer_token("carol", false);
    let as_bob = http.post("Snapshot", json!({"userIds": ["alice"]}), Some(&bob)).await.ok("bob's snapshot");
    assert_eq!(as_bob["users"][0]["state"], "STATE_ONLINE", "bob is in alice's audience: {as_bob}");
    let as_carol = http.post("Snapshot", json!({"userIds": ["alice"]}), Some(&carol)).await.ok("carol's snapshot");
    assert_eq!(as_carol["users"][0]["state"], "STATE_OFFLINE", "carol was taken out: {as_carol}");
    http.service("JoinGroup", json!({"groupId": "team", "userIds": ["alice"]})).await;
    http.service("LeaveGroup", json!({"groupId": "team", "userIds": ["alice"]})).await;

    // Rooms.
    http.service("SetRoomAccess", json!({"roomId": "lobby", "access": "ROOM_ACCESS_PUBLIC"})).await;
    let joined = http
        .service("Join", json!({"userId": "alice", "sessionId": "s1", "generation": generation, "roomId": "lobby"}))
        .await;
    assert!(joined.is_object(), "{joined}");
    let room = http.service("RoomSnapshot", json!({"roomId": "lobby"})).await;
    assert_eq!(room["members"][0]["userId"], "alice", "{room}");
    let counts = http.service("RoomCounts", json!({"roomIds": ["lobby", "empty"]})).await;
    assert_eq!(counts["counts"][0]["roomId"], "lobby", "{counts}");
    http.service("Signal", json!({"userId": "alice", "sessionId": "s1", "generation": generation, "roomId": "lobby", "kind": "typing", "ttlMs": 5000})).await;
    http.service("Leave", json!({"userId": "alice", "sessionId": "s1", "generation": generation, "roomId": "lobby"}))
        .await;

    // The operator's reads.
    let sessions = http.service("ListSessions", json!({"userId": "alice"})).await;
    assert_eq!(sessions["sessions"].as_array().map(Vec::len), Some(2), "{sessions}");
    let exported = http.service("ExportUser", json!({"userId": "alice"})).await;
    assert!(exported.to_string().contains("phone"), "the export holds the session's metadata: {exported}");
    let stats = http.service("Stats", json!({})).await;
    assert_eq!(stats["onlineUsers"], "1", "{stats}");

    // Streams' companions: an unknown stream is NOT_FOUND, as over gRPC.
    for (method, body) in [
        ("UpdateWatch", json!({"watchId": "no-such-watch", "addUserIds": ["bob"]})),
        ("UpdateWatchRoomCounts", json!({"watchId": "no-such-watch", "addRoomIds": ["lobby"]})),
    ] {
        let answer = http.post(method, body, Some(SERVICE)).await;
        assert_eq!((answer.status, answer.error().0), (StatusCode::NOT_FOUND, "not_found"), "{method}: {answer:?}");
    }

    // The session's end.
    let gone =
        http.service("Unregister", json!({"userId": "alice", "sessionId": "s1", "generation": generation})).await;
    assert_eq!(gone["removed"], true, "{gone}");
    let revoked = http.service("Revoke", json!({"userId": "alice"})).await;
    assert_eq!(revoked["revoked"], 1, "s2 ({second_generation}) was revoked: {revoked}");
    assert_eq!(revoked["presence"]["state"], "STATE_OFFLINE", "{revoked}");
    http.service("EraseUser", json!({"userId": "alice"})).await;
    let erased = http.service("Snapshot", json!({"userIds": ["alice"]})).await;
    assert_eq!(erased["users"][0]["state"], "STATE_OFFLINE", "{erased}");

    let served: std::collections::BTreeSet<String> =
        UNARY_METHODS.iter().map(|method| method.name.to_owned()).collect();
    assert_eq!(http.called, served, "this test calls every unary method");
    server.stop().await;
}

/// Errors are Connect error JSON with the HTTP status of their code: the
/// field named in the message and in a BadRequest detail (as `debug` JSON
/// and as the protobuf `value`), whether the body was not the method's
/// request or the server refused a field; and what JSON over HTTP does not
/// serve is named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_over_json_is_answered_with_a_connect_error_naming_the_field() {
    let server = TestServer::start(secured_config()).await;
    let mut http = Http::connect(server.addr).await;
    let violation = |answer: &Answer| {
        let detail = answer.json["details"]
            .as_array()
            .and_then(|details| details.iter().find(|detail| detail["type"] == "google.rpc.BadRequest"))
            .unwrap_or_else(|| panic!("a BadRequest detail: {answer:?}"))
            .clone();
        assert!(detail["value"].as_str().is_some_and(|value| !value.is_empty()), "{detail}");
        detail["debug"]["fieldViolations"][0]["field"].as_str().unwrap().to_owned()
    };

    let wrong_type = http.post_with("Snapshot", r#"{"userIds": ["alice", 7]}"#, Some(SERVICE), &[]).await;
    assert_eq!((wrong_type.status, wrong_type.error().0), (StatusCode::BAD_REQUEST, "invalid_argument"));
    assert_eq!(violation(&wrong_type), "userIds[1]");
    assert!(wrong_type.error().1.contains("userIds[1]"), "{wrong_type:?}");

    let unknown = http.post_with("Snapshot", r#"{"userIdz": ["alice"]}"#, Some(SERVICE), &[]).await;
    assert_eq!(unknown.error().0, "invalid_argument");
    assert!(unknown.error().1.contains("userIdz"), "{unknown:?}");

    let not_json = http.post_with("Snapshot", "{\"userIds\": [", Some(SERVICE), &[]).await;
    assert_eq!((not_json.status, not_json.error().0), (StatusCode::BAD_REQUEST, "invalid_argument"));

    // The server's own refusal of a field, as over gRPC (proto field names).
    let empty = http.post("Register", json!({"userId": "", "sessionId": "s1", "ttlMs": 1000}), Some(SERVICE)).await;
    assert_eq!((empty.status, empty.error().0), (StatusCode::BAD_REQUEST, "invalid_argument"));
    assert_eq!(violation(&empty), "user_id", "{empty:?}");

    let unknown_lease = http
        .post("Renew", json!({"userId": "x", "sessionId": "s", "generation": "1", "ttlMs": 1000}), Some(SERVICE))
        .await;
    assert_eq!((unknown_lease.status, unknown_lease.error().0), (StatusCode::NOT_FOUND, "not_found"));

    let stream = http.post("Watch", json!({"userIds": ["alice"]}), Some(SERVICE)).await;
    assert_eq!((stream.status, stream.error().0), (StatusCode::NOT_FOUND, "unimplemented"));
    assert!(stream.error().1.contains("Watch is a stream"), "{stream:?}");
    let nothing = http.post("Nothing", json!({}), Some(SERVICE)).await;
    assert_eq!((nothing.status, nothing.error().0), (StatusCode::NOT_FOUND, "unimplemented"));
    assert!(nothing.error().1.contains("/openapi.json"), "{nothing:?}");

    let get = http
        .send(
            http.request(Method::GET, "/presence.v1.Presence/Snapshot")
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::default())
                .unwrap(),
        )
        .await;
    assert_eq!(get.status, StatusCode::METHOD_NOT_ALLOWED, "{get:?}");
    assert_eq!(get.headers[header::ALLOW], "POST");

    let gzip = http.post_with("Snapshot", "{}", Some(SERVICE), &[("content-encoding", "gzip")]).await;
    assert_eq!(gzip.error().0, "unimplemented", "{gzip:?}");
    assert!(gzip.error().1.contains("gzip"), "{gzip:?}");

    let huge = format!(r#"{{"userIds": ["{}"]}}"#, "a".repeat(5 * 1024 * 1024));
    let too_large = http.post_with("Snapshot", &huge, Some(SERVICE), &[]).await;
    assert_eq!((too_large.status, too_large.error().0), (StatusCode::TOO_MANY_REQUESTS, "resource_exhausted"));

    // What came before left nothing behind: the connection and the server serve on.
    let fine = http.service("Snapshot", json!({"userIds": ["alice"]})).await;
    assert_eq!(fine["users"][0]["userId"], "alice");
    server.stop().await;
}

/// T1/T2 over JSON: no credential, a wrong one and an expired viewer token
/// are UNAUTHENTICATED (401); a viewer may not make a gateway's call (403).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t1_credentials_over_json_are_checked_as_over_grpc() {
    let server = TestServer::start(secured_config()).await;
    let mut http = Http::connect(server.addr).await;
    let snapshot = json!({"userIds": ["alice"]});
    for (token, what) in
        [(None, "no credential"), (Some("not-a-token"), "a wrong token"), (Some("expired"), "an expired viewer token")]
    {
        let expired = viewer_token("bob", true);
        let token = if token == Some("expired") { Some(expired.as_str()) } else { token };
        let answer = http.post("Snapshot", snapshot.clone(), token).await;
        assert_eq!((answer.status, answer.error().0), (StatusCode::UNAUTHORIZED, "unauthenticated"), "{what}");
    }
    let bob = viewer_token("bob", false);
    let register = json!({"userId": "bob", "sessionId": "s1", "ttlMs": 1000});
    let refused = http.post("Register", register, Some(&bob)).await;
    assert_eq!((refused.status, refused.error().0), (StatusCode::FORBIDDEN, "permission_denied"), "{refused:?}");
    http.post("Snapshot", snapshot, Some(&bob)).await.ok("a viewer's own snapshot");
    server.stop().await;
}

/// A privileged call over JSON is in the audit log like one over gRPC,
/// refused or not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn p7_a_privileged_call_over_json_is_audited() {
    let dir = crate::common::daemon::scratch_dir("audit-json");
    let audit = dir.join("audit.log");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), Some(&audit))).await;
    let mut http = Http::connect(server.addr).await;
    let (_, gateway) = SCOPED[0];
    let (_, admin) = SCOPED[3];
    let erase = json!({"userId": "alice"});
    let refused = http.post("EraseUser", erase.clone(), Some(gateway)).await;
    assert_eq!(refused.error().0, "permission_denied");
    http.post("EraseUser", erase, Some(admin)).await.ok("the admin's erase");
    server.stop().await;
    let seen: Vec<(String, String, String)> = audit_lines(&audit)
        .iter()
        .filter(|line| line["action"] == "EraseUser")
        .map(|line| {
            let field = |name: &str| line[name].as_str().unwrap_or_default().to_owned();
            (field("action"), field("credential"), field("result"))
        })
        .collect();
    let expected = [("EraseUser", "gateway", "PERMISSION_DENIED"), ("EraseUser", "admin", "OK")]
        .map(|(a, c, r)| (a.to_owned(), c.to_owned(), r.to_owned()));
    assert_eq!(seen, expected);
    std::fs::remove_dir_all(dir).unwrap();
}

/// CORS for JSON as for gRPC-Web: a page of a configured origin may send
/// a Connect call (its preflight allows the content type and Connect's
/// headers) and read the answer; a page of another origin may not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o5_cors_lets_pages_of_the_configured_origins_call_json() {
    const APP: &str = "http://app.example:8080";
    let config = ServerConfig { cors_origins: vec![APP.into()], ..secured_config() };
    let server = TestServer::start(config).await;
    let mut http = Http::connect(server.addr).await;
    let preflight = |http: &Http, origin: &str| {
        http.request(Method::OPTIONS, "/presence.v1.Presence/Snapshot")
            .header(header::ORIGIN, origin)
            .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
            .header(header::ACCESS_CONTROL_REQUEST_HEADERS, "content-type,connect-protocol-version,authorization")
            .body(Full::default())
            .unwrap()
    };
    let allowed = http.send(preflight(&http, APP)).await;
    assert!(allowed.status.is_success(), "{allowed:?}");
    assert_eq!(allowed.headers[header::ACCESS_CONTROL_ALLOW_ORIGIN], APP);
    let headers = allowed.headers[header::ACCESS_CONTROL_ALLOW_HEADERS].to_str().unwrap().to_ascii_lowercase();
    for needed in ["content-type", "connect-protocol-version", "connect-timeout-ms", "authorization"] {
        assert!(headers.contains(needed), "{needed} allowed: {headers}");
    }
    let alice = viewer_token("alice", false);
    let answer = http
        .post_with(
            "Snapshot",
            r#"{"userIds":["bob"]}"#,
            Some(&alice),
            &[("origin", APP), ("connect-protocol-version", "1")],
        )
        .await;
    assert_eq!(answer.headers[header::ACCESS_CONTROL_ALLOW_ORIGIN], APP);
    answer.ok("a page's snapshot");
    let refused = http.send(preflight(&http, "http://elsewhere.example")).await;
    assert_eq!(refused.headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN), None, "{refused:?}");
    let elsewhere = http.post_with("Snapshot", "{}", Some(&alice), &[("origin", "http://elsewhere.example")]).await;
    assert_eq!(
        elsewhere.headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN),
        None,
        "a browser keeps the answer from the page"
    );
    server.stop().await;
}

/// The OpenAPI document is served at `/openapi.json` with a path for every
/// unary method and none for a stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openapi_document_is_served_with_every_unary_method() {
    let server = TestServer::start(fast_config()).await;
    let mut http = Http::connect(server.addr).await;
    let document = http.send(http.request(Method::GET, "/openapi.json").body(Full::default()).unwrap()).await;
    let document = document.ok("the OpenAPI document");
    assert_eq!(document["openapi"], "3.1.0");
    let paths = document["paths"].as_object().unwrap();
    for method in UNARY_METHODS {
        assert!(paths[method.path]["post"].is_object(), "{}", method.path);
    }
    assert!(!paths.contains_key("/presence.v1.Presence/Watch"));
    server.stop().await;
}

/// The README's line, run as written with the real curl: a server with no
/// credentials on loopback answers a snapshot.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_readmes_curl_line_answers() {
    let server = TestServer::start(fast_config()).await;
    let url = format!("http://{}/presence.v1.Presence/Snapshot", server.addr);
    let answer = curl(&["-sS", "-H", "content-type: application/json", "-d", r#"{"userIds":["alice"]}"#, &url]).await;
    let answer: Value = serde_json::from_str(&answer).unwrap_or_else(|_| panic!("JSON from curl: {answer}"));
    assert_eq!(answer["users"][0]["userId"], "alice");
    assert_eq!(answer["users"][0]["state"], "STATE_OFFLINE");
    server.stop().await;
}

async fn curl(args: &[&str]) -> String {
    let output = tokio::process::Command::new("curl").args(args).output().await.expect("curl is installed");
    assert!(output.status.success(), "curl {args:?}: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).unwrap()
}
