//! Calls to the other nodes (C2): every node-to-node request is made with
//! [`with_credential`] and waited for with [`call_peer`]; a client's request
//! for users or rooms another node owns goes there through [`forward`],
//! with the client's own credentials, marked [`FORWARDED`] so that the
//! owner answers for its own users only and sends nothing on.

use std::future::Future;
use std::time::Duration;

use tonic::Status;
use tonic::metadata::{Ascii, MetadataValue};

use crate::audit::FORWARDED;
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

/// The next message of a stream the node at `node` answers with, within
/// `within`: what was `awaited` is owed, so an end before it is the node's
/// failure.
pub(crate) async fn next_message<T>(
    node: &str,
    within: Duration,
    awaited: &'static str,
    stream: &mut tonic::Streaming<T>,
) -> Result<T, ServiceError> {
    let node = node.to_owned();
    match tokio::time::timeout(within, stream.message()).await {
        Ok(Ok(Some(message))) => Ok(message),
        Ok(Ok(None)) => Err(ServiceError::PeerEnded { node, awaited }),
        Ok(Err(status)) => Err(ServiceError::Peer { node, status }),
        Err(_) => Err(ServiceError::PeerTimedOut { node, awaited, within }),
    }
}

#[cfg(test)]
mod tests {
    use presence_proto::v1 as pb;
    use tonic::Code;

    use super::*;
    use crate::cluster::peers::Peers;
    use crate::cluster::protocol::PROTOCOL_HEADER;

    const OWNER: &str = "10.0.0.2:4000";

    /// C2: what reaches the owner is marked forwarded (so it answers for its
    /// own users only), carries the caller's credential and this node's
    /// protocol; the owner's answer comes back as it is.
    #[tokio::test]
    async fn c2_a_forwarded_request_is_marked_with_the_callers_credential_and_brings_the_answer_back() {
        let credential = MetadataValue::from_static("Bearer viewer-token");
        let mut sent = None;
        let answer =
            forward((), OWNER, FORWARD_TIMEOUT, pb::SnapshotRequest::default(), Some(&credential), |(), request| {
                sent = Some(request.metadata().clone());
                async { Ok(tonic::Response::new("the owner's answer")) }
            })
            .await;
        assert_eq!(answer.unwrap(), "the owner's answer");
        let sent = sent.expect("the owner was called");
        assert_eq!(sent.get(FORWARDED).and_then(|mark| mark.to_str().ok()), Some("1"));
        assert_eq!(sent.get("authorization"), Some(&credential));
        assert!(sent.contains_key(PROTOCOL_HEADER), "{sent:?}");
    }

    /// C2: the owner's refusal reaches the caller with its code, the owner named.
    #[tokio::test]
    async fn c2_an_owners_refusal_is_relayed_with_its_code_and_the_owner_named() {
        let refused = forward((), OWNER, FORWARD_TIMEOUT, pb::SnapshotRequest::default(), None, |(), _| async {
            Err::<tonic::Response<()>, _>(Status::permission_denied("Snapshot: requires a viewer"))
        })
        .await
        .unwrap_err();
        assert!(matches!(&refused, ServiceError::Peer { node, .. } if node == OWNER), "{refused:?}");
        let status = Status::from(refused);
        assert_eq!(
            (status.code(), status.message()),
            (Code::PermissionDenied, "node at 10.0.0.2:4000: Snapshot: requires a viewer")
        );
    }

    /// C2: an owner that does not answer is given up at the wait's end, as
    /// DEADLINE_EXCEEDED naming it.
    #[tokio::test(start_paused = true)]
    async fn c2_an_owner_silent_past_the_wait_is_given_up_then_as_deadline_exceeded() {
        let started = tokio::time::Instant::now();
        let within = Duration::from_millis(700);
        let silent = forward((), OWNER, within, pb::SnapshotRequest::default(), None, |(), _| {
            std::future::pending::<Result<tonic::Response<()>, Status>>()
        })
        .await
        .unwrap_err();
        assert_eq!(started.elapsed(), within);
        assert!(matches!(silent, ServiceError::PeerTimedOut { .. }), "{silent:?}");
        let status = Status::from(silent);
        assert_eq!(
            (status.code(), status.message()),
            (Code::DeadlineExceeded, "node at 10.0.0.2:4000: no answer within 700ms")
        );
    }

    /// A Snapshot of `user_ids` forwarded to the node at `address`, as the
    /// caller would see its refusal.
    async fn snapshot_refused_at(address: &str, user_ids: Vec<String>) -> Status {
        let client = Peers::new(8, None).client(address).unwrap();
        let request = pb::SnapshotRequest { user_ids, ..Default::default() };
        let answer = forward(client, address, FORWARD_TIMEOUT, request, None, |mut client, request| async move {
            client.snapshot(request).await
        });
        Status::from(answer.await.expect_err("refused"))
    }

    /// C2: an owner nobody listens for is UNAVAILABLE (the client retries),
    /// the owner named.
    #[tokio::test]
    async fn c2_an_owner_nobody_listens_for_is_unavailable_naming_it() {
        let address = {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            listener.local_addr().unwrap().to_string()
        };
        let status = snapshot_refused_at(&address, vec!["u1".into()]).await;
        assert_eq!(status.code(), Code::Unavailable, "{status:?}");
        assert!(status.message().starts_with(&format!("node at {address}: ")), "{status:?}");
    }

    /// C2 against a real owner: a presenced on 127.0.0.1 refuses a bad
    /// request forwarded to it, and its refusal reaches the caller with its
    /// code and the field it names.
    #[tokio::test]
    async fn c2_a_real_owners_refusal_reaches_the_caller_with_its_code_and_field() {
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let address = listener.local_addr().unwrap().to_string();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let server = tokio::spawn(crate::serve(listener, crate::ServerConfig::default(), async {
            let _ = stopped.await;
        }));
        let status = snapshot_refused_at(&address, vec![String::new()]).await;
        assert_eq!(status.code(), Code::InvalidArgument, "{status:?}");
        assert!(status.message().starts_with(&format!("node at {address}: user_ids: ")), "{status:?}");
        let _ = stop.send(());
        server.await.unwrap().unwrap();
    }
}
