//! Rooms and signals through the client against a real server on port 0: a
//! `Session` joins, leaves and signals, and a `RoomWatcher` (or a
//! `RoomCountWatcher`) sees it; memberships end with the lease, come back
//! after a re-register, and survive a server restart.

// Protobuf messages gain fields as the API grows: every literal of one ends in
// `..Default::default()`, so that it keeps compiling, even where it names every field today.
#![allow(clippy::needless_update)]

mod common;

use std::collections::HashMap;
use std::time::Duration;

use common::{PATIENCE, TestServer, fast_config, within};
use presence_client::{
    Backoff, LeaseChannel, LeaseChannelConfig, RoomCountWatcher, RoomCountsWatcher, RoomView, RoomWatcher,
    RoomWatcherEvent, Session, SessionConfig, SessionState, pb,
};
use presence_proto::v1::presence_client::PresenceClient;
use tonic::Code;
use tonic::transport::Channel;

use pb::RoomChangeKind::{RoomChangeJoined as Joined, RoomChangeLeft as Left, RoomChangeUpdated as Updated};

fn fast_reconnect() -> Backoff {
    Backoff { initial: Duration::from_millis(20), max: Duration::from_millis(200), factor: 2.0 }
}

async fn channel(server: &TestServer) -> LeaseChannel {
    let config = LeaseChannelConfig { reconnect: fast_reconnect(), ..LeaseChannelConfig::default() };
    LeaseChannel::connect(server.url(), config).await.expect("connect the lease channel")
}

/// A session renewing every `heartbeat_ms`, with a lease of `ttl_ms`.
async fn session(channel: &LeaseChannel, user: &str, session: &str, ttl_ms: u32, heartbeat_ms: u64) -> Session {
    let config = SessionConfig {
        ttl_ms,
        heartbeat: Duration::from_millis(heartbeat_ms),
        linger_ms: 0,
        min_renew_interval: Duration::ZERO,
        ..SessionConfig::default()
    };
    Session::register(channel, user, session, "gw-rooms", HashMap::new(), config).await.expect("register")
}

fn tab(value: &str) -> HashMap<String, String> {
    [("tab".to_string(), value.to_string())].into()
}

fn shown_tab<'a>(view: &'a RoomView, user: &str) -> Option<&'a str> {
    view.member(user).and_then(|member| member.metadata.get("tab")).map(String::as_str)
}

async fn next(watcher: &mut RoomWatcher) -> RoomWatcherEvent {
    within(PATIENCE, "a room event", watcher.next()).await.expect("the room watch goes on")
}

/// The next event, which must be a member change: its kind and user.
async fn change(watcher: &mut RoomWatcher) -> (pb::RoomChangeKind, String, pb::RoomMemberChange) {
    match next(watcher).await {
        RoomWatcherEvent::Change(change) => {
            let kind = pb::RoomChangeKind::try_from(change.kind).expect("a known kind");
            (kind, change.member.clone().expect("a member").user_id, change)
        }
        other => panic!("a member change, got {other:?}"),
    }
}

/// The next event, which must be a signal set.
async fn signals(watcher: &mut RoomWatcher) -> pb::SignalSet {
    match next(watcher).await {
        RoomWatcherEvent::Signals(set) => set,
        other => panic!("a signal set, got {other:?}"),
    }
}

/// Reads events until the view satisfies `done`; returns them.
async fn until(watcher: &mut RoomWatcher, what: &str, done: impl Fn(&RoomView) -> bool) -> Vec<RoomWatcherEvent> {
    within(PATIENCE, what, async {
        let mut seen = Vec::new();
        while !done(watcher.view()) {
            seen.push(watcher.next().await.expect("the room watch goes on"));
        }
        seen
    })
    .await
}

async fn room_snapshot(client: &mut PresenceClient<Channel>, room: &str) -> pb::RoomSnapshot {
    let request = pb::RoomSnapshotRequest { room_id: room.into(), ..Default::default() };
    client.room_snapshot(request).await.expect("room snapshot").into_inner()
}

