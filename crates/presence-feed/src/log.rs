//! The log: frames in position order, retained by age and bytes, read from
//! a cursor while one writer appends.
//!
//! In memory the log is a tail of frames packed in blocks (`tail.rs`), so
//! that what retention counts, the blocks, is what the frames take. On disk
//! it is a directory of segment files (`segment.rs`) and the same tail
//! holding the newest frames, so that consumers keeping up never read the
//! disk. A batch is visible to
//! readers only once it is written and synced (group commit: one `fdatasync`
//! per batch), so nothing a consumer was sent can be lost by a crash.
//!
//! Besides the segments the directory holds `trimmed` (the cursor through
//! which retention removed frames, so that a cursor before it is refused
//! after a restart as before it) and, between an orderly close and the next
//! open, `clean` (the log's last position): its absence at open means the
//! process that wrote the log did not close it, and the server marks a gap.

use std::collections::VecDeque;
use std::fs;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use parking_lot::{Mutex, RwLock};

use crate::Cursor;
use crate::frame::{Frame, FrameError, MAX_FRAME};
use crate::segment::{self, Segment};
use crate::tail::Tail;

/// How much of the feed is kept (F2).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retention {
    /// Frames older than this (by their store time) are removed.
    pub max_age_ms: u64,
    /// At most this many bytes: in memory, everything the kept frames take
    /// (the blocks they are packed in, whole); on disk, the segment files.
    pub max_bytes: u64,
}

/// The size of the blocks frames are packed into in memory, for a log that
/// keeps `cap` bytes there: a 64th of it, within 4 KiB and 64 KiB, and at
/// most a quarter of it (a frame larger than a block gets one of its own).
/// Retention lets go of a block at a time. Under the allocator's threshold
/// for a mapping of their own, the blocks come from its heap, which reuses
/// what retention let go of.
fn block_bytes(cap: u64) -> usize {
    (cap / 64).clamp(4 << 10, 64 << 10).min((cap / 4).max(256)) as usize
}

/// Frames newer than the oldest a disk log keeps in memory: what consumers
/// that keep up read.
const TAIL_BYTES_ON_DISK: u64 = 32 << 20;
/// How much of a segment a read of some slots' frames takes at a time.
const SLOT_READ_BYTES: usize = 256 << 10;
/// The largest segment file; byte retention removes a segment at a time.
const MAX_SEGMENT_BYTES: u64 = 16 << 20;
const MIN_SEGMENT_BYTES: u64 = 64 << 10;
const TRIMMED: &str = "trimmed";
const CLEAN: &str = "clean";

/// A cursor before what the log still holds (F2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the cursor is before the oldest change the feed still holds")]
pub struct OutOfRange {
    /// The cursor that resumes at the oldest change the log holds.
    pub oldest: Cursor,
}

/// What a read found.
#[derive(Debug, Default)]
pub struct Read {
    /// Frames after the cursor, in order.
    pub frames: Vec<Frame>,
    /// The log is complete up to here: no frame at or before it will be
    /// appended. A reader that got every frame up to it may store it.
    pub end: Cursor,
}

/// What opening a log on disk found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recovery {
    /// Whether the process that wrote it closed it.
    pub clean: bool,
    /// The last frame's position, or through which the log was complete (0: empty).
    pub last_position: u64,
    /// Frames found in the newest segment (the whole log's in memory).
    /// Older segments are read on a thread after the open returns: a read
    /// that needs them waits for it.
    pub frames: u64,
    /// What was damaged and cut off (a write torn by a crash), by file.
    pub repairs: Vec<String>,
}

#[derive(Debug)]
struct State {
    /// The newest frames; every frame after `tail_from` is here.
    tail: Tail,
    tail_from: Cursor,
    /// On disk: the segments, oldest first; the last one takes appends.
    segments: VecDeque<Segment>,
    /// Frames at or before it are gone.
    trimmed: Cursor,
    /// Complete through here.
    end: Cursor,
    /// The batch being written and synced, not yet readable by streams:
    /// only a move reads it ([`FeedLog::read_slots_unsynced`]).
    writing: Vec<Frame>,
    /// Where the log is complete once that batch is synced.
    writing_end: Cursor,
}

