//! ByteScheduler's credit (§4.2), kept per server: bytes pushed to a server that it has
//! not acknowledged receiving yet. Those bytes sit in the lane's send queue, the socket
//! buffers and the wire, ahead of anything that becomes ready later: a partition more
//! urgent than all of them still waits for them. A larger credit keeps the pipe full
//! (more bytes ready to go when one transfer ends); a smaller one lets an urgent
//! partition overtake sooner. One partition (P3's stop-and-wait) is the smallest.
//!
//! Acknowledgements come from the server as soon as it has read a push, whatever the
//! other workers do, so a credit cannot deadlock: it always drains, and an empty credit
//! admits any partition however large.

use std::collections::HashMap;

use super::Order;

#[derive(Debug)]
pub struct Credit {
    /// 0: unbounded.
    limit: u64,
    unacknowledged: HashMap<Order, u64>,
    bytes: u64,
}

impl Credit {
    pub fn new(limit: u64) -> Credit {
        Credit {
            limit,
            unacknowledged: HashMap::new(),
            bytes: 0,
        }
    }

    pub fn set_limit(&mut self, limit: u64) {
        self.limit = limit;
    }

    /// Whether `len` more bytes may go now.
    pub fn may_send(&self, len: u64) -> bool {
        self.limit == 0 || self.bytes == 0 || self.bytes + len <= self.limit
    }

    pub fn sent(&mut self, order: Order, len: u64) {
        *self.unacknowledged.entry(order).or_insert(0) += len;
        self.bytes += len;
    }

    /// The server acknowledged the push at `order` (or it failed): its bytes return.
    pub fn acknowledged(&mut self, order: Order) {
        if let Some(len) = self.unacknowledged.remove(&order) {
            self.bytes -= len;
        }
    }

    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::order;

    #[test]
    fn bounds_unacknowledged_bytes() {
        let mut c = Credit::new(100);
        assert!(c.may_send(1000), "an empty credit admits anything");
        c.sent(order(0, 1), 60);
        assert!(c.may_send(40));
        assert!(!c.may_send(41));
        c.sent(order(0, 2), 40);
        c.acknowledged(order(0, 1));
        assert_eq!(c.bytes(), 40);
        assert!(c.may_send(60));
        c.acknowledged(order(0, 1));
        assert_eq!(c.bytes(), 40, "a second acknowledgement changes nothing");
    }

    #[test]
    fn zero_is_unbounded() {
        let mut c = Credit::new(0);
        c.sent(order(0, 0), u64::MAX / 2);
        assert!(c.may_send(u64::MAX / 2));
    }
}
