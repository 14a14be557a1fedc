//! Who may see whom (contract P2–P5): visibility, audiences and groups, and
//! the one handle that changes them.
//!
//! A viewer sees a user if it is the user, or the user's visibility is
//! EVERYONE, or it is AUDIENCE and the viewer is in the audience: granted by
//! the user (a contact), or a member of a group the user belongs to. NOBODY
//! (invisible) hides the user from everyone but itself. A service caller that
//! acts for no viewer sees everyone.
//!
//! [`Relations`] is the plain data. [`Privacy`] is the handle the server
//! shares: it keeps the relations behind one lock that readers take to see
//! users as a viewer may, and that a change of relations holds, for writing,
//! while it also updates the viewers' open streams (see `Hub::reconcile`), so
//! that no stream ever sees a state of the relations that did not exist. A
//! change of relations or of a status is written to the durable store, synced,
//! before it is applied and acknowledged; one writer at a time, so the order on
//! disk is the order in memory. What a viewer is finally shown of a visible
//! user ([`Released`]) is decided here too: last seen only when offline, and
//! rounded (P5).

use std::sync::Arc;

use hashbrown::{HashMap, HashSet};
use presence_core::{Changes, CompactString, Presence, SlotSet, State, Store, UserView};
use tokio::sync::mpsc;

use crate::error::ServiceError;
use crate::node::groups::{GroupEntry, GroupLedger, Merged};
use crate::node::hub::{Pending, Subscription, Transition};
use crate::node::publish::Publisher;
use crate::node::storage::durable::{self, DurableStore, run_blocking};
use crate::node::sync::RwLock;

pub use crate::node::relations::Visibility;
pub(crate) use crate::node::relations::{HandedOver, RelationChange, SeenBy};

/// One user's side of the relations: everything `can_see` needs about it in
/// one place, so that checking a user costs one lookup.
#[derive(Debug, Default)]
struct UserRelations {
    /// `None`: the default visibility.
    visibility: Option<Visibility>,
    /// The viewers it granted.
    granted: HashSet<CompactString>,
    /// Its groups.
    groups: HashSet<CompactString>,
    /// It does not share its derived availability (A2).
    hides_activity: bool,
}

impl UserRelations {
    fn is_empty(&self) -> bool {
        self.visibility.is_none() && self.granted.is_empty() && self.groups.is_empty() && !self.hides_activity
    }
}

/// Every relation, in memory.
#[derive(Debug)]
pub(crate) struct Relations {
    default_visibility: Visibility,
    /// Every group membership as last written, with the stamps that order
    /// writes made on different nodes; the users' `groups` are its members.
    ledger: GroupLedger,
    /// Users with any relation.
    users: HashMap<CompactString, UserRelations>,
    /// Users whose own visibility is nobody.
    invisible: HashSet<CompactString>,
}

/// A viewer's view of the relations, for checking many users: the viewer's
/// own groups are looked up once.
#[derive(Debug)]
pub(crate) struct ViewerLens<'a> {
    relations: &'a Relations,
    viewer: Option<&'a str>,
    viewer_groups: Option<&'a HashSet<CompactString>>,
}

impl ViewerLens<'_> {
    /// Whether the viewer may see `user`.
    pub(crate) fn can_see(&self, user: &str) -> bool {
        let Some(viewer) = self.viewer else { return true };
        if viewer == user {
            return true;
        }
        let record = self.relations.users.get(user);
        match record.and_then(|record| record.visibility).unwrap_or(self.relations.default_visibility) {
            Visibility::Everyone => true,
            Visibility::Nobody => false,
            Visibility::Audience => record.is_some_and(|record| {
                record.granted.contains(viewer)
                    || self.viewer_groups.is_some_and(|theirs| {
                        let (small, large) = if record.groups.len() <= theirs.len() {
                            (&record.groups, theirs)
                        } else {
                            (theirs, &record.groups)
                        };
                        small.iter().any(|group| large.contains(group))
                    })
            }),
        }
    }
}

impl Relations {
    fn new(default_visibility: Visibility) -> Self {
        Relations {
            default_visibility,
            ledger: GroupLedger::default(),
            users: HashMap::new(),
            invisible: HashSet::new(),
        }
    }

    /// The relations as `viewer` sees them; `None` is a service caller acting for no viewer.
    pub(crate) fn lens<'a>(&'a self, viewer: Option<&'a str>) -> ViewerLens<'a> {
        let viewer_groups = viewer.and_then(|viewer| self.users.get(viewer)).map(|record| &record.groups);
        ViewerLens { relations: self, viewer, viewer_groups }
    }

    /// Whether `viewer` may see `user`; `None` is a service caller acting for no viewer.
    pub(crate) fn can_see(&self, viewer: Option<&str>, user: &str) -> bool {
        self.lens(viewer).can_see(user)
    }

