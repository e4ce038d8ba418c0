//! One worker connection: a reader thread that validates and dispatches frames, and a
//! writer thread that sends replies in the order engines produce them.
//!
//! Stateless and key-level checks happen here, before a payload is read or an engine is
//! involved; round-level checks happen in the engine. Any refusal is an `Error` frame
//! naming the problem, after which the connection is closed and the worker counted gone.
//!
//! A worker may hold several connections (up to `MAX_CONNECTIONS_PER_WORKER`), each
//! asking for its own keys: replies go back on the connection that asked, so the server
//! needs no notion of which connection carries which key. Losing any of them fails the
//! worker; it has left only once all of them said Shutdown.

use std::io::Read;
use std::net::Shutdown;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use crate::channel::Receiver;
use sumflow_wire::accounting::Counted;
use sumflow_wire::gate::Pass;
use sumflow_wire::io::{self, FrameReader};
use sumflow_wire::{
    Codec, ErrorCode, ErrorReply, KeyCodec, KeyInit, Message, Peer, PushMode, ReduceOp, Role,
    Service, WireError,
};
use tracing::{debug, info, warn};

use crate::directory::{DeclareError, Declared, RetireError, Retired};
use crate::messages::{replier, Command, Direct, Outgoing, PushData, Replier};
use crate::outbox::{Frame, Outbox};
use crate::shared::Shared;
use sumflow_client::link::{Link, Receiving};
use sumflow_client::mailbox::{Mailbox, Side};
use sumflow_reduce::buffer::AlignedBuf;
use sumflow_wire::message::DATA_META_LEN;
use sumflow_wire::Lent;

/// How long a pool wait sleeps between checks that the server is still running.
const POOL_POLL: Duration = Duration::from_millis(100);

/// How long a refused connection stays open for the worker to read why: closing a socket
/// with the worker's frames unread would reset it, and the reset can overtake the `Error`
/// frame, leaving the worker only "connection reset".
const LINGER: Duration = Duration::from_secs(2);

/// Serves one accepted connection until it closes; `pass` is its place among the
/// connections in their handshake, given up once it is authenticated (or refused).
pub fn serve(shared: Arc<Shared>, stream: Link, pass: Pass) {
    let addr = stream.peer();
    stream.set_nodelay();
    let admitted = io::accept(
        &mut &stream,
        &shared.token,
        Service::Summation,
        shared.settings.handshake_timeout,
        |peer| admit(&shared, peer),
    );
    drop(pass);
    let (peer, (rank, id)) = match admitted {
        Ok(admitted) => admitted,
        Err(e) => {
            warn!(%addr, error = %e, "connection refused");
            return;
        }
    };
    let _ = stream.set_read_timeout(None);
    info!(%addr, rank, name = %peer.name, "worker connected");

    let outbox = match stream.try_clone() {
        Ok(sending) => {
            let _ = sending.set_write_timeout(Some(shared.settings.write_timeout));
            Arc::new(Mutex::new(Outbox::new(sending)))
        }
        Err(e) => {
            warn!(%addr, error = %e, "connection dropped: no second descriptor for its writer");
            return;
        }
    };
    let (tx, rx) = replier();
    let fatal = Arc::new(Mutex::new(None));
    let mailbox = Arc::new(OnceLock::new());
    let tx = {
        let direct = DirectWriter {
            outbox: Arc::clone(&outbox),
            writer: tx.clone(),
            shared: Arc::clone(&shared),
            mailbox: Arc::clone(&mailbox),
        };
        tx.with_direct(Arc::new(direct))
    };
    let writer = {
        let outbox = Arc::clone(&outbox);
        let unwritten = Arc::clone(tx.unwritten());
        let fatal = Arc::clone(&fatal);
        let shared = Arc::clone(&shared);
        let mailbox = Arc::clone(&mailbox);
        std::thread::Builder::new()
            .name(format!("sumflow-w{rank}-tx"))
            .spawn(move || write_loop(&outbox, rx, &unwritten, fatal, &shared, &mailbox))
    };
    shared.track(id, rank, &stream);
    let mut conn = Connection {
        shared: Arc::clone(&shared),
        reader: FrameReader::new(
            Counted::new(Receiving::new(&stream)),
            shared.settings.max_body,
        ),
        accounted: 0,
        lent: 0,
        worker: rank,
        pool: crate::pool::BufferPool::new(shared.settings.push_buffers),
        mailbox,
        tx,
    };
    let ending = conn.run();
    if let Ending::Refused(_) = ending {
        linger(&stream);
    }
    let _ = conn.tx.send(Outgoing::Close);
    drop(conn);
    if let Ok(writer) = writer {
        let _ = writer.join();
    }
    let _ = stream.shutdown(Shutdown::Both);
    let graceful = matches!(ending, Ending::Left(_));
    let reason = match ending {
        Ending::Left(why) => format!("left the job ({why})"),
        Ending::Refused(msg) => format!("was disconnected: {}", refusal_text(&msg)),
        Ending::Lost(why) => match fatal.lock().expect("fatal slot").take() {
            Some(refusal) => format!("was disconnected: {refusal}"),
            None => format!("lost its connection: {why}"),
        },
        Ending::Stopping => "server stopping".into(),
    };
    shared.detach(id, rank, graceful, &reason);
}