#[tokio::test]
async fn r1_s3_a_session_joins_signals_and_leaves_and_a_room_watcher_sees_each_step() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let ann = session(&channel, "ann", "tab-1", 60_000, 1_000).await;
    let mut watcher = RoomWatcher::open(server.client().await, "doc", fast_reconnect()).await.unwrap();
    assert!(watcher.view().is_empty() && watcher.view().room_id() == "doc");

    let joined = ann.join("doc", tab("one")).await.unwrap();
    assert!(joined.changed && joined.room_version > 0, "{joined:?}");
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Joined, "ann"));
    assert_eq!(shown_tab(watcher.view(), "ann"), Some("one"));
    assert_eq!(watcher.view().version(), joined.room_version);
    assert_eq!(ann.rooms(), ["doc"]);

    let typing = ann.signal("doc", "typing", 5_000).await.unwrap();
    assert!(typing.changed);
    let set = signals(&mut watcher).await;
    assert_eq!((set.kind.as_str(), set.version), ("typing", typing.room_version));
    assert_eq!(watcher.view().signalling("typing"), ["ann"]);
    // A renewal of a set signal changes nothing and is not published; a clear is.
    assert!(!ann.signal("doc", "typing", 5_000).await.unwrap().changed);
    assert!(ann.signal("doc", "typing", 0).await.unwrap().changed);
    assert!(signals(&mut watcher).await.user_ids.is_empty());
    assert!(watcher.view().signalling("typing").is_empty() && watcher.view().signals().next().is_none());

    let not_in = ann.signal("elsewhere", "typing", 1_000).await.unwrap_err();
    assert_eq!(not_in.code(), Code::FailedPrecondition, "a signal into a room the session is not in");

    let left = ann.leave("doc").await.unwrap();
    assert!(left.removed && left.changed, "{left:?}");
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Left, "ann"));
    assert!(watcher.view().is_empty());
    assert!(ann.rooms().is_empty(), "a room left is forgotten");
    assert!(!ann.leave("doc").await.unwrap().removed, "not in it any more");
    server.stop().await;
}

#[tokio::test]
async fn r2_a_second_session_of_a_member_publishes_nothing_and_new_metadata_is_an_update() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let (phone, laptop) = (
        session(&channel, "ann", "phone", 60_000, 1_000).await,
        session(&channel, "ann", "laptop", 60_000, 1_000).await,
    );
    let bob = session(&channel, "bob", "s", 60_000, 1_000).await;
    let mut watcher = RoomWatcher::open(server.client().await, "doc", fast_reconnect()).await.unwrap();

    phone.join("doc", tab("one")).await.unwrap();
    assert_eq!(change(&mut watcher).await.0, Joined);
    let second = laptop.join("doc", tab("one")).await.unwrap();
    assert!(!second.changed, "ann is in already");
    // Bob's join is the barrier: had the second session published anything, it would come first.
    bob.join("doc", HashMap::new()).await.unwrap();
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Joined, "bob"));

    // New metadata for a session in the room: one update, never a leave and a join.
    let update = phone.join("doc", tab("two")).await.unwrap();
    assert!(!update.changed);
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Updated, "ann"));
    assert_eq!(shown_tab(watcher.view(), "ann"), Some("two"));
    assert_eq!(watcher.view().len(), 2);
    assert_eq!(watcher.view().version(), update.room_version);

    // One of ann's sessions leaving keeps her in the room.
    assert!(!laptop.leave("doc").await.unwrap().changed);
    assert_eq!(room_snapshot(&mut server.client().await, "doc").await.users, 2);
    server.stop().await;
}

#[tokio::test]
async fn r1_a_session_whose_lease_ends_leaves_the_room() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut watcher = RoomWatcher::open(server.client().await, "lobby", fast_reconnect()).await.unwrap();

    let closing = session(&channel, "closing", "s", 60_000, 1_000).await;
    closing.join("lobby", HashMap::new()).await.unwrap();
    assert_eq!(change(&mut watcher).await.0, Joined);
    closing.close().await.unwrap();
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Left, "closing"));
    assert!(watcher.view().member("closing").is_none());

    // A lease of 100 ms with a beat an hour away: it runs out through the wheel.
    let expiring = session(&channel, "expiring", "s", 100, 3_600_000).await;
    expiring.join("lobby", HashMap::new()).await.unwrap();
    assert_eq!(change(&mut watcher).await.0, Joined);
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Left, "expiring"));
    assert!(watcher.view().is_empty());
    server.stop().await;
}

