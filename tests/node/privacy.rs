//! P1 to P5 and S1 over real gRPC: credentials and roles, hidden equals never
//! seen (byte for byte), live audience changes on open streams, status and
//! coarse last seen, and relations that survive kill -9.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::common::auth::{self, SECRET, SERVICE, viewer_token};
use crate::common::daemon::{Daemon, scratch_dir};
use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::ServerConfig;
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

fn secured_config() -> ServerConfig {
    let mut config = auth::secured_config();
    config.last_seen_granularity = Duration::from_secs(300);
    config
}

fn service<T>(message: T) -> tonic::Request<T> {
    with_token(message, Some(SERVICE))
}

fn watch_as(token: &str, users: &[&str], viewer_id: &str) -> tonic::Request<pb::WatchRequest> {
    let request = pb::WatchRequest {
        user_ids: users.iter().map(|u| u.to_string()).collect(),
        viewer_id: viewer_id.into(),
        ..Default::default()
    };
    with_token(request, Some(token))
}

async fn snapshot_as(
    client: &mut PresenceClient<Channel>,
    token: &str,
    users: &[&str],
    viewer_id: &str,
) -> Vec<pb::UserPresence> {
    let request =
        pb::SnapshotRequest { user_ids: users.iter().map(|u| u.to_string()).collect(), viewer_id: viewer_id.into() };
    client.snapshot(with_token(request, Some(token))).await.expect("snapshot").into_inner().users
}

fn status(availability: pb::Availability, text: &str, expires_at_ms: i64) -> pb::Status {
    pb::Status { availability: availability as i32, text: text.into(), expires_at_ms }
}

async fn set_status(client: &mut PresenceClient<Channel>, user: &str, status: Option<pb::Status>) {
    client.set_status(service(pb::SetStatusRequest { user_id: user.into(), status })).await.expect("set status");
}

async fn set_visibility(client: &mut PresenceClient<Channel>, token: &str, user: &str, visibility: pb::Visibility) {
    let request =
        pb::SetVisibilityRequest { user_id: user.into(), visibility: visibility as i32, ..Default::default() };
    client.set_visibility(with_token(request, Some(token))).await.expect("set visibility");
}

async fn grant(client: &mut PresenceClient<Channel>, user: &str, viewers: &[&str], grant: bool) {
    let request =
        pb::AudienceRequest { user_id: user.into(), viewer_ids: viewers.iter().map(|v| v.to_string()).collect() };
    if grant {
        client.grant_audience(service(request)).await.expect("grant");
    } else {
        client.revoke_audience(service(request)).await.expect("revoke");
    }
}

async fn group(client: &mut PresenceClient<Channel>, group: &str, users: &[&str], join: bool) {
    let request = pb::GroupRequest { group_id: group.into(), user_ids: users.iter().map(|u| u.to_string()).collect() };
    if join {
        client.join_group(service(request)).await.expect("join");
    } else {
        client.leave_group(service(request)).await.expect("leave");
    }
}

async fn online(client: &mut PresenceClient<Channel>, user: &str, session: &str) -> u64 {
    client.register(service(register(user, session, "gw", 60_000))).await.unwrap().into_inner().generation
}

async fn offline(client: &mut PresenceClient<Channel>, user: &str, session: &str, generation: u64) {
    client.unregister(service(unregister(user, session, generation, 0))).await.unwrap();
}

/// The bytes of an entry with its user id blanked: what it reveals besides the id.
fn shape(presence: &pb::UserPresence) -> Vec<u8> {
    pb::UserPresence { user_id: String::new(), ..presence.clone() }.encode_to_vec()
}

