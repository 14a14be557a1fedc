//! The change feed's webhook sink (F4): the feed POSTed in batches to
//! receivers over HTTP.
//!
//! Each webhook is one task that reads the feed through [`Feed::changes`]
//! from a cursor of its own, as a `Changes` consumer does: it only reads the
//! log, so a receiver that is slow or gone holds back that task and nothing
//! else (not the store, not the writer, not a gRPC stream). A batch is the
//! events the stream has read, up to [`MAX_BATCH_EVENTS`] (or the webhook's
//! `max_events`) and [`MAX_BATCH_BYTES`] of JSON, signed (see
//! [`signature`]) and POSTed until the receiver answers 2xx, backing off
//! with full jitter between attempts; the next batch is only read then, so
//! batches arrive in order, none is skipped, and the task holds one batch.
//!
//! The cursor moves past a batch only after its 2xx. With a data directory
//! it is written (a temporary file, fsynced, renamed) to
//! `DATA_DIR/webhooks/`, one file per URL, and read at the next start: a
//! restart resumes after the last batch answered, and may send again a
//! batch whose 2xx came after the cursor was last written (at least once).
//! Without one it starts from now and lives in memory.
//!
//! A cursor retention has passed (the receiver was gone longer than the
//! feed keeps changes) is a `gap` event with reason `retention`, then the
//! oldest change the feed holds.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use hmac::{KeyInit, Mac};
use http_body_util::{BodyExt, Full, Limited};
use hyper::client::conn::http1::SendRequest;
use presence_feed::Cursor;
use presence_proto::v1::{self as pb, change_event};
use tokio_util::sync::CancellationToken;

use crate::error::ServiceError;
use crate::metrics::{WebhookFailure, WebhookMetrics};
use crate::node::clock::StoreClock;
use crate::node::feed::wire::{self, ChangesFilter, ChangesFrom, GapReason};
use crate::node::feed::{ChangesStream, Feed};
use crate::outbound;

/// The most events in one batch, and the most a webhook's `max_events` may ask.
pub(crate) const MAX_BATCH_EVENTS: usize = 1_000;
/// The most bytes of events' JSON in one batch (a batch holds at least one event).
const MAX_BATCH_BYTES: usize = 1 << 20;
/// How long one attempt may take, connecting included.
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(10);
/// The cap of the wait before the first retry; it doubles with every failure.
const FIRST_BACKOFF: Duration = Duration::from_millis(100);
/// The cap of the wait between attempts.
const MAX_BACKOFF: Duration = Duration::from_secs(30);
/// A cursor moved by `progress` alone (changes this webhook's filters leave
/// out, or none) is written at most this often: losing it costs reading
/// those changes again, not sending them.
const PROGRESS_WRITE_EVERY: Duration = Duration::from_secs(10);
/// The most of an answer's body read (and dropped) to keep its connection.
const MAX_ANSWER_BYTES: usize = 64 << 10;
/// The shortest signing secret: HMAC-SHA256's own output length.
pub(crate) const MIN_SECRET_BYTES: usize = 32;
/// The header of a batch's signatures.
pub(crate) const SIGNATURE_HEADER: &str = "presenced-signature";
/// The header naming a batch: its last event's cursor, as the body's `cursor`.
pub(crate) const BATCH_ID_HEADER: &str = "presenced-batch-id";
/// The folder of the data directory holding webhooks' cursors.
pub(crate) const CURSORS_DIR: &str = "webhooks";

/// The webhooks the change feed is POSTed to (F4), as configured.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct WebhookConfig {
    /// Each receiver's `http://` or `https://` URL, with its filters after a
    /// `#` (`#kinds=flip,status&id_prefix=team-&slots=0-511&max_events=100`;
    /// the fragment of a URL is never sent, so it cannot clash with the
    /// receiver's own query).
    pub urls: Vec<String>,
    /// The secrets that sign every batch: each adds a signature, so that a
    /// receiver can move from one secret to the next without losing a batch.
    pub secrets: Vec<String>,
    /// The CA of `https://` receivers' certificates; `None`: the system's roots.
    pub ca: Option<PathBuf>,
}

// By hand, so that a logged configuration never shows a secret (or a token in a URL's query).
impl std::fmt::Debug for WebhookConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let urls: Vec<String> = self.urls.iter().map(|url| label_of(url)).collect();
        f.debug_struct("WebhookConfig")
            .field("urls", &urls)
            .field("secrets", &self.secrets.len())
            .field("ca", &self.ca)
            .finish()
    }
}

