//! Declaring tensors: checking a declaration, agreeing on it with the other workers
//! through the coordinator, cutting it into partitions placed on the servers (BytePS
//! Eq. 1 and 2, `sumflow_plan::layout`), re-cutting every tensor when the partition size
//! changes, and retiring tensors.

use std::collections::HashMap;
use std::sync::Arc;

use sumflow_plan::layout::{Layout, MAX_GENERATIONS, MAX_TENSOR_ID};
use sumflow_plan::partition::{derived_partition_bytes, DerivedSize, Partition, TensorSpec};
use sumflow_plan::scheduler::Schedule;
use sumflow_wire::Dtype;
use tracing::info;

use super::{CommunicationService, Scheduling};
use crate::compression::Compression;
use crate::error::CommError;

/// A declared tensor: its partitions and where each goes.
#[derive(Debug)]
pub(super) struct Tensor {
    pub(super) id: u32,
    pub(super) name: Arc<str>,
    pub(super) dtype: Dtype,
    pub(super) elements: u64,
    /// How its partitions travel; `None`: raw elements.
    pub(super) compression: Option<Compression>,
    /// The workers that sum it, ascending; `None`: every worker.
    pub(super) members: Option<Arc<[u32]>>,
    /// The worker on whose machine its partitions are kept, if any (see `Declaration`).
    pub(super) home: Option<u32>,
    /// Its shape as declared, if one was.
    pub(super) shape: Option<Arc<[u64]>>,
    /// The group it was declared and placed with, if any.
    pub(super) group: Option<usize>,
    /// Its partitions, each with its server, in the tensor's order.
    pub(super) parts: Vec<Partition>,
    /// The last round pushed, per layout generation: each generation's keys count their
    /// own rounds on the servers.
    pub(super) rounds: Vec<u64>,
    /// Partitions of earlier layouts (partition sizes) it was pushed under: their keys
    /// live on the servers too, until retired.
    pub(super) earlier: Vec<Partition>,
}

impl Tensor {
    /// Counts a push under layout `generation` and returns its round (each generation's
    /// keys count their own rounds on the servers).
    pub(super) fn next_round(&mut self, generation: usize) -> u64 {
        if self.rounds.len() <= generation {
            self.rounds.resize(generation + 1, 0);
        }
        self.rounds[generation] += 1;
        self.rounds[generation]
    }

    fn new(decl: &Declaration<'_>, id: u32, group: Option<usize>, parts: Vec<Partition>) -> Tensor {
        Tensor {
            id,
            name: Arc::from(decl.name),
            dtype: decl.dtype,
            elements: decl.elements,
            compression: decl.compression,
            members: decl.members.map(Arc::from),
            home: decl.home,
            shape: decl.shape.map(Arc::from),
            group,
            parts,
            rounds: Vec::new(),
            earlier: Vec::new(),
        }
    }

    fn declaration(&self) -> Declaration<'_> {
        Declaration {
            name: &self.name,
            dtype: self.dtype,
            elements: self.elements,
            compression: self.compression,
            members: self.members.as_deref(),
            home: self.home,
            shape: self.shape.as_deref(),
        }
    }

    /// Refuses a declaration of the same tensor with another compression or other members.
    fn check_same(&self, decl: &Declaration<'_>) -> Result<(), CommError> {
        if self.compression != decl.compression {
            let show = |c: Option<Compression>| c.map_or("uncompressed".into(), |c| c.to_string());
            return Err(CommError::Invalid(format!(
                "tensor '{}' was declared {} and now {}: a tensor keeps the compression it \
                 was first declared with",
                self.name,
                show(self.compression),
                show(decl.compression)
            )));
        }
        if self.members.as_deref() != decl.members {
            return Err(CommError::Invalid(format!(
                "tensor '{}' was declared {} and now {}: a tensor keeps the members it was \
                 first declared with",
                self.name,
                members_text(self.members.as_deref()),
                members_text(decl.members)
            )));
        }
        Ok(())
    }
}

/// A tensor's members, for messages: "for workers [0, 2]", or "for every worker".
fn members_text(members: Option<&[u32]>) -> String {
    match members {
        Some(m) => format!("for workers {m:?}"),
        None => "for every worker".into(),
    }
}

