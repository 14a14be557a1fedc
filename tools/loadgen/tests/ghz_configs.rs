//! The ghz configurations in `benches/ghz/` against the proto they call.
//!
//! ghz cannot be installed here, so nothing ever runs these files; this test is what
//! keeps them from drifting away from `presence.proto` unnoticed: every `call` names a
//! method of the service, every key of `data` is a field of that method's request (by
//! its proto name or its JSON name, as protobuf JSON accepts), every value has the
//! JSON shape that field takes, and every top-level key is one of ghz's config keys.

use std::path::{Path, PathBuf};

use prost::Message;
use prost_types::field_descriptor_proto::{Label, Type};
use prost_types::{DescriptorProto, FileDescriptorSet};
use serde_json::Value;

/// ghz's JSON config keys (its `runner.Config` struct tags).
const GHZ_KEYS: &[&str] = &[
    "proto",
    "protoset",
    "call",
    "cacert",
    "cert",
    "key",
    "skipTLS",
    "cname",
    "authority",
    "insecure",
    "total",
    "concurrency",
    "connections",
    "qps",
    "duration",
    "duration-stop",
    "max-duration",
    "timeout",
    "data",
    "data-file",
    "binary-file",
    "metadata",
    "metadata-file",
    "stream-interval",
    "output",
    "format",
    "connect-timeout",
    "keepalive",
    "cpus",
    "import-paths",
    "name",
    "tags",
    "reflect-metadata",
    "debug",
    "host",
    "enable-compression",
];

fn ghz_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../benches/ghz")
}

fn configs() -> Vec<(String, Value)> {
    let mut out: Vec<(String, Value)> = std::fs::read_dir(ghz_dir())
        .expect("benches/ghz exists")
        .map(|e| e.expect("readable entry").path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .map(|p| {
            let text = std::fs::read_to_string(&p).expect("readable config");
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            let value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{name}: not JSON: {e}"));
            (name, value)
        })
        .collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    out
}

fn descriptors() -> FileDescriptorSet {
    FileDescriptorSet::decode(presence_proto::FILE_DESCRIPTOR_SET).expect("the compiled descriptor set decodes")
}

/// The request message of `package.Service.Method` or `package.Service/Method`.
fn request_of<'a>(set: &'a FileDescriptorSet, call: &str) -> Result<&'a DescriptorProto, String> {
    let (service_path, method) = call.rsplit_once(['/', '.']).ok_or_else(|| format!("{call}: no method"))?;
    let (package, service) = service_path.rsplit_once('.').ok_or_else(|| format!("{call}: no package"))?;
    let file = set.file.iter().find(|f| f.package() == package).ok_or_else(|| format!("no package {package}"))?;
    let svc = file.service.iter().find(|s| s.name() == service).ok_or_else(|| format!("no service {service}"))?;
    let m =
        svc.method.iter().find(|m| m.name() == method).ok_or_else(|| format!("{service} has no method {method}"))?;
    let input = m.input_type().trim_start_matches('.');
    let (pkg, msg) = input.rsplit_once('.').expect("qualified input type");
    set.file
        .iter()
        .filter(|f| f.package() == pkg)
        .flat_map(|f| &f.message_type)
        .find(|d| d.name() == msg)
        .ok_or_else(|| format!("no message {input}"))
}

/// Whether `v` is what protobuf JSON accepts for one value of a field of type `t`. Strings
/// are accepted for every type, so that ghz's call-data templates (`{{.RequestNumber}}`)
/// and placeholders to fill in (`GENERATION`) pass; a string in a numeric field must then
/// be a template, a placeholder in capitals, or a number.
fn scalar_fits(t: Type, v: &Value) -> bool {
    let template_or_number = |s: &str| {
        s.contains("{{")
            || (!s.is_empty() && s.bytes().all(|b| b.is_ascii_uppercase() || b == b'_'))
            || s.parse::<f64>().is_ok()
    };
    match t {
        Type::String | Type::Bytes => v.is_string(),
        Type::Bool => v.is_boolean(),
        Type::Uint32 | Type::Fixed32 | Type::Uint64 | Type::Fixed64 => {
            v.as_u64().is_some() || v.as_str().is_some_and(template_or_number)
        }
        Type::Int32 | Type::Sint32 | Type::Sfixed32 | Type::Int64 | Type::Sint64 | Type::Sfixed64 => {
            v.as_i64().is_some() || v.as_str().is_some_and(template_or_number)
        }
        Type::Double | Type::Float => v.is_number() || v.as_str().is_some_and(template_or_number),
        Type::Enum => v.is_string() || v.is_i64(),
        Type::Message | Type::Group => v.is_object(),
    }
}

fn check_data(msg: &DescriptorProto, data: &Value) -> Result<(), String> {
    let obj = data.as_object().ok_or("data is not an object")?;
    for (key, value) in obj {
        let field = msg
            .field
            .iter()
            .find(|f| f.name() == key || f.json_name() == key)
            .ok_or_else(|| format!("{}: no field {key}", msg.name()))?;
        let ok = if field.label() == Label::Repeated {
            value.as_array().is_some_and(|a| a.iter().all(|v| scalar_fits(field.r#type(), v)))
        } else {
            scalar_fits(field.r#type(), value)
        };
        if !ok {
            return Err(format!("{}.{key}: {value} does not fit a {:?} field", msg.name(), field.r#type()));
        }
    }
    Ok(())
}

#[test]
fn ghz_configs_follow_the_proto() {
    let set = descriptors();
    let configs = configs();
    assert!(configs.len() >= 3, "register, renew and snapshot at least");
    for (name, config) in &configs {
        let obj = config.as_object().unwrap_or_else(|| panic!("{name}: not an object"));
        for key in obj.keys() {
            assert!(GHZ_KEYS.contains(&key.as_str()), "{name}: {key} is not a ghz config key");
        }
        let call = obj["call"].as_str().unwrap_or_else(|| panic!("{name}: no call"));
        let request = request_of(&set, call).unwrap_or_else(|e| panic!("{name}: {e}"));
        check_data(request, &obj["data"]).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert!(obj.contains_key("total") || obj.contains_key("duration"), "{name}: bounded by total or duration");
        assert_eq!(obj.get("insecure"), Some(&Value::Bool(true)), "{name}: presenced speaks plaintext");
    }
}

#[test]
fn the_check_catches_drift() {
    let set = descriptors();
    let renew = request_of(&set, "presence.v1.Presence.Renew").unwrap();
    assert!(request_of(&set, "presence.v1.Presence/Renew").is_ok(), "ghz's other spelling");
    assert!(request_of(&set, "presence.v1.Presence.Renw").is_err());
    assert!(request_of(&set, "presence.v2.Presence.Renew").is_err());
    assert!(check_data(renew, &serde_json::json!({"user_id": "u", "generation": "GENERATION"})).is_ok());
    assert!(check_data(renew, &serde_json::json!({"userId": "u", "ttlMs": 1000})).is_ok(), "JSON names");
    assert!(check_data(renew, &serde_json::json!({"user": "u"})).is_err(), "unknown field");
    assert!(check_data(renew, &serde_json::json!({"ttl_ms": "soon"})).is_err(), "a word in a number");
    assert!(check_data(renew, &serde_json::json!({"user_id": ["u"]})).is_err(), "a list in a singular field");
    let snapshot = request_of(&set, "presence.v1.Presence.Snapshot").unwrap();
    assert!(check_data(snapshot, &serde_json::json!({"user_ids": "u0"})).is_err(), "a string for a list");
}
