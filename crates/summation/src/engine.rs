//! An engine: a share of the server's keys and everything that reduces them.
//!
//! No engine touches another's keys (PHub's key assignment), and each is summed by one
//! thread at a time: the connection thread that brought a command carries it out under
//! the engine's lock (`Shared::engine`), run to completion. Handing pushes to engine
//! threads instead cost a wake per push on both sides of a queue, the most frequent
//! sleep of a server after the socket reads themselves (issue 22's CPU per byte).
//! A push that completes its round is reduced with the partial result, by the round's op
//! (sum, min, max or product: every push of a round must carry the same), in one pass
//! straight into the round's result (16-bit results are rounded once, there); an earlier
//! push is folded into the accumulator before its connection goes on, so it holds no
//! receive buffer or mailbox slot while other workers are awaited. Either way each pushed
//! byte is read once, and the first push of a round is never combined with an identity
//! element (zeros, ones): it is copied, or, where its bytes already have the
//! accumulator's layout and the accumulator's allocation is at least as large as the
//! receive buffer's, its receive buffer is adopted outright and the old buffer given to the pool (so pool buffers never shrink and never
//! need regrowing: see `pool.rs`). That holds for every op, since a lone term is its own
//! result. A round that every worker skipped (no push carried data) is zeros, whatever
//! its op.
//!
//! A compressed key whose payloads cannot be summed as they are (top-k, sign, dithering)
//! takes the same path, but each push is decoded and added into an f32 accumulator of
//! the key's full length, and the completed sum is compressed again with the key's codec,
//! keeping what that drops in the key's residual when the key asks for error feedback.
//! Compressed keys are only summed (the wire decoder refuses any other op on them).
//!
//! A key whose first push is a delta (asynchronous training, `deltas.rs`) keeps the
//! model's latest value instead: each delta is added to it at once, into a second buffer
//! (the first may still be on its way to a worker), and the pusher's pull gets the result.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use sumflow_compress::{Compressor, Scratch, Seed};
use sumflow_wire::{ErrorCode, Message, ReduceOp};

use crate::deltas::DeltaTracker;
use crate::directory::KeyMeta;
use crate::messages::{Command, JoinAck, Outgoing, PushData, Replier, StallReport};
use crate::metrics::EngineCounters;
use crate::rounds::{PullOutcome, RoundError, RoundTracker};
use sumflow_reduce::buffer::AlignedBuf;
use sumflow_reduce::Reducer;

struct KeyState {
    meta: KeyMeta,
    /// The codec payloads are decoded and re-encoded with, if they are not summed as is.
    decoder: Option<Compressor>,
    /// What re-encoding sums has dropped so far (error feedback); empty if not kept.
    residual: Vec<f32>,
    rounds: RoundTracker,
    acc: AlignedBuf,
    /// Whether `acc` holds a partial result of the current round.
    acc_live: bool,
    staged: Vec<PushData>,
    /// How the round now accumulating combines its pushes: set by its first push.
    round_op: Option<ReduceOp>,
    /// The last completed round's sum (round 0: the initial value).
    sum: Arc<AlignedBuf>,
    /// Pulls of the round now accumulating: the worker, and whether it wants the sum or
    /// only the notice that the round is complete.
    waiting: Vec<(u32, bool, Replier)>,
    /// Workers that retired the key (it stays until all of its workers have).
    retired: Vec<u32>,
    /// The round pulls last waited on, since when, and when its last stall notice went out.
    stalled: Option<(u64, Instant, Instant)>,
    /// Set by the key's first delta push: it then takes deltas only, and `sum` is its
    /// stored value.
    deltas: Option<DeltaTracker>,
    /// The stored value's previous buffer, once no writer sends it any more: the next
    /// delta is added into it.
    spare: Option<AlignedBuf>,
}

pub struct Engine {
    reducer: Reducer,
    scratch: Scratch,
    workers: u32,
    keys: HashMap<u64, KeyState>,
    gone: BTreeMap<u32, Arc<str>>,
    /// Workers that have joined: keys created meanwhile start with them joined.
    joined: BTreeSet<u32>,
    dirty: Vec<u64>,
    /// See `Settings::stall_warning`.
    stall_warning: Option<Duration>,
    /// Where the longest stall of each check goes (to the coordinator), if anywhere.
    stall_reports: Option<std::sync::mpsc::Sender<StallReport>>,
    /// Rounds summed and keys stalled, for metrics.
    counters: Arc<EngineCounters>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("keys", &self.keys.len())
            .field("workers", &self.workers)
            .finish_non_exhaustive()
    }
}

impl Engine {
    pub fn new(reducer: Reducer, workers: u32) -> Self {
        Engine {
            reducer,
            scratch: Scratch::default(),
            workers,
            keys: HashMap::new(),
            gone: BTreeMap::new(),
            joined: BTreeSet::new(),
            dirty: Vec::new(),
            stall_warning: None,
            stall_reports: None,
            counters: Arc::default(),
        }
    }

    /// Counts rounds and stalled keys into `counters` (read by metrics scrapes).
    pub fn with_counters(mut self, counters: Arc<EngineCounters>) -> Self {
        self.counters = counters;
        self
    }

    /// Tells the workers waiting on a round for longer than `warning` which workers have
    /// not pushed it (see [`Message::Stalled`]); `None`: never.
    pub fn with_stall_warning(mut self, warning: Option<Duration>) -> Self {
        self.stall_warning = warning;
        self
    }

    /// Also reports the longest stall of each check to `reports` (the server's coordinator
    /// link), so that the coordinator can name the stalled workers to the job's supervisor.
    pub fn with_stall_reports(mut self, reports: std::sync::mpsc::Sender<StallReport>) -> Self {
        self.stall_reports = Some(reports);
        self
    }

    /// Carries out `cmd` in the calling thread (the connection that brought it), then
    /// folds what it left staged, so no push holds a receive buffer or mailbox slot past
    /// the call (a connection whose buffers all waited on other workers would stop
    /// reading, and those workers' pushes could be waiting behind its own).
    pub fn apply(&mut self, cmd: Command) {
        self.handle(cmd);
        self.fold_staged();
    }

    /// Sends a stall notice to the pulls of every round that has kept them waiting for the
    /// stall warning since it was first seen waiting (or since its last notice).
    pub fn check_stalls(&mut self, now: Instant) {
        let Some(warning) = self.stall_warning else {
            return;
        };
        let mut longest: Option<StallReport> = None;
        let mut stalled = 0;
        for (&key, k) in &mut self.keys {
            if k.waiting.is_empty() {
                k.stalled = None;
                continue;
            }
            // A delta key's pulls wait for the workers its staleness bound leaves behind.
            let round = match &k.deltas {
                Some(d) => k
                    .waiting
                    .iter()
                    .map(|(w, _, _)| d.pulled(*w))
                    .min()
                    .unwrap_or(0),
                None => k.rounds.current(),
            };
            let (since, last) = match k.stalled {
                Some((r, since, last)) if r == round => (since, last),
                _ => {
                    k.stalled = Some((round, now, now));
                    continue;
                }
            };
            if now.duration_since(since) >= warning {
                stalled += 1;
            }
            if now.duration_since(last) < warning {
                continue;
            }
            let waited = now.duration_since(since);
            k.stalled = Some((round, since, now));
            let missing = match &k.deltas {
                Some(d) => d.lagging(round),
                None => k.rounds.missing(),
            };
            if missing.is_empty() {
                continue;
            }
            for (worker, _, reply) in &k.waiting {
                let msg = Message::Stalled {
                    key,
                    round: match &k.deltas {
                        Some(d) => d.pulled(*worker),
                        None => k.rounds.own_round(*worker, round),
                    },
                    waited_ms: waited.as_millis() as u64,
                    missing: missing.clone(),
                };
                let _ = reply.send(Outgoing::Message(msg));
            }
            if longest.as_ref().is_none_or(|l| waited > l.waited) {
                longest = Some(StallReport {
                    key,
                    round,
                    waited,
                    missing,
                });
            }
        }
        self.counters.stalled.store(stalled, Ordering::Relaxed);
        if let (Some(report), Some(to)) = (longest, &self.stall_reports) {
            let _ = to.send(report);
        }
    }

    fn handle(&mut self, cmd: Command) {
        match cmd {
            Command::Init { key, meta, initial } => self.init(key, meta, initial),
            Command::Push {
                key,
                round,
                worker,
                op,
                delta,
                data,
                reply,
            } => match delta {
                Some(staleness) => self.on_delta(key, round, (worker, staleness), data, &reply),
                None => {
                    self.on_push(key, round, (worker, op), data, &reply);
                }
            },
            Command::Skips {
                key,
                from,
                round,
                op,
                workers,
                reply,
            } => self.on_skips(key, (from, round), op, &workers, &reply),
            Command::Pull {
                key,
                round,
                worker,
                wants_sum,
                reply,
            } => self.on_pull(key, round, worker, wants_sum, reply),
            Command::Join {
                worker,
                joined,
                ack,
            } => self.on_join(worker, joined, &ack),
            Command::WorkerGone { worker, reason } => self.worker_gone(worker, reason),
            Command::Retire { key, worker, last } => self.retire(key, worker, last),
        }
    }

    /// `worker` retired `key`; with `last` every worker of it has, and the key is freed:
    /// its buffers, staged pushes and round state. Pulls still waiting then (or waiting
    /// for a round a retired worker never pushed) can never be answered, and fail.
    fn retire(&mut self, key: u64, worker: u32, last: bool) {
        let Some(k) = self.keys.get_mut(&key) else {
            return;
        };
        k.retired.push(worker);
        if last {
            let k = self.keys.remove(&key).expect("present");
            let why = format!("every worker of key {key} retired it");
            for (_, _, reply) in &k.waiting {
                fail_pull(key, k.rounds.current(), &why, reply);
            }
            return;
        }
        if k.deltas.is_some() {
            return fail_blocked_deltas(key, k, &self.gone);
        }
        if let Some(why) = retired_blocker(key, k, k.rounds.current()) {
            for (_, _, reply) in k.waiting.drain(..) {
                fail_pull(key, k.rounds.current(), &why, &reply);
            }
        }
    }

