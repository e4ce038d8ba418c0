//! The coordinator's state machine: who has joined, the cluster map, barriers, liveness,
//! and the job's tensor table (name -> id, checked for agreement at declaration).
//!
//! It does no I/O and reads no clock: the service feeds it events with the current time
//! and carries out the [`Action`]s it returns, in order. Every decision is logged with its
//! reason through [`Action::Log`], so tests can read the same sentences operators do.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::time::{Duration, Instant};

use sumflow_wire::{
    BarrierGroup, ClusterMap, Dtype, ErrorCode, ErrorReply, Message, NodeId, NodeInfo, Peer,
    Registration, Role, WireError,
};
use tracing::Level;

use crate::config::CoordinatorConfig;
use crate::liveness::silence_verdict;
use crate::ranks::{admit, assign_ranks, Refusal};
use crate::{CoordinatorError, JobOutcome};

/// Identifies one connection for the lifetime of a coordinator.
pub type ConnId = u64;

/// Most tensors one job may declare. Real models have thousands; a name that changes from
/// step to step would otherwise grow the table until the coordinator runs out of memory.
pub const MAX_TENSORS: usize = 1 << 20;

/// How many declarers a mismatch message names before it only counts the rest.
const NAMED_DECLARERS: usize = 3;

/// What the service must do in response to an event, in the order given.
#[derive(Debug)]
pub enum Action {
    /// Queue a frame to a connection.
    Send(ConnId, Message),
    /// Send what is queued to the connection, then close it. The core has forgotten it.
    Close(ConnId),
    /// A decision and its reason, for the log.
    Log(Level, String),
    /// Something went wrong with a node: for the record a supervisor reads
    /// (`--incidents-file`), so it blames the node that failed first, not one that noticed.
    Incident(Incident),
    /// The coordinator's work is over: carry out the actions before this one, then stop.
    Finished(Result<JobOutcome, CoordinatorError>),
}

/// What the coordinator saw go wrong with one node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Incident {
    pub kind: IncidentKind,
    pub node: NodeId,
    /// The node's name, machine (host id) and process id, as it registered them.
    pub name: String,
    pub host_id: String,
    pub pid: u32,
    /// The verdict in words, e.g. "no heartbeat for 10.0 s".
    pub reason: String,
}

/// How a node went wrong.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum IncidentKind {
    /// Declared failed: crashed, hung, or its connection lost.
    Failed,
    /// Alive, but a summation server has waited past its stall warning for a round the
    /// worker has not pushed (stuck in its own code while its heartbeat runs).
    Stalled,
}

impl IncidentKind {
    pub fn name(self) -> &'static str {
        match self {
            IncidentKind::Failed => "failed",
            IncidentKind::Stalled => "stalled",
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    Joining,
    Running,
    Done,
}

#[derive(Debug)]
struct Conn {
    peer: Peer,
    last_seen: Instant,
    /// Set once the node has registered.
    reg: Option<Registration>,
    /// Set once the cluster map has given the node its rank.
    node: Option<NodeId>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Status {
    Live,
    Left,
    Failed,
}

#[derive(Debug)]
struct Member {
    name: String,
    host_id: String,
    pid: u32,
    conn: Option<ConnId>,
    status: Status,
    /// Highest barrier id entered so far, per group (`group_index`).
    last_barrier: [Option<u64>; 3],
}

#[derive(Debug)]
struct Barrier {
    group: BarrierGroup,
    waiters: BTreeSet<NodeId>,
    /// The node that entered last so far (`BarrierDone` names it: `join()` returns the
    /// rank of the worker that joined last).
    last: Option<NodeId>,
}

/// One declared tensor: what its first declaration fixed, and who has declared it since.
#[derive(Debug)]
struct Tensor {
    id: u32,
    dtype: Dtype,
    elements: u64,
    /// How it travels, as described by its first declaration; empty: raw elements summed
    /// over every worker.
    compression: String,
    /// Rank of the worker whose declaration came first; mismatch messages name it first.
    first: u32,
    /// Ranks of every worker that declared it with the same dtype and size.
    declared_by: BTreeSet<u32>,
    /// Ranks of the workers that retired it (`Undeclare`); the name leaves the table once
    /// this holds every declarer.
    retired_by: BTreeSet<u32>,
    /// Declarations of the name by workers that already retired this tensor: a new
    /// tensor under the same name, answered once every declarer has retired this one.
    queued: Vec<(ConnId, NodeId, Form)>,
}

impl Tensor {
    fn form(&self) -> Form {
        Form::new(self.dtype, self.elements, self.compression.clone())
    }
}

/// What a declaration says a tensor is; every declaration of a name must say the same.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Form {
    dtype: Dtype,
    elements: u64,
    compression: String,
}

impl Form {
    fn new(dtype: Dtype, elements: u64, compression: String) -> Form {
        Form {
            dtype,
            elements,
            compression,
        }
    }
}

impl std::fmt::Display for Form {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} x {}", self.dtype, self.elements)?;
        // The worker's own words, e.g. "compressed by sign" or "summed over workers [0, 2]".
        if !self.compression.is_empty() {
            write!(f, " {}", self.compression)?;
        }
        Ok(())
    }
}

