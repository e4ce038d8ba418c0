//! A connection's mailbox: memory a worker shares with a summation server on its own
//! machine, so that the payloads of that connection skip the socket (BytePS §6.2).
//!
//! The worker creates the memory (an anonymous memfd) and hands its descriptor to the
//! server with the `Mailbox` frame over the machine-local Unix socket, the only way to
//! reach that server's name ([`crate::link`]). Layout: [`MAILBOX_HEADER_BYTES`] of slot
//! states (one 32-bit word per slot, push slots first), then the push slots, then the
//! pull slots, each `slot_bytes` long.
//!
//! A slot's word says who holds it. A push slot is the worker's while free: it copies a
//! payload in, marks the slot lent and sends a lent `Push` naming it; the server sums
//! straight from the slot and frees it once summed. A pull slot is the server's while
//! free: its writer copies a sum in, marks it lent and sends a lent `PullReply`; the
//! worker copies the sum where it belongs and frees the slot. Nobody waits for a slot:
//! with none free, or a payload larger than a slot, the payload goes on the socket as it
//! always did. The lender's release store and the taker's acquire load of the word order
//! the payload's bytes across the two processes.
//!
//! A worker that breaks this (writes a slot it lent, names a slot it did not fill) can
//! only spoil the numbers of its own contribution: the server checks every locator
//! against its own mapping, and takes lent pushes of raw numbers only, for which any bytes
//! are valid (a compressed payload is checked once and must not change after).

use std::fs::File;
use std::io;
use std::ops::Deref;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use sumflow_wire::message::{MAILBOX_HEADER_BYTES, MAILBOX_MAX_SLOTS};
use sumflow_wire::Lent;

/// Payloads shorter than this go on the socket even with a slot free: the frame's header
/// carries them in the same write, which a lent frame needs anyway.
pub const MIN_LENT_BYTES: usize = 4096;

/// A mailbox's memory keeps its size for good: neither side can shrink it under the other.
const SEALS: libc::c_int = libc::F_SEAL_SHRINK | libc::F_SEAL_GROW | libc::F_SEAL_SEAL;

/// A slot no one has lent: its holder (the worker for push slots, the server for pull
/// slots) may fill it.
const FREE: u32 = 0;
/// A slot lent to the other side, holding a payload it has not released yet.
const LENT: u32 = 1;

/// Memory shared with other processes: a `MAP_SHARED` mapping of a file descriptor.
#[derive(Debug)]
pub struct Mapping {
    base: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is plain memory shared with other processes anyway; every access
// goes through atomics or through ranges a protocol gives one writer at a time.
unsafe impl Send for Mapping {}
// SAFETY: as for Send: `&Mapping` hands out only raw pointers.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// Maps the first `len` bytes of `fd`, readable and writable, shared.
    pub fn new(fd: BorrowedFd<'_>, len: usize) -> io::Result<Mapping> {
        if len == 0 {
            return Err(io::Error::other("cannot map 0 bytes"));
        }
        // SAFETY: a fresh shared mapping of a descriptor the caller holds open; the
        // kernel picks the address, and checks `len` against what it can map.
        let ptr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                fd.as_raw_fd(),
                0,
            )
        };
        if ptr == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let base =
            NonNull::new(ptr.cast::<u8>()).ok_or_else(|| io::Error::other("mmap gave null"))?;
        Ok(Mapping { base, len })
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first byte of the mapping (page aligned).
    pub fn base(&self) -> *mut u8 {
        self.base.as_ptr()
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `new`, unmapped once; nothing borrowed from it
        // outlives &self.
        unsafe {
            libc::munmap(self.base.as_ptr().cast(), self.len);
        }
    }
}

/// The two kinds of slot: those pushes are lent in (filled by the worker) and those sums
/// are lent in (filled by the server).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    Push,
    Pull,
}

