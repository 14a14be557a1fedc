//! The `authorization` metadata of a request. First byte even: the rest is
//! the metadata as sent, one entry per line. Odd: the rest is a token's
//! header JSON and claims JSON, split at the first NUL, which this target
//! signs with the configured HS256 secret and sends as `Bearer <token>`, so
//! that the checks after the signature's (`alg`, `exp`, `nbf`, `sub`, the
//! same for every key) are reached.
#![no_main]

use presence_server::fuzzing;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else { return };
    if mode % 2 == 0 {
        return fuzzing::authorization(rest);
    }
    let (header, claims) = match rest.iter().position(|&byte| byte == 0) {
        Some(at) => (&rest[..at], &rest[at + 1..]),
        None => (rest, &[][..]),
    };
    let token = fuzzing::signed_token(header, claims);
    fuzzing::authorization(format!("Bearer {token}").as_bytes());
});
