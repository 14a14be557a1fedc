//! The Leases request as the server decodes it: a renewal's ids stay in the
//! received buffer.
//!
//! A Leases batch is mostly renewals, and decoding a renewal into the
//! generated `RenewRequest` allocates two strings, copied out of the request
//! only to be dropped once the renewal is applied: at millions of renewals a
//! second that is most of what decoding costs. These types read the same
//! bytes (a `string` field and a `bytes` field are the same on the wire, and a
//! `map` field is a repeated entry message) but keep every id as a slice of the
//! buffer the request arrived in.
//!
//! Checking that text is UTF-8 is left to the server, item by item, which is
//! the other reason for these types: decoded as the generated messages, one
//! item with a bad string made the whole batch undecodable, and every other
//! item of it went unanswered (contract L8: one bad item never fails the others).
//!
//! Only the server's side of the Leases RPC decodes these. Clients send the
//! generated [`LeaseBatch`](crate::v1::LeaseBatch); the API and what reflection
//! shows of it are unchanged.

use bytes::Bytes;
use prost::Message as _;

use crate::v1::LeaseBatch;

/// Most items one batch may carry; a batch with more is refused whole.
pub const MAX_BATCH_ITEMS: usize = 10_000;

/// `LeaseBatch`, as the server decodes it.
///
/// Decoding keeps at most [`MAX_BATCH_ITEMS`] items and only counts the rest:
/// an empty item is two bytes on the wire but a hundred in memory, so a
/// request of the largest size the server accepts, decoded whole, could cost
/// hundreds of megabytes before the batch is refused for its size.
#[derive(Clone, PartialEq, Default, Debug)]
pub struct LeaseBatchFrame {
    /// Echoed in the results.
    pub batch_id: u64,
    /// The items, in order (the first [`MAX_BATCH_ITEMS`] of them).
    pub items: Vec<LeaseItemFrame>,
    /// Items past [`MAX_BATCH_ITEMS`], skipped while decoding.
    pub items_beyond_limit: usize,
}

impl LeaseBatchFrame {
    /// The batch's items as sent, those skipped included.
    pub fn items_sent(&self) -> usize {
        self.items.len() + self.items_beyond_limit
    }
}

impl prost::Message for LeaseBatchFrame {
    fn encode_raw(&self, buf: &mut impl bytes::BufMut) {
        if self.batch_id != 0 {
            prost::encoding::uint64::encode(1, &self.batch_id, buf);
        }
        for item in &self.items {
            prost::encoding::message::encode(2, item, buf);
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: prost::encoding::WireType,
        buf: &mut impl bytes::Buf,
        ctx: prost::encoding::DecodeContext,
    ) -> Result<(), prost::DecodeError> {
        match tag {
            1 => prost::encoding::uint64::merge(wire_type, &mut self.batch_id, buf, ctx),
            2 if self.items.len() < MAX_BATCH_ITEMS => {
                prost::encoding::message::merge_repeated(wire_type, &mut self.items, buf, ctx)
            }
            2 => {
                self.items_beyond_limit += 1;
                prost::encoding::skip_field(wire_type, tag, buf, ctx)
            }
            _ => prost::encoding::skip_field(wire_type, tag, buf, ctx),
        }
    }

    fn encoded_len(&self) -> usize {
        let batch_id = if self.batch_id != 0 { prost::encoding::uint64::encoded_len(1, &self.batch_id) } else { 0 };
        batch_id + prost::encoding::message::encoded_len_repeated(2, &self.items)
    }

    fn clear(&mut self) {
        *self = LeaseBatchFrame::default();
    }
}

/// `LeaseItem`, as the server decodes it.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaseItemFrame {
    /// What the item asks.
    #[prost(oneof = "LeaseOpFrame", tags = "1, 2, 3, 4, 5, 6")]
    pub op: Option<LeaseOpFrame>,
}

/// `LeaseItem.op`, as the server decodes it: text not yet checked.
#[derive(Clone, PartialEq, prost::Oneof)]
pub enum LeaseOpFrame {
    /// A register.
    #[prost(message, tag = "1")]
    Register(RegisterFrame),
    /// A renewal.
    #[prost(message, tag = "2")]
    Renew(RenewFrame),
    /// An unregister.
    #[prost(message, tag = "3")]
    Unregister(UnregisterFrame),
    /// A session joining a room.
    #[prost(message, tag = "4")]
    Join(JoinFrame),
    /// A session leaving a room.
    #[prost(message, tag = "5")]
    Leave(LeaveFrame),
    /// A session's signal into a room.
    #[prost(message, tag = "6")]
    Signal(SignalFrame),
}

