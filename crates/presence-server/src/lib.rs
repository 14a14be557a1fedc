//! The presenced gRPC service over the lease core.
//!
//! This crate owns everything between the network and [`presence_core::Store`]:
//! the store clock, the `presence.v1.Presence` service, the fan-out hub, the
//! expiry driver, health checking and reflection. [`serve`] takes an already
//! bound listener and a shutdown future, so tests bind `127.0.0.1:0` and the
//! binary stays a thin layer of configuration and signals.
//!
//! Three folders, one direction (`api → cluster → node`), and a fourth
//! beside them that any may use (`auth/`: callers, scopes, credentials, which
//! names none of the three): `node/` is one node's presence service and
//! names nothing of the others; `cluster/` is
//! what runs only with `--etcd`, plugged into the node through
//! `node::placement`; `api/` is the edge of the process, which decides once
//! per request whether it is answered here or by another node. [`serve`]
//! composes them: a single node gets the `SingleNode` placement and starts
//! no cluster task. The composition is three files beside the folders:
//! `config.rs` (the settings), `bootstrap.rs` (everything checked before
//! the listener is bound) and `serve.rs` (the tasks, the routes, the
//! shutdown).

mod allocator;
mod api;
pub use api::metrics_port::RenderMetrics;
mod audit;
mod auth;
mod bootstrap;
#[cfg(feature = "shuttle")]
pub mod checker;
mod cluster;
mod config;
mod error;
mod every_now;
// Also in the unit tests, so that `cargo test` checks the seeds and entry points.
#[cfg(any(test, feature = "fuzzing"))]
pub mod fuzzing;
pub mod metrics;
mod node;
mod outbound;
mod serve;
#[cfg(feature = "testing")]
pub mod testing;

use std::future::Future;

use tokio::net::TcpListener;

pub use audit::AuditLogError;
pub use auth::{AuthConfig, AuthConfigError, CredentialsError, Scope, Scopes, TOKEN_PREFIX, entry_for, new_token};
pub use bootstrap::PreparedServer;
pub use cluster::config::{ClusterConfig, DEFAULT_SLOTS, JoinError, MAX_SLOTS};
pub use config::{ServeError, ServerConfig, cpus};
pub use node::feed::webhook::WebhookConfig;
pub use node::feed::{DEFAULT_RETENTION_BYTES_IN_MEMORY, DEFAULT_RETENTION_BYTES_ON_DISK, DEFAULT_RETENTION_MS};
pub use node::hub::{Delivery, Subscription};
pub use node::leases::MAX_BATCH_ITEMS;
pub use node::privacy;
pub use node::settings::{MAX_SETTING_NAME_BYTES, MAX_SETTING_VALUE_BYTES, MAX_SETTINGS_PER_USER};
pub use node::wire::MAX_USERS_PER_REQUEST;

/// Largest request the server decodes; larger ones are refused before decoding.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// Serves presenced on `listener` until `shutdown` completes, then stops
/// accepting, ends open Watch streams (with `UNAVAILABLE`, which clients retry)
/// and returns once in-flight requests are answered. The same as
/// [`PreparedServer::prepare`] followed by [`PreparedServer::serve`]; a binary
/// that announces its address should prepare before it binds (B7).
pub async fn serve(
    listener: TcpListener,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    PreparedServer::prepare(config)?.serve(listener, shutdown).await
}
