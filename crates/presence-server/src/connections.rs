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
//! Admission (contract B5), on both paths: at most `max_connections` are
//! open at once, each holding a [`Semaphore`] permit that its IO object
//! ([`Guarded`]) returns when hyper drops it. A connection beyond the cap is
//! answered with an HTTP/2 GOAWAY and closed at once, counted, and logged at
//! most once a second. A connection that has not sent the client preface and
//! its first SETTINGS frame within `handshake_timeout` is closed: neither
//! hyper nor tonic has such a deadline (hyper's `header_read_timeout` is
//! HTTP/1 only, and HTTP/2 keep-alive pings start after the handshake), so
//! `Guarded` carries it. The hand-off queue to each connection thread is
//! bounded by its share of `max_connections`; when it is full the connection
//! is refused the same way, never queued.

use std::io::Write as _;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use metrics::{Counter, Gauge, counter, gauge};
use tokio::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::sync::mpsc::error::TrySendError;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::{Instant, Sleep};
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::{Stream, StreamExt};
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::transport::server::{Connected, TcpConnectInfo, TcpIncoming};

use crate::metrics::names;

/// The HTTP/2 client connection preface (RFC 9113, 3.4).
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
    const DEBUG: &[u8] = b"presenced: too many connections (max-connections)";
    const REFUSED_STREAM: u32 = 0x7;
    let mut frames = vec![0, 0, 0, 0x4, 0, 0, 0, 0, 0]; // SETTINGS, no parameters
    let length = u32::try_from(8 + DEBUG.len()).expect("a short debug text");
    frames.extend_from_slice(&length.to_be_bytes()[1..]);
    frames.extend_from_slice(&[0x7, 0, 0, 0, 0, 0]); // GOAWAY, no flags, stream 0
    frames.extend_from_slice(&0u32.to_be_bytes()); // last stream id
    frames.extend_from_slice(&REFUSED_STREAM.to_be_bytes());
    frames.extend_from_slice(DEBUG);
    frames
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
    /// When a refusal was last logged, so a flood logs once a second, not
    /// once a connection.
    last_warning: Arc<parking_lot::Mutex<Option<std::time::Instant>>>,
    /// Refusals since the last warning, reported with the next one.
    refused_unlogged: Arc<AtomicU64>,
    /// Places for refused connections that are kept open a moment, so that
    /// their GOAWAY is read (see `refuse`); bounded, because a flood of
    /// refused connections must not become a flood of tasks.
    lingering: Arc<Semaphore>,
}

/// Refused connections kept open at once until their client has read the
/// GOAWAY; beyond these, a refused connection is closed at once.
const LINGERING_REFUSALS: usize = 64;
/// How long a refused connection is kept open for its client to read the GOAWAY.
const REFUSAL_LINGER: Duration = Duration::from_secs(1);

