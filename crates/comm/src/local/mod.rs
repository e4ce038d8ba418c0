//! Shared memory among the workers of one machine: a tensor whose members all share this
//! machine is summed there, by the members' own threads, instead of through a summation
//! server over loopback TCP (BytePS §6.2; docs/architecture.md).
//!
//! `shm` maps files and sleeps on futexes; `area` says what lies where in them; `stage`
//! is the thread that carries out the rounds. This module starts it and checks, once per
//! job, that the workers that claim to share a machine really share its memory.

mod area;
pub mod cross;
mod shm;
mod stage;

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use crossbeam_channel::{unbounded, Sender};
use sumflow_client::coordinator::NodeFailure;
use sumflow_wire::ClusterMap;

use crate::error::CommError;
use crate::handles::Handles;
use crate::trace::Tracer;
pub use stage::{LocalOp, Waited, LOCAL_KEY, LOCAL_SERVER};

use area::{MachineArea, MAX_LOCAL};
use stage::{Command, Peers, Stage, Waiting};

/// This worker's shared-memory stage.
#[derive(Debug)]
pub struct SharedMemory {
    commands: Sender<Command>,
    machine: Arc<MachineArea>,
    thread: Mutex<Option<JoinHandle<()>>>,
    /// Ranks of the workers on this machine, ascending.
    here: Arc<[u32]>,
    workers: usize,
    local_rank: u32,
    waiting: Waiting,
}

impl SharedMemory {
    /// Opens this machine's area and registers this worker in it. Call [`verify`]
    /// once every worker has (after a barrier).
    pub fn open(
        map: &ClusterMap,
        rank: u32,
        job_key: &str,
        handles: Arc<Handles>,
        failures: crossbeam_channel::Receiver<NodeFailure>,
        tracer: Arc<Tracer>,
        link_bits: Option<u64>,
    ) -> Result<SharedMemory, CommError> {
        let me = &map.workers[rank as usize];
        let here: Vec<u32> = map
            .workers
            .iter()
            .filter(|w| w.host_id == me.host_id)
            .map(|w| w.rank)
            .collect();
        if here.len() > MAX_LOCAL {
            return Err(CommError::Invalid(format!(
                "{} workers share machine '{}': shared memory takes at most {MAX_LOCAL}; set \
                 SUMFLOW_SHARED_MEMORY=off",
                here.len(),
                me.host_id
            )));
        }
        let mut local = vec![None; map.workers.len()];
        for (l, r) in here.iter().enumerate() {
            local[*r as usize] = Some(l as u32);
        }
        let local_rank = local[rank as usize].expect("this worker is here");
        let prefix = PathBuf::from(format!(
            "{}/sumflow-{}-{:016x}",
            shm::SHM_DIR,
            sanitize(&map.job_id),
            fnv1a(&[job_key.as_bytes(), me.host_id.as_bytes()])
        ));
        let path = shm::named(&prefix, "machine");
        let machine = Arc::new(MachineArea::open(&path).map_err(|e| CommError::Io {
            what: format!(
                "shared memory for this machine's workers ({}; set \
                     SUMFLOW_SHARED_MEMORY=off to go through the summation servers instead)",
                path.display()
            ),
            source: Arc::new(e),
        })?);
        machine.register(local_rank);
        // The network legs of rounds aggregated inside the machine first end on the
        // pipeline's threads; the stage sleeps on the doorbell.
        let woken = Arc::clone(&machine);
        handles.on_crossing(Box::new(move || woken.ring()));
        let (tx, rx) = unbounded();
        let waiting = Waiting::default();
        let stage = Stage::new(
            Arc::clone(&machine),
            Peers {
                rank,
                prefix,
                local,
            },
            handles,
            failures,
            rx,
            tracer,
            Arc::clone(&waiting),
        )
        .with_crossing_window(stage::crossing_window(link_bits));
        let thread = std::thread::Builder::new()
            .name("sumflow-shm".into())
            .spawn(move || stage.run())
            .map_err(|e| CommError::Io {
                what: "starting the shared-memory stage thread".into(),
                source: Arc::new(e),
            })?;
        Ok(SharedMemory {
            commands: tx,
            machine,
            thread: Mutex::new(Some(thread)),
            here: Arc::from(here),
            workers: map.workers.len(),
            local_rank,
            waiting,
        })
    }

