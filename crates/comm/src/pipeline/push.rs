//! The sending half of each lane: a FIFO send queue that the scheduler fills in the order
//! it starts partitions, and the push thread that drains it, compressing a partition
//! first when its tensor is compressed. A partition started for a lane whose push thread
//! sleeps, by that lane's own receiver (a returning credit), is sent by the receiver
//! instead: the push thread would be woken once per partition for it (issue 22).

use std::collections::HashSet;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use sumflow_client::server::{Pushed, ServerSender};
use sumflow_compress::Compressor;
use sumflow_plan::scheduler::Order;

use super::task::{CodecBuffers, PartTask};
use super::{server_lost, Flight, Shared, POLL};
use crate::queue::LaneQueue;
use crate::trace::{Arg, Track};

/// One connection to a server, with its send queue.
#[derive(Debug)]
pub(super) struct Lane {
    pub(super) server: usize,
    pub(super) sender: Mutex<LaneSender>,
    pub(super) queue: LaneQueue<Queued>,
    /// Its index among its server's lanes, for the trace.
    pub(super) index: usize,
}

/// A started partition in a lane's queue: its order, and when it started.
pub(super) type Queued = (Order, Instant, PartTask);

/// The sending side of a lane's connection, and the keys it has initialised on it: both
/// under one lock, since the lane's push thread and its receiver both send (`send`).
#[derive(Debug)]
pub(super) struct LaneSender {
    pub(super) tx: ServerSender,
    /// Keys whose `InitKey` went out on this connection (retired ones leave: tensor ids
    /// are never reused).
    pub(super) initialised: HashSet<u64>,
}

impl LaneSender {
    pub(super) fn new(tx: ServerSender) -> LaneSender {
        LaneSender {
            tx,
            initialised: HashSet::new(),
        }
    }
}

/// Sends the partitions started for `lane`, in the order they started.
pub(super) fn push_loop(sh: &Shared, lane: usize) {
    let mut buffers = CodecBuffers::default();
    while !sh.stop.load(Ordering::Acquire) {
        if let Some(queued) = sh.lanes[lane].queue.pop(POLL) {
            send(sh, lane, queued, &mut buffers);
        }
    }
}

/// Sends one started partition on `lane`: its push and pull, behind its key's `InitKey`
/// the first time. Called by the lane's push thread, or by its receiver for a partition
/// started while the push thread slept (see `Shared::dispatch_helping`).
pub(super) fn send(
    sh: &Shared,
    lane: usize,
    (order, started, task): Queued,
    buffers: &mut CodecBuffers,
) {
    let Lane {
        server,
        sender,
        index,
        ..
    } = &sh.lanes[lane];
    let (server, index) = (*server, *index);
    let popped = Instant::now();
    // A failed operation's buffer may already be gone: drop its remaining partitions.
    if !sh.handles.begin_access(task.handle) {
        sh.scheduler().abandoned(order, Instant::now());
        return;
    }
    debug_assert_eq!(sh.lane_of(task.server(), task.key()), lane);
    // Compressed before the connection is locked, so lanes compress in parallel.
    let (pushes, wants_sum, op) = (task.pushes, task.wants_sum, task.op);
    if let Some(c) = task.compressor().filter(|_| pushes) {
        compress(sh, &task, c, buffers);
    }
    let (key, round, dtype, len, handle, codec) = (
        task.key(),
        task.round,
        task.dtype,
        task.data.len,
        task.handle,
        task.codec,
    );
    let wire_len = task.wire_len();
    let members = task.members.clone();
    let skips = task.skips.clone();
    let data = task.data;
    let delta = task.delta;
    let tensor_name = Arc::clone(&task.name);
    let label = sh
        .tracer
        .active()
        .then(|| (Arc::clone(&task.name), task.index));
    // Registered before the frames go out: the reply may beat this thread back (so
    // `pushed` is corrected below, which only the trace reads).
    sh.in_flight.lock().expect("in-flight lock").insert(
        key,
        Flight {
            order,
            task,
            started,
            pushed: popped,
            acknowledged: None,
        },
    );
    let sent = {
        let mut lane_tx = sender.lock().expect("sender lock");
        let LaneSender { tx, initialised } = &mut *lane_tx;
        let before = tx.bytes_sent();
        let init = if initialised.insert(key) {
            // Before a key's first frames go: the server's replies may be read (and
            // counted) before this thread counts what it wrote.
            sh.wire.open(key, &tensor_name);
            match (members.as_deref(), &delta) {
                // Members are for raw keys only (the service refuses the rest).
                (Some(members), _) => tx.init_member_key(key, dtype, len as u64, members),
                // The stored value a delta key starts from.
                (None, Some(delta)) => {
                    tx.init_key(key, dtype, len as u64, Some(delta.initial.bytes()))
                }
                (None, None) if codec.is_raw() => tx.init_key(key, dtype, len as u64, None),
                (None, None) => tx.init_compressed_key(key, len as u64, codec),
            }
        } else {
            Ok(())
        };
        let pushed = if let Some(delta) = &delta {
            Pushed::Delta(data.bytes(), delta.staleness)
        } else if !pushes {
            Pushed::Skip
        } else if codec.is_raw() {
            Pushed::Raw(data.bytes())
        } else {
            Pushed::Compressed(codec.codec, &buffers.payload)
        };
        let skips = skips.as_deref().unwrap_or_default();
        let sent =
            init.and_then(|()| tx.push_and_pull(key, round, (dtype, op), pushed, wants_sum, skips));
        sh.wire.sent(key, &tensor_name, tx.bytes_sent() - before);
        sent
    };
    // Recorded before the access ends: the waiter cannot return (and a step close the
    // trace window) before it is.
    if let Some((tensor, part)) = label {
        let pushed = Instant::now();
        if let Some(f) = sh.in_flight.lock().expect("in-flight lock").get_mut(&key) {
            f.pushed = pushed;
        }
        sh.tracer.span(
            Track::Push {
                server: server as u32,
                lane: index as u32,
            },
            format!("{tensor} [{part}]"),
            popped,
            pushed,
            &[
                ("bytes", Arg::Uint(wire_len)),
                ("round", Arg::Uint(round)),
                ("key", Arg::Uint(key)),
                (
                    "queued in lane ms",
                    Arg::Float(popped.duration_since(started).as_secs_f64() * 1e3),
                ),
            ],
        );
    }
    sh.handles.end_access(handle, None);
    if let Err(e) = sent {
        if !sh.stop.load(Ordering::Acquire) {
            server_lost(sh, server, &e.to_string());
        }
    }
}

/// Encodes a compressed partition into `buffers.payload`, with its key's residual when it
/// has error feedback.
fn compress(sh: &Shared, task: &PartTask, c: Compressor, buffers: &mut CodecBuffers) {
    let bytes = task.data.bytes();
    let input: &[f32] = match bytemuck::try_cast_slice(bytes) {
        Ok(aligned) => aligned,
        Err(_) => {
            buffers.elements.clear();
            buffers.elements.extend(
                bytes
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes"))),
            );
            &buffers.elements
        }
    };
    buffers.payload.resize(c.payload_len(), 0);
    let (seed, scratch, out) = (
        task.seed(sh.rank),
        &mut buffers.scratch,
        &mut buffers.payload,
    );
    if task.codec.feedback {
        let mut residual = sh.residuals.take(task.key(), c.elements());
        c.compress_with_feedback(input, &mut residual, seed, scratch, out);
        sh.residuals.put(task.key(), residual);
    } else {
        c.compress(input, seed, scratch, out);
    }
}
