//! The `--json` form of answers: the proto3 JSON mapping with the proto's own
//! field names and every field present (what protobuf-es's `toJson` writes
//! with `useProtoFieldName` and `alwaysEmitImplicit`, so the console, the
//! TypeScript client and scripts read the same shapes). The mapping's rules
//! and the messages the server writes as JSON too (presence, statuses) are
//! `presence_proto::json`'s.

use std::collections::HashMap;

use presence_client::pb;
pub(crate) use presence_proto::json::user_presence;
use presence_proto::json::{bytes, enum_name, int64, status, uint64};
use serde_json::{Value, json};

fn map(entries: &HashMap<String, String>) -> Value {
    Value::Object(entries.iter().map(|(key, value)| (key.clone(), json!(value))).collect())
}

fn list<T>(items: &[T], each: fn(&T) -> Value) -> Value {
    Value::Array(items.iter().map(each).collect())
}

pub(crate) fn snapshot_response(users: &[pb::UserPresence]) -> Value {
    json!({ "users": list(users, user_presence) })
}

pub(crate) fn notify_targets(targets: &[pb::NotifyTarget]) -> Value {
    json!({ "targets": list(targets, notify_target) })
}

fn notify_target(target: &pb::NotifyTarget) -> Value {
    json!({
        "user_id": target.user_id,
        "in_app_session_ids": target.in_app_session_ids,
        "push_now": target.push_now,
        "push_after_ms": uint64(target.push_after_ms),
        "reason": enum_name(target.reason, pb::NotifyReason::as_str_name),
    })
}

pub(crate) fn list_sessions_response(response: &pb::ListSessionsResponse) -> Value {
    json!({ "sessions": list(&response.sessions, session_info), "now_ms": int64(response.now_ms) })
}

fn session_info(session: &pb::SessionInfo) -> Value {
    json!({
        "gateway_id": session.gateway_id,
        "session_id": session.session_id,
        "generation": uint64(session.generation),
        "expires_at_ms": int64(session.expires_at_ms),
        "metadata": map(&session.metadata),
        "rooms": session.rooms,
        "last_renewed_at_ms": int64(session.last_renewed_at_ms),
        "lingering": session.lingering,
    })
}

/// An export (P7), every field present. Settings' values are bytes, so
/// base64 (a setting `locale = "fr"` reads `"locale": "ZnI="`).
pub(crate) fn export_user_response(exported: &pb::ExportUserResponse) -> Value {
    let mut settings: Vec<(&String, &Vec<u8>)> = exported.settings.iter().collect();
    settings.sort();
    json!({
        "user_id": exported.user_id,
        "exported_at_ms": int64(exported.exported_at_ms),
        "held": exported.held,
        "presence": exported.presence.as_ref().map_or(Value::Null, user_presence),
        "sessions": list(&exported.sessions, session_info),
        "rooms": list(&exported.rooms, exported_room_membership),
        "status": exported.status.as_ref().map_or(Value::Null, status),
        "visibility": enum_name(exported.visibility, pb::Visibility::as_str_name),
        "visibility_is_default": exported.visibility_is_default,
        "audience": exported.audience,
        "in_audience_of": exported.in_audience_of,
        "groups": exported.groups,
        "last_active_at_ms": int64(exported.last_active_at_ms),
        "settings": Value::Object(settings.into_iter().map(|(name, value)| (name.clone(), bytes(value))).collect()),
    })
}

fn exported_room_membership(membership: &pb::ExportedRoomMembership) -> Value {
    json!({
        "room_id": membership.room_id,
        "session_id": membership.session_id,
        "metadata": map(&membership.metadata),
    })
}

/// What an erase removed (P7).
pub(crate) fn erase_user_response(erased: &pb::EraseUserResponse) -> Value {
    json!({
        "sessions_revoked": erased.sessions_revoked,
        "rooms_left": erased.rooms_left,
        "went_offline": erased.went_offline,
        "status_removed": erased.status_removed,
        "visibility_removed": erased.visibility_removed,
        "audience_removed": erased.audience_removed,
        "removed_from_audiences": erased.removed_from_audiences,
        "groups_left": erased.groups_left,
        "settings_removed": erased.settings_removed,
        "activity_removed": erased.activity_removed,
        "presence_forgotten": erased.presence_forgotten,
    })
}

pub(crate) fn revoke_response(response: &pb::RevokeResponse) -> Value {
    json!({
        "revoked": response.revoked,
        "changed": response.changed,
        "presence": response.presence.as_ref().map_or(Value::Null, user_presence),
    })
}

pub(crate) fn room_snapshot(room: &pb::RoomSnapshot) -> Value {
    json!({
        "room_id": room.room_id,
        "version": uint64(room.version),
        "users": room.users,
        "sessions": room.sessions,
        "members": list(&room.members, room_member),
        "members_omitted": room.members_omitted,
        "signals": list(&room.signals, signal_set),
    })
}

fn room_member(member: &pb::RoomMember) -> Value {
    json!({ "user_id": member.user_id, "metadata": map(&member.metadata), "sessions": member.sessions })
}

pub(crate) fn signal_set(set: &pb::SignalSet) -> Value {
    json!({
        "room_id": set.room_id,
        "version": uint64(set.version),
        "kind": set.kind,
        "user_ids": set.user_ids,
        "count": set.count,
    })
}

