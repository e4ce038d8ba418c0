//! The priority queue of a pipeline stage.
//!
//! Lower priority values are more urgent (priority = the layer's distance from the input,
//! so the first layers, needed first by the next forward pass, go first); equal priorities
//! keep their arrival order.

use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::sync::{Condvar, Mutex};
use std::time::Duration;

struct Entry<T> {
    key: Reverse<(i64, u64)>,
    item: T,
}

impl<T> PartialEq for Entry<T> {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl<T> Eq for Entry<T> {}
impl<T> PartialOrd for Entry<T> {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl<T> Ord for Entry<T> {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        self.key.cmp(&other.key)
    }
}

struct State<T> {
    heap: BinaryHeap<Entry<T>>,
    seq: u64,
    closed: bool,
}

/// A blocking priority queue shared by the threads feeding and running one stage.
pub struct StageQueue<T> {
    state: Mutex<State<T>>,
    ready: Condvar,
}

impl<T> Default for StageQueue<T> {
    fn default() -> Self {
        StageQueue {
            state: Mutex::new(State {
                heap: BinaryHeap::new(),
                seq: 0,
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> StageQueue<T> {
    pub fn push(&self, priority: i64, item: T) {
        let mut s = self.state.lock().expect("queue lock");
        let seq = s.seq;
        s.seq += 1;
        s.heap.push(Entry {
            key: Reverse((priority, seq)),
            item,
        });
        drop(s);
        self.ready.notify_one();
    }

    /// The most urgent item, waiting up to `timeout`; `None` on timeout or once closed
    /// and drained.
    pub fn pop(&self, timeout: Duration) -> Option<T> {
        let s = self.state.lock().expect("queue lock");
        let (mut s, _) = self
            .ready
            .wait_timeout_while(s, timeout, |s| s.heap.is_empty() && !s.closed)
            .expect("queue lock");
        s.heap.pop().map(|e| e.item)
    }

    /// Wakes every waiter; later pops return what is left, then `None`.
    pub fn close(&self) {
        self.state.lock().expect("queue lock").closed = true;
        self.ready.notify_all();
    }

    /// Removes every queued item matching `pred` (used to fail a dead server's work).
    pub fn drain_where(&self, pred: impl Fn(&T) -> bool) -> Vec<T> {
        let mut s = self.state.lock().expect("queue lock");
        let (out, keep): (Vec<_>, Vec<_>) = s.heap.drain().partition(|e| pred(&e.item));
        s.heap.extend(keep);
        out.into_iter().map(|e| e.item).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn most_urgent_first_then_arrival_order() {
        let q = StageQueue::default();
        for (p, v) in [(5, "e"), (0, "a"), (3, "c1"), (3, "c2"), (1, "b")] {
            q.push(p, v);
        }
        let got: Vec<_> = (0..5).map(|_| q.pop(Duration::ZERO).unwrap()).collect();
        assert_eq!(got, ["a", "b", "c1", "c2", "e"]);
        assert_eq!(q.pop(Duration::from_millis(5)), None);
    }

    #[test]
    fn close_wakes_waiters_and_drain_removes_matches() {
        let q = std::sync::Arc::new(StageQueue::<u32>::default());
        let q2 = q.clone();
        let waiter = std::thread::spawn(move || q2.pop(Duration::from_secs(10)));
        std::thread::sleep(Duration::from_millis(20));
        q.close();
        assert_eq!(waiter.join().unwrap(), None);
        for v in 0..6 {
            q.push(0, v);
        }
        let mut odd = q.drain_where(|v| v % 2 == 1);
        odd.sort();
        assert_eq!(odd, [1, 3, 5]);
        assert_eq!(q.pop(Duration::ZERO), Some(0));
    }
}
