//! One feed entry as bytes: the same in the memory ring, in a segment file
//! and in a read, so that writing is a copy and reading a slice.
//!
//! ```text
//! offset  size  field
//!      0     4  length of everything from offset 8 (u32, little-endian)
//!      4     4  CRC-32 (IEEE) of everything from offset 8
//!      8     8  position (u64)
//!     16     4  slot (u32)
//!     20     1  kind (FrameKind)
//!     21     8  store time, ms (u64)
//!     29     1  id length n (at most 255)
//!     30     n  the user's or room's id
//!   30+n     …  body: the event as the server encodes it for the wire
//! ```

use bytes::{BufMut, Bytes, BytesMut};

/// Bytes before the checked part: the length and the checksum.
pub(crate) const PREFIX: usize = 8;
/// Bytes of a frame without its id and body.
const HEADER: usize = 30;
/// The largest frame the log writes or reads back (a sanity bound on a
/// length read from a damaged file).
pub(crate) const MAX_FRAME: usize = 1 << 20;

/// What a frame records.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum FrameKind {
    /// A user's ONLINE/OFFLINE flip.
    Flip = 1,
    /// A user's status changed.
    Status = 2,
    /// A room became occupied or empty.
    RoomOccupancy = 3,
    /// Entries that were lost (a crash, an intake that overflowed, a
    /// takeover from a follower behind): their range, not their contents.
    Gap = 4,
    /// A user's derived availability changed (A2).
    Availability = 5,
}

impl FrameKind {
    fn from_byte(byte: u8) -> Option<FrameKind> {
        Some(match byte {
            1 => FrameKind::Flip,
            2 => FrameKind::Status,
            3 => FrameKind::RoomOccupancy,
            4 => FrameKind::Gap,
            5 => FrameKind::Availability,
            _ => return None,
        })
    }
}

/// Why bytes are not a frame.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// Fewer bytes than the frame says it has (a write cut short).
    #[error("a frame cut short: {have} of {need} bytes")]
    Short {
        /// Bytes there.
        have: usize,
        /// Bytes the frame needs.
        need: usize,
    },
    /// The checksum does not match, or the fields do not fit together.
    #[error("a damaged frame: {0}")]
    Damaged(&'static str),
}

/// One entry of the feed (see the module for its bytes).
#[derive(Clone, PartialEq, Eq)]
pub struct Frame(Bytes);

impl std::fmt::Debug for Frame {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Frame")
            .field("position", &self.position())
            .field("slot", &self.slot())
            .field("kind", &self.kind())
            .field("id", &String::from_utf8_lossy(self.id()))
            .field("body", &self.body().len())
            .finish()
    }
}

impl Frame {
    /// A frame of these fields. An id longer than 255 bytes is cut (ids are
    /// at most 128 bytes).
    pub fn new(position: u64, slot: u32, kind: FrameKind, at: u64, id: &[u8], body: &[u8]) -> Frame {
        let mut bytes = BytesMut::with_capacity(HEADER + id.len().min(255) + body.len());
        Frame::append_to(&mut bytes, position, slot, kind, at, id, |out| out.put_slice(body));
        Frame(bytes.freeze())
    }

    /// Appends a frame of these fields to `out`, its body written by
    /// `write_body`: frames appended one after another to one buffer cost
    /// one allocation for them all, and [`Frame::packed`] reads them back.
    /// An id longer than 255 bytes is cut, as by [`Frame::new`].
    pub fn append_to(
        out: &mut BytesMut,
        position: u64,
        slot: u32,
        kind: FrameKind,
        at: u64,
        id: &[u8],
        write_body: impl FnOnce(&mut BytesMut),
    ) {
        let id = &id[..id.len().min(255)];
        let start = out.len();
        out.reserve(HEADER + id.len());
        out.put_u32_le(0);
        out.put_u32_le(0);
        out.put_u64_le(position);
        out.put_u32_le(slot);
        out.put_u8(kind as u8);
        out.put_u64_le(at);
        out.put_u8(id.len() as u8);
        out.put_slice(id);
        write_body(out);
        let len = out.len() - start - PREFIX;
        assert!(len <= MAX_FRAME, "a frame of {len} bytes is larger than any the log reads back");
        let crc = crc32fast::hash(&out[start + PREFIX..]);
        out[start..start + 4].copy_from_slice(&(len as u32).to_le_bytes());
        out[start + 4..start + PREFIX].copy_from_slice(&crc.to_le_bytes());
    }

    /// The cursor of the frame at the start of `bytes`, a whole frame's
    /// bytes as the log wrote them (not checked again).
    pub(crate) fn cursor_in(bytes: &[u8]) -> crate::Cursor {
        crate::Cursor {
            position: u64::from_le_bytes(bytes[8..16].try_into().expect("8 bytes")),
            slot: u32::from_le_bytes(bytes[16..20].try_into().expect("4 bytes")),
        }
    }

    /// The store time of the frame at the start of `bytes` (as [`Frame::cursor_in`]).
    pub(crate) fn at_in(bytes: &[u8]) -> u64 {
        u64::from_le_bytes(bytes[21..29].try_into().expect("8 bytes"))
    }

