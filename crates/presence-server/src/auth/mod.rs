//! Caller authentication: who is calling, as which role, with which scopes (P1, P6, T3).
//! It names only the shared `error.rs`: nothing of `node/`, `cluster/` or `api/`, which all may use it.
//!
//! This module owns the check of the `authorization: Bearer <token>` metadata
//! and the role and scope rules built on its answer. It reads request
//! metadata only, never a request field, so a viewer's identity always comes
//! from its credentials (a `viewer_id` field counts only for a service
//! caller). It must not decide what a viewer may see (the audience rules, P2
//! and P3, do that with the identity found here), nor whether the server may
//! run open on a given address (the binary decides that).
//!
//! | credential | caller |
//! |---|---|
//! | none configured at all | every request is a service with every scope (open, for development) |
//! | a `--service-token` | a service with every scope, named `service-token-N` |
//! | a token of the credentials file (`credentials.rs`) | a service with that credential's name and scopes |
//! | a JWT verified with the configured HS256 secret or RSA/Ed25519 public key | a viewer, its `sub` |
//! | no token, on a connection whose client certificate has a `--tls-service-identity` (T2) | a service with every scope, named `certificate:ID` |
//! | no token, on a connection with a certificate of the cluster's CA (another node, T2) | a service with every scope, named `cluster-node:ID` |
//! | anything else, or no credential | `UNAUTHENTICATED` |
//!
//! What each scope allows is in `scopes.rs`; streams that end with their
//! credentials in `stream.rs`.
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

mod credentials;
mod jwks;
pub(crate) mod scopes;
mod stream;

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arc_swap::ArcSwap;
use jsonwebtoken::errors::ErrorKind;
use jsonwebtoken::{Algorithm, DecodingKey, Validation};
use presence_core::MAX_ID_BYTES;
use tonic::metadata::MetadataMap;

use crate::error::ServiceError;

use credentials::CredentialSet;
pub use credentials::{CredentialsError, TOKEN_PREFIX, entry_for, new_token};
pub use scopes::{Scope, Scopes};
pub(crate) use stream::{CredentialBound, StreamCredentials};

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
    pub(crate) certificate: Option<Arc<presence_tls::ClientCertificate>>,
    /// The client's address, for the audit log.
    pub(crate) peer: Option<std::net::SocketAddr>,
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
    /// A gateway, a backend or an admin tool (or anyone, when the server runs open).
    Service(ServiceCaller),
    /// An end user, identified by the verified `sub` of its token.
    Viewer(ViewerCaller),
}

/// A service caller: the credential it presented and what that allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServiceCaller {
    /// The credential's name (`service-token-N` for a `--service-token`,
    /// `certificate:ID` for a client certificate, `open` on an open server).
    pub(crate) name: Arc<str>,
    pub(crate) scopes: Scopes,
}

/// A viewer: its user id and when its token stops being accepted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ViewerCaller {
    pub(crate) id: String,
    /// The token's `exp` plus the configured leeway, in Unix seconds.
    pub(crate) accepted_until: u64,
}

impl Caller {
    /// The credential's name, or the viewer's id, for the audit log.
    pub(crate) fn name(&self) -> &str {
        match self {
            Caller::Service(service) => &service.name,
            Caller::Viewer(viewer) => &viewer.id,
        }
    }

    /// The identity whose view of presence applies, for a read (Snapshot,
    /// Watch, room reads): for a viewer, itself (any `viewer_id` field it sent
    /// is ignored); for a service caller, the `viewer_id` it names, which
    /// needs the `read-as-viewer` scope (or `read`), or `None` (true states)
    /// when it names none (an empty string is none), which needs `read` (P6).
    pub(crate) fn acting_viewer(
        &self,
        viewer_id_field: &str,
        operation: &'static str,
    ) -> Result<Option<String>, ServiceError> {
        match self {
            Caller::Viewer(viewer) => Ok(Some(viewer.id.clone())),
            Caller::Service(_) if viewer_id_field.is_empty() => self.require(Scope::Read, operation).map(|()| None),
            Caller::Service(_) => {
                self.require(Scope::ReadAsViewer, operation).map(|()| Some(viewer_id_field.to_owned()))
            }
        }
    }

    /// `Ok` for a service caller whose credential has `scope`;
    /// `PERMISSION_DENIED` naming the scope it lacks, or, for a viewer,
    /// saying that the call needs service credentials.
    pub(crate) fn require(&self, scope: Scope, operation: &'static str) -> Result<(), ServiceError> {
        match self {
            Caller::Service(service) if service.scopes.allows(scope) => Ok(()),
            Caller::Service(service) => Err(ServiceError::MissingScope {
                operation,
                scope,
                credential: Arc::clone(&service.name),
                scopes: service.scopes,
            }),
            Caller::Viewer(_) => {
                Err(ServiceError::PermissionDenied { operation, reason: "requires service credentials" })
            }
        }
    }

