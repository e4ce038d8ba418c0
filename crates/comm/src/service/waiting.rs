//! Waiting for an operation: bounded, warning while it stalls, and failing with the
//! cause rather than its consequence (a job-fatal error, the coordinator's loss).

use std::time::{Duration, Instant};

use sumflow_wire::{BarrierGroup, ErrorCode};
use tracing::{debug, warn};

use super::CommunicationService;
use crate::error::CommError;
use crate::local::LOCAL_SERVER;

/// How often a wait looks for a job-fatal error from the coordinator.
const JOB_ERROR_CHECK: Duration = Duration::from_millis(100);

/// How long a failed wait looks for a job-fatal error that may explain the failure.
const JOB_ERROR_GRACE: Duration = Duration::from_millis(300);

impl CommunicationService {
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
    pub(super) fn job_error(&self) -> Option<CommError> {
        self.job
            .job_error()
            .map(|e| CommError::Client(format!("the job cannot continue: {}", e.message), e.code))
    }

    /// Waits until every worker reaches this barrier.
    pub fn barrier(&self, timeout: Duration) -> Result<(), CommError> {
        self.job.barrier(BarrierGroup::Workers, timeout)?;
        Ok(())
    }
}
