//! Connections served on connection threads (`connection_threads`), and on the
//! caller's runtime (0): every connection is served, changes made through one
//! thread's connection reach viewers on another's, a shutdown drains them all,
//! and a server whose `serve` future is dropped leaves no connection served.

use std::time::{Duration, Instant};

use crate::common::*;
use presence_proto::v1 as pb;
use presence_proto::v1::presence_client::PresenceClient;
use tokio::net::TcpListener;
use tonic::Code;
use tonic::transport::Channel;

/// One client per connection: `Channel::connect` opens its own.
async fn clients(server: &TestServer, connections: usize) -> Vec<PresenceClient<Channel>> {
    let mut clients = Vec::with_capacity(connections);
    for _ in 0..connections {
        clients.push(server.client().await);
    }
    clients
}

/// Seven connections on `threads` threads: each registers and renews its own
/// user, a viewer on the first connection sees every user come online, and
/// unregisters from every connection take them all offline again.
async fn every_connection_is_served_and_reaches_every_viewer(threads: usize) {
    let config = presence_server::ServerConfig { connection_threads: threads, ..fast_config() };
    let server = TestServer::start(config).await;
    let mut clients = clients(&server, 7).await;
    let users: Vec<String> = (0..clients.len()).map(|n| format!("user-{n}")).collect();
    let names: Vec<&str> = users.iter().map(String::as_str).collect();
    let mut viewer = Viewer::open(&mut clients[0], &names).await;

    let mut generations = Vec::new();
    for (client, user) in clients.iter_mut().zip(&users) {
        let registered = client.register(register(user, "s1", "gw", 5_000)).await.expect("register").into_inner();
        client.renew(renew(user, "s1", registered.generation, 5_000)).await.expect("renew");
        generations.push(registered.generation);
    }
    for user in &users {
        viewer.until_state(user, pb::State::Online).await;
    }
    for ((client, user), generation) in clients.iter_mut().zip(&users).zip(generations) {
        client.unregister(unregister(user, "s1", generation, 0)).await.expect("unregister");
    }
    for user in &users {
        viewer.until_state(user, pb::State::Offline).await;
    }
    server.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_three_connection_threads_every_connection_is_served_and_reaches_every_viewer() {
    every_connection_is_served_and_reaches_every_viewer(3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_connection_threads_every_connection_is_served_and_reaches_every_viewer() {
    every_connection_is_served_and_reaches_every_viewer(0).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_ends_the_watches_and_returns_with_connections_still_open() {
    let config = presence_server::ServerConfig {
        connection_threads: 2,
        shutdown_grace: Duration::from_millis(300),
        ..fast_config()
    };
    let server = TestServer::start(config).await;
    let mut clients = clients(&server, 4).await;
    let mut viewers = Vec::new();
    for client in &mut clients {
        viewers.push(Viewer::open(client, &["u1"]).await);
    }
    server.stop().await; // the clients keep their connections open
    for viewer in &mut viewers {
        let ended = viewer.ended().await;
        assert_eq!(ended.map_err(|status| status.code()), Err(Code::Unavailable));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_serve_future_closes_the_connections_of_every_thread() {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let config = presence_server::ServerConfig { connection_threads: 2, ..fast_config() };
    let serving = tokio::spawn(presence_server::serve(listener, config, std::future::pending()));
    let (mut clients, mut viewers) = (Vec::new(), Vec::new());
    for _ in 0..4 {
        let mut client = PresenceClient::connect(url.clone()).await.expect("connect");
        client.register(register("u1", "s1", "gw", 5_000)).await.expect("served before the drop");
        // An open stream: a graceful close alone would wait for it for ever.
        viewers.push(Viewer::open(&mut client, &["u1"]).await);
        clients.push(client);
    }

    serving.abort();
    let _ = serving.await;
    // Each connection is closed by its thread: its watch ends, and a call on it
    // fails instead of being served by a server that no longer exists.
    for viewer in &mut viewers {
        let _ended_either_way = viewer.ended().await;
    }
    let deadline = Instant::now() + PATIENCE;
    for client in &mut clients {
        loop {
            match client.register(register("u1", "s1", "gw", 5_000)).await {
                Err(status) if status.code() == Code::Unavailable => break,
                other => {
                    assert!(Instant::now() < deadline, "still served after the drop: {other:?}");
                    tokio::time::sleep(Duration::from_millis(10)).await;
                }
            }
        }
    }
}