#[tokio::test]
async fn r6_a_session_joins_its_rooms_again_after_it_registers_again() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut client = server.client().await;
    let ann = session(&channel, "ann", "tab", 300, 30).await;
    ann.join("doc", tab("one")).await.unwrap();
    ann.join("chat", HashMap::new()).await.unwrap();
    let first = ann.generation();
    let mut events = ann.events();
    let mut watcher = RoomWatcher::open(client.clone(), "doc", fast_reconnect()).await.unwrap();
    assert_eq!(shown_tab(watcher.view(), "ann"), Some("one"));

    // The revoke ends the lease and its memberships; the session registers again.
    let revoke = pb::RevokeRequest { user_id: "ann".into(), session_id: "tab".into(), ..Default::default() };
    client.revoke(revoke).await.unwrap();
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Left, "ann"));
    within(PATIENCE, "a re-register", events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap();
    assert!(ann.generation() > first);

    // By the time it says so, it is in both rooms again, with its metadata.
    for room in ["doc", "chat"] {
        let members = room_snapshot(&mut client, room).await.members;
        assert_eq!(members.iter().map(|m| m.user_id.as_str()).collect::<Vec<_>>(), ["ann"], "{room}");
    }
    let (kind, user, _) = change(&mut watcher).await;
    assert_eq!((kind, user.as_str()), (Joined, "ann"));
    assert_eq!(shown_tab(watcher.view(), "ann"), Some("one"));
    assert_eq!(ann.rooms(), ["chat", "doc"]);

    // The room calls go on with the new generation.
    assert!(ann.signal("doc", "typing", 1_000).await.unwrap().changed);
    assert!(ann.leave("chat").await.unwrap().changed);
    server.stop().await;
}

#[tokio::test]
async fn a_join_while_the_lease_is_lost_is_kept_and_made_by_the_re_register() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut client = server.client().await;
    // Beats an hour apart: only the touch below renews, and so finds the lease gone.
    let ann = session(&channel, "ann", "tab", 60_000, 3_600_000).await;
    let mut events = ann.events();
    let revoke = pb::RevokeRequest { user_id: "ann".into(), session_id: "tab".into(), ..Default::default() };
    client.revoke(revoke).await.unwrap();

    let lost = ann.join("doc", tab("one")).await.unwrap_err();
    assert_eq!(lost.code(), Code::NotFound, "{lost:?}");
    assert_eq!(ann.rooms(), ["doc"], "kept for the re-register");
    let refused = ann.join("", tab("one")).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument);
    assert_eq!(ann.rooms(), ["doc"], "any other refusal is forgotten");

    ann.touch();
    within(PATIENCE, "a re-register", events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap();
    let members = room_snapshot(&mut client, "doc").await.members;
    assert_eq!(members.len(), 1);
    assert_eq!(members[0].metadata, tab("one"));
    server.stop().await;
}

