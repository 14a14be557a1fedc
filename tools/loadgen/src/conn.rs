//! One worker's connection to the target, and the gateway operations over it.
//!
//! | mode | presenced | redis |
//! |---|---|---|
//! | `unary` | one `Register`/`Renew`/`Unregister` RPC per item (`PresenceClient`), workers share `--connections` HTTP/2 connections | one `EVALSHA` per item (plus the gateway's `ZADD presence:due`/`PUBLISH` after a register), one connection per worker |
//! | `leases` | `LeaseChannel::submit_batch` of `--batch` items on `--connections` `Leases` streams | a pipeline of `--batch` items, one connection per worker |
//! | `coalesced` | one item per call through `LeaseChannel::{register,renew,unregister}`, which coalesces concurrent calls into batches of up to `--batch` | (not applicable) |

use std::sync::Arc;
use std::time::Duration;

use presence_client::pb::{self, lease_item, lease_result};
use presence_client::{ClientTlsConfig, ClusterLeases, LeaseChannel, LeaseChannelConfig, lease_result as split_result};
use presence_proto::v1::presence_client::PresenceClient;
use redis::Value;
use redis::aio::MultiplexedConnection;
use tonic::Status;
use tonic::transport::Channel;

use crate::ids::{Population, session_id, user_id};
use crate::redis_seed::{self, DUE_KEY, Scripts};
use crate::stats::code_name;

/// Which system the run drives.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum TargetKind {
    /// presenced over gRPC, through presence-client.
    Presenced,
    /// redis-server running the seed 000 scripts.
    Redis,
}

/// How gateway operations are sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub(crate) enum Mode {
    /// One call per operation (presenced: unary RPC; redis: unpipelined EVALSHA).
    Unary,
    /// Explicit batches of `--batch` items (presenced: `Leases` via `submit_batch`;
    /// redis: pipeline depth `--batch`).
    #[value(alias = "batch", alias = "pipelined")]
    Leases,
    /// presenced only: single calls through `LeaseChannel`, coalesced by the client.
    Coalesced,
}

impl Mode {
    /// Items a worker sends per call.
    pub(crate) fn items_per_call(self, batch: u64) -> u64 {
        match self {
            Mode::Leases => batch.max(1),
            Mode::Unary | Mode::Coalesced => 1,
        }
    }

    /// The name in reports.
    pub(crate) fn label(self, target: TargetKind) -> &'static str {
        match (self, target) {
            (Mode::Unary, TargetKind::Presenced) => "unary",
            (Mode::Unary, TargetKind::Redis) => "unpipelined",
            (Mode::Leases, TargetKind::Presenced) => "leases",
            (Mode::Leases, TargetKind::Redis) => "pipelined",
            (Mode::Coalesced, _) => "coalesced",
        }
    }
}

/// Where the target is and how to reach it.
#[derive(Debug, Clone)]
pub(crate) struct Endpoints {
    /// Target system.
    pub(crate) target: TargetKind,
    /// presenced's `host:port`.
    pub(crate) addr: String,
    /// Redis URL.
    pub(crate) redis_url: String,
    /// presenced: the cluster's slot count, or 0 for one node.
    pub(crate) cluster_slots: u32,
    /// presenced: etcd endpoints whose slot map a cluster's client follows (none: learn from refusals).
    pub(crate) etcd: Vec<String>,
    /// The cluster's key prefix in etcd.
    pub(crate) etcd_prefix: String,
    /// presenced serves TLS (`--tls`): its CA, and a client certificate.
    pub(crate) tls: Option<TlsFiles>,
    /// presenced's service token (`--token`).
    pub(crate) token: Option<String>,
}

/// The TLS files of `--tls-ca`, `--tls-cert` and `--tls-key`.
#[derive(Debug, Clone)]
pub(crate) struct TlsFiles {
    pub(crate) ca: Option<std::path::PathBuf>,
    pub(crate) cert: Option<std::path::PathBuf>,
    pub(crate) key: Option<std::path::PathBuf>,
}

impl Endpoints {
    /// The address the report names.
    pub(crate) fn host(&self) -> String {
        match self.target {
            TargetKind::Presenced => self.addr.clone(),
            TargetKind::Redis => self.redis_url.clone(),
        }
    }

    /// `http://host:port`, or `https://host:port` with `--tls`.
    pub(crate) fn presenced_uri(&self) -> String {
        let scheme = if self.tls.is_some() { "https" } else { "http" };
        if self.addr.contains("://") { self.addr.clone() } else { format!("{scheme}://{}", self.addr) }
    }

