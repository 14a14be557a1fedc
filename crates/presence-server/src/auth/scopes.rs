//! What a service credential may do (T3): its scopes, and the scope each
//! call needs.
//!
//! | scope | calls |
//! |---|---|
//! | `gateway` | Register, Renew, Unregister, Leases, Join, Leave, Signal, Touch, SetStatus |
//! | `read` | Snapshot, Watch, UpdateWatch, RoomSnapshot, WatchRoom, RoomCounts, WatchRoomCounts, UpdateWatchRoomCounts: true states, or on behalf of a named viewer |
//! | `read-as-viewer` | the same calls, only on behalf of a named viewer (`viewer_id`), never true states (P6) |
//! | `admin` | Revoke, ListSessions, Stats, SetVisibility, Grant/RevokeAudience, Join/LeaveGroup, SetRoomAccess, PutSetting, GetSettings, ExportUser, EraseUser, slot moves |
//! | `feed` | the change feed |
//! | `cluster` | node-to-node calls (the `presence.v1.Cluster` service) |
//!
//! `read` includes `read-as-viewer`. A viewer (a JWT caller) has no scopes:
//! what it may do is decided by the privacy rules (P1–P3).

use std::fmt;

/// One scope.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Lease operations, room membership and signals, Touch, SetStatus.
    Gateway,
    /// Reads of presence, true states or on behalf of a named viewer.
    Read,
    /// Reads on behalf of a named viewer only.
    ReadAsViewer,
    /// Operators' calls: revocation, privacy settings, export and erase.
    Admin,
    /// The change feed.
    Feed,
    /// Calls between the nodes of a cluster.
    Cluster,
}

impl Scope {
    /// Every scope, in the order they are listed.
    pub const ALL: [Scope; 6] =
        [Scope::Gateway, Scope::Read, Scope::ReadAsViewer, Scope::Admin, Scope::Feed, Scope::Cluster];

    /// The scope's name in the credentials file and in refusals.
    pub fn name(self) -> &'static str {
        match self {
            Scope::Gateway => "gateway",
            Scope::Read => "read",
            Scope::ReadAsViewer => "read-as-viewer",
            Scope::Admin => "admin",
            Scope::Feed => "feed",
            Scope::Cluster => "cluster",
        }
    }

    /// The scope named `name`, or `None`.
    pub fn parse(name: &str) -> Option<Scope> {
        Scope::ALL.into_iter().find(|scope| scope.name() == name)
    }

    fn bit(self) -> u8 {
        1 << (self as u8)
    }
}

impl fmt::Display for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A set of scopes.
#[derive(Clone, Copy, PartialEq, Eq, Default)]
pub struct Scopes(u8);

impl Scopes {
    /// Every scope: the `--service-token` tokens, certificate callers and a
    /// server running open.
    pub const ALL: Scopes = Scopes(0b11_1111);

    /// The set of `scopes`.
    pub fn of(scopes: impl IntoIterator<Item = Scope>) -> Scopes {
        Scopes(scopes.into_iter().fold(0, |bits, scope| bits | scope.bit()))
    }

    /// Whether the set allows what `scope` allows (`read` includes `read-as-viewer`).
    pub fn allows(self, scope: Scope) -> bool {
        self.0 & scope.bit() != 0 || (scope == Scope::ReadAsViewer && self.allows(Scope::Read))
    }

    /// Whether the set is empty.
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }

    /// The scopes in the set, in the order they are listed.
    pub fn iter(self) -> impl Iterator<Item = Scope> {
        Scope::ALL.into_iter().filter(move |scope| self.0 & scope.bit() != 0)
    }
}

impl fmt::Debug for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.iter().map(Scope::name)).finish()
    }
}

impl fmt::Display for Scopes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_empty() {
            return f.write_str("no scope");
        }
        let names: Vec<&str> = self.iter().map(Scope::name).collect();
        f.write_str(&names.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_scope_parses_back_from_its_name() {
        for scope in Scope::ALL {
            assert_eq!(Scope::parse(scope.name()), Some(scope));
        }
        assert_eq!(Scope::parse("Admin"), None, "names are lowercase");
        assert_eq!(Scope::parse("everything"), None);
    }

    #[test]
    fn read_includes_read_as_viewer_and_nothing_else_includes_another() {
        let read = Scopes::of([Scope::Read]);
        assert!(read.allows(Scope::Read) && read.allows(Scope::ReadAsViewer));
        let as_viewer = Scopes::of([Scope::ReadAsViewer]);
        assert!(as_viewer.allows(Scope::ReadAsViewer) && !as_viewer.allows(Scope::Read));
        let gateway = Scopes::of([Scope::Gateway]);
        for scope in Scope::ALL.into_iter().filter(|&scope| scope != Scope::Gateway) {
            assert!(!gateway.allows(scope), "{scope}");
        }
        assert!(Scope::ALL.into_iter().all(|scope| Scopes::ALL.allows(scope)));
        assert_eq!(Scopes::of(Scope::ALL), Scopes::ALL);
    }

    #[test]
    fn scopes_print_in_listed_order() {
        assert_eq!(Scopes::of([Scope::Admin, Scope::Gateway]).to_string(), "gateway, admin");
        assert_eq!(Scopes::default().to_string(), "no scope");
    }
}
