//! Rooms (R1–R6), signals (S3) and flap damping (E6) over real gRPC: per-user
//! membership derived from sessions, member and count watchers, who may read
//! a room, the member cap, signals that expire, and damped flaps.

use std::time::{Duration, Instant};

use crate::common::auth::{SERVICE, secured_config, viewer_token};
use crate::common::*;
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, room_event};
use tonic::Code;
use tonic::transport::Channel;

fn join(user: &str, session: &str, generation: u64, room: &str, metadata: &[(&str, &str)]) -> pb::JoinRequest {
    pb::JoinRequest {
        user_id: user.into(),
        session_id: session.into(),
        generation,
        room_id: room.into(),
        metadata: metadata.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect(),
    }
}

fn leave(user: &str, session: &str, generation: u64, room: &str) -> pb::LeaveRequest {
    pb::LeaveRequest { user_id: user.into(), session_id: session.into(), generation, room_id: room.into() }
}

fn signal(user: &str, session: &str, generation: u64, room: &str, ttl_ms: u32) -> pb::SignalRequest {
    pb::SignalRequest {
        user_id: user.into(),
        session_id: session.into(),
        generation,
        room_id: room.into(),
        kind: "typing".into(),
        ttl_ms,
    }
}

async fn online(client: &mut PresenceClient<Channel>, user: &str, session: &str, ttl_ms: u32) -> u64 {
    client.register(register(user, session, "gw", ttl_ms)).await.expect("register").into_inner().generation
}

/// A member-mode room watcher.
struct RoomViewer {
    stream: tonic::Streaming<pb::RoomEvent>,
}

impl RoomViewer {
    async fn open(
        client: &mut PresenceClient<Channel>,
        request: tonic::Request<pb::WatchRoomRequest>,
    ) -> (Self, pb::RoomEvent) {
        let mut stream = client.watch_room(request).await.expect("open WatchRoom").into_inner();
        let first = within(PATIENCE, "the first room event", stream.message()).await.unwrap().unwrap();
        (RoomViewer { stream }, first)
    }

    async fn next(&mut self) -> room_event::Event {
        let item = within(PATIENCE, "a room event", self.stream.message()).await.expect("healthy").expect("open");
        item.event.expect("an event")
    }

    async fn change(&mut self) -> pb::RoomMemberChange {
        match self.next().await {
            room_event::Event::Change(change) => change,
            other => panic!("expected a member change, got {other:?}"),
        }
    }

    async fn ended(&mut self) -> tonic::Status {
        loop {
            match within(PATIENCE, "the room watch ends", self.stream.message()).await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("ended without a status"),
                Err(status) => return status,
            }
        }
    }
}

fn members_of(room: &str) -> pb::WatchRoomRequest {
    pb::WatchRoomRequest {
        room_id: room.into(),
        mode: pb::RoomWatchMode::RoomWatchMembers as i32,
        ..Default::default()
    }
}

fn kind(change: &pb::RoomMemberChange) -> pb::RoomChangeKind {
    pb::RoomChangeKind::try_from(change.kind).unwrap()
}

fn shown(change: &pb::RoomMemberChange) -> (String, Option<String>, u32) {
    let member = change.member.clone().unwrap();
    (member.user_id, member.metadata.get("tab").cloned(), member.sessions)
}

