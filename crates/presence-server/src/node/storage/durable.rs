//! Durable data (contract B4): per-user settings, activity, visibility,
//! audiences, group memberships and statuses, kept in an embedded redb
//! database in the data directory. This file owns their format on disk.
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

use presence_core::{Availability, SlotSet, Status};
use redb::{Database, ReadableDatabase, ReadableTable, TableDefinition};

use crate::node::groups::GroupEntry;
use crate::node::relations::{HandedOver, RelationChange, Visibility};

/// One user's settings, by name, in name order.
pub(crate) type Named = Vec<(String, Vec<u8>)>;

/// (user id, setting name) -> value.
const SETTINGS: TableDefinition<'_, (&str, &str), &[u8]> = TableDefinition::new("settings");
/// user id -> last_active_at (store ms).
const ACTIVITY: TableDefinition<'_, &str, u64> = TableDefinition::new("activity");
/// user id -> visibility, as a [`stored`] code.
const VISIBILITY: TableDefinition<'_, &str, u8> = TableDefinition::new("visibility");
/// user id -> (): the users that do not share their derived availability
/// (A2). A build that does not know the table leaves it alone, and shows
/// their availability: its viewers see what a user of that build shows.
const ACTIVITY_HIDDEN: TableDefinition<'_, &str, ()> = TableDefinition::new("activity_hidden");
/// (user id, viewer id) -> (): the viewers a user granted.
const GRANTS: TableDefinition<'_, (&str, &str), ()> = TableDefinition::new("grants");
/// (group id, user id) -> (): group memberships as builds before the group
/// ledger kept them; moved into [`GROUP_ENTRIES`] when the store is opened.
const MEMBERS: TableDefinition<'_, (&str, &str), ()> = TableDefinition::new("members");
/// (group id, user id) -> (stamp, member): the group ledger (`groups.rs`),
/// members and, in a cluster, the leaves it keeps.
const GROUP_ENTRIES: TableDefinition<'_, (&str, &str), (u64, bool)> = TableDefinition::new("group_entries");
/// user id -> the store time (ms) an erase of the user was done (P7): a
/// restart from a checkpoint written before then forgets the user again.
/// Rows older than the latest checkpoint are dropped as it is written.
const ERASED: TableDefinition<'_, &str, u64> = TableDefinition::new("erased");
/// user id -> status: availability as a [`stored`] code (u8), expires_at u64
/// little-endian (0 = never), then the text's UTF-8 bytes.
const STATUS: TableDefinition<'_, &str, &[u8]> = TableDefinition::new("status");

/// The codes values are stored under. They are the disk's own: they must
/// never change, whatever the API's enums become, or data written before the
/// change would be read as something else. `tests/golden/` pins them.
pub(crate) mod stored {
    use super::{Availability, Visibility};

    /// A visibility's code.
    pub(crate) fn visibility_code(visibility: Visibility) -> u8 {
        match visibility {
            Visibility::Everyone => 1,
            Visibility::Audience => 2,
            Visibility::Nobody => 3,
        }
    }

    /// The visibility of a code; `None` for a code this build does not know.
    pub(crate) fn visibility(code: u8) -> Option<Visibility> {
        match code {
            1 => Some(Visibility::Everyone),
            2 => Some(Visibility::Audience),
            3 => Some(Visibility::Nobody),
            _ => None,
        }
    }

    /// An availability's code.
    pub(crate) fn availability_code(availability: Availability) -> u8 {
        match availability {
            Availability::Available => 1,
            Availability::Away => 2,
            Availability::DoNotDisturb => 3,
        }
    }

    /// The availability of a code; `None` for a code this build does not know.
    pub(crate) fn availability(code: u8) -> Option<Availability> {
        match code {
            1 => Some(Availability::Available),
            2 => Some(Availability::Away),
            3 => Some(Availability::DoNotDisturb),
            _ => None,
        }
    }
}

/// A status as the STATUS table stores it.
pub(crate) fn encode_status(status: &Status) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(9 + status.text.len());
    bytes.push(stored::availability_code(status.availability));
    bytes.extend_from_slice(&status.expires_at.unwrap_or(0).to_le_bytes());
    bytes.extend_from_slice(status.text.as_bytes());
    bytes
}

/// A stored status; `None` for bytes this build did not write.
pub(crate) fn decode_status(bytes: &[u8]) -> Option<Status> {
    let (&code, rest) = bytes.split_first()?;
    let (expires_at, text) = rest.split_at_checked(8)?;
    let expires_at = u64::from_le_bytes(expires_at.try_into().ok()?);
    Some(Status {
        availability: stored::availability(code)?,
        text: String::from_utf8(text.to_vec()).ok()?,
        expires_at: (expires_at != 0).then_some(expires_at),
    })
}

/// Every relation kept on disk, as loaded at start.
#[derive(Debug, Default)]
pub(crate) struct Relations {
    /// (user, visibility).
    pub(crate) visibility: Vec<(String, Visibility)>,
    /// (user, viewer) grants.
    pub(crate) grants: Vec<(String, String)>,
    /// The group ledger's entries.
    pub(crate) groups: Vec<GroupEntry>,
    /// (user, status).
    pub(crate) statuses: Vec<(String, Status)>,
    /// The users that do not share their derived availability (A2).
    pub(crate) activity_hidden: Vec<String>,
}

