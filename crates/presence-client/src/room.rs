//! The room side of a viewer: what it holds of a room, and `WatchRoom`
//! streams that survive disconnects.
//!
//! [`RoomView`] holds one room as its member-mode watcher sees it (R2, R3,
//! S3): the members by user id, the set of signalling users per kind, and the
//! room version. A change of one member (or one signal kind) is applied only
//! if its version is greater than that of the last change applied for that
//! member (or kind) and than the snapshot's: the server sends a stream's
//! changes in room-version order, and the check keeps a delayed or repeated
//! one from undoing a newer one. A snapshot is a resync that replaces
//! everything.
//!
//! [`RoomWatcher`] feeds a view from a member-mode `WatchRoom` and
//! [`RoomCountWatcher`] follows a count-mode one (R3, for rooms too big to
//! list). Both reopen a broken stream with backoff and jitter, as
//! [`Watcher`](crate::Watcher) does, and start again from what the new stream
//! opens with; neither replays what it missed. A refusal a retry cannot fix
//! ends them: `NOT_FOUND` (the room is not readable by this caller, or no
//! longer), `FAILED_PRECONDITION` (past the server's member cap: watch the
//! counts instead), bad input or credentials.

use hashbrown::HashMap;
use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, room_event};
use tonic::transport::Channel;
use tonic::{Status, Streaming};

use crate::backoff::Backoff;
use crate::call::{Reopen, StreamCredentials, TokenProvider};

/// One room as a member-mode watcher holds it.
#[derive(Debug, Clone, Default)]
pub struct RoomView {
    room_id: String,
    /// The highest room version applied: the snapshot's, or a later change's.
    version: u64,
    /// The version of the snapshot held: a change not newer than it is in it.
    floor: u64,
    /// The members listed to this watcher, by user id.
    members: HashMap<String, pb::RoomMember>,
    /// The version of the last change applied per user, members and users who
    /// left since the snapshot alike, so that a delayed join cannot bring back
    /// a user whose leave was applied. Cleared by every snapshot.
    member_versions: HashMap<String, u64>,
    /// The last set applied per signal kind, empty ones included (for their version).
    signals: HashMap<String, pb::SignalSet>,
}

impl RoomView {
    /// An empty view of `room_id`, at version 0.
    pub fn new(room_id: impl Into<String>) -> Self {
        RoomView { room_id: room_id.into(), ..RoomView::default() }
    }

    /// Replaces everything held with `snapshot`: a resync. It is authoritative
    /// even at a lower version than held (a restarted server starts over).
    pub fn apply_snapshot(&mut self, snapshot: &pb::RoomSnapshot) {
        self.room_id.clone_from(&snapshot.room_id);
        self.version = snapshot.version;
        self.floor = snapshot.version;
        self.members = snapshot.members.iter().map(|member| (member.user_id.clone(), member.clone())).collect();
        self.member_versions.clear();
        self.signals = snapshot.signals.iter().map(|set| (set.kind.clone(), set.clone())).collect();
    }

    /// Applies a member's join, leave or update. True if it was newer than
    /// what is held of that member (the caller re-renders); false for a stale
    /// or repeated change, or one without a member or a known kind, which
    /// changes nothing.
    pub fn apply_change(&mut self, change: &pb::RoomMemberChange) -> bool {
        let Some(member) = &change.member else { return false };
        let Ok(kind) = pb::RoomChangeKind::try_from(change.kind) else { return false };
        if kind == pb::RoomChangeKind::RoomChangeUnspecified
            || change.version <= self.floor
            || change.version <= self.member_versions.get(&member.user_id).copied().unwrap_or(0)
        {
            return false;
        }
        self.member_versions.insert(member.user_id.clone(), change.version);
        if kind == pb::RoomChangeKind::RoomChangeLeft {
            self.members.remove(&member.user_id);
        } else {
            self.members.insert(member.user_id.clone(), member.clone());
        }
        self.version = self.version.max(change.version);
        true
    }

