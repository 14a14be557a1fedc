//! The conversions of the node-to-node protocol (`presence.v1.Cluster`):
//! what one node sends another of users' durable data, group ledger entries,
//! room facts and rooms' access, and the checks of what another node sent
//! (B1: a node's own stores made them, so anything out of bounds is damage,
//! refused whole, naming the field). The client API's conversions are
//! `node/wire.rs`'s; these use them for the parts the two share (ids, statuses).

use std::sync::Arc;

use presence_core::{
    CompactString, MemberMetadata, Presence, RoomAccess, RoomFact, RoomFactScan, StampedRoomFact, State, UserView,
};
use presence_proto::v1 as pb;

use crate::error::ServiceError;
use crate::node::groups::GroupEntry;
use crate::node::privacy::{HandedOver, SeenBy};
use crate::node::settings::{MAX_SETTING_NAME_BYTES, MAX_SETTING_VALUE_BYTES, MAX_SETTINGS_PER_USER};
use crate::node::wire::{id, presence, room_access, status, status_message, unix_ms, visibility, visibility_message};

/// A user's durable data as one node hands it to another (C3).
pub(crate) fn handed_over_message(user: &HandedOver) -> pb::HandedOverUser {
    pb::HandedOverUser {
        user_id: user.user_id.to_string(),
        status: user.status.as_ref().map(status_message),
        visibility: user.visibility.map_or(pb::Visibility::Unspecified, visibility_message) as i32,
        audience: user.audience.iter().map(ToString::to_string).collect(),
        last_active_at_ms: user.last_active_at,
        settings: user.settings.iter().cloned().collect(),
        hides_activity: !user.shares_activity,
    }
}

/// Users' durable data as one node hands it to another, in pieces of about
/// `piece_bytes` encoded (a user's settings may be a few KiB each), each
/// piece at least one user.
pub(crate) fn handed_over_pieces(users: &[HandedOver], piece_bytes: usize) -> Vec<Vec<pb::HandedOverUser>> {
    pieces(users.iter().map(handed_over_message), piece_bytes)
}

/// The feed entries a handover carries (F3), in pieces of about
/// `piece_bytes`, each entry a frame's bytes.
pub(crate) fn feed_entry_pieces(entries: &[presence_feed::Frame], piece_bytes: usize) -> Vec<Vec<Vec<u8>>> {
    pieces(entries.iter().map(|entry| entry.bytes().to_vec()), piece_bytes)
}

/// `messages` cut into pieces of about `piece_bytes` encoded (a message
/// larger than that is a piece of its own), in order.
fn pieces<M: prost::Message>(messages: impl IntoIterator<Item = M>, piece_bytes: usize) -> Vec<Vec<M>> {
    let mut pieces = Vec::new();
    let (mut piece, mut bytes) = (Vec::new(), 0);
    for message in messages {
        let size = message.encoded_len();
        if !piece.is_empty() && bytes + size > piece_bytes {
            pieces.push(std::mem::take(&mut piece));
            bytes = 0;
        }
        bytes += size;
        piece.push(message);
    }
    if !piece.is_empty() {
        pieces.push(piece);
    }
    pieces
}

/// A user's durable data as another node handed it over, as of `now`: a
/// status that ran out on the way is dropped.
pub(crate) fn handed_over(user: pb::HandedOverUser, now: u64) -> Result<HandedOver, ServiceError> {
    let user_id = id("durable.user_id", &user.user_id)?;
    let visibility = match user.visibility {
        0 => None,
        code => Some(visibility(code).map_err(|_| ServiceError::invalid("durable.visibility", "an unknown value"))?),
    };
    let running =
        |status: &pb::Status| status.expires_at_ms == 0 || u64::try_from(status.expires_at_ms).is_ok_and(|at| at > now);
    let status = match user.status.filter(running) {
        Some(wire) => Some(status(wire, now).map_err(|refused| match refused {
            ServiceError::InvalidArgument { field, reason } => {
                ServiceError::invalid(format!("durable.{field}"), reason)
            }
            other => other,
        })?),
        None => None,
    };
    let audience = user.audience.iter().map(|viewer| id("durable.audience", viewer)).collect::<Result<_, _>>()?;
    if user.settings.len() > MAX_SETTINGS_PER_USER {
        return Err(ServiceError::invalid(
            "durable.settings",
            format!("more than {MAX_SETTINGS_PER_USER} for one user"),
        ));
    }
    for (name, value) in &user.settings {
        if name.is_empty() || name.len() > MAX_SETTING_NAME_BYTES || value.len() > MAX_SETTING_VALUE_BYTES {
            return Err(ServiceError::invalid(
                "durable.settings",
                format!("names of 1 to {MAX_SETTING_NAME_BYTES} bytes, values of at most {MAX_SETTING_VALUE_BYTES}"),
            ));
        }
    }
    // A map on the wire; in name order here, as `Settings::get` answers.
    let settings: Vec<(String, Vec<u8>)> =
        user.settings.into_iter().collect::<std::collections::BTreeMap<_, _>>().into_iter().collect();
    Ok(HandedOver {
        user_id,
        status,
        visibility,
        audience,
        shares_activity: !user.hides_activity,
        last_active_at: user.last_active_at_ms,
        settings,
    })
}

