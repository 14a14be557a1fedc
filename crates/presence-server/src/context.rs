//! What every request handler and background task of one server shares, and
//! the two things they all do with it: publish changes, and show users to a
//! caller as that caller may see them.

use std::sync::Arc;

use hashbrown::HashMap;
use presence_core::{CompactString, Presence, PresenceChange, State, Store, UserView};
use presence_proto::v1 as pb;
use tokio_util::sync::CancellationToken;

use crate::activity::Activity;
use crate::auth::Authenticator;
use crate::clock::StoreClock;
use crate::durable::{DurableStore, RelationWrite, run_blocking};
use crate::hub::{Hub, Pending, Transition};
use crate::metrics::Metrics;
use crate::ops::user_presence;
use crate::privacy::{RelationChange, Relations};
use crate::settings::Settings;

/// The shared state of one running server.
#[derive(Debug)]
pub(crate) struct Context {
    pub(crate) store: Arc<Store>,
    pub(crate) hub: Arc<Hub>,
    pub(crate) clock: StoreClock,
    pub(crate) metrics: Metrics,
    /// Most distinct users a viewer's mailbox holds before the viewer is resynced.
    pub(crate) watch_buffer: usize,
    /// Cancelled when the server shuts down: ends Watch and Leases streams.
    pub(crate) stopping: CancellationToken,
    /// Users' last meaningful activity.
    pub(crate) activity: Arc<Activity>,
    /// Durable per-user settings.
    pub(crate) settings: Settings,
    /// Where relations and statuses are kept, with a data directory.
    pub(crate) durable: Option<Arc<DurableStore>>,
    /// Who may see whom. Lock order: relations, then hub mailboxes, then store shards.
    pub(crate) relations: parking_lot::RwLock<Relations>,
    /// Serializes changes of relations and statuses, so that the order on disk
    /// is the order in memory.
    pub(crate) relations_writer: tokio::sync::Mutex<()>,
    /// Last seen is released rounded down to this many milliseconds (P5).
    pub(crate) last_seen_granularity_ms: u64,
    /// Who is calling.
    pub(crate) auth: Authenticator,
}

/// What one caller may be shown of one user.
#[derive(Debug, Clone)]
pub(crate) struct Shown {
    pub(crate) view: UserView,
    /// False: answer exactly as for a user never seen.
    pub(crate) visible: bool,
}

impl Context {
    /// Publishes changes to the viewers of this process, in order, and counts them.
    pub(crate) fn publish(&self, changes: &[PresenceChange]) {
        if changes.is_empty() {
            return;
        }
        let now = self.clock.now();
        for change in changes {
            let delivered = self.hub.publish(change);
            self.metrics.fanned_out.increment(delivered as u64);
            self.metrics.flip(change, now);
            tracing::debug!(
                user_id = %change.user_id,
                state = ?change.presence.state,
                version = change.presence.version,
                expired = change.deadline.is_some(),
                "change"
            );
        }
    }

    /// The wire form of users as `viewer` may see them (`None`: a service acting
    /// for no viewer, which also gets exact activity times). A hidden user is
    /// answered exactly as a user never seen (P3).
    pub(crate) async fn wire<S: AsRef<str>>(
        &self,
        user_ids: &[S],
        shown: &[Shown],
        exact_activity: bool,
    ) -> Result<Vec<pb::UserPresence>, tonic::Status> {
        // Activity is looked up only for users the caller may see.
        let visible: Vec<&str> =
            user_ids.iter().zip(shown).filter(|(_, shown)| shown.visible).map(|(id, _)| id.as_ref()).collect();
        let active: HashMap<&str, u64> =
            visible.iter().copied().zip(self.activity.last_active_at(&visible).await.map_err(unavailable)?).collect();
        Ok(user_ids
            .iter()
            .zip(shown)
            .map(|(user_id, shown)| {
                let user_id = user_id.as_ref();
                if !shown.visible {
                    return user_presence(user_id, Presence::UNKNOWN);
                }
                self.visible_wire(user_id, &shown.view, active.get(user_id).copied().unwrap_or(0), exact_activity)
            })
            .collect())
    }

    /// A visible user on the wire: state, version, status, and for an offline
    /// user its last activity rounded down to the last-seen granularity (P5).
    pub(crate) fn visible_wire(
        &self,
        user_id: &str,
        view: &UserView,
        last_active_at: u64,
        exact_activity: bool,
    ) -> pb::UserPresence {
        let mut wire = user_presence(user_id, view.presence);
        wire.status = view.status.as_deref().map(crate::ops::status_wire);
        if exact_activity {
            wire.last_active_at_ms = i64::try_from(last_active_at).unwrap_or(i64::MAX);
        }
        if view.presence.state == State::Offline && last_active_at > 0 {
            let coarse = last_active_at - last_active_at % self.last_seen_granularity_ms.max(1);
            wire.last_seen_ms = i64::try_from(coarse).unwrap_or(i64::MAX);
        }
        wire
    }

