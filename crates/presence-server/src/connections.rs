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
//! Why it is not the default: Watch fan-out delivered about 8% fewer events
//! per second this way, with about 6% more server CPU per event, although
//! the threads were evenly loaded. And a connection cannot move between
//! threads, so an uneven mix of connections stays uneven. `docs/benchmarks.md`
//! has the measurements.
//!
//! The acceptor stays on the caller's runtime and hands connections round-robin
//! to the threads. Everything else (expiry, lease batch workers, checkpoints)
//! also stays on the caller's runtime.

use std::time::Duration;

use tokio::net::TcpStream;
use tokio::sync::{mpsc, oneshot};
use tokio_stream::StreamExt;
use tokio_stream::wrappers::UnboundedReceiverStream;
use tokio_util::sync::CancellationToken;
use tonic::service::Routes;
use tonic::transport::server::TcpIncoming;

/// The connection threads of one server.
#[derive(Debug)]
pub(crate) struct ConnectionThreads {
    /// Where the acceptor hands each thread its connections.
    handoff: Vec<mpsc::UnboundedSender<std::net::TcpStream>>,
    /// One per thread: its server's result once it has stopped.
    stopped: Vec<oneshot::Receiver<Result<(), tonic::transport::Error>>>,
}

impl ConnectionThreads {
    /// Starts `threads` threads, each serving `routes` on the connections handed
    /// to it. They drain their connections gracefully once `stopping` is
    /// cancelled, and drop whatever is still open once `closing` is.
    pub(crate) fn start(
        threads: usize,
        routes: &Routes,
        stopping: &CancellationToken,
        closing: &CancellationToken,
    ) -> std::io::Result<ConnectionThreads> {
        let mut handoff = Vec::with_capacity(threads);
        let mut stopped = Vec::with_capacity(threads);
        for index in 0..threads {
            let (sender, receiver) = mpsc::unbounded_channel::<std::net::TcpStream>();
            let (report, result) = oneshot::channel();
            let (routes, stopping, closing) = (routes.clone(), stopping.clone(), closing.clone());
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            std::thread::Builder::new().name(format!("presenced-conn-{index}")).spawn(move || {
                let served = runtime.block_on(async move {
                    // A stream the acceptor registered with its own runtime is
                    // moved here as a std stream and registered with this one.
                    let incoming = UnboundedReceiverStream::new(receiver).map(|stream| {
                        TcpStream::from_std(stream).inspect_err(|err| {
                            tracing::warn!(%err, "cannot take over a connection; it is closed");
                        })
                    });
                    let serving = tonic::transport::Server::builder()
                        .add_routes(routes)
                        .serve_with_incoming_shutdown(incoming, stopping.cancelled_owned());
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
        Ok(ConnectionThreads { handoff, stopped })
    }

    /// Accepts connections from `incoming` and hands them out round-robin until
    /// `stopping` is cancelled, then waits for every thread's server to stop.
    pub(crate) async fn serve(
        self,
        mut incoming: TcpIncoming,
        stopping: CancellationToken,
    ) -> Result<(), tonic::transport::Error> {
        let ConnectionThreads { mut handoff, stopped } = self;
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
            let mut stream = match stream.into_std() {
                Ok(stream) => stream,
                Err(err) => {
                    tracing::warn!(%err, "cannot hand over a connection; it is closed");
                    continue;
                }
            };
            // A thread whose server has stopped (none should before the
            // shutdown) has dropped its receiver: it leaves the rotation, and
            // the connection goes to the next thread.
            while let Err(returned) = handoff[next].send(stream) {
                tracing::error!(thread = next, "a connection thread has stopped; serving on the others");
                stream = returned.0;
                handoff.remove(next);
                if handoff.is_empty() {
                    break;
                }
                next %= handoff.len();
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
        let (stopped_thread, gone) = mpsc::unbounded_channel();
        drop(gone);
        let (live_thread, mut served) = mpsc::unbounded_channel();
        let (reports, results): (Vec<_>, Vec<_>) = (0..2).map(|_| oneshot::channel()).unzip();
        let threads = ConnectionThreads { handoff: vec![stopped_thread, live_thread], stopped: results };
        let stopping = CancellationToken::new();
        let accepting = tokio::spawn(threads.serve(TcpIncoming::from(listener), stopping.clone()));

        let mut clients = Vec::new();
        for _ in 0..3 {
            clients.push(TcpStream::connect(addr).await.unwrap());
        }
        let mut handed_over = Vec::new();
        for _ in 0..3 {
            let stream = tokio::time::timeout(Duration::from_secs(10), served.recv()).await.expect("handed over");
            handed_over.push(stream.expect("the live thread's channel is open").peer_addr().unwrap());
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
}
