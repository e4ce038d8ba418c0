//! The staged pipeline (BytePS §6.1) under a scheduler: partitions become ready, the
//! [`Scheduler`] decides when each starts, a push thread per lane sends what started, and
//! each lane's receiver thread reads the sums straight into the tensors they belong to.
//! A lane is one connection to a server; a server has one or more (see [`sumflow_plan::lanes`]),
//! and each of its keys always travels on the same one, `key % lanes`, so a key's push,
//! pull and sum stay in order on one connection.
//!
//! ```text
//!  enqueue --> scheduler --started--> [lane queue l] --push thread l--> server s --receiver l--> tensor
//!              (order, credit,         FIFO                                        (read in place,
//!               Prophet's blocks)                                                   / n for Average)
//!                   ^------------------------------- finished ----------------------------'
//! ```
//!
//! Pushes of later partitions go out while earlier ones are still being summed and pulled,
//! and partitions of different tensors interleave as the scheduler orders them. Each lane
//! has its own send queue and thread: every worker sends partitions in the same order, so
//! with one sending thread all workers would push to the same server at once while the
//! links to the others idled (incast). One sender per lane keeps every link busy, as
//! BytePS §4.1's analysis assumes. A sum is read from the socket into the caller's memory
//! directly: no intermediate buffer to allocate or fault in, and no second pass to copy
//! it, so a sum is touched once (twice when averaged).
//!
//! The scheduler is driven inline by the events (a push_pull call, a sum arriving) and by
//! one timer thread for what happens without an event (a push window's stall rule).

use std::collections::{HashMap, HashSet};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sumflow_client::server::{Reply, ServerReceiver, ServerSender, SumHeader};
use sumflow_client::ClientError;
use sumflow_compress::{Compressor, PayloadError, Scratch, Seed};
use sumflow_plan::lanes;
use sumflow_plan::partition::Partition;
use sumflow_plan::scheduler::{Decision, Order, Ready, Schedule, Scheduler, Started};
use sumflow_wire::{Codec, Dtype, ErrorCode, KeyCodec};
use thiserror::Error;
use tracing::{debug, warn};

use crate::accounting::{KeyBytes, Ledger, WireBytes};
use crate::average::scale_in_place;
use crate::compression::Residuals;
use crate::error::CommError;
use crate::handles::Handles;
use crate::queue::LaneQueue;
use crate::trace::{Arg, Tracer, Track};

/// How often idle threads check for shutdown.
const POLL: Duration = Duration::from_millis(100);

