//! A gRPC connection for the unary workload without tonic's `Channel`.
//!
//! `Channel` puts a `tower::buffer::Buffer` in front of the connection: every call is sent
//! over a channel to a background task, which makes the request, and the answer comes
//! back over another, so each call wakes a second task (often on another thread). On a
//! machine the generator shares with the server that cost is taken from the server, and
//! the generator measured its own overhead more than the server's. Here the calls go
//! straight to hyper's HTTP/2 `SendRequest`, which is itself a cheap clonable handle to
//! one connection, as ghz's Go client and h2load do.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::client::conn::http2;
use hyper_util::rt::TokioExecutor;
use presence_tls::{ClientTls, ClientTlsFiles, TlsEndpoint};
use tonic::body::Body;
use tower_service::Service as _;

/// One HTTP/2 connection, shared by clones.
#[derive(Debug, Clone)]
pub(crate) struct DirectChannel {
    sender: http2::SendRequest<Body>,
    /// `http://host:port`, the authority every request names.
    origin: http::uri::Uri,
    /// `Bearer TOKEN`, sent with every request when presenced requires a token.
    authorization: Option<http::HeaderValue>,
}

impl DirectChannel {
    /// Connects to presenced at `endpoints` (TLS with `--tls`) with TCP_NODELAY, within 5 s.
    pub(crate) async fn connect(endpoints: &crate::conn::Endpoints) -> Result<DirectChannel, String> {
        let uri = endpoints.presenced_uri();
        let tls = match &endpoints.tls {
            Some(files) => Some(std::sync::Arc::new(
                ClientTls::load(ClientTlsFiles::new(files.ca.clone(), files.cert.clone(), files.key.clone()))
                    .map_err(|e| e.to_string())?,
            )),
            None => None,
        };
        let mut channel = DirectChannel::connect_to(&uri, tls).await?;
        if let Some(token) = &endpoints.token {
            let value =
                format!("Bearer {token}").parse().map_err(|_| "--token: not a valid header value".to_owned())?;
            channel.authorization = Some(value);
        }
        Ok(channel)
    }

    /// Connects to `uri` (`http://host:port`, or `https://` with `tls`).
    pub(crate) async fn connect_to(uri: &str, tls: Option<std::sync::Arc<ClientTls>>) -> Result<DirectChannel, String> {
        let target = TlsEndpoint::new(uri, tls, None).map_err(|e| e.to_string())?;
        let origin = target.address().clone();
        let authority = origin.authority().ok_or_else(|| format!("no host:port in {uri}"))?.to_string();
        let stream = tokio::time::timeout(Duration::from_secs(5), target.connector().call(target.dial()))
            .await
            .map_err(|_| format!("cannot connect to {authority}: timed out"))?
            .map_err(|e| format!("cannot connect to {authority}: {e}"))?;
        DirectChannel::over(stream, origin).await
    }

    /// An HTTP/2 connection over `io`, already connected (and through TLS) to `origin`.
    pub(crate) async fn over<Io>(io: Io, origin: http::uri::Uri) -> Result<DirectChannel, String>
    where
        Io: hyper::rt::Read + hyper::rt::Write + Unpin + Send + 'static,
    {
        let authority = origin.authority().map(ToString::to_string).unwrap_or_default();
        let (sender, connection) = http2::Builder::new(TokioExecutor::new())
            .handshake(io)
            .await
            .map_err(|e| format!("HTTP/2 handshake with {authority} failed: {e}"))?;
        tokio::spawn(async move {
            let _ = connection.await;
        });
        Ok(DirectChannel { sender, origin, authorization: None })
    }
}

impl tower_service::Service<http::Request<Body>> for DirectChannel {
    type Response = http::Response<Body>;
    type Error = hyper::Error;
    type Future = Pin<Box<dyn Future<Output = Result<Self::Response, Self::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.sender.poll_ready(cx)
    }

    fn call(&mut self, mut request: http::Request<Body>) -> Self::Future {
        // tonic gives a path only; HTTP/2 needs the scheme and authority too.
        let mut parts = self.origin.clone().into_parts();
        parts.path_and_query = request.uri().path_and_query().cloned();
        if let Ok(uri) = http::uri::Uri::from_parts(parts) {
            *request.uri_mut() = uri;
        }
        if let Some(authorization) = &self.authorization {
            request.headers_mut().insert(http::header::AUTHORIZATION, authorization.clone());
        }
        let response = self.sender.send_request(request);
        Box::pin(async move { Ok(response.await?.map(Body::new)) })
    }
}

#[cfg(test)]
mod tests {
    use presence_proto::v1::presence_client::PresenceClient;
    use presence_proto::v1::{RegisterRequest, RenewRequest};
    use presence_server::testing::{TestServer, fast_config};

    use super::DirectChannel;

    #[tokio::test]
    async fn unary_calls_through_one_direct_connection_are_answered_with_their_statuses() {
        let server = TestServer::start(fast_config()).await;
        let channel = DirectChannel::connect_to(&server.url(), None).await.unwrap();
        let mut client = PresenceClient::new(channel.clone());
        let registered = client
            .register(RegisterRequest {
                user_id: "u".into(),
                session_id: "s".into(),
                gateway_id: "g".into(),
                ttl_ms: 60_000,
                ..Default::default()
            })
            .await
            .unwrap()
            .into_inner();
        // A clone shares the connection, as the generator's workers do.
        let mut other = PresenceClient::new(channel);
        let renew = |generation| RenewRequest {
            user_id: "u".into(),
            session_id: "s".into(),
            generation,
            ttl_ms: 60_000,
            ..Default::default()
        };
        other.renew(renew(registered.generation)).await.unwrap();
        let refused = other.renew(renew(registered.generation + 1)).await.unwrap_err();
        assert_eq!(refused.code(), tonic::Code::NotFound, "a gRPC error arrives as the server's status: {refused:?}");
        server.stop().await;
    }

    #[tokio::test]
    async fn a_closed_port_is_a_clear_error() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        drop(listener);
        let err = DirectChannel::connect_to(&format!("http://{addr}"), None).await.unwrap_err();
        assert!(err.starts_with(&format!("cannot connect to {addr}")), "{err}");
    }
}
