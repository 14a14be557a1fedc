//! `presenced dev-certs DIR`: certificates an operator can serve with at
//! once, over TLS and mutual TLS, with the flags it prints; and its refusals.

use std::process::{Command, Output};

use crate::common::daemon::{BINARY, Daemon};

fn presenced(args: &[&str]) -> Output {
    Command::new(BINARY).args(args).env("RUST_LOG", "warn").output().expect("run presenced")
}

fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("presenced-dev-certs-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// The text after `flag ` on the printed line that starts with `command`.
fn printed_flag(printed: &str, command: &str, flag: &str) -> String {
    let line = printed.lines().find(|line| line.trim_start().starts_with(command) && line.contains(flag));
    let line = line.unwrap_or_else(|| panic!("no `{command} ... {flag}` line in:\n{printed}"));
    let after = line.split(&format!("{flag} ")).nth(1).expect("the flag's value");
    after.split_whitespace().next().expect("a value").to_owned()
}

/// T1: what dev-certs prints is enough to serve TLS and call it: the server
/// certificate covers 127.0.0.1 and localhost, a client with the printed CA
/// verifies it, and one without it cannot.
#[tokio::test]
async fn t1_the_printed_flags_serve_tls_that_a_client_with_the_printed_ca_reaches() {
    let dir = fresh_dir("tls");
    let made = presenced(&["dev-certs", dir.to_str().unwrap(), "--name", "presence.example.test"]);
    let printed = String::from_utf8(made.stdout).unwrap();
    assert_eq!(made.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&made.stderr));
    assert!(printed.contains("127.0.0.1, ::1, localhost, presence.example.test"), "{printed}");
    let cert = printed_flag(&printed, "presenced serve --tls-cert", "--tls-cert");
    let key = printed_flag(&printed, "presenced serve --tls-cert", "--tls-key");
    let ca = printed_flag(&printed, "presenced stats --addr https://127.0.0.1:50051 --ca", "--ca");

    let daemon = Daemon::start(&["--tls-cert", &cert, "--tls-key", &key], &[]);
    let port = daemon.addr().rsplit(':').next().unwrap().to_owned();
    for host in ["127.0.0.1", "localhost"] {
        let address = format!("https://{host}:{port}");
        let called = presenced(&["stats", "--addr", &address, "--ca", &ca]);
        assert_eq!(called.status.code(), Some(0), "{host}: {}", String::from_utf8_lossy(&called.stderr));
    }
    let unverified = presenced(&["stats", "--addr", &format!("https://127.0.0.1:{port}")]);
    assert_ne!(unverified.status.code(), Some(0), "the system's roots do not trust a development CA");
    let _ = std::fs::remove_dir_all(&dir);
}

/// T2: the printed mutual-TLS flags make the client certificate a service
/// caller without a token, on a server that refuses callers without one.
#[tokio::test]
async fn t2_the_printed_client_certificate_is_a_service_caller_under_mutual_tls() {
    let dir = fresh_dir("mtls");
    let made = presenced(&["dev-certs", dir.to_str().unwrap()]);
    assert_eq!(made.status.code(), Some(0), "stderr: {}", String::from_utf8_lossy(&made.stderr));
    let printed = String::from_utf8(made.stdout).unwrap();
    let serve = printed.lines().position(|line| line.contains("--tls-client-ca")).expect("the mutual TLS lines");
    let mutual: String = printed.lines().skip(serve - 1).take(3).collect::<Vec<_>>().join("\n");
    let flag = |name: &str| printed_flag(&mutual, "", name);
    let daemon = Daemon::start(
        &[
            "--tls-cert",
            &flag("--tls-cert"),
            "--tls-key",
            &flag("--tls-key"),
            "--tls-client-ca",
            &flag("--tls-client-ca"),
            "--tls-service-identity",
            &flag("--tls-service-identity"),
            "--service-token",
            "a-token-nobody-in-this-test-sends-0123456789",
        ],
        &[],
    );
    let address = format!("https://{}", daemon.addr());
    let (ca, cert, key) = (flag("--ca"), flag("--cert"), flag("--key"));
    let with_certificate = presenced(&["stats", "--addr", &address, "--ca", &ca, "--cert", &cert, "--key", &key]);
    assert_eq!(with_certificate.status.code(), Some(0), "{}", String::from_utf8_lossy(&with_certificate.stderr));
    let without = presenced(&["stats", "--addr", &address, "--ca", &ca]);
    assert_ne!(without.status.code(), Some(0), "no certificate, no token: refused");
    let _ = std::fs::remove_dir_all(&dir);
}

