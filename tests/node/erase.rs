//! P7 over real gRPC: ExportUser shows every kind of data held about a user;
//! EraseUser removes it all, its watchers see it go OFFLINE, and afterwards
//! the user reads byte for byte as a user never seen, to a viewer and to a
//! service, also after a restart, and after a crash that loses every
//! checkpoint written since the erase.

use std::collections::HashMap;

use crate::common::auth::{self, SECRET, SERVICE, viewer_token};
use crate::common::daemon::{Daemon, scratch_dir};
use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::ServerConfig;
use presence_server::privacy::Visibility;
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

fn service<T>(message: T) -> tonic::Request<T> {
    with_token(message, Some(SERVICE))
}

async fn export(client: &mut PresenceClient<Channel>, user: &str) -> pb::ExportUserResponse {
    client.export_user(service(pb::ExportUserRequest { user_id: user.into() })).await.expect("export").into_inner()
}

async fn erase(client: &mut PresenceClient<Channel>, user: &str) -> pb::EraseUserResponse {
    client.erase_user(service(pb::EraseUserRequest { user_id: user.into() })).await.expect("erase").into_inner()
}

/// A presence's bytes with its user id blanked.
fn shape(presence: &pb::UserPresence) -> Vec<u8> {
    pb::UserPresence { user_id: String::new(), ..presence.clone() }.encode_to_vec()
}

async fn snapshot_as(client: &mut PresenceClient<Channel>, token: &str, users: &[&str]) -> Vec<pb::UserPresence> {
    let request =
        pb::SnapshotRequest { user_ids: users.iter().map(ToString::to_string).collect(), ..Default::default() };
    client.snapshot(with_token(request, Some(token))).await.expect("snapshot").into_inner().users
}

/// The first event of a new Watch of `users` by the holder of `token`: its users' shapes.
async fn watch_opening(client: &mut PresenceClient<Channel>, token: &str, users: &[&str]) -> Vec<Vec<u8>> {
    let request = pb::WatchRequest { user_ids: users.iter().map(ToString::to_string).collect(), ..Default::default() };
    let mut stream = client.watch(with_token(request, Some(token))).await.expect("watch").into_inner();
    let first = within(PATIENCE, "the opening snapshot", stream.message()).await.unwrap().unwrap();
    let Some(pb::watch_event::Event::Snapshot(snapshot)) = first.event else { panic!("a snapshot first: {first:?}") };
    snapshot.users.iter().map(shape).collect()
}

/// A room's snapshot as a service reads it, without its id and version.
async fn room_shape(client: &mut PresenceClient<Channel>, room: &str) -> Vec<u8> {
    let request = pb::RoomSnapshotRequest { room_id: room.into(), ..Default::default() };
    let mut snapshot = client.room_snapshot(service(request)).await.expect("room").into_inner();
    snapshot.room_id.clear();
    snapshot.version = 0;
    for set in &mut snapshot.signals {
        set.room_id.clear();
        set.version = 0;
    }
    snapshot.encode_to_vec()
}

fn with_metadata(mut request: pb::RegisterRequest, key: &str, value: &str) -> pb::RegisterRequest {
    request.metadata.insert(key.into(), value.into());
    request
}

fn join(user: &str, session: &str, generation: u64, room: &str, device: &str) -> pb::JoinRequest {
    pb::JoinRequest {
        user_id: user.into(),
        session_id: session.into(),
        generation,
        room_id: room.into(),
        metadata: [("device".to_owned(), device.to_owned())].into(),
    }
}

