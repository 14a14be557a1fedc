//! Counts of many rooms (R7) over real gRPC: `RoomCounts`, and
//! `WatchRoomCounts` streams that open with every room, then send at most one
//! message per interval of only the rooms whose counts changed, change their
//! rooms on the open stream, keep to the cap, and count for each caller only
//! the rooms it may read (R4).

use std::collections::HashMap;
use std::time::{Duration, Instant};

use crate::common::auth::{SERVICE, secured_config, viewer_token};
use crate::common::*;
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb};
use tonic::Code;
use tonic::transport::Channel;

const CAP: usize = 10_000;

fn rooms(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

fn watch(room_ids: &[String], count_interval_ms: u32) -> pb::WatchRoomCountsRequest {
    pb::WatchRoomCountsRequest { room_ids: room_ids.to_vec(), count_interval_ms, ..Default::default() }
}

fn service<T>(message: T) -> tonic::Request<T> {
    with_token(message, Some(SERVICE))
}

/// Puts `user` (one session) online and in each of `rooms`.
async fn join_all(client: &mut PresenceClient<Channel>, token: Option<&str>, user: &str, rooms: &[&str]) -> u64 {
    let generation =
        client.register(with_token(register(user, "s", "gw", 60_000), token)).await.unwrap().into_inner().generation;
    for room in rooms {
        let join = pb::JoinRequest {
            user_id: user.into(),
            session_id: "s".into(),
            generation,
            room_id: (*room).into(),
            metadata: Default::default(),
        };
        client.join(with_token(join, token)).await.unwrap();
    }
    generation
}

/// A WatchRoomCounts stream and what it has sent, room by room.
struct CountStream {
    stream: tonic::Streaming<pb::RoomCounts>,
    watch_id: String,
    held: HashMap<String, pb::RoomCount>,
    /// When each message after the first came, and the rooms in it.
    messages: Vec<(Instant, Vec<String>)>,
}

impl CountStream {
    async fn open(client: &mut PresenceClient<Channel>, request: tonic::Request<pb::WatchRoomCountsRequest>) -> Self {
        let mut stream = client.watch_room_counts(request).await.expect("open WatchRoomCounts").into_inner();
        let first = within(PATIENCE, "the first counts", stream.message()).await.unwrap().expect("a first message");
        assert!(!first.watch_id.is_empty(), "the first message names the stream");
        let held = first.counts.into_iter().map(|count| (count.room_id.clone(), count)).collect();
        CountStream { stream, watch_id: first.watch_id, held, messages: Vec::new() }
    }

    async fn next(&mut self) -> Vec<pb::RoomCount> {
        let message =
            within(PATIENCE, "a counts message", self.stream.message()).await.expect("healthy").expect("open");
        assert!(message.watch_id.is_empty(), "only the first message names the stream");
        assert!(!message.counts.is_empty(), "a message with no count is never sent");
        self.messages.push((Instant::now(), message.counts.iter().map(|count| count.room_id.clone()).collect()));
        for count in &message.counts {
            self.held.insert(count.room_id.clone(), count.clone());
        }
        message.counts
    }

    /// Reads messages until `room` holds `users` users.
    async fn until(&mut self, room: &str, users: u32) {
        while self.held.get(room).map(|count| count.users) != Some(users) {
            self.next().await;
        }
    }

    fn users(&self, room: &str) -> (u32, u32) {
        let count = &self.held[room];
        (count.users, count.sessions)
    }

    async fn silent_for(&mut self, wait: Duration) -> bool {
        tokio::time::timeout(wait, self.stream.message()).await.is_err()
    }
}

#[tokio::test]
async fn r7_a_stream_opens_with_every_room_then_sends_only_changed_rooms_at_most_once_per_interval() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let watched = rooms("lobby-", 500);
    let mut stream = CountStream::open(&mut client, tonic::Request::new(watch(&watched, 200))).await;
    assert_eq!(stream.held.len(), 500, "every room in the first message");
    assert!(stream.held.values().all(|count| (count.version, count.users, count.sessions) == (0, 0, 0)));
    let stats = client.stats(pb::StatsRequest {}).await.unwrap().into_inner();
    assert_eq!((stats.room_count_streams, stats.room_watchers), (1, 0), "Stats counts the open stream apart");

    // Joins into five of the rooms for about a second.
    let mut gateway = server.client().await;
    let busy: Vec<String> = (0..5).map(|i| format!("lobby-{}", i * 97)).collect();
    let joining = busy.clone();
    let started = Instant::now();
    let churn = tokio::spawn(async move {
        for i in 0..100 {
            let room = joining[i % joining.len()].as_str();
            join_all(&mut gateway, None, &format!("u{i}"), &[room]).await;
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    });
    for room in &busy {
        stream.until(room, 20).await;
    }
    churn.await.unwrap();
    let elapsed = started.elapsed();
    let times: Vec<Instant> = stream.messages.iter().map(|(at, _)| *at).collect();
    assert!(times.windows(2).all(|w| w[1] - w[0] >= Duration::from_millis(150)), "at most one message per interval");
    assert!(times.len() as u128 <= elapsed.as_millis() / 200 + 1, "{} messages in {elapsed:?}", times.len());
    let sent: std::collections::HashSet<&String> = stream.messages.iter().flat_map(|(_, rooms)| rooms).collect();
    assert!(sent.iter().all(|room| busy.contains(room)), "only rooms whose counts changed: {} rooms sent", sent.len());
    for room in &busy {
        let count = &stream.held[room];
        assert_eq!((count.users, count.sessions), (20, 20));
        assert!(count.version > 0, "each count carries its room version");
    }
    // The batched read agrees, in request order, a room named twice answered twice.
    let asked = vec![busy[1].clone(), "lobby-1".into(), busy[1].clone()];
    let read = client.room_counts(pb::RoomCountsRequest { room_ids: asked.clone(), ..Default::default() });
    let read = read.await.unwrap().into_inner();
    let answered: Vec<(&str, u32)> = read.counts.iter().map(|count| (count.room_id.as_str(), count.users)).collect();
    assert_eq!(answered, [(asked[0].as_str(), 20), ("lobby-1", 0), (asked[2].as_str(), 20)]);
    assert_eq!(read.counts[0].version, stream.held[&busy[1]].version);
    // A change that leaves the counts as they were (new room metadata, a
    // signal) moves the room's version but sends nothing.
    let generation = join_all(&mut client, None, "mover", &["lobby-3"]).await;
    stream.until("lobby-3", 1).await;
    let version = client.room_counts(pb::RoomCountsRequest { room_ids: vec!["lobby-3".into()], ..Default::default() });
    let version = version.await.unwrap().into_inner().counts[0].version;
    let update = pb::JoinRequest {
        user_id: "mover".into(),
        session_id: "s".into(),
        generation,
        room_id: "lobby-3".into(),
        metadata: [("tab".to_string(), "two".to_string())].into(),
    };
    client.join(update).await.unwrap();
    let after = client.room_counts(pb::RoomCountsRequest { room_ids: vec!["lobby-3".into()], ..Default::default() });
    assert!(after.await.unwrap().into_inner().counts[0].version > version);
    assert!(stream.silent_for(Duration::from_millis(700)).await, "nothing changes: nothing is sent");
    server.stop().await;
}

#[tokio::test]
async fn r7_rooms_are_added_and_removed_on_the_open_stream_by_its_opener_only() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let initial = rooms("r", 3);
    let mut stream = CountStream::open(&mut client, service(watch(&initial, 100))).await;
    join_all(&mut client, Some(SERVICE), "alice", &["r0", "new"]).await;
    stream.until("r0", 1).await;

    // Added: their counts at once, in one message (not waiting for the interval).
    let update = pb::UpdateWatchRoomCountsRequest {
        watch_id: stream.watch_id.clone(),
        add_room_ids: vec!["new".into(), "r0".into(), "empty".into()],
        remove_room_ids: vec!["r0".into()],
        ..Default::default()
    };
    client.update_watch_room_counts(service(update)).await.unwrap();
    let added = stream.next().await;
    let mut added: Vec<(String, u32)> = added.into_iter().map(|count| (count.room_id, count.users)).collect();
    added.sort();
    assert_eq!(added, [("empty".to_string(), 0), ("new".to_string(), 1)], "r0 was both added and removed: removed");

    // Removed: nothing more of r0, while the others still come.
    join_all(&mut client, Some(SERVICE), "bob", &["r0", "r1"]).await;
    stream.until("r1", 1).await;
    assert_eq!(stream.users("r0"), (1, 1), "r0 removed: bob's join is not sent");
    assert!(stream.messages.last().unwrap().1.iter().all(|room| room != "r0"));

    // Only the opener may change it; an unknown id reads the same.
    let viewer = viewer_token("mallory", false);
    let theirs = pb::UpdateWatchRoomCountsRequest { watch_id: stream.watch_id.clone(), ..Default::default() };
    let refused = client.update_watch_room_counts(with_token(theirs, Some(&viewer))).await.unwrap_err();
    assert_eq!(refused.code(), Code::NotFound, "{refused:?}");
    let unknown = pb::UpdateWatchRoomCountsRequest { watch_id: "no-such-watch".into(), ..Default::default() };
    let refused = client.update_watch_room_counts(service(unknown)).await.unwrap_err();
    assert_eq!((refused.code(), refused.message().starts_with("watch_id")), (Code::NotFound, true), "{refused:?}");
    server.stop().await;
}

