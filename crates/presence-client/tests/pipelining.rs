//! `LeaseChannel` against a scripted `Leases` server, so that the test decides
//! when and in which order batches are answered: batch shaping, the in-flight
//! bound, matching results by batch id, and a stream that breaks.

// Protobuf messages gain fields as the API grows: every literal of one ends in
// `..Default::default()`, so that it keeps compiling, even where it names every field today.
#![allow(clippy::needless_update)]

use std::time::Duration;

use std::convert::Infallible;
use std::task::{Context, Poll};

use presence_client::{Backoff, LeaseChannel, LeaseChannelConfig, pb};
use presence_proto::codec::FieldNamingCodec;
use presence_server::testing::PATIENCE;
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio::task::{JoinHandle, JoinSet};
use tokio_stream::wrappers::{ReceiverStream, TcpListenerStream};
use tonic::body::Body;
use tonic::codegen::{BoxFuture, Service, http};
use tonic::server::{NamedService, StreamingService};
use tonic::{Code, Request, Response, Status, Streaming};

/// One batch as the scripted server received it, and the way to answer its stream.
struct Received {
    batch: pb::LeaseBatch,
    answer: mpsc::Sender<Result<pb::LeaseResults, Status>>,
}

/// A server of `presence.v1.Presence` that knows only `Leases` and hands every
/// batch to the test. It is a hand-routed service rather than an implementation
/// of the generated trait, so that it does not have to grow with the API.
#[derive(Clone)]
struct Scripted {
    received: mpsc::Sender<Received>,
    refuse_leases: bool,
}

impl NamedService for Scripted {
    const NAME: &'static str = "presence.v1.Presence";
}

impl Service<http::Request<Body>> for Scripted {
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Self::Response, Infallible>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<Body>) -> Self::Future {
        let scripted = self.clone();
        Box::pin(async move {
            if request.uri().path() != "/presence.v1.Presence/Leases" || scripted.refuse_leases {
                return Ok(Status::unimplemented("not scripted").into_http());
            }
            let mut grpc = tonic::server::Grpc::new(FieldNamingCodec::default());
            Ok(grpc.streaming(scripted, request).await)
        })
    }
}

impl StreamingService<pb::LeaseBatch> for Scripted {
    type Response = pb::LeaseResults;
    type ResponseStream = ReceiverStream<Result<pb::LeaseResults, Status>>;
    type Future = BoxFuture<Response<Self::ResponseStream>, Status>;

    fn call(&mut self, request: Request<Streaming<pb::LeaseBatch>>) -> Self::Future {
        let received = self.received.clone();
        Box::pin(async move {
            let mut inbound = request.into_inner();
            let (answer, answers) = mpsc::channel(64);
            tokio::spawn(async move {
                while let Ok(Some(batch)) = inbound.message().await {
                    if received.send(Received { batch, answer: answer.clone() }).await.is_err() {
                        return;
                    }
                }
            });
            Ok(Response::new(ReceiverStream::new(answers)))
        })
    }
}

/// A scripted server on a free port, and the batches it receives.
async fn scripted(refuse_leases: bool) -> (String, mpsc::Receiver<Received>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let (received, batches) = mpsc::channel(1_024);
    let service = Scripted { received, refuse_leases };
    tokio::spawn(
        tonic::transport::Server::builder().add_service(service).serve_with_incoming(TcpListenerStream::new(listener)),
    );
    (url, batches)
}

async fn next_batch(batches: &mut mpsc::Receiver<Received>) -> Received {
    tokio::time::timeout(PATIENCE, batches.recv()).await.expect("a batch within the patience").expect("a batch")
}

fn renew_of(user: &str) -> pb::RenewRequest {
    pb::RenewRequest { user_id: user.into(), session_id: "s".into(), generation: 1, ..Default::default() }
}

