//! The communication service of one worker: joins the job, declares tensors, and runs
//! push_pull operations through the pipeline.
//!
//! - this file: joining the job (`start`), what the worker knows of it, leaving it;
//! - [`config`]: how a worker joins ([`CommConfig`]) and what it reports of its scheduling;
//! - [`declare`]: declaring tensors, laying them out in partitions, re-laying them out
//!   (the auto-tuner's knobs) and retiring them;
//! - [`exchange`]: starting operations (push_pull and its partial and asynchronous forms),
//!   through the machine's shared memory or the pipeline;
//! - [`waiting`]: waiting for an operation, and finding the cause of a failure;
//! - [`join`]: Horovod's `join()`, a worker that has finished its data.

mod config;
mod declare;
mod exchange;
mod join;
mod waiting;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sumflow_client::coordinator::CoordinatorClient;
use sumflow_client::ServerClient;
use sumflow_client::ServerOptions;
use sumflow_plan::lanes;
use sumflow_plan::partition::DEFAULT_PARTITION_BYTES;
use sumflow_plan::placement::ServerSet;
use sumflow_plan::scheduler::Schedule;
use sumflow_wire::{BarrierGroup, ClusterMap, Dtype, JobToken, Registration, Role};
use tracing::{debug, info, warn};

use crate::accounting::{KeyBytes, WireBytes};
use crate::error::CommError;
use crate::failures::{self, CoordinatorLoss};
use crate::handles::Handles;
use crate::local::SharedMemory;
use crate::pipeline::{Pipeline, ServerLink};
use crate::trace::{TraceError, TraceFile, Tracer};

pub use config::{CommConfig, Scheduling};
use config::{LAYOUT_CPU_SERVER_LANES, LAYOUT_PARTITION_BYTES, LAYOUT_SHARED_MEMORY};
pub use declare::Declaration;
use declare::Table;
pub use exchange::{Exchange, ReduceOp};

/// The most workers any machine of the job runs, the same on every worker.
fn most_workers_per_machine(map: &ClusterMap) -> u32 {
    let mut per_machine: HashMap<&str, u32> = HashMap::new();
    for w in &map.workers {
        *per_machine.entry(w.host_id.as_str()).or_default() += 1;
    }
    per_machine.into_values().max().unwrap_or(1)
}

/// The slowest link rate any worker registered, in bits a second (the same on every
/// worker); `None` when none knows its own. Workers that do not know theirs are left out:
/// the partition size's link floor is only ever raised by a rate someone reported.
fn slowest_link_bits(map: &ClusterMap) -> Option<u64> {
    map.workers
        .iter()
        .map(|w| w.link_mbit)
        .filter(|&mbit| mbit > 0)
        .min()
        .map(|mbit| u64::from(mbit) * 1_000_000)
}

/// The worker side of a job.
#[derive(Debug)]
pub struct CommunicationService {
    job: CoordinatorClient,
    servers: ServerSet,
    /// Shared with the shared-memory stage, which starts the network legs of rounds
    /// aggregated inside the machine first.
    pipeline: Arc<Pipeline>,
    handles: Arc<Handles>,
    table: Mutex<Table>,
    /// Lanes per server, by rank.
    lanes: Vec<u32>,
    declare_timeout: Duration,
    local: (u32, u32),
    tracer: Arc<Tracer>,
    /// What `join` needs to open its own connection to each server.
    token: JobToken,
    name: String,
    connect_timeout: Duration,
    local_sockets: bool,
    hierarchical: bool,
    /// The most workers any machine of the job runs (the cluster map's, fixed).
    workers_per_machine: u32,
    /// The slowest worker's link rate, bits a second, when known (the cluster map's).
    link_bits: Option<u64>,
    /// The shared-memory stage, unless turned off.
    shared: Option<SharedMemory>,
    /// Whether the credit and the push window are counted in partitions of the reference
    /// size (none was set), and so follow a derived partition size.
    follow: (bool, bool),
    /// Set once the coordinator is lost: every operation fails from then on.
    coordinator_loss: CoordinatorLoss,
    stall_warning: Option<Duration>,
    /// When the search for a failure's cause gives up: set by the first failure, shared
    /// by the ones after it, so that a step whose every tensor fails (a peer died)
    /// waits for the cause once, not once per tensor.
    cause_deadline: OnceLock<Instant>,
}