    /// Applies a kind's new set of signalling users. True if it was newer than
    /// the set held of that kind; false for a stale or repeated one.
    pub fn apply_signals(&mut self, set: &pb::SignalSet) -> bool {
        let held = self.signals.get(&set.kind).map_or(0, |held| held.version);
        if set.version <= self.floor || set.version <= held {
            return false;
        }
        self.signals.insert(set.kind.clone(), set.clone());
        self.version = self.version.max(set.version);
        true
    }

    /// The room watched.
    pub fn room_id(&self) -> &str {
        &self.room_id
    }

    /// The newest room version held.
    pub fn version(&self) -> u64 {
        self.version
    }

    /// A member, with its shown metadata; `None` if it is not in the room (or
    /// not listed to this watcher).
    pub fn member(&self, user_id: &str) -> Option<&pb::RoomMember> {
        self.members.get(user_id)
    }

    /// Every member held, in no particular order.
    ///
    /// A member's `sessions` is exact as of the last snapshot or of its last
    /// change: a session joining or leaving that changes neither membership
    /// nor the shown metadata publishes nothing (R6).
    pub fn members(&self) -> impl Iterator<Item = &pb::RoomMember> {
        self.members.values()
    }

    /// Members held.
    pub fn len(&self) -> usize {
        self.members.len()
    }

    /// Whether no member is held.
    pub fn is_empty(&self) -> bool {
        self.members.is_empty()
    }

    /// The users signalling `kind` now (at most the server's cap of them; see
    /// [`signal_count`](Self::signal_count) for the whole number).
    pub fn signalling(&self, kind: &str) -> &[String] {
        self.signals.get(kind).map_or(&[], |set| &set.user_ids)
    }

    /// How many users signal `kind` now.
    pub fn signal_count(&self, kind: &str) -> u32 {
        self.signals.get(kind).map_or(0, |set| set.count)
    }

    /// The sets of every kind someone signals now, in no particular order.
    pub fn signals(&self) -> impl Iterator<Item = &pb::SignalSet> {
        self.signals.values().filter(|set| set.count > 0)
    }
}

/// What [`RoomWatcher::next`] reports.
#[derive(Debug, Clone, PartialEq)]
pub enum RoomWatcherEvent {
    /// A member joined, left or changed its metadata; already applied to the view.
    Change(pb::RoomMemberChange),
    /// A kind's set of signalling users changed; already applied to the view.
    Signals(pb::SignalSet),
    /// The view was replaced by a fresh snapshot (after a reconnect, or a
    /// resync the server sent); re-render everything.
    Resynced,
}

/// A member-mode `WatchRoom` that survives disconnects, holding the room as a [`RoomView`].
#[derive(Debug)]
pub struct RoomWatcher {
    feed: RoomFeed,
    view: RoomView,
}

impl RoomWatcher {
    /// Opens a member watch of `room_id` and applies its snapshot.
    ///
    /// Fails with the server's answer if the watch cannot be opened
    /// (`NOT_FOUND`: not readable; `FAILED_PRECONDITION`: past the member cap,
    /// see [`RoomCountWatcher`]); only a watch that was once open is reconnected.
    pub async fn open(
        client: PresenceClient<Channel>,
        room_id: impl Into<String>,
        reconnect: Backoff,
    ) -> Result<RoomWatcher, Status> {
        let request = pb::WatchRoomRequest { room_id: room_id.into(), ..Default::default() };
        Self::open_authorized(client, request, reconnect, None).await
    }

