//! Counts of many rooms on one stream (R7): [`RoomCounts`] holds them, and
//! [`RoomCountsWatcher`] keeps it current from a `WatchRoomCounts` stream
//! that survives disconnects and whose rooms can change while it is open.

use std::collections::HashMap;

use presence_proto::v1::{self as pb, presence_client::PresenceClient};
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

use crate::backoff::Backoff;
use crate::call::{Reopen, StreamCredentials, TokenProvider};

/// The counts of a set of rooms, as a `WatchRoomCounts` stream sends them.
///
/// A stream's first message holds every room and replaces all that was held
/// (after a reconnect too); a later one holds the rooms whose counts changed.
/// A count of version 0 is a room nobody is in, or one the caller may not
/// read (the server answers both alike): it replaces whatever was held, so a
/// viewer who leaves a members' room stops seeing its count.
#[derive(Debug, Clone, Default)]
pub struct RoomCounts {
    counts: HashMap<String, pb::RoomCount>,
}

impl RoomCounts {
    /// Replaces everything held with a stream's first message; returns the
    /// rooms whose users or sessions differ from what was held.
    pub fn apply_first(&mut self, first: &pb::RoomCounts) -> Vec<pb::RoomCount> {
        let before = std::mem::take(&mut self.counts);
        for count in &first.counts {
            self.counts.insert(count.room_id.clone(), count.clone());
        }
        self.counts.values().filter(|count| !same(before.get(&count.room_id), count)).cloned().collect()
    }

    /// Takes in a later message; returns the rooms whose users or sessions
    /// changed. A count older than the one held (a lower version, not 0) is
    /// left out.
    pub fn apply(&mut self, message: &pb::RoomCounts) -> Vec<pb::RoomCount> {
        let mut changed = Vec::new();
        for count in &message.counts {
            let held = self.counts.get(&count.room_id);
            if held.is_some_and(|held| count.version != 0 && count.version < held.version) {
                continue;
            }
            if !same(held, count) {
                changed.push(count.clone());
            }
            self.counts.insert(count.room_id.clone(), count.clone());
        }
        changed
    }

    /// Forgets rooms no longer watched.
    pub fn remove(&mut self, room_ids: &[String]) {
        for room_id in room_ids {
            self.counts.remove(room_id);
        }
    }

    /// The room's count, if it is held.
    pub fn get(&self, room_id: &str) -> Option<&pb::RoomCount> {
        self.counts.get(room_id)
    }

    /// Every room held, in no order.
    pub fn iter(&self) -> impl Iterator<Item = &pb::RoomCount> {
        self.counts.values()
    }

    /// How many rooms are held.
    pub fn len(&self) -> usize {
        self.counts.len()
    }

    /// Whether no room is held.
    pub fn is_empty(&self) -> bool {
        self.counts.is_empty()
    }
}

fn same(held: Option<&pb::RoomCount>, count: &pb::RoomCount) -> bool {
    held.is_some_and(|held| (held.users, held.sessions) == (count.users, count.sessions))
}

/// A `WatchRoomCounts` that survives disconnects: the counts of up to 10,000
/// rooms, each reported when it changes, at most once per interval; rooms
/// added and removed with [`update`](Self::update). With a token provider, a
/// stream the server ended for its credentials reopens at once with a fresh
/// token.
pub struct RoomCountsWatcher {
    client: PresenceClient<Channel>,
    /// Sent again on every reopen, with the rooms watched now.
    request: pb::WatchRoomCountsRequest,
    credentials: StreamCredentials,
    reconnect: Backoff,
    /// The open stream and its `watch_id`; `None` between a break and the next reopen.
    stream: Option<(Streaming<pb::RoomCounts>, String)>,
    /// Failed reopen attempts since a stream last opened.
    attempt: u32,
    /// Set when the watch ended for good; `next` then returns `None`.
    failed: Option<Status>,
    reopen_now: bool,
    counts: RoomCounts,
}

impl std::fmt::Debug for RoomCountsWatcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomCountsWatcher")
            .field("rooms", &self.request.room_ids.len())
            .field("open", &self.stream.is_some())
            .field("token_provider", &self.credentials.has_provider())
            .finish_non_exhaustive()
    }
}

impl RoomCountsWatcher {
    /// Opens a watch of `room_ids`' counts, at most one message per
    /// `count_interval_ms` (100 to 60000; 0 takes the server's 1000).
    pub async fn open(
        client: PresenceClient<Channel>,
        room_ids: Vec<String>,
        count_interval_ms: u32,
        reconnect: Backoff,
    ) -> Result<RoomCountsWatcher, Status> {
        let request = pb::WatchRoomCountsRequest { room_ids, count_interval_ms, ..Default::default() };
        Self::open_authorized(client, request, reconnect, None).await
    }

