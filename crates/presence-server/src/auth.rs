//! Caller authentication: who is calling, and which of the two roles it holds (P1).
//!
//! This module owns the check of the `authorization: Bearer <token>` metadata
//! and the role rules built on its answer. It reads request metadata only, never
//! a request field, so a viewer's identity always comes from its credentials
//! (a `viewer_id` field counts only for a service caller). It must not decide
//! what a viewer may see (the audience rules, P2 and P3, do that with the
//! identity found here), nor whether the server may run open on a given
//! address (the binary decides that).
//!
//! | credential | caller |
//! |---|---|
//! | none configured at all | every request is [`Caller::Service`] (open, for development) |
//! | a configured service token | [`Caller::Service`] |
//! | a JWT verified with the configured HS256 secret or RSA/Ed25519 public key | [`Caller::Viewer`] of its `sub` |
//! | no token, on a connection whose client certificate has a `--tls-service-identity` (T2) | [`Caller::Service`] |
//! | no token, on a connection with a certificate of the cluster's CA (another node, T2) | [`Caller::Service`] |
//! | anything else, or no credential | `UNAUTHENTICATED` |
//!
//! A token, when one is sent, decides alone: a viewer's JWT on a connection
//! with a service identity's certificate acts as that viewer, and a wrong
//! token is refused whatever the certificate. A node relays the token of
//! the caller whose call it forwards; a call it forwards without one came
//! from a caller it found to be a service by its certificate.
//!
//! Each configured key accepts exactly one algorithm (HS256, RS256 or EdDSA),
//! fixed by the key's type when the server starts: a token's `alg` header only
//! picks among the configured keys, so a token cannot choose how it is checked
//! (no `none`, no HMAC keyed with a public key).

use std::fmt;

use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use presence_core::MAX_ID_BYTES;
use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};
use tonic::metadata::MetadataMap;

use crate::error::ServiceError;

/// Longest bearer token accepted, in bytes: far above any real JWT, small enough
/// that a hostile header cannot make the server parse much.
const MAX_TOKEN_BYTES: usize = 8 * 1024;

/// Shortest HS256 secret: RFC 7518 section 3.2 requires a key at least as long
/// as the hash output (256 bits).
const MIN_HS256_SECRET_BYTES: usize = 32;

/// Most clock skew that may be allowed on `exp`; more would make expiry meaningless.
pub(crate) const MAX_JWT_LEEWAY_SECS: u64 = 300;

/// What the connection a request came on says of its caller, put in every
/// request's extensions by the connection layer (`api/connections.rs`).
#[derive(Debug, Clone, Default)]
pub(crate) struct ConnectionInfo {
    /// The certificate the client presented in its TLS handshake.
    pub(crate) certificate: Option<std::sync::Arc<presence_tls::ClientCertificate>>,
}

impl ConnectionInfo {
    /// What the connection of `request` says.
    pub(crate) fn of<T>(request: &tonic::Request<T>) -> Option<&ConnectionInfo> {
        request.extensions().get::<ConnectionInfo>()
    }

    /// Whether the connection of `request` presented a certificate of the
    /// cluster's CA: its caller is another node.
    pub(crate) fn is_cluster_node<T>(request: &tonic::Request<T>) -> bool {
        ConnectionInfo::of(request).and_then(|info| info.certificate.as_ref()).is_some_and(|cert| cert.cluster_node)
    }
}

/// Who is calling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Caller {
    /// A gateway or admin tool (or anyone, when the server runs open).
    Service,
    /// An end user, identified by the verified `sub` of its token.
    Viewer(String),
}

impl Caller {
    /// The identity whose view of presence applies: for a viewer, itself (any
    /// `viewer_id` field it sent is ignored); for a service caller, the
    /// `viewer_id` it names, or `None` (sees everything) when it names none
    /// (an empty string is none).
    pub(crate) fn acting_viewer(&self, viewer_id_field: &str) -> Option<String> {
        match self {
            Caller::Viewer(viewer_id) => Some(viewer_id.clone()),
            Caller::Service if viewer_id_field.is_empty() => None,
            Caller::Service => Some(viewer_id_field.to_owned()),
        }
    }

    /// `PERMISSION_DENIED` unless the caller is a service (lease operations,
    /// audience and group management, Touch, the settings of others...). The
    /// message names the operation.
    pub(crate) fn require_service(&self, operation: &'static str) -> Result<(), ServiceError> {
        match self {
            Caller::Service => Ok(()),
            Caller::Viewer(_) => {
                Err(ServiceError::PermissionDenied { operation, reason: "requires service credentials" })
            }
        }
    }

    /// Ok for a service, or for a viewer acting on itself (its own status or
    /// visibility); `PERMISSION_DENIED` otherwise.
    pub(crate) fn require_self_or_service(&self, user_id: &str, operation: &'static str) -> Result<(), ServiceError> {
        match self {
            Caller::Service => Ok(()),
            Caller::Viewer(viewer_id) if viewer_id == user_id => Ok(()),
            Caller::Viewer(_) => {
                Err(ServiceError::PermissionDenied { operation, reason: "a viewer may act only on its own user id" })
            }
        }
    }
}

/// The credentials the server accepts. None at all runs the server open.
#[derive(Clone, Default)]
pub struct AuthConfig {
    /// Static service tokens; several at once so that a token can be rotated
    /// without downtime (list old and new, move the callers, drop the old).
    pub service_tokens: Vec<String>,
    /// Secret that verifies HS256 viewer tokens.
    pub viewer_jwt_hs256_secret: Option<String>,
    /// PEM text of the public key that verifies viewer tokens: an RSA key
    /// (RS256) or an Ed25519 key (EdDSA), told apart by its contents.
    pub viewer_jwt_public_key_pem: Option<Vec<u8>>,
    /// Clock skew allowed on `exp`, in seconds (at most 300).
    pub jwt_leeway_secs: u64,
}