#[tokio::test]
async fn a_room_watcher_resyncs_after_a_server_restart_and_the_session_rejoins_the_new_one() {
    let server = TestServer::start(fast_config()).await;
    let addr = server.addr;
    let channel = channel(&server).await;
    let ann = session(&channel, "ann", "tab", 300, 30).await;
    let bob = session(&channel, "bob", "tab", 300, 30).await;
    ann.join("doc", tab("one")).await.unwrap();
    bob.join("doc", tab("b")).await.unwrap();
    let mut watcher = RoomWatcher::open(server.client().await, "doc", fast_reconnect()).await.unwrap();
    assert_eq!(watcher.view().len(), 2);
    bob.leave("doc").await.unwrap();
    assert_eq!(change(&mut watcher).await.0, Left);

    // A server with nothing in memory: both sides come back to it by themselves.
    server.stop().await;
    let server = TestServer::start_on(addr, fast_config()).await;
    // The view still shows the old server's room until the watcher resyncs from the new one.
    within(PATIENCE, "a resync", async {
        while watcher.next().await.expect("the room watch goes on") != RoomWatcherEvent::Resynced {}
    })
    .await;
    until(&mut watcher, "ann back in the room", |view| shown_tab(view, "ann") == Some("one")).await;
    assert!(watcher.view().member("bob").is_none(), "bob had left: not rejoined");
    assert_eq!(watcher.view().len(), 1);
    assert!(watcher.last_error().is_none());

    // And it follows the new server's changes, once bob's session is on it.
    let mut bob_events = bob.events();
    within(PATIENCE, "bob registered again", bob_events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap();
    bob.join("doc", tab("b")).await.unwrap();
    until(&mut watcher, "bob's join", |view| view.member("bob").is_some()).await;
    server.stop().await;
}

#[tokio::test]
async fn r3_a_count_watcher_yields_the_counts_when_they_change() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut counts = RoomCountWatcher::open(server.client().await, "hall", 100, fast_reconnect()).await.unwrap();
    assert_eq!((counts.latest().users, counts.latest().sessions), (0, 0), "count mode opens with the counts");

    let sessions = [
        session(&channel, "a", "1", 60_000, 1_000).await,
        session(&channel, "a", "2", 60_000, 1_000).await,
        session(&channel, "b", "1", 60_000, 1_000).await,
    ];
    for session in &sessions {
        session.join("hall", HashMap::new()).await.unwrap();
    }
    let mut seen = Vec::new();
    within(PATIENCE, "three sessions of two users", async {
        while (counts.latest().users, counts.latest().sessions) != (2, 3) {
            let count = counts.next().await.expect("the count watch goes on");
            seen.push((count.users, count.sessions));
        }
    })
    .await;
    assert!(seen.windows(2).all(|pair| pair[0] != pair[1]), "only counts that changed: {seen:?}");
    assert_eq!(seen.last(), Some(&(2, 3)));

    sessions[2].leave("hall").await.unwrap();
    let count = within(PATIENCE, "b left", counts.next()).await.unwrap();
    assert_eq!((count.users, count.sessions), (1, 2));
    server.stop().await;
}

/// Reads a counts watcher until `room` holds `users` users and `sessions` sessions.
async fn counts_until(watcher: &mut RoomCountsWatcher, room: &str, users: u32, sessions: u32) {
    let held = |watcher: &RoomCountsWatcher| watcher.counts().get(room).map(|count| (count.users, count.sessions));
    within(PATIENCE, "the room's counts", async {
        while held(watcher) != Some((users, sessions)) {
            watcher.next().await.expect("the counts watch goes on");
        }
    })
    .await;
}

