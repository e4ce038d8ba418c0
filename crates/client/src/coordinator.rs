//! A node's connection to the coordinator: join, barriers, tensor declarations,
//! heartbeats, failure notices.
//!
//! Two threads run behind a [`CoordinatorClient`]: a reader that dispatches every frame
//! the coordinator sends, and a heartbeat thread that also watches the coordinator's
//! liveness. Calls block on shared state with a timeout; nothing waits forever.
//!
//! ```no_run
//! use std::time::Duration;
//! use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
//! use sumflow_wire::{BarrierGroup, Dtype, JobToken, Registration, Role};
//!
//! let token = JobToken::load(None)?;
//! let reg = Registration {
//!     role: Role::Worker,
//!     requested_rank: None,
//!     host: "10.0.0.5".into(),
//!     port: 0,
//!     host_id: "machine-5".into(),
//!     pid: std::process::id(),
//!     link_mbit: 0, // the kernel's figure for the interface used
//!     name: "worker-on-machine-5".into(),
//! };
//! let timeout = Duration::from_secs(300);
//! let coord = CoordinatorClient::join("10.0.0.1:29400", &token, reg, timeout, CoordinatorOptions::default())?;
//! println!("I am worker {} of {}", coord.rank(), coord.cluster_map().workers.len());
//! let fc = coord.declare("fc.weight", Dtype::F32, 1024 * 1000, Duration::from_secs(60))?;
//! println!("fc.weight is tensor {fc} on every worker");
//! coord.barrier(BarrierGroup::Workers, Duration::from_secs(60))?;
//! coord.leave("training finished")?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{unbounded, Receiver, Sender};
use sumflow_wire::io::{connect, write_message, FrameReader};
use sumflow_wire::timing;
use sumflow_wire::{
    BarrierGroup, ClusterMap, Dtype, ErrorCode, ErrorReply, JobToken, Message, NodeId, Peer,
    Registration, Role, Service, WireError, DEFAULT_MAX_BODY, MAX_STRING,
};
use tracing::{debug, warn};

use crate::dial::connect_retrying;
use crate::error::{ClientError, Result};

/// The id under which loss of the coordinator itself is reported through
/// [`CoordinatorClient::failures`]: no real node has rank `u32::MAX`.
pub const COORDINATOR_NODE: NodeId = NodeId {
    role: Role::Server,
    rank: u32::MAX,
};

/// How long `leave` waits for the coordinator to acknowledge by closing the connection.
const LEAVE_WAIT: Duration = Duration::from_secs(2);

/// Timing and limits of a coordinator connection.
#[derive(Clone, Debug)]
pub struct CoordinatorOptions {
    /// How often to send a heartbeat.
    pub heartbeat_interval: Duration,
    /// A coordinator silent this long counts as lost. Keep it near the coordinator's own
    /// heartbeat timeout and several intervals long.
    pub heartbeat_timeout: Duration,
    /// How long to keep trying to reach a coordinator that is not up yet.
    pub connect_timeout: Duration,
    /// Largest frame body accepted from the coordinator.
    pub max_body: u32,
}

impl Default for CoordinatorOptions {
    fn default() -> Self {
        CoordinatorOptions {
            heartbeat_interval: timing::DEFAULT_HEARTBEAT_INTERVAL,
            heartbeat_timeout: timing::DEFAULT_HEARTBEAT_TIMEOUT,
            connect_timeout: timing::DEFAULT_CONNECT_TIMEOUT,
            max_body: DEFAULT_MAX_BODY,
        }
    }
}

/// A node the coordinator declared failed, or the coordinator itself when
/// [`is_coordinator`](Self::is_coordinator) is true.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NodeFailure {
    /// The failed node's role and rank ([`COORDINATOR_NODE`] for the coordinator).
    pub node: NodeId,
    /// Its name from the cluster map ("coordinator at ADDR" for the coordinator).
    pub name: String,
    /// Why it counts as failed, as a sentence.
    pub reason: String,
}

impl NodeFailure {
    /// Whether this notice reports the loss of the coordinator (see [`COORDINATOR_NODE`]).
    pub fn is_coordinator(&self) -> bool {
        self.node == COORDINATOR_NODE
    }
}

