//! `presenced register USER SESSION`: a gateway played from the terminal, so
//! that a fresh server shows somebody ONLINE in its first minute without a
//! line of code. It registers the session (and joins the rooms named),
//! renews it until interrupted through presence-client's `Session`, which
//! registers it again should the server lose it, and unregisters on exit.
//! Each step is one line, or one JSON object with `--json`.

use std::collections::HashMap;
use std::time::Duration;

use presence_client::{LeaseChannel, LeaseChannelConfig, Session, SessionConfig, SessionState};
use serde_json::{Value, json};

use crate::RegisterArgs;
use crate::connect::Connection;
use crate::exit::{Exit, Failure};
use crate::output::{print, print_json};
use crate::text;
use crate::watch::interrupted;

pub(crate) async fn register(args: RegisterArgs) -> Result<(), Failure> {
    // A third of the TTL; the server's default TTL is 45 s unless told otherwise.
    let heartbeat_ms = args.heartbeat_ms.unwrap_or(match args.ttl_ms {
        0 => 15_000,
        ttl_ms => u64::from(ttl_ms / 3).max(1),
    });
    if heartbeat_ms == 0 {
        return Err(Failure::new(Exit::Usage, "--heartbeat-ms: must be at least 1"));
    }
    // Listening from the start: an interrupt must unregister, not kill the process.
    let interrupted = interrupted()?;
    tokio::pin!(interrupted);
    let connection = Connection::open(&args.target).await?;
    let config = LeaseChannelConfig { bearer_token: connection.token.clone(), ..LeaseChannelConfig::default() };
    let channel = LeaseChannel::from_channel(connection.channel.clone(), config);
    let session_config =
        SessionConfig { ttl_ms: args.ttl_ms, ..SessionConfig::with_heartbeat(Duration::from_millis(heartbeat_ms)) };
    let metadata: HashMap<String, String> = args.metadata.iter().cloned().collect();
    let out = Lines { user: args.user.clone(), session: args.session.clone(), json: args.target.json };
    let session = Session::register(
        &channel,
        args.user.clone(),
        args.session.clone(),
        args.gateway.clone(),
        metadata.clone(),
        session_config,
    )
    .await?;
    out.say(
        "REGISTERED",
        &format!("generation {}, renewing every {heartbeat_ms} ms", session.generation()),
        json!({"registered": {"user_id": args.user, "session_id": args.session, "generation": session.generation().to_string()}}),
    )?;
    for room in &args.rooms {
        let joined = match session.join(room.clone(), metadata.clone()).await {
            Ok(joined) => joined,
            Err(refused) => {
                // Leave nothing behind: the session goes with the failure.
                let _ = session.close().await;
                return Err(refused.into());
            }
        };
        out.say(
            "JOINED",
            &format!("room {room}, version {}", joined.room_version),
            json!({"joined": {"room_id": room, "room_version": joined.room_version.to_string()}}),
        )?;
    }
    let mut states = session.events();
    states.mark_unchanged();
    let superseded = loop {
        tokio::select! {
            () = &mut interrupted => break false,
            changed = states.changed() => {
                if changed.is_err() {
                    break false;
                }
                let state = *states.borrow_and_update();
                out.say_state(state)?;
                if state == SessionState::Superseded {
                    break true;
                }
            }
        }
    };
    if superseded {
        return Err(Failure::new(
            Exit::Failed,
            format!("{}/{}: a newer connection owns the session; this one stopped", args.user, args.session),
        ));
    }
    let unregistered = session.close().await?;
    let presence = unregistered.presence.clone().unwrap_or_default();
    out.say(
        "UNREGISTERED",
        &format!("{} is {} (version {})", args.user, text::state(presence.state), presence.version),
        json!({"unregistered": {"removed": unregistered.removed, "presence": crate::json::user_presence(&presence)}}),
    )?;
    Ok(())
}

/// Where the steps are printed: one line each, or one JSON object.
struct Lines {
    user: String,
    session: String,
    json: bool,
}

impl Lines {
    /// `20:51:03.120  REGISTERED    u1/phone  generation …`, or `object` on a line.
    fn say(&self, what: &str, detail: &str, object: Value) -> Result<(), Failure> {
        if self.json {
            print_json(&object)?;
        } else {
            let clock = text::clock(text::local_now_ms());
            print(&format!("{clock}  {what:<12}  {}/{}  {detail}\n", self.user, self.session))?;
        }
        Ok(())
    }

    /// A change of the lease's state, as the session reports it.
    fn say_state(&self, state: SessionState) -> Result<(), Failure> {
        let (what, detail, generation) = match state {
            SessionState::Live { generation } => ("LIVE", "renewed again".to_owned(), Some(generation)),
            SessionState::Reregistered { generation } => {
                ("REREGISTERED", format!("the server had lost the lease: generation {generation}"), Some(generation))
            }
            SessionState::Superseded => ("SUPERSEDED", "a newer connection owns the session".to_owned(), None),
            SessionState::Lost => ("LOST", "renewals are failing; retrying".to_owned(), None),
        };
        let generation = generation.map(|generation| Value::String(generation.to_string()));
        self.say(what, &detail, json!({"state": what, "generation": generation}))
    }
}

/// `--meta KEY=VALUE`, split at the first `=`.
pub(crate) fn key_value(entry: &str) -> Result<(String, String), String> {
    match entry.split_once('=') {
        Some((key, value)) if !key.is_empty() => Ok((key.to_owned(), value.to_owned())),
        _ => Err(format!("{entry:?} is not KEY=VALUE")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn o4_session_metadata_is_key_equals_value_split_at_the_first_equals() {
        assert_eq!(key_value("device=ios"), Ok(("device".into(), "ios".into())));
        assert_eq!(key_value("url=a=b"), Ok(("url".into(), "a=b".into())));
        assert_eq!(key_value("empty="), Ok(("empty".into(), String::new())));
        assert!(key_value("=ios").is_err());
        assert!(key_value("device").is_err());
    }
}
