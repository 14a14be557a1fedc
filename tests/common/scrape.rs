//! Reading the service's Prometheus endpoint (`--metrics-listen`).

use std::time::{Duration, Instant};

use super::PATIENCE;

/// `GET /metrics` over plain HTTP/1.1.
pub fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap();
    stream.write_all(format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    response
}

/// The value of one sample line, `name{labels} value`.
pub fn sample(metrics: &str, series: &str) -> Option<f64> {
    metrics.lines().find_map(|line| line.strip_prefix(series)?.trim().parse().ok())
}

/// The metrics, scraped again until `series` reads `value` (store counts are exported once a second).
pub async fn scrape_when(addr: &str, series: &str, value: f64) -> String {
    scrape_until(addr, series, |read| read == value).await
}

/// The metrics, scraped again until `series` reads a value `wanted` accepts.
pub async fn scrape_until(addr: &str, series: &str, wanted: impl Fn(f64) -> bool) -> String {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let metrics = scrape(addr);
        if sample(&metrics, series).is_some_and(&wanted) {
            return metrics;
        }
        assert!(Instant::now() < deadline, "{series} never reached the value wanted:\n{metrics}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `GET path` over plain HTTP/1.1 (the probes, `/livez` and `/readyz`):
/// the status code and the body.
pub fn probe(addr: &str, path: &str) -> (u16, String) {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(addr).unwrap_or_else(|err| panic!("connect to {addr}: {err}"));
    stream.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes()).unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let status = response.split(' ').nth(1).and_then(|code| code.parse().ok()).unwrap_or(0);
    let body = response.split_once("\r\n\r\n").map_or("", |(_, body)| body).to_owned();
    (status, body)
}
