//! The Redis + Lua baseline, exactly as seed article 000 writes it.
//!
//! * Keys, with the user id as Redis Cluster hash tag:
//!   `presence:{<user>}:s:<session>` (HASH gateway, gen, hb; PEXPIRE = TTL),
//!   `presence:{<user>}:idx` (ZSET session -> lease deadline ms),
//!   `presence:{<user>}:meta` (HASH state, ver, gen), and the global `presence:due` ZSET
//!   (user -> deadline, written by the gateway with its own clock).
//! * The five Lua scripts are the files in `lua/`, copied verbatim from the seed, loaded
//!   with `SCRIPT LOAD` and called with `EVALSHA`.
//! * The gateway's steps: register = `presence_register` then `ZADD presence:due
//!   now+TTL user` then, when the user flipped, `PUBLISH presence:out:<user>
//!   {"userId","state","ver"}`; heartbeat = `presence_heartbeat` only; close =
//!   `presence_unregister` then a PUBLISH when it flipped.
//! * The sweeper ([`sweep_once`], every 2 s): `ZRANGEBYSCORE presence:due -inf <now>
//!   WITHSCORES LIMIT 0 500`, then for each user `presence_recompute`, PUBLISH offline
//!   when it flipped, and re-`ZADD` the user at its next deadline or `due_remove` it.

use std::time::{SystemTime, UNIX_EPOCH};

use redis::aio::MultiplexedConnection;
use redis::{Pipeline, RedisError, Value};

/// The global due set of the seed's sweeper.
pub(crate) const DUE_KEY: &str = "presence:due";
/// Prefix of the per-user transition channels.
pub(crate) const OUT_PREFIX: &str = "presence:out:";
/// The seed's sweeper period and batch.
pub(crate) const SWEEP_INTERVAL_MS: u64 = 2_000;
/// Users taken from the due set per sweep.
pub(crate) const SWEEP_LIMIT: u64 = 500;

/// `presence:{<user>}:s:<session>`
pub(crate) fn session_key(user: &str, session: &str) -> String {
    format!("presence:{{{user}}}:s:{session}")
}

/// `presence:{<user>}:idx`
pub(crate) fn idx_key(user: &str) -> String {
    format!("presence:{{{user}}}:idx")
}

/// `presence:{<user>}:meta`
pub(crate) fn meta_key(user: &str) -> String {
    format!("presence:{{{user}}}:meta")
}

/// `presence:out:<user>`
pub(crate) fn out_channel(user: &str) -> String {
    format!("{OUT_PREFIX}{user}")
}

/// The JSON the seed's `publishTransition` sends: `{"userId":..,"state":..,"ver":..}`.
pub(crate) fn transition_payload(user: &str, state: &str, ver: i64) -> String {
    serde_json::json!({ "userId": user, "state": state, "ver": ver }).to_string()
}

/// A transition read back from a channel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Transition {
    /// The user id.
    pub(crate) user: String,
    /// `online` or `offline`.
    pub(crate) state: String,
    /// The user's version after the flip.
    pub(crate) ver: i64,
}

/// Parses a payload made by [`transition_payload`] (or by the seed's Node gateway).
pub(crate) fn parse_transition(payload: &[u8]) -> Option<Transition> {
    let v: serde_json::Value = serde_json::from_slice(payload).ok()?;
    let user = match &v["userId"] {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Number(n) => n.to_string(),
        _ => return None,
    };
    Some(Transition { user, state: v["state"].as_str()?.to_owned(), ver: v["ver"].as_i64()? })
}

/// One of the seed's scripts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScriptName {
    /// `presence_register.lua`
    Register,
    /// `presence_heartbeat.lua`
    Heartbeat,
    /// `presence_unregister.lua`
    Unregister,
    /// `presence_recompute.lua`
    Recompute,
    /// `due_remove.lua`
    DueRemove,
}

impl ScriptName {
    /// All five, in the seed's order.
    pub(crate) const ALL: [ScriptName; 5] = [
        ScriptName::Register,
        ScriptName::Heartbeat,
        ScriptName::Unregister,
        ScriptName::Recompute,
        ScriptName::DueRemove,
    ];

    /// The file name in `lua/`, without `.lua`.
    pub(crate) fn file_stem(self) -> &'static str {
        match self {
            ScriptName::Register => "presence_register",
            ScriptName::Heartbeat => "presence_heartbeat",
            ScriptName::Unregister => "presence_unregister",
            ScriptName::Recompute => "presence_recompute",
            ScriptName::DueRemove => "due_remove",
        }
    }

    /// The script text, verbatim from the seed.
    pub(crate) fn source(self) -> &'static str {
        match self {
            ScriptName::Register => include_str!("../lua/presence_register.lua"),
            ScriptName::Heartbeat => include_str!("../lua/presence_heartbeat.lua"),
            ScriptName::Unregister => include_str!("../lua/presence_unregister.lua"),
            ScriptName::Recompute => include_str!("../lua/presence_recompute.lua"),
            ScriptName::DueRemove => include_str!("../lua/due_remove.lua"),
        }
    }

    /// The SHA1 that `SCRIPT LOAD` answers and `EVALSHA` takes.
    pub(crate) fn sha1(self) -> String {
        redis::Script::new(self.source()).get_hash().to_owned()
    }
}