impl CommunicationService {
    /// Joins the job through its coordinator and connects to every summation server.
    pub fn start(cfg: CommConfig) -> Result<CommunicationService, CommError> {
        if cfg.partition_bytes == Some(0) {
            return Err(CommError::Invalid(
                "the partition size must be positive".into(),
            ));
        }
        let partition_bytes = cfg.layout_partition_bytes();
        if partition_bytes != cfg.partition_bytes && cfg.partition_bytes.is_some() {
            info!(
                partition_bytes = cfg.partition_bytes,
                "the fifo scheduler sends whole tensors: the partition size does not apply"
            );
        }
        if let Some(c) = cfg.connections_per_cpu_server {
            if !(1..=lanes::MAX).contains(&c) {
                return Err(CommError::Invalid(format!(
                    "connections per CPU server must be 1 to {}, not {c}",
                    lanes::MAX
                )));
            }
        }
        if let Some(trace) = &cfg.trace {
            trace.prepare()?;
        }
        let reg = Registration {
            role: Role::Worker,
            requested_rank: cfg.rank,
            host: String::new(),
            port: 0,
            host_id: cfg.host_id.clone(),
            pid: std::process::id(),
            link_mbit: cfg.link_mbit.unwrap_or(0),
            name: cfg.name.clone(),
        };
        let job = CoordinatorClient::join(
            &cfg.coordinator,
            &cfg.token,
            reg,
            cfg.join_timeout,
            cfg.coordinator_options.clone(),
        )?;
        let map = job.cluster_map().clone();
        let servers = ServerSet::from_cluster(&map)
            .map_err(|e| CommError::Invalid(format!("cannot place partitions: {e}")))?;
        let opts = ServerOptions {
            connect_timeout: cfg.connect_timeout,
            reply_timeout: None,
            machine_local: cfg.local_sockets,
            mailbox: cfg.server_shared_memory,
            ..ServerOptions::default()
        };
        let cpu_lanes = cfg.connections_per_cpu_server.unwrap_or_else(|| {
            // The non-colocated PS gives every server the same share: one lane each.
            if servers.colocated().is_empty() {
                1
            } else {
                lanes::per_cpu_server(servers.colocated().len() as u32, servers.cpu().len() as u32)
            }
        });
        let lanes: Vec<u32> = map
            .servers
            .iter()
            .map(|s| {
                if servers.cpu().contains(&s.rank) {
                    cpu_lanes
                } else {
                    1
                }
            })
            .collect();
        let mut links = Vec::new();
        // How the servers are reached: through shared memory, a Unix socket alone, TCP.
        let mut reached = [0usize; 3];
        for (s, &count) in map.servers.iter().zip(&lanes) {
            let mut lanes = Vec::new();
            for _ in 0..count {
                let c = ServerClient::connect(&s.addr(), &cfg.token, job.rank(), &cfg.name, &opts)?;
                if lanes.is_empty() {
                    reached[usize::from(!c.has_mailbox()) + usize::from(!c.is_machine_local())] +=
                        1;
                }
                lanes.push((c.tx, c.rx));
            }
            links.push(ServerLink {
                name: format!("server {} ({})", s.rank, s.addr()),
                lanes,
            });
        }
        // Said once per job (by worker 0, as the partition size is), the others in debug.
        let reached = format!(
            "{} summation server(s): {} through shared memory, {} through a Unix socket, {} \
             over TCP",
            map.servers.len(),
            reached[0],
            reached[1],
            reached[2]
        );
        if job.rank() == 0 {
            info!("{reached}");
        } else {
            debug!("{reached}");
        }
        // Every worker must cut tensors into the same partitions and pieces, or the servers
        // wait for keys the others never send. Declared as tensors, the layout is compared
        // by the coordinator like any declaration: a worker that differs fails every
        // worker at once with a DeclarationMismatchError naming the setting and both values.
        for (name, value) in [
            // No partition is 1 byte (every dtype is wider): 1 says "derived".
            (LAYOUT_PARTITION_BYTES, partition_bytes.unwrap_or(1)),
            (LAYOUT_CPU_SERVER_LANES, u64::from(cpu_lanes)),
            // A declaration has at least one element: 1 is off, 2 on.
            (LAYOUT_SHARED_MEMORY, 1 + u64::from(cfg.shared_memory)),
        ] {
            job.declare(name, Dtype::I64, value, cfg.declare_timeout)?;
        }
        let tracer = Arc::new(match cfg.trace {
            Some(trace) => Tracer::new(trace, job.rank(), &cfg.name)?,
            None => Tracer::without_window(job.rank(), &cfg.name),
        });
        let handles = Arc::new(Handles::default());
        let shared = if cfg.shared_memory {
            let shared = SharedMemory::open(
                &map,
                job.rank(),
                &cfg.coordinator,
                Arc::clone(&handles),
                job.failures(),
                Arc::clone(&tracer),
                slowest_link_bits(&map),
            )?;
            // Every worker has registered in its machine's area once all pass this.
            job.barrier(BarrierGroup::Workers, cfg.declare_timeout)?;
            shared.verify(&cfg.host_id)?;
            Some(shared)
        } else {
            None
        };
        let reference = partition_bytes.unwrap_or(DEFAULT_PARTITION_BYTES);
        let workers_per_machine = most_workers_per_machine(&map);
        let mut schedule = Schedule::for_machines(cfg.scheduler, reference, workers_per_machine);
        if let Some(credit) = cfg.credit_bytes {
            schedule.credit_bytes = credit;
        }
        if let Some(window) = cfg.push_window_bytes {
            schedule.window_bytes = window;
        }
        schedule.prophet = cfg.prophet.clone();
        let pipeline = Arc::new(Pipeline::start(
            links,
            Arc::clone(&handles),
            schedule,
            reference,
            Arc::clone(&tracer),
            job.rank(),
            map.workers.iter().map(|w| w.name.clone()).collect(),
        )?);
        let coordinator_loss = failures::watch(
            job.failures(),
            pipeline.server_failures(),
            Arc::clone(&handles),
        )
        .map_err(|source| CommError::Io {
            what: "cannot start the thread that acts on failure notices".into(),
            source: Arc::new(source),
        })?;
        let local = local_rank(&map, job.rank());
        let link_bits = slowest_link_bits(&map);
        info!(
            rank = job.rank(),
            workers = map.workers.len(),
            servers = map.servers.len(),
            cpu_lanes,
            scheduler = %cfg.scheduler,
            link_mbit = link_bits.map_or(0, |b| b / 1_000_000),
            "joined job {}",
            map.job_id
        );
        Ok(CommunicationService {
            job,
            servers,
            pipeline,
            handles,
            table: Mutex::new(Table {
                tensors: HashMap::new(),
                groups: Vec::new(),
                layouts: vec![partition_bytes],
                generation: 0,
                reference,
                reason: None,
            }),
            lanes,
            declare_timeout: cfg.declare_timeout,
            local,
            tracer,
            token: cfg.token.clone(),
            name: cfg.name.clone(),
            connect_timeout: cfg.connect_timeout,
            local_sockets: cfg.local_sockets,
            hierarchical: cfg.hierarchical,
            workers_per_machine,
            link_bits,
            shared,
            follow: (cfg.credit_bytes.is_none(), cfg.push_window_bytes.is_none()),
            coordinator_loss,
            stall_warning: cfg.stall_warning,
            cause_deadline: OnceLock::new(),
        })
    }

