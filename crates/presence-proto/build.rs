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
//!
//! For JSON over HTTP (the Connect protocol's unary form) it also writes,
//! from the same descriptors: pbjson's serde code for every message (the
//! proto3 JSON mapping), the table of the `Presence` service's unary methods
//! with their request and response types, and the OpenAPI document of those
//! methods. The proto stays the one source of truth for all of them.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::{env, path::PathBuf};

use prost::Message as _;
use prost_types::{DescriptorProto, EnumDescriptorProto, FileDescriptorProto, FileDescriptorSet};
use serde_json::{Map, Value, json};

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
    let encoded = descriptors.encode_to_vec();
    std::fs::write(out_dir.join("presence_descriptor.bin"), &encoded)?;
    // The proto3 JSON mapping of the API's messages, camelCase names out,
    // either name in, every field written even when it holds its default (a
    // PHP or shell caller reads `"state": "STATE_OFFLINE"` rather than
    // guessing). Not the node-to-node messages of cluster.proto: nothing
    // sends them as JSON, and their serde code would only lengthen the build.
    let api = descriptors.file.iter().find(|file| file.name().ends_with("presence.proto")).expect("presence.proto");
    let cluster = descriptors.file.iter().find(|file| file.name().ends_with("cluster.proto")).expect("cluster.proto");
    let node_to_node = cluster
        .message_type
        .iter()
        .map(|message| message.name())
        .chain(cluster.enum_type.iter().map(|enumeration| enumeration.name()))
        .map(|name| format!(".{}.{name}", cluster.package()));
    pbjson_build::Builder::new()
        .register_descriptors(&encoded)?
        .emit_fields()
        .exclude(node_to_node)
        .build(&[".presence.v1"])?;
    std::fs::write(out_dir.join("presence.v1.unary_json.rs"), unary_method_table(api))?;
    let openapi = openapi(&descriptors, api, &env::var("CARGO_PKG_VERSION")?);
    std::fs::write(out_dir.join("openapi.json"), serde_json::to_string_pretty(&openapi)?)?;

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

/// The service whose unary methods are served as JSON over HTTP.
const JSON_SERVICE: &str = "Presence";

/// One unary method of the JSON service.
struct UnaryMethod<'a> {
    name: &'a str,
    input: &'a str,
    output: &'a str,
    comment: String,
}

/// The JSON service's unary methods, in the proto's order.
fn unary_methods(file: &FileDescriptorProto) -> Vec<UnaryMethod<'_>> {
    let comments = comments_of(file);
    let Some((service_index, service)) =
        file.service.iter().enumerate().find(|(_, service)| service.name() == JSON_SERVICE)
    else {
        panic!("{} has no service {JSON_SERVICE}", file.name());
    };
    service
        .method
        .iter()
        .enumerate()
        .filter(|(_, method)| !method.client_streaming() && !method.server_streaming())
        .map(|(index, method)| UnaryMethod {
            name: method.name(),
            input: method.input_type(),
            output: method.output_type(),
            comment: comments.get(&vec![6, service_index as i32, 2, index as i32]).cloned().unwrap_or_default(),
        })
        .collect()
}

/// `crate::connect::UNARY_METHODS`: each unary method's path with the
/// functions that carry its request from JSON to protobuf and its response back.
fn unary_method_table(api: &FileDescriptorProto) -> String {
    let mut out = String::from(
        "/// Every unary method of `presence.v1.Presence`, as JSON over HTTP serves it (generated by build.rs).\n",
    );
    out.push_str("pub const UNARY_METHODS: &[UnaryMethod] = &[\n");
    for method in unary_methods(api) {
        let rust = |proto: &str| format!("crate::v1::{}", proto.rsplit('.').next().unwrap_or(proto));
        let _ = writeln!(
            out,
            "    UnaryMethod {{ name: \"{name}\", path: \"/{package}.{JSON_SERVICE}/{name}\", \
             request_from_json: request_from_json::<{input}>, \
             request_to_json: message_to_json::<{input}>, response_to_json: message_to_json::<{output}> }},",
            name = method.name,
            package = api.package(),
            input = rust(method.input),
            output = rust(method.output),
        );
    }
    out.push_str("];\n");
    out
}

