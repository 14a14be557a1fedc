//! Values that many leases of a shard share, stored once per shard.
//!
//! A shard holds hundreds of thousands of leases but only as many distinct
//! gateway ids as there are gateway processes, and only a few distinct TTLs,
//! so each lease keeps a 4-byte reference to its *origin* (the gateway that
//! wrote it and how long before its deadline it was last written) instead of
//! a copy of the id and a time of its own: that is 4 bytes per lease instead
//! of 8, which takes a lease from 56 bytes to 48. An origin is the gateway
//! and the TTL of the last write for every lease but a lingering one (a
//! lingering lease's deadline was cut short, so its offset is whatever was
//! left), which holds an origin of its own for as long as it lingers.
//!
//! Entries are reference counted and freed with their last lease, so gateways
//! that come and go with every deploy, and the origins of lingering leases,
//! do not accumulate.

use std::borrow::Borrow;
use std::hash::Hash;

use compact_str::CompactString;
use hashbrown::HashMap;

/// Reference-counted values, each stored once, named by a slot number.
#[derive(Debug)]
struct Interner<K> {
    /// Slot per value: the value and how many references it has; `None` when free.
    slots: Vec<Option<(K, u32)>>,
    /// Free slots, reused before the vector grows.
    free: Vec<u32>,
    /// Slot of each value.
    by_value: HashMap<K, u32>,
}

impl<K> Default for Interner<K> {
    fn default() -> Self {
        Interner { slots: Vec::new(), free: Vec::new(), by_value: HashMap::new() }
    }
}

impl<K: Hash + Eq + Clone> Interner<K> {
    /// Takes a reference to `value`, interning it if it is new; says whether it was.
    fn acquire<Q>(&mut self, value: &Q) -> (u32, bool)
    where
        Q: Hash + Eq + ?Sized,
        K: Borrow<Q> + for<'q> From<&'q Q>,
    {
        if let Some(&slot) = self.by_value.get(value) {
            self.retain(slot);
            return (slot, false);
        }
        let value = K::from(value);
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some((value.clone(), 1));
                slot
            }
            None => {
                self.slots.push(Some((value.clone(), 1)));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 interned values")
            }
        };
        self.by_value.insert(value, slot);
        (slot, true)
    }

    /// Takes one more reference to an interned value.
    fn retain(&mut self, slot: u32) {
        self.slots[slot as usize].as_mut().expect("a retained value is interned").1 += 1;
    }

    /// Drops one reference; returns the value if that was its last one.
    fn release(&mut self, slot: u32) -> Option<K> {
        let entry = self.slots[slot as usize].as_mut().expect("a released value is interned");
        entry.1 -= 1;
        if entry.1 > 0 {
            return None;
        }
        let (value, _) = self.slots[slot as usize].take().expect("checked above");
        self.by_value.remove(&value);
        self.free.push(slot);
        Some(value)
    }

    /// The value at `slot`, if one is interned there.
    fn find_at(&self, slot: u32) -> Option<&K> {
        self.slots.get(slot as usize)?.as_ref().map(|(value, _)| value)
    }

    fn get(&self, slot: u32) -> &K {
        &self.slots[slot as usize].as_ref().expect("a resolved value is interned").0
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.by_value.len()
    }
}

/// A reference to an interned [`Origin`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct OriginRef(u32);

/// Who last wrote a lease and when, relative to its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Origin {
    /// The gateway's slot in [`Origins::gateways`].
    gateway: u32,
    /// `expires_at - last_heartbeat_at`: the TTL of the last write, or what
    /// was left of it when a linger cut it short.
    before_expiry: u32,
}

impl From<&Origin> for Origin {
    fn from(origin: &Origin) -> Self {
        *origin
    }
}

/// The origins of one shard's leases, and the gateway ids they name.
#[derive(Debug, Default)]
pub(crate) struct Origins {
    /// Each referenced once per origin that names it.
    gateways: Interner<CompactString>,
    origins: Interner<Origin>,
    /// The origin [`Origins::acquire`] handed out last, if it may still be
    /// interned: leases come in runs of one gateway and one TTL (a gateway's
    /// registrations, a checkpoint's records), so it is the likeliest next
    /// one, and finding it costs a comparison instead of two lookups.
    last: Option<u32>,
}

impl Origins {
    /// Takes a reference to the origin of a lease written by `gateway_id`
    /// `before_expiry` ms before its deadline.
    pub(crate) fn acquire(&mut self, gateway_id: &str, before_expiry: u32) -> OriginRef {
        if let Some(last) = self.last
            && let Some(origin) = self.origins.find_at(last)
            && origin.before_expiry == before_expiry
            && self.gateways.get(origin.gateway) == gateway_id
        {
            self.origins.retain(last);
            return OriginRef(last);
        }
        let (gateway, _) = self.gateways.acquire(gateway_id);
        let (origin, created) = self.origins.acquire(&Origin { gateway, before_expiry });
        if !created {
            // The origin holds its gateway already.
            self.gateways.release(gateway);
        }
        self.last = Some(origin);
        OriginRef(origin)
    }

