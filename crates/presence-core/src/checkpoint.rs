//! The checkpoint format: every lease, version and stamp clock of a store, as
//! bytes, and back (contract B3, M4).
//!
//! This module only turns a store into bytes and bytes into a store; the
//! server owns the files (writing them atomically, keeping the previous one).
//! A checkpoint is written one shard at a time, each under its own lock only
//! while its records are encoded, so gateways are never stalled for the whole
//! write. Everything is little-endian; strings are length-prefixed; the last
//! bytes are a record count and a CRC-32 of all that precedes them, so a
//! truncated or corrupted file is detected, never half-loaded. A checkpoint is
//! loaded the same way it is written, a piece at a time ([`StoreLoader`]):
//! records go straight into the new store, which is handed out only once the
//! checksum at the end has matched.
//!
//! ```text
//! header   "PRESENCD" | format u32 = 2 | written_at u64 (store ms)
//! clock    0x01 | last stamp u64                     (one per user shard and one per room shard)
//! user     0x02 | id str | version u64 | online u8 | leases u16 | lease*
//! lease    session str | gateway str | generation u64 | last heartbeat u64
//!          | expires_at u64 | closing u8 | metadata u8 | (key str, value str)*
//!          | rooms u16 | membership*                                  (format 2)
//! membership  room str | order u64 | metadata u8 | (key str, value str)*
//! room     0x03 | id str | access u8 (1: public)   (rooms with non-default access; format 2)
//! end      0x00 | records u64 | crc32 u32
//! str      length u16 | UTF-8 bytes
//! ```
//!
//! Versions, generations, membership orders and clock records are stamps
//! (`stamp.rs`), at most `MAX_STAMP`: a file with a larger one is refused.
//!
//! Format 1 is format 2 without memberships and room records; it is still
//! read. Signals are never written (S3): they are gone after a restart.

use std::borrow::Cow;

use thiserror::Error;

use crate::config::{ConfigError, StoreConfig};
use crate::stamp::MAX_STAMP;
use crate::store::Store;
use crate::types::RoomAccess;
use crate::wheel::Tick;

const MAGIC: &[u8; 8] = b"PRESENCD";
const FORMAT: u32 = 2;
/// The first format, before rooms: still read.
const FORMAT_1: u32 = 1;
const TAG_END: u8 = 0;
const TAG_CLOCK: u8 = 1;
const TAG_USER: u8 = 2;
const TAG_ROOM: u8 = 3;
/// How a flag (`online`, `closing`) is stored. The format's own codes, written
/// out rather than taken from `bool as u8`, so that what is on disk is spelled
/// here and nowhere else.
const FLAG_NO: u8 = 0;
const FLAG_YES: u8 = 1;

/// Why a checkpoint cannot be loaded. The store is never built from one that
/// fails any check.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum CheckpointError {
    /// The bytes do not start like a presenced checkpoint.
    #[error("not a presenced checkpoint (bad magic bytes)")]
    NotACheckpoint,
    /// Written by a format this build does not know.
    #[error("checkpoint format {0} is not supported (this build reads formats {FORMAT_1} and {FORMAT})")]
    UnsupportedFormat(u32),
    /// The bytes end before the end record: the write was cut short.
    #[error("checkpoint is truncated at byte {0}")]
    Truncated(usize),
    /// The checksum does not match: the bytes were altered.
    #[error("checkpoint checksum mismatch (stored {stored:#010x}, computed {computed:#010x})")]
    Checksum {
        /// The CRC-32 the file carries.
        stored: u32,
        /// The CRC-32 of the bytes read.
        computed: u32,
    },
    /// A record is malformed.
    #[error("checkpoint is corrupt at byte {offset}: {reason}")]
    Corrupt {
        /// Where the malformed record starts.
        offset: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
}

/// One lease as checkpointed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointLease {
    /// The session id.
    pub session_id: String,
    /// The gateway that registered it.
    pub gateway_id: String,
    /// Its generation, kept across the restart so that renewals carry on.
    pub generation: u64,
    /// Its last write.
    pub last_heartbeat_at: Tick,
    /// Its deadline, in store time (Unix ms in the server).
    pub expires_at: Tick,
    /// Unregistered with linger.
    pub closing: bool,
    /// Its metadata.
    pub metadata: Vec<(String, String)>,
    /// The rooms the session is in, most recently joined first (none in format 1).
    pub rooms: Vec<CheckpointMembership>,
}

/// One session's membership of one room, as checkpointed (R1).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointMembership {
    /// The room.
    pub room_id: String,
    /// The stamp of its join or last update: the most recent session's metadata is shown.
    pub order: u64,
    /// The session's metadata in the room.
    pub metadata: Vec<(String, String)>,
}

/// A room whose access is not the default, as checkpointed (R4).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointRoom {
    /// The room.
    pub room_id: String,
    /// Who may see it.
    pub access: RoomAccess,
}

/// One user as checkpointed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CheckpointUser {
    /// The user id.
    pub user_id: String,
    /// The version of its last flip.
    pub version: u64,
    /// Its state when the checkpoint was written.
    pub online: bool,
    /// Its leases.
    pub leases: Vec<CheckpointLease>,
}

/// A decoded checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// When it was written, in store time.
    pub written_at: Tick,
    /// The greatest stamp any shard had issued: every stamp after a restore is greater.
    pub last_stamp: u64,
    /// Every user with a lease or a version.
    pub users: Vec<CheckpointUser>,
    /// Every room with non-default access.
    pub rooms: Vec<CheckpointRoom>,
}

/// A membership as the writer takes it: room id, order, metadata.
pub(crate) type MembershipOut<'a> = (&'a str, u64, &'a [(String, String)]);

/// Builds a checkpoint's bytes: a header, then records, then the end record.
/// The bytes can be taken out as they are made, so that a large checkpoint is
/// streamed to its file rather than held whole.
#[derive(Debug)]
pub struct CheckpointWriter {
    /// Bytes not yet taken.
    bytes: Vec<u8>,
    records: u64,
    /// CRC of the bytes already taken.
    crc: crc32fast::Hasher,
}

impl CheckpointWriter {
    /// A checkpoint written at `written_at`.
    pub fn new(written_at: Tick) -> Self {
        let mut bytes = Vec::with_capacity(1 << 20);
        bytes.extend_from_slice(MAGIC);
        bytes.extend_from_slice(&FORMAT.to_le_bytes());
        bytes.extend_from_slice(&written_at.to_le_bytes());
        CheckpointWriter { bytes, records: 0, crc: crc32fast::Hasher::new() }
    }

