//! The shared in-process server harness (`presence_server::testing`), a fast
//! configuration, request helpers, and the viewer-side bookkeeping the tests
//! check streams with.

// Helpers are `pub` for the test modules beside `common`; the binary exports nothing.
#![allow(unreachable_pub)]

pub mod auth;
pub mod daemon;
pub mod scrape;
pub mod tls;

use std::collections::HashMap;

use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, watch_event};
pub use presence_server::testing::{PATIENCE, TestServer, fast_config, within};
use tonic::transport::Channel;

/// An export's bytes without what differs between any two users never seen:
/// the user id and the time of the export (P7).
pub fn export_shape(exported: &pb::ExportUserResponse) -> Vec<u8> {
    use prost::Message as _;
    let mut shape = exported.clone();
    shape.user_id.clear();
    shape.exported_at_ms = 0;
    if let Some(presence) = &mut shape.presence {
        presence.user_id.clear();
    }
    shape.encode_to_vec()
}

pub fn register(user: &str, session: &str, gateway: &str, ttl_ms: u32) -> pb::RegisterRequest {
    pb::RegisterRequest {
        user_id: user.into(),
        session_id: session.into(),
        gateway_id: gateway.into(),
        ttl_ms,
        ..Default::default()
    }
}

pub fn renew(user: &str, session: &str, generation: u64, ttl_ms: u32) -> pb::RenewRequest {
    pb::RenewRequest { user_id: user.into(), session_id: session.into(), generation, ttl_ms, ..Default::default() }
}

pub fn unregister(user: &str, session: &str, generation: u64, linger_ms: u32) -> pb::UnregisterRequest {
    pb::UnregisterRequest { user_id: user.into(), session_id: session.into(), generation, linger_ms }
}

/// Sends one batch on a fresh Leases stream and returns its results.
pub async fn lease_batch(client: &mut PresenceClient<Channel>, items: Vec<pb::LeaseItem>) -> Vec<pb::LeaseResult> {
    let batch = pb::LeaseBatch { batch_id: 1, items };
    let mut results = client.leases(tokio_stream::iter([batch])).await.expect("open Leases").into_inner();
    results.message().await.expect("a healthy stream").expect("one result batch").results
}

pub fn register_item(user: &str, session: &str, ttl_ms: u32) -> pb::LeaseItem {
    pb::LeaseItem { op: Some(pb::lease_item::Op::Register(register(user, session, "gw-test", ttl_ms))) }
}

pub fn renew_item(user: &str, session: &str, generation: u64) -> pb::LeaseItem {
    pb::LeaseItem { op: Some(pb::lease_item::Op::Renew(renew(user, session, generation, 0))) }
}

pub fn generation_of(result: &pb::LeaseResult) -> u64 {
    match &result.result {
        Some(pb::lease_result::Result::Register(registered)) => registered.generation,
        other => panic!("expected a register result, got code {} {:?}: {other:?}", result.code, result.message),
    }
}

/// A request carrying `authorization: Bearer <token>` when a token is given.
pub fn with_token<T>(message: T, token: Option<&str>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(token) = token {
        request.metadata_mut().insert("authorization", format!("Bearer {token}").parse().expect("ASCII token"));
    }
    request
}

pub fn state_of(presence: &pb::UserPresence) -> pb::State {
    pb::State::try_from(presence.state).expect("a known state")
}

pub async fn snapshot(client: &mut PresenceClient<Channel>, users: &[&str]) -> Vec<pb::UserPresence> {
    let request = pb::SnapshotRequest { user_ids: users.iter().map(|u| u.to_string()).collect(), ..Default::default() };
    client.snapshot(request).await.expect("snapshot").into_inner().users
}

