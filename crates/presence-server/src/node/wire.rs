//! Every conversion between the client API's wire and the core: `presence.v1`
//! messages and the server's Leases frames in, core inputs out; core answers
//! in, messages out. (The change feed's frames, events and webhook JSON are
//! `feed/wire.rs`'s.)
//!
//! Nothing here touches the store or decides policy (who may see what is
//! `privacy.rs`'s, what a refusal's code is `error.rs`'s). A request is turned
//! into core values once, here, whichever way it came (a unary call or an item
//! of a `Leases` batch), so both paths answer alike. A Leases frame keeps its
//! ids in the received buffer; they are checked as UTF-8 here and borrowed,
//! never copied.

use std::time::Duration;

use bytes::{Bytes, BytesMut};
use presence_core::attention::{
    Activity, Attention, AttentionChange, DeviceKind, MAX_NOTIFY_USERS, NotifyDecision, NotifyPolicy, NotifyReason,
    Urgency,
};
use presence_core::{
    Availability, CompactString, Joined, Left, Presence, Registered, Registration, Renewal, Renewed, Revoked,
    RoomAccess, RoomMember, RoomRef, SessionView, Signalled, State, StoreConfig, StoreStats, UnregisterOutcome,
    Unregistered,
};
use presence_proto::lease_frames::{
    JoinFrame, LeaveFrame, MetadataEntryFrame, RegisterFrame, RenewFrame, SignalFrame, UnregisterFrame,
};
use presence_proto::prepared::WatchFrame;
use presence_proto::v1::{self as pb, lease_result, watch_event};
use prost::Message as _;
use prost::encoding::{WireType, encode_key, encode_varint, encoded_len_varint};
use tonic::Code;

use crate::error::ServiceError;
use crate::metrics::{LATENCY_BUCKETS, Totals};
use crate::node::privacy::{RelationChange, Released, Visibility};

/// Most users one Snapshot or Watch may name.
pub const MAX_USERS_PER_REQUEST: usize = 10_000;

/// The longest batch window a viewer may ask for: a second is already a visibly late dot.
pub(crate) const MAX_BATCH_WINDOW_MS: u32 = 1_000;

// ---------------------------------------------------------------------------
// Requests in.

/// A register request as the store takes it: ids borrowed from the request,
/// metadata sorted by key (a later entry for a key replaces an earlier one,
/// as in a decoded `map`), and the attention it reports (A1).
#[derive(Debug)]
pub(crate) struct RegisterInput<'a> {
    user_id: &'a str,
    session_id: &'a str,
    gateway_id: &'a str,
    ttl_ms: u32,
    metadata: Vec<(String, String)>,
    pub(crate) attention: AttentionChange<'a>,
}

impl RegisterInput<'_> {
    /// The core's view of it.
    pub(crate) fn registration(&self) -> Registration<'_> {
        Registration {
            user_id: self.user_id,
            session_id: self.session_id,
            gateway_id: self.gateway_id,
            ttl_ms: self.ttl_ms,
            metadata: &self.metadata,
        }
    }

    /// The user it registers.
    pub(crate) fn user_id(&self) -> &str {
        self.user_id
    }
}

/// A renewal as the store takes it, and the attention it reports (A1).
#[derive(Debug, Clone, Copy)]
pub(crate) struct RenewInput<'a> {
    pub(crate) renewal: Renewal<'a>,
    pub(crate) attention: AttentionChange<'a>,
}

/// An unregister request as the store takes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct UnregisterInput<'a> {
    pub(crate) user_id: &'a str,
    pub(crate) session_id: &'a str,
    pub(crate) generation: u64,
    pub(crate) linger_ms: u32,
}

/// A session's attention as a register or renewal reports it (A1): the
/// enums by number (an unknown one is refused, naming its field), the room
/// as text.
fn attention_change(
    attention: Option<i32>,
    device_kind: i32,
    focused_room_id: Option<&str>,
) -> Result<AttentionChange<'_>, ServiceError> {
    let attention = match attention.map(pb::Attention::try_from) {
        None | Some(Ok(pb::Attention::Unspecified)) => None,
        Some(Ok(pb::Attention::Active)) => Some(Attention::Active),
        Some(Ok(pb::Attention::Idle)) => Some(Attention::Idle),
        Some(Ok(pb::Attention::Background)) => Some(Attention::Background),
        Some(Err(_)) => {
            let given = attention.unwrap_or_default();
            return Err(ServiceError::invalid("attention", format!("{given} is not an Attention (1 to 3)")));
        }
    };
    let device = match pb::DeviceKind::try_from(device_kind) {
        Ok(pb::DeviceKind::DeviceUnspecified) => None,
        Ok(pb::DeviceKind::DeviceDesktop) => Some(DeviceKind::Desktop),
        Ok(pb::DeviceKind::DeviceMobile) => Some(DeviceKind::Mobile),
        Ok(pb::DeviceKind::DeviceWeb) => Some(DeviceKind::Web),
        Ok(pb::DeviceKind::DeviceOther) => Some(DeviceKind::Other),
        Err(_) => {
            return Err(ServiceError::invalid("device_kind", format!("{device_kind} is not a DeviceKind (1 to 4)")));
        }
    };
    // Checked here, before the register or renewal it rides on is applied.
    if let Some(room_id) = focused_room_id.filter(|room_id| !room_id.is_empty()) {
        presence_core::validate_id("focused_room_id", room_id)?;
    }
    Ok(AttentionChange { attention, device, focused_room_id })
}

