//! HTTP/1.1 requests the server makes itself, over TLS or in plaintext:
//! fetching the viewer keys' JWKS document (T4), POSTing the change feed's
//! webhook batches (F4).

use std::sync::Arc;

use hyper::client::conn::http1::SendRequest;
use hyper_util::rt::TokioIo;
use presence_tls::{ClientTls, ClientTlsFiles, TlsError};

/// A TLS configuration for HTTPS to servers whose certificates come from
/// `files`' CA (without one, from the system's trusted roots).
pub(crate) fn tls_config(files: ClientTlsFiles) -> Result<Arc<rustls::ClientConfig>, TlsError> {
    let mut config = (*ClientTls::load(files)?.config()).clone();
    // Offered alone: a server that speaks only HTTP/1.1 refuses a client that
    // offers only h2 (the default, for gRPC).
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(config))
}

/// An HTTP/1.1 connection to `url`'s host and port: TLS with `tls` (for an
/// `https://` URL), else plaintext. A task of its own drives it, until the
/// returned sender and the bodies of its answers are dropped.
pub(crate) async fn connect<B>(
    url: &http::Uri,
    tls: Option<&Arc<rustls::ClientConfig>>,
) -> Result<SendRequest<B>, String>
where
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let host = url.host().ok_or("the URL has no host")?.trim_matches(['[', ']']).to_owned();
    let port = url.port_u16().unwrap_or(if tls.is_some() { 443 } else { 80 });
    let tcp =
        tokio::net::TcpStream::connect((host.as_str(), port)).await.map_err(|err| format!("cannot connect: {err}"))?;
    // A request is one write: it must not wait for the peer's delayed ACK.
    tcp.set_nodelay(true).map_err(|err| format!("cannot connect: {err}"))?;
    let Some(tls) = tls else { return handshake(TokioIo::new(tcp)).await };
    let name = rustls::pki_types::ServerName::try_from(host).map_err(|err| format!("not a server name: {err}"))?;
    let stream = tokio_rustls::TlsConnector::from(Arc::clone(tls))
        .connect(name, tcp)
        .await
        .map_err(|err| format!("TLS: {err}"))?;
    handshake(TokioIo::new(stream)).await
}

async fn handshake<I, B>(io: I) -> Result<SendRequest<B>, String>
where
    I: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    B: hyper::body::Body + Send + 'static,
    B::Data: Send,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let (sender, connection) = hyper::client::conn::http1::handshake(io).await.map_err(|err| format!("HTTP: {err}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(sender)
}

/// The `host` header of a request to `url`: its host and port as given.
pub(crate) fn host_header(url: &http::Uri) -> String {
    url.authority().map_or_else(String::new, |authority| authority.as_str().to_owned())
}

/// The `user-agent` of every request the server makes.
pub(crate) const USER_AGENT: &str = concat!("presenced/", env!("CARGO_PKG_VERSION"));
