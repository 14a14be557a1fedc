//! The change feed's consumer against a real server: a consumer dropped
//! mid-stream resumes from its cursor file and sees each committed event
//! once and only its uncommitted batch again; it reopens after the server
//! restarts; a cursor past retention comes back as OUT_OF_RANGE with the
//! oldest cursor, which it resumes from; a token provider carries it across
//! a credential's rotation.

// Protobuf messages gain fields as the API grows: every literal of one ends in
// `..Default::default()`, so that it keeps compiling, even where it names every field today.
#![allow(clippy::needless_update)]

mod common;

use std::collections::HashSet;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{PATIENCE, TestServer, fast_config, register, unregister, within};
use presence_client::pb::change_event::Event;
use presence_client::pb::presence_client::PresenceClient;
use presence_client::{
    Backoff, ChangeBatch, ChangesConfig, ChangesConsumer, ChangesError, CursorStore, FileCursorStore,
    MemoryCursorStore, TokenProvider, pb,
};
use tonic::transport::Channel;

fn scratch_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("presence-client-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Reopens quick enough for tests, and small batches, so that a few hundred flips make several.
fn config(max_batch: usize) -> ChangesConfig {
    ChangesConfig {
        reconnect: Backoff { initial: Duration::from_millis(20), max: Duration::from_millis(200), factor: 2.0 },
        max_batch,
    }
}

fn flips_from(from: pb::ChangesFrom) -> pb::ChangesRequest {
    pb::ChangesRequest { from: from as i32, kinds: vec![pb::ChangeKind::Flip as i32], ..Default::default() }
}

/// The user and state of a flip.
fn flip(event: &pb::ChangeEvent) -> (String, i32) {
    match &event.event {
        Some(Event::Flip(user)) => (user.user_id.clone(), user.state),
        other => panic!("a flip, not {other:?}"),
    }
}

/// The next batch, within the patience.
async fn next<S: CursorStore>(consumer: &mut ChangesConsumer<S>, what: &str) -> ChangeBatch {
    within(PATIENCE, what, consumer.next_batch()).await.unwrap_or_else(|err| panic!("{what}: {err}"))
}

/// Batches, each committed, until one holds `last`'s flip to `state`.
async fn until_flip_of<S: CursorStore>(
    consumer: &mut ChangesConsumer<S>,
    last: &str,
    state: pb::State,
) -> Vec<pb::ChangeEvent> {
    let mut events = Vec::new();
    while !events.iter().any(|event| flip(event) == (last.to_owned(), state as i32)) {
        events.extend(next(consumer, last).await.events);
        consumer.commit().await.unwrap();
    }
    events
}

/// Each of `users` ONLINE then OFFLINE, one call at a time.
async fn flip_on_and_off(mut client: PresenceClient<Channel>, users: Vec<String>) {
    for user in users {
        let generation = client.register(register(&user, "s", 60_000)).await.unwrap().into_inner().generation;
        client.unregister(unregister(&user, "s", generation)).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_a_consumer_dropped_mid_stream_resumes_from_its_file_seeing_committed_events_once_and_its_uncommitted_batch_again()
 {
    let server = TestServer::start(fast_config()).await;
    let client = server.client().await;
    let dir = scratch_dir("changes-resume");
    let cursor_file = dir.join("cursor");

    let store = FileCursorStore::new(&cursor_file);
    let mut first =
        ChangesConsumer::open(client.clone(), flips_from(pb::ChangesFrom::Oldest), store, config(25)).await.unwrap();
    // 200 users flip on and off (400 flips), then a sentinel comes online,
    // while the first consumer reads.
    let users: Vec<String> = (0..200).map(|i| format!("user-{i:03}")).collect();
    let flips = tokio::spawn(flip_on_and_off(client.clone(), users));
    let mut committed = Vec::new();
    while committed.len() < 150 {
        let batch = next(&mut first, "the first consumer's batches").await;
        assert!(batch.events.len() <= 25, "at most max_batch events: {}", batch.events.len());
        assert_eq!(batch.cursor, batch.events.last().unwrap().cursor, "a batch resumes after its last event");
        committed.extend(batch.events);
        first.commit().await.unwrap();
    }
    assert_eq!(
        FileCursorStore::new(&cursor_file).load().await.unwrap().as_deref(),
        Some(committed.last().unwrap().cursor.as_slice()),
        "the file holds the last committed cursor"
    );
    // One more batch is handed out, processed perhaps, and not committed: the consumer dies.
    let uncommitted = next(&mut first, "a batch never committed").await;
    // A handler that fails leaves its batch uncommitted: the next one is handed it again.
    let mut handed = Vec::new();
    let failed = first
        .run(|batch| {
            handed.push(batch.events[0].cursor.clone());
            async { Err(std::io::Error::other("the push service is down")) }
        })
        .await;
    assert!(matches!(failed, ChangesError::Handler(_)), "{failed}");
    assert_eq!(handed, [uncommitted.events[0].cursor.clone()], "the uncommitted batch again");
    drop(first);
    flips.await.unwrap();
    let mut client_after = client.clone();
    client_after.register(register("sentinel", "s", 60_000)).await.unwrap();

    let store = FileCursorStore::new(&cursor_file);
    let mut second =
        ChangesConsumer::open(client.clone(), flips_from(pb::ChangesFrom::Now), store, config(25)).await.unwrap();
    let resumed = until_flip_of(&mut second, "sentinel", pb::State::Online).await;

    // At least once, identified by cursor: the uncommitted batch again, then the rest.
    assert_eq!(resumed[..uncommitted.events.len()], uncommitted.events[..], "the uncommitted batch comes again first");
    let all: Vec<&pb::ChangeEvent> = committed.iter().chain(&resumed).collect();
    let cursors: HashSet<&[u8]> = all.iter().map(|event| event.cursor.as_slice()).collect();
    assert_eq!(cursors.len(), all.len(), "no committed event twice");
    assert!(all.windows(2).all(|pair| pair[0].cursor < pair[1].cursor), "in feed order");
    assert_eq!(all.len(), 401, "every flip: 200 users on and off, and the sentinel");
    for (i, pair) in all[..400].chunks(2).enumerate() {
        let user = format!("user-{i:03}");
        assert_eq!(
            [flip(pair[0]), flip(pair[1])],
            [(user.clone(), pb::State::Online as i32), (user, pb::State::Offline as i32)]
        );
    }
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_a_consumer_reopens_after_the_server_restarts_and_goes_on_after_its_cursor() {
    let dir = scratch_dir("changes-restart");
    let with_data_dir = || {
        let mut config = fast_config();
        config.data_dir = Some(dir.clone());
        config
    };
    let server = TestServer::start(with_data_dir()).await;
    let addr = server.addr;
    let store = MemoryCursorStore::new();
    let request = flips_from(pb::ChangesFrom::Oldest);
    let mut consumer =
        ChangesConsumer::open(server.client().await, request, store.clone(), config(1_000)).await.unwrap();
    let before: Vec<String> = (0..10).map(|i| format!("before-{i}")).collect();
    flip_on_and_off(server.client().await, before).await;
    let seen_before = until_flip_of(&mut consumer, "before-9", pb::State::Offline).await;
    assert_eq!(seen_before.len(), 20);

    server.stop().await;
    let server = TestServer::start_on(addr, with_data_dir()).await;
    let after: Vec<String> = (0..10).map(|i| format!("after-{i}")).collect();
    flip_on_and_off(server.client().await, after.clone()).await;
    let seen_after = until_flip_of(&mut consumer, "after-9", pb::State::Offline).await;

    let users: Vec<String> = seen_after.iter().map(|event| flip(event).0).collect();
    let expected: Vec<String> = after.iter().flat_map(|user| [user.clone(), user.clone()]).collect();
    assert_eq!(users, expected, "the new process's flips, each once, and nothing from before the restart again");
    assert!(seen_after[0].cursor > seen_before.last().unwrap().cursor);
    assert_eq!(store.cursor().as_deref(), Some(seen_after.last().unwrap().cursor.as_slice()));
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_a_cursor_past_retention_is_out_of_range_with_the_oldest_cursor_and_resume_from_goes_on_there() {
    let mut server_config = fast_config();
    server_config.feed_retention_bytes = Some(64 << 10);
    let server = TestServer::start(server_config).await;
    let mut client = server.client().await;
    let store = MemoryCursorStore::new();
    let request = pb::ChangesRequest::default(); // everything, from now
    let mut consumer =
        ChangesConsumer::open(client.clone(), request.clone(), store.clone(), config(1_000)).await.unwrap();
    client.register(register("first", "s", 60_000)).await.unwrap();
    until_flip_of(&mut consumer, "first", pb::State::Online).await;
    drop(consumer);
    // About 80 bytes a flip: 5,000 flips are far more than 64 KiB.
    let users: Vec<String> = (0..2_500).map(|i| format!("user-{i:04}")).collect();
    let registers = users.iter().map(|user| pb::lease_item::Op::Register(register(user, "s", 60_000)));
    let registered = leases(&mut client, registers.collect()).await;
    let unregisters = users.iter().zip(&registered).map(|(user, result)| match &result.result {
        Some(pb::lease_result::Result::Register(answer)) => {
            pb::lease_item::Op::Unregister(unregister(user, "s", answer.generation))
        }
        other => panic!("a register's answer, not {other:?}"),
    });
    leases(&mut client, unregisters.collect()).await;

    // Once they are all in the feed, retention has passed the stored cursor
    // for good: a consumer opened now (its stream is open once `open`
    // returns) sees a flip made after them.
    let sentinel = pb::ChangesRequest { id_prefix: "sentinel".into(), ..Default::default() };
    let mut settled =
        ChangesConsumer::open(client.clone(), sentinel, MemoryCursorStore::new(), config(1_000)).await.unwrap();
    client.register(register("sentinel", "s", 60_000)).await.unwrap();
    until_flip_of(&mut settled, "sentinel", pb::State::Online).await;

    let mut consumer = ChangesConsumer::open(client.clone(), request, store.clone(), config(1_000)).await.unwrap();
    let oldest = match within(PATIENCE, "the refusal", consumer.next_batch()).await {
        Err(ChangesError::OutOfRange { oldest_cursor, status }) => {
            assert!(status.message().starts_with("cursor: older than the oldest change"), "{status:?}");
            oldest_cursor
        }
        other => panic!("out of range, not {other:?}"),
    };
    // Not retried: asked again, the same answer.
    assert!(matches!(consumer.next_batch().await, Err(ChangesError::OutOfRange { .. })));

    // The caller resyncs (a Snapshot), then resumes at the oldest change retained.
    consumer.resume_from(oldest.clone()).await.unwrap();
    assert_eq!(store.cursor(), Some(oldest.clone()), "the oldest cursor is the committed one now");
    let resumed = next(&mut consumer, "the feed from the oldest cursor").await;
    let everything_from_oldest = pb::ChangesRequest { from: pb::ChangesFrom::Oldest as i32, ..Default::default() };
    let raw = client.changes(everything_from_oldest).await.unwrap().into_inner().message().await;
    let from_oldest = raw.unwrap().unwrap();
    assert!(resumed.events[0].cursor > oldest, "resumes just after the oldest cursor");
    assert_eq!(resumed.events[0], from_oldest, "at the oldest change retained");
    server.stop().await;
}

/// One batch of lease items, every one answered: their results.
async fn leases(client: &mut PresenceClient<Channel>, ops: Vec<pb::lease_item::Op>) -> Vec<pb::LeaseResult> {
    let items = ops.into_iter().map(|op| pb::LeaseItem { op: Some(op) }).collect();
    let batch = pb::LeaseBatch { batch_id: 1, items };
    let mut results = client.leases(tokio_stream::iter([batch])).await.unwrap().into_inner();
    let results = results.message().await.unwrap().unwrap().results;
    assert!(results.iter().all(|result| result.code == 0), "every item answered");
    results
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn t3_a_consumer_with_a_token_provider_reopens_with_a_fresh_token_when_its_credential_is_removed() {
    use presence_server::{Scope, entry_for};
    let dir = scratch_dir("changes-tokens");
    let credentials = dir.join("credentials.toml");
    let gateway = entry_for("gw", &[Scope::Gateway], "test-only-token-of-the-gateway").unwrap();
    let old = entry_for("feed-old", &[Scope::Feed], "test-only-token-of-the-old-feed").unwrap();
    let new = entry_for("feed-new", &[Scope::Feed], "test-only-token-of-the-new-feed").unwrap();
    std::fs::write(&credentials, format!("{gateway}{old}")).unwrap();
    let mut server_config = fast_config();
    server_config.auth.credentials_file = Some(credentials.clone());
    let server = TestServer::start(server_config).await;

    let current = Arc::new(Mutex::new("test-only-token-of-the-old-feed".to_owned()));
    let asked = Arc::new(Mutex::new(0));
    let provider: TokenProvider = {
        let (current, asked) = (Arc::clone(&current), Arc::clone(&asked));
        Arc::new(move || {
            *asked.lock().unwrap() += 1;
            let token = current.lock().unwrap().clone();
            Box::pin(async move { Ok(token) })
        })
    };
    let request = flips_from(pb::ChangesFrom::Now);
    let client = server.client().await;
    let mut consumer = ChangesConsumer::open_with_token_provider(
        client.clone(),
        request,
        MemoryCursorStore::new(),
        config(1_000),
        provider,
    )
    .await
    .unwrap();
    let gateway_client = |user: &str| {
        let mut request = tonic::Request::new(register(user, "s", 60_000));
        request.metadata_mut().insert("authorization", "Bearer test-only-token-of-the-gateway".parse().unwrap());
        request
    };
    let mut writer = client.clone();
    writer.register(gateway_client("before")).await.unwrap();
    until_flip_of(&mut consumer, "before", pb::State::Online).await;

    // The credential rotates: the new token is what the provider gives from
    // now on, and the old one is removed, which ends the open stream; a flip
    // made once the consumer asked for the fresh token comes on the new one.
    *current.lock().unwrap() = "test-only-token-of-the-new-feed".to_owned();
    let next_file = credentials.with_extension("next");
    std::fs::write(&next_file, format!("{gateway}{new}")).unwrap();
    std::fs::rename(&next_file, &credentials).unwrap();
    let flip_once_reopened = async {
        within(PATIENCE, "a fresh token asked for", async {
            while *asked.lock().unwrap() < 2 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        })
        .await;
        writer.register(gateway_client("after")).await.unwrap();
    };
    let (after, ()) = tokio::join!(until_flip_of(&mut consumer, "after", pb::State::Online), flip_once_reopened);
    assert_eq!(after.iter().map(|event| flip(event).0).collect::<Vec<_>>(), ["after"], "nothing missed, nothing twice");
    assert_eq!(*asked.lock().unwrap(), 2, "asked at the open and once when the old token was refused");
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}
