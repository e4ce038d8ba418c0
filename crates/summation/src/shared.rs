//! State shared by the connections of one server: the key directory, the engines' queues,
//! which workers are connected or gone, and the stop flag.

use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::Duration;

use crossbeam_channel::Sender;
use sumflow_wire::{ErrorCode, ErrorReply, JobToken};
use tracing::info;

use crate::directory::KeyDirectory;
use crate::engine::Command;

/// Per-connection limits.
#[derive(Clone, Debug)]
pub struct Settings {
    pub max_body: u32,
    /// Receive buffers per connection: pushes a worker can have in flight.
    pub push_buffers: usize,
    pub handshake_timeout: Duration,
    /// A worker that does not read its replies for this long is disconnected.
    pub write_timeout: Duration,
}

#[derive(Default)]
struct Registry {
    /// Names from the cluster map, else from each worker's hello.
    names: Vec<String>,
    attached: Vec<bool>,
    gone: Vec<Option<String>>,
    streams: HashMap<u32, TcpStream>,
}

impl Registry {
    fn label(&self, rank: u32) -> String {
        match self.names.get(rank as usize) {
            Some(name) if !name.is_empty() => format!("worker {rank} ({name})"),
            _ => format!("worker {rank}"),
        }
    }
}

pub struct Shared {
    pub settings: Settings,
    pub token: JobToken,
    pub workers: u32,
    pub directory: RwLock<KeyDirectory>,
    engines: Vec<Sender<Command>>,
    registry: Mutex<Registry>,
    stopping: AtomicBool,
}

impl Shared {
    pub fn new(
        settings: Settings,
        token: JobToken,
        worker_names: Vec<String>,
        engines: Vec<Sender<Command>>,
        memory_limit: Option<u64>,
    ) -> Self {
        let workers = worker_names.len() as u32;
        Shared {
            settings,
            token,
            workers,
            directory: RwLock::new(KeyDirectory::new(engines.len(), memory_limit)),
            engines,
            registry: Mutex::new(Registry {
                names: worker_names,
                attached: vec![false; workers as usize],
                gone: vec![None; workers as usize],
                streams: HashMap::new(),
            }),
            stopping: AtomicBool::new(false),
        }
    }

    /// Queues a command; blocks while the engine's queue is full (back-pressure).
    pub fn engine(&self, engine: usize, cmd: Command) {
        // A send fails only once the engine stopped, i.e. the server is shutting down.
        let _ = self.engines[engine].send(cmd);
    }

    /// Sends `Stop` to every engine.
    pub fn stop_engines(&self) {
        for e in &self.engines {
            let _ = e.send(Command::Stop);
        }
    }

    pub fn attach(&self, rank: u32, hello_name: &str) -> Result<(), ErrorReply> {
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
        if reg.attached[r] {
            return Err(refuse(
                ErrorCode::DuplicateNode,
                format!("{} is already connected", reg.label(rank)),
            ));
        }
        reg.attached[r] = true;
        if reg.names[r].is_empty() {
            reg.names[r] = hello_name.to_string();
        }
        Ok(())
    }

    pub fn track(&self, rank: u32, stream: &TcpStream) {
        if let Ok(clone) = stream.try_clone() {
            let mut reg = self.registry.lock().expect("registry lock");
            reg.streams.insert(rank, clone);
        }
        // A stop that raced with this connection's start must still close it.
        if self.is_stopping() {
            let _ = stream.shutdown(Shutdown::Both);
        }
    }

    pub fn untrack(&self, rank: u32) {
        self.registry
            .lock()
            .expect("registry lock")
            .streams
            .remove(&rank);
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
            reg.attached[r] = false;
            format!("{} {reason}", reg.label(rank))
        };
        info!("{text}");
        let reason: Arc<str> = text.into();
        for e in &self.engines {
            let _ = e.send(Command::WorkerGone {
                worker: rank,
                reason: Arc::clone(&reason),
            });
        }
    }

    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Sets the stop flag and closes every worker connection.
    pub fn stop(&self) {
        self.stopping.store(true, Ordering::Release);
        let reg = self.registry.lock().expect("registry lock");
        for s in reg.streams.values() {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}