/// A tensor to declare: its name, element type and count, how it is compressed, and which
/// workers sum it.
#[derive(Clone, Copy, Debug)]
pub struct Declaration<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub elements: u64,
    /// `None` sends raw elements; compressors take f32 tensors only.
    pub compression: Option<Compression>,
    /// The workers whose tensors are summed (a Horovod process set): distinct ranks of the
    /// job in ascending order, every one of which must declare the tensor the same way and
    /// push it every time; the others must not push it. `None`: every worker. Uncompressed
    /// tensors only.
    pub members: Option<&'a [u32]>,
    /// The worker that takes the tensor's bytes, when one does (a relay region): every
    /// partition is then kept by the summation server on that worker's machine, so the bytes
    /// cross one link instead of two. Without a colocated server there, or with `None`, the
    /// partitions are placed from their keys as usual.
    pub home: Option<u32>,
    /// Its shape (the product of which is `elements`), which every worker's declaration
    /// must then match too, as Horovod checks: tensors of one size but other shapes
    /// ([32, 32] and [16, 64]) would otherwise be summed element by element, silently.
    /// `None`: a flat buffer, checked by size alone.
    pub shape: Option<&'a [u64]>,
}

impl<'a> Declaration<'a> {
    /// An uncompressed tensor.
    pub fn raw(name: &'a str, dtype: Dtype, elements: u64) -> Declaration<'a> {
        Declaration {
            name,
            dtype,
            elements,
            compression: None,
            members: None,
            home: None,
            shape: None,
        }
    }

    /// What partitioning needs to know of it.
    fn spec(self) -> TensorSpec<'a> {
        TensorSpec {
            name: self.name,
            elements: self.elements,
            dtype: self.dtype,
        }
    }

    /// Checks what can be checked before asking the coordinator, in a job of `workers`.
    fn check(&self, workers: u32) -> Result<(), CommError> {
        let invalid =
            |why: String| Err(CommError::Invalid(format!("tensor '{}' {why}", self.name)));
        if let Some(home) = self.home.filter(|&w| w >= workers) {
            return invalid(format!(
                "is to be kept on worker {home}'s machine, but this job has workers \
                 0..{workers}"
            ));
        }
        if let Some(shape) = self.shape {
            let product = shape.iter().try_fold(1u64, |acc, d| acc.checked_mul(*d));
            if product != Some(self.elements) {
                return invalid(format!(
                    "is declared with {} elements but shape {shape:?}",
                    self.elements
                ));
            }
        }
        if let (Some(c), dtype) = (self.compression, self.dtype) {
            if dtype != Dtype::F32 {
                return invalid(format!(
                    "holds {dtype}: {c} compresses f32 tensors only (cast it, or leave it \
                     uncompressed)"
                ));
            }
        }
        let Some(members) = self.members else {
            return Ok(());
        };
        if let Some(c) = self.compression {
            // Servers re-encode compressed sums for every worker alike; process sets sum
            // raw tensors.
            return invalid(format!(
                "is compressed by {c}: a tensor of some workers only must be uncompressed"
            ));
        }
        if members.is_empty() {
            return invalid("has an empty member list: name at least one worker".into());
        }
        for pair in members.windows(2) {
            if pair[0] == pair[1] {
                return invalid(format!("lists worker {} twice among its members", pair[0]));
            }
            if pair[0] > pair[1] {
                return invalid(format!(
                    "lists its members {members:?} out of order: ranks must be ascending"
                ));
            }
        }
        match members.iter().find(|&&r| r >= workers) {
            Some(rank) => invalid(format!(
                "names worker {rank} among its members, but this job has workers 0..{workers}"
            )),
            None => Ok(()),
        }
    }

    /// Its shape and how it travels, for people and for the coordinator, which compares it
    /// as text across workers like dtype and size: "shaped [32, 32]", "compressed by topk
    /// (ratio 0.01) with error feedback", "summed over workers [0, 2]" (never both of the
    /// last two: see `check`), or empty for a flat raw tensor of every worker.
    fn travel(&self) -> String {
        let how = match (self.compression, self.members) {
            (Some(c), _) => format!("compressed by {c}"),
            (None, Some(m)) => format!("summed over workers {m:?}"),
            (None, None) => String::new(),
        };
        let how = match self.home {
            None => how,
            Some(w) if how.is_empty() => format!("kept on worker {w}'s machine"),
            Some(w) => format!("{how}, kept on worker {w}'s machine"),
        };
        match self.shape {
            None => how,
            Some(shape) if how.is_empty() => format!("shaped {shape:?}"),
            Some(shape) => format!("shaped {shape:?}, {how}"),
        }
    }
}

