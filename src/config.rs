//! Configuration of `presenced serve` (contract O3): flags, then environment,
//! then a TOML file, then defaults.
//!
//! Each setting is declared once, as a field of [`ServeArgs`]: clap reads it
//! from `--some-flag` and from `PRESENCED_SOME_FLAG` (the flag first), serde
//! from the key `some_flag` of the `--config` file. The file and the
//! command line are merged as TOML tables, the command line's keys replacing
//! the file's, and a setting still unset keeps the library's default
//! (`ServerConfig::default()`, `StoreConfig::default()`): no default is
//! written here, and `--help` shows the library's (see [`with_defaults_in_help`]).
//!
//! Why not figment: clap already reads the environment with the right
//! precedence and names the variable in its errors, so what is left is one
//! merge of two tables, which the `toml` crate the binary already uses does.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use presence_server::privacy::Visibility;
use presence_server::{ClusterConfig, MAX_SLOTS, ServerConfig};
use serde::{Deserialize, Serialize};

/// Where `serve` listens: an address, or `localhost:PORT`, which is both
/// loopbacks (127.0.0.1 and ::1, as `localhost` resolves to either).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub(crate) enum ListenAddr {
    Socket(SocketAddr),
    Localhost(u16),
}

impl ListenAddr {
    /// Whether only this machine can reach it.
    fn is_loopback(self) -> bool {
        match self {
            ListenAddr::Socket(addr) => addr.ip().is_loopback(),
            ListenAddr::Localhost(_) => true,
        }
    }
}

impl std::str::FromStr for ListenAddr {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        if let Ok(addr) = text.parse() {
            return Ok(ListenAddr::Socket(addr));
        }
        let port = text.strip_prefix("localhost:").and_then(|port| port.parse().ok());
        port.map(ListenAddr::Localhost).ok_or_else(|| {
            format!(
                "{text:?} is not IP:PORT or localhost:PORT (127.0.0.1:50051, [::1]:50051, 0.0.0.0:50051, \
                 localhost:50051)"
            )
        })
    }
}

impl std::fmt::Display for ListenAddr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ListenAddr::Socket(addr) => addr.fmt(f),
            ListenAddr::Localhost(port) => write!(f, "localhost:{port}"),
        }
    }
}

impl TryFrom<String> for ListenAddr {
    type Error = String;

    fn try_from(text: String) -> Result<Self, String> {
        text.parse()
    }
}

impl From<ListenAddr> for String {
    fn from(addr: ListenAddr) -> String {
        addr.to_string()
    }
}

/// Where `serve` listens when told nothing.
const DEFAULT_LISTEN: SocketAddr = SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 50051);