    /// Ok for a service caller with `scope`, or for a viewer acting on itself
    /// (its own status or visibility); `PERMISSION_DENIED` otherwise.
    pub(crate) fn require_self_or(
        &self,
        user_id: &str,
        scope: Scope,
        operation: &'static str,
    ) -> Result<(), ServiceError> {
        match self {
            Caller::Service(_) => self.require(scope, operation),
            Caller::Viewer(viewer) if viewer.id == user_id => Ok(()),
            Caller::Viewer(_) => {
                Err(ServiceError::PermissionDenied { operation, reason: "a viewer may act only on its own user id" })
            }
        }
    }

    /// Whether the caller is a service (tests).
    #[cfg(test)]
    pub(crate) fn is_service(&self) -> bool {
        matches!(self, Caller::Service(_))
    }

    /// The viewer's id, for a viewer (tests).
    #[cfg(test)]
    pub(crate) fn viewer_id(&self) -> Option<&str> {
        match self {
            Caller::Viewer(viewer) => Some(&viewer.id),
            Caller::Service(_) => None,
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
    /// The credentials file (T3): named credentials with scopes and hashed
    /// tokens, read again when it changes.
    pub credentials_file: Option<PathBuf>,
    /// Viewer keys from a JWKS document (T4): a file, or an `https://` URL
    /// of the identity provider's.
    pub viewer_jwks: Option<String>,
    /// The CA of the JWKS URL's certificate; `None`: the system's roots.
    pub viewer_jwks_ca: Option<PathBuf>,
    /// How often a JWKS URL is fetched again; zero: every 5 minutes.
    pub viewer_jwks_refresh: std::time::Duration,
    /// Accepted `aud` values of viewer tokens; when any is set, a token must
    /// carry one of them.
    pub viewer_jwt_audiences: Vec<String>,
    /// The `iss` viewer tokens must carry, when set.
    pub viewer_jwt_issuer: Option<String>,
}

// By hand, so that a logged configuration never shows a secret.
impl fmt::Debug for AuthConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AuthConfig")
            .field("service_tokens", &format_args!("[{} redacted]", self.service_tokens.len()))
            .field("viewer_jwt_hs256_secret", &self.viewer_jwt_hs256_secret.as_ref().map(|_| "redacted"))
            .field("viewer_jwt_public_key_pem", &self.viewer_jwt_public_key_pem.as_ref().map(Vec::len))
            .field("jwt_leeway_secs", &self.jwt_leeway_secs)
            .field("credentials_file", &self.credentials_file)
            .field("viewer_jwks", &self.viewer_jwks)
            .field("viewer_jwt_audiences", &self.viewer_jwt_audiences)
            .field("viewer_jwt_issuer", &self.viewer_jwt_issuer)
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
    /// The credentials file cannot be read or is not valid.
    #[error(transparent)]
    Credentials(#[from] CredentialsError),
    /// The JWKS file cannot be read, or the URL is not an `https://` URL.
    #[error("--viewer-jwks {location}: {reason}")]
    Jwks {
        /// The file or URL.
        location: String,
        /// What is wrong.
        reason: String,
    },
    /// The build has no (or two) JWT crypto backends, so no token could be checked.
    #[error("viewer JWT keys are configured but this build has no JWT crypto provider")]
    NoCryptoProvider,
}

/// Checks credentials and names the caller.
pub(crate) struct Authenticator {
    /// The `--service-token` tokens, with every scope.
    service_tokens: CredentialSet,
    /// The credentials file, and its credentials as last read.
    credentials_file: Option<(PathBuf, ArcSwap<CredentialSet>)>,
    /// The viewer token keys, at most one per algorithm.
    viewer_keys: Vec<ViewerKey>,
    /// Viewer keys from a JWKS document, with `--viewer-jwks`.
    jwks: Option<JwksState>,
    /// What every viewer token is checked for besides its signature.
    claims: ClaimRules,
    /// Counts changes of the accepted credentials: open streams look at
    /// theirs again on each (see `stream.rs`).
    changes: tokio::sync::watch::Sender<u64>,
    /// The warning of client certificates refused for naming no listed
    /// identity: a deployment mistake the operator asks the log about, at
    /// most a line every ten seconds.
    unlisted_certificates_logged: crate::every_now::EveryNow,
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

/// The claims every viewer token is held to.
#[derive(Debug, Clone, Default)]
struct ClaimRules {
    /// Clock skew allowed on `exp` and `nbf`, in seconds.
    leeway_secs: u64,
    audiences: Vec<String>,
    issuer: Option<String>,
}

impl ClaimRules {
    /// A validation that accepts `algorithm` alone and enforces the rules.
    /// Why a token was refused, as `jsonwebtoken` found it, in words about
    /// that token alone.
    fn why_refused(&self, kind: &ErrorKind) -> &'static str {
        match kind {
            ErrorKind::InvalidSignature => "its signature does not verify with the viewer key of its `alg`",
            ErrorKind::MissingRequiredClaim(claim) => match claim.as_str() {
                "exp" => "the token has no `exp` claim (a viewer token must expire)",
                "sub" => "the token has no `sub` claim",
                "aud" => "the token has no `aud` claim, and this server requires one (--viewer-jwt-audience)",
                "iss" => "the token has no `iss` claim, and this server requires one (--viewer-jwt-issuer)",
                _ => "the token lacks a required claim",
            },
            ErrorKind::InvalidAudience if self.audiences.is_empty() => {
                "the token has an `aud` claim, and no audience is configured (--viewer-jwt-audience)"
            }
            ErrorKind::InvalidAudience => "the token's `aud` is not an audience this server accepts",
            ErrorKind::InvalidIssuer => "the token's `iss` is not the issuer this server accepts",
            ErrorKind::ImmatureSignature => "the token is not valid yet (its `nbf` is ahead)",
            ErrorKind::InvalidAlgorithm => "the token's `alg` is not its key's",
            // The claims are read into their types first: a missing one is serde's to find.
            ErrorKind::Json(err) if err.to_string().contains("missing field `sub`") => "the token has no `sub` claim",
            ErrorKind::Json(err) if err.to_string().contains("missing field `exp`") => {
                "the token has no `exp` claim (a viewer token must expire)"
            }
            ErrorKind::Json(_) => "the token's claims are not of the expected types (`exp` a number, `sub` a string)",
            _ => "the token cannot be read as a JWT",
        }
    }

    fn validation(&self, algorithm: Algorithm) -> Validation {
        let mut validation = Validation::new(algorithm);
        let mut required = vec!["exp", "sub"];
        validation.leeway = self.leeway_secs;
        validation.validate_exp = true;
        // A token not yet valid is refused too, when it says so.
        validation.validate_nbf = true;
        if !self.audiences.is_empty() {
            validation.set_audience(&self.audiences);
            required.push("aud");
        }
        if let Some(issuer) = &self.issuer {
            validation.set_issuer(&[issuer]);
            required.push("iss");
        }
        validation.set_required_spec_claims(&required);
        validation
    }
}

/// The JWKS document's keys and how to read it again.
struct JwksState {
    source: jwks::JwksSource,
    keys: ArcSwap<jwks::JwksKeys>,
    /// How often a URL is fetched again.
    refresh: std::time::Duration,
    /// One fetch for unknown `kid`s at a time, and not too often.
    unknown_kid: tokio::sync::Mutex<jwks::UnknownKidFetches>,
    /// One read of the document at a time, whatever asked for it: a call
    /// with an unknown `kid` arriving while the first read (at start) or a
    /// scheduled one is under way waits for it and looks again, rather than
    /// fetching the same document twice.
    reading: tokio::sync::Mutex<()>,
}

// By hand, so that a logged authenticator never shows a secret.
impl fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Authenticator")
            .field("service_tokens", &self.service_tokens.len())
            .field("credentials_file", &self.credentials_file.as_ref().map(|(path, _)| path))
            .field("viewer_algorithms", &self.viewer_keys.iter().map(|key| key.algorithm).collect::<Vec<_>>())
            .finish()
    }
}

