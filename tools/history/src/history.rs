//! The recorded history: every call a gateway made, every lease state a
//! `Session` reported, every event a viewer received, and the runner's phase
//! marks, on one monotonic clock shared by the process.
//!
//! This module only records and serialises; what a history must satisfy is
//! the checker's (`checker.rs`).

use std::io::Write;
use std::path::Path;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

/// A user's presence as one observer saw it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Presence {
    /// The user.
    pub user: String,
    /// ONLINE (true) or OFFLINE.
    pub online: bool,
    /// Its version (M3).
    pub version: u64,
}

/// What a gateway asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Unary `Register`.
    Register,
    /// Unary `Renew`.
    Renew,
    /// Unary `Unregister`.
    Unregister,
    /// `Session::register` (a register item on a `LeaseChannel`).
    SessionRegister,
    /// `Session::close` (an unregister item on a `LeaseChannel`).
    SessionClose,
}

impl Op {
    /// Whether the call ends a session (an unregister of either path).
    pub fn is_close(self) -> bool {
        matches!(self, Op::Unregister | Op::SessionClose)
    }

    /// Whether the call creates a session (a register of either path).
    pub fn is_register(self) -> bool {
        matches!(self, Op::Register | Op::SessionRegister)
    }
}

/// How a call ended.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub enum Outcome {
    /// Answered OK.
    Ok {
        /// `changed` of the answer, when the path reports it (`Session::register` does not).
        changed: Option<bool>,
        /// The user's presence in the answer, when it carries one.
        presence: Option<Presence>,
        /// The generation answered (register) or sent (renew, unregister).
        generation: u64,
    },
    /// Refused or failed: the gRPC code's name, and the message.
    Err {
        /// `NotFound`, `Unavailable`, `DeadlineExceeded`, ...
        code: String,
        /// The status message.
        message: String,
    },
}

impl Outcome {
    /// The error code's name, if the call failed.
    pub fn code(&self) -> Option<&str> {
        match self {
            Outcome::Ok { .. } => None,
            Outcome::Err { code, .. } => Some(code),
        }
    }

    /// Whether the server gave a definite answer: OK, or a refusal that changed
    /// nothing. A failure in transit (`Unavailable`, a deadline) leaves the
    /// outcome unknown.
    pub fn is_definite(&self) -> bool {
        match self.code() {
            None => true,
            Some(code) => matches!(code, "NotFound" | "FailedPrecondition" | "InvalidArgument"),
        }
    }
}

/// One call, from the moment it was sent to the moment its answer arrived.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Call {
    /// The gateway that made it (`gw3`).
    pub client: String,
    /// What it asked for.
    pub op: Op,
    /// The user.
    pub user: String,
    /// The session.
    pub session: String,
    /// The generation sent (renew, unregister; 0 for a register).
    pub sent_generation: u64,
    /// Microseconds on the history clock when it was sent.
    pub start_us: u64,
    /// When its answer (or failure) arrived.
    pub end_us: u64,
    /// The answer.
    pub outcome: Outcome,
}

/// The lease states a `Session` reports on its own (its renewals are internal).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SessionState {
    /// Renewing at this generation.
    Live,
    /// The server had lost the lease; registered again.
    Reregistered,
    /// Renewals fail; retrying.
    Lost,
    /// A newer connection owns the session.
    Superseded,
}

/// What a viewer received.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EventKind {
    /// An entry of a stream's opening snapshot.
    Opening {
        /// The snapshot left out users whose version the viewer said it holds (E8).
        partial: bool,
    },
    /// An entry of a later snapshot on the same stream (E4).
    Resync,
    /// An `update`, or one entry of an `updates` batch.
    Update,
}

impl EventKind {
    /// Whether the entry came in a snapshot (which may repeat a version held).
    pub fn is_snapshot(self) -> bool {
        !matches!(self, EventKind::Update)
    }
}