// By hand, so that a logged configuration never shows a secret.
impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("service_tokens", &format_args!("[{} redacted]", self.service_tokens.len()))
            .field("viewer_jwt_hs256_secret", &self.viewer_jwt_hs256_secret.as_ref().map(|_| "redacted"))
            .field("viewer_jwt_public_key_pem", &self.viewer_jwt_public_key_pem.as_ref().map(Vec::len))
            .field("jwt_leeway_secs", &self.jwt_leeway_secs)
            .finish()
    }
}

/// Why the credentials configuration cannot be used. Messages are one line and
/// never contain a secret.
#[derive(Debug, thiserror::Error)]
pub enum AuthConfigError {
    /// A service token is empty, too long, or not printable ASCII (it could
    /// never be sent as metadata).
    #[error("service token #{position}: {reason}")]
    ServiceToken {
        /// Where the token is in the configured list, from 1.
        position: usize,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// The HS256 secret is empty or too short.
    #[error("viewer JWT HS256 secret: {bytes} bytes, shorter than the minimum of {MIN_HS256_SECRET_BYTES}")]
    Hs256SecretTooShort {
        /// The secret's length.
        bytes: usize,
    },
    /// The public key is not one PEM-encoded RSA or Ed25519 public key.
    #[error("viewer JWT public key: {reason}")]
    PublicKey {
        /// What is wrong with it.
        reason: String,
    },
    /// The allowed clock skew is larger than 300 seconds.
    #[error("JWT leeway: {secs} s, more than the limit of {MAX_JWT_LEEWAY_SECS} s")]
    Leeway {
        /// The configured leeway.
        secs: u64,
    },
    /// The build has no (or two) JWT crypto backends, so no token could be checked.
    #[error("viewer JWT keys are configured but this build has no JWT crypto provider")]
    NoCryptoProvider,
}

/// Checks credentials and names the caller.
pub(crate) struct Authenticator {
    /// SHA-256 digests of the service tokens. Comparing fixed-size digests in
    /// constant time, against every one, reveals neither which token matched
    /// nor how long the tokens are.
    service_digests: Vec<[u8; 32]>,
    /// The viewer token keys, at most one per algorithm.
    viewer_keys: Vec<ViewerKey>,
}

/// One viewer token key and the only algorithm it accepts.
struct ViewerKey {
    /// The algorithm fixed by the key's type.
    algorithm: Algorithm,
    /// The secret or public key.
    key: DecodingKey,
    /// Accepts `algorithm` alone, and requires and enforces `exp` and `sub`.
    validation: Validation,
}

// By hand, so that a logged authenticator never shows a secret.
impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator")
            .field("service_tokens", &self.service_digests.len())
            .field("viewer_algorithms", &self.viewer_keys.iter().map(|key| key.algorithm).collect::<Vec<_>>())
            .finish()
    }
}

impl Authenticator {
    /// Checks the configuration and prepares the keys.
    pub(crate) fn new(config: AuthConfig) -> Result<Self, AuthConfigError> {
        if config.jwt_leeway_secs > MAX_JWT_LEEWAY_SECS {
            return Err(AuthConfigError::Leeway { secs: config.jwt_leeway_secs });
        }
        let mut service_digests = Vec::with_capacity(config.service_tokens.len());
        for (index, token) in config.service_tokens.iter().enumerate() {
            let reason = if token.is_empty() {
                Some("is empty")
            } else if token.len() > MAX_TOKEN_BYTES {
                Some("is longer than 8192 bytes")
            } else if !token.bytes().all(|byte| byte.is_ascii_graphic()) {
                Some("must be printable ASCII without spaces")
            } else {
                None
            };
            if let Some(reason) = reason {
                return Err(AuthConfigError::ServiceToken { position: index + 1, reason });
            }
            service_digests.push(digest(token));
        }

        let mut viewer_keys = Vec::new();
        if let Some(secret) = &config.viewer_jwt_hs256_secret {
            if secret.len() < MIN_HS256_SECRET_BYTES {
                return Err(AuthConfigError::Hs256SecretTooShort { bytes: secret.len() });
            }
            let key = DecodingKey::from_secret(secret.as_bytes())
                .map_err(|_| AuthConfigError::Hs256SecretTooShort { bytes: secret.len() })?;
            viewer_keys.push(ViewerKey::new(Algorithm::HS256, key, config.jwt_leeway_secs));
        }
        if let Some(pem) = &config.viewer_jwt_public_key_pem {
            let (algorithm, key) = public_key(pem)?;
            viewer_keys.push(ViewerKey::new(algorithm, key, config.jwt_leeway_secs));
        }
        // Without exactly one backend, jsonwebtoken panics on the first token:
        // fail at start instead.
        if !viewer_keys.is_empty() && jsonwebtoken::crypto::CryptoProvider::try_get_default().is_none() {
            return Err(AuthConfigError::NoCryptoProvider);
        }
        Ok(Authenticator { service_digests, viewer_keys })
    }

    /// No credentials configured: every caller is [`Caller::Service`].
    pub(crate) fn is_open(&self) -> bool {
        self.service_digests.is_empty() && self.viewer_keys.is_empty()
    }

    /// Names the caller from its `authorization: Bearer <token>` metadata: a
    /// configured service token is [`Caller::Service`]; any other token must be
    /// a JWT verified with a configured key, with an unexpired `exp` and a
    /// `sub` of 1 to 128 bytes, and is [`Caller::Viewer`] of that `sub`.
    /// Anything else is `UNAUTHENTICATED`, with a message that does not tell
    /// which tokens exist. An open server answers [`Caller::Service`] whatever
    /// was sent.
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn caller(&self, metadata: &MetadataMap) -> Result<Caller, ServiceError> {
        self.caller_on(metadata, None)
    }

    /// The caller of `request`, from its token or, without one, from the
    /// certificate its connection presented (see the module's table).
    pub(crate) fn caller_of<T>(&self, request: &tonic::Request<T>) -> Result<Caller, ServiceError> {
        let certificate = ConnectionInfo::of(request).and_then(|info| info.certificate.as_deref());
        self.caller_on(request.metadata(), certificate)
    }

