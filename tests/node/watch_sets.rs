//! E7 and E8 over real gRPC: changing the users of an open Watch (only by the
//! caller that opened it, losing no change of the users that stay) and
//! resuming a Watch with the versions the viewer holds, which must tell a
//! viewer nothing about a hidden user that a user never seen would not.

use std::collections::HashMap;

use crate::common::auth;
use crate::common::auth::{SERVICE, secured_config};
use crate::common::*;
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, watch_event};
use prost::Message;
use tonic::Code;
use tonic::transport::Channel;

fn viewer_token(subject: &str) -> String {
    auth::viewer_token(subject, false)
}

fn ids(users: &[&str]) -> Vec<String> {
    users.iter().map(|u| u.to_string()).collect()
}

fn update(watch_id: &str, add: &[&str], remove: &[&str]) -> pb::UpdateWatchRequest {
    pb::UpdateWatchRequest {
        watch_id: watch_id.into(),
        add_user_ids: ids(add),
        remove_user_ids: ids(remove),
        ..Default::default()
    }
}

async fn online(client: &mut PresenceClient<Channel>, token: Option<&str>, user: &str) -> u64 {
    let request = with_token(register(user, "s", "gw", 60_000), token);
    client.register(request).await.expect("register").into_inner().generation
}

async fn offline(client: &mut PresenceClient<Channel>, token: Option<&str>, user: &str, generation: u64) {
    client.unregister(with_token(unregister(user, "s", generation, 0), token)).await.expect("unregister");
}

#[tokio::test]
async fn e7_update_watch_adds_users_with_their_presence_removes_others_and_loses_no_change_of_those_that_stay() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let mut gateway = server.client().await;
    let mut viewer = Viewer::open(&mut client, &["stays", "leaves", "sentinel"]).await;
    let joiner = online(&mut gateway, None, "joins").await;

    // The user that stays flips all the while the set changes around it.
    let churn = tokio::spawn(async move {
        let mut generation = online(&mut gateway, None, "stays").await;
        for _ in 0..50 {
            offline(&mut gateway, None, "stays", generation).await;
            generation = online(&mut gateway, None, "stays").await;
        }
        gateway
    });
    for round in 0..10 {
        let (add, remove) = if round % 2 == 0 { (["joins"], ["leaves"]) } else { (["leaves"], ["joins"]) };
        client.update_watch(update(&viewer.watch_id, &add, &remove)).await.expect("update watch");
    }
    let mut gateway = churn.await.unwrap();
    client.update_watch(update(&viewer.watch_id, &["joins"], &["leaves"])).await.expect("update watch");
    viewer.barrier_with(&mut client, "sentinel", None).await;

    // Every added event carried the user with its presence at that time.
    assert_eq!(viewer.added.len(), 11, "joins was added 6 times, leaves 5, each a real addition");
    assert!(viewer.added.iter().all(|users| users.len() == 1));
    assert_eq!(viewer.held["joins"], (pb::State::Online, snapshot(&mut client, &["joins"]).await[0].version));
    assert_eq!(viewer.resyncs, 0, "an added user is not a resync");
    // The user that stayed: after the barrier the viewer holds what the store
    // does, each update newer than the last (checked by `step`; conflation may merge some).
    let stays = &snapshot(&mut client, &["stays"]).await[0];
    assert_eq!(viewer.held["stays"], (state_of(stays), stays.version));
    assert!(viewer.updates_of("stays").len() > 1);

    // The removed user sends nothing more.
    let generation = online(&mut gateway, None, "leaves").await;
    offline(&mut gateway, None, "leaves", generation).await;
    offline(&mut gateway, None, "joins", joiner).await;
    assert_eq!(state_of(&viewer.until_update_of("joins").await), pb::State::Offline);
    viewer.barrier_with(&mut client, "sentinel", None).await;
    let after: Vec<_> = viewer.updates.iter().rev().take_while(|u| u.user_id != "joins").collect();
    assert!(after.iter().all(|u| u.user_id == "sentinel"), "a removed user's change arrived: {after:?}");
    server.stop().await;
}

