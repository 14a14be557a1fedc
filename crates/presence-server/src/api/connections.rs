//! Connection threads (`connection_threads` > 0): each accepted connection is
//! served, for its whole life, by one of a few threads that each run a
//! single-threaded event loop.
//!
//! Why: a unary call is tiny, so its cost is mostly the HTTP/2 machinery around
//! it, and on the shared work-stealing runtime that machinery wakes other
//! threads. hyper runs each request in its own task and the connection in
//! another; when a request task finishes, the connection task is woken (often
//! on another worker, through a futex) and writes that one reply with its own
//! `writev`. Measured on 2 cores at 64 calls in flight, that is one `writev` per
//! reply. On a single-threaded loop, woken tasks run in order, so the
//! connection task runs once after all the request tasks that were ready and
//! writes all their replies at once (about 16 per `writev` in the same
//! measurement), with no wake across threads at all.
//!
//! Why it is the default (one thread per CPU): unary calls are the first
//! load most users put on the server, and on 2 cores they cost about a
//! third less server CPU each this way. `Leases` batches are applied by the
//! lease workers on the shared runtime either way, so they measured the same
//! (within 5%), and Watch fan-out measured no worse. What it gives up: a
//! connection cannot move between threads, so an uneven mix of connections
//! stays uneven. `--connection-threads 0` serves every connection on the
//! shared runtime instead. `docs/benchmarks.md` has the measurements.
//!
//! The acceptor stays on the caller's runtime and hands connections round-robin
//! to the threads. Everything else (expiry, lease batch workers, checkpoints)
//! also stays on the caller's runtime.
//!
//! Admission (contract B5), on both paths and for both HTTP versions (gRPC
//! over HTTP/2; gRPC-Web and the console over HTTP/1.1 too, which is what a
//! browser speaks on plain http): at most `max_connections` are open at
//! once, each holding a [`Semaphore`] permit that its IO object
//! ([`Guarded`]) returns when hyper drops it. A connection beyond the cap is
//! refused in the client's own protocol, told by its first bytes (an HTTP/2
//! GOAWAY, or an HTTP/1 503), closed, counted, and logged at most once a
//! second. A connection that has not sent its opening within
//! `handshake_timeout` is closed: for HTTP/2 the client preface and its first
//! SETTINGS frame, for HTTP/1 a whole request head. Neither hyper nor tonic
//! has such a deadline (hyper's `header_read_timeout` needs a timer tonic
//! gives only its HTTP/2 side, and HTTP/2 keep-alive pings start after the
//! handshake), so `Guarded` carries it. The hand-off queue to each
//! connection thread is bounded by its share of `max_connections`; when it
//! is full the connection is refused the same way, never queued.
//!
//! TLS (contract T1, T2), when the server has a certificate: the handshake
//! is part of the opening, under the same deadline and the same place under
//! the cap. A connection's TLS handshake runs on the thread that will serve
//! it, at most [`HANDSHAKES_IN_FLIGHT`] at once per thread (beyond those,
//! connections wait in the hand-off queue, their deadlines running), so
//! that a storm of handshakes takes a bounded share of each thread and the
//! connections already served keep theirs. A client whose first byte is
//! not a TLS handshake record spoke plaintext to the TLS port: it is told
//! so in its own protocol (an HTTP/2 GOAWAY, an HTTP/1 400) and closed. A
//! TLS client refused at the cap is closed before its handshake (no TLS
//! alert says "too many connections"), which it sees as a connection closed
//! during the handshake and retries as it would `UNAVAILABLE`.

use std::io::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use metrics::{Counter, Gauge, counter, gauge};
use presence_tls::{ClientCertificate, ServerTls};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::transport::server::Connected;

use crate::api::web;
use crate::auth::ConnectionInfo;
use crate::metrics::names;

/// The HTTP/2 client connection preface (RFC 9113, 3.4).
const PREFACE: &[u8; PREFACE_BYTES] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
/// Its length.
const PREFACE_BYTES: usize = 24;
/// An HTTP/2 frame header: 3 bytes of length, type, flags, stream id.
const FRAME_HEADER_BYTES: usize = 9;

/// What the server answers a connection beyond the cap with: its own
/// connection preface (an empty SETTINGS frame, which a client must see
/// first) and a GOAWAY with no stream processed (last stream id 0) and
/// REFUSED_STREAM, which tells the client nothing was done and a retry
/// (elsewhere, or later) is safe. The debug data says why, for a person
/// reading a packet capture or a client log.
fn refusal_frames() -> Vec<u8> {
    const REFUSED_STREAM: u32 = 0x7;
    goaway_frames(b"presenced: too many connections (max-connections)", REFUSED_STREAM)
}

/// What an HTTP/2 client that speaks plaintext to the TLS port is answered
/// with: a GOAWAY whose debug data (which clients print, as h2's "connection
/// error received: ...") says what to change. PROTOCOL_ERROR, because a
/// retry of the same thing cannot succeed.
fn tls_required_frames() -> Vec<u8> {
    const PROTOCOL_ERROR: u32 = 0x1;
    goaway_frames(TLS_REQUIRED.as_bytes(), PROTOCOL_ERROR)
}

/// What a plaintext client on the TLS port is told.
const TLS_REQUIRED: &str = "presenced: this port speaks TLS; connect with https:// and the server's CA";

