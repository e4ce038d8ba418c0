//! Shared memory between the processes of one machine: files in `/dev/shm` mapped by
//! every process that opens them, and futexes on words inside them.
//!
//! Files rather than anonymous memory passed over sockets: every worker of the machine
//! derives the same name from the job and the tensor, so no process has to hand the
//! others anything. Each file is unlinked as soon as every process that needs it has
//! mapped it (and by each process again at retirement, which tolerates its absence), so
//! a crashed job leaves at most the files of the moment it crashed, named by its job id.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd};
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64};
use std::time::Duration;

use sumflow_client::mailbox::Mapping;

/// Where the machine's shared memory files live: memory-backed on Linux; elsewhere a
/// plain directory, whose mappings are still shared, if slower.
#[cfg(target_os = "linux")]
pub const SHM_DIR: &str = "/dev/shm";
#[cfg(not(target_os = "linux"))]
pub const SHM_DIR: &str = "/tmp";

/// A shared file mapped into this process. Every access to the mapping goes through
/// atomics or through ranges the round protocol gives one writer at a time.
#[derive(Debug)]
pub struct Segment {
    path: PathBuf,
    file: File,
    map: Mapping,
}

impl Segment {
    /// Opens (creating it if needed) the file at `path` with `len` bytes and maps it. Every
    /// process of the machine opens the same path with the same length; a file of another
    /// length is another job's or a bug, and refused. Pages are not reserved: call
    /// [`reserve`](Self::reserve) on a range before writing it.
    pub fn open(path: &Path, len: usize) -> io::Result<Segment> {
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .mode(0o600)
            .open(path)?;
        let size = file.metadata()?.len();
        if size == 0 {
            file.set_len(len as u64)?;
        } else if size != len as u64 {
            return Err(io::Error::other(format!(
                "{} is {size} bytes, not the {len} this job expects: another job's file \
                 of the same name?",
                path.display()
            )));
        }
        let map = Mapping::new(file.as_fd(), len)?;
        Ok(Segment {
            path: path.to_path_buf(),
            file,
            map,
        })
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// The first byte of the mapping (page aligned).
    pub fn base(&self) -> *mut u8 {
        self.map.base()
    }

    /// Allocates the pages of `offset..offset + len` in the file, so that writing them
    /// cannot fail later. A full `/dev/shm` is an error here rather than a SIGBUS on the
    /// first store to a page tmpfs cannot back.
    pub fn reserve(&self, offset: usize, len: usize) -> io::Result<()> {
        assert!(offset + len <= self.len(), "reserve past the segment's end");
        if len == 0 {
            return Ok(());
        }
        self.fallocate(offset, len)
    }

    #[cfg(not(target_os = "linux"))]
    fn fallocate(&self, _offset: usize, _len: usize) -> io::Result<()> {
        Ok(())
    }

    #[cfg(target_os = "linux")]
    fn fallocate(&self, offset: usize, len: usize) -> io::Result<()> {
        // SAFETY: fallocate on a file descriptor we own, within the file's length.
        let rc = unsafe {
            libc::fallocate(
                self.file.as_raw_fd(),
                0,
                offset as libc::off_t,
                len as libc::off_t,
            )
        };
        if rc == 0 {
            return Ok(());
        }
        let e = io::Error::last_os_error();
        // Filesystems without fallocate (not tmpfs) fall back to faulting pages in.
        if e.raw_os_error() == Some(libc::EOPNOTSUPP) {
            return Ok(());
        }
        Err(e)
    }

    /// The 32-bit word at `offset` (4-byte aligned, inside the segment).
    pub fn u32_at(&self, offset: usize) -> &AtomicU32 {
        assert!(
            offset.is_multiple_of(4) && offset + 4 <= self.len(),
            "bad word offset {offset}"
        );
        // SAFETY: in bounds and aligned (checked); the mapping lives as long as &self, and
        // AtomicU32 has u32's layout, which any 4 bytes of shared memory may hold.
        unsafe { &*self.base().add(offset).cast::<AtomicU32>() }
    }

    /// The 64-bit word at `offset` (8-byte aligned, inside the segment).
    pub fn u64_at(&self, offset: usize) -> &AtomicU64 {
        assert!(
            offset.is_multiple_of(8) && offset + 8 <= self.len(),
            "bad word offset {offset}"
        );
        // SAFETY: as for u32_at.
        unsafe { &*self.base().add(offset).cast::<AtomicU64>() }
    }

    /// Removes the file's name; the mapping stays valid. A name already gone is fine.
    pub fn unlink(&self) {
        unlink(&self.path);
    }
}

/// The file `<prefix>-<what>`: one of a job's files on this machine.
pub fn named(prefix: &Path, what: &str) -> PathBuf {
    let mut p = prefix.as_os_str().to_owned();
    p.push(format!("-{what}"));
    PathBuf::from(p)
}

/// Removes a shared file's name, if it is still there.
pub fn unlink(path: &Path) {
    let _ = std::fs::remove_file(path);
}

/// Sleeps while `word` holds `expected`, at most `timeout`; wakes early on
/// [`wake_all`] from any process. Spurious returns are allowed (callers re-check).
#[cfg(target_os = "linux")]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: FUTEX_WAIT on a live, aligned 32-bit word; shared (not PRIVATE) because
    // other processes wake it; the timeout is relative.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            std::ptr::from_ref(&ts),
        );
    }
}

/// Without futexes: polls the word every 50 µs, up to `timeout`.
#[cfg(not(target_os = "linux"))]
pub fn wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let deadline = std::time::Instant::now() + timeout;
    while word.load(std::sync::atomic::Ordering::Acquire) == expected
        && std::time::Instant::now() < deadline
    {
        std::thread::sleep(Duration::from_micros(50));
    }
}

/// Without futexes, waiters poll: nothing to wake.
#[cfg(not(target_os = "linux"))]
pub fn wake_all(_word: &AtomicU32) {}

/// Wakes every process and thread sleeping in [`wait`] on `word`.
#[cfg(target_os = "linux")]
pub fn wake_all(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a live, aligned 32-bit word.
    unsafe {
        libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX);
    }
}
