//! The audit log (P7): one JSON object per privileged call.
//!
//! Every privileged call (Revoke, SetVisibility, Grant/RevokeAudience,
//! Join/LeaveGroup, SetRoomAccess, PutSetting, ExportUser, EraseUser, slot
//! moves) and every change of the credentials file is recorded, refused or
//! not, as one line:
//!
//! ```json
//! {"time":"2026-12-05T17:50:01.123Z","action":"Revoke","credential":"ops-admin","peer":"10.0.0.7:50312","args":{"user_id":"u1","session_id":""},"result":"OK"}
//! ```
//!
//! `credential` is the caller's credential name (a viewer's user id for a
//! viewer acting on itself, `unauthenticated` when none was accepted);
//! `result` is the gRPC code name, with `message` beside it when the call was
//! refused; `forwarded` is true on the node that answered a call another
//! node of the cluster passed on. A record never holds a token or a setting's
//! value. Lines go to the tracing target `presenced::audit` (at INFO), and,
//! with `--audit-log FILE`, are appended to that file as well, flushed line
//! by line; SIGHUP opens the file again, for log rotation.

use std::io::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use parking_lot::Mutex;
use serde_json::{Value, json};
use tonic::{Code, Status};

use crate::auth::{Authenticator, ConnectionInfo};

/// The tracing target of audit lines.
pub(crate) const AUDIT_TARGET: &str = "presenced::audit";

/// The metadata a node adds to a request it forwards to another node: that
/// node answers for its own users only and forwards nothing. Named here, as
/// a record's `forwarded`, for the cluster's forwarding to use.
pub(crate) const FORWARDED: &str = "presenced-forwarded";

/// Where audit lines go.
#[derive(Debug, Default)]
pub(crate) struct Audit {
    file: Option<(PathBuf, Mutex<std::fs::File>)>,
}

/// Why the audit log cannot be opened.
#[derive(Debug, thiserror::Error)]
#[error("--audit-log {}: {source}", path.display())]
pub struct AuditLogError {
    /// The file.
    pub path: PathBuf,
    /// The error opening it.
    pub source: std::io::Error,
}

/// A privileged call being made: who, from where, with what.
pub(crate) struct AuditEntry<'a> {
    audit: &'a Audit,
    action: &'static str,
    credential: String,
    peer: Option<SocketAddr>,
    forwarded: bool,
    args: Value,
}

impl Audit {
    /// Lines to the tracing target, and appended to `file` when given.
    pub(crate) fn open(file: Option<&Path>) -> Result<Audit, AuditLogError> {
        let Some(path) = file else { return Ok(Audit::default()) };
        let opened = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .map_err(|source| AuditLogError { path: path.to_owned(), source })?;
        Ok(Audit { file: Some((path.to_owned(), Mutex::new(opened))) })
    }

    /// Whether lines also go to a file.
    pub(crate) fn has_file(&self) -> bool {
        self.file.is_some()
    }

    /// Opens the file again, by its path (on SIGHUP): after a log rotation
    /// renamed it, lines go to the new file rather than the renamed one.
    pub(crate) fn reopen(&self) {
        let Some((path, file)) = &self.file else { return };
        match std::fs::OpenOptions::new().create(true).append(true).open(path) {
            Ok(reopened) => *file.lock() = reopened,
            Err(err) => {
                tracing::error!(path = %path.display(), %err, "cannot reopen the audit log; writing to the old file")
            }
        }
    }

    /// The entry of `action` made by the caller of `request`, with `args`.
    pub(crate) fn entry<'a, T>(
        &'a self,
        auth: &Authenticator,
        request: &tonic::Request<T>,
        action: &'static str,
        args: Value,
    ) -> AuditEntry<'a> {
        let credential = auth.caller_of(request).map_or_else(|_| "unauthenticated".to_owned(), |c| c.name().to_owned());
        let peer = ConnectionInfo::of(request).and_then(|info| info.peer).or_else(|| request.remote_addr());
        let forwarded = request.metadata().contains_key(FORWARDED);
        AuditEntry { audit: self, action, credential, peer, forwarded, args }
    }

    /// Records a change made by the server itself (`credential` is `presenced`).
    pub(crate) fn server_event(&self, action: &'static str, args: Value) {
        let entry =
            AuditEntry { audit: self, action, credential: "presenced".into(), peer: None, forwarded: false, args };
        entry.write(Code::Ok, None);
    }
}

