//! What a worker pushes: push_pull operations (a tensor, or a span of fused tensors), laid
//! out on summation servers by the runtime's own code: `sumflow_plan::layout` cuts them
//! into partitions, places those by Eq. 1/2 and cuts them into pieces per lane.

use sumflow_plan::lanes;
use sumflow_plan::layout::{GroupLayout, Layout as ServerLayout};
use sumflow_plan::partition::{partition_tensors, Partition, TensorSpec};
use sumflow_plan::placement::{ServerKind, ServerSet};
use sumflow_wire::Dtype;

use crate::config::{Architecture, SimConfig};
use crate::error::SimError;

/// One push_pull per iteration: a tensor, or tensors fused into one buffer.
#[derive(Clone, Debug)]
pub struct Op {
    pub name: String,
    pub priority: i64,
    pub bytes: u64,
    /// Its partitions: `parts[first..first + count]`.
    pub first: u32,
    pub count: u32,
    /// Layers whose parameters it updates.
    pub layers: Vec<u32>,
}

/// A summation server: on worker machine `machine` (colocated) or on CPU machine `cpu`.
#[derive(Clone, Copy, Debug)]
pub struct Server {
    pub kind: ServerKind,
    /// Worker machine index (colocated) or CPU machine index (CPU).
    pub index: u32,
    pub lanes: u32,
    /// Bytes of the model placed on it.
    pub bytes: u64,
}

#[derive(Debug)]
pub struct Layout {
    pub ops: Vec<Op>,
    /// Every op's partitions (or lanes' pieces of them), as the scheduler and the network
    /// see them: a partition's tensor is its op, its server an index into
    /// [`Layout::servers`] (for an all-reduce: 0, the collective).
    pub parts: Vec<Partition>,
    /// Per layer, the ops that become ready when its backward ends, in backward order.
    pub ready_after: Vec<Vec<u32>>,
    /// Per layer, how many ops update it.
    pub updated_by: Vec<u32>,
    pub servers: Vec<Server>,
    /// The placement's own account of each server's share.
    pub placement: Vec<String>,
}

impl Layout {
    pub fn build(cfg: &SimConfig) -> Result<Layout, SimError> {
        let partition_bytes = cfg.schedule.layout_partition_bytes()?;
        let (ops, ready_after, updated_by) = spans(cfg);
        let specs: Vec<TensorSpec<'_>> = ops
            .iter()
            .map(|o| TensorSpec {
                name: &o.name,
                elements: o.bytes / 4,
                dtype: Dtype::F32,
            })
            .collect();
        let (parts, servers, placement) = if cfg.architecture.has_servers() {
            let (servers, laid) = lay_out(cfg, &specs, partition_bytes)?;
            (laid.tensors.concat(), servers, laid.placement.explain())
        } else {
            // An all-reduce has no servers to place partitions on: they are only cut.
            let parts = partition_tensors(&specs, partition_bytes)?;
            (parts, Vec::new(), Vec::new())
        };
        let mut layout = Layout {
            ops,
            parts: Vec::with_capacity(parts.len()),
            ready_after,
            updated_by,
            servers,
            placement,
        };
        for p in parts {
            layout.push_part(p);
        }
        Ok(layout)
    }

    fn push_part(&mut self, p: Partition) {
        let o = &mut self.ops[p.tensor as usize];
        if o.count == 0 {
            o.first = self.parts.len() as u32;
        }
        o.count += 1;
        self.parts.push(p);
    }

    /// The lane of its server that carries `p` (an all-reduce's partitions: 0).
    pub fn lane(&self, p: &Partition) -> u32 {
        self.servers
            .get(p.server as usize)
            .map_or(0, |s| lanes::lane_of(p.key, s.lanes))
    }

    /// Bytes placed on colocated servers: none means every worker machine only talks to
    /// CPU servers.
    pub fn colocated_bytes(&self) -> u64 {
        self.servers
            .iter()
            .filter(|s| s.kind == ServerKind::Colocated)
            .map(|s| s.bytes)
            .sum()
    }

    pub fn parts_of(&self, op: u32) -> std::ops::Range<usize> {
        let o = &self.ops[op as usize];
        o.first as usize..(o.first + o.count) as usize
    }
}

