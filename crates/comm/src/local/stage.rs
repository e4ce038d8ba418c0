//! The shared-memory stage: one thread per worker that carries out the rounds of the
//! tensors whose members all share this machine, in the machine's shared memory.
//!
//! A round of a tensor with G members: each member copies its tensor into its slot and
//! publishes the round (or publishes a skip); once every member has (a member that has
//! joined and not pushed counts as skipping), either
//! - **two phases**, when all G pushed and every one takes back the whole result (an
//!   allreduce): member m reduces the m-th slice of the slots into the result, publishes
//!   it, and once all slices are there copies the whole result into its tensor. Each byte
//!   is read G + 1 times across the machine, whatever G;
//! - **direct**, otherwise (a relay, a reduce-scatter share, a joined member): each member
//!   reduces the ranges it takes straight from the contributors' slots into its tensor.
//!
//! A member then publishes that it consumed the round; a slot is written again only once
//! every member that took part in its last round has consumed it. Rounds of different
//! tensors progress independently, in any order across members, so no order of
//! operations can deadlock: the thread sleeps on the machine's doorbell (a futex every
//! change rings) and advances whatever it can.

use std::collections::HashMap;
use std::ops::Range;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crossbeam_channel::{Receiver, TryRecvError};
use sumflow_client::coordinator::NodeFailure;
use sumflow_reduce::Reducer;
use sumflow_wire::{Dtype, ErrorCode, ReduceOp as WireOp, Role};

use super::area::{MachineArea, PushFlags, TensorArea};
use super::shm;
use crate::average::scale_in_place;
use crate::error::CommError;
use crate::handles::Handles;
use crate::pipeline::HostSlice;
use crate::trace::{Arg, Tracer, Track};
use sumflow_plan::hierarchy;
use sumflow_plan::partition::Partition;

/// The handles' key and server of a shared-memory operation (its one "partition").
pub const LOCAL_KEY: u64 = u64::MAX;
pub const LOCAL_SERVER: u32 = u32::MAX;

/// How long the stage sleeps at most before checking for failures again.
const POLL: Duration = Duration::from_millis(100);
/// Bytes a pass copies in before it looks again at the rounds already in (see
/// [`Stage::run`]): one 8 MB tensor, or a few dozen of ResNet-50's small ones, whose
/// pass per tensor cost the one-machine benchmark 8-10% (a scan of every round and a ring
/// of the doorbell each).
const COPY_IN_BATCH: usize = 4 << 20;
/// Bytes of rounds aggregated across machines that a worker copies in ahead of its own
/// reduces (see [`Stage::run`]).
const CROSSING_AHEAD: usize = 4 << 20;
/// The least the crossing window (see [`Stage::run`]) holds, and how long the slowest
/// worker's link takes to carry it where that is more. Measured on the emulated cluster
/// (4 machines of 4 workers, 250 Mbit/s, ResNet-50's gradients): 16 MiB 0.89-0.90 of
/// BytePS Eq. 6, 8 MiB 0.82-0.84 (the window then slowed the links), no window
/// 0.83-0.85 (every worker copying its whole gradient in at the round's start).
const CROSSING_WINDOW_MIN: usize = 16 << 20;
const CROSSING_LEAD: Duration = Duration::from_millis(500);
/// How long copy-ins held back by the crossing window (see [`Stage::run`]) wait without
/// any of this worker's rounds coming back from the summation servers before they go in
/// anyway: only machines that issue their tensors in different orders ever need it.
const CROSSING_STALL: Duration = Duration::from_secs(1);
/// How long a failed slice's push and pull may take to let go of the result.
const ABANDON_WAIT: Duration = Duration::from_secs(1);

/// Bytes of a worker's rounds across machines that may be on their way at once (copied
/// in, not back from the summation servers), for links of `link_bits` a second (the
/// slowest worker's; `None`: unknown).
pub fn crossing_window(link_bits: Option<u64>) -> usize {
    let lead = link_bits.map_or(0.0, |b| b as f64 / 8.0 * CROSSING_LEAD.as_secs_f64());
    (lead as usize).max(CROSSING_WINDOW_MIN)
}

/// One operation on a tensor all of whose members share this machine.
#[derive(Debug)]
pub struct LocalOp {
    pub handle: u64,
    pub tensor: u32,
    pub name: Arc<str>,
    pub data: HostSlice,
    pub dtype: Dtype,
    /// The members' ranks, ascending; this worker is one of them.
    pub members: Arc<[u32]>,
    pub op: WireOp,
    pub divisor: Option<u32>,
    /// Whether this worker contributes its tensor this round (else it skips it).
    pub contributes: bool,
    /// Byte ranges it takes back; `None`: all.
    pub pulls: Option<Vec<Range<u64>>>,
    /// For a tensor whose members span machines: this worker's part in carrying the
    /// machine's sum across them (`None`: every member is on this machine).
    pub cross: Option<Cross>,
}

