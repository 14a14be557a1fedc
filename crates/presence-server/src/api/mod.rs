//! The edge of one process: the `Presence` gRPC handlers, gRPC-Web and the
//! console, and the connections they are served on. It sees both `node/`
//! and `cluster/`, and decides once per request whether it is answered here
//! or by another node.

pub(crate) mod connections;
pub(crate) mod metrics_port;
pub(crate) mod readiness;
pub(crate) mod reload_credentials;
pub(crate) mod reload_tls;
pub(crate) mod service;
pub(crate) mod web;
