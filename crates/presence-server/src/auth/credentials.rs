//! The credentials file (`--credentials FILE`, T3): named service credentials,
//! each with its scopes and the SHA-256 of its token.
//!
//! ```toml
//! [[credential]]
//! name = "gateway-eu-1"
//! scopes = ["gateway"]
//! token_sha256 = "3b0c…"   # 64 hex digits
//! ```
//!
//! Only hashes are stored, so the file (and a backup, a crash dump, a
//! `ps` listing) never holds a usable token. A plain SHA-256 is enough: the
//! tokens `presenced token new` makes are 256 random bits, so there is no
//! dictionary to try and no search shorter than 2^256; a slow password hash
//! (bcrypt, Argon2) protects low-entropy secrets and would only add
//! milliseconds to every call. Tokens are compared as digests, in constant
//! time.

use std::path::{Path, PathBuf};

use sha2::{Digest, Sha256};
use subtle::{Choice, ConstantTimeEq};

use crate::auth::scopes::{Scope, Scopes};

/// Prefix of the tokens `presenced token new` makes, so that a secret
/// scanner (or a person) can tell one in a log or a commit.
pub const TOKEN_PREFIX: &str = "pdt_";

/// Longest credential name, in bytes.
const MAX_NAME_BYTES: usize = 64;

/// Most credentials one file may hold: each call compares its token with every one.
const MAX_CREDENTIALS: usize = 1024;

/// A named service credential.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ServiceCredential {
    /// Its name: in audit records and refusals, never a secret.
    pub(crate) name: std::sync::Arc<str>,
    pub(crate) scopes: Scopes,
    /// The SHA-256 of its token.
    pub(crate) digest: [u8; 32],
}

/// Every credential of one reading of the file (or of the `--service-token` list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct CredentialSet {
    credentials: Vec<ServiceCredential>,
}

/// Why the credentials file cannot be used; one line, naming the entry and the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("--credentials {}: {reason}", path.display())]
pub struct CredentialsError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong, naming the credential (by position and name) and the field.
    pub reason: String,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct FileFormat {
    #[serde(default, rename = "credential")]
    credentials: Vec<Entry>,
}

#[derive(serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct Entry {
    name: String,
    scopes: Vec<String>,
    token_sha256: String,
}

impl CredentialSet {
    /// The `--service-token` tokens: every scope, named `service-token-1`, `-2`...
    pub(crate) fn of_service_tokens(tokens: &[String]) -> CredentialSet {
        let credentials = tokens
            .iter()
            .enumerate()
            .map(|(index, token)| ServiceCredential {
                name: format!("service-token-{}", index + 1).into(),
                scopes: Scopes::ALL,
                digest: digest(token),
            })
            .collect();
        CredentialSet { credentials }
    }

    /// Reads and checks the file at `path`.
    pub(crate) fn read(path: &Path) -> Result<CredentialSet, CredentialsError> {
        let fail = |reason: String| CredentialsError { path: path.to_owned(), reason };
        let text = std::fs::read_to_string(path).map_err(|err| fail(format!("cannot read: {err}")))?;
        CredentialSet::parse(&text).map_err(fail)
    }

