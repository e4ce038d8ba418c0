//! A worker's declared tensors laid out for the wire: each cut into partitions of the
//! layout's size ([`crate::partition`]), keyed in the layout's generation, placed on the
//! summation servers ([`crate::placement`] for a group, [`crate::scatter`] for a tensor
//! declared alone) and cut into one piece per lane ([`crate::lanes`]).
//!
//! Every worker derives the same partitions from the same declarations, settings and
//! cluster map, so keys and servers agree without any exchange.
//!
//! A layout generation is kept in the top byte of every key (tensor ids stay below 2^24),
//! so that when the auto-tuner changes the partition size, the keys of the new size never
//! collide with the old ones on a server.

use sumflow_wire::Dtype;
use thiserror::Error;

use crate::lanes::{self, LaneError};
use crate::partition::{partition, partition_tensors, Partition, PartitionError, TensorSpec};
use crate::placement::{place, Placement, PlacementError, ServerSet};
use crate::scatter::scatter;

const GENERATION_SHIFT: u32 = 56;

/// The highest tensor id a key has room for.
pub const MAX_TENSOR_ID: u32 = (1 << (GENERATION_SHIFT - 32)) - 1;

/// How many partition sizes a job can use: a key's top byte numbers them.
pub const MAX_GENERATIONS: usize = 1 << (64 - GENERATION_SHIFT);