    pub(crate) fn apply(&mut self, change: &RelationChange) {
        match change {
            RelationChange::Visibility { user, visibility } => {
                self.users.entry(user.clone()).or_default().visibility = Some(*visibility);
                if *visibility == Visibility::Nobody {
                    self.invisible.insert(user.clone());
                } else {
                    self.invisible.remove(user);
                }
            }
            RelationChange::Audience { user, viewers, grant: true } => {
                self.users.entry(user.clone()).or_default().granted.extend(viewers.iter().cloned());
            }
            RelationChange::Audience { user, viewers, grant: false } => {
                if let Some(record) = self.users.get_mut(user) {
                    for viewer in viewers {
                        record.granted.remove(viewer);
                    }
                }
                self.forget_if_empty(user);
            }
            RelationChange::ShareActivity { user, shares } => {
                self.users.entry(user.clone()).or_default().hides_activity = !shares;
                self.forget_if_empty(user);
            }
        }
    }

    /// Takes in a group ledger entry; returns whether the user's membership
    /// of the group changed.
    fn merge_group_entry(&mut self, entry: &GroupEntry) -> bool {
        match self.ledger.merge(entry) {
            Merged::Stale | Merged::Restamped => false,
            Merged::Membership(true) => {
                self.users.entry(entry.user.clone()).or_default().groups.insert(entry.group.clone());
                true
            }
            Merged::Membership(false) => {
                if let Some(record) = self.users.get_mut(&entry.user) {
                    record.groups.remove(&entry.group);
                }
                self.forget_if_empty(&entry.user);
                true
            }
        }
    }

    /// Who `user` is shown to, as far as it is known without a viewer.
    fn seen_by(&self, user: &str) -> SeenBy {
        let own = self.users.get(user).and_then(|record| record.visibility);
        match own.unwrap_or(self.default_visibility) {
            Visibility::Everyone => SeenBy::Everyone,
            Visibility::Nobody => SeenBy::Nobody,
            Visibility::Audience => SeenBy::Audience,
        }
    }

    /// Whether no viewer but itself may see `user`.
    fn is_invisible(&self, user: &str) -> bool {
        let own = self.users.get(user).and_then(|record| record.visibility);
        own.unwrap_or(self.default_visibility) == Visibility::Nobody
    }

    /// The users that granted `viewer` (whose audience it is in), sorted.
    /// A scan of every user with relations: for P7's rare calls only.
    fn grantors_of(&self, viewer: &str) -> Vec<CompactString> {
        let mut grantors: Vec<CompactString> = self
            .users
            .iter()
            .filter(|(_, record)| record.granted.contains(viewer))
            .map(|(user, _)| user.clone())
            .collect();
        grantors.sort_unstable();
        grantors
    }

    /// Takes `viewer` out of the audience of each of `grantors`.
    fn remove_grants_to(&mut self, viewer: &str, grantors: &[CompactString]) {
        for grantor in grantors {
            if let Some(record) = self.users.get_mut(grantor) {
                record.granted.remove(viewer);
            }
            self.forget_if_empty(grantor);
        }
    }

    /// Sets a user's own visibility (`None`: the default), audience and
    /// sharing of its availability, whatever they were; its groups stay as
    /// they are.
    fn replace(
        &mut self,
        user: &CompactString,
        visibility: Option<Visibility>,
        granted: HashSet<CompactString>,
        shares_activity: bool,
    ) {
        let record = self.users.entry(user.clone()).or_default();
        record.visibility = visibility;
        record.granted = granted;
        record.hides_activity = !shares_activity;
        if visibility == Some(Visibility::Nobody) {
            self.invisible.insert(user.clone());
        } else {
            self.invisible.remove(user);
        }
        self.forget_if_empty(user);
    }

    fn forget_if_empty(&mut self, user: &str) {
        if self.users.get(user).is_some_and(UserRelations::is_empty) {
            self.users.remove(user);
        }
    }
}

/// A user's own relations, as an export shows them (P7).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct OwnRelations {
    /// Its own choice; `None`: the default applies.
    pub(crate) visibility: Option<Visibility>,
    /// The visibility in force.
    pub(crate) in_force: Visibility,
    /// The viewers it granted, sorted.
    pub(crate) audience: Vec<CompactString>,
    /// Its groups, sorted.
    pub(crate) groups: Vec<CompactString>,
}

/// What [`Privacy::erase`] removed of a user (P7).
#[derive(Debug, Clone)]
pub(crate) struct ErasedHere {
    /// What the store ended: sessions, rooms, status.
    pub(crate) store: presence_core::Erased,
    /// Whether it had chosen a visibility.
    pub(crate) visibility: bool,
    /// The viewers it had granted.
    pub(crate) audience: usize,
    /// The users of this node whose audience it was in.
    pub(crate) granted_by: Vec<CompactString>,
    /// The group leaves written for it, one per group it was in (for the
    /// other nodes of a cluster).
    pub(crate) group_leaves: Vec<GroupEntry>,
    /// How many settings it had on disk (none without a data directory).
    pub(crate) settings_on_disk: usize,
    /// Whether its record (its version) was held, and is now forgotten.
    pub(crate) forgotten: bool,
}

/// What one caller may be shown of one user, as read from the store.
#[derive(Debug, Clone)]
pub(crate) struct Shown {
    pub(crate) view: UserView,
    /// False: answer exactly as for a user never seen (P3).
    pub(crate) visible: bool,
}

/// What is released to one caller of one user: `None` for a hidden user,
/// which goes out exactly as a user never seen (P3).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Released {
    pub(crate) view: Option<UserView>,
    /// For an offline user with known activity: its last activity rounded
    /// down to the last-seen granularity (P5).
    pub(crate) last_seen: Option<u64>,
    /// Exact last activity, for a service acting for no viewer only.
    pub(crate) last_active_at: Option<u64>,
}