pub(crate) fn room_member_change(change: &pb::RoomMemberChange) -> Value {
    json!({
        "room_id": change.room_id,
        "version": uint64(change.version),
        "kind": enum_name(change.kind, pb::RoomChangeKind::as_str_name),
        "member": change.member.as_ref().map_or(Value::Null, room_member),
    })
}

pub(crate) fn room_count(count: &pb::RoomCount) -> Value {
    json!({
        "room_id": count.room_id,
        "version": uint64(count.version),
        "users": count.users,
        "sessions": count.sessions,
    })
}

/// A change of the feed; of its `event` oneof, only the member set is present.
pub(crate) fn change_event(event: &pb::ChangeEvent) -> Value {
    use pb::change_event::Event;
    let mut value = json!({ "cursor": bytes(&event.cursor), "at_ms": int64(event.at_ms), "slot": event.slot });
    let (name, member) = match &event.event {
        Some(Event::Flip(user)) => ("flip", user_presence(user)),
        Some(Event::Status(user)) => ("status", user_presence(user)),
        Some(Event::Availability(user)) => ("availability", user_presence(user)),
        Some(Event::RoomOccupancy(room)) => (
            "room_occupancy",
            json!({ "room_id": room.room_id, "occupied": room.occupied, "version": uint64(room.version) }),
        ),
        Some(Event::Gap(gap)) => {
            ("gap", json!({ "after_cursor": bytes(&gap.after_cursor), "reason": gap.reason, "lost": uint64(gap.lost) }))
        }
        Some(Event::Progress(_)) => ("progress", json!({})),
        None => return value,
    };
    value[name] = member;
    value
}

pub(crate) fn stats_response(stats: &pb::StatsResponse) -> Value {
    json!({
        "version": stats.version,
        "uptime_ms": uint64(stats.uptime_ms),
        "now_ms": int64(stats.now_ms),
        "sessions": uint64(stats.sessions),
        "online_users": uint64(stats.online_users),
        "users": uint64(stats.users),
        "rooms": uint64(stats.rooms),
        "room_memberships": uint64(stats.room_memberships),
        "viewers": uint64(stats.viewers),
        "room_watchers": uint64(stats.room_watchers),
        "room_count_streams": uint64(stats.room_count_streams),
        "relay_links": uint64(stats.relay_links),
        "relayed_users": uint64(stats.relayed_users),
        "relay_sessions": uint64(stats.relay_sessions),
        "renewals_total": uint64(stats.renewals_total),
        "renewals_shed_total": uint64(stats.renewals_shed_total),
        "registers_total": uint64(stats.registers_total),
        "unregisters_total": uint64(stats.unregisters_total),
        "expiries_total": uint64(stats.expiries_total),
        "expiry_lag": stats.expiry_lag.as_ref().map_or(Value::Null, histogram),
        "ttl": stats.ttl.as_ref().map_or(Value::Null, ttl_settings),
    })
}

fn histogram(histogram: &pb::Histogram) -> Value {
    json!({
        "bounds_seconds": histogram.bounds_seconds,
        "counts": histogram.counts.iter().copied().map(uint64).collect::<Vec<_>>(),
        "count": uint64(histogram.count),
        "sum_seconds": histogram.sum_seconds,
    })
}

fn ttl_settings(ttl: &pb::TtlSettings) -> Value {
    json!({
        "min_ttl_ms": ttl.min_ttl_ms,
        "max_ttl_ms": ttl.max_ttl_ms,
        "default_ttl_ms": ttl.default_ttl_ms,
        "suggested_heartbeat_ms": ttl.suggested_heartbeat_ms,
        "min_renew_interval_ms": ttl.min_renew_interval_ms,
        "offline_grace_ms": uint64(ttl.offline_grace_ms),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// O4: a version above 2^53 survives the trip through JSON exactly, and
    /// enums read by name.
    #[test]
    fn o4_large_versions_are_strings_and_states_are_names() {
        let user = pb::UserPresence {
            user_id: "u1".into(),
            state: pb::State::Online as i32,
            version: (1 << 60) + 1,
            ..Default::default()
        };
        let value = user_presence(&user);
        assert_eq!(value["version"], "1152921504606846977");
        assert_eq!(value["state"], "STATE_ONLINE");
        assert_eq!(value["status"], Value::Null);
        assert_eq!(enum_name(99, pb::State::as_str_name), json!(99));
    }

    /// P7: an export's settings are base64 as the proto3 JSON mapping says,
    /// and every field is present, empty or not.
    #[test]
    fn p7_an_export_has_every_field_and_its_settings_in_base64() {
        let exported = pb::ExportUserResponse {
            user_id: "u1".into(),
            settings: [("locale".to_owned(), b"fr".to_vec()), ("blob".to_owned(), vec![0, 255])].into(),
            visibility: pb::Visibility::Audience as i32,
            ..Default::default()
        };
        let value = export_user_response(&exported);
        assert_eq!(value["settings"], json!({ "blob": "AP8=", "locale": "ZnI=" }));
        assert_eq!(value["visibility"], "VISIBILITY_AUDIENCE");
        assert_eq!(value["presence"], Value::Null);
        let fields: Vec<&str> = value.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(fields.len(), 14, "{fields:?}");
    }
}
