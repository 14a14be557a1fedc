//! JSON over HTTP: every unary RPC of `presence.v1.Presence` in the Connect
//! protocol's unary form, for callers with no gRPC (curl, PHP, Ruby, a
//! backend's HTTP client, `buf curl`).
//!
//! `POST /presence.v1.Presence/Snapshot` with `content-type: application/json`
//! and the request as JSON answers 200 with the response as JSON, or a Connect
//! error: `{"code": "invalid_argument", "message": ..., "details": [...]}`
//! with the HTTP status the protocol gives that code.
//!
//! A call is turned into the gRPC call it stands for and handed to the very
//! routes a gRPC call reaches, as tonic-web does for gRPC-Web: the same
//! credentials, scopes, audit, limits and statuses, with no handler of its
//! own. The JSON conversions are `presence_proto::connect` (generated from
//! the proto); what is here is the HTTP around them.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use base64::Engine as _;
use bytes::{Buf as _, BufMut as _, Bytes, BytesMut};
use http::header::{self, HeaderValue};
use http::{HeaderMap, Method, Request, Response, StatusCode};
use http_body_util::{BodyExt as _, Full};
use presence_proto::connect::{self as wire, UnaryMethod};
use presence_proto::v1 as pb;
use prost::Message as _;
use serde_json::{Value, json};
use tonic::Code;
use tonic::body::Body;
use tower_service::Service;

use crate::error::ServiceError;

/// The largest request body read: tonic's own limit on a decoded gRPC
/// message, so that a call is refused over JSON exactly where it would be over gRPC.
const MAX_REQUEST_BYTES: usize = 4 * 1024 * 1024;

/// How much of a request over the limit is read and dropped before the
/// refusal is sent: a client still sending when the connection closes
/// would otherwise lose the answer to a reset. Past it, the connection closes.
const MAX_DRAINED_BYTES: usize = 4 * MAX_REQUEST_BYTES;

/// Where the OpenAPI document of JSON over HTTP is served, on the service port.
pub(crate) const OPENAPI_PATH: &str = "/openapi.json";

/// The Connect unary methods' service: see the module doc.
#[derive(Debug, Clone)]
pub(crate) struct ConnectJson<S> {
    routes: S,
}

impl<S> ConnectJson<S> {
    pub(crate) fn new(routes: S) -> Self {
        ConnectJson { routes }
    }
}

impl<S> Service<Request<Body>> for ConnectJson<S>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send,
{
    type Response = Response<Body>;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response<Body>, Infallible>> + Send>>;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Each call readies its own clone of the routes.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request<Body>) -> Self::Future {
        let routes = self.routes.clone();
        Box::pin(async move { Ok(call(routes, request).await.unwrap_or_else(|refused| refused)) })
    }
}

/// One call: the answer, or the Connect error that refused it before the routes.
async fn call<S>(mut routes: S, request: Request<Body>) -> Result<Response<Body>, Response<Body>>
where
    S: Service<Request<Body>, Response = Response<Body>, Error = Infallible>,
{
    let path = request.uri().path().to_owned();
    if request.method() != Method::POST {
        let refused = tonic::Status::unimplemented(format!("{path}: JSON over HTTP takes POST only"));
        let mut answer = error_response(&refused);
        *answer.status_mut() = StatusCode::METHOD_NOT_ALLOWED;
        answer.headers_mut().insert(header::ALLOW, HeaderValue::from_static("POST"));
        return Err(answer);
    }
    let method = wire::unary_method(&path).ok_or_else(|| no_such_method(&path))?;
    if let Some(encoding) = request.headers().get(header::CONTENT_ENCODING)
        && encoding != "identity"
    {
        let encoding = String::from_utf8_lossy(encoding.as_bytes());
        let refused = tonic::Status::unimplemented(format!(
            "content-encoding {encoding} is not supported: send the JSON uncompressed"
        ));
        return Err(error_response(&refused));
    }
    let (mut parts, body) = request.into_parts();
    let body = read_body(body).await.map_err(|refused| error_response(&refused))?;
    let encoded = (method.request_from_json)(&body).map_err(|wrong| {
        let field = if wrong.field.is_empty() { "(request body)".to_owned() } else { wrong.field.clone() };
        error_response(&ServiceError::invalid(field, wrong.reason).into())
    })?;
    grpc_headers(&mut parts.headers);
    let mut framed = BytesMut::with_capacity(5 + encoded.len());
    framed.put_u8(0);
    framed.put_u32(u32::try_from(encoded.len()).expect("a request under the size limit"));
    framed.put_slice(&encoded);
    let grpc = Request::from_parts(parts, Body::new(Full::new(framed.freeze())));
    let Ok(()) = std::future::poll_fn(|cx| routes.poll_ready(cx)).await;
    let Ok(answer) = routes.call(grpc).await;
    Ok(json_answer(method, answer).await)
}

