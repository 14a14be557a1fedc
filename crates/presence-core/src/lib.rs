//! The presenced lease core: session leases in, derived user presence out.
//!
//! This crate owns the state machine of contract rules M1 to M3, L1 to L6, E1
//! and E2: leases keyed by user and session, generation-checked transitions,
//! per-user versions that move only when a user's ONLINE/OFFLINE state flips,
//! and a timer wheel that expires leases on time.
//!
//! It must not do I/O, spawn anything or read a clock: every operation takes
//! `now` (milliseconds) and hands back the flips it caused. The server turns
//! its clock into `now`, drives [`Store::expire`] at [`Store::next_deadline`]
//! and publishes the flips; tests drive simulated time at full speed.

pub mod attention;
pub mod checkpoint;
mod config;
mod error;
pub mod feed;
mod interner;
mod room_intake;
mod room_names;
mod rooms;
mod shard;
mod slots;
pub mod stamp;
mod store;
pub mod sync;
mod types;
mod user_index;
mod validate;
pub mod wheel;

pub use compact_str::CompactString;
pub use config::{
    ConfigError, MAX_ACTIVE_WINDOW_MS, MAX_FORGET_OFFLINE_AFTER_MS, MAX_OFFLINE_GRACE_MS, MIN_FORGET_OFFLINE_AFTER_MS,
    StoreConfig,
};
pub use error::LeaseError;
pub use feed::{FeedEntry, FeedEvent, FeedIntake, RoomOccupancy};
pub use room_intake::{LEFT_KEPT_MS, RoomFactScan, ScanTakenFor, StampedRoomFact};
pub use rooms::{MemberMetadata, RoomFact};
pub use shard::{LeaseView, MAX_ROOMS_PER_SESSION, SIGNAL_CHANGES_PER_SECOND, SessionView};
pub use slots::{SlotSet, slot_of};
pub use store::Store;
pub use types::{
    Availability, ChangeKind, Changes, Erased, Imported, Joined, Left, Presence, PresenceChange, Registered,
    Registration, Renewal, Renewed, Replaced, Revoked, RoomAccess, RoomChange, RoomChangeKind, RoomEventBody,
    RoomMember, RoomMetadata, RoomRef, RoomView, SIGNAL_SET_CAP, Signalled, State, Status, StoreStats,
    UnregisterOutcome, Unregistered, UserView,
};
pub use validate::{
    MAX_ID_BYTES, MAX_METADATA_ENTRIES, MAX_METADATA_KEY_BYTES, MAX_METADATA_VALUE_BYTES, MAX_SIGNAL_KIND_BYTES,
    MAX_SIGNAL_TTL_MS, MAX_STATUS_TEXT_CHARS, id as validate_id, status_text as validate_status_text,
    user_ids as validate_user_ids,
};
pub use wheel::Tick;

#[cfg(test)]
mod store_tests;