    /// The TLS settings presence-client dials with (`None`: plaintext).
    pub(crate) fn client_tls(&self) -> Result<Option<ClientTlsConfig>, String> {
        let Some(files) = &self.tls else { return Ok(None) };
        ClientTlsConfig::from_files(files.ca.clone(), files.cert.clone(), files.key.clone())
            .map(Some)
            .map_err(|e| format!("--tls-ca/--tls-cert: {e}"))
    }

    /// A `LeaseChannelConfig` with `config`'s settings and this target's TLS.
    pub(crate) fn lease_config(&self, config: LeaseChannelConfig) -> Result<LeaseChannelConfig, String> {
        Ok(LeaseChannelConfig { tls: self.client_tls()?, bearer_token: self.token.clone(), ..config })
    }

    /// One HTTP/2 connection to presenced (TLS with `--tls`).
    pub(crate) async fn grpc_channel(&self) -> Result<Channel, String> {
        presence_client::connect(&self.presenced_uri(), self.client_tls()?.as_ref())
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.addr))
    }

    /// A new Redis connection (one TCP connection).
    pub(crate) async fn redis(&self) -> Result<MultiplexedConnection, String> {
        let client = redis::Client::open(self.redis_url.as_str()).map_err(|e| format!("bad redis url: {e}"))?;
        client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| format!("cannot connect to {}: {e}", self.redis_url))
    }

    /// A Redis client (for pub/sub connections).
    pub(crate) fn redis_client(&self) -> Result<redis::Client, String> {
        redis::Client::open(self.redis_url.as_str()).map_err(|e| format!("bad redis url: {e}"))
    }
}

/// How to open the workers' connections.
#[derive(Debug, Clone)]
pub(crate) struct ConnSpec {
    /// Target and addresses.
    pub(crate) endpoints: Endpoints,
    /// Send mode.
    pub(crate) mode: Mode,
    /// Workers (calls in flight).
    pub(crate) concurrency: u64,
    /// presenced: HTTP/2 connections (unary) or `Leases` streams (leases, coalesced).
    pub(crate) connections: u64,
    /// Items per batch.
    pub(crate) batch: u64,
    /// presenced coalesced mode: how long an item waits for its batch to fill.
    pub(crate) max_delay: Duration,
}

/// Why `--cluster-slots` refuses unary calls.
const UNARY_IN_A_CLUSTER: &str = "--cluster-slots sends items in Leases batches to their users' owners; unary calls \
     would all go to --addr: use --mode leases (fanout's flips: --churn-mode leases)";

/// Opens one connection per worker (sharing the underlying HTTP/2 connections or
/// `Leases` streams round-robin on presenced).
pub(crate) async fn open_conns(spec: &ConnSpec) -> Result<Vec<Conn>, String> {
    let workers = spec.concurrency.max(1);
    let connections = spec.connections.clamp(1, workers);
    let mut out = Vec::with_capacity(workers as usize);
    match (spec.endpoints.target, spec.mode) {
        (TargetKind::Presenced, Mode::Unary) if spec.endpoints.cluster_slots > 0 => {
            // A unary call goes to --addr whoever owns its user; only the
            // cluster client sends each item to its owner.
            return Err(UNARY_IN_A_CLUSTER.into());
        }
        (TargetKind::Presenced, Mode::Unary) => {
            let mut channels = Vec::new();
            for _ in 0..connections {
                channels.push(crate::direct::DirectChannel::connect(&spec.endpoints).await?);
            }
            for w in 0..workers {
                let ch = channels[(w % connections) as usize].clone();
                let client = PresenceClient::new(ch).max_decoding_message_size(64 << 20);
                out.push(Conn::Unary(client));
            }
        }
        (TargetKind::Presenced, mode) => {
            let in_flight = workers.div_ceil(connections).max(1) as usize;
            let config = LeaseChannelConfig {
                max_batch: spec.batch.max(1) as usize,
                max_delay: spec.max_delay,
                max_in_flight_batches: if mode == Mode::Coalesced { 8 } else { in_flight },
                ..spec.endpoints.lease_config(LeaseChannelConfig::default())?
            };
            if spec.endpoints.cluster_slots > 0 {
                if mode == Mode::Coalesced {
                    return Err("--cluster-slots goes with --mode leases".into());
                }
                // One ClusterLeases keeps a stream per node; every worker shares it.
                let cluster = ClusterLeases::new(&spec.endpoints.presenced_uri(), spec.endpoints.cluster_slots, config)
                    .map_err(|e| e.to_string())?;
                if !spec.endpoints.etcd.is_empty() {
                    cluster
                        .follow_etcd(&spec.endpoints.etcd, &spec.endpoints.etcd_prefix)
                        .await
                        .map_err(|e| e.to_string())?;
                }
                out.extend((0..workers).map(|_| Conn::Leases(LeaseSink::Cluster(cluster.clone()))));
                return Ok(out);
            }
            let mut chans = Vec::new();
            for _ in 0..connections {
                let ch = LeaseChannel::connect(spec.endpoints.presenced_uri(), config.clone())
                    .await
                    .map_err(|e| e.to_string())?;
                chans.push(ch);
            }
            for w in 0..workers {
                let ch = chans[(w % connections) as usize].clone();
                out.push(if mode == Mode::Coalesced { Conn::Coalesced(ch) } else { Conn::Leases(LeaseSink::One(ch)) });
            }
        }
        (TargetKind::Redis, Mode::Coalesced) => return Err("--mode coalesced is presenced only".into()),
        (TargetKind::Redis, mode) => {
            let mut first = spec.endpoints.redis().await?;
            let scripts = Arc::new(Scripts::load(&mut first).await.map_err(|e| format!("SCRIPT LOAD: {e}"))?);
            let pipelined = mode == Mode::Leases;
            out.push(Conn::Redis(RedisConn { conn: first, scripts: Arc::clone(&scripts), pipelined }));
            for _ in 1..workers {
                let conn = spec.endpoints.redis().await?;
                out.push(Conn::Redis(RedisConn { conn, scripts: Arc::clone(&scripts), pipelined }));
            }
        }
    }
    Ok(out)
}