/// Reads and drops what the worker still sends until it closes (it does once it has read
/// the refusal), for at most [`LINGER`].
fn linger(stream: &Link) {
    let deadline = Instant::now() + LINGER;
    let mut sink = [0u8; 64 << 10];
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let _ = stream.set_read_timeout(Some(left.max(Duration::from_millis(1))));
        match (&*stream).read(&mut sink) {
            Ok(n) if n > 0 => {}
            _ => return,
        }
    }
}

fn refusal_text(m: &Message) -> String {
    match m {
        Message::Error(e) => format!("{}: {}", e.code, e.message),
        other => format!("{other:?}"),
    }
}

/// Checks that the authenticated peer is a worker of this job, within its connection
/// limit; returns its rank and the connection's id.
fn admit(shared: &Shared, peer: &Peer) -> Result<(u32, u64), ErrorReply> {
    let refuse = |code, message: String| ErrorReply {
        code,
        key: None,
        message,
    };
    if peer.role != Role::Worker {
        return Err(refuse(
            ErrorCode::UnexpectedOp,
            format!(
                "summation servers serve workers; '{}' connected as a {}",
                peer.name, peer.role
            ),
        ));
    }
    let Some(rank) = peer.rank.filter(|r| *r < shared.workers) else {
        return Err(refuse(
            ErrorCode::BadRank,
            format!(
                "worker '{}' claims rank {:?}, but this job has ranks 0..{}",
                peer.name, peer.rank, shared.workers
            ),
        ));
    };
    shared.attach(rank, &peer.name).map(|id| (rank, id))
}

enum Ending {
    Left(String),
    Refused(Message),
    Lost(String),
    Stopping,
}

struct Connection<'a> {
    shared: Arc<Shared>,
    reader: FrameReader<Counted<Receiving<'a>>>,
    /// The bytes read up to the last frame accounted for.
    accounted: u64,
    /// What lent payloads add to the bytes read (each counted as if it had come inline).
    lent: u64,
    worker: u32,
    pool: crate::pool::BufferPool,
    /// The worker's mailbox once it offered one (shared with the writer, which lends sums
    /// in it).
    mailbox: Arc<OnceLock<Arc<Mailbox>>>,
    tx: Replier,
}

