//! D3 over real gRPC and the binary: a backup taken while sessions renew,
//! users flip and durable data is written restores into a fresh node whose
//! every export matches; a corrupt, truncated, foreign or missing file is
//! refused before `listening on`; a backup needs the admin scope and is
//! audited; `presenced backup` writes the file atomically with a summary.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::common::auth::{self, SERVICE};
use crate::common::daemon::{BINARY, scratch_dir};
use crate::common::*;
use crate::node::credentials::{SCOPED, audit_lines, credentials_config, scoped_credentials};
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::ServerConfig;
use tonic::Code;
use tonic::transport::Channel;

fn service<T>(message: T) -> tonic::Request<T> {
    with_token(message, Some(SERVICE))
}

/// Takes a backup over gRPC as the holder of `token` into `path`.
async fn backup_into(
    client: &mut PresenceClient<Channel>,
    token: &str,
    path: &Path,
) -> Result<pb::BackupChunk, tonic::Status> {
    let mut stream = client.backup(with_token(pb::BackupRequest {}, Some(token))).await?.into_inner();
    let mut bytes = Vec::new();
    while let Some(chunk) = stream.message().await? {
        bytes.extend_from_slice(&chunk.data);
        if chunk.last {
            std::fs::write(path, &bytes).unwrap();
            return Ok(chunk);
        }
    }
    panic!("the backup stream ended without its last message");
}

fn disk_config(dir: &Path) -> ServerConfig {
    let mut config = auth::secured_config();
    config.data_dir = Some(dir.to_owned());
    config
}

fn restore_config(file: &Path, dir: &Path) -> ServerConfig {
    let mut config = disk_config(dir);
    config.restore = Some(file.to_owned());
    config
}

/// Gives `user` a session in a room with metadata, a status, a visibility,
/// an audience, a group, activity and a setting.
async fn populate(client: &mut PresenceClient<Channel>, user: &str) {
    let mut request = register(user, "s1", "gw-a", 60_000);
    request.metadata.insert("device".into(), "ios".into());
    let generation = client.register(service(request)).await.unwrap().into_inner().generation;
    let join = pb::JoinRequest {
        user_id: user.into(),
        session_id: "s1".into(),
        generation,
        room_id: "doc".into(),
        metadata: [("role".to_owned(), "editor".to_owned())].into(),
    };
    client.join(service(join)).await.unwrap();
    let status =
        pb::Status { availability: pb::Availability::Away as i32, text: format!("{user} away"), expires_at_ms: 0 };
    client.set_status(service(pb::SetStatusRequest { user_id: user.into(), status: Some(status) })).await.unwrap();
    let visibility = pb::SetVisibilityRequest {
        user_id: user.into(),
        visibility: pb::Visibility::Audience as i32,
        ..Default::default()
    };
    client.set_visibility(service(visibility)).await.unwrap();
    let audience = pb::AudienceRequest { user_id: user.into(), viewer_ids: vec!["bob".into()] };
    client.grant_audience(service(audience)).await.unwrap();
    let team = pb::GroupRequest { group_id: "team".into(), user_ids: vec![user.into()] };
    client.join_group(service(team)).await.unwrap();
    client.touch(service(pb::TouchRequest { user_id: user.into() })).await.unwrap();
    let setting = pb::PutSettingRequest { user_id: user.into(), name: "theme".into(), value: user.as_bytes().to_vec() };
    client.put_setting(service(setting)).await.unwrap();
}

async fn exports(client: &mut PresenceClient<Channel>, users: &[String]) -> BTreeMap<String, pb::ExportUserResponse> {
    let mut exported = BTreeMap::new();
    for user in users {
        let request = service(pb::ExportUserRequest { user_id: user.clone() });
        exported.insert(user.clone(), client.export_user(request).await.unwrap().into_inner());
    }
    exported
}

/// Load until `stop`: renewals of the busy users' sessions, users flipping
/// online and offline, and durable writes; `progress` counts rounds.
fn start_load(
    client: PresenceClient<Channel>,
    stop: Arc<AtomicBool>,
    progress: Arc<AtomicU64>,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut client = client;
        let mut generations = BTreeMap::new();
        for user in 0..20 {
            let id = format!("busy{user}");
            let generation =
                client.register(service(register(&id, "s", "gw-b", 60_000))).await.unwrap().into_inner().generation;
            generations.insert(id, generation);
        }
        let mut round = 0u64;
        while !stop.load(Ordering::Relaxed) {
            for (user, generation) in &generations {
                client.renew(service(renew(user, "s", *generation, 60_000))).await.unwrap();
            }
            let flip = format!("flip{}", round % 10);
            let generation =
                client.register(service(register(&flip, "s", "gw-c", 60_000))).await.unwrap().into_inner().generation;
            if round.is_multiple_of(2) {
                client.unregister(service(unregister(&flip, "s", generation, 0))).await.unwrap();
            }
            let user = format!("busy{}", round % 20);
            let setting =
                pb::PutSettingRequest { user_id: user, name: "round".into(), value: round.to_le_bytes().to_vec() };
            client.put_setting(service(setting)).await.unwrap();
            round += 1;
            progress.store(round, Ordering::Relaxed);
        }
    })
}