pub(crate) fn register_request(request: &pb::RegisterRequest) -> Result<RegisterInput<'_>, ServiceError> {
    let mut metadata: Vec<(String, String)> =
        request.metadata.iter().map(|(key, value)| (key.clone(), value.clone())).collect();
    metadata.sort_unstable();
    Ok(RegisterInput {
        user_id: &request.user_id,
        session_id: &request.session_id,
        gateway_id: &request.gateway_id,
        ttl_ms: request.ttl_ms,
        metadata,
        attention: attention_change(request.attention, request.device_kind, request.focused_room_id.as_deref())?,
    })
}

/// A register item of a batch; text that is not UTF-8 refuses the item alone.
pub(crate) fn register_frame(frame: &RegisterFrame) -> Result<RegisterInput<'_>, ServiceError> {
    let metadata = metadata_frame(&frame.metadata)?;
    let focused_room_id = frame.focused_room_id.as_deref().map(|room| utf8("focused_room_id", room)).transpose()?;
    Ok(RegisterInput {
        user_id: utf8("user_id", &frame.user_id)?,
        session_id: utf8("session_id", &frame.session_id)?,
        gateway_id: utf8("gateway_id", &frame.gateway_id)?,
        ttl_ms: frame.ttl_ms,
        metadata,
        attention: attention_change(frame.attention, frame.device_kind, focused_room_id)?,
    })
}

pub(crate) fn renew_request(request: &pb::RenewRequest) -> Result<RenewInput<'_>, ServiceError> {
    Ok(RenewInput {
        renewal: Renewal {
            user_id: &request.user_id,
            session_id: &request.session_id,
            generation: request.generation,
            ttl_ms: request.ttl_ms,
        },
        attention: attention_change(request.attention, 0, request.focused_room_id.as_deref())?,
    })
}

/// A renewal item of a batch; bytes that are not UTF-8 refuse the item alone,
/// as the unary `Renew` refuses such a request.
pub(crate) fn renew_frame(frame: &RenewFrame) -> Result<RenewInput<'_>, ServiceError> {
    let focused_room_id = frame.focused_room_id.as_deref().map(|room| utf8("focused_room_id", room)).transpose()?;
    Ok(RenewInput {
        renewal: Renewal {
            user_id: utf8("user_id", &frame.user_id)?,
            session_id: utf8("session_id", &frame.session_id)?,
            generation: frame.generation,
            ttl_ms: frame.ttl_ms,
        },
        attention: attention_change(frame.attention, 0, focused_room_id)?,
    })
}

pub(crate) fn unregister_request(request: &pb::UnregisterRequest) -> UnregisterInput<'_> {
    UnregisterInput {
        user_id: &request.user_id,
        session_id: &request.session_id,
        generation: request.generation,
        linger_ms: request.linger_ms,
    }
}

pub(crate) fn unregister_frame(frame: &UnregisterFrame) -> Result<UnregisterInput<'_>, ServiceError> {
    Ok(UnregisterInput {
        user_id: utf8("user_id", &frame.user_id)?,
        session_id: utf8("session_id", &frame.session_id)?,
        generation: frame.generation,
        linger_ms: frame.linger_ms,
    })
}

/// A join as the store takes it: the session's room and its metadata there.
#[derive(Debug, Clone)]
pub(crate) struct JoinInput<'a> {
    pub(crate) room: RoomRef<'a>,
    pub(crate) metadata: Vec<(String, String)>,
}

/// A signal as the store takes it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SignalInput<'a> {
    pub(crate) room: RoomRef<'a>,
    pub(crate) kind: &'a str,
    pub(crate) ttl_ms: u32,
}

pub(crate) fn join_request(request: &pb::JoinRequest) -> JoinInput<'_> {
    let mut metadata: Vec<(String, String)> =
        request.metadata.iter().map(|(key, value)| (key.clone(), value.clone())).collect();
    metadata.sort_unstable();
    let room = room_ref(&request.user_id, &request.session_id, request.generation, &request.room_id);
    JoinInput { room, metadata }
}

/// A join item of a batch; text that is not UTF-8 refuses the item alone.
pub(crate) fn join_frame(frame: &JoinFrame) -> Result<JoinInput<'_>, ServiceError> {
    let metadata = metadata_frame(&frame.metadata)?;
    let room = room_frame(&frame.user_id, &frame.session_id, frame.generation, &frame.room_id)?;
    Ok(JoinInput { room, metadata })
}

pub(crate) fn leave_request(request: &pb::LeaveRequest) -> RoomRef<'_> {
    room_ref(&request.user_id, &request.session_id, request.generation, &request.room_id)
}

pub(crate) fn leave_frame(frame: &LeaveFrame) -> Result<RoomRef<'_>, ServiceError> {
    room_frame(&frame.user_id, &frame.session_id, frame.generation, &frame.room_id)
}

pub(crate) fn signal_request(request: &pb::SignalRequest) -> SignalInput<'_> {
    let room = room_ref(&request.user_id, &request.session_id, request.generation, &request.room_id);
    SignalInput { room, kind: &request.kind, ttl_ms: request.ttl_ms }
}

pub(crate) fn signal_frame(frame: &SignalFrame) -> Result<SignalInput<'_>, ServiceError> {
    let room = room_frame(&frame.user_id, &frame.session_id, frame.generation, &frame.room_id)?;
    Ok(SignalInput { room, kind: utf8("kind", &frame.kind)?, ttl_ms: frame.ttl_ms })
}

