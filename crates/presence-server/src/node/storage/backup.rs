//! Backup files (contract D3): an online snapshot of one node that a new
//! node can start from (`presenced serve --restore FILE`).
//!
//! ```text
//! header   "PRESBKUP" | format u32 = 1 | slots u32 (0: a single node) | written_at u64 (store ms = Unix ms)
//! frame    kind u8 | length u32 | bytes          (length at most FRAME_BYTES)
//!          kind 1: the next piece of a lease checkpoint (presence-core's format: leases, versions, rooms)
//!          kind 2: durable rows, each  table u8 | first str | second str | value bytes
//! end      0x00 | crc32 u32 of every byte before it
//! str, bytes   length u32 | bytes
//! ```
//!
//! What "consistent" means: each user is taken whole (its leases, version
//! and room memberships) under its shard's lock, as a checkpoint takes it,
//! at most 1,024 users per lock hold, so renewals wait for a short slice,
//! never for a whole shard; each shard's stamp clock and room settings
//! after its users. After each shard the backup rests twice as long as the
//! shard took, leaving the cores to renewals ([`REST_PER_WORK`]). Different
//! users are taken at different instants within the backup's run (under a
//! second for 1M sessions), and no user tears. The
//! durable data is read in one read transaction, a view of it as of one
//! instant. A user's leases and its durable rows may be from instants that
//! far apart, which restores as it would had the write landed just after
//! the backup (the two are independent: no durable row refers to a lease).
//!
//! The slot count makes a file foreign: a cluster node's file holds the users
//! of its slots under that many slots, and a node with another count (or a
//! single node, 0) would place them elsewhere.

use std::fs::File;
use std::io::{self, BufReader, Read};
use std::path::Path;
use std::time::Instant;

use presence_core::checkpoint::{CheckpointError, CheckpointWriter, StoreLoader};
use presence_core::{ConfigError, Store, StoreConfig, Tick};

use crate::node::storage::durable::{BackupRow, DurableError, DurableStore};

const MAGIC: &[u8; 8] = b"PRESBKUP";
const FORMAT: u32 = 1;
const KIND_END: u8 = 0;
const KIND_LEASES: u8 = 1;
const KIND_DURABLE: u8 = 2;
/// Most bytes in one frame: bounds what a reader holds at a time and keeps
/// each frame within one gRPC message of the default 4 MiB limit.
pub(crate) const FRAME_BYTES: usize = 1 << 20;

/// How long a backup rests after taking and sending a shard, for each unit
/// of time that took: the heartbeat comes first, and a backup is work that
/// can wait. On two cores busy with renewals, backups back to back that ran
/// flat out put renewal p99 at 5-8x quiet; resting twice as long as they
/// work, about 2.3x, each backup taking twice as long (docs/benchmarks.md,
/// "Backup of 1M sessions").
const REST_PER_WORK: u32 = 2;

/// What a backup held.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Summary {
    pub(crate) users: u64,
    pub(crate) sessions: u64,
    pub(crate) durable_rows: u64,
}

/// Writes the frames of a backup, keeping their checksum.
struct Framer<'a> {
    out: &'a mut dyn FnMut(Vec<u8>) -> bool,
    crc: crc32fast::Hasher,
    /// False once `out` refused bytes: the reader went away.
    open: bool,
}

impl Framer<'_> {
    fn emit(&mut self, bytes: Vec<u8>) {
        if self.open {
            self.crc.update(&bytes);
            self.open = (self.out)(bytes);
        }
    }

    /// `bytes` as frames of `kind`, each at most [`FRAME_BYTES`].
    fn frames(&mut self, kind: u8, bytes: &[u8]) {
        for piece in bytes.chunks(FRAME_BYTES) {
            let mut frame = Vec::with_capacity(5 + piece.len());
            frame.push(kind);
            frame.extend_from_slice(&(piece.len() as u32).to_le_bytes());
            frame.extend_from_slice(piece);
            self.emit(frame);
        }
    }
}

