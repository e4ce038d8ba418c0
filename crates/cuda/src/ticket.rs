//! A staged copy's outcome, for the caller to poll or wait on.

use std::sync::{Condvar, Mutex};
use std::time::Duration;

/// Filled once, by the staging thread; read any number of times.
#[derive(Debug)]
pub struct Ticket<T> {
    outcome: Mutex<Option<T>>,
    done: Condvar,
}

impl<T: Clone> Default for Ticket<T> {
    fn default() -> Self {
        Self {
            outcome: Mutex::new(None),
            done: Condvar::new(),
        }
    }
}

impl<T: Clone> Ticket<T> {
    /// Sets the outcome (the first one set stays) and wakes every waiter.
    pub fn complete(&self, value: T) {
        let mut outcome = self.outcome.lock().expect("ticket lock");
        if outcome.is_none() {
            *outcome = Some(value);
        }
        drop(outcome);
        self.done.notify_all();
    }

    /// The outcome, if set.
    pub fn get(&self) -> Option<T> {
        self.outcome.lock().expect("ticket lock").clone()
    }

    /// The outcome, waiting at most `timeout` for it (None: not set in time).
    pub fn wait(&self, timeout: Duration) -> Option<T> {
        let outcome = self.outcome.lock().expect("ticket lock");
        let (outcome, _) = self
            .done
            .wait_timeout_while(outcome, timeout, |o| o.is_none())
            .expect("ticket lock");
        outcome.clone()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::thread;
    use std::time::Instant;

    use super::*;

    #[test]
    fn a_waiter_gets_the_outcome_set_on_another_thread_and_keeps_it() {
        let ticket = Arc::new(Ticket::<Result<u64, String>>::default());
        assert_eq!(ticket.get(), None);
        let setter = Arc::clone(&ticket);
        let t = thread::spawn(move || {
            thread::sleep(Duration::from_millis(20));
            setter.complete(Ok(7));
            setter.complete(Err("late".into()));
        });
        assert_eq!(ticket.wait(Duration::from_secs(10)), Some(Ok(7)));
        t.join().unwrap();
        assert_eq!(ticket.get(), Some(Ok(7)));
        assert_eq!(ticket.wait(Duration::from_millis(1)), Some(Ok(7)));
    }

    #[test]
    fn a_wait_for_an_outcome_never_set_ends_at_its_timeout() {
        let ticket = Ticket::<u8>::default();
        let began = Instant::now();
        assert_eq!(ticket.wait(Duration::from_millis(30)), None);
        assert!(began.elapsed() >= Duration::from_millis(30));
    }
}
