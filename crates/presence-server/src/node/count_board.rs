//! Which watched rooms' counts may have changed (R7), so that a stream of
//! many rooms' counts reads again only those, not all of its rooms at every
//! interval.
//!
//! A room some count stream watches has one cell here, shared by every
//! stream that watches it. Whatever may change what a room's count is
//! (any room change the store publishes, a change of its access, a change
//! of its members' relations, facts taken in from other nodes) touches the
//! cell after the change is made: it stamps it with the board's next
//! sequence number. A stream notes the board's sequence before it reads;
//! next time it reads again exactly the rooms stamped since. A room no
//! stream watches has no cell, and touching it costs one map lookup.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use dashmap::DashMap;
use presence_core::CompactString;

/// The cells of the rooms count streams watch in this process.
#[derive(Debug)]
pub(crate) struct CountBoard {
    cells: DashMap<CompactString, Arc<CountCell>>,
    /// Starts above a new cell's stamp (0), which is then never read as touched.
    sequence: AtomicU64,
}

impl Default for CountBoard {
    fn default() -> Self {
        CountBoard { cells: DashMap::new(), sequence: AtomicU64::new(1) }
    }
}

/// One watched room's stamp: the board's sequence when it was last touched.
#[derive(Debug, Default)]
pub(crate) struct CountCell {
    touched: AtomicU64,
}

impl CountBoard {
    /// The room's cell, made if no stream watched it yet; give it back with
    /// [`CountBoard::release`].
    pub(crate) fn watch(&self, room_id: &CompactString) -> Arc<CountCell> {
        Arc::clone(&self.cells.entry(room_id.clone()).or_default())
    }

    /// A stream no longer watches the room: its cell goes with its last watcher.
    pub(crate) fn release(&self, room_id: &str, cell: Arc<CountCell>) {
        drop(cell);
        // Held only by the board now: nobody watches the room.
        self.cells.remove_if(room_id, |_, cell| Arc::strong_count(cell) == 1);
    }

    /// Something that may change the room's count was just done.
    pub(crate) fn touch(&self, room_id: &str) {
        if let Some(cell) = self.cells.get(room_id) {
            cell.touched.store(self.sequence.fetch_add(1, Ordering::AcqRel) + 1, Ordering::Release);
        }
    }

    /// Where a stream about to read stands: pass it to [`CountCell::touched_since`] next time.
    pub(crate) fn now(&self) -> u64 {
        self.sequence.load(Ordering::Acquire)
    }

    /// Rooms some stream watches.
    #[cfg(test)]
    pub(crate) fn watched(&self) -> usize {
        self.cells.len()
    }
}

impl CountCell {
    /// Whether the room was touched at or after `stamp`, a [`CountBoard::now`]
    /// taken before the last read. At, not only after: a touch takes its
    /// number before it stamps the cell, so a read between the two has seen
    /// the number in `now` but not the stamp; reading such a room once more
    /// costs one count.
    pub(crate) fn touched_since(&self, stamp: u64) -> bool {
        self.touched.load(Ordering::Acquire) >= stamp
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn r7_a_stream_reads_again_only_the_rooms_touched_since_its_last_read() {
        let board = CountBoard::default();
        let (a, b) = (board.watch(&"a".into()), board.watch(&"b".into()));
        assert!(!a.touched_since(board.now()), "a new cell is not touched");
        board.touch("a");
        let read = board.now();
        assert!(a.touched_since(read), "touched at the stamp read: read once more");
        board.touch("b");
        board.touch("nobody-watches-this");
        let next = board.now();
        assert!(b.touched_since(read) && !a.touched_since(next) && !b.touched_since(next + 1));
    }

    #[test]
    fn r7_a_rooms_cell_goes_with_its_last_watcher() {
        let board = CountBoard::default();
        let room: CompactString = "lobby".into();
        let (first, second) = (board.watch(&room), board.watch(&room));
        assert!(Arc::ptr_eq(&first, &second), "two streams of one room share its cell");
        board.release(&room, first);
        assert_eq!(board.watched(), 1);
        board.release(&room, second);
        assert_eq!(board.watched(), 0);
    }
}
