//! The `presenced` binary as a user runs it: the listening line, health and
//! reflection, configuration from flags and environment, clear refusals, and
//! a graceful SIGTERM.

use std::process::Command;
use std::time::{Duration, Instant};

use crate::common::daemon::{BINARY, Daemon, free_port};
use crate::common::scrape::{sample, scrape, scrape_when};
use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tokio_stream::StreamExt;
use tonic::Code;

async fn channel(daemon: &Daemon) -> tonic::transport::Channel {
    tonic::transport::Channel::from_shared(daemon.url()).unwrap().connect().await.expect("connect to presenced")
}

/// Runs the binary to completion and returns (exit code, stderr).
fn run_to_exit(args: &[&str]) -> (Option<i32>, String) {
    let output = Command::new(BINARY).args(args).env("RUST_LOG", "warn").output().unwrap();
    (output.status.code(), String::from_utf8(output.stderr).unwrap())
}

#[tokio::test]
async fn serves_health_and_both_reflection_versions_and_stops_gracefully_on_sigterm() {
    // Clients keep their connections open across the shutdown, as gateways do; the grace bounds the wait.
    let mut daemon = Daemon::start(&["--shutdown-grace-ms", "1000"], &[]);

    let mut health = tonic_health::pb::health_client::HealthClient::new(channel(&daemon).await);
    for service in ["", "presence.v1.Presence"] {
        let request = tonic_health::pb::HealthCheckRequest { service: service.into() };
        let status = health.check(request).await.unwrap().into_inner().status;
        assert_eq!(status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32, "{service:?}");
    }

    use tonic_reflection::pb::{v1, v1alpha};
    let mut reflection_v1 = v1::server_reflection_client::ServerReflectionClient::new(channel(&daemon).await);
    let request = v1::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1::server_reflection_request::MessageRequest::ListServices(String::new())),
    };
    let mut answers = reflection_v1.server_reflection_info(tokio_stream::iter([request])).await.unwrap().into_inner();
    let Some(v1::server_reflection_response::MessageResponse::ListServicesResponse(listed)) =
        answers.next().await.unwrap().unwrap().message_response
    else {
        panic!("reflection v1 must list services");
    };
    let names: Vec<_> = listed.service.iter().map(|s| s.name.as_str()).collect();
    for expected in ["presence.v1.Presence", "grpc.health.v1.Health"] {
        assert!(names.contains(&expected), "{expected} missing from {names:?}");
    }

    let mut reflection_v1alpha = v1alpha::server_reflection_client::ServerReflectionClient::new(channel(&daemon).await);
    let request = v1alpha::ServerReflectionRequest {
        host: String::new(),
        message_request: Some(v1alpha::server_reflection_request::MessageRequest::FileContainingSymbol(
            "presence.v1.Presence".into(),
        )),
    };
    let mut answers =
        reflection_v1alpha.server_reflection_info(tokio_stream::iter([request])).await.unwrap().into_inner();
    let answer = answers.next().await.unwrap().unwrap().message_response;
    assert!(
        matches!(answer, Some(v1alpha::server_reflection_response::MessageResponse::FileDescriptorResponse(ref f)) if !f.file_descriptor_proto.is_empty()),
        "reflection v1alpha must describe presence.v1.Presence: {answer:?}"
    );

    // An open Watch is ended with a retryable status, and the process exits 0.
    let mut viewer = PresenceClient::connect(daemon.url()).await.unwrap();
    let mut stream = viewer
        .watch(pb::WatchRequest { user_ids: vec!["u1".into()], ..Default::default() })
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().expect("the opening snapshot");
    daemon.terminate();
    let ended = tokio::time::timeout(PATIENCE, stream.message()).await.expect("the watch ends on shutdown");
    match ended {
        Err(status) => assert_eq!(status.code(), Code::Unavailable, "{status:?}"),
        Ok(item) => panic!("expected UNAVAILABLE, got {item:?}"),
    }
    let status = daemon.wait_exit().await;
    assert!(status.success(), "graceful shutdown exits 0, got {status:?}");
}

#[tokio::test]
async fn ttl_bounds_come_from_flags_and_from_the_environment() {
    let daemon =
        Daemon::start(&["--min-ttl-ms", "2000", "--default-ttl-ms", "3000"], &[("PRESENCED_MAX_TTL_MS", "5000")]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    for (ttl, accepted) in [(1_999, false), (2_000, true), (5_000, true), (5_001, false)] {
        let result = client.register(register("u1", "s1", "gw", ttl)).await;
        assert_eq!(result.is_ok(), accepted, "ttl {ttl}: {result:?}");
        if let Err(status) = result {
            assert_eq!(status.code(), Code::InvalidArgument);
            assert!(status.message().contains("ttl_ms"));
        }
    }
}

#[test]
fn a_taken_address_is_refused_in_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let (code, stderr) = run_to_exit(&["serve", "--listen", &addr]);
    assert_ne!(code, Some(0));
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
    assert!(stderr.contains("cannot listen on") && stderr.contains(&addr), "{stderr:?}");
}

