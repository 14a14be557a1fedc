//! TLS on the service and metrics ports (contract T1, T2, T4), with real
//! handshakes against `presenced serve` and certificates the tests make:
//! what a client with the right CA gets over gRPC and gRPC-Web, what each
//! kind of wrong client sees, what a client certificate makes of its
//! holder, and a certificate rotated on disk under open streams.

use std::path::Path;
use std::time::Duration;

use crate::common::auth::{SECRET, SERVICE, viewer_token};
use crate::common::daemon::{Daemon, scratch_dir};
use crate::common::tls::*;
use crate::common::*;
use presence_client::{LeaseChannel, LeaseChannelConfig};
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tokio::io::AsyncWriteExt as _;
use tonic::Code;

/// A CA and a certificate from it for `localhost` and 127.0.0.1, in a fresh directory.
fn server_pki(name: &str) -> (Pki, Issued) {
    let pki = Pki::new(&scratch_dir(name), "server");
    let server = pki.issue("server", &["localhost", "127.0.0.1"]);
    (pki, server)
}

fn start(server: &Issued, extra: &[&str]) -> Daemon {
    let flags = tls_flags(server);
    let args: Vec<&str> = flags.iter().map(String::as_str).chain(extra.iter().copied()).collect();
    Daemon::start(&args, &[])
}

/// [`start`], with the server's log written to `log`.
fn start_logging_to(log: &Path, server: &Issued, extra: &[&str]) -> Daemon {
    let flags = tls_flags(server);
    let args: Vec<&str> = flags.iter().map(String::as_str).chain(extra.iter().copied()).collect();
    Daemon::start_on("127.0.0.1:0", &args, &[], Some(log))
}

fn https(daemon: &Daemon) -> String {
    format!("https://{}", daemon.addr())
}

async fn client(daemon: &Daemon, ca: &Path, cert: Option<&Issued>) -> PresenceClient<tonic::transport::Channel> {
    let channel =
        presence_client::connect(&https(daemon), Some(&client_tls(ca, cert))).await.expect("connect over TLS");
    PresenceClient::new(channel)
}

/// The message a failed call or connection shows, whichever failed first.
async fn refusal_seen(daemon: &Daemon, ca: &Path, cert: Option<&Issued>) -> String {
    match presence_client::connect(&https(daemon), Some(&client_tls(ca, cert))).await {
        Err(err) => err.to_string(),
        Ok(channel) => {
            let answer = PresenceClient::new(channel).snapshot(pb::SnapshotRequest::default()).await;
            answer.expect_err("a refused client's call fails").to_string()
        }
    }
}

/// An error and its sources, as a client's log shows them.
fn sources(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(next) = source {
        text = format!("{text}: {next}");
        source = next.source();
    }
    text
}

#[tokio::test]
async fn t1_a_client_with_the_right_ca_is_served_over_grpc_and_grpc_web_and_the_console() {
    let (pki, server) = server_pki("tls-served");
    let daemon = start(&server, &[]);
    let mut grpc = client(&daemon, &pki.ca_path(), None).await;
    grpc.register(register("alice", "s1", "gw", 30_000)).await.expect("Register over TLS");
    let seen = snapshot(&mut grpc, &["alice"]).await;
    assert_eq!(state_of(&seen[0]), pb::State::Online);

    // gRPC-Web as a browser on an https page sends it: over HTTP/1.1 here (h2 is what gRPC does above).
    let request = pb::SnapshotRequest { user_ids: vec!["alice".into()], ..Default::default() };
    let mut body = vec![0u8];
    body.extend_from_slice(&u32::try_from(prost::Message::encoded_len(&request)).unwrap().to_be_bytes());
    body.extend_from_slice(&prost::Message::encode_to_vec(&request));
    let mut http = format!(
        "POST /presence.v1.Presence/Snapshot HTTP/1.1\r\nhost: localhost\r\ncontent-type: application/grpc-web+proto\r\n\
         x-grpc-web: 1\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    )
    .into_bytes();
    http.extend_from_slice(&body);
    let stream =
        handshake(daemon.addr(), &pki.ca_path(), None, &[b"http/1.1"]).await.expect("an HTTP/1.1 TLS handshake");
    assert_eq!(stream.get_ref().1.alpn_protocol(), Some(&b"http/1.1"[..]));
    let answer = String::from_utf8_lossy(&http1_exchange(stream, &http).await).into_owned();
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("grpc-status:0") || answer.contains("grpc-status: 0"), "{answer}");
    assert!(answer.contains("alice"), "the snapshot names alice: {answer}");

    let console = handshake(daemon.addr(), &pki.ca_path(), None, &[b"http/1.1"]).await.unwrap();
    let page = http1_exchange(console, b"GET /console/ HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n").await;
    let page = String::from_utf8_lossy(&page);
    assert!(page.starts_with("HTTP/1.1 200") && page.contains("<html"), "the console over https: {page:.200}");
    daemon.stop().await;
}