/// What metrics and logs call a webhook: its URL without credentials, query
/// or filters, which may hold secrets.
fn label_of(given: &str) -> String {
    let url = given.split('#').next().unwrap_or_default();
    let url = url.split('?').next().unwrap_or_default();
    match url.split_once("://") {
        Some((scheme, rest)) => {
            let (authority, path) = rest.split_at(rest.find('/').unwrap_or(rest.len()));
            let host = authority.rsplit('@').next().unwrap_or_default();
            format!("{scheme}://{host}{path}")
        }
        None => url.to_owned(),
    }
}

/// One webhook, checked.
#[derive(Debug)]
struct Webhook {
    /// Where batches go.
    url: http::Uri,
    /// What metrics and logs call it.
    label: String,
    filter: ChangesFilter,
    max_events: usize,
    /// Its cursor's file, with a data directory.
    cursor_file: Option<PathBuf>,
    /// The cursor that file held at start.
    resume_after: Option<Cursor>,
}

/// The webhooks, checked before the server announces itself, ready to start.
#[derive(Debug, Default)]
pub(crate) struct Webhooks {
    sinks: Vec<Webhook>,
    signing: Arc<Signing>,
}

/// What every webhook shares: the secrets that sign, the TLS that connects.
#[derive(Default)]
struct Signing {
    secrets: Vec<Vec<u8>>,
    tls: Option<Arc<rustls::ClientConfig>>,
}

impl std::fmt::Debug for Signing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signing").field("secrets", &self.secrets.len()).finish_non_exhaustive()
    }
}

impl Webhooks {
    /// Checks the configuration and reads each webhook's cursor from
    /// `cursors` (the data directory's folder), before anything is
    /// announced (B7). `feed` is `None` when the feed is off, and says why.
    pub(crate) fn prepare(
        config: &WebhookConfig,
        feed: Result<&Arc<Feed>, &str>,
        cursors: Option<&Path>,
    ) -> Result<Webhooks, String> {
        if config.urls.is_empty() {
            if !config.secrets.is_empty() {
                return Err("--feed-webhook-secret needs --feed-webhook: the URL its batches go to".into());
            }
            if config.ca.is_some() {
                return Err("--feed-webhook-ca needs an https:// --feed-webhook".into());
            }
            return Ok(Webhooks::default());
        }
        let feed = feed.map_err(|why| format!("--feed-webhook {why}"))?;
        if config.secrets.is_empty() {
            return Err("--feed-webhook needs --feed-webhook-secret (or --feed-webhook-secret-file): \
                        the secret that signs its batches"
                .into());
        }
        if let Some(short) = config.secrets.iter().find(|secret| secret.len() < MIN_SECRET_BYTES) {
            return Err(format!(
                "--feed-webhook-secret: {} bytes, shorter than the minimum of {MIN_SECRET_BYTES} \
                 (`openssl rand -hex 32` makes one)",
                short.len()
            ));
        }
        let https = config.urls.iter().any(|url| url.starts_with("https://"));
        if config.ca.is_some() && !https {
            return Err("--feed-webhook-ca needs an https:// --feed-webhook".into());
        }
        let tls = if https {
            let files =
                presence_tls::ClientTlsFiles::new(config.ca.clone(), None, None).named(["--feed-webhook-ca", "", ""]);
            Some(outbound::tls_config(files).map_err(|err| format!("--feed-webhook: {err}"))?)
        } else {
            None
        };
        if let Some(dir) = cursors {
            std::fs::create_dir_all(dir)
                .map_err(|err| format!("--feed-webhook: cannot create {}: {err}", dir.display()))?;
        }
        let mut sinks: Vec<Webhook> = Vec::new();
        for given in &config.urls {
            let refused = |why: String| format!("--feed-webhook {}: {why}", label_of(given));
            let (url, filter, max_events) = parse(given, feed.slots()).map_err(refused)?;
            let label = label_of(given);
            if let Some(twin) = sinks.iter().find(|sink| sink.url == url || sink.label == label) {
                return Err(refused(if twin.url == url {
                    "given twice: one webhook per URL (its cursor is kept by URL)".into()
                } else {
                    format!(
                        "{} differs from it only in its query, which metrics and logs leave out: give them different paths",
                        twin.label
                    )
                }));
            }
            let cursor_file = cursors.map(|dir| dir.join(cursor_file_name(&url)));
            let resume_after = match &cursor_file {
                Some(file) => read_cursor(file).map_err(refused)?,
                None => None,
            };
            sinks.push(Webhook { url, label, filter, max_events, cursor_file, resume_after });
        }
        let secrets = config.secrets.iter().map(|secret| secret.as_bytes().to_vec()).collect();
        Ok(Webhooks { sinks, signing: Arc::new(Signing { secrets, tls }) })
    }