#[tokio::test]
async fn r2_membership_is_per_user_a_second_tab_publishes_nothing_and_metadata_changes_are_updates() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let (one, two) =
        (online(&mut client, "alice", "s1", 60_000).await, online(&mut client, "alice", "s2", 60_000).await);
    let bob = online(&mut client, "bob", "s", 60_000).await;
    let (mut watcher, first) = RoomViewer::open(&mut client, tonic::Request::new(members_of("doc"))).await;
    let Some(room_event::Event::Snapshot(snapshot)) = first.event else { panic!("a snapshot first") };
    assert!(snapshot.members.is_empty());

    let joined = client.join(join("alice", "s1", one, "doc", &[("tab", "one")])).await.unwrap().into_inner();
    assert!(joined.changed && joined.room_version > snapshot.version);
    let change = watcher.change().await;
    assert_eq!(
        (kind(&change), shown(&change)),
        (pb::RoomChangeKind::RoomChangeJoined, ("alice".into(), Some("one".into()), 1))
    );
    assert_eq!(change.version, joined.room_version);

    // A second tab: the user is already in; its metadata is now the one shown (the latest join).
    let second = client.join(join("alice", "s2", two, "doc", &[("tab", "two")])).await.unwrap().into_inner();
    assert!(!second.changed);
    let change = watcher.change().await;
    assert_eq!((kind(&change), shown(&change).1), (pb::RoomChangeKind::RoomChangeUpdated, Some("two".into())));
    // The same metadata again: nothing at all (bob's join comes next).
    client.join(join("alice", "s2", two, "doc", &[("tab", "two")])).await.unwrap();
    client.join(join("bob", "s", bob, "doc", &[])).await.unwrap();
    let change = watcher.change().await;
    assert_eq!((kind(&change), shown(&change).0.as_str()), (pb::RoomChangeKind::RoomChangeJoined, "bob"));

    // The shown tab leaves: the other's metadata shows, as an update, never a leave and a join.
    let left = client.leave(leave("alice", "s2", two, "doc")).await.unwrap().into_inner();
    assert!(left.removed && !left.changed);
    let change = watcher.change().await;
    assert_eq!((kind(&change), shown(&change).1), (pb::RoomChangeKind::RoomChangeUpdated, Some("one".into())));
    let again = client.leave(leave("alice", "s2", two, "doc")).await.unwrap().into_inner();
    assert!(!again.removed, "that session was not in the room any more");
    let left = client.leave(leave("alice", "s1", one, "doc")).await.unwrap().into_inner();
    assert!(left.removed && left.changed);
    let change = watcher.change().await;
    assert_eq!((kind(&change), shown(&change).0.as_str()), (pb::RoomChangeKind::RoomChangeLeft, "alice"));

    let room = client.room_snapshot(pb::RoomSnapshotRequest { room_id: "doc".into(), ..Default::default() }).await;
    let room = room.unwrap().into_inner();
    assert_eq!((room.users, room.sessions, room.members.len()), (1, 1, 1));
    assert!(room.version >= change.version);
    server.stop().await;
}

#[tokio::test]
async fn r1_membership_ends_with_the_lease_by_unregister_expiry_revoke_and_reconnect() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let (mut watcher, _) = RoomViewer::open(&mut client, tonic::Request::new(members_of("lobby"))).await;
    for (user, end) in [("gone", "unregister"), ("expired", "expiry"), ("revoked", "revoke"), ("again", "reconnect")] {
        let ttl = if end == "expiry" { 100 } else { 60_000 };
        let generation = online(&mut client, user, "s", ttl).await;
        client.join(join(user, "s", generation, "lobby", &[])).await.unwrap();
        assert_eq!(kind(&watcher.change().await), pb::RoomChangeKind::RoomChangeJoined, "{end}");
        match end {
            "unregister" => drop(client.unregister(unregister(user, "s", generation, 0)).await.unwrap()),
            "revoke" => {
                let request = pb::RevokeRequest { user_id: user.into(), session_id: String::new() };
                drop(client.revoke(request).await.unwrap());
            }
            "reconnect" => drop(online(&mut client, user, "s", 60_000).await),
            _ => {} // the lease runs out by itself
        }
        let change = watcher.change().await;
        assert_eq!((kind(&change), shown(&change).0.as_str()), (pb::RoomChangeKind::RoomChangeLeft, user), "{end}");
    }
    server.stop().await;
}

