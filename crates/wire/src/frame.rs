//! The fixed frame header and the op codes.
//!
//! ```text
//! offset  size  field
//! 0       4     magic "SFLW"
//! 4       1     protocol version (1)
//! 5       1     op code
//! 6       2     flags (little endian): 0x0001 lent, every other bit must be 0
//! 8       4     body length in bytes (little endian)
//! ```
//!
//! A *lent* frame (`Push` or `PullReply` only) carries its payload outside the stream: in
//! a slot of the connection's mailbox, memory the worker shares with a summation server
//! on its own machine. Its body is the meta block and an 8-byte [`Lent`] locator (slot,
//! length) where the payload would be.

use std::fmt;

use crate::error::WireError;

pub const MAGIC: [u8; 4] = *b"SFLW";
pub const VERSION: u8 = 3;
pub const HEADER_LEN: usize = 12;
/// Default cap on a frame body: a 4 MB partition plus generous room for larger keys.
pub const DEFAULT_MAX_BODY: u32 = 64 << 20;
/// The header flag of a lent frame.
pub const FLAG_LENT: u16 = 0x0001;
/// Length of a lent frame's locator, in place of its payload.
pub const LENT_LEN: usize = 8;

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
    // Shared memory between a worker and a server on its machine: worker -> server (with
    // the memory's file descriptor), and the server's answer.
    Mailbox = 0x1a,
    MailboxAck = 0x1b,
    // Members of the pusher's machine that skip the round: worker -> server, after the
    // push that carries their machine's sum.
    Skips = 0x1c,
    Shutdown = 0x30,
    Error = 0x3f,
}

impl Op {
    /// Ops whose body ends in a bulk payload that readers stream into their own buffers.
    pub fn has_payload(self) -> bool {
        matches!(self, Op::InitKey | Op::Push | Op::PullReply)
    }

    /// Ops whose payload may be lent (left in the connection's mailbox).
    pub fn may_lend(self) -> bool {
        matches!(self, Op::Push | Op::PullReply)
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
    /// The payload is lent: a [`Lent`] locator ends the body instead.
    pub lent: bool,
}

/// Where a lent frame's payload lies: `len` bytes at the start of mailbox slot `slot`
/// (a push slot for a `Push`, a pull slot for a `PullReply`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lent {
    pub slot: u32,
    pub len: u32,
}

impl Lent {
    pub fn encode(&self) -> [u8; LENT_LEN] {
        let mut out = [0u8; LENT_LEN];
        out[..4].copy_from_slice(&self.slot.to_le_bytes());
        out[4..].copy_from_slice(&self.len.to_le_bytes());
        out
    }

    /// How many bytes more the frame would have had with its payload inline: what byte
    /// counts add for a lent frame, so that they do not depend on where payloads went
    /// (wrapping: a short payload makes it negative, and counters add it wrapping).
    pub fn inline_surplus(&self) -> u64 {
        u64::from(self.len).wrapping_sub(LENT_LEN as u64)
    }

    /// Decodes a locator; a lent payload is never empty.
    pub fn decode(op: Op, bytes: &[u8; LENT_LEN]) -> Result<Lent, WireError> {
        let lent = Lent {
            slot: u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")),
            len: u32::from_le_bytes(bytes[4..].try_into().expect("4 bytes")),
        };
        if lent.len == 0 {
            return Err(WireError::BadField {
                op,
                field: "lent",
                why: "a lent payload of 0 bytes".into(),
            });
        }
        Ok(lent)
    }
}

impl Header {
    pub fn encode(&self) -> [u8; HEADER_LEN] {
        let mut out = [0u8; HEADER_LEN];
        out[..4].copy_from_slice(&MAGIC);
        out[4] = VERSION;
        out[5] = self.op as u8;
        if self.lent {
            out[6..8].copy_from_slice(&FLAG_LENT.to_le_bytes());
        }
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
        if flags & !FLAG_LENT != 0 {
            return Err(WireError::UnknownFlags(flags));
        }
        let lent = flags & FLAG_LENT != 0;
        let body_len = u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes"));
        if lent && !op.may_lend() {
            return Err(WireError::BadField {
                op,
                field: "flags",
                why: "only Push and PullReply frames may lend their payload".into(),
            });
        }
        if lent && body_len as usize != crate::message::DATA_META_LEN + LENT_LEN {
            return Err(WireError::BadField {
                op,
                field: "lent",
                why: format!(
                    "a lent frame's body is its meta block and locator ({} bytes), not \
                     {body_len}",
                    crate::message::DATA_META_LEN + LENT_LEN
                ),
            });
        }
        if body_len > max_body {
            return Err(WireError::FrameTooLarge {
                len: body_len.into(),
                max: max_body.into(),
            });
        }
        Ok(Header { op, body_len, lent })
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
            lent: false,
        };
        assert_eq!(Header::decode(&h.encode(), 4096).unwrap(), h);
        let lent = Header {
            op: Op::PullReply,
            body_len: (crate::message::DATA_META_LEN + LENT_LEN) as u32,
            lent: true,
        };
        assert_eq!(Header::decode(&lent.encode(), 4096).unwrap(), lent);
    }

    #[test]
    fn header_rejections_name_the_problem() {
        let good = Header {
            op: Op::Pull,
            body_len: 16,
            lent: false,
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
        b[6] = 2;
        assert!(matches!(
            Header::decode(&b, 64),
            Err(WireError::UnknownFlags(2))
        ));
        let mut b = good;
        b[6] = 1;
        let e = Header::decode(&b, 64).unwrap_err();
        assert!(e.to_string().contains("only Push and PullReply"), "{e}");
        let mut b = Header {
            op: Op::Push,
            body_len: 40,
            lent: true,
        }
        .encode();
        let e = Header::decode(&b, 64).unwrap_err();
        assert!(e.to_string().contains("not 40"), "{e}");
        b[6] = 0;
        assert!(Header::decode(&b, 64).is_ok(), "the same frame, not lent");
        let e = Lent::decode(Op::Push, &[0; LENT_LEN]).unwrap_err();
        assert!(e.to_string().contains("0 bytes"), "{e}");
        let e = Header::decode(&good, 8).unwrap_err();
        assert!(matches!(e, WireError::FrameTooLarge { len: 16, max: 8 }));
    }
}
