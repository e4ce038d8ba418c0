//! Receive buffers of one connection: a fixed number, so a fast worker meets back-pressure.
//!
//! A connection's reader takes a buffer before reading a push payload; the engine drops it
//! once summed, which sends it home. With every buffer in flight the reader stops reading,
//! and TCP flow control stalls the worker: server memory stays bounded whatever a worker
//! sends.
//!
//! Buffers are sized on demand and never shrink: a buffer smaller than the largest key its
//! worker has declared grows to that size when next taken (not step by step through the
//! sizes it meets), and swaps with key buffers only ever hand it one at least as large. So
//! once a worker has declared its keys and each buffer has been taken once more, receiving
//! its pushes allocates nothing and faults in no fresh pages.

use std::ops::{Deref, DerefMut};
use std::time::Duration;

use crate::channel::{bounded, Receiver, RecvTimeoutError, Sender};

use sumflow_reduce::buffer::AlignedBuf;

pub struct BufferPool {
    home: Sender<AlignedBuf>,
    free: Receiver<AlignedBuf>,
    /// The largest payload expected: the size a buffer that must grow grows to.
    largest: usize,
}

impl BufferPool {
    pub fn new(depth: usize) -> Self {
        assert!(depth > 0, "a pool needs at least one buffer");
        let (home, free) = bounded(depth);
        for _ in 0..depth {
            home.send(AlignedBuf::zeroed(0)).expect("pool has room");
        }
        BufferPool {
            home,
            free,
            largest: 0,
        }
    }

    /// Notes that pushes of `len` bytes may come (a key was declared), so that a buffer
    /// grows once to the largest size rather than once per larger size it meets.
    pub fn note_key(&mut self, len: usize) {
        self.largest = self.largest.max(len);
    }

    /// Takes a buffer of `len` bytes, waiting while all are in flight. Gives up (returns
    /// `None`) when `keep_waiting` says so, checked every `poll`.
    pub fn take(
        &self,
        len: usize,
        poll: Duration,
        keep_waiting: impl Fn() -> bool,
    ) -> Option<PooledBuf> {
        loop {
            match self.free.recv_timeout(poll) {
                Ok(mut buf) => {
                    // Grown to the largest expected push at once, whatever this push's
                    // size, so that each buffer is reallocated once after the keys are
                    // declared, not whenever a large push first happens to land in it.
                    let want = self.largest.max(len);
                    if buf.capacity() < want {
                        buf.reuse_for(want);
                    }
                    buf.reuse_for(len);
                    return Some(PooledBuf {
                        buf: Some(buf),
                        home: self.home.clone(),
                    });
                }
                Err(RecvTimeoutError::Timeout) if keep_waiting() => continue,
                Err(_) => return None,
            }
        }
    }
}

/// A pool buffer on loan; dropping it returns it, on every path, so none can leak.
pub struct PooledBuf {
    buf: Option<AlignedBuf>,
    home: Sender<AlignedBuf>,
}

impl PooledBuf {
    /// Exchanges contents with `other` (of equal length) without copying, when that keeps
    /// the pool's buffer at least as large: the received push becomes the key's buffer,
    /// and the key's old buffer goes back to the pool. Returns false, changing nothing,
    /// when `other`'s allocation is smaller; the caller copies instead. (Trading a large
    /// pool buffer for a small key buffer would make the pool regrow it, zeroed, for the
    /// next large push: a copy is much cheaper than fresh pages.)
    #[must_use]
    pub fn try_swap_with(&mut self, other: &mut AlignedBuf) -> bool {
        let mine = self.buf.as_mut().expect("present until drop");
        assert_eq!(
            mine.len(),
            other.len(),
            "swapped buffers must be equally long"
        );
        if other.capacity() < mine.capacity() {
            return false;
        }
        std::mem::swap(mine, other);
        true
    }
}

impl Deref for PooledBuf {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        self.buf.as_ref().expect("present until drop")
    }
}

