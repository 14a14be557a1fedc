//! h2load as an outside witness of presenced's unary `Renew` figures.
//!
//! h2load (nghttp2) knows nothing of gRPC or of this generator, so its numbers check
//! that the generator's client stack (tonic, its own scheduling) neither flatters nor
//! penalises the server. It sends one request body over and over, so:
//!
//! - `h2load-prepare` registers one session on presenced and writes its `RenewRequest`
//!   as a gRPC message frame (the file h2load's `-d` sends). Every h2load request then
//!   renews that one session: the hot-user case, one shard lock, which is why
//!   `compare.sh` also runs the generator against one session with the same layout.
//!   It sends the written file's Renew once itself and fails unless it is answered OK,
//!   so that h2load never measures a stream of NOT_FOUNDs.
//! - `h2load-report` turns the run into a report in ghz's shape. h2load only sees HTTP
//!   status 200, which gRPC answers even for errors (the code is in the trailers), so
//!   the gRPC outcomes come from presenced's own counter of renewals by result
//!   (`presenced_renewals_total{result}`, read from `--metrics-listen` before and after
//!   the run), and the latency percentiles from h2load's `--log-file` (one line per
//!   request), since h2load prints only min, max, mean and deviation.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::{Duration, Instant};

use presence_client::pb;
use presence_proto::v1::presence_client::PresenceClient;
use prost::Message;
use serde_json::json;

use crate::cli::{H2loadPrepareArgs, H2loadReportArgs};
use crate::conn::TargetKind;
use crate::report::Report;
use crate::stats::{Recorder, code_name, fmt_ns};

/// The length of a gRPC message frame's header: a compressed flag and a 4-byte length.
const FRAME_HEADER: usize = 5;

/// `message` as one gRPC message frame: flag 0 (not compressed), its length as a
/// big-endian u32, its bytes.
pub(crate) fn grpc_frame(message: &impl Message) -> Vec<u8> {
    let body = message.encode_to_vec();
    let mut frame = Vec::with_capacity(FRAME_HEADER + body.len());
    frame.push(0);
    frame.extend_from_slice(&(body.len() as u32).to_be_bytes());
    frame.extend_from_slice(&body);
    frame
}

/// The message inside a file that holds exactly one uncompressed gRPC frame.
pub(crate) fn frame_body(bytes: &[u8]) -> Result<&[u8], String> {
    let Some((header, body)) = bytes.split_at_checked(FRAME_HEADER) else {
        return Err(format!("{} bytes: shorter than a gRPC frame header", bytes.len()));
    };
    if header[0] != 0 {
        return Err(format!("compressed flag {} (h2load's requests carry no grpc-encoding)", header[0]));
    }
    let len = u32::from_be_bytes([header[1], header[2], header[3], header[4]]) as usize;
    if len != body.len() {
        return Err(format!("the header says {len} bytes, {} follow", body.len()));
    }
    Ok(body)
}

fn presenced_only(target: TargetKind) -> Result<(), String> {
    match target {
        TargetKind::Presenced => Ok(()),
        TargetKind::Redis => Err("h2load drives presenced's gRPC only (there is no Redis equivalent)".into()),
    }
}

/// `h2load-prepare`.
// Requests gain fields as the API grows; the defaults are what the generator means.
#[allow(clippy::needless_update)]
pub(crate) async fn prepare(args: H2loadPrepareArgs) -> Result<Report, String> {
    let common = &args.common;
    presenced_only(common.target)?;
    let endpoints = common.endpoints();
    let mut client = PresenceClient::new(endpoints.grpc_channel().await?);
    let registered = client
        .register(pb::RegisterRequest {
            user_id: args.user_id.clone(),
            session_id: args.session_id.clone(),
            gateway_id: common.gateway_id.clone(),
            ttl_ms: args.ttl_ms,
            ..Default::default()
        })
        .await
        .map_err(|s| format!("Register refused: {} {}", code_name(s.code() as i32), s.message()))?
        .into_inner();
    let renew = pb::RenewRequest {
        user_id: args.user_id.clone(),
        session_id: args.session_id.clone(),
        generation: registered.generation,
        ttl_ms: args.ttl_ms,
        ..Default::default()
    };
    std::fs::write(&args.out, grpc_frame(&renew)).map_err(|e| format!("cannot write {}: {e}", args.out.display()))?;

    // Send what h2load will send: the file as written, read back and decoded.
    let written = std::fs::read(&args.out).map_err(|e| format!("cannot read {}: {e}", args.out.display()))?;
    let body = frame_body(&written).map_err(|e| format!("{}: {e}", args.out.display()))?;
    let decoded =
        pb::RenewRequest::decode(body).map_err(|e| format!("{}: not a RenewRequest: {e}", args.out.display()))?;
    let sent = Instant::now();
    let answer = client.renew(decoded).await.map_err(|s| {
        format!(
            "the file's Renew was answered {}: {} (h2load would measure errors)",
            code_name(s.code() as i32),
            s.message()
        )
    })?;
    let mut rec = Recorder::default();
    rec.ok(sent.elapsed(), 1);

    let mut report = Report::from_recorder("h2load-prepare", &rec, sent.elapsed(), "normal");
    report.options.host = endpoints.host();
    report.options.call = "presence.v1.Presence.Renew".into();
    report.set("file", args.out.display().to_string());
    report.set("frame_bytes", written.len());
    report.set("user_id", &args.user_id);
    report.set("session_id", &args.session_id);
    report.set("generation", registered.generation);
    report.set("ttl_ms", args.ttl_ms);
    report.set("check_throttled", answer.get_ref().throttled);
    println!(
        "h2load data: {} ({} bytes), a Renew of {}/{} at generation {}; sent once from the file: OK{}",
        args.out.display(),
        written.len(),
        args.user_id,
        args.session_id,
        registered.generation,
        if answer.get_ref().throttled { " (throttled: start presenced with --min-renew-interval-ms 0)" } else { "" }
    );
    Ok(report)
}