    pub fn rank(&self) -> u32 {
        self.job.rank()
    }

    /// Number of workers.
    pub fn size(&self) -> u32 {
        self.job.cluster_map().workers.len() as u32
    }

    /// This worker's rank among the workers of its machine.
    pub fn local_rank(&self) -> u32 {
        self.local.0
    }

    /// Number of workers on this machine.
    pub fn local_size(&self) -> u32 {
        self.local.1
    }

    pub fn cluster_map(&self) -> &ClusterMap {
        self.job.cluster_map()
    }

    /// Whether every worker machine runs the same number of workers (Horovod's
    /// `is_homogeneous`).
    pub fn is_homogeneous(&self) -> bool {
        let workers = &self.cluster_map().workers;
        workers
            .iter()
            .all(|w| local_rank(self.cluster_map(), w.rank).1 == self.local_size())
    }

    /// The measured rate at which partitions complete (bytes per second), once measured.
    pub fn bandwidth(&self) -> Option<f64> {
        self.pipeline.bandwidth()
    }

    /// The bytes this worker wrote to and read from the summation servers so far, per key
    /// (with its tensor), and those no key names (see [`KeyBytes`]).
    pub fn wire_bytes(&self) -> (Vec<KeyBytes>, WireBytes) {
        self.pipeline.wire_bytes()
    }

