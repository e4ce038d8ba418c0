//! Summation servers (BytePS's Summation Service, and the two parameter servers as its
//! special cases): a worker pushes each partition to its server on the partition's lane;
//! the server acknowledges the push at once, on the same connection as the sums it sends
//! that worker (so an acknowledgement waits behind them, as in the runtime); once every
//! worker's push of the round is in, the sum goes back to every worker.
//!
//! Summation itself costs no time here: BytePS §5 measures CPU summation above the NIC
//! rate (Fig. 9b), and sumflow's servers reduce with SIMD kernels. What costs CPU time is
//! each message (`crate::net`): a worker prepares each push, a server each sum it sends;
//! acknowledgements are free.

use crate::engine::{Event, Payload, Sim};

impl Sim<'_> {
    fn lane(&self, w: u32, part: u32) -> usize {
        let p = &self.layout.parts[part as usize];
        (w * self.lanes_total + self.lane_base[p.server as usize] + self.layout.lane(p)) as usize
    }

    /// Copies of a message from or to worker machine `w`: on its own NIC, and at the
    /// server (every machine it stands for).
    fn copies(&self, w: u32) -> (u32, u32) {
        let g = self.plan.gpu_copies;
        (g, g * self.workers[w as usize].copies)
    }

    pub fn send_push(&mut self, w: u32, part: u32) {
        let conn = self.push_conns[self.lane(w, part)];
        let bytes = self.layout.parts[part as usize].bytes;
        let (own, all) = self.copies(w);
        // Each GPU's process (or the machine's one, aggregating) prepares its own push.
        self.net.send(
            self.now,
            conn,
            bytes,
            (own, all),
            1,
            Payload::Push { worker: w, part },
            &mut self.q,
        );
    }

    pub fn push_arrived(&mut self, w: u32, part: u32) {
        let header = self.cfg.network.header_bytes;
        let (own, all) = self.copies(w);
        let ack = self.back_conns[self.lane(w, part)];
        self.net.send(
            self.now,
            ack,
            header,
            (all, own),
            0,
            Payload::Ack { worker: w, part },
            &mut self.q,
        );
        let p = part as usize;
        if self.received[p] == 0 {
            self.round_began[p] = self.now;
        }
        self.received[p] += all;
        if self.received[p] < self.plan.pushes_per_round {
            return;
        }
        self.received[p] = 0;
        self.rec.round(
            &self.layout,
            part,
            self.round_began[p],
            self.now,
            &self.plan,
        );
        let bytes = self.layout.parts[p].bytes;
        // The server prepares one sum per puller as each comes up on its connection (a
        // machine's GPUs' copies together).
        for to in 0..self.workers.len() as u32 {
            let (own, all) = self.copies(to);
            let conn = self.back_conns[self.lane(to, part)];
            self.net.send(
                self.now,
                conn,
                bytes,
                (all, own),
                own,
                Payload::Sum { worker: to, part },
                &mut self.q,
            );
        }
    }

    pub fn sum_arrived(&mut self, w: u32, part: u32) {
        let at = self.clock.instant(self.now);
        let wk = &mut self.workers[w as usize];
        wk.sched.finished(wk.orders[part as usize], at);
        self.poll(w);
        if self.reduces_locally() {
            let bytes = self.intra_bytes(self.layout.parts[part as usize].bytes);
            let done = self.intra(w, bytes);
            self.q.push(done, Event::Broadcast { worker: w, part });
        } else {
            self.part_done(w, part);
        }
    }
}