fn put_bytes(buffer: &mut Vec<u8>, bytes: &[u8]) {
    buffer.extend_from_slice(&(bytes.len() as u32).to_le_bytes());
    buffer.extend_from_slice(bytes);
}

/// Writes a backup of `store` and `durable` at `now`, handing its bytes to
/// `out` in order, a frame at a time; `out` returning false stops it (the
/// reader went away) and nothing more is read. Blocks: run it on the
/// blocking pool.
pub(crate) fn write(
    store: &Store,
    durable: Option<&DurableStore>,
    slots: u32,
    now: Tick,
    out: &mut dyn FnMut(Vec<u8>) -> bool,
) -> Result<Summary, DurableError> {
    let stats = store.stats();
    let mut summary = Summary { users: stats.users as u64, sessions: stats.sessions as u64, durable_rows: 0 };
    let mut framer = Framer { out, crc: crc32fast::Hasher::new(), open: true };
    let mut header = Vec::with_capacity(24);
    header.extend_from_slice(MAGIC);
    header.extend_from_slice(&FORMAT.to_le_bytes());
    header.extend_from_slice(&slots.to_le_bytes());
    header.extend_from_slice(&now.to_le_bytes());
    framer.emit(header);
    let mut writer = CheckpointWriter::new(now);
    for shard in 0..store.shard_count() {
        if !framer.open {
            return Ok(summary);
        }
        let started = Instant::now();
        store.checkpoint_shard(shard, &mut writer);
        framer.frames(KIND_LEASES, &writer.take_chunk());
        // Sending waits for the reader, which is part of the backup's work
        // (the stream, the client writing the file): measured with it.
        std::thread::sleep(started.elapsed() * REST_PER_WORK);
    }
    framer.frames(KIND_LEASES, &writer.finish());
    if let Some(durable) = durable {
        let mut rows = Vec::new();
        durable.backup_rows(|row| {
            summary.durable_rows += 1;
            rows.push(row.table);
            put_bytes(&mut rows, row.first.as_bytes());
            put_bytes(&mut rows, row.second.as_bytes());
            put_bytes(&mut rows, &row.value);
            if rows.len() >= FRAME_BYTES / 2 {
                framer.frames(KIND_DURABLE, &std::mem::take(&mut rows));
            }
            framer.open
        })?;
        framer.frames(KIND_DURABLE, &rows);
    }
    let crc = framer.crc.clone().finalize();
    let mut end = vec![KIND_END];
    end.extend_from_slice(&crc.to_le_bytes());
    // The checksum covers everything before the end record, not the record itself.
    if framer.open {
        (framer.out)(end);
    }
    Ok(summary)
}