#[tokio::test]
async fn r7_bad_requests_are_refused_naming_the_field_and_the_cap_holds() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let refusal = |status: tonic::Status| (status.code(), status.message().split(':').next().unwrap_or("").to_owned());
    let invalid = |field: &str| (Code::InvalidArgument, field.to_owned());

    let none = client.watch_room_counts(watch(&[], 0)).await.map(drop).unwrap_err();
    assert_eq!(refusal(none), invalid("room_ids"));
    let too_many = client.watch_room_counts(watch(&rooms("x", CAP + 1), 0)).await.map(drop).unwrap_err();
    assert!(too_many.message().contains("10001 rooms, more than the limit of 10000"), "{too_many:?}");
    assert_eq!(refusal(too_many), invalid("room_ids"));
    let fast = client.watch_room_counts(watch(&rooms("x", 1), 50)).await.map(drop).unwrap_err();
    assert_eq!(refusal(fast), invalid("count_interval_ms"));
    let mut bad_id = rooms("x", 3);
    bad_id[2] = String::new();
    let empty_id = client.watch_room_counts(watch(&bad_id, 0)).await.map(drop).unwrap_err();
    assert!(empty_id.message().contains("entry 2"), "{empty_id:?}");
    assert_eq!(refusal(empty_id), invalid("room_ids"));
    let read = client.room_counts(pb::RoomCountsRequest { room_ids: rooms("x", CAP + 1), ..Default::default() });
    assert_eq!(refusal(read.await.unwrap_err()), invalid("room_ids"));

    // The cap itself: 10,000 rooms in one read and on one stream, and no more through an update.
    let read = client.room_counts(pb::RoomCountsRequest { room_ids: rooms("x", CAP), ..Default::default() });
    assert_eq!(read.await.unwrap().into_inner().counts.len(), CAP);
    let mut full = CountStream::open(&mut client, tonic::Request::new(watch(&rooms("x", CAP), 100))).await;
    assert_eq!(full.held.len(), CAP);
    let over = pb::UpdateWatchRoomCountsRequest {
        watch_id: full.watch_id.clone(),
        add_room_ids: vec!["one-more".into()],
        ..Default::default()
    };
    let over = client.update_watch_room_counts(over).await.unwrap_err();
    assert!(over.message().contains("would watch 10001 rooms"), "{over:?}");
    assert_eq!(refusal(over), invalid("add_room_ids"));
    // Room for one more once one goes.
    let swap = pb::UpdateWatchRoomCountsRequest {
        watch_id: full.watch_id.clone(),
        add_room_ids: vec!["one-more".into()],
        remove_room_ids: vec!["x0".into()],
        ..Default::default()
    };
    client.update_watch_room_counts(swap).await.unwrap();
    assert_eq!(full.next().await.iter().map(|count| count.room_id.as_str()).collect::<Vec<_>>(), ["one-more"]);
    server.stop().await;
}

