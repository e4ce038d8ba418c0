//! The coordinator's membership state machine driven by arbitrary events: connections
//! from workers and servers, decoded frames from them, disconnections and the clock. No
//! sequence may panic it, and it never sends to a connection it has not seen.
#![no_main]

use std::collections::HashSet;
use std::time::{Duration, Instant};

use libfuzzer_sys::fuzz_target;
use sumflow_coordinator::membership::{Action, Membership};
use sumflow_coordinator::CoordinatorConfig;
use sumflow_wire::io::Peer;
use sumflow_wire::message::decode_frame;
use sumflow_wire::{JobToken, Role};

const MAX_BODY: u32 = 1 << 12;

fuzz_target!(|data: &[u8]| {
    let token = JobToken::new("a-fuzzed-job-token-0123456789").unwrap();
    let cfg = CoordinatorConfig::new("127.0.0.1:0".parse().unwrap(), 3, 1, token);
    let mut now = Instant::now();
    let mut core = Membership::new(&cfg, now);
    let mut seen: HashSet<u64> = HashSet::new();
    let mut rest = data;
    while let [op, conn, tail @ ..] = rest {
        let conn = u64::from(conn % 8);
        rest = tail;
        let actions = match op % 5 {
            0 => {
                seen.insert(conn);
                let role = if op & 0x80 == 0 { Role::Worker } else { Role::Server };
                let rank = (op & 0x40 == 0).then_some(u32::from(op >> 3 & 3));
                let peer = Peer {
                    role,
                    rank,
                    name: format!("node {conn}"),
                };
                core.connected(conn, peer, now)
            }
            1 | 2 => match decode_frame(rest, MAX_BODY) {
                Ok(Some(frame)) => {
                    rest = &rest[frame.consumed..];
                    core.message(conn, frame.message, now)
                }
                _ => continue,
            },
            3 => core.disconnected(conn, "fuzzed disconnection"),
            _ => {
                now += Duration::from_millis(u64::from(*op) * 50);
                core.tick(now)
            }
        };
        for action in actions {
            if let Action::Send(to, _) | Action::Close(to) = action {
                assert!(seen.contains(&to), "acted on connection {to}, never seen");
            }
        }
    }
});