#[tokio::test]
async fn d3_a_backup_under_load_restores_into_a_fresh_node_with_every_export_equal() {
    let dir = scratch_dir("backup-load");
    let source = TestServer::start(disk_config(&dir.join("source"))).await;
    let mut client = source.client().await;
    let still: Vec<String> = (0..30).map(|user| format!("still{user}")).collect();
    for user in &still {
        populate(&mut client, user).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let progress = Arc::new(AtomicU64::new(0));
    let load = start_load(source.client().await, Arc::clone(&stop), Arc::clone(&progress));
    within(PATIENCE, "the load under way", async {
        while progress.load(Ordering::Relaxed) < 20 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    let under_load = dir.join("under-load.backup");
    let taken = backup_into(&mut client, SERVICE, &under_load).await.unwrap();
    let rounds_at_backup = progress.load(Ordering::Relaxed);
    within(PATIENCE, "the load going on after the backup", async {
        while progress.load(Ordering::Relaxed) < rounds_at_backup + 20 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    })
    .await;
    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    assert!(taken.users >= 30 && taken.durable_rows > 0, "{taken:?}");

    // A quiet backup restores to exactly what the source holds.
    let quiet = dir.join("quiet.backup");
    backup_into(&mut client, SERVICE, &quiet).await.unwrap();
    let mut users = still.clone();
    users.extend((0..20).map(|user| format!("busy{user}")));
    users.extend((0..10).map(|user| format!("flip{user}")));
    let expected = exports(&mut client, &users).await;
    let restored = TestServer::start(restore_config(&quiet, &dir.join("quiet-node"))).await;
    let got = exports(&mut restored.client().await, &users).await;
    for user in &users {
        assert_eq!(
            export_shape(&got[user]),
            export_shape(&expected[user]),
            "{user}: {:?} vs {:?}",
            got[user],
            expected[user]
        );
    }
    // A gateway that goes on renewing with the generation it had is answered as before.
    let generation = got["still0"].sessions[0].generation;
    let renewed = restored.client().await.renew(service(renew("still0", "s1", generation, 60_000))).await;
    assert!(renewed.unwrap().into_inner().expires_at_ms >= got["still0"].sessions[0].expires_at_ms);
    restored.stop().await;

    // The backup under load: what nobody touched is exactly as it was, and
    // every busy user is there, online, with a generation the source had.
    let restored = TestServer::start(restore_config(&under_load, &dir.join("load-node"))).await;
    let mut restored_client = restored.client().await;
    let got = exports(&mut restored_client, &users).await;
    for user in &still {
        assert_eq!(export_shape(&got[user]), export_shape(&expected[user]), "{user}");
    }
    for user in (0..20).map(|user| format!("busy{user}")) {
        let (got, now) = (&got[&user], &expected[&user]);
        assert_eq!(got.presence.as_ref().map(|presence| presence.state), Some(pb::State::Online as i32), "{got:?}");
        assert_eq!(got.sessions.len(), 1, "{got:?}");
        assert!(got.sessions[0].generation <= now.sessions[0].generation, "{got:?} vs {now:?}");
    }
    restored.stop().await;
    source.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// `presenced serve --restore FILE` with `more` args: its exit code, stdout and stderr.
fn serve_restoring(file: &Path, more: &[&str]) -> (Option<i32>, String, String) {
    let output = Command::new(BINARY)
        .args(["serve", "--listen", "127.0.0.1:0", "--restore"])
        .arg(file)
        .args(more)
        .output()
        .expect("run presenced");
    let text = |bytes: Vec<u8>| String::from_utf8(bytes).unwrap();
    (output.status.code(), text(output.stdout), text(output.stderr))
}

fn assert_refused(file: &Path, more: &[&str], reason: &str) {
    let (code, stdout, stderr) = serve_restoring(file, more);
    assert_eq!(code, Some(2), "{stderr}");
    assert!(!stdout.contains("listening on"), "{stdout}");
    let last = stderr.lines().last().unwrap_or_default();
    assert!(last.starts_with("presenced: --restore ") && last.contains(reason), "{reason:?} in {stderr}");
}

#[tokio::test]
async fn d3_a_corrupt_truncated_foreign_or_missing_backup_is_refused_before_listening_on() {
    let dir = scratch_dir("backup-refused");
    let source = TestServer::start(disk_config(&dir.join("source"))).await;
    let mut client = source.client().await;
    populate(&mut client, "ann").await;
    let good = dir.join("good.backup");
    backup_into(&mut client, SERVICE, &good).await.unwrap();
    source.stop().await;
    let bytes = std::fs::read(&good).unwrap();
    let write = |name: &str, bytes: &[u8]| -> PathBuf {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        path
    };

    let mut corrupt = bytes.clone();
    corrupt[bytes.len() / 2] ^= 0x40;
    assert_refused(&write("corrupt", &corrupt), &[], "corrupt");
    // In the durable rows, which only the file's own checksum covers.
    let mut corrupt = bytes.clone();
    corrupt[bytes.len() - 10] ^= 0x01;
    assert_refused(&write("corrupt-durable", &corrupt), &[], "corrupt: checksum mismatch");
    assert_refused(&write("truncated", &bytes[..bytes.len() - 7]), &[], "truncated");
    assert_refused(&write("cut-in-header", &bytes[..12]), &[], "truncated");
    assert_refused(&write("trailing", &[&bytes[..], b"x"].concat()), &[], "bytes after the end record");
    assert_refused(&write("not-a-backup", b"PRESENCD and then some"), &[], "not a presenced backup");
    let mut future = bytes.clone();
    future[8] = 9;
    assert_refused(&write("future", &future), &[], "backup format 9 is not supported");
    let cluster = ["--etcd", "http://127.0.0.1:1", "--node-id", "a", "--advertise", "127.0.0.1:1", "--slots", "64"];
    assert_refused(&good, &cluster, "a foreign backup: written by a node of 0 slots, this node has 64");
    assert_refused(&dir.join("missing"), &[], "cannot read the file");
    // Durable data needs somewhere to go; a data directory in use is not mixed with a backup.
    assert_refused(&good, &[], "no --data-dir to keep it in");
    let used = dir.join("source");
    assert_refused(&good, &["--data-dir", used.to_str().unwrap()], "already holds data");
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn d3_a_backup_needs_the_admin_scope_and_is_audited() {
    let dir = scratch_dir("backup-scope");
    let audit = dir.join("audit.log");
    let server = TestServer::start(credentials_config(&scoped_credentials(&dir, ""), Some(&audit))).await;
    let mut client = server.client().await;
    let (gateway, admin) = (SCOPED[0].1, SCOPED[3].1);
    let refused = backup_into(&mut client, gateway, &dir.join("refused.backup")).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    assert!(refused.message().contains("`admin` scope"), "{refused:?}");
    backup_into(&mut client, admin, &dir.join("taken.backup")).await.unwrap();
    let lines = audit_lines(&audit);
    let seen: Vec<(&str, &str, &str)> = lines
        .iter()
        .map(|line| {
            (line["action"].as_str().unwrap(), line["credential"].as_str().unwrap(), line["result"].as_str().unwrap())
        })
        .collect();
    assert_eq!(seen, [("Backup", "gateway", "PERMISSION_DENIED"), ("Backup", "admin", "OK")]);
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

/// Runs the binary with `args` off the test's runtime thread, which serves
/// the in-process server it calls.
async fn presenced_beside(args: &[&str]) -> std::process::Output {
    let args: Vec<String> = args.iter().map(ToString::to_string).collect();
    tokio::task::spawn_blocking(move || Command::new(BINARY).args(args).output().unwrap()).await.unwrap()
}

#[tokio::test]
async fn d3_presenced_backup_writes_the_file_atomically_and_prints_a_summary() {
    let dir = scratch_dir("backup-cli");
    let server = TestServer::start(disk_config(&dir.join("source"))).await;
    let mut client = server.client().await;
    populate(&mut client, "ann").await;
    let file = dir.join("node.backup");
    let addr = server.addr.to_string();
    let output = presenced_beside(&["backup", "--addr", &addr, "--token", SERVICE, file.to_str().unwrap()]).await;
    assert!(output.status.success(), "{output:?}");
    let stdout = String::from_utf8(output.stdout).unwrap();
    let bytes = std::fs::metadata(&file).unwrap().len();
    assert!(
        stdout.starts_with(&format!("backed up {}: 1 users, 1 sessions, ", file.display()))
            && stdout.contains(&format!(" {bytes} bytes in ")),
        "{stdout}"
    );
    assert!(!dir.join("node.backup.tmp").exists());
    // Refused midway (no admin token): nothing is left behind, not even the temporary file.
    let refused = dir.join("refused.backup");
    let output = presenced_beside(&["backup", "--addr", &addr, refused.to_str().unwrap()]).await;
    assert_eq!(output.status.code(), Some(4), "{output:?}");
    assert!(!refused.exists() && !dir.join("refused.backup.tmp").exists());
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}
