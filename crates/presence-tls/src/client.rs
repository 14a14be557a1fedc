//! The dialing side: a client's TLS material, reloaded when its files
//! change, and the connector every presenced client dials with, plaintext or TLS.

use std::io;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::SystemTime;

use arc_swap::ArcSwap;
use http::Uri;
use hyper_util::rt::TokioIo;
use rustls::client::ResolvesClientCert;
use rustls::pki_types::ServerName;
use rustls::sign::CertifiedKey;
use rustls::{ClientConfig, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

use crate::certificate::CertificateFacts;
use crate::files::{PemFile, Reading};
use crate::server::certified_key;
use crate::{PEER_ALPN_MARKER, TlsError, provider};

/// Where a client's TLS material is, and the flags that named it (for messages).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientTlsFiles {
    /// The CA the server's certificate must come from; without it, the
    /// system's trusted roots.
    pub ca: Option<PathBuf>,
    /// A client certificate chain, for servers that require one (mutual TLS).
    pub cert: Option<PathBuf>,
    /// Its key; given exactly when `cert` is.
    pub key: Option<PathBuf>,
    /// The flags `ca`, `cert` and `key` came from (`--ca`, `--cert`, `--key`).
    pub flags: [&'static str; 3],
    /// Dial as a node of the cluster: offer [`PEER_ALPN_MARKER`], so that the
    /// other node shows its peer certificate.
    pub as_cluster_node: bool,
}

impl ClientTlsFiles {
    /// The files a command-line client names with `--ca`, `--cert` and `--key`.
    pub fn new(ca: Option<PathBuf>, cert: Option<PathBuf>, key: Option<PathBuf>) -> ClientTlsFiles {
        ClientTlsFiles { ca, cert, key, flags: ["--ca", "--cert", "--key"], as_cluster_node: false }
    }

    /// The same files, named by other flags in messages.
    pub fn named(mut self, flags: [&'static str; 3]) -> ClientTlsFiles {
        self.flags = flags;
        self
    }
}

/// A client's TLS configuration, read from [`ClientTlsFiles`] and read again
/// by [`reload`](ClientTls::reload): connections made after a reload use
/// the new material.
pub struct ClientTls {
    files: ClientTlsFiles,
    current: ArcSwap<ClientMaterial>,
}

struct ClientMaterial {
    config: Arc<ClientConfig>,
    certificate: Option<CertificateFacts>,
    fingerprint: u64,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClientTls").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Reads and checks the material.
    pub fn load(files: ClientTlsFiles) -> Result<ClientTls, TlsError> {
        let material = build(&files, SystemTime::now())?;
        Ok(ClientTls { files, current: ArcSwap::from_pointee(material) })
    }

    /// The configuration connections made now use.
    pub fn config(&self) -> Arc<ClientConfig> {
        Arc::clone(&self.current.load().config)
    }

    /// Reads the files again and, if anything changed, uses the new material
    /// from the next connection on; `Ok(true)` when it changed. On an error
    /// the current material stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let material = build(&self.files, SystemTime::now())?;
        if material.fingerprint == self.current.load().fingerprint {
            return Ok(false);
        }
        self.current.store(Arc::new(material));
        Ok(true)
    }

    /// The current configuration with a session cache of its own, holding up
    /// to `sessions` sessions: what one of many separate clients would have
    /// (a load generator playing them resumes each one's own session).
    pub fn config_of_one_client(&self, sessions: usize) -> Arc<ClientConfig> {
        let mut config = (*self.config()).clone();
        config.resumption = rustls::client::Resumption::in_memory_sessions(sessions);
        Arc::new(config)
    }

    /// The client certificate presented, if any.
    pub fn certificate(&self) -> Option<CertificateFacts> {
        self.current.load().certificate.clone()
    }

    /// Where the material is read from.
    pub fn files(&self) -> &ClientTlsFiles {
        &self.files
    }
}

fn build(files: &ClientTlsFiles, now: SystemTime) -> Result<ClientMaterial, TlsError> {
    let [ca_flag, cert_flag, key_flag] = files.flags;
    let mut reading = Reading::default();
    let roots = match &files.ca {
        Some(path) => {
            let file = PemFile::new(ca_flag, path);
            file.roots(&reading.read(&file)?)?
        }
        None => system_roots()?,
    };
    let builder = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsError::Settings(err.to_string()))?
        .with_root_certificates(roots);
    let (mut config, certificate) = match (&files.cert, &files.key) {
        (Some(cert), Some(key)) => {
            let (key, facts) =
                certified_key(&mut reading, &PemFile::new(cert_flag, cert), &PemFile::new(key_flag, key), now)?;
            (builder.with_client_cert_resolver(Arc::new(ClientCertificateKey(key))), Some(facts))
        }
        (None, None) => (builder.with_no_client_auth(), None),
        (Some(_), None) => return Err(TlsError::Settings(format!("{cert_flag} needs {key_flag}: its private key"))),
        (None, Some(_)) => return Err(TlsError::Settings(format!("{key_flag} needs {cert_flag}: its certificate"))),
    };
    config.alpn_protocols = vec![b"h2".to_vec()];
    if files.as_cluster_node {
        config.alpn_protocols.push(PEER_ALPN_MARKER.to_vec());
    }
    Ok(ClientMaterial { config: Arc::new(config), certificate, fingerprint: reading.fingerprint() })
}

