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

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use parking_lot::{Mutex, RwLock, RwLockReadGuard};
use presence_cluster::{
    Campaigner, Coordinator, Etcd, LeaseState, NodeLease, NodeSet, NodeSetWatch, SlotMap, SlotMapWatch, register_node,
};
use presence_core::{SlotSet, slot_of};
use presence_proto::v1::{self as pb, cluster_client::ClusterClient};
use presence_tls::ClientTls;
use tokio::time::Instant;
use tonic::metadata::{Ascii, MetadataValue};
use tonic::transport::Channel;

use crate::cluster::config::{ClusterConfig, ClusterTls, JoinError};
use crate::cluster::forward::{FORWARD_TIMEOUT, forward, next_message};
use crate::cluster::outage::{Fencer, Outage};
use crate::cluster::peers::{PeerStream, Peers};
use crate::error::{NotOwner, ServiceError};

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

/// Taken off every confirmed lease deadline before this node stops acting:
/// covers the difference of clock rates between etcd and this node and the
/// time an answer takes to leave.
const LEASE_MARGIN: Duration = Duration::from_millis(500);

/// A node's part in its cluster, kept while it serves.
#[derive(Debug)]
pub(crate) struct Membership {
    node: String,
    slots: u32,
    /// Where the lease stands, read by every check: relayed from the lease
    /// in force (see [`Membership::relay`]), which changes when the node
    /// joins again after etcd said its lease was gone.
    lease_state: Arc<tokio::sync::watch::Sender<LeaseState>>,
    /// Which lease's relay may publish: a count of the leases relayed, so
    /// that the relay of a lease gone publishes nothing once the next one's
    /// relay began (its last word, `Lost`, would undo the new lease's state
    /// and make the node join again for nothing).
    relaying: Arc<std::sync::atomic::AtomicU64>,
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
    fencer: Arc<Fencer>,
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
    /// See [`ClusterConfig::serves_relay`].
    pub(crate) serves_relay: bool,
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
            config.client_tls().map_err(|err| JoinError::Tls(format!("TLS: {err}")))?;
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
        let fencer = Arc::new(Fencer {
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
            relaying: Arc::default(),
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
            serves_relay: config.serves_relay,
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
    /// viewer and with the caller's own credentials (C2).
    pub(crate) async fn forward_snapshot(
        &self,
        address: &str,
        user_ids: Vec<String>,
        viewer_id: &str,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<Vec<pb::UserPresence>, ServiceError> {
        let request = pb::SnapshotRequest { user_ids, viewer_id: viewer_id.to_owned() };
        let client = self.peers.client(address)?;
        let answer =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.snapshot(request).await
            });
        Ok(answer.await?.users)
    }

    /// Asks the node at `address`, which owns `request`'s users, where their
    /// notifications should go (A4), with the caller's credentials.
    pub(crate) async fn forward_notify_targets(
        &self,
        address: &str,
        request: pb::NotifyTargetsRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<Vec<pb::NotifyTarget>, ServiceError> {
        let client = self.peers.client(address)?;
        let answer =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.notify_targets(request).await
            });
        Ok(answer.await?.targets)
    }

    /// Sends lease items held through a freeze to the node at `address`,
    /// which owns their users now (C7), with the caller's credentials.
    pub(crate) async fn forward_leases(
        &self,
        address: &str,
        batch: pb::LeaseBatch,
        authorization: Option<MetadataValue<Ascii>>,
    ) -> Result<pb::LeaseResults, ServiceError> {
        let client = self.peers.client(address)?;
        let batch = tokio_stream::iter([batch]);
        let mut results =
            forward(client, address, FORWARD_TIMEOUT, batch, authorization.as_ref(), |mut client, batch| async move {
                client.leases(batch).await
            })
            .await?;
        next_message(address, FORWARD_TIMEOUT, "results", &mut results).await
    }

