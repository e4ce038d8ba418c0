//! The communication service of one worker: joins the job, declares tensors, and runs
//! push_pull operations through the pipeline.

use std::collections::HashMap;
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::server::Reply;
use sumflow_client::{ClientError, ServerClient, ServerOptions};
use sumflow_plan::hierarchy;
use sumflow_plan::lanes;
use sumflow_plan::layout::{Layout, MAX_GENERATIONS, MAX_TENSOR_ID};
use sumflow_plan::partition::{
    derived_partition_bytes, DerivedSize, Partition, TensorSpec, DEFAULT_PARTITION_BYTES,
    WHOLE_TENSOR_BYTES,
};
use sumflow_plan::placement::ServerSet;
use sumflow_plan::scheduler::prophet::ProphetConfig;
use sumflow_plan::scheduler::{Schedule, SchedulerKind};
use sumflow_wire::timing;
use sumflow_wire::{
    BarrierGroup, ClusterMap, Dtype, ErrorCode, JobToken, KeyCodec, Message, ReduceOp as WireOp,
    Registration, Role,
};
use tracing::{debug, info, warn};

use crate::accounting::{KeyBytes, WireBytes};
use crate::compression::Compression;
use crate::error::CommError;
use crate::failures::{self, CoordinatorLoss};
use crate::handles::Handles;
use crate::local::cross::{self, Round};
use crate::local::{LocalOp, SharedMemory, LOCAL_KEY, LOCAL_SERVER};
use crate::pipeline::{Delta, HostSlice, PartTask, Pipeline, ServerLink};
use crate::trace::{TraceConfig, TraceError, TraceFile, Tracer};

/// How often a wait looks for a job-fatal error from the coordinator.
const JOB_ERROR_CHECK: Duration = Duration::from_millis(100);

/// How long a failed wait looks for a job-fatal error that may explain the failure.
const JOB_ERROR_GRACE: Duration = Duration::from_millis(300);

/// Names under which a worker declares its layout settings (their values as the element
/// count), so that workers set up differently fail with a clear mismatch.
const LAYOUT_PARTITION_BYTES: &str = "sumflow.setting.partition_bytes (SUMFLOW_PARTITION_BYTES)";
const LAYOUT_CPU_SERVER_LANES: &str =
    "sumflow.setting.cpu_server_connections (SUMFLOW_CPU_SERVER_CONNECTIONS)";
const LAYOUT_SHARED_MEMORY: &str = "sumflow.setting.shared_memory (SUMFLOW_SHARED_MEMORY)";

/// How a worker joins its job.
#[derive(Clone, Debug)]
pub struct CommConfig {
    /// The coordinator's address (host:port).
    pub coordinator: String,
    pub token: JobToken,
    /// A rank to ask for (torchrun's RANK); `None` lets the coordinator choose.
    pub rank: Option<u32>,
    /// Shown in other nodes' error messages.
    pub name: String,
    /// Machine identity: workers with the same one share a machine and its colocated server.
    pub host_id: String,
    /// The size tensors are cut into, except under `fifo`, which sends whole tensors;
    /// `None`: derived from each declaration and the number of servers
    /// ([`derived_partition_bytes`]).
    pub partition_bytes: Option<u64>,
    /// This worker's link rate in Mbit/s as the job states it; `None`: the kernel's figure
    /// for the interface the coordinator is reached by (`sumflow_client::coordinator`).
    /// The slowest worker's known rate sets the derived partition size's link floor.
    pub link_mbit: Option<u32>,
    /// Which scheduler decides when partitions go out (see [`sumflow_plan::scheduler`]).
    pub scheduler: SchedulerKind,
    /// Unacknowledged bytes per server, the scheduler's credit (ByteScheduler and Prophet);
    /// `None`: 2 partitions; 0: unbounded.
    pub credit_bytes: Option<u64>,
    /// Bytes a worker may have pushed to one server whose sums have not come back yet
    /// (the push window that paces workers against each other); `None`: 4 partitions;
    /// 0: unbounded.
    pub push_window_bytes: Option<u64>,
    /// Prophet's knobs (only the `prophet` scheduler reads them).
    pub prophet: ProphetConfig,
    /// Connections to each CPU server, each partition for it cut into one piece per
    /// connection; colocated servers get one. `None`: round(c/g) of Eq. 1 and 2, so that
    /// TCP's per-connection fairness gives each server its share of every link (see
    /// [`sumflow_plan::lanes`]); at most [`lanes::MAX`]. Pieces are keys, so every worker of a
    /// job must use the same value, as it must the same partition size.
    pub connections_per_cpu_server: Option<u32>,
    pub join_timeout: Duration,
    /// Longest wait for the coordinator to answer a declaration.
    pub declare_timeout: Duration,
    pub coordinator_options: CoordinatorOptions,
    pub connect_timeout: Duration,
    /// Record a Chrome trace of a window of steps (see [`crate::trace`]); `None`: off.
    pub trace: Option<TraceConfig>,
    /// Sum the tensors whose members all share this worker's machine in the machine's
    /// shared memory rather than through a summation server (see [`crate::local`]). Every
    /// worker of a job must agree.
    pub shared_memory: bool,
    /// Reach a summation server on this worker's machine through its Unix socket rather
    /// than TCP (`sumflow_client::link`).
    pub local_sockets: bool,
    /// Over those Unix sockets, pass payloads through a mailbox shared with the server
    /// (`sumflow_client::mailbox`, BytePS §6.2): the server sums a push where the worker
    /// put it, and lends the sum back the same way.
    pub server_shared_memory: bool,
    /// With `shared_memory`, aggregate a tensor whose members span machines inside each
    /// machine first (`crate::local::cross`). Workers need not agree: the keys are the
    /// same either way.
    pub hierarchical: bool,
    /// After how long a `wait` logs what it still waits for (and again after each further
    /// such stretch); `None`: never.
    pub stall_warning: Option<Duration>,
}

impl CommConfig {
    pub fn new(coordinator: &str, token: JobToken, host_id: &str) -> CommConfig {
        CommConfig {
            coordinator: coordinator.to_string(),
            token,
            rank: None,
            name: format!("worker pid {}", std::process::id()),
            host_id: host_id.to_string(),
            partition_bytes: None,
            link_mbit: None,
            scheduler: SchedulerKind::default(),
            credit_bytes: None,
            push_window_bytes: None,
            prophet: ProphetConfig::default(),
            connections_per_cpu_server: None,
            join_timeout: timing::DEFAULT_JOIN_TIMEOUT,
            declare_timeout: timing::DEFAULT_JOIN_TIMEOUT,
            coordinator_options: CoordinatorOptions::default(),
            connect_timeout: timing::DEFAULT_CONNECT_TIMEOUT,
            trace: None,
            shared_memory: true,
            hierarchical: true,
            local_sockets: true,
            server_shared_memory: true,
            stall_warning: Some(timing::DEFAULT_STALL_WARNING),
        }
    }

