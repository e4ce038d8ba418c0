//! The event loop and the state it drives: worker machines (compute, and the runtime's
//! scheduler), summation servers or all-reduce collectives, and the network.
//!
//! Each simulated worker machine owns a `sumflow_plan::scheduler::Scheduler`, the same
//! state machine the runtime's pipeline drives, fed with the same events (partitions ready,
//! push acknowledged, sum back, step mark) at simulated instants; whatever it starts goes
//! onto the lane's connection, in the order it started them.

use std::time::Instant;

use sumflow_plan::placement::ServerKind;
use sumflow_plan::scheduler::{Order, Ready, Scheduler, SchedulerKind};

use crate::config::{Architecture, SimConfig};
use crate::error::SimError;
use crate::jitter::Pace;
use crate::layout::Layout;
use crate::net::{ConnId, Costs, NetEvent, Network};
use crate::plan::Plan;
use crate::queue::EventQueue;
use crate::report::{Progress, Recorder};
use crate::time::{from_secs, transfer, Clock, Time};

/// The runtime's timer thread waits at least this long between polls when a deadline
/// has passed but nothing could go (`pipeline.rs`, `timer_loop`).
const TIMER_RESOLUTION: Time = 1_000_000_000;

/// Stands for the connections of a server that runs on no simulated machine.
const NO_CONN: ConnId = ConnId::MAX;

#[derive(Debug)]
pub enum Event {
    Net(NetEvent),
    /// A worker machine finished a layer's forward or backward pass.
    Computed {
        worker: u32,
    },
    /// A worker machine's GPUs reduced an op locally: it goes to the scheduler.
    Reduced {
        worker: u32,
        op: u32,
    },
    /// A worker machine's GPUs received a partition's sum by local broadcast.
    Broadcast {
        worker: u32,
        part: u32,
    },
    /// The scheduler asked to be polled now (a push window's stall rule).
    Poll {
        worker: u32,
    },
    /// A collective's current phase or step finished inside the machine.
    Collective {
        worker: u32,
    },
}

impl From<NetEvent> for Event {
    fn from(e: NetEvent) -> Self {
        Event::Net(e)
    }
}

/// What a message carries.
#[derive(Clone, Copy, Debug)]
pub enum Payload {
    Push {
        worker: u32,
        part: u32,
    },
    Ack {
        worker: u32,
        part: u32,
    },
    Sum {
        worker: u32,
        part: u32,
    },
    /// One step of a ring all-reduce.
    Step {
        worker: u32,
    },
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Stage {
    Forward(u32),
    Backward(u32),
    /// Reached the start of the iteration after the last measured one.
    Done,
}

/// The all-reduce a worker machine runs, one partition at a time (one communicator, one
/// stream, as NCCL and gloo run them).
#[derive(Default)]
pub struct Collective {
    pub queue: std::collections::VecDeque<u32>,
    pub running: Option<Running>,
}

#[derive(Clone, Copy, Debug)]
pub struct Running {
    pub part: u32,
    pub phase: Phase,
    pub step: u32,
    pub steps: u32,
    pub chunk: u64,
    /// When the step's hops between GPUs inside the machine end.
    pub inside_until: Time,
    pub started: Time,
}

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Phase {
    Reduce,
    Ring,
    Broadcast,
}

pub struct Worker {
    pub machine: u32,
    pub copies: u32,
    pub sched: Scheduler<u32>,
    pub iteration: u32,
    pub stage: Stage,
    pub computing: bool,
    pub stage_started: Time,
    /// When the machine's intra-machine link (local reduce and broadcast) is free.
    pub intra_free: Time,
    /// Per op: partitions not done this round.
    pub op_left: Vec<u32>,
    pub ops_open: u32,
    /// Per layer: ops updating it not done this round; rounds completed.
    pub layer_left: Vec<u32>,
    pub layer_rounds: Vec<u32>,
    /// Rounds of every op completed.
    pub rounds: u32,
    /// Per partition: its place in the scheduler's order once started.
    pub orders: Vec<Order>,
    pub poll_at: Option<Time>,
    pub collective: Collective,
    /// Forward start of each iteration.
    pub starts: Vec<Time>,
    /// Draws the machine's pace for each iteration.
    pub pace: Pace,
    /// The current iteration's pace: what its layers' times are multiplied by.
    pub factor: f64,
}

pub struct Sim<'a> {
    pub cfg: &'a SimConfig,
    pub kind: SchedulerKind,
    pub layout: Layout,
    pub plan: Plan,
    pub clock: Clock,
    pub now: Time,
    pub q: EventQueue<Event>,
    pub net: Network<Payload>,
    pub workers: Vec<Worker>,
    /// Per partition: pushes received this round, at its server.
    pub received: Vec<u32>,
    /// Per partition: when this round's first push reached its server.
    pub round_began: Vec<Time>,
    /// Connections: per worker machine, per server lane, towards the server and back.
    pub lane_base: Vec<u32>,
    pub lanes_total: u32,
    pub push_conns: Vec<ConnId>,
    pub back_conns: Vec<ConnId>,
    /// A worker machine's ring all-reduce path, through its own NIC.
    pub ring_conns: Vec<ConnId>,
    pub forward: Vec<Time>,
    pub backward: Vec<Time>,
    pub last_iteration: u32,
    pub finished: u32,
    /// Events handled so far.
    pub events: u64,
    pub rec: Recorder,
}