    fn caller_on(
        &self,
        metadata: &MetadataMap,
        certificate: Option<&presence_tls::ClientCertificate>,
    ) -> Result<Caller, ServiceError> {
        if self.is_open() {
            return Ok(Caller::Service);
        }
        let service_certificate =
            certificate.is_some_and(|certificate| certificate.service || certificate.cluster_node);
        if service_certificate && metadata.get("authorization").is_none() {
            return Ok(Caller::Service);
        }
        let token = bearer_token(metadata)?;
        // A service token is never tried as a JWT.
        if self.is_service_token(token) {
            return Ok(Caller::Service);
        }
        self.viewer(token).map(Caller::Viewer)
    }

    /// Whether `token` is one of the service tokens, in time that depends on
    /// neither which one nor how many bytes of it match.
    fn is_service_token(&self, token: &str) -> bool {
        let presented = digest(token);
        let mut matched = Choice::from(0);
        for configured in &self.service_digests {
            matched |= configured[..].ct_eq(&presented[..]);
        }
        bool::from(matched)
    }

    /// The verified `sub` of a viewer token.
    fn viewer(&self, token: &str) -> Result<String, ServiceError> {
        // The header's `alg` only selects among the configured keys; each key
        // then accepts its own algorithm alone.
        let Ok(header) = jsonwebtoken::decode_header(token) else {
            return Err(refused("not a service token or a JWT"));
        };
        let Some(key) = self.viewer_keys.iter().find(|key| key.algorithm == header.alg) else {
            return Err(refused("no viewer key for the token's algorithm"));
        };
        let claims = match jsonwebtoken::decode::<ViewerClaims>(token, &key.key, &key.validation) {
            Ok(data) => data.claims,
            Err(err) => {
                return Err(match err.kind() {
                    ErrorKind::ExpiredSignature => {
                        tracing::debug!("refused credentials: expired viewer token");
                        ServiceError::Unauthenticated("credentials expired".into())
                    }
                    // The configured key itself cannot be used: the operator must hear of it.
                    ErrorKind::InvalidRsaKey(_) | ErrorKind::InvalidEcdsaKey | ErrorKind::InvalidKeyFormat => {
                        tracing::warn!(algorithm = ?key.algorithm, %err, "the viewer JWT key cannot verify tokens");
                        invalid_credentials()
                    }
                    _ => refused_with(&err),
                });
            }
        };
        if claims.sub.is_empty() || claims.sub.len() > MAX_ID_BYTES {
            return Err(refused("viewer token sub is not 1 to 128 bytes"));
        }
        Ok(claims.sub)
    }
}

impl ViewerKey {
    fn new(algorithm: Algorithm, key: DecodingKey, leeway_secs: u64) -> Self {
        let mut validation = Validation::new(algorithm);
        validation.set_required_spec_claims(&["exp", "sub"]);
        validation.leeway = leeway_secs;
        validation.validate_exp = true;
        // A token not yet valid is refused too, when it says so.
        validation.validate_nbf = true;
        ViewerKey { algorithm, key, validation }
    }
}

/// The claims a viewer token must carry besides `exp` (which the library checks).
#[derive(serde::Deserialize)]
struct ViewerClaims {
    /// The viewer's user id.
    sub: String,
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

/// Parses one PEM public key, RSA or Ed25519, and pins its algorithm.
fn public_key(pem: &[u8]) -> Result<(Algorithm, DecodingKey), AuthConfigError> {
    let invalid = |reason: &str| AuthConfigError::PublicKey { reason: reason.to_owned() };
    let text = std::str::from_utf8(pem).map_err(|_| invalid("not a PEM text file"))?;
    // The library would also take a private key or a certificate where a
    // public key belongs, so the label is checked here first.
    let labels: Vec<&str> = text
        .match_indices("-----BEGIN ")
        .map(|(at, begin)| text[at + begin.len()..].split_once("-----").map_or("", |(label, _)| label))
        .collect();
    match labels.as_slice() {
        [] => return Err(invalid("no PEM block; expected -----BEGIN PUBLIC KEY-----")),
        [label] if label.contains("PRIVATE") => {
            return Err(invalid("is a private key; configure the public key only"));
        }
        ["PUBLIC KEY" | "RSA PUBLIC KEY"] => {}
        [_] => return Err(invalid("is not a public key; expected -----BEGIN PUBLIC KEY-----")),
        _ => return Err(invalid("holds more than one PEM block; configure exactly one public key")),
    }
    if let Ok(key) = DecodingKey::from_rsa_pem(pem) {
        return Ok((Algorithm::RS256, key));
    }
    match DecodingKey::from_ed_pem(pem) {
        Ok(key) if key.try_get_as_bytes().is_ok_and(|bytes| bytes.len() == 32) => Ok((Algorithm::EdDSA, key)),
        _ => Err(invalid("not an RSA or Ed25519 public key")),
    }
}

/// Reads the one bearer token of a request.
fn bearer_token(metadata: &MetadataMap) -> Result<&str, ServiceError> {
    let mut values = metadata.get_all("authorization").iter();
    let value = match (values.next(), values.next()) {
        (None, _) => {
            return Err(ServiceError::Unauthenticated(
                "missing credentials: send `authorization: Bearer <token>` metadata".into(),
            ));
        }
        (Some(value), None) => value,
        (Some(_), Some(_)) => return Err(malformed("more than one authorization entry")),
    };
    let value = value.to_str().map_err(|_| malformed("authorization is not printable ASCII"))?;
    // The scheme is case-insensitive (RFC 7235 section 2.1).
    let token = match value.trim().split_once(' ') {
        Some((scheme, token)) if scheme.eq_ignore_ascii_case("bearer") => token.trim_start(),
        _ => return Err(malformed("authorization must be `Bearer <token>`")),
    };
    if token.is_empty() {
        return Err(malformed("empty bearer token"));
    }
    if token.len() > MAX_TOKEN_BYTES {
        return Err(malformed("bearer token longer than 8192 bytes"));
    }
    if token.contains(|c: char| c.is_ascii_whitespace()) {
        return Err(malformed("authorization must be `Bearer <token>`"));
    }
    Ok(token)
}

fn malformed(what: &str) -> ServiceError {
    ServiceError::Unauthenticated(format!("malformed credentials: {what}").into())
}

/// The one answer for every token that is not accepted, whatever the reason,
/// so that a caller cannot probe which tokens or keys exist.
fn invalid_credentials() -> ServiceError {
    ServiceError::Unauthenticated("invalid credentials".into())
}

fn refused(reason: &'static str) -> ServiceError {
    tracing::debug!(reason, "refused credentials");
    invalid_credentials()
}

fn refused_with(err: &jsonwebtoken::errors::Error) -> ServiceError {
    tracing::debug!(reason = %err, "refused credentials");
    invalid_credentials()
}

#[cfg(test)]
mod tests {
    use super::*;
    use jsonwebtoken::{EncodingKey, Header};
    use serde_json::{Value, json};
    use tonic::metadata::MetadataValue;
    use tonic::{Code, Status};

