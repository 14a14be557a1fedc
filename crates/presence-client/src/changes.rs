//! The change feed's resumable consumer (F1, F2): `Changes` read in
//! batches, each batch's cursor saved to a store the caller provides once
//! the caller has processed the batch, and every reopen resuming from the
//! cursor saved last.
//!
//! Delivery is at least once, identified by cursor: a batch is handed out
//! again until it is committed, so a consumer that dies (or fails) between
//! processing a batch and committing it sees that batch again, with the same
//! cursors, and nothing that was committed. Processing made idempotent by
//! cursor (or by user and version) is then exactly once.
//!
//! A cursor the feed no longer retains is not retried: it is
//! [`ChangesError::OutOfRange`] with the oldest cursor the feed holds, for
//! the caller to resync from a `Snapshot` and [`resume_from`](ChangesConsumer::resume_from)
//! it. A `gap` (changes the feed lost) is an event like the others.

use std::fmt;
use std::future::Future;
use std::io::{self, Write as _};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::Poll;

use presence_proto::v1::presence_client::PresenceClient;
use presence_proto::v1::{self as pb, change_event};
use prost::Message as _;
use tokio_stream::Stream as _;
use tonic::transport::Channel;
use tonic::{Status, Streaming};

use crate::backoff::Backoff;
use crate::call::{Reopen, StreamCredentials, TokenProvider};

/// The type URL of the `ChangesOutOfRange` detail of an `OUT_OF_RANGE` refusal.
const OUT_OF_RANGE_TYPE_URL: &str = "type.googleapis.com/presence.v1.ChangesOutOfRange";

/// Where a consumer keeps the cursor of the last batch it processed.
///
/// [`ChangesConsumer`] loads it when it opens and saves each batch's cursor
/// once the caller committed the batch. A store that saves to the same place
/// the processing writes to (a row of the database the consumer updates, in
/// the same transaction) makes processing and cursor one step.
pub trait CursorStore: Send {
    /// The cursor saved last, or `None` when none ever was.
    fn load(&mut self) -> impl Future<Output = io::Result<Option<Vec<u8>>>> + Send;

    /// Saves `cursor` in place of the one before. Once it returned `Ok`, a
    /// load (in this process or a later one) returns it.
    fn save(&mut self, cursor: &[u8]) -> impl Future<Output = io::Result<()>> + Send;
}

/// A cursor in a file, as one line of hex ([`cursor_to_hex`], what
/// `presenced changes --cursor-file` reads and writes too), replaced
/// atomically: written to `FILE.tmp`, synced, renamed over the file, and the
/// directory synced, so that a crash leaves the old cursor or the new one,
/// never a torn one. A missing or empty file holds no cursor.
#[derive(Debug, Clone)]
pub struct FileCursorStore {
    path: PathBuf,
}

impl FileCursorStore {
    /// The cursor in `path` (created on the first save).
    pub fn new(path: impl Into<PathBuf>) -> Self {
        FileCursorStore { path: path.into() }
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl CursorStore for FileCursorStore {
    fn load(&mut self) -> impl Future<Output = io::Result<Option<Vec<u8>>>> + Send {
        let path = self.path.clone();
        blocking(move || read_cursor_file(&path))
    }

    fn save(&mut self, cursor: &[u8]) -> impl Future<Output = io::Result<()>> + Send {
        let (path, cursor) = (self.path.clone(), cursor.to_vec());
        blocking(move || write_cursor_file(&path, &cursor))
    }
}

/// File work off the runtime's threads: a sync takes milliseconds.
async fn blocking<T: Send + 'static>(work: impl FnOnce() -> io::Result<T> + Send + 'static) -> io::Result<T> {
    tokio::task::spawn_blocking(work).await.map_err(io::Error::other)?
}

/// `err` with the file it is about.
fn about(path: &Path, err: impl fmt::Display, kind: io::ErrorKind) -> io::Error {
    io::Error::new(kind, format!("{}: {err}", path.display()))
}

fn read_cursor_file(path: &Path) -> io::Result<Option<Vec<u8>>> {
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(err) if err.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(about(path, &err, err.kind())),
    };
    let text = text.trim();
    if text.is_empty() {
        return Ok(None);
    }
    cursor_from_hex(text).map(Some).map_err(|err| about(path, err, io::ErrorKind::InvalidData))
}

