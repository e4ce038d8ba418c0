//! Cutting tensors into partitions, and naming every partition with a key all workers agree
//! on.
//!
//! BytePS (§4.1) cuts every tensor into parts of at most 4 MB. Small parts let placement
//! spread the model over the servers in the proportions of Eq. 1 and 2, and let the push of
//! one part overlap the pull of another; parts much smaller than that pay per-message
//! overhead for nothing. Every partition of a tensor is full-size except the last, which
//! holds the remainder: a partition's bounds and key then depend only on the tensor's own
//! size and the partition size, never on how the remainder happens to fall, and full
//! partitions stay aligned to the partition size in the tensor's memory.

use std::collections::HashMap;

use sumflow_wire::message::DATA_META_LEN;
use sumflow_wire::{Dtype, DEFAULT_MAX_BODY};
use thiserror::Error;

/// BytePS's partition size, which its authors found to work well (§4.1, footnote 6); tune it
/// per job when messages are too many (raise it) or placement too lumpy (lower it).
pub const DEFAULT_PARTITION_BYTES: u64 = 4 << 20;

/// The fewest partitions a server should get from one declaration when the partition size
/// is derived ([`derived_partition_bytes`]): enough for the pushes of some to overlap the
/// pulls of others, and for placement to follow Eq. 1 and 2 closely. On the emulated
/// cluster (BENCHMARKS.md, "The partition size at 1 Gbit/s"), 2 to 4 per server ran at
/// 0.64-0.93 of Eq. 6 and 16 to 32 at 0.90-0.96; against grids of fixed sizes at
/// 250 Mbit/s and 1 Gbit/s, ResNet-50's set ran best at 256-512 KiB, where 16 per server
/// gave 1 MiB (0.89-0.93 of Eq. 6 where 32 per server reaches 0.93-0.97).
pub const DERIVED_PARTITIONS_PER_SERVER: u64 = 32;

/// The smallest derived partition: every partition costs CPU on a worker and a server
/// (system calls, a header, a round), and 128 KiB partitions saturated the emulated
/// cluster's CPU where 512 KiB did not.
pub const DERIVED_MIN_PARTITION_BYTES: u64 = 256 << 10;

/// The smallest derived partition on machines of several workers, whatever their number:
/// the floor above divided by the workers per machine stops here. On the emulated cluster
/// (n = 4 machines of 4 workers, k = 4), 128 KiB ran at 0.86 of Eq. 6 at 250 Mbit/s and
/// 0.67 at 1 Gbit/s where the 2 cores were the limit; 64 KiB at 0.87 and 0.50.
pub const DERIVED_MIN_CARRIED_BYTES: u64 = 128 << 10;

/// The smallest piece a derived partition is cut into for a server with several
/// connections ([`crate::lanes`]): each piece is a message of its own. At n = 4, k = 3 (6
/// connections per CPU server), 512 KiB partitions in 85 KiB pieces saturated the emulated
/// cluster's CPU and ran at 0.74 of Eq. 6; in 170 KiB pieces, 0.87.
pub const DERIVED_MIN_PIECE_BYTES: u64 = 128 << 10;

/// The link rate BytePS's partition size was chosen for (§6.1: 4 MB on its 100 Gbit/s
/// testbed). A derived partition spends at least as long on its link as BytePS's does
/// there, 0.34 ms: every partition costs a message on a worker and a server whatever the
/// link, and at 100 Gbit/s a 256 KiB partition passes in 21 µs, less than that cost, so
/// the CPU rather than the link would set the pace. At 1 Gbit/s this asks for 42 KB, and
/// the CPU floors above govern.
pub const DERIVED_REFERENCE_LINK_BITS: u64 = 100_000_000_000;

/// A partition size derived from what it partitions, and why, for the log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DerivedSize {
    pub bytes: u64,
    pub reason: String,
}

