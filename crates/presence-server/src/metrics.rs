//! The service's metrics (O1), through the `metrics` facade.
//!
//! Handles are made once, at start, so the hot paths only add to atomics; the
//! binary decides where they go (a Prometheus endpoint), and without a recorder
//! they cost next to nothing. Counts the store keeps itself (sessions, online
//! users, per-shard operations) are copied into gauges once a second rather
//! than counted on every request.
//!
//! The figures the service reports about itself (`Stats`, O4) are read here
//! too, never from the exporter's text: a counter or gauge that `Stats`
//! reports is a [`Tally`] or [`Level`], the `metrics` handle with an atomic
//! beside it that every clone shares, so each figure is counted in one place
//! and read back from there, with or without a recorder installed.

use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, counter, gauge, histogram};
use presence_core::{ChangeKind, PresenceChange, RoomChange, RoomChangeKind, RoomEventBody, State, Store};
use tokio_util::sync::CancellationToken;

/// Every metric name, for documentation and for the exporter's bucket settings.
pub mod names {
    /// Leases held (gauge).
    pub const SESSIONS: &str = "presenced_sessions";
    /// Users ONLINE (gauge).
    pub const ONLINE_USERS: &str = "presenced_online_users";
    /// Renewals by `result`: ok, throttled, not_found, stale_generation, invalid, shed (counter).
    pub const RENEWALS: &str = "presenced_renewals_total";
    /// Time to apply a renewal, or a Leases batch, in seconds (histogram).
    pub const RENEWAL_SECONDS: &str = "presenced_renewal_duration_seconds";
    /// Registers by `result`: ok, invalid, and of those, reconnects (counter).
    pub const REGISTERS: &str = "presenced_registers_total";
    /// Registers that replaced a live lease of the same session (counter).
    pub const RECONNECTS: &str = "presenced_reconnects_total";
    /// Unregisters by `outcome` (counter).
    pub const UNREGISTERS: &str = "presenced_unregisters_total";
    /// Users flipped OFFLINE by lease expiry (counter).
    pub const EXPIRIES: &str = "presenced_expiries_total";
    /// From a lease's deadline to the publication of the OFFLINE it caused, in seconds (histogram).
    pub const EXPIRY_LAG_SECONDS: &str = "presenced_expiry_lag_seconds";
    /// ONLINE/OFFLINE flips by the `state` flipped to (counter). Nothing else.
    pub const FLIPS: &str = "presenced_flips_total";
    /// Published changes of a user's status, its state unchanged (counter).
    pub const STATUS_CHANGES: &str = "presenced_status_changes_total";
    /// Published changes of a user's derived availability (A2), its state unchanged (counter).
    pub const AVAILABILITY_CHANGES: &str = "presenced_availability_changes_total";
    /// Operations applied to each `shard` (gauge of a running count).
    pub const SHARD_OPERATIONS: &str = "presenced_shard_operations";
    /// Lease batches waiting for a worker (gauge).
    pub const QUEUE_DEPTH: &str = "presenced_lease_queue_depth";
    /// Renewals shed under overload (counter).
    pub const SHED: &str = "presenced_renewals_shed_total";
    /// Changes delivered into viewers' mailboxes (counter).
    pub const FANNED_OUT: &str = "presenced_events_fanned_out_total";
    /// Updates sent on Watch streams (counter).
    pub const WATCH_UPDATES: &str = "presenced_watch_updates_total";
    /// Open Watch streams (gauge).
    pub const VIEWERS: &str = "presenced_viewers";
    /// Resync snapshots sent to viewers that fell behind (counter).
    pub const RESYNCS: &str = "presenced_resyncs_total";
    /// Open client connections (gauge).
    pub const CONNECTIONS: &str = "presenced_connections";
    /// Connections refused at `max_connections` or at a full hand-off queue (counter).
    pub const CONNECTIONS_REFUSED: &str = "presenced_connections_refused_total";
    /// Connections closed for not completing the HTTP/2 handshake in time (counter).
    pub const HANDSHAKE_TIMEOUTS: &str = "presenced_handshake_timeouts_total";
    /// TLS handshakes that failed, by `reason` (`plaintext`: a client spoke
    /// plaintext to the TLS port; `handshake`: rustls refused it, for a
    /// certificate, a protocol version or a broken record).
    pub const TLS_HANDSHAKE_FAILURES: &str = "presenced_tls_handshake_failures_total";
    /// TLS handshakes completed, by `resumed` (`true` when the client resumed a session).
    pub const TLS_HANDSHAKES: &str = "presenced_tls_handshakes_total";
    /// Reloads of TLS material from its files, by `material` (`server`,
    /// `peer`, `etcd`) and `result` (`changed`, `failed`).
    pub const TLS_RELOADS: &str = "presenced_tls_reloads_total";
    /// Seconds until a certificate in use expires (negative once it has), by
    /// `certificate` (`service`, `peer`, `peer-client`, `etcd-client`).
    pub const TLS_CERTIFICATE_EXPIRY_SECONDS: &str = "presenced_tls_certificate_expiry_seconds";
    /// Reloads of the credentials file (and, with `--viewer-jwks`, of the
    /// viewer keys), by `material` (`credentials`, `viewer-keys`) and
    /// `result` (`changed`, `failed`).
    pub const CREDENTIAL_RELOADS: &str = "presenced_credential_reloads_total";
    /// Accepted joins of a session to a room (counter).
    pub const ROOM_JOINS: &str = "presenced_room_joins_total";
    /// Accepted signals: set, extended or cleared (counter).
    pub const SIGNALS: &str = "presenced_signals_total";
    /// Room changes published by the store, by `kind`: joined, left, updated, sessions, signals (counter).
    pub const ROOM_CHANGES: &str = "presenced_room_changes_total";
    /// Room changes delivered into room watchers' mailboxes (counter).
    pub const ROOM_FANNED_OUT: &str = "presenced_room_events_fanned_out_total";
    /// Count frames sent to count-mode room watchers (counter).
    pub const ROOM_COUNT_FRAMES: &str = "presenced_room_count_frames_total";
    /// Rooms held: with a member, or with non-default access (gauge).
    pub const ROOMS: &str = "presenced_rooms";
    /// Users in rooms, once per room (gauge).
    pub const ROOM_MEMBERSHIPS: &str = "presenced_room_memberships";
    /// Open WatchRoom streams (gauge).
    pub const ROOM_WATCHERS: &str = "presenced_room_watchers";
    /// Open WatchRoomCounts streams (gauge).
    pub const ROOM_COUNT_STREAMS: &str = "presenced_room_count_streams";
    /// Relays this node keeps open at other nodes, one per node whose users its viewers watch (gauge).
    pub const RELAY_LINKS: &str = "presenced_relay_links";
    /// Other nodes' users this node relays to its viewers, each once whatever the number of viewers (gauge).
    pub const RELAYED_USERS: &str = "presenced_relayed_users";
    /// Relays other nodes keep open here (gauge).
    pub const RELAY_SESSIONS: &str = "presenced_relay_sessions";
    /// Messages sent on WatchRoomCounts streams (counter).
    pub const ROOM_COUNT_MESSAGES: &str = "presenced_room_count_messages_total";
    /// Rooms' counts read again for WatchRoomCounts streams: here because
    /// something touched them, or asked of their owners (counter).
    pub const ROOMS_RECOUNTED: &str = "presenced_rooms_recounted_total";
    /// Flips to OFFLINE that flap damping suppressed: a new lease came within the grace window (gauge of a running count).
    pub const SUPPRESSED_FLAPS: &str = "presenced_suppressed_flaps";
    /// Times the process was found not to have run for over a second: stopped, paused or starved (counter).
    pub const CLOCK_STALLS: &str = "presenced_clock_stalls_total";
    /// Milliseconds of those stalls left out of store time, so not counted against leases (counter).
    pub const CLOCK_STALLED_MS: &str = "presenced_clock_stalled_ms_total";
    /// Periodic checkpoints by `result`: ok, failed (a failed one is retried at the next interval) (counter).
    pub const CHECKPOINTS: &str = "presenced_checkpoints_total";
    /// From an owner taking its users' changes to their follower applying them, in seconds (histogram, C4).
    pub const FOLLOWER_LAG_SECONDS: &str = "presenced_follower_lag_seconds";
    /// How long a move's slots were frozen at this node, the node handing them over: from refusing
    /// them to etcd giving them to the target, in seconds (histogram, C7).
    pub const MOVE_FREEZE_SECONDS: &str = "presenced_move_freeze_seconds";
    /// Freezes given up past their bound: the slots were answered here again and stayed (counter, C7).
    pub const MOVE_FREEZES_ABORTED: &str = "presenced_move_freezes_aborted_total";
    /// Requests for a frozen slot that waited the freeze out at this node instead of being refused (counter, C7).
    pub const REQUESTS_HELD: &str = "presenced_requests_held_total";
    /// How long those requests waited, in seconds (histogram, C7).
    pub const REQUEST_HOLD_SECONDS: &str = "presenced_request_hold_seconds";
    /// Users taken over from this node's copy when their owner died (counter, C4).
    pub const TAKEN_OVER_USERS: &str = "presenced_taken_over_users_total";
    /// Group ledger entries newer than this node's, taken in from other nodes, by `via`: sent (another node's write), catch_up (counter).
    pub const GROUP_ENTRIES_MERGED: &str = "presenced_group_entries_merged_total";
    /// Group changes this node wrote that another node did not take when sent; the catch-up brings them there (counter).
    pub const GROUP_SENDS_MISSED: &str = "presenced_group_sends_missed_total";
    /// Room facts this node's users made that did not reach their room's owner: a full queue, or no owner yet; the owner is sent a scan instead (counter, C1).
    pub const ROOM_FACTS_DROPPED: &str = "presenced_room_facts_dropped_total";
    /// Changes written to the change feed, gaps included (counter, F1).
    pub const FEED_ENTRIES: &str = "presenced_feed_entries_total";
    /// Gaps the change feed marked, by `reason`: restart, overflow, write_failed (counter, F2).
    pub const FEED_GAPS: &str = "presenced_feed_gaps_total";
    /// Writing and syncing one batch of the change feed, in seconds (histogram, F2).
    pub const FEED_WRITE_SECONDS: &str = "presenced_feed_write_duration_seconds";
    /// Bytes the change feed holds, on disk or in memory (gauge).
    pub const FEED_BYTES: &str = "presenced_feed_bytes";
    /// Open Changes streams (gauge).
    pub const FEED_STREAMS: &str = "presenced_feed_streams";
    /// Batches of the change feed a webhook's receiver answered with a 2xx, by `webhook` (counter, F4).
    pub const WEBHOOK_BATCHES: &str = "presenced_webhook_batches_total";
    /// Events in those batches, by `webhook` (counter, F4).
    pub const WEBHOOK_EVENTS: &str = "presenced_webhook_events_total";
    /// Attempts to deliver a batch that failed, by `webhook` and `reason`:
    /// status (an answer other than 2xx), timeout, connection (counter, F4).
    pub const WEBHOOK_FAILURES: &str = "presenced_webhook_failures_total";
    /// How old the oldest change a webhook has not delivered yet is, in
    /// seconds; 0 when it has delivered everything it read, by `webhook` (gauge, F4).
    pub const WEBHOOK_LAG_SECONDS: &str = "presenced_webhook_lag_seconds";
    /// Gaps a webhook sent because retention removed changes it had not delivered, by `webhook` (counter, F4).
    pub const WEBHOOK_GAPS: &str = "presenced_webhook_gaps_total";
}

