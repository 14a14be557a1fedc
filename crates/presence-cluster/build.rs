//! Compiles etcd's v3 API (`proto/`, see its README) with protox, a
//! pure-Rust protobuf compiler, so that no `protoc` is needed: clients only.

use std::{env, path::PathBuf};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from(env::var("CARGO_MANIFEST_DIR")?).join("proto");
    println!("cargo:rerun-if-changed={}", proto_root.display());
    let files = ["rpc.proto", "v3election.proto"].map(|file| proto_root.join(file));
    let descriptors = protox::compile(files, [&proto_root])?;
    tonic_prost_build::configure().build_server(false).compile_fds(descriptors)?;
    Ok(())
}
