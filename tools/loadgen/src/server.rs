//! The server a long scenario watches: started by the scenario (`--server-bin`) or
//! found at `--addr` (`--server-pid`, `--metrics-addr`), and sampled while it runs:
//! resident memory, CPU time and the counters and histograms of its `/metrics`.
//!
//! `soak` and `overload` judge the server by what it says about itself as well as by
//! what the generator sees: an OFFLINE flip the viewers missed still shows in
//! `presenced_flips_total`, and the expiry lag is the server's own histogram.

use std::collections::BTreeMap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::cli::ServerArgs;
use crate::h2load::parse_prometheus;
use crate::memory::rss_bytes;
use crate::server_cpu::cpu_ns;

/// `GET /metrics` from `addr` (HTTP/1.1, plain TCP: the endpoint is on this machine).
pub(crate) async fn scrape(addr: &str) -> Result<String, String> {
    let mut stream =
        tokio::net::TcpStream::connect(addr).await.map_err(|e| format!("cannot connect to metrics at {addr}: {e}"))?;
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.map_err(|e| format!("metrics request: {e}"))?;
    let mut body = Vec::new();
    stream.read_to_end(&mut body).await.map_err(|e| format!("metrics response: {e}"))?;
    Ok(String::from_utf8_lossy(&body).into_owned())
}