fn write_cursor_file(path: &Path, cursor: &[u8]) -> io::Result<()> {
    let mut temporary = path.as_os_str().to_owned();
    temporary.push(".tmp");
    let temporary = PathBuf::from(temporary);
    let written = (|| {
        let mut file = std::fs::File::create(&temporary)?;
        file.write_all(format!("{}\n", cursor_to_hex(cursor)).as_bytes())?;
        file.sync_all()?;
        std::fs::rename(&temporary, path)?;
        // The rename is durable once the directory that holds the name is synced.
        #[cfg(unix)]
        {
            let dir = path.parent().filter(|dir| !dir.as_os_str().is_empty()).unwrap_or(Path::new("."));
            std::fs::File::open(dir)?.sync_all()?;
        }
        Ok(())
    })();
    written.map_err(|err: io::Error| {
        let _ = std::fs::remove_file(&temporary);
        about(path, &err, err.kind())
    })
}

/// A cursor in memory: for a consumer whose process keeps it, for tests, and
/// for `now` feeds that need not survive a restart. Clones share the cursor.
#[derive(Debug, Clone, Default)]
pub struct MemoryCursorStore {
    cursor: Arc<Mutex<Option<Vec<u8>>>>,
}

impl MemoryCursorStore {
    /// A store holding no cursor.
    pub fn new() -> Self {
        MemoryCursorStore::default()
    }

    /// The cursor saved last.
    pub fn cursor(&self) -> Option<Vec<u8>> {
        self.cursor.lock().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }
}

impl CursorStore for MemoryCursorStore {
    fn load(&mut self) -> impl Future<Output = io::Result<Option<Vec<u8>>>> + Send {
        std::future::ready(Ok(self.cursor()))
    }

    fn save(&mut self, cursor: &[u8]) -> impl Future<Output = io::Result<()>> + Send {
        *self.cursor.lock().unwrap_or_else(std::sync::PoisonError::into_inner) = Some(cursor.to_vec());
        std::future::ready(Ok(()))
    }
}

