//! The four timelines of seed 000, played over real gRPC, each with a
//! watching viewer: against one server on port 0, and through a cluster of
//! three nodes and etcd (C2: the gateway at its users' owner, the viewer at
//! another node, whose Watch merges the owner's part). Each test fails on the
//! naive design it names: a user-level flag, a delete without a generation
//! check, a renewal that recreates what it does not find.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::cluster::nodes;
use crate::common::*;
use presence_cluster::slot_of;
use presence_cluster::testing::EtcdServer;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tonic::Code;
use tonic::transport::Channel;

/// Where a timeline runs, and the user ids it plays with.
struct Deployment {
    servers: Vec<TestServer>,
    /// Kept running while the nodes are; `None` for one server.
    etcd: Option<EtcdServer>,
    /// The node gateways (and admins) call: the users' owner.
    gateway: usize,
    /// The node the viewer watches through.
    viewer: usize,
    /// The timeline's user, a second user, and the barrier's sentinel.
    user: String,
    other: String,
    sentinel: String,
}

impl Deployment {
    /// One server: everything at it.
    async fn single() -> Deployment {
        let server = TestServer::start(fast_config()).await;
        let [user, other, sentinel] = ["u42", "u43", "sentinel"].map(str::to_owned);
        Deployment { servers: vec![server], etcd: None, gateway: 0, viewer: 0, user, other, sentinel }
    }

    /// Three nodes sharing the slots through etcd: the users are node-a's
    /// (each the first of its kind node-a owns), gateways call node-a, and
    /// the viewer watches through node-b.
    async fn cluster() -> Deployment {
        let etcd = EtcdServer::start().await;
        let (servers, map) = nodes::three_nodes(&etcd).await;
        let of_a = |prefix: &str| {
            (0..)
                .map(|i| format!("{prefix}{i}"))
                .find(|id| map.owner(slot_of(id, nodes::SLOTS)).is_some_and(|owner| owner.node == "node-a"))
                .expect("node-a owns slots")
        };
        let (user, other, sentinel) = (of_a("u"), of_a("v"), of_a("sentinel-"));
        Deployment { servers, etcd: Some(etcd), gateway: 0, viewer: 1, user, other, sentinel }
    }

    /// A client of the node gateways call.
    async fn gateway(&self) -> PresenceClient<Channel> {
        self.servers[self.gateway].client().await
    }

    /// A viewer watching `users` through the viewer's node.
    async fn viewer(&self, users: &[&str]) -> Viewer {
        let mut client = self.servers[self.viewer].client().await;
        match self.etcd {
            None => Viewer::open(&mut client, users).await,
            Some(_) => Viewer::open_merged(&mut client, users).await,
        }
    }

    async fn stop(self) {
        for server in self.servers {
            server.stop().await;
        }
    }
}

/// Runs `timeline` on one server and through a cluster, as two tests.
macro_rules! on_one_server_and_a_cluster {
    ($timeline:ident, $single:ident, $cluster:ident) => {
        #[tokio::test]
        async fn $single() {
            $timeline(Deployment::single().await).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $cluster() {
            $timeline(Deployment::cluster().await).await;
        }
    };
}

fn unix_ms_now() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as i64
}

/// Timeline 1: a phone and a laptop; the phone closing changes nothing a viewer can see.
async fn timeline_1(d: Deployment) {
    let (u, s) = (d.user.clone(), d.sentinel.clone());
    let (u, s) = (u.as_str(), s.as_str());
    let mut gw_a = d.gateway().await;
    let mut gw_b = d.gateway().await;
    let mut viewer = d.viewer(&[u, s]).await;

    let phone = gw_a.register(register(u, "phone", "gw-a", 0)).await.unwrap().into_inner();
    assert!(phone.changed, "the first lease flips the user ONLINE");
    let laptop = gw_b.register(register(u, "laptop", "gw-b", 0)).await.unwrap().into_inner();
    assert!(!laptop.changed, "a second device changes nothing visible");
    assert_eq!(laptop.presence.as_ref().unwrap().version, phone.presence.as_ref().unwrap().version);

    let closed = gw_a.unregister(unregister(u, "phone", phone.generation, 0)).await.unwrap().into_inner();
    assert!(closed.removed);
    assert!(!closed.changed, "the laptop still holds a lease: a user-level flag would go OFFLINE here");
    assert_eq!(state_of(closed.presence.as_ref().unwrap()), pb::State::Online);

    viewer.barrier(&mut gw_a, s).await;
    let phone_version = phone.presence.unwrap().version;
    assert_eq!(viewer.updates_of(u), [(pb::State::Online, phone_version)], "exactly one event: the ONLINE");
    let now = snapshot(&mut gw_b, &[u]).await;
    assert_eq!((state_of(&now[0]), now[0].version), (pb::State::Online, phone_version));
    d.stop().await;
}

