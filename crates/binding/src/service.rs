//! `sumflow._core.CommunicationService`: the worker's communication service, for Python.
//!
//! Python hands over raw host pointers (`tensor.data_ptr()`, `array.ctypes.data`) with the
//! object that owns the memory. The binding keeps a reference to that owner until the
//! operation has been waited for, so the buffer cannot be freed while the pipeline threads
//! write the sum into it. Every call that can block runs with the GIL released.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};
use sumflow_client::coordinator::CoordinatorOptions;
use sumflow_comm::trace::DEFAULT_MAX_EVENTS;
use sumflow_comm::{
    CommConfig, CommError, CommunicationService, Compression, Declaration, Exchange, ReduceOp,
    Scheduling,
};
use sumflow_wire::{timing, Dtype, ErrorCode, JobToken};

use crate::errors::{to_py_err, ErrorKind};
use crate::owners::Owners;
use crate::staging::{self, StagedSum};
use crate::trace;
use sumflow_cuda::{DriverEngine, Stager};

/// Which Python exception a communication error becomes.
pub(crate) fn kind_of(e: &CommError) -> ErrorKind {
    match e {
        CommError::Invalid(_) | CommError::Layout(_) | CommError::UnknownHandle(_) => {
            ErrorKind::Invalid
        }
        CommError::Io { .. } => ErrorKind::Io,
        CommError::Timeout { .. } => ErrorKind::Timeout,
        CommError::Busy(_) | CommError::Shutdown => ErrorKind::Other,
        CommError::Failed { code, .. } | CommError::Client(_, code) => match code {
            ErrorCode::Timeout => ErrorKind::Timeout,
            ErrorCode::NodeFailed | ErrorCode::ShuttingDown => ErrorKind::NodeFailed,
            ErrorCode::KeyMismatch => ErrorKind::DeclarationMismatch,
            ErrorCode::BadFrame
            | ErrorCode::UnsupportedVersion
            | ErrorCode::UnknownOp
            | ErrorCode::FrameTooLarge
            | ErrorCode::UnexpectedOp
            | ErrorCode::BadRank
            | ErrorCode::UnknownKey
            | ErrorCode::RoundOutOfSequence
            | ErrorCode::DuplicatePush
            | ErrorCode::DuplicatePull => ErrorKind::Protocol,
            _ => ErrorKind::Other,
        },
    }
}

fn py_err(py: Python<'_>, e: CommError) -> PyErr {
    to_py_err(py, kind_of(&e), e.to_string())
}

pub(crate) fn seconds(what: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| {
            PyValueError::new_err(format!(
                "{what} must be a positive number of seconds, not {secs}"
            ))
        })
}

/// A link rate given in Gbit/s, in the whole Mbit/s the cluster map carries.
fn link_mbit(gbits: f64) -> PyResult<u32> {
    let mbit = (gbits * 1000.0).round();
    if gbits.is_finite() && (1.0..=f64::from(u32::MAX)).contains(&mbit) {
        Ok(mbit as u32)
    } else {
        Err(PyValueError::new_err(format!(
            "link_gbits must be a link rate of at least 0.001 Gbit/s, not {gbits}"
        )))
    }
}

/// A compression as Python gives it: (compressor, parameter, error feedback).
type CompressionSpec = (String, f64, bool);

/// A tensor of `declare_group` as Python gives it: `(name, dtype, elements, compression)`,
/// or with its members after them.
#[derive(FromPyObject)]
enum TensorSpec {
    WithMembers(
        String,
        String,
        u64,
        Option<CompressionSpec>,
        Option<Vec<i64>>,
    ),
    Plain(String, String, u64, Option<CompressionSpec>),
}

/// A declaration whose members (`members`, already checked by [`member_ranks`]) are
/// borrowed from the caller.
fn declaration<'a>(
    py: Python<'_>,
    name: &'a str,
    dtype_name: &str,
    elements: u64,
    compression: Option<CompressionSpec>,
    members: Option<&'a [u32]>,
    shape: Option<&'a [u64]>,
) -> PyResult<Declaration<'a>> {
    let compression = compression
        .map(|(c, param, feedback)| Compression::parse(&c, param, feedback))
        .transpose()
        .map_err(|e| py_err(py, e))?;
    Ok(Declaration {
        name,
        dtype: dtype(dtype_name)?,
        elements,
        compression,
        members,
        home: None,
        shape,
    })
}

