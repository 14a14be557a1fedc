//! How a client subcommand ends: its exit status, and the one table from
//! gRPC codes to those statuses, so that every subcommand means the same by
//! each number.

use std::error::Error;

use tonic::{Code, Status};

/// What the exit statuses mean, for `--help` and docs/guide.md.
pub const EXIT_CODES: &str = "\
Exit status of the client commands (get, watch, changes, sessions, revoke, room, stats, export, erase,
backup, register, cluster status, cluster backup):
  0  success (a user never seen is OFFLINE at version 0, a room never used is empty:
     both are answers, not errors; an interrupted watch, changes or register also exits 0)
  1  not found: revoke found no session to revoke, or the server answered NOT_FOUND
     (a room the token may not read)
  2  usage error (unknown flag, missing argument, unusable --addr, --token, --token-file, --from or
     --cursor-file)
  3  cannot reach the server (or, for cluster status and backup, etcd), or it is unavailable
     (UNAVAILABLE, DEADLINE_EXCEEDED)
  4  unauthenticated or permission denied (a missing or bad token, a viewer token
     for a service-only command)
  5  invalid argument (the server answered INVALID_ARGUMENT, naming the field), or for changes a
     cursor the feed no longer retains (OUT_OF_RANGE; the message gives the oldest cursor)
  6  any other failure (the message says which)";

/// What an unreachable server's refusal adds: how to check it.
pub(crate) const CHECK_THE_SERVER: &str = "is `presenced serve` running there? It prints the address it listens on \
     when it starts (--addr or PRESENCED_ADDR say where to look)";

/// What a presenced TLS port answers a plaintext HTTP/2 client with (in
/// its GOAWAY), as `api/connections.rs` words it.
const TLS_PORT_SAYS: &str = "this port speaks TLS";

/// An exit status of a client subcommand.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Exit {
    NotFound = 1,
    Usage = 2,
    Unreachable = 3,
    Denied = 4,
    Invalid = 5,
    Failed = 6,
}

/// Why a subcommand failed: the status it exits with and the one line it prints.
#[derive(Debug)]
pub(crate) struct Failure {
    pub(crate) exit: Exit,
    pub(crate) message: String,
}

impl Failure {
    pub(crate) fn new(exit: Exit, message: impl Into<String>) -> Self {
        Failure { exit, message: message.into() }
    }

    /// The server at `addr` could not be reached at all.
    pub(crate) fn unreachable(addr: &str, err: &(dyn Error + 'static)) -> Self {
        Failure::new(
            Exit::Unreachable,
            match certificate_refused(&causes(err)) {
                Some(why) => format!("cannot reach presenced at {addr}: {why} ({})", causes(err)),
                None => format!("cannot reach presenced at {addr}: {}; {CHECK_THE_SERVER}", causes(err)),
            },
        )
    }

    /// The server's refusal (or the transport's, as a status) of a call.
    pub(crate) fn status(status: &Status) -> Self {
        let exit = match status.code() {
            Code::NotFound => Exit::NotFound,
            Code::InvalidArgument | Code::OutOfRange => Exit::Invalid,
            Code::Unauthenticated | Code::PermissionDenied => Exit::Denied,
            Code::Unavailable | Code::DeadlineExceeded => Exit::Unreachable,
            _ => Exit::Failed,
        };
        let mut message = format!("{:?}: {}", status.code(), status.message());
        if let Some(source) = status.source() {
            message = format!("{message}: {}", causes(source));
        }
        // A plaintext call to a TLS port: the server says so in the HTTP/2
        // refusal that ends the connection; the call never reached it.
        if message.contains(TLS_PORT_SAYS) {
            return Failure::new(
                Exit::Unreachable,
                "cannot reach presenced over plaintext: this port speaks TLS: use an https:// --addr and --ca",
            );
        }
        if status.code() == Code::Unauthenticated && status.message().starts_with("missing credentials") {
            message.push_str(" (give a token with --token, --token-file or PRESENCED_TOKEN)");
        }
        Failure::new(exit, message)
    }
}

impl From<Status> for Failure {
    fn from(status: Status) -> Self {
        Failure::status(&status)
    }
}

/// An error and its causes in one line: a transport error's own message says
/// little ("transport error") without the cause beneath it.
/// What a refused server certificate means, in words, when `causes` (the
/// TLS library's chain of errors) says which refusal it was: the server
/// answered, and running it again will not help.
fn certificate_refused(causes: &str) -> Option<&'static str> {
    let said: [(&[&str], &str); 5] = [
        (
            &["not valid for name", "NotValidForName"],
            "the server's certificate does not cover the host dialled: dial a name or address it covers, or \
             give the one it covers with --server-name",
        ),
        (
            &["UnknownIssuer", "BadSignature"],
            "the server's certificate is not from the CA given with --ca (without --ca, the system's trusted \
             roots): give the CA that issued it",
        ),
        (&["certificate expired", "Expired"], "the server's certificate has expired"),
        (
            &["certificate not valid yet", "NotValidYet"],
            "the server's certificate is not valid yet (or this machine's clock is behind)",
        ),
        (
            &["UnsupportedCertVersion"],
            "the server's certificate is X.509 v1, which TLS clients refuse: it needs v3 (docs/security.md)",
        ),
    ];
    said.into_iter()
        .find(|(rustls_says, _)| rustls_says.iter().any(|says| causes.contains(says)))
        .map(|(_, words)| words)
}

fn causes(err: &(dyn Error + 'static)) -> String {
    let mut line = err.to_string();
    let mut source = err.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line = format!("{line}: {text}");
        }
        source = cause.source();
    }
    line
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o4_each_refusal_has_the_exit_status_a_script_expects() {
        let exit = |code: Code| Failure::status(&Status::new(code, "x")).exit;
        assert_eq!(exit(Code::NotFound), Exit::NotFound);
        assert_eq!(exit(Code::InvalidArgument), Exit::Invalid);
        assert_eq!(exit(Code::Unauthenticated), Exit::Denied);
        assert_eq!(exit(Code::PermissionDenied), Exit::Denied);
        assert_eq!(exit(Code::Unavailable), Exit::Unreachable);
        assert_eq!(exit(Code::Internal), Exit::Failed);
        assert_eq!(Exit::Usage as u8, 2, "clap's own usage status");
    }
}