/// Why a lent frame's locator cannot be taken.
#[derive(Debug, thiserror::Error)]
pub enum MailboxError {
    #[error("this connection has no mailbox")]
    None,
    #[error("{side:?} slot {slot} is outside the mailbox's {slots}")]
    NoSuchSlot { side: Side, slot: u32, slots: u32 },
    #[error("a lent payload of {len} bytes is larger than a slot ({slot_bytes} bytes)")]
    TooLong { len: u32, slot_bytes: usize },
    #[error("{side:?} slot {slot} was named in a lent frame but not lent")]
    NotLent { side: Side, slot: u32 },
}

/// The shared memory of one worker-server connection.
#[derive(Debug)]
pub struct Mailbox {
    map: Mapping,
    push_slots: u32,
    pull_slots: u32,
    slot_bytes: usize,
}

impl Mailbox {
    /// The bytes a mailbox of this shape occupies.
    pub fn bytes_for(push_slots: u32, pull_slots: u32, slot_bytes: u64) -> u64 {
        MAILBOX_HEADER_BYTES + u64::from(push_slots + pull_slots) * slot_bytes
    }

    /// Creates a mailbox (the worker's side): its memory and the descriptor to hand over.
    /// Pages are taken as slots are first written, not now.
    pub fn create(
        push_slots: u32,
        pull_slots: u32,
        slot_bytes: u64,
    ) -> io::Result<(Mailbox, OwnedFd)> {
        assert!(
            (1..=MAILBOX_MAX_SLOTS).contains(&push_slots)
                && (1..=MAILBOX_MAX_SLOTS).contains(&pull_slots),
            "1 to {MAILBOX_MAX_SLOTS} slots of each kind"
        );
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor it returns is
        // ours alone, owned from here on.
        let fd = unsafe {
            libc::memfd_create(
                c"sumflow-mailbox".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor that nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        File::from(fd.try_clone()?).set_len(Self::bytes_for(push_slots, pull_slots, slot_bytes))?;
        // Sealed at its size: the server, which maps it, must never find part of it gone
        // (a store to a page past the end of a shrunk file is a SIGBUS).
        // SAFETY: fcntl on a descriptor we own.
        let sealed = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, SEALS) };
        if sealed != 0 {
            return Err(io::Error::last_os_error());
        }
        let mailbox = Self::map(fd.as_fd(), push_slots, pull_slots, slot_bytes)?;
        Ok((mailbox, fd))
    }