/// A barrier this node has entered and not yet waited for
/// ([`CoordinatorClient::enter_barrier`]).
#[must_use = "a barrier entered is waited for with await_barrier"]
#[derive(Debug)]
pub struct Barrier {
    id: u64,
    group: BarrierGroup,
}

/// A joined node's connection to its job's coordinator.
///
/// Call [`leave`](Self::leave) when done; dropping the client without it closes the
/// connection abruptly, which the coordinator reports to every other node as a failure.
#[derive(Debug)]
pub struct CoordinatorClient {
    rank: u32,
    map: ClusterMap,
    role: Role,
    conn: Connection,
}

impl CoordinatorClient {
    /// Connects to the coordinator at `addr` (retrying for `opts.connect_timeout`, as it
    /// may start after us), proves we hold `token`, registers as `reg` and waits up to
    /// `join_timeout` for the cluster map, which comes once every node has joined. A
    /// `reg.link_mbit` of 0 is filled in with the speed of the interface the connection
    /// leaves by, when the kernel knows it.
    pub fn join(
        addr: &str,
        token: &JobToken,
        mut reg: Registration,
        join_timeout: Duration,
        opts: CoordinatorOptions,
    ) -> Result<CoordinatorClient> {
        if opts.heartbeat_interval.is_zero() || opts.heartbeat_interval >= opts.heartbeat_timeout {
            return Err(ClientError::Invalid(format!(
                "heartbeat interval {:?} must be positive and shorter than the heartbeat timeout {:?}",
                opts.heartbeat_interval, opts.heartbeat_timeout
            )));
        }
        let peer = format!("coordinator at {addr}");
        let mut stream = connect_retrying(addr, "coordinator", opts.connect_timeout)?;
        let wire = |source| ClientError::Wire {
            peer: peer.clone(),
            source,
        };
        let setup = stream
            .set_nodelay(true)
            .and_then(|_| stream.set_read_timeout(Some(opts.heartbeat_timeout)))
            .and_then(|_| stream.set_write_timeout(Some(opts.heartbeat_timeout)));
        setup.map_err(|e| wire(WireError::Io(e)))?;
        let me = Peer {
            role: reg.role,
            rank: reg.requested_rank,
            name: reg.name.clone(),
        };
        connect(&mut stream, token, Service::Coordinator, &me)
            .map_err(|e| ClientError::from_wire(&peer, e))?;
        if reg.link_mbit == 0 {
            // The interface this node reaches the job by, unless the caller knew its rate.
            reg.link_mbit = stream
                .local_addr()
                .map_or(0, |local| crate::nic::link_mbit(local.ip()));
        }
        write_message(&mut stream, &Message::Register(reg.clone())).map_err(wire)?;
        // The heartbeat thread judges silence precisely; the socket timeout only ensures a
        // reader cannot block forever, so it must not fire first.
        let backstop = opts.heartbeat_timeout * 2;
        stream
            .set_read_timeout(Some(backstop))
            .map_err(|e| wire(WireError::Io(e)))?;
        let conn = Connection::start(stream, peer.clone(), &opts)?;
        let (rank, map) = conn.wait_for_map(join_timeout)?;
        debug!("joined as {} {rank} of job {}", reg.role, map.job_id);
        Ok(CoordinatorClient {
            rank,
            map,
            role: reg.role,
            conn,
        })
    }

    /// Our rank among the nodes of our role.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Every node of the job, identical on all nodes.
    pub fn cluster_map(&self) -> &ClusterMap {
        &self.map
    }

    /// Waits until every live member of `group` has entered the same barrier; returns
    /// the node that entered it last (the same on every member).
    ///
    /// Each node numbers its barriers per group, `3n` for its n-th workers barrier,
    /// `3n + 1` for its n-th all-nodes barrier and `3n + 2` for its n-th join barrier, so
    /// all nodes agree on the id as long as they enter the barriers of a group in the same
    /// order. Fails with [`ClientError::NodeFailed`] if a member has failed or fails while
    /// we wait.
    pub fn barrier(&self, group: BarrierGroup, timeout: Duration) -> Result<NodeId> {
        let entered = self.enter_barrier(group)?;
        self.await_barrier(entered, timeout)
    }

