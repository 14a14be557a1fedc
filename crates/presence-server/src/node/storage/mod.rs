//! Storage: what one node keeps on disk, the durable store (`durable.rs`), the data directory and backup files.
//! It may name the plain data it keeps (`relations.rs`, `groups.rs`) and the webhooks' folder; nothing that serves.

pub(crate) mod backup;
pub(crate) mod data_dir;
pub(crate) mod durable;
