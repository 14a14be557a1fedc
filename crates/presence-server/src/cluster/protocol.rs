//! The node-to-node protocol's version, so that nodes of two adjacent
//! versions serve one cluster during a rolling upgrade (D1) and a node
//! refuses what it cannot understand instead of misreading it.
//!
//! Every request one node makes of another (the `Cluster` service, and
//! client calls forwarded to an owner) says, in metadata, the protocol it
//! speaks as `major.minor` and the sender's presenced version. A minor
//! version only adds fields and calls (protobuf's unknown fields are
//! skipped, and a call a node does not know is `UNIMPLEMENTED`), so a node
//! reads any minor of its own major. A different major changes what a
//! message means: the receiver refuses the request `FAILED_PRECONDITION`,
//! naming both versions, before any handler reads it. A request without the
//! header comes from a node older than the header, which spoke 1.0.

use tonic::metadata::{AsciiMetadataValue, MetadataMap};

use crate::error::ServiceError;

/// The metadata key of the sender's protocol, `major.minor`.
pub(crate) const PROTOCOL_HEADER: &str = "presenced-cluster-protocol";
/// The metadata key of the sender's presenced version, for the refusal's message.
pub(crate) const VERSION_HEADER: &str = "presenced-version";

/// A version of the node-to-node protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Protocol {
    /// Changes of meaning: nodes of different majors cannot talk.
    pub(crate) major: u32,
    /// Added fields and calls: nodes of one major talk whatever their minors.
    pub(crate) minor: u32,
}

impl std::fmt::Display for Protocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.major, self.minor)
    }
}

/// The protocol this build speaks. A build with the `next-cluster-protocol`
/// feature speaks the next minor, with a field this one does not know
/// (`SlotState.sender_version`, `FollowUpdate.sender_version`), so that a
/// roll between two adjacent versions can be run (`tools/roll`).
pub(crate) const PROTOCOL: Protocol =
    Protocol { major: 1, minor: if cfg!(feature = "next-cluster-protocol") { 1 } else { 0 } };

/// What a node of this build says of itself: its protocol, as sent.
fn protocol_value() -> AsciiMetadataValue {
    PROTOCOL.to_string().parse().expect("digits and a dot are ASCII")
}

/// Marks a request to another node with this node's protocol and version.
pub(crate) fn stamp(metadata: &mut MetadataMap) {
    metadata.insert(PROTOCOL_HEADER, protocol_value());
    metadata.insert(VERSION_HEADER, AsciiMetadataValue::from_static(env!("CARGO_PKG_VERSION")));
}

/// Whether a request whose headers are `headers` comes from a node whose
/// protocol this node understands: anything of its own major, or no header
/// (a node from before it). A request of no other node has no header either.
pub(crate) fn check(headers: &http::HeaderMap) -> Result<(), ServiceError> {
    let Some(value) = headers.get(PROTOCOL_HEADER) else { return Ok(()) };
    let theirs = value.to_str().ok().and_then(parse).ok_or_else(|| {
        ServiceError::invalid(PROTOCOL_HEADER, format!("{value:?} is not a protocol version (major.minor)"))
    })?;
    if theirs.major == PROTOCOL.major {
        return Ok(());
    }
    let their_version = headers.get(VERSION_HEADER).and_then(|value| value.to_str().ok()).unwrap_or("unknown");
    Err(ServiceError::ProtocolMismatch {
        theirs: theirs.to_string(),
        their_version: their_version.to_owned(),
        ours: PROTOCOL.to_string(),
    })
}

/// `major.minor`.
fn parse(text: &str) -> Option<Protocol> {
    let (major, minor) = text.split_once('.')?;
    Some(Protocol { major: major.parse().ok()?, minor: minor.parse().ok()? })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(protocol: Option<&str>) -> http::HeaderMap {
        let mut headers = http::HeaderMap::new();
        if let Some(protocol) = protocol {
            headers.insert(PROTOCOL_HEADER, protocol.parse().unwrap());
            headers.insert(VERSION_HEADER, "9.0.0".parse().unwrap());
        }
        headers
    }

    #[test]
    fn d1_a_node_reads_every_minor_of_its_major_and_refuses_another_major_naming_both() {
        assert!(check(&headers(None)).is_ok(), "a node from before the header");
        assert!(check(&headers(Some("1.0"))).is_ok());
        assert!(check(&headers(Some("1.7"))).is_ok(), "a later minor only adds fields");
        let refused = tonic::Status::from(check(&headers(Some("2.0"))).unwrap_err());
        assert_eq!(refused.code(), tonic::Code::FailedPrecondition);
        assert_eq!(
            refused.message(),
            format!(
                "a node running presenced 9.0.0 speaks node-to-node protocol 2.0, which this node (presenced {}, \
                 protocol {PROTOCOL}) cannot read: the nodes of a cluster must share the protocol's major version",
                env!("CARGO_PKG_VERSION")
            )
        );
        let malformed = tonic::Status::from(check(&headers(Some("one"))).unwrap_err());
        assert_eq!(malformed.code(), tonic::Code::InvalidArgument);
        assert!(malformed.message().contains(PROTOCOL_HEADER), "{malformed:?}");
    }

    #[test]
    fn a_stamped_request_says_this_builds_protocol_and_version() {
        let mut metadata = MetadataMap::new();
        stamp(&mut metadata);
        assert!(check(&metadata.clone().into_headers()).is_ok());
        assert_eq!(metadata.get(PROTOCOL_HEADER).unwrap(), PROTOCOL.to_string().as_str());
        assert_eq!(metadata.get(VERSION_HEADER).unwrap(), env!("CARGO_PKG_VERSION"));
    }
}