/// Who may see whom, and the one writer of relations and statuses.
#[derive(Debug)]
pub(crate) struct Privacy {
    /// Lock order: relations, then hub mailboxes, then store shards.
    relations: RwLock<Relations>,
    /// Held across a durable write and its application in memory, so that
    /// the order on disk is the order in memory.
    writer: tokio::sync::Mutex<()>,
    /// Where relations and statuses are kept, with a data directory.
    durable: Option<Arc<DurableStore>>,
    /// Versions are bumped and users read through it.
    publisher: Publisher,
    /// Last seen is released rounded down to this many milliseconds (P5).
    last_seen_granularity_ms: u64,
    /// Users whose visibility or audience changed since a follower was last
    /// sent them (C4); `None` unless tracked.
    changed: parking_lot::Mutex<Option<HashSet<CompactString>>>,
    /// Who is told of every change of relations, in the order they are
    /// made (the relays of this node's users to other nodes' viewers).
    listeners: parking_lot::Mutex<Vec<mpsc::Sender<RelationsChanged>>>,
}

/// A change of relations as a listener hears it: each viewer's view of
/// `users` (with who sees them now) and `viewers`' view of every user may
/// have changed.
#[derive(Debug, Clone)]
pub(crate) struct RelationsChanged {
    pub(crate) users: Vec<(CompactString, SeenBy)>,
    pub(crate) viewers: Vec<CompactString>,
}

impl Privacy {
    pub(crate) fn new(
        default_visibility: Visibility,
        durable: Option<Arc<DurableStore>>,
        publisher: Publisher,
        last_seen_granularity_ms: u64,
    ) -> Self {
        Privacy {
            relations: RwLock::new(Relations::new(default_visibility)),
            writer: tokio::sync::Mutex::new(()),
            durable,
            publisher,
            last_seen_granularity_ms: last_seen_granularity_ms.max(1),
            changed: parking_lot::Mutex::new(None),
            listeners: parking_lot::Mutex::new(Vec::new()),
        }
    }

    /// Hears every change of relations from now on, in order, `capacity`
    /// at most waiting: a listener that falls further behind is dropped
    /// (its receiver ends), never waited for.
    pub(crate) fn listen(&self, capacity: usize) -> mpsc::Receiver<RelationsChanged> {
        let (tx, rx) = mpsc::channel(capacity.max(1));
        self.listeners.lock().push(tx);
        rx
    }

    /// Who each of `users` is shown to.
    pub(crate) fn seen_by(&self, users: &[CompactString]) -> Vec<SeenBy> {
        let relations = self.relations.read();
        users.iter().map(|user| relations.seen_by(user)).collect()
    }

    /// Gives each of `users` a new version, as a change of its audience does
    /// (P4), publishing nothing; answers them as they are now, read as a
    /// service acting for no viewer. A user the store no longer holds (an
    /// erased one) is given a version and stays forgotten.
    pub(crate) fn bump_versions(&self, users: &[CompactString]) -> Result<Vec<UserView>, ServiceError> {
        self.publisher
            .apply(|store, now, changes| {
                users.iter().map(|user| store.bump_version_if_held(now, user, changes)).collect::<Result<Vec<_>, _>>()
            })
            .map_err(ServiceError::from)
    }

    /// Starts noting whose visibility or audience changes, for
    /// [`Privacy::take_changed`] (C4).
    pub(crate) fn track_changes(&self) {
        self.changed.lock().get_or_insert_with(HashSet::new);
    }

    /// The users whose visibility or audience changed since the last call.
    pub(crate) fn take_changed(&self) -> Vec<CompactString> {
        self.changed.lock().as_mut().map(|changed| changed.drain().collect()).unwrap_or_default()
    }

    /// The status, visibility and audience of each of `user_ids` (all empty
    /// for a user with nothing); `user_data.rs` adds the rest.
    pub(crate) fn durable_of(&self, user_ids: &[CompactString]) -> Vec<HandedOver> {
        let relations = self.relations.read();
        user_ids
            .iter()
            .map(|user_id| {
                let record = relations.users.get(user_id);
                HandedOver {
                    user_id: user_id.clone(),
                    status: self.store().status_of(user_id),
                    visibility: record.and_then(|record| record.visibility),
                    audience: record.map(|record| record.granted.iter().cloned().collect()).unwrap_or_default(),
                    shares_activity: record.is_none_or(|record| !record.hides_activity),
                    last_active_at: 0,
                    settings: Vec::new(),
                }
            })
            .collect()
    }

    fn store(&self) -> &Store {
        &self.publisher.store
    }

