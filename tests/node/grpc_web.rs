//! The service's port as a browser on plain http uses it (contract O5, and
//! the serving half of O4): gRPC-Web over HTTP/1.1 for every call a page
//! needs, with a viewer's token and the same statuses as over gRPC; CORS
//! preflights for the configured origins only; the console's files; and the
//! connection limits of B5 for HTTP/1 connections.
//!
//! The client here is what a browser's fetch does, written out: hyper's
//! HTTP/1.1 client, requests framed by hand (a flag byte, a length, the
//! message), and the answer read frame by frame as it arrives, so that a
//! stream held back until its end would be seen.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use crate::common::auth::{SERVICE, secured_config, viewer_token};
use crate::common::*;
use bytes::Bytes;
use http::header::{self, HeaderName};
use http::{Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;
use presence_proto::v1 as pb;
use presence_proto::v1::{room_event, watch_event};
use presence_server::ServerConfig;
use prost::Message;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// One HTTP/1.1 connection, as a page's fetch holds it: one call at a time.
pub(crate) struct Page {
    sender: hyper::client::conn::http1::SendRequest<Full<Bytes>>,
    addr: SocketAddr,
}

impl Page {
    pub(crate) async fn connect(addr: SocketAddr) -> Page {
        let stream = TcpStream::connect(addr).await.expect("connect");
        let (sender, connection) =
            hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.expect("an HTTP/1.1 connection");
        tokio::spawn(connection);
        Page { sender, addr }
    }

    pub(crate) fn request(&self, method: Method, path: &str) -> http::request::Builder {
        Request::builder().method(method).uri(path).header(header::HOST, self.addr.to_string())
    }

    async fn respond(&mut self, request: Request<Full<Bytes>>) -> hyper::Response<Incoming> {
        within(PATIENCE, "an HTTP/1.1 answer", async {
            self.sender.ready().await.expect("the connection is open");
            self.sender.send_request(request).await.expect("an answer")
        })
        .await
    }

    /// Sends `request` and reads its whole answer.
    pub(crate) async fn send(&mut self, request: Request<Full<Bytes>>) -> (http::response::Parts, Bytes) {
        let (head, body) = self.respond(request).await.into_parts();
        let body = within(PATIENCE, "the whole body", body.collect()).await.expect("a healthy body").to_bytes();
        (head, body)
    }

    async fn get(&mut self, path: &str) -> (http::response::Parts, Bytes) {
        self.send(self.request(Method::GET, path).body(Full::default()).unwrap()).await
    }

    /// Starts a gRPC-Web call of `method` with `message`, as `token`, from a
    /// page of `origin`.
    async fn call_from(
        &mut self,
        method: &str,
        message: &impl Message,
        token: Option<&str>,
        origin: Option<&str>,
    ) -> WebCall {
        let encoded = message.encode_to_vec();
        let mut framed = vec![0];
        framed.extend_from_slice(&u32::try_from(encoded.len()).unwrap().to_be_bytes());
        framed.extend_from_slice(&encoded);
        let mut request = self
            .request(Method::POST, &format!("/presence.v1.Presence/{method}"))
            .header(header::CONTENT_TYPE, "application/grpc-web+proto")
            .header("x-grpc-web", "1")
            .header("x-user-agent", "presenced-tests");
        if let Some(token) = token {
            request = request.header(header::AUTHORIZATION, format!("Bearer {token}"));
        }
        if let Some(origin) = origin {
            request = request.header(header::ORIGIN, origin);
        }
        let (head, body) = self.respond(request.body(Full::new(framed.into())).unwrap()).await.into_parts();
        assert_eq!(head.status, StatusCode::OK, "a gRPC-Web answer is 200 whatever its gRPC status: {head:?}");
        let content_type = head.headers.get(header::CONTENT_TYPE).expect("a content type");
        assert_eq!(content_type, "application/grpc-web+proto");
        WebCall { head, body, buffered: Vec::new(), trailers: None }
    }

    async fn call(&mut self, method: &str, message: &impl Message, token: Option<&str>) -> WebCall {
        self.call_from(method, message, token, None).await
    }

    /// A unary call that must succeed: its one message.
    async fn unary<M: Message + Default>(&mut self, method: &str, message: &impl Message, token: &str) -> M {
        let mut call = self.call(method, message, Some(token)).await;
        let answer = call.message().await.unwrap_or_else(|| panic!("{method}: no message, {:?}", call.status_now()));
        let status = call.status().await;
        assert_eq!(status.code, tonic::Code::Ok, "{method}: {status:?}");
        assert!(status.in_trailers, "{method}: after its message, the status comes in the trailers frame");
        answer
    }
}

/// A gRPC status as a gRPC-Web answer carries it.
#[derive(Debug)]
struct WebStatus {
    code: tonic::Code,
    message: String,
    /// In the body's trailers frame, rather than in the headers of an
    /// answer that has nothing else (trailers-only).
    in_trailers: bool,
}

/// A gRPC-Web answer, read as it arrives.
struct WebCall {
    head: http::response::Parts,
    body: Incoming,
    /// Bytes of the body not yet taken as frames.
    buffered: Vec<u8>,
    /// The trailers frame, once read.
    trailers: Option<HashMap<String, String>>,
}

impl WebCall {
    /// The next frame (flags, payload), or `None` at the end of the body.
    async fn frame(&mut self) -> Option<(u8, Vec<u8>)> {
        loop {
            if let Some(header) = self.buffered.get(..5) {
                let length = u32::from_be_bytes(header[1..5].try_into().unwrap()) as usize;
                if self.buffered.len() >= 5 + length {
                    let flags = self.buffered[0];
                    let payload = self.buffered.drain(..5 + length).skip(5).collect();
                    return Some((flags, payload));
                }
            }
            match within(PATIENCE, "more of the gRPC-Web answer", self.body.frame()).await {
                Some(frame) => {
                    if let Ok(data) = frame.expect("a healthy body").into_data() {
                        self.buffered.extend_from_slice(&data);
                    }
                }
                None => {
                    assert!(self.buffered.is_empty(), "a partial frame at the end: {:?}", self.buffered);
                    return None;
                }
            }
        }
    }

    /// The next message, or `None` once the trailers (or the end) came instead.
    async fn message<M: Message + Default>(&mut self) -> Option<M> {
        if self.trailers.is_some() {
            return None;
        }
        let (flags, payload) = self.frame().await?;
        if flags & 0x80 != 0 {
            let text = String::from_utf8(payload).expect("trailers are text");
            let trailers = text
                .split("\r\n")
                .filter(|line| !line.is_empty())
                .map(|line| {
                    let (name, value) = line.split_once(':').expect("name: value");
                    (name.trim().to_ascii_lowercase(), value.trim().to_owned())
                })
                .collect();
            self.trailers = Some(trailers);
            return None;
        }
        Some(M::decode(payload.as_slice()).expect("a message of the call's type"))
    }

    /// The status as far as it is known without reading on.
    fn status_now(&self) -> Option<WebStatus> {
        let (fields, in_trailers) = match &self.trailers {
            Some(trailers) => (trailers.clone(), true),
            None => {
                let headers = &self.head.headers;
                let field = |name: &str| Some((name.to_owned(), headers.get(name)?.to_str().ok()?.to_owned()));
                (["grpc-status", "grpc-message"].into_iter().filter_map(field).collect(), false)
            }
        };
        let code = fields.get("grpc-status")?.parse::<i32>().expect("a numeric grpc-status");
        let message = percent_decoded(fields.get("grpc-message").map_or("", String::as_str));
        Some(WebStatus { code: tonic::Code::from(code), message, in_trailers })
    }

    /// The status of a call refused at once, or `Ok` for one that answered a
    /// message (a stream is not read to its end).
    async fn status_now_or_first(&mut self) -> WebStatus {
        if let Some(status) = self.status_now() {
            return status;
        }
        match self.message::<()>().await {
            Some(()) => WebStatus { code: tonic::Code::Ok, message: String::new(), in_trailers: false },
            None => self.status_now().expect("a gRPC-Web answer ends with a status"),
        }
    }

    /// Reads to the end (messages left are skipped) and returns the status.
    async fn status(&mut self) -> WebStatus {
        // `()` decodes any message, skipping its fields.
        while self.message::<()>().await.is_some() {}
        self.status_now().expect("a gRPC-Web answer ends with a status")
    }

    /// The next Watch event.
    async fn event(&mut self) -> watch_event::Event {
        let event: pb::WatchEvent =
            self.message().await.unwrap_or_else(|| panic!("the watch ended: {:?}", self.status_now()));
        event.event.expect("an event")
    }

    /// Watch events until an update of `user` to `state`.
    async fn until_update(&mut self, user: &str, state: pb::State) -> pb::UserPresence {
        loop {
            if let watch_event::Event::Update(update) = self.event().await
                && update.user_id == user
                && state_of(&update) == state
            {
                return update;
            }
        }
    }

    /// The next WatchRoom event.
    async fn room_event(&mut self) -> room_event::Event {
        let event: pb::RoomEvent =
            self.message().await.unwrap_or_else(|| panic!("the room watch ended: {:?}", self.status_now()));
        event.event.expect("an event")
    }
}

#[tokio::test]
async fn t3_each_scope_allows_its_calls_and_refuses_the_others_over_grpc_web() {
    use crate::node::credentials::{SCOPED, Shape, check_scope, credentials_config, scope_cases, scoped_credentials};
    let dir = crate::common::daemon::scratch_dir("scopes-grpc-web");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), None)).await;
    // A page makes unary and server-streaming calls of the Presence service
    // (each on its own connection: a stream left open holds one).
    let cases = scope_cases();
    let web = cases.iter().filter(|case| case.shape != Shape::BidiStream && case.service == "presence.v1.Presence");
    for case in web {
        for (held, token) in SCOPED {
            let mut page = Page::connect(server.addr).await;
            let status = page.call(case.method, &case.request, Some(token)).await.status_now_or_first().await;
            check_scope("gRPC-Web", case, held, (status.code, status.message));
        }
    }
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// `grpc-message` as sent: percent-encoded (gRPC's HTTP/2 protocol, which gRPC-Web keeps).
fn percent_decoded(text: &str) -> String {
    let bytes = text.as_bytes();
    let mut decoded = Vec::with_capacity(bytes.len());
    let mut at = 0;
    while at < bytes.len() {
        let hex = bytes.get(at + 1..at + 3).and_then(|hex| u8::from_str_radix(std::str::from_utf8(hex).ok()?, 16).ok());
        match (bytes[at], hex) {
            (b'%', Some(byte)) => {
                decoded.push(byte);
                at += 3;
            }
            (byte, _) => {
                decoded.push(byte);
                at += 1;
            }
        }
    }
    String::from_utf8_lossy(&decoded).into_owned()
}

