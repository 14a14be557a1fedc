//! The Rust client of presenced, for gateways and viewers.
//!
//! Gateway side:
//! - [`LeaseChannel`]: one long-lived `Leases` stream shared by every session of a
//!   gateway. Single register, renew and unregister calls are coalesced into
//!   batches (L8) and pipelined, under bounded queues; a broken stream is reopened
//!   with exponential backoff and jitter.
//! - [`Session`]: one socket's lease, renewed in the background (first beat
//!   jittered, then every heartbeat, sooner on [`Session::touch`] unless
//!   throttled), registered again when the server has lost it (`NOT_FOUND`),
//!   stopped when a newer connection owns it (`FAILED_PRECONDITION`), and
//!   unregistered on drop.
//!
//! In a cluster (`presenced serve --etcd ...`), [`ClusterLeases`] sends each
//! item to its user's owner, learning the owners from refusals and, if told
//! where etcd is, from the slot map there; a [`Session`] registers through it
//! as through a [`LeaseChannel`] (see [`SessionLeases`]).
//!
//! Rooms and signals, gateway side: a [`Session`] joins a room with its
//! metadata there ([`Session::join`], again to change the metadata),
//! leaves it ([`Session::leave`]) and sets or clears ephemeral signals such as
//! "typing" in it ([`Session::signal`]; a TTL of at most 10 s, 0 clears). They
//! travel as items of the same [`LeaseChannel`] as the renewals, named by the
//! session's current generation, and the answers are the wire's
//! [`pb::JoinResponse`], [`pb::LeaveResponse`] and [`pb::SignalResponse`].
//! Membership ends with the lease, and a re-register (a new generation) starts
//! in no room (R6): the session remembers the rooms it joined and joins them
//! again, with the same metadata, before it reports
//! [`SessionState::Reregistered`]. Signals are not remembered.
//!
//! Viewer side:
//! - [`ViewerStore`]: per user the newest presence seen; stale and duplicate
//!   events are dropped by version, a snapshot replaces everything.
//! - [`Watcher`]: a `Watch` that reconnects with backoff and jitter and resyncs
//!   from a fresh snapshot; with a [`TokenProvider`]
//!   ([`Watcher::open_with_token_provider`]) it outlives short-lived viewer
//!   tokens, reopening at once with a fresh one when the server ends the
//!   stream at the token's expiry ([`RoomWatcher`] and [`RoomCountWatcher`]
//!   take one the same way).
//! - [`RoomView`]: one room's members (by user, with the shown metadata), the
//!   users signalling each kind, and the room version; a change of a member or
//!   kind is applied only if newer than the last one applied for it, a
//!   snapshot replaces everything.
//! - [`RoomWatcher`]: a member-mode `WatchRoom` feeding a [`RoomView`], with
//!   the same reconnects and resyncs; [`RoomCountWatcher`]: a count-mode one,
//!   for rooms past the server's member cap. `NOT_FOUND` (the room is not
//!   readable) and `FAILED_PRECONDITION` (past the member cap: count instead)
//!   end them, with the status in `last_error`.
//! - [`RoomCountsWatcher`]: a `WatchRoomCounts` (R7) feeding [`RoomCounts`],
//!   the counts of up to 10,000 rooms on one stream (a lobby, a list of
//!   feeds), each reported when it changes; rooms added and removed while it
//!   is open ([`RoomCountsWatcher::update`]), reopened with the rooms as they
//!   are now after a break. A room the viewer may not read counts as empty.
//!
//! Backend side, the change feed (F1, F2):
//! - [`ChangesConsumer`]: a resumable consumer of `Changes`. It starts after
//!   the cursor a [`CursorStore`] holds ([`FileCursorStore`] writes it
//!   atomically, [`MemoryCursorStore`] keeps it in memory, or the caller's
//!   own, beside the data the processing writes), hands out the events that
//!   arrived together as a [`ChangeBatch`], and saves the batch's cursor
//!   once the caller commits it ([`ChangesConsumer::run`] does both around a
//!   handler). A broken stream is reopened with backoff and jitter after
//!   the committed cursor, with a fresh token from a [`TokenProvider`] if
//!   the server ended it for its credentials. Delivery is at least once,
//!   identified by cursor: a batch not committed is handed out again. A
//!   cursor past retention is [`ChangesError::OutOfRange`] with the oldest
//!   cursor, to resume from after a resync; a `gap` is an event.
//!
//! This crate does not own the wire types: they are `presence-proto`'s,
//! re-exported as [`pb`]. Answers from the server stay [`tonic::Status`] with the
//! codes the contract names; [`ClientError`] covers only setting up a connection.
//!
//! ```no_run
//! # async fn gateway() -> Result<(), Box<dyn std::error::Error>> {
//! use presence_client::{LeaseChannel, LeaseChannelConfig, Session, SessionConfig};
//!
//! let leases = LeaseChannel::connect("http://127.0.0.1:50051", LeaseChannelConfig::default()).await?;
//! let session =
//!     Session::register(&leases, "user-42", "phone", "gateway-a", Default::default(), SessionConfig::default())
//!         .await?;
//! // ... on every message from the socket:
//! session.touch();
//! // ... when the socket closes:
//! session.close().await?;
//! # Ok(())
//! # }
//! ```
//!
//! A room, from both sides:
//!
//! ```no_run
//! # async fn room(session: presence_client::Session) -> Result<(), Box<dyn std::error::Error>> {
//! use presence_client::{Backoff, RoomWatcher, RoomWatcherEvent, pb};
//!
//! // The gateway: its user opened document 7 in this tab, and types.
//! let metadata = [("cursor".to_string(), "p3".to_string())].into();
//! let joined = session.join("doc-7", metadata).await?;
//! session.signal("doc-7", "typing", 3_000).await?;
//!
//! // A viewer of the room (a service acting for a viewer names it in `viewer_id`).
//! let client = pb::presence_client::PresenceClient::connect("http://127.0.0.1:50051").await?;
//! let mut watcher = RoomWatcher::open(client, "doc-7", Backoff::default()).await?;
//! while let Some(event) = watcher.next().await {
//!     match event {
//!         RoomWatcherEvent::Change(change) => { /* one member joined, left or changed its metadata */ }
//!         RoomWatcherEvent::Signals(set) => { /* who is typing now: set.user_ids */ }
//!         RoomWatcherEvent::Resynced => { /* re-render watcher.view() whole */ }
//!     }
//! }
//! // Ended: watcher.last_error() says why.
//! # let _ = joined;
//! # Ok(())
//! # }
//! ```
//!
//! A backend that pushes a notification when a user goes OFFLINE, resuming where it left off:
//!
//! ```no_run
//! # async fn push_worker() -> Result<(), Box<dyn std::error::Error>> {
//! use presence_client::{ChangesConfig, ChangesConsumer, ChangesError, FileCursorStore, pb};
//! use pb::change_event::Event;
//!
//! let client = pb::presence_client::PresenceClient::connect("http://127.0.0.1:50051").await?;
//! let request = pb::ChangesRequest {
//!     from: pb::ChangesFrom::Oldest as i32, // when the file holds no cursor yet
//!     kinds: vec![pb::ChangeKind::Flip as i32],
//!     ..Default::default()
//! };
//! let store = FileCursorStore::new("push-worker.cursor");
//! let mut feed = ChangesConsumer::open(client, request, store, ChangesConfig::default()).await?;
//! loop {
//!     let failed = feed
//!         .run(|batch| async move {
//!             for event in &batch.events {
//!                 match &event.event {
//!                     Some(Event::Flip(user)) if user.state == pb::State::Offline as i32 => {
//!                         // push(user.user_id): idempotent by event.cursor
//!                     }
//!                     Some(Event::Gap(_)) => { /* resync what matters from a Snapshot */ }
//!                     _ => {}
//!                 }
//!             }
//!             Ok::<(), std::io::Error>(())
//!         })
//!         .await;
//!     match failed {
//!         // Resync from a Snapshot, then go on from the oldest change retained.
//!         ChangesError::OutOfRange { oldest_cursor, .. } => feed.resume_from(oldest_cursor).await?,
//!         other => return Err(other.into()),
//!     }
//! }
//! # }
//! ```