/// Why a lane's receiver gives its server up.
#[derive(Debug, Error)]
enum ReceiveError {
    #[error(transparent)]
    Connection(#[from] ClientError),
    #[error("sent the sum of key {key} round {round} that was not asked for ({asked:?})")]
    NotAsked {
        key: u64,
        round: u64,
        /// What this worker had in flight under that key.
        asked: Option<PartTask>,
    },
    #[error("sum of key {key}: {source}")]
    Sum { key: u64, source: SumError },
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

/// A span of the caller's tensor memory.
///
/// The push stage reads it and its lane's receiver later overwrites it with the result.
#[derive(Clone, Copy, Debug)]
pub struct HostSlice {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a HostSlice is only created by `HostSlice::new`, whose caller promises the memory
// stays valid and untouched by others until the operation has been waited for; the stages
// touch it only between `Handles::begin_access` and `end_access`, which `wait` outlasts,
// and each slice from one thread at a time (push, then receive, ordered by the reply).
unsafe impl Send for HostSlice {}

impl HostSlice {
    /// # Safety
    /// `ptr..ptr+len` must be valid for reads and writes, and neither freed nor accessed by
    /// anyone else until `Handles::wait` on the operation using it has returned something
    /// other than a timeout.
    pub unsafe fn new(ptr: *mut u8, len: usize) -> Option<HostSlice> {
        NonNull::new(ptr).map(|ptr| HostSlice { ptr, len })
    }

    /// The sub-span `offset..offset+len`.
    pub fn sub(&self, offset: usize, len: usize) -> HostSlice {
        assert!(offset + len <= self.len, "sub-span out of range");
        // SAFETY: in bounds of the span the caller vouched for, which is not null.
        let ptr = unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) };
        HostSlice { ptr, len }
    }

    fn bytes(&self) -> &[u8] {
        // SAFETY: see `new`; only the push stage reads, before the reply exists.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    #[allow(clippy::mut_from_ref)]
    fn bytes_mut(&self) -> &mut [u8] {
        // SAFETY: see `new`; only the receiver of this span's lane writes, once its sum
        // arrived: the server answers the Pull that the lane's push thread sends after the
        // whole push, on the same connection, so that thread has stopped reading the span
        // by then.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// One partition of one push_pull.
#[derive(Debug)]
pub struct PartTask {
    pub handle: u64,
    pub partition: Partition,
    pub round: u64,
    pub dtype: Dtype,
    /// The partition's span of the caller's tensor.
    pub data: HostSlice,
    /// How its push and sum are encoded on the wire.
    pub codec: KeyCodec,
    /// Divide the sum by this (Average).
    pub divisor: Option<u32>,
    /// The tensor's name and the partition's index in it, for the trace.
    pub name: Arc<str>,
    pub index: u32,
}

impl PartTask {
    fn key(&self) -> u64 {
        self.partition.key
    }

    fn server(&self) -> usize {
        self.partition.server as usize
    }

    /// Bytes of its push on the wire, what the scheduler's credit counts.
    fn wire_len(&self) -> u64 {
        let elements = (self.data.len / self.dtype.size()) as u64;
        self.codec.payload_len(self.dtype, elements)
    }

    /// Its compressor, for a compressed partition.
    fn compressor(&self) -> Option<Compressor> {
        (!self.codec.is_raw()).then(|| {
            Compressor::new(self.codec, self.data.len / 4)
                .expect("the service declares codecs that fit their keys")
        })
    }

    /// Where random-k's indices and dithering's rounding come from: this worker's stream
    /// of the key's round.
    fn seed(&self, rank: u32) -> Seed {
        Seed::new(self.key(), self.round, u64::from(rank))
    }
}

/// What a lane's thread reuses to compress or decode partitions: no allocation per
/// partition once the largest has passed.
#[derive(Default)]
struct CodecBuffers {
    scratch: Scratch,
    payload: Vec<u8>,
    /// The partition as f32s, where the tensor's memory is not 4-byte aligned.
    elements: Vec<f32>,
}

/// A started partition until its sum is back.
#[derive(Debug)]
struct Flight {
    order: Order,
    task: PartTask,
    /// When the scheduler started it, its push was written, and the server acknowledged it.
    started: Instant,
    pushed: Instant,
    acknowledged: Option<Instant>,
}

/// One server's connections, as [`Pipeline::start`] takes them.
pub struct ServerLink {
    /// How messages name the server.
    pub name: String,
    /// At least one connection.
    pub lanes: Vec<(ServerSender, ServerReceiver)>,
}

/// One connection to a server, with its send queue.
#[derive(Debug)]
struct Lane {
    server: usize,
    sender: Mutex<ServerSender>,
    queue: LaneQueue<(Order, Instant, PartTask)>,
    /// Its index among its server's lanes, for the trace.
    index: usize,
}

#[derive(Debug)]
struct Shared {
    lanes: Vec<Lane>,
    /// Per server: (its first lane, how many).
    server_lanes: Vec<(usize, usize)>,
    server_names: Vec<String>,
    scheduler: Mutex<Scheduler<PartTask>>,
    /// Wakes the timer thread when the scheduler's next deadline may have moved.
    timer: Condvar,
    /// Started partitions whose push went out, by key.
    in_flight: Mutex<HashMap<u64, Flight>>,
    tracer: Arc<Tracer>,
    dead: Vec<Mutex<Option<String>>>,
    handles: Arc<Handles>,
    wire: Ledger,
    /// This worker's rank: its stream of random draws.
    rank: u32,
    residuals: Residuals,
    stop: AtomicBool,
}

impl Shared {
    /// The lane that carries `key` to `server`.
    fn lane_of(&self, server: usize, key: u64) -> usize {
        let (first, count) = self.server_lanes[server];
        first + lanes::lane_of(key, count as u32) as usize
    }

    fn lanes_of(&self, server: usize) -> &[Lane] {
        let (first, count) = self.server_lanes[server];
        &self.lanes[first..first + count]
    }

    fn scheduler(&self) -> MutexGuard<'_, Scheduler<PartTask>> {
        self.scheduler.lock().expect("scheduler lock")
    }

    /// Hands what the scheduler started to the lanes. Called with the scheduler locked, so
    /// lanes receive partitions in the order they started.
    fn dispatch(&self, started: Vec<Started<PartTask>>) {
        let now = Instant::now();
        for Started {
            server,
            order,
            item,
        } in started
        {
            let lane = self.lane_of(server, item.key());
            self.lanes[lane].queue.push((order, now, item));
        }
    }

    /// Records a scheduler decision and the scheduler's load on the trace.
    fn trace_decision(&self, s: &Scheduler<PartTask>, what: &str, priority: i64, d: &Decision) {
        if !self.tracer.active() {
            return;
        }
        let now = Instant::now();
        let why = d.why.as_ref().map(|w| w.describe());
        let mut args = vec![
            ("priority", Arg::Int(priority)),
            ("partitions", Arg::Uint(d.ready as u64)),
        ];
        if let Some(why) = &why {
            args.push(("block", Arg::Uint(d.block as u64)));
            args.push(("prophet", Arg::Str(why)));
        }
        self.tracer
            .instant(Track::Scheduler, what.to_string(), now, &args);
        let mut values = vec![
            ("outstanding MB", s.outstanding() as f64 / 1e6),
            ("waiting", s.waiting() as f64),
            ("in flight", s.in_flight() as f64),
        ];
        if let Some(rate) = s.bandwidth() {
            values.push(("bandwidth MB/s", rate / 1e6));
        }
        self.tracer.counter("scheduler", now, &values);
    }
}

#[derive(Debug)]
pub struct Pipeline {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Pipeline {
    /// Starts the lanes' threads and the scheduler's timer over each server's lanes, for
    /// worker `rank`.
    pub fn start(
        links: Vec<ServerLink>,
        handles: Arc<Handles>,
        schedule: Schedule,
        partition_bytes: u64,
        tracer: Arc<Tracer>,
        rank: u32,
    ) -> Result<Pipeline, CommError> {
        let mut lanes = Vec::new();
        let mut receivers = Vec::new();
        let mut server_lanes = Vec::new();
        let mut names = Vec::new();
        for (server, link) in links.into_iter().enumerate() {
            if link.lanes.is_empty() {
                return Err(CommError::Invalid(format!(
                    "{} has no connection to send on",
                    link.name
                )));
            }
            server_lanes.push((lanes.len(), link.lanes.len()));
            names.push(link.name);
            for (index, (tx, rx)) in link.lanes.into_iter().enumerate() {
                lanes.push(Lane {
                    server,
                    sender: Mutex::new(tx),
                    queue: LaneQueue::default(),
                    index,
                });
                receivers.push(rx);
            }
        }
        let scheduler = Scheduler::new(schedule, partition_bytes, names.len(), Instant::now());
        let shared = Arc::new(Shared {
            dead: names.iter().map(|_| Mutex::new(None)).collect(),
            lanes,
            server_lanes,
            server_names: names,
            scheduler: Mutex::new(scheduler),
            timer: Condvar::new(),
            in_flight: Mutex::new(HashMap::new()),
            tracer,
            handles,
            wire: Ledger::default(),
            rank,
            residuals: Residuals::default(),
            stop: AtomicBool::new(false),
        });
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name.clone())
                .spawn(f)
                .map_err(|source| CommError::Io {
                    what: format!("cannot start the pipeline thread {name}"),
                    source: Arc::new(source),
                })
        };
        let mut threads = Vec::new();
        for (l, rx) in receivers.into_iter().enumerate() {
            let sh = Arc::clone(&shared);
            threads.push(spawn(
                format!("sumflow-recv-{l}"),
                Box::new(move || receive_loop(&sh, l, rx)),
            )?);
            let sh = Arc::clone(&shared);
            threads.push(spawn(
                format!("sumflow-push-{l}"),
                Box::new(move || push_loop(&sh, l)),
            )?);
        }
        let sh = Arc::clone(&shared);
        threads.push(spawn(
            "sumflow-scheduler".into(),
            Box::new(move || timer_loop(&sh)),
        )?);
        Ok(Pipeline {
            shared,
            threads: Mutex::new(threads),
        })
    }

    /// Hands the partitions of one push_pull of `tensor` (`name`) to the scheduler, as
    /// ready now.
    pub fn enqueue(&self, tensor: u32, name: &str, priority: i64, tasks: Vec<PartTask>) {
        let sh = &self.shared;
        let mut parts = Vec::with_capacity(tasks.len());
        for task in tasks {
            if sh.stop.load(Ordering::Acquire) {
                sh.handles.fail(task.handle, |_| CommError::Shutdown);
                continue;
            }
            if let Some(why) = sh.dead[task.server()].lock().expect("dead lock").clone() {
                let name = sh.server_names[task.server()].clone();
                sh.handles.fail(task.handle, |t| lost(t, &name, &why));
                continue;
            }
            parts.push(Ready {
                partition: task.partition,
                wire_bytes: task.wire_len(),
                item: task,
            });
        }
        let now = Instant::now();
        let mut s = sh.scheduler();
        let decision = s.ready(tensor, priority, parts, now);
        sh.dispatch(s.poll(now));
        sh.trace_decision(&s, name, priority, &decision);
        drop(s);
        sh.timer.notify_one();
    }

    /// Marks the end of an iteration's backward pass (the plugin's optimizer step).
    pub fn mark_step(&self) {
        let sh = &self.shared;
        let mut s = sh.scheduler();
        s.mark_step();
        sh.dispatch(s.poll(Instant::now()));
        sh.trace_decision(&s, "step", 0, &Decision::default());
    }

    /// Changes the credit per server (and the partition size P3's credit follows).
    pub fn set_credit(&self, credit_bytes: u64, partition_bytes: u64) {
        let sh = &self.shared;
        let mut s = sh.scheduler();
        s.set_credit(credit_bytes, partition_bytes);
        sh.dispatch(s.poll(Instant::now()));
    }

    /// The scheduler's knobs now.
    pub fn schedule(&self) -> Schedule {
        self.shared.scheduler().schedule().clone()
    }

    /// The measured rate at which servers acknowledge this worker's pushes, bytes per
    /// second of busy network.
    pub fn bandwidth(&self) -> Option<f64> {
        self.shared.scheduler().bandwidth()
    }

    /// The bytes written to and read from the servers so far, per key, and those no key
    /// names (see [`crate::accounting`]).
    pub fn wire_bytes(&self) -> (Vec<KeyBytes>, WireBytes) {
        self.shared.wire.snapshot()
    }

    /// Moves a tensor's error-feedback residuals from its keys under one partition size
    /// to its keys under another (see [`Residuals::relayout`]).
    pub fn relayout_residuals(&self, old: &[Partition], new: &[Partition]) {
        self.shared.residuals.relayout(old, new);
    }

    /// The name of a server, for messages.
    pub fn server_name(&self, server: usize) -> String {
        self.shared.server_names[server].clone()
    }

    /// Stops every stage, leaving each server gracefully; operations still in flight fail,
    /// and so does any enqueued later. Only the first call does anything.
    pub fn shutdown(&self, reason: &str) {
        if self.shared.stop.swap(true, Ordering::AcqRel) {
            return;
        }
        drop(self.shared.scheduler().drain_where(|_, _| true));
        self.shared.timer.notify_all();
        for lane in &self.shared.lanes {
            lane.queue.close();
        }
        for lane in &self.shared.lanes {
            let mut tx = lane.sender.lock().expect("sender lock");
            let before = tx.bytes_sent();
            let _ = tx.shutdown(reason);
            self.shared.wire.sent_other(tx.bytes_sent() - before);
        }
        let threads = std::mem::take(&mut *self.threads.lock().expect("threads lock"));
        for t in threads {
            let _ = t.join();
        }
        self.shared.handles.fail_all(None, |_| CommError::Shutdown);
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.shutdown("communication service dropped");
    }
}

fn lost(tensor: &str, server: &str, why: &str) -> CommError {
    CommError::Failed {
        tensor: tensor.to_string(),
        code: ErrorCode::NodeFailed,
        message: format!("{server} is unreachable: {why}"),
    }
}

/// Marks a server dead and fails everything queued for it, in flight on it, or waiting:
/// losing any of its lanes loses the server (the server, for its part, fails this worker).
fn server_lost(sh: &Shared, server: usize, why: &str) {
    {
        let mut dead = sh.dead[server].lock().expect("dead lock");
        if dead.is_some() {
            return;
        }
        *dead = Some(why.to_string());
    }
    let name = &sh.server_names[server];
    warn!(server = %name, reason = %why, "lost a summation server");
    let stranded: Vec<Flight> = {
        let mut inf = sh.in_flight.lock().expect("in-flight lock");
        let keys: Vec<u64> = inf
            .iter()
            .filter(|(_, f)| f.task.server() == server)
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter().filter_map(|k| inf.remove(&k)).collect()
    };
    {
        let now = Instant::now();
        let mut s = sh.scheduler();
        for f in &stranded {
            s.abandoned(f.order, now);
        }
        drop(s.drain_where(|s, _| s == server));
        for lane in sh.lanes_of(server) {
            for (order, _, _) in lane.queue.drain() {
                s.abandoned(order, now);
            }
        }
        sh.dispatch(s.poll(now));
    }
    sh.handles.fail_all(Some(server), |t| lost(t, name, why));
}

/// Runs the scheduler's time-driven decisions: a full push window's stall rule.
fn timer_loop(sh: &Shared) {
    let mut s = sh.scheduler();
    while !sh.stop.load(Ordering::Acquire) {
        let now = Instant::now();
        sh.dispatch(s.poll(now));
        let wait = s.next_deadline(now).map_or(POLL, |d| {
            d.saturating_duration_since(now)
                .clamp(Duration::from_millis(1), POLL)
        });
        s = sh.timer.wait_timeout(s, wait).expect("scheduler lock").0;
    }
}

/// Sends the partitions started for `lane`, in the order they started.
fn push_loop(sh: &Shared, lane: usize) {
    let mut initialised: HashSet<u64> = HashSet::new();
    let mut buffers = CodecBuffers::default();
    let Lane {
        server,
        sender,
        queue,
        index,
    } = &sh.lanes[lane];
    let (server, index) = (*server, *index);
    while !sh.stop.load(Ordering::Acquire) {
        let Some((order, started, task)) = queue.pop(POLL) else {
            continue;
        };
        let popped = Instant::now();
        // A failed operation's buffer may already be gone: drop its remaining partitions.
        if !sh.handles.begin_access(task.handle) {
            sh.scheduler().abandoned(order, Instant::now());
            continue;
        }
        debug_assert_eq!(sh.lane_of(task.server(), task.key()), lane);
        // Compressed by this lane's thread, so lanes compress in parallel, and before the
        // connection is locked.
        if let Some(c) = task.compressor() {
            compress(sh, &task, c, &mut buffers);
        }
        let (key, round, dtype, len, handle, codec) = (
            task.key(),
            task.round,
            task.dtype,
            task.data.len,
            task.handle,
            task.codec,
        );
        let data = task.data;
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
            let mut tx = sender.lock().expect("sender lock");
            let before = tx.bytes_sent();
            let init = if initialised.insert(key) {
                // Before a key's first frames go: the server's replies may be read (and
                // counted) before this thread counts what it wrote.
                sh.wire.open(key, &tensor_name);
                if codec.is_raw() {
                    tx.init_key(key, dtype, len as u64, None)
                } else {
                    tx.init_compressed_key(key, len as u64, codec)
                }
            } else {
                Ok(())
            };
            let sent = init
                .and_then(|()| {
                    if codec.is_raw() {
                        tx.push(key, round, dtype, data.bytes())
                    } else {
                        tx.push_compressed(key, round, codec.codec, &buffers.payload)
                    }
                })
                .and_then(|()| tx.pull(key, round));
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
                    (
                        "bytes",
                        Arg::Uint(codec.payload_len(dtype, (len / dtype.size()) as u64)),
                    ),
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
            if sh.stop.load(Ordering::Acquire) {
                break;
            }
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

fn receive_loop(sh: &Shared, lane: usize, mut rx: ServerReceiver) {
    let server = sh.lanes[lane].server;
    let mut buffers = CodecBuffers::default();
    loop {
        let mut before = rx.bytes_received();
        let (key, received) = match rx.recv_header() {
            // Counted inside (moving `before` past it), before the operation can complete
            // and its waiter read the count.
            Ok(Reply::Sum(head)) => (
                None,
                receive_sum(sh, lane, &mut rx, head, &mut before, &mut buffers),
            ),
            Ok(Reply::PushAck { key, round }) => {
                acknowledged(sh, key, round);
                (Some(key), Ok(()))
            }
            Ok(Reply::InitAck { key }) => (Some(key), Ok(())),
            Ok(Reply::HeartbeatAck { .. }) => (None, Ok(())),
            Err(ClientError::Remote {
                key: Some(key),
                code,
                message,
                ..
            }) => {
                let flight = sh.in_flight.lock().expect("in-flight lock").remove(&key);
                if let Some(Flight { order, task, .. }) = flight {
                    finished(sh, order, false);
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
        if let Err(why) = received {
            if !sh.stop.load(Ordering::Acquire) {
                server_lost(sh, server, &why.to_string());
            }
            debug!(server, lane, "receiver stopping");
            return;
        }
    }
}

/// The server has read a push: its credit returns, which may start the next ones.
fn acknowledged(sh: &Shared, key: u64, round: u64) {
    let order = match sh.in_flight.lock().expect("in-flight lock").get_mut(&key) {
        Some(f) if f.task.round == round => {
            f.acknowledged = Some(Instant::now());
            f.order
        }
        _ => return,
    };
    let now = Instant::now();
    let mut s = sh.scheduler();
    s.acknowledged(order, now);
    sh.dispatch(s.poll(now));
}

/// A partition's sum is back (or it failed): its credit returns, which may start the
/// next ones.
fn finished(sh: &Shared, order: Order, ok: bool) {
    let now = Instant::now();
    let mut s = sh.scheduler();
    if ok {
        s.finished(order, now);
    } else {
        s.abandoned(order, now);
    }
    sh.dispatch(s.poll(now));
}

/// Reads a sum straight into its partition of the caller's tensor, averages it there if
/// asked, and marks the partition done. An error is why the server must be given up.
fn receive_sum(
    sh: &Shared,
    lane: usize,
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
                asked: other.map(|f| f.task),
            })
        }
    };
    // The credit returns before the sum is read: the next push overlaps the read.
    finished(sh, order, true);
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

#[cfg(test)]
mod tests;