/// The declared tensors and how they are laid out.
#[derive(Debug)]
pub(super) struct Table {
    pub(super) tensors: HashMap<u32, Tensor>,
    /// Tensor ids of each declared group, in declaration order.
    pub(super) groups: Vec<Vec<u32>>,
    /// Every partition size used so far (`None`: derived per declaration); a layout's
    /// generation is its index here, so going back to a size reuses its keys (and the
    /// servers' memory for them).
    pub(super) layouts: Vec<Option<u64>>,
    pub(super) generation: usize,
    /// The partition size the scheduler's default credit and push window are counted in:
    /// the set size, or the derived size of the last group declared.
    pub(super) reference: u64,
    /// Why the last group got its derived size.
    pub(super) reason: Option<String>,
}

impl Table {
    fn partition_bytes(&self) -> Option<u64> {
        self.layouts[self.generation]
    }
}

/// The bytes of a tensor's elements.
fn spec_bytes(spec: &TensorSpec<'_>) -> u64 {
    spec.elements.saturating_mul(spec.dtype.size() as u64)
}
impl CommunicationService {
    /// Declares one uncompressed tensor; every worker must declare it with the same dtype
    /// and size. Returns its id. Its partitions are placed from their keys alone, so
    /// workers may declare tensors in any order.
    pub fn declare(&self, name: &str, dtype: Dtype, elements: u64) -> Result<u32, CommError> {
        self.declare_one(&Declaration::raw(name, dtype, elements))
    }

    /// Declares one tensor, compressed or not (see [`Self::declare`]); every worker must
    /// declare it with the same compression too.
    pub fn declare_one(&self, decl: &Declaration<'_>) -> Result<u32, CommError> {
        decl.check(self.size())?;
        let id = self.declare_id(decl)?;
        let mut table = self.table.lock().expect("table lock");
        match table.tensors.get(&id) {
            Some(t) => t.check_same(decl)?,
            None => {
                let parts = self.place_alone(&table, id, decl)?;
                table.tensors.insert(id, Tensor::new(decl, id, None, parts));
            }
        }
        Ok(id)
    }

    /// Declares a group of uncompressed tensors (see [`Self::declare_groups`]).
    pub fn declare_group(&self, tensors: &[(&str, Dtype, u64)]) -> Result<Vec<u32>, CommError> {
        let decls: Vec<Declaration<'_>> = tensors
            .iter()
            .map(|&(name, dtype, elements)| Declaration::raw(name, dtype, elements))
            .collect();
        self.declare_groups(&decls)
    }

