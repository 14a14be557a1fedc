//! T3, T4: viewer keys from the identity provider's JWKS document, fetched
//! over https from a loopback server the test starts (its certificate from a
//! CA the test makes): keys that rotate without a restart, an unknown `kid`
//! that fetches the document once rather than once per request, `aud` and
//! `iss` checked, failed fetches retried a bounded number of times, and
//! streams of a key rotated out ended.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use crate::common::auth::unix_secs;
use crate::common::daemon::scratch_dir;
use crate::common::*;
use crate::node::credentials::{SCOPED, credentials_config, scoped_credentials};
use bytes::Bytes;
use http_body_util::Full;
use presence_proto::v1 as pb;
use presence_tls::testing::Pki;
use tonic::Code;
use tonic_types::StatusExt;

// Test-only Ed25519 keys, made with `openssl genpkey -algorithm ed25519` for
// these tests and used nowhere else; `x` is each public key, base64url.
const OLD_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEIMxAhRIpqrUiYDKNEJSKxp981B+nKaRD7RwzvO6nSMQ6
-----END PRIVATE KEY-----
";
const OLD_X: &str = "98CI_O1d_d8iulzSmyt3_YTZx5xyUvig9vfU30Fx9iE";
const NEW_PRIVATE: &str = "-----BEGIN PRIVATE KEY-----
MC4CAQAwBQYDK2VwBCIEINoWxq1ZxsvL68sk9vt9WCMCwLU4dqlnrJ8IIZsKwSwx
-----END PRIVATE KEY-----
";
const NEW_X: &str = "6-4472tOUhNxY64ef0UYdAijcFkGaKsrXuYc7802q8c";

const AUDIENCE: &str = "presence.example";
const ISSUER: &str = "https://idp.example";

fn jwk(kid: &str, x: &str) -> serde_json::Value {
    serde_json::json!({ "kty": "OKP", "crv": "Ed25519", "x": x, "kid": kid, "use": "sig", "alg": "EdDSA" })
}

fn document(keys: &[(&str, &str)]) -> String {
    serde_json::json!({ "keys": keys.iter().map(|(kid, x)| jwk(kid, x)).collect::<Vec<_>>() }).to_string()
}

/// A viewer JWT signed by `private` naming `kid`, with the test's audience and issuer.
fn token(private: &str, kid: &str, subject: &str, claims: serde_json::Value) -> String {
    let mut header = jsonwebtoken::Header::new(jsonwebtoken::Algorithm::EdDSA);
    header.kid = Some(kid.into());
    let mut body = serde_json::json!({ "sub": subject, "exp": unix_secs() + 600, "aud": AUDIENCE, "iss": ISSUER });
    body.as_object_mut().unwrap().extend(claims.as_object().unwrap().clone());
    let key = jsonwebtoken::EncodingKey::from_ed_pem(private.as_bytes()).unwrap();
    jsonwebtoken::encode(&header, &body, &key).unwrap()
}

/// The identity provider's JWKS endpoint: https on loopback, a document
/// the test changes, every request counted, and failures on demand.
struct JwksServer {
    url: String,
    document: Arc<std::sync::Mutex<String>>,
    requests: Arc<AtomicUsize>,
    failing: Arc<AtomicBool>,
}

