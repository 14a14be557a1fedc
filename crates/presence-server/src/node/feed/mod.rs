//! The change feed: its writer and `Changes` streams (here), its webhooks, and its frames, events and JSON (`wire.rs`).
//! It may name the node's clock and the client API's conversions of a user (`node/wire.rs`); nothing else of `node/`.
//!
//! This file (F1, F2): the writer that moves what the store recorded into
//! the log, and the `Changes` streams that read the log.
//!
//! The store records every flip, status change and room occupancy change in
//! its intake, under the lock that made it (`presence_core::feed`). A writer
//! thread drains the intake every [`COMMIT_INTERVAL`] and appends the batch
//! to the log: with a data directory, written and synced with one
//! `fdatasync` (group commit) before any stream can read it, so an event a
//! consumer received is never lost by a crash; without one, a ring in
//! memory. Renewals and registers that change nothing record nothing.
//!
//! A stream reads the log from its cursor in batches, on the blocking pool
//! (a consumer catching up reads the disk), and waits for the log's end to
//! move once it has caught up. Nothing is queued per consumer beyond one
//! batch: a slow consumer reads the log at its own pace, and one that falls
//! behind retention is ended with `OUT_OF_RANGE`.
//!
//! What the feed could not keep is an explicit gap (F2): the changes of a
//! process that stopped without closing its feed, a batch the disk refused,
//! an intake the writer let overflow.

pub(crate) mod webhook;
pub(crate) mod wire;

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use presence_core::{FeedIntake, SlotSet, Tick, slot_of};
use presence_feed::{Cursor, FeedLog, Frame, ReadError, Retention};
use presence_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

use self::wire::{ChangesFilter, ChangesFrom, GapReason};
use crate::error::ServiceError;
use crate::metrics::names;
use crate::node::clock::StoreClock;

/// How often the writer drains the intake: the longest a change waits
/// before it is written (plus the sync).
pub(crate) const COMMIT_INTERVAL: Duration = Duration::from_millis(5);
/// How often a move looks whether the writer took what it waits for: a
/// freeze waits for it (C7), at most a commit interval and a batch's encoding.
const TAKEN_POLL: Duration = Duration::from_millis(1);
/// Most entries the intake holds between two drains before it drops what
/// comes next (and the writer marks a gap): about 100 MB, and far more than
/// a writer that keeps up ever sees.
const INTAKE_CAPACITY: usize = 1 << 20;
/// About how many bytes of frames a stream reads at a time.
const READ_BYTES: usize = 256 << 10;
/// A stream whose cursor moved without an event for it says so this often.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// How often this node's part of a cluster's merged stream says how far it
/// got: the merging node holds each event until every part passed it.
pub(crate) const NODE_PART_PROGRESS_EVERY: Duration = Duration::from_millis(50);
/// Slots of a single node's feed: a cluster's default, so that consumers
/// can share a single node's feed by slot as a cluster's.
pub(crate) const SINGLE_NODE_SLOTS: u32 = 1024;

/// Retention when none is given (F2, documented in docs/feed.md).
pub const DEFAULT_RETENTION_MS: u64 = 24 * 60 * 60 * 1000;
/// Bytes kept on disk when none is given.
pub const DEFAULT_RETENTION_BYTES_ON_DISK: u64 = 1 << 30;
/// Bytes kept in memory (no data directory) when none is given: about
/// 190,000 changes, and 6 bytes a session at 3M sessions (the store itself
/// takes 79); docs/feed.md says why this size.
pub const DEFAULT_RETENTION_BYTES_IN_MEMORY: u64 = 16 << 20;

/// The feed's metrics, made once.
#[derive(Debug)]
struct FeedMetrics {
    entries: metrics::Counter,
    write_seconds: metrics::Histogram,
    bytes: metrics::Gauge,
    streams: metrics::Gauge,
}

impl FeedMetrics {
    fn new() -> Self {
        FeedMetrics {
            entries: metrics::counter!(names::FEED_ENTRIES),
            write_seconds: metrics::histogram!(names::FEED_WRITE_SECONDS),
            bytes: metrics::gauge!(names::FEED_BYTES),
            streams: metrics::gauge!(names::FEED_STREAMS),
        }
    }

    fn gap(reason: GapReason) {
        let reason = match reason {
            GapReason::Restart => "restart",
            GapReason::Overflow => "overflow",
            GapReason::WriteFailed => "write_failed",
            // A webhook's own gaps, counted as its metrics.
            GapReason::Retention => "retention",
            GapReason::UnknownCursor => "unknown_cursor",
            GapReason::Takeover => "takeover",
        };
        metrics::counter!(names::FEED_GAPS, "reason" => reason).increment(1);
    }
}