/// This worker's part in a round aggregated inside the machine first
/// (`sumflow_plan::hierarchy`): of the machine's members that take part, the i-th
/// reduces the machine's sum of the i-th run of the tensor's partitions, then pushes it to
/// the summation servers and pulls back the sum over every machine into the round's
/// result (`local::cross`).
pub struct Cross {
    /// The tensor's partitions in the layout of the round.
    pub parts: Vec<Partition>,
    /// Starts the push and pull of its [`Leg`] from the result (the whole tensor's span
    /// in the shared memory); returns the handle to poll.
    pub send: SendLeg,
}

/// What one member carries of a round across machines.
#[derive(Debug)]
pub struct Leg {
    /// The partitions (indices, ascending) it pushes and pulls: its run.
    pub run: Vec<usize>,
    /// Whether any member of the machine contributed (else its pushes are skips).
    pub pushes: bool,
    /// The machine's other members taking part in the round, ascending: its pushes stand
    /// for theirs, so that they send nothing for the run's keys (`Message::Skips`).
    pub skips: Arc<[u32]>,
}

/// Starts a round's network leg (see [`Cross::send`]).
pub type SendLeg = Box<dyn FnOnce(HostSlice, Leg) -> Result<u64, CommError> + Send>;

impl std::fmt::Debug for Cross {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cross")
            .field("parts", &self.parts.len())
            .finish_non_exhaustive()
    }
}

pub enum Command {
    Run(LocalOp),
    /// The tensor is retired: unmap its area.
    Retire(u32),
    /// This worker left `join`: every tensor picks up at the round the others reached.
    Resync,
    Stop,
}

/// This worker's place: its rank, the local ranks of the job's workers, and where the
/// job's files are on this machine.
#[derive(Debug)]
pub struct Peers {
    pub rank: u32,
    /// Path prefix of this job's files on this machine.
    pub prefix: PathBuf,
    /// Local rank of each worker on this machine, by rank; `None` elsewhere.
    pub local: Vec<Option<u32>>,
}

#[derive(Debug)]
enum Phase {
    Enter,
    Pushed,
    /// Its slice is on its way to and from the summation servers.
    Crossing,
    Reduced,
}

struct Pending {
    op: LocalOp,
    round: u64,
    phase: Phase,
    issued: Instant,
    /// "two phases" or "direct", once known.
    mode: &'static str,
    /// The members it last waited for, by rank, as published in `Waiting`.
    waited: Vec<u32>,
    /// The handle of its slice's push and pull, while it crosses, and since when.
    net: Option<u64>,
    crossed: Instant,
    /// Whether its round is aggregated across machines (`LocalOp::cross`, which the
    /// round takes when its slice leaves).
    crosses: bool,
    /// What its copy-in waits for, while it is held back.
    held: Option<Hold>,
    /// The phase whose wait `waited` was last recorded in.
    noted: Option<std::mem::Discriminant<Phase>>,
}

/// What each blocked operation waits for, by handle, for timeout messages and stall
/// reports.
pub type Waiting = Arc<Mutex<HashMap<u64, Waited>>>;

/// What a blocked operation waits for.
#[derive(Clone, Debug)]
pub struct Waited {
    pub tensor: u32,
    pub round: u64,
    /// The members it waits for, by rank.
    pub missing: Vec<u32>,
    /// All of it in words: "this machine's shared memory, waiting for workers [1] to
    /// push round 3".
    pub text: String,
}

struct Area {
    area: TensorArea,
    me: usize,
    round: u64,
    resync: bool,
    slot_reserved: bool,
    result_reserved: bool,
}

impl Area {
    /// The round this worker's next copy-in will be, as `enter` numbers it: a tensor new
    /// here, or after `join`, picks up at the round the machine completed.
    fn next_round(&self) -> u64 {
        if self.resync {
            self.area.completed() + 1
        } else {
            self.round + 1
        }
    }
}

/// Why a copy-in of a round across machines is held back (see [`Stage::run`]).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Hold {
    /// This worker's earlier rounds wait for the machine's other workers to copy in.
    Reduces,
    /// This worker's earlier rounds fill the crossing window.
    Window,
}

enum Step {
    Blocked,
    Moved,
    Done,
}

pub struct Stage {
    machine: Arc<MachineArea>,
    peers: Peers,
    handles: Arc<Handles>,
    failures: Receiver<NodeFailure>,
    commands: Receiver<Command>,
    tracer: Arc<Tracer>,
    waiting: Waiting,
    reducer: Reducer,
    areas: HashMap<u32, Area>,
    /// Workers the coordinator reported failed, with why.
    failed: HashMap<u32, String>,
    /// Bytes of this worker's rounds across machines that may be on their way at once,
    /// copied in and not back from the summation servers (see [`Stage::run`]).
    window: usize,
    /// While the window holds a copy-in back: since when, or since one of this worker's
    /// rounds last came back from the servers, whichever is later.
    held_since: Option<Instant>,
    /// `Handles::crossings_ended` when the rounds crossing machines were last polled, and
    /// when they were last polled whatever it said.
    crossings_seen: u64,
    crossings_polled: Instant,
}