#[tokio::test]
async fn p3_hidden_users_are_answered_byte_for_byte_as_users_never_seen() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let viewer = viewer_token("viewer", false);
    // (a) invisible, online, with a status; (b) online, in no relation to the viewer; (c) never seen.
    set_visibility(&mut client, SERVICE, "invisible", pb::Visibility::Nobody).await;
    let mut generations = [online(&mut client, "invisible", "s").await, online(&mut client, "stranger", "s").await];
    set_status(&mut client, "invisible", Some(status(pb::Availability::DoNotDisturb, "busy", 0))).await;
    let users = ["invisible", "stranger", "nobody-ever", "viewer"];
    let mut watching = Viewer::open_request(&mut client, watch_as(&viewer, &users, "")).await;

    for round in 0..5 {
        let snapshot = snapshot_as(&mut client, &viewer, &users, "").await;
        let never_seen = shape(&snapshot[2]);
        assert_eq!(shape(&snapshot[0]), never_seen, "round {round}: invisible user");
        assert_eq!(shape(&snapshot[1]), never_seen, "round {round}: stranger");
        assert_eq!(
            snapshot[2],
            pb::UserPresence { user_id: "nobody-ever".into(), state: pb::State::Offline as i32, ..Default::default() }
        );
        // They flip, change status and are active, over and over.
        for (index, user) in ["invisible", "stranger"].into_iter().enumerate() {
            offline(&mut client, user, "s", generations[index]).await;
            client.touch(service(pb::TouchRequest { user_id: user.into() })).await.unwrap();
            set_status(&mut client, user, Some(status(pb::Availability::Away, &format!("round {round}"), 0))).await;
            generations[index] = online(&mut client, user, "s").await;
        }
    }
    // The Watch snapshot said the same, and not one update about them reached the viewer.
    let opening: Vec<Vec<u8>> = ["invisible", "stranger", "nobody-ever"]
        .iter()
        .map(|user| {
            let (state, version) = watching.held[*user];
            shape(&pb::UserPresence { user_id: String::new(), state: state as i32, version, ..Default::default() })
        })
        .collect();
    assert!(opening.iter().all(|entry| *entry == opening[2]));
    watching.barrier_with(&mut client, "viewer", Some(SERVICE)).await;
    let leaked: Vec<_> = watching.updates.iter().filter(|u| u.user_id != "viewer").collect();
    assert!(leaked.is_empty(), "updates about hidden users reached the viewer: {leaked:?}");

    // Once granted, the same viewer sees the stranger as it is, on the open stream and in snapshots.
    grant(&mut client, "stranger", &["viewer"], true).await;
    let revealed = watching.until_update_of("stranger").await;
    assert_eq!(state_of(&revealed), pb::State::Online);
    assert_eq!(revealed.status.as_ref().map(|s| s.text.as_str()), Some("round 4"));
    let snapshot = snapshot_as(&mut client, &viewer, &users, "").await;
    assert_eq!(state_of(&snapshot[1]), pb::State::Online);
    assert!(snapshot[1].version > 0);
    assert_eq!(shape(&snapshot[0]), shape(&snapshot[2]), "the invisible user stays hidden");
    server.stop().await;
}

#[tokio::test]
async fn p4_grants_groups_and_visibility_change_open_streams_at_once_both_ways() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let viewer = viewer_token("viewer", false);
    let owner = viewer_token("alice", false);
    let mut generation = online(&mut client, "alice", "s").await;
    let mut watching = Viewer::open_request(&mut client, watch_as(&viewer, &["alice", "viewer"], "")).await;
    assert_eq!(watching.held["alice"], (pb::State::Offline, 0), "hidden at first (default visibility: audience)");

    // Grant, then revoke.
    grant(&mut client, "alice", &["viewer"], true).await;
    let shown = watching.until_update_of("alice").await;
    assert_eq!(state_of(&shown), pb::State::Online);
    grant(&mut client, "alice", &["viewer"], false).await;
    let hidden = watching.until_update_of("alice").await;
    assert_eq!(state_of(&hidden), pb::State::Offline);
    assert!(hidden.version > shown.version, "an ordinary update the viewer accepts");
    assert_eq!(
        shape(&hidden),
        shape(&pb::UserPresence { version: hidden.version, state: pb::State::Offline as i32, ..Default::default() })
    );
    // Hidden now: her flips do not reach the viewer.
    offline(&mut client, "alice", "s", generation).await;
    generation = online(&mut client, "alice", "s").await;
    watching.barrier_with(&mut client, "viewer", Some(SERVICE)).await;
    assert_eq!(watching.updates_of("alice").len(), 2, "nothing after the revoke");

    // A shared group, then leaving it.
    group(&mut client, "team", &["alice", "viewer"], true).await;
    assert_eq!(state_of(&watching.until_update_of("alice").await), pb::State::Online);
    group(&mut client, "team", &["viewer"], false).await;
    assert_eq!(state_of(&watching.until_update_of("alice").await), pb::State::Offline);

    // Visibility, set by alice herself: granted back, then invisible, then everyone.
    grant(&mut client, "alice", &["viewer"], true).await;
    assert_eq!(state_of(&watching.until_update_of("alice").await), pb::State::Online);
    set_visibility(&mut client, &owner, "alice", pb::Visibility::Nobody).await;
    assert_eq!(state_of(&watching.until_update_of("alice").await), pb::State::Offline);
    grant(&mut client, "alice", &["viewer"], false).await;
    set_visibility(&mut client, &owner, "alice", pb::Visibility::Everyone).await;
    assert_eq!(state_of(&watching.until_update_of("alice").await), pb::State::Online);
    offline(&mut client, "alice", "s", generation).await;
    assert_eq!(state_of(&watching.until_update_of("alice").await), pb::State::Offline, "visible flips flow again");
    server.stop().await;
}

