//! NetLab: traffic between the host and the namespace flows, and loss and
//! partitions hit exactly the group they are set on. Needs root, iproute2
//! and nftables (`.ci/install-fault-tools`); without them each test fails
//! with a message naming what is missing.

use std::net::{SocketAddr, UdpSocket};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use presence_faults::{NetLab, connect_from};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;
use tokio::time::timeout;

fn lab(groups: usize) -> NetLab {
    NetLab::new(groups).unwrap_or_else(|e| panic!("cannot set up the network lab: {e}"))
}

/// A TCP echo server listening in the lab; returns its address.
fn echo_server(lab: &NetLab) -> SocketAddr {
    let ip = lab.server_ip();
    let listener = lab
        .run_in(move || std::net::TcpListener::bind((ip, 0)))
        .expect("enter the namespace")
        .expect("bind in the namespace");
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
    let addr = listener.local_addr().expect("local addr");
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            tokio::spawn(async move {
                let mut buf = [0u8; 4096];
                while let Ok(n @ 1..) = stream.read(&mut buf).await {
                    if stream.write_all(&buf[..n]).await.is_err() {
                        break;
                    }
                }
            });
        }
    });
    addr
}

async fn echo(stream: &mut TcpStream, message: &[u8]) -> std::io::Result<Vec<u8>> {
    stream.write_all(message).await?;
    let mut back = vec![0u8; message.len()];
    stream.read_exact(&mut back).await?;
    Ok(back)
}

#[tokio::test]
async fn tcp_echo_between_host_and_namespace_from_each_group_address() {
    let lab = lab(3);
    let server = echo_server(&lab);
    for group in 0..3 {
        let mut stream = connect_from(lab.group_ip(group), server).await.expect("connect");
        assert_eq!(stream.local_addr().unwrap().ip(), lab.group_ip(group));
        assert_eq!(echo(&mut stream, b"ping").await.expect("echo"), b"ping");
    }
}

#[tokio::test]
async fn tonic_endpoint_connects_from_the_group_address() {
    let lab = lab(2);
    let ip = lab.server_ip();
    let listener = lab.run_in(move || std::net::TcpListener::bind((ip, 0))).unwrap().unwrap();
    listener.set_nonblocking(true).unwrap();
    let listener = tokio::net::TcpListener::from_std(listener).unwrap();
    let port = listener.local_addr().unwrap().port();
    let endpoint = lab.endpoint(1, port);
    // The HTTP/2 handshake never completes (this is no gRPC server); only
    // the TCP connection's source address is checked.
    let connecting = tokio::spawn(async move { endpoint.connect().await });
    let (_, peer) = timeout(Duration::from_secs(5), listener.accept()).await.expect("accept in time").unwrap();
    assert_eq!(peer.ip(), lab.group_ip(1));
    connecting.abort();
}

/// Sends `count` numbered datagrams from `from` to the UDP echo at `server`,
/// draining replies as it goes; returns the replies received.
fn udp_round(from: &UdpSocket, server: SocketAddr, count: u32) -> u32 {
    let mut replies = 0;
    let mut buf = [0u8; 16];
    from.set_nonblocking(true).unwrap();
    for i in 0..count {
        from.send_to(&i.to_be_bytes(), server).unwrap();
        while from.recv(&mut buf).is_ok() {
            replies += 1;
        }
    }
    // Late replies: the echo is on this machine, so a quiet half second
    // means none is still on its way.
    from.set_nonblocking(false).unwrap();
    from.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    while from.recv(&mut buf).is_ok() {
        replies += 1;
    }
    replies
}

fn big_receive_buffer(socket: &UdpSocket) {
    use std::os::fd::AsRawFd as _;
    let bytes: libc::c_int = 32 << 20;
    // SAFETY: a valid socket fd and a c_int option value of the given size.
    let rc = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVBUFFORCE,
            (&raw const bytes).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    assert_eq!(rc, 0, "SO_RCVBUFFORCE: {}", std::io::Error::last_os_error());
}

