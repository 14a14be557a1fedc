//! Per-user settings (contract B4): small named values that must survive a
//! crash once acknowledged. Later features (visibility, audiences, status)
//! keep their data here.
//!
//! With a data directory they go to the durable store, synced before the
//! write is acknowledged; without one the service is purely in memory, as
//! documented, and settings live as long as the process. In a cluster they
//! go with their user's slot (`user_data.rs`).

use std::sync::Arc;

use hashbrown::{HashMap, HashSet};
use parking_lot::Mutex;
use presence_core::{CompactString, SlotSet};

use crate::node::storage::durable::{DurableError, DurableStore, Named, run_blocking};

/// Longest setting name, in bytes.
pub const MAX_SETTING_NAME_BYTES: usize = 64;
/// Largest setting value, in bytes.
pub const MAX_SETTING_VALUE_BYTES: usize = 4_096;
/// Most settings one user may have: with the two limits above, about 1 MiB
/// at most, so that a user's data always fits a handover's piece (C3).
pub const MAX_SETTINGS_PER_USER: usize = 256;

/// Where settings live.
#[derive(Debug)]
enum Kept {
    /// Purely in memory (no data directory).
    Memory(Mutex<HashMap<String, HashMap<String, Vec<u8>>>>),
    /// On disk, synced before acknowledgement.
    Durable(Arc<DurableStore>),
}

/// Every user's settings.
#[derive(Debug)]
pub(crate) struct Settings {
    kept: Kept,
    /// Users whose settings changed since a follower was last sent them
    /// (C4); `None` unless tracked.
    changed: Mutex<Option<HashSet<CompactString>>>,
}

impl Settings {
    /// Settings on `durable`, or in memory without one.
    pub(crate) fn new(durable: Option<Arc<DurableStore>>) -> Self {
        let kept = match durable {
            Some(durable) => Kept::Durable(durable),
            None => Kept::Memory(Mutex::default()),
        };
        Settings { kept, changed: Mutex::default() }
    }

    /// Writes one setting; false (nothing written) for a new name of a user
    /// that has [`MAX_SETTINGS_PER_USER`] already.
    pub(crate) async fn put(&self, user_id: String, name: String, value: Vec<u8>) -> Result<bool, DurableError> {
        let user = CompactString::from(user_id.as_str());
        let written = match &self.kept {
            Kept::Memory(map) => {
                let mut map = map.lock();
                let named = map.entry(user_id).or_default();
                let room = named.contains_key(&name) || named.len() < MAX_SETTINGS_PER_USER;
                if room {
                    named.insert(name, value);
                }
                room
            }
            Kept::Durable(store) => {
                let store = Arc::clone(store);
                run_blocking(move || store.put_setting(&user_id, &name, &value, MAX_SETTINGS_PER_USER)).await?
            }
        };
        if let (true, Some(changed)) = (written, self.changed.lock().as_mut()) {
            changed.insert(user);
        }
        Ok(written)
    }

    pub(crate) async fn get(&self, user_id: String) -> Result<Named, DurableError> {
        Ok(self.get_many(vec![user_id]).await?.pop().unwrap_or_default())
    }

    /// The settings of each of `user_ids`, in order; from disk in one read.
    pub(crate) async fn get_many(&self, user_ids: Vec<String>) -> Result<Vec<Named>, DurableError> {
        match &self.kept {
            Kept::Memory(map) => {
                let map = map.lock();
                Ok(user_ids
                    .iter()
                    .map(|user_id| {
                        let mut settings: Named =
                            map.get(user_id).map(|named| named.clone().into_iter().collect()).unwrap_or_default();
                        settings.sort();
                        settings
                    })
                    .collect())
            }
            Kept::Durable(store) => {
                let store = Arc::clone(store);
                run_blocking(move || store.settings_of(&user_ids)).await
            }
        }
    }

    /// Starts noting whose settings change, for [`Settings::take_changed`] (C4).
    pub(crate) fn track_changes(&self) {
        self.changed.lock().get_or_insert_with(HashSet::new);
    }

    /// The users whose settings changed since the last call.
    pub(crate) fn take_changed(&self) -> Vec<CompactString> {
        self.changed.lock().as_mut().map(|changed| changed.drain().collect()).unwrap_or_default()
    }

    /// The settings of every user of `slots` that has some, to hand over
    /// with them (C3) or copy to their follower (C4).
    pub(crate) async fn in_slots(&self, slots: &SlotSet) -> Result<Vec<(String, Named)>, DurableError> {
        match &self.kept {
            Kept::Memory(map) => Ok(map
                .lock()
                .iter()
                .filter(|(user, _)| slots.holds(user.as_bytes()))
                .map(|(user, named)| {
                    let mut settings: Named = named.clone().into_iter().collect();
                    settings.sort();
                    (user.clone(), settings)
                })
                .collect()),
            Kept::Durable(store) => {
                let (store, set) = (Arc::clone(store), slots.clone());
                run_blocking(move || store.settings_in(&set)).await
            }
        }
    }

    /// Takes the settings of users handed over by another node (C3, C4),
    /// each user's replacing whatever was here. With a durable store they
    /// are on disk already (`DurableStore::replace_users`).
    pub(crate) fn take_over<'a>(&self, users: impl IntoIterator<Item = (&'a str, &'a Named)>) {
        let Kept::Memory(map) = &self.kept else { return };
        let mut map = map.lock();
        for (user, settings) in users {
            if settings.is_empty() {
                map.remove(user);
            } else {
                map.insert(user.to_owned(), settings.iter().cloned().collect());
            }
        }
    }

    /// Forgets `user`'s settings (P7): in memory here; on disk they go with
    /// the erase's transaction (`DurableStore::erase_user`). Returns how many
    /// it had in memory.
    pub(crate) fn erase(&self, user: &str) -> usize {
        if let Some(changed) = self.changed.lock().as_mut() {
            changed.insert(user.into());
        }
        match &self.kept {
            Kept::Memory(map) => map.lock().remove(user).map_or(0, |named| named.len()),
            Kept::Durable(_) => 0,
        }
    }

    /// Forgets the settings of the users of `slots` in memory, once another
    /// node has them (on disk they go with `DurableStore::forget_users`).
    pub(crate) fn release(&self, slots: &SlotSet) {
        if let Kept::Memory(map) = &self.kept {
            map.lock().retain(|user, _| !slots.holds(user.as_bytes()));
        }
    }
}
