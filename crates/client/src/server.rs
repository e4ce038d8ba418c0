//! A blocking client of one summation server.
//!
//! It splits into a sending half and a receiving half so that a pipeline can push later
//! partitions while it receives the sums of earlier ones on another thread.

use std::io::Write;
use std::net::Shutdown;
use std::os::fd::AsFd;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sumflow_wire::accounting::Counted;
use sumflow_wire::io::{self, FrameReader};
use sumflow_wire::{
    Codec, Dtype, JobToken, KeyCodec, KeyInit, Lent, Message, Peer, PushMode, ReduceOp, Role,
    Service, WireError,
};

use tracing::warn;

use crate::dial::connect_retrying;
use crate::error::{ClientError, Result};
use crate::link::{connect_local, send_with_fd, Link};
use crate::mailbox::{Mailbox, Side};

/// The shape of the mailbox a worker offers a server on its machine: enough push slots
/// for the pushes a server holds before summing them (a push window's worth and the
/// engine's batch) and pull slots for the sums the worker has not read yet; payloads
/// larger than a slot go through the socket. Pages are taken only as slots are written.
const MAILBOX_PUSH_SLOTS: u32 = 8;
const MAILBOX_PULL_SLOTS: u32 = 4;
const MAILBOX_SLOT_BYTES: u64 = 4 << 20;

#[derive(Clone, Debug)]
pub struct ServerOptions {
    /// How long to keep trying to connect (the server may still be starting).
    pub connect_timeout: Duration,
    /// Longest silence tolerated while waiting for a reply; `None` waits indefinitely
    /// (for a pipeline's receiver, idle between iterations, whose callers time out their
    /// own waits).
    pub reply_timeout: Option<Duration>,
    pub max_body: u32,
    /// Reaches a server on this machine through its Unix socket ([`crate::link`]), TCP
    /// otherwise; false always uses TCP (tests of the TCP path on one machine).
    pub machine_local: bool,
    /// Over the Unix socket, offers the server a mailbox ([`crate::mailbox`]), so that
    /// payloads pass through shared memory rather than the socket.
    pub mailbox: bool,
}

impl Default for ServerOptions {
    fn default() -> Self {
        ServerOptions {
            connect_timeout: Duration::from_secs(30),
            reply_timeout: Some(Duration::from_secs(300)),
            max_body: sumflow_wire::DEFAULT_MAX_BODY,
            machine_local: true,
            mailbox: true,
        }
    }
}