impl LeaseItemFrame {
    /// The user the item acts for, as received (every operation names one).
    pub fn user_id(&self) -> Option<&[u8]> {
        Some(match self.op.as_ref()? {
            LeaseOpFrame::Register(frame) => &frame.user_id,
            LeaseOpFrame::Renew(frame) => &frame.user_id,
            LeaseOpFrame::Unregister(frame) => &frame.user_id,
            LeaseOpFrame::Join(frame) => &frame.user_id,
            LeaseOpFrame::Leave(frame) => &frame.user_id,
            LeaseOpFrame::Signal(frame) => &frame.user_id,
        })
    }
}

/// `RegisterRequest` with its text as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RegisterFrame {
    /// `user_id`'s bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub user_id: Bytes,
    /// `session_id`'s bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub session_id: Bytes,
    /// `gateway_id`'s bytes.
    #[prost(bytes = "bytes", tag = "3")]
    pub gateway_id: Bytes,
    /// The TTL asked for (0: the server default).
    #[prost(uint32, tag = "4")]
    pub ttl_ms: u32,
    /// `metadata`'s entries in the order received (a later entry for a key replaces an earlier one).
    #[prost(message, repeated, tag = "5")]
    pub metadata: Vec<MetadataEntryFrame>,
    /// `device_kind`, as a number (A1).
    #[prost(int32, tag = "6")]
    pub device_kind: i32,
    /// `attention`, as a number, if sent (A1).
    #[prost(int32, optional, tag = "7")]
    pub attention: Option<i32>,
    /// `focused_room_id`'s bytes, if sent (A1).
    #[prost(bytes = "bytes", optional, tag = "8")]
    pub focused_room_id: Option<Bytes>,
}

/// One entry of `RegisterRequest.metadata`, as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct MetadataEntryFrame {
    /// The key's bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub key: Bytes,
    /// The value's bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub value: Bytes,
}

/// `UnregisterRequest` with its ids as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct UnregisterFrame {
    /// `user_id`'s bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub user_id: Bytes,
    /// `session_id`'s bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub session_id: Bytes,
    /// The generation the gateway holds.
    #[prost(uint64, tag = "3")]
    pub generation: u64,
    /// How long the lease may linger (0: delete now).
    #[prost(uint32, tag = "4")]
    pub linger_ms: u32,
}

/// `RenewRequest` with its ids as received: bytes that should be UTF-8.
#[derive(Clone, PartialEq, prost::Message)]
pub struct RenewFrame {
    /// `user_id`'s bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub user_id: Bytes,
    /// `session_id`'s bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub session_id: Bytes,
    /// The generation the gateway holds.
    #[prost(uint64, tag = "3")]
    pub generation: u64,
    /// The TTL asked for (0: the server default).
    #[prost(uint32, tag = "4")]
    pub ttl_ms: u32,
    /// `attention`, as a number, if sent (A1).
    #[prost(int32, optional, tag = "5")]
    pub attention: Option<i32>,
    /// `focused_room_id`'s bytes, if sent (A1).
    #[prost(bytes = "bytes", optional, tag = "6")]
    pub focused_room_id: Option<Bytes>,
}

/// `JoinRequest` with its text as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct JoinFrame {
    /// `user_id`'s bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub user_id: Bytes,
    /// `session_id`'s bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub session_id: Bytes,
    /// The generation the gateway holds.
    #[prost(uint64, tag = "3")]
    pub generation: u64,
    /// `room_id`'s bytes.
    #[prost(bytes = "bytes", tag = "4")]
    pub room_id: Bytes,
    /// `metadata`'s entries in the order received (a later entry for a key replaces an earlier one).
    #[prost(message, repeated, tag = "5")]
    pub metadata: Vec<MetadataEntryFrame>,
}

/// `LeaveRequest` with its text as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct LeaveFrame {
    /// `user_id`'s bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub user_id: Bytes,
    /// `session_id`'s bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub session_id: Bytes,
    /// The generation the gateway holds.
    #[prost(uint64, tag = "3")]
    pub generation: u64,
    /// `room_id`'s bytes.
    #[prost(bytes = "bytes", tag = "4")]
    pub room_id: Bytes,
}

/// `SignalRequest` with its text as received.
#[derive(Clone, PartialEq, prost::Message)]
pub struct SignalFrame {
    /// `user_id`'s bytes.
    #[prost(bytes = "bytes", tag = "1")]
    pub user_id: Bytes,
    /// `session_id`'s bytes.
    #[prost(bytes = "bytes", tag = "2")]
    pub session_id: Bytes,
    /// The generation the gateway holds.
    #[prost(uint64, tag = "3")]
    pub generation: u64,
    /// `room_id`'s bytes.
    #[prost(bytes = "bytes", tag = "4")]
    pub room_id: Bytes,
    /// `kind`'s bytes.
    #[prost(bytes = "bytes", tag = "5")]
    pub kind: Bytes,
    /// How long the signal lasts (0: clear it).
    #[prost(uint32, tag = "6")]
    pub ttl_ms: u32,
}

