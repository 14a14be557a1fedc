//! The gateway side against a real server on port 0: batched lease traffic
//! through `LeaseChannel`, and `Session`s that renew, re-register, give way to
//! a newer connection and survive a server restart.

// Protobuf messages gain fields as the API grows: every literal of one ends in
// `..Default::default()`, so that it keeps compiling, even where it names every field today.
#![allow(clippy::needless_update)]

mod common;

use std::time::Duration;

use common::{PATIENCE, TestServer, fast_config, register, renew, snapshot, state_now, state_of, unregister, within};
use presence_client::{
    Backoff, LeaseChannel, LeaseChannelConfig, Session, SessionConfig, SessionState, Watcher, WatcherEvent, pb,
};
use tokio::task::JoinSet;
use tonic::Code;

const USERS: usize = 1_000;

fn session_config(ttl_ms: u32, heartbeat_ms: u64) -> SessionConfig {
    SessionConfig {
        ttl_ms,
        heartbeat: Duration::from_millis(heartbeat_ms),
        linger_ms: 0,
        min_renew_interval: Duration::ZERO,
        ..SessionConfig::default()
    }
}

async fn channel(server: &TestServer) -> LeaseChannel {
    LeaseChannel::connect(server.url(), LeaseChannelConfig::default()).await.expect("connect the lease channel")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_channel_batches_a_thousand_concurrent_sessions() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut client = server.client().await;
    let users: Vec<String> = (0..USERS).map(|i| format!("batch-user-{i}")).collect();

    let mut tasks = JoinSet::new();
    for (i, user) in users.iter().enumerate() {
        let (channel, user) = (channel.clone(), user.clone());
        tasks.spawn(async move { (i, channel.register(register(&user, "s", 60_000)).await) });
    }
    let mut generations = vec![0u64; USERS];
    while let Some(joined) = tasks.join_next().await {
        let (i, registered) = joined.unwrap();
        let registered = registered.unwrap_or_else(|status| panic!("register {i}: {status}"));
        let presence = registered.presence.expect("a presence");
        assert_eq!(presence.user_id, users[i], "the result of item {i} went to another submitter");
        assert_eq!(state_of(&presence), pb::State::Online);
        assert!(registered.changed && registered.generation > 0);
        generations[i] = registered.generation;
    }
    assert!(snapshot(&mut client, &users).await.iter().all(|p| state_of(p) == pb::State::Online));
    let after_registers = channel.stats();
    assert_eq!(after_registers.items_sent, USERS as u64);
    assert!(
        after_registers.batches_sent * 10 <= USERS as u64,
        "1000 concurrent registers should travel in a few batches: {after_registers:?}"
    );

    // Renewals: the current generation is accepted, an older one is told apart from an unknown lease.
    let mut tasks = JoinSet::new();
    for (i, user) in users.iter().enumerate() {
        let (channel, user, generation) = (channel.clone(), user.clone(), generations[i]);
        tasks.spawn(async move {
            let renewed = channel.renew(renew(&user, "s", generation, 60_000)).await;
            assert!(renewed.is_ok(), "renew {user}: {renewed:?}");
            let older = channel.renew(renew(&user, "s", generation - 1, 60_000)).await.unwrap_err();
            assert_eq!(older.code(), Code::FailedPrecondition, "{user}: {older:?}");
            let unknown = channel.renew(renew(&user, "no-such-session", generation, 60_000)).await.unwrap_err();
            assert_eq!(unknown.code(), Code::NotFound, "{user}: {unknown:?}");
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap();
    }

    let mut tasks = JoinSet::new();
    for (i, user) in users.iter().enumerate() {
        let (channel, user, generation) = (channel.clone(), user.clone(), generations[i]);
        tasks.spawn(async move {
            let unregistered = channel.unregister(unregister(&user, "s", generation)).await.unwrap();
            assert!(unregistered.removed && unregistered.changed, "{user}: {unregistered:?}");
            assert_eq!(unregistered.outcome, pb::UnregisterOutcome::Removed as i32);
            assert_eq!(state_of(unregistered.presence.as_ref().unwrap()), pb::State::Offline);
        });
    }
    while let Some(joined) = tasks.join_next().await {
        joined.unwrap();
    }
    assert!(snapshot(&mut client, &users).await.iter().all(|p| state_of(p) == pb::State::Offline));
    let stats = channel.stats();
    assert_eq!(stats.items_sent, 5 * USERS as u64);
    assert_eq!((stats.streams_opened, stats.streams_broken), (1, 0), "{stats:?}");
}

#[tokio::test]
async fn submit_batch_answers_every_item_in_order() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let item = |op| pb::LeaseItem { op: Some(op), ..Default::default() };
    use pb::lease_item::Op;

    let first = channel
        .submit_batch(vec![
            item(Op::Register(register("ordered-a", "s", 60_000))),
            item(Op::Register(register("", "s", 60_000))),
            item(Op::Renew(renew("ordered-b", "s", 1, 60_000))),
            item(Op::Unregister(unregister("ordered-b", "s", 1))),
            item(Op::Register(register("ordered-c", "s", 60_000))),
        ])
        .await
        .expect("the batch is answered");
    assert_eq!(first.len(), 5);
    let codes: Vec<Code> = first.iter().map(|r| Code::from(r.code as i32)).collect();
    assert_eq!(codes, [Code::Ok, Code::InvalidArgument, Code::NotFound, Code::Ok, Code::Ok]);
    assert!(first[1].message.starts_with("user_id"), "the message names the field: {:?}", first[1].message);

    let mut first = first.into_iter().map(presence_client::lease_result);
    let Ok(pb::lease_result::Result::Register(a)) = first.next().unwrap() else { panic!("a register result") };
    assert_eq!(first.next().unwrap().unwrap_err().code(), Code::InvalidArgument);
    assert_eq!(first.next().unwrap().unwrap_err().code(), Code::NotFound);
    let Ok(pb::lease_result::Result::Unregister(b)) = first.next().unwrap() else { panic!("an unregister result") };
    assert_eq!((b.removed, b.outcome), (false, pb::UnregisterOutcome::NotFound as i32));
    let Ok(pb::lease_result::Result::Register(c)) = first.next().unwrap() else { panic!("a register result") };
    assert_eq!(a.presence.unwrap().user_id, "ordered-a");
    assert_eq!(c.presence.unwrap().user_id, "ordered-c");

    // A second batch over the same stream, with an older generation told apart.
    let second = channel
        .submit_batch(vec![
            item(Op::Renew(renew("ordered-a", "s", a.generation - 1, 60_000))),
            item(Op::Renew(renew("ordered-a", "s", a.generation, 60_000))),
        ])
        .await
        .unwrap();
    let codes: Vec<Code> = second.iter().map(|r| Code::from(r.code as i32)).collect();
    assert_eq!(codes, [Code::FailedPrecondition, Code::Ok]);
    assert!(channel.submit_batch(Vec::new()).await.unwrap().is_empty());
}

#[tokio::test]
async fn session_keeps_a_user_online_across_several_ttls() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let user = "steady-user";
    let mut watcher = Watcher::open(server.client().await, vec![user.into()], Backoff::default()).await.unwrap();

    let session = Session::register(&channel, user, "phone", "gw-a", Default::default(), session_config(150, 40))
        .await
        .expect("register");
    let generation = session.generation();
    assert_eq!(session.state(), SessionState::Live { generation });
    let online = within(PATIENCE, "the ONLINE update", watcher.next()).await.unwrap();
    assert!(matches!(&online, WatcherEvent::Update(p) if state_of(p) == pb::State::Online), "{online:?}");

    // Five TTLs: any event now would be a flip, and so a missed renewal.
    let quiet = tokio::time::timeout(Duration::from_millis(750), watcher.next()).await;
    assert!(quiet.is_err(), "the user flipped while its session was renewing: {quiet:?}");
    assert_eq!(session.generation(), generation, "no re-register was needed");
    assert_eq!(session.state(), SessionState::Live { generation });
    assert_eq!(state_now(&mut server.client().await, user).await, pb::State::Online);

    let closed = session.close().await.expect("unregister");
    assert!(closed.removed && closed.changed, "{closed:?}");
    let offline = within(PATIENCE, "the OFFLINE update", watcher.next()).await.unwrap();
    assert!(matches!(&offline, WatcherEvent::Update(p) if state_of(p) == pb::State::Offline), "{offline:?}");
}