#[tokio::test]
async fn r6_room_calls_name_a_session_like_renew_and_refuse_like_it() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let old = online(&mut client, "u", "s", 60_000).await;
    let current = online(&mut client, "u", "s", 60_000).await;
    let stale = client.join(join("u", "s", old, "r", &[])).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition);
    let unknown = client.join(join("u", "nope", 1, "r", &[])).await.unwrap_err();
    assert_eq!(unknown.code(), Code::NotFound);
    let not_in = client.signal(signal("u", "s", current, "r", 1_000)).await.unwrap_err();
    assert_eq!(not_in.code(), Code::FailedPrecondition, "a signal into a room the session is not in");
    let bad = client.join(join("u", "s", current, "", &[])).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().starts_with("room_id"), "{bad:?}");
    let bad = client.signal(pb::SignalRequest { ttl_ms: 10_001, ..signal("u", "s", current, "r", 0) }).await;
    // Refused before anything else is looked at, naming the field.
    let bad = bad.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    let bad = client.watch_room(pb::WatchRoomRequest { mode: 7, ..members_of("r") }).await.unwrap_err();
    assert!(bad.message().starts_with("mode"), "{bad:?}");
    let count = pb::WatchRoomRequest {
        mode: pb::RoomWatchMode::RoomWatchCount as i32,
        count_interval_ms: 50,
        ..members_of("r")
    };
    assert!(client.watch_room(count).await.unwrap_err().message().starts_with("count_interval_ms"));

    // The same through Leases items, answered alike and one by one.
    let items = vec![
        pb::LeaseItem { op: Some(pb::lease_item::Op::Join(join("u", "s", current, "r", &[]))) },
        pb::LeaseItem { op: Some(pb::lease_item::Op::Join(join("u", "s", old, "r", &[]))) },
        pb::LeaseItem { op: Some(pb::lease_item::Op::Signal(signal("u", "s", current, "r", 1_000))) },
        pb::LeaseItem { op: Some(pb::lease_item::Op::Leave(leave("u", "s", current, "r"))) },
    ];
    let results = lease_batch(&mut client, items).await;
    let codes: Vec<u32> = results.iter().map(|r| r.code).collect();
    assert_eq!(codes, [0, Code::FailedPrecondition as u32, 0, 0]);
    assert!(matches!(&results[0].result, Some(pb::lease_result::Result::Join(j)) if j.changed));
    assert!(matches!(&results[2].result, Some(pb::lease_result::Result::Signal(s)) if s.changed));
    assert!(matches!(&results[3].result, Some(pb::lease_result::Result::Leave(l)) if l.removed && l.changed));
    server.stop().await;
}

#[tokio::test]
async fn s3_signal_sets_reach_watchers_only_when_they_change_and_expire_by_themselves() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let generation = online(&mut client, "typist", "s", 60_000).await;
    client.join(join("typist", "s", generation, "chat", &[])).await.unwrap();
    let (mut watcher, _) = RoomViewer::open(&mut client, tonic::Request::new(members_of("chat"))).await;

    assert!(client.signal(signal("typist", "s", generation, "chat", 300)).await.unwrap().into_inner().changed);
    let room_event::Event::Signals(set) = watcher.next().await else { panic!("a signal set") };
    assert_eq!((set.kind.as_str(), set.user_ids.as_slice(), set.count), ("typing", &["typist".to_string()][..], 1));
    // A renewal extends it and publishes nothing.
    assert!(!client.signal(signal("typist", "s", generation, "chat", 300)).await.unwrap().into_inner().changed);
    let set_at = Instant::now();
    let room_event::Event::Signals(cleared) = watcher.next().await else { panic!("the set emptied") };
    assert!(cleared.user_ids.is_empty() && cleared.count == 0 && cleared.version > set.version);
    assert!(set_at.elapsed() >= Duration::from_millis(250), "it lasted its (renewed) TTL");

    // The rate bound.
    let mut refused = None;
    for i in 0..40 {
        if let Err(status) =
            client.signal(signal("typist", "s", generation, "chat", if i % 2 == 0 { 5_000 } else { 0 })).await
        {
            refused = Some(status);
            break;
        }
    }
    assert_eq!(refused.expect("the rate bound").code(), Code::ResourceExhausted);
    server.stop().await;
}

fn service<T>(message: T) -> tonic::Request<T> {
    with_token(message, Some(SERVICE))
}