    /// The length of the frame at the start of `bytes` (as [`Frame::cursor_in`]).
    pub(crate) fn len_in(bytes: &[u8]) -> usize {
        PREFIX + u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize
    }

    /// The frames [`Frame::append_to`] wrote one after another into
    /// `bytes`, each a slice of it (not a copy, and not checked again).
    pub fn packed(bytes: Bytes) -> impl Iterator<Item = Frame> {
        let mut at = 0;
        std::iter::from_fn(move || {
            if at + PREFIX > bytes.len() {
                return None;
            }
            let len = Frame::len_in(&bytes[at..]);
            let frame = Frame(bytes.slice(at..at + len));
            at += len;
            Some(frame)
        })
    }

    /// The frame at the start of `bytes`, checked, and its length; a slice
    /// of `bytes`, not a copy.
    pub fn parse(bytes: &Bytes) -> Result<(Frame, usize), FrameError> {
        if bytes.len() < PREFIX {
            return Err(FrameError::Short { have: bytes.len(), need: PREFIX });
        }
        let len = u32::from_le_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
        if !(HEADER - PREFIX..=MAX_FRAME).contains(&len) {
            return Err(FrameError::Damaged("a length out of bounds"));
        }
        let need = PREFIX + len;
        if bytes.len() < need {
            return Err(FrameError::Short { have: bytes.len(), need });
        }
        let crc = u32::from_le_bytes(bytes[4..8].try_into().expect("4 bytes"));
        if crc32fast::hash(&bytes[PREFIX..need]) != crc {
            return Err(FrameError::Damaged("its checksum does not match"));
        }
        let frame = Frame(bytes.slice(..need));
        if FrameKind::from_byte(frame.0[20]).is_none() {
            return Err(FrameError::Damaged("an unknown kind"));
        }
        if HEADER + frame.0[29] as usize > need {
            return Err(FrameError::Damaged("an id longer than the frame"));
        }
        Ok((frame, need))
    }

    /// The frame's bytes, as written.
    pub fn bytes(&self) -> &Bytes {
        &self.0
    }

    /// The entry's position.
    pub fn position(&self) -> u64 {
        Frame::cursor_in(&self.0).position
    }

    /// The slot of the entry's user or room.
    pub fn slot(&self) -> u32 {
        Frame::cursor_in(&self.0).slot
    }

    /// The cursor just after this entry.
    pub fn cursor(&self) -> crate::Cursor {
        Frame::cursor_in(&self.0)
    }

    /// What it records.
    pub fn kind(&self) -> FrameKind {
        FrameKind::from_byte(self.0[20]).expect("checked when built or parsed")
    }

    /// The store time of the entry, ms.
    pub fn at(&self) -> u64 {
        Frame::at_in(&self.0)
    }

    /// The user's or room's id (empty for a gap).
    pub fn id(&self) -> &[u8] {
        &self.0[HEADER..HEADER + self.0[29] as usize]
    }

    /// The event as the server encoded it.
    pub fn body(&self) -> Bytes {
        self.0.slice(HEADER + self.0[29] as usize..)
    }

    /// Bytes the frame takes.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Never: a frame has at least its header.
    pub fn is_empty(&self) -> bool {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_appended_to_one_buffer_read_back_as_each_made_alone() {
        let alone = [
            Frame::new(1, 2, FrameKind::Flip, 3, b"alice", b"first body"),
            Frame::new(4, 5, FrameKind::Gap, 6, b"", b""),
            Frame::new(7, 8, FrameKind::Status, 9, &[b'x'; 300], b"long id"),
        ];
        let mut buffer = BytesMut::new();
        for frame in &alone {
            let body = frame.body();
            let (position, slot, kind, at) = (frame.position(), frame.slot(), frame.kind(), frame.at());
            Frame::append_to(&mut buffer, position, slot, kind, at, frame.id(), |out| out.put_slice(&body));
        }
        let packed: Vec<Frame> = Frame::packed(buffer.freeze()).collect();
        assert_eq!(packed, alone);
    }

    #[test]
    fn a_frame_reads_back_its_fields_and_a_changed_byte_is_refused() {
        let frame = Frame::new(7 << 20, 21, FrameKind::Status, 1_700_000_000_000, b"alice", b"\x0a\x05body!");
        let bytes = frame.bytes().clone();
        let (read, len) = Frame::parse(&bytes).unwrap();
        assert_eq!(len, bytes.len());
        assert_eq!((read.position(), read.slot(), read.kind()), (7 << 20, 21, FrameKind::Status));
        assert_eq!((read.at(), read.id(), &read.body()[..]), (1_700_000_000_000, &b"alice"[..], &b"\x0a\x05body!"[..]));
        for at in 4..bytes.len() {
            let mut damaged = bytes.to_vec();
            damaged[at] ^= 0x40;
            assert!(Frame::parse(&Bytes::from(damaged)).is_err(), "byte {at} changed");
        }
        assert_eq!(
            Frame::parse(&bytes.slice(..bytes.len() - 1)),
            Err(FrameError::Short { have: bytes.len() - 1, need: bytes.len() })
        );
    }
}
