//! TLS material read from files: what a certificate says of itself, what
//! refuses a start (T1, B7), and what a reload sees (T4).

use std::path::PathBuf;

use presence_tls::testing::{Lifetime, Pki};
use presence_tls::{CertificateFacts, ClientTls, ClientTlsFiles, ServerTls, ServerTlsFiles, TlsError};

fn dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("presence-tls-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn server_files(cert: PathBuf, key: PathBuf) -> ServerTlsFiles {
    ServerTlsFiles { cert, key, client_ca: None, peer: None, service_identities: Vec::new() }
}

#[test]
fn a_certificates_identities_are_its_alternative_names_then_its_common_name() {
    let pki = Pki::new(&dir("identities"), "ca");
    let issued = pki.issue("gateway", &["gateway.internal", "spiffe://example.org/gateway", "10.0.0.7"]);
    let pem = std::fs::read(&issued.cert).unwrap();
    let der = rustls::pki_types::pem::PemObject::from_pem_slice(&pem).unwrap();
    let facts = CertificateFacts::of(&der).unwrap();
    assert_eq!(
        facts.identities,
        ["gateway.internal", "spiffe://example.org/gateway", "10.0.0.7", "gateway.internal"],
        "DNS, URI and IP names in order, then the subject's common name"
    );
}

#[test]
fn t1_a_certificate_out_of_its_validity_or_a_key_not_its_own_is_refused_naming_the_flag_and_file() {
    let pki = Pki::new(&dir("refusals"), "ca");
    let good = pki.issue("good", &["localhost"]);
    let other = pki.issue("other", &["localhost"]);
    let not_yet = pki.issue_for("not-yet", &["localhost"], Lifetime::NotYet);
    let refusal = |cert: &PathBuf, key: &PathBuf| ServerTls::load(server_files(cert.clone(), key.clone())).unwrap_err();

    let mismatched = refusal(&good.cert, &other.key).to_string();
    assert!(
        mismatched.starts_with("--tls-key ") && mismatched.contains("is not the key of the certificate in --tls-cert")
    );
    let early = refusal(&not_yet.cert, &not_yet.key).to_string();
    assert!(early.starts_with("--tls-cert ") && early.contains("not valid yet"), "{early}");
    let missing = refusal(&good.cert.with_extension("missing"), &good.key);
    assert!(matches!(&missing, TlsError::File { flag: "--tls-cert", .. }), "{missing}");
    assert!(ServerTls::load(server_files(good.cert, good.key)).is_ok());
}

#[test]
fn t4_a_reload_reports_a_change_only_when_the_files_changed_and_keeps_the_material_when_they_break() {
    let pki = Pki::new(&dir("reload"), "ca");
    let issued = pki.issue("server", &["localhost"]);
    let tls = ServerTls::load(server_files(issued.cert.clone(), issued.key.clone())).unwrap();
    let first = tls.certificates()[0].1.clone();
    assert!(!tls.reload().unwrap(), "nothing changed");
    pki.issue("server", &["localhost", "rotated.example"]);
    assert!(tls.reload().unwrap(), "a new certificate in the same files");
    let second = tls.certificates()[0].1.clone();
    assert!(second.identities.contains(&"rotated.example".to_owned()) && second != first);
    std::fs::write(&issued.key, "garbage").unwrap();
    assert!(tls.reload().is_err(), "a broken key is refused");
    assert_eq!(tls.certificates()[0].1, second, "and the material in use stays");
}

#[test]
fn a_client_certificate_needs_its_key_and_the_message_names_both_flags() {
    let pki = Pki::new(&dir("client"), "ca");
    let issued = pki.issue("client", &["client"]);
    let files = ClientTlsFiles::new(Some(pki.ca_path()), Some(issued.cert.clone()), None);
    let refused = ClientTls::load(files).unwrap_err().to_string();
    assert_eq!(refused, "--cert needs --key: its private key");
    let etcd = ClientTlsFiles::new(Some(pki.ca_path()), None, Some(issued.key)).named([
        "--etcd-ca",
        "--etcd-cert",
        "--etcd-key",
    ]);
    assert_eq!(ClientTls::load(etcd).unwrap_err().to_string(), "--etcd-key needs --etcd-cert: its certificate");
}
