//! A summation server's connection handler fed an arbitrary stream of frames by an
//! authenticated worker: mostly well-formed frames (key declarations, pushes with payloads,
//! pulls, retires, joins, heartbeats) built from the input, with arbitrary bytes between
//! them. Whatever comes, the server must not panic (a panic on any thread aborts), must
//! answer only with frames that decode, must end the connection once the worker has sent
//! everything and hung up, and must then stop when asked. A real server runs behind it
//! (engines and all, one worker, so that rounds complete and sums come back), on loopback.
#![no_main]

use std::io::{Read, Write};
use std::net::{Shutdown, TcpStream};
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use sumflow_summation::{ServerConfig, SummationService};
use sumflow_wire::io::{connect, FrameReader, Peer};
use sumflow_wire::{
    Codec, Dtype, JobToken, KeyCodec, KeyInit, Message, PushMode, ReduceOp, Role, Service,
    WireError,
};

/// A server that neither answers nor closes for this long after the worker hung up hangs.
const HANG: Duration = Duration::from_secs(10);
const MAX_BODY: u32 = 64 << 10;

/// Reads the input a byte at a time; zeros once it is used up.
struct Input<'a>(&'a [u8]);

impl Input<'_> {
    fn byte(&mut self) -> u8 {
        match self.0 {
            [b, rest @ ..] => {
                self.0 = rest;
                *b
            }
            [] => 0,
        }
    }

    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.0.len());
        let (taken, rest) = self.0.split_at(n);
        self.0 = rest;
        taken.to_vec()
    }

    fn key(&mut self) -> u64 {
        u64::from(self.byte() % 4) << 32 | u64::from(self.byte() % 2)
    }

    fn dtype(&mut self) -> Dtype {
        let b = self.byte();
        Dtype::from_code(b % 12).unwrap_or(Dtype::F32)
    }

    fn codec(&mut self) -> KeyCodec {
        let b = self.byte();
        match Codec::from_code(b % 6) {
            Some(codec) if codec != Codec::Raw => KeyCodec {
                codec,
                param: u32::from(self.byte() % 8),
                feedback: b & 0x80 != 0,
            },
            _ => KeyCodec::RAW,
        }
    }
}

/// The worker's side of the conversation: frames built from the input, and raw bytes.
fn stream_of(mut input: Input<'_>) -> Vec<u8> {
    let mut out = Vec::new();
    while !input.0.is_empty() {
        let msg = match input.byte() % 8 {
            0 => {
                let init = match input.byte() % 3 {
                    0 => KeyInit::Zeros,
                    1 => KeyInit::Value,
                    _ => KeyInit::Members(vec![u32::from(input.byte() % 2)]),
                };
                let byte_len = u64::from(input.byte()) * 4;
                let payload = if init == KeyInit::Value {
                    vec![input.byte(); byte_len as usize]
                } else {
                    Vec::new()
                };
                let msg = Message::InitKey {
                    key: input.key(),
                    dtype: input.dtype(),
                    byte_len,
                    init,
                    codec: input.codec(),
                };
                out.extend(msg.encode_with_payload(&payload));
                continue;
            }
            1 | 2 => {
                let mode = match input.byte() % 5 {
                    0 => PushMode::Skip,
                    1 => PushMode::Delta { staleness: None },
                    2 => PushMode::Delta {
                        staleness: Some(u32::from(input.byte() % 3)),
                    },
                    _ => PushMode::Sum,
                };
                let msg = Message::Push {
                    key: input.key(),
                    round: u64::from(input.byte() % 4),
                    dtype: input.dtype(),
                    codec: Codec::from_code(input.byte() % 6).unwrap_or(Codec::Raw),
                    mode,
                    op: ReduceOp::from_code(input.byte() % 5).unwrap_or(ReduceOp::Sum),
                };
                let len = usize::from(input.byte()) * 4;
                let payload = if mode == PushMode::Skip { Vec::new() } else { input.bytes(len) };
                out.extend(msg.encode_with_payload(&payload));
                continue;
            }
            3 => Message::Pull {
                key: input.key(),
                round: u64::from(input.byte() % 4),
                wants_sum: input.byte() % 2 == 0,
            },
            4 => Message::Retire { key: input.key() },
            5 => Message::Join {
                joined: input.byte() % 2 == 0,
            },
            6 => Message::Heartbeat {
                seq: u64::from(input.byte()),
            },
            _ => {
                let n = usize::from(input.byte() % 32);
                out.extend(input.bytes(n));
                continue;
            }
        };
        out.extend(msg.encode(0));
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let token = JobToken::new("a-fuzzed-job-token-0123456789").unwrap();
    let mut cfg = ServerConfig::standalone(1, token.clone());
    cfg.settings.max_body = MAX_BODY;
    cfg.settings.handshake_timeout = Duration::from_secs(2);
    cfg.settings.write_timeout = Duration::from_secs(2);
    cfg.settings.stall_warning = None;
    cfg.max_key_memory = Some(16 << 20);
    let server = SummationService::start(cfg).expect("server starts");
    let mut stream = TcpStream::connect(server.local_addr()).expect("connect");
    let me = Peer {
        role: Role::Worker,
        rank: Some(0),
        name: "fuzzed worker".into(),
    };
    connect(&mut stream, &token, Service::Summation, &me).expect("handshake");

    // Writes from a thread of its own: the server's replies must be read meanwhile, or
    // both sides could block on full socket buffers.
    let bytes = stream_of(Input(data));
    let mut tx = stream.try_clone().expect("clone");
    let writer = std::thread::spawn(move || {
        let _ = tx.write_all(&bytes);
        let _ = tx.shutdown(Shutdown::Write);
    });
    stream.set_read_timeout(Some(HANG)).unwrap();
    let mut replies = FrameReader::new(&mut stream, u32::MAX);
    loop {
        match replies.read_owned() {
            Ok(_) => {}
            // Closed or reset (a refused connection, before the worker finished writing).
            Err(WireError::Closed | WireError::Io(_)) => break,
            Err(WireError::Timeout { .. }) => panic!(
                "the server neither answered nor closed within {HANG:?} of the worker hanging up"
            ),
            Err(e) => panic!("the server sent a frame that does not decode: {e}"),
        }
    }
    writer.join().unwrap();
    let mut rest = Vec::new();
    let _ = stream.read_to_end(&mut rest);
    server.shutdown();
    server.wait();
});