/// A tensor's members as the core takes them: ranks in ascending order. Python may list
/// them in any order; the core refuses an empty list, duplicates and ranks beyond the job
/// (ValueErrors naming the tensor), and this a rank no worker can have.
fn member_ranks(name: &str, members: Option<Vec<i64>>) -> PyResult<Option<Vec<u32>>> {
    let Some(members) = members else {
        return Ok(None);
    };
    let mut ranks = members
        .iter()
        .map(|&r| {
            u32::try_from(r).map_err(|_| {
                PyValueError::new_err(format!(
                    "tensor '{name}' names {r} among its members, which is not a worker rank"
                ))
            })
        })
        .collect::<PyResult<Vec<u32>>>()?;
    ranks.sort_unstable();
    Ok(Some(ranks))
}

fn dtype(name: &str) -> PyResult<Dtype> {
    Dtype::from_name(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "unknown dtype '{name}'; expected one of f32, f16, bf16, f64, i32, i64"
        ))
    })
}

/// The reduction `push_pull` is asked for.
fn reduce_op(op: Option<&str>, average: bool) -> PyResult<ReduceOp> {
    match (op, average) {
        (None, false) => Ok(ReduceOp::Sum),
        (None, true) => Ok(ReduceOp::Average),
        (Some("min"), false) => Ok(ReduceOp::Min),
        (Some("max"), false) => Ok(ReduceOp::Max),
        (Some("product"), false) => Ok(ReduceOp::Product),
        (Some(op), _) => Err(PyValueError::new_err(format!(
            "op must be 'min', 'max' or 'product' (and average false), not {op:?}"
        ))),
    }
}

/// `push_pull`'s byte ranges as the core takes them.
fn exchange(pushes: Option<Vec<(u64, u64)>>, pulls: Option<Vec<(u64, u64)>>) -> Exchange {
    let ranges = |r: Option<Vec<(u64, u64)>>| r.map(|r| r.into_iter().map(|(a, b)| a..b).collect());
    Exchange {
        pushes: ranges(pushes),
        pulls: ranges(pulls),
    }
}

/// The communication service of one worker: joins the job through its coordinator,
/// connects to every summation server, and sums tensors across workers.
#[pyclass(name = "CommunicationService", module = "sumflow._core", frozen)]
#[derive(Debug)]
pub struct PyCommunicationService {
    svc: Arc<CommunicationService>,
    owners: Owners,
    /// The CUDA staging thread, started by the first CUDA tensor; or why it cannot be.
    stager: OnceLock<Result<Stager<DriverEngine>, String>>,
}

