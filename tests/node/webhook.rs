//! The change feed's webhook sink (F4) against a receiver on loopback that
//! checks every signature, fails, is slow and is gone for a while: every
//! event arrives once and in order, the store and the gRPC feed never wait
//! for it, a restart resumes from the durable cursor, a bad configuration
//! is refused before `listening on`, and the verification snippets of
//! docs/feed.md accept a real batch and refuse a tampered one.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use base64::Engine as _;
use bytes::Bytes;
use hmac::{KeyInit, Mac};
use http_body_util::{BodyExt, Full};
use hyper_util::rt::TokioIo;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::WebhookConfig;
use serde_json::Value;
use tokio::net::TcpListener;
use tonic::transport::Channel;

use super::cli::run_with_deadline;
use super::feed::{changes, everything, flip, read_until, register_users, unregister_users};
use crate::common::daemon::{Daemon, free_port, scratch_dir};
use crate::common::scrape::scrape;
use crate::common::*;

const SECRET: &str = "0123456789abcdef0123456789abcdef-test";

/// A batch the receiver answered 2xx, as it came.
#[derive(Debug, Clone)]
struct Accepted {
    id: String,
    signature: String,
    body: Bytes,
    json: Value,
}

impl Accepted {
    fn events(&self) -> &[Value] {
        self.json["events"].as_array().expect("events")
    }
}

/// What the receiver saw and how it answers.
#[derive(Debug, Default)]
struct Received {
    accepted: Vec<Accepted>,
    /// Every attempt's status, in order.
    answered: Vec<u16>,
    /// A batch whose id is the last accepted one: sent again because its
    /// answer was lost (the receiver drops it, as docs/feed.md says to).
    replays: usize,
    bad_signatures: usize,
    /// The next this many attempts are answered 500.
    fail_next: usize,
    /// Every answer waits this long.
    delay: Duration,
}

/// A webhook receiver on a loopback port: HTTP/1.1 with keep-alive, a
/// signature check on every request; taken down (port closed, connections
/// cut) and brought back on the same port.
struct Receiver {
    addr: SocketAddr,
    received: Arc<Mutex<Received>>,
    accepting: Option<tokio::task::JoinHandle<()>>,
    /// Serving https with this, or plain http.
    tls: Option<tokio_rustls::TlsAcceptor>,
}

impl Receiver {
    async fn start() -> Receiver {
        Receiver::serving(None).await
    }

    /// A receiver at `https://localhost:PORT/hook` presenting `issued`.
    async fn start_tls(issued: &crate::common::tls::Issued) -> Receiver {
        Receiver::serving(Some(crate::common::tls::acceptor(issued))).await
    }

    async fn serving(tls: Option<tokio_rustls::TlsAcceptor>) -> Receiver {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let received = Arc::new(Mutex::new(Received::default()));
        let accepting = Some(tokio::spawn(accept(listener, Arc::clone(&received), tls.clone())));
        Receiver { addr, received, accepting, tls }
    }

    fn url(&self) -> String {
        match self.tls {
            Some(_) => format!("https://localhost:{}/hook", self.addr.port()),
            None => format!("http://{}/hook", self.addr),
        }
    }

    fn with<T>(&self, read: impl FnOnce(&mut Received) -> T) -> T {
        read(&mut self.received.lock().unwrap())
    }

    /// The port closed and every open connection cut.
    fn down(&mut self) {
        self.accepting.take().expect("up").abort();
    }

    async fn up(&mut self) {
        let listener = within(PATIENCE, "the receiver's port again", async {
            loop {
                match TcpListener::bind(self.addr).await {
                    Ok(listener) => return listener,
                    Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
                }
            }
        })
        .await;
        self.accepting = Some(tokio::spawn(accept(listener, Arc::clone(&self.received), self.tls.clone())));
    }