/// A viewer: a Watch stream and what it has shown, applied the way a careful
/// client would, but checking instead of discarding: every update must be
/// newer than what the viewer holds (E3).
pub struct Viewer {
    stream: tonic::Streaming<pb::WatchEvent>,
    /// user -> (state, version) as shown.
    pub held: HashMap<String, (pb::State, u64)>,
    /// Every update received, in order.
    pub updates: Vec<pb::UserPresence>,
    pub resyncs: usize,
    /// `updates` events (batches) received, and the updates of the last one not yet stepped through.
    pub batches: Vec<usize>,
    /// The users of each `added` event received, in order.
    pub added: Vec<Vec<String>>,
    /// The `watch_id` of the opening snapshot, for UpdateWatch.
    pub watch_id: String,
    batched: std::collections::VecDeque<pb::UserPresence>,
}

impl Viewer {
    pub async fn open(client: &mut PresenceClient<Channel>, users: &[&str]) -> Viewer {
        let request =
            pb::WatchRequest { user_ids: users.iter().map(|u| u.to_string()).collect(), ..Default::default() };
        Viewer::open_request(client, tonic::Request::new(request)).await
    }

    /// Opens a watch of `users` at a cluster node, which merges the parts of
    /// other owners into one stream: such a stream names no `watch_id` (it
    /// is reopened rather than updated, C2).
    pub async fn open_merged(client: &mut PresenceClient<Channel>, users: &[&str]) -> Viewer {
        let request =
            pb::WatchRequest { user_ids: users.iter().map(|u| u.to_string()).collect(), ..Default::default() };
        Viewer::open_checked(client, tonic::Request::new(request), false).await
    }

    /// Opens a watch with a request the caller prepared (credentials, viewer_id).
    pub async fn open_request(
        client: &mut PresenceClient<Channel>,
        request: tonic::Request<pb::WatchRequest>,
    ) -> Viewer {
        Viewer::open_checked(client, request, true).await
    }

    async fn open_checked(
        client: &mut PresenceClient<Channel>,
        request: tonic::Request<pb::WatchRequest>,
        named: bool,
    ) -> Viewer {
        let stream = client.watch(request).await.expect("open watch").into_inner();
        let mut viewer = Viewer {
            stream,
            held: HashMap::new(),
            updates: Vec::new(),
            resyncs: 0,
            batches: Vec::new(),
            added: Vec::new(),
            watch_id: String::new(),
            batched: Default::default(),
        };
        match viewer.next_event().await {
            watch_event::Event::Snapshot(snapshot) => {
                assert_eq!(!snapshot.watch_id.is_empty(), named, "the opening snapshot names the watch: {snapshot:?}");
                viewer.watch_id = snapshot.watch_id.clone();
                viewer.apply_snapshot(snapshot);
            }
            other => panic!("a watch must open with a snapshot, got {other:?}"),
        }
        viewer
    }

    fn apply_snapshot(&mut self, snapshot: pb::Snapshot) {
        self.held = snapshot.users.iter().map(|p| (p.user_id.clone(), (state_of(p), p.version))).collect();
    }

    async fn next_event(&mut self) -> watch_event::Event {
        let item = tokio::time::timeout(PATIENCE, self.stream.message())
            .await
            .expect("a watch event within the patience")
            .expect("the stream is healthy")
            .expect("the stream is open");
        item.event.expect("an event")
    }

    /// Waits for the stream to end, and returns how it ended.
    pub async fn ended(&mut self) -> Result<(), tonic::Status> {
        match tokio::time::timeout(PATIENCE, self.stream.message()).await.expect("the stream ends") {
            Ok(Some(item)) => panic!("expected the stream to end, got {item:?}"),
            Ok(None) => Ok(()),
            Err(status) => Err(status),
        }
    }