    /// Declares a group of tensors (a model's parameters) and places their partitions
    /// together, balancing bytes over the servers by BytePS's Eq. 1 and 2. Every worker
    /// must declare the same group.
    pub fn declare_groups(&self, decls: &[Declaration<'_>]) -> Result<Vec<u32>, CommError> {
        let mut ids = Vec::with_capacity(decls.len());
        for decl in decls {
            decl.check(self.size())?;
            ids.push(self.declare_id(decl)?);
        }
        let mut table = self.table.lock().expect("table lock");
        // A repeated declaration keeps its first placement and round count.
        let mut fresh: Vec<(u32, Declaration<'_>)> = Vec::new();
        for (&id, decl) in ids.iter().zip(decls) {
            match table.tensors.get(&id) {
                Some(t) => t.check_same(decl)?,
                None => fresh.push((id, *decl)),
            }
        }
        if fresh.is_empty() {
            return Ok(ids);
        }
        let specs: Vec<(u32, TensorSpec<'_>)> =
            fresh.iter().map(|(id, d)| (*id, d.spec())).collect();
        let bytes = specs.iter().map(|(_, t)| spec_bytes(t)).sum();
        // Every server counts, also colocated ones that Eq. 2 gives nothing at k >= n:
        // there the CPU servers then get twice the partitions, which measured better on
        // the emulated cluster (n = k = 4, 1 Gbit/s, 64 MB: 0.95x of Eq. 6 in 256 KiB
        // partitions against 0.91-0.92x in the 512 KiB that counting summing servers only
        // gives).
        let derived = self.derived(&table, bytes, self.servers.len());
        let partition_bytes = derived.as_ref().map(|d| d.bytes);
        let laid = self.layout(&table, partition_bytes).group(&specs)?.tensors;
        if let Some(derived) = derived {
            info!(
                tensors = specs.len(),
                partition_bytes = derived.bytes,
                "partition size derived for a group: {}",
                derived.reason
            );
            self.follow_partition_size(&mut table, derived.bytes);
            table.reason = Some(derived.reason);
        }
        let group = table.groups.len();
        table.groups.push(fresh.iter().map(|t| t.0).collect());
        for ((id, decl), parts) in fresh.iter().zip(laid) {
            let t = Tensor::new(decl, *id, Some(group), parts);
            table.tensors.insert(*id, t);
        }
        Ok(ids)
    }

    fn declare_id(&self, decl: &Declaration<'_>) -> Result<u32, CommError> {
        let Declaration {
            name,
            dtype,
            elements,
            ..
        } = *decl;
        let id = self.job.declare_compressed(
            name,
            dtype,
            elements,
            &decl.travel(),
            self.declare_timeout,
        )?;
        check_tensor_id(name, id)?;
        Ok(id)
    }

    /// The partitions of a tensor declared alone, under the table's partition size or the
    /// size derived from the tensor (over one server when it has a home).
    fn place_alone(
        &self,
        table: &Table,
        id: u32,
        decl: &Declaration<'_>,
    ) -> Result<Vec<Partition>, CommError> {
        let servers = match self.home_server(decl) {
            Some(_) => 1,
            None => self.servers.len(),
        };
        let derived = self.derived(table, spec_bytes(&decl.spec()), servers);
        let layout = self.layout(table, derived.map(|d| d.bytes));
        self.place_alone_in(&layout, id, decl)
    }

    /// The partitions of a tensor declared alone under `layout`: on its home worker's
    /// machine's server, or each where its key falls.
    fn place_alone_in(
        &self,
        layout: &Layout<'_>,
        id: u32,
        decl: &Declaration<'_>,
    ) -> Result<Vec<Partition>, CommError> {
        Ok(match self.home_server(decl) {
            Some(server) => layout.pinned(id, &decl.spec(), server)?,
            None => layout.single(id, &decl.spec())?,
        })
    }

    /// The colocated server of the worker a tensor is kept for, if it has one.
    fn home_server(&self, decl: &Declaration<'_>) -> Option<u32> {
        decl.home
            .and_then(|w| self.cluster_map().colocated_servers(w).first().copied())
    }

    /// The partition size derived for a declaration of `bytes` over `servers` servers, if
    /// the table has none set.
    fn derived(&self, table: &Table, bytes: u64, servers: usize) -> Option<DerivedSize> {
        table.partition_bytes().is_none().then(|| {
            // Alone on one server (a colocated one, one connection) or spread over all.
            let lanes = if servers == 1 { 1 } else { self.max_lanes() };
            let carriers = if servers == 1 {
                1
            } else {
                self.workers_per_machine
            };
            derived_partition_bytes(bytes, servers, lanes, carriers, self.link_bits)
        })
    }

    /// The layout in the table's generation with its set partition size, or `derived`.
    fn layout(&self, table: &Table, derived: Option<u64>) -> Layout<'_> {
        Layout {
            servers: &self.servers,
            lanes: &self.lanes,
            partition_bytes: derived
                .or(table.partition_bytes())
                .expect("a derived size where the table has none"),
            generation: table.generation,
        }
    }

    /// The most connections this worker has to one server.
    fn max_lanes(&self) -> u32 {
        self.lanes.iter().copied().max().unwrap_or(1)
    }

    /// Counts the default credit and push window in partitions of `bytes` (a group's
    /// derived size): a window of 4 partitions of 4 MiB would let dozens of small ones run
    /// ahead, and one of 4 small ones would hold back large ones.
    fn follow_partition_size(&self, table: &mut Table, bytes: u64) {
        table.reference = bytes;
        let (credit, window) = self.follow;
        let kind = self.pipeline.schedule().kind;
        let schedule = Schedule::for_machines(kind, bytes, self.workers_per_machine);
        if credit {
            self.pipeline.set_credit(schedule.credit_bytes, bytes);
        }
        if window {
            self.pipeline.set_window(schedule.window_bytes);
        }
    }

    /// Changes the partition size and/or the credit per server (the auto-tuner's knobs).
    ///
    /// Every worker must make the same call between the same two steps, with no push_pull
    /// in flight: partitions are keys, and workers cutting a tensor differently would wait
    /// for each other's keys forever. A new partition size re-cuts and re-places every
    /// declared tensor under keys of their own (a size used before gets its old keys back),
    /// so the servers never mix partitions of two layouts.
    pub fn reconfigure(
        &self,
        partition_bytes: Option<u64>,
        credit_bytes: Option<u64>,
    ) -> Result<(), CommError> {
        let mut table = self.table.lock().expect("table lock");
        let busy = self.handles.busy();
        if busy > 0 {
            return Err(CommError::Invalid(format!(
                "reconfigure() with {busy} push_pull operation(s) in flight: wait for them \
                 first (every worker must switch between the same two steps)"
            )));
        }
        if let Some(bytes) = partition_bytes.filter(|&b| Some(b) != table.partition_bytes()) {
            let kind = self.pipeline.schedule().kind;
            if kind.sends_whole_tensors() {
                return Err(CommError::Invalid(format!(
                    "the {kind} scheduler sends whole tensors: it has no partition size to \
                     change (bytescheduler and prophet cut tensors into partitions)"
                )));
            }
            if bytes == 0 {
                return Err(CommError::Invalid(
                    "the partition size must be positive".into(),
                ));
            }
            let generation = match table.layouts.iter().position(|&b| b == Some(bytes)) {
                Some(g) => g,
                None if table.layouts.len() < MAX_GENERATIONS => table.layouts.len(),
                None => {
                    return Err(CommError::Invalid(format!(
                        "{MAX_GENERATIONS} partition sizes were used already: a job can use at \
                         most that many"
                    )))
                }
            };
            // Lay everything out under the new size first, so a failure changes nothing.
            let next = Layout {
                servers: &self.servers,
                lanes: &self.lanes,
                partition_bytes: bytes,
                generation,
            };
            let mut parts: HashMap<u32, Vec<Partition>> = HashMap::new();
            for t in table.tensors.values().filter(|t| t.group.is_none()) {
                parts.insert(t.id, self.place_alone_in(&next, t.id, &t.declaration())?);
            }
            for ids in &table.groups {
                let members: Vec<(u32, TensorSpec<'_>)> = ids
                    .iter()
                    .map(|id| (*id, table.tensors[id].declaration().spec()))
                    .collect();
                for (id, laid) in ids.iter().zip(next.group(&members)?.tensors) {
                    parts.insert(*id, laid);
                }
            }
            let current = table.generation;
            for (id, laid) in parts {
                let t = table.tensors.get_mut(&id).expect("laid out");
                if t.rounds.get(current).is_some_and(|r| *r > 0) {
                    t.earlier.extend_from_slice(&t.parts);
                }
                let old = std::mem::replace(&mut t.parts, laid);
                if t.compression.is_some_and(|c| c.feedback) {
                    self.pipeline.relayout_residuals(&old, &t.parts);
                }
            }
            if generation == table.layouts.len() {
                table.layouts.push(Some(bytes));
            }
            table.generation = generation;
            table.reference = bytes;
            info!(
                partition_bytes = bytes,
                generation, "partition size changed"
            );
        }
        // P3's credit follows the partition size even when the credit stays.
        let credit = credit_bytes.unwrap_or_else(|| self.pipeline.schedule().credit_bytes);
        self.pipeline.set_credit(credit, table.reference);
        Ok(())
    }

    /// The scheduler, the partition size and the credit per server in use.
    pub fn schedule(&self) -> Scheduling {
        let table = self.table.lock().expect("table lock");
        let s = self.pipeline.schedule();
        Scheduling {
            scheduler: s.kind,
            partition_bytes: table.partition_bytes().unwrap_or(table.reference),
            derived: table.partition_bytes().is_none(),
            reason: table
                .reason
                .clone()
                .filter(|_| table.partition_bytes().is_none()),
            credit_bytes: s.credit_bytes,
        }
    }

    /// Retires tensor `id`: this worker will never push it again. Refused while an
    /// operation on it is in flight (wait for it first). Sends `Retire` for each of its
    /// keys this worker pushed (under every partition size it was pushed under) on the
    /// key's lane, after everything sent for the key before; tells the coordinator; and
    /// forgets the tensor here. Servers free a key, and the coordinator the name, once
    /// every worker of it has retired it. A later declaration of the same name is a new
    /// tensor with a new id, answered once every worker that declared the old one has
    /// retired it (ids are never reused: keys embed them, and a server may still hold the
    /// old keys for a worker yet to retire them).
    pub fn retire(&self, id: u32) -> Result<(), CommError> {
        if let Some(e) = self.job_error() {
            return Err(e);
        }
        let mut table = self.table.lock().expect("table lock");
        let t = table.tensors.get(&id).ok_or_else(|| {
            CommError::Invalid(format!(
                "tensor id {id} is not declared here: never declared, or already retired"
            ))
        })?;
        if self.handles.in_flight(id) {
            return Err(CommError::Invalid(format!(
                "tensor '{}' has an operation in flight: wait for it before retiring the \
                 tensor",
                t.name
            )));
        }
        let mut keys: Vec<(u64, usize)> = Vec::new();
        if t.rounds.get(table.generation).is_some_and(|r| *r > 0) {
            keys.extend(t.parts.iter().map(|p| (p.key, p.server as usize)));
        }
        keys.extend(t.earlier.iter().map(|p| (p.key, p.server as usize)));
        keys.sort_unstable();
        keys.dedup();
        self.pipeline.retire(&t.name, &keys)?;
        if let Some(shared) = &self.shared {
            shared.retire(id);
        }
        self.job.undeclare(&t.name, id)?;
        if let Some(group) = t.group {
            table.groups[group].retain(|member| *member != id);
        }
        table.tensors.remove(&id);
        Ok(())
    }

    /// Tensors declared here and not retired.
    pub fn live_tensors(&self) -> usize {
        self.table.lock().expect("table lock").tensors.len()
    }

    /// One line per server: the bytes of declared tensors it sums and its target share.
    pub fn placement_report(&self) -> Vec<String> {
        let table = self.table.lock().expect("table lock");
        let mut bytes: HashMap<u32, u64> = HashMap::new();
        for t in table.tensors.values() {
            for p in &t.parts {
                *bytes.entry(p.server).or_default() += p.bytes;
            }
        }
        let total: u64 = bytes.values().sum();
        let mut ranks: Vec<_> = bytes.into_iter().collect();
        ranks.sort_unstable();
        ranks
            .into_iter()
            .map(|(r, b)| {
                format!(
                    "server {r}: {:.1} MB, {:.1}% of declared bytes",
                    b as f64 / 1e6,
                    100.0 * b as f64 / total.max(1) as f64
                )
            })
            .collect()
    }
}

/// Refuses a tensor id that keys cannot carry (24 bits: `MAX_TENSOR_ID`). Ids are never
/// reused, retired tensors' included, so this bounds the declarations of a job's life.
fn check_tensor_id(name: &str, id: u32) -> Result<(), CommError> {
    if id > MAX_TENSOR_ID {
        return Err(CommError::Invalid(format!(
            "tensor '{name}' was given id {id}, past the last id a key can carry \
             (MAX_TENSOR_ID = {MAX_TENSOR_ID}): a job declares at most {} tensors over its \
             life, retired ones included, since ids are never reused; name tensors that \
             recur (an unnamed operation declares new ones each call)",
            u64::from(MAX_TENSOR_ID) + 1
        )));
    }
    Ok(())
}

#[cfg(test)]
mod retire_tests {
    use super::*;

    #[test]
    fn an_id_past_what_keys_carry_is_refused_naming_the_limit() {
        assert!(check_tensor_id("t", MAX_TENSOR_ID).is_ok());
        let e = check_tensor_id("allreduce.noname.9", MAX_TENSOR_ID + 1).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("MAX_TENSOR_ID = 16777215") && msg.contains("never reused"),
            "{msg}"
        );
        assert!(msg.contains("'allreduce.noname.9'"), "{msg}");
    }
}
