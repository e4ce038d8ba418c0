//! A worker's connection to a summation server: TCP, or a Unix socket when the server runs
//! on the worker's own machine.
//!
//! At k = 0 every worker sends 1/n of its gradient to its own machine's colocated server
//! and takes 1/n of every sum back from it (BytePS §6.2: loopback TCP costs two kernel
//! copies per hop). Through TCP that leg crossed the whole TCP/IP stack twice; a Unix
//! stream socket carries the same frames for less than half the CPU per byte (measured on
//! the development VM: 0.25-0.30 against 0.57-0.64 core-seconds per GB, sender and receiver
//! together). The protocol, the handshake with the job token included, is the same on both.
//!
//! A server listens on an abstract Unix socket named after the address it advertises
//! ([`local_name`]). Abstract names belong to a network namespace, which is what a machine
//! (or an emulated host) is: a worker that can reach the name shares the server's network
//! namespace, and the address in the name makes it that very server. Anyone else finds no
//! such name and uses TCP. A local process that took the name first cannot pass the
//! handshake (the server proves it holds the job's token), and the worker then uses TCP.

use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

use sumflow_wire::PayloadRead;

/// The abstract socket name of the server that workers dial at `addr` ("host:port").
pub fn local_name(addr: &str) -> String {
    format!("sumflow-summation-{addr}")
}

/// Listens on the machine-local socket of the server advertised at `addr`.
pub fn listen_local(addr: &str) -> io::Result<UnixListener> {
    UnixListener::bind_addr(&SocketAddr::from_abstract_name(local_name(addr))?)
}

/// The machine-local socket of the server advertised at `addr`, if it is on this machine
/// and listening.
pub fn connect_local(addr: &str) -> Option<UnixStream> {
    let name = SocketAddr::from_abstract_name(local_name(addr)).ok()?;
    UnixStream::connect_addr(&name).ok()
}

/// One connection between a worker and a summation server.
#[derive(Debug)]
pub enum Link {
    Tcp(TcpStream),
    /// A Unix stream socket on one machine.
    Local(UnixStream),
}

impl Link {
    pub fn try_clone(&self) -> io::Result<Link> {
        Ok(match self {
            Link::Tcp(s) => Link::Tcp(s.try_clone()?),
            Link::Local(s) => Link::Local(s.try_clone()?),
        })
    }

    /// Writes as much of `bufs` as the socket's buffer takes now, without waiting for room
    /// (`MSG_DONTWAIT`, whatever the socket's mode): the bytes written, 0 when it is full.
    pub fn send_now(&self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        let fd = match self {
            Link::Tcp(s) => s.as_raw_fd(),
            Link::Local(s) => s.as_raw_fd(),
        };
        // SAFETY: msghdr is plain data, valid zeroed; `IoSlice` is ABI-compatible with
        // `iovec` on Unix, and `bufs` outlives the sendmsg call, which only reads it.
        let sent = unsafe {
            let mut msg: libc::msghdr = std::mem::zeroed();
            msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
            msg.msg_iovlen = bufs.len() as _;
            libc::sendmsg(fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
        };
        if sent >= 0 {
            return Ok(sent as usize);
        }
        match io::Error::last_os_error() {
            e if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
            e => Err(e),
        }
    }

    pub fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Link::Tcp(s) => s.shutdown(how),
            Link::Local(s) => s.shutdown(how),
        }
    }

    pub fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Link::Tcp(s) => s.set_read_timeout(timeout),
            Link::Local(s) => s.set_read_timeout(timeout),
        }
    }

    pub fn set_write_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        match self {
            Link::Tcp(s) => s.set_write_timeout(timeout),
            Link::Local(s) => s.set_write_timeout(timeout),
        }
    }

    /// Sends small frames at once (no Nagle delay); nothing to do on a Unix socket.
    pub fn set_nodelay(&self) {
        if let Link::Tcp(s) = self {
            let _ = s.set_nodelay(true);
        }
    }

    /// The other end, for logs: its TCP address, or that it is on this machine.
    pub fn peer(&self) -> String {
        match self {
            Link::Tcp(s) => s
                .peer_addr()
                .map_or_else(|_| "unknown".into(), |a| a.to_string()),
            Link::Local(_) => "this machine (Unix socket)".into(),
        }
    }

    pub fn is_local(&self) -> bool {
        matches!(self, Link::Local(_))
    }
}

