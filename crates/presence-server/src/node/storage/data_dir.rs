//! The data directory: where the lease checkpoint and the durable store live
//! (contract B3).
//!
//! ```text
//! DIR/leases.checkpoint        the latest complete checkpoint
//! DIR/leases.checkpoint.prev   the one before it, kept in case the latest is damaged
//! DIR/leases.checkpoint.tmp    a checkpoint being written (never read)
//! DIR/durable.redb             settings and activity (see durable.rs)
//! DIR/feed/                     the change feed's log (feed/mod.rs)
//! DIR/webhooks/                 each webhook's cursor (feed/webhook.rs)
//! ```
//!
//! A checkpoint is written to the temporary file, fsynced, and renamed over
//! the latest after the latest is renamed to `.prev`, and the directory is
//! fsynced: a crash at any point leaves a complete checkpoint to load, either
//! the new one or the one before it.

use std::fs::{self, File};
use std::io::{self, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use presence_core::checkpoint::{CheckpointError, CheckpointWriter, StoreLoader};
use presence_core::{ConfigError, Store, StoreConfig, Tick};

const CHECKPOINT: &str = "leases.checkpoint";
const PREVIOUS: &str = "leases.checkpoint.prev";
const WRITING: &str = "leases.checkpoint.tmp";
const DURABLE: &str = "durable.redb";
const FEED: &str = "feed";
/// How much of a checkpoint file is read at a time while loading: large
/// enough that reading costs little per byte, small beside the store it fills.
const READ_PIECE: usize = 1 << 20;

/// What writing a checkpoint took.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Written {
    pub(crate) bytes: u64,
    pub(crate) took: Duration,
}

/// A store restored from a checkpoint, and when that checkpoint was written.
#[derive(Debug)]
pub(crate) struct Loaded {
    pub(crate) store: Store,
    /// Store ms, as the checkpoint's header says.
    pub(crate) written_at: Tick,
}

/// A data directory.
#[derive(Debug, Clone)]
pub(crate) struct DataDir {
    path: PathBuf,
}

impl DataDir {
    /// Opens the directory, creating it if needed.
    pub(crate) fn open(path: &Path) -> io::Result<Self> {
        fs::create_dir_all(path)?;
        Ok(DataDir { path: path.to_owned() })
    }

    /// Whether the directory at `path` holds a checkpoint or durable data: a
    /// restore (D3) must not mix a backup with them.
    pub(crate) fn holds_data(path: &Path) -> bool {
        [CHECKPOINT, PREVIOUS, DURABLE].iter().any(|name| path.join(name).exists())
    }

    pub(crate) fn durable_store_path(&self) -> PathBuf {
        self.path.join(DURABLE)
    }

    /// The change feed's directory of segment files (F2).
    pub(crate) fn feed_path(&self) -> PathBuf {
        self.path.join(FEED)
    }

    /// The webhooks' cursors (F4).
    pub(crate) fn webhooks_path(&self) -> PathBuf {
        self.path.join(crate::node::feed::webhook::CURSORS_DIR)
    }

    /// A store restored from the latest checkpoint that is intact, falling
    /// back to the one before it (see [`Store::restore`] for `now` and
    /// `hold_until`). Every unusable file is reported in one line; `None`
    /// means start empty. The file is read a piece at a time into the new
    /// store, never whole, and a store is handed out only from a checkpoint
    /// that proved intact to its last byte.
    pub(crate) fn load_store(
        &self,
        config: &StoreConfig,
        now: Tick,
        hold_until: Tick,
    ) -> Result<Option<Loaded>, ConfigError> {
        let mut any = false;
        for name in [CHECKPOINT, PREVIOUS] {
            let path = self.path.join(name);
            let file = match File::open(&path) {
                Ok(file) => file,
                Err(err) if err.kind() == io::ErrorKind::NotFound => continue,
                Err(err) => {
                    any = true;
                    tracing::error!("checkpoint {} cannot be read ({err}); trying the previous one", path.display());
                    continue;
                }
            };
            any = true;
            match load(file, StoreLoader::new(config.clone(), now, hold_until)?) {
                Ok(loaded) => {
                    let stats = loaded.store.stats();
                    tracing::info!(
                        path = %path.display(),
                        users = stats.users,
                        sessions = stats.sessions,
                        "loaded checkpoint"
                    );
                    return Ok(Some(loaded));
                }
                Err(Unusable::Read(err)) => {
                    tracing::error!("checkpoint {} cannot be read ({err}); trying the previous one", path.display())
                }
                Err(Unusable::Refused(err)) => {
                    tracing::error!("checkpoint {} is unusable ({err}); trying the previous one", path.display())
                }
            }
        }
        if any {
            tracing::warn!(dir = %self.path.display(), "no usable checkpoint: starting empty");
        } else {
            // A new data directory, not a damaged one.
            tracing::info!(dir = %self.path.display(), "no checkpoint yet: starting empty");
        }
        Ok(None)
    }