    /// Starts one task per webhook, from its cursor, or from now; each ends
    /// when `stopping` is cancelled, its cursor written.
    pub(crate) fn start(
        self,
        feed: &Arc<Feed>,
        clock: &StoreClock,
        stopping: &CancellationToken,
    ) -> Vec<tokio::task::JoinHandle<()>> {
        self.sinks
            .into_iter()
            .map(|webhook| {
                // Taken here, before the service answers a call: no change made after `listening on` is missed.
                let start = webhook.resume_after.unwrap_or_else(|| feed.cursor_now());
                tracing::info!(webhook = %webhook.label, resumes = webhook.resume_after.is_some(), "webhook started");
                let sink = Sink {
                    metrics: WebhookMetrics::new(&webhook.label),
                    written: webhook.resume_after,
                    delivered: start,
                    webhook,
                    signing: Arc::clone(&self.signing),
                    clock: clock.clone(),
                    stopping: stopping.clone(),
                    connection: None,
                    progress_written: Instant::now(),
                };
                tokio::spawn(sink.run(Arc::clone(feed)))
            })
            .collect()
    }
}

/// A webhook's URL and its filters: `URL#key=value&key=value`, the keys
/// `kinds` (flip, status, room_occupancy, comma-separated), `id_prefix`,
/// `slots` (numbers and ranges `N-M`, comma-separated) and `max_events`.
fn parse(given: &str, slot_count: u32) -> Result<(http::Uri, ChangesFilter, usize), String> {
    let (url, filters) = given.split_once('#').unwrap_or((given, ""));
    let uri: http::Uri = url.parse().map_err(|err| format!("not a URL: {err}"))?;
    if !matches!(uri.scheme_str(), Some("http" | "https")) {
        return Err("the URL must start with http:// or https://".into());
    }
    let Some(authority) = uri.authority() else { return Err("the URL has no host".into()) };
    if authority.as_str().contains('@') {
        return Err("credentials in the URL are not sent; receivers verify the signature instead".into());
    }
    let mut request = pb::ChangesRequest::default();
    let mut max_events = MAX_BATCH_EVENTS;
    for pair in filters.split('&').filter(|pair| !pair.is_empty()) {
        let Some((key, value)) = pair.split_once('=') else {
            return Err(format!("filter {pair:?} is not key=value"));
        };
        match key {
            "kinds" => {
                for kind in value.split(',') {
                    let kind = match kind {
                        "flip" => pb::ChangeKind::Flip,
                        "status" => pb::ChangeKind::Status,
                        "room_occupancy" => pb::ChangeKind::RoomOccupancy,
                        "availability" => pb::ChangeKind::Availability,
                        other => {
                            return Err(format!(
                                "kinds: {other:?} is not flip, status, room_occupancy or availability"
                            ));
                        }
                    };
                    request.kinds.push(kind as i32);
                }
            }
            "id_prefix" => request.id_prefix = value.to_owned(),
            "slots" => {
                for range in value.split(',') {
                    let number =
                        |text: &str| text.parse::<u32>().map_err(|_| format!("slots: {range:?} is not N or N-M"));
                    let (first, last) = match range.split_once('-') {
                        Some((first, last)) => (number(first)?, number(last)?),
                        None => (number(range)?, number(range)?),
                    };
                    if first > last || last >= slot_count {
                        return Err(format!("slots: {range:?} is not within 0-{}", slot_count - 1));
                    }
                    request.slots.extend(first..=last);
                }
            }
            "max_events" => {
                max_events = value
                    .parse()
                    .ok()
                    .filter(|max| (1..=MAX_BATCH_EVENTS).contains(max))
                    .ok_or_else(|| format!("max_events: {value:?} is not between 1 and {MAX_BATCH_EVENTS}"))?;
            }
            other => return Err(format!("unknown filter {other:?} (kinds, id_prefix, slots, max_events)")),
        }
    }
    let (_, filter) = wire::changes_request(&request, slot_count).map_err(|err| err.to_string())?;
    Ok((uri, filter, max_events))
}

