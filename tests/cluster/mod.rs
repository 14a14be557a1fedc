//! Cluster mode against a real etcd (C1–C5): presenced nodes in this
//! process or as child processes, on loopback or in network namespaces,
//! joined through one etcd each test starts (`etcd` from PATH or
//! `PRESENCED_ETCD_BIN`; `.ci/install-etcd`). The tests are grouped as the
//! cluster's parts are: routing (C1, C2), planned moves (C3), takeover (C4),
//! etcd outages, groups (P4), rooms, and export and erase (P7); the helpers
//! they share are here.

// Protobuf literals end in `..Default::default()` so that they keep compiling as messages gain fields.
#![allow(clippy::needless_update)]

mod backup;
mod erase;
mod feed;
mod fencing;
mod groups;
mod handover;
pub(crate) mod nodes;
mod outage;
mod readiness;
mod relay;
mod rooms;
mod routing;
mod silent;
mod takeover;
mod tls;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use crate::common::{PATIENCE, daemon};
use nodes::*;
use presence_client::{ClusterLeases, LeaseChannelConfig, Session, SessionConfig, SessionState, lease_result};
use presence_cluster::testing::EtcdServer;
use presence_cluster::{Etcd, slot_of};
use presence_faults::DelayProxy;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use presence_server::ServerConfig;
use presence_server::testing::{TestServer, fast_config};
use prost::Message as _;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

/// `presenced cluster status --etcd ... EXTRA` against the test's cluster.
fn cluster_status_output(etcd: &EtcdServer, extra: &[&str]) -> std::process::Output {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_presenced"))
        .args(["cluster", "status", "--etcd", &etcd.endpoint, "--etcd-prefix", PREFIX, "--slots", &SLOTS.to_string()])
        .args(extra)
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    output
}

/// `presenced cluster status --json`, parsed.
fn cluster_status(etcd: &EtcdServer, extra: &[&str]) -> serde_json::Value {
    serde_json::from_slice(&cluster_status_output(etcd, extra).stdout).unwrap()
}

/// The `presence.v1.NotOwner` in a refusal's details.
fn not_owner_of(status: &tonic::Status) -> pb::NotOwner {
    let details = tonic_types::Status::decode(status.details()).expect("google.rpc.Status details");
    let any = details
        .details
        .iter()
        .find(|any| any.type_url == "type.googleapis.com/presence.v1.NotOwner")
        .unwrap_or_else(|| panic!("no NotOwner in {status:?}"));
    pb::NotOwner::decode(any.value.as_slice()).unwrap()
}

fn register(user: &str) -> pb::LeaseItem {
    pb::LeaseItem {
        op: Some(pb::lease_item::Op::Register(pb::RegisterRequest {
            user_id: user.into(),
            session_id: "s".into(),
            gateway_id: "gw".into(),
            ttl_ms: 30_000,
            ..Default::default()
        })),
    }
}

/// A gateway's `ClusterLeases` entering at `entry`, and the generation of
/// each of `users`' sessions, registered through it.
async fn register_all(entry: &TestServer, users: &[String]) -> (std::sync::Arc<ClusterLeases>, Vec<(String, u64)>) {
    register_all_at(&entry.url(), users).await
}

/// [`register_all`] entering at the node at `url`.
async fn register_all_at(url: &str, users: &[String]) -> (std::sync::Arc<ClusterLeases>, Vec<(String, u64)>) {
    let leases = std::sync::Arc::new(ClusterLeases::new(url, SLOTS, LeaseChannelConfig::default()).unwrap());
    let generations = register_through(&leases, users).await;
    (leases, generations)
}

/// Registers a session of each of `users` through `leases`; each user with its generation.
async fn register_through(leases: &ClusterLeases, users: &[String]) -> Vec<(String, u64)> {
    let registered = leases.submit_batch(users.iter().map(|user| register(user)).collect()).await;
    let mut generations = Vec::new();
    for (user, result) in users.iter().zip(registered) {
        match lease_result(result.clone()) {
            Ok(pb::lease_result::Result::Register(done)) => generations.push((user.clone(), done.generation)),
            other => panic!("{user}: {other:?}"),
        }
    }
    generations
}