/// The system's trusted roots, for servers with certificates from a public CA.
fn system_roots() -> Result<RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        return Err(TlsError::Settings(format!(
            "no CA given and no trusted roots found on this system ({} errors reading them); name the server's CA",
            found.errors.len()
        )));
    }
    Ok(roots)
}

/// Always the one client certificate.
#[derive(Debug)]
struct ClientCertificateKey(Arc<CertifiedKey>);

impl ResolvesClientCert for ClientCertificateKey {
    fn resolve(&self, _root_hint_subjects: &[&[u8]], _sigschemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        Some(Arc::clone(&self.0))
    }

    fn has_certs(&self) -> bool {
        true
    }
}

/// An address as a client gives it (`http://host:port` or `https://...`),
/// ready for tonic: tonic dials [`dial`](TlsEndpoint::dial) through
/// [`connector`](TlsEndpoint::connector), which does the TLS itself, and
/// sends the address's own scheme in requests.
#[derive(Debug, Clone)]
pub struct TlsEndpoint {
    address: Uri,
    connector: Connector,
}

impl TlsEndpoint {
    /// `address` with `tls` for an `https://` one (required: its CA and
    /// client certificate), and `server_name` to verify instead of the
    /// address's host. An `http://` address is dialled in plaintext; giving
    /// it TLS material is refused, so that a typo in the scheme does not
    /// silently send tokens in the clear.
    pub fn new(
        address: &str,
        tls: Option<Arc<ClientTls>>,
        server_name: Option<String>,
    ) -> Result<TlsEndpoint, TlsError> {
        let uri: Uri =
            address.parse().map_err(|err| TlsError::Settings(format!("{address:?} is not an address: {err}")))?;
        let secure = match uri.scheme_str() {
            Some("https") => true,
            Some("http") => false,
            _ => {
                return Err(TlsError::Settings(format!(
                    "{address:?}: the address must start with http:// or https://"
                )));
            }
        };
        if uri.host().is_none() {
            return Err(TlsError::Settings(format!("{address:?}: the address has no host")));
        }
        let tls = match (secure, tls) {
            (true, Some(tls)) => Some(tls),
            (true, None) => Some(Arc::new(ClientTls::load(ClientTlsFiles::new(None, None, None))?)),
            (false, Some(_)) => {
                return Err(TlsError::Settings(format!(
                    "{address:?} is plaintext (http://) but TLS files are given: use https://"
                )));
            }
            (false, None) => None,
        };
        if let Some(name) = &server_name {
            ServerName::try_from(name.clone())
                .map_err(|err| TlsError::Settings(format!("{name:?} is not a server name: {err}")))?;
        }
        Ok(TlsEndpoint { address: uri, connector: Connector { tls, server_name } })
    }

    /// Whether this dials TLS.
    pub fn is_tls(&self) -> bool {
        self.connector.tls.is_some()
    }

    /// The address as given.
    pub fn address(&self) -> &Uri {
        &self.address
    }

    /// What tonic dials: the address with `http` for its scheme, because
    /// tonic refuses an `https` URI it does not do the TLS of itself.
    pub fn dial(&self) -> Uri {
        let mut parts = self.address.clone().into_parts();
        parts.scheme = Some(http::uri::Scheme::HTTP);
        Uri::from_parts(parts).unwrap_or_else(|_| self.address.clone())
    }

    /// The connector tonic dials through.
    pub fn connector(&self) -> Connector {
        self.connector.clone()
    }

    /// A tonic endpoint for this address, to be given its timeouts and then
    /// connected with [`connector`](TlsEndpoint::connector).
    pub fn endpoint(&self) -> tonic::transport::Endpoint {
        tonic::transport::Endpoint::from(self.dial()).origin(self.address.clone())
    }
}