/// Gives `user` every kind of data presenced holds: two sessions on two
/// gateways with metadata, in rooms; a status, a visibility, an audience,
/// a place in `grantor`'s audience, a group with `teammate`, activity and
/// two settings.
async fn populate(client: &mut PresenceClient<Channel>, user: &str, grantor: &str, teammate: &str) {
    let phone = client
        .register(service(with_metadata(register(user, "phone", "gw-a", 60_000), "device", "ios")))
        .await
        .unwrap()
        .into_inner()
        .generation;
    let laptop = client
        .register(service(with_metadata(register(user, "laptop", "gw-b", 60_000), "device", "linux")))
        .await
        .unwrap()
        .into_inner()
        .generation;
    client.join(service(join(user, "phone", phone, "doc", "phone"))).await.unwrap();
    client.join(service(join(user, "laptop", laptop, "doc", "laptop"))).await.unwrap();
    client.join(service(join(user, "laptop", laptop, "lobby", "laptop"))).await.unwrap();
    let status = pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), expires_at_ms: 0 };
    client.set_status(service(pb::SetStatusRequest { user_id: user.into(), status: Some(status) })).await.unwrap();
    let visibility = pb::SetVisibilityRequest {
        user_id: user.into(),
        visibility: pb::Visibility::Audience as i32,
        ..Default::default()
    };
    client.set_visibility(service(visibility)).await.unwrap();
    let audience = pb::AudienceRequest { user_id: user.into(), viewer_ids: vec!["bob".into(), "carol".into()] };
    client.grant_audience(service(audience)).await.unwrap();
    let theirs = pb::AudienceRequest { user_id: grantor.into(), viewer_ids: vec![user.into(), "bob".into()] };
    client.grant_audience(service(theirs)).await.unwrap();
    let team = pb::GroupRequest { group_id: "team".into(), user_ids: vec![user.into(), teammate.into()] };
    client.join_group(service(team)).await.unwrap();
    client.touch(service(pb::TouchRequest { user_id: user.into() })).await.unwrap();
    for (name, value) in [("locale", "fr"), ("theme", "dark")] {
        let setting = pb::PutSettingRequest { user_id: user.into(), name: name.into(), value: value.into() };
        client.put_setting(service(setting)).await.unwrap();
    }
}

/// Asserts that the export of `user` shows everything [`populate`] gave it.
fn assert_everything_exported(exported: &pb::ExportUserResponse, user: &str, grantor: &str) {
    assert!(exported.held, "{exported:?}");
    let presence = exported.presence.as_ref().unwrap();
    assert_eq!((presence.state, presence.user_id.as_str()), (pb::State::Online as i32, user));
    assert!(presence.version > 0 && presence.last_active_at_ms > 0, "{presence:?}");
    let sessions: HashMap<&str, (&str, &str)> = exported
        .sessions
        .iter()
        .map(|session| {
            (session.session_id.as_str(), (session.gateway_id.as_str(), session.metadata["device"].as_str()))
        })
        .collect();
    assert_eq!(sessions, HashMap::from([("phone", ("gw-a", "ios")), ("laptop", ("gw-b", "linux"))]));
    assert!(exported.sessions.iter().all(|session| session.generation > 0 && session.expires_at_ms > 0));
    let mut rooms: Vec<(&str, &str, &str)> = exported
        .rooms
        .iter()
        .map(|room| (room.session_id.as_str(), room.room_id.as_str(), room.metadata["device"].as_str()))
        .collect();
    rooms.sort_unstable();
    assert_eq!(rooms, [("laptop", "doc", "laptop"), ("laptop", "lobby", "laptop"), ("phone", "doc", "phone")]);
    assert_eq!(exported.status.as_ref().map(|status| status.text.as_str()), Some("lunch"));
    assert_eq!((exported.visibility, exported.visibility_is_default), (pb::Visibility::Audience as i32, false));
    assert_eq!(exported.audience, ["bob", "carol"]);
    assert_eq!(exported.in_audience_of, [grantor]);
    assert_eq!(exported.groups, ["team"]);
    assert_eq!(exported.last_active_at_ms, presence.last_active_at_ms);
    assert_eq!(
        exported.settings,
        HashMap::from([("locale".to_owned(), b"fr".to_vec()), ("theme".to_owned(), b"dark".to_vec())])
    );
}

