//! Which of a cluster's fixed slots a user or a room falls in (C1).
//!
//! Pure, and here rather than in the cluster crate because every side needs
//! it: the server to check that it owns a request's slot, the clients to send
//! each user's items to its owner.

/// Which of `slots` slots `id` (a user id, or a room id) falls in:
/// 32-bit FNV-1a over the id's UTF-8 bytes (as received: a Leases frame's
/// id is hashed before it is checked to be UTF-8), modulo `slots`. Chosen because
/// every client can compute it in a few lines (the TypeScript client with
/// `Math.imul`); the tests pin it with fixed vectors that other
/// implementations must reproduce.
pub fn slot_of(id: impl AsRef<[u8]>, slots: u32) -> u32 {
    const OFFSET: u32 = 0x811c_9dc5;
    const PRIME: u32 = 0x0100_0193;
    let hash = id.as_ref().iter().copied().fold(OFFSET, |hash, byte| (hash ^ u32::from(byte)).wrapping_mul(PRIME));
    hash % slots.max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Fixed vectors: any other implementation of the slot function (the
    /// TypeScript client's) must give the same slots.
    #[test]
    fn slots_are_fnv1a_of_the_id_modulo_the_slot_count() {
        // Computed with an independent implementation (Python) of 32-bit FNV-1a.
        let vectors = [("", 453), ("a", 300), ("alice", 999), ("user-42", 939), ("ユーザー", 766), ("room:doc-7", 330)];
        for (id, slot) in vectors {
            assert_eq!(slot_of(id, 1024), slot, "{id:?}");
        }
        assert_eq!(slot_of("alice", u32::MAX), 0x8722_13e7, "the whole hash, below u32::MAX");
        assert_eq!(slot_of("alice", 1), 0);
        assert_eq!(slot_of("alice", 0), 0, "no slots is taken as one, not a division by zero");
    }

    #[test]
    fn slots_spread_evenly() {
        let mut counts = vec![0u32; 1024];
        for i in 0..1_024_000 {
            counts[slot_of(format!("user-{i}"), 1024) as usize] += 1;
        }
        let (min, max) = (counts.iter().min().unwrap(), counts.iter().max().unwrap());
        assert!(*min > 800 && *max < 1200, "slot loads between {min} and {max} for 1,000 ids per slot on average");
    }
}