#[tokio::test]
async fn r4_members_rooms_are_read_by_members_and_services_only_and_hidden_members_are_not_listed() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let gen_alice =
        client.register(service(register("alice", "s", "gw", 60_000))).await.unwrap().into_inner().generation;
    let gen_carol =
        client.register(service(register("carol", "s", "gw", 60_000))).await.unwrap().into_inner().generation;
    client.join(service(join("alice", "s", gen_alice, "team", &[]))).await.unwrap();
    client.join(service(join("carol", "s", gen_carol, "team", &[]))).await.unwrap();
    let (alice, outsider) = (viewer_token("alice", false), viewer_token("dave", false));
    let snapshot = |token: &str, room: &str| {
        with_token(pb::RoomSnapshotRequest { room_id: room.into(), ..Default::default() }, Some(token))
    };

    // An outsider: the room reads exactly as one that does not exist.
    let forbidden = client.room_snapshot(snapshot(&outsider, "team")).await.unwrap_err();
    let unknown = client.room_snapshot(snapshot(&outsider, "no-such-room")).await.unwrap_err();
    assert_eq!((forbidden.code(), unknown.code()), (Code::NotFound, Code::NotFound));
    assert_eq!(forbidden.message().replace("team", "X"), unknown.message().replace("no-such-room", "X"));
    let watch = with_token(members_of("team"), Some(&outsider));
    assert_eq!(client.watch_room(watch).await.unwrap_err().code(), Code::NotFound);

    // A member sees the room, but not carol, who is hidden from alice (the default audience is empty).
    let seen = client.room_snapshot(snapshot(&alice, "team")).await.unwrap().into_inner();
    let listed: Vec<&str> = seen.members.iter().map(|m| m.user_id.as_str()).collect();
    assert_eq!((listed, seen.users), (vec!["alice"], 1));
    let whole = client.room_snapshot(service(pb::RoomSnapshotRequest { room_id: "team".into(), ..Default::default() }));
    assert_eq!(whole.await.unwrap().into_inner().users, 2, "a service acting for no viewer sees every member");

    // Public: anyone may read it.
    let public = pb::SetRoomAccessRequest { room_id: "team".into(), access: pb::RoomAccess::Public as i32 };
    client.set_room_access(service(public)).await.unwrap();
    assert_eq!(
        client.room_snapshot(snapshot(&outsider, "team")).await.unwrap().into_inner().users,
        0,
        "carol and alice are hidden from dave"
    );
    let as_viewer = client
        .set_room_access(with_token(pb::SetRoomAccessRequest { room_id: "team".into(), access: 1 }, Some(&alice)))
        .await;
    assert_eq!(as_viewer.unwrap_err().code(), Code::PermissionDenied);

    // Back to members only: an outsider's open watch ends with the refusal of an unknown room.
    let (mut watching, _) = RoomViewer::open(&mut client, with_token(members_of("team"), Some(&outsider))).await;
    let members_only = pb::SetRoomAccessRequest { room_id: "team".into(), access: pb::RoomAccess::Members as i32 };
    client.set_room_access(service(members_only)).await.unwrap();
    assert_eq!(watching.ended().await.code(), Code::NotFound);

    // An invisible member is counted by nobody.
    let invisible = pb::SetVisibilityRequest {
        user_id: "carol".into(),
        visibility: pb::Visibility::Nobody as i32,
        ..Default::default()
    };
    client.set_visibility(service(invisible)).await.unwrap();
    let count = pb::WatchRoomRequest {
        mode: pb::RoomWatchMode::RoomWatchCount as i32,
        count_interval_ms: 100,
        ..members_of("team")
    };
    let (_, first) = RoomViewer::open(&mut client, service(count)).await;
    let Some(room_event::Event::Count(count)) = first.event else { panic!("count mode opens with a count") };
    assert_eq!((count.users, count.sessions), (1, 1));
    server.stop().await;
}

