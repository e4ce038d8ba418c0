//! A worker machine's GPUs: forward through the layers, backward in reverse, gradients
//! handed to communication as each layer's backward ends, and the next forward pass waiting
//! for the sums it needs.
//!
//! Forward of layer l in iteration i needs l's parameters updated by iteration i - 1's sums:
//! with `cross_barrier` (ByteScheduler §3.4, what sumflow's optimizer does) layer by layer,
//! otherwise all of them before the forward pass starts (the global barrier of PyTorch and
//! TensorFlow). The local parameter update itself is not modelled.

use crate::engine::{Event, Sim, Stage};
use crate::time::Time;

impl Sim<'_> {
    fn layer_ready(&self, w: u32, layer: u32) -> bool {
        let wk = &self.workers[w as usize];
        let i = wk.iteration;
        if self.cfg.training.cross_barrier {
            self.layout.updated_by[layer as usize] == 0 || wk.layer_rounds[layer as usize] >= i
        } else {
            self.layout.ops.is_empty() || wk.rounds >= i
        }
    }

    /// Starts worker `w`'s next layer if nothing holds it back.
    pub fn advance(&mut self, w: u32) {
        let wk = &self.workers[w as usize];
        if wk.computing {
            return;
        }
        let (duration, stage) = match wk.stage {
            Stage::Done => return,
            Stage::Forward(l) => {
                if !self.layer_ready(w, l) {
                    return;
                }
                if l == 0 {
                    self.iteration_starts(w);
                    if self.workers[w as usize].stage == Stage::Done {
                        return;
                    }
                }
                (self.forward[l as usize], Stage::Forward(l))
            }
            Stage::Backward(l) => (self.backward[l as usize], Stage::Backward(l)),
        };
        let wk = &mut self.workers[w as usize];
        let duration = if wk.factor == 1.0 {
            duration
        } else {
            (duration as f64 * wk.factor).round() as Time
        };
        wk.computing = true;
        wk.stage = stage;
        wk.stage_started = self.now;
        self.q
            .push(self.now + duration, Event::Computed { worker: w });
    }

    /// Worker `w` starts the forward pass of its current iteration now.
    fn iteration_starts(&mut self, w: u32) {
        let now = self.now;
        let last = self.last_iteration;
        let warmup = self.cfg.training.warmup_iterations;
        let wk = &mut self.workers[w as usize];
        wk.starts.push(now);
        wk.factor = wk.pace.next_factor();
        if w == 0 {
            // Links are measured from the measured iterations' start on machine 0 until
            // every machine is through them, so that all their bytes count.
            if wk.iteration == warmup {
                self.net.measuring = true;
                self.rec.measuring();
            }
            self.rec.iteration(now, &self.net);
        }
        let wk = &mut self.workers[w as usize];
        if wk.iteration == last {
            wk.stage = Stage::Done;
            self.finished += 1;
            if self.finished == self.workers.len() as u32 {
                self.net.measuring = false;
                self.rec.stop();
            }
        }
    }

    pub fn computed(&mut self, w: u32) {
        let layers = self.cfg.model.layers.len() as u32;
        let (stage, started) = {
            let wk = &mut self.workers[w as usize];
            wk.computing = false;
            (wk.stage, wk.stage_started)
        };
        match stage {
            Stage::Forward(l) => {
                self.rec.compute(w, true, l, started, self.now);
                self.workers[w as usize].stage = if l + 1 < layers {
                    Stage::Forward(l + 1)
                } else {
                    Stage::Backward(layers - 1)
                };
            }
            Stage::Backward(l) => {
                self.rec.compute(w, false, l, started, self.now);
                for i in 0..self.layout.ready_after[l as usize].len() {
                    let op = self.layout.ready_after[l as usize][i];
                    if self.reduces_locally() {
                        let done =
                            self.intra(w, self.intra_bytes(self.layout.ops[op as usize].bytes));
                        self.q.push(done, Event::Reduced { worker: w, op });
                    } else {
                        self.submit(w, op);
                    }
                }
                if l > 0 {
                    self.workers[w as usize].stage = Stage::Backward(l - 1);
                } else {
                    // The optimizer's step: the backward pass is over.
                    let wk = &mut self.workers[w as usize];
                    wk.sched.mark_step();
                    wk.iteration += 1;
                    wk.stage = Stage::Forward(0);
                    self.rec.step(w, self.now);
                    self.poll(w);
                }
            }
            Stage::Done => unreachable!("a done worker computes nothing"),
        }
        self.advance(w);
    }
}
