//! F3: the change feed across a cluster. A consumer at any node gets every
//! node's flips in cursor order, each once, while a node's slots move to
//! another and the node stops (its entries go with its slots); a consumer
//! resuming later at another node still gets them; consumers sharing the
//! slots get disjoint parts whose union is everything; a node killed with
//! kill -9 leaves a gap of each slot it owned, never a silent hole.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;

use presence_proto::v1::change_event::Event;

use super::*;
use crate::common::{generation_of, within};

/// An acknowledged flip: the user's version after it, whether it went
/// ONLINE, and when its answer came.
type Acked = (u64, bool, Instant);

/// Flips each of `users` ONLINE (a register) and OFFLINE (its unregister)
/// through `leases`, round after round, until told to stop, as gateways
/// do: an item refused while its slot moves or its owner is dead is sent
/// again. Returns every flip the owners answered, by user.
fn keep_flipping(leases: Arc<ClusterLeases>, users: Vec<String>) -> Running<BTreeMap<String, Vec<Acked>>> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut acked: BTreeMap<String, Vec<Acked>> = BTreeMap::new();
        let mut generations: BTreeMap<String, u64> = BTreeMap::new();
        loop {
            // Users with a session go OFFLINE, the others ONLINE.
            let items: Vec<(String, pb::LeaseItem)> = users
                .iter()
                .map(|user| {
                    let item = match generations.get(user) {
                        Some(&generation) => pb::LeaseItem {
                            op: Some(pb::lease_item::Op::Unregister(pb::UnregisterRequest {
                                user_id: user.clone(),
                                session_id: "s".into(),
                                generation,
                                ..Default::default()
                            })),
                        },
                        None => register(user),
                    };
                    (user.clone(), item)
                })
                .collect();
            let results = leases.submit_batch(items.iter().map(|(_, item)| item.clone()).collect()).await;
            for ((user, _), result) in items.iter().zip(results) {
                match result.result {
                    Some(pb::lease_result::Result::Register(done)) if result.code == 0 => {
                        generations.insert(user.clone(), done.generation);
                        let presence = done.presence.expect("a register answers the presence");
                        if done.changed {
                            acked.entry(user.clone()).or_default().push((presence.version, true, Instant::now()));
                        }
                    }
                    Some(pb::lease_result::Result::Unregister(done)) if result.code == 0 => {
                        generations.remove(user);
                        let presence = done.presence.expect("an unregister answers the presence");
                        if done.changed {
                            acked.entry(user.clone()).or_default().push((presence.version, false, Instant::now()));
                        }
                    }
                    // Refused (a slot moving, an owner gone): sent again next round.
                    _ => {}
                }
            }
            tokio::select! {
                _ = &mut stopped => break,
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        acked
    });
    (stop, task)
}

/// A consumer reading a Changes stream at `url` into a shared list (progress
/// left out), from `from`, of `slots` (empty: all).
struct Consumer {
    events: Arc<std::sync::Mutex<Vec<pb::ChangeEvent>>>,
    reader: tokio::task::JoinHandle<()>,
}

impl Consumer {
    async fn open(url: &str, from: pb::ChangesFrom, cursor: &[u8], slots: Vec<u32>) -> Consumer {
        let mut client = PresenceClient::connect(url.to_owned()).await.unwrap();
        let request = pb::ChangesRequest { from: from as i32, cursor: cursor.to_vec(), slots, ..Default::default() };
        let mut stream = client.changes(request).await.expect("Changes opens at a cluster node").into_inner();
        let events = Arc::new(std::sync::Mutex::new(Vec::new()));
        let kept = Arc::clone(&events);
        let reader = tokio::spawn(async move {
            while let Some(event) = stream.message().await.expect("a healthy merged feed") {
                if !matches!(event.event, Some(Event::Progress(_))) {
                    kept.lock().unwrap().push(event);
                }
            }
        });
        Consumer { events, reader }
    }

    fn events(&self) -> Vec<pb::ChangeEvent> {
        self.events.lock().unwrap().clone()
    }

