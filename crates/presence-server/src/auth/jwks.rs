//! Viewer keys that rotate (T4): the identity provider's JWKS document, read
//! from a file or fetched from an `https://` URL.
//!
//! The document is read again on a schedule (a file every credentials poll,
//! a URL every `--viewer-jwks-refresh-ms`), on SIGHUP, and when a token names
//! a `kid` the keys in use do not have: at most one fetch at a time, and
//! none for [`UNKNOWN_KID_REFETCH_AFTER`] after one that did not find its
//! `kid`, so that a flood of tokens with made-up `kid`s costs the provider
//! one request every ten seconds. A
//! fetch is tried [`FETCH_ATTEMPTS`] times, backing off; one that still
//! fails keeps the keys in use. Several keys are in the document during a
//! rotation; each verifies the tokens whose `kid` names it, with the one
//! algorithm its type fixes (RSA: RS256, or its `alg`; EC P-256/P-384:
//! ES256/ES384; OKP Ed25519: EdDSA). Symmetric (`oct`) keys and keys not for
//! signatures (`use: enc`) are skipped.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, Jwk, JwkSet, KeyAlgorithm, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// Tries of one fetch of a JWKS URL before it counts as failed.
pub(crate) const FETCH_ATTEMPTS: u32 = 3;
/// The wait before the second try; doubled for each next one.
const FIRST_BACKOFF: Duration = Duration::from_millis(200);
/// How long one try may take, connection included.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// A token with an unknown `kid` fetches the document again at most this often.
pub(crate) const UNKNOWN_KID_REFETCH_AFTER: Duration = Duration::from_secs(10);
/// The largest document read: a provider's holds a few keys of a few hundred bytes.
const MAX_DOCUMENT_BYTES: usize = 1024 * 1024;

/// Where the JWKS document is.
#[derive(Debug, Clone)]
pub(crate) enum JwksSource {
    File(PathBuf),
    Url { url: http::Uri, tls: Arc<rustls::ClientConfig> },
}

/// One key of the document.
#[derive(Debug, Clone)]
pub(crate) struct JwksKey {
    /// Its `kid`; a key without one verifies tokens without one.
    pub(crate) kid: Option<String>,
    pub(crate) algorithm: Algorithm,
    pub(crate) key: DecodingKey,
}

/// The usable keys of one reading of the document, and the reading itself
/// (to tell whether anything changed).
#[derive(Debug, Clone, Default)]
pub(crate) struct JwksKeys {
    pub(crate) keys: Vec<JwksKey>,
    pub(crate) document: Bytes,
}

impl JwksKeys {
    /// Whether a key of the document has `kid`.
    pub(crate) fn has(&self, kid: &str) -> bool {
        self.keys.iter().any(|key| key.kid.as_deref() == Some(kid))
    }

    /// The `kid`s, for the log.
    pub(crate) fn kids(&self) -> Vec<String> {
        self.keys.iter().map(|key| key.kid.clone().unwrap_or_default()).collect()
    }
}

/// Parses a JWKS document: its usable signature keys, or why there is none.
pub(crate) fn parse(document: Bytes) -> Result<JwksKeys, String> {
    let set: JwkSet = serde_json::from_slice(&document).map_err(|err| format!("not a JWKS document: {err}"))?;
    let mut keys = Vec::with_capacity(set.keys.len());
    let mut skipped = Vec::new();
    for (index, jwk) in set.keys.iter().enumerate() {
        let kid = jwk.common.key_id.clone();
        let named = || format!("key #{} ({})", index + 1, kid.as_deref().unwrap_or("no kid"));
        match usable(jwk) {
            Ok((algorithm, key)) => keys.push(JwksKey { kid: kid.clone(), algorithm, key }),
            Err(reason) => skipped.push(format!("{}: {reason}", named())),
        }
    }
    if !skipped.is_empty() {
        tracing::warn!(skipped = ?skipped, "JWKS keys skipped");
    }
    if keys.is_empty() {
        return Err(format!("no usable signature key (of {} keys)", set.keys.len()));
    }
    Ok(JwksKeys { keys, document })
}