    pub(crate) fn clock(&mut self, last_stamp: u64) {
        self.bytes.push(TAG_CLOCK);
        self.u64(last_stamp);
        self.records += 1;
    }

    pub(crate) fn user(&mut self, user_id: &str, version: u64, online: bool, leases: u16) {
        self.bytes.push(TAG_USER);
        self.str(user_id);
        self.u64(version);
        self.flag(online);
        self.bytes.extend_from_slice(&leases.to_le_bytes());
        self.records += 1;
    }

    #[expect(clippy::too_many_arguments, reason = "one argument per field of the record")]
    pub(crate) fn lease(
        &mut self,
        session_id: &str,
        gateway_id: &str,
        generation: u64,
        last_heartbeat_at: Tick,
        expires_at: Tick,
        closing: bool,
        metadata: &[(String, String)],
        rooms: &[MembershipOut<'_>],
    ) {
        self.str(session_id);
        self.str(gateway_id);
        self.u64(generation);
        self.u64(last_heartbeat_at);
        self.u64(expires_at);
        self.flag(closing);
        self.metadata(metadata);
        let count = u16::try_from(rooms.len()).expect("a session is in far fewer than 65536 rooms");
        self.bytes.extend_from_slice(&count.to_le_bytes());
        for &(room_id, order, metadata) in rooms {
            self.str(room_id);
            self.u64(order);
            self.metadata(metadata);
        }
    }

    pub(crate) fn room(&mut self, room_id: &str, access: RoomAccess) {
        self.bytes.push(TAG_ROOM);
        self.str(room_id);
        self.flag(access == RoomAccess::Public);
        self.records += 1;
    }

    fn metadata(&mut self, metadata: &[(String, String)]) {
        self.bytes.push(u8::try_from(metadata.len()).expect("metadata is bounded well below 256 entries"));
        for (key, value) in metadata {
            self.str(key);
            self.str(value);
        }
    }

    /// Takes the bytes made so far, to write them out.
    pub fn take_chunk(&mut self) -> Vec<u8> {
        self.crc.update(&self.bytes);
        std::mem::take(&mut self.bytes)
    }

    /// Closes the checkpoint and returns its last bytes: the end record and the
    /// CRC of everything, taken chunks included.
    pub fn finish(mut self) -> Vec<u8> {
        self.bytes.push(TAG_END);
        let records = self.records;
        self.u64(records);
        self.crc.update(&self.bytes);
        let checksum = self.crc.finalize();
        self.bytes.extend_from_slice(&checksum.to_le_bytes());
        self.bytes
    }

    fn u64(&mut self, value: u64) {
        self.bytes.extend_from_slice(&value.to_le_bytes());
    }

    fn flag(&mut self, value: bool) {
        self.bytes.push(if value { FLAG_YES } else { FLAG_NO });
    }

    fn str(&mut self, value: &str) {
        let len = u16::try_from(value.len()).expect("ids and metadata are bounded well below 64 KiB");
        self.bytes.extend_from_slice(&len.to_le_bytes());
        self.bytes.extend_from_slice(value.as_bytes());
    }
}

/// The whole checkpoint of `store` taken at `at`, in memory, written shard by
/// shard as the server writes its file (which streams each shard's chunk to
/// disk instead of keeping it).
pub fn encode(store: &Store, at: Tick) -> Vec<u8> {
    let mut writer = CheckpointWriter::new(at);
    let mut bytes = Vec::new();
    for shard in 0..store.shard_count() {
        store.checkpoint_shard(shard, &mut writer);
        bytes.extend(writer.take_chunk());
    }
    bytes.extend(writer.finish());
    bytes
}

/// Decodes and checks a whole checkpoint held in memory. A server loading a
/// file should rather feed it to a [`StoreLoader`] piece by piece, which never
/// holds the file or a decoded copy of it.
pub fn decode(bytes: &[u8]) -> Result<Checkpoint, CheckpointError> {
    let mut decoder = Decoder::default();
    let mut checkpoint = Checkpoint::default();
    decoder.feed(bytes, &mut |item| match item {
        Item::Clock(stamp) => checkpoint.last_stamp = checkpoint.last_stamp.max(stamp),
        Item::User(user) => checkpoint.users.push(user.to_owned()),
        Item::Room(room_id, access) => checkpoint.rooms.push(CheckpointRoom { room_id: room_id.to_owned(), access }),
    })?;
    checkpoint.written_at = decoder.finish()?;
    Ok(checkpoint)
}

/// Builds a store from a checkpoint handed over in pieces, as it is read from
/// its file (B3): each record goes straight into the new store's shards, so a
/// load holds the store, one piece and at most one partly received record,
/// never the whole file or a decoded copy of it.
///
/// The checksum is at the end of the file, so it is known only once the last
/// piece is in: [`StoreLoader::finish`] checks it and the end record, and
/// hands the store out only if they are right. A checkpoint refused anywhere
/// takes the half-built store down with the loader; no caller ever sees it.
pub struct StoreLoader {
    store: Store,
    decoder: Decoder,
    /// The restore's time and the end of its hold (see [`Store::restore`]).
    now: Tick,
    hold_until: Tick,
    /// Users whose OFFLINE is due at the restore (see [`Store::restore_user`]).
    offline_due: Vec<(u32, u32)>,
}

impl std::fmt::Debug for StoreLoader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StoreLoader").field("decoder", &self.decoder).finish_non_exhaustive()
    }
}

impl StoreLoader {
    /// A loader into a new store with `config` whose clock starts at `now`;
    /// users that were online are held online until `hold_until`, as
    /// [`Store::restore`] does.
    pub fn new(config: StoreConfig, now: Tick, hold_until: Tick) -> Result<Self, ConfigError> {
        Ok(StoreLoader {
            store: Store::new(config, now)?,
            decoder: Decoder::default(),
            now,
            hold_until,
            offline_due: Vec::new(),
        })
    }

    /// Takes the next bytes of the checkpoint, of any length, and restores
    /// every record they complete. An error is final: the checkpoint is refused.
    pub fn feed(&mut self, bytes: &[u8]) -> Result<(), CheckpointError> {
        let StoreLoader { store, decoder, now, hold_until, offline_due } = self;
        decoder.feed(bytes, &mut |item| match item {
            Item::Clock(stamp) => store.restore_clock(stamp),
            Item::User(user) => offline_due.extend(store.restore_user(*now, user, *hold_until)),
            Item::Room(room_id, access) => store.restore_room(room_id, access),
        })
    }

