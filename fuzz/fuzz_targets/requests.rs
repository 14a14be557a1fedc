//! Every unary and server-streaming request: the first byte picks the RPC
//! (`presence_server::fuzzing::METHODS`), the rest is its protobuf body,
//! decoded and handled as the service does.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((&method, body)) = data.split_first() {
        presence_server::fuzzing::request(method, body);
    }
});
