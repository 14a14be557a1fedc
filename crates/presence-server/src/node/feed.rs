//! The change feed (F1, F2): the writer that moves what the store recorded
//! into the log, and the `Changes` streams that read the log.
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

use std::path::Path;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context as TaskContext, Poll};
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use presence_core::{FeedIntake, Tick, slot_of};
use presence_feed::{Cursor, FeedLog, Frame, ReadError, Retention};
use presence_proto::v1 as pb;
use tokio::sync::{mpsc, watch};
use tokio_stream::Stream;
use tokio_util::sync::CancellationToken;

use crate::error::ServiceError;
use crate::node::clock::StoreClock;
use crate::node::wire::{self, ChangesFilter, ChangesFrom, GapReason};

/// How often the writer drains the intake: the longest a change waits
/// before it is written (plus the sync).
pub(crate) const COMMIT_INTERVAL: Duration = Duration::from_millis(5);
/// Most entries the intake holds between two drains before it drops what
/// comes next (and the writer marks a gap): about 100 MB, and far more than
/// a writer that keeps up ever sees.
const INTAKE_CAPACITY: usize = 1 << 20;
/// About how many bytes of frames a stream reads at a time.
const READ_BYTES: usize = 256 << 10;
/// A stream whose cursor moved without an event for it says so this often.
pub(crate) const PROGRESS_EVERY: Duration = Duration::from_secs(1);
/// Slots of a single node's feed: a cluster's default, so that consumers
/// can share a single node's feed by slot as a cluster's.
pub(crate) const SINGLE_NODE_SLOTS: u32 = 1024;

/// Retention when none is given (F2, documented in docs/feed.md).
pub const DEFAULT_RETENTION_MS: u64 = 24 * 60 * 60 * 1000;
/// Bytes kept on disk when none is given.
pub const DEFAULT_RETENTION_BYTES_ON_DISK: u64 = 1 << 30;
/// Bytes kept in memory (no data directory) when none is given.
pub const DEFAULT_RETENTION_BYTES_IN_MEMORY: u64 = 64 << 20;