    /// Keys this engine holds now.
    #[cfg(test)]
    pub(crate) fn live_keys(&self) -> usize {
        self.keys.len()
    }

    fn init(&mut self, key: u64, meta: KeyMeta, initial: Option<AlignedBuf>) {
        let acc = AlignedBuf::zeroed(meta.acc_len() as usize);
        let decoder = meta.decoder();
        let sum = initial.unwrap_or_else(|| {
            let mut sum = AlignedBuf::zeroed(meta.payload_len() as usize);
            // Round 0's "sum" of a compressed key is the encoding of zeros.
            if let Some(c) = &decoder {
                let seed = Seed::new(key, 0, Seed::SERVER);
                c.compress(f32s(&acc), seed, &mut self.scratch, &mut sum);
            }
            sum
        });
        let residual = match decoder {
            Some(_) if meta.codec.feedback => vec![0.0; meta.elements() as usize],
            _ => Vec::new(),
        };
        let mut rounds = RoundTracker::new(self.workers, meta.members.clone());
        for &w in &self.joined {
            // A new key has no rounds: joining it cannot fail or complete anything.
            let _ = rounds.join(w);
        }
        self.keys.insert(
            key,
            KeyState {
                meta,
                decoder,
                residual,
                rounds,
                acc,
                acc_live: false,
                staged: Vec::new(),
                round_op: None,
                sum: Arc::new(sum),
                waiting: Vec::new(),
                retired: Vec::new(),
                stalled: None,
                deltas: None,
                spare: None,
            },
        );
    }

    /// A push of `worker`'s contribution to `round`, combined by `op`; `data` None: the
    /// worker skips the round, contributing nothing. Returns whether it was counted (else
    /// `reply` has the refusal).
    fn on_push(
        &mut self,
        key: u64,
        round: u64,
        (worker, op): (u32, ReduceOp),
        data: Option<PushData>,
        reply: &Replier,
    ) -> bool {
        let Some(k) = self.keys.get_mut(&key) else {
            unknown_key(key, reply);
            return false;
        };
        if k.deltas.is_some() {
            let why = format!(
                "worker {worker} pushed round {round} to be summed, but the key takes \
                 asynchronous deltas (its first push was one)"
            );
            refuse_op(key, why, reply);
            return false;
        }
        // A non-member's push is wrong whatever became of the members: refused first.
        if let Err(e) = k.rounds.admit(worker, "push", round) {
            refuse(key, e, reply);
            return false;
        }
        if let Some(why) = blocker(&self.gone, &k.rounds, k.rounds.key_round(worker, round)) {
            fail_pull(key, round, &why, reply);
            return false;
        }
        if let Some(why) = retired_blocker(key, k, round) {
            fail_pull(key, round, &why, reply);
            return false;
        }
        if let Some(first) = k.round_op.filter(|&first| first != op) {
            let why = format!(
                "worker {worker}'s push of round {round} reduces by {op}, but the round's \
                 earlier pushes by {first}"
            );
            refuse_op(key, why, reply);
            return false;
        }
        match k.rounds.push(worker, round) {
            // The payload is dropped unsummed: a refused push leaves no partial sum.
            Err(e) => {
                refuse(key, e, reply);
                return false;
            }
            Ok(true) => {
                k.staged.extend(data);
                k.round_op = Some(op);
                complete_round(&self.reducer, &mut self.scratch, key, k);
                self.counters.rounds.fetch_add(1, Ordering::Relaxed);
            }
            Ok(false) => {
                k.round_op = Some(op);
                if let Some(data) = data {
                    if k.staged.is_empty() {
                        self.dirty.push(key);
                    }
                    k.staged.push(data);
                }
            }
        }
        true
    }

    /// `workers` skip the round that is `from`'s own `round` (a push of nothing each) and
    /// take no notice of its end (a pull recorded that nobody waits for): `from`, of their
    /// machine, pushes their machine's sum. Stops at the first refused, which `reply`
    /// (`from`'s) hears of.
    fn on_skips(
        &mut self,
        key: u64,
        (from, round): (u32, u64),
        op: ReduceOp,
        workers: &[u32],
        reply: &Replier,
    ) {
        let Some(k) = self.keys.get(&key) else {
            return unknown_key(key, reply);
        };
        // A worker's own rounds lag the key's by those completed while it had joined.
        let key_round = k.rounds.key_round(from, round);
        // Checked for all first: a list naming a stranger counts none of them.
        if let Some(&w) = workers.iter().find(|&&w| !k.rounds.counts(w)) {
            let members = k.meta.members.as_deref().unwrap_or_default();
            let _ = reply.send(Outgoing::Fatal(Message::error(
                ErrorCode::BadRank,
                Some(key),
                format!(
                    "key {key}: skips of round {round} name worker {w}, but the key's rounds \
                     count only its members, workers {members:?}"
                ),
            )));
            return;
        }
        let rounds: Vec<u64> = workers
            .iter()
            .map(|&w| k.rounds.own_round(w, key_round))
            .collect();
        for (&worker, round) in workers.iter().zip(rounds) {
            if !self.on_push(key, round, (worker, op), None, reply) {
                return;
            }
            let k = self.keys.get_mut(&key).expect("the push found the key");
            if let Err(e) = k.rounds.pull(worker, round) {
                return refuse(key, e, reply);
            }
        }
    }

    /// An asynchronous delta of `worker`'s `round`: added to the key's stored value now.
    fn on_delta(
        &mut self,
        key: u64,
        round: u64,
        (worker, staleness): (u32, Option<u32>),
        data: Option<PushData>,
        reply: &Replier,
    ) {
        let Some(k) = self.keys.get_mut(&key) else {
            return unknown_key(key, reply);
        };
        let Some(data) = data else {
            let why = format!("worker {worker}'s delta of round {round} carries no elements");
            return refuse_op(key, why, reply);
        };
        if k.deltas.is_none() {
            if !k.rounds.is_fresh() {
                let why = format!(
                    "worker {worker} pushed a delta, but the key has synchronous rounds: a \
                     key takes either sums or deltas"
                );
                return refuse_op(key, why, reply);
            }
            let mut tracker = DeltaTracker::new(self.workers, k.meta.members.clone(), staleness);
            for &w in &self.joined {
                tracker.set_joined(w, true);
            }
            k.deltas = Some(tracker);
        }
        let deltas = k.deltas.as_mut().expect("set above");
        if deltas.staleness() != staleness {
            let why = format!(
                "worker {worker}'s delta of round {round} has staleness bound {}, but the \
                 key's first delta set {}",
                bound(staleness),
                bound(deltas.staleness())
            );
            return refuse_op(key, why, reply);
        }
        if let Err(e) = deltas.push(worker, round) {
            return refuse(key, e, reply);
        }
        let len = k.sum.len();
        let mut out = k
            .spare
            .take()
            .filter(|b| b.len() == len)
            .unwrap_or_else(|| AlignedBuf::zeroed(len));
        let srcs: [&[u8]; 2] = [&k.sum, &data];
        self.reducer
            .reduce_into(k.meta.dtype, ReduceOp::Sum, None, &srcs, &mut out);
        drop(data);
        let previous = std::mem::replace(&mut k.sum, Arc::new(out));
        k.spare = Arc::try_unwrap(previous).ok();
        self.counters.rounds.fetch_add(1, Ordering::Relaxed);
        release_deltas(key, k);
    }

    fn on_pull(&mut self, key: u64, round: u64, worker: u32, wants_sum: bool, reply: Replier) {
        let Some(k) = self.keys.get_mut(&key) else {
            return unknown_key(key, &reply);
        };
        if let Some(deltas) = &mut k.deltas {
            match deltas.pull(worker, round) {
                Err(e) => refuse(key, e, &reply),
                Ok(PullOutcome::Ready) => answer_delta(key, k, worker, wants_sum, &reply),
                Ok(PullOutcome::Wait) => match delta_blocker(&self.gone, &k.retired, deltas, round)
                {
                    Some(why) => fail_pull(key, round, &why, &reply),
                    None => k.waiting.push((worker, wants_sum, reply)),
                },
            }
            return;
        }
        if let Err(e) = k.rounds.admit(worker, "pull", round) {
            return refuse(key, e, &reply);
        }
        // A round that can no longer complete is reported as such, whatever else is
        // wrong with the pull: the departed worker is the news.
        if let Some(why) = blocker(&self.gone, &k.rounds, k.rounds.key_round(worker, round)) {
            return fail_pull(key, round, &why, &reply);
        }
        if let Some(why) = retired_blocker(key, k, round) {
            return fail_pull(key, round, &why, &reply);
        }
        match k.rounds.pull(worker, round) {
            Err(e) => refuse(key, e, &reply),
            Ok(PullOutcome::Ready) => answer(key, k, worker, wants_sum, &reply),
            Ok(PullOutcome::Wait) => k.waiting.push((worker, wants_sum, reply)),
        }
    }

    /// A worker joined (its rounds of every key complete without it, which may complete
    /// some now) or leaves join; acknowledged once every engine has applied it.
    fn on_join(&mut self, worker: u32, joined: bool, ack: &JoinAck) {
        if !joined {
            self.joined.remove(&worker);
            for k in self.keys.values_mut() {
                k.rounds.leave(worker);
                if let Some(deltas) = &mut k.deltas {
                    deltas.set_joined(worker, false);
                }
            }
            return ack.applied();
        }
        self.joined.insert(worker);
        for (&key, k) in &mut self.keys {
            if let Some(deltas) = &mut k.deltas {
                deltas.set_joined(worker, true);
                release_deltas(key, k);
                continue;
            }
            match k.rounds.join(worker) {
                Ok(false) => {}
                Ok(true) => {
                    complete_round(&self.reducer, &mut self.scratch, key, k);
                    self.counters.rounds.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) => refuse(key, e, ack.reply()),
            }
        }
        ack.applied();
    }

