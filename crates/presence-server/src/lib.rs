//! The presenced gRPC service over the lease core.
//!
//! This crate owns everything between the network and [`presence_core::Store`]:
//! the store clock, the `presence.v1.Presence` service, the fan-out hub, the
//! expiry driver, health checking and reflection. [`serve`] takes an already
//! bound listener and a shutdown future, so tests bind `127.0.0.1:0` and the
//! binary stays a thin layer of configuration and signals.

mod clock;
mod context;
mod expiry;
mod hub;
mod leases;
pub mod metrics;
mod ops;
mod service;
mod status;
mod watch;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use presence_core::{ConfigError, Store, StoreConfig};

use crate::context::Context;
use crate::leases::LeaseQueue;
use crate::metrics::Metrics;
use presence_proto::v1::presence_server::PresenceServer;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::sync::CancellationToken;

pub use clock::StoreClock;
pub use hub::{Delivery, Hub, Mailbox, Subscription};
pub use leases::{LeasesStream, MAX_BATCH_ITEMS};
pub use service::{MAX_USERS_PER_REQUEST, PresenceService};
pub use watch::WatchStream;

/// Largest request the server decodes; larger ones are refused before decoding.
pub const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

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
    /// Lease batches that may wait for a worker; beyond it renewals are shed (B2).
    pub lease_queue: usize,
    /// Tasks applying lease batches.
    pub lease_workers: usize,
}

impl Default for ServerConfig {
    fn default() -> Self {
        ServerConfig {
            store: StoreConfig::default(),
            expiry_batch: 1_024,
            shutdown_grace: Duration::from_secs(5),
            watch_buffer: 4_096,
            lease_queue: 256,
            lease_workers: std::thread::available_parallelism().map_or(2, usize::from),
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
}

/// Serves presenced on `listener` until `shutdown` completes, then stops
/// accepting, ends open Watch streams (with `UNAVAILABLE`, which clients retry)
/// and returns once in-flight requests are answered.
pub async fn serve(
    listener: TcpListener,
    config: ServerConfig,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let clock = StoreClock::start();
    let expiry_wake = Arc::new(Notify::new());
    let store = Arc::new(Store::new(config.store.clone(), clock.now())?.with_expiry_waker({
        let wake = Arc::clone(&expiry_wake);
        move || wake.notify_one()
    }));
    let stopping = CancellationToken::new();
    let context = Arc::new(Context {
        store: Arc::clone(&store),
        hub: Arc::new(Hub::default()),
        clock,
        metrics: Metrics::new(),
        watch_buffer: config.watch_buffer,
        stopping: stopping.clone(),
    });

    let expiry = tokio::spawn(expiry::run(Arc::clone(&context), expiry_wake, config.expiry_batch));
    tokio::spawn(metrics::export_store_counts(Arc::clone(&store), stopping.clone()));
    let lease_queue = LeaseQueue::start(Arc::clone(&context), config.lease_queue, config.lease_workers);

    let presence =
        PresenceServer::new(PresenceService::new(context, lease_queue)).max_decoding_message_size(MAX_REQUEST_BYTES);
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<PresenceServer<PresenceService>>().await;
    // Both reflection versions describe every service, each other included, so
    // that a client listing services through either sees the whole server.
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(presence_proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_reflection::pb::v1alpha::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;

    let local_addr = listener.local_addr().ok();
    tracing::info!(addr = ?local_addr, shards = config.store.shards, "serving");
    let stop_signal = {
        let stopping = stopping.clone();
        let health = health.clone();
        async move {
            shutdown.await;
            tracing::info!("shutting down: no new connections, ending watch streams");
            health.set_not_serving::<PresenceServer<PresenceService>>().await;
            stopping.cancel();
        }
    };
    let served = tonic::transport::Server::builder()
        .add_service(presence)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), stop_signal);
    // A client that keeps its connection open must not hold the shutdown up for
    // ever (hyper can wait on such connections indefinitely): after the grace
    // period the server stops waiting and its connections close with it.
    let grace_expired = async {
        stopping.cancelled().await;
        tokio::time::sleep(config.shutdown_grace).await;
    };
    let served = tokio::select! {
        served = served => served,
        () = grace_expired => {
            tracing::warn!(grace = ?config.shutdown_grace, "connections still open after the shutdown grace; closing them");
            Ok(())
        }
    };
    stopping.cancel();
    let _ = expiry.await;
    let stats = store.stats();
    tracing::info!(sessions = stats.sessions, online_users = stats.online_users, "stopped");
    served?;
    Ok(())
}