impl Connection<'_> {
    fn run(&mut self) -> Ending {
        let ending = self.serve_frames();
        // What was read of the frame that ended it.
        self.account(None);
        ending
    }

    /// Adds the bytes read since the last call to `key`'s count.
    fn account(&mut self, key: Option<u64>) {
        let read = self.reader.get_ref().counted().wrapping_add(self.lent);
        self.shared.traffic.received(key, read - self.accounted);
        self.accounted = read;
    }

    fn serve_frames(&mut self) -> Ending {
        loop {
            let frame = match self.reader.read() {
                Ok(frame) => frame,
                Err(_) if self.shared.is_stopping() => return Ending::Stopping,
                Err(WireError::Closed) => return Ending::Lost("closed without shutdown".into()),
                Err(e @ WireError::Io(_)) => return Ending::Lost(e.to_string()),
                Err(e) => return self.refuse(Message::error(e.code(), None, e.to_string())),
            };
            let key = key_of(&frame.message);
            let outcome = match frame.message {
                Message::InitKey {
                    key,
                    dtype,
                    byte_len,
                    init,
                    codec,
                } => self.init_key(key, dtype, byte_len, codec, init),
                Message::Push {
                    key,
                    round,
                    dtype,
                    codec,
                    mode,
                    op,
                } => {
                    let payload = match frame.lent {
                        Some(lent) => Payload::Lent(lent),
                        None => Payload::Inline(frame.payload_len),
                    };
                    self.push(key, round, (dtype, codec), (mode, op), payload)
                }
                Message::Mailbox {
                    push_slots,
                    pull_slots,
                    slot_bytes,
                } => self.adopt_mailbox(push_slots, pull_slots, slot_bytes),
                Message::Pull {
                    key,
                    round,
                    wants_sum,
                } => self.pull(key, round, wants_sum),
                Message::Skips {
                    key,
                    round,
                    op,
                    workers,
                } => self.skips(key, round, op, workers),
                Message::Join { joined } => {
                    let what = if joined { "joined" } else { "left join" };
                    info!(worker = self.worker, "worker {what}");
                    self.shared.join(self.worker, joined, self.tx.clone());
                    Ok(())
                }
                Message::Retire { key } => self.retire(key),
                Message::Heartbeat { seq } => {
                    let _ = self
                        .tx
                        .send(Outgoing::Message(Message::HeartbeatAck { seq }));
                    Ok(())
                }
                Message::Shutdown { reason } => return Ending::Left(reason),
                other => Err(Interrupted::Refused(Message::error(
                    ErrorCode::UnexpectedOp,
                    None,
                    format!("a summation server does not serve {} frames", other.op()),
                ))),
            };
            // The frame whole, payload included: every handler consumed it or failed.
            self.account(key);
            match outcome {
                Ok(()) => {}
                Err(Interrupted::Refused(msg)) => return self.refuse(msg),
                Err(Interrupted::Wire(e)) if self.shared.is_stopping() => {
                    debug!(error = %e, "read interrupted by shutdown");
                    return Ending::Stopping;
                }
                Err(Interrupted::Wire(e)) => return Ending::Lost(e.to_string()),
                Err(Interrupted::Stopping) => return Ending::Stopping,
            }
        }
    }

    fn refuse(&self, msg: Message) -> Ending {
        warn!(worker = self.worker, error = %refusal_text(&msg), "refusing worker");
        let _ = self.tx.send(Outgoing::Fatal(msg.clone()));
        Ending::Refused(msg)
    }

    fn init_key(
        &mut self,
        key: u64,
        dtype: sumflow_wire::Dtype,
        byte_len: u64,
        codec: KeyCodec,
        init: KeyInit,
    ) -> Result<(), Interrupted> {
        let max_payload = u64::from(self.shared.settings.max_body) - DATA_META_LEN as u64;
        let payload_len = codec.payload_len(dtype, byte_len / dtype.size() as u64);
        if payload_len > max_payload {
            return Err(Interrupted::Refused(Message::error(
                ErrorCode::FrameTooLarge,
                Some(key),
                format!(
                    "key {key} of {payload_len} bytes could never be pushed: the server's \
                     frame limit allows {max_payload} payload bytes; partition it or raise \
                     --max-frame-bytes"
                ),
            )));
        }
        let (initial, members) = match init {
            KeyInit::Zeros => (None, None),
            KeyInit::Value => {
                let mut buf = AlignedBuf::zeroed(byte_len as usize);
                self.reader.read_payload(&mut buf)?;
                (Some(buf), None)
            }
            KeyInit::Members(members) => {
                // The wire checked the list's form; only the server knows the job's size.
                let workers = self.shared.workers;
                if let Some(rank) = members.iter().find(|&&r| r >= workers) {
                    return Err(Interrupted::Refused(Message::error(
                        ErrorCode::BadRank,
                        Some(key),
                        format!(
                            "key {key} names worker {rank} among its members {members:?}, but \
                             this job has workers 0..{workers}"
                        ),
                    )));
                }
                (None, Some(members))
            }
        };
        let declared = {
            let mut dir = self.shared.directory.write().expect("directory lock");
            if dir.retired_by(key, self.worker) {
                return Err(self.retired(key, "InitKey"));
            }
            let declared =
                dir.declare(key, dtype, byte_len, codec, members.as_deref(), self.worker);
            if let Ok(Declared::New(meta)) = &declared {
                // Queued under the lock: no other connection can reach the engine with
                // this key before the engine has created it.
                self.shared.engine(
                    meta.engine,
                    Command::Init {
                        key,
                        meta: meta.clone(),
                        initial,
                    },
                );
            }
            declared
        };
        match declared {
            Ok(_) => {
                self.pool.note_key(payload_len as usize);
                let _ = self.tx.send(Outgoing::Message(Message::InitAck { key }));
                Ok(())
            }
            Err(e) => {
                let code = match e {
                    DeclareError::Mismatch { .. } | DeclareError::MembersMismatch { .. } => {
                        ErrorCode::KeyMismatch
                    }
                    DeclareError::MemoryLimit { .. } => ErrorCode::ResourceExhausted,
                };
                Err(Interrupted::Refused(Message::error(
                    code,
                    Some(key),
                    e.to_string(),
                )))
            }
        }
    }

    fn push(
        &mut self,
        key: u64,
        round: u64,
        (dtype, codec): (sumflow_wire::Dtype, Codec),
        (mode, op): (PushMode, ReduceOp),
        payload: Payload,
    ) -> Result<(), Interrupted> {
        let meta = self.meta(key, "push")?;
        if dtype != meta.dtype || codec != meta.codec.codec {
            return Err(Interrupted::Refused(Message::error(
                ErrorCode::KeyMismatch,
                Some(key),
                format!(
                    "push for key {key} carries {dtype} {codec}, but the key was declared as \
                     {} {}",
                    meta.dtype, meta.codec
                ),
            )));
        }
        // A skip carries nothing to read or check.
        let data = match (mode, payload) {
            (PushMode::Skip, _) => None,
            (_, Payload::Inline(len)) => {
                Some(self.read_push(key, (dtype, codec), &meta, len)?.into())
            }
            (_, Payload::Lent(lent)) => Some(self.take_lent(key, codec, &meta, lent)?),
        };
        // Acknowledged on receipt, not on summation: the worker's credit must not wait for
        // the other workers (see crates/plan/src/scheduler/credit.rs).
        self.acknowledge(key, round);
        self.shared.engine(
            meta.engine,
            Command::Push {
                key,
                round,
                worker: self.worker,
                op,
                delta: match mode {
                    PushMode::Delta { staleness } => Some(staleness),
                    PushMode::Sum | PushMode::Skip => None,
                },
                data,
                reply: self.tx.clone(),
            },
        );
        Ok(())
    }

    /// Sends a push's acknowledgement: written by this thread when the writer is idle
    /// (`DirectWriter`), so the writer is not woken for a frame of 30 bytes (one wake per
    /// push, a third of the writers' on issue 22's cluster).
    fn acknowledge(&self, key: u64, round: u64) {
        let _ = self
            .tx
            .send(Outgoing::Message(Message::PushAck { key, round }));
    }

    /// Reads a push's payload into a pool buffer, checked whole: its length against the
    /// key's, and a compressed one by its codec.
    fn read_push(
        &mut self,
        key: u64,
        (dtype, codec): (sumflow_wire::Dtype, Codec),
        meta: &crate::directory::KeyMeta,
        payload_len: usize,
    ) -> Result<crate::pool::PooledBuf, Interrupted> {
        check_length(key, (dtype, codec), meta, payload_len)?;
        let shared = &self.shared;
        let mut data = self
            .pool
            .take(payload_len, POOL_POLL, || !shared.is_stopping())
            .ok_or(Interrupted::Stopping)?;
        self.reader.read_payload_whole(&mut data)?;
        // Checked whole before anything of it is summed: a bad payload is refused, not
        // summed in part.
        if let Some(decoder) = meta.decoder() {
            decoder.validate(&data).map_err(|e| {
                Interrupted::Refused(Message::error(
                    ErrorCode::BadFrame,
                    Some(key),
                    format!("push for key {key} ({}): {e}", meta.codec),
                ))
            })?;
        }
        Ok(data)
    }

    /// Takes a push lent in the worker's mailbox, to be summed where it lies: raw numbers
    /// only (any bytes are valid ones, whatever the worker does to its slot after), of the
    /// key's length, in a slot the worker lent.
    fn take_lent(
        &mut self,
        key: u64,
        codec: Codec,
        meta: &crate::directory::KeyMeta,
        lent: Lent,
    ) -> Result<PushData, Interrupted> {
        let refuse = |why: String| {
            Interrupted::Refused(Message::error(
                ErrorCode::BadFrame,
                Some(key),
                format!("lent push for key {key}: {why}"),
            ))
        };
        let Some(mailbox) = self.mailbox.get() else {
            return Err(refuse("this connection has no mailbox".into()));
        };
        if codec != Codec::Raw {
            return Err(refuse(format!(
                "a {codec} payload must come inline (only raw numbers are lent)"
            )));
        }
        check_length(key, (meta.dtype, codec), meta, lent.len as usize)?;
        let taken = mailbox
            .take(Side::Push, lent)
            .map_err(|e| refuse(e.to_string()))?;
        self.lent = self.lent.wrapping_add(lent.inline_surplus());
        Ok(PushData::Lent(taken))
    }

    /// Maps the mailbox the worker offers with the descriptor that came with the frame,
    /// and says whether it did: without one the connection goes on through the socket.
    fn adopt_mailbox(
        &mut self,
        push_slots: u32,
        pull_slots: u32,
        slot_bytes: u64,
    ) -> Result<(), Interrupted> {
        let passed = self.reader.get_mut().get_mut().take_passed();
        let adopted = if self.mailbox.get().is_some() {
            Err("this connection already has one".to_string())
        } else if let Some(fd) = passed {
            Mailbox::adopt(fd, push_slots, pull_slots, slot_bytes).map_err(|e| e.to_string())
        } else if self.reader.get_ref().get_ref().link().is_local() {
            Err("no file descriptor came with it".into())
        } else {
            Err("it can only be offered over this machine's Unix socket".into())
        };
        let ack = match adopted {
            Ok(mailbox) => {
                debug!(worker = self.worker, slot_bytes, "mailbox adopted");
                let _ = self.mailbox.set(Arc::new(mailbox));
                Message::MailboxAck {
                    accepted: true,
                    reason: String::new(),
                }
            }
            Err(reason) => {
                info!(worker = self.worker, reason, "mailbox declined");
                Message::MailboxAck {
                    accepted: false,
                    reason,
                }
            }
        };
        let _ = self.tx.send(Outgoing::Message(ack));
        Ok(())
    }

    fn pull(&mut self, key: u64, round: u64, wants_sum: bool) -> Result<(), Interrupted> {
        let meta = self.meta(key, "pull")?;
        self.shared.engine(
            meta.engine,
            Command::Pull {
                key,
                round,
                worker: self.worker,
                wants_sum,
                reply: self.tx.clone(),
            },
        );
        Ok(())
    }

    /// Other workers of this worker's machine skip `round` of `key`: this worker's push
    /// carries their machine's sum. The engine checks each as it would their own skips.
    fn skips(
        &mut self,
        key: u64,
        round: u64,
        op: ReduceOp,
        workers: Vec<u32>,
    ) -> Result<(), Interrupted> {
        let meta = self.meta(key, "skips")?;
        let foreign = workers
            .iter()
            .find(|&&w| w == self.worker || w >= self.shared.workers);
        if let Some(&w) = foreign {
            let why = if w == self.worker {
                "itself: its own push says whether it skips".to_string()
            } else {
                format!("a job of {} workers has no rank {w}", self.shared.workers)
            };
            return Err(Interrupted::Refused(Message::error(
                ErrorCode::BadRank,
                Some(key),
                format!(
                    "worker {} sent skips of round {round} for key {key} naming worker {w}, {why}",
                    self.worker
                ),
            )));
        }
        self.shared.engine(
            meta.engine,
            Command::Skips {
                key,
                from: self.worker,
                round,
                op,
                workers,
                reply: self.tx.clone(),
            },
        );
        Ok(())
    }

    fn meta(&self, key: u64, op: &str) -> Result<crate::directory::KeyMeta, Interrupted> {
        let dir = self.shared.directory.read().expect("directory lock");
        if dir.retired_by(key, self.worker) {
            return Err(self.retired(key, op));
        }
        dir.get(key).ok_or_else(|| {
            Interrupted::Refused(Message::error(
                ErrorCode::UnknownKey,
                Some(key),
                format!(
                    "{op} for key {key}, which is not live on this server: no worker has \
                     initialised it (send InitKey first), or every worker retired it"
                ),
            ))
        })
    }

    /// The refusal of `op` on a key this worker has retired.
    fn retired(&self, key: u64, op: &str) -> Interrupted {
        Interrupted::Refused(Message::error(
            ErrorCode::UnknownKey,
            Some(key),
            format!(
                "{op} for key {key}, which worker {} retired: a retired key is never pushed, \
                 pulled or initialised again",
                self.worker
            ),
        ))
    }

    /// The worker will never push or pull `key` again. Its pulls of the key went to the
    /// engine before this (frames of a connection are handled in order), so the engine
    /// answers them first; once every worker of the key retired it, the key is freed.
    fn retire(&mut self, key: u64) -> Result<(), Interrupted> {
        let mut dir = self.shared.directory.write().expect("directory lock");
        let (meta, last) = match dir.retire(key, self.worker, self.shared.workers) {
            Ok(Retired::Waiting(meta)) => (meta, false),
            Ok(Retired::Freed(meta)) => (meta, true),
            Err(e) => {
                let code = match e {
                    RetireError::Unknown { .. } => ErrorCode::UnknownKey,
                    RetireError::NotMember { .. } => ErrorCode::BadRank,
                    RetireError::Twice { .. } => ErrorCode::UnexpectedOp,
                };
                return Err(Interrupted::Refused(Message::error(
                    code,
                    Some(key),
                    e.to_string(),
                )));
            }
        };
        // Queued under the lock, as Init is: the engine hears of the key's end in order.
        self.shared.engine(
            meta.engine,
            Command::Retire {
                key,
                worker: self.worker,
                last,
            },
        );
        if last {
            debug!(key, "key freed: every worker retired it");
        }
        Ok(())
    }
}