impl AuditEntry<'_> {
    /// Records the call with its outcome and hands the outcome back.
    pub(crate) fn done<R, E>(self, result: Result<R, E>) -> Result<R, E>
    where
        for<'e> &'e E: Into<StatusView>,
    {
        match &result {
            Ok(_) => self.write(Code::Ok, None),
            Err(err) => {
                let view: StatusView = err.into();
                self.write(view.code, Some(view.message));
            }
        }
        result
    }

    fn write(self, code: Code, message: Option<String>) {
        let mut record = json!({
            "time": now_rfc3339(),
            "action": self.action,
            "credential": self.credential,
            "peer": self.peer.map(|peer| peer.to_string()),
            "args": self.args,
            "result": code_name(code),
        });
        if let Some(message) = message {
            record["message"] = Value::String(message);
        }
        if self.forwarded {
            record["forwarded"] = Value::Bool(true);
        }
        let line = record.to_string();
        tracing::info!(target: AUDIT_TARGET, "{line}");
        if let Some((path, file)) = &self.audit.file {
            let mut file = file.lock();
            if let Err(err) = writeln!(file, "{line}").and_then(|()| file.flush()) {
                tracing::error!(path = %path.display(), %err, "cannot write the audit log");
            }
        }
    }
}

/// A refusal's code and message, whichever type carries it.
pub(crate) struct StatusView {
    code: Code,
    message: String,
}

impl From<&Status> for StatusView {
    fn from(status: &Status) -> Self {
        StatusView { code: status.code(), message: status.message().to_owned() }
    }
}

impl From<&crate::error::ServiceError> for StatusView {
    fn from(err: &crate::error::ServiceError) -> Self {
        StatusView { code: err.code(), message: err.to_string() }
    }
}

/// The code's name as gRPC spells it (`PERMISSION_DENIED`).
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "OK",
        Code::Cancelled => "CANCELLED",
        Code::Unknown => "UNKNOWN",
        Code::InvalidArgument => "INVALID_ARGUMENT",
        Code::DeadlineExceeded => "DEADLINE_EXCEEDED",
        Code::NotFound => "NOT_FOUND",
        Code::AlreadyExists => "ALREADY_EXISTS",
        Code::PermissionDenied => "PERMISSION_DENIED",
        Code::ResourceExhausted => "RESOURCE_EXHAUSTED",
        Code::FailedPrecondition => "FAILED_PRECONDITION",
        Code::Aborted => "ABORTED",
        Code::OutOfRange => "OUT_OF_RANGE",
        Code::Unimplemented => "UNIMPLEMENTED",
        Code::Internal => "INTERNAL",
        Code::Unavailable => "UNAVAILABLE",
        Code::DataLoss => "DATA_LOSS",
        Code::Unauthenticated => "UNAUTHENTICATED",
    }
}

fn now_rfc3339() -> String {
    let now = time::OffsetDateTime::now_utc();
    let format =
        time::macros::format_description!("[year]-[month]-[day]T[hour]:[minute]:[second].[subsecond digits:3]Z");
    now.format(&format).unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_is_one_json_line_without_the_token() {
        let dir = std::env::temp_dir().join(format!("presenced-audit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.log");
        let audit = Audit::open(Some(&path)).unwrap();
        let auth = Authenticator::new(crate::AuthConfig {
            service_tokens: vec!["test-only-audit-token".into()],
            ..crate::AuthConfig::default()
        })
        .unwrap();
        let mut request = tonic::Request::new(());
        request.metadata_mut().insert("authorization", "Bearer test-only-audit-token".parse().unwrap());
        let entry = audit.entry(&auth, &request, "Revoke", json!({ "user_id": "u1" }));
        let _ = entry.done::<(), Status>(Err(Status::not_found("no live lease")));
        let entry = audit.entry(&auth, &tonic::Request::new(()), "Revoke", json!({ "user_id": "u2" }));
        let _ = entry.done::<(), Status>(Ok(()));
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(!text.contains("test-only-audit-token"), "{text}");
        let lines: Vec<Value> = text.lines().map(|line| serde_json::from_str(line).unwrap()).collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(lines[0]["action"], "Revoke");
        assert_eq!(lines[0]["credential"], "service-token-1");
        assert_eq!(lines[0]["args"]["user_id"], "u1");
        assert_eq!(lines[0]["result"], "NOT_FOUND");
        assert_eq!(lines[0]["message"], "no live lease");
        assert_eq!(lines[1]["credential"], "unauthenticated");
        assert_eq!(lines[1]["result"], "OK");
        assert!(lines[1].get("message").is_none());
        let time = lines[0]["time"].as_str().unwrap();
        assert!(time.len() == 24 && time.ends_with('Z'), "{time}");
    }

    #[test]
    fn a_reopen_after_a_rotation_writes_to_the_new_file() {
        let dir = std::env::temp_dir().join(format!("presenced-audit-rotation-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("audit.log");
        let audit = Audit::open(Some(&path)).unwrap();
        audit.server_event("ReloadCredentials", json!({ "n": 1 }));
        std::fs::rename(&path, dir.join("audit.log.1")).unwrap();
        audit.reopen();
        audit.server_event("ReloadCredentials", json!({ "n": 2 }));
        let rotated = std::fs::read_to_string(dir.join("audit.log.1")).unwrap();
        let current = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(rotated.contains("\"n\":1") && !rotated.contains("\"n\":2"), "{rotated}");
        assert!(current.contains("\"n\":2") && current.lines().count() == 1, "{current}");
    }
}