#[tokio::test]
async fn t1_each_wrong_client_is_refused_with_an_error_that_says_which() {
    let (_pki, server) = server_pki("tls-refusals");
    let metrics = format!("127.0.0.1:{}", crate::common::daemon::free_port());
    let daemon = start(&server, &["--metrics-listen", &metrics]);

    let other = Pki::new(&scratch_dir("tls-refusals-other"), "other");
    let unknown_ca = refusal_seen(&daemon, &other.ca_path(), None).await;
    assert!(unknown_ca.contains("invalid peer certificate") && unknown_ca.contains("UnknownIssuer"), "{unknown_ca}");

    // A plaintext gRPC client on the TLS port is told so, in HTTP/2.
    let plaintext =
        PresenceClient::new(presence_client::connect_lazy(&format!("http://{}", daemon.addr()), None).unwrap())
            .snapshot(pb::SnapshotRequest::default())
            .await
            .expect_err("plaintext is refused");
    // tonic's message is hyper's ("http2 error"); the GOAWAY's text is in its source, as a client logs it.
    let seen = sources(&plaintext);
    assert!(seen.contains("this port speaks TLS; connect with https://"), "{seen}");
    // And a plaintext HTTP/1 client (curl http://), in HTTP/1.
    let mut raw = tokio::net::TcpStream::connect(daemon.addr()).await.unwrap();
    raw.write_all(b"GET /console/ HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let _ =
        within(PATIENCE, "the plaintext refusal", tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut answer)).await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("this port speaks TLS"), "{answer}");
    // The metrics port says the same to curl http:// (not a raw TLS alert).
    let mut raw = tokio::net::TcpStream::connect(&metrics).await.unwrap();
    raw.write_all(b"GET /metrics HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let _ = within(PATIENCE, "the metrics port's refusal", tokio::io::AsyncReadExt::read_to_end(&mut raw, &mut answer))
        .await;
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 400") && answer.contains("this port speaks TLS"), "{answer}");
    daemon.stop().await;
}

