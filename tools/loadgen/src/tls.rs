//! What TLS costs the server beyond the bytes it encrypts (presenced only;
//! the Redis design has no TLS of its own here).
//!
//! - `tls-handshakes`: a storm of `--clients` clients that connect at once
//!   (`--concurrency` at a time), each with a full TLS 1.3 handshake and one
//!   Snapshot, then the same clients again, each resuming its own session
//!   from the ticket the server gave it (as clients reconnecting after a
//!   restart of their own network do). For each storm: the time until every
//!   client was served, handshakes per second, and with `--server-pid` the
//!   server's CPU per handshake and so handshakes per second per core.
//! - `idle-connections`: `--connections` connections that each make one call
//!   and then stay open, idle; with `--server-pid`, the server's resident
//!   memory per connection. Run against a plaintext and a TLS server
//!   (`--tls`) to compare the two.

use std::sync::Arc;
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient};
use presence_tls::{ClientTls, ClientTlsFiles};
use rustls::pki_types::ServerName;
use serde_json::json;
use tokio::net::TcpStream;
use tokio::sync::Semaphore;
use tokio::task::JoinSet;

use crate::cli::{HandshakeArgs, IdleArgs};
use crate::direct::DirectChannel;
use crate::progress::Progress;
use crate::report::Report;
use crate::server_cpu::cpu_ns;
use crate::stats::Recorder;

/// One client's connection: TCP, the TLS handshake with `config` (none:
/// plaintext), HTTP/2, one Snapshot; whether the handshake resumed a session.
async fn connect_and_call(
    addr: &str,
    origin: &http::Uri,
    config: Option<Arc<rustls::ClientConfig>>,
) -> Result<(bool, PresenceClient<DirectChannel>), String> {
    let tcp = TcpStream::connect(addr).await.map_err(|e| format!("connect: {e}"))?;
    tcp.set_nodelay(true).map_err(|e| e.to_string())?;
    let Some(config) = config else {
        let mut client =
            PresenceClient::new(DirectChannel::over(hyper_util::rt::TokioIo::new(tcp), origin.clone()).await?);
        client.snapshot(pb::SnapshotRequest::default()).await.map_err(|status| format!("Snapshot: {status}"))?;
        return Ok((false, client));
    };
    let host = origin.host().unwrap_or("localhost").trim_start_matches('[').trim_end_matches(']').to_owned();
    let name = ServerName::try_from(host).map_err(|e| e.to_string())?;
    let tls =
        tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.map_err(|e| format!("handshake: {e}"))?;
    let resumed = tls.get_ref().1.handshake_kind() == Some(rustls::HandshakeKind::Resumed);
    let channel = DirectChannel::over(hyper_util::rt::TokioIo::new(tls), origin.clone()).await?;
    let mut client = PresenceClient::new(channel);
    client.snapshot(pb::SnapshotRequest::default()).await.map_err(|status| format!("Snapshot: {status}"))?;
    Ok((resumed, client))
}

