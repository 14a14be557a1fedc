//! What a certificate says of itself: its identities and its validity.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rustls::pki_types::CertificateDer;
use x509_parser::extensions::GeneralName;
use x509_parser::prelude::{FromDer as _, X509Certificate};

/// The parts of a certificate presenced acts on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CertificateFacts {
    /// Its identities, in the order a person reads them: the subject
    /// alternative names (DNS names, URIs such as SPIFFE ids, e-mail
    /// addresses, IP addresses), then the subject's common name. A
    /// `--tls-service-identity` matches any one of them exactly.
    pub identities: Vec<String>,
    /// The names a client can dial it by (its DNS and IP subject
    /// alternative names): what a TLS client checks the address against.
    pub dialable_names: Vec<String>,
    /// Its X.509 version: 1, 2 or 3. TLS clients accept only 3.
    pub version: u32,
    /// When it becomes valid.
    pub not_before: SystemTime,
    /// When it stops being valid.
    pub not_after: SystemTime,
}

/// Where a certificate stands at a moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Validity {
    /// Valid, for this much longer.
    Valid(Duration),
    /// Not valid yet, for this much longer.
    NotYet(Duration),
    /// Expired this long ago.
    Expired(Duration),
}

impl CertificateFacts {
    /// Reads `certificate`; `None` if it is not X.509 that can be parsed
    /// (rustls refuses such a certificate on its own).
    pub fn of(certificate: &CertificateDer<'_>) -> Option<CertificateFacts> {
        let (_, parsed) = X509Certificate::from_der(certificate.as_ref()).ok()?;
        let (mut identities, mut dialable_names) = (Vec::new(), Vec::new());
        if let Ok(Some(names)) = parsed.subject_alternative_name() {
            for name in &names.value.general_names {
                match name {
                    GeneralName::DNSName(name) => {
                        identities.push((*name).to_owned());
                        dialable_names.push((*name).to_owned());
                    }
                    GeneralName::URI(name) | GeneralName::RFC822Name(name) => identities.push((*name).to_owned()),
                    GeneralName::IPAddress(bytes) => {
                        if let Some(address) = ip_address(bytes) {
                            identities.push(address.to_string());
                            dialable_names.push(address.to_string());
                        }
                    }
                    _ => {}
                }
            }
        }
        for common_name in parsed.subject().iter_common_name() {
            if let Ok(name) = common_name.as_str() {
                identities.push(name.to_owned());
            }
        }
        let time = |seconds: i64| UNIX_EPOCH + Duration::from_secs(u64::try_from(seconds).unwrap_or(0));
        Some(CertificateFacts {
            identities,
            dialable_names,
            version: parsed.version().0 + 1,
            not_before: time(parsed.validity().not_before.timestamp()),
            not_after: time(parsed.validity().not_after.timestamp()),
        })
    }

    /// Where it stands at `now`.
    pub fn validity(&self, now: SystemTime) -> Validity {
        if now < self.not_before {
            Validity::NotYet(self.not_before.duration_since(now).unwrap_or_default())
        } else if now > self.not_after {
            Validity::Expired(now.duration_since(self.not_after).unwrap_or_default())
        } else {
            Validity::Valid(self.not_after.duration_since(now).unwrap_or_default())
        }
    }

    /// Why it cannot be served at `now`, if it cannot.
    pub(crate) fn unusable_at(&self, now: SystemTime) -> Option<String> {
        if self.version < 3 {
            return Some(format!(
                "is an X.509 v{} certificate, which TLS clients refuse: they need v3, with a subjectAltName \
                 naming the address they dial (`openssl x509 -req` makes v1 unless given -extfile; \
                 `presenced dev-certs DIR` makes a v3 set; see docs/security.md)",
                self.version
            ));
        }
        match self.validity(now) {
            Validity::Valid(_) => None,
            Validity::NotYet(left) => Some(format!(
                "the certificate is not valid yet: valid from {} ({} s from now)",
                seconds_since_epoch(self.not_before),
                left.as_secs()
            )),
            Validity::Expired(ago) => Some(format!(
                "the certificate has expired: valid until {} ({} s ago)",
                seconds_since_epoch(self.not_after),
                ago.as_secs()
            )),
        }
    }
}

/// A moment as an RFC 3339 UTC time, for messages.
fn seconds_since_epoch(at: SystemTime) -> String {
    let seconds = at.duration_since(UNIX_EPOCH).map_or(0, |since| since.as_secs());
    match x509_parser::time::ASN1Time::from_timestamp(i64::try_from(seconds).unwrap_or(i64::MAX)) {
        Ok(time) => time.to_datetime().to_string(),
        Err(_) => format!("{seconds} s after 1970"),
    }
}

fn ip_address(bytes: &[u8]) -> Option<std::net::IpAddr> {
    match bytes.len() {
        4 => Some(std::net::IpAddr::from(<[u8; 4]>::try_from(bytes).ok()?)),
        16 => Some(std::net::IpAddr::from(<[u8; 16]>::try_from(bytes).ok()?)),
        _ => None,
    }
}