#[tokio::test]
async fn r3_count_watchers_get_a_count_at_once_then_at_most_one_per_interval_and_only_on_change() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let count = pb::WatchRoomRequest {
        mode: pb::RoomWatchMode::RoomWatchCount as i32,
        count_interval_ms: 200,
        ..members_of("big")
    };
    let (mut watcher, first) = RoomViewer::open(&mut client, tonic::Request::new(count)).await;
    assert!(matches!(first.event, Some(room_event::Event::Count(pb::RoomCount { users: 0, sessions: 0, .. }))));
    let started = Instant::now();
    // Churn for about a second.
    let mut gateway = server.client().await;
    let churn = tokio::spawn(async move {
        for i in 0..200 {
            let user = format!("u{i}");
            let generation = online(&mut gateway, &user, "s", 60_000).await;
            gateway.join(join(&user, "s", generation, "big", &[])).await.unwrap();
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    let mut frames = Vec::new();
    loop {
        let room_event::Event::Count(count) = watcher.next().await else { panic!("only counts in count mode") };
        frames.push((Instant::now(), count.users));
        if count.users == 200 {
            break;
        }
    }
    churn.await.unwrap();
    let elapsed = started.elapsed();
    assert!(frames.windows(2).all(|w| w[1].0 - w[0].0 >= Duration::from_millis(150)), "at most one per interval");
    assert!(frames.len() as u128 <= elapsed.as_millis() / 200 + 1, "{} frames in {elapsed:?}", frames.len());
    assert!(frames.windows(2).all(|w| w[1].1 > w[0].1), "only when the counts changed");
    // Nothing changes: nothing is sent.
    assert!(tokio::time::timeout(Duration::from_millis(600), watcher.stream.message()).await.is_err());
    server.stop().await;
}

#[tokio::test]
async fn r6_member_mode_is_refused_past_the_member_cap_naming_count_mode() {
    let mut config = fast_config();
    config.room_member_cap = 2;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    for user in ["a", "b"] {
        let generation = online(&mut client, user, "s", 60_000).await;
        client.join(join(user, "s", generation, "hall", &[])).await.unwrap();
    }
    let (mut watcher, _) = RoomViewer::open(&mut client, tonic::Request::new(members_of("hall"))).await;
    let generation = online(&mut client, "c", "s", 60_000).await;
    client.join(join("c", "s", generation, "hall", &[])).await.unwrap();
    let ended = watcher.ended().await;
    assert_eq!(ended.code(), Code::FailedPrecondition);
    assert!(ended.message().contains("ROOM_WATCH_COUNT"), "{ended:?}");
    let refused = client.watch_room(members_of("hall")).await.unwrap_err();
    assert_eq!((refused.code(), refused.message()), (ended.code(), ended.message()));
    let snapshot = client.room_snapshot(pb::RoomSnapshotRequest { room_id: "hall".into(), ..Default::default() });
    let snapshot = snapshot.await.unwrap().into_inner();
    assert!(snapshot.members_omitted && snapshot.members.is_empty());
    assert_eq!((snapshot.users, snapshot.sessions), (3, 3));
    server.stop().await;
}

#[tokio::test]
async fn e6_a_flap_within_the_grace_window_reaches_no_viewer() {
    let mut config = fast_config();
    config.store.offline_grace_ms = 400;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let generation = online(&mut client, "flappy", "s", 60_000).await;
    let mut viewer = Viewer::open(&mut client, &["flappy", "sentinel"]).await;
    let version = viewer.held["flappy"].1;
    client.unregister(unregister("flappy", "s", generation, 0)).await.unwrap();
    let back = client.register(register("flappy", "s", "gw", 60_000)).await.unwrap().into_inner();
    assert!(!back.changed, "the user never went offline");
    // A barrier that damping does not hold back: the sentinel coming online is published after the flap.
    online(&mut client, "sentinel", "s", 60_000).await;
    viewer.until_state("sentinel", pb::State::Online).await;
    assert!(viewer.updates_of("flappy").is_empty(), "a damped flap reached the viewer");
    assert_eq!(snapshot(&mut client, &["flappy"]).await[0].version, version, "the version did not move");
    // Without a new lease, OFFLINE comes at the end of the window.
    client.unregister(unregister("flappy", "s", back.generation, 0)).await.unwrap();
    let gone = Instant::now();
    assert_eq!(state_of(&viewer.until_update_of("flappy").await), pb::State::Offline);
    assert!(gone.elapsed() >= Duration::from_millis(350), "OFFLINE came before the window ended");
    server.stop().await;
}

#[tokio::test]
async fn r4_a_change_of_relations_shows_or_hides_a_member_on_open_room_watches() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    for user in ["alice", "carol"] {
        let generation =
            client.register(service(register(user, "s", "gw", 60_000))).await.unwrap().into_inner().generation;
        client.join(service(join(user, "s", generation, "team", &[]))).await.unwrap();
    }
    let alice = viewer_token("alice", false);
    let (mut watcher, first) = RoomViewer::open(&mut client, with_token(members_of("team"), Some(&alice))).await;
    let listed = |event: &room_event::Event| match event {
        room_event::Event::Snapshot(snapshot) => snapshot.members.iter().map(|m| m.user_id.clone()).collect::<Vec<_>>(),
        other => panic!("expected a snapshot, got {other:?}"),
    };
    assert_eq!(listed(&first.event.unwrap()), ["alice"], "carol is hidden from alice");
    let grant = pb::AudienceRequest { user_id: "carol".into(), viewer_ids: vec!["alice".into()] };
    client.grant_audience(service(grant.clone())).await.unwrap();
    let mut shown = listed(&watcher.next().await);
    shown.sort();
    assert_eq!(shown, ["alice", "carol"], "shown at once, as a fresh snapshot");
    client.revoke_audience(service(grant)).await.unwrap();
    assert_eq!(listed(&watcher.next().await), ["alice"], "hidden again at once");
    server.stop().await;
}
