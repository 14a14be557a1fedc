//! What the client's streams share about a call: the credentials it carries
//! (a token, or fresh ones from a [`TokenProvider`]), and which refusals end
//! a stream for good instead of being retried.
//!
//! It holds no connection and never retries by itself: [`StreamCredentials`]
//! only says how a stream that broke goes on.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use tonic::metadata::AsciiMetadataValue;
use tonic::{Code, Request, Status};

/// Where a reconnecting stream ([`Watcher`](crate::Watcher), the room
/// watchers, [`ChangesConsumer`](crate::ChangesConsumer)) gets a fresh bearer
/// token: called when the stream opens and whenever the server ends it for
/// its credentials (the token expired, or its key rotated out), so that the
/// token can be short-lived. An error ends the stream with it.
pub type TokenProvider = Arc<dyn Fn() -> Pin<Box<dyn Future<Output = Result<String, Status>> + Send>> + Send + Sync>;

/// Reopens in a row refused `UNAUTHENTICATED` with fresh tokens before a
/// stream with a token provider gives up: the provider's tokens are not
/// accepted at all.
pub(crate) const MAX_REFUSED_FRESH_TOKENS: u32 = 3;

/// What a reconnecting stream presents on every (re)open: the same token
/// (or none), or tokens from a provider, asked again once the server ended
/// the stream for its credentials.
pub(crate) struct StreamCredentials {
    authorization: Option<AsciiMetadataValue>,
    tokens: Option<TokenProvider>,
    /// The server ended the stream for its credentials: the next open asks
    /// the provider for a fresh token first.
    spent: bool,
    /// Opens refused `UNAUTHENTICATED` in a row despite a fresh token.
    refused_fresh: u32,
}

/// How a stream goes on after it broke, or after a reopen failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Reopen {
    /// At once: the server ended it for a token a fresh one replaces.
    Now,
    /// After the stream's backoff.
    AfterBackoff,
    /// Never: the refusal is one a retry cannot fix.
    Never,
}

impl StreamCredentials {
    /// The same `authorization` (or none) on every open.
    pub(crate) fn fixed(authorization: Option<AsciiMetadataValue>) -> Self {
        StreamCredentials { authorization, tokens: None, spent: false, refused_fresh: 0 }
    }

    /// `bearer_token` (or none) on every open, checked now.
    pub(crate) fn token(bearer_token: Option<&str>) -> Result<Self, Status> {
        Ok(Self::fixed(bearer(bearer_token)?))
    }

    /// Tokens from `tokens`, the first one asked for now.
    pub(crate) async fn provider(tokens: TokenProvider) -> Result<Self, Status> {
        let authorization = bearer(Some(&tokens().await?))?;
        Ok(StreamCredentials { authorization, tokens: Some(tokens), spent: false, refused_fresh: 0 })
    }

    /// Whether fresh tokens come from a provider.
    pub(crate) fn has_provider(&self) -> bool {
        self.tokens.is_some()
    }

    /// The `authorization` value presented now, for the unary calls made
    /// beside the stream.
    pub(crate) fn authorization(&self) -> Option<&AsciiMetadataValue> {
        self.authorization.as_ref()
    }

    /// `message` as the request that (re)opens the stream: with a fresh
    /// token first, if the last one was spent.
    pub(crate) async fn request<T>(&mut self, message: T) -> Result<Request<T>, Status> {
        if let (true, Some(tokens)) = (self.spent, &self.tokens) {
            self.authorization = bearer(Some(&tokens().await?))?;
            self.spent = false;
        }
        Ok(authorized(message, self.authorization.as_ref()))
    }

    /// The stream opened: its credentials were accepted.
    pub(crate) fn opened(&mut self) {
        self.refused_fresh = 0;
    }

    /// How a stream goes on after `status` ended it (or refused a reopen,
    /// when `reopening`): a stream the server ended for its credentials
    /// reopens at once with a fresh token from the provider, and a refused
    /// fresh token is tried again after the backoff, a few times; other
    /// refusals a retry cannot fix end it; anything else is retried.
    pub(crate) fn after(&mut self, status: &Status, reopening: bool) -> Reopen {
        if status.code() == Code::Unauthenticated
            && self.tokens.is_some()
            && self.refused_fresh < MAX_REFUSED_FRESH_TOKENS
        {
            self.spent = true;
            if reopening {
                self.refused_fresh += 1;
                Reopen::AfterBackoff
            } else {
                Reopen::Now
            }
        } else if is_permanent(status.code()) {
            Reopen::Never
        } else {
            Reopen::AfterBackoff
        }
    }
}

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
