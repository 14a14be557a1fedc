//! The viewer side: what a viewer holds, and a Watch that survives disconnects.
//!
//! [`ViewerStore`] is the seed's `known` map (000, "Reordered events"): per user
//! the newest presence seen, where an event not newer than what is held is a
//! delayed or duplicate one and is dropped, and a snapshot is a resync that
//! replaces everything. [`Watcher`] feeds a store from a `Watch` stream and,
//! when the stream ends, reopens it with backoff and jitter and resyncs from
//! the fresh snapshot instead of trying to replay what it missed. A reopen
//! says which version it holds of each user (E8), so the server sends only the
//! users that changed meanwhile: a reconnect storm of viewers that missed
//! nothing costs almost nothing. [`Watcher::update`] changes the watched users
//! of the open stream (E7) and of every reopen after it.

use std::collections::VecDeque;

use hashbrown::HashMap;

use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, watch_event};
use tonic::transport::Channel;
use tonic::{Code, Status, Streaming};

use crate::backoff::Backoff;
use crate::call::{Reopen, StreamCredentials, TokenProvider, authorized};

/// What a viewer holds: per user, the newest presence seen.
#[derive(Debug, Clone, Default)]
pub struct ViewerStore {
    /// By user id, hashed with hashbrown's fast default hasher: a viewer looks
    /// up every change it receives here (hundreds of thousands a second for a
    /// busy one), and the ids come from the server, not from an attacker.
    users: HashMap<String, pb::UserPresence>,
}

impl ViewerStore {
    /// An empty store.
    pub fn new() -> Self {
        ViewerStore::default()
    }

    /// Replaces everything held for these users, and forgets others: a snapshot is a resync.
    pub fn apply_snapshot(&mut self, users: &[pb::UserPresence]) {
        self.users.clear();
        for user in users {
            self.users.insert(user.user_id.clone(), user.clone());
        }
    }

    /// Applies one change. True if newer than held (the caller re-renders);
    /// false for a stale or duplicate event, which changes nothing.
    pub fn apply_update(&mut self, update: &pb::UserPresence) -> bool {
        // Looked up by reference first: most updates are of users already held,
        // and their ids need no copy.
        match self.users.get_mut(&update.user_id) {
            Some(held) if update.version <= held.version => false,
            Some(held) => {
                held.clone_from(update);
                true
            }
            None => {
                self.users.insert(update.user_id.clone(), update.clone());
                true
            }
        }
    }

    /// Applies a resumed snapshot (`partial`: it left out users whose version
    /// the viewer said it holds): the users sent replace what is held of them,
    /// the others held and still in `watched` stay, the rest are forgotten.
    pub fn apply_partial_snapshot(&mut self, users: &[pb::UserPresence], watched: &[String]) {
        let watched: hashbrown::HashSet<&str> = watched.iter().map(String::as_str).collect();
        self.users.retain(|user_id, _| watched.contains(user_id.as_str()));
        for user in users {
            self.users.insert(user.user_id.clone(), user.clone());
        }
    }

    /// Forgets users no longer watched.
    pub fn remove(&mut self, user_ids: &[String]) {
        for user_id in user_ids {
            self.users.remove(user_id);
        }
    }

    /// The version held of each of `user_ids` that is held.
    pub fn versions(&self, user_ids: &[String]) -> std::collections::HashMap<String, u64> {
        user_ids.iter().filter_map(|user_id| self.users.get(user_id).map(|p| (user_id.clone(), p.version))).collect()
    }

    /// The newest presence held for `user_id`.
    pub fn get(&self, user_id: &str) -> Option<&pb::UserPresence> {
        self.users.get(user_id)
    }

    /// Users held.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether no user is held.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// Every user held, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = &pb::UserPresence> {
        self.users.values()
    }
}