    // Test-only key pairs, generated with `openssl genpkey` for these tests and
    // used nowhere else. Never configure them anywhere.
    const TEST_ONLY_RSA_PRIVATE_PEM: &str = "-----BEGIN PRIVATE KEY-----
MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQCYE3cB/54CPceS
Wi0unOZhXG+aW0YhoadoNDZgAySi8UOA+3zyUbq403abX4LFFPF9XDE7K3W+vQCM
qz/jHC4oK153ojnubpmkHP24FK+H6FpjwOOrUYMtPiJ2GtbjQYPdwARWEPRLvXCu
PcqnpBtVzQ+6CejekPylxfYn0ZbpPQYMxpn6ev90n6hEd8L2+6i+DWIYFdJvUpZU
FFsEZp9ylPPiMm5IBUsaE6IAWnM8MzISL43JOs3O+fgNl0R4L0NQjFoVr3EZd5nu
tPIcJuPSFb3sX0zrjCEaUXqbC7EAKBLRv1xSJ8clrXUsxnEvOiTY1E77TOulX70b
+ZXo8/ILAgMBAAECggEALfa0IYaA22yQxUs8HLqPZx3pHV449DFHx9cAGETa7eS9
4l4ghZzuMq63Sn6zp52M37bdqmSYUe4OHHYl+R6rVLjG9KGzoL0M8u1QQjL+WrV/
nGbQaRdZ7nK5N7kk+crzcDJ5HQpCzCGVzRQgDEstd+Fiv3f/SkXIFtKec6qFUjkH
174wCRV8gAOGeJzp3QruL14j1ZKVs0sXWSEOTKyKFqw3iW/h8g0+7rncsEyzvj5z
N1BwE+00mxbSfBtYjhmmbeAb8wRxm4cxcpDG25tBEbHMTSIx+JYrjG35bBwG4WQ+
kOeUVS9soAKVANaxAR6th7RVg9rjXaA+JDgdytmSAQKBgQDVXr0NhqobcBjPXPMl
O+8mRovRHPduHv7LAV7UpKTOh+ad6PkTxf0fvhBJx1G7iuvqVv5RSfseWZ0H2Ty5
JuQt2Xt3m7zfYcBxr8KBlCviyE6cMh56geq5Wi6APorJgbM9OxN5HAMTgCu40fkU
1F5GRmbOuV1XGHAMws+UTGfxgwKBgQC2dba760Q0YtIIg83JO9BllzEV5VLFA2Sc
8tvkE7oT36PQHEgYT8snsHl6avRmfcK2SWnMxtTfvS0zyQ9rw53yNuDIlnqS9W4z
fjHNAsiXaRGZrT7EAU45ZaYBDg/BELdrcPUFlGOKgOqC0v//0i2RJuAYjWg/3Ykt
mjh0i7O+2QKBgQCM91RrtUZ5bivWBBDXzqsHXKBO/ZYy+ONY94TRdB02He8s8Jhu
ieXbrNRSCg9jmjqWzfajef8gZBAs+Ub3BEzIReEeepPj+U8NTRNyTJRZ9gCJjUs5
oM+UuZHzRF6pFrl2gKsy3mDh51H7fy3SpyPJxgVyGmEig5CzvZkq3vflRQKBgEiB
cJMug5T5rBMcJVuRPFgSg7v6vDB0D7havczdlfUtys/5XSDkHIvyEeP2upY75XNA
qx1n6dHbQCoy/MDLJGnLKvoq6hyaESe/PxUDxSh95TOXZ7jF+ArQ/O2wY8xJ00mL
wqJr/D5eylIgfQBwyhDDTQwUrVertkZ74XFWzp/JAoGAa910WhuX15zVGb5fxQpl
wGiSyLpJvie86GQFKYLHOCHMMAGznth3oqx/rgOMntRAEwHR64TO6WaAIac4OeHo
ntbhqg1b07tCmPZ/BaBf8lBOfYSdpbUalL+ubPoGd1So4r5w8Elrdp5RlnOk4vCF
GOdbdc5NzjiS6a6B1OxMgPc=
-----END PRIVATE KEY-----
";
    const TEST_ONLY_RSA_PUBLIC_PEM: &str = "-----BEGIN PUBLIC KEY-----
MIIBIjANBgkqhkiG9w0BAQEFAAOCAQ8AMIIBCgKCAQEAmBN3Af+eAj3HklotLpzm
YVxvmltGIaGnaDQ2YAMkovFDgPt88lG6uNN2m1+CxRTxfVwxOyt1vr0AjKs/4xwu
KCted6I57m6ZpBz9uBSvh+haY8Djq1GDLT4idhrW40GD3cAEVhD0S71wrj3Kp6Qb
Vc0Pugno3pD8pcX2J9GW6T0GDMaZ+nr/dJ+oRHfC9vuovg1iGBXSb1KWVBRbBGaf
cpTz4jJuSAVLGhOiAFpzPDMyEi+NyTrNzvn4DZdEeC9DUIxaFa9xGXeZ7rTyHCbj
0hW97F9M64whGlF6mwuxACgS0b9cUifHJa11LMZxLzok2NRO+0zrpV+9G/mV6PPy
CwIDAQAB
-----END PUBLIC KEY-----
";
    /// The same RSA public key in PKCS#1 form.
    const TEST_ONLY_RSA_PUBLIC_PKCS1_PEM: &str = "-----BEGIN RSA PUBLIC KEY-----
MIIBCgKCAQEAmBN3Af+eAj3HklotLpzmYVxvmltGIaGnaDQ2YAMkovFDgPt88lG6
uNN2m1+CxRTxfVwxOyt1vr0AjKs/4xwuKCted6I57m6ZpBz9uBSvh+haY8Djq1GD
LT4idhrW40GD3cAEVhD0S71wrj3Kp6QbVc0Pugno3pD8pcX2J9GW6T0GDMaZ+nr/
dJ+oRHfC9vuovg1iGBXSb1KWVBRbBGafcpTz4jJuSAVLGhOiAFpzPDMyEi+NyTrN
zvn4DZdEeC9DUIxaFa9xGXeZ7rTyHCbj0hW97F9M64whGlF6mwuxACgS0b9cUifH
Ja11LMZxLzok2NRO+0zrpV+9G/mV6PPyCwIDAQAB
-----END RSA PUBLIC KEY-----
";
    const TEST_ONLY_ED25519_PRIVATE_PEM: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIJnAWLlWkhVQjtKloORm15rMRV4eVwZE2CzzMaiuxkB4
-----END PRIVATE KEY-----
";
    const TEST_ONLY_ED25519_PUBLIC_PEM: &str = "-----BEGIN PUBLIC KEY-----
MCowBQYDK2VwAyEA8FQKZALniC2GAy1YF4CrboyTwzELANIPWC4S/mvLluA=
-----END PUBLIC KEY-----
";
    /// A second Ed25519 key, not the configured one.
    const TEST_ONLY_OTHER_ED25519_PRIVATE_PEM: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIGp3Xt2pI1/5ql0DS/Pc+3kjNEVWnMxA38I77aKXwIeo
-----END PRIVATE KEY-----
";
    /// A P-256 public key: a key type viewer tokens do not use.
    const TEST_ONLY_EC_P256_PUBLIC_PEM: &str = "-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEHsW2u1awo4WW9jy/SOeDVL8QGVVn
bKFoyrOJ9nwLzBn2Qbh+Sk7hDlFA+GH6EFL2ol91V6l37ydHgvlmefjE5A==
-----END PUBLIC KEY-----
";
    const TEST_ONLY_HS256_SECRET: &str = "test-only-hs256-secret-of-at-least-32-bytes";
    const TEST_ONLY_SERVICE_TOKENS: [&str; 2] = ["test-only-old-service-token", "test-only-new-service-token"];