/// The algorithm and key of one JWK, or why it cannot verify viewer tokens.
fn usable(jwk: &Jwk) -> Result<(Algorithm, DecodingKey), String> {
    if matches!(jwk.common.public_key_use, Some(ref used) if *used != PublicKeyUse::Signature) {
        return Err("not a signature key (use)".into());
    }
    let named = jwk.common.key_algorithm;
    let algorithm = match (&jwk.algorithm, named) {
        (AlgorithmParameters::RSA(_), None | Some(KeyAlgorithm::RS256)) => Algorithm::RS256,
        (AlgorithmParameters::RSA(_), Some(KeyAlgorithm::RS384)) => Algorithm::RS384,
        (AlgorithmParameters::RSA(_), Some(KeyAlgorithm::RS512)) => Algorithm::RS512,
        (AlgorithmParameters::RSA(_), Some(KeyAlgorithm::PS256)) => Algorithm::PS256,
        (AlgorithmParameters::EllipticCurve(ec), None | Some(KeyAlgorithm::ES256))
            if ec.curve == EllipticCurve::P256 =>
        {
            Algorithm::ES256
        }
        (AlgorithmParameters::EllipticCurve(ec), None | Some(KeyAlgorithm::ES384))
            if ec.curve == EllipticCurve::P384 =>
        {
            Algorithm::ES384
        }
        (AlgorithmParameters::OctetKeyPair(okp), None | Some(KeyAlgorithm::EdDSA))
            if okp.curve == EllipticCurve::Ed25519 =>
        {
            Algorithm::EdDSA
        }
        (AlgorithmParameters::OctetKey(_), _) => {
            return Err("a symmetric (oct) key: viewer keys are public keys".into());
        }
        (_, named) => return Err(format!("unsupported key type or algorithm {named:?}")),
    };
    let key = DecodingKey::from_jwk(jwk).map_err(|err| format!("unreadable key: {err}"))?;
    if algorithm == Algorithm::EdDSA && key.try_get_as_bytes().map(<[u8]>::len) != Ok(32) {
        return Err("an Ed25519 key must be 32 bytes".into());
    }
    Ok((algorithm, key))
}

impl JwksSource {
    /// Reads the document: the file, or the URL with retries.
    pub(crate) async fn read(&self) -> Result<Bytes, String> {
        match self {
            JwksSource::File(path) => {
                let path = path.clone();
                let read = tokio::task::spawn_blocking(move || std::fs::read(&path)).await;
                match read {
                    Ok(Ok(bytes)) => Ok(bytes.into()),
                    Ok(Err(err)) => Err(format!("cannot read: {err}")),
                    Err(err) => Err(format!("the read failed: {err}")),
                }
            }
            JwksSource::Url { url, tls } => {
                let mut backoff = FIRST_BACKOFF;
                let mut attempt = 1;
                loop {
                    let fetched = tokio::time::timeout(FETCH_TIMEOUT, fetch(url, tls)).await;
                    let failure = match fetched {
                        Ok(Ok(bytes)) => return Ok(bytes),
                        Ok(Err(err)) => err,
                        Err(_) => format!("no answer within {FETCH_TIMEOUT:?}"),
                    };
                    if attempt == FETCH_ATTEMPTS {
                        return Err(format!("{failure} (after {FETCH_ATTEMPTS} tries)"));
                    }
                    tracing::debug!(%url, attempt, %failure, "JWKS fetch failed; trying again");
                    tokio::time::sleep(backoff).await;
                    backoff *= 2;
                    attempt += 1;
                }
            }
        }
    }

    /// The file or URL, for messages.
    pub(crate) fn describe(&self) -> String {
        match self {
            JwksSource::File(path) => path.display().to_string(),
            JwksSource::Url { url, .. } => url.to_string(),
        }
    }