/// The change feed of a node.
#[derive(Debug)]
pub(crate) struct Feed {
    log: FeedLog,
    intake: Arc<FeedIntake>,
    slots: u32,
    /// Where a log kept in memory began: nothing before it was ever
    /// recorded here (a cluster's merged stream asks this node's part from
    /// a cursor of the cluster's, which may be older).
    began_in_memory: Option<Cursor>,
    /// Entries of slots that other cluster nodes handed over to this one,
    /// with their positions (F3): served with this node's own.
    inherited: Mutex<Inherited>,
    /// Where the log is complete to, after each batch.
    end: watch::Sender<Cursor>,
    stop: AtomicBool,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// A batch the disk refused, to be marked as a gap by the next one.
    lost: Mutex<Option<(Cursor, u64, u64)>>,
    /// The writer's buffers, kept from batch to batch.
    buffers: Mutex<Buffers>,
    /// When `end` last moved without a frame: streams waiting for frames
    /// wake for the end alone only this often.
    end_moved: Mutex<Instant>,
    metrics: FeedMetrics,
}

/// What the writer keeps between batches, so that a batch allocates
/// nothing once the first few have grown them: the intake's vector, handed
/// back emptied to take the next batch's entries; the buffer a batch's
/// frames are packed into; the list of those frames.
#[derive(Debug, Default)]
struct Buffers {
    spare: Vec<presence_core::FeedEntry>,
    packed: bytes::BytesMut,
    frames: Vec<Frame>,
}

/// The most entries of a batch the writer's buffers are kept at (about
/// 4 MB in all): a flood past it lets them go, not keep them for good.
const KEPT_BUFFER_ENTRIES: usize = 1 << 14;
/// The fewest entries they are kept at.
const LEAST_BUFFER_ENTRIES: usize = 1 << 8;
/// About what a frame takes, for the packed buffer's share.
const FRAME_BYTES: usize = 128;

impl Buffers {
    /// Sizes the buffers for a batch of `entries` after one of as many: a
    /// flood grows them once and keeps them while it lasts, and they
    /// shrink back as batches get small again (so an idle feed holds a few
    /// kilobytes, not its busiest batch).
    fn fit(&mut self, entries: usize) {
        let wanted = (entries * 2).next_power_of_two().clamp(LEAST_BUFFER_ENTRIES, KEPT_BUFFER_ENTRIES);
        if self.spare.capacity() > 2 * wanted {
            self.spare = Vec::with_capacity(wanted);
        }
        if self.frames.capacity() > 2 * wanted {
            self.frames = Vec::with_capacity(wanted);
        }
        if self.packed.capacity() > 2 * wanted * FRAME_BYTES {
            self.packed = bytes::BytesMut::with_capacity(wanted * FRAME_BYTES);
        }
    }
}

/// How often streams hear that the end moved with no frame (for progress).
const END_WITHOUT_FRAMES_EVERY: Duration = Duration::from_millis(250);

/// How the log was found when the feed opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Opened {
    /// A gap was marked: the process before did not close the feed.
    pub(crate) gap: bool,
    /// Frames found on disk.
    pub(crate) frames: u64,
}

impl Feed {
    /// Opens the feed: the log in `dir` (checked, a torn tail cut off, a
    /// gap marked if the process before did not close it), or a ring in
    /// memory that starts now. `now` is the store time.
    pub(crate) fn open(
        dir: Option<&Path>,
        retention: Retention,
        slots: u32,
        now: Tick,
    ) -> std::io::Result<(Arc<Feed>, Opened)> {
        let floor = now << presence_core::stamp::COUNTER_BITS;
        let (log, after, opened) = match dir {
            None => (FeedLog::in_memory(retention, Cursor::through(floor)), floor, Opened { gap: false, frames: 0 }),
            Some(dir) => {
                let (log, recovery) = FeedLog::open(dir, retention)?;
                for repair in &recovery.repairs {
                    tracing::warn!(%repair, "the change feed's last write was torn; cut off");
                }
                let held = recovery.frames > 0 || log.oldest() != Cursor::START;
                let mut after = recovery.last_position;
                let gap = held && !recovery.clean;
                if gap {
                    let position = floor.max(after + 1);
                    let frame = wire::gap_frame(position, log.end(), GapReason::Restart, 0, now);
                    log.append(&[frame], 0, now)?;
                    after = position;
                    tracing::warn!(
                        after = recovery.last_position,
                        "the change feed was not closed by the process before: a gap marks what it may have lost"
                    );
                }
                (log, after, Opened { gap, frames: recovery.frames })
            }
        };
        let end = watch::Sender::new(log.end());
        let began_in_memory = dir.is_none().then(|| log.oldest());
        let feed = Feed {
            log,
            intake: FeedIntake::new(INTAKE_CAPACITY, after),
            slots,
            began_in_memory,
            inherited: Mutex::new(Inherited::default()),
            end,
            stop: AtomicBool::new(false),
            writer: Mutex::new(None),
            lost: Mutex::new(None),
            buffers: Mutex::new(Buffers::default()),
            end_moved: Mutex::new(Instant::now()),
            metrics: FeedMetrics::new(),
        };
        if opened.gap {
            FeedMetrics::gap(GapReason::Restart);
        }
        Ok((Arc::new(feed), opened))
    }

