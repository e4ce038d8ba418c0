//! A lane's send queue: the partitions the scheduler started, in the order it started
//! them. Nothing overtakes a started partition (it is in the network, as far as the
//! scheduler is concerned); the scheduler's own queues are where priorities act.

use std::collections::VecDeque;
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    closed: bool,
    /// Threads asleep in `pop`: a push wakes one only when there is one, since a notify is
    /// a futex system call whether or not anyone sleeps, and the push thread is usually
    /// busy writing when the scheduler starts another partition for it.
    asleep: usize,
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
                asleep: 0,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> LaneQueue<T> {
    pub fn push(&self, item: T) {
        let mut s = self.state.lock().expect("queue lock");
        s.items.push_back(item);
        if s.asleep > 0 {
            self.ready.notify_one();
        }
    }

    /// Queues `item`, unless the queue is empty and its thread asleep: then `item` comes
    /// back, for the caller to handle itself instead of waking that thread for it (a
    /// futex call and two context switches, once per partition on issue 22's cluster).
    /// Nothing is queued before a returned item, so the order stays first in, first out.
    pub fn offer(&self, item: T) -> Option<T> {
        let mut s = self.state.lock().expect("queue lock");
        if s.asleep > 0 && s.items.is_empty() && !s.closed {
            return Some(item);
        }
        // A sleeper with items queued was notified by the push that queued the first.
        s.items.push_back(item);
        None
    }

    /// The oldest item, waiting up to `timeout`; `None` on timeout, or once closed and
    /// drained.
    pub fn pop(&self, timeout: Duration) -> Option<T> {
        let deadline = Instant::now() + timeout;
        let mut s = self.state.lock().expect("queue lock");
        while s.items.is_empty() && !s.closed {
            let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                break;
            };
            s.asleep += 1;
            s = self.ready.wait_timeout(s, left).expect("queue lock").0;
            s.asleep -= 1;
        }
        s.items.pop_front()
    }

    /// Wakes every waiter; later pops return what is left, then `None`.
    pub fn close(&self) {
        let mut s = self.state.lock().expect("queue lock");
        s.closed = true;
        if s.asleep > 0 {
            self.ready.notify_all();
        }
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
    fn a_push_wakes_a_sleeping_pop() {
        let q = Arc::new(LaneQueue::<u32>::default());
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || q2.pop(Duration::from_secs(10)));
        while q.state.lock().unwrap().asleep == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        q.push(7);
        assert_eq!(waiter.join().unwrap(), Some(7));
        assert_eq!(q.state.lock().unwrap().asleep, 0);
    }

    #[test]
    fn an_offer_comes_back_only_while_the_popper_sleeps_on_an_empty_queue() {
        let q = Arc::new(LaneQueue::<u32>::default());
        assert_eq!(q.offer(1), None, "nobody asleep: queued");
        assert_eq!(q.pop(Duration::ZERO), Some(1));
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || q2.pop(Duration::from_secs(10)));
        while q.state.lock().unwrap().asleep == 0 {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert_eq!(
            q.offer(2),
            Some(2),
            "the popper sleeps: the caller keeps it"
        );
        q.push(3);
        assert_eq!(q.offer(4), None, "queued behind 3, which woke the popper");
        assert_eq!(waiter.join().unwrap(), Some(3));
        assert_eq!(q.pop(Duration::ZERO), Some(4));
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
