//! Message bodies: layout, encoding and stateless validation.
//!
//! Three ops carry a bulk payload after a fixed 24-byte meta block (`InitKey`, `Push`,
//! `PullReply`). Their `Message` value describes the payload; the bytes themselves are
//! streamed by [`crate::io`] straight into the receiver's buffer, never through a `Vec`.

use crate::cluster::{ClusterMap, NodeId, NodeInfo, Role};
use crate::codec::{Dec, Enc, MAX_NODES};
use crate::compression::{Codec, KeyCodec};
use crate::dtype::Dtype;
use crate::error::{ErrorCode, WireError};
use crate::frame::{Header, Lent, Op, HEADER_LEN, LENT_LEN};

/// Length of the meta block that precedes the payload of `InitKey`, `Push` and `PullReply`.
pub const DATA_META_LEN: usize = 24;
pub const NONCE_LEN: usize = 32;
/// A mailbox's slot states fill its first `MAILBOX_HEADER_BYTES` (one 32-bit word per
/// slot, push slots first); the slots follow, each `slot_bytes` long.
pub const MAILBOX_HEADER_BYTES: u64 = 4096;
/// At most this many slots of each kind (the header holds both kinds' states).
pub const MAILBOX_MAX_SLOTS: u32 = 512;
/// The largest mailbox slot; slots are whole multiples of 4096 bytes.
pub const MAILBOX_MAX_SLOT_BYTES: u64 = 256 << 20;
pub const PROOF_LEN: usize = 32;
const NO_RANK: u32 = u32::MAX;

/// Which service accepted a connection; a client checks it to catch a wrong address early.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Service {
    Summation = 1,
    Coordinator = 2,
}

impl Service {
    fn from_code(code: u8) -> Option<Service> {
        match code {
            1 => Some(Service::Summation),
            2 => Some(Service::Coordinator),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Service::Summation => "summation server",
            Service::Coordinator => "coordinator",
        }
    }
}

/// What a push means.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PushMode {
    /// Synchronous round: combined with every other worker's push of the same round.
    Sum,
    /// Asynchronous training (BytePS §4.3, Fig. 11b): a delta added at once to the key's
    /// stored value, whatever the other workers have pushed; the worker's pull of the
    /// same round then returns the stored value. `staleness` (stale-synchronous
    /// parallel): that pull waits until every other worker has pushed at least round
    /// minus `staleness`; `None`, never. Every push of a key carries the same bound.
    Delta { staleness: Option<u32> },
    /// The worker takes part in the round but contributes nothing, so the push has no
    /// payload. Bytes that only some workers hold (an allgather's regions, a broadcast's
    /// root) are pushed by those workers; the others skip, and no zeros cross the wire.
    Skip,
}

/// The staleness field of a delta push that waits for nobody.
const UNBOUNDED: u32 = u32::MAX;

impl PushMode {
    /// The mode's code in a push's meta block.
    pub fn code(self) -> u8 {
        match self {
            PushMode::Sum => 0,
            PushMode::Delta { .. } => 1,
            PushMode::Skip => 2,
        }
    }

    /// The four bytes after the op: a delta's staleness bound, else zero.
    fn staleness_field(self) -> u32 {
        match self {
            PushMode::Delta { staleness } => staleness.unwrap_or(UNBOUNDED),
            PushMode::Sum | PushMode::Skip => 0,
        }
    }

    pub fn is_delta(self) -> bool {
        matches!(self, PushMode::Delta { .. })
    }
}

/// How a round's pushes are combined, carried by each push (every push of a round must
/// carry the same op). Compressed keys are only summed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum ReduceOp {
    Sum = 0,
    Min = 1,
    Max = 2,
    Product = 3,
}

impl ReduceOp {
    pub const ALL: [ReduceOp; 4] = [
        ReduceOp::Sum,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Product,
    ];

    pub fn from_code(code: u8) -> Option<ReduceOp> {
        Self::ALL.get(code as usize).copied()
    }

    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Product => "product",
        }
    }
}

impl std::fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What follows an `InitKey`'s meta block, its `has_init` byte.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum KeyInit {
    /// 0: nothing; the key starts at zeros.
    Zeros,
    /// 1: the key's initial value, `byte_len` bytes (raw keys only), streamed into the
    /// receiver's buffer like any payload.
    Value,
    /// 2: the key's members, the workers whose pushes make up each of its rounds: at least
    /// one rank, distinct and strictly ascending (raw keys only; no initial value). A few
    /// bytes of control data, so they are decoded with the meta block, not streamed.
    Members(Vec<u32>),
}

impl KeyInit {
    fn code(&self) -> u8 {
        match self {
            KeyInit::Zeros => 0,
            KeyInit::Value => 1,
            KeyInit::Members(_) => INIT_MEMBERS,
        }
    }
}

