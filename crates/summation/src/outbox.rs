//! The sending side of a worker's connection, shared under one lock by the connection's
//! writer thread and by the threads that answer on it directly.
//!
//! A thread with an answer for an idle connection (nothing queued for its writer, nothing
//! half-written) writes it itself, without waiting for room in the socket's buffer
//! (`Outbox::write_now`): waking the writer for it cost a futex call and two context
//! switches per answer, one per sum and connection at every completed round (issue 22's
//! CPU per byte). What the socket does not take at once stays here as the rest of that
//! frame, and the writer, woken for it, writes it before anything else (`Outbox::finish`),
//! so frames never interleave.

use std::io::{self, IoSlice, Write};
use std::sync::Arc;

use sumflow_client::link::Link;
use sumflow_reduce::buffer::AlignedBuf;
use sumflow_wire::accounting::Counted;

/// One frame to send: its encoded head and the payload after it, if any, and the key
/// its bytes are counted under.
pub struct Frame {
    pub key: Option<u64>,
    pub head: Vec<u8>,
    pub payload: Option<Arc<AlignedBuf>>,
}

impl Frame {
    fn len(&self) -> usize {
        self.head.len() + self.payload.as_ref().map_or(0, |p| p.len())
    }

    /// The bytes from `offset` on, as at most two slices.
    fn from(&self, offset: usize) -> [&[u8]; 2] {
        let payload = self.payload.as_deref().map_or(&[][..], |p| &p[..]);
        match offset.checked_sub(self.head.len()) {
            None => [&self.head[offset..], payload],
            Some(into_payload) => [&payload[into_payload..], &[]],
        }
    }
}

/// A frame the socket took only part of.
struct Rest {
    frame: Frame,
    written: usize,
}

pub struct Outbox {
    link: Counted<Link>,
    rest: Option<Rest>,
    /// Where the next free pull slot of the worker's mailbox is looked for.
    pub cursor: u32,
    /// What sums lent in the mailbox add to the bytes sent (counted as if sent inline).
    pub lent_bytes: u64,
}

impl Outbox {
    pub fn new(link: Link) -> Outbox {
        Outbox {
            link: Counted::new(link),
            rest: None,
            cursor: 0,
            lent_bytes: 0,
        }
    }

    pub fn link(&self) -> &Link {
        self.link.get_ref()
    }

    /// Bytes sent so far, lent sums counted as if they had gone inline.
    pub fn sent(&self) -> u64 {
        self.link.counted().wrapping_add(self.lent_bytes)
    }

    /// Writes `frame` whole, waiting for room (up to the socket's write timeout): only
    /// once [`Outbox::finish`] has left no rest.
    pub fn write(&mut self, frame: &Frame) -> io::Result<()> {
        debug_assert!(self.rest.is_none(), "a frame's rest goes first");
        self.write_from(frame, 0)
    }

    /// Writes `frame` from `offset` on, head and payload in one system call where the
    /// socket takes them (so that, with Nagle's delay off, a head does not leave as a
    /// packet of its own).
    fn write_from(&mut self, frame: &Frame, mut offset: usize) -> io::Result<()> {
        while offset < frame.len() {
            let [a, b] = frame.from(offset);
            match self
                .link
                .write_vectored(&[IoSlice::new(a), IoSlice::new(b)])
            {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => offset += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes what the socket takes of `frame` now, without waiting for room; false when
    /// some of it is left for [`Outbox::finish`]. Only with no rest pending.
    pub fn write_now(&mut self, frame: Frame) -> io::Result<bool> {
        debug_assert!(self.rest.is_none(), "a frame's rest goes first");
        let [a, b] = frame.from(0);
        let written = self
            .link
            .get_ref()
            .send_now(&[IoSlice::new(a), IoSlice::new(b)])?;
        self.link.add(written as u64);
        if written == frame.len() {
            return Ok(true);
        }
        self.rest = Some(Rest { frame, written });
        Ok(false)
    }

    /// Writes the rest of a frame that [`Outbox::write_now`] left, waiting for room (up
    /// to the socket's write timeout); returns the key it is counted under and the bytes
    /// written, if there was one.
    pub fn finish(&mut self) -> io::Result<Option<(Option<u64>, u64)>> {
        let Some(Rest { frame, written }) = self.rest.take() else {
            return Ok(None);
        };
        let before = self.link.counted();
        self.write_from(&frame, written)?;
        Ok(Some((frame.key, self.link.counted() - before)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;
    use std::os::unix::net::UnixStream;

    fn payload(len: usize) -> Arc<AlignedBuf> {
        let mut buf = AlignedBuf::zeroed(len);
        for (i, b) in buf.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        Arc::new(buf)
    }

    #[test]
    fn what_the_socket_does_not_take_at_once_is_finished_first_and_whole() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut outbox = Outbox::new(Link::Local(ours));
        // Far more than a Unix socket's buffer: the peer reads nothing yet.
        let big = Frame {
            key: Some(7),
            head: b"HEAD".to_vec(),
            payload: Some(payload(8 << 20)),
        };
        assert!(!outbox.write_now(big).unwrap(), "the socket took only part");
        let taken = outbox.sent();
        assert!(taken > 0 && taken < (8 << 20) + 4);
        let reader = std::thread::spawn(move || {
            let mut all = Vec::new();
            theirs.read_to_end(&mut all).unwrap();
            all
        });
        assert_eq!(
            outbox.finish().unwrap(),
            Some((Some(7), (8 << 20) + 4 - taken))
        );
        assert_eq!(outbox.finish().unwrap(), None, "nothing left");
        let next = Frame {
            key: None,
            head: b"NE".to_vec(),
            payload: Some(Arc::new({
                let mut xt = AlignedBuf::zeroed(2);
                xt.copy_from_slice(b"XT");
                xt
            })),
        };
        outbox.write(&next).unwrap();
        assert_eq!(outbox.sent(), (8 << 20) + 8);
        drop(outbox);
        let all = reader.join().unwrap();
        assert_eq!(&all[..4], b"HEAD");
        assert_eq!(&all[4..all.len() - 4], &payload(8 << 20)[..]);
        assert_eq!(&all[all.len() - 4..], b"NEXT");
    }

    #[test]
    fn a_frame_that_fits_goes_at_once() {
        let (ours, mut theirs) = UnixStream::pair().unwrap();
        let mut outbox = Outbox::new(Link::Local(ours));
        let small = Frame {
            key: None,
            head: b"ack".to_vec(),
            payload: None,
        };
        assert!(outbox.write_now(small).unwrap());
        assert_eq!(outbox.finish().unwrap(), None);
        let mut got = [0u8; 3];
        theirs.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"ack");
    }

    #[test]
    fn a_rest_that_starts_inside_the_payload_resumes_there() {
        let frame = Frame {
            key: None,
            head: vec![1, 2],
            payload: Some(payload(10)),
        };
        assert_eq!(frame.from(1), [&[2u8][..], &payload(10)[..]]);
        assert_eq!(frame.from(5), [&payload(10)[3..], &[][..]]);
        assert_eq!(frame.len(), 12);
    }
}
