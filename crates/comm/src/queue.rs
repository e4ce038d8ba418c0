//! A lane's send queue: the partitions the scheduler started, in the order it started
//! them. Nothing overtakes a started partition (it is in the network, as far as the
//! scheduler is concerned); the scheduler's own queues are where priorities act.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    closed: bool,
}

/// A blocking FIFO shared by the threads feeding a lane and its push thread.
#[derive(Debug)]
pub struct LaneQueue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

impl<T> Default for LaneQueue<T> {
    fn default() -> Self {
        LaneQueue {
            state: Mutex::new(State {
                items: VecDeque::new(),
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> LaneQueue<T> {
    pub fn push(&self, item: T) {
        self.state.lock().expect("queue lock").items.push_back(item);
        self.ready.notify_one();
    }

    /// The oldest item, waiting up to `timeout`; `None` on timeout, or once closed and
    /// drained.
    pub fn pop(&self, timeout: Duration) -> Option<T> {
        let s = self.state.lock().expect("queue lock");
        let (mut s, _) = self
            .ready
            .wait_timeout_while(s, timeout, |s| s.items.is_empty() && !s.closed)
            .expect("queue lock");
        s.items.pop_front()
    }

    /// Wakes every waiter; later pops return what is left, then `None`.
    pub fn close(&self) {
        self.state.lock().expect("queue lock").closed = true;
        self.ready.notify_all();
    }

    /// Removes and returns everything queued (a dead server's work).
    pub fn drain(&self) -> Vec<T> {
        self.state
            .lock()
            .expect("queue lock")
            .items
            .drain(..)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn first_in_first_out() {
        let q = LaneQueue::default();
        for v in [3, 1, 2] {
            q.push(v);
        }
        let got: Vec<_> = (0..3).map(|_| q.pop(Duration::ZERO).unwrap()).collect();
        assert_eq!(got, [3, 1, 2]);
        assert_eq!(q.pop(Duration::from_millis(5)), None);
    }

    #[test]
    fn close_wakes_waiters_and_drain_empties() {
        let q = Arc::new(LaneQueue::<u32>::default());
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || q2.pop(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        q.close();
        assert_eq!(waiter.join().unwrap(), None);
        q.push(1);
        q.push(2);
        assert_eq!(q.drain(), [1, 2]);
        assert_eq!(q.pop(Duration::ZERO), None);
    }
}
