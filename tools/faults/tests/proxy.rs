//! DelayProxy: a round trip through it takes twice the one-way delay, the
//! delay can change mid-connection, the bytes arrive intact and in order,
//! and a receiver that stops reading does not make it buffer without bound.
//! Needs nothing but loopback.

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use presence_faults::{DelayProxy, ProxyCounters};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::timeout;

async fn echo_upstream() -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut read, mut write) = stream.into_split();
                let _ = tokio::io::copy(&mut read, &mut write).await;
                let _ = write.shutdown().await;
            });
        }
    });
    addr
}

async fn proxy(upstream: SocketAddr, delay: Duration) -> DelayProxy {
    DelayProxy::start("127.0.0.1:0".parse().unwrap(), upstream, delay).await.unwrap()
}

async fn round_trip(stream: &mut TcpStream) -> Duration {
    let started = Instant::now();
    stream.write_all(b"x").await.unwrap();
    let mut back = [0u8; 1];
    stream.read_exact(&mut back).await.unwrap();
    started.elapsed()
}

#[tokio::test]
async fn round_trip_takes_twice_the_delay_and_follows_set_delay() {
    let proxy = proxy(echo_upstream().await, Duration::from_millis(100)).await;
    let mut stream = TcpStream::connect(proxy.local_addr()).await.unwrap();
    stream.set_nodelay(true).unwrap();
    for _ in 0..3 {
        let rtt = round_trip(&mut stream).await;
        assert!(rtt >= Duration::from_millis(200), "round trip {rtt:?} under 2 x 100 ms");
        assert!(rtt < Duration::from_millis(350), "round trip {rtt:?} far over 2 x 100 ms");
    }
    // The same connection, with the delay changed under it.
    proxy.set_delay(Duration::from_millis(25));
    assert_eq!(proxy.delay(), Duration::from_millis(25));
    for _ in 0..3 {
        let rtt = round_trip(&mut stream).await;
        assert!(rtt >= Duration::from_millis(50), "round trip {rtt:?} under 2 x 25 ms");
        assert!(rtt < Duration::from_millis(175), "round trip {rtt:?} far over 2 x 25 ms");
    }
}

/// Waits until the proxy's counters equal `want`: they move just after the
/// bytes are written, so a reader may see the bytes first.
async fn counters_reach(proxy: &DelayProxy, want: ProxyCounters) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while proxy.counters() != want {
        assert!(Instant::now() < deadline, "counters {:?}, want {want:?}", proxy.counters());
        tokio::task::yield_now().await;
    }
}

#[tokio::test]
async fn a_stream_stays_intact_and_in_order_and_is_counted() {
    let proxy = proxy(echo_upstream().await, Duration::from_millis(20)).await;
    let payload: Vec<u8> = (0..4 << 20).map(|_| fastrand::u8(..)).collect();
    let stream = TcpStream::connect(proxy.local_addr()).await.unwrap();
    let (mut read, mut write) = stream.into_split();
    let sent = payload.clone();
    let writer = tokio::spawn(async move {
        // Uneven pieces, with the delay changing mid-stream.
        let mut rest = &sent[..];
        while !rest.is_empty() {
            let n = rest.len().min(fastrand::usize(1..100_000));
            write.write_all(&rest[..n]).await.unwrap();
            rest = &rest[n..];
        }
        write.shutdown().await.unwrap();
    });
    let mut back = Vec::new();
    let changer = async {
        tokio::time::sleep(Duration::from_millis(30)).await;
        proxy.set_delay(Duration::from_millis(1));
        tokio::time::sleep(Duration::from_millis(30)).await;
        proxy.set_delay(Duration::from_millis(40));
    };
    let (read_result, ()) = tokio::join!(timeout(Duration::from_secs(60), read.read_to_end(&mut back)), changer);
    read_result.expect("the echo ends in time").unwrap();
    writer.await.unwrap();
    assert!(back == payload, "the bytes came back changed or reordered");
    let len = payload.len() as u64;
    counters_reach(&proxy, ProxyCounters { bytes_up: len, bytes_down: len, connections: 1 }).await;
}

#[tokio::test]
async fn a_receiver_that_stops_reading_bounds_what_the_proxy_holds() {
    // An upstream that accepts and never reads.
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let upstream = listener.local_addr().unwrap();
    let held = tokio::spawn(async move { listener.accept().await.unwrap() });
    let proxy = proxy(upstream, Duration::from_millis(1)).await;
    let mut stream = TcpStream::connect(proxy.local_addr()).await.unwrap();
    let chunk = vec![7u8; 64 * 1024];
    let mut written = 0u64;
    // Write until a write blocks for a second: the sender has been pushed back.
    while let Ok(result) = timeout(Duration::from_secs(1), stream.write_all(&chunk)).await {
        result.unwrap();
        written += chunk.len() as u64;
        assert!(written < 256 << 20, "256 MiB accepted without push-back");
    }
    // Socket buffers on three sockets (autotuned up to a few MiB each) plus
    // the proxy's 1 MiB queue.
    eprintln!("accepted {written} bytes before push-back");
    assert!(written < 40 << 20, "{written} bytes accepted before push-back");
    drop(held);
}

#[tokio::test]
async fn dropping_the_proxy_closes_its_connections() {
    let proxy = proxy(echo_upstream().await, Duration::ZERO).await;
    let mut stream = TcpStream::connect(proxy.local_addr()).await.unwrap();
    round_trip(&mut stream).await;
    drop(proxy);
    let mut buf = [0u8; 1];
    let read = timeout(Duration::from_secs(5), stream.read(&mut buf)).await.expect("closed in time");
    assert!(matches!(read, Ok(0) | Err(_)), "the connection outlived the proxy: {read:?}");
}
