//! Disk faults: the data directory on a [`SmallDisk`] filled to `ENOSPC`,
//! or on a [`SlowDisk`] whose every write, fsync and rename is slow.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime};

use presence_faults::{SlowDisk, SmallDisk};

use crate::checker::{Allowances, Analysis, Expectation, Violation};
use crate::faults::{Fault, FaultCx, Kill9, Plan, no_change_in_window};
use crate::history::Record;
use crate::netfaults::renew_quantile;
use crate::server::Launch;

/// The checkpoint file in a data directory.
fn checkpoint_file(dir: &Path) -> PathBuf {
    dir.join("leases.checkpoint")
}

fn modified(path: &Path) -> Option<SystemTime> {
    std::fs::metadata(path).and_then(|m| m.modified()).ok()
}

/// Waits for `done` with a deadline, polling (on a thread the runtime lent with `block_in_place`).
fn wait_for(patience: Duration, mut done: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + patience;
    while !done() {
        if Instant::now() > deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    true
}

/// The tmpfs the data directory is on: this size holds every checkpoint of
/// the runs here many times over, so it is only full when filled.
const SMALL_DISK_BYTES: u64 = 64 << 20;

/// The data directory on a small tmpfs, filled while the gateways churn
/// (checkpoints fail), then `kill -9` while it is still full, the disk freed
/// and the server restarted: the restart loads the last checkpoint written
/// before the disk filled.
#[derive(Debug, Default)]
pub struct DiskFull {
    kill9: Kill9,
    disk: Option<SmallDisk>,
    data_dir: PathBuf,
    /// The server's stderr, where it logs each failed checkpoint.
    log: PathBuf,
    /// Failed checkpoints logged before the fill, and by the kill.
    failed_before: usize,
    failed_by_kill: usize,
    /// When the disk was full, on the history clock.
    filled_at: u64,
    /// Whether the checkpoint file was the same at the kill as at the fill (not replaced, not damaged).
    kept: Option<bool>,
}

impl DiskFull {
    fn failures(&self) -> usize {
        std::fs::read_to_string(&self.log)
            .map(|text| text.lines().filter(|l| l.contains("cannot write a checkpoint")).count())
            .unwrap_or(0)
    }
}

impl Allowances for DiskFull {
    fn version_may_go_back(&self, user: &str, version: u64, at_us: u64) -> bool {
        self.kill9.version_may_go_back(user, version, at_us)
    }
}

impl Fault for DiskFull {
    fn name(&self) -> &'static str {
        "disk-full"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        let mut lines = vec![
            format!(
                "disk-full-checkpoints-fail-and-the-last-stays: the data directory's tmpfs is filled while the gateways churn for {} ms; at least two periodic checkpoints (every {} ms) fail, and the checkpoint file at the kill is byte for byte the one at the fill (B3: the last good checkpoint stays)",
                self.lasts(plan).as_millis(),
                plan.checkpoint_interval_ms
            ),
            "disk-full-serves: while the disk is full every register and unregister is answered OK (the store is in memory; nothing waits on the disk)".into(),
            "then kill -9 while the disk is still full, the disk freed, and a restart on the data directory (freed first: the restart's own writes are not what this fault tests); from here the kill9 expectations, with 'the checkpoint' the one written before the fill:".into(),
        ];
        lines.extend(self.kill9.expected_outcome(plan));
        lines
    }

    fn needs_data_dir(&self) -> bool {
        true
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        let disk = SmallDisk::new(SMALL_DISK_BYTES).map_err(|e| e.to_string())?;
        self.data_dir = disk.path().join("data");
        self.disk = Some(disk);
        launch.data_dir = Some(self.data_dir.clone());
        self.log = std::env::temp_dir().join(format!("presence-history-disk-full-{}.log", std::process::id()));
        let _ = std::fs::remove_file(&self.log);
        launch.stderr = Some(self.log.clone());
        self.kill9.configure(launch, plan)
    }

    fn churn_during(&self) -> bool {
        true
    }

    fn lasts(&self, plan: &Plan) -> Duration {
        Duration::from_millis(u64::from(plan.checkpoint_interval_ms) * 4).max(plan.ttl())
    }

    fn recovery(&self, plan: &Plan) -> Duration {
        self.kill9.recovery(plan)
    }

    fn inject(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        self.failed_before = self.failures();
        self.disk.as_ref().ok_or("not configured")?.fill().map_err(|e| e.to_string())?;
        self.filled_at = cx.recorder.now_us();
        Ok(())
    }

    fn heal(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        let path = checkpoint_file(&self.data_dir);
        let at_fill = std::fs::read(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        // At least two failed checkpoints before the kill, so the kill meets a disk that refused writes.
        let before = self.failed_before;
        if !wait_for(Duration::from_secs(20), || self.failures() >= before + 2) {
            return Err("no two failed checkpoints were logged within 20 s of filling the disk".into());
        }
        self.failed_by_kill = self.failures() - self.failed_before;
        self.kill9.inject(cx)?;
        let at_kill = std::fs::read(&path).ok();
        self.kept = Some(at_kill.as_deref() == Some(at_fill.as_slice()));
        self.disk.as_ref().ok_or("not configured")?.free().map_err(|e| e.to_string())?;
        self.kill9.heal(cx)
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let mut kept = Expectation::new(
            "disk-full-checkpoints-fail-and-the-last-stays",
            &format!(
                "{} checkpoints failed while full; the file at the kill was the one at the fill",
                self.failed_by_kill
            ),
        );
        kept.checked = self.failed_by_kill;
        if self.failed_by_kill < 2 || self.kept != Some(true) {
            kept.violations.push(Violation {
                user: String::new(),
                what: format!("{} failed checkpoints; checkpoint kept: {:?}", self.failed_by_kill, self.kept),
                excerpt: Vec::new(),
            });
        }
        let mut serves = Expectation::new("disk-full-serves", "every register and unregister answered OK while full");
        for record in a.records {
            if let Record::Call(c) = record
                && (c.op.is_register() || c.op.is_close())
                && c.start_us >= self.filled_at
                && c.end_us <= self.kill9.killed_at
            {
                serves.checked += 1;
                if c.outcome.code().is_some() {
                    serves.violations.push(Violation {
                        user: c.user.clone(),
                        what: format!("{:?} failed with {:?} while the disk was full", c.op, c.outcome.code()),
                        excerpt: vec![record.clone()],
                    });
                }
            }
        }
        let mut out = vec![kept, serves];
        out.extend(self.kill9.check(a));
        out
    }
}

/// The data directory on a FUSE file system that delays every write, fsync
/// and rename.
#[derive(Debug, Default)]
pub struct SlowDiskFault {
    disk: Option<SlowDisk>,
    /// Checkpoints seen replaced during the fault window, and the disk operations delayed then.
    written: u32,
    delayed: u64,
}

/// The delay of each operation of the `slow-disk` fault.
const SLOW: Duration = Duration::from_millis(150);

/// A unary renewal slower than this waited on something; the disk's one
/// operation alone takes [`SLOW`].
const RENEW_P99_BOUND_MS: f64 = 100.0;

impl SlowDiskFault {
    /// How long `inject` watches the checkpoint file: two TTLs.
    fn window(plan: &Plan) -> Duration {
        plan.ttl() * 2
    }
}

impl Allowances for SlowDiskFault {}

impl Fault for SlowDiskFault {
    fn name(&self) -> &'static str {
        "slow-disk"
    }

    fn expected_outcome(&self, plan: &Plan) -> Vec<String> {
        vec![
            "every generic rule holds".into(),
            format!(
                "slow-disk-no-flip: the data directory is on a disk taking {} ms per write, fsync and rename for the whole run; no user changes in the {} ms quiet window",
                SLOW.as_millis(),
                (Self::window(plan) + self.recovery(plan)).as_millis()
            ),
            "slow-disk-no-lease-trouble: in the whole run no call fails, none is answered NOT_FOUND, no Session loses its lease".into(),
            format!(
                "slow-disk-renewal-latency: the p99 of the unary renewals of the whole run stays under {RENEW_P99_BOUND_MS} ms (less than one disk operation: no renewal waits on the disk)"
            ),
            format!(
                "slow-disk-checkpoints-written: periodic checkpoints (every {} ms) are still written, slowly: at least two replace the file in the {} ms fault window",
                plan.checkpoint_interval_ms,
                Self::window(plan).as_millis()
            ),
        ]
    }

    fn needs_data_dir(&self) -> bool {
        true
    }

    fn configure(&mut self, launch: &mut Launch, plan: &Plan) -> Result<(), String> {
        let disk = SlowDisk::new(SLOW).map_err(|e| e.to_string())?;
        let dir = disk.path().join("data");
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        launch.data_dir = Some(dir);
        launch.args.extend(["--checkpoint-interval-ms".to_owned(), plan.checkpoint_interval_ms.to_string()]);
        self.disk = Some(disk);
        Ok(())
    }

    /// Zero: `inject` itself watches the checkpoints for [`Self::window`].
    fn lasts(&self, _plan: &Plan) -> Duration {
        Duration::ZERO
    }

    /// Counts the checkpoints that replace the file while the fault window lasts.
    fn inject(&mut self, cx: &mut FaultCx<'_>) -> Result<(), String> {
        let disk = self.disk.as_ref().ok_or("not configured")?;
        let path = checkpoint_file(&disk.backing_path().join("data"));
        let ops = disk.delayed_ops();
        let deadline = Instant::now() + Self::window(cx.plan);
        let mut last = modified(&path);
        while Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
            // The file is gone for a moment between its rename to `.prev`
            // and the new one's arrival: count only the arrivals.
            let now = modified(&path);
            if now.is_some() && now != last {
                self.written += 1;
                last = now;
            }
        }
        self.delayed = disk.delayed_ops() - ops;
        Ok(())
    }

    fn heal(&mut self, _cx: &mut FaultCx<'_>) -> Result<(), String> {
        Ok(())
    }

    fn check(&self, a: &Analysis<'_>) -> Vec<Expectation> {
        let calm = no_change_in_window(a, "slow-disk-no-flip", "no user changes in the quiet window", false);
        let mut trouble = Expectation::new("slow-disk-no-lease-trouble", "no lease trouble in the whole run");
        trouble.checked = a.records.iter().filter(|r| matches!(r, Record::Call(_))).count();
        trouble.violations = crate::netfaults::gateway_trouble(a, 0, u64::MAX);
        let (p99, n) = renew_quantile(a, 0, u64::MAX, 0.99);
        let (p50, _) = renew_quantile(a, 0, u64::MAX, 0.5);
        let mut latency = Expectation::new(
            "slow-disk-renewal-latency",
            &format!("unary renewals: p50 {p50:.1} ms, p99 {p99:.1} ms over {n}"),
        );
        latency.checked = n;
        if n == 0 || p99 >= RENEW_P99_BOUND_MS {
            latency.violations.push(Violation {
                user: String::new(),
                what: format!("p99 {p99:.1} ms over {n} renewals"),
                excerpt: Vec::new(),
            });
        }
        let mut written = Expectation::new(
            "slow-disk-checkpoints-written",
            &format!(
                "{} checkpoints replaced the file in the fault window; {} disk operations delayed",
                self.written, self.delayed
            ),
        );
        written.checked = self.written as usize;
        if self.written < 2 || self.delayed == 0 {
            written.violations.push(Violation {
                user: String::new(),
                what: format!("{} checkpoints written, {} operations delayed", self.written, self.delayed),
                excerpt: Vec::new(),
            });
        }
        vec![calm, trouble, latency, written]
    }
}