    /// Puts the relations and statuses kept on disk back in memory, at start.
    pub(crate) fn load(&self, stored: durable::Relations, now: u64) {
        let count = (stored.visibility.len(), stored.grants.len(), stored.groups.len(), stored.statuses.len());
        let mut relations = self.relations.write();
        for (user, visibility) in stored.visibility {
            relations.apply(&RelationChange::Visibility { user: user.into(), visibility });
        }
        for (user, viewer) in stored.grants {
            relations.apply(&RelationChange::Audience { user: user.into(), viewers: vec![viewer.into()], grant: true });
        }
        for entry in &stored.groups {
            relations.merge_group_entry(entry);
        }
        for user in &stored.activity_hidden {
            relations.apply(&RelationChange::ShareActivity { user: user.into(), shares: false });
            // Nothing is shown yet at start: nothing to publish.
            let _ = self.store().set_shares_activity(now, user, false, &mut Changes::default());
        }
        for (user, status) in stored.statuses {
            if status.expires_at.is_some_and(|at| at <= now) {
                continue; // it ran out while the service was down
            }
            let _ = self.store().restore_status(now, &user, status);
        }
        tracing::info!(
            visibilities = count.0,
            grants = count.1,
            group_entries = count.2,
            statuses = count.3,
            "loaded relations"
        );
    }

    /// The users of `slots` with a status, a visibility or an audience here.
    pub(crate) fn users_in(&self, slots: &SlotSet) -> HashSet<CompactString> {
        let mut user_ids: HashSet<CompactString> =
            self.relations.read().users.keys().filter(|user| slots.holds(user.as_bytes())).cloned().collect();
        user_ids.extend(self.store().statuses_in(slots).into_iter().map(|(user_id, _)| user_id));
        user_ids
    }

    /// Takes over what users handed over by another node keep beside their
    /// leases (C3): on disk first, then in memory, replacing whatever this
    /// node held of them, with no new version (their owner until now
    /// published all there was). Their leases are in the store already.
    pub(crate) async fn take_over(&self, users: Vec<HandedOver>, now: u64) -> Result<(), ServiceError> {
        let _writer = self.writer.lock().await;
        if let Some(durable) = &self.durable {
            let (durable, users) = (Arc::clone(durable), users.clone());
            run_blocking(move || durable.replace_users(&users)).await?;
        }
        let mut relations = self.relations.write();
        for user in users {
            relations.replace(
                &user.user_id,
                user.visibility,
                user.audience.into_iter().collect(),
                user.shares_activity,
            );
            // As its status: what its owner until now showed, with no new version.
            let _ = self.store().set_shares_activity(now, &user.user_id, user.shares_activity, &mut Changes::default());
            if let Some(status) = user.status.filter(|status| status.expires_at.is_none_or(|at| at > now)) {
                let _ = self.store().restore_status(now, &user.user_id, status);
            }
        }
        Ok(())
    }

    /// Forgets the visibility and audience of the users of `slots`, on disk
    /// and in memory, once another node has taken them over (C3); their
    /// statuses went with their users out of the store.
    pub(crate) async fn release_slots(&self, slots: &SlotSet) -> Result<(), ServiceError> {
        let _writer = self.writer.lock().await;
        if let Some(durable) = &self.durable {
            let (durable, slots) = (Arc::clone(durable), slots.clone());
            run_blocking(move || durable.forget_users(&slots)).await?;
        }
        let mut relations = self.relations.write();
        let leaving: Vec<CompactString> =
            relations.users.keys().filter(|user| slots.holds(user.as_bytes())).cloned().collect();
        for user in leaving {
            relations.replace(&user, None, HashSet::new(), true);
            let _ = self.store().set_shares_activity(self.publisher.clock.now(), &user, true, &mut Changes::default());
        }
        Ok(())
    }

    /// Subscribes `viewer` (`None`: a service acting for no viewer) to
    /// `user_ids` and reads them, both under the relations lock, so that the
    /// users hidden in the mailbox are exactly those hidden in what is read.
    pub(crate) fn subscribe(
        &self,
        user_ids: Vec<CompactString>,
        capacity: usize,
        viewer: Option<CompactString>,
    ) -> Result<(Subscription, Vec<Shown>), ServiceError> {
        let relations = self.relations.read();
        let lens = relations.lens(viewer.as_deref());
        let subscription = self.publisher.hub.subscribe(user_ids, capacity, viewer.clone(), |user| !lens.can_see(user));
        let shown = self.reread(&subscription, &subscription.users())?;
        Ok((subscription, shown))
    }

    /// Reads the watched users again for a resync, as the mailbox's viewer may
    /// see them now; returns them with how each is shown.
    pub(crate) fn resync(&self, subscription: &Subscription) -> Result<(Vec<CompactString>, Vec<Shown>), ServiceError> {
        let _relations = self.relations.read();
        let users = subscription.users();
        let shown = self.reread(subscription, &users)?;
        Ok((users, shown))
    }

    /// Adds users to an open subscription (E7), hidden from its viewer as the
    /// relations say, and reads them: the users added (those not yet watched,
    /// in order) and how each is shown.
    pub(crate) fn add(
        &self,
        subscription: &Subscription,
        user_ids: Vec<CompactString>,
    ) -> Result<(Vec<CompactString>, Vec<Shown>), ServiceError> {
        let relations = self.relations.read();
        let lens = relations.lens(subscription.mailbox().viewer());
        let added = subscription.add(user_ids, |user| !lens.can_see(user));
        let shown = self.reread(subscription, &added)?;
        Ok((added, shown))
    }