/// The coordinator's whole state. Feed it events; it answers with actions.
#[derive(Debug)]
pub struct Membership {
    job_id: String,
    expected_workers: u32,
    expected_servers: u32,
    heartbeat_timeout: Duration,
    join_timeout: Duration,
    started: Instant,
    phase: Phase,
    conns: HashMap<ConnId, Conn>,
    /// Registered connections in join order, until the map is sent.
    joined: Vec<ConnId>,
    members: BTreeMap<NodeId, Member>,
    barriers: BTreeMap<u64, Barrier>,
    failed: Vec<(NodeId, String, String)>,
    /// Declared tensors by name; ids are 0, 1, 2, ... in the order names first arrived.
    tensors: HashMap<String, Tensor>,
    max_tensors: usize,
    /// The next tensor id. Ids are never reused, retired tensors' included: a server may
    /// still hold a retired tensor's keys (they embed the id) for workers yet to retire it.
    next_id: u32,
    /// The most names the table held at once, and how many left it once retired.
    peak_tensors: usize,
    retired_tensors: u64,
    /// The declaration error that ended the job's agreement on tensors. Every later
    /// declaration gets it again: the table can no longer be trusted.
    declare_error: Option<ErrorReply>,
    /// Workers reported stalled so far (one per worker per report).
    stalls_reported: u64,
    out: Vec<Action>,
}

/// What the coordinator's metrics show (see [`Membership::counts`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counts {
    /// Whether the cluster map went out and the job has not ended.
    pub running: bool,
    /// Ranked nodes by role (worker, server) and status: live, left, failed.
    pub nodes: [[u64; 3]; 2],
    /// Nodes registered while the job gathers, before ranks are given.
    pub joining: u64,
    pub connections: u64,
    pub tensors: u64,
    pub tensor_ids: u64,
    pub tensors_retired: u64,
    pub barriers_waiting: u64,
    pub stalls_reported: u64,
}

impl Membership {
    /// A coordinator that started at `now` and waits for the nodes `cfg` expects.
    pub fn new(cfg: &CoordinatorConfig, now: Instant) -> Membership {
        Membership {
            job_id: cfg.job_id.clone(),
            expected_workers: cfg.num_workers,
            expected_servers: cfg.num_servers,
            heartbeat_timeout: cfg.heartbeat_timeout,
            join_timeout: cfg.join_timeout,
            started: now,
            phase: Phase::Joining,
            conns: HashMap::new(),
            joined: Vec::new(),
            members: BTreeMap::new(),
            barriers: BTreeMap::new(),
            failed: Vec::new(),
            tensors: HashMap::new(),
            max_tensors: MAX_TENSORS,
            next_id: 0,
            peak_tensors: 0,
            retired_tensors: 0,
            declare_error: None,
            stalls_reported: 0,
            out: Vec::new(),
        }
    }

    /// The job's state in numbers, for metrics.
    pub fn counts(&self) -> Counts {
        let mut nodes = [[0; 3]; 2];
        for (id, m) in &self.members {
            let role = usize::from(id.role == Role::Server);
            let status = match m.status {
                Status::Live => 0,
                Status::Left => 1,
                Status::Failed => 2,
            };
            nodes[role][status] += 1;
        }
        Counts {
            running: self.phase == Phase::Running,
            nodes,
            joining: self.joined.len() as u64,
            connections: self.conns.len() as u64,
            tensors: self.tensors.len() as u64,
            tensor_ids: u64::from(self.next_id),
            tensors_retired: self.retired_tensors,
            barriers_waiting: self.barriers.len() as u64,
            stalls_reported: self.stalls_reported,
        }
    }

    /// Lowers the tensor table's limit so that tests can reach it.
    #[cfg(test)]
    pub(crate) fn limit_tensors(&mut self, max: usize) {
        self.max_tensors = max;
    }

    /// The ranks of the workers that have declared tensor `name` (in rank order), or
    /// `None` if no worker has.
    pub fn declarers(&self, name: &str) -> Option<Vec<u32>> {
        let t = self.tensors.get(name)?;
        Some(t.declared_by.iter().copied().collect())
    }

    /// Names in the tensor table now (live tensors: declared and not yet retired by every
    /// worker that declared them).
    pub fn live_tensors(&self) -> usize {
        self.tensors.len()
    }

    /// A connection finished the token handshake as `peer`.
    pub fn connected(&mut self, conn: ConnId, peer: Peer, now: Instant) -> Vec<Action> {
        if self.phase == Phase::Done {
            self.out.push(Action::Close(conn));
        } else {
            self.log(
                Level::DEBUG,
                format!("{} '{}' authenticated", peer.role, peer.name),
            );
            let c = Conn {
                peer,
                last_seen: now,
                reg: None,
                node: None,
            };
            self.conns.insert(conn, c);
        }
        self.take()
    }

