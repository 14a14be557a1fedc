//! Per-user settings (contract B4): small named values that must survive a
//! crash once acknowledged. Later features (visibility, audiences, status)
//! keep their data here.
//!
//! With a data directory they go to the durable store, synced before the
//! write is acknowledged; without one the service is purely in memory, as
//! documented, and settings live as long as the process.

use std::sync::Arc;

use hashbrown::HashMap;
use parking_lot::Mutex;

use crate::durable::{DurableError, DurableStore, run_blocking};

/// Longest setting name, in bytes.
pub const MAX_SETTING_NAME_BYTES: usize = 64;
/// Largest setting value, in bytes.
pub const MAX_SETTING_VALUE_BYTES: usize = 4_096;

/// Where settings live.
#[derive(Debug)]
pub(crate) enum Settings {
    /// Purely in memory (no data directory).
    Memory(Mutex<HashMap<String, HashMap<String, Vec<u8>>>>),
    /// On disk, synced before acknowledgement.
    Durable(Arc<DurableStore>),
}

impl Settings {
    pub(crate) async fn put(&self, user_id: String, name: String, value: Vec<u8>) -> Result<(), DurableError> {
        match self {
            Settings::Memory(map) => {
                map.lock().entry(user_id).or_default().insert(name, value);
                Ok(())
            }
            Settings::Durable(store) => {
                let store = Arc::clone(store);
                run_blocking(move || store.put_setting(&user_id, &name, &value)).await
            }
        }
    }

    pub(crate) async fn get(&self, user_id: String) -> Result<Vec<(String, Vec<u8>)>, DurableError> {
        match self {
            Settings::Memory(map) => {
                let mut settings: Vec<(String, Vec<u8>)> =
                    map.lock().get(&user_id).map(|named| named.clone().into_iter().collect()).unwrap_or_default();
                settings.sort();
                Ok(settings)
            }
            Settings::Durable(store) => {
                let store = Arc::clone(store);
                run_blocking(move || store.settings(&user_id)).await
            }
        }
    }
}
