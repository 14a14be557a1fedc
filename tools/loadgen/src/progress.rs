//! Progress bars for long phases (indicatif), hidden with `--quiet` or when stdout is not
//! a terminal, so that piped and scripted runs print only their summaries.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Makes progress bars, or hidden ones.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Progress {
    enabled: bool,
}

impl Progress {
    /// Bars are drawn unless `quiet` or stdout is not a terminal.
    pub(crate) fn new(quiet: bool) -> Progress {
        Progress { enabled: !quiet && std::io::stdout().is_terminal() }
    }

    fn bar(&self, len: u64, template: &str, title: &str) -> ProgressBar {
        if !self.enabled {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr_with_hz(10));
        bar.set_style(
            ProgressStyle::with_template(template)
                .unwrap_or_else(|_| ProgressStyle::default_bar())
                .progress_chars("=> "),
        );
        bar.set_prefix(title.to_owned());
        bar
    }

    /// A bar counting `total` items.
    pub(crate) fn items(&self, title: &str, total: u64) -> ProgressBar {
        self.bar(total, "{prefix:>12} [{bar:40}] {human_pos}/{human_len} ({per_sec}, eta {eta}) {msg}", title)
    }

    /// A bar over a fixed duration; its message shows a counter and its rate.
    pub(crate) fn timed(&self, title: &str, duration: Duration) -> ProgressBar {
        let bar = self.bar(duration.as_millis() as u64, "{prefix:>12} [{bar:40}] {elapsed}/{duration} {msg}", title);
        bar.set_length(duration.as_millis() as u64);
        bar
    }

    /// A spinner for waits of unknown length.
    pub(crate) fn spinner(&self, title: &str) -> ProgressBar {
        if !self.enabled {
            return ProgressBar::hidden();
        }
        let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(10));
        bar.set_style(
            ProgressStyle::with_template("{prefix:>12} {spinner} {elapsed} {msg}")
                .unwrap_or_else(|_| ProgressStyle::default_spinner()),
        );
        bar.set_prefix(title.to_owned());
        bar.enable_steady_tick(Duration::from_millis(100));
        bar
    }
}

/// Keeps a [`Progress::timed`] bar moving: every 100 ms sets its position to the
/// elapsed time and its message to `counter` items and their rate, until dropped.
#[derive(Debug)]
pub(crate) struct Ticker {
    task: tokio::task::JoinHandle<()>,
}

impl Ticker {
    /// Starts ticking `bar` from `start`.
    pub(crate) fn start(bar: ProgressBar, counter: Arc<AtomicU64>, start: Instant, unit: &'static str) -> Ticker {
        let task = tokio::spawn(async move {
            loop {
                tokio::time::sleep(Duration::from_millis(100)).await;
                let elapsed = start.elapsed();
                let n = counter.load(Ordering::Relaxed);
                bar.set_position(elapsed.as_millis() as u64);
                let rate = n as f64 / elapsed.as_secs_f64().max(1e-9);
                bar.set_message(format!("{n} {unit}, {rate:.0}/s"));
            }
        });
        Ticker { task }
    }
}

impl Drop for Ticker {
    fn drop(&mut self) {
        self.task.abort();
    }
}
