//! Locks that outlive a panic.
//!
//! The simulated libraries keep process-wide state behind a mutex, and a
//! caller's thread may panic while holding it (every exported function
//! catches the panic and answers an error code). Each critical section
//! writes whole values, so the data stays consistent and later calls take
//! the lock as it is; tests that serialize on a lock go on after one of
//! them failed. The fake libcuda uses this too.

use std::sync::{Mutex, MutexGuard, PoisonError};

/// [`Mutex::lock`], taking a poisoned lock as it is.
pub trait Locked<T: ?Sized> {
    fn locked(&self) -> MutexGuard<'_, T>;
}

impl<T: ?Sized> Locked<T> for Mutex<T> {
    fn locked(&self) -> MutexGuard<'_, T> {
        self.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_poisoned_lock_is_taken_as_it_is() {
        let m = std::sync::Arc::new(Mutex::new(1));
        let m2 = m.clone();
        let _ = std::thread::spawn(move || {
            let _m = m2.lock().unwrap();
            panic!("poisons it");
        })
        .join();
        assert!(m.is_poisoned());
        *m.locked() += 1;
        assert_eq!(*m.locked(), 2);
    }
}
