//! The protobuf codec the generated services use.
//!
//! It is prost's codec with one difference: a request that cannot be decoded
//! (invalid UTF-8 in a string, a truncated field, a wrong wire type) is answered
//! `INVALID_ARGUMENT` with prost's message, which names the message and field
//! (`RegisterRequest.user_id: invalid string value: data is not UTF-8 encoded`),
//! instead of the `INTERNAL` that tonic answers by default. Bad input is the
//! caller's mistake, and the caller must be able to see which field was wrong.

use std::marker::PhantomData;

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// prost encoding into a buffer reserved to size (see [`SizedEncoder`]), with
/// decode failures reported as `INVALID_ARGUMENT`.
#[derive(Debug, Clone)]
pub struct FieldNamingCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for FieldNamingCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for FieldNamingCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = SizedEncoder<T>;
    type Decoder = FieldNamingDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        SizedEncoder { _pd: PhantomData }
    }

    fn decoder(&mut self) -> Self::Decoder {
        FieldNamingDecoder { _pd: PhantomData }
    }
}

/// Encodes `T` with prost, reserving the message's whole length first.
///
/// prost's own encoder writes into whatever room the buffer has, and the
/// buffer grows by doubling: a Leases batch of a few thousand items (100 KB
/// and more) was copied three or four times on its way out. Reserving its
/// exact length makes that one allocation and no copy; prost computes the
/// length before encoding anyway.
#[derive(Debug, Clone)]
pub struct SizedEncoder<T> {
    _pd: PhantomData<T>,
}

impl<T: Message> Encoder for SizedEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: Self::Item, buf: &mut EncodeBuf<'_>) -> Result<(), Self::Error> {
        buf.reserve(item.encoded_len());
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}

/// Decodes `U`, answering `INVALID_ARGUMENT` with the failing field on error.
#[derive(Debug, Clone)]
pub struct FieldNamingDecoder<U> {
    _pd: PhantomData<U>,
}

impl<U: Message + Default> Decoder for FieldNamingDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<Self::Item>, Self::Error> {
        U::decode(buf).map(Some).map_err(|err| Status::invalid_argument(format!("undecodable request: {err}")))
    }
}
