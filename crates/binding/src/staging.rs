//! CUDA tensors staged to host memory without Python (`sumflow_cuda`): the sum that
//! `CommunicationService.push_pull_after_copy` issues once the copy is complete, and the
//! `StagedSum` Python waits on for it.

use std::sync::Arc;
use std::time::Duration;

use pyo3::prelude::*;
use sumflow_comm::trace::Track;
use sumflow_comm::{CommunicationService, Exchange, ReduceOp};
use sumflow_cuda::{DriverEngine, DriverError, HostCopy, Stager, Ticket};

use crate::errors::{to_py_err, ErrorKind};
use crate::owners::Owners;
use crate::service::{kind_of, seconds};

/// A staged sum's outcome: its core handle, or the error to raise (kind, message).
type Outcome = Result<u64, (ErrorKind, String)>;

/// The trace track of the copies to host memory (the one `sumflow.torch._staging` uses).
const TRACK: &str = "cuda staging";

/// The stager of a communication service, started on its first CUDA tensor; or why the
/// driver cannot stage.
pub fn start_stager() -> Result<Stager<DriverEngine>, String> {
    let driver = sumflow_cuda::Driver::load().map_err(|e| e.to_string())?;
    Stager::new(DriverEngine::new(driver))
        .map_err(|e| format!("sumflow's CUDA staging thread could not start: {e}"))
}

/// What to sum once a tensor's copy to host memory is complete: `push_exchange`'s
/// arguments, and the objects owning the host buffer and the device tensor.
pub struct Sum {
    pub name: String,
    pub device: u32,
    pub tensor_id: u32,
    pub host: (Py<PyAny>, usize, usize),
    pub source: (Py<PyAny>, u64),
    pub priority: i64,
    pub op: ReduceOp,
    pub exchange: Exchange,
}

/// Marks the end of the caller's work on `stream` that produces the tensor, and queues its
/// copy into the host buffer; the sum is issued on the staging thread once the copy is
/// complete.
pub fn stage(
    py: Python<'_>,
    stager: &Stager<DriverEngine>,
    svc: &Arc<CommunicationService>,
    owners: &Owners,
    stream: usize,
    sum: Sum,
) -> PyResult<StagedSum> {
    let marker = stager
        .engine()
        .mark(sum.device, stream)
        .map_err(|e| to_py_err(py, ErrorKind::Other, copy_failed(&sum.name, sum.device, &e)))?;
    let ticket = Arc::new(Ticket::default());
    let staged = StagedSum {
        ticket: Arc::clone(&ticket),
        name: sum.name.clone(),
        device: sum.device,
    };
    let tracer = svc.tracer();
    let queued = tracer.active().then(|| tracer.now_ns());
    let svc = Arc::clone(svc);
    let owners = owners.clone();
    let (host_owner, ptr, nbytes) = sum.host;
    let copy = HostCopy {
        dst: ptr,
        src: sum.source.1,
        len: nbytes,
    };
    let then = move |copied: Result<(), DriverError>| {
        // The device tensor is read: the caller's work may free it now.
        drop(sum.source);
        let outcome: Outcome = match copied {
            Err(e) => Err((ErrorKind::Other, copy_failed(&sum.name, sum.device, &e))),
            Ok(()) => {
                if let Some(start) = queued.filter(|_| tracer.active()) {
                    let (start, end) = (tracer.time_at(start), tracer.time_at(tracer.now_ns()));
                    let name = format!("to host {}", sum.name);
                    tracer.span(Track::Python(TRACK.into()), name, start, end, &[]);
                }
                owners
                    .start(host_owner, || {
                        // SAFETY: `host_owner` owns `ptr..ptr+nbytes` (the contract of
                        // `push_pull_after_copy`, as of `push_pull`) and stays referenced in
                        // `owners` until `wait` returns.
                        unsafe {
                            svc.push_exchange(
                                sum.tensor_id,
                                (ptr as *mut u8, nbytes),
                                sum.priority,
                                sum.op,
                                &sum.exchange,
                            )
                        }
                    })
                    .map_err(|e| (kind_of(&e), e.to_string()))
            }
        };
        ticket.complete(outcome);
    };
    // SAFETY: the host buffer is owned by `host_owner`, which `then` holds until the copy
    // is complete; the caller writes it only through this operation (the pinned buffer of
    // a tensor name, which is never in flight twice).
    unsafe { stager.submit(marker, copy, then) };
    Ok(staged)
}

fn copy_failed(name: &str, device: u32, e: &DriverError) -> String {
    format!("tensor '{name}': its copy from cuda:{device} to host memory failed: {e}")
}

/// A CUDA tensor's sum, issued once its copy to host memory is complete.
#[pyclass(name = "StagedSum", module = "sumflow._core", frozen)]
#[derive(Debug)]
pub struct StagedSum {
    ticket: Arc<Ticket<Outcome>>,
    name: String,
    device: u32,
}

#[pymethods]
impl StagedSum {
    /// Whether its sum was issued (or failed to be).
    fn ready(&self) -> bool {
        self.ticket.get().is_some()
    }

    /// The handle of its sum, in a list, once issued: waits at most `timeout` seconds for
    /// the copy (0: only looks). Raises what the copy or the issue raised, every time it
    /// is asked.
    fn cores(&self, py: Python<'_>, timeout: f64) -> PyResult<Vec<u64>> {
        let limit = if timeout == 0.0 {
            Duration::ZERO
        } else {
            seconds("timeout", timeout)?
        };
        let ticket = Arc::clone(&self.ticket);
        match py.detach(|| ticket.wait(limit)) {
            Some(Ok(handle)) => Ok(vec![handle]),
            Some(Err((kind, message))) => Err(to_py_err(py, kind, message)),
            None => Err(to_py_err(
                py,
                ErrorKind::Timeout,
                format!(
                    "tensor '{}': its copy from cuda:{} to host memory did not complete \
                     within {timeout} s (SUMFLOW_TIMEOUT): the GPU is still busy with the \
                     work queued before it, or hung",
                    self.name, self.device
                ),
            )),
        }
    }
}
