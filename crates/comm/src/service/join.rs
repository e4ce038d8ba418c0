//! Horovod's `join()`: a worker that has finished its data lets the others' rounds
//! complete without it.

use std::time::Duration;

use sumflow_client::server::Reply;
use sumflow_client::{ClientError, ServerClient, ServerOptions};
use sumflow_wire::{BarrierGroup, ErrorCode, Message};
use tracing::info;

use super::CommunicationService;
use crate::error::CommError;

impl CommunicationService {
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
}

/// A failure of one step of `join`, naming the step.
fn join_error(step: &str, e: ClientError) -> CommError {
    CommError::Client(format!("join(): {step}: {e}"), e.code())
}
