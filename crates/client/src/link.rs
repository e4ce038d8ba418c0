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
use std::os::linux::net::SocketAddrExt;
use std::os::unix::net::{SocketAddr, UnixListener, UnixStream};
use std::time::Duration;

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
}
