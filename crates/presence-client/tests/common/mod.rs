//! The shared in-process server harness (`presence_server::testing`), a fast
//! configuration for lease tests, and request helpers.

#![allow(dead_code, unreachable_pub)]

use presence_client::pb;
use presence_proto::v1::presence_client::PresenceClient;
// Each test binary uses its own part of the harness.
#[allow(unused_imports)]
pub use presence_server::testing::{PATIENCE, TestServer, fast_config, within};
use tonic::transport::Channel;

pub fn register(user: &str, session: &str, ttl_ms: u32) -> pb::RegisterRequest {
    pb::RegisterRequest {
        user_id: user.into(),
        session_id: session.into(),
        gateway_id: "gw-test".into(),
        ttl_ms,
        ..Default::default()
    }
}

pub fn renew(user: &str, session: &str, generation: u64, ttl_ms: u32) -> pb::RenewRequest {
    pb::RenewRequest { user_id: user.into(), session_id: session.into(), generation, ttl_ms, ..Default::default() }
}

pub fn unregister(user: &str, session: &str, generation: u64) -> pb::UnregisterRequest {
    pb::UnregisterRequest { user_id: user.into(), session_id: session.into(), generation, ..Default::default() }
}

pub fn state_of(presence: &pb::UserPresence) -> pb::State {
    pb::State::try_from(presence.state).expect("a known state")
}

pub async fn snapshot(client: &mut PresenceClient<Channel>, users: &[String]) -> Vec<pb::UserPresence> {
    let request = pb::SnapshotRequest { user_ids: users.to_vec(), ..Default::default() };
    client.snapshot(request).await.expect("snapshot").into_inner().users
}

pub async fn state_now(client: &mut PresenceClient<Channel>, user: &str) -> pb::State {
    state_of(&snapshot(client, &[user.to_owned()]).await[0])
}