#[tokio::test]
async fn session_registers_again_after_its_lease_is_revoked() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut client = server.client().await;
    let user = "revoked-user";
    let session =
        Session::register(&channel, user, "laptop", "gw-a", Default::default(), session_config(300, 30)).await.unwrap();
    let first = session.generation();
    let mut events = session.events();

    let revoked = client
        .revoke(pb::RevokeRequest { user_id: user.into(), session_id: "laptop".into(), ..Default::default() })
        .await;
    let revoked = revoked.unwrap().into_inner();
    assert_eq!((revoked.revoked, revoked.changed), (1, true));

    let state = within(PATIENCE, "a re-register", events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap()
        .to_owned();
    let SessionState::Reregistered { generation } = state else { unreachable!() };
    assert!(generation > first, "a new generation: {generation} after {first}");
    assert_eq!(session.generation(), generation);
    assert_eq!(state_now(&mut client, user).await, pb::State::Online);

    // It renews the new generation from then on: three TTLs later nothing has changed
    // (a renewal of the old generation would have shown as Superseded or yet another register).
    let settled = tokio::time::timeout(Duration::from_millis(900), events.changed()).await;
    assert!(settled.is_err(), "the session's state moved on: {:?}", session.state());
    assert_eq!(state_now(&mut client, user).await, pb::State::Online);
}