fn goaway_frames(debug: &[u8], error_code: u32) -> Vec<u8> {
    let mut frames = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0]; // SETTINGS, no parameters
    let length = u32::try_from(8 + debug.len()).expect("a short debug text");
    frames.extend_from_slice(&length.to_be_bytes()[1..]);
    frames.extend_from_slice(&[0x7, 0, 0, 0, 0, 0]); // GOAWAY, no flags, stream 0
    frames.extend_from_slice(&0u32.to_be_bytes()); // last stream id
    frames.extend_from_slice(&error_code.to_be_bytes());
    frames.extend_from_slice(debug);
    frames
}

/// What an HTTP/1 client (curl, a browser) that speaks plaintext to a TLS
/// port (the service's or the metrics') is answered with.
pub(crate) fn http1_tls_required() -> Vec<u8> {
    let text = format!("{TLS_REQUIRED}\n");
    format!(
        "HTTP/1.1 400 Bad Request\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\n\
         connection: close\r\n\r\n{text}",
        text.len()
    )
    .into_bytes()
}

/// The first byte of a TLS record that carries a handshake message: a TLS
/// client's first byte. No HTTP/1 method and not the HTTP/2 preface starts with it.
pub(crate) const TLS_HANDSHAKE_RECORD: u8 = 0x16;

/// TLS handshakes one server loop (one connection thread) works on at once.
pub(crate) const HANDSHAKES_IN_FLIGHT: usize = 32;

/// What a client beyond the cap that speaks HTTP/1 (a browser) is answered
/// with: a 503 that fetch reports as such, with the gRPC status a gRPC-Web
/// client reads (UNAVAILABLE, which clients retry), and the close. A page of
/// another origin that `--cors-origin` lets in (`allowed_origin`) is given
/// the CORS headers it needs to read that answer at all: without them the
/// browser hides it behind a network error.
fn http1_refusal(allowed_origin: Option<&str>) -> Vec<u8> {
    const TEXT: &str = "presenced: too many connections (max-connections)\n";
    let cors = allowed_origin.map_or_else(String::new, |origin| {
        format!(
            "access-control-allow-origin: {origin}\r\nvary: origin\r\n\
             access-control-expose-headers: grpc-status, grpc-message, retry-after\r\n"
        )
    });
    format!(
        "HTTP/1.1 503 Service Unavailable\r\ncontent-type: text/plain; charset=utf-8\r\n\
         content-length: {}\r\nretry-after: 1\r\ngrpc-status: 14\r\n\
         grpc-message: too%20many%20connections\r\n{cors}connection: close\r\n\r\n{TEXT}",
        TEXT.len()
    )
    .into_bytes()
}

/// The most of a refused HTTP/1 request that is read to find its `Origin`:
/// a browser's request head is far smaller.
const REFUSED_HEAD_BYTES: usize = 8 * 1024;

/// The value of the `Origin` header in `head` (an HTTP/1 request head, or
/// its start), if a whole line of it carries one.
fn origin_of(head: &[u8]) -> Option<&str> {
    // Whole lines only: up to the blank line that ends the head, or to the last line that ended.
    let position = |needle: &[u8]| head.windows(needle.len()).position(|window| window == needle);
    let end = position(b"\r\n\r\n").or_else(|| head.windows(2).rposition(|window| window == b"\r\n"))?;
    let head = std::str::from_utf8(&head[..end]).ok()?;
    head.split("\r\n").skip(1).find_map(|line| {
        let (name, value) = line.split_once(':')?;
        name.trim().eq_ignore_ascii_case("origin").then(|| value.trim())
    })
}

/// Decides which connections are served: the connection cap and the
/// handshake deadline of one server, shared by its acceptor and threads.
#[derive(Debug, Clone)]
pub(crate) struct Admission {
    /// One permit per connection that may be open; a connection holds its
    /// permit for as long as its IO object lives.
    permits: Arc<Semaphore>,
    /// The cap, for the warning.
    max_connections: usize,
    /// How long a connection may take to send the preface and its SETTINGS.
    handshake_timeout: Duration,
    /// Open connections (gauge).
    open: Gauge,
    /// Connections refused at the cap or at a full hand-off queue (counter).
    refused: Counter,
    /// Connections closed for not completing the handshake in time (counter).
    handshake_timeouts: Counter,
    /// The warning of connections refused at the cap, at most once a second.
    refusals_logged: Arc<crate::every_now::EveryNow>,
    /// The warning of TLS handshakes refused (a client with the wrong CA, an
    /// expired certificate or none where one is required), at most once
    /// every ten seconds: a client's mistake, but one its operator asks the
    /// server's log about.
    handshake_refusals_logged: Arc<crate::every_now::EveryNow>,
    /// Places for refused connections that are kept open a moment, so that
    /// their GOAWAY is read (see `refuse`); bounded, because a flood of
    /// refused connections must not become a flood of tasks.
    lingering: Arc<Semaphore>,
    /// The origins whose pages may call over gRPC-Web (`--cors-origin`), as
    /// browsers send them: a refusal to one of their pages carries CORS headers.
    cors_origins: Arc<[http::HeaderValue]>,
    /// The server's TLS material, with TLS on.
    tls: Option<Arc<ServerTls>>,
    /// TLS handshakes refused, by reason (counters).
    tls_plaintext: Counter,
    tls_failed: Counter,
    /// TLS handshakes completed, resumed or full (counters).
    tls_resumed: Counter,
    tls_full: Counter,
}

