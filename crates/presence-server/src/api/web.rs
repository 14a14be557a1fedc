//! The service's port as a browser sees it (contract O5, and the serving
//! half of O4): gRPC-Web, JSON over HTTP, CORS for pages served from other
//! origins, and the console's static files, beside plain gRPC.
//!
//! [`Front`] is the one service every connection is served with. It sorts
//! each request by its content type and path before anything else looks at it:
//!
//! | request | goes to |
//! |---|---|
//! | `application/grpc…` over HTTP/2 | the routes, untouched: gateways pay one header lookup and nothing else |
//! | `application/grpc-web…` (any HTTP version), a CORS preflight, gRPC over HTTP/1 | tower-http's CORS layer, then tonic-web's translation, then the same routes |
//! | `application/json` (JSON over HTTP, the Connect protocol's unary form) | the same CORS layer, then [`super::connect`]'s translation, then the same routes |
//! | `GET /openapi.json` | the OpenAPI document of JSON over HTTP |
//! | `/console`, `/console/…` | the console's files, built into the binary |
//! | anything else | 404 |
//!
//! So a call over gRPC-Web or JSON reaches the very handlers a gRPC call does, with
//! the same credentials, limits and statuses. What it must not do: read
//! anything from disk at run time (the console's files are `include_bytes!`
//! of `console/` beside this crate's manifest), or answer a request that is
//! neither gRPC, JSON, the OpenAPI document nor the console with anything but a 404.

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::LazyLock;
use std::task::{Context, Poll, ready};
use std::time::Duration;

use bytes::Bytes;
use http::header::{self, HeaderName, HeaderValue};
use http::{Method, Request, Response, StatusCode, Version};
use http_body_util::Full;
use sha2::Digest as _;
use tonic::body::Body;
use tonic::service::Routes;
use tower_http::cors::{AllowOrigin, Cors, CorsLayer};
use tower_layer::Layer as _;
use tower_service::Service;

use super::connect::{self, ConnectJson};
use crate::ServeError;

/// The console's files, named by their path under `console/`. Adding a file
/// to the console is one line here; a unit test fails if a file in the
/// directory is missing from this list.
macro_rules! console_files {
    ($($name:literal),* $(,)?) => {
        &[$(($name, include_bytes!(concat!(env!("CARGO_MANIFEST_DIR"), "/console/", $name)))),*]
    };
}

/// Every file of the console, as built into the binary.
const CONSOLE_FILES: &[(&str, &[u8])] = console_files!["index.html", "console.css", "app.js"];

/// Where the console lives on the port.
const CONSOLE_PATH: &str = "/console";

/// How long a browser may reuse a preflight's answer before asking again:
/// a page's first call after that costs one more round trip.
const PREFLIGHT_MAX_AGE: Duration = Duration::from_secs(600);

/// The request headers a gRPC-Web client sends (connect-web, grpc-web and
/// the TypeScript client all use a subset of these), and a Connect JSON call's.
const ALLOWED_HEADERS: [&str; 7] = [
    "authorization",
    "content-type",
    "x-grpc-web",
    "x-user-agent",
    "grpc-timeout",
    "connect-protocol-version",
    "connect-timeout-ms",
];

/// The response headers a page must be able to read: where a trailers-only
/// answer (an error before any message) carries its status.
const EXPOSED_HEADERS: [&str; 3] = ["grpc-status", "grpc-message", "grpc-status-details-bin"];

