//! Who may join and which rank each node gets: pure functions of the registrations so far.

use std::collections::BTreeSet;

use sumflow_wire::{ErrorCode, Registration};

/// Why a registration is refused; it goes back to the node in an `Error` frame.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The code the `Error` frame carries.
    pub code: ErrorCode,
    /// What is wrong and what to do about it.
    pub message: String,
}

/// Decides whether `reg` may join, given the registrations of its role already accepted
/// (in join order) and how many nodes of that role the job expects.
pub fn admit(reg: &Registration, joined: &[&Registration], expected: u32) -> Result<(), Refusal> {
    let role = reg.role;
    if joined.len() >= expected as usize {
        let names: Vec<_> = joined.iter().map(|r| format!("'{}'", r.name)).collect();
        return Err(Refusal {
            code: ErrorCode::ClusterFull,
            message: format!(
                "the job expects {expected} {role}s and all have joined ({}); {role} '{}' is one \
                 too many: check the --workers/--servers counts given to the coordinator",
                if names.is_empty() {
                    "none".into()
                } else {
                    names.join(", ")
                },
                reg.name
            ),
        });
    }
    let Some(rank) = reg.requested_rank else {
        return Ok(());
    };
    if rank >= expected {
        return Err(Refusal {
            code: ErrorCode::BadRank,
            message: format!(
                "{role} '{}' asked for rank {rank} but the job has {expected} {role}s (ranks 0 to {})",
                reg.name,
                expected - 1
            ),
        });
    }
    if let Some(other) = joined.iter().find(|r| r.requested_rank == Some(rank)) {
        return Err(Refusal {
            code: ErrorCode::DuplicateNode,
            message: format!(
                "{role} rank {rank} asked for by '{}' is already held by '{}' (pid {} on {}); \
                 give every {role} its own rank",
                reg.name, other.name, other.pid, other.host_id
            ),
        });
    }
    Ok(())
}

/// Ranks for one role's registrations in join order: requested ranks are honoured, the
/// others take the lowest free ranks in join order. Expects registrations `admit` accepted.
pub fn assign_ranks(requested: &[Option<u32>]) -> Vec<u32> {
    let taken: BTreeSet<u32> = requested.iter().flatten().copied().collect();
    let mut free = (0u32..).filter(|r| !taken.contains(r));
    requested
        .iter()
        .map(|r| r.unwrap_or_else(|| free.next().unwrap_or(u32::MAX)))
        .collect()
}
