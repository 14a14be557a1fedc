//! The accepting side: the service and metrics ports' TLS material, reloaded
//! when its files change, and what a client's certificate makes of its holder.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::SystemTime;

use arc_swap::ArcSwap;
use rustls::pki_types::UnixTime;
use rustls::server::danger::ClientCertVerifier;
use rustls::server::{ClientHello, ResolvesServerCert, ServerSessionMemoryCache, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{RootCertStore, ServerConfig, ServerConnection};

use crate::certificate::CertificateFacts;
use crate::files::{PemFile, Reading};
use crate::{PEER_ALPN_MARKER, TlsError, provider};

/// TLS 1.2 sessions remembered for resumption by id; TLS 1.3 (and 1.2 with
/// tickets) resumes from tickets, which take no server memory.
const SESSION_CACHE: usize = 4096;

/// Where the service port's TLS material is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ServerTlsFiles {
    /// The certificate chain, the end entity first (`--tls-cert`).
    pub cert: PathBuf,
    /// Its private key (`--tls-key`).
    pub key: PathBuf,
    /// With it, every caller must present a certificate from this CA (or,
    /// for another node, from the cluster's CA) (`--tls-client-ca`).
    pub client_ca: Option<PathBuf>,
    /// Node-to-node TLS.
    pub peer: Option<PeerFiles>,
    /// Certificate identities that make their holder a service caller
    /// (`--tls-service-identity`); see [`CertificateFacts::identities`].
    pub service_identities: Vec<String>,
}

/// A node's material for node-to-node TLS: the certificate it shows other
/// nodes (as their server and as their client) and the cluster's CA, which
/// its peers' certificates must come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerFiles {
    /// The peer certificate chain.
    pub cert: PathBuf,
    /// Its key.
    pub key: PathBuf,
    /// The cluster's CA.
    pub ca: PathBuf,
    /// Whether these are the service port's own files (no `--peer-tls-*`
    /// given), for messages that name the flag the operator wrote.
    pub from_service_flags: bool,
}

impl PeerFiles {
    pub(crate) fn pem_files(&self) -> [PemFile; 3] {
        let [cert, key, ca] = if self.from_service_flags {
            ["--tls-cert", "--tls-key", "--tls-client-ca"]
        } else {
            ["--peer-tls-cert", "--peer-tls-key", "--peer-tls-ca"]
        };
        [PemFile::new(cert, &self.cert), PemFile::new(key, &self.key), PemFile::new(ca, &self.ca)]
    }
}

/// What a client's certificate makes of its holder, decided once per
/// connection, at its handshake.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClientCertificate {
    /// The certificate's identities ([`CertificateFacts::identities`]).
    pub identities: Vec<String>,
    /// One of them is a configured service identity: the holder is a
    /// service caller without a token.
    pub service: bool,
    /// It comes from the cluster's CA: the holder is another node.
    pub cluster_node: bool,
}

/// One reading of the material, and everything built from it. Connections
/// take the snapshot current at their accept and keep it.
pub struct ServerTlsSnapshot {
    config: Arc<ServerConfig>,
    /// Verifies against the cluster's CA alone.
    peer_ca: Option<Arc<dyn ClientCertVerifier>>,
    service_identities: Arc<[String]>,
    certificates: Vec<(&'static str, CertificateFacts)>,
    fingerprint: u64,
}

impl std::fmt::Debug for ServerTlsSnapshot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTlsSnapshot").field("certificates", &self.certificates).finish_non_exhaustive()
    }
}

impl ServerTlsSnapshot {
    /// The acceptor for a connection accepted now.
    pub fn acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(Arc::clone(&self.config))
    }

    /// What the certificate the client presented on `connection` (whose
    /// handshake is complete) makes of it; `None` without one.
    pub fn client_certificate(&self, connection: &ServerConnection) -> Option<ClientCertificate> {
        let (end_entity, intermediates) = connection.peer_certificates()?.split_first()?;
        let now = UnixTime::now();
        let from = |verifier: &Option<Arc<dyn ClientCertVerifier>>| {
            verifier
                .as_ref()
                .is_some_and(|verifier| verifier.verify_client_cert(end_entity, intermediates, now).is_ok())
        };
        let identities = CertificateFacts::of(end_entity).map(|facts| facts.identities).unwrap_or_default();
        let service = identities.iter().any(|identity| self.service_identities.contains(identity));
        // Checked again here, although the handshake checked the chain
        // against both CAs together: only the cluster's CA makes a node.
        let cluster_node = from(&self.peer_ca);
        Some(ClientCertificate { identities, service, cluster_node })
    }
}