/// The settings of `presenced serve`, each from a flag, the environment or
/// the `--config` file. `None` (or empty, or false) is unset: the layer
/// below, and in the end the library's default, decides.
#[derive(Debug, Default, Clone, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ServeArgs {
    /// A TOML file with any of the settings below, each keyed by its flag's
    /// name with `_` for `-` (presenced.example.toml holds them all).
    #[arg(long, env = "PRESENCED_CONFIG", value_name = "FILE")]
    #[serde(skip)]
    config: Option<PathBuf>,
    /// The service's address (gRPC, gRPC-Web and the console): IP:PORT, or
    /// localhost:PORT for both loopbacks (127.0.0.1 and ::1); port 0 picks a
    /// free port.
    #[arg(long, env = "PRESENCED_LISTEN", value_name = "ADDR")]
    listen: Option<ListenAddr>,
    /// The shortest lease TTL a request may ask for.
    #[arg(long, env = "PRESENCED_MIN_TTL_MS", value_name = "MS")]
    min_ttl_ms: Option<u32>,
    /// The TTL of a request that asks for 0.
    #[arg(long, env = "PRESENCED_DEFAULT_TTL_MS", value_name = "MS")]
    default_ttl_ms: Option<u32>,
    /// The longest lease TTL a request may ask for.
    #[arg(long, env = "PRESENCED_MAX_TTL_MS", value_name = "MS")]
    max_ttl_ms: Option<u32>,
    /// Renewals of a lease closer together than this (at most half its TTL) are
    /// acknowledged without a write; 0 turns the throttle off.
    #[arg(long, env = "PRESENCED_MIN_RENEW_INTERVAL_MS", value_name = "MS")]
    min_renew_interval_ms: Option<u32>,
    /// How long a user that is offline, with nothing else held in memory, is
    /// remembered before it is forgotten (B6).
    #[arg(long, env = "PRESENCED_FORGET_OFFLINE_AFTER_MS", value_name = "MS")]
    forget_offline_after_ms: Option<u64>,
    /// Flap damping (E6): when a user's last lease ends by expiry or
    /// unregister, it stays ONLINE this long, and a new lease within it
    /// publishes nothing; 0 (the default) is off, 30000 the most.
    #[arg(long, env = "PRESENCED_OFFLINE_GRACE_MS", value_name = "MS")]
    offline_grace_ms: Option<u64>,
    /// How long after a user's last activity on any session it is still
    /// shown ACTIVE (A2): the damping that keeps a quick switch of tabs from
    /// showing it away; 0 is none, 3600000 (an hour) the most.
    #[arg(long, env = "PRESENCED_ACTIVE_WINDOW_MS", value_name = "MS")]
    active_window_ms: Option<u64>,
    /// The most members a member-mode room snapshot or watch lists; larger
    /// rooms are watched in count mode.
    #[arg(long, env = "PRESENCED_ROOM_MEMBER_CAP", value_name = "N")]
    room_member_cap: Option<usize>,
    /// Lease store shards, a power of two.
    #[arg(long, env = "PRESENCED_SHARDS", value_name = "N")]
    shards: Option<usize>,
    /// Users expired per shard per lock hold.
    #[arg(long, env = "PRESENCED_EXPIRY_BATCH", value_name = "N")]
    expiry_batch: Option<usize>,
    /// How long a shutdown waits for open requests and connections.
    #[arg(long, env = "PRESENCED_SHUTDOWN_GRACE_MS", value_name = "MS")]
    shutdown_grace_ms: Option<u64>,
    /// How long after a user's last activity on some session a notification's
    /// push waits, for NotifyTargets calls that name no hand-off (A3).
    #[arg(long, env = "PRESENCED_PUSH_HANDOFF_MS", value_name = "MS")]
    push_handoff_ms: Option<u64>,
    /// The Prometheus endpoint (`GET /metrics`); none unless set.
    #[arg(long, env = "PRESENCED_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Users with undelivered changes a viewer may have before it is resynced.
    #[arg(long, env = "PRESENCED_WATCH_BUFFER", value_name = "N")]
    watch_buffer: Option<usize>,
    /// How long a busy Watch stream without a batch window waits for the
    /// delivery tick every stream shares: less CPU per event under load, each
    /// change at most this much later; 0 delivers each change at once.
    #[arg(long, env = "PRESENCED_WATCH_DELIVERY_TICK_MS", value_name = "MS")]
    watch_delivery_tick_ms: Option<u64>,
    /// Lease batches that may wait for a worker before renewals are shed.
    #[arg(long, env = "PRESENCED_LEASE_QUEUE", value_name = "N")]
    lease_queue: Option<usize>,
    /// Tasks applying lease batches. [default: the number of CPUs]
    #[arg(long, env = "PRESENCED_LEASE_WORKERS", value_name = "N")]
    lease_workers: Option<usize>,
    /// Threads of the shared runtime: lease batches, expiry, checkpoints, and
    /// connections when there are no connection threads. [default: the number of CPUs]
    #[arg(long, env = "PRESENCED_WORKER_THREADS", value_name = "N")]
    worker_threads: Option<usize>,
    /// Threads that serve client connections, each a single-threaded event loop
    /// that owns its connections: much cheaper for many small unary calls.
    /// 0 serves connections on the shared runtime instead; the default is one
    /// per CPU.
    #[arg(long, env = "PRESENCED_CONNECTION_THREADS", value_name = "N")]
    connection_threads: Option<usize>,
    /// Keep checkpoints and durable data (settings, activity) here; without it
    /// everything is in memory only.
    #[arg(long, env = "PRESENCED_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// Start from this backup (`presenced backup`) instead of the data
    /// directory's checkpoint; with --data-dir, the directory must hold no
    /// checkpoint or durable data yet. A corrupt, truncated or foreign file
    /// (another --slots) is refused before `listening on`.
    #[arg(long, value_name = "FILE")]
    restore: Option<PathBuf>,
    /// How often the leases are checkpointed to the data directory.
    #[arg(long, env = "PRESENCED_CHECKPOINT_INTERVAL_MS", value_name = "MS")]
    checkpoint_interval_ms: Option<u64>,
    /// After a restart, how long users online at the checkpoint are held online
    /// while their gateways reconnect. [default: the default TTL]
    #[arg(long, env = "PRESENCED_RESTART_GRACE_MS", value_name = "MS")]
    restart_grace_ms: Option<u64>,
    /// How often at most one user's activity is written to disk.
    #[arg(long, env = "PRESENCED_ACTIVITY_WRITE_INTERVAL_MS", value_name = "MS")]
    activity_write_interval_ms: Option<u64>,
    /// A bearer token that service callers (gateways, admin tools) present,
    /// with EVERY scope (gateway, read, admin, feed, cluster); repeat it (or
    /// separate with commas in the environment) to rotate tokens without
    /// downtime. It shows in `ps` and the environment: prefer --credentials,
    /// whose credentials have names, scopes and hashed tokens.
    #[arg(long = "service-token", env = "PRESENCED_SERVICE_TOKEN", value_name = "TOKEN", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "service_token")]
    service_tokens: Vec<String>,
    /// A TOML file of named service credentials, each with its scopes and
    /// the SHA-256 of its token (`presenced token new` makes one); read again
    /// when it changes, and on SIGHUP.
    #[arg(long, env = "PRESENCED_CREDENTIALS", value_name = "FILE")]
    credentials: Option<PathBuf>,
    /// A file holding the token this node presents to the other nodes of
    /// its cluster (a credential with the `cluster` scope) [default: the
    /// first --service-token]. Not needed with node-to-node TLS certificates.
    #[arg(long, env = "PRESENCED_PEER_TOKEN_FILE", value_name = "FILE")]
    peer_token_file: Option<PathBuf>,
    /// Also append the audit log of privileged calls to FILE, one JSON object
    /// a line (it always goes to the log, under the target `presenced::audit`).
    #[arg(long, env = "PRESENCED_AUDIT_LOG", value_name = "FILE")]
    audit_log: Option<PathBuf>,
    /// Clock skew allowed on a viewer JWT's `exp` (and `nbf`), in seconds, at
    /// most 300; a viewer's streams end at `exp` plus this. [default: 0]
    #[arg(long, env = "PRESENCED_JWT_LEEWAY_SECS", value_name = "SECS")]
    jwt_leeway_secs: Option<u64>,
    /// The HS256 secret that signs viewers' JWTs.
    #[arg(long, env = "PRESENCED_VIEWER_JWT_HS256_SECRET", value_name = "SECRET")]
    viewer_jwt_hs256_secret: Option<String>,
    /// A PEM public key (RSA for RS256, Ed25519 for EdDSA) that verifies viewers' JWTs.
    #[arg(long, env = "PRESENCED_VIEWER_JWT_PUBLIC_KEY", value_name = "FILE")]
    viewer_jwt_public_key: Option<PathBuf>,
    /// Viewer keys from the identity provider's JWKS document: a file, or an
    /// https:// URL; read again on a schedule, on SIGHUP and when a token
    /// names an unknown `kid`. Several keys verify at once during a rotation.
    #[arg(long, env = "PRESENCED_VIEWER_JWKS", value_name = "FILE_OR_HTTPS_URL")]
    viewer_jwks: Option<String>,
    /// The PEM CA of the JWKS URL's certificate [default: the system's roots].
    #[arg(long, env = "PRESENCED_VIEWER_JWKS_CA", value_name = "FILE")]
    viewer_jwks_ca: Option<PathBuf>,
    /// How often a JWKS URL is fetched again. [default: 300000]
    #[arg(long, env = "PRESENCED_VIEWER_JWKS_REFRESH_MS", value_name = "MS")]
    viewer_jwks_refresh_ms: Option<u64>,
    /// An `aud` viewer tokens must carry (repeatable: any of them); without
    /// one, tokens with an `aud` are refused.
    #[arg(
        long = "viewer-jwt-audience",
        env = "PRESENCED_VIEWER_JWT_AUDIENCE",
        value_name = "AUD",
        value_delimiter = ','
    )]
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "viewer_jwt_audience")]
    viewer_jwt_audiences: Vec<String>,
    /// The `iss` viewer tokens must carry.
    #[arg(long, env = "PRESENCED_VIEWER_JWT_ISSUER", value_name = "ISS")]
    viewer_jwt_issuer: Option<String>,
    /// With no credentials configured, allow listening on a non-loopback address.
    #[arg(long, env = "PRESENCED_INSECURE")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    insecure: bool,
    /// The visibility of a user that chose none.
    #[arg(long, env = "PRESENCED_DEFAULT_VISIBILITY", value_name = "VISIBILITY")]
    default_visibility: Option<DefaultVisibility>,
    /// Last seen is released to viewers rounded down to this.
    #[arg(long, env = "PRESENCED_LAST_SEEN_GRANULARITY_MS", value_name = "MS")]
    last_seen_granularity_ms: Option<u64>,
    /// Changes older than this leave the change feed (`Changes`); the
    /// default is a day.
    #[arg(long, env = "PRESENCED_FEED_RETENTION_MS", value_name = "MS")]
    feed_retention_ms: Option<u64>,
    /// At most this many bytes of the change feed are kept: on disk with
    /// --data-dir (its segment files), else in memory (everything its
    /// entries take, about 90 bytes a change); 0 turns the feed off.
    /// [default: 1073741824 (1 GiB) with --data-dir, 16777216 (16 MiB)
    /// without]
    #[arg(long, env = "PRESENCED_FEED_RETENTION_BYTES", value_name = "BYTES")]
    feed_retention_bytes: Option<u64>,
    /// POST the change feed in signed JSON batches to this http:// or
    /// https:// URL; repeat it for more receivers. Filters go after a `#`:
    /// `#kinds=flip,status,room_occupancy&id_prefix=P&slots=0-511&max_events=N`
    /// (the environment variable holds one: filters have commas).
    #[arg(long = "feed-webhook", env = "PRESENCED_FEED_WEBHOOK", value_name = "URL")]
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "feed_webhook")]
    feed_webhooks: Vec<String>,
    /// The secret that signs webhook batches (HMAC-SHA256, at least 32
    /// bytes); repeat it to sign with two while receivers move to a new one.
    /// It shows in `ps`: prefer --feed-webhook-secret-file.
    #[arg(long = "feed-webhook-secret", env = "PRESENCED_FEED_WEBHOOK_SECRET", value_name = "SECRET")]
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "feed_webhook_secret")]
    feed_webhook_secrets: Vec<String>,
    /// A file holding the webhook secrets, one a line (blank lines skipped).
    #[arg(long, env = "PRESENCED_FEED_WEBHOOK_SECRET_FILE", value_name = "FILE")]
    feed_webhook_secret_file: Option<PathBuf>,
    /// The PEM CA of https:// webhooks' certificates [default: the system's
    /// trusted roots].
    #[arg(long, env = "PRESENCED_FEED_WEBHOOK_CA", value_name = "FILE")]
    feed_webhook_ca: Option<PathBuf>,
    /// Client connections open at once; more are refused with an HTTP/2
    /// GOAWAY (an HTTP/1 client: a 503). Keep it below the file-descriptor
    /// limit.
    #[arg(long, env = "PRESENCED_MAX_CONNECTIONS", value_name = "N")]
    max_connections: Option<usize>,
    /// A connection that has not sent the HTTP/2 preface and SETTINGS (or,
    /// over HTTP/1, a whole request head) within this is closed.
    #[arg(long, env = "PRESENCED_HANDSHAKE_TIMEOUT_MS", value_name = "MS")]
    handshake_timeout_ms: Option<u64>,
    /// Concurrent streams (calls, Watch and Leases streams) one connection may
    /// have open; more are refused with REFUSED_STREAM.
    #[arg(long, env = "PRESENCED_MAX_STREAMS_PER_CONNECTION", value_name = "N")]
    max_streams_per_connection: Option<u32>,
    /// The origin (scheme://host[:port]) of a page served elsewhere that may
    /// call the service over gRPC-Web; repeat it (or separate with commas in
    /// the environment) for more. Without one, only pages served by presenced
    /// itself (the console) can.
    #[arg(long = "cors-origin", env = "PRESENCED_CORS_ORIGIN", value_name = "ORIGIN", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "cors_origin")]
    cors_origins: Vec<String>,
    /// Serve the web console at http://LISTEN/console/ (its files are built
    /// into the binary); false answers 404 there.
    #[arg(long, env = "PRESENCED_CONSOLE", value_name = "BOOL")]
    console: Option<bool>,
    /// Join a cluster coordinated by etcd at these client URLs
    /// (http://host:2379, comma-separated); without it, a single node.
    #[arg(long, env = "PRESENCED_ETCD", value_name = "URL,...", value_delimiter = ',')]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    etcd: Vec<String>,
    /// This node's name in the cluster (needs --etcd).
    #[arg(long, env = "PRESENCED_NODE_ID", value_name = "ID")]
    node_id: Option<String>,
    /// The host:port clients reach this node at, as refusals name it (needs --etcd).
    #[arg(long, env = "PRESENCED_ADVERTISE", value_name = "ADDR")]
    advertise: Option<String>,
    /// Hash slots users and rooms are spread over, fixed for the life of a
    /// cluster [default: 1024] (needs --etcd).
    #[arg(long, env = "PRESENCED_SLOTS", value_name = "N")]
    slots: Option<u32>,
    /// The prefix of the cluster's keys in etcd, so that clusters can share
    /// one etcd [default: /presenced/] (needs --etcd).
    #[arg(long, env = "PRESENCED_ETCD_PREFIX", value_name = "PREFIX")]
    etcd_prefix: Option<String>,
    /// The TTL of this node's etcd lease: a node that dies or is cut off from
    /// etcd loses its slots this long after its last keep-alive etcd
    /// answered [default: 5000] (needs --etcd).
    #[arg(long, env = "PRESENCED_ETCD_LEASE_TTL_MS", value_name = "MS")]
    etcd_lease_ttl_ms: Option<u64>,
    /// How long past its lease a node may keep serving through an etcd
    /// outage that every node it knows is in too; also how long after a
    /// node's registration is gone the coordinator waits before giving away
    /// the slots of a node it cannot reach. The same on every node
    /// [default: 10000] (needs --etcd).
    #[arg(long, env = "PRESENCED_ETCD_RIDE_OUT_MS", value_name = "MS")]
    etcd_ride_out_ms: Option<u64>,
    /// How long a new cluster waits with no node joining before it gives out
    /// its slots, so that nodes started together share them [default: 2000]
    /// (needs --etcd).
    #[arg(long, env = "PRESENCED_CLUSTER_SETTLE_MS", value_name = "MS")]
    cluster_settle_ms: Option<u64>,
    /// Whether the coordinator evens the slots out between the live nodes by
    /// planned moves (a node that joins gets its share); false leaves every
    /// move to `presenced cluster move` [default: true] (needs --etcd).
    #[arg(long, env = "PRESENCED_CLUSTER_REBALANCE", value_name = "BOOL")]
    cluster_rebalance: Option<bool>,
    /// PEM certificate chain (the server's first) for TLS on the service and
    /// metrics ports; with --tls-key. Reloaded when the file changes.
    #[arg(long, env = "PRESENCED_TLS_CERT", value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert.
    #[arg(long, env = "PRESENCED_TLS_KEY", value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// Mutual TLS: every client must present a certificate from this PEM CA
    /// (needs --tls-cert).
    #[arg(long, env = "PRESENCED_TLS_CLIENT_CA", value_name = "FILE", requires = "tls_cert")]
    tls_client_ca: Option<PathBuf>,
    /// A client certificate identity (a DNS, URI or e-mail subject
    /// alternative name, an IP address, or the subject's common name) whose
    /// holder is a service caller without a token; repeat it (or separate
    /// with commas in the environment) for more (needs --tls-client-ca).
    #[arg(
        long = "tls-service-identity",
        env = "PRESENCED_TLS_SERVICE_IDENTITY",
        value_name = "ID",
        value_delimiter = ',',
        requires = "tls_client_ca"
    )]
    #[serde(default, skip_serializing_if = "Vec::is_empty", rename = "tls_service_identity")]
    tls_service_identities: Vec<String>,
    /// The certificate this node shows other nodes, as their server and as
    /// their client [default: --tls-cert] (needs --etcd and --tls-cert).
    #[arg(long, env = "PRESENCED_PEER_TLS_CERT", value_name = "FILE", requires = "peer_tls_key")]
    peer_tls_cert: Option<PathBuf>,
    /// The key of --peer-tls-cert.
    #[arg(long, env = "PRESENCED_PEER_TLS_KEY", value_name = "FILE", requires = "peer_tls_cert")]
    peer_tls_key: Option<PathBuf>,
    /// The cluster's CA: nodes verify each other's certificates against it,
    /// and take Cluster calls only from a certificate of it [default:
    /// --tls-client-ca] (needs --etcd and --tls-cert).
    #[arg(long, env = "PRESENCED_PEER_TLS_CA", value_name = "FILE")]
    peer_tls_ca: Option<PathBuf>,
    /// The PEM CA of etcd's certificate, for https:// --etcd URLs [default:
    /// the system's trusted roots].
    #[arg(long, env = "PRESENCED_ETCD_CA", value_name = "FILE")]
    etcd_ca: Option<PathBuf>,
    /// A PEM client certificate for etcd's --client-cert-auth; with --etcd-key.
    #[arg(long, env = "PRESENCED_ETCD_CERT", value_name = "FILE", requires = "etcd_key")]
    etcd_cert: Option<PathBuf>,
    /// The key of --etcd-cert.
    #[arg(long, env = "PRESENCED_ETCD_KEY", value_name = "FILE", requires = "etcd_cert")]
    etcd_key: Option<PathBuf>,
    /// How often certificate, key and CA files are read again to pick up a
    /// rotation (SIGHUP reads them at once).
    #[arg(long, env = "PRESENCED_TLS_RELOAD_INTERVAL_MS", value_name = "MS")]
    tls_reload_interval_ms: Option<u64>,
    /// With credentials but without TLS, listen on a non-loopback address
    /// without the warning that tokens cross the network in the clear (for a
    /// service mesh or a TLS-terminating proxy in front).
    #[arg(long, env = "PRESENCED_ALLOW_PLAINTEXT")]
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    allow_plaintext: bool,
}

