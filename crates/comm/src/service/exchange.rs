//! Starting an operation on a declared tensor: a push_pull, one of some byte ranges only
//! (allgather, reduce-scatter), or an asynchronous delta. Each goes to the machine's
//! shared memory when that sums it, and otherwise through the pipeline, one task a
//! partition.

use std::ops::Range;
use std::sync::Arc;

use sumflow_plan::hierarchy;
use sumflow_plan::partition::Partition;
use sumflow_wire::{Dtype, KeyCodec, ReduceOp as WireOp};

use super::declare::{Table, Tensor};
use super::CommunicationService;
use crate::error::CommError;
use crate::local::cross::{self, Round};
use crate::local::{LocalOp, SharedMemory, LOCAL_KEY, LOCAL_SERVER};
use crate::pipeline::{Delta, HostSlice, PartTask};

/// How a push_pull combines the workers' tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceOp {
    Sum,
    /// The sum divided by the number of workers.
    Average,
    /// Element-wise minimum, maximum or product, by the servers' kernels.
    Min,
    Max,
    Product,
}

impl ReduceOp {
    /// What the servers do with the round's pushes.
    fn on_servers(self) -> WireOp {
        match self {
            ReduceOp::Sum | ReduceOp::Average => WireOp::Sum,
            ReduceOp::Min => WireOp::Min,
            ReduceOp::Max => WireOp::Max,
            ReduceOp::Product => WireOp::Product,
        }
    }
}

/// Which bytes of a push_pull's tensor this worker contributes and which it takes back.
/// The servers work by partition: a partition that meets a range is pushed (or taken)
/// whole, so ranges need not fall on partition boundaries, but the bytes of a pushed
/// partition outside this worker's ranges must hold the op's identity (zeros for a sum).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Exchange {
    /// Byte ranges this worker contributes; `None`: all of the tensor. For a partition
    /// that meets none, the worker takes part in its round with an empty push: nothing
    /// but a frame header crosses the wire.
    pub pushes: Option<Vec<Range<u64>>>,
    /// Byte ranges this worker takes back; `None`: all of the tensor. A partition that
    /// meets none is left as it is; only the notice that its round is complete comes back.
    pub pulls: Option<Vec<Range<u64>>>,
}

impl Exchange {
    /// The whole tensor both ways: an allreduce.
    pub const ALL: Exchange = Exchange {
        pushes: None,
        pulls: None,
    };

    fn meets(ranges: &Option<Vec<Range<u64>>>, part: &Partition) -> bool {
        let end = part.offset + part.bytes;
        ranges
            .as_deref()
            .is_none_or(|rs| rs.iter().any(|r| r.start < end && part.offset < r.end))
    }

    fn check(&self, name: &str, len: u64) -> Result<(), CommError> {
        for (what, ranges) in [("pushes", &self.pushes), ("pulls", &self.pulls)] {
            for r in ranges.iter().flatten() {
                if r.start >= r.end || r.end > len {
                    return Err(CommError::Invalid(format!(
                        "tensor '{name}': the byte range {r:?} this worker {what} is empty or \
                         outside the tensor's {len} bytes"
                    )));
                }
            }
        }
        Ok(())
    }
}

/// The one "partition" of an operation summed in the machine's shared memory.
fn local_partition(tensor: u32, len: usize) -> Partition {
    Partition {
        key: LOCAL_KEY,
        tensor,
        offset: 0,
        bytes: len as u64,
        server: LOCAL_SERVER,
    }
}

