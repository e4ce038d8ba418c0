//! Reading a large buffer from TCP with one wake-up rather than one per burst of segments.
//!
//! A blocking `recv` returns as soon as any byte is there, so a thread reading a 512 KiB
//! partition at 1 Gbit/s sleeps and wakes once per burst that the link delivers: about
//! eight times per partition, each a context switch on a machine whose cores should sum.
//! The socket's low-water mark (`SO_RCVLOWAT`) makes the kernel wake a waiter only once
//! that many bytes are queued, so the thread sleeps until the rest of its buffer is there
//! and copies it in one call. gloo reaches a similar count with one epoll thread per
//! process; this keeps sumflow's one blocking reader per connection.
//!
//! The mark is raised only around a `poll` and lowered again before returning: a blocking
//! `recv` with a high mark would wait for the mark, not for what it asked, after it
//! copied part of the data. The kernel caps the mark at half the receive buffer (growing
//! an unlocked buffer to fit) and reports the socket readable regardless when its window
//! or memory runs short, so a mark above what can arrive cannot stall the reader.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;

/// Reads of at least this many bytes wait for the whole rest at once; a frame's header and
/// small replies are read as they come.
pub const WHOLE_READ_BYTES: usize = 32 << 10;

/// Reads into `buf`, which the peer is sending whole (a frame's payload), as `Read::read`
/// does, but when `buf` is large and not all of it is queued, sleeps until the rest (or
/// half the socket's receive buffer) has arrived and returns it together with what was
/// there: not for reads that take whatever comes. Honours the socket's read timeout
/// (`SO_RCVTIMEO`): what arrived by then, or `WouldBlock`, as a plain blocking read fails,
/// when nothing did.
pub fn read(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    if buf.len() < WHOLE_READ_BYTES {
        return io::Read::read(&mut &*stream, buf);
    }
    let mut got = 0;
    loop {
        match recv_now(stream, &mut buf[got..]) {
            // The end of the stream, or all of it.
            Ok(0) => return Ok(got),
            Ok(n) if got + n == buf.len() => return Ok(buf.len()),
            Ok(n) => got += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            // The connection failed: what was read of the buffer no longer matters.
            Err(e) => return Err(e),
        }
        if !wait_for(stream, buf.len() - got)? {
            // The timeout bounds a wait without any byte, as a plain read's does: bytes
            // that arrived short of the mark are progress.
            return match recv_now(stream, &mut buf[got..]) {
                Ok(n) => Ok(got + n),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock && got > 0 => Ok(got),
                Err(e) => Err(e),
            };
        }
    }
}

/// What is queued now, without waiting.
fn recv_now(stream: &TcpStream, buf: &mut [u8]) -> io::Result<usize> {
    // SAFETY: `buf` is valid for writes of its length for the duration of the call.
    let got = unsafe {
        libc::recv(
            stream.as_raw_fd(),
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_DONTWAIT,
        )
    };
    if got < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(got as usize)
}