/// Refused connections kept open at once until their client has read the
/// refusal; beyond these, a refused connection is sent the GOAWAY and closed
/// at once.
const LINGERING_REFUSALS: usize = 64;
/// How long a refused connection is kept open for its client to read the refusal.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);
/// How long a refused connection's first bytes are waited for, to answer in
/// its protocol. The client speaks first in both, and a live one does so
/// within a round trip; a silent one is sent the GOAWAY after this.
const REFUSAL_SNIFF: Duration = Duration::from_millis(250);

impl Admission {
    pub(crate) fn new(
        max_connections: usize,
        handshake_timeout: Duration,
        cors_origins: Vec<http::HeaderValue>,
        tls: Option<Arc<ServerTls>>,
    ) -> Self {
        Admission {
            permits: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            max_connections,
            handshake_timeout,
            open: gauge!(names::CONNECTIONS),
            refused: counter!(names::CONNECTIONS_REFUSED),
            handshake_timeouts: counter!(names::HANDSHAKE_TIMEOUTS),
            refusals_logged: Arc::new(crate::every_now::EveryNow::new(Duration::from_secs(1))),
            handshake_refusals_logged: Arc::new(crate::every_now::EveryNow::new(Duration::from_secs(10))),
            lingering: Arc::new(Semaphore::new(LINGERING_REFUSALS)),
            cors_origins: cors_origins.into(),
            tls,
            tls_plaintext: counter!(names::TLS_HANDSHAKE_FAILURES, "reason" => "plaintext"),
            tls_failed: counter!(names::TLS_HANDSHAKE_FAILURES, "reason" => "handshake"),
            tls_resumed: counter!(names::TLS_HANDSHAKES, "resumed" => "true"),
            tls_full: counter!(names::TLS_HANDSHAKES, "resumed" => "false"),
        }
    }

    /// A place for one more connection, or `None` at the cap.
    fn admit(&self) -> Option<Admitted> {
        let permit = Arc::clone(&self.permits).try_acquire_owned().ok()?;
        self.open.increment(1.0);
        Some(Admitted { _permit: permit, open: self.open.clone() })
    }

    /// The deadline of the handshake of a connection accepted now.
    fn handshake_deadline(&self) -> Instant {
        Instant::now() + self.handshake_timeout
    }

    /// Tells the client it is refused, in its protocol where it can (best
    /// effort: the socket is not waited on), and closes the connection.
    fn refuse(&self, stream: std::net::TcpStream, why: &'static str) {
        self.refused.increment(1);
        if let Some(refused) = self.refusals_logged.note() {
            tracing::warn!(max_connections = self.max_connections, refused, "refusing connections: {why}");
        }
        let lingering = Arc::clone(&self.lingering).try_acquire_owned().ok().and_then(|place| {
            let runtime = tokio::runtime::Handle::try_current().ok()?;
            Some((place, runtime))
        });
        let Some((place, runtime)) = lingering else {
            // A flood: no task, and the answer most clients (gateways) read.
            // The stream is non-blocking: a full send buffer only loses the GOAWAY.
            let _ = (&stream).write_all(&refusal_frames());
            let _ = stream.shutdown(std::net::Shutdown::Write);
            return;
        };
        let Ok(stream) = TcpStream::from_std(stream) else { return };
        let cors_origins = Arc::clone(&self.cors_origins);
        runtime.spawn(async move {
            let _place = place;
            answer_refused(stream, &cors_origins).await;
        });
    }
}

/// Answers a refused connection in the protocol its first bytes show, then
/// closes it ([`answer_and_close`]).
async fn answer_refused(mut stream: TcpStream, cors_origins: &[http::HeaderValue]) {
    let mut first = vec![0; REFUSED_HEAD_BYTES];
    let mut received = 0;
    // Two bytes tell the preface ("PR") from every HTTP/1 method ("PO",
    // "PU", "GE", ...); an HTTP/1 request is read on to the end of its head,
    // for its Origin.
    let sniffed = tokio::time::timeout(REFUSAL_SNIFF, async {
        loop {
            match stream.read(&mut first[received..]).await {
                Ok(0) | Err(_) => break,
                Ok(read) => received += read,
            }
            let head = &first[..received];
            let http2 = PREFACE.starts_with(&head[..head.len().min(PREFACE_BYTES)]);
            let tls = head[0] == TLS_HANDSHAKE_RECORD;
            if tls || (received >= 2 && (http2 || head.windows(4).any(|w| w == b"\r\n\r\n") || received == first.len()))
            {
                break;
            }
        }
    });
    let _ = sniffed.await;
    let head = &first[..received];
    if head.first() == Some(&TLS_HANDSHAKE_RECORD) {
        // A TLS client: nothing it could read without a handshake.
        return;
    }
    let http1 = received > 0 && !PREFACE.starts_with(&head[..received.min(PREFACE_BYTES)]);
    let answer = if http1 {
        let origin =
            origin_of(head).filter(|origin| cors_origins.iter().any(|allowed| allowed.as_bytes() == origin.as_bytes()));
        http1_refusal(origin)
    } else {
        refusal_frames()
    };
    answer_and_close(stream, &answer).await;
}