    /// Where the store records what the feed carries.
    pub(crate) fn intake(&self) -> Arc<FeedIntake> {
        Arc::clone(&self.intake)
    }

    /// The slots of the feed's users and rooms.
    pub(crate) fn slots(&self) -> u32 {
        self.slots
    }

    /// Starts the writer thread.
    pub(crate) fn start(self: &Arc<Self>, clock: StoreClock) {
        let feed = Arc::clone(self);
        let writer = std::thread::Builder::new()
            .name("presenced-feed".into())
            .spawn(move || {
                while !feed.stop.load(Ordering::Acquire) {
                    std::thread::sleep(COMMIT_INTERVAL);
                    feed.write_batch(clock.now());
                }
            })
            .expect("the feed's writer thread starts");
        *self.writer.lock() = Some(writer);
    }

    /// Drains the intake and appends what it held: one write and one sync.
    fn write_batch(&self, now: Tick) {
        let mut buffers = self.buffers.lock();
        let Buffers { spare, packed, frames } = &mut *buffers;
        let drained = self.intake.drain_reusing(now, std::mem::take(spare));
        frames.clear();
        if let Some((after, position, lost)) = self.lost.lock().take() {
            FeedMetrics::gap(GapReason::WriteFailed);
            frames.push(wire::gap_frame(position, after, GapReason::WriteFailed, lost, now));
        }
        for entry in &drained.entries {
            wire::append_feed_frame(packed, entry, slot_of(entry.event.id(), self.slots));
        }
        frames.extend(Frame::packed(packed.split().freeze()));
        if let Some(dropped) = drained.dropped {
            let after = frames.last().map_or(self.log.end(), Frame::cursor);
            tracing::error!(count = dropped.count, "the change feed's writer fell behind; a gap marks what it dropped");
            FeedMetrics::gap(GapReason::Overflow);
            frames.push(wire::gap_frame(dropped.last, after, GapReason::Overflow, dropped.count, now));
        }
        let started = Instant::now();
        let appended = self.log.append(frames, drained.through, now);
        if !frames.is_empty() {
            self.metrics.write_seconds.record(started.elapsed().as_secs_f64());
        }
        match appended {
            Ok(()) => {
                self.metrics.entries.increment(frames.len() as u64);
                self.metrics.bytes.set(self.log.bytes() as f64);
                let mut end_moved = self.end_moved.lock();
                if !frames.is_empty() || end_moved.elapsed() >= END_WITHOUT_FRAMES_EVERY {
                    *end_moved = Instant::now();
                    // Retention by age for what other nodes handed over, as for the log.
                    self.inherited.lock().take(Vec::new(), self.log.retention(), now);
                    self.end.send_replace(self.log.end());
                }
            }
            Err(err) => {
                // Nothing of the batch is visible: the next one starts with a gap in its place.
                tracing::error!(%err, frames = frames.len(), "cannot write the change feed; a gap marks the batch");
                if let Some(last) = frames.last() {
                    let mut lost = self.lost.lock();
                    let count = lost.map_or(0, |(_, _, count)| count) + frames.len() as u64;
                    let after = lost.map_or(self.log.end(), |(after, _, _)| after);
                    *lost = Some((after, last.position(), count));
                }
            }
        }
        // The log copied what it keeps: the buffers go back for the next batch.
        frames.clear();
        let mut entries = drained.entries;
        let batch = entries.len();
        entries.clear();
        *spare = entries;
        buffers.fit(batch);
    }

    /// Stops the writer, writes what is left and closes the log, so that
    /// the next process knows it lost nothing (no gap).
    pub(crate) fn close(&self, now: Tick) {
        self.stop.store(true, Ordering::Release);
        if let Some(writer) = self.writer.lock().take() {
            let _ = writer.join();
        }
        self.write_batch(now);
        if let Err(err) = self.log.close() {
            tracing::error!(%err, "cannot close the change feed; the next start marks a gap");
        }
    }

