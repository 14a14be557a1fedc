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

/// Every relation, in memory.
#[derive(Debug)]
pub(crate) struct Relations {
    default_visibility: Visibility,
    visibility: HashMap<CompactString, Visibility>,
    /// user -> the viewers it granted.
    granted: HashMap<CompactString, HashSet<CompactString>>,
    /// user -> its groups.
    groups_of: HashMap<CompactString, HashSet<CompactString>>,
    /// group -> its members.
    members: HashMap<CompactString, HashSet<CompactString>>,
}

impl Relations {
    pub(crate) fn new(default_visibility: Visibility) -> Self {
        Relations {
            default_visibility,
            visibility: HashMap::new(),
            granted: HashMap::new(),
            groups_of: HashMap::new(),
            members: HashMap::new(),
        }
    }

    /// Whether `viewer` may see `user`; `None` is a service caller acting for no viewer.
    pub(crate) fn can_see(&self, viewer: Option<&str>, user: &str) -> bool {
        let Some(viewer) = viewer else { return true };
        if viewer == user {
            return true;
        }
        match self.visibility.get(user).copied().unwrap_or(self.default_visibility) {
            Visibility::Everyone => true,
            Visibility::Nobody => false,
            Visibility::Audience => {
                self.granted.get(user).is_some_and(|viewers| viewers.contains(viewer))
                    || match (self.groups_of.get(user), self.groups_of.get(viewer)) {
                        (Some(mine), Some(theirs)) => {
                            let (small, large) =
                                if mine.len() <= theirs.len() { (mine, theirs) } else { (theirs, mine) };
                            small.iter().any(|group| large.contains(group))
                        }
                        _ => false,
                    }
            }
        }
    }

    pub(crate) fn apply(&mut self, change: &RelationChange) {
        match change {
            RelationChange::Visibility { user, visibility } => {
                self.visibility.insert(user.clone(), *visibility);
            }
            RelationChange::Audience { user, viewers, grant: true } => {
                self.granted.entry(user.clone()).or_default().extend(viewers.iter().cloned());
            }
            RelationChange::Audience { user, viewers, grant: false } => {
                if let Some(granted) = self.granted.get_mut(user) {
                    for viewer in viewers {
                        granted.remove(viewer);
                    }
                    if granted.is_empty() {
                        self.granted.remove(user);
                    }
                }
            }
            RelationChange::Membership { group, users, join: true } => {
                self.members.entry(group.clone()).or_default().extend(users.iter().cloned());
                for user in users {
                    self.groups_of.entry(user.clone()).or_default().insert(group.clone());
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
                    if let Some(groups) = self.groups_of.get_mut(user) {
                        groups.remove(group);
                        if groups.is_empty() {
                            self.groups_of.remove(user);
                        }
                    }
                }
            }
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
    }
}