/// The service port's TLS: the current [`ServerTlsSnapshot`], and the files
/// it is read from again by [`reload`](ServerTls::reload).
pub struct ServerTls {
    files: ServerTlsFiles,
    current: ArcSwap<ServerTlsSnapshot>,
    /// Kept across reloads, so that a client resumes a session it began
    /// before a rotation.
    ticketer: Arc<dyn rustls::server::ProducesTickets>,
    sessions: Arc<ServerSessionMemoryCache>,
}

impl std::fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerTls").field("files", &self.files).finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Reads and checks the material: every file readable and PEM, each
    /// certificate valid now and its key its own, each CA usable.
    pub fn load(files: ServerTlsFiles) -> Result<ServerTls, TlsError> {
        let ticketer = rustls::crypto::ring::Ticketer::new()
            .map_err(|err| TlsError::Settings(format!("cannot make a session ticket key: {err}")))?;
        let sessions = ServerSessionMemoryCache::new(SESSION_CACHE);
        let snapshot = build(&files, &ticketer, &sessions, SystemTime::now())?;
        warn_of_names_nobody_dials(&snapshot);
        Ok(ServerTls { files, current: ArcSwap::from_pointee(snapshot), ticketer, sessions })
    }

    /// The material connections accepted now are served with.
    pub fn current(&self) -> Arc<ServerTlsSnapshot> {
        self.current.load_full()
    }

    /// Reads the files again; if anything in them changed, checks the new
    /// material as [`load`](ServerTls::load) does and serves it from the
    /// next connection on. `Ok(true)` when it changed; on an error the
    /// current material stays.
    pub fn reload(&self) -> Result<bool, TlsError> {
        let snapshot = build(&self.files, &self.ticketer, &self.sessions, SystemTime::now())?;
        if snapshot.fingerprint == self.current.load().fingerprint {
            return Ok(false);
        }
        warn_of_names_nobody_dials(&snapshot);
        self.current.store(Arc::new(snapshot));
        Ok(true)
    }

    /// The certificates served, by use (`service`, `peer`), for their
    /// remaining lifetimes.
    pub fn certificates(&self) -> Vec<(&'static str, CertificateFacts)> {
        self.current.load().certificates.clone()
    }

    /// Where the material is read from.
    pub fn files(&self) -> &ServerTlsFiles {
        &self.files
    }
}

/// Warns of a served certificate that names nothing a client dials (no DNS
/// or IP subjectAltName): every TLS client refuses it, whatever address it
/// dials, so the start succeeds and each client fails later; the warning
/// says why where the operator looks first.
fn warn_of_names_nobody_dials(snapshot: &ServerTlsSnapshot) {
    for (used_as, facts) in &snapshot.certificates {
        if facts.dialable_names.is_empty() {
            let flag = if *used_as == "peer" { "--peer-tls-cert" } else { "--tls-cert" };
            tracing::warn!(
                "the certificate in {flag} names no DNS name or IP address (subjectAltName): TLS clients will \
                 refuse it whatever address they dial (a common name is not checked); make it for the names \
                 clients dial (`presenced dev-certs DIR --name NAME`, docs/security.md)"
            );
        }
    }
}