/// What h2load printed at the end of a run.
#[derive(Debug, Clone, Default, PartialEq)]
pub(crate) struct H2loadSummary {
    /// `finished in X`: the measured duration, seconds.
    pub(crate) finished_s: Option<f64>,
    /// `..., N req/s`: h2load's own rate (requests done over that duration).
    pub(crate) req_per_s: Option<f64>,
    /// `requests: N total, N started, N done, N succeeded, N failed, N errored, N timeout`.
    pub(crate) requests: BTreeMap<String, u64>,
    /// `status codes: N 2xx, N 3xx, N 4xx, N 5xx`.
    pub(crate) status_codes: BTreeMap<String, u64>,
    /// `time for request:` min, max, mean, sd, in ns.
    pub(crate) time_for_request_ns: Option<[u64; 4]>,
}

/// `123us`, `1.04ms`, `2.5s` (h2load's durations) in ns.
fn h2load_duration_ns(s: &str) -> Option<u64> {
    let (num, scale) = if let Some(n) = s.strip_suffix("us") {
        (n, 1e3)
    } else if let Some(n) = s.strip_suffix("ms") {
        (n, 1e6)
    } else if let Some(n) = s.strip_suffix('s') {
        (n, 1e9)
    } else {
        return None;
    };
    num.parse::<f64>().ok().map(|v| (v * scale).round() as u64)
}

/// `N word, N word, ...` into `word -> N`.
fn counts(list: &str) -> BTreeMap<String, u64> {
    list.split(',')
        .filter_map(|part| {
            let mut it = part.split_whitespace();
            let n = it.next()?.parse().ok()?;
            Some((it.next()?.to_owned(), n))
        })
        .collect()
}

/// Reads h2load's closing summary out of its standard output.
pub(crate) fn parse_h2load_output(text: &str) -> H2loadSummary {
    let mut out = H2loadSummary::default();
    for line in text.lines().map(str::trim) {
        if let Some(rest) = line.strip_prefix("finished in ") {
            let mut parts = rest.split(',').map(str::trim);
            out.finished_s = parts.next().and_then(h2load_duration_ns).map(|ns| ns as f64 / 1e9);
            out.req_per_s = parts.next().and_then(|p| p.strip_suffix(" req/s")).and_then(|n| n.parse().ok());
        } else if let Some(rest) = line.strip_prefix("requests:") {
            out.requests = counts(rest);
        } else if let Some(rest) = line.strip_prefix("status codes:") {
            out.status_codes = counts(rest);
        } else if let Some(rest) = line.strip_prefix("time for request:") {
            let v: Vec<u64> = rest.split_whitespace().take(4).filter_map(h2load_duration_ns).collect();
            out.time_for_request_ns = <[u64; 4]>::try_from(v).ok();
        }
    }
    out
}

/// What h2load's `--log-file` holds: per request, its start (µs since the epoch), its
/// HTTP status (-1 for a failed stream) and its duration (µs).
#[derive(Debug, Clone, Default)]
pub(crate) struct LogSummary {
    /// Requests with status 200 as successes, others as errors.
    pub(crate) rec: Recorder,
    /// Requests per HTTP status.
    pub(crate) http: BTreeMap<i64, u64>,
    /// First start to last end, µs.
    pub(crate) span_us: u64,
    /// Lines that did not parse.
    pub(crate) bad_lines: u64,
}

