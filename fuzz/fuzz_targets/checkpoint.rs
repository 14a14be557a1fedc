//! A checkpoint file, loaded as the server loads one: a piece at a time into
//! a new store, which is then driven through expiry. The first byte's low bit
//! makes the target rewrite the last four bytes as the CRC-32 of the rest, so
//! that altered files also reach the end of the load; the next four bytes are
//! the piece sizes, used in turn (1 byte to 8 KiB); the rest is the file.
#![no_main]

use presence_core::checkpoint::StoreLoader;
use presence_core::{Changes, StoreConfig};

/// The store's clock at the load: after the seeds' leases were written.
const NOW: u64 = 1_700_000_010_000;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    let Some((header, file)) = data.split_at_checked(5) else { return };
    let mut file = file.to_vec();
    if header[0] & 1 == 1 && file.len() >= 4 {
        let end = file.len() - 4;
        let (body, crc) = file.split_at_mut(end);
        crc.copy_from_slice(&crc32fast::hash(body).to_le_bytes());
    }
    let sizes: Vec<usize> = header[1..].iter().map(|&b| 1 + usize::from(b) * usize::from(b) / 8).collect();
    let config = StoreConfig { shards: 4, ..StoreConfig::default() };
    let mut loader = StoreLoader::new(config, NOW, NOW + 30_000).expect("a valid config");
    let mut rest = &file[..];
    for size in sizes.iter().cycle() {
        if rest.is_empty() {
            break;
        }
        let (piece, after) = rest.split_at(rest.len().min(*size));
        if loader.feed(piece).is_err() {
            return;
        }
        rest = after;
    }
    let Ok(store) = loader.finish() else { return };
    // A restored store must work as any other: stats, then every deadline.
    let stats = store.stats();
    let mut changes = Changes::default();
    // The server's clock moves on from the load by at most weeks, never to a
    // deadline the file made up; each step expires everything due in batches.
    for now in [NOW, NOW + 30_000, NOW + 3_600_000, NOW + 31 * 86_400_000] {
        for _ in 0..64 {
            if !store.expire(now, 1_024, &mut changes) {
                break;
            }
        }
    }
    assert!(store.stats().sessions <= stats.sessions, "expiry never adds sessions");
});