/// `--default-visibility`, as spelled on the command line and in the file.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub(crate) enum DefaultVisibility {
    /// Every viewer.
    Everyone,
    /// The user's audience.
    Audience,
    /// Nobody but the user.
    Nobody,
}

impl From<DefaultVisibility> for Visibility {
    fn from(visibility: DefaultVisibility) -> Self {
        match visibility {
            DefaultVisibility::Everyone => Visibility::Everyone,
            DefaultVisibility::Audience => Visibility::Audience,
            DefaultVisibility::Nobody => Visibility::Nobody,
        }
    }
}

impl From<Visibility> for DefaultVisibility {
    fn from(visibility: Visibility) -> Self {
        match visibility {
            Visibility::Everyone => DefaultVisibility::Everyone,
            Visibility::Audience => DefaultVisibility::Audience,
            Visibility::Nobody => DefaultVisibility::Nobody,
        }
    }
}

/// How a setting's value becomes a field of type `C` of the library's
/// configuration, and back (for `--help`): a `*_ms` setting is a `Duration`
/// there, or stays milliseconds where the library counts them so.
trait Field<C>: Sized {
    fn into_config(self) -> C;
    fn from_config(config: &C) -> Self;
}

impl<T: Clone> Field<T> for T {
    fn into_config(self) -> T {
        self
    }
    fn from_config(config: &T) -> T {
        config.clone()
    }
}

impl Field<Duration> for u64 {
    fn into_config(self) -> Duration {
        Duration::from_millis(self)
    }
    fn from_config(config: &Duration) -> u64 {
        u64::try_from(config.as_millis()).unwrap_or(u64::MAX)
    }
}

impl Field<Visibility> for DefaultVisibility {
    fn into_config(self) -> Visibility {
        self.into()
    }
    fn from_config(config: &Visibility) -> Self {
        (*config).into()
    }
}

/// Declares, once per setting, which field of `ServerConfig` a flag sets.
/// From it come both directions: applying the settings given to a
/// configuration, and the library's defaults as settings (for `--help`).
/// Settings that are not a plain field there (addresses, the runtime's
/// threads, credentials) are resolved by hand in [`ServeArgs::resolve`].
macro_rules! fields_of_server_config {
    ($($setting:ident => $($path:ident).+;)*) => {
        impl ServeArgs {
            /// Sets every field of `config` whose setting is given.
            fn apply(&self, config: &mut ServerConfig) {
                $(if let Some(value) = self.$setting.clone() {
                    config.$($path).+ = Field::into_config(value);
                })*
            }

            /// `config`'s values as settings.
            fn from_config(config: &ServerConfig) -> ServeArgs {
                ServeArgs { $($setting: Some(Field::from_config(&config.$($path).+)),)* ..ServeArgs::default() }
            }
        }
    };
}

fields_of_server_config! {
    min_ttl_ms => store.min_ttl_ms;
    default_ttl_ms => store.default_ttl_ms;
    max_ttl_ms => store.max_ttl_ms;
    min_renew_interval_ms => store.min_renew_interval_ms;
    forget_offline_after_ms => store.forget_offline_after_ms;
    offline_grace_ms => store.offline_grace_ms;
    active_window_ms => store.active_window_ms;
    room_member_cap => room_member_cap;
    shards => store.shards;
    expiry_batch => expiry_batch;
    shutdown_grace_ms => shutdown_grace;
    push_handoff_ms => push_handoff;
    watch_buffer => watch_buffer;
    watch_delivery_tick_ms => watch_delivery_tick;
    lease_queue => lease_queue;
    connection_threads => connection_threads;
    checkpoint_interval_ms => checkpoint_interval;
    activity_write_interval_ms => activity_write_interval;
    default_visibility => default_visibility;
    last_seen_granularity_ms => last_seen_granularity;
    feed_retention_ms => feed_retention;
    max_connections => max_connections;
    handshake_timeout_ms => handshake_timeout;
    max_streams_per_connection => max_streams_per_connection;
    console => console;
    tls_reload_interval_ms => tls_reload_interval;
}

/// The cluster's settings as given, before they are checked together.
struct ClusterArgs {
    etcd: Vec<String>,
    node_id: Option<String>,
    advertise: Option<String>,
    slots: Option<u32>,
    prefix: Option<String>,
    lease_ttl_ms: Option<u64>,
    ride_out_ms: Option<u64>,
    settle_ms: Option<u64>,
    rebalance: Option<bool>,
}