fn service<T>(message: T) -> tonic::Request<T> {
    with_token(message, Some(SERVICE))
}

fn everyone(user: &str) -> pb::SetVisibilityRequest {
    pb::SetVisibilityRequest { user_id: user.into(), visibility: pb::Visibility::Everyone as i32, ..Default::default() }
}

/// A page of alice's calls every RPC a viewer needs over gRPC-Web while
/// gateways work over gRPC: the calls are answered as over gRPC, and her
/// open Watch and WatchRoom deliver each change as it happens.
async fn a_page_calls_what_a_viewer_needs_over_grpc_web(threads: usize) {
    let server = TestServer::start(ServerConfig { connection_threads: threads, ..secured_config() }).await;
    let mut gateway = server.client().await;
    let (alice, bob) = (viewer_token("alice", false), viewer_token("bob", false));
    let mut page = Page::connect(server.addr).await;

    // Bob's own page shows him to everyone and sets his status.
    let _: pb::SetVisibilityResponse = page.unary("SetVisibility", &everyone("bob"), &bob).await;
    let busy = pb::Status {
        availability: pb::Availability::DoNotDisturb as i32,
        text: "in a meeting".into(),
        expires_at_ms: 0,
    };
    let set = pb::SetStatusRequest { user_id: "bob".into(), status: Some(busy.clone()) };
    let answer: pb::SetStatusResponse = page.unary("SetStatus", &set, &bob).await;
    assert_eq!(answer.presence.and_then(|presence| presence.status), Some(busy.clone()));
    gateway.set_visibility(service(everyone("carol"))).await.unwrap();

    let request = pb::SnapshotRequest { user_ids: vec!["bob".into()], ..Default::default() };
    let snapshot: pb::SnapshotResponse = page.unary("Snapshot", &request, &alice).await;
    assert_eq!(snapshot.users.len(), 1);
    assert_eq!((state_of(&snapshot.users[0]), snapshot.users[0].status.clone()), (pb::State::Offline, Some(busy)));

    // A Watch holds its connection (one call at a time over HTTP/1.1).
    let mut watch_page = Page::connect(server.addr).await;
    let request = pb::WatchRequest { user_ids: vec!["bob".into()], ..Default::default() };
    let mut watch = watch_page.call("Watch", &request, Some(&alice)).await;
    let watch_id = match watch.event().await {
        watch_event::Event::Snapshot(snapshot) => {
            assert_eq!(snapshot.users.iter().map(state_of).collect::<Vec<_>>(), [pb::State::Offline]);
            snapshot.watch_id
        }
        other => panic!("a watch opens with a snapshot, got {other:?}"),
    };
    let registered = gateway.register(service(register("bob", "s1", "gw", 60_000))).await.unwrap().into_inner();
    let online = watch.until_update("bob", pb::State::Online).await;
    assert!(online.version > 0);

    let add = pb::UpdateWatchRequest { watch_id, add_user_ids: vec!["carol".into()], ..Default::default() };
    let _: pb::UpdateWatchResponse = page.unary("UpdateWatch", &add, &alice).await;
    loop {
        if let watch_event::Event::Added(added) = watch.event().await {
            assert_eq!(added.users.iter().map(|user| user.user_id.as_str()).collect::<Vec<_>>(), ["carol"]);
            break;
        }
    }

    // Rooms: a public room bob is in, watched and read from the page.
    let public = pb::SetRoomAccessRequest { room_id: "lobby".into(), access: pb::RoomAccess::Public as i32 };
    gateway.set_room_access(service(public)).await.unwrap();
    let join = |user: &str, generation: u64| pb::JoinRequest {
        user_id: user.into(),
        session_id: "s1".into(),
        generation,
        room_id: "lobby".into(),
        metadata: Default::default(),
    };
    gateway.join(service(join("bob", registered.generation))).await.unwrap();
    let mut room_page = Page::connect(server.addr).await;
    let members = pb::WatchRoomRequest {
        room_id: "lobby".into(),
        mode: pb::RoomWatchMode::RoomWatchMembers as i32,
        ..Default::default()
    };
    let mut room = room_page.call("WatchRoom", &members, Some(&alice)).await;
    match room.room_event().await {
        room_event::Event::Snapshot(snapshot) => assert_eq!(snapshot.users, 1),
        other => panic!("a room watch opens with a snapshot, got {other:?}"),
    }
    let carol = gateway.register(service(register("carol", "s1", "gw", 60_000))).await.unwrap().into_inner();
    gateway.join(service(join("carol", carol.generation))).await.unwrap();
    loop {
        if let room_event::Event::Change(change) = room.room_event().await {
            let kind = change.kind();
            let member = change.member.expect("the member");
            assert_eq!((kind, member.user_id.as_str()), (pb::RoomChangeKind::RoomChangeJoined, "carol"));
            break;
        }
    }
    let request = pb::RoomSnapshotRequest { room_id: "lobby".into(), ..Default::default() };
    let lobby: pb::RoomSnapshot = page.unary("RoomSnapshot", &request, &alice).await;
    let mut listed: Vec<_> = lobby.members.iter().map(|member| member.user_id.as_str()).collect();
    listed.sort_unstable();
    assert_eq!(listed, ["bob", "carol"]);

    // The Watch is still open, and still live.
    gateway.unregister(service(unregister("bob", "s1", registered.generation, 0))).await.unwrap();
    watch.until_update("bob", pb::State::Offline).await;
    assert!(watch.status_now().is_none(), "the stream has not ended");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o5_without_connection_threads_a_page_calls_what_a_viewer_needs_over_grpc_web() {
    a_page_calls_what_a_viewer_needs_over_grpc_web(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o5_on_two_connection_threads_a_page_calls_what_a_viewer_needs_over_grpc_web() {
    a_page_calls_what_a_viewer_needs_over_grpc_web(2).await;
}

/// A bad or missing token is UNAUTHENTICATED over gRPC-Web, as over gRPC,
/// for a unary call and for a Watch, and nothing else is answered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o5_a_bad_token_over_grpc_web_is_unauthenticated() {
    let server = TestServer::start(secured_config()).await;
    let mut page = Page::connect(server.addr).await;
    let expired = viewer_token("alice", true);
    let snapshot = pb::SnapshotRequest { user_ids: vec!["bob".into()], ..Default::default() };
    let watch = pb::WatchRequest { user_ids: vec!["bob".into()], ..Default::default() };
    for token in [Some("not-a-token"), Some(expired.as_str()), None] {
        for method in ["Snapshot", "Watch"] {
            let mut call = match method {
                "Snapshot" => page.call(method, &snapshot, token).await,
                _ => page.call(method, &watch, token).await,
            };
            assert!(call.message::<()>().await.is_none(), "{method} as {token:?}: no message");
            let status = call.status().await;
            assert_eq!(status.code, tonic::Code::Unauthenticated, "{method} as {token:?}: {status:?}");
            assert!(status.message.contains("credentials"), "{method} as {token:?}: says why: {status:?}");
            // Refused before any message: a trailers-only answer, whose
            // trailers are the headers, as over gRPC.
            assert!(!status.in_trailers, "{method} as {token:?}: {status:?}");
        }
    }
    // The same connection still serves a good token.
    let alice = viewer_token("alice", false);
    let _: pb::SnapshotResponse = page.unary("Snapshot", &snapshot, &alice).await;
    server.stop().await;
}

fn preflight(page: &Page, origin: &str) -> Request<Full<Bytes>> {
    page.request(Method::OPTIONS, "/presence.v1.Presence/Watch")
        .header(header::ORIGIN, origin)
        .header(header::ACCESS_CONTROL_REQUEST_METHOD, "POST")
        .header(
            header::ACCESS_CONTROL_REQUEST_HEADERS,
            "authorization,content-type,x-grpc-web,x-user-agent,grpc-timeout",
        )
        .body(Full::default())
        .unwrap()
}

fn listed(head: &http::response::Parts, name: HeaderName) -> Vec<String> {
    head.headers
        .get_all(name)
        .iter()
        .flat_map(|value| value.to_str().unwrap().split(',').map(|item| item.trim().to_ascii_lowercase()))
        .collect()
}

/// `--cors-origin`: a preflight from a configured origin is answered with
/// the headers and methods gRPC-Web needs, and the call's answer lets the
/// page read its status; another origin, or any origin when none is
/// configured, gets no permission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o5_cors_lets_in_the_configured_origins_only() {
    const APP: &str = "http://app.example:8080";
    let config = ServerConfig { cors_origins: vec!["http://App.example:8080".into()], ..secured_config() };
    let server = TestServer::start(config).await;
    let mut page = Page::connect(server.addr).await;

    let (allowed, _) = page.send(preflight(&page, APP)).await;
    assert!(allowed.status.is_success(), "{allowed:?}");
    assert_eq!(allowed.headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).map(|v| v.to_str().unwrap()), Some(APP));
    assert!(listed(&allowed, header::ACCESS_CONTROL_ALLOW_METHODS).contains(&"post".to_owned()), "{allowed:?}");
    let headers = listed(&allowed, header::ACCESS_CONTROL_ALLOW_HEADERS);
    for needed in ["authorization", "content-type", "x-grpc-web", "x-user-agent", "grpc-timeout"] {
        assert!(headers.contains(&needed.to_owned()), "{needed} allowed: {headers:?}");
    }

    let alice = viewer_token("alice", false);
    let snapshot = pb::SnapshotRequest { user_ids: vec!["bob".into()], ..Default::default() };
    let mut call = page.call_from("Snapshot", &snapshot, Some(&alice), Some(APP)).await;
    assert_eq!(call.head.headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN).map(|v| v.to_str().unwrap()), Some(APP));
    let exposed = listed(&call.head, header::ACCESS_CONTROL_EXPOSE_HEADERS);
    for readable in ["grpc-status", "grpc-message", "grpc-status-details-bin"] {
        assert!(exposed.contains(&readable.to_owned()), "{readable} exposed: {exposed:?}");
    }
    assert_eq!(call.status().await.code, tonic::Code::Ok);

    let (refused, _) = page.send(preflight(&page, "http://elsewhere.example")).await;
    assert_eq!(refused.headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN), None, "{refused:?}");
    server.stop().await;

    let server = TestServer::start(secured_config()).await;
    let mut page = Page::connect(server.addr).await;
    let (unconfigured, _) = page.send(preflight(&page, APP)).await;
    assert_eq!(unconfigured.headers.get(header::ACCESS_CONTROL_ALLOW_ORIGIN), None, "{unconfigured:?}");
    server.stop().await;
}

