//! Counts of many rooms (R7): the batched `RoomCounts` read, and the
//! `WatchRoomCounts` stream that `UpdateWatchRoomCounts` changes.
//!
//! A stream opens with every room's count and then, at most once per
//! interval, sends one message of the rooms whose users or sessions changed
//! since it last sent them. What it costs does not grow with the rooms it
//! watches but with what changed: each watched room held here has a cell on
//! the count board (`count_board.rs`), which everything that may change its
//! count touches, and the stream reads again only the rooms touched since
//! its last read. A room held elsewhere (a cluster) is asked of its owner at
//! each interval, in one call per owner.
//!
//! Access is as for count mode (R4), decided room by room at each read: a
//! room the caller may not read is counted as an unknown room is (version 0,
//! nobody in it), so neither the batch nor the stream tells whether it
//! exists, and a viewer who joins a room sees its count at the next
//! interval. The viewer's own joins and leaves, and changes of a room's
//! access, touch the room like any other change.

use std::sync::Arc;
use std::time::Duration;

use hashbrown::HashMap;
use presence_core::CompactString;
use presence_proto::v1 as pb;
use tokio::sync::mpsc;
use tonic::Status;

use crate::error::ServiceError;
use crate::metrics::OpenGauge;
use crate::node::context::Context;
use crate::node::count_board::CountCell;
use crate::node::placement::HOLD_THROUGH_FREEZE;
use crate::node::rooms::may_read_room;
use crate::node::watches::{UpdateRequest, WatchUpdate};

/// The most rooms one `RoomCounts` asks for, or one `WatchRoomCounts`
/// watches (documented in the proto).
pub(crate) const MAX_ROOMS: usize = 10_000;

/// Messages the gRPC layer has not yet sent; past them the stream waits,
/// and its next message carries everything that changed meanwhile.
const STREAM_BUFFER: usize = 2;

/// How often a stream opening while some of its rooms' owners cannot answer
/// (a move) asks them again, until [`HOLD_THROUGH_FREEZE`].
const OPEN_RECHECK: Duration = Duration::from_millis(10);

/// The stream type the WatchRoomCounts RPC returns.
pub(crate) type RoomCountsStream = tokio_stream::wrappers::ReceiverStream<Result<pb::RoomCounts, Status>>;

/// The count of a room this node answers for, as `viewer` may read it
/// (`None`: a service acting for no viewer).
pub(crate) fn count_here(context: &Context, viewer: Option<&str>, room_id: &str) -> pb::RoomCount {
    let store = context.store();
    if !may_read_room(store, viewer, room_id) {
        return unknown(room_id);
    }
    let (version, users, sessions) = context.placement.room_counts(store, &context.privacy, room_id);
    pb::RoomCount { room_id: room_id.to_owned(), version, users, sessions }
}

/// How a room nobody may read, or that does not exist, is counted.
fn unknown(room_id: &str) -> pb::RoomCount {
    pb::RoomCount { room_id: room_id.to_owned(), ..pb::RoomCount::default() }
}

/// The counts of `rooms` wherever they are, in order: `None` for a room
/// whose owner could not answer now.
async fn counts(context: &Context, viewer: Option<&str>, rooms: &[CompactString]) -> Vec<Option<pb::RoomCount>> {
    let mut answers = vec![None; rooms.len()];
    let mut elsewhere = Vec::new();
    for (answer, room_id) in answers.iter_mut().zip(rooms) {
        if context.placement.room_here(room_id).is_ok() {
            *answer = Some(count_here(context, viewer, room_id));
        } else {
            elsewhere.push(room_id.clone());
        }
    }
    if !elsewhere.is_empty() {
        let mut asked = context.placement.counts_elsewhere(viewer, elsewhere).await.into_iter();
        for answer in answers.iter_mut().filter(|answer| answer.is_none()) {
            *answer = asked.next().flatten();
        }
    }
    answers
}

/// A `RoomCounts` read: refused, naming a room, while some room's owner
/// cannot answer (a read held through a move asks again).
pub(crate) async fn read(
    context: &Context,
    viewer: Option<&str>,
    rooms: &[CompactString],
) -> Result<pb::RoomCounts, ServiceError> {
    let answers = counts(context, viewer, rooms).await;
    let unanswered = answers.iter().filter(|answer| answer.is_none()).count();
    if let Some(at) = answers.iter().position(Option::is_none) {
        return Err(ServiceError::RoomCountsUnanswered { room_id: rooms[at].to_string(), more: unanswered - 1 });
    }
    Ok(pb::RoomCounts { counts: answers.into_iter().flatten().collect(), watch_id: String::new() })
}

