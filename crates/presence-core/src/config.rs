//! The store's configuration and its validation.

use thiserror::Error;

/// How the lease store is shaped and which TTLs it accepts (contract L5).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// Number of shards, a power of two. Every user lives in exactly one shard,
    /// so more shards mean less lock contention between unrelated users.
    pub shards: usize,
    /// The shortest TTL a request may ask for.
    pub min_ttl_ms: u32,
    /// The TTL used when a request asks for 0.
    pub default_ttl_ms: u32,
    /// The longest TTL a request may ask for.
    pub max_ttl_ms: u32,
    /// Renewals of one lease closer together than this (capped at half the
    /// requested TTL) are acknowledged without a store write (L7); 0 turns the
    /// throttle off.
    pub min_renew_interval_ms: u32,
    /// A user that has been OFFLINE this long, with no lease, no restart hold
    /// and no status, is forgotten: its record leaves memory and it is then
    /// answered like a user never seen (B6). 0 never forgets. Otherwise at
    /// least [`MIN_FORGET_OFFLINE_AFTER_MS`] and at most
    /// [`MAX_FORGET_OFFLINE_AFTER_MS`].
    pub forget_offline_after_ms: u64,
    /// Flap damping (E6): when a user's last lease ends by expiry or
    /// unregister, the user stays ONLINE this much longer, and a register
    /// within that window hides the flip altogether. 0 turns damping off; at
    /// most [`MAX_OFFLINE_GRACE_MS`].
    pub offline_grace_ms: u64,
    /// How long after a user's last active session stopped being active it
    /// is still shown `ACTIVE` (A2): the damping of availability, so that a
    /// quick switch of tabs never shows it away. 0 turns it off; at most
    /// [`MAX_ACTIVE_WINDOW_MS`].
    pub active_window_ms: u64,
}

/// The longest active window (A2): an hour without activity is away by any reading.
pub const MAX_ACTIVE_WINDOW_MS: u64 = 3_600_000;

/// The longest flap-damping window (E6): longer, and a user who closed its
/// last session would look present for too long to be called present.
pub const MAX_OFFLINE_GRACE_MS: u64 = 30_000;

/// The shortest forget window: below a second a user that flaps would be
/// forgotten and made again over and over, costing work for no memory, and a
/// value this small is most likely seconds mistaken for milliseconds.
pub const MIN_FORGET_OFFLINE_AFTER_MS: u64 = 1_000;

/// The longest forget window, a week: longer keeps nearly every id ever seen,
/// which is what 0 says plainly.
pub const MAX_FORGET_OFFLINE_AFTER_MS: u64 = 7 * 24 * 3_600_000;

impl Default for StoreConfig {
    /// Heartbeats every 15 s against a 45 s TTL tolerate two lost beats (L5).
    fn default() -> Self {
        StoreConfig {
            shards: 64,
            min_ttl_ms: 1_000,
            default_ttl_ms: 45_000,
            max_ttl_ms: 3_600_000,
            // Half the heartbeat interval, as gateways commonly throttle (seed 000).
            min_renew_interval_ms: 7_500,
            // Long enough that a user who closes a laptop and opens it again
            // over lunch keeps its record; short enough that a day's distinct
            // users do not pile up (B6).
            forget_offline_after_ms: 600_000,
            // Off: OFFLINE is shown as soon as it is true (E6).
            offline_grace_ms: 0,
            // A minute: a locked screen or a hidden tab for longer is away.
            active_window_ms: 60_000,
        }
    }
}

/// A configuration the store cannot run with.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    /// The shard count is zero, too large, or not a power of two.
    #[error("shards must be a power of two between 1 and 65536, got {0}")]
    Shards(usize),
    /// The TTL bounds are not ordered `0 < min <= default <= max`.
    #[error("TTL bounds must satisfy 0 < min-ttl-ms ({min}) <= default-ttl-ms ({default}) <= max-ttl-ms ({max})")]
    TtlBounds {
        /// The configured minimum.
        min: u32,
        /// The configured default.
        default: u32,
        /// The configured maximum.
        max: u32,
    },
    /// The forget window is neither 0 nor within its bounds.
    #[error(
        "forget-offline-after-ms must be 0 (never forget) or between {MIN_FORGET_OFFLINE_AFTER_MS} and \
         {MAX_FORGET_OFFLINE_AFTER_MS}, got {0}"
    )]
    ForgetOfflineAfter(u64),
    /// The flap-damping window is longer than [`MAX_OFFLINE_GRACE_MS`].
    #[error("offline-grace-ms (offline_grace_ms) must be at most {MAX_OFFLINE_GRACE_MS}, got {0}")]
    OfflineGrace(u64),
    /// The active window is longer than [`MAX_ACTIVE_WINDOW_MS`].
    #[error("active-window-ms (active_window_ms) must be at most {MAX_ACTIVE_WINDOW_MS}, got {0}")]
    ActiveWindow(u64),
}