    /// Reads `users` of a subscription; the caller holds the relations lock, so
    /// the mailbox's hidden marks are current.
    fn reread(&self, subscription: &Subscription, users: &[CompactString]) -> Result<Vec<Shown>, ServiceError> {
        let views = self.publisher.apply(|store, now, changes| store.view(now, users, changes))?;
        let mailbox = subscription.mailbox();
        Ok(users
            .iter()
            .zip(views)
            .map(|(user_id, view)| Shown { visible: !mailbox.is_hidden(user_id), view })
            .collect())
    }

    /// Reads users for `viewer` under the relations lock: what each is, and
    /// whether the viewer may see it.
    pub(crate) fn shown<S: AsRef<str>>(
        &self,
        viewer: Option<&str>,
        user_ids: &[S],
    ) -> Result<Vec<Shown>, ServiceError> {
        let relations = self.relations.read();
        let lens = relations.lens(viewer);
        let views = self.publisher.apply(|store, now, changes| store.view(now, user_ids, changes))?;
        Ok(user_ids
            .iter()
            .zip(views)
            .map(|(user_id, view)| Shown { visible: lens.can_see(user_id.as_ref()), view })
            .collect())
    }

    /// What is released of a user read as `shown`, whose last activity is
    /// `last_active_at` (0: none known); `exact_activity` for a service acting
    /// for no viewer.
    pub(crate) fn release(&self, shown: &Shown, last_active_at: u64, exact_activity: bool) -> Released {
        if !shown.visible {
            return Released { view: None, last_seen: None, last_active_at: None };
        }
        let known = last_active_at > 0;
        let offline = shown.view.presence.state == State::Offline;
        Released {
            view: Some(shown.view.clone()),
            last_seen: (known && offline).then(|| last_active_at - last_active_at % self.last_seen_granularity_ms),
            last_active_at: (known && exact_activity).then_some(last_active_at),
        }
    }

    /// Whether no viewer but itself may see `user`.
    pub(crate) fn is_invisible(&self, user: &str) -> bool {
        self.relations.read().is_invisible(user)
    }

    /// Whether `viewer` may see `user` now.
    pub(crate) fn can_see(&self, viewer: Option<&str>, user: &str) -> bool {
        self.relations.read().can_see(viewer, user)
    }

    /// Those of `items` whose user `viewer` may see, in order.
    pub(crate) fn visible<T>(&self, viewer: Option<&str>, items: Vec<T>, user: impl Fn(&T) -> &str) -> Vec<T> {
        if viewer.is_none() {
            return items;
        }
        let relations = self.relations.read();
        let lens = relations.lens(viewer);
        items.into_iter().filter(|item| lens.can_see(user(item))).collect()
    }

    /// A room's counts of users and sessions with its invisible members left
    /// out: an invisible member is counted by nobody (R4).
    pub(crate) fn counted(&self, store: &Store, room_id: &str, users: u32, sessions: u32) -> (u32, u32) {
        let relations = self.relations.read();
        if relations.default_visibility == Visibility::Nobody {
            // Everyone without a visibility of their own is invisible: count those who chose to be seen.
            let view = store.room(room_id, usize::MAX);
            let members = view.members.unwrap_or_default();
            let seen = members.iter().filter(|member| !relations.is_invisible(&member.user_id));
            return seen.fold((0, 0), |(users, sessions), member| (users + 1, sessions + member.sessions));
        }
        relations.invisible.iter().fold((users, sessions), |(users, sessions), user_id| {
            match store.member_sessions(room_id, user_id) {
                0 => (users, sessions),
                in_room => (users.saturating_sub(1), sessions.saturating_sub(in_room)),
            }
        })
    }

    /// Applies a change of relations: on disk first (synced), then in memory,
    /// then to the open streams whose view it changes (P4).
    pub(crate) async fn change(&self, change: RelationChange) -> Result<(), ServiceError> {
        let _writer = self.writer.lock().await;
        if let Some(durable) = &self.durable {
            let (durable, write) = (Arc::clone(durable), change.clone());
            run_blocking(move || durable.write_relations(&write)).await?;
        }
        let mut relations = self.relations.write();
        relations.apply(&change);
        let user = change.user().clone();
        if let RelationChange::ShareActivity { shares, .. } = change {
            // Who may see the user is unchanged: what they see of it changes
            // as a change of the user, published in order like any other.
            drop(relations);
            self.publisher
                .apply(|store, now, changes| store.set_shares_activity(now, &user, shares, changes))
                .map_err(ServiceError::from)?;
            return Ok(());
        }
        if let Some(changed) = self.changed.lock().as_mut() {
            changed.insert(user.clone());
        }
        self.show_changed_relations(relations, std::slice::from_ref(&user), &[]);
        if let RelationChange::Visibility { .. } = &change {
            // The rooms' owners count the user as its visibility says (R4).
            self.publisher.restate_rooms_of(&user);
        }
        Ok(())
    }

    /// Makes the open streams show what changed relations now allow (P4):
    /// `users`' audiences changed, and `viewers`' view of others. Called with
    /// the relations just changed, still write-locked.
    fn show_changed_relations(
        &self,
        relations: impl std::ops::Deref<Target = Relations>,
        users: &[CompactString],
        viewers: &[CompactString],
    ) {
        let transitions = self.publisher.hub.reconcile(users, viewers, |viewer, user| relations.can_see(viewer, user));
        self.apply_transitions(transitions);
        // Told while the relations are still held, so that a listener hears
        // of the change before any change of a user made after it.
        self.tell_listeners(&relations, users, viewers);
        drop(relations);
        // Room watchers that may see these users differently start over from a fresh snapshot.
        let rooms: Vec<CompactString> = users.iter().flat_map(|user| self.store().rooms_of(user)).collect();
        self.publisher.relations_changed(rooms, viewers);
    }