impl Admission {
    pub(crate) fn new(max_connections: usize, handshake_timeout: Duration) -> Self {
        Admission {
            permits: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            max_connections,
            handshake_timeout,
            open: gauge!(names::CONNECTIONS),
            refused: counter!(names::CONNECTIONS_REFUSED),
            handshake_timeouts: counter!(names::HANDSHAKE_TIMEOUTS),
            last_warning: Arc::default(),
            refused_unlogged: Arc::default(),
            lingering: Arc::new(Semaphore::new(LINGERING_REFUSALS)),
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

    /// Tells the client it is refused (best effort: the socket is not
    /// waited on) and closes the connection.
    fn refuse(&self, stream: std::net::TcpStream, why: &'static str) {
        self.refused.increment(1);
        self.refused_unlogged.fetch_add(1, Ordering::Relaxed);
        {
            let mut last = self.last_warning.lock();
            let now = std::time::Instant::now();
            if last.is_none_or(|at| now.duration_since(at) >= Duration::from_secs(1)) {
                *last = Some(now);
                let refused = self.refused_unlogged.swap(0, Ordering::Relaxed);
                tracing::warn!(max_connections = self.max_connections, refused, "refusing connections: {why}");
            }
        }
        // The stream is non-blocking: a full send buffer only loses the GOAWAY.
        let _ = (&stream).write_all(&refusal_frames());
        let _ = stream.shutdown(std::net::Shutdown::Write);
        // Closing a socket whose client's preface is still arriving makes the
        // kernel answer with a reset, which can reach the client before it
        // has read the GOAWAY; so the socket is kept, and what arrives read
        // away, until the client closes or a second passes.
        let Ok(place) = Arc::clone(&self.lingering).try_acquire_owned() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let Ok(stream) = TcpStream::from_std(stream) else { return };
        runtime.spawn(async move {
            let _place = place;
            let mut stream = stream;
            let mut discard = [0; 1024];
            let _ = tokio::time::timeout(REFUSAL_LINGER, async {
                while matches!(stream.read(&mut discard).await, Ok(n) if n > 0) {}
            })
            .await;
        });
    }
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

/// An admitted connection as hyper sees it: the socket, its place under the
/// cap, and until the handshake is complete, its deadline.
#[derive(Debug)]
pub(crate) struct Guarded {
    inner: TcpStream,
    /// `None` once the client has sent its preface and first frame.
    handshake: Option<Handshake>,
    /// Counts a connection closed for its handshake.
    timeouts: Counter,
    _admitted: Admitted,
}

/// The client's first bytes, watched until they make the preface and the
/// whole first frame (which must be SETTINGS; h2 checks both). HTTP/2 only:
/// the server does not accept HTTP/1, and if it ever does (gRPC-Web), this
/// must tell the two apart, or an HTTP/1 client would be read as a frame
/// of arbitrary length and closed at the deadline.
#[derive(Debug)]
struct Handshake {
    deadline: Pin<Box<Sleep>>,
    /// The preface and the first frame's header, to read the frame's length.
    first: [u8; PREFACE_BYTES + FRAME_HEADER_BYTES],
    /// Bytes received so far.
    received: usize,
}

impl Handshake {
    /// Takes note of `bytes`, just read; true once the handshake is complete.
    fn received(&mut self, bytes: &[u8]) -> bool {
        if let Some(room) = self.first.get_mut(self.received..) {
            let copied = room.len().min(bytes.len());
            room[..copied].copy_from_slice(&bytes[..copied]);
        }
        self.received += bytes.len();
        if self.received < self.first.len() {
            return false;
        }
        let length = u32::from_be_bytes([0, self.first[24], self.first[25], self.first[26]]) as usize;
        self.received >= self.first.len() + length
    }
}

impl Guarded {
    fn new(inner: TcpStream, admitted: Admitted, deadline: Instant, admission: &Admission) -> Self {
        let handshake = Handshake {
            deadline: Box::pin(tokio::time::sleep_until(deadline)),
            first: [0; PREFACE_BYTES + FRAME_HEADER_BYTES],
            received: 0,
        };
        Guarded {
            inner,
            handshake: Some(handshake),
            timeouts: admission.handshake_timeouts.clone(),
            _admitted: admitted,
        }
    }
}

impl AsyncRead for Guarded {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        // Polling the deadline here registers this task's waker with it: h2
        // reads until the preface is in, so the deadline's wake-up reaches
        // this very call, and the error closes the connection.
        if let Some(handshake) = &mut this.handshake
            && handshake.deadline.as_mut().poll(cx).is_ready()
        {
            this.handshake = None;
            this.timeouts.increment(1);
            return Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "no HTTP/2 preface and SETTINGS within the handshake timeout",
            )));
        }
        let before = buf.filled().len();
        let polled = Pin::new(&mut this.inner).poll_read(cx, buf);
        if let Some(handshake) = &mut this.handshake
            && handshake.received(&buf.filled()[before..])
        {
            this.handshake = None;
        }
        polled
    }
}

impl AsyncWrite for Guarded {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.get_mut().inner).poll_write_vectored(cx, bufs)
    }

    // hyper writes many replies in one `writev` only if this says it can
    // (see the module doc of the connection threads).
    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.get_mut().inner).poll_shutdown(cx)
    }
}

impl Connected for Guarded {
    type ConnectInfo = TcpConnectInfo;

