//! The summation server over real TCP on 127.0.0.1: sums, rounds, and every refusal.

use std::collections::HashMap;
use std::thread;
use std::time::Duration;

use half::{bf16, f16};
use sumflow_client::server::Pushed;
use sumflow_client::{ClientError, Pulled, Reply, ServerClient, ServerOptions};
use sumflow_summation::{ServerConfig, ServerHandle, SummationService, MAX_CONNECTIONS_PER_WORKER};
use sumflow_wire::frame::Header;
use sumflow_wire::{Codec, Dtype, ErrorCode, JobToken, Lent, Message, Op, PushMode};

fn token() -> JobToken {
    JobToken::new("summation-test-token-0123456789").unwrap()
}

fn start(workers: u32, engines: usize) -> (ServerHandle, String) {
    let mut cfg = ServerConfig::standalone(workers, token());
    cfg.engine_threads = engines;
    cfg.settings.max_body = 1 << 20;
    let h = SummationService::start(cfg).unwrap();
    let addr = h.local_addr().to_string();
    (h, addr)
}

fn opts() -> ServerOptions {
    ServerOptions {
        connect_timeout: Duration::from_secs(5),
        reply_timeout: Some(Duration::from_secs(10)),
        max_body: 1 << 20,
        machine_local: true,
        mailbox: true,
    }
}

fn worker(addr: &str, rank: u32) -> ServerClient {
    worker_over(addr, rank, true)
}

/// A worker reaching the server through its machine-local socket, or through TCP.
fn worker_over(addr: &str, rank: u32, machine_local: bool) -> ServerClient {
    let c = ServerClient::connect(
        addr,
        &token(),
        rank,
        &format!("test worker {rank}"),
        &ServerOptions {
            machine_local,
            ..opts()
        },
    )
    .unwrap();
    assert_eq!(
        c.is_machine_local(),
        machine_local,
        "the transport asked for"
    );
    assert_eq!(
        c.has_mailbox(),
        machine_local,
        "payloads to a server on this machine pass through shared memory"
    );
    c
}

fn stop(h: ServerHandle) {
    h.shutdown();
    h.wait();
}

/// Small integers are exact in every dtype, so every sum can be checked exactly.
fn value(key: u64, round: u64, worker: u32, i: usize) -> i64 {
    ((key * 7 + round * 13 + worker as u64 * 31 + i as u64) % 17) as i64 - 8
}

fn encode(dtype: Dtype, vals: impl Iterator<Item = i64>) -> Vec<u8> {
    let mut out = Vec::new();
    for v in vals {
        match dtype {
            Dtype::F32 => out.extend_from_slice(&(v as f32).to_le_bytes()),
            Dtype::F64 => out.extend_from_slice(&(v as f64).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&f16::from_f64(v as f64).to_le_bytes()),
            Dtype::Bf16 => out.extend_from_slice(&bf16::from_f64(v as f64).to_le_bytes()),
            Dtype::I32 => out.extend_from_slice(&(v as i32).to_le_bytes()),
            Dtype::I64 => out.extend_from_slice(&v.to_le_bytes()),
        }
    }
    out
}

fn expect_refused(err: ClientError, code: ErrorCode, needle: &str) {
    match &err {
        ClientError::Remote {
            code: c, message, ..
        } => {
            assert_eq!(*c, code, "{err}");
            assert!(message.contains(needle), "'{message}' lacks '{needle}'");
        }
        other => panic!("expected a {code} refusal, got {other}"),
    }
}

/// After a refusal the server closes the connection.
fn expect_closed(c: &mut ServerClient) {
    match c.rx.recv() {
        Err(ClientError::PeerLost { .. }) | Err(ClientError::Wire { .. }) => {}
        other => panic!("connection should be closed, got {other:?}"),
    }
}