    fn tell_listeners(&self, relations: &Relations, users: &[CompactString], viewers: &[CompactString]) {
        let mut listeners = self.listeners.lock();
        if listeners.is_empty() {
            return;
        }
        let changed = RelationsChanged {
            users: users.iter().map(|user| (user.clone(), relations.seen_by(user))).collect(),
            viewers: viewers.to_vec(),
        };
        listeners.retain(|listener| listener.try_send(changed.clone()).is_ok());
    }

    /// Makes a cluster node keep group leaves as tombstones (`groups.rs`);
    /// called before the stored relations are loaded.
    pub(crate) fn keep_group_tombstones(&self) {
        self.relations.write().ledger = GroupLedger::new(true);
    }

    /// `users` join (`join`) or leave `group`, written here: the entries this
    /// node stamped for them, of which those that changed anything are
    /// returned, for the other nodes of a cluster.
    pub(crate) async fn change_groups(
        &self,
        group: CompactString,
        users: Vec<CompactString>,
        join: bool,
    ) -> Result<Vec<GroupEntry>, ServiceError> {
        let _writer = self.writer.lock().await;
        let entries = self.relations.write().ledger.stamp(self.publisher.clock.now(), &group, &users, join);
        self.merge_groups_held(entries).await
    }

    /// Takes in group ledger entries written elsewhere: on disk first
    /// (synced), then in memory, then to the open streams whose view they
    /// change (P4). Returns the entries that were newer than those held.
    pub(crate) async fn merge_groups(&self, entries: Vec<GroupEntry>) -> Result<Vec<GroupEntry>, ServiceError> {
        let _writer = self.writer.lock().await;
        self.merge_groups_held(entries).await
    }

    /// [`Privacy::merge_groups`] for a caller holding the writer.
    async fn merge_groups_held(&self, entries: Vec<GroupEntry>) -> Result<Vec<GroupEntry>, ServiceError> {
        let (newer, rows) = {
            let relations = self.relations.read();
            // Of two entries of one pair in one batch, the one that wins.
            let mut winners: HashMap<(CompactString, CompactString), GroupEntry> = HashMap::new();
            for entry in entries {
                let key = (entry.group.clone(), entry.user.clone());
                match winners.get(&key) {
                    Some(held) if !entry.beats(held.stamp, held.member) => {}
                    _ => {
                        winners.insert(key, entry);
                    }
                }
            }
            let newer: Vec<GroupEntry> =
                winners.into_values().filter(|entry| relations.ledger.is_newer(entry)).collect();
            let rows: Vec<bool> = newer.iter().map(|entry| relations.ledger.keeps_row(entry)).collect();
            (newer, rows)
        };
        if newer.is_empty() {
            return Ok(newer);
        }
        if let Some(durable) = &self.durable {
            let write: Vec<(GroupEntry, bool)> = newer.iter().cloned().zip(rows).collect();
            let durable = Arc::clone(durable);
            run_blocking(move || durable.write_groups(&write)).await?;
        }
        let mut relations = self.relations.write();
        let mut moved: HashSet<CompactString> = HashSet::new();
        for entry in &newer {
            if relations.merge_group_entry(entry) {
                moved.insert(entry.user.clone());
            }
        }
        let moved: Vec<CompactString> = moved.into_iter().collect();
        // Joining a group puts the joiner in the other members' audience and
        // them in the joiner's: both sides' streams may change.
        self.show_changed_relations(relations, &moved, &moved);
        Ok(newer)
    }

    /// The digest of each part of the group ledger.
    pub(crate) fn group_digests(&self) -> Vec<u64> {
        self.relations.read().ledger.digests()
    }

    /// The group ledger's entries of the parts whose digest differs from `theirs`.
    pub(crate) fn group_entries_differing(&self, theirs: &[u64]) -> Vec<GroupEntry> {
        self.relations.read().ledger.entries_differing(theirs)
    }

    /// Forgets the group tombstones past the horizon, on disk and in memory.
    pub(crate) async fn forget_old_group_tombstones(&self) -> Result<usize, ServiceError> {
        let _writer = self.writer.lock().await;
        let old = self.relations.write().ledger.forget_old_tombstones(self.publisher.clock.now());
        if let (Some(durable), false) = (&self.durable, old.is_empty()) {
            let (durable, old) = (Arc::clone(durable), old.clone());
            run_blocking(move || durable.forget_group_entries(&old)).await?;
        }
        Ok(old.len())
    }

    /// Sets (or clears) a user's status: on disk first (synced), then in the
    /// store, which publishes it. Returns the user as it now is.
    pub(crate) async fn set_status(
        &self,
        user_id: &str,
        status: Option<presence_core::Status>,
    ) -> Result<UserView, ServiceError> {
        let _writer = self.writer.lock().await;
        if let Some(durable) = &self.durable {
            let (durable, user_id, status) = (Arc::clone(durable), user_id.to_owned(), status.clone());
            run_blocking(move || durable.write_status(&user_id, status.as_ref())).await?;
        }
        Ok(self.publisher.apply(|store, now, changes| store.set_status(now, user_id, status, changes))?)
    }

