//! Configuration of `presenced serve`: flags, then environment, then a TOML
//! file, then defaults (contract O3). Every flag `--some-flag` also reads from
//! `PRESENCED_SOME_FLAG` and from the key `some_flag` of the `--config` file.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use presence_core::StoreConfig;
use presence_server::ServerConfig;
use serde::Deserialize;

/// The flags of `presenced serve`.
#[derive(Debug, Args)]
pub(crate) struct ServeArgs {
    /// A TOML file with any of the settings below (keys in snake_case).
    #[arg(long, env = "PRESENCED_CONFIG", value_name = "FILE")]
    config: Option<PathBuf>,
    /// The gRPC address; port 0 picks a free port. [default: 127.0.0.1:50051]
    #[arg(long, env = "PRESENCED_LISTEN", value_name = "ADDR")]
    listen: Option<SocketAddr>,
    /// The shortest lease TTL a request may ask for. [default: 1000]
    #[arg(long, env = "PRESENCED_MIN_TTL_MS", value_name = "MS")]
    min_ttl_ms: Option<u32>,
    /// The TTL of a request that asks for 0. [default: 45000]
    #[arg(long, env = "PRESENCED_DEFAULT_TTL_MS", value_name = "MS")]
    default_ttl_ms: Option<u32>,
    /// The longest lease TTL a request may ask for. [default: 3600000]
    #[arg(long, env = "PRESENCED_MAX_TTL_MS", value_name = "MS")]
    max_ttl_ms: Option<u32>,
    /// Renewals of a lease closer together than this (at most half its TTL) are
    /// acknowledged without a write; 0 turns the throttle off. [default: 7500]
    #[arg(long, env = "PRESENCED_MIN_RENEW_INTERVAL_MS", value_name = "MS")]
    min_renew_interval_ms: Option<u32>,
    /// Lease store shards, a power of two. [default: 64]
    #[arg(long, env = "PRESENCED_SHARDS", value_name = "N")]
    shards: Option<usize>,
    /// Users expired per shard per lock hold. [default: 1024]
    #[arg(long, env = "PRESENCED_EXPIRY_BATCH", value_name = "N")]
    expiry_batch: Option<usize>,
    /// How long a shutdown waits for open requests and connections. [default: 5000]
    #[arg(long, env = "PRESENCED_SHUTDOWN_GRACE_MS", value_name = "MS")]
    shutdown_grace_ms: Option<u64>,
    /// The Prometheus endpoint (`GET /metrics`); none unless set.
    #[arg(long, env = "PRESENCED_METRICS_LISTEN", value_name = "ADDR")]
    metrics_listen: Option<SocketAddr>,
    /// Users with undelivered changes a viewer may have before it is resynced. [default: 4096]
    #[arg(long, env = "PRESENCED_WATCH_BUFFER", value_name = "N")]
    watch_buffer: Option<usize>,
    /// Lease batches that may wait for a worker before renewals are shed. [default: 256]
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
    /// 0 serves connections on the shared runtime, which serves Watch
    /// fan-out a little better. [default: 0]
    #[arg(long, env = "PRESENCED_CONNECTION_THREADS", value_name = "N")]
    connection_threads: Option<usize>,
    /// Keep checkpoints and durable data (settings, activity) here; without it
    /// everything is in memory only.
    #[arg(long, env = "PRESENCED_DATA_DIR", value_name = "DIR")]
    data_dir: Option<PathBuf>,
    /// How often the leases are checkpointed to the data directory. [default: 5000]
    #[arg(long, env = "PRESENCED_CHECKPOINT_INTERVAL_MS", value_name = "MS")]
    checkpoint_interval_ms: Option<u64>,
    /// After a restart, how long users online at the checkpoint are held online
    /// while their gateways reconnect. [default: the default TTL]
    #[arg(long, env = "PRESENCED_RESTART_GRACE_MS", value_name = "MS")]
    restart_grace_ms: Option<u64>,
    /// How often at most one user's activity is written to disk. [default: 60000]
    #[arg(long, env = "PRESENCED_ACTIVITY_WRITE_INTERVAL_MS", value_name = "MS")]
    activity_write_interval_ms: Option<u64>,
    /// A bearer token that service callers (gateways, admin tools) present;
    /// repeat it (or separate with commas in the environment) to rotate tokens
    /// without downtime.
    #[arg(long = "service-token", env = "PRESENCED_SERVICE_TOKEN", value_name = "TOKEN", value_delimiter = ',')]
    service_tokens: Vec<String>,
    /// The HS256 secret that signs viewers' JWTs.
    #[arg(long, env = "PRESENCED_VIEWER_JWT_HS256_SECRET", value_name = "SECRET")]
    viewer_jwt_hs256_secret: Option<String>,
    /// A PEM public key (RSA for RS256, Ed25519 for EdDSA) that verifies viewers' JWTs.
    #[arg(long, env = "PRESENCED_VIEWER_JWT_PUBLIC_KEY", value_name = "FILE")]
    viewer_jwt_public_key: Option<PathBuf>,
    /// With no credentials configured, allow listening on a non-loopback address.
    #[arg(long, env = "PRESENCED_INSECURE")]
    insecure: bool,
    /// The visibility of a user that chose none: everyone, audience or nobody. [default: audience]
    #[arg(long, env = "PRESENCED_DEFAULT_VISIBILITY", value_name = "VISIBILITY")]
    default_visibility: Option<String>,
    /// Last seen is released to viewers rounded down to this. [default: 300000]
    #[arg(long, env = "PRESENCED_LAST_SEEN_GRANULARITY_MS", value_name = "MS")]
    last_seen_granularity_ms: Option<u64>,
}

