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
/// user id -> visibility (see privacy.rs).
const VISIBILITY: TableDefinition<'_, &str, u8> = TableDefinition::new("visibility");
/// (user id, viewer id) -> (): the viewers a user granted.
const GRANTS: TableDefinition<'_, (&str, &str), ()> = TableDefinition::new("grants");
/// (group id, user id) -> (): group memberships.
const MEMBERS: TableDefinition<'_, (&str, &str), ()> = TableDefinition::new("members");
/// user id -> status: availability u8, expires_at u64 (0 = never), text.
const STATUS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("status");

/// Every relation kept on disk, as loaded at start.
#[derive(Debug, Default)]
pub struct Relations {
    /// (user, visibility code).
    pub visibility: Vec<(String, u8)>,
    /// (user, viewer) grants.
    pub grants: Vec<(String, String)>,
    /// (group, user) memberships.
    pub members: Vec<(String, String)>,
    /// (user, availability code, expires_at or 0, text).
    pub statuses: Vec<(String, u8, u64, String)>,
}

/// One change of relations, written in one transaction.
#[derive(Debug)]
pub enum RelationWrite<'a> {
    /// A user's visibility.
    Visibility(&'a str, u8),
    /// Grants (true) or revokes (false) viewers in a user's audience.
    Grants(&'a str, &'a [String], bool),
    /// Adds (true) or removes (false) users of a group.
    Members(&'a str, &'a [String], bool),
    /// Sets (Some) or clears (None) a user's status: (availability, expires_at or 0, text).
    Status(&'a str, Option<(u8, u64, &'a str)>),
}

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
        txn.open_table(VISIBILITY).map_err(failed)?;
        txn.open_table(GRANTS).map_err(failed)?;
        txn.open_table(MEMBERS).map_err(failed)?;
        txn.open_table(STATUS).map_err(failed)?;
        txn.commit().map_err(failed)?;
        Ok(DurableStore { db })
    }

    /// Writes one change of relations; returns once it is on disk.
    pub fn write_relations(&self, write: &RelationWrite<'_>) -> Result<(), DurableError> {
        let txn = self.db.begin_write().map_err(failed)?;
        match write {
            RelationWrite::Visibility(user, code) => {
                txn.open_table(VISIBILITY).map_err(failed)?.insert(*user, *code).map_err(failed)?;
            }
            RelationWrite::Grants(user, viewers, add) => {
                let mut table = txn.open_table(GRANTS).map_err(failed)?;
                for viewer in viewers.iter() {
                    if *add {
                        table.insert((*user, viewer.as_str()), ()).map_err(failed)?;
                    } else {
                        table.remove((*user, viewer.as_str())).map_err(failed)?;
                    }
                }
            }
            RelationWrite::Members(group, users, add) => {
                let mut table = txn.open_table(MEMBERS).map_err(failed)?;
                for user in users.iter() {
                    if *add {
                        table.insert((*group, user.as_str()), ()).map_err(failed)?;
                    } else {
                        table.remove((*group, user.as_str())).map_err(failed)?;
                    }
                }
            }
            RelationWrite::Status(user, status) => {
                let mut table = txn.open_table(STATUS).map_err(failed)?;
                match status {
                    Some((availability, expires_at, text)) => {
                        let mut bytes = Vec::with_capacity(9 + text.len());
                        bytes.push(*availability);
                        bytes.extend_from_slice(&expires_at.to_le_bytes());
                        bytes.extend_from_slice(text.as_bytes());
                        table.insert(*user, bytes.as_slice()).map_err(failed)?;
                    }
                    None => {
                        table.remove(*user).map_err(failed)?;
                    }
                }
            }
        }
        txn.commit().map_err(failed)
    }

    /// Every relation, to load at start.
    pub fn relations(&self) -> Result<Relations, DurableError> {
        let txn = self.db.begin_read().map_err(failed)?;
        let mut relations = Relations::default();
        for entry in txn.open_table(VISIBILITY).map_err(failed)?.iter().map_err(failed)? {
            let (user, code) = entry.map_err(failed)?;
            relations.visibility.push((user.value().to_owned(), code.value()));
        }
        for entry in txn.open_table(GRANTS).map_err(failed)?.iter().map_err(failed)? {
            let (key, _) = entry.map_err(failed)?;
            let (user, viewer) = key.value();
            relations.grants.push((user.to_owned(), viewer.to_owned()));
        }
        for entry in txn.open_table(MEMBERS).map_err(failed)?.iter().map_err(failed)? {
            let (key, _) = entry.map_err(failed)?;
            let (group, user) = key.value();
            relations.members.push((group.to_owned(), user.to_owned()));
        }
        for entry in txn.open_table(STATUS).map_err(failed)?.iter().map_err(failed)? {
            let (user, bytes) = entry.map_err(failed)?;
            let bytes = bytes.value();
            if bytes.len() < 9 {
                continue; // not written by this build: skip rather than guess
            }
            let expires_at = u64::from_le_bytes(bytes[1..9].try_into().expect("eight bytes"));
            let text = String::from_utf8_lossy(&bytes[9..]).into_owned();
            relations.statuses.push((user.value().to_owned(), bytes[0], expires_at, text));
        }
        Ok(relations)
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