/// Writes `bytes` with the descriptor `fd` attached (`SCM_RIGHTS`): the reader receives
/// its own descriptor of the same file along with the first of these bytes, if it reads
/// them with [`Receiving`].
pub fn send_with_fd(stream: &UnixStream, bytes: &[u8], fd: BorrowedFd<'_>) -> io::Result<()> {
    let raw = fd.as_raw_fd();
    let mut control = Control([0u8; CONTROL_BYTES]);
    let mut iov = libc::iovec {
        iov_base: bytes.as_ptr() as *mut libc::c_void,
        iov_len: bytes.len(),
    };
    // SAFETY: msghdr is plain data, valid zeroed; every pointer set below points into
    // locals that outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.0.as_mut_ptr().cast();
    // SAFETY: CMSG_SPACE only computes a size.
    msg.msg_controllen = unsafe { libc::CMSG_SPACE(size_of::<libc::c_int>() as u32) } as _;
    // SAFETY: the control buffer holds one header and one int (CONTROL_BYTES is at least
    // CMSG_SPACE of an int), so the first header and its data are inside it; the buffer
    // is aligned for cmsghdr (see `Control`).
    let sent = unsafe {
        let cmsg = libc::CMSG_FIRSTHDR(&msg);
        (*cmsg).cmsg_level = libc::SOL_SOCKET;
        (*cmsg).cmsg_type = libc::SCM_RIGHTS;
        (*cmsg).cmsg_len = libc::CMSG_LEN(size_of::<libc::c_int>() as u32) as _;
        std::ptr::write_unaligned(libc::CMSG_DATA(cmsg).cast::<libc::c_int>(), raw);
        libc::sendmsg(stream.as_raw_fd(), &msg, libc::MSG_NOSIGNAL)
    };
    if sent < 0 {
        return Err(io::Error::last_os_error());
    }
    // The descriptor went with the first byte; the rest, if the socket took only part,
    // follows as plain bytes.
    (&*stream).write_all(&bytes[sent as usize..])
}

/// Room for the control message of one descriptor, aligned for `cmsghdr`.
const CONTROL_BYTES: usize = 64;

#[repr(C, align(8))]
struct Control([u8; CONTROL_BYTES]);

/// A reading end of a [`Link`] that keeps a descriptor the peer passed along with its
/// bytes ([`send_with_fd`]) instead of letting the kernel discard it: the summation
/// server's reader, which may be handed a mailbox.
#[derive(Debug)]
pub struct Receiving<'a> {
    link: &'a Link,
    passed: Option<OwnedFd>,
}

impl<'a> Receiving<'a> {
    pub fn new(link: &'a Link) -> Receiving<'a> {
        Receiving { link, passed: None }
    }

    pub fn link(&self) -> &'a Link {
        self.link
    }

    /// The descriptor most recently passed, if any (taken: a second call gives `None`).
    pub fn take_passed(&mut self) -> Option<OwnedFd> {
        self.passed.take()
    }
}

