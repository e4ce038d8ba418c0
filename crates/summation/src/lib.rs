//! The summation service (BytePS §5): sums pushed gradient partitions and returns each
//! round's sum to every worker that pulls it. It never runs an optimizer.
//!
//! Layout: `connection` validates and dispatches each worker's frames; `engine` threads
//! own disjoint sets of keys ([`directory`]) and run the [`rounds`] protocol and the SIMD
//! kernels of `sumflow-reduce` over its page-aligned buffers; the two speak only through the
//! `messages` they exchange (commands to engines, replies to connections), over the
//! `channel`s that put an idle thread to sleep at once; [`accounting`] counts the bytes on
//! the wire per key; [`service`] starts and stops it all.

pub mod accounting;
mod channel;
pub mod cli;
mod connection;
pub mod deltas;
pub mod directory;
pub mod elastic;
mod engine;
mod messages;
mod metrics;
mod outbox;
mod pool;
pub mod rounds;
pub mod service;
mod shared;

pub use accounting::WireTraffic;
pub use service::{
    CoordinatorLink, Membership, ServerConfig, ServerError, ServerHandle, SummationService,
};
pub use shared::{Settings, MAX_CONNECTIONS_PER_WORKER};
pub use sumflow_reduce::{Reducer, SimdLevel};
