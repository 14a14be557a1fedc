//! A1, A3 and A4 over gRPC: sessions report their attention on Register,
//! Renew and Leases items, and NotifyTargets answers where a notification
//! should go from it; seed 000's laptop and phone, bad input naming its
//! field without changing anything, and who may ask.

use std::time::Duration;

use crate::common::auth::{SERVICE, secured_config, viewer_token};
use crate::common::*;
use presence_proto::v1::{self as pb, lease_item};
use presence_server::ServerConfig;
use tonic::Code;

/// The fast configuration with a one-second hand-off, so that a lock's
/// hand-off passes within a test.
fn handoff_config() -> ServerConfig {
    ServerConfig { push_handoff: Duration::from_secs(1), ..fast_config() }
}

fn with_attention(
    mut request: pb::RegisterRequest,
    device: pb::DeviceKind,
    attention: pb::Attention,
) -> pb::RegisterRequest {
    request.device_kind = device as i32;
    request.attention = Some(attention as i32);
    request
}

fn attention_change(
    renewal: pb::RenewRequest,
    attention: Option<pb::Attention>,
    focused_room_id: Option<&str>,
) -> pb::RenewRequest {
    pb::RenewRequest {
        attention: attention.map(|attention| attention as i32),
        focused_room_id: focused_room_id.map(str::to_owned),
        ..renewal
    }
}

async fn targets(
    client: &mut pb::presence_client::PresenceClient<tonic::transport::Channel>,
    users: &[&str],
    room_id: &str,
) -> Vec<pb::NotifyTarget> {
    let request = pb::NotifyTargetsRequest {
        user_ids: users.iter().map(|user| (*user).to_owned()).collect(),
        room_id: room_id.to_owned(),
        ..Default::default()
    };
    client.notify_targets(request).await.expect("NotifyTargets answers").into_inner().targets
}

fn reason(target: &pb::NotifyTarget) -> pb::NotifyReason {
    pb::NotifyReason::try_from(target.reason).unwrap()
}

