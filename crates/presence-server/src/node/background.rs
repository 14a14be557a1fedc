//! Work that can wait (a backup, a move's copy, a follower's copy) on a
//! thread of its own, at a lower CPU priority than the runtime's: on cores
//! that renewals fill, the scheduler runs the heartbeat first and the
//! housekeeping in what is left (H1), instead of sharing the cores evenly
//! between them. A thread per piece of work, not a pool: a pool's thread
//! could not take its priority back (that needs a privilege), and the work
//! comes a few times a second at most.
//!
//! The thread still takes shard locks for short slices (at most 1,024 users
//! a hold, as for checkpoints); a lower priority makes a slice take longer
//! only when the cores are full.

use std::io;

/// The nice value of a background thread: 10 of Linux's 0 (the runtime's)
/// to 19, a weight of 110 against the runtime threads' 1,024.
const BACKGROUND_NICE: i32 = 10;

/// Runs `work` on a new thread named `name`, at the background priority
/// where the platform lets a thread lower its own.
pub(crate) fn spawn(name: &str, work: impl FnOnce() + Send + 'static) -> io::Result<()> {
    std::thread::Builder::new().name(name.to_owned()).spawn(move || {
        lower_this_threads_priority();
        work();
    })?;
    Ok(())
}

/// Runs `work` on a new background thread named `name` and answers what it
/// returns; `Err` when no thread could be started or the work panicked.
pub(crate) async fn run<T: Send + 'static>(
    name: &str,
    work: impl FnOnce() -> T + Send + 'static,
) -> Result<T, BackgroundError> {
    let (sender, receiver) = tokio::sync::oneshot::channel();
    spawn(name, move || {
        let _ = sender.send(work());
    })
    .map_err(BackgroundError::Spawn)?;
    receiver.await.map_err(|_| BackgroundError::Panicked)
}

/// Why background work gave no answer.
#[derive(Debug, thiserror::Error)]
pub(crate) enum BackgroundError {
    #[error("cannot start a background thread: {0}")]
    Spawn(io::Error),
    #[error("the background work panicked")]
    Panicked,
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn lower_this_threads_priority() {
    // SAFETY: gettid has no preconditions; setpriority on this thread's own
    // id changes only this thread's nice value (Linux keeps it per thread).
    let changed = unsafe {
        let thread = libc::gettid() as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, thread, BACKGROUND_NICE)
    };
    if changed != 0 {
        tracing::debug!(error = %io::Error::last_os_error(), "a background thread keeps the runtime's priority");
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn lower_this_threads_priority() {}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    #[test]
    fn a_background_thread_runs_at_the_background_nice_value() {
        let (sender, receiver) = std::sync::mpsc::channel();
        super::spawn("test-background", move || {
            // SAFETY: as above, this thread's own id.
            let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
            sender.send(nice).unwrap();
        })
        .unwrap();
        assert_eq!(receiver.recv().unwrap(), super::BACKGROUND_NICE);
    }

    #[tokio::test]
    async fn background_work_answers_what_it_returns_and_a_panic_is_an_error() {
        assert_eq!(super::run("test-background", || 7).await.unwrap(), 7);
        let panicked = super::run("test-background", || -> u8 { panic!("on purpose") }).await;
        assert!(matches!(panicked, Err(super::BackgroundError::Panicked)));
    }
}