#[tokio::test]
async fn session_is_superseded_by_a_newer_register_of_the_same_session() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let mut client = server.client().await;
    let user = "superseded-user";
    let session =
        Session::register(&channel, user, "tab", "gw-a", Default::default(), session_config(300, 30)).await.unwrap();
    let old = session.generation();
    let mut events = session.events();

    // The same session reconnects through another gateway.
    let newer = client.register(register(user, "tab", 60_000)).await.unwrap().into_inner();
    assert!(newer.generation > old && !newer.changed);

    within(PATIENCE, "Superseded", events.wait_for(|s| *s == SessionState::Superseded)).await.unwrap();
    assert_eq!(session.generation(), old, "a superseded session keeps its own generation");

    // Its close is the delayed close of a dead socket: it changes nothing (L3).
    let closed = session.close().await.unwrap();
    assert_eq!((closed.removed, closed.changed), (false, false));
    assert_eq!(closed.outcome, pb::UnregisterOutcome::StaleGeneration as i32);
    assert_eq!(state_now(&mut client, user).await, pb::State::Online);
    client.renew(renew(user, "tab", newer.generation, 60_000)).await.expect("the newer lease is intact");
}

#[tokio::test]
async fn touch_renews_unless_throttled() {
    let server = TestServer::start(fast_config()).await;
    let channel = channel(&server).await;
    let client = server.client().await;
    // Heartbeats an hour apart: only touches can keep these leases alive.
    let hourly = Duration::from_secs(3_600);

    let user = "touched-user";
    let mut watcher = Watcher::open(client.clone(), vec![user.into()], Backoff::default()).await.unwrap();
    let config = SessionConfig {
        ttl_ms: 150,
        heartbeat: hourly,
        linger_ms: 0,
        min_renew_interval: Duration::ZERO,
        ..SessionConfig::default()
    };
    let session = Session::register(&channel, user, "s", "gw-a", Default::default(), config).await.unwrap();
    within(PATIENCE, "ONLINE", watcher.next()).await.unwrap();
    let touching = async {
        for _ in 0..25 {
            session.touch();
            tokio::time::sleep(Duration::from_millis(30)).await;
        }
    };
    tokio::select! {
        () = touching => {}
        event = watcher.next() => panic!("the user flipped while its socket was active: {event:?}"),
    }
    drop(session);
    let offline = within(PATIENCE, "OFFLINE after the drop", watcher.next()).await.unwrap();
    assert!(matches!(&offline, WatcherEvent::Update(p) if state_of(p) == pb::State::Offline), "{offline:?}");

    // The same activity against a throttle of an hour renews nothing: the lease runs out.
    let user = "throttled-user";
    let mut watcher = Watcher::open(client.clone(), vec![user.into()], Backoff::default()).await.unwrap();
    let config = SessionConfig {
        ttl_ms: 150,
        heartbeat: hourly,
        linger_ms: 0,
        min_renew_interval: hourly,
        ..SessionConfig::default()
    };
    let session = Session::register(&channel, user, "s", "gw-a", Default::default(), config).await.unwrap();
    within(PATIENCE, "ONLINE", watcher.next()).await.unwrap();
    let touching = async {
        loop {
            session.touch();
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    };
    let offline = within(PATIENCE, "OFFLINE despite the touches", async {
        tokio::select! {
            () = touching => unreachable!(),
            event = watcher.next() => event,
        }
    })
    .await
    .unwrap();
    assert!(matches!(&offline, WatcherEvent::Update(p) if state_of(p) == pb::State::Offline), "{offline:?}");
}

#[tokio::test]
async fn lease_channel_and_session_recover_after_a_server_restart() {
    let server = TestServer::start(fast_config()).await;
    let addr = server.addr;
    let config = LeaseChannelConfig {
        reconnect: Backoff { initial: Duration::from_millis(20), max: Duration::from_millis(200), factor: 2.0 },
        ..LeaseChannelConfig::default()
    };
    let channel = LeaseChannel::connect(server.url(), config).await.unwrap();
    let user = "restart-user";
    let session =
        Session::register(&channel, user, "s", "gw-a", Default::default(), session_config(300, 30)).await.unwrap();
    let before = session.generation();
    let mut events = session.events();

    server.stop().await;
    // While the server is away, lease calls fail visibly, and the session knows it.
    let refused = channel.register(register("bystander", "s", 60_000)).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    within(PATIENCE, "Lost", events.wait_for(|s| *s == SessionState::Lost)).await.unwrap();

    // The new server knows nothing: the session's next renewal is NOT_FOUND, and it registers again.
    let server = TestServer::start_on(addr, fast_config()).await;
    let state = within(PATIENCE, "a re-register", events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap()
        .to_owned();
    let SessionState::Reregistered { generation } = state else { unreachable!() };
    assert_ne!(generation, before);
    assert_eq!(session.generation(), generation);
    let mut client = server.client().await;
    assert_eq!(state_now(&mut client, user).await, pb::State::Online);

    // And the channel itself serves again.
    let registered = channel.register(register("bystander", "s", 60_000)).await.expect("the channel recovered");
    assert!(registered.changed);
    let stats = channel.stats();
    assert!(stats.streams_opened >= 2 && stats.streams_broken >= 1, "{stats:?}");

    let closed = session.close().await.unwrap();
    assert!(closed.removed, "{closed:?}");
    assert_eq!(state_now(&mut client, user).await, pb::State::Offline);
}

/// A1 from a gateway's `Session`: the device kind with the register, each
/// change of attention and focus sent at once, and all of it said again
/// with the register that follows a lost lease (a new generation starts
/// with nothing said), as NotifyTargets and the user's availability show.
#[tokio::test]
async fn session_says_its_attention_and_says_it_again_after_a_re_register() {
    let mut config = fast_config();
    config.store.active_window_ms = 0; // AWAY as soon as nothing is active: the test sees each change
    let server = TestServer::start(config).await;
    let channel = channel(&server).await;
    let mut client = server.client().await;
    let user = "attending-user";
    let config = SessionConfig { device_kind: pb::DeviceKind::DeviceDesktop, ..session_config(300, 30) };
    let session = Session::register(&channel, user, "laptop", "gw-a", Default::default(), config).await.unwrap();
    let availability = |presence: &pb::UserPresence| pb::Availability::try_from(presence.availability).unwrap();
    let reader = client.clone();
    let now = || {
        let mut client = reader.clone();
        async move { snapshot(&mut client, &[user.to_owned()]).await.remove(0) }
    };
    assert_eq!(availability(&now().await), pb::Availability::Unspecified, "nothing said yet");

    session.set_attention(pb::Attention::Active).await.unwrap();
    assert_eq!(availability(&now().await), pb::Availability::Active);
    session.focus(Some("doc-7")).await.unwrap();
    let ask = pb::NotifyTargetsRequest { user_ids: vec![user.into()], room_id: "doc-7".into(), ..Default::default() };
    let reason = |targets: pb::NotifyTargetsResponse| pb::NotifyReason::try_from(targets.targets[0].reason).unwrap();
    assert_eq!(reason(client.notify_targets(ask.clone()).await.unwrap().into_inner()), pb::NotifyReason::RoomOpen);
    session.set_attention(pb::Attention::Background).await.unwrap();
    assert_eq!(availability(&now().await), pb::Availability::Away);

    let mut events = session.events();
    client
        .revoke(pb::RevokeRequest { user_id: user.into(), session_id: "laptop".into(), ..Default::default() })
        .await
        .unwrap();
    within(PATIENCE, "a re-register", events.wait_for(|s| matches!(s, SessionState::Reregistered { .. })))
        .await
        .unwrap();
    // Said again with the register: background (so AWAY, not nothing), and not attended.
    assert_eq!(availability(&now().await), pb::Availability::Away);
    assert_eq!(
        reason(client.notify_targets(ask).await.unwrap().into_inner()),
        pb::NotifyReason::NoAttendedSession,
        "a re-register that said nothing would be answered UNKNOWN_FAIL_OPEN"
    );
    session.close().await.unwrap();
}
