//! Compiles `proto/` with protox, a pure-Rust protobuf compiler, so that no
//! `protoc` is needed on any machine that builds presenced.

use std::{env, path::PathBuf};

use prost::Message as _;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("../../proto");
    let proto_file = proto_root.join("presence/v1/presence.proto");
    println!("cargo:rerun-if-changed={}", proto_root.display());

    let descriptors = protox::compile([&proto_file], [&proto_root])?;
    // Server reflection serves this set, so grpcurl-style clients need no .proto file.
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    std::fs::write(out_dir.join("presence_descriptor.bin"), descriptors.encode_to_vec())?;

    tonic_prost_build::configure().codec_path("crate::codec::FieldNamingCodec").compile_fds(descriptors)?;
    Ok(())
}