#[tokio::test]
async fn p1_each_credential_case_gets_its_answer() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let snapshot_with = |token: Option<&str>| {
        with_token(pb::SnapshotRequest { user_ids: vec!["u".into()], ..Default::default() }, token)
    };

    let none = client.snapshot(snapshot_with(None)).await.unwrap_err();
    assert_eq!(none.code(), Code::Unauthenticated);
    let mut malformed = tonic::Request::new(pb::SnapshotRequest { user_ids: vec!["u".into()], ..Default::default() });
    malformed.metadata_mut().insert("authorization", "Basic dXNlcjpwYXNz".parse().unwrap());
    assert_eq!(client.snapshot(malformed).await.unwrap_err().code(), Code::Unauthenticated);
    let forged = {
        let claims = serde_json::json!({ "sub": "viewer", "exp": auth::unix_secs() + 60 });
        let key = jsonwebtoken::EncodingKey::from_secret(b"another-secret-another-secret-another").unwrap();
        jsonwebtoken::encode(&jsonwebtoken::Header::default(), &claims, &key).unwrap()
    };
    assert_eq!(client.snapshot(snapshot_with(Some(&forged))).await.unwrap_err().code(), Code::Unauthenticated);
    let expired = viewer_token("viewer", true);
    assert_eq!(client.snapshot(snapshot_with(Some(&expired))).await.unwrap_err().code(), Code::Unauthenticated);

    // A viewer may not touch leases, others' settings or relations.
    let viewer = viewer_token("viewer", false);
    let refused = client.register(with_token(register("viewer", "s", "gw", 0), Some(&viewer))).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied);
    let request = pb::SetVisibilityRequest {
        user_id: "alice".into(),
        visibility: pb::Visibility::Nobody as i32,
        ..Default::default()
    };
    assert_eq!(
        client.set_visibility(with_token(request, Some(&viewer))).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    let request = pb::AudienceRequest { user_id: "viewer".into(), viewer_ids: vec!["x".into()] };
    assert_eq!(
        client.grant_audience(with_token(request, Some(&viewer))).await.unwrap_err().code(),
        Code::PermissionDenied
    );
    // ... but may set its own status and visibility.
    let own = pb::SetStatusRequest { user_id: "viewer".into(), status: Some(status(pb::Availability::Away, "", 0)) };
    client.set_status(with_token(own, Some(&viewer))).await.expect("own status");

    // A viewer naming another viewer_id is still itself; a service naming one acts for it.
    online(&mut client, "alice", "s").await;
    grant(&mut client, "alice", &["bob"], true).await;
    let as_viewer = snapshot_as(&mut client, &viewer, &["alice"], "bob").await;
    assert_eq!(
        (state_of(&as_viewer[0]), as_viewer[0].version),
        (pb::State::Offline, 0),
        "viewer_id is ignored for viewers"
    );
    let for_bob = snapshot_as(&mut client, SERVICE, &["alice"], "bob").await;
    assert_eq!(state_of(&for_bob[0]), pb::State::Online);
    let for_carol = snapshot_as(&mut client, SERVICE, &["alice"], "carol").await;
    assert_eq!(state_of(&for_carol[0]), pb::State::Offline);
    let for_nobody = snapshot_as(&mut client, SERVICE, &["alice"], "").await;
    assert_eq!(state_of(&for_nobody[0]), pb::State::Online, "a service acting for no viewer sees everyone");
    server.stop().await;
}