    /// `user`'s own relations (P7's export).
    pub(crate) fn own_relations(&self, user: &str) -> OwnRelations {
        let relations = self.relations.read();
        let record = relations.users.get(user);
        let sorted = |ids: Option<&HashSet<CompactString>>| {
            let mut ids: Vec<CompactString> = ids.map(|ids| ids.iter().cloned().collect()).unwrap_or_default();
            ids.sort_unstable();
            ids
        };
        let visibility = record.and_then(|record| record.visibility);
        OwnRelations {
            visibility,
            in_force: visibility.unwrap_or(relations.default_visibility),
            audience: sorted(record.map(|record| &record.granted)),
            groups: sorted(record.map(|record| &record.groups)),
        }
    }

    /// The users that granted `viewer` (whose audience it is in), sorted (P7).
    pub(crate) fn grantors_of(&self, viewer: &str) -> Vec<CompactString> {
        self.relations.read().grantors_of(viewer)
    }

    /// Erases everything this node's relations, statuses and durable store
    /// hold of `user` (P7), as one writer: on disk first, in one transaction
    /// (its visibility, grants both ways, status, settings and activity, and
    /// a leave of each of its groups); then the store ends its leases and
    /// status, publishing the OFFLINE flip and room leaves a Revoke
    /// publishes; then its relations go from memory, with the open streams
    /// they change (P4); then the store forgets it, and, with a data
    /// directory, the erasure is noted for restarts from an older checkpoint.
    /// The caller has taken the user's activity out of memory, holding
    /// activity writes until this returns.
    pub(crate) async fn erase(&self, user: &CompactString) -> Result<ErasedHere, ServiceError> {
        let _writer = self.writer.lock().await;
        let (own, granted_by, group_leaves, rows) = {
            let mut relations = self.relations.write();
            let own = relations.users.get(user).map(|record| {
                let mut groups: Vec<CompactString> = record.groups.iter().cloned().collect();
                groups.sort_unstable();
                (record.visibility.is_some(), record.granted.len(), groups)
            });
            let (visibility, audience, groups) = own.unwrap_or_default();
            let granted_by = relations.grantors_of(user);
            let now = self.publisher.clock.now();
            let leaves: Vec<GroupEntry> = groups
                .iter()
                .flat_map(|group| relations.ledger.stamp(now, group, std::slice::from_ref(user), false))
                .collect();
            let rows: Vec<bool> = leaves.iter().map(|entry| relations.ledger.keeps_row(entry)).collect();
            ((visibility, audience), granted_by, leaves, rows)
        };
        let mut settings_on_disk = 0;
        if let Some(durable) = &self.durable {
            let write: Vec<(GroupEntry, bool)> = group_leaves.iter().cloned().zip(rows).collect();
            let (durable, id) = (Arc::clone(durable), user.to_string());
            settings_on_disk = run_blocking(move || durable.erase_user(&id, &write)).await?;
        }
        let store = self.publisher.apply(|store, now, changes| store.erase(now, user, changes))?;
        {
            let mut relations = self.relations.write();
            for entry in &group_leaves {
                relations.merge_group_entry(entry);
            }
            relations.replace(user, None, HashSet::new(), true);
            relations.remove_grants_to(user, &granted_by);
            if let Some(changed) = self.changed.lock().as_mut() {
                changed.insert(user.clone());
                changed.extend(granted_by.iter().cloned());
            }
            // Its audience and groups are gone (others' view of it), and so is
            // its place in others' audiences and groups (its view of them).
            self.show_changed_relations(relations, std::slice::from_ref(user), std::slice::from_ref(user));
        }
        // Its choice not to share its availability goes with the rest (P7).
        self.store().set_shares_activity(self.publisher.clock.now(), user, true, &mut Changes::default())?;
        let forgotten = self.store().forget_idle(self.publisher.clock.now(), user)?;
        if let Some(durable) = &self.durable {
            let (durable, id, at) = (Arc::clone(durable), user.to_string(), self.publisher.clock.now());
            run_blocking(move || durable.note_erased(&id, at)).await?;
        }
        Ok(ErasedHere {
            store,
            visibility: own.0,
            audience: own.1,
            granted_by,
            group_leaves,
            settings_on_disk,
            forgotten,
        })
    }

    /// Takes `viewer`, erased at its owner, out of the audience of every
    /// user this node holds (P7): on disk first, then in memory, then on the
    /// viewer's open streams here. Returns the users whose audience it left.
    pub(crate) async fn forget_viewer(&self, viewer: &CompactString) -> Result<Vec<CompactString>, ServiceError> {
        let _writer = self.writer.lock().await;
        let grantors = self.relations.read().grantors_of(viewer);
        if grantors.is_empty() {
            return Ok(grantors);
        }
        if let Some(durable) = &self.durable {
            let (durable, id) = (Arc::clone(durable), viewer.to_string());
            run_blocking(move || durable.forget_grants_to(&id)).await?;
        }
        {
            let mut relations = self.relations.write();
            relations.remove_grants_to(viewer, &grantors);
            if let Some(changed) = self.changed.lock().as_mut() {
                changed.extend(grantors.iter().cloned());
            }
            self.show_changed_relations(relations, &[], std::slice::from_ref(viewer));
        }
        Ok(grantors)
    }

