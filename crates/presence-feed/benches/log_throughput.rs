//! The feed log's own throughput (F2): frames of the size a flip takes
//! appended by group commit (one write and one `fdatasync` per batch, as the
//! server's writer does every 5 ms), then read back from the oldest by a
//! consumer catching up, in the batches a `Changes` stream reads.
//!
//! `cargo bench -p presence-feed --bench log_throughput` (env: FRAMES, BATCH,
//! FEED_BENCH_DIR: a directory on the disk to measure, default under target/).

use std::time::Instant;

use presence_feed::{Cursor, FeedLog, Frame, FrameKind, Retention};

fn main() {
    let frames: u64 = std::env::var("FRAMES").ok().and_then(|v| v.parse().ok()).unwrap_or(2_000_000);
    let batch: u64 = std::env::var("BATCH").ok().and_then(|v| v.parse().ok()).unwrap_or(5_000);
    let dir = std::env::var("FEED_BENCH_DIR").map_or_else(
        |_| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target/feed-bench"),
        std::path::PathBuf::from,
    );
    let _ = std::fs::remove_dir_all(&dir);
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 40 };
    let (log, _) = FeedLog::open(&dir, retention).expect("open the log");
    // A flip as the server writes it: a 10-byte user id, a body of about 40 bytes.
    let body = [0x12u8; 40];
    let make = |position: u64| {
        let id = format!("user-{:05}", position % 100_000);
        Frame::new(position, (position % 1024) as u32, FrameKind::Flip, 1_800_000_000_000, id.as_bytes(), &body)
    };
    let started = Instant::now();
    let mut position = 1;
    let mut syncs = 0;
    while position <= frames {
        let end = (position + batch).min(frames + 1);
        let built: Vec<Frame> = (position..end).map(make).collect();
        log.append(&built, 0, 0).expect("append");
        syncs += 1;
        position = end;
    }
    let wrote = started.elapsed();
    let bytes = log.bytes();
    println!(
        "append: {frames} frames ({bytes} bytes, {:.0} B each) in {syncs} synced batches of {batch}: {:.2} s, {:.0} frames/s, {:.1} MB/s",
        bytes as f64 / frames as f64,
        wrote.as_secs_f64(),
        frames as f64 / wrote.as_secs_f64(),
        bytes as f64 / wrote.as_secs_f64() / 1e6
    );
    drop(log);
    // A fresh open: every frame is on disk (the page cache holds it: this is
    // the log's cost, not the device's).
    let (log, _) = FeedLog::open(&dir, retention).expect("open the log again");
    let started = Instant::now();
    let mut after = Cursor::START;
    let mut read = 0u64;
    loop {
        let got = log.read(after, 256 << 10).expect("read");
        if got.frames.is_empty() {
            break;
        }
        read += got.frames.len() as u64;
        after = got.end;
    }
    let took = started.elapsed();
    println!(
        "read back: {read} frames in {:.2} s, {:.0} frames/s",
        took.as_secs_f64(),
        read as f64 / took.as_secs_f64()
    );
    std::fs::remove_dir_all(&dir).expect("remove the bench's log");
}
