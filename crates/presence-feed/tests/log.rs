//! The feed log against what it promises: every frame after a cursor once and
//! in order, in memory and on disk, across reopening, a torn write and
//! retention (F1, F2).

use std::path::PathBuf;

use bytes::Bytes;
use presence_feed::{Cursor, FeedLog, Frame, FrameKind, ReadError, Retention};

const FOREVER: Retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: u64::MAX / 2 };

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("presence-feed-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Frames at positions `from..to`, store time = position, a body of 40 bytes.
fn frames(from: u64, to: u64) -> Vec<Frame> {
    (from..to)
        .map(|position| {
            let id = format!("user-{}", position % 97);
            Frame::new(position, (position % 1024) as u32, FrameKind::Flip, position, id.as_bytes(), &[7; 40])
        })
        .collect()
}

/// Every frame after `after`, read in batches of about `batch` bytes.
fn read_all(log: &FeedLog, mut after: Cursor, batch: usize) -> Vec<u64> {
    let mut positions = Vec::new();
    loop {
        let read = log.read(after, batch).unwrap();
        if read.frames.is_empty() {
            assert_eq!(read.end, log.end(), "an empty read is complete to the log's end");
            return positions;
        }
        positions.extend(read.frames.iter().map(Frame::position));
        after = read.end;
    }
}

#[test]
fn f1_a_reader_gets_every_frame_after_its_cursor_once_in_order_in_memory_and_on_disk() {
    let dir = scratch("every-frame");
    let (disk, recovery) = FeedLog::open(&dir, Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 30 }).unwrap();
    assert_eq!((recovery.clean, recovery.frames), (false, 0));
    let memory = FeedLog::in_memory(FOREVER, Cursor::START);
    for log in [&disk, &memory] {
        for batch in 0..50 {
            log.append(&frames(1 + batch * 1_000, 1 + (batch + 1) * 1_000), 0, 0).unwrap();
        }
        let all: Vec<u64> = (1..=50_000).collect();
        assert_eq!(read_all(log, Cursor::START, 10_000), all);
        let after = Cursor { position: 12_345, slot: (12_345 % 1024) as u32 };
        assert_eq!(read_all(log, after, 64 << 10), all[12_345..]);
        assert_eq!(log.end(), Cursor { position: 50_000, slot: (50_000 % 1024) as u32 });
        log.append(&[], 60_000, 0).unwrap();
        assert_eq!(log.end(), Cursor::through(60_000), "a batch with nothing moves the end");
        assert_eq!(log.read(log.end(), 1 << 20).unwrap().frames.len(), 0);
    }
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn f2_a_disk_log_reopens_with_every_synced_frame_and_says_whether_it_was_closed() {
    let dir = scratch("reopen");
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 30 };
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    log.append(&frames(1, 20_001), 0, 0).unwrap();
    log.close().unwrap();
    drop(log);
    let (log, recovery) = FeedLog::open(&dir, retention).unwrap();
    assert_eq!((recovery.clean, recovery.last_position, recovery.frames), (true, 20_000, 20_000));
    assert_eq!(read_all(&log, Cursor::START, 1 << 20), (1..=20_000).collect::<Vec<_>>());
    log.append(&frames(20_001, 20_101), 0, 0).unwrap();
    drop(log);
    let (log, recovery) = FeedLog::open(&dir, retention).unwrap();
    assert!(!recovery.clean, "not closed: the next open knows");
    assert_eq!(recovery.last_position, 20_100);
    assert_eq!(
        read_all(&log, Cursor { position: 20_000, slot: (20_000 % 1024) as u32 }, 1 << 20),
        (20_001..=20_100).collect::<Vec<_>>()
    );
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn f2_a_cursor_through_an_end_past_the_last_frame_stays_in_range_after_an_orderly_close() {
    let dir = scratch("closed-end");
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 30 };
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    log.append(&frames(1, 101), 0, 0).unwrap();
    // Batches with no frame move the end: a progress event hands out a cursor through it.
    log.append(&[], 500, 0).unwrap();
    let progress = log.end();
    assert_eq!(progress, Cursor::through(500));
    log.close().unwrap();
    drop(log);
    let (log, recovery) = FeedLog::open(&dir, retention).unwrap();
    assert_eq!((recovery.clean, recovery.last_position), (true, 500), "complete through the end it closed at");
    assert_eq!(log.end(), progress);
    assert_eq!(log.read(progress, 1 << 20).unwrap().frames.len(), 0);
    log.append(&frames(501, 511), 0, 0).unwrap();
    assert_eq!(read_all(&log, progress, 1 << 20), (501..=510).collect::<Vec<_>>());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn f2_a_write_torn_by_a_crash_is_cut_off_and_named_and_the_frames_before_it_stay() {
    let dir = scratch("torn");
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 30 };
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    log.append(&frames(1, 1_001), 0, 0).unwrap();
    drop(log);
    let segment = std::fs::read_dir(&dir)
        .unwrap()
        .map(|entry| entry.unwrap().path())
        .find(|path| path.extension().is_some_and(|ext| ext == "feed"))
        .unwrap();
    let whole = std::fs::read(&segment).unwrap();
    let torn = frames(1_001, 1_002)[0].bytes().clone();
    let mut bytes = whole.clone();
    bytes.extend_from_slice(&torn[..torn.len() / 2]);
    std::fs::write(&segment, &bytes).unwrap();
    let (log, recovery) = FeedLog::open(&dir, retention).unwrap();
    assert!(!recovery.clean);
    assert_eq!(recovery.repairs.len(), 1, "{:?}", recovery.repairs);
    assert!(recovery.repairs[0].contains("cut off"), "{:?}", recovery.repairs);
    assert_eq!(std::fs::read(&segment).unwrap(), whole, "cut back to the last whole frame");
    assert_eq!(read_all(&log, Cursor::START, 1 << 20).len(), 1_000);
    log.append(&frames(1_001, 1_101), 0, 0).unwrap();
    assert_eq!(read_all(&log, Cursor::START, 1 << 20), (1..=1_100).collect::<Vec<_>>());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn f2_retention_by_bytes_and_age_refuses_older_cursors_naming_the_oldest_even_after_a_reopen() {
    let dir = scratch("retention");
    let by_bytes = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 20 };
    let (disk, _) = FeedLog::open(&dir, by_bytes).unwrap();
    let memory = FeedLog::in_memory(by_bytes, Cursor::START);
    for log in [&disk, &memory] {
        for batch in 0..100 {
            log.append(&frames(1 + batch * 1_000, 1 + (batch + 1) * 1_000), 0, 0).unwrap();
        }
        assert!(log.bytes() <= 1 << 20, "{} bytes kept", log.bytes());
        let oldest = log.oldest();
        assert!(oldest.position > 50_000, "retention removed the oldest frames: {oldest:?}");
        match log.read(Cursor { position: 10, slot: 10 }, 1 << 20) {
            Err(ReadError::OutOfRange(refused)) => assert_eq!(refused.oldest, oldest),
            other => panic!("a cursor past retention: {other:?}"),
        }
        let kept = read_all(log, oldest, 1 << 16);
        assert_eq!(kept.first(), Some(&(oldest.position + 1)), "from the oldest, nothing missing");
        assert_eq!(kept.last(), Some(&100_000));
    }
    let oldest = disk.oldest();
    drop(disk);
    let (disk, _) = FeedLog::open(&dir, by_bytes).unwrap();
    assert_eq!(disk.oldest(), oldest, "what retention removed stays removed after a reopen");
    assert!(matches!(disk.read(Cursor::START, 1), Err(ReadError::OutOfRange(_))));

    let by_age = Retention { max_age_ms: 10_000, max_bytes: 1 << 30 };
    let memory = FeedLog::in_memory(by_age, Cursor::START);
    memory.append(&frames(1, 1_001), 0, 1_000).unwrap();
    memory.append(&frames(1_001, 2_001), 0, 1_500 + 10_000).unwrap();
    assert_eq!(memory.oldest().position, 1_499, "frames older than 10 s at 11.5 s are gone");
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn a_frame_body_is_read_back_as_written() {
    let log = FeedLog::in_memory(FOREVER, Cursor::START);
    let frame = Frame::new(5, 3, FrameKind::Gap, 9, b"", b"gap body");
    log.append(std::slice::from_ref(&frame), 0, 0).unwrap();
    let read = log.read(Cursor::START, 1).unwrap();
    assert_eq!(read.frames, vec![frame]);
    assert_eq!(read.frames[0].body(), Bytes::from_static(b"gap body"));
}

#[test]
fn f3_a_read_of_some_slots_gets_exactly_their_frames_after_a_cursor_from_segments_tail_and_a_reopened_log() {
    let dir = scratch("slots");
    // More than the 32 MiB of newest frames a log on disk keeps in memory,
    // less than it keeps on disk: the oldest frames are read from segments.
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 40 << 20 };
    let wanted = |slot: u32| slot % 10 == 3 || slot == 1000;
    let expected = |log: &FeedLog, after: Cursor| -> Vec<u64> {
        let all = read_all(log, after, 1 << 16);
        all.into_iter().filter(|position| wanted((position % 1024) as u32)).collect()
    };
    let read = |log: &FeedLog, after: Cursor| -> Vec<u64> {
        let read = log.read_slots(after, &wanted).unwrap();
        assert_eq!(read.end, log.end(), "complete to the log's end");
        read.frames.iter().map(Frame::position).collect()
    };
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    for batch in 0..60u64 {
        log.append(&frames(1 + batch * 10_000, 1 + (batch + 1) * 10_000), 0, 0).unwrap();
    }
    let oldest = log.oldest();
    assert!(oldest.position > 1, "retention removed some segments: {oldest:?}");
    for after in [oldest, Cursor::through(200_000), Cursor::through(599_990), log.end()] {
        let got = read(&log, after);
        assert_eq!(got, expected(&log, after), "after {after:?}");
    }
    assert!(!read(&log, oldest).is_empty());
    assert!(matches!(log.read_slots(Cursor::START, &wanted), Err(ReadError::OutOfRange(_))), "before the oldest");
    log.close().unwrap();
    drop(log);
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    assert_eq!(read(&log, log.oldest()), expected(&log, log.oldest()), "the index is built again at open");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn f2_a_log_on_disk_opens_reading_only_its_newest_segment_and_a_read_waits_for_the_older_ones() {
    let dir = scratch("older-segments");
    // Segments of 128 KiB: eight batches of 70 KB make several.
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 20 };
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    for batch in 0..8u64 {
        log.append(&frames(1 + batch * 1_000, 1 + (batch + 1) * 1_000), 0, 0).unwrap();
    }
    log.close().unwrap();
    drop(log);
    let segments = std::fs::read_dir(&dir)
        .unwrap()
        .filter(|entry| entry.as_ref().unwrap().file_name().to_string_lossy().ends_with(".feed"));
    assert!(segments.count() > 2, "several segments");
    let (log, recovery) = FeedLog::open(&dir, retention).unwrap();
    assert_eq!((recovery.clean, recovery.last_position), (true, 8_000));
    assert!(recovery.frames < 8_000, "only the newest segment is read at open: {}", recovery.frames);
    // Appended at once, before the older segments are in: nothing is lost or trimmed.
    log.append(&frames(8_001, 8_101), 0, 0).unwrap();
    assert_eq!(read_all(&log, Cursor::START, 1 << 16), (1..=8_100).collect::<Vec<_>>());
    assert_eq!(log.oldest(), Cursor::START);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn c7_a_move_reads_the_batch_being_synced_and_every_frame_of_its_slots_once() {
    let dir = scratch("unsynced");
    let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 1 << 30 };
    let (log, _) = FeedLog::open(&dir, retention).unwrap();
    let log = std::sync::Arc::new(log);
    let wanted = |slot: u32| slot % 7 == 2;
    const BATCH: u64 = 50_000;
    const BATCHES: u64 = 30;
    let writer = {
        let log = std::sync::Arc::clone(&log);
        std::thread::spawn(move || {
            for batch in 0..BATCHES {
                log.append(&frames(1 + batch * BATCH, 1 + (batch + 1) * BATCH), 0, 0).unwrap();
            }
        })
    };
    let (mut reads, mut ahead_of_the_disk) = (0, 0);
    while !writer.is_finished() {
        let read = log.read_slots_unsynced(Cursor::START, &wanted).unwrap();
        let synced_after = log.end();
        let got: Vec<u64> = read.frames.iter().map(Frame::position).collect();
        let expected: Vec<u64> = (1..=read.end.position).filter(|position| wanted((position % 1024) as u32)).collect();
        assert_eq!(got, expected, "every frame of the slots through the read's end, once, in order");
        if read.end > synced_after {
            ahead_of_the_disk += 1;
        }
        reads += 1;
    }
    writer.join().unwrap();
    assert!(ahead_of_the_disk > 0, "a read found a batch before its sync ({reads} reads)");
    assert_eq!(log.end_unsynced(), log.end(), "nothing is being written any more");
    let _ = std::fs::remove_dir_all(&dir);
}