/// The ops declared as one group on every worker, as the runtime's optimizer declares a
/// model, laid out on the job's servers; each server with the lanes a worker opens to it
/// and the bytes placed on it.
fn lay_out(
    cfg: &SimConfig,
    ops: &[TensorSpec<'_>],
    partition_bytes: u64,
) -> Result<(Vec<Server>, GroupLayout), SimError> {
    let n = cfg.cluster.machines;
    let k = cfg.cluster.cpu_machines;
    // Ranks as the cluster map would give them: colocated servers first, by machine. A
    // server's rank is therefore its index in the list below, which is how partitions
    // name it.
    let set = match cfg.architecture {
        Architecture::Ps => ServerSet::non_colocated(n, (0..k).collect())?,
        _ => ServerSet::new((0..n).collect(), (n..n + k).collect())?,
    };
    // The runtime opens lanes to CPU servers only where colocated servers share the load.
    let cpu_lanes = lanes::per_cpu_server(set.colocated().len() as u32, set.cpu().len() as u32);
    let colocated = set.colocated().iter().map(|&rank| Server {
        kind: ServerKind::Colocated,
        index: rank,
        lanes: 1,
        bytes: 0,
    });
    let cpu = (0..set.cpu().len() as u32).map(|j| Server {
        kind: ServerKind::Cpu,
        index: j,
        lanes: cpu_lanes,
        bytes: 0,
    });
    let mut servers: Vec<Server> = colocated.chain(cpu).collect();
    let lanes: Vec<u32> = servers.iter().map(|s| s.lanes).collect();
    let layout = ServerLayout {
        servers: &set,
        lanes: &lanes,
        partition_bytes,
        generation: 0,
    };
    let laid = layout.declaration(ops)?;
    for p in laid.tensors.iter().flatten() {
        servers[p.server as usize].bytes += p.bytes;
    }
    Ok((servers, laid))
}

/// The push_pulls of one iteration, in declaration order: one per tensor, or, with
/// `fusion_bytes`, spans cut in backward order that close once they hold at least that
/// many bytes (GradientFlow's lazy all-reduce; DDP's buckets close the same way). A span
/// is ready when its last tensor in backward order is, and is as urgent as its most
/// urgent tensor.
fn spans(cfg: &SimConfig) -> (Vec<Op>, Vec<Vec<u32>>, Vec<u32>) {
    let layers = &cfg.model.layers;
    // (tensor index, layer, name, bytes) in declaration order.
    let tensors: Vec<(usize, u32, &str, u64)> = layers
        .iter()
        .enumerate()
        .flat_map(|(l, layer)| layer.tensors.iter().map(move |t| (l as u32, t)))
        .enumerate()
        .map(|(i, (l, t))| (i, l, t.name.as_str(), t.bytes))
        .collect();
    let priority =
        |i: usize| -> i64 { cfg.schedule.priorities.as_ref().map_or(i as i64, |p| p[i]) };
    let theta = cfg.schedule.fusion_bytes;
    let mut groups: Vec<Vec<usize>> = Vec::new();
    let mut open: Vec<usize> = Vec::new();
    let mut open_bytes = 0;
    for &(i, _, _, bytes) in tensors.iter().rev() {
        open.push(i);
        open_bytes += bytes;
        if open_bytes >= theta {
            groups.push(std::mem::take(&mut open));
            open_bytes = 0;
        }
    }
    if !open.is_empty() {
        groups.push(open);
    }
    // Declaration order: the group holding the lowest tensor index first.
    groups.reverse();
    let mut ready_after = vec![Vec::new(); layers.len()];
    let mut updated_by = vec![0; layers.len()];
    let mut ops = Vec::with_capacity(groups.len());
    for (id, group) in groups.iter().enumerate() {
        let first = *group.iter().min().expect("groups are never empty");
        let last = *group.iter().max().expect("groups are never empty");
        let mut op_layers: Vec<u32> = group.iter().map(|&i| tensors[i].1).collect();
        op_layers.dedup();
        op_layers.sort_unstable();
        op_layers.dedup();
        for &l in &op_layers {
            updated_by[l as usize] += 1;
        }
        // Ready with its tensor that backward produces last: the lowest index.
        ready_after[tensors[first].1 as usize].push(id as u32);
        ops.push(Op {
            name: if group.len() == 1 {
                tensors[first].2.to_string()
            } else {
                format!("fused[{}..{}]", tensors[first].2, tensors[last].2)
            },
            priority: group.iter().map(|&i| priority(i)).min().expect("non-empty"),
            bytes: group.iter().map(|&i| tensors[i].3).sum(),
            first: 0,
            count: 0,
            layers: op_layers,
        });
    }
    // Within a layer, backward completes later tensors first.
    for ops_of_layer in &mut ready_after {
        ops_of_layer.reverse();
    }
    (ops, ready_after, updated_by)
}