/// One record of the history, as one line of the JSON-lines file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum Record {
    /// A gateway's call.
    Call(Call),
    /// A `Session`'s report of its lease.
    Session {
        /// The gateway.
        client: String,
        /// The user.
        user: String,
        /// The session.
        session: String,
        /// When it was reported.
        at_us: u64,
        /// The state.
        state: SessionState,
        /// The generation it renews with (0 when not known).
        generation: u64,
    },
    /// One user's presence received by a viewer.
    Event {
        /// The viewer.
        viewer: usize,
        /// Which of the viewer's streams (1, 2, ... across reconnects).
        stream: u64,
        /// When it arrived.
        at_us: u64,
        /// In which kind of message.
        kind: EventKind,
        /// What it said.
        presence: Presence,
    },
    /// A viewer's stream opened (its first snapshot arrived) or ended.
    Stream {
        /// The viewer.
        viewer: usize,
        /// The stream.
        stream: u64,
        /// When.
        at_us: u64,
        /// Opened (true) or ended.
        opened: bool,
    },
    /// The users a viewer watches (once, at its start).
    Watching {
        /// The viewer.
        viewer: usize,
        /// Its users.
        users: Vec<String>,
    },
    /// A mark of the runner's schedule (`quiet`, `inject`, `heal`, `churn`, `final-quiet`, `check`).
    Phase {
        /// When.
        at_us: u64,
        /// Which.
        name: String,
    },
    /// A session a gateway holds (registered and renewing) at the final check.
    Held {
        /// The user.
        user: String,
        /// The session.
        session: String,
    },
    /// What a viewer holds at the end (`viewer: None`: a fresh `Snapshot` of every user).
    Final {
        /// The viewer, or none for the fresh snapshot.
        viewer: Option<usize>,
        /// When it was taken.
        at_us: u64,
        /// Per user.
        users: Vec<Presence>,
    },
    /// What the server's checkpoint held when the process was killed (B3).
    Checkpoint {
        /// When the file was read (the process was dead).
        at_us: u64,
        /// Per user in it.
        users: Vec<CheckpointedUser>,
    },
}

impl Record {
    /// When it happened on the history clock, for records that have a time.
    pub fn at_us(&self) -> Option<u64> {
        match self {
            Record::Call(call) => Some(call.end_us),
            Record::Session { at_us, .. }
            | Record::Event { at_us, .. }
            | Record::Stream { at_us, .. }
            | Record::Phase { at_us, .. }
            | Record::Final { at_us, .. }
            | Record::Checkpoint { at_us, .. } => Some(*at_us),
            Record::Watching { .. } | Record::Held { .. } => None,
        }
    }

    /// The user it is about, for records about one user.
    pub fn user(&self) -> Option<&str> {
        match self {
            Record::Call(call) => Some(&call.user),
            Record::Session { user, .. } | Record::Held { user, .. } => Some(user),
            Record::Event { presence, .. } => Some(&presence.user),
            _ => None,
        }
    }
}

/// One user of a checkpoint: its version and state, and its leases.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CheckpointedUser {
    /// The user.
    pub user: String,
    /// The version restored.
    pub version: u64,
    /// The state restored.
    pub online: bool,
    /// Its leases: (session, generation, deadline on the history clock in µs).
    pub leases: Vec<(String, u64, u64)>,
}

/// The shared recorder: cheap to clone, one clock for every client.
#[derive(Debug, Clone)]
pub struct Recorder {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// Zero of the history clock.
    start: Instant,
    /// Unix milliseconds at `start`: turns the server's store times (Unix ms) into history time.
    start_unix_ms: u64,
    /// Every record, in the order they were pushed. A `Mutex<Vec>` is enough:
    /// a push is a few hundred nanoseconds against calls of tens of microseconds.
    records: Mutex<Vec<Record>>,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder::new()
    }
}

impl Recorder {
    /// A recorder whose clock starts now.
    pub fn new() -> Self {
        let start_unix_ms =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or_default();
        Recorder { inner: Arc::new(Inner { start: Instant::now(), start_unix_ms, records: Mutex::new(Vec::new()) }) }
    }

    /// Microseconds since the recorder started.
    pub fn now_us(&self) -> u64 {
        self.inner.start.elapsed().as_micros() as u64
    }

    /// A store time (Unix ms) on the history clock, in µs (0 if before the start).
    pub fn unix_ms_to_us(&self, unix_ms: u64) -> u64 {
        unix_ms.saturating_sub(self.inner.start_unix_ms) * 1_000
    }

    /// Appends a record.
    pub fn push(&self, record: Record) {
        self.records().push(record);
    }

    /// Marks a phase of the schedule, now.
    pub fn phase(&self, name: &str) {
        let at_us = self.now_us();
        self.push(Record::Phase { at_us, name: name.to_owned() });
    }

    /// A copy of every record so far.
    pub fn records_so_far(&self) -> Vec<Record> {
        self.records().clone()
    }

    fn records(&self) -> std::sync::MutexGuard<'_, Vec<Record>> {
        // A push cannot leave the vector half-written, so a poisoned lock still holds a valid history.
        self.inner.records.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// Writes `records` to `path`, one JSON object per line.
pub fn write_json_lines(path: &Path, records: &[Record]) -> std::io::Result<()> {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path)?);
    for record in records {
        serde_json::to_writer(&mut out, record)?;
        out.write_all(b"\n")?;
    }
    out.flush()
}

/// Reads a history written by [`write_json_lines`].
pub fn read_json_lines(path: &Path) -> std::io::Result<Vec<Record>> {
    let text = std::fs::read_to_string(path)?;
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| serde_json::from_str(line).map_err(std::io::Error::other))
        .collect()
}
