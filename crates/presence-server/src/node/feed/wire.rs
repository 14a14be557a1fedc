//! The change feed's wire formats: a feed entry into the frame the log
//! keeps, a frame into its `ChangeEvent`, a `Changes` request into what it
//! asks for (F1, F2), and a batch of events as a webhook's JSON body (F4).
//! A user's presence and status are put on the wire as the client API puts
//! them (`node/wire.rs`).

use presence_core::{CompactString, FeedEntry, FeedEvent};
use presence_feed::{Cursor as FeedCursor, Frame, FrameKind};
use presence_proto::v1::{self as pb, change_event};
use prost::Message;

use crate::error::ServiceError;
use crate::node::wire::{presence, status_message, unix_ms};

/// Appends to `out` the frame of a feed entry as the log keeps it: its slot
/// and kind beside the event as it goes on the wire (without its cursor,
/// which the position and slot make). The writer packs a batch's frames
/// into one buffer, with no allocation of their own.
pub(crate) fn append_feed_frame(out: &mut bytes::BytesMut, entry: &FeedEntry, slot: u32) {
    let (kind, event) = match &entry.event {
        FeedEvent::TakenOver { slot, at } => {
            let mut body = gap_event(&[], FeedCursor::START, GapReason::Takeover, 0, *at);
            body.slot = *slot;
            Frame::append_to(out, entry.position, *slot, FrameKind::Gap, *at, b"", |out| body.encode_raw(out));
            return;
        }
        FeedEvent::User(change) => {
            let mut user = presence(&change.user_id, change.presence);
            user.status = change.status.as_deref().map(status_message);
            match change.kind {
                presence_core::ChangeKind::Flip => (FrameKind::Flip, change_event::Event::Flip(user)),
                presence_core::ChangeKind::Status => (FrameKind::Status, change_event::Event::Status(user)),
                presence_core::ChangeKind::Activity => {
                    (FrameKind::Availability, change_event::Event::Availability(user))
                }
            }
        }
        FeedEvent::Room(room) => (
            FrameKind::RoomOccupancy,
            change_event::Event::RoomOccupancy(pb::RoomOccupancy {
                room_id: room.room_id.to_string(),
                occupied: room.occupied,
                version: room.version,
            }),
        ),
    };
    let at = entry.event.at();
    let body = pb::ChangeEvent { cursor: Vec::new(), event: Some(event), at_ms: unix_ms(at), slot };
    let id = entry.event.id().as_bytes();
    Frame::append_to(out, entry.position, slot, kind, at, id, |out| body.encode_raw(out));
}

/// Why the feed lost changes, as a gap says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum GapReason {
    /// The process that wrote the feed did not close it.
    Restart,
    /// The writer fell behind and the intake dropped changes.
    Overflow,
    /// Writing to disk failed.
    WriteFailed,
    /// Retention removed changes a webhook had not delivered yet (F4).
    Retention,
    /// A webhook's cursor was ahead of every change the feed holds: a data
    /// directory's feed replaced or removed (F4).
    UnknownCursor,
    /// A cluster node took a slot over from its copy of a node that is
    /// gone (F3): what that node recorded for the slot and could not hand
    /// on is lost. Its gap concerns that slot alone.
    Takeover,
}

/// A gap event: everything after `after` up to `cursor` was lost.
pub(crate) fn gap_event(cursor: &[u8], after: FeedCursor, reason: GapReason, lost: u64, at: u64) -> pb::ChangeEvent {
    let reason = match reason {
        GapReason::Restart => "restart",
        GapReason::Overflow => "overflow",
        GapReason::WriteFailed => "write failed",
        GapReason::Retention => "retention",
        GapReason::UnknownCursor => "unknown cursor",
        GapReason::Takeover => "takeover",
    };
    // A takeover cannot know what the gone node kept last of the slot: no cursor.
    let after_cursor = if reason == "takeover" { Vec::new() } else { after.encode().to_vec() };
    let gap = pb::Gap { after_cursor, reason: reason.to_owned(), lost };
    pb::ChangeEvent { cursor: cursor.to_vec(), event: Some(change_event::Event::Gap(gap)), at_ms: unix_ms(at), slot: 0 }
}

/// A gap at `position`: everything after `after` up to it was lost.
pub(crate) fn gap_frame(position: u64, after: FeedCursor, reason: GapReason, lost: u64, at: u64) -> Frame {
    let body = gap_event(&[], after, reason, lost, at);
    Frame::new(position, u32::MAX, FrameKind::Gap, at, b"", &body.encode_to_vec())
}

