//! Criterion suites for the lease core, sized like etcd's lease benchmarks:
//! stores holding 1k, 100k and 1M sessions (two per user, ids shaped like
//! `sess_` plus 12 characters). Run with `cargo bench --bench lease_core`;
//! results and the machine they came from are in docs/benchmarks.md.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use presence_core::{Changes, Registration, Renewal, Store, StoreConfig, Tick};

const SIZES: [usize; 3] = [1_000, 100_000, 1_000_000];
const START: Tick = 1_700_000_000_000;
const TTL_MS: u32 = 45_000;

fn user_id(session: usize) -> String {
    format!("user_{:08}", session / 2)
}

fn session_id(session: usize) -> String {
    format!("sess_{session:012}")
}

struct Loaded {
    store: Store,
    users: Vec<String>,
    sessions: Vec<String>,
    generations: Vec<u64>,
}

/// A store holding `size` sessions registered at `START`.
fn loaded(size: usize) -> Loaded {
    // No throttle: every renewal here is a real write (L7 would acknowledge most of them without one).
    let store = Store::new(StoreConfig { min_renew_interval_ms: 0, ..StoreConfig::default() }, START).unwrap();
    let users: Vec<String> = (0..size).map(user_id).collect();
    let sessions: Vec<String> = (0..size).map(session_id).collect();
    let mut changes = Changes::default();
    let generations = (0..size)
        .map(|i| {
            let registration = Registration {
                user_id: &users[i],
                session_id: &sessions[i],
                gateway_id: "gw-1",
                ttl_ms: TTL_MS,
                metadata: &[],
            };
            changes.users.clear();
            store.register(START, &registration, &mut changes).unwrap().generation
        })
        .collect();
    Loaded { store, users, sessions, generations }
}

fn sample_size(size: usize) -> usize {
    if size >= 1_000_000 { 10 } else { 30 }
}

fn register(c: &mut Criterion) {
    let mut group = c.benchmark_group("register_new_session");
    group.throughput(Throughput::Elements(1));
    for size in SIZES {
        group.sample_size(sample_size(size));
        let loaded = loaded(size);
        let mut next = size;
        let mut changes = Changes::default();
        group.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter_custom(|iters| {
                let ids: Vec<(String, String)> =
                    (next..next + iters as usize).map(|i| (user_id(i), session_id(i))).collect();
                next += iters as usize;
                let start = Instant::now();
                for (user, session) in &ids {
                    let registration = Registration {
                        user_id: user,
                        session_id: session,
                        gateway_id: "gw-1",
                        ttl_ms: TTL_MS,
                        metadata: &[],
                    };
                    changes.users.clear();
                    black_box(loaded.store.register(START + 1, &registration, &mut changes).unwrap());
                }
                start.elapsed()
            })
        });
    }
    group.finish();
}

fn renew(c: &mut Criterion) {
    renewals(c, "renew", 1);
}

/// Renewals per `renew_batch` call, as a gateway's Leases batch would carry.
const BATCH: usize = 1_000;

fn renew_batch(c: &mut Criterion) {
    renewals(c, "renew_batch_of_1000", BATCH);
}

/// Renewals in an order unrelated to the store's layout (a large odd stride):
/// one `renew` per iteration with `batch` 1, else one `renew_batch` of `batch`.
fn renewals(c: &mut Criterion, name: &str, batch: usize) {
    let mut group = c.benchmark_group(name);
    group.throughput(Throughput::Elements(batch as u64));
    for size in SIZES {
        group.sample_size(sample_size(size));
        let loaded = loaded(size);
        let mut cursor = 0usize;
        let mut next = || {
            cursor = (cursor + 7_919) % size;
            Renewal {
                user_id: &loaded.users[cursor],
                session_id: &loaded.sessions[cursor],
                generation: loaded.generations[cursor],
                ttl_ms: TTL_MS,
            }
        };
        let mut changes = Changes::default();
        group.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter(|| {
                if batch == 1 {
                    let Renewal { user_id, session_id, generation, ttl_ms } = next();
                    let renewed =
                        loaded.store.renew(START + 1_000, user_id, session_id, generation, ttl_ms, &mut changes);
                    black_box(renewed.unwrap());
                } else {
                    let renewals: Vec<Renewal<'_>> = (0..batch).map(|_| next()).collect();
                    black_box(loaded.store.renew_batch(START + 1_000, &renewals, &mut changes));
                }
            })
        });
    }
    group.finish();
}

fn unregister(c: &mut Criterion) {
    let mut group = c.benchmark_group("unregister");
    group.throughput(Throughput::Elements(1));
    for size in SIZES {
        group.sample_size(sample_size(size));
        let mut loaded = loaded(size);
        let mut cursor = 0usize;
        let mut changes = Changes::default();
        group.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter_custom(|iters| {
                let mut timed = Duration::ZERO;
                let mut left = iters as usize;
                while left > 0 {
                    // Unregister a chunk (timed), then register it again (untimed) so the store keeps its size.
                    let chunk = left.min(size - cursor).min(10_000);
                    let start = Instant::now();
                    for i in cursor..cursor + chunk {
                        black_box(
                            loaded
                                .store
                                .unregister(
                                    START + 2_000,
                                    &loaded.users[i],
                                    &loaded.sessions[i],
                                    loaded.generations[i],
                                    0,
                                    &mut changes,
                                )
                                .unwrap(),
                        );
                    }
                    timed += start.elapsed();
                    for i in cursor..cursor + chunk {
                        let registration = Registration {
                            user_id: &loaded.users[i],
                            session_id: &loaded.sessions[i],
                            gateway_id: "gw-1",
                            ttl_ms: TTL_MS,
                            metadata: &[],
                        };
                        loaded.generations[i] =
                            loaded.store.register(START + 2_000, &registration, &mut changes).unwrap().generation;
                    }
                    changes.users.clear();
                    cursor = (cursor + chunk) % size;
                    left -= chunk;
                }
                timed
            })
        });
    }
    group.finish();
}

fn expire_due_batch(c: &mut Criterion) {
    let mut group = c.benchmark_group("expire_due_batch");
    for size in SIZES {
        group.sample_size(10);
        group.throughput(Throughput::Elements(size as u64));
        group.bench_function(BenchmarkId::from_parameter(size), |b| {
            b.iter_batched(
                || loaded(size).store,
                |store| {
                    // Every lease ran out at the same millisecond: drain them as the server's driver does.
                    let mut changes = Changes { users: Vec::with_capacity(size / 2), ..Changes::default() };
                    while store.expire(START + u64::from(TTL_MS), 1_024, &mut changes) {}
                    assert_eq!(changes.users.len(), size / 2);
                    store
                },
                BatchSize::PerIteration,
            )
        });
    }
    group.finish();
}

criterion_group!(benches, register, renew, renew_batch, unregister, expire_due_batch);
criterion_main!(benches);