#[tokio::test]
async fn e7_only_the_caller_that_opened_a_watch_can_change_it() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let (alice, bob) = (viewer_token("alice"), viewer_token("bob"));
    let request = pb::WatchRequest { user_ids: ids(&["alice"]), ..Default::default() };
    let mut watching = Viewer::open_request(&mut client, with_token(request, Some(&alice))).await;
    let watch_id = watching.watch_id.clone();

    let refused = |token: &str, viewer_id: &str| {
        let mut request = update(&watch_id, &["carol"], &[]);
        request.viewer_id = viewer_id.into();
        with_token(request, Some(token))
    };
    for (who, request) in [
        ("another viewer", refused(&bob, "")),
        ("another viewer naming the owner", refused(&bob, "alice")),
        ("a service acting for no viewer", refused(SERVICE, "")),
        ("a service acting for another viewer", refused(SERVICE, "bob")),
    ] {
        let status = client.update_watch(request).await.expect_err(who);
        assert_eq!(status.code(), Code::NotFound, "{who}: {status:?}");
    }
    let unknown = client.update_watch(with_token(update("no-such-watch", &["x"], &[]), Some(&alice))).await;
    let unknown = unknown.expect_err("unknown watch");
    assert_eq!(unknown.code(), Code::NotFound);
    assert_eq!(unknown.message(), refused_message(&client, &bob, &watch_id).await, "an unknown watch reads alike");

    // The owner, and a service acting for the owner, may.
    client.update_watch(with_token(update(&watch_id, &["carol"], &[]), Some(&alice))).await.expect("the owner");
    let mut for_alice = update(&watch_id, &["dave"], &[]);
    for_alice.viewer_id = "alice".into();
    client.update_watch(with_token(for_alice, Some(SERVICE))).await.expect("a service acting for the owner");
    watching.step().await;
    watching.step().await;
    assert_eq!(watching.added, [vec!["carol".to_string()], vec!["dave".to_string()]]);

    // A service's own watch (for no viewer) can be changed by any service caller, by no viewer.
    let request = pb::WatchRequest { user_ids: ids(&["alice"]), ..Default::default() };
    let service_watch = Viewer::open_request(&mut client, with_token(request, Some(SERVICE))).await;
    let by_viewer = client.update_watch(with_token(update(&service_watch.watch_id, &["x"], &[]), Some(&alice))).await;
    assert_eq!(by_viewer.expect_err("a viewer").code(), Code::NotFound);
    client
        .update_watch(with_token(update(&service_watch.watch_id, &["x"], &[]), Some(SERVICE)))
        .await
        .expect("any service caller");

    // A watch that ended can no longer be changed.
    drop(watching);
    let ended = within(PATIENCE, "the ended watch leaves", async {
        loop {
            match client.update_watch(with_token(update(&watch_id, &["e"], &[]), Some(&alice))).await {
                Err(status) if status.code() == Code::NotFound => break,
                _ => tokio::time::sleep(std::time::Duration::from_millis(10)).await,
            }
        }
    });
    ended.await;
    server.stop().await;
}

async fn refused_message(client: &PresenceClient<Channel>, token: &str, watch_id: &str) -> String {
    let mut client = client.clone();
    let status = client.update_watch(with_token(update(watch_id, &["x"], &[]), Some(token))).await.unwrap_err();
    status.message().replace(watch_id, "no-such-watch")
}

#[tokio::test]
async fn e7_an_added_hidden_user_looks_never_seen_and_none_of_its_changes_arrive() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let viewer = viewer_token("viewer");
    let generation = online(&mut client, Some(SERVICE), "stranger").await;
    let request = pb::WatchRequest { user_ids: ids(&["viewer"]), ..Default::default() };
    let mut watching = Viewer::open_request(&mut client, with_token(request, Some(&viewer))).await;
    client.update_watch(with_token(update(&watching.watch_id, &["stranger"], &[]), Some(&viewer))).await.unwrap();
    watching.step().await;
    assert_eq!(watching.held["stranger"], (pb::State::Offline, 0), "added as a user never seen");
    offline(&mut client, Some(SERVICE), "stranger", generation).await;
    online(&mut client, Some(SERVICE), "stranger").await;
    watching.barrier_with(&mut client, "viewer", Some(SERVICE)).await;
    assert!(watching.updates_of("stranger").is_empty(), "a hidden user's change reached the viewer");
    server.stop().await;
}

#[tokio::test]
async fn e7_update_watch_refuses_bad_ids_and_sets_past_the_limit_naming_the_field() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let viewer = Viewer::open(&mut client, &["a"]).await;
    let status = client.update_watch(update(&viewer.watch_id, &[""], &[])).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("add_user_ids"), "{status:?}");
    let status = client.update_watch(update(&viewer.watch_id, &[], &["x".repeat(129).as_str()])).await.unwrap_err();
    assert!(status.message().starts_with("remove_user_ids"), "{status:?}");
    let many: Vec<String> = (0..presence_server::MAX_USERS_PER_REQUEST).map(|i| format!("u{i}")).collect();
    let request =
        pb::UpdateWatchRequest { watch_id: viewer.watch_id.clone(), add_user_ids: many, ..Default::default() };
    let status = client.update_watch(request).await.unwrap_err();
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("add_user_ids: the watch would follow 10001 users"), "{status:?}");
    // The watch is still whole and working.
    client.update_watch(update(&viewer.watch_id, &["b"], &[])).await.expect("a valid update still works");
    server.stop().await;
}

