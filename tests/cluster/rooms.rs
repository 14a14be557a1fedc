//! Rooms across nodes against a real etcd (C1, C2, C3, R1–R6): a room lives
//! at the owner of its room id's slot, fed by the nodes that own its members;
//! any node reads it; its members and versions survive moves of the room's
//! slot and of its members' slots.

// Protobuf literals end in `..Default::default()` so that they keep compiling as messages gain fields.
#![allow(clippy::needless_update)]

use std::collections::BTreeMap;
use std::time::Duration;

use super::nodes::*;
use crate::common::{PATIENCE, within};
use presence_cluster::slot_of;
use presence_cluster::testing::EtcdServer;
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, room_event};
use presence_server::testing::TestServer;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

const ROOM: &str = "lobby";

/// The server of `node`, of the servers of the nodes from the first one given on.
fn server_of<'a>(servers: &'a [TestServer], node: &str) -> &'a TestServer {
    let offset = NODES.len() - servers.len();
    &servers[NODES.iter().position(|name| *name == node).expect("a node of the test") - offset]
}

/// A user the map gives to each node, in node order, and the room's owner.
fn one_user_per_node(map: &presence_cluster::SlotMap) -> Vec<(String, &'static str)> {
    NODES
        .iter()
        .map(|&node| {
            let user =
                (0..).map(|i| format!("member-{i}")).find(|user| map.owner(slot_of(user, SLOTS)).unwrap().node == node);
            (user.unwrap(), node)
        })
        .collect()
}

async fn register_at(client: &mut PresenceClient<Channel>, user: &str) -> u64 {
    let request = pb::RegisterRequest {
        user_id: user.into(),
        session_id: "s".into(),
        gateway_id: "gw".into(),
        ttl_ms: 60_000,
        ..Default::default()
    };
    client.register(request).await.expect("register at the user's owner").into_inner().generation
}

fn join(user: &str, generation: u64, device: &str) -> pb::JoinRequest {
    join_in(ROOM, user, generation, device)
}

fn join_in(room: &str, user: &str, generation: u64, device: &str) -> pb::JoinRequest {
    pb::JoinRequest {
        user_id: user.into(),
        session_id: "s".into(),
        generation,
        room_id: room.into(),
        metadata: [("device".to_string(), device.to_string())].into(),
    }
}

fn members_of(room: &str) -> pb::WatchRoomRequest {
    pb::WatchRoomRequest {
        room_id: room.into(),
        mode: pb::RoomWatchMode::RoomWatchMembers as i32,
        ..Default::default()
    }
}

/// The room's members as `(user, device, sessions)`, by user.
fn listed(snapshot: &pb::RoomSnapshot) -> BTreeMap<String, (String, u32)> {
    snapshot
        .members
        .iter()
        .map(|member| (member.user_id.clone(), (member.metadata["device"].clone(), member.sessions)))
        .collect()
}

async fn room_snapshot(client: &mut PresenceClient<Channel>) -> Result<pb::RoomSnapshot, tonic::Status> {
    room_snapshot_of(client, ROOM).await
}

async fn room_snapshot_of(client: &mut PresenceClient<Channel>, room: &str) -> Result<pb::RoomSnapshot, tonic::Status> {
    let request = pb::RoomSnapshotRequest { room_id: room.into(), ..Default::default() };
    Ok(client.room_snapshot(request).await?.into_inner())
}

/// The room as `client`'s node answers it, once it answers (a node that just
/// gained the room's slot answers UNAVAILABLE while it gathers the members).
async fn room_snapshot_once_answered(client: &mut PresenceClient<Channel>) -> pb::RoomSnapshot {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match room_snapshot(client).await {
            Ok(snapshot) => return snapshot,
            Err(status) if status.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(status) => panic!("RoomSnapshot: {status:?}"),
        }
    }
}

/// A member-mode WatchRoom at `client`'s node, once it opens, and its snapshot.
async fn watch_room(client: &mut PresenceClient<Channel>) -> (tonic::Streaming<pb::RoomEvent>, pb::RoomSnapshot) {
    watch_room_of(client, ROOM).await
}