    fn connect_info(&self) -> TcpConnectInfo {
        self.inner.connect_info()
    }
}

/// The connections of `incoming` that `admission` admits, for tonic's own
/// server loop (no connection threads); the others are refused as they come.
pub(crate) fn admitted(
    incoming: TcpIncoming,
    admission: Admission,
) -> impl Stream<Item = std::io::Result<Guarded>> + Send + 'static {
    incoming.filter_map(move |accepted| {
        let stream = match accepted {
            Ok(stream) => stream,
            Err(err) => return Some(Err(err)),
        };
        match admission.admit() {
            Some(admitted) => Some(Ok(Guarded::new(stream, admitted, admission.handshake_deadline(), &admission))),
            None => {
                if let Ok(stream) = stream.into_std() {
                    admission.refuse(stream, "at max-connections");
                }
                None
            }
        }
    })
}

/// The HTTP/2 server settings every connection is served with.
pub(crate) fn server(max_streams_per_connection: u32) -> tonic::transport::Server {
    // A client opening more concurrent streams than this gets REFUSED_STREAM
    // for the extra ones (well-behaved clients wait for a free one instead).
    tonic::transport::Server::builder().max_concurrent_streams(max_streams_per_connection)
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
    /// Starts `threads` threads, each serving `routes` with `server`'s
    /// settings on the connections handed to it. They drain their
    /// connections gracefully once `stopping` is cancelled, and drop whatever
    /// is still open once `closing` is.
    pub(crate) fn start(
        threads: usize,
        routes: &Routes,
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
            let (routes, stopping, closing) = (routes.clone(), stopping.clone(), closing.clone());
            let (mut server, admission) = (server.clone(), admission.clone());
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            std::thread::Builder::new().name(format!("presenced-conn-{index}")).spawn(move || {
                let served = runtime.block_on(async move {
                    // A stream the acceptor registered with its own runtime is
                    // moved here as a std stream and registered with this one
                    // (and so is its deadline's timer).
                    let incoming = ReceiverStream::new(receiver).map(|handoff| {
                        let Handoff { stream, admitted, handshake_deadline } = handoff;
                        TcpStream::from_std(stream)
                            .map(|stream| Guarded::new(stream, admitted, handshake_deadline, &admission))
                            .inspect_err(|err| {
                                tracing::warn!(%err, "cannot take over a connection; it is closed");
                            })
                    });
                    let serving =
                        server.add_routes(routes).serve_with_incoming_shutdown(incoming, stopping.cancelled_owned());
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
        mut incoming: TcpIncoming,
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
        let admission = Admission::new(8, Duration::from_secs(10));
        let threads = ConnectionThreads { handoff: vec![stopped_thread, live_thread], stopped: results, admission };
        let stopping = CancellationToken::new();
        let accepting = tokio::spawn(threads.serve(TcpIncoming::from(listener), stopping.clone()));

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
        let admission = Admission::new(8, Duration::from_secs(10));
        let threads = ConnectionThreads { handoff: vec![stuck_thread], stopped: vec![result], admission };
        let stopping = CancellationToken::new();
        let accepting = tokio::spawn(threads.serve(TcpIncoming::from(listener), stopping.clone()));

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

    #[test]
    fn the_handshake_is_complete_with_the_preface_and_the_whole_first_frame() {
        let mut bytes = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        bytes.extend_from_slice(&[0, 0, 6, 0x4, 0, 0, 0, 0, 0]); // SETTINGS with one parameter
        bytes.extend_from_slice(&[0, 3, 0, 0, 0, 100]);
        for split in 0..bytes.len() {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_time().build().unwrap();
            let _entered = runtime.enter();
            let mut handshake = Handshake {
                deadline: Box::pin(tokio::time::sleep(Duration::from_secs(1))),
                first: [0; PREFACE_BYTES + FRAME_HEADER_BYTES],
                received: 0,
            };
            assert!(!handshake.received(&bytes[..split]), "incomplete after {split} bytes");
            assert!(handshake.received(&bytes[split..]), "complete after all, split at {split}");
        }
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
