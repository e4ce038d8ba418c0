//! What connections and engines say to each other: a connection's reader carries out
//! [`Command`]s on the engine that owns the key, and every engine answers on the
//! [`Replier`] of the connection that asked, whose writer thread sends each [`Outgoing`] in
//! the order it arrives. Both sides depend on this module, not on each other.

use std::ops::Deref;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use crate::channel::{unbounded, Receiver, SendError, Sender};
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

/// What a connection's reader (or the service) asks of an engine.
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
    /// `workers` (of the sender's machine) skip `round` and want no notice of its end:
    /// a skip's push and a pull without reply for each (`Message::Skips`). `round` is in
    /// the numbering of `from`, the sender.
    Skips {
        key: u64,
        from: u32,
        round: u64,
        op: ReduceOp,
        workers: Vec<u32>,
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
    /// Nothing to send but the rest of a frame written directly ([`Direct`]), which the
    /// writer finishes before anything else whatever it takes from its queue.
    Flush,
}

/// Writes an answer on the connection's socket at once when its writer is idle, instead
/// of waking the writer for it (`connection.rs`).
pub trait Direct: Send + Sync {
    /// Writes `out` now (what the socket does not take is the writer's to finish), or
    /// gives it back to be queued: the writer is busy or has answers queued, or `out` is
    /// one only the writer sends.
    fn write_now(&self, out: Outgoing) -> Result<(), Outgoing>;
}

/// Where an engine (or the connection's own reader) sends its answers to one connection:
/// the writer's queue, a count of the answers queued or being written, and, when set,
/// the way to write an answer at once while that count is 0 (nothing sent before can
/// then be overtaken, and the writer need not be woken).
#[derive(Clone)]
pub struct Replier {
    queue: Sender<Outgoing>,
    unwritten: Arc<AtomicUsize>,
    direct: Option<Arc<dyn Direct>>,
}

impl Replier {
    /// Writes `out` at once when the connection is idle, else queues it for the writer;
    /// fails, handing it back, once the writer is gone.
    pub fn send(&self, out: Outgoing) -> Result<(), SendError<Outgoing>> {
        let out = match &self.direct {
            // Only a hint here: `write_now` checks again under the socket's lock.
            Some(direct) if self.unwritten.load(Ordering::Acquire) == 0 => {
                match direct.write_now(out) {
                    Ok(()) => return Ok(()),
                    Err(out) => out,
                }
            }
            _ => out,
        };
        self.unwritten.fetch_add(1, Ordering::AcqRel);
        self.queue.send(out).inspect_err(|_| {
            self.unwritten.fetch_sub(1, Ordering::AcqRel);
        })
    }

    /// Answers queued or being written; the writer counts each down once written.
    pub fn unwritten(&self) -> &Arc<AtomicUsize> {
        &self.unwritten
    }

    /// This replier, writing answers through `direct` while the connection is idle.
    pub fn with_direct(self, direct: Arc<dyn Direct>) -> Replier {
        Replier {
            direct: Some(direct),
            ..self
        }
    }
}

/// A connection's replier and the queue its writer takes answers from.
pub fn replier() -> (Replier, Receiver<Outgoing>) {
    let (queue, rx) = unbounded();
    let unwritten = Arc::new(AtomicUsize::new(0));
    (
        Replier {
            queue,
            unwritten,
            direct: None,
        },
        rx,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_replier_counts_what_is_queued_until_the_writer_counts_it_down() {
        let (tx, rx) = replier();
        let other = tx.clone();
        assert!(tx.send(Outgoing::Close).is_ok());
        assert!(other.send(Outgoing::Close).is_ok());
        assert_eq!(
            tx.unwritten().load(Ordering::Acquire),
            2,
            "shared by clones"
        );
        assert!(matches!(rx.recv(), Ok(Outgoing::Close)));
        tx.unwritten().fetch_sub(1, Ordering::AcqRel);
        assert_eq!(other.unwritten().load(Ordering::Acquire), 1);
        drop(rx);
        assert!(tx.send(Outgoing::Close).is_err());
        assert_eq!(
            tx.unwritten().load(Ordering::Acquire),
            1,
            "a send that failed is not counted"
        );
    }
}
