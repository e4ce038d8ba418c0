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
//! BytePS §4.1's analysis assumes. A partition started by the credit a lane's receiver
//! returned, while that lane's push thread sleeps with nothing queued, is sent by the
//! receiver itself: waking the push thread for it cost a futex call and two context
//! switches per partition (issue 22's CPU per byte). A sum is read from the socket into
//! the caller's memory directly: no intermediate buffer to allocate or fault in, and no
//! second pass to copy it, so a sum is touched once (twice when averaged).
//!
//! The scheduler is driven inline by the events (a push_pull call, a sum arriving) and by
//! one timer thread for what happens without an event (a push window's stall rule).
//!
//! This module wires the stages together and drives the scheduler; [`task`] is what
//! travels for each partition, [`push`] the send queues and push threads, [`receive`] the
//! receiver threads.

mod push;
mod receive;
mod task;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sumflow_client::server::{ServerReceiver, ServerSender};
use sumflow_plan::lanes;
use sumflow_plan::partition::Partition;
use sumflow_plan::scheduler::{Decision, Order, Ready, Schedule, Scheduler, Started};
use sumflow_wire::ErrorCode;
use tracing::warn;

use crate::accounting::{KeyBytes, Ledger, WireBytes};
use crate::compression::Residuals;
use crate::error::CommError;
use crate::handles::Handles;
use crate::queue::LaneQueue;
use crate::trace::{Arg, Tracer, Track};
use push::{push_loop, Lane, LaneSender, Queued};
use receive::receive_loop;
pub use task::{Delta, HostSlice, PartTask};

/// How often idle threads check for shutdown.
const POLL: Duration = Duration::from_millis(100);

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