/// What [`Watcher::next`] reports.
#[derive(Debug, Clone, PartialEq)]
pub enum WatcherEvent {
    /// A user's change, newer than what the store held; already applied.
    Update(pb::UserPresence),
    /// The store was replaced by a fresh snapshot (after a reconnect, or a resync
    /// the server sent); re-render everything.
    Resynced,
}

/// A Watch that survives disconnects: reconnects with backoff + jitter and resyncs from a fresh snapshot.
pub struct Watcher {
    client: PresenceClient<Channel>,
    /// Sent again on every reconnect.
    request: pb::WatchRequest,
    reconnect: Backoff,
    /// The open stream; `None` between a break and the next successful reopen.
    stream: Option<Streaming<pb::WatchEvent>>,
    store: ViewerStore,
    /// Failed reopen attempts since the last snapshot arrived.
    attempt: u32,
    /// Set when the watch ended for good; `next` then returns `None`.
    failed: Option<Status>,
    /// Presented on every (re)open and `UpdateWatch`: the viewer's own
    /// token, a service token, or fresh ones from a provider.
    credentials: StreamCredentials,
    /// Updates of a batch already applied to the store and not yet reported.
    unreported: VecDeque<pb::UserPresence>,
    /// The open stream's name for `UpdateWatch`.
    watch_id: String,
    /// Whether a reopen sends the versions held (E8); on unless turned off.
    resume: bool,
    /// The next reopen goes without waiting its backoff (once).
    reopen_now: bool,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("user_ids", &self.request.user_ids)
            .field("open", &self.stream.is_some())
            .field("held", &self.store.len())
            .field("token_provider", &self.credentials.has_provider())
            .finish_non_exhaustive()
    }
}

impl Watcher {
    /// Opens a watch of `user_ids` and applies its first snapshot.
    ///
    /// Fails with the server's answer if the watch cannot be opened; only a
    /// watch that was once open is reconnected.
    pub async fn open(
        client: PresenceClient<Channel>,
        user_ids: Vec<String>,
        reconnect: Backoff,
    ) -> Result<Watcher, Status> {
        Self::open_request(client, pb::WatchRequest { user_ids, ..Default::default() }, reconnect).await
    }

    /// [`open`](Self::open) with a whole request, for its other fields (a service
    /// watching for a viewer names it in `viewer_id`); every reconnect sends it again.
    pub async fn open_request(
        client: PresenceClient<Channel>,
        request: pb::WatchRequest,
        reconnect: Backoff,
    ) -> Result<Watcher, Status> {
        Self::open_authorized(client, request, reconnect, None).await
    }