/// A frame as its event, with its cursor.
pub(crate) fn change_event(frame: &Frame) -> Result<pb::ChangeEvent, ServiceError> {
    let mut event = pb::ChangeEvent::decode(frame.body()).map_err(|err| {
        ServiceError::Internal(format!("a feed entry at {} does not decode: {err}", frame.position()))
    })?;
    event.cursor = frame.cursor().encode().to_vec();
    Ok(event)
}

/// A `progress` event: the stream's cursor moved without an event for it.
pub(crate) fn progress_event(cursor: FeedCursor) -> pb::ChangeEvent {
    pb::ChangeEvent {
        cursor: cursor.encode().to_vec(),
        event: Some(change_event::Event::Progress(pb::Progress {})),
        at_ms: 0,
        slot: 0,
    }
}

/// Where a Changes stream starts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ChangesFrom {
    /// After what was made before the call.
    Now,
    /// At the oldest retained.
    Oldest,
    /// After this cursor.
    Cursor(FeedCursor),
}

/// What a Changes stream carries (gaps and progress always).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ChangesFilter {
    /// Kinds asked for: flips, statuses, room occupancy, availability.
    pub(crate) kinds: [bool; 4],
    /// Only ids starting with this.
    pub(crate) id_prefix: CompactString,
    /// Only these slots (`None`: every one).
    pub(crate) slots: Option<presence_core::SlotSet>,
}

impl ChangesFilter {
    /// Whether the stream carries `frame`.
    pub(crate) fn carries(&self, frame: &Frame) -> bool {
        let kind = match frame.kind() {
            // A gap of one slot (a takeover) concerns only its slot's consumers.
            FrameKind::Gap => return frame.slot() == u32::MAX || self.carries_slot(frame.slot()),
            FrameKind::Flip => 0,
            FrameKind::Status => 1,
            FrameKind::RoomOccupancy => 2,
            FrameKind::Availability => 3,
        };
        self.kinds[kind] && frame.id().starts_with(self.id_prefix.as_bytes()) && self.carries_slot(frame.slot())
    }

    /// Whether the request asked for `slot` (every slot when it named none).
    fn carries_slot(&self, slot: u32) -> bool {
        self.slots.as_ref().is_none_or(|slots| slots.contains(slot))
    }
}

/// Where a Changes request starts, as its `from` and `cursor` fields (what
/// a cluster node asks of another node's part, F3).
pub(crate) fn changes_from_fields(from: ChangesFrom) -> (i32, Vec<u8>) {
    match from {
        ChangesFrom::Now => (pb::ChangesFrom::Now as i32, Vec::new()),
        ChangesFrom::Oldest => (pb::ChangesFrom::Oldest as i32, Vec::new()),
        ChangesFrom::Cursor(cursor) => (pb::ChangesFrom::Cursor as i32, cursor.encode().to_vec()),
    }
}

/// A Changes request, checked: where it starts and what it carries, in a
/// feed of `slot_count` slots.
pub(crate) fn changes_request(
    request: &pb::ChangesRequest,
    slot_count: u32,
) -> Result<(ChangesFrom, ChangesFilter), ServiceError> {
    let from = match pb::ChangesFrom::try_from(request.from) {
        Ok(pb::ChangesFrom::Now) => ChangesFrom::Now,
        Ok(pb::ChangesFrom::Oldest) => ChangesFrom::Oldest,
        Ok(pb::ChangesFrom::Unspecified) if request.cursor.is_empty() => ChangesFrom::Now,
        Ok(pb::ChangesFrom::Cursor | pb::ChangesFrom::Unspecified) => {
            if request.cursor.is_empty() {
                return Err(ServiceError::invalid("cursor", "CHANGES_FROM_CURSOR needs the cursor of an event"));
            }
            ChangesFrom::Cursor(
                FeedCursor::decode(&request.cursor).map_err(|err| ServiceError::invalid("cursor", err.to_string()))?,
            )
        }
        Err(_) => return Err(ServiceError::invalid("from", format!("{} is not a ChangesFrom", request.from))),
    };
    if !request.cursor.is_empty() && !matches!(from, ChangesFrom::Cursor(_)) {
        return Err(ServiceError::invalid("cursor", "a cursor is only read with CHANGES_FROM_CURSOR"));
    }
    let mut kinds = [request.kinds.is_empty(); 4];
    for &kind in &request.kinds {
        match pb::ChangeKind::try_from(kind) {
            Ok(pb::ChangeKind::Flip) => kinds[0] = true,
            Ok(pb::ChangeKind::Status) => kinds[1] = true,
            Ok(pb::ChangeKind::RoomOccupancy) => kinds[2] = true,
            Ok(pb::ChangeKind::Availability) => kinds[3] = true,
            _ => return Err(ServiceError::invalid("kinds", format!("{kind} is not a ChangeKind"))),
        }
    }
    if request.id_prefix.len() > presence_core::MAX_ID_BYTES {
        return Err(ServiceError::invalid(
            "id_prefix",
            format!("at most {} bytes, not {}", presence_core::MAX_ID_BYTES, request.id_prefix.len()),
        ));
    }
    let slots = if request.slots.is_empty() {
        None
    } else {
        if let Some(slot) = request.slots.iter().find(|&&slot| slot >= slot_count) {
            return Err(ServiceError::invalid(
                "slots",
                format!("slot {slot} is not below the feed's {slot_count} slots"),
            ));
        }
        Some(presence_core::SlotSet::of(slot_count, request.slots.iter().copied()))
    };
    Ok((from, ChangesFilter { kinds, id_prefix: request.id_prefix.as_str().into(), slots }))
}