/// One storm: every client connects and calls, `concurrency` at a time,
/// while a client connected before it makes one Snapshot after another on
/// its connection (a connection already served): its latency before and
/// during the storm says whether the handshakes starve it.
async fn storm(
    addr: &str,
    origin: &http::Uri,
    clients: &[Option<Arc<rustls::ClientConfig>>],
    concurrency: usize,
    progress: &Progress,
    what: &str,
) -> Result<serde_json::Value, String> {
    let (_, served) = connect_and_call(addr, origin, clients[0].clone()).await?;
    let quiet = probe(served.clone(), Duration::from_millis(500)).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let during = tokio::spawn(probe_until(served, stopped));
    let bar = progress.items(what, clients.len() as u64);
    let places = Arc::new(Semaphore::new(concurrency.max(1)));
    let mut tasks = JoinSet::new();
    let started = Instant::now();
    for config in clients {
        let (places, addr, origin, config) = (Arc::clone(&places), addr.to_owned(), origin.clone(), config.clone());
        tasks.spawn(async move {
            let _place = places.acquire_owned().await.expect("never closed");
            let began = Instant::now();
            let answer = connect_and_call(&addr, &origin, config).await.map(|(resumed, _)| resumed);
            (began.elapsed(), answer)
        });
    }
    let (mut resumed, mut errors, mut rec) = (0u64, Vec::new(), Recorder::default());
    while let Some(done) = tasks.join_next().await {
        let (took, answer) = done.map_err(|e| e.to_string())?;
        bar.inc(1);
        match answer {
            Ok(was_resumed) => {
                rec.ok(took, 1);
                resumed += u64::from(was_resumed);
            }
            Err(err) => errors.push(err),
        }
    }
    let elapsed = started.elapsed();
    let _ = stop.send(());
    let during = during.await.map_err(|e| e.to_string())?;
    bar.finish();
    if let Some(first) = errors.first() {
        return Err(format!("{} of {} clients failed; the first: {first}", errors.len(), clients.len()));
    }
    let served = clients.len() as f64;
    Ok(json!({
        "clients": clients.len(),
        "resumed": resumed,
        "all_served_ms": elapsed.as_secs_f64() * 1e3,
        "handshakes_per_s": served / elapsed.as_secs_f64(),
        "p50_ms": rec.percentile_ns(50.0) as f64 / 1e6,
        "p99_ms": rec.percentile_ns(99.0) as f64 / 1e6,
        "served_connection_p99_ms_quiet": quiet.percentile_ns(99.0) as f64 / 1e6,
        "served_connection_p99_ms_during": during.percentile_ns(99.0) as f64 / 1e6,
        "served_connection_calls_during": during.ok_count(),
    }))
}

/// Snapshots one after another on `client` for `length`.
async fn probe(client: PresenceClient<DirectChannel>, length: Duration) -> Recorder {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let probing = tokio::spawn(probe_until(client, stopped));
    tokio::time::sleep(length).await;
    let _ = stop.send(());
    probing.await.unwrap_or_default()
}

/// Snapshots one after another on `client` until `stop`.
async fn probe_until(
    mut client: PresenceClient<DirectChannel>,
    mut stop: tokio::sync::oneshot::Receiver<()>,
) -> Recorder {
    let mut rec = Recorder::default();
    loop {
        let began = Instant::now();
        tokio::select! {
            answer = client.snapshot(pb::SnapshotRequest::default()) => match answer {
                Ok(_) => rec.ok(began.elapsed(), 1),
                Err(status) => rec.err(began.elapsed(), "error", status.message()),
            },
            _ = &mut stop => return rec,
        }
    }
}

/// The server's CPU time (ns) around `work`, with `--server-pid`.
async fn with_server_cpu<T>(pid: Option<u32>, work: impl Future<Output = T>) -> (T, Option<u64>) {
    let before = pid.and_then(|pid| cpu_ns(pid).ok());
    let out = work.await;
    let after = pid.and_then(|pid| cpu_ns(pid).ok());
    (out, before.zip(after).map(|(before, after)| after.saturating_sub(before)))
}

