//! Everything a server does before it may touch the network (contract B7):
//! [`PreparedServer::prepare`] checks the credentials and the store's shape
//! and opens the data directory and its durable store; `restore` then loads
//! the last checkpoint and the relations kept on disk and builds the shared
//! [`Context`].
//!
//! Neither binds, spawns or prints anything. A binary prepares first and only
//! then binds and announces `listening on`, so a supervisor that waits for
//! that line never sees a service that is about to exit over its own
//! configuration. The tasks (expiry, checkpoints, lease workers) and the
//! routes are started by [`PreparedServer::serve`], in `serve.rs`.

use std::path::Path;
use std::sync::Arc;

use http::HeaderValue;
use presence_core::Store;
use presence_tls::ServerTls;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

use crate::api::readiness::Readiness;
use crate::audit::Audit;
use crate::auth::Authenticator;
use crate::cluster::ClusterNode;
use crate::cluster::membership::Membership;
use crate::cluster::replica::Replica;
use crate::node::clock::StoreClock;
use crate::node::context::Context;
use crate::node::feed::Feed;
use crate::node::feed::webhook::Webhooks;
use crate::node::storage::backup::{self, Restored as FromBackup};
use crate::node::storage::data_dir::{DataDir, Loaded};
use crate::node::storage::durable::BackupRow;
use crate::node::storage::durable::{self, DurableStore};
use crate::{ServeError, ServerConfig};

/// A server whose configuration has been checked and whose data directory is
/// open, ready to [`serve`](PreparedServer::serve) on a listener.
pub struct PreparedServer {
    /// What `serve` reads as it was prepared; `restore` hands it on whole.
    pub(crate) serving: Serving,
    /// The store's clock, started here so that the restore and the relations
    /// read agree on `now`.
    clock: StoreClock,
    /// Relations, statuses and settings on disk, with a data directory.
    durable: Option<Arc<DurableStore>>,
    /// The relations and statuses read from `durable`, applied once the store exists.
    stored: Option<durable::Relations>,
    /// The store of `--restore`'s backup and when it was written, read here
    /// because a corrupt or foreign file refuses the configuration (D3).
    from_backup: Option<(Store, u64)>,
    /// The change feed, opened here because a feed that cannot be read
    /// refuses to start (F2); `None` when it is turned off.
    feed: Option<Arc<Feed>>,
    /// The change feed's webhooks (F4), checked here with their cursors read.
    webhooks: Webhooks,
}

/// What a server was prepared with that `serve` reads, from the metrics
/// port's start to the final checkpoint.
pub(crate) struct Serving {
    /// The settings; `serve` reads the network and task ones.
    pub(crate) config: ServerConfig,
    /// Who is calling; built here because a bad key or secret refuses the configuration.
    pub(crate) auth: Arc<Authenticator>,
    /// Where privileged calls are recorded; opened here because a file that
    /// cannot be opened refuses the configuration.
    pub(crate) audit: Arc<Audit>,
    /// Where checkpoints go, with a data directory.
    pub(crate) data_dir: Option<DataDir>,
    /// `config.cors_origins` as browsers send them; read here because a bad
    /// one refuses the configuration.
    pub(crate) cors_origins: Vec<HeaderValue>,
    /// The service port's TLS material, read and checked here because an
    /// expired certificate or a key that is not its own refuses the
    /// configuration (T1, B7).
    pub(crate) tls: Option<Arc<ServerTls>>,
    /// What `/readyz` reports: made here because the metrics port serves it
    /// from before the restore, while the node is not ready yet (D2); told
    /// when the server has started and when it stops.
    pub(crate) readiness: Arc<Readiness>,
}

impl std::fmt::Debug for PreparedServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PreparedServer").field("config", &self.serving.config).finish_non_exhaustive()
    }
}

/// What [`PreparedServer::restore`] hands to `serve`.
pub(crate) struct Restored {
    /// What the server was prepared with.
    pub(crate) serving: Serving,
    /// The state every handler and task shares.
    pub(crate) context: Arc<Context>,
    /// This node's part in its cluster; `None` for a single node.
    pub(crate) cluster: Option<Arc<ClusterNode>>,
    /// Woken by the store when a deadline earlier than any other is set, so
    /// the expiry task can sleep until the next deadline.
    pub(crate) expiry_wake: Arc<Notify>,
    /// The change feed's webhooks, to start with the feed.
    pub(crate) webhooks: Webhooks,
}

