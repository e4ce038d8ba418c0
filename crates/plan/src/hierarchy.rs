//! Aggregation inside each machine first (BytePS §4.2.2): a tensor summed by workers on
//! several machines is reduced among each machine's workers in its shared memory, and only
//! then crosses the network, once per machine, not once per worker.
//!
//! A machine's workers that take part in a round split the tensor's partitions among
//! themselves into runs: the i-th of them (by rank) reduces the machine's sum of run i,
//! pushes it to the summation servers and pulls back the sum over every machine,
//! while pushing an empty push (a skip) for every other partition and taking only its
//! notice. Keys keep the tensor's members, so the servers' rounds, `join()` (a joined
//! worker's run goes to the others) and machines that do not aggregate (one worker, or
//! shared memory off) all mix freely; a machine's NIC carries each byte once per direction
//! whatever its workers, which is BytePS Eq. 6's traffic for n machines, plus a header per
//! skip.
//!
//! Runs are cut from the partitions ordered by server, so each worker of a machine talks
//! to about 1/G of the servers and each server hears from one worker per machine, the same
//! local index everywhere: as many flows per machine as with one worker, none of them
//! waiting on a sibling that the link happened to serve more slowly. Cut in tensor order
//! instead (every worker to every server), n = 4 machines of 4 workers and 4 CPU servers
//! at 250 Mbit/s ran at 0.78x of Eq. 6.
//!
//! Pure: the workers of a machine derive the same runs from the same partitions and the
//! same workers taking part.

use std::ops::Range;

use crate::partition::Partition;

/// The members of a tensor on worker `rank`'s machine (`machine_of` says a worker's
/// machine), ascending, when aggregating inside the machine first applies: the members
/// span several machines and this one holds at least two of them.
pub fn machine_members<K: PartialEq>(
    members: &[u32],
    rank: u32,
    machine_of: impl Fn(u32) -> K,
) -> Option<Vec<u32>> {
    let mine = machine_of(rank);
    let mut here: Vec<u32> = members
        .iter()
        .copied()
        .filter(|&r| machine_of(r) == mine)
        .collect();
    here.sort_unstable();
    (here.len() >= 2 && here.len() < members.len()).then_some(here)
}

/// Splits `parts` (a tensor's, in its order) into `g` runs of about equal bytes, each the
/// indices of its partitions, ascending: run m is what local index m carries. The runs are
/// consecutive stretches of the partitions ordered by (server, index), so a run holds
/// whole servers' partitions where it can. A run may be empty when there are fewer
/// partitions than workers per machine.
pub fn runs(parts: &[Partition], g: usize) -> Vec<Vec<usize>> {
    let mut order: Vec<usize> = (0..parts.len()).collect();
    order.sort_by_key(|&i| (parts[i].server, i));
    let total: u64 = parts.iter().map(|p| p.bytes).sum();
    let mut runs = Vec::with_capacity(g);
    let mut start = 0;
    let mut before = 0u64;
    for m in 1..=g as u64 {
        // Run m - 1 ends at the first partition at or past m/g of the bytes.
        let goal = total * m / g as u64;
        let mut end = start;
        while end < order.len() && (before < goal || m == g as u64) {
            before += parts[order[end]].bytes;
            end += 1;
        }
        let mut run = order[start..end].to_vec();
        run.sort_unstable();
        runs.push(run);
        start = end;
    }
    runs
}

/// The bytes of the tensor that `run` (ascending partition indices) covers, neighbouring
/// partitions merged into one range.
pub fn byte_ranges(parts: &[Partition], run: &[usize]) -> Vec<Range<usize>> {
    let mut ranges: Vec<Range<usize>> = Vec::new();
    for p in run.iter().map(|&i| &parts[i]) {
        let (start, end) = (p.offset as usize, (p.offset + p.bytes) as usize);
        match ranges.last_mut() {
            Some(last) if last.end == start => last.end = end,
            _ => ranges.push(start..end),
        }
    }
    ranges
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(lengths: &[u64]) -> Vec<Partition> {
        on_servers(lengths, &vec![0; lengths.len()])
    }

    fn on_servers(lengths: &[u64], servers: &[u32]) -> Vec<Partition> {
        let mut offset = 0;
        lengths
            .iter()
            .zip(servers)
            .enumerate()
            .map(|(i, (&bytes, &server))| {
                let p = Partition {
                    key: i as u64,
                    tensor: 0,
                    offset,
                    bytes,
                    server,
                };
                offset += bytes;
                p
            })
            .collect()
    }

    #[test]
    fn a_machine_aggregates_when_it_holds_two_members_of_a_tensor_spanning_machines() {
        let host = |r: u32| ["a", "a", "b", "b", "a"][r as usize];
        assert_eq!(machine_members(&[0, 1, 2, 3], 1, host), Some(vec![0, 1]));
        assert_eq!(machine_members(&[4, 0, 2, 1], 0, host), Some(vec![0, 1, 4]));
        assert_eq!(
            machine_members(&[0, 2, 3], 0, host),
            None,
            "alone on its machine"
        );
        assert_eq!(machine_members(&[0, 2, 3], 2, host), Some(vec![2, 3]));
        assert_eq!(
            machine_members(&[0, 1, 4], 1, host),
            None,
            "one machine: all local"
        );
    }

    #[test]
    fn runs_split_the_partitions_once_each_by_bytes() {
        let p = parts(&[4, 4, 4, 4, 4, 4]);
        assert_eq!(runs(&p, 2), [vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(runs(&p, 4), [vec![0, 1], vec![2], vec![3, 4], vec![5]]);
        assert_eq!(byte_ranges(&p, &[2]), std::slice::from_ref(&(8..12)));
        assert_eq!(byte_ranges(&p, &[0, 1, 3]), [0..8, 12..16]);
        // Fewer partitions than workers: some carry nothing.
        let p = parts(&[10]);
        assert_eq!(runs(&p, 3), [vec![0], vec![], vec![]]);
        assert!(byte_ranges(&p, &[]).is_empty());
        // A big partition does not make its neighbours' runs swallow the rest.
        let p = parts(&[1, 100, 1, 1]);
        assert_eq!(runs(&p, 2), [vec![0, 1], vec![2, 3]]);
        for lengths in [&[3u64, 5, 7, 11, 13][..], &[1; 17], &[]] {
            let servers: Vec<u32> = (0..lengths.len() as u32).map(|i| i * 7 % 3).collect();
            let p = on_servers(lengths, &servers);
            for g in 1..=6 {
                let r = runs(&p, g);
                assert_eq!(r.len(), g);
                let mut all: Vec<usize> = r.concat();
                all.sort_unstable();
                assert_eq!(all, (0..p.len()).collect::<Vec<_>>(), "{r:?}");
                assert!(r.iter().all(|run| run.windows(2).all(|w| w[0] < w[1])));
            }
        }
    }

    #[test]
    fn runs_keep_each_servers_partitions_together() {
        // Placed round-robin over 4 servers, as placement spreads equal partitions.
        let servers: Vec<u32> = (0..16).map(|i| i % 4).collect();
        let p = on_servers(&[8; 16], &servers);
        let r = runs(&p, 4);
        for (m, run) in r.iter().enumerate() {
            assert_eq!(
                run,
                &[m, m + 4, m + 8, m + 12],
                "worker {m} carries server {m}'s"
            );
        }
        // Two workers, four servers: two servers each.
        let r = runs(&p, 2);
        assert!(r[0].iter().all(|&i| p[i].server < 2));
        assert!(r[1].iter().all(|&i| p[i].server >= 2));
    }
}
