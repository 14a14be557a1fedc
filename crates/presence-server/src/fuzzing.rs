//! Entry points for the fuzz targets in `fuzz/` (feature `fuzzing`; see
//! `fuzz/README.md`), and the seeds of their corpus.
//!
//! Each entry hands bytes from outside, as a client or a disk would hand
//! them, to the code the server runs on them: a request to the service's own
//! handler, a Leases frame to the lease workers' own `apply`, a stored value
//! to `durable.rs`'s decoders, an `authorization` header to the
//! authenticator. Nothing here re-implements what it tests. Every input runs
//! against a fresh in-memory server, so that an input's outcome never depends
//! on the inputs before it and a crash reproduces from its input alone.
//!
//! An entry returns normally for every input the server answers, whatever the
//! answer; a panic, a hang or an allocation without bound is the defect the
//! fuzzer looks for. Where a decoder has a writer, the entry also checks that
//! what the decoder accepts is exactly what the writer writes.

use std::sync::{Arc, OnceLock};

use base64::Engine as _;
use jsonwebtoken::{Algorithm, EncodingKey};
use presence_core::{Store, StoreConfig};
use presence_proto::lease_frames::LeaseBatchFrame;
use presence_proto::v1::{self as pb, presence_server::Presence as _};
use prost::Message;
use tokio_util::sync::CancellationToken;
use tonic::Request;
use tonic::metadata::{MetadataMap, MetadataValue};

use crate::api::service::PresenceService;
use crate::auth::{AuthConfig, Authenticator};
use crate::node::clock::StoreClock;
use crate::node::context::Context;
use crate::node::leases::{self, LeaseQueue};
use crate::node::privacy::Visibility;
use crate::node::storage::durable::{self, stored};
use crate::{ServerConfig, node::wire};

/// The store a fuzzed request meets: the default limits (TTL bounds, the
/// renewal throttle, metadata sizes), with few shards so that creating one
/// per input costs little.
fn store_config() -> StoreConfig {
    StoreConfig { shards: 4, ..StoreConfig::default() }
}

/// When every fuzzed input runs, in store ticks (2023-11-14): the clock
/// stands still there, so an input meets the same generations each time.
const EPOCH: u64 = 1_700_000_000_000;

/// A fresh in-memory server's shared state.
fn context() -> Arc<Context> {
    let clock = StoreClock::frozen_at(EPOCH);
    let store = Store::new(store_config(), clock.now()).expect("the fuzzing store config is valid");
    // The default reads the CPU count from the cgroup files: once, not per input.
    static CONFIG: OnceLock<ServerConfig> = OnceLock::new();
    let config = CONFIG.get_or_init(ServerConfig::default);
    // A change feed in memory, as a server without a data directory has.
    let retention = config.feed_retention().expect("the default keeps a feed");
    let (feed, _) = crate::node::feed::Feed::open(None, retention, crate::node::feed::SINGLE_NODE_SLOTS, EPOCH)
        .expect("a feed in memory opens");
    let store = Arc::new(store.with_feed(feed.intake()));
    Arc::new(Context::new(store, clock, None, Some(feed), &config.node(), CancellationToken::new()))
}

// ---------------------------------------------------------------------------
// Requests.

/// The unary and server-streaming RPCs, in the order [`request`] numbers
/// them. `Leases` has its own entry, [`leases`].
pub const METHODS: [&str; 32] = [
    "Register",
    "Renew",
    "Unregister",
    "Revoke",
    "Snapshot",
    "Watch",
    "UpdateWatch",
    "Join",
    "Leave",
    "Signal",
    "RoomSnapshot",
    "WatchRoom",
    "SetRoomAccess",
    "SetStatus",
    "SetVisibility",
    "GrantAudience",
    "RevokeAudience",
    "JoinGroup",
    "LeaveGroup",
    "Touch",
    "PutSetting",
    "GetSettings",
    "ListSessions",
    "Stats",
    "ExportUser",
    "EraseUser",
    "Backup",
    "RoomCounts",
    "WatchRoomCounts",
    "UpdateWatchRoomCounts",
    "Changes",
    "NotifyTargets",
];

