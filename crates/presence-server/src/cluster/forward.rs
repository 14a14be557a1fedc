//! Calls to the other nodes (C2): every node-to-node request is made with
//! [`with_credential`] and waited for with [`call_peer`]; a client's request
//! for users or rooms another node owns goes there through [`forward`],
//! with the client's own credentials, marked [`FORWARDED`] so that the
//! owner answers for its own users only and sends nothing on.

use std::future::Future;
use std::time::Duration;

use presence_proto::v1 as pb;
use tonic::Status;
use tonic::metadata::{Ascii, MetadataValue};

use crate::audit::FORWARDED;
use crate::cluster::membership::Membership;
use crate::cluster::peers::PeerStream;
use crate::error::ServiceError;
pub(crate) use crate::node::placement::FORWARD_TIMEOUT;

/// `call` to node `node`, given at most `within`: its answer, or the node's
/// refusal relayed, or [`ServiceError::PeerTimedOut`] naming it once the
/// time is up.
pub(crate) async fn call_peer<T>(
    node: &str,
    within: Duration,
    call: impl Future<Output = Result<tonic::Response<T>, Status>>,
) -> Result<T, ServiceError> {
    match tokio::time::timeout(within, call).await {
        Ok(Ok(answer)) => Ok(answer.into_inner()),
        Ok(Err(status)) => Err(ServiceError::Peer { node: node.to_owned(), status }),
        Err(_) => Err(ServiceError::PeerTimedOut { node: node.to_owned(), awaited: "answer", within }),
    }
}

/// `message` as a request to another node, carrying `credential`
/// (`authorization`), if any, and this node's protocol version (every
/// node-to-node request is made here).
pub(crate) fn with_credential<T>(message: T, credential: Option<&MetadataValue<Ascii>>) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    crate::cluster::protocol::stamp(request.metadata_mut());
    if let Some(credential) = credential {
        request.metadata_mut().insert("authorization", credential.clone());
    }
    request
}

/// `message` sent on for a client to the node at `address` by `call` on
/// `client`: marked [`FORWARDED`], with the client's `authorization`, so
/// that the owner applies its rules to the client as if asked directly
/// (C2); waited for as [`call_peer`] does.
pub(crate) async fn forward<C, Q, A, F>(
    client: C,
    address: &str,
    within: Duration,
    message: Q,
    authorization: Option<&MetadataValue<Ascii>>,
    call: impl FnOnce(C, tonic::Request<Q>) -> F,
) -> Result<A, ServiceError>
where
    F: Future<Output = Result<tonic::Response<A>, Status>>,
{
    let mut request = with_credential(message, authorization);
    request.metadata_mut().insert(FORWARDED, MetadataValue::from_static("1"));
    call_peer(address, within, call(client, request)).await
}

/// The client requests a node sends on to the owners of their users and rooms.
impl Membership {
    /// Asks the node at `address` for a Snapshot of `user_ids`, for the same
    /// viewer and with the caller's own credentials (C2).
    pub(crate) async fn forward_snapshot(
        &self,
        address: &str,
        user_ids: Vec<String>,
        viewer_id: &str,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<Vec<pb::UserPresence>, ServiceError> {
        let request = pb::SnapshotRequest { user_ids, viewer_id: viewer_id.to_owned() };
        let client = self.peers().client(address)?;
        let answer =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.snapshot(request).await
            });
        Ok(answer.await?.users)
    }

    /// Sends lease items held through a freeze to the node at `address`,
    /// which owns their users now (C7), with the caller's credentials.
    pub(crate) async fn forward_leases(
        &self,
        address: &str,
        batch: pb::LeaseBatch,
        authorization: Option<MetadataValue<Ascii>>,
    ) -> Result<pb::LeaseResults, ServiceError> {
        let client = self.peers().client(address)?;
        let batch = tokio_stream::iter([batch]);
        let mut results =
            forward(client, address, FORWARD_TIMEOUT, batch, authorization.as_ref(), |mut client, batch| async move {
                client.leases(batch).await
            })
            .await?;
        let node = address.to_owned();
        match tokio::time::timeout(FORWARD_TIMEOUT, results.message()).await {
            Ok(Ok(Some(results))) => Ok(results),
            Ok(Ok(None)) => Err(ServiceError::PeerEnded { node, awaited: "results" }),
            Ok(Err(status)) => Err(ServiceError::Peer { node, status }),
            Err(_) => Err(ServiceError::PeerTimedOut { node, awaited: "results", within: FORWARD_TIMEOUT }),
        }
    }

    /// Opens a Watch at the node at `address` for the caller, as
    /// [`Membership::forward_snapshot`] asks for a Snapshot.
    pub(crate) async fn forward_watch(
        &self,
        address: &str,
        request: pb::WatchRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<PeerStream<pb::WatchEvent>, ServiceError> {
        let (client, place) = self.peers().stream_client(address)?;
        let stream =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.watch(request).await
            });
        Ok(PeerStream::new(stream.await?, place))
    }

    /// Asks the room's owner at `address` for a RoomSnapshot, for the caller
    /// and with its credentials (C1).
    pub(crate) async fn forward_room_snapshot(
        &self,
        address: &str,
        request: pb::RoomSnapshotRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::RoomSnapshot, ServiceError> {
        let client = self.peers().client(address)?;
        forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.room_snapshot(request).await
        })
        .await
    }

    /// Asks the room's owner at `address` to set the room's access, for the
    /// caller and with its credentials (C1).
    pub(crate) async fn forward_set_room_access(
        &self,
        address: &str,
        request: pb::SetRoomAccessRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::SetRoomAccessResponse, ServiceError> {
        let client = self.peers().client(address)?;
        forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.set_room_access(request).await
        })
        .await
    }

    /// Asks the user's owner at `address` for an ExportUser, with the
    /// caller's credentials (P7). The owner asks every node in turn, so this
    /// waits for twice the forwarding time.
    pub(crate) async fn forward_export_user(
        &self,
        address: &str,
        request: pb::ExportUserRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::ExportUserResponse, ServiceError> {
        let client = self.peers().client(address)?;
        forward(client, address, 2 * FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.export_user(request).await
        })
        .await
    }

    /// Asks the user's owner at `address` to erase it, with the caller's
    /// credentials (P7), waiting as [`Membership::forward_export_user`] does.
    pub(crate) async fn forward_erase_user(
        &self,
        address: &str,
        request: pb::EraseUserRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<pb::EraseUserResponse, ServiceError> {
        let client = self.peers().client(address)?;
        forward(client, address, 2 * FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
            client.erase_user(request).await
        })
        .await
    }

    /// Opens a WatchRoom at the room's owner at `address`, as
    /// [`Membership::forward_room_snapshot`] asks for a RoomSnapshot.
    pub(crate) async fn forward_watch_room(
        &self,
        address: &str,
        request: pb::WatchRoomRequest,
        authorization: Option<&MetadataValue<Ascii>>,
    ) -> Result<PeerStream<pb::RoomEvent>, ServiceError> {
        let (client, place) = self.peers().stream_client(address)?;
        let stream =
            forward(client, address, FORWARD_TIMEOUT, request, authorization, |mut client, request| async move {
                client.watch_room(request).await
            });
        Ok(PeerStream::new(stream.await?, place))
    }
}