    /// The size tensors are cut into: `partition_bytes` (`None`: derived per
    /// declaration), or under `fifo` whole tensors (up to [`WHOLE_TENSOR_BYTES`]).
    pub fn layout_partition_bytes(&self) -> Option<u64> {
        if self.scheduler.sends_whole_tensors() {
            Some(WHOLE_TENSOR_BYTES)
        } else {
            self.partition_bytes
        }
    }
}

/// The scheduler in use and the knobs the auto-tuner changes
/// ([`CommunicationService::reconfigure`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduling {
    pub scheduler: SchedulerKind,
    /// The size tensors are cut into now (see [`CommConfig::layout_partition_bytes`]);
    /// when derived, that of the last group declared (before any, BytePS's 4 MiB).
    pub partition_bytes: u64,
    /// Whether the partition size is derived from each declaration rather than set.
    pub derived: bool,
    /// Why the last group got its derived size (see [`derived_partition_bytes`]).
    pub reason: Option<String>,
    /// The credit per server: how many bytes pushed to it may wait for its
    /// acknowledgement; 0: unbounded (fifo has none and p3 one partition, whatever this
    /// says).
    pub credit_bytes: u64,
}

/// How a push_pull combines the workers' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the number of workers.
    Average,
    /// Element-wise minimum, maximum or product, by the servers' kernels.
    Min,
    Max,
    Product,
}

impl ReduceOp {
    /// What the servers do with the round's pushes.
    fn on_servers(self) -> WireOp {
        match self {
            ReduceOp::Sum | ReduceOp::Average => WireOp::Sum,
            ReduceOp::Min => WireOp::Min,
            ReduceOp::Max => WireOp::Max,
            ReduceOp::Product => WireOp::Product,
        }
    }
}

/// Which bytes of a push_pull's tensor this worker contributes and which it takes back.
/// The servers work by partition: a partition that meets a range is pushed (or taken)
/// whole, so ranges need not fall on partition boundaries, but the bytes of a pushed
/// partition outside this worker's ranges must hold the op's identity (zeros for a sum).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exchange {
    /// Byte ranges this worker contributes; `None`: all of the tensor. For a partition
    /// that meets none, the worker takes part in its round with an empty push: nothing
    /// but a frame header crosses the wire.
    pub pushes: Option<Vec<Range<u64>>>,
    /// Byte ranges this worker takes back; `None`: all of the tensor. A partition that
    /// meets none is left as it is; only the notice that its round is complete comes back.
    pub pulls: Option<Vec<Range<u64>>>,
}

impl Exchange {
    /// The whole tensor both ways: an allreduce.
    pub const ALL: Exchange = Exchange {
        pushes: None,
        pulls: None,
    };

    fn meets(ranges: &Option<Vec<Range<u64>>>, part: &Partition) -> bool {
        let end = part.offset + part.bytes;
        ranges
            .as_deref()
            .is_none_or(|rs| rs.iter().any(|r| r.start < end && part.offset < r.end))
    }