/// One room of a stream.
#[derive(Debug)]
struct Watched {
    cell: Arc<CountCell>,
    /// Users and sessions as last sent (`None`: not sent yet).
    sent: Option<(u32, u32)>,
    /// Whether it was held here at the last read: a room that comes here
    /// (a move) is read whether or not anything touched it.
    here: bool,
}

/// The rooms of one stream, and where its last read stood.
struct Rooms {
    context: Arc<Context>,
    viewer: Option<CompactString>,
    rooms: HashMap<CompactString, Watched>,
    /// The count board's sequence before the last read.
    read_at: u64,
}

impl Rooms {
    fn new(context: Arc<Context>, viewer: Option<CompactString>) -> Self {
        Rooms { context, viewer, rooms: HashMap::new(), read_at: 0 }
    }

    /// Watches `added` (those not watched yet) and returns their counts,
    /// waiting out a move of their owners for a moment; a room still
    /// unanswered then is sent when its owner answers.
    async fn add(&mut self, added: Vec<CompactString>) -> Vec<pb::RoomCount> {
        let board = &self.context.rooms().counts;
        let mut fresh = Vec::new();
        for room_id in added {
            if let hashbrown::hash_map::Entry::Vacant(entry) = self.rooms.entry(room_id) {
                let cell = board.watch(entry.key());
                fresh.push(entry.key().clone());
                entry.insert(Watched { cell, sent: None, here: false });
            }
        }
        let deadline = tokio::time::Instant::now() + HOLD_THROUGH_FREEZE;
        let mut counted = Vec::with_capacity(fresh.len());
        loop {
            let answers = counts(&self.context, self.viewer.as_deref(), &fresh).await;
            let mut unanswered = Vec::new();
            for (room_id, answer) in fresh.into_iter().zip(answers) {
                match answer {
                    Some(count) => counted.push(self.sent(count)),
                    None => unanswered.push(room_id),
                }
            }
            if unanswered.is_empty() || tokio::time::Instant::now() >= deadline {
                return counted;
            }
            fresh = unanswered;
            tokio::time::sleep(OPEN_RECHECK).await;
        }
    }

    /// Notes `count` as sent and returns it.
    fn sent(&mut self, count: pb::RoomCount) -> pb::RoomCount {
        if let Some(watched) = self.rooms.get_mut(count.room_id.as_str()) {
            watched.sent = Some((count.users, count.sessions));
        }
        count
    }

    fn remove(&mut self, removed: &[CompactString]) {
        for room_id in removed {
            if let Some(watched) = self.rooms.remove(room_id) {
                self.context.rooms().counts.release(room_id, watched.cell);
            }
        }
    }

    /// The rooms whose counts changed since they were last sent: those here
    /// that something touched (or that just came here), and those elsewhere
    /// as their owners answer.
    async fn changed(&mut self) -> Vec<pb::RoomCount> {
        let context = Arc::clone(&self.context);
        let read_at = std::mem::replace(&mut self.read_at, context.rooms().counts.now());
        let viewer = self.viewer.as_deref();
        let mut changed = Vec::new();
        let mut elsewhere = Vec::new();
        let mut recounted = 0;
        for (room_id, watched) in &mut self.rooms {
            let here = context.placement.room_here(room_id).is_ok();
            let came_here = here && !std::mem::replace(&mut watched.here, here);
            if !here {
                elsewhere.push(room_id.clone());
            } else if came_here || watched.sent.is_none() || watched.cell.touched_since(read_at) {
                recounted += 1;
                let count = count_here(&context, viewer, room_id);
                if watched.sent != Some((count.users, count.sessions)) {
                    watched.sent = Some((count.users, count.sessions));
                    changed.push(count);
                }
            }
        }
        if !elsewhere.is_empty() {
            recounted += elsewhere.len();
            let answers = context.placement.counts_elsewhere(viewer, elsewhere).await;
            for count in answers.into_iter().flatten() {
                let Some(watched) = self.rooms.get_mut(count.room_id.as_str()) else { continue };
                if watched.sent != Some((count.users, count.sessions)) {
                    watched.sent = Some((count.users, count.sessions));
                    changed.push(count);
                }
            }
        }
        context.metrics().rooms_recounted.increment(recounted as u64);
        changed
    }
}

