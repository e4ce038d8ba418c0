//! Errors of the communication service. Each names the tensor, key, server or timeout.

use std::io;
use std::sync::Arc;

use sumflow_client::ClientError;
use sumflow_plan::layout::LayoutError;
use sumflow_wire::ErrorCode;
use thiserror::Error;

use crate::trace::TraceError;

#[derive(Clone, Debug, Error)]
pub enum CommError {
    /// A server, the coordinator or the network failed the operation.
    #[error("tensor '{tensor}': {message}")]
    Failed {
        tensor: String,
        code: ErrorCode,
        message: String,
    },
    #[error(
        "tensor '{tensor}': timed out after {secs:.1}s waiting for {outstanding} of {parts} \
         partitions (servers {servers}); a peer may be stuck or the job misconfigured"
    )]
    Timeout {
        tensor: String,
        secs: f64,
        outstanding: usize,
        parts: usize,
        servers: String,
    },
    #[error("tensor '{0}' already has a push_pull in flight; wait for it before the next")]
    Busy(String),
    #[error("unknown handle {0}: never issued, or already waited for")]
    UnknownHandle(u64),
    #[error("invalid argument: {0}")]
    Invalid(String),
    /// A declaration that cannot be cut, placed or cut into pieces per lane.
    #[error("invalid argument: {0}")]
    Layout(#[from] LayoutError),
    /// The operating system refused what the service needs: a directory, a file, a thread.
    #[error("{what}: {source}")]
    Io {
        /// What could not be done, naming the path or thread.
        what: String,
        /// Shared, so that every poll of a failed operation gets the error.
        source: Arc<io::Error>,
    },
    #[error("the communication service is shut down")]
    Shutdown,
    #[error("{0}")]
    Client(String, ErrorCode),
}

impl CommError {
    pub fn code(&self) -> ErrorCode {
        match self {
            CommError::Failed { code, .. } | CommError::Client(_, code) => *code,
            CommError::Timeout { .. } => ErrorCode::Timeout,
            CommError::Busy(_)
            | CommError::Invalid(_)
            | CommError::Layout(_)
            | CommError::UnknownHandle(_)
            | CommError::Io { .. } => ErrorCode::Internal,
            CommError::Shutdown => ErrorCode::ShuttingDown,
        }
    }

    /// Attaches a tensor's name to a client error.
    pub fn on_tensor(tensor: &str, e: &ClientError) -> CommError {
        CommError::Failed {
            tensor: tensor.to_string(),
            code: e.code(),
            message: e.to_string(),
        }
    }
}

impl From<TraceError> for CommError {
    fn from(e: TraceError) -> Self {
        match e {
            TraceError::Invalid(_) => CommError::Invalid(e.to_string()),
            TraceError::Directory { path, source } => CommError::Io {
                what: format!("cannot create the trace directory {}", path.display()),
                source: Arc::new(source),
            },
            TraceError::Write { path, source } => CommError::Io {
                what: format!("cannot write the trace {}", path.display()),
                source: Arc::new(source),
            },
        }
    }
}

impl From<ClientError> for CommError {
    fn from(e: ClientError) -> Self {
        CommError::Client(e.to_string(), e.code())
    }
}
