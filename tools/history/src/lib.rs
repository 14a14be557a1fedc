//! A black-box history checker for presenced, in the manner of Jepsen.
//!
//! Many gateway and viewer clients run against the real `presenced` binary
//! and record every call (start, end, request, outcome) and every event
//! (time, user, state, version; snapshots marked) on one monotonic clock
//! ([`history`]); a fault is injected on a schedule ([`faults`], [`runner`]);
//! the recorded history is then checked ([`checker`]) for one event per flip
//! (E1), versions that never go back, viewers that converge to a fresh
//! snapshot, and no acknowledged register or unregister lost.
//!
//! Plugging in a fault: implement [`faults::Fault`] (and
//! [`checker::Allowances`] for the exceptions it allows), and shape the
//! server through [`server::Launch`] (a command prefix such as
//! `ip netns exec NS`, the listen address, a data directory, flags); clients
//! connect through [`clients::Target`] (a URL and an optional local bind
//! address).

pub mod checker;
pub mod clients;
pub mod diskfaults;
pub mod faults;
pub mod history;
pub mod netfaults;
pub mod runner;
pub mod server;
