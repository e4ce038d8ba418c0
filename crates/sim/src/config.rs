//! What a simulation is asked: the model, the cluster, the network, the architecture and
//! the scheduler. Every field is explicit (the Python front end, `sumflow.sim`, holds the
//! documented defaults), and [`SimConfig::check`] refuses a configuration that cannot be
//! simulated with a sentence naming the field and the way out.

use std::str::FromStr;

use serde::{Deserialize, Serialize};
use sumflow_plan::partition::{DEFAULT_PARTITION_BYTES, WHOLE_TENSOR_BYTES};
use sumflow_plan::scheduler::prophet::ProphetConfig;
use sumflow_plan::scheduler::{Schedule, SchedulerKind};

use crate::error::SimError;

/// One simulation.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct SimConfig {
    pub model: Model,
    pub cluster: Cluster,
    pub network: Network,
    pub architecture: Architecture,
    pub schedule: ScheduleSpec,
    pub training: Training,
    pub trace: TraceSpec,
    /// Simulate one worker machine for all where every worker machine provably does the
    /// same thing at the same time (see `crate::plan`); off only to check that reduction.
    pub exploit_symmetry: bool,
    /// Seeds every draw (`training.compute_jitter`, `network.nic_queue_spread`): a
    /// simulation is reproducible.
    #[serde(default)]
    pub seed: u64,
}

/// A model as communication sees it: layers in forward order, each with its compute
/// times on one GPU and its gradient tensors.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Model {
    pub name: String,
    pub layers: Vec<Layer>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Layer {
    pub name: String,
    pub forward_s: f64,
    pub backward_s: f64,
    /// The gradients this layer's backward completes, in declaration order.
    pub tensors: Vec<Tensor>,
}

#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Tensor {
    pub name: String,
    pub bytes: u64,
}

/// n worker machines of g GPUs each, and k machines without GPUs for summation servers.
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Cluster {
    pub machines: u32,
    pub gpus_per_machine: u32,
    pub cpu_machines: u32,
}

/// A full-bisection network: every machine has one full-duplex NIC into a non-blocking
/// switch (BytePS §4.1's assumption).
#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Network {
    /// A worker machine's NIC, bytes per second in each direction.
    pub bandwidth: f64,
    /// A CPU machine's NIC, bytes per second in each direction.
    pub cpu_bandwidth: f64,
    /// One-way propagation and switching delay, seconds.
    pub latency_s: f64,
    /// Sender time per data message before its first byte leaves (serialisation, system
    /// calls, the partition overhead of ByteScheduler §4.1), seconds; it delays its
    /// connection, not the link.
    pub message_overhead_s: f64,
    /// Bytes per second between the GPUs of one machine and between a worker and the
    /// summation server beside it (NVLink/PCIe, loopback).
    pub intra_bandwidth: f64,
    /// The unit in which links interleave connections: a link sends one segment of one
    /// connection, then one of the next. Smaller is closer to packet-level sharing and
    /// costs more events.
    pub segment_bytes: u64,
    /// Bytes one connection may queue at its NIC ahead of the others' (what TCP's window
    /// lets it hand the kernel): at most a segment interleaves connections segment by
    /// segment; more sends them in larger bursts, in the order they were written.
    pub nic_queue_bytes: u64,
    /// How unevenly connections share their NIC (0: evenly): each connection's allowance is
    /// drawn from `nic_queue_bytes` times 1 +- this, uniformly, and drawn again each time
    /// it has queued that much. TCP's windows differ between connections and change from
    /// one round trip to the next, so flows into one server progress unevenly, and a
    /// round waits for the slowest.
    #[serde(default)]
    pub nic_queue_spread: f64,
    /// A switch port serves the connections arriving at it in turn, a segment each, as
    /// TCP's flows converge to equal shares of the link they bottleneck on; off, in arrival
    /// order (a FIFO port with senders that never slow down).
    #[serde(default)]
    pub fair_downlinks: bool,
    /// Bytes of a message without payload (a push acknowledgement).
    pub header_bytes: u64,
}

/// How gradients are summed across workers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Architecture {
    /// Ring all-reduce over every GPU (NCCL's ring across machines).
    Ring,
    /// Reduce inside each machine, ring all-reduce across machines, broadcast inside.
    Hierarchical,
    /// Non-colocated parameter server: summation only on the k CPU machines.
    Ps,
    /// Colocated parameter server: one summation server per worker machine, no CPU
    /// machines.
    ColocatedPs,
    /// BytePS / sumflow: summation servers on every worker machine and on the k CPU
    /// machines, load split by Eq. 1 and 2.
    Byteps,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Ring => "ring",
            Architecture::Hierarchical => "hierarchical",
            Architecture::Ps => "ps",
            Architecture::ColocatedPs => "colocated-ps",
            Architecture::Byteps => "byteps",
        }
    }

    /// Whether summation servers do the summing (rather than an all-reduce).
    pub fn has_servers(self) -> bool {
        matches!(
            self,
            Architecture::Ps | Architecture::ColocatedPs | Architecture::Byteps
        )
    }
}

