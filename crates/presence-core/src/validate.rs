//! Request validation (contract B1): every refusal names the field at fault.
//!
//! The store validates its own inputs rather than trusting the service to, so
//! that no caller of the core can put an oversized id or an out-of-bounds TTL
//! into a shard.

use crate::config::StoreConfig;
use crate::error::LeaseError;

/// Longest user, session or gateway id, in bytes (M1).
pub const MAX_ID_BYTES: usize = 128;
/// Most metadata entries one lease may carry.
pub const MAX_METADATA_ENTRIES: usize = 16;
/// Longest metadata key, in bytes.
pub const MAX_METADATA_KEY_BYTES: usize = 64;
/// Longest metadata value, in bytes.
pub const MAX_METADATA_VALUE_BYTES: usize = 256;

/// An id is 1 to [`MAX_ID_BYTES`] bytes of UTF-8 (the type already guarantees UTF-8).
pub fn id(field: &'static str, value: &str) -> Result<(), LeaseError> {
    if value.is_empty() {
        return Err(LeaseError::invalid(field, "must not be empty"));
    }
    if value.len() > MAX_ID_BYTES {
        return Err(LeaseError::invalid(
            field,
            format!("is {} bytes, longer than the limit of {MAX_ID_BYTES}", value.len()),
        ));
    }
    Ok(())
}

/// Every id of a `user_ids` list is valid; the refusal says which entry is not.
pub fn user_ids<S: AsRef<str>>(user_ids: &[S]) -> Result<(), LeaseError> {
    for (index, user_id) in user_ids.iter().enumerate() {
        if let Err(LeaseError::InvalidArgument { reason, .. }) = id("user_ids", user_id.as_ref()) {
            return Err(LeaseError::invalid("user_ids", format!("entry {index} {reason}")));
        }
    }
    Ok(())
}

/// Longest signal kind, in bytes (S3).
pub const MAX_SIGNAL_KIND_BYTES: usize = 64;
/// Longest signal TTL (S3): a signal is ephemeral.
pub const MAX_SIGNAL_TTL_MS: u32 = 10_000;

/// A signal kind is 1 to [`MAX_SIGNAL_KIND_BYTES`] bytes, its TTL at most
/// [`MAX_SIGNAL_TTL_MS`] (0 clears the signal).
pub(crate) fn signal(kind: &str, ttl_ms: u32) -> Result<(), LeaseError> {
    if kind.is_empty() || kind.len() > MAX_SIGNAL_KIND_BYTES {
        return Err(LeaseError::invalid(
            "kind",
            format!("must be 1 to {MAX_SIGNAL_KIND_BYTES} bytes, is {}", kind.len()),
        ));
    }
    if ttl_ms > MAX_SIGNAL_TTL_MS {
        return Err(LeaseError::invalid(
            "ttl_ms",
            format!("{ttl_ms} is above the longest signal TTL {MAX_SIGNAL_TTL_MS} (0 clears the signal)"),
        ));
    }
    Ok(())
}

/// Longest status text, in characters.
pub const MAX_STATUS_TEXT_CHARS: usize = 128;

/// A status text is at most [`MAX_STATUS_TEXT_CHARS`] characters of printable
/// text: no control characters (line breaks included), so that it renders as
/// one line wherever it is shown.
pub fn status_text(text: &str) -> Result<(), LeaseError> {
    let chars = text.chars().count();
    if chars > MAX_STATUS_TEXT_CHARS {
        return Err(LeaseError::invalid(
            "text",
            format!("is {chars} characters, longer than the limit of {MAX_STATUS_TEXT_CHARS}"),
        ));
    }
    if let Some(bad) = text.chars().find(|c| c.is_control()) {
        return Err(LeaseError::invalid("text", format!("contains the control character {bad:?}")));
    }
    Ok(())
}