    /// Parses and checks the text of a credentials file.
    pub(crate) fn parse(text: &str) -> Result<CredentialSet, String> {
        // A token appended with its entry (`token new ... >> file` of an
        // older version printed both) is the one secret the file must never
        // hold: said as such, not as TOML's complaint about a bare key.
        if let Some(line) = text.lines().position(|line| line.trim().starts_with(TOKEN_PREFIX)) {
            return Err(format!(
                "line {}: is a token, not an entry: remove it from this file and give it to the caller; \
                 the file holds only each token's SHA-256 (`presenced token new` prints the entry on stdout)",
                line + 1
            ));
        }
        let file: FileFormat = toml::from_str(text).map_err(|err| format!("not a credentials file: {err}"))?;
        if file.credentials.len() > MAX_CREDENTIALS {
            return Err(format!("{} credentials, more than the limit of {MAX_CREDENTIALS}", file.credentials.len()));
        }
        let mut credentials: Vec<ServiceCredential> = Vec::with_capacity(file.credentials.len());
        for (index, entry) in file.credentials.into_iter().enumerate() {
            let at = format!("credential #{} ({:?})", index + 1, entry.name);
            let name = entry.name.as_str();
            if name.is_empty()
                || name.len() > MAX_NAME_BYTES
                || !name.bytes().all(|byte| byte.is_ascii_alphanumeric() || b"._-".contains(&byte))
            {
                return Err(format!("{at}: name: must be 1 to {MAX_NAME_BYTES} letters, digits, '.', '_' or '-'"));
            }
            if credentials.iter().any(|credential| &*credential.name == name) {
                return Err(format!("{at}: name: another credential has this name"));
            }
            let mut scopes = Vec::with_capacity(entry.scopes.len());
            for scope in &entry.scopes {
                let Some(scope) = Scope::parse(scope) else {
                    let known: Vec<&str> = Scope::ALL.iter().map(|scope| scope.name()).collect();
                    return Err(format!("{at}: scopes: unknown scope {scope:?}; the scopes are {}", known.join(", ")));
                };
                scopes.push(scope);
            }
            if scopes.is_empty() {
                return Err(format!("{at}: scopes: empty; a credential needs at least one scope"));
            }
            let digest = parse_digest(&entry.token_sha256).ok_or_else(|| {
                format!(
                    "{at}: token_sha256: must be 64 hex digits (the SHA-256 of the token; see `presenced token new`)"
                )
            })?;
            if credentials.iter().any(|credential| credential.digest == digest) {
                return Err(format!("{at}: token_sha256: another credential has the same token"));
            }
            credentials.push(ServiceCredential { name: name.into(), scopes: Scopes::of(scopes), digest });
        }
        Ok(CredentialSet { credentials })
    }

    /// The credential whose token has SHA-256 `presented`, compared with
    /// every one in constant time, so that the time taken tells neither
    /// which matched nor how much of a digest did.
    pub(crate) fn find(&self, presented: &[u8; 32]) -> Option<&ServiceCredential> {
        let mut found = None;
        for credential in &self.credentials {
            let matched: Choice = credential.digest[..].ct_eq(&presented[..]);
            if bool::from(matched) {
                found = Some(credential);
            }
        }
        found
    }

    pub(crate) fn len(&self) -> usize {
        self.credentials.len()
    }

    pub(crate) fn is_empty(&self) -> bool {
        self.credentials.is_empty()
    }

    /// The names in `self` and not in `other`.
    pub(crate) fn names_missing_from(&self, other: &CredentialSet) -> Vec<String> {
        self.credentials
            .iter()
            .filter(|credential| !other.credentials.iter().any(|theirs| theirs.name == credential.name))
            .map(|credential| credential.name.to_string())
            .collect()
    }
}

/// The SHA-256 of a token.
pub(crate) fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

fn parse_digest(hex: &str) -> Option<[u8; 32]> {
    let hex = hex.as_bytes();
    if hex.len() != 64 {
        return None;
    }
    let mut digest = [0u8; 32];
    for (byte, pair) in digest.iter_mut().zip(hex.chunks_exact(2)) {
        let pair = std::str::from_utf8(pair).ok()?;
        *byte = u8::from_str_radix(pair, 16).ok()?;
    }
    Some(digest)
}

fn to_hex(bytes: &[u8]) -> String {
    bytes.iter().map(|byte| format!("{byte:02x}")).collect()
}

/// A fresh token: [`TOKEN_PREFIX`] and 256 bits from the operating system's
/// random source, in hex.
pub fn new_token() -> Result<String, std::io::Error> {
    let mut bytes = [0u8; 32];
    getrandom::fill(&mut bytes).map_err(|err| std::io::Error::other(err.to_string()))?;
    Ok(format!("{TOKEN_PREFIX}{}", to_hex(&bytes)))
}