/// The whole request body, up to [`MAX_REQUEST_BYTES`].
async fn read_body(mut body: Body) -> Result<Bytes, tonic::Status> {
    let unreadable = |error: tonic::Status| {
        tonic::Status::invalid_argument(format!("the request's body could not be read: {}", error.message()))
    };
    let mut read = BytesMut::new();
    let mut dropped = 0;
    while let Some(frame) = body.frame().await {
        let Ok(data) = frame.map_err(unreadable)?.into_data() else { continue };
        if dropped == 0 && read.len() + data.len() <= MAX_REQUEST_BYTES {
            read.extend_from_slice(&data);
            continue;
        }
        dropped += data.len();
        if dropped > MAX_DRAINED_BYTES {
            break;
        }
    }
    if dropped > 0 {
        return Err(tonic::Status::resource_exhausted(format!(
            "the request is larger than {MAX_REQUEST_BYTES} bytes, the most a call takes"
        )));
    }
    Ok(read.freeze())
}

/// The request's headers as the gRPC call it stands for: a gRPC content
/// type, Connect's timeout as gRPC's, and nothing of the JSON body's framing.
fn grpc_headers(headers: &mut HeaderMap) {
    let timeout = headers
        .remove("connect-timeout-ms")
        .and_then(|value| value.to_str().ok()?.parse::<u64>().ok())
        // gRPC's timeout takes at most 8 digits.
        .map(|ms| ms.min(99_999_999));
    for framing in [header::CONTENT_LENGTH, header::CONTENT_ENCODING, header::ACCEPT_ENCODING] {
        headers.remove(framing);
    }
    headers.remove("connect-protocol-version");
    headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/grpc+proto"));
    headers.insert(header::TE, HeaderValue::from_static("trailers"));
    if let Some(ms) = timeout {
        headers.insert("grpc-timeout", HeaderValue::try_from(format!("{ms}m")).expect("digits"));
    }
}

/// The routes' gRPC answer as JSON over HTTP.
async fn json_answer(method: &UnaryMethod, answer: Response<Body>) -> Response<Body> {
    let (parts, body) = answer.into_parts();
    // A trailers-only answer carries its status in the headers.
    if let Some(status) = tonic::Status::from_header_map(&parts.headers) {
        return error_response(&status);
    }
    let collected = match body.collect().await {
        Ok(collected) => collected,
        Err(error) => return error_response(&tonic::Status::internal(format!("the answer was cut short: {error}"))),
    };
    let trailers = collected.trailers().cloned().unwrap_or_default();
    let mut data = collected.to_bytes();
    match tonic::Status::from_header_map(&trailers) {
        Some(status) if status.code() != Code::Ok => return error_response(&status),
        Some(_) => {}
        None => return error_response(&tonic::Status::internal("the answer carried no status")),
    }
    // One message, uncompressed: a flag byte, a length, the message.
    if data.len() < 5 || data[0] != 0 {
        return error_response(&tonic::Status::internal("the answer carried no message"));
    }
    data.advance(1);
    let length = data.get_u32() as usize;
    let Some(message) = data.get(..length) else {
        return error_response(&tonic::Status::internal("the answer's message was cut short"));
    };
    match (method.response_to_json)(message) {
        Ok(json) => json_response(StatusCode::OK, json),
        Err(error) => error_response(&tonic::Status::internal(format!("the answer could not be read: {error}"))),
    }
}

/// A path that is no unary method: a stream, or nothing at all.
fn no_such_method(path: &str) -> Response<Body> {
    let method = path.rsplit('/').next().unwrap_or(path);
    let stream = ["Leases", "Watch", "WatchRoom", "WatchRoomCounts", "Backup", "Changes"];
    let message = if path.starts_with("/presence.v1.Presence/") && stream.contains(&method) {
        format!("{method} is a stream: call it over gRPC or gRPC-Web; JSON over HTTP serves the unary methods")
    } else {
        format!("{path} is no unary method of presence.v1.Presence (the list: {OPENAPI_PATH})")
    };
    let mut answer = error_response(&tonic::Status::unimplemented(message));
    // Connect answers a procedure it does not serve with a 404.
    *answer.status_mut() = StatusCode::NOT_FOUND;
    answer
}

/// A gRPC status as a Connect error: its code's name, its message, its
/// details (each as `type`, base64 `value`, and `debug` JSON where known).
pub(crate) fn error_response(status: &tonic::Status) -> Response<Body> {
    let mut error = json!({"code": code_name(status.code()), "message": status.message()});
    let details: Vec<Value> = tonic_types::Status::decode(status.details())
        .map(|decoded| decoded.details.iter().map(detail_json).collect())
        .unwrap_or_default();
    if !details.is_empty() {
        error["details"] = Value::Array(details);
    }
    json_response(http_status(status.code()), serde_json::to_vec(&error).expect("JSON"))
}

