//! Resident memory of the lease core alone, per session: registers 1M and then
//! 3M sessions (2.5 per user, ids shaped like the seed's) and reports the
//! growth of this process's resident set. Run with
//! `cargo bench --bench core_memory`; the figures are in docs/benchmarks.md.
//! (The whole server's figure, measured over gRPC, comes from the load generator.)

use presence_core::{Registration, Store, StoreConfig, Tick};

const START: Tick = 1_700_000_000_000;

/// This process's resident set, from /proc (Linux).
fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

fn main() {
    // `cargo bench` passes `--bench`; any other argument is a filter we do not need.
    let Some(before) = resident_bytes() else {
        eprintln!("core_memory: /proc/self/status is not readable here; nothing measured");
        return;
    };
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    let mut changes = Vec::new();
    let mut registered = 0usize;
    for target in [1_000_000usize, 3_000_000] {
        // Sessions 0, 1 (and every fifth one more) share a user: 2.5 sessions per user.
        while registered < target {
            let user_id = format!("u{}", registered * 2 / 5);
            let session_id = format!("sess_{registered:012}");
            let registration = Registration {
                user_id: &user_id,
                session_id: &session_id,
                gateway_id: "gw-07",
                ttl_ms: 45_000,
                metadata: &[],
            };
            store.register(START, &registration, &mut changes).expect("valid registration");
            changes.clear();
            registered += 1;
        }
        let grown = resident_bytes().unwrap_or(before).saturating_sub(before);
        let stats = store.stats();
        println!(
            "core_memory: {} sessions of {} users: {:.1} MiB resident growth, {:.1} bytes per session",
            stats.sessions,
            stats.users,
            grown as f64 / (1024.0 * 1024.0),
            grown as f64 / stats.sessions as f64
        );
    }
}
