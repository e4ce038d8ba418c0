//! The communication service: runs inside each training process and moves its gradients
//! through the job's summation servers. This crate is the threads and sockets; what to
//! send where and when is decided by `sumflow-plan`, whose pure decisions it carries out.
//!
//! A tensor is declared once by name ([`CommunicationService::declare_one`],
//! [`CommunicationService::declare_groups`]): the coordinator gives it an id, and
//! `sumflow_plan::layout` cuts it into partitions, places each on a summation server and
//! cuts those for CPU servers into one piece per connection ("lane"). Each push_pull of it
//! then runs through the pipeline:
//!
//! 1. every partition becomes ready at the scheduler (`sumflow_plan::scheduler`), which
//!    decides when each goes out: priority order, credit, push window, Prophet's blocks;
//! 2. one push thread per lane sends what started, in the order it started, compressing
//!    it first when its tensor is compressed ([`Compression`]);
//! 3. one receiver thread per lane reads each sum straight into the caller's tensor
//!    (dividing it there for [`ReduceOp::Average`]), and the operation's handle completes
//!    once every partition's has.
//!
//! Errors name the tensor, the server and the timeout ([`CommError`]); the bytes on the
//! wire are counted per key ([`CommunicationService::wire_bytes`]); a Chrome trace of a
//! window of steps records what each partition went through ([`trace`]).

mod accounting;
mod average;
mod compression;
mod error;
mod failures;
mod handles;
mod local;
mod pipeline;
mod queue;
mod service;
pub mod trace;

pub use accounting::{KeyBytes, WireBytes};
pub use compression::{Compression, CompressorKind};
pub use error::CommError;
pub use service::{CommConfig, CommunicationService, Declaration, Exchange, ReduceOp, Scheduling};