/// Offset of `has_init` in InitKey's meta block (after `key u64`, `byte_len u64`, `dtype u8`).
const HAS_INIT_AT: usize = 17;
/// The `has_init` value of a member list.
const INIT_MEMBERS: u8 = 2;
/// The longest member list: a count and [`MAX_NODES`] ranks.
const MAX_MEMBERS_BYTES: usize = 4 + 4 * MAX_NODES;

/// Which nodes a barrier waits for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum BarrierGroup {
    Workers = 1,
    All = 2,
    /// The workers' barriers of `join()`: workers only, numbered apart from the
    /// [`Workers`](BarrierGroup::Workers) group's, so that a worker waiting in `join()`
    /// never meets another in an ordinary barrier.
    Join = 3,
}

/// What a node tells the coordinator when it joins.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Registration {
    pub role: Role,
    /// A rank the node wants (e.g. torchrun's RANK); `None` lets the coordinator choose.
    pub requested_rank: Option<u32>,
    pub host: String,
    pub port: u16,
    pub host_id: String,
    pub pid: u32,
    /// See [`NodeInfo::link_mbit`].
    pub link_mbit: u32,
    pub name: String,
}

/// The body of an `Error` frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ErrorReply {
    pub code: ErrorCode,
    /// The key the error concerns, when there is one.
    pub key: Option<u64>,
    pub message: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    Challenge {
        service: Service,
        nonce: [u8; NONCE_LEN],
    },
    Hello {
        role: Role,
        rank: Option<u32>,
        nonce: [u8; NONCE_LEN],
        proof: [u8; PROOF_LEN],
        name: String,
    },
    Welcome {
        service: Service,
        proof: [u8; PROOF_LEN],
    },
    Register(Registration),
    ClusterMap {
        your_rank: u32,
        map: ClusterMap,
    },
    /// A worker declares a tensor before its first push. Every worker must declare each
    /// name with the same dtype, element count and description; the coordinator checks that.
    Declare {
        /// The tensor's name, e.g. "layer1.0.conv1.weight"; never empty.
        name: String,
        dtype: Dtype,
        /// Number of elements; positive, and small enough that the tensor's byte length
        /// fits in a `u64`.
        elements: u64,
        /// How the tensor travels, described for people (e.g. "compressed by topk (ratio
        /// 0.01) with error feedback", "summed over workers [0, 2]"); empty for raw
        /// elements summed over every worker. Compared as text, like dtype and size.
        compression: String,
    },
    /// The coordinator's answer to a `Declare`: the job-wide id of the named tensor,
    /// assigned in the order of first declaration across the job, so every worker gets
    /// the same id for the same name whatever order it declared in.
    Declared {
        name: String,
        tensor_id: u32,
    },
    /// A worker will never push the tensor again: the coordinator removes the name from
    /// its table once every worker that declared it has sent this. `tensor_id` is the id
    /// the worker was given, so a stale or mistaken frame cannot remove another tensor.
    /// No reply.
    Undeclare {
        name: String,
        tensor_id: u32,
    },
    /// A worker will never push or pull `key` again; it follows the worker's last pull of
    /// the key on the same connection. The server frees the key once every worker of the
    /// key (its members, or every worker) has retired it. No reply.
    Retire {
        key: u64,
    },
    /// Payload: the initial value (`byte_len` bytes) when `init` is [`KeyInit::Value`], the
    /// member list (part of the decoded message, not a streamed payload) when it is
    /// [`KeyInit::Members`], else empty. `byte_len` is the key's uncompressed length;
    /// `codec` fixes how every payload of the key is encoded (a compressed key has neither
    /// an initial value nor members).
    InitKey {
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        init: KeyInit,
        codec: KeyCodec,
    },
    InitAck {
        key: u64,
    },
    /// Payload: the pushed elements (none when `mode` is [`PushMode::Skip`]).
    Push {
        key: u64,
        round: u64,
        dtype: Dtype,
        codec: Codec,
        mode: PushMode,
        op: ReduceOp,
    },
    /// `wants_sum` false: the worker takes no bytes of this round, only the notice that it
    /// is complete (a `PullReply` without payload), which lets it push the next round.
    Pull {
        key: u64,
        round: u64,
        wants_sum: bool,
    },
    /// `workers`, of the sender's machine, take part in `round` of `key` without
    /// contributing, and want no notice of its end: the sender's push of the round
    /// carries their machine's sum (BytePS §4.2.2), so they send nothing for the key
    /// themselves. As if each had pushed a skip and pulled without wanting the sum; no
    /// reply. `op` is the round's, as a skip's push would carry it.
    Skips {
        key: u64,
        round: u64,
        op: ReduceOp,
        workers: Vec<u32>,
    },
    /// The server has read a push (whatever the other workers have done): the worker's
    /// scheduler counts its credit by these.
    PushAck {
        key: u64,
        round: u64,
    },
    /// A worker has joined (`joined` true: it has finished its data, and the key's rounds
    /// complete without it, as if it pushed nothing) or leaves join (false). The server
    /// answers `JoinAck` once every engine applied it.
    Join {
        joined: bool,
    },
    /// The server has applied the worker's `Join` to every key.
    JoinAck {
        joined: bool,
    },
    /// The round `round` of `key`, which this worker waits on, has waited `waited_ms`
    /// milliseconds for the pushes of workers `missing` (ranks, ascending): sent to every
    /// waiting worker when a round waits longer than the server's stall warning, and again
    /// after each further such stretch. Nothing to answer.
    Stalled {
        key: u64,
        round: u64,
        waited_ms: u64,
        missing: Vec<u32>,
    },
    /// Payload: the round's result; none for a pull that did not want it.
    PullReply {
        key: u64,
        round: u64,
        dtype: Dtype,
        codec: Codec,
    },
    Barrier {
        id: u64,
        group: BarrierGroup,
    },
    BarrierDone {
        id: u64,
        /// The node whose arrival completed the barrier (the last to enter it); for a
        /// barrier that a departure completed, the last of those still waiting.
        last: NodeId,
    },
    Heartbeat {
        seq: u64,
    },
    HeartbeatAck {
        seq: u64,
    },
    NodeFailed {
        node: NodeId,
        name: String,
        reason: String,
    },
    /// Worker -> a server on its own machine: shared memory for this connection's
    /// payloads (its file descriptor comes with the frame, as Unix sockets pass them):
    /// `push_slots` slots the worker lends pushes in, then `pull_slots` the server lends
    /// sums in, each `slot_bytes` long, after [`MAILBOX_HEADER_BYTES`] of slot states.
    Mailbox {
        push_slots: u32,
        pull_slots: u32,
        slot_bytes: u64,
    },
    /// The server maps the mailbox (`accepted`) or says why not; either way the
    /// connection goes on, lent frames only after an acceptance.
    MailboxAck {
        accepted: bool,
        reason: String,
    },
    Shutdown {
        reason: String,
    },
    Error(ErrorReply),
}