impl From<&LeaseBatch> for LeaseBatchFrame {
    /// The batch as the server would receive it (for tests and in-process callers).
    fn from(batch: &LeaseBatch) -> Self {
        LeaseBatchFrame::decode(batch.encode_to_vec().as_slice())
            .expect("the two messages share one wire format; a generated message always decodes")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{LeaseItem, RegisterRequest, RenewRequest, UnregisterRequest, lease_item};

    #[test]
    fn b6_decoding_keeps_at_most_the_batch_limit_of_items_and_counts_the_rest() {
        // A frame of the largest size the server accepts holds two million empty items.
        let sent = 2 * 1024 * 1024 - 8;
        let mut bytes = vec![0x08, 0x07]; // batch_id 7
        bytes.extend(std::iter::repeat_n([0x12u8, 0x00], sent).flatten()); // field 2, empty message
        let frame = LeaseBatchFrame::decode(bytes.as_slice()).unwrap();
        assert_eq!(frame.batch_id, 7);
        assert_eq!(frame.items.len(), MAX_BATCH_ITEMS, "no more items are held than a batch may carry");
        assert_eq!(frame.items_sent(), sent, "the others are counted, for the refusal to say how many");
        assert!(frame.items.capacity() < 2 * MAX_BATCH_ITEMS);
    }

    #[test]
    fn a_batch_reads_the_same_as_the_generated_message_and_keeps_renewal_ids_in_the_buffer() {
        let renew = RenewRequest {
            user_id: "ü1".into(),
            session_id: "s".into(),
            generation: 7,
            ttl_ms: 9,
            attention: Some(3),
            focused_room_id: Some(String::new()),
        };
        let register = RegisterRequest {
            user_id: "u2".into(),
            session_id: "s2".into(),
            gateway_id: "g".into(),
            ttl_ms: 5,
            metadata: [("k".to_string(), "v".to_string())].into(),
            device_kind: 2,
            attention: Some(1),
            focused_room_id: Some("doc".into()),
        };
        let unregister = UnregisterRequest { user_id: "u3".into(), generation: 3, linger_ms: 4, ..Default::default() };
        let batch = LeaseBatch {
            batch_id: 42,
            items: vec![
                LeaseItem { op: Some(lease_item::Op::Renew(renew)) },
                LeaseItem { op: Some(lease_item::Op::Register(register.clone())) },
                LeaseItem { op: Some(lease_item::Op::Unregister(unregister.clone())) },
                LeaseItem { op: None },
            ],
        };
        let wire = Bytes::from(batch.encode_to_vec());
        let frame = LeaseBatchFrame::decode(wire.clone()).unwrap();
        assert_eq!(frame.batch_id, 42);
        let Some(LeaseOpFrame::Renew(renewal)) = &frame.items[0].op else { panic!("{:?}", frame.items[0]) };
        assert_eq!((&renewal.user_id[..], &renewal.session_id[..]), ("ü1".as_bytes(), &b"s"[..]));
        assert_eq!((renewal.generation, renewal.ttl_ms), (7, 9));
        assert_eq!(
            (renewal.attention, renewal.focused_room_id.as_deref()),
            (Some(3), Some(&b""[..])),
            "set, and set to empty"
        );
        let inside = wire.as_ptr_range();
        assert!(inside.contains(&renewal.user_id.as_ptr()), "the id is a slice of the received bytes, not a copy");
        let bytes = |text: &'static str| Bytes::from_static(text.as_bytes());
        let entry = MetadataEntryFrame { key: bytes("k"), value: bytes("v") };
        let register = RegisterFrame {
            user_id: bytes("u2"),
            session_id: bytes("s2"),
            gateway_id: bytes("g"),
            ttl_ms: 5,
            metadata: vec![entry],
            device_kind: 2,
            attention: Some(1),
            focused_room_id: Some(bytes("doc")),
        };
        assert_eq!(frame.items[1].op, Some(LeaseOpFrame::Register(register)));
        let unregister =
            UnregisterFrame { user_id: bytes("u3"), session_id: Bytes::new(), generation: 3, linger_ms: 4 };
        assert_eq!(frame.items[2].op, Some(LeaseOpFrame::Unregister(unregister)));
        assert_eq!(frame.items[3].op, None);
        assert_eq!(LeaseBatchFrame::from(&batch), frame);
    }
}