impl PreparedServer {
    /// Does everything that can refuse the configuration without a listener:
    /// validates `config`, builds the authenticator, opens the data directory
    /// and the durable store and reads what it holds. Nothing is bound,
    /// spawned or printed, so an error here leaves no trace.
    pub fn prepare(config: ServerConfig) -> Result<PreparedServer, ServeError> {
        crate::allocator::pin_mmap_threshold();
        let clock = StoreClock::start();
        // Credentials first: they need no disk, and a bad one is the likeliest mistake.
        let auth = Arc::new(Authenticator::new(config.auth.clone())?);
        let audit = Arc::new(Audit::open(config.audit_log.as_deref())?);
        config.store.validate()?;
        // Zero would refuse every connection, every stream, or every handshake.
        for (setting, zero) in [
            ("max_connections", config.max_connections == 0),
            ("max_streams_per_connection", config.max_streams_per_connection == 0),
            ("handshake_timeout", config.handshake_timeout.is_zero()),
        ] {
            if zero {
                return Err(ServeError::Setting { setting, reason: "must be more than 0" });
            }
        }
        if let Some(cluster) = &config.cluster {
            cluster.validate()?;
        }
        let tls = config.tls.clone().map(ServerTls::load).transpose()?.map(Arc::new);
        let cors_origins = config
            .cors_origins
            .iter()
            .map(|origin| crate::api::web::parse_cors_origin(origin))
            .collect::<Result<_, _>>()?;
        // A data directory in use is refused before the backup is read: reading a large one takes seconds.
        if let (Some(backup), Some(path)) = (&config.restore, &config.data_dir)
            && DataDir::holds_data(path)
        {
            let message = format!(
                "the data directory {} already holds data; restore into an empty one (or start without --restore)",
                path.display()
            );
            return Err(ServeError::Restore { path: backup.clone(), message });
        }
        let from_backup = match &config.restore {
            Some(path) => Some(read_backup(&config, path, &clock)?),
            None => None,
        };
        let data_dir_error = |path: &Path, message: String| ServeError::DataDir { path: path.to_owned(), message };
        let (data_dir, durable, stored) = match &config.data_dir {
            Some(path) => {
                let dir = DataDir::open(path).map_err(|err| data_dir_error(path, err.to_string()))?;
                let durable = DurableStore::open(&dir.durable_store_path())
                    .map_err(|err| data_dir_error(path, err.to_string()))?;
                if let (Some((_, rows)), Some(backup)) = (&from_backup, &config.restore) {
                    let refused = |message: String| ServeError::Restore { path: backup.clone(), message };
                    durable
                        .restore_rows(rows)
                        .map_err(|err| data_dir_error(path, err.to_string()))?
                        .map_err(|err| refused(format!("corrupt: {err}")))?;
                }
                let stored = durable.relations().map_err(|err| data_dir_error(path, err.to_string()))?;
                (Some(dir), Some(Arc::new(durable)), Some(stored))
            }
            None => {
                if let (Some((_, rows)), Some(backup)) = (&from_backup, &config.restore)
                    && !rows.is_empty()
                {
                    let message =
                        format!("it holds durable data ({} rows) and there is no --data-dir to keep it in", rows.len());
                    return Err(ServeError::Restore { path: backup.clone(), message });
                }
                (None, None, None)
            }
        };
        // The change feed is opened here, before `listening on`: a feed it cannot read refuses to start.
        let feed = match config.feed_retention() {
            None => None,
            Some(retention) => {
                let dir = data_dir.as_ref().map(DataDir::feed_path);
                let slots =
                    config.cluster.as_ref().map_or(crate::node::feed::SINGLE_NODE_SLOTS, |cluster| cluster.slots);
                let (feed, opened) = Feed::open(dir.as_deref(), retention, slots, clock.now()).map_err(|err| {
                    data_dir_error(dir.as_deref().unwrap_or(Path::new("")), format!("the change feed: {err}"))
                })?;
                if dir.is_some() {
                    tracing::info!(entries = opened.frames, gap = opened.gap, "change feed opened");
                }
                Some(feed)
            }
        };
        let feed_or_why = match (&feed, &config.cluster) {
            // A node's own feed holds only the slots it owns, and the
            // webhook sink does not merge the cluster's yet.
            (Some(_), Some(_)) => Err(
                "is not built for a cluster node: run a Changes consumer against any node instead (docs/feed.md, \"Across a cluster\")",
            ),
            (Some(feed), None) => Ok(feed),
            (None, _) => Err("needs the change feed, and --feed-retention-bytes 0 turns it off"),
        };
        let cursors = data_dir.as_ref().map(DataDir::webhooks_path);
        let webhooks =
            Webhooks::prepare(&config.feed_webhooks, feed_or_why, cursors.as_deref()).map_err(ServeError::Webhook)?;
        let readiness = Arc::new(Readiness::default());
        let from_backup = from_backup.map(|(restored, _)| (restored.store, restored.written_at));
        let serving = Serving { config, auth, audit, data_dir, cors_origins, tls, readiness };
        Ok(PreparedServer { serving, clock, durable, stored, from_backup, feed, webhooks })
    }

