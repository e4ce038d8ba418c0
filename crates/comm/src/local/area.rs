//! What lies where in the machine's shared files: the machine's area (doorbell, who is
//! there, who has joined) and each tensor's (per member: the round it pushed, reduced,
//! consumed, and the last whose slice it could not bring back from the servers; then a
//! slot per member and the result).
//!
//! Every field a process reads from another is an atomic with its own cache line, written
//! with release and read with acquire ordering: a member stores its slot's bytes, then its
//! round number, so a peer that reads the round sees the bytes.

use std::io;
use std::path::Path;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

use super::shm::{self, Segment};

const PAGE: usize = 4096;
const LINE: usize = 64;

/// Workers one machine may have (Horovod's local size); far above any real machine.
pub const MAX_LOCAL: usize = 512;

const MAGIC: u64 = u64::from_le_bytes(*b"sumflow1");

const DOORBELL: usize = LINE;
const BROKEN: usize = 2 * LINE;
const PRESENT: usize = 4 * LINE;
const JOINED: usize = PRESENT + 8 * MAX_LOCAL;
const MACHINE_LEN: usize = (JOINED + 4 * MAX_LOCAL).next_multiple_of(PAGE);

/// The machine's area, one per job and machine, mapped by each of its workers.
#[derive(Debug)]
pub struct MachineArea {
    seg: Segment,
}

impl MachineArea {
    pub fn open(path: &Path) -> io::Result<MachineArea> {
        let seg = Segment::open(path, MACHINE_LEN)?;
        let magic = seg.u64_at(0);
        if magic
            .compare_exchange(0, MAGIC, Ordering::AcqRel, Ordering::Acquire)
            .is_err_and(|m| m != MAGIC)
        {
            return Err(io::Error::other(format!(
                "{} is not a sumflow machine area",
                path.display()
            )));
        }
        Ok(MachineArea { seg })
    }

    /// The word every change to any shared state of the machine increments, and every
    /// waiting stage sleeps on.
    pub fn doorbell(&self) -> &AtomicU32 {
        self.seg.u32_at(DOORBELL)
    }

    /// Tells every waiting stage of the machine that something changed.
    pub fn ring(&self) {
        self.doorbell().fetch_add(1, Ordering::AcqRel);
        shm::wake_all(self.doorbell());
    }

    /// Marks local worker `local` present (with its process id).
    pub fn register(&self, local: u32) {
        self.present(local)
            .store(u64::from(std::process::id()) + 1, Ordering::Release);
    }

    /// The process id local worker `local` registered, if it did.
    pub fn registered(&self, local: u32) -> Option<u32> {
        match self.present(local).load(Ordering::Acquire) {
            0 => None,
            pid => Some((pid - 1) as u32),
        }
    }

    fn present(&self, local: u32) -> &AtomicU64 {
        self.seg.u64_at(PRESENT + 8 * local as usize)
    }

    pub fn set_joined(&self, local: u32, joined: bool) {
        self.seg
            .u32_at(JOINED + 4 * local as usize)
            .store(u32::from(joined), Ordering::Release);
        self.ring();
    }

    pub fn joined(&self, local: u32) -> bool {
        self.seg
            .u32_at(JOINED + 4 * local as usize)
            .load(Ordering::Acquire)
            != 0
    }

    /// Records that local worker `local` could not go on (it could not allocate shared
    /// memory): every stage of the machine fails its operations, naming it.
    pub fn break_down(&self, local: u32) {
        let _ = self.seg.u32_at(BROKEN).compare_exchange(
            0,
            local + 1,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
        self.ring();
    }

    /// The local worker that broke the machine's shared memory, if one did.
    pub fn broken_by(&self) -> Option<u32> {
        match self.seg.u32_at(BROKEN).load(Ordering::Acquire) {
            0 => None,
            l => Some(l - 1),
        }
    }

    pub fn unlink(&self) {
        self.seg.unlink();
    }
}

/// What a member says of its push in a round, besides the round number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PushFlags {
    /// Its slot holds its tensor for the round (else it skipped the round).
    pub contributes: bool,
    /// It takes back the whole result.
    pub pulls_all: bool,
}

const ATTACHED: usize = 0;
const COMPLETED: usize = 8;
const R_PUSHED: usize = 0;
const R_FLAGS: usize = 8;
const R_REDUCED: usize = 16;
const R_CONSUMED: usize = 24;
const R_FAILED: usize = 32;

