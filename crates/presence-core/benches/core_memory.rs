//! Resident memory of the lease core alone, per session: registers 1M and then
//! 3M sessions (2.5 per user, ids shaped like the seed's) and reports the
//! growth of this process's resident set. Run with
//! `cargo bench --bench core_memory`; the figures are in docs/benchmarks.md.
//! (The whole server's figure, measured over gRPC, comes from the load generator.)

use presence_core::{Store, StoreConfig};

#[path = "support/mod.rs"]
mod support;

use support::{START, register_sessions, resident_bytes};

fn main() {
    // `cargo bench` passes `--bench`; any other argument is a filter we do not need.
    let Some(before) = resident_bytes() else {
        eprintln!("core_memory: /proc/self/status is not readable here; nothing measured");
        return;
    };
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    let mut registered = 0usize;
    for target in [1_000_000usize, 3_000_000] {
        register_sessions(&store, registered..target);
        registered = target;
        let grown = resident_bytes().unwrap_or(before).saturating_sub(before);
        let stats = store.stats();
        println!(
            "core_memory: {} sessions of {} users: {:.1} MiB resident growth, {:.1} bytes per session",
            stats.sessions,
            stats.users,
            grown as f64 / (1024.0 * 1024.0),
            grown as f64 / stats.sessions as f64
        );
        // Where the resident bytes are, as malloc sees them: what the store
        // holds, and what malloc holds free (freed buffers of grown vectors).
        // SAFETY: mallinfo2 has no preconditions.
        let info = unsafe { libc::mallinfo2() };
        let mib = |bytes: usize| bytes as f64 / (1024.0 * 1024.0);
        println!(
            "  malloc: {:.1} MiB in use ({:.1} B per session), {:.1} MiB free in the heap, {:.1} MiB mapped on its own",
            mib(info.uordblks + info.hblkhd),
            (info.uordblks + info.hblkhd) as f64 / stats.sessions as f64,
            mib(info.fordblks),
            mib(info.hblkhd),
        );
    }
}