/// Renews every session of `generations` (TTL `ttl_ms`) in chunks of
/// `chunk`, one every 5 ms, through each of `gateways` in turn, until told
/// to stop, sending nothing refused again (C7: every freeze meets some):
/// how many chunks went, and every refusal.
fn renew_in_chunks(
    gateways: std::sync::Arc<Vec<ClusterLeases>>,
    generations: Vec<(String, u64)>,
    chunk: usize,
    ttl_ms: u32,
) -> Running<(usize, Vec<String>)> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let generations = std::sync::Arc::new(generations);
    let task = tokio::spawn(async move {
        let mut chunks = tokio::task::JoinSet::new();
        let mut tick = tokio::time::interval(Duration::from_millis(5));
        let (mut next, mut gateway) = (0, 0);
        loop {
            tokio::select! {
                _ = &mut stopped => break,
                _ = tick.tick() => {}
            }
            let range = next..(next + chunk).min(generations.len());
            next = if range.end == generations.len() { 0 } else { range.end };
            gateway = (gateway + 1) % gateways.len();
            let (gateways, generations) = (std::sync::Arc::clone(&gateways), std::sync::Arc::clone(&generations));
            chunks.spawn(async move {
                let items =
                    generations[range.clone()].iter().map(|(user, generation)| renew(user, *generation, ttl_ms));
                let results = gateways[gateway].submit_batch(items.collect()).await;
                let sessions = generations[range].iter();
                sessions
                    .zip(results)
                    .filter(|(_, result)| result.code != 0)
                    .map(|((user, _), result)| format!("{user}: {} {}", result.code, result.message))
                    .collect::<Vec<String>>()
            });
        }
        let (mut sent, mut refused) = (0, Vec::new());
        while let Some(chunk) = chunks.join_next().await {
            refused.extend(chunk.unwrap());
            sent += 1;
        }
        (sent, refused)
    });
    (stop, task)
}

/// Asserts that `viewer` sees every one of `users` ONLINE at the version `before` held (M4: no flip, no new version).
async fn assert_online_at_the_versions_before(
    viewer: &mut PresenceClient<Channel>,
    users: &[String],
    before: &HashMap<String, pb::UserPresence>,
) {
    let after = presences(viewer, users).await;
    for user in users {
        assert_eq!(
            (after[user].state, after[user].version),
            (pb::State::Online as i32, before[user].version),
            "{user}: online at the version it had"
        );
    }
}

async fn snapshot(client: &mut PresenceClient<Channel>, user: &str) -> Result<pb::UserPresence, tonic::Status> {
    let request = pb::SnapshotRequest { user_ids: vec![user.into()], ..Default::default() };
    Ok(client.snapshot(request).await?.into_inner().users.remove(0))
}

/// A Snapshot as a node forwards it: answered by the owner alone.
async fn forwarded_snapshot(
    client: &mut PresenceClient<Channel>,
    user: &str,
) -> Result<pb::UserPresence, tonic::Status> {
    let mut request = tonic::Request::new(pb::SnapshotRequest { user_ids: vec![user.into()], ..Default::default() });
    request.metadata_mut().insert("presenced-forwarded", "1".parse().unwrap());
    Ok(client.snapshot(request).await?.into_inner().users.remove(0))
}

/// Every answer one node gave for `user`, asked directly (a forwarded
/// request, so that a non-owner refuses rather than forwards) every 20 ms
/// until told to stop: `(when, Ok(()) or the refusal)`.
fn ask_repeatedly(url: String, user: String) -> Asked {
    ask_repeatedly_at(tonic::transport::Endpoint::from_shared(url).unwrap(), user)
}

/// [`ask_repeatedly`] through `endpoint` (from a chosen local address).
fn ask_repeatedly_at(endpoint: tonic::transport::Endpoint, user: String) -> Asked {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut client = PresenceClient::new(endpoint.connect().await.unwrap());
        let mut answers = Vec::new();
        loop {
            let asked = Instant::now();
            let answer = forwarded_snapshot(&mut client, &user).await.map(drop);
            answers.push((asked, answer));
            tokio::select! {
                _ = &mut stopped => return answers,
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
    });
    (stop, task)
}

/// Answers to a Snapshot asked again and again, as [`ask_repeatedly`] gathers them.
type Asked = Running<Vec<(Instant, Result<(), tonic::Status>)>>;

