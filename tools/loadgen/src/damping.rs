//! `damping` (presenced only: the Redis design has no flap damping): `--population`
//! users, one session each, all watched by `--viewers` Watch streams, flap at
//! `--flap-rate`: a session is unregistered and registered again `--gap-ms` later (a
//! gateway's socket that drops and comes back). Without damping every flap is an
//! OFFLINE and an ONLINE for every viewer; with presenced's `--offline-grace-ms` longer
//! than the gap, none should reach them. `benches/compare.sh` runs it against a server
//! of each kind; `--grace-ms` only labels the report with the server's setting.
//!
//! Reported: OFFLINE and ONLINE updates the viewers received, per flap, and, with
//! `--metrics-addr`, how far `presenced_suppressed_flaps` moved during the run.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient};
use presence_client::{Backoff, LeaseChannel, LeaseChannelConfig, Watcher, WatcherEvent};
use tokio::sync::{Mutex, watch};
use tokio::task::JoinSet;

use crate::cli::DampingArgs;
use crate::conn::{Conn, GenItem, LeaseSink, RegItem};
use crate::ids::user_id;
use crate::phase::register_everyone;
use crate::progress::Progress;
use crate::report::Report;
use crate::rooms::{one_session_each, presenced_report};
use crate::stats::{Recorder, fmt_ns};

/// The gauge flap damping keeps.
const SUPPRESSED_FLAPS: &str = "presenced_suppressed_flaps";

/// How often a batch of flaps starts.
const TICK: Duration = Duration::from_millis(10);

/// What the viewers received.
#[derive(Debug, Default)]
struct Seen {
    offline: AtomicU64,
    online: AtomicU64,
    resyncs: AtomicU64,
}

/// What the flaps did.
#[derive(Debug, Default)]
struct Flaps {
    /// Unregisters and registers, each item at its batch's round trip.
    rec: Recorder,
    /// Unregisters that took the user OFFLINE at once.
    went_offline: u64,
    /// Registers that took the user ONLINE again (it had gone OFFLINE).
    came_online: u64,
    started: u64,
}

/// The value of an unlabelled sample `name` in a Prometheus text exposition.
pub(crate) fn metric_value(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| line.strip_prefix(name)?.strip_prefix(' ')?.trim().parse().ok())
}

async fn suppressed(addr: Option<&str>) -> Option<f64> {
    let text = crate::server::scrape(addr?).await.map_err(|e| println!("warning: {e}")).ok()?;
    metric_value(&text, SUPPRESSED_FLAPS)
}