    /// [`open_request`](Self::open_request) presenting `bearer_token` (a viewer's
    /// JWT or a service token) on every (re)open.
    pub async fn open_authorized(
        client: PresenceClient<Channel>,
        request: pb::WatchRequest,
        reconnect: Backoff,
        bearer_token: Option<&str>,
    ) -> Result<Watcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::token(bearer_token)?).await
    }

    /// [`open_request`](Self::open_request) presenting a token from `tokens`,
    /// asked again whenever the server ends the stream for its credentials
    /// (`UNAUTHENTICATED`: the token expired, or was revoked): the watch
    /// reopens at once with the fresh token and the versions it holds (E8),
    /// so the viewer sees no gap and nothing goes blank.
    pub async fn open_with_token_provider(
        client: PresenceClient<Channel>,
        request: pb::WatchRequest,
        reconnect: Backoff,
        tokens: TokenProvider,
    ) -> Result<Watcher, Status> {
        Self::open_with(client, request, reconnect, StreamCredentials::provider(tokens).await?).await
    }

    async fn open_with(
        client: PresenceClient<Channel>,
        request: pb::WatchRequest,
        reconnect: Backoff,
        credentials: StreamCredentials,
    ) -> Result<Watcher, Status> {
        let mut watcher = Watcher {
            client,
            request,
            reconnect,
            stream: None,
            store: ViewerStore::new(),
            attempt: 0,
            failed: None,
            credentials,
            unreported: VecDeque::new(),
            watch_id: String::new(),
            resume: true,
            reopen_now: false,
        };
        watcher.reopen().await?;
        Ok(watcher)
    }

    /// Next change applied to the store (None when closed); resyncs are applied
    /// internally and reported as [`WatcherEvent::Resynced`].
    ///
    /// Stale and duplicate updates are dropped here and never reported. The
    /// watch is closed for good only when reopening it is refused for a reason
    /// a retry cannot fix (see [`last_error`](Self::last_error)).
    pub async fn next(&mut self) -> Option<WatcherEvent> {
        if self.failed.is_some() {
            return None;
        }
        loop {
            if let Some(update) = self.unreported.pop_front() {
                return Some(WatcherEvent::Update(update));
            }
            let Some(stream) = self.stream.as_mut() else {
                // A spent token is replaced and the watch reopened at once;
                // anything else waits its backoff.
                if !std::mem::take(&mut self.reopen_now) {
                    tokio::time::sleep(self.reconnect.delay(self.attempt)).await;
                    self.attempt = self.attempt.saturating_add(1);
                }
                match self.reopen().await {
                    Ok(()) => return Some(WatcherEvent::Resynced),
                    Err(status) => match self.credentials.after(&status, true) {
                        Reopen::Never => {
                            tracing::warn!(%status, "the watch cannot be reopened; giving up");
                            self.failed = Some(status);
                            return None;
                        }
                        _ => {
                            tracing::debug!(%status, attempt = self.attempt, "reopening the watch failed; retrying");
                            continue;
                        }
                    },
                }
            };
            match stream.message().await {
                Ok(Some(pb::WatchEvent { event: Some(watch_event::Event::Update(update)), .. })) => {
                    if self.store.apply_update(&update) {
                        return Some(WatcherEvent::Update(update));
                    }
                }
                Ok(Some(pb::WatchEvent { event: Some(watch_event::Event::Updates(batch)), .. })) => {
                    // Applied at once, in order, so the store is current with the
                    // batch; reported one by one from `unreported`.
                    for update in batch.users {
                        if self.store.apply_update(&update) {
                            self.unreported.push_back(update);
                        }
                    }
                }
                Ok(Some(pb::WatchEvent { event: Some(watch_event::Event::Added(added)), .. })) => {
                    // Users this client's `update` added, with their presence.
                    for update in added.users {
                        if self.store.apply_update(&update) {
                            self.unreported.push_back(update);
                        }
                    }
                }
                Ok(Some(pb::WatchEvent { event: Some(watch_event::Event::Snapshot(snapshot)), .. })) => {
                    self.apply_snapshot(snapshot);
                    return Some(WatcherEvent::Resynced);
                }
                Ok(Some(pb::WatchEvent { event: None, .. })) => {}
                Ok(None) => {
                    tracing::debug!("the watch stream ended; reconnecting");
                    self.stream = None;
                }
                Err(status) => {
                    // Any break is reopened (a refusal a retry cannot fix
                    // then ends the watch as its reopen's answer); one for
                    // the token is reopened at once with a fresh one.
                    tracing::debug!(%status, "the watch stream broke; reconnecting");
                    self.stream = None;
                    self.reopen_now = self.credentials.after(&status, false) == Reopen::Now;
                }
            }
        }
    }

    /// What the viewer holds.
    pub fn store(&self) -> &ViewerStore {
        &self.store
    }

    /// The users watched.
    pub fn user_ids(&self) -> &[String] {
        &self.request.user_ids
    }

    /// Why the watch closed, once [`next`](Self::next) has returned `None`.
    pub fn last_error(&self) -> Option<&Status> {
        self.failed.as_ref()
    }

    /// Sets whether a reopen says which versions the viewer holds (E8; on by default).
    pub fn set_resume(&mut self, resume: bool) {
        self.resume = resume;
    }

    /// Adds users to the watch and removes others (E7), without reopening it:
    /// added users arrive (as updates from [`next`](Self::next)) with their
    /// presence, removed ones are forgotten and send nothing more, and no
    /// change of the others is lost. Every later reopen watches the new set.
    /// While the stream is broken only the set for the next reopen changes.
    pub async fn update(&mut self, add: Vec<String>, remove: Vec<String>) -> Result<(), Status> {
        if self.stream.is_some() {
            let update = pb::UpdateWatchRequest {
                watch_id: self.watch_id.clone(),
                add_user_ids: add.clone(),
                remove_user_ids: remove.clone(),
                viewer_id: self.request.viewer_id.clone(),
            };
            let request = authorized(update, self.credentials.authorization());
            match self.client.update_watch(request).await {
                Ok(_) => {}
                // The stream ended meanwhile; the reopen watches the new set.
                Err(status) if status.code() == Code::NotFound => self.stream = None,
                Err(status) => return Err(status),
            }
        }
        let removed: hashbrown::HashSet<&String> = remove.iter().collect();
        self.request.user_ids.retain(|user_id| !removed.contains(user_id));
        for user_id in add {
            if !removed.contains(&user_id) && !self.request.user_ids.contains(&user_id) {
                self.request.user_ids.push(user_id);
            }
        }
        self.store.remove(&remove);
        Ok(())
    }

    /// Applies a snapshot of the stream: a whole one replaces the store, a
    /// resumed (`partial`) one only the users it carries.
    fn apply_snapshot(&mut self, snapshot: pb::Snapshot) {
        if !snapshot.watch_id.is_empty() {
            self.watch_id = snapshot.watch_id;
        }
        if snapshot.partial {
            self.store.apply_partial_snapshot(&snapshot.users, &self.request.user_ids);
        } else {
            self.store.apply_snapshot(&snapshot.users);
        }
    }

    /// Opens a stream and applies its first item, which must be a snapshot.
    async fn reopen(&mut self) -> Result<(), Status> {
        let mut request = self.request.clone();
        if self.resume {
            request.known_versions = self.store.versions(&request.user_ids);
        }
        let request = self.credentials.request(request).await?;
        let mut stream = self.client.watch(request).await?.into_inner();
        match stream.message().await? {
            Some(pb::WatchEvent { event: Some(watch_event::Event::Snapshot(snapshot)), .. }) => {
                self.apply_snapshot(snapshot);
                self.stream = Some(stream);
                self.attempt = 0;
                self.credentials.opened();
                Ok(())
            }
            Some(other) => Err(Status::internal(format!("a watch must open with a snapshot, got {other:?}"))),
            None => Err(Status::unavailable("the watch ended before its snapshot")),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn presence(user: &str, state: pb::State, version: u64) -> pb::UserPresence {
        pb::UserPresence { user_id: user.into(), state: state as i32, version, ..Default::default() }
    }

    fn held(store: &ViewerStore, user: &str) -> Option<(pb::State, u64)> {
        store.get(user).map(|p| (pb::State::try_from(p.state).unwrap(), p.version))
    }

    #[test]
    fn offline_v2_arriving_before_online_v1_stays_offline() {
        // Seed 000, "Reordered events": two gateways publish through a bus with no
        // global order, and the OFFLINE that happened last arrives first.
        let mut store = ViewerStore::new();
        store.apply_snapshot(&[presence("42", pb::State::Offline, 0)]);
        assert!(store.apply_update(&presence("42", pb::State::Offline, 2)));
        assert!(!store.apply_update(&presence("42", pb::State::Online, 1)), "a delayed event is stale");
        assert_eq!(held(&store, "42"), Some((pb::State::Offline, 2)));
    }

    #[test]
    fn duplicates_and_equal_versions_are_ignored() {
        let mut store = ViewerStore::new();
        assert!(store.apply_update(&presence("a", pb::State::Online, 5)));
        assert!(!store.apply_update(&presence("a", pb::State::Online, 5)), "exact duplicate");
        assert!(!store.apply_update(&presence("a", pb::State::Offline, 5)), "same version, other state");
        assert!(!store.apply_update(&presence("a", pb::State::Offline, 4)));
        assert_eq!(held(&store, "a"), Some((pb::State::Online, 5)));
        assert!(store.apply_update(&presence("a", pb::State::Offline, 6)));
        assert_eq!(held(&store, "a"), Some((pb::State::Offline, 6)));
    }

    #[test]
    fn any_arrival_order_ends_on_the_newest_version() {
        // Every permutation of four events of one user leaves the newest.
        let events = [
            presence("u", pb::State::Online, 10),
            presence("u", pb::State::Offline, 11),
            presence("u", pb::State::Online, 12),
            presence("u", pb::State::Offline, 13),
        ];
        let mut order = [0usize, 1, 2, 3];
        let mut permutations = 0;
        loop {
            let mut store = ViewerStore::new();
            let mut accepted = Vec::new();
            for &i in &order {
                if store.apply_update(&events[i]) {
                    accepted.push(events[i].version);
                }
            }
            assert_eq!(held(&store, "u"), Some((pb::State::Offline, 13)), "order {order:?}");
            assert!(accepted.windows(2).all(|w| w[0] < w[1]), "accepted versions only grow: {accepted:?}");
            permutations += 1;
            if !next_permutation(&mut order) {
                break;
            }
        }
        assert_eq!(permutations, 24);
    }

    fn next_permutation(order: &mut [usize]) -> bool {
        let Some(i) = (1..order.len()).rev().find(|&i| order[i - 1] < order[i]) else { return false };
        let j = (i..order.len()).rev().find(|&j| order[j] > order[i - 1]).expect("exists");
        order.swap(i - 1, j);
        order[i..].reverse();
        true
    }

    #[test]
    fn snapshot_replaces_everything_and_forgets_others() {
        let mut store = ViewerStore::new();
        store.apply_snapshot(&[presence("a", pb::State::Online, 7), presence("b", pb::State::Online, 3)]);
        assert!(store.apply_update(&presence("c", pb::State::Online, 1)));
        assert_eq!(store.len(), 3);
        // A resync is authoritative, even where it holds a lower version (a store
        // that lost its history answers what it knows now).
        store.apply_snapshot(&[presence("a", pb::State::Offline, 2)]);
        assert_eq!(store.len(), 1);
        assert_eq!(held(&store, "a"), Some((pb::State::Offline, 2)));
        assert_eq!(store.get("b"), None);
        assert_eq!(store.get("c"), None);
        assert!(store.apply_update(&presence("a", pb::State::Online, 3)));
        assert_eq!(store.iter().count(), 1);
        store.apply_snapshot(&[]);
        assert!(store.is_empty());
    }

    #[test]
    fn e8_a_resumed_snapshot_replaces_only_the_users_it_carries() {
        let mut store = ViewerStore::new();
        store.apply_snapshot(&[presence("a", pb::State::Online, 7), presence("b", pb::State::Online, 3)]);
        store.apply_update(&presence("gone", pb::State::Online, 1));
        let watched = ["a".to_string(), "b".to_string(), "c".to_string()];
        assert_eq!(store.versions(&watched), [("a".to_string(), 7), ("b".to_string(), 3)].into());
        // b changed while the viewer was away; a did not; c is new; "gone" is no longer watched.
        store.apply_partial_snapshot(
            &[presence("b", pb::State::Offline, 4), presence("c", pb::State::Online, 2)],
            &watched,
        );
        assert_eq!(held(&store, "a"), Some((pb::State::Online, 7)), "kept: the server left it out as unchanged");
        assert_eq!(held(&store, "b"), Some((pb::State::Offline, 4)));
        assert_eq!(held(&store, "c"), Some((pb::State::Online, 2)));
        assert_eq!(store.get("gone"), None);
    }
}
