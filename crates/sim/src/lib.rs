//! sumflow's discrete-event simulator: how data-parallel training behaves on a cluster
//! larger than the one at hand (256 or 1024 GPUs), for sizing it before renting it: how
//! many CPU machines, which scheduler, how much bandwidth.
//!
//! It replays a layer profile (per layer: forward and backward time, gradient tensors) on
//! n worker machines of g GPUs and k CPU machines connected by a full-bisection network,
//! under one of five architectures (ring and hierarchical all-reduce, non-colocated and
//! colocated PS, BytePS), and reports iteration time, GPU idle time, per-link utilisation
//! and a timeline.
//!
//! What it shares with the runtime, rather than re-implements: the scheduler state machine
//! (`sumflow_plan::scheduler`: fifo, p3, bytescheduler and prophet, with their credit,
//! push window and Prophet's profile and bandwidth monitor, driven with simulated instants),
//! and the lay-out of a model on the servers (`sumflow_plan::layout`: partitioning, Eq. 1/2
//! placement and lanes, which `crate::layout` calls). What it adds: the compute
//! timeline (`compute`), servers (`ps`), all-reduce (`collective`) and the network (`net`).
//! `plan` says which machines are simulated and why folding the others away is exact.
//!
//! ```
//! use sumflow_sim::{simulate, SimConfig};
//!
//! let cfg: SimConfig = serde_json::from_str(include_str!("../tests/tiny.json"))?;
//! let report = simulate(&cfg, &mut |_| {})?;
//! assert!(report.iteration_s >= report.compute_s);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod collective;
mod compute;
pub mod config;
mod engine;
pub mod error;
mod jitter;
mod layout;
mod net;
mod plan;
mod ps;
mod queue;
mod random;
pub mod report;
mod time;

use std::time::Instant;

pub use config::SimConfig;
pub use error::SimError;
pub use report::{LinkReport, Progress, Report, TraceEvent};

use engine::Sim;
use time::secs;

/// Runs one simulation; `progress` hears about a long one about once a second.
pub fn simulate(cfg: &SimConfig, progress: &mut dyn FnMut(Progress)) -> Result<Report, SimError> {
    let wall = Instant::now();
    let mut sim = Sim::new(cfg)?;
    sim.run(progress)?;
    let warmup = cfg.training.warmup_iterations as usize;
    let measured = cfg.training.iterations as usize;
    let starts = &sim.workers[0].starts;
    let window = &starts[warmup..=warmup + measured];
    let iterations_s: Vec<f64> = window.windows(2).map(|w| secs(w[1] - w[0])).collect();
    let span = window[measured] - window[0];
    let iteration_s = secs(span) / measured as f64;
    let compute_s = cfg
        .model
        .layers
        .iter()
        .map(|l| l.forward_s + l.backward_s)
        .sum::<f64>();
    let names = report::machine_names(&sim.plan);
    let mut links = Vec::new();
    for m in 0..sim.net.machines() {
        let stands_for = sim.plan.workers.get(m as usize).map_or(1, |w| w.copies);
        let (up, down) = sim.net.usage(m);
        for (direction, u) in [("up", up), ("down", down)] {
            links.push(LinkReport {
                machine: m,
                name: names[m as usize].clone(),
                stands_for,
                direction,
                utilisation: if span > 0 {
                    u.busy as f64 / span as f64
                } else {
                    0.0
                },
                bytes_per_iteration: u.bytes as f64 / measured as f64,
                busy_s_per_iteration: secs(u.busy) / measured as f64,
            });
        }
    }
    let network_s = links
        .iter()
        .map(|l| l.busy_s_per_iteration)
        .fold(0.0, f64::max);
    let mut trace = std::mem::take(&mut sim.rec.events);
    if cfg.trace.enabled {
        steps(&sim, window, &mut trace);
    }
    Ok(Report {
        model: cfg.model.name.clone(),
        architecture: cfg.architecture.name(),
        scheduler: sim.kind.name(),
        iteration_s,
        iterations_s,
        compute_s,
        gpu_idle_s: (iteration_s - compute_s).max(0.0),
        network_s,
        links,
        machines: names,
        servers: report::server_names(&sim.layout),
        reduction: sim.plan.reduction.clone(),
        placement: sim.layout.placement.clone(),
        push_pulls: sim.layout.ops.len(),
        partitions: sim.layout.parts.len(),
        events: sim.events,
        wall_s: wall.elapsed().as_secs_f64(),
        trace,
        trace_truncated: sim.rec.truncated,
    })
}

/// One `steps` slice per measured iteration of each recorded worker machine.
fn steps(sim: &Sim<'_>, window: &[time::Time], trace: &mut Vec<TraceEvent>) {
    let first = sim.cfg.training.warmup_iterations as usize;
    for (w, wk) in sim.workers.iter().enumerate() {
        let wanted =
            sim.cfg.trace.machines.is_empty() || sim.cfg.trace.machines.contains(&(w as u32));
        if !wanted {
            continue;
        }
        for (i, pair) in wk.starts[first..]
            .windows(2)
            .enumerate()
            .take(window.len() - 1)
        {
            let mut args = serde_json::Map::new();
            args.insert("iteration".into(), (first + i).into());
            trace.push(TraceEvent {
                ph: "X",
                machine: w as u32,
                track: "steps".into(),
                name: format!("step {}", first + i),
                ts: secs(pair[0]),
                dur: secs(pair[1] - pair[0]),
                args,
            });
        }
    }
}

/// [`simulate`] from a JSON configuration to a JSON report: the binding's entry point.
pub fn simulate_json(config: &str, progress: &mut dyn FnMut(Progress)) -> Result<String, SimError> {
    let cfg: SimConfig = serde_json::from_str(config)?;
    let report = simulate(&cfg, progress)?;
    Ok(serde_json::to_string(&report)?)
}