    /// Maps a mailbox a worker handed over (the server's side), after checking that the
    /// memory is as large as the shape the worker announced.
    pub fn adopt(
        fd: OwnedFd,
        push_slots: u32,
        pull_slots: u32,
        slot_bytes: u64,
    ) -> io::Result<Mailbox> {
        // SAFETY: fcntl on a descriptor we own; anything but a memfd answers an error.
        let seals = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GET_SEALS) };
        if seals < 0 || seals & libc::F_SEAL_SHRINK == 0 {
            return Err(io::Error::other(
                "the descriptor passed is not memory sealed against shrinking (a memfd with \
                 F_SEAL_SHRINK), so the server could not safely map it",
            ));
        }
        let want = Self::bytes_for(push_slots, pull_slots, slot_bytes);
        let file = File::from(fd);
        let meta = file.metadata()?;
        if !meta.is_file() || meta.len() != want {
            return Err(io::Error::other(format!(
                "the descriptor passed is {} bytes{}, not the {want} its mailbox needs",
                meta.len(),
                if meta.is_file() {
                    ""
                } else {
                    " and not memory"
                }
            )));
        }
        Self::map(file.as_fd(), push_slots, pull_slots, slot_bytes)
    }

    fn map(
        fd: BorrowedFd<'_>,
        push_slots: u32,
        pull_slots: u32,
        slot_bytes: u64,
    ) -> io::Result<Mailbox> {
        let len = usize::try_from(Self::bytes_for(push_slots, pull_slots, slot_bytes))
            .map_err(|_| io::Error::other("mailbox larger than the address space"))?;
        Ok(Mailbox {
            map: Mapping::new(fd, len)?,
            push_slots,
            pull_slots,
            slot_bytes: slot_bytes as usize,
        })
    }

    /// The largest payload a slot holds.
    pub fn slot_bytes(&self) -> usize {
        self.slot_bytes
    }

    fn slots(&self, side: Side) -> u32 {
        match side {
            Side::Push => self.push_slots,
            Side::Pull => self.pull_slots,
        }
    }

    /// The index of `slot` of `side` among all slots (push slots first).
    fn index(&self, side: Side, slot: u32) -> usize {
        debug_assert!(slot < self.slots(side));
        match side {
            Side::Push => slot as usize,
            Side::Pull => (self.push_slots + slot) as usize,
        }
    }

    fn state(&self, side: Side, slot: u32) -> &AtomicU32 {
        let offset = 4 * self.index(side, slot);
        // SAFETY: the header holds a word per slot (at most 2 x MAILBOX_MAX_SLOTS words,
        // within MAILBOX_HEADER_BYTES), 4-byte aligned in a page-aligned mapping that
        // lives as long as &self; AtomicU32 has u32's layout.
        unsafe { &*self.map.base().add(offset).cast::<AtomicU32>() }
    }

    fn slot_ptr(&self, side: Side, slot: u32) -> *mut u8 {
        let offset = MAILBOX_HEADER_BYTES as usize + self.index(side, slot) * self.slot_bytes;
        // SAFETY: every slot lies inside the mapping (its length is `bytes_for` the shape).
        unsafe { self.map.base().add(offset) }
    }

    /// Lends `data` to the other side in a free slot of `side`, looking from `*cursor` on
    /// (round robin); `None` when no slot is free or `data` is shorter than
    /// [`MIN_LENT_BYTES`] or too long for a slot. Only the holder of `side`'s free slots
    /// calls this, from one thread.
    pub fn lend(&self, side: Side, cursor: &mut u32, data: &[u8]) -> Option<Lent> {
        if data.len() < MIN_LENT_BYTES || data.len() > self.slot_bytes {
            return None;
        }
        let slots = self.slots(side);
        for step in 0..slots {
            let slot = (*cursor + step) % slots;
            let state = self.state(side, slot);
            if state.load(Ordering::Acquire) != FREE {
                continue;
            }
            // SAFETY: the slot is free, so ours (the other side writes no free slot of
            // this kind), and `data` fits it (checked); `data` is this process's memory,
            // never the mailbox's slot, so the ranges do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(data.as_ptr(), self.slot_ptr(side, slot), data.len());
            }
            state.store(LENT, Ordering::Release);
            *cursor = (slot + 1) % slots;
            return Some(Lent {
                slot,
                len: data.len() as u32,
            });
        }
        None
    }

    /// Takes the payload a lent frame names, after checking its locator: read it through
    /// the returned [`Taken`], whose drop frees the slot.
    pub fn take(self: &Arc<Self>, side: Side, lent: Lent) -> Result<Taken, MailboxError> {
        let slots = self.slots(side);
        if lent.slot >= slots {
            return Err(MailboxError::NoSuchSlot {
                side,
                slot: lent.slot,
                slots,
            });
        }
        if lent.len as usize > self.slot_bytes {
            return Err(MailboxError::TooLong {
                len: lent.len,
                slot_bytes: self.slot_bytes,
            });
        }
        if self.state(side, lent.slot).load(Ordering::Acquire) != LENT {
            return Err(MailboxError::NotLent {
                side,
                slot: lent.slot,
            });
        }
        Ok(Taken {
            mailbox: Arc::clone(self),
            side,
            lent,
        })
    }
}

/// A lent payload being read; dropping it hands the slot back to its lender.
#[derive(Debug)]
pub struct Taken {
    mailbox: Arc<Mailbox>,
    side: Side,
    lent: Lent,
}

impl Deref for Taken {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: inside the mapping (the locator was checked against the slot size), which
        // `self.mailbox` keeps alive; the slot is lent to us until this drops, and its
        // lender writes no lent slot. A lender breaking that changes only the values read
        // (plain bytes), never where they are.
        unsafe {
            std::slice::from_raw_parts(
                self.mailbox.slot_ptr(self.side, self.lent.slot),
                self.lent.len as usize,
            )
        }
    }
}

