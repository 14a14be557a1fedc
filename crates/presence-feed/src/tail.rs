//! The newest frames in memory, packed as the segment files are: one
//! after another in blocks the log owns, so that what they take is their
//! bytes and the blocks' unfilled ends, and nothing per frame.
//!
//! Appending is a copy into the last block; retention lets go of whole
//! blocks by bytes and of frames at the front by age; a read copies the
//! frames it returns out of the blocks (one allocation for a read's frames,
//! which share it), so that no reader holds a block and the log's memory is
//! the blocks it keeps. A frame is found by its cursor: the block by the
//! blocks' last cursors, then the frames of that block in order.

use std::collections::VecDeque;

use bytes::BytesMut;

use crate::Cursor;
use crate::frame::Frame;

/// A block of frames, one after another from `start`.
#[derive(Debug)]
struct Block {
    bytes: Vec<u8>,
    /// Where the first frame retention kept begins.
    start: usize,
    /// The last frame's cursor.
    last: Cursor,
}

/// Frames in blocks (see the module).
#[derive(Debug)]
pub(crate) struct Tail {
    blocks: VecDeque<Block>,
    /// The size of a block (a frame larger than that gets one of its own).
    block_bytes: usize,
    /// Bytes of the frames kept.
    frame_bytes: u64,
    /// Bytes the blocks hold, frames or not.
    held: u64,
    /// A block let go of, kept to take the next frames (it is the size of
    /// the ones it would be made for, and its pages are already there).
    spare: Option<Vec<u8>>,
}

impl Tail {
    pub(crate) fn new(block_bytes: usize) -> Tail {
        Tail { blocks: VecDeque::new(), block_bytes, frame_bytes: 0, held: 0, spare: None }
    }

    /// Bytes of the frames kept.
    #[cfg(test)]
    fn frame_bytes(&self) -> u64 {
        self.frame_bytes
    }

    /// What the tail takes in memory: its blocks, whole, and the spare.
    pub(crate) fn held(&self) -> u64 {
        self.held + self.spare.as_ref().map_or(0, |spare| spare.capacity() as u64)
    }

    /// Appends `frame`, after every frame kept.
    pub(crate) fn push(&mut self, frame: &Frame) {
        let bytes = frame.bytes();
        let fits = self.blocks.back().is_some_and(|last| last.bytes.capacity() - last.bytes.len() >= bytes.len());
        if !fits {
            let bytes = match self.spare.take() {
                Some(mut spare) if spare.capacity() >= bytes.len() => {
                    spare.clear();
                    spare
                }
                _ => Vec::with_capacity(self.block_bytes.max(bytes.len())),
            };
            self.held += bytes.capacity() as u64;
            self.blocks.push_back(Block { bytes, start: 0, last: Cursor::START });
        }
        let last = self.blocks.back_mut().expect("a block with room");
        last.bytes.extend_from_slice(bytes);
        last.last = frame.cursor();
        self.frame_bytes += bytes.len() as u64;
    }

    /// Lets go of the oldest blocks until the blocks and a spare fit in
    /// `cap` bytes; the cursor of the last frame let go of, if any.
    pub(crate) fn trim_to(&mut self, cap: u64) -> Option<Cursor> {
        let mut gone = None;
        while !self.blocks.is_empty() && self.held + self.block_bytes as u64 > cap {
            gone = self.drop_oldest_block();
        }
        gone
    }

    /// Lets go of the oldest block (kept as the spare); the cursor of its
    /// last frame, or `None` when there is none.
    pub(crate) fn drop_oldest_block(&mut self) -> Option<Cursor> {
        let oldest = self.blocks.pop_front()?;
        self.frame_bytes -= (oldest.bytes.len() - oldest.start) as u64;
        self.held -= oldest.bytes.capacity() as u64;
        if oldest.bytes.capacity() == self.block_bytes {
            self.spare = Some(oldest.bytes);
        }
        Some(oldest.last)
    }

    /// The blocks it holds.
    #[cfg(test)]
    fn blocks(&self) -> usize {
        self.blocks.len()
    }

    /// The store time of the oldest frame kept, or `None`.
    pub(crate) fn front_at(&self) -> Option<u64> {
        let first = self.blocks.front()?;
        Some(Frame::at_in(&first.bytes[first.start..]))
    }

    /// Lets go of the oldest frame; its cursor, or `None` when there is none.
    pub(crate) fn pop_front(&mut self) -> Option<Cursor> {
        let first = self.blocks.front_mut()?;
        let len = Frame::len_in(&first.bytes[first.start..]);
        let cursor = Frame::cursor_in(&first.bytes[first.start..]);
        first.start += len;
        self.frame_bytes -= len as u64;
        if first.start == first.bytes.len() {
            self.drop_oldest_block();
        }
        Some(cursor)
    }

