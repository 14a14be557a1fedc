//! A [`Placement`] a test tells what to answer: one node of a cluster that
//! owns some users and not others, and hears from the other users' nodes
//! what a viewer may see of them, so that one node's code is tested on the
//! cluster's paths without etcd or another node.

use futures_util::future::BoxFuture;
use hashbrown::HashMap;
use parking_lot::Mutex;
use presence_core::{CompactString, Store, slot_of};
use presence_proto::v1 as pb;
use tonic::metadata::{Ascii, MetadataValue};

use crate::error::{NotOwner, ServiceError};
use crate::node::placement::{Acting, Placement, SingleNode, UserCheck};
use crate::node::privacy::Privacy;

/// The slot count of the told cluster: the slot a refusal names.
const SLOTS: u32 = 1024;

/// The epoch every told ownership has.
pub(crate) const EPOCH: i64 = 7;

/// A node of a cluster as a test tells it.
#[derive(Debug, Default)]
pub(crate) struct ToldPlacement {
    /// Users another node owns, with that node's id and address; every
    /// other user is this node's.
    elsewhere: HashMap<CompactString, (String, String)>,
    /// What the users' own nodes answer MayView, by (viewer, user); a user
    /// told nothing of is left to the relations here.
    views: HashMap<(CompactString, CompactString), bool>,
    /// Set: MayView fails, naming this node.
    unreachable: Option<String>,
    /// Every MayView asked, in order: the viewer and the users.
    asked: Mutex<Vec<(String, Vec<CompactString>)>>,
}

impl ToldPlacement {
    /// `user` is owned by `node`, at `address`.
    pub(crate) fn owned_elsewhere(mut self, user: &str, node: &str, address: &str) -> Self {
        self.elsewhere.insert(user.into(), (node.to_owned(), address.to_owned()));
        self
    }

    /// `user`'s node answers whether `viewer` may see it.
    pub(crate) fn shows(mut self, viewer: &str, user: &str, visible: bool) -> Self {
        self.views.insert((viewer.into(), user.into()), visible);
        self
    }

    /// MayView fails as if `node` did not answer.
    pub(crate) fn unreachable(mut self, node: &str) -> Self {
        self.unreachable = Some(node.to_owned());
        self
    }

    /// The MayView calls made so far.
    pub(crate) fn asked(&self) -> Vec<(String, Vec<CompactString>)> {
        self.asked.lock().clone()
    }
}

/// The told node's check of a user.
struct Owned<'a>(&'a ToldPlacement);

impl UserCheck for Owned<'_> {
    fn check(&self, user_id: &[u8]) -> Result<(), ServiceError> {
        let user = String::from_utf8_lossy(user_id);
        match self.0.elsewhere.get(user.as_ref()) {
            None => Ok(()),
            Some((node, address)) => Err(ServiceError::NotOwner(NotOwner {
                slot: slot_of(user_id, SLOTS),
                epoch: EPOCH,
                owner_id: node.clone(),
                owner_addr: address.clone(),
                frozen: false,
            })),
        }
    }
}

impl Placement for ToldPlacement {
    fn acting(&self) -> Acting<'_> {
        Acting::Some(Box::new(Owned(self)))
    }

    // What is not told is as on a single node: nothing moves away, nothing is
    // held through a freeze or sent on, rooms are held here.
    fn durable_gate(&self) -> Option<&tokio::sync::RwLock<()>> {
        None
    }

    fn freeze_over<'a>(&'a self, slots: Vec<u32>, deadline: tokio::time::Instant) -> BoxFuture<'a, bool> {
        SingleNode::freeze_over(&SingleNode, slots, deadline)
    }

    fn forward_leases<'a>(
        &'a self,
        address: &'a str,
        batch: pb::LeaseBatch,
        authorization: Option<MetadataValue<Ascii>>,
    ) -> BoxFuture<'a, Result<pb::LeaseResults, ServiceError>> {
        SingleNode::forward_leases(&SingleNode, address, batch, authorization)
    }

    fn room_here(&self, room_id: &str) -> Result<(), ServiceError> {
        SingleNode.room_here(room_id)
    }

    fn room_version<'a>(
        &'a self,
        store: &'a Store,
        room_id: &'a str,
    ) -> BoxFuture<'a, Result<Option<u64>, ServiceError>> {
        SingleNode::room_version(&SingleNode, store, room_id)
    }

    fn may_view<'a>(
        &'a self,
        _privacy: &'a Privacy,
        viewer: &'a str,
        users: Vec<CompactString>,
    ) -> BoxFuture<'a, Result<HashMap<CompactString, bool>, ServiceError>> {
        self.asked.lock().push((viewer.to_owned(), users.clone()));
        let answer = match &self.unreachable {
            Some(node) => Err(ServiceError::RoomOwnerUnreachable { node: node.clone() }),
            None => Ok(users
                .into_iter()
                .filter_map(|user| {
                    let visible = self.views.get(&(CompactString::from(viewer), user.clone()))?;
                    Some((user, *visible))
                })
                .collect()),
        };
        Box::pin(std::future::ready(answer))
    }

    fn room_counts(&self, store: &Store, privacy: &Privacy, room_id: &str) -> (u64, u32, u32) {
        SingleNode.room_counts(store, privacy, room_id)
    }
}