/// Metadata entries as received: a later entry for a key replaces an earlier one.
fn metadata_frame(entries: &[MetadataEntryFrame]) -> Result<Vec<(String, String)>, ServiceError> {
    // A map, not a search per entry: the entry count is the client's, and
    // the core's limit on it is checked only after this.
    let mut unique: hashbrown::HashMap<&str, &str> = hashbrown::HashMap::with_capacity(entries.len());
    for entry in entries {
        unique.insert(utf8("metadata", &entry.key)?, utf8("metadata", &entry.value)?);
    }
    let mut metadata: Vec<(String, String)> =
        unique.into_iter().map(|(key, value)| (key.to_owned(), value.to_owned())).collect();
    metadata.sort_unstable();
    Ok(metadata)
}

/// A session's room, as Join, Leave and Signal name it.
fn room_ref<'a>(user_id: &'a str, session_id: &'a str, generation: u64, room_id: &'a str) -> RoomRef<'a> {
    RoomRef { user_id, session_id, generation, room_id }
}

/// [`room_ref`] of a Leases item: text that is not UTF-8 refuses the item alone.
fn room_frame<'a>(
    user_id: &'a [u8],
    session_id: &'a [u8],
    generation: u64,
    room_id: &'a [u8],
) -> Result<RoomRef<'a>, ServiceError> {
    let (user_id, session_id) = (utf8("user_id", user_id)?, utf8("session_id", session_id)?);
    Ok(room_ref(user_id, session_id, generation, utf8("room_id", room_id)?))
}

pub(crate) fn join_response(joined: &Joined) -> pb::JoinResponse {
    pb::JoinResponse { changed: joined.changed, room_version: joined.room_version }
}

pub(crate) fn leave_response(left: &Left) -> pb::LeaveResponse {
    pb::LeaveResponse { removed: left.removed, changed: left.changed, room_version: left.room_version }
}

pub(crate) fn signal_response(signalled: &Signalled) -> pb::SignalResponse {
    pb::SignalResponse { changed: signalled.changed, room_version: signalled.room_version }
}

/// A member as shown on the wire.
pub(crate) fn room_member(member: &RoomMember) -> pb::RoomMember {
    pb::RoomMember {
        user_id: member.user_id.to_string(),
        metadata: member.metadata.iter().cloned().collect(),
        sessions: member.sessions,
    }
}

/// A WatchRoom's mode: `None` for member mode, the count interval for count mode (R3, R6).
pub(crate) fn room_watch_mode(mode: i32, count_interval_ms: u32) -> Result<Option<Duration>, ServiceError> {
    match pb::RoomWatchMode::try_from(mode) {
        Ok(pb::RoomWatchMode::RoomWatchUnspecified | pb::RoomWatchMode::RoomWatchMembers) => Ok(None),
        Ok(pb::RoomWatchMode::RoomWatchCount) => count_interval(count_interval_ms).map(Some),
        Err(_) => Err(ServiceError::invalid(
            "mode",
            format!("{mode} is not a room watch mode (ROOM_WATCH_MEMBERS = 1 or ROOM_WATCH_COUNT = 2)"),
        )),
    }
}

/// The least time between two count messages (R3, R7): 100 to 60000 ms, 0 meaning 1000.
pub(crate) fn count_interval(count_interval_ms: u32) -> Result<Duration, ServiceError> {
    match count_interval_ms {
        0 => Ok(Duration::from_millis(1_000)),
        100..=60_000 => Ok(Duration::from_millis(u64::from(count_interval_ms))),
        other => Err(ServiceError::invalid("count_interval_ms", format!("{other} is outside 100 to 60000 (0 = 1000)"))),
    }
}

/// The rooms a RoomCounts or WatchRoomCounts asks for (R7): 1 to
/// [`room_counts::MAX_ROOMS`](crate::node::room_counts::MAX_ROOMS), each a valid id.
pub(crate) fn counted_room_ids(ids: &[String]) -> Result<Vec<CompactString>, ServiceError> {
    let cap = crate::node::room_counts::MAX_ROOMS;
    match ids.len() {
        0 => Err(ServiceError::invalid("room_ids", format!("names no room: give 1 to {cap}"))),
        asked if asked > cap => Err(ServiceError::invalid(
            "room_ids",
            format!(
                "{asked} rooms, more than the limit of {cap} per request (split them over more requests or streams)"
            ),
        )),
        _ => user_ids("room_ids", ids),
    }
}

/// The wire form of a room's access setting.
pub(crate) fn room_access(access: i32) -> Result<RoomAccess, ServiceError> {
    match pb::RoomAccess::try_from(access) {
        Ok(pb::RoomAccess::Members) => Ok(RoomAccess::Members),
        Ok(pb::RoomAccess::Public) => Ok(RoomAccess::Public),
        _ => Err(ServiceError::invalid(
            "access",
            format!("{access} is not a room access (ROOM_ACCESS_MEMBERS = 1 or ROOM_ACCESS_PUBLIC = 2)"),
        )),
    }
}

fn utf8<'a>(field: &'static str, bytes: &'a [u8]) -> Result<&'a str, ServiceError> {
    std::str::from_utf8(bytes)
        .map_err(|_| ServiceError::invalid(field, "invalid string value: data is not UTF-8 encoded"))
}

