//! The CUDA staging stage (BytePS §6.1: the copy between GPU and host memory is a pipeline
//! stage of its own), without Python.
//!
//! A CUDA gradient reaches the core through a pinned host buffer. The gradient hook, on
//! backward's thread, only records an event behind the kernels that produce the gradient
//! ([`DriverEngine::mark`]); the [`Stager`]'s thread queues the copy on a side stream
//! behind that event, waits for it (asleep, not spinning) and hands the buffer on. Neither
//! step takes Python's interpreter lock, so backward's thread, which launches the kernels,
//! never waits for it.
//!
//! - [`driver`]: the CUDA driver API, loaded at run time.
//! - [`engine`]: the copies through the driver: per device its context, side stream and
//!   reusable events.
//! - [`stager`]: the staging thread, generic over the engine (tested with a fake one).
//! - [`ticket`]: what a caller waits on for a staged copy's outcome.

pub mod driver;
pub mod engine;
pub mod stager;
pub mod ticket;

pub use driver::{Driver, DriverError};
pub use engine::{DriverEngine, Marker};
pub use stager::{CopyEngine, HostCopy, Stager};
pub use ticket::Ticket;
