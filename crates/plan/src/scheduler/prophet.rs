//! Prophet (ICPP'21, restated in docs/scheduling.md): gradients appear in bursts during
//! backward, separated by gaps while the GPU computes the next layers. From a profile of
//! past iterations Prophet predicts each gap and, when one begins, sends as a block as many
//! waiting partitions as the measured bandwidth completes before the next, more urgent
//! burst arrives (the paper's constraint 11: a transfer started during backward must finish
//! before any higher-priority gradient is generated). Whatever does not fit stays queued
//! behind the next burst in priority order.
//!
//! In sumflow the blocks come on top of ByteScheduler's credit: every partition competes
//! for the credit as soon as it is ready, and a gap's block goes past it. The credit sizes
//! the pipe for a fixed preemption delay; the block widens it exactly as far as the gap
//! allows. Holding partitions back beyond the credit, as the notes' prototype does, only
//! idled the link on the emulated cluster (0.74-0.94x of ByteScheduler), because a budget
//! measured short left the network quiet while gradients waited.
//!
//! Everything here is a pure function of the events and times passed in.

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::time::{Duration, Instant};

use super::Order;

/// Prophet's knobs.
#[derive(Clone, Debug, PartialEq)]
pub struct ProphetConfig {
    /// A gap between two ready gradients is a stage boundary when it is longer than this
    /// times the iteration's mean gap; shorter gaps are inside a burst and get no block.
    /// The notes' rule is 2; the default, 0, makes every gap a boundary: a gradient may
    /// then use the gap before the next one whatever its length (Prophet's constraint 11
    /// per gradient). With 2, the 3–23 ms gaps between VGG-16's fully connected layers
    /// read as one burst.
    pub stage_factor: f64,
    /// Iterations not profiled at the start (allocation and first-touch make them slow).
    pub warmup_iterations: u32,
    /// Iterations the profile keeps; each gap is the median over them, so the profile
    /// follows a drifting pattern within half as many iterations.
    pub history: usize,
    /// Added to every predicted gap (negative margins are not allowed: use a smaller
    /// stage_factor instead).
    pub slack: Duration,
}

impl Default for ProphetConfig {
    fn default() -> Self {
        ProphetConfig {
            stage_factor: 0.0,
            warmup_iterations: 1,
            history: 5,
            slack: Duration::ZERO,
        }
    }
}

/// What one iteration's backward pass looked like: (tensor, time since its first ready).
type Record = Vec<(u32, Duration)>;

/// The stepwise pattern, as predicted from recent iterations.
#[derive(Clone, Debug, PartialEq)]
pub struct Profile {
    /// Tensors in the order backward produces them.
    pub order: Vec<u32>,
    /// The gap that follows each tensor's ready time, zero inside a burst.
    pub gap_after: HashMap<u32, Duration>,
    /// Iterations it was built from.
    pub iterations: usize,
}

impl Profile {
    /// The last tensor of the backward pass: once it is ready, nothing more is coming.
    pub fn last(&self) -> Option<u32> {
        self.order.last().copied()
    }

    /// Number of stages (bursts separated by gaps).
    pub fn stages(&self) -> usize {
        1 + self.order[..self.order.len().saturating_sub(1)]
            .iter()
            .filter(|t| self.gap_after.get(t).is_some_and(|g| !g.is_zero()))
            .count()
    }

    /// Builds the profile from past iterations with the same tensor order.
    fn build(history: &VecDeque<Record>, stage_factor: f64) -> Option<Profile> {
        let latest = history.back()?;
        if latest.len() < 2 {
            return None;
        }
        let mut gaps: HashMap<u32, Vec<Duration>> = HashMap::new();
        for record in history {
            let span = record.last().map_or(Duration::ZERO, |e| e.1);
            let mean = span.as_secs_f64() / (record.len() - 1) as f64;
            for w in record.windows(2) {
                let gap = w[1].1.saturating_sub(w[0].1);
                let stage_end = gap.as_secs_f64() > stage_factor * mean;
                gaps.entry(w[0].0)
                    .or_default()
                    .push(if stage_end { gap } else { Duration::ZERO });
            }
        }
        let gap_after = gaps
            .into_iter()
            .map(|(t, mut g)| {
                g.sort_unstable();
                (t, g[g.len() / 2])
            })
            .collect();
        Some(Profile {
            order: latest.iter().map(|e| e.0).collect(),
            gap_after,
            iterations: history.len(),
        })
    }
}