#[tokio::test]
async fn t1_a_v1_certificate_is_refused_naming_it_one_naming_no_address_is_warned_of_and_refused_handshakes_are_logged()
{
    use crate::common::daemon::BINARY;
    // The usual openssl recipe without -extfile makes an X.509 v1 certificate.
    presence_faults::install::provide(&["openssl"], "install-openssl").expect("openssl");
    let dir = scratch_dir("tls-v1");
    let (cert, key, csr) = (dir.join("v1.pem"), dir.join("v1-key.pem"), dir.join("v1.csr"));
    let openssl = |args: &[&str]| {
        let ran = std::process::Command::new("openssl").args(args).output().unwrap();
        assert!(ran.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&ran.stderr));
    };
    let path = |path: &std::path::PathBuf| path.to_str().unwrap().to_owned();
    openssl(&["ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", &path(&key)]);
    openssl(&["req", "-new", "-key", &path(&key), "-subj", "/CN=localhost", "-out", &path(&csr)]);
    openssl(&["x509", "-req", "-in", &path(&csr), "-signkey", &path(&key), "-days", "30", "-out", &path(&cert)]);
    let refused = std::process::Command::new(BINARY)
        .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert", &path(&cert), "--tls-key", &path(&key)])
        .output()
        .unwrap();
    assert_eq!(refused.status.code(), Some(2));
    let said = String::from_utf8_lossy(&refused.stderr);
    assert!(
        said.contains(&format!("--tls-cert {}: is an X.509 v1 certificate, which TLS clients refuse", cert.display())),
        "the certificate is blamed, in words: {said}"
    );
    assert!(!said.contains("--tls-key") && !said.contains("UnsupportedCertVersion"), "{said}");

    // A v3 certificate that names no address starts, with a warning.
    let pki = Pki::new(&dir, "server");
    let nameless = pki.issue("nameless", &["spiffe://example.org/presenced"]);
    let log = dir.join("nameless.log");
    let daemon = start_logging_to(&log, &nameless, &[]);
    let warned = std::fs::read_to_string(&log).unwrap();
    assert!(warned.contains("the certificate in --tls-cert names no DNS name or IP address"), "{warned}");
    daemon.stop().await;

    // Refused handshakes are logged, a line per ten seconds with their count.
    let (_, server) = server_pki("tls-refused-logged");
    let log = dir.join("refused.log");
    let daemon = start_logging_to(&log, &server, &[]);
    let other = Pki::new(&scratch_dir("tls-refused-logged-other"), "other");
    for _ in 0..3 {
        refusal_seen(&daemon, &other.ca_path(), None).await;
    }
    within(PATIENCE, "the refused handshake in the log", async {
        loop {
            let logged = std::fs::read_to_string(&log).unwrap();
            if let Some(line) = logged.lines().find(|line| line.contains("refused TLS handshakes")) {
                assert!(line.contains("the last, from 127.0.0.1:"), "{line}");
                assert_eq!(logged.matches("refused TLS handshakes").count(), 1, "one line for three: {logged}");
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    daemon.stop().await;
}

#[tokio::test]
async fn t1_an_expired_server_certificate_is_refused_by_the_client() {
    // A server whose certificate expired while it ran (presenced refuses to
    // start with one, below, but keeps serving one that expires): a
    // handshake server of rustls's own, presenting it.
    let pki = Pki::new(&scratch_dir("tls-expired-served"), "server");
    let expired = pki.issue_for("expired", &["localhost", "127.0.0.1"], Lifetime::Expired);
    let chain = vec![first_certificate(&expired.cert)];
    let key = {
        use rustls::pki_types::pem::PemObject as _;
        rustls::pki_types::PrivateKeyDer::from_pem_file(&expired.key).unwrap()
    };
    #[allow(deprecated)]
    let provider = std::sync::Arc::new(rustls::crypto::ring::default_provider());
    let mut config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    config.alpn_protocols = vec![b"h2".to_vec()];
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let acceptor = tokio_rustls::TlsAcceptor::from(std::sync::Arc::new(config));
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let _ = acceptor.accept(stream).await;
        }
    });
    let err = presence_client::connect(&format!("https://{addr}"), Some(&client_tls(&pki.ca_path(), None)))
        .await
        .expect_err("an expired certificate is refused");
    assert!(err.to_string().contains("expired"), "{err}");
}