    /// Reads into `carried` what the log holds of its slots after what it
    /// read before (the first time, from the oldest retained entry, with the
    /// entries other nodes handed over): a planned move reads the log once,
    /// then only what came since for each of its rounds (F3).
    pub(crate) fn read_for_move(&self, carried: &mut Carried) -> std::io::Result<()> {
        if carried.after.is_none() {
            let inherited = self.inherited.lock();
            let theirs = inherited.frames.values().filter(|frame| carried.holds(frame)).cloned().collect::<Vec<_>>();
            drop(inherited);
            carried.entries.extend(theirs);
            carried.after = Some(self.log.oldest());
        }
        let mut after = carried.after.unwrap_or(Cursor::START);
        // The log's index of its frames by slot finds them: no other is read.
        let slots = carried.slots.clone();
        let wanted = move |slot: u32| slot == u32::MAX || slots.contains(slot);
        let read = loop {
            match self.log.read_slots_unsynced(after, &wanted) {
                Ok(read) => break read,
                // Retention moved on while this read: what is left is newer.
                Err(ReadError::OutOfRange(out)) => after = out.oldest,
                Err(ReadError::Io(err)) => return Err(std::io::Error::other(err)),
            }
        };
        after = after.max(read.end);
        carried.entries.extend(read.frames);
        carried.after = Some(after);
        Ok(())
    }

    /// Returns once the writer has taken everything up to `position`
    /// (recorded before the call) from the intake into the log, synced or
    /// not yet (a move reads the batch being synced: it need not wait for
    /// the disk), or after a few seconds if the writer has stopped.
    pub(crate) async fn taken_through(&self, position: u64) {
        let deadline = Instant::now() + Duration::from_secs(5);
        while self.log.end_unsynced().position < position && Instant::now() < deadline {
            tokio::time::sleep(TAKEN_POLL).await;
        }
    }

    /// Takes in the entries of slots another node handed over (F3), and
    /// gives every later entry a position above `last_position`, the last
    /// the other node gave, so that each slot's entries stay in order.
    pub(crate) fn inherit(&self, entries: Vec<Frame>, last_position: u64, now: Tick) {
        self.intake.raise_to(last_position);
        self.inherited.lock().take(entries, self.log.retention(), now);
    }

    /// Records that `slots` were taken over from a copy (F3): a gap of each.
    pub(crate) fn mark_taken_over(&self, slots: impl IntoIterator<Item = u32>, now: Tick) {
        self.intake.record_taken_over(slots, now);
    }

    /// The cursor that resumes at the oldest entry this feed still holds,
    /// its own or handed over: anything before it is out of range.
    fn oldest(&self) -> Cursor {
        self.log.oldest().max(self.inherited.lock().trimmed)
    }

    /// The cursor after everything recorded so far, written or not yet:
    /// where a stream from now starts.
    pub(crate) fn cursor_now(&self) -> Cursor {
        Cursor::through(self.intake.last_position())
    }

    /// Opens a `Changes` stream (F1): from where `from` says, carrying what
    /// `filter` lets through, until the consumer goes or `stopping`.
    pub(crate) fn changes(
        self: &Arc<Self>,
        from: ChangesFrom,
        filter: ChangesFilter,
        stopping: CancellationToken,
    ) -> Result<ChangesStream, ServiceError> {
        self.open_stream(from, filter, stopping, StreamKind::Consumer)
    }

    /// Opens this node's part of a cluster's merged `Changes` stream (F3):
    /// as [`Feed::changes`], but progress comes often (the merging node
    /// waits for every part's before it sends an event on), a cursor from
    /// before this node's log began starts where it began, and one ahead of
    /// this node's clock waits for it.
    pub(crate) fn node_part(
        self: &Arc<Self>,
        from: ChangesFrom,
        filter: ChangesFilter,
        stopping: CancellationToken,
    ) -> Result<ChangesStream, ServiceError> {
        self.open_stream(from, filter, stopping, StreamKind::NodePart)
    }

