//! Does the memory of forgotten users come back to the operating system (B6)?
//!
//! Whole-process RSS, read from `/proc/self/statm` (this is a bench, not the
//! core: it may read /proc), around a wave of users that come and go:
//!
//! 1. A store with the default shape (64 shards, 10-minute forget window) is
//!    warmed with `BASE` users that stay online throughout, so that the
//!    baseline is a store in use, not an empty heap: RSS `start`.
//! 2. `USERS` distinct users each register one session and unregister it, in
//!    simulated time over five minutes, the expiry driver running along as the
//!    server's would: all of them are held at once, offline, at the peak.
//! 3. Simulated time moves past their forget window and `expire` is driven
//!    until nothing is due: RSS `end (kept by malloc)`. Then `malloc_trim(0)`,
//!    as the server's expiry driver calls it after a large forget: RSS `end`.
//!
//! The store gives all its memory back to the allocator (its containers shrink
//! to what they hold), but glibc's malloc keeps most freed heap pages mapped
//! until it is asked to trim, hence the two figures. The bench fails (exits 1)
//! if `end` is more than 10% above `start`.
//!
//! ```text
//! cargo bench -p presence-core --bench forget_memory
//! FORGET_MEMORY_USERS=1000000 cargo bench -p presence-core --bench forget_memory   # a quicker run
//! FORGET_MEMORY_TRIM=0 cargo bench -p presence-core --bench forget_memory          # judge without malloc_trim
//! ```

use std::time::Instant;

use presence_core::{Changes, Registration, Store, StoreConfig, Tick};

/// Users online throughout: about what a small deployment holds at any time.
const BASE: usize = 100_000;
/// Users passing through, by default.
const USERS: usize = 10_000_000;
/// The simulated time over which they pass.
const PASSING_MS: Tick = 5 * 60_000;
/// The expiry driver's batch, as the server's default.
const EXPIRY_BATCH: usize = 1_024;
const T0: Tick = 1_700_000_000_000;
const ALLOWED_GROWTH: f64 = 1.10;

fn rss_bytes() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").expect("/proc/self/statm (Linux only)");
    let resident: u64 =
        statm.split_whitespace().nth(1).and_then(|pages| pages.parse().ok()).expect("statm's second field");
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    resident * u64::try_from(page).expect("a positive page size")
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1024.0 * 1024.0)
}

fn drain(store: &Store, now: Tick) {
    let mut changes = Changes::default();
    while store.expire(now, EXPIRY_BATCH, &mut changes) {
        changes.users.clear();
    }
}

fn main() {
    // `cargo bench` passes `--bench`; this bench takes no arguments of its own.
    let users: usize = std::env::var("FORGET_MEMORY_USERS").ok().and_then(|v| v.parse().ok()).unwrap_or(USERS);
    let trim = std::env::var_os("FORGET_MEMORY_TRIM").is_none_or(|v| v != "0");
    let config = StoreConfig::default();
    let forget_after = config.forget_offline_after_ms;
    let max_ttl = config.max_ttl_ms;
    let store = Store::new(config, T0).expect("the default configuration is valid");
    let mut changes = Changes::default();
    let mut id = String::new();
    let mut user_id = |prefix: &str, i: usize| {
        use std::fmt::Write;
        id.clear();
        write!(id, "{prefix}-{i:08}").expect("writing to a String");
        id.clone()
    };

    // 1. The base: online for longer than the whole run (an hour's TTL).
    for i in 0..BASE {
        let user = user_id("base", i);
        let registration =
            Registration { user_id: &user, session_id: "tab-1", gateway_id: "gw-1", ttl_ms: max_ttl, metadata: &[] };
        store.register(T0, &registration, &mut changes).expect("register");
    }
    changes.users.clear();
    drain(&store, T0);
    let start = rss_bytes();

    // 2. The wave.
    let began = Instant::now();
    let per_ms = (users as u64 / PASSING_MS).max(1);
    let mut now = T0;
    for i in 0..users {
        if (i as u64).is_multiple_of(per_ms) {
            now += 1;
            if now.is_multiple_of(1_000) {
                drain(&store, now);
            }
        }
        let user = user_id("user", i);
        let registration =
            Registration { user_id: &user, session_id: "tab-1", gateway_id: "gw-1", ttl_ms: 0, metadata: &[] };
        let registered = store.register(now, &registration, &mut changes).expect("register");
        store.unregister(now, &user, "tab-1", registered.generation, 0, &mut changes).expect("unregister");
        changes.users.clear();
    }
    let passed = began.elapsed();
    let peak_users = store.stats().users;
    let peak = rss_bytes();

    // 3. Past the window: the driver forgets them.
    let began = Instant::now();
    let after = now + forget_after + 1;
    drain(&store, after);
    let forgot = began.elapsed();
    let stats = store.stats();
    assert_eq!(stats.users, BASE, "every passing user is forgotten, every base user kept");
    assert_eq!(stats.online_users, BASE);
    let kept = rss_bytes();
    let began = Instant::now();
    if trim {
        // What the server's expiry driver does after a large forget.
        // SAFETY: malloc_trim has no preconditions.
        unsafe { libc::malloc_trim(0) };
    }
    let trimmed = began.elapsed();
    let end = rss_bytes();

    let ratio = end as f64 / start as f64;
    println!("forget_memory: {BASE} base users online, {users} users passing, forget window {forget_after} ms");
    println!("  passing took {passed:.2?} ({peak_users} users held at the peak); forgetting took {forgot:.2?}");
    println!(
        "  RSS start {:.1} MiB, peak {:.1} MiB, end (kept by malloc) {:.1} MiB, end {:.1} MiB ({})",
        mib(start),
        mib(peak),
        mib(kept),
        mib(end),
        if trim { format!("after malloc_trim, {trimmed:.2?}") } else { "no malloc_trim".to_string() },
    );
    println!("  end / start = {ratio:.3} (allowed: {ALLOWED_GROWTH:.2})");
    drop(store);
    if ratio > ALLOWED_GROWTH {
        eprintln!("forget_memory: FAILED: RSS after forgetting is {:.1}% above the start", (ratio - 1.0) * 100.0);
        std::process::exit(1);
    }
}
