//! The communication service: runs inside each training process and moves its gradients
//! through the job's summation servers.
//!
//! A tensor is declared once by name; each push_pull of it is cut into partitions, each
//! partition goes to the server placement chose for it, and the [`pipeline`] pushes
//! partitions in priority order and writes each pulled sum back into the tensor.

mod average;
pub mod error;
pub mod handles;
pub mod pipeline;
mod queue;

pub use error::CommError;