/// Why an attempt to deliver a webhook batch failed, as counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum WebhookFailure {
    /// The receiver answered, with a status other than 2xx.
    Status,
    /// No answer within the attempt's timeout.
    Timeout,
    /// No connection, or it broke.
    Connection,
}

/// One webhook's metrics (F4), labelled with what the logs call it.
#[derive(Debug, Clone)]
pub(crate) struct WebhookMetrics {
    pub(crate) batches: Counter,
    pub(crate) events: Counter,
    failures: [Counter; 3],
    pub(crate) lag_seconds: Gauge,
    pub(crate) gaps: Counter,
}

impl WebhookMetrics {
    pub(crate) fn new(webhook: &str) -> Self {
        let label = webhook.to_owned();
        let failure =
            |reason: &'static str| counter!(names::WEBHOOK_FAILURES, "webhook" => label.clone(), "reason" => reason);
        WebhookMetrics {
            batches: counter!(names::WEBHOOK_BATCHES, "webhook" => label.clone()),
            events: counter!(names::WEBHOOK_EVENTS, "webhook" => label.clone()),
            failures: [failure("status"), failure("timeout"), failure("connection")],
            lag_seconds: gauge!(names::WEBHOOK_LAG_SECONDS, "webhook" => label.clone()),
            gaps: counter!(names::WEBHOOK_GAPS, "webhook" => label.clone()),
        }
    }