impl CommunicationService {
    /// Starts summing the tensor `id` across workers, in place in `ptr..ptr+len`.
    /// Returns at once with a handle to poll or wait on. Lower `priority` goes first.
    ///
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes and left alone (not freed, read
    /// or written) until [`wait`](Self::wait) on the handle has returned anything but a
    /// timeout, or [`shutdown`](Self::shutdown) has returned.
    pub unsafe fn push_pull(
        &self,
        id: u32,
        ptr: *mut u8,
        len: usize,
        priority: i64,
        op: ReduceOp,
    ) -> Result<u64, CommError> {
        // SAFETY: the caller's contract is exactly push_exchange's.
        unsafe { self.push_exchange(id, (ptr, len), priority, op, &Exchange::ALL) }
    }

    /// Like [`push_pull`](Self::push_pull), pushing and taking back only the partitions
    /// of `exchange`'s ranges: an allgather pushes this worker's rows and takes the
    /// others', a reduce-scatter pushes everything and takes its own share.
    ///
    /// # Safety
    /// As for [`push_pull`](Self::push_pull).
    pub unsafe fn push_exchange(
        &self,
        id: u32,
        (ptr, len): (*mut u8, usize),
        priority: i64,
        op: ReduceOp,
        exchange: &Exchange,
    ) -> Result<u64, CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut table = self.table.lock().expect("table lock");
        let table_generation = table.generation;
        let t = self.pushed(&mut table, id, len)?;
        exchange.check(&t.name, len as u64)?;
        if let Some(members) = t.members.as_deref() {
            // The server would refuse the push and count this worker gone for the job.
            if members.binary_search(&self.rank()).is_err() {
                return Err(CommError::Invalid(format!(
                    "tensor '{}' is summed over workers {members:?}: worker {} is not one \
                     of them and must not push it",
                    t.name,
                    self.rank()
                )));
            }
        }
        if op.on_servers() != WireOp::Sum && t.compression.is_some() {
            return Err(CommError::Invalid(format!(
                "tensor '{}' is compressed: it can be summed or averaged, not reduced by {op:?}",
                t.name
            )));
        }
        let divisor = match (op, t.dtype) {
            (ReduceOp::Sum | ReduceOp::Min | ReduceOp::Max | ReduceOp::Product, _) => None,
            (ReduceOp::Average, Dtype::I32 | Dtype::I64) => {
                return Err(CommError::Invalid(format!(
                    "tensor '{}' holds {}: averaging integers would truncate; use Sum",
                    t.name, t.dtype
                )))
            }
            // The mean over the workers whose tensors were summed.
            (ReduceOp::Average, _) => {
                Some(t.members.as_ref().map_or(self.size(), |m| m.len() as u32))
            }
        };
        // SAFETY: the caller's contract is exactly HostSlice::new's.
        let whole = unsafe { HostSlice::new(ptr, len) }
            .ok_or_else(|| CommError::Invalid(format!("tensor '{}': null buffer", t.name)))?;
        let crossing = self.crossing_for(t);
        let shared = crossing
            .as_ref()
            .map(|(s, _)| *s)
            .or_else(|| self.shared_for(t));
        if let Some(shared) = shared {
            let handle = self
                .handles
                .start(t.id, &t.name, &[local_partition(t.id, len)])?;
            let (members, local_divisor, cross) = match crossing {
                Some((_, here)) => {
                    let round = t.next_round(table_generation);
                    let round = Round {
                        tensor: t.id,
                        name: &t.name,
                        dtype: t.dtype,
                        parts: &t.parts,
                        members: t.members.clone(),
                        round,
                        priority,
                        op: op.on_servers(),
                        divisor,
                    };
                    let cross = cross::plan(&round, &self.pipeline, &self.handles);
                    // The servers' sums come back averaged over every member.
                    (here, None, Some(cross))
                }
                None => {
                    let members = t.members.clone().unwrap_or_else(|| shared.here());
                    (members, divisor, None)
                }
            };
            shared.submit(LocalOp {
                handle,
                tensor: t.id,
                name: Arc::clone(&t.name),
                data: whole,
                dtype: t.dtype,
                members,
                op: op.on_servers(),
                divisor: local_divisor,
                contributes: exchange.pushes.as_ref().is_none_or(|p| !p.is_empty()),
                pulls: exchange.pulls.clone(),
                cross,
            })?;
            return Ok(handle);
        }
        let handle = self.handles.start(t.id, &t.name, &t.parts)?;
        let round = t.next_round(table_generation);
        let tasks = t
            .parts
            .iter()
            .enumerate()
            .map(|(index, &partition)| PartTask {
                name: Arc::clone(&t.name),
                index: index as u32,
                handle,
                partition,
                round,
                dtype: t.dtype,
                data: whole.sub(partition.offset as usize, partition.bytes as usize),
                codec: t.compression.map_or(KeyCodec::RAW, |c| {
                    c.key_codec(partition.bytes / t.dtype.size() as u64)
                }),
                members: t.members.clone(),
                divisor,
                op: op.on_servers(),
                pushes: Exchange::meets(&exchange.pushes, &partition),
                wants_sum: Exchange::meets(&exchange.pulls, &partition),
                skips: None,
                delta: None,
            })
            .collect();
        self.pipeline.enqueue(id, &t.name, priority, tasks);
        Ok(handle)
    }