fn build(
    files: &ServerTlsFiles,
    ticketer: &Arc<dyn rustls::server::ProducesTickets>,
    sessions: &Arc<ServerSessionMemoryCache>,
    now: SystemTime,
) -> Result<ServerTlsSnapshot, TlsError> {
    let mut reading = Reading::default();
    let mut certificates = Vec::new();
    let (service, facts) = certified_key(
        &mut reading,
        &PemFile::new("--tls-cert", &files.cert),
        &PemFile::new("--tls-key", &files.key),
        now,
    )?;
    certificates.push(("service", facts));
    let client_ca = match &files.client_ca {
        Some(path) => {
            let file = PemFile::new("--tls-client-ca", path);
            Some(file.roots(&reading.read(&file)?)?)
        }
        None => None,
    };
    let (peer, peer_ca) = match &files.peer {
        Some(peer) => {
            let [cert, key, ca] = peer.pem_files();
            let (key, facts) = certified_key(&mut reading, &cert, &key, now)?;
            certificates.push(("peer", facts));
            (Some(key), Some(ca.roots(&reading.read(&ca)?)?))
        }
        None => (None, None),
    };
    let verifier_of = |roots: &RootCertStore| -> Result<Arc<dyn ClientCertVerifier>, TlsError> {
        WebPkiClientVerifier::builder_with_provider(Arc::new(roots.clone()), provider())
            .build()
            .map_err(|err| TlsError::Settings(format!("cannot verify client certificates: {err}")))
    };
    let verifier: Arc<dyn ClientCertVerifier> = match (&client_ca, &peer_ca) {
        (None, None) => WebPkiClientVerifier::no_client_auth(),
        (client, peer) => {
            let mut roots = RootCertStore::empty();
            roots.roots.extend(client.iter().chain(peer.iter()).flat_map(|store| store.roots.iter().cloned()));
            let builder = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider());
            // Without a client CA, only nodes present certificates; everyone else comes without one.
            let builder = if client.is_none() { builder.allow_unauthenticated() } else { builder };
            builder.build().map_err(|err| TlsError::Settings(format!("cannot verify client certificates: {err}")))?
        }
    };
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|err| TlsError::Settings(err.to_string()))?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(Certificates { service, peer }));
    // HTTP/2 for gRPC; HTTP/1.1 for browsers' gRPC-Web and the console.
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    config.ticketer = Arc::clone(ticketer);
    config.session_storage = sessions.clone();
    Ok(ServerTlsSnapshot {
        config: Arc::new(config),
        peer_ca: peer_ca.as_ref().map(verifier_of).transpose()?,
        service_identities: files.service_identities.clone().into(),
        certificates,
        fingerprint: reading.fingerprint(),
    })
}

/// A certificate chain and its key, read and checked: valid at `now`, and
/// the key the certificate's.
pub(crate) fn certified_key(
    reading: &mut Reading,
    cert: &PemFile,
    key: &PemFile,
    now: SystemTime,
) -> Result<(Arc<CertifiedKey>, CertificateFacts), TlsError> {
    let chain = cert.certificates(&reading.read(cert)?)?;
    let private_key = key.private_key(&reading.read(key)?)?;
    let facts = CertificateFacts::of(&chain[0])
        .ok_or_else(|| TlsError::file(cert.flag, &cert.path, "the first certificate is not X.509 that can be read"))?;
    if let Some(reason) = facts.unusable_at(now) {
        return Err(TlsError::file(cert.flag, &cert.path, reason));
    }
    let certified = CertifiedKey::from_der(chain, private_key, &provider()).map_err(|err| match err {
        rustls::Error::InconsistentKeys(_) => TlsError::file(
            key.flag,
            &key.path,
            format!("is not the key of the certificate in {} {}", cert.flag, cert.path.display()),
        ),
        // Past the checks above, what rustls refuses is the certificate's
        // (its encoding or extensions), not the key's.
        rustls::Error::InvalidCertificate(why) => {
            TlsError::file(cert.flag, &cert.path, format!("cannot be used: the certificate is invalid ({why:?})"))
        }
        err => TlsError::file(key.flag, &key.path, format!("cannot be used with {}: {err}", cert.flag)),
    })?;
    Ok((Arc::new(certified), facts))
}

/// Which certificate a client is shown: the peer certificate to another node
/// (it offers [`PEER_ALPN_MARKER`]), the service certificate to everyone else.
#[derive(Debug)]
struct Certificates {
    service: Arc<CertifiedKey>,
    peer: Option<Arc<CertifiedKey>>,
}

impl ResolvesServerCert for Certificates {
    fn resolve(&self, hello: ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        if let Some(peer) = &self.peer
            && hello.alpn().is_some_and(|mut offered| offered.any(|protocol| protocol == PEER_ALPN_MARKER))
        {
            return Some(Arc::clone(peer));
        }
        Some(Arc::clone(&self.service))
    }
}
