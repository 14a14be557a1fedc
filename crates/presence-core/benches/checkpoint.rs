//! Checkpoint write and load: what a restart costs, with 1M and 3M sessions
//! (2.5 per user, ids shaped like the seed's).
//!
//! For each size: a store is filled and written to a file (write time), then
//! dropped and the heap trimmed; the file is loaded as the server loads it
//! (load time), and the process's resident memory is read before the load,
//! after it (the loaded store) and at its peak during it (`VmHWM`, reset just
//! before the load through `/proc/self/clear_refs`, which needs root or
//! ownership of the process; without it the peak is not reported). The figure
//! to read is `peak / loaded`: how much more than the store itself the load
//! needs at its worst. Figures in docs/benchmarks.md.
//!
//! ```text
//! cargo bench -p presence-core --bench checkpoint
//! ```
//!
//! Writes to a scratch directory under the system temp dir and removes it.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::time::Instant;

use presence_core::checkpoint::{CheckpointWriter, StoreLoader};
use presence_core::{Store, StoreConfig};

#[path = "support/mod.rs"]
mod support;

use support::{START, register_sessions, resident_bytes};

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// The process's peak resident set since the last [`reset_peak`], from /proc (Linux).
fn peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}

/// Resets `VmHWM` to the current resident set; false when the kernel refuses.
fn reset_peak() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

fn populated(sessions: usize) -> Store {
    let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
    register_sessions(&store, 0..sessions);
    store
}

/// Loads the checkpoint at `path` as the server does (presence-server's
/// `data_dir.rs`): a piece at a time, straight into the new store.
fn load(path: &Path) -> Store {
    let mut file = File::open(path).expect("open");
    let mut loader = StoreLoader::new(StoreConfig::default(), START + 1, START + 1).expect("default config is valid");
    let mut piece = vec![0; 1 << 20];
    loop {
        let read = file.read(&mut piece).expect("read");
        if read == 0 {
            break;
        }
        loader.feed(&piece[..read]).expect("intact");
    }
    loader.finish().expect("intact")
}

fn main() {
    let dir = std::env::temp_dir().join(format!("presenced-checkpoint-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let path = dir.join("leases.checkpoint");
    for sessions in [1_000_000usize, 3_000_000] {
        let store = populated(sessions);
        let before_write = resident_bytes().unwrap_or(0);

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
        let during_write = resident_bytes().unwrap_or(0);
        let bytes = std::fs::metadata(&path).expect("metadata").len();
        drop(store);
        // What the dropped store's heap kept would otherwise be reused by the
        // load and hide part of its growth.
        // SAFETY: malloc_trim has no preconditions.
        unsafe { libc::malloc_trim(0) };

        let before_load = resident_bytes().unwrap_or(0);
        let peak_known = reset_peak();
        let started = Instant::now();
        let restored = load(&path);
        let load_took = started.elapsed();
        let after_load = resident_bytes().unwrap_or(0);
        let peak = peak_bytes().filter(|_| peak_known);
        assert_eq!(restored.stats().sessions, sessions);
        // The store itself, without what the load freed and malloc kept.
        // SAFETY: as above.
        unsafe { libc::malloc_trim(0) };
        let loaded = resident_bytes().unwrap_or(0).saturating_sub(before_load);
        let peak = match peak {
            Some(peak) => {
                let growth = peak.saturating_sub(before_load);
                format!("peak +{:.0} MiB = {:.2}x the loaded store", mib(growth), growth as f64 / loaded as f64)
            }
            None => "peak not measured (/proc/self/clear_refs refused)".to_string(),
        };
        println!(
            "checkpoint: {sessions} sessions, {:.0} MiB file: write {:.0} ms (RSS {:.0} -> {:.0} MiB); \
             load {:.0} ms, RSS {:.0} -> {:.0} MiB (the loaded store itself +{:.0} MiB), {peak}",
            mib(bytes),
            write_took.as_secs_f64() * 1e3,
            mib(before_write),
            mib(during_write),
            load_took.as_secs_f64() * 1e3,
            mib(before_load),
            mib(after_load),
            mib(loaded),
        );
        drop(restored);
        // SAFETY: as above.
        unsafe { libc::malloc_trim(0) };
    }
    std::fs::remove_dir_all(&dir).expect("remove scratch directory");
}