/// What a push carries.
#[derive(Clone, Copy, Debug)]
pub enum Pushed<'a> {
    /// Nothing: the worker takes part in the round without contributing.
    Skip,
    /// Raw elements.
    Raw(&'a [u8]),
    /// A compressed f32 key's payload, encoded by its codec.
    Compressed(Codec, &'a [u8]),
    /// Raw elements to add to an asynchronous key's stored value, and the staleness bound
    /// the worker's pull of the round then waits under ([`PushMode::Delta`]).
    Delta(&'a [u8], Option<u32>),
}

/// A round's sum as received.
#[derive(Debug, PartialEq, Eq)]
pub struct Pulled {
    pub key: u64,
    pub round: u64,
    pub dtype: Dtype,
    pub data: Vec<u8>,
}

/// A round's sum whose payload (`len` bytes) is still on the socket: the caller reads it
/// where it belongs with [`ServerReceiver::read_sum`], or drops it with
/// [`ServerReceiver::skip_sum`], before receiving anything else.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SumHeader {
    pub key: u64,
    pub round: u64,
    pub dtype: Dtype,
    pub codec: Codec,
    pub len: usize,
}

/// What the receiving half read: a sum (its payload read, [`Pulled`], or about to be,
/// [`SumHeader`]) or an acknowledgement.
#[derive(Debug, PartialEq, Eq)]
pub enum Reply<S = Pulled> {
    Sum(S),
    InitAck {
        key: u64,
    },
    /// The server has read the push of `key` at `round` (only from [`ServerReceiver::recv_header`]).
    PushAck {
        key: u64,
        round: u64,
    },
    HeartbeatAck {
        seq: u64,
    },
    /// The server has applied this worker's `Join` (joined, or left join) to every key.
    JoinAck {
        joined: bool,
    },
    /// A round this worker waits on has waited `waited` for the pushes of workers
    /// `missing` (the server's stall warning).
    Stalled {
        key: u64,
        round: u64,
        waited: Duration,
        missing: Vec<u32>,
    },
}

#[derive(Debug)]
pub struct ServerClient {
    pub tx: ServerSender,
    pub rx: ServerReceiver,
}

#[derive(Debug)]
pub struct ServerSender {
    stream: Counted<Link>,
    peer: String,
    mailbox: Option<Arc<Mailbox>>,
    /// Where the next push slot is looked for.
    cursor: u32,
    /// What lent payloads added to the count of bytes sent (see [`Self::bytes_sent`]).
    lent_bytes: u64,
    /// Pushes lent through the mailbox.
    lent_frames: u64,
}

#[derive(Debug)]
pub struct ServerReceiver {
    reader: FrameReader<Counted<Link>>,
    peer: String,
    mailbox: Option<Arc<Mailbox>>,
    /// The lent sum [`Self::recv_header`] returned, not yet read or skipped.
    pending_lent: Option<Lent>,
    lent_bytes: u64,
    /// Sums received through the mailbox.
    lent_frames: u64,
}

impl ServerClient {
    /// Connects as worker `rank` and authenticates with the job token.
    pub fn connect(
        addr: &str,
        token: &JobToken,
        rank: u32,
        name: &str,
        opts: &ServerOptions,
    ) -> Result<ServerClient> {
        let peer = format!("summation server at {addr}");
        let me = Peer {
            role: Role::Worker,
            rank: Some(rank),
            name: name.to_string(),
        };
        let handshake = |mut stream: Link| -> Result<Link> {
            stream.set_nodelay();
            stream
                .set_read_timeout(opts.reply_timeout)
                .map_err(|e| wire(&peer, e.into()))?;
            io::connect(&mut stream, token, Service::Summation, &me)
                .map_err(|e| ClientError::from_wire(&peer, e))?;
            Ok(stream)
        };
        let local = opts.machine_local.then(|| connect_local(addr)).flatten();
        let local = local.and_then(|s| match handshake(Link::Local(s)) {
            Ok(link) => Some(link),
            Err(e) => {
                warn!(server = addr, error = %e, "this machine's socket of the server failed; using TCP");
                None
            }
        });
        let stream = match local {
            Some(link) => link,
            None => handshake(Link::Tcp(connect_retrying(
                addr,
                "summation server",
                opts.connect_timeout,
            )?))?,
        };
        let (mailbox, (sent, received)) = match opts.mailbox {
            true => offer_mailbox(&stream, &peer, opts.max_body)?,
            false => (None, (0, 0)),
        };
        let read_half = stream.try_clone().map_err(|e| wire(&peer, e.into()))?;
        Ok(ServerClient {
            tx: ServerSender {
                stream: Counted::starting_at(stream, sent),
                peer: peer.clone(),
                mailbox: mailbox.clone(),
                cursor: 0,
                lent_bytes: 0,
                lent_frames: 0,
            },
            rx: ServerReceiver {
                reader: FrameReader::new(Counted::starting_at(read_half, received), opts.max_body),
                peer,
                mailbox,
                pending_lent: None,
                lent_bytes: 0,
                lent_frames: 0,
            },
        })
    }

    /// Whether this connection is the server's machine-local socket rather than TCP.
    pub fn is_machine_local(&self) -> bool {
        self.tx.stream.get_ref().is_local()
    }

    /// Whether payloads of this connection may pass through a mailbox the server took.
    pub fn has_mailbox(&self) -> bool {
        self.tx.mailbox.is_some()
    }

    /// How many pushes went, and sums came, through the mailbox rather than the socket.
    pub fn lent_frames(&self) -> (u64, u64) {
        (self.tx.lent_frames, self.rx.lent_frames)
    }

    /// Declares a key and waits for the server to accept it.
    pub fn init_key(
        &mut self,
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        initial: Option<&[u8]>,
    ) -> Result<()> {
        self.tx.init_key(key, dtype, byte_len, initial)?;
        self.init_acknowledged(key)
    }

    /// Declares a raw key whose rounds count only the workers `members` (distinct ranks,
    /// ascending) and waits for the server to accept it.
    pub fn init_member_key(
        &mut self,
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        members: &[u32],
    ) -> Result<()> {
        self.tx.init_member_key(key, dtype, byte_len, members)?;
        self.init_acknowledged(key)
    }

    /// Declares a compressed f32 key of `byte_len` uncompressed bytes and waits for the
    /// server to accept it.
    pub fn init_compressed_key(&mut self, key: u64, byte_len: u64, codec: KeyCodec) -> Result<()> {
        self.tx.init_compressed_key(key, byte_len, codec)?;
        self.init_acknowledged(key)
    }

    fn init_acknowledged(&mut self, key: u64) -> Result<()> {
        match self.rx.recv()? {
            Reply::InitAck { key: k } if k == key => Ok(()),
            other => Err(self.rx.unexpected(&other)),
        }
    }

    /// Pushes `data` for `round` and waits for the round's sum.
    pub fn push_pull(&mut self, key: u64, round: u64, dtype: Dtype, data: &[u8]) -> Result<Pulled> {
        self.tx.push(key, round, dtype, data)?;
        self.pull(key, round)
    }

    /// Asks for a round's sum and waits for it.
    pub fn pull(&mut self, key: u64, round: u64) -> Result<Pulled> {
        self.tx.pull(key, round, true)?;
        match self.rx.recv()? {
            Reply::Sum(p) if p.key == key && p.round == round => Ok(p),
            other => Err(self.rx.unexpected(&other)),
        }
    }

    /// Round trip to check the server is alive.
    pub fn heartbeat(&mut self, seq: u64) -> Result<()> {
        io::write_message(&mut self.tx.stream, &Message::Heartbeat { seq })
            .map_err(|e| wire(&self.tx.peer, e))?;
        match self.rx.recv()? {
            Reply::HeartbeatAck { seq: s } if s == seq => Ok(()),
            other => Err(self.rx.unexpected(&other)),
        }
    }

    /// Tells the server this worker has joined (`joined`: its rounds complete without it,
    /// as if it pushed nothing) or leaves join, and waits until every key took it in.
    /// Send it with no push of this worker in flight on any connection.
    pub fn join(&mut self, joined: bool) -> Result<()> {
        io::write_message(&mut self.tx.stream, &Message::Join { joined })
            .map_err(|e| wire(&self.tx.peer, e))?;
        match self.rx.recv()? {
            Reply::JoinAck { joined: j } if j == joined => Ok(()),
            other => Err(self.rx.unexpected(&other)),
        }
    }

    /// Leaves gracefully: the server will not count this worker as failed.
    pub fn shutdown(mut self, reason: &str) -> Result<()> {
        self.tx.shutdown(reason)
    }
}

impl ServerSender {
    /// Bytes written to the connection since the handshake: frames whole, headers
    /// included, a lent frame counted as if its payload had gone with it (so that a
    /// tensor's count is the same whichever way its payloads went).
    pub fn bytes_sent(&self) -> u64 {
        self.stream.counted().wrapping_add(self.lent_bytes)
    }

    pub fn init_key(
        &mut self,
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        initial: Option<&[u8]>,
    ) -> Result<()> {
        let msg = Message::InitKey {
            key,
            dtype,
            byte_len,
            init: if initial.is_some() {
                KeyInit::Value
            } else {
                KeyInit::Zeros
            },
            codec: KeyCodec::RAW,
        };
        io::write_data(&mut self.stream, &msg, initial.unwrap_or_default())
            .map_err(|e| wire(&self.peer, e))
    }

    /// Declares a raw key whose rounds count only the workers `members` (distinct ranks,
    /// ascending); it starts at zeros.
    pub fn init_member_key(
        &mut self,
        key: u64,
        dtype: Dtype,
        byte_len: u64,
        members: &[u32],
    ) -> Result<()> {
        let msg = Message::InitKey {
            key,
            dtype,
            byte_len,
            init: KeyInit::Members(members.to_vec()),
            codec: KeyCodec::RAW,
        };
        io::write_message(&mut self.stream, &msg).map_err(|e| wire(&self.peer, e))
    }

    /// Declares a compressed f32 key of `byte_len` uncompressed bytes.
    pub fn init_compressed_key(&mut self, key: u64, byte_len: u64, codec: KeyCodec) -> Result<()> {
        let msg = Message::InitKey {
            key,
            dtype: Dtype::F32,
            byte_len,
            init: KeyInit::Zeros,
            codec,
        };
        io::write_message(&mut self.stream, &msg).map_err(|e| wire(&self.peer, e))
    }

    pub fn push(&mut self, key: u64, round: u64, dtype: Dtype, data: &[u8]) -> Result<()> {
        self.push_reduced(key, round, dtype, ReduceOp::Sum, data)
    }

    /// Pushes raw elements that the round combines by `op` (every push of the round must
    /// name the same op).
    pub fn push_reduced(
        &mut self,
        key: u64,
        round: u64,
        dtype: Dtype,
        op: ReduceOp,
        data: &[u8],
    ) -> Result<()> {
        self.push_then(key, round, (dtype, op), Pushed::Raw(data), &[])
    }

    /// Takes part in a round of a raw key without contributing to it: no payload.
    pub fn push_skip(&mut self, key: u64, round: u64, dtype: Dtype, op: ReduceOp) -> Result<()> {
        self.push_then(key, round, (dtype, op), Pushed::Skip, &[])
    }

    /// Pushes a payload of a compressed f32 key, encoded by its codec.
    pub fn push_compressed(
        &mut self,
        key: u64,
        round: u64,
        codec: Codec,
        payload: &[u8],
    ) -> Result<()> {
        let how = (Dtype::F32, ReduceOp::Sum);
        self.push_then(key, round, how, Pushed::Compressed(codec, payload), &[])
    }

    /// Pushes and asks for the round's result (or only its completion, `wants_sum`
    /// false) in one write: the pipeline's every partition. `skips`: the members of this
    /// worker's machine whose part in the round this push carries (`Message::Skips`),
    /// ascending; empty for a push of this worker's own.
    pub fn push_and_pull(
        &mut self,
        key: u64,
        round: u64,
        (dtype, op): (Dtype, ReduceOp),
        pushed: Pushed<'_>,
        wants_sum: bool,
        skips: &[u32],
    ) -> Result<()> {
        let pull = Message::Pull {
            key,
            round,
            wants_sum,
        };
        if skips.is_empty() {
            return self.push_then(key, round, (dtype, op), pushed, &[&pull]);
        }
        let skips = Message::Skips {
            key,
            round,
            op,
            workers: skips.to_vec(),
        };
        self.push_then(key, round, (dtype, op), pushed, &[&skips, &pull])
    }

    /// Writes a push, and `then` behind it in the same write.
    fn push_then(
        &mut self,
        key: u64,
        round: u64,
        (dtype, op): (Dtype, ReduceOp),
        pushed: Pushed<'_>,
        then: &[&Message],
    ) -> Result<()> {
        let (mode, codec, payload) = match pushed {
            Pushed::Skip => (PushMode::Skip, Codec::Raw, &[][..]),
            Pushed::Raw(data) => (PushMode::Sum, Codec::Raw, data),
            Pushed::Compressed(codec, data) => (PushMode::Sum, codec, data),
            Pushed::Delta(data, staleness) => (PushMode::Delta { staleness }, Codec::Raw, data),
        };
        let msg = Message::Push {
            key,
            round,
            dtype,
            codec,
            mode,
            op,
        };
        // Only raw numbers are lent: the server checks a compressed payload once, and it
        // must not change after that.
        let lent = match (&self.mailbox, mode, codec) {
            (Some(mailbox), PushMode::Sum | PushMode::Delta { .. }, Codec::Raw) => {
                mailbox.lend(Side::Push, &mut self.cursor, payload)
            }
            _ => None,
        };
        let written = match lent {
            Some(lent) => {
                self.lent_bytes = self.lent_bytes.wrapping_add(lent.inline_surplus());
                self.lent_frames += 1;
                let mut frames = msg.encode_lent(lent);
                for then in then {
                    frames.extend_from_slice(&then.encode(0));
                }
                self.stream.write_all(&frames).map_err(WireError::from)
            }
            None => io::write_data_then(&mut self.stream, &msg, payload, then),
        };
        written.map_err(|e| wire(&self.peer, e))
    }

    /// Asks for round `round`'s result (`wants_sum`), or only for the notice that it is
    /// complete: a reply without payload.
    pub fn pull(&mut self, key: u64, round: u64, wants_sum: bool) -> Result<()> {
        let msg = Message::Pull {
            key,
            round,
            wants_sum,
        };
        io::write_message(&mut self.stream, &msg).map_err(|e| wire(&self.peer, e))
    }

    /// Retires `key`: this worker will never push or pull it again (after its last pull
    /// of the key on this connection). No reply; the server frees the key once every
    /// worker of it has retired it.
    pub fn retire(&mut self, key: u64) -> Result<()> {
        io::write_message(&mut self.stream, &Message::Retire { key })
            .map_err(|e| wire(&self.peer, e))
    }

    /// Sends any frame as is (tests use it to send what a correct client would not).
    pub fn send_raw(&mut self, msg: &Message, payload: &[u8]) -> Result<()> {
        io::write_data(&mut self.stream, msg, payload).map_err(|e| wire(&self.peer, e))
    }

    /// Writes raw bytes (tests use it to send malformed frames).
    pub fn send_bytes(&mut self, bytes: &[u8]) -> Result<()> {
        self.stream
            .write_all(bytes)
            .map_err(|e| wire(&self.peer, e.into()))
    }

    pub fn shutdown(&mut self, reason: &str) -> Result<()> {
        let msg = Message::Shutdown {
            reason: reason.to_string(),
        };
        let result = io::write_message(&mut self.stream, &msg).map_err(|e| wire(&self.peer, e));
        // Both halves: the frame still goes out, and a receiver blocked on this socket in
        // another thread wakes up instead of waiting on a server that may never answer.
        let _ = self.stream.get_ref().shutdown(Shutdown::Both);
        result
    }
}

impl ServerReceiver {
    /// Bytes read from the connection since the handshake: frames whole, headers
    /// included, a lent frame counted as if its payload had come with it.
    pub fn bytes_received(&self) -> u64 {
        self.reader
            .get_ref()
            .counted()
            .wrapping_add(self.lent_bytes)
    }

    /// Waits for the next reply, reading a sum's payload into a new buffer (tests and the
    /// control path; the pipeline reads sums in place with [`Self::recv_header`]). Push
    /// acknowledgements are skipped: only a scheduler counting credit needs them.
    pub fn recv(&mut self) -> Result<Reply> {
        let mut reply = self.recv_header()?;
        while let Reply::PushAck { .. } = reply {
            reply = self.recv_header()?;
        }
        Ok(match reply {
            Reply::Sum(head) => {
                let mut data = vec![0; head.len];
                self.read_sum(&mut data)?;
                Reply::Sum(Pulled {
                    key: head.key,
                    round: head.round,
                    dtype: head.dtype,
                    data,
                })
            }
            Reply::InitAck { key } => Reply::InitAck { key },
            Reply::PushAck { key, round } => Reply::PushAck { key, round },
            Reply::HeartbeatAck { seq } => Reply::HeartbeatAck { seq },
            Reply::JoinAck { joined } => Reply::JoinAck { joined },
            Reply::Stalled {
                key,
                round,
                waited,
                missing,
            } => Reply::Stalled {
                key,
                round,
                waited,
                missing,
            },
        })
    }

    /// Waits for the next reply, leaving a sum's payload on the socket so that it can be
    /// read straight into its destination: no intermediate buffer, no copy. An `Error`
    /// frame from the server becomes `ClientError::Remote` with the server's code and
    /// message.
    pub fn recv_header(&mut self) -> Result<Reply<SumHeader>> {
        // A lent sum left unread is dropped, its slot handed back to the server.
        if let Some(lent) = self.pending_lent.take() {
            drop(self.take_lent(lent));
        }
        let started = Instant::now();
        let frame = self
            .reader
            .read()
            .map_err(|e| self.read_error(e, started))?;
        if let Some(lent) = frame.lent {
            if !matches!(frame.message, Message::PullReply { .. }) || self.mailbox.is_none() {
                return Err(ClientError::Protocol {
                    peer: self.peer.clone(),
                    what: format!("a lent {} frame", frame.message.op()),
                });
            }
            self.lent_bytes = self.lent_bytes.wrapping_add(lent.inline_surplus());
            self.lent_frames += 1;
            self.pending_lent = Some(lent);
        }
        match frame.message {
            Message::PullReply {
                key,
                round,
                dtype,
                codec,
            } => Ok(Reply::Sum(SumHeader {
                key,
                round,
                dtype,
                codec,
                len: frame.lent.map_or(frame.payload_len, |l| l.len as usize),
            })),
            Message::InitAck { key } => Ok(Reply::InitAck { key }),
            Message::PushAck { key, round } => Ok(Reply::PushAck { key, round }),
            Message::HeartbeatAck { seq } => Ok(Reply::HeartbeatAck { seq }),
            Message::JoinAck { joined } => Ok(Reply::JoinAck { joined }),
            Message::Stalled {
                key,
                round,
                waited_ms,
                missing,
            } => Ok(Reply::Stalled {
                key,
                round,
                waited: Duration::from_millis(waited_ms),
                missing,
            }),
            Message::Error(e) => Err(ClientError::Remote {
                peer: self.peer.clone(),
                code: e.code,
                key: e.key,
                message: e.message,
            }),
            other => {
                let _ = self.reader.skip_payload();
                Err(ClientError::Protocol {
                    peer: self.peer.clone(),
                    what: format!("a {} frame", other.op()),
                })
            }
        }
    }

    /// Reads the next frame whole, as it is (tests use it to see what a client would not
    /// expect).
    pub fn recv_raw(&mut self) -> Result<(Message, Vec<u8>)> {
        let started = Instant::now();
        self.reader
            .read_owned()
            .map_err(|e| self.read_error(e, started))
    }

    /// Reads the payload of the sum [`Self::recv_header`] just returned into `dst`, which
    /// must be exactly as long; a sum of another length is a protocol error (and leaves
    /// the stream unusable).
    pub fn read_sum(&mut self, dst: &mut [u8]) -> Result<()> {
        if let Some(lent) = self.pending_lent.take() {
            let sum = self.take_lent(lent)?;
            if dst.len() != sum.len() {
                return Err(ClientError::Protocol {
                    peer: self.peer.clone(),
                    what: format!(
                        "a sum of {} bytes where {} were expected",
                        sum.len(),
                        dst.len()
                    ),
                });
            }
            dst.copy_from_slice(&sum);
            return Ok(());
        }
        let pending = self.reader.pending_payload();
        if dst.len() != pending {
            return Err(ClientError::Protocol {
                peer: self.peer.clone(),
                what: format!("a sum of {pending} bytes where {} were expected", dst.len()),
            });
        }
        let started = Instant::now();
        self.reader
            .read_payload_whole(dst)
            .map_err(|e| self.read_error(e, started))
    }

    /// Discards the payload of the sum [`Self::recv_header`] just returned.
    pub fn skip_sum(&mut self) -> Result<()> {
        if let Some(lent) = self.pending_lent.take() {
            // Taken and dropped: the slot goes back to the server.
            return self.take_lent(lent).map(drop);
        }
        let started = Instant::now();
        self.reader
            .skip_payload()
            .map_err(|e| self.read_error(e, started))
    }

    /// The sum a lent reply left in a pull slot; the slot is freed when it drops.
    fn take_lent(&self, lent: Lent) -> Result<crate::mailbox::Taken> {
        let mailbox = self
            .mailbox
            .as_ref()
            .expect("a lent reply was only accepted with a mailbox");
        mailbox
            .take(Side::Pull, lent)
            .map_err(|e| ClientError::Protocol {
                peer: self.peer.clone(),
                what: format!("a lent sum that cannot be read ({e})"),
            })
    }

    fn read_error(&self, e: WireError, started: Instant) -> ClientError {
        match e {
            WireError::Timeout { .. } => ClientError::Timeout {
                what: format!("a reply from the {}", self.peer),
                secs: started.elapsed().as_secs_f64(),
            },
            WireError::Closed => ClientError::PeerLost {
                peer: self.peer.clone(),
                reason: "connection closed".into(),
            },
            e => wire(&self.peer, e),
        }
    }

    fn unexpected(&self, reply: &Reply) -> ClientError {
        ClientError::Protocol {
            peer: self.peer.clone(),
            what: format!("{reply:?}").chars().take(120).collect(),
        }
    }
}

/// A mailbox, if the server took one, and the bytes sent and received to agree on it.
type Offered = (Option<Arc<Mailbox>>, (u64, u64));

/// Offers a server on this machine a mailbox for the connection's payloads, and waits
/// for its answer: the mailbox the server took, or `None` (not a machine-local link,
/// shared memory unavailable, or the server declined, which it says why and is logged).
fn offer_mailbox(stream: &Link, peer: &str, max_body: u32) -> Result<Offered> {
    let Link::Local(unix) = stream else {
        return Ok((None, (0, 0)));
    };
    let (mailbox, fd) = match Mailbox::create(
        MAILBOX_PUSH_SLOTS,
        MAILBOX_PULL_SLOTS,
        MAILBOX_SLOT_BYTES,
    ) {
        Ok(created) => created,
        Err(e) => {
            warn!(server = peer, error = %e, "no shared memory for the server on this machine; its payloads go through the socket");
            return Ok((None, (0, 0)));
        }
    };
    let offer = Message::Mailbox {
        push_slots: MAILBOX_PUSH_SLOTS,
        pull_slots: MAILBOX_PULL_SLOTS,
        slot_bytes: MAILBOX_SLOT_BYTES,
    };
    let offered = offer.encode(0);
    send_with_fd(unix, &offered, fd.as_fd()).map_err(|e| wire(peer, e.into()))?;
    let started = Instant::now();
    let mut reader = FrameReader::new(Counted::new(stream), max_body);
    let answer = reader.read().map_err(|e| match e {
        WireError::Timeout { .. } => ClientError::Timeout {
            what: format!("the {peer}'s answer to a mailbox"),
            secs: started.elapsed().as_secs_f64(),
        },
        e => wire(peer, e),
    })?;
    let bytes = (offered.len() as u64, reader.get_ref().counted());
    match answer.message {
        Message::MailboxAck { accepted: true, .. } => Ok((Some(Arc::new(mailbox)), bytes)),
        Message::MailboxAck { reason, .. } => {
            warn!(server = peer, reason, "the server on this machine declined shared memory; its payloads go through the socket");
            Ok((None, bytes))
        }
        Message::Error(e) => Err(ClientError::Remote {
            peer: peer.to_string(),
            code: e.code,
            key: e.key,
            message: e.message,
        }),
        other => Err(ClientError::Protocol {
            peer: peer.to_string(),
            what: format!("a {} frame in answer to a mailbox", other.op()),
        }),
    }
}

fn wire(peer: &str, source: WireError) -> ClientError {
    ClientError::Wire {
        peer: peer.to_string(),
        source,
    }
}
