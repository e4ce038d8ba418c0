//! Communication scheduling: which ready partitions enter the network, and when.
//!
//! The scheduler sees every partition of a worker become ready (a push_pull call: tensor,
//! priority, size, time) and every transfer finish (its sum came back), and decides which
//! partitions go out. A partition that went out is *started*: handed to its lane's FIFO
//! send queue, from which nothing overtakes it, as ByteScheduler's "underlying FIFO
//! network queue". Until then it can be overtaken by anything more urgent.
//!
//! Three decisions make a scheduler (see [`SchedulerKind`]):
//! - the *order* of a server's ready partitions: by priority (lower = nearer the input,
//!   needed first by the next forward pass; ties by key, the same on every worker), or by
//!   arrival (FIFO);
//! - the *credit* of each server: bytes pushed to it that it has not acknowledged yet,
//!   which nothing ready later can overtake (ByteScheduler §4.2, [`credit`]);
//! - *blocks*: whether some ready partitions go past the credit, in blocks Prophet sizes to
//!   the gaps of the backward pass ([`prophet`]).
//!
//! Under all of them, each server's push window ([`window`]) paces workers against each
//! other: bytes pushed whose sums have not come back.
//!
//! All of it is a pure state machine over the events and times passed in, so it is tested
//! without a network and the simulator can run the same code.

pub mod bandwidth;
pub mod credit;
pub mod prophet;
pub mod window;

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::str::FromStr;
use std::time::{Duration, Instant};

use bandwidth::BandwidthMonitor;
use credit::Credit;
use prophet::{Block, Prophet, ProphetConfig, Release, Waiting};
use window::PushWindow;

use crate::partition::Partition;

/// A partition's place in its server's sending order: lower goes first, by `priority`,
/// then by key (the same on every worker).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Order {
    /// Its push_pull's priority, or under `fifo` the push_pull's arrival number.
    pub priority: i64,
    pub key: u64,
}

/// `(priority, key)` as an order, for the tests' tables.
#[cfg(test)]
fn order(priority: i64, key: u64) -> Order {
    Order { priority, key }
}

/// The schedulers a job can run; ByteScheduler unless the job asks for another.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum SchedulerKind {
    /// Whole tensors in the order they became ready, straight into the network (no
    /// credit): the baseline of every framework.
    Fifo,
    /// P3: priority order, one partition per server in flight (stop-and-wait).
    P3,
    /// ByteScheduler Algorithm 1: priority order under a byte credit per server.
    #[default]
    ByteScheduler,
    /// Prophet: ByteScheduler, plus blocks that go past the credit during backward, sized
    /// to the predicted gaps at the measured bandwidth.
    Prophet,
}

impl SchedulerKind {
    pub const ALL: [SchedulerKind; 4] = [
        SchedulerKind::Fifo,
        SchedulerKind::P3,
        SchedulerKind::ByteScheduler,
        SchedulerKind::Prophet,
    ];

    pub fn name(self) -> &'static str {
        match self {
            SchedulerKind::Fifo => "fifo",
            SchedulerKind::P3 => "p3",
            SchedulerKind::ByteScheduler => "bytescheduler",
            SchedulerKind::Prophet => "prophet",
        }
    }

    fn by_priority(self) -> bool {
        self != SchedulerKind::Fifo
    }

    /// Whether it sends whole tensors rather than partitions of the job's partition size
    /// (see [`crate::partition::WHOLE_TENSOR_BYTES`]).
    pub fn sends_whole_tensors(self) -> bool {
        self == SchedulerKind::Fifo
    }
}

impl fmt::Display for SchedulerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for SchedulerKind {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        SchedulerKind::ALL
            .into_iter()
            .find(|k| k.name() == s.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                let names: Vec<_> = SchedulerKind::ALL.iter().map(|k| k.name()).collect();
                format!(
                    "unknown scheduler '{s}': choose one of {}",
                    names.join(", ")
                )
            })
    }
}

/// Push window per server by default, in partitions: enough to cover a sum's round trip
/// while keeping workers within a few partitions of each other (measured on the emulated
/// cluster: 0.91–0.98 of BytePS Eq. 6).
pub const DEFAULT_WINDOW_PARTITIONS: u64 = 4;

