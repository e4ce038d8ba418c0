//! The communication service of one worker: joins the job, declares tensors, and runs
//! push_pull operations through the pipeline.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::{ServerClient, ServerOptions};
use sumflow_wire::{BarrierGroup, ClusterMap, Dtype, ErrorCode, JobToken, Registration, Role};
use tracing::{info, warn};

use crate::error::CommError;
use crate::handles::Handles;
use crate::lanes;
use crate::partition::{partition, partition_key, DEFAULT_PARTITION_BYTES};
use crate::pipeline::{HostSlice, PartTask, Pipeline, ServerLink};
use crate::placement::{place, ServerSet};
use crate::scatter::scatter;
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

/// Partitions per server in flight by default: enough to cover a sum's round trip while
/// keeping workers within a few partitions of each other.
const DEFAULT_WINDOW_PARTITIONS: u64 = 4;

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
    pub partition_bytes: u64,
    /// Bytes a worker may have pushed to one server whose sums have not come back yet
    /// (see the pipeline's push window); `None`: 4 partitions; 0: unbounded.
    pub push_window_bytes: Option<u64>,
    /// Connections to each CPU server, each partition for it cut into one piece per
    /// connection; colocated servers get one. `None`: round(c/g) of Eq. 1 and 2, so that
    /// TCP's per-connection fairness gives each server its share of every link (see
    /// [`crate::lanes`]); at most [`lanes::MAX`]. Pieces are keys, so every worker of a
    /// job must use the same value, as it must the same partition size.
    pub connections_per_cpu_server: Option<u32>,
    pub join_timeout: Duration,
    /// Longest wait for the coordinator to answer a declaration.
    pub declare_timeout: Duration,
    pub coordinator_options: CoordinatorOptions,
    pub connect_timeout: Duration,
    /// Record a Chrome trace of a window of steps (see [`crate::trace`]); `None`: off.
    pub trace: Option<TraceConfig>,
}

impl CommConfig {
    pub fn new(coordinator: &str, token: JobToken, host_id: &str) -> CommConfig {
        CommConfig {
            coordinator: coordinator.to_string(),
            token,
            rank: None,
            name: format!("worker pid {}", std::process::id()),
            host_id: host_id.to_string(),
            partition_bytes: DEFAULT_PARTITION_BYTES,
            push_window_bytes: None,
            connections_per_cpu_server: None,
            join_timeout: Duration::from_secs(300),
            declare_timeout: Duration::from_secs(300),
            coordinator_options: CoordinatorOptions::default(),
            connect_timeout: Duration::from_secs(60),
            trace: None,
        }
    }
}

/// How the sum of a push_pull is returned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the number of workers.
    Average,
}

/// A declared tensor: its partitions and where each goes.
#[derive(Debug)]
struct Tensor {
    id: u32,
    name: String,
    dtype: Dtype,
    elements: u64,
    /// (key, server rank, byte offset, byte length)
    parts: Vec<(u64, u32, usize, usize)>,
    /// The last round pushed.
    round: u64,
}

/// The worker side of a job.
pub struct CommunicationService {
    job: CoordinatorClient,
    servers: ServerSet,
    pipeline: Pipeline,
    handles: Arc<Handles>,
    tensors: Mutex<HashMap<u32, Tensor>>,
    /// Lanes per server, by rank.
    lanes: Vec<u32>,
    partition_bytes: u64,
    declare_timeout: Duration,
    local: (u32, u32),
    tracer: Arc<Tracer>,
}

