//! What a user keeps beside its leases and version, gathered from where each
//! part lives (status, visibility and audience in `privacy.rs`, last
//! activity in `activity.rs`, settings in `settings.rs`) so that it goes with
//! the user's slot: handed over whole in a planned move (C3), copied to the
//! slot's follower and taken over from that copy when the owner dies (C4),
//! and forgotten here once another node has it.

use hashbrown::{HashMap, HashSet};
use presence_core::{CompactString, SlotSet};

use crate::error::ServiceError;
use crate::node::context::Context;
use crate::node::privacy::HandedOver;
use crate::node::storage::durable::Named;

/// Starts noting whose data changes, for [`take_changed`] (C4).
pub(crate) fn track_changes(context: &Context) {
    context.privacy.track_changes();
    context.activity.track_changes();
    context.settings.track_changes();
}

/// The users whose data changed since the last call.
pub(crate) fn take_changed(context: &Context) -> Vec<CompactString> {
    let mut changed: HashSet<CompactString> = context.privacy.take_changed().into_iter().collect();
    changed.extend(context.activity.take_changed());
    changed.extend(context.settings.take_changed());
    changed.into_iter().collect()
}

/// The data of every user of `slots` that has any here.
pub(crate) async fn in_slots(context: &Context, slots: &SlotSet) -> Result<Vec<HandedOver>, ServiceError> {
    let activity: HashMap<CompactString, u64> = context.activity.in_slots(slots).await?.into_iter().collect();
    let settings: HashMap<CompactString, Named> =
        context.settings.in_slots(slots).await?.into_iter().map(|(user, named)| (user.into(), named)).collect();
    let mut users = context.privacy.users_in(slots);
    users.extend(activity.keys().cloned());
    users.extend(settings.keys().cloned());
    let mut data = context.privacy.durable_of(&users.into_iter().collect::<Vec<_>>());
    for user in &mut data {
        user.last_active_at = activity.get(&user.user_id).copied().unwrap_or(0);
        user.settings = settings.get(&user.user_id).cloned().unwrap_or_default();
    }
    Ok(data)
}

/// The data of each of `user_ids` (all empty for a user with nothing).
pub(crate) async fn of(context: &Context, user_ids: &[CompactString]) -> Result<Vec<HandedOver>, ServiceError> {
    let mut data = context.privacy.durable_of(user_ids);
    let activity = context.activity.last_active_at(user_ids).await?;
    let settings = context.settings.get_many(user_ids.iter().map(ToString::to_string).collect()).await?;
    for ((user, last_active_at), settings) in data.iter_mut().zip(activity).zip(settings) {
        user.last_active_at = last_active_at;
        user.settings = settings;
    }
    Ok(data)
}

/// Takes over the data of users another node had, replacing whatever this
/// node held of them (activity only moves forward): on disk first, in one
/// transaction, then in memory.
pub(crate) async fn take_over(context: &Context, users: Vec<HandedOver>, now: u64) -> Result<(), ServiceError> {
    let activity: Vec<(CompactString, u64)> =
        users.iter().map(|user| (user.user_id.clone(), user.last_active_at)).collect();
    let settings: Vec<(CompactString, Named)> =
        users.iter().map(|user| (user.user_id.clone(), user.settings.clone())).collect();
    context.privacy.take_over(users, now).await?;
    context.activity.take_over(activity, now);
    context.settings.take_over(settings.iter().map(|(user, named)| (user.as_str(), named)));
    Ok(())
}

/// Forgets the data of the users of `slots`, on disk and in memory, once
/// another node has them.
pub(crate) async fn release(context: &Context, slots: &SlotSet) -> Result<(), ServiceError> {
    context.privacy.release_slots(slots).await?;
    context.activity.release(slots);
    context.settings.release(slots);
    Ok(())
}
