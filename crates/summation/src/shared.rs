//! State shared by the connections of one server: the key directory, the engines,
//! which workers are connected or gone, and the stop flag.

use std::collections::HashMap;
use std::net::Shutdown;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, RwLock};
use std::time::{Duration, Instant};

use sumflow_client::link::Link;
use sumflow_wire::gate::{Gate, MAX_HANDSHAKES};
use sumflow_wire::{ErrorCode, ErrorReply, JobToken};
use tracing::info;

use crate::accounting::Traffic;
use crate::directory::KeyDirectory;
use crate::engine::Engine;
use crate::messages::{Command, JoinAck, Replier};

/// Per-connection limits.
#[derive(Clone, Debug)]
pub struct Settings {
    pub max_body: u32,
    /// Receive buffers per connection: pushes a worker can have in flight.
    pub push_buffers: usize,
    pub handshake_timeout: Duration,
    /// A worker that does not read its replies for this long is disconnected.
    pub write_timeout: Duration,
    /// A round that keeps pulls waiting this long tells them which workers have not pushed
    /// it (and again after each further such stretch); `None`: never.
    pub stall_warning: Option<Duration>,
}

/// Connections one worker may hold at once. A worker opens several to a CPU server so that
/// TCP's per-connection fairness gives that server's traffic its share of every link (see
/// sumflow-comm's `lanes`); it asks for at most 8, and the headroom tolerates a newer worker.
pub const MAX_CONNECTIONS_PER_WORKER: u32 = 16;

#[derive(Debug, Default)]
struct Registry {
    /// Names from the cluster map, else from each worker's hello.
    names: Vec<String>,
    /// Open connections per worker rank.
    attached: Vec<u32>,
    gone: Vec<Option<String>>,
    /// Every open connection by its id, with its worker's rank.
    streams: HashMap<u64, (u32, Link)>,
    next_id: u64,
}

impl Registry {
    fn label(&self, rank: u32) -> String {
        match self.names.get(rank as usize) {
            Some(name) if !name.is_empty() => format!("worker {rank} ({name})"),
            _ => format!("worker {rank}"),
        }
    }
}

/// The job's workers as a server sees them (see [`Shared::worker_states`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WorkerStates {
    pub connected: usize,
    pub waiting: usize,
    pub gone: usize,
    pub connections: usize,
}

#[derive(Debug)]
pub struct Shared {
    pub settings: Settings,
    pub token: JobToken,
    pub workers: u32,
    pub directory: RwLock<KeyDirectory>,
    /// Each summed by one thread at a time, whichever connection brings a command.
    engines: Vec<Mutex<Engine>>,
    registry: Mutex<Registry>,
    stopping: AtomicBool,
    /// Bytes on the wire per key.
    pub traffic: Traffic,
    /// Connections still in their handshake (unauthenticated), capped on their own.
    pub handshakes: Arc<Gate>,
    /// Why the server stopped on its own because the job is gone (the coordinator lost).
    failure: Mutex<Option<String>>,
}

impl Shared {
    pub fn new(
        settings: Settings,
        token: JobToken,
        worker_names: Vec<String>,
        engines: Vec<Engine>,
        memory_limit: Option<u64>,
    ) -> Self {
        let workers = worker_names.len() as u32;
        Shared {
            settings,
            token,
            workers,
            directory: RwLock::new(KeyDirectory::new(engines.len(), memory_limit)),
            engines: engines.into_iter().map(Mutex::new).collect(),
            registry: Mutex::new(Registry {
                names: worker_names,
                attached: vec![0; workers as usize],
                gone: vec![None; workers as usize],
                streams: HashMap::new(),
                next_id: 0,
            }),
            stopping: AtomicBool::new(false),
            traffic: Traffic::default(),
            handshakes: Gate::new(MAX_HANDSHAKES),
            failure: Mutex::new(None),
        }
    }

    /// Carries out `cmd` on `engine` in the calling thread, waiting while another thread
    /// sums on it.
    pub fn engine(&self, engine: usize, cmd: Command) {
        self.lock_engine(engine).apply(cmd);
    }