/// What Prophet decided at a gradient (for logs and the trace).
#[derive(Clone, Debug, PartialEq)]
pub enum Release {
    /// No profile or no bandwidth measurement yet: the credit alone, as ByteScheduler.
    Unprofiled,
    /// A gap begins: a block of what completes within `budget` bytes goes past the credit.
    Gap { gap: Duration, budget: u64 },
    /// Inside a burst: the credit alone.
    Burst,
    /// The backward pass is over (its last gradient, or one the profile does not know):
    /// the credit alone until the next iteration.
    Flush(&'static str),
}

impl Release {
    /// A few words for logs and the trace.
    pub fn describe(&self) -> String {
        match self {
            Release::Unprofiled => "not profiled yet: the credit alone".into(),
            Release::Gap { gap, budget } => format!(
                "gap of {:.1} ms: a block of up to {budget} bytes goes past the credit",
                gap.as_secs_f64() * 1e3
            ),
            Release::Burst => "inside a burst: the credit alone".into(),
            Release::Flush(why) => format!("{why}: the credit alone"),
        }
    }
}

/// A ready partition not sent yet, which a gap's block may take.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Waiting {
    /// Its place in its server's sending order.
    pub order: Order,
    /// What its push puts on the wire, which the block's budget counts.
    pub wire_bytes: u64,
}

/// What Prophet lets out past the credit at a gradient, and why: a block when a gap
/// begins, nothing otherwise.
#[derive(Clone, Debug, PartialEq)]
pub struct Block {
    /// Most urgent first.
    pub orders: Vec<Order>,
    pub why: Release,
}

impl Block {
    fn none(why: Release) -> Block {
        Block {
            orders: Vec::new(),
            why,
        }
    }
}

/// The state of Prophet's block assembler.
#[derive(Debug)]
pub struct Prophet {
    cfg: ProphetConfig,
    /// This iteration's ready events so far.
    current: Vec<(u32, Instant)>,
    history: VecDeque<Record>,
    profile: Option<Profile>,
    closed_iterations: u32,
    /// Partitions ready and not sent yet, which a gap's block may take: order -> wire
    /// bytes.
    waiting: BTreeMap<Order, u64>,
}

impl Prophet {
    pub fn new(cfg: ProphetConfig) -> Prophet {
        Prophet {
            cfg,
            current: Vec::new(),
            history: VecDeque::new(),
            profile: None,
            closed_iterations: 0,
            waiting: BTreeMap::new(),
        }
    }

    pub fn profile(&self) -> Option<&Profile> {
        self.profile.as_ref()
    }

    /// The gradient `tensor` became ready with `parts`. `ahead`: bytes on their way out
    /// already (sent and not acknowledged, or in an earlier block); `bytes_per_sec`: the
    /// monitor's measurement. Returns the block that goes past the credit now, and why.
    pub fn ready(
        &mut self,
        tensor: u32,
        parts: impl IntoIterator<Item = Waiting>,
        now: Instant,
        ahead: u64,
        bytes_per_sec: Option<f64>,
    ) -> Block {
        // A gradient seen again starts a new iteration even without a step mark (the DDP
        // hook, user code that never calls step()).
        if self.current.iter().any(|e| e.0 == tensor) {
            self.close_iteration();
        }
        self.current.push((tensor, now));
        self.waiting
            .extend(parts.into_iter().map(|w| (w.order, w.wire_bytes)));
        let (Some(profile), Some(rate)) = (&self.profile, bytes_per_sec) else {
            return Block::none(Release::Unprofiled);
        };
        if profile.last() == Some(tensor) {
            return Block::none(Release::Flush("last gradient"));
        }
        let Some(&gap) = profile.gap_after.get(&tensor) else {
            return Block::none(Release::Flush("gradient not in the profile"));
        };
        if gap.is_zero() {
            return Block::none(Release::Burst);
        }
        let budget = (((gap + self.cfg.slack).as_secs_f64() * rate) as u64).saturating_sub(ahead);
        let mut left = budget;
        let mut orders = Vec::new();
        while let Some((&order, &bytes)) = self.waiting.first_key_value() {
            if bytes > left {
                break;
            }
            left -= bytes;
            self.waiting.remove(&order);
            orders.push(order);
        }
        Block {
            orders,
            why: Release::Gap { gap, budget },
        }
    }