/// The group ledger's entries as sent between nodes, in pieces of about `piece_bytes`.
pub(crate) fn group_entry_pieces(entries: &[GroupEntry], piece_bytes: usize) -> Vec<pb::GroupEntries> {
    let messages = entries.iter().map(|entry| pb::GroupEntry {
        group_id: entry.group.to_string(),
        user_id: entry.user.to_string(),
        stamp: entry.stamp,
        member: entry.member,
    });
    pieces(messages, piece_bytes).into_iter().map(|entries| pb::GroupEntries { entries }).collect()
}

/// Group ledger entries another node sent: ids checked as a request's are,
/// and no stamp beyond any a node issues.
pub(crate) fn group_entries(sent: pb::GroupEntries) -> Result<Vec<GroupEntry>, ServiceError> {
    sent.entries
        .into_iter()
        .map(|entry| {
            if entry.stamp > presence_core::stamp::MAX_STAMP {
                return Err(ServiceError::invalid(
                    "entries.stamp",
                    format!("{} is beyond any stamp a node issues", entry.stamp),
                ));
            }
            Ok(GroupEntry {
                group: id("entries.group_id", &entry.group_id)?,
                user: id("entries.user_id", &entry.user_id)?,
                stamp: entry.stamp,
                member: entry.member,
            })
        })
        .collect()
}

/// Room facts this node's users made, for their rooms' owner (C1, `room_sync.rs`).
pub(crate) fn room_facts_message(from_node: &str, facts: &[StampedRoomFact]) -> pb::RoomFacts {
    pb::RoomFacts {
        from_node: from_node.to_owned(),
        facts: facts.iter().map(room_fact_message).collect(),
        ..Default::default()
    }
}

/// A scan of where this node's users stand in the rooms of `slots` (see [`RoomFactScan`]).
pub(crate) fn room_scan_message(from_node: &str, scan: &RoomFactScan, slots: &presence_core::SlotSet) -> pb::RoomFacts {
    pb::RoomFacts {
        from_node: from_node.to_owned(),
        facts: scan.facts.iter().map(room_fact_message).collect(),
        scan: true,
        slots: slots.iter().collect(),
        slot_count: slots.slots(),
        shard_stamps: scan.shard_stamps.clone(),
        relations_changed: Vec::new(),
        access: Vec::new(),
        versions_of: Vec::new(),
        room_clock: 0,
    }
}

/// Rooms' access as their owners set it, for another node.
pub(crate) fn room_access_entries(entries: &[(CompactString, RoomAccess, u64)]) -> Vec<pb::RoomAccessEntry> {
    entries
        .iter()
        .map(|(room_id, access, stamp)| pb::RoomAccessEntry {
            room_id: room_id.to_string(),
            access: match access {
                RoomAccess::Members => pb::RoomAccess::Members,
                RoomAccess::Public => pb::RoomAccess::Public,
            }
            .into(),
            stamp: *stamp,
        })
        .collect()
}

/// Rooms' access another node sent, checked (B1).
pub(crate) fn room_access_entries_sent(
    sent: Vec<pb::RoomAccessEntry>,
) -> Result<Vec<(CompactString, RoomAccess, u64)>, ServiceError> {
    sent.into_iter()
        .map(|entry| {
            if entry.stamp > presence_core::stamp::MAX_STAMP {
                return Err(ServiceError::invalid(
                    "entries.stamp",
                    format!("{} is not a stamp a node issues", entry.stamp),
                ));
            }
            Ok((id("entries.room_id", &entry.room_id)?, room_access(entry.access)?, entry.stamp))
        })
        .collect()
}