/// What a reload of the credentials file changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct CredentialsReloaded {
    /// How many credentials the file now holds.
    pub(crate) credentials: usize,
    /// The names no longer in the file: their streams end.
    pub(crate) removed: Vec<String>,
    /// The names new in the file.
    pub(crate) added: Vec<String>,
}

impl Authenticator {
    /// Checks the configuration, reads the credentials file and prepares the keys.
    pub(crate) fn new(config: AuthConfig) -> Result<Self, AuthConfigError> {
        if config.jwt_leeway_secs > MAX_JWT_LEEWAY_SECS {
            return Err(AuthConfigError::Leeway { secs: config.jwt_leeway_secs });
        }
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
        }
        let service_tokens = CredentialSet::of_service_tokens(&config.service_tokens);
        let credentials_file = match config.credentials_file {
            Some(path) => {
                let credentials = CredentialSet::read(&path)?;
                if credentials.is_empty() {
                    // Valid, and what a new deployment starts from; but every
                    // service call is refused until an entry is added.
                    tracing::warn!(
                        "the credentials file {} holds no credential: every service call is refused until one is \
                         added (`presenced token new NAME --scope SCOPE >> {}`; the file is read again when it \
                         changes)",
                        path.display(),
                        path.display()
                    );
                }
                Some((path, ArcSwap::from_pointee(credentials)))
            }
            None => None,
        };

