//! Little-endian field cursors used by the message codecs.

use crate::error::WireError;
use crate::frame::Op;

/// Longest string field accepted (names, host names, reasons, error messages).
pub const MAX_STRING: usize = 4096;
/// Longest list accepted in a cluster map.
pub const MAX_NODES: usize = 1 << 16;

pub(crate) struct Dec<'a> {
    op: Op,
    buf: &'a [u8],
}

impl<'a> Dec<'a> {
    pub fn new(op: Op, buf: &'a [u8]) -> Self {
        Dec { op, buf }
    }

    pub fn bytes(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], WireError> {
        if self.buf.len() < n {
            return Err(WireError::Truncated {
                op: self.op,
                field,
                need: n - self.buf.len(),
            });
        }
        let (head, rest) = self.buf.split_at(n);
        self.buf = rest;
        Ok(head)
    }

    pub fn array<const N: usize>(&mut self, field: &'static str) -> Result<[u8; N], WireError> {
        Ok(self.bytes(N, field)?.try_into().expect("length checked"))
    }

    pub fn u8(&mut self, field: &'static str) -> Result<u8, WireError> {
        Ok(self.array::<1>(field)?[0])
    }

    pub fn u16(&mut self, field: &'static str) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.array(field)?))
    }

    pub fn u32(&mut self, field: &'static str) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.array(field)?))
    }

    pub fn u64(&mut self, field: &'static str) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.array(field)?))
    }

    /// Reserved padding must be zero so that later versions can give it meaning.
    pub fn zeros(&mut self, n: usize, field: &'static str) -> Result<(), WireError> {
        if self.bytes(n, field)?.iter().any(|b| *b != 0) {
            return Err(self.bad(field, "reserved bytes must be zero"));
        }
        Ok(())
    }

    pub fn string(&mut self, field: &'static str) -> Result<String, WireError> {
        let len = self.u16(field)? as usize;
        if len > MAX_STRING {
            return Err(self.bad(field, format!("{len} bytes exceeds {MAX_STRING}")));
        }
        let raw = self.bytes(len, field)?;
        String::from_utf8(raw.to_vec()).map_err(|_| self.bad(field, "not valid UTF-8"))
    }

    /// Bytes not yet decoded.
    pub fn remaining(&self) -> usize {
        self.buf.len()
    }

    pub fn finish(self) -> Result<(), WireError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(WireError::TrailingBytes {
                op: self.op,
                extra: self.buf.len(),
            })
        }
    }

    pub fn bad(&self, field: &'static str, why: impl Into<String>) -> WireError {
        WireError::BadField {
            op: self.op,
            field,
            why: why.into(),
        }
    }
}

#[derive(Default)]
pub(crate) struct Enc {
    pub buf: Vec<u8>,
}

impl Enc {
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.buf.extend_from_slice(v);
        self
    }
    pub fn zeros(&mut self, n: usize) -> &mut Self {
        self.buf.resize(self.buf.len() + n, 0);
        self
    }
    /// Strings longer than the protocol allows are cut at a character boundary: they are
    /// names and messages, and a shortened message beats a peer rejecting the frame.
    pub fn string(&mut self, s: &str) -> &mut Self {
        let mut end = s.len().min(MAX_STRING);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16).bytes(&s.as_bytes()[..end])
    }
}
