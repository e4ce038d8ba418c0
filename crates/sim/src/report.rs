//! What a simulation reports: iteration times, GPU idle time, per-link utilisation, and a
//! timeline of the measured iterations in the runtime trace's terms (docs/tracing.md), which
//! the Python side writes as a Chrome trace.

use serde::Serialize;
use serde_json::{json, Map, Value};
use sumflow_plan::placement::ServerKind;
use sumflow_plan::scheduler::Decision;

use crate::config::SimConfig;
use crate::engine::Payload;
use crate::layout::{Layout, Op};
use crate::net::{Msg, Network, Usage};
use crate::plan::Plan;
use crate::time::{secs, Time};

/// How far a long run has got, reported about once a second.
#[derive(Clone, Copy, Debug)]
pub struct Progress {
    /// Iterations machine 0 has started, of `iterations` in all.
    pub iteration: u32,
    pub iterations: u32,
    pub simulated_s: f64,
    pub events: u64,
    pub wall_s: f64,
}

/// One direction of one simulated machine's NIC over the measured iterations.
#[derive(Clone, Debug, Serialize)]
pub struct LinkReport {
    pub machine: u32,
    pub name: String,
    /// Real machines this simulated one stands for.
    pub stands_for: u32,
    /// "up" (NIC to switch) or "down" (switch to NIC).
    pub direction: &'static str,
    pub utilisation: f64,
    pub bytes_per_iteration: f64,
    pub busy_s_per_iteration: f64,
}

/// One event of the timeline: a slice (`X`), an instant (`i`) or a counter (`C`), times in
/// seconds since the simulation began.
#[derive(Clone, Debug, Serialize)]
pub struct TraceEvent {
    pub ph: &'static str,
    pub machine: u32,
    pub track: String,
    pub name: String,
    pub ts: f64,
    pub dur: f64,
    pub args: Map<String, Value>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub model: String,
    pub architecture: &'static str,
    pub scheduler: &'static str,
    /// Mean time per measured iteration, forward start to forward start on worker machine 0.
    pub iteration_s: f64,
    pub iterations_s: Vec<f64>,
    /// Forward plus backward of one iteration.
    pub compute_s: f64,
    /// Iteration time the GPUs spend waiting for communication.
    pub gpu_idle_s: f64,
    /// The busiest link's transmission time per iteration: the floor any schedule of these
    /// bytes on this network has (BytePS Table 1 and Eq. 6 on a uniform network).
    pub network_s: f64,
    pub links: Vec<LinkReport>,
    /// Simulated machines by index: worker machines, then CPU machines.
    pub machines: Vec<String>,
    pub servers: Vec<String>,
    pub reduction: String,
    pub placement: Vec<String>,
    pub push_pulls: usize,
    pub partitions: usize,
    pub events: u64,
    pub wall_s: f64,
    pub trace: Vec<TraceEvent>,
    /// Recording stopped at `trace.max_events`.
    pub trace_truncated: bool,
}

/// Collects the timeline while the measured iterations run.
#[derive(Debug)]
pub struct Recorder {
    enabled: bool,
    machines: Vec<bool>,
    max_events: u64,
    recording: bool,
    pub events: Vec<TraceEvent>,
    pub truncated: bool,
    layer_names: Vec<String>,
    /// Machine 0's iteration starts and the link usage then, for the counters.
    last: Option<(Time, Vec<(Usage, Usage)>)>,
}

pub fn machine_names(plan: &Plan) -> Vec<String> {
    let mut names: Vec<String> = plan
        .workers
        .iter()
        .map(|w| {
            if w.copies > 1 {
                format!(
                    "worker machines {}-{} (one simulated for all)",
                    w.first,
                    w.first + w.copies - 1
                )
            } else {
                format!("worker machine {}", w.first)
            }
        })
        .collect();
    let cpus = plan.rates.len() - plan.workers.len();
    names.extend((0..cpus).map(|j| format!("CPU machine {j}")));
    names
}

pub fn server_names(layout: &Layout) -> Vec<String> {
    layout
        .servers
        .iter()
        .enumerate()
        .map(|(s, srv)| match srv.kind {
            ServerKind::Colocated => format!("server {s} (on worker machine {})", srv.index),
            ServerKind::Cpu => format!("server {s} (on CPU machine {})", srv.index),
        })
        .collect()
}

impl Recorder {
    pub fn new(cfg: &SimConfig, plan: &Plan) -> Recorder {
        let count = plan.rates.len();
        let machines = if cfg.trace.machines.is_empty() {
            vec![true; count]
        } else {
            (0..count as u32)
                .map(|m| cfg.trace.machines.contains(&m))
                .collect()
        };
        Recorder {
            enabled: cfg.trace.enabled,
            machines,
            max_events: cfg.trace.max_events,
            recording: false,
            events: Vec::new(),
            truncated: false,
            layer_names: cfg.model.layers.iter().map(|l| l.name.clone()).collect(),
            last: None,
        }
    }

    fn wants(&mut self, machine: u32) -> bool {
        if !(self.enabled && self.recording) {
            return false;
        }
        if self.events.len() as u64 >= self.max_events {
            self.truncated = true;
            return false;
        }
        self.machines
            .get(machine as usize)
            .copied()
            .unwrap_or(false)
    }

