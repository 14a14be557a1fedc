//! Golden-file tests of the checkpoint format (contract B3).
//!
//! The round-trip tests in `checkpoint.rs` pass whenever the writer and the
//! reader agree, even if both changed and every checkpoint already on disk no
//! longer loads. These tests pin the bytes instead:
//! - `tests/golden/checkpoint-v1.bin` was written by format 1's writer from the
//!   fixed store state built below, and must still decode to exactly the
//!   users, leases and stamps that state holds (today's reader reads
//!   yesterday's files);
//! - `tests/golden/checkpoint-v2.bin` was written by format 2's writer from
//!   the same state with room memberships and room access settings added, and
//!   must decode to exactly that, and today's writer must write that state to
//!   exactly the committed bytes (so any change of the format is a deliberate one).
//!
//! If the last check fails because you changed the format on purpose: bump
//! `FORMAT` in `src/checkpoint.rs`, keep a reader for every earlier format
//! (their files must still decode), add a golden file for the new format, and
//! only then regenerate with
//! `PRESENCED_BLESS=1 cargo test -p presence-core --test checkpoint_golden writes`
//! (that one test writes the newest file, after checking the state it writes).
//! Never re-bless an older golden file to make a failure go away.

use std::path::PathBuf;

use presence_core::checkpoint::{
    self, Checkpoint, CheckpointLease, CheckpointMembership, CheckpointRoom, CheckpointUser,
};
use presence_core::stamp::COUNTER_BITS;
use presence_core::{Changes, Registration, RoomAccess, RoomRef, Store, StoreConfig, Tick};

/// The first store's start, in store time (Unix ms).
const T0: Tick = 1_700_000_000_000;
/// The restart: the first store was checkpointed at `T0 + 10` and restored here.
const T1: Tick = T0 + 20_000;
/// The end of the restart grace.
const HOLD_UNTIL: Tick = T1 + 45_000;
/// When the golden checkpoint is written.
const WRITTEN_AT: Tick = T1 + 10;

fn golden_path(format: u32) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/golden/checkpoint-v{format}.bin"))
}

fn config() -> StoreConfig {
    StoreConfig { shards: 4, min_renew_interval_ms: 0, ..StoreConfig::default() }
}

/// The first stamp a shard issues at `at` (nothing issued later in that millisecond before it).
fn stamp(at: Tick) -> u64 {
    at << COUNTER_BITS
}

fn register(
    store: &Store,
    now: Tick,
    user_id: &str,
    session_id: &str,
    gateway_id: &str,
    ttl_ms: u32,
    metadata: &[(String, String)],
) -> u64 {
    let registration = Registration { user_id, session_id, gateway_id, ttl_ms, metadata };
    store.register(now, &registration, &mut Changes::default()).unwrap().generation
}

fn phone_metadata() -> Vec<(String, String)> {
    vec![("device".to_string(), "phone".to_string()), ("app".to_string(), "web/2.1".to_string())]
}

/// The fixed store state, every time at a fixed `now`:
/// - before a restart: `dave` registers a short lease, `bob` comes and goes;
/// - restarted at `T1`: `dave` is held online by a restart hold (his lease ran
///   out while the store was down and is expired away just after `T1`), `bob`
///   is offline;
/// - then `alice` registers two sessions (one with metadata) and `carol`
///   registers and unregisters with linger, so her lease is closing.
fn golden_store() -> Store {
    let first = Store::new(config(), T0).unwrap();
    register(&first, T0, "dave", "d1", "gw-a", 10_000, &[]);
    let bob = register(&first, T0 + 1, "bob", "b1", "gw-a", 45_000, &[]);
    first.unregister(T0 + 2, "bob", "b1", bob, 0, &mut Changes::default()).unwrap();
    let before = checkpoint::decode(&checkpoint::encode(&first, T0 + 10)).unwrap();

    let store = Store::restore(config(), T1, &before, HOLD_UNTIL).unwrap();
    // A restored lease that already ran out is due on the restored wheel's first tick.
    while store.expire(T1 + 1, 1_000, &mut Changes::default()) {}
    register(&store, T1 + 1, "alice", "phone", "gw-a", 45_000, &phone_metadata());
    register(&store, T1 + 2, "alice", "laptop", "gw-b", 30_000, &[]);
    let carol = register(&store, T1 + 3, "carol", "c1", "gw-b", 45_000, &[]);
    store.unregister(T1 + 4, "carol", "c1", carol, 5_000, &mut Changes::default()).unwrap();
    store
}

