//! A Watch stream's message as the server sends it: a `WatchEvent` to encode,
//! or one encoded already, from bytes every viewer sent the same change
//! shares (E5: a change is encoded once, not once per viewer).
//!
//! The server trait's `Watch` stream yields [`WatchFrame`] instead of the
//! generated `WatchEvent` (see build.rs): the wire format is the same, so a
//! client decodes either as a `WatchEvent`.

use bytes::{Buf, BufMut, Bytes};
use prost::encoding::{DecodeContext, WireType};
use prost::{DecodeError, Message};

use crate::v1::WatchEvent;

/// One message of a Watch stream.
#[derive(Debug, Clone, PartialEq)]
pub enum WatchFrame {
    /// An event encoded as it is sent (snapshots, resyncs, `added`).
    Event(WatchEvent),
    /// The bytes of a whole encoded `WatchEvent`, copied as they are.
    Encoded(Bytes),
}

impl Default for WatchFrame {
    fn default() -> Self {
        WatchFrame::Event(WatchEvent::default())
    }
}

impl From<WatchEvent> for WatchFrame {
    fn from(event: WatchEvent) -> Self {
        WatchFrame::Event(event)
    }
}

impl WatchFrame {
    /// The event this frame sends (decoding the bytes of an encoded one).
    pub fn event(&self) -> Result<WatchEvent, DecodeError> {
        match self {
            WatchFrame::Event(event) => Ok(event.clone()),
            WatchFrame::Encoded(bytes) => WatchEvent::decode(bytes.clone()),
        }
    }
}

impl Message for WatchFrame {
    fn encode_raw(&self, buf: &mut impl BufMut) {
        match self {
            WatchFrame::Event(event) => event.encode_raw(buf),
            WatchFrame::Encoded(bytes) => buf.put_slice(bytes),
        }
    }

    fn merge_field(
        &mut self,
        tag: u32,
        wire_type: WireType,
        buf: &mut impl Buf,
        ctx: DecodeContext,
    ) -> Result<(), DecodeError> {
        // The server only sends frames; one decoded (in a test) is the event it holds.
        if let WatchFrame::Encoded(bytes) = self {
            *self = WatchFrame::Event(WatchEvent::decode(bytes.clone())?);
        }
        let WatchFrame::Event(event) = self else { unreachable!("made an event above") };
        event.merge_field(tag, wire_type, buf, ctx)
    }

    fn encoded_len(&self) -> usize {
        match self {
            WatchFrame::Event(event) => event.encoded_len(),
            WatchFrame::Encoded(bytes) => bytes.len(),
        }
    }

    fn clear(&mut self) {
        *self = WatchFrame::default();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::{UserPresence, watch_event};

    #[test]
    fn an_encoded_frame_is_sent_as_the_event_it_holds() {
        let event = WatchEvent {
            event: Some(watch_event::Event::Update(UserPresence {
                user_id: "ann".into(),
                version: 7,
                ..Default::default()
            })),
        };
        let encoded = WatchFrame::Encoded(Bytes::from(event.encode_to_vec()));
        assert_eq!(encoded.encoded_len(), event.encoded_len());
        assert_eq!(WatchEvent::decode(encoded.encode_to_vec().as_slice()).unwrap(), event);
        assert_eq!(WatchFrame::from(event.clone()).encode_to_vec(), encoded.encode_to_vec());
        assert_eq!(encoded.event().unwrap(), event);
    }
}