/// A failure of the durable store; the request that caused it is answered
/// `UNAVAILABLE` and nothing is acknowledged.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DurableError {
    /// The database file cannot be opened or created.
    #[error("durable store: cannot open: {0}")]
    Open(#[from] redb::DatabaseError),
    /// A transaction cannot begin.
    #[error("durable store: {0}")]
    Transaction(#[from] redb::TransactionError),
    /// A table cannot be opened.
    #[error("durable store: {0}")]
    Table(#[from] redb::TableError),
    /// Reading or writing the file failed.
    #[error("durable store: {0}")]
    Storage(#[from] redb::StorageError),
    /// A transaction cannot commit.
    #[error("durable store: {0}")]
    Commit(#[from] redb::CommitError),
    /// The blocking task that ran the call failed.
    #[error("durable store: the blocking task failed: {0}")]
    Task(#[from] tokio::task::JoinError),
}

/// Runs a durable-store call on the blocking pool.
pub(crate) async fn run_blocking<T: Send + 'static>(
    work: impl FnOnce() -> Result<T, DurableError> + Send + 'static,
) -> Result<T, DurableError> {
    tokio::task::spawn_blocking(work).await?
}

/// The durable store of one data directory.
#[derive(Debug)]
pub(crate) struct DurableStore {
    db: Database,
}

impl DurableStore {
    /// Opens (or creates) the database at `path`.
    pub(crate) fn open(path: &Path) -> Result<Self, DurableError> {
        let db = Database::create(path)?;
        // Create the tables up front, so that readers never meet a missing table.
        let txn = db.begin_write()?;
        txn.open_table(SETTINGS)?;
        txn.open_table(ACTIVITY)?;
        txn.open_table(VISIBILITY)?;
        txn.open_table(GRANTS)?;
        txn.open_table(ACTIVITY_HIDDEN)?;
        txn.open_table(STATUS)?;
        txn.open_table(ERASED)?;
        {
            // Memberships an earlier build kept become ledger entries older
            // than any write stamped since (stamp 0).
            let mut members = txn.open_table(MEMBERS)?;
            let mut entries = txn.open_table(GROUP_ENTRIES)?;
            for entry in members.iter()? {
                let (key, _) = entry?;
                let (group, user) = key.value();
                if entries.get((group, user))?.is_none() {
                    entries.insert((group, user), (0, true))?;
                }
            }
            members.retain(|_, ()| false)?;
        }
        txn.commit()?;
        Ok(DurableStore { db })
    }

    /// Writes one change of relations in one transaction; returns once it is on disk.
    pub(crate) fn write_relations(&self, change: &RelationChange) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        match change {
            RelationChange::Visibility { user, visibility } => {
                txn.open_table(VISIBILITY)?.insert(user.as_str(), stored::visibility_code(*visibility))?;
            }
            RelationChange::Audience { user, viewers, grant } => {
                let mut table = txn.open_table(GRANTS)?;
                for viewer in viewers {
                    let key = (user.as_str(), viewer.as_str());
                    if *grant {
                        table.insert(key, ())?;
                    } else {
                        table.remove(key)?;
                    }
                }
            }
            RelationChange::ShareActivity { user, shares } => {
                let mut table = txn.open_table(ACTIVITY_HIDDEN)?;
                if *shares {
                    table.remove(user.as_str())?;
                } else {
                    table.insert(user.as_str(), ())?;
                }
            }
        }
        Ok(txn.commit()?)
    }

    /// Writes group ledger entries (each newer than the one stored) in one
    /// transaction, each with whether the ledger keeps a row for it (else
    /// the pair's row goes). Returns once it is on disk.
    pub(crate) fn write_groups(&self, entries: &[(GroupEntry, bool)]) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        put_group_rows(&mut txn.open_table(GROUP_ENTRIES)?, entries)?;
        Ok(txn.commit()?)
    }

    /// Deletes the given group ledger entries where no newer one replaced them.
    pub(crate) fn forget_group_entries(&self, entries: &[GroupEntry]) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(GROUP_ENTRIES)?;
            for entry in entries {
                let key = (entry.group.as_str(), entry.user.as_str());
                let stored = table.get(key)?.map(|value| value.value());
                if stored == Some((entry.stamp, entry.member)) {
                    table.remove(key)?;
                }
            }
        }
        Ok(txn.commit()?)
    }

    /// Sets (`Some`) or clears (`None`) a user's status; returns once it is on disk.
    pub(crate) fn write_status(&self, user_id: &str, status: Option<&Status>) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(STATUS)?;
            match status {
                Some(status) => {
                    table.insert(user_id, encode_status(status).as_slice())?;
                }
                None => {
                    table.remove(user_id)?;
                }
            }
        }
        Ok(txn.commit()?)
    }

    /// Writes what users handed over by another node keep on disk (C3), in
    /// one transaction: each user's visibility, grants, status and settings
    /// replace whatever this store held of them, and its activity time moves
    /// forward to the one handed over. Returns once it is on disk.
    pub(crate) fn replace_users(&self, users: &[HandedOver]) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        {
            let (mut visibility, mut grants, mut statuses) =
                (txn.open_table(VISIBILITY)?, txn.open_table(GRANTS)?, txn.open_table(STATUS)?);
            let (mut activity, mut settings) = (txn.open_table(ACTIVITY)?, txn.open_table(SETTINGS)?);
            let mut hidden = txn.open_table(ACTIVITY_HIDDEN)?;
            for user in users {
                let id = user.user_id.as_str();
                if user.shares_activity {
                    hidden.remove(id)?;
                } else {
                    hidden.insert(id, ())?;
                }
                match user.visibility {
                    Some(chosen) => visibility.insert(id, stored::visibility_code(chosen)).map(drop)?,
                    None => visibility.remove(id).map(drop)?,
                }
                remove_every_key_of(&mut grants, id)?;
                for viewer in &user.audience {
                    grants.insert((id, viewer.as_str()), ())?;
                }
                match &user.status {
                    Some(status) => statuses.insert(id, encode_status(status).as_slice()).map(drop)?,
                    None => statuses.remove(id).map(drop)?,
                }
                let stored = activity.get(id)?.map(|value| value.value());
                if user.last_active_at > 0 && stored.is_none_or(|stored| stored < user.last_active_at) {
                    activity.insert(id, user.last_active_at)?;
                }
                remove_every_key_of(&mut settings, id)?;
                for (name, value) in &user.settings {
                    settings.insert((id, name.as_str()), value.as_slice())?;
                }
            }
        }
        Ok(txn.commit()?)
    }

    /// Deletes everything kept of `user` (P7) in one transaction: its
    /// visibility, the viewers it granted, its status, settings and activity,
    /// and its place in every other user's audience; and writes its group
    /// leaves (`group_rows`, as [`DurableStore::write_groups`] takes them).
    /// Returns how many settings it had. Returns once it is on disk.
    pub(crate) fn erase_user(&self, user: &str, group_rows: &[(GroupEntry, bool)]) -> Result<usize, DurableError> {
        let txn = self.db.begin_write()?;
        let settings_removed;
        {
            txn.open_table(VISIBILITY)?.remove(user)?;
            txn.open_table(ACTIVITY_HIDDEN)?.remove(user)?;
            txn.open_table(STATUS)?.remove(user)?;
            txn.open_table(ACTIVITY)?.remove(user)?;
            let mut grants = txn.open_table(GRANTS)?;
            remove_every_key_of(&mut grants, user)?;
            grants.retain(|(_, viewer), ()| viewer != user)?;
            let mut settings = txn.open_table(SETTINGS)?;
            settings_removed = seconds_of(&settings, user)?.len();
            remove_every_key_of(&mut settings, user)?;
            put_group_rows(&mut txn.open_table(GROUP_ENTRIES)?, group_rows)?;
        }
        txn.commit()?;
        Ok(settings_removed)
    }

    /// Takes `viewer` out of every user's audience (P7: the viewer was
    /// erased at its owner). Returns once it is on disk.
    pub(crate) fn forget_grants_to(&self, viewer: &str) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        txn.open_table(GRANTS)?.retain(|(_, granted), ()| granted != viewer)?;
        Ok(txn.commit()?)
    }

    /// Notes that `user` was erased at store time `at` (P7); returns once it is on disk.
    pub(crate) fn note_erased(&self, user: &str, at: u64) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        txn.open_table(ERASED)?.insert(user, at)?;
        Ok(txn.commit()?)
    }

    /// Every erasure noted, with its time.
    pub(crate) fn erasures(&self) -> Result<Vec<(String, u64)>, DurableError> {
        let txn = self.db.begin_read()?;
        let mut erased = Vec::new();
        for entry in txn.open_table(ERASED)?.iter()? {
            let (user, at) = entry?;
            erased.push((user.value().to_owned(), at.value()));
        }
        Ok(erased)
    }

    /// Drops the erasures noted before store time `before`: a checkpoint
    /// written from then on does not hold their users.
    pub(crate) fn forget_erasures_before(&self, before: u64) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        txn.open_table(ERASED)?.retain(|_, at| at >= before)?;
        Ok(txn.commit()?)
    }

    /// The activity time of every user of `slots` that has one on disk.
    pub(crate) fn activity_in(&self, slots: &SlotSet) -> Result<Vec<(String, u64)>, DurableError> {
        let txn = self.db.begin_read()?;
        let mut found = Vec::new();
        for entry in txn.open_table(ACTIVITY)?.iter()? {
            let (user, at) = entry?;
            if slots.holds(user.value().as_bytes()) {
                found.push((user.value().to_owned(), at.value()));
            }
        }
        Ok(found)
    }

    /// The settings of every user of `slots` that has some, by user, each in name order.
    pub(crate) fn settings_in(&self, slots: &SlotSet) -> Result<Vec<(String, Named)>, DurableError> {
        let txn = self.db.begin_read()?;
        let mut found: Vec<(String, Named)> = Vec::new();
        for entry in txn.open_table(SETTINGS)?.iter()? {
            let (key, value) = entry?;
            let (user, name) = key.value();
            if !slots.holds(user.as_bytes()) {
                continue;
            }
            let setting = (name.to_owned(), value.value().to_vec());
            match found.last_mut() {
                // Keys are in (user, name) order: a user's settings are together.
                Some((last, settings)) if last == user => settings.push(setting),
                _ => found.push((user.to_owned(), vec![setting])),
            }
        }
        Ok(found)
    }

    /// Deletes the visibility, grants, status, activity and settings of the
    /// users of `slots` once another node has taken them over (C3), so that a
    /// restart of this node does not bring back what their owner has changed
    /// since.
    pub(crate) fn forget_users(&self, slots: &SlotSet) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        txn.open_table(VISIBILITY)?.retain(|user, _| !slots.holds(user))?;
        txn.open_table(ACTIVITY_HIDDEN)?.retain(|user, ()| !slots.holds(user))?;
        txn.open_table(GRANTS)?.retain(|(user, _), ()| !slots.holds(user))?;
        txn.open_table(STATUS)?.retain(|user, _| !slots.holds(user))?;
        txn.open_table(ACTIVITY)?.retain(|user, _| !slots.holds(user))?;
        txn.open_table(SETTINGS)?.retain(|(user, _), _| !slots.holds(user))?;
        Ok(txn.commit()?)
    }

    /// Every relation, to load at start. A value this build cannot read (a
    /// code from a newer build) is skipped with a warning, never guessed.
    pub(crate) fn relations(&self) -> Result<Relations, DurableError> {
        let txn = self.db.begin_read()?;
        let mut relations = Relations::default();
        for entry in txn.open_table(VISIBILITY)?.iter()? {
            let (user, code) = entry?;
            match stored::visibility(code.value()) {
                Some(visibility) => relations.visibility.push((user.value().to_owned(), visibility)),
                None => tracing::warn!(user = user.value(), code = code.value(), "unknown stored visibility; skipped"),
            }
        }
        for entry in txn.open_table(GRANTS)?.iter()? {
            let (key, _) = entry?;
            let (user, viewer) = key.value();
            relations.grants.push((user.to_owned(), viewer.to_owned()));
        }
        for entry in txn.open_table(ACTIVITY_HIDDEN)?.iter()? {
            let (user, _) = entry?;
            relations.activity_hidden.push(user.value().to_owned());
        }
        for entry in txn.open_table(GROUP_ENTRIES)?.iter()? {
            let (key, value) = entry?;
            let ((group, user), (stamp, member)) = (key.value(), value.value());
            relations.groups.push(GroupEntry { group: group.into(), user: user.into(), stamp, member });
        }
        for entry in txn.open_table(STATUS)?.iter()? {
            let (user, bytes) = entry?;
            match decode_status(bytes.value()) {
                Some(status) => relations.statuses.push((user.value().to_owned(), status)),
                None => tracing::warn!(user = user.value(), "unreadable stored status; skipped"),
            }
        }
        Ok(relations)
    }

    /// Stores one setting; returns once it is on disk.
    /// Writes one setting, unless it is a new name of a user that has
    /// `most` settings already (then false, nothing written).
    pub(crate) fn put_setting(
        &self,
        user_id: &str,
        name: &str,
        value: &[u8],
        most: usize,
    ) -> Result<bool, DurableError> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(SETTINGS)?;
            if table.get((user_id, name))?.is_none() && seconds_of(&table, user_id)?.len() >= most {
                return Ok(false);
            }
            table.insert((user_id, name), value)?;
        }
        txn.commit()?;
        Ok(true)
    }

    /// The settings of each of `user_ids`, in order, read in one transaction.
    pub(crate) fn settings_of<S: AsRef<str>>(&self, user_ids: &[S]) -> Result<Vec<Named>, DurableError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(SETTINGS)?;
        user_ids
            .iter()
            .map(|user_id| rows_of(&table, user_id.as_ref(), |name, value| (name.to_owned(), value.to_vec())))
            .collect()
    }

    /// Records activity times, each only moving forward; returns once they are on disk.
    pub(crate) fn record_activity(&self, entries: &[(String, u64)]) -> Result<(), DurableError> {
        let txn = self.db.begin_write()?;
        {
            let mut table = txn.open_table(ACTIVITY)?;
            for (user_id, at) in entries {
                let stored = table.get(user_id.as_str())?.map(|value| value.value());
                if stored.is_none_or(|stored| stored < *at) {
                    table.insert(user_id.as_str(), *at)?;
                }
            }
        }
        Ok(txn.commit()?)
    }

    /// The stored activity time of each user, if any.
    pub(crate) fn activity<S: AsRef<str>>(&self, user_ids: &[S]) -> Result<Vec<Option<u64>>, DurableError> {
        let txn = self.db.begin_read()?;
        let table = txn.open_table(ACTIVITY)?;
        user_ids.iter().map(|user_id| Ok(table.get(user_id.as_ref())?.map(|value| value.value()))).collect()
    }
}

