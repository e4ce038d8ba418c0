//! The coordinator's failure notices, carried to the operations they doom.
//!
//! A summation server that hangs with its sockets open breaks no lane: only the
//! coordinator's heartbeat timeout notices it. Its notice fails, at once, every operation
//! queued for that server, in flight on it or waiting for it, as a broken lane would. A
//! lost coordinator fails every operation in flight and every later one: without it no
//! failure would be noticed any more, and a hang would last until the operation timeout.
//! (Failed workers reach this worker through the servers, which fail the rounds that can
//! no longer complete, and through the shared-memory stage's own subscription.)

use std::sync::{Arc, OnceLock};

use crossbeam_channel::Receiver;
use sumflow_client::coordinator::NodeFailure;
use sumflow_wire::{ErrorCode, Role};
use tracing::warn;

use crate::error::CommError;
use crate::handles::Handles;
use crate::pipeline::ServerFailures;

/// Why the job cannot go on, once the coordinator is lost: set once, read by every push.
#[derive(Clone, Debug, Default)]
pub struct CoordinatorLoss(Arc<OnceLock<String>>);

impl CoordinatorLoss {
    /// The error for an operation on `tensor`, if the coordinator is lost.
    pub fn error(&self, tensor: &str) -> Option<CommError> {
        self.0.get().map(|why| lost(tensor, why))
    }
}

fn lost(tensor: &str, why: &str) -> CommError {
    CommError::Failed {
        tensor: tensor.to_string(),
        code: ErrorCode::NodeFailed,
        message: format!(
            "{why}; without the coordinator no failure could be detected any more, so this \
             worker stops communicating"
        ),
    }
}

/// Starts the thread that acts on the notices; it ends when the coordinator connection
/// is dropped (the channel closes).
pub fn watch(
    notices: Receiver<NodeFailure>,
    servers: ServerFailures,
    handles: Arc<Handles>,
) -> std::io::Result<CoordinatorLoss> {
    let loss = CoordinatorLoss::default();
    let record = loss.clone();
    std::thread::Builder::new()
        .name("sumflow-failures".into())
        .spawn(move || {
            for f in notices {
                if f.is_coordinator() {
                    let why = format!("{} is lost: {}", f.name, f.reason);
                    warn!(reason = %why, "failing every operation");
                    let _ = record.0.set(why.clone());
                    handles.fail_all(None, |t| lost(t, &why));
                } else if f.node.role == Role::Server {
                    let why = format!("the coordinator declared it failed: {}", f.reason);
                    servers.report(f.node.rank as usize, &why);
                }
            }
        })?;
    Ok(loss)
}