/// A failed item: ghz's status name and the message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ItemErr {
    /// gRPC code name (`NotFound`, `Unavailable`, ...); for Redis, `NotFound` is a
    /// script's `ok = 0` (no lease at that generation), `Unavailable` a connection error
    /// and `Internal` an error reply.
    pub(crate) status: &'static str,
    /// What the server said.
    pub(crate) message: String,
}

impl ItemErr {
    fn from_status(s: &Status) -> ItemErr {
        ItemErr { status: code_name(s.code() as i32), message: s.message().to_owned() }
    }

    fn from_redis(e: &redis::RedisError) -> ItemErr {
        let status =
            if e.is_io_error() || e.is_connection_dropped() || e.is_timeout() { "Unavailable" } else { "Internal" };
        ItemErr { status, message: e.to_string() }
    }

    fn internal(message: impl Into<String>) -> ItemErr {
        ItemErr { status: "Internal", message: message.into() }
    }

    fn rejected() -> ItemErr {
        ItemErr { status: "NotFound", message: "script answered ok = 0 (no lease at that generation)".into() }
    }
}

/// A register to send.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RegItem {
    /// Session number.
    pub(crate) session: u64,
    /// Lease TTL.
    pub(crate) ttl_ms: u32,
}

/// A renew or unregister to send.
#[derive(Debug, Clone, Copy)]
pub(crate) struct GenItem {
    /// Session number.
    pub(crate) session: u64,
    /// The generation the gateway holds.
    pub(crate) generation: u64,
    /// Lease TTL (renew only).
    pub(crate) ttl_ms: u32,
}

/// What a room item does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RoomOp {
    /// Join the room (a session already in it updates its room metadata). With
    /// `stamped`, the metadata carries the send time, Unix ns, under [`SENT_NS_KEY`],
    /// so that a watcher can measure the change's latency.
    Join {
        /// Put the send time in the metadata.
        stamped: bool,
    },
    /// Leave the room.
    Leave,
    /// Set (`ttl_ms` > 0) or clear (0) the `typing` signal in the room.
    Typing {
        /// The signal's TTL.
        ttl_ms: u32,
    },
}

/// The room metadata key that holds a join's send time (Unix ns, decimal).
pub(crate) const SENT_NS_KEY: &str = "sent_ns";

/// A room item to send for one session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct RoomItem {
    /// Session number.
    pub(crate) session: u64,
    /// The generation the gateway holds (filled in by the sender).
    pub(crate) generation: u64,
    /// Room number (see [`crate::ids::room_id`]).
    pub(crate) room: u64,
    /// What to do.
    pub(crate) op: RoomOp,
}

/// A room item's answer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct RoomDone {
    /// The room changed: the user joined or left it, or the signal set changed.
    pub(crate) changed: bool,
}

/// A register's answer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Registered {
    /// The session's new generation.
    pub(crate) generation: u64,
    /// The lease deadline, Unix ms (0 when not asked for on Redis).
    pub(crate) deadline_ms: i64,
    /// Whether the user flipped.
    pub(crate) changed: bool,
}