    /// Forgets, at a restart, the users erased after the checkpoint the
    /// store was restored from was written (`written_at`; `None`: no
    /// checkpoint), and drops the notes of the erasures the checkpoint
    /// already holds (P7). The relations are loaded already.
    pub(crate) fn forget_erased_at_restart(&self, written_at: Option<u64>, now: u64) -> Result<usize, ServiceError> {
        let Some(durable) = &self.durable else { return Ok(0) };
        let erased = durable.erasures()?;
        let again: Vec<CompactString> = erased
            .into_iter()
            .filter(|(_, at)| written_at.is_some_and(|written_at| *at >= written_at))
            .map(|(user, _)| user.into())
            .collect();
        let forgotten = self.store().release_users(now, &again);
        if let Some(written_at) = written_at {
            durable.forget_erasures_before(written_at)?;
        } else {
            durable.forget_erasures_before(u64::MAX)?;
        }
        Ok(forgotten)
    }

    /// Drops the notes of the erasures done before store time `written_at`,
    /// once a checkpoint taken then is on disk: it does not hold their users
    /// (P7). A failure is logged; the notes stay until the next one.
    pub(crate) async fn checkpointed(&self, written_at: u64) {
        let Some(durable) = &self.durable else { return };
        let durable = Arc::clone(durable);
        if let Err(err) = run_blocking(move || durable.forget_erasures_before(written_at)).await {
            tracing::warn!(%err, "the notes of erasures a checkpoint holds were not dropped; the next one will");
        }
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
            for hidden in transitions.iter().filter(|t| !t.visible) {
                hidden.mailbox.set_hidden(&user_id, true);
            }
            self.publisher.apply(|store, now, changes| {
                let Ok(bumped) = store.bump_version(now, &user_id, changes) else { return };
                let offline = Presence::new(State::Offline, bumped.presence.version);
                for hidden in transitions.iter().filter(|t| !t.visible) {
                    hidden.mailbox.post_transition(&user_id, Pending::alone(offline, None, true));
                }
                for revealed in transitions.iter().filter(|t| t.visible) {
                    revealed.mailbox.set_hidden(&user_id, false);
                }
                if let Ok(views) = store.view(now, &[user_id.as_str()], changes) {
                    let view = &views[0];
                    for revealed in transitions.iter().filter(|t| t.visible) {
                        let pending = Pending::alone(view.presence, view.status.clone(), false);
                        revealed.mailbox.post_transition(&user_id, pending);
                    }
                }
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(ids: &[&str]) -> Vec<CompactString> {
        ids.iter().map(|id| CompactString::from(*id)).collect()
    }

    fn member(group: &str, user: &str, stamp: u64, member: bool) -> GroupEntry {
        GroupEntry { group: group.into(), user: user.into(), stamp, member }
    }

    #[test]
    fn p2_visibility_audience_and_groups_decide_who_sees_whom() {
        let mut relations = Relations::new(Visibility::Audience);
        assert!(relations.can_see(None, "alice"), "a service acting for no viewer sees everyone");
        assert!(relations.can_see(Some("alice"), "alice"), "a user always sees itself");
        assert!(!relations.can_see(Some("bob"), "alice"), "the default audience is empty");

        relations.apply(&RelationChange::Audience { user: "alice".into(), viewers: ids(&["bob"]), grant: true });
        assert!(relations.can_see(Some("bob"), "alice"));
        assert!(!relations.can_see(Some("alice"), "bob"), "a grant is one way");

        for (user, stamp) in [("alice", 1), ("carol", 2)] {
            relations.merge_group_entry(&member("team", user, stamp, true));
        }
        assert!(relations.can_see(Some("carol"), "alice") && relations.can_see(Some("alice"), "carol"));
        assert!(!relations.can_see(Some("dave"), "alice"));

        relations.apply(&RelationChange::Visibility { user: "alice".into(), visibility: Visibility::Nobody });
        assert!(!relations.can_see(Some("bob"), "alice") && !relations.can_see(Some("carol"), "alice"));
        assert!(relations.can_see(Some("alice"), "alice"), "invisible, but not to itself");

        relations.apply(&RelationChange::Visibility { user: "alice".into(), visibility: Visibility::Everyone });
        assert!(relations.can_see(Some("dave"), "alice"));

        relations.apply(&RelationChange::Visibility { user: "alice".into(), visibility: Visibility::Audience });
        relations.apply(&RelationChange::Audience { user: "alice".into(), viewers: ids(&["bob"]), grant: false });
        relations.merge_group_entry(&member("team", "carol", 3, false));
        assert!(!relations.can_see(Some("bob"), "alice") && !relations.can_see(Some("carol"), "alice"));
        let team: Vec<GroupEntry> =
            relations.ledger.entries_differing(&[]).into_iter().filter(|entry| entry.member).collect();
        assert_eq!(team, [member("team", "alice", 1, true)], "alice stays in the team, carol left it");
        assert!(!relations.users.contains_key("carol"), "a user with no relation left is forgotten");
    }
}