    /// Enters the next barrier of `group` without waiting for it: the coordinator
    /// records this node's arrival now (which decides the node that entered last), and
    /// [`await_barrier`](Self::await_barrier) waits for the others.
    pub fn enter_barrier(&self, group: BarrierGroup) -> Result<Barrier> {
        if group != BarrierGroup::All && self.role == Role::Server {
            return Err(ClientError::Invalid(format!(
                "a server is not a member of {} barriers; use BarrierGroup::All",
                group_name(group)
            )));
        }
        let inner = &self.conn.inner;
        let g = group_offset(group);
        let id = {
            let mut st = inner.lock();
            inner.check_barrier(&st, group)?;
            let seq = &mut st.barrier_seq[g as usize];
            *seq += 1;
            *seq * 3 + g
        };
        inner.send(&Message::Barrier { id, group })?;
        Ok(Barrier { id, group })
    }

    /// Waits until every live member has entered `barrier`; see [`barrier`](Self::barrier).
    pub fn await_barrier(&self, barrier: Barrier, timeout: Duration) -> Result<NodeId> {
        let Barrier { id, group } = barrier;
        let inner = &self.conn.inner;
        let what = format!("{} barrier {id}", group_name(group));
        let mut st = inner.lock();
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(last) = st.done.remove(&id) {
                return Ok(last);
            }
            if let Some(e) = st.barrier_errors.remove(&id) {
                return Err(ClientError::Remote {
                    peer: inner.peer.clone(),
                    code: e.code,
                    key: None,
                    message: e.message,
                });
            }
            inner.check_barrier(&st, group)?;
            st = match inner.wait_until(st, deadline) {
                Some(st) => st,
                None => {
                    return Err(ClientError::Timeout {
                        what: format!("{what} (some member has not entered it)"),
                        secs: timeout.as_secs_f64(),
                    })
                }
            };
        }
    }

    /// Declares tensor `name` with `elements` elements of `dtype` and returns its tensor
    /// id, the same on every worker of the job.
    ///
    /// The coordinator numbers tensors in the order their names first reach it from any
    /// worker, so workers may declare in any order and at any time. Call it before a
    /// tensor's first push; several threads may declare at once. Declaring a name again
    /// with the same dtype and size answers the same id without asking the coordinator.
    ///
    /// Fails with [`ClientError::Remote`] and code `KeyMismatch` once any worker has
    /// declared some tensor with another dtype or size than an earlier declaration of it
    /// (this call's tensor or another: the job cannot go on, see [`job_error`](Self::job_error)),
    /// and with [`ClientError::Timeout`] naming the tensor if no answer comes in `timeout`.
    pub fn declare(
        &self,
        name: &str,
        dtype: Dtype,
        elements: u64,
        timeout: Duration,
    ) -> Result<u32> {
        self.declare_compressed(name, dtype, elements, "", timeout)
    }

    /// Declares a tensor as [`declare`](Self::declare) does, with how it is compressed
    /// (a description for people, empty for raw elements), which every worker's
    /// declaration must then match too.
    pub fn declare_compressed(
        &self,
        name: &str,
        dtype: Dtype,
        elements: u64,
        compression: &str,
        timeout: Duration,
    ) -> Result<u32> {
        self.check_declaration(name, dtype, elements)?;
        if compression.len() > MAX_STRING {
            return Err(ClientError::Invalid(format!(
                "tensor '{name}': a compression described in {} bytes, more than the \
                 {MAX_STRING} the protocol carries",
                compression.len()
            )));
        }
        let inner = &self.conn.inner;
        let spec = Declaration {
            dtype,
            elements,
            compression: compression.to_string(),
            id: None,
            ambiguous: false,
        };
        let must_send = {
            let mut st = inner.lock();
            inner.check_declare(&st)?;
            match st.tensors.get_mut(name) {
                Some(d) if d.same_as(&spec) => match d.answer(&spec) {
                    Some(id) => return Ok(id),
                    // Another thread's identical declaration is in flight: share its answer.
                    None => false,
                },
                // We disagree with ourselves. The coordinator must still hear it, so that
                // every worker learns the job cannot go on; only its error can answer us.
                Some(d) => {
                    d.ambiguous |= d.id.is_none();
                    true
                }
                None => {
                    st.tensors.insert(name.to_string(), spec.clone());
                    true
                }
            }
        };
        if must_send {
            inner.send(&Message::Declare {
                name: name.to_string(),
                dtype,
                elements,
                compression: compression.to_string(),
            })?;
        }
        inner.wait_for_tensor_id(name, &spec, timeout)
    }

    /// Tells the coordinator that this worker will never use tensor `name` (id
    /// `tensor_id`) again, and forgets the name here: a later [`declare`](Self::declare)
    /// of it asks the coordinator anew. The coordinator removes the name once every worker
    /// that declared it has retired it, and answers a new declaration of the name by a
    /// worker that retired it only then, with a new id (ids are never reused).
    pub fn undeclare(&self, name: &str, tensor_id: u32) -> Result<()> {
        let inner = &self.conn.inner;
        {
            let mut st = inner.lock();
            inner.check_declare(&st)?;
            match st.tensors.get(name) {
                Some(d) if d.id == Some(tensor_id) => {
                    st.tensors.remove(name);
                }
                _ => {
                    return Err(ClientError::Invalid(format!(
                        "tensor '{name}' is not tensor {tensor_id} here: only a tensor this \
                         worker declared and was given that id can be retired"
                    )))
                }
            }
        }
        inner.send(&Message::Undeclare {
            name: name.to_string(),
            tensor_id,
        })
    }

    /// Refuses, before anything is sent, a declaration the coordinator could never accept.
    fn check_declaration(&self, name: &str, dtype: Dtype, elements: u64) -> Result<()> {
        let why = if self.role == Role::Server {
            format!("a server does not declare tensors (tensor '{name}'); only workers do")
        } else if name.is_empty() {
            "a tensor name must not be empty".to_string()
        } else if name.len() > MAX_STRING {
            // The wire would cut the name short, and a cut name is another tensor.
            format!(
                "tensor name '{}...' is {} bytes long, more than the {MAX_STRING} the protocol carries",
                name.chars().take(40).collect::<String>(),
                name.len()
            )
        } else if elements == 0 {
            format!("tensor '{name}' must have at least one element")
        } else if elements.checked_mul(dtype.size() as u64).is_none() {
            format!("tensor '{name}' of {elements} {dtype} elements does not fit in 2^64 bytes")
        } else {
            return Ok(());
        };
        Err(ClientError::Invalid(why))
    }

    /// The job-fatal error the coordinator announced, if any: a tensor that two workers
    /// declared differently (or a tensor table that overflowed). Once set, every
    /// [`declare`](Self::declare) and [`barrier`](Self::barrier) fails with it, and the
    /// communication service fails its pushes with it.
    pub fn job_error(&self) -> Option<ErrorReply> {
        let st = self.conn.inner.lock();
        st.job_error.clone()
    }

    /// A channel carrying every failure notice: those already received first, then new
    /// ones as they come, and a [`COORDINATOR_NODE`] notice if the coordinator is lost.
    /// Each call returns a new subscription that sees all notices.
    pub fn failures(&self) -> Receiver<NodeFailure> {
        let (tx, rx) = unbounded();
        let mut st = self.conn.inner.lock();
        for f in &st.failed {
            let _ = tx.send(f.clone());
        }
        st.subscribers.push(tx);
        rx
    }

    /// Every failure notice received so far, in order.
    pub fn failed_nodes(&self) -> Vec<NodeFailure> {
        self.conn.inner.lock().failed.clone()
    }

    /// Tells the coordinator (a summation server's word) that round `round` of `key` has
    /// waited `waited` for the workers in `missing` to push it: it logs them by name and
    /// records them as stalled for the job's supervisor. Nothing answers it.
    pub fn report_stall(
        &self,
        key: u64,
        round: u64,
        waited: Duration,
        missing: Vec<u32>,
    ) -> Result<()> {
        self.conn.inner.send(&Message::Stalled {
            key,
            round,
            waited_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
            missing,
        })
    }

    /// Whether the coordinator has told us to shut down (e.g. all workers finished).
    pub fn shutdown_requested(&self) -> bool {
        self.conn.inner.lock().shutdown.is_some()
    }

    /// Waits up to `timeout` for the coordinator to tell us to shut down; true if it did.
    pub fn wait_shutdown(&self, timeout: Duration) -> bool {
        let inner = &self.conn.inner;
        let deadline = Instant::now() + timeout;
        let st = inner.wait_while(inner.lock(), deadline, |st| st.shutdown.is_none());
        st.shutdown.is_some()
    }

    /// Leaves the job gracefully: the coordinator stops expecting us in barriers and does
    /// not report us as failed. Fails only if the coordinator was already lost. Calls after
    /// the first do nothing.
    pub fn leave(&self, reason: &str) -> Result<()> {
        let inner = self.conn.inner.clone();
        {
            let mut st = inner.lock();
            if st.shutdown.is_some() || st.closing {
                return Ok(());
            }
            if let Some(reason) = &st.lost {
                return Err(inner.lost_error(reason));
            }
            st.closing = true;
        }
        inner.changed.notify_all();
        let sent = inner.send(&Message::Shutdown {
            reason: reason.to_string(),
        });
        // The coordinator closes the connection once it has recorded the leave. If the
        // send failed, it may have closed after telling us to shut down: the reader still
        // has to get to that frame.
        let deadline = Instant::now() + LEAVE_WAIT.min(inner.timeout);
        let st = inner.wait_while(inner.lock(), deadline, |st| !st.reader_done);
        match sent {
            Err(_) if st.shutdown.is_some() => Ok(()),
            other => other,
        }
    }
}

