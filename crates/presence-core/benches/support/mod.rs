//! What the core benchmarks share: the seed-shaped population and the
//! process's resident memory. Included with `#[path]`; not a bench itself.

use presence_core::{Changes, Registration, Store, Tick};

/// The store time every benchmark registers at.
pub(crate) const START: Tick = 1_700_000_000_000;

/// Registers sessions `range` into `store`: ids like `sess_` plus 12 digits,
/// 2.5 sessions per user (sessions 0 and 1, and every fifth one more, share a user).
pub(crate) fn register_sessions(store: &Store, range: std::ops::Range<usize>) {
    let mut changes = Changes::default();
    for session in range {
        let user_id = format!("u{}", session * 2 / 5);
        let session_id = format!("sess_{session:012}");
        let registration = Registration {
            user_id: &user_id,
            session_id: &session_id,
            gateway_id: "gw-07",
            ttl_ms: 45_000,
            metadata: &[],
        };
        store.register(START, &registration, &mut changes).expect("valid registration");
        changes.users.clear();
    }
}

/// This process's resident set in bytes, from /proc (Linux); `None` elsewhere.
pub(crate) fn resident_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
