//! Errors of the wire layer and the error codes carried by `Error` frames.

use std::fmt;
use std::io;

use thiserror::Error;

use crate::frame::Op;

/// Why a frame could not be read or decoded. Every variant names what was wrong so the
/// peer's error reply, and our log line, say more than "bad frame".
#[derive(Debug, Error)]
pub enum WireError {
    #[error("bad magic {0:02x?}: the peer does not speak the sumflow protocol")]
    BadMagic([u8; 4]),
    #[error(
        "unsupported protocol version {got} (this build speaks version {supported}): every \
         machine of a job needs the same sumflow release"
    )]
    UnsupportedVersion { got: u8, supported: u8 },
    #[error("unknown op code {0:#04x}")]
    UnknownOp(u8),
    #[error("unknown header flags {0:#06x} (only 0x0001, lent, is defined)")]
    UnknownFlags(u16),
    #[error("frame body of {len} bytes exceeds the configured maximum of {max} bytes")]
    FrameTooLarge { len: u64, max: u64 },
    #[error("{op} frame truncated: needed {need} more bytes of {field}")]
    Truncated {
        op: Op,
        field: &'static str,
        need: usize,
    },
    #[error("{op} frame has {extra} unexpected trailing bytes")]
    TrailingBytes { op: Op, extra: usize },
    #[error("{op} frame: field {field} is invalid: {why}")]
    BadField {
        op: Op,
        field: &'static str,
        why: String,
    },
    #[error("expected {expected}, got a {got} frame")]
    Unexpected { expected: &'static str, got: Op },
    #[error("authentication failed: {0}")]
    AuthFailed(String),
    #[error("peer refused: {}: {}", .0.code, .0.message)]
    Rejected(crate::message::ErrorReply),
    #[error("connection closed by peer")]
    Closed,
    #[error("timed out after {secs:.1}s waiting for {what}")]
    Timeout { what: String, secs: f64 },
    #[error("i/o error: {0}")]
    Io(#[source] io::Error),
}

impl WireError {
    /// The code to put in the error reply for this failure.
    pub fn code(&self) -> ErrorCode {
        match self {
            WireError::UnsupportedVersion { .. } => ErrorCode::UnsupportedVersion,
            WireError::UnknownOp(_) => ErrorCode::UnknownOp,
            WireError::FrameTooLarge { .. } => ErrorCode::FrameTooLarge,
            WireError::Timeout { .. } => ErrorCode::Timeout,
            WireError::Unexpected { .. } => ErrorCode::UnexpectedOp,
            WireError::AuthFailed(_) => ErrorCode::AuthFailed,
            WireError::Rejected(r) => r.code,
            WireError::Io(_) | WireError::Closed => ErrorCode::Internal,
            _ => ErrorCode::BadFrame,
        }
    }

    /// Maps an I/O error, turning read timeouts and resets into their own variants.
    pub fn from_io(err: io::Error, waiting_for: impl FnOnce() -> String, secs: f64) -> WireError {
        match err.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Timeout {
                what: waiting_for(),
                secs,
            },
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => WireError::Closed,
            _ => WireError::Io(err),
        }
    }
}

impl From<io::Error> for WireError {
    fn from(err: io::Error) -> Self {
        WireError::from_io(err, || "the peer".to_string(), 0.0)
    }
}

/// The code an `Error` frame carries, so programs can react without parsing text.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u16)]
pub enum ErrorCode {
    BadFrame = 1,
    UnsupportedVersion = 2,
    UnknownOp = 3,
    FrameTooLarge = 4,
    AuthFailed = 5,
    UnexpectedOp = 6,
    BadRank = 7,
    DuplicateNode = 8,
    ClusterFull = 9,
    UnknownKey = 16,
    KeyMismatch = 17,
    RoundOutOfSequence = 18,
    DuplicatePush = 19,
    DuplicatePull = 20,
    Unsupported = 21,
    ResourceExhausted = 22,
    NodeFailed = 32,
    Timeout = 33,
    ShuttingDown = 34,
    Internal = 255,
}

impl ErrorCode {
    const ALL: [ErrorCode; 20] = [
        ErrorCode::BadFrame,
        ErrorCode::UnsupportedVersion,
        ErrorCode::UnknownOp,
        ErrorCode::FrameTooLarge,
        ErrorCode::AuthFailed,
        ErrorCode::UnexpectedOp,
        ErrorCode::BadRank,
        ErrorCode::DuplicateNode,
        ErrorCode::ClusterFull,
        ErrorCode::UnknownKey,
        ErrorCode::KeyMismatch,
        ErrorCode::RoundOutOfSequence,
        ErrorCode::DuplicatePush,
        ErrorCode::DuplicatePull,
        ErrorCode::Unsupported,
        ErrorCode::ResourceExhausted,
        ErrorCode::NodeFailed,
        ErrorCode::Timeout,
        ErrorCode::ShuttingDown,
        ErrorCode::Internal,
    ];

    /// Decodes a code; codes this build does not know become `Internal` so that a newer
    /// peer's error still reaches the user with its message intact.
    pub fn from_u16(code: u16) -> ErrorCode {
        ErrorCode::ALL
            .into_iter()
            .find(|c| *c as u16 == code)
            .unwrap_or(ErrorCode::Internal)
    }
}

impl fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