    pub(crate) fn failed(&self, why: WebhookFailure) {
        self.failures[why as usize].increment(1);
    }
}

/// Counts a periodic checkpoint, written or not (B3).
pub(crate) fn checkpoint_written(ok: bool) {
    counter!(names::CHECKPOINTS, "result" => if ok { "ok" } else { "failed" }).increment(1);
}

/// Buckets for the latency histograms, in seconds: 50 µs to 5 s.
pub const LATENCY_BUCKETS: &[f64] =
    &[0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0];

/// Buckets for a move's freeze and the requests held through it, in
/// seconds: 1 ms to 1 s, fine around their bounds (20 ms, 250 ms).
pub const MOVE_BUCKETS: &[f64] =
    &[0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.25, 0.3, 0.5, 1.0];

/// The results a renewal can have, as counted.
#[derive(Debug, Clone, Copy)]
pub(crate) enum RenewResult {
    Ok,
    Throttled,
    NotFound,
    StaleGeneration,
    Invalid,
    Shed,
    /// Refused by a cluster node that does not own the user (C2).
    NotOwner,
}

impl RenewResult {
    /// How many results there are.
    pub(crate) const COUNT: usize = 7;

    /// Every result, in discriminant order.
    pub(crate) const ALL: [RenewResult; Self::COUNT] = [
        RenewResult::Ok,
        RenewResult::Throttled,
        RenewResult::NotFound,
        RenewResult::StaleGeneration,
        RenewResult::Invalid,
        RenewResult::Shed,
        RenewResult::NotOwner,
    ];
}