    /// When the checkpoint was written (store ms), once its header has been
    /// fed: a restart compares it with what happened since (P7's erasures).
    pub fn written_at(&self) -> Option<Tick> {
        self.decoder.written_at
    }

    /// The restored store, once every byte has been fed and the checkpoint is
    /// whole: its end record is there, counts every record, and the checksum
    /// of everything matches.
    pub fn finish(self) -> Result<Store, CheckpointError> {
        self.decoder.finish()?;
        Ok(self.store.finish_restore(self.now, &self.offline_due))
    }
}

/// One user record, its strings borrowed from the bytes it was read from.
#[derive(Debug)]
pub(crate) struct UserRecord<'a> {
    pub(crate) user_id: &'a str,
    pub(crate) version: u64,
    pub(crate) online: bool,
    pub(crate) leases: Vec<LeaseRecord<'a>>,
}

/// One lease record, borrowed like its [`UserRecord`]. Metadata, which few
/// leases carry, is owned: the store keeps it as owned strings anyway.
#[derive(Debug)]
pub(crate) struct LeaseRecord<'a> {
    pub(crate) session_id: &'a str,
    pub(crate) gateway_id: &'a str,
    pub(crate) generation: u64,
    pub(crate) last_heartbeat_at: Tick,
    pub(crate) expires_at: Tick,
    pub(crate) closing: bool,
    pub(crate) metadata: Cow<'a, [(String, String)]>,
    pub(crate) rooms: Vec<MembershipRecord<'a>>,
}

/// One membership record, borrowed like its [`LeaseRecord`].
#[derive(Debug)]
pub(crate) struct MembershipRecord<'a> {
    pub(crate) room_id: &'a str,
    pub(crate) order: u64,
    pub(crate) metadata: Cow<'a, [(String, String)]>,
}

