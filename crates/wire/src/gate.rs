//! The front door's admission: how many connections may be in their handshake at once.
//!
//! An unauthenticated connection costs a thread and a socket until its handshake deadline.
//! Capping them separately keeps a flood of them (or of half-open connections) from
//! exhausting a server's threads or crowding out the workers of the job, whose own
//! connections are counted against the larger limit of authenticated ones.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Connections a server or coordinator lets into the handshake at the same time.
pub const MAX_HANDSHAKES: usize = 64;

/// How often a refusal at a full gate is logged at most: a flood must not flood the log.
const WARN_EVERY: Duration = Duration::from_secs(1);

#[derive(Debug)]
pub struct Gate {
    inside: AtomicUsize,
    limit: usize,
    last_warning: Mutex<Option<Instant>>,
}

/// A connection's place in the handshake; leaving it (drop) frees the place.
#[derive(Debug)]
pub struct Pass(Arc<Gate>);

impl Drop for Pass {
    fn drop(&mut self) {
        self.0.inside.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Gate {
    pub fn new(limit: usize) -> Arc<Gate> {
        Arc::new(Gate {
            inside: AtomicUsize::new(0),
            limit,
            last_warning: Mutex::new(None),
        })
    }

    /// A place in the handshake, or None when `limit` connections hold one: close the new
    /// connection then.
    pub fn enter(self: &Arc<Self>) -> Option<Pass> {
        let mut now = self.inside.load(Ordering::Acquire);
        loop {
            if now >= self.limit {
                return None;
            }
            match self.inside.compare_exchange_weak(
                now,
                now + 1,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Some(Pass(Arc::clone(self))),
                Err(seen) => now = seen,
            }
        }
    }

    /// Connections in their handshake now.
    pub fn inside(&self) -> usize {
        self.inside.load(Ordering::Acquire)
    }

    pub fn limit(&self) -> usize {
        self.limit
    }

    /// Whether a refusal should be logged now: at most once every second.
    pub fn should_warn(&self) -> bool {
        let mut last = self.last_warning.lock().expect("gate lock");
        let now = Instant::now();
        if last.is_some_and(|t| now.duration_since(t) < WARN_EVERY) {
            return false;
        }
        *last = Some(now);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::Gate;

    #[test]
    fn the_gate_holds_at_most_its_limit_and_frees_places_on_drop() {
        let gate = Gate::new(2);
        let a = gate.enter().expect("first");
        let b = gate.enter().expect("second");
        assert!(gate.enter().is_none());
        assert_eq!(gate.inside(), 2);
        drop(a);
        let c = gate.enter().expect("a place was freed");
        assert!(gate.enter().is_none());
        drop((b, c));
        assert_eq!(gate.inside(), 0);
        assert!(gate.should_warn());
        assert!(!gate.should_warn(), "a second warning within a second");
    }
}