/// Asserts that `user` reads byte for byte as `never`, a user never seen,
/// through every call that reads a user: to a service and to viewer bob.
async fn assert_reads_as_never_seen(client: &mut PresenceClient<Channel>, user: &str, never: &str) {
    let bob = viewer_token("bob", false);
    let exported = export(client, user).await;
    assert!(!exported.held, "{exported:?}");
    assert_eq!(export_shape(&exported), export_shape(&export(client, never).await), "{exported:?}");
    for token in [SERVICE, bob.as_str()] {
        let read = snapshot_as(client, token, &[user, never]).await;
        assert_eq!(shape(&read[0]), shape(&read[1]), "Snapshot with {token}: {read:?}");
        let opening = watch_opening(client, token, &[user, never]).await;
        assert_eq!(opening[0], opening[1], "Watch's opening snapshot with {token}");
    }
    let listed = |user: &str| service(pb::ListSessionsRequest { user_id: user.into() });
    let mut sessions = client.list_sessions(listed(user)).await.unwrap().into_inner();
    let mut never_sessions = client.list_sessions(listed(never)).await.unwrap().into_inner();
    (sessions.now_ms, never_sessions.now_ms) = (0, 0);
    assert_eq!(sessions.encode_to_vec(), never_sessions.encode_to_vec(), "ListSessions");
    let settings = |user: &str| service(pb::GetSettingsRequest { user_id: user.into() });
    let own = client.get_settings(settings(user)).await.unwrap().into_inner();
    assert_eq!(own.encode_to_vec(), client.get_settings(settings(never)).await.unwrap().into_inner().encode_to_vec());
}

fn disk_config(dir: &std::path::Path) -> ServerConfig {
    let mut config = auth::secured_config();
    config.data_dir = Some(dir.to_owned());
    config.default_visibility = Visibility::Audience;
    config
}