    /// A well-formed frame arrived on `conn`. Any frame counts as a sign of life.
    pub fn message(&mut self, conn: ConnId, msg: Message, now: Instant) -> Vec<Action> {
        let Some(c) = self.conns.get_mut(&conn) else {
            return Vec::new();
        };
        c.last_seen = now;
        match msg {
            Message::Register(reg) => self.register(conn, reg),
            Message::Heartbeat { seq } => self.send(conn, Message::HeartbeatAck { seq }),
            Message::Barrier { id, group } => self.barrier(conn, id, group),
            Message::Declare {
                name,
                dtype,
                elements,
                compression,
            } => self.declare(conn, name, Form::new(dtype, elements, compression)),
            Message::Undeclare { name, tensor_id } => self.undeclare(conn, name, tensor_id),
            Message::Shutdown { reason } => self.leave(conn, &reason),
            Message::Stalled {
                key,
                round,
                waited_ms,
                missing,
            } => self.stall_report(conn, key, round, waited_ms, &missing),
            Message::Error(e) => {
                let who = self.describe(conn);
                self.log(
                    Level::WARN,
                    format!("{who} reported an error: {}: {}", e.code, e.message),
                );
            }
            other => self.refuse_and_close(
                conn,
                ErrorCode::UnexpectedOp,
                format!(
                    "sent a {} frame, which the coordinator does not handle",
                    other.op()
                ),
            ),
        }
        self.take()
    }

    /// A frame on `conn` could not be decoded: tell the node why and close the connection.
    pub fn invalid_frame(&mut self, conn: ConnId, err: &WireError) -> Vec<Action> {
        if self.conns.contains_key(&conn) {
            self.refuse_and_close(conn, err.code(), format!("sent an invalid frame: {err}"));
        }
        self.take()
    }

    /// `conn` closed or broke for `reason`; a ranked node that had not left has failed.
    pub fn disconnected(&mut self, conn: ConnId, reason: &str) -> Vec<Action> {
        self.drop_conn(conn, reason);
        self.take()
    }

    /// Time passed: enforce the join deadline and the heartbeat timeout.
    pub fn tick(&mut self, now: Instant) -> Vec<Action> {
        match self.phase {
            Phase::Done => {}
            Phase::Joining if now.saturating_duration_since(self.started) > self.join_timeout => {
                self.join_timed_out();
            }
            Phase::Joining | Phase::Running => {
                let mut silent: Vec<(ConnId, String)> = self
                    .conns
                    .iter()
                    .filter_map(|(id, c)| {
                        let why = silence_verdict(
                            c.last_seen,
                            now,
                            self.heartbeat_timeout,
                            self.started,
                        )?;
                        Some((*id, why))
                    })
                    .collect();
                silent.sort();
                for (conn, why) in silent {
                    self.send(
                        conn,
                        Message::error(
                            ErrorCode::Timeout,
                            None,
                            format!("{why}; the coordinator is closing this connection"),
                        ),
                    );
                    self.drop_conn(conn, &why);
                }
            }
        }
        self.take()
    }

    /// Stop on request: tell every node and finish.
    pub fn stop(&mut self) -> Vec<Action> {
        if self.phase != Phase::Done {
            self.finish("coordinator stopping".into());
        }
        self.take()
    }