impl Message {
    pub fn op(&self) -> Op {
        match self {
            Message::Challenge { .. } => Op::Challenge,
            Message::Hello { .. } => Op::Hello,
            Message::Welcome { .. } => Op::Welcome,
            Message::Register(_) => Op::Register,
            Message::ClusterMap { .. } => Op::ClusterMap,
            Message::Declare { .. } => Op::Declare,
            Message::Declared { .. } => Op::Declared,
            Message::Undeclare { .. } => Op::Undeclare,
            Message::Retire { .. } => Op::Retire,
            Message::InitKey { .. } => Op::InitKey,
            Message::InitAck { .. } => Op::InitAck,
            Message::Push { .. } => Op::Push,
            Message::Pull { .. } => Op::Pull,
            Message::Skips { .. } => Op::Skips,
            Message::PushAck { .. } => Op::PushAck,
            Message::Join { .. } => Op::Join,
            Message::JoinAck { .. } => Op::JoinAck,
            Message::Stalled { .. } => Op::Stalled,
            Message::PullReply { .. } => Op::PullReply,
            Message::Barrier { .. } => Op::Barrier,
            Message::BarrierDone { .. } => Op::BarrierDone,
            Message::Heartbeat { .. } => Op::Heartbeat,
            Message::HeartbeatAck { .. } => Op::HeartbeatAck,
            Message::NodeFailed { .. } => Op::NodeFailed,
            Message::Mailbox { .. } => Op::Mailbox,
            Message::MailboxAck { .. } => Op::MailboxAck,
            Message::Shutdown { .. } => Op::Shutdown,
            Message::Error(_) => Op::Error,
        }
    }

    pub fn error(code: ErrorCode, key: Option<u64>, message: impl Into<String>) -> Message {
        Message::Error(ErrorReply {
            code,
            key,
            message: message.into(),
        })
    }

    /// Encodes header and body, except the payload of data ops, whose length
    /// `payload_len` is counted in the header; the caller writes the payload next.
    pub fn encode(&self, payload_len: usize) -> Vec<u8> {
        self.encode_framed(payload_len, false)
    }

    /// Encodes a lent frame: header and meta block, and the locator of the payload in the
    /// connection's mailbox.
    pub fn encode_lent(&self, lent: Lent) -> Vec<u8> {
        debug_assert!(self.op().may_lend(), "{} frames lend nothing", self.op());
        let mut out = self.encode_framed(LENT_LEN, true);
        out.extend_from_slice(&lent.encode());
        out
    }

    fn encode_framed(&self, payload_len: usize, lent: bool) -> Vec<u8> {
        let mut e = Enc::default();
        e.buf.resize(HEADER_LEN, 0);
        self.encode_body(&mut e);
        debug_assert!(self.op().has_payload() || payload_len == 0);
        let body_len = e.buf.len() - HEADER_LEN + payload_len;
        let header = Header {
            op: self.op(),
            body_len: u32::try_from(body_len).expect("frame body fits in u32"),
            lent,
        };
        e.buf[..HEADER_LEN].copy_from_slice(&header.encode());
        e.buf
    }

