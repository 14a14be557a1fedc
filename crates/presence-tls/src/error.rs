//! What can be wrong with TLS material, said with the flag and file it came from.

use std::path::PathBuf;

/// Why TLS material cannot be used. Each names the flag that gave the file
/// and the file, so a refusal at start (B7) or a failed reload says what to fix.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// A file cannot be read, or holds nothing usable.
    #[error("{flag} {}: {reason}", path.display())]
    File {
        /// The flag that named the file (`--tls-cert`).
        flag: &'static str,
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A combination of settings that cannot work.
    #[error("{0}")]
    Settings(String),
}

impl TlsError {
    pub(crate) fn file(flag: &'static str, path: &std::path::Path, reason: impl Into<String>) -> TlsError {
        TlsError::File { flag, path: path.to_owned(), reason: reason.into() }
    }
}
