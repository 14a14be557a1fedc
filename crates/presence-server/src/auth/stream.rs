//! Streams that end with their credentials (T3).
//!
//! A stream (Watch, WatchRoom, Leases) is authorised when it opens, but it
//! may stay open for days. [`CredentialBound`] ends it when the credentials
//! it was opened with stop being accepted:
//! - a viewer's JWT at its `exp` plus the configured leeway:
//!   `UNAUTHENTICATED` with the `google.rpc.ErrorInfo` reason
//!   `CREDENTIALS_EXPIRED`;
//! - a credential removed from the credentials file (or a viewer key rotated
//!   out) as soon as the server reads the change: `UNAUTHENTICATED` with the
//!   reason `CREDENTIALS_REVOKED`; a credential that lost the scope the
//!   stream needs: `PERMISSION_DENIED` naming the scope.
//!
//! The check runs when the credentials change, not per event, so it costs
//! an open stream nothing in between.

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use futures_util::Stream;
use tonic::Status;

use crate::auth::{Authenticator, Caller, Scope};
use crate::error::ServiceError;

/// What a stream was opened with, to be checked again.
pub(crate) struct StreamCredentials {
    auth: Arc<Authenticator>,
    /// The bearer token presented, if any (a caller known by its certificate
    /// alone keeps its stream: certificates are checked at the handshake).
    token: Option<String>,
    /// Who it named, and what the stream needed of it.
    caller: Caller,
    needs: Option<Scope>,
}

impl StreamCredentials {
    /// The credentials `request` presented, naming `caller`, for a stream
    /// that needs `needs` of a service caller (`None`: what a viewer opens).
    pub(crate) fn of<T>(
        auth: &Arc<Authenticator>,
        request: &tonic::Request<T>,
        caller: Caller,
        needs: Option<Scope>,
    ) -> StreamCredentials {
        // A token decides alone when one is sent; without one, the
        // certificate did, and it was checked at the handshake.
        let token = super::bearer_token(request.metadata()).ok().map(str::to_owned);
        StreamCredentials { auth: Arc::clone(auth), token, caller, needs }
    }

    /// Wraps `stream` so that it ends when these credentials do.
    pub(crate) fn bind<S>(self, stream: S) -> CredentialBound<S> {
        if self.auth.is_open() || self.token.is_none() {
            return CredentialBound { inner: stream, ending: None, ended: false };
        }
        CredentialBound { inner: stream, ending: Some(Box::pin(self.until_refused())), ended: false }
    }

    /// Resolves, with the stream's last item, when the credentials stop being accepted.
    async fn until_refused(self) -> Status {
        let expiry = match &self.caller {
            Caller::Viewer(viewer) => Some(until(viewer.accepted_until)),
            Caller::Service(_) => None,
        };
        let expired = async {
            match expiry {
                Some(left) => tokio::time::sleep(left).await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(expired);
        let mut changes = self.auth.watch_changes();
        loop {
            tokio::select! {
                () = &mut expired => return ServiceError::CredentialsExpired.into(),
                changed = changes.changed() => {
                    if changed.is_err() {
                        // The server is going away; the stream ends with it.
                        std::future::pending::<()>().await;
                    }
                    if let Err(refusal) = self.check_again() {
                        return refusal.into();
                    }
                }
            }
        }
    }

    fn check_again(&self) -> Result<(), ServiceError> {
        let Some(token) = &self.token else { return Ok(()) };
        let now = self.auth.caller_with_token(token).map_err(|_| ServiceError::CredentialsRevoked)?;
        match (&self.caller, &now) {
            (Caller::Viewer(then), Caller::Viewer(now)) if then.id == now.id => Ok(()),
            (Caller::Service(_), Caller::Service(_)) => match self.needs {
                Some(scope) => now.require(scope, "the open stream"),
                None => Ok(()),
            },
            _ => Err(ServiceError::CredentialsRevoked),
        }
    }
}

/// How long until the Unix second `at`.
fn until(at: u64) -> Duration {
    let at = UNIX_EPOCH + Duration::from_secs(at);
    at.duration_since(SystemTime::now()).unwrap_or_default()
}

/// A response stream that ends with its credentials (see the module).
pub(crate) struct CredentialBound<S> {
    inner: S,
    ending: Option<Pin<Box<dyn Future<Output = Status> + Send>>>,
    ended: bool,
}

impl<S> std::fmt::Debug for CredentialBound<S> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CredentialBound").field("bound", &self.ending.is_some()).field("ended", &self.ended).finish()
    }
}

impl<S, T> Stream for CredentialBound<S>
where
    S: Stream<Item = Result<T, Status>> + Unpin,
{
    type Item = Result<T, Status>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if self.ended {
            return Poll::Ready(None);
        }
        if let Some(ending) = &mut self.ending
            && let Poll::Ready(status) = ending.as_mut().poll(cx)
        {
            self.ended = true;
            return Poll::Ready(Some(Err(status)));
        }
        Pin::new(&mut self.inner).poll_next(cx)
    }
}
