//! The one lock-poisoning policy of `cluster`: a lock a panicking thread held is taken as it is.
//! What the store's locks guard (values, counts, a socket's writer) is left whole at every
//! step a thread can panic in, and a store that stopped serving for one thread's panic would
//! end the whole run rather than that connection.

use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// `m`, locked.
pub fn locked<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Wait on `cv` for at most `d`, the guard back.
pub fn wait<'a, T>(cv: &Condvar, guard: MutexGuard<'a, T>, d: Duration) -> MutexGuard<'a, T> {
    cv.wait_timeout(guard, d)
        .unwrap_or_else(|e| e.into_inner())
        .0
}
