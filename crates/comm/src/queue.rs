//! The priority queue of a pipeline stage.
//!
//! Items are ordered by (priority, key): lower priority values are more urgent (priority =
//! the layer's distance from the input, so the first layers, needed first by the next
//! forward pass, go first), and equal priorities go by key, an order every worker agrees on
//! whatever order its partitions were queued in (the push window relies on it).

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
                closed: false,
            }),
            ready: Condvar::new(),
        }
    }
}

impl<T> StageQueue<T> {
    /// Queues `item` at `order` = (priority, key); keys are unique among queued items.
    pub fn push(&self, order: (i64, u64), item: T) {
        let mut s = self.state.lock().expect("queue lock");
        s.heap.push(Entry {
            key: Reverse(order),
            item,
        });
        drop(s);
        self.ready.notify_all();
    }

    /// The most urgent item, waiting up to `timeout`; `None` on timeout or once closed
    /// and drained.
    #[cfg(test)]
    pub fn pop(&self, timeout: Duration) -> Option<T> {
        self.pop_when(timeout, |_, _| true)
    }

    /// The most urgent item once `allowed(order, item)` holds for it, waiting up to
    /// `timeout` (re-checked on every push and every `notify`); `None` on timeout, or once
    /// closed and drained.
    pub fn pop_when(
        &self,
        timeout: Duration,
        allowed: impl Fn((i64, u64), &T) -> bool,
    ) -> Option<T> {
        let s = self.state.lock().expect("queue lock");
        let (mut s, _) = self
            .ready
            .wait_timeout_while(s, timeout, |s| match s.heap.peek() {
                Some(top) => !s.closed && !allowed(top.key.0, &top.item),
                None => !s.closed,
            })
            .expect("queue lock");
        match s.heap.peek() {
            Some(top) if s.closed || allowed(top.key.0, &top.item) => s.heap.pop().map(|e| e.item),
            _ => None,
        }
    }

    /// Wakes the waiters of `pop_when` to re-check their condition.
    pub fn notify(&self) {
        let _guard = self.state.lock().expect("queue lock");
        self.ready.notify_all();
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
    fn most_urgent_first_then_by_key() {
        let q = StageQueue::default();
        for (p, k, v) in [
            (5, 0, "e"),
            (0, 9, "a"),
            (3, 8, "c2"),
            (3, 2, "c1"),
            (1, 4, "b"),
        ] {
            q.push((p, k), v);
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
            q.push((0, u64::from(v)), v);
        }
        let mut odd = q.drain_where(|v| v % 2 == 1);
        odd.sort();
        assert_eq!(odd, [1, 3, 5]);
        assert_eq!(q.pop(Duration::ZERO), Some(0));
    }

    #[test]
    fn pop_when_waits_for_the_condition_on_the_most_urgent_item() {
        let q = std::sync::Arc::new(StageQueue::<u32>::default());
        let open = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        q.push((1, 1), 10);
        q.push((2, 2), 20);
        // The condition holds for 20 but not for the head, 10: nothing is popped.
        assert_eq!(q.pop_when(Duration::from_millis(5), |_, v| *v == 20), None);
        let (q2, open2) = (q.clone(), open.clone());
        let waiter = std::thread::spawn(move || {
            q2.pop_when(Duration::from_secs(10), |_, _| {
                open2.load(std::sync::atomic::Ordering::SeqCst)
            })
        });
        std::thread::sleep(Duration::from_millis(20));
        open.store(true, std::sync::atomic::Ordering::SeqCst);
        q.notify();
        assert_eq!(waiter.join().unwrap(), Some(10));
    }
}