/// The feed's log (see the module).
#[derive(Debug)]
pub struct FeedLog {
    dir: Option<PathBuf>,
    retention: Retention,
    state: RwLock<State>,
    /// One writer at a time; readers never take it.
    writer: Mutex<()>,
    /// The segments before the newest, while a thread reads them at open.
    older: Mutex<Older>,
}

/// The older segments of a log on disk (see [`FeedLog::open`]).
#[derive(Debug)]
enum Older {
    /// Read and in the log's segments (or there were none).
    Settled,
    /// Being read: the thread's answer.
    Reading(std::thread::JoinHandle<io::Result<Found>>),
    /// Could not be read: every read that needs them fails saying why.
    Failed(String),
}

/// What reading the older segments found, oldest first.
#[derive(Debug)]
struct Found {
    segments: Vec<Segment>,
}

/// Reads the segments starting at `firsts` (ascending), as
/// [`FeedLog::open`] reads the newest: each frame checked, a damaged end
/// cut off, an empty file removed.
fn read_older(dir: &Path, firsts: &[u64], after: u64) -> io::Result<Found> {
    let mut segments = Vec::new();
    let mut last = after;
    for &first in firsts {
        let path = Segment::path_for(dir, first);
        let (found, repair) = Segment::recover(&path, last)?;
        if let Some(repair) = repair {
            // Only a crash's torn write is expected, and only in the newest segment.
            tracing::warn!(damage = describe(&path, &repair), "the change feed's older segment was damaged and cut");
        }
        if found.is_empty() {
            fs::remove_file(&path)?;
            continue;
        }
        last = found.last;
        segments.push(found);
    }
    Ok(Found { segments })
}

fn describe(path: &Path, repair: &segment::Repair) -> String {
    format!("{}: {} bytes cut off at offset {} ({})", path.display(), repair.cut, repair.offset, repair.why)
}

impl FeedLog {
    /// A log in memory only, whose frames come after `start`: a cursor
    /// before it (of an earlier process, whose log went with it) is out of
    /// range.
    pub fn in_memory(retention: Retention, start: Cursor) -> FeedLog {
        FeedLog {
            dir: None,
            retention,
            state: RwLock::new(State {
                tail: Tail::new(block_bytes(retention.max_bytes)),
                tail_from: start,
                segments: VecDeque::new(),
                trimmed: start,
                end: start,
                writing: Vec::new(),
                writing_end: start,
            }),
            writer: Mutex::new(()),
            older: Mutex::new(Older::Settled),
        }
    }