    fn check(&self, name: &str, len: u64) -> Result<(), CommError> {
        for (what, ranges) in [("pushes", &self.pushes), ("pulls", &self.pulls)] {
            for r in ranges.iter().flatten() {
                if r.start >= r.end || r.end > len {
                    return Err(CommError::Invalid(format!(
                        "tensor '{name}': the byte range {r:?} this worker {what} is empty or \
                         outside the tensor's {len} bytes"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// A declared tensor: its partitions and where each goes.
#[derive(Debug)]
struct Tensor {
    id: u32,
    name: Arc<str>,
    dtype: Dtype,
    elements: u64,
    /// How its partitions travel; `None`: raw elements.
    compression: Option<Compression>,
    /// The workers that sum it, ascending; `None`: every worker.
    members: Option<Arc<[u32]>>,
    /// The worker on whose machine its partitions are kept, if any (see `Declaration`).
    home: Option<u32>,
    /// Its shape as declared, if one was.
    shape: Option<Arc<[u64]>>,
    /// The group it was declared and placed with, if any.
    group: Option<usize>,
    /// Its partitions, each with its server, in the tensor's order.
    parts: Vec<Partition>,
    /// The last round pushed, per layout generation: each generation's keys count their
    /// own rounds on the servers.
    rounds: Vec<u64>,
    /// Partitions of earlier layouts (partition sizes) it was pushed under: their keys
    /// live on the servers too, until retired.
    earlier: Vec<Partition>,
}

impl Tensor {
    /// Counts a push under layout `generation` and returns its round (each generation's
    /// keys count their own rounds on the servers).
    fn next_round(&mut self, generation: usize) -> u64 {
        if self.rounds.len() <= generation {
            self.rounds.resize(generation + 1, 0);
        }
        self.rounds[generation] += 1;
        self.rounds[generation]
    }

    fn new(decl: &Declaration<'_>, id: u32, group: Option<usize>, parts: Vec<Partition>) -> Tensor {
        Tensor {
            id,
            name: Arc::from(decl.name),
            dtype: decl.dtype,
            elements: decl.elements,
            compression: decl.compression,
            members: decl.members.map(Arc::from),
            home: decl.home,
            shape: decl.shape.map(Arc::from),
            group,
            parts,
            rounds: Vec::new(),
            earlier: Vec::new(),
        }
    }

    fn declaration(&self) -> Declaration<'_> {
        Declaration {
            name: &self.name,
            dtype: self.dtype,
            elements: self.elements,
            compression: self.compression,
            members: self.members.as_deref(),
            home: self.home,
            shape: self.shape.as_deref(),
        }
    }

    /// Refuses a declaration of the same tensor with another compression or other members.
    fn check_same(&self, decl: &Declaration<'_>) -> Result<(), CommError> {
        if self.compression != decl.compression {
            let show = |c: Option<Compression>| c.map_or("uncompressed".into(), |c| c.to_string());
            return Err(CommError::Invalid(format!(
                "tensor '{}' was declared {} and now {}: a tensor keeps the compression it \
                 was first declared with",
                self.name,
                show(self.compression),
                show(decl.compression)
            )));
        }
        if self.members.as_deref() != decl.members {
            return Err(CommError::Invalid(format!(
                "tensor '{}' was declared {} and now {}: a tensor keeps the members it was \
                 first declared with",
                self.name,
                members_text(self.members.as_deref()),
                members_text(decl.members)
            )));
        }
        Ok(())
    }
}

/// A tensor's members, for messages: "for workers [0, 2]", or "for every worker".
fn members_text(members: Option<&[u32]>) -> String {
    match members {
        Some(m) => format!("for workers {m:?}"),
        None => "for every worker".into(),
    }
}

/// A tensor to declare: its name, element type and count, how it is compressed, and which
/// workers sum it.
#[derive(Clone, Copy, Debug)]
pub struct Declaration<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub elements: u64,
    /// `None` sends raw elements; compressors take f32 tensors only.
    pub compression: Option<Compression>,
    /// The workers whose tensors are summed (a Horovod process set): distinct ranks of the
    /// job in ascending order, every one of which must declare the tensor the same way and
    /// push it every time; the others must not push it. `None`: every worker. Uncompressed
    /// tensors only.
    pub members: Option<&'a [u32]>,
    /// The worker that takes the tensor's bytes, when one does (a relay region): every
    /// partition is then kept by the summation server on that worker's machine, so the bytes
    /// cross one link instead of two. Without a colocated server there, or with `None`, the
    /// partitions are placed from their keys as usual.
    pub home: Option<u32>,
    /// Its shape (the product of which is `elements`), which every worker's declaration
    /// must then match too, as Horovod checks: tensors of one size but other shapes
    /// ([32, 32] and [16, 64]) would otherwise be summed element by element, silently.
    /// `None`: a flat buffer, checked by size alone.
    pub shape: Option<&'a [u64]>,
}

impl<'a> Declaration<'a> {
    /// An uncompressed tensor.
    pub fn raw(name: &'a str, dtype: Dtype, elements: u64) -> Declaration<'a> {
        Declaration {
            name,
            dtype,
            elements,
            compression: None,
            members: None,
            home: None,
            shape: None,
        }
    }

    /// What partitioning needs to know of it.
    fn spec(self) -> TensorSpec<'a> {
        TensorSpec {
            name: self.name,
            elements: self.elements,
            dtype: self.dtype,
        }
    }

    /// Checks what can be checked before asking the coordinator, in a job of `workers`.
    fn check(&self, workers: u32) -> Result<(), CommError> {
        let invalid =
            |why: String| Err(CommError::Invalid(format!("tensor '{}' {why}", self.name)));
        if let Some(home) = self.home.filter(|&w| w >= workers) {
            return invalid(format!(
                "is to be kept on worker {home}'s machine, but this job has workers \
                 0..{workers}"
            ));
        }
        if let Some(shape) = self.shape {
            let product = shape.iter().try_fold(1u64, |acc, d| acc.checked_mul(*d));
            if product != Some(self.elements) {
                return invalid(format!(
                    "is declared with {} elements but shape {shape:?}",
                    self.elements
                ));
            }
        }
        if let (Some(c), dtype) = (self.compression, self.dtype) {
            if dtype != Dtype::F32 {
                return invalid(format!(
                    "holds {dtype}: {c} compresses f32 tensors only (cast it, or leave it \
                     uncompressed)"
                ));
            }
        }
        let Some(members) = self.members else {
            return Ok(());
        };
        if let Some(c) = self.compression {
            // Servers re-encode compressed sums for every worker alike; process sets sum
            // raw tensors.
            return invalid(format!(
                "is compressed by {c}: a tensor of some workers only must be uncompressed"
            ));
        }
        if members.is_empty() {
            return invalid("has an empty member list: name at least one worker".into());
        }
        for pair in members.windows(2) {
            if pair[0] == pair[1] {
                return invalid(format!("lists worker {} twice among its members", pair[0]));
            }
            if pair[0] > pair[1] {
                return invalid(format!(
                    "lists its members {members:?} out of order: ranks must be ascending"
                ));
            }
        }
        match members.iter().find(|&&r| r >= workers) {
            Some(rank) => invalid(format!(
                "names worker {rank} among its members, but this job has workers 0..{workers}"
            )),
            None => Ok(()),
        }
    }

    /// Its shape and how it travels, for people and for the coordinator, which compares it
    /// as text across workers like dtype and size: "shaped [32, 32]", "compressed by topk
    /// (ratio 0.01) with error feedback", "summed over workers [0, 2]" (never both of the
    /// last two: see `check`), or empty for a flat raw tensor of every worker.
    fn travel(&self) -> String {
        let how = match (self.compression, self.members) {
            (Some(c), _) => format!("compressed by {c}"),
            (None, Some(m)) => format!("summed over workers {m:?}"),
            (None, None) => String::new(),
        };
        let how = match self.home {
            None => how,
            Some(w) if how.is_empty() => format!("kept on worker {w}'s machine"),
            Some(w) => format!("{how}, kept on worker {w}'s machine"),
        };
        match self.shape {
            None => how,
            Some(shape) if how.is_empty() => format!("shaped {shape:?}"),
            Some(shape) => format!("shaped {shape:?}, {how}"),
        }
    }
}

/// The declared tensors and how they are laid out.
#[derive(Debug)]
struct Table {
    tensors: HashMap<u32, Tensor>,
    /// Tensor ids of each declared group, in declaration order.
    groups: Vec<Vec<u32>>,
    /// Every partition size used so far (`None`: derived per declaration); a layout's
    /// generation is its index here, so going back to a size reuses its keys (and the
    /// servers' memory for them).
    layouts: Vec<Option<u64>>,
    generation: usize,
    /// The partition size the scheduler's default credit and push window are counted in:
    /// the set size, or the derived size of the last group declared.
    reference: u64,
    /// Why the last group got its derived size.
    reason: Option<String>,
}

impl Table {
    fn partition_bytes(&self) -> Option<u64> {
        self.layouts[self.generation]
    }
}

/// The bytes of a tensor's elements.
fn spec_bytes(spec: &TensorSpec<'_>) -> u64 {
    spec.elements.saturating_mul(spec.dtype.size() as u64)
}

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

/// The one "partition" of an operation summed in the machine's shared memory.
fn local_partition(tensor: u32, len: usize) -> Partition {
    Partition {
        key: LOCAL_KEY,
        tensor,
        offset: 0,
        bytes: len as u64,
        server: LOCAL_SERVER,
    }
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

    /// Declares one uncompressed tensor; every worker must declare it with the same dtype
    /// and size. Returns its id. Its partitions are placed from their keys alone, so
    /// workers may declare tensors in any order.
    pub fn declare(&self, name: &str, dtype: Dtype, elements: u64) -> Result<u32, CommError> {
        self.declare_one(&Declaration::raw(name, dtype, elements))
    }

    /// Declares one tensor, compressed or not (see [`Self::declare`]); every worker must
    /// declare it with the same compression too.
    pub fn declare_one(&self, decl: &Declaration<'_>) -> Result<u32, CommError> {
        decl.check(self.size())?;
        let id = self.declare_id(decl)?;
        let mut table = self.table.lock().expect("table lock");
        match table.tensors.get(&id) {
            Some(t) => t.check_same(decl)?,
            None => {
                let parts = self.place_alone(&table, id, decl)?;
                table.tensors.insert(id, Tensor::new(decl, id, None, parts));
            }
        }
        Ok(id)
    }

    /// Declares a group of uncompressed tensors (see [`Self::declare_groups`]).
    pub fn declare_group(&self, tensors: &[(&str, Dtype, u64)]) -> Result<Vec<u32>, CommError> {
        let decls: Vec<Declaration<'_>> = tensors
            .iter()
            .map(|&(name, dtype, elements)| Declaration::raw(name, dtype, elements))
            .collect();
        self.declare_groups(&decls)
    }

    /// Declares a group of tensors (a model's parameters) and places their partitions
    /// together, balancing bytes over the servers by BytePS's Eq. 1 and 2. Every worker
    /// must declare the same group.
    pub fn declare_groups(&self, decls: &[Declaration<'_>]) -> Result<Vec<u32>, CommError> {
        let mut ids = Vec::with_capacity(decls.len());
        for decl in decls {
            decl.check(self.size())?;
            ids.push(self.declare_id(decl)?);
        }
        let mut table = self.table.lock().expect("table lock");
        // A repeated declaration keeps its first placement and round count.
        let mut fresh: Vec<(u32, Declaration<'_>)> = Vec::new();
        for (&id, decl) in ids.iter().zip(decls) {
            match table.tensors.get(&id) {
                Some(t) => t.check_same(decl)?,
                None => fresh.push((id, *decl)),
            }
        }
        if fresh.is_empty() {
            return Ok(ids);
        }
        let specs: Vec<(u32, TensorSpec<'_>)> =
            fresh.iter().map(|(id, d)| (*id, d.spec())).collect();
        let bytes = specs.iter().map(|(_, t)| spec_bytes(t)).sum();
        // Every server counts, also colocated ones that Eq. 2 gives nothing at k >= n:
        // there the CPU servers then get twice the partitions, which measured better on
        // the emulated cluster (n = k = 4, 1 Gbit/s, 64 MB: 0.95x of Eq. 6 in 256 KiB
        // partitions against 0.91-0.92x in the 512 KiB that counting summing servers only
        // gives).
        let derived = self.derived(&table, bytes, self.servers.len());
        let partition_bytes = derived.as_ref().map(|d| d.bytes);
        let laid = self.layout(&table, partition_bytes).group(&specs)?.tensors;
        if let Some(derived) = derived {
            info!(
                tensors = specs.len(),
                partition_bytes = derived.bytes,
                "partition size derived for a group: {}",
                derived.reason
            );
            self.follow_partition_size(&mut table, derived.bytes);
            table.reason = Some(derived.reason);
        }
        let group = table.groups.len();
        table.groups.push(fresh.iter().map(|t| t.0).collect());
        for ((id, decl), parts) in fresh.iter().zip(laid) {
            let t = Tensor::new(decl, *id, Some(group), parts);
            table.tensors.insert(*id, t);
        }
        Ok(ids)
    }

    fn declare_id(&self, decl: &Declaration<'_>) -> Result<u32, CommError> {
        let Declaration {
            name,
            dtype,
            elements,
            ..
        } = *decl;
        let id = self.job.declare_compressed(
            name,
            dtype,
            elements,
            &decl.travel(),
            self.declare_timeout,
        )?;
        check_tensor_id(name, id)?;
        Ok(id)
    }

    /// The partitions of a tensor declared alone, under the table's partition size or the
    /// size derived from the tensor (over one server when it has a home).
    fn place_alone(
        &self,
        table: &Table,
        id: u32,
        decl: &Declaration<'_>,
    ) -> Result<Vec<Partition>, CommError> {
        let servers = match self.home_server(decl) {
            Some(_) => 1,
            None => self.servers.len(),
        };
        let derived = self.derived(table, spec_bytes(&decl.spec()), servers);
        let layout = self.layout(table, derived.map(|d| d.bytes));
        self.place_alone_in(&layout, id, decl)
    }

    /// The partitions of a tensor declared alone under `layout`: on its home worker's
    /// machine's server, or each where its key falls.
    fn place_alone_in(
        &self,
        layout: &Layout<'_>,
        id: u32,
        decl: &Declaration<'_>,
    ) -> Result<Vec<Partition>, CommError> {
        Ok(match self.home_server(decl) {
            Some(server) => layout.pinned(id, &decl.spec(), server)?,
            None => layout.single(id, &decl.spec())?,
        })
    }

    /// The colocated server of the worker a tensor is kept for, if it has one.
    fn home_server(&self, decl: &Declaration<'_>) -> Option<u32> {
        decl.home
            .and_then(|w| self.cluster_map().colocated_servers(w).first().copied())
    }

    /// The partition size derived for a declaration of `bytes` over `servers` servers, if
    /// the table has none set.
    fn derived(&self, table: &Table, bytes: u64, servers: usize) -> Option<DerivedSize> {
        table.partition_bytes().is_none().then(|| {
            // Alone on one server (a colocated one, one connection) or spread over all.
            let lanes = if servers == 1 { 1 } else { self.max_lanes() };
            let carriers = if servers == 1 {
                1
            } else {
                self.workers_per_machine
            };
            derived_partition_bytes(bytes, servers, lanes, carriers, self.link_bits)
        })
    }

    /// The layout in the table's generation with its set partition size, or `derived`.
    fn layout(&self, table: &Table, derived: Option<u64>) -> Layout<'_> {
        Layout {
            servers: &self.servers,
            lanes: &self.lanes,
            partition_bytes: derived
                .or(table.partition_bytes())
                .expect("a derived size where the table has none"),
            generation: table.generation,
        }
    }

    /// The most connections this worker has to one server.
    fn max_lanes(&self) -> u32 {
        self.lanes.iter().copied().max().unwrap_or(1)
    }

    /// Counts the default credit and push window in partitions of `bytes` (a group's
    /// derived size): a window of 4 partitions of 4 MiB would let dozens of small ones run
    /// ahead, and one of 4 small ones would hold back large ones.
    fn follow_partition_size(&self, table: &mut Table, bytes: u64) {
        table.reference = bytes;
        let (credit, window) = self.follow;
        let kind = self.pipeline.schedule().kind;
        let schedule = Schedule::for_machines(kind, bytes, self.workers_per_machine);
        if credit {
            self.pipeline.set_credit(schedule.credit_bytes, bytes);
        }
        if window {
            self.pipeline.set_window(schedule.window_bytes);
        }
    }

    /// Changes the partition size and/or the credit per server (the auto-tuner's knobs).
    ///
    /// Every worker must make the same call between the same two steps, with no push_pull
    /// in flight: partitions are keys, and workers cutting a tensor differently would wait
    /// for each other's keys forever. A new partition size re-cuts and re-places every
    /// declared tensor under keys of their own (a size used before gets its old keys back),
    /// so the servers never mix partitions of two layouts.
    pub fn reconfigure(
        &self,
        partition_bytes: Option<u64>,
        credit_bytes: Option<u64>,
    ) -> Result<(), CommError> {
        let mut table = self.table.lock().expect("table lock");
        let busy = self.handles.busy();
        if busy > 0 {
            return Err(CommError::Invalid(format!(
                "reconfigure() with {busy} push_pull operation(s) in flight: wait for them \
                 first (every worker must switch between the same two steps)"
            )));
        }
        if let Some(bytes) = partition_bytes.filter(|&b| Some(b) != table.partition_bytes()) {
            let kind = self.pipeline.schedule().kind;
            if kind.sends_whole_tensors() {
                return Err(CommError::Invalid(format!(
                    "the {kind} scheduler sends whole tensors: it has no partition size to \
                     change (bytescheduler and prophet cut tensors into partitions)"
                )));
            }
            if bytes == 0 {
                return Err(CommError::Invalid(
                    "the partition size must be positive".into(),
                ));
            }
            let generation = match table.layouts.iter().position(|&b| b == Some(bytes)) {
                Some(g) => g,
                None if table.layouts.len() < MAX_GENERATIONS => table.layouts.len(),
                None => {
                    return Err(CommError::Invalid(format!(
                        "{MAX_GENERATIONS} partition sizes were used already: a job can use at \
                         most that many"
                    )))
                }
            };
            // Lay everything out under the new size first, so a failure changes nothing.
            let next = Layout {
                servers: &self.servers,
                lanes: &self.lanes,
                partition_bytes: bytes,
                generation,
            };
            let mut parts: HashMap<u32, Vec<Partition>> = HashMap::new();
            for t in table.tensors.values().filter(|t| t.group.is_none()) {
                parts.insert(t.id, self.place_alone_in(&next, t.id, &t.declaration())?);
            }
            for ids in &table.groups {
                let members: Vec<(u32, TensorSpec<'_>)> = ids
                    .iter()
                    .map(|id| (*id, table.tensors[id].declaration().spec()))
                    .collect();
                for (id, laid) in ids.iter().zip(next.group(&members)?.tensors) {
                    parts.insert(*id, laid);
                }
            }
            let current = table.generation;
            for (id, laid) in parts {
                let t = table.tensors.get_mut(&id).expect("laid out");
                if t.rounds.get(current).is_some_and(|r| *r > 0) {
                    t.earlier.extend_from_slice(&t.parts);
                }
                let old = std::mem::replace(&mut t.parts, laid);
                if t.compression.is_some_and(|c| c.feedback) {
                    self.pipeline.relayout_residuals(&old, &t.parts);
                }
            }
            if generation == table.layouts.len() {
                table.layouts.push(Some(bytes));
            }
            table.generation = generation;
            table.reference = bytes;
            info!(
                partition_bytes = bytes,
                generation, "partition size changed"
            );
        }
        // P3's credit follows the partition size even when the credit stays.
        let credit = credit_bytes.unwrap_or_else(|| self.pipeline.schedule().credit_bytes);
        self.pipeline.set_credit(credit, table.reference);
        Ok(())
    }

    /// The scheduler, the partition size and the credit per server in use.
    pub fn schedule(&self) -> Scheduling {
        let table = self.table.lock().expect("table lock");
        let s = self.pipeline.schedule();
        Scheduling {
            scheduler: s.kind,
            partition_bytes: table.partition_bytes().unwrap_or(table.reference),
            derived: table.partition_bytes().is_none(),
            reason: table
                .reason
                .clone()
                .filter(|_| table.partition_bytes().is_none()),
            credit_bytes: s.credit_bytes,
        }
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

    /// Starts summing the tensor `id` across workers, in place in `ptr..ptr+len`.
    /// Returns at once with a handle to poll or wait on. Lower `priority` goes first.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes and left alone (not freed, read
    /// or written) until [`wait`](Self::wait) on the handle has returned anything but a
    /// timeout, or [`shutdown`](Self::shutdown) has returned.
    pub unsafe fn push_pull(
        &self,
        id: u32,
        ptr: *mut u8,
        len: usize,
        priority: i64,
        op: ReduceOp,
    ) -> Result<u64, CommError> {
        // SAFETY: the caller's contract is exactly push_exchange's.
        unsafe { self.push_exchange(id, (ptr, len), priority, op, &Exchange::ALL) }
    }

    /// Like [`push_pull`](Self::push_pull), pushing and taking back only the partitions
    /// of `exchange`'s ranges: an allgather pushes this worker's rows and takes the
    /// others', a reduce-scatter pushes everything and takes its own share.
    ///
    /// # Safety
    /// As for [`push_pull`](Self::push_pull).
    pub unsafe fn push_exchange(
        &self,
        id: u32,
        (ptr, len): (*mut u8, usize),
        priority: i64,
        op: ReduceOp,
        exchange: &Exchange,
    ) -> Result<u64, CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut table = self.table.lock().expect("table lock");
        let table_generation = table.generation;
        let t = self.pushed(&mut table, id, len)?;
        exchange.check(&t.name, len as u64)?;
        if let Some(members) = t.members.as_deref() {
            // The server would refuse the push and count this worker gone for the job.
            if members.binary_search(&self.rank()).is_err() {
                return Err(CommError::Invalid(format!(
                    "tensor '{}' is summed over workers {members:?}: worker {} is not one \
                     of them and must not push it",
                    t.name,
                    self.rank()
                )));
            }
        }
        if op.on_servers() != WireOp::Sum && t.compression.is_some() {
            return Err(CommError::Invalid(format!(
                "tensor '{}' is compressed: it can be summed or averaged, not reduced by {op:?}",
                t.name
            )));
        }
        let divisor = match (op, t.dtype) {
            (ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max | ReduceOp::Product, _) => None,
            (ReduceOp::Average, Dtype::I32 | Dtype::I64) => {
                return Err(CommError::Invalid(format!(
                    "tensor '{}' holds {}: averaging integers would truncate; use Sum",
                    t.name, t.dtype
                )))
            }
            // The mean over the workers whose tensors were summed.
            (ReduceOp::Average, _) => {
                Some(t.members.as_ref().map_or(self.size(), |m| m.len() as u32))
            }
        };
        // SAFETY: the caller's contract is exactly HostSlice::new's.
        let whole = unsafe { HostSlice::new(ptr, len) }
            .ok_or_else(|| CommError::Invalid(format!("tensor '{}': null buffer", t.name)))?;
        let crossing = self.crossing_for(t);
        let shared = crossing
            .as_ref()
            .map(|(s, _)| *s)
            .or_else(|| self.shared_for(t));
        if let Some(shared) = shared {
            let handle = self
                .handles
                .start(t.id, &t.name, &[local_partition(t.id, len)])?;
            let (members, local_divisor, cross) = match crossing {
                Some((_, here)) => {
                    let round = t.next_round(table_generation);
                    let round = Round {
                        tensor: t.id,
                        name: &t.name,
                        dtype: t.dtype,
                        parts: &t.parts,
                        members: t.members.clone(),
                        round,
                        priority,
                        op: op.on_servers(),
                        divisor,
                    };
                    let cross = cross::plan(&round, &self.pipeline, &self.handles);
                    // The servers' sums come back averaged over every member.
                    (here, None, Some(cross))
                }
                None => {
                    let members = t.members.clone().unwrap_or_else(|| shared.here());
                    (members, divisor, None)
                }
            };
            shared.submit(LocalOp {
                handle,
                tensor: t.id,
                name: Arc::clone(&t.name),
                data: whole,
                dtype: t.dtype,
                members,
                op: op.on_servers(),
                divisor: local_divisor,
                contributes: exchange.pushes.as_ref().is_none_or(|p| !p.is_empty()),
                pulls: exchange.pulls.clone(),
                cross,
            })?;
            return Ok(handle);
        }
        let handle = self.handles.start(t.id, &t.name, &t.parts)?;
        let round = t.next_round(table_generation);
        let tasks = t
            .parts
            .iter()
            .enumerate()
            .map(|(index, &partition)| PartTask {
                name: Arc::clone(&t.name),
                index: index as u32,
                handle,
                partition,
                round,
                dtype: t.dtype,
                data: whole.sub(partition.offset as usize, partition.bytes as usize),
                codec: t.compression.map_or(KeyCodec::RAW, |c| {
                    c.key_codec(partition.bytes / t.dtype.size() as u64)
                }),
                members: t.members.clone(),
                divisor,
                op: op.on_servers(),
                pushes: Exchange::meets(&exchange.pushes, &partition),
                wants_sum: Exchange::meets(&exchange.pulls, &partition),
                skips: None,
                delta: None,
            })
            .collect();
        self.pipeline.enqueue(id, &t.name, priority, tasks);
        Ok(handle)
    }

    /// Asynchronous training (BytePS §4.3, Fig. 11b): adds the `len` bytes at `ptr`, this
    /// worker's delta of tensor `id` (its parameters after its own update, less the value
    /// it last pulled), to the servers' stored value, and overwrites them with the stored
    /// value once the delta is in: every worker's deltas so far. Workers do not wait for
    /// each other, but with `staleness` s a worker's round r returns only once every
    /// worker has pushed round r − s. `initial` (as long) is the value the servers start
    /// from, read by the tensor's first push only: every worker passes the same (e.g.
    /// parameters broadcast from one worker). The tensor must be raw, of every worker,
    /// and pushed by this method only; its sums skip the machine's shared memory.
    ///
    /// # Safety
    /// As `push_exchange` for `ptr..ptr+len`; `initial..initial+len` must be valid for
    /// reads and unchanged until the operation has been waited for.
    pub unsafe fn push_delta(
        &self,
        id: u32,
        (ptr, len): (*mut u8, usize),
        initial: *mut u8,
        staleness: Option<u32>,
        priority: i64,
    ) -> Result<u64, CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut table = self.table.lock().expect("table lock");
        let generation = table.generation;
        let t = self.pushed(&mut table, id, len)?;
        let refused = if t.compression.is_some() {
            Some("is compressed: deltas are added as raw elements".to_string())
        } else if t.members.is_some() || t.home.is_some() {
            Some("belongs to a process set or a worker: deltas are of every worker".to_string())
        } else {
            None
        };
        if let Some(why) = refused {
            return Err(CommError::Invalid(format!("tensor '{}' {why}", t.name)));
        }
        // SAFETY: the caller's contract is exactly HostSlice::new's, for both spans.
        let (whole, start) = unsafe { (HostSlice::new(ptr, len), HostSlice::new(initial, len)) };
        let (Some(whole), Some(start)) = (whole, start) else {
            return Err(CommError::Invalid(format!(
                "tensor '{}': null buffer",
                t.name
            )));
        };
        let handle = self.handles.start(t.id, &t.name, &t.parts)?;
        let round = t.next_round(generation);
        let tasks = t
            .parts
            .iter()
            .enumerate()
            .map(|(index, &partition)| {
                let (offset, bytes) = (partition.offset as usize, partition.bytes as usize);
                PartTask {
                    name: Arc::clone(&t.name),
                    index: index as u32,
                    handle,
                    partition,
                    round,
                    dtype: t.dtype,
                    data: whole.sub(offset, bytes),
                    codec: KeyCodec::RAW,
                    members: None,
                    divisor: None,
                    op: ReduceOp::Sum.on_servers(),
                    pushes: true,
                    wants_sum: true,
                    skips: None,
                    delta: Some(Delta {
                        staleness,
                        initial: start.sub(offset, bytes),
                    }),
                }
            })
            .collect();
        self.pipeline.enqueue(id, &t.name, priority, tasks);
        Ok(handle)
    }

    /// Tensor `id`, about to be pushed from a buffer of `len` bytes: declared here, its
    /// name not lost with the coordinator, and `len` its size.
    fn pushed<'t>(
        &self,
        table: &'t mut Table,
        id: u32,
        len: usize,
    ) -> Result<&'t mut Tensor, CommError> {
        let t = table
            .tensors
            .get_mut(&id)
            .ok_or_else(|| CommError::Invalid(format!("tensor id {id} was never declared")))?;
        if let Some(e) = self.coordinator_loss.error(&t.name) {
            return Err(e);
        }
        let want = t.elements as usize * t.dtype.size();
        if len != want {
            return Err(CommError::Invalid(format!(
                "tensor '{}' is declared as {} x {} ({want} bytes) but {len} bytes were given",
                t.name, t.dtype, t.elements
            )));
        }
        Ok(t)
    }

    /// The shared-memory stage and this machine's members of the tensor, when it is
    /// aggregated inside the machine first (`sumflow_plan::hierarchy`): raw elements, not
    /// kept on one worker's machine (a relay region or a reduce-scatter share), members
    /// on several machines and at least two on this one.
    fn crossing_for(&self, t: &Tensor) -> Option<(&SharedMemory, Arc<[u32]>)> {
        let shared = self.shared.as_ref().filter(|_| self.hierarchical)?;
        if t.compression.is_some() || t.home.is_some() {
            return None;
        }
        let map = self.job.cluster_map();
        let all: Vec<u32>;
        let members = match t.members.as_deref() {
            Some(m) => m,
            None => {
                all = (0..map.workers.len() as u32).collect();
                &all
            }
        };
        let host = |r: u32| map.workers[r as usize].host_id.as_str();
        let here = hierarchy::machine_members(members, self.rank(), host)?;
        Some((shared, Arc::from(here)))
    }

    /// The shared-memory stage, when it sums this tensor: every member on this machine,
    /// and raw elements (compressors exist for the network).
    fn shared_for(&self, t: &Tensor) -> Option<&SharedMemory> {
        self.shared
            .as_ref()
            .filter(|s| t.compression.is_none() && s.covers(t.members.as_deref()))
    }

    /// Retires tensor `id`: this worker will never push it again. Refused while an
    /// operation on it is in flight (wait for it first). Sends `Retire` for each of its
    /// keys this worker pushed (under every partition size it was pushed under) on the
    /// key's lane, after everything sent for the key before; tells the coordinator; and
    /// forgets the tensor here. Servers free a key, and the coordinator the name, once
    /// every worker of it has retired it. A later declaration of the same name is a new
    /// tensor with a new id, answered once every worker that declared the old one has
    /// retired it (ids are never reused: keys embed them, and a server may still hold the
    /// old keys for a worker yet to retire them).
    pub fn retire(&self, id: u32) -> Result<(), CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut table = self.table.lock().expect("table lock");
        let t = table.tensors.get(&id).ok_or_else(|| {
            CommError::Invalid(format!(
                "tensor id {id} is not declared here: never declared, or already retired"
            ))
        })?;
        if self.handles.in_flight(id) {
            return Err(CommError::Invalid(format!(
                "tensor '{}' has an operation in flight: wait for it before retiring the \
                 tensor",
                t.name
            )));
        }
        let mut keys: Vec<(u64, usize)> = Vec::new();
        if t.rounds.get(table.generation).is_some_and(|r| *r > 0) {
            keys.extend(t.parts.iter().map(|p| (p.key, p.server as usize)));
        }
        keys.extend(t.earlier.iter().map(|p| (p.key, p.server as usize)));
        keys.sort_unstable();
        keys.dedup();
        self.pipeline.retire(&t.name, &keys)?;
        if let Some(shared) = &self.shared {
            shared.retire(id);
        }
        self.job.undeclare(&t.name, id)?;
        if let Some(group) = t.group {
            table.groups[group].retain(|member| *member != id);
        }
        table.tensors.remove(&id);
        Ok(())
    }

    /// Tensors declared here and not retired.
    pub fn live_tensors(&self) -> usize {
        self.table.lock().expect("table lock").tensors.len()
    }

    /// Whether the operation finished; its error if it failed.
    pub fn poll(&self, handle: u64) -> Result<bool, CommError> {
        self.handles.poll(handle)
    }

    /// Waits for an operation and releases its handle. A job-fatal error announced by the
    /// coordinator (workers declaring a tensor differently) fails the wait at once, since
    /// the operation may never complete; it is also the error reported when the operation
    /// failed for another reason meanwhile, being the cause.
    pub fn wait(&self, handle: u64, timeout: Duration) -> Result<(), CommError> {
        let started = Instant::now();
        let deadline = started + timeout;
        let mut warn_at = self.stall_warning.map(|w| started + w);
        loop {
            let slice = JOB_ERROR_CHECK.min(deadline.saturating_duration_since(Instant::now()));
            let result = self.handles.wait(handle, slice, |s| match &self.shared {
                Some(shared) if s == LOCAL_SERVER as usize => shared.waiting_for(handle),
                _ => self.pipeline.server_wait(s),
            });
            match (result, self.job_error()) {
                (Ok(()), _) => return Ok(()),
                (Err(CommError::Timeout { .. }), Some(e)) => {
                    self.handles.fail(handle, |_| e);
                }
                (
                    Err(CommError::Timeout {
                        tensor,
                        outstanding,
                        parts,
                        servers,
                        ..
                    }),
                    None,
                ) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return Err(CommError::Timeout {
                            tensor,
                            secs: timeout.as_secs_f64(),
                            outstanding,
                            parts,
                            servers,
                        });
                    }
                    if let (Some(at), Some(every)) = (warn_at, self.stall_warning) {
                        if now >= at {
                            self.report_local_stall(handle, started.elapsed());
                            warn!(
                                "tensor '{tensor}': still waiting after {:.0} s for {outstanding} \
                                 of {parts} partitions from {servers}; failing after {:.0} s \
                                 (SUMFLOW_STALL_WARNING, SUMFLOW_TIMEOUT)",
                                started.elapsed().as_secs_f64(),
                                timeout.as_secs_f64()
                            );
                            warn_at = Some(at + every);
                        }
                    }
                }
                (Err(CommError::UnknownHandle(h)), _) => return Err(CommError::UnknownHandle(h)),
                (Err(_), Some(e)) => return Err(e),
                (Err(e), None) if e.code() == ErrorCode::NodeFailed => {
                    return Err(self.cause_of_failure(e))
                }
                (Err(e), None) => return Err(e),
            }
        }
    }

    /// Tells the coordinator which of this machine's workers a shared-memory operation has
    /// waited `waited` for (a server does the same for rounds it holds): it names them,
    /// and the launcher blames them if the job then fails.
    fn report_local_stall(&self, handle: u64, waited: Duration) {
        let Some(w) = self.shared.as_ref().and_then(|s| s.stalled_on(handle)) else {
            return;
        };
        // Keys carry the tensor id in bits 32 to 55 (docs/protocol.md); the coordinator
        // names the tensor from it.
        let key = u64::from(w.tensor) << 32;
        if let Err(e) = self.job.report_stall(key, w.round, waited, w.missing) {
            debug!("cannot report a stall to the coordinator: {e}");
        }
    }

    /// A peer's failure may follow from a cause that has not reached this worker yet: a
    /// job-fatal error (the worker that saw a declaration mismatch first left at once,
    /// and its servers said so sooner than the coordinator's notice arrived), or the
    /// coordinator's loss (a worker that noticed it first left). Waits briefly for either,
    /// the real cause, and returns it if it comes; failures after the first wait only
    /// what is left of its grace.
    fn cause_of_failure(&self, e: CommError) -> CommError {
        let deadline = *self
            .cause_deadline
            .get_or_init(|| Instant::now() + JOB_ERROR_GRACE);
        let tensor = match &e {
            CommError::Failed { tensor, .. } => tensor.clone(),
            _ => String::new(),
        };
        loop {
            if let Some(cause) = self.job_error() {
                return cause;
            }
            if let Some(cause) = self.coordinator_loss.error(&tensor) {
                return cause;
            }
            if Instant::now() >= deadline {
                return e;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// The coordinator's job-fatal error, if it announced one.
    fn job_error(&self) -> Option<CommError> {
        self.job
            .job_error()
            .map(|e| CommError::Client(format!("the job cannot continue: {}", e.message), e.code))
    }

    /// Waits until every worker reaches this barrier.
    pub fn barrier(&self, timeout: Duration) -> Result<(), CommError> {
        self.job.barrier(BarrierGroup::Workers, timeout)?;
        Ok(())
    }

    /// Horovod's `join()`: this worker has finished its data. Until every worker has
    /// joined, the others' rounds complete without it, as if it pushed zeros; returns
    /// the rank of the worker that joined last, the same on every worker.
    ///
    /// Operations of this worker still in flight are waited for first (the others'
    /// rounds complete without the workers that joined, so they do complete). Then, on
    /// a connection of its own to each server: a join barrier of the coordinator entered
    /// first, so that its last worker, the answer, is the last to have called `join()`
    /// (a worker still summing cannot finish before the servers learn of this join, and
    /// so enters after this one); `Join(1)` and its acknowledgement from every server;
    /// the wait in that barrier; `Join(0)` and its acknowledgements; and then a second
    /// join barrier, so that no worker pushes again while another is still joined on
    /// some server. Each wait is bounded by `timeout` and its error names what it waited for.
    pub fn join(&self, timeout: Duration) -> Result<u32, CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        self.handles.wait_idle(timeout).map_err(|tensors| {
            CommError::Client(
                format!(
                    "join(): timed out after {:.1}s waiting for this worker's operations in \
                     flight to complete (tensors {})",
                    timeout.as_secs_f64(),
                    tensors.join(", ")
                ),
                ErrorCode::Timeout,
            )
        })?;
        let opts = ServerOptions {
            connect_timeout: self.connect_timeout,
            reply_timeout: Some(timeout),
            machine_local: self.local_sockets,
            // Joins carry no payloads.
            mailbox: false,
            ..ServerOptions::default()
        };
        let mut controls = Vec::new();
        for s in &self.job.cluster_map().servers {
            let what = format!("server {} ({})", s.rank, s.addr());
            let c = ServerClient::connect(&s.addr(), &self.token, self.rank(), &self.name, &opts)
                .map_err(|e| join_error(&format!("connecting to {what}"), e))?;
            controls.push((what, c));
        }
        let result = self
            .join_step(&mut controls, true, timeout)
            .and_then(|last| {
                info!(last, "every worker has joined");
                self.join_step(&mut controls, false, timeout).map(|_| last)
            });
        if let (Err(_), Some(shared)) = (&result, &self.shared) {
            shared.set_joined(false);
        }
        for (_, mut c) in controls {
            // After a failure this worker may still be joined there: leave join first.
            if result.is_err() {
                let _ = c.tx.send_raw(&Message::Join { joined: false }, &[]);
            }
            let _ = c.shutdown("join done");
        }
        result
    }

    /// Joins (`joined`) or leaves join on every server, then waits in a join barrier;
    /// returns the rank of the worker that entered the barrier last.
    fn join_step(
        &self,
        controls: &mut [(String, ServerClient)],
        joined: bool,
        timeout: Duration,
    ) -> Result<u32, CommError> {
        let step = if joined { "joining" } else { "leaving join" };
        let barrier = if joined {
            "waiting for every worker to join"
        } else {
            "waiting for every worker to leave join"
        };
        let enter = || {
            self.job
                .enter_barrier(BarrierGroup::Join)
                .map_err(|e| join_error(barrier, e))
        };
        // Leaving, the barrier is entered only once every server has acknowledged, so
        // that no worker leaves it while another is still joined somewhere.
        let entered_early = if joined { Some(enter()?) } else { None };
        for (what, c) in controls.iter_mut() {
            c.tx.send_raw(&Message::Join { joined }, &[])
                .map_err(|e| join_error(&format!("telling {what} of {step}"), e))?;
        }
        for (what, c) in controls.iter_mut() {
            match c.rx.recv() {
                Ok(Reply::JoinAck { joined: j }) if j == joined => {}
                Ok(other) => {
                    return Err(CommError::Client(
                        format!(
                            "join(): {what} answered {step} with {other:?}, not its \
                             acknowledgement"
                        ),
                        ErrorCode::Internal,
                    ))
                }
                Err(e) => {
                    return Err(join_error(
                        &format!("waiting for {what} to acknowledge {step}"),
                        e,
                    ))
                }
            }
        }
        // The machine's other workers go on without this one from here, as the servers
        // already do.
        if let Some(shared) = &self.shared {
            shared.set_joined(joined);
        }
        let entered = match entered_early {
            Some(entered) => entered,
            None => enter()?,
        };
        let last = self
            .job
            .await_barrier(entered, timeout)
            .map_err(|e| join_error(barrier, e))?;
        Ok(last.rank)
    }

    /// One line per server: the bytes of declared tensors it sums and its target share.
    pub fn placement_report(&self) -> Vec<String> {
        let table = self.table.lock().expect("table lock");
        let mut bytes: HashMap<u32, u64> = HashMap::new();
        for t in table.tensors.values() {
            for p in &t.parts {
                *bytes.entry(p.server).or_default() += p.bytes;
            }
        }
        let total: u64 = bytes.values().sum();
        let mut ranks: Vec<_> = bytes.into_iter().collect();
        ranks.sort_unstable();
        ranks
            .into_iter()
            .map(|(r, b)| {
                format!(
                    "server {r}: {:.1} MB, {:.1}% of declared bytes",
                    b as f64 / 1e6,
                    100.0 * b as f64 / total.max(1) as f64
                )
            })
            .collect()
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

/// A failure of one step of `join`, naming the step.
fn join_error(step: &str, e: ClientError) -> CommError {
    CommError::Client(format!("join(): {step}: {e}"), e.code())
}

/// Refuses a tensor id that keys cannot carry (24 bits: `MAX_TENSOR_ID`). Ids are never
/// reused, retired tensors' included, so this bounds the declarations of a job's life.
fn check_tensor_id(name: &str, id: u32) -> Result<(), CommError> {
    if id > MAX_TENSOR_ID {
        return Err(CommError::Invalid(format!(
            "tensor '{name}' was given id {id}, past the last id a key can carry \
             (MAX_TENSOR_ID = {MAX_TENSOR_ID}): a job declares at most {} tensors over its \
             life, retired ones included, since ids are never reused; name tensors that \
             recur (an unnamed operation declares new ones each call)",
            u64::from(MAX_TENSOR_ID) + 1
        )));
    }
    Ok(())
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
mod retire_tests {
    use super::*;

    #[test]
    fn an_id_past_what_keys_carry_is_refused_naming_the_limit() {
        assert!(check_tensor_id("t", MAX_TENSOR_ID).is_ok());
        let e = check_tensor_id("allreduce.noname.9", MAX_TENSOR_ID + 1).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("MAX_TENSOR_ID = 16777215") && msg.contains("never reused"),
            "{msg}"
        );
        assert!(msg.contains("'allreduce.noname.9'"), "{msg}");
    }
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