/// A renewal's answer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Renewed {
    /// Acknowledged without a store write (presenced's minimum renewal interval).
    pub(crate) throttled: bool,
}

/// An unregister's answer.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Unregistered {
    /// The lease was removed.
    pub(crate) removed: bool,
    /// Whether the user flipped.
    pub(crate) changed: bool,
}

/// What the gateway side needs to name things.
#[derive(Debug, Clone)]
pub(crate) struct Naming {
    /// The population (session number -> user number).
    pub(crate) pop: Population,
    /// The gateway id sent with registers.
    pub(crate) gateway_id: String,
    /// Every session's `(user id, session id)`, made once: a gateway holds its
    /// sessions' ids and copies them into requests, it does not format them
    /// again for each heartbeat, and neither should the generator's CPU budget.
    ids: Arc<[(String, String)]>,
}

impl Naming {
    /// Names for the sessions of `pop`, registered by `gateway_id`.
    pub(crate) fn new(pop: Population, gateway_id: String) -> Naming {
        Naming::offset(pop, gateway_id, 0, 0)
    }

    /// Names for a second population beside a first one: session `k` is named as session
    /// `first_session + k` of user `first_user + pop.user_of(k)`, so that the two share no
    /// user and no session (a population of users that expire, beside one that never does).
    pub(crate) fn offset(pop: Population, gateway_id: String, first_user: u64, first_session: u64) -> Naming {
        let ids = (0..pop.sessions)
            .map(|session| (user_id(first_user + pop.user_of(session)), session_id(first_session + session)))
            .collect();
        Naming { pop, gateway_id, ids }
    }

    /// Session `session`'s `(user id, session id)`.
    pub(crate) fn ids(&self, session: u64) -> (String, String) {
        match self.ids.get(session as usize) {
            Some((user, session)) => (user.clone(), session.clone()),
            None => (user_id(self.pop.user_of(session)), session_id(session)),
        }
    }
}

/// Where a worker's explicit lease batches go.
#[derive(Debug, Clone)]
pub(crate) enum LeaseSink {
    /// One node's `Leases` stream.
    One(LeaseChannel),
    /// A cluster's nodes, each item to its user's owner (`--cluster-slots`).
    Cluster(ClusterLeases),
}

impl LeaseSink {
    /// Sends `items` as one batch (split by owner in a cluster).
    pub(crate) async fn submit_batch(&self, items: Vec<pb::LeaseItem>) -> Result<Vec<pb::LeaseResult>, Status> {
        match self {
            LeaseSink::One(channel) => channel.submit_batch(items).await,
            LeaseSink::Cluster(cluster) => Ok(cluster.submit_batch(items).await),
        }
    }
}

/// One worker's connection.
#[derive(Debug)]
pub(crate) enum Conn {
    /// presenced, one RPC per item.
    Unary(PresenceClient<crate::direct::DirectChannel>),
    /// presenced, explicit batches on a `Leases` stream (or a cluster's).
    Leases(LeaseSink),
    /// presenced, single items coalesced by the client.
    Coalesced(LeaseChannel),
    /// Redis with the seed scripts.
    Redis(RedisConn),
}

/// A Redis connection with the seed's scripts loaded.
#[derive(Debug)]
pub(crate) struct RedisConn {
    conn: MultiplexedConnection,
    scripts: Arc<Scripts>,
    pipelined: bool,
}

// Requests gain fields as the API grows; the defaults are what the generator means.
#[allow(clippy::needless_update)]
pub(crate) fn register_request(n: &Naming, item: &RegItem) -> pb::RegisterRequest {
    let (user_id, session_id) = n.ids(item.session);
    pb::RegisterRequest {
        user_id,
        session_id,
        gateway_id: n.gateway_id.clone(),
        ttl_ms: item.ttl_ms,
        ..Default::default()
    }
}

// Requests gain fields as the API grows; the defaults are what the generator means.
#[allow(clippy::needless_update)]
pub(crate) fn renew_request(n: &Naming, item: &GenItem) -> pb::RenewRequest {
    let (user_id, session_id) = n.ids(item.session);
    pb::RenewRequest { user_id, session_id, generation: item.generation, ttl_ms: item.ttl_ms, ..Default::default() }
}

// Requests gain fields as the API grows; the defaults are what the generator means.
#[allow(clippy::needless_update)]
pub(crate) fn unregister_request(n: &Naming, item: &GenItem) -> pb::UnregisterRequest {
    let (user_id, session_id) = n.ids(item.session);
    pb::UnregisterRequest { user_id, session_id, generation: item.generation, linger_ms: 0, ..Default::default() }
}

