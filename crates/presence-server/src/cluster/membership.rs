//! Cluster mode (C1, C2, C5): which users this node may act for.
//!
//! With `--etcd`, a node joins a cluster whose slot map etcd holds (see the
//! `presence-cluster` crate): it grants itself an etcd lease, advertises its
//! address under it, campaigns to coordinate, and follows the slot map and
//! the set of nodes. A request for a user is served only when this node owns
//! the user's slot **and** its etcd lease is confirmed: the last keep-alive
//! etcd answered, plus the TTL, less a margin, is still ahead. Otherwise the
//! request is refused with [`ServiceError::NotOwner`], which names the owner
//! the map shows, so that the client can go there. A node cut off from etcd
//! therefore stops answering for its slots before etcd could expire its
//! lease and the coordinator give them to another node: two nodes never both
//! act for one slot.
//!
//! Without `--etcd` nothing of this exists (C5): the node is a
//! `SingleNode` placement, which checks nothing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use presence_cluster::{
    Campaigner, Coordinator, Etcd, LeaseState, NodeLease, NodeSet, NodeSetWatch, SlotMap, SlotMapWatch, register_node,
};
use presence_core::{SlotSet, slot_of};
use presence_proto::v1::{self as pb, cluster_client::ClusterClient};
use presence_tls::{ClientTls, ClientTlsFiles};
use tokio::time::Instant;
use tonic::Status;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

use crate::cluster::peers::{PeerStream, Peers};
use crate::error::{NotOwner, ServiceError};

/// How to join a cluster: `serve --etcd ... --node-id ... --advertise ...`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClusterConfig {
    /// etcd's client URLs; the first one that answers is used.
    pub etcd: Vec<String>,
    /// This node's name, unique in the cluster.
    pub node_id: String,
    /// Where clients reach this node (host:port), as `NotOwner` names it.
    pub advertise: String,
    /// The cluster's slot count, the same on every node for its whole life.
    pub slots: u32,
    /// The keys' prefix in etcd, so that clusters can share one etcd.
    pub prefix: String,
    /// The TTL of this node's etcd lease: how long after its last confirmed
    /// keep-alive a dead or cut-off node's slots are given to others.
    pub lease_ttl: Duration,
    /// How long a new cluster waits for no more nodes to join before giving
    /// out its slots.
    pub settle: Duration,
    /// How long past its lease this node may act riding out an etcd outage
    /// that every node it knows is in too; and how long the coordinator
    /// waits, after a node's registration is gone, before it gives away the
    /// slots of a node it cannot reach (C6). The same on every node.
    pub ride_out: Duration,
    /// Whether this node, while it coordinates, evens the slots out between
    /// the live nodes by planned moves (`rebalance`).
    pub rebalance: bool,
    /// How long a move out of this node may keep its slots frozen for the
    /// target to take the last changes (C7) before it gives the freeze up
    /// and answers them here again. At most `HOLD_THROUGH_FREEZE` (250 ms),
    /// so that requests held meanwhile are answered; not a flag (0 gives
    /// every freeze up, which only a test wants).
    pub move_freeze_bound: Duration,
    /// What this node presents to the other nodes when it calls them of its
    /// own accord (handing its slots over as it drains): one of the service
    /// tokens every node accepts. `None` when the cluster runs open.
    pub peer_token: Option<String>,
    /// Node-to-node TLS, as this node dials the others: the cluster's CA,
    /// which their certificates must come from, and the certificate this
    /// node shows them. With it, nodes dial each other over `https://`,
    /// verifying each other's advertised names, and accept `Cluster` calls
    /// only from a certificate of the cluster's CA (T2).
    pub peer_tls: Option<ClientTlsFiles>,
    /// TLS to etcd (`https://` endpoints): its CA, and a client certificate
    /// for etcd's `--client-cert-auth`.
    pub etcd_tls: Option<ClientTlsFiles>,
}

impl ClusterConfig {
    /// The defaults for joining through `etcd` as `node_id`, reached at `advertise`.
    pub fn new(etcd: Vec<String>, node_id: impl Into<String>, advertise: impl Into<String>) -> Self {
        ClusterConfig {
            etcd,
            node_id: node_id.into(),
            advertise: advertise.into(),
            slots: DEFAULT_SLOTS,
            prefix: "/presenced/".to_owned(),
            lease_ttl: Duration::from_secs(5),
            settle: Duration::from_secs(2),
            ride_out: DEFAULT_RIDE_OUT,
            rebalance: true,
            move_freeze_bound: crate::cluster::handover::FREEZE_BOUND,
            peer_token: None,
            peer_tls: None,
            etcd_tls: None,
        }
    }
}

impl ClusterConfig {
    /// Refuses a configuration no cluster could run with.
    pub(crate) fn validate(&self) -> Result<(), crate::ServeError> {
        let refuse = |setting, reason| Err(crate::ServeError::Setting { setting, reason });
        if self.etcd.is_empty() {
            return refuse("cluster.etcd", "needs at least one etcd URL");
        }
        if self.node_id.is_empty() || self.node_id.len() > 128 || self.node_id.contains('/') {
            return refuse("cluster.node_id", "must be 1 to 128 bytes without '/'");
        }
        if self.advertise.is_empty() {
            return refuse("cluster.advertise", "must be the host:port clients reach this node at");
        }
        if !(1..=MAX_SLOTS).contains(&self.slots) {
            return refuse("cluster.slots", "must be between 1 and 65536");
        }
        if self.lease_ttl < Duration::from_secs(2) {
            return refuse("cluster.lease_ttl", "must be at least 2 s (etcd counts whole seconds, less a margin)");
        }
        if self.move_freeze_bound > crate::node::placement::HOLD_THROUGH_FREEZE {
            return refuse(
                "cluster.move_freeze_bound",
                "must be at most 250 ms, the time requests wait through a freeze",
            );
        }
        // Read now, so that a bad file refuses the start (B7); `join` reads them again.
        self.client_tls()?;
        Ok(())
    }

    /// The peer and etcd client TLS material, read and checked.
    pub(crate) fn client_tls(&self) -> Result<ClusterTls, crate::ServeError> {
        let load = |files: &Option<ClientTlsFiles>| {
            files.clone().map(ClientTls::load).transpose().map(|tls| tls.map(Arc::new))
        };
        Ok(ClusterTls { peer: load(&self.peer_tls)?, etcd: load(&self.etcd_tls)? })
    }
}

/// A node's client TLS material: to the other nodes, and to etcd.
#[derive(Debug)]
pub(crate) struct ClusterTls {
    peer: Option<Arc<ClientTls>>,
    etcd: Option<Arc<ClientTls>>,
}

/// The most slots a cluster may have: the slot map is read whole.
pub const MAX_SLOTS: u32 = 65_536;

pub(crate) use crate::node::placement::FORWARD_TIMEOUT;

