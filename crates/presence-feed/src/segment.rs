//! One file of the log on disk: frames appended in position order, named by
//! the position of its first frame, with a sparse index of positions to
//! offsets so that a read from a cursor starts near it.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use bytes::Bytes;

use crate::frame::{Frame, MAX_FRAME};

/// The file name's ending.
pub(crate) const SUFFIX: &str = ".feed";
/// One index point per this many bytes of frames.
const INDEX_EVERY: u64 = 64 * 1024;

/// A segment file and what the log knows of it.
#[derive(Debug)]
pub(crate) struct Segment {
    pub(crate) path: PathBuf,
    pub(crate) file: Arc<File>,
    /// The first and last frames' positions (0, 0 while empty).
    pub(crate) first: u64,
    pub(crate) last: u64,
    /// The last frame's cursor.
    pub(crate) last_cursor: crate::Cursor,
    /// Bytes written and synced: readers read no further.
    pub(crate) bytes: u64,
    /// The latest store time of its frames.
    pub(crate) last_at: u64,
    /// How many frames it holds.
    pub(crate) frames: u64,
    /// (position, offset) of a frame every [`INDEX_EVERY`] bytes, the first frame's included.
    index: Vec<(u64, u64)>,
    /// The offset of every frame, by slot, ascending: a move reads its
    /// slots' frames and no other (C7). Four bytes a frame.
    by_slot: HashMap<u32, Vec<u32>>,
}

/// What recovering a segment found wrong and mended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Repair {
    /// Where the damage started.
    pub(crate) offset: u64,
    /// Bytes cut off from there.
    pub(crate) cut: u64,
    /// What was wrong.
    pub(crate) why: String,
}

impl Segment {
    /// The name of a segment whose first frame is at `first`.
    pub(crate) fn path_for(dir: &Path, first: u64) -> PathBuf {
        dir.join(format!("{first:016x}{SUFFIX}"))
    }

    /// A new, empty segment file for frames from `first` on.
    pub(crate) fn create(dir: &Path, first: u64) -> io::Result<Segment> {
        let path = Self::path_for(dir, first);
        let file = OpenOptions::new().read(true).write(true).create_new(true).open(&path)?;
        Ok(Segment::holding_nothing_yet(path, file))
    }

    /// What the log knows of `file` before it has read a frame of it.
    fn holding_nothing_yet(path: PathBuf, file: File) -> Segment {
        Segment {
            path,
            file: Arc::new(file),
            first: 0,
            last: 0,
            last_cursor: crate::Cursor::START,
            bytes: 0,
            last_at: 0,
            frames: 0,
            index: Vec::new(),
            by_slot: HashMap::new(),
        }
    }

    /// Opens a segment and reads every frame, checking each; cuts the file
    /// at the first frame that is damaged, cut short, or not after
    /// `after` and the frame before it.
    pub(crate) fn recover(path: &Path, after: u64) -> io::Result<(Segment, Option<Repair>)> {
        let file = OpenOptions::new().read(true).write(true).open(path)?;
        let len = file.metadata()?.len();
        let mut segment = Segment::holding_nothing_yet(path.to_owned(), file);
        let mut last = after;
        let mut repair = None;
        'scan: while segment.bytes < len {
            let chunk = segment.read_chunk(segment.bytes, len, 4 * MAX_FRAME)?;
            let mut at = 0;
            while at < chunk.len() {
                match Frame::parse(&chunk.slice(at..)) {
                    Ok((frame, size)) if frame.position() > last => {
                        last = frame.position();
                        segment.note(&frame, segment.bytes);
                        at += size;
                    }
                    Ok(_) => {
                        repair = Some(segment.bytes_repair(len, "a position not after the one before"));
                        break 'scan;
                    }
                    Err(crate::FrameError::Short { .. }) if at > 0 => break,
                    Err(error) => {
                        repair = Some(segment.bytes_repair(len, &error.to_string()));
                        break 'scan;
                    }
                }
            }
        }
        if let Some(repair) = &repair {
            segment.file.set_len(repair.offset)?;
            segment.file.sync_all()?;
        }
        Ok((segment, repair))
    }

    fn bytes_repair(&self, len: u64, why: &str) -> Repair {
        Repair { offset: self.bytes, cut: len - self.bytes, why: why.to_owned() }
    }

    /// Takes note of a frame written at `offset` (the segment's end).
    pub(crate) fn note(&mut self, frame: &Frame, offset: u64) {
        debug_assert_eq!(offset, self.bytes);
        if self.first == 0 {
            self.first = frame.position();
        }
        if self.index.last().is_none_or(|&(_, indexed)| offset >= indexed + INDEX_EVERY) {
            self.index.push((frame.position(), offset));
        }
        // A segment stops taking batches at 16 MiB: its offsets fit.
        self.by_slot.entry(frame.slot()).or_default().push(offset as u32);
        self.last = frame.position();
        self.last_cursor = frame.cursor();
        self.last_at = self.last_at.max(frame.at());
        self.bytes = offset + frame.len() as u64;
        self.frames += 1;
    }

    /// Whether it holds no frame.
    pub(crate) fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The offset of an indexed frame at or before the first frame after `position`.
    pub(crate) fn offset_before(&self, position: u64) -> u64 {
        let at = self.index.partition_point(|&(indexed, _)| indexed <= position);
        if at == 0 { 0 } else { self.index[at - 1].1 }
    }

    /// The offsets of the frames whose slot `wanted` takes, ascending.
    pub(crate) fn offsets_of(&self, wanted: &dyn Fn(u32) -> bool) -> Vec<u64> {
        let mut offsets: Vec<u64> = self
            .by_slot
            .iter()
            .filter(|&(&slot, _)| wanted(slot))
            .flat_map(|(_, offsets)| offsets.iter().map(|&offset| u64::from(offset)))
            .collect();
        offsets.sort_unstable();
        offsets
    }

    /// Up to `max` bytes from `offset`, no further than `end`.
    pub(crate) fn read_chunk(&self, offset: u64, end: u64, max: usize) -> io::Result<Bytes> {
        read_at(&self.file, offset, end, max)
    }
}

/// Up to `max` bytes of `file` from `offset`, no further than `end`.
pub(crate) fn read_at(file: &File, offset: u64, end: u64, max: usize) -> io::Result<Bytes> {
    let want = (end.saturating_sub(offset)).min(max as u64) as usize;
    let mut buffer = vec![0; want];
    let mut filled = 0;
    while filled < want {
        let read = file.read_at(&mut buffer[filled..], offset + filled as u64)?;
        if read == 0 {
            break;
        }
        filled += read;
    }
    buffer.truncate(filled);
    Ok(Bytes::from(buffer))
}

/// The first position a segment file's name gives, if it is one.
pub(crate) fn first_of(name: &str) -> Option<u64> {
    let hex = name.strip_suffix(SUFFIX)?;
    if hex.len() != 16 {
        return None;
    }
    u64::from_str_radix(hex, 16).ok()
}
