//! How many connections ("lanes") a worker opens to each summation server.
//!
//! TCP shares a congested link equally per connection, whatever each connection has to
//! carry. A worker machine's egress carries its pushes to the n − 1 other colocated servers
//! (g·M bytes each) and to the k CPU servers (c·M each), and its own colocated server's
//! n − 1 sums going back (g·M each): with one connection per server, a CPU server's
//! connection gets the same rate as a colocated one but has c/g times the bytes, so the CPU
//! servers, BytePS's critical path (Eq. 4), run below B while colocated connections finish
//! early, and every round ends with only the CPU servers' traffic left. Measured at
//! n = 4, B = 250 Mbit/s: about 0.8 of Eq. 6 for 0 < k < n, against 0.97 at k = 0 and 0.90 at
//! k = n, where all connections carry equal shares. Opening round(c/g) connections to each
//! CPU server and spreading its bytes evenly over them gives every connection about g·M,
//! so per-connection fairness becomes per-byte fairness: each server gets its Eq. 1 or 2
//! share of every link.
//!
//! A partition bound for a CPU server is cut into one piece per lane (of at least
//! [`MIN_PIECE_BYTES`]) rather than sent whole down one of them. Fair sharing makes every
//! connection progress at once, so the first sums come back only once every connection
//! has delivered a whole piece, and the last pushes end together, leaving the sums of a
//! piece per connection to return on their own: about 2·(connections × piece size)/B per
//! round in which one direction idles. Whole
//! partitions on r lanes would multiply that by r (measured at n = 4, k = 3 with 6 lanes:
//! 0.76 of Eq. 6, below one connection's 0.80); pieces of 1/r keep it at what one
//! connection per server costs. Every worker must therefore use the same number of lanes,
//! as it must the same partition size: pieces are keys of their own. (A server's push
//! window counts all its lanes' pieces, so it holds what one connection would.) With
//! both, at n = 4: 0.94, 0.94 and 0.92 of Eq. 6 for k = 1, 2, 3.

use thiserror::Error;

use crate::partition::Partition;
use crate::placement::optimal_shares;

/// Why a partition cannot be cut into pieces.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum LaneError {
    #[error("partition key {key:#x} has too high an index to be cut into {lanes} pieces")]
    KeySpace { key: u64, lanes: u32 },
}

/// Marks a piece's key. Partition indices stay below it unless a tensor has 2^31
/// partitions (512 TiB at 256 KiB each), which nothing declares.
const PIECE: u64 = 1 << 31;

/// The lane, of a server's `lanes`, that carries `key`: the same for all of the key's
/// pushes, pulls and sums, so they stay in order on one connection.
pub fn lane_of(key: u64, lanes: u32) -> u32 {
    (key % u64::from(lanes)) as u32
}

/// The smallest piece a partition is cut into: each piece is a message of its own (a
/// header, system calls on both ends, a round on the server). ResNet-50's 161 tensors,
/// most of them batch-norm parameters far smaller than a partition, were cut six ways each
/// at k = 3 (down to pieces of 43 bytes), which took the workers' CPU per byte to twice
/// k = 0's and goodput to 0.72 of Eq. 6. Not much larger, though: cutting is what gives a
/// CPU server its Eq. 1 share of every link at a round's start and end, and 128 KiB
/// partitions sent whole on 3 lanes ran at 0.78 of Eq. 6 (250 Mbit/s, k = 2) where their
/// 43 KiB pieces ran at 0.90-0.92; with 64 KiB the simulator put that run 11% slower
/// than measured. (How large a derived partition is, so that its pieces are not too many,
/// is `partition::derived_partition_bytes`'s concern.)
pub const MIN_PIECE_BYTES: u64 = 32 << 10;

/// Cuts `partition`, of `elem`-byte elements, into one piece per lane, fewer where pieces
/// would be smaller than [`MIN_PIECE_BYTES`] (or have no element): pieces of whole
/// elements, sizes differing by at most one element, each on the partition's tensor and
/// server. A partition left whole keeps its key and travels on [`lane_of`] its key. Piece j
/// of partition i of tensor t is keyed t << 32 | 2^31 | (i·lanes + (s + j) mod lanes), s = 0
/// when there is a piece per lane and s = i when there are fewer: the same on every worker
/// with the same `lanes`, never a partition's key, and distinct within a partition's block
/// of `lanes` keys; [`lane_of`] puts piece j on lane (c + s + j) mod lanes, c fixed per
/// tensor, so the pieces of one partition take distinct lanes, and partitions cut into
/// fewer pieces than lanes start on a lane that turns with i, spreading their bytes over
/// all lanes.
pub fn pieces(partition: Partition, elem: u64, lanes: u32) -> Result<Vec<Partition>, LaneError> {
    let Partition { key, .. } = partition;
    let elements = partition.bytes / elem;
    let count = u64::from(lanes)
        .min(elements)
        .min(partition.bytes / MIN_PIECE_BYTES)
        .max(1);
    if count == 1 {
        return Ok(vec![partition]);
    }
    let index = key & 0xffff_ffff;
    let lanes = u64::from(lanes);
    let first = index
        .checked_mul(lanes)
        .filter(|f| f + lanes <= PIECE)
        .ok_or(LaneError::KeySpace {
            key,
            lanes: lanes as u32,
        })?;
    // A piece on every lane needs no turning.
    let turn = if count < lanes { index } else { 0 };
    let (base, extra) = (elements / count, elements % count);
    let mut at = partition.offset;
    Ok((0..count)
        .map(|j| {
            let bytes = (base + u64::from(j < extra)) * elem;
            let piece = Partition {
                key: (key & !0xffff_ffff) | PIECE | (first + (turn + j) % lanes),
                offset: at,
                bytes,
                ..partition
            };
            at += bytes;
            piece
        })
        .collect())
}