fn room_lease_item(n: &Naming, item: &RoomItem) -> lease_item::Op {
    let (user_id, session_id) = n.ids(item.session);
    let (generation, room_id) = (item.generation, crate::ids::room_id(item.room));
    match item.op {
        RoomOp::Join { stamped } => {
            let metadata = if stamped {
                [(SENT_NS_KEY.to_owned(), crate::expiry::unix_ns().to_string())].into_iter().collect()
            } else {
                Default::default()
            };
            lease_item::Op::Join(pb::JoinRequest { user_id, session_id, generation, room_id, metadata })
        }
        RoomOp::Leave => lease_item::Op::Leave(pb::LeaveRequest { user_id, session_id, generation, room_id }),
        RoomOp::Typing { ttl_ms } => lease_item::Op::Signal(pb::SignalRequest {
            user_id,
            session_id,
            generation,
            room_id,
            kind: "typing".into(),
            ttl_ms,
        }),
    }
}

fn room_done(r: lease_result::Result) -> Option<RoomDone> {
    match r {
        lease_result::Result::Join(r) => Some(RoomDone { changed: r.changed }),
        lease_result::Result::Leave(r) => Some(RoomDone { changed: r.changed }),
        lease_result::Result::Signal(r) => Some(RoomDone { changed: r.changed }),
        _ => None,
    }
}

fn registered(r: &pb::RegisterResponse) -> Registered {
    Registered { generation: r.generation, deadline_ms: r.expires_at_ms, changed: r.changed }
}

fn unregistered(r: &pb::UnregisterResponse) -> Unregistered {
    Unregistered { removed: r.removed, changed: r.changed }
}

/// Splits a `submit_batch` answer into per-item results.
fn batch_results<T>(
    n: usize,
    answer: Result<Vec<pb::LeaseResult>, Status>,
    pick: impl Fn(lease_result::Result) -> Option<T>,
) -> Vec<Result<T, ItemErr>> {
    match answer {
        Err(s) => (0..n).map(|_| Err(ItemErr::from_status(&s))).collect(),
        Ok(results) if results.len() != n => {
            (0..n).map(|_| Err(ItemErr::internal(format!("{} results for a batch of {n}", results.len())))).collect()
        }
        Ok(results) => results
            .into_iter()
            .map(|r| match split_result(r) {
                Ok(payload) => pick(payload).ok_or_else(|| ItemErr::internal("result of the wrong kind")),
                Err(s) => Err(ItemErr::from_status(&s)),
            })
            .collect(),
    }
}