/// A cursor as text: lowercase hex. What `presenced changes` prints and its
/// `--from` takes, and what [`FileCursorStore`] (and the TypeScript client's
/// file store) write.
pub fn cursor_to_hex(cursor: &[u8]) -> String {
    cursor.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// A cursor from its text form ([`cursor_to_hex`]; upper case is taken too).
pub fn cursor_from_hex(text: &str) -> Result<Vec<u8>, NotACursor> {
    if text.is_empty() {
        return Err(NotACursor("empty"));
    }
    if !text.len().is_multiple_of(2) {
        return Err(NotACursor("an odd number of hex digits"));
    }
    let digit = |byte: u8| char::from(byte).to_digit(16).ok_or(NotACursor("only hex digits (0-9, a-f) make one"));
    text.as_bytes().chunks(2).map(|pair| Ok((digit(pair[0])? * 16 + digit(pair[1])?) as u8)).collect()
}

/// Text that is not a cursor's hex form.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("not a cursor: {0}")]
pub struct NotACursor(&'static str);

/// Why a [`ChangesConsumer`] stopped handing out batches.
#[derive(Debug, thiserror::Error)]
pub enum ChangesError {
    /// The cursor is older than the oldest change the feed retains (or is
    /// not one of this feed's: another server's, or from before its data
    /// directory was replaced). Not retried: resync what matters with a
    /// `Snapshot`, then [`resume_from`](ChangesConsumer::resume_from) `oldest_cursor`.
    #[error("{}; the oldest cursor is {}", status.message(), cursor_to_hex(oldest_cursor))]
    OutOfRange {
        /// Resumes at the oldest change the feed holds (the refusal's `ChangesOutOfRange` detail).
        oldest_cursor: Vec<u8>,
        /// The refusal.
        status: Status,
    },
    /// The server refused the feed for a reason a retry cannot fix (bad
    /// input, credentials, a node that keeps no feed); or, when opening, the
    /// first stream could not be opened at all.
    #[error("{:?}: {}", .0.code(), .0.message())]
    Refused(Status),
    /// The cursor store could not load or save.
    #[error("the cursor store failed: {0}")]
    Store(#[source] io::Error),
    /// The handler of [`run`](ChangesConsumer::run) failed; its batch was not committed.
    #[error("the batch's handler failed: {0}")]
    Handler(#[source] Box<dyn std::error::Error + Send + Sync>),
}

impl ChangesError {
    /// The server's answer as an error: `OUT_OF_RANGE` with its oldest cursor, or a refusal.
    fn from_status(status: Status) -> Self {
        match out_of_range_detail(&status) {
            Some(oldest_cursor) if status.code() == tonic::Code::OutOfRange => {
                ChangesError::OutOfRange { oldest_cursor, status }
            }
            _ => ChangesError::Refused(status),
        }
    }
}

/// The oldest cursor of an `OUT_OF_RANGE` refusal's `ChangesOutOfRange` detail.
fn out_of_range_detail(status: &Status) -> Option<Vec<u8>> {
    let details = tonic_types::Status::decode(status.details()).ok()?;
    let detail = details.details.iter().find(|any| any.type_url == OUT_OF_RANGE_TYPE_URL)?;
    Some(pb::ChangesOutOfRange::decode(detail.value.as_slice()).ok()?.oldest_cursor)
}

/// How a [`ChangesConsumer`] reads the feed.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ChangesConfig {
    /// Delays between reopen attempts after the stream broke.
    pub reconnect: Backoff,
    /// The most events in one batch (at least 1).
    pub max_batch: usize,
}

impl Default for ChangesConfig {
    /// The default backoff (50 ms, doubling, at most 5 s); batches of at most 1,000 events.
    fn default() -> Self {
        ChangesConfig { reconnect: Backoff::default(), max_batch: 1_000 }
    }
}

/// Events that arrived together, to process and then commit as one.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ChangeBatch {
    /// In feed order: flips, status changes, room occupancy changes, and
    /// gaps (resync what matters on one); never empty. Progress events are
    /// left out, their cursors kept in `cursor`.
    pub events: Vec<pb::ChangeEvent>,
    /// Where the feed resumes once this batch is committed: its last
    /// event's cursor, or a later progress event's.
    pub cursor: Vec<u8>,
}

/// A `Changes` consumer that resumes where its caller's processing got to.
///
/// It opens the feed after the cursor its [`CursorStore`] holds (or as its
/// request says, when the store holds none), hands out the events that
/// arrived together as a [`ChangeBatch`] ([`next_batch`](Self::next_batch)),
/// and saves the batch's cursor once the caller [`commit`](Self::commit)s it
/// ([`run`](Self::run) does both around a handler). A stream that breaks
/// (`UNAVAILABLE`, a lost connection, a server restart) is reopened with
/// backoff and jitter after the committed cursor; with a [`TokenProvider`],
/// one the server ended for its credentials is reopened at once with a fresh
/// token. A batch handed out and not committed is handed out again by the
/// next `next_batch`: delivery is at least once, identified by cursor.
///
/// Progress events are not handed out: a batch of nothing but progress is
/// saved at once, which keeps a narrowly filtered consumer's cursor fresh.
///
/// Until the first cursor is saved, a reopen starts as the request says: a
/// consumer opened from `now` that breaks before its first commit misses
/// what happened while it was away. Open from a stored cursor (or `oldest`)
/// where that matters.
pub struct ChangesConsumer<S> {
    client: PresenceClient<Channel>,
    /// The filters, and where to start while the store holds no cursor.
    request: pb::ChangesRequest,
    store: S,
    config: ChangesConfig,
    credentials: StreamCredentials,
    /// The open stream; `None` between a break and the next reopen.
    stream: Option<Streaming<pb::ChangeEvent>>,
    /// The cursor the store holds: every reopen resumes after it.
    committed: Option<Vec<u8>>,
    /// The cursor of the batch handed out and not committed yet.
    uncommitted: Option<Vec<u8>>,
    /// How the stream broke while a batch was gathered: acted on once the batch is out.
    broken: Option<Status>,
    /// Failed reopen attempts since a stream last opened.
    attempt: u32,
    /// The next reopen goes without waiting its backoff (once).
    reopen_now: bool,
}

impl<S> fmt::Debug for ChangesConsumer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChangesConsumer")
            .field("committed", &self.committed.as_deref().map(cursor_to_hex))
            .field("uncommitted", &self.uncommitted.as_deref().map(cursor_to_hex))
            .field("open", &self.stream.is_some())
            .field("token_provider", &self.credentials.has_provider())
            .finish_non_exhaustive()
    }
}