/// Why a backup file is refused.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackupError {
    #[error("cannot read the file: {0}")]
    Read(#[from] io::Error),
    #[error("not a presenced backup (bad magic bytes)")]
    NotABackup,
    #[error("backup format {0} is not supported (this build reads format {FORMAT})")]
    Format(u32),
    #[error("a foreign backup: written by a node of {file} slots, this node has {ours} (0: a single node)")]
    Foreign { file: u32, ours: u32 },
    #[error("truncated: it ends before its end record")]
    Truncated,
    #[error("corrupt: checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum { stored: u32, computed: u32 },
    #[error("corrupt: {0}")]
    Corrupt(&'static str),
    #[error("corrupt: its leases are unusable: {0}")]
    Leases(CheckpointError),
    #[error("{0}")]
    Config(#[from] ConfigError),
}

/// A backup read and checked to its last byte.
#[derive(Debug)]
pub(crate) struct Restored {
    pub(crate) store: Store,
    /// Store ms, as the header says.
    pub(crate) written_at: Tick,
    /// The durable rows, to be written to the data directory's store.
    pub(crate) rows: Vec<BackupRow>,
}

/// Reads exactly `buffer.len()` bytes, counting them into `crc`; the end of
/// the file before that is truncation.
fn take(file: &mut impl Read, crc: &mut crc32fast::Hasher, buffer: &mut [u8]) -> Result<(), BackupError> {
    file.read_exact(buffer).map_err(|err| match err.kind() {
        io::ErrorKind::UnexpectedEof => BackupError::Truncated,
        _ => BackupError::Read(err),
    })?;
    crc.update(buffer);
    Ok(())
}

/// Reads the backup at `path` into a new store with `config` (users that were
/// online held until `hold_until`, as a restart from a checkpoint does) and
/// its durable rows, refusing a file of another slot count than `slots`.
/// Nothing is handed out unless the whole file checked out.
pub(crate) fn read(
    path: &Path,
    config: &StoreConfig,
    slots: u32,
    now: Tick,
    hold_until: Tick,
) -> Result<Restored, BackupError> {
    let mut file = BufReader::with_capacity(FRAME_BYTES, File::open(path)?);
    let mut crc = crc32fast::Hasher::new();
    let mut header = [0u8; 24];
    take(&mut file, &mut crc, &mut header[..8]).map_err(|_| BackupError::NotABackup)?;
    if &header[..8] != MAGIC {
        return Err(BackupError::NotABackup);
    }
    take(&mut file, &mut crc, &mut header[8..])?;
    let word = |at: usize| u32::from_le_bytes(header[at..at + 4].try_into().unwrap_or_default());
    if word(8) != FORMAT {
        return Err(BackupError::Format(word(8)));
    }
    if word(12) != slots {
        return Err(BackupError::Foreign { file: word(12), ours: slots });
    }
    let written_at = u64::from_le_bytes(header[16..24].try_into().unwrap_or_default());
    let mut loader = StoreLoader::new(config.clone(), now, hold_until)?;
    let mut rows = Vec::new();
    let mut frame = vec![0u8; FRAME_BYTES];
    loop {
        let mut head = [0u8; 1];
        let before = crc.clone().finalize();
        take(&mut file, &mut crc, &mut head)?;
        if head[0] == KIND_END {
            let mut stored = [0u8; 4];
            file.read_exact(&mut stored).map_err(|_| BackupError::Truncated)?;
            let stored = u32::from_le_bytes(stored);
            if stored != before {
                return Err(BackupError::Checksum { stored, computed: before });
            }
            if file.read(&mut head)? != 0 {
                return Err(BackupError::Corrupt("bytes after the end record"));
            }
            break;
        }
        let mut length = [0u8; 4];
        take(&mut file, &mut crc, &mut length)?;
        let length = u32::from_le_bytes(length) as usize;
        if length > FRAME_BYTES {
            return Err(BackupError::Corrupt("a frame longer than the format allows"));
        }
        let bytes = &mut frame[..length];
        take(&mut file, &mut crc, bytes)?;
        match head[0] {
            KIND_LEASES => loader.feed(bytes).map_err(BackupError::Leases)?,
            KIND_DURABLE => parse_rows(bytes, &mut rows)?,
            _ => return Err(BackupError::Corrupt("a frame of an unknown kind")),
        }
    }
    let store = loader.finish().map_err(BackupError::Leases)?;
    Ok(Restored { store, written_at, rows })
}

/// Appends the rows of one durable frame (rows never span frames).
fn parse_rows(mut bytes: &[u8], rows: &mut Vec<BackupRow>) -> Result<(), BackupError> {
    const MALFORMED: BackupError = BackupError::Corrupt("a malformed durable row");
    fn field<'a>(bytes: &mut &'a [u8]) -> Result<&'a [u8], BackupError> {
        let (length, rest) = bytes.split_at_checked(4).ok_or(MALFORMED)?;
        let length = u32::from_le_bytes(length.try_into().map_err(|_| MALFORMED)?) as usize;
        let (value, rest) = rest.split_at_checked(length).ok_or(MALFORMED)?;
        *bytes = rest;
        Ok(value)
    }
    let text = |bytes: &[u8]| String::from_utf8(bytes.to_vec()).map_err(|_| MALFORMED);
    while let Some((&table, rest)) = bytes.split_first() {
        bytes = rest;
        let first = text(field(&mut bytes)?)?;
        let second = text(field(&mut bytes)?)?;
        let value = field(&mut bytes)?.to_vec();
        rows.push(BackupRow { table, first, second, value });
    }
    Ok(())
}