    fn now() -> u64 {
        jsonwebtoken::get_current_timestamp()
    }

    fn metadata(authorization: &str) -> MetadataMap {
        let mut metadata = MetadataMap::new();
        metadata.insert("authorization", MetadataValue::try_from(authorization).unwrap());
        metadata
    }

    fn bearer(token: &str) -> MetadataMap {
        metadata(&format!("Bearer {token}"))
    }

    fn hs256_config() -> AuthConfig {
        AuthConfig { viewer_jwt_hs256_secret: Some(TEST_ONLY_HS256_SECRET.into()), ..AuthConfig::default() }
    }

    fn full_config() -> AuthConfig {
        AuthConfig { service_tokens: TEST_ONLY_SERVICE_TOKENS.map(String::from).to_vec(), ..hs256_config() }
    }

    fn public_key_config(pem: &str) -> AuthConfig {
        AuthConfig { viewer_jwt_public_key_pem: Some(pem.as_bytes().to_vec()), ..AuthConfig::default() }
    }

    fn authenticator(config: AuthConfig) -> Authenticator {
        Authenticator::new(config).unwrap()
    }

    fn sign(algorithm: Algorithm, key: &EncodingKey, claims: &Value) -> String {
        jsonwebtoken::encode(&Header::new(algorithm), claims, key).unwrap()
    }

    fn hs256(claims: &Value) -> String {
        sign(Algorithm::HS256, &EncodingKey::from_secret(TEST_ONLY_HS256_SECRET.as_bytes()).unwrap(), claims)
    }

    fn valid_claims(sub: &str) -> Value {
        json!({ "sub": sub, "exp": now() + 600 })
    }

    #[track_caller]
    fn assert_unauthenticated(result: Result<Caller, ServiceError>, message: &str) {
        let status = Status::from(result.unwrap_err());
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert_eq!(status.message(), message);
    }

    #[track_caller]
    fn assert_invalid(result: Result<Caller, ServiceError>) {
        assert_unauthenticated(result, "invalid credentials");
    }