/// The server under test.
#[derive(Debug)]
pub(crate) struct Server {
    /// Its gRPC address.
    pub(crate) addr: String,
    /// Its process id, for `/proc` (None: memory and CPU are not reported).
    pub(crate) pid: Option<u32>,
    /// Its metrics endpoint (None: the server's counters are not reported).
    pub(crate) metrics_addr: Option<String>,
    /// The process, when the scenario started it: killed on drop.
    child: Option<Child>,
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(child) = &mut self.child {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A free loopback port (bound and released: the server binds it a moment later).
fn free_port() -> Result<u16, String> {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").map_err(|e| format!("no free port: {e}"))?;
    listener.local_addr().map(|a| a.port()).map_err(|e| format!("no free port: {e}"))
}

impl Server {
    /// Starts `--server-bin serve` (under `taskset -c` with `--server-cpus`), or describes
    /// the server at `addr`.
    pub(crate) fn start(args: &ServerArgs, addr: &str) -> Result<Server, String> {
        let Some(bin) = &args.server_bin else {
            return Ok(Server {
                addr: addr.to_owned(),
                pid: args.server_pid,
                metrics_addr: args.metrics_addr.clone(),
                child: None,
            });
        };
        let metrics_addr = format!("127.0.0.1:{}", free_port()?);
        let mut command = match &args.server_cpus {
            Some(cpus) => {
                let mut c = Command::new("taskset");
                c.arg("-c").arg(cpus).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        command
            .arg("serve")
            .arg("--listen")
            .arg("127.0.0.1:0")
            .arg("--metrics-listen")
            .arg(&metrics_addr)
            .args(&args.server_arg)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = command.spawn().map_err(|e| format!("cannot start {}: {e}", bin.display()))?;
        let pid = child.id();
        let stdout = child.stdout.take().ok_or("the server has no stdout")?;
        let mut lines = std::io::BufRead::lines(std::io::BufReader::new(stdout));
        let mut server = Server { addr: String::new(), pid: Some(pid), metrics_addr: Some(metrics_addr), child: None };
        server.child = Some(child);
        // `listening on ADDR` is the server's first line once it accepts connections.
        let addr = loop {
            match lines.next() {
                Some(Ok(line)) => {
                    if let Some(addr) = line.strip_prefix("listening on ") {
                        break addr.trim().to_owned();
                    }
                }
                _ => return Err(format!("{} exited before it was listening", bin.display())),
            }
        };
        // Drain the rest of its stdout, so that it never blocks on a full pipe.
        std::thread::spawn(move || for _ in lines {});
        server.addr = addr;
        println!(
            "started {} serve (pid {pid}{}) on {}, metrics on {}",
            bin.display(),
            args.server_cpus.as_ref().map_or_else(String::new, |c| format!(", CPUs {c}")),
            server.addr,
            server.metrics_addr.as_deref().unwrap_or("-")
        );
        Ok(server)
    }

    /// Resident memory, CPU time and metrics, now.
    pub(crate) async fn sample(&self) -> Sample {
        let metrics = match &self.metrics_addr {
            Some(addr) => match scrape(addr).await {
                Ok(text) => parse_prometheus(&text),
                Err(e) => {
                    println!("warning: {e}");
                    BTreeMap::new()
                }
            },
            None => BTreeMap::new(),
        };
        Sample {
            at: Instant::now(),
            rss_bytes: self.pid.and_then(|pid| rss_bytes(pid).ok()),
            cpu_ns: self.pid.and_then(|pid| cpu_ns(pid).ok()),
            metrics,
        }
    }
}

/// The server, and the machine, at one moment.
#[derive(Debug, Clone)]
pub(crate) struct Sample {
    /// When.
    pub(crate) at: Instant,
    /// VmRSS.
    pub(crate) rss_bytes: Option<u64>,
    /// User + system CPU of the server.
    pub(crate) cpu_ns: Option<u64>,
    /// Every sample of `/metrics`, by `name{labels}`.
    pub(crate) metrics: BTreeMap<String, f64>,
}

impl Sample {
    /// How far the metric `key` (`name{labels}` as exposed) moved since `earlier`.
    pub(crate) fn delta(&self, earlier: &Sample, key: &str) -> Option<f64> {
        Some(self.metrics.get(key)? - earlier.metrics.get(key).copied().unwrap_or(0.0))
    }

    /// The server's CPU use since `earlier`, in cores (1.0 = one core busy).
    pub(crate) fn cores_since(&self, earlier: &Sample) -> Option<f64> {
        let (now, then) = (self.cpu_ns?, earlier.cpu_ns?);
        let wall = self.at.duration_since(earlier.at).as_nanos().max(1) as f64;
        Some(now.saturating_sub(then) as f64 / wall)
    }

    /// The histogram `name`'s buckets since `earlier`: (upper bound in seconds, count up to it).
    pub(crate) fn buckets_since(&self, earlier: &Sample, name: &str) -> Vec<(f64, f64)> {
        let prefix = format!("{name}_bucket{{le=\"");
        let mut out: Vec<(f64, f64)> = self
            .metrics
            .iter()
            .filter_map(|(k, v)| {
                let le = k.strip_prefix(&prefix)?.strip_suffix("\"}")?;
                let bound = if le == "+Inf" { f64::INFINITY } else { le.parse().ok()? };
                Some((bound, v - earlier.metrics.get(k).copied().unwrap_or(0.0)))
            })
            .collect();
        out.sort_by(|a, b| a.0.total_cmp(&b.0));
        out
    }
}

/// The upper bound of the bucket that holds quantile `q` (0..1) of cumulative `buckets`
/// (as [`Sample::buckets_since`] gives them); None without observations.
pub(crate) fn bucket_quantile(buckets: &[(f64, f64)], q: f64) -> Option<f64> {
    let total = buckets.last()?.1;
    if total <= 0.0 {
        return None;
    }
    buckets.iter().find(|(_, cumulative)| *cumulative >= q * total).map(|(bound, _)| *bound)
}

/// Seconds as people read them; the open top bucket as `> 5 s`.
pub(crate) fn fmt_bound(seconds: Option<f64>, top: f64) -> String {
    match seconds {
        None => "-".into(),
        Some(s) if s.is_infinite() => format!("> {top} s"),
        Some(s) => format!("<= {}", crate::stats::fmt_ns((s * 1e9) as u64)),
    }
}

/// The machine's load averages, as `/proc/loadavg` has them (1, 5 and 15 minutes).
pub(crate) fn loadavg_line() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|_| "-".into())
}

/// Waits until `f` holds, checking every 10 ms, for at most `limit`.
pub(crate) async fn wait_for(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + limit;
    while !f() {
        if Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample(metrics: &[(&str, f64)]) -> Sample {
        Sample {
            at: Instant::now(),
            rss_bytes: None,
            cpu_ns: None,
            metrics: metrics.iter().map(|(k, v)| ((*k).to_owned(), *v)).collect(),
        }
    }

    #[test]
    fn histogram_quantiles_are_read_from_bucket_deltas() {
        let name = "presenced_expiry_lag_seconds";
        let before = sample(&[
            ("presenced_expiry_lag_seconds_bucket{le=\"0.01\"}", 10.0),
            ("presenced_expiry_lag_seconds_bucket{le=\"0.1\"}", 10.0),
            ("presenced_expiry_lag_seconds_bucket{le=\"+Inf\"}", 10.0),
        ]);
        // 100 more: 90 within 10 ms, 9 within 100 ms, 1 above.
        let after = sample(&[
            ("presenced_expiry_lag_seconds_bucket{le=\"0.01\"}", 100.0),
            ("presenced_expiry_lag_seconds_bucket{le=\"0.1\"}", 109.0),
            ("presenced_expiry_lag_seconds_bucket{le=\"+Inf\"}", 110.0),
        ]);
        let buckets = after.buckets_since(&before, name);
        assert_eq!(buckets, vec![(0.01, 90.0), (0.1, 99.0), (f64::INFINITY, 100.0)]);
        assert_eq!(bucket_quantile(&buckets, 0.5), Some(0.01));
        assert_eq!(bucket_quantile(&buckets, 0.99), Some(0.1));
        assert_eq!(bucket_quantile(&buckets, 1.0), Some(f64::INFINITY));
        assert_eq!(bucket_quantile(&before.buckets_since(&before, name), 0.99), None, "nothing observed");
        assert_eq!(after.delta(&before, "presenced_expiry_lag_seconds_bucket{le=\"0.1\"}"), Some(99.0));
        assert_eq!(after.delta(&before, "missing"), None);
    }
}
