//! The history checker's short form: the `none`, `kill9` and
//! `partition-gateways` faults against
//! the real binary with small numbers, and the checker failing on doctored
//! histories, so that it is shown to be able to fail.

use std::collections::BTreeSet;
use std::time::Duration;

use presence_history::checker::CheckConfig;
use presence_history::faults::{self, Plan};
use presence_history::history::{Call, EventKind, Op, Outcome, Presence, Record, read_json_lines, write_json_lines};
use presence_history::runner::{self, RunOptions};
use presence_history::server::find_presenced;

fn plan(duration_s: u64) -> Plan {
    Plan {
        users: 40,
        gateways: 4,
        viewers: 3,
        ttl_ms: 1_200,
        heartbeat_ms: 400,
        duration: Duration::from_secs(duration_s),
        restart_grace_ms: 1_200,
        checkpoint_interval_ms: 300,
        delivery_bound_ms: 2_000,
    }
}

async fn run(fault: &str, plan: Plan) -> runner::RunReport {
    let options = RunOptions {
        plan,
        presenced: find_presenced(None).expect("the presenced binary (cargo build --bin presenced)"),
        prefix: Vec::new(),
        listen: "127.0.0.1:0".into(),
        connect: None,
        bind: None,
        data_dir: None,
        server_args: Vec::new(),
        history: None,
    };
    let fault = faults::by_name(fault).expect("a known fault");
    let mut lines = Vec::new();
    let report = runner::run(fault, options, &mut |line| lines.push(line.to_owned())).await.expect("the run");
    assert!(lines[0].starts_with("fault: "), "{lines:?}");
    assert!(lines[1].starts_with("expected outcome"), "the expected outcome comes first: {lines:?}");
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_no_fault_every_expectation_holds() {
    let report = run("none", plan(6)).await;
    assert!(report.passed(), "{}", report.render());
    assert!(report.figures.flips > 20, "the run churned: {}", report.render());
    let checked = |name: &str| report.expectations.iter().find(|e| e.name == name).map(|e| e.checked).unwrap();
    assert!(checked("converges") > 0 && checked("no-acknowledged-write-lost") == 40, "{}", report.render());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill9_and_a_restart_on_the_data_directory_keep_b3() {
    let report = run("kill9", plan(8)).await;
    assert!(report.passed(), "{}", report.render());
    let checkpoint = report.records.iter().any(|r| matches!(r, Record::Checkpoint { users, .. } if !users.is_empty()));
    assert!(checkpoint, "the checkpoint the process died with was read");
    assert!(report.figures.streams > 3, "the viewers reconnected after the kill: {}", report.render());
}

// Needs root, `ip` and `nft` (.ci/install-fault-tools); CI runs as root.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn partitioned_gateways_lose_exactly_their_users_and_get_them_back() {
    let report = run("partition-gateways", plan(14)).await;
    assert!(report.passed(), "{}", report.render());
    let checked = |name: &str| report.expectations.iter().find(|e| e.name == name).map(|e| e.checked).unwrap();
    assert!(checked("partitioned-users-offline-once") > 0, "some users were cut off: {}", report.render());
    assert!(report.figures.not_found > 0, "the healed gateways met NOT_FOUND: {}", report.render());
}

// A handmade history of one user `a`, watched by two viewers: registered
// (ONLINE 10), unregistered (OFFLINE 11), registered again (ONLINE 12).

const CONFIG: CheckConfig = CheckConfig { ttl_ms: 1_000, heartbeat_ms: 333, delivery_bound_ms: 2_000 };

fn presence(online: bool, version: u64) -> Presence {
    Presence { user: "a".into(), online, version }
}

fn call(op: Op, start_us: u64, changed: bool, online: bool, version: u64) -> Record {
    Record::Call(Call {
        client: "gw1".into(),
        op,
        user: "a".into(),
        session: "s".into(),
        sent_generation: if op.is_register() { 0 } else { 7 },
        start_us,
        end_us: start_us + 1_000,
        outcome: Outcome::Ok { changed: Some(changed), presence: Some(presence(online, version)), generation: 7 },
    })
}

fn event(viewer: usize, at_us: u64, kind: EventKind, online: bool, version: u64) -> Record {
    Record::Event { viewer, stream: 1, at_us, kind, presence: presence(online, version) }
}

fn both(at_us: u64, online: bool, version: u64) -> Vec<Record> {
    (0..2).map(|viewer| event(viewer, at_us + viewer as u64, EventKind::Update, online, version)).collect()
}

fn finals(online: bool, version: u64) -> Vec<Record> {
    [None, Some(0), Some(1)]
        .into_iter()
        .map(|viewer| Record::Final { viewer, at_us: 20_000_000, users: vec![presence(online, version)] })
        .collect()
}

fn clean() -> Vec<Record> {
    let mut h = Vec::new();
    for viewer in 0..2 {
        h.push(Record::Watching { viewer, users: vec!["a".into()] });
        h.push(Record::Stream { viewer, stream: 1, at_us: 500, opened: true });
        h.push(event(viewer, 500, EventKind::Opening { partial: false }, false, 0));
    }
    h.push(call(Op::Register, 1_000, true, true, 10));
    h.extend(both(2_100, true, 10));
    h.push(call(Op::Unregister, 5_000, true, false, 11));
    h.extend(both(6_100, false, 11));
    h.push(call(Op::Register, 8_000, true, true, 12));
    h.extend(both(9_100, true, 12));
    h.push(Record::Phase { at_us: 20_000_000, name: "check".into() });
    h.push(Record::Held { user: "a".into(), session: "s".into() });
    h.extend(finals(true, 12));
    h
}

fn violated(records: &[Record]) -> BTreeSet<String> {
    let plan = Plan { ttl_ms: CONFIG.ttl_ms as u32, heartbeat_ms: CONFIG.heartbeat_ms as u32, ..plan(1) };
    let (_, expectations) = runner::check_history(records, faults::by_name("none").unwrap().as_ref(), &plan);
    expectations.iter().filter(|e| !e.held()).map(|e| e.name.clone()).collect()
}

fn names(names: &[&str]) -> BTreeSet<String> {
    names.iter().map(|n| n.to_string()).collect()
}

#[test]
fn the_clean_history_passes_and_survives_its_file() {
    let history = clean();
    assert_eq!(violated(&history), names(&[]));
    let path = std::env::temp_dir().join(format!("presence-history-test-{}.jsonl", std::process::id()));
    write_json_lines(&path, &history).unwrap();
    assert_eq!(read_json_lines(&path).unwrap(), history, "the JSON lines read back as written");
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn a_version_going_back_is_flagged() {
    let mut history = clean();
    // Viewer 1 receives ONLINE 10 again after ONLINE 12.
    history.insert(history.len() - 5, event(1, 9_500, EventKind::Update, true, 10));
    assert_eq!(violated(&history), names(&["versions-increase"]));
}

#[test]
fn a_snapshot_older_than_what_the_viewer_held_is_flagged() {
    let mut history = clean();
    history.insert(history.len() - 5, event(0, 9_500, EventKind::Resync, false, 11));
    history.insert(history.len() - 5, event(0, 9_600, EventKind::Update, true, 12));
    assert!(violated(&history).contains("versions-increase"));
}

/// The clean history with a second ONLINE, 13, right after ONLINE 12, with nothing between them.
fn with_a_second_online() -> Vec<Record> {
    let mut history = clean();
    let at = history.len() - 5;
    for (i, record) in both(9_300, true, 13).into_iter().enumerate() {
        history.insert(at + i, record);
    }
    history.truncate(history.len() - 3);
    history.extend(finals(true, 13));
    history
}

#[test]
fn a_duplicate_flip_is_flagged() {
    assert_eq!(violated(&with_a_second_online()), names(&["one-event-per-flip"]));
}

#[test]
fn a_duplicate_flip_beside_a_call_of_unknown_outcome_is_excused() {
    let mut history = with_a_second_online();
    history.push(Record::Call(Call {
        client: "gw1".into(),
        op: Op::Unregister,
        user: "a".into(),
        session: "s2".into(),
        sent_generation: 8,
        start_us: 9_150,
        end_us: 9_250,
        outcome: Outcome::Err { code: "Unavailable".into(), message: "the stream broke".into() },
    }));
    assert_eq!(violated(&history), names(&[]), "the unregister may have applied and been hidden by conflation");
}

#[test]
fn a_lost_unregister_is_flagged() {
    let mut history = clean();
    // The unregister was acknowledged (OFFLINE 11), but no viewer ever gets
    // it and the user is still ONLINE at 10 at the end with no session held.
    history.retain(|r| match r {
        Record::Event { presence, .. } => presence.version == 0 || presence.version == 10,
        Record::Call(call) => call.start_us != 8_000,
        Record::Held { .. } | Record::Final { .. } => false,
        _ => true,
    });
    history.extend(finals(true, 10));
    assert_eq!(violated(&history), names(&["no-acknowledged-write-lost", "offline-follows-unregister"]));
}

#[test]
fn two_states_for_one_version_are_flagged() {
    let mut history = clean();
    history.insert(history.len() - 5, event(1, 9_500, EventKind::Resync, false, 12));
    history.insert(history.len() - 5, event(1, 9_600, EventKind::Resync, true, 12));
    assert!(violated(&history).contains("e1-one-state-per-version"));
}

#[test]
fn a_viewer_that_does_not_converge_is_flagged() {
    let mut history = clean();
    let last = history.len() - 1;
    history[last] = Record::Final { viewer: Some(1), at_us: 20_000_000, users: vec![presence(false, 11)] };
    assert_eq!(violated(&history), names(&["converges"]));
}
