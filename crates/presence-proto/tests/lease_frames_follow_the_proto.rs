//! The server's Leases frames must read every field of the messages they
//! mirror: prost skips fields a type does not declare, so a field added to
//! `RegisterRequest` in the proto but not to `RegisterFrame` would be silently
//! dropped on the Leases path alone. This test walks the API's descriptor and,
//! for every field of every mirrored message, sends that one field through the
//! frame type: the frame must decode it and encode it back byte for byte.

use presence_proto::lease_frames::{
    JoinFrame, LeaseBatchFrame, LeaseItemFrame, LeaveFrame, MetadataEntryFrame, RegisterFrame, RenewFrame, SignalFrame,
    UnregisterFrame,
};
use presence_proto::v1 as pb;
use prost::Message;
use prost::bytes::BufMut;
use prost_types::field_descriptor_proto::Type;
use prost_types::{DescriptorProto, FieldDescriptorProto, FileDescriptorSet};

/// Decodes `bytes` as `M` and encodes it again.
fn round_trip<M: Message + Default>(bytes: &[u8]) -> Result<Vec<u8>, prost::DecodeError> {
    M::decode(bytes).map(|message| message.encode_to_vec())
}

type RoundTrip = fn(&[u8]) -> Result<Vec<u8>, prost::DecodeError>;

/// Each mirrored message: its full name, the frame that mirrors it, and the
/// generated message (which checks that the sample encoding itself is valid).
const MIRRORS: &[(&str, RoundTrip, RoundTrip)] = &[
    ("presence.v1.LeaseBatch", round_trip::<LeaseBatchFrame>, round_trip::<pb::LeaseBatch>),
    ("presence.v1.LeaseItem", round_trip::<LeaseItemFrame>, round_trip::<pb::LeaseItem>),
    ("presence.v1.RegisterRequest", round_trip::<RegisterFrame>, round_trip::<pb::RegisterRequest>),
    ("presence.v1.RegisterRequest.MetadataEntry", round_trip::<MetadataEntryFrame>, metadata_entry),
    ("presence.v1.RenewRequest", round_trip::<RenewFrame>, round_trip::<pb::RenewRequest>),
    ("presence.v1.UnregisterRequest", round_trip::<UnregisterFrame>, round_trip::<pb::UnregisterRequest>),
    ("presence.v1.JoinRequest", round_trip::<JoinFrame>, round_trip::<pb::JoinRequest>),
    ("presence.v1.JoinRequest.MetadataEntry", round_trip::<MetadataEntryFrame>, metadata_entry),
    ("presence.v1.LeaveRequest", round_trip::<LeaveFrame>, round_trip::<pb::LeaveRequest>),
    ("presence.v1.SignalRequest", round_trip::<SignalFrame>, round_trip::<pb::SignalRequest>),
];

/// A map entry has no generated type of its own; its encoding is two fields.
fn metadata_entry(bytes: &[u8]) -> Result<Vec<u8>, prost::DecodeError> {
    round_trip::<MetadataEntryFrame>(bytes)
}

fn messages(set: &FileDescriptorSet) -> Vec<(String, &DescriptorProto)> {
    fn walk<'a>(prefix: &str, message: &'a DescriptorProto, out: &mut Vec<(String, &'a DescriptorProto)>) {
        let name = format!("{prefix}.{}", message.name());
        for nested in &message.nested_type {
            walk(&name, nested, out);
        }
        out.push((name, message));
    }
    let mut out = Vec::new();
    for file in &set.file {
        for message in &file.message_type {
            walk(file.package(), message, &mut out);
        }
    }
    out
}

fn put_varint(out: &mut Vec<u8>, value: u64) {
    prost::encoding::encode_varint(value, out);
}

/// One field, alone, with a value that is not its default.
fn sample(field: &FieldDescriptorProto) -> Vec<u8> {
    let number = u64::try_from(field.number()).expect("field numbers are positive");
    let mut out = Vec::new();
    let key = |wire_type: u64| (number << 3) | wire_type;
    match field.r#type() {
        Type::Double | Type::Fixed64 | Type::Sfixed64 => {
            put_varint(&mut out, key(1));
            out.put_u64_le(1);
        }
        Type::Float | Type::Fixed32 | Type::Sfixed32 => {
            put_varint(&mut out, key(5));
            out.put_u32_le(1);
        }
        Type::Int64 | Type::Uint64 | Type::Int32 | Type::Uint32 | Type::Bool | Type::Enum => {
            put_varint(&mut out, key(0));
            put_varint(&mut out, 1);
        }
        Type::Sint32 | Type::Sint64 => {
            put_varint(&mut out, key(0));
            put_varint(&mut out, 2); // zigzag 1
        }
        Type::String | Type::Bytes => {
            put_varint(&mut out, key(2));
            put_varint(&mut out, 1);
            out.push(b'x');
        }
        Type::Message => {
            // An empty message is still present: a oneof member or a list entry.
            put_varint(&mut out, key(2));
            put_varint(&mut out, 0);
        }
        Type::Group => panic!("{}: groups are not used in this API", field.name()),
    }
    out
}

#[test]
fn every_field_of_a_mirrored_message_survives_its_frame() {
    let set = FileDescriptorSet::decode(presence_proto::FILE_DESCRIPTOR_SET).expect("the API's descriptor decodes");
    let messages = messages(&set);
    for (name, frame, generated) in MIRRORS {
        let (_, message) = messages
            .iter()
            .find(|(full_name, _)| full_name == name)
            .unwrap_or_else(|| panic!("{name} is not in the API's descriptor"));
        assert!(!message.field.is_empty(), "{name} has fields");
        for field in &message.field {
            let bytes = sample(field);
            assert_eq!(
                generated(&bytes).as_deref(),
                Ok(bytes.as_slice()),
                "the test's own encoding of {name}.{} is not what the generated message reads",
                field.name()
            );
            assert_eq!(
                frame(&bytes).as_deref(),
                Ok(bytes.as_slice()),
                "{name}.{} (field {}) is lost or misread by its Leases frame: add it to lease_frames.rs",
                field.name(),
                field.number()
            );
        }
    }
}