/// The credentials file entry for `token`: its name, scopes and hash.
pub fn entry_for(name: &str, scopes: &[Scope], token: &str) -> Result<String, String> {
    let names: Vec<String> = scopes.iter().map(|scope| format!("{:?}", scope.name())).collect();
    let entry = format!(
        "[[credential]]\nname = {name:?}\nscopes = [{}]\ntoken_sha256 = \"{}\"\n",
        names.join(", "),
        to_hex(&digest(token))
    );
    // The entry must read back as written.
    CredentialSet::parse(&entry).map(|_| entry)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_new_token_is_256_random_bits_with_a_prefix() {
        let (one, two) = (new_token().unwrap(), new_token().unwrap());
        assert!(one.starts_with(TOKEN_PREFIX) && one.len() == TOKEN_PREFIX.len() + 64, "{one}");
        assert_ne!(one, two);
    }

    /// A token appended to the file with its entry is named as one, by its line.
    #[test]
    fn a_token_in_the_file_is_refused_as_a_token_naming_its_line() {
        let token = new_token().unwrap();
        let entry = entry_for("gateway-eu-1", &[Scope::Gateway], &token).unwrap();
        let refused = CredentialSet::parse(&format!("# gateways\n{token}\n{entry}")).err().unwrap();
        assert!(refused.starts_with("line 2: is a token, not an entry"), "{refused}");
        assert!(!refused.contains(&token[TOKEN_PREFIX.len()..]), "the refusal does not echo the secret: {refused}");
    }

    #[test]
    fn an_entry_reads_back_as_the_credential_it_names() {
        let token = new_token().unwrap();
        let entry = entry_for("gateway-eu-1", &[Scope::Gateway, Scope::Read], &token).unwrap();
        assert!(!entry.contains(&token), "the entry holds the hash, never the token");
        let set = CredentialSet::parse(&entry).unwrap();
        let found = set.find(&digest(&token)).unwrap();
        assert_eq!(&*found.name, "gateway-eu-1");
        assert_eq!(found.scopes, Scopes::of([Scope::Gateway, Scope::Read]));
        assert!(set.find(&digest("another token")).is_none());
    }

    #[test]
    fn bad_files_are_refused_naming_the_entry_and_field() {
        let hash = "a".repeat(64);
        let cases = [
            ("[[credential]]\nname = \"a\"\nscopes = [\"gateway\"]\n", "missing field `token_sha256`"),
            (
                &format!("[[credential]]\nname = \"a b\"\nscopes = [\"gateway\"]\ntoken_sha256 = \"{hash}\"\n"),
                "credential #1 (\"a b\"): name:",
            ),
            (
                &format!("[[credential]]\nname = \"a\"\nscopes = [\"adminn\"]\ntoken_sha256 = \"{hash}\"\n"),
                "credential #1 (\"a\"): scopes: unknown scope \"adminn\"",
            ),
            (&format!("[[credential]]\nname = \"a\"\nscopes = []\ntoken_sha256 = \"{hash}\"\n"), "scopes: empty"),
            (
                "[[credential]]\nname = \"a\"\nscopes = [\"read\"]\ntoken_sha256 = \"abc\"\n",
                "token_sha256: must be 64 hex",
            ),
            (
                &format!(
                    "[[credential]]\nname = \"a\"\nscopes = [\"read\"]\ntoken_sha256 = \"{hash}\"\n\
                     [[credential]]\nname = \"a\"\nscopes = [\"read\"]\ntoken_sha256 = \"{}\"\n",
                    "b".repeat(64)
                ),
                "credential #2 (\"a\"): name: another credential has this name",
            ),
            (
                &format!(
                    "[[credential]]\nname = \"a\"\nscopes = [\"read\"]\ntoken_sha256 = \"{hash}\"\n\
                     [[credential]]\nname = \"b\"\nscopes = [\"read\"]\ntoken_sha256 = \"{hash}\"\n"
                ),
                "credential #2 (\"b\"): token_sha256: another credential has the same token",
            ),
            (
                &format!("[[credential]]\nname = \"a\"\nscope = [\"read\"]\ntoken_sha256 = \"{hash}\"\n"),
                "unknown field `scope`",
            ),
        ];
        for (text, expected) in cases {
            let err = CredentialSet::parse(text).unwrap_err();
            assert!(err.contains(expected), "{err:?} should contain {expected:?}");
            assert!(!err.contains('\n') || err.starts_with("not a credentials file"), "{err:?}");
        }
        assert!(CredentialSet::parse("").unwrap().is_empty(), "an empty file holds no credential");
    }

    #[test]
    fn service_tokens_hold_every_scope() {
        let set = CredentialSet::of_service_tokens(&["one".into(), "two".into()]);
        let found = set.find(&digest("two")).unwrap();
        assert_eq!((&*found.name, found.scopes), ("service-token-2", Scopes::ALL));
    }
}
