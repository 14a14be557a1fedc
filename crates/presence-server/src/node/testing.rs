//! A [`Placement`] a test tells what to answer: one node of a cluster that
//! owns some users and not others, hands some over in a move, and hears
//! from the other users' nodes what a viewer may see of them, so that one
//! node's code is tested on the cluster's paths without etcd or another node.

use std::sync::atomic::{AtomicBool, Ordering};

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
    /// Users whose slot moves to the node named, at the address given:
    /// frozen here until the freeze is waited out, then that node's.
    moving: HashMap<CompactString, (String, String)>,
    /// Whether the freeze was waited out.
    moved: AtomicBool,
    /// Every batch sent on to another node, with its address.
    sent_on: Mutex<Vec<(String, pb::LeaseBatch)>>,
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

    /// `user`'s slot moves to `node`, at `address`.
    pub(crate) fn moving(mut self, user: &str, node: &str, address: &str) -> Self {
        self.moving.insert(user.into(), (node.to_owned(), address.to_owned()));
        self
    }

    /// The batches sent on to other nodes so far, with their addresses.
    pub(crate) fn sent_on(&self) -> Vec<(String, pb::LeaseBatch)> {
        self.sent_on.lock().clone()
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
        let not_owner = |owner_id: &str, owner_addr: &str, frozen| {
            let (owner_id, owner_addr) = (owner_id.to_owned(), owner_addr.to_owned());
            Err(ServiceError::NotOwner(NotOwner {
                slot: slot_of(user_id, SLOTS),
                epoch: EPOCH,
                owner_id,
                owner_addr,
                frozen,
            }))
        };
        if let Some((node, address)) = self.0.elsewhere.get(user.as_ref()) {
            return not_owner(node, address, false);
        }
        match self.0.moving.get(user.as_ref()) {
            Some((node, address)) if self.0.moved.load(Ordering::Acquire) => not_owner(node, address, false),
            Some(_) => not_owner("", "", true),
            None => Ok(()),
        }
    }
}

impl Placement for ToldPlacement {
    fn acting(&self) -> Acting<'_> {
        Acting::Some(Box::new(Owned(self)))
    }

    fn durable_gate(&self) -> Option<&tokio::sync::RwLock<()>> {
        None
    }

    fn freeze_over<'a>(&'a self, _slots: Vec<u32>, _deadline: tokio::time::Instant) -> BoxFuture<'a, bool> {
        // The move ends as soon as it is waited for.
        self.moved.store(true, Ordering::Release);
        Box::pin(std::future::ready(false))
    }

    fn forward_leases<'a>(
        &'a self,
        address: &'a str,
        batch: pb::LeaseBatch,
        _authorization: Option<MetadataValue<Ascii>>,
    ) -> BoxFuture<'a, Result<pb::LeaseResults, ServiceError>> {
        // The node there takes every item, saying so.
        let answer = |_| pb::LeaseResult { message: format!("taken at {address}"), ..Default::default() };
        let results = pb::LeaseResults { batch_id: batch.batch_id, results: batch.items.iter().map(answer).collect() };
        self.sent_on.lock().push((address.to_owned(), batch));
        Box::pin(std::future::ready(Ok(results)))
    }

    // Rooms are held here, as on a single node.
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

    fn counts_elsewhere<'a>(
        &'a self,
        viewer: Option<&'a str>,
        rooms: Vec<CompactString>,
    ) -> BoxFuture<'a, Vec<Option<pb::RoomCount>>> {
        SingleNode.counts_elsewhere(viewer, rooms)
    }
}