/// Runs the scenario.
pub(crate) async fn run(args: DampingArgs, progress: Progress) -> Result<Report, String> {
    let common = &args.common;
    let endpoints = common.endpoints();
    let population = args.population.max(1);
    let shared = one_session_each(&common.gateway_id, population);
    let gap = Duration::from_millis(args.gap_ms);
    println!(
        "damping: {population} users watched by {} viewers, {} flaps/s (unregister, register {} ms later) for {:.0} s, \
         server grace {} ms, on {}",
        args.viewers,
        args.flap_rate,
        args.gap_ms,
        args.duration.as_secs_f64(),
        args.grace_ms,
        endpoints.host()
    );
    let spec = args.drive.conn_spec(common, args.drive.batch);
    let (setup, conns) = register_everyone(&spec, &shared, args.ttl_ms, 0..population, progress).await?;
    drop(conns);
    if setup.rec.ok_count() < population {
        return Err(format!(
            "only {} of {population} registers succeeded: {:?}",
            setup.rec.ok_count(),
            setup.rec.errors()
        ));
    }

    let seen = Arc::new(Seen::default());
    let (stop, stop_rx) = watch::channel(false);
    let mut viewers = Vec::new();
    let watched: Vec<String> = (0..population.min(10_000)).map(user_id).collect();
    for _ in 0..args.viewers {
        let client = PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20);
        let mut watcher = Watcher::open(client, watched.clone(), Backoff::default())
            .await
            .map_err(|s| format!("Watch refused: {s}"))?;
        let (seen, mut stop_rx) = (Arc::clone(&seen), stop_rx.clone());
        viewers.push(tokio::spawn(async move {
            loop {
                tokio::select! {
                    event = watcher.next() => match event {
                        Some(WatcherEvent::Update(u)) if u.state == pb::State::Offline as i32 => {
                            seen.offline.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(WatcherEvent::Update(_)) => {
                            seen.online.fetch_add(1, Ordering::Relaxed);
                        }
                        Some(WatcherEvent::Resynced) => {
                            seen.resyncs.fetch_add(1, Ordering::Relaxed);
                        }
                        None => break,
                    },
                    _ = stop_rx.changed() => break,
                }
            }
        }));
    }
    let before = suppressed(args.metrics_addr.as_deref()).await;

    let config = LeaseChannelConfig { max_batch: args.drive.batch.max(1) as usize, ..LeaseChannelConfig::default() };
    let channel = LeaseChannel::connect(endpoints.presenced_uri(), endpoints.lease_config(config)?)
        .await
        .map_err(|e| e.to_string())?;
    let flaps = Arc::new(Mutex::new(Flaps::default()));
    let mut batches = JoinSet::new();
    let start = Instant::now();
    let mut next = 0u64;
    while start.elapsed() < args.duration {
        let due = (start.elapsed().as_secs_f64() * args.flap_rate) as u64;
        let sessions: Vec<u64> = (next..due).map(|t| t % population).collect();
        next = due.max(next);
        if !sessions.is_empty() {
            let (shared, flaps, ttl_ms) = (Arc::clone(&shared), Arc::clone(&flaps), args.ttl_ms);
            let mut conn = Conn::Leases(LeaseSink::One(channel.clone()));
            batches.spawn(async move {
                let gone: Vec<GenItem> =
                    sessions.iter().map(|&s| GenItem { session: s, generation: shared.gens.get(s), ttl_ms }).collect();
                let sent = Instant::now();
                let answers = conn.unregister(&shared.naming, &gone).await;
                let unregistered = sent.elapsed();
                tokio::time::sleep_until((sent + gap).into()).await;
                let back: Vec<RegItem> = sessions.iter().map(|&s| RegItem { session: s, ttl_ms }).collect();
                let sent = Instant::now();
                let registered = conn.register(&shared.naming, &back, false).await;
                let latency = sent.elapsed();
                let mut flaps = flaps.lock().await;
                flaps.started += sessions.len() as u64;
                for answer in answers {
                    match answer {
                        Ok(r) => {
                            flaps.rec.ok(unregistered, 1);
                            flaps.went_offline += u64::from(r.changed);
                        }
                        Err(e) => flaps.rec.err(unregistered, e.status, &e.message),
                    }
                }
                for (item, answer) in back.iter().zip(registered) {
                    match answer {
                        Ok(r) => {
                            flaps.rec.ok(latency, 1);
                            flaps.came_online += u64::from(r.changed);
                            shared.gens.set(item.session, r.generation);
                        }
                        Err(e) => flaps.rec.err(latency, e.status, &e.message),
                    }
                }
            });
        }
        tokio::time::sleep(TICK).await;
    }
    while let Some(done) = batches.join_next().await {
        done.map_err(|e| format!("a flap batch failed: {e}"))?;
    }
    let elapsed = start.elapsed();
    // Let the last updates arrive (a damped OFFLINE would come at the end of its window).
    tokio::time::sleep(Duration::from_millis(args.grace_ms.max(args.gap_ms) + 500)).await;
    let after = suppressed(args.metrics_addr.as_deref()).await;
    let _ = stop.send(true);
    for viewer in viewers {
        let _ = viewer.await;
    }

    let flaps = Arc::try_unwrap(flaps).map_err(|_| "flap batches still running")?.into_inner();
    let (offline, online) = (seen.offline.load(Ordering::Relaxed), seen.online.load(Ordering::Relaxed));
    let per_flap = |n: u64| n as f64 / flaps.started.max(1) as f64;
    let suppressed_during = before.zip(after).map(|(b, a)| a - b);
    let call = "presence.v1.Presence.Leases (unregister, then register items)";
    let mut report = presenced_report("damping", &flaps.rec, elapsed, &endpoints, call, args.duration);
    report.tag("grace_ms", args.grace_ms);
    report.set("grace_ms", args.grace_ms);
    report.set("population", population);
    report.set("viewers", args.viewers);
    report.set("watched", watched.len());
    report.set("gap_ms", args.gap_ms);
    report.set("flap_rate", args.flap_rate);
    report.set("flaps", flaps.started);
    report.set("flaps_per_s", flaps.started as f64 / elapsed.as_secs_f64().max(1e-9));
    report.set("flap_errors", flaps.rec.count() - flaps.rec.ok_count());
    report.set("unregisters_that_went_offline", flaps.went_offline);
    report.set("registers_that_came_online", flaps.came_online);
    report.set("offline_events", offline);
    report.set("online_events", online);
    report.set("offline_events_per_flap", per_flap(offline));
    report.set("resyncs", seen.resyncs.load(Ordering::Relaxed));
    report.set("suppressed_flaps_before", before);
    report.set("suppressed_flaps_after", after);
    report.set("suppressed_flaps", suppressed_during);
    println!(
        "\nflaps: {} in {:.1} s ({} errors), {} unregisters went OFFLINE at once, {} registers came back ONLINE; batch \
         p99 {}",
        flaps.started,
        elapsed.as_secs_f64(),
        flaps.rec.count() - flaps.rec.ok_count(),
        flaps.went_offline,
        flaps.came_online,
        fmt_ns(flaps.rec.percentile_ns(99.0))
    );
    println!(
        "viewers received {offline} OFFLINE ({:.2} per flap, {} viewers) and {online} ONLINE updates, {} resyncs; \
         {SUPPRESSED_FLAPS} moved by {}",
        per_flap(offline),
        args.viewers,
        seen.resyncs.load(Ordering::Relaxed),
        suppressed_during.map_or_else(|| "- (no --metrics-addr)".into(), |n| format!("{n:.0}"))
    );
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metric_values_are_read_from_the_exposition() {
        let text = "HTTP/1.1 200 OK\r\n\r\n# TYPE presenced_suppressed_flaps gauge\npresenced_suppressed_flaps 42\n\
                    presenced_suppressed_flaps_other 7\npresenced_viewers{shard=\"0\"} 3\n";
        assert_eq!(metric_value(text, SUPPRESSED_FLAPS), Some(42.0));
        assert_eq!(metric_value(text, "presenced_viewers"), None, "labelled samples are not read");
        assert_eq!(metric_value("", SUPPRESSED_FLAPS), None);
    }
}
