//! The proto3 JSON mapping of the API's messages, written by hand for those
//! that leave the process as JSON: the command line's `--json` answers and
//! the change feed's webhook batches (F4). The proto's own field names and
//! every field present (what protobuf-es's `toJson` writes with
//! `useProtoFieldName` and `alwaysEmitImplicit`, and its `fromJson` reads
//! back). 64-bit integers are strings, as the mapping says, because versions
//! and generations are stamps above 2^53 that a JSON number would round;
//! enums are their names; bytes are standard base64, padded; an absent
//! message is `null`.

use serde_json::{Value, json};

use crate::v1::{self as pb, change_event};

/// An `int64` field.
pub fn int64(value: i64) -> Value {
    Value::String(value.to_string())
}

/// A `uint64` field.
pub fn uint64(value: u64) -> Value {
    Value::String(value.to_string())
}

/// An enum field by its name, or its number when this build does not know it.
pub fn enum_name<E: TryFrom<i32>>(code: i32, name: fn(&E) -> &'static str) -> Value {
    E::try_from(code).map_or_else(|_| json!(code), |known| json!(name(&known)))
}

/// A `bytes` field: standard base64, padded.
pub fn bytes(value: &[u8]) -> Value {
    use base64::Engine as _;
    Value::String(base64::engine::general_purpose::STANDARD.encode(value))
}

/// A `UserPresence`.
pub fn user_presence(user: &pb::UserPresence) -> Value {
    json!({
        "user_id": user.user_id,
        "state": enum_name(user.state, pb::State::as_str_name),
        "version": uint64(user.version),
        "last_active_at_ms": int64(user.last_active_at_ms),
        "status": user.status.as_ref().map_or(Value::Null, status),
        "last_seen_ms": int64(user.last_seen_ms),
        "availability": enum_name(user.availability, pb::Availability::as_str_name),
    })
}

/// A `Status`.
pub fn status(status: &pb::Status) -> Value {
    json!({
        "availability": enum_name(status.availability, pb::Availability::as_str_name),
        "text": status.text,
        "expires_at_ms": int64(status.expires_at_ms),
    })
}

/// A `ChangeEvent`: its cursor, the one field of its `event` it carries,
/// its time and its slot.
pub fn change_event(event: &pb::ChangeEvent) -> Value {
    let mut value = json!({
        "cursor": bytes(&event.cursor),
        "at_ms": int64(event.at_ms),
        "slot": event.slot,
    });
    let (field, body) = match &event.event {
        Some(change_event::Event::Flip(user)) => ("flip", user_presence(user)),
        Some(change_event::Event::Status(user)) => ("status", user_presence(user)),
        Some(change_event::Event::Availability(user)) => ("availability", user_presence(user)),
        Some(change_event::Event::RoomOccupancy(room)) => (
            "room_occupancy",
            json!({ "room_id": room.room_id, "occupied": room.occupied, "version": uint64(room.version) }),
        ),
        Some(change_event::Event::Gap(gap)) => {
            ("gap", json!({ "after_cursor": bytes(&gap.after_cursor), "reason": gap.reason, "lost": uint64(gap.lost) }))
        }
        Some(change_event::Event::Progress(_)) => ("progress", json!({})),
        None => return value,
    };
    value[field] = body;
    value
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_event_carries_its_one_event_with_large_numbers_as_strings() {
        let flip = pb::ChangeEvent {
            cursor: vec![1, 0, 0, 0, 0, 0, 0, 0, 7, 0, 0, 0, 3],
            event: Some(change_event::Event::Flip(pb::UserPresence {
                user_id: "u1".into(),
                state: pb::State::Online as i32,
                version: (1 << 60) + 1,
                ..Default::default()
            })),
            at_ms: 1_700_000_000_000,
            slot: 3,
        };
        let value = change_event(&flip);
        assert_eq!(value["cursor"], "AQAAAAAAAAAHAAAAAw==");
        assert_eq!((value["at_ms"].as_str(), value["slot"].as_u64()), (Some("1700000000000"), Some(3)));
        assert_eq!(value["flip"]["version"], "1152921504606846977");
        assert_eq!(value["flip"]["state"], "STATE_ONLINE");
        assert_eq!(value.as_object().unwrap().len(), 4, "cursor, at_ms, slot and the event: {value}");
        let gap = pb::ChangeEvent {
            event: Some(change_event::Event::Gap(pb::Gap {
                after_cursor: vec![1; 13],
                reason: "restart".into(),
                lost: 0,
            })),
            ..Default::default()
        };
        assert_eq!(
            change_event(&gap)["gap"],
            json!({ "after_cursor": "AQEBAQEBAQEBAQEBAQ==", "reason": "restart", "lost": "0" })
        );
    }
}