    #[test]
    fn open_mode_makes_everyone_a_service() {
        let auth = authenticator(AuthConfig::default());
        assert!(auth.is_open());
        assert_eq!(auth.caller(&MetadataMap::new()).unwrap(), Caller::Service);
        assert_eq!(auth.caller(&metadata("garbage")).unwrap(), Caller::Service);
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("alice")))).unwrap(), Caller::Service);
    }

    #[test]
    fn any_configured_credential_closes_the_server() {
        assert!(!authenticator(hs256_config()).is_open());
        assert!(!authenticator(public_key_config(TEST_ONLY_ED25519_PUBLIC_PEM)).is_open());
        let tokens_only = AuthConfig { service_tokens: vec!["test-only-token".into()], ..AuthConfig::default() };
        assert!(!authenticator(tokens_only).is_open());
    }

    #[test]
    fn no_credentials_is_unauthenticated() {
        let auth = authenticator(full_config());
        assert_unauthenticated(
            auth.caller(&MetadataMap::new()),
            "missing credentials: send `authorization: Bearer <token>` metadata",
        );
    }

    #[test]
    fn malformed_headers_are_unauthenticated() {
        let auth = authenticator(full_config());
        let token = TEST_ONLY_SERVICE_TOKENS[0];
        for (value, message) in [
            (token.to_owned(), "malformed credentials: authorization must be `Bearer <token>`"),
            (format!("Basic {token}"), "malformed credentials: authorization must be `Bearer <token>`"),
            (format!("Bearer{token}"), "malformed credentials: authorization must be `Bearer <token>`"),
            ("Bearer".to_owned(), "malformed credentials: authorization must be `Bearer <token>`"),
            ("Bearer ".to_owned(), "malformed credentials: authorization must be `Bearer <token>`"),
            (format!("Bearer {token} extra"), "malformed credentials: authorization must be `Bearer <token>`"),
            (
                format!("Bearer {}", "a".repeat(MAX_TOKEN_BYTES + 1)),
                "malformed credentials: bearer token longer than 8192 bytes",
            ),
        ] {
            assert_unauthenticated(auth.caller(&metadata(&value)), message);
        }

        let mut non_ascii = MetadataMap::new();
        let value = MetadataValue::try_from("Bearer tökén".as_bytes()).unwrap();
        non_ascii.insert("authorization", value);
        assert_unauthenticated(auth.caller(&non_ascii), "malformed credentials: authorization is not printable ASCII");

        let mut twice = bearer(token);
        twice.append("authorization", MetadataValue::try_from(format!("Bearer {token}")).unwrap());
        assert_unauthenticated(auth.caller(&twice), "malformed credentials: more than one authorization entry");
    }

    #[test]
    fn scheme_is_case_insensitive_and_spacing_tolerated() {
        let auth = authenticator(full_config());
        let token = TEST_ONLY_SERVICE_TOKENS[0];
        for value in [format!("bearer {token}"), format!("BEARER  {token}"), format!(" Bearer {token} ")] {
            assert_eq!(auth.caller(&metadata(&value)).unwrap(), Caller::Service, "{value:?}");
        }
    }

    #[test]
    fn both_rotated_service_tokens_work() {
        let auth = authenticator(full_config());
        for token in TEST_ONLY_SERVICE_TOKENS {
            assert_eq!(auth.caller(&bearer(token)).unwrap(), Caller::Service);
        }
    }

    #[test]
    fn unknown_service_tokens_are_refused_like_bad_jwts() {
        let auth = authenticator(full_config());
        for token in [
            "test-only-unknown-token",
            "test-only-old-service-toke",   // a prefix
            "test-only-old-service-tokenX", // an extension
            "TEST-ONLY-OLD-SERVICE-TOKEN",
        ] {
            assert_invalid(auth.caller(&bearer(token)));
        }
    }

    #[test]
    fn a_service_token_is_never_tried_as_a_jwt() {
        // A service token that happens to be a valid viewer JWT names a service.
        let jwt = hs256(&valid_claims("alice"));
        let auth = authenticator(AuthConfig { service_tokens: vec![jwt.clone()], ..hs256_config() });
        assert_eq!(auth.caller(&bearer(&jwt)).unwrap(), Caller::Service);
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("bob")))).unwrap(), Caller::Viewer("bob".into()));
    }

    #[test]
    fn jwts_are_refused_when_no_jwt_key_is_configured() {
        let auth = authenticator(AuthConfig {
            service_tokens: TEST_ONLY_SERVICE_TOKENS.map(String::from).to_vec(),
            ..AuthConfig::default()
        });
        assert_invalid(auth.caller(&bearer(&hs256(&valid_claims("alice")))));
    }

    #[test]
    fn hs256_viewer_token_names_its_subject() {
        let auth = authenticator(full_config());
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("alice")))).unwrap(), Caller::Viewer("alice".into()));
        let longest = "u".repeat(MAX_ID_BYTES);
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims(&longest)))).unwrap(), Caller::Viewer(longest));
    }

    #[test]
    fn wrong_signature_is_refused() {
        let auth = authenticator(full_config());
        let other = EncodingKey::from_secret(b"test-only-another-secret-of-32-bytes-or-more").unwrap();
        assert_invalid(auth.caller(&bearer(&sign(Algorithm::HS256, &other, &valid_claims("alice")))));

        // A valid token whose claims were swapped keeps the old signature.
        let token = hs256(&valid_claims("alice"));
        let forged_claims = hs256(&valid_claims("mallory"));
        let parts: Vec<&str> = token.split('.').collect();
        let forged_payload = forged_claims.split('.').nth(1).unwrap();
        let forged = format!("{}.{}.{}", parts[0], forged_payload, parts[2]);
        assert_invalid(auth.caller(&bearer(&forged)));
    }

    #[test]
    fn expired_tokens_are_refused() {
        let auth = authenticator(full_config());
        let expired = hs256(&json!({ "sub": "alice", "exp": now() - 10 }));
        assert_unauthenticated(auth.caller(&bearer(&expired)), "credentials expired");

        let lenient = authenticator(AuthConfig { jwt_leeway_secs: 60, ..hs256_config() });
        assert_eq!(lenient.caller(&bearer(&expired)).unwrap(), Caller::Viewer("alice".into()));
        let long_expired = hs256(&json!({ "sub": "alice", "exp": now() - 120 }));
        assert_unauthenticated(lenient.caller(&bearer(&long_expired)), "credentials expired");
    }

    #[test]
    fn tokens_without_exp_are_refused() {
        let auth = authenticator(full_config());
        assert_invalid(auth.caller(&bearer(&hs256(&json!({ "sub": "alice" })))));
        assert_invalid(auth.caller(&bearer(&hs256(&json!({ "sub": "alice", "exp": "tomorrow" })))));
    }

    #[test]
    fn tokens_not_yet_valid_are_refused() {
        let auth = authenticator(full_config());
        let early = hs256(&json!({ "sub": "alice", "exp": now() + 600, "nbf": now() + 300 }));
        assert_invalid(auth.caller(&bearer(&early)));
    }

    #[test]
    fn tokens_without_a_usable_sub_are_refused() {
        let auth = authenticator(full_config());
        let exp = now() + 600;
        for claims in [
            json!({ "exp": exp }),
            json!({ "sub": "", "exp": exp }),
            json!({ "sub": 42, "exp": exp }),
            json!({ "sub": null, "exp": exp }),
            json!({ "sub": "u".repeat(MAX_ID_BYTES + 1), "exp": exp }),
        ] {
            assert_invalid(auth.caller(&bearer(&hs256(&claims))));
        }
    }

    #[test]
    fn tokens_for_an_audience_are_refused_as_none_is_configured() {
        let auth = authenticator(full_config());
        let claims = json!({ "sub": "alice", "exp": now() + 600, "aud": "some-other-service" });
        assert_invalid(auth.caller(&bearer(&hs256(&claims))));
    }

    #[test]
    fn refusals_do_not_tell_tokens_apart() {
        let auth = authenticator(full_config());
        let other = EncodingKey::from_secret(b"test-only-another-secret-of-32-bytes-or-more").unwrap();
        let statuses = [
            auth.caller(&bearer("test-only-unknown-token")),
            auth.caller(&bearer("a.b.c")),
            auth.caller(&bearer(&sign(Algorithm::HS256, &other, &valid_claims("alice")))),
            auth.caller(&bearer(&hs256(&json!({ "exp": now() + 600 })))),
        ]
        .map(|result| Status::from(result.unwrap_err()));
        for status in &statuses {
            assert_eq!((status.code(), status.message()), (Code::Unauthenticated, "invalid credentials"));
        }
    }

    #[test]
    fn rs256_tokens_verify_with_an_rsa_public_key() {
        let private = EncodingKey::from_rsa_pem(TEST_ONLY_RSA_PRIVATE_PEM.as_bytes()).unwrap();
        let token = sign(Algorithm::RS256, &private, &valid_claims("alice"));
        for pem in [TEST_ONLY_RSA_PUBLIC_PEM, TEST_ONLY_RSA_PUBLIC_PKCS1_PEM] {
            let auth = authenticator(public_key_config(pem));
            assert_eq!(auth.caller(&bearer(&token)).unwrap(), Caller::Viewer("alice".into()));
            let expired = sign(Algorithm::RS256, &private, &json!({ "sub": "alice", "exp": now() - 10 }));
            assert_unauthenticated(auth.caller(&bearer(&expired)), "credentials expired");
            // The key is pinned to RS256: another RSA algorithm is refused.
            assert_invalid(auth.caller(&bearer(&sign(Algorithm::RS512, &private, &valid_claims("alice")))));
            assert_invalid(auth.caller(&bearer(&sign(Algorithm::PS256, &private, &valid_claims("alice")))));
        }
    }

    #[test]
    fn eddsa_tokens_verify_with_an_ed25519_public_key() {
        let auth = authenticator(public_key_config(TEST_ONLY_ED25519_PUBLIC_PEM));
        let private = EncodingKey::from_ed_pem(TEST_ONLY_ED25519_PRIVATE_PEM.as_bytes()).unwrap();
        assert_eq!(
            auth.caller(&bearer(&sign(Algorithm::EdDSA, &private, &valid_claims("alice")))).unwrap(),
            Caller::Viewer("alice".into())
        );
        let other = EncodingKey::from_ed_pem(TEST_ONLY_OTHER_ED25519_PRIVATE_PEM.as_bytes()).unwrap();
        assert_invalid(auth.caller(&bearer(&sign(Algorithm::EdDSA, &other, &valid_claims("alice")))));
        let expired = sign(Algorithm::EdDSA, &private, &json!({ "sub": "alice", "exp": now() - 10 }));
        assert_unauthenticated(auth.caller(&bearer(&expired)), "credentials expired");
    }

    #[test]
    fn hs256_signed_with_the_public_key_is_refused() {
        // The classic algorithm confusion: HMAC keyed with the server's public key.
        for pem in [TEST_ONLY_RSA_PUBLIC_PEM, TEST_ONLY_ED25519_PUBLIC_PEM] {
            let auth = authenticator(public_key_config(pem));
            let confused = EncodingKey::from_secret(pem.as_bytes()).unwrap();
            assert_invalid(auth.caller(&bearer(&sign(Algorithm::HS256, &confused, &valid_claims("alice")))));
        }
        // Also with an HS256 secret configured beside the key: the secret, not the public key, is the HMAC key.
        let both = AuthConfig { viewer_jwt_public_key_pem: Some(TEST_ONLY_RSA_PUBLIC_PEM.into()), ..hs256_config() };
        let auth = authenticator(both);
        let confused = EncodingKey::from_secret(TEST_ONLY_RSA_PUBLIC_PEM.as_bytes()).unwrap();
        assert_invalid(auth.caller(&bearer(&sign(Algorithm::HS256, &confused, &valid_claims("alice")))));
        // ...while each key still verifies its own algorithm.
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("alice")))).unwrap(), Caller::Viewer("alice".into()));
        let private = EncodingKey::from_rsa_pem(TEST_ONLY_RSA_PRIVATE_PEM.as_bytes()).unwrap();
        let rs256 = sign(Algorithm::RS256, &private, &valid_claims("bob"));
        assert_eq!(auth.caller(&bearer(&rs256)).unwrap(), Caller::Viewer("bob".into()));
    }

    #[test]
    fn asymmetric_tokens_are_refused_when_only_a_secret_is_configured() {
        let auth = authenticator(hs256_config());
        let private = EncodingKey::from_rsa_pem(TEST_ONLY_RSA_PRIVATE_PEM.as_bytes()).unwrap();
        assert_invalid(auth.caller(&bearer(&sign(Algorithm::RS256, &private, &valid_claims("alice")))));
        let private = EncodingKey::from_ed_pem(TEST_ONLY_ED25519_PRIVATE_PEM.as_bytes()).unwrap();
        assert_invalid(auth.caller(&bearer(&sign(Algorithm::EdDSA, &private, &valid_claims("alice")))));
    }

    #[test]
    fn unsigned_tokens_are_refused() {
        let auth = authenticator(full_config());
        let payload = hs256(&valid_claims("alice")).split('.').nth(1).unwrap().to_owned();
        // {"alg":"none","typ":"JWT"}
        let header = "eyJhbGciOiJub25lIiwidHlwIjoiSldUIn0";
        assert_invalid(auth.caller(&bearer(&format!("{header}.{payload}."))));
        assert_invalid(auth.caller(&bearer(&format!("{header}.{payload}"))));
    }

    #[test]
    fn bad_configurations_are_refused_in_one_line() {
        let cases: Vec<(AuthConfig, &str)> = vec![
            (
                AuthConfig { service_tokens: vec!["test-only-token".into(), String::new()], ..AuthConfig::default() },
                "service token #2: is empty",
            ),
            (
                AuthConfig { service_tokens: vec!["test only".into()], ..AuthConfig::default() },
                "service token #1: must be printable ASCII without spaces",
            ),
            (
                AuthConfig { service_tokens: vec!["test-only\n".into()], ..AuthConfig::default() },
                "service token #1: must be printable ASCII without spaces",
            ),
            (
                AuthConfig { viewer_jwt_hs256_secret: Some(String::new()), ..AuthConfig::default() },
                "viewer JWT HS256 secret: 0 bytes, shorter than the minimum of 32",
            ),
            (
                AuthConfig { viewer_jwt_hs256_secret: Some("test-only-short".into()), ..AuthConfig::default() },
                "viewer JWT HS256 secret: 15 bytes, shorter than the minimum of 32",
            ),
            (
                public_key_config(TEST_ONLY_RSA_PRIVATE_PEM),
                "viewer JWT public key: is a private key; configure the public key only",
            ),
            (
                public_key_config(TEST_ONLY_ED25519_PRIVATE_PEM),
                "viewer JWT public key: is a private key; configure the public key only",
            ),
            (
                public_key_config(TEST_ONLY_EC_P256_PUBLIC_PEM),
                "viewer JWT public key: not an RSA or Ed25519 public key",
            ),
            (
                public_key_config("not a key"),
                "viewer JWT public key: no PEM block; expected -----BEGIN PUBLIC KEY-----",
            ),
            (
                public_key_config(&format!("{TEST_ONLY_RSA_PUBLIC_PEM}{TEST_ONLY_ED25519_PUBLIC_PEM}")),
                "viewer JWT public key: holds more than one PEM block; configure exactly one public key",
            ),
            (
                public_key_config("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"),
                "viewer JWT public key: is not a public key; expected -----BEGIN PUBLIC KEY-----",
            ),
            (
                public_key_config("-----BEGIN PUBLIC KEY-----\nbm90IGEga2V5\n-----END PUBLIC KEY-----\n"),
                "viewer JWT public key: not an RSA or Ed25519 public key",
            ),
            (AuthConfig { jwt_leeway_secs: 301, ..hs256_config() }, "JWT leeway: 301 s, more than the limit of 300 s"),
        ];
        for (config, message) in cases {
            let err = Authenticator::new(config).unwrap_err();
            assert_eq!(err.to_string(), message);
        }
        let mut bad_utf8 = public_key_config("");
        bad_utf8.viewer_jwt_public_key_pem = Some(vec![0xff, 0xfe]);
        assert_eq!(Authenticator::new(bad_utf8).unwrap_err().to_string(), "viewer JWT public key: not a PEM text file");
    }

    #[test]
    fn debug_output_shows_no_secret() {
        let config = full_config();
        let shown = format!("{config:?} {:?}", authenticator(config.clone()));
        for secret in TEST_ONLY_SERVICE_TOKENS.into_iter().chain([TEST_ONLY_HS256_SECRET]) {
            assert!(!shown.contains(secret), "{shown}");
        }
        assert!(shown.contains("HS256"), "{shown}");
    }

    #[test]
    fn viewers_act_as_themselves_whatever_viewer_id_they_send() {
        let alice = Caller::Viewer("alice".into());
        assert_eq!(alice.acting_viewer(""), Some("alice".into()));
        assert_eq!(alice.acting_viewer("bob"), Some("alice".into()));
    }

    #[test]
    fn services_act_for_the_viewer_they_name() {
        assert_eq!(Caller::Service.acting_viewer("bob"), Some("bob".into()));
        assert_eq!(Caller::Service.acting_viewer(""), None);
    }

    #[test]
    fn only_services_pass_require_service() {
        assert!(Caller::Service.require_service("Register").is_ok());
        let status = Status::from(Caller::Viewer("alice".into()).require_service("Register").unwrap_err());
        assert_eq!(status.code(), Code::PermissionDenied);
        assert_eq!(status.message(), "Register: requires service credentials");
    }

    #[test]
    fn viewers_may_act_on_themselves_only() {
        let alice = Caller::Viewer("alice".into());
        assert!(Caller::Service.require_self_or_service("bob", "SetStatus").is_ok());
        assert!(alice.require_self_or_service("alice", "SetStatus").is_ok());
        let status = Status::from(alice.require_self_or_service("bob", "SetVisibility").unwrap_err());
        assert_eq!(status.code(), Code::PermissionDenied);
        assert_eq!(status.message(), "SetVisibility: a viewer may act only on its own user id");
        // Ids compare exactly: no case folding, no prefix.
        assert!(alice.require_self_or_service("Alice", "SetStatus").is_err());
        assert!(alice.require_self_or_service("alic", "SetStatus").is_err());
    }
}