/// B7: a second run into the same directory replaces nothing (what trusts the
/// first CA would stop verifying), and a name that is neither an address nor
/// a DNS name is refused naming it; both exit 2 and write nothing.
#[test]
fn b7_dev_certs_refuses_to_replace_a_set_or_to_take_a_name_it_cannot_certify() {
    let dir = fresh_dir("refusals");
    assert_eq!(presenced(&["dev-certs", dir.to_str().unwrap()]).status.code(), Some(0));
    let ca = std::fs::read(dir.join("ca.pem")).unwrap();
    let again = presenced(&["dev-certs", dir.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&again.stderr);
    assert_eq!(again.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("ca.pem exists") && stderr.contains("empty directory"), "{stderr}");
    assert_eq!(std::fs::read(dir.join("ca.pem")).unwrap(), ca, "the first CA is kept");

    let other = fresh_dir("bad-name");
    let bad = presenced(&["dev-certs", other.to_str().unwrap(), "--name", "not a host"]);
    let stderr = String::from_utf8_lossy(&bad.stderr);
    assert_eq!(bad.status.code(), Some(2), "{stderr}");
    assert!(stderr.contains("--name \"not a host\""), "{stderr}");
    assert!(!other.join("ca.pem").exists(), "nothing is written");
    let _ = std::fs::remove_dir_all(&dir);
}

/// From nothing to a TLS server with mutual TLS and a scoped token in the
/// five commands docs/security.md lists ("Five commands"), run as written
/// there (a free port for 50051): a gateway's certificate is a service
/// caller, and the reader's token reads and may do nothing else.
#[tokio::test]
async fn t3_a_newcomer_serves_tls_with_mutual_tls_and_a_scoped_token_in_five_commands() {
    let dir = fresh_dir("five");
    let certs = dir.join("dev-certs");
    let file = |name: &str| certs.join(name).to_str().unwrap().to_owned();
    // 1. presenced dev-certs ./dev-certs
    assert_eq!(presenced(&["dev-certs", certs.to_str().unwrap()]).status.code(), Some(0));
    // 2. presenced token new reader --scope read --token-file reader.token >> credentials.toml
    let (credentials, token_file) = (dir.join("credentials.toml"), dir.join("reader.token"));
    let made = presenced(&["token", "new", "reader", "--scope", "read", "--token-file", token_file.to_str().unwrap()]);
    assert_eq!(made.status.code(), Some(0), "{}", String::from_utf8_lossy(&made.stderr));
    std::fs::write(&credentials, &made.stdout).unwrap();
    // 3. presenced serve --tls-cert ... --tls-key ... --tls-client-ca ... --tls-service-identity ... --credentials ...
    let daemon = Daemon::start(
        &[
            "--tls-cert",
            &file("server.pem"),
            "--tls-key",
            &file("server-key.pem"),
            "--tls-client-ca",
            &file("ca.pem"),
            "--tls-service-identity",
            "spiffe://presenced.dev/gateway",
            "--credentials",
            credentials.to_str().unwrap(),
        ],
        &[],
    );
    let address = format!("https://{}", daemon.addr());
    let tls =
        ["--addr", &address, "--ca", &file("ca.pem"), "--cert", &file("client.pem"), "--key", &file("client-key.pem")];
    // 4. presenced stats --addr https://127.0.0.1:50051 --ca ... --cert ... --key ...: a service by its certificate.
    let stats = presenced(&[&["stats"][..], &tls].concat());
    assert_eq!(stats.status.code(), Some(0), "{}", String::from_utf8_lossy(&stats.stderr));
    // 5. presenced get alice ... --token-file reader.token: the scoped token reads, and only reads.
    let reader = ["--token-file", token_file.to_str().unwrap()];
    let read = presenced(&[&["get", "alice"][..], &tls, &reader].concat());
    assert_eq!(read.status.code(), Some(0), "{}", String::from_utf8_lossy(&read.stderr));
    assert!(String::from_utf8_lossy(&read.stdout).contains("alice"), "{read:?}");
    let beyond = presenced(&[&["stats"][..], &tls, &reader].concat());
    assert_eq!(beyond.status.code(), Some(4), "the reader may not administer");
    assert!(String::from_utf8_lossy(&beyond.stderr).contains("needs the `admin` scope"), "{beyond:?}");
    daemon.stop().await;
    let _ = std::fs::remove_dir_all(&dir);
}