/// A webhook's cursor file: named by a hash of its URL (filters aside), so
/// that changing its filters keeps its place.
fn cursor_file_name(url: &http::Uri) -> String {
    use sha2::Digest as _;
    let digest = sha2::Sha256::digest(url.to_string().as_bytes());
    digest[..8].iter().map(|byte| format!("{byte:02x}")).collect::<String>() + ".cursor"
}

/// The cursor a file holds (`POSITION SLOT`, then the webhook's label for
/// whoever looks), or `None` when there is no file yet.
fn read_cursor(file: &Path) -> Result<Option<Cursor>, String> {
    let text = match std::fs::read_to_string(file) {
        Ok(text) => text,
        Err(err) if err.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(err) => return Err(format!("cannot read its cursor {}: {err}", file.display())),
    };
    let mut fields = text.lines().next().unwrap_or_default().split(' ');
    let cursor = (|| Some(Cursor { position: fields.next()?.parse().ok()?, slot: fields.next()?.parse().ok()? }))();
    cursor.map(Some).ok_or_else(|| format!("its cursor {} is not a position and a slot", file.display()))
}

/// Writes a cursor file whole or not at all: a temporary file, synced,
/// renamed, and the folder synced.
fn write_cursor(file: &Path, cursor: Cursor, label: &str) -> std::io::Result<()> {
    let temporary = file.with_extension("tmp");
    std::fs::write(&temporary, format!("{} {}\n{label}\n", cursor.position, cursor.slot))?;
    std::fs::File::open(&temporary)?.sync_all()?;
    std::fs::rename(&temporary, file)?;
    std::fs::File::open(file.parent().expect("a file in the data directory"))?.sync_all()
}

/// The signature header of a batch `body` sent at `timestamp` (Unix
/// seconds): `t=TIMESTAMP,v1=HEX` with one `v1` per secret, each the
/// HMAC-SHA256 of `TIMESTAMP.BODY` under that secret, in lower-case hex.
pub(crate) fn signature(secrets: &[Vec<u8>], timestamp: u64, body: &[u8]) -> String {
    let mut header = format!("t={timestamp}");
    for secret in secrets {
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(secret).expect("HMAC takes a key of any length");
        mac.update(format!("{timestamp}.").as_bytes());
        mac.update(body);
        header.push_str(",v1=");
        for byte in mac.finalize().into_bytes() {
            header.push_str(&format!("{byte:02x}"));
        }
    }
    header
}

/// One batch: its events as JSON, and what it covers.
#[derive(Debug, Default)]
struct Batch {
    events: Vec<Vec<u8>>,
    bytes: usize,
    /// Its last event's cursor.
    last: Cursor,
    /// Its first event's store time (Unix ms), for the lag.
    first_at_ms: i64,
}

impl Batch {
    fn push(&mut self, event: &pb::ChangeEvent, json: Vec<u8>) {
        if self.events.is_empty() {
            self.first_at_ms = event.at_ms;
        }
        self.last = cursor_of(event);
        self.bytes += json.len();
        self.events.push(json);
    }
}

/// An event's cursor, as the feed wrote it.
fn cursor_of(event: &pb::ChangeEvent) -> Cursor {
    Cursor::decode(&event.cursor).expect("the feed's events carry its cursors")
}

fn is_progress(event: &pb::ChangeEvent) -> bool {
    matches!(event.event, Some(change_event::Event::Progress(_)))
}

/// A webhook at work: reads the feed, delivers batches, keeps its cursor.
struct Sink {
    webhook: Webhook,
    signing: Arc<Signing>,
    clock: StoreClock,
    stopping: CancellationToken,
    metrics: WebhookMetrics,
    /// The receiver has everything up to here (its last 2xx, or progress).
    delivered: Cursor,
    /// What the cursor file holds.
    written: Option<Cursor>,
    progress_written: Instant,
    /// Kept between batches; dropped after a failure.
    connection: Option<SendRequest<Full<Bytes>>>,
}