/// Once node-a was cut off at `cut`: waits until etcd has given all its
/// slots away and `follower` answers for `user`, stops the two askers (of
/// node-a, then of the follower) and asserts [`assert_one_owner_at_a_time`].
async fn assert_taken_over_by_one_owner_at_a_time(
    etcd: &EtcdServer,
    follower: &TestServer,
    user: &str,
    old_epoch: i64,
    cut: Instant,
    [(stop_a, answers_a), (stop_follower, answers_follower)]: [Asked; 2],
) {
    let taken =
        map_where(&etcd.client().await, "node-a's slots taken over", |map| map.owned_by("node-a").count() == 0).await;
    let new_epoch = taken.owner(slot_of(user, SLOTS)).unwrap().epoch;
    let deadline = Instant::now() + PATIENCE;
    while forwarded_snapshot(&mut follower.client().await, user).await.is_err() {
        assert!(Instant::now() < deadline, "the follower did not take the slot over");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    // The askers hear the follower's answers too before they stop.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (_, _) = (stop_a.send(()), stop_follower.send(()));
    let (answers_a, answers_follower) = (answers_a.await.unwrap(), answers_follower.await.unwrap());
    assert_one_owner_at_a_time(&answers_a, &answers_follower, cut, (old_epoch, new_epoch));
}

/// The answers of node-a (cut off at `cut`) and of its slot's follower,
/// asked all along, show one owner at a time (C1): node-a's last answer came
/// before the follower's first, within node-a's lease of the cut; node-a's
/// refusals after it name its own lapsed epoch and no owner; the follower's
/// before it took over name node-a at that epoch; its ownership comes with a
/// later one.
fn assert_one_owner_at_a_time(
    answers_a: &[(Instant, Result<(), tonic::Status>)],
    answers_follower: &[(Instant, Result<(), tonic::Status>)],
    cut: Instant,
    (old_epoch, new_epoch): (i64, i64),
) {
    let last_a = answers_a.iter().filter(|(_, answer)| answer.is_ok()).map(|(at, _)| *at).max().unwrap();
    let first_follower = answers_follower.iter().find(|(_, answer)| answer.is_ok()).map(|(at, _)| *at);
    let first_follower = first_follower.expect("the follower answered once it took over");
    assert!(
        last_a < first_follower,
        "node-a answered at {:?}, after the follower at {:?}",
        last_a - cut,
        first_follower - cut
    );
    assert!(last_a - cut < Duration::from_secs(2), "node-a acted {:?} after the cut, past its lease", last_a - cut);
    for (at, answer) in answers_a.iter().filter(|(at, _)| *at > last_a) {
        let refusal = answer.as_ref().unwrap_err();
        assert_eq!(refusal.code(), Code::Unavailable, "{:?}: {refusal:?}", *at - cut);
        let named = not_owner_of(refusal);
        assert_eq!((named.owner_id.as_str(), named.epoch), ("", old_epoch), "{named:?}");
    }
    for (_, answer) in answers_follower.iter().filter(|(at, _)| *at < first_follower) {
        let named = not_owner_of(answer.as_ref().unwrap_err());
        assert_eq!((named.owner_id.as_str(), named.epoch), ("node-a", old_epoch), "{named:?}");
    }
    assert!(new_epoch > old_epoch, "the takeover's epoch {new_epoch} follows node-a's {old_epoch}");
}

/// The port of `host:port`.
fn probe_port(address: &str) -> u16 {
    address.rsplit(':').next().unwrap().parse().unwrap()
}

/// The etcd lease each node's registration is bound to.
async fn registrations(etcd: &Etcd) -> HashMap<String, i64> {
    let mut leases = HashMap::new();
    for node in NODES {
        if let Some(kv) = etcd.get(format!("{PREFIX}nodes/{node}").as_bytes()).await.unwrap() {
            leases.insert(node.to_owned(), kv.lease);
        }
    }
    leases
}

/// The next event of a stream, within the patience.
async fn next_event(stream: &mut tonic::Streaming<pb::WatchEvent>) -> Result<pb::WatchEvent, tonic::Status> {
    let next = tokio::time::timeout(PATIENCE, stream.message()).await.expect("an event within the patience");
    next.and_then(|event| event.ok_or_else(|| tonic::Status::cancelled("the stream ended")))
}

/// Reads updates until the stream ends, which must be `UNAVAILABLE`; anything
/// but an update before it (a part's snapshot above all) fails the test.
async fn updates_until_unavailable(stream: &mut tonic::Streaming<pb::WatchEvent>) -> tonic::Status {
    let ended = loop {
        match next_event(stream).await {
            Ok(pb::WatchEvent { event: Some(pb::watch_event::Event::Update(_)) }) => continue,
            Ok(other) => panic!("only updates before the end: {other:?}"),
            Err(status) => break status,
        }
    };
    assert_eq!(ended.code(), tonic::Code::Unavailable, "{ended:?}");
    ended
}

fn renew(user: &str, generation: u64, ttl_ms: u32) -> pb::LeaseItem {
    pb::LeaseItem {
        op: Some(pb::lease_item::Op::Renew(pb::RenewRequest {
            user_id: user.into(),
            session_id: "s".into(),
            generation,
            ttl_ms,
            ..Default::default()
        })),
    }
}

/// Renews every user's session every 200 ms through `leases` until told to
/// stop; returns how many rounds ran and every renewal that failed.
fn keep_renewing(
    leases: std::sync::Arc<ClusterLeases>,
    generations: Vec<(String, u64)>,
    ttl_ms: u32,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<(usize, Vec<String>)>) {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let (mut rounds, mut failed) = (0, Vec::new());
        loop {
            let items = generations.iter().map(|(user, generation)| renew(user, *generation, ttl_ms)).collect();
            for ((user, _), result) in generations.iter().zip(leases.submit_batch(items).await) {
                if result.code != 0 {
                    failed.push(format!("{user}: {result:?}"));
                }
            }
            rounds += 1;
            tokio::select! {
                _ = &mut stopped => return (rounds, failed),
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    });
    (stop, task)
}

/// Every user's presence, read through `client`.
async fn presences(client: &mut PresenceClient<Channel>, users: &[String]) -> HashMap<String, pb::UserPresence> {
    let request = pb::SnapshotRequest { user_ids: users.to_vec(), ..Default::default() };
    let answer = match client.snapshot(request).await {
        Ok(answer) => answer.into_inner().users,
        Err(status) => panic!("a Snapshot of {} users: {status:?}", users.len()),
    };
    answer.into_iter().map(|presence| (presence.user_id.clone(), presence)).collect()
}

/// The events a watch delivers until it ends (UNAVAILABLE, as a moved part
/// ends it) or stays quiet for a second.
async fn events_until_quiet_or_ended(stream: &mut tonic::Streaming<pb::WatchEvent>) -> Vec<pb::WatchEvent> {
    let mut events = Vec::new();
    while let Ok(Ok(Some(event))) = tokio::time::timeout(Duration::from_secs(1), stream.message()).await {
        events.push(event);
    }
    events
}

/// `user` (at its owner, through `client`) shows the status "lunch", to its audience ("friend") only.
async fn show_lunch_to_friend_only(client: &mut PresenceClient<Channel>, user: &str) {
    let status = pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), ..Default::default() };
    let request = pb::SetStatusRequest { user_id: user.into(), status: Some(status), ..Default::default() };
    client.set_status(request).await.unwrap();
    let audience =
        pb::AudienceRequest { user_id: user.into(), viewer_ids: vec!["friend".into()], ..Default::default() };
    client.grant_audience(audience).await.unwrap();
    let visibility = pb::SetVisibilityRequest {
        user_id: user.into(),
        visibility: pb::Visibility::Audience as i32,
        ..Default::default()
    };
    client.set_visibility(visibility).await.unwrap();
}