async fn watch_room_of(
    client: &mut PresenceClient<Channel>,
    room: &str,
) -> (tonic::Streaming<pb::RoomEvent>, pb::RoomSnapshot) {
    let deadline = Instant::now() + PATIENCE;
    loop {
        match client.watch_room(members_of(room)).await {
            Ok(stream) => {
                let mut stream = stream.into_inner();
                match next_room_event(&mut stream).await {
                    Ok(room_event::Event::Snapshot(snapshot)) => return (stream, snapshot),
                    Ok(other) => panic!("a snapshot first, got {other:?}"),
                    Err(status) if status.code() == Code::Unavailable && Instant::now() < deadline => {}
                    Err(status) => panic!("WatchRoom: {status:?}"),
                }
            }
            Err(status) if status.code() == Code::Unavailable && Instant::now() < deadline => {}
            Err(status) => panic!("WatchRoom: {status:?}"),
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

async fn next_room_event(stream: &mut tonic::Streaming<pb::RoomEvent>) -> Result<room_event::Event, tonic::Status> {
    let item = within(PATIENCE, "a room event", stream.message()).await?;
    Ok(item.expect("the stream stays open").event.expect("an event"))
}

/// The next member change, its kind, user and version.
async fn next_change(stream: &mut tonic::Streaming<pb::RoomEvent>) -> (pb::RoomChangeKind, String, u64) {
    match next_room_event(stream).await.expect("a healthy stream") {
        room_event::Event::Change(change) => {
            (pb::RoomChangeKind::try_from(change.kind).unwrap(), change.member.unwrap().user_id, change.version)
        }
        other => panic!("expected a member change, got {other:?}"),
    }
}

/// The status a room watch ends with (`what` it is), past whatever it still carries.
async fn ended(stream: &mut tonic::Streaming<pb::RoomEvent>, what: &str) -> tonic::Status {
    loop {
        match within(PATIENCE, what, stream.message()).await {
            Ok(Some(_)) => continue,
            Ok(None) => panic!("{what}: ended without a status"),
            Err(status) => return status,
        }
    }
}

/// Whatever the stream carries within `quiet` of silence.
async fn events_within(stream: &mut tonic::Streaming<pb::RoomEvent>, quiet: Duration) -> Vec<room_event::Event> {
    let mut events = Vec::new();
    while let Ok(item) = tokio::time::timeout(quiet, stream.message()).await {
        match item {
            Ok(Some(event)) => events.extend(event.event),
            other => panic!("the stream ended: {other:?}"),
        }
    }
    events
}

/// Three nodes, one member in the room per node (joined at its own node), and
/// each member's generation.
async fn a_room_with_a_member_at_every_node(
    etcd: &EtcdServer,
) -> (Vec<TestServer>, presence_cluster::SlotMap, Vec<(String, &'static str, u64)>) {
    let (servers, map) = three_nodes_with(etcd, presence_server::testing::fast_config, false).await;
    let mut members = Vec::new();
    for (user, node) in one_user_per_node(&map) {
        let generation = register_at(&mut server_of(&servers, node).client().await, &user).await;
        members.push((user, node, generation));
    }
    (servers, map, members)
}

/// C1, C2, R1–R3, S3: a room whose members' users live on all three nodes is
/// one room: Join, Leave and Signal at each member's node answer the room
/// owner's versions, a watcher at another node sees every change in version
/// order, and every node answers the same snapshot. A lease that ends ends
/// its membership there too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c1_a_rooms_members_on_every_node_make_one_room_that_any_node_reads() {
    let etcd = EtcdServer::start().await;
    let (servers, map, members) = a_room_with_a_member_at_every_node(&etcd).await;
    let room_owner = map.owner(slot_of(ROOM, SLOTS)).unwrap().node.clone();
    let elsewhere = NODES.iter().find(|node| **node != room_owner).unwrap();
    let (mut stream, first) = watch_room(&mut server_of(&servers, elsewhere).client().await).await;
    assert!(first.members.is_empty());
    let mut last = first.version;

    for (user, node, generation) in &members {
        let joined = server_of(&servers, node).client().await.join(join(user, *generation, node)).await.unwrap();
        let joined = joined.into_inner();
        assert!(joined.changed, "{user} joined");
        assert!(joined.room_version > last, "{user}: the owner's version {} after {last}", joined.room_version);
        assert_eq!(
            next_change(&mut stream).await,
            (pb::RoomChangeKind::RoomChangeJoined, user.clone(), joined.room_version)
        );
        last = joined.room_version;
    }
    // The typist's node is not the room's: its calls' versions come from the owner.
    let typist_at = members.iter().position(|(_, node, _)| *node != room_owner).unwrap();
    let rest: Vec<usize> = (0..members.len()).filter(|&at| at != typist_at).collect();
    let (typist, typist_node, typist_generation) = &members[typist_at];
    let typing = pb::SignalRequest {
        user_id: typist.clone(),
        session_id: "s".into(),
        generation: *typist_generation,
        room_id: ROOM.into(),
        kind: "typing".into(),
        ttl_ms: 5_000,
    };
    let signalled = server_of(&servers, typist_node).client().await.signal(typing.clone()).await.unwrap().into_inner();
    assert!(signalled.changed && signalled.room_version > last);
    match next_room_event(&mut stream).await.unwrap() {
        room_event::Event::Signals(set) => {
            assert_eq!((set.user_ids.clone(), set.version), (vec![typist.clone()], signalled.room_version), "{set:?}");
        }
        other => panic!("expected the signal set, got {other:?}"),
    }
    last = signalled.room_version;
    // A call that changes nothing at the room answers its version all the same.
    let renewed = server_of(&servers, typist_node).client().await.signal(typing.clone()).await.unwrap().into_inner();
    assert_eq!((renewed.changed, renewed.room_version), (false, last), "a renewed signal");
    let (other, other_node, other_generation) = &members[rest[0]];
    let not_in = pb::LeaveRequest {
        user_id: other.clone(),
        session_id: "s".into(),
        generation: *other_generation,
        room_id: "elsewhere".into(),
    };
    let answered = server_of(&servers, other_node).client().await.leave(not_in).await.unwrap().into_inner();
    assert!(!answered.removed, "{answered:?}");

    // A Join in a Leases batch, routed by a gateway's ClusterLeases, answers the owner's version too.
    let leases = presence_client::ClusterLeases::new(&servers[0].url(), SLOTS, Default::default()).unwrap();
    let item = pb::LeaseItem { op: Some(pb::lease_item::Op::Join(join(typist, *typist_generation, typist_node))) };
    let answered = leases.submit_batch(vec![item]).await.remove(0);
    let Ok(pb::lease_result::Result::Join(again)) = presence_client::lease_result(answered.clone()) else {
        panic!("a Join result: {answered:?}")
    };
    assert!(!again.changed && again.room_version == last, "the same metadata changes nothing: {again:?}");
    let item = pb::LeaseItem { op: Some(pb::lease_item::Op::Join(join(typist, *typist_generation, "laptop"))) };
    let answered = leases.submit_batch(vec![item]).await.remove(0);
    let Ok(pb::lease_result::Result::Join(updated)) = presence_client::lease_result(answered.clone()) else {
        panic!("a Join result: {answered:?}")
    };
    assert!(updated.room_version > last, "{updated:?}");
    assert_eq!(
        next_change(&mut stream).await,
        (pb::RoomChangeKind::RoomChangeUpdated, typist.clone(), updated.room_version)
    );
    let put_back = pb::LeaseItem { op: Some(pb::lease_item::Op::Join(join(typist, *typist_generation, typist_node))) };
    leases.submit_batch(vec![put_back]).await;
    let (_, _, version) = next_change(&mut stream).await;
    assert!(version > updated.room_version);
    last = version;

    let expected: BTreeMap<String, (String, u32)> =
        members.iter().map(|(user, node, _)| (user.clone(), (node.to_string(), 1))).collect();
    for server in &servers {
        let snapshot = room_snapshot(&mut server.client().await).await.unwrap();
        assert_eq!(listed(&snapshot), expected, "every node answers the whole room");
        assert_eq!((snapshot.version, snapshot.users, snapshot.sessions), (last, 3, 3));
    }

    // A leave, and a lease that ends, at their own nodes.
    let (leaver, leaver_node, leaver_generation) = &members[rest[1]];
    let leave = pb::LeaveRequest {
        user_id: leaver.clone(),
        session_id: "s".into(),
        generation: *leaver_generation,
        room_id: ROOM.into(),
    };
    let left = server_of(&servers, leaver_node).client().await.leave(leave).await.unwrap().into_inner();
    assert!(left.removed && left.changed && left.room_version > last);
    assert_eq!(next_change(&mut stream).await, (pb::RoomChangeKind::RoomChangeLeft, leaver.clone(), left.room_version));
    let (gone, gone_node, gone_generation) = &members[rest[0]];
    let unregister = pb::UnregisterRequest {
        user_id: gone.clone(),
        session_id: "s".into(),
        generation: *gone_generation,
        ..Default::default()
    };
    server_of(&servers, gone_node).client().await.unregister(unregister).await.unwrap();
    let (kind, user, version) = next_change(&mut stream).await;
    assert_eq!((kind, &user), (pb::RoomChangeKind::RoomChangeLeft, gone));
    assert!(version > left.room_version);
    for server in &servers {
        let snapshot = room_snapshot(&mut server.client().await).await.unwrap();
        let listed: Vec<&String> = snapshot.members.iter().map(|member| &member.user_id).collect();
        assert_eq!(listed, [typist]);
        assert_eq!(snapshot.version, version);
    }
    for server in servers {
        server.stop().await;
    }
}

/// The next count a count-mode watch sends: (users, sessions).
async fn next_count(stream: &mut tonic::Streaming<pb::RoomEvent>) -> (u32, u32) {
    match next_room_event(stream).await.expect("a healthy stream") {
        room_event::Event::Count(count) => (count.users, count.sessions),
        other => panic!("expected a count, got {other:?}"),
    }
}

/// R3, R4 across nodes: a count-mode watch at any node counts the members of
/// every node but those their own nodes hold invisible, and follows a
/// member's visibility as its node changes it, and members coming.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r3_counts_from_any_node_leave_out_members_their_own_nodes_hold_invisible() {
    let etcd = EtcdServer::start().await;
    let (servers, map, members) = a_room_with_a_member_at_every_node(&etcd).await;
    let room_owner = map.owner(slot_of(ROOM, SLOTS)).unwrap().node.clone();
    let (shy, shy_node, _) = members.iter().find(|(_, node, _)| *node != room_owner).unwrap().clone();
    let mut at_shy = server_of(&servers, shy_node).client().await;
    let visibility = |visibility: pb::Visibility| pb::SetVisibilityRequest {
        user_id: shy.clone(),
        visibility: visibility as i32,
        ..Default::default()
    };
    at_shy.set_visibility(visibility(pb::Visibility::Nobody)).await.unwrap();
    for (user, node, generation) in &members {
        server_of(&servers, node).client().await.join(join(user, *generation, node)).await.unwrap();
    }
    let watcher_node = NODES.iter().find(|node| **node != room_owner).unwrap();
    let counts = pb::WatchRoomRequest {
        room_id: ROOM.into(),
        mode: pb::RoomWatchMode::RoomWatchCount as i32,
        count_interval_ms: 100,
        ..Default::default()
    };
    let mut client = server_of(&servers, watcher_node).client().await;
    let mut stream = client.watch_room(counts).await.unwrap().into_inner();
    assert_eq!(next_count(&mut stream).await, (2, 2), "the invisible member is counted by nobody");
    let snapshot = room_snapshot(&mut client).await.unwrap();
    assert_eq!((snapshot.users, snapshot.members.len()), (3, 3), "a service acting for no viewer lists it");

    at_shy.set_visibility(visibility(pb::Visibility::Everyone)).await.unwrap();
    assert_eq!(next_count(&mut stream).await, (3, 3), "counted once its node says it is visible");
    let (second, second_node, _) = members.iter().find(|(user, ..)| *user != shy).unwrap();
    let node = server_of(&servers, second_node);
    let generation = {
        let mut client = node.client().await;
        let request = pb::RegisterRequest {
            user_id: second.clone(),
            session_id: "tab".into(),
            gateway_id: "gw".into(),
            ttl_ms: 60_000,
            ..Default::default()
        };
        client.register(request).await.unwrap().into_inner().generation
    };
    let mut tab = join(second, generation, "tab");
    tab.session_id = "tab".into();
    node.client().await.join(tab).await.unwrap();
    assert_eq!(next_count(&mut stream).await, (3, 4), "a second session of a member");
    at_shy.set_visibility(visibility(pb::Visibility::Nobody)).await.unwrap();
    assert_eq!(next_count(&mut stream).await, (2, 3));
    for server in servers {
        server.stop().await;
    }
}

/// The members a viewer's room read lists, by user.
async fn listed_to(client: &mut PresenceClient<Channel>, viewer: &str) -> Result<Vec<String>, tonic::Status> {
    let request = pb::RoomSnapshotRequest { room_id: ROOM.into(), viewer_id: viewer.into() };
    let snapshot = client.room_snapshot(request).await?.into_inner();
    let mut users: Vec<String> = snapshot.members.into_iter().map(|member| member.user_id).collect();
    users.sort();
    assert_eq!(snapshot.users as usize, users.len(), "users counts those listed");
    Ok(users)
}

/// The users a room snapshot event lists, sorted.
fn users_of(snapshot: &pb::RoomSnapshot) -> Vec<String> {
    let mut users: Vec<String> = snapshot.members.iter().map(|member| member.user_id.clone()).collect();
    users.sort();
    users
}

/// R4, P2–P4 across nodes: the room's owner lists to a viewer the members
/// their own nodes let it see (an invisible one never, an audience one that
/// granted it), at every node alike; a room the viewer is not in is unknown
/// to it; a viewer's watch starts over when a member's relations change at
/// the member's node, without it, or with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_viewer_reads_a_room_across_nodes_as_each_members_own_node_allows() {
    let etcd = EtcdServer::start().await;
    let (servers, map, members) = a_room_with_a_member_at_every_node(&etcd).await;
    let room_owner = map.owner(slot_of(ROOM, SLOTS)).unwrap().node.clone();
    let (viewer, _, _) = members.iter().find(|(_, node, _)| *node == room_owner).unwrap().clone();
    let others: Vec<&(String, &str, u64)> = members.iter().filter(|(_, node, _)| *node != room_owner).collect();
    let (hidden, hidden_node) = (others[0].0.clone(), others[0].1);
    let (granting, granting_node) = (others[1].0.clone(), others[1].1);
    let visibility = |user: &str, visibility: pb::Visibility| pb::SetVisibilityRequest {
        user_id: user.into(),
        visibility: visibility as i32,
        ..Default::default()
    };
    let mut at_hidden = server_of(&servers, hidden_node).client().await;
    at_hidden.set_visibility(visibility(&hidden, pb::Visibility::Nobody)).await.unwrap();
    let mut at_granting = server_of(&servers, granting_node).client().await;
    at_granting.set_visibility(visibility(&granting, pb::Visibility::Audience)).await.unwrap();
    let grant = pb::AudienceRequest { user_id: granting.clone(), viewer_ids: vec![viewer.clone()] };
    at_granting.grant_audience(grant.clone()).await.unwrap();
    for (user, node, generation) in &members {
        server_of(&servers, node).client().await.join(join(user, *generation, node)).await.unwrap();
    }

    let mut shown = vec![viewer.clone(), granting.clone()];
    shown.sort();
    for server in &servers {
        let mut client = server.client().await;
        assert_eq!(listed_to(&mut client, &viewer).await.unwrap(), shown, "at {}", server.url());
        let stranger = listed_to(&mut client, "stranger").await.unwrap_err();
        assert_eq!(stranger.code(), Code::NotFound, "a room the viewer is not in: {stranger:?}");
        let to_hidden = listed_to(&mut client, &hidden).await.unwrap();
        assert!(
            to_hidden.contains(&hidden) && !to_hidden.contains(&granting),
            "an invisible member sees itself: {to_hidden:?}"
        );
    }

    // A watch at a node that is neither the room's nor the granting member's.
    let watcher_node = NODES.iter().find(|node| **node != room_owner && **node != granting_node).unwrap();
    let mut client = server_of(&servers, watcher_node).client().await;
    let mut request = members_of(ROOM);
    request.viewer_id = viewer.clone();
    let mut stream = client.watch_room(request).await.unwrap().into_inner();
    let Ok(room_event::Event::Snapshot(first)) = next_room_event(&mut stream).await else { panic!("a snapshot first") };
    assert_eq!(users_of(&first), shown);

    at_granting.revoke_audience(grant).await.unwrap();
    let Ok(room_event::Event::Snapshot(resynced)) = next_room_event(&mut stream).await else {
        panic!("a fresh snapshot after the member's node changed its audience")
    };
    assert_eq!(users_of(&resynced), vec![viewer.clone()]);
    at_hidden.set_visibility(visibility(&hidden, pb::Visibility::Everyone)).await.unwrap();
    let Ok(room_event::Event::Snapshot(shown_again)) = next_room_event(&mut stream).await else {
        panic!("a fresh snapshot after the member's node made it visible")
    };
    let mut both = vec![viewer.clone(), hidden.clone()];
    both.sort();
    assert_eq!(users_of(&shown_again), both);
    for server in servers {
        server.stop().await;
    }
}

fn access(access: pb::RoomAccess) -> pb::SetRoomAccessRequest {
    pb::SetRoomAccessRequest { room_id: ROOM.into(), access: access as i32 }
}

/// R4, C1, C3: a room's access set at any node is set by the room's owner and
/// kept at every node: a caller that is not a member reads a public room at
/// any node, still after the room's slot moved, until it is made a members'
/// room again, which ends that caller's watch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r4_a_rooms_access_set_at_any_node_holds_at_every_node_and_moves_with_its_slot() {
    let etcd = EtcdServer::start().await;
    let (servers, map, members) = a_room_with_a_member_at_every_node(&etcd).await;
    for (user, node, generation) in &members {
        server_of(&servers, node).client().await.join(join(user, *generation, node)).await.unwrap();
    }
    let room_slot = slot_of(ROOM, SLOTS);
    let room_owner = map.owner(room_slot).unwrap().node.clone();
    let elsewhere: Vec<&str> = NODES.iter().copied().filter(|node| *node != room_owner).collect();
    for server in &servers {
        let refused = listed_to(&mut server.client().await, "stranger").await.unwrap_err();
        assert_eq!(refused.code(), Code::NotFound, "a members' room: {refused:?}");
    }
    server_of(&servers, elsewhere[0]).client().await.set_room_access(access(pb::RoomAccess::Public)).await.unwrap();
    for server in &servers {
        listed_to(&mut server.client().await, "stranger").await.expect("a public room, at every node");
    }

    // The room's slot moves; the new owner had the access already.
    let request = pb::MoveSlotsRequest { slots: vec![room_slot], to_node: elsewhere[1].to_string() };
    let cluster_url = server_of(&servers, &room_owner).url();
    let mut cluster = presence_proto::v1::cluster_client::ClusterClient::connect(cluster_url).await.unwrap();
    cluster.move_slots(request).await.unwrap();
    map_where(&etcd.client().await, "the room's slot moved", |map| {
        map.owner(room_slot).is_some_and(|owner| owner.node == elsewhere[1])
    })
    .await;
    let mut at_other = server_of(&servers, elsewhere[0]).client().await;
    room_snapshot_once_answered(&mut at_other).await;
    listed_to(&mut at_other, "stranger").await.expect("still public at the new owner");
    let mut request = members_of(ROOM);
    request.viewer_id = "stranger".into();
    let mut stream = at_other.watch_room(request).await.unwrap().into_inner();
    assert!(matches!(next_room_event(&mut stream).await, Ok(room_event::Event::Snapshot(_))));

    // Made a members' room again, at the old owner: the stranger may read it nowhere, and its watch ends.
    server_of(&servers, &room_owner).client().await.set_room_access(access(pb::RoomAccess::Members)).await.unwrap();
    let status = ended(&mut stream, "the stranger's watch ends").await;
    assert_eq!(status.code(), Code::NotFound, "{status:?}");
    for server in &servers {
        let refused = listed_to(&mut server.client().await, "stranger").await.unwrap_err();
        assert_eq!(refused.code(), Code::NotFound, "a members' room again: {refused:?}");
    }
    for server in servers {
        server.stop().await;
    }
}