/// Where a push's payload is: `len` bytes on the socket after the frame, or lent.
enum Payload {
    Inline(usize),
    Lent(Lent),
}

/// Refuses a push whose payload is not as long as its key's.
fn check_length(
    key: u64,
    (dtype, codec): (sumflow_wire::Dtype, Codec),
    meta: &crate::directory::KeyMeta,
    payload_len: usize,
) -> Result<(), Interrupted> {
    if payload_len as u64 == meta.payload_len() {
        return Ok(());
    }
    let what = |bytes: u64| match codec {
        Codec::Raw => format!("{dtype} x {} elements", bytes / dtype.size() as u64),
        _ => format!("{bytes} bytes of {}", meta.codec),
    };
    Err(Interrupted::Refused(Message::error(
        ErrorCode::KeyMismatch,
        Some(key),
        format!(
            "push for key {key} carries {}, but the key was declared as {}",
            what(payload_len as u64),
            what(meta.payload_len())
        ),
    )))
}

/// Why handling a frame stopped the connection.
enum Interrupted {
    Refused(Message),
    Wire(WireError),
    Stopping,
}

impl From<WireError> for Interrupted {
    fn from(e: WireError) -> Self {
        Interrupted::Wire(e)
    }
}

/// The key a frame is about, for wire accounting.
fn key_of(m: &Message) -> Option<u64> {
    match m {
        Message::InitKey { key, .. }
        | Message::InitAck { key }
        | Message::Push { key, .. }
        | Message::Pull { key, .. }
        | Message::Skips { key, .. }
        | Message::PushAck { key, .. }
        | Message::PullReply { key, .. }
        | Message::Retire { key } => Some(*key),
        Message::Error(e) => e.key,
        _ => None,
    }
}

