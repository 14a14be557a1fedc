//! F2: an in-memory feed's byte cap (`--feed-retention-bytes`) bounds what
//! it really takes, not only its frames' encoded size. This test binary
//! counts every byte the process allocates and frees, fills a log to three
//! times its cap, and holds the growth to the cap and a tenth.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicIsize, Ordering};

use presence_feed::{Cursor, FeedLog, Frame, FrameKind, Retention};

/// The system allocator, counting the bytes live.
struct Counting;

static LIVE: AtomicIsize = AtomicIsize::new(0);

// SAFETY: every call goes to the system allocator with the caller's
// arguments; the counter only adds and subtracts the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as the caller's.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as the caller's.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        LIVE.fetch_add(new_size as isize - layout.size() as isize, Ordering::Relaxed);
        // SAFETY: as the caller's.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static COUNTING: Counting = Counting;

/// A batch of `count` flips from `first`, each the size of a real one: a
/// user id of 12 bytes and a body of 44 (the server's encoded change).
fn flips(first: u64, count: u64) -> Vec<Frame> {
    (first..first + count)
        .map(|position| {
            let id = format!("user-{:07}", position % 10_000_000);
            Frame::new(position, (position % 16_384) as u32, FrameKind::Flip, 1_000, id.as_bytes(), &[7u8; 44])
        })
        .collect()
}

#[test]
fn f2_an_in_memory_log_filled_past_its_cap_grows_the_process_by_at_most_its_cap_and_a_tenth() {
    for cap in [1u64 << 20, 8 << 20, 32 << 20] {
        let log = FeedLog::in_memory(Retention { max_age_ms: u64::MAX / 2, max_bytes: cap }, Cursor::START);
        let before = LIVE.load(Ordering::Relaxed);
        let (mut next, mut appended, mut highest) = (1u64, 0u64, 0isize);
        while appended < 3 * cap {
            let batch = flips(next, 100);
            appended += batch.iter().map(|frame| frame.len() as u64).sum::<u64>();
            next += 100;
            log.append(&batch, next - 1, 1_000).unwrap();
            drop(batch);
            highest = highest.max(LIVE.load(Ordering::Relaxed) - before);
        }
        let grown = (LIVE.load(Ordering::Relaxed) - before) as u64;
        let frame = flips(1, 1)[0].len() as u64;
        eprintln!(
            "cap {cap}: {appended} bytes appended, the process grew by {grown} (highest {highest}), the log counts {}; \
             {} of {} frames kept",
            log.bytes(),
            next - log.oldest().position - 1,
            next - 1
        );
        assert!(grown <= cap + cap / 10, "cap {cap}: the process grew by {grown}");
        assert!(highest as u64 <= cap + cap / 10, "cap {cap}: the process grew by {highest} at its highest");
        assert!(log.bytes() <= cap, "the log counts {} against a cap of {cap}", log.bytes());
        // It keeps most of what its cap allows: frames and their slots.
        let kept = next - log.oldest().position - 1;
        assert!(kept * frame >= cap / 2, "cap {cap}: only {kept} frames of {frame} bytes kept");
        // What it keeps reads back, from the oldest on.
        let read = log.read(log.oldest(), 1 << 20).unwrap();
        assert_eq!(read.frames.first().map(Frame::position), Some(log.oldest().position + 1));
        drop(read);
        drop(log);
        let left = LIVE.load(Ordering::Relaxed) - before;
        assert!(left <= 4 << 10, "cap {cap}: {left} bytes left behind by a dropped log");
    }
}