impl CommunicationService {
    /// Joins the job through its coordinator and connects to every summation server.
    pub fn start(cfg: CommConfig) -> Result<CommunicationService, CommError> {
        if cfg.partition_bytes == 0 {
            return Err(CommError::Invalid(
                "the partition size must be positive".into(),
            ));
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
            trace
                .prepare()
                .map_err(|e| CommError::Invalid(e.to_string()))?;
        }
        let reg = Registration {
            role: Role::Worker,
            requested_rank: cfg.rank,
            host: String::new(),
            port: 0,
            host_id: cfg.host_id.clone(),
            pid: std::process::id(),
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
        for (s, &count) in map.servers.iter().zip(&lanes) {
            let mut lanes = Vec::new();
            for _ in 0..count {
                let c = ServerClient::connect(&s.addr(), &cfg.token, job.rank(), &cfg.name, &opts)?;
                lanes.push((c.tx, c.rx));
            }
            links.push(ServerLink {
                name: format!("server {} ({})", s.rank, s.addr()),
                lanes,
            });
        }
        // Every worker must cut tensors into the same partitions and pieces, or the servers
        // wait for keys the others never send. Declared as tensors, the layout is compared
        // by the coordinator like any declaration: a worker that differs fails every
        // worker at once with a DeclarationMismatchError naming the setting and both values.
        for (name, value) in [
            (LAYOUT_PARTITION_BYTES, cfg.partition_bytes),
            (LAYOUT_CPU_SERVER_LANES, u64::from(cpu_lanes)),
        ] {
            job.declare(name, Dtype::I64, value, cfg.declare_timeout)?;
        }
        let tracer = Arc::new(match cfg.trace {
            Some(trace) => Tracer::new(trace, job.rank(), &cfg.name)
                .map_err(|e| CommError::Invalid(e.to_string()))?,
            None => Tracer::disabled(),
        });
        let handles = Arc::new(Handles::default());
        let window = cfg.push_window_bytes.unwrap_or(
            cfg.partition_bytes
                .saturating_mul(DEFAULT_WINDOW_PARTITIONS),
        );
        let pipeline = Pipeline::start(links, Arc::clone(&handles), window)?;
        let local = local_rank(&map, job.rank());
        info!(
            rank = job.rank(),
            workers = map.workers.len(),
            servers = map.servers.len(),
            cpu_lanes,
            "joined job {}",
            map.job_id
        );
        Ok(CommunicationService {
            job,
            servers,
            pipeline,
            handles,
            tensors: Mutex::new(HashMap::new()),
            lanes,
            partition_bytes: cfg.partition_bytes,
            declare_timeout: cfg.declare_timeout,
            local,
            tracer,
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

    /// Declares one tensor; every worker must declare it with the same dtype and size.
    /// Returns its id. Its partitions are placed from their keys alone, so workers may
    /// declare tensors in any order.
    pub fn declare(&self, name: &str, dtype: Dtype, elements: u64) -> Result<u32, CommError> {
        let id = self
            .job
            .declare(name, dtype, elements, self.declare_timeout)?;
        let mut parts = self.cut(id, name, dtype, elements)?;
        for p in &mut parts {
            p.1 = scatter(p.0, &self.servers).map_err(|e| CommError::Invalid(e.to_string()))?;
        }
        let parts = self.spread(dtype, parts)?;
        self.register(id, name, dtype, elements, parts);
        Ok(id)
    }

    /// Declares a group of tensors (a model's parameters) and places their partitions
    /// together, balancing bytes over the servers by BytePS's Eq. 1 and 2. Every worker
    /// must declare the same group.
    pub fn declare_group(&self, tensors: &[(&str, Dtype, u64)]) -> Result<Vec<u32>, CommError> {
        let mut ids = Vec::with_capacity(tensors.len());
        let mut all = Vec::new();
        for &(name, dtype, elements) in tensors {
            let id = self
                .job
                .declare(name, dtype, elements, self.declare_timeout)?;
            all.push((
                id,
                name,
                dtype,
                elements,
                self.cut(id, name, dtype, elements)?,
            ));
            ids.push(id);
        }
        let keyed: Vec<(u64, u64)> = all
            .iter()
            .flat_map(|t| t.4.iter().map(|p| (p.0, p.3 as u64)))
            .collect();
        let placement =
            place(&keyed, &self.servers).map_err(|e| CommError::Invalid(e.to_string()))?;
        for (id, name, dtype, elements, mut parts) in all {
            for p in &mut parts {
                p.1 = placement
                    .server_of(p.0)
                    .expect("every partition was placed");
            }
            let parts = self.spread(dtype, parts)?;
            self.register(id, name, dtype, elements, parts);
        }
        Ok(ids)
    }

    /// Cuts each placed partition bound for a server with several lanes into one piece per
    /// lane (see [`crate::lanes`]).
    fn spread(
        &self,
        dtype: Dtype,
        parts: Vec<(u64, u32, usize, usize)>,
    ) -> Result<Vec<(u64, u32, usize, usize)>, CommError> {
        let mut out = Vec::with_capacity(parts.len());
        for (key, server, offset, bytes) in parts {
            let lanes = self.lanes[server as usize];
            let pieces = lanes::pieces((key, offset, bytes), dtype.size(), lanes)
                .map_err(|e| CommError::Invalid(e.to_string()))?;
            out.extend(pieces.into_iter().map(|(k, o, b)| (k, server, o, b)));
        }
        Ok(out)
    }

    fn cut(
        &self,
        id: u32,
        name: &str,
        dtype: Dtype,
        elements: u64,
    ) -> Result<Vec<(u64, u32, usize, usize)>, CommError> {
        let parts = partition(name, elements, dtype, self.partition_bytes)
            .map_err(|e| CommError::Invalid(e.to_string()))?;
        let size = dtype.size();
        Ok(parts
            .iter()
            .map(|p| {
                (
                    partition_key(id, p.index_in_tensor),
                    0,
                    p.offset_elements as usize * size,
                    p.elements as usize * size,
                )
            })
            .collect())
    }

    fn register(
        &self,
        id: u32,
        name: &str,
        dtype: Dtype,
        elements: u64,
        parts: Vec<(u64, u32, usize, usize)>,
    ) {
        let mut tensors = self.tensors.lock().expect("tensors lock");
        // A repeated declaration keeps its first placement and round count.
        tensors.entry(id).or_insert_with(|| Tensor {
            id,
            name: name.to_string(),
            dtype,
            elements,
            parts,
            round: 0,
        });
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
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut tensors = self.tensors.lock().expect("tensors lock");
        let t = tensors
            .get_mut(&id)
            .ok_or_else(|| CommError::Invalid(format!("tensor id {id} was never declared")))?;
        let want = t.elements as usize * t.dtype.size();
        if len != want {
            return Err(CommError::Invalid(format!(
                "tensor '{}' is declared as {} x {} ({want} bytes) but {len} bytes were given",
                t.name, t.dtype, t.elements
            )));
        }
        let divisor = match (op, t.dtype) {
            (ReduceOp::Sum, _) => None,
            (ReduceOp::Average, Dtype::I32 | Dtype::I64) => {
                return Err(CommError::Invalid(format!(
                    "tensor '{}' holds {}: averaging integers would truncate; use Sum",
                    t.name, t.dtype
                )))
            }
            (ReduceOp::Average, _) => Some(self.size()),
        };
        // SAFETY: the caller's contract is exactly HostSlice::new's.
        let whole = unsafe { HostSlice::new(ptr, len) }
            .ok_or_else(|| CommError::Invalid(format!("tensor '{}': null buffer", t.name)))?;
        let handle =
            self.handles
                .start(t.id, &t.name, t.parts.iter().map(|p| (p.0, p.1 as usize)))?;
        t.round += 1;
        for &(key, server, offset, bytes) in &t.parts {
            self.pipeline.enqueue(PartTask {
                handle,
                key,
                round: t.round,
                server: server as usize,
                dtype: t.dtype,
                priority,
                data: whole.sub(offset, bytes),
                divisor,
            });
        }
        Ok(handle)
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
        let deadline = Instant::now() + timeout;
        loop {
            let slice = JOB_ERROR_CHECK.min(deadline.saturating_duration_since(Instant::now()));
            let result = self
                .handles
                .wait(handle, slice, |s| self.pipeline.server_name(s));
            match (result, self.job_error()) {
                (Ok(()), _) => return Ok(()),
                (Err(CommError::Timeout { .. }), Some(e)) => {
                    self.handles.fail(handle, |_| e);
                }
                (Err(CommError::Timeout { .. }), None) if Instant::now() < deadline => {}
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
                    return Err(CommError::Timeout {
                        tensor,
                        secs: timeout.as_secs_f64(),
                        outstanding,
                        parts,
                        servers,
                    })
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

    /// A peer's failure may follow from a job-fatal error that has not reached this worker
    /// yet (the worker that saw a declaration mismatch first left at once, and its
    /// servers said so sooner than the coordinator's notice arrived): waits briefly for
    /// it, the real cause, and returns it if it comes.
    fn cause_of_failure(&self, e: CommError) -> CommError {
        let deadline = Instant::now() + JOB_ERROR_GRACE;
        while Instant::now() < deadline {
            if let Some(cause) = self.job_error() {
                return cause;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        e
    }

    /// The coordinator's job-fatal error, if it announced one.
    fn job_error(&self) -> Option<CommError> {
        self.job
            .job_error()
            .map(|e| CommError::Client(format!("the job cannot continue: {}", e.message), e.code))
    }

    /// Waits until every worker reaches this barrier.
    pub fn barrier(&self, timeout: Duration) -> Result<(), CommError> {
        Ok(self.job.barrier(BarrierGroup::Workers, timeout)?)
    }

    /// One line per server: the bytes of declared tensors it sums and its target share.
    pub fn placement_report(&self) -> Vec<String> {
        let tensors = self.tensors.lock().expect("tensors lock");
        let mut bytes: HashMap<u32, u64> = HashMap::new();
        for t in tensors.values() {
            for p in &t.parts {
                *bytes.entry(p.1).or_default() += p.3 as u64;
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

    /// Marks the end of a training step and the beginning of the next: the trace window
    /// counts these. Returns the trace file when this step ended the window and it was
    /// written.
    pub fn mark_step(&self) -> Result<Option<TraceFile>, TraceError> {
        self.tracer.mark_step()
    }

    /// Leaves the job gracefully; operations still in flight fail with
    /// [`CommError::Shutdown`], and so does every later one. A trace window cut short is
    /// written first ([`Tracer::flush`]). Calls after the first do nothing.
    pub fn shutdown(&self, reason: &str) -> Result<(), CommError> {
        self.pipeline.shutdown(reason);
        // A trace that cannot be written must not fail leaving the job: it is logged.
        if let Err(e) = self.tracer.flush() {
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
