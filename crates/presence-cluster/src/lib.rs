//! presenced's cluster coordination on etcd (rules C1–C5 of the contract).
//!
//! etcd holds only small, slow data: one registration per node bound to that
//! node's etcd lease, and the slot map (slot → owner, with the key's
//! `mod_revision` as the ownership's epoch). Session leases never go to etcd:
//! its lease keep-alives top out in the tens of thousands a second, where
//! presenced serves millions.
//!
//! - [`slot_of`]: which of the fixed slots a user or room id falls in.
//! - [`Etcd`]: the parts of etcd's v3 API this uses, over tonic, generated
//!   without `protoc` (see `crates/presence-cluster/proto/README.md`).
//! - [`NodeLease`]: a node's etcd lease, kept alive, and until when the node
//!   may act on what it owns: the send time of the last keep-alive etcd
//!   answered, plus the TTL it granted, less a margin. A node that cannot
//!   reach etcd stops acting on its slots by then, before another node could
//!   have been given them.
//! - [`SlotMap`], [`SlotMapWatch`], [`claim_slot`]: the slot map, read and
//!   followed from etcd, and changed only by compare-and-swap on the epoch.
//! - [`Coordinator`]: one node at a time, elected through etcd's election
//!   API, gives every slot without a live owner to a live node
//!   ([`repairs`]), its writes fenced by its leadership; for a grace after
//!   an etcd outage, only once the nodes whose leases etcd let go could
//!   have joined again.
//!
//! Without `--etcd` none of this runs (C5).

mod coordinator;
mod etcd;
mod follow;
mod lease;
mod silence;
mod slots;
#[cfg(feature = "testing")]
pub mod testing;

pub use coordinator::{Campaigner, Coordinator, Fencing, StoodDown, election_name};
pub use etcd::{Error, Etcd, api};
pub use lease::{ANSWER_WAIT, LeaseState, NodeLease};
pub use presence_core::slot_of;
pub use silence::{EXPIRY_SLACK, Sightings, Tally, Withheld};
pub use slots::{
    Claim, MOVES_PER_TXN, NodeSet, NodeSetWatch, REBALANCE_SLOTS_PER_MOVE, SlotMap, SlotMapWatch, SlotOwner,
    claim_slot, even_share, follower_of, last_address, move_slots, rebalancing_move, register_node, repairs,
};
