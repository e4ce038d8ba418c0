//! Which summation server sums which partition: BytePS's placement (§4.1).
//!
//! # The model
//!
//! n worker machines each run one summation server beside the worker ("colocated", BytePS's
//! SS_GPU); k machines without workers run one each ("CPU", SS_CPU). Every worker sends its
//! whole gradient, M bytes, and receives M back. A colocated server summing m bytes spares
//! its own worker m bytes of network traffic but receives m from each of the n − 1 others,
//! so its machine moves M + (n − 2)m bytes each way (Eq. 3). A CPU server summing c bytes
//! exchanges c with every worker, n·c in all (Eq. 4 prints c/B, but Eq. 1 follows from n·c/B,
//! the traffic the paper's text describes). Equal times under M = n·m + k·c (Eq. 5) give the
//! shares of Eq. 1 and 2 and the time of Eq. 6, all with B the per-machine bandwidth.
//!
//! # Outside 2 ≤ n, 1 ≤ k ≤ n, where the equations hold as printed
//!
//! - k = 0: colocated PS, whose traffic equals all-reduce's: every server sums M/n.
//! - k ≥ n: the CPU servers carry the whole model (at k = n Eq. 2 is already 0), each M/k.
//!   Past k = n the workers' own NICs are the bottleneck and more CPU servers gain nothing
//!   (§4.1.1); spreading over all k anyway lowers every CPU machine's load at no cost.
//! - n = 1: nothing has to cross the network, so the colocated server sums everything and
//!   CPU servers get nothing (Eq. 1 gives them 0 too, wherever it is defined).
//! - n = 2: Eq. 6 is M/B whatever k, because a colocated server's traffic no longer depends
//!   on its share; the shares of Eq. 1 and 2 remain an optimum and are used unchanged.
//!
//! # Assigning partitions
//!
//! BytePS hashes partition indices into n² + kn − 2k buckets and gives each server as many
//! buckets as its share asks. That meets the shares only on average over many equal parts.
//! Real models are lumpy: ResNet-50 at 4 MiB is 169 partitions with 94% of its bytes in the
//! 37 of 1 MiB or more, and hashed placement puts some server up to 4× its share (the tests
//! measure it). [`place`] instead takes the partitions largest first (ties by key) and gives
//! each to the server whose bytes, divided by its target share, would be smallest after
//! taking it (ties by lowest rank): longest-processing-time-first scheduling on machines
//! whose speeds are the target shares. The big partitions are spread first and the many
//! small ones even out the rest. On ResNet-50 at 4 MiB with n ≤ 8, no server ends more
//! than 3.3% above its share, nor more than 3.3% below wherever 5% is reachable at all.
//!
//! What the greedy bounds is overshoot, the only deviation that costs time. Whatever the
//! sizes, no server ends above `target × (model bytes + m × largest partition)` (m servers
//! with a nonzero share), and since a machine's traffic grows at most in proportion to its
//! share, a placement whose worst server is ε over its share takes at most (1 + ε) times
//! Eq. 6. A server can still end well under its share when partitions are coarse next to
//! it: with n = 8 and k = 7 a colocated server's share of ResNet-50 is 0.96 MB, and the
//! partitions under 1 MiB are too few to bring all eight within 5% of it, by any
//! placement. A smaller partition size is the remedy (2 MiB suffices there).
//!
//! Comparisons use exact integer arithmetic on byte counts and the integer weights behind
//! the shares, and the order depends only on sizes and keys, so every worker derives the
//! same placement from the same partitions, in whatever order it lists them.

use std::cmp::{Ordering, Reverse};
use std::collections::{BTreeMap, HashSet};
use std::fmt;

use sumflow_wire::ClusterMap;
use thiserror::Error;

use crate::partition::Partition;

/// Why a placement or a communication time cannot be computed.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum PlacementError {
    #[error("no worker machines (n = 0): placement needs at least one")]
    NoMachines,
    #[error("non-colocated PS needs at least one CPU server, and k = 0")]
    NoCpuServers,
    #[error("bandwidth must be a positive, finite number of bytes per second, not {0}")]
    InvalidBandwidth(f64),
    #[error("server rank {0} is listed twice in the server set; every server needs its own rank")]
    DuplicateServer(u32),
    #[error(
        "worker machine '{machine}' (worker '{worker}') runs no summation server but others \
         do; start one there, or none on any worker machine for a non-colocated PS"
    )]
    NoColocatedServer { machine: String, worker: String },
    #[error(
        "worker machine '{machine}' runs summation servers {ranks:?}; placement expects \
         exactly one per worker machine"
    )]
    SeveralColocatedServers { machine: String, ranks: Vec<u32> },
    #[error("partition key {0:#x} is listed twice; every partition needs its own key")]
    DuplicateKey(u64),
    #[error("the partitions add up to more than {} bytes", u64::MAX)]
    TooManyBytes,
}

/// Fraction of the model each server of a kind sums: `n × colocated + k × cpu = 1`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shares {
    /// Per colocated server (Eq. 2 divided by M).
    pub colocated: f64,
    /// Per CPU server (Eq. 1 divided by M); 0 when there are none.
    pub cpu: f64,
}

/// The shares as integer weights (colocated, CPU), so that placement decisions are exact
/// and identical on every worker; see the module docs for the cases.
fn weights(n: u64, k: u64) -> (u64, u64) {
    if n == 1 || k == 0 {
        (1, 0)
    } else if k >= n {
        (0, 1)
    } else {
        (n - k, 2 * (n - 1))
    }
}

