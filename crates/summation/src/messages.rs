//! What connection threads and engine threads say to each other: a connection's reader
//! sends [`Command`]s to the engine that owns the key, and every engine answers on the
//! [`Replier`] of the connection that asked, whose writer thread sends each [`Outgoing`] in
//! the order it arrives. Both sides depend on this module, not on each other.

use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::channel::Sender;
use sumflow_wire::{Codec, Dtype, Message, ReduceOp};

use crate::directory::KeyMeta;
use crate::pool::PooledBuf;
use sumflow_client::mailbox::Taken;
use sumflow_reduce::buffer::AlignedBuf;

/// A round that has kept its pulls waiting past the stall warning, for the coordinator
/// (which names the stalled workers to the job's supervisor): an engine's longest wait of
/// each check that sent notices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StallReport {
    pub key: u64,
    pub round: u64,
    pub waited: Duration,
    /// Workers that have not pushed the round, ascending.
    pub missing: Vec<u32>,
}

/// What a connection's reader (or the service) asks of an engine thread.
pub enum Command {
    Init {
        key: u64,
        meta: KeyMeta,
        initial: Option<AlignedBuf>,
    },
    /// `data` None: the worker takes part in the round without contributing (a skip).
    /// `delta`: an asynchronous delta (`PushMode::Delta`) and its staleness bound.
    Push {
        key: u64,
        round: u64,
        worker: u32,
        op: ReduceOp,
        delta: Option<Option<u32>>,
        data: Option<PushData>,
        reply: Replier,
    },
    /// `wants_sum` false: answer with the notice that the round is complete, no payload.
    Pull {
        key: u64,
        round: u64,
        worker: u32,
        wants_sum: bool,
        reply: Replier,
    },
    /// A worker joined (`joined` true: its rounds complete without it) or leaves join;
    /// every engine gets one, and the last to apply it acknowledges.
    Join {
        worker: u32,
        joined: bool,
        ack: Arc<JoinAck>,
    },
    /// `worker` will never push or pull `key` again (its pulls of the key were queued
    /// before this). With `last`, every worker of the key has retired it: free it.
    Retire { key: u64, worker: u32, last: bool },
    /// A worker left or failed: rounds it has not pushed can never complete.
    WorkerGone { worker: u32, reason: Arc<str> },
    /// The server is stopping.
    Stop,
}

/// The acknowledgement of a worker's `Join`, sent once every engine has applied it.
pub struct JoinAck {
    joined: bool,
    remaining: AtomicUsize,
    reply: Replier,
}

impl JoinAck {
    /// An acknowledgement owed once `engines` engines have applied the `Join`.
    pub fn new(joined: bool, engines: usize, reply: Replier) -> JoinAck {
        JoinAck {
            joined,
            remaining: AtomicUsize::new(engines),
            reply,
        }
    }

    /// One engine has applied it; the last one sends the acknowledgement.
    pub fn applied(&self) {
        if self.remaining.fetch_sub(1, Ordering::AcqRel) == 1 {
            let _ = self.reply.send(Outgoing::Message(Message::JoinAck {
                joined: self.joined,
            }));
        }
    }

    /// Where engines refuse what cannot be joined.
    pub fn reply(&self) -> &Replier {
        &self.reply
    }
}

/// A push's payload: read from the socket into a buffer of the connection's pool, or lent
/// in the worker's mailbox and summed where it lies. Dropping it hands it back either way:
/// the buffer to its pool, the slot to the worker.
pub enum PushData {
    Pooled(PooledBuf),
    Lent(Taken),
}

impl PushData {
    /// Exchanges contents with `other` without copying (see [`PooledBuf::try_swap_with`]);
    /// a lent payload is the worker's memory and never swapped: false, the caller copies.
    #[must_use]
    pub fn try_swap_with(&mut self, other: &mut AlignedBuf) -> bool {
        match self {
            PushData::Pooled(buf) => buf.try_swap_with(other),
            PushData::Lent(_) => false,
        }
    }
}

impl Deref for PushData {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            PushData::Pooled(buf) => buf,
            PushData::Lent(taken) => taken,
        }
    }
}

impl From<PooledBuf> for PushData {
    fn from(buf: PooledBuf) -> Self {
        PushData::Pooled(buf)
    }
}

/// What a connection's writer thread sends.
pub enum Outgoing {
    Message(Message),
    /// A completed round's sum, shared with every other puller without copying.
    Sum {
        key: u64,
        round: u64,
        dtype: Dtype,
        codec: Codec,
        data: Arc<AlignedBuf>,
    },
    /// Send this error, then close the connection.
    Fatal(Message),
    /// The reader is done: stop without waiting for engines to drop their senders.
    Close,
}

/// Where an engine sends its answers to one connection.
pub type Replier = Sender<Outgoing>;