/// A counter the service also reads back (`Stats`): the exported counter and
/// its running total, shared by every clone of the handle.
#[derive(Debug, Clone)]
pub(crate) struct Tally {
    counter: Counter,
    total: Arc<AtomicU64>,
}

impl Tally {
    fn new(counter: Counter) -> Self {
        Tally { counter, total: Arc::default() }
    }

    pub(crate) fn increment(&self, count: u64) {
        self.counter.increment(count);
        self.total.fetch_add(count, Ordering::Relaxed);
    }

    /// The total since the handle was made.
    pub(crate) fn total(&self) -> u64 {
        self.total.load(Ordering::Relaxed)
    }
}

/// A gauge the service also reads back (`Stats`), moved only by [`OpenGauge`].
#[derive(Debug, Clone)]
pub(crate) struct Level {
    gauge: Gauge,
    value: Arc<AtomicI64>,
}

impl Level {
    fn new(gauge: Gauge) -> Self {
        Level { gauge, value: Arc::default() }
    }

    pub(crate) fn add(&self, delta: i64) {
        if delta >= 0 {
            self.gauge.increment(delta as f64);
        } else {
            self.gauge.decrement(-delta as f64);
        }
        self.value.fetch_add(delta, Ordering::Relaxed);
    }

    /// The current value (never below 0).
    pub(crate) fn value(&self) -> u64 {
        u64::try_from(self.value.load(Ordering::Relaxed)).unwrap_or(0)
    }
}

/// The expiry lag histogram: the exported one, and the same buckets
/// ([`LATENCY_BUCKETS`]) counted here for `Stats`.
#[derive(Debug, Clone)]
struct LagHistogram {
    histogram: Histogram,
    counts: Arc<LagCounts>,
}

/// Observations per bucket (not cumulative; one more than there are bounds,
/// for those above every bound) and their sum.
#[derive(Debug)]
struct LagCounts {
    buckets: [AtomicU64; LATENCY_BUCKETS.len() + 1],
    sum_ms: AtomicU64,
}

