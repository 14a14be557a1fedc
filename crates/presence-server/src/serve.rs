//! Serving a prepared server, after `bootstrap.rs` has checked everything
//! that can refuse the configuration: join the cluster (with `--etcd`),
//! restore the store, then four steps, each a function here: start the
//! tasks, build the routes, serve until shutdown, shut down.

use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use presence_core::Store;
use presence_proto::v1::cluster_server::ClusterServer;
use presence_proto::v1::presence_server::PresenceServer;
use tokio::net::TcpListener;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;
use tonic_health::server::HealthReporter;

use crate::api::readiness::Readiness;
use crate::api::service::PresenceService;
use crate::api::{self, connections, web};
use crate::bootstrap::{PreparedServer, Restored, Serving};
use crate::cluster::membership::Membership;
use crate::cluster::service::ClusterService;
use crate::cluster::{self, ClusterNode, handover};
use crate::node::context::Context;
use crate::node::feed::webhook::Webhooks;
use crate::node::leases::LeaseQueue;
use crate::node::storage::data_dir::DataDir;
use crate::node::{activity, clock, expiry};
use crate::{MAX_REQUEST_BYTES, ServeError, metrics};

impl PreparedServer {
    /// Serves `render` (the Prometheus text of the metrics) at `/metrics` on
    /// `listener` for as long as the runtime runs, over TLS when the service
    /// port has it, with the same certificate.
    pub fn spawn_metrics_endpoint(&self, listener: TcpListener, render: api::metrics_port::RenderMetrics) {
        let serving = &self.serving;
        let answers = api::metrics_port::Answers { render, readiness: Arc::clone(&serving.readiness) };
        tokio::spawn(api::metrics_port::serve(
            listener,
            answers,
            serving.tls.clone(),
            serving.config.handshake_timeout,
        ));
    }

    /// Serves on `listener` until `shutdown` completes, as [`serve`](crate::serve) does.
    pub async fn serve(
        self,
        listener: TcpListener,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        self.serve_on(vec![listener], shutdown).await
    }

    /// Serves on every one of `listeners` alike (both loopbacks, for
    /// `localhost`) until `shutdown` completes.
    pub async fn serve_on(
        self,
        listeners: Vec<TcpListener>,
        shutdown: impl Future<Output = ()> + Send,
    ) -> Result<(), ServeError> {
        let config = &self.serving.config;
        let membership = match config.cluster.as_ref() {
            Some(cluster) => Some(Membership::join(cluster, config.max_streams_per_connection).await?),
            None => None,
        };
        let Restored { serving, context, cluster, expiry_wake, webhooks } = self.restore(membership)?;
        let (tasks, lease_queue) = start_tasks(&serving, &context, cluster.as_ref(), expiry_wake, webhooks);
        let (front, health) = build_routes(&serving, &context, cluster.as_ref(), lease_queue).await?;
        let served = serve_until_shutdown(listeners, front, health, &serving, &context, cluster, shutdown).await;
        shut_down(tasks, &context, serving.data_dir).await;
        served
    }
}

/// The tasks [`shut_down`] waits for; each ends once `stopping` is cancelled.
struct Tasks {
    expiry: JoinHandle<()>,
    activity_flusher: JoinHandle<()>,
    /// One per webhook of the change feed, each writing its cursor as it ends.
    webhook_sinks: Vec<JoinHandle<()>>,
    /// With a data directory.
    checkpoints: Option<JoinHandle<()>>,
}