/// Every element's leading comment, by its source path, on one line.
fn comments_of(file: &FileDescriptorProto) -> HashMap<Vec<i32>, String> {
    let Some(info) = &file.source_code_info else { return HashMap::new() };
    info.location
        .iter()
        .filter_map(|location| {
            let comment = location.leading_comments().trim();
            (!comment.is_empty())
                .then(|| (location.path.clone(), comment.split_whitespace().collect::<Vec<_>>().join(" ")))
        })
        .collect()
}

/// The OpenAPI 3.1 document of JSON over HTTP: a `POST` path per unary
/// method, a schema per message and enum of the package (the proto3 JSON
/// mapping: camelCase names, 64-bit integers as strings, enums by name,
/// bytes as base64), and the Connect error every method may answer.
fn openapi(descriptors: &FileDescriptorSet, api: &FileDescriptorProto, version: &str) -> Value {
    let mut schemas = Map::new();
    for file in &descriptors.file {
        let comments = comments_of(file);
        for (index, message) in file.message_type.iter().enumerate() {
            message_schemas(&mut schemas, &comments, &format!("{}.", file.package()), message, vec![4, index as i32]);
        }
        for (index, enumeration) in file.enum_type.iter().enumerate() {
            let name = format!("{}.{}", file.package(), enumeration.name());
            schemas.insert(name, enum_schema(enumeration, comments.get(&vec![5, index as i32])));
        }
    }
    schemas.insert(
        "connect.Error".to_owned(),
        json!({
            "type": "object",
            "description": "A Connect error: the gRPC status code's name in snake_case, the message, and the status details (google.rpc.BadRequest names the refused field; presence.v1.NotOwner names the slot's owner).",
            "required": ["code"],
            "properties": {
                "code": {"type": "string", "enum": [
                    "canceled", "unknown", "invalid_argument", "deadline_exceeded", "not_found", "already_exists",
                    "permission_denied", "resource_exhausted", "failed_precondition", "aborted", "out_of_range",
                    "unimplemented", "internal", "unavailable", "data_loss", "unauthenticated"]},
                "message": {"type": "string"},
                "details": {"type": "array", "items": {
                    "type": "object",
                    "properties": {
                        "type": {"type": "string", "description": "The detail's message type, e.g. google.rpc.BadRequest."},
                        "value": {"type": "string", "contentEncoding": "base64", "description": "The detail's protobuf encoding."},
                        "debug": {"type": "object", "description": "The detail as JSON, for people and scripts."}
                    }
                }}
            }
        }),
    );
    let mut paths = Map::new();
    let reference = |proto: &str| json!({"$ref": format!("#/components/schemas/{}", proto.trim_start_matches('.'))});
    for method in unary_methods(api) {
        let path = format!("/{}.{JSON_SERVICE}/{}", api.package(), method.name);
        paths.insert(
            path,
            json!({"post": {
                "operationId": method.name,
                "description": method.comment,
                "requestBody": {"required": true, "content": {"application/json": {"schema": reference(method.input)}}},
                "responses": {
                    "200": {"description": "The method's response.", "content": {"application/json": {"schema": reference(method.output)}}},
                    "default": {"description": "A Connect error; the HTTP status follows the code.", "content": {"application/json": {"schema": {"$ref": "#/components/schemas/connect.Error"}}}}
                }
            }}),
        );
    }
    json!({
        "openapi": "3.1.0",
        "info": {
            "title": "presenced: JSON over HTTP",
            "version": version,
            "description": "Every unary RPC of presence.v1.Presence in the Connect protocol's unary form: POST the request as JSON (the proto3 JSON mapping), get the response as JSON or a Connect error. Credentials as over gRPC: `authorization: Bearer TOKEN`. Streams (Watch, WatchRoom, WatchRoomCounts, Changes, Backup, Leases) are served over gRPC and gRPC-Web only. Generated from proto/presence/v1/presence.proto."
        },
        "paths": paths,
        "components": {
            "schemas": schemas,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}
        },
        "security": [{}, {"bearer": []}]
    })
}