/// Reads h2load's `--log-file`.
pub(crate) fn parse_h2load_log(text: &str) -> LogSummary {
    let mut out = LogSummary::default();
    let (mut first, mut last) = (u64::MAX, 0u64);
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let mut cols = line.split('\t').map(str::trim);
        let parsed = (|| {
            Some((
                cols.next()?.parse::<u64>().ok()?,
                cols.next()?.parse::<i64>().ok()?,
                cols.next()?.parse::<u64>().ok()?,
            ))
        })();
        let Some((start_us, status, dur_us)) = parsed else {
            out.bad_lines += 1;
            continue;
        };
        first = first.min(start_us);
        last = last.max(start_us + dur_us);
        *out.http.entry(status).or_default() += 1;
        let latency = Duration::from_micros(dur_us);
        if status == 200 {
            out.rec.ok(latency, 1);
        } else {
            out.rec.err(latency, "Unknown", &format!("HTTP status {status} in h2load's log (-1: the stream failed)"));
        }
    }
    out.span_us = last.saturating_sub(first.min(last));
    out
}

/// Counter values of a Prometheus text exposition, by `name{labels}` as written.
pub(crate) fn parse_prometheus(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#'))
        .filter_map(|l| {
            // The value is the last field; a label value may hold spaces, so split from the right.
            let (key, value) = l.trim().rsplit_once(' ')?;
            Some((key.trim().to_owned(), value.parse().ok()?))
        })
        .collect()
}

/// `presenced_renewals_total` by result, after minus before.
pub(crate) fn renewal_deltas(before: &BTreeMap<String, f64>, after: &BTreeMap<String, f64>) -> BTreeMap<String, u64> {
    const PREFIX: &str = "presenced_renewals_total{result=\"";
    after
        .iter()
        .filter_map(|(k, v)| {
            let result = k.strip_prefix(PREFIX)?.strip_suffix("\"}")?;
            let was = before.get(k).copied().unwrap_or(0.0);
            Some((result.to_owned(), (v - was).max(0.0) as u64))
        })
        .collect()
}

/// The gRPC status a renewal result is answered with (ghz's spelling).
fn grpc_status_of(result: &str) -> &'static str {
    match result {
        "ok" | "throttled" => "OK",
        "not_found" => "NotFound",
        "stale_generation" => "FailedPrecondition",
        "invalid" => "InvalidArgument",
        "shed" => "ResourceExhausted",
        _ => "Unknown",
    }
}

/// The gRPC status of each of h2load's requests, as far as the server's counters tell:
/// `succeeded` HTTP 200s and `failed_streams` that never got an answer.
///
/// The server also answers the requests still in flight when h2load stops counting, so
/// its counts may exceed h2load's: its refusals are taken as they are, and h2load's HTTP
/// 200s less those are the OKs, as far as the server counted that many. HTTP 200s it
/// counted neither as OK nor as refused are `Unknown` (refused before a renewal is
/// counted: say UNAUTHENTICATED); failed streams are `Unavailable`.
pub(crate) fn grpc_codes(deltas: &BTreeMap<String, u64>, succeeded: u64, failed_streams: u64) -> BTreeMap<String, u64> {
    let server_ok: u64 = deltas.iter().filter(|(r, _)| grpc_status_of(r) == "OK").map(|(_, n)| n).sum();
    let mut codes: BTreeMap<String, u64> = BTreeMap::new();
    for (result, n) in deltas.iter().filter(|(r, _)| grpc_status_of(r) != "OK") {
        *codes.entry(grpc_status_of(result).to_owned()).or_default() += n;
    }
    let refused: u64 = codes.values().sum();
    let ok_claimed = succeeded.saturating_sub(refused);
    let ok = ok_claimed.min(server_ok);
    codes.insert("OK".into(), ok);
    codes.insert("Unknown".into(), ok_claimed - ok);
    codes.insert("Unavailable".into(), failed_streams);
    codes.retain(|_, n| *n > 0);
    codes
}

fn read(path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))
}