/// Writes `answer` and keeps the connection open until its client closes or
/// [`REFUSAL_LINGER`] passes: closing a socket whose client's bytes are still
/// arriving makes the kernel answer with a reset, which can reach the client
/// before it has read the answer.
async fn answer_and_close(mut stream: TcpStream, answer: &[u8]) {
    let _ = tokio::time::timeout(REFUSAL_LINGER, async {
        let _ = stream.write_all(answer).await;
        let _ = stream.shutdown().await;
        let mut discard = [0; 1024];
        while matches!(stream.read(&mut discard).await, Ok(read) if read > 0) {}
    })
    .await;
}

/// A connection's place under the cap: returned, and the gauge lowered,
/// when the connection's IO object is dropped.
#[derive(Debug)]
pub(crate) struct Admitted {
    _permit: OwnedSemaphorePermit,
    open: Gauge,
}

impl Drop for Admitted {
    fn drop(&mut self) {
        self.open.decrement(1.0);
    }
}

/// An admitted connection as hyper sees it: the socket (under TLS, once its
/// TLS handshake is done), its place under the cap, and until the opening
/// is complete, its deadline.
#[derive(Debug)]
pub(crate) struct Guarded {
    inner: Transport,
    /// `None` once the client has sent its opening (see [`Opening`]).
    handshake: Option<Handshake>,
    /// Counts a connection closed for its handshake.
    timeouts: Counter,
    /// Who the connection is, for every request on it.
    info: ConnectionInfo,
    _admitted: Admitted,
}

/// A connection's bytes: plaintext, or TLS over the socket.
#[derive(Debug)]
enum Transport {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

/// Calls `$method` on the transport's stream, whichever it is.
macro_rules! on_transport {
    ($transport:expr, $stream:ident => $call:expr) => {
        match $transport {
            Transport::Plain($stream) => $call,
            Transport::Tls($stream) => $call,
        }
    };
}

/// A connection's deadline for its opening, and how far the opening is.
#[derive(Debug)]
struct Handshake {
    deadline: Pin<Box<Sleep>>,
    opening: Opening,
}

/// The client's first bytes, followed until they make a complete opening:
/// for HTTP/2, the preface and the whole first frame (which must be
/// SETTINGS; h2 checks both); for HTTP/1, a whole request head. The two are
/// told apart as hyper's server tells them apart: by whether the bytes are
/// the preface's. Read byte by byte, but only until the opening is complete.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Opening {
    /// Every byte so far is the preface's; this many of them.
    Preface(usize),
    /// The preface is in; the first frame's header so far, and how much of it.
    FrameHeader([u8; FRAME_HEADER_BYTES], usize),
    /// The bytes of the first frame's payload still to come.
    FramePayload(usize),
    /// An HTTP/1 request head: line ends in a row so far (two end it; a
    /// carriage return does not count, so that bare line feeds, which
    /// hyper accepts, end it too).
    Head(u8),
    /// Complete.
    Complete,
}

impl Opening {
    /// How far the opening is after `bytes`, just read.
    fn after(mut self, mut bytes: &[u8]) -> Opening {
        while let Some((&byte, rest)) = bytes.split_first() {
            self = match self {
                Opening::Complete => return Opening::Complete,
                Opening::FramePayload(left) => {
                    let taken = left.min(bytes.len());
                    bytes = &bytes[taken..];
                    if taken == left { Opening::Complete } else { Opening::FramePayload(left - taken) }
                }
                state => {
                    bytes = rest;
                    state.step(byte)
                }
            };
        }
        self
    }

    fn step(self, byte: u8) -> Opening {
        match self {
            Opening::Preface(matched) if byte == PREFACE[matched] => match matched + 1 {
                PREFACE_BYTES => Opening::FrameHeader([0; FRAME_HEADER_BYTES], 0),
                matched => Opening::Preface(matched),
            },
            // Not the preface: an HTTP/1 request head, which began with the
            // bytes taken for the preface's so far.
            Opening::Preface(matched) => {
                PREFACE[..matched].iter().chain([&byte]).fold(Opening::Head(0), |head, &byte| head.step(byte))
            }
            Opening::FrameHeader(mut header, filled) => {
                header[filled] = byte;
                if filled + 1 < FRAME_HEADER_BYTES {
                    return Opening::FrameHeader(header, filled + 1);
                }
                match u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize {
                    0 => Opening::Complete,
                    length => Opening::FramePayload(length),
                }
            }
            Opening::Head(ends) => match byte {
                b'\n' if ends >= 1 => Opening::Complete,
                b'\n' => Opening::Head(1),
                b'\r' => Opening::Head(ends),
                _ => Opening::Head(0),
            },
            Opening::FramePayload(_) | Opening::Complete => self,
        }
    }
}

