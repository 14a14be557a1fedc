//! The wire half of JSON over HTTP (the Connect protocol's unary form): for
//! every unary method of `presence.v1.Presence`, its path and the two
//! conversions a call needs, a JSON request to its protobuf encoding and a
//! protobuf response to JSON. Both go through prost's messages with pbjson's
//! serde code (the proto3 JSON mapping), both generated from the proto by
//! build.rs, so a field added to the proto is served at once and a method
//! added is in [`UNARY_METHODS`] without a line written here.
//!
//! The server serves these by handing the protobuf to the very routes a
//! gRPC call reaches (crate `presence-server`, `api::connect`).

use prost::Message;

/// One unary method as JSON over HTTP serves it.
#[derive(Debug)]
pub struct UnaryMethod {
    /// `Snapshot`.
    pub name: &'static str,
    /// `/presence.v1.Presence/Snapshot`.
    pub path: &'static str,
    /// A JSON request (the proto3 JSON mapping; camelCase or proto field
    /// names) to its protobuf encoding, or why it is not one, naming the field.
    pub request_from_json: fn(&[u8]) -> Result<Vec<u8>, JsonError>,
    /// A protobuf request to JSON, as a caller would send it (camelCase
    /// names, every field written), for a caller that holds it as protobuf.
    pub request_to_json: fn(&[u8]) -> Result<Vec<u8>, prost::DecodeError>,
    /// A protobuf response to JSON (camelCase names, every field written).
    pub response_to_json: fn(&[u8]) -> Result<Vec<u8>, prost::DecodeError>,
}

/// A JSON request that is not the method's request message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JsonError {
    /// Where in the request: `userIds[1]`, or empty for the whole body.
    pub field: String,
    /// What is wrong there, as serde_json tells it.
    pub reason: String,
}

impl std::fmt::Display for JsonError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.field.is_empty() {
            write!(f, "the request is not valid JSON for this method: {}", self.reason)
        } else {
            write!(f, "{}: {}", self.field, self.reason)
        }
    }
}

impl std::error::Error for JsonError {}

fn request_from_json<M>(body: &[u8]) -> Result<Vec<u8>, JsonError>
where
    M: Message + for<'de> serde::Deserialize<'de>,
{
    let mut reader = serde_json::Deserializer::from_slice(body);
    let message: M = serde_path_to_error::deserialize(&mut reader).map_err(|error| {
        let field = error.path().to_string();
        // serde_path_to_error names no field as `.` or `?`.
        let field = if field == "." || field == "?" { String::new() } else { field };
        JsonError { field, reason: error.into_inner().to_string() }
    })?;
    reader.end().map_err(|error| JsonError { field: String::new(), reason: error.to_string() })?;
    Ok(message.encode_to_vec())
}

fn message_to_json<M>(encoded: &[u8]) -> Result<Vec<u8>, prost::DecodeError>
where
    M: Message + Default + serde::Serialize,
{
    let message = M::decode(encoded)?;
    Ok(serde_json::to_vec(&message).expect("a generated message always serializes"))
}

include!(concat!(env!("OUT_DIR"), "/presence.v1.unary_json.rs"));

/// The unary method served at `path`, if there is one.
pub fn unary_method(path: &str) -> Option<&'static UnaryMethod> {
    UNARY_METHODS.iter().find(|method| method.path == path)
}

/// The OpenAPI 3.1 document of JSON over HTTP, generated from the proto.
pub const OPENAPI_JSON: &str = include_str!(concat!(env!("OUT_DIR"), "/openapi.json"));

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1 as pb;

    #[test]
    fn a_request_reads_either_field_name_and_64_bit_integers_as_strings_or_numbers() {
        let register = unary_method("/presence.v1.Presence/Renew").expect("Renew is served");
        for body in [
            r#"{"userId":"alice","sessionId":"s1","generation":"18446744073709551615"}"#,
            r#"{"user_id":"alice","session_id":"s1","generation":18446744073709551615}"#,
        ] {
            let encoded = (register.request_from_json)(body.as_bytes()).expect(body);
            let request = pb::RenewRequest::decode(encoded.as_slice()).unwrap();
            assert_eq!((request.user_id.as_str(), request.generation), ("alice", u64::MAX), "{body}");
        }
    }

    #[test]
    fn a_wrong_request_names_the_field() {
        let snapshot = unary_method("/presence.v1.Presence/Snapshot").unwrap();
        let wrong = (snapshot.request_from_json)(br#"{"userIds":["alice", 7]}"#).unwrap_err();
        assert_eq!(wrong.field, "userIds[1]", "{wrong}");
        let unknown = (snapshot.request_from_json)(br#"{"userIdz":["alice"]}"#).unwrap_err();
        assert!(unknown.to_string().contains("userIdz"), "{unknown}");
        let not_json = (snapshot.request_from_json)(b"{").unwrap_err();
        assert!(not_json.field.is_empty() && !not_json.reason.is_empty(), "{not_json}");
        let trailing = (snapshot.request_from_json)(br#"{} {}"#).unwrap_err();
        assert!(trailing.reason.contains("trailing"), "{trailing}");
    }

    #[test]
    fn a_response_writes_camel_case_names_enum_names_and_every_field() {
        let snapshot = unary_method("/presence.v1.Presence/Snapshot").unwrap();
        let response = pb::SnapshotResponse {
            users: vec![pb::UserPresence {
                user_id: "alice".to_owned(),
                state: pb::State::Offline as i32,
                version: u64::MAX,
                ..Default::default()
            }],
        };
        let json: serde_json::Value =
            serde_json::from_slice(&(snapshot.response_to_json)(&response.encode_to_vec()).unwrap()).unwrap();
        let user = &json["users"][0];
        assert_eq!(user["userId"], "alice");
        assert_eq!(user["state"], "STATE_OFFLINE");
        assert_eq!(user["version"], u64::MAX.to_string());
        assert_eq!(user["lastSeenMs"], "0", "a field at its default is written too");
    }

    #[test]
    fn every_unary_method_is_served_and_no_stream_is() {
        let served: Vec<&str> = UNARY_METHODS.iter().map(|method| method.name).collect();
        for name in ["Register", "Renew", "Unregister", "Snapshot", "RoomCounts", "Stats", "EraseUser"] {
            assert!(served.contains(&name), "{name} in {served:?}");
        }
        for stream in ["Leases", "Watch", "WatchRoom", "WatchRoomCounts", "Backup", "Changes"] {
            assert!(!served.contains(&stream), "{stream} is a stream");
        }
        let openapi: serde_json::Value = serde_json::from_str(OPENAPI_JSON).unwrap();
        let paths = openapi["paths"].as_object().unwrap();
        assert_eq!(paths.len(), UNARY_METHODS.len());
        for method in UNARY_METHODS {
            let request = &paths[method.path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"];
            let name = request.as_str().unwrap().trim_start_matches("#/components/schemas/");
            assert!(openapi["components"]["schemas"][name].is_object(), "{} has its request's schema", method.name);
        }
        let version = &openapi["components"]["schemas"]["presence.v1.UserPresence"]["properties"]["version"];
        assert!(version.to_string().contains("uint64"), "{version}");
    }
}