/// At most this many lanes per CPU server unless asked for more. Every lane costs a
/// thread and a socket on each end, and a derived partition holds a piece of at least
/// `partition::DERIVED_MIN_PIECE_BYTES` per lane, so past 4 lanes partitions double in
/// size and each server gets half as many per round to overlap pushes with pulls. At
/// n = 4, k = 3 (c/g = 6), 64 MB in 8 tensors: 4 lanes (512 KiB partitions) ran at
/// 0.89-0.93 of Eq. 6 at 1 Gbit/s (three runs) and 0.91 at 250 Mbit/s, 6 lanes (1 MiB) at
/// 0.87-0.89 (four runs) and 0.88, 3 lanes at 0.89 and 2 at 0.85: a CPU server's share of
/// each link 12/15 of its Eq. 2 share's 18/21 costs less than coarser partitions.
pub const AUTO_MAX: u32 = 4;

/// The most lanes a worker may open to one server: a summation server accepts this many
/// connections per worker (sumflow-summation's `MAX_CONNECTIONS_PER_WORKER`).
pub const MAX: u32 = 16;

/// Lanes to each CPU server with `n` worker machines and `k` CPU servers, each colocated
/// server getting one: round(c/g) of Eq. 1 over Eq. 2, which is 2(n − 1)/(n − k). One when
/// every server has the same share (k = 0 or k ≥ n, where g = 0) or n = 0.
pub fn per_cpu_server(n: u32, k: u32) -> u32 {
    match optimal_shares(n, k) {
        Ok(s) if s.colocated > 0.0 && s.cpu > 0.0 => {
            ((s.cpu / s.colocated).round() as u32).clamp(1, AUTO_MAX)
        }
        _ => 1,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lanes_follow_the_ratio_of_eq_1_to_eq_2() {
        // 2(n − 1)/(n − k): n = 4 gives 6/3, 6/2, 6/1.
        assert_eq!(per_cpu_server(4, 1), 2);
        assert_eq!(per_cpu_server(4, 2), 3);
        // 6/1 is capped.
        assert_eq!(per_cpu_server(4, 3), AUTO_MAX);
        // 14/6 = 2.33 and 14/4 = 3.5 round to the nearest.
        assert_eq!(per_cpu_server(8, 2), 2);
        assert_eq!(per_cpu_server(8, 4), 4);
        // 14/3 = 4.67 and 14/1 are capped.
        assert_eq!(per_cpu_server(8, 5), AUTO_MAX);
        assert_eq!(per_cpu_server(8, 7), AUTO_MAX);
        // n = 2: 2/1.
        assert_eq!(per_cpu_server(2, 1), 2);
    }

    /// A partition of tensor 3 on server 7.
    fn part(key: u64, offset: u64, bytes: u64) -> Partition {
        Partition {
            key,
            tensor: 3,
            offset,
            bytes,
            server: 7,
        }
    }

    #[test]
    fn pieces_cover_the_partition_each_on_a_lane_of_its_own() {
        const M: u64 = MIN_PIECE_BYTES;
        let key = 3 << 32 | 5;
        // 3 lanes, 3 pieces' worth and two f32 elements more.
        let got = pieces(part(key, 400, 3 * M + 8), 4, 3).unwrap();
        let block = 3 << 32 | PIECE | 15;
        // Partition 5's pieces, in its block of keys from 15, one per lane.
        assert_eq!(
            got,
            vec![
                part(block, 400, M + 4),
                part(block + 1, 400 + M + 4, M + 4),
                part(block + 2, 400 + 2 * M + 8, M)
            ]
        );
        let mut lanes: Vec<u32> = got.iter().map(|p| lane_of(p.key, 3)).collect();
        lanes.sort_unstable();
        assert_eq!(lanes, [0, 1, 2], "one piece per lane");
        // One lane, or too little for two pieces, leaves the partition as it is.
        assert_eq!(
            pieces(part(key, 8, 4 * M), 4, 1).unwrap(),
            vec![part(key, 8, 4 * M)]
        );
        assert_eq!(
            pieces(part(key, 8, 2 * M - 4), 4, 6).unwrap(),
            vec![part(key, 8, 2 * M - 4)]
        );
        assert_eq!(
            pieces(part(PIECE - 1, 0, 2 * M), 4, 2),
            Err(LaneError::KeySpace {
                key: PIECE - 1,
                lanes: 2
            })
        );
    }

    #[test]
    fn partitions_cut_into_fewer_pieces_than_lanes_spread_over_all_of_them() {
        // 2.5 pieces' worth over 6 lanes: 2 pieces each, starting on a turning lane.
        let mut load = [0u64; 6];
        let mut keys = std::collections::BTreeSet::new();
        for i in 0..6u64 {
            let got = pieces(part(3 << 32 | i, 0, 5 * MIN_PIECE_BYTES / 2), 4, 6).unwrap();
            assert_eq!(got.len(), 2);
            assert_ne!(lane_of(got[0].key, 6), lane_of(got[1].key, 6));
            for p in got {
                load[lane_of(p.key, 6) as usize] += p.bytes;
                assert!(keys.insert(p.key), "piece keys are distinct");
            }
        }
        assert!(load.iter().all(|&b| b == load[0]), "{load:?}");
    }

    #[test]
    fn equal_shares_need_one_lane() {
        for n in 0..6 {
            assert_eq!(per_cpu_server(n, 0), 1, "k = 0, n = {n}");
            for k in n.max(1)..n + 3 {
                assert_eq!(per_cpu_server(n, k), 1, "n = {n}, k = {k}");
            }
        }
        // n = 1: CPU servers get nothing to carry.
        assert_eq!(per_cpu_server(1, 3), 1);
    }
}