impl Guarded {
    fn new(
        inner: Transport,
        admitted: Admitted,
        deadline: Instant,
        admission: &Admission,
        certificate: Option<ClientCertificate>,
    ) -> Self {
        let handshake =
            Handshake { deadline: Box::pin(tokio::time::sleep_until(deadline)), opening: Opening::Preface(0) };
        let peer = match &inner {
            Transport::Plain(stream) => stream.peer_addr().ok(),
            Transport::Tls(stream) => stream.get_ref().0.peer_addr().ok(),
        };
        let info = ConnectionInfo { certificate: certificate.map(Arc::new), peer };
        Guarded {
            inner,
            handshake: Some(handshake),
            timeouts: admission.handshake_timeouts.clone(),
            info,
            _admitted: admitted,
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        // Polling the deadline here registers this task's waker with it:
        // hyper reads until the opening is in, so the deadline's wake-up
        // reaches this very call, and the error closes the connection.
        if let Some(handshake) = &mut this.handshake
            && handshake.deadline.as_mut().poll(cx).is_ready()
        {
            this.handshake = None;
            this.timeouts.increment(1);
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no HTTP/2 preface and SETTINGS, nor an HTTP/1 request head, within the handshake timeout",
            )));
        }
        let before = buf.filled().len();
        let polled = on_transport!(&mut this.inner, stream => Pin::new(stream).poll_read(cx, buf));
        if let Some(handshake) = &mut this.handshake {
            handshake.opening = handshake.opening.after(&buf.filled()[before..]);
            if handshake.opening == Opening::Complete {
                this.handshake = None;
            }
        }
        polled
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        on_transport!(&mut self.get_mut().inner, stream => Pin::new(stream).poll_write(cx, buf))
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        on_transport!(&mut self.get_mut().inner, stream => Pin::new(stream).poll_write_vectored(cx, bufs))
    }

    // hyper writes many replies in one `writev` only if this says it can
    // (see the module doc of the connection threads).
    fn is_write_vectored(&self) -> bool {
        on_transport!(&self.inner, stream => stream.is_write_vectored())
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        on_transport!(&mut self.get_mut().inner, stream => Pin::new(stream).poll_flush(cx))
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        on_transport!(&mut self.get_mut().inner, stream => Pin::new(stream).poll_shutdown(cx))
    }
}

impl Connected for Guarded {
    type ConnectInfo = ConnectionInfo;

    fn connect_info(&self) -> ConnectionInfo {
        self.info.clone()
    }
}

/// A connection admitted and not yet served: its socket, place and deadline.
#[derive(Debug)]
struct Accepted {
    stream: TcpStream,
    admitted: Admitted,
    deadline: Instant,
}

/// The connections of `accepted` ready for hyper: as they are in
/// plaintext; with TLS, once their handshake is done (at most
/// [`HANDSHAKES_IN_FLIGHT`] at once, each by its deadline). A connection
/// that fails its handshake is closed here and never reaches hyper.
fn ready_to_serve(
    accepted: impl Stream<Item = Accepted> + Send + 'static,
    admission: Admission,
) -> Pin<Box<dyn Stream<Item = std::io::Result<Guarded>> + Send>> {
    if admission.tls.is_none() {
        return Box::pin(accepted.map(move |Accepted { stream, admitted, deadline }| {
            Ok(Guarded::new(Transport::Plain(stream), admitted, deadline, &admission, None))
        }));
    }
    let handshakes = accepted.map({
        let admission = admission.clone();
        move |accepted| tls_handshake(accepted, admission.clone())
    });
    Box::pin(
        futures_util::StreamExt::buffer_unordered(handshakes, HANDSHAKES_IN_FLIGHT)
            .filter_map(|guarded| guarded.map(Ok)),
    )
}

/// The TLS handshake of one connection, by its deadline, with the material
/// current now; `None` if it failed (counted and logged at debug: a
/// client's mistake is for the client to see, and a flood of them must not
/// flood the log).
async fn tls_handshake(accepted: Accepted, admission: Admission) -> Option<Guarded> {
    let Accepted { stream, admitted, deadline } = accepted;
    let material = admission.tls.as_ref()?.current();
    let peer = stream.peer_addr().ok();
    let handshake = async {
        let mut first = [0; 1];
        if stream.peek(&mut first).await? == 0 {
            return Err(std::io::Error::new(std::io::ErrorKind::UnexpectedEof, "closed before its handshake"));
        }
        if first[0] != TLS_HANDSHAKE_RECORD {
            admission.tls_plaintext.increment(1);
            answer_plaintext(stream).await;
            return Err(std::io::Error::new(std::io::ErrorKind::InvalidData, "plaintext on the TLS port"));
        }
        material.acceptor().accept(stream).await.inspect_err(|_| admission.tls_failed.increment(1))
    };
    match tokio::time::timeout_at(deadline, handshake).await {
        Ok(Ok(tls)) => {
            let resumed = tls.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
            if resumed { &admission.tls_resumed } else { &admission.tls_full }.increment(1);
            let certificate = material.client_certificate(tls.get_ref().1);
            Some(Guarded::new(Transport::Tls(Box::new(tls)), admitted, deadline, &admission, certificate))
        }
        Ok(Err(err)) => {
            tracing::debug!(%err, ?peer, "TLS handshake failed");
            if let Some(refused) = admission.handshake_refusals_logged.note() {
                let peer = peer.map_or_else(|| "an unknown address".to_owned(), |peer| peer.to_string());
                tracing::warn!(
                    refused,
                    "refused TLS handshakes ({refused} since the last such line); the last, from {peer}: {err}"
                );
            }
            None
        }
        Err(_) => {
            admission.handshake_timeouts.increment(1);
            None
        }
    }
}

