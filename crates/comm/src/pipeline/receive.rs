//! The receiving half of each lane: a thread that reads the server's replies, hands
//! acknowledgements and sums to the scheduler, and reads each sum straight into the
//! caller's tensor (decoding it there when compressed, dividing it there for Average).

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use sumflow_client::server::{Reply, ServerReceiver, SumHeader};
use sumflow_client::ClientError;
use sumflow_compress::{Compressor, PayloadError};
use sumflow_wire::{Codec, KeyCodec};
use thiserror::Error;
use tracing::{debug, warn};

use super::push::{send, Queued};
use super::task::{CodecBuffers, PartTask};
use super::{acknowledged, finished, server_lost, Flight, Shared};
use crate::average::scale_in_place;
use crate::error::CommError;
use crate::trace::{Arg, Track};

/// Why a lane's receiver gives its server up.
#[derive(Debug, Error)]
enum ReceiveError {
    #[error(transparent)]
    Connection(#[from] ClientError),
    #[error("sent the sum of key {key} round {round} that was not asked for ({asked:?})")]
    NotAsked {
        key: u64,
        round: u64,
        /// What this worker had in flight under that key (boxed: a rare error should
        /// not make every result of `receive_sum` as large as a task).
        asked: Option<Box<PartTask>>,
    },
    #[error("sum of key {key}: {source}")]
    Sum { key: u64, source: SumError },
    #[error(
        "answered the pull of key {key} round {round} with {len} bytes, but it asked only \
         for the notice that the round is complete"
    )]
    NotWanted { key: u64, round: u64, len: usize },
}