fn shares_of(n: u64, k: u64) -> Shares {
    let (colocated, cpu) = weights(n, k);
    let total = n as f64 * colocated as f64 + k as f64 * cpu as f64;
    Shares {
        colocated: colocated as f64 / total,
        cpu: cpu as f64 / total,
    }
}

fn check_machines(n: u32) -> Result<(), PlacementError> {
    if n == 0 {
        return Err(PlacementError::NoMachines);
    }
    Ok(())
}

fn check_bandwidth(bandwidth: f64) -> Result<(), PlacementError> {
    if !(bandwidth.is_finite() && bandwidth > 0.0) {
        return Err(PlacementError::InvalidBandwidth(bandwidth));
    }
    Ok(())
}

/// The shares that minimise communication time with `n` worker machines and `k` CPU
/// servers (Eq. 1 and 2, with the edge cases of the module docs).
pub fn optimal_shares(n: u32, k: u32) -> Result<Shares, PlacementError> {
    check_machines(n)?;
    Ok(shares_of(n.into(), k.into()))
}

/// Seconds per iteration of ring all-reduce, the baseline any placement must beat
/// (§2.2, Table 1: 2(n − 1)M / nB; colocated PS takes the same).
pub fn allreduce_time(n: u32, model_bytes: u64, bandwidth: f64) -> Result<f64, PlacementError> {
    check_machines(n)?;
    check_bandwidth(bandwidth)?;
    let n = f64::from(n);
    Ok(2.0 * (n - 1.0) * model_bytes as f64 / (n * bandwidth))
}

/// Seconds per iteration of non-colocated PS over `k` CPU servers (§2.3, Table 1:
/// max(M/B, nM/kB)): each worker moves M, each server n·M/k.
pub fn ps_time(n: u32, k: u32, model_bytes: u64, bandwidth: f64) -> Result<f64, PlacementError> {
    check_machines(n)?;
    if k == 0 {
        return Err(PlacementError::NoCpuServers);
    }
    check_bandwidth(bandwidth)?;
    let worker = model_bytes as f64 / bandwidth;
    Ok(worker.max(f64::from(n) * worker / f64::from(k)))
}

/// Seconds per iteration with the optimal shares (Eq. 6), the floor a placement is judged
/// against. CPU servers past k = n count as k = n (they add no speed); with n = 1 nothing
/// crosses the network and the time is 0.
pub fn optimal_time(
    n: u32,
    k: u32,
    model_bytes: u64,
    bandwidth: f64,
) -> Result<f64, PlacementError> {
    check_machines(n)?;
    check_bandwidth(bandwidth)?;
    if n == 1 {
        return Ok(0.0);
    }
    let (n, k) = (f64::from(n), f64::from(k.min(n)));
    Ok(2.0 * n * (n - 1.0) * model_bytes as f64 / ((n * n + k * n - 2.0 * k) * bandwidth))
}

/// How many times faster than all-reduce the optimal shares communicate (Eq. 7's γ_a,
/// (n² + kn − 2k) / n², with k capped at n); 1 for n = 1, where neither communicates.
pub fn acceleration_vs_allreduce(n: u32, k: u32) -> Result<f64, PlacementError> {
    check_machines(n)?;
    if n == 1 {
        return Ok(1.0);
    }
    let (n, k) = (f64::from(n), f64::from(k.min(n)));
    Ok((n * n + k * n - 2.0 * k) / (n * n))
}

/// How many times faster than non-colocated PS on the same `k` CPU servers the optimal
/// shares communicate (Eq. 7's γ_p, (n² + kn − 2k) / 2k(n − 1), with k capped at n);
/// infinite for n = 1, where PS still sends the model but the colocated server needs no
/// network.
pub fn acceleration_vs_ps(n: u32, k: u32) -> Result<f64, PlacementError> {
    check_machines(n)?;
    if k == 0 {
        return Err(PlacementError::NoCpuServers);
    }
    if n == 1 {
        return Ok(f64::INFINITY);
    }
    let (n, k) = (f64::from(n), f64::from(k.min(n)));
    Ok((n * n + k * n - 2.0 * k) / (2.0 * k * (n - 1.0)))
}

/// Where a summation server runs, which decides its share.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ServerKind {
    /// On a worker machine (SS_GPU).
    Colocated,
    /// On a machine without workers (SS_CPU).
    Cpu,
}

impl fmt::Display for ServerKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ServerKind::Colocated => "colocated",
            ServerKind::Cpu => "CPU",
        })
    }
}

/// The job's summation servers by cluster-map rank: one colocated with each of the n worker
/// machines, plus k on CPU machines; or, in the non-colocated PS, only the k CPU servers.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServerSet {
    /// n, the number of worker machines.
    machines: u32,
    /// One per worker machine, or none (non-colocated).
    colocated: Vec<u32>,
    cpu: Vec<u32>,
}

impl ServerSet {
    /// `colocated` holds one server per worker machine, so its length is n.
    pub fn new(colocated: Vec<u32>, cpu: Vec<u32>) -> Result<ServerSet, PlacementError> {
        if colocated.is_empty() {
            return Err(PlacementError::NoMachines);
        }
        // Server ranks are u32, so there are fewer than 2^32 of them.
        ServerSet::checked(colocated.len() as u32, colocated, cpu)
    }

