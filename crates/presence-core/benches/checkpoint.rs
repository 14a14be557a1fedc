//! Checkpoint write and load: what a restart costs, with 1M and 3M sessions
//! (2.5 per user, ids shaped like the seed's).
//!
//! For each size a store is filled and written to a file (write time). The
//! file is then loaded as the server loads it when it starts, a piece at a
//! time (`data_dir.rs`), in a fresh process: this bench again, with
//! `CHECKPOINT_LOAD` naming the file. A load in the process that built and
//! dropped the first store would meet a heap shaped by that store (glibc
//! raises its mmap threshold as large blocks are freed, after which growing
//! vectors are copied instead of remapped), which no starting server sees.
//! The fresh process reports the load time, the loaded store's resident
//! memory (its growth over the load, after a `malloc_trim`, so without what
//! the load freed and malloc kept) and the load's peak (`VmHWM`). The figure
//! to read is `peak / loaded`: how much more than the store itself the load
//! needs at its worst. Each load runs 3 times (`CHECKPOINT_LOADS`), for its
//! time on a shared machine: the fastest and the median are printed.
//!
//! ```text
//! cargo bench -p presence-core --bench checkpoint
//! CHECKPOINT_SESSIONS=3000000 CHECKPOINT_LOADS=5 cargo bench -p presence-core --bench checkpoint
//! ```
//!
//! Writes to a scratch directory under the system temp dir and removes it.
//! Figures in docs/benchmarks.md.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::Path;
use std::process::Command;
use std::time::Instant;

use presence_core::checkpoint::{CheckpointWriter, StoreLoader};
use presence_core::{Store, StoreConfig};

#[path = "support/mod.rs"]
mod support;

use support::{START, register_sessions, resident_bytes};

/// Set in the process that loads: the checkpoint file to load.
const LOAD: &str = "CHECKPOINT_LOAD";

fn mib(bytes: u64) -> f64 {
    bytes as f64 / 1_048_576.0
}

/// The process's peak resident set, from /proc (Linux).
fn peak_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|line| line.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
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

/// What one load in a fresh process measured.
struct Loaded {
    millis: f64,
    /// Resident growth over the load: right after it, and the store itself (after a trim).
    after: u64,
    store: u64,
    /// Peak resident growth over the process before the load.
    peak: u64,
}

/// The loading process: loads the file, prints what it measured in one line, exits.
fn load_and_report(path: &Path) {
    // Start the peak from here (it is all but here already in a fresh process).
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = resident_bytes().unwrap_or(0);
    let started = Instant::now();
    let store = load(path);
    let millis = started.elapsed().as_secs_f64() * 1e3;
    let after = resident_bytes().unwrap_or(0);
    let peak = peak_bytes().unwrap_or(0);
    // SAFETY: malloc_trim has no preconditions.
    unsafe { libc::malloc_trim(0) };
    let trimmed = resident_bytes().unwrap_or(0);
    println!(
        "{millis} {} {} {} {}",
        after - before,
        trimmed.saturating_sub(before),
        peak.saturating_sub(before),
        store.stats().sessions
    );
    // The process ends here: taking the store apart is the kernel's work.
    std::mem::forget(store);
}

/// Loads `path` in a fresh process (see the module docs).
fn load_in_a_fresh_process(path: &Path, sessions: usize) -> Loaded {
    let exe = std::env::current_exe().expect("this bench's path");
    let output = Command::new(exe).arg("--bench").env(LOAD, path).output().expect("the loading process");
    assert!(output.status.success(), "the loading process failed: {}", String::from_utf8_lossy(&output.stderr));
    let line = String::from_utf8(output.stdout).expect("a line of numbers");
    let fields: Vec<f64> = line.split_whitespace().map(|field| field.parse().expect("a number")).collect();
    assert_eq!(fields[4] as usize, sessions, "every session loaded");
    Loaded { millis: fields[0], after: fields[1] as u64, store: fields[2] as u64, peak: fields[3] as u64 }
}

fn main() {
    if let Some(path) = std::env::var_os(LOAD) {
        return load_and_report(Path::new(&path));
    }
    let sizes: Vec<usize> = match std::env::var("CHECKPOINT_SESSIONS") {
        Ok(sizes) => sizes.split_whitespace().map(|size| size.parse().expect("CHECKPOINT_SESSIONS: numbers")).collect(),
        Err(_) => vec![1_000_000, 3_000_000],
    };
    let loads: usize = std::env::var("CHECKPOINT_LOADS").map_or(3, |loads| loads.parse().expect("CHECKPOINT_LOADS"));
    let dir = std::env::temp_dir().join(format!("presenced-checkpoint-bench-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("scratch directory");
    let path = dir.join("leases.checkpoint");
    for sessions in sizes {
        let before_fill = resident_bytes().unwrap_or(0);
        let store = Store::new(StoreConfig::default(), START).expect("default config is valid");
        register_sessions(&store, 0..sessions);
        let filled = resident_bytes().unwrap_or(0).saturating_sub(before_fill);

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
        let bytes = std::fs::metadata(&path).expect("metadata").len();
        drop(store);

        let mut runs: Vec<Loaded> = (0..loads.max(1)).map(|_| load_in_a_fresh_process(&path, sessions)).collect();
        runs.sort_by(|a, b| a.millis.total_cmp(&b.millis));
        let median = &runs[runs.len() / 2];
        println!(
            "checkpoint: {sessions} sessions, {:.0} MiB file, written in {:.0} ms (the store filled +{:.0} MiB); \
             loaded in a fresh process in {:.0} ms (fastest of {}; median {:.0} ms): +{:.0} MiB right after, \
             the store itself +{:.0} MiB, peak +{:.0} MiB = {:.2}x the loaded store",
            mib(bytes),
            write_took.as_secs_f64() * 1e3,
            mib(filled),
            runs[0].millis,
            runs.len(),
            median.millis,
            mib(median.after),
            mib(median.store),
            mib(median.peak),
            median.peak as f64 / median.store as f64,
        );
    }
    std::fs::remove_dir_all(&dir).expect("remove scratch directory");
}