    fn open_stream(
        self: &Arc<Self>,
        from: ChangesFrom,
        filter: ChangesFilter,
        stopping: CancellationToken,
        kind: StreamKind,
    ) -> Result<ChangesStream, ServiceError> {
        let oldest = self.oldest();
        // The log is read from here on: a node's part may start before its
        // in-memory log began, where only entries handed over can be.
        let mut log_floor = Cursor::START;
        let mut first = None;
        let after = match from {
            ChangesFrom::Now => self.cursor_now(),
            ChangesFrom::Oldest => {
                let (start, read) = self.read_from_oldest()?;
                first = Some(read);
                start
            }
            ChangesFrom::Cursor(cursor) if kind == StreamKind::NodePart => {
                let inherited_trimmed = self.inherited.lock().trimmed;
                match self.began_in_memory {
                    // Nothing before it was recorded here, and nothing since was trimmed.
                    Some(began) if cursor < began && self.log.oldest() == began && cursor >= inherited_trimmed => {
                        log_floor = began;
                        cursor
                    }
                    _ if cursor < oldest => {
                        let why = "older than the oldest change this node's feed retains";
                        return Err(ServiceError::FeedOutOfRange { oldest, why });
                    }
                    _ => cursor,
                }
            }
            ChangesFrom::Cursor(cursor) => {
                if cursor < oldest {
                    let why = "older than the oldest change the feed retains";
                    return Err(ServiceError::FeedOutOfRange { oldest, why });
                }
                if cursor.position > self.intake.last_position() {
                    let why = "ahead of every change this feed holds: not one of its cursors";
                    return Err(ServiceError::FeedOutOfRange { oldest, why });
                }
                cursor
            }
        };
        let (sender, receiver) = mpsc::channel(1);
        let progress_every = match kind {
            StreamKind::Consumer => PROGRESS_EVERY,
            StreamKind::NodePart => NODE_PART_PROGRESS_EVERY,
        };
        let reader = StreamReader { after, log_floor, first, filter, progress_every };
        tokio::spawn(Arc::clone(self).stream(reader, sender, stopping));
        Ok(ChangesStream::reading(self, receiver, after))
    }

    /// The oldest cursor the feed holds and the first read after it, taken
    /// together: a stream from the oldest change then starts there even if
    /// retention moves on before its reader runs (F4: a webhook that
    /// retention passed resumes with one gap, not a second one for the
    /// changes recorded while it reopened).
    fn read_from_oldest(&self) -> Result<(Cursor, presence_feed::Read), ServiceError> {
        let mut oldest = self.oldest();
        // Each try fails only if retention moved between two reads of a
        // few microseconds; a log turning over that fast is out of reach.
        for _ in 0..100 {
            match self.log.read(oldest, READ_BYTES) {
                Ok(read) => return Ok((oldest, read)),
                Err(ReadError::OutOfRange(out)) => oldest = out.oldest.max(self.oldest()),
                Err(ReadError::Io(err)) => {
                    return Err(ServiceError::Internal(format!("reading the change feed: {err}")));
                }
            }
        }
        let why = "retention removes changes faster than the feed can be read from its oldest";
        Err(ServiceError::FeedOutOfRange { oldest, why })
    }

    /// One stream's reader: a batch of the log at a time, then waits for more.
    async fn stream(
        self: Arc<Self>,
        reader: StreamReader,
        sender: mpsc::Sender<Result<Vec<pb::ChangeEvent>, ServiceError>>,
        stopping: CancellationToken,
    ) {
        let StreamReader { mut after, log_floor, mut first, filter, progress_every } = reader;
        self.metrics.streams.increment(1.0);
        let _open = counted_while_open(&self.metrics.streams);
        let mut end = self.end.subscribe();
        let mut reported = after;
        let mut last_sent = Instant::now();
        loop {
            let read = match first.take() {
                Some(read) => Ok(Ok(read)),
                None => {
                    let feed = Arc::clone(&self);
                    tokio::task::spawn_blocking(move || feed.log.read(after.max(log_floor), READ_BYTES)).await
                }
            };
            let read = match read {
                Ok(Ok(read)) => read,
                Ok(Err(ReadError::OutOfRange(out))) => {
                    let why = "retention removed changes this stream had not read yet";
                    let _ = sender.send(Err(ServiceError::FeedOutOfRange { oldest: out.oldest, why })).await;
                    return;
                }
                Ok(Err(ReadError::Io(err))) => {
                    let _ = sender.send(Err(ServiceError::Internal(format!("reading the change feed: {err}")))).await;
                    return;
                }
                Err(err) => {
                    let _ = sender.send(Err(ServiceError::Internal(format!("reading the change feed: {err}")))).await;
                    return;
                }
            };
            let caught_up = read.frames.is_empty();
            let frames = self.inherited.lock().merged_into(read.frames, after, read.end);
            let mut events = Vec::new();
            for frame in frames.iter().filter(|frame| filter.carries(frame)) {
                match wire::change_event(frame) {
                    Ok(event) => events.push(event),
                    Err(err) => {
                        let _ = sender.send(Err(err)).await;
                        return;
                    }
                }
            }
            after = after.max(read.end);
            if !events.is_empty() {
                reported = after;
                last_sent = Instant::now();
                if sender.send(Ok(events)).await.is_err() {
                    return;
                }
            } else if after > reported && last_sent.elapsed() >= progress_every {
                reported = after;
                last_sent = Instant::now();
                if sender.send(Ok(vec![wire::progress_event(after)])).await.is_err() {
                    return;
                }
            }
            if !caught_up {
                continue;
            }
            let progress_due = progress_every.saturating_sub(last_sent.elapsed());
            tokio::select! {
                changed = end.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(progress_due), if after > reported => {}
                () = sender.closed() => return,
                () = stopping.cancelled() => return,
            }
        }
    }
}