impl<S: CursorStore> ChangesConsumer<S> {
    /// Opens the feed after the cursor `store` holds, or where `request`
    /// says (`from`, `cursor`) when it holds none; `request`'s filters
    /// (`kinds`, `id_prefix`, `slots`) apply to every reopen.
    ///
    /// Fails with the server's answer when the first stream cannot be
    /// opened (only a feed once open is reopened). A stored cursor past
    /// retention does not fail it: the first [`next_batch`](Self::next_batch)
    /// returns the [`ChangesError::OutOfRange`], so that it is handled where
    /// a later one is, and [`resume_from`](Self::resume_from) goes on.
    pub async fn open(
        client: PresenceClient<Channel>,
        request: pb::ChangesRequest,
        store: S,
        config: ChangesConfig,
    ) -> Result<Self, ChangesError> {
        Self::open_authorized(client, request, store, config, None).await
    }

    /// [`open`](Self::open) presenting `bearer_token` (a service token with
    /// the `feed` scope) on every (re)open.
    pub async fn open_authorized(
        client: PresenceClient<Channel>,
        request: pb::ChangesRequest,
        store: S,
        config: ChangesConfig,
        bearer_token: Option<&str>,
    ) -> Result<Self, ChangesError> {
        let credentials = StreamCredentials::token(bearer_token).map_err(ChangesError::Refused)?;
        Self::open_with(client, request, store, config, credentials).await
    }

    /// [`open`](Self::open) presenting a token from `tokens`, asked again
    /// whenever the server ends the stream for its credentials: the feed
    /// then reopens at once, after the committed cursor, with a fresh one.
    pub async fn open_with_token_provider(
        client: PresenceClient<Channel>,
        request: pb::ChangesRequest,
        store: S,
        config: ChangesConfig,
        tokens: TokenProvider,
    ) -> Result<Self, ChangesError> {
        let credentials = StreamCredentials::provider(tokens).await.map_err(ChangesError::Refused)?;
        Self::open_with(client, request, store, config, credentials).await
    }

    async fn open_with(
        client: PresenceClient<Channel>,
        request: pb::ChangesRequest,
        mut store: S,
        config: ChangesConfig,
        credentials: StreamCredentials,
    ) -> Result<Self, ChangesError> {
        let committed = store.load().await.map_err(ChangesError::Store)?;
        let mut consumer = ChangesConsumer {
            client,
            request,
            store,
            config: ChangesConfig { max_batch: config.max_batch.max(1), ..config },
            credentials,
            stream: None,
            committed,
            uncommitted: None,
            broken: None,
            attempt: 0,
            reopen_now: false,
        };
        if let Err(status) = consumer.reopen().await {
            match ChangesError::from_status(status) {
                // Handled where a later one is: the first `next_batch` returns it.
                ChangesError::OutOfRange { status, .. } => consumer.broken = Some(status),
                refused => return Err(refused),
            }
        }
        Ok(consumer)
    }

    /// The next batch: the events that arrived together (at most
    /// `max_batch`), waiting for the first. Reopens a broken stream after
    /// the committed cursor; if the batch handed out before was not
    /// committed, it is handed out again first (with whatever followed it).
    ///
    /// Errors end nothing by themselves: a later call tries again.
    pub async fn next_batch(&mut self) -> Result<ChangeBatch, ChangesError> {
        if self.uncommitted.take().is_some() {
            // Not committed: what came after the committed cursor comes again.
            self.stream = None;
            self.broken = None;
            self.reopen_now = true;
        }
        loop {
            if let Some(status) = self.broken.take() {
                self.broke(status, false)?;
            }
            let Some(stream) = self.stream.as_mut() else {
                if !std::mem::take(&mut self.reopen_now) {
                    tokio::time::sleep(self.config.reconnect.delay(self.attempt)).await;
                    self.attempt = self.attempt.saturating_add(1);
                }
                if let Err(status) = self.reopen().await {
                    self.broke(status, true)?;
                }
                continue;
            };
            let first = match stream.message().await {
                Ok(Some(event)) => event,
                Ok(None) => {
                    self.broke(Status::unavailable("presenced ended the change feed"), false)?;
                    continue;
                }
                Err(status) => {
                    self.broke(status, false)?;
                    continue;
                }
            };
            let batch = self.gather(first).await;
            if batch.events.is_empty() {
                // Nothing but progress: nothing to process, so saved now.
                if !batch.cursor.is_empty() {
                    self.save(batch.cursor).await?;
                }
                continue;
            }
            self.uncommitted = Some(batch.cursor.clone());
            return Ok(batch);
        }
    }