/// The runtime's scheduler knobs (docs/scheduling.md), plus what only a simulation sets.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ScheduleSpec {
    /// `fifo`, `p3`, `bytescheduler` or `prophet`.
    pub scheduler: String,
    /// Partition size (none: BytePS's 4 MiB, the runtime's default before it derived one
    /// per declaration, which the simulator does not model yet); `fifo` sends whole
    /// tensors whatever this says, as the runtime does.
    pub partition_bytes: Option<u64>,
    /// Unacknowledged bytes per server (0: unbounded; none: the runtime's default of 2
    /// partitions); `fifo` has none, `p3` one partition.
    pub credit_bytes: Option<u64>,
    /// Bytes per server whose sums have not come back (0: unbounded; none: the runtime's
    /// default of 4 partitions); servers only.
    pub window_bytes: Option<u64>,
    /// Prophet: a gap longer than this times the mean gap ends a stage (0: every gap).
    pub prophet_stage_factor: f64,
    /// Tensors fused, in backward order, into push_pulls of at least this many bytes
    /// (GradientFlow's lazy all-reduce, DDP's buckets); 0: one push_pull per tensor.
    pub fusion_bytes: u64,
    /// A priority per tensor in declaration order (lower goes first) instead of the
    /// tensor's position in the model; for what-if studies and the optimality check.
    pub priorities: Option<Vec<i64>>,
}

impl ScheduleSpec {
    pub fn kind(&self) -> Result<SchedulerKind, SimError> {
        SchedulerKind::from_str(&self.scheduler).map_err(SimError::Invalid)
    }

    pub fn partition_bytes(&self) -> u64 {
        self.partition_bytes.unwrap_or(DEFAULT_PARTITION_BYTES)
    }

    /// The size tensors are cut into, as the runtime's `CommConfig::layout_partition_bytes`:
    /// whole tensors (up to the servers' frame limit) under `fifo`.
    pub fn layout_partition_bytes(&self) -> Result<u64, SimError> {
        Ok(if self.kind()?.sends_whole_tensors() {
            WHOLE_TENSOR_BYTES
        } else {
            self.partition_bytes()
        })
    }

    /// The runtime's schedule for these knobs: its defaults where none is given, sized
    /// for the layout's partitions as the runtime sizes them.
    pub fn schedule(&self) -> Result<Schedule, SimError> {
        let mut s = Schedule::new(self.kind()?, self.layout_partition_bytes()?);
        s.credit_bytes = self.credit_bytes.unwrap_or(s.credit_bytes);
        s.window_bytes = self.window_bytes.unwrap_or(s.window_bytes);
        s.prophet = ProphetConfig {
            stage_factor: self.prophet_stage_factor,
            ..ProphetConfig::default()
        };
        Ok(s)
    }
}

#[derive(Clone, Copy, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct Training {
    /// Reduce a machine's GPUs' gradients locally and push one copy per machine (BytePS
    /// §4.2); without it every GPU is a worker of its own on the shared NIC. Servers only.
    pub intra_aggregation: bool,
    /// The next forward pass starts layer by layer as each layer's sums arrive
    /// (ByteScheduler §3.4), instead of after every sum.
    pub cross_barrier: bool,
    /// Iterations simulated before the measured ones (Prophet profiles the first).
    pub warmup_iterations: u32,
    /// Measured iterations.
    pub iterations: u32,
    /// How much a worker machine's compute varies from one iteration to the next: the
    /// coefficient of variation of a log-normal factor drawn per machine and iteration
    /// that stretches all its layers' times (a machine that is slower in one iteration,
    /// as on a shared or throttled host). 0: every machine keeps the profile's times.
    #[serde(default)]
    pub compute_jitter: f64,
}

/// What goes on the timeline.
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct TraceSpec {
    pub enabled: bool,
    /// Simulated machines to record (worker machines first, then CPU machines); empty:
    /// every one.
    pub machines: Vec<u32>,
    /// Recording stops after this many events.
    pub max_events: u64,
}

fn positive(name: &str, v: f64, unit: &str) -> Result<(), SimError> {
    if v.is_finite() && v > 0.0 {
        Ok(())
    } else {
        Err(SimError::Invalid(format!(
            "{name} must be a positive, finite number of {unit}, not {v}"
        )))
    }
}

fn non_negative(name: &str, v: f64, unit: &str) -> Result<(), SimError> {
    if v.is_finite() && v >= 0.0 {
        Ok(())
    } else {
        Err(SimError::Invalid(format!(
            "{name} must be a finite number of {unit} >= 0, not {v}"
        )))
    }
}

