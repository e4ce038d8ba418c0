//! The staged pipeline (BytePS §6.1): partitions go out through a push stage, one thread
//! and priority queue per lane, and each lane's sums come back through that lane's
//! receiver thread, which reads them straight into the tensors they belong to. A lane is
//! one connection to a server; a server has one or more (see [`crate::lanes`]), and each
//! of its keys always travels on the same one, `key % lanes`, so a key's push, pull and
//! sum stay in order on one connection.
//!
//! ```text
//!  enqueue --> [push queue l] --push thread l--> server s --receiver l--> tensor
//!              by priority      (lane l of s)               (read in place, then / n for Average)
//! ```
//!
//! Pushes of later partitions go out while earlier ones are still being summed and pulled,
//! and partitions of different tensors interleave by priority. Each lane has its own push
//! queue and thread: every worker sends partitions in the same priority order, so with one
//! sending thread all workers would push to the same server at once while the links to the
//! others idled (incast: that server's ingress at B shared by n-1 senders, each worker's
//! egress at B/(n-1)). One sender per lane keeps every link busy, as BytePS §4.1's
//! analysis assumes, and each lane still sends its most urgent partition first. A sum is
//! read from the socket into the caller's memory directly: no intermediate buffer to allocate or fault
//! in, and no second pass to copy it, so a sum is touched once (twice when averaged).
//!
//! Nothing here waits on other workers before sending: a round completes only once every
//! worker pushed it, and workers may reach their partitions in different orders, so any
//! window counting bytes until their sums return could fill up with partitions the others
//! have not pushed yet and stall the job. Bytes in flight are bounded by the push thread's
//! blocking writes and the server's receive buffers instead. (ByteScheduler's credit,
//! which counts until the server has *received* a push, needs push acknowledgements the
//! protocol does not have yet.)

use std::collections::{HashMap, HashSet};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use sumflow_client::server::{Reply, ServerReceiver, ServerSender, SumHeader};
use sumflow_client::ClientError;
use sumflow_wire::{Dtype, ErrorCode};
use tracing::{debug, warn};

use crate::average::scale_in_place;
use crate::error::CommError;
use crate::handles::Handles;
use crate::queue::StageQueue;
use crate::window::PushWindow;

/// How often idle stage threads check for shutdown.
const POLL: Duration = Duration::from_millis(100);

/// How long a full push window waits without any sum coming back before it lets one more
/// partition out (only workers that disagree on priorities ever need it).
const WINDOW_STALL: Duration = Duration::from_millis(200);

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
        // SAFETY: in bounds of the span the caller vouched for.
        HostSlice {
            ptr: unsafe { NonNull::new_unchecked(self.ptr.as_ptr().add(offset)) },
            len,
        }
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
    pub key: u64,
    pub round: u64,
    pub server: usize,
    pub dtype: Dtype,
    pub priority: i64,
    pub data: HostSlice,
    /// Divide the sum by this (Average).
    pub divisor: Option<u32>,
}

impl PartTask {
    /// Its place in the sending order, the same on every worker.
    fn order(&self) -> (i64, u64) {
        (self.priority, self.key)
    }
}

/// One server's connections, as [`Pipeline::start`] takes them.
pub struct ServerLink {
    /// How messages name the server.
    pub name: String,
    /// At least one connection.
    pub lanes: Vec<(ServerSender, ServerReceiver)>,
}

/// One connection to a server, with its own push queue, push window and threads.
struct Lane {
    server: usize,
    sender: Mutex<ServerSender>,
    queue: StageQueue<PartTask>,
    window: Mutex<PushWindow>,
}

struct Shared {
    lanes: Vec<Lane>,
    /// Per server: (its first lane, how many).
    server_lanes: Vec<(usize, usize)>,
    server_names: Vec<String>,
    in_flight: Mutex<HashMap<u64, PartTask>>,
    dead: Vec<Mutex<Option<String>>>,
    handles: Arc<Handles>,
    stop: AtomicBool,
}