impl JwksServer {
    async fn start(pki: &Pki, first: String) -> JwksServer {
        let acceptor = crate::common::tls::acceptor(&pki.issue("jwks", &["localhost", "127.0.0.1"]));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (document, requests, failing) =
            (Arc::new(std::sync::Mutex::new(first)), Arc::new(AtomicUsize::new(0)), Arc::new(AtomicBool::new(false)));
        let served = (Arc::clone(&document), Arc::clone(&requests), Arc::clone(&failing));
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let Ok(stream) = acceptor.accept(stream).await else { continue };
                let (document, requests, failing) =
                    (Arc::clone(&served.0), Arc::clone(&served.1), Arc::clone(&served.2));
                let answer = hyper::service::service_fn(move |request: http::Request<hyper::body::Incoming>| {
                    requests.fetch_add(1, Ordering::SeqCst);
                    let response = if failing.load(Ordering::SeqCst) {
                        http::Response::builder().status(503).body(Full::new(Bytes::new())).unwrap()
                    } else {
                        assert_eq!(request.uri().path(), "/.well-known/jwks.json");
                        http::Response::new(Full::new(Bytes::from(document.lock().unwrap().clone())))
                    };
                    async move { Ok::<_, Infallible>(response) }
                });
                let connection = hyper::server::conn::http1::Builder::new()
                    .serve_connection(hyper_util::rt::TokioIo::new(stream), answer);
                tokio::spawn(connection);
            }
        });
        JwksServer {
            url: format!("https://localhost:{}/.well-known/jwks.json", addr.port()),
            document,
            requests,
            failing,
        }
    }

    fn publish(&self, document: String) {
        *self.document.lock().unwrap() = document;
    }

    fn requests(&self) -> usize {
        self.requests.load(Ordering::SeqCst)
    }
}

/// A server whose viewer keys come from `jwks`, fetched again every `refresh`.
async fn server_with(dir: &std::path::Path, pki: &Pki, jwks: &JwksServer, refresh: Duration) -> TestServer {
    let mut config = credentials_config(&scoped_credentials(dir, ""), None);
    config.auth.viewer_jwt_hs256_secret = None;
    config.auth.viewer_jwks = Some(jwks.url.clone());
    config.auth.viewer_jwks_ca = Some(pki.ca_path());
    config.auth.viewer_jwks_refresh = refresh;
    config.auth.viewer_jwt_audiences = vec![AUDIENCE.into()];
    config.auth.viewer_jwt_issuer = Some(ISSUER.into());
    TestServer::start(config).await
}

async fn snapshot_as(
    client: &mut presence_proto::v1::presence_client::PresenceClient<tonic::transport::Channel>,
    token: &str,
) -> Result<(), tonic::Status> {
    let request = pb::SnapshotRequest { user_ids: vec!["u1".into()], ..Default::default() };
    client.snapshot(with_token(request, Some(token))).await.map(|_| ())
}

