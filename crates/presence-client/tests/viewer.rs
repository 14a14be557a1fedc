//! The viewer side against a real server on port 0: a `Watcher` follows
//! changes and resyncs from a fresh snapshot after the server restarts.

// Protobuf messages gain fields as the API grows: every literal of one ends in
// `..Default::default()`, so that it keeps compiling, even where it names every field today.
#![allow(clippy::needless_update)]

mod common;

use std::time::Duration;

use common::{PATIENCE, TestServer, fast_config, register, state_of, within};
use presence_client::{Backoff, Watcher, WatcherEvent, pb};

fn held(watcher: &Watcher, user: &str) -> Option<pb::State> {
    watcher.store().get(user).map(state_of)
}

#[tokio::test]
async fn watcher_follows_changes_and_resyncs_after_a_server_restart() {
    let server = TestServer::start(fast_config()).await;
    let addr = server.addr;
    let mut client = server.client().await;
    client.register(register("w1", "s", 60_000)).await.unwrap();

    let reconnect = Backoff { initial: Duration::from_millis(20), max: Duration::from_millis(200), factor: 2.0 };
    let mut watcher = Watcher::open(client.clone(), vec!["w1".into(), "w2".into()], reconnect).await.unwrap();
    assert_eq!(watcher.store().len(), 2);
    assert_eq!(held(&watcher, "w1"), Some(pb::State::Online), "the opening snapshot");
    assert_eq!(held(&watcher, "w2"), Some(pb::State::Offline));

    client.register(register("w2", "s", 60_000)).await.unwrap();
    let event = within(PATIENCE, "w2 ONLINE", watcher.next()).await.unwrap();
    let WatcherEvent::Update(update) = event else { panic!("an update, got {event:?}") };
    assert_eq!((update.user_id.as_str(), state_of(&update)), ("w2", pb::State::Online));
    assert_eq!(held(&watcher, "w2"), Some(pb::State::Online));

    // The server restarts with nothing in memory; meanwhile w2 comes back on the new one.
    server.stop().await;
    let server = TestServer::start_on(addr, fast_config()).await;
    let mut client = server.client().await;
    let w2 = client.register(register("w2", "s", 60_000)).await.unwrap().into_inner();

    let event = within(PATIENCE, "a resync", watcher.next()).await.unwrap();
    assert_eq!(event, WatcherEvent::Resynced);
    assert_eq!(held(&watcher, "w1"), Some(pb::State::Offline), "w1's lease died with the old server");
    assert_eq!(held(&watcher, "w2"), Some(pb::State::Online));
    assert_eq!(watcher.store().get("w2").unwrap().version, w2.presence.unwrap().version);

    // And it goes on following changes on the new stream.
    client.register(register("w1", "s", 60_000)).await.unwrap();
    let event = within(PATIENCE, "w1 ONLINE", watcher.next()).await.unwrap();
    let WatcherEvent::Update(update) = event else { panic!("an update, got {event:?}") };
    assert_eq!((update.user_id.as_str(), state_of(&update)), ("w1", pb::State::Online));
    assert!(watcher.last_error().is_none());
}

#[tokio::test]
async fn watcher_refused_for_bad_input_fails_to_open() {
    let server = TestServer::start(fast_config()).await;
    let refused = Watcher::open(server.client().await, vec![String::new()], Backoff::default()).await.unwrap_err();
    assert_eq!(refused.code(), tonic::Code::InvalidArgument, "{refused:?}");
}

#[tokio::test]
async fn a_batched_watcher_reports_each_update_of_a_batch_in_order() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let users: Vec<String> = (0..3).map(|i| format!("b{i}")).collect();
    // A window long enough that the three registers below land in one batch.
    let request = pb::WatchRequest { user_ids: users.clone(), batch_window_ms: 1_000, ..Default::default() };
    let mut watcher = Watcher::open_request(client.clone(), request, Backoff::default()).await.unwrap();
    for user in &users {
        client.register(register(user, "s", 60_000)).await.unwrap();
    }
    let mut reported = Vec::new();
    for _ in 0..3 {
        match within(PATIENCE, "a batched update", watcher.next()).await.unwrap() {
            WatcherEvent::Update(update) => {
                assert_eq!(state_of(&update), pb::State::Online);
                reported.push(update.user_id);
            }
            other => panic!("an update, got {other:?}"),
        }
    }
    assert_eq!(reported, users, "every update of the batch, in the order the users changed");
    assert!(users.iter().all(|user| held(&watcher, user) == Some(pb::State::Online)));
}

#[tokio::test]
async fn e7_e8_watcher_changes_its_users_in_place_and_resumes_with_the_versions_it_holds() {
    let server = TestServer::start(fast_config()).await;
    let addr = server.addr;
    let mut client = server.client().await;
    client.register(register("a", "s", 60_000)).await.unwrap();
    client.register(register("c", "s", 60_000)).await.unwrap();
    let reconnect = Backoff { initial: Duration::from_millis(20), max: Duration::from_millis(200), factor: 2.0 };
    let mut watcher = Watcher::open(client.clone(), vec!["a".into(), "b".into()], reconnect).await.unwrap();

    watcher.update(vec!["c".into()], vec!["b".into()]).await.unwrap();
    let event = within(PATIENCE, "c added", watcher.next()).await.unwrap();
    let WatcherEvent::Update(added) = event else { panic!("the added user, got {event:?}") };
    assert_eq!((added.user_id.as_str(), state_of(&added)), ("c", pb::State::Online));
    assert_eq!(watcher.user_ids(), ["a", "c"]);
    assert!(watcher.store().get("b").is_none(), "a removed user is forgotten");

    // The server restarts keeping nothing; c's lease goes with it, a comes back.
    server.stop().await;
    let server = TestServer::start_on(addr, fast_config()).await;
    let mut client = server.client().await;
    client.register(register("a", "s", 60_000)).await.unwrap();
    assert_eq!(within(PATIENCE, "a resync", watcher.next()).await.unwrap(), WatcherEvent::Resynced);
    assert_eq!(held(&watcher, "a"), Some(pb::State::Online), "a's new version differed: sent");
    assert_eq!(held(&watcher, "c"), Some(pb::State::Offline), "c's did: sent as it is now");
    assert!(watcher.store().get("b").is_none(), "the reopen watched the changed set");
    assert_eq!(watcher.store().len(), 2);
}
