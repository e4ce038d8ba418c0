//! The fixed frame header and the op codes.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "SFLW"
//! 4       1     protocol version (1)
//! 5       1     op code
//! 6       2     flags (little endian; none defined in version 1, must be 0)
//! 8       4     body length in bytes (little endian)
//! ```

use std::fmt;

use crate::error::WireError;

pub const MAGIC: [u8; 4] = *b"SFLW";
pub const VERSION: u8 = 1;
pub const HEADER_LEN: usize = 12;
/// Default cap on a frame body: a 4 MB partition plus generous room for larger keys.
pub const DEFAULT_MAX_BODY: u32 = 64 << 20;

macro_rules! ops {
    ($($name:ident = $code:literal),* $(,)?) => {
        /// Operation carried by a frame.
        #[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum Op { $($name = $code),* }

        impl Op {
            pub fn from_code(code: u8) -> Option<Op> {
                match code { $($code => Some(Op::$name),)* _ => None }
            }
        }
    };
}

ops! {
    Challenge = 0x01,
    Hello = 0x02,
    Welcome = 0x03,
    Register = 0x04,
    ClusterMap = 0x05,
    Declare = 0x06,
    Declared = 0x07,
    // Retiring tensors that will never be used again: worker -> coordinator (the name)
    // and worker -> server (each key). Listed here, apart from their neighbours by code.
    Undeclare = 0x08,
    Retire = 0x18,
    // A round a worker waits on has waited long: server -> worker (the stall inspector).
    Stalled = 0x19,
    InitKey = 0x10,
    InitAck = 0x11,
    Push = 0x12,
    Pull = 0x13,
    PullReply = 0x14,
    PushAck = 0x15,
    Join = 0x16,
    JoinAck = 0x17,
    Barrier = 0x20,
    BarrierDone = 0x21,
    Heartbeat = 0x22,
    HeartbeatAck = 0x23,
    NodeFailed = 0x24,
    Shutdown = 0x30,
    Error = 0x3f,
}

impl Op {
    /// Ops whose body ends in a bulk payload that readers stream into their own buffers.
    pub fn has_payload(self) -> bool {
        matches!(self, Op::InitKey | Op::Push | Op::PullReply)
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A decoded and validated frame header.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Header {
    pub op: Op,
    pub body_len: u32,
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.op as u8;
        out[8..12].copy_from_slice(&self.body_len.to_le_bytes());
        out
    }

    /// Validates magic, version, op, flags and the body length against `max_body`.
    pub fn decode(bytes: &[u8; HEADER_LEN], max_body: u32) -> Result<Header, WireError> {
        let magic: [u8; 4] = bytes[..4].try_into().expect("4 bytes");
        if magic != MAGIC {
            return Err(WireError::BadMagic(magic));
        }
        if bytes[4] != VERSION {
            return Err(WireError::UnsupportedVersion {
                got: bytes[4],
                supported: VERSION,
            });
        }
        let op = Op::from_code(bytes[5]).ok_or(WireError::UnknownOp(bytes[5]))?;
        let flags = u16::from_le_bytes([bytes[6], bytes[7]]);
        if flags != 0 {
            return Err(WireError::UnknownFlags(flags));
        }
        let body_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if body_len > max_body {
            return Err(WireError::FrameTooLarge {
                len: body_len.into(),
                max: max_body.into(),
            });
        }
        Ok(Header { op, body_len })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_round_trip() {
        let h = Header {
            op: Op::Push,
            body_len: 1234,
        };
        assert_eq!(Header::decode(&h.encode(), 4096).unwrap(), h);
    }

    #[test]
    fn header_rejections_name_the_problem() {
        let good = Header {
            op: Op::Pull,
            body_len: 16,
        }
        .encode();
        let mut b = good;
        b[0] = b'X';
        assert!(matches!(
            Header::decode(&b, 64),
            Err(WireError::BadMagic(_))
        ));
        let mut b = good;
        b[4] = 9;
        let e = Header::decode(&b, 64).unwrap_err();
        assert!(e.to_string().contains("version 9"), "{e}");
        let mut b = good;
        b[5] = 0x7e;
        assert!(matches!(
            Header::decode(&b, 64),
            Err(WireError::UnknownOp(0x7e))
        ));
        let mut b = good;
        b[6] = 1;
        assert!(matches!(
            Header::decode(&b, 64),
            Err(WireError::UnknownFlags(1))
        ));
        let e = Header::decode(&good, 8).unwrap_err();
        assert!(matches!(e, WireError::FrameTooLarge { len: 16, max: 8 }));
    }
}