    /// Saves the cursor of the batch handed out last: the caller has
    /// processed it, and no later consumer of this store sees it again. On
    /// a failure the batch stays uncommitted (and is handed out again).
    pub async fn commit(&mut self) -> Result<(), ChangesError> {
        let Some(cursor) = self.uncommitted.take() else { return Ok(()) };
        if let Err(err) = self.store.save(&cursor).await {
            self.uncommitted = Some(cursor);
            return Err(ChangesError::Store(err));
        }
        self.committed = Some(cursor);
        Ok(())
    }

    /// Saves `cursor` as the committed one and resumes after it: after an
    /// [`OutOfRange`](ChangesError::OutOfRange), once the caller has resynced
    /// from a `Snapshot`, with its `oldest_cursor`. A batch handed out and
    /// not committed is dropped.
    pub async fn resume_from(&mut self, cursor: Vec<u8>) -> Result<(), ChangesError> {
        self.uncommitted = None;
        self.broken = None;
        self.stream = None;
        self.reopen_now = true;
        self.save(cursor).await
    }

    /// Hands every batch to `handler` and commits it once `handler` is
    /// done, until something fails, which it returns: a handler's error
    /// ([`ChangesError::Handler`]; its batch is not committed), a refusal, an
    /// [`OutOfRange`](ChangesError::OutOfRange), or the store's failure.
    /// Calling it again goes on, from the uncommitted batch if there is one.
    pub async fn run<F, Fut, E>(&mut self, mut handler: F) -> ChangesError
    where
        F: FnMut(ChangeBatch) -> Fut,
        Fut: Future<Output = Result<(), E>>,
        E: Into<Box<dyn std::error::Error + Send + Sync>>,
    {
        loop {
            let batch = match self.next_batch().await {
                Ok(batch) => batch,
                Err(err) => return err,
            };
            if let Err(err) = handler(batch).await {
                return ChangesError::Handler(err.into());
            }
            if let Err(err) = self.commit().await {
                return err;
            }
        }
    }

    /// The cursor the store holds, as this consumer last loaded or saved it.
    pub fn committed_cursor(&self) -> Option<&[u8]> {
        self.committed.as_deref()
    }

    /// The cursor store.
    pub fn store(&self) -> &S {
        &self.store
    }

