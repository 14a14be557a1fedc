//! Where a client subcommand connects and what it presents: the `--addr`,
//! `--token` and `--json` flags every one of them takes, and the connection.

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use presence_client::pb::presence_client::PresenceClient;
use presence_client::{ClientError, ClientTlsConfig};
use tonic::Request;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::Channel;

use crate::exit::{CHECK_THE_SERVER, Exit, Failure};

/// How long a connection attempt may take before the server counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a unary call may take: a server that accepts but never answers
/// must not hang a script for ever. Streams (`watch`) have no such limit.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The flags every client subcommand takes.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// The server's gRPC address: HOST:PORT (plaintext), http://HOST:PORT, or
    /// https://HOST:PORT (TLS; see --ca).
    #[arg(long, env = "PRESENCED_ADDR", default_value = "127.0.0.1:50051", value_name = "ADDR")]
    addr: String,
    #[command(flatten)]
    pub(crate) tls: TlsArgs,
    #[command(flatten)]
    pub(crate) token: TokenArgs,
    /// Print JSON (the proto's field names; 64-bit integers as strings, enums
    /// by name): one document, or for `watch` and `changes` one object per line.
    #[arg(long)]
    pub(crate) json: bool,
}

/// The credential every client subcommand presents.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct TokenArgs {
    /// A service token (or a viewer's JWT), sent as `authorization: Bearer
    /// TOKEN`. A token given here shows in `ps` and the shell's history:
    /// prefer --token-file or PRESENCED_TOKEN.
    #[arg(long, env = "PRESENCED_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    token: Option<String>,
    /// A file holding the token (its first line; `presenced token new
    /// --token-file` writes one); instead of --token.
    #[arg(long, env = "PRESENCED_TOKEN_FILE", value_name = "FILE")]
    token_file: Option<PathBuf>,
}

impl TokenArgs {
    /// The token given, read from --token-file if that is how; a usage
    /// error when both are given or the file cannot be used.
    pub(crate) fn token(&self) -> Result<Option<String>, Failure> {
        let Some(path) = &self.token_file else { return Ok(self.token.clone()) };
        if self.token.is_some() {
            return Err(Failure::new(
                Exit::Usage,
                "--token-file: give the token one way: --token (or PRESENCED_TOKEN) or --token-file, not both",
            ));
        }
        let unusable = |why: String| Failure::new(Exit::Usage, format!("--token-file {}: {why}", path.display()));
        let text = std::fs::read_to_string(path).map_err(|err| unusable(format!("cannot read: {err}")))?;
        match text.lines().next().map(str::trim) {
            Some(token) if !token.is_empty() => Ok(Some(token.to_owned())),
            _ => Err(unusable("is empty; its first line is the token".to_owned())),
        }
    }

    /// The token as the `authorization` header's value, checked before anything is sent.
    pub(crate) fn authorization(&self) -> Result<Option<AsciiMetadataValue>, Failure> {
        bearer(self.token()?.as_deref())
    }
}

/// TLS to a server (`https://` addresses), for every client subcommand.
#[derive(Debug, Clone, Default, Args)]
pub(crate) struct TlsArgs {
    /// The PEM CA the server's certificate must come from [default: the
    /// system's trusted roots].
    #[arg(long, env = "PRESENCED_CA", value_name = "FILE")]
    ca: Option<PathBuf>,
    /// A PEM client certificate, for a server that requires one (mutual TLS); with --key.
    #[arg(long, env = "PRESENCED_CERT", value_name = "FILE", requires = "key")]
    cert: Option<PathBuf>,
    /// The PEM key of --cert.
    #[arg(long, env = "PRESENCED_KEY", value_name = "FILE", requires = "cert")]
    key: Option<PathBuf>,
    /// The name to verify the server's certificate for, when it is not the
    /// address's host (a server reached by IP, or through a tunnel).
    #[arg(long, env = "PRESENCED_SERVER_NAME", value_name = "NAME")]
    server_name: Option<String>,
}

impl TlsArgs {
    /// Whether any TLS setting was given.
    pub(crate) fn given(&self) -> bool {
        self.ca.is_some() || self.cert.is_some() || self.server_name.is_some()
    }

    /// The settings for an `https://` address; `None` for plaintext.
    fn config(&self, uri: &str) -> Result<Option<ClientTlsConfig>, Failure> {
        if !uri.starts_with("https://") {
            if self.given() {
                return Err(Failure::new(
                    Exit::Usage,
                    format!("--ca, --cert and --server-name need an https:// address; {uri} is plaintext"),
                ));
            }
            return Ok(None);
        }
        let config = ClientTlsConfig::from_files(self.ca.clone(), self.cert.clone(), self.key.clone())
            .map_err(|err| Failure::new(Exit::Usage, err.to_string()))?;
        Ok(Some(match &self.server_name {
            Some(name) => config.with_server_name(name.clone()),
            None => config,
        }))
    }