    /// Encodes a whole frame, payload included (control path and tests).
    pub fn encode_with_payload(&self, payload: &[u8]) -> Vec<u8> {
        let mut out = self.encode(payload.len());
        out.extend_from_slice(payload);
        out
    }

    fn encode_body(&self, e: &mut Enc) {
        match self {
            Message::Challenge { service, nonce } => {
                e.u8(*service as u8).bytes(nonce);
            }
            Message::Hello {
                role,
                rank,
                nonce,
                proof,
                name,
            } => {
                e.u8(*role as u8)
                    .u32(rank.unwrap_or(NO_RANK))
                    .bytes(nonce)
                    .bytes(proof)
                    .string(name);
            }
            Message::Welcome { service, proof } => {
                e.u8(*service as u8).bytes(proof);
            }
            Message::Register(r) => {
                e.u8(r.role as u8)
                    .u32(r.requested_rank.unwrap_or(NO_RANK))
                    .u16(r.port)
                    .u32(r.pid)
                    .u32(r.link_mbit)
                    .string(&r.host)
                    .string(&r.host_id)
                    .string(&r.name);
            }
            Message::ClusterMap { your_rank, map } => {
                e.u32(*your_rank).string(&map.job_id);
                for nodes in [&map.workers, &map.servers] {
                    e.u32(nodes.len() as u32);
                    for n in nodes {
                        e.u32(n.rank)
                            .u16(n.port)
                            .u32(n.pid)
                            .u32(n.link_mbit)
                            .string(&n.host)
                            .string(&n.host_id)
                            .string(&n.name);
                    }
                }
            }
            Message::Declare {
                name,
                dtype,
                elements,
                compression,
            } => {
                e.string(name)
                    .u8(*dtype as u8)
                    .u64(*elements)
                    .string(compression);
            }
            Message::Declared { name, tensor_id } => {
                e.string(name).u32(*tensor_id);
            }
            Message::Undeclare { name, tensor_id } => {
                e.string(name).u32(*tensor_id);
            }
            Message::Retire { key } => {
                e.u64(*key);
            }
            Message::Stalled {
                key,
                round,
                waited_ms,
                missing,
            } => {
                e.u64(*key)
                    .u64(*round)
                    .u64(*waited_ms)
                    .u32(missing.len() as u32);
                for rank in missing {
                    e.u32(*rank);
                }
            }
            Message::InitKey {
                key,
                dtype,
                byte_len,
                init,
                codec,
            } => {
                e.u64(*key)
                    .u64(*byte_len)
                    .u8(*dtype as u8)
                    .u8(init.code())
                    .u8(codec.codec as u8)
                    .u8(codec.feedback as u8)
                    .u32(codec.param);
                if let KeyInit::Members(ranks) = init {
                    e.u32(ranks.len() as u32);
                    for r in ranks {
                        e.u32(*r);
                    }
                }
            }
            Message::InitAck { key } => {
                e.u64(*key);
            }
            Message::Push {
                key,
                round,
                dtype,
                codec,
                mode,
                op,
            } => {
                e.u64(*key)
                    .u64(*round)
                    .u8(*dtype as u8)
                    .u8(*codec as u8)
                    .u8(mode.code())
                    .u8(*op as u8)
                    .u32(mode.staleness_field());
            }
            Message::Pull {
                key,
                round,
                wants_sum,
            } => {
                e.u64(*key).u64(*round).u8(u8::from(*wants_sum));
            }
            Message::Skips {
                key,
                round,
                op,
                workers,
            } => {
                e.u64(*key)
                    .u64(*round)
                    .u8(*op as u8)
                    .u32(workers.len() as u32);
                for rank in workers {
                    e.u32(*rank);
                }
            }
            Message::PushAck { key, round } => {
                e.u64(*key).u64(*round);
            }
            Message::PullReply {
                key,
                round,
                dtype,
                codec,
            } => {
                e.u64(*key)
                    .u64(*round)
                    .u8(*dtype as u8)
                    .u8(*codec as u8)
                    .zeros(6);
            }
            Message::Barrier { id, group } => {
                e.u64(*id).u8(*group as u8);
            }
            Message::BarrierDone { id, last } => {
                e.u64(*id).u8(last.role as u8).u32(last.rank);
            }
            Message::Join { joined } | Message::JoinAck { joined } => {
                e.u8(u8::from(*joined));
            }
            Message::Heartbeat { seq } | Message::HeartbeatAck { seq } => {
                e.u64(*seq);
            }
            Message::NodeFailed { node, name, reason } => {
                e.u8(node.role as u8)
                    .u32(node.rank)
                    .string(name)
                    .string(reason);
            }
            Message::Mailbox {
                push_slots,
                pull_slots,
                slot_bytes,
            } => {
                e.u32(*push_slots).u32(*pull_slots).u64(*slot_bytes);
            }
            Message::MailboxAck { accepted, reason } => {
                e.u8(u8::from(*accepted)).string(reason);
            }
            Message::Shutdown { reason } => {
                e.string(reason);
            }
            Message::Error(err) => {
                e.u16(err.code as u16)
                    .u8(err.key.is_some() as u8)
                    .u64(err.key.unwrap_or(0))
                    .string(&err.message);
            }
        }
    }

