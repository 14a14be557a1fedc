//! The four timelines of seed 000, played over real gRPC against a server on
//! port 0, each with a watching viewer. Each test fails on the naive design it
//! names: a user-level flag, a delete without a generation check, a renewal
//! that recreates what it does not find.

mod common;

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use presence_proto::v1 as pb;
use tonic::Code;

fn unix_ms_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Timeline 1: a phone and a laptop; the phone closing changes nothing a viewer can see.
#[tokio::test]
async fn timeline_1_one_of_two_devices_closing_changes_nothing_visible() {
    let server = TestServer::start(fast_config()).await;
    let mut gw_a = server.client().await;
    let mut gw_b = server.client().await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u42", "sentinel"]).await;

    let phone = gw_a.register(register("u42", "phone", "gw-a", 0)).await.unwrap().into_inner();
    assert!(phone.changed, "the first lease flips the user ONLINE");
    let laptop = gw_b.register(register("u42", "laptop", "gw-b", 0)).await.unwrap().into_inner();
    assert!(!laptop.changed, "a second device changes nothing visible");
    assert_eq!(laptop.presence.as_ref().unwrap().version, phone.presence.as_ref().unwrap().version);

    let closed = gw_a.unregister(unregister("u42", "phone", phone.generation, 0)).await.unwrap().into_inner();
    assert!(closed.removed);
    assert!(!closed.changed, "the laptop still holds a lease: a user-level flag would go OFFLINE here");
    assert_eq!(state_of(closed.presence.as_ref().unwrap()), pb::State::Online);

    viewer.barrier(&mut gw_a, "sentinel").await;
    let phone_version = phone.presence.unwrap().version;
    assert_eq!(viewer.updates_of("u42"), [(pb::State::Online, phone_version)], "exactly one event: the ONLINE");
    let now = snapshot(&mut gw_b, &["u42"]).await;
    assert_eq!((state_of(&now[0]), now[0].version), (pb::State::Online, phone_version));
    server.stop().await;
}

/// Timeline 2: the last device dies silently; exactly one OFFLINE, when its lease runs out.
#[tokio::test]
async fn timeline_2_last_device_dying_silently_gives_one_offline_within_the_window() {
    const TTL_MS: u32 = 300;
    const INTERVAL: Duration = Duration::from_millis(100);
    // When the OFFLINE is published is checked to the millisecond on the
    // server's own paused clock (expiry.rs, `l4_the_expiry_driver_publishes_offline_at_the_deadline_to_the_millisecond`);
    // over a real network this test checks what a viewer sees, and that nothing comes early.

    let server = TestServer::start(fast_config()).await;
    let mut gateway = server.client().await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u42", "sentinel"]).await;

    let phone = gateway.register(register("u42", "phone", "gw-a", TTL_MS)).await.unwrap().into_inner();
    let laptop = gateway.register(register("u42", "laptop", "gw-b", TTL_MS)).await.unwrap().into_inner();
    gateway.unregister(unregister("u42", "phone", phone.generation, 0)).await.unwrap();

    // The laptop heartbeats for a while, then its network drops right after a beat.
    let mut last_deadline = laptop.expires_at_ms;
    for _ in 0..5 {
        tokio::time::sleep(INTERVAL).await; // the heartbeat interval itself is what is being modelled
        let renewed = gateway.renew(renew("u42", "laptop", laptop.generation, TTL_MS)).await.unwrap().into_inner();
        assert!(renewed.expires_at_ms >= last_deadline, "a renewal moves the deadline forward");
        last_deadline = renewed.expires_at_ms;
    }
    let died_at = unix_ms_now();

    let offline = viewer.until_state("u42", pb::State::Offline).await;
    let arrived_at = unix_ms_now();
    assert_eq!(state_of(&offline), pb::State::Offline);
    let online_version = laptop.presence.unwrap().version;
    assert!(offline.version > online_version);
    // Never before the deadline (1 ms of slack for the two clocks' rounding)...
    assert!(arrived_at >= last_deadline - 1, "OFFLINE arrived {} ms before the deadline", last_deadline - arrived_at);
    // ... and no sooner than TTL - interval after the real disconnect.
    let detection = arrived_at - died_at;
    assert!(detection >= i64::from(TTL_MS) - INTERVAL.as_millis() as i64, "detected after only {detection} ms");

    viewer.barrier(&mut gateway, "sentinel").await;
    assert_eq!(
        viewer.updates_of("u42"),
        [(pb::State::Online, online_version), (pb::State::Offline, offline.version)],
        "a dozen lease operations, two visible events"
    );
    server.stop().await;
}