/// Cluster mode when `--etcd` is given, with the node's name and address it
/// needs; a cluster setting without `--etcd` is refused rather than ignored.
fn cluster_config(args: ClusterArgs) -> Result<Option<ClusterConfig>, SettingsError> {
    let invalid = |message: &str| Err(SettingsError::Invalid(message.to_owned()));
    if args.etcd.is_empty() {
        let given = [
            ("--node-id", args.node_id.is_some()),
            ("--advertise", args.advertise.is_some()),
            ("--slots", args.slots.is_some()),
            ("--etcd-prefix", args.prefix.is_some()),
            ("--etcd-lease-ttl-ms", args.lease_ttl_ms.is_some()),
            ("--etcd-ride-out-ms", args.ride_out_ms.is_some()),
            ("--cluster-settle-ms", args.settle_ms.is_some()),
            ("--cluster-rebalance", args.rebalance.is_some()),
        ];
        return match given.iter().find(|(_, given)| *given) {
            Some((flag, _)) => Err(SettingsError::Invalid(format!("{flag} needs --etcd (cluster mode)"))),
            None => Ok(None),
        };
    }
    let Some(node_id) = args.node_id else { return invalid("--etcd needs --node-id: this node's name in the cluster") };
    let Some(advertise) = args.advertise else {
        return invalid("--etcd needs --advertise: the host:port clients reach this node at");
    };
    let mut config = ClusterConfig::new(args.etcd, node_id, advertise);
    config.slots = args.slots.unwrap_or(config.slots);
    if let Some(prefix) = args.prefix {
        config.prefix = if prefix.ends_with('/') { prefix } else { format!("{prefix}/") };
    }
    config.lease_ttl = args.lease_ttl_ms.map_or(config.lease_ttl, Duration::from_millis);
    config.settle = args.settle_ms.map_or(config.settle, Duration::from_millis);
    config.ride_out = args.ride_out_ms.map_or(config.ride_out, Duration::from_millis);
    config.rebalance = args.rebalance.unwrap_or(config.rebalance);
    if !(1..=MAX_SLOTS).contains(&config.slots) {
        return Err(SettingsError::Invalid(format!("--slots must be between 1 and {MAX_SLOTS}")));
    }
    if config.lease_ttl < Duration::from_secs(2) || config.lease_ttl.subsec_millis() != 0 {
        return invalid("--etcd-lease-ttl-ms must be whole seconds, at least 2000 (etcd counts seconds)");
    }
    Ok(Some(config))
}

/// The TLS settings, checked together: the service port's files, and in a
/// cluster the node-to-node files (the service port's by default) and
/// etcd's, set on `cluster`.
fn tls_settings(
    args: &ServeArgs,
    cluster: Option<&mut ClusterConfig>,
) -> Result<Option<presence_tls::ServerTlsFiles>, SettingsError> {
    let invalid = |message: String| Err(SettingsError::Invalid(message));
    let peer_given = args.peer_tls_cert.is_some() || args.peer_tls_ca.is_some();
    let etcd_given = args.etcd_ca.is_some() || args.etcd_cert.is_some();
    if !args.tls_service_identities.is_empty() && args.tls_client_ca.is_none() {
        return invalid(
            "--tls-service-identity needs --tls-client-ca: identities come from client certificates".into(),
        );
    }
    if let Some((given, needs)) = half_given(args) {
        let key = |flag: &str| flag.trim_start_matches("--").replace('-', "_");
        return invalid(format!("{given} needs {needs} (in a --config file: {} needs {})", key(given), key(needs)));
    }
    let Some(cluster) = cluster else {
        if let Some(flag) = [("--peer-tls-cert / --peer-tls-ca", peer_given), ("--etcd-ca / --etcd-cert", etcd_given)]
            .iter()
            .find_map(|(flag, given)| given.then_some(flag))
        {
            return invalid(format!("{flag} needs --etcd (cluster mode)"));
        }
        return Ok(server_tls_files(args, None));
    };
    let https = cluster.etcd.iter().filter(|url| url.starts_with("https://")).count();
    if https != 0 && https != cluster.etcd.len() {
        return invalid("--etcd URLs must be all https:// or all http://".into());
    }
    if https > 0 {
        cluster.etcd_tls = Some(
            presence_tls::ClientTlsFiles::new(args.etcd_ca.clone(), args.etcd_cert.clone(), args.etcd_key.clone())
                .named(["--etcd-ca", "--etcd-cert", "--etcd-key"]),
        );
    } else if etcd_given {
        return invalid("--etcd-ca and --etcd-cert need https:// --etcd URLs".into());
    }
    if args.tls_cert.is_none() {
        if peer_given {
            return invalid(
                "--peer-tls-cert and --peer-tls-ca need --tls-cert: nodes reach each other on the service port".into(),
            );
        }
        return Ok(None);
    }
    let Some(ca) = args.peer_tls_ca.clone().or_else(|| args.tls_client_ca.clone()) else {
        return invalid(
            "with --tls-cert in a cluster, nodes verify each other against the cluster's CA: \
             give --peer-tls-ca (or --tls-client-ca, when one CA signs nodes and clients)"
                .into(),
        );
    };
    let (cert, key) = match (&args.peer_tls_cert, &args.peer_tls_key) {
        (Some(cert), Some(key)) => (cert.clone(), key.clone()),
        _ => (args.tls_cert.clone().expect("checked"), args.tls_key.clone().expect("clap requires it")),
    };
    let from_service_flags = args.peer_tls_cert.is_none() && args.peer_tls_ca.is_none();
    let peer = presence_tls::PeerFiles { cert, key, ca, from_service_flags };
    let [cert_flag, key_flag, ca_flag] = if from_service_flags {
        ["--tls-cert", "--tls-key", "--tls-client-ca"]
    } else {
        ["--peer-tls-cert", "--peer-tls-key", "--peer-tls-ca"]
    };
    cluster.peer_tls = Some(presence_tls::ClientTlsFiles {
        ca: Some(peer.ca.clone()),
        cert: Some(peer.cert.clone()),
        key: Some(peer.key.clone()),
        flags: [ca_flag, cert_flag, key_flag],
        as_cluster_node: true,
    });
    Ok(server_tls_files(args, Some(peer)))
}

/// The webhooks (F4), their secrets from the flag or the file (one, not both).
fn webhook_config(args: &ServeArgs) -> Result<presence_server::WebhookConfig, SettingsError> {
    let mut secrets = args.feed_webhook_secrets.clone();
    if let Some(path) = &args.feed_webhook_secret_file {
        if !secrets.is_empty() {
            return Err(SettingsError::Invalid(
                "--feed-webhook-secret and --feed-webhook-secret-file: give the secrets one way".into(),
            ));
        }
        let text = std::fs::read_to_string(path).map_err(|source| SettingsError::ReadFlagFile {
            flag: "--feed-webhook-secret-file",
            path: path.clone(),
            source,
        })?;
        secrets = text.lines().map(str::trim).filter(|line| !line.is_empty()).map(str::to_owned).collect();
        if secrets.is_empty() {
            return Err(SettingsError::Invalid(format!(
                "--feed-webhook-secret-file {}: no secret in it",
                path.display()
            )));
        }
    }
    Ok(presence_server::WebhookConfig { urls: args.feed_webhooks.clone(), secrets, ca: args.feed_webhook_ca.clone() })
}

/// The first setting given without the one it needs. The flags' `requires`
/// say the same on the command line, but a `--config` file is merged after
/// clap has checked it: half a TLS setup from a file would otherwise start
/// in plaintext without a word.
fn half_given(args: &ServeArgs) -> Option<(&'static str, &'static str)> {
    let pairs = [
        ("--tls-cert", args.tls_cert.is_some(), "--tls-key", args.tls_key.is_some()),
        ("--tls-key", args.tls_key.is_some(), "--tls-cert", args.tls_cert.is_some()),
        ("--tls-client-ca", args.tls_client_ca.is_some(), "--tls-cert", args.tls_cert.is_some()),
        ("--peer-tls-cert", args.peer_tls_cert.is_some(), "--peer-tls-key", args.peer_tls_key.is_some()),
        ("--peer-tls-key", args.peer_tls_key.is_some(), "--peer-tls-cert", args.peer_tls_cert.is_some()),
        ("--etcd-cert", args.etcd_cert.is_some(), "--etcd-key", args.etcd_key.is_some()),
        ("--etcd-key", args.etcd_key.is_some(), "--etcd-cert", args.etcd_cert.is_some()),
    ];
    pairs.into_iter().find(|(_, given, _, needed)| *given && !*needed).map(|(given, _, needs, _)| (given, needs))
}

fn server_tls_files(args: &ServeArgs, peer: Option<presence_tls::PeerFiles>) -> Option<presence_tls::ServerTlsFiles> {
    Some(presence_tls::ServerTlsFiles {
        cert: args.tls_cert.clone()?,
        key: args.tls_key.clone()?,
        client_ca: args.tls_client_ca.clone(),
        peer,
        service_identities: args.tls_service_identities.clone(),
    })
}

/// Everything `serve` needs, resolved.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) listen: ListenAddr,
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// Threads of the runtime that serves requests.
    pub(crate) worker_threads: usize,
    pub(crate) server: ServerConfig,
    /// Things the operator should hear at start, logged once logging is up.
    pub(crate) warnings: Vec<String>,
}

/// A `--service-token` shorter than this is warned of at start: 32
/// characters of hex are 128 bits, the least a secret should hold.
const SHORTEST_UNWARNED_TOKEN: usize = 32;

/// The config file's keys are the flags' names, `-` written `_`
/// (`--max-ttl-ms` is `max_ttl_ms`): the one list of settings is the flags',
/// so the two cannot drift apart.
fn flag_keys() -> Vec<String> {
    let serve = <ServeArgs as clap::Args>::augment_args(clap::Command::new("serve"));
    let longs = serve.get_arguments().filter_map(|arg| arg.get_long()).filter(|long| *long != "config");
    longs.map(|long| long.replace('-', "_")).collect()
}