impl Conn {
    /// Registers every item.
    pub(crate) async fn register(
        &mut self,
        n: &Naming,
        items: &[RegItem],
        want_deadline: bool,
    ) -> Vec<Result<Registered, ItemErr>> {
        match self {
            Conn::Unary(c) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    out.push(match c.register(register_request(n, item)).await {
                        Ok(r) => Ok(registered(r.get_ref())),
                        Err(s) => Err(ItemErr::from_status(&s)),
                    });
                }
                out
            }
            Conn::Leases(ch) => {
                let batch = items
                    .iter()
                    .map(|i| pb::LeaseItem { op: Some(lease_item::Op::Register(register_request(n, i))) })
                    .collect();
                batch_results(items.len(), ch.submit_batch(batch).await, |r| match r {
                    lease_result::Result::Register(r) => Some(registered(&r)),
                    _ => None,
                })
            }
            Conn::Coalesced(ch) => {
                let calls = items.iter().map(|i| ch.register(register_request(n, i)));
                futures_util::future::join_all(calls)
                    .await
                    .into_iter()
                    .map(|r| r.map(|r| registered(&r)).map_err(|s| ItemErr::from_status(&s)))
                    .collect()
            }
            Conn::Redis(r) => r.register(n, items, want_deadline).await,
        }
    }

    /// Renews every item.
    pub(crate) async fn renew(&mut self, n: &Naming, items: &[GenItem]) -> Vec<Result<Renewed, ItemErr>> {
        match self {
            Conn::Unary(c) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    out.push(match c.renew(renew_request(n, item)).await {
                        Ok(r) => Ok(Renewed { throttled: r.get_ref().throttled }),
                        Err(s) => Err(ItemErr::from_status(&s)),
                    });
                }
                out
            }
            Conn::Leases(ch) => {
                let batch = items
                    .iter()
                    .map(|i| pb::LeaseItem { op: Some(lease_item::Op::Renew(renew_request(n, i))) })
                    .collect();
                batch_results(items.len(), ch.submit_batch(batch).await, |r| match r {
                    lease_result::Result::Renew(r) => Some(Renewed { throttled: r.throttled }),
                    _ => None,
                })
            }
            Conn::Coalesced(ch) => {
                let calls = items.iter().map(|i| ch.renew(renew_request(n, i)));
                futures_util::future::join_all(calls)
                    .await
                    .into_iter()
                    .map(|r| r.map(|r| Renewed { throttled: r.throttled }).map_err(|s| ItemErr::from_status(&s)))
                    .collect()
            }
            Conn::Redis(r) => r.heartbeat(n, items).await,
        }
    }

    /// Unregisters every item (compare-and-delete on the generation, no linger).
    pub(crate) async fn unregister(&mut self, n: &Naming, items: &[GenItem]) -> Vec<Result<Unregistered, ItemErr>> {
        match self {
            Conn::Unary(c) => {
                let mut out = Vec::with_capacity(items.len());
                for item in items {
                    out.push(match c.unregister(unregister_request(n, item)).await {
                        Ok(r) => Ok(unregistered(r.get_ref())),
                        Err(s) => Err(ItemErr::from_status(&s)),
                    });
                }
                out
            }
            Conn::Leases(ch) => {
                let batch = items
                    .iter()
                    .map(|i| pb::LeaseItem { op: Some(lease_item::Op::Unregister(unregister_request(n, i))) })
                    .collect();
                batch_results(items.len(), ch.submit_batch(batch).await, |r| match r {
                    lease_result::Result::Unregister(r) => Some(unregistered(&r)),
                    _ => None,
                })
            }
            Conn::Coalesced(ch) => {
                let calls = items.iter().map(|i| ch.unregister(unregister_request(n, i)));
                futures_util::future::join_all(calls)
                    .await
                    .into_iter()
                    .map(|r| r.map(|r| unregistered(&r)).map_err(|s| ItemErr::from_status(&s)))
                    .collect()
            }
            Conn::Redis(r) => r.unregister(n, items).await,
        }
    }

    /// Sends room items (presenced over a `Leases` stream only: the Redis design has no rooms).
    pub(crate) async fn rooms(&mut self, n: &Naming, items: &[RoomItem]) -> Vec<Result<RoomDone, ItemErr>> {
        match self {
            Conn::Leases(sink) => {
                let batch = items.iter().map(|i| pb::LeaseItem { op: Some(room_lease_item(n, i)) }).collect();
                batch_results(items.len(), sink.submit_batch(batch).await, room_done)
            }
            Conn::Coalesced(ch) => {
                let batch = items.iter().map(|i| pb::LeaseItem { op: Some(room_lease_item(n, i)) }).collect();
                batch_results(items.len(), ch.submit_batch(batch).await, room_done)
            }
            Conn::Unary(_) | Conn::Redis(_) => {
                items.iter().map(|_| Err(ItemErr::internal("room items are sent as Leases items"))).collect()
            }
        }
    }
}

impl RedisConn {
    /// Sends a pipeline and returns one value per command (error replies inline).
    async fn send(&mut self, p: &redis::Pipeline) -> Result<Vec<Value>, redis::RedisError> {
        if p.is_empty() {
            return Ok(Vec::new());
        }
        self.conn.send_packed_commands(p, 0, p.len()).await
    }