/// The socket and the two threads behind a client; dropping it stops both.
#[derive(Debug)]
struct Connection {
    inner: Arc<Inner>,
    threads: Vec<JoinHandle<()>>,
}

impl Connection {
    fn start(stream: TcpStream, peer: String, opts: &CoordinatorOptions) -> Result<Connection> {
        let clone = || {
            stream.try_clone().map_err(|e| ClientError::Wire {
                peer: peer.clone(),
                source: WireError::Io(e),
            })
        };
        let (read_half, control) = (clone()?, clone()?);
        let inner = Arc::new(Inner {
            peer,
            timeout: opts.heartbeat_timeout,
            writer: Mutex::new(stream),
            control,
            state: Mutex::new(State::new()),
            changed: Condvar::new(),
        });
        let mut conn = Connection {
            inner: inner.clone(),
            threads: Vec::new(),
        };
        let max_body = opts.max_body;
        let (reader, beat) = (inner.clone(), inner.clone());
        let interval = opts.heartbeat_interval;
        conn.spawn("coord-client-read", move || {
            reader.read_loop(FrameReader::new(read_half, max_body));
        })?;
        conn.spawn("coord-client-beat", move || beat.heartbeat_loop(interval))?;
        Ok(conn)
    }

    fn spawn(&mut self, name: &str, f: impl FnOnce() + Send + 'static) -> Result<()> {
        let t = thread::Builder::new()
            .name(name.into())
            .spawn(f)
            .map_err(|e| ClientError::Connect {
                service: "coordinator",
                addr: self.inner.peer.clone(),
                source: e,
            })?;
        self.threads.push(t);
        Ok(())
    }