    fn lock_engine(&self, engine: usize) -> MutexGuard<'_, Engine> {
        // A panic while summing is a bug that may have left a round half-updated: every
        // later command on the engine fails loudly too, ending its connections, rather
        // than summing on from a state nobody can vouch for.
        self.engines[engine].lock().expect("engine lock")
    }

    /// Tells every engine that `worker` joined (or leaves join); the last engine to apply
    /// it answers `JoinAck` on `reply`.
    pub fn join(&self, worker: u32, joined: bool, reply: Replier) {
        let ack = Arc::new(JoinAck::new(joined, self.engines.len(), reply));
        for engine in 0..self.engines.len() {
            self.engine(
                engine,
                Command::Join {
                    worker,
                    joined,
                    ack: Arc::clone(&ack),
                },
            );
        }
    }

    /// Tells the pulls of every round waiting past the stall warning who they wait for.
    pub fn check_stalls(&self) {
        let now = Instant::now();
        for engine in 0..self.engines.len() {
            self.lock_engine(engine).check_stalls(now);
        }
    }

    /// How many of the job's workers are connected, not yet connected, or gone, and the
    /// open connections (for metrics).
    pub fn worker_states(&self) -> WorkerStates {
        let r = self.registry.lock().expect("registry lock");
        let gone = r.gone.iter().filter(|g| g.is_some()).count();
        let connected = r
            .attached
            .iter()
            .zip(&r.gone)
            .filter(|(&a, g)| a > 0 && g.is_none())
            .count();
        WorkerStates {
            connected,
            waiting: r.gone.len() - gone - connected,
            gone,
            connections: r.streams.len(),
        }
    }

    /// Admits one more connection of worker `rank`; returns the connection's id, which
    /// [`track`](Self::track) and [`detach`](Self::detach) take.
    pub fn attach(&self, rank: u32, hello_name: &str) -> Result<u64, ErrorReply> {
        let mut reg = self.registry.lock().expect("registry lock");
        let r = rank as usize;
        let refuse = |code, message| ErrorReply {
            code,
            key: None,
            message,
        };
        if let Some(why) = &reg.gone[r] {
            return Err(refuse(
                ErrorCode::NodeFailed,
                format!(
                    "{} already {why}; a worker cannot rejoin a running job",
                    reg.label(rank)
                ),
            ));
        }
        if reg.attached[r] >= MAX_CONNECTIONS_PER_WORKER {
            return Err(refuse(
                ErrorCode::DuplicateNode,
                format!(
                    "{} already holds {MAX_CONNECTIONS_PER_WORKER} connections, the most \
                     one worker may",
                    reg.label(rank)
                ),
            ));
        }
        reg.attached[r] += 1;
        if reg.names[r].is_empty() {
            reg.names[r] = hello_name.to_string();
        }
        reg.next_id += 1;
        Ok(reg.next_id)
    }

    /// Keeps a handle on connection `id` of worker `rank`, for [`stop`](Self::stop) and
    /// [`detach`](Self::detach) to close it.
    pub fn track(&self, id: u64, rank: u32, stream: &Link) {
        if let Ok(clone) = stream.try_clone() {
            let mut reg = self.registry.lock().expect("registry lock");
            reg.streams.insert(id, (rank, clone));
        }
        // A stop that raced with this connection's start must still close it.
        if self.is_stopping() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    /// Connection `id` of worker `rank` ended. A graceful end (the worker said Shutdown)
    /// means the worker left only once its last connection has; until then its other
    /// connections carry on. Any other end means the worker failed, whatever its other
    /// connections do: they are closed, and every engine is told at once.
    pub fn detach(&self, id: u64, rank: u32, graceful: bool, reason: &str) {
        let last = {
            let mut reg = self.registry.lock().expect("registry lock");
            reg.streams.remove(&id);
            let open = &mut reg.attached[rank as usize];
            *open = open.saturating_sub(1);
            *open == 0
        };
        if graceful && !last {
            return;
        }
        // Recorded before the other connections close, so that this is the reason given.
        self.worker_gone(rank, reason);
        if !graceful {
            self.disconnect(rank);
        }
    }

    /// Closes every connection of worker `rank`, which failed: their threads stop at
    /// once, with any buffer a push half read holds, and a worker that was only hung
    /// finds its connections closed when it wakes, not a server that still listens.
    pub fn disconnect(&self, rank: u32) {
        let reg = self.registry.lock().expect("registry lock");
        for (r, s) in reg.streams.values() {
            if *r == rank {
                let _ = s.shutdown(Shutdown::Both);
            }
        }
    }

    /// Records that a worker left or failed and tells every engine, once.
    pub fn worker_gone(&self, rank: u32, reason: &str) {
        let text = {
            let mut reg = self.registry.lock().expect("registry lock");
            let r = rank as usize;
            if r >= reg.gone.len() || reg.gone[r].is_some() {
                return;
            }
            reg.gone[r] = Some(reason.to_string());
            format!("{} {reason}", reg.label(rank))
        };
        info!("{text}");
        let reason: Arc<str> = text.into();
        for engine in 0..self.engines.len() {
            self.engine(
                engine,
                Command::WorkerGone {
                    worker: rank,
                    reason: Arc::clone(&reason),
                },
            );
        }
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Records why the server must stop for a failure (the first reason holds).
    pub fn fail(&self, why: String) {
        self.failure
            .lock()
            .expect("failure lock")
            .get_or_insert(why);
    }

    /// Why the server stopped for a failure, if it did.
    pub fn failure(&self) -> Option<String> {
        self.failure.lock().expect("failure lock").clone()
    }

    /// Sets the stop flag and closes every worker connection.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        let reg = self.registry.lock().expect("registry lock");
        for (_, s) in reg.streams.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
