//! Checkpoint write and load times and resident memory, with 1M and 3M
//! sessions (2.5 per user, ids shaped like the seed's): what a restart costs.
//! Run with `cargo bench --bench checkpoint`; figures in docs/benchmarks.md.
//! Writes to a scratch directory under the system temp dir and removes it.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::time::Instant;

use presence_core::checkpoint::{self, CheckpointWriter};
use presence_core::{Registration, Store, StoreConfig, Tick};

const START: Tick = 1_700_000_000_000;

fn resident_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib: f64 = status
        .lines()
        .find(|line| line.starts_with("VmRSS:"))
        .and_then(|line| line.split_whitespace().nth(1)?.parse().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

fn populated(sessions: usize) -> Store {
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    let mut changes = Vec::new();
    for session in 0..sessions {
        let user_id = format!("u{}", session * 2 / 5);
        let session_id = format!("sess_{session:012}");
        let registration = Registration {
            user_id: &user_id,
            session_id: &session_id,
            gateway_id: "gw-07",
            ttl_ms: 45_000,
            metadata: &[],
        };
        store.register(START, &registration, &mut changes).expect("valid registration");
        changes.clear();
    }
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