#[tokio::test]
async fn t1_a_start_with_an_expired_or_mismatched_certificate_is_refused_before_listening() {
    let pki = Pki::new(&scratch_dir("tls-start-refusals"), "server");
    let expired = pki.issue_for("expired", &["localhost"], Lifetime::Expired);
    let good = pki.issue("good", &["localhost"]);
    let other = pki.issue("other", &["localhost"]);
    let cases = [
        (expired.cert.clone(), expired.key.clone(), "the certificate has expired"),
        (good.cert.clone(), other.key.clone(), "is not the key of the certificate in --tls-cert"),
        (good.key.clone(), good.key.clone(), "holds no certificate"),
    ];
    for (cert, key, says) in cases {
        let output = std::process::Command::new(crate::common::daemon::BINARY)
            .args(["serve", "--listen", "127.0.0.1:0", "--tls-cert"])
            .arg(&cert)
            .arg("--tls-key")
            .arg(&key)
            .output()
            .unwrap();
        let (stdout, stderr) = (String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        assert_eq!(output.status.code(), Some(2), "refused: {stderr}");
        assert!(!stdout.contains("listening on"), "refused before listening: {stdout}");
        assert!(stderr.contains(says), "says {says:?}: {stderr}");
    }
}

#[tokio::test]
async fn t2_mutual_tls_refuses_a_client_without_a_certificate_or_with_another_cas() {
    let (pki, server) = server_pki("mtls-refusals");
    let clients = Pki::new(&scratch_dir("mtls-refusals-clients"), "clients");
    let ca = clients.ca_path().display().to_string();
    let daemon = start(&server, &["--tls-client-ca", &ca]);

    let gateway = clients.issue("gateway", &["gateway.internal"]);
    let mut served = client(&daemon, &pki.ca_path(), Some(&gateway)).await;
    served.snapshot(pb::SnapshotRequest::default()).await.expect("a certificate from the client CA is let in");

    let without = refusal_seen(&daemon, &pki.ca_path(), None).await;
    assert!(without.contains("CertificateRequired"), "a client without a certificate: {without}");
    let stranger =
        Pki::new(&scratch_dir("mtls-refusals-stranger"), "stranger").issue("stranger", &["gateway.internal"]);
    let foreign = refusal_seen(&daemon, &pki.ca_path(), Some(&stranger)).await;
    assert!(foreign.contains("UnknownCA"), "a client certificate from another CA: {foreign}");
    daemon.stop().await;
}

#[tokio::test]
async fn t2_a_service_identity_certificate_is_a_service_caller_and_a_viewer_jwt_still_acts_as_its_viewer() {
    let (pki, server) = server_pki("mtls-identity");
    let clients = Pki::new(&scratch_dir("mtls-identity-clients"), "clients");
    let ca = clients.ca_path().display().to_string();
    let log = scratch_dir("mtls-identity-log").join("presenced.log");
    let daemon = start_logging_to(
        &log,
        &server,
        &[
            "--tls-client-ca",
            &ca,
            "--tls-service-identity",
            "spiffe://example.org/gateway",
            "--service-token",
            SERVICE,
            "--viewer-jwt-hs256-secret",
            SECRET,
            "--default-visibility",
            "everyone",
        ],
    );
    let gateway = clients.issue("gateway", &["gateway.internal", "spiffe://example.org/gateway"]);
    let mut as_gateway = client(&daemon, &pki.ca_path(), Some(&gateway)).await;
    as_gateway.register(register("bob", "s1", "gw", 30_000)).await.expect("the service identity may Register");

    let browser = clients.issue("browser", &["browser.internal"]);
    let mut as_browser = client(&daemon, &pki.ca_path(), Some(&browser)).await;
    let unlisted = as_browser.snapshot(pb::SnapshotRequest::default()).await.expect_err("no token, unlisted identity");
    assert_eq!(unlisted.code(), Code::Unauthenticated, "{unlisted:?}");
    assert!(
        unlisted
            .message()
            .contains("the client certificate (browser.internal) has no identity listed by --tls-service-identity"),
        "the refusal names the certificate's identities and the flag: {unlisted:?}"
    );
    let logged = std::fs::read_to_string(&log).unwrap();
    assert!(
        logged.contains("refused calls with a client certificate whose identities no --tls-service-identity lists")
            && logged.contains("browser.internal"),
        "the operator hears of it: {logged}"
    );

    let jwt = viewer_token("carol", false);
    let seen = as_browser
        .snapshot(with_token(pb::SnapshotRequest { user_ids: vec!["bob".into()], ..Default::default() }, Some(&jwt)))
        .await
        .expect("a viewer's JWT over mutual TLS");
    assert_eq!(state_of(&seen.into_inner().users[0]), pb::State::Online);
    let denied = as_browser
        .register(with_token(register("carol", "s1", "gw", 30_000), Some(&jwt)))
        .await
        .expect_err("the JWT makes its holder the viewer carol, not a service");
    assert_eq!(denied.code(), Code::PermissionDenied, "{denied:?}");
    // A token, when sent, decides: the gateway's certificate with a viewer's JWT is that viewer.
    let as_viewer = as_gateway
        .register(with_token(register("carol", "s2", "gw", 30_000), Some(&jwt)))
        .await
        .expect_err("a viewer's JWT on the gateway's connection");
    assert_eq!(as_viewer.code(), Code::PermissionDenied, "{as_viewer:?}");
    daemon.stop().await;
}

#[tokio::test]
async fn t4_a_rotated_certificate_serves_new_connections_while_open_streams_go_on() {
    let dir = scratch_dir("tls-rotation");
    let pki = Pki::new(&dir, "server");
    let server = pki.issue("server", &["localhost", "127.0.0.1"]);
    let metrics = format!("127.0.0.1:{}", crate::common::daemon::free_port());
    let daemon = start(&server, &["--tls-reload-interval-ms", "100", "--metrics-listen", &metrics]);
    let tls = client_tls(&pki.ca_path(), None);

    let mut viewer_client = client(&daemon, &pki.ca_path(), None).await;
    let mut viewer = Viewer::open(&mut viewer_client, &["dave"]).await;
    let config = LeaseChannelConfig { tls: Some(tls.clone()), ..LeaseChannelConfig::default() };
    let leases = LeaseChannel::connect(https(&daemon), config).await.unwrap();
    let registered = leases.register(register("dave", "s1", "gw", 30_000)).await.expect("Register through Leases");
    viewer.until_state("dave", pb::State::Online).await;
    let before = handshake(daemon.addr(), &pki.ca_path(), None, &[b"h2"]).await.unwrap();
    assert_eq!(presented(&before), first_certificate(&server.cert));

    // A new certificate for the same names, from the same CA, written over the old files.
    let rotated = pki.issue("server", &["localhost", "127.0.0.1", "rotated.example"]);
    let new_certificate = first_certificate(&rotated.cert);
    assert_ne!(new_certificate, presented(&before));
    within(PATIENCE, "a new connection sees the new certificate", async {
        loop {
            let stream = handshake(daemon.addr(), &pki.ca_path(), None, &[b"h2"]).await.unwrap();
            if presented(&stream) == new_certificate {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    // The streams opened before go on, on their connections.
    leases.renew(renew("dave", "s1", registered.generation, 30_000)).await.expect("the open Leases stream renews");
    leases.register(register("erin", "s1", "gw", 30_000)).await.expect("and registers");
    assert_eq!(leases.stats().streams_opened, 1, "the Leases stream was never reopened");
    leases.unregister(unregister("dave", "s1", registered.generation, 0)).await.unwrap();
    viewer.until_state("dave", pb::State::Offline).await;
    let ca = pki.ca_path();
    let changed = "presenced_tls_reloads_total{material=\"server\",result=\"changed\"}";
    let scraped = scrape_tls_until(&metrics, &ca, changed, |n| n >= 1.0).await;
    let left =
        crate::common::scrape::sample(&scraped, "presenced_tls_certificate_expiry_seconds{certificate=\"service\"}")
            .unwrap();
    assert!(left > 86_400.0 * 365.0, "the certificate's remaining lifetime, in seconds: {left}");

    // A rotation that leaves a broken file keeps the material in use, and says so.
    std::fs::write(&rotated.cert, "not a certificate").unwrap();
    let failed = "presenced_tls_reloads_total{material=\"server\",result=\"failed\"}";
    scrape_tls_until(&metrics, &ca, failed, |n| n >= 1.0).await;
    let still = handshake(daemon.addr(), &pki.ca_path(), None, &[b"h2"]).await.expect("still served");
    assert_eq!(presented(&still), new_certificate, "the last good certificate stays");
    drop(leases);
    daemon.stop().await;
}

#[tokio::test]
async fn t1_a_client_that_stalls_in_its_tls_handshake_is_closed_on_the_handshake_deadline() {
    use tokio::io::AsyncReadExt as _;
    let (pki, server) = server_pki("tls-stall");
    let daemon = start(&server, &["--handshake-timeout-ms", "300"]);
    let mut stalled = tokio::net::TcpStream::connect(daemon.addr()).await.unwrap();
    // The start of a ClientHello's record, and nothing more.
    stalled.write_all(&[0x16, 0x03, 0x01, 0x02, 0x00, 0x01]).await.unwrap();
    let started = std::time::Instant::now();
    let mut byte = [0; 1];
    let closed = within(PATIENCE, "the stalled handshake is closed", stalled.read(&mut byte)).await;
    assert!(matches!(closed, Ok(0) | Err(_)), "closed, not answered: {closed:?}");
    assert!(started.elapsed() < Duration::from_secs(3), "on the deadline: {:?}", started.elapsed());
    // Meanwhile, and after, others are served.
    let mut served = client(&daemon, &pki.ca_path(), None).await;
    served.snapshot(pb::SnapshotRequest::default()).await.expect("served");
    daemon.stop().await;
}

#[tokio::test]
async fn t1_plaintext_with_credentials_on_a_public_address_warns_and_names_the_flag_that_silences_it() {
    let dir = scratch_dir("tls-plaintext-warning");
    let warned = "serving plaintext on 0.0.0.0";
    for (extra, warns) in [(None, true), (Some("--allow-plaintext"), false)] {
        let stderr = dir.join(format!("stderr-{warns}"));
        let mut args = vec!["--service-token", SERVICE];
        args.extend(extra);
        let daemon = Daemon::start_on("0.0.0.0:0", &args, &[], Some(&stderr));
        let text = daemon.stderr_text();
        assert_eq!(text.contains(warned), warns, "{text}");
        if warns {
            assert!(text.contains("in the clear") && text.contains("--allow-plaintext"), "{text}");
        }
        daemon.stop().await;
    }
    let (_pki, server) = server_pki("tls-plaintext-warning-tls");
    let stderr = dir.join("stderr-tls");
    let flags = tls_flags(&server);
    let mut args: Vec<&str> = flags.iter().map(String::as_str).collect();
    args.extend(["--service-token", SERVICE]);
    let daemon = Daemon::start_on("0.0.0.0:0", &args, &[], Some(&stderr));
    assert!(!daemon.stderr_text().contains(warned), "no warning with TLS: {}", daemon.stderr_text());
    daemon.stop().await;
}

/// `presenced ARGS` (a client subcommand): its exit code, stdout and stderr.
fn cli(args: &[&str]) -> (Option<i32>, String, String) {
    let output = std::process::Command::new(crate::common::daemon::BINARY).args(args).output().unwrap();
    let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
    (output.status.code(), text(&output.stdout), text(&output.stderr))
}

#[tokio::test]
async fn t1_the_cli_reaches_a_tls_server_with_its_ca_and_client_certificate_and_says_why_it_cannot_without() {
    let (pki, server) = server_pki("tls-cli");
    let clients = Pki::new(&scratch_dir("tls-cli-clients"), "clients");
    let client_ca = clients.ca_path().display().to_string();
    let daemon = start(&server, &["--tls-client-ca", &client_ca, "--tls-service-identity", "cli.example"]);
    let operator = clients.issue("operator", &["cli.example"]);
    let (ca, cert, key) =
        (pki.ca_path().display().to_string(), operator.cert.display().to_string(), operator.key.display().to_string());
    let addr = https(&daemon);

    let (code, stdout, stderr) = cli(&["get", "alice", "--addr", &addr, "--ca", &ca, "--cert", &cert, "--key", &key]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(stdout.contains("alice") && stdout.contains("OFFLINE"), "{stdout}");

    let (code, _, stderr) = cli(&["get", "alice", "--addr", &addr, "--cert", &cert, "--key", &key]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("UnknownIssuer"), "without the server's CA: {stderr}");
    let (code, _, stderr) = cli(&["get", "alice", "--addr", &addr, "--ca", &ca]);
    assert_ne!(code, Some(0));
    assert!(stderr.contains("CertificateRequired"), "without a client certificate: {stderr}");
    let (code, _, stderr) = cli(&["get", "alice", "--addr", daemon.addr(), "--ca", &ca]);
    assert_eq!(code, Some(2), "a usage error: {stderr}");
    assert!(stderr.contains("need an https:// address"), "{stderr}");
    daemon.stop().await;
}

#[tokio::test]
async fn t4_sighup_reloads_the_certificate_at_once() {
    let dir = scratch_dir("tls-sighup");
    let pki = Pki::new(&dir, "server");
    let server = pki.issue("server", &["localhost", "127.0.0.1"]);
    // Polling once an hour: only the signal can make the reload seen here.
    let daemon = start(&server, &["--tls-reload-interval-ms", "3600000"]);
    let before = handshake(daemon.addr(), &pki.ca_path(), None, &[b"h2"]).await.unwrap();
    assert_eq!(presented(&before), first_certificate(&server.cert));
    let rotated = pki.issue("server", &["localhost", "127.0.0.1", "after-sighup.example"]);
    let new_certificate = first_certificate(&rotated.cert);
    let hup = std::process::Command::new("kill").args(["-HUP", &daemon.child.id().to_string()]).status().unwrap();
    assert!(hup.success());
    within(PATIENCE, "a new connection sees the certificate after SIGHUP", async {
        loop {
            let stream = handshake(daemon.addr(), &pki.ca_path(), None, &[b"h2"]).await.unwrap();
            if presented(&stream) == new_certificate {
                return;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    daemon.stop().await;
}