impl Stage {
    pub fn new(
        machine: Arc<MachineArea>,
        peers: Peers,
        handles: Arc<Handles>,
        failures: Receiver<NodeFailure>,
        commands: Receiver<Command>,
        tracer: Arc<Tracer>,
        waiting: Waiting,
    ) -> Stage {
        Stage {
            machine,
            peers,
            handles,
            failures,
            commands,
            tracer,
            waiting,
            reducer: Reducer::detect(),
            areas: HashMap::new(),
            failed: HashMap::new(),
            window: crossing_window(None),
            held_since: None,
            crossings_seen: 0,
            crossings_polled: Instant::now(),
        }
    }

    /// Sets the crossing window (see [`crossing_window`]).
    pub fn with_crossing_window(mut self, bytes: usize) -> Stage {
        self.window = bytes;
        self
    }

    pub fn area_path(prefix: &std::path::Path, tensor: u32) -> PathBuf {
        shm::named(prefix, &format!("t{tensor}"))
    }

    /// The thread's body: until `Stop`, advance every operation it can, then sleep on the
    /// doorbell.
    pub fn run(mut self) {
        let mut pending: Vec<Pending> = Vec::new();
        loop {
            let seen = self
                .machine
                .doorbell()
                .load(std::sync::atomic::Ordering::Acquire);
            loop {
                match self.commands.try_recv() {
                    Ok(Command::Run(op)) => {
                        if let Some(p) = self.begin(op) {
                            pending.push(p);
                        }
                    }
                    Ok(Command::Retire(t)) => self.retire(t),
                    Ok(Command::Resync) => self.areas.values_mut().for_each(|a| a.resync = true),
                    Ok(Command::Stop) | Err(TryRecvError::Disconnected) => {
                        return self.stop(pending)
                    }
                    Err(TryRecvError::Empty) => break,
                }
            }
            let mut failure = false;
            while let Ok(f) = self.failures.try_recv() {
                failure = true;
                if f.node.role == Role::Worker {
                    self.failed
                        .insert(f.node.rank, format!("{} failed: {}", f.name, f.reason));
                }
            }
            // First the rounds past their copy-in: a reduce, a crossing or a copy out
            // unblocks the other members and starts pushes. Then copy-ins, oldest first,
            // up to COPY_IN_BATCH bytes, and the pass starts over: copying every tensor in
            // before reducing any held a round's first push back until the machine's
            // slowest member had copied its whole gradient (40-110 ms a round at G = 4 on
            // the emulated cluster's 2 cores), and the others, asleep, heard of none of it
            // until the ring at the pass's end.
            // A round crossing machines changes only when its network leg ends (the
            // count tells) or a member fails: most of a step's rounds wait there, and
            // polling each on every ring of the machine's doorbell cost more than the
            // copies at 4 workers per machine. They are polled anyway every POLL.
            let ended = self.handles.crossings_ended();
            let poll_crossings =
                ended != self.crossings_seen || failure || self.crossings_polled.elapsed() >= POLL;
            if poll_crossings {
                (self.crossings_seen, self.crossings_polled) = (ended, Instant::now());
            }
            let mut moved = false;
            let mut i = 0;
            while i < pending.len() {
                let crossing = matches!(pending[i].phase, Phase::Crossing);
                if matches!(pending[i].phase, Phase::Enter) || (crossing && !poll_crossings) {
                    i += 1;
                    continue;
                }
                let (went, left) = self.drive(&mut pending, i);
                if crossing && went {
                    // Back from the servers: whatever the window holds has not stalled.
                    if let Some(since) = self.held_since.as_mut() {
                        *since = Instant::now();
                    }
                }
                moved |= went;
                i += usize::from(!left);
            }
            // A round that crosses machines is copied in only while this worker's
            // earlier ones wait for less than CROSSING_AHEAD bytes of reduce and less
            // than the window's bytes of them are on their way (copied in, not back from
            // the servers), or once a member of the machine has pushed it. The network
            // paces those rounds: copying a whole gradient in at once (G workers per
            // machine at a round's start) took the cores from the first reduces and
            // sums, which every machine waits for, and its copies bought nothing the
            // links could carry yet. A member that pushed is never kept waiting by this,
            // so no order of issue across a machine's members can deadlock; machines
            // that issue in different orders can hold each other's rounds back through
            // the window, which lets everything in once CROSSING_STALL passes without
            // any round coming back.
            let (mut ahead, mut on_way) = crossing_bytes(&pending);
            let open = self
                .held_since
                .is_some_and(|since| since.elapsed() >= CROSSING_STALL);
            let mut window_held = false;
            let (mut i, mut copied) = (0, 0);
            while i < pending.len() && copied < COPY_IN_BATCH {
                if !matches!(pending[i].phase, Phase::Enter) {
                    i += 1;
                    continue;
                }
                let hold = if !pending[i].crosses {
                    None
                } else if ahead >= CROSSING_AHEAD {
                    Some(Hold::Reduces)
                } else if on_way >= self.window && !open {
                    Some(Hold::Window)
                } else {
                    None
                };
                let hold = hold.filter(|_| !self.demanded(&pending[i].op));
                window_held |= hold == Some(Hold::Window);
                self.note_held(&mut pending[i], hold);
                if hold.is_some() {
                    i += 1;
                    continue;
                }
                let bytes = pending[i].op.data.len;
                let (went, left) = self.drive(&mut pending, i);
                if went {
                    moved = true;
                    copied += bytes;
                    // Only this round moved: it adds to what waits for reduce if it
                    // stopped there, and to what is on its way unless it is back.
                    if !left && pending[i].crosses {
                        match pending[i].phase {
                            Phase::Pushed => (ahead, on_way) = (ahead + bytes, on_way + bytes),
                            Phase::Crossing => on_way += bytes,
                            Phase::Enter | Phase::Reduced => {}
                        }
                    }
                }
                i += usize::from(!left);
            }
            // Once open, the window stays open until a round comes back.
            self.held_since = match (open, window_held) {
                (true, _) => self.held_since,
                (false, true) => self.held_since.or_else(|| Some(Instant::now())),
                (false, false) => None,
            };
            // One ring for everything this pass published: each wakes every stage of
            // the machine.
            if moved {
                self.machine.ring();
            } else {
                shm::wait(self.machine.doorbell(), seen, POLL);
            }
        }
    }