/// Timeline 2: the last device dies silently; exactly one OFFLINE, when its lease runs out.
async fn timeline_2(d: Deployment) {
    let (u, s) = (d.user.clone(), d.sentinel.clone());
    let (u, s) = (u.as_str(), s.as_str());
    const TTL_MS: u32 = 300;
    const INTERVAL: Duration = Duration::from_millis(100);
    // When the OFFLINE is published is checked to the millisecond on the
    // server's own paused clock (expiry.rs, `l4_the_expiry_driver_publishes_offline_at_the_deadline_to_the_millisecond`);
    // over a real network this test checks what a viewer sees, and that nothing comes early.

    let mut gateway = d.gateway().await;
    let mut viewer = d.viewer(&[u, s]).await;

    let phone = gateway.register(register(u, "phone", "gw-a", TTL_MS)).await.unwrap().into_inner();
    let laptop = gateway.register(register(u, "laptop", "gw-b", TTL_MS)).await.unwrap().into_inner();
    gateway.unregister(unregister(u, "phone", phone.generation, 0)).await.unwrap();

    // The laptop heartbeats for a while, then its network drops right after a beat.
    let mut last_deadline = laptop.expires_at_ms;
    for _ in 0..5 {
        tokio::time::sleep(INTERVAL).await; // the heartbeat interval itself is what is being modelled
        let renewed = gateway.renew(renew(u, "laptop", laptop.generation, TTL_MS)).await.unwrap().into_inner();
        assert!(renewed.expires_at_ms >= last_deadline, "a renewal moves the deadline forward");
        last_deadline = renewed.expires_at_ms;
    }
    let died_at = unix_ms_now();

    let offline = viewer.until_state(u, pb::State::Offline).await;
    let arrived_at = unix_ms_now();
    assert_eq!(state_of(&offline), pb::State::Offline);
    let online_version = laptop.presence.unwrap().version;
    assert!(offline.version > online_version);
    // Never before the deadline (1 ms of slack for the two clocks' rounding)...
    assert!(arrived_at >= last_deadline - 1, "OFFLINE arrived {} ms before the deadline", last_deadline - arrived_at);
    // ... and no sooner than TTL - interval after the real disconnect.
    let detection = arrived_at - died_at;
    assert!(detection >= i64::from(TTL_MS) - INTERVAL.as_millis() as i64, "detected after only {detection} ms");

    viewer.barrier(&mut gateway, s).await;
    assert_eq!(
        viewer.updates_of(u),
        [(pb::State::Online, online_version), (pb::State::Offline, offline.version)],
        "a dozen lease operations, two visible events"
    );
    d.stop().await;
}

/// Timeline 3: the old socket's close arrives after the reconnect; the generation rejects it.
async fn timeline_3(d: Deployment) {
    let (u, s) = (d.user.clone(), d.sentinel.clone());
    let (u, s) = (u.as_str(), s.as_str());
    let mut gw_a = d.gateway().await;
    let mut gw_b = d.gateway().await;
    let mut viewer = d.viewer(&[u, s]).await;

    let old = gw_a.register(register(u, "phone", "gw-a", 0)).await.unwrap().into_inner();
    // Wi-Fi to cellular: the phone reconnects through gateway B with the same session id.
    let new = gw_b.register(register(u, "phone", "gw-b", 0)).await.unwrap().into_inner();
    assert!(new.generation > old.generation);
    assert!(!new.changed);

    // Gateway A only now notices its dead socket and closes it.
    let late = gw_a.unregister(unregister(u, "phone", old.generation, 0)).await.unwrap().into_inner();
    assert!(!late.removed, "a delete without a generation check would remove the new session here");
    assert!(!late.changed);
    assert_eq!(late.outcome, pb::UnregisterOutcome::StaleGeneration as i32);
    assert_eq!(state_of(late.presence.as_ref().unwrap()), pb::State::Online);

    // The old socket's heartbeat is refused too, and told apart from an unknown lease.
    let stale = gw_a.renew(renew(u, "phone", old.generation, 0)).await.unwrap_err();
    assert_eq!(stale.code(), Code::FailedPrecondition, "{stale:?}");
    gw_b.renew(renew(u, "phone", new.generation, 0)).await.expect("the new generation renews");

    viewer.barrier(&mut gw_a, s).await;
    assert_eq!(viewer.updates_of(u), [(pb::State::Online, old.presence.unwrap().version)]);
    assert_eq!(state_of(&snapshot(&mut gw_b, &[u]).await[0]), pb::State::Online);
    d.stop().await;
}