/// Decodes `body` as the request of `METHODS[method % METHODS.len()]`, as
/// the service's codec does, and runs the service's handler on it, on a fresh
/// server that runs open (every caller a service, as in development). A
/// stream the handler opens is dropped at once.
pub fn request(method: u8, body: &[u8]) {
    let context = context();
    // Without workers: a Leases batch never reaches this service. The
    // receiver is kept so that the queue stays open, as in a running server.
    let (queue, _jobs) = LeaseQueue::new(Arc::clone(&context), 1);
    let auth = Authenticator::new(AuthConfig::default()).expect("the open configuration is valid");
    let audit = Arc::new(crate::audit::Audit::default());
    let service = PresenceService::new(Arc::clone(&context), None, queue, Arc::new(auth), audit);
    // One runtime per input: dropping it ends whatever a handler spawned
    // (a Watch stream's forwarder), so nothing outlives the input.
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_time().build().expect("a current-thread runtime builds");
    runtime.block_on(dispatch(&service, method, body));
    context.stopping.cancel();
}

/// Calls `$service.$method` with `$body` decoded as its request, if it decodes.
macro_rules! call {
    ($service:expr, $method:ident, $body:expr) => {
        if let Ok(message) = Message::decode($body) {
            drop($service.$method(Request::new(message)).await);
        }
    };
}

async fn dispatch(service: &PresenceService, method: u8, body: &[u8]) {
    match usize::from(method) % METHODS.len() {
        0 => call!(service, register, body),
        1 => call!(service, renew, body),
        2 => call!(service, unregister, body),
        3 => call!(service, revoke, body),
        4 => call!(service, snapshot, body),
        5 => call!(service, watch, body),
        6 => call!(service, update_watch, body),
        7 => call!(service, join, body),
        8 => call!(service, leave, body),
        9 => call!(service, signal, body),
        10 => call!(service, room_snapshot, body),
        11 => call!(service, watch_room, body),
        12 => call!(service, set_room_access, body),
        13 => call!(service, set_status, body),
        14 => call!(service, set_visibility, body),
        15 => call!(service, grant_audience, body),
        16 => call!(service, revoke_audience, body),
        17 => call!(service, join_group, body),
        18 => call!(service, leave_group, body),
        19 => call!(service, touch, body),
        20 => call!(service, put_setting, body),
        21 => call!(service, get_settings, body),
        22 => call!(service, list_sessions, body),
        23 => call!(service, stats, body),
        24 => call!(service, export_user, body),
        25 => call!(service, erase_user, body),
        26 => call!(service, backup, body),
        27 => call!(service, room_counts, body),
        28 => call!(service, watch_room_counts, body),
        29 => call!(service, update_watch_room_counts, body),
        30 => call!(service, changes, body),
        _ => call!(service, notify_targets, body),
    }
}

/// Decodes `frame` as one `LeaseBatch` of a Leases stream, admits it as the
/// stream does and applies it as a lease worker does, on a fresh store;
/// `shed_renewals` applies it as a worker does when the queue is full (B2).
/// Every item must be answered, in order (L8).
pub fn leases(shed_renewals: bool, frame: &[u8]) {
    let Ok(batch) = LeaseBatchFrame::decode(bytes::Bytes::copy_from_slice(frame)) else { return };
    if leases::admit(&batch).is_err() {
        return;
    }
    let items = batch.items.len();
    let batch_id = batch.batch_id;
    let results = leases::apply(&context(), &batch, shed_renewals);
    assert_eq!((results.batch_id, results.results.len()), (batch_id, items), "one result per item (L8)");
}

// ---------------------------------------------------------------------------
// Stored values.

/// The tables of `durable.redb` whose values [`stored_value`] decodes.
pub const STORED_TABLES: [&str; 2] = ["visibility", "status"];

