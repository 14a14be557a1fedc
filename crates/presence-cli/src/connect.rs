//! Where a client subcommand connects and what it presents: the `--addr`,
//! `--token` and `--json` flags every one of them takes, and the connection.

use std::time::Duration;

use clap::Args;
use presence_client::pb::presence_client::PresenceClient;
use tonic::Request;
use tonic::metadata::AsciiMetadataValue;
use tonic::transport::{Channel, Endpoint};

use crate::exit::{Exit, Failure};

/// How long a connection attempt may take before the server counts as unreachable.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a unary call may take: a server that accepts but never answers
/// must not hang a script for ever. Streams (`watch`) have no such limit.
const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// The flags every client subcommand takes.
#[derive(Debug, Clone, Args)]
pub struct Target {
    /// The server's gRPC address: HOST:PORT, with or without http://.
    #[arg(long, env = "PRESENCED_ADDR", default_value = "127.0.0.1:50051", value_name = "ADDR")]
    addr: String,
    /// A service token (or a viewer's JWT), sent as `authorization: Bearer TOKEN`.
    #[arg(long, env = "PRESENCED_TOKEN", hide_env_values = true, value_name = "TOKEN")]
    token: Option<String>,
    /// Print JSON (the proto's field names; 64-bit integers as strings, enums
    /// by name): one document, or for `watch` one object per line.
    #[arg(long)]
    pub(crate) json: bool,
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
}

impl Connection {
    /// Connects to `target`'s address: a usage error if the address or the
    /// token is unusable, unreachable if nothing answers there.
    pub(crate) async fn open(target: &Target) -> Result<Connection, Failure> {
        let uri = endpoint_uri(&target.addr);
        let endpoint = Endpoint::from_shared(uri.clone())
            .map_err(|err| Failure::new(Exit::Usage, format!("--addr {:?}: {err}", target.addr)))?
            .connect_timeout(CONNECT_TIMEOUT);
        let authorization = match &target.token {
            Some(token) => Some(format!("Bearer {token}").parse().map_err(|_| {
                Failure::new(Exit::Usage, "--token: not a valid header value (visible ASCII characters only)")
            })?),
            None => None,
        };
        let channel = endpoint.connect().await.map_err(|err| Failure::unreachable(&uri, &err))?;
        Ok(Connection {
            client: PresenceClient::new(channel.clone()),
            channel,
            authorization,
            token: target.token.clone(),
        })
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

/// `--addr` as a URI: `serve --listen` takes HOST:PORT, so that is accepted
/// here too, and means plain HTTP/2 (the server has no TLS of its own).
fn endpoint_uri(addr: &str) -> String {
    if addr.contains("://") { addr.to_owned() } else { format!("http://{addr}") }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o4_an_address_is_taken_with_or_without_its_scheme() {
        assert_eq!(endpoint_uri("127.0.0.1:50051"), "http://127.0.0.1:50051");
        assert_eq!(endpoint_uri("http://presenced:50051"), "http://presenced:50051");
    }
}
