//! TLS from a client's side for the tests: certificates made on the spot
//! (`presence_tls::testing`), and raw handshakes where a test must see what
//! the server presents or speak HTTP/1.1 over TLS itself.

use std::path::Path;
use std::sync::Arc;

use presence_client::ClientTlsConfig;
pub use presence_tls::testing::{Issued, Lifetime, Pki};
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, ServerName};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;

/// A client's TLS settings: `ca`, and a client certificate when given.
pub fn client_tls(ca: &Path, client: Option<&Issued>) -> ClientTlsConfig {
    ClientTlsConfig::from_files(
        Some(ca.to_owned()),
        client.map(|issued| issued.cert.clone()),
        client.map(|issued| issued.key.clone()),
    )
    .expect("the test's client TLS files")
}

/// The flags that serve TLS with `server`'s certificate.
pub fn tls_flags(server: &Issued) -> Vec<String> {
    vec!["--tls-cert".into(), server.cert.display().to_string(), "--tls-key".into(), server.key.display().to_string()]
}

/// A TLS connection to `addr` trusting `ca`, offering `alpn`, with a client
/// certificate when given; the handshake's error as the client sees it.
pub async fn handshake(
    addr: &str,
    ca: &Path,
    client: Option<&Issued>,
    alpn: &[&[u8]],
) -> std::io::Result<TlsStream<TcpStream>> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in CertificateDer::pem_file_iter(ca).unwrap() {
        roots.add(cert.unwrap()).unwrap();
    }
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match client {
        Some(issued) => {
            let chain = CertificateDer::pem_file_iter(&issued.cert).unwrap().map(Result::unwrap).collect();
            let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&issued.key).unwrap();
            builder.with_client_auth_cert(chain, key).unwrap()
        }
        None => builder.with_no_client_auth(),
    };
    config.alpn_protocols = alpn.iter().map(|protocol| protocol.to_vec()).collect();
    let tcp = TcpStream::connect(addr).await?;
    tokio_rustls::TlsConnector::from(Arc::new(config)).connect(ServerName::try_from("localhost").unwrap(), tcp).await
}

/// The certificate the server presented on `stream`.
pub fn presented(stream: &TlsStream<TcpStream>) -> CertificateDer<'static> {
    stream.get_ref().1.peer_certificates().expect("the server presents a certificate")[0].clone().into_owned()
}

/// A TLS acceptor presenting `issued` (its chain's first certificate), for a
/// server a test plays (a JWKS document, a webhook receiver).
pub fn acceptor(issued: &Issued) -> tokio_rustls::TlsAcceptor {
    let chain = vec![first_certificate(&issued.cert)];
    let key = rustls::pki_types::PrivateKeyDer::from_pem_file(&issued.key).unwrap();
    #[allow(deprecated)]
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .unwrap();
    tokio_rustls::TlsAcceptor::from(Arc::new(config))
}

/// The first certificate of a PEM file.
pub fn first_certificate(path: &Path) -> CertificateDer<'static> {
    CertificateDer::pem_file_iter(path).unwrap().next().unwrap().unwrap()
}

/// Sends `request` (a whole HTTP/1.1 request) on `stream` and reads the
/// answer to the end (the server closes the connection: `connection: close`).
pub async fn http1_exchange(mut stream: TlsStream<TcpStream>, request: &[u8]) -> Vec<u8> {
    stream.write_all(request).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(super::PATIENCE, stream.read_to_end(&mut answer)).await;
    answer
}

/// `GET /metrics` on a metrics port that serves TLS, trusting `ca`.
pub async fn scrape_tls(addr: &str, ca: &Path) -> String {
    let stream = handshake(addr, ca, None, &[b"http/1.1"]).await.expect("the metrics port over TLS");
    let request = b"GET /metrics HTTP/1.1\r\nhost: localhost\r\nconnection: close\r\n\r\n";
    String::from_utf8_lossy(&http1_exchange(stream, request).await).into_owned()
}

/// The metrics over TLS, scraped again until `series` reads a value `wanted` accepts.
pub async fn scrape_tls_until(addr: &str, ca: &Path, series: &str, wanted: impl Fn(f64) -> bool) -> String {
    let deadline = std::time::Instant::now() + super::PATIENCE;
    loop {
        let metrics = scrape_tls(addr, ca).await;
        if super::scrape::sample(&metrics, series).is_some_and(&wanted) {
            return metrics;
        }
        assert!(std::time::Instant::now() < deadline, "{series} never reached the value wanted:\n{metrics}");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}
