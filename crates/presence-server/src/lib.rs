//! The presenced gRPC service over the lease core.
//!
//! This crate owns everything between the network and [`presence_core::Store`]:
//! the store clock, the `presence.v1.Presence` service, the fan-out hub, the
//! expiry driver, health checking and reflection. [`serve`] takes an already
//! bound listener and a shutdown future, so tests bind `127.0.0.1:0` and the
//! binary stays a thin layer of configuration and signals.
//!
//! Three folders, one direction (`api → cluster → node`): `node/` is one
//! node's presence service and names nothing of the others; `cluster/` is
//! what runs only with `--etcd`, plugged into the node through
//! `node::placement`; `api/` is the edge of the process, which decides once
//! per request whether it is answered here or by another node. [`serve`]
//! composes them: a single node gets the `SingleNode` placement and starts
//! no cluster task.

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
#[cfg(feature = "fuzzing")]
pub mod fuzzing;
pub mod metrics;
mod node;
mod outbound;
#[cfg(feature = "testing")]
pub mod testing;

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use presence_core::Store;

use crate::api::connections;
use crate::api::service::PresenceService;
use crate::api::web;
use crate::cluster::handover;
use crate::cluster::membership::Membership;
use crate::cluster::service::ClusterService;
use crate::node::context::Context;
use crate::node::data_dir::DataDir;
use crate::node::leases::LeaseQueue;
use crate::node::{activity, clock, expiry};
use presence_proto::v1::cluster_server::ClusterServer;
use presence_proto::v1::presence_server::PresenceServer;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

pub use audit::AuditLogError;
pub use auth::{AuthConfig, AuthConfigError, CredentialsError, Scope, Scopes, TOKEN_PREFIX, entry_for, new_token};
pub use bootstrap::PreparedServer;
pub use cluster::membership::{ClusterConfig, DEFAULT_SLOTS, JoinError, MAX_SLOTS};
pub use config::{ServeError, ServerConfig, cpus};
pub use node::feed::{DEFAULT_RETENTION_BYTES_IN_MEMORY, DEFAULT_RETENTION_BYTES_ON_DISK, DEFAULT_RETENTION_MS};
pub use node::hub::{Delivery, Subscription};
pub use node::leases::MAX_BATCH_ITEMS;
pub use node::privacy;
pub use node::settings::{MAX_SETTING_NAME_BYTES, MAX_SETTING_VALUE_BYTES, MAX_SETTINGS_PER_USER};
pub use node::webhook::WebhookConfig;
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

impl PreparedServer {
    /// Serves `render` (the Prometheus text of the metrics) at `/metrics` on
    /// `listener` for as long as the runtime runs, over TLS when the service
    /// port has it, with the same certificate.
    pub fn spawn_metrics_endpoint(&self, listener: TcpListener, render: api::metrics_port::RenderMetrics) {
        let answers = api::metrics_port::Answers { render, readiness: Arc::clone(&self.readiness) };
        tokio::spawn(api::metrics_port::serve(listener, answers, self.tls.clone(), self.config.handshake_timeout));
    }

    /// Serves on `listener` until `shutdown` completes, as [`serve`] does.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        serve_prepared(self, listener, shutdown).await
    }
}