/// `/console/` is served on the service's port from the files built into
/// the binary, with their content type and caching headers; anything else
/// that is not gRPC is a 404, and so is the console with `--console false`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn o4_the_console_is_served_from_the_binary_and_anything_else_is_404() {
    let server = TestServer::start(fast_config()).await;
    let mut page = Page::connect(server.addr).await;
    let index = include_bytes!("../../crates/presence-server/console/index.html");
    for path in ["/console/", "/console/index.html", "/console/?user=alice"] {
        let (head, body) = page.get(path).await;
        assert_eq!(head.status, StatusCode::OK, "{path}");
        assert_eq!(head.headers[header::CONTENT_TYPE], "text/html; charset=utf-8", "{path}");
        assert_eq!(head.headers[header::CACHE_CONTROL], "no-cache", "{path}");
        assert_eq!(&body[..], &index[..], "{path}");
    }
    let (head, _) = page.get("/console/").await;
    let etag = head.headers.get(header::ETAG).expect("an etag").clone();
    let revalidate = page.request(Method::GET, "/console/").header(header::IF_NONE_MATCH, etag).body(Full::default());
    let (head, body) = page.send(revalidate.unwrap()).await;
    assert_eq!((head.status, body.len()), (StatusCode::NOT_MODIFIED, 0));
    let (head, body) = page.send(page.request(Method::HEAD, "/console/").body(Full::default()).unwrap()).await;
    assert_eq!((head.status, body.len()), (StatusCode::OK, 0));
    assert_eq!(head.headers[header::CONTENT_LENGTH], index.len().to_string().as_str());

    let (head, _) = page.get("/console").await;
    assert_eq!(head.status, StatusCode::PERMANENT_REDIRECT);
    assert_eq!(head.headers[header::LOCATION], "/console/");
    for path in ["/console/missing.js", "/console/../Cargo.toml", "/", "/consoles", "/metrics"] {
        let (head, _) = page.get(path).await;
        assert_eq!(head.status, StatusCode::NOT_FOUND, "{path}");
    }
    server.stop().await;

    let server = TestServer::start(ServerConfig { console: false, ..fast_config() }).await;
    let mut page = Page::connect(server.addr).await;
    for path in ["/console/", "/console", "/console/index.html"] {
        let (head, _) = page.get(path).await;
        assert_eq!(head.status, StatusCode::NOT_FOUND, "{path} with the console off");
    }
    server.stop().await;
}

