//! Export and erase of one user at its owner (contract P7): what this node
//! holds of a user, gathered into one message, or removed.
//!
//! An erase goes in the order that keeps every viewer's stream right and a
//! restart from bringing anything back: the user's activity leaves memory
//! while activity writes are held (so that a flush cannot write it back);
//! then, as the one writer of relations, everything kept on disk goes in
//! one transaction, the store ends its leases and status (publishing the
//! OFFLINE flip and the room leaves a Revoke publishes), its relations both
//! ways and its groups go from memory (P4 on open streams), the store
//! forgets it, and the erasure is noted on disk for a restart from an older
//! checkpoint (`Privacy::erase`). What other nodes hold (the audiences of
//! their users, the group ledger, a follower's copy) is the cluster's to
//! reach; this module names nothing of it.

use presence_core::CompactString;
use presence_proto::v1 as pb;

use crate::error::ServiceError;
use crate::node::context::Context;
use crate::node::privacy::ErasedHere;
use crate::node::wire;

/// What an erase removed at this node.
#[derive(Debug)]
pub(crate) struct Erased {
    /// What the relations, the store and the durable store removed.
    pub(crate) here: ErasedHere,
    /// Its settings (on disk, or in memory without a data directory).
    pub(crate) settings: usize,
    /// Whether its last activity was known.
    pub(crate) activity: bool,
}

impl Erased {
    /// The answer to an `EraseUser`, with `granted_by`, the users (over
    /// every node) whose audience it left.
    pub(crate) fn response(&self, granted_by: usize) -> pb::EraseUserResponse {
        let Erased { here, settings, activity } = self;
        let count = |count: usize| u32::try_from(count).unwrap_or(u32::MAX);
        pb::EraseUserResponse {
            sessions_revoked: here.store.sessions,
            rooms_left: here.store.rooms,
            went_offline: here.store.flipped,
            status_removed: here.store.status,
            visibility_removed: here.visibility,
            audience_removed: count(here.audience),
            removed_from_audiences: count(granted_by),
            groups_left: count(here.group_leaves.len()),
            settings_removed: count(*settings),
            activity_removed: *activity,
            presence_forgotten: here.forgotten,
        }
    }
}

/// Erases everything this node holds of `user`, which it owns; the caller
/// holds the durable-write hold (C3).
pub(crate) async fn erase(context: &Context, user: &CompactString) -> Result<Erased, ServiceError> {
    let activity = context.activity.last_active_at(std::slice::from_ref(user)).await?[0] > 0;
    let writes = context.activity.hold_writes().await;
    context.activity.erase(user);
    let in_memory = context.settings.erase(user);
    let mut here = context.privacy.erase(user).await?;
    drop(writes);
    here.granted_by = acted_for(context, here.granted_by);
    Ok(Erased { settings: in_memory + here.settings_on_disk, activity, here })
}

/// Everything this node holds of `user`, which it owns, as an export shows
/// it; `in_audience_of` holds this node's users only.
pub(crate) async fn export(context: &Context, user: &CompactString) -> Result<pb::ExportUserResponse, ServiceError> {
    let users = std::slice::from_ref(user);
    let shown = context.privacy.shown(None, users)?;
    let presence = context.released(users, &shown, true).await?.pop().unwrap_or_default();
    let now = context.now();
    let sessions = context.store().sessions(now, user)?;
    let rooms = sessions
        .iter()
        .flat_map(|session| {
            session.rooms.iter().zip(&session.room_metadata).map(|(room_id, metadata)| pb::ExportedRoomMembership {
                room_id: room_id.to_string(),
                session_id: session.lease.session_id.to_string(),
                metadata: metadata.iter().cloned().collect(),
            })
        })
        .collect();
    let own = context.privacy.own_relations(user);
    let in_audience_of = acted_for(context, context.privacy.grantors_of(user));
    let last_active_at = context.activity.last_active_at(users).await?[0];
    let settings = context.settings.get(user.to_string()).await?;
    let status = context.store().status_of(user).map(|status| wire::status_message(&status));
    let mut exported = pb::ExportUserResponse {
        user_id: user.to_string(),
        exported_at_ms: wire::unix_ms(now),
        held: false,
        presence: Some(presence),
        sessions: wire::list_sessions_response(&sessions, now).sessions,
        rooms,
        status,
        visibility: wire::visibility_message(own.in_force) as i32,
        visibility_is_default: own.visibility.is_none(),
        audience: own.audience.iter().map(ToString::to_string).collect(),
        in_audience_of: in_audience_of.iter().map(ToString::to_string).collect(),
        groups: own.groups.iter().map(ToString::to_string).collect(),
        last_active_at_ms: if last_active_at > 0 { wire::unix_ms(last_active_at) } else { 0 },
        settings: settings.into_iter().collect(),
    };
    exported.held = holds_anything(&exported);
    Ok(exported)
}

/// Whether an export shows anything held about its user: anything but what
/// a user never seen is answered with.
pub(crate) fn holds_anything(exported: &pb::ExportUserResponse) -> bool {
    exported.presence.as_ref().is_some_and(|presence| presence.version > 0)
        || !exported.sessions.is_empty()
        || exported.status.is_some()
        || !exported.visibility_is_default
        || !exported.audience.is_empty()
        || !exported.in_audience_of.is_empty()
        || !exported.groups.is_empty()
        || exported.last_active_at_ms != 0
        || !exported.settings.is_empty()
}

/// Those of `users` this node acts for: a cluster node may still hold the
/// relations of users whose slots moved away while it was down.
fn acted_for(context: &Context, mut users: Vec<CompactString>) -> Vec<CompactString> {
    let acting = context.placement.acting();
    users.retain(|user| acting.check(user).is_ok());
    users
}

/// The users of this node in whose audience `viewer` (a user of another
/// node) is, for an export at that node; with `erase`, taken out of every
/// audience here first (P7).
pub(crate) async fn held_here(
    context: &Context,
    viewer: &CompactString,
    erase: bool,
) -> Result<Vec<CompactString>, ServiceError> {
    let granted_by = if erase {
        let _durable = context.hold_for_durable_write().await;
        context.privacy.forget_viewer(viewer).await?
    } else {
        context.privacy.grantors_of(viewer)
    };
    Ok(acted_for(context, granted_by))
}
