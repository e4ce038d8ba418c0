//! Page-aligned, zero-initialised byte buffers for accumulators, results and
//! receive buffers.
//!
//! Page alignment keeps every SIMD load of a key's data inside one page. Zeroing is
//! not free: for an alignment above malloc's, `alloc_zeroed` is an aligned allocation
//! plus a memset (not calloc), which also faults in every page at once. Buffers are
//! therefore allocated once and reused (see [`AlignedBuf::reuse_for`]), not per round.

use std::alloc::{self, Layout};
use std::fmt;
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

/// Alignment, and capacity granularity, of every [`AlignedBuf`].
pub const PAGE: usize = 4096;

/// Only its alignment matters: a dangling pointer to it is a page-aligned
/// non-null address for buffers that own no memory.
#[repr(align(4096))]
struct Page;

const _: () = assert!(align_of::<Page>() == PAGE);

/// A heap byte buffer whose first byte is page aligned and whose bytes are always
/// initialised (zero unless written).
pub struct AlignedBuf {
    ptr: NonNull<u8>,
    len: usize,
    /// Bytes owned at `ptr`; 0 means nothing was allocated.
    cap: usize,
}

// SAFETY: AlignedBuf uniquely owns its allocation, like Vec<u8>; no interior
// mutability, so moving it across threads or sharing &AlignedBuf is sound.
unsafe impl Send for AlignedBuf {}
// SAFETY: see Send; shared access only hands out &[u8].
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// A buffer of `len` zero bytes. `len == 0` allocates nothing.
    pub fn zeroed(len: usize) -> AlignedBuf {
        if len == 0 {
            return AlignedBuf {
                ptr: NonNull::<Page>::dangling().cast(),
                len: 0,
                cap: 0,
            };
        }
        let layout = layout_for(len);
        // SAFETY: layout has a non-zero size (len > 0, rounded up to PAGE).
        let raw = unsafe { alloc::alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            alloc::handle_alloc_error(layout)
        };
        AlignedBuf {
            ptr,
            len,
            cap: layout.size(),
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn capacity(&self) -> usize {
        self.cap
    }

    /// Readies the buffer to be overwritten with `len` bytes. The allocation is reused
    /// when its capacity suffices; otherwise it is replaced by a fresh one of `len`
    /// bytes, and the old bytes are not copied over: callers (receive buffers) overwrite
    /// every byte anyway, so copying them would only fault in pages for nothing. Either
    /// way the contents are unspecified afterwards (but initialised).
    pub fn reuse_for(&mut self, len: usize) {
        if len > self.cap {
            // Freed before allocating, so peak memory is one buffer, not two.
            drop(std::mem::take(self));
            *self = AlignedBuf::zeroed(len);
        }
        self.len = len;
    }
}

/// Capacity is rounded up to whole pages: the allocator hands out page-aligned
/// blocks in whole pages anyway, and the slack makes small regrowth free.
fn layout_for(len: usize) -> Layout {
    len.checked_next_multiple_of(PAGE)
        .and_then(|cap| Layout::from_size_align(cap, PAGE).ok())
        .unwrap_or_else(|| panic!("AlignedBuf: {len} bytes is too large to allocate"))
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.cap != 0 {
            // SAFETY: a non-zero cap means ptr came from alloc_zeroed with exactly
            // this layout (layout_for is deterministic in cap, which is a PAGE
            // multiple, so layout_for(cap) has size cap).
            unsafe { alloc::dealloc(self.ptr.as_ptr(), layout_for(self.cap)) }
        }
    }
}

impl Deref for AlignedBuf {
    type Target = [u8];

    fn deref(&self) -> &[u8] {
        // SAFETY: ptr is non-null and page aligned; when cap > 0 it owns cap >= len
        // bytes, all initialised (zeroed at allocation, only ever overwritten);
        // when len == 0 a dangling aligned pointer is valid for an empty slice.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl DerefMut for AlignedBuf {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as in deref; &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AlignedBuf")
            .field("len", &self.len)
            .field("capacity", &self.cap)
            .finish()
    }
}

impl Default for AlignedBuf {
    fn default() -> Self {
        AlignedBuf::zeroed(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pointer_is_page_aligned() {
        for len in [1, 7, 4095, 4096, 4097, 1 << 20] {
            let b = AlignedBuf::zeroed(len);
            assert_eq!(b.as_ptr() as usize % PAGE, 0, "len {len}");
            assert_eq!(b.len(), len);
            assert!(b.capacity() >= len);
        }
    }

    #[test]
    fn contents_start_zeroed() {
        let b = AlignedBuf::zeroed(3 * PAGE + 5);
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn zero_length_allocates_nothing() {
        let mut b = AlignedBuf::zeroed(0);
        assert!(b.is_empty());
        assert_eq!(b.capacity(), 0);
        assert_eq!(*b, [0u8; 0]);
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        b.reuse_for(0);
        assert!(b.is_empty());
        assert_eq!(b.capacity(), 0);
        b.reuse_for(10);
        assert_eq!(b.len(), 10);
    }

    #[test]
    fn reuse_within_capacity_keeps_the_allocation() {
        let mut b = AlignedBuf::zeroed(3 * PAGE);
        let (ptr, cap) = (b.as_ptr(), b.capacity());
        for len in [10, 3 * PAGE, 1, 2 * PAGE + 7, 0, cap] {
            b.reuse_for(len);
            assert_eq!((b.len(), b.capacity(), b.as_ptr()), (len, cap, ptr));
        }
    }

    #[test]
    fn reuse_beyond_capacity_reallocates_once() {
        let mut b = AlignedBuf::zeroed(100);
        b.reuse_for(5 * PAGE);
        assert_eq!(b.len(), 5 * PAGE);
        assert!(b.capacity() >= 5 * PAGE);
        assert_eq!(b.as_ptr() as usize % PAGE, 0);
        let ptr = b.as_ptr();
        b.reuse_for(PAGE);
        b.reuse_for(5 * PAGE);
        assert_eq!(b.as_ptr(), ptr, "once sized, it never reallocates");
    }

    #[test]
    fn debug_shows_sizes_only() {
        let b = AlignedBuf::zeroed(5);
        assert_eq!(format!("{b:?}"), "AlignedBuf { len: 5, capacity: 4096 }");
    }
}