    /// Waits until what it received satisfies `done`, within the patience.
    async fn until(&self, what: &str, done: impl Fn(&[pb::ChangeEvent]) -> bool) -> Vec<pb::ChangeEvent> {
        let deadline = Instant::now() + PATIENCE;
        loop {
            let events = self.events();
            if done(&events) {
                return events;
            }
            assert!(!self.reader.is_finished(), "{what}: the feed ended");
            assert!(Instant::now() < deadline, "{what}: not within {PATIENCE:?}; {} events", events.len());
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    fn close(self) {
        self.reader.abort();
    }
}

/// The flips in `events`, by user: (version, online), in the order received.
fn flips_by_user(events: &[pb::ChangeEvent]) -> BTreeMap<String, Vec<(u64, bool)>> {
    let mut flips: BTreeMap<String, Vec<(u64, bool)>> = BTreeMap::new();
    for event in events {
        if let Some(Event::Flip(user)) = &event.event {
            let online = user.state == pb::State::Online as i32;
            flips.entry(user.user_id.clone()).or_default().push((user.version, online));
        }
    }
    flips
}

/// The acknowledged flips without their instants.
fn acked_flips(acked: &BTreeMap<String, Vec<Acked>>) -> BTreeMap<String, Vec<(u64, bool)>> {
    acked
        .iter()
        .map(|(user, flips)| (user.clone(), flips.iter().map(|&(v, online, _)| (v, online)).collect()))
        .collect()
}

/// Whether every acknowledged flip is among `events`.
fn has_every(events: &[pb::ChangeEvent], acked: &BTreeMap<String, Vec<(u64, bool)>>) -> bool {
    let received = flips_by_user(events);
    acked.iter().all(|(user, flips)| {
        let got: BTreeSet<u64> =
            received.get(user).map(|got| got.iter().map(|(v, _)| *v).collect()).unwrap_or_default();
        flips.iter().all(|(version, _)| got.contains(version))
    })
}

/// F1 across the cluster: cursors strictly grow (none twice), and each
/// user's versions grow.
fn assert_in_cursor_order_once(events: &[pb::ChangeEvent], what: &str) {
    let cursors: Vec<&Vec<u8>> = events.iter().map(|event| &event.cursor).collect();
    for pair in cursors.windows(2) {
        assert!(pair[0] < pair[1], "{what}: a cursor not after the one before: {:02x?} then {:02x?}", pair[0], pair[1]);
    }
    for (user, flips) in flips_by_user(events) {
        assert!(flips.windows(2).all(|pair| pair[0].0 < pair[1].0), "{what}: {user}'s versions go back: {flips:?}");
    }
}

fn gaps(events: &[pb::ChangeEvent]) -> Vec<(u32, String)> {
    events
        .iter()
        .filter_map(|event| match &event.event {
            Some(Event::Gap(gap)) => Some((event.slot, gap.reason.clone())),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_every_slot_of_a_node_moves_and_it_stops_while_users_flip_and_consumers_anywhere_get_every_flip_once() {
    let etcd = EtcdServer::start().await;
    // Slots move by hand only: nothing evens them out meanwhile.
    let (mut servers, map) = three_nodes_with(&etcd, fast_config, false).await;
    let users: Vec<String> = (0..240).map(|i| format!("feed-{i}")).collect();
    let moving: Vec<u32> = map.owned_by("node-a").collect();
    let on_a = users.iter().filter(|user| moving.contains(&slot_of(user, SLOTS))).count();
    assert!(on_a > 30, "node-a owns {on_a} of the users");

    // Consumers at node-c: one of every slot, two sharing the slots.
    let url_c = servers[2].url();
    let all = Consumer::open(&url_c, pb::ChangesFrom::Now, &[], Vec::new()).await;
    let low = Consumer::open(&url_c, pb::ChangesFrom::Now, &[], (0..SLOTS / 2).collect()).await;
    let high = Consumer::open(&url_c, pb::ChangesFrom::Now, &[], (SLOTS / 2..SLOTS).collect()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;

    // Rooms, some of them in node-a's slots, each occupied by one member.
    let leases = Arc::new(ClusterLeases::new(&servers[1].url(), SLOTS, LeaseChannelConfig::default()).unwrap());
    let rooms: Vec<String> = (0..12).map(|i| format!("room-{i}")).collect();
    assert!(rooms.iter().any(|room| moving.contains(&slot_of(room, SLOTS))), "a room in node-a's slots");
    let mut member_flips: BTreeMap<String, Vec<(u64, bool)>> = BTreeMap::new();
    for (i, room) in rooms.iter().enumerate() {
        let member = format!("member-{i}");
        let registered = until_not_refused(&leases, register(&member)).await;
        let generation = generation_of(&registered);
        if let Some(pb::lease_result::Result::Register(done)) = &registered.result {
            member_flips.insert(member.clone(), vec![(done.presence.as_ref().unwrap().version, true)]);
        }
        let join = pb::JoinRequest {
            user_id: member.clone(),
            session_id: "s".into(),
            generation,
            room_id: room.clone(),
            ..Default::default()
        };
        let joined = until_not_refused(&leases, pb::LeaseItem { op: Some(pb::lease_item::Op::Join(join)) }).await;
        assert_eq!(joined.code, 0, "{member} joins {room}: {joined:?}");
    }

    let (stop_flipping, flipper) = keep_flipping(Arc::clone(&leases), users.clone());
    tokio::time::sleep(Duration::from_millis(700)).await;
    // Every slot of node-a to node-b, in a planned move, while users flip.
    let mut at_a = presence_proto::v1::cluster_client::ClusterClient::connect(servers[0].url()).await.unwrap();
    let moved = at_a.move_slots(pb::MoveSlotsRequest { slots: moving.clone(), to_node: "node-b".into() }).await;
    let moved = moved.expect("node-a's slots move to node-b").into_inner();
    assert!(moved.users > 0, "{moved:?}");
    map_where(&etcd.client().await, "node-a's slots at node-b", |map| map.owned_by("node-a").count() == 0).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    // node-a stops and leaves: what it recorded went with its slots.
    servers.remove(0).stop().await;
    tokio::time::sleep(Duration::from_millis(700)).await;
    let _ = stop_flipping.send(());
    let acked = acked_flips(&flipper.await.unwrap());
    let acked_count: usize = acked.values().map(Vec::len).sum();
    assert!(
        acked.keys().filter(|user| moving.contains(&slot_of(user, SLOTS))).count() == on_a,
        "node-a's users flipped"
    );
    assert!(acked_count > 2_000, "{acked_count} flips");

    // Every flip once, in order, nothing else: no gap, no flip nobody made.
    let received = all.until("every flip at node-c", |events| has_every(events, &acked)).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    let received_after = all.events();
    assert_eq!(received_after.len(), received.len(), "nothing after the last flip");
    assert_in_cursor_order_once(&received, "the consumer at node-c");
    assert_eq!(gaps(&received), Vec::new(), "no gap in planned moves and stops");
    let acked_with_members: BTreeMap<String, Vec<(u64, bool)>> =
        acked.iter().map(|(user, flips)| (user.clone(), flips.clone())).chain(member_flips).collect();
    assert_eq!(flips_by_user(&received), acked_with_members, "exactly the flips the owners answered, in order");
    // Each room became occupied once: the move rebuilt node-a's rooms at
    // node-b without saying so again.
    let occupancy: Vec<(String, bool)> = received
        .iter()
        .filter_map(|event| match &event.event {
            Some(Event::RoomOccupancy(room)) => Some((room.room_id.clone(), room.occupied)),
            _ => None,
        })
        .collect();
    let mut once: Vec<(String, bool)> = rooms.iter().map(|room| (room.clone(), true)).collect();
    once.sort();
    let mut sorted = occupancy.clone();
    sorted.sort();
    assert_eq!(sorted, once, "each room occupied once, in: {occupancy:?}");

    // Two consumers sharing the slots: disjoint, and together everything.
    let low_events = low.until("the low slots' flips", |events| has_every(events, &slice(&acked, 0..SLOTS / 2))).await;
    let high_events =
        high.until("the high slots' flips", |events| has_every(events, &slice(&acked, SLOTS / 2..SLOTS))).await;
    assert_in_cursor_order_once(&low_events, "the low consumer");
    assert_in_cursor_order_once(&high_events, "the high consumer");
    assert!(low_events.iter().all(|event| event.slot < SLOTS / 2), "the low consumer got only its slots");
    assert!(high_events.iter().all(|event| event.slot >= SLOTS / 2), "the high consumer got only its slots");
    let low_cursors: BTreeSet<&Vec<u8>> = low_events.iter().map(|event| &event.cursor).collect();
    let high_cursors: BTreeSet<&Vec<u8>> = high_events.iter().map(|event| &event.cursor).collect();
    assert!(low_cursors.is_disjoint(&high_cursors), "the shares are disjoint");
    let union: BTreeSet<&Vec<u8>> = low_cursors.union(&high_cursors).copied().collect();
    let every: BTreeSet<&Vec<u8>> = received.iter().map(|event| &event.cursor).collect();
    assert_eq!(union, every, "the shares together are everything");

    // A consumer resuming at node-b from the first event's cursor, node-a
    // gone: node-a's entries came to node-b with its slots.
    let resumed = Consumer::open(&servers[0].url(), pb::ChangesFrom::Cursor, &received[0].cursor, Vec::new()).await;
    let later =
        resumed.until("every flip after the first, at node-b", |events| events.len() >= received.len() - 1).await;
    assert_eq!(
        later.iter().map(|event| &event.cursor).collect::<Vec<_>>(),
        received[1..].iter().map(|event| &event.cursor).collect::<Vec<_>>(),
        "resumed at another node after the node that wrote them left: the same events"
    );
    for consumer in [all, low, high, resumed] {
        consumer.close();
    }
    for server in servers {
        server.stop().await;
    }
}

/// The acknowledged flips of users in `slots`.
fn slice(
    acked: &BTreeMap<String, Vec<(u64, bool)>>,
    slots: std::ops::Range<u32>,
) -> BTreeMap<String, Vec<(u64, bool)>> {
    acked
        .iter()
        .filter(|(user, _)| slots.contains(&slot_of(user, SLOTS)))
        .map(|(u, f)| (u.clone(), f.clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_a_node_killed_with_kill_9_while_users_flip_leaves_a_gap_of_each_of_its_slots_never_a_silent_hole() {
    let etcd = EtcdServer::start().await;
    let (node_a, servers, map) = node_a_apart(&etcd, Duration::from_secs(5)).await;
    let users: Vec<String> = (0..240).map(|i| format!("feed-{i}")).collect();
    let slots_of_a: BTreeSet<u32> = map.owned_by("node-a").collect();
    let on_a: BTreeSet<&String> = users.iter().filter(|user| slots_of_a.contains(&slot_of(user, SLOTS))).collect();
    assert!(on_a.len() > 30, "node-a owns {} of the users", on_a.len());

    let consumer = Consumer::open(&servers[1].url(), pb::ChangesFrom::Now, &[], Vec::new()).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let leases = Arc::new(ClusterLeases::new(&servers[0].url(), SLOTS, LeaseChannelConfig::default()).unwrap());
    let (stop_flipping, flipper) = keep_flipping(Arc::clone(&leases), users.clone());
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    node_a.kill9();
    map_where(&etcd.client().await, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
    let taken = Instant::now();
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let _ = stop_flipping.send(());
    let acked = flipper.await.unwrap();
    let after_takeover: BTreeMap<String, Vec<(u64, bool)>> = acked
        .iter()
        .map(|(user, flips)| {
            let later = flips.iter().filter(|(_, _, at)| *at > taken + Duration::from_millis(200));
            (user.clone(), later.map(|&(v, online, _)| (v, online)).collect())
        })
        .collect();
    assert!(
        on_a.iter().all(|user| !after_takeover[*user].is_empty()),
        "node-a's users flipped at their new owners after the takeover"
    );

    // Every flip of node-b's and node-c's users, and every flip after the
    // takeover; a takeover gap for each slot of node-a, and no other gap.
    let flips = acked_flips(&acked);
    let elsewhere: BTreeMap<String, Vec<(u64, bool)>> =
        flips.iter().filter(|(user, _)| !on_a.contains(user)).map(|(u, f)| (u.clone(), f.clone())).collect();
    let received = consumer
        .until("every flip of the live nodes' users and every flip after the takeover", |events| {
            has_every(events, &elsewhere) && has_every(events, &after_takeover)
        })
        .await;
    assert_in_cursor_order_once(&received, "the consumer at node-c");
    let gap_slots: BTreeSet<u32> = gaps(&received)
        .into_iter()
        .map(|(slot, reason)| {
            assert_eq!(reason, "takeover", "slot {slot}: the only gaps are the takeover's");
            slot
        })
        .collect();
    assert_eq!(gap_slots, slots_of_a, "a gap of each slot node-a owned, and of no other");
    // Nothing of node-b's or node-c's users is missing or extra.
    let received_flips = flips_by_user(&received);
    for (user, flips) in &elsewhere {
        assert_eq!(received_flips.get(user), Some(flips), "{user}: exactly its flips");
    }
    // node-a's users: what is missing came before their slot's gap (a hole
    // the consumer is told of), and nothing after it is.
    for user in &on_a {
        let slot = slot_of(user, SLOTS);
        let gap_at = received.iter().position(|event| event.slot == slot && matches!(event.event, Some(Event::Gap(_))));
        let gap_at = gap_at.expect("a gap of the slot");
        let got: BTreeSet<u64> = received[gap_at..]
            .iter()
            .filter_map(|event| match &event.event {
                Some(Event::Flip(flip)) if flip.user_id == **user => Some(flip.version),
                _ => None,
            })
            .collect();
        for (version, _) in &after_takeover[*user] {
            assert!(got.contains(version), "{user}: flip at version {version} after the takeover, after the gap");
        }
    }
    consumer.close();
    for server in servers {
        server.stop().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn f3_a_bad_request_and_a_node_with_its_feed_off_are_refused_saying_what() {
    let etcd = EtcdServer::start().await;
    // node-c keeps no feed: the cluster's cannot be whole.
    let mut servers = Vec::new();
    for node in NODES {
        tokio::time::sleep(node_stagger()).await;
        let mut base = fast_config();
        if node == "node-c" {
            base.feed_retention_bytes = Some(0);
        }
        servers.push(TestServer::start_with(|addr| node_config_with(&etcd, node, addr, base)).await);
    }
    map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    let mut at_a = servers[0].client().await;

    // A slot the cluster does not have, named.
    let request = pb::ChangesRequest { slots: vec![SLOTS], ..Default::default() };
    let refused = at_a.changes(request).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().contains("slots"), "{refused:?}");

    // At node-a, the merged stream ends saying which node keeps no feed.
    let mut stream = at_a.changes(pb::ChangesRequest::default()).await.unwrap().into_inner();
    let ended = within(PATIENCE, "the merged feed ends", async {
        loop {
            match stream.message().await {
                Ok(Some(_)) => continue,
                Ok(None) => panic!("the merged feed ended without saying why"),
                Err(status) => return status,
            }
        }
    })
    .await;
    assert_eq!(ended.code(), Code::FailedPrecondition, "{ended:?}");
    assert!(ended.message().contains("keeps no change feed"), "{ended:?}");
    assert!(ended.message().contains(&servers[2].addr.to_string()), "names node-c: {ended:?}");
    // At node-c itself, at once.
    let refused = servers[2].client().await.changes(pb::ChangesRequest::default()).await.unwrap_err();
    assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
    for server in servers {
        server.stop().await;
    }
}