    /// Decodes a body. For data ops `body` is the 24-byte meta block (with, for an `InitKey`
    /// with members, its member list: see `inline_len`) and `payload_len` the number of
    /// payload bytes that follow it on the wire; for other ops `body` is the whole body and
    /// `payload_len` must be 0.
    pub fn decode(op: Op, body: &[u8], payload_len: usize) -> Result<Message, WireError> {
        let mut d = Dec::new(op, body);
        let msg = match op {
            Op::Challenge => Message::Challenge {
                service: service(&mut d)?,
                nonce: d.array("nonce")?,
            },
            Op::Hello => Message::Hello {
                role: role(&mut d)?,
                rank: rank(&mut d, "rank")?,
                nonce: d.array("nonce")?,
                proof: d.array("proof")?,
                name: label(&mut d, "name")?,
            },
            Op::Welcome => Message::Welcome {
                service: service(&mut d)?,
                proof: d.array("proof")?,
            },
            Op::Register => Message::Register(Registration {
                role: role(&mut d)?,
                requested_rank: rank(&mut d, "requested_rank")?,
                port: d.u16("port")?,
                pid: d.u32("pid")?,
                link_mbit: d.u32("link_mbit")?,
                host: label(&mut d, "host")?,
                host_id: label(&mut d, "host_id")?,
                name: label(&mut d, "name")?,
            }),
            Op::ClusterMap => {
                let your_rank = d.u32("your_rank")?;
                let job_id = d.string("job_id")?;
                let workers = nodes(&mut d, "workers")?;
                let servers = nodes(&mut d, "servers")?;
                Message::ClusterMap {
                    your_rank,
                    map: ClusterMap {
                        job_id,
                        workers,
                        servers,
                    },
                }
            }
            Op::Declare => {
                let name = tensor_name(&mut d)?;
                let dtype = dtype(&mut d)?;
                let elements = d.u64("elements")?;
                declared_size(&d, dtype, elements)?;
                Message::Declare {
                    name,
                    dtype,
                    elements,
                    compression: d.string("compression")?,
                }
            }
            Op::Declared => Message::Declared {
                name: tensor_name(&mut d)?,
                tensor_id: d.u32("tensor_id")?,
            },
            Op::Undeclare => Message::Undeclare {
                name: tensor_name(&mut d)?,
                tensor_id: d.u32("tensor_id")?,
            },
            Op::Retire => Message::Retire { key: d.u64("key")? },
            Op::Stalled => Message::Stalled {
                key: d.u64("key")?,
                round: d.u64("round")?,
                waited_ms: d.u64("waited_ms")?,
                missing: members(&mut d)?,
            },
            Op::InitKey => {
                let key = d.u64("key")?;
                let byte_len = d.u64("byte_len")?;
                let dtype = dtype(&mut d)?;
                let has_init = d.u8("has_init")?;
                if has_init > INIT_MEMBERS {
                    return Err(d.bad("has_init", format!("{has_init} is not 0, 1 or 2")));
                }
                let codec = KeyCodec {
                    codec: codec(&mut d)?,
                    feedback: flag(&mut d, "feedback")?,
                    param: d.u32("codec_param")?,
                };
                if byte_len == 0 || !byte_len.is_multiple_of(dtype.size() as u64) {
                    return Err(d.bad(
                        "byte_len",
                        format!(
                            "{byte_len} is not a positive multiple of {dtype}'s {} bytes",
                            dtype.size()
                        ),
                    ));
                }
                codec
                    .check(dtype, byte_len / dtype.size() as u64)
                    .map_err(|why| d.bad("codec", why.to_string()))?;
                let init = match has_init {
                    0 => KeyInit::Zeros,
                    1 if !codec.is_raw() => {
                        return Err(d.bad("has_init", "a compressed key has no initial value"))
                    }
                    1 => KeyInit::Value,
                    // Compressed sums are re-encoded for every worker alike; members are
                    // for raw keys only, which is all process sets need.
                    _ if !codec.is_raw() => {
                        return Err(d.bad("codec", "a key with members must be raw (codec 0)"))
                    }
                    _ => KeyInit::Members(members(&mut d)?),
                };
                let expected = if init == KeyInit::Value { byte_len } else { 0 };
                if payload_len as u64 != expected {
                    return Err(d.bad(
                        "payload",
                        format!("{payload_len} bytes of initial value, expected {expected}"),
                    ));
                }
                Message::InitKey {
                    key,
                    dtype,
                    byte_len,
                    init,
                    codec,
                }
            }
            Op::InitAck => Message::InitAck { key: d.u64("key")? },
            Op::Push => {
                let key = d.u64("key")?;
                let round = d.u64("round")?;
                let dtype = dtype(&mut d)?;
                let codec = codec(&mut d)?;
                let mode = d.u8("mode")?;
                let op = reduce_op(&mut d)?;
                let mode = match mode {
                    0 => {
                        d.zeros(4, "reserved")?;
                        PushMode::Sum
                    }
                    1 => {
                        let bound = d.u32("staleness")?;
                        PushMode::Delta {
                            staleness: (bound != UNBOUNDED).then_some(bound),
                        }
                    }
                    2 => {
                        d.zeros(4, "reserved")?;
                        PushMode::Skip
                    }
                    v => return Err(d.bad("mode", format!("unknown push mode {v}"))),
                };
                if mode.is_delta() && codec != Codec::Raw {
                    return Err(d.bad(
                        "codec",
                        format!("a delta push carries raw elements, not {codec}"),
                    ));
                }
                if op != ReduceOp::Sum && (codec != Codec::Raw || mode.is_delta()) {
                    return Err(d.bad(
                        "op",
                        format!("a {codec} {mode:?} push can only be summed, not reduced by {op}"),
                    ));
                }
                if mode == PushMode::Skip {
                    if payload_len != 0 {
                        return Err(d.bad(
                            "payload",
                            format!("a push that skips its round carries {payload_len} bytes"),
                        ));
                    }
                } else {
                    payload(&d, dtype, codec, payload_len)?;
                }
                Message::Push {
                    key,
                    round,
                    dtype,
                    codec,
                    mode,
                    op,
                }
            }
            Op::Pull => Message::Pull {
                key: d.u64("key")?,
                round: d.u64("round")?,
                wants_sum: flag(&mut d, "wants_sum")?,
            },
            Op::Skips => {
                let key = d.u64("key")?;
                let round = d.u64("round")?;
                let op = reduce_op(&mut d)?;
                Message::Skips {
                    key,
                    round,
                    op,
                    workers: members(&mut d)?,
                }
            }
            Op::PushAck => Message::PushAck {
                key: d.u64("key")?,
                round: d.u64("round")?,
            },
            Op::PullReply => {
                let key = d.u64("key")?;
                let round = d.u64("round")?;
                let dtype = dtype(&mut d)?;
                let codec = codec(&mut d)?;
                d.zeros(6, "reserved")?;
                // An empty reply answers a pull that wanted only the round's completion.
                if payload_len != 0 {
                    payload(&d, dtype, codec, payload_len)?;
                }
                Message::PullReply {
                    key,
                    round,
                    dtype,
                    codec,
                }
            }
            Op::Barrier => Message::Barrier {
                id: d.u64("id")?,
                group: match d.u8("group")? {
                    1 => BarrierGroup::Workers,
                    2 => BarrierGroup::All,
                    3 => BarrierGroup::Join,
                    v => return Err(d.bad("group", format!("unknown barrier group {v}"))),
                },
            },
            Op::BarrierDone => Message::BarrierDone {
                id: d.u64("id")?,
                last: NodeId {
                    role: role(&mut d)?,
                    rank: d.u32("last_rank")?,
                },
            },
            Op::Join => Message::Join {
                joined: flag(&mut d, "joined")?,
            },
            Op::JoinAck => Message::JoinAck {
                joined: flag(&mut d, "joined")?,
            },
            Op::Mailbox => {
                let push_slots = d.u32("push_slots")?;
                let pull_slots = d.u32("pull_slots")?;
                let slot_bytes = d.u64("slot_bytes")?;
                for (field, n) in [("push_slots", push_slots), ("pull_slots", pull_slots)] {
                    if n == 0 || n > MAILBOX_MAX_SLOTS {
                        return Err(d.bad(
                            field,
                            format!("{n} slots (1 to {MAILBOX_MAX_SLOTS} allowed)"),
                        ));
                    }
                }
                if slot_bytes == 0
                    || slot_bytes > MAILBOX_MAX_SLOT_BYTES
                    || !slot_bytes.is_multiple_of(4096)
                {
                    return Err(d.bad(
                        "slot_bytes",
                        format!(
                            "{slot_bytes} bytes is not a multiple of 4096 up to \
                             {MAILBOX_MAX_SLOT_BYTES}"
                        ),
                    ));
                }
                Message::Mailbox {
                    push_slots,
                    pull_slots,
                    slot_bytes,
                }
            }
            Op::MailboxAck => Message::MailboxAck {
                accepted: flag(&mut d, "accepted")?,
                reason: d.string("reason")?,
            },
            Op::Heartbeat => Message::Heartbeat { seq: d.u64("seq")? },
            Op::HeartbeatAck => Message::HeartbeatAck { seq: d.u64("seq")? },
            Op::NodeFailed => Message::NodeFailed {
                node: NodeId {
                    role: role(&mut d)?,
                    rank: d.u32("rank")?,
                },
                name: d.string("name")?,
                reason: d.string("reason")?,
            },
            Op::Shutdown => Message::Shutdown {
                reason: d.string("reason")?,
            },
            Op::Error => {
                let code = ErrorCode::from_u16(d.u16("code")?);
                let has_key = flag(&mut d, "has_key")?;
                let key = d.u64("key")?;
                if !has_key && key != 0 {
                    return Err(d.bad("key", "must be 0 when has_key is 0"));
                }
                Message::Error(ErrorReply {
                    code,
                    key: has_key.then_some(key),
                    message: d.string("message")?,
                })
            }
        };
        if !op.has_payload() && payload_len != 0 {
            return Err(WireError::TrailingBytes {
                op,
                extra: payload_len,
            });
        }
        d.finish()?;
        Ok(msg)
    }
}

