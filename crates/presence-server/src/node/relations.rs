//! The plain data of who may see whom: a user's visibility, a change of a
//! user's relations, and what a user takes with it to another node. Shared
//! by the handle that changes relations (`privacy.rs`) and the disk format
//! that keeps them (`durable.rs`), so that neither names the other for them.

use presence_core::{CompactString, Status};

/// A user's choice of who may see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Visibility {
    /// Every viewer.
    Everyone,
    /// The user's audience: granted viewers and members of its groups.
    Audience,
    /// Nobody but the user itself (invisible).
    Nobody,
}

/// Who a user's relations show it to, as far as they say without naming a
/// viewer: what a node relaying the user to its viewers needs to know of
/// it, asking the user's node about each viewer only for an audience.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum SeenBy {
    Everyone,
    /// Nobody but the user itself.
    Nobody,
    /// Its audience: it depends on the viewer.
    Audience,
}

impl SeenBy {
    /// Whether `viewer` may see `user`, shown as `self`; `None` for an
    /// audience, which only the user's node can say.
    pub(crate) fn decides(self, viewer: &str, user: &str) -> Option<bool> {
        match self {
            _ if viewer == user => Some(true),
            SeenBy::Everyone => Some(true),
            SeenBy::Nobody => Some(false),
            SeenBy::Audience => None,
        }
    }
}

/// One change of a user's own relations (group memberships are entries of
/// the group ledger, `groups.rs`).
#[derive(Debug, Clone)]
pub(crate) enum RelationChange {
    Visibility {
        user: CompactString,
        visibility: Visibility,
    },
    Audience {
        user: CompactString,
        viewers: Vec<CompactString>,
        grant: bool,
    },
    /// Whether viewers that see the user see its derived availability (A2).
    ShareActivity {
        user: CompactString,
        shares: bool,
    },
}

impl RelationChange {
    /// The user whose audience the change alters: its viewers' streams are
    /// to be looked at again.
    pub(crate) fn user(&self) -> &CompactString {
        match self {
            RelationChange::Visibility { user, .. }
            | RelationChange::Audience { user, .. }
            | RelationChange::ShareActivity { user, .. } => user,
        }
    }
}

/// What a user handed over to another node takes with it beside its leases
/// (C3): its status, who may see it, its last activity and its settings
/// (gathered in `user_data.rs`). Its groups stay: every node holds every
/// group membership (`groups.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HandedOver {
    pub(crate) user_id: CompactString,
    pub(crate) status: Option<Status>,
    /// `None`: the default.
    pub(crate) visibility: Option<Visibility>,
    pub(crate) audience: Vec<CompactString>,
    /// Whether it shares its derived availability (A2); the default is yes.
    pub(crate) shares_activity: bool,
    /// Its last activity (store ms); 0: none known.
    pub(crate) last_active_at: u64,
    /// Its settings, by name, in name order.
    pub(crate) settings: Vec<(String, Vec<u8>)>,
}
