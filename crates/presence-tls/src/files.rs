//! PEM files: read whole, parsed, and fingerprinted so that a reload can tell
//! whether anything changed.

use std::hash::{DefaultHasher, Hash as _, Hasher as _};
use std::path::{Path, PathBuf};

use rustls::RootCertStore;
use rustls::pki_types::pem::PemObject as _;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};

use crate::TlsError;

/// A PEM file and the flag that named it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct PemFile {
    pub(crate) flag: &'static str,
    pub(crate) path: PathBuf,
}

/// The bytes of one reading of a set of files, and their fingerprint.
#[derive(Debug, Default)]
pub(crate) struct Reading {
    hasher: DefaultHasher,
}

impl Reading {
    /// The bytes of `file`, folded into this reading's fingerprint.
    pub(crate) fn read(&mut self, file: &PemFile) -> Result<Vec<u8>, TlsError> {
        let bytes = std::fs::read(&file.path).map_err(|err| TlsError::file(file.flag, &file.path, err.to_string()))?;
        file.path.hash(&mut self.hasher);
        bytes.hash(&mut self.hasher);
        Ok(bytes)
    }

    /// What the files read so far held: equal fingerprints, equal contents
    /// (a hash of a few kilobytes, compared once a poll, so a collision
    /// would only delay a reload to the next change).
    pub(crate) fn fingerprint(&self) -> u64 {
        self.hasher.finish()
    }
}

impl PemFile {
    pub(crate) fn new(flag: &'static str, path: &Path) -> PemFile {
        PemFile { flag, path: path.to_owned() }
    }

    /// Every certificate in `bytes`, in order (a chain: the end entity first).
    pub(crate) fn certificates(&self, bytes: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
        let certificates = CertificateDer::pem_slice_iter(bytes)
            .collect::<Result<Vec<_>, _>>()
            .map_err(|err| TlsError::file(self.flag, &self.path, format!("not PEM certificates: {err}")))?;
        if certificates.is_empty() {
            return Err(TlsError::file(self.flag, &self.path, "holds no certificate (no BEGIN CERTIFICATE block)"));
        }
        Ok(certificates)
    }

    /// The one private key in `bytes` (PKCS#8, PKCS#1 or SEC1).
    pub(crate) fn private_key(&self, bytes: &[u8]) -> Result<PrivateKeyDer<'static>, TlsError> {
        PrivateKeyDer::from_pem_slice(bytes).map_err(|err| {
            let reason = match err {
                rustls::pki_types::pem::Error::NoItemsFound => {
                    "holds no private key (no BEGIN PRIVATE KEY block)".into()
                }
                err => format!("not a PEM private key: {err}"),
            };
            TlsError::file(self.flag, &self.path, reason)
        })
    }

    /// The CA certificates in `bytes`, as trust anchors.
    pub(crate) fn roots(&self, bytes: &[u8]) -> Result<RootCertStore, TlsError> {
        let mut roots = RootCertStore::empty();
        for certificate in self.certificates(bytes)? {
            roots
                .add(certificate)
                .map_err(|err| TlsError::file(self.flag, &self.path, format!("not a usable CA certificate: {err}")))?;
        }
        Ok(roots)
    }
}