    /// This worker's trace recorder, for the pipeline's stages and the scheduler.
    pub fn tracer(&self) -> Arc<Tracer> {
        Arc::clone(&self.tracer)
    }

    /// Marks the end of a training step's backward pass (the plugin calls it at each
    /// optimizer step): Prophet closes its profile of the iteration and lets out what it
    /// held, and the trace window counts steps by it. Returns the trace file when this step
    /// ended the window and it was written.
    pub fn mark_step(&self) -> Result<Option<TraceFile>, TraceError> {
        self.pipeline.mark_step();
        self.tracer.mark_step()
    }

    /// Leaves the job gracefully; operations still in flight fail with
    /// [`CommError::Shutdown`], and so does every later one. A trace window cut short is
    /// written first ([`Tracer::flush`]), and so is an interval still being recorded
    /// ([`Tracer::stop_interval`]). Calls after the first do nothing.
    pub fn shutdown(&self, reason: &str) -> Result<(), CommError> {
        self.pipeline.shutdown(reason);
        if let Some(shared) = &self.shared {
            shared.stop();
        }
        // A trace that cannot be written must not fail leaving the job: it is logged.
        if let Err(e) = self.tracer.flush() {
            warn!("{e}");
        }
        if let Err(e) = self.tracer.stop_interval() {
            warn!("{e}");
        }
        Ok(self.job.leave(reason)?)
    }
}

/// (rank among the workers of this machine, number of them).
fn local_rank(map: &ClusterMap, rank: u32) -> (u32, u32) {
    let Some(me) = map.workers.get(rank as usize) else {
        return (0, 1);
    };
    let peers: Vec<u32> = map
        .workers
        .iter()
        .filter(|w| w.host_id == me.host_id)
        .map(|w| w.rank)
        .collect();
    let local = peers.iter().position(|r| *r == rank).unwrap_or(0) as u32;
    (local, peers.len() as u32)
}

#[cfg(test)]
mod link_tests {
    use super::*;
    use sumflow_wire::NodeInfo;

    fn map(rates: &[u32]) -> ClusterMap {
        let node = |(rank, &link_mbit): (usize, &u32)| NodeInfo {
            rank: rank as u32,
            host: "10.0.0.1".into(),
            port: 0,
            host_id: format!("m{rank}"),
            pid: 1,
            link_mbit,
            name: format!("w{rank}"),
        };
        ClusterMap {
            job_id: "j".into(),
            workers: rates.iter().enumerate().map(node).collect(),
            servers: Vec::new(),
        }
    }

    #[test]
    fn the_slowest_known_worker_link_sets_the_rate() {
        assert_eq!(
            slowest_link_bits(&map(&[100_000, 25_000, 0])),
            Some(25_000_000_000)
        );
        assert_eq!(slowest_link_bits(&map(&[0, 0])), None);
        assert_eq!(slowest_link_bits(&map(&[])), None);
    }
}