fn lobby_metadata() -> Vec<(String, String)> {
    vec![("role".to_string(), "host".to_string())]
}

/// The state of format 1's file, then in format 2:
/// - alice's phone joins `lobby` with metadata, then her laptop joins it with
///   none (she now shows the laptop's) and joins `doc-7`;
/// - `lobby` and `empty` are made public (`empty` has no member);
/// - her laptop signals `typing` in `doc-7`, which is never written.
fn golden_store_with_rooms() -> (Store, u64, u64) {
    let store = golden_store();
    let leases = store.leases(T1 + 5, "alice", &mut Changes::default()).unwrap();
    let generation = |session: &str| leases.iter().find(|lease| lease.session_id == session).unwrap().generation;
    let (phone, laptop) = (generation("phone"), generation("laptop"));
    let room = |session_id, generation, room_id| RoomRef { user_id: "alice", session_id, generation, room_id };
    store.join(T1 + 5, &room("phone", phone, "lobby"), &lobby_metadata(), &mut Changes::default()).unwrap();
    store.join(T1 + 6, &room("laptop", laptop, "lobby"), &[], &mut Changes::default()).unwrap();
    store.join(T1 + 6, &room("laptop", laptop, "doc-7"), &[], &mut Changes::default()).unwrap();
    store.set_room_access("lobby", RoomAccess::Public).unwrap();
    store.set_room_access("empty", RoomAccess::Public).unwrap();
    store.signal(T1 + 7, &room("laptop", laptop, "doc-7"), "typing", 5_000, &mut Changes::default()).unwrap();
    (store, phone, laptop)
}

/// What format 2's golden file holds: format 1's, with alice's memberships,
/// stamped by her shard's clock as she joined, and the public rooms.
fn expected_v2() -> Checkpoint {
    let mut checkpoint = expected();
    let membership = |room_id: &str, order, metadata| CheckpointMembership { room_id: room_id.into(), order, metadata };
    let alice = &mut checkpoint.users[0];
    // The laptop's memberships, most recently joined first.
    alice.leases[0].rooms =
        vec![membership("doc-7", stamp(T1 + 6) + 1, vec![]), membership("lobby", stamp(T1 + 6), vec![])];
    alice.leases[1].rooms = vec![membership("lobby", stamp(T1 + 5), lobby_metadata())];
    checkpoint.rooms = vec![
        CheckpointRoom { room_id: "empty".into(), access: RoomAccess::Public },
        CheckpointRoom { room_id: "lobby".into(), access: RoomAccess::Public },
    ];
    // The signal's room version, the last stamp of all.
    checkpoint.last_stamp = stamp(T1 + 7);
    checkpoint
}

/// What the golden file holds, field by field, users sorted by id (the file
/// holds them in shard order).
fn expected() -> Checkpoint {
    let lease = |session_id: &str, gateway_id: &str, generation, last_heartbeat_at, expires_at, closing, metadata| {
        CheckpointLease {
            session_id: session_id.into(),
            gateway_id: gateway_id.into(),
            generation,
            last_heartbeat_at,
            expires_at,
            closing,
            metadata,
            rooms: vec![],
        }
    };
    Checkpoint {
        written_at: WRITTEN_AT,
        // carol's ONLINE flip, the last stamp of all (her unregister with linger flips nothing).
        last_stamp: stamp(T1 + 3) + 1,
        users: vec![
            CheckpointUser {
                user_id: "alice".into(),
                // Her first register flipped her ONLINE; the second one did not.
                version: stamp(T1 + 1) + 1,
                online: true,
                // Newest first.
                leases: vec![
                    lease("laptop", "gw-b", stamp(T1 + 2), T1 + 2, T1 + 30_002, false, vec![]),
                    lease("phone", "gw-a", stamp(T1 + 1), T1 + 1, T1 + 45_001, false, phone_metadata()),
                ],
            },
            CheckpointUser {
                user_id: "bob".into(),
                // The OFFLINE flip of his unregister, kept across the restart.
                version: stamp(T0 + 2),
                online: false,
                leases: vec![],
            },
            CheckpointUser {
                user_id: "carol".into(),
                version: stamp(T1 + 3) + 1,
                online: true,
                // Lingering: closing, deadline cut to the unregister plus 5 s.
                leases: vec![lease("c1", "gw-b", stamp(T1 + 3), T1 + 3, T1 + 5_004, true, vec![])],
            },
            CheckpointUser {
                user_id: "dave".into(),
                // His ONLINE flip before the restart (his register's stamp was the generation).
                version: stamp(T0) + 1,
                online: true,
                // The restart hold: no session, no gateway, generation 0, closing,
                // from the restore until the end of the grace.
                leases: vec![lease("", "", 0, T1, HOLD_UNTIL, true, vec![])],
            },
        ],
        rooms: vec![],
    }
}