/// The scripts' SHA1s, after `SCRIPT LOAD`.
#[derive(Debug, Clone)]
pub(crate) struct Scripts {
    register: String,
    heartbeat: String,
    unregister: String,
    recompute: String,
    due_remove: String,
}

impl Scripts {
    /// Loads the five scripts (`SCRIPT LOAD`, idempotent) and checks each answer against
    /// the SHA1 of the embedded text.
    pub(crate) async fn load(conn: &mut MultiplexedConnection) -> Result<Scripts, RedisError> {
        let mut shas = Vec::new();
        for s in ScriptName::ALL {
            let sha: String = redis::cmd("SCRIPT").arg("LOAD").arg(s.source()).query_async(conn).await?;
            if sha != s.sha1() {
                return Err(RedisError::from((
                    redis::ErrorKind::ClientError,
                    "SCRIPT LOAD answered an unexpected SHA1",
                    format!("{}: {sha} != {}", s.file_stem(), s.sha1()),
                )));
            }
            shas.push(sha);
        }
        let mut it = shas.into_iter();
        let mut next = || it.next().unwrap_or_default();
        Ok(Scripts { register: next(), heartbeat: next(), unregister: next(), recompute: next(), due_remove: next() })
    }

    /// Appends `presence_register` (KEYS session, idx, meta; ARGV session, gateway, ttl).
    pub(crate) fn register(&self, p: &mut Pipeline, user: &str, session: &str, gateway: &str, ttl_ms: u32) {
        p.cmd("EVALSHA")
            .arg(&self.register)
            .arg(3)
            .arg(session_key(user, session))
            .arg(idx_key(user))
            .arg(meta_key(user))
            .arg(session)
            .arg(gateway)
            .arg(ttl_ms);
    }

    /// Appends `presence_heartbeat` (KEYS session, idx; ARGV session, gen, ttl).
    pub(crate) fn heartbeat(&self, p: &mut Pipeline, user: &str, session: &str, generation: u64, ttl_ms: u32) {
        p.cmd("EVALSHA")
            .arg(&self.heartbeat)
            .arg(2)
            .arg(session_key(user, session))
            .arg(idx_key(user))
            .arg(session)
            .arg(generation)
            .arg(ttl_ms);
    }

    /// Appends `presence_unregister` (KEYS session, idx, meta; ARGV session, gen).
    pub(crate) fn unregister(&self, p: &mut Pipeline, user: &str, session: &str, generation: u64) {
        p.cmd("EVALSHA")
            .arg(&self.unregister)
            .arg(3)
            .arg(session_key(user, session))
            .arg(idx_key(user))
            .arg(meta_key(user))
            .arg(session)
            .arg(generation);
    }

    /// Appends `presence_recompute` (KEYS idx, meta).
    pub(crate) fn recompute(&self, p: &mut Pipeline, user: &str) {
        p.cmd("EVALSHA").arg(&self.recompute).arg(2).arg(idx_key(user)).arg(meta_key(user));
    }

    /// Appends `due_remove` (KEYS presence:due; ARGV user, expected score).
    pub(crate) fn due_remove(&self, p: &mut Pipeline, user: &str, score: &str) {
        p.cmd("EVALSHA").arg(&self.due_remove).arg(1).arg(DUE_KEY).arg(user).arg(score);
    }
}

/// The gateway's clock, `Date.now()`.
pub(crate) fn now_ms() -> i64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64)
}

/// Reads the `{a, b}` pair a script returns.
pub(crate) fn pair(v: &Value) -> Option<(i64, i64)> {
    match v {
        Value::Array(items) if items.len() == 2 => Some((int(&items[0])?, int(&items[1])?)),
        _ => None,
    }
}