    fn register(&mut self, conn: ConnId, reg: Registration) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        if c.reg.is_some() {
            let who = self.describe(conn);
            let msg = format!("{who} is already registered; send Register once per connection");
            return self.send(conn, Message::error(ErrorCode::UnexpectedOp, None, msg));
        }
        if self.phase == Phase::Running {
            let msg = format!(
                "job {} already started with its {} workers and {} servers; {} '{}' cannot join a running job",
                self.job_id, self.expected_workers, self.expected_servers, reg.role, reg.name
            );
            return self.refuse_and_close(conn, ErrorCode::ClusterFull, msg);
        }
        if reg.role != c.peer.role || reg.requested_rank != c.peer.rank {
            let msg = format!(
                "'{}' registered as {} with {} but authenticated as {} with {}",
                reg.name,
                reg.role,
                rank_text(reg.requested_rank),
                c.peer.role,
                rank_text(c.peer.rank)
            );
            return self.refuse_and_close(conn, ErrorCode::BadRank, msg);
        }
        let same_role: Vec<&Registration> =
            self.joined_regs().filter(|r| r.role == reg.role).collect();
        if let Err(Refusal { code, message }) = admit(&reg, &same_role, self.expected(reg.role)) {
            return self.refuse_and_close(conn, code, message);
        }
        let line = format!(
            "{} '{}' (pid {} on {}, {}) joined",
            reg.role,
            reg.name,
            reg.pid,
            reg.host_id,
            rank_text(reg.requested_rank)
        );
        if let Some(c) = self.conns.get_mut(&conn) {
            c.reg = Some(reg);
        }
        self.joined.push(conn);
        let (workers, servers) = self.joined_counts();
        self.log(
            Level::INFO,
            format!(
                "{line}: {workers} of {} workers, {servers} of {} servers",
                self.expected_workers, self.expected_servers
            ),
        );
        if workers == self.expected_workers && servers == self.expected_servers {
            self.start();
        }
    }

    /// Everyone is here: assign ranks, remember the members, send each node the map.
    fn start(&mut self) {
        let joined: Vec<(ConnId, Registration)> = self
            .joined
            .drain(..)
            .filter_map(|id| Some((id, self.conns.get(&id)?.reg.clone()?)))
            .collect();
        let mut map = ClusterMap {
            job_id: self.job_id.clone(),
            workers: Vec::new(),
            servers: Vec::new(),
        };
        let mut assigned = Vec::new();
        for role in [Role::Worker, Role::Server] {
            let of_role: Vec<&(ConnId, Registration)> =
                joined.iter().filter(|(_, r)| r.role == role).collect();
            let requested: Vec<Option<u32>> =
                of_role.iter().map(|(_, r)| r.requested_rank).collect();
            let mut nodes = Vec::new();
            for ((conn, reg), rank) in of_role.into_iter().zip(assign_ranks(&requested)) {
                let id = NodeId { role, rank };
                if let Some(c) = self.conns.get_mut(conn) {
                    c.node = Some(id);
                }
                let member = Member {
                    name: reg.name.clone(),
                    host_id: reg.host_id.clone(),
                    pid: reg.pid,
                    conn: Some(*conn),
                    status: Status::Live,
                    last_barrier: [None; 3],
                };
                self.members.insert(id, member);
                assigned.push((*conn, rank));
                nodes.push(NodeInfo {
                    rank,
                    host: reg.host.clone(),
                    port: reg.port,
                    host_id: reg.host_id.clone(),
                    pid: reg.pid,
                    link_mbit: reg.link_mbit,
                    name: reg.name.clone(),
                });
            }
            nodes.sort_by_key(|n| n.rank);
            match role {
                Role::Worker => map.workers = nodes,
                Role::Server => map.servers = nodes,
            }
        }
        self.log(
            Level::INFO,
            format!(
                "all {} nodes joined; sending the cluster map: workers [{}], servers [{}]",
                assigned.len(),
                roster(&map.workers),
                roster(&map.servers)
            ),
        );
        for (conn, rank) in assigned {
            let msg = Message::ClusterMap {
                your_rank: rank,
                map: map.clone(),
            };
            self.send(conn, msg);
        }
        self.phase = Phase::Running;
    }

    fn barrier(&mut self, conn: ConnId, id: u64, group: BarrierGroup) {
        let Some(c) = self.conns.get(&conn) else {
            return;
        };
        let Some(node) = c.node else {
            if c.reg.is_none() {
                let why = "sent a Barrier frame before registering".to_string();
                return self.refuse_and_close(conn, ErrorCode::UnexpectedOp, why);
            }
            let msg = format!(
                "barrier {id} entered before the cluster map was sent; barriers start once every node has joined"
            );
            return self.send(conn, Message::error(ErrorCode::UnexpectedOp, Some(id), msg));
        };
        let who = self.node_name(node);
        let gname = group_name(group);
        if !in_group(group, node.role) {
            let msg = format!("{who} cannot enter {gname} barrier {id}: only workers are members");
            return self.send(conn, Message::error(ErrorCode::UnexpectedOp, Some(id), msg));
        }
        let Some(member) = self.members.get_mut(&node) else {
            return;
        };
        let slot = &mut member.last_barrier[group_index(group)];
        if let Some(prev) = *slot {
            if id <= prev {
                let msg = format!(
                    "{who} entered {gname} barrier {id} after {gname} barrier {prev}: barrier ids must increase"
                );
                return self.send(conn, Message::error(ErrorCode::UnexpectedOp, Some(id), msg));
            }
        }
        *slot = Some(id);
        if let Some(b) = self.barriers.get(&id) {
            if b.group != group {
                let msg = format!(
                    "barrier {id} is a {} barrier but {who} entered it as a {gname} barrier",
                    group_name(b.group)
                );
                return self.send(conn, Message::error(ErrorCode::UnexpectedOp, Some(id), msg));
            }
        }
        if let Some((fid, fname, reason)) = self.failed.iter().find(|f| in_group(group, f.0.role)) {
            let msg = format!(
                "{gname} barrier {id} can never complete: {fid} '{fname}' failed: {reason}"
            );
            return self.send(conn, Message::error(ErrorCode::NodeFailed, Some(id), msg));
        }
        let b = self.barriers.entry(id).or_insert_with(|| Barrier {
            group,
            waiters: BTreeSet::new(),
            last: None,
        });
        b.waiters.insert(node);
        b.last = Some(node);
        self.try_complete(id);
    }

    /// A worker declares a tensor: the first declaration of a name fixes its id, dtype and
    /// size for the job; later ones must match, or the job's agreement is over.
    fn declare(&mut self, conn: ConnId, name: String, form: Form) {
        let Some(node) = self.declaring_worker(conn, &name) else {
            return;
        };
        if let Some(e) = &self.declare_error {
            return self.send(conn, Message::Error(e.clone()));
        }
        let Some(t) = self.tensors.get_mut(&name) else {
            return self.first_declaration(conn, node, name, form);
        };
        if t.retired_by.contains(&node.rank) {
            // This worker is done with the tensor and declares the name anew, while
            // others still use it: the new tensor waits until every declarer retired the
            // old one, so that no worker still on the old one is given the new id.
            let old = t.id;
            t.queued.push((conn, node, form));
            let line = format!(
                "{} declared tensor '{name}' again after retiring tensor {old}; answered once \
                 every worker that declared it has retired it",
                self.node_name(node),
            );
            return self.log(Level::DEBUG, line);
        }
        if t.form() != form {
            let msg = self.mismatch_text(&name, &form, node);
            return self.declaration_failed(conn, ErrorCode::KeyMismatch, msg);
        }
        t.declared_by.insert(node.rank);
        let tensor_id = t.id;
        self.send(conn, Message::Declared { name, tensor_id });
    }

    /// A worker will not use tensor `name` (`tensor_id`) again: once every worker that
    /// declared it has said so, the name leaves the table (so the table's limit counts
    /// live tensors only) and declarations of the name queued meanwhile are answered, as
    /// first declarations, with a new id. A frame that names no live tensor of this
    /// worker's is logged and otherwise ignored.
    fn undeclare(&mut self, conn: ConnId, name: String, tensor_id: u32) {
        let Some(node) = self.conns.get(&conn).and_then(|c| c.node) else {
            let who = self.describe(conn);
            return self.log(
                Level::WARN,
                format!("{who} retired tensor '{name}' before joining the job; ignored"),
            );
        };
        let who = self.node_name(node);
        let ignored = match self.tensors.get_mut(&name) {
            None => Some("no such tensor is live".to_string()),
            Some(t) if t.id != tensor_id => Some(format!("the name is tensor {}", t.id)),
            Some(t) if !t.declared_by.contains(&node.rank) => {
                Some("it never declared it".to_string())
            }
            Some(t) => (!t.retired_by.insert(node.rank)).then(|| "it retired it before".into()),
        };
        if let Some(why) = ignored {
            return self.log(
                Level::WARN,
                format!("{who} retired tensor '{name}' ({tensor_id}), but {why}; ignored"),
            );
        }
        let t = &self.tensors[&name];
        if t.retired_by.len() < t.declared_by.len() {
            return;
        }
        let t = self.tensors.remove(&name).expect("checked above");
        self.retired_tensors += 1;
        self.log(
            Level::DEBUG,
            format!(
                "tensor '{name}' ({tensor_id}) retired by every worker that declared it; \
                 the name is free"
            ),
        );
        for (conn, _, form) in t.queued {
            // A worker may have failed or left meanwhile: the declaration dies with it.
            if self.conns.contains_key(&conn) {
                self.declare(conn, name.clone(), form);
            }
        }
    }

    /// The worker on `conn` if it may declare now; otherwise refuses the declaration.
    fn declaring_worker(&mut self, conn: ConnId, name: &str) -> Option<NodeId> {
        let c = self.conns.get(&conn)?;
        let refusal = match (c.node, &c.reg) {
            (Some(node), _) if node.role == Role::Worker => return Some(node),
            (None, None) => {
                let why = "sent a Declare frame before registering".to_string();
                self.refuse_and_close(conn, ErrorCode::UnexpectedOp, why);
                return None;
            }
            (None, Some(_)) => format!(
                "tensor '{name}' declared before the cluster map was sent; declarations start once every node has joined"
            ),
            (Some(node), _) => format!(
                "{} declared tensor '{name}': only workers declare tensors",
                self.node_name(node)
            ),
        };
        self.send(conn, Message::error(ErrorCode::UnexpectedOp, None, refusal));
        None
    }

    /// A name no worker has declared yet gets the next id, unless the table is full.
    fn first_declaration(&mut self, conn: ConnId, node: NodeId, name: String, form: Form) {
        let who = self.node_name(node);
        let Some(id) = self.next_tensor_id() else {
            let msg = format!(
                "{who} declared tensor '{name}', but the job already has {} tensors, the most the \
                 coordinator keeps (retired tensors do not count): does a tensor's name change \
                 from step to step?",
                self.tensors.len()
            );
            return self.declaration_failed(conn, ErrorCode::ResourceExhausted, msg);
        };
        self.log(
            Level::DEBUG,
            format!("{who} declared tensor '{name}' ({form}): tensor {id}"),
        );
        let t = Tensor {
            id,
            dtype: form.dtype,
            elements: form.elements,
            compression: form.compression,
            first: node.rank,
            declared_by: BTreeSet::from([node.rank]),
            retired_by: BTreeSet::new(),
            queued: Vec::new(),
        };
        self.tensors.insert(name.clone(), t);
        self.next_id += 1;
        self.peak_tensors = self.peak_tensors.max(self.tensors.len());
        self.send(
            conn,
            Message::Declared {
                name,
                tensor_id: id,
            },
        );
    }

    /// The next id, unless the table is full. Ids run on past retired tensors' (never
    /// reused); the workers refuse one beyond what a key can carry (2^24 ids,
    /// `sumflow_plan::layout::MAX_TENSOR_ID`), naming the limit.
    fn next_tensor_id(&self) -> Option<u32> {
        if self.tensors.len() >= self.max_tensors || self.next_id == u32::MAX {
            return None;
        }
        Some(self.next_id)
    }

    /// "tensor 'x' declared as f16 x 4 by worker 1 'b', but as f32 x 4 by worker 0 'a': ...",
    /// naming the earlier declarers, the first one first.
    fn mismatch_text(&self, name: &str, form: &Form, by: NodeId) -> String {
        let Some(t) = self.tensors.get(name) else {
            return format!("tensor '{name}' was declared inconsistently");
        };
        let others = t.declared_by.iter().filter(|r| **r != t.first);
        let ranks: Vec<u32> = std::iter::once(t.first).chain(others.copied()).collect();
        let earlier: Vec<String> = ranks
            .iter()
            .take(NAMED_DECLARERS)
            .map(|r| {
                self.node_name(NodeId {
                    role: Role::Worker,
                    rank: *r,
                })
            })
            .collect();
        let what = if form.compression.is_empty() && t.compression.is_empty() {
            "dtype and size"
        } else {
            "dtype, size, shape, compression and members"
        };
        format!(
            "tensor '{name}' declared as {form} by {}, but as {} by {}: every worker must \
             declare each tensor with the same {what}",
            self.node_name(by),
            t.form(),
            listing(earlier, ranks.len().saturating_sub(NAMED_DECLARERS))
        )
    }

    /// The job's workers can no longer agree on tensors: the declaring worker is answered
    /// and every other live worker told, with the same frame, and later declarations get it
    /// too. Connections stay open; the workers end the job by leaving.
    fn declaration_failed(&mut self, conn: ConnId, code: ErrorCode, message: String) {
        self.log(
            Level::ERROR,
            format!("{message}; the job cannot continue, telling every worker"),
        );
        let reply = ErrorReply {
            code,
            key: None,
            message,
        };
        self.declare_error = Some(reply.clone());
        self.send(conn, Message::Error(reply.clone()));
        let others: Vec<ConnId> = self
            .members
            .iter()
            .filter(|(n, m)| n.role == Role::Worker && m.status == Status::Live)
            .filter_map(|(_, m)| m.conn)
            .filter(|c| *c != conn)
            .collect();
        for other in others {
            self.send(other, Message::Error(reply.clone()));
        }
    }

    /// Releases barrier `id` once every live member of its group waits in it.
    fn try_complete(&mut self, id: u64) {
        let Some(b) = self.barriers.get(&id) else {
            return;
        };
        let complete = self
            .members
            .iter()
            .filter(|(n, m)| m.status == Status::Live && in_group(b.group, n.role))
            .all(|(n, _)| b.waiters.contains(n));
        if !complete {
            return;
        }
        let Some(b) = self.barriers.remove(&id) else {
            return;
        };
        self.log(
            Level::DEBUG,
            format!(
                "{} barrier {id} complete with {} nodes",
                group_name(b.group),
                b.waiters.len()
            ),
        );
        // A barrier completed by a departure: the last of those who entered it.
        let last = b
            .last
            .filter(|n| b.waiters.contains(n))
            .or_else(|| b.waiters.last().copied());
        let Some(last) = last else {
            return;
        };
        for n in b.waiters {
            if let Some(conn) = self.members.get(&n).and_then(|m| m.conn) {
                self.send(conn, Message::BarrierDone { id, last });
            }
        }
    }

    /// A graceful leave: never reported as a failure, and no longer awaited in barriers.
    fn leave(&mut self, conn: ConnId, reason: &str) {
        let who = self.describe(conn);
        let Some(c) = self.forget(conn) else {
            return;
        };
        let Some(node) = c.node else {
            let line = if c.reg.is_some() {
                format!(
                    "{who} left before the cluster map was sent ({reason}); a replacement may join"
                )
            } else {
                format!("{who} left before registering ({reason})")
            };
            return self.log(Level::INFO, line);
        };
        if let Some(m) = self.members.get_mut(&node) {
            m.status = Status::Left;
            m.conn = None;
        }
        self.log(Level::INFO, format!("{who} left: {reason}"));
        for b in self.barriers.values_mut() {
            b.waiters.remove(&node);
        }
        self.barriers.retain(|_, b| !b.waiters.is_empty());
        let ids: Vec<u64> = self.barriers.keys().copied().collect();
        for id in ids {
            self.try_complete(id);
        }
        self.check_finished();
    }

    /// Sends an `Error` naming `why`, then drops the connection for that reason.
    fn refuse_and_close(&mut self, conn: ConnId, code: ErrorCode, why: String) {
        let who = self.describe(conn);
        self.log(Level::WARN, format!("refusing {who}: {code}: {why}"));
        self.send(conn, Message::error(code, None, why.clone()));
        self.drop_conn(conn, &why);
    }

    /// Forgets `conn`; a ranked node still live is declared failed for `reason`.
    fn drop_conn(&mut self, conn: ConnId, reason: &str) {
        let who = self.describe(conn);
        let Some(c) = self.forget(conn) else {
            return;
        };
        match (c.node, c.reg) {
            (Some(id), _) => self.fail(id, reason.to_string()),
            (None, Some(_)) => self.log(
                Level::INFO,
                format!("dropping {who} before the cluster map was sent: {reason}; a replacement may join"),
            ),
            (None, None) => self.log(
                Level::DEBUG,
                format!("dropping {who} before it registered: {reason}"),
            ),
        }
    }

    /// Declares a live member failed: every other live node hears of it, and barriers it
    /// belonged to can never complete (their waiters learn why from the same notice).
    fn fail(&mut self, id: NodeId, reason: String) {
        let Some(m) = self.members.get_mut(&id) else {
            return;
        };
        if m.status != Status::Live {
            return;
        }
        m.status = Status::Failed;
        let name = m.name.clone();
        if let Some(conn) = m.conn.take() {
            self.forget(conn);
        }
        self.log(Level::WARN, format!("{id} '{name}' failed: {reason}"));
        self.failed.push((id, name.clone(), reason.clone()));
        self.incident(IncidentKind::Failed, id, reason.clone());
        let notify: Vec<ConnId> = self
            .members
            .values()
            .filter(|m| m.status == Status::Live)
            .filter_map(|m| m.conn)
            .collect();
        for conn in notify {
            let msg = Message::NodeFailed {
                node: id,
                name: name.clone(),
                reason: reason.clone(),
            };
            self.send(conn, msg);
        }
        let doomed: Vec<u64> = self
            .barriers
            .iter()
            .filter(|(_, b)| in_group(b.group, id.role))
            .map(|(bid, _)| *bid)
            .collect();
        for bid in doomed {
            if let Some(b) = self.barriers.remove(&bid) {
                self.log(
                    Level::WARN,
                    format!(
                        "{} barrier {bid} can never complete because {id} '{name}' failed; its {} waiting node(s) were told",
                        group_name(b.group),
                        b.waiters.len()
                    ),
                );
            }
        }
        self.check_finished();
    }

    /// A server (or a worker, of its machine's shared memory) says a round has waited past
    /// its stall warning for workers that have not pushed it. They are alive (their
    /// heartbeats come) but stuck in their own code, or not calling the operation: logged
    /// by name, and recorded so that the launcher blames them when the waiting workers
    /// give up, not the workers that gave up.
    fn stall_report(
        &mut self,
        conn: ConnId,
        key: u64,
        round: u64,
        waited_ms: u64,
        missing: &[u32],
    ) {
        let Some(reporter) = self.conns.get(&conn).and_then(|c| c.node) else {
            let who = self.describe(conn);
            let why = format!("{who} sent a Stalled frame before the job started");
            return self.refuse_and_close(conn, ErrorCode::UnexpectedOp, why);
        };
        let stalled: Vec<NodeId> = missing
            .iter()
            .map(|&rank| NodeId {
                role: Role::Worker,
                rank,
            })
            .filter(|&id| id != reporter)
            .filter(|id| {
                self.members
                    .get(id)
                    .is_some_and(|m| m.status == Status::Live)
            })
            .collect();
        if stalled.is_empty() {
            return;
        }
        let tensor = self.tensor_of_key(key);
        let waiter = self.node_name(reporter);
        let place = match reporter.role {
            Role::Server => format!("to {waiter}"),
            Role::Worker => format!("to their machine's shared memory ({waiter} waits)"),
        };
        let reason = format!(
            "has not pushed round {round} of {tensor} {place} for {:.0} s while the other \
             workers wait (stuck in its own code, or not calling the operation)",
            waited_ms as f64 / 1000.0
        );
        let names: Vec<String> = stalled.iter().map(|&id| self.node_name(id)).collect();
        self.log(Level::WARN, format!("{}: {reason}", names.join(", ")));
        for id in stalled {
            self.stalls_reported += 1;
            self.incident(IncidentKind::Stalled, id, reason.clone());
        }
    }

    /// `tensor 'name' (key 0x...)`: keys carry their tensor's id in bits 32 to 55
    /// (docs/protocol.md).
    fn tensor_of_key(&self, key: u64) -> String {
        let id = (key >> 32 & 0xff_ffff) as u32;
        match self.tensors.iter().find(|(_, t)| t.id == id) {
            Some((name, _)) => format!("tensor '{name}' (key {key:#x})"),
            None => format!("key {key:#x}"),
        }
    }

    fn incident(&mut self, kind: IncidentKind, node: NodeId, reason: String) {
        let Some(m) = self.members.get(&node) else {
            return;
        };
        let incident = Incident {
            kind,
            node,
            name: m.name.clone(),
            host_id: m.host_id.clone(),
            pid: m.pid,
            reason,
        };
        self.out.push(Action::Incident(incident));
    }

    /// With no live worker left there is nothing to serve: stop the servers and finish.
    fn check_finished(&mut self) {
        if self.phase != Phase::Running {
            return;
        }
        let workers = || self.members.iter().filter(|(n, _)| n.role == Role::Worker);
        if workers().any(|(_, m)| m.status == Status::Live) {
            return;
        }
        let failed = workers()
            .filter(|(_, m)| m.status == Status::Failed)
            .count();
        let reason = if failed == 0 {
            "all workers finished".to_string()
        } else {
            let left = workers().count() - failed;
            format!("no live workers remain: {left} finished, {failed} failed")
        };
        self.finish(reason);
    }

    fn finish(&mut self, reason: String) {
        self.log(
            Level::INFO,
            format!(
                "tensor table: {} live at the end, at most {} at once, {} retired by every \
                 worker that declared them, {} ids given",
                self.tensors.len(),
                self.peak_tensors,
                self.retired_tensors,
                self.next_id
            ),
        );
        self.log(Level::INFO, format!("stopping: {reason}"));
        let mut conns: Vec<ConnId> = self.conns.keys().copied().collect();
        conns.sort();
        for conn in conns {
            let msg = Message::Shutdown {
                reason: reason.clone(),
            };
            self.send(conn, msg);
            self.out.push(Action::Close(conn));
        }
        self.conns.clear();
        self.joined.clear();
        self.phase = Phase::Done;
        let outcome = JobOutcome {
            failed: self.failed.clone(),
            stop_reason: reason,
        };
        self.out.push(Action::Finished(Ok(outcome)));
    }

    fn join_timed_out(&mut self) {
        let (workers, servers) = self.joined_counts();
        let joined: Vec<String> = self
            .joined_regs()
            .map(|r| format!("{} '{}' (pid {} on {})", r.role, r.name, r.pid, r.host_id))
            .collect();
        let err = CoordinatorError::JoinTimeout {
            job_id: self.job_id.clone(),
            secs: self.join_timeout.as_secs_f64(),
            workers_joined: workers,
            workers_expected: self.expected_workers,
            servers_joined: servers,
            servers_expected: self.expected_servers,
            missing: missing_text(
                self.expected_workers - workers,
                self.expected_servers - servers,
            ),
            joined: if joined.is_empty() {
                "nobody".into()
            } else {
                joined.join(", ")
            },
        };
        let msg = err.to_string();
        self.log(Level::ERROR, msg.clone());
        let mut conns: Vec<ConnId> = self.conns.keys().copied().collect();
        conns.sort();
        for conn in conns {
            self.send(conn, Message::error(ErrorCode::Timeout, None, msg.clone()));
            self.out.push(Action::Close(conn));
        }
        self.conns.clear();
        self.joined.clear();
        self.phase = Phase::Done;
        self.out.push(Action::Finished(Err(err)));
    }

    /// Removes a connection from every table and has the service close it.
    fn forget(&mut self, conn: ConnId) -> Option<Conn> {
        let c = self.conns.remove(&conn)?;
        self.joined.retain(|id| *id != conn);
        self.out.push(Action::Close(conn));
        Some(c)
    }

    fn joined_regs(&self) -> impl Iterator<Item = &Registration> {
        self.joined
            .iter()
            .filter_map(|id| self.conns.get(id)?.reg.as_ref())
    }

    fn joined_counts(&self) -> (u32, u32) {
        self.joined_regs().fold((0, 0), |(w, s), r| match r.role {
            Role::Worker => (w + 1, s),
            Role::Server => (w, s + 1),
        })
    }

    fn expected(&self, role: Role) -> u32 {
        match role {
            Role::Worker => self.expected_workers,
            Role::Server => self.expected_servers,
        }
    }

    fn node_name(&self, id: NodeId) -> String {
        match self.members.get(&id) {
            Some(m) => format!("{id} '{}'", m.name),
            None => id.to_string(),
        }
    }

    fn describe(&self, conn: ConnId) -> String {
        match self.conns.get(&conn) {
            Some(Conn { node: Some(id), .. }) => self.node_name(*id),
            Some(Conn { reg: Some(r), .. }) => format!("{} '{}'", r.role, r.name),
            Some(c) => format!("unregistered {} '{}'", c.peer.role, c.peer.name),
            None => format!("connection {conn}"),
        }
    }

    fn send(&mut self, conn: ConnId, msg: Message) {
        self.out.push(Action::Send(conn, msg));
    }

    fn log(&mut self, level: Level, line: String) {
        self.out.push(Action::Log(level, line));
    }

    fn take(&mut self) -> Vec<Action> {
        std::mem::take(&mut self.out)
    }
}

