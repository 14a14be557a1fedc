//! The edge of one process: the `Presence` handlers, gRPC-Web, JSON over HTTP and the console, their connections, and reloads.
//! It may name both `node/` and `cluster/`; nothing in either names it (their guard tests say so).
//!
//! It decides once per request whether a call is answered here or by
//! another node. `reload_credentials.rs` and `reload_tls.rs` keep the
//! credentials and the TLS material in use current (the credentials file's
//! format is `auth/credentials.rs`'s).

pub(crate) mod connect;
pub(crate) mod connections;
pub(crate) mod metrics_port;
pub(crate) mod readiness;
pub(crate) mod reload_credentials;
pub(crate) mod reload_tls;
pub(crate) mod service;
pub(crate) mod web;
