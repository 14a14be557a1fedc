//! The client's own errors: what can go wrong before any request reaches presenced.
//!
//! Answers from the server stay [`tonic::Status`], as the server sent them, so that
//! callers match on the gRPC code the contract names (`NOT_FOUND`, `FAILED_PRECONDITION`...).

/// Why the client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint is not a valid URI (it should look like `http://127.0.0.1:50051`).
    #[error("invalid endpoint {endpoint:?}: {source}")]
    InvalidEndpoint {
        /// The endpoint as given.
        endpoint: String,
        /// What the transport found wrong with it.
        #[source]
        source: tonic::transport::Error,
    },
    /// No connection could be made to the endpoint.
    #[error("cannot connect to {endpoint}: {source}")]
    Connect {
        /// The endpoint as given.
        endpoint: String,
        /// Why the connection failed.
        #[source]
        source: tonic::transport::Error,
    },
    /// etcd could not be read (to follow a cluster's slot map).
    #[error("cannot read the slot map from etcd at {endpoints}: {source}")]
    Etcd {
        /// The endpoints as given.
        endpoints: String,
        /// What etcd (or the connection to it) answered.
        #[source]
        source: presence_cluster::Error,
    },
}