        let claims = ClaimRules {
            leeway_secs: config.jwt_leeway_secs,
            audiences: config.viewer_jwt_audiences.clone(),
            issuer: config.viewer_jwt_issuer.clone(),
        };
        let jwks = match &config.viewer_jwks {
            Some(source) => Some(JwksState::new(source, config.viewer_jwks_ca.clone(), config.viewer_jwks_refresh)?),
            None => None,
        };
        let mut viewer_keys = Vec::new();
        if let Some(secret) = &config.viewer_jwt_hs256_secret {
            if secret.len() < MIN_HS256_SECRET_BYTES {
                return Err(AuthConfigError::Hs256SecretTooShort { bytes: secret.len() });
            }
            let key = DecodingKey::from_secret(secret.as_bytes())
                .map_err(|_| AuthConfigError::Hs256SecretTooShort { bytes: secret.len() })?;
            viewer_keys.push(ViewerKey::new(Algorithm::HS256, key, &claims));
        }
        if let Some(pem) = &config.viewer_jwt_public_key_pem {
            let (algorithm, key) = public_key(pem)?;
            viewer_keys.push(ViewerKey::new(algorithm, key, &claims));
        }
        // Without exactly one backend, jsonwebtoken panics on the first token:
        // fail at start instead.
        if (!viewer_keys.is_empty() || jwks.is_some())
            && jsonwebtoken::crypto::CryptoProvider::try_get_default().is_none()
        {
            return Err(AuthConfigError::NoCryptoProvider);
        }
        Ok(Authenticator {
            service_tokens,
            credentials_file,
            viewer_keys,
            jwks,
            claims,
            changes: tokio::sync::watch::Sender::new(0),
            unlisted_certificates_logged: crate::every_now::EveryNow::new(std::time::Duration::from_secs(10)),
        })
    }

    /// No credentials configured: every caller is a service with every scope.
    pub(crate) fn is_open(&self) -> bool {
        self.service_tokens.is_empty()
            && self.credentials_file.is_none()
            && self.viewer_keys.is_empty()
            && self.jwks.is_none()
    }

    /// The credentials file, when one is configured.
    pub(crate) fn credentials_file(&self) -> Option<&Path> {
        self.credentials_file.as_ref().map(|(path, _)| path.as_path())
    }

    /// Reads the credentials file again. `Ok(None)`: no file, or nothing
    /// changed. A file that cannot be used leaves the credentials in use as
    /// they were. A change ends the open streams of the credentials it took
    /// away (see `stream.rs`).
    pub(crate) fn reload_credentials(&self) -> Result<Option<CredentialsReloaded>, CredentialsError> {
        let Some((path, in_use)) = &self.credentials_file else { return Ok(None) };
        let read = CredentialSet::read(path)?;
        let old = in_use.load();
        if **old == read {
            return Ok(None);
        }
        let reloaded = CredentialsReloaded {
            credentials: read.len(),
            removed: old.names_missing_from(&read),
            added: read.names_missing_from(&old),
        };
        in_use.store(Arc::new(read));
        self.changes.send_modify(|changes| *changes += 1);
        Ok(Some(reloaded))
    }

    /// A receiver that sees every change of the accepted credentials.
    pub(crate) fn watch_changes(&self) -> tokio::sync::watch::Receiver<u64> {
        self.changes.subscribe()
    }

    /// Names the caller from its `authorization: Bearer <token>` metadata
    /// alone (see [`Authenticator::caller_of`]).
    #[cfg(any(test, feature = "fuzzing"))]
    pub(crate) fn caller(&self, metadata: &MetadataMap) -> Result<Caller, ServiceError> {
        self.caller_on(metadata, None)
    }

    /// The caller of `request`, from its token or, without one, from the
    /// certificate its connection presented (see the module's table): a
    /// service token (or a credential of the credentials file) names a
    /// service with its scopes; any other token must be a JWT verified with a
    /// configured key, with an unexpired `exp` and a `sub` of 1 to 128 bytes,
    /// and names a viewer. Anything else is `UNAUTHENTICATED`, with a message
    /// that does not tell which tokens exist. An open server answers a
    /// service with every scope whatever was sent.
    pub(crate) fn caller_of<T>(&self, request: &tonic::Request<T>) -> Result<Caller, ServiceError> {
        let connection = ConnectionInfo::of(request);
        let certificate = connection.and_then(|info| info.certificate.as_deref());
        self.caller_on(request.metadata(), certificate).inspect_err(|refusal| {
            // A caller's mistake, for the caller to see; at debug, for the
            // operator who asks the log about one.
            let peer = connection.and_then(|info| info.peer);
            tracing::debug!(?peer, %refusal, "refused credentials");
            // A certificate of the client CA that names no listed identity is
            // the deployment's mistake more often than a caller's: said at warn.
            let unlisted = certificate.filter(|certificate| !(certificate.service || certificate.cluster_node));
            if let Some(certificate) = unlisted
                && request.metadata().get("authorization").is_none()
                && let Some(refused) = self.unlisted_certificates_logged.note()
            {
                let peer = peer.map_or_else(|| "an unknown address".to_owned(), |peer| peer.to_string());
                tracing::warn!(
                    refused,
                    "refused calls with a client certificate whose identities no --tls-service-identity lists \
                     ({refused} since the last such line); the last, from {peer}: {}",
                    certificate.identities.join(", ")
                );
            }
        })
    }

    fn caller_on(
        &self,
        metadata: &MetadataMap,
        certificate: Option<&presence_tls::ClientCertificate>,
    ) -> Result<Caller, ServiceError> {
        if self.is_open() {
            // Made once: the renewal path of an open server allocates nothing.
            static OPEN: std::sync::LazyLock<Arc<str>> = std::sync::LazyLock::new(|| "open".into());
            return Ok(Caller::Service(ServiceCaller { name: Arc::clone(&OPEN), scopes: Scopes::ALL }));
        }
        if metadata.get("authorization").is_none()
            && let Some(certificate) = certificate
        {
            // A certificate of the client CA that names no service identity
            // is the caller's own: saying which names it holds gives nothing
            // away, and says why it is not enough.
            return certificate_caller(certificate).ok_or_else(|| {
                // Its subject alternative names, then its common name, which often repeats one.
                let mut names: Vec<&str> = Vec::new();
                for name in &certificate.identities {
                    if !names.contains(&name.as_str()) {
                        names.push(name);
                    }
                }
                ServiceError::Unauthenticated(
                    format!(
                        "missing credentials: the client certificate ({}) has no identity listed by \
                         --tls-service-identity, so it names no caller; send `authorization: Bearer <token>` \
                         or connect with a certificate of a listed identity",
                        names.join(", ")
                    )
                    .into(),
                )
            });
        }
        self.caller_with_token(bearer_token(metadata)?)
    }

    /// The caller `token` names.
    pub(crate) fn caller_with_token(&self, token: &str) -> Result<Caller, ServiceError> {
        // A service token is never tried as a JWT.
        if let Some(service) = self.service_credential(token) {
            return Ok(Caller::Service(service));
        }
        self.viewer(token).map(Caller::Viewer)
    }

    /// The service credential whose token is `token`: a `--service-token`
    /// or one of the credentials file.
    fn service_credential(&self, token: &str) -> Option<ServiceCaller> {
        let presented = credentials::digest(token);
        let from_flags = self.service_tokens.find(&presented).cloned();
        let from_file = self.credentials_file.as_ref().and_then(|(_, file)| file.load().find(&presented).cloned());
        from_flags.or(from_file).map(|credential| ServiceCaller { name: credential.name, scopes: credential.scopes })
    }

    /// The verified `sub` of a viewer token, and until when it is accepted.
    fn viewer(&self, token: &str) -> Result<ViewerCaller, ServiceError> {
        // The header's `kid` and `alg` only select among the configured keys;
        // each key then accepts its own algorithm alone.
        let Ok(header) = jsonwebtoken::decode_header(token) else {
            return Err(refused("neither a service token this server holds nor a viewer JWT"));
        };
        let jwks = self.jwks.as_ref().map(|jwks| jwks.keys.load());
        let from_jwks = jwks.as_ref().and_then(|keys| {
            keys.keys.iter().find(|key| key.kid.as_deref() == header.kid.as_deref() && key.algorithm == header.alg)
        });
        let claims = match (from_jwks, &header.kid) {
            (Some(key), _) => self.verify(token, key.algorithm, &key.key, &self.claims.validation(key.algorithm))?,
            (None, Some(_)) if self.jwks.is_some() => return Err(refused("no viewer key has the token's `kid`")),
            (None, _) => {
                let Some(key) = self.viewer_keys.iter().find(|key| key.algorithm == header.alg) else {
                    return Err(refused("no viewer key for the token's `alg`"));
                };
                self.verify(token, key.algorithm, &key.key, &key.validation)?
            }
        };
        if claims.sub.is_empty() || claims.sub.len() > MAX_ID_BYTES {
            return Err(refused("the token's `sub` is not 1 to 128 bytes"));
        }
        Ok(ViewerCaller { id: claims.sub, accepted_until: claims.exp.saturating_add(self.claims.leeway_secs) })
    }

    fn verify(
        &self,
        token: &str,
        algorithm: Algorithm,
        key: &DecodingKey,
        validation: &Validation,
    ) -> Result<ViewerClaims, ServiceError> {
        match jsonwebtoken::decode::<ViewerClaims>(token, key, validation) {
            Ok(data) => Ok(data.claims),
            Err(err) => Err(match err.kind() {
                ErrorKind::ExpiredSignature => ServiceError::Unauthenticated("credentials expired".into()),
                // The configured key itself cannot be used: the operator must hear of it.
                ErrorKind::InvalidRsaKey(_) | ErrorKind::InvalidEcdsaKey | ErrorKind::InvalidKeyFormat => {
                    tracing::warn!(?algorithm, %err, "the viewer JWT key cannot verify tokens");
                    invalid_credentials()
                }
                kind => refused(self.claims.why_refused(kind)),
            }),
        }
    }

    /// Reads the JWKS document again. `Ok(Some(kids))`: the keys changed to
    /// these, and streams opened with tokens of keys gone end (`stream.rs`);
    /// `Ok(None)`: no JWKS, or nothing changed. A failure keeps the keys in use.
    pub(crate) async fn refresh_viewer_keys(&self) -> Result<Option<Vec<String>>, String> {
        let Some(jwks) = &self.jwks else { return Ok(None) };
        let _reading = jwks.reading.lock().await;
        self.read_viewer_keys(jwks).await
    }

    /// [`Authenticator::refresh_viewer_keys`], its caller holding `reading`.
    async fn read_viewer_keys(&self, jwks: &JwksState) -> Result<Option<Vec<String>>, String> {
        let document = jwks.source.read().await?;
        if jwks.keys.load().document == document {
            return Ok(None);
        }
        let keys = jwks::parse(document)?;
        let kids = keys.kids();
        jwks.keys.store(Arc::new(keys));
        self.changes.send_modify(|changes| *changes += 1);
        Ok(Some(kids))
    }

    /// Before a call is authenticated: when its token is a JWT whose `kid`
    /// no JWKS key has, reads the document again (one read at a time, at
    /// most one per `UNKNOWN_KID_REFETCH_AFTER` after one that did not find its
    /// `kid`), so that a key the provider
    /// just published verifies its first token.
    pub(crate) async fn fetch_unknown_kid(&self, metadata: &MetadataMap) {
        let Some(jwks) = &self.jwks else { return };
        let Ok(token) = bearer_token(metadata) else { return };
        let Ok(header) = jsonwebtoken::decode_header(token) else { return };
        let Some(kid) = header.kid else { return };
        if jwks.keys.load().has(&kid) {
            return;
        }
        let mut fetches = jwks.unknown_kid.lock().await;
        let _reading = jwks.reading.lock().await;
        // Another read may have brought the kid while this one waited; a
        // fetch that found an unknown kid still unknown holds the next off.
        if jwks.keys.load().has(&kid)
            || fetches.last_miss.is_some_and(|miss| miss.elapsed() < jwks::UNKNOWN_KID_REFETCH_AFTER)
        {
            return;
        }
        let fetched = self.read_viewer_keys(jwks).await;
        if !jwks.keys.load().has(&kid) {
            fetches.last_miss = Some(std::time::Instant::now());
        }
        match fetched {
            Ok(Some(kids)) => tracing::info!(?kids, "viewer keys read again for an unknown kid; they changed"),
            Ok(None) => tracing::debug!(kid, "viewer keys read again for an unknown kid; unchanged"),
            Err(err) => tracing::error!(%err, "cannot read the viewer keys (JWKS) again; keeping the keys in use"),
        }
    }

    /// The JWKS document's source and refresh interval, with `--viewer-jwks`.
    pub(crate) fn viewer_jwks(&self) -> Option<(String, bool, std::time::Duration)> {
        self.jwks.as_ref().map(|jwks| (jwks.source.describe(), jwks.source.is_file(), jwks.refresh))
    }
}

