//! Who may see whom (contract P2): visibility, audiences and groups.
//!
//! A viewer sees a user if it is the user, or the user's visibility is
//! EVERYONE, or it is AUDIENCE and the viewer is in the audience: granted by
//! the user (a contact), or a member of a group the user belongs to. NOBODY
//! (invisible) hides the user from everyone but itself. A service caller that
//! acts for no viewer sees everyone.
//!
//! The relations live in memory, behind one lock that request handlers read
//! and that a change of relations holds, for writing, while it also updates
//! the viewers' open streams (see `Hub::reconcile`), so that no stream ever
//! sees a state of the relations that did not exist. Changes are written to
//! the durable store, synced, before they are applied and acknowledged.

use hashbrown::{HashMap, HashSet};
use presence_core::CompactString;

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

impl Visibility {
    /// The code stored on disk and used on the wire (`presence.v1.Visibility`).
    pub fn code(self) -> u8 {
        match self {
            Visibility::Everyone => 1,
            Visibility::Audience => 2,
            Visibility::Nobody => 3,
        }
    }

    /// The visibility of a code; `None` for 0 (unspecified) and unknown codes.
    pub fn from_code(code: i64) -> Option<Self> {
        match code {
            1 => Some(Visibility::Everyone),
            2 => Some(Visibility::Audience),
            3 => Some(Visibility::Nobody),
            _ => None,
        }
    }
}

/// One change of relations.
#[derive(Debug, Clone)]
pub(crate) enum RelationChange {
    Visibility { user: CompactString, visibility: Visibility },
    Audience { user: CompactString, viewers: Vec<CompactString>, grant: bool },
    Membership { group: CompactString, users: Vec<CompactString>, join: bool },
}

impl RelationChange {
    /// Users whose audience the change may alter, and viewers whose view of
    /// others it may alter: the streams to look at again.
    pub(crate) fn affected(&self) -> (Vec<CompactString>, Vec<CompactString>) {
        match self {
            RelationChange::Visibility { user, .. } | RelationChange::Audience { user, .. } => {
                (vec![user.clone()], Vec::new())
            }
            // Joining a group puts each joiner in the other members' audience and
            // them in the joiner's: both sides' streams may change.
            RelationChange::Membership { users, .. } => (users.clone(), users.clone()),
        }
    }
}

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
}

impl UserRelations {
    fn is_empty(&self) -> bool {
        self.visibility.is_none() && self.granted.is_empty() && self.groups.is_empty()
    }
}

/// Every relation, in memory.
#[derive(Debug)]
pub(crate) struct Relations {
    default_visibility: Visibility,
    /// Users with any relation.
    users: HashMap<CompactString, UserRelations>,
    /// group -> its members.
    members: HashMap<CompactString, HashSet<CompactString>>,
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
    pub(crate) fn new(default_visibility: Visibility) -> Self {
        Relations { default_visibility, users: HashMap::new(), members: HashMap::new() }
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
            RelationChange::Membership { group, users, join: true } => {
                self.members.entry(group.clone()).or_default().extend(users.iter().cloned());
                for user in users {
                    self.users.entry(user.clone()).or_default().groups.insert(group.clone());
                }
            }
            RelationChange::Membership { group, users, join: false } => {
                if let Some(members) = self.members.get_mut(group) {
                    for user in users {
                        members.remove(user);
                    }
                    if members.is_empty() {
                        self.members.remove(group);
                    }
                }
                for user in users {
                    if let Some(record) = self.users.get_mut(user) {
                        record.groups.remove(group);
                    }
                    self.forget_if_empty(user);
                }
            }
        }
    }

    fn forget_if_empty(&mut self, user: &str) {
        if self.users.get(user).is_some_and(UserRelations::is_empty) {
            self.users.remove(user);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ids(ids: &[&str]) -> Vec<CompactString> {
        ids.iter().map(|id| CompactString::from(*id)).collect()
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

        relations.apply(&RelationChange::Membership {
            group: "team".into(),
            users: ids(&["alice", "carol"]),
            join: true,
        });
        assert!(relations.can_see(Some("carol"), "alice") && relations.can_see(Some("alice"), "carol"));
        assert!(!relations.can_see(Some("dave"), "alice"));

        relations.apply(&RelationChange::Visibility { user: "alice".into(), visibility: Visibility::Nobody });
        assert!(!relations.can_see(Some("bob"), "alice") && !relations.can_see(Some("carol"), "alice"));
        assert!(relations.can_see(Some("alice"), "alice"), "invisible, but not to itself");

        relations.apply(&RelationChange::Visibility { user: "alice".into(), visibility: Visibility::Everyone });
        assert!(relations.can_see(Some("dave"), "alice"));

        relations.apply(&RelationChange::Visibility { user: "alice".into(), visibility: Visibility::Audience });
        relations.apply(&RelationChange::Audience { user: "alice".into(), viewers: ids(&["bob"]), grant: false });
        relations.apply(&RelationChange::Membership { group: "team".into(), users: ids(&["carol"]), join: false });
        assert!(!relations.can_see(Some("bob"), "alice") && !relations.can_see(Some("carol"), "alice"));
        assert!(relations.members.get("team").is_some_and(|m| m.len() == 1));
        assert!(!relations.users.contains_key("carol"), "a user with no relation left is forgotten");
    }
}