/// Touches `user` and gives it the setting locale=fr, at its owner
/// (`client`); answers the activity time the owner recorded.
async fn touch_and_set_locale(client: &mut PresenceClient<Channel>, user: &str) -> i64 {
    let touched = client.touch(pb::TouchRequest { user_id: user.into(), ..Default::default() }).await.unwrap();
    let setting = pb::PutSettingRequest { user_id: user.into(), name: "locale".into(), value: b"fr".to_vec() };
    client.put_setting(setting).await.unwrap();
    touched.into_inner().last_active_at_ms
}

/// Asserts that `user`'s owner, asked through `client`'s node, holds the
/// activity time and the setting [`touch_and_set_locale`] left.
async fn assert_activity_and_locale_kept(client: &mut PresenceClient<Channel>, user: &str, last_active_at_ms: i64) {
    let request = pb::SnapshotRequest { user_ids: vec![user.into()], ..Default::default() };
    let seen = client.snapshot(request).await.unwrap().into_inner().users.remove(0);
    assert_eq!(seen.last_active_at_ms, last_active_at_ms, "{user}'s last activity went with it: {seen:?}");
    // Settings are read at the owner: follow the refusal there.
    let request = pb::GetSettingsRequest { user_id: user.into() };
    let settings = match client.get_settings(request.clone()).await {
        Ok(answer) => answer.into_inner(),
        Err(refused) => {
            let owner = not_owner_of(&refused).owner_addr;
            let mut at_owner = PresenceClient::connect(format!("http://{owner}")).await.unwrap();
            at_owner.get_settings(request).await.unwrap().into_inner()
        }
    };
    assert_eq!(
        settings.settings,
        HashMap::from([("locale".to_owned(), b"fr".to_vec())]),
        "{user}'s settings went with it"
    );
}