    /// Opens a Watch at the node at `address` for the caller, as
    /// [`Membership::forward_snapshot`] asks for a Snapshot.
    pub(crate) async fn forward_watch(
        &self,
        address: &str,
        request: pb::WatchRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<PeerStream<pb::WatchEvent>, ServiceError> {
        let (client, place) = self.peers.stream_client(address)?;
        let stream =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.watch(request).await
            });
        Ok(PeerStream::new(stream.await?, place))
    }

    /// Asks the room's owner at `address` for a RoomSnapshot, for the caller
    /// and with its credentials (C1).
    pub(crate) async fn forward_room_snapshot(
        &self,
        address: &str,
        request: pb::RoomSnapshotRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::RoomSnapshot, ServiceError> {
        let client = self.peers.client(address)?;
        forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.room_snapshot(request).await
        })
        .await
    }

    /// Asks the room's owner at `address` to set the room's access, for the
    /// caller and with its credentials (C1).
    pub(crate) async fn forward_set_room_access(
        &self,
        address: &str,
        request: pb::SetRoomAccessRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::SetRoomAccessResponse, ServiceError> {
        let client = self.peers.client(address)?;
        forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.set_room_access(request).await
        })
        .await
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
        let client = self.peers.client(address)?;
        forward(client, address, 2 * FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.export_user(request).await
        })
        .await
    }

    /// Asks the user's owner at `address` to erase it, with the caller's
    /// credentials (P7), waiting as [`Membership::forward_export_user`] does.
    pub(crate) async fn forward_erase_user(
        &self,
        address: &str,
        request: pb::EraseUserRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::EraseUserResponse, ServiceError> {
        let client = self.peers.client(address)?;
        forward(client, address, 2 * FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.erase_user(request).await
        })
        .await
    }

    /// Opens a WatchRoom at the room's owner at `address`, as
    /// [`Membership::forward_room_snapshot`] asks for a RoomSnapshot.
    pub(crate) async fn forward_watch_room(
        &self,
        address: &str,
        request: pb::WatchRoomRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<PeerStream<pb::RoomEvent>, ServiceError> {
        let (client, place) = self.peers.stream_client(address)?;
        let stream =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.watch_room(request).await
            });
        Ok(PeerStream::new(stream.await?, place))
    }

    /// What may end this node's right to act for some user: the slot map's
    /// changes, the lease's, and the instant the lease lapses unless etcd
    /// confirms it again.
    pub(crate) fn changes(&self) -> OwnershipChanges {
        OwnershipChanges {
            map: self.acted.subscribe(),
            lease: self.lease_state.subscribe(),
            extension: self.outage.extensions(),
            lapse_told: None,
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
            relaying: Arc::clone(&self.relaying),
            lease: self.relaying.fetch_add(1, Ordering::AcqRel) + 1,
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
    fencer: &Arc<Fencer>,
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
    /// The lease relayed last ([`Membership::relaying`]), and this one.
    relaying: Arc<std::sync::atomic::AtomicU64>,
    lease: u64,
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
        if self.relaying.load(Ordering::Acquire) != self.lease {
            return; // a later lease is relayed now
        }
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

/// Until when a node whose lease stands at `lease` may act, given the
/// extension the others' answers gave it during an etcd outage: `None` once
/// etcd said the lease is gone.
fn acting_until(lease: LeaseState, extended_until: Option<Instant>) -> Option<Instant> {
    match lease {
        LeaseState::ValidUntil(until) => Some(extended_until.map_or(until, |extended| extended.max(until))),
        LeaseState::Lost => None,
    }
}

/// The lapse [`OwnershipChanges::changed`] waits for: the right to act's
/// end, unless that very lapse was told already.
fn lapse_to_tell(acting_until: Option<Instant>, told: Option<Instant>) -> Option<Instant> {
    acting_until.filter(|lapses| Some(*lapses) != told)
}

/// Waits for changes of a node's ownership (see [`Membership::changes`]).
#[derive(Debug)]
pub(crate) struct OwnershipChanges {
    map: tokio::sync::watch::Receiver<Arc<SlotMap>>,
    lease: tokio::sync::watch::Receiver<LeaseState>,
    extension: tokio::sync::watch::Receiver<Option<Instant>>,
    /// The lapse already told: a node cut off from etcd stays lapsed until
    /// its lease is renewed or lost, and telling the same lapse again at
    /// every call would spin its callers' loops at full speed for as long.
    lapse_told: Option<Instant>,
}

impl OwnershipChanges {
    /// Returns once the map, the lease or its extension changed, or the
    /// right to act lapsed (each lapse once).
    pub(crate) async fn changed(&mut self) {
        // Lost: nothing lapses; acting again comes with a new lease (a change).
        let lapses = lapse_to_tell(acting_until(*self.lease.borrow(), *self.extension.borrow()), self.lapse_told);
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
            () = lapsed => self.lapse_told = lapses,
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

impl Routes {
    /// One answer per request entry, in request order: `local`'s for this
    /// node's entries, and each owner's answer (one per entry sent to it,
    /// `ask`ed of all owners at once) for theirs. `what` names the call in
    /// the refusal of an owner that answered the wrong number.
    pub(crate) async fn merged<'a, T, F>(
        &'a self,
        local: Vec<T>,
        what: &str,
        ask: impl Fn(&'a str, &'a [usize]) -> F,
    ) -> Result<Vec<T>, ServiceError>
    where
        F: std::future::Future<Output = Result<Vec<T>, ServiceError>>,
    {
        let mut answers: Vec<Option<T>> = std::iter::repeat_with(|| None)
            .take(self.local.len() + self.remote.values().map(Vec::len).sum::<usize>())
            .collect();
        for (&index, answer) in self.local.iter().zip(local) {
            answers[index] = Some(answer);
        }
        let asked = self.remote.iter().map(|(address, indices)| ask(address.as_str(), indices.as_slice()));
        for ((address, indices), answer) in self.remote.iter().zip(futures_util::future::join_all(asked).await) {
            let answer = answer?;
            if answer.len() != indices.len() {
                let wrong = format!("the node at {address} answered a forwarded {what} with the wrong number of users");
                return Err(ServiceError::Internal(wrong));
            }
            for (&index, one) in indices.iter().zip(answer) {
                answers[index] = Some(one);
            }
        }
        Ok(answers.into_iter().flatten().collect())
    }
}

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

impl crate::node::placement::UserCheck for OwnershipView<'_> {
    fn check(&self, user_id: &[u8]) -> Result<(), ServiceError> {
        OwnershipView::check(self, user_id)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lapse_is_told_once_and_a_renewed_lease_lapses_again() {
        let now = Instant::now();
        let lapsed = now - Duration::from_secs(1);
        assert_eq!(lapse_to_tell(Some(lapsed), None), Some(lapsed), "a lapse not yet told is told");
        assert_eq!(lapse_to_tell(Some(lapsed), Some(lapsed)), None, "told once, it is not told again");
        let renewed = now + Duration::from_secs(2);
        assert_eq!(lapse_to_tell(Some(renewed), Some(lapsed)), Some(renewed), "a renewed lease's end is awaited");
        assert_eq!(lapse_to_tell(None, Some(lapsed)), None, "a lost lease does not lapse");
    }
}