impl StoreConfig {
    /// Checks that the store can run with this configuration.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if !self.shards.is_power_of_two() || self.shards > 65_536 {
            return Err(ConfigError::Shards(self.shards));
        }
        let (min, default, max) = (self.min_ttl_ms, self.default_ttl_ms, self.max_ttl_ms);
        if min == 0 || min > default || default > max {
            return Err(ConfigError::TtlBounds { min, default, max });
        }
        let forget = self.forget_offline_after_ms;
        if forget != 0 && !(MIN_FORGET_OFFLINE_AFTER_MS..=MAX_FORGET_OFFLINE_AFTER_MS).contains(&forget) {
            return Err(ConfigError::ForgetOfflineAfter(forget));
        }
        if self.offline_grace_ms > MAX_OFFLINE_GRACE_MS {
            return Err(ConfigError::OfflineGrace(self.offline_grace_ms));
        }
        if self.active_window_ms > MAX_ACTIVE_WINDOW_MS {
            return Err(ConfigError::ActiveWindow(self.active_window_ms));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid_and_match_the_contract() {
        let config = StoreConfig::default();
        assert_eq!(config.validate(), Ok(()));
        assert_eq!((config.min_ttl_ms, config.default_ttl_ms, config.max_ttl_ms), (1_000, 45_000, 3_600_000));
        assert_eq!(config.forget_offline_after_ms, 600_000);
        assert_eq!(config.offline_grace_ms, 0, "flap damping is off by default (E6)");
        assert_eq!(config.active_window_ms, 60_000, "a minute of activity damping (A2)");
    }

    #[test]
    fn a2_an_active_window_above_an_hour_is_refused_naming_active_window_ms() {
        let base = StoreConfig::default();
        for window in [0, 1, MAX_ACTIVE_WINDOW_MS] {
            assert_eq!(StoreConfig { active_window_ms: window, ..base.clone() }.validate(), Ok(()));
        }
        let refused = StoreConfig { active_window_ms: MAX_ACTIVE_WINDOW_MS + 1, ..base.clone() }.validate();
        assert_eq!(refused, Err(ConfigError::ActiveWindow(MAX_ACTIVE_WINDOW_MS + 1)));
        assert!(refused.unwrap_err().to_string().contains("active_window_ms"));
    }

    #[test]
    fn e6_a_grace_above_30000_is_refused_naming_offline_grace_ms() {
        let base = StoreConfig::default();
        for grace in [0, 1, 5_000, MAX_OFFLINE_GRACE_MS] {
            assert_eq!(StoreConfig { offline_grace_ms: grace, ..base.clone() }.validate(), Ok(()));
        }
        for grace in [MAX_OFFLINE_GRACE_MS + 1, u64::MAX] {
            let refused = StoreConfig { offline_grace_ms: grace, ..base.clone() }.validate();
            assert_eq!(refused, Err(ConfigError::OfflineGrace(grace)));
            assert!(refused.unwrap_err().to_string().contains("offline_grace_ms"));
        }
    }

    #[test]
    fn b6_the_forget_window_is_zero_or_within_its_bounds_and_a_refusal_names_the_setting() {
        let base = StoreConfig::default();
        for forget in [0, 1_000, 600_000, MAX_FORGET_OFFLINE_AFTER_MS] {
            assert_eq!(StoreConfig { forget_offline_after_ms: forget, ..base.clone() }.validate(), Ok(()));
        }
        for forget in [1, 999, MAX_FORGET_OFFLINE_AFTER_MS + 1, u64::MAX] {
            let refused = StoreConfig { forget_offline_after_ms: forget, ..base.clone() }.validate();
            assert_eq!(refused, Err(ConfigError::ForgetOfflineAfter(forget)));
            assert!(refused.unwrap_err().to_string().starts_with("forget-offline-after-ms must be 0"));
        }
    }

    #[test]
    fn bad_shapes_are_refused() {
        let base = StoreConfig::default();
        for shards in [0, 3, 100, 131_072] {
            assert_eq!(StoreConfig { shards, ..base.clone() }.validate(), Err(ConfigError::Shards(shards)));
        }
        for (min, default, max) in [(0, 10, 20), (30, 10, 40), (10, 50, 40)] {
            let config = StoreConfig { min_ttl_ms: min, default_ttl_ms: default, max_ttl_ms: max, ..base.clone() };
            assert_eq!(config.validate(), Err(ConfigError::TtlBounds { min, default, max }));
        }
    }
}