// ---------------------------------------------------------------------------
// Webhooks (F4): a batch of the feed as the JSON body POSTed to a receiver.

/// One event of a webhook batch, as JSON: the proto3 JSON mapping of its
/// `ChangeEvent`, as every client reads it.
pub(crate) fn webhook_event(event: &pb::ChangeEvent) -> Vec<u8> {
    serde_json::to_vec(&presence_proto::json::change_event(event)).expect("a JSON value serialises")
}

/// A webhook batch's body: `{"cursor": ..., "events": [...]}`, the cursor
/// (the last event's, base64 as the events' own) first, then the events
/// made by [`webhook_event`].
pub(crate) fn webhook_body(cursor: FeedCursor, events: &[Vec<u8>]) -> Vec<u8> {
    let cursor = presence_proto::json::bytes(&cursor.encode());
    let mut body = Vec::with_capacity(64 + events.iter().map(|event| event.len() + 1).sum::<usize>());
    body.extend_from_slice(b"{\"cursor\":");
    body.extend_from_slice(cursor.to_string().as_bytes());
    body.extend_from_slice(b",\"events\":[");
    for (at, event) in events.iter().enumerate() {
        if at > 0 {
            body.push(b',');
        }
        body.extend_from_slice(event);
    }
    body.extend_from_slice(b"]}");
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f3_where_a_part_starts_reads_back_as_it_was_asked() {
        let cursor = FeedCursor { position: 77, slot: 3 };
        for from in [ChangesFrom::Now, ChangesFrom::Oldest, ChangesFrom::Cursor(cursor)] {
            let (from_field, cursor_field) = changes_from_fields(from);
            let request = pb::ChangesRequest { from: from_field, cursor: cursor_field, ..Default::default() };
            assert_eq!(changes_request(&request, 64).unwrap().0, from);
        }
    }

    #[test]
    fn f4_a_webhook_body_is_json_with_the_last_cursor_and_each_event_as_the_proto3_mapping_writes_it() {
        let cursor = FeedCursor { position: 7, slot: 3 };
        let event = pb::ChangeEvent {
            cursor: cursor.encode().to_vec(),
            event: Some(change_event::Event::RoomOccupancy(pb::RoomOccupancy {
                room_id: "r\"1".into(),
                occupied: true,
                version: 1 << 60,
            })),
            at_ms: 5,
            slot: 3,
        };
        let gap = gap_event(&cursor.encode(), FeedCursor::START, GapReason::Retention, 0, 6);
        let body = webhook_body(cursor, &[webhook_event(&event), webhook_event(&gap)]);
        let parsed: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(parsed["cursor"], "AQAAAAAAAAAHAAAAAw==");
        assert_eq!(parsed["events"][0]["room_occupancy"]["room_id"], "r\"1");
        assert_eq!(parsed["events"][0]["room_occupancy"]["version"], "1152921504606846976");
        assert_eq!(parsed["events"][1]["gap"]["reason"], "retention");
        assert_eq!(webhook_body(cursor, &[]), br#"{"cursor":"AQAAAAAAAAAHAAAAAw==","events":[]}"#);
    }
}