#[tokio::test]
async fn p7_an_export_shows_everything_and_an_erased_user_reads_as_never_seen_even_after_a_restart() {
    let dir = scratch_dir("erase");
    let server = TestServer::start(disk_config(&dir)).await;
    let mut client = server.client().await;
    populate(&mut client, "ann", "dan", "erin").await;
    // A bystander in the same room, and the same in a room ann never used.
    let zed = client.register(service(register("zed", "s", "gw-a", 60_000))).await.unwrap().into_inner().generation;
    for room in ["doc", "control"] {
        client.join(service(join("zed", "s", zed, room, "desk"))).await.unwrap();
    }
    assert_everything_exported(&export(&mut client, "ann").await, "ann", "dan");

    // bob (in ann's audience) and a service watch her.
    let mut bob = Viewer::open_request(
        &mut client,
        with_token(
            pb::WatchRequest { user_ids: vec!["ann".into(), "bob".into()], ..Default::default() },
            Some(&viewer_token("bob", false)),
        ),
    )
    .await;
    assert_eq!(bob.held["ann"].0, pb::State::Online);
    let mut operator = Viewer::open_request(
        &mut client,
        service(pb::WatchRequest { user_ids: vec!["ann".into(), "op-sentinel".into()], ..Default::default() }),
    )
    .await;

    let erased = erase(&mut client, "ann").await;
    assert_eq!(
        erased,
        pb::EraseUserResponse {
            sessions_revoked: 2,
            rooms_left: 2,
            went_offline: true,
            status_removed: true,
            visibility_removed: true,
            audience_removed: 2,
            removed_from_audiences: 1,
            groups_left: 1,
            settings_removed: 2,
            activity_removed: true,
            presence_forgotten: true,
        }
    );
    let offline = operator.until_state("ann", pb::State::Offline).await;
    assert_eq!((offline.status, offline.last_seen_ms), (None, 0), "the OFFLINE carries nothing of her");
    let hidden = bob.until_state("ann", pb::State::Offline).await;
    assert_eq!(
        shape(&hidden),
        shape(&pb::UserPresence { version: hidden.version, state: pb::State::Offline as i32, ..Default::default() })
    );
    operator.barrier_with(&mut client, "op-sentinel", Some(SERVICE)).await;
    assert_eq!(operator.updates_of("ann").len(), 1, "one change for two sessions and a status: {:?}", operator.updates);

    assert_reads_as_never_seen(&mut client, "ann", "never-seen").await;
    assert_eq!(room_shape(&mut client, "doc").await, room_shape(&mut client, "control").await, "doc without ann");
    assert!(export(&mut client, "dan").await.audience == ["bob"], "dan's audience lost ann, kept bob");
    let erin = export(&mut client, "erin").await;
    assert_eq!(erin.groups, ["team"], "erin stays in the team");
    assert!(export(&mut client, "bob").await.in_audience_of == ["dan"], "bob is still in dan's audience");
    // Idempotent: a second erase, and an erase of a user never seen, remove nothing.
    assert_eq!(erase(&mut client, "ann").await, pb::EraseUserResponse::default());
    assert_eq!(erase(&mut client, "never-seen").await, pb::EraseUserResponse::default());

    // A restart on the data directory brings nothing back.
    let addr = server.addr;
    server.stop().await;
    let server = TestServer::start_on(addr, disk_config(&dir)).await;
    let mut client = server.client().await;
    assert_reads_as_never_seen(&mut client, "ann", "never-seen").await;
    assert_eq!(export(&mut client, "dan").await.audience, ["bob"]);
    assert_eq!(export(&mut client, "erin").await.groups, ["team"]);
    server.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A crash after an erase loses the checkpoints written since: the restart
/// loads one that still holds the user's sessions, and forgets the user again.
#[tokio::test]
async fn p7_a_crash_after_an_erase_restores_an_older_checkpoint_without_the_user() {
    let dir = scratch_dir("erase-crash");
    let data_dir = dir.to_str().unwrap();
    // Only the final checkpoint of a graceful stop is written.
    let args = [
        "--data-dir",
        data_dir,
        "--service-token",
        SERVICE,
        "--viewer-jwt-hs256-secret",
        SECRET,
        "--checkpoint-interval-ms",
        "3600000",
    ];
    let daemon = Daemon::start(&args, &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    populate(&mut client, "ann", "dan", "erin").await;
    daemon.stop().await; // the checkpoint holds ann's two sessions

    let daemon = Daemon::start(&args, &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    assert_eq!(export(&mut client, "ann").await.presence.unwrap().state, pb::State::Online as i32, "restored");
    let erased = erase(&mut client, "ann").await;
    assert!(erased.presence_forgotten && erased.sessions_revoked == 2, "{erased:?}");
    daemon.kill9();

    let daemon = Daemon::start(&args, &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    assert_reads_as_never_seen(&mut client, "ann", "never-seen").await;
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}

#[tokio::test]
async fn p7_export_and_erase_name_a_bad_user_id_and_are_for_services_only() {
    let server = TestServer::start(auth::secured_config()).await;
    let mut client = server.client().await;
    for user_id in [String::new(), "x".repeat(129)] {
        let refused =
            client.export_user(service(pb::ExportUserRequest { user_id: user_id.clone() })).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(refused.message().starts_with("user_id"), "{refused:?}");
        let refused = client.erase_user(service(pb::EraseUserRequest { user_id })).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(refused.message().starts_with("user_id"), "{refused:?}");
    }
    let viewer = viewer_token("ann", false);
    let export = client.export_user(with_token(pb::ExportUserRequest { user_id: "ann".into() }, Some(&viewer)));
    assert_eq!(export.await.unwrap_err().code(), Code::PermissionDenied, "not even one's own");
    let erase = client.erase_user(with_token(pb::EraseUserRequest { user_id: "ann".into() }, Some(&viewer)));
    assert_eq!(erase.await.unwrap_err().code(), Code::PermissionDenied);
    let erase = client.erase_user(with_token(pb::EraseUserRequest { user_id: "ann".into() }, None));
    assert_eq!(erase.await.unwrap_err().code(), Code::Unauthenticated);
    server.stop().await;
}