impl Drop for Rooms {
    fn drop(&mut self) {
        let board = &self.context.rooms().counts;
        for (room_id, watched) in self.rooms.drain() {
            board.release(&room_id, watched.cell);
        }
    }
}

/// Opens a WatchRoomCounts stream of `rooms` (distinct, at most
/// [`MAX_ROOMS`]) for `viewer`, sending at most once per `interval` after
/// its first message.
pub(crate) async fn watch(
    context: Arc<Context>,
    viewer: Option<CompactString>,
    rooms: Vec<CompactString>,
    interval: Duration,
) -> Result<RoomCountsStream, ServiceError> {
    let (registration, updates) = context.room_count_watches.register(viewer.clone());
    let mut watched = Rooms::new(Arc::clone(&context), viewer);
    watched.read_at = context.rooms().counts.now();
    let counts = watched.add(rooms).await;
    let (tx, rx) = mpsc::channel(STREAM_BUFFER);
    let first = pb::RoomCounts { counts, watch_id: registration.id.to_string() };
    tx.try_send(Ok(first)).expect("a new channel has room");
    context.metrics().room_count_messages.increment(1);
    tokio::spawn(async move {
        let _open = OpenGauge::open(&context.metrics().room_count_streams);
        let _registration = registration;
        if let Err(err) = run(&context, &mut watched, interval, updates, &tx).await {
            let _ = tx.send(Err(err.into())).await;
        }
    });
    Ok(RoomCountsStream::new(rx))
}

/// Feeds a stream until its caller goes or the server stops: the changed
/// counts once per interval, and the added rooms' counts as each update
/// comes.
async fn run(
    context: &Context,
    rooms: &mut Rooms,
    interval: Duration,
    mut updates: mpsc::Receiver<UpdateRequest>,
    tx: &mpsc::Sender<Result<pb::RoomCounts, Status>>,
) -> Result<(), ServiceError> {
    // At a phase of this stream's own, so that streams opened together do
    // not all read and send at the same instant, each at most once per interval.
    let phase = interval.mul_f64(fastrand::f64() / 4.0);
    let mut tick = tokio::time::interval_at(tokio::time::Instant::now() + interval + phase, interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let counts = tokio::select! {
            _ = tick.tick() => rooms.changed().await,
            Some((update, reply)) = updates.recv() => {
                let added = apply(rooms, update).await;
                let sent = match added {
                    Ok(counts) if counts.is_empty() => Ok(true),
                    Ok(counts) => send(context, tx, counts).await,
                    Err(refusal) => {
                        let _ = reply.send(Err(refusal));
                        continue;
                    }
                };
                let _ = reply.send(Ok(()));
                if !sent? {
                    return Ok(());
                }
                continue;
            }
            () = tx.closed() => return Ok(()),
            () = context.stopping.cancelled() => return Err(ServiceError::ShuttingDown),
        };
        if !counts.is_empty() && !send(context, tx, counts).await? {
            return Ok(());
        }
    }
}

/// Sends one message; false once the caller has gone.
async fn send(
    context: &Context,
    tx: &mpsc::Sender<Result<pb::RoomCounts, Status>>,
    counts: Vec<pb::RoomCount>,
) -> Result<bool, ServiceError> {
    let message = pb::RoomCounts { counts, watch_id: String::new() };
    tokio::select! {
        sent = tx.send(Ok(message)) => {
            context.metrics().room_count_messages.increment(1);
            Ok(sent.is_ok())
        }
        () = context.stopping.cancelled() => Err(ServiceError::ShuttingDown),
    }
}

/// Applies an UpdateWatchRoomCounts: the removed rooms go, the added ones
/// (within the cap) are counted; their counts are returned to be sent.
async fn apply(rooms: &mut Rooms, update: WatchUpdate) -> Result<Vec<pb::RoomCount>, ServiceError> {
    let removed: hashbrown::HashSet<&CompactString> = update.remove.iter().collect();
    let mut add = update.add;
    add.retain(|room_id| !rooms.rooms.contains_key(room_id) && !removed.contains(room_id));
    add.sort_unstable();
    add.dedup();
    let remaining = rooms.rooms.len() - removed.iter().filter(|room_id| rooms.rooms.contains_key(**room_id)).count();
    if remaining + add.len() > MAX_ROOMS {
        return Err(ServiceError::invalid(
            "add_room_ids",
            format!(
                "the stream would watch {} rooms, more than the limit of {MAX_ROOMS} per stream",
                remaining + add.len()
            ),
        ));
    }
    rooms.remove(&update.remove);
    Ok(rooms.add(add).await)
}