    #[allow(clippy::too_many_arguments)]
    fn push(
        &mut self,
        ph: &'static str,
        machine: u32,
        track: String,
        name: String,
        start: Time,
        end: Time,
        args: Value,
    ) {
        let Value::Object(args) = args else {
            unreachable!("args are objects")
        };
        self.events.push(TraceEvent {
            ph,
            machine,
            track,
            name,
            ts: secs(start),
            dur: secs(end - start),
            args,
        });
    }

    /// The measured iterations begin: record from now.
    pub fn measuring(&mut self) {
        self.recording = true;
        // Usage counts from now on: the counters start from zero too.
        self.last = None;
    }

    pub fn stop(&mut self) {
        self.recording = false;
    }

    /// Machine 0 starts an iteration: a counter of each recorded machine's link
    /// utilisation over the iteration that ended.
    pub fn iteration<P>(&mut self, now: Time, net: &Network<P>) {
        let usage: Vec<(Usage, Usage)> = (0..net.machines()).map(|m| net.usage(m)).collect();
        if let Some((since, before)) = self.last.take() {
            if self.enabled && self.recording && now > since {
                for (m, (u, b)) in usage.iter().zip(&before).enumerate() {
                    if !self.machines[m] || self.events.len() as u64 >= self.max_events {
                        continue;
                    }
                    let span = (now - since) as f64;
                    let up = (u.0.busy - b.0.busy) as f64 / span;
                    let down = (u.1.busy - b.1.busy) as f64 / span;
                    self.push(
                        "C",
                        m as u32,
                        "links".into(),
                        "link utilisation".into(),
                        since,
                        since,
                        json!({"uplink": up, "downlink": down}),
                    );
                }
            }
        }
        self.last = Some((now, usage));
    }

    pub fn compute(&mut self, w: u32, forward: bool, layer: u32, start: Time, end: Time) {
        if !self.wants(w) {
            return;
        }
        let name = format!(
            "{} {}",
            if forward { "forward" } else { "backward" },
            self.layer_names[layer as usize]
        );
        self.push(
            "X",
            w,
            "compute".into(),
            name,
            start,
            end,
            json!({"layer": layer}),
        );
    }

    pub fn step(&mut self, w: u32, now: Time) {
        if self.wants(w) {
            self.push(
                "i",
                w,
                "scheduler".into(),
                "step".into(),
                now,
                now,
                json!({}),
            );
        }
    }

    pub fn ready(&mut self, w: u32, now: Time, op: &Op, partitions: usize, d: &Decision) {
        if !self.wants(w) {
            return;
        }
        let mut args =
            json!({"priority": op.priority, "bytes": op.bytes, "partitions": partitions});
        if let Some(why) = &d.why {
            args["block"] = json!(d.block);
            args["why"] = json!(why.describe());
        }
        self.push("i", w, "scheduler".into(), op.name.clone(), now, now, args);
    }

    pub fn intra(&mut self, w: u32, what: &str, name: &str, start: Time, end: Time) {
        if self.wants(w) {
            self.push(
                "X",
                w,
                "intra-machine".into(),
                format!("{what} {name}"),
                start,
                end,
                json!({}),
            );
        }
    }

    pub fn collective(&mut self, w: u32, layout: &Layout, part: u32, start: Time, end: Time) {
        if !self.wants(w) {
            return;
        }
        let p = &layout.parts[part as usize];
        let op = &layout.ops[p.tensor as usize];
        self.push(
            "X",
            w,
            "all-reduce".into(),
            op.name.clone(),
            start,
            end,
            json!({"key": p.key, "bytes": p.bytes, "priority": op.priority}),
        );
    }

    pub fn round(&mut self, layout: &Layout, part: u32, start: Time, end: Time, plan: &Plan) {
        let p = &layout.parts[part as usize];
        let srv = &layout.servers[p.server as usize];
        let machine = match srv.kind {
            ServerKind::Colocated => srv.index,
            ServerKind::Cpu => plan.cpu_machine(srv.index),
        };
        if !self.wants(machine) {
            return;
        }
        let op = &layout.ops[p.tensor as usize];
        self.push(
            "X",
            machine,
            format!("rounds of server {}", p.server),
            op.name.clone(),
            start,
            end,
            json!({"key": p.key, "bytes": p.bytes}),
        );
    }

    /// A message arrived: pushes on their sender's track, sums on their receiver's.
    pub fn delivered(
        &mut self,
        now: Time,
        msg: &Msg<Payload>,
        layout: &Layout,
        net: &Network<Payload>,
    ) {
        let (track, machine, part) = match msg.payload {
            Payload::Push { part, .. } => {
                let p = &layout.parts[part as usize];
                ("push →", net.ends(msg.conn).0, (part, p))
            }
            Payload::Sum { part, .. } => {
                let p = &layout.parts[part as usize];
                ("receive ←", net.ends(msg.conn).1, (part, p))
            }
            Payload::Ack { .. } | Payload::Step { .. } => return,
        };
        if !self.wants(machine) {
            return;
        }
        let (_, p) = part;
        let op = &layout.ops[p.tensor as usize];
        self.push(
            "X",
            machine,
            format!("{track} server {} lane {}", p.server, layout.lane(p)),
            op.name.clone(),
            msg.started,
            now,
            json!({"key": p.key, "bytes": p.bytes, "priority": op.priority}),
        );
    }
}