/// One room fact as sent to its room's owner.
pub(crate) fn room_fact_message(StampedRoomFact { stamp, fact, invisible }: &StampedRoomFact) -> pb::RoomFact {
    let mut message = pb::RoomFact {
        room_id: fact.room_id().to_string(),
        user_id: fact.user_id().to_string(),
        stamp: *stamp,
        invisible: *invisible,
        ..Default::default()
    };
    match fact {
        RoomFact::Member { sessions, metadata, .. } => {
            message.kind = pb::RoomFactKind::RoomFactMember.into();
            message.sessions = *sessions;
            message.metadata = metadata
                .entries()
                .iter()
                .map(|(key, value)| pb::RoomFactMetadata { key: key.clone(), value: value.clone() })
                .collect();
        }
        RoomFact::Left { .. } => message.kind = pb::RoomFactKind::RoomFactLeft.into(),
        RoomFact::Signal { kind, on, .. } => {
            message.kind = pb::RoomFactKind::RoomFactSignal.into();
            message.signal_kind = kind.to_string();
            message.on = *on;
        }
    }
    message
}

/// The facts another node sent, checked (B1): a node's own stores made them,
/// so anything out of their bounds is damage, refused whole, naming the field.
pub(crate) fn room_facts(sent: Vec<pb::RoomFact>) -> Result<Vec<StampedRoomFact>, ServiceError> {
    sent.into_iter()
        .map(|fact| {
            let (stamp, invisible) = (fact.stamp, fact.invisible);
            if stamp == 0 || stamp > presence_core::stamp::MAX_STAMP {
                return Err(ServiceError::invalid(
                    "facts.stamp",
                    format!("{} is not a stamp a node issues", fact.stamp),
                ));
            }
            let (room_id, user_id) = (id("facts.room_id", &fact.room_id)?, id("facts.user_id", &fact.user_id)?);
            let fact = match pb::RoomFactKind::try_from(fact.kind) {
                Ok(pb::RoomFactKind::RoomFactMember) => {
                    if fact.sessions == 0 {
                        return Err(ServiceError::invalid("facts.sessions", "a member has at least one session"));
                    }
                    if fact.metadata.len() > presence_core::MAX_METADATA_ENTRIES
                        || fact.metadata.iter().any(|entry| {
                            entry.key.is_empty()
                                || entry.key.len() > presence_core::MAX_METADATA_KEY_BYTES
                                || entry.value.len() > presence_core::MAX_METADATA_VALUE_BYTES
                        })
                    {
                        return Err(ServiceError::invalid("facts.metadata", "beyond the limits of room metadata"));
                    }
                    let entries: Vec<(String, String)> =
                        fact.metadata.into_iter().map(|entry| (entry.key, entry.value)).collect();
                    RoomFact::Member {
                        room_id,
                        user_id,
                        sessions: fact.sessions,
                        metadata: MemberMetadata::new(&entries),
                    }
                }
                Ok(pb::RoomFactKind::RoomFactLeft) => RoomFact::Left { room_id, user_id },
                Ok(pb::RoomFactKind::RoomFactSignal) => {
                    if fact.signal_kind.is_empty() || fact.signal_kind.len() > presence_core::MAX_SIGNAL_KIND_BYTES {
                        return Err(ServiceError::invalid(
                            "facts.signal_kind",
                            format!("must be 1 to {} bytes", presence_core::MAX_SIGNAL_KIND_BYTES),
                        ));
                    }
                    RoomFact::Signal { room_id, user_id, kind: fact.signal_kind.into(), on: fact.on }
                }
                Err(_) => {
                    return Err(ServiceError::invalid("facts.kind", format!("{} is no kind of room fact", fact.kind)));
                }
            };
            Ok(StampedRoomFact { stamp, fact, invisible })
        })
        .collect()
}

/// The feed entries a handover carried (F3), each checked whole: one that
/// does not parse refuses the handover.
pub(crate) fn feed_entries(sent: Vec<Vec<u8>>) -> Result<Vec<presence_feed::Frame>, ServiceError> {
    sent.into_iter()
        .map(|bytes| {
            let bytes = bytes::Bytes::from(bytes);
            match presence_feed::Frame::parse(&bytes) {
                Ok((frame, size)) if size == bytes.len() => Ok(frame),
                Ok(_) => Err(ServiceError::invalid("feed_entries", "an entry with bytes after its frame")),
                Err(err) => {
                    Err(ServiceError::invalid("feed_entries", format!("an entry that is not a feed frame: {err}")))
                }
            }
        })
        .collect()
}

