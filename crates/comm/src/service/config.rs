//! How a worker joins its job, and what it reports of its scheduling.

use std::time::Duration;

use sumflow_client::coordinator::CoordinatorOptions;
use sumflow_plan::partition::WHOLE_TENSOR_BYTES;
use sumflow_plan::scheduler::prophet::ProphetConfig;
use sumflow_plan::scheduler::SchedulerKind;
use sumflow_wire::timing;
use sumflow_wire::JobToken;

use crate::trace::TraceConfig;

/// Names under which a worker declares its layout settings (their values as the element
/// count), so that workers set up differently fail with a clear mismatch.
pub(super) const LAYOUT_PARTITION_BYTES: &str =
    "sumflow.setting.partition_bytes (SUMFLOW_PARTITION_BYTES)";
pub(super) const LAYOUT_CPU_SERVER_LANES: &str =
    "sumflow.setting.cpu_server_connections (SUMFLOW_CPU_SERVER_CONNECTIONS)";
pub(super) const LAYOUT_SHARED_MEMORY: &str =
    "sumflow.setting.shared_memory (SUMFLOW_SHARED_MEMORY)";

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
    /// ([`derived_partition_bytes`](sumflow_plan::partition::derived_partition_bytes)).
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
    /// [`sumflow_plan::lanes`]); at most [`lanes::MAX`](sumflow_plan::lanes::MAX). Pieces are keys, so every worker of a
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
    /// shared memory rather than through a summation server (see `crate::local`). Every
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
/// ([`CommunicationService::reconfigure`](super::CommunicationService::reconfigure)).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Scheduling {
    pub scheduler: SchedulerKind,
    /// The size tensors are cut into now (see [`CommConfig::layout_partition_bytes`]);
    /// when derived, that of the last group declared (before any, BytePS's 4 MiB).
    pub partition_bytes: u64,
    /// Whether the partition size is derived from each declaration rather than set.
    pub derived: bool,
    /// Why the last group got its derived size (see [`derived_partition_bytes`](sumflow_plan::partition::derived_partition_bytes)).
    pub reason: Option<String>,
    /// The credit per server: how many bytes pushed to it may wait for its
    /// acknowledgement; 0: unbounded (fifo has none and p3 one partition, whatever this
    /// says).
    pub credit_bytes: u64,
}