    /// The origin with `origin`'s gateway and `before_expiry`: a new reference
    /// in place of `origin`'s (which is released), or `origin` itself when it
    /// says that already, which is what a renewal at an unchanged TTL finds.
    pub(crate) fn with_before_expiry(&mut self, origin: OriginRef, before_expiry: u32) -> OriginRef {
        let current = *self.origins.get(origin.0);
        if current.before_expiry == before_expiry {
            return origin;
        }
        let (moved, created) = self.origins.acquire(&Origin { before_expiry, ..current });
        if created {
            self.gateways.retain(current.gateway);
        }
        self.release(origin);
        OriginRef(moved)
    }

    /// Drops one reference, freeing the origin, and then its gateway id, with their last ones.
    pub(crate) fn release(&mut self, origin: OriginRef) {
        if let Some(freed) = self.origins.release(origin.0) {
            self.gateways.release(freed.gateway);
        }
    }

    /// The gateway id of an origin.
    pub(crate) fn gateway_id(&self, origin: OriginRef) -> &str {
        self.gateways.get(self.origins.get(origin.0).gateway)
    }

    /// How long before its deadline a lease of this origin was last written.
    pub(crate) fn before_expiry(&self, origin: OriginRef) -> u32 {
        self.origins.get(origin.0).before_expiry
    }

    /// Distinct gateway ids and origins held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> (usize, usize) {
        (self.gateways.len(), self.origins.len())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn origins_and_their_gateway_ids_are_shared_and_freed_with_their_last_reference() {
        let mut origins = Origins::default();
        let a1 = origins.acquire("gw-a", 45_000);
        let a2 = origins.acquire("gw-a", 45_000);
        let b = origins.acquire("gw-b", 45_000);
        let a_short = origins.acquire("gw-a", 30_000);
        assert_eq!(a1, a2);
        assert_ne!(a1, a_short);
        assert_eq!((origins.gateway_id(b), origins.before_expiry(b)), ("gw-b", 45_000));
        assert_eq!((origins.gateway_id(a_short), origins.before_expiry(a_short)), ("gw-a", 30_000));
        assert_eq!(origins.len(), (2, 3), "gw-a is stored once for its two origins");
        origins.release(a1);
        assert_eq!(origins.gateway_id(a2), "gw-a");
        origins.release(a2);
        assert_eq!(origins.len(), (2, 2), "gw-a stays while an origin names it");
        origins.release(a_short);
        assert_eq!(origins.len(), (1, 1), "and goes with the last");
        let c = origins.acquire("gw-c", 1_000);
        assert!([a1, a_short].contains(&c), "a freed slot is reused");
        assert_eq!((origins.gateway_id(c), origins.before_expiry(c)), ("gw-c", 1_000));
    }

    #[test]
    fn the_last_origin_is_found_again_only_while_it_still_is_that_origin() {
        let mut origins = Origins::default();
        let a = origins.acquire("gw-a", 45_000);
        assert_eq!(origins.acquire("gw-a", 45_000), a, "the last one, again");
        origins.release(a);
        origins.release(a);
        // Its slot is freed, then taken by another gateway's origin.
        let b = origins.acquire("gw-b", 45_000);
        assert_eq!(b, a, "the freed slot is reused");
        let again = origins.acquire("gw-a", 45_000);
        assert_ne!(again, b, "a slot that holds another origin now is not the last one any more");
        assert_eq!((origins.gateway_id(again), origins.before_expiry(again)), ("gw-a", 45_000));
        assert_eq!((origins.gateway_id(b), origins.before_expiry(b)), ("gw-b", 45_000));
        assert_eq!(origins.acquire("gw-a", 30_000), OriginRef(2), "another TTL is another origin");
    }

    #[test]
    fn a_lease_written_again_at_another_offset_moves_to_that_origin_and_keeps_its_gateway() {
        let mut origins = Origins::default();
        let renewed = origins.acquire("gw-a", 45_000);
        let other = origins.acquire("gw-a", 45_000);
        assert_eq!(origins.with_before_expiry(renewed, 45_000), renewed, "the same TTL: no change");
        let lingering = origins.with_before_expiry(renewed, 4_321);
        assert_eq!((origins.gateway_id(lingering), origins.before_expiry(lingering)), ("gw-a", 4_321));
        assert_eq!(origins.before_expiry(other), 45_000, "the other lease's origin is untouched");
        origins.release(other);
        assert_eq!(origins.len(), (1, 1), "the old origin went with its last lease, the gateway stayed");
        origins.release(lingering);
        assert_eq!(origins.len(), (0, 0));
    }
}