    /// Whether the document is re-read on every credentials poll (a file is cheap to read).
    pub(crate) fn is_file(&self) -> bool {
        matches!(self, JwksSource::File(_))
    }
}

/// One GET of an `https://` URL over HTTP/1.1: the body of a 200.
async fn fetch(url: &http::Uri, tls: &Arc<rustls::ClientConfig>) -> Result<Bytes, String> {
    let mut sender = crate::outbound::connect(url, Some(tls)).await?;
    let path = url.path_and_query().map_or("/", |path| path.as_str());
    let request = http::Request::get(path)
        .header(http::header::HOST, crate::outbound::host_header(url))
        .header(http::header::ACCEPT, "application/json")
        .header(http::header::USER_AGENT, crate::outbound::USER_AGENT)
        .body(Empty::<Bytes>::new())
        .map_err(|err| format!("HTTP: {err}"))?;
    let response = sender.send_request(request).await.map_err(|err| format!("HTTP: {err}"))?;
    let status = response.status();
    if status != http::StatusCode::OK {
        return Err(format!("HTTP status {status}"));
    }
    let body = Limited::new(response.into_body(), MAX_DOCUMENT_BYTES).collect().await;
    body.map(http_body_util::Collected::to_bytes).map_err(|err| format!("reading the document: {err}"))
}

/// The state of fetches made for unknown `kid`s.
#[derive(Debug, Default)]
pub(crate) struct UnknownKidFetches {
    /// When the last one that did not find its `kid` ended.
    pub(crate) last_miss: Option<Instant>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_document_yields_its_signature_keys_with_their_algorithms() {
        let document = serde_json::json!({ "keys": [
            { "kty": "OKP", "crv": "Ed25519", "x": "8FQKZALniC2GAy1YF4CrboyTwzELANIPWC4S_mvLluA", "kid": "ed", "use": "sig" },
            { "kty": "RSA", "kid": "rsa", "alg": "RS256",
              "n": "mBN3Af-eAj3HklotLpzmYVxvmltGIaGnaDQ2YAMkovFDgPt88lG6uNN2m1-CxRTxfVwxOyt1vr0AjKs_4xwuKCted6I57m6ZpBz9uBSvh-haY8Djq1GDLT4idhrW40GD3cAEVhD0S71wrj3Kp6QbVc0Pugno3pD8pcX2J9GW6T0GDMaZ-nr_dJ-oRHfC9vuovg1iGBXSb1KWVBRbBGafcpTz4jJuSAVLGhOiAFpzPDMyEi-NyTrNzvn4DZdEeC9DUIxaFa9xGXeZ7rTyHCbj0hW97F9M64whGlF6mwuxACgS0b9cUifHJa11LMZxLzok2NRO-0zrpV-9G_mV6PPyCw",
              "e": "AQAB" },
            { "kty": "oct", "k": "c2VjcmV0", "kid": "secret" },
            { "kty": "OKP", "crv": "Ed25519", "x": "8FQKZALniC2GAy1YF4CrboyTwzELANIPWC4S_mvLluA", "kid": "enc", "use": "enc" }
        ]});
        let keys = parse(document.to_string().into()).unwrap();
        let found: Vec<(Option<&str>, Algorithm)> =
            keys.keys.iter().map(|key| (key.kid.as_deref(), key.algorithm)).collect();
        assert_eq!(found, [(Some("ed"), Algorithm::EdDSA), (Some("rsa"), Algorithm::RS256)]);
        assert!(keys.has("ed") && !keys.has("secret"));
    }

    #[test]
    fn a_document_without_a_usable_key_is_refused() {
        assert!(parse(Bytes::from_static(b"{\"keys\": []}")).unwrap_err().contains("no usable signature key"));
        assert!(parse(Bytes::from_static(b"not json")).unwrap_err().starts_with("not a JWKS document"));
        let short = serde_json::json!({ "keys": [{ "kty": "OKP", "crv": "Ed25519", "x": "AAAA", "kid": "short" }] });
        assert!(parse(short.to_string().into()).is_err());
    }
}