/// The partition size of a declaration of `bytes` (a model's gradients, or one tensor)
/// spread over `servers` summation servers, the busiest taking `lanes` connections, from
/// machines of at most `carriers` workers over links of `link_bits` a second (the
/// slowest worker's, when known), when no size is set: the largest power of two
/// that gives every server [`DERIVED_PARTITIONS_PER_SERVER`] partitions from each of a
/// machine's workers, at least [`DERIVED_MIN_PARTITION_BYTES`] over the workers per machine
/// (a power of two; never below [`DERIVED_MIN_CARRIED_BYTES`]), pieces of
/// at least [`DERIVED_MIN_PIECE_BYTES`] and as long on a machine's link, shared by its
/// workers, as BytePS's size at [`DERIVED_REFERENCE_LINK_BITS`], at most BytePS's
/// [`DEFAULT_PARTITION_BYTES`]. A
/// power of two keeps full partitions aligned to pages and SIMD widths, and a size every
/// worker computes alike from the same declaration and cluster map.
///
/// Why the workers per machine: a machine's G workers each carry 1/G of its partitions
/// (aggregation inside the machine first), side by side on its link, so each pipelines
/// only 1/G of a server's partitions; at the start of a round no sum returns before each
/// has pushed its first ones, and at the end the last sums all return after the pushes.
/// On the emulated cluster (n = 4, k = 4, 250 Mbit/s, 4 workers per machine) 256 KiB
/// partitions ran at 0.78 of Eq. 6, 128 KiB at 0.86.
pub fn derived_partition_bytes(
    bytes: u64,
    servers: usize,
    lanes: u32,
    carriers: u32,
    link_bits: Option<u64>,
) -> DerivedSize {
    let servers = servers.max(1) as u64;
    let carriers = u64::from(carriers.max(1));
    let wanted = bytes / (servers * DERIVED_PARTITIONS_PER_SERVER * carriers);
    let power = power_at_most(wanted);
    let smallest =
        (DERIVED_MIN_PARTITION_BYTES / carriers.next_power_of_two()).max(DERIVED_MIN_CARRIED_BYTES);
    // One connection sends a partition whole: only cut partitions have pieces.
    let pieces = if lanes > 1 {
        (u64::from(lanes) * DERIVED_MIN_PIECE_BYTES).next_power_of_two()
    } else {
        0
    };
    // A machine's workers send side by side: each has 1/G of the link.
    let on_link = link_bits.map_or(0, |bits| {
        let bytes = u128::from(bits) * u128::from(DEFAULT_PARTITION_BYTES)
            / u128::from(DERIVED_REFERENCE_LINK_BITS * carriers);
        power_at_most(u64::try_from(bytes).unwrap_or(u64::MAX))
    });
    let floor = pieces
        .clamp(smallest, DEFAULT_PARTITION_BYTES)
        .max(on_link.min(DEFAULT_PARTITION_BYTES));
    let chosen = power.clamp(floor, DEFAULT_PARTITION_BYTES);
    let why = if power < floor && floor == on_link && on_link > pieces.max(smallest) {
        "the smallest derived size at that link rate: a partition spends at least 0.34 ms on \
         its machine's link (BytePS's 4 MiB at 100 Gbit/s)"
    } else if power < floor && floor > smallest {
        "the smallest derived size for that many connections to a server: pieces of at least \
         128 KiB"
    } else if power < floor {
        "the smallest derived size: smaller ones cost more CPU per byte than they gain"
    } else if power > DEFAULT_PARTITION_BYTES {
        "BytePS's size, the largest derived: placement needs no coarser pieces"
    } else if carriers > 1 {
        "the largest power of two giving each server 32 partitions per round from each of a \
         machine's workers"
    } else {
        "the largest power of two giving each server 32 partitions per round"
    };
    let connections = if lanes > 1 {
        format!(" ({lanes} connections to the busiest)")
    } else {
        String::new()
    };
    let machines = if carriers > 1 {
        format!(", {carriers} workers per machine")
    } else {
        String::new()
    };
    let links = link_bits.map_or_else(String::new, |bits| format!(", {} links", human_rate(bits)));
    DerivedSize {
        bytes: chosen,
        reason: format!(
            "{} over {servers} server(s){connections}{machines}{links}: {} partitions, {why}",
            human_bytes(bytes),
            human_bytes(chosen)
        ),
    }
}

