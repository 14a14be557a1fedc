//! The change feed over gRPC (F1, F2): every flip once and in order across a
//! consumer's absence, nothing for renewals, retention refusing an old cursor
//! with the oldest one, filters, bad requests, and a kill -9 that leaves an
//! explicit gap rather than a silent hole.

// Protobuf literals end in `..Default::default()` so that they keep compiling as messages gain fields.
#![allow(clippy::needless_update)]

use std::collections::{BTreeMap, HashSet};
use std::time::Duration;

use crate::common::daemon::{Daemon, free_port, scratch_dir};
use crate::common::scrape::scrape_when;
use crate::common::*;
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, change_event::Event};
use prost::Message as _;
use tonic::Code;
use tonic::transport::Channel;

/// What a Changes stream carries: `kinds`, `id_prefix` and `slots`.
pub(super) type Filter<'a> = (Vec<pb::ChangeKind>, &'a str, Vec<u32>);

/// A Changes stream from `from` (and `cursor`), with `kinds`, `id_prefix` and `slots`.
pub(super) async fn changes(
    client: &mut PresenceClient<Channel>,
    from: pb::ChangesFrom,
    cursor: &[u8],
    filter: Filter<'_>,
) -> Result<tonic::Streaming<pb::ChangeEvent>, tonic::Status> {
    let (kinds, id_prefix, slots) = filter;
    let request = pb::ChangesRequest {
        from: from as i32,
        cursor: cursor.to_vec(),
        kinds: kinds.into_iter().map(|kind| kind as i32).collect(),
        id_prefix: id_prefix.to_owned(),
        slots,
    };
    client.changes(request).await.map(tonic::Response::into_inner)
}

pub(super) fn everything() -> Filter<'static> {
    (Vec::new(), "", Vec::new())
}

/// Events of `stream` (progress left out) until `done` says so, within the patience.
pub(super) async fn read_until(
    stream: &mut tonic::Streaming<pb::ChangeEvent>,
    what: &str,
    mut done: impl FnMut(&[pb::ChangeEvent]) -> bool,
) -> Vec<pb::ChangeEvent> {
    let mut events = Vec::new();
    within(PATIENCE, what, async {
        while !done(&events) {
            let event = stream.message().await.expect("a healthy feed").expect("an open feed");
            if !matches!(event.event, Some(Event::Progress(_))) {
                events.push(event);
            }
        }
    })
    .await;
    events
}

/// The flip of `event`, if it is one of a user.
pub(super) fn flip(event: &pb::ChangeEvent) -> Option<&pb::UserPresence> {
    match &event.event {
        Some(Event::Flip(user)) => Some(user),
        _ => None,
    }
}

fn unregister_item(user: &str, session: &str, generation: u64) -> pb::LeaseItem {
    pb::LeaseItem { op: Some(pb::lease_item::Op::Unregister(unregister(user, session, generation, 0))) }
}

/// Registers every user's one session (ONLINE flips), returning the generations.
pub(super) async fn register_users(client: &mut PresenceClient<Channel>, users: &[String]) -> Vec<u64> {
    let items = users.iter().map(|user| register_item(user, "s", 60_000)).collect();
    let results = lease_batch(client, items).await;
    results.iter().map(generation_of).collect()
}

/// Unregisters every user's session (OFFLINE flips).
pub(super) async fn unregister_users(client: &mut PresenceClient<Channel>, users: &[String], generations: &[u64]) {
    let items =
        users.iter().zip(generations).map(|(user, &generation)| unregister_item(user, "s", generation)).collect();
    let results = lease_batch(client, items).await;
    assert!(results.iter().all(|result| result.code == 0), "every unregister answered");
}

