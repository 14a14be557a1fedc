//! O4, P7 and F1, the operator's command line: `presenced get`, `watch`, `changes`, `register`,
//! `sessions`, `revoke`, `room`, `stats`, `export` and `erase` run as a user runs them, against a real
//! `presenced serve`, readable and with `--json`, and the exit status each
//! outcome gives a script.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;

use crate::common::auth::{SECRET, SERVICE, viewer_token};
use crate::common::daemon::{BINARY, Daemon, free_port, scratch_dir};
use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use serde_json::Value;
use tonic::transport::Channel;

/// What one run of the command line left: its exit status, stdout and stderr.
struct Ran {
    code: Option<i32>,
    stdout: String,
    stderr: String,
}

impl Ran {
    fn json(&self) -> Value {
        serde_json::from_str(&self.stdout)
            .unwrap_or_else(|err| panic!("not one JSON document ({err}): {:?}", self.stdout))
    }

    /// The words of each stdout line.
    fn rows(&self) -> Vec<Vec<&str>> {
        self.stdout.lines().map(|line| line.split_whitespace().collect()).collect()
    }
}

/// `presenced ARGS...` with only `env` of the client's environment set.
fn presenced(args: &[&str], env: &[(&str, &str)]) -> Ran {
    let Output { status, stdout, stderr } = Command::new(BINARY)
        .args(args)
        .env_remove("PRESENCED_ADDR")
        .env_remove("PRESENCED_TOKEN")
        .env_remove("PRESENCED_TOKEN_FILE")
        .envs(env.iter().copied())
        .output()
        .expect("run presenced");
    let ran = Ran {
        code: status.code(),
        stdout: String::from_utf8(stdout).unwrap(),
        stderr: String::from_utf8(stderr).unwrap(),
    };
    eprintln!("presenced {args:?}: {:?}\n{}{}", ran.code, ran.stdout, ran.stderr);
    ran
}

/// `presenced ARGS... --addr ADDR` against `daemon`.
fn against(daemon: &Daemon, args: &[&str]) -> Ran {
    presenced(&[args, &["--addr", daemon.addr()]].concat(), &[])
}

async fn client(daemon: &Daemon) -> PresenceClient<Channel> {
    PresenceClient::connect(daemon.url()).await.expect("connect to presenced")
}

fn join(user: &str, session: &str, generation: u64, room: &str) -> pb::JoinRequest {
    pb::JoinRequest {
        user_id: user.into(),
        session_id: session.into(),
        generation,
        room_id: room.into(),
        metadata: [("cursor".to_string(), "p3".to_string())].into(),
    }
}

