//! The Rust client's driver of the conformance suite (`clients/conformance`):
//! reads a run file, does what its `client` section says with this crate's
//! public API, and prints its report as one JSON line. The protocol is in
//! `clients/conformance/README.md`.
//!
//! `conformance_driver RUN_FILE`

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use presence_client::pb::presence_client::PresenceClient;
use presence_client::{
    Backoff, ChangesConfig, ChangesConsumer, ChangesError, ClusterLeases, CursorStore, LeaseChannel,
    LeaseChannelConfig, MemoryCursorStore, Session, SessionConfig, SessionState, TokenProvider, Watcher, connect,
    cursor_from_hex, cursor_to_hex, lease_result, pb,
};
use serde_json::{Value, json};
use tonic::Code;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let report = match std::env::args().nth(1) {
        Some(path) => match std::fs::read_to_string(&path) {
            Ok(text) => match serde_json::from_str::<Value>(&text) {
                Ok(run) => drive(&run).await,
                Err(err) => Err(format!("{path} is not JSON: {err}")),
            },
            Err(err) => Err(format!("cannot read {path}: {err}")),
        },
        None => Err("usage: conformance_driver RUN_FILE".to_owned()),
    };
    match report {
        Ok(report) => println!("{report}"),
        Err(error) => {
            println!("{}", json!({ "error": error }));
            std::process::exit(1);
        }
    }
}

fn field<'a>(value: &'a Value, name: &str) -> Result<&'a Value, String> {
    value.get(name).ok_or_else(|| format!("the run file's client has no {name}"))
}

fn number(value: &Value, name: &str) -> Result<u64, String> {
    field(value, name)?.as_u64().ok_or_else(|| format!("{name} is not a number"))
}

fn text<'a>(value: &'a Value, name: &str) -> Result<&'a str, String> {
    field(value, name)?.as_str().ok_or_else(|| format!("{name} is not a string"))
}

/// gRPC's canonical name of `code`, as the report gives codes.
fn code_name(code: Code) -> String {
    let debug = format!("{code:?}");
    let mut name = String::new();
    for (i, letter) in debug.chars().enumerate() {
        if letter.is_uppercase() && i > 0 {
            name.push('_');
        }
        name.push(letter.to_ascii_uppercase());
    }
    if code == Code::Ok { "OK".to_owned() } else { name }
}

async fn drive(run: &Value) -> Result<Value, String> {
    let target = text(run, "target")?;
    let client = field(run, "client")?;
    match text(client, "kind")? {
        "session" => session(target, client).await,
        "cluster_items" => cluster_items(target, client).await,
        "watch" => watch(target, client, run.get("tokens")).await,
        "feed" => feed(target, client).await,
        other => Err(format!("unknown client kind {other}")),
    }
}

async fn session(target: &str, client: &Value) -> Result<Value, String> {
    let channel = LeaseChannel::connect(target, LeaseChannelConfig::default()).await.map_err(|err| err.to_string())?;
    let config = SessionConfig {
        ttl_ms: u32::try_from(number(client, "ttl_ms")?).map_err(|_| "ttl_ms too large")?,
        ..SessionConfig::with_heartbeat(Duration::from_millis(number(client, "renew_every_ms")?))
    };
    let session = Session::register(
        &channel,
        text(client, "user_id")?,
        text(client, "session_id")?,
        "conformance",
        HashMap::new(),
        config,
    )
    .await
    .map_err(|status| format!("register: {status}"))?;
    let mut generations = vec![session.generation()];
    let mut events = session.events();
    let mut superseded = false;
    let until = tokio::time::Instant::now() + Duration::from_millis(number(client, "run_ms")?);
    while let Ok(Ok(())) = tokio::time::timeout_at(until, events.changed()).await {
        match *events.borrow_and_update() {
            SessionState::Live { generation } | SessionState::Reregistered { generation } => {
                if generations.last() != Some(&generation) {
                    generations.push(generation);
                }
            }
            SessionState::Superseded => superseded = true,
            SessionState::Lost => {}
        }
    }
    let close = client.get("close").and_then(Value::as_bool).unwrap_or(false);
    let state = if superseded || close { "closed" } else { "open" };
    if close {
        session.close().await.map_err(|status| format!("close: {status}"))?;
    }
    Ok(json!({ "state": state, "generations": generations }))
}

