//! The modelled population: user and session ids, and per-session state kept compactly.
//!
//! Users are `u<n>` and sessions `sess_<12 chars>`, as in the seed article. Session
//! number `k` (0-based) belongs to user `k % users`, so with 2.5 sessions per user every
//! user holds two or three sessions, and consecutive session numbers belong to different
//! users (which spreads a sequential sweep over every shard of the server).
//! Everything is a pure function of the numbers, so two runs with the same sizes produce
//! the same ids.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// The users and sessions a run models.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Population {
    /// Number of users.
    pub(crate) users: u64,
    /// Number of sessions across all users.
    pub(crate) sessions: u64,
}

impl Population {
    /// `users` users with `sessions_per_user` sessions each on average (at least one each).
    pub(crate) fn new(users: u64, sessions_per_user: f64) -> Population {
        let users = users.max(1);
        let sessions = ((users as f64) * sessions_per_user.max(1.0)).round() as u64;
        Population { users, sessions: sessions.max(users) }
    }

    /// `sessions` sessions spread over users with `sessions_per_user` each on average.
    pub(crate) fn from_sessions(sessions: u64, sessions_per_user: f64) -> Population {
        let sessions = sessions.max(1);
        let users = ((sessions as f64) / sessions_per_user.max(1.0)).round().max(1.0) as u64;
        Population { users, sessions }
    }

    /// The user (number) that holds session `k`.
    pub(crate) fn user_of(&self, session: u64) -> u64 {
        session % self.users
    }
}

/// The user id of user number `n`: `u<n>`.
pub(crate) fn user_id(n: u64) -> String {
    format!("u{n}")
}

/// Parses a user id made by [`user_id`] back into its number.
pub(crate) fn parse_user_id(id: &str) -> Option<u64> {
    id.strip_prefix('u')?.parse().ok()
}

/// The room id of room number `n`: `r<n>`.
pub(crate) fn room_id(n: u64) -> String {
    format!("r{n}")
}

const BASE36: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
const SESSION_CHARS: usize = 12;
const MASK62: u64 = (1 << 62) - 1;

/// A bijection of the 62-bit integers, so that distinct session numbers give distinct,
/// random-looking ids (xor-shifts and odd multipliers are each invertible mod 2^62).
fn permute62(k: u64) -> u64 {
    let mut x = k & MASK62;
    x ^= x >> 31;
    x = x.wrapping_mul(0x3c79_ac49_2ba7_b653) & MASK62;
    x ^= x >> 29;
    x = x.wrapping_mul(0x1c69_b3f7_4ac4_ae35) & MASK62;
    x ^= x >> 32;
    x
}

/// The session id of session number `k`: `sess_` and 12 base-36 characters
/// (36^12 > 2^62, so the encoding of the 62-bit permutation is injective).
pub(crate) fn session_id(k: u64) -> String {
    let mut x = permute62(k);
    let mut buf = [b'0'; SESSION_CHARS];
    for slot in buf.iter_mut().rev() {
        *slot = BASE36[(x % 36) as usize];
        x /= 36;
    }
    let mut id = String::with_capacity(5 + SESSION_CHARS);
    id.push_str("sess_");
    id.extend(buf.iter().map(|&b| b as char));
    id
}

/// The generation of every session, indexed by session number (0 = not registered).
#[derive(Debug)]
pub(crate) struct Generations(Vec<AtomicU64>);

impl Generations {
    /// Room for `n` sessions, none registered.
    pub(crate) fn new(n: u64) -> Generations {
        Generations((0..n).map(|_| AtomicU64::new(0)).collect())
    }

    /// The generation of session `k` (0 when it never registered).
    pub(crate) fn get(&self, k: u64) -> u64 {
        self.0.get(k as usize).map_or(0, |g| g.load(Ordering::Relaxed))
    }

    /// Stores the generation of session `k`.
    pub(crate) fn set(&self, k: u64, generation: u64) {
        if let Some(g) = self.0.get(k as usize) {
            g.store(generation, Ordering::Relaxed);
        }
    }
}

/// A signed 64-bit value per session or user (lease deadlines, flip times), 0 = unset.
#[derive(Debug)]
pub(crate) struct Slots(Vec<AtomicI64>);

