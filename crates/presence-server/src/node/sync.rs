//! The hub's concurrent building blocks: the store's locks and atomics
//! (`presence_core::sync`), `DashMap` and tokio's `Notify`, or, with the
//! feature `shuttle`, stand-ins built on shuttle's, so that the concurrency
//! checker (`tests/interleavings.rs`) runs the real hub, subscriptions and
//! publish path while it chooses the order of their threads.
//!
//! A real `DashMap` cannot stay under the checker: its shard locks block the
//! one OS thread shuttle runs every test thread on, and the hub holds a
//! topic's read guard while it posts into mailboxes, where shuttle switches.
//! The stand-ins keep the semantics the hub relies on and nothing more: one
//! lock for the whole map (a `DashMap` holds one per shard; a coarser lock
//! only orders more), and a `Notify` whose `notify_one` with no waiter keeps
//! one permit for the next `notified`, as tokio's does.

pub(crate) use presence_core::sync::{AtomicU64, Mutex, Ordering, RwLock};

#[cfg(not(feature = "shuttle"))]
pub(crate) use dashmap::{DashMap, Entry};
#[cfg(not(feature = "shuttle"))]
pub(crate) use tokio::sync::Notify;

#[cfg(feature = "shuttle")]
pub(crate) use checked::{DashMap, Entry, Notify};

#[cfg(feature = "shuttle")]
mod checked {
    use std::collections::HashMap;
    use std::fmt;
    use std::hash::Hash;
    use std::ops::{Deref, DerefMut};

    use presence_core::sync::{Mutex, RwLock};
    use shuttle::sync::{Condvar, RwLockReadGuard, RwLockWriteGuard};

    /// A map behind one shuttle lock, with the part of `DashMap`'s API the hub uses.
    pub(crate) struct DashMap<K, V>(RwLock<HashMap<K, V>>);

    impl<K, V> Default for DashMap<K, V> {
        fn default() -> Self {
            DashMap(RwLock::new(HashMap::new()))
        }
    }

    impl<K, V> fmt::Debug for DashMap<K, V> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_struct("DashMap").finish_non_exhaustive()
        }
    }

    impl<K: Hash + Eq + Clone, V> DashMap<K, V> {
        pub(crate) fn get(&self, key: &K) -> Option<Ref<'_, K, V>> {
            let map = self.0.read();
            map.contains_key(key).then(|| Ref { map, key: key.clone() })
        }

        pub(crate) fn entry(&self, key: K) -> Entry<'_, K, V> {
            let map = self.0.write();
            if map.contains_key(&key) {
                Entry::Occupied(OccupiedEntry { map, key })
            } else {
                Entry::Vacant(VacantEntry { map, key })
            }
        }

        #[cfg_attr(not(test), allow(dead_code))]
        pub(crate) fn len(&self) -> usize {
            self.0.read().len()
        }

        #[cfg_attr(not(test), allow(dead_code))]
        pub(crate) fn is_empty(&self) -> bool {
            self.0.read().is_empty()
        }
    }

    /// A value read under the map's shared lock.
    pub(crate) struct Ref<'a, K, V> {
        map: RwLockReadGuard<'a, HashMap<K, V>>,
        key: K,
    }

    impl<K: Hash + Eq, V> Ref<'_, K, V> {
        pub(crate) fn value(&self) -> &V {
            &self.map[&self.key]
        }
    }

    impl<K: Hash + Eq, V> Deref for Ref<'_, K, V> {
        type Target = V;
        fn deref(&self) -> &V {
            self.value()
        }
    }

    /// A value under the map's exclusive lock.
    pub(crate) struct RefMut<'a, K, V> {
        map: RwLockWriteGuard<'a, HashMap<K, V>>,
        key: K,
    }

    impl<K: Hash + Eq, V> Deref for RefMut<'_, K, V> {
        type Target = V;
        fn deref(&self) -> &V {
            &self.map[&self.key]
        }
    }

    impl<K: Hash + Eq, V> DerefMut for RefMut<'_, K, V> {
        fn deref_mut(&mut self) -> &mut V {
            self.map.get_mut(&self.key).expect("an entry's key stays in its map")
        }
    }

    pub(crate) enum Entry<'a, K, V> {
        Occupied(OccupiedEntry<'a, K, V>),
        Vacant(VacantEntry<'a, K, V>),
    }

    impl<'a, K: Hash + Eq + Clone, V: Default> Entry<'a, K, V> {
        pub(crate) fn or_default(self) -> RefMut<'a, K, V> {
            match self {
                Entry::Occupied(OccupiedEntry { map, key }) => RefMut { map, key },
                Entry::Vacant(VacantEntry { mut map, key }) => {
                    map.insert(key.clone(), V::default());
                    RefMut { map, key }
                }
            }
        }
    }

    pub(crate) struct OccupiedEntry<'a, K, V> {
        map: RwLockWriteGuard<'a, HashMap<K, V>>,
        key: K,
    }

    impl<K: Hash + Eq, V> OccupiedEntry<'_, K, V> {
        pub(crate) fn get(&self) -> &V {
            &self.map[&self.key]
        }

        pub(crate) fn get_mut(&mut self) -> &mut V {
            self.map.get_mut(&self.key).expect("an entry's key stays in its map")
        }

        pub(crate) fn remove(mut self) -> V {
            self.map.remove(&self.key).expect("an entry's key stays in its map")
        }
    }

    pub(crate) struct VacantEntry<'a, K, V> {
        map: RwLockWriteGuard<'a, HashMap<K, V>>,
        key: K,
    }

    /// tokio's `Notify` as the hub uses it: one waiter, and a permit kept
    /// for it when it is not waiting.
    #[derive(Debug, Default)]
    pub(crate) struct Notify {
        permit: Mutex<bool>,
        woken: Condvar,
    }

    impl Notify {
        pub(crate) fn new() -> Self {
            Notify::default()
        }

        pub(crate) fn notify_one(&self) {
            *self.permit.lock() = true;
            self.woken.notify_one();
        }

        /// Completes when a permit is there, taking it. It blocks the test
        /// thread rather than yielding to an executor: shuttle switches to
        /// the other threads meanwhile, and reports a deadlock if none will
        /// ever notify.
        pub(crate) async fn notified(&self) {
            let mut permit = self.permit.lock();
            while !*permit {
                permit = self.woken.wait(permit).unwrap_or_else(std::sync::PoisonError::into_inner);
            }
            *permit = false;
        }
    }
}