async fn serve_prepared(
    prepared: PreparedServer,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let membership = match prepared.config.cluster.as_ref() {
        Some(config) => Some(Membership::join(config, prepared.config.max_streams_per_connection).await?),
        None => None,
    };
    let bootstrap::Restored {
        config,
        context,
        cluster,
        auth,
        audit,
        expiry_wake,
        data_dir,
        cors_origins,
        tls,
        readiness,
        webhooks,
    } = prepared.restore(membership)?;
    let (store, clock, stopping) =
        (Arc::clone(context.store()), context.publisher.clock.clone(), context.stopping.clone());
    tokio::spawn(clock::keep_reading(clock.clone(), stopping.clone(), {
        let (store, grace_ms) = (Arc::clone(&store), config.restart_grace_ms());
        move |now| hold_after_stall(&store, now, grace_ms)
    }));
    let activity = Arc::clone(&context.activity);
    let activity_flusher = tokio::spawn(activity::run_flusher(activity, clock.clone(), stopping.clone()));
    let checkpoints = data_dir.clone().map(|dir| {
        tokio::spawn(checkpoint_periodically(dir, Arc::clone(&context), config.checkpoint_interval, stopping.clone()))
    });

    let mut webhook_sinks = Vec::new();
    if let Some(feed) = &context.feed {
        feed.start(clock.clone());
        webhook_sinks = webhooks.start(feed, &clock, &stopping);
    }
    let expiry = tokio::spawn(expiry::run(Arc::clone(&context), expiry_wake, config.expiry_batch));
    if let Some(cluster) = &cluster {
        cluster::start(&context, cluster);
    }
    tokio::spawn(metrics::export_store_counts(Arc::clone(&store), stopping.clone()));
    tokio::spawn(api::tls::keep_reloading(
        api::tls::Reloadable::of(tls.as_ref(), cluster.as_deref()),
        config.tls_reload_interval,
        stopping.clone(),
    ));
    let lease_queue = LeaseQueue::start(Arc::clone(&context), config.lease_queue, config.lease_workers);

    let service_context = Arc::clone(&context);
    let (auth, audit) = (Arc::new(auth), Arc::new(audit));
    tokio::spawn(api::credentials::keep_reloading(
        Arc::clone(&auth),
        Arc::clone(&audit),
        config.credentials_reload_interval,
        stopping.clone(),
    ));
    let cluster_server = ClusterServer::new(ClusterService::new(
        Arc::clone(&context),
        cluster.clone(),
        Arc::clone(&auth),
        Arc::clone(&audit),
    ));
    let presence = PresenceServer::new(PresenceService::new(context, cluster.clone(), lease_queue, auth, audit))
        .max_decoding_message_size(MAX_REQUEST_BYTES);
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
    // Small replies must not wait for the peer's delayed ACK (Nagle): without
    // this, batches and events stall for ~40 ms under load.
    let incoming = tonic::transport::server::TcpIncoming::from(listener)
        .with_nodelay(Some(true))
        .with_keepalive(Some(Duration::from_secs(60)));
    tracing::info!(addr = ?local_addr, shards = config.store.shards, tls = tls.is_some(), "serving");
    readiness.started(cluster.as_ref());
    let stop_signal = {
        let drain_context = Arc::clone(&service_context);
        let stopping = stopping.clone();
        let health = health.clone();
        let readiness = Arc::clone(&readiness);
        async move {
            shutdown.await;
            // Not ready first (D2), so that an orchestrator stops sending
            // traffic before anything is handed over or refused.
            readiness.stopping();
            tracing::info!("shutting down: no new connections, ending watch streams");
            if let Some(cluster) = &cluster {
                handover::drain(&drain_context, cluster).await;
                cluster.membership.leave().await;
            }
            health.set_not_serving::<PresenceServer<PresenceService>>().await;
            stopping.cancel();
        }
    };
    let routes = tonic::service::Routes::new(presence)
        .add_service(cluster_server)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .prepare();
    let front = web::Front::new(routes, cors_origins.clone(), config.console);
    // Cancelled when serve returns, or when its future is dropped: connections
    // still open then are closed with their threads.
    let closing = CancellationToken::new();
    let _close_on_return = closing.clone().drop_guard();
    let admission =
        connections::Admission::new(config.max_connections, config.handshake_timeout, cors_origins, tls.clone());
    let server = connections::server(config.max_streams_per_connection);
    let served = async {
        if config.connection_threads == 0 {
            return server
                .clone()
                .serve_with_incoming_shutdown(front, connections::admitted(incoming, admission), stop_signal)
                .await
                .map_err(ServeError::from);
        }
        let threads = connections::ConnectionThreads::start(
            config.connection_threads,
            &front,
            &server,
            admission,
            &stopping,
            &closing,
        )?;
        let accepting = threads.serve(incoming, stopping.clone());
        tokio::pin!(accepting);
        tokio::select! {
            () = stop_signal => {}
            served = &mut accepting => return served.map_err(ServeError::from),
        }
        accepting.await.map_err(ServeError::from)
    };
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
    closing.cancel();
    let _ = expiry.await;
    let _ = activity_flusher.await;
    // Before the feed closes: each has written its cursor.
    for sink in webhook_sinks {
        let _ = sink.await;
    }
    if let Some(checkpoints) = checkpoints {
        let _ = checkpoints.await;
    }
    let stats = store.stats();
    if let Some(dir) = data_dir {
        // The final checkpoint: a restart resumes exactly here.
        let now = clock.now();
        let checkpointed = Arc::clone(&store);
        match tokio::task::spawn_blocking(move || dir.write_checkpoint(&checkpointed, now)).await {
            Ok(Ok(written)) => {
                tracing::info!(
                    sessions = stats.sessions,
                    users = stats.users,
                    bytes = written.bytes,
                    took_ms = written.took.as_millis() as u64,
                    "final checkpoint written"
                );
                service_context.privacy.checkpointed(now).await;
            }
            Ok(Err(err)) => tracing::error!(%err, "cannot write the final checkpoint; the previous one stays"),
            Err(err) => tracing::error!(%err, "the final checkpoint task failed; the previous one stays"),
        }
    }
    if let Some(feed) = service_context.feed.clone() {
        // After the final checkpoint: a restart from it lost no change the feed holds.
        let now = clock.now();
        let _ = tokio::task::spawn_blocking(move || feed.close(now)).await;
    }
    let stats = store.stats();
    tracing::info!(sessions = stats.sessions, online_users = stats.online_users, "stopped");
    served
}