    /// Writes a checkpoint of `store` taken at `now` and makes it the latest.
    /// Blocks on disk I/O; each shard is locked only while it is encoded.
    pub(crate) fn write_checkpoint(&self, store: &Store, now: Tick) -> io::Result<Written> {
        let started = Instant::now();
        let writing = self.path.join(WRITING);
        let mut file = BufWriter::with_capacity(1 << 20, File::create(&writing)?);
        let mut writer = CheckpointWriter::new(now);
        let mut bytes = 0u64;
        for shard in 0..store.shard_count() {
            store.checkpoint_shard(shard, &mut writer);
            let chunk = writer.take_chunk();
            bytes += chunk.len() as u64;
            file.write_all(&chunk)?;
        }
        let last = writer.finish();
        bytes += last.len() as u64;
        file.write_all(&last)?;
        let file = file.into_inner().map_err(io::IntoInnerError::into_error)?;
        file.sync_all()?;
        drop(file);
        let latest = self.path.join(CHECKPOINT);
        if latest.exists() {
            fs::rename(&latest, self.path.join(PREVIOUS))?;
        }
        fs::rename(&writing, &latest)?;
        File::open(&self.path)?.sync_all()?;
        Ok(Written { bytes, took: started.elapsed() })
    }
}

/// Why a checkpoint file was not loaded.
enum Unusable {
    Read(io::Error),
    Refused(CheckpointError),
}

/// Reads `file` through `loader`, a piece at a time.
fn load(mut file: File, mut loader: StoreLoader) -> Result<Loaded, Unusable> {
    let mut piece = vec![0; READ_PIECE];
    loop {
        let read = match file.read(&mut piece) {
            Ok(0) => break,
            Ok(read) => read,
            Err(err) if err.kind() == io::ErrorKind::Interrupted => continue,
            Err(err) => return Err(Unusable::Read(err)),
        };
        loader.feed(&piece[..read]).map_err(Unusable::Refused)?;
    }
    let written_at = loader.written_at();
    let store = loader.finish().map_err(Unusable::Refused)?;
    // A whole checkpoint has its header; were it missing, 0 forgets every erasure noted again (the safe side).
    Ok(Loaded { store, written_at: written_at.unwrap_or_default() })
}

#[cfg(test)]
mod tests {
    use super::*;
    use presence_core::{Registration, StoreConfig};

    fn scratch(name: &str) -> DataDir {
        let path = std::env::temp_dir().join(format!("presenced-datadir-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&path);
        DataDir::open(&path).unwrap()
    }

    fn store_with(users: usize) -> Store {
        let store = Store::new(StoreConfig::default(), 1_000).unwrap();
        let mut changes = presence_core::Changes::default();
        for user in 0..users {
            let id = format!("u{user}");
            let registration =
                Registration { user_id: &id, session_id: "s", gateway_id: "g", ttl_ms: 45_000, metadata: &[] };
            store.register(1_000, &registration, &mut changes).unwrap();
        }
        store
    }

    #[test]
    fn a_damaged_latest_checkpoint_falls_back_to_the_previous_one() {
        let dir = scratch("fallback");
        let load = |dir: &DataDir| dir.load_store(&StoreConfig::default(), 4_000, 4_000).unwrap();
        assert!(load(&dir).is_none(), "an empty directory starts empty");
        dir.write_checkpoint(&store_with(3), 2_000).unwrap();
        dir.write_checkpoint(&store_with(5), 3_000).unwrap();
        let loaded = load(&dir).unwrap();
        assert_eq!((loaded.store.stats().users, loaded.written_at), (5, 3_000));

        // Cut the latest short, as a crash in the middle of a copy would.
        let latest = dir.path.join(CHECKPOINT);
        let bytes = fs::read(&latest).unwrap();
        fs::write(&latest, &bytes[..bytes.len() / 2]).unwrap();
        let loaded = load(&dir).expect("the previous checkpoint");
        assert_eq!(loaded.store.stats().users, 3, "the store of the checkpoint written at 2,000");

        // Both damaged: start empty rather than from garbage.
        let previous = dir.path.join(PREVIOUS);
        let mut bytes = fs::read(&previous).unwrap();
        bytes[20] ^= 0xff;
        fs::write(&previous, &bytes).unwrap();
        assert!(load(&dir).is_none());
        fs::remove_dir_all(&dir.path).unwrap();
    }
}
