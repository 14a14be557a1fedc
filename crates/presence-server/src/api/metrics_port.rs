//! The metrics port: Prometheus text at `/metrics`, and the probes an
//! orchestrator calls, `/livez` and `/readyz` (D2: 200 when true, 503 when
//! not; see [`readiness`](super::readiness)), over TLS when the service port
//! has it (T1), with the same certificate, rotated with it.
//!
//! A scraper is one trusted process, so the port keeps only what protects
//! the server: at most [`CONNECTIONS`] connections at once (more are closed
//! at accept), and a TLS handshake deadline.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::Full;
use hyper::{Request, Response, StatusCode};
use hyper_util::rt::{TokioExecutor, TokioIo};
use presence_tls::ServerTls;

use super::readiness::{self, Readiness};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::Semaphore;

/// Connections the metrics port serves at once.
const CONNECTIONS: usize = 64;

/// What renders the metrics text.
pub type RenderMetrics = Arc<dyn Fn() -> String + Send + Sync>;

/// What the metrics port answers from: the metrics' renderer and the
/// node's readiness.
#[derive(Clone)]
pub(crate) struct Answers {
    /// Renders `/metrics`.
    pub(crate) render: RenderMetrics,
    /// What `/readyz` reports.
    pub(crate) readiness: Arc<Readiness>,
}

/// Serves `answers` on `listener` for as long as the process runs; a TLS
/// handshake must end within `handshake_timeout`.
pub(crate) async fn serve(
    listener: TcpListener,
    answers: Answers,
    tls: Option<Arc<ServerTls>>,
    handshake_timeout: Duration,
) {
    let places = Arc::new(Semaphore::new(CONNECTIONS));
    loop {
        let (stream, _) = match listener.accept().await {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "cannot accept a metrics connection");
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        let Ok(place) = Arc::clone(&places).try_acquire_owned() else { continue };
        let (answers, tls) = (answers.clone(), tls.clone());
        tokio::spawn(async move {
            let _place = place;
            serve_connection(stream, answers, tls, handshake_timeout).await;
        });
    }
}

async fn serve_connection(stream: TcpStream, answers: Answers, tls: Option<Arc<ServerTls>>, timeout: Duration) {
    let service = hyper::service::service_fn(move |request: Request<hyper::body::Incoming>| {
        let answers = answers.clone();
        async move { Ok::<_, Infallible>(answer(&request, &answers)) }
    });
    let http = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
    let served = match tls {
        None => http.serve_connection(TokioIo::new(stream), service).await,
        Some(_) if !speaks_tls(&stream, timeout).await => {
            // curl http:// (a scraper set up without TLS): told in HTTP/1 what
            // to change, as the service port tells it, not a raw TLS alert.
            let mut stream = stream;
            let _ = tokio::io::AsyncWriteExt::write_all(&mut stream, &super::connections::http1_tls_required()).await;
            return;
        }
        Some(tls) => match tokio::time::timeout(timeout, tls.current().acceptor().accept(stream)).await {
            Ok(Ok(stream)) => http.serve_connection(TokioIo::new(stream), service).await,
            Ok(Err(err)) => return tracing::debug!(%err, "metrics port: TLS handshake failed"),
            Err(_) => return tracing::debug!("metrics port: TLS handshake timed out"),
        },
    };
    if let Err(err) = served {
        tracing::debug!(%err, "metrics connection ended with an error");
    }
}

/// Whether the client's first byte, within `timeout`, starts a TLS
/// handshake; a client that sends nothing in time is left to the handshake's
/// own deadline.
async fn speaks_tls(stream: &TcpStream, timeout: Duration) -> bool {
    let mut first = [0u8; 1];
    match tokio::time::timeout(timeout, stream.peek(&mut first)).await {
        Ok(Ok(1)) => first[0] == super::connections::TLS_HANDSHAKE_RECORD,
        _ => true,
    }
}

fn answer(request: &Request<hyper::body::Incoming>, answers: &Answers) -> Response<Full<Bytes>> {
    let (status, content_type, body) = match request.uri().path() {
        "/metrics" | "/" => (StatusCode::OK, "text/plain; version=0.0.4", (answers.render)()),
        "/livez" => (StatusCode::OK, "text/plain", readiness::ALIVE.to_owned()),
        "/readyz" => {
            let (ready, report) = answers.readiness.report();
            let status = if ready { StatusCode::OK } else { StatusCode::SERVICE_UNAVAILABLE };
            (status, "text/plain", report)
        }
        _ => (
            StatusCode::NOT_FOUND,
            "text/plain",
            "not found: metrics are at /metrics, probes at /livez and /readyz\n".to_owned(),
        ),
    };
    Response::builder()
        .status(status)
        .header(http::header::CONTENT_TYPE, content_type)
        .body(Full::new(Bytes::from(body)))
        .expect("a static response")
}