/// Decodes `bytes` as a value of `STORED_TABLES[table % 2]` as the server
/// does when it loads relations, and checks that a value it accepts is one
/// its writer writes, byte for byte: the decoders guess nothing.
pub fn stored_value(table: u8, bytes: &[u8]) {
    match table % 2 {
        0 => {
            let Some(&code) = bytes.first() else { return };
            if let Some(visibility) = stored::visibility(code) {
                assert_eq!(stored::visibility_code(visibility), code);
            }
        }
        _ => {
            if let Some(status) = durable::decode_status(bytes) {
                assert_eq!(durable::encode_status(&status), bytes, "{status:?}");
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Credentials.

/// The service token [`authenticator`] accepts.
pub const SERVICE_TOKEN: &str = "fuzzing-only-service-token";
/// The HS256 secret [`authenticator`] verifies viewer tokens with.
const HS256_SECRET: &str = "fuzzing-only-hs256-secret-of-at-least-32-bytes";
/// The Ed25519 key [`authenticator`] verifies viewer tokens with, generated
/// for fuzzing only (`openssl genpkey -algorithm ed25519`).
const ED25519_PRIVATE_PEM: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIP7lcdDuN0Urn3oc9xf/hROuOdbeXOsUf8DU/KgmI0Ii
-----END PRIVATE KEY-----
";
const ED25519_PUBLIC_PEM: &str = "-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEAqDCx8HjaSLKYfglQgR/g2zPj5pjuV9jyV6c633JZvks=
-----END PUBLIC KEY-----
";

/// One authenticator for every input: it holds no state that a call changes.
fn authenticator() -> &'static Authenticator {
    static AUTH: OnceLock<Authenticator> = OnceLock::new();
    AUTH.get_or_init(|| {
        Authenticator::new(AuthConfig {
            service_tokens: vec![SERVICE_TOKEN.to_owned()],
            viewer_jwt_hs256_secret: Some(HS256_SECRET.to_owned()),
            viewer_jwt_public_key_pem: Some(ED25519_PUBLIC_PEM.as_bytes().to_vec()),
            jwt_leeway_secs: 0,
            ..AuthConfig::default()
        })
        .expect("the fuzzing credentials are valid")
    })
}

/// Names the caller of a request whose `authorization` metadata entries are
/// the lines of `header` (more than one is refused), as every handler does:
/// a service token, a viewer token verified with the HS256 secret or the
/// Ed25519 key, or `UNAUTHENTICATED`. A viewer's id is a valid user id.
pub fn authorization(header: &[u8]) {
    let mut metadata = MetadataMap::new();
    for line in header.split(|&byte| byte == b'\n').take(3) {
        // As the HTTP/2 layer does, a value with bytes a header cannot hold never arrives.
        let Ok(value) = MetadataValue::try_from(line) else { return };
        metadata.append("authorization", value);
    }
    if let Ok(crate::auth::Caller::Viewer(viewer)) = authenticator().caller(&metadata) {
        wire::id("sub", &viewer.id).expect("a verified viewer is a valid user id");
    }
}

/// A token of `header` and `claims` (JSON, or anything) signed with the HS256
/// secret, so that a fuzzer reaches the checks that follow the signature's:
/// `alg`, `exp`, `nbf` and `sub`, which are the same for every key.
pub fn signed_token(header: &[u8], claims: &[u8]) -> String {
    static KEY: OnceLock<EncodingKey> = OnceLock::new();
    let key = KEY.get_or_init(|| EncodingKey::from_secret(HS256_SECRET.as_bytes()).expect("a valid secret"));
    let encode = |part: &[u8]| base64::engine::general_purpose::URL_SAFE_NO_PAD.encode(part);
    let message = format!("{}.{}", encode(header), encode(claims));
    let signature =
        jsonwebtoken::crypto::sign(message.as_bytes(), key, Algorithm::HS256).expect("HMAC signing cannot fail");
    format!("{message}.{signature}")
}

// ---------------------------------------------------------------------------
// Seeds.

/// One input of a target's corpus, made by the code that makes such inputs in
/// production: requests and batches encoded from the generated messages, a
/// checkpoint written by the store, values by `durable.rs`'s writers, tokens
/// by the JWT library.
#[derive(Debug)]
pub struct Seed {
    /// The fuzz target: `requests`, `leases`, `checkpoint`, `stored_values` or `credentials`.
    pub target: &'static str,
    /// The file's name in `fuzz/corpus/TARGET/`.
    pub name: String,
    /// The input, in the target's format (see its source).
    pub bytes: Vec<u8>,
}

/// Every seed, in a fixed order; the same bytes on every call.
pub fn seeds() -> Vec<Seed> {
    let mut seeds = Vec::new();
    let mut add = |target: &'static str, name: &str, bytes: Vec<u8>| {
        seeds.push(Seed { target, name: format!("seed-{name}"), bytes });
    };
    for (index, body) in request_seeds().into_iter().enumerate() {
        let mut bytes = vec![index as u8];
        bytes.extend(body);
        add("requests", &METHODS[index].to_lowercase(), bytes);
    }
    for (name, flags, batch) in lease_seeds() {
        add("leases", name, [vec![flags], batch.encode_to_vec()].concat());
    }
    let checkpoint = checkpoint_seed();
    // Whole pieces of the largest size; then pieces of 1, 2, 51 and 1 KiB
    // bytes, which cut records everywhere.
    add("checkpoint", "large-pieces", [&[0, 255, 255, 255, 255][..], &checkpoint].concat());
    add("checkpoint", "small-pieces", [&[0, 0, 3, 20, 90][..], &checkpoint].concat());
    for visibility in [Visibility::Everyone, Visibility::Audience, Visibility::Nobody] {
        add(
            "stored_values",
            &format!("visibility-{visibility:?}").to_lowercase(),
            vec![0, stored::visibility_code(visibility)],
        );
    }
    for (name, availability, text, expires_at) in [
        ("status-available", presence_core::Availability::Available, "", None),
        ("status-away", presence_core::Availability::Away, "lunch", Some(1_800_000_000_000)),
        ("status-dnd", presence_core::Availability::DoNotDisturb, "héllo", None),
    ] {
        let status = presence_core::Status { availability, text: text.into(), expires_at };
        add("stored_values", name, [vec![1], durable::encode_status(&status)].concat());
    }
    for (name, authorization) in credential_seeds() {
        add("credentials", name, [vec![0], authorization.into_bytes()].concat());
    }
    let header = br#"{"alg":"HS256","typ":"JWT"}"#;
    let claims = format!(r#"{{"sub":"alice","exp":{FAR_FUTURE},"nbf":1700000000}}"#);
    add("credentials", "signed-hs256", [&[1][..], header, &[0], claims.as_bytes()].concat());
    seeds
}

/// An `exp` that stays in the future: 2100-01-01.
const FAR_FUTURE: u64 = 4_102_444_800;

fn metadata(entries: &[(&str, &str)]) -> std::collections::HashMap<String, String> {
    entries.iter().map(|(key, value)| ((*key).to_owned(), (*value).to_owned())).collect()
}

/// One real request of each of [`METHODS`], in its order.
fn request_seeds() -> Vec<Vec<u8>> {
    let ids = |ids: &[&str]| ids.iter().map(|id| (*id).to_owned()).collect::<Vec<_>>();
    let (alice, s1, room) = ("alice".to_owned(), "s1".to_owned(), "room-1".to_owned());
    let status = pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), expires_at_ms: 0 };
    let seeds = vec![
        pb::RegisterRequest {
            user_id: alice.clone(),
            session_id: s1.clone(),
            gateway_id: "gw-1".into(),
            ttl_ms: 30_000,
            metadata: metadata(&[("device", "phone")]),
            device_kind: pb::DeviceKind::DeviceMobile as i32,
            attention: Some(pb::Attention::Active as i32),
            focused_room_id: Some("room-1".into()),
        }
        .encode_to_vec(),
        pb::RenewRequest {
            user_id: alice.clone(),
            session_id: s1.clone(),
            generation: 1,
            ttl_ms: 0,
            attention: Some(pb::Attention::Background as i32),
            focused_room_id: Some(String::new()),
        }
        .encode_to_vec(),
        pb::UnregisterRequest { user_id: alice.clone(), session_id: s1.clone(), generation: 1, linger_ms: 5_000 }
            .encode_to_vec(),
        pb::RevokeRequest { user_id: alice.clone(), session_id: String::new() }.encode_to_vec(),
        pb::SnapshotRequest { viewer_id: "bob".into(), user_ids: ids(&["alice", "carol"]) }.encode_to_vec(),
        pb::WatchRequest {
            viewer_id: "bob".into(),
            user_ids: ids(&["alice"]),
            batch_window_ms: 50,
            known_versions: [("alice".to_owned(), 3)].into(),
        }
        .encode_to_vec(),
        pb::UpdateWatchRequest {
            viewer_id: "bob".into(),
            watch_id: "w-1".into(),
            add_user_ids: ids(&["carol"]),
            remove_user_ids: ids(&["alice"]),
        }
        .encode_to_vec(),
        pb::JoinRequest {
            user_id: alice.clone(),
            session_id: s1.clone(),
            generation: 1,
            room_id: room.clone(),
            metadata: metadata(&[("role", "host")]),
        }
        .encode_to_vec(),
        pb::LeaveRequest { user_id: alice.clone(), session_id: s1.clone(), generation: 1, room_id: room.clone() }
            .encode_to_vec(),
        pb::SignalRequest {
            user_id: alice.clone(),
            session_id: s1.clone(),
            generation: 1,
            room_id: room.clone(),
            kind: "typing".into(),
            ttl_ms: 3_000,
        }
        .encode_to_vec(),
        pb::RoomSnapshotRequest { room_id: room.clone(), viewer_id: "bob".into() }.encode_to_vec(),
        pb::WatchRoomRequest {
            room_id: room.clone(),
            viewer_id: "bob".into(),
            mode: pb::RoomWatchMode::RoomWatchCount as i32,
            count_interval_ms: 500,
        }
        .encode_to_vec(),
        pb::SetRoomAccessRequest { room_id: room, access: pb::RoomAccess::Public as i32 }.encode_to_vec(),
        pb::SetStatusRequest { user_id: alice.clone(), status: Some(status) }.encode_to_vec(),
        pb::SetVisibilityRequest {
            user_id: alice.clone(),
            visibility: pb::Visibility::Audience as i32,
            ..Default::default()
        }
        .encode_to_vec(),
        pb::AudienceRequest { user_id: alice.clone(), viewer_ids: ids(&["bob"]) }.encode_to_vec(),
        pb::AudienceRequest { user_id: alice.clone(), viewer_ids: ids(&["bob"]) }.encode_to_vec(),
        pb::GroupRequest { group_id: "team".into(), user_ids: ids(&["alice", "bob"]) }.encode_to_vec(),
        pb::GroupRequest { group_id: "team".into(), user_ids: ids(&["bob"]) }.encode_to_vec(),
        pb::TouchRequest { user_id: alice.clone() }.encode_to_vec(),
        pb::PutSettingRequest { user_id: alice.clone(), name: "theme".into(), value: b"dark".to_vec() }.encode_to_vec(),
        pb::GetSettingsRequest { user_id: alice.clone() }.encode_to_vec(),
        pb::ListSessionsRequest { user_id: alice.clone() }.encode_to_vec(),
        pb::StatsRequest {}.encode_to_vec(),
        pb::ExportUserRequest { user_id: alice.clone() }.encode_to_vec(),
        pb::EraseUserRequest { user_id: alice }.encode_to_vec(),
        pb::BackupRequest {}.encode_to_vec(),
        pb::RoomCountsRequest { room_ids: ids(&["lobby", "team", "lobby"]), viewer_id: "bob".into() }.encode_to_vec(),
        pb::WatchRoomCountsRequest {
            room_ids: ids(&["lobby", "team"]),
            viewer_id: "bob".into(),
            count_interval_ms: 500,
        }
        .encode_to_vec(),
        pb::UpdateWatchRoomCountsRequest {
            watch_id: "0000000000000000a1".into(),
            add_room_ids: ids(&["kitchen"]),
            remove_room_ids: ids(&["lobby"]),
            viewer_id: "bob".into(),
        }
        .encode_to_vec(),
        pb::ChangesRequest {
            from: pb::ChangesFrom::Oldest as i32,
            kinds: vec![pb::ChangeKind::Flip as i32, pb::ChangeKind::RoomOccupancy as i32],
            id_prefix: "al".into(),
            slots: vec![0, 21, 1023],
            ..Default::default()
        }
        .encode_to_vec(),
        pb::NotifyTargetsRequest {
            user_ids: ids(&["alice", "bob"]),
            room_id: "room-1".into(),
            urgency: pb::Urgency::Normal as i32,
            handoff_ms: 30_000,
        }
        .encode_to_vec(),
    ];
    assert_eq!(seeds.len(), METHODS.len(), "one seed per method");
    seeds
}

/// Real Leases batches: a gateway's first batch (registers), a batch of every
/// other item kind, carrying the generation the first one was answered, and
/// a batch of renewals applied as by a full queue.
fn lease_seeds() -> Vec<(&'static str, u8, pb::LeaseBatch)> {
    use pb::lease_item::Op;
    let register = |user: &str, session: &str| pb::RegisterRequest {
        user_id: user.into(),
        session_id: session.into(),
        gateway_id: "gw-1".into(),
        ttl_ms: 30_000,
        metadata: metadata(&[("device", "phone")]),
        device_kind: pb::DeviceKind::DeviceDesktop as i32,
        attention: Some(pb::Attention::Active as i32),
        focused_room_id: None,
    };
    let item = |op| pb::LeaseItem { op: Some(op) };
    let registers = pb::LeaseBatch {
        batch_id: 1,
        items: vec![item(Op::Register(register("alice", "s1"))), item(Op::Register(register("bob", "s1")))],
    };
    let answered = leases::apply(&context(), &LeaseBatchFrame::from(&registers), false);
    let generation = match &answered.results[0].result {
        Some(pb::lease_result::Result::Register(registered)) => registered.generation,
        other => panic!("a register is answered with its generation, not {other:?}"),
    };
    let (user_id, session_id, room_id) = ("alice".to_owned(), "s1".to_owned(), "room-1".to_owned());
    let renew = pb::RenewRequest {
        user_id: user_id.clone(),
        session_id: session_id.clone(),
        generation,
        ttl_ms: 0,
        attention: Some(pb::Attention::Idle as i32),
        focused_room_id: Some(room_id.clone()),
    };
    let mixed = pb::LeaseBatch {
        batch_id: 2,
        items: [
            registers.items.clone(),
            vec![
                item(Op::Renew(renew.clone())),
                item(Op::Join(pb::JoinRequest {
                    user_id: user_id.clone(),
                    session_id: session_id.clone(),
                    generation,
                    room_id: room_id.clone(),
                    metadata: metadata(&[("role", "host")]),
                })),
                item(Op::Signal(pb::SignalRequest {
                    user_id: user_id.clone(),
                    session_id: session_id.clone(),
                    generation,
                    room_id: room_id.clone(),
                    kind: "typing".into(),
                    ttl_ms: 3_000,
                })),
                item(Op::Leave(pb::LeaveRequest {
                    user_id: user_id.clone(),
                    session_id: session_id.clone(),
                    generation,
                    room_id,
                })),
                item(Op::Unregister(pb::UnregisterRequest { user_id, session_id, generation, linger_ms: 0 })),
            ],
        ]
        .concat(),
    };
    let renewals = pb::LeaseBatch {
        batch_id: 3,
        items: vec![
            item(Op::Renew(renew.clone())),
            item(Op::Renew(pb::RenewRequest { user_id: "bob".into(), ..renew })),
        ],
    };
    vec![("registers", 0, registers), ("every-item", 0, mixed), ("renewals-shed", 1, renewals)]
}

/// A checkpoint of a small store, as the server writes one: online users with
/// several sessions and metadata, a lingering lease, a room membership and a
/// public room.
fn checkpoint_seed() -> Vec<u8> {
    use presence_core::{Changes, Registration, RoomAccess, RoomRef};
    const T0: u64 = EPOCH;
    let store = Store::new(store_config(), T0).expect("a valid config");
    let mut changes = Changes::default();
    let device = vec![("device".to_owned(), "phone".to_owned())];
    let mut generation = 0;
    for (user_id, session_id) in [("alice", "s1"), ("alice", "s2"), ("bob", "s1"), ("carol", "s1")] {
        let registration = Registration { user_id, session_id, gateway_id: "gw-1", ttl_ms: 30_000, metadata: &device };
        let registered = store.register(T0, &registration, &mut changes).expect("a valid registration");
        if (user_id, session_id) == ("alice", "s1") {
            generation = registered.generation;
        }
    }
    let carol = store
        .register(
            T0,
            &Registration { user_id: "carol", session_id: "s1", gateway_id: "gw-1", ttl_ms: 30_000, metadata: &[] },
            &mut changes,
        )
        .expect("a re-registration");
    store.unregister(T0, "carol", "s1", carol.generation, 20_000, &mut changes).expect("an unregister");
    let room = RoomRef { user_id: "alice", session_id: "s1", generation, room_id: "room-1" };
    store.join(T0, &room, &[("role".to_owned(), "host".to_owned())], &mut changes).expect("a join");
    store.set_room_access("room-2", RoomAccess::Public).expect("a valid room");
    presence_core::checkpoint::encode(&store, T0 + 1_000)
}

/// `authorization` metadata as clients send it: a service token, viewer
/// tokens of both key types, and a request with two entries.
fn credential_seeds() -> Vec<(&'static str, String)> {
    use jsonwebtoken::Header;
    let claims = Claims { sub: "alice", exp: FAR_FUTURE };
    let hs256 = EncodingKey::from_secret(HS256_SECRET.as_bytes()).expect("a valid secret");
    let ed25519 = EncodingKey::from_ed_pem(ED25519_PRIVATE_PEM.as_bytes()).expect("a valid key");
    let token = |algorithm, key| jsonwebtoken::encode(&Header::new(algorithm), &claims, key).expect("a token");
    vec![
        ("service", format!("Bearer {SERVICE_TOKEN}")),
        ("viewer-hs256", format!("Bearer {}", token(Algorithm::HS256, &hs256))),
        ("viewer-eddsa", format!("bearer   {}", token(Algorithm::EdDSA, &ed25519))),
        ("two-entries", format!("Bearer {SERVICE_TOKEN}\nBearer {SERVICE_TOKEN}")),
    ]
}

/// A viewer token's claims: `sub` and an `exp` far ahead.
#[derive(serde::Serialize)]
struct Claims {
    sub: &'static str,
    exp: u64,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn corpus() -> std::path::PathBuf {
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz/corpus")
    }

    /// The seeds are what production accepts: requests that decode, batches
    /// whose items all succeed, a checkpoint that loads, stored values that
    /// read back, tokens that authenticate.
    #[test]
    fn fuzz_seeds_are_inputs_the_server_accepts() {
        let seeds = seeds();
        for seed in seeds.iter().filter(|seed| seed.target == "leases") {
            let batch = LeaseBatchFrame::decode(&seed.bytes[1..]).unwrap();
            let results = leases::apply(&context(), &batch, seed.bytes[0] & 1 == 1);
            let codes: Vec<u32> = results.results.iter().map(|result| result.code).collect();
            let expected = if seed.name.contains("shed") { tonic::Code::ResourceExhausted } else { tonic::Code::Ok };
            assert!(codes.iter().all(|&code| code == expected as u32), "{}: {results:?}", seed.name);
        }
        let checkpoint = seeds.iter().find(|seed| seed.target == "checkpoint").unwrap();
        let store = presence_core::checkpoint::decode(&checkpoint.bytes[5..]).unwrap();
        assert_eq!((store.users.len(), store.rooms.len()), (3, 1));
        for seed in seeds.iter().filter(|seed| seed.target == "stored_values") {
            stored_value(seed.bytes[0], &seed.bytes[1..]);
            let read = match seed.bytes[0] {
                0 => stored::visibility(seed.bytes[1]).is_some(),
                _ => durable::decode_status(&seed.bytes[1..]).is_some(),
            };
            assert!(read, "{}", seed.name);
        }
        for seed in seeds.iter().filter(|seed| seed.target == "credentials" && seed.bytes[0] == 0) {
            let mut metadata = MetadataMap::new();
            for line in seed.bytes[1..].split(|&byte| byte == b'\n') {
                metadata.append("authorization", MetadataValue::try_from(line).unwrap());
            }
            let caller = authenticator().caller(&metadata);
            match seed.name.as_str() {
                "seed-service" => assert!(matches!(caller, Ok(crate::auth::Caller::Service(_)))),
                "seed-two-entries" => assert!(caller.is_err()),
                _ => assert!(
                    matches!(caller, Ok(crate::auth::Caller::Viewer(ref viewer)) if viewer.id == "alice"),
                    "{}",
                    seed.name
                ),
            }
        }
        let hs256 = signed_token(br#"{"alg":"HS256"}"#, format!(r#"{{"sub":"bob","exp":{FAR_FUTURE}}}"#).as_bytes());
        let mut metadata = MetadataMap::new();
        metadata.insert("authorization", format!("Bearer {hs256}").parse().unwrap());
        assert!(
            matches!(authenticator().caller(&metadata), Ok(crate::auth::Caller::Viewer(ref viewer)) if viewer.id == "bob")
        );
    }

    /// Every RPC of the proto's `Presence` service is routed by the
    /// `requests` target (or, `Leases`, by its own): an RPC added to the
    /// proto and not to [`METHODS`] fails here instead of going unfuzzed.
    #[test]
    fn the_requests_target_routes_every_rpc_of_the_service() {
        let proto = include_str!("../../../proto/presence/v1/presence.proto");
        let service = &proto[proto.find("service Presence {").unwrap()..];
        let service = &service[..service.find("\n}").unwrap()];
        let rpcs: Vec<&str> = service
            .lines()
            .filter_map(|line| line.trim().strip_prefix("rpc "))
            .map(|rest| rest.split('(').next().unwrap().trim())
            .filter(|&name| name != "Leases")
            .collect();
        let mut routed = METHODS.to_vec();
        routed.sort_unstable();
        let mut declared = rpcs.clone();
        declared.sort_unstable();
        assert_eq!(routed, declared, "METHODS against the proto's rpcs");
    }

    /// The committed seeds are the ones [`seeds`] makes: `PRESENCED_BLESS=1`
    /// rewrites them (`scripts/fuzz seeds`), and this fails until it has, once
    /// a seed is added or renamed.
    #[test]
    fn fuzz_seeds_are_committed() {
        let seeds = seeds();
        if std::env::var_os("PRESENCED_BLESS").is_some() {
            for seed in &seeds {
                let dir = corpus().join(seed.target);
                std::fs::create_dir_all(&dir).unwrap();
                std::fs::write(dir.join(&seed.name), &seed.bytes).unwrap();
            }
        }
        for seed in &seeds {
            let path = corpus().join(seed.target).join(&seed.name);
            let committed = std::fs::read(&path).unwrap_or_else(|err| panic!("{}: {err}", path.display()));
            assert_eq!(committed, seed.bytes, "{} differs from its generator", path.display());
        }
    }
}