    /// `first` and the events that arrived with it, up to `max_batch`;
    /// a break met on the way is kept for the next call.
    async fn gather(&mut self, first: pb::ChangeEvent) -> ChangeBatch {
        let mut batch = ChangeBatch::default();
        let mut next = Some(first);
        while let Some(event) = next.take() {
            if !event.cursor.is_empty() {
                batch.cursor.clone_from(&event.cursor);
            }
            if !matches!(event.event, Some(change_event::Event::Progress(_))) {
                batch.events.push(event);
            }
            if batch.events.len() >= self.config.max_batch {
                break;
            }
            let Some(stream) = self.stream.as_mut() else { break };
            // Only what is there already: polled once, never waited for.
            let ready = std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *stream).poll_next(cx))).await;
            next = match ready {
                Poll::Ready(Some(Ok(event))) => Some(event),
                Poll::Ready(Some(Err(status))) => {
                    self.stream = None;
                    self.broken = Some(status);
                    None
                }
                Poll::Ready(None) => {
                    self.stream = None;
                    self.broken = Some(Status::unavailable("presenced ended the change feed"));
                    None
                }
                Poll::Pending => None,
            };
        }
        batch
    }

    /// The stream broke, or a reopen failed (`reopening`), with `status`:
    /// reopen (at once, for a spent token), or end with the refusal.
    fn broke(&mut self, status: Status, reopening: bool) -> Result<(), ChangesError> {
        self.stream = None;
        match self.credentials.after(&status, reopening) {
            Reopen::Now => {
                tracing::debug!(%status, "the change feed needs a fresh token");
                self.reopen_now = true;
                Ok(())
            }
            Reopen::AfterBackoff => {
                tracing::debug!(%status, attempt = self.attempt, "the change feed broke; reopening");
                Ok(())
            }
            Reopen::Never => {
                tracing::debug!(%status, "the change feed was refused");
                Err(ChangesError::from_status(status))
            }
        }
    }

    /// Opens a stream after the committed cursor (or as the request says, before the first commit).
    async fn reopen(&mut self) -> Result<(), Status> {
        let request = match &self.committed {
            Some(cursor) => pb::ChangesRequest {
                from: pb::ChangesFrom::Cursor as i32,
                cursor: cursor.clone(),
                ..self.request.clone()
            },
            None => self.request.clone(),
        };
        let request = self.credentials.request(request).await?;
        let stream = self.client.changes(request).await?.into_inner();
        self.stream = Some(stream);
        self.attempt = 0;
        self.credentials.opened();
        Ok(())
    }

    async fn save(&mut self, cursor: Vec<u8>) -> Result<(), ChangesError> {
        self.store.save(&cursor).await.map_err(ChangesError::Store)?;
        self.committed = Some(cursor);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("presence-client-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    #[test]
    fn a_cursor_reads_back_from_its_hex_and_text_that_is_not_one_is_refused() {
        let cursor = [1u8, 0, 0, 0, 0, 0, 0, 0x30, 0x39, 0, 0, 0x03, 0xff];
        assert_eq!(cursor_to_hex(&cursor), "010000000000003039000003ff");
        assert_eq!(cursor_from_hex("010000000000003039000003ff").unwrap(), cursor);
        assert_eq!(cursor_from_hex("010000000000003039000003FF").unwrap(), cursor);
        assert_eq!(cursor_from_hex("").unwrap_err().to_string(), "not a cursor: empty");
        assert_eq!(cursor_from_hex("abc").unwrap_err(), NotACursor("an odd number of hex digits"));
        assert_eq!(cursor_from_hex("now!").unwrap_err(), NotACursor("only hex digits (0-9, a-f) make one"));
    }

    #[tokio::test]
    async fn a_file_store_holds_nothing_until_a_save_then_the_last_cursor_saved_whole() {
        let dir = scratch("file-store");
        let path = dir.join("cursor");
        let mut store = FileCursorStore::new(&path);
        assert_eq!(store.load().await.unwrap(), None, "no file: no cursor");
        store.save(&[1, 2, 3]).await.unwrap();
        store.save(&[4, 5]).await.unwrap();
        assert_eq!(std::fs::read_to_string(&path).unwrap(), "0405\n");
        assert_eq!(FileCursorStore::new(&path).load().await.unwrap(), Some(vec![4, 5]), "a later process reads it");
        let names: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().file_name()).collect();
        assert_eq!(names, ["cursor"], "no temporary file left behind");

        std::fs::write(&path, "").unwrap();
        assert_eq!(store.load().await.unwrap(), None, "an empty file holds no cursor");
        std::fs::write(&path, "not hex\n").unwrap();
        let refused = store.load().await.unwrap_err();
        assert_eq!(refused.kind(), io::ErrorKind::InvalidData);
        assert!(refused.to_string().starts_with(&format!("{}: not a cursor", path.display())), "{refused}");
        let unwritable = FileCursorStore::new(dir.join("missing-dir").join("cursor")).save(&[1]).await.unwrap_err();
        assert!(unwritable.to_string().contains("missing-dir"), "names the file: {unwritable}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_memory_store_is_shared_by_its_clones() {
        let store = MemoryCursorStore::new();
        let mut writer = store.clone();
        assert_eq!(writer.load().await.unwrap(), None);
        writer.save(&[9]).await.unwrap();
        assert_eq!(store.cursor(), Some(vec![9]));
    }

    #[test]
    fn an_out_of_range_refusal_carries_the_oldest_cursor_and_others_are_refusals() {
        let detail = pb::ChangesOutOfRange { oldest_cursor: vec![1, 2] }.encode_to_vec();
        let any = prost_types::Any { type_url: OUT_OF_RANGE_TYPE_URL.to_owned(), value: detail };
        let details = tonic_types::Status { code: 11, message: "cursor: older".into(), details: vec![any] };
        let status = Status::with_details(tonic::Code::OutOfRange, "cursor: older", details.encode_to_vec().into());
        match ChangesError::from_status(status) {
            ChangesError::OutOfRange { oldest_cursor, status } => {
                assert_eq!(oldest_cursor, [1, 2]);
                assert_eq!(status.message(), "cursor: older");
            }
            other => panic!("out of range, not {other:?}"),
        }
        let bare = ChangesError::from_status(Status::out_of_range("no detail"));
        assert!(matches!(bare, ChangesError::Refused(_)), "{bare:?}");
        assert_eq!(
            ChangesError::from_status(Status::invalid_argument("kinds: 9")).to_string(),
            "InvalidArgument: kinds: 9"
        );
    }
}