/// After a stall of the process, holds every online user online for the
/// restart grace, as a restart does (L4, B3): gateways that could not renew
/// meanwhile and find their session gone register it again without a flip.
/// On a blocking thread: it visits every user, a few shard-lock holds at a time.
fn hold_after_stall(store: &Arc<Store>, now: presence_core::Tick, grace_ms: u64) {
    let store = Arc::clone(store);
    drop(tokio::task::spawn_blocking(move || {
        let held = store.hold_online_users(now, now.saturating_add(grace_ms));
        tracing::warn!(held, grace_ms, "after the stall, online users are held online for the restart grace");
    }));
}

/// Writes a checkpoint of `context`'s store every `interval` until `stop`. A
/// failed write is logged and retried at the next interval; the previous
/// checkpoint stays in place. A checkpoint written drops the notes of the
/// erasures it holds (P7).
async fn checkpoint_periodically(dir: DataDir, context: Arc<Context>, interval: Duration, stop: CancellationToken) {
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // the first tick is immediate: nothing new to save yet
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let (dir, store) = (dir.clone(), Arc::clone(context.store()));
        let now = context.now();
        // Housekeeping: at a lower priority than the runtime, so that on full
        // cores renewals go first (H1).
        match crate::node::background::run("presenced-checkpoint", move || dir.write_checkpoint(&store, now)).await {
            Ok(Ok(written)) => {
                metrics::checkpoint_written(true);
                tracing::debug!(bytes = written.bytes, took_ms = written.took.as_millis() as u64, "checkpoint written");
                context.privacy.checkpointed(now).await;
            }
            Ok(Err(err)) => {
                metrics::checkpoint_written(false);
                tracing::error!(%err, "cannot write a checkpoint; the previous one stays")
            }
            Err(err) => {
                metrics::checkpoint_written(false);
                tracing::error!(%err, "the checkpoint task failed; the previous one stays")
            }
        }
    }
}