/// B5 for HTTP/1: a connection whose request head never ends is closed at
/// the handshake deadline; one whose head arrived in time is not, however
/// long it then stays open.
async fn an_http1_connection_without_a_whole_request_head_is_closed_at_the_deadline(threads: usize) {
    const TIMEOUT: Duration = Duration::from_millis(300);
    let config = ServerConfig { connection_threads: threads, handshake_timeout: TIMEOUT, ..fast_config() };
    let server = TestServer::start(config).await;
    let mut page = Page::connect(server.addr).await;
    assert_eq!(page.get("/console/").await.0.status, StatusCode::OK);

    let connected = Instant::now();
    let mut silent = TcpStream::connect(server.addr).await.unwrap();
    silent.write_all(b"GET /console/ HTTP/1.1\r\nhost: presenced\r\n").await.unwrap();
    let mut received = Vec::new();
    // EOF, or a reset: either way the server has closed it.
    let _closed =
        within(PATIENCE, "the unfinished head's connection is closed", silent.read_to_end(&mut received)).await;
    let waited = connected.elapsed();
    assert!(waited >= TIMEOUT, "closed before its deadline, after {waited:?}");
    assert!(waited < TIMEOUT + Duration::from_secs(2), "closed {waited:?} after connecting");
    assert!(!String::from_utf8_lossy(&received).contains(" 200 "), "not served: {received:?}");

    // The page, older than the deadline, is still served on its connection.
    assert_eq!(page.get("/console/").await.0.status, StatusCode::OK);
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b5_without_connection_threads_an_http1_connection_without_a_request_head_is_closed_at_the_deadline() {
    an_http1_connection_without_a_whole_request_head_is_closed_at_the_deadline(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b5_on_two_connection_threads_an_http1_connection_without_a_request_head_is_closed_at_the_deadline() {
    an_http1_connection_without_a_whole_request_head_is_closed_at_the_deadline(2).await;
}

/// A GET of the console on a new HTTP/1.1 connection: its status, or why there is none.
async fn get_on_a_new_connection(addr: SocketAddr) -> Result<StatusCode, String> {
    let stream = TcpStream::connect(addr).await.map_err(|err| err.to_string())?;
    let (mut sender, connection) =
        hyper::client::conn::http1::handshake(TokioIo::new(stream)).await.map_err(|err| err.to_string())?;
    tokio::spawn(connection);
    let request = Request::get("/console/").header(header::HOST, addr.to_string()).body(Full::<Bytes>::default());
    let response = sender.send_request(request.unwrap()).await.map_err(|err| err.to_string())?;
    Ok(response.status())
}

/// B5 for HTTP/1: the connection beyond the cap is answered with a 503
/// (what a browser understands; an HTTP/2 client still gets its GOAWAY)
/// and closed, the admitted keep working, and one leaving makes room.
async fn the_cap_refuses_the_excess_http1_connection_with_a_503(threads: usize) {
    let config = ServerConfig {
        connection_threads: threads,
        max_connections: 2,
        cors_origins: vec!["https://app.example".into()],
        ..fast_config()
    };
    let server = TestServer::start(config).await;
    let mut pages = Vec::new();
    for _ in 0..2 {
        let mut page = Page::connect(server.addr).await;
        assert_eq!(page.get("/console/").await.0.status, StatusCode::OK, "within the cap");
        pages.push(page);
    }

    let mut excess = TcpStream::connect(server.addr).await.unwrap();
    excess.write_all(b"GET /console/ HTTP/1.1\r\nhost: presenced\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let _closed =
        within(PATIENCE, "the refused connection is answered and closed", excess.read_to_end(&mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "a 503: {answer:?}");
    assert!(answer.contains("too many connections (max-connections)"), "saying why: {answer:?}");
    assert!(!answer.contains("access-control-allow-origin"), "no CORS headers for a request from no page: {answer:?}");
    // A page of an allowed origin is given what it needs to read the 503
    // (a browser would otherwise report a network error); another is not.
    for (origin, allowed) in [("https://app.example", true), ("https://elsewhere.example", false)] {
        let mut excess = TcpStream::connect(server.addr).await.unwrap();
        let request = format!("GET /console/ HTTP/1.1\r\nhost: presenced\r\norigin: {origin}\r\n\r\n");
        excess.write_all(request.as_bytes()).await.unwrap();
        let mut answer = Vec::new();
        let _closed =
            within(PATIENCE, "the refused page's connection is answered", excess.read_to_end(&mut answer)).await;
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "a 503: {answer:?}");
        let header = format!("access-control-allow-origin: {origin}\r\n");
        assert_eq!(answer.contains(&header), allowed, "{origin}: {answer:?}");
    }
    let status = within(PATIENCE, "a client's view", get_on_a_new_connection(server.addr)).await;
    assert_eq!(status, Ok(StatusCode::SERVICE_UNAVAILABLE), "what fetch sees");

    for page in &mut pages {
        assert_eq!(page.get("/console/").await.0.status, StatusCode::OK, "the admitted keep working");
    }
    drop(pages.pop());
    let deadline = Instant::now() + PATIENCE;
    loop {
        match get_on_a_new_connection(server.addr).await {
            Ok(StatusCode::OK) => break,
            other => assert!(Instant::now() < deadline, "no connection admitted after one left: {other:?}"),
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b5_without_connection_threads_the_cap_refuses_the_excess_http1_connection_with_a_503() {
    the_cap_refuses_the_excess_http1_connection_with_a_503(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b5_on_two_connection_threads_the_cap_refuses_the_excess_http1_connection_with_a_503() {
    the_cap_refuses_the_excess_http1_connection_with_a_503(2).await;
}