    /// Receives one item and applies it, asserting E3 on updates.
    /// The updates of a batch count one by one, each checked like a single update.
    pub async fn step(&mut self) -> Option<pb::UserPresence> {
        if let Some(update) = self.batched.pop_front() {
            return Some(self.apply_update(update));
        }
        match self.next_event().await {
            watch_event::Event::Snapshot(snapshot) => {
                self.resyncs += 1;
                self.apply_snapshot(snapshot);
                None
            }
            watch_event::Event::Update(update) => Some(self.apply_update(update)),
            watch_event::Event::Added(added) => {
                // Added users replace nothing else the viewer holds.
                self.added.push(added.users.iter().map(|p| p.user_id.clone()).collect());
                for p in &added.users {
                    self.held.insert(p.user_id.clone(), (state_of(p), p.version));
                }
                None
            }
            watch_event::Event::Updates(batch) => {
                assert!(!batch.users.is_empty(), "an updates event carries at least one update");
                self.batches.push(batch.users.len());
                self.batched.extend(batch.users);
                let first = self.batched.pop_front().expect("not empty");
                Some(self.apply_update(first))
            }
        }
    }

    fn apply_update(&mut self, update: pb::UserPresence) -> pb::UserPresence {
        let held = self.held.get(&update.user_id).map_or(0, |(_, version)| *version);
        assert!(
            update.version > held,
            "stale or duplicate update for {}: version {} but the viewer holds {held}",
            update.user_id,
            update.version
        );
        self.held.insert(update.user_id.clone(), (state_of(&update), update.version));
        self.updates.push(update.clone());
        update
    }

    /// Receives until an update for `user` arrives; returns it.
    pub async fn until_update_of(&mut self, user: &str) -> pb::UserPresence {
        loop {
            if let Some(update) = self.step().await
                && update.user_id == user
            {
                return update;
            }
        }
    }

    /// Receives until an update puts `user` in `state`; returns it.
    pub async fn until_state(&mut self, user: &str, state: pb::State) -> pb::UserPresence {
        loop {
            let update = self.until_update_of(user).await;
            if state_of(&update) == state {
                return update;
            }
        }
    }

    /// Receives until every one of `users` is shown in `state`.
    pub async fn until_all_in_state(&mut self, users: &[&str], state: pb::State) {
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while users.iter().any(|user| self.held.get(*user).map(|held| held.0) != Some(state)) {
            assert!(tokio::time::Instant::now() < deadline, "not all of {users:?} became {state:?}");
            self.step().await;
        }
    }

    /// Receives until the viewer's view equals `expected`.
    pub async fn until_equal(&mut self, expected: &[pb::UserPresence]) {
        let want: HashMap<String, (pb::State, u64)> =
            expected.iter().map(|p| (p.user_id.clone(), (state_of(p), p.version))).collect();
        let deadline = tokio::time::Instant::now() + PATIENCE;
        while self.held != want {
            assert!(tokio::time::Instant::now() < deadline, "viewer never caught up: {:?} != {want:?}", self.held);
            self.step().await;
        }
    }

    /// The updates received for one user.
    pub fn updates_of(&self, user: &str) -> Vec<(pb::State, u64)> {
        self.updates.iter().filter(|u| u.user_id == user).map(|u| (state_of(u), u.version)).collect()
    }

    /// Flips `sentinel` (which this viewer watches) and receives until its
    /// change arrives. A viewer gets changes in publication order, so after
    /// this returns it has received every change published before the call.
    pub async fn barrier(&mut self, client: &mut PresenceClient<Channel>, sentinel: &str) {
        self.barrier_with(client, sentinel, None).await;
    }

    /// [`Viewer::barrier`], calling as the service holding `token`.
    pub async fn barrier_with(&mut self, client: &mut PresenceClient<Channel>, sentinel: &str, token: Option<&str>) {
        let request = with_token(register(sentinel, "barrier", "gw-test", 0), token);
        let registered = client.register(request).await.unwrap().into_inner();
        let generation = registered.generation;
        let flipped_online = registered.changed;
        let request = with_token(unregister(sentinel, "barrier", generation, 0), token);
        let unregistered = client.unregister(request).await.unwrap();
        assert!(unregistered.into_inner().changed, "the barrier sentinel must have been offline and alone");
        assert!(flipped_online, "the barrier sentinel must have been offline");
        // Its OFFLINE is the last change published by this call.
        self.until_state(sentinel, pb::State::Offline).await;
    }
}
