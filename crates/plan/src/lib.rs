//! What a worker decides about its gradients before and while they travel, as pure
//! functions and state machines of explicit inputs: declarations, sizes, the cluster map,
//! and the time passed in. No threads, no sockets, no clock of its own, so the
//! communication service (`sumflow-comm`) and the simulator (`sumflow-sim`) run the same
//! decisions, and tests drive them without a network.
//!
//! The decisions, in the order a declared tensor meets them:
//!
//! 1. [`partition`] cuts it into runs of at most the partition size (4 MiB by default) and
//!    keys each run by declaration index and position, so all workers agree on the keys
//!    without talking.
//! 2. [`placement`] picks each key's summation server so that every server sums the share of
//!    the model BytePS's Eq. 1 and 2 give it; [`scatter`] does the same for a tensor
//!    declared alone, from its key. From the same declaration and cluster map, every worker
//!    picks the same servers.
//! 3. [`lanes`] says how many connections go to each server and cuts a partition bound
//!    for a CPU server into one piece per connection.
//! 4. [`scheduler`] decides, at every event, which ready partitions enter the network:
//!    priority order, credit, push window and Prophet's blocks.
//!
//! Steps 1 to 3 run once per declaration, not per iteration, together in [`layout`]; step
//! 4 at every push_pull, acknowledgement and sum. A [`partition::Partition`] carries a
//! partition through all of them, and through the runtime and the simulator after them.

pub mod hierarchy;
pub mod lanes;
pub mod layout;
pub mod partition;
pub mod placement;
pub mod scatter;
pub mod scheduler;