/// C3, M4: moving the slot of a member's user publishes nothing to the room;
/// moving the room's own slot ends its watchers at the old owner, and the
/// new owner, having gathered every node's members, answers the same room at
/// a greater version and takes the changes that follow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c3_a_room_keeps_its_members_and_its_versions_grow_when_its_slot_or_a_members_slot_moves() {
    let etcd = EtcdServer::start().await;
    let (servers, map, members) = a_room_with_a_member_at_every_node(&etcd).await;
    let mut last = 0;
    for (user, node, generation) in &members {
        let joined = server_of(&servers, node).client().await.join(join(user, *generation, node)).await.unwrap();
        last = joined.into_inner().room_version;
    }
    let room_slot = slot_of(ROOM, SLOTS);
    let room_owner = map.owner(room_slot).unwrap().node.clone();
    let watcher_node = NODES.iter().find(|node| **node != room_owner).unwrap();
    let (mut stream, before) = watch_room(&mut server_of(&servers, watcher_node).client().await).await;
    assert_eq!(before.version, last);
    let cluster_client = |node: &str| {
        let url = server_of(&servers, node).url();
        async move { presence_proto::v1::cluster_client::ClusterClient::connect(url).await.unwrap() }
    };

    // A member whose user lives on neither the room's node nor the watcher's moves to the watcher's node.
    let (mover, mover_node, _) =
        members.iter().find(|(_, node, _)| *node != room_owner && node != watcher_node).unwrap();
    let mover_slot = slot_of(mover, SLOTS);
    assert_ne!(mover_slot, room_slot);
    let request = pb::MoveSlotsRequest { slots: vec![mover_slot], to_node: watcher_node.to_string() };
    cluster_client(mover_node).await.move_slots(request).await.unwrap();
    map_where(&etcd.client().await, "the member's slot moved", |map| {
        map.owner(mover_slot).is_some_and(|owner| owner.node == *watcher_node)
    })
    .await;
    let seen = events_within(&mut stream, Duration::from_millis(1_000)).await;
    assert!(seen.is_empty(), "a member that moves publishes nothing: {seen:?}");
    let unchanged = room_snapshot(&mut servers[0].client().await).await.unwrap();
    assert_eq!((listed(&unchanged), unchanged.version), (listed(&before), before.version));

    // The room's own slot moves to the node the watcher is not on, and not its old owner.
    let new_owner = NODES.iter().find(|node| **node != room_owner && *node != watcher_node).unwrap();
    let request = pb::MoveSlotsRequest { slots: vec![room_slot], to_node: new_owner.to_string() };
    cluster_client(&room_owner).await.move_slots(request).await.unwrap();
    map_where(&etcd.client().await, "the room's slot moved", |map| {
        map.owner(room_slot).is_some_and(|owner| owner.node == *new_owner)
    })
    .await;
    let ended = ended(&mut stream, "the old owner ends the watch").await;
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    let (mut stream, after) = watch_room(&mut server_of(&servers, watcher_node).client().await).await;
    assert_eq!(listed(&after), listed(&before), "the new owner gathered every member");
    assert!(after.version > before.version, "versions go on growing at the new owner (M4)");
    for server in &servers {
        let snapshot = room_snapshot_once_answered(&mut server.client().await).await;
        assert_eq!((listed(&snapshot), snapshot.version), (listed(&after), after.version));
    }

    // Changes reach the new owner, from the moved member's new node too.
    let (_, _, mover_generation) = members.iter().find(|(user, ..)| user == mover).unwrap();
    let update = join(mover, *mover_generation, "tablet");
    let updated = server_of(&servers, watcher_node).client().await.join(update).await.unwrap().into_inner();
    assert!(!updated.changed && updated.room_version > after.version);
    assert_eq!(
        next_change(&mut stream).await,
        (pb::RoomChangeKind::RoomChangeUpdated, mover.clone(), updated.room_version)
    );
    for server in servers {
        server.stop().await;
    }
}