/// Where a stream starts and what it carries.
#[derive(Debug)]
struct StreamReader {
    after: Cursor,
    log_floor: Cursor,
    /// The first read, when opening the stream took it.
    first: Option<presence_feed::Read>,
    filter: ChangesFilter,
    progress_every: Duration,
}

/// Who a stream is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StreamKind {
    /// A consumer's `Changes`.
    Consumer,
    /// A cluster node merging every node's part (F3).
    NodePart,
}

/// Entries other nodes handed over with their slots (F3), by cursor; in
/// memory, within the feed's retention.
#[derive(Debug, Default)]
struct Inherited {
    frames: std::collections::BTreeMap<Cursor, Frame>,
    bytes: u64,
    /// Entries at or before it were let go: a cursor before it is out of range.
    trimmed: Cursor,
}

/// The most bytes of entries handed over a node keeps in memory, whatever
/// the retention: past it the oldest go, and cursors before them are out
/// of range (F2) rather than silently missing them.
const INHERITED_MAX_BYTES: u64 = 256 << 20;

impl Inherited {
    /// `read` (this node's log after `after`, complete through `end`) with
    /// the inherited entries in `(after, end]` among them, in cursor order;
    /// an entry both hold once.
    fn merged_into(&self, read: Vec<Frame>, after: Cursor, end: Cursor) -> Vec<Frame> {
        use std::ops::Bound::{Excluded, Included};
        if self.frames.is_empty() || end <= after {
            return read;
        }
        let mut inherited = self.frames.range((Excluded(after), Included(end))).map(|(_, frame)| frame).peekable();
        if inherited.peek().is_none() {
            return read;
        }
        let mut merged = Vec::with_capacity(read.len());
        let mut own = read.into_iter().peekable();
        loop {
            let take_own = match (own.peek(), inherited.peek()) {
                (None, None) => break,
                (Some(_), None) => true,
                (None, Some(_)) => false,
                (Some(mine), Some(theirs)) => mine.cursor() <= theirs.cursor(),
            };
            let next = if take_own { own.next() } else { inherited.next().cloned() };
            if let Some(frame) = next
                && merged.last().is_none_or(|last: &Frame| last.cursor() < frame.cursor())
            {
                merged.push(frame);
            }
        }
        merged
    }

    /// Takes `frames` in, then drops what retention lets go, oldest first.
    fn take(&mut self, frames: Vec<Frame>, retention: Retention, now: Tick) {
        for frame in frames {
            let size = frame.len() as u64;
            if self.frames.insert(frame.cursor(), frame).is_none() {
                self.bytes += size;
            }
        }
        let too_old = now.saturating_sub(retention.max_age_ms);
        let max_bytes = if retention.max_bytes == 0 { INHERITED_MAX_BYTES } else { retention.max_bytes };
        let max_bytes = max_bytes.min(INHERITED_MAX_BYTES);
        while let Some(entry) = self.frames.first_entry() {
            if self.bytes <= max_bytes && entry.get().at() >= too_old {
                break;
            }
            self.trimmed = self.trimmed.max(*entry.key());
            self.bytes -= entry.remove().len() as u64;
        }
    }
}

/// The feed entries a planned move carries (F3): those of its slots, read
/// as the move goes on (see [`Feed::read_for_move`]).
#[derive(Debug)]
pub(crate) struct Carried {
    slots: SlotSet,
    /// Read up to here; `None` before the first read.
    after: Option<Cursor>,
    /// Read and not taken yet.
    entries: Vec<Frame>,
}

impl Carried {
    /// For a move of `slots`.
    pub(crate) fn of(slots: SlotSet) -> Carried {
        Carried { slots, after: None, entries: Vec::new() }
    }

    /// Whether the move carries `frame`.
    fn holds(&self, frame: &Frame) -> bool {
        concerns(&self.slots, frame)
    }

    /// Takes out what was read of `slots` (and the gaps of every slot), in
    /// cursor order, each once.
    pub(crate) fn take(&mut self, slots: &SlotSet) -> Vec<Frame> {
        let (mut taken, kept): (Vec<Frame>, Vec<Frame>) =
            std::mem::take(&mut self.entries).into_iter().partition(|frame| concerns(slots, frame));
        // A gap of every slot goes with each round.
        self.entries = kept;
        self.entries.extend(taken.iter().filter(|frame| frame.slot() == u32::MAX).cloned());
        taken.sort_by_key(Frame::cursor);
        taken.dedup_by_key(|frame| frame.cursor());
        taken
    }
}