/// The largest power of two at most `bytes`; 0 for 0.
fn power_at_most(bytes: u64) -> u64 {
    match bytes {
        0 => 0,
        b => 1 << (63 - b.leading_zeros()),
    }
}

/// `bits` a second in Mbit/s or Gbit/s, for log lines.
fn human_rate(bits: u64) -> String {
    let gbits = bits as f64 / 1e9;
    if gbits >= 1.0 {
        format!("{} Gbit/s", trim(gbits))
    } else {
        format!("{} Mbit/s", trim(bits as f64 / 1e6))
    }
}

/// A figure with at most one decimal, none when it is whole.
fn trim(value: f64) -> String {
    if (value - value.round()).abs() < 0.05 {
        format!("{value:.0}")
    } else {
        format!("{value:.1}")
    }
}

/// `bytes` in KiB, MiB or GiB, for log lines.
fn human_bytes(bytes: u64) -> String {
    const UNITS: [&str; 4] = ["B", "KiB", "MiB", "GiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if value.fract() == 0.0 {
        format!("{value:.0} {}", UNITS[unit])
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// The partition size of the `fifo` scheduler, which sends whole tensors as the frameworks
/// it stands for do (ByteScheduler's baseline): the largest push a server takes by default
/// (its frame limit less a push's header), in whole pages. Only tensors larger than that
/// are cut.
pub const WHOLE_TENSOR_BYTES: u64 = (DEFAULT_MAX_BODY as u64 - DATA_META_LEN as u64) & !4095;

/// A run of one tensor's bytes that is pushed, summed and pulled as one key: a partition
/// of the tensor, or a lane's piece of one ([`crate::lanes`]).
///
/// Every step carries it whole: [`partition`] cuts it, placement ([`crate::placement`],
/// [`crate::scatter`]) sets its server, [`crate::lanes`] cuts it into pieces per lane, and
/// the [`crate::scheduler`] lets it out; the runtime's pipeline and the simulator send it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Partition {
    /// The key every worker names it by.
    pub key: u64,
    /// Its tensor's declaration index.
    pub tensor: u32,
    /// Its first byte in the tensor; full partitions stay aligned to the partition size.
    pub offset: u64,
    /// Its length in bytes: whole elements, never zero.
    pub bytes: u64,
    /// The summation server that sums it, as the caller numbers servers (the runtime: the
    /// cluster map's rank); set by placement, 0 until then.
    pub server: u32,
}

/// A tensor as declared by the training script, in declaration order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorSpec<'a> {
    pub name: &'a str,
    pub elements: u64,
    pub dtype: Dtype,
}

/// Why a tensor or a declaration cannot be partitioned.
#[derive(Clone, Debug, PartialEq, Eq, Error)]
pub enum PartitionError {
    #[error(
        "tensor '{tensor}': a partition size of {partition_bytes} B cannot hold one {dtype} \
         element ({} B); use a partition size of at least {} B",
        .dtype.size(), .dtype.size()
    )]
    PartitionTooSmall {
        tensor: String,
        dtype: Dtype,
        partition_bytes: u64,
    },
    #[error(
        "tensor '{tensor}': {elements} {dtype} elements in partitions of {partition_bytes} B make \
         {count} partitions, more than the {} a partition key can number; raise the partition \
         size",
        u32::MAX
    )]
    TooManyPartitions {
        tensor: String,
        elements: u64,
        dtype: Dtype,
        partition_bytes: u64,
        count: u64,
    },
    #[error(
        "{count} tensors declared, more than the {} a partition key can number",
        u32::MAX
    )]
    TooManyTensors { count: usize },
    #[error(
        "tensor '{name}' is declared twice (declarations {first} and {second}); every tensor \
         needs its own name"
    )]
    DuplicateName {
        name: String,
        first: usize,
        second: usize,
    },
}

