//! Gateway ids, stored once per shard.
//!
//! A shard holds hundreds of thousands of leases but only as many distinct
//! gateway ids as there are gateway processes, so each lease keeps a 4-byte
//! reference instead of its own copy of the id. Entries are reference counted
//! and freed with their last lease, so gateways that come and go with every
//! deploy do not accumulate.

use compact_str::CompactString;
use hashbrown::HashMap;

/// A reference to an interned gateway id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GatewayRef(u32);

/// Reference-counted gateway ids of one shard.
#[derive(Debug, Default)]
pub(crate) struct GatewayInterner {
    /// Slot per interned id: the id and how many leases refer to it; `None` when free.
    slots: Vec<Option<(CompactString, u32)>>,
    /// Free slots, reused before the vector grows.
    free: Vec<u32>,
    /// Slot of each interned id.
    by_id: HashMap<CompactString, u32>,
}

impl GatewayInterner {
    /// Takes a reference to `id`, interning it if it is new.
    pub(crate) fn acquire(&mut self, id: &str) -> GatewayRef {
        if let Some(&slot) = self.by_id.get(id) {
            let entry = self.slots[slot as usize].as_mut().expect("indexed slot is occupied");
            entry.1 += 1;
            return GatewayRef(slot);
        }
        let id = CompactString::from(id);
        let slot = match self.free.pop() {
            Some(slot) => {
                self.slots[slot as usize] = Some((id.clone(), 1));
                slot
            }
            None => {
                self.slots.push(Some((id.clone(), 1)));
                u32::try_from(self.slots.len() - 1).expect("fewer than 2^32 gateways")
            }
        };
        self.by_id.insert(id, slot);
        GatewayRef(slot)
    }

    /// Drops one reference, freeing the id with its last one.
    pub(crate) fn release(&mut self, gateway: GatewayRef) {
        let entry = self.slots[gateway.0 as usize].as_mut().expect("released gateway is interned");
        entry.1 -= 1;
        if entry.1 == 0 {
            let (id, _) = self.slots[gateway.0 as usize].take().expect("checked above");
            self.by_id.remove(&id);
            self.free.push(gateway.0);
        }
    }

    /// The id behind a reference.
    pub(crate) fn resolve(&self, gateway: GatewayRef) -> &str {
        &self.slots[gateway.0 as usize].as_ref().expect("resolved gateway is interned").0
    }

    /// Number of distinct ids held.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.by_id.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_shared_and_freed_with_their_last_reference() {
        let mut interner = GatewayInterner::default();
        let a1 = interner.acquire("gw-a");
        let a2 = interner.acquire("gw-a");
        let b = interner.acquire("gw-b");
        assert_eq!(a1, a2);
        assert_eq!(interner.resolve(b), "gw-b");
        assert_eq!(interner.len(), 2);
        interner.release(a1);
        assert_eq!(interner.resolve(a2), "gw-a");
        interner.release(a2);
        assert_eq!(interner.len(), 1);
        let c = interner.acquire("gw-c");
        assert_eq!(c, a1, "the freed slot is reused");
        assert_eq!(interner.resolve(c), "gw-c");
    }
}
