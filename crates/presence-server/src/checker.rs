//! The concurrent parts of a server as the concurrency checker drives them
//! (feature `shuttle`, `tests/interleavings.rs`): the real store, publish
//! path, hub, Watch opening and resync and expiry alarm, without the network
//! and the runtime around them, which the checker cannot schedule.

use std::sync::Arc;

use presence_core::{Changes, CompactString, Presence, Store, Tick};
use tokio_util::sync::CancellationToken;

use crate::node::clock::StoreClock;
use crate::node::context::{Context, NodeConfig};
use crate::node::hub::Subscription;
use crate::node::privacy::Shown;
use crate::{node::expiry, node::watch};

/// One server's shared state, as its handlers and tasks reach it.
#[derive(Debug)]
pub struct Node {
    context: Context,
}

/// What a snapshot showed a viewer, user by user.
pub type Snapshot = Vec<(CompactString, Presence)>;

impl Node {
    /// A server over `store`, with no data directory, every user visible to
    /// everyone, and a clock that reads `now` (what the store was made with):
    /// the reads the server makes itself (a Watch's snapshot) then run at
    /// about the ticks the checker gives the store, and a schedule replays the same.
    pub fn new(store: Store, now: Tick) -> Self {
        let clock = StoreClock::starting_at(now);
        Node {
            context: Context::new(Arc::new(store), clock, None, None, &NodeConfig::default(), CancellationToken::new()),
        }
    }

    /// The store.
    pub fn store(&self) -> &Store {
        self.context.store()
    }

    /// Runs one store operation and publishes what it changed, as every
    /// handler and the expiry driver do. `now` is the server clock's; the
    /// checker passes ticks of its own to the store so that a schedule replays
    /// the same.
    pub fn apply<T>(&self, operation: impl FnOnce(&Store, u64, &mut Changes) -> T) -> T {
        self.context.apply(operation)
    }

    /// Opens a watch of `users` for a service (who sees everyone) as the Watch
    /// RPC does (E3): subscribe, read the snapshot, record it as held. Changes
    /// then come from the subscription's mailbox.
    pub fn watch(&self, users: Vec<CompactString>, capacity: usize) -> (Subscription, Snapshot) {
        let (subscription, shown) =
            self.context.privacy.subscribe(users, capacity, None).expect("the users are valid ids");
        let users = subscription.users();
        watch::hold(&subscription, &users, &shown);
        (subscription, shown_as_snapshot(users, &shown))
    }

    /// The fresh snapshot a Watch sends after its mailbox asked for a resync (E4).
    pub fn resync(&self, subscription: &Subscription) -> Snapshot {
        let (users, shown) = self.context.privacy.resync(subscription).expect("the users are valid ids");
        watch::hold(subscription, &users, &shown);
        shown_as_snapshot(users, &shown)
    }

    /// Adds users to an open watch as `UpdateWatch` does (E7): subscribe them,
    /// read them, record them as held; returns what the `added` event shows.
    /// Users are removed with [`Subscription::remove`], as the stream does.
    pub fn add(&self, subscription: &Subscription, users: Vec<CompactString>) -> Snapshot {
        let (added, shown) = self.context.privacy.add(subscription, users).expect("the users are valid ids");
        watch::hold(subscription, &added, &shown);
        shown_as_snapshot(added, &shown)
    }

    /// The expiry driver's step before it sleeps: returns when it would wake
    /// (`None`: only when woken).
    pub fn arm_expiry(&self) -> Option<Tick> {
        expiry::arm(self.store())
    }
}

fn shown_as_snapshot(users: Vec<CompactString>, shown: &[Shown]) -> Snapshot {
    users.into_iter().zip(shown).map(|(user_id, shown)| (user_id, shown.view.presence)).collect()
}