    fn worker_gone(&mut self, worker: u32, reason: Arc<str>) {
        self.gone.insert(worker, reason);
        for (key, k) in &mut self.keys {
            k.waiting.retain(|(w, _, _)| *w != worker);
            if k.waiting.is_empty() {
                continue;
            }
            if k.deltas.is_some() {
                fail_blocked_deltas(*key, k, &self.gone);
                continue;
            }
            if let Some(why) = blocker(&self.gone, &k.rounds, k.rounds.current()) {
                for (w, _, reply) in k.waiting.drain(..) {
                    let round = k.rounds.own_round(w, k.rounds.current());
                    fail_pull(*key, round, &why, &reply);
                }
            }
        }
    }

    fn fold_staged(&mut self) {
        for key in self.dirty.drain(..) {
            let Some(k) = self.keys.get_mut(&key) else {
                continue;
            };
            if k.staged.is_empty() {
                continue; // the round completed within the batch
            }
            if k.decoder.is_some() {
                decode_staged(&mut self.scratch, key, k);
                continue;
            }
            let same_width = k.meta.dtype.accumulator() == k.meta.dtype;
            // The round's first push becomes the accumulator: zero-copy (PHub), where the
            // pool's buffer can be traded for the accumulator's without shrinking.
            let adopted = !k.acc_live
                && k.staged.len() == 1
                && same_width
                && k.staged[0].try_swap_with(&mut k.acc);
            if !adopted {
                let op = k.round_op.expect("a staged push set its round's op");
                let srcs: Vec<&[u8]> = k.staged.iter().map(|b| &b[..]).collect();
                self.reducer
                    .accumulate(k.meta.dtype, op, &mut k.acc, !k.acc_live, &srcs);
            }
            k.acc_live = true;
            k.staged.clear();
        }
    }
}

/// Adds a compressed key's staged pushes, decoded, to its f32 accumulator.
fn decode_staged(scratch: &mut Scratch, key: u64, k: &mut KeyState) {
    let decoder = k.decoder.expect("a decoded key");
    let acc = f32s_mut(&mut k.acc);
    if !k.acc_live {
        acc.fill(0.0);
    }
    // Only random-k draws from the seed, and its keys are summed as they are.
    let seed = Seed::new(key, k.rounds.current(), Seed::SERVER);
    for push in k.staged.drain(..) {
        decoder.decompress_add(&push, seed, scratch, acc);
    }
    k.acc_live = true;
}

/// Forms the completed round's result in one pass and answers the pulls waiting for it.
fn complete_round(reducer: &Reducer, scratch: &mut Scratch, key: u64, k: &mut KeyState) {
    let previous = std::mem::replace(&mut k.sum, Arc::new(AlignedBuf::zeroed(0)));
    // Every worker pulled the previous sum before pushing this round, so it is ours to
    // reuse unless a connection writer is still sending it.
    let mut out = Arc::try_unwrap(previous)
        .unwrap_or_else(|_| AlignedBuf::zeroed(k.meta.payload_len() as usize));
    if let Some(decoder) = k.decoder {
        decode_staged(scratch, key, k);
        let seed = Seed::new(key, k.rounds.completed(), Seed::SERVER);
        let sum = f32s(&k.acc);
        if k.residual.is_empty() {
            decoder.compress(sum, seed, scratch, &mut out);
        } else {
            decoder.compress_with_feedback(sum, &mut k.residual, seed, scratch, &mut out);
        }
        k.acc_live = false;
        finish_round(key, k, out);
        return;
    }
    // A round of one push (a single-worker job, or the only worker that did not skip) is
    // its own result, whatever the op: adopt it, no copy, where the pool's buffer can be
    // traded for the result's without shrinking.
    let adopted = !k.acc_live && k.staged.len() == 1 && k.staged[0].try_swap_with(&mut out);
    if !k.acc_live && k.staged.is_empty() {
        // Every worker skipped the round: its result is zeros, whatever the op.
        out.fill(0);
    } else if !adopted {
        let op = k.round_op.expect("the round's pushes set its op");
        let srcs: Vec<&[u8]> = k.staged.iter().map(|b| &b[..]).collect();
        let acc = k.acc_live.then_some(&k.acc[..]);
        reducer.reduce_into(k.meta.dtype, op, acc, &srcs, &mut out);
    }
    k.staged.clear();
    k.acc_live = false;
    finish_round(key, k, out);
}

/// Makes `out` the completed round's result and answers the pulls waiting for it.
fn finish_round(key: u64, k: &mut KeyState, out: AlignedBuf) {
    k.round_op = None;
    k.sum = Arc::new(out);
    for (worker, wants_sum, reply) in std::mem::take(&mut k.waiting) {
        answer(key, k, worker, wants_sum, &reply);
    }
}

/// Answers `worker`'s pull of the last completed round, in the worker's own numbering:
/// its sum, or only the notice.
fn answer(key: u64, k: &KeyState, worker: u32, wants_sum: bool, reply: &Replier) {
    let round = k.rounds.own_round(worker, k.rounds.completed());
    if wants_sum {
        return send_sum(key, k, round, reply);
    }
    let _ = reply.send(Outgoing::Message(Message::PullReply {
        key,
        round,
        dtype: k.meta.dtype,
        codec: k.meta.codec.codec,
    }));
}

fn send_sum(key: u64, k: &KeyState, round: u64, reply: &Replier) {
    let _ = reply.send(Outgoing::Sum {
        key,
        round,
        dtype: k.meta.dtype,
        codec: k.meta.codec.codec,
        data: Arc::clone(&k.sum),
    });
}

/// Answers the pulls of a delta key that its staleness bound now lets through.
fn release_deltas(key: u64, k: &mut KeyState) {
    let Some(deltas) = &k.deltas else { return };
    if k.waiting.is_empty() {
        return;
    }
    let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut k.waiting)
        .into_iter()
        .partition(|(w, _, _)| deltas.released(deltas.pulled(*w)));
    k.waiting = waiting;
    for (worker, wants_sum, reply) in ready {
        answer_delta(key, k, worker, wants_sum, &reply);
    }
}

/// Answers `worker`'s pull of a delta key: the stored value, or only the notice.
fn answer_delta(key: u64, k: &KeyState, worker: u32, wants_sum: bool, reply: &Replier) {
    let round = k.deltas.as_ref().map_or(0, |d| d.pulled(worker));
    if wants_sum {
        return send_sum(key, k, round, reply);
    }
    let _ = reply.send(Outgoing::Message(Message::PullReply {
        key,
        round,
        dtype: k.meta.dtype,
        codec: k.meta.codec.codec,
    }));
}

/// Names the departed or retired workers a delta key's pull of `round` waits for, which
/// then never comes, if any.
fn delta_blocker(
    gone: &BTreeMap<u32, Arc<str>>,
    retired: &[u32],
    deltas: &DeltaTracker,
    round: u64,
) -> Option<String> {
    let lagging = deltas.lagging(round);
    let mut why: Vec<String> = gone
        .iter()
        .filter(|(w, _)| lagging.contains(w))
        .map(|(_, reason)| reason.to_string())
        .collect();
    let retired: Vec<u32> = lagging
        .iter()
        .copied()
        .filter(|w| retired.contains(w))
        .collect();
    if !retired.is_empty() {
        why.push(format!(
            "worker(s) {retired:?} retired the key more than {} round(s) behind",
            bound(deltas.staleness())
        ));
    }
    (!why.is_empty()).then(|| why.join("; "))
}

/// Fails the waiting pulls of a delta key whose staleness bound waits for a worker that
/// has gone or retired the key.
fn fail_blocked_deltas(key: u64, k: &mut KeyState, gone: &BTreeMap<u32, Arc<str>>) {
    let Some(deltas) = &k.deltas else { return };
    let mut waiting = Vec::new();
    for (worker, wants_sum, reply) in std::mem::take(&mut k.waiting) {
        let round = deltas.pulled(worker);
        match delta_blocker(gone, &k.retired, deltas, round) {
            Some(why) => fail_pull(key, round, &why, &reply),
            None => waiting.push((worker, wants_sum, reply)),
        }
    }
    k.waiting = waiting;
}

/// A staleness bound for messages.
fn bound(staleness: Option<u32>) -> String {
    staleness.map_or_else(|| "none".to_string(), |s| s.to_string())
}

/// An accumulator's bytes as f32s (accumulators are page-aligned, whole elements).
fn f32s(buf: &[u8]) -> &[f32] {
    bytemuck::cast_slice(buf)
}

fn f32s_mut(buf: &mut [u8]) -> &mut [f32] {
    bytemuck::cast_slice_mut(buf)
}

/// Names the departed workers that keep `round` from ever completing, if any: members of
/// the key that had not pushed it (a worker that is not a member blocks nothing).
fn blocker(gone: &BTreeMap<u32, Arc<str>>, rounds: &RoundTracker, round: u64) -> Option<String> {
    if round <= rounds.completed() {
        return None;
    }
    let missing: Vec<String> = gone
        .iter()
        .filter(|(w, _)| rounds.counts(**w) && !rounds.has_pushed(**w, round))
        .map(|(_, reason)| reason.to_string())
        .collect();
    (!missing.is_empty()).then(|| missing.join("; "))
}

/// Names the workers that retired `key` without pushing `round`, which can then never
/// complete, if any.
fn retired_blocker(key: u64, k: &KeyState, round: u64) -> Option<String> {
    if k.retired.is_empty() || round <= k.rounds.completed() {
        return None;
    }
    let missing: Vec<u32> = k
        .retired
        .iter()
        .copied()
        .filter(|w| !k.rounds.has_pushed(*w, round))
        .collect();
    (!missing.is_empty())
        .then(|| format!("worker(s) {missing:?} retired key {key} without pushing round {round}"))
}

/// Tells a worker its round can never complete; its connection stays open.
fn fail_pull(key: u64, round: u64, why: &str, reply: &Replier) {
    let _ = reply.send(Outgoing::Message(Message::error(
        ErrorCode::NodeFailed,
        Some(key),
        format!("round {round} of key {key} cannot complete: {why}"),
    )));
}