    /// The non-colocated PS: `machines` worker machines run no server, the `cpu` servers
    /// sum everything in equal shares.
    pub fn non_colocated(machines: u32, cpu: Vec<u32>) -> Result<ServerSet, PlacementError> {
        check_machines(machines)?;
        if cpu.is_empty() {
            return Err(PlacementError::NoCpuServers);
        }
        ServerSet::checked(machines, Vec::new(), cpu)
    }

    fn checked(
        machines: u32,
        colocated: Vec<u32>,
        cpu: Vec<u32>,
    ) -> Result<ServerSet, PlacementError> {
        let mut seen = HashSet::new();
        if let Some(&rank) = colocated.iter().chain(&cpu).find(|&&r| !seen.insert(r)) {
            return Err(PlacementError::DuplicateServer(rank));
        }
        Ok(ServerSet {
            machines,
            colocated,
            cpu,
        })
    }

    /// Reads the servers off the cluster map: workers sharing a `host_id` share a machine,
    /// whose one server is its colocated server; servers on machines without workers are
    /// CPU servers. Either every worker machine runs one server or none does.
    pub fn from_cluster(map: &ClusterMap) -> Result<ServerSet, PlacementError> {
        let mut machines = HashSet::new();
        let mut colocated = Vec::new();
        let mut bare = None;
        for worker in &map.workers {
            if !machines.insert(worker.host_id.as_str()) {
                continue;
            }
            match map.colocated_servers(worker.rank)[..] {
                [rank] => colocated.push(rank),
                [] => {
                    bare.get_or_insert(PlacementError::NoColocatedServer {
                        machine: worker.host_id.clone(),
                        worker: worker.name.clone(),
                    });
                }
                ref ranks => {
                    return Err(PlacementError::SeveralColocatedServers {
                        machine: worker.host_id.clone(),
                        ranks: ranks.to_vec(),
                    })
                }
            }
        }
        match bare {
            None => ServerSet::new(colocated, map.cpu_only_servers()),
            Some(_) if colocated.is_empty() => {
                // Worker ranks are u32, so there are fewer than 2^32 machines.
                ServerSet::non_colocated(machines.len() as u32, map.cpu_only_servers())
            }
            Some(e) => Err(e),
        }
    }

    /// The share of the model each server of a kind sums.
    pub fn shares(&self) -> Shares {
        let (colocated, cpu) = self.weights();
        let total =
            self.colocated.len() as f64 * colocated as f64 + self.cpu.len() as f64 * cpu as f64;
        Shares {
            colocated: colocated as f64 / total,
            cpu: cpu as f64 / total,
        }
    }

    fn weights(&self) -> (u64, u64) {
        if self.colocated.is_empty() {
            (0, 1)
        } else {
            weights(self.machines.into(), self.cpu.len() as u64)
        }
    }

    /// How many servers sum: the colocated ones and the CPU ones.
    pub fn len(&self) -> usize {
        self.colocated.len() + self.cpu.len()
    }

    /// Whether no server sums (a set is never built so; for completeness with `len`).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn colocated(&self) -> &[u32] {
        &self.colocated
    }

    pub fn cpu(&self) -> &[u32] {
        &self.cpu
    }
}

/// What one server ended up with.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerLoad {
    pub rank: u32,
    pub kind: ServerKind,
    pub bytes: u64,
    /// Fraction of the placed bytes it sums (0 when nothing was placed).
    pub share: f64,
    /// Fraction the equations ask of it.
    pub target: f64,
}

impl fmt::Display for ServerLoad {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "server {} ({}): {:.1} MB, {:.1}% of the model, target {:.1}%",
            self.rank,
            self.kind,
            self.bytes as f64 / 1e6,
            self.share * 100.0,
            self.target * 100.0
        )
    }
}

/// Which server sums each partition, and how the bytes came out per server.
#[derive(Clone, Debug, PartialEq)]
pub struct Placement {
    server_of: BTreeMap<u64, u32>,
    loads: Vec<ServerLoad>,
    total_bytes: u64,
}

impl Placement {
    /// The rank of the server that sums partition `key`, if it was placed.
    pub fn server_of(&self, key: u64) -> Option<u32> {
        self.server_of.get(&key).copied()
    }

    /// Every server of the set, by rank.
    pub fn loads(&self) -> &[ServerLoad] {
        &self.loads
    }

    pub fn total_bytes(&self) -> u64 {
        self.total_bytes
    }

    /// One line per server, by rank, saying what it sums against what it should.
    pub fn explain(&self) -> Vec<String> {
        self.loads.iter().map(ServerLoad::to_string).collect()
    }
}

/// A server as the greedy sees it.
struct Slot {
    rank: u32,
    kind: ServerKind,
    weight: u64,
    bytes: u64,
}

/// Orders servers by (bytes + `size`) / weight, lowest rank first on ties; exact, since
/// `bytes + size` never exceeds the checked total and weights stay below 2^34.
fn cheaper(a: &Slot, b: &Slot, size: u64) -> Ordering {
    let a_cost = u128::from(a.bytes + size) * u128::from(b.weight);
    let b_cost = u128::from(b.bytes + size) * u128::from(a.weight);
    a_cost.cmp(&b_cost).then(a.rank.cmp(&b.rank))
}