/// The `(user, _)` rows of `table`, each made into a `T` from the key's
/// second half and the value: a user's granted viewers, its settings.
fn rows_of<V: redb::Value + 'static, T>(
    table: &impl ReadableTable<(&'static str, &'static str), V>,
    user: &str,
    mut row: impl FnMut(&str, V::SelfType<'_>) -> T,
) -> Result<Vec<T>, DurableError> {
    let mut rows = Vec::new();
    for entry in table.range((user, "")..)? {
        let (key, value) = entry?;
        let (owner, second) = key.value();
        if owner != user {
            break;
        }
        rows.push(row(second, value.value()));
    }
    Ok(rows)
}

/// The second halves of the `(user, _)` keys of `table`: a user's granted
/// viewers, its setting names.
fn seconds_of<V: redb::Value + 'static>(
    table: &impl ReadableTable<(&'static str, &'static str), V>,
    user: &str,
) -> Result<Vec<String>, DurableError> {
    rows_of(table, user, |second, _| second.to_owned())
}

/// Writes group ledger entries, each with whether the ledger keeps a row for
/// it (else the pair's row goes).
fn put_group_rows(
    table: &mut redb::Table<'_, (&'static str, &'static str), (u64, bool)>,
    entries: &[(GroupEntry, bool)],
) -> Result<(), DurableError> {
    for (entry, kept) in entries {
        let key = (entry.group.as_str(), entry.user.as_str());
        if *kept {
            table.insert(key, (entry.stamp, entry.member))?;
        } else {
            table.remove(key)?;
        }
    }
    Ok(())
}