impl Sink {
    async fn run(mut self, feed: Arc<Feed>) {
        // The start is written at once: a restart before the first batch resumes from it, not from its own now.
        self.write_cursor().await;
        let mut source = Source::new(feed, &self.webhook, self.delivered, &self.clock, &self.stopping, &self.metrics);
        let max_events = self.webhook.max_events;
        while let Some(first) = source.next().await {
            if is_progress(&first) {
                self.delivered = cursor_of(&first);
                if self.progress_written.elapsed() >= PROGRESS_WRITE_EVERY {
                    self.write_cursor().await;
                }
                continue;
            }
            let mut batch = Batch::default();
            batch.push(&first, wire::webhook_event(&first));
            let mut progress = None;
            while batch.events.len() < max_events {
                let Some(event) = source.ready() else { break };
                if is_progress(&event) {
                    progress = Some(cursor_of(&event));
                    break;
                }
                let json = wire::webhook_event(&event);
                if batch.bytes + json.len() > MAX_BATCH_BYTES {
                    source.hold(event);
                    break;
                }
                batch.push(&event, json);
            }
            if !self.deliver(&batch).await {
                break;
            }
            self.delivered = progress.unwrap_or(batch.last).max(batch.last);
            self.write_cursor().await;
        }
        self.write_cursor().await;
        tracing::info!(webhook = %self.webhook.label, "webhook stopped");
    }

    /// POSTs `batch` until the receiver answers 2xx: true then, false if
    /// the server stops first.
    async fn deliver(&mut self, batch: &Batch) -> bool {
        let body = Bytes::from(wire::webhook_body(batch.last, &batch.events));
        let id = presence_proto::json::bytes(&batch.last.encode());
        let id = id.as_str().expect("base64 is a string");
        let mut failures: u32 = 0;
        loop {
            let lag_ms = crate::node::wire::unix_ms(self.clock.now()).saturating_sub(batch.first_at_ms).max(0);
            self.metrics.lag_seconds.set(lag_ms as f64 / 1_000.0);
            let stopping = self.stopping.clone();
            let outcome = tokio::select! {
                outcome = tokio::time::timeout(ATTEMPT_TIMEOUT, self.post(&body, id)) => outcome,
                () = stopping.cancelled() => return false,
            };
            let failure = match outcome {
                Ok(Ok(status)) if status.is_success() => {
                    self.metrics.batches.increment(1);
                    self.metrics.events.increment(batch.events.len() as u64);
                    self.metrics.lag_seconds.set(0.0);
                    return true;
                }
                Ok(Ok(status)) => (WebhookFailure::Status, format!("answered {status}")),
                Ok(Err(err)) => (WebhookFailure::Connection, err),
                Err(_) => (WebhookFailure::Timeout, format!("no answer within {ATTEMPT_TIMEOUT:?}")),
            };
            if failure.0 != WebhookFailure::Status {
                self.connection = None;
            }
            self.metrics.failed(failure.0);
            failures += 1;
            // Full jitter: a random wait up to a cap that doubles, so that receivers coming back are not hit in step.
            let cap = FIRST_BACKOFF.saturating_mul(1 << (failures - 1).min(16)).min(MAX_BACKOFF);
            let wait = Duration::from_millis(fastrand::u64(0..=cap.as_millis() as u64));
            // Loud on the 1st, 2nd, 4th, 8th... failure of a batch: a receiver gone for hours does not flood the log.
            if failures.is_power_of_two() {
                tracing::warn!(webhook = %self.webhook.label, failures, reason = %failure.1, events = batch.events.len(), "cannot deliver a webhook batch; trying again");
            } else {
                tracing::debug!(webhook = %self.webhook.label, failures, reason = %failure.1, "cannot deliver a webhook batch; trying again");
            }
            tokio::select! {
                () = tokio::time::sleep(wait) => {}
                () = self.stopping.cancelled() => return false,
            }
        }
    }