#[tokio::test]
async fn r7_each_caller_counts_only_the_rooms_it_may_read_and_nobody_counts_the_invisible() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let as_service = Some(SERVICE);
    join_all(&mut client, as_service, "alice", &["team", "town-square"]).await;
    join_all(&mut client, as_service, "carol", &["team"]).await;
    let public = pb::SetRoomAccessRequest { room_id: "town-square".into(), access: pb::RoomAccess::Public as i32 };
    client.set_room_access(service(public)).await.unwrap();

    // Dave is in neither: the members' room reads as an unknown room, the public one as it is.
    let dave = viewer_token("dave", false);
    let asked = vec!["team".to_string(), "town-square".into(), "nowhere".into()];
    let read = client
        .room_counts(with_token(pb::RoomCountsRequest { room_ids: asked.clone(), ..Default::default() }, Some(&dave)));
    let read: Vec<(u64, u32)> = read.await.unwrap().into_inner().counts.iter().map(|c| (c.version, c.users)).collect();
    assert_eq!(read[0], (0, 0), "a members' room dave is not in reads as one that does not exist");
    assert_eq!(read[1].1, 1);
    assert_eq!(read[2], (0, 0));
    let mut daves = CountStream::open(&mut client, with_token(watch(&asked, 100), Some(&dave))).await;
    assert_eq!((daves.held["team"].version, daves.users("team")), (0, (0, 0)));
    assert_eq!(daves.users("town-square"), (1, 1));
    // A service reading for dave is answered as dave is; for no viewer, everything.
    let for_dave = pb::RoomCountsRequest { room_ids: asked.clone(), viewer_id: "dave".into() };
    assert_eq!(client.room_counts(service(for_dave)).await.unwrap().into_inner().counts[0].users, 0);
    let all = pb::RoomCountsRequest { room_ids: asked.clone(), ..Default::default() };
    assert_eq!(client.room_counts(service(all)).await.unwrap().into_inner().counts[0].users, 2);

    // Dave joins the team: its count shows on his open stream; he leaves: it reads as unknown again.
    let generation = join_all(&mut client, as_service, "dave", &["team"]).await;
    daves.until("team", 3).await;
    assert!(daves.held["team"].version > 0);
    let leave = pb::LeaveRequest { user_id: "dave".into(), session_id: "s".into(), generation, room_id: "team".into() };
    client.leave(service(leave)).await.unwrap();
    daves.until("team", 0).await;
    assert_eq!(daves.held["team"].version, 0, "no version of a room dave may not read");

    // An invisible member is counted by nobody, on open streams too.
    let mut services = CountStream::open(&mut client, service(watch(&asked, 100))).await;
    assert_eq!(services.users("team"), (2, 2));
    let invisible = pb::SetVisibilityRequest {
        user_id: "carol".into(),
        visibility: pb::Visibility::Nobody as i32,
        ..Default::default()
    };
    client.set_visibility(service(invisible)).await.unwrap();
    services.until("team", 1).await;
    assert_eq!(services.users("town-square"), (1, 1), "carol was not in it");

    // A members' room made public shows on dave's stream.
    let opened = pb::SetRoomAccessRequest { room_id: "team".into(), access: pb::RoomAccess::Public as i32 };
    client.set_room_access(service(opened)).await.unwrap();
    daves.until("team", 1).await;
    server.stop().await;
}