/// `call` to node `node`, given at most `within`: its answer, or the
/// node's refusal, or `DEADLINE_EXCEEDED` naming it once the time is up.
/// The wait is bounded here rather than by a grpc-timeout, which tonic would
/// report as CANCELLED.
pub(crate) async fn call_peer<T>(
    node: &str,
    within: Duration,
    call: impl std::future::Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, ServiceError> {
    let peer = |status| ServiceError::Peer { node: node.to_owned(), status };
    match tokio::time::timeout(within, call).await {
        Ok(answered) => Ok(answered.map_err(peer)?.into_inner()),
        Err(_) => Err(peer(Status::deadline_exceeded(format!("no answer within {within:?}")))),
    }
}

/// `message` as a request to another node, carrying `credential`
/// (`authorization`), if any, and this node's protocol version (every
/// node-to-node request is made here).
pub(crate) fn with_credential<T>(message: T, credential: Option<&MetadataValue<Ascii>>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    crate::cluster::protocol::stamp(request.metadata_mut());
    if let Some(credential) = credential {
        request.metadata_mut().insert("authorization", credential.clone());
    }
    request
}

/// `--etcd-ride-out-ms`' default: an etcd outage of up to this long past
/// the lease is ridden out; a node that dies unreachable (not refusing
/// connections) is taken over this long after its lease expires.
pub(crate) const DEFAULT_RIDE_OUT: Duration = Duration::from_secs(10);

/// The most users of a forwarded Snapshot whose epochs its answer names.
const MAX_STAMPED_USERS: usize = 64;

/// An answer's mark as its owner's (see [`Membership::owner_stamp`]).
#[derive(Debug)]
pub(crate) struct OwnerStamp {
    node: MetadataValue<Ascii>,
    epochs: MetadataValue<Ascii>,
}

impl OwnerStamp {
    /// Marks the answer whose metadata is `metadata`.
    pub(crate) fn apply(self, metadata: &mut tonic::metadata::MetadataMap) {
        metadata.insert("presenced-node", self.node);
        metadata.insert("presenced-epochs", self.epochs);
    }
}

/// `--slots`' default.
pub const DEFAULT_SLOTS: u32 = 1024;

/// Taken off every confirmed lease deadline before this node stops acting:
/// covers the difference of clock rates between etcd and this node and the
/// time an answer takes to leave.
const LEASE_MARGIN: Duration = Duration::from_millis(500);

/// Why a node could not join its cluster.
#[derive(Debug, thiserror::Error)]
pub enum JoinError {
    /// No etcd endpoint answered.
    #[error("no etcd endpoint of {endpoints:?} could be reached: {last}")]
    Unreachable {
        /// The endpoints tried.
        endpoints: Vec<String>,
        /// The last one's error.
        last: presence_cluster::Error,
    },
    /// The credential for calls to the other nodes cannot be sent.
    #[error("joining the cluster: {0}")]
    Token(&'static str),
    /// etcd refused a step of joining.
    #[error("joining the cluster through etcd: {0}")]
    Etcd(#[from] presence_cluster::Error),
    /// The node-to-node or etcd TLS material cannot be used.
    #[error("joining the cluster: {0}")]
    Tls(String),
}

/// A node's part in its cluster, kept while it serves.
#[derive(Debug)]
pub(crate) struct Membership {
    node: String,
    slots: u32,
    /// Where the lease stands, read by every check: relayed from the lease
    /// in force (see [`Membership::relay`]), which changes when the node
    /// joins again after etcd said its lease was gone.
    lease_state: Arc<tokio::sync::watch::Sender<LeaseState>>,
    /// Whether etcd answers this node's keep-alives now, relayed likewise.
    etcd_answering: Arc<tokio::sync::watch::Sender<bool>>,
    /// When this node last saw etcd come back after an outage: its
    /// keep-alives were answered again, or it joined again after etcd let
    /// its lease go. The coordinator gives no gone node's slots away for a
    /// while after it (see `presence_cluster::Campaigner`).
    etcd_back: Arc<tokio::sync::watch::Sender<Option<Instant>>>,
    /// Acting past the lease while etcd is down for every node (`outage`).
    outage: Outage,
    /// The lease itself, taken to revoke it when the node leaves.
    lease: Mutex<Option<NodeLease>>,
    /// Set when the node leaves: it acts for nobody from then on.
    left: AtomicBool,
    /// Set when the node starts handing its slots over before it stops.
    draining: AtomicBool,
    map: SlotMapWatch,
    /// The slot map this node acts on: etcd's, once this node has taken in
    /// the state of the slots it gives it (C4: a dead owner's users, from the
    /// follower's copy). Requests are checked against it, never against a
    /// map whose new slots are still empty here.
    acted: tokio::sync::watch::Sender<Arc<SlotMap>>,
    /// Slots whose state a handover brought (C3) and that the map has not
    /// given this node yet: taken in already, so not taken over from a copy.
    taken_in: RwLock<SlotSet>,
    nodes: NodeSetWatch,
    peers: Arc<Peers>,
    /// How the coordinator asks a gone node to stand down (C6).
    fencer: Arc<crate::cluster::outage::Fencer>,
    /// How long past its lease this node may act riding out an outage.
    pub(crate) ride_out: Duration,
    /// This node's part in the coordinator's election, on the lease in force.
    coordinator: Mutex<Coordinator>,
    /// Where clients reach this node, as registered in etcd.
    advertise: String,
    /// How long a new cluster waits for more nodes (the coordinator's).
    settle: Duration,
    /// Whether to even the slots out while coordinating.
    pub(crate) rebalance: bool,
    /// See [`ClusterConfig::move_freeze_bound`].
    pub(crate) move_freeze_bound: Duration,
    pub(crate) etcd: Etcd,
    pub(crate) prefix: String,
    pub(crate) lease_ttl: Duration,
    /// Slots handed over, or being handed over: refused, naming no owner,
    /// whatever the slot map says, until the map gives them to another node
    /// (a slot the map shows as another's is refused anyway). Read-locked
    /// by every request from its ownership check to the end of its write,
    /// and write-locked by a handover as it adds the slots it hands over: no
    /// write checked before the handover began lands after the slots' state
    /// was taken (C3).
    leaving: RwLock<SlotSet>,
    /// Bumped whenever slots stop being refused for a move: what requests
    /// held through a freeze wait on, with the map this node acts on.
    unfrozen: tokio::sync::watch::Sender<u64>,
    /// Slots whose state a move is bringing here (C7): not answered here
    /// yet, and their copy here expires nothing.
    taking: Mutex<SlotSet>,
    /// Held as [`Membership::leaving`] is by requests whose write awaits the
    /// disk (statuses, relations), across the await.
    durable_gate: tokio::sync::RwLock<()>,
    /// One handover out of this node at a time.
    pub(crate) handing_over: tokio::sync::Mutex<()>,
    /// One handover into this node at a time (its last step).
    pub(crate) taking_in: tokio::sync::Mutex<()>,
    /// What this node presents to the others for its own calls (a drain's
    /// handover): the first service token, when there are any.
    peer_token: Option<MetadataValue<Ascii>>,
    /// Node-to-node TLS as this node dials: with it, `Cluster` calls are
    /// taken only from a certificate of the cluster's CA.
    peer_tls: Option<Arc<ClientTls>>,
    /// TLS to etcd.
    etcd_tls: Option<Arc<ClientTls>>,
}

impl Membership {
    /// The client TLS material this node dials with, by use (`peer`, `etcd`),
    /// to be read again when it changes.
    pub(crate) fn tls_material(&self) -> impl Iterator<Item = (&'static str, Arc<ClientTls>)> {
        let peer = self.peer_tls.clone().map(|tls| ("peer", tls));
        let etcd = self.etcd_tls.clone().map(|tls| ("etcd", tls));
        peer.into_iter().chain(etcd)
    }

    /// Whether `Cluster` calls need a certificate of the cluster's CA (T2):
    /// with node-to-node TLS, a service token alone does not make a node.
    pub(crate) fn requires_peer_certificate(&self) -> bool {
        self.peer_tls.is_some()
    }

    /// Joins the cluster `config` describes; the cluster's nodes allow
    /// `max_streams_per_connection` streams a connection.
    pub(crate) async fn join(config: &ClusterConfig, max_streams_per_connection: u32) -> Result<Membership, JoinError> {
        let ClusterTls { peer: peer_tls, etcd: etcd_tls } =
            config.client_tls().map_err(|err| JoinError::Tls(err.to_string()))?;
        let etcd = Etcd::connect_any(&config.etcd, etcd_tls.as_ref())
            .await
            .map_err(|last| JoinError::Unreachable { endpoints: config.etcd.clone(), last })?;
        let lease = NodeLease::grant(&etcd, config.lease_ttl, LEASE_MARGIN).await?;
        register_node(&etcd, &config.prefix, &config.node_id, &config.advertise, lease.id()).await?;
        let map = SlotMapWatch::start(&etcd, &config.prefix, config.slots).await?;
        let nodes = NodeSetWatch::start(&etcd, &config.prefix).await?;
        let peer_token = match &config.peer_token {
            Some(token) => Some(
                MetadataValue::try_from(format!("Bearer {token}"))
                    .map_err(|_| JoinError::Token("a service token must be printable ASCII"))?,
            ),
            None => None,
        };
        let peers = Arc::new(Peers::new(max_streams_per_connection, peer_tls.clone()));
        let fencer = Arc::new(crate::cluster::outage::Fencer {
            node: config.node_id.clone(),
            peers: Arc::clone(&peers),
            peer_token: peer_token.clone(),
        });
        let etcd_back = Arc::new(tokio::sync::watch::Sender::new(None));
        let campaigner =
            campaigner(&config.node_id, config.settle, &etcd_back, config.lease_ttl, config.ride_out, &fencer);
        let coordinator = Coordinator::start(&etcd, &config.prefix, config.slots, &lease, campaigner);
        tracing::info!(
            node = config.node_id,
            advertise = config.advertise,
            slots = config.slots,
            lease = lease.id(),
            "joined the cluster"
        );
        let membership = Membership {
            node: config.node_id.clone(),
            slots: config.slots,
            lease_state: Arc::new(tokio::sync::watch::Sender::new(lease.state())),
            etcd_answering: Arc::new(tokio::sync::watch::Sender::new(true)),
            etcd_back,
            outage: Outage::default(),
            lease: Mutex::new(None),
            left: AtomicBool::new(false),
            draining: AtomicBool::new(false),
            acted: tokio::sync::watch::Sender::new(map.current()),
            taken_in: RwLock::new(SlotSet::new(config.slots)),
            map,
            nodes,
            peers,
            fencer,
            ride_out: config.ride_out,
            peer_tls,
            etcd_tls,
            coordinator: Mutex::new(coordinator),
            advertise: config.advertise.clone(),
            settle: config.settle,
            rebalance: config.rebalance,
            move_freeze_bound: config.move_freeze_bound,
            etcd,
            prefix: config.prefix.clone(),
            lease_ttl: config.lease_ttl,
            leaving: RwLock::new(SlotSet::new(config.slots)),
            unfrozen: tokio::sync::watch::Sender::new(0),
            taking: Mutex::new(SlotSet::new(config.slots)),
            durable_gate: tokio::sync::RwLock::new(()),
            handing_over: tokio::sync::Mutex::new(()),
            taking_in: tokio::sync::Mutex::new(()),
            peer_token,
        };
        membership.relay(lease);
        Ok(membership)
    }

    /// What this node owns as of now, to check a request (or a whole batch) against.
    pub(crate) fn view(&self) -> OwnershipView<'_> {
        OwnershipView {
            // Taken first: a handover that starts refusing a slot waits
            // for every view taken before, and every later view sees it.
            leaving: self.leaving.read(),
            taken_in: self.taken_in.read(),
            node: &self.node,
            slots: self.slots,
            acting: self.is_acting(Instant::now()),
            map: self.acted_map(),
            latest: self.map(),
            nodes: self.nodes.current(),
        }
    }

    /// Held (read) by a request whose write awaits the disk from before its
    /// ownership check to the end of its write (see [`Membership::leaving`]).
    pub(crate) fn durable_gate(&self) -> &tokio::sync::RwLock<()> {
        &self.durable_gate
    }

    /// Asks the node at `address` for a Snapshot of `user_ids`, for the same
    /// viewer and with the caller's own credentials, so that the owner
    /// applies its privacy rules to the caller as if asked directly (C2).
    pub(crate) async fn forward_snapshot(
        &self,
        address: &str,
        user_ids: Vec<String>,
        viewer_id: &str,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<Vec<pb::UserPresence>, ServiceError> {
        let mut client = self.peers.client(address)?;
        let request = forwarded(pb::SnapshotRequest { user_ids, viewer_id: viewer_id.to_owned() }, authorization);
        Ok(call_peer(address, FORWARD_TIMEOUT, client.snapshot(request)).await?.users)
    }

    /// Sends lease items held through a freeze to the node at `address`,
    /// which owns their users now (C7), with the caller's credentials.
    pub(crate) async fn forward_leases(
        &self,
        address: &str,
        batch: pb::LeaseBatch,
        authorization: Option<MetadataValue<Ascii>>,
    ) -> Result<pb::LeaseResults, ServiceError> {
        let mut client = self.peers.client(address)?;
        let request = forwarded(tokio_stream::iter([batch]), authorization.as_ref());
        let mut results = call_peer(address, FORWARD_TIMEOUT, client.leases(request)).await?;
        let peer = |status| ServiceError::Peer { node: address.to_owned(), status };
        let answered = tokio::time::timeout(FORWARD_TIMEOUT, results.message()).await;
        match answered {
            Ok(Ok(Some(results))) => Ok(results),
            Ok(Ok(None)) => Err(peer(Status::unavailable("the stream ended without results"))),
            Ok(Err(status)) => Err(peer(status)),
            Err(_) => Err(peer(Status::deadline_exceeded(format!("no results within {FORWARD_TIMEOUT:?}")))),
        }
    }

    /// Opens a Watch at the node at `address` for the caller, as
    /// [`Membership::forward_snapshot`] asks for a Snapshot.
    pub(crate) async fn forward_watch(
        &self,
        address: &str,
        request: pb::WatchRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<PeerStream<pb::WatchEvent>, ServiceError> {
        let (mut client, place) = self.peers.stream_client(address)?;
        let stream = call_peer(address, FORWARD_TIMEOUT, client.watch(forwarded(request, authorization))).await?;
        Ok(PeerStream::new(stream, place))
    }

    /// Asks the room's owner at `address` for a RoomSnapshot, for the caller
    /// and with its credentials (C1).
    pub(crate) async fn forward_room_snapshot(
        &self,
        address: &str,
        request: pb::RoomSnapshotRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::RoomSnapshot, ServiceError> {
        let mut client = self.peers.client(address)?;
        call_peer(address, FORWARD_TIMEOUT, client.room_snapshot(forwarded(request, authorization))).await
    }

    /// Asks the room's owner at `address` to set the room's access, for the
    /// caller and with its credentials (C1).
    pub(crate) async fn forward_set_room_access(
        &self,
        address: &str,
        request: pb::SetRoomAccessRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::SetRoomAccessResponse, ServiceError> {
        let mut client = self.peers.client(address)?;
        call_peer(address, FORWARD_TIMEOUT, client.set_room_access(forwarded(request, authorization))).await
    }

    /// Asks the user's owner at `address` for an ExportUser, with the
    /// caller's credentials (P7). The owner asks every node in turn, so this
    /// waits for twice the forwarding time.
    pub(crate) async fn forward_export_user(
        &self,
        address: &str,
        request: pb::ExportUserRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::ExportUserResponse, ServiceError> {
        let mut client = self.peers.client(address)?;
        call_peer(address, 2 * FORWARD_TIMEOUT, client.export_user(forwarded(request, authorization))).await
    }

    /// Asks the user's owner at `address` to erase it, with the caller's
    /// credentials (P7), waiting as [`Membership::forward_export_user`] does.
    pub(crate) async fn forward_erase_user(
        &self,
        address: &str,
        request: pb::EraseUserRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::EraseUserResponse, ServiceError> {
        let mut client = self.peers.client(address)?;
        call_peer(address, 2 * FORWARD_TIMEOUT, client.erase_user(forwarded(request, authorization))).await
    }

    /// Opens a WatchRoom at the room's owner at `address`, as
    /// [`Membership::forward_room_snapshot`] asks for a RoomSnapshot.
    pub(crate) async fn forward_watch_room(
        &self,
        address: &str,
        request: pb::WatchRoomRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<PeerStream<pb::RoomEvent>, ServiceError> {
        let (mut client, place) = self.peers.stream_client(address)?;
        let stream = call_peer(address, FORWARD_TIMEOUT, client.watch_room(forwarded(request, authorization))).await?;
        Ok(PeerStream::new(stream, place))
    }

    /// What may end this node's right to act for some user: the slot map's
    /// changes, the lease's, and the instant the lease lapses unless etcd
    /// confirms it again.
    pub(crate) fn changes(&self) -> OwnershipChanges {
        OwnershipChanges {
            map: self.acted.subscribe(),
            lease: self.lease_state.subscribe(),
            extension: self.outage.extensions(),
        }
    }

    /// Leaves the cluster at a planned stop: the lease is revoked, so that
    /// the coordinator gives this node's slots to the others at once rather
    /// than a TTL later.
    pub(crate) async fn leave(&self) {
        self.left.store(true, Ordering::Release);
        let Some(lease) = self.lease.lock().take() else { return };
        let node = &self.node;
        match lease.revoke().await {
            Ok(()) => tracing::info!(node, "left the cluster: lease revoked"),
            Err(error) => tracing::warn!(node, %error, "could not revoke the lease; it expires by its TTL"),
        }
    }

    /// Whether this node may act on its slots at `now`: it has not left, and
    /// etcd confirmed its lease recently enough, or etcd is down for every
    /// node and the others' answers let it act on (`outage`).
    fn is_acting(&self, now: Instant) -> bool {
        !self.left.load(Ordering::Acquire)
            && acting_until(*self.lease_state.borrow(), self.outage.extended_until()).is_some_and(|until| now < until)
    }

    /// Whether etcd answers this node's keep-alives now.
    pub(crate) fn etcd_answers(&self) -> bool {
        *self.etcd_answering.borrow()
    }

    /// Changes of [`Membership::etcd_answers`], to wait on.
    pub(crate) fn etcd_answering(&self) -> tokio::sync::watch::Receiver<bool> {
        self.etcd_answering.subscribe()
    }

    /// Whether this node is the coordinator, as far as it knows.
    pub(crate) fn is_coordinator(&self) -> bool {
        self.coordinator.lock().is_leading()
    }

    /// Whether this node is handing its slots to the others before it stops:
    /// it takes none meanwhile.
    pub(crate) fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Acquire)
    }

    /// Notes that this node drains: it takes no slot from now on.
    pub(crate) fn start_draining(&self) {
        self.draining.store(true, Ordering::Release);
    }

    /// Whether etcd said this node's lease is gone.
    pub(crate) fn lease_lost(&self) -> bool {
        matches!(*self.lease_state.borrow(), LeaseState::Lost)
    }

    /// Changes of the lease in force's state, to wait on.
    pub(crate) fn lease_changes(&self) -> tokio::sync::watch::Receiver<LeaseState> {
        self.lease_state.subscribe()
    }

    /// Makes `lease` the one in force: its state and whether etcd answers it
    /// are relayed to every check from now on, until it is dropped. They are
    /// published once here, before this returns, so that whoever looks next
    /// sees this lease's state, not the lost one's.
    fn relay(&self, lease: NodeLease) {
        let (mut state, mut answering) = (lease.subscribe(), lease.answering());
        let mut relayed = Relayed {
            state: Arc::clone(&self.lease_state),
            answering: Arc::clone(&self.etcd_answering),
            etcd_back: Arc::clone(&self.etcd_back),
            outage_after: self.lease_ttl / 2,
            silent_since: None,
        };
        relayed.publish(*state.borrow_and_update(), *answering.borrow_and_update());
        // A new lease, its registration made: a coordinator that finds it
        // gone later asks this node again.
        self.outage.resume();
        tokio::spawn(async move {
            loop {
                relayed.publish(*state.borrow_and_update(), *answering.borrow_and_update());
                // Ends when the lease's keeper stops: it was dropped, or etcd said it was gone.
                tokio::select! {
                    changed = state.changed() => if changed.is_err() { break },
                    changed = answering.changed() => if changed.is_err() { break },
                }
            }
            // The keeper's last word (`Lost`) may have come with its end: the
            // branch that saw the end may be the one whose value had not
            // changed, so the last state is published here, or the node
            // would never learn that its lease is gone and join again.
            relayed.publish(*state.borrow(), *answering.borrow());
        });
        *self.lease.lock() = Some(lease);
    }

    /// Joins the cluster again after etcd said this node's lease was gone:
    /// a new lease, the node's registration under it, a new campaign. The
    /// node acts again only once the map it acts on has every change etcd's
    /// map had after the registration: every slot given away while it was
    /// gone is then in it, and none can be given away after (a claim of a
    /// gone owner's slot requires that owner not to be registered).
    /// Returns the registration's revision.
    async fn join_again(&self) -> Result<i64, presence_cluster::Error> {
        let lease = NodeLease::grant(&self.etcd, self.lease_ttl, LEASE_MARGIN).await?;
        let revision = register_node(&self.etcd, &self.prefix, &self.node, &self.advertise, lease.id()).await?;
        // etcd let this node's lease go: it may have let the others' go too
        // (it was away longer than the TTL), and they are joining again.
        self.etcd_back.send_replace(Some(Instant::now()));
        let campaigner =
            campaigner(&self.node, self.settle, &self.etcd_back, self.lease_ttl, self.ride_out, &self.fencer);
        *self.coordinator.lock() = Coordinator::start(&self.etcd, &self.prefix, self.slots, &lease, campaigner);
        // The map as etcd holds it after the registration; the map this node
        // acts on follows etcd's view of it (replica::act_on_the_map).
        let caught_up = SlotMap::load(&self.etcd, &self.prefix, self.slots).await?.latest_epoch();
        let mut acted = self.acted.subscribe();
        while acted.borrow_and_update().revision() < caught_up {
            if acted.changed().await.is_err() {
                break;
            }
        }
        self.relay(lease);
        Ok(revision)
    }

    /// What marks a forwarded request's answer as this node's, as owner of
    /// its users' slots: `presenced-node` (this node's id) and
    /// `presenced-epochs` (each user's slot epoch, in request order), so that
    /// whoever asked can tell which node answered for which ownership (C6's
    /// test reads them). Taken before the request's ownership check, from the
    /// map this node acts on, and only when that map gives this node every
    /// user: the check that follows then finds the same ownership. `None`
    /// for more than [`MAX_STAMPED_USERS`] users (a header of thousands of
    /// epochs would pass HTTP/2's header list limit and fail the answer).
    pub(crate) fn owner_stamp<S: AsRef<[u8]>>(&self, user_ids: &[S]) -> Option<OwnerStamp> {
        if user_ids.len() > MAX_STAMPED_USERS {
            return None;
        }
        let map = self.acted_map();
        let epochs: Option<Vec<String>> = user_ids
            .iter()
            .map(|user| map.owner(slot_of(user, self.slots)).filter(|owner| owner.node == self.node))
            .map(|owner| owner.map(|owner| owner.epoch.to_string()))
            .collect();
        // Node ids and numbers are printable ASCII; a node id that is not goes unstamped.
        Some(OwnerStamp {
            node: MetadataValue::try_from(self.node.as_str()).ok()?,
            epochs: MetadataValue::try_from(epochs?.join(",")).ok()?,
        })
    }

    /// Stops acting past the lease at the coordinator's word (C6), and
    /// returns once every request that passed its ownership check before
    /// has written, as a handover waits for them (`start_leaving`).
    pub(crate) async fn stand_down(&self) {
        self.outage.stand_down();
        let _durable = self.durable_gate.write().await;
        drop(self.leaving.write());
    }

    /// This node's part in riding out etcd outages.
    pub(crate) fn outage(&self) -> &Outage {
        &self.outage
    }

    /// This node's id.
    pub(crate) fn node(&self) -> &str {
        &self.node
    }

    /// The cluster's slot count.
    pub(crate) fn slot_count(&self) -> u32 {
        self.slots
    }

    /// The slot map as last seen.
    pub(crate) fn map(&self) -> Arc<SlotMap> {
        self.map.current()
    }

    /// Changes of the slot map, to wait on.
    pub(crate) fn map_changes(&self) -> tokio::sync::watch::Receiver<Arc<SlotMap>> {
        self.map.subscribe()
    }

    /// The slot map this node acts on (see [`Membership::acted`]).
    pub(crate) fn acted_map(&self) -> Arc<SlotMap> {
        self.acted.borrow().clone()
    }

    /// Changes of the slot map this node acts on, to wait on.
    pub(crate) fn acted_changes(&self) -> tokio::sync::watch::Receiver<Arc<SlotMap>> {
        self.acted.subscribe()
    }

    /// Acts on `map` from now on: the state of every slot it gives this node is here.
    pub(crate) fn act_on(&self, map: Arc<SlotMap>) {
        self.acted.send_replace(map);
    }

    /// Notes that a handover brought the state of `slots` (C3).
    pub(crate) fn note_taken_in(&self, slots: &SlotSet) {
        let mut taken_in = self.taken_in.write();
        slots.iter().for_each(|slot| taken_in.insert(slot));
    }

    /// Whether `slot` is being, or was, handed over from this node.
    pub(crate) fn is_leaving(&self, slot: u32) -> bool {
        self.leaving.read().contains(slot)
    }

    /// Whether a handover brought `slot`'s state (and the map has not given it yet).
    pub(crate) fn was_taken_in(&self, slot: u32) -> bool {
        self.taken_in.read().contains(slot)
    }

    /// Forgets that a handover brought `slot`'s state; returns whether one had.
    pub(crate) fn forget_taken_in(&self, slot: u32) -> bool {
        let mut taken_in = self.taken_in.write();
        let had = taken_in.contains(slot);
        taken_in.remove(slot);
        had
    }

    /// The live nodes as last seen.
    pub(crate) fn nodes(&self) -> Arc<NodeSet> {
        self.nodes.current()
    }

    /// The live nodes, each time they change.
    pub(crate) fn node_changes(&self) -> tokio::sync::watch::Receiver<Arc<NodeSet>> {
        self.nodes.subscribe()
    }

    /// The live nodes' ids as last seen, this node's among them even while
    /// its registration is gone (etcd let its lease go and it is joining
    /// again): it still runs, and holds what it holds.
    pub(crate) fn live_ids(&self) -> Vec<String> {
        let mut ids = self.nodes().ids();
        if let Err(at) = ids.binary_search_by(|id| id.as_str().cmp(&self.node)) {
            ids.insert(at, self.node.clone());
        }
        ids
    }

    /// Every other live node as last seen, with its address.
    pub(crate) fn others(&self) -> Vec<(String, String)> {
        let nodes = self.nodes();
        let others = nodes.ids().into_iter().filter(|node| node != self.node());
        others.filter_map(|node| nodes.address(&node).map(str::to_owned).map(|address| (node, address))).collect()
    }

    /// Whether this node may act on its slots now.
    pub(crate) fn acting_now(&self) -> bool {
        self.is_acting(Instant::now())
    }

    /// Whether `map` gives `slot` to this node.
    pub(crate) fn owns(&self, map: &SlotMap, slot: u32) -> bool {
        map.owner(slot).is_some_and(|owner| owner.node == self.node)
    }

    /// Starts refusing every request for `slots` (C3), once every request
    /// that passed its ownership check before has written; returns the slots
    /// whose expiry is held back from now on ([`Membership::expiry_held`]).
    pub(crate) async fn start_leaving(&self, slots: &SlotSet) -> Arc<SlotSet> {
        let _durable = self.durable_gate.write().await;
        let mut leaving = self.leaving.write();
        slots.iter().for_each(|slot| leaving.insert(slot));
        drop(leaving);
        self.expiry_held()
    }

    /// Stops refusing `slots` for being handed over: a handover that failed,
    /// or slots coming back to this node. Returns the slots whose expiry is
    /// still held back.
    pub(crate) fn stop_leaving(&self, slots: &SlotSet) -> Arc<SlotSet> {
        let mut leaving = self.leaving.write();
        slots.iter().for_each(|slot| leaving.remove(slot));
        drop(leaving);
        self.unfrozen.send_modify(|count| *count += 1);
        self.expiry_held()
    }

    /// Notes that a move is bringing `slots`' state here (C7); returns the
    /// slots whose expiry is held back from now on.
    pub(crate) fn start_taking(&self, slots: &SlotSet) -> Arc<SlotSet> {
        let mut taking = self.taking.lock();
        slots.iter().for_each(|slot| taking.insert(slot));
        drop(taking);
        self.expiry_held()
    }

    /// Notes that no move brings `slots`' state here any more (it came
    /// whole, or the move ended); returns the slots whose expiry is held back.
    pub(crate) fn stop_taking(&self, slots: &SlotSet) -> Arc<SlotSet> {
        let mut taking = self.taking.lock();
        slots.iter().for_each(|slot| taking.remove(slot));
        drop(taking);
        self.expiry_held()
    }

    /// The slots whose users' expiry this node holds back: those it refuses
    /// for a move out of it, and those a move is bringing in.
    pub(crate) fn expiry_held(&self) -> Arc<SlotSet> {
        let mut held = self.leaving.read().clone();
        self.taking.lock().iter().for_each(|slot| held.insert(slot));
        Arc::new(held)
    }

    /// Returns once none of `slots` is frozen for a move (see
    /// [`Frozen`]), or at `deadline`; returns whether some still is then.
    pub(crate) async fn freeze_over(&self, slots: &[u32], deadline: Instant) -> bool {
        let mut unfrozen = self.unfrozen.subscribe();
        let mut acted = self.acted_changes();
        let mut latest = self.map_changes();
        let frozen = |membership: &Membership| {
            let frozen = Frozen {
                node: &membership.node,
                acted: &membership.acted_map(),
                latest: &membership.map(),
                leaving: &membership.leaving.read(),
                taken_in: &membership.taken_in.read(),
            };
            slots.iter().any(|&slot| frozen.holds(slot))
        };
        while frozen(self) {
            tokio::select! {
                _ = unfrozen.changed() => {}
                _ = acted.changed() => {}
                _ = latest.changed() => {}
                () = tokio::time::sleep_until(deadline) => return frozen(self),
            }
        }
        false
    }

    /// A client of the Cluster service of the node at `address`.
    pub(crate) fn cluster_client(&self, address: &str) -> Result<ClusterClient<Channel>, ServiceError> {
        Ok(ClusterClient::new(self.peers.channel(address)?))
    }

    /// The credential for a call this node makes of its own accord.
    pub(crate) fn peer_token(&self) -> Option<&MetadataValue<Ascii>> {
        self.peer_token.as_ref()
    }
}

/// Joins the cluster again whenever etcd says this node's lease is gone
/// (it was cut off from etcd, or etcd was away, for longer than the TTL),
/// trying every second until etcd takes the new registration; until the
/// server stops or the node leaves. Meanwhile the node acts for nobody.
pub(crate) async fn join_again_when_lost(
    context: Arc<crate::node::context::Context>,
    cluster: Arc<super::ClusterNode>,
) {
    let membership = &cluster.membership;
    let mut state = membership.lease_state.subscribe();
    loop {
        while !matches!(*state.borrow_and_update(), LeaseState::Lost) {
            tokio::select! {
                changed = state.changed() => if changed.is_err() { return },
                () = context.stopping.cancelled() => return,
            }
        }
        if membership.left.load(Ordering::Acquire) {
            return;
        }
        let node = membership.node();
        tracing::warn!(node, "etcd says this node's lease is gone: joining the cluster again under a new one");
        loop {
            let joined = tokio::select! {
                joined = membership.join_again() => joined,
                () = context.stopping.cancelled() => return,
            };
            match joined {
                Ok(revision) => {
                    tracing::info!(
                        node,
                        revision,
                        "joined the cluster again; acting on the slots the map gives this node"
                    );
                    break;
                }
                Err(error) => {
                    tracing::warn!(node, %error, "could not join the cluster again; trying again in a second");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }
}

/// This node as a campaigner for coordinator: a node whose lease etcd let
/// go in an outage learns it at its next keep-alive (a third of the TTL)
/// and joins again at once, so a whole TTL after etcd came back every node
/// still running has.
fn campaigner(
    node: &str,
    settle: Duration,
    etcd_back: &tokio::sync::watch::Sender<Option<Instant>>,
    lease_ttl: Duration,
    ride_out: Duration,
    fencer: &Arc<crate::cluster::outage::Fencer>,
) -> Campaigner {
    // The ride-out is counted from the lease's own deadline, which comes
    // before etcd expires the lease (`LEASE_MARGIN`); the margin added here
    // covers clock rates over the ride-out itself.
    let ride_out = ride_out + ride_out / 20 + LEASE_MARGIN;
    let fencing: Arc<dyn presence_cluster::Fencing> = fencer.clone();
    Campaigner {
        node: node.to_owned(),
        settle,
        etcd_back: etcd_back.subscribe(),
        rejoin_grace: lease_ttl,
        ride_out,
        lease_ttl,
        fencing: Some(fencing),
    }
}

/// Where the lease in force's state is relayed to.
struct Relayed {
    state: Arc<tokio::sync::watch::Sender<LeaseState>>,
    answering: Arc<tokio::sync::watch::Sender<bool>>,
    etcd_back: Arc<tokio::sync::watch::Sender<Option<Instant>>>,
    /// How long etcd must leave this node unanswered for its answering
    /// again to count as coming back from an outage: half the TTL. A
    /// shorter silence let no lease go (every node renews every third of
    /// the TTL), and a slow answer or two must not hold repairs back.
    outage_after: Duration,
    /// Since when etcd has not answered this node's keep-alives.
    silent_since: Option<Instant>,
}

impl Relayed {
    /// Publishes the lease's state and whether etcd answers it, and notes
    /// etcd coming back after an outage.
    fn publish(&mut self, state: LeaseState, answering: bool) {
        self.state.send_replace(state);
        self.answering.send_replace(answering);
        let now = Instant::now();
        if !answering {
            self.silent_since.get_or_insert(now);
        } else if let Some(since) = self.silent_since.take()
            && now.duration_since(since) >= self.outage_after
        {
            self.etcd_back.send_replace(Some(now));
        }
    }
}

/// `message` as a request forwarded to another node: marked so, with the caller's credentials.
fn forwarded<T>(message: T, authorization: Option<&MetadataValue<Ascii>>) -> tonic::Request<T> {
    let mut request = with_credential(message, authorization);
    request.metadata_mut().insert(FORWARDED, MetadataValue::from_static("1"));
    request
}

/// Until when a node whose lease stands at `lease` may act, given the
/// extension the others' answers gave it during an etcd outage: `None` once
/// etcd said the lease is gone.
fn acting_until(lease: LeaseState, extended_until: Option<Instant>) -> Option<Instant> {
    match lease {
        LeaseState::ValidUntil(until) => Some(extended_until.map_or(until, |extended| extended.max(until))),
        LeaseState::Lost => None,
    }
}

/// Waits for changes of a node's ownership (see [`Membership::changes`]).
#[derive(Debug)]
pub(crate) struct OwnershipChanges {
    map: tokio::sync::watch::Receiver<Arc<SlotMap>>,
    lease: tokio::sync::watch::Receiver<LeaseState>,
    extension: tokio::sync::watch::Receiver<Option<Instant>>,
}

impl OwnershipChanges {
    /// Returns once the map, the lease or its extension changed, or the
    /// right to act lapsed.
    pub(crate) async fn changed(&mut self) {
        // Lost: nothing lapses; acting again comes with a new lease (a change).
        let lapses = acting_until(*self.lease.borrow(), *self.extension.borrow());
        let lapsed = async {
            match lapses {
                Some(lapses) => tokio::time::sleep_until(lapses).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            changed = self.map.changed() => if changed.is_err() { std::future::pending::<()>().await },
            changed = self.lease.changed() => if changed.is_err() { std::future::pending::<()>().await },
            changed = self.extension.changed() => if changed.is_err() { std::future::pending::<()>().await },
            () = lapsed => {}
        }
    }
}

/// This node's ownership at one instant: the slots `map` gives `node`, if
/// `acting`, less those `leaving`.
#[derive(Debug)]
pub(crate) struct OwnershipView<'a> {
    node: &'a str,
    slots: u32,
    acting: bool,
    map: Arc<SlotMap>,
    /// The map as last seen, which this node may not act on yet.
    latest: Arc<SlotMap>,
    nodes: Arc<NodeSet>,
    leaving: RwLockReadGuard<'a, SlotSet>,
    taken_in: RwLockReadGuard<'a, SlotSet>,
}

/// Whether a slot is frozen for a move (C7) at one node: a request for it
/// waits the freeze out there (`HOLD_THROUGH_FREEZE`) instead of being
/// refused. At the source, from the freeze until the map it acts on gives
/// the slot away; at the target, from taking the slot's state (or seeing
/// the map give it the slot) until it acts on a map that gives it.
struct Frozen<'a> {
    node: &'a str,
    acted: &'a SlotMap,
    latest: &'a SlotMap,
    leaving: &'a SlotSet,
    taken_in: &'a SlotSet,
}

impl Frozen<'_> {
    fn holds(&self, slot: u32) -> bool {
        let owns = |map: &SlotMap| map.owner(slot).is_some_and(|owner| owner.node == self.node);
        if owns(self.acted) { self.leaving.contains(slot) } else { self.taken_in.contains(slot) || owns(self.latest) }
    }
}

impl OwnershipView<'_> {
    /// `Ok` when this node may act for `user_id` now; else the refusal that
    /// names the owner.
    pub(crate) fn check(&self, user_id: impl AsRef<[u8]>) -> Result<(), ServiceError> {
        let OwnershipView { node, slots, acting, map, latest, nodes, leaving, taken_in } = self;
        if user_id.as_ref().is_empty() {
            // Any node refuses it as INVALID_ARGUMENT, naming the field.
            return Ok(());
        }
        let slot = slot_of(user_id, *slots);
        let owner = map.owner(slot);
        let mine = owner.is_some_and(|owner| owner.node == *node);
        if mine && *acting && !leaving.contains(slot) {
            return Ok(());
        }
        // Not ours; or ours, but etcd has not confirmed our lease in time,
        // so another node may be about to get it, or ours but being handed
        // over: no owner to name.
        let named = owner.filter(|_| !mine);
        Err(ServiceError::NotOwner(NotOwner {
            slot,
            epoch: owner.map_or(0, |owner| owner.epoch),
            owner_id: named.map(|owner| owner.node.clone()).unwrap_or_default(),
            owner_addr: named.and_then(|owner| nodes.address(&owner.node)).unwrap_or_default().to_owned(),
            frozen: *acting && Frozen { node, acted: map, latest, leaving, taken_in }.holds(slot),
        }))
    }

    /// Which of `user_ids` this node answers itself and which each other
    /// node does, by index: `None` when this node answers them all. Refused when some user's slot
    /// has no owner that may act now, or when `forwarded` (a node's forwarded
    /// request, which is never sent on again) and some user is not this node's.
    pub(crate) fn route<S: AsRef<str>>(&self, user_ids: &[S], forwarded: bool) -> Result<Option<Routes>, ServiceError> {
        let mut routes = Routes::default();
        for (index, user_id) in user_ids.iter().enumerate() {
            match self.check(user_id.as_ref()) {
                Ok(()) => routes.local.push(index),
                Err(ServiceError::NotOwner(not_owner)) if !forwarded && !not_owner.owner_addr.is_empty() => {
                    routes.remote.entry(not_owner.owner_addr).or_default().push(index);
                }
                Err(refusal) => return Err(refusal),
            }
        }
        Ok((!routes.remote.is_empty()).then_some(routes))
    }

    /// [`OwnershipView::check`] of every user of a request.
    pub(crate) fn check_all<S: AsRef<str>>(&self, user_ids: &[S]) -> Result<(), ServiceError> {
        user_ids.iter().try_for_each(|user_id| self.check(user_id.as_ref()))
    }
}

/// Where the users of one request are answered: here, or at other nodes
/// (by advertised address), as indices into the request's list.
#[derive(Debug, Default)]
pub(crate) struct Routes {
    pub(crate) local: Vec<usize>,
    pub(crate) remote: std::collections::BTreeMap<String, Vec<usize>>,
}

/// The metadata a node adds to a request it forwards to another node: that
/// node answers for its own users only and forwards nothing.
pub(crate) const FORWARDED: &str = "presenced-forwarded";

/// `slots` of a cluster of `slot_count`, checked against this one's.
pub(crate) fn slot_set(membership: &Membership, slots: &[u32], slot_count: u32) -> Result<SlotSet, ServiceError> {
    let count = membership.slot_count();
    if slot_count != count {
        return Err(ServiceError::invalid("slot_count", format!("{slot_count}, but this cluster has {count} slots")));
    }
    checked_slots(count, slots)
}

/// `slots` as a set, once each is one of the cluster's `count` and there is one at least.
pub(crate) fn checked_slots(count: u32, slots: &[u32]) -> Result<SlotSet, ServiceError> {
    if slots.is_empty() {
        return Err(ServiceError::invalid("slots", "name at least one slot"));
    }
    if let Some(bad) = slots.iter().find(|&&slot| slot >= count) {
        return Err(ServiceError::invalid("slots", format!("{bad} is not one of the cluster's {count} slots")));
    }
    Ok(SlotSet::of(count, slots.iter().copied()))
}

/// How long past the send time of a round that every other node answered
/// "etcd does not answer me either" the node may act.
pub(crate) const EXTENSION: Duration = Duration::from_millis(1_000);

/// How long a node that answered "etcd does not answer me" takes over no
/// other node's slots: the extension and a margin for clock rates.
pub(crate) const PROMISE: Duration = Duration::from_millis(1_500);

/// A node's part in riding out etcd outages.
#[derive(Debug)]
pub(crate) struct Outage {
    /// Until when the others' answers let this node act past its lease.
    extended_until: tokio::sync::watch::Sender<Option<Instant>>,
    /// Until when this node promised the others to take over no slot.
    no_takeover_before: Mutex<Option<Instant>>,
    /// Set when the coordinator, which etcd answers, asked this node to
    /// stand down: no extension until etcd answers this node again.
    stood_down: AtomicBool,
    /// Gone nodes the coordinator is about to take over, each with until
    /// when this node gives it no word that etcd does not answer here, and
    /// the revision of this node's view of the node set then: a
    /// registration made after it is the node joined again, which acts
    /// only on its new lease, and the vow is over.
    withheld: Mutex<HashMap<String, (Instant, i64)>>,
}

impl Default for Outage {
    fn default() -> Self {
        Outage {
            extended_until: tokio::sync::watch::Sender::new(None),
            no_takeover_before: Mutex::new(None),
            stood_down: AtomicBool::new(false),
            withheld: Mutex::new(HashMap::new()),
        }
    }
}

impl Outage {
    /// Until when the others' answers let this node act past its lease.
    pub(crate) fn extended_until(&self) -> Option<Instant> {
        *self.extended_until.borrow()
    }

    /// Changes of [`Outage::extended_until`], to wait on.
    pub(crate) fn extensions(&self) -> tokio::sync::watch::Receiver<Option<Instant>> {
        self.extended_until.subscribe()
    }

    pub(crate) fn extend_to(&self, until: Instant) {
        self.extended_until.send_if_modified(|extended| {
            // Checked under the channel's lock, which `stand_down` takes
            // too: no extension lands after a stand-down.
            if self.stood_down.load(Ordering::Acquire) {
                return false;
            }
            let later = extended.is_none_or(|extended| extended < until);
            if later {
                *extended = Some(until);
            }
            later
        });
    }

    /// Ends any extension, and refuses new ones until [`Outage::resume`].
    pub(crate) fn stand_down(&self) {
        self.extended_until.send_modify(|extended| {
            self.stood_down.store(true, Ordering::Release);
            *extended = None;
        });
    }

    /// Whether a coordinator asked this node to stand down since etcd last answered it.
    pub(crate) fn stood_down(&self) -> bool {
        self.stood_down.load(Ordering::Acquire)
    }

    /// etcd answers this node again: a later outage may be ridden out.
    pub(crate) fn resume(&self) {
        self.stood_down.store(false, Ordering::Release);
    }

    /// Promises to take over no slot of another node until `now` + [`PROMISE`].
    pub(crate) fn promise(&self, now: Instant) {
        let until = now + PROMISE;
        let mut promised = self.no_takeover_before.lock();
        if promised.is_none_or(|promised| promised < until) {
            *promised = Some(until);
        }
    }

    /// Whether a promise this node made is in force at `now`.
    pub(crate) fn holds_promise(&self, now: Instant) -> bool {
        self.no_takeover_before.lock().is_some_and(|until| now < until)
    }

    /// Gives `nodes` no word that etcd does not answer this node until
    /// `until` (the coordinator's question before a takeover, C4), and
    /// returns whether a promise this node made is in force. An earlier vow
    /// never shortens a later one. Under the same lock as
    /// [`Outage::give_word`]: a word is either given before the vow, and its
    /// promise counted here, or refused after it.
    pub(crate) fn withhold(&self, nodes: &[String], until: Instant, view_revision: i64) -> bool {
        let mut withheld = self.withheld.lock();
        let now = Instant::now();
        withheld.retain(|_, (vowed, _)| now < *vowed);
        for node in nodes {
            let (vowed, revision) = withheld.entry(node.clone()).or_insert((until, view_revision));
            *vowed = (*vowed).max(until);
            *revision = (*revision).max(view_revision);
        }
        self.holds_promise(now)
    }

    /// Gives `node` the word that etcd does not answer this node, with the
    /// promise that comes with it ([`Outage::promise`]), unless this node
    /// vowed not to and `node` has not registered again since
    /// (`registered_at`, the revision of its registration in this node's
    /// view); returns whether it did.
    pub(crate) fn give_word(&self, node: &str, registered_at: Option<i64>) -> bool {
        let withheld = self.withheld.lock();
        let now = Instant::now();
        let vowed = withheld.get(node).is_some_and(|&(until, revision)| {
            now < until && registered_at.is_none_or(|registered| registered <= revision)
        });
        if vowed {
            return false;
        }
        self.promise(now);
        true
    }

    /// Returns once every promise this node made has run out.
    pub(crate) async fn promises_kept(&self) {
        loop {
            let until = *self.no_takeover_before.lock();
            match until {
                Some(until) if Instant::now() < until => tokio::time::sleep_until(until).await,
                _ => return,
            }
        }
    }
}

impl crate::node::placement::UserCheck for OwnershipView<'_> {
    fn check(&self, user_id: &[u8]) -> Result<(), ServiceError> {
        OwnershipView::check(self, user_id)
    }
}
