//! `resume`: a reconnect storm of viewers that missed nothing (E8).
//!
//! V viewers open a Watch of W users each (drawn from a population of which
//! half is ONLINE) and keep the versions of their opening snapshots. Then all
//! of them reopen at once, twice: first as a viewer that resumes nothing
//! would (a whole snapshot each), then saying in `known_versions` what they
//! hold. Nothing changes in between, so a resumed snapshot should carry no
//! user at all. Reported for each storm: the bytes of the opening snapshots
//! (protobuf encoding of the `WatchEvent`, without HTTP/2 framing), the bytes
//! of the requests, and the time from the first reopen to the last snapshot.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use presence_client::pb::{self, presence_client::PresenceClient, watch_event};
use prost::Message;
use serde_json::json;
use tokio::task::JoinSet;

use crate::cli::ResumeArgs;
use crate::ids::{Rng, sample_distinct, user_id};
use crate::progress::Progress;
use crate::report::Report;
use crate::stats::Recorder;

/// What one storm cost.
#[derive(Debug, Default, Clone, Copy)]
struct Storm {
    response_bytes: u64,
    request_bytes: u64,
    users_sent: u64,
    partial: u64,
    elapsed: Duration,
}

pub(crate) async fn run(args: ResumeArgs, progress: Progress) -> Result<Report, String> {
    let endpoints = args.common.endpoints();
    let population = args.population.max(1);
    let watch = args.watch.min(population);
    println!(
        "resume: {} viewers x {watch} users out of {population} ({} online), reopening at once without and with \
         known_versions, on {}",
        args.viewers,
        population / 2,
        endpoints.host()
    );
    let channel = endpoints.grpc_channel().await?;
    let client = PresenceClient::new(channel).max_decoding_message_size(64 << 20);

    // Every other user ONLINE.
    let bar = progress.items("registers", population / 2);
    let mut registers = JoinSet::new();
    for chunk in (0..population).step_by(2).collect::<Vec<_>>().chunks(256) {
        let (mut client, chunk) = (client.clone(), chunk.to_vec());
        registers.spawn(async move {
            for n in chunk {
                let request = pb::RegisterRequest {
                    user_id: user_id(n),
                    session_id: "s".into(),
                    gateway_id: "loadgen".into(),
                    ttl_ms: args.ttl_ms,
                    ..Default::default()
                };
                client.register(request).await.map_err(|s| format!("Register refused: {s}"))?;
            }
            Ok::<u64, String>(0)
        });
    }
    while let Some(done) = registers.join_next().await {
        done.map_err(|e| e.to_string())??;
        bar.inc(256);
    }
    bar.finish();

    let sets: Vec<Vec<String>> = (0..args.viewers)
        .map(|v| sample_distinct(&mut Rng::new(v), population, watch).into_iter().map(user_id).collect())
        .collect();
    // The first opening, to learn the versions.
    let (first, held) = storm(&args, &endpoints, &sets, None).await?;
    let held = held.ok_or("no versions were kept")?;
    // The storms: nothing changed since.
    let (whole, _) = storm(&args, &endpoints, &sets, None).await?;
    let (resumed, _) = storm(&args, &endpoints, &sets, Some(&held)).await?;

    let ratio = whole.response_bytes as f64 / resumed.response_bytes.max(1) as f64;
    let row = |name: &str, s: &Storm| {
        println!(
            "{name}: {} snapshot bytes ({} users sent, {} partial), {} request bytes, all {} viewers in {:.1} ms",
            s.response_bytes,
            s.users_sent,
            s.partial,
            s.request_bytes,
            args.viewers,
            s.elapsed.as_secs_f64() * 1e3
        );
        json!({
            "response_bytes": s.response_bytes,
            "request_bytes": s.request_bytes,
            "users_sent": s.users_sent,
            "partial_snapshots": s.partial,
            "elapsed_ms": s.elapsed.as_secs_f64() * 1e3,
        })
    };
    let first = row("first opening", &first);
    let whole_json = row("storm without resume", &whole);
    let resumed_json = row("storm with known_versions", &resumed);
    println!("snapshot bytes: {ratio:.1}x fewer with known_versions");

    let mut report = Report::from_recorder("resume", &Recorder::default(), whole.elapsed + resumed.elapsed, "normal");
    report.tag("target", "presenced");
    report.tag("viewers", args.viewers);
    report.tag("watch", watch);
    report.tag("population", population);
    report.set("first", first);
    report.set("storm_whole", whole_json);
    report.set("storm_resumed", resumed_json);
    report.set("response_bytes_ratio", ratio);
    Ok(report)
}

/// Opens every viewer's Watch at once (with `known` versions, if given),
/// reads the opening snapshots and closes the streams; returns the cost and,
/// for a storm without `known`, the versions each viewer now holds.
async fn storm(
    args: &ResumeArgs,
    endpoints: &crate::conn::Endpoints,
    sets: &[Vec<String>],
    known: Option<&Vec<HashMap<String, u64>>>,
) -> Result<(Storm, Option<Vec<HashMap<String, u64>>>), String> {
    let mut clients = Vec::new();
    for _ in 0..(sets.len() as u64).div_ceil(args.viewers_per_connection.max(1)) {
        clients.push(PresenceClient::new(endpoints.grpc_channel().await?).max_decoding_message_size(64 << 20));
    }
    let started = Instant::now();
    let mut viewers = JoinSet::new();
    for (i, set) in sets.iter().enumerate() {
        let mut client = clients[i / args.viewers_per_connection.max(1) as usize].clone();
        let request = pb::WatchRequest {
            user_ids: set.clone(),
            known_versions: known.map(|known| known[i].clone().into_iter().collect()).unwrap_or_default(),
            ..Default::default()
        };
        viewers.spawn(async move {
            let request_bytes = request.encoded_len() as u64;
            let mut stream = client.watch(request).await.map_err(|s| format!("Watch refused: {s}"))?.into_inner();
            let event = stream.message().await.map_err(|s| format!("Watch broke: {s}"))?.ok_or("Watch ended")?;
            let response_bytes = event.encoded_len() as u64;
            let Some(watch_event::Event::Snapshot(snapshot)) = event.event else {
                return Err("a Watch opened with something other than a snapshot".to_string());
            };
            let versions: HashMap<String, u64> =
                snapshot.users.iter().map(|u| (u.user_id.clone(), u.version)).collect();
            Ok((i, request_bytes, response_bytes, snapshot.partial, versions))
        });
    }
    let mut cost = Storm::default();
    let mut held = vec![HashMap::new(); sets.len()];
    while let Some(done) = viewers.join_next().await {
        let (i, request_bytes, response_bytes, partial, versions) = done.map_err(|e| e.to_string())??;
        cost.request_bytes += request_bytes;
        cost.response_bytes += response_bytes;
        cost.users_sent += versions.len() as u64;
        cost.partial += u64::from(partial);
        held[i] = versions;
    }
    cost.elapsed = started.elapsed();
    Ok((cost, known.is_none().then_some(held)))
}