/// Assigns each partition to a server of `servers` by its key and size, so that every
/// server's bytes track its optimal share (method and guarantees in the module docs).
///
/// Costs O(partitions × servers).
///
/// ```
/// use sumflow_plan::partition::{partition_tensors, TensorSpec};
/// use sumflow_plan::placement::{place, ServerSet};
/// use sumflow_wire::Dtype;
///
/// // Two worker machines (servers 0 and 1 beside them) and one CPU server: Eq. 1 and 2
/// // give each colocated server a quarter of the model and the CPU server half.
/// let servers = ServerSet::new(vec![0, 1], vec![2])?;
/// let model = [
///     TensorSpec { name: "w", elements: 1_000_000, dtype: Dtype::F32 },
///     TensorSpec { name: "v", elements: 500_000, dtype: Dtype::F32 },
///     TensorSpec { name: "b", elements: 500_000, dtype: Dtype::F32 },
/// ];
/// let parts = partition_tensors(&model, 4 << 20).expect("each tensor is one partition");
/// let placement = place(&parts, &servers)?;
/// assert_eq!(placement.server_of(parts[0].key), Some(2));
/// assert_eq!(placement.explain()[2], "server 2 (CPU): 4.0 MB, 50.0% of the model, target 50.0%");
/// # Ok::<(), sumflow_plan::placement::PlacementError>(())
/// ```
pub fn place(partitions: &[Partition], servers: &ServerSet) -> Result<Placement, PlacementError> {
    let (colocated_weight, cpu_weight) = servers.weights();
    let shares = servers.shares();
    let mut order: Vec<&Partition> = partitions.iter().collect();
    order.sort_unstable_by_key(|p| (Reverse(p.bytes), p.key));
    let total_bytes = order
        .iter()
        .try_fold(0u64, |sum, p| sum.checked_add(p.bytes))
        .ok_or(PlacementError::TooManyBytes)?;

    let mut slots: Vec<Slot> = servers
        .colocated
        .iter()
        .map(|&rank| (rank, ServerKind::Colocated, colocated_weight))
        .chain(
            servers
                .cpu
                .iter()
                .map(|&rank| (rank, ServerKind::Cpu, cpu_weight)),
        )
        .map(|(rank, kind, weight)| Slot {
            rank,
            kind,
            weight,
            bytes: 0,
        })
        .collect();
    slots.sort_unstable_by_key(|s| s.rank);

    let mut server_of = BTreeMap::new();
    for p in order {
        let best = slots
            .iter_mut()
            .filter(|s| s.weight > 0)
            .min_by(|a, b| cheaper(a, b, p.bytes))
            .expect("every server set has a server with a nonzero share");
        best.bytes += p.bytes;
        if server_of.insert(p.key, best.rank).is_some() {
            return Err(PlacementError::DuplicateKey(p.key));
        }
    }

    let loads = slots
        .into_iter()
        .map(|s| ServerLoad {
            rank: s.rank,
            kind: s.kind,
            bytes: s.bytes,
            share: if total_bytes == 0 {
                0.0
            } else {
                s.bytes as f64 / total_bytes as f64
            },
            target: match s.kind {
                ServerKind::Colocated => shares.colocated,
                ServerKind::Cpu => shares.cpu,
            },
        })
        .collect();
    Ok(Placement {
        server_of,
        loads,
        total_bytes,
    })
}

#[cfg(test)]
mod tests {
    use sumflow_wire::{Dtype, NodeInfo};

    use super::*;
    use crate::partition::{partition_tensors, TensorSpec, DEFAULT_PARTITION_BYTES};

    /// Partitions of these keys and sizes, of one tensor.
    fn sized(parts: &[(u64, u64)]) -> Vec<Partition> {
        parts
            .iter()
            .map(|&(key, bytes)| Partition {
                key,
                bytes,
                ..Partition::default()
            })
            .collect()
    }