/// The change feed of a node.
#[derive(Debug)]
pub(crate) struct Feed {
    log: FeedLog,
    intake: Arc<FeedIntake>,
    slots: u32,
    /// Where the log is complete to, after each batch.
    end: watch::Sender<Cursor>,
    stop: AtomicBool,
    writer: Mutex<Option<std::thread::JoinHandle<()>>>,
    /// A batch the disk refused, to be marked as a gap by the next one.
    lost: Mutex<Option<(Cursor, u64, u64)>>,
    /// When `end` last moved without a frame: streams waiting for frames
    /// wake for the end alone only this often.
    end_moved: Mutex<Instant>,
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
        let feed = Feed {
            log,
            intake: FeedIntake::new(INTAKE_CAPACITY, after),
            slots,
            end,
            stop: AtomicBool::new(false),
            writer: Mutex::new(None),
            lost: Mutex::new(None),
            end_moved: Mutex::new(Instant::now()),
        };
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
        let drained = self.intake.drain(now);
        let mut frames = Vec::with_capacity(drained.entries.len() + 2);
        if let Some((after, position, lost)) = self.lost.lock().take() {
            frames.push(wire::gap_frame(position, after, GapReason::WriteFailed, lost, now));
        }
        frames.extend(drained.entries.iter().map(|entry| {
            let slot = slot_of(entry.event.id(), self.slots);
            wire::feed_frame(entry, slot)
        }));
        if let Some(dropped) = drained.dropped {
            let after = frames.last().map_or(self.log.end(), Frame::cursor);
            tracing::error!(count = dropped.count, "the change feed's writer fell behind; a gap marks what it dropped");
            frames.push(wire::gap_frame(dropped.last, after, GapReason::Overflow, dropped.count, now));
        }
        match self.log.append(&frames, drained.through, now) {
            Ok(()) => {
                let mut end_moved = self.end_moved.lock();
                if !frames.is_empty() || end_moved.elapsed() >= END_WITHOUT_FRAMES_EVERY {
                    *end_moved = Instant::now();
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

    /// Opens a `Changes` stream (F1): from where `from` says, carrying what
    /// `filter` lets through, until the consumer goes or `stopping`.
    pub(crate) fn changes(
        self: &Arc<Self>,
        from: ChangesFrom,
        filter: ChangesFilter,
        stopping: CancellationToken,
    ) -> Result<ChangesStream, ServiceError> {
        let after = match from {
            // Everything recorded before the call, written or not yet.
            ChangesFrom::Now => Cursor::through(self.intake.last_position()),
            ChangesFrom::Oldest => self.log.oldest(),
            ChangesFrom::Cursor(cursor) => {
                if cursor < self.log.oldest() {
                    let why = "older than the oldest change the feed retains";
                    return Err(ServiceError::FeedOutOfRange { oldest: self.log.oldest(), why });
                }
                if cursor.position > self.intake.last_position() {
                    let why = "ahead of every change this feed holds: not one of its cursors";
                    return Err(ServiceError::FeedOutOfRange { oldest: self.log.oldest(), why });
                }
                cursor
            }
        };
        let (sender, receiver) = mpsc::channel(1);
        tokio::spawn(Arc::clone(self).stream(after, filter, sender, stopping));
        Ok(ChangesStream { receiver, batch: std::collections::VecDeque::new() })
    }

    /// One stream's reader: a batch of the log at a time, then waits for more.
    async fn stream(
        self: Arc<Self>,
        mut after: Cursor,
        filter: ChangesFilter,
        sender: mpsc::Sender<Result<Vec<pb::ChangeEvent>, tonic::Status>>,
        stopping: CancellationToken,
    ) {
        let mut end = self.end.subscribe();
        let mut reported = after;
        let mut last_sent = Instant::now();
        loop {
            let feed = Arc::clone(&self);
            let read = tokio::task::spawn_blocking(move || feed.log.read(after, READ_BYTES)).await;
            let read = match read {
                Ok(Ok(read)) => read,
                Ok(Err(ReadError::OutOfRange(out))) => {
                    let why = "retention removed changes this stream had not read yet";
                    let _ = sender.send(Err(ServiceError::FeedOutOfRange { oldest: out.oldest, why }.into())).await;
                    return;
                }
                Ok(Err(ReadError::Io(err))) => {
                    let _ = sender
                        .send(Err(ServiceError::Internal(format!("reading the change feed: {err}")).into()))
                        .await;
                    return;
                }
                Err(err) => {
                    let _ = sender
                        .send(Err(ServiceError::Internal(format!("reading the change feed: {err}")).into()))
                        .await;
                    return;
                }
            };
            let caught_up = read.frames.is_empty();
            let mut events = Vec::new();
            for frame in read.frames.iter().filter(|frame| filter.carries(frame)) {
                match wire::change_event(frame) {
                    Ok(event) => events.push(event),
                    Err(err) => {
                        let _ = sender.send(Err(err.into())).await;
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
            } else if after > reported && last_sent.elapsed() >= PROGRESS_EVERY {
                reported = after;
                last_sent = Instant::now();
                if sender.send(Ok(vec![wire::progress_event(after)])).await.is_err() {
                    return;
                }
            }
            if !caught_up {
                continue;
            }
            let progress_due = PROGRESS_EVERY.saturating_sub(last_sent.elapsed());
            tokio::select! {
                changed = end.changed() => if changed.is_err() { return },
                () = tokio::time::sleep(progress_due), if after > reported => {}
                () = sender.closed() => return,
                () = stopping.cancelled() => return,
            }
        }
    }
}

/// The events of a `Changes` stream, a batch of the log at a time.
#[derive(Debug)]
pub struct ChangesStream {
    receiver: mpsc::Receiver<Result<Vec<pb::ChangeEvent>, tonic::Status>>,
    batch: std::collections::VecDeque<pb::ChangeEvent>,
}

impl Stream for ChangesStream {
    type Item = Result<pb::ChangeEvent, tonic::Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<Option<Self::Item>> {
        loop {
            if let Some(event) = self.batch.pop_front() {
                return Poll::Ready(Some(Ok(event)));
            }
            match self.receiver.poll_recv(cx) {
                Poll::Ready(Some(Ok(batch))) => self.batch.extend(batch),
                Poll::Ready(Some(Err(status))) => return Poll::Ready(Some(Err(status))),
                Poll::Ready(None) => return Poll::Ready(None),
                Poll::Pending => return Poll::Pending,
            }
        }
    }
}
