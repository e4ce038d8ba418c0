//! Arbitrary bytes as the other side of the job-token handshake, on both ends: the
//! service's `accept` reading a client and a client's `connect` reading a service. Neither
//! may panic, allocate past the handshake's frame limit or accept a peer that cannot prove
//! the token (random bytes never can).
#![no_main]

use std::io::{self, Cursor, Read, Write};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sumflow_wire::io::{accept, connect, Peer, Timed};
use sumflow_wire::message::Service;
use sumflow_wire::{JobToken, Role};

/// The peer's bytes to read, and a sink for what we write.
struct Scripted {
    input: Cursor<Vec<u8>>,
}

impl Read for Scripted {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.input.read(buf)
    }
}

impl Write for Scripted {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Timed for Scripted {
    fn set_read_timeout(&self, _: Option<Duration>) -> io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let token = JobToken::new("a-fuzzed-job-token-0123456789").unwrap();
    let mut client = Scripted {
        input: Cursor::new(data.to_vec()),
    };
    let accepted = accept(
        &mut client,
        &token,
        Service::Summation,
        Duration::from_secs(1),
        |_| Ok(()),
    );
    assert!(accepted.is_err(), "a peer without the token was admitted");
    let mut service = Scripted {
        input: Cursor::new(data.to_vec()),
    };
    let me = Peer {
        role: Role::Worker,
        rank: Some(0),
        name: "fuzzed worker".into(),
    };
    let connected = connect(&mut service, &token, Service::Coordinator, &me);
    assert!(connected.is_err(), "a service without the token was trusted");
});