    /// One attempt: the receiver's status, or why there was none.
    async fn post(&mut self, body: &Bytes, id: &str) -> Result<http::StatusCode, String> {
        let url = &self.webhook.url;
        let sender = match &mut self.connection {
            Some(sender) if !sender.is_closed() => sender,
            connection => connection.insert(outbound::connect(url, self.signing.tls.as_ref()).await?),
        };
        sender.ready().await.map_err(|err| format!("HTTP: {err}"))?;
        let timestamp = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |since| since.as_secs());
        let request = http::Request::post(url.path_and_query().map_or("/", |path| path.as_str()))
            .header(http::header::HOST, outbound::host_header(url))
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::USER_AGENT, outbound::USER_AGENT)
            .header(SIGNATURE_HEADER, signature(&self.signing.secrets, timestamp, body))
            .header(BATCH_ID_HEADER, id)
            .body(Full::new(body.clone()))
            .map_err(|err| format!("HTTP: {err}"))?;
        let answer = sender.send_request(request).await.map_err(|err| format!("HTTP: {err}"))?;
        let status = answer.status();
        // Read to its end (within reason) so that the connection serves the next batch.
        if Limited::new(answer.into_body(), MAX_ANSWER_BYTES).collect().await.is_err() {
            self.connection = None;
        }
        Ok(status)
    }

    /// Writes the cursor to its file, if it has one and it moved.
    async fn write_cursor(&mut self) {
        let Some(file) = self.webhook.cursor_file.clone() else { return };
        if self.written == Some(self.delivered) {
            return;
        }
        let (cursor, label) = (self.delivered, self.webhook.label.clone());
        match tokio::task::spawn_blocking(move || write_cursor(&file, cursor, &label)).await {
            Ok(Ok(())) => {
                self.written = Some(cursor);
                self.progress_written = Instant::now();
            }
            // The next batch writes it again; until then a restart sends again what this one held.
            Ok(Err(err)) => tracing::error!(webhook = %self.webhook.label, %err, "cannot write the webhook's cursor"),
            Err(err) => tracing::error!(webhook = %self.webhook.label, %err, "cannot write the webhook's cursor"),
        }
    }
}

/// A webhook's reading of the feed: a `Changes` stream, opened again where
/// it left off when it fails, with a gap where retention passed it.
struct Source {
    feed: Arc<Feed>,
    filter: ChangesFilter,
    clock: StoreClock,
    stopping: CancellationToken,
    metrics: WebhookMetrics,
    label: String,
    stream: Option<ChangesStream>,
    /// The cursor of the last event read: a stream opened again starts after it.
    read: Cursor,
    /// An event read and left for the next batch, or a gap to send.
    held: Option<pb::ChangeEvent>,
    /// How the stream failed while `ready` read it, for `next` to take up.
    failure: Option<ServiceError>,
}

impl Source {
    fn new(
        feed: Arc<Feed>,
        webhook: &Webhook,
        after: Cursor,
        clock: &StoreClock,
        stopping: &CancellationToken,
        metrics: &WebhookMetrics,
    ) -> Source {
        Source {
            feed,
            filter: webhook.filter.clone(),
            clock: clock.clone(),
            stopping: stopping.clone(),
            metrics: metrics.clone(),
            label: webhook.label.clone(),
            stream: None,
            read: after,
            held: None,
            failure: None,
        }
    }

    /// The next event, waiting for it; `None` once the server stops.
    async fn next(&mut self) -> Option<pb::ChangeEvent> {
        if let Some(err) = self.failure.take() {
            self.failed(err).await?;
        }
        loop {
            if let Some(event) = self.held.take() {
                return Some(self.was_read(event));
            }
            let stream = match &mut self.stream {
                Some(stream) => stream,
                None => {
                    match self.feed.changes(ChangesFrom::Cursor(self.read), self.filter.clone(), self.stopping.clone())
                    {
                        Ok(stream) => self.stream.insert(stream),
                        Err(err) => {
                            self.failed(err).await?;
                            continue;
                        }
                    }
                }
            };
            let next = tokio::select! {
                next = stream.next_event() => next,
                () = self.stopping.cancelled() => return None,
            };
            match next {
                Some(Ok(event)) => return Some(self.was_read(event)),
                Some(Err(err)) => {
                    self.stream = None;
                    self.failed(err).await?;
                }
                None => return None,
            }
        }
    }

    /// The next event if it has been read already, without waiting.
    fn ready(&mut self) -> Option<pb::ChangeEvent> {
        let event = match self.held.take() {
            Some(event) => event,
            None => match self.stream.as_mut()?.ready_event()? {
                Ok(event) => event,
                Err(err) => {
                    // Taken up by `next`, which may have to wait.
                    self.stream = None;
                    self.failure = Some(err);
                    return None;
                }
            },
        };
        Some(self.was_read(event))
    }