    fn wait_for_map(&self, timeout: Duration) -> Result<(u32, ClusterMap)> {
        let inner = &self.inner;
        let deadline = Instant::now() + timeout;
        let mut st = inner.lock();
        loop {
            if let Some(map) = st.map.take() {
                return Ok(map);
            }
            if let Some(e) = st.refusal.take() {
                return Err(ClientError::Remote {
                    peer: inner.peer.clone(),
                    code: e.code,
                    key: e.key,
                    message: e.message,
                });
            }
            if let Some(reason) = &st.lost {
                return Err(inner.lost_error(reason));
            }
            if let Some(reason) = &st.shutdown {
                return Err(inner.shutting_down(reason));
            }
            st = inner.wait_until(st, deadline).ok_or_else(|| ClientError::Timeout {
                what: format!(
                    "the cluster map from the {} (it comes once every worker and server has joined)",
                    inner.peer
                ),
                secs: timeout.as_secs_f64(),
            })?;
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.inner.lock().closing = true;
        self.inner.changed.notify_all();
        self.inner.shutdown_socket();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[derive(Debug)]
struct Inner {
    /// "coordinator at ADDR", for messages.
    peer: String,
    timeout: Duration,
    writer: Mutex<TcpStream>,
    /// Shuts the socket down without waiting for a writer stuck in a send.
    control: TcpStream,
    state: Mutex<State>,
    changed: Condvar,
}

/// One tensor as this node first declared it, and its id once the coordinator has answered.
#[derive(Clone, Debug)]
struct Declaration {
    dtype: Dtype,
    elements: u64,
    compression: String,
    id: Option<u32>,
    /// A different declaration of the same name went out before the answer came. An answer
    /// does not say which declaration it is for, so none is trusted: the coordinator's
    /// mismatch error, certain to follow, settles every waiter.
    ambiguous: bool,
}

impl Declaration {
    fn same_as(&self, other: &Declaration) -> bool {
        self.dtype == other.dtype
            && self.elements == other.elements
            && self.compression == other.compression
    }

    /// The tensor id, if the coordinator has answered a declaration like `spec` with it.
    fn answer(&self, spec: &Declaration) -> Option<u32> {
        self.id.filter(|_| self.same_as(spec) && !self.ambiguous)
    }
}

#[derive(Debug)]
struct State {
    map: Option<(u32, ClusterMap)>,
    map_seen: bool,
    /// Barriers released but not yet collected by their caller, with the node that
    /// entered each last.
    done: HashMap<u64, NodeId>,
    barrier_errors: HashMap<u64, ErrorReply>,
    /// An error not tied to a barrier; before the map it refuses our registration.
    refusal: Option<ErrorReply>,
    /// Tensors by name, as first declared here; replies are matched to them by name.
    tensors: HashMap<String, Declaration>,
    /// The coordinator's job-fatal declaration error; it fails declarations and barriers.
    job_error: Option<ErrorReply>,
    failed: Vec<NodeFailure>,
    subscribers: Vec<Sender<NodeFailure>>,
    shutdown: Option<String>,
    lost: Option<String>,
    /// `leave` or drop is under way: the connection ending is expected.
    closing: bool,
    reader_done: bool,
    last_heard: Instant,
    barrier_seq: [u64; 3],
}

impl State {
    fn new() -> State {
        State {
            map: None,
            map_seen: false,
            done: HashMap::new(),
            barrier_errors: HashMap::new(),
            refusal: None,
            tensors: HashMap::new(),
            job_error: None,
            failed: Vec::new(),
            subscribers: Vec::new(),
            shutdown: None,
            lost: None,
            closing: false,
            reader_done: false,
            last_heard: Instant::now(),
            barrier_seq: [0; 3],
        }
    }

    fn record_failure(&mut self, f: NodeFailure) {
        self.subscribers.retain(|s| s.send(f.clone()).is_ok());
        self.failed.push(f);
    }

    /// The connection stopped working while we still needed it.
    fn lose(&mut self, peer: &str, reason: String) {
        if self.lost.is_some() || self.closing || self.shutdown.is_some() {
            return;
        }
        warn!("lost the {peer}: {reason}");
        self.lost = Some(reason.clone());
        self.record_failure(NodeFailure {
            node: COORDINATOR_NODE,
            name: peer.to_string(),
            reason,
        });
    }
}

impl Inner {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Waits for a change until `deadline`; `None` once it has passed.
    fn wait_until<'a>(
        &self,
        st: MutexGuard<'a, State>,
        deadline: Instant,
    ) -> Option<MutexGuard<'a, State>> {
        let left = deadline.checked_duration_since(Instant::now())?;
        let (st, _) = self
            .changed
            .wait_timeout(st, left)
            .unwrap_or_else(|e| e.into_inner());
        Some(st)
    }

    /// Waits while `pending` holds, until `deadline` at the latest.
    fn wait_while<'a>(
        &self,
        mut st: MutexGuard<'a, State>,
        deadline: Instant,
        pending: impl Fn(&State) -> bool,
    ) -> MutexGuard<'a, State> {
        while pending(&st) {
            match deadline.checked_duration_since(Instant::now()) {
                Some(left) => {
                    st = self
                        .changed
                        .wait_timeout(st, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0;
                }
                None => break,
            }
        }
        st
    }