/// Reads one `--cors-origin` value into the form browsers send in `Origin`
/// (`scheme://host[:port]`, lowercase): a value that could never match is
/// refused at start rather than silently letting no page in.
pub(crate) fn parse_cors_origin(origin: &str) -> Result<HeaderValue, ServeError> {
    let invalid = |reason: &'static str| ServeError::CorsOrigin { origin: origin.to_owned(), reason };
    if origin == "*" {
        return Err(invalid("any origin is not allowed; name each page's origin"));
    }
    let Some((scheme, authority)) = origin.split_once("://") else {
        return Err(invalid("must be scheme://host[:port], for example https://app.example.com"));
    };
    let scheme = scheme.to_ascii_lowercase();
    if scheme != "http" && scheme != "https" {
        return Err(invalid("must start with http:// or https://"));
    }
    if authority.is_empty() || authority.contains(['/', '?', '#', '@']) {
        return Err(invalid("must be only scheme://host[:port], as a browser sends it: no path, no trailing slash"));
    }
    let authority: http::uri::Authority =
        authority.parse().map_err(|_| invalid("does not have a valid host and port"))?;
    // After the last colon outside an IPv6 literal's brackets comes the port.
    let has_port = !authority.as_str().ends_with(']') && authority.as_str().contains(':');
    if authority.host().is_empty() || (has_port && authority.port_u16().is_none()) {
        return Err(invalid("does not have a valid host and port"));
    }
    HeaderValue::try_from(format!("{scheme}://{}", authority.as_str().to_ascii_lowercase()))
        .map_err(|_| invalid("is not a valid header value"))
}

/// What goes to the routes through tonic-web and CORS.
pub(crate) type WebRoutes = Cors<tonic_web::GrpcWebService<Routes>>;

/// What goes to the routes through JSON over HTTP and CORS.
pub(crate) type JsonRoutes = Cors<ConnectJson<Routes>>;

/// The service every connection is served with.
pub(crate) type FrontService = Front<Routes, WebRoutes, JsonRoutes>;

/// The service of every connection: see the module doc.
#[derive(Debug, Clone)]
pub(crate) struct Front<G, W, J> {
    /// Plain gRPC over HTTP/2.
    grpc: G,
    /// gRPC-Web and CORS preflights, to the same routes.
    web: W,
    /// JSON over HTTP, to the same routes.
    json: J,
    /// Whether `/console/` is served (`--console`); a 404 when not.
    console: bool,
}

impl Front<Routes, WebRoutes, JsonRoutes> {
    /// Serves `routes` over gRPC and gRPC-Web, letting pages from `origins`
    /// call them (none: only same-origin pages, the console's), and the
    /// console if `console`.
    pub(crate) fn new(routes: Routes, origins: Vec<HeaderValue>, console: bool) -> Self {
        let cors = CorsLayer::new()
            .allow_origin(AllowOrigin::list(origins))
            .allow_methods([Method::POST])
            .allow_headers(ALLOWED_HEADERS.map(HeaderName::from_static))
            .expose_headers(EXPOSED_HEADERS.map(HeaderName::from_static))
            .max_age(PREFLIGHT_MAX_AGE);
        // The CORS layer outside, so that a preflight is answered before
        // tonic-web (which would refuse a request that is not gRPC-Web).
        let web = cors.clone().layer(tonic_web::GrpcWebLayer::new().layer(routes.clone()));
        let json = cors.layer(ConnectJson::new(routes.clone()));
        Front { grpc: routes, web, json, console }
    }
}

/// Where a request goes (see the module doc).
#[derive(Debug, PartialEq, Eq)]
enum Kind {
    Grpc,
    Web,
    Json,
    OpenApi,
    Console,
    NotFound,
}

impl Kind {
    fn of<B>(request: &Request<B>) -> Kind {
        let content_type = request.headers().get(header::CONTENT_TYPE).map(HeaderValue::as_bytes);
        match content_type {
            Some(content_type) if content_type.starts_with(b"application/grpc-web") => Kind::Web,
            // gRPC over HTTP/1 cannot work (no trailers); tonic-web answers it with a 400.
            Some(content_type) if content_type.starts_with(b"application/grpc") => match request.version() {
                Version::HTTP_2 => Kind::Grpc,
                _ => Kind::Web,
            },
            Some(content_type) if content_type.starts_with(b"application/json") => Kind::Json,
            _ if request.method() == Method::OPTIONS => Kind::Web,
            _ if request.method() == Method::GET && request.uri().path() == connect::OPENAPI_PATH => Kind::OpenApi,
            _ if is_console_path(request.uri().path()) => Kind::Console,
            _ => Kind::NotFound,
        }
    }
}