    /// [`open`](Self::open) with a whole request (a service watching for a
    /// viewer names it in `viewer_id`), presenting `bearer_token` (a viewer's
    /// JWT or a service token) on every (re)open. The mode is always member mode.
    pub async fn open_authorized(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        reconnect: Backoff,
        bearer_token: Option<&str>,
    ) -> Result<RoomWatcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::token(bearer_token)?).await
    }

    /// [`open_authorized`](Self::open_authorized) presenting a token from
    /// `tokens`, asked again whenever the server ends the stream for its
    /// credentials (the token expired, or was revoked): the watch then
    /// reopens at once with a fresh one.
    pub async fn open_with_token_provider(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        reconnect: Backoff,
        tokens: TokenProvider,
    ) -> Result<RoomWatcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::provider(tokens).await?).await
    }

    async fn open_with(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        reconnect: Backoff,
        credentials: StreamCredentials,
    ) -> Result<RoomWatcher, Status> {
        let (feed, first) =
            RoomFeed::open(client, request, pb::RoomWatchMode::RoomWatchMembers, reconnect, credentials).await?;
        let mut view = RoomView::new(feed.request.room_id.clone());
        if let room_event::Event::Snapshot(snapshot) = &first {
            view.apply_snapshot(snapshot);
        }
        Ok(RoomWatcher { feed, view })
    }

    /// The next change applied to the view (`None` once the watch has ended
    /// for good, see [`last_error`](Self::last_error)). Stale and repeated
    /// changes are dropped here and never reported.
    pub async fn next(&mut self) -> Option<RoomWatcherEvent> {
        loop {
            match self.feed.next().await? {
                room_event::Event::Snapshot(snapshot) => {
                    self.view.apply_snapshot(&snapshot);
                    return Some(RoomWatcherEvent::Resynced);
                }
                room_event::Event::Change(change) => {
                    if self.view.apply_change(&change) {
                        return Some(RoomWatcherEvent::Change(change));
                    }
                }
                room_event::Event::Signals(set) => {
                    if self.view.apply_signals(&set) {
                        return Some(RoomWatcherEvent::Signals(set));
                    }
                }
                // Count mode only.
                room_event::Event::Count(_) => {}
            }
        }
    }

    /// What the watcher holds of the room.
    pub fn view(&self) -> &RoomView {
        &self.view
    }

    /// Why the watch ended, once [`next`](Self::next) has returned `None`.
    pub fn last_error(&self) -> Option<&Status> {
        self.feed.failed.as_ref()
    }
}

/// A count-mode `WatchRoom` that survives disconnects: the users and sessions
/// in a room too big to list, when they change, at most once per interval (R3).
#[derive(Debug)]
pub struct RoomCountWatcher {
    feed: RoomFeed,
    /// The counts last reported (or opened with).
    latest: pb::RoomCount,
}

impl RoomCountWatcher {
    /// Opens a count watch of `room_id`, with at most one count per
    /// `count_interval_ms` (100 to 60000; 0 takes the server's 1000).
    pub async fn open(
        client: PresenceClient<Channel>,
        room_id: impl Into<String>,
        count_interval_ms: u32,
        reconnect: Backoff,
    ) -> Result<RoomCountWatcher, Status> {
        let request = pb::WatchRoomRequest { room_id: room_id.into(), count_interval_ms, ..Default::default() };
        Self::open_authorized(client, request, reconnect, None).await
    }

    /// [`open`](Self::open) with a whole request (`viewer_id`,
    /// `count_interval_ms`), presenting `bearer_token` on every (re)open. The
    /// mode is always count mode.
    pub async fn open_authorized(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        reconnect: Backoff,
        bearer_token: Option<&str>,
    ) -> Result<RoomCountWatcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::token(bearer_token)?).await
    }

    /// [`open_authorized`](Self::open_authorized) presenting a token from
    /// `tokens`, asked again whenever the server ends the stream for its
    /// credentials.
    pub async fn open_with_token_provider(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        reconnect: Backoff,
        tokens: TokenProvider,
    ) -> Result<RoomCountWatcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::provider(tokens).await?).await
    }

    async fn open_with(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        reconnect: Backoff,
        credentials: StreamCredentials,
    ) -> Result<RoomCountWatcher, Status> {
        let (feed, first) =
            RoomFeed::open(client, request, pb::RoomWatchMode::RoomWatchCount, reconnect, credentials).await?;
        let latest = match first {
            room_event::Event::Count(count) => count,
            _ => pb::RoomCount::default(),
        };
        Ok(RoomCountWatcher { feed, latest })
    }

    /// The next counts that differ from the last ones reported (`None` once
    /// the watch has ended for good). After a reconnect, the new stream's
    /// first counts are reported only if they differ.
    pub async fn next(&mut self) -> Option<pb::RoomCount> {
        loop {
            if let room_event::Event::Count(count) = self.feed.next().await?
                && (count.users, count.sessions) != (self.latest.users, self.latest.sessions)
            {
                self.latest.clone_from(&count);
                return Some(count);
            }
        }
    }

    /// The counts last reported, or those the watch opened with.
    pub fn latest(&self) -> &pb::RoomCount {
        &self.latest
    }

    /// Why the watch ended, once [`next`](Self::next) has returned `None`.
    pub fn last_error(&self) -> Option<&Status> {
        self.feed.failed.as_ref()
    }
}

