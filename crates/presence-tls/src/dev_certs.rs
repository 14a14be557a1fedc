//! Certificates for development (`presenced dev-certs DIR`): a CA for the
//! service port and its clients, the server's certificate, a client's, and a
//! second CA with one peer certificate per cluster node. Each is X.509 v3
//! with the extensions rustls and the gRPC clients ask for (subject
//! alternative names, key usages, basic constraints), which the usual
//! `openssl x509 -req` recipe leaves out.
//!
//! Two CAs, because a node trusts every certificate of the cluster's CA as a
//! node's: a gateway's certificate must not come from it.

use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// The names every development server certificate covers: what a client on
/// the same machine dials.
pub const LOOPBACK_NAMES: [&str; 3] = ["127.0.0.1", "::1", "localhost"];

/// The identity of the development client certificate, which
/// `--tls-service-identity` lists to make its holder a service caller.
pub const CLIENT_IDENTITY: &str = "spiffe://presenced.dev/gateway";

/// The cluster nodes a development directory has peer certificates for.
pub const NODES: [&str; 3] = ["node-a", "node-b", "node-c"];

/// What [`write`] made, by role, each a file in the directory.
#[derive(Debug, Clone)]
pub struct DevCerts {
    /// The CA of the service port and its clients (`--tls-client-ca`, and a client's `--ca`).
    pub ca: PathBuf,
    /// The service port's certificate and key (`--tls-cert`, `--tls-key`).
    pub server: (PathBuf, PathBuf),
    /// A client's certificate and key (`--cert`, `--key`), identity [`CLIENT_IDENTITY`].
    pub client: (PathBuf, PathBuf),
    /// The cluster's CA (`--peer-tls-ca`).
    pub cluster_ca: PathBuf,
    /// Each node's peer certificate and key (`--peer-tls-cert`, `--peer-tls-key`), as [`NODES`].
    pub nodes: Vec<(String, PathBuf, PathBuf)>,
    /// The names the server and peer certificates cover.
    pub names: Vec<String>,
}

/// Why no certificates were written.
#[derive(Debug, thiserror::Error)]
pub enum DevCertsError {
    /// A name given with `--name` is neither an IP address nor a DNS name.
    #[error("--name {name:?} is neither an IP address nor a DNS name ({reason})")]
    Name {
        /// The name as given.
        name: String,
        /// What is wrong with it.
        reason: String,
    },
    /// A file of the set is there already: replacing it would leave what
    /// trusts the old CA unable to verify the new certificates.
    #[error("{0} exists: choose an empty directory, or remove the files of the last run")]
    Exists(PathBuf),
    /// The directory or a file cannot be written.
    #[error("cannot write {path}: {reason}")]
    Write {
        /// The file or directory.
        path: PathBuf,
        /// The system's reason.
        reason: String,
    },
    /// The crypto library refused to make a key or a certificate.
    #[error("cannot make a certificate: {0}")]
    Make(String),
}