    /// Whether another member of the machine has pushed the round this worker would
    /// copy `op` into next (it then waits for this worker).
    fn demanded(&mut self, op: &LocalOp) -> bool {
        let Ok(a) = self.area(op) else {
            // The copy-in reports the error.
            return true;
        };
        let round = a.next_round();
        (0..op.members.len()).any(|k| k != a.me && a.area.pushed(k) >= round)
    }

    /// Says what a held-back copy-in waits for (for timeout messages), and forgets it once
    /// it is not held back.
    fn note_held(&self, p: &mut Pending, held: Option<Hold>) {
        if p.held == held {
            return;
        }
        p.held = held;
        // Whatever it waits for next is recorded afresh.
        p.noted = None;
        let mut waiting = self.waiting.lock().expect("waiting");
        let Some(hold) = held else {
            waiting.remove(&p.op.handle);
            return;
        };
        let text = match hold {
            Hold::Reduces => "this machine's shared memory: its copy-in waits behind this \
                              worker's earlier rounds across machines, which wait for the \
                              machine's other workers"
                .to_string(),
            Hold::Window => format!(
                "this machine's shared memory: its copy-in waits for this worker's earlier \
                 rounds across machines ({} MiB on their way, at most) to come back from the \
                 summation servers",
                self.window >> 20
            ),
        };
        let waited = Waited {
            tensor: p.op.tensor,
            round: self.areas.get(&p.op.tensor).map_or(1, Area::next_round),
            missing: Vec::new(),
            text,
        };
        waiting.insert(p.op.handle, waited);
    }

    /// Advances `pending[i]` as far as it goes: whether it moved, and whether it left
    /// `pending` (done or failed; the rest keep their order, oldest first).
    fn drive(&mut self, pending: &mut Vec<Pending>, i: usize) -> (bool, bool) {
        let mut moved = false;
        loop {
            match self.advance(&mut pending[i]) {
                Ok(Step::Blocked) => {
                    self.note_waiting(&mut pending[i]);
                    return (moved, false);
                }
                Ok(Step::Moved) => moved = true,
                Ok(Step::Done) => {
                    let p = pending.remove(i);
                    self.waiting.lock().expect("waiting").remove(&p.op.handle);
                    return (true, true);
                }
                Err(e) => {
                    let p = pending.remove(i);
                    self.waiting.lock().expect("waiting").remove(&p.op.handle);
                    self.abandon_crossing(&p, &e);
                    self.handles.fail(p.op.handle, |_| e);
                    return (moved, true);
                }
            }
        }
    }

    /// Records which members a blocked operation waits for, when that or its phase
    /// changed: it runs on every pass for every blocked operation (161 of them a step for
    /// ResNet-50), so the text is formatted only then (formatting it each time showed in
    /// perf at 4 workers per machine).
    fn note_waiting(&self, p: &mut Pending) {
        let Some(a) = self.areas.get(&p.op.tensor) else {
            return;
        };
        let round = p.round;
        // Whether member k is one the round waits for.
        let missing = |k: usize| match p.phase {
            Phase::Enter => a.area.consumed(k) < a.area.pushed(k).min(a.round),
            Phase::Pushed => a.area.pushed(k) < round && !self.joined(p.op.members[k]),
            Phase::Crossing => false,
            Phase::Reduced => a.area.pushed(k) >= round && a.area.reduced(k) < round,
        };
        let members = || {
            (0..p.op.members.len())
                .filter(|&k| missing(k))
                .map(|k| p.op.members[k])
        };
        let phase = std::mem::discriminant(&p.phase);
        // Compared without collecting: this runs for every blocked round on every pass.
        if p.noted == Some(phase) && members().eq(p.waited.iter().copied()) {
            return;
        }
        let missing: Vec<u32> = members().collect();
        let text = match p.phase {
            Phase::Enter => format!(
                "this machine's shared memory, waiting for workers {missing:?} to finish \
                 round {} of it",
                a.round
            ),
            Phase::Pushed => format!(
                "this machine's shared memory, waiting for workers {missing:?} to push round \
                 {round}"
            ),
            Phase::Crossing => format!(
                "this machine's shared memory, waiting for the summation servers' sum of its \
                 slice of round {round} over every machine"
            ),
            Phase::Reduced => format!(
                "this machine's shared memory, waiting for workers {missing:?} to reduce \
                 their slices of round {round}"
            ),
        };
        let waited = Waited {
            tensor: p.op.tensor,
            round,
            text,
            missing: missing.clone(),
        };
        self.waiting
            .lock()
            .expect("waiting")
            .insert(p.op.handle, waited);
        p.waited = missing;
        p.noted = Some(phase);
    }