/// One id field, checked by the core's one id rule.
pub(crate) fn id(field: &'static str, value: &str) -> Result<CompactString, ServiceError> {
    presence_core::validate_id(field, value)?;
    Ok(CompactString::from(value))
}

/// A list of ids: at most [`MAX_USERS_PER_REQUEST`], each a valid id; a
/// refusal names the list and the entry (`user_ids: entry 3 must not be empty`).
pub(crate) fn user_ids(field: &'static str, ids: &[String]) -> Result<Vec<CompactString>, ServiceError> {
    if ids.len() > MAX_USERS_PER_REQUEST {
        return Err(ServiceError::invalid(
            field,
            format!("{} ids, more than the limit of {MAX_USERS_PER_REQUEST} per request", ids.len()),
        ));
    }
    ids.iter()
        .enumerate()
        .map(|(index, value)| {
            presence_core::validate_id(field, value).map_err(|err| match ServiceError::from(err) {
                ServiceError::InvalidArgument { reason, .. } => {
                    ServiceError::invalid(field, format!("entry {index} {reason}"))
                }
                other => other,
            })?;
            Ok(CompactString::from(value.as_str()))
        })
        .collect()
}

/// `WatchRequest.known_versions` (E8): at most [`MAX_USERS_PER_REQUEST`]
/// entries, each keyed by a valid id.
pub(crate) fn known_versions(
    known: &std::collections::HashMap<String, u64>,
) -> Result<hashbrown::HashMap<CompactString, u64>, ServiceError> {
    const FIELD: &str = "known_versions";
    if known.len() > MAX_USERS_PER_REQUEST {
        return Err(ServiceError::invalid(
            FIELD,
            format!("{} entries, more than the limit of {MAX_USERS_PER_REQUEST} per request", known.len()),
        ));
    }
    known
        .iter()
        .map(|(user_id, version)| {
            presence_core::validate_id(FIELD, user_id).map_err(|err| match ServiceError::from(err) {
                ServiceError::InvalidArgument { reason, .. } => ServiceError::invalid(FIELD, format!("key {reason}")),
                other => other,
            })?;
            Ok((CompactString::from(user_id.as_str()), *version))
        })
        .collect()
}

/// A list of ids a change applies to: like [`user_ids`], and not empty.
pub(crate) fn nonempty_ids(field: &'static str, ids: &[String]) -> Result<Vec<CompactString>, ServiceError> {
    if ids.is_empty() {
        return Err(ServiceError::invalid(field, "must name at least one id"));
    }
    user_ids(field, ids)
}

/// The batch window a Watch request asks for (`None`: one event per change).
pub(crate) fn batch_window(batch_window_ms: u32) -> Result<Option<Duration>, ServiceError> {
    match batch_window_ms {
        0 => Ok(None),
        ms if ms <= MAX_BATCH_WINDOW_MS => Ok(Some(Duration::from_millis(u64::from(ms)))),
        ms => Err(ServiceError::invalid(
            "batch_window_ms",
            format!("{ms} is longer than the limit of {MAX_BATCH_WINDOW_MS} ms"),
        )),
    }
}

/// A visibility from the wire.
pub(crate) fn visibility(code: i32) -> Result<Visibility, ServiceError> {
    match pb::Visibility::try_from(code) {
        Ok(pb::Visibility::Everyone) => Ok(Visibility::Everyone),
        Ok(pb::Visibility::Audience) => Ok(Visibility::Audience),
        Ok(pb::Visibility::Nobody) => Ok(Visibility::Nobody),
        Ok(pb::Visibility::Unspecified) | Err(_) => Err(ServiceError::invalid(
            "visibility",
            "must be VISIBILITY_EVERYONE, VISIBILITY_AUDIENCE or VISIBILITY_NOBODY",
        )),
    }
}

/// The changes a SetVisibility asks for (P2, A2): its visibility, whether it
/// shares its availability, or both; at least one of them.
pub(crate) fn visibility_changes(
    user: CompactString,
    request: &pb::SetVisibilityRequest,
) -> Result<Vec<RelationChange>, ServiceError> {
    let mut changes = Vec::new();
    if request.visibility != pb::Visibility::Unspecified as i32 || request.share_activity.is_none() {
        changes.push(RelationChange::Visibility { user: user.clone(), visibility: visibility(request.visibility)? });
    }
    if let Some(shares) = request.share_activity {
        changes.push(RelationChange::ShareActivity { user, shares });
    }
    Ok(changes)
}

/// A visibility on the wire.
pub(crate) fn visibility_message(visibility: Visibility) -> pb::Visibility {
    match visibility {
        Visibility::Everyone => pb::Visibility::Everyone,
        Visibility::Audience => pb::Visibility::Audience,
        Visibility::Nobody => pb::Visibility::Nobody,
    }
}

