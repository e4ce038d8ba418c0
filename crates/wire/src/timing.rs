//! The job's timing defaults, in one place for every node: the coordinator judges silence
//! by the same heartbeat timeout the nodes' clients assume, and the Python settings
//! (`sumflow.settings`, through `sumflow._core`) take their defaults from here too.

use std::time::Duration;

/// How often a node tells the coordinator it is alive.
pub const DEFAULT_HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// Silence after which the coordinator declares a node failed (and a node its coordinator).
pub const DEFAULT_HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(10);
/// Time every expected node has to join before the job is abandoned.
pub const DEFAULT_JOIN_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a node keeps retrying to connect to a peer that may still be starting.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(60);
/// Longest wait for one collective operation of a worker. Dead peers are found by
/// heartbeats much sooner; this bounds every other way an operation can stall.
pub const DEFAULT_OPERATION_TIMEOUT: Duration = Duration::from_secs(300);
/// How long a worker waits on one operation before it says, on its stderr, what it waits
/// for (and again after each further such stretch), as Horovod's stall check does.
pub const DEFAULT_STALL_WARNING: Duration = Duration::from_secs(60);