/// C4, M4: the room's owner killed with `kill -9`: the follower that takes
/// the room's slot over gathers the members from every node (the dead node's
/// own member from the node that took its user over) and answers the same
/// room at a greater version. In a room another node owns, the dead node's
/// member stays without a flip (its follower speaks for it), its signal
/// ends; and nothing leaves once the dead node is forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn c4_a_rooms_owner_killed_with_kill_9_is_followed_by_a_node_that_gathers_its_members() {
    let etcd = EtcdServer::start().await;
    let (node_a, servers, map) = node_a_apart(&etcd, Duration::from_secs(30)).await;
    let room =
        (0..).map(|i| format!("hall-{i}")).find(|room| map.owner(slot_of(room, SLOTS)).unwrap().node == "node-a");
    let room = room.unwrap();
    let mut joined_version = 0;
    let mut expected = BTreeMap::new();
    for (user, node) in one_user_per_node(&map) {
        let mut client = match node {
            "node-a" => PresenceClient::connect(node_a.url()).await.unwrap(),
            node => server_of(&servers[..], node).client().await,
        };
        let generation = register_at(&mut client, &user).await;
        joined_version = client.join(join_in(&room, &user, generation, node)).await.unwrap().into_inner().room_version;
        expected.insert(user, (node.to_string(), 1));
    }
    let mut at_b = servers[0].client().await;
    let (mut stream, before) = watch_room_of(&mut at_b, &room).await;
    assert_eq!((listed(&before), before.version), (expected.clone(), joined_version));
    // node-a's member is also in a room of node-b's, typing there.
    let den = (0..).map(|i| format!("den-{i}")).find(|room| map.owner(slot_of(room, SLOTS)).unwrap().node == "node-b");
    let den = den.unwrap();
    let (typist, _) = one_user_per_node(&map).remove(0);
    let mut at_a = PresenceClient::connect(node_a.url()).await.unwrap();
    let sessions = at_a.list_sessions(pb::ListSessionsRequest { user_id: typist.clone() }).await.unwrap().into_inner();
    let generation = sessions.sessions[0].generation;
    at_a.join(join_in(&den, &typist, generation, "node-a")).await.unwrap();
    let typing = pb::SignalRequest {
        user_id: typist.clone(),
        session_id: "s".into(),
        generation,
        room_id: den.clone(),
        kind: "typing".into(),
        ttl_ms: 10_000,
    };
    at_a.signal(typing).await.unwrap();
    let (mut den_stream, den_before) = watch_room_of(&mut servers[1].client().await, &den).await;
    assert_eq!(den_before.members.len(), 1);
    assert_eq!(den_before.signals.len(), 1, "{den_before:?}");
    // The follower's copy of node-a's users is at most an interval behind.
    tokio::time::sleep(Duration::from_millis(500)).await;

    node_a.kill9();
    let ended = ended(&mut stream, "the dead owner's watch ends").await;
    assert_eq!(ended.code(), Code::Unavailable, "{ended:?}");
    map_where(&etcd.client().await, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
    let (_, after) = watch_room_of(&mut at_b, &room).await;
    assert_eq!(listed(&after), expected, "every member, node-a's own from the node that took its user over");
    assert!(after.version > before.version, "versions go on growing (M4)");

    // In node-b's room: the signal ends, the member stays.
    match next_room_event(&mut den_stream).await.unwrap() {
        room_event::Event::Signals(set) => assert!(set.user_ids.is_empty(), "{set:?}"),
        other => panic!("the signal set emptied, got {other:?}"),
    }

    // Once node-a is forgotten, what it last spoke for would leave; its user lives on at its follower.
    let quiet = events_within(&mut den_stream, Duration::from_secs(12)).await;
    assert!(quiet.is_empty(), "nothing more in node-b's room: {quiet:?}");
    let later = room_snapshot_of(&mut servers[1].client().await, &room).await.unwrap();
    assert_eq!(listed(&later), expected);
    let den_later = room_snapshot_of(&mut servers[1].client().await, &den).await.unwrap();
    assert_eq!(den_later.members.iter().map(|member| member.user_id.clone()).collect::<Vec<_>>(), vec![typist]);
    for server in servers {
        server.stop().await;
    }
}