    fn stop(&mut self, pending: Vec<Pending>) {
        for p in pending {
            self.abandon_crossing(&p, &CommError::Shutdown);
            self.handles.fail(p.op.handle, |_| CommError::Shutdown);
        }
        for (_, a) in self.areas.drain() {
            a.area.unlink();
        }
    }

    /// A failed round's slice still crossing: fails it (the pipeline then no longer
    /// writes into the result), releases its handle, and tells the machine's other
    /// members, which would otherwise wait for the slice.
    fn abandon_crossing(&self, p: &Pending, why: &CommError) {
        let Some(net) = p.net else {
            return;
        };
        self.handles.fail(net, |_| why.clone());
        let _ = self.handles.wait(net, ABANDON_WAIT, |_| String::new());
        if let Some(a) = self.areas.get(&p.op.tensor) {
            a.area.publish_failed(a.me, p.round);
            self.machine.ring();
        }
    }

    fn retire(&mut self, tensor: u32) {
        match self.areas.remove(&tensor) {
            Some(a) => a.area.unlink(),
            None => shm::unlink(&Self::area_path(&self.peers.prefix, tensor)),
        }
    }

    /// Starts an operation: a tensor of one member completes at once.
    fn begin(&mut self, op: LocalOp) -> Option<Pending> {
        if op.members.len() == 1 {
            if !op.contributes && self.handles.begin_access(op.handle) {
                // A lone skipped round sums nothing: zeros, as the servers give.
                for r in pulled(&op) {
                    op.data.bytes_mut()[r].fill(0);
                }
                self.handles.end_access(op.handle, Some(LOCAL_KEY));
            } else if self.handles.begin_access(op.handle) {
                self.handles.end_access(op.handle, Some(LOCAL_KEY));
            }
            return None;
        }
        Some(Pending {
            round: 0,
            phase: Phase::Enter,
            issued: Instant::now(),
            mode: "",
            waited: Vec::new(),
            net: None,
            crossed: Instant::now(),
            crosses: op.cross.is_some(),
            held: None,
            noted: None,
            op,
        })
    }

    fn fail_text(&self, op: &LocalOp, what: String) -> CommError {
        CommError::Failed {
            tensor: op.name.to_string(),
            code: ErrorCode::NodeFailed,
            message: what,
        }
    }

    /// Fails the operation if a member failed or the machine's shared memory broke.
    fn check_peers(&self, op: &LocalOp) -> Result<(), CommError> {
        if let Some(l) = self.machine.broken_by() {
            return Err(self.fail_text(
                op,
                format!(
                    "local worker {l} of this machine could not allocate shared memory in {} \
                     (full? enlarge it, e.g. docker --shm-size, or set \
                     SUMFLOW_SHARED_MEMORY=off)",
                    shm::SHM_DIR
                ),
            ));
        }
        for m in op.members.iter() {
            if let Some(why) = self.failed.get(m) {
                return Err(self.fail_text(op, format!("member worker {m}: {why}")));
            }
        }
        Ok(())
    }

    fn area(&mut self, op: &LocalOp) -> Result<&mut Area, CommError> {
        if !self.areas.contains_key(&op.tensor) {
            let path = Self::area_path(&self.peers.prefix, op.tensor);
            let area = TensorArea::open(&path, op.members.len(), op.data.len)
                .map_err(|e| self.io_error(op, &path, e))?;
            if area.attach() {
                area.unlink();
            }
            let me = op
                .members
                .binary_search(&self.peers.rank)
                .expect("the service checked membership");
            self.areas.insert(
                op.tensor,
                Area {
                    area,
                    me,
                    round: 0,
                    resync: true,
                    slot_reserved: false,
                    result_reserved: false,
                },
            );
        }
        Ok(self.areas.get_mut(&op.tensor).expect("inserted"))
    }

    fn io_error(&self, op: &LocalOp, path: &std::path::Path, e: std::io::Error) -> CommError {
        if let Some(l) = self.peers.local[self.peers.rank as usize] {
            self.machine.break_down(l);
        }
        CommError::Io {
            what: format!(
                "tensor '{}': shared memory {} ({} bytes per member; set \
                 SUMFLOW_SHARED_MEMORY=off to go through the summation servers instead)",
                op.name,
                path.display(),
                op.data.len
            ),
            source: Arc::new(e),
        }
    }