impl JwksState {
    fn new(source: &str, ca: Option<PathBuf>, refresh: std::time::Duration) -> Result<JwksState, AuthConfigError> {
        let fail = |reason: String| AuthConfigError::Jwks { location: source.to_owned(), reason };
        let refresh = if refresh.is_zero() { std::time::Duration::from_secs(300) } else { refresh };
        let (source, keys) = if source.starts_with("https://") {
            let url: http::Uri = source.parse().map_err(|err| fail(format!("not a URL: {err}")))?;
            let files = presence_tls::ClientTlsFiles::new(ca, None, None).named(["--viewer-jwks-ca", "", ""]);
            let tls = crate::outbound::tls_config(files).map_err(|err| fail(err.to_string()))?;
            // Fetched once serving starts; until then no JWKS key verifies a token.
            (jwks::JwksSource::Url { url, tls }, jwks::JwksKeys::default())
        } else if source.contains("://") {
            return Err(fail("a JWKS URL must be https://".into()));
        } else {
            let document = std::fs::read(source).map_err(|err| fail(format!("cannot read: {err}")))?;
            (jwks::JwksSource::File(source.into()), jwks::parse(document.into()).map_err(fail)?)
        };
        Ok(JwksState {
            source,
            keys: ArcSwap::from_pointee(keys),
            refresh,
            unknown_kid: tokio::sync::Mutex::default(),
            reading: tokio::sync::Mutex::default(),
        })
    }
}