impl Drop for Taken {
    fn drop(&mut self) {
        self.mailbox
            .state(self.side, self.lent.slot)
            .store(FREE, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lent_payload_is_read_in_place_and_its_slot_comes_back() {
        let (worker, fd) = Mailbox::create(2, 1, 4096).unwrap();
        let server = Arc::new(Mailbox::adopt(fd, 2, 1, 4096).unwrap());
        let mut cursor = 0;
        let short = [1; MIN_LENT_BYTES - 1];
        assert!(
            worker.lend(Side::Push, &mut cursor, &short).is_none(),
            "too short"
        );
        let a = worker.lend(Side::Push, &mut cursor, &[1; 4096]).unwrap();
        let b = worker.lend(Side::Push, &mut cursor, &[2; 4096]).unwrap();
        assert_eq!((a.slot, b.slot), (0, 1));
        assert!(
            worker.lend(Side::Push, &mut cursor, &[3; 4096]).is_none(),
            "both slots lent: the caller uses the socket"
        );
        assert!(
            worker.lend(Side::Pull, &mut 0, &[4; 4097]).is_none(),
            "too long"
        );
        let taken = server.take(Side::Push, a).unwrap();
        assert_eq!(&taken[..], &[1; 4096][..], "the other process's view");
        assert!(matches!(
            server.take(Side::Pull, Lent { slot: 0, len: 8 }),
            Err(MailboxError::NotLent { .. })
        ));
        drop(taken);
        let c = worker.lend(Side::Push, &mut cursor, &[5; 4096]).unwrap();
        assert_eq!(c.slot, 0, "freed by the server's drop");
        assert_eq!(&server.take(Side::Push, b).unwrap()[..], &[2; 4096][..]);
        // The other direction: the server lends, the worker takes.
        let sum = server.lend(Side::Pull, &mut 0, &[6; 4096]).unwrap();
        let worker = Arc::new(worker);
        let got = worker.take(Side::Pull, sum).unwrap();
        assert_eq!(&got[..], &[6; 4096][..]);
        assert!(
            server.lend(Side::Pull, &mut 0, &[7; 4096]).is_none(),
            "one pull slot, held"
        );
        drop(got);
        assert!(
            server.lend(Side::Pull, &mut 0, &[7; 4096]).is_some(),
            "and freed"
        );
    }

    #[test]
    fn a_locator_outside_the_mailbox_is_refused() {
        let (_worker, fd) = Mailbox::create(1, 1, 4096).unwrap();
        let server = Arc::new(Mailbox::adopt(fd, 1, 1, 4096).unwrap());
        let e = server
            .take(Side::Push, Lent { slot: 1, len: 8 })
            .unwrap_err();
        assert!(e.to_string().contains("outside"), "{e}");
        let e = server
            .take(Side::Pull, Lent { slot: 0, len: 4097 })
            .unwrap_err();
        assert!(e.to_string().contains("larger than a slot"), "{e}");
    }

    #[test]
    fn memory_of_another_shape_or_that_could_shrink_is_refused() {
        let (_worker, fd) = Mailbox::create(1, 1, 4096).unwrap();
        let shrink = File::from(fd.try_clone().unwrap()).set_len(0);
        assert!(shrink.is_err(), "sealed at its size");
        let e = Mailbox::adopt(fd, 2, 1, 4096).unwrap_err();
        assert!(e.to_string().contains("not the"), "{e}");
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"unsealed".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0);
        // SAFETY: a fresh descriptor that nothing else owns.
        let unsealed = unsafe { OwnedFd::from_raw_fd(raw) };
        let bytes = Mailbox::bytes_for(1, 1, 4096);
        File::from(unsealed.try_clone().unwrap())
            .set_len(bytes)
            .unwrap();
        let e = Mailbox::adopt(unsealed, 1, 1, 4096).unwrap_err();
        assert!(e.to_string().contains("sealed against shrinking"), "{e}");
    }
}