/// One detail of a status, as Connect's error JSON carries it.
fn detail_json(detail: &prost_types::Any) -> Value {
    let name = detail.type_url.rsplit('/').next().unwrap_or(&detail.type_url);
    let value = base64::engine::general_purpose::STANDARD_NO_PAD.encode(&detail.value);
    let debug = match name {
        "google.rpc.BadRequest" => tonic_types::pb::BadRequest::decode(detail.value.as_slice()).ok().map(|bad| {
            let violations: Vec<Value> = bad
                .field_violations
                .iter()
                .map(|violation| json!({"field": violation.field, "description": violation.description}))
                .collect();
            json!({ "fieldViolations": violations })
        }),
        "google.rpc.ErrorInfo" => tonic_types::pb::ErrorInfo::decode(detail.value.as_slice())
            .ok()
            .map(|info| json!({"reason": info.reason, "domain": info.domain, "metadata": info.metadata})),
        "presence.v1.NotOwner" => {
            pb::NotOwner::decode(detail.value.as_slice()).ok().and_then(|owner| serde_json::to_value(owner).ok())
        }
        "presence.v1.ChangesOutOfRange" => pb::ChangesOutOfRange::decode(detail.value.as_slice())
            .ok()
            .and_then(|range| serde_json::to_value(range).ok()),
        _ => None,
    };
    let mut json = json!({"type": name, "value": value});
    if let Some(debug) = debug {
        json["debug"] = debug;
    }
    json
}

/// A code's name in a Connect error.
fn code_name(code: Code) -> &'static str {
    match code {
        Code::Ok => "ok",
        Code::Cancelled => "canceled",
        Code::Unknown => "unknown",
        Code::InvalidArgument => "invalid_argument",
        Code::DeadlineExceeded => "deadline_exceeded",
        Code::NotFound => "not_found",
        Code::AlreadyExists => "already_exists",
        Code::PermissionDenied => "permission_denied",
        Code::ResourceExhausted => "resource_exhausted",
        Code::FailedPrecondition => "failed_precondition",
        Code::Aborted => "aborted",
        Code::OutOfRange => "out_of_range",
        Code::Unimplemented => "unimplemented",
        Code::Internal => "internal",
        Code::Unavailable => "unavailable",
        Code::DataLoss => "data_loss",
        Code::Unauthenticated => "unauthenticated",
    }
}

/// The HTTP status of a Connect error with `code` (the Connect protocol's table).
fn http_status(code: Code) -> StatusCode {
    match code {
        Code::Ok => StatusCode::OK,
        Code::Cancelled => StatusCode::from_u16(499).expect("499 is a status"),
        Code::InvalidArgument | Code::FailedPrecondition | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::DeadlineExceeded => StatusCode::GATEWAY_TIMEOUT,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::AlreadyExists | Code::Aborted => StatusCode::CONFLICT,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unimplemented => StatusCode::NOT_IMPLEMENTED,
        Code::Unavailable => StatusCode::SERVICE_UNAVAILABLE,
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::Unknown | Code::Internal | Code::DataLoss => StatusCode::INTERNAL_SERVER_ERROR,
    }
}

fn json_response(status: StatusCode, body: Vec<u8>) -> Response<Body> {
    Response::builder()
        .status(status)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, body.len())
        .body(Body::new(Full::new(Bytes::from(body))))
        .expect("a valid answer")
}

/// `GET /openapi.json`: the OpenAPI document of JSON over HTTP.
pub(crate) fn openapi() -> Response<Body> {
    Response::builder()
        .status(StatusCode::OK)
        .header(header::CONTENT_TYPE, "application/json")
        .header(header::CONTENT_LENGTH, wire::OPENAPI_JSON.len())
        .body(Body::new(Full::new(Bytes::from_static(wire::OPENAPI_JSON.as_bytes()))))
        .expect("a valid answer")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_code_has_the_connect_protocols_name_and_http_status() {
        for (code, name, status) in [
            (Code::Cancelled, "canceled", 499),
            (Code::InvalidArgument, "invalid_argument", 400),
            (Code::NotFound, "not_found", 404),
            (Code::FailedPrecondition, "failed_precondition", 400),
            (Code::PermissionDenied, "permission_denied", 403),
            (Code::ResourceExhausted, "resource_exhausted", 429),
            (Code::Unimplemented, "unimplemented", 501),
            (Code::Unavailable, "unavailable", 503),
            (Code::Unauthenticated, "unauthenticated", 401),
            (Code::DeadlineExceeded, "deadline_exceeded", 504),
        ] {
            assert_eq!((code_name(code), http_status(code).as_u16()), (name, status), "{code:?}");
        }
    }

    #[test]
    fn the_grpc_request_carries_connects_timeout_and_no_json_framing() {
        let mut headers = HeaderMap::new();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static("application/json"));
        headers.insert(header::CONTENT_LENGTH, HeaderValue::from_static("17"));
        headers.insert("connect-timeout-ms", HeaderValue::from_static("2500"));
        headers.insert(header::AUTHORIZATION, HeaderValue::from_static("Bearer t"));
        grpc_headers(&mut headers);
        assert_eq!(headers[header::CONTENT_TYPE], "application/grpc+proto");
        assert_eq!(headers["grpc-timeout"], "2500m");
        assert_eq!(headers[header::AUTHORIZATION], "Bearer t");
        assert!(headers.get(header::CONTENT_LENGTH).is_none());
    }
}