/// Splits `spec`, the tensor of declaration index `tensor`, into partitions of at most
/// `partition_bytes`, keyed with [`partition_key`]; a tensor without elements has nothing
/// to send and gets no partitions.
///
/// A partition holds whole elements, so the per-partition element count is rounded down.
pub fn partition(
    tensor: u32,
    spec: &TensorSpec<'_>,
    partition_bytes: u64,
) -> Result<Vec<Partition>, PartitionError> {
    let TensorSpec {
        name,
        elements,
        dtype,
    } = *spec;
    let size = dtype.size() as u64;
    let per_partition = partition_bytes / size;
    if per_partition == 0 {
        return Err(PartitionError::PartitionTooSmall {
            tensor: name.to_string(),
            dtype,
            partition_bytes,
        });
    }
    let count = elements.div_ceil(per_partition);
    let count = u32::try_from(count).map_err(|_| PartitionError::TooManyPartitions {
        tensor: name.to_string(),
        elements,
        dtype,
        partition_bytes,
        count,
    })?;
    Ok((0..count)
        .map(|index_in_tensor| {
            let first = u64::from(index_in_tensor) * per_partition;
            Partition {
                key: partition_key(tensor, index_in_tensor),
                tensor,
                offset: first * size,
                bytes: per_partition.min(elements - first) * size,
                server: 0,
            }
        })
        .collect())
}

/// The key of a tensor's partition: the tensor's declaration index in the high 32 bits, the
/// partition's index in the low 32.
///
/// Every worker computes it from the declaration order alone, so the same partition gets
/// the same key everywhere without any exchange, and declaring more tensors later never
/// changes the keys of earlier ones.
pub const fn partition_key(tensor_index: u32, index_in_tensor: u32) -> u64 {
    (tensor_index as u64) << 32 | index_in_tensor as u64
}