/// Tells a client that spoke plaintext to the TLS port so, in the protocol
/// of its first bytes, and closes the connection ([`answer_and_close`]).
async fn answer_plaintext(mut stream: TcpStream) {
    let mut first = [0; PREFACE_BYTES];
    let mut received = 0;
    let _ = tokio::time::timeout(REFUSAL_SNIFF, async {
        while received < 2 {
            match stream.read(&mut first[received..]).await {
                Ok(0) | Err(_) => break,
                Ok(read) => received += read,
            }
        }
    })
    .await;
    let http2 = PREFACE.starts_with(&first[..received]);
    let answer = if http2 { tls_required_frames() } else { http1_tls_required() };
    answer_and_close(stream, &answer).await;
}

/// Accepted sockets, from one listener or several merged.
pub(crate) trait Incoming: Stream<Item = std::io::Result<TcpStream>> + Send + Unpin + 'static {}

impl<T: Stream<Item = std::io::Result<TcpStream>> + Send + Unpin + 'static> Incoming for T {}

/// The connections of `incoming` that `admission` admits, for tonic's own
/// server loop (no connection threads); the others are refused as they come.
pub(crate) fn admitted(
    incoming: impl Incoming,
    admission: Admission,
) -> impl Stream<Item = std::io::Result<Guarded>> + Send + 'static {
    let accepted = incoming.filter_map({
        let admission = admission.clone();
        move |accepted| {
            let stream = match accepted {
                Ok(stream) => stream,
                Err(err) => {
                    // Out of file descriptors, a reset before accept: the listener is fine.
                    tracing::warn!(%err, "cannot accept a connection");
                    return None;
                }
            };
            match admission.admit() {
                Some(admitted) => Some(Accepted { stream, admitted, deadline: admission.handshake_deadline() }),
                None => {
                    if let Ok(stream) = stream.into_std() {
                        admission.refuse(stream, "at max-connections");
                    }
                    None
                }
            }
        }
    });
    ready_to_serve(accepted, admission)
}

/// The server settings every connection is served with.
pub(crate) fn server(max_streams_per_connection: u32) -> tonic::transport::Server {
    // A client opening more concurrent streams than this gets REFUSED_STREAM
    // for the extra ones (well-behaved clients wait for a free one instead).
    // HTTP/1 is for browsers on plain http (gRPC-Web, the console); hyper
    // tells an HTTP/2 client by its preface, so gRPC clients see no change.
    tonic::transport::Server::builder().max_concurrent_streams(max_streams_per_connection).accept_http1(true)
}

/// One connection on its way to a connection thread.
#[derive(Debug)]
struct Handoff {
    stream: std::net::TcpStream,
    admitted: Admitted,
    /// Counted from the accept, not from the hand-off.
    handshake_deadline: Instant,
}

/// The connection threads of one server.
#[derive(Debug)]
pub(crate) struct ConnectionThreads {
    /// Where the acceptor hands each thread its connections; bounded, so a
    /// thread that falls behind makes the acceptor refuse, not queue.
    handoff: Vec<mpsc::Sender<Handoff>>,
    /// One per thread: its server's result once it has stopped.
    stopped: Vec<oneshot::Receiver<Result<(), tonic::transport::Error>>>,
    /// The cap and the handshake deadline.
    admission: Admission,
}

impl ConnectionThreads {
    /// Starts `threads` threads, each serving `front` with `server`'s
    /// settings on the connections handed to it. They drain their
    /// connections gracefully once `stopping` is cancelled, and drop whatever
    /// is still open once `closing` is.
    pub(crate) fn start(
        threads: usize,
        front: &web::FrontService,
        server: &tonic::transport::Server,
        admission: Admission,
        stopping: &CancellationToken,
        closing: &CancellationToken,
    ) -> std::io::Result<ConnectionThreads> {
        // A queue can hold at most the connections the cap admits, and a
        // thread's fair share of them is enough: more waiting for one thread
        // means that thread is stuck.
        let queue = admission.max_connections.div_ceil(threads).max(1);
        let mut handoff = Vec::with_capacity(threads);
        let mut stopped = Vec::with_capacity(threads);
        for index in 0..threads {
            let (sender, receiver) = mpsc::channel::<Handoff>(queue);
            let (report, result) = oneshot::channel();
            let (front, stopping, closing) = (front.clone(), stopping.clone(), closing.clone());
            let (server, admission) = (server.clone(), admission.clone());
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            std::thread::Builder::new().name(format!("presenced-conn-{index}")).spawn(move || {
                let served = runtime.block_on(async move {
                    // A stream the acceptor registered with its own runtime is
                    // moved here as a std stream and registered with this one
                    // (and so is its deadline's timer).
                    let accepted = ReceiverStream::new(receiver).filter_map(|handoff| {
                        let Handoff { stream, admitted, handshake_deadline } = handoff;
                        TcpStream::from_std(stream)
                            .map(|stream| Accepted { stream, admitted, deadline: handshake_deadline })
                            .inspect_err(|err| {
                                tracing::warn!(%err, "cannot take over a connection; it is closed");
                            })
                            .ok()
                    });
                    let incoming = ready_to_serve(accepted, admission);
                    let serving = server.serve_with_incoming_shutdown(front, incoming, stopping.cancelled_owned());
                    tokio::select! {
                        served = serving => served,
                        () = closing.cancelled() => Ok(()),
                    }
                });
                // Whatever is still running (a request past the grace) is dropped
                // with the runtime; a blocking job gets a moment to finish.
                runtime.shutdown_timeout(Duration::from_millis(100));
                let _ = report.send(served);
            })?;
            handoff.push(sender);
            stopped.push(result);
        }
        Ok(ConnectionThreads { handoff, stopped, admission })
    }