impl LagHistogram {
    fn new(histogram: Histogram) -> Self {
        let counts = LagCounts { buckets: std::array::from_fn(|_| AtomicU64::new(0)), sum_ms: AtomicU64::new(0) };
        LagHistogram { histogram, counts: Arc::new(counts) }
    }

    fn record_ms(&self, lag_ms: u64) {
        let seconds = lag_ms as f64 / 1_000.0;
        self.histogram.record(seconds);
        // Prometheus' `le`: an observation on a bound counts in that bound's bucket.
        let bucket = LATENCY_BUCKETS.partition_point(|&bound| bound < seconds);
        self.counts.buckets[bucket].fetch_add(1, Ordering::Relaxed);
        self.counts.sum_ms.fetch_add(lag_ms, Ordering::Relaxed);
    }
}

/// The expiry lag histogram as read: counts per bucket of [`LATENCY_BUCKETS`]
/// (the last for above every bound) and the sum of the observations.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct LagReading {
    pub(crate) counts: Vec<u64>,
    pub(crate) sum_ms: u64,
}

/// The figures `Stats` reports from the metrics: totals since the start and
/// streams open now.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Totals {
    /// Renewals answered, whatever their result.
    pub(crate) renewals: u64,
    pub(crate) renewals_shed: u64,
    /// Registers, accepted or refused.
    pub(crate) registers: u64,
    /// Unregisters, whatever their outcome.
    pub(crate) unregisters: u64,
    pub(crate) expiries: u64,
    pub(crate) expiry_lag: LagReading,
    pub(crate) viewers: u64,
    pub(crate) room_watchers: u64,
    pub(crate) room_count_streams: u64,
    pub(crate) relay_links: u64,
    pub(crate) relayed_users: u64,
    pub(crate) relay_sessions: u64,
}

/// Handles to every hot-path metric.
#[derive(Debug, Clone)]
pub(crate) struct Metrics {
    renewals: [Tally; RenewResult::COUNT],
    pub(crate) renewal_seconds: Histogram,
    pub(crate) requests_held: Counter,
    pub(crate) move_freeze_seconds: Histogram,
    pub(crate) move_freezes_aborted: Counter,
    pub(crate) request_hold_seconds: Histogram,
    pub(crate) registers_ok: Tally,
    pub(crate) registers_invalid: Tally,
    pub(crate) reconnects: Counter,
    pub(crate) unregisters_removed: Tally,
    pub(crate) unregisters_lingering: Tally,
    pub(crate) unregisters_stale: Tally,
    pub(crate) unregisters_not_found: Tally,
    expiries: Tally,
    expiry_lag: LagHistogram,
    flips_online: Counter,
    flips_offline: Counter,
    status_changes: Counter,
    availability_changes: Counter,
    pub(crate) queue_depth: Gauge,
    pub(crate) shed: Tally,
    pub(crate) fanned_out: Counter,
    pub(crate) watch_updates: Counter,
    pub(crate) viewers: Level,
    pub(crate) resyncs: Counter,
    pub(crate) room_joins: Counter,
    pub(crate) signals: Counter,
    room_changes: [Counter; 5],
    pub(crate) room_fanned_out: Counter,
    pub(crate) room_count_frames: Counter,
    pub(crate) room_watchers: Level,
    pub(crate) room_count_streams: Level,
    pub(crate) relay_links: Level,
    pub(crate) relayed_users: Level,
    pub(crate) relay_sessions: Level,
    pub(crate) room_count_messages: Counter,
    pub(crate) rooms_recounted: Counter,
}