/// Keys of earlier versions, named after the list a repeatable flag fills,
/// and the flag's key that replaces each: still read, with a warning.
const PLURAL_KEYS: [(&str, &str); 6] = [
    ("service_tokens", "service_token"),
    ("viewer_jwt_audiences", "viewer_jwt_audience"),
    ("feed_webhooks", "feed_webhook"),
    ("feed_webhook_secrets", "feed_webhook_secret"),
    ("cors_origins", "cors_origin"),
    ("tls_service_identities", "tls_service_identity"),
];

/// Checks a config file's keys against the flags': an old plural key is
/// taken as its flag's key (with a warning in `warnings`), an unknown key is
/// refused naming the nearest flag's key.
fn file_keys_as_flags(table: &mut toml::Table, warnings: &mut Vec<String>) -> Result<(), String> {
    for (plural, key) in PLURAL_KEYS {
        let Some(value) = table.remove(plural) else { continue };
        if table.contains_key(key) {
            return Err(format!("`{plural}` and `{key}` are one setting: keep `{key}` (as the flag --{})", flag(key)));
        }
        warnings.push(format!(
            "config key `{plural}` is now `{key}`, named as the flag --{} is; `{plural}` is still read, for now",
            flag(key)
        ));
        table.insert(key.to_owned(), value);
    }
    let known = flag_keys();
    let mut unknown: Vec<&String> = table.keys().filter(|key| !known.contains(key)).collect();
    unknown.sort();
    let Some(first) = unknown.first() else { return Ok(()) };
    let nearest = known
        .iter()
        .map(|key| (strsim::damerau_levenshtein(first, key), key))
        .filter(|(distance, key)| {
            *distance <= (key.len() / 3).max(2) || key.starts_with(first.as_str()) || first.starts_with(key.as_str())
        })
        .min();
    let hint = match nearest {
        Some((_, key)) => format!("did you mean `{key}` (--{})?", flag(key)),
        None => "keys are the flags' names with `_` for `-`: `presenced serve --help` lists them".to_owned(),
    };
    Err(format!("unknown key `{first}`: {hint}"))
}

/// The flag whose config key is `key`.
fn flag(key: &str) -> String {
    key.replace('_', "-")
}