    /// Asynchronous training (BytePS §4.3, Fig. 11b): adds the `len` bytes at `ptr`, this
    /// worker's delta of tensor `id` (its parameters after its own update, less the value
    /// it last pulled), to the servers' stored value, and overwrites them with the stored
    /// value once the delta is in: every worker's deltas so far. Workers do not wait for
    /// each other, but with `staleness` s a worker's round r returns only once every
    /// worker has pushed round r − s. `initial` (as long) is the value the servers start
    /// from, read by the tensor's first push only: every worker passes the same (e.g.
    /// parameters broadcast from one worker). The tensor must be raw, of every worker,
    /// and pushed by this method only; its sums skip the machine's shared memory.
    ///
    /// # Safety
    /// As `push_exchange` for `ptr..ptr+len`; `initial..initial+len` must be valid for
    /// reads and unchanged until the operation has been waited for.
    pub unsafe fn push_delta(
        &self,
        id: u32,
        (ptr, len): (*mut u8, usize),
        initial: *mut u8,
        staleness: Option<u32>,
        priority: i64,
    ) -> Result<u64, CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut table = self.table.lock().expect("table lock");
        let generation = table.generation;
        let t = self.pushed(&mut table, id, len)?;
        let refused = if t.compression.is_some() {
            Some("is compressed: deltas are added as raw elements".to_string())
        } else if t.members.is_some() || t.home.is_some() {
            Some("belongs to a process set or a worker: deltas are of every worker".to_string())
        } else {
            None
        };
        if let Some(why) = refused {
            return Err(CommError::Invalid(format!("tensor '{}' {why}", t.name)));
        }
        // SAFETY: the caller's contract is exactly HostSlice::new's, for both spans.
        let (whole, start) = unsafe { (HostSlice::new(ptr, len), HostSlice::new(initial, len)) };
        let (Some(whole), Some(start)) = (whole, start) else {
            return Err(CommError::Invalid(format!(
                "tensor '{}': null buffer",
                t.name
            )));
        };
        let handle = self.handles.start(t.id, &t.name, &t.parts)?;
        let round = t.next_round(generation);
        let tasks = t
            .parts
            .iter()
            .enumerate()
            .map(|(index, &partition)| {
                let (offset, bytes) = (partition.offset as usize, partition.bytes as usize);
                PartTask {
                    name: Arc::clone(&t.name),
                    index: index as u32,
                    handle,
                    partition,
                    round,
                    dtype: t.dtype,
                    data: whole.sub(offset, bytes),
                    codec: KeyCodec::RAW,
                    members: None,
                    divisor: None,
                    op: ReduceOp::Sum.on_servers(),
                    pushes: true,
                    wants_sum: true,
                    skips: None,
                    delta: Some(Delta {
                        staleness,
                        initial: start.sub(offset, bytes),
                    }),
                }
            })
            .collect();
        self.pipeline.enqueue(id, &t.name, priority, tasks);
        Ok(handle)
    }

    /// Tensor `id`, about to be pushed from a buffer of `len` bytes: declared here, its
    /// name not lost with the coordinator, and `len` its size.
    fn pushed<'t>(
        &self,
        table: &'t mut Table,
        id: u32,
        len: usize,
    ) -> Result<&'t mut Tensor, CommError> {
        let t = table
            .tensors
            .get_mut(&id)
            .ok_or_else(|| CommError::Invalid(format!("tensor id {id} was never declared")))?;
        if let Some(e) = self.coordinator_loss.error(&t.name) {
            return Err(e);
        }
        let want = t.elements as usize * t.dtype.size();
        if len != want {
            return Err(CommError::Invalid(format!(
                "tensor '{}' is declared as {} x {} ({want} bytes) but {len} bytes were given",
                t.name, t.dtype, t.elements
            )));
        }
        Ok(t)
    }

    /// The shared-memory stage and this machine's members of the tensor, when it is
    /// aggregated inside the machine first (`sumflow_plan::hierarchy`): raw elements, not
    /// kept on one worker's machine (a relay region or a reduce-scatter share), members
    /// on several machines and at least two on this one.
    fn crossing_for(&self, t: &Tensor) -> Option<(&SharedMemory, Arc<[u32]>)> {
        let shared = self.shared.as_ref().filter(|_| self.hierarchical)?;
        if t.compression.is_some() || t.home.is_some() {
            return None;
        }
        let map = self.job.cluster_map();
        let all: Vec<u32>;
        let members = match t.members.as_deref() {
            Some(m) => m,
            None => {
                all = (0..map.workers.len() as u32).collect();
                &all
            }
        };
        let host = |r: u32| map.workers[r as usize].host_id.as_str();
        let here = hierarchy::machine_members(members, self.rank(), host)?;
        Some((shared, Arc::from(here)))
    }

    /// The shared-memory stage, when it sums this tensor: every member on this machine,
    /// and raw elements (compressors exist for the network).
    fn shared_for(&self, t: &Tensor) -> Option<&SharedMemory> {
        self.shared
            .as_ref()
            .filter(|s| t.compression.is_none() && s.covers(t.members.as_deref()))
    }
}