// Protobuf messages gain fields as the API grows: every literal of one ends in
// `..Default::default()`, so that it keeps compiling, even where it names every field today.
#![allow(clippy::needless_update)]

mod backoff;
mod call;
mod changes;
mod cluster;
mod error;
mod lease_channel;
mod room;
mod room_counts;
mod session;
mod transport;
mod viewer;

pub use backoff::Backoff;
pub use call::TokenProvider;
pub use changes::{
    ChangeBatch, ChangesConfig, ChangesConsumer, ChangesError, CursorStore, FileCursorStore, MemoryCursorStore,
    NotACursor, cursor_from_hex, cursor_to_hex,
};
pub use cluster::ClusterLeases;
pub use error::ClientError;
pub use lease_channel::{LeaseChannel, LeaseChannelConfig, LeaseChannelStats, lease_result};
pub use room::{RoomCountWatcher, RoomView, RoomWatcher, RoomWatcherEvent};
pub use room_counts::{RoomCounts, RoomCountsWatcher};
pub use session::{Session, SessionConfig, SessionLeases, SessionState};
pub use transport::{ClientTlsConfig, connect, connect_lazy};
pub use viewer::{ViewerStore, Watcher, WatcherEvent};

/// The wire types of `presence.v1` (from `presence-proto`).
pub use presence_proto::v1 as pb;
