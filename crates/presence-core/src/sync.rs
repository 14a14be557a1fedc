//! The locks and atomics of the concurrent parts: `parking_lot`'s mutex and
//! lock and std's atomics, or, with the feature `shuttle`, shuttle's, so that
//! the concurrency checker (`crates/presence-server/tests/interleavings.rs`)
//! runs the real store and hub while it chooses the order of their threads.
//!
//! Only the names the code uses are here, with `parking_lot`'s signatures (a
//! lock never fails). Without the feature this is a re-export and costs nothing.

#[cfg(not(feature = "shuttle"))]
pub use parking_lot::{Mutex, RwLock};
#[cfg(not(feature = "shuttle"))]
pub use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[cfg(feature = "shuttle")]
pub use checked::{Mutex, RwLock};
#[cfg(feature = "shuttle")]
pub use shuttle::sync::atomic::{AtomicBool, AtomicU64, Ordering};

#[cfg(feature = "shuttle")]
mod checked {
    use std::fmt;
    use std::sync::PoisonError;

    use shuttle::sync::{MutexGuard, RwLockReadGuard, RwLockWriteGuard};

    /// shuttle's mutex with `parking_lot`'s signatures. A thread that
    /// panicked while holding it has failed the test already, so poison is
    /// passed over.
    #[derive(Default)]
    pub struct Mutex<T>(shuttle::sync::Mutex<T>);

    impl<T> Mutex<T> {
        /// A new unlocked mutex.
        pub fn new(value: T) -> Self {
            Mutex(shuttle::sync::Mutex::new(value))
        }

        /// Waits for the lock: a point where shuttle may switch threads.
        pub fn lock(&self) -> MutexGuard<'_, T> {
            self.0.lock().unwrap_or_else(PoisonError::into_inner)
        }

        /// The value, through a unique borrow: no lock needed.
        pub fn get_mut(&mut self) -> &mut T {
            self.0.get_mut().unwrap_or_else(PoisonError::into_inner)
        }
    }

    impl<T: fmt::Debug> fmt::Debug for Mutex<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_tuple("Mutex").finish_non_exhaustive()
        }
    }

    /// shuttle's reader-writer lock with `parking_lot`'s signatures.
    #[derive(Default)]
    pub struct RwLock<T>(shuttle::sync::RwLock<T>);

    impl<T> RwLock<T> {
        /// A new unlocked lock.
        pub fn new(value: T) -> Self {
            RwLock(shuttle::sync::RwLock::new(value))
        }

        /// Waits for a shared hold.
        pub fn read(&self) -> RwLockReadGuard<'_, T> {
            self.0.read().unwrap_or_else(PoisonError::into_inner)
        }

        /// Waits for the exclusive hold.
        pub fn write(&self) -> RwLockWriteGuard<'_, T> {
            self.0.write().unwrap_or_else(PoisonError::into_inner)
        }
    }

    impl<T: fmt::Debug> fmt::Debug for RwLock<T> {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            f.debug_tuple("RwLock").finish_non_exhaustive()
        }
    }
}