/// A `WatchRoom` stream reopened with backoff when it breaks: what both kinds
/// of room watcher share. It yields the stream's events, the first one of
/// every reopened stream included (a snapshot in member mode, a count in count
/// mode), and checks nothing else about them. With a token provider, a
/// stream the server ended for its credentials reopens at once with a fresh
/// token.
struct RoomFeed {
    client: PresenceClient<Channel>,
    /// Sent again on every reopen.
    request: pb::WatchRoomRequest,
    /// Presented on every (re)open.
    credentials: StreamCredentials,
    reconnect: Backoff,
    /// The open stream; `None` between a break and the next successful reopen.
    stream: Option<Streaming<pb::RoomEvent>>,
    /// Failed reopen attempts since a stream last opened.
    attempt: u32,
    /// Set when the watch ended for good; `next` then returns `None`.
    failed: Option<Status>,
    /// The next reopen goes without waiting its backoff (once).
    reopen_now: bool,
}

impl std::fmt::Debug for RoomFeed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RoomFeed")
            .field("room_id", &self.request.room_id)
            .field("open", &self.stream.is_some())
            .field("token_provider", &self.credentials.has_provider())
            .finish_non_exhaustive()
    }
}

impl RoomFeed {
    /// Opens the stream in `mode`, whatever the request says; fails with the
    /// server's answer. Also yields its first event.
    async fn open(
        client: PresenceClient<Channel>,
        request: pb::WatchRoomRequest,
        mode: pb::RoomWatchMode,
        reconnect: Backoff,
        credentials: StreamCredentials,
    ) -> Result<(RoomFeed, room_event::Event), Status> {
        let request = pb::WatchRoomRequest { mode: mode as i32, ..request };
        let mut feed = RoomFeed {
            client,
            request,
            credentials,
            reconnect,
            stream: None,
            attempt: 0,
            failed: None,
            reopen_now: false,
        };
        let first = feed.reopen().await?;
        Ok((feed, first))
    }

    async fn next(&mut self) -> Option<room_event::Event> {
        loop {
            if self.failed.is_some() {
                return None;
            }
            let Some(stream) = self.stream.as_mut() else {
                if !std::mem::take(&mut self.reopen_now) {
                    tokio::time::sleep(self.reconnect.delay(self.attempt)).await;
                    self.attempt = self.attempt.saturating_add(1);
                }
                match self.reopen().await {
                    Ok(first) => return Some(first),
                    Err(status) => self.broke(status, true),
                }
                continue;
            };
            match stream.message().await {
                Ok(Some(pb::RoomEvent { event: Some(event) })) => return Some(event),
                Ok(Some(pb::RoomEvent { event: None })) => {}
                Ok(None) => self.broke(Status::unavailable("presenced ended the room watch"), false),
                Err(status) => self.broke(status, false),
            }
        }
    }

