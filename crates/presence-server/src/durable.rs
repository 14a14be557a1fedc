//! Durable data (contract B4): per-user settings and activity, kept in an
//! embedded redb database in the data directory.
//!
//! Sync policy: every write commits with redb's `Durability::Immediate`, which
//! fsyncs before the commit returns, and the server acknowledges a write only
//! after that. So anything acknowledged survives `kill -9` and power loss (as
//! far as the disk honours fsync). Settings are written one per request;
//! activity is written in batches, at most once a minute per user (see
//! `activity.rs`). redb was chosen because it is a pure-Rust, well-maintained,
//! ACID store with crash-safe commits and nothing to run beside the server.
//!
//! Every call blocks on disk I/O: async callers run them on the blocking pool.

use std::path::Path;

use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

/// (user id, setting name) -> value.
const SETTINGS: TableDefinition<'_, (&str, &str), &[u8]> = TableDefinition::new("settings");
/// user id -> last_active_at (store ms).
const ACTIVITY: TableDefinition<'_, &str, u64> = TableDefinition::new("activity");

/// A failure of the durable store; the request that caused it is answered
/// `UNAVAILABLE` and nothing is acknowledged.
#[derive(Debug, thiserror::Error)]
#[error("durable store: {0}")]
pub struct DurableError(String);

fn failed(err: impl std::fmt::Display) -> DurableError {
    DurableError(err.to_string())
}

/// Runs a durable-store call on the blocking pool.
pub(crate) async fn run_blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, DurableError> + Send + 'static,
) -> Result<T, DurableError> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|err| Err(DurableError(format!("the blocking task failed: {err}"))))
}

/// The durable store of one data directory.
#[derive(Debug)]
pub struct DurableStore {
    db: Database,
}

impl DurableStore {
    /// Opens (or creates) the database at `path`.
    pub fn open(path: &Path) -> Result<Self, DurableError> {
        let db = Database::create(path).map_err(failed)?;
        // Create the tables up front, so that readers never meet a missing table.
        let txn = db.begin_write().map_err(failed)?;
        txn.open_table(SETTINGS).map_err(failed)?;
        txn.open_table(ACTIVITY).map_err(failed)?;
        txn.commit().map_err(failed)?;
        Ok(DurableStore { db })
    }

    /// Stores one setting; returns once it is on disk.
    pub fn put_setting(&self, user_id: &str, name: &str, value: &[u8]) -> Result<(), DurableError> {
        let txn = self.db.begin_write().map_err(failed)?;
        txn.open_table(SETTINGS).map_err(failed)?.insert((user_id, name), value).map_err(failed)?;
        txn.commit().map_err(failed)
    }

    /// Every setting of a user, by name.
    pub fn settings(&self, user_id: &str) -> Result<Vec<(String, Vec<u8>)>, DurableError> {
        let txn = self.db.begin_read().map_err(failed)?;
        let table = txn.open_table(SETTINGS).map_err(failed)?;
        let mut settings = Vec::new();
        for entry in table.range((user_id, "")..).map_err(failed)? {
            let (key, value) = entry.map_err(failed)?;
            let (owner, name) = key.value();
            if owner != user_id {
                break;
            }
            settings.push((name.to_owned(), value.value().to_vec()));
        }
        Ok(settings)
    }

    /// Records activity times, each only moving forward; returns once they are on disk.
    pub fn record_activity(&self, entries: &[(String, u64)]) -> Result<(), DurableError> {
        let txn = self.db.begin_write().map_err(failed)?;
        {
            let mut table = txn.open_table(ACTIVITY).map_err(failed)?;
            for (user_id, at) in entries {
                let stored = table.get(user_id.as_str()).map_err(failed)?.map(|value| value.value());
                if stored.is_none_or(|stored| stored < *at) {
                    table.insert(user_id.as_str(), *at).map_err(failed)?;
                }
            }
        }
        txn.commit().map_err(failed)
    }

    /// The stored activity time of each user, if any.
    pub fn activity<S: AsRef<str>>(&self, user_ids: &[S]) -> Result<Vec<Option<u64>>, DurableError> {
        let txn = self.db.begin_read().map_err(failed)?;
        let table = txn.open_table(ACTIVITY).map_err(failed)?;
        user_ids
            .iter()
            .map(|user_id| Ok(table.get(user_id.as_ref()).map_err(failed)?.map(|value| value.value())))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("presenced-durable-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn settings_and_activity_survive_reopening() {
        let dir = scratch("reopen");
        let path = dir.join("durable.redb");
        {
            let store = DurableStore::open(&path).unwrap();
            store.put_setting("alice", "visibility", b"audience").unwrap();
            store.put_setting("alice", "status", b"away").unwrap();
            store.put_setting("alicea", "status", b"other user").unwrap();
            store.record_activity(&[("alice".into(), 2_000), ("bob".into(), 1_000)]).unwrap();
            store.record_activity(&[("alice".into(), 1_500)]).unwrap(); // never backwards
        }
        let store = DurableStore::open(&path).unwrap();
        let settings = store.settings("alice").unwrap();
        assert_eq!(
            settings,
            [("status".to_string(), b"away".to_vec()), ("visibility".to_string(), b"audience".to_vec())]
        );
        assert_eq!(store.activity(&["alice", "bob", "carol"]).unwrap(), [Some(2_000), Some(1_000), None]);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
