//! Round trips and rejections of every message, through both decoders.

use std::io::{Cursor, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::cluster::{ClusterMap, NodeId, NodeInfo, Role};
use crate::error::{ErrorCode, WireError};
use crate::frame::{Lent, Op, HEADER_LEN};
use crate::io::{
    accept, connect, write_data, write_data_then, FrameReader, Peer, HANDSHAKE_MAX_BODY,
};
use crate::message::*;
use crate::{Codec, Dtype, JobToken, KeyCodec};

fn node(rank: u32) -> NodeInfo {
    NodeInfo {
        rank,
        host: "10.0.0.1".into(),
        port: 7000,
        host_id: "machine-a".into(),
        pid: 42,
        link_mbit: 0,
        name: "worker ünïcode".into(),
    }
}

fn samples() -> Vec<(Message, Vec<u8>)> {
    vec![
        (
            Message::Stalled {
                key: 7,
                round: 3,
                waited_ms: 61_000,
                missing: vec![1, 4],
            },
            vec![],
        ),
        (
            Message::Challenge {
                service: Service::Summation,
                nonce: [7; 32],
            },
            vec![],
        ),
        (
            Message::Hello {
                role: Role::Worker,
                rank: Some(3),
                nonce: [1; 32],
                proof: [2; 32],
                name: "w3".into(),
            },
            vec![],
        ),
        (
            Message::Hello {
                role: Role::Server,
                rank: None,
                nonce: [1; 32],
                proof: [2; 32],
                name: String::new(),
            },
            vec![],
        ),
        (
            Message::Welcome {
                service: Service::Coordinator,
                proof: [9; 32],
            },
            vec![],
        ),
        (
            Message::Register(Registration {
                role: Role::Server,
                requested_rank: None,
                host: "127.0.0.1".into(),
                port: 9999,
                host_id: "h".into(),
                pid: 77,
                link_mbit: 0,
                name: "server on h".into(),
            }),
            vec![],
        ),
        (
            Message::ClusterMap {
                your_rank: 1,
                map: ClusterMap {
                    job_id: "job".into(),
                    workers: vec![node(0), node(1)],
                    servers: vec![node(0)],
                },
            },
            vec![],
        ),
        (
            Message::Declare {
                name: "layer1.0.conv1.weight".into(),
                dtype: Dtype::Bf16,
                elements: 36_864,
                compression: String::new(),
            },
            vec![],
        ),
        (
            Message::Declare {
                name: "ü".into(),
                dtype: Dtype::I64,
                elements: u64::MAX / 8,
                compression: String::new(),
            },
            vec![],
        ),
        (
            Message::Declared {
                name: "layer1.0.conv1.weight".into(),
                tensor_id: 0,
            },
            vec![],
        ),
        (
            Message::Declared {
                name: "fc.bias".into(),
                tensor_id: u32::MAX,
            },
            vec![],
        ),
        (
            Message::Undeclare {
                name: "allreduce.noname.7".into(),
                tensor_id: 12,
            },
            vec![],
        ),
        (Message::Retire { key: 12 << 32 | 3 }, vec![]),
        (
            Message::Skips {
                key: 7 << 32 | 2,
                round: 9,
                op: ReduceOp::Max,
                workers: vec![1, 2, 7],
            },
            vec![],
        ),
        (
            Message::InitKey {
                key: 5,
                dtype: Dtype::F16,
                byte_len: 6,
                init: KeyInit::Value,
                codec: KeyCodec::RAW,
            },
            vec![1, 2, 3, 4, 5, 6],
        ),
        (
            Message::InitKey {
                key: u64::MAX,
                dtype: Dtype::I64,
                byte_len: 800,
                init: KeyInit::Zeros,
                codec: KeyCodec::RAW,
            },
            vec![],
        ),
        (
            Message::InitKey {
                key: 6,
                dtype: Dtype::F32,
                byte_len: 4000,
                init: KeyInit::Zeros,
                codec: KeyCodec {
                    codec: Codec::TopK,
                    param: 10,
                    feedback: true,
                },
            },
            vec![],
        ),
        (
            Message::InitKey {
                key: 7,
                dtype: Dtype::Bf16,
                byte_len: 64,
                init: KeyInit::Members(vec![0, 2, 65_535]),
                codec: KeyCodec::RAW,
            },
            vec![],
        ),
        (
            Message::InitKey {
                key: 8,
                dtype: Dtype::F32,
                byte_len: 4,
                init: KeyInit::Members(vec![3]),
                codec: KeyCodec::RAW,
            },
            vec![],
        ),
        (Message::InitAck { key: 5 }, vec![]),
        (Message::PushAck { key: 5, round: 9 }, vec![]),
        (
            Message::Push {
                key: 9,
                round: 3,
                dtype: Dtype::F32,
                codec: Codec::Raw,
                mode: PushMode::Sum,
                op: ReduceOp::Sum,
            },
            vec![0; 16],
        ),
        (
            Message::Push {
                key: 9,
                round: 3,
                dtype: Dtype::Bf16,
                codec: Codec::Raw,
                mode: PushMode::Delta { staleness: Some(2) },
                op: ReduceOp::Sum,
            },
            vec![0; 2],
        ),
        (
            Message::Push {
                key: 9,
                round: 4,
                dtype: Dtype::F32,
                codec: Codec::Raw,
                mode: PushMode::Delta { staleness: None },
                op: ReduceOp::Sum,
            },
            vec![0; 4],
        ),
        (
            Message::Push {
                key: 9,
                round: 3,
                dtype: Dtype::F32,
                codec: Codec::Sign,
                mode: PushMode::Sum,
                op: ReduceOp::Sum,
            },
            vec![0; 7],
        ),
        (
            Message::Push {
                key: 9,
                round: 3,
                dtype: Dtype::I64,
                codec: Codec::Raw,
                mode: PushMode::Sum,
                op: ReduceOp::Product,
            },
            vec![0; 8],
        ),
        (
            Message::Push {
                key: 9,
                round: 4,
                dtype: Dtype::F16,
                codec: Codec::Raw,
                mode: PushMode::Skip,
                op: ReduceOp::Min,
            },
            vec![],
        ),
        (
            Message::Pull {
                key: 9,
                round: 3,
                wants_sum: true,
            },
            vec![],
        ),
        (
            Message::Pull {
                key: 9,
                round: 4,
                wants_sum: false,
            },
            vec![],
        ),
        (
            Message::PullReply {
                key: 9,
                round: 3,
                dtype: Dtype::F64,
                codec: Codec::Raw,
            },
            vec![3; 8],
        ),
        (
            Message::PullReply {
                key: 9,
                round: 4,
                dtype: Dtype::F16,
                codec: Codec::Raw,
            },
            vec![],
        ),
        (
            Message::Barrier {
                id: 11,
                group: BarrierGroup::Workers,
            },
            vec![],
        ),
        (
            Message::Barrier {
                id: 12,
                group: BarrierGroup::All,
            },
            vec![],
        ),
        (
            Message::Barrier {
                id: 14,
                group: BarrierGroup::Join,
            },
            vec![],
        ),
        (
            Message::BarrierDone {
                id: 11,
                last: NodeId {
                    role: Role::Worker,
                    rank: 3,
                },
            },
            vec![],
        ),
        (Message::Join { joined: true }, vec![]),
        (Message::Join { joined: false }, vec![]),
        (Message::JoinAck { joined: true }, vec![]),
        (Message::JoinAck { joined: false }, vec![]),
        (Message::Heartbeat { seq: 1 }, vec![]),
        (Message::HeartbeatAck { seq: 1 }, vec![]),
        (
            Message::NodeFailed {
                node: NodeId {
                    role: Role::Worker,
                    rank: 2,
                },
                name: "worker 2".into(),
                reason: "no heartbeat for 3.0s".into(),
            },
            vec![],
        ),
        (
            Message::Mailbox {
                push_slots: 8,
                pull_slots: 4,
                slot_bytes: 1 << 20,
            },
            vec![],
        ),
        (
            Message::MailboxAck {
                accepted: false,
                reason: "no descriptor".into(),
            },
            vec![],
        ),
        (
            Message::Shutdown {
                reason: "done".into(),
            },
            vec![],
        ),
        (
            Message::error(ErrorCode::DuplicatePush, Some(4), "again"),
            vec![],
        ),
        (Message::error(ErrorCode::Timeout, None, ""), vec![]),
    ]
}

#[test]
fn every_message_round_trips_through_both_decoders() {
    for (msg, payload) in samples() {
        let bytes = msg.encode_with_payload(&payload);
        let frame = decode_frame(&bytes, 1 << 20).unwrap().expect("complete");
        assert_eq!(frame.message, msg);
        assert_eq!(frame.payload, &payload[..]);
        assert_eq!(frame.consumed, bytes.len());
        // Every strict prefix is incomplete, never an error or a panic.
        for cut in 0..bytes.len() {
            assert!(decode_frame(&bytes[..cut], 1 << 20).unwrap().is_none());
        }
        let mut r = FrameReader::new(Cursor::new(bytes), 1 << 20);
        let (m, p) = r.read_owned().unwrap();
        assert_eq!((m, p), (msg, payload));
        assert!(matches!(r.read(), Err(WireError::Closed)));
    }
}

#[test]
fn lent_frames_carry_a_locator_through_both_decoders() {
    let push = Message::Push {
        key: 3,
        round: 9,
        dtype: Dtype::F32,
        codec: Codec::Raw,
        mode: PushMode::Sum,
        op: ReduceOp::Sum,
    };
    let lent = Lent { slot: 2, len: 4096 };
    let bytes = push.encode_lent(lent);
    assert_eq!(bytes.len(), HEADER_LEN + DATA_META_LEN + 8);
    let frame = decode_frame(&bytes, 1 << 20).unwrap().expect("complete");
    assert_eq!(
        (&frame.message, frame.payload, frame.lent),
        (&push, &[][..], Some(lent))
    );
    let mut wire = bytes.clone();
    write_data(&mut wire, &Message::Heartbeat { seq: 1 }, &[]).unwrap();
    let mut r = FrameReader::new(Cursor::new(wire), 1 << 20);
    let f = r.read().unwrap();
    assert_eq!((f.message, f.payload_len, f.lent), (push, 0, Some(lent)));
    assert_eq!(r.read().unwrap().message, Message::Heartbeat { seq: 1 });
    // The locator's length is checked as a payload's would be.
    let odd = Message::PullReply {
        key: 3,
        round: 9,
        dtype: Dtype::F32,
        codec: Codec::Raw,
    }
    .encode_lent(Lent { slot: 0, len: 6 });
    let e = decode_frame(&odd, 1 << 20).unwrap_err();
    assert!(e.to_string().contains("multiple of f32"), "{e}");
}

#[test]
fn a_mailbox_offer_is_checked_before_anything_is_mapped() {
    for (push_slots, pull_slots, slot_bytes, why) in [
        (0, 4, 4096, "push_slots"),
        (4, 513, 4096, "pull_slots"),
        (4, 4, 1000, "slot_bytes"),
        (4, 4, 512 << 20, "slot_bytes"),
    ] {
        let m = Message::Mailbox {
            push_slots,
            pull_slots,
            slot_bytes,
        };
        let e = decode_frame(&m.encode(0), 1 << 20).unwrap_err();
        assert!(e.to_string().contains(why), "{e}");
    }
}

/// A writer that takes at most `max` bytes per call, vectored or not, as a busy socket may.
struct Trickle {
    out: Vec<u8>,
    max: usize,
    calls: usize,
}

impl Write for Trickle {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[std::io::IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        self.calls += 1;
        let mut n = 0;
        for b in bufs {
            let take = b.len().min(self.max - n);
            self.out.extend_from_slice(&b[..take]);
            n += take;
            if n == self.max {
                break;
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A raw i32 push of key 1, round 1.
fn raw_push() -> Message {
    Message::Push {
        key: 1,
        round: 1,
        dtype: Dtype::I32,
        codec: Codec::Raw,
        mode: PushMode::Sum,
        op: ReduceOp::Sum,
    }
}

#[test]
fn frames_written_together_are_the_frames_written_one_by_one() {
    let push = raw_push();
    let pull = Message::Pull {
        key: 1,
        round: 1,
        wants_sum: true,
    };
    for len in [16, 200_000] {
        let payload: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let mut want = push.encode_with_payload(&payload);
        want.extend_from_slice(&pull.encode(0));
        // One call when the stream takes everything; whole frames however it trickles.
        let mut all = Trickle {
            out: Vec::new(),
            max: usize::MAX,
            calls: 0,
        };
        write_data_then(&mut all, &push, &payload, &[&pull]).unwrap();
        assert_eq!((all.out == want, all.calls), (true, 1), "{len} bytes");
        let mut trickle = Trickle {
            out: Vec::new(),
            max: 7_001,
            calls: 0,
        };
        let mut counted = crate::accounting::Counted::new(&mut trickle);
        write_data_then(&mut counted, &push, &payload, &[&pull]).unwrap();
        assert_eq!(
            counted.counted(),
            want.len() as u64,
            "counted through write_vectored"
        );
        assert!(trickle.out == want, "{len} bytes in pieces");
    }
}

#[test]
fn streamed_frames_follow_each_other() {
    let mut wire = Vec::new();
    let push = raw_push();
    let big = vec![5u8; 200_000];
    write_data(&mut wire, &push, &big).unwrap();
    write_data(
        &mut wire,
        &Message::Pull {
            key: 1,
            round: 1,
            wants_sum: true,
        },
        &[],
    )
    .unwrap();
    let mut r = FrameReader::new(Cursor::new(wire), 1 << 20);
    let f = r.read().unwrap();
    assert_eq!(f.payload_len, big.len());
    r.skip_payload().unwrap();
    assert_eq!(
        r.read().unwrap().message,
        Message::Pull {
            key: 1,
            round: 1,
            wants_sum: true
        }
    );
}

fn body_err(op: Op, body: &[u8]) -> WireError {
    let mut bytes = crate::frame::Header {
        op,
        body_len: body.len() as u32,
        lent: false,
    }
    .encode()
    .to_vec();
    bytes.extend_from_slice(body);
    decode_frame(&bytes, 1 << 20).unwrap_err()
}

#[test]
fn malformed_join_and_barrier_done_bodies_are_refused() {
    for op in [Op::Join, Op::JoinAck] {
        let e = body_err(op, &[2]);
        assert_eq!(e.code(), ErrorCode::BadFrame);
        assert!(e.to_string().contains("joined"), "{e}");
        assert!(e.to_string().contains("2 is not 0 or 1"), "{e}");
        assert_eq!(body_err(op, &[]).code(), ErrorCode::BadFrame);
        assert_eq!(body_err(op, &[1, 0]).code(), ErrorCode::BadFrame);
    }
    let done = |role: u8| [&7u64.to_le_bytes()[..], &[role], &2u32.to_le_bytes()].concat();
    let e = body_err(Op::BarrierDone, &done(9));
    assert!(e.to_string().contains("role"), "{e}");
    // The id alone, as before this field: truncated.
    assert_eq!(
        body_err(Op::BarrierDone, &7u64.to_le_bytes()).code(),
        ErrorCode::BadFrame
    );
    let e = body_err(Op::Barrier, &[&7u64.to_le_bytes()[..], &[4]].concat());
    assert!(e.to_string().contains("unknown barrier group 4"), "{e}");
}

#[test]
fn malformed_bodies_are_rejected_with_the_field_named() {
    let push = Message::Push {
        key: 1,
        round: 1,
        dtype: Dtype::F32,
        codec: Codec::Raw,
        mode: PushMode::Sum,
        op: ReduceOp::Sum,
    };
    let good = push.encode_with_payload(&[0; 8]);
    let meta = &good[HEADER_LEN..HEADER_LEN + DATA_META_LEN];

    let mut m = meta.to_vec();
    m[16] = 99; // dtype
    assert!(body_err(Op::Push, &[&m[..], &[0; 8]].concat())
        .to_string()
        .contains("dtype"));
    let mut m = meta.to_vec();
    m[17] = 5; // codec
    assert!(body_err(Op::Push, &[&m[..], &[0; 8]].concat())
        .to_string()
        .contains("codec"));
    let mut m = meta.to_vec();
    m[18] = 9; // mode
    assert!(body_err(Op::Push, &[&m[..], &[0; 8]].concat())
        .to_string()
        .contains("mode"));
    let mut m = meta.to_vec();
    m[19] = 4; // op
    assert!(body_err(Op::Push, &[&m[..], &[0; 8]].concat())
        .to_string()
        .contains("unknown reduction 4"));
    let mut m = meta.to_vec();
    m[23] = 1; // reserved
    assert!(body_err(Op::Push, &[&m[..], &[0; 8]].concat())
        .to_string()
        .contains("reserved"));
    // A skip carries no payload; a compressed push is only summed.
    let mut m = meta.to_vec();
    m[18] = PushMode::Skip.code();
    let e = body_err(Op::Push, &[&m[..], &[0; 8]].concat());
    assert!(
        e.to_string().contains("skips its round carries 8 bytes"),
        "{e}"
    );
    let mut m = meta.to_vec();
    m[17] = Codec::RandomK as u8;
    m[19] = ReduceOp::Max as u8;
    let e = body_err(Op::Push, &[&m[..], &[0; 8]].concat());
    assert!(e.to_string().contains("not reduced by max"), "{e}");
    // A delta is raw elements, summed into the stored value; its last four bytes are its
    // staleness bound, the others' are reserved.
    let mut m = meta.to_vec();
    m[17] = Codec::Sign as u8;
    m[18] = PushMode::Delta { staleness: None }.code();
    let e = body_err(Op::Push, &[&m[..], &[0; 4]].concat());
    assert!(e.to_string().contains("delta push carries raw"), "{e}");
    let mut m = meta.to_vec();
    m[18] = PushMode::Delta { staleness: None }.code();
    m[19] = ReduceOp::Min as u8;
    let e = body_err(Op::Push, &[&m[..], &[0; 8]].concat());
    assert!(e.to_string().contains("only be summed"), "{e}");
    // wants_sum is a flag.
    let e = body_err(Op::Pull, &[&[0; 16][..], &[2]].concat());
    assert!(e.to_string().contains("wants_sum"), "{e}");
    // Payload not a multiple of the element size, and an empty payload.
    let e = body_err(Op::Push, &[meta, &[0; 7]].concat());
    assert!(e.to_string().contains("7 bytes"), "{e}");
    assert!(body_err(Op::Push, meta).to_string().contains("payload"));
    // Meta block cut short.
    assert!(matches!(
        body_err(Op::Push, &meta[..10]),
        WireError::Truncated { .. }
    ));
    // Trailing bytes after a fixed-size body.
    assert!(matches!(
        body_err(Op::Pull, &[0; 18]),
        WireError::TrailingBytes { extra: 1, .. }
    ));
    // Bad UTF-8 in a string.
    let e = body_err(Op::Shutdown, &[2, 0, 0xff, 0xfe]);
    assert!(e.to_string().contains("UTF-8"), "{e}");
    // Init value length disagreeing with the declared length.
    let init = Message::InitKey {
        key: 1,
        dtype: Dtype::F32,
        byte_len: 8,
        init: KeyInit::Value,
        codec: KeyCodec::RAW,
    };
    let bytes = init.encode_with_payload(&[0; 4]);
    assert!(decode_frame(&bytes, 1 << 20)
        .unwrap_err()
        .to_string()
        .contains("initial value"));
    let init = Message::InitKey {
        key: 1,
        dtype: Dtype::F32,
        byte_len: 6,
        init: KeyInit::Zeros,
        codec: KeyCodec::RAW,
    };
    let e = decode_frame(&init.encode(0), 1 << 20).unwrap_err();
    assert!(e.to_string().contains("byte_len"), "{e}");
    // A codec that cannot apply to the key, or a compressed key with an initial value.
    let compressed = |dtype, param, init| Message::InitKey {
        key: 1,
        dtype,
        byte_len: 40,
        init,
        codec: KeyCodec {
            codec: Codec::TopK,
            param,
            feedback: false,
        },
    };
    let e = decode_frame(
        &compressed(Dtype::F32, 11, KeyInit::Zeros).encode(0),
        1 << 20,
    )
    .unwrap_err();
    assert!(e.to_string().contains("k must be 1 to 10"), "{e}");
    let e = decode_frame(
        &compressed(Dtype::F16, 5, KeyInit::Zeros).encode(0),
        1 << 20,
    )
    .unwrap_err();
    assert!(e.to_string().contains("not f16"), "{e}");
    let e = decode_frame(
        &compressed(Dtype::F32, 5, KeyInit::Value).encode_with_payload(&[0; 40]),
        1 << 20,
    )
    .unwrap_err();
    assert!(e.to_string().contains("no initial value"), "{e}");
    // Oversized frame, caught from the header alone.
    let e = decode_frame(&good, 16).unwrap_err();
    assert_eq!(e.code(), ErrorCode::FrameTooLarge);
}

/// An InitKey with members, as bytes: its meta block, then `list` after it.
fn members_frame(codec: KeyCodec, list: &[u8]) -> Vec<u8> {
    let head = Message::InitKey {
        key: 1,
        dtype: Dtype::F32,
        byte_len: 8,
        init: KeyInit::Members(vec![0]),
        codec,
    }
    .encode(0);
    body_frame(&[&head[HEADER_LEN..HEADER_LEN + DATA_META_LEN], list].concat())
}

fn body_frame(body: &[u8]) -> Vec<u8> {
    let mut bytes = crate::frame::Header {
        op: Op::InitKey,
        body_len: body.len() as u32,
        lent: false,
    }
    .encode()
    .to_vec();
    bytes.extend_from_slice(body);
    bytes
}

fn ranks(count: u32, ranks: &[u32]) -> Vec<u8> {
    std::iter::once(count)
        .chain(ranks.iter().copied())
        .flat_map(u32::to_le_bytes)
        .collect()
}

/// Both decoders refuse `bytes` alike; returns the error.
fn refused_by_both(bytes: &[u8]) -> WireError {
    let whole = decode_frame(bytes, 1 << 20).unwrap_err();
    let streamed = FrameReader::new(Cursor::new(bytes), 1 << 20)
        .read()
        .unwrap_err();
    assert_eq!(whole.to_string(), streamed.to_string());
    assert_eq!(whole.code(), ErrorCode::BadFrame);
    whole
}

#[test]
fn member_lists_are_checked_when_decoded_and_field_named() {
    let raw = KeyCodec::RAW;
    // The list as it is encoded: decoded alike by both readers, nothing left to stream.
    let good = members_frame(raw, &ranks(2, &[0, 2]));
    let frame = decode_frame(&good, 1 << 20).unwrap().unwrap();
    assert!(frame.payload.is_empty());
    let Message::InitKey { init, .. } = frame.message else {
        panic!("an InitKey")
    };
    assert_eq!(init, KeyInit::Members(vec![0, 2]));
    let f = FrameReader::new(Cursor::new(&good), 1 << 20)
        .read()
        .unwrap();
    assert_eq!(f.payload_len, 0);

    for (list, says) in [
        (ranks(0, &[]), "at least one rank"),
        (vec![], "truncated"),
        (
            ranks(2, &[0]),
            "the count says 2 ranks but 4 bytes follow it, not 8",
        ),
        (
            ranks(1, &[0, 1]),
            "the count says 1 ranks but 8 bytes follow it",
        ),
        ([ranks(1, &[0]), vec![0]].concat(), "5 bytes follow it"),
        (
            ranks(3, &[0, 2, 1]),
            "rank 1 after 2: ranks must be distinct and ascending",
        ),
        (ranks(2, &[4, 4]), "rank 4 after 4"),
        (ranks(70_000, &[]), "70000 members exceeds 65536"),
    ] {
        let e = refused_by_both(&members_frame(raw, &list));
        let msg = e.to_string();
        assert!(msg.contains(says), "{says}: {msg}");
        if !list.is_empty() {
            assert!(msg.contains("field members"), "{msg}");
        }
    }
    // Longer than any list: refused before it is read.
    let e = refused_by_both(&members_frame(raw, &vec![0; 4 + 4 * 65_537]));
    assert!(
        e.to_string().contains("longer than a list of 65536 ranks"),
        "{e}"
    );
    // Members are for raw keys.
    let topk = KeyCodec {
        codec: Codec::TopK,
        param: 1,
        feedback: false,
    };
    let e = refused_by_both(&members_frame(topk, &ranks(1, &[0])));
    assert!(e.to_string().contains("field codec"), "{e}");
    assert!(e.to_string().contains("must be raw"), "{e}");
    // A has_init beyond 2.
    let mut bad = members_frame(raw, &[]);
    bad[HEADER_LEN + 17] = 3;
    let e = refused_by_both(&bad);
    assert!(e.to_string().contains("3 is not 0, 1 or 2"), "{e}");
}

#[test]
fn keys_without_members_encode_as_before() {
    // has_init 0 and 1, byte for byte as version 1 always sent them.
    let init = |init| Message::InitKey {
        key: 0x0102,
        dtype: Dtype::I32,
        byte_len: 8,
        init,
        codec: KeyCodec::RAW,
    };
    let meta = |has_init: u8| {
        let mut m = vec![2, 1, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 5, has_init];
        m.extend([0; 6]);
        m
    };
    assert_eq!(init(KeyInit::Zeros).encode(0)[HEADER_LEN..], meta(0)[..]);
    assert_eq!(init(KeyInit::Value).encode(8)[HEADER_LEN..], meta(1)[..]);
    let with = init(KeyInit::Members(vec![1, 5])).encode(0);
    assert_eq!(
        with[HEADER_LEN..],
        [meta(2), ranks(2, &[1, 5])].concat()[..]
    );
}

#[test]
fn declarations_without_a_name_or_elements_are_rejected_with_the_field_named() {
    let declare = |name: &str, dtype: Dtype, elements: u64| {
        let msg = Message::Declare {
            name: name.into(),
            dtype,
            elements,
            compression: String::new(),
        };
        decode_frame(&msg.encode(0), 1 << 20).map(|f| f.map(|f| f.message))
    };
    let e = declare("", Dtype::F32, 4).unwrap_err();
    assert!(e.to_string().contains("field name"), "{e}");
    assert!(e.to_string().contains("must not be empty"), "{e}");
    assert_eq!(e.code(), ErrorCode::BadFrame);
    let e = declare("w", Dtype::F32, 0).unwrap_err();
    assert!(e.to_string().contains("at least one element"), "{e}");
    // The byte length of 2^62 f64 elements overflows a u64; of f16 elements it does not.
    let e = declare("w", Dtype::F64, 1 << 62).unwrap_err();
    assert!(e.to_string().contains("field elements"), "{e}");
    assert!(declare("w", Dtype::F16, 1 << 62).is_ok());

    let good = Message::Declare {
        name: "w".into(),
        dtype: Dtype::F32,
        elements: 4,
        compression: String::new(),
    }
    .encode(0);
    let mut body = good[HEADER_LEN..].to_vec();
    body[3] = 0; // dtype, after the 2-byte length and the 1-byte name
    assert!(body_err(Op::Declare, &body).to_string().contains("dtype"));
    // Cut inside the elements (the 2-byte compression string follows them).
    assert!(matches!(
        body_err(Op::Declare, &good[HEADER_LEN..good.len() - 3]),
        WireError::Truncated {
            field: "elements",
            ..
        }
    ));
    assert!(matches!(
        body_err(Op::Declare, &good[HEADER_LEN..good.len() - 1]),
        WireError::Truncated {
            field: "compression",
            ..
        }
    ));
    let named = Message::Declared {
        name: String::new(),
        tensor_id: 3,
    };
    let e = decode_frame(&named.encode(0), 1 << 20).unwrap_err();
    assert!(e.to_string().contains("Declared frame: field name"), "{e}");
}

#[test]
fn retiring_frames_are_checked() {
    // Undeclare: a name and an id, the name not empty, nothing after them.
    let good = Message::Undeclare {
        name: "w".into(),
        tensor_id: 9,
    }
    .encode(0);
    assert_eq!(good[5], 0x08);
    let body = &good[HEADER_LEN..];
    assert!(matches!(
        body_err(Op::Undeclare, &body[..body.len() - 1]),
        WireError::Truncated {
            field: "tensor_id",
            ..
        }
    ));
    let e = body_err(Op::Undeclare, &[body, &[0][..]].concat());
    assert!(matches!(e, WireError::TrailingBytes { .. }), "{e}");
    let empty = Message::Undeclare {
        name: String::new(),
        tensor_id: 9,
    };
    let e = decode_frame(&empty.encode(0), 1 << 20).unwrap_err();
    assert!(e.to_string().contains("Undeclare frame: field name"), "{e}");
    // Retire: exactly one key.
    let good = Message::Retire { key: 5 }.encode(0);
    assert_eq!(good[5], 0x18);
    let body = &good[HEADER_LEN..];
    assert!(matches!(
        body_err(Op::Retire, &body[..7]),
        WireError::Truncated { field: "key", .. }
    ));
    let e = body_err(Op::Retire, &[body, &[0][..]].concat());
    assert!(matches!(e, WireError::TrailingBytes { .. }), "{e}");
    assert_eq!(e.code(), ErrorCode::BadFrame);
}

#[test]
fn a_skips_frame_names_distinct_ascending_workers_and_a_known_op() {
    let skips = |op: u8, ranks: &[u32]| {
        let mut body = Vec::new();
        body.extend_from_slice(&7u64.to_le_bytes());
        body.extend_from_slice(&3u64.to_le_bytes());
        body.push(op);
        body.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
        for r in ranks {
            body.extend_from_slice(&r.to_le_bytes());
        }
        body
    };
    let good = Message::Skips {
        key: 7,
        round: 3,
        op: ReduceOp::Min,
        workers: vec![1, 4],
    };
    assert_eq!(good.encode(0)[HEADER_LEN..], skips(1, &[1, 4])[..]);
    let e = body_err(Op::Skips, &skips(1, &[]));
    assert!(e.to_string().contains("at least one rank"), "{e}");
    let e = body_err(Op::Skips, &skips(1, &[4, 1]));
    assert!(e.to_string().contains("distinct and ascending"), "{e}");
    let e = body_err(Op::Skips, &skips(9, &[1]));
    assert!(e.to_string().contains("unknown reduction 9"), "{e}");
    let e = body_err(Op::Skips, &skips(1, &[1, 4])[..20]);
    assert_eq!(e.code(), ErrorCode::BadFrame);
}

#[test]
fn random_bytes_never_panic_the_decoder() {
    let mut x = 0x9e3779b97f4a7c15u64;
    for _ in 0..20_000 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let len = (x % 80) as usize;
        let mut buf: Vec<u8> = (0..len)
            .map(|i| (x >> (i % 8 * 8)) as u8 ^ i as u8)
            .collect();
        if len > 6 {
            buf[..4].copy_from_slice(b"SFLW");
            buf[4] = 1;
        }
        let _ = decode_frame(&buf, 1 << 16);
    }
}

const TEN_SECONDS: Duration = Duration::from_secs(10);

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
    let (s, _) = l.accept().unwrap();
    (c, s)
}

#[test]
fn handshake_authenticates_both_sides() {
    let token = JobToken::new("a-job-token-of-some-length").unwrap();
    let (mut c, mut s) = pair();
    let t2 = token.clone();
    let server =
        thread::spawn(move || accept(&mut s, &t2, Service::Summation, TEN_SECONDS, |_| Ok(())));
    let me = Peer {
        role: Role::Worker,
        rank: Some(2),
        name: "w2".into(),
    };
    connect(&mut c, &token, Service::Summation, &me).unwrap();
    assert_eq!(server.join().unwrap().unwrap().0, me);
}

#[test]
fn wrong_token_is_refused_and_told() {
    let token = JobToken::new("a-job-token-of-some-length").unwrap();
    let wrong = JobToken::new("another-token-entirely!!").unwrap();
    let (mut c, mut s) = pair();
    let server = thread::spawn(move || {
        accept(
            &mut s,
            &token,
            Service::Coordinator,
            TEN_SECONDS,
            |_| Ok(()),
        )
    });
    let me = Peer {
        role: Role::Server,
        rank: None,
        name: "intruder".into(),
    };
    let err = connect(&mut c, &wrong, Service::Coordinator, &me).unwrap_err();
    assert!(
        matches!(&err, WireError::Rejected(r) if r.code == ErrorCode::AuthFailed),
        "{err}"
    );
    let server_err = server.join().unwrap().unwrap_err();
    assert!(server_err.to_string().contains("intruder"), "{server_err}");
}

#[test]
fn wrong_service_is_named() {
    let token = JobToken::new("a-job-token-of-some-length").unwrap();
    let (mut c, mut s) = pair();
    let t2 = token.clone();
    let _server =
        thread::spawn(move || accept(&mut s, &t2, Service::Coordinator, TEN_SECONDS, |_| Ok(())));
    let me = Peer {
        role: Role::Worker,
        rank: Some(0),
        name: "w".into(),
    };
    let err = connect(&mut c, &token, Service::Summation, &me).unwrap_err();
    assert!(
        err.to_string().contains("this address is a coordinator"),
        "{err}"
    );
}

#[test]
fn admission_refusal_reaches_the_client_during_the_handshake() {
    let token = JobToken::new("a-job-token-of-some-length").unwrap();
    let (mut c, mut s) = pair();
    let t2 = token.clone();
    let server = thread::spawn(move || {
        accept(
            &mut s,
            &t2,
            Service::Summation,
            TEN_SECONDS,
            |p| -> Result<(), ErrorReply> {
                Err(ErrorReply {
                    code: ErrorCode::BadRank,
                    key: None,
                    message: format!("no rank {:?}", p.rank),
                })
            },
        )
    });
    let me = Peer {
        role: Role::Worker,
        rank: Some(9),
        name: "w9".into(),
    };
    let err = connect(&mut c, &token, Service::Summation, &me).unwrap_err();
    assert!(
        matches!(&err, WireError::Rejected(r) if r.code == ErrorCode::BadRank && r.message == "no rank Some(9)"),
        "{err}"
    );
    assert!(server.join().unwrap().is_err());
}

/// A Hello as the client would send it, with this name.
fn hello_bytes(name: &str) -> Vec<u8> {
    Message::Hello {
        role: Role::Worker,
        rank: Some(0),
        nonce: [7; 32],
        proof: [9; 32],
        name: name.into(),
    }
    .encode(0)
}

/// The service's side of one handshake, ending as `accept` does.
type Accepting = thread::JoinHandle<Result<(Peer, ()), WireError>>;

/// A summation service accepting one client with `deadline` on a thread, and the client's
/// end, past the service's Challenge.
fn accepting(deadline: Duration) -> (TcpStream, Accepting) {
    let token = JobToken::new("a-job-token-of-some-length").unwrap();
    let (mut c, mut s) = pair();
    let server =
        thread::spawn(move || accept(&mut s, &token, Service::Summation, deadline, |_| Ok(())));
    let (msg, _) = FrameReader::new(&mut c, HANDSHAKE_MAX_BODY)
        .read_owned()
        .unwrap();
    assert!(matches!(msg, Message::Challenge { .. }), "{msg:?}");
    (c, server)
}

#[test]
fn an_unauthenticated_hello_larger_than_the_handshake_limit_is_refused_unread() {
    let (mut c, server) = accepting(TEN_SECONDS);
    // A header announcing a 60 MiB Hello: refused on the header, nothing allocated for it.
    let header = crate::frame::Header {
        op: Op::Hello,
        body_len: 60 << 20,
        lent: false,
    };
    c.write_all(&header.encode()).unwrap();
    let err = server.join().unwrap().unwrap_err();
    assert!(
        matches!(err, WireError::FrameTooLarge { .. }),
        "{err} (limit {HANDSHAKE_MAX_BODY})"
    );
}

#[test]
fn a_client_trickling_its_hello_is_held_to_one_deadline_for_the_whole_handshake() {
    let deadline = Duration::from_millis(600);
    let started = Instant::now();
    let (mut c, server) = accepting(deadline);
    // One byte every 100 ms: each read succeeds well within any per-read timeout.
    let trickle = thread::spawn(move || {
        for b in hello_bytes("slow") {
            if c.write_all(&[b]).is_err() {
                return;
            }
            thread::sleep(Duration::from_millis(100));
        }
    });
    let err = server.join().unwrap().unwrap_err();
    let took = started.elapsed();
    assert!(
        took >= deadline && took < deadline * 3,
        "gave up after {took:?}"
    );
    let text = err.to_string();
    assert!(matches!(err, WireError::Timeout { .. }), "{text}");
    assert!(
        text.contains("the client's Hello") && !text.contains("0.0s"),
        "{text}"
    );
    drop(trickle);
}

#[test]
fn peer_chosen_names_with_control_characters_are_refused() {
    for name in [
        "evil\n2026-11-26 INFO forged line",
        "\u{1b}[31mred",
        "tab\there",
    ] {
        let bytes = hello_bytes(name);
        let err = decode_frame(&bytes, 1 << 20).unwrap_err();
        assert!(
            matches!(&err, WireError::BadField { field: "name", .. }),
            "{name:?}: {err}"
        );
        // The refusal does not repeat the name.
        assert!(!err.to_string().contains("forged"), "{err}");
    }
    assert!(decode_frame(&hello_bytes("worker 3 on gpu-07 (pid 4121) ü"), 1 << 20).is_ok());
}

#[test]
fn a_refused_clients_name_is_logged_escaped() {
    let (mut c, server) = accepting(TEN_SECONDS);
    c.write_all(&hello_bytes("a \"quoted\" name")).unwrap();
    let mut sink = Vec::new();
    let _ = c.read_to_end(&mut sink);
    let err = server.join().unwrap().unwrap_err().to_string();
    assert!(err.contains(r#""a \"quoted\" name""#), "{err}");
}

/// The protocol versions and, for each, a digest of every sample frame's bytes (FNV-1a).
/// A change to any frame's layout changes the digest and must come with a new
/// [`crate::frame::VERSION`]: peers of different builds then refuse each other by the
/// header ("unsupported protocol version 2 (this build speaks version 3)") instead of
/// misreading a body.
const LAYOUT_DIGESTS: &[(u8, u64)] = &[(2, 0x0522_f217_19ec_9f46), (3, 0x75ba_bec3_d369_6a57)];

#[test]
fn a_frame_layout_change_comes_with_a_new_protocol_version() {
    let samples = samples();
    // Every op has a sample, so no frame's layout escapes the digest.
    for code in 0..=u8::MAX {
        if let Some(op) = Op::from_code(code) {
            assert!(
                samples.iter().any(|(m, _)| m.op() == op),
                "no sample frame for {op:?}: add one to samples()"
            );
        }
    }
    let mut digest = 0xcbf2_9ce4_8422_2325u64;
    for (msg, payload) in &samples {
        for b in msg.encode_with_payload(payload) {
            digest = (digest ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    }
    let version = crate::frame::VERSION;
    let pinned = LAYOUT_DIGESTS.iter().find(|(v, _)| *v == version);
    assert_eq!(
        pinned.map(|(_, d)| *d),
        Some(digest),
        "the sample frames' bytes changed under protocol version {version} (digest \
         {digest:#018x}). If a frame's layout changed, raise VERSION in frame.rs, say what \
         changed in docs/protocol.md, and pin the new version's digest here; if only the \
         samples changed, pin the new digest for this version."
    );
}