async fn cluster_items(target: &str, client: &Value) -> Result<Value, String> {
    let slots = u32::try_from(number(client, "slots")?).map_err(|_| "slots too large")?;
    let cluster = ClusterLeases::new(target, slots, LeaseChannelConfig::default())
        .map_err(|err| err.to_string())?
        .with_move_wait(Duration::from_millis(number(client, "move_wait_ms")?));
    let mut results = Vec::new();
    for item in field(client, "items")?.as_array().ok_or("items is not a list")? {
        let register = pb::RegisterRequest {
            user_id: text(item, "user_id")?.to_owned(),
            session_id: text(item, "session_id")?.to_owned(),
            gateway_id: "conformance".to_owned(),
            ttl_ms: u32::try_from(number(item, "ttl_ms")?).map_err(|_| "ttl_ms too large")?,
            ..Default::default()
        };
        let item = pb::LeaseItem { op: Some(pb::lease_item::Op::Register(register)) };
        let answer = cluster.submit_batch(vec![item]).await.into_iter().next().ok_or("no result")?;
        results.push(match lease_result(answer) {
            Ok(pb::lease_result::Result::Register(registered)) => {
                json!({ "code": "OK", "generation": registered.generation })
            }
            Ok(_) => json!({ "code": "INTERNAL" }),
            Err(status) => json!({ "code": code_name(status.code()) }),
        });
    }
    Ok(json!({ "results": results }))
}

async fn watch(target: &str, client: &Value, tokens: Option<&Value>) -> Result<Value, String> {
    let channel = connect(target, None).await.map_err(|err| err.to_string())?;
    let user_ids: Vec<String> = field(client, "user_ids")?
        .as_array()
        .ok_or("user_ids is not a list")?
        .iter()
        .filter_map(|user| user.as_str().map(str::to_owned))
        .collect();
    let request = pb::WatchRequest { user_ids, ..Default::default() };
    let backoff = Backoff { initial: Duration::from_millis(50), max: Duration::from_millis(500), factor: 2.0 };
    let presence = PresenceClient::new(channel);
    let mut watcher = match tokens.and_then(Value::as_array) {
        Some(tokens) => {
            let tokens: Vec<String> = tokens.iter().filter_map(|token| token.as_str().map(str::to_owned)).collect();
            let given = Arc::new(AtomicUsize::new(0));
            let provider: TokenProvider = Arc::new(move || {
                // The first token, then the next at each asking, the last for ever after.
                let index = given.fetch_add(1, Ordering::SeqCst).min(tokens.len().saturating_sub(1));
                let token = tokens.get(index).cloned().unwrap_or_default();
                Box::pin(async move { Ok(token) })
            });
            Watcher::open_with_token_provider(presence, request, backoff, provider).await
        }
        None => Watcher::open_request(presence, request, backoff).await,
    }
    .map_err(|status| format!("watch: {status}"))?;
    let until = tokio::time::Instant::now() + Duration::from_millis(number(client, "run_ms")?);
    while let Ok(Some(_)) = tokio::time::timeout_at(until, watcher.next()).await {}
    let users: BTreeMap<String, Value> = watcher
        .store()
        .iter()
        .map(|user| {
            let state = if user.state == pb::State::Online as i32 { "ONLINE" } else { "OFFLINE" };
            (user.user_id.clone(), json!({ "state": state, "version": user.version }))
        })
        .collect();
    Ok(json!({ "users": users }))
}

async fn feed(target: &str, client: &Value) -> Result<Value, String> {
    let channel = connect(target, None).await.map_err(|err| err.to_string())?;
    let cursor = cursor_from_hex(text(client, "cursor_hex")?).map_err(|err| err.to_string())?;
    let mut store = MemoryCursorStore::new();
    store.save(&cursor).await.map_err(|err| err.to_string())?;
    let request = pb::ChangesRequest::default();
    let mut consumer = ChangesConsumer::open(PresenceClient::new(channel), request, store, ChangesConfig::default())
        .await
        .map_err(|err| format!("open: {err}"))?;
    let mut events = 0;
    let until = tokio::time::Instant::now() + Duration::from_millis(number(client, "run_ms")?);
    loop {
        match tokio::time::timeout_at(until, consumer.next_batch()).await {
            Err(_) => return Ok(json!({ "events": events })),
            Ok(Ok(batch)) => {
                events += batch.events.len();
                consumer.commit().await.map_err(|err| err.to_string())?;
            }
            Ok(Err(ChangesError::OutOfRange { oldest_cursor, .. })) => {
                let error = json!({ "code": "OUT_OF_RANGE", "oldest_cursor_hex": cursor_to_hex(&oldest_cursor) });
                return Ok(json!({ "events": events, "error": error }));
            }
            Ok(Err(err)) => return Err(err.to_string()),
        }
    }
}