/// Timeline 4 (and L6): a renewal after a revoke is rejected and revives nothing.
async fn timeline_4(d: Deployment) {
    let (u, s) = (d.user.clone(), d.sentinel.clone());
    let (u, s) = (u.as_str(), s.as_str());
    let mut gateway = d.gateway().await;
    let mut admin = d.gateway().await;
    let mut viewer = d.viewer(&[u, s]).await;

    let phone = gateway.register(register(u, "phone", "gw-a", 0)).await.unwrap().into_inner();
    let laptop = gateway.register(register(u, "laptop", "gw-a", 0)).await.unwrap().into_inner();

    // A password reset revokes every session of the user.
    let revoked =
        admin.revoke(pb::RevokeRequest { user_id: u.into(), session_id: String::new() }).await.unwrap().into_inner();
    assert_eq!(revoked.revoked, 2);
    assert!(revoked.changed);
    assert_eq!(state_of(revoked.presence.as_ref().unwrap()), pb::State::Offline);

    for (session, generation) in [("phone", phone.generation), ("laptop", laptop.generation)] {
        let refused = gateway.renew(renew(u, session, generation, 0)).await.unwrap_err();
        assert_eq!(refused.code(), Code::NotFound, "a renewal that upserts would revive {session}: {refused:?}");
    }
    let offline_version = revoked.presence.unwrap().version;
    let now = snapshot(&mut admin, &[u]).await;
    assert_eq!((state_of(&now[0]), now[0].version), (pb::State::Offline, offline_version));

    viewer.barrier(&mut admin, s).await;
    assert_eq!(
        viewer.updates_of(u),
        [(pb::State::Online, phone.presence.unwrap().version), (pb::State::Offline, offline_version)]
    );
    d.stop().await;
}

/// L3 linger: a page reload within the linger publishes no OFFLINE/ONLINE pair.
async fn linger(d: Deployment) {
    let (u, s) = (d.user.clone(), d.sentinel.clone());
    let (u, s) = (u.as_str(), s.as_str());
    let leaving = d.other.clone();
    let mut gateway = d.gateway().await;
    let mut viewer = d.viewer(&[u, &leaving, s]).await;

    let tab = gateway.register(register(u, "tab", "gw-a", 0)).await.unwrap().into_inner();
    let closed = gateway.unregister(unregister(u, "tab", tab.generation, 5_000)).await.unwrap().into_inner();
    assert_eq!(closed.outcome, pb::UnregisterOutcome::Lingering as i32);
    assert!(!closed.changed);
    let reloaded = gateway.register(register(u, "tab", "gw-a", 0)).await.unwrap().into_inner();
    assert!(!reloaded.changed, "the reload arrived within the linger");
    viewer.barrier(&mut gateway, s).await;
    assert_eq!(viewer.updates_of(u), [(pb::State::Online, tab.presence.unwrap().version)]);

    // A real exit: nobody comes back, and the OFFLINE follows the linger.
    let other = gateway.register(register(&leaving, "tab", "gw-a", 0)).await.unwrap().into_inner();
    gateway.unregister(unregister(&leaving, "tab", other.generation, 50)).await.unwrap();
    let offline = viewer.until_state(&leaving, pb::State::Offline).await;
    assert_eq!(state_of(&offline), pb::State::Offline);
    d.stop().await;
}

on_one_server_and_a_cluster!(
    timeline_1,
    timeline_1_one_of_two_devices_closing_changes_nothing_visible,
    timeline_1_one_of_two_devices_closing_changes_nothing_visible_through_a_cluster
);
on_one_server_and_a_cluster!(
    timeline_2,
    timeline_2_last_device_dying_silently_gives_one_offline_within_the_window,
    timeline_2_last_device_dying_silently_gives_one_offline_within_the_window_through_a_cluster
);
on_one_server_and_a_cluster!(
    timeline_3,
    timeline_3_delayed_close_after_reconnect_is_rejected_by_the_generation,
    timeline_3_delayed_close_after_reconnect_is_rejected_by_the_generation_through_a_cluster
);
on_one_server_and_a_cluster!(
    timeline_4,
    timeline_4_renewal_after_revoke_is_rejected_and_revives_nothing,
    timeline_4_renewal_after_revoke_is_rejected_and_revives_nothing_through_a_cluster
);
on_one_server_and_a_cluster!(
    linger,
    linger_hides_a_page_reload_and_still_ends_a_real_exit,
    linger_hides_a_page_reload_and_still_ends_a_real_exit_through_a_cluster
);