impl Shared {
    /// The lane that carries `key` to `server`.
    fn lane_of(&self, server: usize, key: u64) -> usize {
        let (first, count) = self.server_lanes[server];
        first + (key % count as u64) as usize
    }

    fn lanes_of(&self, server: usize) -> &[Lane] {
        let (first, count) = self.server_lanes[server];
        &self.lanes[first..first + count]
    }
}

pub struct Pipeline {
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
}

impl Pipeline {
    /// Starts the stage threads over each server's lanes. A server's push window of
    /// `window_bytes` (see [`crate::window`]; 0: unbounded) is split evenly over its lanes:
    /// a lane carries pieces of 1/lanes of a partition, and holds as many in flight as a
    /// single connection holds partitions. More would let workers drift further apart on
    /// that server (measured at n = 4, k = 2: 0.84 of Eq. 6 with a whole window per lane,
    /// 0.94 split).
    pub fn start(
        links: Vec<ServerLink>,
        handles: Arc<Handles>,
        window_bytes: u64,
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
            let lane_window = match window_bytes {
                0 => 0,
                w => (w / link.lanes.len() as u64).max(1),
            };
            for (tx, rx) in link.lanes {
                lanes.push(Lane {
                    server,
                    sender: Mutex::new(tx),
                    queue: StageQueue::default(),
                    window: Mutex::new(PushWindow::new(lane_window, WINDOW_STALL, Instant::now())),
                });
                receivers.push(rx);
            }
        }
        let shared = Arc::new(Shared {
            dead: names.iter().map(|_| Mutex::new(None)).collect(),
            lanes,
            server_lanes,
            server_names: names,
            in_flight: Mutex::new(HashMap::new()),
            handles,
            stop: AtomicBool::new(false),
        });
        let spawn = |name: String, f: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(name)
                .spawn(f)
                .map_err(|e| CommError::Invalid(format!("cannot start a pipeline thread: {e}")))
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
        Ok(Pipeline {
            shared,
            threads: Mutex::new(threads),
        })
    }

    /// Queues a partition for the push stage.
    pub fn enqueue(&self, task: PartTask) {
        if self.shared.stop.load(Ordering::Acquire) {
            self.shared
                .handles
                .fail(task.handle, |_| CommError::Shutdown);
            return;
        }
        if let Some(why) = self.shared.dead[task.server]
            .lock()
            .expect("dead lock")
            .clone()
        {
            let name = self.shared.server_names[task.server].clone();
            self.shared
                .handles
                .fail(task.handle, |t| lost(t, &name, &why));
            return;
        }
        let lane = self.shared.lane_of(task.server, task.key);
        self.shared.lanes[lane].queue.push(task.order(), task);
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
        for lane in &self.shared.lanes {
            lane.queue.close();
        }
        for lane in &self.shared.lanes {
            let _ = lane.sender.lock().expect("sender lock").shutdown(reason);
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
    let stranded: Vec<PartTask> = {
        let mut inf = sh.in_flight.lock().expect("in-flight lock");
        let keys: Vec<u64> = inf
            .iter()
            .filter(|(_, t)| t.server == server)
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter().filter_map(|k| inf.remove(&k)).collect()
    };
    drop(stranded);
    for lane in sh.lanes_of(server) {
        lane.queue.drain_where(|_| true);
    }
    sh.handles.fail_all(Some(server), |t| lost(t, name, why));
}

/// Sends the partitions queued for `lane`, most urgent first, as its window allows.
fn push_loop(sh: &Shared, lane: usize) {
    let mut initialised: HashSet<u64> = HashSet::new();
    let Lane {
        server,
        sender,
        queue,
        window,
    } = &sh.lanes[lane];
    let server = *server;
    while !sh.stop.load(Ordering::Acquire) {
        let wait = {
            let w = window.lock().expect("window lock");
            if w.bytes() == 0 {
                POLL
            } else {
                w.until_stall(Instant::now())
                    .clamp(Duration::from_millis(1), POLL)
            }
        };
        let popped = queue.pop_when(wait, |order, task| {
            let w = window.lock().expect("window lock");
            w.may_send(order, task.data.len as u64, Instant::now())
        });
        let Some(task) = popped else {
            continue;
        };
        // A failed operation's buffer may already be gone: drop its remaining partitions.
        if !sh.handles.begin_access(task.handle) {
            continue;
        }
        debug_assert_eq!(sh.lane_of(task.server, task.key), lane);
        let (key, round, dtype, len, handle) =
            (task.key, task.round, task.dtype, task.data.len, task.handle);
        let data = task.data;
        let order = task.order();
        window
            .lock()
            .expect("window lock")
            .sent(order, len as u64, Instant::now());
        // Registered before the frames go out: the reply may beat this thread back.
        sh.in_flight
            .lock()
            .expect("in-flight lock")
            .insert(key, task);
        let sent = {
            let mut tx = sender.lock().expect("sender lock");
            let init = if initialised.insert(key) {
                tx.init_key(key, dtype, len as u64, None)
            } else {
                Ok(())
            };
            init.and_then(|()| tx.push(key, round, dtype, data.bytes()))
                .and_then(|()| tx.pull(key, round))
        };
        sh.handles.end_access(handle, None);
        if let Err(e) = sent {
            if sh.stop.load(Ordering::Acquire) {
                break;
            }
            server_lost(sh, server, &e.to_string());
        }
    }
}

fn receive_loop(sh: &Shared, lane: usize, mut rx: ServerReceiver) {
    let server = sh.lanes[lane].server;
    loop {
        let received = match rx.recv_header() {
            Ok(Reply::Sum(head)) => receive_sum(sh, lane, &mut rx, head),
            Ok(Reply::InitAck { .. } | Reply::HeartbeatAck { .. }) => Ok(()),
            Err(ClientError::Remote {
                key: Some(key),
                code,
                message,
                ..
            }) => {
                let task = sh.in_flight.lock().expect("in-flight lock").remove(&key);
                if let Some(task) = task {
                    window_freed(sh, lane, &task);
                    let server_name = sh.server_names[server].clone();
                    sh.handles.fail(task.handle, |t| CommError::Failed {
                        tensor: t.to_string(),
                        code,
                        message: format!("{server_name}: {message}"),
                    });
                }
                Ok(())
            }
            Err(e) => Err(e.to_string()),
        };
        if let Err(why) = received {
            if !sh.stop.load(Ordering::Acquire) {
                server_lost(sh, server, &why);
            }
            debug!(server, lane, "receiver stopping");
            return;
        }
    }
}

/// A partition's sum is back (or it failed): its bytes leave `lane`'s window, which may
/// let the push thread send the next one.
fn window_freed(sh: &Shared, lane: usize, task: &PartTask) {
    let lane = &sh.lanes[lane];
    lane.window
        .lock()
        .expect("window lock")
        .finished(task.order(), Instant::now());
    lane.queue.notify();
}

/// Reads a sum straight into its partition of the caller's tensor, averages it there if
/// asked, and marks the partition done. An error is why the server must be given up.
fn receive_sum(
    sh: &Shared,
    lane: usize,
    rx: &mut ServerReceiver,
    head: SumHeader,
) -> Result<(), String> {
    let task = sh
        .in_flight
        .lock()
        .expect("in-flight lock")
        .remove(&head.key);
    let task = match task {
        Some(task) if task.round == head.round => task,
        other => {
            return Err(format!(
                "sent the sum of key {} round {} that was not asked for ({other:?})",
                head.key, head.round
            ))
        }
    };
    window_freed(sh, lane, &task);
    // A failed operation's buffer may already be gone: never write into it.
    if !sh.handles.begin_access(task.handle) {
        return rx.skip_sum().map_err(|e| e.to_string());
    }
    let dst = task.data.bytes_mut();
    let read = rx.read_sum(dst);
    if read.is_ok() {
        scale_in_place(task.dtype, dst, task.divisor);
    }
    // A partition left half-read is not done: losing the server fails its operation.
    sh.handles
        .end_access(task.handle, read.is_ok().then_some(task.key));
    read.map_err(|e| format!("sum of key {}: {e}", head.key))
}
