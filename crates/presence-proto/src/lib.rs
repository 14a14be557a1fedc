//! The generated code of presenced's `presence.v1` gRPC API.
//!
//! Built into `OUT_DIR` from `proto/presence/v1/presence.proto` (the API) and
//! `cluster.proto` (between a cluster's nodes) by a pure-Rust
//! protobuf compiler; nothing here is written by hand except the codec, which
//! turns undecodable requests into `INVALID_ARGUMENT` naming the field, and
//! the server's view of a Leases request ([`lease_frames`]), and the proto3
//! JSON mapping of the messages that leave the process as JSON ([`json`],
//! feature `json`). With feature `json`, every message also has pbjson's
//! generated serde code, which JSON over HTTP uses ([`connect`]).

pub mod codec;
#[cfg(feature = "json")]
pub mod connect;
#[cfg(feature = "json")]
pub mod json;
pub mod lease_frames;
pub mod prepared;

/// Messages and services of the `presence.v1` package.
#[allow(missing_docs, unreachable_pub, clippy::all)]
pub mod v1 {
    tonic::include_proto!("presence.v1");
    // The server trait, generated from the same service (see build.rs).
    include!(concat!(env!("OUT_DIR"), "/presence.v1.Presence.rs"));
    include!(concat!(env!("OUT_DIR"), "/presence.v1.Cluster.rs"));
    // The proto3 JSON mapping of every message (pbjson-build, see build.rs).
    #[cfg(feature = "json")]
    include!(concat!(env!("OUT_DIR"), "/presence.v1.serde.rs"));
}

/// The encoded `FileDescriptorSet` of the API, for server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/presence_descriptor.bin"));