fn service(d: &mut Dec<'_>) -> Result<Service, WireError> {
    let v = d.u8("service")?;
    Service::from_code(v).ok_or_else(|| d.bad("service", format!("unknown service {v}")))
}

fn role(d: &mut Dec<'_>) -> Result<Role, WireError> {
    let v = d.u8("role")?;
    Role::from_code(v).ok_or_else(|| d.bad("role", format!("unknown role {v}")))
}

/// A name a peer chose (its node name, host, host id), which ends up in logs and error
/// messages: printable only, so no peer can forge log lines or send terminal escapes.
fn label(d: &mut Dec<'_>, field: &'static str) -> Result<String, WireError> {
    let s = d.string(field)?;
    if s.chars().any(char::is_control) {
        return Err(d.bad(field, "contains control characters"));
    }
    Ok(s)
}

fn rank(d: &mut Dec<'_>, field: &'static str) -> Result<Option<u32>, WireError> {
    let v = d.u32(field)?;
    Ok((v != NO_RANK).then_some(v))
}

fn dtype(d: &mut Dec<'_>) -> Result<Dtype, WireError> {
    let v = d.u8("dtype")?;
    Dtype::from_code(v).ok_or_else(|| d.bad("dtype", format!("unknown dtype code {v}")))
}

fn reduce_op(d: &mut Dec<'_>) -> Result<ReduceOp, WireError> {
    let v = d.u8("op")?;
    ReduceOp::from_code(v).ok_or_else(|| d.bad("op", format!("unknown reduction {v}")))
}