    /// Accepts connections from `incoming`, admits them and hands them out
    /// round-robin until `stopping` is cancelled, then waits for every
    /// thread's server to stop.
    pub(crate) async fn serve(
        self,
        mut incoming: impl Incoming,
        stopping: CancellationToken,
    ) -> Result<(), tonic::transport::Error> {
        let ConnectionThreads { mut handoff, stopped, admission } = self;
        let mut next = 0;
        loop {
            let accepted = tokio::select! {
                accepted = incoming.next() => accepted,
                () = stopping.cancelled() => break,
            };
            let stream = match accepted {
                Some(Ok(stream)) => stream,
                Some(Err(err)) => {
                    // Out of file descriptors, a reset before accept: the
                    // listener itself is fine, so keep accepting, without spinning.
                    tracing::warn!(%err, "cannot accept a connection");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
                None => break,
            };
            let admitted = admission.admit();
            let handshake_deadline = admission.handshake_deadline();
            let stream = match stream.into_std() {
                Ok(stream) => stream,
                Err(err) => {
                    tracing::warn!(%err, "cannot hand over a connection; it is closed");
                    continue;
                }
            };
            let Some(admitted) = admitted else {
                admission.refuse(stream, "at max-connections");
                continue;
            };
            let mut connection = Handoff { stream, admitted, handshake_deadline };
            // A thread whose server has stopped (none should before the
            // shutdown) has dropped its receiver: it leaves the rotation, and
            // the connection goes to the next thread.
            loop {
                match handoff[next].try_send(connection) {
                    Ok(()) => break,
                    Err(TrySendError::Full(refused)) => {
                        // Its place under the cap is given back before the refusal.
                        let Handoff { stream, admitted, .. } = refused;
                        drop(admitted);
                        admission.refuse(stream, "a connection thread's hand-off queue is full");
                        break;
                    }
                    Err(TrySendError::Closed(returned)) => {
                        tracing::error!(thread = next, "a connection thread has stopped; serving on the others");
                        connection = returned;
                        handoff.remove(next);
                        if handoff.is_empty() {
                            break;
                        }
                        next %= handoff.len();
                    }
                }
            }
            if handoff.is_empty() {
                break;
            }
            next = (next + 1) % handoff.len();
        }
        drop(incoming); // stop listening before the drain
        drop(handoff);
        let mut result = Ok(());
        for stopped in stopped {
            if let Ok(Err(err)) = stopped.await {
                result = Err(err);
            }
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_stopped_thread_leaves_the_rotation_and_its_connections_go_to_the_others() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (stopped_thread, gone) = mpsc::channel(4);
        drop(gone);
        let (live_thread, mut served) = mpsc::channel(4);
        let (reports, results): (Vec<_>, Vec<_>) = (0..2).map(|_| oneshot::channel()).unzip();
        let admission = Admission::new(8, Duration::from_secs(10), Vec::new(), None);
        let threads = ConnectionThreads { handoff: vec![stopped_thread, live_thread], stopped: results, admission };
        let stopping = CancellationToken::new();
        let accepting =
            tokio::spawn(threads.serve(tonic::transport::server::TcpIncoming::from(listener), stopping.clone()));

        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut handed_over = Vec::new();
        for _ in 0..3 {
            let handoff = tokio::time::timeout(Duration::from_secs(10), served.recv()).await.expect("handed over");
            handed_over.push(handoff.expect("the live thread's channel is open").stream.peer_addr().unwrap());
        }
        let mut connected: Vec<_> = clients.iter().map(|client| client.local_addr().unwrap()).collect();
        handed_over.sort();
        connected.sort();
        assert_eq!(handed_over, connected, "every connection reaches the live thread");

        stopping.cancel();
        for report in reports {
            let _ = report.send(Ok(()));
        }
        accepting.await.unwrap().unwrap();
    }

    #[tokio::test]
    async fn a_connection_for_a_thread_whose_queue_is_full_is_refused_not_queued() {
        use tokio::io::AsyncReadExt as _;
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        // A thread that is stuck: its queue holds one connection and nothing takes it.
        let (stuck_thread, mut queued) = mpsc::channel(1);
        let (report, result) = oneshot::channel();
        let admission = Admission::new(8, Duration::from_secs(10), Vec::new(), None);
        let threads = ConnectionThreads { handoff: vec![stuck_thread], stopped: vec![result], admission };
        let stopping = CancellationToken::new();
        let accepting =
            tokio::spawn(threads.serve(tonic::transport::server::TcpIncoming::from(listener), stopping.clone()));

        let first = TcpStream::connect(addr).await.unwrap();
        let mut second = TcpStream::connect(addr).await.unwrap();
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), second.read_to_end(&mut answer))
            .await
            .expect("the second connection is answered and closed, not queued")
            .unwrap();
        assert_eq!(answer, refusal_frames());
        let handed = queued.try_recv().expect("the first connection is queued");
        assert_eq!(handed.stream.peer_addr().unwrap(), first.local_addr().unwrap());

        stopping.cancel();
        let _ = report.send(Ok(()));
        drop(queued);
        accepting.await.unwrap().unwrap();
    }