    /// The seed gateway's `onConnected`: `presence_register`, then `ZADD presence:due
    /// Date.now()+TTL user`, then `PUBLISH` when the user flipped. With
    /// `want_deadline`, a `ZSCORE` of the session in the user's index right after the
    /// script reads back the lease deadline the script set (not part of the seed; only
    /// the expiry scenario asks for it, outside any measured latency).
    async fn register(
        &mut self,
        n: &Naming,
        items: &[RegItem],
        want_deadline: bool,
    ) -> Vec<Result<Registered, ItemErr>> {
        if self.pipelined {
            return self.register_pipelined(n, items, want_deadline).await;
        }
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            out.push(self.register_one(n, item, want_deadline).await);
        }
        out
    }

    /// One register, each step awaited before the next as the seed's gateway does.
    async fn register_one(&mut self, n: &Naming, item: &RegItem, want_deadline: bool) -> Result<Registered, ItemErr> {
        let (user, session) = n.ids(item.session);
        let mut p = redis::pipe();
        self.scripts.register(&mut p, &user, &session, &n.gateway_id, item.ttl_ms);
        if want_deadline {
            p.cmd("ZSCORE").arg(redis_seed::idx_key(&user)).arg(&session);
        }
        let mut values = self.send(&p).await.map_err(|e| ItemErr::from_redis(&e))?;
        let mut p = redis::pipe();
        p.cmd("ZADD").arg(DUE_KEY).arg(redis_seed::now_ms() + i64::from(item.ttl_ms)).arg(&user);
        values.extend(self.send(&p).await.map_err(|e| ItemErr::from_redis(&e))?);
        let (reg, ver) = decode_register(&values)?;
        if reg.changed {
            self.publish(&user, "online", ver).await;
        }
        Ok(reg)
    }

    /// A batch of registers as one pipeline, then one pipeline of the PUBLISHes.
    async fn register_pipelined(
        &mut self,
        n: &Naming,
        items: &[RegItem],
        want_deadline: bool,
    ) -> Vec<Result<Registered, ItemErr>> {
        let per_item = if want_deadline { 3 } else { 2 };
        let mut p = redis::pipe();
        let mut users = Vec::with_capacity(items.len());
        for item in items {
            let (user, session) = n.ids(item.session);
            self.scripts.register(&mut p, &user, &session, &n.gateway_id, item.ttl_ms);
            if want_deadline {
                p.cmd("ZSCORE").arg(redis_seed::idx_key(&user)).arg(&session);
            }
            p.cmd("ZADD").arg(DUE_KEY).arg(redis_seed::now_ms() + i64::from(item.ttl_ms)).arg(&user);
            users.push(user);
        }
        let values = match self.send(&p).await {
            Err(e) => return items.iter().map(|_| Err(ItemErr::from_redis(&e))).collect(),
            Ok(v) if v.len() != items.len() * per_item => {
                return items.iter().map(|_| Err(ItemErr::internal("short pipeline answer"))).collect();
            }
            Ok(v) => v,
        };
        let mut out = Vec::with_capacity(items.len());
        let mut publishes = redis::pipe();
        for (v, user) in values.chunks(per_item).zip(&users) {
            let r = decode_register(v);
            if let Ok((reg, ver)) = &r
                && reg.changed
            {
                publishes
                    .cmd("PUBLISH")
                    .arg(redis_seed::out_channel(user))
                    .arg(redis_seed::transition_payload(user, "online", *ver));
            }
            out.push(r.map(|(reg, _)| reg));
        }
        let _ = self.send(&publishes).await;
        out
    }

    async fn publish(&mut self, user: &str, state: &str, ver: i64) {
        let mut p = redis::pipe();
        p.cmd("PUBLISH").arg(redis_seed::out_channel(user)).arg(redis_seed::transition_payload(user, state, ver));
        let _ = self.send(&p).await;
    }

    /// The seed gateway's `onLivenessSignal`: `presence_heartbeat` only.
    async fn heartbeat(&mut self, n: &Naming, items: &[GenItem]) -> Vec<Result<Renewed, ItemErr>> {
        let mut out = Vec::with_capacity(items.len());
        let step = if self.pipelined { items.len().max(1) } else { 1 };
        for chunk in items.chunks(step) {
            let mut p = redis::pipe();
            for item in chunk {
                let (user, session) = n.ids(item.session);
                self.scripts.heartbeat(&mut p, &user, &session, item.generation, item.ttl_ms);
            }
            match self.send(&p).await {
                Err(e) => out.extend(chunk.iter().map(|_| Err(ItemErr::from_redis(&e)))),
                Ok(values) => {
                    out.extend(values.iter().map(|v| match v {
                        Value::ServerError(e) => Err(ItemErr::internal(format!("{e:?}"))),
                        v => match redis_seed::pair(v) {
                            Some((1, _)) => Ok(Renewed::default()),
                            Some(_) => Err(ItemErr::rejected()),
                            None => Err(ItemErr::internal(format!("unexpected reply {v:?}"))),
                        },
                    }));
                    if values.len() < chunk.len() {
                        out.extend(
                            (values.len()..chunk.len()).map(|_| Err(ItemErr::internal("short pipeline answer"))),
                        );
                    }
                }
            }
        }
        out
    }

    /// The seed gateway's `onClosed`: `presence_unregister`, then `PUBLISH` offline when
    /// the user flipped.
    async fn unregister(&mut self, n: &Naming, items: &[GenItem]) -> Vec<Result<Unregistered, ItemErr>> {
        let mut out = Vec::with_capacity(items.len());
        let step = if self.pipelined { items.len().max(1) } else { 1 };
        for chunk in items.chunks(step) {
            let mut p = redis::pipe();
            let mut users = Vec::with_capacity(chunk.len());
            for item in chunk {
                let (user, session) = n.ids(item.session);
                self.scripts.unregister(&mut p, &user, &session, item.generation);
                users.push(user);
            }
            match self.send(&p).await {
                Err(e) => out.extend(chunk.iter().map(|_| Err(ItemErr::from_redis(&e)))),
                Ok(values) => {
                    let mut publishes = redis::pipe();
                    for (v, user) in values.iter().zip(&users) {
                        out.push(match redis_seed::pair(v) {
                            Some((1, ver)) => {
                                if ver != 0 {
                                    publishes
                                        .cmd("PUBLISH")
                                        .arg(redis_seed::out_channel(user))
                                        .arg(redis_seed::transition_payload(user, "offline", ver));
                                }
                                Ok(Unregistered { removed: true, changed: ver != 0 })
                            }
                            Some(_) => Ok(Unregistered::default()),
                            None => Err(ItemErr::internal(format!("unexpected reply {v:?}"))),
                        });
                    }
                    let _ = self.send(&publishes).await;
                }
            }
        }
        out
    }
}

