//! Keeping TLS material current (T4): every certificate, key and CA file in
//! use (the service port's, the certificate this node shows other nodes, the
//! one it shows etcd) is read again every `tls_reload_interval` and at once on
//! SIGHUP. Changed material is used from the next connection on; connections
//! already established keep theirs. A reload that fails keeps the material in
//! use, says why in the log and counts it; each certificate's remaining
//! lifetime is a gauge, so an alert can fire well before one expires.

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use metrics::{counter, gauge};
use presence_tls::{CertificateFacts, ClientTls, ServerTls, TlsError};
use tokio_util::sync::CancellationToken;

use crate::cluster::ClusterNode;
use crate::metrics::names;

/// One set of TLS material that can be read again.
#[derive(Debug, Clone)]
pub(crate) enum Reloadable {
    /// The service port's (and the peer certificate it shows other nodes).
    Server(Arc<ServerTls>),
    /// A client's: `what` is `peer` (calls to other nodes) or `etcd`.
    Client { what: &'static str, tls: Arc<ClientTls> },
}

impl Reloadable {
    /// Everything this process reads TLS material for.
    pub(crate) fn of(server: Option<&Arc<ServerTls>>, cluster: Option<&ClusterNode>) -> Vec<Reloadable> {
        let mut all: Vec<Reloadable> = server.map(|tls| Reloadable::Server(Arc::clone(tls))).into_iter().collect();
        if let Some(cluster) = cluster {
            all.extend(cluster.membership.tls_material().map(|(what, tls)| Reloadable::Client { what, tls }));
        }
        all
    }

    fn name(&self) -> &'static str {
        match self {
            Reloadable::Server(_) => "server",
            Reloadable::Client { what, .. } => what,
        }
    }

    fn reload(&self) -> Result<bool, TlsError> {
        match self {
            Reloadable::Server(tls) => tls.reload(),
            Reloadable::Client { tls, .. } => tls.reload(),
        }
    }

    /// The certificates it presents, named for the expiry gauge.
    fn certificates(&self) -> Vec<(&'static str, CertificateFacts)> {
        match self {
            Reloadable::Server(tls) => tls.certificates(),
            Reloadable::Client { what, tls } => {
                let name = if *what == "peer" { "peer-client" } else { "etcd-client" };
                tls.certificate().map(|facts| (name, facts)).into_iter().collect()
            }
        }
    }
}

/// Reloads `material` every `interval` and on SIGHUP until `stopping`.
pub(crate) async fn keep_reloading(material: Vec<Reloadable>, interval: Duration, stopping: CancellationToken) {
    if material.is_empty() {
        return;
    }
    report_expiry(&material);
    let mut hangups = hangups();
    let mut tick = tokio::time::interval(interval.max(Duration::from_millis(10)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // immediate: the material was just read
    loop {
        let hangup = tokio::select! {
            _ = tick.tick() => false,
            Some(()) = next_hangup(&mut hangups) => true,
            () = stopping.cancelled() => return,
        };
        for reloadable in &material {
            // A file is read on a blocking thread: it may sit on a slow volume.
            let reading = reloadable.clone();
            let reloaded = tokio::task::spawn_blocking(move || reading.reload()).await;
            let what = reloadable.name();
            match reloaded {
                Ok(Ok(true)) => {
                    counter!(names::TLS_RELOADS, "material" => what, "result" => "changed").increment(1);
                    tracing::info!(material = what, "TLS material changed on disk; new connections use it");
                }
                Ok(Ok(false)) if hangup => tracing::info!(material = what, "SIGHUP: TLS material unchanged"),
                Ok(Ok(false)) => {}
                Ok(Err(err)) => {
                    counter!(names::TLS_RELOADS, "material" => what, "result" => "failed").increment(1);
                    tracing::error!(material = what, %err, "cannot reload TLS material; keeping the material in use");
                }
                Err(err) => tracing::error!(material = what, %err, "the TLS reload task failed"),
            }
        }
        report_expiry(&material);
    }
}

/// Sets each certificate's remaining lifetime, in seconds (negative once expired).
fn report_expiry(material: &[Reloadable]) {
    let now = SystemTime::now();
    for (certificate, facts) in material.iter().flat_map(Reloadable::certificates) {
        let seconds = match facts.not_after.duration_since(now) {
            Ok(left) => left.as_secs_f64(),
            Err(past) => -past.duration().as_secs_f64(),
        };
        gauge!(names::TLS_CERTIFICATE_EXPIRY_SECONDS, "certificate" => certificate).set(seconds);
    }
}

#[cfg(unix)]
pub(crate) type Hangups = Option<tokio::signal::unix::Signal>;
#[cfg(not(unix))]
pub(crate) type Hangups = Option<()>;

pub(crate) fn hangups() -> Hangups {
    #[cfg(unix)]
    {
        tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .inspect_err(|err| tracing::warn!(%err, "cannot listen for SIGHUP; files are reloaded by polling only"))
            .ok()
    }
    #[cfg(not(unix))]
    None
}

pub(crate) async fn next_hangup(hangups: &mut Hangups) -> Option<()> {
    #[cfg(unix)]
    if let Some(signal) = hangups {
        return signal.recv().await;
    }
    std::future::pending().await
}