#[test]
fn loss_drops_about_the_given_share_in_each_direction_for_that_group_only() {
    let lab = lab(2);
    let ip = lab.server_ip();
    let socket = lab.run_in(move || UdpSocket::bind((ip, 0))).unwrap().unwrap();
    let server = socket.local_addr().unwrap();
    let arrived = Arc::new(AtomicU64::new(0));
    let counter = Arc::clone(&arrived);
    let echo = socket.try_clone().unwrap();
    std::thread::spawn(move || {
        let socket = echo;
        let mut buf = [0u8; 16];
        while let Ok((n, peer)) = socket.recv_from(&mut buf) {
            counter.fetch_add(1, Ordering::Relaxed);
            let _ = socket.send_to(&buf[..n], peer);
        }
    });
    let lossy = UdpSocket::bind((lab.group_ip(0), 0)).unwrap();
    let clean = UdpSocket::bind((lab.group_ip(1), 0)).unwrap();
    // Room for every datagram of a round, so a busy machine that delays
    // the echo thread overflows no buffer and only the rules drop.
    for socket in [&socket, &lossy, &clean] {
        big_receive_buffer(socket);
    }
    let count = 4000u32;

    lab.loss(0, 0.3).unwrap();
    let back = udp_round(&lossy, server, count);
    let there = arrived.swap(0, Ordering::Relaxed);
    let one_way = 1.0 - there as f64 / f64::from(count);
    let round_trip = f64::from(back) / f64::from(count);
    eprintln!("loss 0.3: one-way loss {one_way:.3}, round trips kept {round_trip:.3}");
    // Binomial standard deviation here is under 0.01: 0.05 is five of them.
    assert!((0.25..=0.35).contains(&one_way), "one-way loss {one_way}");
    // Kept both ways: 0.7 * 0.7 = 0.49.
    assert!((0.44..=0.54).contains(&round_trip), "round trips kept {round_trip}");

    let clean_back = udp_round(&clean, server, count);
    assert_eq!(arrived.swap(0, Ordering::Relaxed), u64::from(count), "the other group lost datagrams");
    assert_eq!(clean_back, count);

    lab.heal_all().unwrap();
    assert_eq!(udp_round(&lossy, server, 500), 500, "loss stays after heal_all");
}

#[tokio::test]
async fn partition_times_out_connects_and_stalls_connections_until_healed() {
    let lab = lab(2);
    let server = echo_server(&lab);
    let mut cut = connect_from(lab.group_ip(0), server).await.unwrap();
    let mut spared = connect_from(lab.group_ip(1), server).await.unwrap();
    assert_eq!(echo(&mut cut, b"before").await.unwrap(), b"before");

    lab.partition(0).unwrap();
    let connect = timeout(Duration::from_secs(1), connect_from(lab.group_ip(0), server)).await;
    assert!(connect.is_err(), "a connect during the partition did not time out: {connect:?}");
    cut.write_all(b"during").await.unwrap(); // queued in the send buffer
    let mut back = [0u8; 6];
    let stalled = timeout(Duration::from_secs(1), cut.read_exact(&mut back)).await;
    assert!(stalled.is_err(), "an established connection got through the partition");
    assert_eq!(echo(&mut spared, b"spared").await.unwrap(), b"spared", "the other group was cut too");

    lab.heal(0).unwrap();
    // The queued bytes arrive on TCP's next retransmission.
    timeout(Duration::from_secs(20), cut.read_exact(&mut back)).await.expect("the stalled connection resumes").unwrap();
    assert_eq!(&back, b"during");
    let mut fresh = timeout(Duration::from_secs(5), connect_from(lab.group_ip(0), server)).await.unwrap().unwrap();
    assert_eq!(echo(&mut fresh, b"after").await.unwrap(), b"after");
}

fn namespace_exists(name: &str) -> bool {
    std::path::Path::new("/run/netns").join(name).exists()
}

#[test]
fn drop_removes_the_namespace_and_the_veth_even_on_panic() {
    let lab = lab(1);
    let name = lab.namespace().to_owned();
    let host_if = std::process::Command::new("ip")
        .args(["-o", "addr", "show", "to", &lab.group_ip(0).to_string()])
        .output()
        .unwrap();
    assert!(!host_if.stdout.is_empty(), "the host address is missing");
    assert!(namespace_exists(&name));
    let group_ip = lab.group_ip(0).to_string();
    let result = std::panic::catch_unwind(move || {
        let _lab = lab;
        panic!("a test fails while the lab is up");
    });
    assert!(result.is_err());
    assert!(!namespace_exists(&name), "namespace {name} left behind");
    let left = std::process::Command::new("ip").args(["-o", "addr", "show", "to", &group_ip]).output().unwrap();
    assert!(left.stdout.is_empty(), "host address left behind: {}", String::from_utf8_lossy(&left.stdout));
}