/// Decodes `[register reply, (zscore,) zadd reply]` into the register's outcome and the
/// user's version.
fn decode_register(values: &[Value]) -> Result<(Registered, i64), ItemErr> {
    let first = values.first().ok_or_else(|| ItemErr::internal("empty reply"))?;
    if let Value::ServerError(e) = first {
        return Err(ItemErr::internal(format!("{e:?}")));
    }
    let (generation, ver) =
        redis_seed::pair(first).ok_or_else(|| ItemErr::internal(format!("unexpected {first:?}")))?;
    let deadline_ms =
        if values.len() == 3 { values.get(1).and_then(redis_seed::number).unwrap_or(0.0) as i64 } else { 0 };
    Ok((Registered { generation: generation.max(0) as u64, deadline_ms, changed: ver != 0 }, ver))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_send_the_documented_items_per_call() {
        assert_eq!(Mode::Unary.items_per_call(100), 1);
        assert_eq!(Mode::Coalesced.items_per_call(100), 1);
        assert_eq!(Mode::Leases.items_per_call(100), 100);
        assert_eq!(Mode::Leases.items_per_call(0), 1);
        assert_eq!(Mode::Leases.label(TargetKind::Redis), "pipelined");
        assert_eq!(Mode::Unary.label(TargetKind::Redis), "unpipelined");
    }

    #[tokio::test]
    async fn unary_calls_to_a_cluster_are_refused_naming_the_mode_that_routes_them() {
        let endpoints = Endpoints {
            target: TargetKind::Presenced,
            addr: "127.0.0.1:1".into(),
            redis_url: String::new(),
            cluster_slots: 1024,
            etcd: Vec::new(),
            etcd_prefix: "/presenced/".into(),
            tls: None,
            token: None,
        };
        let spec = ConnSpec {
            endpoints,
            mode: Mode::Unary,
            concurrency: 1,
            connections: 1,
            batch: 1,
            max_delay: Duration::ZERO,
        };
        assert_eq!(open_conns(&spec).await.err().as_deref(), Some(UNARY_IN_A_CLUSTER));
    }

    #[test]
    fn register_replies_decode() {
        let v = [Value::Array(vec![Value::Int(4), Value::Int(2)]), Value::Int(1)];
        let (r, ver) = decode_register(&v).unwrap();
        assert_eq!((r.generation, r.changed, r.deadline_ms, ver), (4, true, 0, 2));
        let v = [
            Value::Array(vec![Value::Int(5), Value::Int(0)]),
            Value::BulkString(b"1700000000500".to_vec()),
            Value::Int(0),
        ];
        let (r, _) = decode_register(&v).unwrap();
        assert_eq!((r.generation, r.changed, r.deadline_ms), (5, false, 1_700_000_000_500));
    }

    #[test]
    fn batch_failures_fail_every_item() {
        let r: Vec<Result<(), ItemErr>> = batch_results(3, Err(Status::unavailable("down")), |_| Some(()));
        assert_eq!(r.len(), 3);
        assert!(r.iter().all(|x| x.as_ref().unwrap_err().status == "Unavailable"));
        let one = pb::LeaseResult { code: 5, message: "gone".into(), ..Default::default() };
        let r: Vec<Result<(), ItemErr>> = batch_results(1, Ok(vec![one]), |_| Some(()));
        assert_eq!(r[0].as_ref().unwrap_err(), &ItemErr { status: "NotFound", message: "gone".into() });
    }
}
