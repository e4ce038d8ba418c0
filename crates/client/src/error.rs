//! Errors a client call can end with. Each names the peer, and the node or timeout involved.

use sumflow_wire::{ErrorCode, NodeId, WireError};
use thiserror::Error;

#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot connect to the {service} at {addr}: {source}")]
    Connect {
        service: &'static str,
        addr: String,
        #[source]
        source: std::io::Error,
    },
    #[error("{peer}: {source}")]
    Wire {
        peer: String,
        #[source]
        source: WireError,
    },
    #[error("{peer} refused{}: {code}: {message}", key.map(|k| format!(" key {k}")).unwrap_or_default())]
    Remote {
        peer: String,
        code: ErrorCode,
        key: Option<u64>,
        message: String,
    },
    #[error("{name} ({node}) failed: {reason}")]
    NodeFailed {
        node: NodeId,
        name: String,
        reason: String,
    },
    #[error("{peer} is unreachable: {reason}")]
    PeerLost { peer: String, reason: String },
    #[error("timed out after {secs:.1}s waiting for {what}")]
    Timeout { what: String, secs: f64 },
    #[error("{peer} sent {what} where it was not expected")]
    Protocol { peer: String, what: String },
    #[error("invalid argument: {0}")]
    Invalid(String),
}

impl ClientError {
    /// A refusal the peer sent becomes `Remote`, so its code (e.g. `AuthFailed`) reaches
    /// the caller; anything else stays a wire error.
    pub fn from_wire(peer: &str, e: WireError) -> ClientError {
        match e {
            WireError::Rejected(r) => ClientError::Remote {
                peer: peer.to_string(),
                code: r.code,
                key: r.key,
                message: r.message,
            },
            source => ClientError::Wire {
                peer: peer.to_string(),
                source,
            },
        }
    }

    /// The wire error code that best describes this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            ClientError::Remote { code, .. } => *code,
            ClientError::Wire { source, .. } => source.code(),
            ClientError::NodeFailed { .. } | ClientError::PeerLost { .. } => ErrorCode::NodeFailed,
            ClientError::Timeout { .. } => ErrorCode::Timeout,
            ClientError::Protocol { .. } => ErrorCode::UnexpectedOp,
            ClientError::Connect { .. } | ClientError::Invalid(_) => ErrorCode::Internal,
        }
    }
}

pub type Result<T, E = ClientError> = std::result::Result<T, E>;
