//! sumflow's wire protocol: length-framed binary messages over TCP (docs/protocol.md).
//!
//! This crate owns the byte layout and the stateless validation of every frame, the job
//! token handshake, and a framed reader/writer over any byte stream. Stateful checks (is
//! the key initialised, is the round in sequence) belong to the services.

pub mod accounting;
pub mod auth;
pub mod cluster;
mod codec;
pub mod compression;
pub mod dtype;
pub mod error;
pub mod frame;
pub mod gate;
pub mod io;
#[cfg(feature = "cli")]
pub mod logging;
pub mod message;
pub mod metrics;
#[cfg(feature = "cli")]
pub mod program;
pub mod timing;

pub use auth::JobToken;
pub use cluster::{ClusterMap, NodeId, NodeInfo, Role};
pub use codec::MAX_STRING;
pub use compression::{Codec, CodecMismatch, KeyCodec};
pub use dtype::Dtype;
pub use error::{ErrorCode, WireError};
pub use frame::{Lent, Op, DEFAULT_MAX_BODY};
pub use io::{FrameReader, PayloadRead, Peer};
pub use message::{
    BarrierGroup, ErrorReply, KeyInit, Message, PushMode, ReduceOp, Registration, Service,
};

#[cfg(test)]
mod tests;