    /// [`open`](Self::open) with a whole request (`viewer_id`), presenting
    /// `bearer_token` on every (re)open.
    pub async fn open_authorized(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomCountsRequest,
        reconnect: Backoff,
        bearer_token: Option<&str>,
    ) -> Result<RoomCountsWatcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::token(bearer_token)?).await
    }

    /// [`open_authorized`](Self::open_authorized) presenting a token from
    /// `tokens`, asked again whenever the server ends the stream for its
    /// credentials.
    pub async fn open_with_token_provider(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomCountsRequest,
        reconnect: Backoff,
        tokens: TokenProvider,
    ) -> Result<RoomCountsWatcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::provider(tokens).await?).await
    }

    async fn open_with(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomCountsRequest,
        reconnect: Backoff,
        credentials: StreamCredentials,
    ) -> Result<RoomCountsWatcher, Status> {
        let mut watcher = RoomCountsWatcher {
            client,
            request,
            credentials,
            reconnect,
            stream: None,
            attempt: 0,
            failed: None,
            reopen_now: false,
            counts: RoomCounts::default(),
        };
        watcher.reopen().await?;
        Ok(watcher)
    }

    /// The next counts that changed (`None` once the watch has ended for
    /// good). After a reconnect, the rooms whose counts differ from those held.
    pub async fn next(&mut self) -> Option<Vec<pb::RoomCount>> {
        loop {
            if self.failed.is_some() {
                return None;
            }
            let Some((stream, _)) = self.stream.as_mut() else {
                if !std::mem::take(&mut self.reopen_now) {
                    tokio::time::sleep(self.reconnect.delay(self.attempt)).await;
                    self.attempt = self.attempt.saturating_add(1);
                }
                match self.reopen().await {
                    Ok(changed) if changed.is_empty() => continue,
                    Ok(changed) => return Some(changed),
                    Err(status) => self.broke(status, true),
                }
                continue;
            };
            match stream.message().await {
                Ok(Some(message)) => {
                    let changed = self.counts.apply(&message);
                    if !changed.is_empty() {
                        return Some(changed);
                    }
                }
                Ok(None) => self.broke(Status::unavailable("presenced ended the room counts watch"), false),
                Err(status) => self.broke(status, false),
            }
        }
    }

    /// Adds rooms to the watch and removes others. Their counts come on the
    /// stream; a reopen watches the rooms as they are now. A stream that
    /// ended meanwhile takes the change when it reopens.
    pub async fn update(&mut self, add: Vec<String>, remove: Vec<String>) -> Result<(), Status> {
        self.request.room_ids.retain(|room_id| !remove.contains(room_id));
        for room_id in &add {
            if !self.request.room_ids.contains(room_id) {
                self.request.room_ids.push(room_id.clone());
            }
        }
        self.counts.remove(&remove);
        let Some((_, watch_id)) = &self.stream else { return Ok(()) };
        let update = pb::UpdateWatchRoomCountsRequest {
            watch_id: watch_id.clone(),
            add_room_ids: add,
            remove_room_ids: remove,
            viewer_id: self.request.viewer_id.clone(),
        };
        let update = self.credentials.request(update).await?;
        match self.client.update_watch_room_counts(update).await {
            Ok(_) => Ok(()),
            // The stream ended under it: the reopen watches the new rooms.
            Err(status) if status.code() == Code::NotFound => Ok(()),
            Err(status) => Err(status),
        }
    }

    /// The counts held now.
    pub fn counts(&self) -> &RoomCounts {
        &self.counts
    }

    /// Why the watch ended, once [`next`](Self::next) has returned `None`.
    pub fn last_error(&self) -> Option<&Status> {
        self.failed.as_ref()
    }

    fn broke(&mut self, status: Status, reopening: bool) {
        self.stream = None;
        match self.credentials.after(&status, reopening) {
            Reopen::Now => self.reopen_now = true,
            Reopen::AfterBackoff => {
                tracing::debug!(%status, attempt = self.attempt, "the room counts watch broke; reconnecting");
            }
            Reopen::Never => {
                tracing::debug!(%status, "the room counts watch was refused; giving up");
                self.failed = Some(status);
            }
        }
    }

    /// Opens a stream and takes in its first message; returns the rooms
    /// whose counts differ from those held.
    async fn reopen(&mut self) -> Result<Vec<pb::RoomCount>, Status> {
        let request = self.credentials.request(self.request.clone()).await?;
        let mut stream = self.client.watch_room_counts(request).await?.into_inner();
        let first = stream
            .message()
            .await?
            .ok_or_else(|| Status::unavailable("the room counts watch ended before its first message"))?;
        let changed = self.counts.apply_first(&first);
        self.stream = Some((stream, first.watch_id));
        self.attempt = 0;
        self.credentials.opened();
        Ok(changed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn count(room: &str, version: u64, users: u32) -> pb::RoomCount {
        pb::RoomCount { room_id: room.into(), version, users, sessions: users }
    }

    fn message(counts: Vec<pb::RoomCount>) -> pb::RoomCounts {
        pb::RoomCounts { counts, watch_id: String::new() }
    }

    fn rooms(changed: &[pb::RoomCount]) -> Vec<&str> {
        let mut rooms: Vec<&str> = changed.iter().map(|count| count.room_id.as_str()).collect();
        rooms.sort_unstable();
        rooms
    }

    #[test]
    fn r7_a_first_message_replaces_everything_and_reports_only_what_differs() {
        let mut counts = RoomCounts::default();
        assert_eq!(rooms(&counts.apply_first(&message(vec![count("a", 3, 1), count("b", 0, 0)]))), ["a", "b"]);
        let again = counts.apply_first(&message(vec![count("a", 5, 1), count("c", 2, 4)]));
        assert_eq!(rooms(&again), ["c"], "a's counts did not change; b is gone");
        assert!(counts.get("b").is_none() && counts.get("a").unwrap().version == 5);
    }

    #[test]
    fn r7_an_older_count_is_left_out_but_a_room_read_as_unknown_is_taken() {
        let mut counts = RoomCounts::default();
        counts.apply_first(&message(vec![count("a", 7, 2)]));
        assert!(counts.apply(&message(vec![count("a", 6, 9)])).is_empty(), "older than held");
        assert_eq!(counts.get("a").unwrap().users, 2);
        assert_eq!(rooms(&counts.apply(&message(vec![count("a", 0, 0)]))), ["a"], "no longer readable");
        assert_eq!(rooms(&counts.apply(&message(vec![count("a", 9, 3)]))), ["a"]);
        counts.remove(&["a".to_string()]);
        assert!(counts.is_empty());
    }
}