impl Read for Receiving<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let Link::Local(stream) = self.link else {
            return (&*self.link).read(buf);
        };
        let mut control = Control([0u8; CONTROL_BYTES]);
        let mut iov = libc::iovec {
            iov_base: buf.as_mut_ptr().cast(),
            iov_len: buf.len(),
        };
        // SAFETY: as in send_with_fd: plain data, pointers into locals that outlive the call.
        let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
        msg.msg_iov = &mut iov;
        msg.msg_iovlen = 1;
        msg.msg_control = control.0.as_mut_ptr().cast();
        msg.msg_controllen = CONTROL_BYTES as _;
        // SAFETY: recvmsg into `buf` (its length given) and the control buffer; with
        // MSG_CMSG_CLOEXEC any descriptor received is close-on-exec.
        let got = unsafe { libc::recvmsg(stream.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC) };
        if got < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: the kernel filled `msg` and the control buffer; CMSG_FIRSTHDR and
        // CMSG_NXTHDR stay within msg_controllen, and each SCM_RIGHTS header's data holds
        // (cmsg_len - CMSG_LEN(0)) / 4 descriptors that are now ours.
        unsafe {
            let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
            while !cmsg.is_null() {
                if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                    let data = libc::CMSG_DATA(cmsg).cast::<libc::c_int>();
                    let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize)
                        / size_of::<libc::c_int>();
                    for i in 0..count {
                        // Owned even if unwanted, so that it is closed: only the last is kept.
                        let fd = OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i)));
                        self.passed = Some(fd);
                    }
                }
                cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
            }
        }
        Ok(got as usize)
    }
}

impl PayloadRead for Receiving<'_> {
    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self.link {
            Link::Tcp(s) => crate::low_water::read(s, buf),
            // A passed descriptor may come with a payload's first bytes.
            Link::Local(_) => self.read(buf),
        }
    }
}

impl PayloadRead for Link {
    fn read_payload(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => crate::low_water::read(s, buf),
            Link::Local(s) => (&*s).read(buf),
        }
    }
}

impl sumflow_wire::io::Timed for Link {
    fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        Link::set_read_timeout(self, timeout)
    }
}

impl Read for &Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).read(buf),
            Link::Local(s) => (&*s).read(buf),
        }
    }
}

impl Write for &Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).write(buf),
            Link::Local(s) => (&*s).write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        match self {
            Link::Tcp(s) => (&*s).write_vectored(bufs),
            Link::Local(s) => (&*s).write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_server_on_this_machine_is_reached_by_its_advertised_address_only() {
        let addr = format!("127.0.0.1:{}", std::process::id());
        let listener = listen_local(&addr).unwrap();
        assert!(listen_local(&addr).is_err(), "one server per name");
        let link = Link::Local(connect_local(&addr).expect("reachable on this machine"));
        assert!(link.is_local());
        let (mut served, _) = listener.accept().unwrap();
        (&link).write_all(b"frame").unwrap();
        let mut got = [0u8; 5];
        served.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"frame");
        link.shutdown(Shutdown::Both).unwrap();
        assert_eq!(served.read(&mut got).unwrap(), 0, "the end is seen");
        assert!(connect_local("127.0.0.1:1").is_none(), "no server there");
    }

    #[test]
    fn a_descriptor_passed_with_a_frame_is_kept_by_the_reader_only() {
        use std::fs::File;
        use std::os::fd::AsFd;
        let (a, b) = UnixStream::pair().unwrap();
        let file = tempfile_in_memory();
        (&file).write_all(b"shared").unwrap();
        send_with_fd(&a, b"frame bytes", file.as_fd()).unwrap();
        (&a).write_all(b" and more").unwrap();
        let link = Link::Local(b);
        let mut r = Receiving::new(&link);
        let mut got = vec![0u8; 20];
        r.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"frame bytes and more");
        let passed = File::from(r.take_passed().expect("the descriptor came along"));
        assert_eq!(passed.metadata().unwrap().len(), 6, "the same file");
        assert!(r.take_passed().is_none(), "taken once");
    }

    fn tempfile_in_memory() -> std::fs::File {
        // SAFETY: memfd_create with a NUL-terminated name; the descriptor is owned below.
        let raw = unsafe { libc::memfd_create(c"test".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(raw >= 0, "{}", io::Error::last_os_error());
        // SAFETY: a fresh descriptor that nothing else owns.
        std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) })
    }
}