/// Partitions a whole declaration (tensors in declaration order, each keyed by its index)
/// with [`partition`].
///
/// Workers must pass the same declaration to get the same keys; checking that they agree
/// is the caller's job.
///
/// ```
/// use sumflow_plan::partition::{partition_tensors, TensorSpec};
/// use sumflow_wire::Dtype;
///
/// let decl = [
///     TensorSpec { name: "fc.weight", elements: 2_500_000, dtype: Dtype::F32 },
///     TensorSpec { name: "fc.bias", elements: 1000, dtype: Dtype::F32 },
/// ];
/// let parts = partition_tensors(&decl, 4 << 20)?;
/// let keys: Vec<_> = parts.iter().map(|p| (p.key, p.bytes)).collect();
/// assert_eq!(keys, [(0, 4 << 20), (1, 4 << 20), (2, 1_611_392), (1 << 32, 4000)]);
/// # Ok::<(), sumflow_plan::partition::PartitionError>(())
/// ```
pub fn partition_tensors(
    tensors: &[TensorSpec<'_>],
    partition_bytes: u64,
) -> Result<Vec<Partition>, PartitionError> {
    if u32::try_from(tensors.len()).is_err() {
        return Err(PartitionError::TooManyTensors {
            count: tensors.len(),
        });
    }
    let mut first_of: HashMap<&str, usize> = HashMap::with_capacity(tensors.len());
    let mut out = Vec::new();
    for (tensor_index, spec) in (0u32..).zip(tensors) {
        if let Some(first) = first_of.insert(spec.name, tensor_index as usize) {
            return Err(PartitionError::DuplicateName {
                name: spec.name.to_string(),
                first,
                second: tensor_index as usize,
            });
        }
        out.extend(partition(tensor_index, spec, partition_bytes)?);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(name: &str, elements: u64, dtype: Dtype) -> TensorSpec<'_> {
        TensorSpec {
            name,
            elements,
            dtype,
        }
    }

    #[test]
    fn full_partitions_then_the_remainder() {
        let parts = partition(3, &spec("w", 10, Dtype::F32), 16).unwrap();
        let spans: Vec<_> = parts.iter().map(|p| (p.key, p.offset, p.bytes)).collect();
        assert_eq!(
            spans,
            vec![
                (3 << 32, 0, 16),
                (3 << 32 | 1, 16, 16),
                (3 << 32 | 2, 32, 8)
            ]
        );
        assert!(parts.iter().all(|p| p.tensor == 3));
    }

    #[test]
    fn the_derived_size_gives_every_server_32_partitions_within_its_bounds() {
        let mib = 1u64 << 20;
        // 64 MiB over 8 servers: 256 KiB is the largest power of two giving 32 each.
        let d = derived_partition_bytes(64 * mib, 8, 1, 1, None);
        assert_eq!(d.bytes, 256 << 10);
        assert_eq!(
            d.reason,
            "64 MiB over 8 server(s): 256 KiB partitions, the largest power of two giving each \
             server 32 partitions per round"
        );
        // Not a power of two: rounded down, so each server gets at least 32.
        assert_eq!(
            derived_partition_bytes(100 * mib, 6, 1, 1, None).bytes,
            mib / 2
        );
        assert!(100 * mib / (6 * (mib / 2)) >= 32);
        // A small tensor, or none: the floor. A huge set: BytePS's 4 MiB.
        assert_eq!(
            derived_partition_bytes(mib, 4, 1, 1, None).bytes,
            DERIVED_MIN_PARTITION_BYTES
        );
        assert_eq!(
            derived_partition_bytes(0, 4, 1, 1, None).bytes,
            DERIVED_MIN_PARTITION_BYTES
        );
        assert!(derived_partition_bytes(mib, 4, 1, 1, None)
            .reason
            .contains("smallest"));
        let huge = derived_partition_bytes(64 << 30, 2, 1, 1, None);
        assert_eq!(huge.bytes, DEFAULT_PARTITION_BYTES);
        assert!(
            huge.reason.starts_with("64 GiB over 2 server(s): 4 MiB"),
            "{}",
            huge.reason
        );
        // 6 connections to a CPU server (asked for: n = 4, k = 3 gets 4 by default): pieces
        // of 128 KiB or more, so 768 KiB rounded up; 4 connections (n = 4, k = 3): 512 KiB;
        // 3 connections (k = 2): 384 KiB, below 512 KiB anyway.
        let k3 = derived_partition_bytes(61 * mib, 7, 6, 1, None);
        assert_eq!(k3.bytes, mib);
        assert_eq!(
            k3.reason,
            "61 MiB over 7 server(s) (6 connections to the busiest): 1 MiB partitions, the \
             smallest derived size for that many connections to a server: pieces of at least \
             128 KiB"
        );
        assert_eq!(
            derived_partition_bytes(61 * mib, 7, 4, 1, None).bytes,
            mib / 2
        );
        assert_eq!(
            derived_partition_bytes(61 * mib, 6, 3, 1, None).bytes,
            mib / 2
        );
        // No servers counts as one rather than dividing by zero.
        assert_eq!(
            derived_partition_bytes(128 * mib, 0, 0, 1, None).bytes,
            DEFAULT_PARTITION_BYTES
        );
    }

    #[test]
    fn machines_of_several_workers_get_partitions_for_each() {
        let mib = 1u64 << 20;
        // 128 MiB over 4 servers from machines of 2 workers: 32 partitions per server from
        // each is 512 KiB; from 4 workers, 256 KiB.
        assert_eq!(
            derived_partition_bytes(128 * mib, 4, 1, 2, None).bytes,
            512 << 10
        );
        let d = derived_partition_bytes(128 * mib, 4, 1, 4, None);
        assert_eq!(d.bytes, 256 << 10);
        assert_eq!(
            d.reason,
            "128 MiB over 4 server(s), 4 workers per machine: 256 KiB partitions, the largest \
             power of two giving each server 32 partitions per round from each of a \
             machine's workers"
        );
        // The floor falls with the workers per machine, to 128 KiB at most.
        assert_eq!(derived_partition_bytes(mib, 4, 1, 2, None).bytes, 128 << 10);
        assert_eq!(derived_partition_bytes(mib, 4, 1, 3, None).bytes, 128 << 10);
        let many = derived_partition_bytes(mib, 4, 1, 8, None);
        assert_eq!(many.bytes, DERIVED_MIN_CARRIED_BYTES);
        assert!(many
            .reason
            .contains("128 KiB partitions, the smallest derived size"));
        // Pieces per connection keep their own floor.
        assert_eq!(derived_partition_bytes(mib, 7, 6, 4, None).bytes, mib);
        // One worker per machine (or none given): as before.
        assert_eq!(
            derived_partition_bytes(64 * mib, 8, 1, 0, None),
            derived_partition_bytes(64 * mib, 8, 1, 1, None)
        );
    }

    #[test]
    fn fast_links_raise_the_floor_to_a_third_of_a_millisecond_on_the_link() {
        let mib = 1u64 << 20;
        let gbit = 1_000_000_000u64;
        // ResNet-50's 97.5 MiB over 8 servers asks for 256 KiB; at 100 Gbit/s that passes
        // in 21 µs, so BytePS's 4 MiB.
        let fast = derived_partition_bytes(97 * mib, 8, 1, 1, Some(100 * gbit));
        assert_eq!(fast.bytes, 4 * mib);
        assert_eq!(
            fast.reason,
            "97 MiB over 8 server(s), 100 Gbit/s links: 4 MiB partitions, the smallest derived \
             size at that link rate: a partition spends at least 0.34 ms on its machine's \
             link (BytePS's 4 MiB at 100 Gbit/s)"
        );
        assert_eq!(
            derived_partition_bytes(97 * mib, 8, 1, 1, Some(25 * gbit)).bytes,
            mib
        );
        // 10 Gbit/s asks 419 KB: 256 KiB, the floor it would have had anyway.
        let ten = derived_partition_bytes(97 * mib, 8, 1, 1, Some(10 * gbit));
        assert_eq!(ten.bytes, 256 << 10);
        assert!(ten.reason.contains("10 Gbit/s links"), "{}", ten.reason);
        assert!(ten.reason.contains("32 partitions"), "{}", ten.reason);
        // At 1 Gbit/s and below the rate changes nothing: the CPU floors govern.
        for bits in [gbit, 250_000_000] {
            assert_eq!(
                derived_partition_bytes(mib, 4, 1, 1, Some(bits)).bytes,
                derived_partition_bytes(mib, 4, 1, 1, None).bytes
            );
        }
        assert!(derived_partition_bytes(mib, 4, 1, 1, Some(250_000_000))
            .reason
            .contains("250 Mbit/s links"));
        // A machine's workers share its link: 4 per machine at 100 Gbit/s get 1 MiB each.
        assert_eq!(
            derived_partition_bytes(97 * mib, 8, 1, 4, Some(100 * gbit)).bytes,
            mib
        );
        // A large set asks more than the link's floor anyway, and 400 Gbit/s stops at
        // BytePS's size.
        assert_eq!(
            derived_partition_bytes(64 << 30, 2, 1, 1, Some(400 * gbit)).bytes,
            DEFAULT_PARTITION_BYTES
        );
    }

    #[test]
    fn an_exact_multiple_has_no_short_partition() {
        let parts = partition(0, &spec("w", 3 << 20, Dtype::F32), DEFAULT_PARTITION_BYTES).unwrap();
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| p.bytes == DEFAULT_PARTITION_BYTES));
    }

    #[test]
    fn partitions_hold_whole_elements() {
        // 4 MiB + 7 B holds 524288 f64 elements; the 7 spare bytes are not used.
        let w = spec("w", 524_289, Dtype::F64);
        let parts = partition(0, &w, DEFAULT_PARTITION_BYTES + 7).unwrap();
        assert_eq!(parts.len(), 2);
        assert_eq!(parts[0].bytes, 524_288 * 8);
        assert_eq!(parts[1].offset, 524_288 * 8);
        assert_eq!(parts[1].bytes, 8);
    }

    #[test]
    fn a_small_tensor_is_one_partition_and_an_empty_one_none() {
        assert_eq!(
            partition(1, &spec("b", 3, Dtype::Bf16), DEFAULT_PARTITION_BYTES).unwrap(),
            vec![Partition {
                key: 1 << 32,
                tensor: 1,
                offset: 0,
                bytes: 6,
                server: 0,
            }]
        );
        assert!(partition(0, &spec("e", 0, Dtype::F32), 4)
            .unwrap()
            .is_empty());
    }

    #[test]
    fn a_partition_smaller_than_an_element_is_refused() {
        for size in [0, 7] {
            let err = partition(0, &spec("fc.weight", 10, Dtype::F64), size).unwrap_err();
            assert_eq!(
                err,
                PartitionError::PartitionTooSmall {
                    tensor: "fc.weight".into(),
                    dtype: Dtype::F64,
                    partition_bytes: size
                }
            );
            let msg = err.to_string();
            assert!(msg.contains("fc.weight") && msg.contains(&format!("{size} B")));
            assert!(msg.contains("one f64 element (8 B)"), "{msg}");
        }
    }

    #[test]
    fn too_many_partitions_is_refused_before_allocating() {
        let err = partition(0, &spec("huge", 1 << 33, Dtype::F32), 4).unwrap_err();
        assert!(matches!(
            err,
            PartitionError::TooManyPartitions { count, .. } if count == 1 << 33
        ));
        assert!(err.to_string().contains("'huge'"));
    }

    #[test]
    fn keys_follow_declaration_order() {
        let decl = [
            spec("a", 5, Dtype::F32),
            spec("empty", 0, Dtype::F32),
            spec("b", 1, Dtype::F16),
        ];
        let parts = partition_tensors(&decl, 8).unwrap();
        let keys: Vec<_> = parts.iter().map(|p| (p.key, p.bytes)).collect();
        assert_eq!(keys, vec![(0, 8), (1, 8), (2, 4), (2 << 32, 2)]);
        assert_eq!(parts[3].tensor, 2);
        assert_eq!(partition_key(7, 3), 0x0000_0007_0000_0003);
    }

    #[test]
    fn declaring_more_tensors_keeps_earlier_keys() {
        let short = [spec("a", 100, Dtype::F32), spec("b", 9, Dtype::I64)];
        let long = [short[0], short[1], spec("c", 1000, Dtype::F16)];
        let before = partition_tensors(&short, 64).unwrap();
        let after = partition_tensors(&long, 64).unwrap();
        assert_eq!(before[..], after[..before.len()]);
    }

    #[test]
    fn duplicate_names_are_refused() {
        let decl = [
            spec("a", 1, Dtype::F32),
            spec("b", 1, Dtype::F32),
            spec("a", 2, Dtype::F32),
        ];
        let err = partition_tensors(&decl, 4).unwrap_err();
        assert_eq!(
            err.to_string(),
            "tensor 'a' is declared twice (declarations 0 and 2); every tensor needs its own name"
        );
    }

    #[test]
    fn errors_name_the_tensor_that_failed() {
        let decl = [spec("ok", 1, Dtype::F16), spec("wide", 1, Dtype::F64)];
        let err = partition_tensors(&decl, 4).unwrap_err();
        assert!(
            matches!(err, PartitionError::PartitionTooSmall { ref tensor, .. } if tensor == "wide")
        );
    }
}