    /// Checks that every worker of this machine registered in the area this worker
    /// mapped, i.e. that they share its memory (after a barrier all have registered).
    /// Workers that claim one host id on different machines, or in containers without a
    /// common `/dev/shm`, get an error here rather than rounds that never complete.
    pub fn verify(&self, host_id: &str) -> Result<(), CommError> {
        let missing: Vec<u32> = self
            .here
            .iter()
            .enumerate()
            .filter(|(l, _)| self.machine.registered(*l as u32).is_none())
            .map(|(_, r)| *r)
            .collect();
        if !missing.is_empty() {
            return Err(CommError::Invalid(format!(
                "workers {missing:?} say they run on machine '{host_id}' like this worker, but \
                 do not share its memory ({}): give each machine its own host id, or set \
                 SUMFLOW_SHARED_MEMORY=off",
                shm::SHM_DIR
            )));
        }
        // Everyone has it mapped: the name is no longer needed.
        if self.local_rank == 0 {
            self.machine.unlink();
        }
        Ok(())
    }

    /// Whether every member of a tensor (`None`: every worker) is on this machine.
    pub fn covers(&self, members: Option<&[u32]>) -> bool {
        match members {
            None => self.here.len() == self.workers,
            Some(m) => m.iter().all(|r| self.here.binary_search(r).is_ok()),
        }
    }

    /// What the operation of `handle` waits for, for a timeout's message.
    pub fn waiting_for(&self, handle: u64) -> String {
        self.waiting
            .lock()
            .expect("waiting")
            .get(&handle)
            .map(|w| w.text.clone())
            .unwrap_or_else(|| "this machine's shared memory".into())
    }

    /// The tensor, round and members the operation of `handle` waits for, when it waits
    /// for members.
    pub fn stalled_on(&self, handle: u64) -> Option<Waited> {
        let waiting = self.waiting.lock().expect("waiting");
        waiting
            .get(&handle)
            .filter(|w| !w.missing.is_empty())
            .cloned()
    }

    /// Ranks of the workers on this machine.
    pub fn here(&self) -> Arc<[u32]> {
        Arc::clone(&self.here)
    }

    pub fn submit(&self, op: LocalOp) -> Result<(), CommError> {
        self.commands
            .send(Command::Run(op))
            .map_err(|_| CommError::Shutdown)?;
        self.machine.ring();
        Ok(())
    }

    pub fn retire(&self, tensor: u32) {
        let _ = self.commands.send(Command::Retire(tensor));
        self.machine.ring();
    }

    /// Marks this worker joined (Horovod's `join()`): the others' rounds go on without
    /// it. Leaving join makes every tensor pick up where the others got to.
    pub fn set_joined(&self, joined: bool) {
        if !joined {
            let _ = self.commands.send(Command::Resync);
        }
        self.machine.set_joined(self.local_rank, joined);
    }

    /// Stops the stage (failing what is still pending) and removes this job's files,
    /// the machine's area included (gone already unless the job failed to start).
    pub fn stop(&self) {
        let _ = self.commands.send(Command::Stop);
        self.machine.ring();
        if let Some(t) = self.thread.lock().expect("thread lock").take() {
            let _ = t.join();
        }
        self.machine.unlink();
    }
}

impl Drop for SharedMemory {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A job id as part of a file name.
fn sanitize(s: &str) -> String {
    s.chars()
        .take(48)
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect()
}

/// FNV-1a over the parts (with separators): the same on every worker.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for b in p.iter().chain(std::iter::once(&0xff)) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}