/// The push window by default where machines run several workers: each of a machine's
/// workers carries the partitions of its own servers (`crate::hierarchy`), and a window
/// of 2 let them run closer together. On the emulated cluster (n = k = 4, 250 Mbit/s),
/// 4 partitions ran at 0.90 and 0.85 of Eq. 6 with 2 and 4 workers per machine, 2 at
/// 0.95 and 0.88-0.89, 1 at 0.86 (4 workers).
pub const DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS: u64 = 2;

/// The default push window in partitions for machines of at most `workers_per_machine`.
pub fn default_window_partitions(workers_per_machine: u32) -> u64 {
    if workers_per_machine > 1 {
        DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS
    } else {
        DEFAULT_WINDOW_PARTITIONS
    }
}

/// ByteScheduler's and Prophet's credit per server by default, in partitions: one on the
/// wire and one ready to follow it.
pub const DEFAULT_CREDIT_PARTITIONS: u64 = 2;

/// How long a full push window waits without any sum coming back before it lets one more
/// partition out (only workers that disagree on the order ever need it).
pub const WINDOW_STALL: Duration = Duration::from_millis(200);

/// The knobs of a worker's scheduler.
#[derive(Clone, Debug, PartialEq)]
pub struct Schedule {
    pub kind: SchedulerKind,
    /// Unacknowledged bytes per server; 0: unbounded. FIFO has none and P3 one partition,
    /// whatever this says.
    pub credit_bytes: u64,
    /// Bytes per server whose sums have not come back; 0: unbounded.
    pub window_bytes: u64,
    pub prophet: ProphetConfig,
}

impl Schedule {
    /// `kind` with its default credit and window for `partition_bytes`.
    pub fn new(kind: SchedulerKind, partition_bytes: u64) -> Schedule {
        Schedule::for_machines(kind, partition_bytes, 1)
    }

    /// `kind` with its default credit and window for `partition_bytes`, in a job whose
    /// machines run at most `workers_per_machine` workers.
    pub fn for_machines(
        kind: SchedulerKind,
        partition_bytes: u64,
        workers_per_machine: u32,
    ) -> Schedule {
        let window = default_window_partitions(workers_per_machine);
        Schedule {
            kind,
            credit_bytes: partition_bytes.saturating_mul(DEFAULT_CREDIT_PARTITIONS),
            window_bytes: partition_bytes.saturating_mul(window),
            prophet: ProphetConfig::default(),
        }
    }

    fn effective_credit(&self, partition_bytes: u64) -> u64 {
        match self.kind {
            SchedulerKind::Fifo => 0,
            SchedulerKind::P3 => partition_bytes,
            _ => self.credit_bytes,
        }
    }
}

/// A partition that became ready; `item` is what the caller sends.
#[derive(Debug)]
pub struct Ready<T> {
    pub partition: Partition,
    /// What its push puts on the wire, which credit and window count: the partition's
    /// bytes, or fewer when its tensor is compressed.
    pub wire_bytes: u64,
    pub item: T,
}

/// A partition let out: it goes to its server's lane now, and `order` identifies it when
/// it finishes.
#[derive(Debug, PartialEq)]
pub struct Started<T> {
    pub server: usize,
    pub order: Order,
    pub item: T,
}

/// What the scheduler decided at one event, for logs and the trace.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Decision {
    /// Partitions that became ready at this event.
    pub ready: usize,
    /// Of all ready partitions, those that went past the credit at this event (Prophet's
    /// block).
    pub block: usize,
    /// Prophet's reason, when it decided.
    pub why: Option<Release>,
}

#[derive(Debug)]
struct Queued<T> {
    bytes: u64,
    /// In a block Prophet sized to a gap: the budget is its credit.
    budgeted: bool,
    item: T,
}

#[derive(Debug)]
struct ServerQueue<T> {
    /// Eligible partitions waiting for credit, in sending order.
    ready: BTreeMap<Order, Queued<T>>,
    credit: Credit,
    window: PushWindow,
}

/// A started partition until its sum is back.
#[derive(Debug)]
struct Flight {
    server: usize,
    wire_bytes: u64,
    acknowledged: bool,
}