    /// `bytes` read in two parts, split at every place: the opening is
    /// incomplete before `complete_at` bytes and complete from there on.
    fn assert_opening_completes_at(bytes: &[u8], complete_at: usize) {
        for split in 0..=bytes.len() {
            let first = Opening::Preface(0).after(&bytes[..split]);
            assert_eq!(first == Opening::Complete, split >= complete_at, "after {split} of {:?}", bytes);
            assert_eq!(first.after(&bytes[split..]), Opening::Complete, "after all, split at {split}");
        }
    }

    #[test]
    fn the_handshake_is_complete_with_the_preface_and_the_whole_first_frame() {
        let mut bytes = PREFACE.to_vec();
        bytes.extend_from_slice(&[0, 0, 6, 0x4, 0, 0, 0, 0, 0]); // SETTINGS with one parameter
        bytes.extend_from_slice(&[0, 3, 0, 0, 0, 100]);
        let complete_at = bytes.len();
        bytes.extend_from_slice(&[0, 0, 4, 0x8, 0, 0, 0, 0, 0]); // and the next frame: still complete
        assert_opening_completes_at(&bytes, complete_at);
        let mut empty_settings = PREFACE.to_vec();
        empty_settings.extend_from_slice(&[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
        assert_opening_completes_at(&empty_settings, empty_settings.len());
    }

    #[test]
    fn the_handshake_is_complete_with_a_whole_http1_request_head() {
        let head = "POST /presence.v1.Presence/Snapshot HTTP/1.1\r\nhost: a\r\ncontent-type: application/grpc-web+proto\r\n\r\n";
        let mut bytes = head.as_bytes().to_vec();
        bytes.extend_from_slice(&[0, 0, 0, 0, 2, 10, 0]); // the body follows
        assert_opening_completes_at(&bytes, head.len());
        // Bare line feeds (hyper takes them), and a method that starts like the preface.
        assert_opening_completes_at(b"GET /console/ HTTP/1.1\nhost: a\n\n", 32);
        assert_opening_completes_at(b"PRI /x HTTP/1.1\r\n\r\n", 19);
        // A head still arriving is not complete, however long.
        let endless = format!("GET /console/ HTTP/1.1\r\n{}", "x-a: b\r\n".repeat(1000));
        assert_ne!(Opening::Preface(0).after(endless.as_bytes()), Opening::Complete);
    }

    #[test]
    fn a_refused_http1_client_is_answered_with_a_503() {
        let refusal = String::from_utf8(http1_refusal(None)).unwrap();
        let (head, body) = refusal.split_once("\r\n\r\n").expect("a head and a body");
        assert!(head.starts_with("HTTP/1.1 503 Service Unavailable\r\n"), "{head}");
        let length: usize =
            head.lines().find_map(|line| line.strip_prefix("content-length: ")).unwrap().parse().unwrap();
        assert_eq!(length, body.len());
        assert!(head.contains("\r\nconnection: close") && head.contains("\r\ngrpc-status: 14"), "{head}");
    }

    #[test]
    fn a_refusal_to_an_allowed_page_carries_the_cors_headers_it_needs_to_be_read() {
        let refusal = String::from_utf8(http1_refusal(Some("https://app.example"))).unwrap();
        let (head, body) = refusal.split_once("\r\n\r\n").unwrap();
        assert!(head.contains("\r\naccess-control-allow-origin: https://app.example\r\n"), "{head}");
        assert!(
            head.contains("\r\naccess-control-expose-headers: grpc-status, grpc-message, retry-after\r\n"),
            "{head}"
        );
        assert!(head.contains("\r\nvary: origin\r\n") && body.contains("too many connections"), "{refusal}");
        assert!(!String::from_utf8(http1_refusal(None)).unwrap().contains("access-control"), "none for other pages");
    }

    #[test]
    fn the_origin_is_read_from_whole_header_lines_only() {
        let head = b"POST /presence.v1.Presence/Watch HTTP/1.1\r\nHost: x\r\nOrigin: https://app.example\r\n\r\n";
        assert_eq!(origin_of(head), Some("https://app.example"));
        assert_eq!(origin_of(b"GET / HTTP/1.1\r\norigin:https://a.example\r\nHost: x\r\n"), Some("https://a.example"));
        assert_eq!(origin_of(b"GET / HTTP/1.1\r\nOrigin: https://cut"), None, "a line still arriving");
        assert_eq!(origin_of(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"), None);
        assert_eq!(origin_of(b"GET /origin: HTTP/1.1\r\n\r\n"), None, "not from the request line");
        assert_eq!(
            origin_of(b"GET / HTTP/1.1\r\nHost: x\r\n\r\nOrigin: https://body.example\r\n"),
            None,
            "not past the head"
        );
    }

    #[test]
    fn the_refusal_is_a_settings_frame_then_a_goaway() {
        let frames = refusal_frames();
        assert_eq!(&frames[..9], &[0, 0, 0, 0x4, 0, 0, 0, 0, 0]);
        let length = u32::from_be_bytes([0, frames[9], frames[10], frames[11]]) as usize;
        assert_eq!((frames[12], frames.len()), (0x7, 18 + length));
        assert_eq!(&frames[22..26], &7u32.to_be_bytes(), "REFUSED_STREAM");
    }
}