/// A status from the wire, as of `now`: a known availability, a valid text and
/// an expiry in the future (or 0: never).
pub(crate) fn status(status: pb::Status, now: u64) -> Result<presence_core::Status, ServiceError> {
    let availability = match pb::Availability::try_from(status.availability) {
        Ok(pb::Availability::Available) => Availability::Available,
        Ok(pb::Availability::Away) => Availability::Away,
        Ok(pb::Availability::DoNotDisturb) => Availability::DoNotDisturb,
        Ok(pb::Availability::Active) => {
            return Err(ServiceError::invalid(
                "status.availability",
                "AVAILABILITY_ACTIVE is derived from the sessions' attention (A2), never chosen: use \
                 AVAILABILITY_AVAILABLE, AVAILABILITY_AWAY or AVAILABILITY_DO_NOT_DISTURB",
            ));
        }
        Ok(pb::Availability::Unspecified) | Err(_) => {
            return Err(ServiceError::invalid(
                "status.availability",
                "must be AVAILABILITY_AVAILABLE, AVAILABILITY_AWAY or AVAILABILITY_DO_NOT_DISTURB",
            ));
        }
    };
    presence_core::validate_status_text(&status.text).map_err(|err| match ServiceError::from(err) {
        ServiceError::InvalidArgument { field, reason } => ServiceError::invalid(format!("status.{field}"), reason),
        other => other,
    })?;
    let expires_at = match u64::try_from(status.expires_at_ms) {
        Ok(0) => None,
        Ok(at) if at > now => Some(at),
        _ => return Err(ServiceError::invalid("status.expires_at_ms", "must be in the future (or 0: never)")),
    };
    Ok(presence_core::Status { availability, text: status.text, expires_at })
}

/// The longest hand-off delay a NotifyTargets call may ask for: an hour.
pub(crate) const MAX_HANDOFF_MS: u32 = 3_600_000;

/// A NotifyTargets request as the store takes it (A3, A4): `handoff_ms`
/// 0 takes the server's `default_policy`.
pub(crate) struct NotifyTargetsInput<'a> {
    pub(crate) user_ids: Vec<CompactString>,
    pub(crate) room_id: Option<&'a str>,
    pub(crate) urgency: Urgency,
    pub(crate) policy: NotifyPolicy,
}

pub(crate) fn notify_targets_request<'a>(
    request: &'a pb::NotifyTargetsRequest,
    default_policy: &NotifyPolicy,
) -> Result<NotifyTargetsInput<'a>, ServiceError> {
    let user_ids = user_ids("user_ids", &request.user_ids)?;
    if user_ids.is_empty() {
        return Err(ServiceError::invalid("user_ids", "name at least one user"));
    }
    // Checked here, whole: the call is answered a few users at a time (A4).
    if user_ids.len() > MAX_NOTIFY_USERS {
        let reason = format!("at most {MAX_NOTIFY_USERS} users per call, not {}", user_ids.len());
        return Err(ServiceError::invalid("user_ids", reason));
    }
    let room_id = (!request.room_id.is_empty()).then_some(request.room_id.as_str());
    let urgency = match pb::Urgency::try_from(request.urgency) {
        Ok(pb::Urgency::Normal) => Urgency::Normal,
        Ok(pb::Urgency::Urgent) => Urgency::Urgent,
        Err(_) => {
            return Err(ServiceError::invalid("urgency", format!("{} is not an Urgency (0 or 1)", request.urgency)));
        }
    };
    if request.handoff_ms > MAX_HANDOFF_MS {
        let reason = format!("{} is above the longest hand-off, {MAX_HANDOFF_MS} ms", request.handoff_ms);
        return Err(ServiceError::invalid("handoff_ms", reason));
    }
    let policy = match request.handoff_ms {
        0 => *default_policy,
        handoff_ms => NotifyPolicy { handoff_ms: u64::from(handoff_ms) },
    };
    Ok(NotifyTargetsInput { user_ids, room_id, urgency, policy })
}

// ---------------------------------------------------------------------------
// Answers out.

/// One user's answer to NotifyTargets (A3).
pub(crate) fn notify_target(user_id: &str, decision: NotifyDecision<CompactString>) -> pb::NotifyTarget {
    let reason = match decision.reason {
        NotifyReason::RoomOpen => pb::NotifyReason::RoomOpen,
        NotifyReason::AttendedElsewhere => pb::NotifyReason::AttendedElsewhere,
        NotifyReason::NoAttendedSession => pb::NotifyReason::NoAttendedSession,
        NotifyReason::UnknownFailOpen => pb::NotifyReason::UnknownFailOpen,
        NotifyReason::Offline => pb::NotifyReason::Offline,
        NotifyReason::Urgent => pb::NotifyReason::Urgent,
    };
    pb::NotifyTarget {
        user_id: user_id.to_owned(),
        in_app_session_ids: decision.in_app.into_iter().map(String::from).collect(),
        push_now: decision.push_now,
        push_after_ms: decision.push_after_ms,
        reason: reason as i32,
    }
}

/// A store tick as the API's `int64` Unix milliseconds.
pub(crate) fn unix_ms(tick: u64) -> i64 {
    i64::try_from(tick).unwrap_or(i64::MAX)
}

/// A user's presence with nothing else: state and version.
pub(crate) fn presence(user_id: &str, presence: Presence) -> pb::UserPresence {
    pb::UserPresence {
        user_id: user_id.to_owned(),
        state: match presence.state {
            State::Online => pb::State::Online,
            State::Offline => pb::State::Offline,
        } as i32,
        version: presence.version,
        availability: presence.activity.map_or(pb::Availability::Unspecified, activity_message) as i32,
        ..pb::UserPresence::default()
    }
}

/// A derived availability (A2) on the wire.
fn activity_message(activity: Activity) -> pb::Availability {
    match activity {
        Activity::Active => pb::Availability::Active,
        Activity::Away => pb::Availability::Away,
    }
}

