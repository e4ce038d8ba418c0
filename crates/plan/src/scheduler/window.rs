//! The push window of one server: how many bytes a worker may have pushed to a server
//! whose sums have not come back yet. It paces workers against each other; the
//! scheduler's credit ([`super::credit`]) bounds what is committed to the network.
//!
//! Why: a round of a partition completes only when every worker has pushed it, so a server
//! can send sums only as fast as its *slowest* pusher delivers. Without a bound, short-term
//! unfairness between TCP flows lets one worker run far ahead on some servers and lag on
//! others; the servers then hold many half-complete rounds, their egress idles, and the
//! sums all leave at the end of the transfer instead of overlapping with the pushes (on an
//! emulated 4+4-host cluster: 0.75x of BytePS Eq. 6, the links idle for the last quarter).
//! A bound keeps every worker's pushes to a server within a few partitions of each other,
//! so sums stream back while pushes are still going out, and a worker that is ahead on one
//! server spends its egress on the others.
//!
//! Deadlock freedom: windows count bytes until the sum returns, which needs every other
//! worker's push, and workers may queue partitions in different orders, so a plain limit
//! could leave each worker's window full of partitions the others have not sent. Two
//! rules prevent that:
//! - a partition more urgent, by (priority, key), than everything in flight may always go:
//!   the most urgent unfinished partition of a server is then sendable by every worker that
//!   has not sent it yet (anything more urgent is finished), so it completes, and by
//!   induction every partition does, provided workers agree on priorities (the plugin
//!   derives them from the model, the same everywhere);
//! - should they disagree, a window that saw no sum return for `stall` lets one more
//!   partition out, so the job slows down but never stops.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use super::Order;

#[derive(Debug)]
pub struct PushWindow {
    limit: u64,
    stall: Duration,
    in_flight: BTreeMap<Order, u64>,
    bytes: u64,
    last_progress: Instant,
}

impl PushWindow {
    /// A window of `limit` bytes (0: unbounded) that lets a partition past a full window
    /// after `stall` without progress.
    pub fn new(limit: u64, stall: Duration, now: Instant) -> PushWindow {
        PushWindow {
            limit,
            stall,
            in_flight: BTreeMap::new(),
            bytes: 0,
            last_progress: now,
        }
    }

    /// Whether a partition at `order` of `len` bytes may be pushed now.
    pub fn may_send(&self, order: Order, len: u64, now: Instant) -> bool {
        self.limit == 0
            || self.bytes == 0
            || self.bytes + len <= self.limit
            || self
                .in_flight
                .keys()
                .next()
                .is_some_and(|first| order < *first)
            || now.duration_since(self.last_progress) >= self.stall
    }

    /// Changes the limit; bytes already in flight stay counted.
    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// How long until a full window's stall rule lets something out.
    pub fn until_stall(&self, now: Instant) -> Duration {
        self.stall
            .saturating_sub(now.duration_since(self.last_progress))
    }

    /// A partition went out.
    pub fn sent(&mut self, order: Order, len: u64, now: Instant) {
        if self.bytes == 0 {
            // Idle until now: the stall clock starts with the first partition in flight.
            self.last_progress = now;
        }
        *self.in_flight.entry(order).or_insert(0) += len;
        self.bytes += len;
    }

    /// A partition's sum came back (or it failed): its bytes leave the window.
    pub fn finished(&mut self, order: Order, now: Instant) {
        if let Some(len) = self.in_flight.remove(&order) {
            self.bytes -= len;
            self.last_progress = now;
        }
    }

    /// Bytes in flight.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::order;

    const STALL: Duration = Duration::from_millis(100);

    #[test]
    fn bounds_bytes_in_flight() {
        let t = Instant::now();
        let mut w = PushWindow::new(100, STALL, t);
        assert!(w.may_send(order(5, 1), 60, t));
        w.sent(order(5, 1), 60, t);
        assert!(w.may_send(order(5, 2), 40, t));
        w.sent(order(5, 2), 40, t);
        assert!(!w.may_send(order(5, 3), 1, t), "full");
        w.finished(order(5, 1), t);
        assert_eq!(w.bytes(), 40);
        assert!(w.may_send(order(5, 3), 60, t));
        assert!(!w.may_send(order(5, 3), 61, t));
    }

    #[test]
    fn one_partition_always_fits_an_empty_window() {
        let t = Instant::now();
        let w = PushWindow::new(10, STALL, t);
        assert!(w.may_send(order(0, 0), 1 << 20, t));
    }

    #[test]
    fn more_urgent_than_everything_in_flight_goes() {
        let t = Instant::now();
        let mut w = PushWindow::new(100, STALL, t);
        w.sent(order(5, 7), 100, t);
        assert!(w.may_send(order(4, 9), 100, t), "more urgent priority");
        assert!(w.may_send(order(5, 6), 100, t), "same priority, lower key");
        assert!(!w.may_send(order(5, 8), 100, t));
        assert!(!w.may_send(order(6, 0), 100, t));
    }

    #[test]
    fn stall_lets_one_more_out() {
        let t = Instant::now();
        let mut w = PushWindow::new(100, STALL, t);
        w.sent(order(1, 1), 100, t);
        assert!(!w.may_send(order(2, 2), 10, t + STALL / 2));
        assert_eq!(w.until_stall(t + STALL / 2), STALL / 2);
        assert!(w.may_send(order(2, 2), 10, t + STALL));
        w.sent(order(2, 2), 10, t + STALL);
        w.finished(order(1, 1), t + STALL * 2);
        assert!(w.may_send(order(3, 3), 90, t + STALL * 2));
        assert!(!w.may_send(order(3, 3), 91, t + STALL * 2));
    }

    #[test]
    fn unbounded_when_limit_is_zero() {
        let t = Instant::now();
        let mut w = PushWindow::new(0, STALL, t);
        w.sent(order(1, 1), u64::MAX / 2, t);
        assert!(w.may_send(order(9, 9), 1 << 30, t));
    }

    /// Worker 0 queues six partitions at once; worker 1 gets them one per step in reverse
    /// order (its backward pass runs late), so with a one-partition window it first fills
    /// its window with the least urgent one, which worker 0 sends last. Each always pops
    /// its most urgent queued partition, as StageQueue does: both still finish.
    #[test]
    fn different_queueing_orders_do_not_deadlock() {
        let t = Instant::now();
        let parts: Vec<Order> = (0..6).map(|k| order(k as i64, k)).collect();
        let mut arriving: Vec<Order> = parts.clone(); // worker 1 pops from the end: 5 first
        let mut queues: [Vec<Order>; 2] = [parts.clone(), vec![]];
        let mut windows = [PushWindow::new(1, STALL, t), PushWindow::new(1, STALL, t)];
        let mut pushed: [Vec<Order>; 2] = [vec![], vec![]];
        for _ in 0..100 {
            if let Some(o) = arriving.pop() {
                queues[1].push(o);
            }
            for w in 0..2 {
                let head = queues[w].iter().min().copied();
                if let Some(o) = head.filter(|o| windows[w].may_send(*o, 1, t)) {
                    queues[w].retain(|x| *x != o);
                    windows[w].sent(o, 1, t);
                    pushed[w].push(o);
                }
            }
            for o in &parts {
                if pushed[0].contains(o) && pushed[1].contains(o) {
                    windows[0].finished(*o, t);
                    windows[1].finished(*o, t);
                }
            }
        }
        assert_eq!(pushed[0].len(), 6);
        assert_eq!(pushed[1].len(), 6);
        assert_eq!(windows[0].bytes() + windows[1].bytes(), 0);
    }
}