/// Dials TCP (without Nagle's delay) and, for TLS, does the handshake with
/// the [`ClientTls`] material current at the dial. A tower service, as
/// tonic's `Endpoint::connect_with_connector` takes.
#[derive(Debug, Clone)]
pub struct Connector {
    tls: Option<Arc<ClientTls>>,
    server_name: Option<String>,
}

impl tower_service::Service<Uri> for Connector {
    type Response = TokioIo<ClientStream>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<TokioIo<ClientStream>>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (tls, server_name) = (self.tls.clone(), self.server_name.clone());
        Box::pin(async move {
            let host = uri.host().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']').to_owned();
            let port = uri.port_u16().unwrap_or(if tls.is_some() { 443 } else { 80 });
            let tcp = TcpStream::connect((host.as_str(), port)).await?;
            tcp.set_nodelay(true)?;
            let Some(tls) = tls else { return Ok(TokioIo::new(ClientStream::Plain(tcp))) };
            let name = ServerName::try_from(server_name.unwrap_or(host))
                .map_err(|err| io::Error::new(io::ErrorKind::InvalidInput, err))?;
            let mut stream = tokio_rustls::TlsConnector::from(tls.config()).connect(name, tcp).await?;
            let first = first_bytes(&mut stream).await?;
            Ok(TokioIo::new(ClientStream::Tls(Box::new(stream), first)))
        })
    }
}

/// How long a new TLS connection waits for the server's first bytes.
const FIRST_BYTES_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// Waits for what a TLS 1.3 server sends right after the handshake, and
/// returns any application bytes among it, to be read again. Why: in TLS
/// 1.3 a client's handshake is complete before the server has checked the
/// client's certificate, so a server that refuses it (or the lack of one)
/// does so with an alert after the handshake. Read here, that alert fails
/// the connection with what it says ("CertificateRequired", "UnknownCA");
/// left to hyper, it ends the connection and the caller sees only
/// "connection closed". A server that accepted the client sends its session
/// tickets (rustls, Go and OpenSSL servers all do) or its first bytes, which
/// end the wait; a server that sends neither is given [`FIRST_BYTES_WAIT`].
async fn first_bytes(stream: &mut tokio_rustls::client::TlsStream<TcpStream>) -> io::Result<Vec<u8>> {
    if stream.get_ref().1.protocol_version() != Some(rustls::ProtocolVersion::TLSv1_3) {
        // TLS 1.2 checks the client's certificate within the handshake.
        return Ok(Vec::new());
    }
    let mut first = vec![0; 1024];
    let mut buf = ReadBuf::new(&mut first);
    let waited = tokio::time::timeout(
        FIRST_BYTES_WAIT,
        std::future::poll_fn(|cx| match Pin::new(&mut *stream).poll_read(cx, &mut buf) {
            Poll::Ready(read) => Poll::Ready(read),
            Poll::Pending if stream.get_ref().1.tls13_tickets_received() > 0 => Poll::Ready(Ok(())),
            Poll::Pending => Poll::Pending,
        }),
    )
    .await;
    match waited {
        Ok(Ok(())) | Err(_) => {
            let read = buf.filled().len();
            first.truncate(read);
            Ok(first)
        }
        Ok(Err(err)) => Err(err),
    }
}

/// A connection a [`Connector`] made.
#[derive(Debug)]
pub enum ClientStream {
    /// Plaintext.
    Plain(TcpStream),
    /// TLS, and the first bytes the server sent, still to be read.
    Tls(Box<tokio_rustls::client::TlsStream<TcpStream>>, Vec<u8>),
}

impl AsyncRead for ClientStream {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_read(cx, buf),
            ClientStream::Tls(_, first) if !first.is_empty() => {
                let taken = first.len().min(buf.remaining());
                buf.put_slice(&first[..taken]);
                first.drain(..taken);
                Poll::Ready(Ok(()))
            }
            ClientStream::Tls(stream, _) => Pin::new(stream).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_write(cx, buf),
            ClientStream::Tls(stream, _) => Pin::new(stream).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_write_vectored(cx, bufs),
            ClientStream::Tls(stream, _) => Pin::new(stream).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            ClientStream::Plain(stream) => stream.is_write_vectored(),
            ClientStream::Tls(stream, _) => stream.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_flush(cx),
            ClientStream::Tls(stream, _) => Pin::new(stream).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            ClientStream::Plain(stream) => Pin::new(stream).poll_shutdown(cx),
            ClientStream::Tls(stream, _) => Pin::new(stream).poll_shutdown(cx),
        }
    }
}