    /// The stream broke, or a reopen failed (`reopening`), with `status`:
    /// retry (with a fresh token, when the credentials were refused and a
    /// provider gives them), or end for good.
    fn broke(&mut self, status: Status, reopening: bool) {
        self.stream = None;
        match self.credentials.after(&status, reopening) {
            Reopen::Now => {
                tracing::debug!(room_id = %self.request.room_id, %status, "the room watch needs a fresh token");
                self.reopen_now = true;
            }
            Reopen::AfterBackoff => {
                tracing::debug!(room_id = %self.request.room_id, %status, attempt = self.attempt, "the room watch broke; reconnecting");
            }
            Reopen::Never => {
                tracing::debug!(room_id = %self.request.room_id, %status, "the room watch was refused; giving up");
                self.failed = Some(status);
            }
        }
    }

    /// Opens a stream and reads its first event, which must be what the mode opens with.
    async fn reopen(&mut self) -> Result<room_event::Event, Status> {
        let request = self.credentials.request(self.request.clone()).await?;
        let mut stream = self.client.watch_room(request).await?.into_inner();
        let counting = self.request.mode == pb::RoomWatchMode::RoomWatchCount as i32;
        match stream.message().await? {
            Some(pb::RoomEvent { event: Some(first @ room_event::Event::Snapshot(_)) }) if !counting => {
                self.open_with(stream, first)
            }
            Some(pb::RoomEvent { event: Some(first @ room_event::Event::Count(_)) }) if counting => {
                self.open_with(stream, first)
            }
            Some(other) => Err(Status::internal(format!("a room watch opened with {other:?}"))),
            None => Err(Status::unavailable("the room watch ended before its first event")),
        }
    }

