//! Certificates made on the spot, for tests: a CA and the certificates it
//! issues, written as PEM files into a directory the test owns.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose, SanType,
};

/// A certificate authority whose files live in `dir`.
pub struct Pki {
    dir: PathBuf,
    name: String,
    ca: CertifiedIssuer<'static, KeyPair>,
}

impl std::fmt::Debug for Pki {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pki").field("dir", &self.dir).field("name", &self.name).finish_non_exhaustive()
    }
}

/// A certificate and key written to files.
#[derive(Debug, Clone)]
pub struct Issued {
    /// The certificate chain (the certificate alone: its CA is the root).
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
}

/// When an issued certificate is valid.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lifetime {
    /// From 1975 to 4096.
    Long,
    /// Expired at the start of 2021.
    Expired,
    /// Valid only from 4000 on.
    NotYet,
}

impl Pki {
    /// A new CA named `name`, its certificate written to `dir/{name}-ca.pem`.
    pub fn new(dir: &Path, name: &str) -> Pki {
        std::fs::create_dir_all(dir).expect("create the certificate directory");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
        params.distinguished_name.push(DnType::CommonName, format!("{name} test CA"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages =
            vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
        let ca =
            CertifiedIssuer::self_signed(params, KeyPair::generate().expect("a CA key")).expect("a CA certificate");
        let pki = Pki { dir: dir.to_owned(), name: name.to_owned(), ca };
        std::fs::write(pki.ca_path(), pki.ca.pem()).expect("write the CA certificate");
        pki
    }

    /// The CA's certificate file.
    pub fn ca_path(&self) -> PathBuf {
        self.dir.join(format!("{}-ca.pem", self.name))
    }

    /// A certificate for `names` (DNS names, IP addresses, or URIs with a
    /// scheme such as `spiffe://`), its first name also the subject's common
    /// name, usable by servers and clients, valid for a long time; written
    /// to `dir/{stem}.pem` and `dir/{stem}-key.pem`.
    pub fn issue(&self, stem: &str, names: &[&str]) -> Issued {
        self.issue_for(stem, names, Lifetime::Long)
    }

    /// [`issue`](Pki::issue) with a chosen lifetime.
    pub fn issue_for(&self, stem: &str, names: &[&str], lifetime: Lifetime) -> Issued {
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("parameters");
        for name in names {
            let san = if name.contains("://") {
                SanType::URI((*name).try_into().expect("a URI"))
            } else if let Ok(address) = name.parse::<std::net::IpAddr>() {
                SanType::IpAddress(address)
            } else {
                SanType::DnsName((*name).try_into().expect("a DNS name"))
            };
            params.subject_alt_names.push(san);
        }
        if let Some(first) = names.first() {
            params.distinguished_name.push(DnType::CommonName, *first);
        }
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        match lifetime {
            Lifetime::Long => {}
            Lifetime::Expired => {
                params.not_before = rcgen::date_time_ymd(2019, 1, 1);
                params.not_after = rcgen::date_time_ymd(2021, 1, 1);
            }
            Lifetime::NotYet => params.not_before = rcgen::date_time_ymd(4000, 1, 1),
        }
        let key = KeyPair::generate().expect("a key");
        let certificate = params.signed_by(&key, &self.ca).expect("a certificate");
        let issued =
            Issued { cert: self.dir.join(format!("{stem}.pem")), key: self.dir.join(format!("{stem}-key.pem")) };
        write_replacing(&issued.cert, &certificate.pem());
        write_replacing(&issued.key, &key.serialize_pem());
        issued
    }
}

/// Writes `contents` to `path` as a rotation tool does: to a file beside it,
/// then renamed over it, so that no reader sees half a file.
pub fn write_replacing(path: &Path, contents: &str) {
    let partial = path.with_extension("partial");
    std::fs::write(&partial, contents).expect("write a certificate file");
    std::fs::rename(&partial, path).expect("move a certificate file into place");
}