    /// Copies of the frames after `after`, up to about `max_bytes` of them
    /// (at least one when there is one), and whether they are every frame
    /// after it that the tail holds.
    pub(crate) fn read_after(&self, after: Cursor, max_bytes: usize) -> (Vec<Frame>, bool) {
        let from = self.blocks.partition_point(|block| block.last <= after);
        let mut copied = BytesMut::new();
        for (at, block) in self.blocks.range(from..).enumerate() {
            let mut offset = block.start;
            if at == 0 {
                while offset < block.bytes.len() && Frame::cursor_in(&block.bytes[offset..]) <= after {
                    offset += Frame::len_in(&block.bytes[offset..]);
                }
            }
            let mut end = offset;
            while end < block.bytes.len()
                && (copied.len() + end - offset < max_bytes || copied.is_empty() && end == offset)
            {
                end += Frame::len_in(&block.bytes[end..]);
            }
            copied.extend_from_slice(&block.bytes[offset..end]);
            if end < block.bytes.len() {
                return (Frame::packed(copied.freeze()).collect(), false);
            }
        }
        (Frame::packed(copied.freeze()).collect(), true)
    }

    /// Every frame after `after` whose slot `wanted` takes, in order: only
    /// those are copied out (C7: a move's slots).
    pub(crate) fn read_matching(&self, after: Cursor, wanted: &dyn Fn(u32) -> bool) -> Vec<Frame> {
        let from = self.blocks.partition_point(|block| block.last <= after);
        let mut copied = BytesMut::new();
        for block in self.blocks.range(from..) {
            let mut offset = block.start;
            while offset < block.bytes.len() {
                let frame = &block.bytes[offset..];
                let (cursor, len) = (Frame::cursor_in(frame), Frame::len_in(frame));
                if cursor > after && wanted(cursor.slot) {
                    copied.extend_from_slice(&frame[..len]);
                }
                offset += len;
            }
        }
        Frame::packed(copied.freeze()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::FrameKind;

    fn frame(position: u64) -> Frame {
        Frame::new(position, (position % 7) as u32, FrameKind::Flip, position, b"someone", &[1; 40])
    }

    fn positions(frames: &[Frame]) -> Vec<u64> {
        frames.iter().map(Frame::position).collect()
    }

    #[test]
    fn frames_read_back_in_order_from_any_cursor_across_blocks() {
        let size = frame(1).len();
        let mut tail = Tail::new(3 * size + 5);
        for position in 1..=10 {
            tail.push(&frame(position));
        }
        assert_eq!(tail.blocks(), 4, "three frames a block");
        assert_eq!(tail.frame_bytes(), 10 * size as u64);
        assert_eq!(tail.held(), 4 * (3 * size + 5) as u64);
        let (all, whole) = tail.read_after(Cursor::START, usize::MAX);
        assert_eq!((positions(&all), whole), ((1..=10).collect(), true));
        assert_eq!(all[4], frame(5), "a copy of the frame appended");
        let (some, whole) = tail.read_after(frame(4).cursor(), 2 * size);
        assert_eq!((positions(&some), whole), (vec![5, 6], false));
        let (one, _) = tail.read_after(frame(4).cursor(), 1);
        assert_eq!(positions(&one), vec![5], "at least one frame");
        let (none, whole) = tail.read_after(frame(10).cursor(), usize::MAX);
        assert_eq!((none.len(), whole), (0, true));
    }

    #[test]
    fn retention_lets_go_of_blocks_and_frames_and_reuses_a_block() {
        let size = frame(1).len();
        let mut tail = Tail::new(2 * size);
        for position in 1..=5 {
            tail.push(&frame(position));
        }
        assert_eq!(tail.pop_front(), Some(frame(1).cursor()));
        assert_eq!(tail.front_at(), Some(2), "frame 2's store time");
        assert_eq!(tail.drop_oldest_block(), Some(frame(2).cursor()), "the rest of the first block");
        assert_eq!(tail.frame_bytes(), 3 * size as u64);
        assert_eq!(tail.held(), 3 * 2 * size as u64, "two blocks and the spare");
        let (left, _) = tail.read_after(Cursor::START, usize::MAX);
        assert_eq!(positions(&left), vec![3, 4, 5]);
        tail.push(&frame(6));
        assert_eq!(tail.held(), 3 * 2 * size as u64, "frame 6 went after frame 5");
        tail.push(&frame(7));
        assert_eq!(tail.held(), 3 * 2 * size as u64, "the spare took frame 7");
        assert_eq!(tail.pop_front(), Some(frame(3).cursor()));
        assert_eq!(tail.pop_front(), Some(frame(4).cursor()));
        assert_eq!((tail.blocks(), tail.held()), (2, 3 * 2 * size as u64), "the emptied block is the spare");
        // Within a cap of three blocks: two and the spare.
        assert_eq!(tail.trim_to(3 * 2 * size as u64), None);
        assert_eq!(tail.trim_to(2 * 2 * size as u64), Some(frame(6).cursor()));
        assert_eq!((tail.blocks(), tail.held()), (1, 2 * 2 * size as u64));
        let big = Frame::new(8, 0, FrameKind::Status, 8, b"someone", &[2; 400]);
        tail.push(&big);
        let (last, _) = tail.read_after(frame(7).cursor(), usize::MAX);
        assert_eq!(last, vec![big], "a frame larger than a block has one of its own");
    }
}