/// A command line of the wrong shape is answered as clap words it, with
/// the usage; bare `presenced`, `presenced token` and `presenced cluster`
/// print their help on several lines; the top-level help names the client
/// commands' common flags.
#[test]
fn usage_errors_and_help_read_as_clap_prints_them() {
    let (code, stderr) = run_to_exit(&["token", "new", "x"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("the following required arguments were not provided:\n"), "{stderr}");
    assert!(stderr.contains("\nUsage: presenced token new"), "a Usage: line: {stderr}");
    for bare in [&[][..], &["token"], &["cluster"]] {
        let (code, stderr) = run_to_exit(bare);
        assert_eq!(code, Some(2), "{bare:?}");
        assert!(stderr.lines().count() > 5, "{bare:?}: help on several lines: {stderr}");
        assert!(stderr.lines().all(|line| line.len() < 200), "{bare:?}: no line of the whole help: {stderr}");
        assert!(stderr.contains("Usage: presenced"), "{bare:?}: {stderr}");
    }
    let (code, stderr) = run_to_exit(&["get", "u1", "--adress", "x"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("unexpected argument '--adress'") && stderr.contains("--addr"), "a suggestion: {stderr}");
    let help = Command::new(BINARY).arg("--help").output().unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    for flag in ["--addr ADDR", "--token TOKEN", "--token-file FILE", "--json", "4  unauthenticated"] {
        assert!(help.contains(flag), "presenced --help names {flag}: {help}");
    }
}

/// What a start logs says what it means: the address served and the
/// console's, a new data directory as new (not as damage), a credentials
/// file that lets nobody in, and a service token short enough to guess;
/// `serve --help` gives each default once.
#[tokio::test]
async fn a_start_says_where_it_serves_and_warns_of_settings_that_let_nobody_in_or_anybody() {
    let dir = crate::common::daemon::scratch_dir("start-words");
    let (credentials, log) = (dir.join("credentials.toml"), dir.join("presenced.log"));
    std::fs::write(&credentials, "# no credential yet\n").unwrap();
    let data = dir.join("data");
    let args = [
        "--data-dir",
        data.to_str().unwrap(),
        "--credentials",
        credentials.to_str().unwrap(),
        "--service-token",
        "abc",
    ];
    let daemon = Daemon::start_on("127.0.0.1:0", &args, &[("RUST_LOG", "info")], Some(&log));
    let addr = daemon.addr();
    // The line is logged as serving begins, beside the `listening on` line the start waits for.
    let deadline = std::time::Instant::now() + crate::common::PATIENCE;
    let said = loop {
        let said = std::fs::read_to_string(&log).unwrap();
        if said.contains("serving on") || std::time::Instant::now() > deadline {
            break said;
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    };
    assert!(said.contains(&format!("serving on {addr}; the console at http://{addr}/console/")), "{said}");
    assert!(said.contains("no checkpoint yet: starting empty") && !said.contains("no usable checkpoint"), "{said}");
    assert!(said.contains("holds no credential: every service call is refused until one is added"), "{said}");
    assert!(said.contains("--service-token #1: 3 characters can be guessed"), "{said}");
    daemon.stop().await;
    let help = Command::new(BINARY).args(["serve", "--help"]).output().unwrap();
    let help = String::from_utf8(help.stdout).unwrap();
    assert!(!help.contains("] [default:"), "each default once: {help}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--listen localhost:PORT` serves both loopbacks on one port: a client
/// reaches it at 127.0.0.1, at ::1 (where this machine has IPv6) and at
/// localhost, which resolves to either.
#[tokio::test]
async fn listen_localhost_serves_both_loopbacks_on_one_port() {
    let daemon = Daemon::start_on("localhost:0", &[], &[], None);
    let port = daemon.addr().rsplit(':').next().unwrap().to_owned();
    assert!(daemon.addr().starts_with("127.0.0.1:"), "{}", daemon.addr());
    let mut addresses = vec![format!("127.0.0.1:{port}"), format!("localhost:{port}")];
    if std::net::TcpListener::bind("[::1]:0").is_ok() {
        addresses.push(format!("[::1]:{port}"));
    }
    for addr in &addresses {
        let ran = Command::new(BINARY).args(["stats", "--addr", addr]).output().unwrap();
        assert_eq!(ran.status.code(), Some(0), "{addr}: {}", String::from_utf8_lossy(&ran.stderr));
    }
    daemon.stop().await;
    let (code, stderr) = run_to_exit(&["serve", "--listen", "localhost"]);
    assert_eq!(code, Some(2));
    assert!(stderr.contains("is not IP:PORT or localhost:PORT"), "{stderr}");
}

#[test]
fn an_invalid_configuration_is_refused_in_one_line() {
    for args in [
        &["serve", "--min-ttl-ms", "0"][..],
        &["serve", "--min-ttl-ms", "50000", "--default-ttl-ms", "45000"],
        &["serve", "--shards", "6"],
        &["serve", "--config", "/nonexistent/presenced.toml"],
    ] {
        let (code, stderr) = run_to_exit(args);
        assert_ne!(code, Some(0), "{args:?}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr:?}");
        assert!(stderr.starts_with("presenced: "), "{stderr:?}");
    }
}

#[tokio::test]
async fn o1_metrics_are_served_on_the_metrics_address() {
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let daemon = Daemon::start(&["--metrics-listen", &metrics_addr, "--min-ttl-ms", "50"], &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    let mut viewer = Viewer::open(&mut client, &["u1", "u2"]).await;
    let u1 = client.register(register("u1", "s1", "gw", 0)).await.unwrap().into_inner();
    client.register(register("u1", "s1", "gw", 0)).await.unwrap(); // a reconnect
    client.renew(renew("u1", "s1", u1.generation, 0)).await.unwrap_err(); // stale after the reconnect
    client.register(register("u2", "s1", "gw", 50)).await.unwrap(); // expires in 50 ms
    viewer.until_state("u2", pb::State::Offline).await;

    // Store counts are exported once a second: wait for them rather than for a fixed time.
    let metrics = scrape_when(&metrics_addr, "presenced_sessions ", 1.0).await;
    assert_eq!(sample(&metrics, "presenced_online_users "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_reconnects_total "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_renewals_total{result=\"stale_generation\"} "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_expiries_total "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_flips_total{state=\"online\"} "), Some(2.0));
    assert_eq!(sample(&metrics, "presenced_expiry_lag_seconds_count "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_viewers "), Some(1.0));
    assert!(sample(&metrics, "presenced_events_fanned_out_total ").is_some_and(|n| n >= 3.0), "{metrics}");
    assert!(metrics.contains("presenced_shard_operations{shard=\"0\"}"), "{metrics}");
    assert!(metrics.contains("presenced_expiry_lag_seconds_bucket{le=\"0.05\"}"), "{metrics}");
}

#[test]
fn p1_an_open_server_refuses_a_non_loopback_address_unless_insecure() {
    let (code, stderr) = run_to_exit(&["serve", "--listen", "0.0.0.0:0"]);
    assert_ne!(code, Some(0));
    assert_eq!(stderr.lines().count(), 1, "one line: {stderr:?}");
    assert!(stderr.contains("--insecure") && stderr.contains("0.0.0.0:0"), "{stderr:?}");
}

#[tokio::test]
async fn p1_insecure_or_credentials_allow_any_address() {
    for args in [&["--insecure"][..], &["--service-token", "t0k3n"]] {
        let daemon = Daemon::start_on("0.0.0.0:0", args, &[], None);
        assert!(daemon.addr.starts_with("0.0.0.0:"), "{}", daemon.addr);
        daemon.stop().await;
    }
}

/// Runs the binary and returns (exit code, stdout, stderr), killing it if it
/// has not exited within the patience: a configuration that is accepted by
/// mistake would otherwise serve for ever.
pub(super) fn run_with_deadline(args: &[&str]) -> (Option<i32>, String, String) {
    use std::process::Stdio;
    let mut child = Command::new(BINARY)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + PATIENCE;
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let output = child.wait_with_output().unwrap();
    (output.status.code(), String::from_utf8(output.stdout).unwrap(), String::from_utf8(output.stderr).unwrap())
}

/// B7: every class of bad configuration (credentials, key files, the data
/// directory, flag combinations, the config file, the metrics address) is
/// refused before the service binds or prints `listening on`: stdout stays
/// empty, the exit status is 2, and stderr is one line naming the setting.
#[test]
fn b7_a_bad_configuration_is_refused_before_anything_is_announced() {
    let dir = crate::common::daemon::scratch_dir("b7");
    let file = dir.join("a-file");
    std::fs::write(&file, "not a directory").unwrap();
    let not_a_key = dir.join("not-a-key.pem");
    std::fs::write(&not_a_key, "-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n").unwrap();
    // A data directory whose durable store cannot be created (a directory is
    // in the way): the closest to "not writable" that also holds for root.
    let blocked = dir.join("blocked");
    std::fs::create_dir_all(blocked.join("durable.redb")).unwrap();
    let unknown_key = dir.join("unknown-key.toml");
    std::fs::write(&unknown_key, "listen = \"127.0.0.1:0\"\nmax_ttl = 5000\n").unwrap();
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let taken = taken.local_addr().unwrap().to_string();
    let path = |path: &std::path::Path| path.to_str().unwrap().to_owned();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (vec!["--viewer-jwt-hs256-secret".into(), "short".into()], "viewer-jwt-hs256-secret"),
        (vec!["--viewer-jwt-public-key".into(), path(&dir.join("missing.pem"))], "viewer-jwt-public-key"),
        (vec!["--viewer-jwt-public-key".into(), path(&not_a_key)], "viewer-jwt-public-key"),
        (vec!["--service-token".into(), "has space".into()], "service-token"),
        (vec!["--data-dir".into(), path(&file)], "data-dir"),
        (vec!["--data-dir".into(), path(&file.join("below-a-file"))], "data-dir"),
        (vec!["--data-dir".into(), path(&blocked)], "data-dir"),
        (vec!["--min-ttl-ms".into(), "5000".into(), "--max-ttl-ms".into(), "1000".into()], "min-ttl-ms"),
        (vec!["--watch-buffer".into(), "0".into()], "watch-buffer"),
        (vec!["--config".into(), path(&unknown_key)], "max_ttl"),
        (vec!["--metrics-listen".into(), taken.clone()], &taken),
        (vec!["--default-visibility".into(), "friends".into()], "--default-visibility"),
        (vec!["--forget-offline-after-ms".into(), "soon".into()], "--forget-offline-after-ms"),
        (vec!["--cors-origin".into(), "https://app.example/".into()], "--cors-origin"),
        (vec!["--console".into(), "maybe".into()], "--console"),
    ];
    for (args, setting) in cases {
        let argv: Vec<&str> =
            ["serve", "--listen", "127.0.0.1:0"].into_iter().chain(args.iter().map(String::as_str)).collect();
        let (code, stdout, stderr) = run_with_deadline(&argv);
        assert_eq!(stdout, "", "{args:?}: nothing may be announced (stderr {stderr:?})");
        assert_eq!(code, Some(2), "{args:?}: exit 2 (stderr {stderr:?})");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: one line: {stderr:?}");
        assert!(stderr.starts_with("presenced: ") && stderr.contains(setting), "{args:?}: names {setting}: {stderr:?}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Scrapes `/metrics` until `series` has `value`, or fails after the patience.
async fn until_sample(metrics_addr: &str, series: &str, value: f64) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let metrics = scrape(metrics_addr);
        if sample(&metrics, series) == Some(value) {
            return;
        }
        assert!(Instant::now() < deadline, "{series}never reached {value}:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test]
async fn b5_open_connections_and_refusals_are_counted_and_the_gauge_returns_to_zero() {
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let daemon = Daemon::start(&["--metrics-listen", &metrics_addr, "--max-connections", "2"], &[]);
    let mut clients = Vec::new();
    for user in ["u1", "u2"] {
        let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
        client.register(register(user, "s1", "gw", 0)).await.expect("within the cap");
        clients.push(client);
    }
    until_sample(&metrics_addr, "presenced_connections ", 2.0).await;
    // One plain TCP connection, so that exactly one connection is refused (a
    // gRPC client may try again on its own): the server closes it.
    let mut third = tokio::net::TcpStream::connect(daemon.addr()).await.unwrap();
    let closed = within(PATIENCE, "the third connection is closed", async {
        use tokio::io::AsyncReadExt;
        let mut buf = [0u8; 1024];
        while third.read(&mut buf).await.is_ok_and(|read| read > 0) {}
    });
    closed.await;
    until_sample(&metrics_addr, "presenced_connections_refused_total ", 1.0).await;
    drop(clients);
    until_sample(&metrics_addr, "presenced_connections ", 0.0).await;
}

#[tokio::test]
async fn o1_room_signal_and_damping_metrics_are_served() {
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let daemon = Daemon::start(&["--metrics-listen", &metrics_addr, "--offline-grace-ms", "5000"], &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    let watch = pb::WatchRoomRequest { room_id: "doc".into(), ..Default::default() };
    let mut room = client.watch_room(watch).await.unwrap().into_inner();
    room.message().await.unwrap().expect("the opening snapshot");
    let session = client.register(register("u1", "s1", "gw", 0)).await.unwrap().into_inner();
    let join = pb::JoinRequest {
        user_id: "u1".into(),
        session_id: "s1".into(),
        generation: session.generation,
        room_id: "doc".into(),
        metadata: Default::default(),
    };
    client.join(join).await.unwrap();
    let signal = pb::SignalRequest {
        user_id: "u1".into(),
        session_id: "s1".into(),
        generation: session.generation,
        room_id: "doc".into(),
        kind: "typing".into(),
        ttl_ms: 5_000,
    };
    client.signal(signal).await.unwrap();
    // A flap that damping hides: the user never goes OFFLINE.
    client.unregister(unregister("u1", "s1", session.generation, 0)).await.unwrap();
    client.register(register("u1", "s1", "gw", 0)).await.unwrap();

    let metrics = scrape_when(&metrics_addr, "presenced_suppressed_flaps ", 1.0).await;
    assert_eq!(sample(&metrics, "presenced_room_joins_total "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_signals_total "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_room_changes_total{kind=\"joined\"} "), Some(1.0));
    assert_eq!(
        sample(&metrics, "presenced_room_changes_total{kind=\"signals\"} "),
        Some(2.0),
        "set, then ended with the lease"
    );
    assert_eq!(sample(&metrics, "presenced_room_changes_total{kind=\"left\"} "), Some(1.0));
    // Joined, the signal set, and the leave (the signal's end conflated with it or not): at least 3.
    assert!(sample(&metrics, "presenced_room_events_fanned_out_total ").is_some_and(|n| n >= 3.0), "{metrics}");
    assert_eq!(sample(&metrics, "presenced_room_watchers "), Some(1.0));
    assert_eq!(sample(&metrics, "presenced_rooms "), Some(0.0), "the room emptied with the lease");
    assert_eq!(sample(&metrics, "presenced_room_memberships "), Some(0.0));
}

#[tokio::test]
async fn d2_livez_answers_while_a_large_checkpoint_loads_and_readyz_only_once_it_is_served() {
    let data = crate::common::daemon::scratch_dir("d2-readyz");
    let data_dir = data.to_str().unwrap();
    let metrics_addr = format!("127.0.0.1:{}", free_port());
    let args = ["--data-dir", data_dir, "--metrics-listen", &metrics_addr];
    let daemon = Daemon::start(&args, &[]);
    assert_eq!(probe_until_answered(&metrics_addr, "/livez").await, (200, "ok\n".to_owned()));
    // 100,000 sessions, so that the checkpoint takes a moment to load.
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    for part in 0..10 {
        let items = (0..10_000).map(|i| register_item(&format!("u-{part}-{i}"), "s", 600_000)).collect();
        lease_batch(&mut client, items).await;
    }
    let (status, body) = probe_until_answered(&metrics_addr, "/readyz").await;
    assert_eq!((status, body.as_str()), (200, "[+]started ok\n[+]not-draining ok\nready\n"));
    assert_eq!(probe_until_answered(&metrics_addr, "/nothing").await.0, 404);
    daemon.stop().await;

    // Started again on the same data directory: the checkpoint loads after
    // the listening line, and the node is alive, not ready, meanwhile.
    let daemon = Daemon::start(&args, &[]);
    let (status, body) = probe_until_answered(&metrics_addr, "/readyz").await;
    assert_eq!(status, 503, "{body}");
    assert!(body.contains("[-]started failed: restoring"), "{body}");
    assert_eq!(probe_until_answered(&metrics_addr, "/livez").await.0, 200);
    let deadline = Instant::now() + Duration::from_secs(20);
    while probe_until_answered(&metrics_addr, "/readyz").await.0 != 200 {
        assert!(Instant::now() < deadline, "not ready after the checkpoint loaded");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let snapshot = snapshot(&mut PresenceClient::connect(daemon.url()).await.unwrap(), &["u-9-9999"]).await;
    assert_eq!(state_of(&snapshot[0]), pb::State::Online, "restored by the time it is ready");
    daemon.stop().await;
    let _ = std::fs::remove_dir_all(&data);
}

/// [`crate::common::scrape::probe`], asked again while the metrics port is not bound yet.
async fn probe_until_answered(addr: &str, path: &str) -> (u16, String) {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        if std::net::TcpStream::connect(addr).is_ok() {
            return crate::common::scrape::probe(addr, path);
        }
        assert!(Instant::now() < deadline, "the metrics port {addr} never answered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}