#[tokio::test]
async fn r7_a_counts_watcher_follows_many_rooms_takes_new_ones_and_reopens_with_them_after_a_restart() {
    let server = TestServer::start(fast_config()).await;
    let addr = server.addr;
    let channel = channel(&server).await;
    let rooms: Vec<String> = (0..100).map(|i| format!("table-{i}")).collect();
    let mut watcher =
        RoomCountsWatcher::open(server.client().await, rooms.clone(), 100, fast_reconnect()).await.unwrap();
    assert_eq!(watcher.counts().len(), 100, "every room from the first message");

    let ann = session(&channel, "ann", "tab", 300, 30).await;
    ann.join("table-7", HashMap::new()).await.unwrap();
    counts_until(&mut watcher, "table-7", 1, 1).await;

    // A room added on the open stream, one removed.
    watcher.update(vec!["bar".into()], vec!["table-0".into()]).await.unwrap();
    assert!(watcher.counts().get("table-0").is_none());
    ann.join("bar", HashMap::new()).await.unwrap();
    counts_until(&mut watcher, "bar", 1, 1).await;

    // A server with nothing in memory: the watcher reopens with the rooms as
    // they are now, and the session joins its rooms there again.
    server.stop().await;
    let server = TestServer::start_on(addr, fast_config()).await;
    let mut ann_events = ann.events();
    within(PATIENCE, "ann registered again", ann_events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap();
    // Bob is new to this server: his join shows only on a stream of the new
    // server that watches bar, added after the watcher first opened.
    let bob = session(&channel, "bob", "tab", 300, 30).await;
    bob.join("bar", HashMap::new()).await.unwrap();
    counts_until(&mut watcher, "bar", 2, 2).await;
    counts_until(&mut watcher, "table-7", 1, 1).await;
    assert_eq!(watcher.counts().len(), 100, "99 of the first rooms and bar");
    assert!(watcher.counts().get("table-0").is_none() && watcher.last_error().is_none());
    server.stop().await;
}

#[tokio::test]
async fn r6_a_member_watch_past_the_member_cap_ends_naming_count_mode() {
    let mut config = fast_config();
    config.room_member_cap = 1;
    let server = TestServer::start(config).await;
    let channel = channel(&server).await;
    let (a, b) = (session(&channel, "a", "s", 60_000, 1_000).await, session(&channel, "b", "s", 60_000, 1_000).await);
    a.join("hall", HashMap::new()).await.unwrap();
    let mut watcher = RoomWatcher::open(server.client().await, "hall", fast_reconnect()).await.unwrap();
    assert_eq!(watcher.view().len(), 1);

    b.join("hall", HashMap::new()).await.unwrap();
    let ended = within(PATIENCE, "the member watch ends", async { while watcher.next().await.is_some() {} });
    ended.await;
    let status = watcher.last_error().expect("why it ended");
    assert_eq!(status.code(), Code::FailedPrecondition);
    assert!(status.message().contains("ROOM_WATCH_COUNT"), "{status:?}");
    assert!(watcher.next().await.is_none(), "ended for good");

    let refused = RoomWatcher::open(server.client().await, "hall", fast_reconnect()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition);
    let counts = RoomCountWatcher::open(server.client().await, "hall", 0, fast_reconnect()).await.unwrap();
    assert_eq!(counts.latest().users, 2, "count mode has no cap");
    server.stop().await;
}

#[tokio::test]
async fn r4_a_room_watcher_presents_its_token_and_ends_when_its_viewer_may_no_longer_read() {
    const SERVICE: &str = "a-service-token-for-room-tests";
    let mut config = fast_config();
    config.auth = presence_server::AuthConfig { service_tokens: vec![SERVICE.into()], ..Default::default() };
    let server = TestServer::start(config).await;
    let leases = LeaseChannelConfig {
        bearer_token: Some(SERVICE.into()),
        reconnect: fast_reconnect(),
        ..LeaseChannelConfig::default()
    };
    let channel = LeaseChannel::connect(server.url(), leases).await.unwrap();
    let ann = session(&channel, "ann", "s", 60_000, 1_000).await;
    ann.join("team", tab("one")).await.unwrap();
    let client = server.client().await;
    let for_viewer =
        |viewer: &str| pb::WatchRoomRequest { room_id: "team".into(), viewer_id: viewer.into(), ..Default::default() };

    let anonymous = RoomWatcher::open(client.clone(), "team", fast_reconnect()).await.unwrap_err();
    assert_eq!(anonymous.code(), Code::Unauthenticated, "{anonymous:?}");
    let outsider = RoomWatcher::open_authorized(client.clone(), for_viewer("dave"), fast_reconnect(), Some(SERVICE));
    assert_eq!(outsider.await.unwrap_err().code(), Code::NotFound, "a members-only room dave is not in");
    let counts = RoomCountWatcher::open_authorized(client.clone(), for_viewer("dave"), fast_reconnect(), Some(SERVICE));
    assert_eq!(counts.await.unwrap_err().code(), Code::NotFound, "in count mode alike");

    let mut watcher =
        RoomWatcher::open_authorized(client.clone(), for_viewer("ann"), fast_reconnect(), Some(SERVICE)).await.unwrap();
    assert_eq!(shown_tab(watcher.view(), "ann"), Some("one"), "a member reads its room");
    // Ann's last session leaves: she may no longer read it, and the watch ends, not retried.
    ann.leave("team").await.unwrap();
    within(PATIENCE, "the watch ends", async { while watcher.next().await.is_some() {} }).await;
    assert_eq!(watcher.last_error().map(|status| status.code()), Some(Code::NotFound));
    server.stop().await;
}