    fn joined(&self, rank: u32) -> bool {
        self.peers.local[rank as usize].is_some_and(|l| self.machine.joined(l))
    }

    fn advance(&mut self, p: &mut Pending) -> Result<Step, CommError> {
        match p.phase {
            Phase::Enter => self.enter(p),
            Phase::Pushed => self.pushed(p),
            Phase::Crossing => self.crossing(p),
            Phase::Reduced => self.reduced(p),
        }
    }

    /// Copies this worker's tensor into its slot once every member is done with the
    /// slot's last round, and publishes the push.
    fn enter(&mut self, p: &mut Pending) -> Result<Step, CommError> {
        self.check_peers(&p.op)?;
        let handles = Arc::clone(&self.handles);
        let a = self.area(&p.op)?;
        if a.resync {
            a.round = a.area.completed();
            a.area.resync(a.me, a.round);
            a.resync = false;
        }
        let round = a.round + 1;
        let free = (0..p.op.members.len())
            .all(|k| k == a.me || a.area.consumed(k) >= a.area.pushed(k).min(round - 1));
        if !free {
            return Ok(Step::Blocked);
        }
        let offset = a.area.slot_offset(a.me);
        let len = p.op.data.len;
        let mut contributes = p.op.contributes;
        if contributes && !a.slot_reserved {
            if let Err(e) = a.area.reserve(offset, len) {
                let path = Self::area_path(&self.peers.prefix, p.op.tensor);
                return Err(self.io_error(&p.op, &path, e));
            }
            a.slot_reserved = true;
        }
        let began = Instant::now();
        if contributes {
            if handles.begin_access(p.op.handle) {
                // SAFETY: the slot is this member's alone until it publishes the push, and
                // no member reads it (every one consumed its last round, checked above);
                // the caller's span is valid while access is held.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        p.op.data.bytes().as_ptr(),
                        a.area.at(offset),
                        len,
                    );
                }
                handles.end_access(p.op.handle, None);
            } else {
                // The operation failed meanwhile: take part without the buffer, so the
                // others' round still completes.
                contributes = false;
            }
        }
        let pulls_all = p.op.pulls.is_none();
        a.area.publish_push(
            a.me,
            round,
            PushFlags {
                contributes,
                pulls_all,
            },
        );
        a.round = round;
        p.round = round;
        p.phase = Phase::Pushed;
        if contributes {
            self.tracer
                .span(Track::SharedMemory, "copy in", began, Instant::now(), &[]);
        }
        Ok(Step::Moved)
    }

    /// Once every member pushed (or joined without pushing), reduces: this worker's
    /// slice for two phases, its ranges for a direct round.
    fn pushed(&mut self, p: &mut Pending) -> Result<Step, CommError> {
        let members = Arc::clone(&p.op.members);
        let a = &self.areas[&p.op.tensor];
        let round = p.round;
        let arrived =
            (0..members.len()).all(|k| a.area.pushed(k) >= round || self.joined(members[k]));
        if !arrived {
            self.check_peers(&p.op)?;
            return Ok(Step::Blocked);
        }
        let took_part: Vec<usize> = (0..members.len())
            .filter(|&k| a.area.pushed(k) == round)
            .collect();
        // The members taking part share the runs (a joined member's goes to the others).
        let run = p.op.cross.as_ref().map(|c| {
            let i = took_part
                .iter()
                .position(|&k| k == a.me)
                .expect("took part");
            hierarchy::runs(&c.parts, took_part.len()).swap_remove(i)
        });
        let others: Arc<[u32]> = match &p.op.cross {
            Some(_) => took_part
                .iter()
                .filter(|&&k| k != a.me)
                .map(|&k| members[k])
                .collect(),
            None => Arc::from([]),
        };
        // Across machines, every member's slice must cross whatever it takes back.
        let two_phase = p.op.cross.is_some()
            || (took_part.len() == members.len()
                && took_part.iter().all(|&k| a.area.flags(k).pulls_all));
        let sources: Vec<usize> = took_part
            .into_iter()
            .filter(|&k| a.area.flags(k).contributes)
            .collect();
        if !two_phase {
            p.mode = "direct";
            self.take(&p.op, &sources, None);
            return Ok(self.consume(p));
        }
        p.mode = "two phases";
        let began = Instant::now();
        let ranges = match (&p.op.cross, &run) {
            (Some(cross), Some(run)) => hierarchy::byte_ranges(&cross.parts, run),
            _ => {
                let es = p.op.dtype.size();
                let slice = slice_of(p.op.data.len / es, members.len(), a.me);
                std::iter::once(slice.start * es..slice.end * es).collect()
            }
        };
        let result = a.area.slot_offset(members.len());
        let a = self.areas.get_mut(&p.op.tensor).expect("area");
        if !a.result_reserved {
            if let Err(e) = a.area.reserve(result, p.op.data.len) {
                let path = Self::area_path(&self.peers.prefix, p.op.tensor);
                return Err(self.io_error(&p.op, &path, e));
            }
            a.result_reserved = true;
        }
        let a = &self.areas[&p.op.tensor];
        for bytes in ranges.into_iter().filter(|r| !r.is_empty()) {
            // SAFETY: the result's ranges of member m (its slice, or its run's partitions)
            // are written by member m alone in this phase (no one reads the result before
            // every member has published its part); the slots are read only, their members
            // published them and write them again only after this member consumes the
            // round.
            let out = unsafe {
                std::slice::from_raw_parts_mut(a.area.at(result + bytes.start), bytes.len())
            };
            let srcs = slot_views(&a.area, &sources, bytes);
            reduce(self.reducer, p.op.dtype, p.op.op, &srcs, out);
        }
        self.tracer.span(
            Track::SharedMemory,
            "reduce slice",
            began,
            Instant::now(),
            &[("sources", Arg::Uint(sources.len() as u64))],
        );
        // A member whose run is empty (fewer partitions than members) sends nothing: the
        // others' pushes stand for it.
        if let (Some(cross), Some(run)) = (p.op.cross.take(), run.filter(|r| !r.is_empty())) {
            // SAFETY: the result region lies inside the mapping, which stays mapped while
            // the tensor has an operation (it is unmapped at retirement, refused while one
            // is in flight); the network leg writes only this member's slice of it.
            let result = unsafe { HostSlice::new(a.area.at(result), p.op.data.len) }
                .expect("a mapping is never at address 0");
            let leg = Leg {
                run,
                pushes: !sources.is_empty(),
                skips: others,
            };
            match (cross.send)(result, leg) {
                Ok(net) => {
                    p.net = Some(net);
                    p.crossed = Instant::now();
                    p.phase = Phase::Crossing;
                    return Ok(Step::Moved);
                }
                Err(e) => {
                    a.area.publish_failed(a.me, round);
                    return Err(e);
                }
            }
        }
        a.area.publish_reduced(a.me, round);
        p.phase = Phase::Reduced;
        Ok(Step::Moved)
    }

    /// Once this worker's slice is back from the summation servers (summed over every
    /// machine), publishes it as reduced.
    fn crossing(&mut self, p: &mut Pending) -> Result<Step, CommError> {
        let net = p.net.expect("a crossing round has its network leg");
        match self.handles.poll(net) {
            Ok(false) => {
                self.check_peers(&p.op)?;
                Ok(Step::Blocked)
            }
            Ok(true) => {
                // Done: this releases the handle once the receiver has let go of it (at
                // once, but it may still be returning). A timeout here must not become
                // the operation's error: its waiter would take it for its own.
                match self.handles.wait(net, ABANDON_WAIT, |_| String::new()) {
                    Ok(()) => p.net = None,
                    Err(CommError::Timeout { .. }) => {
                        let why = format!(
                            "its slice of round {} came back, but its buffer stayed in use",
                            p.round
                        );
                        return Err(self.fail_text(&p.op, why));
                    }
                    Err(e) => {
                        p.net = None;
                        return Err(e);
                    }
                }
                let a = &self.areas[&p.op.tensor];
                a.area.publish_reduced(a.me, p.round);
                self.tracer.span(
                    Track::SharedMemory,
                    "cross machines",
                    p.crossed,
                    Instant::now(),
                    &[],
                );
                p.phase = Phase::Reduced;
                Ok(Step::Moved)
            }
            Err(e) => Err(e),
        }
    }

    /// Once every slice is reduced, copies the result into the caller's tensor.
    fn reduced(&mut self, p: &mut Pending) -> Result<Step, CommError> {
        let a = &self.areas[&p.op.tensor];
        let n = p.op.members.len();
        if let Some(k) = (0..n).find(|&k| k != a.me && a.area.failed(k) >= p.round) {
            let why = format!(
                "worker {} of this machine could not bring back its slice of round {} from \
                 the summation servers (its own error says why)",
                p.op.members[k], p.round
            );
            return Err(self.fail_text(&p.op, why));
        }
        // A joined member that did not push this round reduces nothing of it.
        let took_part = |k: usize| a.area.pushed(k) >= p.round;
        if !(0..n).all(|k| !took_part(k) || a.area.reduced(k) >= p.round) {
            self.check_peers(&p.op)?;
            return Ok(Step::Blocked);
        }
        let result = a.area.slot_offset(n);
        self.take(&p.op, &[], Some(result));
        Ok(self.consume(p))
    }

    fn consume(&mut self, p: &Pending) -> Step {
        let a = &self.areas[&p.op.tensor];
        a.area.publish_consumed(a.me, p.round);
        self.tracer.span(
            Track::SharedMemory,
            p.op.name.to_string(),
            p.issued,
            Instant::now(),
            &[
                ("round", Arg::Uint(p.round)),
                ("mode", Arg::Str(p.mode)),
                ("bytes", Arg::Uint(p.op.data.len as u64)),
                ("members", Arg::Uint(p.op.members.len() as u64)),
            ],
        );
        Step::Done
    }

    /// Writes the round's result into the caller's ranges: copied from the result region
    /// (`Some(offset)`), or reduced from the `sources`' slots; then averages, and
    /// completes the operation's handle.
    fn take(&self, op: &LocalOp, sources: &[usize], result: Option<usize>) {
        if !self.handles.begin_access(op.handle) {
            return;
        }
        let began = Instant::now();
        let a = &self.areas[&op.tensor];
        let buf = op.data.bytes_mut();
        for r in pulled(op) {
            match result {
                Some(offset) => {
                    // SAFETY: the result is complete (every slice published) and is not
                    // written again before this member consumes the round.
                    let src =
                        unsafe { std::slice::from_raw_parts(a.area.at(offset + r.start), r.len()) };
                    buf[r].copy_from_slice(src);
                }
                None if sources.is_empty() => buf[r].fill(0),
                None => {
                    let srcs = slot_views(&a.area, sources, r.clone());
                    reduce(self.reducer, op.dtype, op.op, &srcs, &mut buf[r]);
                }
            }
        }
        for r in pulled(op) {
            scale_in_place(op.dtype, &mut buf[r], op.divisor);
        }
        self.handles.end_access(op.handle, Some(LOCAL_KEY));
        self.tracer
            .span(Track::SharedMemory, "take", began, Instant::now(), &[]);
    }
}

