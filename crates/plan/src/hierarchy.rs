//! Aggregation inside each machine first (BytePS §4.2.2): a tensor summed by workers on
//! several machines is reduced among each machine's workers in its shared memory, and only
//! then crosses the network, once per machine, not once per worker.
//!
//! A machine's workers that take part in a round split the tensor's partitions among
//! themselves into contiguous runs: the i-th of them (by rank) reduces the machine's sum
//! of run i, pushes it to the summation servers and pulls back the sum over every machine,
//! while pushing an empty push (a skip) for every other partition and taking only its
//! notice. Keys keep the tensor's members, so the servers' rounds, `join()` (a joined
//! worker's run goes to the others) and machines that do not aggregate (one worker, or
//! shared memory off) all mix freely; a machine's NIC carries each byte once per direction
//! whatever its workers, which is BytePS Eq. 6's traffic for n machines, plus a header per
//! skip.
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

/// Splits `parts` (a tensor's, in its order) into `g` contiguous runs of about equal
/// bytes: run m is what local index m carries. A run may be empty when there are fewer
/// partitions than workers per machine.
pub fn runs(parts: &[Partition], g: usize) -> Vec<Range<usize>> {
    let total: u64 = parts.iter().map(|p| p.bytes).sum();
    let mut runs = Vec::with_capacity(g);
    let mut start = 0;
    let mut before = 0u64;
    for m in 1..=g as u64 {
        // Run m - 1 ends at the first partition boundary at or past m/g of the bytes.
        let goal = total * m / g as u64;
        let mut end = start;
        while end < parts.len() && (before < goal || m == g as u64) {
            before += parts[end].bytes;
            end += 1;
        }
        runs.push(start..end);
        start = end;
    }
    runs
}

/// The bytes of the tensor that run `run` of `parts` covers.
pub fn byte_range(parts: &[Partition], run: &Range<usize>) -> Range<usize> {
    match (
        parts.get(run.start),
        run.end.checked_sub(1).and_then(|l| parts.get(l)),
    ) {
        (Some(first), Some(last)) if !run.is_empty() => {
            first.offset as usize..(last.offset + last.bytes) as usize
        }
        _ => 0..0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(lengths: &[u64]) -> Vec<Partition> {
        let mut offset = 0;
        lengths
            .iter()
            .enumerate()
            .map(|(i, &bytes)| {
                let p = Partition {
                    key: i as u64,
                    tensor: 0,
                    offset,
                    bytes,
                    server: 0,
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
        assert_eq!(runs(&p, 2), [0..3, 3..6]);
        assert_eq!(runs(&p, 4), [0..2, 2..3, 3..5, 5..6]);
        assert_eq!(byte_range(&p, &(2..3)), 8..12);
        // Fewer partitions than workers: some carry nothing.
        let p = parts(&[10]);
        assert_eq!(runs(&p, 3), [0..1, 1..1, 1..1]);
        assert_eq!(byte_range(&p, &(1..1)), 0..0);
        // A big partition does not make its neighbours' runs swallow the rest.
        let p = parts(&[1, 100, 1, 1]);
        assert_eq!(runs(&p, 2), [0..2, 2..4]);
        for lengths in [&[3u64, 5, 7, 11, 13][..], &[1; 17], &[]] {
            let p = parts(lengths);
            for g in 1..=6 {
                let r = runs(&p, g);
                assert_eq!(r.len(), g);
                assert_eq!(r.first().map(|r| r.start), Some(0));
                assert!(r.windows(2).all(|w| w[0].end == w[1].start), "{r:?}");
                assert_eq!(r.last().map(|r| r.end), Some(p.len()));
            }
        }
    }
}