#[tokio::test]
async fn o4_get_prints_each_users_presence_readable_and_as_json() {
    let daemon = Daemon::start(&[], &[]);
    // u1's gateway says its human is at the keyboard (A2).
    let mut request = register("u1", "phone", "gw-a", 60_000);
    request.attention = Some(pb::Attention::Active as i32);
    let registered = client(&daemon).await.register(request).await.unwrap();
    let version = registered.into_inner().presence.unwrap().version.to_string();

    let ran = against(&daemon, &["get", "u1", "u2"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(
        ran.rows(),
        [
            vec!["USER", "STATE", "AVAILABILITY", "VERSION", "STATUS", "LAST", "ACTIVE"],
            vec!["u1", "ONLINE", "active", version.as_str(), "-", "-"],
            vec!["u2", "OFFLINE", "-", "0", "-", "-"],
        ]
    );
    let lines: Vec<&str> = ran.stdout.lines().collect();
    let column = |line: &str, word: &str| line.find(word).unwrap();
    assert_eq!(column(lines[1], "ONLINE"), column(lines[0], "STATE"), "aligned columns");
    assert_eq!(column(lines[2], "OFFLINE"), column(lines[0], "STATE"));

    // The address from the environment, with its scheme; the proto's field names.
    let ran = presenced(&["get", "u1", "u2", "--json"], &[("PRESENCED_ADDR", &daemon.url())]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let users = &ran.json()["users"];
    assert_eq!(
        (&users[0]["user_id"], &users[0]["state"], &users[0]["version"]),
        (&"u1".into(), &"STATE_ONLINE".into(), &Value::from(version))
    );
    assert_eq!((&users[1]["state"], &users[1]["version"]), (&"STATE_OFFLINE".into(), &"0".into()));
    assert_eq!(
        (&users[0]["availability"], &users[1]["availability"]),
        (&"AVAILABILITY_ACTIVE".into(), &"AVAILABILITY_UNSPECIFIED".into())
    );
}

#[tokio::test]
async fn o4_sessions_lists_a_users_sessions_with_their_rooms() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let mut request = register("u1", "phone", "gw-a", 60_000);
    request.metadata.insert("device".into(), "ios".into());
    let generation = client.register(request).await.unwrap().into_inner().generation;
    client.join(join("u1", "phone", generation, "doc-7")).await.unwrap();

    let ran = against(&daemon, &["sessions", "u1"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = ran.rows();
    assert_eq!(rows[0], ["SESSION", "GATEWAY", "GENERATION", "EXPIRES", "RENEWED", "ROOMS", "METADATA"]);
    assert_eq!(rows.len(), 2, "one session");
    assert_eq!(rows[1][..3], ["phone", "gw-a", &generation.to_string()]);
    assert_eq!(rows[1][3], "in", "the deadline is ahead: {:?}", rows[1]);
    assert_eq!(rows[1][rows[1].len() - 2..], ["doc-7", "device=ios"]);

    let ran = against(&daemon, &["sessions", "u1", "--json"]);
    let listed = ran.json();
    let session = &listed["sessions"][0];
    assert_eq!((&session["session_id"], &session["gateway_id"]), (&"phone".into(), &"gw-a".into()));
    assert_eq!(session["generation"], generation.to_string());
    assert_eq!(session["rooms"], serde_json::json!(["doc-7"]));
    assert_eq!(session["metadata"]["device"], "ios");
    let ms = |value: &Value| value.as_str().unwrap().parse::<i64>().unwrap();
    assert!(ms(&session["expires_at_ms"]) > ms(&listed["now_ms"]));

    let ran = against(&daemon, &["sessions", "nobody"]);
    assert_eq!((ran.code, ran.stdout.as_str()), (Some(0), "nobody has no sessions\n"));
}

#[tokio::test]
async fn o4_revoke_takes_a_user_offline_and_exits_1_when_nothing_is_left_to_revoke() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    for session in ["phone", "laptop"] {
        client.register(register("u1", session, "gw-a", 60_000)).await.unwrap();
    }
    let ran = against(&daemon, &["revoke", "u1", "phone"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(ran.stdout.starts_with("revoked 1 session of u1; it is ONLINE"), "{:?}", ran.stdout);
    let ran = against(&daemon, &["revoke", "u1", "phone"]);
    assert_eq!(ran.code, Some(1), "the session is gone");
    assert!(ran.stderr.contains("u1 has no session \"phone\" to revoke"), "{:?}", ran.stderr);

    let ran = against(&daemon, &["revoke", "u1", "--json"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let revoked = ran.json();
    assert_eq!((&revoked["revoked"], &revoked["changed"]), (&1.into(), &true.into()));
    assert_eq!(revoked["presence"]["state"], "STATE_OFFLINE");
    assert_eq!(state_of(&snapshot(&mut client, &["u1"]).await[0]), pb::State::Offline);
    assert_eq!(against(&daemon, &["revoke", "u1"]).code, Some(1), "no session left");
}

#[tokio::test]
async fn o4_room_prints_its_members_counts_and_signals() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let generation = client.register(register("u1", "phone", "gw-a", 60_000)).await.unwrap().into_inner().generation;
    let version = client.join(join("u1", "phone", generation, "doc-7")).await.unwrap().into_inner().room_version;
    let signal = pb::SignalRequest {
        user_id: "u1".into(),
        session_id: "phone".into(),
        generation,
        room_id: "doc-7".into(),
        kind: "typing".into(),
        ttl_ms: 10_000,
    };
    let version = client.signal(signal).await.unwrap().into_inner().room_version.max(version);

    let ran = against(&daemon, &["room", "doc-7"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let lines: Vec<&str> = ran.stdout.lines().collect();
    assert_eq!(lines[0], format!("room doc-7: 1 users, 1 sessions, version {version}"));
    assert_eq!(
        ran.rows()[1..],
        [vec!["USER", "SESSIONS", "METADATA"], vec!["u1", "1", "cursor=p3"], vec!["typing:", "u1", "(1)"]]
    );

    let room = against(&daemon, &["room", "doc-7", "--json"]).json();
    assert_eq!(
        (&room["room_id"], &room["users"], &room["version"]),
        (&"doc-7".into(), &1.into(), &version.to_string().into())
    );
    assert_eq!(room["members"][0]["metadata"]["cursor"], "p3");
    assert_eq!(
        (&room["signals"][0]["kind"], &room["signals"][0]["user_ids"]),
        (&"typing".into(), &serde_json::json!(["u1"]))
    );

    let ran = against(&daemon, &["room", "never-used"]);
    assert_eq!((ran.code, ran.stdout.as_str()), (Some(0), "room never-used: 0 users, 0 sessions, version 0\n"));
}

#[tokio::test]
async fn o4_stats_prints_the_services_figures() {
    let daemon = Daemon::start(&["--default-ttl-ms", "30000"], &[]);
    let mut client = client(&daemon).await;
    let generation = client.register(register("u1", "phone", "gw-a", 60_000)).await.unwrap().into_inner().generation;
    client.renew(renew("u1", "phone", generation, 60_000)).await.unwrap();

    let ran = against(&daemon, &["stats"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let rows = ran.rows();
    let row = |name: &str| rows.iter().find(|row| row[0] == name).unwrap_or_else(|| panic!("no {name} line")).clone();
    assert_eq!(row("presenced")[1], format!("{},", env!("CARGO_PKG_VERSION")));
    assert_eq!(row("sessions"), ["sessions", "1"]);
    assert_eq!(row("renewals"), ["renewals", "1", "(0", "shed)"]);
    assert_eq!(row("heartbeat")[1], "10000", "a third of the default TTL");

    let stats = against(&daemon, &["stats", "--json"]).json();
    assert_eq!(
        (&stats["sessions"], &stats["online_users"], &stats["registers_total"]),
        (&"1".into(), &"1".into(), &"1".into())
    );
    assert_eq!(
        (&stats["ttl"]["default_ttl_ms"], &stats["ttl"]["suggested_heartbeat_ms"]),
        (&30_000.into(), &10_000.into())
    );
    let lag = &stats["expiry_lag"];
    assert_eq!(lag["bounds_seconds"].as_array().unwrap().len() + 1, lag["counts"].as_array().unwrap().len());
}

/// A client command running in the background, its stdout and stderr read line by line.
struct Running {
    child: Child,
    lines: mpsc::Receiver<String>,
    said: mpsc::Receiver<String>,
}

/// Each line `from` gives, sent on the returned channel as it comes.
fn lines_of(from: impl std::io::Read + Send + 'static) -> mpsc::Receiver<String> {
    let (sender, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(from).lines().map_while(Result::ok) {
            if sender.send(line).is_err() {
                return;
            }
        }
    });
    lines
}

impl Running {
    fn start(daemon: &Daemon, args: &[&str]) -> Running {
        let mut child = Command::new(BINARY)
            .args(args)
            .args(["--addr", daemon.addr()])
            .env_remove("PRESENCED_ADDR")
            .env_remove("PRESENCED_TOKEN")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn presenced");
        let lines = lines_of(child.stdout.take().unwrap());
        let said = lines_of(child.stderr.take().unwrap());
        Running { child, lines, said }
    }

    /// The next line on stderr, within the patience.
    fn said_line(&self) -> String {
        let line = self.said.recv_timeout(PATIENCE).expect("a line on stderr within the patience");
        eprintln!("said: {line}");
        line
    }

    /// The next line, within the patience.
    fn line(&self) -> String {
        let line = self.lines.recv_timeout(PATIENCE).expect("a line within the patience");
        eprintln!("watch: {line}");
        line
    }

    /// Ctrl-C, and the exit status it leads to.
    async fn interrupt(mut self) -> Option<i32> {
        let sent = Command::new("kill").args(["-INT", &self.child.id().to_string()]).status().unwrap();
        assert!(sent.success());
        let deadline = std::time::Instant::now() + PATIENCE;
        loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            assert!(std::time::Instant::now() < deadline, "watch did not stop on SIGINT");
            tokio::time::sleep(std::time::Duration::from_millis(10)).await;
        }
    }
}

impl Drop for Running {
    /// A test that fails before interrupting must not leave the watch
    /// running: it would hold the test's output open for ever.
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn o4_watch_prints_each_change_then_stops_on_interrupt() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let watch = Running::start(&daemon, &["watch", "u1"]);
    let first = watch.line();
    assert!(first.ends_with("u1  OFFLINE  version 0"), "the opening state: {first:?}");
    let registered = client.register(register("u1", "phone", "gw-a", 60_000)).await.unwrap().into_inner();
    let online = watch.line();
    let version = registered.presence.unwrap().version;
    assert!(online.ends_with(&format!("u1  ONLINE   version {version}")), "the change: {online:?}");
    client.revoke(pb::RevokeRequest { user_id: "u1".into(), session_id: String::new() }).await.unwrap();
    assert!(watch.line().contains("u1  OFFLINE  version "));
    assert_eq!(watch.interrupt().await, Some(0), "an interrupted watch exits 0");

    // A room: its header, then one line per member change.
    let room = Running::start(&daemon, &["watch", "--room", "doc-7"]);
    assert!(room.line().ends_with("ROOM     doc-7: 0 users, 0 sessions, version 0"));
    let generation = client.register(register("u2", "tab", "gw-a", 60_000)).await.unwrap().into_inner().generation;
    client.join(join("u2", "tab", generation, "doc-7")).await.unwrap();
    assert!(room.line().ends_with("JOINED   u2  sessions 1  cursor=p3"));
    client.unregister(unregister("u2", "tab", generation, 0)).await.unwrap();
    assert!(room.line().contains("LEFT     u2  sessions 0"));
    assert_eq!(room.interrupt().await, Some(0));
}

#[tokio::test]
async fn o4_watch_json_is_one_object_per_line() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let watch = Running::start(&daemon, &["watch", "u1", "u2", "--json"]);
    let parse = |line: String| serde_json::from_str::<Value>(&line).unwrap();
    let opening = parse(watch.line());
    let users = opening["snapshot"]["users"].as_array().expect("an opening snapshot");
    assert_eq!(users.iter().map(|user| user["user_id"].as_str().unwrap()).collect::<Vec<_>>(), ["u1", "u2"]);
    let registered = client.register(register("u2", "phone", "gw-a", 60_000)).await.unwrap().into_inner();
    let update = parse(watch.line());
    assert_eq!((&update["update"]["user_id"], &update["update"]["state"]), (&"u2".into(), &"STATE_ONLINE".into()));
    assert_eq!(update["update"]["version"], registered.presence.unwrap().version.to_string());
    assert_eq!(watch.interrupt().await, Some(0));

    let room = Running::start(&daemon, &["watch", "--room", "doc-7", "--json"]);
    assert_eq!(parse(room.line())["snapshot"]["users"], 0);
    client.join(join("u2", "phone", registered.generation, "doc-7")).await.unwrap();
    let change = parse(room.line());
    assert_eq!(
        (&change["change"]["kind"], &change["change"]["member"]["user_id"]),
        (&"ROOM_CHANGE_JOINED".into(), &"u2".into())
    );
    assert_eq!(room.interrupt().await, Some(0));
}

/// The words of a `changes` line after its date and time: kind, id, state, "version", version, "cursor", cursor.
fn change_words(line: &str) -> Vec<String> {
    line.split_whitespace().skip(2).map(str::to_owned).collect()
}

#[tokio::test]
async fn f1_changes_prints_each_change_with_its_cursor_and_resumes_from_its_cursor_file() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let dir = scratch_dir("changes-cli");
    let cursor_file = dir.join("cursor");
    let file = cursor_file.to_str().unwrap();
    let saved = |cursor: &str| {
        let deadline = std::time::Instant::now() + PATIENCE;
        while std::fs::read_to_string(&cursor_file).ok().as_deref().map(str::trim) != Some(cursor) {
            assert!(std::time::Instant::now() < deadline, "{cursor} never saved to {}", cursor_file.display());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    };

    // The first run starts at the oldest change retained: it misses nothing made as it starts.
    let feed = Running::start(&daemon, &["changes", "--from", "oldest", "--cursor-file", file]);
    assert_eq!(
        feed.said_line(),
        format!(
            "presenced changes: connected to http://{}; from the oldest change the feed retains; \
             saving each batch's cursor in {file}",
            daemon.addr()
        ),
        "where it starts, once connected"
    );
    let registered = client.register(register("u1", "phone", "gw-a", 60_000)).await.unwrap().into_inner();
    let online = change_words(&feed.line());
    let version = registered.presence.unwrap().version.to_string();
    assert_eq!(online[..5], ["FLIP", "u1", "ONLINE", "version", version.as_str()], "{online:?}");
    assert_eq!(online[5], "cursor");
    client.revoke(pb::RevokeRequest { user_id: "u1".into(), session_id: String::new() }).await.unwrap();
    let offline = change_words(&feed.line());
    assert_eq!(offline[..3], ["FLIP", "u1", "OFFLINE"]);
    assert!(offline[6] > online[6], "cursors grow: {offline:?} after {online:?}");
    saved(&offline[6]);
    assert_eq!(feed.interrupt().await, Some(0), "an interrupted feed exits 0");

    // Away, a change; the next run resumes after the saved cursor (its --from
    // is for a first run): that change, and nothing printed before.
    client.register(register("u2", "tab", "gw-a", 60_000)).await.unwrap();
    let feed = Running::start(&daemon, &["changes", "--from", "oldest", "--cursor-file", file, "--kind", "flip"]);
    let said = feed.said_line();
    let resuming =
        format!("resuming after cursor {} from {file}; the file's cursor comes before --from oldest", offline[6]);
    assert!(said.ends_with(&resuming), "the cursor file wins, and it says so: {said}");
    let resumed = change_words(&feed.line());
    assert_eq!(resumed[..3], ["FLIP", "u2", "ONLINE"], "resumed after the saved cursor: {resumed:?}");
    saved(&resumed[6]);
    assert_eq!(feed.interrupt().await, Some(0));

    // --from a printed cursor, as JSON lines: what came after it.
    let feed = Running::start(&daemon, &["changes", "--from", &online[6], "--json"]);
    assert!(feed.said_line().ends_with(&format!("; after cursor {}", online[6])));
    let line: Value = serde_json::from_str(&feed.line()).unwrap();
    assert_eq!(
        (&line["change"]["flip"]["user_id"], &line["change"]["flip"]["state"]),
        (&"u1".into(), &"STATE_OFFLINE".into())
    );
    assert_eq!(line["cursor_hex"], offline[6].as_str(), "the cursor as --from takes it");
    assert_eq!(feed.interrupt().await, Some(0));
    // --quiet: the changes, and nothing on stderr.
    let feed = Running::start(&daemon, &["changes", "--from", &online[6], "--quiet"]);
    assert_eq!(change_words(&feed.line())[..3], ["FLIP", "u1", "OFFLINE"]);
    let said = feed.said.recv_timeout(std::time::Duration::from_millis(200));
    assert!(said.is_err(), "--quiet says nothing: {said:?}");
    assert_eq!(feed.interrupt().await, Some(0));

    // Bad input names the flag; a cursor the feed does not hold gives the oldest one.
    let ran = against(&daemon, &["changes", "--from", "yesterday"]);
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(ran.stderr.contains("--from") && ran.stderr.contains("not a cursor"), "{:?}", ran.stderr);
    assert_eq!(against(&daemon, &["changes", "--kind", "renewal"]).code, Some(2));
    std::fs::write(&cursor_file, "torn\n").unwrap();
    let ran = against(&daemon, &["changes", "--cursor-file", file]);
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    assert!(ran.stderr.contains("--cursor-file") && ran.stderr.contains(file), "{:?}", ran.stderr);
    let nowhere = dir.join("missing").join("cursor");
    let ran = against(&daemon, &["changes", "--cursor-file", nowhere.to_str().unwrap()]);
    assert_eq!(ran.code, Some(2), "{}", ran.stderr);
    let missing =
        format!("--cursor-file {}: its directory {} does not exist", nowhere.display(), dir.join("missing").display());
    assert!(ran.stderr.contains(&missing), "{:?}", ran.stderr);
    let ran = against(&daemon, &["changes", "--slot", "1024"]);
    assert_eq!(ran.code, Some(5), "{}", ran.stderr);
    assert!(ran.stderr.contains("slots: slot 1024"), "{:?}", ran.stderr);
    let ahead = format!("01{}", "7f".repeat(12));
    let ran = against(&daemon, &["changes", "--from", &ahead]);
    assert_eq!(ran.code, Some(5), "{}", ran.stderr);
    assert!(ran.stderr.contains("OutOfRange") && ran.stderr.contains("the oldest cursor is 01"), "{:?}", ran.stderr);
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn o4_exit_status_tells_unknown_unreachable_denied_invalid_and_usage_apart() {
    let nowhere = format!("127.0.0.1:{}", free_port());
    let ran = presenced(&["get", "u1", "--addr", &nowhere], &[]);
    assert_eq!(ran.code, Some(3), "nothing listens there");
    assert!(ran.stderr.contains(&format!("cannot reach presenced at http://{nowhere}")), "{:?}", ran.stderr);

    let daemon = Daemon::start(&["--service-token", SERVICE, "--viewer-jwt-hs256-secret", SECRET], &[]);
    assert_eq!(against(&daemon, &["get", "u1"]).code, Some(4), "no token");
    assert_eq!(against(&daemon, &["get", "u1", "--token", "wrong"]).code, Some(4), "a bad token");
    let viewer = viewer_token("v1", false);
    assert_eq!(
        against(&daemon, &["stats", "--token", &viewer]).code,
        Some(4),
        "a viewer's token for a service-only command"
    );
    assert_eq!(against(&daemon, &["get", "u1", "--token", SERVICE]).code, Some(0));
    let from_env = presenced(&["get", "u1"], &[("PRESENCED_ADDR", daemon.addr()), ("PRESENCED_TOKEN", SERVICE)]);
    assert_eq!(from_env.code, Some(0), "the address and the token from the environment");

    let token = ["--token", SERVICE];
    let ran = against(&daemon, &[&["get", ""][..], &token].concat());
    assert_eq!(ran.code, Some(5), "an empty user id");
    assert!(ran.stderr.contains("user_ids: entry 0 must not be empty"), "{:?}", ran.stderr);
    assert_eq!(against(&daemon, &[&["sessions", ""][..], &token].concat()).code, Some(5));
    assert_eq!(against(&daemon, &[&["revoke", "nobody"][..], &token].concat()).code, Some(1), "nothing to revoke");
    assert_eq!(
        against(&daemon, &[&["watch", "--room", "doc-7"][..], &["--token", viewer.as_str()]].concat()).code,
        Some(1),
        "a room the viewer may not read"
    );

    for usage in [&["get"][..], &["watch"], &["revoke"], &["sessions", "u1", "extra"], &["watch", "u1", "--count"]] {
        assert_eq!(against(&daemon, usage).code, Some(2), "{usage:?}");
    }
    assert_eq!(presenced(&["get", "u1", "--addr", "http://not a uri"], &[]).code, Some(2));
    let help = presenced(&["get", "--help"], &[]);
    assert!(help.stdout.contains("4  unauthenticated or permission denied"), "the exit statuses are in --help");
}

#[tokio::test]
async fn o4_a_token_file_a_missing_token_and_a_tls_port_dialled_in_plaintext_each_say_what_to_do() {
    let dir = scratch_dir("cli-tokens");
    let nowhere = format!("127.0.0.1:{}", free_port());
    let ran = presenced(&["get", "u1", "--addr", &nowhere], &[]);
    assert_eq!(ran.code, Some(3), "nothing listens there");
    assert!(ran.stderr.contains("is `presenced serve` running there?"), "how to check the server: {:?}", ran.stderr);

    // No token: the refusal names the ways to give one.
    let daemon = Daemon::start(&["--service-token", SERVICE], &[]);
    let ran = against(&daemon, &["get", "u1"]);
    assert_eq!(ran.code, Some(4), "{:?}", ran.stderr);
    assert!(ran.stderr.contains("give a token with --token, --token-file or PRESENCED_TOKEN"), "{:?}", ran.stderr);

    // --token-file (or PRESENCED_TOKEN_FILE): the token stays out of `ps`.
    let token_file = dir.join("service.token");
    std::fs::write(&token_file, format!("{SERVICE}\n")).unwrap();
    let file = token_file.to_str().unwrap();
    assert_eq!(against(&daemon, &["get", "u1", "--token-file", file]).code, Some(0));
    let from_env = presenced(&["get", "u1", "--addr", daemon.addr()], &[("PRESENCED_TOKEN_FILE", file)]);
    assert_eq!(from_env.code, Some(0), "{:?}", from_env.stderr);
    let both = against(&daemon, &["get", "u1", "--token-file", file, "--token", SERVICE]);
    assert_eq!(both.code, Some(2));
    assert!(both.stderr.contains("--token-file: give the token one way"), "{:?}", both.stderr);
    let missing = dir.join("none.token");
    let ran = against(&daemon, &["get", "u1", "--token-file", missing.to_str().unwrap()]);
    assert_eq!(ran.code, Some(2));
    assert!(ran.stderr.contains(&format!("--token-file {}: cannot read", missing.display())), "{:?}", ran.stderr);
    std::fs::write(dir.join("empty.token"), "\n").unwrap();
    let ran = against(&daemon, &["get", "u1", "--token-file", dir.join("empty.token").to_str().unwrap()]);
    assert_eq!((ran.code, ran.stderr.contains("is empty; its first line is the token")), (Some(2), true));
    // Every client command that presents a token takes it (`cluster status` reads etcd alone).
    for command in [
        &["get"][..],
        &["watch"],
        &["changes"],
        &["sessions"],
        &["revoke"],
        &["room"],
        &["stats"],
        &["export"],
        &["erase"],
        &["backup"],
        &["register"],
        &["cluster", "backup"],
        &["cluster", "move"],
    ] {
        let help = presenced(&[command, &["--help"]].concat(), &[]);
        assert!(help.stdout.contains("--token-file <FILE>"), "{command:?} takes --token-file: {}", help.stdout);
    }
    daemon.stop().await;

    // A plaintext client on a TLS port cannot reach it, and is told why.
    let certs = dir.join("certs");
    assert_eq!(presenced(&["dev-certs", certs.to_str().unwrap()], &[]).code, Some(0));
    let (cert, key) = (certs.join("server.pem"), certs.join("server-key.pem"));
    let tls = Daemon::start(&["--tls-cert", cert.to_str().unwrap(), "--tls-key", key.to_str().unwrap()], &[]);
    let ran = against(&tls, &["get", "u1"]);
    assert_eq!(ran.code, Some(3), "{:?}", ran.stderr);
    assert!(ran.stderr.contains("this port speaks TLS: use an https:// --addr and --ca"), "{:?}", ran.stderr);
    let https = format!("https://{}", tls.addr());
    let ca = certs.join("ca.pem");
    let ran = presenced(&["get", "u1", "--addr", &https, "--ca", ca.to_str().unwrap()], &[]);
    assert_eq!(ran.code, Some(0), "over TLS with the CA: {:?}", ran.stderr);
    // A certificate the client refuses is said in words, with the TLS library's own after.
    let ran = presenced(
        &["get", "u1", "--addr", &https, "--ca", ca.to_str().unwrap(), "--server-name", "elsewhere.test"],
        &[],
    );
    assert_eq!(ran.code, Some(3), "{:?}", ran.stderr);
    assert!(ran.stderr.contains("the server's certificate does not cover the host dialled"), "{:?}", ran.stderr);
    let other = dir.join("other-certs");
    assert_eq!(presenced(&["dev-certs", other.to_str().unwrap()], &[]).code, Some(0));
    let ran = presenced(&["get", "u1", "--addr", &https, "--ca", other.join("ca.pem").to_str().unwrap()], &[]);
    assert_eq!(ran.code, Some(3), "{:?}", ran.stderr);
    assert!(ran.stderr.contains("the server's certificate is not from the CA given with --ca"), "{:?}", ran.stderr);
    tls.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn o4_register_plays_a_gateway_renewing_until_interrupted_then_unregisters() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let args = ["register", "u1", "laptop", "--room", "doc-7", "--meta", "device=cli", "--ttl-ms", "1000"];
    let session = Running::start(&daemon, &[&args[..], &["--heartbeat-ms", "200"]].concat());
    let registered = session.line();
    assert!(registered.contains("REGISTERED    u1/laptop  generation "), "{registered:?}");
    let joined = session.line();
    assert!(joined.contains("JOINED        u1/laptop  room doc-7, version "), "{joined:?}");

    // Past its 1 s TTL the session is still there: it renews.
    tokio::time::sleep(std::time::Duration::from_millis(1_500)).await;
    let request = pb::SnapshotRequest { user_ids: vec!["u1".into()], ..Default::default() };
    let presence = client.snapshot(request.clone()).await.unwrap().into_inner().users.remove(0);
    assert_eq!(presence.state, pb::State::Online as i32, "{presence:?}");
    let request_sessions = pb::ListSessionsRequest { user_id: "u1".into() };
    let sessions = client.list_sessions(request_sessions).await.unwrap().into_inner().sessions;
    let listed: Vec<_> =
        sessions.iter().map(|s| (s.session_id.as_str(), s.gateway_id.as_str(), s.rooms.clone())).collect();
    assert_eq!(listed, [("laptop", "presenced-cli", vec!["doc-7".to_owned()])]);
    assert_eq!(sessions[0].metadata.get("device").map(String::as_str), Some("cli"));

    // The server loses the lease: the next renewal meets NOT_FOUND and the
    // session registers again, saying so.
    client.revoke(pb::RevokeRequest { user_id: "u1".into(), session_id: "laptop".into() }).await.unwrap();
    let again = session.line();
    assert!(again.contains("REREGISTERED  u1/laptop  the server had lost the lease"), "{again:?}");

    // Ctrl-C unregisters: the user goes OFFLINE at once, and it exits 0.
    assert_eq!(session.interrupt().await, Some(0));
    let presence = client.snapshot(request).await.unwrap().into_inner().users.remove(0);
    assert_eq!(presence.state, pb::State::Offline as i32, "unregistered on exit: {presence:?}");

    // With --json, one object per step.
    let session = Running::start(&daemon, &["register", "u2", "tab", "--json"]);
    let first: Value = serde_json::from_str(&session.line()).unwrap();
    assert_eq!((&first["registered"]["user_id"], &first["registered"]["session_id"]), (&"u2".into(), &"tab".into()));
    assert!(first["registered"]["generation"].as_str().is_some_and(|generation| generation.parse::<u64>().is_ok()));
    assert_eq!(session.interrupt().await, Some(0));

    // Its heartbeat is a third of the TTL: of the server's default (45 s), or of --ttl-ms.
    for (extra, every) in [(&[][..], "renewing every 15000 ms"), (&["--ttl-ms", "3000"], "renewing every 1000 ms")] {
        let session = Running::start(&daemon, &[&["register", "u3", "tab"][..], extra].concat());
        let registered = session.line();
        assert!(registered.ends_with(every), "{extra:?}: {registered:?}");
        assert_eq!(session.interrupt().await, Some(0));
    }

    // A refused register says why, and exits as the table says.
    let ran = against(&daemon, &["register", "", "s"]);
    assert_eq!(ran.code, Some(5), "an empty user id");
    assert!(ran.stderr.contains("user_id"), "names the field: {:?}", ran.stderr);
    assert_eq!(against(&daemon, &["register", "u1", "s", "--meta", "novalue"]).code, Some(2));
    assert_eq!(against(&daemon, &["register", "u1", "s", "--heartbeat-ms", "0"]).code, Some(2));
}

#[tokio::test]
async fn p7_export_prints_the_users_data_as_json_and_erase_prints_what_it_removed() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = client(&daemon).await;
    let mut request = register("u1", "phone", "gw-a", 60_000);
    request.metadata.insert("device".into(), "ios".into());
    let generation = client.register(request).await.unwrap().into_inner().generation;
    client.join(join("u1", "phone", generation, "doc-7")).await.unwrap();
    let setting = pb::PutSettingRequest { user_id: "u1".into(), name: "locale".into(), value: b"fr".to_vec() };
    client.put_setting(setting).await.unwrap();
    client.grant_audience(pb::AudienceRequest { user_id: "u1".into(), viewer_ids: vec!["u2".into()] }).await.unwrap();
    client.join_group(pb::GroupRequest { group_id: "team".into(), user_ids: vec!["u1".into()] }).await.unwrap();

    // Pretty JSON, the proto's field names, bytes in base64.
    let ran = against(&daemon, &["export", "u1"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert!(ran.stdout.lines().count() > 20, "indented, one field a line: {:?}", ran.stdout);
    let exported = ran.json();
    assert_eq!((&exported["user_id"], &exported["held"]), (&"u1".into(), &true.into()));
    assert_eq!(exported["presence"]["state"], "STATE_ONLINE");
    assert_eq!(exported["sessions"][0]["session_id"], "phone");
    assert_eq!(exported["sessions"][0]["metadata"]["device"], "ios");
    assert_eq!(exported["sessions"][0]["generation"], generation.to_string());
    assert_eq!(exported["rooms"][0]["room_id"], "doc-7");
    assert_eq!(exported["rooms"][0]["metadata"]["cursor"], "p3");
    assert_eq!(exported["audience"], serde_json::json!(["u2"]));
    assert_eq!(exported["groups"], serde_json::json!(["team"]));
    assert_eq!(exported["settings"], serde_json::json!({ "locale": "ZnI=" }));
    assert_eq!(against(&daemon, &["export", "u2"]).json()["in_audience_of"], serde_json::json!(["u1"]));

    // Erase: one line, then what was removed, each kind a row.
    let ran = against(&daemon, &["erase", "u1"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    assert_eq!(ran.stdout.lines().next(), Some("erased u1: it now reads as a user never seen"));
    let row = |name: &str| {
        let line = ran.stdout.lines().find(|line| line.starts_with(name)).unwrap_or_else(|| panic!("{name}"));
        line.split_whitespace().last().unwrap().to_owned()
    };
    assert_eq!(row("sessions revoked"), "1");
    assert_eq!(row("rooms left"), "1");
    assert_eq!(row("went offline"), "yes");
    assert_eq!(row("audience"), "1");
    assert_eq!(row("groups left"), "1");
    assert_eq!(row("settings"), "1");
    assert_eq!(row("presence record"), "yes");
    let exported = against(&daemon, &["export", "u1"]).json();
    assert_eq!((&exported["held"], &exported["sessions"]), (&false.into(), &serde_json::json!([])));

    // Again, with --json: nothing left to remove, and it still succeeds.
    let ran = against(&daemon, &["erase", "u1", "--json"]);
    assert_eq!(ran.code, Some(0), "{}", ran.stderr);
    let erased = ran.json();
    assert_eq!((&erased["sessions_revoked"], &erased["presence_forgotten"]), (&0.into(), &false.into()));
    let ran = against(&daemon, &["erase", ""]);
    assert_eq!(ran.code, Some(5), "an empty user id");
    assert!(ran.stderr.contains("user_id"), "names the field: {:?}", ran.stderr);
}