    /// Leaves `event` for the next batch.
    fn hold(&mut self, event: pb::ChangeEvent) {
        self.held = Some(event);
    }

    fn was_read(&mut self, event: pb::ChangeEvent) -> pb::ChangeEvent {
        self.read = cursor_of(&event);
        event
    }

    /// When `err` says retention passed the cursor: a gap event, with the
    /// stream opened again at once from the oldest change, where the gap
    /// ends (opened later, after the gap is delivered, it could find
    /// retention past that too and need a second gap); `None` for any
    /// other failure, or when the feed cannot be read from its oldest.
    fn gap_for(&mut self, err: &ServiceError) -> Option<pb::ChangeEvent> {
        let ServiceError::FeedOutOfRange { oldest, .. } = err else { return None };
        let reason = if self.read < *oldest { GapReason::Retention } else { GapReason::UnknownCursor };
        let stream = self.feed.changes(ChangesFrom::Oldest, self.filter.clone(), self.stopping.clone()).ok()?;
        let resumes_at = stream.start();
        self.stream = Some(stream);
        tracing::error!(webhook = %self.label, %err, "the webhook's cursor is out of the feed's range; it sends a gap and goes on from the oldest change");
        self.metrics.gaps.increment(1);
        Some(wire::gap_event(&resumes_at.encode(), self.read, reason, 0, self.clock.now()))
    }

    /// After the stream failed with `err`: a gap to send next, or a wait
    /// before opening it again; `None` when the server stops meanwhile.
    async fn failed(&mut self, err: ServiceError) -> Option<()> {
        if let Some(gap) = self.gap_for(&err) {
            self.held = Some(gap);
            return Some(());
        }
        tracing::error!(webhook = %self.label, %err, "the webhook cannot read the change feed; trying again");
        tokio::select! {
            () = tokio::time::sleep(Duration::from_secs(1)) => Some(()),
            () = self.stopping.cancelled() => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f4_the_signature_is_hmac_sha256_of_the_timestamp_a_dot_and_the_body_once_per_secret() {
        // As Python's hmac module signs b"1700000000." + body.
        let body = br#"{"cursor":"","events":[]}"#;
        assert_eq!(
            signature(&[b"Jefe".to_vec(), b"b".repeat(32)], 1_700_000_000, body),
            "t=1700000000,v1=59bce75b8855fe45504d8da8a8a6b917072c8c156094494badd223fadc62081f,\
             v1=5cbb44878e99a6998a860caabb5fe22106bfeb7d7ff61bd924ef7bbd678219ff"
        );
    }

    #[test]
    fn f4_filters_after_the_hash_are_checked_by_name() {
        let (url, filter, max) = parse(
            "http://127.0.0.1:9/hook?x=1#kinds=flip,room_occupancy&id_prefix=team-&slots=0-1,5&max_events=10",
            1024,
        )
        .unwrap();
        assert_eq!(url.to_string(), "http://127.0.0.1:9/hook?x=1");
        assert_eq!((filter.kinds, filter.id_prefix.as_str(), max), ([true, false, true, false], "team-", 10));
        let slots: Vec<u32> = filter.slots.unwrap().iter().collect();
        assert_eq!(slots, [0, 1, 5]);
        for (given, named) in [
            ("ftp://h/x", "http:// or https://"),
            ("http://user:pw@h/x", "credentials"),
            ("http://h/x#kinds=flips", "kinds: \"flips\""),
            ("http://h/x#slots=5-1024", "slots: \"5-1024\""),
            ("http://h/x#slots=a", "slots: \"a\""),
            ("http://h/x#max_events=0", "max_events"),
            ("http://h/x#color=red", "unknown filter \"color\""),
            ("http://h/x#kinds", "not key=value"),
        ] {
            let err = parse(given, 1024).unwrap_err();
            assert!(err.contains(named), "{given}: {err}");
        }
        assert!(
            parse(&format!("http://h/x#id_prefix={}", "x".repeat(129)), 1024)
                .unwrap_err()
                .starts_with("id_prefix: at most")
        );
    }

    #[test]
    fn f4_labels_leave_out_credentials_queries_and_filters() {
        assert_eq!(
            label_of("https://u:p@hooks.example:8443/in/presence?token=s#kinds=flip"),
            "https://hooks.example:8443/in/presence"
        );
        assert_eq!(label_of("http://h"), "http://h");
    }
}