fn write_loop(
    outbox: &Mutex<Outbox>,
    rx: Receiver<Outgoing>,
    unwritten: &AtomicUsize,
    fatal: Arc<Mutex<Option<String>>>,
    shared: &Shared,
    mailbox: &OnceLock<Arc<Mailbox>>,
) {
    for out in &rx {
        let mut w = outbox.lock().unwrap_or_else(|e| e.into_inner());
        // Counted down once written, with the lock held: a thread writing an answer itself
        // only when nothing is unwritten (`DirectWriter`) never overtakes this.
        let _written = Written(unwritten);
        // The rest of a frame written directly goes before anything taken after it.
        match w.finish() {
            Ok(None) => {}
            Ok(Some((key, bytes))) => shared.traffic.sent(key, bytes),
            Err(e) => {
                debug!(error = %e, "writer stopping");
                break;
            }
        }
        let before = w.sent();
        let result = match frame_of(out, &mut w, mailbox.get()) {
            Ok(frame) => {
                let written = w.write(&frame);
                shared.traffic.sent(frame.key, w.sent() - before);
                written
            }
            Err(Outgoing::Fatal(m)) => {
                *fatal.lock().expect("fatal slot") = Some(refusal_text(&m));
                let frame = message_frame(&m);
                let _ = w.write(&frame);
                shared.traffic.sent(frame.key, w.sent() - before);
                // The refusal, then the end of the stream: the reader keeps reading until
                // the worker, having read why, closes, or until it gives up lingering.
                let _ = w.link().shutdown(Shutdown::Write);
                let deadline = Instant::now() + LINGER;
                while let Some(left) = deadline.checked_duration_since(Instant::now()) {
                    match rx.recv_timeout(left) {
                        Ok(Outgoing::Close) | Err(_) => break,
                        Ok(_) => {}
                    }
                }
                break;
            }
            Err(Outgoing::Flush) => Ok(()),
            Err(Outgoing::Close) => break,
            Err(Outgoing::Message(_) | Outgoing::Sum { .. }) => unreachable!("framed above"),
        };
        if let Err(e) = result {
            debug!(error = %e, "writer stopping");
            break;
        }
    }
    // Wakes the reader if it is blocked on a peer that will never send again.
    let _ = outbox
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .link()
        .shutdown(Shutdown::Both);
}