impl Metrics {
    pub(crate) fn new() -> Self {
        let renewal = |result: &'static str| Tally::new(counter!(names::RENEWALS, "result" => result));
        let unregister = |outcome: &'static str| Tally::new(counter!(names::UNREGISTERS, "outcome" => outcome));
        Metrics {
            renewals: [
                renewal("ok"),
                renewal("throttled"),
                renewal("not_found"),
                renewal("stale_generation"),
                renewal("invalid"),
                renewal("shed"),
                renewal("not_owner"),
            ],
            renewal_seconds: histogram!(names::RENEWAL_SECONDS),
            requests_held: counter!(names::REQUESTS_HELD),
            move_freeze_seconds: histogram!(names::MOVE_FREEZE_SECONDS),
            move_freezes_aborted: counter!(names::MOVE_FREEZES_ABORTED),
            request_hold_seconds: histogram!(names::REQUEST_HOLD_SECONDS),
            registers_ok: Tally::new(counter!(names::REGISTERS, "result" => "ok")),
            registers_invalid: Tally::new(counter!(names::REGISTERS, "result" => "invalid")),
            reconnects: counter!(names::RECONNECTS),
            unregisters_removed: unregister("removed"),
            unregisters_lingering: unregister("lingering"),
            unregisters_stale: unregister("stale_generation"),
            unregisters_not_found: unregister("not_found"),
            expiries: Tally::new(counter!(names::EXPIRIES)),
            expiry_lag: LagHistogram::new(histogram!(names::EXPIRY_LAG_SECONDS)),
            flips_online: counter!(names::FLIPS, "state" => "online"),
            flips_offline: counter!(names::FLIPS, "state" => "offline"),
            status_changes: counter!(names::STATUS_CHANGES),
            availability_changes: counter!(names::AVAILABILITY_CHANGES),
            queue_depth: gauge!(names::QUEUE_DEPTH),
            shed: Tally::new(counter!(names::SHED)),
            fanned_out: counter!(names::FANNED_OUT),
            watch_updates: counter!(names::WATCH_UPDATES),
            viewers: Level::new(gauge!(names::VIEWERS)),
            resyncs: counter!(names::RESYNCS),
            room_joins: counter!(names::ROOM_JOINS),
            signals: counter!(names::SIGNALS),
            room_changes: ["joined", "left", "updated", "sessions", "signals"]
                .map(|kind| counter!(names::ROOM_CHANGES, "kind" => kind)),
            room_fanned_out: counter!(names::ROOM_FANNED_OUT),
            room_count_frames: counter!(names::ROOM_COUNT_FRAMES),
            room_watchers: Level::new(gauge!(names::ROOM_WATCHERS)),
            room_count_streams: Level::new(gauge!(names::ROOM_COUNT_STREAMS)),
            relay_links: Level::new(gauge!(names::RELAY_LINKS)),
            relayed_users: Level::new(gauge!(names::RELAYED_USERS)),
            relay_sessions: Level::new(gauge!(names::RELAY_SESSIONS)),
            room_count_messages: counter!(names::ROOM_COUNT_MESSAGES),
            rooms_recounted: counter!(names::ROOMS_RECOUNTED),
        }
    }

    /// Counts a room change the store published.
    pub(crate) fn room_change(&self, change: &RoomChange) {
        let index = match &change.body {
            RoomEventBody::Member { kind: RoomChangeKind::Joined, .. } => 0,
            RoomEventBody::Member { kind: RoomChangeKind::Left, .. } => 1,
            RoomEventBody::Member { kind: RoomChangeKind::Updated, .. } => 2,
            RoomEventBody::Sessions => 3,
            RoomEventBody::Signals { .. } => 4,
        };
        self.room_changes[index].increment(1);
    }

    pub(crate) fn renewals(&self, result: RenewResult, count: u64) {
        if count > 0 {
            self.renewals[result as usize].increment(count);
        }
    }

    /// Counts a published change, a flip as a flip, a status change and an
    /// availability change each as one; `now` is the store time of publication.
    pub(crate) fn change(&self, change: &PresenceChange, now: u64) {
        match (change.kind, change.presence.state) {
            (ChangeKind::Flip, State::Online) => self.flips_online.increment(1),
            (ChangeKind::Flip, State::Offline) => self.flips_offline.increment(1),
            (ChangeKind::Status, _) => self.status_changes.increment(1),
            (ChangeKind::Activity, _) => self.availability_changes.increment(1),
        }
        if let Some(deadline) = change.deadline {
            self.expiries.increment(1);
            self.expiry_lag.record_ms(now.saturating_sub(deadline));
        }
    }