/// Checks a run of flips per user: versions strictly increase and states
/// alternate, ONLINE first. Returns each user's flips (state, version).
fn per_user(events: &[pb::ChangeEvent]) -> BTreeMap<String, Vec<(i32, u64)>> {
    let mut users: BTreeMap<String, Vec<(i32, u64)>> = BTreeMap::new();
    for user in events.iter().filter_map(flip) {
        let flips = users.entry(user.user_id.clone()).or_default();
        if let Some(&(state, version)) = flips.last() {
            assert!(user.version > version, "F1: {} went from version {version} to {}", user.user_id, user.version);
            assert_ne!(user.state, state, "F1: {} flipped to the state it had", user.user_id);
        }
        flips.push((user.state, user.version));
    }
    users
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_a_consumer_away_while_10000_flips_happen_resumes_from_its_cursor_and_gets_each_once_in_order() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let mut feed = changes(&mut client, pb::ChangesFrom::Now, b"", everything()).await.unwrap();
    register_users(&mut client, &["warm-up".to_owned()]).await;
    let seen = read_until(&mut feed, "the warm-up flip", |events| !events.is_empty()).await;
    let cursor = seen[0].cursor.clone();
    drop(feed);

    // Away for about 5 s: 1,000 users flip ONLINE and OFFLINE five times, and
    // renew in between, which changes nothing and must put nothing in the feed.
    let users: Vec<String> = (0..1_000).map(|i| format!("user-{i:04}")).collect();
    let started = std::time::Instant::now();
    for _ in 0..5 {
        let generations = register_users(&mut client, &users).await;
        let renewals = users.iter().zip(&generations).map(|(user, &generation)| renew_item(user, "s", generation));
        let renewed = lease_batch(&mut client, renewals.collect()).await;
        assert!(renewed.iter().all(|result| result.code == 0), "every renewal answered");
        tokio::time::sleep(Duration::from_millis(500)).await;
        unregister_users(&mut client, &users, &generations).await;
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert!(started.elapsed() >= Duration::from_secs(5));
    // A last flip after them all: once it arrives, everything before it has.
    register_users(&mut client, &["sentinel".to_owned()]).await;

    let mut feed = changes(&mut client, pb::ChangesFrom::Cursor, &cursor, everything()).await.unwrap();
    let events = read_until(&mut feed, "every flip and the sentinel", |events| {
        events.last().and_then(flip).is_some_and(|user| user.user_id == "sentinel")
    })
    .await;
    let flips: Vec<&pb::ChangeEvent> = events.iter().filter(|event| flip(event).is_some()).collect();
    assert_eq!(flips.len(), 10_001, "F1: every flip once, and nothing for the renewals");
    assert!(events.iter().all(|event| flip(event).is_some()), "only flips: {:?}", &events[..3]);
    let cursors: HashSet<&[u8]> = events.iter().map(|event| event.cursor.as_slice()).collect();
    assert_eq!(cursors.len(), events.len(), "no cursor twice");
    assert!(events.windows(2).all(|pair| pair[0].cursor < pair[1].cursor), "cursors in order");
    let by_user = per_user(&events);
    assert_eq!(by_user.len(), 1_001);
    let names: Vec<&str> = users.iter().map(String::as_str).collect();
    let now = snapshot(&mut client, &names).await;
    for presence in &now {
        let flips = &by_user[&presence.user_id];
        assert_eq!(flips.len(), 10, "F1: {}'s ten flips", presence.user_id);
        assert_eq!(flips[0].0, pb::State::Online as i32);
        assert_eq!(*flips.last().unwrap(), (presence.state, presence.version), "the feed ends where the store is");
    }
    server.stop().await;
}

/// The `ChangesOutOfRange` detail of a refusal.
fn oldest_cursor(status: &tonic::Status) -> Vec<u8> {
    let details = tonic_types::Status::decode(status.details()).expect("a google.rpc.Status in the details");
    let detail = details
        .details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/presence.v1.ChangesOutOfRange")
        .expect("a ChangesOutOfRange detail");
    pb::ChangesOutOfRange::decode(detail.value.as_slice()).unwrap().oldest_cursor
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_a_cursor_past_retention_is_out_of_range_with_the_oldest_cursor_which_resumes() {
    let mut config = fast_config();
    config.feed_retention_bytes = Some(64 << 10);
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let mut feed = changes(&mut client, pb::ChangesFrom::Now, b"", everything()).await.unwrap();
    register_users(&mut client, &["first".to_owned()]).await;
    let first = read_until(&mut feed, "the first flip", |events| !events.is_empty()).await[0].cursor.clone();
    drop(feed);
    // About 80 bytes a flip: 5,000 flips are far more than 64 KiB.
    let users: Vec<String> = (0..2_500).map(|i| format!("user-{i:04}")).collect();
    let generations = register_users(&mut client, &users).await;
    unregister_users(&mut client, &users, &generations).await;
    // Once a change made after them all is in the feed, so are they, and
    // retention has done its work.
    let mut tail = changes(&mut client, pb::ChangesFrom::Now, b"", everything()).await.unwrap();
    register_users(&mut client, &["last".to_owned()]).await;
    read_until(&mut tail, "the last flip", |events| events.last().and_then(flip).is_some_and(|u| u.user_id == "last"))
        .await;
    drop(tail);
    let refused = changes(&mut client, pb::ChangesFrom::Cursor, &first, everything()).await.unwrap_err();
    assert_eq!(refused.code(), Code::OutOfRange, "{}", refused.message());
    assert!(refused.message().starts_with("cursor: older than the oldest change"), "{}", refused.message());
    let oldest = oldest_cursor(&refused);
    let mut resumed = changes(&mut client, pb::ChangesFrom::Cursor, &oldest, everything()).await.unwrap();
    let mut from_oldest = changes(&mut client, pb::ChangesFrom::Oldest, b"", everything()).await.unwrap();
    let resumed = read_until(&mut resumed, "the resumed feed", |events| !events.is_empty()).await;
    let from_oldest = read_until(&mut from_oldest, "the feed from the oldest", |events| !events.is_empty()).await;
    assert!(resumed[0].cursor > oldest, "resumes just after the oldest cursor");
    assert_eq!(resumed[0], from_oldest[0], "CHANGES_FROM_OLDEST starts at the same change");
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f1_filters_by_kind_id_prefix_and_slots_split_the_feed_and_rooms_say_when_they_fill_and_empty() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let mut all = changes(&mut client, pb::ChangesFrom::Now, b"", everything()).await.unwrap();
    let statuses = (vec![pb::ChangeKind::Status], "", vec![]);
    let mut only_statuses = changes(&mut client, pb::ChangesFrom::Now, b"", statuses).await.unwrap();
    let mut only_rooms = changes(&mut client, pb::ChangesFrom::Now, b"", (vec![], "room-", vec![])).await.unwrap();
    let (low, high): (Vec<u32>, Vec<u32>) = (0..1024).partition(|slot| slot % 2 == 0);
    let mut evens = changes(&mut client, pb::ChangesFrom::Now, b"", (vec![], "", low)).await.unwrap();
    let mut odds = changes(&mut client, pb::ChangesFrom::Now, b"", (vec![], "", high)).await.unwrap();

    let users: Vec<String> = (0..50).map(|i| format!("user-{i}")).collect();
    let generations = register_users(&mut client, &users).await;
    let join = pb::JoinRequest {
        user_id: users[0].clone(),
        session_id: "s".into(),
        generation: generations[0],
        room_id: "room-1".into(),
        metadata: Default::default(),
    };
    client.join(join).await.unwrap();
    let status = pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), expires_at_ms: 0 };
    let set = pb::SetStatusRequest { user_id: users[1].clone(), status: Some(status) };
    client.set_status(set).await.unwrap();
    let leave = pb::LeaveRequest {
        user_id: users[0].clone(),
        session_id: "s".into(),
        generation: generations[0],
        room_id: "room-1".into(),
    };
    client.leave(leave).await.unwrap();
    register_users(&mut client, &["sentinel".to_owned()]).await;
    let sentinel = |events: &[pb::ChangeEvent]| events.last().and_then(flip).is_some_and(|u| u.user_id == "sentinel");
    let everything = read_until(&mut all, "everything", sentinel).await;
    assert_eq!(
        everything.len(),
        50 + 1 + 1 + 1 + 1,
        "50 flips, a room filled, a status, the room emptied, the sentinel"
    );

    let statuses = read_until(&mut only_statuses, "the status", |events| !events.is_empty()).await;
    match &statuses[0].event {
        Some(Event::Status(user)) => {
            assert_eq!((user.user_id.as_str(), user.status.as_ref().unwrap().text.as_str()), ("user-1", "lunch"))
        }
        other => panic!("a status change, not {other:?}"),
    }
    let rooms = read_until(&mut only_rooms, "the room filling and emptying", |events| events.len() == 2).await;
    let occupancy: Vec<(String, bool)> = rooms
        .iter()
        .map(|event| match &event.event {
            Some(Event::RoomOccupancy(room)) => (room.room_id.clone(), room.occupied),
            other => panic!("room occupancy, not {other:?}"),
        })
        .collect();
    assert_eq!(occupancy, [("room-1".to_owned(), true), ("room-1".to_owned(), false)]);

    // Two consumers of half the slots each: disjoint, and together everything.
    let mut union = Vec::new();
    for (stream, parity) in [(&mut evens, 0), (&mut odds, 1)] {
        let expected = everything.iter().filter(|event| event.slot % 2 == parity).count();
        assert!(expected > 0, "50 users fill both halves");
        let half = read_until(stream, "a half of the slots", |events| events.len() == expected).await;
        assert!(half.iter().all(|event| event.slot % 2 == parity), "F3: only the slots asked for");
        union.extend(half);
    }
    union.sort_by(|a, b| a.cursor.cmp(&b.cursor));
    assert_eq!(union, everything, "the two halves are disjoint and together the whole feed");
    server.stop().await;
}

