//! The client's own errors: what can go wrong before any request reaches presenced.
//!
//! Answers from the server stay [`tonic::Status`], as the server sent them, so that
//! callers match on the gRPC code the contract names (`NOT_FOUND`, `FAILED_PRECONDITION`...).

/// Why the client could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The address or the TLS material cannot be used (an address should
    /// look like `http://127.0.0.1:50051` or `https://presence.example:50051`).
    #[error("{0}")]
    Tls(#[from] presence_tls::TlsError),
    /// No connection could be made to the endpoint (the source's chain says
    /// why: refused, an unknown CA, a certificate refused by the server...).
    #[error("cannot connect to {endpoint}: {}", chain(source))]
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

/// An error and its sources, one after another: tonic's transport error
/// alone says only "transport error", while the reason a TLS handshake
/// failed is several sources down.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(next) = source {
        let next_text = next.to_string();
        if !text.contains(&next_text) {
            text.push_str(": ");
            text.push_str(&next_text);
        }
        source = next.source();
    }
    text
}