/// Reads an integer reply (or a bulk string holding one).
pub(crate) fn int(v: &Value) -> Option<i64> {
    match v {
        Value::Int(i) => Some(*i),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// Reads a number reply such as a ZSCORE (a bulk string, or a double in RESP3).
pub(crate) fn number(v: &Value) -> Option<f64> {
    match v {
        Value::Int(i) => Some(*i as f64),
        Value::Double(d) => Some(*d),
        Value::BulkString(b) => std::str::from_utf8(b).ok()?.parse().ok(),
        Value::SimpleString(s) => s.parse().ok(),
        _ => None,
    }
}

/// What one sweep did.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct SweepStats {
    /// Users read from the due set.
    pub(crate) users: u64,
    /// OFFLINE transitions published.
    pub(crate) published: u64,
    /// Users put back at a later deadline.
    pub(crate) rescheduled: u64,
}

/// The seed's `sweepOnce`, one command at a time as its Node code awaits them.
pub(crate) async fn sweep_once(
    conn: &mut MultiplexedConnection,
    scripts: &Scripts,
    limit: u64,
) -> Result<SweepStats, RedisError> {
    let rows: Vec<String> = redis::cmd("ZRANGEBYSCORE")
        .arg(DUE_KEY)
        .arg("-inf")
        .arg(now_ms())
        .arg("WITHSCORES")
        .arg("LIMIT")
        .arg(0)
        .arg(limit)
        .query_async(conn)
        .await?;
    let mut stats = SweepStats::default();
    for row in rows.chunks(2) {
        let [user, score] = row else { continue };
        stats.users += 1;
        let mut p = redis::pipe();
        scripts.recompute(&mut p, user);
        let v: Vec<Value> = p.query_async(conn).await?;
        let (ver, live_until) = v.first().and_then(pair).unwrap_or((0, 0));
        if ver != 0 {
            let _: i64 = redis::cmd("PUBLISH")
                .arg(out_channel(user))
                .arg(transition_payload(user, "offline", ver))
                .query_async(conn)
                .await?;
            stats.published += 1;
        }
        if live_until > 0 {
            let _: i64 = redis::cmd("ZADD").arg(DUE_KEY).arg(live_until).arg(user).query_async(conn).await?;
            stats.rescheduled += 1;
        } else {
            let mut p = redis::pipe();
            scripts.due_remove(&mut p, user, score);
            let _: Vec<Value> = p.query_async(conn).await?;
        }
    }
    Ok(stats)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_match_the_seed_layout() {
        // The seed: sessionKey = 'presence:{' + u + '}:s:' + s, idxKey = 'presence:{' + u + '}:idx',
        // metaKey = 'presence:{' + u + '}:meta', channel 'presence:out:' + userId.
        assert_eq!(session_key("42", "sess_phone"), "presence:{42}:s:sess_phone");
        assert_eq!(idx_key("42"), "presence:{42}:idx");
        assert_eq!(meta_key("42"), "presence:{42}:meta");
        assert_eq!(out_channel("42"), "presence:out:42");
        assert_eq!(DUE_KEY, "presence:due");
        assert_eq!(session_key("u7", "sess_abc"), "presence:{u7}:s:sess_abc");
    }

    #[test]
    fn payload_round_trips_like_the_seed() {
        let p = transition_payload("u9", "offline", 3);
        let v: serde_json::Value = serde_json::from_str(&p).unwrap();
        assert_eq!(v, serde_json::json!({"userId": "u9", "state": "offline", "ver": 3}));
        assert_eq!(
            parse_transition(p.as_bytes()),
            Some(Transition { user: "u9".into(), state: "offline".into(), ver: 3 })
        );
        // The seed's Node code publishes numeric user ids as numbers when they are numbers.
        assert_eq!(parse_transition(br#"{"userId":42,"state":"online","ver":1}"#).unwrap().user, "42");
        assert_eq!(parse_transition(b"not json"), None);
    }

    #[test]
    fn scripts_are_the_seed_blocks() {
        for s in ScriptName::ALL {
            let src = s.source();
            assert!(src.starts_with(&format!("-- ===== {}.lua", s.file_stem())), "{}", s.file_stem());
            assert_eq!(s.sha1().len(), 40);
        }
        assert!(ScriptName::Heartbeat.source().contains("if redis.call('HGET', KEYS[1], 'gen') ~= ARGV[2]"));
        assert!(ScriptName::Recompute.source().contains("return {ver, top[2] and tonumber(top[2]) or 0}"));
    }

    /// When the seed is at hand (the workspace's `shared/` beside the repository), every
    /// script file must appear in it character for character.
    #[test]
    fn scripts_are_verbatim_when_the_seed_is_at_hand() {
        let dirs = [
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../../shared/seeds"),
            std::path::PathBuf::from("/work/shared/seeds"),
        ];
        let Some(seed) = dirs.iter().filter_map(|d| std::fs::read_dir(d).ok()).flatten().flatten().find_map(|e| {
            let name = e.file_name().to_string_lossy().into_owned();
            name.starts_with("000_").then(|| std::fs::read_to_string(e.path()).ok()).flatten()
        }) else {
            eprintln!("seed 000 not found beside the repository: verbatim check skipped");
            return;
        };
        for s in ScriptName::ALL {
            assert!(seed.contains(s.source().trim_end()), "{}.lua differs from the seed", s.file_stem());
        }
    }

    #[test]
    fn replies_decode() {
        assert_eq!(pair(&Value::Array(vec![Value::Int(3), Value::Int(0)])), Some((3, 0)));
        assert_eq!(pair(&Value::Int(3)), None);
        assert_eq!(number(&Value::BulkString(b"1700000000123".to_vec())), Some(1_700_000_000_123.0));
        assert_eq!(int(&Value::BulkString(b"12".to_vec())), Some(12));
    }
}