/// A derived availability (A2) from the wire, as a node relays it (`field`
/// names it in a refusal): ACTIVE, AWAY or none.
pub(crate) fn activity(availability: i32, field: &'static str) -> Result<Option<Activity>, ServiceError> {
    match pb::Availability::try_from(availability) {
        Ok(pb::Availability::Unspecified) => Ok(None),
        Ok(pb::Availability::Active) => Ok(Some(Activity::Active)),
        Ok(pb::Availability::Away) => Ok(Some(Activity::Away)),
        _ => Err(ServiceError::invalid(field, "a derived availability is ACTIVE, AWAY or unset")),
    }
}

/// A user as released to one caller (see [`Released`]): a hidden user is
/// exactly a user never seen (P3).
pub(crate) fn released(user_id: &str, released: &Released) -> pb::UserPresence {
    let Some(view) = &released.view else { return presence(user_id, Presence::UNKNOWN) };
    let mut wire = presence(user_id, view.presence);
    wire.status = view.status.as_deref().map(status_message);
    wire.last_active_at_ms = released.last_active_at.map_or(0, unix_ms);
    wire.last_seen_ms = released.last_seen.map_or(0, unix_ms);
    wire
}

/// A status on the wire.
pub(crate) fn status_message(status: &presence_core::Status) -> pb::Status {
    pb::Status {
        availability: match status.availability {
            Availability::Available => pb::Availability::Available,
            Availability::Away => pb::Availability::Away,
            Availability::DoNotDisturb => pb::Availability::DoNotDisturb,
        } as i32,
        text: status.text.clone(),
        expires_at_ms: status.expires_at.map_or(0, unix_ms),
    }
}

pub(crate) fn register_response(user_id: &str, registered: &Registered) -> pb::RegisterResponse {
    pb::RegisterResponse {
        generation: registered.generation,
        changed: registered.changed,
        presence: Some(presence(user_id, registered.presence)),
        expires_at_ms: unix_ms(registered.expires_at),
    }
}

pub(crate) fn renew_response(renewed: &Renewed) -> pb::RenewResponse {
    pb::RenewResponse { expires_at_ms: unix_ms(renewed.expires_at), throttled: renewed.throttled }
}

pub(crate) fn unregister_response(user_id: &str, unregistered: &Unregistered) -> pb::UnregisterResponse {
    let (removed, outcome) = match unregistered.outcome {
        UnregisterOutcome::Removed => (true, pb::UnregisterOutcome::Removed),
        UnregisterOutcome::Lingering { .. } => (true, pb::UnregisterOutcome::Lingering),
        UnregisterOutcome::StaleGeneration { .. } => (false, pb::UnregisterOutcome::StaleGeneration),
        UnregisterOutcome::NotFound => (false, pb::UnregisterOutcome::NotFound),
    };
    pb::UnregisterResponse {
        removed,
        changed: unregistered.changed,
        presence: Some(presence(user_id, unregistered.presence)),
        outcome: outcome as i32,
    }
}

pub(crate) fn revoke_response(user_id: &str, revoked: &Revoked) -> pb::RevokeResponse {
    pb::RevokeResponse {
        revoked: revoked.count,
        changed: revoked.changed,
        presence: Some(presence(user_id, revoked.presence)),
    }
}

/// A user's sessions as an operator lists them, as of store time `now`.
pub(crate) fn list_sessions_response(sessions: &[SessionView], now: u64) -> pb::ListSessionsResponse {
    let sessions = sessions
        .iter()
        .map(|session| {
            let lease = &session.lease;
            pb::SessionInfo {
                gateway_id: lease.gateway_id.to_string(),
                session_id: lease.session_id.to_string(),
                generation: lease.generation,
                expires_at_ms: unix_ms(lease.expires_at),
                metadata: lease.metadata.iter().cloned().collect(),
                rooms: session.rooms.iter().map(ToString::to_string).collect(),
                last_renewed_at_ms: unix_ms(lease.last_heartbeat_at),
                lingering: lease.closing,
            }
        })
        .collect();
    pb::ListSessionsResponse { sessions, now_ms: unix_ms(now) }
}

/// What `Stats` reads, from wherever each figure is kept.
#[derive(Debug)]
pub(crate) struct StatsReading<'a> {
    pub(crate) store: StoreStats,
    pub(crate) config: &'a StoreConfig,
    pub(crate) totals: Totals,
    pub(crate) uptime: Duration,
    pub(crate) now: u64,
}

/// The service's figures on the wire.
pub(crate) fn stats_response(reading: StatsReading<'_>) -> pb::StatsResponse {
    let StatsReading { store, config, totals, uptime, now } = reading;
    let count = |n: usize| n as u64;
    let lag = totals.expiry_lag;
    pb::StatsResponse {
        version: env!("CARGO_PKG_VERSION").to_owned(),
        uptime_ms: u64::try_from(uptime.as_millis()).unwrap_or(u64::MAX),
        now_ms: unix_ms(now),
        sessions: count(store.sessions),
        online_users: count(store.online_users),
        users: count(store.users),
        rooms: count(store.rooms),
        room_memberships: count(store.room_memberships),
        viewers: totals.viewers,
        room_watchers: totals.room_watchers,
        room_count_streams: totals.room_count_streams,
        relay_links: totals.relay_links,
        relayed_users: totals.relayed_users,
        relay_sessions: totals.relay_sessions,
        renewals_total: totals.renewals,
        renewals_shed_total: totals.renewals_shed,
        registers_total: totals.registers,
        unregisters_total: totals.unregisters,
        expiries_total: totals.expiries,
        expiry_lag: Some(pb::Histogram {
            bounds_seconds: LATENCY_BUCKETS.to_vec(),
            count: lag.counts.iter().sum(),
            counts: lag.counts,
            sum_seconds: lag.sum_ms as f64 / 1_000.0,
        }),
        ttl: Some(pb::TtlSettings {
            min_ttl_ms: config.min_ttl_ms,
            max_ttl_ms: config.max_ttl_ms,
            default_ttl_ms: config.default_ttl_ms,
            // Two lost beats tolerated (L5): the TTL covers three intervals.
            suggested_heartbeat_ms: config.default_ttl_ms / 3,
            min_renew_interval_ms: config.min_renew_interval_ms,
            offline_grace_ms: config.offline_grace_ms,
        }),
    }
}