/// Writes an answer on an idle connection from the thread that has it (an engine's, after
/// a round completes, or the reader's, acknowledging a push), without waiting for room in
/// the socket's buffer: a wake of the writer saved per answer. The writer finishes what
/// the socket did not take, woken by a `Flush` counted as unwritten like any answer.
struct DirectWriter {
    outbox: Arc<Mutex<Outbox>>,
    /// The connection's replier as it was before writing directly: its writer's queue.
    writer: Replier,
    shared: Arc<Shared>,
    mailbox: Arc<OnceLock<Arc<Mailbox>>>,
}

impl Direct for DirectWriter {
    fn write_now(&self, out: Outgoing) -> Result<(), Outgoing> {
        let Ok(mut w) = self.outbox.try_lock() else {
            return Err(out);
        };
        // Under the lock the writer counts down under: nothing queued or half-written.
        if self.writer.unwritten().load(Ordering::Acquire) != 0 {
            return Err(out);
        }
        let before = w.sent();
        let frame = frame_of(out, &mut w, self.mailbox.get())?;
        let key = frame.key;
        match w.write_now(frame) {
            Ok(true) => {}
            // A writer gone has stopped the connection: the rest has nowhere to go.
            Ok(false) => {
                let _ = self.writer.send(Outgoing::Flush);
            }
            // The socket is broken: the reader's next read fails, and the connection with
            // it, as it would have had the writer met this.
            Err(e) => debug!(error = %e, "direct write failed"),
        }
        self.shared.traffic.sent(key, w.sent() - before);
        Ok(())
    }
}