#[tokio::test]
async fn f1_bad_changes_requests_are_refused_naming_the_field() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let cases: [(pb::ChangesFrom, &[u8], Filter<'_>, Code, &str); 5] = [
        (pb::ChangesFrom::Cursor, b"junk", everything(), Code::InvalidArgument, "cursor: a cursor is 13 bytes, not 4"),
        (pb::ChangesFrom::Cursor, b"", everything(), Code::InvalidArgument, "cursor: CHANGES_FROM_CURSOR needs"),
        (pb::ChangesFrom::Now, b"", (vec![], "", vec![1024]), Code::InvalidArgument, "slots: slot 1024 is not below"),
        (pb::ChangesFrom::Now, b"", (vec![], &"x".repeat(129), vec![]), Code::InvalidArgument, "id_prefix: at most"),
        (
            pb::ChangesFrom::Cursor,
            &[1, 0x7f, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0],
            everything(),
            Code::OutOfRange,
            "cursor: ahead of every change this feed holds",
        ),
    ];
    for (from, cursor, filter, code, message) in cases {
        let refused = changes(&mut client, from, cursor, filter).await.unwrap_err();
        assert_eq!(refused.code(), code, "{}", refused.message());
        assert!(refused.message().starts_with(message), "{:?} does not start with {message:?}", refused.message());
    }
    let bad_kind = pb::ChangesRequest { from: 1, kinds: vec![9], ..Default::default() };
    let refused = client.changes(bad_kind).await.unwrap_err();
    assert_eq!((refused.code(), refused.message()), (Code::InvalidArgument, "kinds: 9 is not a ChangeKind"));
    let mut config = fast_config();
    config.feed_retention_bytes = Some(0);
    let off = TestServer::start(config).await;
    let refused = changes(&mut off.client().await, pb::ChangesFrom::Now, b"", everything()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    assert!(refused.message().contains("--feed-retention-bytes 0"), "{}", refused.message());
    off.stop().await;
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f2_after_kill_9_mid_storm_every_synced_change_is_there_a_gap_marks_the_rest_and_versions_grow() {
    let dir = scratch_dir("feed-kill-9");
    let listen = format!("127.0.0.1:{}", free_port());
    let args = ["--data-dir", dir.to_str().unwrap(), "--checkpoint-interval-ms", "1000"];
    let daemon = Daemon::start_on(&listen, &args, &[], None);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    let mut feed = changes(&mut client, pb::ChangesFrom::Oldest, b"", everything()).await.unwrap();
    // The storm: 500 users flipping ONLINE and OFFLINE until the process dies.
    let storm = tokio::spawn({
        let mut client = client.clone();
        async move {
            let users: Vec<String> = (0..500).map(|i| format!("user-{i:03}")).collect();
            loop {
                let items = users.iter().map(|user| register_item(user, "s", 60_000)).collect();
                let batch = pb::LeaseBatch { batch_id: 1, items };
                let Ok(results) = client.leases(tokio_stream::iter([batch])).await else { return };
                let Ok(Some(results)) = results.into_inner().message().await else { return };
                let items = users
                    .iter()
                    .zip(&results.results)
                    .map(|(user, result)| unregister_item(user, "s", generation_of(result)))
                    .collect();
                let batch = pb::LeaseBatch { batch_id: 2, items };
                let Ok(results) = client.leases(tokio_stream::iter([batch])).await else { return };
                if results.into_inner().message().await.is_err() {
                    return;
                }
            }
        }
    });
    let before = read_until(&mut feed, "5,000 changes of the storm", |events| events.len() >= 5_000).await;
    daemon.kill9();
    let _ = storm.await;
    let last_cursor = before.last().unwrap().cursor.clone();
    let highest: BTreeMap<String, u64> =
        per_user(&before).into_iter().map(|(user, flips)| (user, flips.last().unwrap().1)).collect();

    let metrics = format!("127.0.0.1:{}", free_port());
    let restarted: Vec<&str> = args.iter().copied().chain(["--metrics-listen", metrics.as_str()]).collect();
    let daemon = Daemon::start_on(&listen, &restarted, &[], None);
    let mut client = PresenceClient::connect(daemon.url()).await.unwrap();
    // Everything a consumer was sent had been synced: a reader from the oldest finds it all, unchanged.
    let mut again = changes(&mut client, pb::ChangesFrom::Oldest, b"", everything()).await.unwrap();
    let replayed =
        read_until(&mut again, "the changes sent before the kill", |events| events.len() >= before.len()).await;
    assert_eq!(replayed[..before.len()], before[..], "F2: every change sent before the kill, as it was sent");
    // The consumer resumes from its cursor: what was synced after it, then the gap.
    let mut resumed = changes(&mut client, pb::ChangesFrom::Cursor, &last_cursor, everything()).await.unwrap();
    let after = read_until(&mut resumed, "the gap", |events| {
        events.last().is_some_and(|event| matches!(event.event, Some(Event::Gap(_))))
    })
    .await;
    let Some(Event::Gap(gap)) = &after.last().unwrap().event else { unreachable!() };
    assert_eq!(gap.reason, "restart");
    assert!(gap.after_cursor >= last_cursor, "the gap starts after what was synced");
    assert!(after[..after.len() - 1].iter().all(|event| flip(event).is_some()), "synced flips before the gap");
    scrape_when(&metrics, "presenced_feed_gaps_total{reason=\"restart\"}", 1.0).await;
    // M4: flips after the restart carry versions above any the feed held.
    let users: Vec<String> = highest.keys().take(20).cloned().collect();
    let names: Vec<&str> = users.iter().map(String::as_str).collect();
    for presence in snapshot(&mut client, &names).await {
        let request = if state_of(&presence) == pb::State::Online {
            let revoke = pb::RevokeRequest { user_id: presence.user_id.clone(), ..Default::default() };
            client.revoke(revoke).await.map(|_| ())
        } else {
            client.register(register(&presence.user_id, "s", "gw", 60_000)).await.map(|_| ())
        };
        request.unwrap();
    }
    let flipped = read_until(&mut resumed, "a flip of each of 20 users", |events| {
        events.iter().filter_map(flip).filter(|user| names.contains(&user.user_id.as_str())).count() >= 20
    })
    .await;
    for user in flipped.iter().filter_map(flip).filter(|user| names.contains(&user.user_id.as_str())) {
        assert!(
            user.version > highest[&user.user_id],
            "M4: {} at {} after {}",
            user.user_id,
            user.version,
            highest[&user.user_id]
        );
    }
    daemon.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}