/// The service caller a client certificate names, without a token: a
/// `--tls-service-identity` or another node of the cluster, with every scope.
fn certificate_caller(certificate: &presence_tls::ClientCertificate) -> Option<Caller> {
    if !(certificate.service || certificate.cluster_node) {
        return None;
    }
    let identity = certificate.identities.first().map_or("", String::as_str);
    let kind = if certificate.cluster_node { "cluster-node" } else { "certificate" };
    Some(Caller::Service(ServiceCaller { name: format!("{kind}:{identity}").into(), scopes: Scopes::ALL }))
}

impl ViewerKey {
    fn new(algorithm: Algorithm, key: DecodingKey, claims: &ClaimRules) -> Self {
        ViewerKey { algorithm, key, validation: claims.validation(algorithm) }
    }
}

/// The claims a viewer token must carry.
#[derive(serde::Deserialize)]
struct ViewerClaims {
    /// The viewer's user id.
    sub: String,
    /// When it expires, in Unix seconds (the library checks it as well).
    exp: u64,
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

/// A token refused for `reason`: what is wrong with the token presented,
/// in terms of that token alone (its form, its claims, whether a key of its
/// `kid` or `alg` verifies it), never of the other tokens or keys there are.
fn refused(reason: &str) -> ServiceError {
    ServiceError::Unauthenticated(format!("invalid credentials: {reason}").into())
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

    /// Refused as `invalid credentials`, with a reason.
    #[track_caller]
    fn assert_invalid(result: Result<Caller, ServiceError>) {
        let status = Status::from(result.unwrap_err());
        assert_eq!(status.code(), Code::Unauthenticated, "{status:?}");
        assert!(status.message().starts_with("invalid credentials: "), "{status:?}");
    }

    #[test]
    fn open_mode_makes_everyone_a_service() {
        let auth = authenticator(AuthConfig::default());
        assert!(auth.is_open());
        assert!(auth.caller(&MetadataMap::new()).unwrap().is_service());
        assert!(auth.caller(&metadata("garbage")).unwrap().is_service());
        assert!(auth.caller(&bearer(&hs256(&valid_claims("alice")))).unwrap().is_service());
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
            assert!(auth.caller(&metadata(&value)).unwrap().is_service(), "{value:?}");
        }
    }