    /// A channel to `uri` with these settings: a usage error if they are
    /// unusable, unreachable if the server cannot be reached or refuses the handshake.
    pub(crate) async fn connect(&self, uri: &str) -> Result<Channel, Failure> {
        let tls = self.config(uri)?;
        presence_client::connect(uri, tls.as_ref()).await.map_err(|err| match err {
            ClientError::Connect { .. } => Failure::unreachable(uri, &err),
            err => Failure::new(Exit::Usage, format!("--addr {uri:?}: {err}")),
        })
    }
}

/// A connection to the server, with the credentials every call carries.
#[derive(Debug, Clone)]
pub(crate) struct Connection {
    pub(crate) client: PresenceClient<Channel>,
    /// The connection itself, for a Leases stream (`register`).
    pub(crate) channel: Channel,
    /// `Bearer TOKEN`, checked once, before anything is sent.
    authorization: Option<AsciiMetadataValue>,
    /// The token as given, for the watchers, which add it to every reopen themselves.
    pub(crate) token: Option<String>,
    /// The address connected to, as a URI.
    pub(crate) uri: String,
}

impl Connection {
    /// Connects to `target`'s address: a usage error if the address or the
    /// token is unusable, unreachable if nothing answers there.
    pub(crate) async fn open(target: &Target) -> Result<Connection, Failure> {
        let uri = endpoint_uri(&target.addr);
        let token = target.token.token()?;
        let authorization = bearer(token.as_deref())?;
        let channel = tokio::time::timeout(CONNECT_TIMEOUT, target.tls.connect(&uri)).await.map_err(|_| {
            Failure::new(
                Exit::Unreachable,
                format!("cannot reach presenced at {uri}: no answer in time; {CHECK_THE_SERVER}"),
            )
        })??;
        Ok(Connection { client: PresenceClient::new(channel.clone()), channel, authorization, token, uri })
    }

    /// `message` as a streamed call: with the credentials and no time limit
    /// (a backup of a large node takes as long as it takes).
    pub(crate) fn stream_request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        if let Some(authorization) = &self.authorization {
            request.metadata_mut().insert("authorization", authorization.clone());
        }
        request
    }

    /// `message` as a unary call: with the credentials and a time limit.
    pub(crate) fn request<T>(&self, message: T) -> Request<T> {
        let mut request = Request::new(message);
        request.set_timeout(CALL_TIMEOUT);
        if let Some(authorization) = &self.authorization {
            request.metadata_mut().insert("authorization", authorization.clone());
        }
        request
    }
}

/// A token as the `authorization` header's value, checked before anything is sent.
fn bearer(token: Option<&str>) -> Result<Option<AsciiMetadataValue>, Failure> {
    token
        .map(|token| {
            format!("Bearer {token}").parse().map_err(|_| {
                Failure::new(Exit::Usage, "--token: not a valid header value (visible ASCII characters only)")
            })
        })
        .transpose()
}

/// `--addr` as a URI: `serve --listen` takes HOST:PORT, so that is accepted
/// here too, and means plain HTTP/2 (a server with TLS is https://HOST:PORT);
/// an address without a port means presenced's, 50051.
fn endpoint_uri(addr: &str) -> String {
    let uri = if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") };
    let (scheme, rest) = uri.split_once("://").unwrap_or(("http", &uri));
    let (authority, path) = rest.split_once('/').map_or((rest, ""), |(authority, path)| (authority, path));
    // A port follows the last ':', unless that ':' is inside an IPv6 literal's brackets.
    let has_port = authority.rsplit_once(':').is_some_and(|(_, after)| !after.contains(']'));
    let bare_ipv6 = !authority.starts_with('[') && authority.matches(':').count() > 1;
    if (has_port && !bare_ipv6) || authority.is_empty() {
        return uri;
    }
    let authority = if bare_ipv6 { format!("[{authority}]") } else { authority.to_owned() };
    let path = if path.is_empty() { String::new() } else { format!("/{path}") };
    format!("{scheme}://{authority}:{DEFAULT_PORT}{path}")
}

/// The port `presenced serve` listens on unless told otherwise.
const DEFAULT_PORT: u16 = 50051;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o4_an_address_is_taken_with_or_without_its_scheme() {
        assert_eq!(endpoint_uri("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(endpoint_uri("http://presenced:50051"), "http://presenced:50051");
    }

    #[test]
    fn o4_an_address_without_a_port_means_presenceds_port() {
        assert_eq!(endpoint_uri("localhost"), "http://localhost:50051");
        assert_eq!(endpoint_uri("https://presenced.internal"), "https://presenced.internal:50051");
        assert_eq!(endpoint_uri("https://presenced.internal:443"), "https://presenced.internal:443");
        assert_eq!(endpoint_uri("[::1]"), "http://[::1]:50051");
        assert_eq!(endpoint_uri("http://[::1]:7000"), "http://[::1]:7000");
        assert_eq!(endpoint_uri("::1"), "http://[::1]:50051");
    }
}