    /// splitmix64: a tiny PRNG whose stream depends only on the seed.
    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
            let mut z = self.0;
            z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
            z ^ (z >> 31)
        }

        fn below(&mut self, bound: u64) -> u64 {
            self.next() % bound
        }

        fn shuffle<T>(&mut self, items: &mut [T]) {
            for i in (1..items.len()).rev() {
                items.swap(i, self.below(i as u64 + 1) as usize);
            }
        }
    }

    /// ResNet-50's trainable tensors (name, f32 elements) in declaration order.
    fn resnet50() -> Vec<(String, u64)> {
        fn conv_bn(t: &mut Vec<(String, u64)>, conv: &str, bn: &str, shape: [u64; 3]) {
            let [cin, cout, kernel] = shape;
            t.push((format!("{conv}.weight"), kernel * kernel * cin * cout));
            t.push((format!("{bn}.weight"), cout));
            t.push((format!("{bn}.bias"), cout));
        }
        let mut t = Vec::new();
        conv_bn(&mut t, "conv1", "bn1", [3, 64, 7]);
        let mut cin = 64;
        for (stage, blocks, width) in [(1, 3, 64), (2, 4, 128), (3, 6, 256), (4, 3, 512)] {
            for block in 0..blocks {
                let p = format!("layer{stage}.{block}");
                let input = if block == 0 { cin } else { 4 * width };
                let convs = [[input, width, 1], [width, width, 3], [width, 4 * width, 1]];
                for (i, shape) in (1..).zip(convs) {
                    conv_bn(
                        &mut t,
                        &format!("{p}.conv{i}"),
                        &format!("{p}.bn{i}"),
                        shape,
                    );
                }
                if block == 0 {
                    let (conv, bn) = (format!("{p}.downsample.0"), format!("{p}.downsample.1"));
                    conv_bn(&mut t, &conv, &bn, [input, 4 * width, 1]);
                }
            }
            cin = 4 * width;
        }
        t.push(("fc.weight".into(), 2048 * 1000));
        t.push(("fc.bias".into(), 1000));
        t
    }

    /// Every partition of `tensors`, all f32.
    fn keyed(tensors: &[(String, u64)], partition_bytes: u64) -> Vec<Partition> {
        let specs: Vec<_> = tensors
            .iter()
            .map(|(name, elements)| TensorSpec {
                name,
                elements: *elements,
                dtype: Dtype::F32,
            })
            .collect();
        partition_tensors(&specs, partition_bytes).unwrap()
    }

    fn contiguous(n: u32, k: u32) -> ServerSet {
        ServerSet::new((0..n).collect(), (n..n + k).collect()).unwrap()
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * a.abs().max(b.abs()).max(1.0)
    }

    #[test]
    fn resnet50_fixture_matches_the_architecture() {
        let t = resnet50();
        assert_eq!(t.len(), 161);
        assert_eq!(t.iter().map(|(_, e)| e).sum::<u64>(), 25_557_032);
        let parts = keyed(&t, DEFAULT_PARTITION_BYTES);
        assert_eq!(parts.len(), 169);
        let big: u64 = parts
            .iter()
            .map(|p| p.bytes)
            .filter(|&b| b >= 1 << 20)
            .sum();
        assert_eq!(parts.iter().filter(|p| p.bytes >= 1 << 20).count(), 37);
        assert!(big as f64 > 0.93 * (25_557_032 * 4) as f64);
    }

    #[test]
    fn shares_follow_eq_1_and_2() {
        let s = optimal_shares(4, 2).unwrap();
        // n² + kn − 2k = 16 + 8 − 4 = 20.
        assert!(close(s.colocated, 2.0 / 20.0) && close(s.cpu, 6.0 / 20.0));
        let s = optimal_shares(2, 1).unwrap();
        assert!(close(s.colocated, 0.25) && close(s.cpu, 0.5));
    }

    #[test]
    fn shares_are_never_negative_and_sum_to_one() {
        for n in 1..=64u32 {
            for k in 0..=80u32 {
                let s = optimal_shares(n, k).unwrap();
                assert!(s.colocated >= 0.0 && s.cpu >= 0.0, "n={n} k={k}: {s:?}");
                let sum = f64::from(n) * s.colocated + f64::from(k) * s.cpu;
                assert!(close(sum, 1.0), "n={n} k={k}: {s:?} sums to {sum}");
            }
        }
    }

    #[test]
    fn edge_cases_reduce_to_all_reduce_ps_and_local() {
        let (m, b) = (100 << 20, 12.5e9);
        for n in 2..=16u32 {
            let s = optimal_shares(n, 0).unwrap();
            assert!(close(s.colocated, 1.0 / f64::from(n)) && s.cpu == 0.0);
            let s = optimal_shares(n, n).unwrap();
            assert!(s.colocated == 0.0 && close(s.cpu, 1.0 / f64::from(n)));
            let s = optimal_shares(n, 3 * n).unwrap();
            assert!(s.colocated == 0.0 && close(s.cpu, 1.0 / f64::from(3 * n)));
            let t = optimal_time(n, 0, m, b).unwrap();
            assert!(close(t, allreduce_time(n, m, b).unwrap()));
            let t = optimal_time(n, n, m, b).unwrap();
            assert!(close(t, ps_time(n, n, m, b).unwrap()));
            assert!(close(optimal_time(n, 2 * n, m, b).unwrap(), m as f64 / b));
        }
        for k in 0..4 {
            let s = optimal_shares(1, k).unwrap();
            assert_eq!((s.colocated, s.cpu), (1.0, 0.0));
            assert_eq!(optimal_time(1, k, 1 << 30, 1e9).unwrap(), 0.0);
        }
        // With two workers every k takes M/B.
        for k in 0..5 {
            assert!(close(optimal_time(2, k, 1_000, 1_000.0).unwrap(), 1.0));
        }
    }

    #[test]
    fn eq_7_gives_the_papers_numbers() {
        // §4.1.1 quotes 1.46 and 1.52; exactly 1504/1024 = 1.46875 and 1504/992 = 1.516.
        let ga = acceleration_vs_allreduce(32, 16).unwrap();
        let gp = acceleration_vs_ps(32, 16).unwrap();
        assert!(close(ga, 1504.0 / 1024.0) && (ga * 100.0).floor() == 146.0);
        assert!(close(gp, 1504.0 / 992.0) && (gp * 100.0).round() == 152.0);
    }

    #[test]
    fn eq_7_is_the_ratio_of_the_times() {
        let (m, b) = (1 << 28, 3e9);
        for n in 2..=40u32 {
            for k in 0..=n + 5 {
                let opt = optimal_time(n, k, m, b).unwrap();
                let ga = allreduce_time(n, m, b).unwrap() / opt;
                assert!(
                    close(ga, acceleration_vs_allreduce(n, k).unwrap()),
                    "n={n} k={k}"
                );
                if k > 0 {
                    let gp = ps_time(n, k, m, b).unwrap() / opt;
                    assert!(close(gp, acceleration_vs_ps(n, k).unwrap()), "n={n} k={k}");
                }
            }
        }
        assert_eq!(acceleration_vs_allreduce(1, 3).unwrap(), 1.0);
        assert_eq!(acceleration_vs_ps(1, 3).unwrap(), f64::INFINITY);
    }

    #[test]
    fn invalid_inputs_are_refused() {
        assert_eq!(optimal_shares(0, 1), Err(PlacementError::NoMachines));
        assert_eq!(allreduce_time(0, 1, 1.0), Err(PlacementError::NoMachines));
        assert_eq!(ps_time(4, 0, 1, 1.0), Err(PlacementError::NoCpuServers));
        assert_eq!(acceleration_vs_ps(4, 0), Err(PlacementError::NoCpuServers));
        for b in [0.0, -1.0, f64::INFINITY] {
            assert_eq!(
                optimal_time(4, 1, 1, b),
                Err(PlacementError::InvalidBandwidth(b))
            );
        }
        assert!(optimal_time(4, 1, 1, f64::NAN).is_err());
        assert_eq!(
            ServerSet::new(vec![], vec![1]),
            Err(PlacementError::NoMachines)
        );
        assert_eq!(
            ServerSet::new(vec![0, 1], vec![2, 1]),
            Err(PlacementError::DuplicateServer(1))
        );
        let err = place(&sized(&[(7, 1), (8, 2), (7, 3)]), &contiguous(2, 1)).unwrap_err();
        assert_eq!(
            err.to_string(),
            "partition key 0x7 is listed twice; every partition needs its own key"
        );
        assert_eq!(
            place(&sized(&[(1, u64::MAX), (2, 1)]), &contiguous(1, 0)),
            Err(PlacementError::TooManyBytes)
        );
    }

    /// A node of rank `rank` on machine `host`, named "host-rank".
    fn node(rank: u32, host: &str) -> NodeInfo {
        NodeInfo {
            rank,
            host: "10.0.0.1".into(),
            port: 9000,
            host_id: host.into(),
            pid: 1,
            link_mbit: 0,
            name: format!("{host}-{rank}"),
        }
    }

    #[test]
    fn servers_come_from_the_cluster_map() {
        let mut map = ClusterMap {
            job_id: "j".into(),
            // Two workers share machine a.
            workers: vec![node(0, "a"), node(1, "a"), node(2, "b")],
            servers: vec![node(0, "cpu1"), node(1, "b"), node(2, "a"), node(3, "cpu2")],
        };
        let set = ServerSet::from_cluster(&map).unwrap();
        assert_eq!((set.colocated(), set.cpu()), (&[2, 1][..], &[0, 3][..]));

        map.servers[2].host_id = "cpu3".into();
        assert_eq!(
            ServerSet::from_cluster(&map).unwrap_err().to_string(),
            "worker machine 'a' (worker 'a-0') runs no summation server but others do; start \
             one there, or none on any worker machine for a non-colocated PS"
        );
        map.servers[0].host_id = "a".into();
        map.servers[2].host_id = "a".into();
        assert_eq!(
            ServerSet::from_cluster(&map),
            Err(PlacementError::SeveralColocatedServers {
                machine: "a".into(),
                ranks: vec![0, 2]
            })
        );
    }

    #[test]
    fn without_colocated_servers_the_cpu_servers_share_equally() {
        let map = ClusterMap {
            job_id: "j".into(),
            workers: vec![node(0, "a"), node(1, "b"), node(2, "c")],
            servers: vec![node(0, "cpu1"), node(1, "cpu2")],
        };
        let set = ServerSet::from_cluster(&map).unwrap();
        assert_eq!((set.colocated(), set.cpu()), (&[][..], &[0, 1][..]));
        assert_eq!(set, ServerSet::non_colocated(3, vec![0, 1]).unwrap());
        let shares = set.shares();
        assert_eq!((shares.colocated, shares.cpu), (0.0, 0.5));
        let parts = sized(&(0..10).map(|k| (k, 1000)).collect::<Vec<_>>());
        let p = place(&parts, &set).unwrap();
        assert!(p
            .loads()
            .iter()
            .all(|l| l.bytes == 5000 && l.kind == ServerKind::Cpu));
        assert_eq!(
            ServerSet::non_colocated(3, vec![]),
            Err(PlacementError::NoCpuServers)
        );
        assert_eq!(
            ServerSet::non_colocated(0, vec![1]),
            Err(PlacementError::NoMachines)
        );
    }

    #[test]
    fn explanations_read_as_one_line_per_server() {
        let parts = sized(&[(1, 2_000_000), (2, 1_000_000), (3, 1_000_000)]);
        let p = place(&parts, &contiguous(2, 1)).unwrap();
        assert_eq!(
            p.explain(),
            vec![
                "server 0 (colocated): 1.0 MB, 25.0% of the model, target 25.0%",
                "server 1 (colocated): 1.0 MB, 25.0% of the model, target 25.0%",
                "server 2 (CPU): 2.0 MB, 50.0% of the model, target 50.0%",
            ]
        );
        assert_eq!((p.server_of(1), p.server_of(4)), (Some(2), None));
        let empty = place(&[], &contiguous(3, 1)).unwrap();
        assert_eq!(empty.total_bytes(), 0);
        assert!(empty.loads().iter().all(|l| l.bytes == 0 && l.share == 0.0));
    }

    type Assignment = BTreeMap<u64, u32>;

    /// Where [`place`] puts each partition.
    fn greedy(parts: &[Partition], servers: &ServerSet) -> Assignment {
        let p = place(parts, servers).unwrap();
        parts
            .iter()
            .map(|part| (part.key, p.server_of(part.key).unwrap()))
            .collect()
    }

    /// BytePS's method: hash every key into n² + kn − 2k buckets, n − k of them per
    /// colocated server and 2(n − 1) per CPU server (or the edge cases' weights).
    fn hashed(parts: &[Partition], servers: &ServerSet) -> Assignment {
        let (n, k) = (servers.colocated().len() as u64, servers.cpu().len() as u64);
        let (colocated, cpu) = weights(n, k);
        let mut buckets = Vec::new();
        for &r in servers.colocated() {
            buckets.extend(std::iter::repeat_n(r, colocated as usize));
        }
        for &r in servers.cpu() {
            buckets.extend(std::iter::repeat_n(r, cpu as usize));
        }
        let bucket = |key| (Rng(key).next() % buckets.len() as u64) as usize;
        parts
            .iter()
            .map(|p| (p.key, buckets[bucket(p.key)]))
            .collect()
    }

    /// How far an assignment strays from the equations' shares, computed from scratch:
    /// (worst |share − target| / target, worst (share − target) / target). Servers whose
    /// target is 0 must get nothing.
    fn deviation(parts: &[Partition], servers: &ServerSet, a: &Assignment) -> (f64, f64) {
        let (n, k) = (servers.colocated().len(), servers.cpu().len());
        let shares = optimal_shares(n as u32, k as u32).unwrap();
        let total: u64 = parts.iter().map(|p| p.bytes).sum();
        let mut bytes = BTreeMap::new();
        for p in parts {
            *bytes.entry(a[&p.key]).or_insert(0u64) += p.bytes;
        }
        let targets = servers.colocated().iter().map(|r| (r, shares.colocated));
        let targets = targets.chain(servers.cpu().iter().map(|r| (r, shares.cpu)));
        let (mut worst, mut over) = (0.0f64, 0.0f64);
        for (rank, target) in targets {
            let b = bytes.get(rank).copied().unwrap_or(0);
            if target == 0.0 {
                assert_eq!(b, 0, "server {rank} has no share but got {b} B");
                continue;
            }
            let dev = (b as f64 / total as f64 - target) / target;
            (worst, over) = (worst.max(dev.abs()), over.max(dev));
        }
        (worst, over)
    }

    /// Whether no placement at all keeps every colocated server within 5% of its share: the
    /// partitions small enough for one (at most 105% of its target) add up to less than the
    /// 95% of their targets that the n colocated servers need together.
    fn out_of_reach(parts: &[Partition], n: u32, k: u32) -> bool {
        let total: u64 = parts.iter().map(|p| p.bytes).sum();
        let target = optimal_shares(n, k).unwrap().colocated * total as f64;
        let small: u64 = parts
            .iter()
            .map(|p| p.bytes)
            .filter(|&b| b as f64 <= 1.05 * target)
            .sum();
        target > 0.0 && (small as f64) < 0.95 * target * f64::from(n)
    }

    /// The slowest machine's seconds per byte per second of bandwidth, by Eq. 3 and 4.
    fn slowest_machine(p: &Placement, n: u32) -> f64 {
        let (m, n) = (p.total_bytes() as f64, f64::from(n));
        p.loads()
            .iter()
            .map(|l| match l.kind {
                ServerKind::Colocated => m + (n - 2.0) * l.bytes as f64,
                ServerKind::Cpu => n * l.bytes as f64,
            })
            .fold(0.0, f64::max)
    }

    /// The worst |deviation| of `assign` on ResNet-50 at 4 MiB, n in 2..=8, k in 0..=n + 2.
    fn resnet50_worst(assign: fn(&[Partition], &ServerSet) -> Assignment) -> f64 {
        let parts = keyed(&resnet50(), DEFAULT_PARTITION_BYTES);
        let mut worst = 0.0f64;
        for n in 2..=8 {
            for k in 0..=n + 2 {
                let servers = contiguous(n, k);
                worst = worst.max(deviation(&parts, &servers, &assign(&parts, &servers)).0);
            }
        }
        worst
    }

    #[test]
    fn resnet50_shares_track_the_equations() {
        let parts = keyed(&resnet50(), DEFAULT_PARTITION_BYTES);
        let model: u64 = parts.iter().map(|p| p.bytes).sum();
        let (mut worst, mut worst_over) = (0.0f64, 0.0f64);
        let mut unreachable = Vec::new();
        for n in 2..=8 {
            for k in 0..=n + 2 {
                let servers = contiguous(n, k);
                let (dev, over) = deviation(&parts, &servers, &greedy(&parts, &servers));
                assert!(over <= 0.05, "n={n} k={k}: {:.2}% over", over * 100.0);
                worst_over = worst_over.max(over);
                // Nobody more than `over` above its share: at most that much above Eq. 6.
                let p = place(&parts, &servers).unwrap();
                let slowdown = slowest_machine(&p, n) / optimal_time(n, k, model, 1.0).unwrap();
                assert!(slowdown <= 1.0 + over + 1e-9, "n={n} k={k}: {slowdown}");
                if out_of_reach(&parts, n, k) {
                    unreachable.push((n, k, dev));
                } else {
                    assert!(dev <= 0.05, "n={n} k={k}: {:.2}% off", dev * 100.0);
                    worst = worst.max(dev);
                }
            }
        }
        println!(
            "ResNet-50 at 4 MiB: worst share deviation {:.2}%, worst overshoot {:.2}%, \
             out of reach for any placement: {unreachable:?}",
            worst * 100.0,
            worst_over * 100.0
        );
        // At n = 8, k = 7 a colocated server's share is 1/106 of the model, 0.96 MB, less
        // than 95% of it can be made of partitions under 1 MiB, and a 1 MiB one is 8.7% over.
        assert_eq!(
            unreachable.iter().map(|u| (u.0, u.1)).collect::<Vec<_>>(),
            [(8, 7)]
        );
    }

    #[test]
    fn smaller_partitions_bring_every_server_within_5_percent() {
        let parts = keyed(&resnet50(), 2 << 20);
        let servers = contiguous(8, 7);
        assert!(!out_of_reach(&parts, 8, 7));
        assert!(deviation(&parts, &servers, &greedy(&parts, &servers)).0 <= 0.05);
    }

    #[test]
    fn resnet50_placement_is_whole_and_deterministic() {
        let parts = keyed(&resnet50(), DEFAULT_PARTITION_BYTES);
        let model: u64 = parts.iter().map(|p| p.bytes).sum();
        let mut rng = Rng(50);
        for n in 2..=8 {
            for k in 0..=n + 2 {
                let servers = contiguous(n, k);
                let p = place(&parts, &servers).unwrap();
                let shares = optimal_shares(n, k).unwrap();
                for l in p.loads() {
                    let want = match l.kind {
                        ServerKind::Colocated => shares.colocated,
                        ServerKind::Cpu => shares.cpu,
                    };
                    assert_eq!(l.target, want);
                }
                assert_eq!(p.total_bytes(), model);
                assert_eq!(p.loads().iter().map(|l| l.bytes).sum::<u64>(), model);
                assert_eq!(place(&parts, &servers).unwrap(), p);
                let mut shuffled = parts.clone();
                rng.shuffle(&mut shuffled);
                assert_eq!(place(&shuffled, &servers).unwrap(), p);
            }
        }
    }

    #[test]
    fn greedy_beats_hashing_on_resnet50() {
        let (greedy, hashing) = (resnet50_worst(greedy), resnet50_worst(hashed));
        println!(
            "ResNet-50 worst share deviation: greedy {:.2}%, hashing {:.2}%",
            greedy * 100.0,
            hashing * 100.0
        );
        assert!(hashing > 4.0 * greedy, "greedy {greedy}, hashing {hashing}");
    }

    #[test]
    fn random_tensor_sets_are_placed_whole_and_deterministically() {
        let mut rng = Rng(7);
        for case in 0..300 {
            let count = 1 + rng.below(80) as usize;
            let names: Vec<String> = (0..count).map(|i| format!("t{i}")).collect();
            let specs: Vec<_> = names
                .iter()
                .map(|name| {
                    // Roughly log-uniform sizes, from 0 to 1M elements.
                    let bits = rng.below(21);
                    TensorSpec {
                        name,
                        elements: rng.below(1 << bits),
                        dtype: Dtype::ALL[rng.below(Dtype::ALL.len() as u64) as usize],
                    }
                })
                .collect();
            // 1 KiB to 8 MiB: from thousands of partitions per tensor to one.
            let partition_bytes = 1024 << rng.below(14);
            let parts = partition_tensors(&specs, partition_bytes).unwrap();
            let (n, k) = (1 + rng.below(10) as usize, rng.below(13) as usize);
            let mut ranks: Vec<u32> = (0..(n + k) as u32).map(|r| r * 3 + 1).collect();
            rng.shuffle(&mut ranks);
            let servers = ServerSet::new(ranks[..n].to_vec(), ranks[n..].to_vec()).unwrap();

            let p = place(&parts, &servers).unwrap();
            let total: u64 = parts.iter().map(|p| p.bytes).sum();
            assert_eq!(p.total_bytes(), total, "case {case}");
            let mut by_server = BTreeMap::new();
            for part in &parts {
                let rank = p.server_of(part.key).unwrap();
                assert!(
                    ranks.contains(&rank),
                    "case {case}: key {:#x} on server {rank}",
                    part.key
                );
                *by_server.entry(rank).or_insert(0) += part.bytes;
            }
            // The guarantee of the module docs.
            let largest = parts.iter().map(|p| p.bytes).max().unwrap_or(0) as f64;
            let used = p.loads().iter().filter(|l| l.target > 0.0).count() as f64;
            for l in p.loads() {
                assert_eq!(by_server.get(&l.rank).copied().unwrap_or(0), l.bytes);
                let bound = l.target * (total as f64 + used * largest);
                assert!(l.bytes as f64 <= bound * (1.0 + 1e-9), "case {case}: {l}");
            }
            let mut shuffled = parts.clone();
            rng.shuffle(&mut shuffled);
            assert_eq!(place(&shuffled, &servers).unwrap(), p, "case {case}");
        }
    }
}