fn codec(d: &mut Dec<'_>) -> Result<Codec, WireError> {
    let v = d.u8("codec")?;
    Codec::from_code(v).ok_or_else(|| d.bad("codec", format!("unknown payload codec {v}")))
}

fn flag(d: &mut Dec<'_>, field: &'static str) -> Result<bool, WireError> {
    match d.u8(field)? {
        0 => Ok(false),
        1 => Ok(true),
        v => Err(d.bad(field, format!("{v} is not 0 or 1"))),
    }
}

/// An `InitKey`'s member list: a count, then that many distinct ranks in ascending order,
/// and nothing after them. Whether each rank is in the job is the server's to check: only
/// it knows the job's size.
fn members(d: &mut Dec<'_>) -> Result<Vec<u32>, WireError> {
    let count = d.u32("members")? as usize;
    if count == 0 {
        return Err(d.bad("members", "a key's member list needs at least one rank"));
    }
    if count > MAX_NODES {
        return Err(d.bad("members", format!("{count} members exceeds {MAX_NODES}")));
    }
    if d.remaining() != 4 * count {
        return Err(d.bad(
            "members",
            format!(
                "the count says {count} ranks but {} bytes follow it, not {}",
                d.remaining(),
                4 * count
            ),
        ));
    }
    let mut ranks: Vec<u32> = Vec::with_capacity(count);
    for _ in 0..count {
        let rank = d.u32("members")?;
        if let Some(&last) = ranks.last() {
            if rank <= last {
                return Err(d.bad(
                    "members",
                    format!("rank {rank} after {last}: ranks must be distinct and ascending"),
                ));
            }
        }
        ranks.push(rank);
    }
    Ok(ranks)
}

/// How many of the `payload_len` bytes after a data frame's meta block belong to the
/// decoded message rather than a streamed payload: an `InitKey`'s member list, all of them;
/// otherwise none. Refuses a member list longer than any valid one before it is read.
pub(crate) fn inline_len(op: Op, meta: &[u8], payload_len: usize) -> Result<usize, WireError> {
    if op != Op::InitKey || meta.get(HAS_INIT_AT) != Some(&INIT_MEMBERS) {
        return Ok(0);
    }
    if payload_len > MAX_MEMBERS_BYTES {
        return Err(WireError::BadField {
            op,
            field: "members",
            why: format!("{payload_len} bytes is longer than a list of {MAX_NODES} ranks"),
        });
    }
    Ok(payload_len)
}

