//! One batch of a Leases stream: the first byte's low bit applies it as a
//! full queue does (renewals shed), the rest is the `LeaseBatch` frame.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Some((&flags, frame)) = data.split_first() {
        presence_server::fuzzing::leases(flags & 1 == 1, frame);
    }
});
