//! Wire accounting's building blocks, shared by workers and servers: a stream wrapper
//! that counts the bytes through it, and a pair of counts. Counting at the stream sees
//! frames whole (headers, acknowledgements, payloads), so what is reported is what
//! crossed the wire, not what tensor sizes suggest.

use std::io::{Read, Write};

/// Bytes one way and the other.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WireBytes {
    pub sent: u64,
    pub received: u64,
}

/// A stream that counts the bytes read from and written to it.
#[derive(Debug)]
pub struct Counted<S> {
    inner: S,
    bytes: u64,
}

impl<S> Counted<S> {
    pub fn new(inner: S) -> Counted<S> {
        Counted { inner, bytes: 0 }
    }

    /// A count that starts at `bytes` already moved through `inner`.
    pub fn starting_at(inner: S, bytes: u64) -> Counted<S> {
        Counted { inner, bytes }
    }

    /// Bytes through the stream so far (reads and writes: use one direction per wrapper).
    pub fn counted(&self) -> u64 {
        self.bytes
    }

    /// Counts `bytes` moved through the inner stream by other means (a non-blocking send).
    pub fn add(&mut self, bytes: u64) {
        self.bytes += bytes;
    }

    pub fn get_ref(&self) -> &S {
        &self.inner
    }

    pub fn get_mut(&mut self) -> &mut S {
        &mut self.inner
    }
}

impl<S: Read> Read for Counted<S> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }
}

impl<S: Write> Write for Counted<S> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        let n = self.inner.write(buf)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        let n = self.inner.write_vectored(bufs)?;
        self.bytes += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_what_goes_through_each_way() {
        let mut out = Counted::new(Vec::new());
        out.write_all(b"hello").unwrap();
        out.write_all(b", world").unwrap();
        assert_eq!(out.counted(), 12);
        let mut input = Counted::new(&b"abcdef"[..]);
        let mut buf = [0u8; 4];
        input.read_exact(&mut buf).unwrap();
        assert_eq!(input.counted(), 4);
    }
}