/// Whether `frame` concerns `slots`: one of theirs, or a gap of every slot
/// (a restart here), which concerns them too.
fn concerns(slots: &SlotSet, frame: &Frame) -> bool {
    frame.slot() == u32::MAX || slots.contains(frame.slot())
}

/// Counts a stream out of the open gauge when its reader ends, however it ends.
fn counted_while_open(streams: &metrics::Gauge) -> impl Drop + '_ {
    struct Closing<'a>(&'a metrics::Gauge);
    impl Drop for Closing<'_> {
        fn drop(&mut self) {
            self.0.decrement(1.0);
        }
    }
    Closing(streams)
}

/// The events of a `Changes` stream, a batch of the log at a time.
#[derive(Debug)]
pub(crate) struct ChangesStream {
    receiver: mpsc::Receiver<Result<Vec<pb::ChangeEvent>, ServiceError>>,
    batch: std::collections::VecDeque<pb::ChangeEvent>,
    /// The feed read, to name its oldest cursor as of when the consumer
    /// learns that retention passed it (`None`: a merged stream, whose
    /// parts' refusals pass through).
    feed: Option<Arc<Feed>>,
    /// Every event the stream carries is after it.
    start: Cursor,
}

impl ChangesStream {
    /// The stream of the batches `receiver` gets.
    pub(crate) fn of(receiver: mpsc::Receiver<Result<Vec<pb::ChangeEvent>, ServiceError>>) -> Self {
        ChangesStream { receiver, batch: std::collections::VecDeque::new(), feed: None, start: Cursor::START }
    }

    /// The stream of the batches `receiver` gets of `feed`'s log, from `start`.
    fn reading(
        feed: &Arc<Feed>,
        receiver: mpsc::Receiver<Result<Vec<pb::ChangeEvent>, ServiceError>>,
        start: Cursor,
    ) -> Self {
        ChangesStream { feed: Some(Arc::clone(feed)), start, ..ChangesStream::of(receiver) }
    }

    /// Where a stream of one feed's log starts: every event it carries is after it.
    pub(crate) fn start(&self) -> Cursor {
        self.start
    }

