//! What attention costs (A1, A3, A4): the memory of every session's
//! attention at 3M sessions, and NotifyTargets' users answered per second
//! in batches of 1,000, on the core alone. Run with
//! `cargo bench --bench attention`; the figures are in docs/benchmarks.md.

use std::time::Instant;

use presence_core::attention::{Attention, AttentionChange, DeviceKind, NotifyPolicy, Urgency};
use presence_core::{Changes, Store, StoreConfig};

#[path = "support/mod.rs"]
mod support;

use support::{START, register_sessions, resident_bytes};

const SESSIONS: usize = 3_000_000;
const BATCH: usize = 1_000;

fn main() {
    let Some(before) = resident_bytes() else {
        eprintln!("attention: /proc/self/status is not readable here; nothing measured");
        return;
    };
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    register_sessions(&store, 0..SESSIONS);
    let stats = store.stats();
    // Made before the first measurement, so that its 1.2M strings are in both.
    let users: Vec<String> = (0..stats.users).map(|user| format!("u{user}")).collect();
    let plain = resident_bytes().unwrap_or(before).saturating_sub(before);
    let plain_in_use = malloc_in_use();

    // Every session says what its human does, as a gateway would on its next renewal.
    let mut changes = Changes::default();
    let desk = AttentionChange {
        attention: Some(Attention::Active),
        device: Some(DeviceKind::Desktop),
        focused_room_id: Some("room-0001"),
    };
    let phone = AttentionChange {
        attention: Some(Attention::Background),
        device: Some(DeviceKind::Mobile),
        focused_room_id: None,
    };
    let started = Instant::now();
    let mut set = 0usize;
    for user in &users {
        for (index, session) in store.sessions(START, user).expect("a valid id").iter().enumerate() {
            let lease = (user.as_str(), session.lease.session_id.as_str(), session.lease.generation);
            let change = if index == 0 { &desk } else { &phone };
            store.set_attention(START, lease, change, &mut changes).expect("a live lease");
            set += 1;
        }
        changes.users.clear();
    }
    let setting = started.elapsed();
    let with = resident_bytes().unwrap_or(before).saturating_sub(before);
    let with_in_use = malloc_in_use();
    let per_session = |bytes: f64| bytes / stats.sessions as f64;
    println!(
        "attention: {} sessions of {} users; {set} changes applied in {:.2} s ({:.0} ns each, with the lookup of each user's sessions)",
        stats.sessions,
        stats.users,
        setting.as_secs_f64(),
        setting.as_nanos() as f64 / set as f64,
    );
    // The resident set also keeps what the lookups allocated and freed; what
    // the store holds is malloc's bytes in use.
    println!(
        "  malloc in use: {:.1} B per session before, {:.1} B with every session's attention ({:+.1} B)",
        per_session(plain_in_use as f64),
        per_session(with_in_use as f64),
        per_session(with_in_use as f64 - plain_in_use as f64),
    );
    println!(
        "  resident growth: {:.1} B per session before, {:.1} B after ({:+.1} B)",
        per_session(plain as f64),
        per_session(with as f64),
        per_session(with as f64 - plain as f64),
    );

    // NotifyTargets: batches of 1,000 users, about a room, at the store's pace.
    let policy = NotifyPolicy::default();
    for (what, room) in [("no room", None), ("about a room", Some("room-0001"))] {
        let rounds = 2_000;
        let started = Instant::now();
        let mut answered = 0usize;
        for round in 0..rounds {
            let from = (round * BATCH) % (users.len() - BATCH);
            let batch = &users[from..from + BATCH];
            let decisions = store.notify_targets(START + 5_000, batch, room, Urgency::Normal, &policy).expect("valid");
            answered += std::hint::black_box(decisions).len();
        }
        let elapsed = started.elapsed();
        println!(
            "notify_targets ({what}): {answered} users in batches of {BATCH} in {:.2} s: {:.0} users/s ({:.0} us per batch)",
            elapsed.as_secs_f64(),
            answered as f64 / elapsed.as_secs_f64(),
            elapsed.as_micros() as f64 / rounds as f64,
        );
    }
}

/// Bytes malloc has handed out and not had back.
fn malloc_in_use() -> usize {
    // SAFETY: mallinfo2 has no preconditions.
    let info = unsafe { libc::mallinfo2() };
    info.uordblks + info.hblkhd
}