/// One item's result in a `LeaseResults` batch.
pub(crate) fn lease_result<T>(
    result: Result<T, ServiceError>,
    wrap: impl FnOnce(T) -> lease_result::Result,
) -> pb::LeaseResult {
    match result {
        Ok(response) => pb::LeaseResult {
            code: Code::Ok as u32,
            message: String::new(),
            result: Some(wrap(response)),
            not_owner: None,
        },
        Err(err) => lease_refused(&err),
    }
}

/// A refused item: the code and message a unary call would have answered.
pub(crate) fn lease_refused(err: &ServiceError) -> pb::LeaseResult {
    pb::LeaseResult { code: err.code() as u32, message: err.to_string(), result: None, not_owner: err.not_owner() }
}

/// The opening snapshot of a Watch, or a resync.
pub(crate) fn snapshot_event(users: Vec<pb::UserPresence>, partial: bool) -> pb::WatchEvent {
    pb::WatchEvent {
        event: Some(watch_event::Event::Snapshot(pb::Snapshot { users, partial, watch_id: String::new() })),
    }
}

/// Names the stream in a snapshot event, for `UpdateWatch`.
pub(crate) fn set_watch_id(event: &mut pb::WatchEvent, watch_id: &str) {
    if let Some(watch_event::Event::Snapshot(snapshot)) = &mut event.event {
        snapshot.watch_id = watch_id.to_owned();
    }
}

/// A snapshot event of users just added to a watch, as the `added` event.
pub(crate) fn added_event(snapshot: pb::WatchEvent) -> pb::WatchEvent {
    match snapshot.event {
        Some(watch_event::Event::Snapshot(pb::Snapshot { users, .. })) => {
            pb::WatchEvent { event: Some(watch_event::Event::Added(pb::Snapshot { users, ..Default::default() })) }
        }
        other => pb::WatchEvent { event: other },
    }
}

/// The frames that carry `updates` (each an encoded [`update_event`]): one
/// each, or all in one `updates` batch.
pub(crate) fn update_frames(updates: Vec<Bytes>, batched: bool) -> Vec<WatchFrame> {
    if !batched {
        return updates.into_iter().map(WatchFrame::Encoded).collect();
    }
    if updates.is_empty() {
        return Vec::new();
    }
    // `WatchEvent{updates: UpdateBatch{users}}`: each user is the body of its
    // encoded `update` event, which differs only in the field number before it.
    let users: Vec<Bytes> = updates.iter().map(update_body).collect();
    let batch_len: usize = users.iter().map(|user| 1 + encoded_len_varint(user.len() as u64) + user.len()).sum();
    let mut frame = BytesMut::with_capacity(1 + encoded_len_varint(batch_len as u64) + batch_len);
    encode_key(WATCH_EVENT_UPDATES, WireType::LengthDelimited, &mut frame);
    encode_varint(batch_len as u64, &mut frame);
    for user in users {
        encode_key(UPDATE_BATCH_USERS, WireType::LengthDelimited, &mut frame);
        encode_varint(user.len() as u64, &mut frame);
        frame.extend_from_slice(&user);
    }
    vec![WatchFrame::Encoded(frame.freeze())]
}

/// Field numbers of the Watch messages encoded by hand here (presence.proto).
const WATCH_EVENT_UPDATE: u32 = 2;
const WATCH_EVENT_UPDATES: u32 = 3;
const UPDATE_BATCH_USERS: u32 = 1;

/// `WatchEvent{update: user}` encoded: what one change sends (E5), encoded
/// once for every viewer sent it.
pub(crate) fn update_event(user: &pb::UserPresence) -> Bytes {
    let len = user.encoded_len();
    let mut event = BytesMut::with_capacity(1 + encoded_len_varint(len as u64) + len);
    encode_key(WATCH_EVENT_UPDATE, WireType::LengthDelimited, &mut event);
    encode_varint(len as u64, &mut event);
    user.encode_raw(&mut event);
    event.freeze()
}

