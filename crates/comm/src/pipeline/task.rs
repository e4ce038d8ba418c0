//! What travels through the pipeline for each partition of a push_pull: the span of the
//! caller's tensor it reads and overwrites, and how it is encoded on the wire.

use std::ptr::NonNull;
use std::sync::Arc;

use sumflow_compress::{Compressor, Scratch, Seed};
use sumflow_plan::partition::Partition;
use sumflow_wire::{Dtype, KeyCodec, ReduceOp};

/// A span of the caller's tensor memory.
///
/// The push stage reads it and its lane's receiver later overwrites it with the result.
#[derive(Clone, Copy, Debug)]
pub struct HostSlice {
    ptr: NonNull<u8>,
    pub(crate) len: usize,
}

// SAFETY: a HostSlice is only created by `HostSlice::new`, whose caller promises the memory
// stays valid and untouched by others until the operation has been waited for; the stages
// touch it only between `Handles::begin_access` and `end_access`, which `wait` outlasts,
// and each slice from one thread at a time (push, then receive, ordered by the reply).
unsafe impl Send for HostSlice {}

impl HostSlice {
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and neither freed nor accessed by
    /// anyone else until `Handles::wait` on the operation using it has returned something
    /// other than a timeout.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Option<HostSlice> {
        NonNull::new(ptr).map(|ptr| HostSlice { ptr, len })
    }

    /// The sub-span `offset..offset+len`.
    pub fn sub(&self, offset: usize, len: usize) -> HostSlice {
        assert!(offset + len <= self.len, "sub-span out of range");
        // SAFETY: in bounds of the span the caller vouched for, which is not null.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) };
        HostSlice { ptr, len }
    }

    pub(crate) fn bytes(&self) -> &[u8] {
        // SAFETY: see `new`; only the push stage reads, before the reply exists.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    #[allow(clippy::mut_from_ref)]
    pub(crate) fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: see `new`; only the receiver of this span's lane writes, once its sum
        // arrived: the server answers the Pull that the lane's push thread sends after the
        // whole push, on the same connection, so that thread has stopped reading the span
        // by then.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// One partition of one push_pull.
#[derive(Debug)]
pub struct PartTask {
    pub handle: u64,
    pub partition: Partition,
    pub round: u64,
    pub dtype: Dtype,
    /// The partition's span of the caller's tensor.
    pub data: HostSlice,
    /// How its push and sum are encoded on the wire.
    pub codec: KeyCodec,
    /// The workers whose pushes its key sums (raw keys only), ascending; `None`: every
    /// worker. Sent with the key's `InitKey`.
    pub members: Option<Arc<[u32]>>,
    /// Divide the sum by this (Average).
    pub divisor: Option<u32>,
    /// How the servers combine the round's pushes.
    pub op: ReduceOp,
    /// Whether this worker contributes the partition's bytes; false: it takes part in the
    /// round with an empty push (a skip).
    pub pushes: bool,
    /// Whether this worker takes the round's result back into the partition; false: it
    /// awaits only the notice that the round is complete, and the span is left alone.
    pub wants_sum: bool,
    /// The other members of this worker's machine whose part in the round its push
    /// carries (`Message::Skips`), ascending; `None`: only its own.
    pub skips: Option<Arc<[u32]>>,
    /// The tensor's name and the partition's index in it, for the trace.
    pub name: Arc<str>,
    pub index: u32,
    /// An asynchronous delta rather than a round's contribution (`push_delta`).
    pub delta: Option<Delta>,
}

/// A partition's asynchronous delta (BytePS §4.3): added to the servers' stored value,
/// whose latest value then comes back into the partition.
#[derive(Clone, Copy, Debug)]
pub struct Delta {
    /// How many rounds the worker may run ahead of the slowest (`None`: unbounded).
    pub staleness: Option<u32>,
    /// The partition's span of the value the servers start from, read by the key's first
    /// push only.
    pub initial: HostSlice,
}

impl PartTask {
    pub(super) fn key(&self) -> u64 {
        self.partition.key
    }

    pub(super) fn server(&self) -> usize {
        self.partition.server as usize
    }

    /// Bytes of its push on the wire, what the scheduler's credit counts.
    pub(super) fn wire_len(&self) -> u64 {
        if !self.pushes {
            return 0;
        }
        let elements = (self.data.len / self.dtype.size()) as u64;
        self.codec.payload_len(self.dtype, elements)
    }

    /// Its compressor, for a compressed partition.
    pub(super) fn compressor(&self) -> Option<Compressor> {
        (!self.codec.is_raw()).then(|| {
            Compressor::new(self.codec, self.data.len / 4)
                .expect("the service declares codecs that fit their keys")
        })
    }

    /// Where random-k's indices and dithering's rounding come from: this worker's stream
    /// of the key's round.
    pub(super) fn seed(&self, rank: u32) -> Seed {
        Seed::new(self.key(), self.round, u64::from(rank))
    }
}

/// What a lane's thread reuses to compress or decode partitions: no allocation per
/// partition once the largest has passed.
#[derive(Default)]
pub(super) struct CodecBuffers {
    pub(super) scratch: Scratch,
    pub(super) payload: Vec<u8>,
    /// The partition as f32s, where the tensor's memory is not 4-byte aligned.
    pub(super) elements: Vec<f32>,
}