/// A worker's scheduler over `T`, the caller's handle on a partition.
#[derive(Debug)]
pub struct Scheduler<T> {
    schedule: Schedule,
    partition_bytes: u64,
    servers: Vec<ServerQueue<T>>,
    prophet: Option<Prophet>,
    /// Bytes of Prophet's blocks not sent yet.
    block_bytes: u64,
    bandwidth: BandwidthMonitor,
    /// Started and unfinished.
    in_flight: HashMap<Order, Flight>,
    /// Bytes ready or sent that no server has acknowledged yet.
    outstanding: u64,
    /// Ready calls so far: the FIFO order.
    arrivals: i64,
}

impl<T> Scheduler<T> {
    pub fn new(schedule: Schedule, partition_bytes: u64, servers: usize, now: Instant) -> Self {
        let credit = schedule.effective_credit(partition_bytes);
        Scheduler {
            prophet: (schedule.kind == SchedulerKind::Prophet)
                .then(|| Prophet::new(schedule.prophet.clone())),
            servers: (0..servers)
                .map(|_| ServerQueue {
                    ready: BTreeMap::new(),
                    credit: Credit::new(credit),
                    window: PushWindow::new(schedule.window_bytes, WINDOW_STALL, now),
                })
                .collect(),
            schedule,
            partition_bytes,
            block_bytes: 0,
            bandwidth: BandwidthMonitor::default(),
            in_flight: HashMap::new(),
            outstanding: 0,
            arrivals: 0,
        }
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The measured rate at which servers acknowledge this worker's pushes, bytes per
    /// second of busy network.
    pub fn bandwidth(&self) -> Option<f64> {
        self.bandwidth.bytes_per_sec()
    }

    /// Prophet's current profile, if it runs and has one.
    pub fn profile(&self) -> Option<&prophet::Profile> {
        self.prophet.as_ref().and_then(|p| p.profile())
    }

    /// Changes the credit per server (auto-tuning), and the partition size P3's credit
    /// follows. Bytes in flight stay counted.
    pub fn set_credit(&mut self, credit_bytes: u64, partition_bytes: u64) {
        self.schedule.credit_bytes = credit_bytes;
        self.partition_bytes = partition_bytes;
        let credit = self.schedule.effective_credit(partition_bytes);
        for s in &mut self.servers {
            s.credit.set_limit(credit);
        }
    }

    /// Changes the push window per server (bytes already in flight stay counted).
    pub fn set_window(&mut self, window_bytes: u64) {
        self.schedule.window_bytes = window_bytes;
        for s in &mut self.servers {
            s.window.set_limit(window_bytes);
        }
    }

    /// The partitions of one push_pull of `tensor` became ready.
    pub fn ready(
        &mut self,
        tensor: u32,
        priority: i64,
        parts: Vec<Ready<T>>,
        now: Instant,
    ) -> Decision {
        let first = if self.schedule.kind.by_priority() {
            priority
        } else {
            self.arrivals
        };
        self.arrivals += 1;
        let ready = parts.len();
        let mut waiting = Vec::with_capacity(ready);
        for p in parts {
            let order = Order {
                priority: first,
                key: p.partition.key,
            };
            waiting.push(Waiting {
                order,
                wire_bytes: p.wire_bytes,
            });
            self.outstanding += p.wire_bytes;
            self.servers[p.partition.server as usize].ready.insert(
                order,
                Queued {
                    bytes: p.wire_bytes,
                    budgeted: false,
                    item: p.item,
                },
            );
        }
        let Some(prophet) = &mut self.prophet else {
            return Decision {
                ready,
                ..Decision::default()
            };
        };
        let ahead = self.servers.iter().map(|s| s.credit.bytes()).sum::<u64>() + self.block_bytes;
        let Block { orders: block, why } =
            prophet.ready(tensor, waiting, now, ahead, self.bandwidth.bytes_per_sec());
        // Prophet's blocks go out without waiting for credit: the budget, sized to the
        // gap at the measured bandwidth, is theirs (the notes: "the per-gap budget adapts
        // each stage").
        for order in &block {
            if let Some(q) = self.servers.iter_mut().find_map(|s| s.ready.get_mut(order)) {
                q.budgeted = true;
                self.block_bytes += q.bytes;
            }
        }
        Decision {
            ready,
            block: block.len(),
            why: Some(why),
        }
    }

    /// The plugin's step mark: this iteration's backward pass is over.
    pub fn mark_step(&mut self) {
        if let Some(p) = &mut self.prophet {
            p.end_iteration();
        }
    }

    /// Lets out every ready partition its server's credit allows (or that is in one of
    /// Prophet's blocks), most urgent first per server.
    pub fn poll(&mut self, now: Instant) -> Vec<Started<T>> {
        let mut out = Vec::new();
        for (server, s) in self.servers.iter_mut().enumerate() {
            while let Some(entry) = s.ready.first_entry() {
                let order = *entry.key();
                let Queued {
                    bytes, budgeted, ..
                } = *entry.get();
                let credit = budgeted || s.credit.may_send(bytes);
                if !(credit && s.window.may_send(order, bytes, now)) {
                    break;
                }
                let q = entry.remove();
                if q.budgeted {
                    self.block_bytes -= q.bytes;
                }
                if let Some(p) = &mut self.prophet {
                    p.sent(&order);
                }
                s.credit.sent(order, q.bytes);
                s.window.sent(order, q.bytes, now);
                self.bandwidth.started(now);
                self.in_flight.insert(
                    order,
                    Flight {
                        server,
                        wire_bytes: q.bytes,
                        acknowledged: false,
                    },
                );
                out.push(Started {
                    server,
                    order,
                    item: q.item,
                });
            }
        }
        out
    }

    /// When [`poll`](Self::poll) may have something new without any event: a push
    /// window's stall rule.
    pub fn next_deadline(&self, now: Instant) -> Option<Instant> {
        self.servers
            .iter()
            .filter(|s| !s.ready.is_empty() && s.window.bytes() > 0)
            .map(|s| now + s.window.until_stall(now))
            .min()
    }

    /// The server acknowledged a started partition's push: its credit returns, and the
    /// bandwidth monitor counts it (pushes complete whatever the other workers do, so the
    /// rate measured is this worker's, not the slowest one's).
    pub fn acknowledged(&mut self, order: Order, now: Instant) {
        if let Some(f) = self.in_flight.get_mut(&order) {
            if !f.acknowledged {
                f.acknowledged = true;
                self.servers[f.server].credit.acknowledged(order);
                self.bandwidth.finished(f.wire_bytes, now);
                self.outstanding -= f.wire_bytes;
            }
        }
    }

    /// A started partition's sum came back (its push was acknowledged by then).
    pub fn finished(&mut self, order: Order, now: Instant) {
        self.acknowledged(order, now);
        if let Some(f) = self.in_flight.remove(&order) {
            self.servers[f.server].window.finished(order, now);
        }
    }

    /// A started partition failed: its credit returns, and it does not count as throughput.
    pub fn abandoned(&mut self, order: Order, now: Instant) {
        if let Some(f) = self.in_flight.remove(&order) {
            self.servers[f.server].credit.acknowledged(order);
            self.servers[f.server].window.finished(order, now);
            if !f.acknowledged {
                self.bandwidth.abandoned();
                self.outstanding -= f.wire_bytes;
            }
        }
    }

    /// Removes every partition not started yet that `pred` selects (a dead server's, a
    /// failed operation's) and returns them.
    pub fn drain_where(&mut self, pred: impl Fn(usize, &T) -> bool) -> Vec<T> {
        let mut out = Vec::new();
        for (server, s) in self.servers.iter_mut().enumerate() {
            let gone: Vec<Order> = s
                .ready
                .iter()
                .filter(|(_, q)| pred(server, &q.item))
                .map(|(o, _)| *o)
                .collect();
            for o in gone {
                let q = s.ready.remove(&o).expect("listed");
                self.outstanding -= q.bytes;
                if q.budgeted {
                    self.block_bytes -= q.bytes;
                }
                if let Some(p) = &mut self.prophet {
                    p.sent(&o);
                }
                out.push(q.item);
            }
        }
        out
    }

    /// Bytes ready or sent that no server has acknowledged yet.
    pub fn outstanding(&self) -> u64 {
        self.outstanding
    }

    /// Partitions not started yet.
    pub fn waiting(&self) -> usize {
        self.servers.iter().map(|s| s.ready.len()).sum::<usize>()
    }

    /// Started partitions whose sums have not come back.
    pub fn in_flight(&self) -> usize {
        self.in_flight.len()
    }
}

#[cfg(test)]
mod tests;