/// Seed 000's timeline with attention: laptop active and phone in the
/// background, the phone gets no push; the laptop locks, and after the
/// hand-off the phone gets it; the room open on the laptop, no push for it;
/// the laptop's lease expires, a push at once.
#[tokio::test]
async fn a3_the_laptop_and_the_phone() {
    let server = TestServer::start(handoff_config()).await;
    let mut client = server.client().await;
    let laptop = register("ann", "laptop", "gw", 60_000);
    let laptop = with_attention(laptop, pb::DeviceKind::DeviceDesktop, pb::Attention::Active);
    let laptop_generation = client.register(laptop).await.unwrap().into_inner().generation;
    // The phone registers as an item of a Leases batch, as a gateway sends it.
    let phone =
        with_attention(register("ann", "phone", "gw", 60_000), pb::DeviceKind::DeviceMobile, pb::Attention::Background);
    let registered = lease_batch(&mut client, vec![pb::LeaseItem { op: Some(lease_item::Op::Register(phone)) }]).await;
    assert_eq!(registered[0].code, 0, "{:?}", registered[0].message);

    let answer = targets(&mut client, &["ann", "nobody"], "").await;
    assert_eq!(answer.len(), 2);
    assert_eq!((answer[0].user_id.as_str(), reason(&answer[0])), ("ann", pb::NotifyReason::AttendedElsewhere));
    assert_eq!(answer[0].in_app_session_ids, ["laptop"], "the phone is in the background");
    assert_eq!((answer[0].push_now, answer[0].push_after_ms), (false, 1_000));
    assert_eq!((reason(&answer[1]), answer[1].push_now), (pb::NotifyReason::Offline, true));

    // The doc open on the laptop (a renewal carrying the focus): no push for it, on any device.
    let focus = attention_change(renew("ann", "laptop", laptop_generation, 60_000), None, Some("doc-7"));
    client.renew(focus).await.unwrap();
    let open = targets(&mut client, &["ann"], "doc-7").await;
    assert_eq!((reason(&open[0]), open[0].push_now, open[0].push_after_ms), (pb::NotifyReason::RoomOpen, false, 0));
    assert_eq!(reason(&targets(&mut client, &["ann"], "doc-8").await[0]), pb::NotifyReason::AttendedElsewhere);

    // The laptop locks (a Leases renew item): held for the hand-off, then pushed.
    let lock =
        attention_change(renew("ann", "laptop", laptop_generation, 60_000), Some(pb::Attention::Background), None);
    let locked = lease_batch(&mut client, vec![pb::LeaseItem { op: Some(lease_item::Op::Renew(lock)) }]).await;
    assert_eq!(locked[0].code, 0, "{:?}", locked[0].message);
    let held = targets(&mut client, &["ann"], "").await;
    assert_eq!((reason(&held[0]), held[0].push_now), (pb::NotifyReason::AttendedElsewhere, false));
    assert!(held[0].push_after_ms <= 1_000 && held[0].in_app_session_ids.is_empty(), "{held:?}");
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let now = targets(&mut client, &["ann"], "").await;
        if now[0].push_now {
            assert_eq!(reason(&now[0]), pb::NotifyReason::NoAttendedSession);
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the hand-off never passed: {now:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // The laptop active again with a short lease that runs out: the phone alone, pushed at once.
    let back =
        with_attention(register("ann", "laptop", "gw", 200), pb::DeviceKind::DeviceDesktop, pb::Attention::Active);
    client.register(back).await.unwrap();
    assert_eq!(reason(&targets(&mut client, &["ann"], "").await[0]), pb::NotifyReason::AttendedElsewhere);
    tokio::time::sleep(Duration::from_millis(400)).await;
    let expired = targets(&mut client, &["ann"], "").await;
    assert_eq!((reason(&expired[0]), expired[0].push_now), (pb::NotifyReason::NoAttendedSession, true), "{expired:?}");
    server.stop().await;
}

/// B1 for attention: an unknown enum value or an oversized room names its
/// field, and the register it rode on is not applied.
#[tokio::test]
async fn a1_bad_attention_names_its_field_and_changes_nothing() {
    let server = TestServer::start(fast_config()).await;
    let mut client = server.client().await;
    let mut bad = register("bo", "s1", "gw", 60_000);
    bad.attention = Some(9);
    let refused = client.register(bad).await.unwrap_err();
    assert_eq!(
        (refused.code(), refused.message().starts_with("attention: 9 is not an Attention")),
        (Code::InvalidArgument, true),
        "{refused:?}"
    );
    let mut bad = register("bo", "s1", "gw", 60_000);
    bad.device_kind = 7;
    let refused = client.register(bad).await.unwrap_err();
    assert!(refused.message().starts_with("device_kind:"), "{refused:?}");
    let mut bad = register("bo", "s1", "gw", 60_000);
    bad.focused_room_id = Some("r".repeat(129));
    let refused = client.register(bad).await.unwrap_err();
    assert!(refused.message().starts_with("focused_room_id:"), "{refused:?}");
    let snapshot =
        client.snapshot(pb::SnapshotRequest { user_ids: vec!["bo".into()], ..Default::default() }).await.unwrap();
    assert_eq!(snapshot.into_inner().users[0].state, pb::State::Offline as i32, "no refused register was applied");

    // A bad renew item fails alone, and the lease it named stays as it was.
    let generation = client.register(register("bo", "s1", "gw", 60_000)).await.unwrap().into_inner().generation;
    let mut bad = renew("bo", "s1", generation, 60_000);
    bad.attention = Some(-1);
    let items = vec![
        pb::LeaseItem { op: Some(lease_item::Op::Renew(bad)) },
        pb::LeaseItem { op: Some(lease_item::Op::Renew(renew("bo", "s1", generation, 60_000))) },
    ];
    let results = lease_batch(&mut client, items).await;
    assert_eq!((results[0].code, results[1].code), (Code::InvalidArgument as u32, 0), "{results:?}");
    assert!(results[0].message.starts_with("attention:"), "{:?}", results[0].message);
    assert_eq!(reason(&targets(&mut client, &["bo"], "").await[0]), pb::NotifyReason::UnknownFailOpen);

    // NotifyTargets' own fields.
    for (request, field) in [
        (pb::NotifyTargetsRequest::default(), "user_ids"),
        (
            pb::NotifyTargetsRequest { user_ids: (0..1_001).map(|i| format!("u{i}")).collect(), ..Default::default() },
            "user_ids",
        ),
        (pb::NotifyTargetsRequest { user_ids: vec!["bo".into()], urgency: 4, ..Default::default() }, "urgency"),
        (
            pb::NotifyTargetsRequest { user_ids: vec!["bo".into()], handoff_ms: 3_600_001, ..Default::default() },
            "handoff_ms",
        ),
        (
            pb::NotifyTargetsRequest { user_ids: vec!["bo".into()], room_id: "r".repeat(129), ..Default::default() },
            "room_id",
        ),
    ] {
        let refused = client.notify_targets(request).await.unwrap_err();
        assert_eq!(refused.code(), Code::InvalidArgument, "{field}: {refused:?}");
        assert!(refused.message().starts_with(&format!("{field}:")), "{field}: {refused:?}");
    }
    server.stop().await;
}

/// A4: a batch of 1,000 users is one call, answered in request order; a
/// viewer may not ask (it would read other users' sessions), a service may.
#[tokio::test]
async fn a4_a_thousand_users_in_one_call_and_viewers_are_refused() {
    let server = TestServer::start(secured_config()).await;
    let mut client = server.client().await;
    let generation = client
        .register(with_token(
            with_attention(register("u500", "s1", "gw", 60_000), pb::DeviceKind::DeviceWeb, pb::Attention::Active),
            Some(SERVICE),
        ))
        .await
        .unwrap()
        .into_inner()
        .generation;
    assert!(generation > 0);
    let users: Vec<String> = (0..1_000).map(|i| format!("u{i}")).collect();
    let request =
        pb::NotifyTargetsRequest { user_ids: users.clone(), urgency: pb::Urgency::Normal as i32, ..Default::default() };
    let answer = client.notify_targets(with_token(request.clone(), Some(SERVICE))).await.unwrap().into_inner().targets;
    let answered: Vec<&str> = answer.iter().map(|target| target.user_id.as_str()).collect();
    assert_eq!(answered, users, "in request order");
    assert_eq!(reason(&answer[500]), pb::NotifyReason::AttendedElsewhere);
    assert!(answer.iter().enumerate().all(|(i, target)| i == 500 || reason(target) == pb::NotifyReason::Offline));

    let refused = client.notify_targets(with_token(request, Some(&viewer_token("u1", false)))).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    assert_eq!(refused.message(), "NotifyTargets: requires service credentials");
    server.stop().await;
}

/// The fast configuration with a one-second active window (A2).
fn window_config() -> ServerConfig {
    let mut config = fast_config();
    config.store.active_window_ms = 1_000;
    config
}

fn availability_of(presence: &pb::UserPresence) -> pb::Availability {
    pb::Availability::try_from(presence.availability).unwrap()
}

/// A2 over gRPC: a viewer sees ACTIVE with the register that says it, AWAY
/// a window after the laptop locks (a new version, ordered like any change),
/// ACTIVE again at once, and nothing beside ONLINE for a gateway that says
/// nothing of attention; Snapshot shows the same; SetStatus may not choose
/// ACTIVE, which only the sessions make.
#[tokio::test]
async fn a2_a_viewer_sees_active_then_away_in_version_order() {
    let server = TestServer::start(window_config()).await;
    let mut client = server.client().await;
    let mut viewer = Viewer::open(&mut client, &["ann", "bob"]).await;
    let laptop =
        with_attention(register("ann", "laptop", "gw", 60_000), pb::DeviceKind::DeviceDesktop, pb::Attention::Active);
    let generation = client.register(laptop).await.unwrap().into_inner().generation;
    let online = viewer.until_update_of("ann").await;
    assert_eq!((state_of(&online), availability_of(&online)), (pb::State::Online, pb::Availability::Active));

    let locked = attention_change(renew("ann", "laptop", generation, 60_000), Some(pb::Attention::Background), None);
    client.renew(locked).await.unwrap();
    let away = viewer.until_update_of("ann").await;
    assert_eq!((state_of(&away), availability_of(&away)), (pb::State::Online, pb::Availability::Away));
    assert!(away.version > online.version, "a change of availability is a change of the user (M3)");
    assert_eq!(snapshot(&mut client, &["ann"]).await[0], away, "Snapshot shows what the viewer was sent");

    let back = attention_change(renew("ann", "laptop", generation, 60_000), Some(pb::Attention::Active), None);
    client.renew(back).await.unwrap();
    let active = viewer.until_update_of("ann").await;
    assert_eq!(availability_of(&active), pb::Availability::Active);
    assert!(active.version > away.version);

    // A gateway that says nothing: ONLINE, no availability, one change.
    client.register(register("bob", "tab", "gw", 60_000)).await.unwrap();
    let bob = viewer.until_update_of("bob").await;
    assert_eq!((state_of(&bob), availability_of(&bob)), (pb::State::Online, pb::Availability::Unspecified));

    let chosen = pb::SetStatusRequest {
        user_id: "ann".into(),
        status: Some(pb::Status { availability: pb::Availability::Active as i32, ..Default::default() }),
    };
    let refused = client.set_status(chosen).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("status.availability:"), "{refused:?}");
    server.stop().await;
}

/// A2 with P2–P4: a user that does not share its availability is shown to
/// a viewer exactly as a user whose gateway never said anything of
/// attention, byte for byte but for the id and version, at once on an open
/// stream, and for as long as it does not share; it may say so itself; when
/// it shares again it is shown at once. A bad request names its field.
#[tokio::test]
async fn a2_a_user_that_does_not_share_is_shown_as_one_that_never_said() {
    let mut config = secured_config();
    config.store.active_window_ms = 1_000;
    let server = TestServer::start(config).await;
    let mut client = server.client().await;
    let everyone = |user: &str, share_activity: Option<bool>| pb::SetVisibilityRequest {
        user_id: user.into(),
        visibility: pb::Visibility::Everyone as i32,
        share_activity,
    };
    for user in ["ann", "bob"] {
        client.set_visibility(with_token(everyone(user, None), Some(SERVICE))).await.unwrap();
    }
    let active =
        with_attention(register("ann", "laptop", "gw", 60_000), pb::DeviceKind::DeviceDesktop, pb::Attention::Active);
    let laptop = client.register(with_token(active, Some(SERVICE))).await.unwrap().into_inner().generation;
    client.register(with_token(register("bob", "tab", "gw", 60_000), Some(SERVICE))).await.unwrap();
    let viewer = viewer_token("viewer", false);
    let watch = pb::WatchRequest { user_ids: vec!["ann".into(), "bob".into(), "viewer".into()], ..Default::default() };
    let mut watching = Viewer::open_request(&mut client, with_token(watch, Some(&viewer))).await;
    let snapshot_as_viewer = |client: &mut pb::presence_client::PresenceClient<tonic::transport::Channel>| {
        let request = pb::SnapshotRequest { user_ids: vec!["ann".into(), "bob".into()], ..Default::default() };
        let mut client = client.clone();
        let viewer = viewer.clone();
        async move { client.snapshot(with_token(request, Some(&viewer))).await.unwrap().into_inner().users }
    };
    let shared = snapshot_as_viewer(&mut client).await;
    assert_eq!(availability_of(&shared[0]), pb::Availability::Active);

    // ann says it herself: only the availability changes.
    let hide = pb::SetVisibilityRequest { user_id: "ann".into(), share_activity: Some(false), ..Default::default() };
    client.set_visibility(with_token(hide, Some(&viewer_token("ann", false)))).await.unwrap();
    let hidden = watching.until_update_of("ann").await;
    assert_eq!((state_of(&hidden), availability_of(&hidden)), (pb::State::Online, pb::Availability::Unspecified));
    let shape = |presence: &pb::UserPresence| {
        prost::Message::encode_to_vec(&pb::UserPresence { user_id: String::new(), version: 0, ..presence.clone() })
    };
    // Its laptop locks, comes back, locks again: nothing reaches the viewer.
    for (at, attention) in
        [pb::Attention::Background, pb::Attention::Active, pb::Attention::Background].into_iter().enumerate()
    {
        let change = attention_change(renew("ann", "laptop", laptop, 60_000), Some(attention), None);
        client.renew(with_token(change, Some(SERVICE))).await.unwrap();
        let answered = snapshot_as_viewer(&mut client).await;
        assert_eq!(shape(&answered[0]), shape(&answered[1]), "step {at}: ann is shown as bob, who never said");
        assert_eq!(answered[0].version, hidden.version, "step {at}: no version moves");
    }
    // Past the window (kept to the second, rounded up): AWAY, were it shown.
    tokio::time::sleep(Duration::from_millis(2_100)).await;
    watching.barrier_with(&mut client, "viewer", Some(SERVICE)).await;
    assert_eq!(watching.updates_of("ann").len(), 1, "only the change to hidden: {:?}", watching.updates);

    // Shared again: AWAY at once, with a new version.
    client.set_visibility(with_token(everyone("ann", Some(true)), Some(SERVICE))).await.unwrap();
    let again = watching.until_update_of("ann").await;
    assert_eq!(availability_of(&again), pb::Availability::Away);
    assert!(again.version > hidden.version);

    // Neither a visibility nor a choice: refused, naming the field; another user's choice: refused.
    let empty = pb::SetVisibilityRequest { user_id: "ann".into(), ..Default::default() };
    let refused = client.set_visibility(with_token(empty, Some(SERVICE))).await.unwrap_err();
    assert_eq!(refused.code(), Code::InvalidArgument, "{refused:?}");
    assert!(refused.message().starts_with("visibility:"), "{refused:?}");
    let others = pb::SetVisibilityRequest { user_id: "bob".into(), share_activity: Some(false), ..Default::default() };
    let refused = client.set_visibility(with_token(others, Some(&viewer_token("ann", false)))).await.unwrap_err();
    assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
    server.stop().await;
}