    fn open_with(
        &mut self,
        stream: Streaming<pb::RoomEvent>,
        first: room_event::Event,
    ) -> Result<room_event::Event, Status> {
        self.stream = Some(stream);
        self.attempt = 0;
        self.credentials.opened();
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(user: &str, tab: &str, sessions: u32) -> pb::RoomMember {
        pb::RoomMember { user_id: user.into(), metadata: [("tab".into(), tab.into())].into(), sessions }
    }

    fn change(version: u64, kind: pb::RoomChangeKind, member: pb::RoomMember) -> pb::RoomMemberChange {
        pb::RoomMemberChange { room_id: "r".into(), version, kind: kind as i32, member: Some(member) }
    }

    fn signals(version: u64, kind: &str, users: &[&str]) -> pb::SignalSet {
        pb::SignalSet {
            room_id: "r".into(),
            version,
            kind: kind.into(),
            user_ids: users.iter().map(|user| user.to_string()).collect(),
            count: users.len() as u32,
        }
    }

    fn snapshot(version: u64, members: Vec<pb::RoomMember>, sets: Vec<pb::SignalSet>) -> pb::RoomSnapshot {
        pb::RoomSnapshot { room_id: "r".into(), version, members, signals: sets, ..Default::default() }
    }

    fn tab<'a>(view: &'a RoomView, user: &str) -> Option<&'a str> {
        view.member(user).map(|member| member.metadata["tab"].as_str())
    }

    use pb::RoomChangeKind::{RoomChangeJoined as Joined, RoomChangeLeft as Left, RoomChangeUpdated as Updated};

    #[test]
    fn a_change_not_newer_than_the_last_one_of_its_member_is_ignored() {
        let mut view = RoomView::new("r");
        view.apply_snapshot(&snapshot(10, vec![member("a", "one", 1)], vec![]));
        assert!(view.apply_change(&change(12, Updated, member("a", "two", 2))));
        assert!(!view.apply_change(&change(11, Updated, member("a", "stale", 1))), "older than a's last change");
        assert!(!view.apply_change(&change(12, Updated, member("a", "again", 1))), "a repeat");
        assert_eq!(tab(&view, "a"), Some("two"));
        // Another member's change is judged by that member's own last change only.
        assert!(view.apply_change(&change(11, Joined, member("b", "one", 1))));
        assert_eq!(view.len(), 2);
        assert_eq!(view.version(), 12);
    }

    #[test]
    fn a_delayed_join_does_not_bring_back_a_member_that_left() {
        let mut view = RoomView::new("r");
        view.apply_snapshot(&snapshot(3, vec![], vec![]));
        assert!(view.apply_change(&change(4, Joined, member("a", "one", 1))));
        assert!(view.apply_change(&change(6, Left, member("a", "one", 0))));
        assert!(!view.apply_change(&change(5, Joined, member("a", "one", 1))));
        assert!(view.member("a").is_none() && view.is_empty());
        assert!(view.apply_change(&change(7, Joined, member("a", "back", 1))), "a later join is one");
        assert_eq!(tab(&view, "a"), Some("back"));
    }

    #[test]
    fn a_change_the_snapshot_already_holds_is_ignored() {
        let mut view = RoomView::new("r");
        view.apply_snapshot(&snapshot(8, vec![member("a", "one", 1)], vec![signals(8, "typing", &["a"])]));
        assert!(!view.apply_change(&change(8, Left, member("a", "one", 0))));
        assert!(!view.apply_change(&change(7, Joined, member("b", "one", 1))), "b is not new to the snapshot");
        assert!(!view.apply_signals(&signals(5, "typing", &[])));
        assert_eq!((view.len(), view.signalling("typing")), (1, &["a".to_string()][..]));
        // Nothing malformed is applied either.
        let unspecified = pb::RoomMemberChange { kind: 0, ..change(9, Joined, member("c", "one", 1)) };
        assert!(!view.apply_change(&unspecified));
        assert!(!view.apply_change(&pb::RoomMemberChange { member: None, ..change(9, Joined, member("c", "", 1)) }));
        assert!(!view.apply_change(&pb::RoomMemberChange { kind: 42, ..change(9, Joined, member("c", "", 1)) }));
        assert_eq!(view.version(), 8);
    }

    #[test]
    fn signal_sets_are_ordered_per_kind() {
        let mut view = RoomView::new("r");
        view.apply_snapshot(&snapshot(1, vec![member("a", "one", 1), member("b", "one", 1)], vec![]));
        assert!(view.apply_signals(&signals(3, "typing", &["a", "b"])));
        assert!(view.apply_signals(&signals(2, "speaking", &["b"])), "another kind has its own order");
        assert!(!view.apply_signals(&signals(2, "typing", &["a"])), "older than typing's last set");
        assert_eq!((view.signalling("typing").len(), view.signal_count("typing")), (2, 2));
        assert!(view.apply_signals(&signals(4, "typing", &[])));
        assert!(view.signalling("typing").is_empty());
        assert!(!view.apply_signals(&signals(3, "typing", &["a"])), "an emptied kind keeps its version");
        let kinds: Vec<&str> = view.signals().map(|set| set.kind.as_str()).collect();
        assert_eq!(kinds, ["speaking"], "only kinds someone signals");
        assert_eq!(view.version(), 4);
    }

    #[test]
    fn a_snapshot_replaces_everything_even_at_a_lower_version() {
        let mut view = RoomView::new("r");
        view.apply_snapshot(&snapshot(20, vec![member("a", "one", 1)], vec![signals(20, "typing", &["a"])]));
        assert!(view.apply_change(&change(21, Joined, member("b", "one", 1))));
        assert!(view.apply_change(&change(22, Left, member("a", "one", 0))));
        // A restarted server starts over at low versions: its snapshot is what holds now.
        view.apply_snapshot(&snapshot(2, vec![member("c", "one", 2)], vec![]));
        assert_eq!(view.members().map(|m| m.user_id.as_str()).collect::<Vec<_>>(), ["c"]);
        assert_eq!(view.member("c").unwrap().sessions, 2);
        assert!(view.signalling("typing").is_empty());
        assert_eq!(view.version(), 2);
        // And what a leave or a set recorded before the resync no longer stands in the way.
        assert!(view.apply_change(&change(3, Joined, member("a", "two", 1))));
        assert!(view.apply_signals(&signals(4, "typing", &["a"])));
        assert_eq!((view.len(), view.version()), (2, 4));
    }
}
