//! How a client reaches presenced: `http://` in plaintext, or `https://`
//! with TLS (T1): the server's CA (the system's trusted roots without one),
//! a client certificate for mutual TLS (T2), and a server name to verify
//! when the address's host is not the certificate's. Every channel this
//! crate opens comes from [`connect`] or [`connect_lazy`]; so can yours, for
//! the viewer and room watchers.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use presence_tls::{ClientTls, ClientTlsFiles, TlsEndpoint};
use tonic::transport::{Channel, Endpoint};

use crate::ClientError;

/// TLS settings for `https://` addresses.
#[derive(Debug, Clone)]
pub struct ClientTlsConfig {
    tls: Arc<ClientTls>,
    server_name: Option<String>,
}

/// Two settings are equal when they share their material (clones of one
/// another) and their server name.
impl PartialEq for ClientTlsConfig {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.tls, &other.tls) && self.server_name == other.server_name
    }
}

impl ClientTlsConfig {
    /// Reads `ca` (PEM; `None` trusts the system's roots) and, for mutual
    /// TLS, a client certificate chain `cert` and its `key`. Files that
    /// change are read again by [`reload`](ClientTlsConfig::reload); connections made
    /// after it use the new material.
    pub fn from_files(ca: Option<PathBuf>, cert: Option<PathBuf>, key: Option<PathBuf>) -> Result<Self, ClientError> {
        let tls = ClientTls::load(ClientTlsFiles::new(ca, cert, key))?;
        Ok(ClientTlsConfig { tls: Arc::new(tls), server_name: None })
    }

    /// Verifies the server's certificate for `name` instead of the
    /// address's host (a server reached by IP, or through a tunnel).
    pub fn with_server_name(mut self, name: impl Into<String>) -> Self {
        self.server_name = Some(name.into());
        self
    }

    /// Reads the files again; `Ok(true)` when they changed.
    pub fn reload(&self) -> Result<bool, ClientError> {
        Ok(self.tls.reload()?)
    }
}

/// The transport settings of every channel: no Nagle delay, and HTTP/2
/// keep-alives so that a vanished server is noticed within seconds.
fn endpoint(address: &str, tls: Option<&ClientTlsConfig>) -> Result<(Endpoint, presence_tls::Connector), ClientError> {
    let target =
        TlsEndpoint::new(address, tls.map(|tls| Arc::clone(&tls.tls)), tls.and_then(|tls| tls.server_name.clone()))?;
    let endpoint = target
        .endpoint()
        .connect_timeout(Duration::from_secs(5))
        .http2_keep_alive_interval(Duration::from_secs(10))
        .keep_alive_timeout(Duration::from_secs(5))
        .keep_alive_while_idle(true);
    Ok((endpoint, target.connector()))
}

/// Connects to `address` now, so that a wrong address, an unknown CA or a
/// refused certificate fails here.
pub async fn connect(address: &str, tls: Option<&ClientTlsConfig>) -> Result<Channel, ClientError> {
    let (endpoint, connector) = endpoint(address, tls)?;
    endpoint
        .connect_with_connector(connector)
        .await
        .map_err(|source| ClientError::Connect { endpoint: address.to_owned(), source })
}

/// A channel to `address` that connects on its first call.
pub fn connect_lazy(address: &str, tls: Option<&ClientTlsConfig>) -> Result<Channel, ClientError> {
    let (endpoint, connector) = endpoint(address, tls)?;
    Ok(endpoint.connect_with_connector_lazy(connector))
}
