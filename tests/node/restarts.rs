//! B3, B4, M4 and S2 with the real binary as a child process: restarts,
//! planned or not, lose nothing that was promised and flood no one.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use crate::common::daemon::{Daemon, free_port, scratch_dir, until_checkpointed};
use crate::common::*;
use presence_client::{LeaseChannel, LeaseChannelConfig};
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tonic::Code;
use tonic::transport::Channel;

async fn connect(daemon: &Daemon) -> PresenceClient<Channel> {
    PresenceClient::connect(daemon.url()).await.expect("connect to presenced")
}

fn user_ids(prefix: &str, count: usize) -> Vec<String> {
    (0..count).map(|i| format!("{prefix}{i}")).collect()
}

/// Registers `sessions_per_user` sessions of each user in batches of 1,000; returns (user, session, generation).
async fn register_all(
    client: &mut PresenceClient<Channel>,
    users: &[String],
    sessions_per_user: usize,
) -> Vec<(String, String, u64)> {
    let wanted: Vec<(String, String)> = users
        .iter()
        .flat_map(|user| (0..sessions_per_user).map(move |s| (user.clone(), format!("sess_{s:012}"))))
        .collect();
    let mut registered = Vec::with_capacity(wanted.len());
    for chunk in wanted.chunks(1_000) {
        let items = chunk.iter().map(|(user, session)| register_item(user, session, 0)).collect();
        for ((user, session), result) in chunk.iter().zip(lease_batch(client, items).await) {
            registered.push((user.clone(), session.clone(), generation_of(&result)));
        }
    }
    registered
}

/// Renews every session with its generation; returns the codes.
async fn renew_all(client: &mut PresenceClient<Channel>, sessions: &[(String, String, u64)]) -> Vec<Code> {
    let mut codes = Vec::with_capacity(sessions.len());
    for chunk in sessions.chunks(1_000) {
        let items = chunk.iter().map(|(user, session, generation)| renew_item(user, session, *generation)).collect();
        codes.extend(lease_batch(client, items).await.iter().map(|r| Code::from(r.code as i32)));
    }
    codes
}

fn versions(presences: &[pb::UserPresence]) -> Vec<(String, i32, u64)> {
    presences.iter().map(|p| (p.user_id.clone(), p.state, p.version)).collect()
}

