//! How the process asks the allocator to keep its memory.
//!
//! glibc's malloc gives an allocation of 128 KiB or more a mapping of its
//! own, returned to the system whole when it is freed, and raises that
//! threshold to the size of any such mapping freed (up to 32 MiB). Once
//! anything frees a buffer of a few hundred kilobytes, the store's large
//! tables (each shard's hash tables, grown by doubling) come from the heap
//! arenas instead, and every table that grows leaves its old copy there as
//! a hole the arena keeps. The same 3M sessions then took 85 to 118 bytes
//! each from run to run, where they take 79 every time when the threshold
//! stays put (`docs/benchmarks.md`, "What the defaults cost"). So the server
//! pins it. What it costs: a buffer of 128 KiB or more made and dropped on a
//! hot path is a `mmap` and a `munmap` each time, so hot paths keep theirs
//! (the change feed's writer does).

/// The threshold the server pins: glibc's own default.
#[cfg(all(target_os = "linux", target_env = "gnu"))]
const MMAP_THRESHOLD: libc::c_int = 128 << 10;

/// Pins the allocator's mapping threshold (see the module); once per process.
pub(crate) fn pin_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        static PINNED: std::sync::Once = std::sync::Once::new();
        PINNED.call_once(|| {
            // SAFETY: mallopt only sets a parameter of the allocator; any
            // thread may call it at any time.
            if unsafe { libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) } != 1 {
                tracing::warn!("the allocator refused to pin its mapping threshold; memory per session may vary");
            }
        });
    }
}