/// Bytes of this worker's rounds across machines copied in and not yet reduced, and
/// copied in and not yet back from the summation servers.
fn crossing_bytes(pending: &[Pending]) -> (usize, usize) {
    pending
        .iter()
        .filter(|p| p.crosses)
        .fold((0, 0), |(ahead, on_way), p| match p.phase {
            Phase::Pushed => (ahead + p.op.data.len, on_way + p.op.data.len),
            Phase::Crossing => (ahead, on_way + p.op.data.len),
            Phase::Enter | Phase::Reduced => (ahead, on_way),
        })
}

/// `out` = the sources reduced by `op`; zeros without sources (a round every member
/// skipped, as the servers give), and a lone source's bytes as they are (the kernels
/// copy a lone term unchanged too, but memcpy is the faster copy).
fn reduce(reducer: Reducer, dtype: Dtype, op: WireOp, srcs: &[&[u8]], out: &mut [u8]) {
    match srcs {
        [] => out.fill(0),
        [only] => out.copy_from_slice(only),
        _ => reducer.reduce_into(dtype, op, None, srcs, out),
    }
}

/// The `range` of each source member's slot.
fn slot_views<'a>(area: &'a TensorArea, sources: &[usize], range: Range<usize>) -> Vec<&'a [u8]> {
    sources
        .iter()
        .map(|&k| {
            // SAFETY: member k published its slot for this round and writes it again only
            // after every member consumed the round; the range lies inside the slot.
            unsafe {
                std::slice::from_raw_parts(area.at(area.slot_offset(k) + range.start), range.len())
            }
        })
        .collect()
}