/// The same settings, as read from the `--config` file.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    listen: Option<SocketAddr>,
    min_ttl_ms: Option<u32>,
    default_ttl_ms: Option<u32>,
    max_ttl_ms: Option<u32>,
    min_renew_interval_ms: Option<u32>,
    shards: Option<usize>,
    expiry_batch: Option<usize>,
    shutdown_grace_ms: Option<u64>,
    metrics_listen: Option<SocketAddr>,
    watch_buffer: Option<usize>,
    lease_queue: Option<usize>,
    lease_workers: Option<usize>,
    worker_threads: Option<usize>,
    connection_threads: Option<usize>,
    data_dir: Option<PathBuf>,
    checkpoint_interval_ms: Option<u64>,
    restart_grace_ms: Option<u64>,
    activity_write_interval_ms: Option<u64>,
    #[serde(default)]
    service_tokens: Vec<String>,
    viewer_jwt_hs256_secret: Option<String>,
    viewer_jwt_public_key: Option<PathBuf>,
    insecure: Option<bool>,
    default_visibility: Option<String>,
    last_seen_granularity_ms: Option<u64>,
}

/// Everything `serve` needs, resolved.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) listen: SocketAddr,
    pub(crate) metrics_listen: Option<SocketAddr>,
    /// Threads of the runtime that serves requests.
    pub(crate) worker_threads: usize,
    pub(crate) server: ServerConfig,
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
    #[error("invalid configuration: {0}")]
    Invalid(String),
}