impl DerefMut for PooledBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        self.buf.as_mut().expect("present until drop")
    }
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        if let Some(buf) = self.buf.take() {
            // The pool is gone when its connection closed; the buffer is then just freed.
            let _ = self.home.try_send(buf);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sumflow_reduce::buffer::PAGE;

    #[test]
    fn buffers_come_home_when_dropped() {
        let pool = BufferPool::new(2);
        let a = pool.take(10, Duration::from_millis(1), || false).unwrap();
        let b = pool.take(20, Duration::from_millis(1), || false).unwrap();
        assert_eq!((a.len(), b.len()), (10, 20));
        assert!(pool.take(1, Duration::from_millis(5), || false).is_none());
        drop(a);
        let c = pool.take(30, Duration::from_millis(1), || false).unwrap();
        assert_eq!(c.len(), 30);
    }

    #[test]
    fn a_growing_buffer_grows_to_the_largest_expected_push_at_once() {
        let mut pool = BufferPool::new(1);
        pool.note_key(3 * PAGE);
        pool.note_key(PAGE);
        let small = pool.take(10, Duration::from_millis(1), || false).unwrap();
        assert_eq!(small.len(), 10);
        let ptr = small.as_ptr();
        drop(small);
        let b = pool
            .take(3 * PAGE, Duration::from_millis(1), || false)
            .unwrap();
        assert_eq!((b.len(), b.as_ptr()), (3 * PAGE, ptr), "no second growth");
        drop(b);
        // A key declared later: a buffer grows to it when next taken, even for a small push.
        pool.note_key(5 * PAGE);
        let b = pool.take(10, Duration::from_millis(1), || false).unwrap();
        let grown = b.as_ptr();
        drop(b);
        let b = pool.take(5 * PAGE, Duration::from_millis(1), || false);
        assert_eq!(
            b.unwrap().as_ptr(),
            grown,
            "already sized for the largest key"
        );
    }

    #[test]
    fn swapping_hands_the_pool_the_other_buffer() {
        let pool = BufferPool::new(1);
        let mut received = pool.take(8, Duration::from_millis(1), || false).unwrap();
        received.copy_from_slice(&[7; 8]);
        let mut kept = AlignedBuf::zeroed(8);
        kept.copy_from_slice(&[1; 8]);
        assert!(received.try_swap_with(&mut kept));
        assert_eq!(&kept[..], &[7; 8]);
        drop(received);
        let back = pool.take(8, Duration::from_millis(1), || false).unwrap();
        assert_eq!(&back[..], &[1; 8], "the pool got the key's old buffer");
    }

    #[test]
    fn a_smaller_key_buffer_is_not_swapped_in() {
        let pool = BufferPool::new(1);
        drop(
            pool.take(4 * PAGE, Duration::from_millis(1), || false)
                .unwrap(),
        );
        let mut received = pool.take(8, Duration::from_millis(1), || false).unwrap();
        received.copy_from_slice(&[7; 8]);
        let mut small = AlignedBuf::zeroed(8);
        assert!(!received.try_swap_with(&mut small));
        assert_eq!((&received[..], &small[..]), (&[7u8; 8][..], &[0u8; 8][..]));
    }

    #[test]
    fn buffers_reused_across_sizes_never_reallocate_once_sized() {
        let pool = BufferPool::new(1);
        let first = pool
            .take(3 * PAGE, Duration::from_millis(1), || false)
            .unwrap();
        let ptr = first.as_ptr();
        drop(first);
        for (i, len) in [1, 3 * PAGE, 2 * PAGE + 5, 100, 3 * PAGE - 1]
            .into_iter()
            .enumerate()
        {
            let mut b = pool.take(len, Duration::from_millis(1), || false).unwrap();
            assert_eq!((b.len(), b.as_ptr()), (len, ptr), "take {i}");
            let pattern: Vec<u8> = (0..len).map(|j| (i + j) as u8).collect();
            b.copy_from_slice(&pattern);
            assert_eq!(&b[..], &pattern[..], "exact contents at {len} bytes");
        }
    }
}
