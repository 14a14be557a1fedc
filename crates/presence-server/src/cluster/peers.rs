//! Connections to the other nodes of a cluster, for the calls a node makes
//! of them: short ones (forwarded reads, room facts, scans, handovers) and
//! long-lived ones (a viewer's Watch or WatchRoom forwarded to an owner,
//! which stays open as long as the viewer's does).
//!
//! A node allows each connection a fixed number of concurrent streams
//! (`--max-streams-per-connection`); an HTTP/2 client past it waits for one
//! to end. Forwarded watches end only when their viewers leave, so a node
//! relaying more of them than one connection allows would leave the next
//! ones waiting for good. So long-lived streams are counted per connection,
//! and one that would take a connection past half its allowance goes on a
//! new connection to the same node; the other half stays free for the short
//! calls that share the first connection.

use std::collections::HashMap;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::task::{Context, Poll};
use std::time::Duration;

use parking_lot::Mutex;
use presence_proto::v1::presence_client::PresenceClient;
use presence_tls::{ClientTls, TlsEndpoint};
use tokio_stream::Stream;
use tonic::Status;
use tonic::transport::Channel;

use crate::error::ServiceError;

/// Clients of the other nodes, their connections made on first use.
#[derive(Debug)]
pub(crate) struct Peers {
    /// Per node address, its connections, the first one carrying the short calls.
    connections: Mutex<HashMap<String, Vec<PeerConnection>>>,
    /// Long-lived streams one connection carries at most.
    long_streams_per_connection: usize,
    /// Node-to-node TLS: with it, nodes are dialled over `https://`, and
    /// their certificates must come from the cluster's CA and name the
    /// address they advertise.
    tls: Option<Arc<ClientTls>>,
}

/// One connection to a node, and how many long-lived streams it carries.
#[derive(Debug)]
struct PeerConnection {
    channel: Channel,
    long_streams: Arc<AtomicUsize>,
}

impl Peers {
    /// Connections to nodes that each allow `max_streams_per_connection`
    /// concurrent streams on a connection (the cluster's nodes share their
    /// `--max-streams-per-connection`).
    pub(crate) fn new(max_streams_per_connection: u32, tls: Option<Arc<ClientTls>>) -> Self {
        let long_streams_per_connection = (max_streams_per_connection as usize / 2).max(1);
        Peers { connections: Mutex::new(HashMap::new()), long_streams_per_connection, tls }
    }

    /// The connection for short calls to the node at `address` (host:port).
    pub(crate) fn channel(&self, address: &str) -> Result<Channel, ServiceError> {
        let mut connections = self.connections.lock();
        let to_node = match connections.get_mut(address) {
            Some(to_node) => to_node,
            None => {
                connections.entry(address.to_owned()).or_insert(vec![PeerConnection::open(address, self.tls.as_ref())?])
            }
        };
        Ok(to_node[0].channel.clone())
    }

    /// A Presence client for short calls to the node at `address`.
    pub(crate) fn client(&self, address: &str) -> Result<PresenceClient<Channel>, ServiceError> {
        Ok(PresenceClient::new(self.channel(address)?))
    }

    /// A Presence client for one long-lived stream to the node at `address`,
    /// on a connection with room for it, and the stream's place there, to be
    /// kept as long as the stream is (see [`PeerStream`]).
    pub(crate) fn stream_client(&self, address: &str) -> Result<(PresenceClient<Channel>, StreamPlace), ServiceError> {
        let mut connections = self.connections.lock();
        let to_node = connections.entry(address.to_owned()).or_default();
        let has_room = |connection: &&PeerConnection| {
            connection.long_streams.load(Ordering::Relaxed) < self.long_streams_per_connection
        };
        let connection = match to_node.iter().position(|c| has_room(&c)) {
            Some(at) => &to_node[at],
            None => {
                to_node.push(PeerConnection::open(address, self.tls.as_ref())?);
                to_node.last().expect("just pushed")
            }
        };
        connection.long_streams.fetch_add(1, Ordering::Relaxed);
        let place = StreamPlace(Arc::clone(&connection.long_streams));
        Ok((PresenceClient::new(connection.channel.clone()), place))
    }

    /// Connections open (or to be opened on first use) to the node at `address`.
    #[cfg(test)]
    fn connections_to(&self, address: &str) -> usize {
        self.connections.lock().get(address).map_or(0, Vec::len)
    }
}

impl PeerConnection {
    /// A connection to the node at `address`, made by its first call.
    fn open(address: &str, tls: Option<&Arc<ClientTls>>) -> Result<PeerConnection, ServiceError> {
        let scheme = if tls.is_some() { "https" } else { "http" };
        let bad_address = |err: presence_tls::TlsError| ServiceError::PeerUnusable {
            node: address.to_owned(),
            reason: format!("bad address: {err}"),
        };
        let node = TlsEndpoint::new(&format!("{scheme}://{address}"), tls.cloned(), None).map_err(bad_address)?;
        let endpoint = node
            .endpoint()
            .connect_timeout(Duration::from_secs(2))
            .http2_keep_alive_interval(Duration::from_secs(10))
            .keep_alive_timeout(Duration::from_secs(5));
        Ok(PeerConnection {
            channel: endpoint.connect_with_connector_lazy(node.connector()),
            long_streams: Arc::default(),
        })
    }
}

/// A long-lived stream's place on its connection, given back when dropped.
#[derive(Debug)]
pub(crate) struct StreamPlace(Arc<AtomicUsize>);

impl Drop for StreamPlace {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// A stream a node opened at another node, holding its place on its
/// connection until it is dropped.
#[derive(Debug)]
pub(crate) struct PeerStream<T> {
    stream: tonic::Streaming<T>,
    _place: StreamPlace,
}

impl<T> PeerStream<T> {
    pub(crate) fn new(stream: tonic::Streaming<T>, place: StreamPlace) -> Self {
        PeerStream { stream, _place: place }
    }

    /// The next message; `None` once the node ended the stream.
    pub(crate) async fn message(&mut self) -> Result<Option<T>, Status> {
        self.stream.message().await
    }
}

impl<T> Stream for PeerStream<T> {
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        Pin::new(&mut self.stream).poll_next(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// B5 in a cluster: long-lived streams past half a connection's allowance
    /// go on a new connection, and a place given back is taken again first.
    #[tokio::test]
    async fn long_streams_past_half_a_connections_allowance_open_another_connection() {
        let peers = Peers::new(4, None);
        let address = "127.0.0.1:1";
        peers.channel(address).unwrap();
        let mut places: Vec<StreamPlace> = (0..2).map(|_| peers.stream_client(address).unwrap().1).collect();
        assert_eq!(peers.connections_to(address), 1, "two streams fit the first connection");
        places.push(peers.stream_client(address).unwrap().1);
        assert_eq!(peers.connections_to(address), 2, "the third opens a second connection");
        places.remove(0);
        places.push(peers.stream_client(address).unwrap().1);
        assert_eq!(peers.connections_to(address), 2, "a place given back is taken again");
        places.push(peers.stream_client(address).unwrap().1);
        assert_eq!(peers.connections_to(address), 2, "the second connection has room for two");
        places.push(peers.stream_client(address).unwrap().1);
        assert_eq!(peers.connections_to(address), 3);
    }
}