/// The frame that answers with `out`, a message or a sum; the others come back. A sum
/// goes into the worker's mailbox when a pull slot is free and it fits.
fn frame_of(
    out: Outgoing,
    w: &mut Outbox,
    mailbox: Option<&Arc<Mailbox>>,
) -> Result<Frame, Outgoing> {
    let (key, round, dtype, codec, data) = match out {
        Outgoing::Message(m) => return Ok(message_frame(&m)),
        Outgoing::Sum {
            key,
            round,
            dtype,
            codec,
            data,
        } => (key, round, dtype, codec, data),
        other => return Err(other),
    };
    let reply = Message::PullReply {
        key,
        round,
        dtype,
        codec,
    };
    Ok(
        match mailbox.and_then(|m| m.lend(Side::Pull, &mut w.cursor, &data)) {
            Some(lent) => {
                w.lent_bytes = w.lent_bytes.wrapping_add(lent.inline_surplus());
                Frame {
                    key: Some(key),
                    head: reply.encode_lent(lent),
                    payload: None,
                }
            }
            None => Frame {
                key: Some(key),
                head: reply.encode(data.len()),
                payload: Some(data),
            },
        },
    )
}

fn message_frame(m: &Message) -> Frame {
    Frame {
        key: key_of(m),
        head: m.encode(0),
        payload: None,
    }
}

/// Counts an answer written when dropped (see `write_loop`).
struct Written<'a>(&'a AtomicUsize);

impl Drop for Written<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::AcqRel);
    }
}