/// Resolves a requested TTL: 0 takes the default, anything else must lie within the bounds (L5).
pub(crate) fn ttl(config: &StoreConfig, ttl_ms: u32) -> Result<u32, LeaseError> {
    if ttl_ms == 0 {
        return Ok(config.default_ttl_ms);
    }
    if ttl_ms < config.min_ttl_ms || ttl_ms > config.max_ttl_ms {
        return Err(LeaseError::invalid(
            "ttl_ms",
            format!(
                "{ttl_ms} is outside the accepted range [{}, {}] (0 takes the default {})",
                config.min_ttl_ms, config.max_ttl_ms, config.default_ttl_ms
            ),
        ));
    }
    Ok(ttl_ms)
}

/// Metadata is small: bounded entry count and key and value sizes, no empty or repeated keys.
pub(crate) fn metadata(entries: &[(String, String)]) -> Result<(), LeaseError> {
    if entries.len() > MAX_METADATA_ENTRIES {
        return Err(LeaseError::invalid(
            "metadata",
            format!("has {} entries, more than the limit of {MAX_METADATA_ENTRIES}", entries.len()),
        ));
    }
    for (index, (key, value)) in entries.iter().enumerate() {
        if key.is_empty() || key.len() > MAX_METADATA_KEY_BYTES {
            return Err(LeaseError::invalid(
                "metadata",
                format!("key {key:.32?} must be 1 to {MAX_METADATA_KEY_BYTES} bytes"),
            ));
        }
        if value.len() > MAX_METADATA_VALUE_BYTES {
            return Err(LeaseError::invalid(
                "metadata",
                format!(
                    "value of {key:?} is {} bytes, longer than the limit of {MAX_METADATA_VALUE_BYTES}",
                    value.len()
                ),
            ));
        }
        if entries[..index].iter().any(|(earlier, _)| earlier == key) {
            return Err(LeaseError::invalid("metadata", format!("key {key:?} appears twice")));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn field_of(result: Result<impl Sized, LeaseError>) -> &'static str {
        match result {
            Err(LeaseError::InvalidArgument { field, .. }) => field,
            _ => panic!("expected InvalidArgument"),
        }
    }

    #[test]
    fn ids_must_be_1_to_128_bytes() {
        assert!(id("user_id", "u").is_ok());
        assert!(id("user_id", &"x".repeat(128)).is_ok());
        assert_eq!(field_of(id("user_id", "")), "user_id");
        assert_eq!(field_of(id("session_id", &"x".repeat(129))), "session_id");
        // 43 three-byte characters are 129 bytes: the limit is in bytes, not characters.
        assert_eq!(field_of(id("gateway_id", &"€".repeat(43))), "gateway_id");
    }

    #[test]
    fn ttl_zero_takes_the_default_and_bounds_are_inclusive() {
        let config = StoreConfig::default();
        assert_eq!(ttl(&config, 0), Ok(45_000));
        assert_eq!(ttl(&config, 1_000), Ok(1_000));
        assert_eq!(ttl(&config, 3_600_000), Ok(3_600_000));
        assert_eq!(field_of(ttl(&config, 999)), "ttl_ms");
        assert_eq!(field_of(ttl(&config, 3_600_001)), "ttl_ms");
    }

    #[test]
    fn status_text_is_short_printable_text() {
        assert!(status_text("in a meeting 🗓").is_ok());
        assert!(status_text(&"é".repeat(128)).is_ok());
        assert_eq!(field_of(status_text(&"é".repeat(129))), "text");
        assert_eq!(field_of(status_text("two\nlines")), "text");
        assert_eq!(field_of(status_text("bell\u{7}")), "text");
    }

    #[test]
    fn metadata_is_bounded() {
        let entry = |k: &str, v: &str| (k.to_string(), v.to_string());
        assert!(metadata(&[entry("device", "phone")]).is_ok());
        assert_eq!(field_of(metadata(&[entry("", "x")])), "metadata");
        assert_eq!(field_of(metadata(&[entry("k", &"v".repeat(257))])), "metadata");
        assert_eq!(field_of(metadata(&[entry("k", "a"), entry("k", "b")])), "metadata");
        let many: Vec<_> = (0..17).map(|i| entry(&format!("k{i}"), "v")).collect();
        assert_eq!(field_of(metadata(&many)), "metadata");
    }
}
