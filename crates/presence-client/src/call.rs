//! What the client's streams share about a call: the credentials it carries,
//! and which refusals end a stream for good instead of being retried.
//!
//! It holds no connection and never retries by itself.

use tonic::metadata::AsciiMetadataValue;
use tonic::{Code, Request, Status};

/// The `authorization` value for `bearer_token`, checked once when a stream
/// is set up, so that a token that is not valid metadata fails there with
/// `INVALID_ARGUMENT` instead of on every reopen.
pub(crate) fn bearer(bearer_token: Option<&str>) -> Result<Option<AsciiMetadataValue>, Status> {
    bearer_token
        .map(|token| {
            format!("Bearer {token}").parse().map_err(|_| Status::invalid_argument("bearer token: not valid metadata"))
        })
        .transpose()
}

/// `message` as a request, carrying `authorization` if there is one.
pub(crate) fn authorized<T>(message: T, authorization: Option<&AsciiMetadataValue>) -> Request<T> {
    let mut request = Request::new(message);
    if let Some(authorization) = authorization {
        request.metadata_mut().insert("authorization", authorization.clone());
    }
    request
}

/// Codes a retry cannot fix: the request or the caller is refused as such.
pub(crate) fn is_permanent(code: Code) -> bool {
    matches!(
        code,
        Code::InvalidArgument
            | Code::Unauthenticated
            | Code::PermissionDenied
            | Code::Unimplemented
            | Code::NotFound
            | Code::FailedPrecondition
            | Code::OutOfRange
            | Code::AlreadyExists
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn permanent_codes_stop_a_stream_and_transient_ones_do_not() {
        assert!(is_permanent(Code::PermissionDenied));
        assert!(is_permanent(Code::InvalidArgument));
        assert!(is_permanent(Code::NotFound), "a room the caller may not read");
        assert!(is_permanent(Code::FailedPrecondition), "a room past the member cap");
        assert!(!is_permanent(Code::Unavailable));
        assert!(!is_permanent(Code::Unknown));
        assert!(!is_permanent(Code::Internal));
        assert!(!is_permanent(Code::ResourceExhausted));
    }

    #[test]
    fn a_bearer_token_goes_into_the_authorization_header() {
        let value = bearer(Some("t0k3n")).unwrap();
        let request = authorized((), value.as_ref());
        assert_eq!(request.metadata().get("authorization").unwrap(), "Bearer t0k3n");
        assert!(authorized((), None).metadata().get("authorization").is_none());
        assert_eq!(bearer(Some("line\nbreak")).unwrap_err().code(), Code::InvalidArgument);
        assert_eq!(bearer(None).unwrap(), None);
    }
}