/// Removes every `(user, _)` key of `table` (a user's grants, its settings).
fn remove_every_key_of<V: redb::Value + 'static>(
    table: &mut redb::Table<'_, (&'static str, &'static str), V>,
    user: &str,
) -> Result<(), DurableError> {
    for second in seconds_of(table, user)? {
        table.remove((user, second.as_str()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings_of(store: &DurableStore, user_id: &str) -> Named {
        store.settings_of(&[user_id]).unwrap().remove(0)
    }

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
            assert!(store.put_setting("alice", "visibility", b"audience", 2).unwrap());
            assert!(store.put_setting("alice", "status", b"away", 2).unwrap());
            assert!(!store.put_setting("alice", "third", b"past the most", 2).unwrap());
            assert!(store.put_setting("alice", "status", b"away", 2).unwrap(), "a name held is replaced");
            assert!(store.put_setting("alicea", "status", b"other user", 2).unwrap());
            store.record_activity(&[("alice".into(), 2_000), ("bob".into(), 1_000)]).unwrap();
            store.record_activity(&[("alice".into(), 1_500)]).unwrap(); // never backwards
        }
        let store = DurableStore::open(&path).unwrap();
        let settings = settings_of(&store, "alice");
        assert_eq!(
            settings,
            [("status".to_string(), b"away".to_vec()), ("visibility".to_string(), b"audience".to_vec())]
        );
        assert_eq!(store.activity(&["alice", "bob", "carol"]).unwrap(), [Some(2_000), Some(1_000), None]);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn c3_activity_and_settings_handed_over_replace_what_was_here_and_go_with_their_slots() {
        let dir = scratch("handed-over");
        let store = DurableStore::open(&dir.join("durable.redb")).unwrap();
        store.put_setting("alice", "stale", b"gone after the handover", 1).unwrap();
        store.record_activity(&[("alice".into(), 5_000)]).unwrap();
        let alice = HandedOver {
            user_id: "alice".into(),
            status: None,
            visibility: None,
            audience: Vec::new(),
            shares_activity: true,
            last_active_at: 3_000,
            settings: vec![("locale".into(), b"fr".to_vec())],
        };
        let bob = HandedOver { user_id: "bob".into(), last_active_at: 7_000, ..alice.clone() };
        store.replace_users(&[alice, bob]).unwrap();
        assert_eq!(settings_of(&store, "alice"), [("locale".to_string(), b"fr".to_vec())], "replaced whole");
        assert_eq!(store.activity(&["alice", "bob"]).unwrap(), [Some(5_000), Some(7_000)], "activity only moves on");

        let slots = 16;
        let of_alice = SlotSet::of(slots, [presence_core::slot_of("alice", slots)]);
        assert_eq!(store.activity_in(&of_alice).unwrap(), [("alice".to_string(), 5_000)]);
        let settings = store.settings_in(&of_alice).unwrap();
        assert_eq!(settings, [("alice".to_string(), vec![("locale".to_string(), b"fr".to_vec())])]);
        store.forget_users(&of_alice).unwrap();
        assert!(settings_of(&store, "alice").is_empty());
        assert_eq!(store.activity(&["alice", "bob"]).unwrap(), [None, Some(7_000)], "only alice's slot forgotten");
        assert_eq!(settings_of(&store, "bob").len(), 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A2: a user's choice not to share its availability is kept on disk,
    /// is replaced by a handover's, goes with its slot and with an erase.
    #[test]
    fn a2_not_sharing_availability_is_kept_handed_over_and_erased() {
        use crate::node::relations::RelationChange;
        let dir = scratch("activity-hidden");
        let path = dir.join("durable.redb");
        let store = DurableStore::open(&path).unwrap();
        for (user, shares) in [("ann", false), ("bob", false), ("cid", false), ("bob", true)] {
            store.write_relations(&RelationChange::ShareActivity { user: user.into(), shares }).unwrap();
        }
        drop(store);
        let store = DurableStore::open(&path).unwrap();
        assert_eq!(store.relations().unwrap().activity_hidden, ["ann", "cid"], "kept across a reopen");
        let handed = |user: &str, shares_activity| HandedOver {
            user_id: user.into(),
            status: None,
            visibility: None,
            audience: Vec::new(),
            shares_activity,
            last_active_at: 0,
            settings: Vec::new(),
        };
        store.replace_users(&[handed("ann", true), handed("dan", false)]).unwrap();
        assert_eq!(store.relations().unwrap().activity_hidden, ["cid", "dan"]);
        store.erase_user("cid", &[]).unwrap();
        let slots = 16;
        store.forget_users(&SlotSet::of(slots, [presence_core::slot_of("dan", slots)])).unwrap();
        assert!(store.relations().unwrap().activity_hidden.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// The golden data directory's durable store: written once by the build
    /// that introduced this format, read by every build since. Regenerate it
    /// only for a deliberate format change, with
    /// `PRESENCED_BLESS=1 cargo test -p presence-server durable::tests::golden`,
    /// and keep a reader for the old format.
    const GOLDEN: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/golden/durable-v1.redb");

    fn write_golden_contents(store: &DurableStore) {
        use crate::node::relations::RelationChange;
        let ids = |ids: &[&str]| ids.iter().map(|id| (*id).into()).collect::<Vec<_>>();
        for (user, visibility) in
            [("ann", Visibility::Everyone), ("bob", Visibility::Audience), ("cat", Visibility::Nobody)]
        {
            store.write_relations(&RelationChange::Visibility { user: user.into(), visibility }).unwrap();
        }
        store
            .write_relations(&RelationChange::Audience {
                user: "ann".into(),
                viewers: ids(&["bob", "cat"]),
                grant: true,
            })
            .unwrap();
        let joined =
            ["ann", "dan"].map(|user| GroupEntry { group: "team".into(), user: user.into(), stamp: 0, member: true });
        store.write_groups(&joined.map(|entry| (entry, true))).unwrap();
        let statuses = [
            ("ann", Availability::Available, "", None),
            ("bob", Availability::Away, "lunch", Some(1_800_000_000_000)),
            ("cat", Availability::DoNotDisturb, "héllo", None),
        ];
        for (user, availability, text, expires_at) in statuses {
            let status = Status { availability, text: text.into(), expires_at };
            store.write_status(user, Some(&status)).unwrap();
        }
        store.put_setting("ann", "theme", b"dark", 1).unwrap();
        store.record_activity(&[("ann".into(), 1_700_000_000_123), ("bob".into(), 1_700_000_000_456)]).unwrap();
    }

    /// Memberships kept by builds before the group ledger become its
    /// entries, once; a leave's row is kept only when asked, and a forgotten
    /// tombstone goes only if no newer entry replaced it.
    #[test]
    fn b4_group_memberships_move_into_the_ledger_and_tombstones_stay_as_asked() {
        let path = scratch("groups").join("durable.redb");
        {
            let db = Database::create(&path).unwrap();
            let txn = db.begin_write().unwrap();
            txn.open_table(MEMBERS).unwrap().insert(("team", "ann"), ()).unwrap();
            txn.commit().unwrap();
        }
        let entry = |user: &str, stamp: u64, member: bool| GroupEntry {
            group: "team".into(),
            user: user.into(),
            stamp,
            member,
        };
        let store = DurableStore::open(&path).unwrap();
        assert_eq!(store.relations().unwrap().groups, [entry("ann", 0, true)]);
        store.write_groups(&[(entry("ann", 5, false), true), (entry("bob", 6, true), true)]).unwrap();
        store.write_groups(&[(entry("cid", 7, true), true)]).unwrap();
        store.write_groups(&[(entry("cid", 8, false), false)]).unwrap();
        drop(store);
        let store = DurableStore::open(&path).unwrap();
        assert_eq!(store.relations().unwrap().groups, [entry("ann", 5, false), entry("bob", 6, true)]);
        store.forget_group_entries(&[entry("ann", 5, false), entry("bob", 4, false)]).unwrap();
        assert_eq!(store.relations().unwrap().groups, [entry("bob", 6, true)]);
    }

    #[test]
    fn golden_a_store_written_by_an_earlier_build_reads_back_whole() {
        if std::env::var_os("PRESENCED_BLESS").is_some() {
            let _ = std::fs::remove_file(GOLDEN);
            std::fs::create_dir_all(std::path::Path::new(GOLDEN).parent().unwrap()).unwrap();
            write_golden_contents(&DurableStore::open(std::path::Path::new(GOLDEN)).unwrap());
        }
        // Opened from a copy: opening may write, and the golden file must not change.
        let dir = scratch("golden");
        let copy = dir.join("durable.redb");
        std::fs::copy(GOLDEN, &copy).expect("the golden file is committed");
        let store = DurableStore::open(&copy).unwrap();
        let relations = store.relations().unwrap();
        assert_eq!(
            relations.visibility,
            [
                ("ann".into(), Visibility::Everyone),
                ("bob".into(), Visibility::Audience),
                ("cat".into(), Visibility::Nobody)
            ]
        );
        assert_eq!(relations.grants, [("ann".into(), "bob".into()), ("ann".into(), "cat".into())]);
        // Written as an earlier build kept memberships, read as ledger entries.
        let groups: Vec<(&str, &str, u64, bool)> = relations
            .groups
            .iter()
            .map(|entry| (entry.group.as_str(), entry.user.as_str(), entry.stamp, entry.member))
            .collect();
        assert_eq!(groups, [("team", "ann", 0, true), ("team", "dan", 0, true)]);
        let statuses: Vec<(String, Availability, String, Option<u64>)> = relations
            .statuses
            .into_iter()
            .map(|(user, status)| (user, status.availability, status.text, status.expires_at))
            .collect();
        assert_eq!(
            statuses,
            [
                ("ann".into(), Availability::Available, String::new(), None),
                ("bob".into(), Availability::Away, "lunch".into(), Some(1_800_000_000_000)),
                ("cat".into(), Availability::DoNotDisturb, "héllo".into(), None),
            ]
        );
        assert_eq!(settings_of(&store, "ann"), [("theme".to_string(), b"dark".to_vec())]);
        assert_eq!(
            store.activity(&["ann", "bob", "cat"]).unwrap(),
            [Some(1_700_000_000_123), Some(1_700_000_000_456), None]
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn golden_todays_writer_stores_exactly_the_bytes_of_the_format() {
        // The stored codes are the disk's own: pinned here, whatever the API's enums become.
        let visibilities =
            [Visibility::Everyone, Visibility::Audience, Visibility::Nobody].map(stored::visibility_code);
        assert_eq!(visibilities, [1, 2, 3]);
        let availabilities =
            [Availability::Available, Availability::Away, Availability::DoNotDisturb].map(stored::availability_code);
        assert_eq!(availabilities, [1, 2, 3]);
        // A status: availability code, expires_at u64 little-endian (0 = never), the text's bytes.
        let status =
            Status { availability: Availability::Away, text: "lunch".into(), expires_at: Some(0x0102_0304_0506) };
        assert_eq!(encode_status(&status), b"\x02\x06\x05\x04\x03\x02\x01\x00\x00lunch");
        let never = Status { availability: Availability::DoNotDisturb, text: String::new(), expires_at: None };
        assert_eq!(encode_status(&never), [3, 0, 0, 0, 0, 0, 0, 0, 0]);
        // And what today's writer puts in the tables is what the golden file holds.
        let dir = scratch("golden-bytes");
        let store = DurableStore::open(&dir.join("durable.redb")).unwrap();
        write_golden_contents(&store);
        let golden_copy = dir.join("golden.redb");
        std::fs::copy(GOLDEN, &golden_copy).unwrap();
        let golden = DurableStore::open(&golden_copy).unwrap();
        assert_eq!(raw_tables(&store), raw_tables(&golden));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// Every row of every table, keys and values as stored (a status as its bytes).
    fn raw_tables(store: &DurableStore) -> Vec<String> {
        let txn = store.db.begin_read().unwrap();
        let mut rows = Vec::new();
        for entry in txn.open_table(VISIBILITY).unwrap().iter().unwrap() {
            let (key, value) = entry.unwrap();
            rows.push(format!("visibility {:?} {:?}", key.value(), value.value()));
        }
        for entry in txn.open_table(STATUS).unwrap().iter().unwrap() {
            let (key, value) = entry.unwrap();
            rows.push(format!("status {:?} {:?}", key.value(), value.value()));
        }
        for entry in txn.open_table(GRANTS).unwrap().iter().unwrap() {
            rows.push(format!("grants {:?}", entry.unwrap().0.value()));
        }
        for entry in txn.open_table(GROUP_ENTRIES).unwrap().iter().unwrap() {
            let (key, value) = entry.unwrap();
            rows.push(format!("group_entries {:?} {:?}", key.value(), value.value()));
        }
        for entry in txn.open_table(SETTINGS).unwrap().iter().unwrap() {
            let (key, value) = entry.unwrap();
            rows.push(format!("settings {:?} {:?}", key.value(), value.value()));
        }
        for entry in txn.open_table(ACTIVITY).unwrap().iter().unwrap() {
            let (key, value) = entry.unwrap();
            rows.push(format!("activity {:?} {:?}", key.value(), value.value()));
        }
        rows
    }
}

/// One row of a durable table as a backup carries it (D3): the table's code,
/// its key's one or two strings and its value's bytes. The codes and the
/// value encodings are the backup format's own, like [`stored`]'s.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct BackupRow {
    pub(crate) table: u8,
    pub(crate) first: String,
    /// The key's second string; empty for tables keyed by user alone.
    pub(crate) second: String,
    pub(crate) value: Vec<u8>,
}

/// The tables' codes in a backup.
mod table_code {
    pub(super) const SETTINGS: u8 = 1;
    pub(super) const ACTIVITY: u8 = 2;
    pub(super) const VISIBILITY: u8 = 3;
    pub(super) const GRANTS: u8 = 4;
    pub(super) const GROUP_ENTRIES: u8 = 5;
    pub(super) const ERASED: u8 = 6;
    pub(super) const STATUS: u8 = 7;
}

/// A backup row whose table or value this build does not know.
#[derive(Debug, thiserror::Error)]
#[error("durable row of table {table} is malformed")]
pub(crate) struct MalformedRow {
    pub(crate) table: u8,
}

impl DurableStore {
    /// Hands every row to `emit`, all read in one transaction: a view of the
    /// durable data as of one instant, however long the reading takes.
    /// `emit` returning false stops the reading (the reader went away).
    pub(crate) fn backup_rows(&self, mut emit: impl FnMut(BackupRow) -> bool) -> Result<(), DurableError> {
        let txn = self.db.begin_read()?;
        let mut row = |table: u8, first: &str, second: &str, value: Vec<u8>| {
            emit(BackupRow { table, first: first.to_owned(), second: second.to_owned(), value })
        };
        for entry in txn.open_table(SETTINGS)?.iter()? {
            let (key, value) = entry?;
            let (user, name) = key.value();
            if !row(table_code::SETTINGS, user, name, value.value().to_vec()) {
                return Ok(());
            }
        }
        for entry in txn.open_table(ACTIVITY)?.iter()? {
            let (user, at) = entry?;
            if !row(table_code::ACTIVITY, user.value(), "", at.value().to_le_bytes().to_vec()) {
                return Ok(());
            }
        }
        for entry in txn.open_table(VISIBILITY)?.iter()? {
            let (user, code) = entry?;
            if !row(table_code::VISIBILITY, user.value(), "", vec![code.value()]) {
                return Ok(());
            }
        }
        for entry in txn.open_table(GRANTS)?.iter()? {
            let (key, ()) = entry.map(|(key, _)| (key, ()))?;
            let (user, viewer) = key.value();
            if !row(table_code::GRANTS, user, viewer, Vec::new()) {
                return Ok(());
            }
        }
        for entry in txn.open_table(GROUP_ENTRIES)?.iter()? {
            let (key, value) = entry?;
            let (group, user) = key.value();
            let (stamp, member) = value.value();
            let mut bytes = stamp.to_le_bytes().to_vec();
            bytes.push(u8::from(member));
            if !row(table_code::GROUP_ENTRIES, group, user, bytes) {
                return Ok(());
            }
        }
        for entry in txn.open_table(ERASED)?.iter()? {
            let (user, at) = entry?;
            if !row(table_code::ERASED, user.value(), "", at.value().to_le_bytes().to_vec()) {
                return Ok(());
            }
        }
        for entry in txn.open_table(STATUS)?.iter()? {
            let (user, bytes) = entry?;
            if !row(table_code::STATUS, user.value(), "", bytes.value().to_vec()) {
                return Ok(());
            }
        }
        Ok(())
    }

    /// Writes `rows` (from [`DurableStore::backup_rows`]) in one
    /// transaction. Every row is checked before anything is written, so a
    /// malformed one leaves the store as it was.
    pub(crate) fn restore_rows(&self, rows: &[BackupRow]) -> Result<Result<(), MalformedRow>, DurableError> {
        let u64_of = |row: &BackupRow| row.value.as_slice().try_into().ok().map(u64::from_le_bytes);
        for row in rows {
            let well_formed = match row.table {
                table_code::SETTINGS | table_code::GRANTS => true,
                table_code::ACTIVITY | table_code::ERASED => u64_of(row).is_some(),
                table_code::VISIBILITY => row.value.len() == 1,
                table_code::GROUP_ENTRIES => row.value.len() == 9,
                table_code::STATUS => decode_status(&row.value).is_some(),
                _ => false,
            };
            if !well_formed {
                return Ok(Err(MalformedRow { table: row.table }));
            }
        }
        let txn = self.db.begin_write()?;
        {
            let mut settings = txn.open_table(SETTINGS)?;
            let mut activity = txn.open_table(ACTIVITY)?;
            let mut visibility = txn.open_table(VISIBILITY)?;
            let mut grants = txn.open_table(GRANTS)?;
            let mut groups = txn.open_table(GROUP_ENTRIES)?;
            let mut erased = txn.open_table(ERASED)?;
            let mut status = txn.open_table(STATUS)?;
            for row in rows {
                let (first, second) = (row.first.as_str(), row.second.as_str());
                let at = u64_of(row).unwrap_or_default();
                match row.table {
                    table_code::SETTINGS => drop(settings.insert((first, second), row.value.as_slice())?),
                    table_code::ACTIVITY => drop(activity.insert(first, at)?),
                    table_code::VISIBILITY => drop(visibility.insert(first, row.value[0])?),
                    table_code::GRANTS => drop(grants.insert((first, second), ())?),
                    table_code::GROUP_ENTRIES => {
                        let stamp = u64::from_le_bytes(row.value[..8].try_into().unwrap_or_default());
                        drop(groups.insert((first, second), (stamp, row.value[8] != 0))?)
                    }
                    table_code::ERASED => drop(erased.insert(first, at)?),
                    _ => drop(status.insert(first, row.value.as_slice())?),
                }
            }
        }
        txn.commit()?;
        Ok(Ok(()))
    }
}