    /// What `Stats` reports of the counts kept here.
    pub(crate) fn totals(&self) -> Totals {
        let lag = &self.expiry_lag.counts;
        let unregisters = [
            &self.unregisters_removed,
            &self.unregisters_lingering,
            &self.unregisters_stale,
            &self.unregisters_not_found,
        ];
        Totals {
            renewals: self.renewals.iter().map(Tally::total).sum(),
            renewals_shed: self.shed.total(),
            registers: self.registers_ok.total() + self.registers_invalid.total(),
            unregisters: unregisters.into_iter().map(Tally::total).sum(),
            expiries: self.expiries.total(),
            expiry_lag: LagReading {
                counts: lag.buckets.iter().map(|count| count.load(Ordering::Relaxed)).collect(),
                sum_ms: lag.sum_ms.load(Ordering::Relaxed),
            },
            viewers: self.viewers.value(),
            room_watchers: self.room_watchers.value(),
            room_count_streams: self.room_count_streams.value(),
            relay_links: self.relay_links.value(),
            relayed_users: self.relayed_users.value(),
            relay_sessions: self.relay_sessions.value(),
        }
    }
}

/// Counts something open (a stream) in a gauge for as long as it lives, so
/// that a task dropped at runtime shutdown is counted out too.
pub(crate) struct OpenGauge(Level);

impl OpenGauge {
    pub(crate) fn open(level: &Level) -> Self {
        level.add(1);
        OpenGauge(level.clone())
    }
}

impl Drop for OpenGauge {
    fn drop(&mut self) {
        self.0.add(-1);
    }
}

/// Copies the store's own counts into gauges once a second until `stop`.
pub(crate) async fn export_store_counts(store: Arc<Store>, stop: CancellationToken) {
    let sessions = gauge!(names::SESSIONS);
    let online = gauge!(names::ONLINE_USERS);
    let suppressed_flaps = gauge!(names::SUPPRESSED_FLAPS);
    let (rooms, memberships) = (gauge!(names::ROOMS), gauge!(names::ROOM_MEMBERSHIPS));
    let shards: Vec<Gauge> =
        (0..store.config().shards).map(|shard| gauge!(names::SHARD_OPERATIONS, "shard" => shard.to_string())).collect();
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = stop.cancelled() => return,
        }
        let stats = store.stats();
        sessions.set(stats.sessions as f64);
        online.set(stats.online_users as f64);
        suppressed_flaps.set(stats.suppressed_flaps as f64);
        rooms.set(stats.rooms as f64);
        memberships.set(stats.room_memberships as f64);
        for (gauge, operations) in shards.iter().zip(store.shard_operations()) {
            gauge.set(operations as f64);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// O4: the expiry lag read back for `Stats` is counted in the exported
    /// histogram's buckets, an observation on a bound in that bound's bucket.
    #[test]
    fn o4_the_expiry_lag_read_back_uses_the_exported_buckets() {
        let metrics = Metrics::new();
        // 0 ms and 1 ms (a bound) fall in the buckets of 50 µs and 1 ms; 7 s above every bound.
        for lag_ms in [0, 1, 7_000] {
            metrics.expiry_lag.record_ms(lag_ms);
        }
        let reading = metrics.totals().expiry_lag;
        assert_eq!(reading.counts.len(), LATENCY_BUCKETS.len() + 1);
        let at = |bound: f64| LATENCY_BUCKETS.iter().position(|&b| b == bound).unwrap();
        let mut expected = vec![0; LATENCY_BUCKETS.len() + 1];
        for bucket in [at(0.00005), at(0.001), LATENCY_BUCKETS.len()] {
            expected[bucket] += 1;
        }
        assert_eq!(reading, LagReading { counts: expected, sum_ms: 7_001 });
    }

    /// O4: every clone of the handles counts into the same totals, as the
    /// service's clones of them do.
    #[test]
    fn o4_totals_are_shared_by_every_clone_of_the_handles() {
        let metrics = Metrics::new();
        let clone = metrics.clone();
        clone.renewals(RenewResult::Ok, 3);
        clone.renewals(RenewResult::Shed, 2);
        clone.shed.increment(2);
        clone.registers_invalid.increment(1);
        clone.unregisters_stale.increment(1);
        let watching = OpenGauge::open(&clone.viewers);
        let totals = metrics.totals();
        assert_eq!(
            (totals.renewals, totals.renewals_shed, totals.registers, totals.unregisters, totals.viewers),
            (5, 2, 1, 1, 1)
        );
        drop(watching);
        assert_eq!(metrics.totals().viewers, 0);
    }
}