/// Asserts, through `viewer`, that "friend" sees `user` online with its "lunch" status and a stranger sees nothing.
async fn assert_lunch_shown_to_friend_only(viewer: &mut PresenceClient<Channel>, user: &str) {
    for (who, sees) in [("friend", true), ("stranger", false)] {
        let request = pb::SnapshotRequest { user_ids: vec![user.into()], viewer_id: who.into(), ..Default::default() };
        let seen = viewer.snapshot(request).await.unwrap().into_inner().users.remove(0);
        let shown = (seen.state == pb::State::Online as i32, seen.status.as_ref().map(|status| status.text.as_str()));
        assert_eq!(shown, if sees { (true, Some("lunch")) } else { (false, None) }, "{who}: {seen:?}");
    }
}

/// The answer to `item` once it is not refused for want of an owner: a
/// gateway sends a refused write again, as `ClusterLeases` does a few hops.
async fn until_not_refused(leases: &ClusterLeases, item: pb::LeaseItem) -> pb::LeaseResult {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let result = leases.submit_batch(vec![item.clone()]).await.remove(0);
        if result.code != Code::Unavailable as u32 || Instant::now() > deadline {
            return result;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The `q`-quantile of `durations` (sorted here), in ms.
fn quantile_ms(durations: &mut [Duration], q: f64) -> f64 {
    durations.sort();
    let index = ((durations.len() as f64 * q).ceil() as usize).clamp(1, durations.len()) - 1;
    durations[index].as_secs_f64() * 1_000.0
}

/// A task running until told to stop, and what it comes to.
type Running<T> = (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<T>);

/// Renews every user's session every 200 ms through `leases` until told to
/// stop, as a gateway does: each round is sent on time, whether or not the
/// ones before were answered (a part waiting for a dead node's slots to get
/// a new owner holds up no other user). Returns, per round, when it started
/// and the renewals that failed.
fn keep_renewing_by_round(
    leases: std::sync::Arc<ClusterLeases>,
    generations: Vec<(String, u64)>,
    ttl_ms: u32,
) -> Running<Vec<(Instant, Vec<String>)>> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let generations = std::sync::Arc::new(generations);
    let task = tokio::spawn(async move {
        let mut rounds = Vec::new();
        loop {
            let (leases, generations) = (std::sync::Arc::clone(&leases), std::sync::Arc::clone(&generations));
            let started = Instant::now();
            rounds.push((
                started,
                tokio::spawn(async move {
                    let items = generations.iter().map(|(user, generation)| renew(user, *generation, ttl_ms)).collect();
                    let results = leases.submit_batch(items).await;
                    generations
                        .iter()
                        .zip(results)
                        .filter(|(_, result)| result.code != 0)
                        .map(|((user, _), result)| format!("{user}: {result:?}"))
                        .collect::<Vec<String>>()
                }),
            ));
            tokio::select! {
                _ = &mut stopped => break,
                () = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
        let mut answered = Vec::new();
        for (started, round) in rounds {
            answered.push((started, round.await.unwrap()));
        }
        answered
    });
    (stop, task)
}

/// Every event a viewer at `url` is sent for `users` until told to stop,
/// reopening (with the versions it holds, E8) whenever the stream ends or
/// cannot be opened, as a browser does: `(user, state, version)` in order.
fn watch_through_failures(url: String, users: Vec<String>) -> Running<Vec<(String, i32, u64)>> {
    let (stop, mut stopped) = tokio::sync::oneshot::channel();
    let task = tokio::spawn(async move {
        let mut seen: Vec<(String, i32, u64)> = Vec::new();
        let mut held: HashMap<String, u64> = HashMap::new();
        loop {
            let opened = async {
                let mut client = PresenceClient::connect(url.clone()).await.ok()?;
                let request =
                    pb::WatchRequest { user_ids: users.clone(), known_versions: held.clone(), ..Default::default() };
                client.watch(request).await.ok().map(tonic::Response::into_inner)
            };
            let stream = tokio::select! {
                _ = &mut stopped => return seen,
                stream = opened => stream,
            };
            if let Some(mut stream) = stream {
                loop {
                    let event = tokio::select! {
                        _ = &mut stopped => return seen,
                        event = stream.message() => event,
                    };
                    let presences = match event {
                        Ok(Some(pb::WatchEvent { event: Some(pb::watch_event::Event::Snapshot(snapshot)) })) => {
                            snapshot.users
                        }
                        Ok(Some(pb::WatchEvent { event: Some(pb::watch_event::Event::Update(update)) })) => {
                            vec![update]
                        }
                        Ok(Some(_)) => continue,
                        _ => break,
                    };
                    for presence in presences {
                        held.insert(presence.user_id.clone(), presence.version);
                        seen.push((presence.user_id, presence.state, presence.version));
                    }
                }
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    });
    (stop, task)
}

/// Asserts that a viewer's events (`watch_through_failures`) hold no
/// OFFLINE (`what` says which) and no user's version going back (M4).
fn assert_no_offline_and_no_version_back(seen: &[(String, i32, u64)], what: &str) {
    let offline: Vec<_> = seen.iter().filter(|(_, state, _)| *state != pb::State::Online as i32).collect();
    assert!(offline.is_empty(), "{what}: {offline:?}");
    let mut last: HashMap<&str, u64> = HashMap::new();
    for (user, _, version) in seen {
        let previous = last.insert(user.as_str(), *version).unwrap_or(0);
        assert!(*version >= previous, "{user}: version {version} after {previous}");
    }
}

/// Whether `viewer` sees `user` ONLINE, asked at `client`'s node; a refusal
/// while the user's slot is being taken in there is asked again.
async fn sees_online(client: &mut PresenceClient<Channel>, viewer: &str, user: &str) -> bool {
    let request = pb::SnapshotRequest { user_ids: vec![user.into()], viewer_id: viewer.into() };
    let deadline = Instant::now() + PATIENCE;
    loop {
        match client.snapshot(request.clone()).await {
            Ok(answer) => return answer.into_inner().users[0].state == pb::State::Online as i32,
            Err(refused) if refused.code() == Code::Unavailable && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(refused) => panic!("Snapshot of {user} for {viewer}: {refused:?}"),
        }
    }
}

/// The group ledger a node holds, sorted.
async fn group_ledger(server: &TestServer) -> Vec<(String, String, u64, bool)> {
    let mut cluster = presence_proto::v1::cluster_client::ClusterClient::connect(server.url()).await.unwrap();
    let mut pieces = cluster.group_ledger(pb::GroupLedgerRequest { digests: Vec::new() }).await.unwrap().into_inner();
    let mut entries = Vec::new();
    while let Some(piece) = pieces.message().await.unwrap() {
        entries
            .extend(piece.entries.into_iter().map(|entry| (entry.group_id, entry.user_id, entry.stamp, entry.member)));
    }
    entries.sort();
    entries
}

fn group(group: &str, users: &[&str]) -> pb::GroupRequest {
    pb::GroupRequest { group_id: group.into(), user_ids: users.iter().map(|user| (*user).into()).collect() }
}

/// Nodes that allow 16 streams a connection (`--max-streams-per-connection`).
fn few_streams_config() -> ServerConfig {
    ServerConfig { max_streams_per_connection: 16, ..fast_config() }
}

// etcd outages longer than the lease TTL, with the nodes coming back at
// different moments, as real nodes do (C3, C4, M4): at the thaw etcd lets
// every node's lease go at once, and each node learns it at its own next
// keep-alive. Each test goes through several outages on one cluster;
// `PRESENCED_THAW_ROUNDS` sets how many (the soak in docs/cluster.md runs 50).

/// How many outages a thaw test goes through: `PRESENCED_THAW_ROUNDS`, or `default`.
fn thaw_rounds(default: usize) -> usize {
    std::env::var("PRESENCED_THAW_ROUNDS").ok().and_then(|rounds| rounds.parse().ok()).unwrap_or(default)
}

/// The three nodes as processes of their own, so that one can be held back
/// with SIGSTOP, each logging at info to `<node>.log` in `logs`; and the slot
/// map once every node owns slots.
async fn three_node_processes(etcd: &EtcdServer, logs: &std::path::Path) -> Vec<daemon::Daemon> {
    let mut nodes = Vec::new();
    for node in NODES {
        let advertise = format!("127.0.0.1:{}", daemon::free_port());
        let args = node_process_args(etcd, node, &advertise);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let log = logs.join(format!("{node}.log"));
        nodes.push(daemon::Daemon::start_on(&advertise, &args, &[("RUST_LOG", "info")], Some(&log)));
    }
    map_where(&etcd.client().await, "every node owns slots", |map| {
        NODES.iter().all(|node| map.owned_by(node).count() > 0)
    })
    .await;
    nodes
}

/// Which node coordinates now, by etcd's election.
async fn coordinator(etcd: &Etcd) -> String {
    etcd_leader(etcd).await.expect("a coordinator")
}

/// The coordinator etcd names now, if any.
async fn etcd_leader(etcd: &Etcd) -> Option<String> {
    let leader = etcd.leader(&presence_cluster::election_name(PREFIX)).await.unwrap();
    leader.map(|leader| String::from_utf8(leader).unwrap())
}

/// Freezes etcd (SIGSTOP) for twice the nodes' lease TTL, then thaws it
/// with each node held back (SIGSTOP from 100 ms before the thaw) until
/// `holds[i]` after it (`ZERO`: not held). Returns once every node is
/// registered again under a new lease and every slot has a registered owner.
async fn freeze_and_thaw_staggered(etcd: &EtcdServer, nodes: &[daemon::Daemon], holds: [Duration; 3]) {
    let client = etcd.client().await;
    let before = registrations(&client).await;
    assert_eq!(before.len(), NODES.len(), "every node is registered before the outage: {before:?}");
    etcd.signal("-STOP");
    tokio::time::sleep(Duration::from_millis(3_900)).await;
    let held: Vec<usize> = (0..nodes.len()).filter(|&node| !holds[node].is_zero()).collect();
    held.iter().for_each(|&node| nodes[node].pause());
    tokio::time::sleep(Duration::from_millis(100)).await;
    etcd.signal("-CONT");
    let thawed = Instant::now();
    let mut by_hold = held.clone();
    by_hold.sort_by_key(|&node| holds[node]);
    for node in by_hold {
        tokio::time::sleep_until(thawed + holds[node]).await;
        nodes[node].resume();
    }
    let deadline = Instant::now() + PATIENCE;
    let after = loop {
        let now = registrations(&client).await;
        if now.len() == NODES.len() && now.iter().all(|(node, lease)| before[node] != *lease) {
            break now;
        }
        assert!(Instant::now() < deadline, "the nodes did not all join again under new leases: {now:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    map_where(&client, "every slot has a registered owner", |map| {
        (0..SLOTS).all(|slot| after.contains_key(&map.owner(slot).unwrap().node))
    })
    .await;
}

/// A gateway renewing 300 users' sessions every 200 ms through the routing
/// client, and a viewer watching them at one node, reopening with the
/// versions it holds, while a test breaks things; [`Traffic::finish`]
/// asserts that nothing showed.
struct Traffic {
    users: Vec<String>,
    viewer_url: String,
    before: HashMap<String, pb::UserPresence>,
    renewing: Running<Vec<(Instant, Vec<String>)>>,
    watching: Running<Vec<(String, i32, u64)>>,
    /// When each outage began, and what it was.
    outages: Vec<(Instant, String)>,
}

impl Traffic {
    /// Registers `name-0` … `name-299` entering at `entry`, and watches them at `viewer_url`.
    async fn start(name: &str, entry: &str, viewer_url: &str) -> Traffic {
        Traffic::start_with_ttl(name, entry, viewer_url, 3_000).await
    }

    /// [`Traffic::start`], renewing sessions of `ttl_ms`.
    async fn start_with_ttl(name: &str, entry: &str, viewer_url: &str, ttl_ms: u32) -> Traffic {
        let users: Vec<String> = (0..300).map(|i| format!("{name}-{i}")).collect();
        let (leases, generations) = register_all_at(entry, &users).await;
        let mut viewer = PresenceClient::connect(viewer_url.to_owned()).await.unwrap();
        let before = presences(&mut viewer, &users).await;
        let watching = watch_through_failures(viewer_url.to_owned(), users.clone());
        // Sessions renewed every 200 ms.
        let renewing = keep_renewing_by_round(leases, generations, ttl_ms);
        tokio::time::sleep(Duration::from_millis(500)).await;
        Traffic { users, viewer_url: viewer_url.to_owned(), before, renewing, watching, outages: Vec::new() }
    }

    /// Notes that an outage described by `what` began at `started`.
    fn outage(&mut self, started: Instant, what: String) {
        self.outages.push((started, what));
    }

    /// Stops, and asserts what C4 and M4 promise: no session lost (no
    /// renewal answered `NOT_FOUND`, naming the outage it was lost in),
    /// the last renewals all answered, nobody shown OFFLINE, no version
    /// going back at the viewer, and every user online at the version it
    /// had. `logs` says where the nodes' logs are.
    async fn finish(self, logs: &std::path::Path) {
        self.finish_checking(logs, false).await;
    }

    /// [`Traffic::finish`], asserting besides that no renewal met any
    /// refusal at all: the gateway saw nothing (C7).
    async fn finish_seeing_nothing(self, logs: &std::path::Path) {
        self.finish_checking(logs, true).await;
    }

    async fn finish_checking(self, logs: &std::path::Path, nothing_refused: bool) {
        let Traffic { users, viewer_url, before, renewing, watching, outages } = self;
        let _ = renewing.0.send(());
        let rounds = renewing.1.await.unwrap();
        if nothing_refused {
            let refused: Vec<&String> = rounds.iter().flat_map(|(_, failed)| failed).collect();
            assert!(refused.is_empty(), "{} renewals were refused, first {:?}", refused.len(), refused.first());
        }
        let _ = watching.0.send(());
        let seen = watching.1.await.unwrap();
        let lost: Vec<String> = rounds
            .iter()
            .flat_map(|(at, failed)| failed.iter().map(move |failure| (*at, failure)))
            .filter(|(_, failure)| failure.contains("code: 5,"))
            .map(|(at, failure)| {
                let outage =
                    outages.iter().rev().find(|(started, _)| *started <= at).map_or("before", |(_, what)| what);
                format!("{outage}: {failure}")
            })
            .collect();
        let logs = logs.display();
        assert!(lost.is_empty(), "{} renewals met NOT_FOUND (logs in {logs}), first {:?}", lost.len(), lost.first());
        let settled = rounds.iter().rev().take(3).flat_map(|(_, failed)| failed).collect::<Vec<_>>();
        let since_last_outage = outages.last().zip(rounds.last()).map(|((started, _), (at, _))| *at - *started);
        assert!(
            settled.is_empty(),
            "the last rounds of renewals failed, the last round {since_last_outage:?} after the last outage began \
             (logs in {logs}): {settled:?}"
        );
        assert_no_offline_and_no_version_back(&seen, "no OFFLINE through the outages");
        let mut viewer = PresenceClient::connect(viewer_url).await.unwrap();
        assert_online_at_the_versions_before(&mut viewer, &users, &before).await;
    }
}

impl Traffic {
    /// Stops, asserting nothing: for faults that lose users, as two nodes
    /// failing at once (a slot's one copy is at its follower).
    async fn stop(self) {
        let _ = self.renewing.0.send(());
        let _ = self.renewing.1.await.unwrap();
        let _ = self.watching.0.send(());
        let _ = self.watching.1.await.unwrap();
    }
}

/// Runs `rounds` etcd outages on three node processes under [`Traffic`]
/// entering at node-a and watched at node-b; each outage's thaw holds the
/// nodes back as `holds(round, coordinator)` says (by index into `NODES`).
/// Then asserts that nothing showed, and that every user is at one node only.
async fn staggered_thaws(name: &str, rounds: usize, holds: impl Fn(usize, usize) -> [Duration; 3]) {
    let logs = daemon::scratch_dir(name);
    let etcd = EtcdServer::start().await;
    let nodes = three_node_processes(&etcd, &logs).await;
    let mut traffic = Traffic::start(name, &nodes[0].url(), &nodes[1].url()).await;
    let client = etcd.client().await;
    for round in 0..rounds {
        let coordinator = coordinator(&client).await;
        let coordinator = NODES.iter().position(|node| *node == coordinator).unwrap();
        let holds = holds(round, coordinator);
        traffic.outage(Instant::now(), format!("outage {round} (coordinator {}, holds {holds:?})", NODES[coordinator]));
        freeze_and_thaw_staggered(&etcd, &nodes, holds).await;
        // Renewals go on at whichever node the map gives each user now.
        tokio::time::sleep(Duration::from_millis(1_500)).await;
    }
    let users = traffic.users.clone();
    traffic.finish(&logs).await;
    // Each node joined again once per lease etcd let go.
    for node in NODES {
        let log = std::fs::read_to_string(logs.join(format!("{node}.log"))).unwrap();
        let joined = log.matches("joined the cluster again").count();
        assert_eq!(
            joined,
            rounds,
            "{node} joined again {joined} times in {rounds} outages (logs in {})",
            logs.display()
        );
    }
    let map = map_where(&client, "the map after the outages", |_| true).await;
    for user in &users {
        let owner = &map.owner(slot_of(user, SLOTS)).unwrap().node;
        for (node, process) in NODES.iter().zip(&nodes) {
            let mut client = PresenceClient::connect(process.url()).await.unwrap();
            let answered = forwarded_snapshot(&mut client, user).await;
            assert_eq!(answered.is_ok(), node == owner, "{user} at {node} (owner {owner}): {answered:?}");
        }
    }
    for node in nodes {
        node.stop().await;
    }
    let _ = std::fs::remove_dir_all(&logs);
}
