//! What a server is configured with ([`ServerConfig`]) and why it could not
//! run ([`ServeError`]). The node's own part of the settings is handed to it
//! as a [`NodeConfig`], so that `node/` names nothing of this file.

use std::path::PathBuf;
use std::time::Duration;

use presence_core::attention::NotifyPolicy;
use presence_core::{ConfigError, StoreConfig};

use crate::node::context::NodeConfig;
use crate::privacy::Visibility;
use crate::{AuditLogError, AuthConfig, AuthConfigError, ClusterConfig, JoinError, WebhookConfig};
use crate::{DEFAULT_RETENTION_BYTES_IN_MEMORY, DEFAULT_RETENTION_BYTES_ON_DISK, DEFAULT_RETENTION_MS};

/// How the service runs.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Shards and TTL bounds of the lease store.
    pub store: StoreConfig,
    /// Users expired per shard per lock hold, so that a mass expiry lets
    /// requests in between batches.
    pub expiry_batch: usize,
    /// How long a shutdown waits for in-flight requests and open connections
    /// before closing them anyway.
    pub shutdown_grace: Duration,
    /// Most distinct users with undelivered changes a viewer may have before it
    /// is sent a fresh snapshot instead (E4).
    pub watch_buffer: usize,
    /// How long a busy Watch stream without a batch window waits for the
    /// delivery tick all streams share (E3, E5): less server CPU per event
    /// under load, at most this much later. Zero delivers each change at once.
    pub watch_delivery_tick: Duration,
    /// Most members a member-mode room snapshot or watch lists (R6); larger
    /// rooms are watched in count mode.
    pub room_member_cap: usize,
    /// Lease batches that may wait for a worker; beyond it renewals are shed (B2).
    pub lease_queue: usize,
    /// Tasks applying lease batches.
    pub lease_workers: usize,
    /// Threads that serve connections, each on its own single-threaded event
    /// loop (by default one per CPU); 0 serves them on the caller's runtime.
    /// Connection threads make small unary calls much cheaper and cost
    /// `Leases` and Watch nothing measurable. See `api/connections.rs` and
    /// `docs/benchmarks.md`.
    pub connection_threads: usize,
    /// Where checkpoints and durable data live; `None` keeps everything in
    /// memory only.
    pub data_dir: Option<PathBuf>,
    /// A backup file (D3) to start from, in place of the data directory's
    /// checkpoint; the data directory, if any, must hold no data yet.
    pub restore: Option<PathBuf>,
    /// How often a checkpoint of the leases is written (with a data directory).
    pub checkpoint_interval: Duration,
    /// After a restart, how long users that were online at the checkpoint are
    /// held online while their gateways reconnect; `None` takes the default TTL.
    /// The same hold follows a stall of the process (L4).
    pub restart_grace: Option<Duration>,
    /// How often at most a user's activity is written to disk.
    pub activity_write_interval: Duration,
    /// Service tokens and viewer-token keys; none configured runs the service open.
    pub auth: AuthConfig,
    /// How often the credentials file is read again (T4): often, so that a
    /// removed credential's streams end within a second.
    pub credentials_reload_interval: Duration,
    /// Also append the audit log (P7) to this file, one JSON object a line.
    pub audit_log: Option<PathBuf>,
    /// The visibility of a user that chose none.
    pub default_visibility: Visibility,
    /// Last seen is released rounded down to this (P5).
    pub last_seen_granularity: Duration,
    /// How long after a user's last activity on some session a notification's
    /// push waits (A3: a minute after a screen locks, the user may be back).
    pub push_handoff: Duration,
    /// Most client connections open at once; more are refused (B5). An idle
    /// connection costs about 15 KiB, so the default 10,000 bounds that to
    /// about 150 MiB, and it is far more than one node needs when gateways
    /// multiplex their users' sessions over a few connections each.
    pub max_connections: usize,
    /// A connection that has not sent the HTTP/2 preface and its SETTINGS
    /// within this is closed (B5). The default, 10 s, is far longer than any
    /// live client needs, even through a proxy on a slow link, and still
    /// clears a flood of silent sockets within seconds.
    pub handshake_timeout: Duration,
    /// HTTP/2 `SETTINGS_MAX_CONCURRENT_STREAMS`: streams one connection may
    /// have open (B5). A viewer needs one Watch and a gateway one Leases
    /// stream plus its unary calls in flight; 1024 leaves room for deep
    /// pipelining and bounds what one connection can make the server hold.
    pub max_streams_per_connection: u32,
    /// Origins (`scheme://host[:port]`) of pages served elsewhere that may
    /// call the service over gRPC-Web (O5); none lets in only pages of the
    /// service's own origin, such as the console.
    pub cors_origins: Vec<String>,
    /// Whether the web console is served at `/console/` on the service's port (O4).
    pub console: bool,
    /// Cluster mode (`--etcd`): `None` is a single node (C5).
    pub cluster: Option<ClusterConfig>,
    /// TLS on the service port (T1, T2): `None` serves plaintext.
    pub tls: Option<presence_tls::ServerTlsFiles>,
    /// How often TLS material (the server's, the peer and etcd client
    /// certificates) is read again to see whether it changed (T4); SIGHUP
    /// reads it at once.
    pub tls_reload_interval: Duration,
    /// Changes older than this leave the change feed (F2).
    pub feed_retention: Duration,
    /// At most about this many bytes of the change feed are kept (F2); `None`
    /// takes 1 GiB with a data directory and 16 MiB in memory; 0 turns the
    /// feed off.
    pub feed_retention_bytes: Option<u64>,
    /// Receivers the change feed is POSTed to (F4); none by default.
    pub feed_webhooks: WebhookConfig,
}