impl ServeArgs {
    /// Merges flags and environment (clap has already applied those, flags
    /// first) with the config file and the defaults, and validates the result.
    pub(crate) fn resolve(self) -> Result<Settings, SettingsError> {
        let file = match &self.config {
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|source| SettingsError::ReadFile { path: path.clone(), source })?;
                toml::from_str::<FileSettings>(&text)
                    .map_err(|err| SettingsError::ParseFile { path: path.clone(), message: err.message().to_owned() })?
            }
            None => FileSettings::default(),
        };
        let store_defaults = StoreConfig::default();
        let server_defaults = ServerConfig::default();
        let store = StoreConfig {
            shards: self.shards.or(file.shards).unwrap_or(store_defaults.shards),
            min_ttl_ms: self.min_ttl_ms.or(file.min_ttl_ms).unwrap_or(store_defaults.min_ttl_ms),
            default_ttl_ms: self.default_ttl_ms.or(file.default_ttl_ms).unwrap_or(store_defaults.default_ttl_ms),
            max_ttl_ms: self.max_ttl_ms.or(file.max_ttl_ms).unwrap_or(store_defaults.max_ttl_ms),
            min_renew_interval_ms: self
                .min_renew_interval_ms
                .or(file.min_renew_interval_ms)
                .unwrap_or(store_defaults.min_renew_interval_ms),
        };
        store.validate().map_err(|err| SettingsError::Invalid(err.to_string()))?;
        let at_least_one = |name: &str, value: Option<usize>, default: usize| match value.unwrap_or(default) {
            0 => Err(SettingsError::Invalid(format!("{name} must be at least 1"))),
            value => Ok(value),
        };
        let expiry_batch =
            at_least_one("expiry-batch", self.expiry_batch.or(file.expiry_batch), server_defaults.expiry_batch)?;
        let watch_buffer =
            at_least_one("watch-buffer", self.watch_buffer.or(file.watch_buffer), server_defaults.watch_buffer)?;
        let lease_queue =
            at_least_one("lease-queue", self.lease_queue.or(file.lease_queue), server_defaults.lease_queue)?;
        let lease_workers =
            at_least_one("lease-workers", self.lease_workers.or(file.lease_workers), server_defaults.lease_workers)?;
        let cpus = std::thread::available_parallelism().map_or(2, usize::from);
        let worker_threads = at_least_one("worker-threads", self.worker_threads.or(file.worker_threads), cpus)?;
        let listen = self.listen.or(file.listen).unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 50051)));
        let shutdown_grace = self
            .shutdown_grace_ms
            .or(file.shutdown_grace_ms)
            .map_or(server_defaults.shutdown_grace, std::time::Duration::from_millis);
        let service_tokens = if self.service_tokens.is_empty() { file.service_tokens } else { self.service_tokens };
        let public_key_path = self.viewer_jwt_public_key.or(file.viewer_jwt_public_key);
        let viewer_jwt_public_key_pem = match public_key_path {
            Some(path) => Some(std::fs::read(&path).map_err(|source| SettingsError::ReadKey { path, source })?),
            None => None,
        };
        let auth = presence_server::AuthConfig {
            service_tokens,
            viewer_jwt_hs256_secret: self.viewer_jwt_hs256_secret.or(file.viewer_jwt_hs256_secret),
            viewer_jwt_public_key_pem,
            ..presence_server::AuthConfig::default()
        };
        let open = auth.service_tokens.is_empty()
            && auth.viewer_jwt_hs256_secret.is_none()
            && auth.viewer_jwt_public_key_pem.is_none();
        let insecure = self.insecure || file.insecure.unwrap_or(false);
        if open && !insecure && !listen.ip().is_loopback() {
            return Err(SettingsError::Invalid(format!(
                "no credentials are configured, so presenced runs open and listens only on loopback; \
                 {listen} is not (configure --service-token / viewer JWT keys, or pass --insecure)"
            )));
        }
        let default_visibility = match self.default_visibility.or(file.default_visibility).as_deref() {
            None | Some("audience") => presence_server::privacy::Visibility::Audience,
            Some("everyone") => presence_server::privacy::Visibility::Everyone,
            Some("nobody") => presence_server::privacy::Visibility::Nobody,
            Some(other) => {
                return Err(SettingsError::Invalid(format!(
                    "default-visibility must be everyone, audience or nobody, got {other:?}"
                )));
            }
        };
        let last_seen_granularity = self
            .last_seen_granularity_ms
            .or(file.last_seen_granularity_ms)
            .map_or(server_defaults.last_seen_granularity, std::time::Duration::from_millis);
        if last_seen_granularity.is_zero() {
            return Err(SettingsError::Invalid("last-seen-granularity-ms must be at least 1".into()));
        }
        Ok(Settings {
            listen,
            metrics_listen: self.metrics_listen.or(file.metrics_listen),
            worker_threads,
            server: ServerConfig {
                store,
                expiry_batch,
                shutdown_grace,
                watch_buffer,
                lease_queue,
                lease_workers,
                connection_threads: self
                    .connection_threads
                    .or(file.connection_threads)
                    .unwrap_or(server_defaults.connection_threads),
                data_dir: self.data_dir.or(file.data_dir),
                checkpoint_interval: self
                    .checkpoint_interval_ms
                    .or(file.checkpoint_interval_ms)
                    .map_or(server_defaults.checkpoint_interval, std::time::Duration::from_millis),
                restart_grace: self.restart_grace_ms.or(file.restart_grace_ms).map(std::time::Duration::from_millis),
                activity_write_interval: self
                    .activity_write_interval_ms
                    .or(file.activity_write_interval_ms)
                    .map_or(server_defaults.activity_write_interval, std::time::Duration::from_millis),
                auth,
                default_visibility,
                last_seen_granularity,
            },
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Debug, Parser)]
    struct Harness {
        #[command(flatten)]
        args: ServeArgs,
    }

    fn resolve(argv: &[&str]) -> Result<Settings, SettingsError> {
        Harness::try_parse_from(std::iter::once("serve").chain(argv.iter().copied())).unwrap().args.resolve()
    }

    #[test]
    fn defaults_follow_the_api() {
        let settings = resolve(&[]).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:50051".parse().unwrap());
        assert_eq!(settings.server.store, StoreConfig::default());
    }

    #[test]
    fn flags_win_over_the_file_and_the_file_over_defaults() {
        let dir = std::env::temp_dir().join(format!("presenced-config-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("presenced.toml");
        std::fs::write(&path, "listen = \"127.0.0.1:7000\"\nmin_ttl_ms = 500\nshards = 8\n").unwrap();
        let settings = resolve(&["--config", path.to_str().unwrap(), "--min-ttl-ms", "200"]).unwrap();
        assert_eq!(settings.listen, "127.0.0.1:7000".parse().unwrap());
        assert_eq!(settings.server.store.min_ttl_ms, 200);
        assert_eq!(settings.server.store.shards, 8);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn connection_threads_come_from_the_flag_or_the_file_and_default_to_the_shared_runtime() {
        assert_eq!(resolve(&[]).unwrap().server.connection_threads, 0);
        assert_eq!(resolve(&["--connection-threads", "2"]).unwrap().server.connection_threads, 2);
        let dir = std::env::temp_dir().join(format!("presenced-config-threads-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("presenced.toml");
        std::fs::write(&path, "connection_threads = 3\n").unwrap();
        assert_eq!(resolve(&["--config", path.to_str().unwrap()]).unwrap().server.connection_threads, 3);
        let flag_wins = resolve(&["--config", path.to_str().unwrap(), "--connection-threads", "1"]).unwrap();
        assert_eq!(flag_wins.server.connection_threads, 1);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn invalid_settings_are_refused_with_a_reason() {
        let err = resolve(&["--min-ttl-ms", "5000", "--default-ttl-ms", "1000"]).unwrap_err();
        assert!(err.to_string().contains("min-ttl-ms"), "{err}");
        let err = resolve(&["--worker-threads", "0"]).unwrap_err();
        assert!(err.to_string().contains("worker-threads must be at least 1"), "{err}");
        assert_eq!(resolve(&["--worker-threads", "1"]).unwrap().worker_threads, 1);
        let err = resolve(&["--shards", "3"]).unwrap_err();
        assert!(err.to_string().contains("power of two"), "{err}");
        let err = resolve(&["--config", "/nonexistent/presenced.toml"]).unwrap_err();
        assert!(err.to_string().contains("/nonexistent/presenced.toml"), "{err}");
    }
}