    /// Opens (or creates) the log in `dir`, checking every frame and cutting
    /// off a tail that a crash left half written.
    pub fn open(dir: &Path, retention: Retention) -> io::Result<(FeedLog, Recovery)> {
        fs::create_dir_all(dir)?;
        let clean_path = dir.join(CLEAN);
        let clean = clean_path.exists();
        let trimmed = match fs::read_to_string(dir.join(TRIMMED)) {
            Ok(text) => parse_cursor(&text).ok_or_else(|| {
                io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{}: not a position and a slot", dir.join(TRIMMED).display()),
                )
            })?,
            Err(error) if error.kind() == io::ErrorKind::NotFound => Cursor::START,
            Err(error) => return Err(error),
        };
        let mut firsts: Vec<u64> = Vec::new();
        for entry in fs::read_dir(dir)? {
            let entry = entry?;
            if let Some(first) = entry.file_name().to_str().and_then(segment::first_of) {
                firsts.push(first);
            }
        }
        firsts.sort_unstable();
        // The newest segment that holds a frame is read now: the log's end
        // is there, and a write a crash tore can only be there. The older
        // ones are read on a thread of their own (`Older`), so that a large
        // log does not hold up the start; a read that needs them waits.
        let mut segments = VecDeque::new();
        let mut repairs = Vec::new();
        let mut last = trimmed.position;
        let mut end = trimmed;
        let mut frames = 0;
        while let Some(first) = firsts.pop() {
            let path = Segment::path_for(dir, first);
            let (found, repair) = Segment::recover(&path, first.saturating_sub(1).max(trimmed.position))?;
            if let Some(repair) = repair {
                repairs.push(describe(&path, &repair));
            }
            if found.is_empty() {
                fs::remove_file(&path)?;
                continue;
            }
            last = found.last;
            end = found.last_cursor;
            frames = found.frames;
            segments.push_back(found);
            break;
        }
        let older = match firsts.is_empty() {
            true => Older::Settled,
            false => {
                let (dir, after) = (dir.to_owned(), trimmed.position);
                let reading = std::thread::Builder::new()
                    .name("feed-older-segments".to_owned())
                    .spawn(move || read_older(&dir, &firsts, after))?;
                Older::Reading(reading)
            }
        };
        if clean {
            // The end an orderly close wrote may be past the last frame (a
            // batch with no frame moves it): consumers were handed cursors
            // up to it (progress), which must still be in range.
            let closed_at = fs::read_to_string(&clean_path)?.trim().parse::<u64>().map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidData, format!("{}: not a position", clean_path.display()))
            })?;
            if closed_at > last {
                last = closed_at;
                end = Cursor::through(closed_at);
            }
            fs::remove_file(&clean_path)?;
        }
        sync_dir(dir)?;
        let recovery = Recovery { clean: clean && repairs.is_empty(), last_position: last, frames, repairs };
        let log = FeedLog {
            dir: Some(dir.to_owned()),
            retention,
            state: RwLock::new(State {
                tail: Tail::new(block_bytes(TAIL_BYTES_ON_DISK.min(retention.max_bytes))),
                tail_from: end,
                segments,
                trimmed,
                end,
                writing: Vec::new(),
                writing_end: end,
            }),
            writer: Mutex::new(()),
            older: Mutex::new(older),
        };
        Ok((log, recovery))
    }

    /// Puts the older segments read at open in the log, waiting for the
    /// thread reading them if `wait` (else returning whether they are in).
    fn settle_older(&self, wait: bool) -> Result<bool, ReadError> {
        let mut older = self.older.lock();
        match &*older {
            Older::Settled => return Ok(true),
            Older::Failed(why) => return Err(ReadError::Io(why.clone())),
            Older::Reading(reading) if !wait && !reading.is_finished() => return Ok(false),
            Older::Reading(_) => {}
        }
        let Older::Reading(reading) = std::mem::replace(&mut *older, Older::Settled) else { unreachable!("matched") };
        let found = reading.join().unwrap_or_else(|_| Err(io::Error::other("the thread reading them panicked")));
        match found {
            Ok(found) => {
                let mut state = self.state.write();
                for segment in found.segments.into_iter().rev() {
                    state.segments.push_front(segment);
                }
                Ok(true)
            }
            Err(error) => {
                let why = format!("reading the change feed's older segments: {error}");
                *older = Older::Failed(why.clone());
                Err(ReadError::Io(why))
            }
        }
    }

    /// Waits until the segments read at open in the background are in the
    /// log: a test or a tool that needs the whole log at once.
    pub fn wait_for_older_segments(&self) -> Result<(), ReadError> {
        self.settle_older(true).map(drop)
    }

    /// Whether the log is on disk.
    pub fn is_durable(&self) -> bool {
        self.dir.is_some()
    }

    /// The retention it keeps.
    pub fn retention(&self) -> Retention {
        self.retention
    }

    /// Appends `frames` (positions after every frame before, in order),
    /// written and synced before a reader can see them, and marks the log
    /// complete through `through`; then removes what retention no longer
    /// keeps at `now` (ms). On an error nothing of the batch is visible.
    pub fn append(&self, frames: &[Frame], through: u64, now: u64) -> io::Result<()> {
        let _writer = self.writer.lock();
        debug_assert!(frames.windows(2).all(|pair| pair[0].position() < pair[1].position()));
        if let (Some(dir), Some(first)) = (&self.dir, frames.first()) {
            {
                let mut state = self.state.write();
                state.writing = frames.to_vec();
                let last = frames.last().map_or(state.end, Frame::cursor);
                state.writing_end = last.max(Cursor::through(through)).max(state.end);
            }
            let written = self.write(dir, frames, first.position());
            if written.is_err() {
                self.state.write().writing.clear();
            }
            written?;
        }
        let cap = if self.dir.is_some() {
            TAIL_BYTES_ON_DISK.min(self.retention.max_bytes)
        } else {
            self.retention.max_bytes
        };
        let memory = self.dir.is_none();
        let mut state = self.state.write();
        if let Some(last) = frames.last() {
            debug_assert!(last.cursor() > state.end || state.end.position < last.position());
            for frame in frames {
                state.tail.push(frame);
            }
            state.end = last.cursor();
            state.writing.clear();
        }
        if through > state.end.position {
            state.end = Cursor::through(through);
        }
        // By bytes a block at a time; by age a frame at a time.
        if let Some(gone) = state.tail.trim_to(cap) {
            state.tail_from = gone;
            if memory {
                state.trimmed = gone;
            }
        }
        while memory && state.tail.front_at().is_some_and(|at| self.expired(at, now)) {
            let gone = state.tail.pop_front().expect("a frame");
            state.tail_from = gone;
            state.trimmed = gone;
        }
        drop(state);
        if let Some(dir) = &self.dir {
            self.trim_segments(dir, now)?;
        }
        Ok(())
    }

    fn expired(&self, at: u64, now: u64) -> bool {
        at.saturating_add(self.retention.max_age_ms) < now
    }

    fn segment_bytes(&self) -> u64 {
        (self.retention.max_bytes / 8).clamp(MIN_SEGMENT_BYTES, MAX_SEGMENT_BYTES)
    }

    /// Writes and syncs a batch to the last segment, or a new one.
    fn write(&self, dir: &Path, frames: &[Frame], first: u64) -> io::Result<()> {
        let (file, offset) = {
            let state = self.state.read();
            match state.segments.back() {
                Some(last) if last.bytes < self.segment_bytes() => (Some(last.file.clone()), last.bytes),
                _ => (None, 0),
            }
        };
        let file = match file {
            Some(file) => file,
            None => {
                let created = Segment::create(dir, first)?;
                sync_dir(dir)?;
                let file = created.file.clone();
                self.state.write().segments.push_back(created);
                file
            }
        };
        let mut buffer = Vec::with_capacity(frames.iter().map(Frame::len).sum());
        for frame in frames {
            buffer.extend_from_slice(frame.bytes());
        }
        file.write_all_at(&buffer, offset)?;
        file.sync_data()?;
        let mut state = self.state.write();
        let last = state.segments.back_mut().expect("the segment written to");
        let mut at = offset;
        for frame in frames {
            last.note(frame, at);
            at += frame.len() as u64;
        }
        Ok(())
    }

    /// Removes whole segments that retention no longer keeps: the oldest,
    /// while the rest hold more than the bytes kept, or while its newest
    /// frame is older than the age kept.
    fn trim_segments(&self, dir: &Path, now: u64) -> io::Result<()> {
        // Retention counts every segment: it waits for the older ones to be read.
        if !matches!(self.settle_older(false), Ok(true)) {
            return Ok(());
        }
        let mut removed = Vec::new();
        {
            let mut state = self.state.write();
            let mut total: u64 = state.segments.iter().map(|segment| segment.bytes).sum();
            while let Some(oldest) = state.segments.front() {
                if total <= self.retention.max_bytes && !self.expired(oldest.last_at, now) {
                    break;
                }
                let oldest = state.segments.pop_front().expect("a front");
                total -= oldest.bytes;
                state.trimmed = state.trimmed.max(oldest.last_cursor);
                state.tail_from = state.tail_from.max(state.trimmed);
                removed.push(oldest);
            }
        }
        if let Some(last) = removed.last() {
            let trimmed = last.last_cursor;
            write_atomically(&dir.join(TRIMMED), format!("{} {}\n", trimmed.position, trimmed.slot).as_bytes())?;
            for segment in &removed {
                fs::remove_file(&segment.path)?;
            }
            sync_dir(dir)?;
        }
        Ok(())
    }

    /// The frames after `after`, up to about `max_bytes` of them (at least
    /// one when there is one), and how far the log is complete; or
    /// [`OutOfRange`] for a cursor before what it holds.
    pub fn read(&self, after: Cursor, max_bytes: usize) -> Result<Read, ReadError> {
        self.settle_older(true)?;
        let state = self.state.read();
        if after < state.trimmed {
            return Err(ReadError::OutOfRange(OutOfRange { oldest: state.trimmed }));
        }
        let end = state.end;
        if after >= state.tail_from {
            let (frames, whole) = state.tail.read_after(after, max_bytes);
            // The end is known complete only once every frame before it is read.
            let end = if whole { end } else { after.max(frames_end(&frames)) };
            return Ok(Read { frames, end });
        }
        let at = state.segments.partition_point(|segment| segment.last_cursor <= after);
        let Some(segment) = state.segments.get(at) else {
            return Ok(Read { frames: Vec::new(), end });
        };
        let (file, offset, limit) = (segment.file.clone(), segment.offset_before(after.position), segment.bytes);
        drop(state);
        let chunk = segment::read_at(&file, offset, limit, max_bytes.max(MAX_FRAME))
            .map_err(|error| ReadError::Io(error.to_string()))?;
        let mut frames = Vec::new();
        let mut at = 0;
        let mut bytes = 0;
        while at < chunk.len() && bytes < max_bytes {
            match Frame::parse(&chunk.slice(at..)) {
                Ok((frame, size)) => {
                    at += size;
                    if frame.cursor() > after {
                        bytes += size;
                        frames.push(frame);
                    }
                }
                Err(FrameError::Short { .. }) => break,
                Err(error) => return Err(ReadError::Io(error.to_string())),
            }
        }
        let end = after.max(frames_end(&frames));
        Ok(Read { frames, end })
    }

    /// Every frame after `after` whose slot `wanted` takes, in order, and
    /// how far the log is complete: found through each segment's index of
    /// its frames by slot, and in the tail in memory, copying no other frame
    /// (C7: what a move carries of its slots). The segments' frames are read
    /// in chunks of [`SLOT_READ_BYTES`] that hold some of them.
    pub fn read_slots(&self, after: Cursor, wanted: &dyn Fn(u32) -> bool) -> Result<Read, ReadError> {
        self.settle_older(true)?;
        let state = self.state.read();
        if after < state.trimmed {
            return Err(ReadError::OutOfRange(OutOfRange { oldest: state.trimmed }));
        }
        let (end, tail_from) = (state.end, state.tail_from);
        let tail = state.tail.read_matching(after.max(tail_from), wanted);
        if after >= tail_from {
            return Ok(Read { frames: tail, end });
        }
        let planned: Vec<(Arc<fs::File>, u64, Vec<u64>)> = state
            .segments
            .iter()
            .filter(|segment| segment.last_cursor > after)
            .map(|segment| (Arc::clone(&segment.file), segment.bytes, segment.offsets_of(wanted)))
            .collect();
        drop(state);
        let mut frames = Vec::new();
        // A segment retention removes meanwhile stays readable through its open file.
        for (file, bytes, offsets) in planned {
            let mut next = 0;
            while next < offsets.len() {
                let start = offsets[next];
                let chunk = segment::read_at(&file, start, bytes, SLOT_READ_BYTES.max(MAX_FRAME))
                    .map_err(|error| ReadError::Io(error.to_string()))?;
                while next < offsets.len() && offsets[next] < start + chunk.len() as u64 {
                    match Frame::parse(&chunk.slice((offsets[next] - start) as usize..)) {
                        Ok((frame, _)) => {
                            if frame.cursor() > after && frame.cursor() <= tail_from {
                                frames.push(frame);
                            }
                            next += 1;
                        }
                        // Cut by the chunk's end: the next chunk starts at it.
                        Err(FrameError::Short { .. }) if offsets[next] > start => break,
                        Err(error) => return Err(ReadError::Io(error.to_string())),
                    }
                }
            }
        }
        frames.extend(tail);
        Ok(Read { frames, end })
    }

    /// [`FeedLog::read_slots`], and the matching frames of the batch being
    /// written and synced, which no stream reads yet (C7: a move freezes its
    /// slots, then sends their entries to the target at once instead of
    /// waiting for the disk; the target keeps them from then on).
    pub fn read_slots_unsynced(&self, after: Cursor, wanted: &dyn Fn(u32) -> bool) -> Result<Read, ReadError> {
        // The batch first: if it is appended while the rest is read, the
        // read finds it in the tail, and its copy here is left out by cursor.
        let (writing, writing_end) = {
            let state = self.state.read();
            let matching: Vec<Frame> = state.writing.iter().filter(|frame| wanted(frame.slot())).cloned().collect();
            (matching, state.writing_end)
        };
        let mut read = self.read_slots(after, wanted)?;
        let from = read.end.max(after);
        read.frames.extend(writing.into_iter().filter(|frame| frame.cursor() > from));
        read.end = read.end.max(writing_end);
        Ok(read)
    }

    /// The cursor through which it is complete now.
    pub fn end(&self) -> Cursor {
        self.state.read().end
    }

    /// The cursor through which it is complete once the batch being written
    /// is synced: what [`FeedLog::read_slots_unsynced`] reads through.
    pub fn end_unsynced(&self) -> Cursor {
        let state = self.state.read();
        state.end.max(state.writing_end)
    }

    /// The cursor that resumes at the oldest frame it holds.
    pub fn oldest(&self) -> Cursor {
        self.state.read().trimmed
    }

    /// Bytes it holds, as [`Retention::max_bytes`] counts them: on disk,
    /// the segment files; in memory, everything the kept frames take (a
    /// test holds the process to it: `tests/memory.rs`).
    pub fn bytes(&self) -> u64 {
        let state = self.state.read();
        match self.dir {
            Some(_) => state.segments.iter().map(|segment| segment.bytes).sum(),
            None => state.tail.held(),
        }
    }

    /// Syncs the last segment and writes the mark of an orderly close, so
    /// that the next open knows nothing was lost. Nothing may be appended
    /// after it.
    pub fn close(&self) -> io::Result<()> {
        let Some(dir) = &self.dir else { return Ok(()) };
        let _writer = self.writer.lock();
        let state = self.state.read();
        if let Some(last) = state.segments.back() {
            last.file.sync_all()?;
        }
        write_atomically(&dir.join(CLEAN), format!("{}\n", state.end.position).as_bytes())
    }
}

/// Why a read failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReadError {
    /// The cursor is before what the log holds.
    #[error(transparent)]
    OutOfRange(#[from] OutOfRange),
    /// The disk failed, or a segment is damaged.
    #[error("reading the feed: {0}")]
    Io(String),
}

/// A cursor as `trimmed` holds it: its position and slot.
fn parse_cursor(text: &str) -> Option<Cursor> {
    let mut fields = text.split_whitespace();
    let cursor = Cursor { position: fields.next()?.parse().ok()?, slot: fields.next()?.parse().ok()? };
    fields.next().is_none().then_some(cursor)
}

fn frames_end(frames: &[Frame]) -> Cursor {
    frames.last().map_or(Cursor::START, Frame::cursor)
}

/// Writes a small file whole or not at all: a temporary file, synced, renamed.
fn write_atomically(path: &Path, contents: &[u8]) -> io::Result<()> {
    let temporary = path.with_extension("tmp");
    fs::write(&temporary, contents)?;
    fs::File::open(&temporary)?.sync_all()?;
    fs::rename(&temporary, path)?;
    sync_dir(path.parent().expect("a file in the log's directory"))
}

fn sync_dir(dir: &Path) -> io::Result<()> {
    fs::File::open(dir)?.sync_all()
}
