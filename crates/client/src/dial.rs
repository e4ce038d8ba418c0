//! Connecting to a peer that may not be listening yet.

use std::io::ErrorKind;
use std::net::{TcpStream, ToSocketAddrs};
use std::thread;
use std::time::{Duration, Instant};

use tracing::debug;

use crate::error::{ClientError, Result};

/// Longest single connection attempt.
const CONNECT_ATTEMPT: Duration = Duration::from_secs(2);
/// Longest pause between attempts.
const MAX_RETRY_DELAY: Duration = Duration::from_secs(1);

/// Connects to `addr`, retrying with backoff until `timeout` has passed: in a job, peers
/// start in any order.
pub fn connect_retrying(addr: &str, service: &'static str, timeout: Duration) -> Result<TcpStream> {
    let deadline = Instant::now() + timeout;
    let mut delay = Duration::from_millis(50);
    loop {
        let err = match try_connect(addr, deadline) {
            Ok(s) => return Ok(s),
            Err(e) => e,
        };
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() || err.kind() == ErrorKind::InvalidInput {
            return Err(ClientError::Connect {
                service,
                addr: addr.to_string(),
                source: err,
            });
        }
        debug!("{service} at {addr} not reachable yet ({err}); retrying");
        thread::sleep(delay.min(left));
        delay = (delay * 2).min(MAX_RETRY_DELAY);
    }
}

fn try_connect(addr: &str, deadline: Instant) -> std::io::Result<TcpStream> {
    let mut last = std::io::Error::new(ErrorKind::NotFound, "the address resolved to nothing");
    for sa in addr.to_socket_addrs()? {
        let left = deadline.saturating_duration_since(Instant::now());
        let attempt = left.clamp(Duration::from_millis(1), CONNECT_ATTEMPT);
        match TcpStream::connect_timeout(&sa, attempt) {
            Ok(s) => return Ok(s),
            Err(e) => last = e,
        }
    }
    Err(last)
}
