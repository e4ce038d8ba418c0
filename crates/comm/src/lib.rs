//! The communication service: runs inside each training process and moves its gradients
//! through the job's summation servers.
//!
//! A tensor is declared once by name; each push_pull of it is cut into partitions, each
//! partition goes to the server placement chose for it, and the [`pipeline`] pushes
//! partitions in priority order and writes each pulled sum back into the tensor.
//!
//! The data path of one declared tensor, on every worker alike:
//!
//! 1. [`partition`] cuts it into runs of at most the partition size (4 MiB by default) and
//!    keys each run by declaration index and position, so all workers agree on the keys
//!    without talking.
//! 2. [`placement`] picks each key's summation server so that every server sums the share of
//!    the model BytePS's Eq. 1 and 2 give it; from the same declaration and cluster map,
//!    every worker picks the same servers.
//! 3. The [`pipeline`]'s push stage sends each partition to its server in priority order,
//!    and that server's receiver reads the sum straight back into the tensor.
//!
//! Steps 1 and 2 are pure functions of the declaration, the partition size and the servers;
//! they run once per declaration, not per iteration.

pub mod accounting;
mod average;
pub mod compression;
pub mod error;
pub mod handles;
pub mod pipeline;
mod queue;
pub mod service;
pub mod trace;

pub use compression::{Compression, CompressorKind};
pub use error::CommError;
pub use service::{CommConfig, CommunicationService, Declaration, ReduceOp};
pub use trace::{TraceConfig, TraceError, TraceFile, Tracer, Track};