/// Waits until `token` is accepted (the server fetches the document when it starts).
async fn until_accepted(
    client: &mut presence_proto::v1::presence_client::PresenceClient<tonic::transport::Channel>,
    token: &str,
) {
    within(PATIENCE, "the token is accepted", async {
        while snapshot_as(client, token).await.is_err() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
}

#[tokio::test]
async fn t4_an_unknown_kid_fetches_the_jwks_once_for_many_requests_and_aud_and_iss_are_checked() {
    let dir = scratch_dir("jwks-unknown-kid");
    let pki = Pki::new(&dir, "jwks");
    let jwks = JwksServer::start(&pki, document(&[("old", OLD_X)])).await;
    // No scheduled fetch during the test: only the start and unknown kids fetch.
    let server = server_with(&dir, &pki, &jwks, Duration::from_secs(3600)).await;
    let mut client = server.client().await;
    let old = token(OLD_PRIVATE, "old", "alice", serde_json::json!({}));
    until_accepted(&mut client, &old).await;

    // The provider publishes a new key; the first tokens signed by it arrive
    // at once, twenty together: one fetch serves them all.
    jwks.publish(document(&[("old", OLD_X), ("new", NEW_X)]));
    let before = jwks.requests();
    let new = token(NEW_PRIVATE, "new", "bob", serde_json::json!({}));
    let mut calls = tokio::task::JoinSet::new();
    for _ in 0..20 {
        let (mut client, new) = (client.clone(), new.clone());
        calls.spawn(async move { snapshot_as(&mut client, &new).await });
    }
    for answer in calls.join_all().await {
        answer.expect("a token of the newly published key is accepted at its first call");
    }
    assert_eq!(jwks.requests() - before, 1, "one fetch for twenty calls with the new kid");

    // Made-up kids are refused and fetch nothing more within the refetch window.
    let before = jwks.requests();
    for attempt in 0..20 {
        let bogus = token(NEW_PRIVATE, &format!("made-up-{attempt}"), "mallory", serde_json::json!({}));
        let refused = snapshot_as(&mut client, &bogus).await.unwrap_err();
        assert_eq!(
            (refused.code(), refused.message()),
            (Code::Unauthenticated, "invalid credentials: no viewer key has the token's `kid`")
        );
    }
    assert!(jwks.requests() - before <= 1, "made-up kids fetched {} times", jwks.requests() - before);

    // aud and iss are checked: a token for another audience or issuer, or without them, is refused.
    for claims in [
        serde_json::json!({ "aud": "another.example" }),
        serde_json::json!({ "iss": "https://another-idp.example" }),
        serde_json::json!({ "aud": null }),
    ] {
        let wrong = token(NEW_PRIVATE, "new", "bob", claims.clone());
        let refused = snapshot_as(&mut client, &wrong).await.unwrap_err();
        assert_eq!(refused.code(), Code::Unauthenticated, "{claims}");
    }
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}

#[tokio::test]
async fn t3_t4_during_a_rotation_both_keys_verify_and_the_old_keys_tokens_and_streams_end_when_it_leaves() {
    let dir = scratch_dir("jwks-rotation");
    let pki = Pki::new(&dir, "jwks");
    let jwks = JwksServer::start(&pki, document(&[("old", OLD_X)])).await;
    let server = server_with(&dir, &pki, &jwks, Duration::from_millis(300)).await;
    let mut client = server.client().await;
    let old = token(OLD_PRIVATE, "old", "alice", serde_json::json!({}));
    until_accepted(&mut client, &old).await;
    let watch = pb::WatchRequest { user_ids: vec!["alice".into()], ..Default::default() };
    let mut old_watch = Viewer::open_request(&mut client, with_token(watch.clone(), Some(&old))).await;

    // The overlap: both keys are in the document, tokens of each verify.
    jwks.publish(document(&[("old", OLD_X), ("new", NEW_X)]));
    let new = token(NEW_PRIVATE, "new", "alice", serde_json::json!({}));
    until_accepted(&mut client, &new).await;
    snapshot_as(&mut client, &old).await.expect("the old key still verifies during the overlap");
    let mut new_watch = Viewer::open_request(&mut client, with_token(watch, Some(&new))).await;

    // A failing provider: each scheduled fetch tries a bounded number of
    // times, and the keys in use stay.
    jwks.failing.store(true, Ordering::SeqCst);
    let before = jwks.requests();
    within(PATIENCE, "three failed fetches", async {
        while jwks.requests() - before < 3 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    snapshot_as(&mut client, &old).await.expect("a failed fetch keeps the keys in use");
    snapshot_as(&mut client, &new).await.expect("a failed fetch keeps the keys in use");
    jwks.failing.store(false, Ordering::SeqCst);

    // The old key leaves the document: its tokens are refused, its stream ends.
    jwks.publish(document(&[("new", NEW_X)]));
    let ended = old_watch.ended().await.expect_err("the old key's Watch ends with a status");
    assert_eq!(ended.code(), Code::Unauthenticated, "{ended:?}");
    assert_eq!(ended.get_details_error_info().map(|info| info.reason).as_deref(), Some("CREDENTIALS_REVOKED"));
    let refused = snapshot_as(&mut client, &old).await.unwrap_err();
    assert_eq!(
        (refused.code(), refused.message()),
        (Code::Unauthenticated, "invalid credentials: no viewer key has the token's `kid`")
    );
    snapshot_as(&mut client, &new).await.expect("the new key verifies");
    // The new key's stream goes on.
    let gateway = Some(SCOPED[0].1);
    new_watch.barrier_with(&mut client, "alice", gateway).await;
    server.stop().await;
    std::fs::remove_dir_all(dir).unwrap();
}