/// Why tensors cannot be laid out; each says which tensor, key or server.
#[derive(Clone, Debug, PartialEq, Error)]
pub enum LayoutError {
    #[error(transparent)]
    Partition(#[from] PartitionError),
    #[error(transparent)]
    Placement(#[from] PlacementError),
    #[error(transparent)]
    Lanes(#[from] LaneError),
}

/// How one worker lays out tensors: under which partition size, onto which servers.
#[derive(Clone, Copy, Debug)]
pub struct Layout<'a> {
    /// The job's summation servers.
    pub servers: &'a ServerSet,
    /// Lanes to each server, by rank.
    pub lanes: &'a [u32],
    pub partition_bytes: u64,
    /// The partition size's index among those the job has used (below
    /// [`MAX_GENERATIONS`]), kept in each key's top byte.
    pub generation: usize,
}

/// Tensors laid out together: their partitions, and the placement that gave them servers.
#[derive(Clone, Debug)]
pub struct GroupLayout {
    /// One list per tensor, in the group's order.
    pub tensors: Vec<Vec<Partition>>,
    /// What each server sums against the share Eq. 1 and 2 ask of it
    /// ([`Placement::explain`] says it in a line per server).
    pub placement: Placement,
}

impl Layout<'_> {
    /// The partitions of tensor `id`, declared alone: each placed from its key, so
    /// workers may declare such tensors in any order.
    pub fn single(&self, id: u32, tensor: &TensorSpec<'_>) -> Result<Vec<Partition>, LayoutError> {
        let mut parts = self.cut(id, tensor)?;
        for p in &mut parts {
            p.server = scatter(p.key, self.servers)?;
        }
        self.spread(tensor.dtype, parts)
    }

    /// The partitions of one tensor, every one on server `server`: a tensor whose bytes one
    /// worker takes (a relay region) kept on that worker's machine crosses one link, not
    /// two.
    pub fn pinned(
        &self,
        id: u32,
        tensor: &TensorSpec<'_>,
        server: u32,
    ) -> Result<Vec<Partition>, LayoutError> {
        let mut parts = self.cut(id, tensor)?;
        for p in &mut parts {
            p.server = server;
        }
        self.spread(tensor.dtype, parts)
    }

    /// The partitions of a group's tensors (`(id, tensor)`, a model's parameters, the same
    /// group on every worker), placed together to track BytePS's Eq. 1 and 2.
    pub fn group(&self, tensors: &[(u32, TensorSpec<'_>)]) -> Result<GroupLayout, LayoutError> {
        let mut cut = Vec::with_capacity(tensors.len());
        for (id, tensor) in tensors {
            cut.push(self.cut(*id, tensor)?);
        }
        self.place_together(tensors.iter().map(|(_, tensor)| tensor.dtype), cut)
    }

    /// A whole declaration laid out as one group (see [`Self::group`]), each tensor's id
    /// its index in `tensors`, whose names must differ: how the simulator declares a
    /// model. The runtime gets ids, and one per name, from the coordinator instead.
    ///
    /// The checks are [`partition_tensors`]'s, in its order, so the first tensor at fault
    /// is the one named. Ids past [`MAX_TENSOR_ID`] reach into the generation's byte.
    pub fn declaration(&self, tensors: &[TensorSpec<'_>]) -> Result<GroupLayout, LayoutError> {
        let mut cut = vec![Vec::new(); tensors.len()];
        for p in self.keyed(partition_tensors(tensors, self.partition_bytes)?) {
            cut[p.tensor as usize].push(p);
        }
        self.place_together(tensors.iter().map(|tensor| tensor.dtype), cut)
    }

    /// Places tensors' partitions (`cut`, a list per tensor, each of its `dtypes`)
    /// together, then cuts them into pieces per lane.
    fn place_together(
        &self,
        dtypes: impl IntoIterator<Item = Dtype>,
        cut: Vec<Vec<Partition>>,
    ) -> Result<GroupLayout, LayoutError> {
        let placement = place(&cut.concat(), self.servers)?;
        let tensors = dtypes
            .into_iter()
            .zip(cut)
            .map(|(dtype, mut parts)| {
                for p in &mut parts {
                    p.server = placement
                        .server_of(p.key)
                        .expect("every partition was placed");
                }
                self.spread(dtype, parts)
            })
            .collect::<Result<_, _>>()?;
        Ok(GroupLayout { tensors, placement })
    }

    /// Cuts a tensor by the layout's partition size, keyed in its generation.
    fn cut(&self, id: u32, tensor: &TensorSpec<'_>) -> Result<Vec<Partition>, LayoutError> {
        Ok(self.keyed(partition(id, tensor, self.partition_bytes)?))
    }

    /// Puts the layout's generation into the keys' top byte.
    fn keyed(&self, mut parts: Vec<Partition>) -> Vec<Partition> {
        let generation = (self.generation as u64) << GENERATION_SHIFT;
        for p in &mut parts {
            p.key |= generation;
        }
        parts
    }

    /// Cuts each placed partition bound for a server with several lanes into one piece per
    /// lane.
    fn spread(&self, dtype: Dtype, parts: Vec<Partition>) -> Result<Vec<Partition>, LayoutError> {
        let mut out = Vec::with_capacity(parts.len());
        for p in parts {
            let lanes = self.lanes[p.server as usize];
            out.extend(lanes::pieces(p, dtype.size() as u64, lanes)?);
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use sumflow_wire::Dtype;

    use super::*;

    fn spec(name: &str, elements: u64) -> TensorSpec<'_> {
        TensorSpec {
            name,
            elements,
            dtype: Dtype::F32,
        }
    }

    #[test]
    fn keys_carry_the_generation_and_pieces_their_lanes() {
        // Servers 0 and 1 colocated, 2 a CPU server with two lanes.
        let servers = ServerSet::new(vec![0, 1], vec![2]).unwrap();
        let lanes = [1, 1, 2];
        let piece = lanes::MIN_PIECE_BYTES;
        let layout = Layout {
            servers: &servers,
            lanes: &lanes,
            partition_bytes: 2 * piece,
            generation: 3,
        };
        // 5 partitions of "w" (the last 3/4 of one: too little for two pieces), and "b".
        let w = 19 * piece / 4 * 2;
        let group = layout
            .group(&[(5, spec("w", w / 4)), (6, spec("b", 8))])
            .unwrap()
            .tensors;
        assert_eq!(group.len(), 2);
        for (parts, (id, bytes)) in group.iter().zip([(5, w), (6, 32)]) {
            assert_eq!(parts.iter().map(|p| p.bytes).sum::<u64>(), bytes);
            let mut at = 0;
            for p in parts {
                assert_eq!((p.tensor, p.offset), (id, at), "{p:?}");
                assert_eq!(p.key >> GENERATION_SHIFT, 3);
                assert_eq!(p.key >> 32 & 0xff_ffff, u64::from(id));
                at += p.bytes;
            }
        }
        // The CPU server's full partitions come in pieces, one per lane; smaller ones
        // than two pieces' worth whole.
        let cpu: Vec<_> = group
            .concat()
            .into_iter()
            .filter(|p| p.server == 2)
            .collect();
        assert!(cpu.iter().any(|p| p.key & 1 << 31 != 0));
        for p in &cpu {
            let cut = p.key & 1 << 31 != 0;
            assert_eq!(cut, p.bytes == piece, "{p:?}");
        }
        assert!(cpu.iter().any(|p| lanes::lane_of(p.key, 2) == 0));
        assert!(cpu.iter().any(|p| lanes::lane_of(p.key, 2) == 1));
    }

    #[test]
    fn a_declaration_is_a_group_keyed_by_position() {
        let servers = ServerSet::new(vec![0, 1], vec![2]).unwrap();
        let layout = Layout {
            servers: &servers,
            lanes: &[1, 1, 2],
            partition_bytes: 64,
            generation: 2,
        };
        let model = [spec("w", 40), spec("e", 0), spec("b", 8)];
        let declared = layout.declaration(&model).unwrap();
        let group = layout
            .group(&[(0, model[0]), (1, model[1]), (2, model[2])])
            .unwrap();
        assert_eq!(declared.tensors, group.tensors);
        assert_eq!(
            declared.tensors[1],
            [],
            "a tensor without elements has no partitions"
        );
        assert_eq!(declared.placement, group.placement);
        assert_eq!(declared.placement.total_bytes(), 192);
    }

    #[test]
    fn a_declaration_names_the_first_tensor_at_fault() {
        let servers = ServerSet::new(vec![0], vec![]).unwrap();
        let layout = Layout {
            servers: &servers,
            lanes: &[1],
            partition_bytes: 4,
            generation: 0,
        };
        let repeated = [spec("a", 1), spec("b", 1), spec("a", 1)];
        assert!(matches!(
            layout.declaration(&repeated),
            Err(LayoutError::Partition(PartitionError::DuplicateName {
                second: 2,
                ..
            }))
        ));
        // A tensor with too many partitions before the repeated name: it is the one named.
        let huge = [spec("a", 1), spec("big", 1 << 40), spec("a", 1)];
        assert!(matches!(
            layout.declaration(&huge),
            Err(LayoutError::Partition(PartitionError::TooManyPartitions { ref tensor, .. }))
                if tensor == "big"
        ));
    }

    #[test]
    fn a_tensor_declared_alone_is_placed_from_its_keys() {
        let servers = ServerSet::new(vec![0, 1, 2], vec![]).unwrap();
        let layout = Layout {
            servers: &servers,
            lanes: &[1, 1, 1],
            partition_bytes: 16,
            generation: 0,
        };
        let parts = layout.single(9, &spec("w", 100)).unwrap();
        assert_eq!(parts.len(), 25);
        for p in &parts {
            assert_eq!(p.server, scatter(p.key, &servers).unwrap());
        }
        assert_eq!(
            layout.single(9, &spec("w", 100)).unwrap(),
            parts,
            "the same on every worker"
        );
    }

    #[test]
    fn a_pinned_tensor_keeps_every_partition_on_one_server_with_its_lanes() {
        let servers = ServerSet::new(vec![0, 1, 2], vec![]).unwrap();
        let layout = Layout {
            servers: &servers,
            lanes: &[1, 2, 1],
            partition_bytes: 2 * lanes::MIN_PIECE_BYTES,
            generation: 0,
        };
        // 25 partitions.
        let elements = 25 * 2 * lanes::MIN_PIECE_BYTES / 4;
        let parts = layout.pinned(9, &spec("w", elements), 1).unwrap();
        assert!(parts.iter().all(|p| p.server == 1));
        // The same cut as placed from the keys, each piece split over server 1's lanes.
        let alone = layout.single(9, &spec("w", elements)).unwrap();
        let bytes = |ps: &[Partition]| ps.iter().map(|p| p.bytes).sum::<u64>();
        assert_eq!(bytes(&parts), bytes(&alone));
        assert_eq!(parts.len(), 50, "two lanes cut each partition in two");
    }

    #[test]
    fn errors_name_the_tensor() {
        let servers = ServerSet::new(vec![0], vec![]).unwrap();
        let layout = Layout {
            servers: &servers,
            lanes: &[1],
            partition_bytes: 2,
            generation: 0,
        };
        let e = layout.single(0, &spec("fc.weight", 4)).unwrap_err();
        assert!(matches!(e, LayoutError::Partition(_)), "{e}");
        assert!(e.to_string().contains("'fc.weight'"), "{e}");
    }
}