fn is_console_path(path: &str) -> bool {
    path.strip_prefix(CONSOLE_PATH).is_some_and(|rest| rest.is_empty() || rest.starts_with('/'))
}

impl<G, W, J> Service<Request<Body>> for Front<G, W, J>
where
    G: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    W: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
    J: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = FrontFuture<G::Future, W::Future, J::Future>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // All are always ready (the routes pick a handler per request);
        // polled so that none is ever called without it.
        ready!(self.grpc.poll_ready(cx))?;
        ready!(self.web.poll_ready(cx))?;
        self.json.poll_ready(cx)
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        match Kind::of(&request) {
            Kind::Grpc => match crate::cluster::protocol::check(request.headers()) {
                Ok(()) => FrontFuture::Grpc { future: self.grpc.call(request) },
                // Another node's request in a protocol this node cannot read
                // (D1): refused before any handler decodes it.
                Err(refused) => FrontFuture::Ready { response: Some(tonic::Status::from(refused).into_http()) },
            },
            Kind::Web => FrontFuture::Web { future: self.web.call(request) },
            Kind::Json => FrontFuture::Json { future: self.json.call(request) },
            Kind::OpenApi => FrontFuture::Ready { response: Some(connect::openapi()) },
            Kind::Console if self.console => FrontFuture::Ready { response: Some(console(&request)) },
            Kind::Console | Kind::NotFound => FrontFuture::Ready { response: Some(not_found()) },
        }
    }
}

pin_project_lite::pin_project! {
    /// The answer of [`Front`]: one of its two inner services' or one made at once.
    #[project = FrontFutureProjection]
    pub(crate) enum FrontFuture<G, W, J> {
        /// Plain gRPC.
        Grpc { #[pin] future: G },
        /// gRPC-Web or a preflight.
        Web { #[pin] future: W },
        /// JSON over HTTP.
        Json { #[pin] future: J },
        /// The console or a 404.
        Ready { response: Option<Response<Body>> },
    }
}

impl<G, W, J> Future for FrontFuture<G, W, J>
where
    G: Future<Output = Result<Response<Body>, Infallible>>,
    W: Future<Output = Result<Response<Body>, Infallible>>,
    J: Future<Output = Result<Response<Body>, Infallible>>,
{
    type Output = Result<Response<Body>, Infallible>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project() {
            FrontFutureProjection::Grpc { future } => future.poll(cx),
            FrontFutureProjection::Web { future } => future.poll(cx),
            FrontFutureProjection::Json { future } => future.poll(cx),
            FrontFutureProjection::Ready { response } => {
                Poll::Ready(Ok(response.take().expect("a ready answer is polled once")))
            }
        }
    }
}

/// One of the console's files, ready to send.
#[derive(Debug)]
struct ConsoleFile {
    body: Bytes,
    content_type: HeaderValue,
    /// A hash of the content: a browser revalidates with it and gets a 304
    /// while the binary (and so the file) is the same.
    etag: HeaderValue,
}

/// The console's files by their path under `/console/`.
static CONSOLE: LazyLock<HashMap<&'static str, ConsoleFile>> = LazyLock::new(|| {
    CONSOLE_FILES
        .iter()
        .map(|(name, bytes)| {
            let digest: [u8; 32] = sha2::Sha256::digest(bytes).into();
            let hex: String = digest[..12].iter().map(|byte| format!("{byte:02x}")).collect();
            let file = ConsoleFile {
                body: Bytes::from_static(bytes),
                content_type: HeaderValue::from_static(content_type_of(name)),
                etag: HeaderValue::try_from(format!("\"{hex}\"")).expect("hex is a valid header value"),
            };
            (*name, file)
        })
        .collect()
});