/// Why the configuration cannot be used.
#[derive(Debug, thiserror::Error)]
pub(crate) enum SettingsError {
    #[error("cannot read config file {path}: {source}")]
    ReadFile { path: PathBuf, source: std::io::Error },
    #[error("invalid config file {path}: {message}")]
    ParseFile { path: PathBuf, message: String },
    #[error("cannot read --viewer-jwt-public-key {path}: {source}")]
    ReadKey { path: PathBuf, source: std::io::Error },
    #[error("cannot read {flag} {path}: {source}")]
    ReadFlagFile { flag: &'static str, path: PathBuf, source: std::io::Error },
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl ServeArgs {
    /// These settings over those of the `--config` file, if there is one,
    /// with what the file should change said as warnings.
    fn over_the_file(self, warnings: &mut Vec<String>) -> Result<ServeArgs, SettingsError> {
        let Some(path) = self.config.clone() else { return Ok(self) };
        let text =
            std::fs::read_to_string(&path).map_err(|source| SettingsError::ReadFile { path: path.clone(), source })?;
        let invalid = |message: String| SettingsError::ParseFile { path: path.clone(), message };
        let mut table: toml::Table = toml::from_str(&text).map_err(|err| invalid(err.message().to_owned()))?;
        file_keys_as_flags(&mut table, warnings).map_err(invalid)?;
        // Parsed into the settings, so that a value of the wrong type is
        // refused by its key.
        let file: ServeArgs = table.try_into().map_err(|err: toml::de::Error| invalid(err.message().to_owned()))?;
        let table = |args: &ServeArgs| {
            toml::Table::try_from(args)
                .map_err(|err| SettingsError::Invalid(format!("a setting is out of range: {err}")))
        };
        let mut merged = table(&file)?;
        merged.extend(table(&self)?);
        let mut merged: ServeArgs =
            merged.try_into().map_err(|err: toml::de::Error| invalid(err.message().to_owned()))?;
        merged.config = self.config;
        Ok(merged)
    }

    /// Merges flags and environment (clap has already applied those, flags
    /// first) with the config file and the defaults, and validates the result.
    pub(crate) fn resolve(self) -> Result<Settings, SettingsError> {
        let mut warnings = Vec::new();
        let args = self.over_the_file(&mut warnings)?;
        let mut server = ServerConfig::default();
        args.apply(&mut server);
        server.store.validate().map_err(|err| SettingsError::Invalid(err.to_string()))?;
        let at_least_one = |name: &str, value: usize| match value {
            0 => Err(SettingsError::Invalid(format!("{name} must be at least 1"))),
            value => Ok(value),
        };
        at_least_one("expiry-batch", server.expiry_batch)?;
        at_least_one("watch-buffer", server.watch_buffer)?;
        at_least_one("room-member-cap", server.room_member_cap)?;
        at_least_one("lease-queue", server.lease_queue)?;
        at_least_one("max-connections", server.max_connections)?;
        at_least_one("max-streams-per-connection", server.max_streams_per_connection as usize)?;
        if server.handshake_timeout.is_zero() {
            return Err(SettingsError::Invalid("handshake-timeout-ms must be at least 1".into()));
        }
        if let Some(workers) = args.lease_workers {
            server.lease_workers = at_least_one("lease-workers", workers)?;
        }
        let cpus = presence_server::cpus();
        let worker_threads = at_least_one("worker-threads", args.worker_threads.unwrap_or(cpus))?;
        if server.last_seen_granularity.is_zero() {
            return Err(SettingsError::Invalid("last-seen-granularity-ms must be at least 1".into()));
        }
        if server.feed_retention.is_zero() {
            return Err(SettingsError::Invalid(
                "feed-retention-ms must be at least 1 (turn the feed off with --feed-retention-bytes 0)".into(),
            ));
        }
        server.feed_retention_bytes = args.feed_retention_bytes.or(server.feed_retention_bytes);
        server.feed_webhooks = webhook_config(&args)?;
        server.restart_grace = args.restart_grace_ms.map(Duration::from_millis).or(server.restart_grace);
        server.data_dir = args.data_dir.clone().or(server.data_dir);
        server.restore = args.restore.clone();
        server.cors_origins = args.cors_origins.clone();
        let listen = args.listen.unwrap_or(ListenAddr::Socket(DEFAULT_LISTEN));
        let mut cluster = cluster_config(ClusterArgs {
            etcd: args.etcd.clone(),
            node_id: args.node_id.clone(),
            advertise: args.advertise.clone(),
            slots: args.slots,
            prefix: args.etcd_prefix.clone(),
            lease_ttl_ms: args.etcd_lease_ttl_ms,
            ride_out_ms: args.etcd_ride_out_ms,
            settle_ms: args.cluster_settle_ms,
            rebalance: args.cluster_rebalance,
        })?;
        let tls = tls_settings(&args, cluster.as_mut())?;
        server.cluster = cluster;
        let viewer_jwt_public_key_pem = match args.viewer_jwt_public_key {
            Some(path) => Some(std::fs::read(&path).map_err(|source| SettingsError::ReadKey { path, source })?),
            None => None,
        };
        server.auth = presence_server::AuthConfig {
            service_tokens: args.service_tokens,
            viewer_jwt_hs256_secret: args.viewer_jwt_hs256_secret,
            viewer_jwt_public_key_pem,
            credentials_file: args.credentials.clone(),
            jwt_leeway_secs: args.jwt_leeway_secs.unwrap_or(server.auth.jwt_leeway_secs),
            viewer_jwks: args.viewer_jwks.clone(),
            viewer_jwks_ca: args.viewer_jwks_ca.clone(),
            viewer_jwks_refresh: args.viewer_jwks_refresh_ms.map_or(Duration::ZERO, Duration::from_millis),
            viewer_jwt_audiences: args.viewer_jwt_audiences.clone(),
            viewer_jwt_issuer: args.viewer_jwt_issuer.clone(),
        };
        server.audit_log = args.audit_log.clone();
        let peer_token = match &args.peer_token_file {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map_err(|source| SettingsError::ReadFlagFile {
                        flag: "--peer-token-file",
                        path: path.clone(),
                        source,
                    })?
                    .trim()
                    .to_owned(),
            ),
            None => server.auth.service_tokens.first().cloned(),
        };
        if let Some(cluster) = &mut server.cluster {
            // A node calls the others (hands its slots over as it drains,
            // syncs groups and rooms) with this token.
            cluster.peer_token = peer_token;
        }
        let auth = &server.auth;
        let open = auth.service_tokens.is_empty()
            && auth.credentials_file.is_none()
            && auth.viewer_jwks.is_none()
            && auth.viewer_jwt_hs256_secret.is_none()
            && auth.viewer_jwt_public_key_pem.is_none();
        if open && !args.insecure && !listen.is_loopback() {
            return Err(SettingsError::Invalid(format!(
                "no credentials are configured, so presenced runs open and listens only on loopback; \
                 {listen} is not (configure --credentials, --service-token or viewer JWT keys, or pass --insecure)"
            )));
        }
        for (index, token) in server.auth.service_tokens.iter().enumerate() {
            if token.len() < SHORTEST_UNWARNED_TOKEN {
                warnings.push(format!(
                    "--service-token #{}: {} characters can be guessed; a token from `presenced token new` has 256 \
                     random bits (and --credentials gives it a name and scopes)",
                    index + 1,
                    token.len()
                ));
            }
        }
        server.tls = tls;
        if server.tls.is_none() && !open && !args.allow_plaintext && !listen.is_loopback() {
            warnings.push(format!(
                "serving plaintext on {listen}: service tokens and viewer JWTs cross the network in the clear; \
                 serve TLS with --tls-cert and --tls-key, or, behind a service mesh or a TLS-terminating proxy, \
                 pass --allow-plaintext to silence this"
            ));
        }
        Ok(Settings { listen, metrics_listen: args.metrics_listen, worker_threads, server, warnings })
    }

    /// The defaults shown in `--help`: the library's, plus the listening address.
    fn defaults() -> ServeArgs {
        ServeArgs {
            listen: Some(ListenAddr::Socket(DEFAULT_LISTEN)),
            ..ServeArgs::from_config(&ServerConfig::default())
        }
    }
}

/// `serve`'s command with `[default: …]` appended to the help of every
/// setting that has one, taken from the library's defaults, so that the help
/// cannot drift from them.
pub(crate) fn with_defaults_in_help(mut serve: clap::Command) -> clap::Command {
    let defaults = toml::Table::try_from(ServeArgs::defaults()).expect("the defaults are representable in TOML");
    for (key, value) in defaults {
        let shown = match value {
            toml::Value::String(text) => text,
            other => other.to_string(),
        };
        serve = serve.mut_arg(key, |arg| {
            let with_default = |help: Option<&clap::builder::StyledStr>| {
                format!("{} [default: {shown}]", help.map(ToString::to_string).unwrap_or_default())
            };
            let long = arg.get_long_help().map(|help| with_default(Some(help)));
            let arg = arg.clone().help(with_default(arg.get_help()));
            match long {
                Some(long) => arg.long_help(long),
                None => arg,
            }
        });
    }
    serve
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{CommandFactory, FromArgMatches, Parser};
    use presence_core::StoreConfig;

    #[derive(Debug, Parser)]
    struct Harness {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn resolve(argv: &[&str]) -> Result<Settings, SettingsError> {
        Harness::try_parse_from(std::iter::once("serve").chain(argv.iter().copied())).unwrap().args.resolve()
    }

    /// A scratch config file holding `text`, removed on drop.
    struct ConfigFile(PathBuf);

    impl ConfigFile {
        fn new(name: &str, text: &str) -> Self {
            let dir = std::env::temp_dir().join(format!("presenced-config-{name}-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let path = dir.join("presenced.toml");
            std::fs::write(&path, text).unwrap();
            ConfigFile(path)
        }

        fn path(&self) -> &str {
            self.0.to_str().unwrap()
        }
    }

    impl Drop for ConfigFile {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(self.0.parent().unwrap());
        }
    }

    #[test]
    fn defaults_follow_the_api() {
        let settings = resolve(&[]).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(settings.server.store, StoreConfig::default());
        // The contract's numbers, so that a change of the library's defaults is seen here too.
        let store = &settings.server.store;
        assert_eq!((store.min_ttl_ms, store.default_ttl_ms, store.max_ttl_ms), (1_000, 45_000, 3_600_000));
    }

    #[test]
    fn an_empty_configuration_resolves_to_the_library_defaults_field_by_field() {
        let resolved = resolve(&[]).unwrap().server;
        assert_eq!(format!("{resolved:#?}"), format!("{:#?}", ServerConfig::default()));
    }

    #[test]
    fn the_defaults_shown_in_help_resolve_back_to_the_library_defaults() {
        // Both directions of the mapping agree: a typo in one of them (a
        // setting mapped to the wrong field) makes these differ.
        let mut server = fast_nonsense();
        ServeArgs::defaults().apply(&mut server);
        assert_eq!(format!("{server:#?}"), format!("{:#?}", ServerConfig::default()));
    }

    /// A configuration whose every mapped field differs from the default.
    fn fast_nonsense() -> ServerConfig {
        let defaults = ServerConfig::default();
        let store = StoreConfig {
            shards: 2,
            min_ttl_ms: 3,
            default_ttl_ms: 4,
            max_ttl_ms: 5,
            min_renew_interval_ms: 6,
            forget_offline_after_ms: 7,
            // Not a flag yet.
            offline_grace_ms: 0,
            active_window_ms: 19,
        };
        ServerConfig {
            store,
            expiry_batch: 8,
            shutdown_grace: Duration::from_millis(9),
            watch_buffer: 10,
            watch_delivery_tick: Duration::from_millis(29),
            lease_queue: 11,
            connection_threads: 12,
            checkpoint_interval: Duration::from_millis(13),
            activity_write_interval: Duration::from_millis(14),
            default_visibility: Visibility::Nobody,
            last_seen_granularity: Duration::from_millis(15),
            max_connections: 16,
            handshake_timeout: Duration::from_millis(17),
            max_streams_per_connection: 18,
            console: false,
            ..defaults
        }
    }

    #[test]
    fn help_shows_the_library_defaults() {
        let command = with_defaults_in_help(Harness::command());
        let help = command.clone().render_long_help().to_string();
        let store = StoreConfig::default();
        let server = ServerConfig::default();
        for (flag, default) in [
            ("--listen", "127.0.0.1:50051".to_owned()),
            ("--min-ttl-ms", store.min_ttl_ms.to_string()),
            ("--default-ttl-ms", store.default_ttl_ms.to_string()),
            ("--max-ttl-ms", store.max_ttl_ms.to_string()),
            ("--min-renew-interval-ms", store.min_renew_interval_ms.to_string()),
            ("--forget-offline-after-ms", store.forget_offline_after_ms.to_string()),
            ("--shards", store.shards.to_string()),
            ("--expiry-batch", server.expiry_batch.to_string()),
            ("--shutdown-grace-ms", server.shutdown_grace.as_millis().to_string()),
            ("--push-handoff-ms", server.push_handoff.as_millis().to_string()),
            ("--active-window-ms", store.active_window_ms.to_string()),
            ("--watch-buffer", server.watch_buffer.to_string()),
            ("--watch-delivery-tick-ms", server.watch_delivery_tick.as_millis().to_string()),
            ("--lease-queue", server.lease_queue.to_string()),
            ("--connection-threads", server.connection_threads.to_string()),
            ("--checkpoint-interval-ms", server.checkpoint_interval.as_millis().to_string()),
            ("--activity-write-interval-ms", server.activity_write_interval.as_millis().to_string()),
            ("--default-visibility", "audience".to_owned()),
            ("--last-seen-granularity-ms", server.last_seen_granularity.as_millis().to_string()),
            ("--max-connections", server.max_connections.to_string()),
            ("--handshake-timeout-ms", server.handshake_timeout.as_millis().to_string()),
            ("--max-streams-per-connection", server.max_streams_per_connection.to_string()),
            ("--console", server.console.to_string()),
        ] {
            let start = help.find(&format!("{flag} ")).unwrap_or_else(|| panic!("{flag} missing from help:\n{help}"));
            let entry = &help[start..];
            let entry = &entry[..entry[2..].find("\n  -").map_or(entry.len(), |end| end + 2)];
            assert!(entry.contains(&format!("[default: {default}]")), "{flag} must show [default: {default}]: {entry}");
        }
        // The patched command still parses what the plain one does.
        let matches = command.try_get_matches_from(["serve", "--min-ttl-ms", "5"]).unwrap();
        assert_eq!(Harness::from_arg_matches(&matches).unwrap().args.min_ttl_ms, Some(5));
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let file = ConfigFile::new("layers", "listen = \"127.0.0.1:7000\"\nmin_ttl_ms = 500\nshards = 8\n");
        let settings = resolve(&["--config", file.path(), "--min-ttl-ms", "200"]).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(settings.server.store.min_ttl_ms, 200);
        assert_eq!(settings.server.store.shards, 8);
        assert_eq!(settings.server.store.max_ttl_ms, StoreConfig::default().max_ttl_ms);
    }

    #[test]
    fn every_kind_of_setting_is_read_from_the_file() {
        let file = ConfigFile::new(
            "kinds",
            "default_visibility = \"nobody\"\nservice_tokens = [\"a\", \"b\"]\ninsecure = true\n\
             listen = \"0.0.0.0:0\"\nforget_offline_after_ms = 1234\nrestart_grace_ms = 77\n\
             data_dir = \"/tmp/somewhere\"\nlast_seen_granularity_ms = 1000\n",
        );
        let settings = resolve(&["--config", file.path()]).unwrap();
        assert_eq!(settings.server.default_visibility, Visibility::Nobody);
        assert_eq!(settings.server.auth.service_tokens, ["a", "b"]);
        assert_eq!(settings.server.store.forget_offline_after_ms, 1234);
        assert_eq!(settings.server.restart_grace, Some(Duration::from_millis(77)));
        assert_eq!(settings.server.data_dir, Some(PathBuf::from("/tmp/somewhere")));
        assert_eq!(settings.server.last_seen_granularity, Duration::from_secs(1));
        // The command line's tokens replace the file's rather than adding to them.
        let settings = resolve(&["--config", file.path(), "--service-token", "c"]).unwrap();
        assert_eq!(settings.server.auth.service_tokens, ["c"]);
        assert_eq!(
            resolve(&["--default-visibility", "everyone"]).unwrap().server.default_visibility,
            Visibility::Everyone
        );
    }

    #[test]
    fn connection_threads_come_from_the_flag_or_the_file_and_default_to_one_per_cpu() {
        assert_eq!(resolve(&[]).unwrap().server.connection_threads, presence_server::cpus());
        assert_eq!(resolve(&["--connection-threads", "0"]).unwrap().server.connection_threads, 0);
        assert_eq!(resolve(&["--connection-threads", "2"]).unwrap().server.connection_threads, 2);
        let file = ConfigFile::new("threads", "connection_threads = 3\n");
        assert_eq!(resolve(&["--config", file.path()]).unwrap().server.connection_threads, 3);
        let flag_wins = resolve(&["--config", file.path(), "--connection-threads", "1"]).unwrap();
        assert_eq!(flag_wins.server.connection_threads, 1);
    }

    #[test]
    fn invalid_settings_are_refused_with_a_reason() {
        let err = resolve(&["--min-ttl-ms", "5000", "--default-ttl-ms", "1000"]).unwrap_err();
        assert!(err.to_string().contains("min-ttl-ms"), "{err}");
        let err = resolve(&["--worker-threads", "0"]).unwrap_err();
        assert!(err.to_string().contains("worker-threads must be at least 1"), "{err}");
        assert_eq!(resolve(&["--worker-threads", "1"]).unwrap().worker_threads, 1);
        for zero in ["--max-connections", "--max-streams-per-connection", "--handshake-timeout-ms"] {
            let err = resolve(&[zero, "0"]).unwrap_err();
            assert!(err.to_string().contains(&format!("{} must be at least 1", &zero[2..])), "{err}");
        }
        let err = resolve(&["--shards", "3"]).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
        // E6: more than 30 s of flap damping is refused at start; R6: a member cap of 0 too.
        let err = resolve(&["--offline-grace-ms", "30001"]).unwrap_err();
        assert!(err.to_string().contains("offline-grace-ms"), "{err}");
        assert_eq!(resolve(&["--offline-grace-ms", "30000"]).unwrap().server.store.offline_grace_ms, 30_000);
        let err = resolve(&["--room-member-cap", "0"]).unwrap_err();
        assert!(err.to_string().contains("room-member-cap must be at least 1"), "{err}");
        assert_eq!(resolve(&["--room-member-cap", "5"]).unwrap().server.room_member_cap, 5);
        let err = resolve(&["--config", "/nonexistent/presenced.toml"]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/presenced.toml"), "{err}");
        let err = Harness::try_parse_from(["serve", "--default-visibility", "friends"]).unwrap_err();
        assert!(err.to_string().contains("friends") && err.to_string().contains("--default-visibility"), "{err}");
    }

    #[test]
    fn t1_tls_settings_are_checked_together_and_a_cluster_takes_the_service_files_by_default() {
        let err = Harness::try_parse_from(["serve", "--tls-cert", "c.pem"]).unwrap_err().to_string();
        assert!(err.contains("--tls-key"), "{err}");
        let err =
            resolve(&["--tls-cert", "c.pem", "--tls-key", "k.pem", "--peer-tls-ca", "ca.pem"]).unwrap_err().to_string();
        assert!(err.contains("needs --etcd"), "{err}");
        let err = resolve(&["--etcd-ca", "e.pem"]).unwrap_err().to_string();
        assert!(err.contains("needs --etcd"), "{err}");
        let cluster = ["--etcd", "https://e1:2379", "--node-id", "a", "--advertise", "a.internal:50051"];
        let tls = ["--tls-cert", "c.pem", "--tls-key", "k.pem"];
        let err = resolve(&[&cluster[..], &tls[..]].concat()).unwrap_err().to_string();
        assert!(err.contains("--peer-tls-ca") && err.contains("--tls-client-ca"), "the cluster's CA is needed: {err}");
        let config = resolve(&[&cluster[..], &tls[..], &["--tls-client-ca", "clients.pem"]].concat()).unwrap().server;
        let peer = config.tls.as_ref().and_then(|tls| tls.peer.clone()).expect("node-to-node TLS");
        assert_eq!(
            (peer.cert.to_str(), peer.ca.to_str(), peer.from_service_flags),
            (Some("c.pem"), Some("clients.pem"), true)
        );
        let cluster_config = config.cluster.expect("cluster mode");
        assert!(cluster_config.peer_tls.expect("peer client TLS").as_cluster_node);
        assert_eq!(cluster_config.etcd_tls.expect("https:// etcd").ca, None, "the system's roots");
        let mixed = ["--etcd", "https://e1:2379,http://e2:2379", "--node-id", "a", "--advertise", "a:1"];
        assert!(resolve(&mixed).unwrap_err().to_string().contains("all https:// or all http://"));
        let plain = ["--etcd", "http://e1:2379", "--node-id", "a", "--advertise", "a:1", "--etcd-ca", "e.pem"];
        assert!(resolve(&plain).unwrap_err().to_string().contains("need https:// --etcd URLs"));
    }

    #[test]
    fn c5_cluster_mode_needs_etcd_a_name_and_an_address_and_nothing_else_turns_it_on() {
        assert!(resolve(&[]).unwrap().server.cluster.is_none(), "a single node by default");
        let err = resolve(&["--node-id", "a"]).unwrap_err().to_string();
        assert!(err.contains("--node-id needs --etcd"), "{err}");
        let err = resolve(&["--slots", "64"]).unwrap_err().to_string();
        assert!(err.contains("--slots needs --etcd"), "{err}");
        let err = resolve(&["--etcd", "http://127.0.0.1:2379"]).unwrap_err().to_string();
        assert!(err.contains("--node-id"), "{err}");
        let err = resolve(&["--etcd", "http://e:2379", "--node-id", "a"]).unwrap_err().to_string();
        assert!(err.contains("--advertise"), "{err}");
        let cluster = ["--etcd", "http://e1:2379,http://e2:2379", "--node-id", "a", "--advertise", "10.0.0.1:50051"];
        let config = resolve(&cluster).unwrap().server.cluster.expect("cluster mode");
        assert_eq!(config.etcd, ["http://e1:2379", "http://e2:2379"]);
        assert_eq!((config.node_id.as_str(), config.advertise.as_str()), ("a", "10.0.0.1:50051"));
        assert_eq!((config.slots, config.prefix.as_str()), (1024, "/presenced/"));
        let with = |extra: &[&str]| resolve(&[&cluster[..], extra].concat());
        assert_eq!(
            with(&["--slots", "64", "--etcd-prefix", "/prod"]).unwrap().server.cluster.unwrap().prefix,
            "/prod/"
        );
        for bad in [&["--slots", "0"][..], &["--slots", "70000"], &["--etcd-lease-ttl-ms", "1500"]] {
            assert!(with(bad).is_err(), "{bad:?} is refused");
        }
        assert!(config.rebalance, "the coordinator evens the slots out by default");
        assert!(!with(&["--cluster-rebalance", "false"]).unwrap().server.cluster.unwrap().rebalance);
        let err = resolve(&["--cluster-rebalance", "false"]).unwrap_err().to_string();
        assert!(err.contains("--cluster-rebalance needs --etcd"), "{err}");
    }

    #[test]
    fn cors_origins_and_the_console_come_from_flags_the_environment_form_and_the_file() {
        let settings = resolve(&[]).unwrap().server;
        assert_eq!((settings.cors_origins.len(), settings.console), (0, true));
        let settings =
            resolve(&["--cors-origin", "https://a.example", "--cors-origin", "http://localhost:3000"]).unwrap().server;
        assert_eq!(settings.cors_origins, ["https://a.example", "http://localhost:3000"]);
        // The environment's form: one value, separated by commas.
        let settings = resolve(&["--cors-origin", "https://a.example,https://b.example"]).unwrap().server;
        assert_eq!(settings.cors_origins, ["https://a.example", "https://b.example"]);
        assert!(!resolve(&["--console", "false"]).unwrap().server.console);
        let file = ConfigFile::new("web", "cors_origins = [\"https://c.example\"]\nconsole = false\n");
        let settings = resolve(&["--config", file.path()]).unwrap().server;
        assert_eq!((settings.cors_origins, settings.console), (vec!["https://c.example".to_owned()], false));
        let err = Harness::try_parse_from(["serve", "--console", "maybe"]).unwrap_err();
        assert!(err.to_string().contains("--console"), "{err}");
    }

    #[test]
    fn f4_webhooks_take_their_secrets_from_the_flag_or_the_file_but_not_both() {
        let secret = "s".repeat(32);
        let hook = ["--feed-webhook", "http://127.0.0.1:9/a", "--feed-webhook", "http://127.0.0.1:9/b#kinds=flip"];
        let webhooks =
            resolve(&[&hook[..], &["--feed-webhook-secret", &secret]].concat()).unwrap().server.feed_webhooks;
        assert_eq!(webhooks.urls, ["http://127.0.0.1:9/a", "http://127.0.0.1:9/b#kinds=flip"]);
        assert_eq!(webhooks.secrets, std::slice::from_ref(&secret));
        assert!(!format!("{webhooks:?}").contains(&secret), "a secret is never shown: {webhooks:?}");
        let file = ConfigFile::new("webhook-secrets", &format!("{secret}\n\n{}\n", "t".repeat(32)));
        let from_file = resolve(&[&hook[..], &["--feed-webhook-secret-file", file.path()]].concat()).unwrap();
        assert_eq!(from_file.server.feed_webhooks.secrets, [secret.clone(), "t".repeat(32)]);
        let both = [&hook[..], &["--feed-webhook-secret", &secret, "--feed-webhook-secret-file", file.path()]].concat();
        assert!(resolve(&both).unwrap_err().to_string().contains("give the secrets one way"));
        let missing = resolve(&["--feed-webhook-secret-file", "/nonexistent/secret"]).unwrap_err().to_string();
        assert!(missing.contains("--feed-webhook-secret-file /nonexistent/secret"), "{missing}");
    }

    /// The config file's keys are the flags' names: every flag (but
    /// --config) is a key the file takes, and every key a flag.
    #[test]
    fn every_flag_is_a_config_key_and_every_config_key_a_flag() {
        // serde names every field it takes when it meets one it does not.
        let refused = toml::from_str::<ServeArgs>("not_a_setting = 1").unwrap_err().message().to_owned();
        let listed = refused.split_once("expected one of ").expect("serde lists the fields").1;
        let mut fields: Vec<String> = listed.split(", ").map(|field| field.trim_matches('`').to_owned()).collect();
        let mut flags = flag_keys();
        fields.sort();
        flags.sort();
        assert_eq!(fields, flags);
        assert!(flags.len() > 60 && flags.contains(&"service_token".to_owned()), "{flags:?}");
    }

    #[test]
    fn an_old_plural_key_is_read_with_a_warning_and_an_unknown_key_names_the_nearest() {
        let file = ConfigFile::new(
            "plural",
            "service_tokens = [\"test-only-token\"]\ncors_origins = [\"https://a.example\"]\n",
        );
        let settings = resolve(&["--config", file.path()]).unwrap();
        assert_eq!(settings.server.auth.service_tokens, ["test-only-token"]);
        assert_eq!(settings.server.cors_origins, ["https://a.example"]);
        let said = settings.warnings.join("\n");
        assert!(
            said.contains("config key `service_tokens` is now `service_token`, named as the flag --service-token"),
            "{said}"
        );
        assert!(said.contains("`cors_origins` is now `cors_origin`"), "{said}");
        let both = ConfigFile::new("both", "service_tokens = [\"a\"]\nservice_token = [\"b\"]\n");
        let err = resolve(&["--config", both.path()]).unwrap_err().to_string();
        assert!(err.contains("`service_tokens` and `service_token` are one setting"), "{err}");
        for (text, hint) in [
            ("max_ttl = 5000\n", "unknown key `max_ttl`: did you mean `max_ttl_ms` (--max-ttl-ms)?"),
            ("tls_certificate = \"a.pem\"\n", "unknown key `tls_certificate`: did you mean `tls_cert` (--tls-cert)?"),
            ("listen_addr = \"127.0.0.1:1\"\n", "did you mean `listen` (--listen)?"),
            ("colour = \"blue\"\n", "unknown key `colour`: keys are the flags' names with `_` for `-`"),
        ] {
            let file = ConfigFile::new("unknown", text);
            let err = resolve(&["--config", file.path()]).unwrap_err().to_string();
            assert!(err.contains(hint), "{text:?}: {err}");
            assert!(err.len() < 300, "one short line, not every key: {err}");
        }
    }

    #[test]
    fn listen_takes_an_address_or_localhost_both_loopbacks_from_the_flag_and_the_file() {
        assert_eq!(resolve(&["--listen", "localhost:7000"]).unwrap().listen, ListenAddr::Localhost(7000));
        assert_eq!(
            resolve(&["--listen", "[::1]:7000"]).unwrap().listen,
            ListenAddr::Socket("[::1]:7000".parse().unwrap())
        );
        let file = ConfigFile::new("localhost", "listen = \"localhost:0\"\n");
        assert_eq!(resolve(&["--config", file.path()]).unwrap().listen, ListenAddr::Localhost(0));
        // Both loopbacks: an open server may listen there.
        assert!(resolve(&["--listen", "localhost:0"]).unwrap().warnings.is_empty());
        let refused = Harness::try_parse_from(["serve", "--listen", "localhost"]).unwrap_err().to_string();
        assert!(refused.contains("is not IP:PORT or localhost:PORT"), "{refused}");
    }

    /// presenced.example.toml, every setting of which is commented out.
    const EXAMPLE: &str = include_str!("../presenced.example.toml");

    /// The example's settings, `(key, "key = value")`: its commented lines
    /// of that shape, and not prose that happens to hold " = ".
    fn example_settings() -> impl Iterator<Item = (&'static str, &'static str)> {
        EXAMPLE.lines().filter_map(|line| line.strip_prefix("# ")).filter_map(|setting| {
            let (key, _) = setting.split_once(" = ")?;
            (!key.contains(' ')).then_some((key, setting))
        })
    }

    /// One setting means the same as a flag and as a key: for each setting
    /// of presenced.example.toml, given alone, the start is refused from the
    /// file exactly when it is refused from the flag (clap's own checks, such
    /// as a flag that needs another, included).
    #[test]
    fn each_setting_alone_is_refused_from_the_file_exactly_when_it_is_from_its_flag() {
        let mut compared = 0;
        for (key, setting) in example_settings() {
            let flag = format!("--{}", key.replace('_', "-"));
            let value: toml::Value = toml::from_str::<toml::Table>(setting).unwrap().remove(key).unwrap();
            let (argv, line): (Vec<String>, String) = match &value {
                // A flag that takes no value (--insecure) is the key set to true.
                toml::Value::Boolean(_) if matches!(key, "insecure" | "allow_plaintext") => {
                    (vec![flag.clone()], format!("{key} = true"))
                }
                toml::Value::Array(values) => {
                    (vec![flag.clone(), values[0].as_str().unwrap().to_owned()], format!("{key} = [{}]", values[0]))
                }
                toml::Value::String(text) => (vec![flag.clone(), text.clone()], setting.to_owned()),
                other => (vec![flag.clone(), other.to_string()], setting.to_owned()),
            };
            let argv: Vec<&str> = std::iter::once("serve").chain(argv.iter().map(String::as_str)).collect();
            let from_flag = Harness::try_parse_from(&argv)
                .map_err(|err| err.to_string())
                .and_then(|harness| harness.args.resolve().map(|_| ()).map_err(|err| err.to_string()));
            let file = ConfigFile::new("alone", &format!("{line}\n"));
            let from_file = resolve(&["--config", file.path()]).map(|_| ()).map_err(|err| err.to_string());
            assert_eq!(from_flag.is_ok(), from_file.is_ok(), "{value}: {flag}: {from_flag:?}; the file: {from_file:?}");
            compared += 1;
        }
        assert!(compared > 60, "{compared} settings");
    }

    /// presenced.example.toml names every flag once, and each of its
    /// settings, uncommented alone, is one the file takes.
    #[test]
    fn the_example_config_names_every_setting_once_and_each_line_of_it_parses() {
        let parse = |text: &str| -> Result<ServeArgs, String> {
            let mut table: toml::Table = toml::from_str(text).map_err(|err| err.to_string())?;
            file_keys_as_flags(&mut table, &mut Vec::new())?;
            table.try_into().map_err(|err: toml::de::Error| err.to_string())
        };
        parse(EXAMPLE).expect("the file as it is");
        let mut named = Vec::new();
        for (key, setting) in example_settings() {
            parse(setting).unwrap_or_else(|err| panic!("{setting:?}: {err}"));
            named.push(key.to_owned());
        }
        let mut flags = flag_keys();
        flags.sort();
        named.sort();
        assert_eq!(named, flags, "every setting once");
    }

    #[test]
    fn the_file_is_refused_by_key_and_by_value() {
        for (text, named) in [
            ("max_ttl = 5000\n", "max_ttl"),
            ("config = \"other.toml\"\n", "config"),
            ("min_ttl_ms = \"soon\"\n", "soon"),
            ("default_visibility = \"friends\"\n", "friends"),
        ] {
            let file = ConfigFile::new("refused", text);
            let err = resolve(&["--config", file.path()]).unwrap_err();
            assert!(err.to_string().contains(named), "{text:?}: {err}");
        }
    }

    /// T1, B7: a config file means what the flags mean: half a TLS setup
    /// given there (a certificate without its key, a client CA without a
    /// certificate) is refused as the same flags are, naming both the flag
    /// and the file's key, instead of serving plaintext.
    #[test]
    fn t1_half_a_tls_setup_in_a_config_file_is_refused_as_the_flags_are() {
        for (text, refusal) in [
            (
                "tls_cert = \"/etc/server.pem\"\n",
                "--tls-cert needs --tls-key (in a --config file: tls_cert needs tls_key)",
            ),
            ("tls_key = \"/etc/server-key.pem\"\n", "--tls-key needs --tls-cert"),
            ("tls_client_ca = \"/etc/ca.pem\"\n", "--tls-client-ca needs --tls-cert"),
        ] {
            let file = ConfigFile::new("half-tls", text);
            let err = resolve(&["--config", file.path()]).expect_err(text).to_string();
            assert!(err.contains(refusal), "{text:?}: {err}");
        }
        let file = ConfigFile::new(
            "half-tls-whole",
            "tls_cert = \"/nonexistent/server.pem\"\ntls_key = \"/nonexistent/server-key.pem\"\n",
        );
        let whole = resolve(&["--config", file.path()]);
        assert!(!whole.is_err_and(|err| err.to_string().contains("needs")), "a whole pair is not refused as half");
    }
}