    fn send(&self, msg: &Message) -> Result<()> {
        let mut w = self.writer.lock().unwrap_or_else(|e| e.into_inner());
        write_message(&mut *w, msg).map_err(|e| {
            let mut st = self.lock();
            st.lose(&self.peer, format!("cannot send a {} frame: {e}", msg.op()));
            self.changed.notify_all();
            match &st.lost {
                Some(reason) => self.lost_error(reason),
                None => ClientError::Wire {
                    peer: self.peer.clone(),
                    source: e,
                },
            }
        })
    }

    fn shutdown_socket(&self) {
        let _ = self.control.shutdown(Shutdown::Both);
    }

    fn lost_error(&self, reason: &str) -> ClientError {
        ClientError::PeerLost {
            peer: self.peer.clone(),
            reason: reason.to_string(),
        }
    }

    fn shutting_down(&self, reason: &str) -> ClientError {
        ClientError::Remote {
            peer: self.peer.clone(),
            code: ErrorCode::ShuttingDown,
            key: None,
            message: format!("the job is shutting down: {reason}"),
        }
    }

    /// The job-fatal error as the caller's error: a refusal by the coordinator.
    fn job_failed(&self, e: &ErrorReply) -> ClientError {
        ClientError::Remote {
            peer: self.peer.clone(),
            code: e.code,
            key: None,
            message: e.message.clone(),
        }
    }