/// Timeline 3: the old socket's close arrives after the reconnect; the generation rejects it.
#[tokio::test]
async fn timeline_3_delayed_close_after_reconnect_is_rejected_by_the_generation() {
    let server = TestServer::start(fast_config()).await;
    let mut gw_a = server.client().await;
    let mut gw_b = server.client().await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u42", "sentinel"]).await;

    let old = gw_a.register(register("u42", "phone", "gw-a", 0)).await.unwrap().into_inner();
    // Wi-Fi to cellular: the phone reconnects through gateway B with the same session id.
    let new = gw_b.register(register("u42", "phone", "gw-b", 0)).await.unwrap().into_inner();
    assert!(new.generation > old.generation);
    assert!(!new.changed);

    // Gateway A only now notices its dead socket and closes it.
    let late = gw_a.unregister(unregister("u42", "phone", old.generation, 0)).await.unwrap().into_inner();
    assert!(!late.removed, "a delete without a generation check would remove the new session here");
    assert!(!late.changed);
    assert_eq!(late.outcome, pb::UnregisterOutcome::StaleGeneration as i32);
    assert_eq!(state_of(late.presence.as_ref().unwrap()), pb::State::Online);

    // The old socket's heartbeat is refused too, and told apart from an unknown lease.
    let stale = gw_a.renew(renew("u42", "phone", old.generation, 0)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    gw_b.renew(renew("u42", "phone", new.generation, 0)).await.expect("the new generation renews");

    viewer.barrier(&mut gw_a, "sentinel").await;
    assert_eq!(viewer.updates_of("u42"), [(pb::State::Online, old.presence.unwrap().version)]);
    assert_eq!(state_of(&snapshot(&mut gw_b, &["u42"]).await[0]), pb::State::Online);
    server.stop().await;
}

/// Timeline 4 (and L6): a renewal after a revoke is rejected and revives nothing.
#[tokio::test]
async fn timeline_4_renewal_after_revoke_is_rejected_and_revives_nothing() {
    let server = TestServer::start(fast_config()).await;
    let mut gateway = server.client().await;
    let mut admin = server.client().await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u42", "sentinel"]).await;

    let phone = gateway.register(register("u42", "phone", "gw-a", 0)).await.unwrap().into_inner();
    let laptop = gateway.register(register("u42", "laptop", "gw-a", 0)).await.unwrap().into_inner();

    // A password reset revokes every session of the user.
    let revoked = admin
        .revoke(pb::RevokeRequest { user_id: "u42".into(), session_id: String::new() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(revoked.revoked, 2);
    assert!(revoked.changed);
    assert_eq!(state_of(revoked.presence.as_ref().unwrap()), pb::State::Offline);

    for (session, generation) in [("phone", phone.generation), ("laptop", laptop.generation)] {
        let refused = gateway.renew(renew("u42", session, generation, 0)).await.unwrap_err();
        assert_eq!(refused.code(), Code::NotFound, "a renewal that upserts would revive {session}: {refused:?}");
    }
    let offline_version = revoked.presence.unwrap().version;
    let now = snapshot(&mut admin, &["u42"]).await;
    assert_eq!((state_of(&now[0]), now[0].version), (pb::State::Offline, offline_version));

    viewer.barrier(&mut admin, "sentinel").await;
    assert_eq!(
        viewer.updates_of("u42"),
        [(pb::State::Online, phone.presence.unwrap().version), (pb::State::Offline, offline_version)]
    );
    server.stop().await;
}

/// L3 linger: a page reload within the linger publishes no OFFLINE/ONLINE pair.
#[tokio::test]
async fn linger_hides_a_page_reload_and_still_ends_a_real_exit() {
    let server = TestServer::start(fast_config()).await;
    let mut gateway = server.client().await;
    let mut viewer = Viewer::open(&mut server.client().await, &["u42", "u43", "sentinel"]).await;

    let tab = gateway.register(register("u42", "tab", "gw-a", 0)).await.unwrap().into_inner();
    let closed = gateway.unregister(unregister("u42", "tab", tab.generation, 5_000)).await.unwrap().into_inner();
    assert_eq!(closed.outcome, pb::UnregisterOutcome::Lingering as i32);
    assert!(!closed.changed);
    let reloaded = gateway.register(register("u42", "tab", "gw-a", 0)).await.unwrap().into_inner();
    assert!(!reloaded.changed, "the reload arrived within the linger");
    viewer.barrier(&mut gateway, "sentinel").await;
    assert_eq!(viewer.updates_of("u42"), [(pb::State::Online, tab.presence.unwrap().version)]);

    // A real exit: nobody comes back, and the OFFLINE follows the linger.
    let other = gateway.register(register("u43", "tab", "gw-a", 0)).await.unwrap().into_inner();
    gateway.unregister(unregister("u43", "tab", other.generation, 50)).await.unwrap();
    let offline = viewer.until_state("u43", pb::State::Offline).await;
    assert_eq!(state_of(&offline), pb::State::Offline);
    server.stop().await;
}