/// One tensor's area: a record and a slot per member, and the result.
#[derive(Debug)]
pub struct TensorArea {
    seg: Segment,
    members: usize,
    slot_len: usize,
    data: usize,
}

impl TensorArea {
    /// Opens the area of a tensor of `bytes` bytes summed by `members` workers.
    pub fn open(path: &Path, members: usize, bytes: usize) -> io::Result<TensorArea> {
        let data = (LINE * (members + 1)).next_multiple_of(PAGE);
        let slot_len = bytes.next_multiple_of(PAGE);
        let len = data + slot_len * (members + 1);
        let seg = Segment::open(path, len)?;
        Ok(TensorArea {
            seg,
            members,
            slot_len,
            data,
        })
    }

    /// Counts this process in; true for the last of the members to attach, which
    /// unlinks the file (every member has it mapped).
    pub fn attach(&self) -> bool {
        let n = self.seg.u32_at(ATTACHED).fetch_add(1, Ordering::AcqRel) + 1;
        n as usize == self.members
    }

    /// The last round any member consumed: where a member that was away (joined) or new
    /// picks up.
    pub fn completed(&self) -> u64 {
        self.seg.u64_at(COMPLETED).load(Ordering::Acquire)
    }

    fn record(&self, member: usize, field: usize) -> &AtomicU64 {
        assert!(member < self.members);
        self.seg.u64_at(LINE * (member + 1) + field)
    }

    pub fn pushed(&self, member: usize) -> u64 {
        self.record(member, R_PUSHED).load(Ordering::Acquire)
    }

    pub fn reduced(&self, member: usize) -> u64 {
        self.record(member, R_REDUCED).load(Ordering::Acquire)
    }

    pub fn consumed(&self, member: usize) -> u64 {
        self.record(member, R_CONSUMED).load(Ordering::Acquire)
    }

    pub fn flags(&self, member: usize) -> PushFlags {
        let f = self.record(member, R_FLAGS).load(Ordering::Acquire);
        PushFlags {
            contributes: f & 1 != 0,
            pulls_all: f & 2 != 0,
        }
    }

    /// Publishes `member`'s push of `round` (its slot written before).
    pub fn publish_push(&self, member: usize, round: u64, flags: PushFlags) {
        let f = u64::from(flags.contributes) | (u64::from(flags.pulls_all) << 1);
        self.record(member, R_FLAGS).store(f, Ordering::Release);
        self.record(member, R_PUSHED)
            .store(round, Ordering::Release);
    }

    pub fn publish_reduced(&self, member: usize, round: u64) {
        self.record(member, R_REDUCED)
            .store(round, Ordering::Release);
    }

    /// Publishes that `member` could not bring back its slice of `round` from the
    /// summation servers: the others fail the round too rather than wait for it.
    pub fn publish_failed(&self, member: usize, round: u64) {
        self.record(member, R_FAILED)
            .fetch_max(round, Ordering::AcqRel);
    }

    /// The last round whose slice `member` could not bring back (0: none).
    pub fn failed(&self, member: usize) -> u64 {
        self.record(member, R_FAILED).load(Ordering::Acquire)
    }

    pub fn publish_consumed(&self, member: usize, round: u64) {
        self.record(member, R_CONSUMED)
            .store(round, Ordering::Release);
        self.seg
            .u64_at(COMPLETED)
            .fetch_max(round, Ordering::AcqRel);
    }

    /// Sets every round of `member` to `round`: it picks up there after being away.
    pub fn resync(&self, member: usize, round: u64) {
        for field in [R_REDUCED, R_CONSUMED, R_PUSHED] {
            self.record(member, field).store(round, Ordering::Release);
        }
    }

    /// Byte offset of `member`'s slot; `members` gives the result's.
    pub fn slot_offset(&self, member: usize) -> usize {
        assert!(member <= self.members);
        self.data + member * self.slot_len
    }

    /// Pointer to byte `offset` of the segment.
    pub fn at(&self, offset: usize) -> *mut u8 {
        assert!(offset <= self.seg.len());
        // SAFETY: in bounds of the mapping (checked).
        unsafe { self.seg.base().add(offset) }
    }

    pub fn reserve(&self, offset: usize, len: usize) -> io::Result<()> {
        self.seg.reserve(offset, len)
    }

    pub fn unlink(&self) {
        self.seg.unlink();
    }
}