impl UserRecord<'_> {
    fn to_owned(&self) -> CheckpointUser {
        CheckpointUser {
            user_id: self.user_id.to_owned(),
            version: self.version,
            online: self.online,
            leases: self
                .leases
                .iter()
                .map(|lease| CheckpointLease {
                    session_id: lease.session_id.to_owned(),
                    gateway_id: lease.gateway_id.to_owned(),
                    generation: lease.generation,
                    last_heartbeat_at: lease.last_heartbeat_at,
                    expires_at: lease.expires_at,
                    closing: lease.closing,
                    metadata: lease.metadata.to_vec(),
                    rooms: lease
                        .rooms
                        .iter()
                        .map(|room| CheckpointMembership {
                            room_id: room.room_id.to_owned(),
                            order: room.order,
                            metadata: room.metadata.to_vec(),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

impl CheckpointUser {
    /// The record this user was (or would be) read from.
    pub(crate) fn as_record(&self) -> UserRecord<'_> {
        UserRecord {
            user_id: &self.user_id,
            version: self.version,
            online: self.online,
            leases: self
                .leases
                .iter()
                .map(|lease| LeaseRecord {
                    session_id: &lease.session_id,
                    gateway_id: &lease.gateway_id,
                    generation: lease.generation,
                    last_heartbeat_at: lease.last_heartbeat_at,
                    expires_at: lease.expires_at,
                    closing: lease.closing,
                    metadata: Cow::Borrowed(&lease.metadata),
                    rooms: lease
                        .rooms
                        .iter()
                        .map(|room| MembershipRecord {
                            room_id: &room.room_id,
                            order: room.order,
                            metadata: Cow::Borrowed(&room.metadata),
                        })
                        .collect(),
                })
                .collect(),
        }
    }
}

/// What the decoder hands its caller, record by record.
enum Item<'r, 'a> {
    /// A shard's last stamp.
    Clock(u64),
    User(&'r UserRecord<'a>),
    /// A room with non-default access.
    Room(&'a str, RoomAccess),
}

/// How much of a piece is first added to the bytes of a record the previous
/// piece ended in: records are mostly a few dozen bytes.
const CARRY_STEP: usize = 4_096;

/// The end record, once read; what is still to check about it waits for the
/// caller to say that nothing follows.
#[derive(Debug, Clone, Copy)]
struct End {
    /// Where it starts in the checkpoint.
    offset: usize,
    stored: u32,
    computed: u32,
}

/// Reads a checkpoint from pieces of any length: it reads every record a
/// piece completes, keeps the bytes of the last, incomplete one for the next
/// piece, and keeps the CRC of everything read so far.
#[derive(Debug, Default)]
struct Decoder {
    /// Bytes received that no complete record has taken yet.
    pending: Vec<u8>,
    /// Where `pending` starts in the checkpoint.
    offset: usize,
    /// CRC of the bytes before `offset`.
    crc: crc32fast::Hasher,
    /// From the header, once it is read.
    written_at: Option<Tick>,
    /// The header's format: 1 or 2.
    format: u32,
    /// Records read, to check against the end record's count.
    records: u64,
    end: Option<End>,
}

impl Decoder {
    /// Reads every record that `bytes` completes and hands each to `sink`.
    fn feed(&mut self, bytes: &[u8], sink: &mut dyn FnMut(Item<'_, '_>)) -> Result<(), CheckpointError> {
        let mut start = 0;
        // The last piece ended inside a record: complete it with as little of
        // this piece as it takes (at least as much as is carried, so that a
        // large record is read again only a few times), then read the rest
        // of this piece where it is rather than copying it.
        while !self.pending.is_empty() {
            if start == bytes.len() {
                return Ok(());
            }
            let carried = self.pending.len();
            let end = start + (bytes.len() - start).min(carried.max(CARRY_STEP));
            let mut pending = std::mem::take(&mut self.pending);
            pending.extend_from_slice(&bytes[start..end]);
            let taken = self.read(&pending, sink)?;
            // The carried record ends after what was carried, so it is either
            // still incomplete (nothing taken) or done, with what follows it
            // in `bytes`.
            debug_assert!(taken == 0 || taken > carried);
            if taken == 0 {
                start = end;
            } else {
                start += taken - carried;
                pending.clear();
            }
            self.pending = pending;
        }
        let taken = self.read(&bytes[start..], sink)?;
        self.pending.extend_from_slice(&bytes[start + taken..]);
        Ok(())
    }

    /// Reads the complete records at the start of `bytes` (which start at
    /// `self.offset`); returns how many bytes they took.
    fn read(&mut self, bytes: &[u8], sink: &mut dyn FnMut(Item<'_, '_>)) -> Result<usize, CheckpointError> {
        if let Some(end) = self.end
            && !bytes.is_empty()
        {
            return Err(CheckpointError::Corrupt { offset: end.offset, reason: "record count or length mismatch" });
        }
        let mut reader = Reader { bytes, at: 0, base: self.offset };
        let mut leases = Vec::new();
        let mut taken = 0;
        let result = loop {
            let read = match self.written_at {
                None => self.header(&mut reader),
                Some(_) => self.record(&mut reader, &mut leases, sink),
            };
            match read {
                Ok(true) => taken = reader.at,
                Ok(false) => break Ok(reader.at),
                // Not an error yet: the rest of the record is in the next piece.
                Err(CheckpointError::Truncated(_)) => break Ok(taken),
                Err(err) => break Err(err),
            }
        };
        let taken = result?;
        if self.end.is_none() {
            self.crc.update(&bytes[..taken]);
        }
        self.offset += taken;
        Ok(taken)
    }

    /// Reads the header; true once read (it never stops the reading).
    fn header(&mut self, reader: &mut Reader<'_>) -> Result<bool, CheckpointError> {
        let magic = reader.take(MAGIC.len().min(reader.bytes.len()))?;
        if magic != &MAGIC[..magic.len()] {
            return Err(CheckpointError::NotACheckpoint);
        }
        if magic.len() < MAGIC.len() {
            return Err(CheckpointError::Truncated(reader.base + reader.bytes.len()));
        }
        let format = reader.u32()?;
        if format != FORMAT && format != FORMAT_1 {
            return Err(CheckpointError::UnsupportedFormat(format));
        }
        self.format = format;
        self.written_at = Some(reader.u64()?);
        Ok(true)
    }

    /// Reads one record and hands it to `sink`; returns false after the end
    /// record. `leases` is room for a user's leases, reused from user to user.
    fn record<'a>(
        &mut self,
        reader: &mut Reader<'a>,
        leases: &mut Vec<LeaseRecord<'a>>,
        sink: &mut dyn FnMut(Item<'_, '_>),
    ) -> Result<bool, CheckpointError> {
        let offset = reader.base + reader.at;
        match reader.u8()? {
            TAG_END => {
                let stated = reader.u64()?;
                let checksummed = reader.at;
                let stored = reader.u32()?;
                if stated != self.records {
                    return Err(CheckpointError::Corrupt { offset, reason: "record count or length mismatch" });
                }
                let mut crc = self.crc.clone();
                crc.update(&reader.bytes[..checksummed]);
                self.end = Some(End { offset, stored, computed: crc.finalize() });
                // What follows the end record is an error only if it is there.
                if reader.at < reader.bytes.len() {
                    return Err(CheckpointError::Corrupt { offset, reason: "record count or length mismatch" });
                }
                return Ok(false);
            }
            TAG_CLOCK => sink(Item::Clock(reader.stamp()?)),
            TAG_USER => {
                let user_id = reader.str()?;
                let version = reader.stamp()?;
                let online = reader.bool()?;
                let count = reader.u16()?;
                leases.clear();
                for _ in 0..count {
                    leases.push(LeaseRecord {
                        session_id: reader.str()?,
                        gateway_id: reader.str()?,
                        generation: reader.stamp()?,
                        last_heartbeat_at: reader.u64()?,
                        expires_at: reader.u64()?,
                        closing: reader.bool()?,
                        metadata: reader.metadata()?,
                        rooms: match self.format {
                            FORMAT_1 => Vec::new(),
                            _ => (0..reader.u16()?)
                                .map(|_| {
                                    Ok(MembershipRecord {
                                        room_id: reader.str()?,
                                        order: reader.stamp()?,
                                        metadata: reader.metadata()?,
                                    })
                                })
                                .collect::<Result<Vec<_>, _>>()?,
                        },
                    });
                }
                let user = UserRecord { user_id, version, online, leases: std::mem::take(leases) };
                sink(Item::User(&user));
                *leases = user.leases;
            }
            TAG_ROOM if self.format != FORMAT_1 => {
                let room_id = reader.str()?;
                let access = if reader.bool()? { RoomAccess::Public } else { RoomAccess::Members };
                sink(Item::Room(room_id, access));
            }
            _ => return Err(CheckpointError::Corrupt { offset, reason: "unknown record tag" }),
        }
        self.records += 1;
        Ok(true)
    }

    /// Once every byte was fed: when the checkpoint was written, if it is whole.
    fn finish(self) -> Result<Tick, CheckpointError> {
        let length = self.offset + self.pending.len();
        match (self.written_at, self.end) {
            _ if length < MAGIC.len() => Err(CheckpointError::NotACheckpoint),
            (Some(written_at), Some(end)) if end.stored == end.computed => Ok(written_at),
            // Well formed, but not what was written: the bytes were altered.
            (Some(_), Some(end)) => Err(CheckpointError::Checksum { stored: end.stored, computed: end.computed }),
            _ => Err(CheckpointError::Truncated(length)),
        }
    }
}

/// Reads values from a piece of a checkpoint. Running out of bytes is
/// [`CheckpointError::Truncated`], which the decoder takes as "the rest is in
/// the next piece"; offsets in errors are offsets in the checkpoint.
struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    /// Where `bytes` starts in the checkpoint.
    base: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], CheckpointError> {
        let end = self.at.checked_add(n).filter(|&end| end <= self.bytes.len());
        let end = end.ok_or(CheckpointError::Truncated(self.base + self.bytes.len()))?;
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }

    fn u8(&mut self) -> Result<u8, CheckpointError> {
        Ok(self.take(1)?[0])
    }

    fn bool(&mut self) -> Result<bool, CheckpointError> {
        let offset = self.base + self.at;
        match self.u8()? {
            FLAG_NO => Ok(false),
            FLAG_YES => Ok(true),
            _ => Err(CheckpointError::Corrupt { offset, reason: "a flag is neither 0 nor 1" }),
        }
    }

    fn u16(&mut self) -> Result<u16, CheckpointError> {
        Ok(u16::from_le_bytes(self.take(2)?.try_into().expect("two bytes")))
    }

    fn u32(&mut self) -> Result<u32, CheckpointError> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("four bytes")))
    }

    fn u64(&mut self) -> Result<u64, CheckpointError> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("eight bytes")))
    }

    /// A version, generation, membership order or a shard's last stamp: no
    /// store issues one above [`MAX_STAMP`], and the stamps after a restore
    /// count up from them (M4).
    fn stamp(&mut self) -> Result<u64, CheckpointError> {
        let offset = self.base + self.at;
        match self.u64()? {
            stamp if stamp <= MAX_STAMP => Ok(stamp),
            _ => Err(CheckpointError::Corrupt { offset, reason: "a stamp is beyond any a store issues" }),
        }
    }

    /// Metadata entries: a count, then each key and value.
    fn metadata(&mut self) -> Result<Cow<'a, [(String, String)]>, CheckpointError> {
        Ok(match self.u8()? {
            // Most leases: no iterator, no allocation.
            0 => Cow::Owned(Vec::new()),
            entries => Cow::Owned(
                (0..entries)
                    .map(|_| Ok((self.str()?.to_owned(), self.str()?.to_owned())))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
        })
    }

    fn str(&mut self) -> Result<&'a str, CheckpointError> {
        let offset = self.base + self.at;
        let len = usize::from(self.u16()?);
        let bytes = self.take(len)?;
        std::str::from_utf8(bytes).map_err(|_| CheckpointError::Corrupt { offset, reason: "a string is not UTF-8" })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Changes, Registration, State, Store, StoreConfig};

    const T0: Tick = 1_700_000_000_000;

    fn stamp_at(at: Tick) -> u64 {
        at << crate::stamp::COUNTER_BITS
    }

    fn config() -> StoreConfig {
        StoreConfig { shards: 4, min_renew_interval_ms: 0, ..StoreConfig::default() }
    }

    /// A store with online, offline and multi-device users, a lingering lease and metadata.
    fn populated() -> (Store, Vec<u64>) {
        let store = Store::new(config(), T0).unwrap();
        let mut changes = Changes::default();
        let metadata = vec![("device".to_string(), "phone".to_string())];
        let mut generations = Vec::new();
        for user in 0..50 {
            for session in 0..(user % 3 + 1) {
                let (user_id, session_id) = (format!("u{user}"), format!("s{session}"));
                let registration = Registration {
                    user_id: &user_id,
                    session_id: &session_id,
                    gateway_id: if user % 2 == 0 { "gw-a" } else { "gw-b" },
                    ttl_ms: 45_000,
                    metadata: if session == 0 { &metadata } else { &[] },
                };
                generations.push(store.register(T0, &registration, &mut changes).unwrap().generation);
            }
        }
        store.revoke(T0 + 1, "u7", None, &mut changes).unwrap();
        store.unregister(T0 + 1, "u8", "s0", generations[12], 5_000, &mut changes).unwrap();
        (store, generations)
    }

    fn view(store: &Store, now: Tick, users: usize) -> Vec<(crate::Presence, Vec<crate::LeaseView>)> {
        let mut changes = Changes::default();
        (0..users)
            .map(|user| {
                let id = format!("u{user}");
                let presence = store.snapshot(now, &[&id], &mut changes).unwrap()[0];
                (presence, store.leases(now, &id, &mut changes).unwrap())
            })
            .collect()
    }

    #[test]
    fn b3_a_restored_store_answers_exactly_as_the_checkpointed_one() {
        let (store, _) = populated();
        let bytes = encode(&store, T0 + 2);
        let checkpoint = decode(&bytes).unwrap();
        assert_eq!(checkpoint.written_at, T0 + 2);
        let restored = Store::restore(config(), T0 + 3, &checkpoint, T0 + 3).unwrap();
        assert_eq!(view(&restored, T0 + 3, 50), view(&store, T0 + 3, 50));
        assert_eq!(restored.stats().sessions, store.stats().sessions);
        assert_eq!(restored.stats().online_users, store.stats().online_users);
    }

    #[test]
    fn b3_a_shard_written_in_several_lock_holds_holds_every_user_once() {
        let config = StoreConfig { shards: 1, ..config() };
        let store = Store::new(config.clone(), T0).unwrap();
        let mut changes = Changes::default();
        let users = crate::store::CHECKPOINT_USERS_PER_LOCK * 2 + 7;
        for user in 0..users {
            let id = format!("u{user}");
            let registration =
                Registration { user_id: &id, session_id: "s", gateway_id: "g", ttl_ms: 45_000, metadata: &[] };
            store.register(T0, &registration, &mut changes).unwrap();
        }
        let checkpoint = decode(&encode(&store, T0)).unwrap();
        assert_eq!(checkpoint.users.len(), users);
        let mut ids: Vec<&str> = checkpoint.users.iter().map(|user| user.user_id.as_str()).collect();
        ids.sort_unstable();
        ids.dedup();
        assert_eq!(ids.len(), users);
        let restored = Store::restore(config, T0, &checkpoint, T0).unwrap();
        assert_eq!(view(&restored, T0, users), view(&store, T0, users));
    }

    #[test]
    fn b3_gateways_carry_on_with_their_generations_after_a_restore() {
        let (store, generations) = populated();
        let checkpoint = decode(&encode(&store, T0 + 2)).unwrap();
        let restored = Store::restore(config(), T0 + 10_000, &checkpoint, T0 + 10_000).unwrap();
        let mut changes = Changes::default();
        let renewed = restored.renew(T0 + 10_000, "u0", "s0", generations[0], 45_000, &mut changes).unwrap();
        assert_eq!(renewed.expires_at, T0 + 55_000);
        assert!(changes.users.is_empty(), "a renewing gateway sees nothing happen: {changes:?}");
    }

    #[test]
    fn m4_stamps_after_a_restore_exceed_every_stamp_before_it_even_with_a_clock_behind() {
        let (store, generations) = populated();
        let mut changes = Changes::default();
        // Many stamps in one millisecond push the clock's counter past its wall-clock floor.
        for _ in 0..100 {
            let g = store
                .register(
                    T0 + 1,
                    &Registration { user_id: "hot", session_id: "s", gateway_id: "g", ttl_ms: 45_000, metadata: &[] },
                    &mut changes,
                )
                .unwrap();
            store.unregister(T0 + 1, "hot", "s", g.generation, 0, &mut changes).unwrap();
        }
        let highest = changes.users.iter().map(|c| c.presence.version).chain(generations).max().unwrap();
        let checkpoint = decode(&encode(&store, T0 + 1)).unwrap();
        // The restored clock reads *earlier* than the checkpoint (a clock that stepped back).
        let restored = Store::restore(config(), T0, &checkpoint, T0).unwrap();
        let mut after = Changes::default();
        let registration =
            Registration { user_id: "hot", session_id: "s", gateway_id: "g", ttl_ms: 45_000, metadata: &[] };
        let registered = restored.register(T0, &registration, &mut after).unwrap();
        assert!(registered.generation > highest);
        assert!(after.users.iter().all(|change| change.presence.version > highest));
    }

    #[test]
    fn m4_a_checkpoint_with_a_stamp_beyond_any_a_store_issues_is_refused() {
        // Found by the checkpoint fuzz target: a clock record of u64::MAX made
        // the next stamp overflow (a panic in a debug build, a stamp of 0,
        // going back, in a release one).
        let beyond = [u64::MAX, crate::stamp::MAX_STAMP + 1];
        let records: [fn(&mut CheckpointWriter, u64); 4] = [
            |writer, stamp| writer.clock(stamp),
            |writer, stamp| writer.user("u", stamp, false, 0),
            |writer, stamp| {
                writer.user("u", 1, true, 1);
                writer.lease("s", "g", stamp, T0, T0 + 45_000, false, &[], &[]);
            },
            |writer, stamp| {
                writer.user("u", 1, true, 1);
                writer.lease("s", "g", 1, T0, T0 + 45_000, false, &[], &[("room", stamp, &[])]);
            },
        ];
        for (kind, record) in records.iter().enumerate() {
            for stamp in beyond {
                let mut writer = CheckpointWriter::new(T0);
                record(&mut writer, stamp);
                let refused = load(&writer.finish(), 7, T0, T0).map(|_| ());
                let expected = "a stamp is beyond any a store issues";
                assert!(
                    matches!(refused, Err(CheckpointError::Corrupt { reason, .. }) if reason == expected),
                    "record {kind}, stamp {stamp}: {refused:?}"
                );
            }
        }
    }

    #[test]
    fn m4_stamps_after_a_restore_exceed_the_restored_ones_even_where_the_clock_records_say_less() {
        // A damaged file whose clock records lag its own versions, generations and orders.
        let high = stamp_at(T0 + 60_000);
        let mut writer = CheckpointWriter::new(T0);
        writer.clock(stamp_at(T0));
        writer.user("versioned", high, false, 0);
        writer.user("generation", 1, true, 1);
        writer.lease("s", "g", high + 1, T0, T0 + 45_000, false, &[], &[]);
        writer.user("ordered", 1, true, 1);
        writer.lease("s", "g", 1, T0, T0 + 45_000, false, &[], &[("room", high + 2, &[])]);
        let restored = load(&writer.finish(), 1 << 20, T0, T0).unwrap();
        // Each user's shard counts on from that user's highest stamp.
        for (user_id, restored_stamp) in [("versioned", high), ("generation", high + 1), ("ordered", high + 2)] {
            let mut changes = Changes::default();
            let registration =
                Registration { user_id, session_id: "new", gateway_id: "g", ttl_ms: 45_000, metadata: &[] };
            let registered = restored.register(T0, &registration, &mut changes).unwrap();
            assert!(
                registered.generation > restored_stamp,
                "{user_id}: {} after {restored_stamp}",
                registered.generation
            );
            if user_id == "versioned" {
                // Offline to online: a new version, above the restored one.
                assert!(registered.presence.version > high, "{registered:?}");
            }
        }
    }

    #[test]
    fn b3_online_users_are_held_until_the_grace_ends_and_then_go_offline_normally() {
        let store = Store::new(config(), T0).unwrap();
        let mut changes = Changes::default();
        let registration =
            |user, ttl_ms| Registration { user_id: user, session_id: "s", gateway_id: "g", ttl_ms, metadata: &[] };
        let kept = store.register(T0, &registration("kept", 10_000), &mut changes).unwrap();
        store.register(T0, &registration("silent", 10_000), &mut changes).unwrap();
        let checkpoint = decode(&encode(&store, T0)).unwrap();
        // Down for 20 s: both leases ran out meanwhile. Grace for 45 s after the start.
        let start = T0 + 20_000;
        let restored = Store::restore(config(), start, &checkpoint, start + 45_000).unwrap();
        let mut changes = Changes::default();
        assert!(!restored.expire(start, 1_000, &mut changes));
        assert!(changes.users.is_empty(), "nobody flips at start: {changes:?}");
        // The lease itself is gone (its deadline passed): the gateway re-registers, no flip.
        let refused = restored.renew(start, "kept", "s", kept.generation, 0, &mut changes);
        assert!(matches!(refused, Err(crate::LeaseError::NotFound { .. })), "{refused:?}");
        let again = restored.register(start, &registration("kept", 60_000), &mut changes).unwrap();
        assert!(!again.changed);
        assert!(changes.users.is_empty());
        // At the end of the grace, the user nobody re-registered goes OFFLINE, once.
        while restored.expire(start + 45_000, 1_000, &mut changes) {}
        assert_eq!(changes.users.len(), 1);
        assert_eq!((changes.users[0].user_id.as_str(), changes.users[0].presence.state), ("silent", State::Offline));
        assert!(restored.leases(start, "kept", &mut changes).unwrap().iter().all(|l| !l.session_id.is_empty()));
    }

    /// A user online at the checkpoint, restored with its session alive, and
    /// held for 45 s after the start.
    fn restored_with_a_live_session_and_a_hold() -> (Store, u64, Tick) {
        let store = Store::new(config(), T0).unwrap();
        let registration =
            Registration { user_id: "u", session_id: "s", gateway_id: "g", ttl_ms: 60_000, metadata: &[] };
        let registered = store.register(T0, &registration, &mut Changes::default()).unwrap();
        let checkpoint = decode(&encode(&store, T0)).unwrap();
        let start = T0 + 1_000;
        (Store::restore(config(), start, &checkpoint, start + 45_000).unwrap(), registered.generation, start)
    }

    /// A restart hold is no session: a restored store counts the sessions
    /// it lists, as the store before counted them.
    #[test]
    fn b3_a_restored_store_counts_its_sessions_and_not_its_holds() {
        let (store, _, start) = restored_with_a_live_session_and_a_hold();
        assert_eq!(store.leases(start, "u", &mut Changes::default()).unwrap().len(), 1);
        assert_eq!(store.stats().sessions, 1, "the hold beside the session is not counted");
        let mut changes = Changes::default();
        store.revoke(start, "u", Some("s"), &mut changes).unwrap();
        assert_eq!(store.stats().sessions, 0);
    }

    #[test]
    fn b3_an_explicit_close_of_the_last_session_ends_the_hold_at_once() {
        let (store, generation, start) = restored_with_a_live_session_and_a_hold();
        let mut changes = Changes::default();
        let closed = store.unregister(start + 10, "u", "s", generation, 0, &mut changes).unwrap();
        assert!(closed.changed, "the gateway closed the user's last session: OFFLINE now, not at the grace's end");
        assert_eq!((closed.presence.state, changes.users.len()), (State::Offline, 1));
        while store.expire(start + 45_000, 1_000, &mut changes) {}
        assert_eq!(changes.users.len(), 1, "nothing more at the end of the grace: {changes:?}");

        let (store, _, start) = restored_with_a_live_session_and_a_hold();
        let revoked = store.revoke(start + 10, "u", Some("s"), &mut Changes::default()).unwrap();
        assert!(revoked.changed, "revoking the last session by id flips too");
        let (store, _, start) = restored_with_a_live_session_and_a_hold();
        let revoked = store.revoke(start + 10, "u", None, &mut Changes::default()).unwrap();
        assert_eq!((revoked.count, revoked.changed), (1, true), "the hold is not a session: not counted");
    }

    #[test]
    fn b3_a_lingering_close_of_the_last_session_ends_with_its_linger_not_the_grace() {
        let (store, generation, start) = restored_with_a_live_session_and_a_hold();
        let mut changes = Changes::default();
        let closing = store.unregister(start + 10, "u", "s", generation, 2_000, &mut changes).unwrap();
        assert!(!closing.changed && changes.users.is_empty(), "lingering: still online");
        while store.expire(start + 2_009, 1_000, &mut changes) {}
        assert!(changes.users.is_empty(), "not before the linger ends: {changes:?}");
        while store.expire(start + 2_010, 1_000, &mut changes) {}
        assert_eq!(changes.users.len(), 1);
        assert_eq!(changes.users[0].presence.state, State::Offline);
    }

    #[test]
    fn b3_a_restart_during_a_restart_hold_keeps_holding_until_the_same_deadline() {
        let store = Store::new(config(), T0).unwrap();
        let mut changes = Changes::default();
        let registration =
            Registration { user_id: "held", session_id: "s", gateway_id: "g", ttl_ms: 10_000, metadata: &[] };
        store.register(T0, &registration, &mut changes).unwrap();
        let first = decode(&encode(&store, T0)).unwrap();
        // Down for 20 s (the lease ran out meanwhile), then held until T0 + 65 s.
        let restored = Store::restore(config(), T0 + 20_000, &first, T0 + 65_000).unwrap();
        let second = decode(&encode(&restored, T0 + 30_000)).unwrap();
        // Restarted again, this time with no grace of its own: the first hold still holds.
        let again = Store::restore(config(), T0 + 40_000, &second, T0 + 40_000).unwrap();
        let mut changes = Changes::default();
        while again.expire(T0 + 64_999, 1_000, &mut changes) {}
        assert!(changes.users.is_empty(), "nobody flips before the first hold's deadline: {changes:?}");
        let presence = again.snapshot(T0 + 64_999, &["held"], &mut changes).unwrap()[0];
        assert_eq!(presence.state, State::Online);
        assert!(again.leases(T0 + 64_999, "held", &mut changes).unwrap().is_empty(), "a hold is no session");
        while again.expire(T0 + 65_000, 1_000, &mut changes) {}
        assert_eq!(changes.users.len(), 1);
        assert_eq!((changes.users[0].user_id.as_str(), changes.users[0].presence.state), ("held", State::Offline));
    }

    #[test]
    fn l4_a_hold_after_a_stall_keeps_online_users_online_until_it_ends_and_never_past_a_close() {
        let store = Store::new(config(), T0).unwrap();
        let mut changes = Changes::default();
        let mut generations = Vec::new();
        for (user, ttl_ms) in [("reconnects", 1_000), ("silent", 1_000), ("closes", 10_000), ("lingers", 1_000)] {
            let registration = Registration { user_id: user, session_id: "s", gateway_id: "g", ttl_ms, metadata: &[] };
            generations.push(store.register(T0, &registration, &mut changes).unwrap().generation);
        }
        let closed = store.unregister(T0 + 1, "lingers", "s", generations[3], 900, &mut changes).unwrap();
        assert!(!closed.changed);
        changes.users.clear();
        // The service ran again at T0 + 500 after a stall: everyone with an open session is held.
        assert_eq!(store.hold_online_users(T0 + 500, T0 + 3_000), 3, "not the lingering user, whose session is closed");
        assert_eq!(store.hold_online_users(T0 + 501, T0 + 3_000), 0, "held already");
        while store.expire(T0 + 2_000, 1_000, &mut changes) {}
        let offline: Vec<&str> = changes.users.iter().map(|c| c.user_id.as_str()).collect();
        assert_eq!(offline, ["lingers"], "only the closed session ends on time");
        changes.users.clear();
        // The gateway of `reconnects` finds its lease gone and registers again: no flip.
        let renewal = store.renew(T0 + 2_000, "reconnects", "s", generations[0], 0, &mut changes);
        assert!(matches!(renewal, Err(crate::LeaseError::NotFound { .. })), "{renewal:?}");
        let registration =
            Registration { user_id: "reconnects", session_id: "s", gateway_id: "g", ttl_ms: 10_000, metadata: &[] };
        assert!(!store.register(T0 + 2_000, &registration, &mut changes).unwrap().changed);
        // `closes` closes its last session, still alive: OFFLINE at once, not at the hold's end.
        let closed = store.unregister(T0 + 2_100, "closes", "s", generations[2], 0, &mut changes).unwrap();
        assert!(closed.changed && closed.presence.state == State::Offline);
        while store.expire(T0 + 2_999, 1_000, &mut changes) {}
        assert_eq!(changes.users.len(), 1, "nothing else before the hold ends: {changes:?}");
        // `silent` is renewed by nobody: OFFLINE when the hold ends, once.
        while store.expire(T0 + 3_000, 1_000, &mut changes) {}
        let flips: Vec<(&str, State)> = changes.users.iter().map(|c| (c.user_id.as_str(), c.presence.state)).collect();
        assert_eq!(flips, [("closes", State::Offline), ("silent", State::Offline)]);
        assert_eq!(store.snapshot(T0 + 3_000, &["reconnects"], &mut changes).unwrap()[0].state, State::Online);
    }

    /// Feeds `bytes` to a loader `piece` bytes at a time.
    fn load(bytes: &[u8], piece: usize, now: Tick, hold_until: Tick) -> Result<Store, CheckpointError> {
        let mut loader = StoreLoader::new(config(), now, hold_until).unwrap();
        for chunk in bytes.chunks(piece.max(1)) {
            loader.feed(chunk)?;
        }
        loader.finish()
    }

    #[test]
    fn b3_a_checkpoint_loaded_in_pieces_of_any_size_restores_what_decoding_it_whole_does() {
        let (store, _) = populated();
        let bytes = encode(&store, T0 + 2);
        let whole = Store::restore(config(), T0 + 3, &decode(&bytes).unwrap(), T0 + 30_000).unwrap();
        // Pieces that end inside the header, inside strings, inside numbers and between records.
        for piece in [1, 2, 3, 7, 19, 20, 21, 64, 1_000, bytes.len()] {
            let loaded = load(&bytes, piece, T0 + 3, T0 + 30_000).unwrap();
            assert_eq!(view(&loaded, T0 + 3, 50), view(&whole, T0 + 3, 50), "pieces of {piece} bytes");
            assert_eq!(loaded.stats(), whole.stats(), "pieces of {piece} bytes");
            // The holds are restored too: nobody flips before the grace ends.
            let mut changes = Changes::default();
            while loaded.expire(T0 + 29_999, 1_000, &mut changes) {}
            assert!(changes.users.iter().all(|change| change.user_id == "u8"), "only the lingering user: {changes:?}");
        }
        // A checkpoint the loader writes out again is the same checkpoint.
        let loaded = load(&bytes, 4_096, T0 + 3, T0 + 30_000).unwrap();
        assert_eq!(encode(&loaded, T0 + 4), encode(&whole, T0 + 4));
    }

    #[test]
    fn b3_a_record_larger_than_a_piece_is_carried_across_pieces() {
        // One user with 300 sessions with metadata: a record of about 40 KB,
        // which pieces of 1,000 or 5,000 bytes cut many times.
        let store = Store::new(config(), T0).unwrap();
        let metadata = vec![("device".to_string(), "x".repeat(64))];
        for session in 0..300 {
            let session_id = format!("s{session}");
            let registration = Registration {
                user_id: "big",
                session_id: &session_id,
                gateway_id: "g",
                ttl_ms: 45_000,
                metadata: &metadata,
            };
            store.register(T0, &registration, &mut Changes::default()).unwrap();
        }
        let bytes = encode(&store, T0);
        assert!(bytes.len() > 30_000);
        let leases = |store: &Store| store.leases(T0 + 1, "big", &mut Changes::default()).unwrap();
        for piece in [1_000, 4_096, 5_000, 40_000] {
            let loaded = load(&bytes, piece, T0 + 1, T0 + 1).unwrap();
            assert_eq!(leases(&loaded), leases(&store), "pieces of {piece} bytes");
        }
    }

    #[test]
    fn b3_the_loader_refuses_every_truncated_altered_or_extended_checkpoint_and_hands_out_no_store() {
        let (store, _) = populated();
        let bytes = encode(&store, T0 + 2);
        for cut in [0, 5, 8, 20, 21, bytes.len() / 2, bytes.len() - 5, bytes.len() - 1] {
            for piece in [1, 13, bytes.len()] {
                let result = load(&bytes[..cut], piece, T0 + 3, T0 + 3);
                assert_eq!(result.err(), decode(&bytes[..cut]).err(), "cut at {cut}, pieces of {piece}");
            }
        }
        for flip in [12, 40, bytes.len() / 3, bytes.len() / 2, bytes.len() - 10, bytes.len() - 2] {
            let mut altered = bytes.clone();
            altered[flip] ^= 0x20;
            for piece in [1, 13, bytes.len()] {
                let result = load(&altered, piece, T0 + 3, T0 + 3);
                assert!(result.is_err(), "a flipped bit at {flip} must be caught (pieces of {piece})");
                assert_eq!(result.err(), decode(&altered).err(), "the same refusal as decoding, bit {flip}");
            }
        }
        // Bytes after the end record.
        let extended = [&bytes[..], &[0]].concat();
        let trailing =
            Err(CheckpointError::Corrupt { offset: bytes.len() - 13, reason: "record count or length mismatch" });
        assert_eq!(decode(&extended).map(|_| ()), trailing);
        for piece in [1, 13, extended.len()] {
            assert_eq!(load(&extended, piece, T0 + 3, T0 + 3).map(|_| ()), trailing, "pieces of {piece}");
        }
        let mut future = bytes.clone();
        future[8] = 9;
        assert_eq!(load(&future, 1, T0, T0).err(), Some(CheckpointError::UnsupportedFormat(9)));
        assert_eq!(load(b"PRESENCX", 3, T0, T0).err(), Some(CheckpointError::NotACheckpoint));
    }

    #[test]
    fn m4_a_user_flipped_offline_by_a_restore_gets_a_version_above_every_shards_clock() {
        // Online at the checkpoint with no lease at all, and no grace to hold
        // it: it goes OFFLINE at the restore, with a new version. The clock
        // of a shard written after it is far ahead: the version must be above
        // it too, though that clock is read only after the user.
        let mut writer = CheckpointWriter::new(T0);
        writer.clock(stamp_at(T0));
        writer.user("u", stamp_at(T0), true, 0);
        let ahead = stamp_at(T0 + 1_000_000);
        writer.clock(ahead);
        let bytes = [writer.take_chunk(), writer.finish()].concat();
        for restored in [
            load(&bytes, 1, T0 + 1, T0 + 1).unwrap(),
            Store::restore(config(), T0 + 1, &decode(&bytes).unwrap(), T0 + 1).unwrap(),
        ] {
            let presence = restored.snapshot(T0 + 1, &["u"], &mut Changes::default()).unwrap()[0];
            assert_eq!(presence.state, State::Offline);
            assert!(presence.version > ahead, "{} is not above {ahead}", presence.version);
        }
    }

    #[test]
    fn b3_truncated_and_corrupted_checkpoints_are_refused() {
        let (store, _) = populated();
        let bytes = encode(&store, T0 + 2);
        for cut in [0, 5, 8, 20, bytes.len() / 2, bytes.len() - 5, bytes.len() - 1] {
            let result = decode(&bytes[..cut]);
            assert!(
                matches!(result, Err(CheckpointError::Truncated(_) | CheckpointError::NotACheckpoint)),
                "cut at {cut}: {result:?}"
            );
        }
        for flip in [12, 40, bytes.len() / 3, bytes.len() - 10] {
            let mut altered = bytes.clone();
            altered[flip] ^= 0x20;
            let result = decode(&altered);
            assert!(result.is_err(), "a flipped bit at {flip} must be caught");
        }
        let mut future = bytes.clone();
        future[8] = 9;
        assert_eq!(decode(&future), Err(CheckpointError::UnsupportedFormat(9)));
    }
}