#[tokio::test]
async fn s1_status_travels_expires_through_the_wheel_and_is_validated() {
    let mut config = secured_config();
    config.default_visibility = presence_server::privacy::Visibility::Everyone;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let viewer = viewer_token("viewer", false);
    let mut watching = Viewer::open_request(&mut client, watch_as(&viewer, &["alice"], "")).await;
    let soon = SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64 + 300;
    set_status(&mut client, "alice", Some(status(pb::Availability::DoNotDisturb, "deep work", soon))).await;
    let set = watching.until_update_of("alice").await;
    assert_eq!(
        set.status.as_ref().map(|s| (s.availability, s.text.as_str())),
        Some((pb::Availability::DoNotDisturb as i32, "deep work"))
    );
    let cleared = watching.until_update_of("alice").await;
    assert_eq!(cleared.status, None, "expired through the wheel");
    assert!(cleared.version > set.version);

    for (text, field) in [("x".repeat(129), "status.text"), ("two\nlines".into(), "status.text")] {
        let request =
            pb::SetStatusRequest { user_id: "alice".into(), status: Some(status(pb::Availability::Away, &text, 0)) };
        let refused = client.set_status(service(request)).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument);
        assert!(refused.message().starts_with(field), "{refused:?}");
    }
    let past = pb::SetStatusRequest { user_id: "alice".into(), status: Some(status(pb::Availability::Away, "", 1)) };
    assert!(client.set_status(service(past)).await.unwrap_err().message().contains("expires_at_ms"));
    let unspecified =
        pb::SetStatusRequest { user_id: "alice".into(), status: Some(status(pb::Availability::Unspecified, "", 0)) };
    assert!(client.set_status(service(unspecified)).await.unwrap_err().message().contains("availability"));
    server.stop().await;
}

#[tokio::test]
async fn p5_last_seen_is_coarse_and_only_for_offline_users_the_viewer_may_see() {
    let mut config = secured_config();
    config.default_visibility = presence_server::privacy::Visibility::Everyone;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let viewer = viewer_token("viewer", false);
    let touched = client.touch(service(pb::TouchRequest { user_id: "alice".into() })).await.unwrap().into_inner();
    let shown = snapshot_as(&mut client, &viewer, &["alice"], "").await;
    let granularity = 300_000;
    assert_eq!(shown[0].last_seen_ms, touched.last_active_at_ms - touched.last_active_at_ms % granularity);
    assert_eq!(shown[0].last_active_at_ms, 0, "viewers never get the exact time");
    let generation = online(&mut client, "alice", "s").await;
    assert_eq!(snapshot_as(&mut client, &viewer, &["alice"], "").await[0].last_seen_ms, 0, "online: no last seen");
    let mut watching = Viewer::open_request(&mut client, watch_as(&viewer, &["alice"], "")).await;
    offline(&mut client, "alice", "s", generation).await;
    let update = watching.until_update_of("alice").await;
    assert_eq!(update.last_seen_ms, shown[0].last_seen_ms, "updates carry it too");
    set_visibility(&mut client, SERVICE, "alice", pb::Visibility::Nobody).await;
    assert_eq!(snapshot_as(&mut client, &viewer, &["alice"], "").await[0].last_seen_ms, 0, "hidden: no timestamps");
    server.stop().await;
}

#[tokio::test]
async fn b4_relations_and_statuses_acknowledged_before_kill_9_survive_it() {
    let dir = scratch_dir("privacy-durable");
    let data_dir = dir.to_str().unwrap();
    let args = ["--data-dir", data_dir, "--service-token", SERVICE, "--viewer-jwt-hs256-secret", SECRET];
    let daemon = Daemon::start(&args, &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    set_visibility(&mut client, SERVICE, "ghost", pb::Visibility::Nobody).await;
    grant(&mut client, "alice", &["viewer"], true).await;
    group(&mut client, "team", &["bob", "viewer"], true).await;
    set_status(&mut client, "alice", Some(status(pb::Availability::Away, "lunch", 0))).await;
    for user in ["ghost", "alice", "bob", "carol"] {
        online(&mut client, user, "s").await;
    }
    daemon.kill9();

    let daemon = Daemon::start(&args, &[]);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    for user in ["ghost", "alice", "bob", "carol"] {
        online(&mut client, user, "s").await; // the gateways re-register what the crash lost
    }
    let viewer = viewer_token("viewer", false);
    let shown = snapshot_as(&mut client, &viewer, &["ghost", "alice", "bob", "carol"], "").await;
    let states: Vec<pb::State> = shown.iter().map(state_of).collect();
    assert_eq!(states, [pb::State::Offline, pb::State::Online, pb::State::Online, pb::State::Offline]);
    assert_eq!(shown[1].status.as_ref().map(|s| s.text.as_str()), Some("lunch"));
    daemon.stop().await;
    std::fs::remove_dir_all(&dir).unwrap();
}
