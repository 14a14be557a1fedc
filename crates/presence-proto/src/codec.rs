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
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic_prost::{ProstCodec, ProstEncoder};

/// prost encoding, with decode failures reported as `INVALID_ARGUMENT`.
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
    type Encoder = ProstEncoder<T>;
    type Decoder = FieldNamingDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::default())
    }

    fn decoder(&mut self) -> Self::Decoder {
        FieldNamingDecoder { _pd: PhantomData }
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
