//! A TCP proxy that delays each direction by a one-way delay.
//!
//! Per connection and direction, a reader task stamps each chunk it reads
//! with its arrival time and queues it; a writer task sleeps until arrival +
//! delay (the delay read at arrival) and writes it. The queue holds at most
//! [`QUEUE_CHUNKS`] chunks of at most [`CHUNK`] bytes: when it is full the
//! reader stops reading, and TCP flow control pushes back on the sender, so
//! a fast sender cannot make the proxy buffer without bound. Chunks leave in
//! the order they came, also when the delay is lowered while they wait.
//!
//! The delay is one value for both directions, so a round trip through the
//! proxy takes twice the delay plus the upstream's own time.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::task::JoinSet;
use tokio::time::Instant;

/// Largest chunk read at once.
const CHUNK: usize = 16 * 1024;

/// Chunks held per direction of a connection: with [`CHUNK`], at most
/// 1 MiB in flight per direction.
const QUEUE_CHUNKS: usize = 64;

/// State shared by the proxy handle and its tasks.
#[derive(Debug, Default)]
struct Shared {
    /// The one-way delay in nanoseconds, read at each chunk's arrival.
    delay_nanos: AtomicU64,
    /// Bytes written to the upstream.
    bytes_up: AtomicU64,
    /// Bytes written back to the clients.
    bytes_down: AtomicU64,
    /// Connections accepted.
    connections: AtomicU64,
}

/// Totals of what a [`DelayProxy`] forwarded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ProxyCounters {
    /// Bytes written to the upstream (client to server).
    pub bytes_up: u64,
    /// Bytes written back to the clients (server to client).
    pub bytes_down: u64,
    /// Connections accepted.
    pub connections: u64,
}

/// A delaying TCP proxy; dropping it closes the listener and every
/// connection through it.
#[derive(Debug)]
pub struct DelayProxy {
    /// The address clients connect to.
    local_addr: SocketAddr,
    /// Delay and counters, shared with the tasks.
    shared: Arc<Shared>,
    /// The accept loop; it owns the connection tasks, so aborting it ends them.
    accept: tokio::task::JoinHandle<()>,
}

impl DelayProxy {
    /// Listens on `listen` (port 0 picks one) and forwards each connection to
    /// `upstream`, delaying each direction by `delay`. Must be called within
    /// a tokio runtime, which runs the proxy.
    pub async fn start(listen: SocketAddr, upstream: SocketAddr, delay: Duration) -> std::io::Result<DelayProxy> {
        let listener = TcpListener::bind(listen).await?;
        Self::serve(listener, upstream, delay)
    }

    /// Like [`DelayProxy::start`] with a listener already bound (for example
    /// inside a [`crate::NetLab`] namespace; it must be non-blocking).
    pub fn serve(listener: TcpListener, upstream: SocketAddr, delay: Duration) -> std::io::Result<DelayProxy> {
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared::default());
        shared.delay_nanos.store(nanos(delay), Ordering::Relaxed);
        let accept = tokio::spawn(accept_loop(listener, upstream, Arc::clone(&shared)));
        Ok(DelayProxy { local_addr, shared, accept })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// Changes the one-way delay for data arriving from now on; data already
    /// held keeps the release time it was given.
    pub fn set_delay(&self, delay: Duration) {
        self.shared.delay_nanos.store(nanos(delay), Ordering::Relaxed);
    }

    /// The one-way delay now in force.
    pub fn delay(&self) -> Duration {
        Duration::from_nanos(self.shared.delay_nanos.load(Ordering::Relaxed))
    }

    /// What has been forwarded so far.
    pub fn counters(&self) -> ProxyCounters {
        ProxyCounters {
            bytes_up: self.shared.bytes_up.load(Ordering::Relaxed),
            bytes_down: self.shared.bytes_down.load(Ordering::Relaxed),
            connections: self.shared.connections.load(Ordering::Relaxed),
        }
    }
}

impl Drop for DelayProxy {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

fn nanos(delay: Duration) -> u64 {
    u64::try_from(delay.as_nanos()).unwrap_or(u64::MAX)
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<Shared>) {
    // Dropped with this task: aborts every connection's tasks.
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else { continue };
                shared.connections.fetch_add(1, Ordering::Relaxed);
                connections.spawn(connection(client, upstream, Arc::clone(&shared)));
            }
            // Reap finished connections so the set does not grow.
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

/// Forwards one connection both ways; a failed upstream connect closes the
/// client's connection, as a refused connect would.
async fn connection(client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    let Ok(server) = TcpStream::connect(upstream).await else { return };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let up = pump(client_read, server_write, Arc::clone(&shared), Direction::Up);
    let down = pump(server_read, client_write, shared, Direction::Down);
    tokio::join!(up, down);
}

#[derive(Debug, Clone, Copy)]
enum Direction {
    /// Client to upstream.
    Up,
    /// Upstream to client.
    Down,
}

/// Moves one direction: reads, holds each chunk until its release time,
/// writes. An end of stream is passed on as a write shutdown once the data
/// before it has been released.
async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    shared: Arc<Shared>,
    direction: Direction,
) {
    let (queue, mut held) = mpsc::channel::<(Instant, Vec<u8>)>(QUEUE_CHUNKS);
    let delay = Arc::clone(&shared);
    let reader = async move {
        let mut buf = vec![0u8; CHUNK];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            let release = Instant::now() + Duration::from_nanos(delay.delay_nanos.load(Ordering::Relaxed));
            if queue.send((release, buf[..n].to_vec())).await.is_err() {
                break; // the writer is gone: the peer closed
            }
        }
        // Dropping the sender ends the writer after the held chunks.
    };
    let writer = async move {
        while let Some((release, chunk)) = held.recv().await {
            tokio::time::sleep_until(release).await;
            if to.write_all(&chunk).await.is_err() {
                return;
            }
            let counter = match direction {
                Direction::Up => &shared.bytes_up,
                Direction::Down => &shared.bytes_down,
            };
            counter.fetch_add(chunk.len() as u64, Ordering::Relaxed);
        }
        let _ = to.shutdown().await;
    };
    tokio::join!(reader, writer);
}