/// Sleeps until `bytes` are queued (or the kernel says to read anyway); false when the
/// read timeout passed first.
fn wait_for(stream: &TcpStream, bytes: usize) -> io::Result<bool> {
    let timeout = match stream.read_timeout()? {
        // Rounded up: a timeout below a millisecond must not become "no wait".
        Some(t) => i32::try_from(t.as_nanos().div_ceil(1_000_000)).unwrap_or(i32::MAX),
        None => -1,
    };
    set_low_water(stream, i32::try_from(bytes).unwrap_or(i32::MAX))?;
    let mut fd = libc::pollfd {
        fd: stream.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ready = loop {
        // SAFETY: one valid pollfd, read and written by the kernel during the call.
        let n = unsafe { libc::poll(&mut fd, 1, timeout) };
        if n >= 0 {
            break Ok(n > 0);
        }
        let e = io::Error::last_os_error();
        if e.kind() != io::ErrorKind::Interrupted {
            break Err(e);
        }
    };
    // Lowered before anything else reads: see the module's note.
    set_low_water(stream, 1)?;
    ready
}

fn set_low_water(stream: &TcpStream, bytes: i32) -> io::Result<()> {
    // SAFETY: SO_RCVLOWAT takes an int, passed by pointer with its size.
    let rc = unsafe {
        libc::setsockopt(
            stream.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            std::ptr::from_ref(&bytes).cast(),
            size_of::<i32>() as libc::socklen_t,
        )
    };
    if rc < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::io::Write;
    use std::net::TcpListener;
    use std::thread;
    use std::time::{Duration, Instant};

    use super::*;

    fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let writer = TcpStream::connect(listener.local_addr().unwrap()).unwrap();
        let (reader, _) = listener.accept().unwrap();
        (reader, writer)
    }

    #[test]
    fn a_large_read_returns_the_whole_buffer_sent_in_bursts() {
        let (reader, mut writer) = pair();
        let sent: Vec<u8> = (0..256 << 10).map(|i: u32| (i % 251) as u8).collect();
        let bursts = sent.clone();
        let t = thread::spawn(move || {
            for chunk in bursts.chunks(16 << 10) {
                writer.write_all(chunk).unwrap();
                thread::sleep(Duration::from_millis(3));
            }
            writer
        });
        let mut buf = vec![0u8; sent.len()];
        // One call: a plain read would return the first burst.
        assert_eq!(read(&reader, &mut buf).unwrap(), sent.len());
        assert_eq!(buf, sent);
        drop(t.join().unwrap());
    }

    #[test]
    fn the_read_timeout_returns_what_arrived_or_would_block() {
        let (reader, mut writer) = pair();
        reader
            .set_read_timeout(Some(Duration::from_millis(50)))
            .unwrap();
        let mut buf = vec![0u8; 64 << 10];
        let started = Instant::now();
        let e = read(&reader, &mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        assert!(started.elapsed() >= Duration::from_millis(50));

        // Bytes short of the mark: handed over once the timeout passes.
        writer.write_all(&[7u8; 1000]).unwrap();
        thread::sleep(Duration::from_millis(10));
        writer.write_all(&[8u8; 1000]).unwrap();
        let mut got = 0;
        while got < 2000 {
            got += read(&reader, &mut buf[got..]).unwrap();
        }
        assert!(buf[..1000].iter().all(|&b| b == 7) && buf[1000..2000].iter().all(|&b| b == 8));
    }

    #[test]
    fn a_small_read_after_a_large_one_is_not_held_by_the_mark() {
        let (reader, mut writer) = pair();
        reader
            .set_read_timeout(Some(Duration::from_secs(5)))
            .unwrap();
        let t = thread::spawn(move || {
            // The second half comes late, so the large read raises the mark to wait for it.
            writer.write_all(&[1u8; 20 << 10]).unwrap();
            thread::sleep(Duration::from_millis(30));
            writer.write_all(&[1u8; 20 << 10]).unwrap();
            // Sent while the small read below already sleeps.
            thread::sleep(Duration::from_millis(100));
            writer.write_all(&[2u8; 10]).unwrap();
            writer
        });
        let mut big = vec![0u8; 40 << 10];
        let mut got = 0;
        while got < big.len() {
            got += read(&reader, &mut big[got..]).unwrap();
        }
        // With the mark left at 20 KiB, the kernel would not wake this read for 10 bytes.
        let started = Instant::now();
        let mut small = [0u8; 10];
        assert_eq!(read(&reader, &mut small).unwrap(), 10);
        assert_eq!(small, [2u8; 10]);
        assert!(started.elapsed() < Duration::from_secs(2));
        drop(t.join().unwrap());
    }

    #[test]
    fn the_end_of_the_stream_ends_a_large_read_with_what_came() {
        let (reader, mut writer) = pair();
        writer.write_all(&[5u8; 100]).unwrap();
        drop(writer);
        let mut buf = vec![0u8; 64 << 10];
        let mut got = 0;
        loop {
            match read(&reader, &mut buf[got..]).unwrap() {
                0 => break,
                n => got += n,
            }
        }
        assert_eq!(got, 100);
    }
}
