//! Keeping credentials current (T4): the credentials file (and a JWKS file)
//! is read again every `credentials_reload_interval`, a JWKS URL every
//! `--viewer-jwks-refresh-ms`, and all of them at once on SIGHUP. A change
//! takes effect for the next call and ends the open streams of the
//! credentials it took away (`auth/stream.rs`); material that cannot be used
//! keeps what is in use, says why in the log and counts it. Every change of
//! the credentials file is recorded in the audit log, whose file SIGHUP
//! opens again (log rotation).

use std::sync::Arc;
use std::time::Duration;

use metrics::counter;
use serde_json::json;
use tokio_util::sync::CancellationToken;

use crate::api::reload_tls::{hangups, next_hangup};
use crate::audit::Audit;
use crate::auth::Authenticator;
use crate::metrics::names;

/// Reloads the credentials file every `interval` and on SIGHUP until `stopping`.
pub(crate) async fn keep_reloading(
    auth: Arc<Authenticator>,
    audit: Arc<Audit>,
    interval: Duration,
    stopping: CancellationToken,
) {
    let jwks = auth.viewer_jwks();
    if auth.credentials_file().is_none() && jwks.is_none() && !audit.has_file() {
        return;
    }
    let mut hangups = hangups();
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    // A JWKS URL is fetched at once (no key verifies until it is), then on its schedule.
    let url_refresh = jwks.as_ref().filter(|(_, is_file, _)| !is_file).map(|(_, _, every)| *every);
    let mut fetch = tokio::time::interval(url_refresh.unwrap_or(Duration::from_secs(3600)));
    fetch.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // immediate: the files were just read
    // A broken file is reported once, not on every poll, until it changes.
    let mut reported: Option<String> = None;
    let mut keys_reported: Option<String> = None;
    loop {
        let (files, url) = tokio::select! {
            _ = tick.tick() => (true, false),
            _ = fetch.tick(), if url_refresh.is_some() => (false, true),
            Some(()) = next_hangup(&mut hangups) => {
                // After a log rotation, the audit log goes to the new file.
                audit.reopen();
                (true, true)
            }
            () = stopping.cancelled() => return,
        };
        let jwks_file = jwks.as_ref().is_some_and(|(_, is_file, _)| *is_file);
        if (url && url_refresh.is_some()) || (files && jwks_file) {
            reload_viewer_keys(&auth, &mut keys_reported).await;
        }
        let Some(path) = auth.credentials_file().filter(|_| files).map(ToOwned::to_owned) else { continue };
        let reading = Arc::clone(&auth);
        let reloaded = tokio::task::spawn_blocking(move || reading.reload_credentials()).await;
        match reloaded {
            Ok(Ok(Some(changed))) => {
                reported = None;
                counter!(names::CREDENTIAL_RELOADS, "material" => "credentials", "result" => "changed").increment(1);
                tracing::info!(
                    path = %path.display(),
                    credentials = changed.credentials,
                    added = ?changed.added,
                    removed = ?changed.removed,
                    "credentials file changed; removed credentials' streams end"
                );
                audit.server_event(
                    "ReloadCredentials",
                    json!({
                        "path": path.display().to_string(),
                        "credentials": changed.credentials,
                        "added": changed.added,
                        "removed": changed.removed,
                    }),
                );
            }
            Ok(Ok(None)) => reported = None,
            Ok(Err(err)) => {
                let message = err.to_string();
                if reported.as_ref() != Some(&message) {
                    counter!(names::CREDENTIAL_RELOADS, "material" => "credentials", "result" => "failed").increment(1);
                    tracing::error!(%err, "cannot reload the credentials file; keeping the credentials in use");
                    reported = Some(message);
                }
            }
            Err(err) => tracing::error!(%err, "the credentials reload task failed"),
        }
    }
}

/// Reads the viewer keys (JWKS) again; a failure is reported once until it changes.
async fn reload_viewer_keys(auth: &Authenticator, reported: &mut Option<String>) {
    match auth.refresh_viewer_keys().await {
        Ok(Some(kids)) => {
            *reported = None;
            counter!(names::CREDENTIAL_RELOADS, "material" => "viewer-keys", "result" => "changed").increment(1);
            tracing::info!(?kids, "viewer keys (JWKS) changed; tokens of keys gone are refused, their streams end");
        }
        Ok(None) => *reported = None,
        Err(err) => {
            if reported.as_ref() != Some(&err) {
                counter!(names::CREDENTIAL_RELOADS, "material" => "viewer-keys", "result" => "failed").increment(1);
                tracing::error!(%err, "cannot read the viewer keys (JWKS) again; keeping the keys in use");
                *reported = Some(err);
            }
        }
    }
}