    /// Why no declaration can be answered now, if none can.
    fn check_declare(&self, st: &State) -> Result<()> {
        if let Some(e) = &st.job_error {
            return Err(self.job_failed(e));
        }
        if let Some(reason) = &st.lost {
            return Err(self.lost_error(reason));
        }
        if let Some(reason) = &st.shutdown {
            return Err(self.shutting_down(reason));
        }
        Ok(())
    }

    /// Waits until the coordinator has given tensor `name`, as declared in `spec`, its id.
    fn wait_for_tensor_id(&self, name: &str, spec: &Declaration, timeout: Duration) -> Result<u32> {
        let deadline = Instant::now() + timeout;
        let mut st = self.lock();
        loop {
            // The job error comes first: it may have been caused by this very declaration.
            self.check_declare(&st)?;
            if let Some(id) = st.tensors.get(name).and_then(|d| d.answer(spec)) {
                return Ok(id);
            }
            st = self
                .wait_until(st, deadline)
                .ok_or_else(|| ClientError::Timeout {
                    what: format!(
                        "the {} to assign an id to tensor '{name}' ({} x {})",
                        self.peer, spec.dtype, spec.elements
                    ),
                    secs: timeout.as_secs_f64(),
                })?;
        }
    }

    /// Records the coordinator's answer to one of our declarations.
    fn tensor_declared(&self, st: &mut State, name: String, tensor_id: u32) {
        match st.tensors.get_mut(&name) {
            Some(Declaration { id: id @ None, .. }) => *id = Some(tensor_id),
            Some(Declaration {
                id: Some(first), ..
            }) if *first != tensor_id => warn!(
                "the {} gave tensor '{name}' id {tensor_id} after id {first}; keeping the first",
                self.peer
            ),
            Some(_) => {}
            None => warn!(
                "the {} assigned id {tensor_id} to tensor '{name}', which we never declared",
                self.peer
            ),
        }
    }

    /// Why a barrier of `group` cannot complete now, if it cannot.
    fn check_barrier(&self, st: &State, group: BarrierGroup) -> Result<()> {
        if let Some(e) = &st.job_error {
            return Err(self.job_failed(e));
        }
        if let Some(reason) = &st.lost {
            return Err(self.lost_error(reason));
        }
        if let Some(reason) = &st.shutdown {
            return Err(self.shutting_down(reason));
        }
        let member = |f: &&NodeFailure| {
            !f.is_coordinator() && (group == BarrierGroup::All || f.node.role == Role::Worker)
        };
        match st.failed.iter().find(member) {
            Some(f) => Err(ClientError::NodeFailed {
                node: f.node,
                name: f.name.clone(),
                reason: f.reason.clone(),
            }),
            None => Ok(()),
        }
    }