/// A room name the map gives to `node`.
fn room_at(map: &presence_cluster::SlotMap, node: &str) -> String {
    (0..).map(|i| format!("room-{i}")).find(|room| map.owner(slot_of(room, SLOTS)).unwrap().node == node).unwrap()
}

/// The counts a WatchRoomCounts stream holds, by room, as `(users, sessions)`.
async fn counts_until(
    stream: &mut tonic::Streaming<pb::RoomCounts>,
    held: &mut BTreeMap<String, (u32, u32)>,
    what: &str,
    done: impl Fn(&BTreeMap<String, (u32, u32)>) -> bool,
) {
    while !done(held) {
        let message = within(PATIENCE, what, stream.message()).await.expect("a healthy stream").expect("open");
        held.extend(message.counts.into_iter().map(|count| (count.room_id, (count.users, count.sessions))));
    }
}

/// R7 across nodes: one WatchRoomCounts at any node counts rooms whose owners
/// are every node, leaving out members their own nodes hold invisible; a
/// RoomCounts at every node answers the same; and a room whose slot moves
/// to another node goes on being counted on the open stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn r7_one_stream_at_any_node_counts_rooms_of_every_owner_and_follows_them_through_moves() {
    let etcd = EtcdServer::start().await;
    let (servers, map, members) = a_room_with_a_member_at_every_node(&etcd).await;
    let rooms: Vec<String> = NODES.iter().map(|node| room_at(&map, node)).collect();
    for (user, node, generation) in &members {
        let mut client = server_of(&servers, node).client().await;
        for room in &rooms {
            client.join(join_in(room, user, *generation, node)).await.unwrap();
        }
    }
    let watcher_node = NODES[0];
    let request = pb::WatchRoomCountsRequest { room_ids: rooms.clone(), count_interval_ms: 100, ..Default::default() };
    let mut client = server_of(&servers, watcher_node).client().await;
    let mut stream = client.watch_room_counts(request).await.unwrap().into_inner();
    let mut held = BTreeMap::new();
    counts_until(&mut stream, &mut held, "every room counted", |held| {
        rooms.iter().all(|room| held.get(room) == Some(&(3, 3)))
    })
    .await;
    for server in &servers {
        let read = pb::RoomCountsRequest { room_ids: rooms.clone(), ..Default::default() };
        let read = server.client().await.room_counts(read).await.unwrap().into_inner();
        assert!(read.counts.iter().zip(&rooms).all(|(count, room)| count.room_id == *room && count.users == 3));
    }

    // A member its own node now holds invisible is counted by nobody, in every room.
    let (shy, shy_node, _) = members.iter().find(|(_, node, _)| *node != watcher_node).unwrap();
    let invisible = pb::SetVisibilityRequest {
        user_id: shy.clone(),
        visibility: pb::Visibility::Nobody as i32,
        ..Default::default()
    };
    server_of(&servers, shy_node).client().await.set_visibility(invisible).await.unwrap();
    counts_until(&mut stream, &mut held, "the invisible member uncounted", |held| {
        rooms.iter().all(|room| held.get(room) == Some(&(2, 2)))
    })
    .await;

    // A room of another node moves to the watcher's node: still counted, its changes too.
    let moving = &rooms[1];
    let (from, slot) = (NODES[1], slot_of(moving, SLOTS));
    let cluster = presence_proto::v1::cluster_client::ClusterClient::connect(server_of(&servers, from).url());
    let request = pb::MoveSlotsRequest { slots: vec![slot], to_node: watcher_node.to_string() };
    cluster.await.unwrap().move_slots(request).await.unwrap();
    map_where(&etcd.client().await, "the room's slot moved", |map| {
        map.owner(slot).is_some_and(|owner| owner.node == watcher_node)
    })
    .await;
    let (member, node, _) = members.iter().find(|(user, ..)| user != shy).unwrap();
    let mut at_member = server_of(&servers, node).client().await;
    let second = pb::RegisterRequest {
        user_id: member.clone(),
        session_id: "tab".into(),
        gateway_id: "gw".into(),
        ttl_ms: 60_000,
        ..Default::default()
    };
    let generation = at_member.register(second).await.unwrap().into_inner().generation;
    let mut tab = join_in(moving, member, generation, "tab");
    tab.session_id = "tab".into();
    within(PATIENCE, "a join once the room moved", async {
        while at_member.join(tab.clone()).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    counts_until(&mut stream, &mut held, "the moved room's new session counted", |held| {
        held.get(moving) == Some(&(2, 3))
    })
    .await;
    assert_eq!(held[&rooms[0]], (2, 2));
    assert_eq!(held[&rooms[2]], (2, 2));
    for server in servers {
        server.stop().await;
    }
}
