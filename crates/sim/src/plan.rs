//! Which machines the simulation runs, and what each stands for.
//!
//! The cluster has n worker machines of g GPUs and k CPU machines. Two reductions keep a
//! simulation of a thousand GPUs small, and each is used only where it is exact, that is
//! where the machines folded together provably do the same thing at the same time:
//!
//! - **GPUs of one machine.** They compute the same layers in the same times and send the
//!   same partitions to the same servers. With intra-machine aggregation they leave the
//!   machine as one copy (after a local reduce); without it, one message stands for g
//!   copies on every link it crosses (see `crate::net`), each GPU's process preparing its
//!   own push. The one approximation: a server's g sums for one machine are written once
//!   all g are prepared, not each as soon as it is.
//! - **Worker machines**: in ring and hierarchical all-reduce every node sends the same
//!   chunk to its neighbour in every step. In the non-colocated PS and BytePS with k >= n
//!   (Eq. 2 gives colocated servers nothing) every worker machine pushes the same
//!   partitions to the same CPU servers at the same times and gets the same sums back,
//!   provided messages cost no CPU time (a server prepares the n sums of a round one after
//!   the other, so with a per-message cost each machine gets its sum at its own time). One
//!   machine is then simulated, its messages standing for n copies at the servers. With
//!   colocated servers doing work (colocated PS, BytePS with k < n) each machine's NIC
//!   also carries the sums of the partitions *it* hosts, which differ, so every worker
//!   machine is simulated.

use std::fmt::Write;

use crate::config::{Architecture, SimConfig};
use crate::layout::Layout;

/// A simulated worker machine.
#[derive(Clone, Copy, Debug)]
pub struct WorkerMachine {
    /// The first real machine it stands for.
    pub first: u32,
    /// How many real machines it stands for.
    pub copies: u32,
}

#[derive(Debug)]
pub struct Plan {
    pub workers: Vec<WorkerMachine>,
    /// Simulated machines: the worker machines, then the k CPU machines.
    pub rates: Vec<f64>,
    /// Copies of a message per worker machine: g without intra-machine aggregation.
    pub gpu_copies: u32,
    /// Pushes of a partition a server waits for.
    pub pushes_per_round: u32,
    /// One line on how the cluster was reduced, and why that is exact.
    pub reduction: String,
}

impl Plan {
    pub fn new(cfg: &SimConfig, layout: &Layout) -> Plan {
        let c = cfg.cluster;
        let (n, g, k) = (c.machines, c.gpus_per_machine, c.cpu_machines);
        let arch = cfg.architecture;
        let aggregate = cfg.training.intra_aggregation || !arch.has_servers();
        let gpu_copies = if aggregate { 1 } else { g };
        // With a per-message cost, a server prepares its sums for the n machines one after
        // the other, so they get them at different times: no longer identical.
        let servers_fold = cfg.exploit_symmetry && cfg.network.message_overhead_s == 0.0;
        // With compute jitter every machine keeps its own pace.
        let steady = cfg.training.compute_jitter == 0.0;
        let foldable = steady
            && match arch {
                Architecture::Ring | Architecture::Hierarchical => true,
                Architecture::Ps => servers_fold,
                Architecture::ColocatedPs | Architecture::Byteps => {
                    servers_fold && layout.colocated_bytes() == 0
                }
            };
        let workers: Vec<WorkerMachine> = if foldable {
            vec![WorkerMachine {
                first: 0,
                copies: n,
            }]
        } else {
            (0..n)
                .map(|m| WorkerMachine {
                    first: m,
                    copies: 1,
                })
                .collect()
        };
        let mut rates = vec![cfg.network.bandwidth; workers.len()];
        rates.extend(std::iter::repeat_n(cfg.network.cpu_bandwidth, k as usize));
        let mut reduction = String::new();
        if g > 1 {
            let _ = write!(
                reduction,
                "each machine's {g} GPUs as one ({}); ",
                if aggregate {
                    "their gradients reduced inside the machine first"
                } else {
                    "every message standing for their copies"
                }
            );
        }
        if foldable && n > 1 {
            let why = match arch {
                Architecture::Ring | Architecture::Hierarchical => {
                    "every node sends the same chunk to its neighbour in every step"
                }
                _ => {
                    "no summation server on a worker machine has anything to sum, so every \
                      worker machine pushes the same partitions to the same CPU servers at \
                      the same times"
                }
            };
            let _ = write!(
                reduction,
                "{n} worker machines simulated as one, exactly: {why}"
            );
        } else if n > 1 {
            let why = if !steady {
                ": compute jitter gives each its own pace"
            } else if !arch.has_servers() || !cfg.exploit_symmetry {
                ""
            } else if layout.colocated_bytes() > 0 {
                ": each hosts a summation server with its own share, so their NICs carry \
                 different sums at different times"
            } else {
                ": servers prepare their sums for them one after the other (the \
                 per-message cost), so each gets them at its own time"
            };
            let _ = write!(reduction, "all {n} worker machines simulated{why}");
        } else {
            reduction.push_str("one worker machine");
        }
        Plan {
            workers,
            rates,
            gpu_copies,
            pushes_per_round: n * gpu_copies,
            reduction,
        }
    }

    /// The simulated machine a CPU server runs on.
    pub fn cpu_machine(&self, j: u32) -> u32 {
        self.workers.len() as u32 + j
    }
}
