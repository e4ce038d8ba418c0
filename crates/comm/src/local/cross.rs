//! The network leg of a round aggregated inside the machine first (BytePS §4.2.2,
//! `sumflow_plan::hierarchy`): once the machine's sum of this worker's run of partitions
//! is in the shared memory's result, it pushes that run to the summation servers and
//! pulls back the sum over every machine. Its pushes stand for the machine's other members
//! that take part (`Message::Skips`), which send nothing for those keys: a server hears
//! once per machine and partition, however many workers the machine has.

use std::sync::Arc;

use sumflow_plan::partition::Partition;
use sumflow_wire::{Dtype, KeyCodec, ReduceOp};

use super::stage::{Cross, Leg};
use crate::handles::{Handles, CROSSING};
use crate::pipeline::{HostSlice, PartTask, Pipeline};

/// One round of one tensor, as the service issues it.
#[derive(Debug)]
pub struct Round<'a> {
    pub tensor: u32,
    pub name: &'a Arc<str>,
    pub dtype: Dtype,
    /// The tensor's partitions in the layout in use.
    pub parts: &'a [Partition],
    /// The tensor's members (`None`: every worker), which its keys keep.
    pub members: Option<Arc<[u32]>>,
    /// The round's number on the partitions' keys.
    pub round: u64,
    pub priority: i64,
    pub op: ReduceOp,
    /// What the servers' sums are divided by (an average over every member).
    pub divisor: Option<u32>,
}

/// This worker's part in carrying the round across machines; the stage picks its run
/// once it knows which of the machine's members take part.
pub fn plan(r: &Round<'_>, pipeline: &Arc<Pipeline>, handles: &Arc<Handles>) -> Cross {
    let parts: Vec<Partition> = r.parts.to_vec();
    let (tensor, name, dtype, round) = (r.tensor, Arc::clone(r.name), r.dtype, r.round);
    let (members, priority, op, divisor) = (r.members.clone(), r.priority, r.op, r.divisor);
    let (pipeline, handles) = (Arc::clone(pipeline), Arc::clone(handles));
    let legs = parts.clone();
    let send = Box::new(move |result: HostSlice, leg: Leg| -> Result<u64, _> {
        let carried: Vec<Partition> = leg.run.iter().map(|&i| legs[i]).collect();
        let handle = handles.start(tensor | CROSSING, &name, &carried)?;
        let skips = (!leg.skips.is_empty()).then_some(leg.skips);
        let tasks = leg
            .run
            .iter()
            .zip(carried)
            .map(|(&index, partition)| PartTask {
                name: Arc::clone(&name),
                index: index as u32,
                handle,
                partition,
                round,
                dtype,
                data: result.sub(partition.offset as usize, partition.bytes as usize),
                codec: KeyCodec::RAW,
                members: members.clone(),
                divisor,
                op,
                pushes: leg.pushes,
                wants_sum: true,
                skips: skips.clone(),
                delta: None,
            })
            .collect();
        pipeline.enqueue(tensor, &name, priority, tasks);
        Ok(handle)
    });
    Cross { parts, send }
}
