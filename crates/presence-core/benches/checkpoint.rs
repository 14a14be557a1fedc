//! Checkpoint write and load times and resident memory, with 1M and 3M
//! sessions (2.5 per user, ids shaped like the seed's): what a restart costs.
//! Run with `cargo bench --bench checkpoint`; figures in docs/benchmarks.md.
//! Writes to a scratch directory under the system temp dir and removes it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Instant;

use presence_core::checkpoint::{self, CheckpointWriter};
use presence_core::{Store, StoreConfig};

#[path = "support/mod.rs"]
mod support;

use support::{START, register_sessions, resident_bytes};

fn resident_mib() -> f64 {
    resident_bytes().unwrap_or(0) as f64 / 1_048_576.0
}

fn populated(sessions: usize) -> Store {
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    register_sessions(&store, 0..sessions);
    store
}

fn main() {
    let dir = std::env::temp_dir().join(format!("presenced-checkpoint-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let path = dir.join("leases.checkpoint");
    for sessions in [1_000_000usize, 3_000_000] {
        let store = populated(sessions);
        let before_write = resident_mib();

        let started = Instant::now();
        let mut file = BufWriter::with_capacity(1 << 20, File::create(&path).expect("create"));
        let mut writer = CheckpointWriter::new(START);
        for shard in 0..store.shard_count() {
            store.checkpoint_shard(shard, &mut writer);
            file.write_all(&writer.take_chunk()).expect("write");
        }
        file.write_all(&writer.finish()).expect("write");
        let file = file.into_inner().expect("flush");
        file.sync_all().expect("fsync");
        let write_took = started.elapsed();
        let during_write = resident_mib();
        let bytes = std::fs::metadata(&path).expect("metadata").len();
        drop(store);

        let before_load = resident_mib();
        let started = Instant::now();
        let read = std::fs::read(&path).expect("read");
        let decoded = checkpoint::decode(&read).expect("intact");
        drop(read);
        let restored = Store::restore(StoreConfig::default(), START + 1, &decoded, START + 1).expect("restore");
        let peak_load = resident_mib();
        drop(decoded);
        let load_took = started.elapsed();
        assert_eq!(restored.stats().sessions, sessions);
        println!(
            "checkpoint: {sessions} sessions, {:.0} MiB file: write {:.0} ms (RSS {:.0} -> {:.0} MiB), \
             load {:.0} ms (RSS {:.0} -> {:.0} MiB at peak)",
            bytes as f64 / 1048576.0,
            write_took.as_secs_f64() * 1e3,
            before_write,
            during_write,
            load_took.as_secs_f64() * 1e3,
            before_load,
            peak_load,
        );
    }
    std::fs::remove_dir_all(&dir).expect("remove scratch directory");
}
