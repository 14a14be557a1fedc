//! presenced's TLS (contract T1, T2, T4), in one place for every connection
//! presenced makes or takes.
//!
//! - [`ServerTls`]: the service and metrics ports' side. Its material (the
//!   certificate chain and key, the client CA for mutual TLS, the cluster's CA
//!   and the peer certificate shown to other nodes) is read from PEM files,
//!   checked (a certificate out of its validity, or a key that is not the
//!   certificate's, is refused with the file named), and read again when the
//!   files change ([`ServerTls::reload`]): connections accepted after that see
//!   the new material, connections already established keep theirs. What a
//!   client's certificate makes of its holder (a service caller, a cluster
//!   node) is [`ClientCertificate`].
//! - [`ClientTls`] and [`Connector`]: the dialing side, for the Rust client,
//!   the CLI, the load generator, node-to-node calls and etcd: `https://`
//!   addresses, a CA (or the system's roots), a client certificate, a server
//!   name, reloaded the same way.
//!
//! The crypto is rustls with its `ring` provider (no OpenSSL, no C toolchain
//! beyond `ring`'s own), chosen per configuration rather than installed
//! process-wide, so a library user's own choice is not overridden.
//!
//! Nothing here reads a clock other than to check a certificate's validity,
//! spawns a task or records a metric: the server decides when to reload and
//! what to count.

mod certificate;
mod client;
mod error;
mod files;
mod server;
#[cfg(feature = "testing")]
pub mod testing;

pub use certificate::{CertificateFacts, Validity};
pub use client::{ClientTls, ClientTlsFiles, Connector, TlsEndpoint};
pub use error::TlsError;
pub use server::{ClientCertificate, PeerFiles, ServerTls, ServerTlsFiles, ServerTlsSnapshot};

/// The ALPN protocol a presenced node offers, beside `h2`, when it calls
/// another node: it never wins the negotiation (a server picks `h2`, the
/// first of its own list that the client offers), but it tells the server to
/// show its peer certificate, from the cluster's CA, instead of its service
/// certificate (which may come from a public CA the other nodes do not trust).
pub const PEER_ALPN_MARKER: &[u8] = b"presenced-peer";

/// The crypto every configuration here uses: rustls's `ring` provider.
/// rustls marks it deprecated because it has no post-quantum key exchange
/// (X25519MLKEM768, which its `aws-lc-rs` provider has); `ring` builds with
/// a plain C compiler in seconds where `aws-lc-rs` needs minutes and more
/// tools, and TLS 1.3 with X25519 is what etcd, browsers and Node negotiate
/// with it today. `docs/security.md` says so.
#[allow(deprecated)]
fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    std::sync::Arc::new(rustls::crypto::ring::default_provider())
}