    /// The step ended (the plugin's step mark): the backward pass is over.
    pub fn end_iteration(&mut self) {
        self.close_iteration();
    }

    /// A partition was sent (or given up on: a dead server's): no block may take it.
    pub fn sent(&mut self, order: &Order) {
        self.waiting.remove(order);
    }

    fn close_iteration(&mut self) {
        let events = std::mem::take(&mut self.current);
        let Some(&(_, first)) = events.first() else {
            return;
        };
        self.closed_iterations += 1;
        if self.closed_iterations <= self.cfg.warmup_iterations {
            return;
        }
        let record: Record = events
            .iter()
            .map(|&(t, at)| (t, at.saturating_duration_since(first)))
            .collect();
        let same_pattern = self.history.back().is_some_and(|last| {
            last.len() == record.len() && last.iter().zip(&record).all(|(a, b)| a.0 == b.0)
        });
        if !same_pattern {
            if !self.history.is_empty() {
                tracing::info!(
                    tensors = record.len(),
                    "prophet: the order of gradients changed; profiling again"
                );
            }
            self.history.clear();
        }
        self.history.push_back(record);
        while self.history.len() > self.cfg.history.max(1) {
            self.history.pop_front();
        }
        let fresh = self.profile.is_none();
        self.profile = Profile::build(&self.history, self.cfg.stage_factor);
        if let (true, Some(p)) = (fresh, &self.profile) {
            tracing::info!(
                tensors = p.order.len(),
                stages = p.stages(),
                "prophet: profiled the backward pass"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scheduler::order;

    const MS: Duration = Duration::from_millis(1);

    /// A partition of `wire_bytes` at `(priority, key)`.
    fn waiting(priority: i64, key: u64, wire_bytes: u64) -> [Waiting; 1] {
        [Waiting {
            order: order(priority, key),
            wire_bytes,
        }]
    }

    /// One backward pass: tensors 5..0 (5 first), bursts {5,4} {3,2,1} {0} with 20 ms gaps.
    /// Prophet's block at each, in that order.
    fn backward(p: &mut Prophet, t0: Instant, rate: Option<f64>) -> Vec<Block> {
        let times = [0, 1, 21, 22, 23, 43];
        (0..6u32)
            .rev()
            .zip(times)
            .map(|(tensor, at)| {
                let part = waiting(i64::from(tensor), u64::from(tensor), 1000);
                p.ready(tensor, part, t0 + at * MS, 0, rate)
            })
            .collect()
    }

    /// The credit sent everything that was ready.
    fn send_all(p: &mut Prophet) {
        for k in 0..6 {
            p.sent(&order(k, k as u64));
        }
    }

    /// The notes' stage rule: gaps over twice the mean.
    fn notes() -> ProphetConfig {
        ProphetConfig {
            stage_factor: 2.0,
            ..ProphetConfig::default()
        }
    }

    fn profiled() -> (Prophet, Instant) {
        let mut p = Prophet::new(notes());
        let t = Instant::now();
        for i in 0..3 {
            backward(&mut p, t + i * 100 * MS, None);
            send_all(&mut p);
            p.end_iteration();
        }
        (p, t + 300 * MS)
    }

    #[test]
    fn stages_and_gaps_are_found() {
        let (p, _) = profiled();
        let prof = p.profile().unwrap();
        assert_eq!(prof.order, [5, 4, 3, 2, 1, 0]);
        assert_eq!(prof.stages(), 3);
        assert_eq!(prof.gap_after[&4], 20 * MS);
        assert_eq!(prof.gap_after[&1], 20 * MS);
        assert_eq!(prof.gap_after[&5], Duration::ZERO);
        assert_eq!(prof.iterations, 2, "the first iteration is warm-up");
    }

    #[test]
    fn by_default_every_gap_is_a_stage_boundary() {
        let mut p = Prophet::new(ProphetConfig::default());
        let t = Instant::now();
        for i in 0..3 {
            backward(&mut p, t + i * 100 * MS, None);
            send_all(&mut p);
            p.end_iteration();
        }
        let prof = p.profile().unwrap();
        assert_eq!(prof.stages(), 6);
        assert_eq!(prof.gap_after[&5], MS);
        // 1 ms at 1 MB/s: the waiting 1000-byte partition of 5 goes in the gap after it.
        let out = backward(&mut p, t + 300 * MS, Some(1e6));
        assert_eq!(out[0].orders, [order(5, 5)]);
    }

    #[test]
    fn without_profile_or_bandwidth_no_block_goes_past_the_credit() {
        let mut p = Prophet::new(ProphetConfig::default());
        let out = backward(&mut p, Instant::now(), Some(1e6));
        assert!(out.iter().all(|b| *b == Block::none(Release::Unprofiled)));
        let (mut p, t) = profiled();
        let out = backward(&mut p, t, None);
        assert!(out.iter().all(|b| b.orders.is_empty()));
    }

    #[test]
    fn a_gap_lets_out_what_fits_most_urgent_first() {
        let (mut p, t) = profiled();
        // 20 ms at 100 kB/s = 2000 bytes: two of the waiting 1000-byte partitions.
        let out = backward(&mut p, t, Some(100_000.0));
        assert_eq!(
            out[0],
            Block::none(Release::Burst),
            "inside the first burst"
        );
        assert_eq!(
            out[1],
            Block {
                orders: vec![order(4, 4), order(5, 5)],
                why: Release::Gap {
                    gap: 20 * MS,
                    budget: 2000
                }
            },
            "gap after 4: both waiting ones fit"
        );
        assert_eq!(out[2].orders, []);
        assert_eq!(out[3].orders, []);
        assert_eq!(
            out[4].orders,
            [order(1, 1), order(2, 2)],
            "3 waits behind the next burst"
        );
        assert_eq!(
            out[5],
            Block::none(Release::Flush("last gradient")),
            "last gradient: the credit alone"
        );
    }

    #[test]
    fn outstanding_bytes_shrink_the_budget() {
        let (mut p, t) = profiled();
        p.ready(5, waiting(5, 5, 1000), t, 0, Some(100_000.0));
        let block = p.ready(4, waiting(4, 4, 1000), t + MS, 1500, Some(100_000.0));
        assert_eq!(
            block,
            Block::none(Release::Gap {
                gap: 20 * MS,
                budget: 500
            })
        );
    }

    #[test]
    fn a_block_takes_only_partitions_not_sent_yet() {
        let (mut p, t) = profiled();
        p.ready(5, waiting(5, 5, 1000), t, 0, Some(100_000.0));
        p.sent(&order(5, 5));
        let block = p.ready(4, waiting(4, 4, 1000), t + MS, 0, Some(100_000.0));
        assert_eq!(block.orders, [order(4, 4)]);
    }

    #[test]
    fn a_new_order_is_profiled_again_and_repeats_close_iterations() {
        let (mut p, t) = profiled();
        // Without step marks: tensor 9 appears, then the pass repeats twice.
        for i in 0..3u32 {
            for (k, tensor) in [9u32, 5, 0].into_iter().enumerate() {
                p.ready(
                    tensor,
                    waiting(0, u64::from(tensor), 1),
                    t + MS * (i * 100 + k as u32 * 30),
                    0,
                    None,
                );
            }
        }
        let prof = p.profile().unwrap();
        assert_eq!(prof.order, [9, 5, 0]);
        assert_eq!(prof.iterations, 2);
    }

    #[test]
    fn an_unknown_gradient_flushes() {
        let (mut p, t) = profiled();
        p.ready(5, waiting(5, 5, 1000), t, 0, Some(1.0));
        let block = p.ready(77, waiting(77, 77, 1), t + MS, 0, Some(1.0));
        assert_eq!(
            block,
            Block::none(Release::Flush("gradient not in the profile"))
        );
    }
}
