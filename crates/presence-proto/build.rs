//! Compiles `proto/` with protox, a pure-Rust protobuf compiler, so that no
//! `protoc` is needed on any machine that builds presenced.
//!
//! Messages and the client come from tonic-prost-build as usual. The server
//! trait is generated from the same service description with one change: the
//! `Leases` RPC's requests are decoded as `crate::lease_frames::LeaseBatchFrame`
//! (same wire format, renewal ids kept in the received buffer; see that
//! module) instead of the generated `LeaseBatch`, and the `Watch` RPC's
//! responses are `crate::prepared::WatchFrame` (an event, or its bytes
//! encoded once for every viewer) instead of the generated `WatchEvent`.

use std::{env, path::PathBuf};

use prost::Message as _;

/// Request types the server decodes as something other than the generated message.
const SERVER_INPUT_OVERRIDES: &[(&str, &str)] = &[(".presence.v1.LeaseBatch", "crate::lease_frames::LeaseBatchFrame")];

/// Response types the server encodes from something other than the generated
/// message: a Watch stream sends changes encoded once for every viewer.
const SERVER_OUTPUT_OVERRIDES: &[(&str, &str)] = &[(".presence.v1.WatchEvent", "crate::prepared::WatchFrame")];

const CODEC: &str = "crate::codec::FieldNamingCodec";

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let proto_files = [proto_root.join("presence/v1/presence.proto"), proto_root.join("presence/v1/cluster.proto")];
    println!("cargo:rerun-if-changed={}", proto_root.display());

    let mut descriptors = protox::compile(&proto_files, [&proto_root])?;
    if env::var_os("CARGO_FEATURE_NEXT_CLUSTER_PROTOCOL").is_some() {
        add_next_protocol_fields(&mut descriptors);
    }
    // Server reflection serves this set, so grpcurl-style clients need no .proto file.
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("presence_descriptor.bin"), descriptors.encode_to_vec())?;

    let services: Vec<tonic_build::manual::Service> = descriptors
        .file
        .iter()
        .flat_map(|file| file.service.iter().map(move |service| server_of(file.package(), service)))
        .collect();
    tonic_prost_build::configure().build_server(false).codec_path(CODEC).compile_fds(descriptors)?;
    tonic_build::manual::Builder::new().build_client(false).compile(&services);
    Ok(())
}

/// The node-to-node protocol's next minor version, as a later presenced
/// would add to it: `string sender_version = 100` in `SlotState` and
/// `FollowUpdate`, which a node of this version skips as unknown fields.
/// Only the `next-cluster-protocol` feature's build has it (the
/// mixed-version roll, tools/roll).
fn add_next_protocol_fields(descriptors: &mut prost_types::FileDescriptorSet) {
    use prost_types::field_descriptor_proto::{Label, Type};
    let cluster =
        descriptors.file.iter_mut().find(|file| file.name().ends_with("cluster.proto")).expect("cluster.proto");
    for (index, message) in cluster.message_type.iter_mut().enumerate() {
        if !matches!(message.name(), "SlotState" | "FollowUpdate") {
            continue;
        }
        // prost-build looks up every field's comments by its source location.
        let path = vec![4, index as i32, 2, message.field.len() as i32];
        let locations = &mut cluster.source_code_info.get_or_insert_with(Default::default).location;
        locations.push(prost_types::source_code_info::Location { path, span: vec![0, 0, 0], ..Default::default() });
        message.field.push(prost_types::FieldDescriptorProto {
            name: Some("sender_version".to_owned()),
            number: Some(100),
            label: Some(Label::Optional as i32),
            r#type: Some(Type::String as i32),
            json_name: Some("senderVersion".to_owned()),
            ..Default::default()
        });
    }
}

/// The server side of `service`, every method as tonic-prost-build would make it but for the overrides.
fn server_of(package: &str, service: &prost_types::ServiceDescriptorProto) -> tonic_build::manual::Service {
    let rust_type = |proto_type: &str| {
        let short = proto_type.rsplit('.').next().unwrap_or(proto_type);
        format!("crate::v1::{short}")
    };
    let mut builder = tonic_build::manual::Service::builder().name(service.name()).package(package);
    for method in &service.method {
        let input = SERVER_INPUT_OVERRIDES
            .iter()
            .find(|(proto, _)| *proto == method.input_type())
            .map_or_else(|| rust_type(method.input_type()), |(_, rust)| (*rust).to_owned());
        let mut rpc = tonic_build::manual::Method::builder()
            .name(snake_case(method.name()))
            .route_name(method.name())
            .input_type(input)
            .output_type(
                SERVER_OUTPUT_OVERRIDES
                    .iter()
                    .find(|(proto, _)| *proto == method.output_type())
                    .map_or_else(|| rust_type(method.output_type()), |(_, rust)| (*rust).to_owned()),
            )
            .codec_path(CODEC);
        if method.client_streaming() {
            rpc = rpc.client_streaming();
        }
        if method.server_streaming() {
            rpc = rpc.server_streaming();
        }
        builder = builder.method(rpc.build());
    }
    builder.build()
}

/// `GrantAudience` -> `grant_audience`.
fn snake_case(name: &str) -> String {
    let mut out = String::with_capacity(name.len() + 4);
    for (index, c) in name.char_indices() {
        if c.is_ascii_uppercase() && index > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}