#[derive(Debug)]
struct Shared {
    lanes: Vec<Lane>,
    /// Per server: (its first lane, how many).
    server_lanes: Vec<(usize, usize)>,
    server_names: Vec<String>,
    /// The job's workers' names by rank, for messages naming them.
    worker_names: Vec<String>,
    scheduler: Mutex<Scheduler<PartTask>>,
    /// Wakes the timer thread when the scheduler's next deadline may have moved.
    timer: Condvar,
    /// Started partitions whose push went out, by key.
    in_flight: Mutex<HashMap<u64, Flight>>,
    tracer: Arc<Tracer>,
    dead: Vec<Mutex<Option<String>>>,
    /// Per server: the last round it said lacks other workers' pushes (key, and what it
    /// said, naming them), until that key's sum comes back; timeout errors repeat it.
    stalls: Vec<Mutex<Option<(u64, String)>>>,
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
        let kept = self.dispatch_helping(started, None);
        debug_assert!(kept.is_empty());
    }

    /// As `dispatch`, but what is started for lane `helper` while its push thread sleeps
    /// with nothing queued comes back, in order, for the caller (that lane's receiver,
    /// which returned the credit) to send once the scheduler is unlocked.
    fn dispatch_helping(
        &self,
        started: Vec<Started<PartTask>>,
        helper: Option<usize>,
    ) -> Vec<Queued> {
        let now = Instant::now();
        let mut kept = Vec::new();
        for Started {
            server,
            order,
            item,
        } in started
        {
            let lane = self.lane_of(server, item.key());
            let queued = (order, now, item);
            // Once one is kept, the rest for that lane are too, keeping their order.
            if Some(lane) == helper {
                if !kept.is_empty() {
                    kept.push(queued);
                } else if let Some(queued) = self.lanes[lane].queue.offer(queued) {
                    kept.push(queued);
                }
            } else {
                self.lanes[lane].queue.push(queued);
            }
        }
        kept
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
    /// worker `rank` of the workers named `worker_names`.
    pub fn start(
        links: Vec<ServerLink>,
        handles: Arc<Handles>,
        schedule: Schedule,
        partition_bytes: u64,
        tracer: Arc<Tracer>,
        rank: u32,
        worker_names: Vec<String>,
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
                    sender: Mutex::new(LaneSender::new(tx)),
                    queue: LaneQueue::default(),
                    index,
                });
                receivers.push(rx);
            }
        }
        let scheduler = Scheduler::new(schedule, partition_bytes, names.len(), Instant::now());
        let shared = Arc::new(Shared {
            dead: names.iter().map(|_| Mutex::new(None)).collect(),
            stalls: names.iter().map(|_| Mutex::new(None)).collect(),
            lanes,
            server_lanes,
            server_names: names,
            worker_names,
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

    /// Changes the push window per server.
    pub fn set_window(&self, window_bytes: u64) {
        let sh = &self.shared;
        let mut s = sh.scheduler();
        s.set_window(window_bytes);
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

    /// Sends `Retire` for each (key, server) on the key's lane, and forgets the keys'
    /// residuals and lane state. The caller has made sure nothing of these keys is queued
    /// or in flight (their operations are done): their frames are all written, so the
    /// `Retire` follows them on the connection.
    pub fn retire(&self, tensor: &Arc<str>, keys: &[(u64, usize)]) -> Result<(), CommError> {
        let sh = &self.shared;
        if sh.stop.load(Ordering::Acquire) {
            return Err(CommError::Shutdown);
        }
        for &(key, server) in keys {
            if let Some(why) = sh.dead[server].lock().expect("dead lock").clone() {
                return Err(lost(tensor, &sh.server_names[server], &why));
            }
            let lane = &sh.lanes[sh.lane_of(server, key)];
            let sent = {
                let mut lane_tx = lane.sender.lock().expect("sender lock");
                let before = lane_tx.tx.bytes_sent();
                let sent = lane_tx.tx.retire(key);
                sh.wire.sent(key, tensor, lane_tx.tx.bytes_sent() - before);
                // Retired keys never come back (tensor ids are never reused).
                lane_tx.initialised.remove(&key);
                sent
            };
            if let Err(e) = sent {
                server_lost(sh, server, &e.to_string());
                return Err(lost(tensor, &sh.server_names[server], &e.to_string()));
            }
            sh.residuals.forget(key);
        }
        Ok(())
    }

    /// Where failures of servers the coordinator reports are told.
    pub fn server_failures(&self) -> ServerFailures {
        ServerFailures(Arc::clone(&self.shared))
    }

    /// The name of a server, for messages.
    pub fn server_name(&self, server: usize) -> String {
        self.shared.server_names[server].clone()
    }

    /// A server's name and, if it said a round this worker waits on lacks other workers'
    /// pushes, what it said (naming them): what a timeout error tells about the server.
    pub fn server_wait(&self, server: usize) -> String {
        let name = self.server_name(server);
        match &*self.shared.stalls[server].lock().expect("stalls lock") {
            Some((_, said)) => format!("{name}, where {said}"),
            None => name,
        }
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
            let tx = &mut lane.sender.lock().expect("sender lock").tx;
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

/// Reports servers failed from outside the pipeline (the coordinator's notices).
pub struct ServerFailures(Arc<Shared>);

impl ServerFailures {
    /// Server `server` failed for `why`: everything queued for it, in flight on it or
    /// waiting for it fails at once, naming it, as if its lanes broke.
    pub fn report(&self, server: usize, why: &str) {
        if server < self.0.server_names.len() {
            server_lost(&self.0, server, why);
        }
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

/// The server has read a push: its credit returns, which may start the next ones. Those
/// for `lane` while its push thread sleeps go to `kept`, for its receiver to send.
fn acknowledged(sh: &Shared, key: u64, round: u64, lane: usize, kept: &mut Vec<Queued>) {
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
    kept.extend(sh.dispatch_helping(s.poll(now), Some(lane)));
}

/// A partition's sum is back (or it failed): its credit returns, which may start the
/// next ones; as [`acknowledged`], those kept for `lane` go to `kept`.
fn finished(sh: &Shared, order: Order, ok: bool, lane: usize, kept: &mut Vec<Queued>) {
    let now = Instant::now();
    let mut s = sh.scheduler();
    if ok {
        s.finished(order, now);
    } else {
        s.abandoned(order, now);
    }
    kept.extend(sh.dispatch_helping(s.poll(now), Some(lane)));
}

#[cfg(test)]
mod tests;