pub(crate) async fn handshakes(args: HandshakeArgs, progress: Progress) -> Result<Report, String> {
    let endpoints = args.common.endpoints();
    let origin: http::Uri = endpoints.presenced_uri().parse().map_err(|e| format!("--addr: {e}"))?;
    let addr = origin.authority().map(ToString::to_string).ok_or("--addr has no host:port")?;
    let Some(files) = &endpoints.tls else {
        // Plaintext: the same storm without TLS, the cost of a connection and its first call alone.
        println!(
            "tls-handshakes (plaintext baseline): {} clients, {} at a time, on {addr}",
            args.clients, args.concurrency
        );
        let clients = vec![None; args.clients.max(1)];
        let (plain, cpu) =
            with_server_cpu(args.server_pid, storm(&addr, &origin, &clients, args.concurrency, &progress, "plain"))
                .await;
        let mut plain = plain?;
        per_connection_cpu(&mut plain, cpu, args.clients);
        println!("plaintext: {plain}");
        let total = Duration::from_secs_f64(plain["all_served_ms"].as_f64().unwrap_or(0.0) / 1e3);
        let mut report = Report::from_recorder("tls-handshakes", &Recorder::default(), total, "normal");
        report.set("clients", args.clients);
        report.set("concurrency", args.concurrency);
        report.set("plaintext", plain);
        return Ok(report);
    };
    let tls = ClientTls::load(ClientTlsFiles::new(files.ca.clone(), files.cert.clone(), files.key.clone()))
        .map_err(|e| e.to_string())?;
    println!(
        "tls-handshakes: {} clients, {} at a time, full handshakes then resumed ones, on {}",
        args.clients, args.concurrency, addr
    );
    // Each client its own session cache, as separate processes have.
    let clients: Vec<_> = (0..args.clients.max(1)).map(|_| Some(tls.config_of_one_client(4))).collect();
    let (full, full_cpu) =
        with_server_cpu(args.server_pid, storm(&addr, &origin, &clients, args.concurrency, &progress, "full")).await;
    let mut full = full?;
    // The server sends its tickets just after the handshake: let the last ones land.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let (resumed, resumed_cpu) =
        with_server_cpu(args.server_pid, storm(&addr, &origin, &clients, args.concurrency, &progress, "resumed")).await;
    let mut resumed = resumed?;
    per_connection_cpu(&mut full, full_cpu, args.clients);
    per_connection_cpu(&mut resumed, resumed_cpu, args.clients);
    println!("full:    {full}\nresumed: {resumed}");
    let total = Duration::from_secs_f64(
        (full["all_served_ms"].as_f64().unwrap_or(0.0) + resumed["all_served_ms"].as_f64().unwrap_or(0.0)) / 1e3,
    );
    let mut report = Report::from_recorder("tls-handshakes", &Recorder::default(), total, "normal");
    report.set("clients", args.clients);
    report.set("concurrency", args.concurrency);
    report.set("full", full);
    report.set("resumed", resumed);
    Ok(report)
}

/// Adds the server's CPU per connection (and so connections per core per second) to `storm`.
fn per_connection_cpu(storm: &mut serde_json::Value, cpu: Option<u64>, clients: usize) {
    if let Some(ns) = cpu {
        let us = ns as f64 / 1e3 / clients.max(1) as f64;
        storm["server_cpu_us_per_connection"] = json!(us);
        storm["per_core_per_s"] = json!(1e6 / us);
    }
}

pub(crate) async fn idle(args: IdleArgs, progress: Progress) -> Result<Report, String> {
    let endpoints = args.common.endpoints();
    println!(
        "idle-connections: {} connections ({}), one call each, then idle, on {}",
        args.connections,
        if endpoints.tls.is_some() { "TLS" } else { "plaintext" },
        endpoints.host()
    );
    let rss = |pid: Option<u32>| pid.and_then(|pid| crate::memory::rss_bytes(pid).ok());
    let before = rss(args.server_pid);
    let bar = progress.items("connections", args.connections);
    let mut held = Vec::with_capacity(args.connections as usize);
    for _ in 0..args.connections {
        let mut client = PresenceClient::new(DirectChannel::connect(&endpoints).await?);
        client.snapshot(pb::SnapshotRequest::default()).await.map_err(|status| format!("Snapshot: {status}"))?;
        held.push(client);
        bar.inc(1);
    }
    bar.finish();
    // Let the server settle its buffers before reading its memory.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = rss(args.server_pid);
    let per_connection =
        before.zip(after).map(|(before, after)| after.saturating_sub(before) as f64 / args.connections as f64);
    println!("resident memory per idle connection: {per_connection:?} bytes");
    let mut report = Report::from_recorder("idle-connections", &Recorder::default(), Duration::ZERO, "normal");
    report.set("connections", args.connections);
    report.set("tls", endpoints.tls.is_some());
    report.set("rss_before_bytes", before);
    report.set("rss_after_bytes", after);
    report.set("bytes_per_connection", per_connection);
    drop(held);
    Ok(report)
}