fn refuse(key: u64, e: RoundError, reply: &Replier) {
    let code = match e {
        RoundError::DuplicatePush { .. } => ErrorCode::DuplicatePush,
        RoundError::DuplicatePull { .. } => ErrorCode::DuplicatePull,
        RoundError::OutOfSequence { .. }
        | RoundError::Joined { .. }
        | RoundError::JoinedMidRound { .. } => ErrorCode::RoundOutOfSequence,
        // A rank outside the key's members, as BadRank is one outside the job's.
        RoundError::NotMember { .. } => ErrorCode::BadRank,
    };
    let _ = reply.send(Outgoing::Fatal(Message::error(
        code,
        Some(key),
        format!("key {key}: {e}"),
    )));
}

/// Refuses a push whose reduction differs from its round's earlier pushes: the workers
/// disagree about the key's round, as they would about its dtype or length. Nothing of
/// the push is counted, and the connection stays open.
fn refuse_op(key: u64, why: String, reply: &Replier) {
    let _ = reply.send(Outgoing::Message(Message::error(
        ErrorCode::KeyMismatch,
        Some(key),
        format!("key {key}: {why}"),
    )));
}

fn unknown_key(key: u64, reply: &Replier) {
    let _ = reply.send(Outgoing::Fatal(Message::error(
        ErrorCode::UnknownKey,
        Some(key),
        format!("key {key} is not initialised on this server"),
    )));
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use crate::channel::Receiver;
    use crate::messages::replier;
    use sumflow_wire::Dtype;

    use super::*;
    use crate::pool::BufferPool;

    fn meta(dtype: Dtype, elements: u64) -> KeyMeta {
        KeyMeta {
            dtype,
            byte_len: elements * dtype.size() as u64,
            codec: sumflow_wire::KeyCodec::RAW,
            members: None,
            engine: 0,
            declared_by: 0,
        }
    }

    /// A pooled buffer holding `bytes`, as a connection's reader would hand it over.
    fn pooled(pool: &BufferPool, bytes: &[u8]) -> PushData {
        let mut b = pool
            .take(bytes.len(), Duration::from_millis(1), || false)
            .unwrap();
        b.copy_from_slice(bytes);
        b.into()
    }

    fn data(pool: &BufferPool, vals: &[i32]) -> PushData {
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        pooled(pool, &bytes)
    }

    fn sum_of(rx: &Receiver<Outgoing>) -> Vec<i32> {
        match rx.try_recv().expect("a reply") {
            Outgoing::Sum { data, .. } => data
                .chunks(4)
                .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            Outgoing::Message(m) | Outgoing::Fatal(m) => panic!("expected a sum, got {m:?}"),
            Outgoing::Close | Outgoing::Flush => panic!("expected a sum, got Close or Flush"),
        }
    }

    impl Engine {
        fn push(&mut self, key: u64, round: u64, worker: u32, data: PushData, reply: &Replier) {
            self.on_push(key, round, (worker, ReduceOp::Sum), Some(data), reply);
        }

        fn pull(&mut self, key: u64, round: u64, worker: u32, reply: Replier) {
            self.on_pull(key, round, worker, true, reply);
        }
    }

    fn engine(workers: u32) -> Engine {
        let mut e = Engine::new(Reducer::detect(), workers);
        e.init(1, meta(Dtype::I32, 3), None);
        e
    }

    /// The next reply, which must be a notice: a `PullReply` without payload.
    fn notice_of(rx: &Receiver<Outgoing>) -> u64 {
        match rx.try_recv().expect("a reply") {
            Outgoing::Message(Message::PullReply { round, .. }) => round,
            Outgoing::Sum { round, .. } => panic!("expected a notice, got round {round}'s sum"),
            Outgoing::Message(m) | Outgoing::Fatal(m) => panic!("expected a notice, got {m:?}"),
            Outgoing::Close | Outgoing::Flush => panic!("expected a notice, got Close or Flush"),
        }
    }

    /// A push lent in a worker's mailbox is summed where it lies (never swapped in as the
    /// key's buffer: it is the worker's memory), and its slot is freed once summed.
    #[test]
    fn a_lent_push_is_summed_in_place_and_its_slot_comes_back() {
        use sumflow_client::mailbox::{Mailbox, Side};
        let pool = BufferPool::new(2);
        let (tx, rx) = replier();
        let n = 2048;
        for lent_first in [true, false] {
            let mut e = Engine::new(Reducer::detect(), 2);
            e.init(1, meta(Dtype::I32, n as u64), None);
            let (worker, fd) = Mailbox::create(1, 1, 8192).unwrap();
            let server = Arc::new(Mailbox::adopt(fd, 1, 1, 8192).unwrap());
            let mut cursor = 0;
            let vals: Vec<i32> = (0..n).collect();
            let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
            let lent = worker.lend(Side::Push, &mut cursor, &bytes).unwrap();
            let lent = PushData::Lent(server.take(Side::Push, lent).unwrap());
            let pooled = data(&pool, &vec![10; n as usize]);
            let (first, second) = if lent_first {
                (lent, pooled)
            } else {
                (pooled, lent)
            };
            e.push(1, 1, 0, first, &tx);
            e.fold_staged();
            e.push(1, 1, 1, second, &tx);
            e.pull(1, 1, 0, tx.clone());
            let want: Vec<i32> = vals.iter().map(|v| v + 10).collect();
            assert_eq!(sum_of(&rx), want, "lent first: {lent_first}");
            assert!(
                worker.lend(Side::Push, &mut cursor, &bytes).is_some(),
                "the slot is the worker's again once summed"
            );
        }
    }

    #[test]
    fn a_round_waiting_past_the_stall_warning_names_the_workers_that_have_not_pushed() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let warning = Duration::from_secs(60);
        let (to_coordinator, reports) = std::sync::mpsc::channel();
        let mut e = engine(3)
            .with_stall_warning(Some(warning))
            .with_stall_reports(to_coordinator);
        e.push(1, 1, 1, data(&pool, &[1, 2, 3]), &tx);
        e.pull(1, 1, 1, tx.clone());
        let seen = Instant::now();
        e.check_stalls(seen);
        e.check_stalls(seen + warning / 2);
        assert!(rx.try_recv().is_err(), "no notice before the warning");
        e.check_stalls(seen + warning);
        match rx.try_recv() {
            Ok(Outgoing::Message(Message::Stalled {
                key: 1,
                round: 1,
                waited_ms: 60_000,
                missing,
            })) => assert_eq!(missing, vec![0, 2]),
            Ok(Outgoing::Message(m)) => panic!("expected a stall notice, got {m:?}"),
            _ => panic!("expected a stall notice"),
        }
        let report = StallReport {
            key: 1,
            round: 1,
            waited: warning,
            missing: vec![0, 2],
        };
        assert_eq!(reports.try_iter().collect::<Vec<_>>(), [report]);
        // Again only after another stretch, saying how long in all; none once the round
        // completes.
        e.check_stalls(seen + warning + warning / 2);
        assert!(rx.try_recv().is_err(), "a second notice within the warning");
        e.check_stalls(seen + 2 * warning);
        assert!(matches!(
            rx.try_recv(),
            Ok(Outgoing::Message(Message::Stalled {
                waited_ms: 120_000,
                ..
            }))
        ));
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.push(1, 1, 2, data(&pool, &[1, 1, 1]), &tx);
        e.fold_staged();
        assert_eq!(sum_of(&rx), vec![3, 4, 5]);
        e.check_stalls(seen + 3 * warning);
        assert!(rx.try_recv().is_err(), "a completed round is no stall");
        assert_eq!(
            reports.try_iter().count(),
            1,
            "the second stretch's report only"
        );
    }

    #[test]
    fn only_the_longest_stall_of_a_check_goes_to_the_coordinator() {
        let pool = BufferPool::new(8);
        let (tx, _rx) = replier();
        let warning = Duration::from_secs(60);
        let (to_coordinator, reports) = std::sync::mpsc::channel();
        let mut e = engine(2)
            .with_stall_warning(Some(warning))
            .with_stall_reports(to_coordinator);
        let seen = Instant::now();
        e.push(1, 1, 1, data(&pool, &[1]), &tx);
        e.pull(1, 1, 1, tx.clone());
        e.check_stalls(seen);
        e.push(2, 1, 0, data(&pool, &[1]), &tx);
        e.pull(2, 1, 0, tx.clone());
        e.check_stalls(seen + warning / 2);
        e.check_stalls(seen + 2 * warning);
        let sent: Vec<(u64, Vec<u32>)> = reports.try_iter().map(|r| (r.key, r.missing)).collect();
        assert_eq!(sent, [(1, vec![0])], "key 2 waited less");
    }

    #[test]
    fn skipping_workers_add_nothing_and_notices_carry_no_sum() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        let skip = (1, ReduceOp::Sum);
        // Round 1: one worker holds the bytes, the others skip; it takes only the notice.
        e.on_push(1, 1, (0, ReduceOp::Sum), Some(data(&pool, &[1, 2, 3])), &tx);
        e.on_pull(1, 1, 0, false, tx.clone());
        assert!(rx.try_recv().is_err(), "the round is not complete yet");
        e.on_push(1, 1, skip, None, &tx);
        e.on_push(1, 1, (2, ReduceOp::Sum), None, &tx);
        assert_eq!(notice_of(&rx), 1);
        e.on_pull(1, 1, 1, true, tx.clone());
        assert_eq!(sum_of(&rx), vec![1, 2, 3]);
        e.on_pull(1, 1, 2, true, tx.clone());
        assert_eq!(sum_of(&rx), vec![1, 2, 3]);
        // Round 2: a skip first, then data folded at the end of a batch, then a skip.
        e.on_push(1, 2, skip, None, &tx);
        e.on_push(1, 2, (2, ReduceOp::Sum), Some(data(&pool, &[5, 5, 5])), &tx);
        e.fold_staged();
        e.on_push(1, 2, (0, ReduceOp::Sum), None, &tx);
        for w in 0..3 {
            e.on_pull(1, 2, w, true, tx.clone());
            assert_eq!(sum_of(&rx), vec![5, 5, 5]);
        }
        // Round 3: everyone skips, and the round sums to zeros.
        for w in 0..3 {
            e.on_push(1, 3, (w, ReduceOp::Sum), None, &tx);
        }
        e.on_pull(1, 3, 0, true, tx.clone());
        assert_eq!(sum_of(&rx), vec![0, 0, 0]);
    }

    /// Machines of several workers (BytePS §4.2.2): the member that carries a partition
    /// pushes the machine's sum and its `Skips` stand for the others, who send nothing.
    #[test]
    fn skips_sent_for_a_machine_count_as_its_members_push_and_pull() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        // Two machines of two workers: 0 and 1, 2 and 3.
        let mut e = engine(4);
        for round in 1..=3 {
            // Who carries the partition may change from round to round.
            let (a, b) = if round == 2 { (1, 0) } else { (0, 1) };
            e.on_push(
                1,
                round,
                (a, ReduceOp::Sum),
                Some(data(&pool, &[1, 2, 3])),
                &tx,
            );
            e.on_skips(1, (a, round), ReduceOp::Sum, &[b], &tx);
            e.on_pull(1, round, a, true, tx.clone());
            assert!(
                rx.try_recv().is_err(),
                "round {round}: machine 2 has not pushed"
            );
            e.on_skips(1, (3, round), ReduceOp::Sum, &[2], &tx);
            e.on_push(
                1,
                round,
                (3, ReduceOp::Sum),
                Some(data(&pool, &[10; 3])),
                &tx,
            );
            e.fold_staged();
            assert_eq!(sum_of(&rx), vec![11, 12, 13], "round {round}");
            e.on_pull(1, round, 3, true, tx.clone());
            assert_eq!(sum_of(&rx), vec![11, 12, 13], "round {round}");
            assert!(
                rx.try_recv().is_err(),
                "round {round}: skipped workers get no notice"
            );
        }
        // A skipped worker has pushed and pulled its round: skipping it again is a
        // duplicate, and its own push must be of the next round.
        e.on_skips(1, (0, 3), ReduceOp::Sum, &[1], &tx);
        assert_eq!(error(&rx).1.code, ErrorCode::DuplicatePush);
        e.on_push(1, 4, (1, ReduceOp::Sum), None, &tx);
        assert!(
            rx.try_recv().is_err(),
            "worker 1's own skip of round 4 is in sequence"
        );
        // Skips are pushes: of the round's op, by members only.
        e.on_skips(1, (1, 4), ReduceOp::Max, &[0], &tx);
        assert_eq!(error(&rx).1.code, ErrorCode::KeyMismatch);
        let mut m = Engine::new(Reducer::detect(), 4);
        let mut key = meta(Dtype::I32, 3);
        key.members = Some(Arc::from([0, 1]));
        m.init(1, key, None);
        m.on_skips(1, (0, 1), ReduceOp::Sum, &[1, 2], &tx);
        let (fatal, err) = error(&rx);
        assert!(fatal, "{err:?}");
        assert_eq!(err.code, ErrorCode::BadRank);
        assert!(err.message.contains("name worker 2"), "{}", err.message);
        // None of the list was counted: worker 1's skip of round 1 is still to come.
        m.on_skips(1, (0, 1), ReduceOp::Sum, &[1], &tx);
        assert!(
            rx.try_recv().is_err(),
            "worker 1 had not skipped round 1 before"
        );
    }

    #[test]
    fn a_round_takes_one_reduction() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        e.on_push(1, 1, (0, ReduceOp::Sum), Some(data(&pool, &[1, 2, 3])), &tx);
        // A push of another op is refused, data or skip, folded partial result or not.
        e.on_push(1, 1, (1, ReduceOp::Max), Some(data(&pool, &[1, 2, 3])), &tx);
        e.fold_staged();
        e.on_push(1, 1, (2, ReduceOp::Product), None, &tx);
        for _ in 0..2 {
            let (fatal, err) = error(&rx);
            assert!(!fatal, "the connection stays open");
            assert_eq!((err.code, err.key), (ErrorCode::KeyMismatch, Some(1)));
            assert!(
                err.message.contains("by max") || err.message.contains("by product"),
                "{}",
                err.message
            );
            assert!(
                err.message.contains("earlier pushes by sum"),
                "{}",
                err.message
            );
        }
        // The refused pushes were not counted: the workers may push the round again.
        e.on_push(1, 1, (1, ReduceOp::Sum), Some(data(&pool, &[1, 1, 1])), &tx);
        e.on_push(1, 1, (2, ReduceOp::Sum), None, &tx);
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![2, 3, 4]);
        for w in [0, 2] {
            e.pull(1, 1, w, tx.clone());
            assert_eq!(sum_of(&rx), vec![2, 3, 4]);
        }
        // The next round may take another op, which its first push sets.
        e.on_push(1, 2, (2, ReduceOp::Max), Some(data(&pool, &[1, 7, 3])), &tx);
        e.on_push(1, 2, (0, ReduceOp::Sum), Some(data(&pool, &[9, 9, 9])), &tx);
        assert_eq!(error(&rx).1.code, ErrorCode::KeyMismatch);
        e.on_push(1, 2, (0, ReduceOp::Max), Some(data(&pool, &[5, 5, 5])), &tx);
        e.on_push(1, 2, (1, ReduceOp::Max), Some(data(&pool, &[4, 4, 4])), &tx);
        e.pull(1, 2, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![5, 7, 5]);
    }

    /// A pooled buffer holding `vals` as f16 bits.
    fn halves(pool: &BufferPool, vals: &[u16]) -> PushData {
        let bytes: Vec<u8> = vals.iter().flat_map(|v| v.to_le_bytes()).collect();
        pooled(pool, &bytes)
    }

    fn f16_bits(v: f32) -> u16 {
        half::f16::from_f32(v).to_bits()
    }

    fn result_bytes(rx: &Receiver<Outgoing>) -> Arc<AlignedBuf> {
        match rx.try_recv().expect("a reply") {
            Outgoing::Sum { data, .. } => data,
            Outgoing::Message(m) | Outgoing::Fatal(m) => panic!("expected a result, got {m:?}"),
            Outgoing::Close | Outgoing::Flush => panic!("expected a result, got Close or Flush"),
        }
    }

    /// How a round's three pushes reach the reducer: which are folded at the end of a
    /// batch (in groups) before the last ones complete the round.
    const SCHEDULES: [&[usize]; 4] = [
        &[],     // all three staged: one reduce_into of 3 sources
        &[1],    // the first folded alone (an i32 key adopts it), then acc + 2 sources
        &[2],    // the first two folded together (a fresh accumulate), then acc + 1
        &[1, 1], // the first adopted, the second folded into it, the third completes
    ];

    /// Runs one round of key 2 with `pushes` by workers 0, 1, 2 under `schedule`, checks
    /// that the first push is adopted as the accumulator where it can be, and returns the
    /// round's result after every worker has pulled it.
    fn run_round(
        e: &mut Engine,
        round: u64,
        op: ReduceOp,
        pushes: [PushData; 3],
        schedule: &[usize],
    ) -> Arc<AlignedBuf> {
        let (tx, rx) = replier();
        let adoptable = e.keys[&2].meta.dtype.accumulator() == e.keys[&2].meta.dtype;
        let mut pushes = pushes.into_iter().enumerate();
        for (g, &group) in schedule.iter().enumerate() {
            let first = g == 0 && group == 1;
            let mut ptr = std::ptr::null();
            for (w, data) in pushes.by_ref().take(group) {
                ptr = data.as_ptr();
                e.on_push(2, round, (w as u32, op), Some(data), &tx);
            }
            e.fold_staged();
            if first && adoptable {
                assert_eq!(
                    e.keys[&2].acc.as_ptr(),
                    ptr,
                    "{op}: the first push is adopted"
                );
            }
        }
        for (w, data) in pushes {
            e.on_push(2, round, (w as u32, op), Some(data), &tx);
        }
        let sum = (0..3)
            .map(|w| {
                e.pull(2, round, w, tx.clone());
                result_bytes(&rx)
            })
            .collect::<Vec<_>>();
        assert!(sum.iter().all(|s| Arc::ptr_eq(s, &sum[0])));
        assert!(rx.try_recv().is_err(), "no other reply");
        sum[0].clone()
    }

    fn i32s(bytes: &[u8]) -> Vec<i32> {
        bytes
            .chunks(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    #[test]
    fn min_max_and_product_rounds_of_i32() {
        let pool = BufferPool::new(8);
        let mut e = engine(3);
        e.init(2, meta(Dtype::I32, 5), None);
        let vals = [
            [3, -7, i32::MAX, 0, i32::MIN],
            [-2, 5, 2, 4, -1],
            [10, -7, 1, -1, 1],
        ];
        let want = |op| match op {
            ReduceOp::Min => vec![-2, -7, 1, -1, i32::MIN],
            ReduceOp::Max => vec![10, 5, i32::MAX, 4, 1],
            // Products wrap as sums do: MAX * 2 is -2, and MIN * -1 is MIN.
            ReduceOp::Product => vec![-60, 245, -2, 0, i32::MIN],
            ReduceOp::Sum => unreachable!(),
        };
        let mut round = 0;
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Product] {
            for schedule in SCHEDULES {
                round += 1;
                let pushes = vals.map(|v| data(&pool, &v));
                let got = run_round(&mut e, round, op, pushes, schedule);
                assert_eq!(i32s(&got), want(op), "{op} {schedule:?}");
            }
        }
    }

    #[test]
    fn min_max_and_product_rounds_of_f16_form_in_f32() {
        let pool = BufferPool::new(8);
        let mut e = engine(3);
        e.init(2, meta(Dtype::F16, 5), None);
        let (nan, inf) = (0x7E01u16, f16_bits(f32::INFINITY));
        let vals = [
            [
                f16_bits(256.0),
                f16_bits(-0.0),
                nan,
                f16_bits(-65504.0),
                0x0000,
            ],
            [
                f16_bits(256.0),
                f16_bits(0.0),
                f16_bits(1.0),
                f16_bits(3.5),
                0x8000,
            ],
            [
                f16_bits(1.0 / 256.0),
                f16_bits(1.0),
                f16_bits(2.0),
                inf,
                f16_bits(-1.0),
            ],
        ];
        let want = |op| match op {
            // NaN gives the canonical quiet NaN; -0.0 < +0.0.
            ReduceOp::Min => [
                f16_bits(1.0 / 256.0),
                0x8000,
                0x7E00,
                f16_bits(-65504.0),
                0xBC00,
            ],
            ReduceOp::Max => [f16_bits(256.0), f16_bits(1.0), 0x7E00, inf, 0x0000],
            // 256 * 256 = 65536 overflows f16 but not the f32 partial product.
            ReduceOp::Product => [f16_bits(256.0), 0x8000, nan, 0xFC00, 0x0000],
            ReduceOp::Sum => unreachable!(),
        };
        let mut round = 0;
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Product] {
            for schedule in SCHEDULES {
                round += 1;
                let pushes = vals.map(|v| halves(&pool, &v));
                let got = run_round(&mut e, round, op, pushes, schedule);
                let got: Vec<u16> = got
                    .chunks(2)
                    .map(|c| u16::from_le_bytes([c[0], c[1]]))
                    .collect();
                for (i, (&g, w)) in got.iter().zip(want(op)).enumerate() {
                    // A product's NaN is any NaN (payloads are not promised).
                    let nan_ok = op == ReduceOp::Product && w == nan && g & 0x7FFF > 0x7C00;
                    assert!(
                        g == w || nan_ok,
                        "{op} {schedule:?} [{i}]: {g:#06x} != {w:#06x}"
                    );
                }
            }
        }
    }

    #[test]
    fn a_lone_contribution_is_the_result_and_nobody_s_is_zeros_whatever_the_op() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        e.init(2, meta(Dtype::F16, 3), None);
        let mut round = 0;
        for op in [ReduceOp::Min, ReduceOp::Max, ReduceOp::Product] {
            // One worker holds the bytes (adopted as the result where the pool allows);
            // the others skip: the result is that push, as it came.
            round += 1;
            let bits = [0x7E01, 0x8000, f16_bits(0.5)];
            let push = halves(&pool, &bits);
            let ptr = push.as_ptr();
            e.on_push(2, round, (0, op), None, &tx);
            e.on_push(2, round, (1, op), Some(push), &tx);
            e.on_push(2, round, (2, op), None, &tx);
            for w in 0..3 {
                e.pull(2, round, w, tx.clone());
                let got = result_bytes(&rx);
                assert_eq!(got.as_ptr(), ptr, "{op}: the lone push is adopted");
                assert_eq!(&got[..], &halves(&pool, &bits)[..], "{op}");
            }
            // Every worker skips: zeros, not the op's identity.
            round += 1;
            for w in 0..3 {
                e.on_push(2, round, (w, op), None, &tx);
            }
            for w in 0..3 {
                e.pull(2, round, w, tx.clone());
                assert_eq!(&result_bytes(&rx)[..], &[0; 6], "{op}");
            }
        }
    }

    #[test]
    fn a_refused_push_leaves_no_partial_sum() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(2);
        e.push(1, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.push(1, 1, 0, data(&pool, &[100, 100, 100]), &tx); // duplicate: refused
        assert!(matches!(rx.try_recv(), Ok(Outgoing::Fatal(_))));
        e.fold_staged();
        e.push(1, 1, 1, data(&pool, &[10, 20, 30]), &tx);
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![11, 22, 33]);
    }

    #[test]
    fn staged_and_folded_pushes_sum_alike() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(4);
        // Two pushes folded at a batch end, two staged and reduced at completion.
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.push(1, 1, 1, data(&pool, &[2, 2, 2]), &tx);
        e.fold_staged();
        e.push(1, 1, 2, data(&pool, &[3, 3, 3]), &tx);
        e.pull(1, 1, 0, tx.clone());
        assert!(rx.try_recv().is_err(), "round 1 is not complete yet");
        e.push(1, 1, 3, data(&pool, &[4, 4, -4]), &tx);
        assert_eq!(sum_of(&rx), vec![10, 10, 2]);
        // Next round starts fresh: no trace of round 1 in the accumulator.
        for w in 1..4 {
            e.pull(1, 1, w, tx.clone());
            assert_eq!(sum_of(&rx), vec![10, 10, 2]);
        }
        for w in 0..4 {
            e.push(1, 2, w, data(&pool, &[w as i32, 0, 0]), &tx);
        }
        e.pull(1, 2, 2, tx.clone());
        assert_eq!(sum_of(&rx), vec![6, 0, 0]);
    }

    #[test]
    fn small_keys_copy_rather_than_shrink_pool_buffers() {
        let pool = BufferPool::new(1);
        let (tx, rx) = replier();
        let mut e = engine(2);
        e.init(2, meta(Dtype::I32, 2048), None);
        let big: Vec<i32> = (0..2048).collect();
        let home = |pool: &BufferPool| {
            let b = pool.take(0, Duration::from_millis(1), || false).unwrap();
            b.as_ptr()
        };
        e.push(2, 1, 0, data(&pool, &big), &tx);
        e.fold_staged(); // adopted: the pool now holds key 2's old accumulator
        let pooled = home(&pool);
        e.push(1, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.fold_staged(); // copied: key 1's one-page accumulator stays with key 1
        assert_eq!(home(&pool), pooled, "the pool kept its two-page buffer");
        e.push(1, 1, 1, data(&pool, &[10, 20, 30]), &tx);
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![11, 22, 33]);
        e.push(2, 1, 1, data(&pool, &big), &tx);
        e.pull(2, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), big.iter().map(|v| 2 * v).collect::<Vec<_>>());
    }

    fn compressed(codec: sumflow_wire::Codec, param: u32, feedback: bool, n: u64) -> KeyMeta {
        KeyMeta {
            codec: sumflow_wire::KeyCodec {
                codec,
                param,
                feedback,
            },
            ..meta(Dtype::F32, n)
        }
    }

    /// A pooled buffer holding `x` encoded by `meta`'s codec.
    fn encoded(pool: &BufferPool, meta: &KeyMeta, x: &[f32]) -> PushData {
        let c = meta.decoder().unwrap();
        let mut b = pool
            .take(c.payload_len(), Duration::from_millis(1), || false)
            .unwrap();
        c.compress(x, Seed::new(0, 0, 0), &mut Scratch::default(), &mut b);
        b.into()
    }

    fn decoded_sum(rx: &Receiver<Outgoing>, meta: &KeyMeta) -> Vec<f32> {
        match rx.try_recv().expect("a reply") {
            Outgoing::Sum { data, codec, .. } => {
                assert_eq!(codec, meta.codec.codec);
                let c = meta.decoder().unwrap();
                c.validate(&data).expect("the server's payload is valid");
                let mut out = vec![0.0; c.elements()];
                c.decompress(&data, Seed::new(0, 0, 0), &mut Scratch::default(), &mut out);
                out
            }
            _ => panic!("expected a sum"),
        }
    }

    #[test]
    fn top_k_sums_are_re_compressed_and_what_they_drop_comes_later() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let m = compressed(sumflow_wire::Codec::TopK, 2, true, 4);
        let mut e = Engine::new(Reducer::detect(), 2);
        e.init(1, m.clone(), None);
        e.pull(1, 0, 0, tx.clone());
        assert_eq!(decoded_sum(&rx, &m), [0.0; 4], "round 0 is zeros");
        e.push(1, 1, 0, encoded(&pool, &m, &[5.0, 0.0, 0.0, 1.0]), &tx);
        e.fold_staged();
        e.push(1, 1, 1, encoded(&pool, &m, &[0.0, 4.0, 0.0, 2.0]), &tx);
        e.pull(1, 1, 0, tx.clone());
        // The sum is [5, 4, 0, 3]; its top two go out, the 3 stays on the server.
        assert_eq!(decoded_sum(&rx, &m), [5.0, 4.0, 0.0, 0.0]);
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(decoded_sum(&rx, &m), [5.0, 4.0, 0.0, 0.0]);
        for w in 0..2 {
            e.push(1, 2, w, encoded(&pool, &m, &[0.0, 0.0, 1.0, 0.0]), &tx);
        }
        e.pull(1, 2, 0, tx.clone());
        assert_eq!(decoded_sum(&rx, &m), [0.0, 0.0, 2.0, 3.0]);
    }

    #[test]
    fn sign_sums_are_decoded_summed_and_encoded_again() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let m = compressed(sumflow_wire::Codec::Sign, 0, false, 4);
        let mut e = Engine::new(Reducer::detect(), 2);
        e.init(1, m.clone(), None);
        // Decoded: [1, -1, 1, -1] and [3, 3, -3, -3]; sum [4, 2, -2, -4], mean magnitude 3.
        e.push(1, 1, 0, encoded(&pool, &m, &[1.0, -1.0, 1.0, -1.0]), &tx);
        e.push(1, 1, 1, encoded(&pool, &m, &[3.0, 3.0, -3.0, -3.0]), &tx);
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(decoded_sum(&rx, &m), [3.0, 3.0, -3.0, -3.0]);
    }

    #[test]
    fn random_k_values_are_summed_as_they_are() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let m = compressed(sumflow_wire::Codec::RandomK, 3, false, 100);
        assert!(m.decoder().is_none());
        let mut e = Engine::new(Reducer::detect(), 2);
        e.init(1, m.clone(), None);
        let values = |v: [f32; 3]| {
            let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
            pooled(&pool, &bytes)
        };
        e.push(1, 1, 0, values([1.0, 2.0, 3.0]), &tx);
        e.push(1, 1, 1, values([10.0, 20.0, 30.0]), &tx);
        e.pull(1, 1, 1, tx.clone());
        let Ok(Outgoing::Sum { data, codec, .. }) = rx.try_recv() else {
            panic!("expected the sum")
        };
        assert_eq!(codec, sumflow_wire::Codec::RandomK);
        assert_eq!(f32s(&data), [11.0, 22.0, 33.0]);
    }

    /// The message of the next reply, which must be an error of `code`.
    fn error_of(rx: &Receiver<Outgoing>, code: ErrorCode) -> String {
        match rx.try_recv() {
            Ok(Outgoing::Message(Message::Error(err))) => {
                assert_eq!(err.code, code, "{}", err.message);
                err.message
            }
            _ => panic!("expected an error reply ({code:?})"),
        }
    }

    fn delta(e: &mut Engine, round: u64, worker: u32, staleness: Option<u32>, d: PushData) {
        let (tx, rx) = replier();
        e.on_delta(1, round, (worker, staleness), Some(d), &tx);
        assert!(rx.try_recv().is_err(), "an accepted delta is not answered");
    }

    /// BytePS §4.3: each delta is added to the stored value at once, and the pusher's pull
    /// gets the value with every delta so far, including other workers' of later rounds.
    #[test]
    fn deltas_are_added_to_the_stored_value_at_once() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = Engine::new(Reducer::detect(), 2);
        let mut initial = AlignedBuf::zeroed(12);
        for (chunk, v) in initial.chunks_mut(4).zip([100i32, 200, 300]) {
            chunk.copy_from_slice(&v.to_le_bytes());
        }
        e.init(1, meta(Dtype::I32, 3), Some(initial));
        e.pull(1, 0, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![100, 200, 300]);
        delta(&mut e, 1, 0, None, data(&pool, &[1, 2, 3]));
        e.pull(1, 1, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![101, 202, 303]);
        // Worker 0 runs on while worker 1 has pushed nothing.
        delta(&mut e, 2, 0, None, data(&pool, &[1, 1, 1]));
        let held = e.keys[&1].sum.clone(); // a writer still sending the value
        delta(&mut e, 1, 1, None, data(&pool, &[10, 10, 10]));
        e.pull(1, 2, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![112, 213, 314]);
        assert_eq!(
            &held[..4],
            &102i32.to_le_bytes(),
            "a value being sent is never changed"
        );
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![112, 213, 314]);
    }

    #[test]
    fn a_staleness_bound_holds_the_fast_worker_and_names_the_slow_one() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let warning = Duration::from_secs(60);
        let mut e = engine(2).with_stall_warning(Some(warning));
        delta(&mut e, 1, 0, Some(1), data(&pool, &[1, 1, 1]));
        e.pull(1, 1, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![1, 1, 1]);
        delta(&mut e, 2, 0, Some(1), data(&pool, &[1, 1, 1]));
        e.pull(1, 2, 0, tx.clone());
        assert!(
            rx.try_recv().is_err(),
            "round 2 waits for worker 1's round 1"
        );
        let seen = Instant::now();
        e.check_stalls(seen);
        e.check_stalls(seen + warning);
        match rx.try_recv() {
            Ok(Outgoing::Message(Message::Stalled {
                round: 2, missing, ..
            })) => assert_eq!(missing, vec![1]),
            _ => panic!("expected a stall notice"),
        }
        delta(&mut e, 1, 1, Some(1), data(&pool, &[5, 5, 5]));
        assert_eq!(sum_of(&rx), vec![7, 7, 7], "released by worker 1's delta");
        // Every delta of a key carries the same bound.
        let (tx1, rx1) = replier();
        e.on_delta(1, 2, (1, None), Some(data(&pool, &[1, 1, 1])), &tx1);
        let why = error_of(&rx1, ErrorCode::KeyMismatch);
        assert!(why.contains("staleness bound none"), "{why}");
    }

    #[test]
    fn a_key_takes_sums_or_deltas_not_both() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(2);
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.on_delta(1, 1, (1, None), Some(data(&pool, &[1, 1, 1])), &tx);
        let why = error_of(&rx, ErrorCode::KeyMismatch);
        assert!(why.contains("has synchronous rounds"), "{why}");
        let mut e = engine(2);
        delta(&mut e, 1, 0, None, data(&pool, &[1, 1, 1]));
        e.push(1, 1, 1, data(&pool, &[1, 1, 1]), &tx);
        let why = error_of(&rx, ErrorCode::KeyMismatch);
        assert!(why.contains("takes asynchronous deltas"), "{why}");
    }

    #[test]
    fn a_departed_or_joined_worker_under_a_staleness_bound() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        delta(&mut e, 1, 0, Some(0), data(&pool, &[1, 1, 1]));
        delta(&mut e, 1, 1, Some(0), data(&pool, &[1, 1, 1]));
        e.pull(1, 1, 0, tx.clone());
        assert!(rx.try_recv().is_err(), "waits for worker 2");
        // A joined worker is not waited for; a departed one fails the pulls it blocks.
        let (ack_tx, _ack_rx) = replier();
        e.on_join(2, true, &JoinAck::new(true, 1, ack_tx.clone()));
        assert_eq!(sum_of(&rx), vec![2, 2, 2]);
        // Back from join, it is waited for again.
        e.on_join(2, false, &JoinAck::new(false, 1, ack_tx));
        e.pull(1, 1, 1, tx.clone());
        assert!(rx.try_recv().is_err(), "waits for worker 2 again");
        delta(&mut e, 1, 2, Some(0), data(&pool, &[1, 1, 1]));
        assert_eq!(sum_of(&rx), vec![3, 3, 3]);
        delta(&mut e, 2, 0, Some(0), data(&pool, &[1, 1, 1]));
        e.pull(1, 2, 0, tx.clone());
        assert!(rx.try_recv().is_err(), "waits for workers 1 and 2");
        e.worker_gone(2, "worker 2 (w2) lost its connection".into());
        let why = error_of(&rx, ErrorCode::NodeFailed);
        assert!(why.contains("worker 2 (w2) lost"), "{why}");
    }

    #[test]
    fn a_departed_worker_fails_the_rounds_it_did_not_push() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.pull(1, 1, 0, tx.clone());
        e.push(1, 1, 2, data(&pool, &[1, 1, 1]), &tx);
        e.worker_gone(1, "worker 1 (w1) lost its connection".into());
        match rx.try_recv() {
            Ok(Outgoing::Message(Message::Error(err))) => {
                assert_eq!(err.code, ErrorCode::NodeFailed);
                assert!(
                    err.message.contains("worker 1 (w1) lost"),
                    "{}",
                    err.message
                );
            }
            _ => panic!("the waiting pull must fail"),
        }
        e.pull(1, 1, 2, tx.clone());
        assert!(matches!(
            rx.try_recv(),
            Ok(Outgoing::Message(Message::Error(_)))
        ));
    }

    #[test]
    fn a_key_is_freed_once_every_worker_retired_it() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(2);
        e.push(1, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.push(1, 1, 1, data(&pool, &[1, 1, 1]), &tx);
        e.pull(1, 1, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![2, 3, 4]);
        e.retire(1, 0, false);
        assert_eq!(e.live_keys(), 1, "worker 1 has not retired it");
        // Worker 1's last pull is still answered after worker 0 retired.
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![2, 3, 4]);
        // A round worker 0 will never push cannot complete: worker 1 is told at once.
        e.push(1, 2, 1, data(&pool, &[1, 1, 1]), &tx);
        let (fatal, err) = error(&rx);
        assert!(!fatal);
        assert_eq!(err.code, ErrorCode::NodeFailed);
        assert!(
            err.message
                .contains("worker(s) [0] retired key 1 without pushing round 2"),
            "{}",
            err.message
        );
        e.retire(1, 1, true);
        assert_eq!(e.live_keys(), 0);
        // Anything about it now is about an unknown key.
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(error(&rx).1.code, ErrorCode::UnknownKey);
    }

    #[test]
    fn retiring_with_a_pull_pending_fails_what_cannot_complete() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        // Worker 0 pushed and waits; worker 1 retires without pushing: the pull fails.
        e.push(1, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.pull(1, 1, 0, tx.clone());
        assert!(rx.try_recv().is_err());
        e.retire(1, 1, false);
        let (_, err) = error(&rx);
        assert_eq!(err.code, ErrorCode::NodeFailed);
        assert!(err.message.contains("retired key 1"), "{}", err.message);
        // A pull pending when the last worker retires fails too, and the key is gone.
        let mut e = engine(2);
        e.push(1, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.push(1, 1, 1, data(&pool, &[1, 1, 1]), &tx);
        e.pull(1, 1, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![2, 3, 4]);
        e.push(1, 2, 0, data(&pool, &[1, 2, 3]), &tx);
        e.pull(1, 2, 0, tx.clone());
        e.retire(1, 1, false);
        let (_, err) = error(&rx);
        assert!(
            err.message.contains("without pushing round 2"),
            "{}",
            err.message
        );
        e.retire(1, 0, true);
        assert_eq!(e.live_keys(), 0);
    }

    #[test]
    fn sixteen_bit_keys_sum_in_f32_across_batches() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = Engine::new(Reducer::detect(), 3);
        e.init(2, meta(Dtype::F16, 1), None);
        let h = |v: f32| {
            let mut b = pool.take(2, Duration::from_millis(1), || false).unwrap();
            b.copy_from_slice(&half::f16::from_f32(v).to_le_bytes());
            PushData::from(b)
        };
        e.push(2, 1, 0, h(2048.0), &tx);
        e.fold_staged();
        e.push(2, 1, 1, h(1.0), &tx);
        e.fold_staged();
        e.push(2, 1, 2, h(1.0), &tx);
        e.pull(2, 1, 0, tx.clone());
        let Ok(Outgoing::Sum { data, .. }) = rx.try_recv() else {
            panic!("expected the sum")
        };
        // 2050 is exact in f16; summing in f16 would have given 2048.
        assert_eq!(
            half::f16::from_le_bytes([data[0], data[1]]).to_f32(),
            2050.0
        );
    }

    /// An engine of 3 workers with key 1 of every worker and key 2 of workers 0 and 2.
    fn member_engine() -> Engine {
        let mut e = engine(3);
        let members = KeyMeta {
            members: Some(Arc::from([0, 2])),
            ..meta(Dtype::I32, 3)
        };
        e.init(2, members, None);
        e
    }

    fn error(rx: &Receiver<Outgoing>) -> (bool, sumflow_wire::ErrorReply) {
        match rx.try_recv() {
            Ok(Outgoing::Fatal(Message::Error(err))) => (true, err),
            Ok(Outgoing::Message(Message::Error(err))) => (false, err),
            _ => panic!("expected an error"),
        }
    }

    #[test]
    fn a_member_key_sums_its_members_and_refuses_the_others() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = member_engine();
        e.push(2, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.pull(2, 1, 0, tx.clone());
        assert!(rx.try_recv().is_err(), "worker 2 has not pushed yet");
        e.push(2, 1, 2, data(&pool, &[10, 20, 30]), &tx);
        assert_eq!(sum_of(&rx), vec![11, 22, 33]);
        e.pull(2, 1, 2, tx.clone());
        assert_eq!(sum_of(&rx), vec![11, 22, 33]);
        // Worker 1's push is refused and summed nowhere.
        e.push(2, 2, 1, data(&pool, &[100, 100, 100]), &tx);
        let (fatal, err) = error(&rx);
        assert!(fatal);
        assert_eq!(err.code, ErrorCode::BadRank);
        assert!(
            err.message.contains("worker 1") && err.message.contains("workers [0, 2]"),
            "{}",
            err.message
        );
        e.pull(2, 0, 1, tx.clone());
        assert_eq!(error(&rx).1.code, ErrorCode::BadRank);
        for w in [0, 2] {
            e.push(2, 2, w, data(&pool, &[w as i32, 1, 1]), &tx);
        }
        e.pull(2, 2, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![2, 2, 2]);
        // Key 1 still needs all three.
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.push(1, 1, 2, data(&pool, &[1, 1, 1]), &tx);
        e.pull(1, 1, 0, tx.clone());
        assert!(rx.try_recv().is_err(), "worker 1 has not pushed key 1");
        e.push(1, 1, 1, data(&pool, &[1, 1, 1]), &tx);
        assert_eq!(sum_of(&rx), vec![3, 3, 3]);
    }

    #[test]
    fn a_departed_worker_blocks_only_the_keys_it_is_a_member_of() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = member_engine();
        e.push(2, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.pull(2, 1, 0, tx.clone());
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.pull(1, 1, 0, tx.clone());
        // Worker 1 is no member of key 2: only key 1's pull fails.
        e.worker_gone(1, "worker 1 (w1) lost its connection".into());
        let (fatal, err) = error(&rx);
        assert!(!fatal);
        assert_eq!((err.code, err.key), (ErrorCode::NodeFailed, Some(1)));
        assert!(rx.try_recv().is_err(), "key 2's pull still waits");
        e.push(2, 1, 2, data(&pool, &[2, 2, 2]), &tx);
        assert_eq!(sum_of(&rx), vec![3, 3, 3]);
        // Worker 2, a member, leaving fails key 2's next round.
        e.pull(2, 1, 2, tx.clone());
        assert_eq!(sum_of(&rx), vec![3, 3, 3]);
        e.push(2, 2, 0, data(&pool, &[1, 1, 1]), &tx);
        e.pull(2, 2, 0, tx.clone());
        e.worker_gone(2, "worker 2 (w2) left".into());
        let (_, err) = error(&rx);
        assert_eq!((err.code, err.key), (ErrorCode::NodeFailed, Some(2)));
        assert!(
            err.message.contains("worker 2 (w2) left"),
            "{}",
            err.message
        );
    }

    /// Applies a `Join` as every engine would, and checks its acknowledgement is the
    /// next reply.
    fn join(e: &mut Engine, worker: u32, joined: bool, tx: &Replier, rx: &Receiver<Outgoing>) {
        let ack = Arc::new(JoinAck::new(joined, 1, tx.clone()));
        e.on_join(worker, joined, &ack);
        match rx.try_recv() {
            Ok(Outgoing::Message(Message::JoinAck { joined: j })) => assert_eq!(j, joined),
            _ => panic!("expected the JoinAck"),
        }
    }

    #[test]
    fn skips_name_the_senders_round_in_each_skipped_workers_own_numbering() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        // One machine of workers 0 and 1 and another of worker 2.
        let mut e = engine(3);
        // Key round 1 completes while worker 1 has joined: its own numbering lags by one.
        join(&mut e, 1, true, &tx, &rx);
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        e.push(1, 1, 2, data(&pool, &[2, 2, 2]), &tx);
        e.fold_staged();
        for w in [0, 2] {
            e.pull(1, 1, w, tx.clone());
            assert_eq!(sum_of(&rx), vec![3, 3, 3]);
        }
        join(&mut e, 1, false, &tx, &rx);
        // Key round 2: worker 0's round 2 is worker 1's own round 1.
        e.push(1, 2, 0, data(&pool, &[5, 5, 5]), &tx);
        e.on_skips(1, (0, 2), ReduceOp::Sum, &[1], &tx);
        e.push(1, 2, 2, data(&pool, &[1, 1, 1]), &tx);
        e.fold_staged();
        e.pull(1, 2, 0, tx.clone());
        assert_eq!(sum_of(&rx), vec![6, 6, 6]);
        // Key round 3, carried by worker 1 (its round 2) for worker 0 (its round 3).
        e.push(1, 2, 1, data(&pool, &[7, 7, 7]), &tx);
        e.on_skips(1, (1, 2), ReduceOp::Sum, &[0], &tx);
        e.pull(1, 2, 2, tx.clone());
        assert_eq!(sum_of(&rx), vec![6, 6, 6], "worker 2's pull of key round 2");
        e.push(1, 3, 2, data(&pool, &[1, 1, 1]), &tx);
        e.fold_staged();
        e.pull(1, 2, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![8, 8, 8]);
        assert!(rx.try_recv().is_err(), "no refusal, no notice");
    }

    #[test]
    fn a_joined_worker_counts_as_zeros_and_comes_back_in_its_own_numbering() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(3);
        // Round 1: workers 0 and 1 push; worker 2 joins instead, completing it.
        e.push(1, 1, 0, data(&pool, &[1, 2, 3]), &tx);
        e.pull(1, 1, 0, tx.clone());
        e.push(1, 1, 1, data(&pool, &[10, 20, 30]), &tx);
        assert!(rx.try_recv().is_err(), "worker 2 has not pushed round 1");
        let ack = Arc::new(JoinAck::new(true, 2, tx.clone()));
        e.on_join(2, true, &ack);
        assert_eq!(sum_of(&rx), vec![11, 22, 33], "joining completed round 1");
        assert!(
            rx.try_recv().is_err(),
            "one of two engines applied the join"
        );
        ack.applied();
        assert!(matches!(
            rx.try_recv(),
            Ok(Outgoing::Message(Message::JoinAck { joined: true }))
        ));
        e.pull(1, 1, 1, tx.clone());
        assert_eq!(sum_of(&rx), vec![11, 22, 33]);
        // Round 2 without worker 2; a key declared now counts it joined from the start.
        e.init(2, meta(Dtype::I32, 3), None);
        for w in 0..2 {
            e.push(1, 2, w, data(&pool, &[w as i32 + 1, 0, 0]), &tx);
            e.push(2, 1, w, data(&pool, &[5, 5, 5]), &tx);
        }
        for w in 0..2 {
            e.pull(1, 2, w, tx.clone());
            assert_eq!(sum_of(&rx), vec![3, 0, 0]);
            e.pull(2, 1, w, tx.clone());
            assert_eq!(sum_of(&rx), vec![10, 10, 10]);
        }
        // A joined worker's push is refused, and summed nowhere.
        e.push(1, 2, 2, data(&pool, &[100, 100, 100]), &tx);
        let (fatal, err) = error(&rx);
        assert!(fatal);
        assert_eq!(err.code, ErrorCode::RoundOutOfSequence);
        assert!(
            err.message.contains("worker 2 has joined"),
            "{}",
            err.message
        );
        // Worker 2 leaves join: its round 1 of key 1 is the key's round 3, its round 1 of
        // key 2 the key's round 2, and the answers name its own rounds.
        join(&mut e, 2, false, &tx, &rx);
        e.push(1, 3, 0, data(&pool, &[1, 1, 1]), &tx);
        e.push(1, 3, 1, data(&pool, &[1, 1, 1]), &tx);
        e.push(1, 1, 2, data(&pool, &[1, 1, 1]), &tx);
        e.on_pull(1, 1, 2, false, tx.clone());
        assert_eq!(notice_of(&rx), 1, "worker 2's own round");
        e.pull(1, 3, 0, tx.clone());
        match rx.try_recv() {
            Ok(Outgoing::Sum { round, data, .. }) => {
                assert_eq!(round, 3);
                assert_eq!(&data[..4], &3i32.to_le_bytes());
            }
            _ => panic!("expected round 3's sum"),
        }
        e.push(2, 1, 2, data(&pool, &[1, 2, 3]), &tx);
        e.push(2, 2, 0, data(&pool, &[1, 2, 3]), &tx);
        e.push(2, 2, 1, data(&pool, &[1, 2, 3]), &tx);
        e.pull(2, 1, 2, tx.clone());
        match rx.try_recv() {
            Ok(Outgoing::Sum { round, .. }) => assert_eq!(round, 1),
            _ => panic!("expected a sum"),
        }
    }

    #[test]
    fn joining_in_the_middle_of_a_round_is_refused() {
        let pool = BufferPool::new(8);
        let (tx, rx) = replier();
        let mut e = engine(2);
        e.push(1, 1, 0, data(&pool, &[1, 1, 1]), &tx);
        let ack = Arc::new(JoinAck::new(true, 1, tx.clone()));
        e.on_join(0, true, &ack);
        let (fatal, err) = error(&rx);
        assert!(fatal);
        assert_eq!(
            (err.code, err.key),
            (ErrorCode::RoundOutOfSequence, Some(1))
        );
        assert!(
            err.message.contains("pushed but not pulled"),
            "{}",
            err.message
        );
    }
}
