//! A consumer's place in the feed.

/// The place just after one entry of the feed: a consumer that resumes from
/// it receives every entry after it (F1). Ordered by position, then slot,
/// which orders the entries of every slot of a cluster as one sequence.
///
/// On the wire it is opaque bytes ([`Cursor::encode`]): a format byte, the
/// position and the slot, big-endian, so that a later format can be told
/// apart and refused rather than misread.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Cursor {
    /// The entry's position.
    pub position: u64,
    /// The entry's slot.
    pub slot: u32,
}

/// The format byte of [`Cursor::encode`].
const FORMAT: u8 = 1;

/// The length of an encoded cursor.
pub(crate) const ENCODED_LEN: usize = 13;

/// Why bytes are not a cursor.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CursorError {
    /// Not 13 bytes.
    #[error("a cursor is {ENCODED_LEN} bytes, not {0}")]
    Length(usize),
    /// A format this build does not know.
    #[error("cursor format {0} is not one this server reads (it reads format {FORMAT})")]
    Format(u8),
}

impl Cursor {
    /// The cursor before every entry.
    pub const START: Cursor = Cursor { position: 0, slot: 0 };

    /// The cursor just after every entry up to `position` of every slot
    /// ([`Cursor::START`] for 0: no entry has position 0).
    pub fn through(position: u64) -> Cursor {
        if position == 0 { Cursor::START } else { Cursor { position, slot: u32::MAX } }
    }

    /// The bytes a consumer stores.
    pub fn encode(&self) -> [u8; ENCODED_LEN] {
        let mut bytes = [0; ENCODED_LEN];
        bytes[0] = FORMAT;
        bytes[1..9].copy_from_slice(&self.position.to_be_bytes());
        bytes[9..13].copy_from_slice(&self.slot.to_be_bytes());
        bytes
    }

    /// Reads what [`Cursor::encode`] wrote.
    pub fn decode(bytes: &[u8]) -> Result<Cursor, CursorError> {
        if bytes.len() != ENCODED_LEN {
            return Err(CursorError::Length(bytes.len()));
        }
        if bytes[0] != FORMAT {
            return Err(CursorError::Format(bytes[0]));
        }
        let position = u64::from_be_bytes(bytes[1..9].try_into().expect("8 bytes"));
        let slot = u32::from_be_bytes(bytes[9..13].try_into().expect("4 bytes"));
        Ok(Cursor { position, slot })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cursor_reads_back_as_written_and_bad_bytes_are_named() {
        let cursor = Cursor { position: 1 << 40, slot: 1023 };
        assert_eq!(Cursor::decode(&cursor.encode()), Ok(cursor));
        assert_eq!(Cursor::decode(&[1; 4]), Err(CursorError::Length(4)));
        let mut later = cursor.encode();
        later[0] = 2;
        assert_eq!(Cursor::decode(&later), Err(CursorError::Format(2)));
        assert!(Cursor { position: 5, slot: 9 } < Cursor { position: 6, slot: 0 });
        assert!(Cursor { position: 5, slot: 9 } < Cursor::through(5));
    }
}