fn in_group(group: BarrierGroup, role: Role) -> bool {
    group == BarrierGroup::All || role == Role::Worker
}

fn group_index(group: BarrierGroup) -> usize {
    match group {
        BarrierGroup::Workers => 0,
        BarrierGroup::All => 1,
        BarrierGroup::Join => 2,
    }
}

fn group_name(group: BarrierGroup) -> &'static str {
    match group {
        BarrierGroup::Workers => "workers",
        BarrierGroup::All => "all-nodes",
        BarrierGroup::Join => "join",
    }
}

fn rank_text(rank: Option<u32>) -> String {
    rank.map_or_else(|| "any rank".into(), |r| format!("rank {r}"))
}

/// "a", "a and b", "a, b and c", "a, b, c and 2 more workers".
fn listing(mut names: Vec<String>, unnamed: usize) -> String {
    if unnamed > 0 {
        let plural = if unnamed == 1 { "" } else { "s" };
        names.push(format!("{unnamed} more worker{plural}"));
    }
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        Some((last, _)) => last.clone(),
        None => "nobody".into(),
    }
}

fn roster(nodes: &[NodeInfo]) -> String {
    let names: Vec<String> = nodes
        .iter()
        .map(|n| format!("{} '{}' on {}", n.rank, n.name, n.host_id))
        .collect();
    names.join(", ")
}

/// "1 worker and 2 servers", naming only the roles that are short.
fn missing_text(workers: u32, servers: u32) -> String {
    let count = |n: u32, what: &str| format!("{n} {what}{}", if n == 1 { "" } else { "s" });
    let mut parts = Vec::new();
    if workers > 0 {
        parts.push(count(workers, "worker"));
    }
    if servers > 0 {
        parts.push(count(servers, "server"));
    }
    parts.join(" and ")
}