/// Writes a development set into `dir` (made if missing): the server and
/// peer certificates cover [`LOOPBACK_NAMES`] and `names`. Refuses, writing
/// nothing, when a name is not an address or a DNS name, or when a file of
/// the set is there already.
pub fn write(dir: &Path, names: &[String]) -> Result<DevCerts, DevCertsError> {
    let mut covered: Vec<String> = LOOPBACK_NAMES.iter().map(|name| name.to_string()).collect();
    for name in names {
        san(name)?;
        if !covered.contains(name) {
            covered.push(name.clone());
        }
    }
    let file = |stem: &str| dir.join(format!("{stem}.pem"));
    let pair = |stem: &str| (file(stem), file(&format!("{stem}-key")));
    let certs = DevCerts {
        ca: file("ca"),
        server: pair("server"),
        client: pair("client"),
        cluster_ca: file("cluster-ca"),
        nodes: NODES
            .iter()
            .map(|node| {
                let (cert, key) = pair(node);
                (node.to_string(), cert, key)
            })
            .collect(),
        names: covered.clone(),
    };
    let mut files = vec![certs.ca.clone(), file("ca-key"), certs.cluster_ca.clone(), file("cluster-ca-key")];
    files.extend([&certs.server, &certs.client].into_iter().flat_map(|(cert, key)| [cert.clone(), key.clone()]));
    files.extend(certs.nodes.iter().flat_map(|(_, cert, key)| [cert.clone(), key.clone()]));
    if let Some(there) = files.iter().find(|path| path.exists()) {
        return Err(DevCertsError::Exists(there.clone()));
    }
    std::fs::create_dir_all(dir)
        .map_err(|err| DevCertsError::Write { path: dir.to_owned(), reason: err.to_string() })?;

    let (ca, ca_key) = authority("presenced development CA")?;
    let (cluster_ca, cluster_ca_key) = authority("presenced development cluster CA")?;
    save(&certs.ca, &ca.pem())?;
    save_key(&file("ca-key"), &ca_key)?;
    save(&certs.cluster_ca, &cluster_ca.pem())?;
    save_key(&file("cluster-ca-key"), &cluster_ca_key)?;
    let server_usage = [ExtendedKeyUsagePurpose::ServerAuth];
    issue(&ca, "localhost", &covered, &server_usage, &certs.server)?;
    issue(&ca, CLIENT_IDENTITY, &[CLIENT_IDENTITY.to_owned()], &[ExtendedKeyUsagePurpose::ClientAuth], &certs.client)?;
    // A node is both the others' server and their client.
    let peer_usage = [ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
    for (node, cert, key) in &certs.nodes {
        let mut node_names = covered.clone();
        node_names.push(node.clone());
        issue(&cluster_ca, node, &node_names, &peer_usage, &(cert.clone(), key.clone()))?;
    }
    Ok(certs)
}

/// A CA certificate, valid from now for ten years, and its issuer.
fn authority(common_name: &str) -> Result<(CertifiedIssuer<'static, KeyPair>, String), DevCertsError> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(make)?;
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    valid_from_now(&mut params);
    let key = KeyPair::generate().map_err(make)?;
    let key_pem = key.serialize_pem();
    let ca = CertifiedIssuer::self_signed(params, key).map_err(make)?;
    Ok((ca, key_pem))
}

/// A certificate for `names` issued by `ca`, written to the pair of files.
fn issue(
    ca: &CertifiedIssuer<'static, KeyPair>,
    common_name: &str,
    names: &[String],
    usages: &[ExtendedKeyUsagePurpose],
    (cert, key): &(PathBuf, PathBuf),
) -> Result<(), DevCertsError> {
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(make)?;
    params.distinguished_name.push(DnType::CommonName, common_name);
    params.subject_alt_names = names.iter().map(|name| san(name)).collect::<Result<_, _>>()?;
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
    params.extended_key_usages = usages.to_vec();
    valid_from_now(&mut params);
    let key_pair = KeyPair::generate().map_err(make)?;
    let certificate = params.signed_by(&key_pair, ca).map_err(make)?;
    save(cert, &certificate.pem())?;
    save_key(key, &key_pair.serialize_pem())
}

/// A name as a subject alternative name: an IP address, a URI (with a
/// scheme, such as `spiffe://`), or a DNS name.
fn san(name: &str) -> Result<SanType, DevCertsError> {
    let refused = |reason: String| DevCertsError::Name { name: name.to_owned(), reason };
    if let Ok(address) = name.parse::<IpAddr>() {
        return Ok(SanType::IpAddress(address));
    }
    if name.contains("://") {
        return name.try_into().map(SanType::URI).map_err(|err| refused(format!("{err}")));
    }
    let valid = !name.is_empty()
        && name.len() <= 253
        && name.split('.').all(|label| {
            !label.is_empty()
                && label.len() <= 63
                && !label.starts_with('-')
                && !label.ends_with('-')
                && label.chars().all(|c| c.is_ascii_alphanumeric() || c == '-' || c == '*')
        });
    if !valid {
        return Err(refused("a DNS name is dot-separated labels of letters, digits and '-'".into()));
    }
    name.try_into().map(SanType::DnsName).map_err(|err| refused(format!("{err}")))
}

/// Valid from a day ago (clocks differ) for ten years.
fn valid_from_now(params: &mut CertificateParams) {
    let now = time::OffsetDateTime::now_utc();
    params.not_before = now - time::Duration::days(1);
    params.not_after = now + time::Duration::days(3650);
}

fn make(err: rcgen::Error) -> DevCertsError {
    DevCertsError::Make(err.to_string())
}

fn save(path: &Path, contents: &str) -> Result<(), DevCertsError> {
    std::fs::write(path, contents)
        .map_err(|err| DevCertsError::Write { path: path.to_owned(), reason: err.to_string() })
}

/// A private key, readable by its owner only.
fn save_key(path: &Path, contents: &str) -> Result<(), DevCertsError> {
    use std::io::Write as _;
    #[cfg(unix)]
    use std::os::unix::fs::OpenOptionsExt as _;
    let mut options = std::fs::OpenOptions::new();
    options.write(true).create_new(true);
    #[cfg(unix)]
    options.mode(0o600);
    let written = options.open(path).and_then(|mut file| file.write_all(contents.as_bytes()));
    written.map_err(|err| DevCertsError::Write { path: path.to_owned(), reason: err.to_string() })
}