#[test]
fn workers_keys_rounds_sum_exactly_in_every_dtype() {
    let keys: Vec<(u64, Dtype, usize)> = vec![
        (0, Dtype::I32, 1),
        (1, Dtype::I64, 1000),
        (2, Dtype::F32, 4099),
        (3, Dtype::F16, 333),
        (4, Dtype::Bf16, 4096),
        (5, Dtype::F64, 77),
        (1 << 40, Dtype::I32, 70_001),
    ];
    for (workers, engines) in [(1u32, 1usize), (3, 2), (4, 3)] {
        let (h, addr) = start(workers, engines);
        let rounds = 6;
        let threads: Vec<_> = (0..workers)
            .map(|w| {
                let addr = addr.clone();
                let keys = keys.clone();
                thread::spawn(move || {
                    // Even workers through the machine-local socket, odd ones through TCP:
                    // both transports, and a job that mixes them.
                    let mut c = worker_over(&addr, w, w % 2 == 0);
                    for &(k, d, n) in &keys {
                        c.init_key(k, d, (n * d.size()) as u64, None).unwrap();
                    }
                    for r in 1..=rounds {
                        // Pipelined: every push first, then every pull.
                        for &(k, d, n) in &keys {
                            let data = encode(d, (0..n).map(|i| value(k, r, w, i)));
                            c.tx.push(k, r, d, &data).unwrap();
                        }
                        for &(k, _, _) in &keys {
                            c.tx.pull(k, r, true).unwrap();
                        }
                        let mut got = Vec::new();
                        for _ in &keys {
                            match c.rx.recv().unwrap() {
                                Reply::Sum(p) => got.push(p),
                                other => panic!("unexpected {other:?}"),
                            }
                        }
                        got.sort_by_key(|p| p.key);
                        let mut want: Vec<_> = keys
                            .iter()
                            .map(|&(k, d, n)| Pulled {
                                key: k,
                                round: r,
                                dtype: d,
                                data: encode(
                                    d,
                                    (0..n).map(|i| (0..workers).map(|w| value(k, r, w, i)).sum()),
                                ),
                            })
                            .collect();
                        want.sort_by_key(|p| p.key);
                        assert_eq!(got, want, "worker {w} round {r}");
                    }
                    c.shutdown("done").unwrap();
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        stop(h);
    }
}

#[test]
fn sixteen_bit_sums_are_rounded_once_from_f32() {
    // In f16, 2048 + 1 rounds back to 2048, so summing in f16 gives 2048 at every step;
    // the f32 sum 2051 rounds (ties to even) to 2052.
    let (h, addr) = start(4, 1);
    let threads: Vec<_> = (0..4u32)
        .map(|w| {
            let addr = addr.clone();
            thread::spawn(move || {
                let mut c = worker(&addr, w);
                c.init_key(9, Dtype::F16, 2, None).unwrap();
                let v = if w == 0 { 2048.0 } else { 1.0 };
                let p = c
                    .push_pull(9, 1, Dtype::F16, &f16::from_f32(v).to_le_bytes())
                    .unwrap();
                f16::from_le_bytes([p.data[0], p.data[1]]).to_f32()
            })
        })
        .collect();
    for t in threads {
        assert_eq!(t.join().unwrap(), 2052.0);
    }
    stop(h);
}

#[test]
fn initial_value_is_served_as_round_zero() {
    let (h, addr) = start(2, 1);
    let init = encode(Dtype::I64, [5, -6, 7].into_iter());
    let mut a = worker(&addr, 0);
    let mut b = worker(&addr, 1);
    a.init_key(3, Dtype::I64, 24, Some(&init)).unwrap();
    b.init_key(3, Dtype::I64, 24, None).unwrap();
    assert_eq!(a.pull(3, 0).unwrap().data, init);
    assert_eq!(b.pull(3, 0).unwrap().data, init);
    stop(h);
}

/// Asynchronous training (BytePS §4.3): each worker's delta is added to the stored value
/// at once, and its pull returns the value with every delta so far; under a staleness
/// bound of 0 a pull waits for every worker's delta of its round.
#[test]
fn deltas_update_the_stored_value_at_once() {
    let (h, addr) = start(2, 1);
    let init = encode(Dtype::I32, [100, 200].into_iter());
    let mut a = worker(&addr, 0);
    let mut b = worker(&addr, 1);
    for c in [&mut a, &mut b] {
        for key in [1, 2] {
            c.init_key(key, Dtype::I32, 8, Some(&init)).unwrap();
        }
    }
    let delta = encode(Dtype::I32, [1, 2].into_iter());
    let sum = (Dtype::I32, sumflow_wire::ReduceOp::Sum);
    let stored = |c: &mut ServerClient| match c.rx.recv().unwrap() {
        Reply::Sum(p) => p.data,
        other => panic!("expected the stored value, got {other:?}"),
    };
    // Unbounded: worker 0 runs two rounds ahead of worker 1.
    for round in 1..=2 {
        let d = Pushed::Delta(&delta, None);
        a.tx.push_and_pull(1, round, sum, d, true, &[]).unwrap();
        let want = encode(
            Dtype::I32,
            [100 + round as i64, 200 + 2 * round as i64].into_iter(),
        );
        assert_eq!(stored(&mut a), want);
    }
    b.tx.push_and_pull(1, 1, sum, Pushed::Delta(&delta, None), true, &[])
        .unwrap();
    assert_eq!(stored(&mut b), encode(Dtype::I32, [103, 206].into_iter()));
    // Staleness 0: worker 0's round 1 waits for worker 1's.
    a.tx.push_and_pull(2, 1, sum, Pushed::Delta(&delta, Some(0)), true, &[])
        .unwrap();
    let waiting = thread::spawn(move || (stored(&mut a), a));
    thread::sleep(Duration::from_millis(200));
    assert!(
        !waiting.is_finished(),
        "the pull must wait for worker 1's delta"
    );
    b.tx.push_and_pull(2, 1, sum, Pushed::Delta(&delta, Some(0)), true, &[])
        .unwrap();
    let both = encode(Dtype::I32, [102, 204].into_iter());
    assert_eq!(stored(&mut b), both);
    assert_eq!(waiting.join().unwrap().0, both);
    stop(h);
}

#[test]
fn an_early_pull_waits_for_the_last_push() {
    let (h, addr) = start(2, 1);
    let mut a = worker(&addr, 0);
    let mut b = worker(&addr, 1);
    a.init_key(1, Dtype::I32, 4, None).unwrap();
    b.init_key(1, Dtype::I32, 4, None).unwrap();
    a.tx.push(1, 1, Dtype::I32, &3i32.to_le_bytes()).unwrap();
    a.tx.pull(1, 1, true).unwrap();
    let waiting = thread::spawn(move || (a.rx.recv(), a));
    thread::sleep(Duration::from_millis(200));
    assert!(!waiting.is_finished(), "the pull must wait for worker 1");
    let p = b.push_pull(1, 1, Dtype::I32, &4i32.to_le_bytes()).unwrap();
    assert_eq!(p.data, 7i32.to_le_bytes());
    let (got, _a) = waiting.join().unwrap();
    assert!(matches!(got.unwrap(), Reply::Sum(p) if p.data == 7i32.to_le_bytes()));
    stop(h);
}

#[test]
fn sums_a_socket_cannot_take_at_once_arrive_whole_and_in_order() {
    // Far more sum bytes than loopback's socket buffers hold, answered while worker 0
    // reads nothing: the thread completing each round writes what the socket takes and
    // the connection's writer finishes the rest before anything else (outbox.rs).
    const KEYS: u64 = 24;
    const ELEMENTS: usize = 200_000;
    let (h, addr) = start(2, 1);
    let mut a = worker_over(&addr, 0, false);
    let mut b = worker_over(&addr, 1, false);
    let data = |key: u64, round: u64, worker: u32| {
        encode(
            Dtype::I32,
            (0..ELEMENTS).map(|i| value(key, round, worker, i)),
        )
    };
    let sum = |key: u64, round: u64| {
        encode(
            Dtype::I32,
            (0..ELEMENTS).map(|i| value(key, round, 0, i) + value(key, round, 1, i)),
        )
    };
    let bytes = (ELEMENTS * 4) as u64;
    for key in 1..=KEYS {
        a.init_key(key, Dtype::I32, bytes, None).unwrap();
        b.init_key(key, Dtype::I32, bytes, None).unwrap();
    }
    for key in 1..=KEYS {
        a.tx.push(key, 1, Dtype::I32, &data(key, 1, 0)).unwrap();
        a.tx.pull(key, 1, true).unwrap();
    }
    for key in 1..=KEYS {
        let p = b.push_pull(key, 1, Dtype::I32, &data(key, 1, 1)).unwrap();
        assert!(p.data == sum(key, 1), "worker 1's sum of key {key}");
    }
    // Worker 0's replies: the acknowledgements, then every sum, whole and in order.
    for key in 1..=KEYS {
        assert_eq!(
            a.rx.recv_header().unwrap(),
            Reply::PushAck { key, round: 1 }
        );
    }
    for key in 1..=KEYS {
        match a.rx.recv().unwrap() {
            Reply::Sum(p) => {
                assert_eq!((p.key, p.round), (key, 1));
                assert!(p.data == sum(key, 1), "worker 0's sum of key {key}");
            }
            _ => panic!("expected the sum of key {key}"),
        }
    }
    // The stream goes on intact.
    let b_side = thread::spawn(move || b.push_pull(1, 2, Dtype::I32, &data(1, 2, 1)));
    let p = a.push_pull(1, 2, Dtype::I32, &data(1, 2, 0)).unwrap();
    assert!(p.data == sum(1, 2));
    assert!(b_side.join().unwrap().unwrap().data == sum(1, 2));
    stop(h);
}

#[test]
fn sums_are_read_in_place_skipped_or_refused_when_their_length_is_wrong() {
    let (h, addr) = start(1, 1);
    let mut a = worker(&addr, 0);
    a.init_key(1, Dtype::I32, 8, None).unwrap();
    let mut tensor = [0u8; 8];
    for round in 1..=3u64 {
        let pushed = encode(Dtype::I32, [round as i64, -1].into_iter());
        a.tx.push(1, round, Dtype::I32, &pushed).unwrap();
        a.tx.pull(1, round, true).unwrap();
        assert_eq!(
            a.rx.recv_header().unwrap(),
            Reply::PushAck { key: 1, round },
            "a push is acknowledged on receipt"
        );
        let head = match a.rx.recv_header().unwrap() {
            Reply::Sum(head) => head,
            other => panic!("expected a sum, got {other:?}"),
        };
        assert_eq!((head.key, head.round, head.len), (1, round, 8));
        match round {
            1 => {
                a.rx.read_sum(&mut tensor).unwrap();
                assert_eq!(
                    tensor[..],
                    pushed[..],
                    "read straight into the caller's bytes"
                );
            }
            2 => a.rx.skip_sum().unwrap(),
            _ => {
                let e = a.rx.read_sum(&mut [0u8; 4]).unwrap_err();
                assert!(
                    matches!(&e, ClientError::Protocol { what, .. } if what.contains("8 bytes")),
                    "{e}"
                );
            }
        }
    }
    stop(h);
}

/// A lent push of i32 key 1 whose payload is said to lie at `lent`.
fn lent_push(round: u64, lent: Lent) -> Vec<u8> {
    Message::Push {
        key: 1,
        round,
        dtype: Dtype::I32,
        codec: Codec::Raw,
        mode: PushMode::Sum,
        op: sumflow_wire::ReduceOp::Sum,
    }
    .encode_lent(lent)
}

/// Each refusal: the culprit gets a typed error naming the problem and is disconnected.
#[test]
fn every_invalid_request_is_refused_by_name_and_closes_the_connection() {
    type Case = (&'static str, ErrorCode, &'static str, fn(&mut ServerClient));
    let cases: Vec<Case> = vec![
        ("unknown op", ErrorCode::UnknownOp, "unknown op", |c| {
            let mut h = Header {
                op: Op::Pull,
                body_len: 0,
                lent: false,
            }
            .encode();
            h[5] = 0x7e;
            c.tx.send_bytes(&h).unwrap();
        }),
        (
            "bad version",
            ErrorCode::UnsupportedVersion,
            "version 9",
            |c| {
                let mut h = Header {
                    op: Op::Pull,
                    body_len: 16,
                    lent: false,
                }
                .encode();
                h[4] = 9;
                c.tx.send_bytes(&h).unwrap();
            },
        ),
        (
            "frame too large",
            ErrorCode::FrameTooLarge,
            "exceeds",
            |c| {
                let h = Header {
                    op: Op::Push,
                    body_len: (1 << 20) + 1,
                    lent: false,
                }
                .encode();
                c.tx.send_bytes(&h).unwrap();
            },
        ),
        ("malformed body", ErrorCode::BadFrame, "dtype", |c| {
            let mut f = Message::Push {
                key: 1,
                round: 1,
                dtype: Dtype::I32,
                codec: Codec::Raw,
                mode: PushMode::Sum,
                op: sumflow_wire::ReduceOp::Sum,
            }
            .encode_with_payload(&[0; 4]);
            f[12 + 16] = 77;
            c.tx.send_bytes(&f).unwrap();
        }),
        ("uninitialised key", ErrorCode::UnknownKey, "key 42", |c| {
            c.tx.push(42, 1, Dtype::I32, &[0; 4]).unwrap();
        }),
        (
            "dtype mismatch",
            ErrorCode::KeyMismatch,
            "declared as i32",
            |c| {
                c.tx.push(1, 1, Dtype::F32, &[0; 16]).unwrap();
            },
        ),
        (
            "length mismatch",
            ErrorCode::KeyMismatch,
            "i32 x 3 elements",
            |c| {
                c.tx.push(1, 1, Dtype::I32, &[0; 12]).unwrap();
            },
        ),
        (
            "round out of sequence",
            ErrorCode::RoundOutOfSequence,
            "expected round 1",
            |c| {
                c.tx.push(1, 2, Dtype::I32, &[0; 16]).unwrap();
            },
        ),
        (
            "second push in a round",
            ErrorCode::DuplicatePush,
            "pushed round 1 twice",
            |c| {
                c.tx.push(1, 1, Dtype::I32, &[0; 16]).unwrap();
                c.tx.push(1, 1, Dtype::I32, &[0; 16]).unwrap();
            },
        ),
        (
            "pull before push",
            ErrorCode::RoundOutOfSequence,
            "has not pushed round 1",
            |c| {
                c.tx.pull(1, 1, true).unwrap();
            },
        ),
        (
            "declaration mismatch",
            ErrorCode::KeyMismatch,
            "same dtype and size",
            |c| {
                c.tx.init_key(1, Dtype::I64, 16, None).unwrap();
            },
        ),
        (
            "lent push in a slot the worker did not lend",
            ErrorCode::BadFrame,
            "Push slot 5 was named in a lent frame but not lent",
            |c| {
                c.tx.send_bytes(&lent_push(1, Lent { slot: 5, len: 16 }))
                    .unwrap();
            },
        ),
        (
            "lent push outside the mailbox",
            ErrorCode::BadFrame,
            "Push slot 99 is outside the mailbox's 8",
            |c| {
                c.tx.send_bytes(&lent_push(1, Lent { slot: 99, len: 16 }))
                    .unwrap();
            },
        ),
        (
            "lent push of another length",
            ErrorCode::KeyMismatch,
            "i32 x 3 elements",
            |c| {
                c.tx.send_bytes(&lent_push(1, Lent { slot: 0, len: 12 }))
                    .unwrap();
            },
        ),
        (
            "skips naming the sender",
            ErrorCode::BadRank,
            "naming worker 0, itself",
            |c| {
                let skips = Message::Skips {
                    key: 1,
                    round: 1,
                    op: sumflow_wire::ReduceOp::Sum,
                    workers: vec![0],
                };
                c.tx.send_raw(&skips, &[]).unwrap();
            },
        ),
        (
            "skips naming a worker the job lacks",
            ErrorCode::BadRank,
            "a job of 2 workers has no rank 5",
            |c| {
                let skips = Message::Skips {
                    key: 1,
                    round: 1,
                    op: sumflow_wire::ReduceOp::Sum,
                    workers: vec![1, 5],
                };
                c.tx.send_raw(&skips, &[]).unwrap();
            },
        ),
        (
            "op meant for the coordinator",
            ErrorCode::UnexpectedOp,
            "Barrier",
            |c| {
                c.tx.send_raw(
                    &Message::Barrier {
                        id: 1,
                        group: sumflow_wire::BarrierGroup::All,
                    },
                    &[],
                )
                .unwrap();
            },
        ),
    ];
    for (name, code, needle, misbehave) in cases {
        let (h, addr) = start(2, 1);
        let mut bad = worker(&addr, 0);
        bad.init_key(1, Dtype::I32, 16, None).unwrap();
        let mut good = worker(&addr, 1);
        good.init_key(1, Dtype::I32, 16, None).unwrap();
        // The other worker is waiting for a round the culprit will never finish.
        good.tx.push(1, 1, Dtype::I32, &[1; 16]).unwrap();
        good.tx.pull(1, 1, true).unwrap();
        misbehave(&mut bad);
        let err = bad.rx.recv().expect_err(name);
        expect_refused(err, code, needle);
        expect_closed(&mut bad);
        // The server goes on serving: the waiting worker is told who broke its round. (A
        // culprit's first, valid push may have completed round 1; round 2 then breaks.)
        let err = match good.rx.recv() {
            Ok(Reply::Sum(p)) => {
                assert_eq!(p.round, 1, "{name}");
                good.push_pull(1, 2, Dtype::I32, &[1; 16]).expect_err(name)
            }
            other => other.expect_err(name),
        };
        match &err {
            ClientError::Remote {
                code: ErrorCode::NodeFailed,
                message,
                ..
            } => {
                assert!(
                    message.contains("worker 0 (test worker 0)"),
                    "{name}: {message}"
                );
            }
            other => panic!("{name}: expected NodeFailed, got {other}"),
        }
        // Each request gets one reply: a push that arrived after the culprit left is
        // refused too. Then the server still answers.
        good.tx
            .send_raw(&Message::Heartbeat { seq: 7 }, &[])
            .unwrap();
        loop {
            match good.rx.recv() {
                Ok(Reply::HeartbeatAck { seq: 7 }) => break,
                Err(e) if e.code() == ErrorCode::NodeFailed => {}
                other => panic!("{name}: unexpected {other:?}"),
            }
        }
        stop(h);
    }
}

/// Payloads to a server on the worker's machine pass through the mailbox both ways, and
/// sum exactly with those of a worker on TCP; slots come back round after round.
#[test]
fn payloads_pass_through_the_mailbox_and_sum_with_those_on_tcp() {
    let (h, addr) = start(2, 2);
    let mut local = worker(&addr, 0);
    let mut remote = worker_over(&addr, 1, false);
    // 64 KiB keys, more of them than slots (8 push, 4 pull), pushed before any is pulled.
    let n = 16 * 1024;
    let keys: Vec<u64> = (1..=12).collect();
    for c in [&mut local, &mut remote] {
        for &k in &keys {
            c.init_key(k, Dtype::I32, 4 * n as u64, None).unwrap();
        }
    }
    let rounds = 5;
    for r in 1..=rounds {
        for (w, c) in [&mut local, &mut remote].into_iter().enumerate() {
            for &k in &keys {
                let data = encode(Dtype::I32, (0..n).map(|i| value(k, r, w as u32, i)));
                c.tx.push(k, r, Dtype::I32, &data).unwrap();
                c.tx.pull(k, r, true).unwrap();
            }
        }
        for (w, c) in [&mut local, &mut remote].into_iter().enumerate() {
            for _ in &keys {
                let Reply::Sum(p) = c.rx.recv().unwrap() else {
                    panic!("worker {w}: a sum expected")
                };
                let want = encode(
                    Dtype::I32,
                    (0..n).map(|i| value(p.key, r, 0, i) + value(p.key, r, 1, i)),
                );
                assert_eq!((p.round, &p.data), (r, &want), "worker {w} key {}", p.key);
            }
        }
    }
    let (pushes, sums) = local.lent_frames();
    let all = rounds * keys.len() as u64;
    assert!(
        pushes > all / 2 && sums > 0 && sums <= all,
        "lent pushes {pushes} and sums {sums} of {all}"
    );
    assert_eq!(remote.lent_frames(), (0, 0), "TCP lends nothing");
    stop(h);
}

/// A lent sum the worker never reads (it received something else next) hands its slot
/// back all the same: every later sum is lent too.
#[test]
fn a_lent_sum_left_unread_hands_its_slot_back() {
    let (h, addr) = start(1, 1);
    let mut c = worker(&addr, 0);
    let data = encode_i32(&[3; 2048]);
    c.init_key(1, Dtype::I32, data.len() as u64, None).unwrap();
    let rounds = 6; // more than the mailbox's pull slots
    for r in 1..=rounds {
        c.tx.push(1, r, Dtype::I32, &data).unwrap();
        c.tx.pull(1, r, true).unwrap();
        loop {
            if let Reply::Sum(head) = c.rx.recv_header().unwrap() {
                assert_eq!((head.round, head.len), (r, data.len()));
                break;
            }
        }
        c.heartbeat(r).unwrap();
    }
    assert_eq!(c.lent_frames(), (rounds, rounds));
    stop(h);
}

/// A mailbox offered without shared memory behind it is declined, saying why, and the
/// connection goes on through the socket; a lent push where no mailbox was taken is
/// refused.
#[test]
fn a_mailbox_without_shared_memory_is_declined_and_nothing_is_lost() {
    let (h, addr) = start(1, 1);
    let offer = Message::Mailbox {
        push_slots: 2,
        pull_slots: 2,
        slot_bytes: 4096,
    };
    let plain = ServerOptions {
        mailbox: false,
        ..opts()
    };
    let local_without = ServerClient::connect(&addr, &token(), 0, "w", &plain).unwrap();
    let mut cases = [
        (local_without, "no file descriptor came with it"),
        (
            worker_over(&addr, 0, false),
            "only be offered over this machine's Unix socket",
        ),
        (worker(&addr, 0), "this connection already has one"),
    ];
    // Every connection stays open: losing one would fail the worker.
    for (key, (c, why)) in (1..).zip(&mut cases) {
        c.tx.send_raw(&offer, &[]).unwrap();
        match c.rx.recv_raw().unwrap().0 {
            Message::MailboxAck { accepted, reason } => {
                assert!(!accepted && reason.contains(*why), "{reason}");
            }
            other => panic!("expected a MailboxAck, got {other:?}"),
        }
        // Long enough to be lent, had a mailbox been taken.
        let data = encode_i32(&[7; 2048]);
        c.init_key(key, Dtype::I32, data.len() as u64, None)
            .unwrap();
        let sum = c.push_pull(key, 1, Dtype::I32, &data).unwrap();
        assert_eq!(sum.data, data, "{why}");
    }
    let mut tcp = worker_over(&addr, 0, false);
    tcp.init_key(1, Dtype::I32, 4 * 2048, None).unwrap();
    tcp.tx
        .send_bytes(&lent_push(
            2,
            Lent {
                slot: 0,
                len: 4 * 2048,
            },
        ))
        .unwrap();
    let err = tcp.rx.recv().expect_err("refused");
    expect_refused(err, ErrorCode::BadFrame, "this connection has no mailbox");
    stop(h);
}

fn encode_i32(vals: &[i32]) -> Vec<u8> {
    vals.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[test]
fn a_worker_that_disappears_is_named_to_the_others() {
    let (h, addr) = start(3, 2);
    let mut ws: Vec<_> = (0..3).map(|w| worker(&addr, w)).collect();
    for c in &mut ws {
        c.init_key(5, Dtype::F32, 8, None).unwrap();
    }
    for c in &mut ws[..2] {
        c.tx.push(5, 1, Dtype::F32, &[0; 8]).unwrap();
        c.tx.pull(5, 1, true).unwrap();
    }
    drop(ws.pop()); // worker 2 vanishes mid-round, without a shutdown
    for c in &mut ws {
        let err = c.rx.recv().unwrap_err();
        let text = err.to_string();
        assert_eq!(err.code(), ErrorCode::NodeFailed, "{text}");
        assert!(
            text.contains("worker 2 (test worker 2) lost its connection"),
            "{text}"
        );
    }
    // A later round is refused at once rather than left to hang.
    let err = ws[0].push_pull(5, 2, Dtype::F32, &[0; 8]).unwrap_err();
    assert!(err.to_string().contains("worker 2"), "{err}");
    stop(h);
}

#[test]
fn a_worker_may_split_its_keys_over_several_connections() {
    let (h, addr) = start(2, 2);
    let mut a = [worker(&addr, 0), worker(&addr, 0)];
    let mut b = worker(&addr, 1);
    for (key, c) in [1u64, 2].into_iter().zip(a.iter_mut()) {
        c.init_key(key, Dtype::I32, 4, None).unwrap();
        b.init_key(key, Dtype::I32, 4, None).unwrap();
    }
    for round in 1..=3 {
        for (key, c) in [1u64, 2].into_iter().zip(a.iter_mut()) {
            c.tx.push(key, round, Dtype::I32, &(key as i32).to_le_bytes())
                .unwrap();
            c.tx.pull(key, round, true).unwrap();
            let mine = b
                .push_pull(key, round, Dtype::I32, &10i32.to_le_bytes())
                .unwrap();
            assert_eq!(mine.data, (10 + key as i32).to_le_bytes());
            // Each sum comes back on the connection that asked for it.
            match c.rx.recv().unwrap() {
                Reply::Sum(p) => assert_eq!((p.key, p.data), (key, mine.data)),
                other => panic!("unexpected {other:?}"),
            }
        }
    }
    // One connection leaving gracefully is not the worker leaving: the other goes on.
    let [first, mut second] = a;
    first.shutdown("lane done").unwrap();
    thread::sleep(Duration::from_millis(100));
    second
        .tx
        .push(2, 4, Dtype::I32, &2i32.to_le_bytes())
        .unwrap();
    second.tx.pull(2, 4, true).unwrap();
    let sum = b.push_pull(2, 4, Dtype::I32, &10i32.to_le_bytes()).unwrap();
    assert_eq!(sum.data, 12i32.to_le_bytes());
    assert!(matches!(second.rx.recv().unwrap(), Reply::Sum(p) if p.data == sum.data));
    stop(h);
}

#[test]
fn losing_one_of_a_workers_connections_fails_the_worker() {
    let (h, addr) = start(2, 1);
    let mut a = vec![worker(&addr, 0), worker(&addr, 0)];
    let mut b = worker(&addr, 1);
    for c in [&mut a[0], &mut b] {
        c.init_key(1, Dtype::I32, 4, None).unwrap();
    }
    b.tx.push(1, 1, Dtype::I32, &[0; 4]).unwrap();
    b.tx.pull(1, 1, true).unwrap();
    drop(a.pop()); // one of worker 0's connections vanishes without a shutdown
    let err = b.rx.recv().unwrap_err();
    assert_eq!(err.code(), ErrorCode::NodeFailed, "{err}");
    assert!(
        err.to_string()
            .contains("worker 0 (test worker 0) lost its connection"),
        "{err}"
    );
    // The worker's other connection is closed with it, and it cannot come back.
    expect_closed(&mut a[0]);
    let err = ServerClient::connect(&addr, &token(), 0, "again", &opts())
        .err()
        .unwrap();
    assert_eq!(err.code(), ErrorCode::NodeFailed, "{err}");
    stop(h);
}

#[test]
fn impostors_and_duplicates_are_refused() {
    let (h, addr) = start(2, 1);
    let wrong = JobToken::new("not-the-job-token-at-all").unwrap();
    let err = ServerClient::connect(&addr, &wrong, 0, "intruder", &opts())
        .err()
        .unwrap();
    assert_eq!(err.code(), ErrorCode::AuthFailed, "{err}");
    let err = ServerClient::connect(&addr, &token(), 5, "rank five", &opts())
        .err()
        .unwrap();
    assert_eq!(err.code(), ErrorCode::BadRank, "{err}");
    let mut first = worker(&addr, 0);
    let _more: Vec<_> = (1..MAX_CONNECTIONS_PER_WORKER)
        .map(|_| worker(&addr, 0))
        .collect();
    let err = ServerClient::connect(&addr, &token(), 0, "twin", &opts())
        .err()
        .unwrap();
    assert_eq!(err.code(), ErrorCode::DuplicateNode, "{err}");
    // Garbage before the handshake completes disturbs nobody.
    let mut raw = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut raw, b"GET / HTTP/1.1\r\n\r\n").unwrap();
    drop(raw);
    first.heartbeat(1).unwrap();
    first.init_key(1, Dtype::I64, 8, None).unwrap();
    stop(h);
}

#[test]
fn shutdown_interrupts_waiting_workers() {
    let (h, addr) = start(2, 1);
    let mut a = worker(&addr, 0);
    a.init_key(1, Dtype::I32, 4, None).unwrap();
    a.tx.push(1, 1, Dtype::I32, &[0; 4]).unwrap();
    a.tx.pull(1, 1, true).unwrap();
    let t = thread::spawn(move || a.rx.recv());
    thread::sleep(Duration::from_millis(100));
    stop(h);
    assert!(t.join().unwrap().is_err());
}

/// (bytes sent, bytes received) since the handshake, on a worker's connection.
fn counted(c: &ServerClient) -> (u64, u64) {
    (c.tx.bytes_sent(), c.rx.bytes_received())
}

fn add_since(total: &mut (u64, u64), before: (u64, u64), after: (u64, u64)) {
    total.0 += after.0 - before.0;
    total.1 += after.1 - before.1;
}

#[test]
fn server_and_workers_count_the_same_bytes() {
    let (h, addr) = start(2, 2);
    // Key 10 is long enough to be lent through the mailbox, key 11 is not.
    let keys = [(10u64, Dtype::F32, 4000usize), (11, Dtype::F16, 77)];
    let reason = "done";
    let threads: Vec<_> = (0..2u32)
        .map(|w| {
            let addr = addr.clone();
            thread::spawn(move || {
                let mut c = worker(&addr, w);
                let mut per_key: HashMap<u64, (u64, u64)> = HashMap::new();
                // The mailbox's offer and acceptance.
                let mut other = counted(&c);
                assert!(other.0 > 0 && other.1 > 0);
                for &(k, d, n) in &keys {
                    let before = counted(&c);
                    c.init_key(k, d, (n * d.size()) as u64, None).unwrap();
                    add_since(per_key.entry(k).or_default(), before, counted(&c));
                }
                for r in 1..=3 {
                    for &(k, d, n) in &keys {
                        let before = counted(&c);
                        let data = encode(d, (0..n).map(|i| value(k, r, w, i)));
                        c.push_pull(k, r, d, &data).unwrap();
                        add_since(per_key.entry(k).or_default(), before, counted(&c));
                    }
                    let before = counted(&c);
                    c.heartbeat(r).unwrap();
                    add_since(&mut other, before, counted(&c));
                }
                let mut frame = Vec::new();
                sumflow_wire::io::write_message(
                    &mut frame,
                    &Message::Shutdown {
                        reason: reason.into(),
                    },
                )
                .unwrap();
                c.shutdown(reason).unwrap();
                other.0 += frame.len() as u64;
                (per_key, other)
            })
        })
        .collect();
    let workers: Vec<_> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    let other_sent: u64 = workers.iter().map(|(_, o)| o.0).sum();
    // The server reads the Shutdown frames on its own threads: wait until it has.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.wire_traffic().other.received < other_sent {
        assert!(
            std::time::Instant::now() < deadline,
            "{:?}",
            h.wire_traffic()
        );
        thread::sleep(Duration::from_millis(10));
    }
    h.shutdown();
    let server = h.wait();
    for &(k, d, n) in &keys {
        let (sent, received) = workers.iter().fold((0, 0), |a, (per_key, _)| {
            (a.0 + per_key[&k].0, a.1 + per_key[&k].1)
        });
        let got = server.keys[&k];
        assert_eq!((got.received, got.sent), (sent, received), "key {k}");
        // Three rounds' payloads from two workers, and their headers.
        assert!(
            got.received > (3 * 2 * n * d.size()) as u64,
            "key {k}: {got:?}"
        );
    }
    let other_received: u64 = workers.iter().map(|(_, o)| o.1).sum();
    assert_eq!(
        (server.other.received, server.other.sent),
        (other_sent, other_received)
    );
    assert_eq!(server.keys.len(), keys.len());
}

#[test]
fn a_joined_worker_counts_as_zeros_and_goes_on_in_its_own_round_numbers() {
    // Two engines: the acknowledgement waits for both, and the keys land on either.
    let (h, addr) = start(3, 2);
    let mut w: Vec<ServerClient> = (0..3).map(|r| worker(&addr, r)).collect();
    let ones = encode(Dtype::I32, [1, 2, 3].into_iter());
    for (r, c) in w.iter_mut().enumerate() {
        for key in [1, 2] {
            c.init_key(key, Dtype::I32, 12, None).unwrap();
        }
        c.tx.push(1, 1, Dtype::I32, &ones)
            .unwrap_or_else(|e| panic!("worker {r}: {e}"));
    }
    for c in &mut w {
        assert_eq!(
            c.pull(1, 1).unwrap().data,
            encode(Dtype::I32, [3, 6, 9].into_iter())
        );
    }
    // Worker 2 joins: rounds 2 and 3 of key 1 and round 1 of key 2 complete without it.
    w[2].join(true).unwrap();
    for round in [2, 3] {
        for c in &mut w[..2] {
            c.tx.push(1, round, Dtype::I32, &ones).unwrap();
        }
        for c in &mut w[..2] {
            assert_eq!(
                c.pull(1, round).unwrap().data,
                encode(Dtype::I32, [2, 4, 6].into_iter())
            );
        }
    }
    // A joined worker's push is refused.
    let mut extra = worker(&addr, 2);
    extra.tx.push(2, 1, Dtype::I32, &ones).unwrap();
    let err = extra.pull(2, 1).unwrap_err();
    expect_refused(err, ErrorCode::RoundOutOfSequence, "worker 2 has joined");
    // Refused, the worker is gone for the job: a new job for what follows.
    stop(h);

    let (h, addr) = start(2, 2);
    let mut w: Vec<ServerClient> = (0..2).map(|r| worker(&addr, r)).collect();
    w[0].init_key(7, Dtype::I32, 12, None).unwrap();
    w[1].join(true).unwrap();
    // Key 7's first rounds, and key 8 declared only now, by worker 0 alone.
    w[0].init_key(8, Dtype::I32, 12, None).unwrap();
    for round in 1..=2 {
        for key in [7, 8] {
            w[0].tx.push(key, round, Dtype::I32, &ones).unwrap();
            assert_eq!(w[0].pull(key, round).unwrap().data, ones);
        }
    }
    w[1].join(false).unwrap();
    w[1].init_key(7, Dtype::I32, 12, None).unwrap();
    w[1].init_key(8, Dtype::I32, 12, None).unwrap();
    // Worker 1's round 1 is the keys' round 3; its replies name its round 1.
    for key in [7, 8] {
        w[0].tx.push(key, 3, Dtype::I32, &ones).unwrap();
        w[1].tx.push(key, 1, Dtype::I32, &ones).unwrap();
        let twice = encode(Dtype::I32, [2, 4, 6].into_iter());
        let got = w[1].pull(key, 1).unwrap();
        assert_eq!((got.round, &got.data), (1, &twice));
        let got = w[0].pull(key, 3).unwrap();
        assert_eq!((got.round, &got.data), (3, &twice));
    }
    for c in w {
        c.shutdown("done").unwrap();
    }
    stop(h);
}

/// Waits until the server's key counts (live, peak, freed) are `want`.
fn counts_become(h: &ServerHandle, want: (usize, usize, u64)) {
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while h.key_counts() != want {
        assert!(
            std::time::Instant::now() < deadline,
            "key counts {:?}, expected {want:?}",
            h.key_counts()
        );
        thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_key_is_freed_once_every_worker_retired_it_and_never_pushed_again() {
    let (h, addr) = start(2, 1);
    let data = encode(Dtype::I32, [1, 2, 3, 4].into_iter());
    let mut clients: Vec<ServerClient> = (0..2).map(|w| worker(&addr, w)).collect();
    for c in &mut clients {
        for key in [1, 2] {
            c.tx.init_key(key, Dtype::I32, 16, None).unwrap();
            assert!(matches!(c.rx.recv().unwrap(), Reply::InitAck { key: k } if k == key));
        }
    }
    let sums: Vec<Pulled> = thread::scope(|s| {
        let threads: Vec<_> = clients
            .iter_mut()
            .map(|c| s.spawn(|| c.push_pull(1, 1, Dtype::I32, &data).unwrap()))
            .collect();
        threads.into_iter().map(|t| t.join().unwrap()).collect()
    });
    for p in &sums {
        assert_eq!(p.data, encode(Dtype::I32, [2, 4, 6, 8].into_iter()));
    }
    assert_eq!(h.key_counts(), (2, 2, 0));
    // Worker 0 retires key 1: it stays for worker 1, then goes with worker 1's retire.
    clients[0].tx.retire(1).unwrap();
    clients[0].heartbeat(1).unwrap();
    assert_eq!(h.key_counts(), (2, 2, 0));
    clients[1].tx.retire(1).unwrap();
    counts_become(&h, (1, 2, 1));
    // A key every worker retired is unknown again; one this worker retired, refused.
    clients[0].tx.retire(2).unwrap();
    clients[0].tx.push(2, 1, Dtype::I32, &data).unwrap();
    let err = clients[0].rx.recv().unwrap_err();
    expect_refused(err, ErrorCode::UnknownKey, "key 2, which worker 0 retired");
    clients[1].tx.push(1, 2, Dtype::I32, &data).unwrap();
    let err = clients[1].rx.recv().unwrap_err();
    expect_refused(err, ErrorCode::UnknownKey, "every worker retired it");
    stop(h);
}