    /// Reads users for `viewer` under the relations lock: what each is, and
    /// whether the viewer may see it.
    pub(crate) fn shown<S: AsRef<str>>(
        &self,
        viewer: Option<&str>,
        user_ids: &[S],
    ) -> Result<Vec<Shown>, tonic::Status> {
        let relations = self.relations.read();
        let lens = relations.lens(viewer);
        let mut changes = Vec::new();
        let views = self.store.view(self.clock.now(), user_ids, &mut changes);
        self.publish(&changes);
        let views = views.map_err(crate::status::status_of)?;
        Ok(user_ids
            .iter()
            .zip(views)
            .map(|(user_id, view)| Shown { visible: lens.can_see(user_id.as_ref()), view })
            .collect())
    }

    /// Applies a change of relations: on disk first (synced), then in memory,
    /// then to the open streams whose view it changes (P4).
    pub(crate) async fn change_relations(&self, change: RelationChange) -> Result<(), tonic::Status> {
        let _writer = self.relations_writer.lock().await;
        if let Some(durable) = &self.durable {
            let durable = Arc::clone(durable);
            let write = change.clone();
            run_blocking(move || durable.write_relations(&RelationWrite::from(&relation_write(&write))))
                .await
                .map_err(unavailable)?;
        }
        let mut relations = self.relations.write();
        relations.apply(&change);
        let (users, viewers) = change.affected();
        let transitions = self.hub.reconcile(&users, &viewers, |viewer, user| relations.can_see(viewer, user));
        self.apply_transitions(transitions);
        Ok(())
    }

    /// Tells mailboxes that users were hidden from or revealed to their viewers.
    ///
    /// Order matters. Hiding: the user is marked hidden in the mailbox before
    /// its version is bumped, so a change made after the bump (whose version
    /// would beat the "offline" we send) can never reach the viewer. Revealing:
    /// the version is bumped, then the mark removed, then the user read, so the
    /// viewer gets a version above the one it holds and misses no change.
    fn apply_transitions(&self, transitions: Vec<Transition>) {
        let mut by_user: HashMap<CompactString, Vec<Transition>> = HashMap::new();
        for transition in transitions {
            by_user.entry(transition.user_id.clone()).or_default().push(transition);
        }
        for (user_id, transitions) in by_user {
            let now = self.clock.now();
            let mut changes = Vec::new();
            for hidden in transitions.iter().filter(|t| !t.visible) {
                hidden.mailbox.set_hidden(&user_id, true);
            }
            let Ok(bumped) = self.store.bump_version(now, &user_id, &mut changes) else { continue };
            let offline = Presence { state: State::Offline, version: bumped.presence.version };
            for hidden in transitions.iter().filter(|t| !t.visible) {
                hidden.mailbox.post_transition(&user_id, Pending { presence: offline, status: None, hidden: true });
            }
            for revealed in transitions.iter().filter(|t| t.visible) {
                revealed.mailbox.set_hidden(&user_id, false);
            }
            if let Ok(views) = self.store.view(now, &[user_id.as_str()], &mut changes) {
                let view = &views[0];
                for revealed in transitions.iter().filter(|t| t.visible) {
                    let pending = Pending { presence: view.presence, status: view.status.clone(), hidden: false };
                    revealed.mailbox.post_transition(&user_id, pending);
                }
            }
            self.publish(&changes);
        }
    }
}

/// The disk form of a change of relations.
fn relation_write(change: &RelationChange) -> RelationWriteOwned {
    match change {
        RelationChange::Visibility { user, visibility } => {
            RelationWriteOwned::Visibility(user.to_string(), visibility.code())
        }
        RelationChange::Audience { user, viewers, grant } => RelationWriteOwned::Grants(
            user.to_string(),
            viewers.iter().map(|viewer| viewer.to_string()).collect(),
            *grant,
        ),
        RelationChange::Membership { group, users, join } => {
            RelationWriteOwned::Members(group.to_string(), users.iter().map(|user| user.to_string()).collect(), *join)
        }
    }
}

/// A change of relations with owned strings, borrowed as a [`RelationWrite`].
enum RelationWriteOwned {
    Visibility(String, u8),
    Grants(String, Vec<String>, bool),
    Members(String, Vec<String>, bool),
}

impl<'a> From<&'a RelationWriteOwned> for RelationWrite<'a> {
    fn from(owned: &'a RelationWriteOwned) -> Self {
        match owned {
            RelationWriteOwned::Visibility(user, code) => RelationWrite::Visibility(user, *code),
            RelationWriteOwned::Grants(user, viewers, add) => RelationWrite::Grants(user, viewers, *add),
            RelationWriteOwned::Members(group, users, add) => RelationWrite::Members(group, users, *add),
        }
    }
}

/// A durable-store failure, as the caller sees it: retry later.
pub(crate) fn unavailable(err: crate::durable::DurableError) -> tonic::Status {
    tracing::error!(%err, "durable store failure");
    tonic::Status::unavailable(format!("{err}; nothing was changed, retry"))
}