/// Why a sum could not be read into its partition.
#[derive(Debug, Error)]
enum SumError {
    #[error(transparent)]
    Read(#[from] ClientError),
    #[error("a {got} sum for a key declared {declared}")]
    Codec { got: Codec, declared: KeyCodec },
    #[error("the {codec} sum: {source}")]
    Payload {
        codec: KeyCodec,
        source: PayloadError,
    },
}

pub(super) fn receive_loop(sh: &Shared, lane: usize, mut rx: ServerReceiver) {
    let server = sh.lanes[lane].server;
    let mut buffers = CodecBuffers::default();
    // Partitions started for this lane, by the credit a reply returned, while its push
    // thread slept: sent from here once the reply is handled.
    let mut kept = Vec::new();
    loop {
        let mut before = rx.bytes_received();
        let (key, received) = match rx.recv_header() {
            // Counted inside (moving `before` past it), before the operation can complete
            // and its waiter read the count.
            Ok(Reply::Sum(head)) => (
                None,
                receive_sum(
                    sh,
                    (lane, &mut kept),
                    &mut rx,
                    head,
                    &mut before,
                    &mut buffers,
                ),
            ),
            Ok(Reply::PushAck { key, round }) => {
                acknowledged(sh, key, round, lane, &mut kept);
                (Some(key), Ok(()))
            }
            Ok(Reply::InitAck { key }) => (Some(key), Ok(())),
            // Joins travel on connections of their own (CommunicationService::join).
            Ok(Reply::HeartbeatAck { .. } | Reply::JoinAck { .. }) => (None, Ok(())),
            Ok(Reply::Stalled {
                key,
                round,
                waited,
                missing,
            }) => {
                stalled(sh, server, key, round, waited, &missing);
                (Some(key), Ok(()))
            }
            Err(ClientError::Remote {
                key: Some(key),
                code,
                message,
                ..
            }) => {
                let flight = sh.in_flight.lock().expect("in-flight lock").remove(&key);
                if let Some(Flight { order, task, .. }) = flight {
                    finished(sh, order, false, lane, &mut kept);
                    let server_name = sh.server_names[server].clone();
                    sh.handles.fail(task.handle, |t| CommError::Failed {
                        tensor: t.to_string(),
                        code,
                        message: format!("{server_name}: {message}"),
                    });
                }
                (Some(key), Ok(()))
            }
            Err(e) => (None, Err(ReceiveError::from(e))),
        };
        sh.wire.received(key, rx.bytes_received() - before);
        for queued in kept.drain(..) {
            send(sh, lane, queued, &mut buffers);
        }
        if let Err(why) = received {
            if !sh.stop.load(Ordering::Acquire) {
                server_lost(sh, server, &why.to_string());
            }
            debug!(server, lane, "receiver stopping");
            return;
        }
    }
}

/// The server says a round this worker waits on still lacks some workers' pushes: the
/// stall inspector's news, logged with the tensor's name (Horovod's stall check names the
/// ranks that have not submitted, as this does).
fn stalled(sh: &Shared, server: usize, key: u64, round: u64, waited: Duration, missing: &[u32]) {
    let what = match sh.in_flight.lock().expect("in-flight lock").get(&key) {
        Some(f) => format!("tensor '{}' (partition {})", f.task.name, f.task.index),
        None => format!("key {key}"),
    };
    let workers: Vec<String> = missing
        .iter()
        .map(|&rank| match sh.worker_names.get(rank as usize) {
            Some(name) if !name.is_empty() => format!("rank {rank} '{name}'"),
            _ => format!("rank {rank}"),
        })
        .collect();
    *sh.stalls[server].lock().expect("stalls lock") = Some((
        key,
        format!(
            "{what} round {round} waited {:.0} s for {} to push",
            waited.as_secs_f64(),
            workers.join(", ")
        ),
    ));
    warn!(
        "{what}: round {round} has waited {:.0} s on {} for {}, which {} not pushed it \
         (stuck in {} own code, or not calling the operation)",
        waited.as_secs_f64(),
        sh.server_names[server],
        workers.join(", "),
        if workers.len() == 1 { "has" } else { "have" },
        if workers.len() == 1 { "its" } else { "their" },
    );
}

/// Reads a sum straight into its partition of the caller's tensor, averages it there if
/// asked, and marks the partition done. An error is why the server must be given up.
fn receive_sum(
    sh: &Shared,
    (lane, kept): (usize, &mut Vec<Queued>),
    rx: &mut ServerReceiver,
    head: SumHeader,
    counted_from: &mut u64,
    buffers: &mut CodecBuffers,
) -> Result<(), ReceiveError> {
    let mut count = |rx: &ServerReceiver| {
        sh.wire
            .received(Some(head.key), rx.bytes_received() - *counted_from);
        *counted_from = rx.bytes_received();
    };
    let arrived = Instant::now();
    let flight = sh
        .in_flight
        .lock()
        .expect("in-flight lock")
        .remove(&head.key);
    let (order, task, times) = match flight {
        Some(f) if f.task.round == head.round => {
            (f.order, f.task, (f.started, f.pushed, f.acknowledged))
        }
        other => {
            return Err(ReceiveError::NotAsked {
                key: head.key,
                round: head.round,
                asked: other.map(|f| Box::new(f.task)),
            })
        }
    };
    {
        let mut stall = sh.stalls[task.server()].lock().expect("stalls lock");
        if stall.as_ref().is_some_and(|(key, _)| *key == head.key) {
            *stall = None;
        }
    }
    // The credit returns before the sum is read: the next push overlaps the read (sent
    // from here when the push thread sleeps, before reading on).
    finished(sh, order, true, lane, kept);
    for queued in kept.drain(..) {
        send(sh, lane, queued, buffers);
    }
    if !task.wants_sum {
        // Only the notice: the span stays as it is.
        if head.len != 0 {
            return Err(ReceiveError::NotWanted {
                key: head.key,
                round: head.round,
                len: head.len,
            });
        }
        if sh.handles.begin_access(task.handle) {
            sh.handles.end_access(task.handle, Some(task.key()));
        }
        count(rx);
        return Ok(());
    }
    // A failed operation's buffer may already be gone: never write into it.
    if !sh.handles.begin_access(task.handle) {
        let skipped = rx.skip_sum();
        count(rx);
        return Ok(skipped?);
    }
    let dst = task.data.bytes_mut();
    let read = match task.compressor() {
        None => rx.read_sum(dst).map_err(SumError::from),
        Some(c) => read_compressed(sh, rx, &head, &task, c, dst, buffers),
    };
    if read.is_ok() {
        scale_in_place(task.dtype, dst, task.divisor);
    }
    if sh.tracer.active() {
        let (started, pushed, acknowledged) = times;
        let ms =
            |a: Instant, b: Instant| Arg::Float(b.saturating_duration_since(a).as_secs_f64() * 1e3);
        let mut args = vec![
            ("bytes", Arg::Uint(dst.len() as u64)),
            ("round", Arg::Uint(head.round)),
            ("started to sum ms", ms(started, arrived)),
            ("pushed to sum ms", ms(pushed, arrived)),
        ];
        if let Some(ack) = acknowledged {
            args.push(("pushed to acknowledged ms", ms(pushed, ack)));
        }
        sh.tracer.span(
            Track::Receive {
                server: task.partition.server,
                lane: sh.lanes[lane].index as u32,
            },
            format!("{} [{}]", task.name, task.index),
            arrived,
            Instant::now(),
            &args,
        );
    }
    count(rx);
    // A partition left half-read is not done: losing the server fails its operation.
    sh.handles
        .end_access(task.handle, read.is_ok().then_some(task.key()));
    read.map_err(|source| ReceiveError::Sum {
        key: head.key,
        source,
    })
}

/// Reads a compressed sum, checks it, and decodes it into the partition's memory.
fn read_compressed(
    sh: &Shared,
    rx: &mut ServerReceiver,
    head: &SumHeader,
    task: &PartTask,
    c: Compressor,
    dst: &mut [u8],
    buffers: &mut CodecBuffers,
) -> Result<(), SumError> {
    if head.codec != task.codec.codec {
        return Err(SumError::Codec {
            got: head.codec,
            declared: task.codec,
        });
    }
    buffers.payload.resize(c.payload_len(), 0);
    rx.read_sum(&mut buffers.payload)?;
    c.validate(&buffers.payload)
        .map_err(|source| SumError::Payload {
            codec: task.codec,
            source,
        })?;
    let (seed, scratch) = (task.seed(sh.rank), &mut buffers.scratch);
    match bytemuck::try_cast_slice_mut::<u8, f32>(dst) {
        Ok(out) => c.decompress(&buffers.payload, seed, scratch, out),
        Err(_) => {
            buffers.elements.resize(c.elements(), 0.0);
            c.decompress(&buffers.payload, seed, scratch, &mut buffers.elements);
            for (d, v) in dst.chunks_exact_mut(4).zip(&buffers.elements) {
                d.copy_from_slice(&v.to_le_bytes());
            }
        }
    }
    Ok(())
}