/// The content type of a console file, by its extension.
fn content_type_of(name: &str) -> &'static str {
    match name.rsplit_once('.').map(|(_, extension)| extension) {
        Some("html") => "text/html; charset=utf-8",
        Some("js" | "mjs") => "text/javascript; charset=utf-8",
        Some("css") => "text/css; charset=utf-8",
        Some("json" | "map") => "application/json",
        Some("svg") => "image/svg+xml",
        Some("png") => "image/png",
        Some("ico") => "image/x-icon",
        Some("wasm") => "application/wasm",
        Some("txt") => "text/plain; charset=utf-8",
        _ => "application/octet-stream",
    }
}

/// The files are not named by their content, so a browser must ask again
/// each time (cheaply: the etag makes the answer a 304); a new binary's
/// console is then seen at once.
const CONSOLE_CACHE_CONTROL: &str = "no-cache";

/// Answers a request under `/console`.
fn console(request: &Request<Body>) -> Response<Body> {
    let path = request.uri().path();
    if path == CONSOLE_PATH {
        // Relative links in the page resolve against `/console/`.
        let location = match request.uri().query() {
            Some(query) => format!("{CONSOLE_PATH}/?{query}"),
            None => format!("{CONSOLE_PATH}/"),
        };
        return response(StatusCode::PERMANENT_REDIRECT)
            .header(header::LOCATION, location)
            .body(Body::empty())
            .expect("a valid redirect");
    }
    if request.method() != Method::GET && request.method() != Method::HEAD {
        return response(StatusCode::METHOD_NOT_ALLOWED)
            .header(header::ALLOW, "GET, HEAD")
            .body(Body::empty())
            .expect("a valid answer");
    }
    let name = match &path[CONSOLE_PATH.len() + 1..] {
        "" => "index.html",
        name => name,
    };
    let Some(file) = CONSOLE.get(name) else { return not_found() };
    let builder = response(StatusCode::OK)
        .header(header::CACHE_CONTROL, CONSOLE_CACHE_CONTROL)
        .header(header::ETAG, file.etag.clone())
        .header(header::X_CONTENT_TYPE_OPTIONS, "nosniff");
    let unchanged =
        request.headers().get_all(header::IF_NONE_MATCH).iter().any(|tags| {
            tags.as_bytes().split(|&byte| byte == b',').any(|tag| tag.trim_ascii() == file.etag.as_bytes())
        });
    if unchanged {
        return builder.status(StatusCode::NOT_MODIFIED).body(Body::empty()).expect("a valid answer");
    }
    let builder =
        builder.header(header::CONTENT_TYPE, file.content_type.clone()).header(header::CONTENT_LENGTH, file.body.len());
    let body = match *request.method() {
        Method::HEAD => Body::empty(),
        _ => Body::new(Full::new(file.body.clone())),
    };
    builder.body(body).expect("a valid answer")
}

fn response(status: StatusCode) -> http::response::Builder {
    Response::builder().status(status)
}