/// The encoded `UserPresence` inside an [`update_event`], without copying it.
fn update_body(event: &Bytes) -> Bytes {
    let mut rest = &event[1..];
    let len = prost::encoding::decode_varint(&mut rest).expect("made by update_event") as usize;
    event.slice(event.len() - len..)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use presence_proto::lease_frames::MetadataEntryFrame;

    #[test]
    fn e5_encoded_updates_decode_as_the_events_they_stand_for_alone_and_batched() {
        let users: Vec<pb::UserPresence> = (0..3)
            .map(|i| pb::UserPresence { user_id: format!("user-{i}"), version: 300 + i, ..Default::default() })
            .collect();
        let encoded: Vec<Bytes> = users.iter().map(update_event).collect();
        let decode = |frame: &WatchFrame| pb::WatchEvent::decode(frame.encode_to_vec().as_slice()).unwrap();
        let alone: Vec<pb::WatchEvent> = update_frames(encoded.clone(), false).iter().map(decode).collect();
        let expected: Vec<pb::WatchEvent> =
            users.iter().map(|user| pb::WatchEvent { event: Some(watch_event::Event::Update(user.clone())) }).collect();
        assert_eq!(alone, expected);
        let batched: Vec<pb::WatchEvent> = update_frames(encoded, true).iter().map(decode).collect();
        let batch = pb::WatchEvent { event: Some(watch_event::Event::Updates(pb::UpdateBatch { users })) };
        assert_eq!(batched, [batch]);
        assert!(update_frames(Vec::new(), true).is_empty());
    }

    /// The field a refusal names; any other answer fails the test.
    pub(crate) fn field_of<T: std::fmt::Debug>(result: Result<T, ServiceError>) -> String {
        match result {
            Err(ServiceError::InvalidArgument { field, .. }) => field.into_owned(),
            other => panic!("expected a refused field, got {other:?}"),
        }
    }

    #[test]
    fn b1_a_frame_and_a_request_give_the_same_registration() {
        let request = pb::RegisterRequest {
            user_id: "u".into(),
            session_id: "s".into(),
            gateway_id: "gw".into(),
            ttl_ms: 1_000,
            metadata: [("b".to_string(), "2".to_string()), ("a".to_string(), "1".to_string())].into(),
            ..pb::RegisterRequest::default()
        };
        let entry =
            |key: &str, value: &str| MetadataEntryFrame { key: key.to_owned().into(), value: value.to_owned().into() };
        let frame = RegisterFrame {
            user_id: "u".into(),
            session_id: "s".into(),
            gateway_id: "gw".into(),
            ttl_ms: 1_000,
            // A later entry for a key replaces an earlier one, as a decoded map does.
            metadata: vec![entry("b", "0"), entry("a", "1"), entry("b", "2")],
            ..RegisterFrame::default()
        };
        let from_request = register_request(&request).unwrap();
        let from_frame = register_frame(&frame).unwrap();
        assert_eq!(format!("{:?}", from_request.registration()), format!("{:?}", from_frame.registration()));
        assert_eq!(from_frame.metadata, [("a".into(), "1".into()), ("b".into(), "2".into())]);
    }

    #[test]
    fn b1_text_that_is_not_utf8_names_its_field() {
        let renewal =
            RenewFrame { user_id: vec![0xff].into(), session_id: "s".into(), generation: 1, ..RenewFrame::default() };
        assert_eq!(field_of(renew_frame(&renewal)), "user_id");
        let unregister =
            UnregisterFrame { user_id: "u".into(), session_id: vec![0xc3].into(), generation: 1, linger_ms: 0 };
        assert_eq!(field_of(unregister_frame(&unregister)), "session_id");
        let register = RegisterFrame { gateway_id: vec![0xfe].into(), ..RegisterFrame::default() };
        assert_eq!(field_of(register_frame(&register)), "gateway_id");
    }

    #[test]
    fn b1_id_lists_name_the_entry_at_fault() {
        let refused = user_ids("viewer_ids", &["a".into(), String::new()]).unwrap_err();
        assert_eq!(refused.to_string(), "viewer_ids: entry 1 must not be empty");
        let long = "x".repeat(presence_core::MAX_ID_BYTES + 1);
        assert_eq!(field_of(user_ids("user_ids", &[long])), "user_ids");
        assert_eq!(field_of(user_ids("user_ids", &vec!["u".to_string(); MAX_USERS_PER_REQUEST + 1])), "user_ids");
        assert_eq!(field_of(nonempty_ids("viewer_ids", &[])), "viewer_ids");
        assert_eq!(user_ids("user_ids", &[]).unwrap(), Vec::<CompactString>::new());
    }

    #[test]
    fn b1_statuses_and_visibilities_from_the_wire_are_checked() {
        let now = 1_000;
        let valid =
            pb::Status { availability: pb::Availability::Away as i32, text: "lunch".into(), expires_at_ms: 2_000 };
        let status = status(valid, now).unwrap();
        assert_eq!((status.availability, status.expires_at), (Availability::Away, Some(2_000)));
        let unspecified = pb::Status { availability: 0, ..pb::Status::default() };
        assert_eq!(field_of(super::status(unspecified, now)), "status.availability");
        let past = pb::Status { availability: 1, text: String::new(), expires_at_ms: 1_000 };
        assert_eq!(field_of(super::status(past, now)), "status.expires_at_ms");
        let negative = pb::Status { availability: 1, text: String::new(), expires_at_ms: -5 };
        assert_eq!(field_of(super::status(negative, now)), "status.expires_at_ms");
        let control = pb::Status { availability: 1, text: "a\nb".into(), expires_at_ms: 0 };
        assert_eq!(field_of(super::status(control, now)), "status.text");
        assert_eq!(visibility(pb::Visibility::Nobody as i32).unwrap(), Visibility::Nobody);
        assert_eq!(field_of(visibility(0)), "visibility");
        assert_eq!(field_of(visibility(99)), "visibility");
    }

    #[test]
    fn p3_a_hidden_user_is_released_exactly_as_a_user_never_seen() {
        let hidden = Released { view: None, last_seen: None, last_active_at: None };
        assert_eq!(released("u", &hidden), presence("u", Presence::UNKNOWN));
    }
}