impl Slots {
    /// `n` unset slots.
    pub(crate) fn new(n: u64) -> Slots {
        Slots((0..n).map(|_| AtomicI64::new(0)).collect())
    }

    /// The value in slot `k` (0 when unset or out of range).
    pub(crate) fn get(&self, k: u64) -> i64 {
        self.0.get(k as usize).map_or(0, |g| g.load(Ordering::Relaxed))
    }

    /// Sets slot `k`.
    pub(crate) fn set(&self, k: u64, value: i64) {
        if let Some(g) = self.0.get(k as usize) {
            g.store(value, Ordering::Relaxed);
        }
    }
}

/// A small deterministic generator (xorshift64*), so runs are repeatable.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed` (any value, 0 included).
    pub(crate) fn new(seed: u64) -> Rng {
        Rng(permute62(seed.wrapping_add(0x9e37_79b9)) | 1)
    }

    /// The next 64 random bits.
    pub(crate) fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A value in `0..n` (`n > 0`).
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }
}

/// `count` distinct numbers out of `0..population`, chosen by `rng` (all of them when
/// `count >= population`).
pub(crate) fn sample_distinct(rng: &mut Rng, population: u64, count: u64) -> Vec<u64> {
    if count >= population {
        return (0..population).collect();
    }
    let mut chosen = std::collections::HashSet::with_capacity(count as usize);
    let mut out = Vec::with_capacity(count as usize);
    while (out.len() as u64) < count {
        let n = rng.below(population);
        if chosen.insert(n) {
            out.push(n);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn user_ids_round_trip() {
        assert_eq!(user_id(0), "u0");
        assert_eq!(user_id(1_199_999), "u1199999");
        assert_eq!(parse_user_id("u42"), Some(42));
        assert_eq!(parse_user_id("x42"), None);
        assert_eq!(parse_user_id("u"), None);
    }

    #[test]
    fn session_ids_have_the_seed_shape() {
        for k in [0, 1, 2, 1_000_000, 2_999_999, u64::from(u32::MAX), MASK62] {
            let id = session_id(k);
            assert!(id.starts_with("sess_"), "{id}");
            assert_eq!(id.len(), 5 + 12, "{id}");
            assert!(id[5..].bytes().all(|b| b.is_ascii_digit() || b.is_ascii_lowercase()), "{id}");
        }
        assert_eq!(session_id(7), session_id(7), "deterministic");
    }

    #[test]
    fn session_ids_are_distinct() {
        let n = 300_000;
        let ids: HashSet<String> = (0..n).map(session_id).collect();
        assert_eq!(ids.len() as u64, n);
        // Near the top of the 62-bit range too.
        let top: HashSet<String> = (MASK62 - 10_000..=MASK62).map(session_id).collect();
        assert_eq!(top.len(), 10_001);
    }

    #[test]
    fn population_spreads_sessions_over_users() {
        let p = Population::new(1_200_000, 2.5);
        assert_eq!(p.sessions, 3_000_000);
        let mut per_user = vec![0u8; 1_200_000];
        for k in 0..p.sessions {
            per_user[p.user_of(k) as usize] += 1;
        }
        assert!(per_user.iter().all(|&c| c == 2 || c == 3));
        assert_eq!(Population::from_sessions(1_000_000, 2.5), Population { users: 400_000, sessions: 1_000_000 });
        assert_eq!(Population::new(10, 0.5).sessions, 10, "at least one session per user");
    }

    #[test]
    fn generations_and_slots_store_per_index() {
        let g = Generations::new(3);
        g.set(2, 99);
        assert_eq!((g.get(0), g.get(2), g.get(7)), (0, 99, 0));
        let s = Slots::new(2);
        s.set(1, -5);
        assert_eq!((s.get(1), s.get(2)), (-5, 0));
    }

    #[test]
    fn sampling_is_distinct_and_bounded() {
        let mut rng = Rng::new(1);
        let s = sample_distinct(&mut rng, 1000, 500);
        assert_eq!(s.iter().collect::<HashSet<_>>().len(), 500);
        assert!(s.iter().all(|&n| n < 1000));
        assert_eq!(sample_distinct(&mut rng, 5, 10), vec![0, 1, 2, 3, 4]);
    }
}