    /// Loads the last checkpoint and the stored relations into a new store
    /// and builds the shared context. Nothing here refuses the configuration
    /// (an unusable checkpoint is logged and skipped), so `serve` runs it
    /// after the listener is bound: while a large checkpoint loads,
    /// reconnecting gateways wait in the listen backlog instead of being
    /// refused and backing off.
    pub(crate) fn restore(self, membership: Option<Membership>) -> Result<Restored, ServeError> {
        let config = &self.serving.config;
        let started = self.clock.now();
        let hold_until = started.saturating_add(config.restart_grace_ms());
        let restored = match (self.from_backup, &self.serving.data_dir) {
            (Some((store, written_at)), _) => Some(Loaded { store, written_at }),
            (None, Some(dir)) => dir.load_store(&config.store, started, hold_until)?,
            (None, None) => None,
        };
        let written_at = restored.as_ref().map(|loaded| loaded.written_at);
        let store = match restored {
            Some(loaded) => loaded.store,
            None => Store::new(config.store.clone(), started)?,
        };
        let expiry_wake = Arc::new(Notify::new());
        let store = match &self.feed {
            Some(feed) => store.with_feed(feed.intake()),
            None => store,
        };
        let store = Arc::new(store.with_expiry_waker({
            let wake = Arc::clone(&expiry_wake);
            move || wake.notify_one()
        }));
        let stopping = CancellationToken::new();
        let node = config.node();
        let (context, cluster) = match membership {
            None => (Context::new(store, self.clock, self.durable, self.feed, &node, stopping), None),
            Some(membership) => {
                // Followers' copies are made of what changed (C4).
                store.track_changes();
                let hold_ms = config.restart_grace_ms();
                let replica = Replica::new(&config.store, started, membership.slot_count(), hold_ms)?;
                let cluster = Arc::new(ClusterNode::new(membership, replica));
                let placement: Arc<dyn crate::node::placement::Placement> = cluster.clone();
                let context = Context::placed(store, self.clock, self.durable, self.feed, &node, stopping, placement);
                crate::node::user_data::track_changes(&context);
                context.privacy.keep_group_tombstones();
                (context, Some(cluster))
            }
        };
        let context = Arc::new(context);
        if let Some(stored) = self.stored {
            context.privacy.load(stored, started);
            // Users erased after the checkpoint was written are forgotten again (P7).
            let forgotten = context.privacy.forget_erased_at_restart(written_at, started).map_err(|err| {
                ServeError::DataDir { path: config.data_dir.clone().unwrap_or_default(), message: err.to_string() }
            })?;
            if forgotten > 0 {
                tracing::info!(forgotten, "users erased after the checkpoint are forgotten again");
            }
        }
        Ok(Restored { serving: self.serving, context, cluster, expiry_wake, webhooks: self.webhooks })
    }
}

/// Reads and checks `--restore`'s backup to its last byte (D3): users online
/// in it are held online for the restart grace from now, as after a restart
/// from a checkpoint.
fn read_backup(
    config: &ServerConfig,
    path: &Path,
    clock: &StoreClock,
) -> Result<(FromBackup, Vec<BackupRow>), ServeError> {
    let slots = config.cluster.as_ref().map_or(0, |cluster| cluster.slots);
    let now = clock.now();
    let hold_until = now.saturating_add(config.restart_grace_ms());
    let mut restored = backup::read(path, &config.store, slots, now, hold_until)
        .map_err(|err| ServeError::Restore { path: path.to_owned(), message: err.to_string() })?;
    let rows = std::mem::take(&mut restored.rows);
    let stats = restored.store.stats();
    tracing::info!(path = %path.display(), users = stats.users, sessions = stats.sessions, durable_rows = rows.len(), "read the backup to restore");
    Ok((restored, rows))
}