impl SimConfig {
    /// Refuses what cannot be simulated, naming the field.
    pub fn check(&self) -> Result<(), SimError> {
        let c = &self.cluster;
        if c.machines == 0 {
            return Err(SimError::Invalid(
                "cluster.machines must be at least 1 worker machine".into(),
            ));
        }
        if c.gpus_per_machine == 0 {
            return Err(SimError::Invalid(
                "cluster.gpus_per_machine must be at least 1".into(),
            ));
        }
        let arch = self.architecture;
        match arch {
            Architecture::Ring | Architecture::Hierarchical | Architecture::ColocatedPs
                if c.cpu_machines > 0 =>
            {
                return Err(SimError::Invalid(format!(
                    "{} cannot use CPU machines (cluster.cpu_machines = {}): set it to 0, or \
                     choose 'byteps' to sum on them",
                    arch.name(),
                    c.cpu_machines
                )));
            }
            Architecture::Ps if c.cpu_machines == 0 => {
                return Err(SimError::Invalid(
                    "a non-colocated PS sums only on CPU machines and cluster.cpu_machines is \
                     0: give it at least 1, or choose 'colocated-ps' or 'byteps'"
                        .into(),
                ));
            }
            _ => {}
        }
        let n = &self.network;
        positive("network.bandwidth", n.bandwidth, "bytes per second")?;
        positive("network.cpu_bandwidth", n.cpu_bandwidth, "bytes per second")?;
        positive(
            "network.intra_bandwidth",
            n.intra_bandwidth,
            "bytes per second",
        )?;
        non_negative("network.latency_s", n.latency_s, "seconds")?;
        non_negative(
            "network.message_overhead_s",
            n.message_overhead_s,
            "seconds",
        )?;
        if !(n.nic_queue_spread.is_finite() && (0.0..=1.0).contains(&n.nic_queue_spread)) {
            return Err(SimError::Invalid(format!(
                "network.nic_queue_spread must be a fraction from 0 to 1, not {}",
                n.nic_queue_spread
            )));
        }
        if n.segment_bytes == 0 {
            return Err(SimError::Invalid(
                "network.segment_bytes must be at least 1".into(),
            ));
        }
        let s = &self.schedule;
        let kind = s.kind()?;
        if !kind.sends_whole_tensors() && s.partition_bytes() < 4 {
            return Err(SimError::Invalid(format!(
                "schedule.partition_bytes is {}: a partition must hold at least one float32 \
                 element (4 bytes)",
                s.partition_bytes()
            )));
        }
        if !(s.prophet_stage_factor.is_finite() && s.prophet_stage_factor >= 0.0) {
            return Err(SimError::Invalid(format!(
                "schedule.prophet_stage_factor must be a finite number >= 0, not {}",
                s.prophet_stage_factor
            )));
        }
        let t = &self.training;
        if !(t.compute_jitter.is_finite() && (0.0..=1.0).contains(&t.compute_jitter)) {
            return Err(SimError::Invalid(format!(
                "training.compute_jitter must be a coefficient of variation from 0 to 1, not {}",
                t.compute_jitter
            )));
        }
        if t.iterations == 0 {
            return Err(SimError::Invalid(
                "training.iterations must be at least 1 measured iteration".into(),
            ));
        }
        self.check_model()?;
        if let Some(p) = &s.priorities {
            let tensors: usize = self.model.layers.iter().map(|l| l.tensors.len()).sum();
            if p.len() != tensors {
                return Err(SimError::Invalid(format!(
                    "schedule.priorities has {} entries and the model {tensors} tensors: give \
                     one priority per tensor, in declaration order",
                    p.len()
                )));
            }
        }
        if self.trace.enabled && self.trace.max_events == 0 {
            return Err(SimError::Invalid(
                "trace.max_events must be at least 1".into(),
            ));
        }
        Ok(())
    }

    fn check_model(&self) -> Result<(), SimError> {
        let m = &self.model;
        if m.layers.is_empty() {
            return Err(SimError::Invalid(format!(
                "model '{}' has no layers",
                m.name
            )));
        }
        for (i, layer) in m.layers.iter().enumerate() {
            let at = format!("model '{}' layer {i} ('{}')", m.name, layer.name);
            non_negative(&format!("{at}: forward_s"), layer.forward_s, "seconds")?;
            non_negative(&format!("{at}: backward_s"), layer.backward_s, "seconds")?;
            for t in &layer.tensors {
                if t.bytes == 0 || t.bytes % 4 != 0 {
                    return Err(SimError::Invalid(format!(
                        "{at}: tensor '{}' has {} bytes; a float32 tensor has a positive \
                         multiple of 4",
                        t.name, t.bytes
                    )));
                }
            }
        }
        Ok(())
    }
}