/// Answers each renewal OK, with `expires_at_ms` the number in its user id, so
/// that a submitter can check it got its own result.
fn answer_ok(received: &Received) -> pb::LeaseResults {
    let results = received
        .batch
        .items
        .iter()
        .map(|item| {
            let Some(pb::lease_item::Op::Renew(renew)) = &item.op else { panic!("renewals only") };
            let expires_at_ms = renew.user_id.trim_start_matches("u-").parse().unwrap();
            pb::LeaseResult {
                code: 0,
                message: String::new(),
                result: Some(pb::lease_result::Result::Renew(pb::RenewResponse {
                    expires_at_ms,
                    ..Default::default()
                })),
                ..Default::default()
            }
        })
        .collect();
    pb::LeaseResults { batch_id: received.batch.batch_id, results, ..Default::default() }
}

fn spawn_renewals(channel: &LeaseChannel, users: std::ops::Range<i64>) -> JoinSet<()> {
    let mut tasks = JoinSet::new();
    for i in users {
        let channel = channel.clone();
        tasks.spawn(async move {
            let renewed = channel.renew(renew_of(&format!("u-{i}"))).await.expect("renewed");
            assert_eq!(renewed.expires_at_ms, i, "u-{i} got another item's result");
        });
    }
    tasks
}

