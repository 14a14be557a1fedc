//! The change feed's log (contract F1, F2): what a backend reads to learn of
//! every flip, status change and room occupancy change, from a cursor.
//!
//! - [`Cursor`]: the opaque position a consumer stores and resumes from.
//! - [`Frame`]: one entry as stored and as read, the same bytes in memory and
//!   on disk, with its position, slot, kind, store time and id readable
//!   without decoding its body (the wire message, which the server encodes).
//! - [`FeedLog`]: frames in position order, retained by age and bytes, packed
//!   in blocks in memory or in segment files written by group commit, read
//!   from a cursor by any number of readers while one writer appends.
//!
//! No async runtime and no clock here: the server's writer task calls
//! [`FeedLog::append`] with what it drained and `now`, and readers call
//! [`FeedLog::read`] when the log's end moves.

mod cursor;
mod frame;
mod log;
mod segment;
mod tail;

pub use cursor::{Cursor, CursorError};
pub use frame::{Frame, FrameError, FrameKind};
pub use log::{FeedLog, OutOfRange, Read, ReadError, Recovery, Retention};