/// `h2load-report`.
pub(crate) fn report(args: H2loadReportArgs) -> Result<Report, String> {
    presenced_only(args.common.target)?;
    let summary = parse_h2load_output(&read(&args.output)?);
    let log = parse_h2load_log(&read(&args.log)?);
    if log.rec.count() == 0 {
        return Err(format!("{}: no requests in h2load's log", args.log.display()));
    }
    let elapsed = summary.finished_s.map_or(Duration::from_micros(log.span_us), Duration::from_secs_f64);
    let mut report = Report::from_recorder("h2load", &log.rec, elapsed, "timeout");
    if let Some(rps) = summary.req_per_s {
        report.rps = rps;
    }
    report.options.host = args.common.addr.clone();
    report.options.call = "presence.v1.Presence.Renew (h2load, one pre-framed request)".into();
    report.options.connections = args.connections;
    report.options.concurrency = args.concurrency;
    report.tag("target", "presenced");
    report.tag("client", "h2load");

    let done = summary.requests.get("done").copied().unwrap_or(log.rec.count());
    let succeeded = summary.requests.get("succeeded").copied().unwrap_or(log.rec.ok_count());
    let mut grpc = json!(null);
    if let (Some(b), Some(a)) = (&args.metrics_before, &args.metrics_after) {
        let deltas = renewal_deltas(&parse_prometheus(&read(b)?), &parse_prometheus(&read(a)?));
        let answered: u64 = deltas.values().sum();
        let codes = grpc_codes(&deltas, succeeded, log.rec.count() - log.rec.ok_count());
        let ok = codes.get("OK").copied().unwrap_or(0);
        // The status distribution is the server's: h2load's HTTP statuses say nothing of gRPC's.
        report.status_code_distribution = codes.clone();
        grpc = json!({
            "renewals_by_result": deltas,
            "by_code": codes,
            "answered": answered,
            "ok": ok,
            "errors": codes.values().sum::<u64>() - ok,
            // Renewals the server answered that h2load did not count as done: those in
            // flight when its duration ran out.
            "answered_after_h2load_stopped": answered.saturating_sub(done),
        });
    }
    let p = |q: f64| log.rec.percentile_ns(q);
    report.set("client", "h2load");
    report.set("command", args.command.as_deref().unwrap_or(""));
    report.set("h2load_req_per_s", summary.req_per_s);
    report.set("h2load_finished_s", summary.finished_s);
    report.set("h2load_requests", &summary.requests);
    report.set("h2load_status_codes", &summary.status_codes);
    report.set(
        "h2load_time_for_request_ns",
        summary.time_for_request_ns.map(|[min, max, mean, sd]| json!({"min": min, "max": max, "mean": mean, "sd": sd})),
    );
    report.set("log_requests", log.rec.count());
    report.set("log_http_status", log.http.iter().map(|(k, v)| (k.to_string(), *v)).collect::<BTreeMap<_, _>>());
    report.set("log_bad_lines", log.bad_lines);
    report.set(
        "percentiles_ns",
        json!({"p50": p(50.0), "p90": p(90.0), "p99": p(99.0), "p999": p(99.9), "max": log.rec.slowest_ns()}),
    );
    report.set("grpc", &grpc);

    print!("{}", report.summary("h2load Renew (latency from its --log-file, statuses from presenced's metrics):"));
    println!(
        "\n  h2load: {} req/s over {} s, {} done, {} succeeded (HTTP); p50 {} p99 {} p99.9 {}",
        summary.req_per_s.map_or("?".into(), |r| format!("{r:.0}")),
        summary.finished_s.map_or("?".into(), |s| format!("{s:.2}")),
        done,
        succeeded,
        fmt_ns(p(50.0)),
        fmt_ns(p(99.0)),
        fmt_ns(p(99.9)),
    );
    if grpc.is_null() {
        println!("  no metrics given: the gRPC outcomes are unknown (h2load sees HTTP 200 for gRPC errors too)");
    } else {
        println!("  gRPC outcomes counted by presenced: {}", grpc["renewals_by_result"]);
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_frame_decodes_as_the_renew_request() {
        let renew = pb::RenewRequest {
            user_id: "h2load-u0".into(),
            session_id: "sess_h2load000001".into(),
            generation: 1_812_345_678_901_234_567,
            ttl_ms: 600_000,
            ..Default::default()
        };
        let frame = grpc_frame(&renew);
        assert_eq!(frame[0], 0, "not compressed");
        assert_eq!(u32::from_be_bytes([frame[1], frame[2], frame[3], frame[4]]) as usize, frame.len() - 5);
        let decoded = pb::RenewRequest::decode(frame_body(&frame).unwrap()).unwrap();
        assert_eq!(decoded, renew);
        assert!(frame_body(&frame[..frame.len() - 1]).is_err(), "truncated");
        assert!(frame_body(&frame[..3]).is_err(), "no header");
        let mut compressed = frame.clone();
        compressed[0] = 1;
        assert!(frame_body(&compressed).is_err());
    }

    const OUTPUT: &str = "starting benchmark...
spawning thread #0: 2 total client(s). 0 total requests
Application protocol: h2c

finished in 20.00s, 61234.50 req/s, 5.12MB/s
requests: 1224690 total, 1224754 started, 1224690 done, 1224689 succeeded, 1 failed, 1 errored, 0 timeout
status codes: 1224689 2xx, 0 3xx, 0 4xx, 0 5xx
traffic: 80.12MB (84012345) total, 10.01MB (10495633) headers (space savings 95.01%), 30.01MB (31466456) data
                     min         max         mean         sd        +/- sd
time for request:      123us     12.34ms      1.04ms       456us    78.90%
time for connect:      160us       1.2ms       800us       200us    70.00%
";

    #[test]
    fn h2load_summary_parses() {
        let s = parse_h2load_output(OUTPUT);
        assert_eq!(s.finished_s, Some(20.0));
        assert_eq!(s.req_per_s, Some(61234.5));
        assert_eq!(s.requests["done"], 1_224_690);
        assert_eq!(s.requests["succeeded"], 1_224_689);
        assert_eq!(s.requests["errored"], 1);
        assert_eq!(s.status_codes["2xx"], 1_224_689);
        assert_eq!(s.time_for_request_ns, Some([123_000, 12_340_000, 1_040_000, 456_000]));
        assert_eq!(h2load_duration_ns("661.88ms"), Some(661_880_000));
        assert_eq!(h2load_duration_ns("12"), None);
    }

    #[test]
    fn log_percentiles_and_failures() {
        // 1,000 requests of 1..=1000 µs, one failed stream, one line that is not a request.
        let mut text = String::new();
        for i in 1..=1000u64 {
            text.push_str(&format!("{}\t200\t{i}\n", 1_700_000_000_000_000 + i * 10));
        }
        text.push_str("1700000000020000\t-1\t5000\n");
        text.push_str("garbage\n");
        let log = parse_h2load_log(&text);
        assert_eq!((log.rec.count(), log.rec.ok_count(), log.bad_lines), (1001, 1000, 1));
        assert_eq!((log.http[&200], log.http[&-1]), (1000, 1));
        for (q, want_us) in [(50.0, 500), (90.0, 900), (99.0, 990)] {
            let got = log.rec.percentile_ns(q) as f64 / 1e3;
            assert!((got - f64::from(want_us)).abs() / f64::from(want_us) < 0.002, "p{q} = {got} µs");
        }
        assert_eq!(log.rec.slowest_ns(), 1_000_000, "the failed stream is not a success");
        // From the first start (…010) to the last end (…020000 + 5000).
        assert_eq!(log.span_us, 20_000 + 5_000 - 10);
    }

    #[test]
    fn renewal_counters_subtract_by_result() {
        let before = parse_prometheus(
            "# TYPE presenced_renewals_total counter\npresenced_renewals_total{result=\"ok\"} 1\n\
             presenced_renewals_total{result=\"not_found\"} 0\npresenced_sessions 1\n",
        );
        let after = parse_prometheus(
            "presenced_renewals_total{result=\"ok\"} 1001\npresenced_renewals_total{result=\"not_found\"} 2\n\
             presenced_renewals_total{result=\"shed\"} 3\npresenced_sessions 1\n",
        );
        let d = renewal_deltas(&before, &after);
        assert_eq!(d.len(), 3);
        assert_eq!((d["ok"], d["not_found"], d["shed"]), (1000, 2, 3));
        assert_eq!((grpc_status_of("throttled"), grpc_status_of("shed")), ("OK", "ResourceExhausted"));
    }

    #[test]
    fn grpc_codes_add_up_to_h2load_requests() {
        let deltas = |pairs: &[(&str, u64)]| pairs.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect();
        // All OK; the server answered 64 more, in flight when h2load stopped.
        let c = grpc_codes(&deltas(&[("ok", 1064), ("throttled", 0), ("not_found", 0)]), 1000, 0);
        assert_eq!(c.into_iter().collect::<Vec<_>>(), vec![("OK".to_owned(), 1000)]);
        // Throttled renewals are answered OK; refusals are kept, and the rest is OK.
        let c = grpc_codes(&deltas(&[("ok", 500), ("throttled", 480), ("not_found", 20)]), 1000, 2);
        assert_eq!((c["OK"], c["NotFound"], c["Unavailable"]), (980, 20, 2));
        assert_eq!(c.values().sum::<u64>(), 1002);
        // HTTP 200s the server never counted as renewals: errors of another kind.
        let c = grpc_codes(&deltas(&[("ok", 900)]), 1000, 0);
        assert_eq!((c["OK"], c["Unknown"]), (900, 100));
    }
}