/// A relayed user as its owner sends it (see `cluster/relay.rs`): its view
/// as a service acting for no viewer reads it, its exact last activity
/// (store ms; 0: none known) and who its relations show it to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Relayed {
    pub(crate) user_id: CompactString,
    pub(crate) view: UserView,
    pub(crate) last_active_at: u64,
    pub(crate) seen_by: SeenBy,
}

pub(crate) fn relayed_message(user: &Relayed) -> pb::RelayedUser {
    let mut presence = presence(&user.user_id, user.view.presence);
    presence.status = user.view.status.as_deref().map(status_message);
    presence.last_active_at_ms = unix_ms(user.last_active_at);
    let seen_by = match user.seen_by {
        SeenBy::Everyone => pb::SeenBy::Everyone,
        SeenBy::Nobody => pb::SeenBy::Nobody,
        SeenBy::Audience => pb::SeenBy::Audience,
    };
    pb::RelayedUser { presence: Some(presence), seen_by: seen_by as i32 }
}

/// A relayed user as the relaying node takes it, as of `now`: a status
/// that ran out on the way is dropped.
pub(crate) fn relayed(user: pb::RelayedUser, now: u64) -> Result<Relayed, ServiceError> {
    let presence = user.presence.ok_or_else(|| ServiceError::invalid("relayed.presence", "missing"))?;
    let user_id = id("relayed.presence.user_id", &presence.user_id)?;
    let state = match pb::State::try_from(presence.state) {
        Ok(pb::State::Online) => State::Online,
        Ok(pb::State::Offline) => State::Offline,
        _ => return Err(ServiceError::invalid("relayed.presence.state", "must be ONLINE or OFFLINE")),
    };
    let activity = crate::node::wire::activity(presence.availability, "relayed.presence.availability")?;
    let seen_by = match pb::SeenBy::try_from(user.seen_by) {
        Ok(pb::SeenBy::Everyone) => SeenBy::Everyone,
        Ok(pb::SeenBy::Nobody) => SeenBy::Nobody,
        Ok(pb::SeenBy::Audience) => SeenBy::Audience,
        Err(_) => return Err(ServiceError::invalid("relayed.seen_by", "an unknown value")),
    };
    let running =
        |status: &pb::Status| status.expires_at_ms == 0 || u64::try_from(status.expires_at_ms).is_ok_and(|at| at > now);
    let status = match presence.status.filter(running) {
        Some(wire) => Some(Arc::new(status(wire, now).map_err(|refused| match refused {
            ServiceError::InvalidArgument { field, reason } => {
                ServiceError::invalid(format!("relayed.presence.{field}"), reason)
            }
            other => other,
        })?)),
        None => None,
    };
    Ok(Relayed {
        user_id,
        view: UserView { presence: Presence { state, version: presence.version, activity }, status },
        last_active_at: u64::try_from(presence.last_active_at_ms).unwrap_or(0),
        seen_by,
    })
}

#[cfg(test)]
mod tests {
    use presence_core::Availability;

    use super::*;
    use crate::node::privacy::Visibility;
    use crate::node::wire::tests::field_of;

    /// B1: group entries from another node are checked as a request is;
    /// pieces keep every entry, in order.
    #[test]
    fn b1_group_entries_from_a_node_name_the_bad_field_and_pieces_keep_them_all() {
        let sent = |group: &str, stamp: u64| pb::GroupEntries {
            entries: vec![pb::GroupEntry { group_id: group.into(), user_id: "ann".into(), stamp, member: true }],
        };
        assert_eq!(field_of(group_entries(sent("", 1))), "entries.group_id");
        assert_eq!(field_of(group_entries(sent("team", presence_core::stamp::MAX_STAMP + 1))), "entries.stamp");
        let entries: Vec<GroupEntry> = (0..1_000)
            .map(|i| GroupEntry {
                group: format!("group-{i}").into(),
                user: "ann".into(),
                stamp: i,
                member: i % 2 == 0,
            })
            .collect();
        let pieces = group_entry_pieces(&entries, 4_096);
        assert!(pieces.len() > 1, "cut in pieces");
        let back: Vec<GroupEntry> = pieces.into_iter().flat_map(|piece| group_entries(piece).unwrap()).collect();
        assert_eq!(back, entries);
    }

