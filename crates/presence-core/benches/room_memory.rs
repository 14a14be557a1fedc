//! Resident memory of room memberships in the core alone (R5): 1M users
//! online with one session each, then 20,000 rooms of 50 members each (one
//! membership per session, no metadata), and the growth of this process's
//! resident set per membership. The users are registered first, so the
//! figure is what the memberships add. Run with
//! `cargo bench -p presence-core --bench room_memory`.

use presence_core::{Changes, Registration, RoomRef, Store, StoreConfig};

#[path = "support/mod.rs"]
#[expect(dead_code, reason = "this bench registers users of its own shape, one session each")]
mod support;

use support::{START, resident_bytes};

const ROOMS: usize = 20_000;
const MEMBERS: usize = 50;

fn main() {
    let Some(start) = resident_bytes() else {
        eprintln!("room_memory: /proc/self/status is not readable here; nothing measured");
        return;
    };
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    let mut changes = Changes::default();
    let mut generations = Vec::with_capacity(ROOMS * MEMBERS);
    for user in 0..ROOMS * MEMBERS {
        let user_id = format!("u{user}");
        let registration =
            Registration { user_id: &user_id, session_id: "sess", gateway_id: "gw-07", ttl_ms: 45_000, metadata: &[] };
        generations.push(store.register(START, &registration, &mut changes).expect("valid").generation);
        changes.users.clear();
    }
    let before = resident_bytes().unwrap_or(start);
    println!("room_memory: {} users online: {:.1} MiB resident", ROOMS * MEMBERS, mib(before - start));
    for (user, &generation) in generations.iter().enumerate() {
        let user_id = format!("u{user}");
        let room_id = format!("room-{:05}", user / MEMBERS);
        let room = RoomRef { user_id: &user_id, session_id: "sess", generation, room_id: &room_id };
        store.join(START + 1, &room, &[], &mut changes).expect("valid join");
        changes.rooms.clear();
    }
    let after = resident_bytes().unwrap_or(before);
    let memberships = ROOMS * MEMBERS;
    println!(
        "room_memory: {memberships} memberships in {ROOMS} rooms: {:.1} MiB resident growth, {:.1} bytes per membership",
        mib(after.saturating_sub(before)),
        after.saturating_sub(before) as f64 / memberships as f64
    );
    assert_eq!(store.room("room-00007", MEMBERS).users as usize, MEMBERS);
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}