    #[test]
    fn both_rotated_service_tokens_work() {
        let auth = authenticator(full_config());
        for token in TEST_ONLY_SERVICE_TOKENS {
            assert!(auth.caller(&bearer(token)).unwrap().is_service());
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
        assert!(auth.caller(&bearer(&jwt)).unwrap().is_service());
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("bob")))).unwrap().viewer_id(), Some("bob"));
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
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("alice")))).unwrap().viewer_id(), Some("alice"));
        let longest = "u".repeat(MAX_ID_BYTES);
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims(&longest)))).unwrap().viewer_id(), Some(longest.as_str()));
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
        assert_eq!(lenient.caller(&bearer(&expired)).unwrap().viewer_id(), Some("alice"));
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
    fn refusals_say_what_is_wrong_with_the_token_and_nothing_of_other_tokens() {
        let auth = authenticator(full_config());
        let other = EncodingKey::from_secret(b"test-only-another-secret-of-32-bytes-or-more").unwrap();
        let refusal = |token: &str| Status::from(auth.caller(&bearer(token)).unwrap_err()).message().to_owned();
        // A service token the server does not hold reads as any other string that is not a JWT.
        let unheld = refusal("test-only-unknown-token");
        assert_eq!(unheld, "invalid credentials: neither a service token this server holds nor a viewer JWT");
        assert_eq!(refusal("a.b.c"), unheld);
        let cases = [
            (sign(Algorithm::HS256, &other, &valid_claims("alice")), "its signature does not verify"),
            (hs256(&json!({ "exp": now() + 600 })), "the token has no `sub` claim"),
            (hs256(&json!({ "sub": "alice" })), "the token has no `exp` claim (a viewer token must expire)"),
            (hs256(&json!({ "sub": "alice", "exp": now() + 600, "aud": "chat" })), "no audience is configured"),
            (hs256(&json!({ "sub": "alice", "exp": now() + 600, "nbf": now() + 300 })), "not valid yet"),
        ];
        for (token, reason) in cases {
            let said = refusal(&token);
            assert!(said.starts_with("invalid credentials: ") && said.contains(reason), "{reason}: {said}");
        }
    }

    #[test]
    fn rs256_tokens_verify_with_an_rsa_public_key() {
        let private = EncodingKey::from_rsa_pem(TEST_ONLY_RSA_PRIVATE_PEM.as_bytes()).unwrap();
        let token = sign(Algorithm::RS256, &private, &valid_claims("alice"));
        for pem in [TEST_ONLY_RSA_PUBLIC_PEM, TEST_ONLY_RSA_PUBLIC_PKCS1_PEM] {
            let auth = authenticator(public_key_config(pem));
            assert_eq!(auth.caller(&bearer(&token)).unwrap().viewer_id(), Some("alice"));
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
            auth.caller(&bearer(&sign(Algorithm::EdDSA, &private, &valid_claims("alice")))).unwrap().viewer_id(),
            Some("alice")
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
        assert_eq!(auth.caller(&bearer(&hs256(&valid_claims("alice")))).unwrap().viewer_id(), Some("alice"));
        let private = EncodingKey::from_rsa_pem(TEST_ONLY_RSA_PRIVATE_PEM.as_bytes()).unwrap();
        let rs256 = sign(Algorithm::RS256, &private, &valid_claims("bob"));
        assert_eq!(auth.caller(&bearer(&rs256)).unwrap().viewer_id(), Some("bob"));
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

    fn viewer(id: &str) -> Caller {
        Caller::Viewer(ViewerCaller { id: id.into(), accepted_until: u64::MAX })
    }

    fn service(scopes: &[Scope]) -> Caller {
        Caller::Service(ServiceCaller { name: "test-credential".into(), scopes: Scopes::of(scopes.iter().copied()) })
    }

    #[track_caller]
    fn assert_denied(result: Result<impl fmt::Debug, ServiceError>, message: &str) {
        let status = Status::from(result.unwrap_err());
        assert_eq!(status.code(), Code::PermissionDenied, "{status:?}");
        assert_eq!(status.message(), message);
    }

    #[test]
    fn viewers_act_as_themselves_whatever_viewer_id_they_send() {
        let alice = viewer("alice");
        assert_eq!(alice.acting_viewer("", "Watch").unwrap(), Some("alice".into()));
        assert_eq!(alice.acting_viewer("bob", "Watch").unwrap(), Some("alice".into()));
    }

    #[test]
    fn p6_services_act_for_the_viewer_they_name_and_true_states_need_read() {
        let reader = service(&[Scope::Read]);
        assert_eq!(reader.acting_viewer("bob", "Watch").unwrap(), Some("bob".into()));
        assert_eq!(reader.acting_viewer("", "Watch").unwrap(), None);
        let as_viewer = service(&[Scope::ReadAsViewer]);
        assert_eq!(as_viewer.acting_viewer("bob", "Snapshot").unwrap(), Some("bob".into()));
        assert_denied(
            as_viewer.acting_viewer("", "Snapshot"),
            "Snapshot needs the `read` scope; credential \"test-credential\" has read-as-viewer",
        );
        assert_denied(
            service(&[Scope::Gateway]).acting_viewer("bob", "Watch"),
            "Watch needs the `read-as-viewer` scope; credential \"test-credential\" has gateway",
        );
    }

    #[test]
    fn t3_a_call_outside_the_credentials_scopes_is_denied_naming_the_scope() {
        let gateway = service(&[Scope::Gateway]);
        assert!(gateway.require(Scope::Gateway, "Register").is_ok());
        assert_denied(
            gateway.require(Scope::Admin, "Revoke"),
            "Revoke needs the `admin` scope; credential \"test-credential\" has gateway",
        );
        assert_denied(viewer("alice").require(Scope::Gateway, "Register"), "Register: requires service credentials");
        assert!(service(&Scope::ALL).require(Scope::Cluster, "MergeGroups").is_ok());
    }

    #[test]
    fn viewers_may_act_on_themselves_only() {
        let alice = viewer("alice");
        assert!(service(&[Scope::Gateway]).require_self_or("bob", Scope::Gateway, "SetStatus").is_ok());
        assert!(service(&[Scope::Read]).require_self_or("bob", Scope::Gateway, "SetStatus").is_err());
        assert!(alice.require_self_or("alice", Scope::Gateway, "SetStatus").is_ok());
        assert_denied(
            alice.require_self_or("bob", Scope::Admin, "SetVisibility"),
            "SetVisibility: a viewer may act only on its own user id",
        );
        // Ids compare exactly: no case folding, no prefix.
        assert!(alice.require_self_or("Alice", Scope::Gateway, "SetStatus").is_err());
        assert!(alice.require_self_or("alic", Scope::Gateway, "SetStatus").is_err());
    }
}
