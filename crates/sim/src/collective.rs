//! All-reduce, one partition at a time, as NCCL and gloo run collectives on one stream.
//!
//! - **Ring** over all N = n·g GPUs, ordered machine by machine: a partition of s bytes is
//!   2(N - 1) steps (reduce-scatter, then all-gather), in each of which every GPU sends
//!   s/N bytes to the next. Per machine, one of those sends crosses the NIC (Table 1's
//!   2(n - 1)M/nB with n = N when g = 1); the others use the links between its GPUs, in
//!   parallel, so a step ends when both paths have.
//! - **Hierarchical**: the machine's GPUs reduce the partition locally, the n machines run
//!   a ring of 2(n - 1) steps of s/n bytes, and the machine broadcasts the result.
//!
//! Every node does the same in every step, so one machine is simulated and its ring
//! neighbour is itself: each step's message leaves through its NIC and comes back in
//! through it (`crate::plan`).

use crate::engine::{Event, Payload, Phase, Running, Sim};
use crate::time::{from_secs, transfer};

impl Sim<'_> {
    pub fn collective_enqueue(&mut self, w: u32, part: u32) {
        let c = &mut self.workers[w as usize].collective;
        c.queue.push_back(part);
        if c.running.is_none() {
            self.collective_next(w);
        }
    }

    fn hierarchical(&self) -> bool {
        self.architecture() == crate::config::Architecture::Hierarchical
    }

    fn collective_next(&mut self, w: u32) {
        let Some(part) = self.workers[w as usize].collective.queue.pop_front() else {
            return;
        };
        let bytes = self.layout.parts[part as usize].bytes;
        let (n, g) = (self.cfg.cluster.machines, self.cfg.cluster.gpus_per_machine);
        let ring = if self.hierarchical() { n } else { n * g };
        let mut run = Running {
            part,
            phase: Phase::Ring,
            step: 0,
            steps: 2 * (ring - 1),
            chunk: bytes.div_ceil(u64::from(ring)),
            inside_until: self.now,
            started: self.now,
        };
        if self.hierarchical() && g > 1 {
            run.phase = Phase::Reduce;
            self.workers[w as usize].collective.running = Some(run);
            let done = self.intra(w, self.intra_bytes(bytes));
            self.q.push(done, Event::Collective { worker: w });
            return;
        }
        self.workers[w as usize].collective.running = Some(run);
        self.ring_step(w);
    }

    /// Starts the current step, or ends the ring phase when no step is left.
    fn ring_step(&mut self, w: u32) {
        let run = self.workers[w as usize]
            .collective
            .running
            .expect("a collective is running");
        if run.step == run.steps {
            return self.ring_over(w);
        }
        // Every step is a message the machine's process prepares first.
        let net = self.cfg.network;
        let inside =
            self.now + from_secs(net.message_overhead_s) + transfer(run.chunk, net.intra_bandwidth);
        let g = self.cfg.cluster.gpus_per_machine;
        let single = self.cfg.cluster.machines == 1;
        // Hops between the machine's own GPUs: every hop with one machine, the others of a
        // flat ring's step with several.
        let inside_until = if single || (!self.hierarchical() && g > 1) {
            inside
        } else {
            self.now
        };
        if let Some(r) = self.workers[w as usize].collective.running.as_mut() {
            r.inside_until = inside_until;
        }
        if single {
            self.q.push(inside, Event::Collective { worker: w });
            return;
        }
        self.net.send(
            self.now,
            self.ring_conns[w as usize],
            run.chunk,
            (1, 1),
            1,
            Payload::Step { worker: w },
            &mut self.q,
        );
    }

    /// A step's message came back in through the NIC.
    pub fn step_delivered(&mut self, w: u32) {
        let run = self.workers[w as usize]
            .collective
            .running
            .expect("a collective is running");
        if run.inside_until > self.now {
            self.q
                .push(run.inside_until, Event::Collective { worker: w });
        } else {
            self.step_over(w);
        }
    }

    fn step_over(&mut self, w: u32) {
        if let Some(r) = self.workers[w as usize].collective.running.as_mut() {
            r.step += 1;
        }
        self.ring_step(w);
    }

    fn ring_over(&mut self, w: u32) {
        let run = self.workers[w as usize]
            .collective
            .running
            .expect("a collective is running");
        let g = self.cfg.cluster.gpus_per_machine;
        if self.hierarchical() && g > 1 {
            let bytes = self.layout.parts[run.part as usize].bytes;
            let done = self.intra(w, self.intra_bytes(bytes));
            if let Some(r) = self.workers[w as usize].collective.running.as_mut() {
                r.phase = Phase::Broadcast;
            }
            self.q.push(done, Event::Collective { worker: w });
            return;
        }
        self.collective_done(w);
    }

    pub fn collective_event(&mut self, w: u32) {
        let run = self.workers[w as usize]
            .collective
            .running
            .expect("a collective is running");
        match run.phase {
            Phase::Reduce => {
                if let Some(r) = self.workers[w as usize].collective.running.as_mut() {
                    r.phase = Phase::Ring;
                }
                self.ring_step(w);
            }
            Phase::Ring => self.step_over(w),
            Phase::Broadcast => self.collective_done(w),
        }
    }

    fn collective_done(&mut self, w: u32) {
        let run = self.workers[w as usize]
            .collective
            .running
            .take()
            .expect("a collective is running");
        self.rec
            .collective(w, &self.layout, run.part, run.started, self.now);
        let at = self.clock.instant(self.now);
        let wk = &mut self.workers[w as usize];
        let order = wk.orders[run.part as usize];
        wk.sched.acknowledged(order, at);
        wk.sched.finished(order, at);
        // Polling may have queued (and started) the next partition already.
        self.poll(w);
        self.part_done(w, run.part);
        if self.workers[w as usize].collective.running.is_none() {
            self.collective_next(w);
        }
    }
}