/// The schema of `message` (named `prefix` + its name) and of every type nested in it.
fn message_schemas(
    schemas: &mut Map<String, Value>,
    comments: &HashMap<Vec<i32>, String>,
    prefix: &str,
    message: &DescriptorProto,
    path: Vec<i32>,
) {
    let name = format!("{prefix}{}", message.name());
    let map_entries: HashMap<String, &DescriptorProto> = message
        .nested_type
        .iter()
        .filter(|nested| nested.options.as_ref().is_some_and(|options| options.map_entry()))
        .map(|nested| (format!(".{name}.{}", nested.name()), nested))
        .collect();
    let mut properties = Map::new();
    for (index, field) in message.field.iter().enumerate() {
        let mut schema = match map_entries.get(field.type_name()) {
            Some(entry) => json!({"type": "object", "additionalProperties": field_schema(&entry.field[1])}),
            None if field.label() == prost_types::field_descriptor_proto::Label::Repeated => {
                json!({"type": "array", "items": field_schema(field)})
            }
            None => field_schema(field),
        };
        let mut field_path = path.clone();
        field_path.extend([2, index as i32]);
        if let Some(comment) = comments.get(&field_path) {
            schema = json!({"allOf": [schema], "description": comment});
        }
        properties.insert(field.json_name().to_owned(), schema);
    }
    let mut schema = json!({"type": "object", "properties": properties});
    if let Some(comment) = comments.get(&path) {
        schema["description"] = json!(comment);
    }
    schemas.insert(name.clone(), schema);
    for (index, nested) in message.nested_type.iter().enumerate() {
        if !map_entries.contains_key(&format!(".{name}.{}", nested.name())) {
            let mut nested_path = path.clone();
            nested_path.extend([3, index as i32]);
            message_schemas(schemas, comments, &format!("{name}."), nested, nested_path);
        }
    }
    for (index, enumeration) in message.enum_type.iter().enumerate() {
        let mut enum_path = path.clone();
        enum_path.extend([4, index as i32]);
        schemas.insert(format!("{name}.{}", enumeration.name()), enum_schema(enumeration, comments.get(&enum_path)));
    }
}

/// One value of `field` as the proto3 JSON mapping writes it.
fn field_schema(field: &prost_types::FieldDescriptorProto) -> Value {
    use prost_types::field_descriptor_proto::Type;
    match field.r#type() {
        Type::Double | Type::Float => json!({"type": "number"}),
        Type::Int32 | Type::Sint32 | Type::Sfixed32 => json!({"type": "integer", "format": "int32"}),
        Type::Uint32 | Type::Fixed32 => json!({"type": "integer", "format": "int64", "minimum": 0}),
        // Strings, because a JSON number rounds above 2^53 (versions and
        // generations are stamps above it); a number is read too.
        Type::Int64 | Type::Sint64 | Type::Sfixed64 => json!({"type": "string", "format": "int64"}),
        Type::Uint64 | Type::Fixed64 => json!({"type": "string", "format": "uint64"}),
        Type::Bool => json!({"type": "boolean"}),
        Type::String => json!({"type": "string"}),
        Type::Bytes => json!({"type": "string", "contentEncoding": "base64"}),
        Type::Enum | Type::Message | Type::Group => {
            json!({"$ref": format!("#/components/schemas/{}", field.type_name().trim_start_matches('.'))})
        }
    }
}

/// An enum: its values' names.
fn enum_schema(enumeration: &EnumDescriptorProto, comment: Option<&String>) -> Value {
    let names: Vec<&str> = enumeration.value.iter().map(|value| value.name()).collect();
    let mut schema = json!({"type": "string", "enum": names});
    if let Some(comment) = comment {
        schema["description"] = json!(comment);
    }
    schema
}