/// Starts what runs beside the routes until `stopping`: the clock's watch
/// for stalls, the activity flusher, checkpoints, the change feed and its
/// webhooks, expiry, the cluster's tasks, the store's gauges, the reloading
/// of TLS material and credentials, and the lease workers, whose queue the
/// service takes.
fn start_tasks(
    serving: &Serving,
    context: &Arc<Context>,
    cluster: Option<&Arc<ClusterNode>>,
    expiry_wake: Arc<Notify>,
    webhooks: Webhooks,
) -> (Tasks, LeaseQueue) {
    let config = &serving.config;
    let (store, clock, stopping) = (context.store(), &context.publisher.clock, &context.stopping);
    tokio::spawn(clock::keep_reading(clock.clone(), stopping.clone(), {
        let (store, grace_ms) = (Arc::clone(store), config.restart_grace_ms());
        move |now| hold_after_stall(&store, now, grace_ms)
    }));
    let activity = Arc::clone(&context.activity);
    let activity_flusher = tokio::spawn(activity::run_flusher(activity, clock.clone(), stopping.clone()));
    let checkpoints = serving.data_dir.clone().map(|dir| {
        tokio::spawn(checkpoint_periodically(dir, Arc::clone(context), config.checkpoint_interval, stopping.clone()))
    });
    let mut webhook_sinks = Vec::new();
    if let Some(feed) = &context.feed {
        feed.start(clock.clone());
        webhook_sinks = webhooks.start(feed, clock, stopping);
    }
    let expiry = tokio::spawn(expiry::run(Arc::clone(context), expiry_wake, config.expiry_batch));
    if let Some(cluster) = cluster {
        cluster::start(context, cluster);
    }
    tokio::spawn(metrics::export_store_counts(Arc::clone(store), stopping.clone()));
    tokio::spawn(api::reload_tls::keep_reloading(
        api::reload_tls::Reloadable::of(serving.tls.as_ref(), cluster.map(Arc::as_ref)),
        config.tls_reload_interval,
        stopping.clone(),
    ));
    let lease_queue = LeaseQueue::start(Arc::clone(context), config.lease_queue, config.lease_workers);
    tokio::spawn(api::reload_credentials::keep_reloading(
        Arc::clone(&serving.auth),
        Arc::clone(&serving.audit),
        config.credentials_reload_interval,
        stopping.clone(),
    ));
    (Tasks { expiry, activity_flusher, webhook_sinks, checkpoints }, lease_queue)
}

/// The service port's routes (presenced, the node-to-node service, health
/// and reflection) behind gRPC-Web, CORS and the console, and the health
/// reporter, which the shutdown turns to not serving.
async fn build_routes(
    serving: &Serving,
    context: &Arc<Context>,
    cluster: Option<&Arc<ClusterNode>>,
    lease_queue: LeaseQueue,
) -> Result<(web::FrontService, HealthReporter), ServeError> {
    let (auth, audit) = (&serving.auth, &serving.audit);
    let cluster_server = ClusterServer::new(ClusterService::new(
        Arc::clone(context),
        cluster.cloned(),
        Arc::clone(auth),
        Arc::clone(audit),
    ));
    let service =
        PresenceService::new(Arc::clone(context), cluster.cloned(), lease_queue, Arc::clone(auth), Arc::clone(audit));
    let presence = PresenceServer::new(service).max_decoding_message_size(MAX_REQUEST_BYTES);
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
    let routes = tonic::service::Routes::new(presence)
        .add_service(cluster_server)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .prepare();
    Ok((web::Front::new(routes, serving.cors_origins.clone(), serving.config.console), health))
}

/// Serves `front` on `listener` until `shutdown` completes and the open
/// connections are done with, or the shutdown grace has passed; then
/// cancels `stopping`, which ends the tasks, and closes whatever is still open.
async fn serve_until_shutdown(
    listeners: Vec<TcpListener>,
    front: web::FrontService,
    health: HealthReporter,
    serving: &Serving,
    context: &Arc<Context>,
    cluster: Option<Arc<ClusterNode>>,
    shutdown: impl Future<Output = ()> + Send,
) -> Result<(), ServeError> {
    let (config, stopping) = (&serving.config, &context.stopping);
    let addrs: Vec<String> = listeners
        .iter()
        .map(|listener| listener.local_addr().map_or_else(|_| "an unknown address".to_owned(), |addr| addr.to_string()))
        .collect();
    // Small replies must not wait for the peer's delayed ACK (Nagle): without
    // this, batches and events stall for ~40 ms under load.
    let incoming = futures_util::stream::select_all(listeners.into_iter().map(|listener| {
        tonic::transport::server::TcpIncoming::from(listener)
            .with_nodelay(Some(true))
            .with_keepalive(Some(Duration::from_secs(60)))
    }));
    let scheme = if serving.tls.is_some() { "https" } else { "http" };
    let console = match addrs.first() {
        Some(addr) if config.console => format!("; the console at {scheme}://{addr}/console/"),
        _ => String::new(),
    };
    let addrs = addrs.join(" and ");
    tracing::info!(shards = config.store.shards, tls = serving.tls.is_some(), "serving on {addrs}{console}");
    serving.readiness.started(cluster.as_ref());
    let stop_signal = stop_after(shutdown, Arc::clone(context), cluster, health, Arc::clone(&serving.readiness));
    // Cancelled when serve returns, or when its future is dropped: connections
    // still open then are closed with their threads.
    let closing = CancellationToken::new();
    let _close_on_return = closing.clone().drop_guard();
    let admission = connections::Admission::new(
        config.max_connections,
        config.handshake_timeout,
        serving.cors_origins.clone(),
        serving.tls.clone(),
    );
    let served = serve_connections(config, incoming, front, admission, stop_signal, stopping, &closing);
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
    served
}

