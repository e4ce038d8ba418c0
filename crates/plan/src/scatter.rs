//! Placement of a tensor declared on its own, outside any group.
//!
//! Group placement ([`crate::placement::place`]) balances bytes exactly, but it needs the
//! whole group, in the same order, on every worker. A tensor declared alone (Horovod's
//! `allreduce(tensor, name=...)` may come at any time, in any order across workers) must be
//! placed from its own key alone: weighted rendezvous hashing gives each partition to the
//! server with the best `-ln(u) / weight` score, `u` a hash of (key, server), so servers get
//! partitions in proportion to their optimal shares, and every worker computes the same
//! server without knowing what else was declared.

use crate::placement::{PlacementError, ServerSet};

/// A 64-bit mix (splitmix64's finaliser): consecutive keys spread over the whole range.
fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    x ^ (x >> 31)
}

/// The server (cluster-map rank) for a partition key.
pub fn scatter(key: u64, servers: &ServerSet) -> Result<u32, PlacementError> {
    let shares = servers.shares();
    let candidates = servers
        .colocated()
        .iter()
        .map(|&r| (r, shares.colocated))
        .chain(servers.cpu().iter().map(|&r| (r, shares.cpu)));
    let mut best: Option<(f64, u32)> = None;
    for (rank, weight) in candidates.filter(|(_, w)| *w > 0.0) {
        let h = mix(key ^ mix(u64::from(rank).wrapping_add(0x9e37_79b9_7f4a_7c15)));
        // Uniform in (0, 1], never 0, so ln is finite.
        let u = ((h >> 11) + 1) as f64 / (1u64 << 53) as f64;
        let score = -u.ln() / weight;
        if best.is_none_or(|(s, r)| score < s || (score == s && rank < r)) {
            best = Some((score, rank));
        }
    }
    best.map(|(_, r)| r).ok_or(PlacementError::NoMachines)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::placement::optimal_shares;

    #[test]
    fn shares_follow_the_equations_and_every_worker_agrees() {
        // n = 4 colocated servers (ranks 0..4) and k = 2 CPU servers (4, 5).
        let servers = ServerSet::new(vec![0, 1, 2, 3], vec![4, 5]).unwrap();
        let shares = optimal_shares(4, 2).unwrap();
        let mut counts = [0u32; 6];
        let keys = 60_000u64;
        for key in 0..keys {
            let r = scatter(key, &servers).unwrap();
            assert_eq!(scatter(key, &servers).unwrap(), r, "deterministic");
            counts[r as usize] += 1;
        }
        for (rank, count) in counts.iter().enumerate() {
            let want = if rank < 4 {
                shares.colocated
            } else {
                shares.cpu
            };
            let got = f64::from(*count) / keys as f64;
            assert!(
                (got - want).abs() / want < 0.05,
                "server {rank}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn servers_without_a_share_get_nothing() {
        // k = n: the colocated servers' share is zero (non-colocated PS).
        let servers = ServerSet::new(vec![0, 1], vec![2, 3]).unwrap();
        for key in 0..1000 {
            assert!(scatter(key, &servers).unwrap() >= 2);
        }
        // No colocated servers at all: only the CPU servers.
        let servers = ServerSet::non_colocated(4, vec![5, 7]).unwrap();
        for key in 0..1000 {
            assert!([5, 7].contains(&scatter(key, &servers).unwrap()));
        }
    }
}