#[pymethods]
impl PyCommunicationService {
    #[new]
    #[pyo3(signature = (
        coordinator, token, *, host_id, rank = None, name = None,
        partition_bytes = None, link_gbits = None, scheduler = None, credit_bytes = None,
        push_window_bytes = None, prophet_stage_factor = 0.0,
        connections_per_cpu_server = None, shared_memory = true, local_sockets = true,
        server_shared_memory = true, hierarchical = true,
        join_timeout = timing::DEFAULT_JOIN_TIMEOUT.as_secs_f64(),
        declare_timeout = timing::DEFAULT_JOIN_TIMEOUT.as_secs_f64(),
        connect_timeout = timing::DEFAULT_CONNECT_TIMEOUT.as_secs_f64(),
        heartbeat_interval = timing::DEFAULT_HEARTBEAT_INTERVAL.as_secs_f64(),
        heartbeat_timeout = timing::DEFAULT_HEARTBEAT_TIMEOUT.as_secs_f64(),
        trace_dir = None, trace_start_step = None, trace_steps = None, trace_max_events = None,
        stall_warning = timing::DEFAULT_STALL_WARNING.as_secs_f64(),
    ))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        coordinator: &str,
        token: &str,
        host_id: &str,
        rank: Option<u32>,
        name: Option<String>,
        partition_bytes: Option<u64>,
        link_gbits: Option<f64>,
        scheduler: Option<&str>,
        credit_bytes: Option<u64>,
        push_window_bytes: Option<u64>,
        prophet_stage_factor: f64,
        connections_per_cpu_server: Option<u32>,
        shared_memory: bool,
        local_sockets: bool,
        server_shared_memory: bool,
        hierarchical: bool,
        join_timeout: f64,
        declare_timeout: f64,
        connect_timeout: f64,
        heartbeat_interval: f64,
        heartbeat_timeout: f64,
        trace_dir: Option<PathBuf>,
        trace_start_step: Option<u64>,
        trace_steps: Option<u64>,
        trace_max_events: Option<usize>,
        stall_warning: f64,
    ) -> PyResult<Self> {
        // The core's warnings (a lost server, a failing operation) reach the script's
        // stderr; nothing else sets up Rust logging in a worker process.
        sumflow_wire::logging::init_worker_logging();
        let token = JobToken::new(token.trim().as_bytes().to_vec())
            .map_err(|e| PyValueError::new_err(format!("job token: {e}")))?;
        let mut cfg = CommConfig::new(coordinator, token, host_id);
        cfg.rank = rank;
        if let Some(name) = name {
            cfg.name = name;
        }
        cfg.partition_bytes = partition_bytes;
        cfg.link_mbit = link_gbits.map(link_mbit).transpose()?;
        if let Some(scheduler) = scheduler {
            cfg.scheduler = scheduler.parse().map_err(PyValueError::new_err)?;
        }
        cfg.credit_bytes = credit_bytes;
        cfg.push_window_bytes = push_window_bytes;
        if !(prophet_stage_factor.is_finite() && prophet_stage_factor >= 0.0) {
            return Err(PyValueError::new_err(format!(
                "prophet_stage_factor must be a number >= 0, not {prophet_stage_factor}"
            )));
        }
        cfg.prophet.stage_factor = prophet_stage_factor;
        cfg.connections_per_cpu_server = connections_per_cpu_server;
        cfg.shared_memory = shared_memory;
        cfg.local_sockets = local_sockets;
        cfg.server_shared_memory = server_shared_memory;
        cfg.hierarchical = hierarchical;
        cfg.join_timeout = seconds("join_timeout", join_timeout)?;
        cfg.declare_timeout = seconds("declare_timeout", declare_timeout)?;
        cfg.connect_timeout = seconds("connect_timeout", connect_timeout)?;
        cfg.coordinator_options = CoordinatorOptions {
            heartbeat_interval: seconds("heartbeat_interval", heartbeat_interval)?,
            heartbeat_timeout: seconds("heartbeat_timeout", heartbeat_timeout)?,
            connect_timeout: cfg.connect_timeout,
            ..CoordinatorOptions::default()
        };
        cfg.trace = trace::config(trace_dir, trace_start_step, trace_steps, trace_max_events)?;
        cfg.stall_warning = if stall_warning == 0.0 {
            None
        } else {
            Some(seconds("stall_warning", stall_warning)?)
        };
        let svc = py
            .detach(move || CommunicationService::start(cfg))
            .map_err(|e| py_err(py, e))?;
        Ok(PyCommunicationService {
            svc: Arc::new(svc),
            owners: Owners::default(),
            stager: OnceLock::new(),
        })
    }

    /// This worker's rank, 0 to size - 1.
    #[getter]
    fn rank(&self) -> u32 {
        self.svc.rank()
    }

    /// The number of workers.
    #[getter]
    fn size(&self) -> u32 {
        self.svc.size()
    }

    /// This worker's rank among the workers of its machine.
    #[getter]
    fn local_rank(&self) -> u32 {
        self.svc.local_rank()
    }

    /// The number of workers on this machine.
    #[getter]
    fn local_size(&self) -> u32 {
        self.svc.local_size()
    }

    /// Whether every worker machine runs the same number of workers.
    #[getter]
    fn is_homogeneous(&self) -> bool {
        self.svc.is_homogeneous()
    }

    /// The number of summation servers.
    #[getter]
    fn num_servers(&self) -> usize {
        self.svc.cluster_map().servers.len()
    }

    /// Changes the partition size and/or the credit per server. Every worker must make
    /// the same call between the same two steps, with no operation in flight.
    #[pyo3(signature = (partition_bytes = None, credit_bytes = None))]
    fn reconfigure(
        &self,
        py: Python<'_>,
        partition_bytes: Option<u64>,
        credit_bytes: Option<u64>,
    ) -> PyResult<()> {
        let svc = Arc::clone(&self.svc);
        py.detach(|| svc.reconfigure(partition_bytes, credit_bytes))
            .map_err(|e| py_err(py, e))
    }

    /// The schedule in use: ``{"scheduler", "partition_bytes", "derived",
    /// "credit_bytes"}`` (``derived``: the partition size is derived from each declaration,
    /// and ``partition_bytes`` is the last group's, chosen for ``"partition_reason"``),
    /// plus ``"bandwidth"`` (bytes/s at which partitions complete) once measured.
    fn schedule<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let Scheduling {
            scheduler,
            partition_bytes,
            derived,
            reason,
            credit_bytes,
        } = self.svc.schedule();
        let d = PyDict::new(py);
        d.set_item("scheduler", scheduler.name())?;
        d.set_item("partition_bytes", partition_bytes)?;
        d.set_item("derived", derived)?;
        if let Some(reason) = reason {
            d.set_item("partition_reason", reason)?;
        }
        d.set_item("credit_bytes", credit_bytes)?;
        if let Some(rate) = self.svc.bandwidth() {
            d.set_item("bandwidth", rate)?;
        }
        Ok(d)
    }

    /// The bytes this worker wrote to and read from the summation servers so far, counted
    /// at the sockets: ``([(tensor, key, sent, received), ...], (sent, received))``, the
    /// second for frames naming no key (leaving).
    #[allow(clippy::type_complexity)]
    fn wire_bytes(&self) -> (Vec<(String, u64, u64, u64)>, (u64, u64)) {
        let (keys, other) = self.svc.wire_bytes();
        (
            keys.into_iter()
                .map(|k| (k.tensor.to_string(), k.key, k.bytes.sent, k.bytes.received))
                .collect(),
            (other.sent, other.received),
        )
    }

    /// Declares a tensor by name; returns its id. Every worker must declare it with the
    /// same dtype, number of elements, compression (`(compressor, parameter,
    /// error_feedback)` or `None`) and members (the ranks of the workers that sum it, or
    /// `None` for every worker). `home`: the worker that takes the tensor's bytes, on
    /// whose machine its partitions are then kept (see `Declaration::home`). `shape`: its
    /// dimensions, which every worker must then declare alike too (`None`: a flat buffer).
    #[pyo3(signature = (
        name, dtype_name, elements, compression = None, members = None, home = None,
        shape = None,
    ))]
    #[allow(clippy::too_many_arguments)]
    fn declare(
        &self,
        py: Python<'_>,
        name: &str,
        dtype_name: &str,
        elements: u64,
        compression: Option<CompressionSpec>,
        members: Option<Vec<i64>>,
        home: Option<u32>,
        shape: Option<Vec<u64>>,
    ) -> PyResult<u32> {
        let members = member_ranks(name, members)?;
        let mut decl = declaration(
            py,
            name,
            dtype_name,
            elements,
            compression,
            members.as_deref(),
            shape.as_deref(),
        )?;
        decl.home = home;
        let svc = Arc::clone(&self.svc);
        py.detach(|| svc.declare_one(&decl))
            .map_err(|e| py_err(py, e))
    }

    /// Declares tensors `(name, dtype, elements, compression[, members])` together and
    /// places their partitions by BytePS's Eq. 1 and 2; returns their ids in order.
    /// `shapes`: each tensor's dimensions (`None` for a flat one), as `declare` takes.
    #[pyo3(signature = (tensors, shapes = None))]
    fn declare_group(
        &self,
        py: Python<'_>,
        tensors: Vec<TensorSpec>,
        shapes: Option<Vec<Option<Vec<u64>>>>,
    ) -> PyResult<Vec<u32>> {
        let shapes = shapes.unwrap_or_else(|| vec![None; tensors.len()]);
        if shapes.len() != tensors.len() {
            return Err(PyValueError::new_err(format!(
                "declare_group: {} shapes for {} tensors",
                shapes.len(),
                tensors.len()
            )));
        }
        let tensors = tensors
            .into_iter()
            .map(|t| {
                let (n, d, e, c, m) = match t {
                    TensorSpec::WithMembers(n, d, e, c, m) => (n, d, e, c, m),
                    TensorSpec::Plain(n, d, e, c) => (n, d, e, c, None),
                };
                let m = member_ranks(&n, m)?;
                Ok((n, d, e, c, m))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let decls = tensors
            .iter()
            .zip(&shapes)
            .map(|((n, d, e, c, m), shape)| {
                declaration(py, n, d, *e, c.clone(), m.as_deref(), shape.as_deref())
            })
            .collect::<PyResult<Vec<_>>>()?;
        let svc = Arc::clone(&self.svc);
        py.detach(|| svc.declare_groups(&decls))
            .map_err(|e| py_err(py, e))
    }

    /// Starts summing tensor `tensor_id` across workers in place, in the `nbytes` bytes
    /// at address `ptr`, which `owner` must own (kept alive until `wait`). Returns a
    /// handle at once. Lower `priority` is sent first; `average` divides by the number of
    /// workers summed: the tensor's members, or the size. `op` "min", "max" or "product"
    /// reduces otherwise. `pushes` and `pulls`: the `(start, end)` byte ranges this worker
    /// contributes and takes back (None: all); see `Exchange`.
    #[pyo3(signature = (
        tensor_id, owner, ptr, nbytes, priority = 0, average = false, *, op = None,
        pushes = None, pulls = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn push_pull(
        &self,
        py: Python<'_>,
        tensor_id: u32,
        owner: Py<PyAny>,
        ptr: usize,
        nbytes: usize,
        priority: i64,
        average: bool,
        op: Option<&str>,
        pushes: Option<Vec<(u64, u64)>>,
        pulls: Option<Vec<(u64, u64)>>,
    ) -> PyResult<u64> {
        let op = reduce_op(op, average)?;
        let exchange = exchange(pushes, pulls);
        self.owners
            .start(owner, || {
                // SAFETY: `owner` owns `ptr..ptr+nbytes` (the documented contract of this
                // method, upheld by sumflow.torch, which passes a contiguous tensor and its
                // data_ptr) and stays referenced in `owners` until `wait` returns, so the
                // memory outlives the operation; Python code touching it meanwhile is the
                // caller's race, as with any asynchronous in-place collective.
                unsafe {
                    self.svc.push_exchange(
                        tensor_id,
                        (ptr as *mut u8, nbytes),
                        priority,
                        op,
                        &exchange,
                    )
                }
            })
            .map_err(|e| py_err(py, e))
    }

    /// `push_pull` of a CUDA tensor through its pinned host buffer: marks the point of
    /// the caller's CUDA stream `stream` (a `cudaStream_t`, 0: the legacy default stream)
    /// of device `device` where the tensor at device address `source_ptr` (owned by
    /// `source`) is complete, and returns at once. A staging thread copies the tensor
    /// into the `nbytes` bytes at host address `ptr` (pinned memory owned by `owner`) on
    /// a side stream once the GPU reaches that point, then issues the sum, all without
    /// the GIL. `name` names the tensor in errors. The returned `StagedSum` gives the
    /// sum's handle once issued. Raises where the CUDA driver cannot be used
    /// (`cuda_staging_unavailable` says why beforehand).
    #[pyo3(signature = (
        name, source, source_ptr, device, stream, tensor_id, owner, ptr, nbytes, priority = 0,
        average = false, *, op = None, pushes = None, pulls = None
    ))]
    #[allow(clippy::too_many_arguments)]
    fn push_pull_after_copy(
        &self,
        py: Python<'_>,
        name: String,
        source: Py<PyAny>,
        source_ptr: u64,
        device: u32,
        stream: usize,
        tensor_id: u32,
        owner: Py<PyAny>,
        ptr: usize,
        nbytes: usize,
        priority: i64,
        average: bool,
        op: Option<&str>,
        pushes: Option<Vec<(u64, u64)>>,
        pulls: Option<Vec<(u64, u64)>>,
    ) -> PyResult<StagedSum> {
        let op = reduce_op(op, average)?;
        let stager = self
            .stager()
            .map_err(|why| to_py_err(py, ErrorKind::Other, why.to_string()))?;
        let sum = staging::Sum {
            name,
            device,
            tensor_id,
            host: (owner, ptr, nbytes),
            source: (source, source_ptr),
            priority,
            op,
            exchange: exchange(pushes, pulls),
        };
        staging::stage(py, stager, &self.svc, &self.owners, stream, sum)
    }

    /// None where CUDA tensors can be staged through the CUDA driver
    /// (`push_pull_after_copy`); else why not (no driver, no GPU). The first call loads
    /// the driver and starts the staging thread.
    fn cuda_staging_unavailable(&self) -> Option<String> {
        self.stager().err().map(str::to_string)
    }

    /// Asynchronous training (BytePS §4.3): adds the `nbytes` bytes at `ptr` (owned by
    /// `owner`), this worker's delta of tensor `tensor_id`, to the servers' stored value,
    /// and overwrites them with the stored value once the delta is in. `initial` (an
    /// address of as many bytes, owned by `initial_owner`) is the value the servers start
    /// from, read by the tensor's first push only. With `staleness` s, the worker's round
    /// r returns once every worker has pushed round r − s. Returns a handle at once.
    #[pyo3(signature = (
        tensor_id, owner, ptr, nbytes, initial_owner, initial, staleness = None, priority = 0
    ))]
    #[allow(clippy::too_many_arguments)]
    fn push_delta(
        &self,
        py: Python<'_>,
        tensor_id: u32,
        owner: Py<PyAny>,
        ptr: usize,
        nbytes: usize,
        initial_owner: Py<PyAny>,
        initial: usize,
        staleness: Option<u32>,
        priority: i64,
    ) -> PyResult<u64> {
        let both = PyTuple::new(py, [owner, initial_owner])?;
        self.owners
            .start(both.into_any().unbind(), || {
                // SAFETY: `owner` and `initial_owner` own the two spans (the documented
                // contract, upheld by sumflow.torch) and stay referenced in `owners` until
                // `wait` returns.
                unsafe {
                    self.svc.push_delta(
                        tensor_id,
                        (ptr as *mut u8, nbytes),
                        initial as *mut u8,
                        staleness,
                        priority,
                    )
                }
            })
            .map_err(|e| py_err(py, e))
    }

    /// Retires tensor `tensor_id`: this worker will never push it again. Raises
    /// `ValueError` while an operation on it is in flight. Servers free its keys, and the
    /// coordinator its name, once every worker of it has retired it; declaring the name
    /// again makes a new tensor with a new id (ids are never reused).
    fn retire(&self, py: Python<'_>, tensor_id: u32) -> PyResult<()> {
        let svc = Arc::clone(&self.svc);
        py.detach(|| svc.retire(tensor_id))
            .map_err(|e| py_err(py, e))
    }

    /// Tensors declared by this worker and not retired.
    fn live_tensors(&self) -> usize {
        self.svc.live_tensors()
    }

    /// True once the operation has finished; raises its error if it failed.
    fn poll(&self, py: Python<'_>, handle: u64) -> PyResult<bool> {
        self.svc.poll(handle).map_err(|e| py_err(py, e))
    }

    /// Waits for an operation to finish, at most `timeout` seconds, and releases its
    /// handle and buffer owner. Raises the operation's error if it failed.
    fn wait(&self, py: Python<'_>, handle: u64, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        let svc = Arc::clone(&self.svc);
        let result = py.detach(|| svc.wait(handle, timeout));
        // A timed-out operation may still write into the buffer: keep its owner.
        if !matches!(result, Err(CommError::Timeout { .. })) {
            self.owners.release(handle);
        }
        result.map_err(|e| py_err(py, e))
    }

    /// Waits until every worker reaches this barrier, at most `timeout` seconds.
    fn barrier(&self, py: Python<'_>, timeout: f64) -> PyResult<()> {
        let timeout = seconds("timeout", timeout)?;
        let svc = Arc::clone(&self.svc);
        py.detach(|| svc.barrier(timeout))
            .map_err(|e| py_err(py, e))
    }

    /// Horovod's ``join()``: this worker has finished its data. Waits (GIL released) for
    /// its operations in flight, then until every worker has joined, the others' sums
    /// meanwhile counting it as zeros; returns the rank of the worker that joined last,
    /// the same on every worker. Each wait is bounded by `timeout` seconds.
    fn join(&self, py: Python<'_>, timeout: f64) -> PyResult<u32> {
        let timeout = seconds("timeout", timeout)?;
        let svc = Arc::clone(&self.svc);
        py.detach(|| svc.join(timeout)).map_err(|e| py_err(py, e))
    }

    /// One line per summation server: the bytes of declared tensors it sums.
    fn placement_report(&self) -> Vec<String> {
        self.svc.placement_report()
    }

    /// Ends the current training step for the trace window (see ``docs/tracing.md``).
    /// Returns (path, steps it holds) when this step closed the window and the trace
    /// was written.
    fn mark_step(&self, py: Python<'_>) -> PyResult<Option<(String, String)>> {
        let svc = Arc::clone(&self.svc);
        let file = py
            .detach(|| svc.mark_step())
            .map_err(|e| trace::py_err(py, e))?;
        Ok(trace::written(file))
    }

    /// Writes the trace now unless it was written already (or tracing is off); returns
    /// (path, steps it holds or why none).
    fn trace_flush(&self, py: Python<'_>) -> PyResult<Option<(String, String)>> {
        let tracer = self.svc.tracer();
        let file = py
            .detach(|| tracer.flush())
            .map_err(|e| trace::py_err(py, e))?;
        Ok(trace::written(file))
    }

    /// Starts recording a trace of an interval on demand into `path` (written by
    /// `trace_interval_stop`), at most `max_events` events (default: the window's
    /// default), whatever the trace window does (see ``docs/tracing.md``).
    #[pyo3(signature = (path, max_events = None))]
    fn trace_interval_start(
        &self,
        py: Python<'_>,
        path: PathBuf,
        max_events: Option<usize>,
    ) -> PyResult<()> {
        self.svc
            .tracer()
            .start_interval(path, max_events.unwrap_or(DEFAULT_MAX_EVENTS))
            .map_err(|e| trace::py_err(py, e))
    }

    /// Stops recording the interval and writes its file; returns (path, what it holds), or
    /// None when no interval was being recorded.
    fn trace_interval_stop(&self, py: Python<'_>) -> PyResult<Option<(String, String)>> {
        let tracer = self.svc.tracer();
        let file = py
            .detach(|| tracer.stop_interval())
            .map_err(|e| trace::py_err(py, e))?;
        Ok(trace::written(file))
    }

    /// Whether trace events are being recorded now.
    #[getter]
    fn tracing(&self) -> bool {
        self.svc.tracer().active()
    }

    /// The trace clock: nanoseconds since this worker's start, for `trace_span`.
    fn trace_now(&self) -> u64 {
        self.svc.tracer().now_ns()
    }

    /// Records a span on the Python track `track` from `start` to `end` (`trace_now()`
    /// readings); nothing unless recording.
    #[pyo3(signature = (track, name, start, end, args = None))]
    fn trace_span(
        &self,
        track: &str,
        name: &str,
        start: u64,
        end: u64,
        args: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        trace::span(&self.svc.tracer(), track, name, start, end, args)
    }

    /// Records an instant on the Python track `track` at `at` (a `trace_now()` reading;
    /// now if None); nothing unless recording.
    #[pyo3(signature = (track, name, at = None, args = None))]
    fn trace_instant(
        &self,
        track: &str,
        name: &str,
        at: Option<u64>,
        args: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<()> {
        trace::instant(&self.svc.tracer(), track, name, at, args)
    }

    /// Leaves the job gracefully. Operations in flight fail, and so does any later call.
    #[pyo3(signature = (reason = "shutdown"))]
    fn shutdown(&self, py: Python<'_>, reason: &str) -> PyResult<()> {
        let svc = Arc::clone(&self.svc);
        let result = py.detach(|| svc.shutdown(reason));
        // Every operation has failed or finished by now: nothing writes into the buffers.
        self.owners.release_all();
        result.map_err(|e| py_err(py, e))
    }

    fn __repr__(&self) -> String {
        format!(
            "CommunicationService(rank={}, size={}, servers={})",
            self.svc.rank(),
            self.svc.size(),
            self.svc.cluster_map().servers.len()
        )
    }
}

impl PyCommunicationService {
    fn stager(&self) -> Result<&Stager<DriverEngine>, &str> {
        self.stager
            .get_or_init(staging::start_stager)
            .as_ref()
            .map_err(String::as_str)
    }
}