/// Serves the connections of `incoming` on the connection threads, or on
/// this runtime when there are none, until `stop_signal` completes and they
/// are done with.
async fn serve_connections(
    config: &crate::ServerConfig,
    incoming: impl connections::Incoming,
    front: web::FrontService,
    admission: connections::Admission,
    stop_signal: impl Future<Output = ()> + Send,
    stopping: &CancellationToken,
    closing: &CancellationToken,
) -> Result<(), ServeError> {
    let server = connections::server(config.max_streams_per_connection);
    if config.connection_threads == 0 {
        return server
            .serve_with_incoming_shutdown(front, connections::admitted(incoming, admission), stop_signal)
            .await
            .map_err(ServeError::from);
    }
    let threads = connections::ConnectionThreads::start(
        config.connection_threads,
        &front,
        &server,
        admission,
        stopping,
        closing,
    )?;
    let accepting = threads.serve(incoming, stopping.clone());
    tokio::pin!(accepting);
    tokio::select! {
        () = stop_signal => {}
        served = &mut accepting => return served.map_err(ServeError::from),
    }
    accepting.await.map_err(ServeError::from)
}

/// Once `shutdown` completes, stops the node in order and then cancels
/// `stopping`, which ends Watch and Leases streams and the tasks.
async fn stop_after(
    shutdown: impl Future<Output = ()> + Send,
    context: Arc<Context>,
    cluster: Option<Arc<ClusterNode>>,
    health: HealthReporter,
    readiness: Arc<Readiness>,
) {
    shutdown.await;
    // Not ready first (D2), so that an orchestrator stops sending
    // traffic before anything is handed over or refused.
    readiness.stopping();
    tracing::info!("shutting down: no new connections, ending watch streams");
    if let Some(cluster) = &cluster {
        handover::drain(&context, cluster).await;
        cluster.membership.leave().await;
    }
    health.set_not_serving::<PresenceServer<PresenceService>>().await;
    context.stopping.cancel();
}

/// Waits for the tasks to end, then writes the final checkpoint (with a data
/// directory) and closes the change feed.
async fn shut_down(tasks: Tasks, context: &Context, data_dir: Option<DataDir>) {
    let _ = tasks.expiry.await;
    let _ = tasks.activity_flusher.await;
    // Before the feed closes: each has written its cursor.
    for sink in tasks.webhook_sinks {
        let _ = sink.await;
    }
    if let Some(checkpoints) = tasks.checkpoints {
        let _ = checkpoints.await;
    }
    if let Some(dir) = data_dir {
        write_final_checkpoint(dir, context).await;
    }
    let clock = &context.publisher.clock;
    if let Some(feed) = context.feed.clone() {
        // After the final checkpoint: a restart from it lost no change the feed holds.
        let now = clock.now();
        let _ = tokio::task::spawn_blocking(move || feed.close(now)).await;
    }
    let stats = context.store().stats();
    tracing::info!(sessions = stats.sessions, online_users = stats.online_users, "stopped");
}

/// The final checkpoint: a restart resumes exactly here. A failed one is
/// logged; the previous one stays.
async fn write_final_checkpoint(dir: DataDir, context: &Context) {
    let store = context.store();
    let stats = store.stats();
    let now = context.publisher.clock.now();
    let checkpointed = Arc::clone(store);
    match tokio::task::spawn_blocking(move || dir.write_checkpoint(&checkpointed, now)).await {
        Ok(Ok(written)) => {
            tracing::info!(
                sessions = stats.sessions,
                users = stats.users,
                bytes = written.bytes,
                took_ms = written.took.as_millis() as u64,
                "final checkpoint written"
            );
            context.privacy.checkpointed(now).await;
        }
        Ok(Err(err)) => tracing::error!(%err, "cannot write the final checkpoint; the previous one stays"),
        Err(err) => tracing::error!(%err, "the final checkpoint task failed; the previous one stays"),
    }
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
