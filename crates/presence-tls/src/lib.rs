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
//! Nothing here reads a clock other than to check a certificate's validity
//! (or to date a development certificate, `dev_certs`),
//! spawns a task or records a metric: the server decides when to reload and
//! what to count.

mod certificate;
mod client;
pub mod dev_certs;
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

/// The crypto every configuration here uses: rustls's `ring` provider, with
/// X25519 first among the key exchanges and AES-128-GCM first among the
/// ciphers. The provider's own defaults put P-384 first, which `ring` runs on
/// generic big-number code: measured on the benchmark machine, a handshake
/// cost the server about 1 ms of CPU with P-384 against a tenth of that with
/// X25519 (`docs/benchmarks.md`, "TLS"). AES-128-GCM is as safe for this use
/// and cheaper per byte than AES-256-GCM.
///
/// rustls marks the `ring` provider deprecated because it has no
/// post-quantum key exchange (X25519MLKEM768, which its `aws-lc-rs` provider
/// has); `ring` builds with a plain C compiler in seconds where `aws-lc-rs`
/// needs minutes and more tools, and what etcd, browsers and Node negotiate
/// with it today is X25519. `docs/security.md` says so.
#[allow(deprecated)]
fn provider() -> std::sync::Arc<rustls::crypto::CryptoProvider> {
    use rustls::crypto::ring::{cipher_suite as suite, default_provider, kx_group};
    std::sync::Arc::new(rustls::crypto::CryptoProvider {
        kx_groups: vec![kx_group::X25519, kx_group::SECP256R1, kx_group::SECP384R1],
        cipher_suites: vec![
            suite::TLS13_AES_128_GCM_SHA256,
            suite::TLS13_AES_256_GCM_SHA384,
            suite::TLS13_CHACHA20_POLY1305_SHA256,
            suite::TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256,
            suite::TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384,
            suite::TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256,
            suite::TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256,
            suite::TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384,
            suite::TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256,
        ],
        ..default_provider()
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn x25519_and_aes_128_are_offered_first() {
        let provider = super::provider();
        assert_eq!(provider.kx_groups[0].name(), rustls::NamedGroup::X25519);
        assert_eq!(provider.cipher_suites[0].suite(), rustls::CipherSuite::TLS13_AES_128_GCM_SHA256);
        assert_eq!(
            provider.cipher_suites.len(),
            rustls::crypto::ring::ALL_CIPHER_SUITES.len(),
            "every suite, reordered"
        );
    }
}