    fn poll_event(&mut self, cx: &mut TaskContext<'_>) -> Poll<Option<Result<pb::ChangeEvent, ServiceError>>> {
        loop {
            if let Some(event) = self.batch.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            match self.receiver.poll_recv(cx) {
                Poll::Ready(Some(Ok(batch))) => self.batch.extend(batch),
                // The reader found retention past it before the consumer took
                // the batches read ahead, maybe long before (a webhook whose
                // receiver is down): retention may have gone on since, and a
                // stream opened again from the oldest cursor then would be
                // refused once more. The oldest is the one of now.
                Poll::Ready(Some(Err(ServiceError::FeedOutOfRange { oldest, why }))) => {
                    let oldest = self.feed.as_ref().map_or(oldest, |feed| oldest.max(feed.oldest()));
                    return Poll::Ready(Some(Err(ServiceError::FeedOutOfRange { oldest, why })));
                }
                Poll::Ready(Some(Err(err))) => return Poll::Ready(Some(Err(err))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }

    /// The next event, or why the stream ended (`None`: the server is stopping).
    pub(crate) async fn next_event(&mut self) -> Option<Result<pb::ChangeEvent, ServiceError>> {
        std::future::poll_fn(|cx| self.poll_event(cx)).await
    }

    /// The next event if the stream has already read it, without waiting.
    pub(crate) fn ready_event(&mut self) -> Option<Result<pb::ChangeEvent, ServiceError>> {
        match self.poll_event(&mut TaskContext::from_waker(std::task::Waker::noop())) {
            Poll::Ready(next) => next,
            Poll::Pending => None,
        }
    }
}

impl Stream for ChangesStream {
    type Item = Result<pb::ChangeEvent, tonic::Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        self.poll_event(cx).map(|next| next.map(|event| event.map_err(tonic::Status::from)))
    }
}

#[cfg(test)]
mod tests {
    use presence_core::CompactString;
    use presence_feed::FrameKind;

    use super::*;

    fn frame(position: u64, slot: u32, at: u64) -> Frame {
        Frame::new(position, slot, FrameKind::Flip, at, b"user", b"body")
    }

    fn cursors(frames: &[Frame]) -> Vec<(u64, u32)> {
        frames.iter().map(|frame| (frame.position(), frame.slot())).collect()
    }

    /// Gaps of the writer's own, `count` of them from `first`: frames whose
    /// bodies decode as the events a stream sends.
    fn gaps(first: u64, count: u64) -> Vec<Frame> {
        (first..first + count)
            .map(|position| wire::gap_frame(position, Cursor::START, GapReason::Overflow, 0, 1))
            .collect()
    }

    #[tokio::test]
    async fn f4_a_stream_from_the_oldest_starts_where_it_says_though_retention_passes_it_before_it_is_read() {
        let retention = Retention { max_age_ms: u64::MAX / 2, max_bytes: 16 << 10 };
        let (feed, _) = Feed::open(None, retention, SINGLE_NODE_SLOTS, 0).unwrap();
        let first = feed.log.oldest().position + 1;
        feed.log.append(&gaps(first, 100), first + 99, 1).unwrap();
        let everything = ChangesFilter { kinds: [true; 4], id_prefix: CompactString::default(), slots: None };
        let mut stream = feed.changes(ChangesFrom::Oldest, everything, CancellationToken::new()).unwrap();
        let start = stream.start();
        assert_eq!(start, feed.log.oldest(), "it starts at the oldest change");
        // Retention passes the start before the stream's reader has run.
        feed.log.append(&gaps(first + 100, 1_000), first + 1_099, 1).unwrap();
        assert!(feed.log.oldest() > start);
        let event = stream.next_event().await.expect("an event").expect("not refused");
        let cursor = Cursor::decode(&event.cursor).expect("a cursor");
        assert_eq!(cursor.position, start.position + 1, "the change right after its start");
    }

    #[test]
    fn f3_entries_handed_over_are_read_among_this_nodes_own_in_cursor_order_once_within_the_read() {
        let mut inherited = Inherited::default();
        let unbounded = Retention { max_age_ms: u64::MAX, max_bytes: 0 };
        inherited.take(vec![frame(10, 3, 0), frame(20, 3, 0), frame(30, 3, 0), frame(50, 3, 0)], unbounded, 0);
        let own = vec![frame(15, 1, 0), frame(20, 3, 0), frame(40, 1, 0)];
        // After (10, 3), complete through (45, 0): 50 is not read yet.
        let merged = inherited.merged_into(own, Cursor { position: 10, slot: 3 }, Cursor::through(45));
        assert_eq!(cursors(&merged), vec![(15, 1), (20, 3), (30, 3), (40, 1)]);
        // Nothing of its own: the handed-over entries alone, up to the end.
        let merged = inherited.merged_into(Vec::new(), Cursor::through(35), Cursor::through(60));
        assert_eq!(cursors(&merged), vec![(50, 3)]);
    }

    #[test]
    fn f3_a_move_carries_each_rounds_slots_once_and_a_gap_of_every_slot_with_each_round() {
        let mut carried = Carried::of(SlotSet::of(8, [1, 2]));
        let gap = Frame::new(3, u32::MAX, FrameKind::Gap, 0, b"", b"gap");
        carried.entries = vec![frame(1, 1, 0), frame(2, 2, 0), gap, frame(4, 1, 0), frame(4, 1, 0)];
        let first = carried.take(&SlotSet::of(8, [1]));
        assert_eq!(cursors(&first), vec![(1, 1), (3, u32::MAX), (4, 1)]);
        let second = carried.take(&SlotSet::of(8, [2]));
        assert_eq!(cursors(&second), vec![(2, 2), (3, u32::MAX)]);
    }

    #[test]
    fn f3_entries_handed_over_are_kept_within_the_feeds_retention_by_bytes_and_age() {
        let mut inherited = Inherited::default();
        let size = frame(1, 0, 0).len() as u64;
        let by_bytes = Retention { max_age_ms: u64::MAX, max_bytes: 2 * size };
        inherited.take((1..=5).map(|position| frame(position, 0, 0)).collect(), by_bytes, 0);
        assert_eq!(inherited.frames.keys().map(|cursor| cursor.position).collect::<Vec<_>>(), vec![4, 5]);
        assert_eq!(inherited.bytes, 2 * size);
        assert_eq!(inherited.trimmed, Cursor { position: 3, slot: 0 }, "cursors before the kept ones are out of range");
        let by_age = Retention { max_age_ms: 1_000, max_bytes: 0 };
        let mut inherited = Inherited::default();
        inherited.take(vec![frame(1, 0, 100), frame(2, 0, 2_000)], by_age, 2_500);
        assert_eq!(inherited.frames.keys().map(|cursor| cursor.position).collect::<Vec<_>>(), vec![2]);
    }
}