/// Gateways: renew every session through a presence-client LeaseChannel, round
/// after round, across the restart, until told to stop. Returns every code seen.
/// Renews every session each heartbeat until `stop`, counting successful
/// renewals in `renewed` as they come.
async fn keep_renewing(
    url: String,
    sessions: Arc<Vec<(String, String, u64)>>,
    stop: Arc<AtomicBool>,
    renewed: Arc<AtomicUsize>,
) -> Vec<Code> {
    let channel = LeaseChannel::connect(url, LeaseChannelConfig::default()).await.expect("connect the gateway");
    let mut codes = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        for chunk in sessions.chunks(1_000) {
            let items =
                chunk.iter().map(|(user, session, generation)| renew_item(user, session, *generation)).collect();
            match channel.submit_batch(items).await {
                Ok(results) => {
                    codes.extend(results.iter().map(|r| Code::from(r.code as i32)));
                    let ok = results.iter().filter(|r| Code::from(r.code as i32) == Code::Ok).count();
                    renewed.fetch_add(ok, Ordering::SeqCst);
                }
                Err(status) => codes.push(status.code()), // the server is restarting
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await; // the heartbeat interval
    }
    codes
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b3_a_graceful_restart_under_10000_renewing_sessions_shows_viewers_no_flip() {
    let dir = scratch_dir("graceful-restart");
    let listen = format!("127.0.0.1:{}", free_port());
    let data_dir = dir.to_str().unwrap();
    let args = ["--data-dir", data_dir, "--default-ttl-ms", "30000", "--min-renew-interval-ms", "0"];
    let daemon = Daemon::start_on(&listen, &args, &[], None);
    let mut client = connect(&daemon).await;
    let users = user_ids("user", 5_000);
    let sessions = Arc::new(register_all(&mut client, &users, 2).await);
    assert_eq!(sessions.len(), 10_000);
    let user_refs: Vec<&str> = users.iter().map(String::as_str).chain(["sentinel"]).collect();
    let mut viewer = Viewer::open(&mut client, &user_refs).await;
    let before = snapshot(&mut client, &user_refs).await;
    assert!(before[..5_000].iter().all(|p| state_of(p) == pb::State::Online));
    let stop = Arc::new(AtomicBool::new(false));
    let renewed = Arc::new(AtomicUsize::new(0));
    let gateways =
        tokio::spawn(keep_renewing(daemon.url(), Arc::clone(&sessions), Arc::clone(&stop), Arc::clone(&renewed)));
    // The gateways connect and renew on the old process before it stops (a
    // connection attempted while it stops is reset, and the test is about renewing across it).
    let deadline = Instant::now() + PATIENCE;
    while renewed.load(Ordering::SeqCst) == 0 {
        assert!(Instant::now() < deadline, "the gateways never renewed on the first process");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }

    daemon.stop().await;
    let ended = viewer.ended().await.expect_err("the watch is told to reconnect");
    assert_eq!(ended.code(), Code::Unavailable);
    assert!(viewer.updates.is_empty(), "nothing flipped before the restart: {:?}", viewer.updates.first());
    let renewed_before_restart = renewed.load(Ordering::SeqCst);

    let daemon = Daemon::start_on(&listen, &args, &[], None);
    let mut client = connect(&daemon).await;
    // Let the gateways renew every session on the new process at least once.
    let codes_before = renew_all(&mut client, &sessions).await;
    assert!(codes_before.iter().all(|code| *code == Code::Ok), "renewals with old generations succeed");
    // A few more heartbeat rounds. Awaited rather than slept: the gateways
    // reconnect with jittered backoff, so a fixed wait sometimes ends before
    // their first round on the new process.
    let deadline = Instant::now() + PATIENCE;
    let enough = (renewed_before_restart + sessions.len()).max(20_000);
    while renewed.load(Ordering::SeqCst) < enough {
        assert!(Instant::now() < deadline, "the gateways stopped renewing: {}", renewed.load(Ordering::SeqCst));
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    stop.store(true, Ordering::SeqCst);
    let codes = gateways.await.unwrap();
    let refused: Vec<&Code> = codes.iter().filter(|code| !matches!(code, Code::Ok | Code::Unavailable)).collect();
    assert!(refused.is_empty(), "no renewal was refused across the restart: {:?}", &refused[..refused.len().min(5)]);
    assert!(codes.iter().filter(|code| **code == Code::Ok).count() >= 20_000, "they kept renewing on both sides");

    // The viewer reconnects and resumes: every user as it was, same version: zero flips.
    let mut resumed = Viewer::open(&mut client, &user_refs).await;
    let after = snapshot(&mut client, &user_refs).await;
    assert_eq!(versions(&after), versions(&before));
    // A sentinel flip reaches the viewer after anything else would have.
    resumed.barrier(&mut client, "sentinel").await;
    assert!(resumed.updates.iter().all(|u| u.user_id == "sentinel"), "flips after the restart: {:?}", resumed.updates);
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn b3_after_kill_9_only_sessions_newer_than_the_checkpoint_flip_and_they_come_back_by_registering() {
    let dir = scratch_dir("kill-9");
    let listen = format!("127.0.0.1:{}", free_port());
    let data_dir = dir.to_str().unwrap();
    let args = ["--data-dir", data_dir, "--checkpoint-interval-ms", "3000", "--default-ttl-ms", "30000"];
    let daemon = Daemon::start_on(&listen, &args, &[], None);
    let mut client = connect(&daemon).await;
    let old_users = user_ids("old", 200);
    let new_users = user_ids("new", 200);
    let old = register_all(&mut client, &old_users, 1).await;
    until_checkpointed(&dir, "old199").await;
    // Registered after the last checkpoint, then the process dies before the next one.
    let new = register_all(&mut client, &new_users, 1).await;
    let all: Vec<&str> = old_users.iter().chain(&new_users).map(String::as_str).chain(["sentinel"]).collect();
    let before = snapshot(&mut client, &all).await;
    let highest_before = before.iter().map(|p| p.version).max().unwrap();
    assert!(before[..400].iter().all(|p| state_of(p) == pb::State::Online));
    daemon.kill9();

    let daemon = Daemon::start_on(&listen, &args, &[], None);
    let mut client = connect(&daemon).await;
    let mut viewer = Viewer::open(&mut client, &all).await;
    // Sessions from before the checkpoint renew as if nothing happened.
    assert!(renew_all(&mut client, &old).await.iter().all(|code| *code == Code::Ok));
    // Sessions from after it are unknown: the gateway re-registers them.
    let codes = renew_all(&mut client, &new).await;
    assert!(codes.iter().all(|code| *code == Code::NotFound), "{:?}", &codes[..3]);
    let again = register_all(&mut client, &new_users, 1).await;
    assert!(again.iter().zip(&new).all(|(after, before)| after.2 > before.2), "generations never go back");
    viewer.barrier(&mut client, "sentinel").await;
    let flipped: Vec<&str> = viewer.updates.iter().map(|u| u.user_id.as_str()).filter(|u| *u != "sentinel").collect();
    assert!(flipped.iter().all(|user| user.starts_with("new")), "only post-checkpoint users may flip: {flipped:?}");
    assert!(viewer.updates.iter().all(|u| u.version > highest_before || u.user_id == "sentinel"));
    let after = snapshot(&mut client, &all[..400]).await;
    assert!(after.iter().all(|p| state_of(p) == pb::State::Online), "everyone is back online");
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// L4: a service stopped (SIGSTOP) for twice the TTL takes nobody offline whose
/// gateway renews once it runs again: the time it did not run does not count
/// against leases, and online users are held for the restart grace, so a
/// gateway that comes back too late for its lease registers it again without
/// a flip. Users nobody renews go OFFLINE when the grace ends.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn l4_a_service_stopped_longer_than_a_ttl_takes_nobody_offline_whose_gateway_renews_after_it() {
    let (ttl, grace) = (Duration::from_millis(2_000), Duration::from_millis(6_000));
    let args = ["--default-ttl-ms", "2000", "--min-ttl-ms", "1000", "--restart-grace-ms", "6000"];
    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let users = user_ids("paused", 200);
    let sessions = register_all(&mut client, &users, 1).await;
    let watched: Vec<&str> = users.iter().map(String::as_str).chain(["sentinel"]).collect();
    let mut viewer = Viewer::open(&mut client, &watched).await;

    daemon.pause();
    tokio::time::sleep(ttl * 2).await;
    daemon.resume();
    let resumed = Instant::now();
    let (renewing, rest) = sessions.split_at(100);
    let (late, silent) = rest.split_at(50);
    let codes = renew_all(&mut client, renewing).await;
    assert!(codes.iter().all(|code| *code == Code::Ok), "renewals right after the stop: {:?}", &codes[..3]);
    // A gateway slower to come back than its lease (under a second was left of
    // it): the lease is gone, the user is not, and registering again shows nothing.
    tokio::time::sleep(ttl * 3 / 4).await;
    let codes = renew_all(&mut client, late).await;
    assert!(codes.iter().all(|code| *code == Code::NotFound), "late renewals: {:?}", &codes[..3]);
    let late_users: Vec<String> = late.iter().map(|(user, _, _)| user.clone()).collect();
    register_all(&mut client, &late_users, 1).await;
    viewer.barrier(&mut client, "sentinel").await;
    let flipped: Vec<&str> = viewer.updates.iter().map(|u| u.user_id.as_str()).filter(|u| *u != "sentinel").collect();
    assert!(flipped.is_empty(), "nobody flips for the service's own stop: {flipped:?}");
    let online = snapshot(&mut client, &watched[..150]).await.iter().all(|p| state_of(p) == pb::State::Online);
    assert!(online, "the renewed and the registered again are online");

    // The 50 sessions nobody renews go OFFLINE when the grace ends, not before.
    let silent: Vec<&str> = silent.iter().map(|(user, _, _)| user.as_str()).collect();
    viewer.until_all_in_state(&silent, pb::State::Offline).await;
    let took = resumed.elapsed();
    assert!(took >= grace - Duration::from_millis(100) && took < grace + Duration::from_secs(1), "took {took:?}");
    daemon.stop().await;
}

/// The highest generation and the highest version a user reached.
#[derive(Debug, Default, Clone, Copy)]
struct Highest {
    generation: u64,
    version: u64,
}

/// Flips `user` ONLINE and OFFLINE three times, asserting that every register
/// and unregister really flipped it (so the versions really moved), and
/// returns the highest generation and version it reached.
async fn flip_a_few_times(client: &mut PresenceClient<Channel>, user: &str) -> Highest {
    let mut highest = Highest::default();
    for _ in 0..3 {
        let registered = client.register(register(user, "s", "gw", 0)).await.unwrap().into_inner();
        assert!(registered.changed, "{user} was offline, so the register flips it ONLINE");
        let unregistered =
            client.unregister(unregister(user, "s", registered.generation, 0)).await.unwrap().into_inner();
        assert!(unregistered.changed, "{user} had one session, so the unregister flips it OFFLINE");
        highest.generation = highest.generation.max(registered.generation);
        highest.version = highest.version.max(unregistered.presence.unwrap().version);
    }
    highest
}

#[tokio::test]
async fn m4_versions_never_go_back_across_kill_9_without_a_data_directory() {
    let daemon = Daemon::start(&[], &[]);
    let mut client = connect(&daemon).await;
    let highest = flip_a_few_times(&mut client, "u1").await;
    daemon.kill9();
    let daemon = Daemon::start(&[], &[]);
    let mut client = connect(&daemon).await;
    let registered = client.register(register("u1", "s", "gw", 0)).await.unwrap().into_inner();
    assert!(registered.generation > highest.generation);
    let version = registered.presence.unwrap().version;
    assert!(
        version > highest.version,
        "a viewer holding the old version accepts the new one: {version} vs {highest:?}"
    );
}

#[tokio::test]
async fn m4_versions_never_go_back_across_kill_9_with_flips_after_the_last_checkpoint() {
    let dir = scratch_dir("m4-data");
    let data_dir = dir.to_str().unwrap();
    let args = ["--data-dir", data_dir, "--checkpoint-interval-ms", "60000"];
    // The last checkpoint this test writes: u1 known, and OFFLINE (so that no
    // restart hold keeps it online and the flips below really happen).
    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let checkpointed = flip_a_few_times(&mut client, "u1").await;
    daemon.stop().await;
    // After it: flips that no checkpoint records, then a crash.
    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    assert_eq!(snapshot(&mut client, &["u1"]).await[0].version, checkpointed.version, "restored from the checkpoint");
    let highest = flip_a_few_times(&mut client, "u1").await;
    assert!(highest.version > checkpointed.version);
    daemon.kill9();
    // The restart loads the checkpoint from before those flips.
    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let restored = snapshot(&mut client, &["u1"]).await;
    assert_eq!(restored[0].version, checkpointed.version, "the flips after the checkpoint are not in it");
    let registered = client.register(register("u1", "s9", "gw", 0)).await.unwrap().into_inner();
    assert!(registered.changed);
    assert!(registered.generation > highest.generation, "{} vs {highest:?}", registered.generation);
    let version = registered.presence.unwrap().version;
    assert!(
        version > highest.version,
        "a viewer holding the lost version accepts the new one: {version} vs {highest:?}"
    );
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn b4_touches_and_settings_acknowledged_before_kill_9_survive_it() {
    let dir = scratch_dir("durable");
    let data_dir = dir.to_str().unwrap();
    // A one-second activity interval stands in for the production minute.
    let args = ["--data-dir", data_dir, "--activity-write-interval-ms", "1000"];
    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let first = client.touch(pb::TouchRequest { user_id: "u1".into() }).await.unwrap().into_inner();
    tokio::time::sleep(Duration::from_millis(20)).await; // a later activity, at a later millisecond
    let second = client.touch(pb::TouchRequest { user_id: "u1".into() }).await.unwrap().into_inner();
    assert!(second.last_active_at_ms > first.last_active_at_ms);
    let setting =
        pb::PutSettingRequest { user_id: "u1".into(), name: "visibility".into(), value: b"contacts".to_vec() };
    client.put_setting(setting).await.expect("acknowledged once synced");
    // The second touch is promised durable once its interval is up (plus the flusher's period).
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    daemon.kill9();

    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let settings = client.get_settings(pb::GetSettingsRequest { user_id: "u1".into() }).await.unwrap().into_inner();
    assert_eq!(settings.settings.get("visibility").map(Vec::as_slice), Some(&b"contacts"[..]));
    let now = snapshot(&mut client, &["u1"]).await;
    assert_eq!(now[0].last_active_at_ms, second.last_active_at_ms);
    // last_active_at only moves forward.
    let third = client.touch(pb::TouchRequest { user_id: "u1".into() }).await.unwrap().into_inner();
    assert!(third.last_active_at_ms >= second.last_active_at_ms);
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn b3_a_damaged_checkpoint_is_reported_in_one_line_and_never_loaded() {
    let dir = scratch_dir("damaged");
    let data_dir = dir.to_str().unwrap();
    let args = ["--data-dir", data_dir, "--checkpoint-interval-ms", "60000"];
    // Two graceful stops leave two checkpoints: u1 alone, then u1 and u2.
    let daemon = Daemon::start(&args, &[]);
    connect(&daemon).await.register(register("u1", "s", "gw", 60_000)).await.unwrap();
    daemon.stop().await;
    let daemon = Daemon::start(&args, &[]);
    connect(&daemon).await.register(register("u2", "s", "gw", 60_000)).await.unwrap();
    daemon.stop().await;

    // Truncate the latest: the service says so and starts from the previous one.
    let latest = dir.join("leases.checkpoint");
    let bytes = std::fs::read(&latest).unwrap();
    std::fs::write(&latest, &bytes[..bytes.len() - 7]).unwrap();
    let stderr = dir.join("stderr.log");
    let daemon = Daemon::start_on("127.0.0.1:0", &args, &[], Some(&stderr));
    let mut client = connect(&daemon).await;
    let now = snapshot(&mut client, &["u1", "u2"]).await;
    assert_eq!(now.iter().map(state_of).collect::<Vec<_>>(), [pb::State::Online, pb::State::Offline]);
    let reported: Vec<String> =
        daemon.stderr_text().lines().filter(|line| line.contains("leases.checkpoint ")).map(str::to_owned).collect();
    assert_eq!(reported.len(), 1, "{reported:?}");
    assert!(reported[0].contains("truncated"), "{reported:?}");
    drop(daemon);

    // Corrupt both: the service starts empty rather than from garbage.
    for name in ["leases.checkpoint", "leases.checkpoint.prev"] {
        let path = dir.join(name);
        let mut bytes = std::fs::read(&path).unwrap();
        let middle = bytes.len() / 2;
        bytes[middle] ^= 0x55;
        std::fs::write(&path, &bytes).unwrap();
    }
    let daemon = Daemon::start_on("127.0.0.1:0", &args, &[], Some(&stderr));
    let mut client = connect(&daemon).await;
    let now = snapshot(&mut client, &["u1", "u2"]).await;
    assert!(now.iter().all(|p| state_of(p) == pb::State::Offline && p.version == 0));
    let text = daemon.stderr_text();
    assert_eq!(text.lines().filter(|line| line.contains("is unusable")).count(), 2, "{text}");
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn b3_room_memberships_and_access_survive_a_graceful_restart_and_signals_do_not() {
    let dir = scratch_dir("rooms-data");
    let data_dir = dir.to_str().unwrap();
    let args = ["--data-dir", data_dir];
    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let registered = client.register(register("u1", "s", "gw", 60_000)).await.unwrap().into_inner();
    let metadata = [("tab".to_string(), "one".to_string())].into();
    let join = pb::JoinRequest {
        user_id: "u1".into(),
        session_id: "s".into(),
        generation: registered.generation,
        room_id: "doc".into(),
        metadata,
    };
    let joined = client.join(join).await.unwrap().into_inner();
    let signal = pb::SignalRequest {
        user_id: "u1".into(),
        session_id: "s".into(),
        generation: registered.generation,
        room_id: "doc".into(),
        kind: "typing".into(),
        ttl_ms: 10_000,
    };
    assert!(client.signal(signal).await.unwrap().into_inner().changed);
    let public = pb::SetRoomAccessRequest { room_id: "lobby".into(), access: pb::RoomAccess::Public as i32 };
    client.set_room_access(public).await.unwrap();
    daemon.stop().await;

    let daemon = Daemon::start(&args, &[]);
    let mut client = connect(&daemon).await;
    let room = client.room_snapshot(pb::RoomSnapshotRequest { room_id: "doc".into(), ..Default::default() }).await;
    let room = room.unwrap().into_inner();
    assert_eq!(room.members.len(), 1, "the member came back with its session's lease");
    assert_eq!(room.members[0].metadata.get("tab").map(String::as_str), Some("one"));
    assert!(room.signals.is_empty(), "signals are never written to a checkpoint");
    assert!(room.version > joined.room_version, "room versions go on above the checkpointed ones");
    // An empty room is held only for a non-default access; one never held reads as version 0.
    let lobby = client.room_snapshot(pb::RoomSnapshotRequest { room_id: "lobby".into(), ..Default::default() });
    assert!(lobby.await.unwrap().into_inner().version > 0, "the public lobby's access came back");
    let never = client.room_snapshot(pb::RoomSnapshotRequest { room_id: "never".into(), ..Default::default() });
    assert_eq!(never.await.unwrap().into_inner().version, 0);
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