fn sorted(mut checkpoint: Checkpoint) -> Checkpoint {
    checkpoint.users.sort_by(|a, b| a.user_id.cmp(&b.user_id));
    checkpoint.rooms.sort_by(|a, b| a.room_id.cmp(&b.room_id));
    checkpoint
}

#[test]
fn b3_the_committed_format_1_checkpoint_decodes_to_what_it_holds() {
    let bytes = std::fs::read(golden_path(1)).expect("tests/golden/checkpoint-v1.bin is committed");
    let decoded = checkpoint::decode(&bytes).expect("format 1 checkpoints stay readable");
    assert_eq!(sorted(decoded), expected());
}

#[test]
fn b3_the_committed_format_2_checkpoint_decodes_to_what_it_holds() {
    let bytes = std::fs::read(golden_path(2)).expect("tests/golden/checkpoint-v2.bin is committed");
    let decoded = checkpoint::decode(&bytes).expect("format 2 checkpoints stay readable");
    assert_eq!(sorted(decoded), expected_v2());
}

#[test]
fn b3_todays_writer_writes_the_committed_format_2_bytes() {
    let bytes = checkpoint::encode(&golden_store_with_rooms().0, WRITTEN_AT);
    // The state itself is what the decoding test expects, so that a wrong
    // state cannot be blessed unnoticed.
    assert_eq!(sorted(checkpoint::decode(&bytes).unwrap()), expected_v2());
    if std::env::var_os("PRESENCED_BLESS").is_some_and(|v| v == "1") {
        std::fs::write(golden_path(2), &bytes).unwrap();
        return;
    }
    let committed = std::fs::read(golden_path(2)).expect("tests/golden/checkpoint-v2.bin is committed");
    assert!(
        bytes == committed,
        "the checkpoint writer no longer writes format 2's bytes (first difference at byte {:?}, {} bytes vs {} \
         committed). If the format changed on purpose, bump FORMAT, keep a reader for the earlier formats and add a \
         new golden file: see this file's documentation.",
        bytes.iter().zip(&committed).position(|(a, b)| a != b),
        bytes.len(),
        committed.len(),
    );
}

/// B3, R1, S3: a store restored from format 2's file has alice in both rooms,
/// showing the laptop's metadata in `lobby`, the rooms' access settings, room
/// versions above every one before, and no signal.
#[test]
fn b3_r1_s3_memberships_and_access_survive_a_restore_and_signals_do_not() {
    let (store, phone, laptop) = golden_store_with_rooms();
    let before = store.room("doc-7", 10).version.max(store.room("lobby", 10).version);
    let bytes = std::fs::read(golden_path(2)).expect("tests/golden/checkpoint-v2.bin is committed");
    let restored = Store::restore(config(), T1 + 10, &checkpoint::decode(&bytes).unwrap(), T1 + 10).unwrap();
    let lobby = restored.room("lobby", 10);
    assert_eq!((lobby.users, lobby.sessions, lobby.access), (1, 2, RoomAccess::Public));
    let members = lobby.members.unwrap();
    assert_eq!(members[0].user_id, "alice");
    assert!(members[0].metadata.is_empty(), "the laptop joined last: {members:?}");
    assert!(lobby.version > before, "room versions go on above the checkpointed ones");
    let doc = restored.room("doc-7", 10);
    assert_eq!((doc.users, doc.access, doc.signals.len()), (1, RoomAccess::Members, 0));
    assert_eq!(restored.room("empty", 10).access, RoomAccess::Public);
    assert_eq!(restored.rooms_of("alice"), ["doc-7", "lobby"]);
    // The phone leaves: alice still shows the laptop's metadata, one session fewer.
    let mut changes = Changes::default();
    let room = |session_id, generation| RoomRef { user_id: "alice", session_id, generation, room_id: "lobby" };
    let left = restored.leave(T1 + 11, &room("phone", phone), &mut changes).unwrap();
    assert!(left.removed && !left.changed);
    let left = restored.leave(T1 + 11, &room("laptop", laptop), &mut changes).unwrap();
    assert!(left.removed && left.changed);
    assert!(!restored.is_member("lobby", "alice"));
}