/// The CPUs this process may use (2 when the system cannot tell): the
/// default of every setting that scales with the cores.
pub fn cpus() -> usize {
    std::thread::available_parallelism().map_or(2, usize::from)
}

impl ServerConfig {
    /// The restart grace in store milliseconds: as set, or the default TTL.
    pub(crate) fn restart_grace_ms(&self) -> u64 {
        self.restart_grace
            .map_or(u64::from(self.store.default_ttl_ms), |grace| u64::try_from(grace.as_millis()).unwrap_or(u64::MAX))
    }

    /// The change feed's retention, or `None` when it is turned off.
    pub(crate) fn feed_retention(&self) -> Option<presence_feed::Retention> {
        let max_bytes = self.feed_retention_bytes.unwrap_or(if self.data_dir.is_some() {
            DEFAULT_RETENTION_BYTES_ON_DISK
        } else {
            DEFAULT_RETENTION_BYTES_IN_MEMORY
        });
        let max_age_ms = u64::try_from(self.feed_retention.as_millis()).unwrap_or(u64::MAX);
        (max_bytes > 0).then_some(presence_feed::Retention { max_age_ms, max_bytes })
    }

    /// The settings the node itself reads, for its [`Context`](crate::node::context::Context).
    pub(crate) fn node(&self) -> NodeConfig {
        NodeConfig {
            watch_buffer: self.watch_buffer,
            watch_delivery_tick: self.watch_delivery_tick,
            room_member_cap: self.room_member_cap,
            activity_write_interval: self.activity_write_interval,
            forget_offline_after_ms: self.store.forget_offline_after_ms,
            default_visibility: self.default_visibility,
            last_seen_granularity: self.last_seen_granularity,
            notify_policy: NotifyPolicy {
                handoff_ms: u64::try_from(self.push_handoff.as_millis()).unwrap_or(u64::MAX),
            },
        }
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        // The node's own settings have their defaults in one place, the node's.
        let node = NodeConfig::default();
        ServerConfig {
            store: StoreConfig::default(),
            expiry_batch: 1_024,
            shutdown_grace: Duration::from_secs(5),
            watch_buffer: node.watch_buffer,
            watch_delivery_tick: node.watch_delivery_tick,
            room_member_cap: node.room_member_cap,
            lease_queue: 256,
            lease_workers: cpus(),
            connection_threads: cpus(),
            data_dir: None,
            restore: None,
            checkpoint_interval: Duration::from_secs(5),
            restart_grace: None,
            activity_write_interval: node.activity_write_interval,
            auth: AuthConfig::default(),
            credentials_reload_interval: Duration::from_millis(250),
            audit_log: None,
            default_visibility: node.default_visibility,
            last_seen_granularity: node.last_seen_granularity,
            push_handoff: Duration::from_millis(node.notify_policy.handoff_ms),
            max_connections: 10_000,
            handshake_timeout: Duration::from_secs(10),
            max_streams_per_connection: 1_024,
            cors_origins: Vec::new(),
            console: true,
            cluster: None,
            tls: None,
            tls_reload_interval: Duration::from_secs(2),
            feed_retention: Duration::from_millis(DEFAULT_RETENTION_MS),
            feed_retention_bytes: None,
            feed_webhooks: WebhookConfig::default(),
        }
    }
}

/// Why the server could not run.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(#[from] ConfigError),
    /// The reflection service could not load the API's descriptors.
    #[error("cannot build server reflection: {0}")]
    Reflection(#[from] tonic_reflection::server::Error),
    /// The transport failed.
    #[error("transport error: {0}")]
    Transport(#[from] tonic::transport::Error),
    /// The connection threads could not be started.
    #[error("cannot start the connection threads: {0}")]
    Threads(#[from] std::io::Error),
    /// The credentials configuration is unusable.
    #[error("{0}")]
    Auth(#[from] AuthConfigError),
    /// The audit log file cannot be opened.
    #[error("{0}")]
    Audit(#[from] AuditLogError),
    /// The cluster could not be joined (`--etcd`).
    #[error("{0}")]
    Cluster(#[from] JoinError),
    /// A setting is out of its range.
    #[error("{setting} {reason}")]
    Setting {
        /// The `ServerConfig` field.
        setting: &'static str,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// A CORS origin cannot be matched by any page.
    #[error("{origin:?} is not an origin: {reason}")]
    CorsOrigin {
        /// The origin as given.
        origin: String,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// TLS material cannot be used.
    #[error("TLS: {0}")]
    Tls(#[from] presence_tls::TlsError),
    /// The data directory cannot be used.
    #[error("data directory {path}: {message}")]
    DataDir {
        /// The directory.
        path: PathBuf,
        /// What went wrong.
        message: String,
    },
    /// A webhook of the change feed cannot be used (F4).
    #[error("{0}")]
    Webhook(String),
    /// The backup to start from cannot be used (D3).
    #[error("--restore {path}: {message}")]
    Restore {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        message: String,
    },
}

impl From<crate::cluster::config::Refused> for ServeError {
    fn from(refused: crate::cluster::config::Refused) -> Self {
        match refused {
            crate::cluster::config::Refused::Setting { setting, reason } => ServeError::Setting { setting, reason },
            crate::cluster::config::Refused::Tls(err) => ServeError::Tls(err),
        }
    }
}