/// Anything on the port that is neither gRPC nor the console.
fn not_found() -> Response<Body> {
    const TEXT: &str = "not found: this port serves gRPC, gRPC-Web, JSON over HTTP (POST /presence.v1.Presence/<Method>, \
                        content-type application/json; the methods: /openapi.json) and /console/\n";
    response(StatusCode::NOT_FOUND)
        .header(header::CONTENT_TYPE, "text/plain; charset=utf-8")
        .header(header::CONTENT_LENGTH, TEXT.len())
        .body(Body::new(Full::new(Bytes::from_static(TEXT.as_bytes()))))
        .expect("a valid answer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_file_in_the_console_directory_is_built_in_with_a_content_type() {
        let directory = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("console");
        let mut on_disk = Vec::new();
        let mut pending = vec![directory.clone()];
        while let Some(dir) = pending.pop() {
            for entry in std::fs::read_dir(&dir).unwrap() {
                let path = entry.unwrap().path();
                if path.is_dir() {
                    pending.push(path);
                } else {
                    on_disk.push(path.strip_prefix(&directory).unwrap().to_str().unwrap().to_owned());
                }
            }
        }
        on_disk.sort();
        let mut built_in: Vec<_> = CONSOLE_FILES.iter().map(|(name, _)| (*name).to_owned()).collect();
        built_in.sort();
        assert_eq!(built_in, on_disk, "console_files! in web.rs lists every file under console/");
        for name in &built_in {
            assert_ne!(content_type_of(name), "application/octet-stream", "{name} has a known content type");
        }
        assert!(CONSOLE.contains_key("index.html"), "the console has a page");
    }

    #[test]
    fn requests_are_sorted_by_content_type_version_and_path() {
        let request = |method: Method, path: &str, content_type: Option<&str>, version: Version| {
            let mut builder = Request::builder().method(method).uri(path).version(version);
            if let Some(content_type) = content_type {
                builder = builder.header(header::CONTENT_TYPE, content_type);
            }
            builder.body(()).unwrap()
        };
        let grpc = "/presence.v1.Presence/Snapshot";
        for (method, path, content_type, version, kind) in [
            (Method::POST, grpc, Some("application/grpc"), Version::HTTP_2, Kind::Grpc),
            (Method::POST, grpc, Some("application/grpc+proto"), Version::HTTP_2, Kind::Grpc),
            (Method::POST, grpc, Some("application/grpc"), Version::HTTP_11, Kind::Web),
            (Method::POST, grpc, Some("application/grpc-web+proto"), Version::HTTP_11, Kind::Web),
            (Method::POST, grpc, Some("application/grpc-web-text"), Version::HTTP_2, Kind::Web),
            (Method::OPTIONS, grpc, None, Version::HTTP_11, Kind::Web),
            (Method::GET, "/console", None, Version::HTTP_11, Kind::Console),
            (Method::GET, "/console/", None, Version::HTTP_11, Kind::Console),
            (Method::GET, "/console/app.js", None, Version::HTTP_2, Kind::Console),
            (Method::GET, "/consoles", None, Version::HTTP_11, Kind::NotFound),
            (Method::GET, "/", None, Version::HTTP_11, Kind::NotFound),
            (Method::POST, grpc, Some("application/json"), Version::HTTP_11, Kind::Json),
            (Method::POST, grpc, Some("application/json; charset=utf-8"), Version::HTTP_2, Kind::Json),
            (Method::GET, "/openapi.json", None, Version::HTTP_11, Kind::OpenApi),
            (Method::POST, grpc, Some("text/plain"), Version::HTTP_11, Kind::NotFound),
        ] {
            let described = format!("{method} {path} {content_type:?} {version:?}");
            assert_eq!(Kind::of(&request(method, path, content_type, version)), kind, "{described}");
        }
    }

    #[test]
    fn origins_are_read_as_browsers_send_them_and_others_are_refused() {
        for (given, read) in [
            ("http://localhost:8080", "http://localhost:8080"),
            ("https://App.Example.com", "https://app.example.com"),
            ("HTTPS://example.com:443", "https://example.com:443"),
            ("http://127.0.0.1:3000", "http://127.0.0.1:3000"),
            ("http://[::1]:3000", "http://[::1]:3000"),
        ] {
            assert_eq!(parse_cors_origin(given).unwrap(), read, "{given}");
        }
        for (refused, why) in [
            ("*", "name each page's origin"),
            ("example.com", "scheme://host[:port]"),
            ("ftp://example.com", "http:// or https://"),
            ("https://example.com/", "no trailing slash"),
            ("https://example.com/app", "no path"),
            ("https://user@example.com", "no path"),
            ("https://", "no path"),
            ("https://example.com:port", "valid host and port"),
            ("https://exa mple.com", "valid host and port"),
        ] {
            let err = parse_cors_origin(refused).expect_err(refused).to_string();
            assert!(err.contains(why) && err.contains(refused), "{refused}: {err}");
        }
    }
}