impl<'a> Sim<'a> {
    pub fn new(cfg: &'a SimConfig) -> Result<Sim<'a>, SimError> {
        cfg.check()?;
        let kind = cfg.schedule.kind()?;
        let layout = Layout::build(cfg)?;
        let plan = Plan::new(cfg, &layout);
        let net_cfg = cfg.network;
        let mut net = Network::new(
            &plan.rates,
            Costs {
                segment: net_cfg.segment_bytes,
                nic_queue: net_cfg.nic_queue_bytes,
                nic_queue_spread: net_cfg.nic_queue_spread,
                fair_downlinks: net_cfg.fair_downlinks,
                seed: cfg.seed,
                latency_s: net_cfg.latency_s,
                overhead_s: net_cfg.message_overhead_s,
                intra_rate: net_cfg.intra_bandwidth,
            },
        );
        let clock = Clock::new();
        let servers = layout.servers.len().max(1);
        let mut lane_base = Vec::with_capacity(layout.servers.len());
        let mut lanes_total = 0;
        for s in &layout.servers {
            lane_base.push(lanes_total);
            lanes_total += s.lanes;
        }
        let mut push_conns = Vec::new();
        let mut back_conns = Vec::new();
        let mut ring_conns = Vec::new();
        for (w, _) in plan.workers.iter().enumerate() {
            let w = w as u32;
            for s in &layout.servers {
                // A colocated server of folded machines has nothing placed on it (that is
                // why they could be folded) and runs on no simulated machine.
                let machine = match s.kind {
                    ServerKind::Colocated => {
                        (s.index < plan.workers.len() as u32).then_some(s.index)
                    }
                    ServerKind::Cpu => Some(plan.cpu_machine(s.index)),
                };
                for _ in 0..s.lanes {
                    let (to, back) = match machine {
                        Some(m) => (net.connect(w, m), net.connect(m, w)),
                        None => (NO_CONN, NO_CONN),
                    };
                    push_conns.push(to);
                    back_conns.push(back);
                }
            }
            ring_conns.push(net.connect_through_nic(w));
        }
        let layers = cfg.model.layers.len();
        let ops = layout.ops.len() as u32;
        let mut schedule = cfg.schedule.schedule()?;
        let partition_bytes = cfg.schedule.layout_partition_bytes()?;
        if !cfg.architecture.has_servers() {
            // The push window paces pushes to servers; an all-reduce has none.
            schedule.window_bytes = 0;
        }
        let workers = plan
            .workers
            .iter()
            .enumerate()
            .map(|(w, wm)| Worker {
                machine: w as u32,
                copies: wm.copies,
                sched: Scheduler::new(schedule.clone(), partition_bytes, servers, clock.instant(0)),
                iteration: 0,
                stage: Stage::Forward(0),
                computing: false,
                stage_started: 0,
                intra_free: 0,
                op_left: layout.ops.iter().map(|o| o.count).collect(),
                ops_open: ops,
                layer_left: layout.updated_by.clone(),
                layer_rounds: vec![0; layers],
                rounds: 0,
                orders: vec![
                    Order {
                        priority: 0,
                        key: 0
                    };
                    layout.parts.len()
                ],
                poll_at: None,
                collective: Collective::default(),
                starts: Vec::new(),
                pace: Pace::new(cfg.training.compute_jitter, cfg.seed, wm.first),
                factor: 1.0,
            })
            .collect();
        let rec = Recorder::new(cfg, &plan);
        Ok(Sim {
            cfg,
            kind,
            received: vec![0; layout.parts.len()],
            round_began: vec![0; layout.parts.len()],
            forward: cfg
                .model
                .layers
                .iter()
                .map(|l| from_secs(l.forward_s))
                .collect(),
            backward: cfg
                .model
                .layers
                .iter()
                .map(|l| from_secs(l.backward_s))
                .collect(),
            layout,
            plan,
            clock,
            now: 0,
            q: EventQueue::new(),
            net,
            workers,
            lane_base,
            lanes_total,
            push_conns,
            back_conns,
            ring_conns,
            last_iteration: cfg.training.warmup_iterations + cfg.training.iterations,
            finished: 0,
            events: 0,
            rec,
        })
    }

    /// Runs until every worker machine reaches the start of the iteration after the last
    /// measured one.
    pub fn run(&mut self, progress: &mut dyn FnMut(Progress)) -> Result<(), SimError> {
        for w in 0..self.workers.len() as u32 {
            self.advance(w);
        }
        let wall = Instant::now();
        let mut told = wall;
        while self.finished < self.workers.len() as u32 {
            let Some((at, event)) = self.q.pop() else {
                return Err(self.stalled());
            };
            self.now = at;
            self.handle(event);
            self.events += 1;
            // Reading the clock costs more than an event: look at it now and then.
            if self.events.is_multiple_of(65_536) && told.elapsed().as_secs_f64() >= 1.0 {
                told = Instant::now();
                progress(Progress {
                    iteration: self.workers[0].iteration,
                    iterations: self.last_iteration,
                    simulated_s: crate::time::secs(self.now),
                    events: self.events,
                    wall_s: wall.elapsed().as_secs_f64(),
                });
            }
        }
        Ok(())
    }

    fn stalled(&self) -> SimError {
        let w = self
            .workers
            .iter()
            .find(|w| w.stage != Stage::Done)
            .expect("a worker is not done");
        let what = match w.stage {
            Stage::Forward(l) => format!(
                "worker machine {} waits to run the forward pass of layer '{}', whose \
                 parameters never came back ({} partitions of the step are not started, {} \
                 in flight)",
                w.machine,
                self.cfg.model.layers[l as usize].name,
                w.sched.waiting(),
                w.sched.in_flight()
            ),
            _ => format!("worker machine {} is stuck in {:?}", w.machine, w.stage),
        };
        SimError::Stalled {
            at_s: crate::time::secs(self.now),
            iteration: w.iteration,
            what,
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Net(e) => {
                if let Some(id) = self.net.handle(self.now, e, &mut self.q) {
                    let msg = self.net.take(id);
                    self.rec.delivered(self.now, &msg, &self.layout, &self.net);
                    self.delivered(msg.payload);
                }
            }
            Event::Computed { worker } => self.computed(worker),
            Event::Reduced { worker, op } => {
                let start =
                    self.now - transfer(self.reduce_bytes(op), self.cfg.network.intra_bandwidth);
                self.rec.intra(
                    worker,
                    "reduce",
                    &self.layout.ops[op as usize].name,
                    start,
                    self.now,
                );
                self.submit(worker, op);
            }
            Event::Broadcast { worker, part } => self.part_done(worker, part),
            Event::Poll { worker } => {
                if self.workers[worker as usize].poll_at == Some(self.now) {
                    self.workers[worker as usize].poll_at = None;
                    self.poll(worker);
                }
            }
            Event::Collective { worker } => self.collective_event(worker),
        }
    }

    fn delivered(&mut self, payload: Payload) {
        match payload {
            Payload::Push { worker, part } => self.push_arrived(worker, part),
            Payload::Ack { worker, part } => {
                let w = &mut self.workers[worker as usize];
                let at = self.clock.instant(self.now);
                w.sched.acknowledged(w.orders[part as usize], at);
                self.poll(worker);
            }
            Payload::Sum { worker, part } => self.sum_arrived(worker, part),
            Payload::Step { worker } => self.step_delivered(worker),
        }
    }

    /// Bytes an intra-machine reduce or broadcast of `bytes` moves: (g - 1)/g of them,
    /// as a reduce-scatter or an all-gather among g GPUs does.
    pub fn intra_bytes(&self, bytes: u64) -> u64 {
        let g = u64::from(self.cfg.cluster.gpus_per_machine);
        bytes * (g - 1) / g
    }

    fn reduce_bytes(&self, op: u32) -> u64 {
        self.intra_bytes(self.layout.ops[op as usize].bytes)
    }

    /// Occupies worker `w`'s intra-machine link for `bytes` from now (or when it frees);
    /// returns when it is done.
    pub fn intra(&mut self, w: u32, bytes: u64) -> Time {
        let rate = self.cfg.network.intra_bandwidth;
        let wk = &mut self.workers[w as usize];
        let start = self.now.max(wk.intra_free);
        wk.intra_free = start + transfer(bytes, rate);
        wk.intra_free
    }

    /// Whether gradients are reduced inside the machine before they are pushed.
    pub fn reduces_locally(&self) -> bool {
        self.cfg.architecture.has_servers()
            && self.cfg.training.intra_aggregation
            && self.cfg.cluster.gpus_per_machine > 1
    }

    /// The op's partitions become ready at worker `w`'s scheduler.
    pub fn submit(&mut self, w: u32, op: u32) {
        let at = self.clock.instant(self.now);
        let o = &self.layout.ops[op as usize];
        let parts: Vec<Ready<u32>> = self
            .layout
            .parts_of(op)
            .map(|i| {
                let partition = self.layout.parts[i];
                Ready {
                    partition,
                    wire_bytes: partition.bytes,
                    item: i as u32,
                }
            })
            .collect();
        let count = parts.len();
        let decision = self.workers[w as usize]
            .sched
            .ready(op, o.priority, parts, at);
        self.rec.ready(w, self.now, o, count, &decision);
        self.poll(w);
    }

    /// Starts whatever worker `w`'s scheduler lets out now.
    pub fn poll(&mut self, w: u32) {
        let at = self.clock.instant(self.now);
        let started = self.workers[w as usize].sched.poll(at);
        for s in started {
            let part = s.item;
            self.workers[w as usize].orders[part as usize] = s.order;
            if self.cfg.architecture.has_servers() {
                self.send_push(w, part);
            } else {
                self.collective_enqueue(w, part);
            }
        }
        let wk = &mut self.workers[w as usize];
        if let Some(deadline) = wk.sched.next_deadline(at) {
            let t = self.clock.time(deadline).max(self.now + TIMER_RESOLUTION);
            if wk.poll_at.is_none_or(|p| t < p) {
                wk.poll_at = Some(t);
                self.q.push(t, Event::Poll { worker: w });
            }
        }
    }

    /// A partition's round is complete at worker `w`: its sum is in place.
    pub fn part_done(&mut self, w: u32, part: u32) {
        let op = self.layout.parts[part as usize].tensor;
        let wk = &mut self.workers[w as usize];
        wk.op_left[op as usize] -= 1;
        if wk.op_left[op as usize] > 0 {
            return;
        }
        wk.op_left[op as usize] = self.layout.ops[op as usize].count;
        for &l in &self.layout.ops[op as usize].layers {
            let l = l as usize;
            wk.layer_left[l] -= 1;
            if wk.layer_left[l] == 0 {
                wk.layer_left[l] = self.layout.updated_by[l];
                wk.layer_rounds[l] += 1;
            }
        }
        wk.ops_open -= 1;
        if wk.ops_open == 0 {
            wk.ops_open = self.layout.ops.len() as u32;
            wk.rounds += 1;
        }
        self.advance(w);
    }

    pub fn architecture(&self) -> Architecture {
        self.cfg.architecture
    }
}