/// The element range member `m` of `g` reduces in two phases: equal slices of whole
/// 64-element blocks (cache lines for every dtype), the last ones possibly short or empty.
pub fn slice_of(elements: usize, g: usize, m: usize) -> Range<usize> {
    let per = elements.div_ceil(g).next_multiple_of(64);
    (m * per).min(elements)..((m + 1) * per).min(elements)
}

/// The byte ranges this operation takes, widened to whole elements, sorted and merged
/// (an average must divide each byte once).
fn pulled(op: &LocalOp) -> Vec<Range<usize>> {
    let len = op.data.len;
    let Some(ranges) = &op.pulls else {
        return std::iter::once(0..len).collect();
    };
    let es = op.dtype.size();
    let mut rs: Vec<Range<usize>> = ranges
        .iter()
        .map(|r| (r.start as usize / es * es)..(r.end as usize).next_multiple_of(es).min(len))
        .collect();
    rs.sort_by_key(|r| r.start);
    let mut merged: Vec<Range<usize>> = Vec::with_capacity(rs.len());
    for r in rs {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    merged
}

#[cfg(test)]
mod tests {
    use super::{crossing_window, slice_of};

    #[test]
    fn slices_cover_every_element_once() {
        for n in [0, 1, 63, 64, 65, 1000, 4097] {
            for g in 1..=9 {
                let mut next = 0;
                for m in 0..g {
                    let s = slice_of(n, g, m);
                    assert_eq!(s.start, next.min(n), "n={n} g={g} m={m}");
                    next = s.end;
                }
                assert_eq!(next, n, "n={n} g={g}");
            }
        }
    }

    #[test]
    fn the_crossing_window_covers_half_a_second_of_the_link_and_16_mib_at_least() {
        assert_eq!(crossing_window(None), 16 << 20);
        assert_eq!(crossing_window(Some(250_000_000)), 16 << 20);
        assert_eq!(crossing_window(Some(1_000_000_000)), 62_500_000);
        assert_eq!(crossing_window(Some(100_000_000_000)), 6_250_000_000);
    }
}