    /// B1, C1: room facts from a node read back as they were sent; one out
    /// of bounds is refused naming its field.
    #[test]
    fn b1_room_facts_from_a_node_read_back_and_a_bad_one_names_its_field() {
        let facts = vec![
            StampedRoomFact {
                invisible: true,
                stamp: 7,
                fact: RoomFact::Member {
                    room_id: "lobby".into(),
                    user_id: "ann".into(),
                    sessions: 2,
                    metadata: MemberMetadata::new(&[("z".into(), "1".into()), ("a".into(), "2".into())]),
                },
            },
            StampedRoomFact::new(8, RoomFact::Left { room_id: "lobby".into(), user_id: "bob".into() }),
            StampedRoomFact::new(
                9,
                RoomFact::Signal { room_id: "lobby".into(), user_id: "ann".into(), kind: "typing".into(), on: true },
            ),
        ];
        let sent = room_facts_message("node-a", &facts);
        assert_eq!((sent.from_node.as_str(), sent.scan), ("node-a", false));
        assert_eq!(room_facts(sent.facts.clone()).unwrap(), facts, "metadata keeps its order");
        let bad = |change: fn(&mut pb::RoomFact)| {
            let mut fact = sent.facts[0].clone();
            change(&mut fact);
            field_of(room_facts(vec![fact]))
        };
        assert_eq!(bad(|fact| fact.stamp = 0), "facts.stamp");
        assert_eq!(bad(|fact| fact.stamp = presence_core::stamp::MAX_STAMP + 1), "facts.stamp");
        assert_eq!(bad(|fact| fact.room_id = String::new()), "facts.room_id");
        assert_eq!(bad(|fact| fact.user_id = "x".repeat(300)), "facts.user_id");
        assert_eq!(bad(|fact| fact.sessions = 0), "facts.sessions");
        assert_eq!(bad(|fact| fact.metadata[0].key = String::new()), "facts.metadata");
        assert_eq!(bad(|fact| fact.kind = 9), "facts.kind");
        let mut signal = sent.facts[2].clone();
        signal.signal_kind = String::new();
        assert_eq!(field_of(room_facts(vec![signal])), "facts.signal_kind");
    }

    #[test]
    fn c3_a_users_durable_data_crosses_the_wire_whole_and_a_bad_one_is_refused_naming_the_field() {
        let user = HandedOver {
            user_id: "u".into(),
            status: Some(presence_core::Status {
                availability: Availability::Away,
                text: "lunch".into(),
                expires_at: Some(9_000),
            }),
            visibility: Some(Visibility::Audience),
            audience: vec!["v1".into(), "v2".into()],
            shares_activity: false,
            last_active_at: 4_000,
            settings: vec![("locale".into(), b"fr".to_vec()), ("theme".into(), b"dark".to_vec())],
        };
        assert_eq!(handed_over(handed_over_message(&user), 1_000).unwrap(), user);
        let earlier_build = pb::HandedOverUser { hides_activity: false, ..handed_over_message(&user) };
        assert!(handed_over(earlier_build, 1_000).unwrap().shares_activity, "a build without A2 sends: it shares");
        let ran_out = handed_over(handed_over_message(&user), 9_000).unwrap();
        assert_eq!(ran_out.status, None, "a status that ran out on the way is dropped");
        let mut bad = handed_over_message(&user);
        bad.visibility = 42;
        assert!(
            matches!(handed_over(bad, 1_000), Err(ServiceError::InvalidArgument { field, .. }) if field == "durable.visibility")
        );
        let mut bad = handed_over_message(&user);
        bad.audience.push(String::new());
        assert!(
            matches!(handed_over(bad, 1_000), Err(ServiceError::InvalidArgument { field, .. }) if field == "durable.audience")
        );
        for (name, value) in [(String::new(), Vec::new()), ("x".repeat(65), Vec::new()), ("big".into(), vec![0; 4_097])]
        {
            let mut bad = handed_over_message(&user);
            bad.settings.insert(name, value);
            assert!(
                matches!(handed_over(bad, 1_000), Err(ServiceError::InvalidArgument { field, .. }) if field == "durable.settings")
            );
        }
    }
}