    fn read_loop(&self, mut reader: FrameReader<TcpStream>) {
        loop {
            let result = reader.read();
            let mut st = self.lock();
            match result {
                Ok(frame) if frame.payload_len == 0 => {
                    st.last_heard = Instant::now();
                    if !self.dispatch(&mut st, frame.message) {
                        self.stop_reading(st);
                        return;
                    }
                }
                Ok(frame) => {
                    let why = format!("sent a {} frame with a payload", frame.message.op());
                    st.lose(&self.peer, why);
                    self.stop_reading(st);
                    return;
                }
                Err(e) => {
                    let why = match (&e, &st.refusal) {
                        (_, Some(r)) => {
                            format!("it closed the connection after: {}: {}", r.code, r.message)
                        }
                        (WireError::Closed, None) => "it closed the connection".to_string(),
                        (WireError::Timeout { .. }, None) => {
                            format!(
                                "nothing received for {:.2}s",
                                2.0 * self.timeout.as_secs_f64()
                            )
                        }
                        _ => e.to_string(),
                    };
                    st.lose(&self.peer, why);
                    self.stop_reading(st);
                    return;
                }
            }
            drop(st);
            self.changed.notify_all();
        }
    }

    fn stop_reading(&self, mut st: MutexGuard<'_, State>) {
        st.reader_done = true;
        drop(st);
        self.changed.notify_all();
        self.shutdown_socket();
    }

    /// Applies one frame to the state; false when the coordinator broke the protocol.
    fn dispatch(&self, st: &mut State, msg: Message) -> bool {
        match msg {
            Message::HeartbeatAck { .. } => {}
            Message::ClusterMap { your_rank, map } if !st.map_seen => {
                st.map_seen = true;
                st.map = Some((your_rank, map));
            }
            Message::BarrierDone { id, last } => {
                st.done.insert(id, last);
            }
            Message::Declared { name, tensor_id } => self.tensor_declared(st, name, tensor_id),
            Message::NodeFailed { node, name, reason } => {
                warn!("{node} '{name}' failed: {reason}");
                st.record_failure(NodeFailure { node, name, reason });
            }
            Message::Shutdown { reason } => {
                debug!("the {} asks us to shut down: {reason}", self.peer);
                st.shutdown = Some(reason);
            }
            Message::Error(e) => match e.key {
                Some(id) => {
                    st.barrier_errors.insert(id, e);
                }
                // Sent to every worker at once and to any later declaration: the first
                // one is the news, the rest repeat it.
                None if st.map_seen && is_job_fatal(e.code) => {
                    if st.job_error.is_none() {
                        warn!(
                            "the {} reports that the job cannot go on: {}",
                            self.peer, e.message
                        );
                        st.job_error = Some(e);
                    }
                }
                None => {
                    warn!("the {} reports: {}: {}", self.peer, e.code, e.message);
                    st.refusal = Some(e);
                }
            },
            other => {
                let why = format!("it sent an unexpected {} frame", other.op());
                st.lose(&self.peer, why);
                return false;
            }
        }
        true
    }

    /// Sends heartbeats and declares the coordinator lost once it has been silent too long.
    fn heartbeat_loop(&self, interval: Duration) {
        let mut seq = 0u64;
        loop {
            {
                let mut st = self.lock();
                if st.closing || st.lost.is_some() || st.shutdown.is_some() {
                    return;
                }
                let silent = st.last_heard.elapsed();
                if silent > self.timeout {
                    let why = format!(
                        "no reply for {:.2}s (timeout {:.2}s)",
                        silent.as_secs_f64(),
                        self.timeout.as_secs_f64()
                    );
                    st.lose(&self.peer, why);
                    drop(st);
                    self.changed.notify_all();
                    self.shutdown_socket();
                    return;
                }
            }
            seq += 1;
            if self.send(&Message::Heartbeat { seq }).is_err() {
                return;
            }
            let deadline = Instant::now() + interval;
            drop(self.wait_while(self.lock(), deadline, |st| !st.closing));
        }
    }
}

/// Errors without a key that the coordinator sends, after the map, only when the job's
/// workers can no longer agree on their tensors.
fn is_job_fatal(code: ErrorCode) -> bool {
    matches!(code, ErrorCode::KeyMismatch | ErrorCode::ResourceExhausted)
}

fn group_name(group: BarrierGroup) -> &'static str {
    match group {
        BarrierGroup::Workers => "workers",
        BarrierGroup::All => "all-nodes",
        BarrierGroup::Join => "join",
    }
}

/// A group's place in the barrier ids (`3n + offset`) and in `State::barrier_seq`.
fn group_offset(group: BarrierGroup) -> u64 {
    match group {
        BarrierGroup::Workers => 0,
        BarrierGroup::All => 1,
        BarrierGroup::Join => 2,
    }
}
