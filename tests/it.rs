//! The integration tests, in one binary: a test binary links the whole
//! server, so one link instead of one per file. `node` runs one presenced,
//! `cluster` several on a real etcd; `common` is the harness they share.
//! `cargo test --test it NAME` runs the tests whose path contains NAME
//! (`node::ops_cli`, `cluster::outage`, a test's own name).

mod cluster;
mod common;
mod node;