fn tensor_name(d: &mut Dec<'_>) -> Result<String, WireError> {
    let name = d.string("name")?;
    if name.is_empty() {
        return Err(d.bad("name", "a tensor name must not be empty"));
    }
    Ok(name)
}

/// A declared tensor must have elements, and its byte length must fit in a `u64` so that
/// no receiver overflows computing it.
fn declared_size(d: &Dec<'_>, dtype: Dtype, elements: u64) -> Result<(), WireError> {
    if elements == 0 {
        return Err(d.bad("elements", "a tensor must have at least one element"));
    }
    if elements.checked_mul(dtype.size() as u64).is_none() {
        return Err(d.bad(
            "elements",
            format!("{elements} elements of {dtype} do not fit in 2^64 bytes"),
        ));
    }
    Ok(())
}

/// A payload must hold something; raw elements must be whole. A compressed payload's exact
/// length depends on the key, which the service checks.
fn payload(d: &Dec<'_>, dtype: Dtype, codec: Codec, payload_len: usize) -> Result<(), WireError> {
    if codec != Codec::Raw {
        return match payload_len {
            0 => Err(d.bad("payload", format!("an empty {codec} payload"))),
            _ => Ok(()),
        };
    }
    if payload_len == 0 || !payload_len.is_multiple_of(dtype.size()) {
        return Err(d.bad(
            "payload",
            format!(
                "{payload_len} bytes is not a positive multiple of {dtype}'s {} bytes",
                dtype.size()
            ),
        ));
    }
    Ok(())
}

fn nodes(d: &mut Dec<'_>, field: &'static str) -> Result<Vec<NodeInfo>, WireError> {
    let count = d.u32(field)? as usize;
    if count > MAX_NODES {
        return Err(d.bad(field, format!("{count} nodes exceeds {MAX_NODES}")));
    }
    let mut out = Vec::with_capacity(count.min(1024));
    for i in 0..count {
        let n = NodeInfo {
            rank: d.u32("rank")?,
            port: d.u16("port")?,
            pid: d.u32("pid")?,
            link_mbit: d.u32("link_mbit")?,
            host: d.string("host")?,
            host_id: d.string("host_id")?,
            name: d.string("name")?,
        };
        if n.rank as usize != i {
            return Err(d.bad(field, format!("entry {i} has rank {}", n.rank)));
        }
        out.push(n);
    }
    Ok(out)
}

/// A whole frame decoded from a byte slice.
#[derive(Debug, PartialEq, Eq)]
pub struct DecodedFrame<'a> {
    pub message: Message,
    pub payload: &'a [u8],
    /// Bytes of `buf` the frame occupied.
    pub consumed: usize,
    /// Where a lent frame's payload lies (`payload` is then empty).
    pub lent: Option<Lent>,
}

/// Decodes the first frame in `buf`; `Ok(None)` when `buf` holds only part of it.
/// This is the fuzzed entry point; the streaming reader in [`crate::io`] shares every check.
pub fn decode_frame(buf: &[u8], max_body: u32) -> Result<Option<DecodedFrame<'_>>, WireError> {
    let Some(head) = buf.get(..HEADER_LEN) else {
        return Ok(None);
    };
    let header = Header::decode(head.try_into().expect("header length"), max_body)?;
    let end = HEADER_LEN + header.body_len as usize;
    let Some(body) = buf.get(HEADER_LEN..end) else {
        return Ok(None);
    };
    if header.lent {
        // The header checked the body's length: meta block and locator exactly.
        let (meta, locator) = body.split_at(DATA_META_LEN);
        let lent = Lent::decode(header.op, locator.try_into().expect("locator length"))?;
        let message = Message::decode(header.op, meta, lent.len as usize)?;
        return Ok(Some(DecodedFrame {
            message,
            payload: &[],
            consumed: end,
            lent: Some(lent),
        }));
    }
    let (meta, payload) = split_body(header.op, body)?;
    let message = Message::decode(header.op, meta, payload.len())?;
    Ok(Some(DecodedFrame {
        message,
        payload,
        consumed: end,
        lent: None,
    }))
}

/// Splits a body into meta block and payload for data ops.
fn split_body(op: Op, body: &[u8]) -> Result<(&[u8], &[u8]), WireError> {
    if !op.has_payload() {
        return Ok((body, &[]));
    }
    if body.len() < DATA_META_LEN {
        return Err(WireError::Truncated {
            op,
            field: "meta",
            need: DATA_META_LEN - body.len(),
        });
    }
    let inline = inline_len(op, &body[..DATA_META_LEN], body.len() - DATA_META_LEN)?;
    Ok(body.split_at(DATA_META_LEN + inline))
}
