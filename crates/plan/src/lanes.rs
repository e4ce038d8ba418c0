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
//! A partition bound for a CPU server is cut into one piece per lane rather than sent
//! whole down one of them. Fair sharing makes every connection progress at once, so the
//! first sums come back only once every connection has delivered a whole piece, and the
//! last pushes end together, leaving the sums of a piece per connection to return on their
//! own: about 2·(connections × piece size)/B per round in which one direction idles. Whole
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

/// Cuts `partition`, of `elem`-byte elements, into `lanes` pieces of whole elements (fewer
/// if it has fewer elements), sizes differing by at most one element, each on the
/// partition's tensor and server. Piece j of partition i of tensor t is keyed
/// t << 32 | 2^31 | (i·lanes + j): the same on every worker with the same `lanes`, never a
/// partition's key, and consecutive, so that [`lane_of`] gives each piece its own lane.
/// One lane leaves it whole.
pub fn pieces(partition: Partition, elem: u64, lanes: u32) -> Result<Vec<Partition>, LaneError> {
    let Partition { key, .. } = partition;
    let elements = partition.bytes / elem;
    let count = u64::from(lanes).min(elements).max(1);
    if count == 1 {
        return Ok(vec![partition]);
    }
    let first = (key & 0xffff_ffff)
        .checked_mul(lanes.into())
        .filter(|f| f + u64::from(lanes) <= PIECE)
        .ok_or(LaneError::KeySpace { key, lanes })?;
    let (base, extra) = (elements / count, elements % count);
    let mut at = partition.offset;
    Ok((0..count)
        .map(|j| {
            let bytes = (base + u64::from(j < extra)) * elem;
            let piece = Partition {
                key: (key & !0xffff_ffff) | PIECE | (first + j),
                offset: at,
                bytes,
                ..partition
            };
            at += bytes;
            piece
        })
        .collect())
}

/// At most this many lanes per CPU server unless asked for more: beyond it the extra
/// threads and sockets cost more than the last few percent of balance is worth (c/g
/// reaches 8 only at k = n − 1 with n ≥ 8, where a colocated share is already tiny).
pub const AUTO_MAX: u32 = 8;

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
        assert_eq!(per_cpu_server(4, 3), 6);
        // 14/6 = 2.33 and 14/3 = 4.67 round to the nearest.
        assert_eq!(per_cpu_server(8, 2), 2);
        assert_eq!(per_cpu_server(8, 5), 5);
        // 14/1 is capped.
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
    fn pieces_cover_the_partition_with_consecutive_keys_of_their_own() {
        let key = 3 << 32 | 5;
        let got = pieces(part(key, 400, 40), 4, 3).unwrap();
        let base = 3 << 32 | PIECE | 15;
        assert_eq!(
            got,
            vec![
                part(base, 400, 16),
                part(base + 1, 416, 12),
                part(base + 2, 428, 12)
            ]
        );
        // Every piece on its own lane.
        let lanes: Vec<u32> = got.iter().map(|p| lane_of(p.key, 3)).collect();
        assert_eq!(lanes.len(), 3);
        assert!(lanes
            .iter()
            .all(|l| lanes.iter().filter(|m| *m == l).count() == 1));
        // One lane, or one element, leaves the partition as it is.
        assert_eq!(
            pieces(part(key, 8, 40), 4, 1).unwrap(),
            vec![part(key, 8, 40)]
        );
        assert_eq!(
            pieces(part(key, 8, 8), 8, 4).unwrap(),
            vec![part(key, 8, 8)]
        );
        // Two elements over four lanes: two pieces.
        assert_eq!(pieces(part(key, 0, 4), 2, 4).unwrap().len(), 2);
        assert_eq!(
            pieces(part(PIECE - 1, 0, 64), 4, 2),
            Err(LaneError::KeySpace {
                key: PIECE - 1,
                lanes: 2
            })
        );
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