/// Opens a watch with `known_versions` and returns its opening snapshot.
async fn resume(
    client: &mut PresenceClient<Channel>,
    token: Option<&str>,
    users: &[&str],
    known: &[(&str, u64)],
) -> pb::Snapshot {
    let request = pb::WatchRequest {
        user_ids: ids(users),
        known_versions: known.iter().map(|(user, version)| (user.to_string(), *version)).collect(),
        ..Default::default()
    };
    let mut stream = client.watch(with_token(request, token)).await.expect("open watch").into_inner();
    match stream.message().await.expect("healthy").expect("open").event {
        Some(watch_event::Event::Snapshot(snapshot)) => snapshot,
        other => panic!("a watch opens with a snapshot, got {other:?}"),
    }
}

#[tokio::test]
async fn e8_a_resumed_watch_opens_with_only_the_users_whose_version_differs_and_says_partial() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    online(&mut client, None, "a").await;
    online(&mut client, None, "b").await;
    let held: HashMap<String, u64> =
        snapshot(&mut client, &["a", "b", "c"]).await.into_iter().map(|p| (p.user_id, p.version)).collect();

    let nothing_changed =
        resume(&mut client, None, &["a", "b", "c"], &[("a", held["a"]), ("b", held["b"]), ("c", 0)]).await;
    assert!(nothing_changed.users.is_empty() && nothing_changed.partial, "{nothing_changed:?}");
    assert!(!nothing_changed.watch_id.is_empty());

    // b changed since; c is not in known_versions; "z" is not watched.
    let generation = snapshot(&mut client, &["b"]).await[0].version;
    assert_eq!(generation, held["b"]);
    let b_generation = client.register(register("b", "s", "gw", 60_000)).await.unwrap().into_inner().generation;
    offline(&mut client, None, "b", b_generation).await;
    let resumed = resume(&mut client, None, &["a", "b", "c"], &[("a", held["a"]), ("b", held["b"]), ("z", 7)]).await;
    let sent: Vec<&str> = resumed.users.iter().map(|p| p.user_id.as_str()).collect();
    assert_eq!(sent, ["b", "c"], "b differs, c was not known");
    assert!(resumed.partial);
    assert_eq!(state_of(&resumed.users[0]), pb::State::Offline);

    // Without known_versions, or when nothing is left out, the snapshot is whole.
    let whole = resume(&mut client, None, &["a", "b"], &[]).await;
    assert_eq!((whole.users.len(), whole.partial), (2, false));
    let all_differ = resume(&mut client, None, &["a"], &[("a", held["a"] + 1)]).await;
    assert_eq!((all_differ.users.len(), all_differ.partial), (1, false));

    let bad = pb::WatchRequest {
        user_ids: ids(&["a"]),
        known_versions: [(String::new(), 1)].into_iter().collect(),
        ..Default::default()
    };
    let status = client.watch(bad).await.expect_err("an empty key");
    assert_eq!(status.code(), Code::InvalidArgument);
    assert!(status.message().starts_with("known_versions"), "{status:?}");
    server.stop().await;
}

/// A snapshot's bytes with its user ids and watch id blanked: what it tells besides them.
fn shape(snapshot: &pb::Snapshot) -> Vec<u8> {
    let users = snapshot.users.iter().map(|p| pb::UserPresence { user_id: String::new(), ..p.clone() }).collect();
    pb::Snapshot { users, watch_id: String::new(), ..snapshot.clone() }.encode_to_vec()
}

#[tokio::test]
async fn e8_resume_answers_a_hidden_user_byte_for_byte_as_a_user_never_seen() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let viewer = viewer_token("viewer");
    // Online, with a real version, and hidden from the viewer (the default audience is empty).
    online(&mut client, Some(SERVICE), "hidden").await;
    let real = snapshot_of(&mut client, "hidden").await;
    assert!(real > 0);
    for known in [0, 1, real, real + 1] {
        let hidden = resume(&mut client, Some(&viewer), &["hidden"], &[("hidden", known)]).await;
        let never_seen = resume(&mut client, Some(&viewer), &["never-seen"], &[("never-seen", known)]).await;
        assert_eq!(shape(&hidden), shape(&never_seen), "known version {known}");
    }
    let hidden = resume(&mut client, Some(&viewer), &["hidden"], &[]).await;
    let never_seen = resume(&mut client, Some(&viewer), &["never-seen"], &[]).await;
    assert_eq!(shape(&hidden), shape(&never_seen), "no known version");
    server.stop().await;
}

async fn snapshot_of(client: &mut PresenceClient<Channel>, user: &str) -> u64 {
    let request = pb::SnapshotRequest { user_ids: ids(&[user]), ..Default::default() };
    client.snapshot(with_token(request, Some(SERVICE))).await.unwrap().into_inner().users[0].version
}