#[tokio::test]
async fn batches_fill_up_to_max_batch_or_leave_after_max_delay() {
    let (url, mut batches) = scripted(false).await;
    let config = LeaseChannelConfig { max_batch: 4, max_delay: Duration::from_millis(50), ..Default::default() };
    let channel = LeaseChannel::connect(url, config).await.unwrap();

    let mut tasks = spawn_renewals(&channel, 0..10);
    let mut sizes = Vec::new();
    while sizes.iter().sum::<usize>() < 10 {
        let received = next_batch(&mut batches).await;
        sizes.push(received.batch.items.len());
        received.answer.send(Ok(answer_ok(&received))).await.unwrap();
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert!(sizes.iter().all(|&n| (1..=4).contains(&n)), "batch sizes {sizes:?}");
    assert!(sizes.contains(&4), "concurrent items fill whole batches: {sizes:?}");

    // A lone item waits for company up to max_delay, then goes alone.
    let started = tokio::time::Instant::now();
    let mut tasks = spawn_renewals(&channel, 10..11);
    let received = next_batch(&mut batches).await;
    assert!(started.elapsed() >= Duration::from_millis(50), "left after {:?}", started.elapsed());
    assert_eq!(received.batch.items.len(), 1);
    received.answer.send(Ok(answer_ok(&received))).await.unwrap();
    tasks.join_next().await.unwrap().unwrap();
    assert_eq!(channel.stats().items_sent, 11);
}

#[tokio::test]
async fn in_flight_batches_are_bounded_and_results_find_their_batch_in_any_order() {
    let (url, mut batches) = scripted(false).await;
    let config = LeaseChannelConfig {
        max_batch: 1,
        max_delay: Duration::from_millis(1),
        max_in_flight_batches: 2,
        ..Default::default()
    };
    let channel = LeaseChannel::connect(url, config).await.unwrap();
    let mut tasks = spawn_renewals(&channel, 0..6);

    let first = next_batch(&mut batches).await;
    let second = next_batch(&mut batches).await;
    // The bound holds: nothing more is sent while two batches are unanswered.
    let third = tokio::time::timeout(Duration::from_millis(150), batches.recv()).await;
    assert!(third.is_err(), "a third batch went out with two in flight");

    // Answered out of order, each result still reaches its own submitter.
    second.answer.send(Ok(answer_ok(&second))).await.unwrap();
    let third = next_batch(&mut batches).await;
    assert!(tokio::time::timeout(Duration::from_millis(100), batches.recv()).await.is_err());
    first.answer.send(Ok(answer_ok(&first))).await.unwrap();
    third.answer.send(Ok(answer_ok(&third))).await.unwrap();
    for _ in 0..3 {
        let received = next_batch(&mut batches).await;
        received.answer.send(Ok(answer_ok(&received))).await.unwrap();
    }
    while let Some(done) = tasks.join_next().await {
        done.unwrap();
    }
    assert_eq!(channel.stats().batches_sent, 6);
}

/// Reopens a broken stream after tens of milliseconds, not seconds.
const QUICK_RECONNECT: Backoff =
    Backoff { initial: Duration::from_millis(10), max: Duration::from_millis(50), factor: 2.0 };

/// One renewal of `user` through `channel`, on its own task.
fn pending_renewal(channel: &LeaseChannel, user: &'static str) -> JoinHandle<Result<pb::RenewResponse, Status>> {
    let channel = channel.clone();
    tokio::spawn(async move { channel.renew(renew_of(user)).await })
}

#[tokio::test]
async fn a_broken_stream_fails_its_items_with_unavailable_and_is_reopened() {
    let (url, mut batches) = scripted(false).await;
    let config = LeaseChannelConfig { reconnect: QUICK_RECONNECT, ..Default::default() };
    let channel = LeaseChannel::connect(url, config).await.unwrap();

    let pending = pending_renewal(&channel, "u-1");
    let received = next_batch(&mut batches).await;
    received.answer.send(Err(Status::internal("the server fell over"))).await.unwrap();
    drop(received);
    let failed = tokio::time::timeout(PATIENCE, pending).await.unwrap().unwrap().unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(failed.message().contains("the server fell over"), "{failed:?}");

    // The next item opens a new stream and is answered there.
    let mut tasks = spawn_renewals(&channel, 2..3);
    let received = next_batch(&mut batches).await;
    received.answer.send(Ok(answer_ok(&received))).await.unwrap();
    tasks.join_next().await.unwrap().unwrap();
    let stats = channel.stats();
    assert_eq!((stats.streams_opened, stats.streams_broken), (2, 1), "{stats:?}");
}

#[tokio::test]
async fn a_silent_stream_is_given_up_after_the_response_timeout() {
    let (url, mut batches) = scripted(false).await;
    let config = LeaseChannelConfig {
        response_timeout: Duration::from_millis(100),
        reconnect: QUICK_RECONNECT,
        ..Default::default()
    };
    let channel = LeaseChannel::connect(url, config).await.unwrap();

    let pending = pending_renewal(&channel, "u-1");
    // Received and never answered, while the connection stays healthy.
    let silent = next_batch(&mut batches).await;
    let failed = tokio::time::timeout(PATIENCE, pending).await.unwrap().unwrap().unwrap_err();
    assert_eq!(failed.code(), Code::Unavailable, "{failed:?}");
    assert!(failed.message().contains("did not answer"), "{failed:?}");

    let mut tasks = spawn_renewals(&channel, 2..3);
    let received = next_batch(&mut batches).await;
    received.answer.send(Ok(answer_ok(&received))).await.unwrap();
    tasks.join_next().await.unwrap().unwrap();
    // A late answer on the abandoned stream reaches nobody.
    let _ = silent.answer.send(Ok(answer_ok(&silent))).await;
    assert_eq!(channel.stats().streams_opened, 2);
}

#[tokio::test]
async fn a_server_without_leases_answers_each_item_unimplemented() {
    let (url, _batches) = scripted(true).await;
    let channel = LeaseChannel::connect(url, LeaseChannelConfig::default()).await.unwrap();
    let refused = channel.renew(renew_of("u-1")).await.unwrap_err();
    assert_eq!(refused.code(), Code::Unimplemented, "{refused:?}");
    let refused = channel.submit_batch(vec![pb::LeaseItem {
        op: Some(pb::lease_item::Op::Renew(renew_of("u-2"))),
        ..Default::default()
    }]);
    assert_eq!(refused.await.unwrap_err().code(), Code::Unimplemented);
}

#[tokio::test]
async fn connect_reports_a_bad_endpoint_and_an_unreachable_one() {
    let invalid = LeaseChannel::connect("not a uri", LeaseChannelConfig::default()).await.unwrap_err();
    assert!(matches!(invalid, presence_client::ClientError::Tls(_)), "{invalid:?}");
    assert!(invalid.to_string().contains("\"not a uri\""), "names the address: {invalid}");
    // A port that was free a moment ago: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0").await.unwrap().local_addr().unwrap().port();
    let unreachable =
        LeaseChannel::connect(format!("http://127.0.0.1:{port}"), LeaseChannelConfig::default()).await.unwrap_err();
    assert!(matches!(unreachable, presence_client::ClientError::Connect { .. }), "{unreachable:?}");
}