    /// Waits until a batch holding `user`'s flip is accepted.
    async fn until_flip_of(&self, user: &str) {
        within(PATIENCE, &format!("a batch with {user}'s flip"), async {
            while !self.with(|received| flips(&received.accepted).iter().any(|(id, _, _)| id == user)) {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
    }
}

/// Accepts connections until aborted; aborting drops them all.
async fn accept(listener: TcpListener, received: Arc<Mutex<Received>>, tls: Option<tokio_rustls::TlsAcceptor>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else { continue };
        let (received, tls) = (Arc::clone(&received), tls.clone());
        connections.spawn(async move {
            let service = hyper::service::service_fn(move |request| answer(request, Arc::clone(&received)));
            let http1 = hyper::server::conn::http1::Builder::new();
            match tls {
                None => drop(http1.serve_connection(TokioIo::new(stream), service).await),
                Some(tls) => {
                    // A client that does not trust the certificate ends here.
                    let Ok(stream) = tls.accept(stream).await else { return };
                    drop(http1.serve_connection(TokioIo::new(stream), service).await);
                }
            }
        });
        while connections.try_join_next().is_some() {}
    }
}

async fn answer(
    request: http::Request<hyper::body::Incoming>,
    received: Arc<Mutex<Received>>,
) -> Result<http::Response<Full<Bytes>>, Infallible> {
    let (parts, body) = request.into_parts();
    let body = body.collect().await.map(|body| body.to_bytes()).unwrap_or_default();
    let header = |name: &str| parts.headers.get(name).and_then(|value| value.to_str().ok()).unwrap_or("").to_owned();
    let delay = received.lock().unwrap().delay;
    tokio::time::sleep(delay).await;
    let mut received = received.lock().unwrap();
    let signature = header("presenced-signature");
    let status = if !verify(SECRET.as_bytes(), &signature, &body) {
        received.bad_signatures += 1;
        401
    } else if received.fail_next > 0 {
        received.fail_next -= 1;
        500
    } else {
        let id = header("presenced-batch-id");
        if received.accepted.last().is_some_and(|last| last.id == id) {
            received.replays += 1;
        } else {
            let json: Value = serde_json::from_slice(&body).expect("a JSON body");
            received.accepted.push(Accepted { id, signature, body, json });
        }
        200
    };
    received.answered.push(status);
    Ok(http::Response::builder().status(status).body(Full::new(Bytes::new())).unwrap())
}

/// The receiver's check, as docs/feed.md describes it: some `v1` is the
/// HMAC-SHA256 of `t.body`, and `t` is within five minutes of now.
fn verify(secret: &[u8], header: &str, body: &[u8]) -> bool {
    let fields: Vec<(&str, &str)> = header.split(',').filter_map(|field| field.split_once('=')).collect();
    let Some(t) = fields.iter().find(|(key, _)| *key == "t").and_then(|(_, t)| t.parse::<u64>().ok()) else {
        return false;
    };
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
    if now.abs_diff(t) > 300 {
        return false;
    }
    fields.iter().filter(|(key, _)| *key == "v1").any(|(_, given)| {
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).unwrap();
        mac.update(format!("{t}.").as_bytes());
        mac.update(body);
        let expected: String = mac.finalize().into_bytes().iter().map(|byte| format!("{byte:02x}")).collect();
        *given == expected
    })
}

fn cursor_bytes(cursor: &Value) -> Vec<u8> {
    base64::engine::general_purpose::STANDARD.decode(cursor.as_str().expect("a base64 cursor")).unwrap()
}

/// The flips of the accepted batches, in order: (user, state, version).
fn flips(accepted: &[Accepted]) -> Vec<(String, String, String)> {
    accepted
        .iter()
        .flat_map(Accepted::events)
        .filter_map(|event| event.get("flip"))
        .map(|user| {
            (
                user["user_id"].as_str().unwrap().to_owned(),
                user["state"].as_str().unwrap().to_owned(),
                user["version"].as_str().unwrap().to_owned(),
            )
        })
        .collect()
}

/// Every event of the accepted batches once and in cursor order, each
/// batch named by its last event's cursor.
fn assert_each_event_once_in_order(accepted: &[Accepted]) {
    let mut last: Vec<u8> = Vec::new();
    for batch in accepted {
        assert!(!batch.events().is_empty(), "no empty batch");
        for event in batch.events() {
            let cursor = cursor_bytes(&event["cursor"]);
            assert!(cursor > last, "F4: each event once, in order: {event} after {last:?}");
            last = cursor;
        }
        let named = batch.events().last().unwrap()["cursor"].clone();
        assert_eq!(batch.json["cursor"], named, "the body's cursor is its last event's");
        assert_eq!(batch.id, named.as_str().unwrap(), "presenced-batch-id is the body's cursor");
    }
}

fn webhook_config(url: String) -> presence_server::ServerConfig {
    let mut config = fast_config();
    config.feed_webhooks = WebhookConfig { urls: vec![url], secrets: vec![SECRET.into()], ca: None };
    config
}

/// Every user ONLINE, then OFFLINE: two flips each.
async fn round_trip(client: &mut PresenceClient<Channel>, users: &[String]) {
    let generations = register_users(client, users).await;
    unregister_users(client, users, &generations).await;
}

/// Renews one session every 20 ms until `stop`: the longest any renewal took, and how many.
async fn renew_until(
    mut client: PresenceClient<Channel>,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> (Duration, usize) {
    let registered = client.register(register("renewer", "s", "gw", 60_000)).await.unwrap().into_inner();
    let (mut longest, mut count) = (Duration::ZERO, 0);
    while !stop.load(std::sync::atomic::Ordering::Relaxed) {
        let started = Instant::now();
        client.renew(renew("renewer", "s", registered.generation, 0)).await.expect("a renewal answered");
        longest = longest.max(started.elapsed());
        count += 1;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    (longest, count)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_through_failures_a_slow_receiver_and_a_dead_one_every_event_arrives_once_in_order_and_nothing_else_waits() {
    let mut receiver = Receiver::start().await;
    receiver.with(|received| received.fail_next = 3);
    let server = TestServer::start(webhook_config(format!("{}#max_events=50", receiver.url()))).await;
    let mut client = server.client().await;
    let mut grpc = changes(&mut client, pb::ChangesFrom::Now, b"", everything()).await.unwrap();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let renewer = tokio::spawn(renew_until(client.clone(), Arc::clone(&stop)));
    let users: Vec<String> = (0..100).map(|i| format!("user-{i:03}")).collect();
    let mut made = 0;

    // The first three attempts are answered 500: the same batch is sent until a 2xx.
    round_trip(&mut client, &users).await;
    made += 200;
    within(PATIENCE, "a batch accepted after three 500s", async {
        while receiver.with(|received| received.accepted.is_empty()) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert_eq!(receiver.with(|received| received.answered[..4].to_vec()), [500, 500, 500, 200]);

    // Slow: every answer takes 300 ms, for a few batches.
    receiver.with(|received| received.delay = Duration::from_millis(300));
    let answered = receiver.with(|received| received.answered.len());
    round_trip(&mut client, &users).await;
    made += 200;
    within(PATIENCE, "three slow answers", async {
        while receiver.with(|received| received.answered.len()) < answered + 3 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    receiver.with(|received| received.delay = Duration::ZERO);

    // Gone: the port closed for 1.5 s while changes keep coming.
    receiver.down();
    let outage = Instant::now();
    round_trip(&mut client, &users).await;
    round_trip(&mut client, &users).await;
    made += 400;
    // The gRPC feed is not held back by the webhook: it has every flip so far.
    let users_flipped = |events: &[pb::ChangeEvent]| {
        events.iter().filter_map(flip).filter(|user| user.user_id.starts_with("user-")).count()
    };
    let streamed = read_until(&mut grpc, "every flip on the gRPC feed", |events| users_flipped(events) >= made).await;
    let delivered = receiver
        .with(|received| flips(&received.accepted).iter().filter(|(user, _, _)| user.starts_with("user-")).count());
    assert!(delivered < made, "the receiver is gone: it cannot have everything ({delivered} of {made})");
    // The length of the outage, not a wait for anything.
    tokio::time::sleep(Duration::from_millis(1_500).saturating_sub(outage.elapsed())).await;
    receiver.up().await;
    register_users(&mut client, &["sentinel".to_owned()]).await;
    receiver.until_flip_of("sentinel").await;
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let (longest, renewals) = renewer.await.unwrap();

    let received = receiver.with(std::mem::take);
    assert_eq!(received.bad_signatures, 0, "every batch signed with the secret");
    assert!(received.answered.iter().filter(|&&status| status == 500).count() == 3);
    assert!(received.replays <= 1, "only a batch whose answer the outage cut is sent again: {}", received.replays);
    assert_each_event_once_in_order(&received.accepted);
    assert!(received.accepted.iter().all(|batch| batch.events().len() <= 50), "max_events bounds a batch");
    let mut streamed = streamed;
    streamed.extend(
        read_until(&mut grpc, "the sentinel on the gRPC feed", |events| {
            events.last().and_then(flip).is_some_and(|user| user.user_id == "sentinel")
        })
        .await,
    );
    let from_grpc: Vec<(String, String, String)> = streamed
        .iter()
        .filter_map(flip)
        .map(|user| {
            (
                user.user_id.clone(),
                pb::State::try_from(user.state).unwrap().as_str_name().to_owned(),
                user.version.to_string(),
            )
        })
        .collect();
    assert_eq!(users_flipped(&streamed), made);
    assert_eq!(flips(&received.accepted), from_grpc, "F4: the webhook carries every flip the feed does, in its order");
    assert!(renewals > 10, "renewals went on throughout: {renewals}");
    assert!(longest < Duration::from_secs(1), "no renewal waited for the webhook: the longest took {longest:?}");
    server.stop().await;
}

/// `presenced serve` with a webhook to `url` and a data directory.
fn serve_args<'a>(dir: &'a str, url: &'a str, secret_file: &'a str, metrics: &'a str) -> [&'a str; 8] {
    ["--data-dir", dir, "--feed-webhook", url, "--feed-webhook-secret-file", secret_file, "--metrics-listen", metrics]
}

/// A sample of the webhook's series `name` whose labels contain `labels`.
fn webhook_sample(metrics: &str, name: &str, labels: &str) -> Option<f64> {
    metrics
        .lines()
        .filter(|line| line.starts_with(&format!("{name}{{")) && line.contains(labels))
        .find_map(|line| line.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_a_restarted_node_resumes_its_webhook_from_the_durable_cursor_and_sends_nothing_twice() {
    let dir = scratch_dir("webhook-restart");
    let secret_file = dir.join("webhook-secret");
    std::fs::write(&secret_file, format!("{SECRET}\n")).unwrap();
    let mut receiver = Receiver::start().await;
    let url = receiver.url();
    let (data, listen, metrics) =
        (dir.join("data"), format!("127.0.0.1:{}", free_port()), format!("127.0.0.1:{}", free_port()));
    let args = serve_args(data.to_str().unwrap(), &url, secret_file.to_str().unwrap(), &metrics);
    let daemon = Daemon::start_on(&listen, &args, &[], None);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    let users: Vec<String> = (0..20).map(|i| format!("user-{i:02}")).collect();
    let generations = register_users(&mut client, &users).await;
    register_users(&mut client, &["first".to_owned()]).await;
    receiver.until_flip_of("first").await;
    let label = format!("webhook=\"{url}\"");
    // As below: the receiver holds the batch before the webhook reads its 2xx and counts it.
    within(PATIENCE, "the 21 events counted after the 2xx", async {
        while webhook_sample(&scrape(&metrics), "presenced_webhook_events_total", &label) != Some(21.0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let scraped = scrape(&metrics);
    assert!(webhook_sample(&scraped, "presenced_webhook_batches_total", &label) >= Some(1.0), "{scraped}");

    // The receiver is gone while 21 more flips happen; the node stops with them undelivered.
    receiver.down();
    unregister_users(&mut client, &users, &generations).await;
    register_users(&mut client, &["second".to_owned()]).await;
    within(PATIENCE, "a failed attempt counted", async {
        while webhook_sample(&scrape(&metrics), "presenced_webhook_failures_total", "reason=\"connection\"")
            .unwrap_or(0.0)
            < 1.0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let lag = webhook_sample(&scrape(&metrics), "presenced_webhook_lag_seconds", &label);
    assert!(lag.is_some_and(|lag| lag >= 0.0), "the lag is exported: {lag:?}");
    daemon.stop().await;
    let cursor_files: Vec<_> = std::fs::read_dir(data.join("webhooks")).unwrap().collect();
    assert_eq!(cursor_files.len(), 1, "one cursor file for the one webhook");

    receiver.up().await;
    let daemon = Daemon::start_on(&listen, &args, &[], None);
    receiver.until_flip_of("second").await;
    let received = receiver.with(std::mem::take);
    assert_each_event_once_in_order(&received.accepted);
    let all = flips(&received.accepted);
    assert_eq!(all.len(), 42, "F4: the 21 flips before the restart once, then the 21 it had not delivered: {all:?}");
    assert!(all[..21].iter().all(|(_, state, _)| state == "STATE_ONLINE"));
    assert!(all[21..].iter().all(|(user, state, _)| state == "STATE_OFFLINE" || user == "second"));
    // The receiver holds the batch before the webhook reads its 2xx and counts it.
    within(PATIENCE, "the events counted after the 2xx", async {
        while webhook_sample(&scrape(&metrics), "presenced_webhook_events_total", &label) != Some(21.0) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    // The verification snippets of docs/feed.md, run on this real batch.
    let batch = received.accepted.last().unwrap();
    snippets_accept_only_the_real_batch(&dir, batch);
    daemon.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// The code block of docs/feed.md that starts with `first_line`.
fn documented(first_line: &str) -> String {
    let doc = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("docs/feed.md")).unwrap();
    let start = doc.find(first_line).unwrap_or_else(|| panic!("docs/feed.md has no {first_line:?}"));
    let block = &doc[start..];
    block[..block.find("```").expect("the block ends")].to_owned()
}

/// The Node and Python snippets accept `batch` as sent, and refuse it with
/// a byte of the body changed or under another secret.
fn snippets_accept_only_the_real_batch(dir: &Path, batch: &Accepted) {
    let body = dir.join("batch.json");
    std::fs::write(&body, &batch.body).unwrap();
    let tampered = dir.join("tampered.json");
    // Still JSON, one byte more: a signature covers the bytes, not the meaning.
    std::fs::write(&tampered, [&batch.body[..], b" "].concat()).unwrap();
    let node = format!(
        "{}\nconst fs = require('node:fs');\nconsole.log(verifyPresencedBatch(fs.readFileSync(process.env.BODY), process.env.HEADER, process.env.SECRET));",
        documented("// Verifies a presenced webhook batch")
    );
    let python = format!(
        "{}\nimport os\nprint('true' if verify_presenced_batch(open(os.environ['BODY'], 'rb').read(), os.environ['HEADER'], os.environ['SECRET'].encode()) else 'false')",
        documented("# Verifies a presenced webhook batch")
    );
    for (program, flag, code) in [("node", "-e", &node), ("python3", "-c", &python)] {
        for (file, secret, expected) in [
            (&body, SECRET, "true"),
            (&tampered, SECRET, "false"),
            (&body, "another-secret-of-32-bytes-or-more", "false"),
        ] {
            let output = Command::new(program)
                .args([flag, code])
                .env("BODY", file)
                .env("HEADER", &batch.signature)
                .env("SECRET", secret)
                .output()
                .unwrap_or_else(|err| panic!("run {program}: {err}"));
            let said = String::from_utf8_lossy(&output.stdout);
            assert_eq!(
                said.trim(),
                expected,
                "{program} on {}: {}",
                file.display(),
                String::from_utf8_lossy(&output.stderr)
            );
        }
    }
}

#[test]
fn f4_a_webhook_without_a_secret_with_a_bad_url_or_on_a_cluster_node_is_refused_before_listening_on() {
    let long = "s".repeat(32);
    let cases: [(&[&str], &str); 8] = [
        (&["--feed-webhook", "http://127.0.0.1:9/hook"], "--feed-webhook needs --feed-webhook-secret"),
        (&["--feed-webhook", "ftp://127.0.0.1:9/hook", "--feed-webhook-secret", &long], "http:// or https://"),
        (
            &["--feed-webhook", "http://127.0.0.1:9/hook", "--feed-webhook-secret", "short"],
            "shorter than the minimum of 32",
        ),
        (
            &["--feed-webhook", "http://127.0.0.1:9/hook#kind=flip", "--feed-webhook-secret", &long],
            "unknown filter \"kind\"",
        ),
        (&["--feed-webhook-secret", &long], "--feed-webhook-secret needs --feed-webhook"),
        (
            &[
                "--feed-webhook",
                "http://127.0.0.1:9/hook",
                "--feed-webhook-secret",
                &long,
                "--feed-retention-bytes",
                "0",
            ],
            "--feed-webhook needs the change feed",
        ),
        (
            &[
                "--feed-webhook",
                "http://127.0.0.1:9/a",
                "--feed-webhook",
                "http://127.0.0.1:9/a#kinds=flip",
                "--feed-webhook-secret",
                &long,
            ],
            "given twice",
        ),
        (
            &[
                "--feed-webhook",
                "http://127.0.0.1:9/hook",
                "--feed-webhook-secret",
                &long,
                "--etcd",
                "http://127.0.0.1:9",
                "--node-id",
                "node-a",
                "--advertise",
                "127.0.0.1:9",
            ],
            "--feed-webhook is not built for a cluster node: run a Changes consumer",
        ),
    ];
    for (args, reason) in cases {
        let argv: Vec<&str> = ["serve", "--listen", "127.0.0.1:0"].iter().chain(args).copied().collect();
        let (code, stdout, stderr) = run_with_deadline(&argv);
        assert_eq!(code, Some(2), "{args:?}: {stderr}");
        assert_eq!(stdout, "", "{args:?}: nothing announced");
        let last = stderr.lines().last().unwrap_or_default();
        assert!(last.starts_with("presenced: ") && last.contains(reason), "{args:?}: {reason:?} in {stderr:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_a_webhook_over_https_is_delivered_to_a_receiver_the_given_ca_vouches_for_and_to_no_other() {
    let dir = scratch_dir("webhook-https");
    let pki = crate::common::tls::Pki::new(&dir, "receiver");
    let receiver = Receiver::start_tls(&pki.issue("receiver", &["localhost"])).await;
    // Trusting the receiver's CA: the flips arrive, signed.
    let mut config = webhook_config(receiver.url());
    config.feed_webhooks.ca = Some(pki.ca_path());
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let users: Vec<String> = (0..20).map(|i| format!("secure-{i}")).collect();
    round_trip(&mut client, &users).await;
    receiver.until_flip_of("secure-19").await;
    assert_eq!(receiver.with(|received| received.bad_signatures), 0);
    server.stop().await;

    // Trusting only the system's roots: no handshake completes, nothing is delivered.
    let stranger = Receiver::start_tls(&pki.issue("stranger", &["localhost"])).await;
    let server = TestServer::start(webhook_config(stranger.url())).await;
    let mut client = server.client().await;
    round_trip(&mut client, &users).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(stranger.with(|received| received.answered.is_empty()), "no request reached a receiver it does not trust");
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_filters_after_the_hash_choose_what_a_webhook_carries() {
    let receiver = Receiver::start().await;
    let server = TestServer::start(webhook_config(format!("{}#kinds=status&id_prefix=team-", receiver.url()))).await;
    let mut client = server.client().await;
    register_users(&mut client, &["team-a".to_owned(), "other".to_owned()]).await;
    for user in ["team-a", "other", "team-b"] {
        let status = pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), expires_at_ms: 0 };
        let set = pb::SetStatusRequest { user_id: user.into(), status: Some(status) };
        client.set_status(set).await.unwrap();
    }
    within(PATIENCE, "team-b's status", async {
        while !receiver.with(|received| {
            received.accepted.iter().flat_map(Accepted::events).any(|event| event["status"]["user_id"] == "team-b")
        }) {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    let received = receiver.with(std::mem::take);
    let carried: Vec<&Value> = received.accepted.iter().flat_map(Accepted::events).collect();
    let users: Vec<&str> =
        carried.iter().map(|event| event["status"]["user_id"].as_str().expect("only statuses")).collect();
    assert_eq!(users, ["team-a", "team-b"], "only statuses of ids starting with team-");
    assert_eq!(carried[0]["status"]["status"]["availability"], "AVAILABILITY_AWAY");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f4_a_receiver_gone_past_retention_gets_a_retention_gap_then_the_oldest_changes() {
    let mut receiver = Receiver::start().await;
    let mut config = webhook_config(receiver.url());
    config.feed_retention_bytes = Some(64 << 10);
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    register_users(&mut client, &["first".to_owned()]).await;
    receiver.until_flip_of("first").await;
    let first = receiver.with(|received| received.accepted[0].json["cursor"].clone());
    receiver.down();
    // About 80 bytes a flip: 10,000 flips are far more than 64 KiB, and more
    // than the webhook's stream reads ahead while its batch waits.
    let users: Vec<String> = (0..500).map(|i| format!("user-{i:03}")).collect();
    for _ in 0..10 {
        round_trip(&mut client, &users).await;
    }
    within(PATIENCE, "retention to pass the webhook's cursor", async {
        while changes(&mut client, pb::ChangesFrom::Cursor, &cursor_bytes(&first), everything()).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    receiver.up().await;
    register_users(&mut client, &["sentinel".to_owned()]).await;
    receiver.until_flip_of("sentinel").await;
    let received = receiver.with(std::mem::take);
    assert_each_event_once_in_order(&received.accepted);
    let events: Vec<&Value> = received.accepted.iter().flat_map(Accepted::events).collect();
    let gaps: Vec<usize> = (0..events.len()).filter(|&at| events[at].get("gap").is_some()).collect();
    let around: Vec<String> =
        gaps.iter().map(|&at| format!("event {at} of {}: {}", events.len(), events[at])).collect();
    assert_eq!(gaps.len(), 1, "F4: one gap where retention passed the webhook: {around:?}");
    let gap = &events[gaps[0]]["gap"];
    assert_eq!(gap["reason"], "retention");
    assert_eq!(gap["after_cursor"], events[gaps[0] - 1]["cursor"], "the gap starts after the last event sent");
    assert!(events.len() < 10_003, "what retention removed is not sent: {} events", events.len());
    server.stop().await;
}
