//! The asynchronous protocol of one key (BytePS §4.3, Fig. 11b), as a pure state machine.
//!
//! A key that takes deltas keeps the model's latest parameters, not a round's sum: the
//! worker updates its parameters itself, pushes the difference (the delta of its round r),
//! and the server adds it to the stored value at once, whatever the other workers have
//! pushed; the worker's pull of round r then returns the stored value. By Theorem 2 that
//! is Asynchronous Parallel with the optimizer on the workers.
//!
//! Each worker still alternates push and pull of its own rounds 1, 2, 3, ... (a pull of
//! round 0, before the first push, returns the stored value, as for a synchronous key's
//! initial value). Workers do not wait for each other, except under a staleness bound s
//! (stale-synchronous parallel): the pull of round r is answered once every member has
//! pushed round r − s, so no worker runs more than s rounds ahead of the slowest. Joined
//! workers (Horovod's `join()`) are not waited for.

use std::sync::Arc;

use crate::rounds::{admit, is_member, PullOutcome, RoundError};

#[derive(Debug)]
pub struct DeltaTracker {
    /// The workers that push the key, ascending; `None`: every worker.
    members: Option<Arc<[u32]>>,
    staleness: Option<u32>,
    /// Per worker rank: the last round it pushed, the last it pulled.
    pushed: Vec<u64>,
    pulled: Vec<u64>,
    pulled_initial: Vec<bool>,
    joined: Vec<bool>,
}

impl DeltaTracker {
    /// A key of a job of `workers` workers, pushed by `members` (or every worker), whose
    /// pulls wait for workers more than `staleness` rounds behind (`None`: for nobody).
    pub fn new(workers: u32, members: Option<Arc<[u32]>>, staleness: Option<u32>) -> Self {
        let n = workers as usize;
        DeltaTracker {
            members,
            staleness,
            pushed: vec![0; n],
            pulled: vec![0; n],
            pulled_initial: vec![false; n],
            joined: vec![false; n],
        }
    }

    /// The bound every push of the key must carry.
    pub fn staleness(&self) -> Option<u32> {
        self.staleness
    }

    fn counts(&self, worker: u32) -> bool {
        is_member(self.members.as_deref(), worker)
    }

    fn admit(&self, worker: u32, op: &'static str, round: u64) -> Result<(), RoundError> {
        admit(self.members.as_ref(), worker, op, round)
    }

    /// Accepts `worker`'s delta of its `round`: the next after the last it pulled.
    pub fn push(&mut self, worker: u32, round: u64) -> Result<(), RoundError> {
        self.admit(worker, "push", round)?;
        let w = worker as usize;
        if round == self.pushed[w] && round > 0 {
            return Err(RoundError::DuplicatePush { worker, round });
        }
        let why = if round != self.pushed[w] + 1 {
            Some(format!("expected round {}", self.pushed[w] + 1))
        } else if self.pulled[w] < self.pushed[w] {
            Some(format!("round {} must be pulled first", self.pushed[w]))
        } else {
            None
        };
        if let Some(why) = why {
            return Err(RoundError::OutOfSequence {
                worker,
                op: "push",
                round,
                why,
            });
        }
        self.pushed[w] = round;
        Ok(())
    }

    /// Accepts `worker`'s pull of its `round` (which it has pushed; or round 0, the stored
    /// value before its first push) and says whether the staleness bound lets it be
    /// answered now.
    pub fn pull(&mut self, worker: u32, round: u64) -> Result<PullOutcome, RoundError> {
        self.admit(worker, "pull", round)?;
        let w = worker as usize;
        let out_of_sequence = |why: String| RoundError::OutOfSequence {
            worker,
            op: "pull",
            round,
            why,
        };
        if round == 0 {
            if self.pulled_initial[w] {
                return Err(RoundError::DuplicatePull { worker, round });
            }
            if self.pushed[w] > 0 {
                return Err(out_of_sequence(
                    "the stored value is pulled as round 0 only before the first push".into(),
                ));
            }
            self.pulled_initial[w] = true;
            return Ok(PullOutcome::Ready);
        }
        if round <= self.pulled[w] {
            return Err(RoundError::DuplicatePull { worker, round });
        }
        if round != self.pulled[w] + 1 {
            return Err(out_of_sequence(format!(
                "expected round {}",
                self.pulled[w] + 1
            )));
        }
        if round > self.pushed[w] {
            return Err(out_of_sequence(format!(
                "worker {worker} has not pushed round {round}"
            )));
        }
        self.pulled[w] = round;
        Ok(if self.released(round) {
            PullOutcome::Ready
        } else {
            PullOutcome::Wait
        })
    }

    /// Whether a pull of `round` may be answered: every member not joined has pushed
    /// round − staleness.
    pub fn released(&self, round: u64) -> bool {
        self.lagging(round).is_empty()
    }

    /// The members (not joined) whose pushes a pull of `round` still waits for, ascending.
    pub fn lagging(&self, round: u64) -> Vec<u32> {
        let Some(bound) = self.staleness else {
            return Vec::new();
        };
        let needed = round.saturating_sub(u64::from(bound));
        (0..self.pushed.len() as u32)
            .filter(|&w| self.counts(w) && !self.joined[w as usize])
            .filter(|&w| self.pushed[w as usize] < needed)
            .collect()
    }

    /// The last round `worker` pulled (the round its waiting pull, if any, is of).
    pub fn pulled(&self, worker: u32) -> u64 {
        self.pulled[worker as usize]
    }

    /// Whether `worker` has pushed its `round`.
    pub fn has_pushed(&self, worker: u32, round: u64) -> bool {
        self.pushed[worker as usize] >= round
    }

    /// `worker` has joined (true) or left join: pulls no longer wait for it, or do again.
    pub fn set_joined(&mut self, worker: u32, joined: bool) {
        self.joined[worker as usize] = joined;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_a_bound_nobody_waits() {
        let mut t = DeltaTracker::new(3, None, None);
        for round in 1..=5 {
            t.push(0, round).unwrap();
            assert_eq!(t.pull(0, round), Ok(PullOutcome::Ready));
        }
        assert!(t.lagging(5).is_empty());
    }

    #[test]
    fn a_bound_holds_the_fast_worker_until_the_slowest_is_close_enough() {
        let mut t = DeltaTracker::new(2, None, Some(1));
        t.push(0, 1).unwrap();
        assert_eq!(t.pull(0, 1), Ok(PullOutcome::Ready));
        t.push(0, 2).unwrap();
        // Round 2 needs every worker at round 1 at least.
        assert_eq!(t.pull(0, 2), Ok(PullOutcome::Wait));
        assert_eq!(t.lagging(2), vec![1]);
        t.push(1, 1).unwrap();
        assert!(t.released(t.pulled(0)));
        // Staleness 0 is the synchronous schedule, with deltas.
        let mut t = DeltaTracker::new(2, None, Some(0));
        t.push(0, 1).unwrap();
        assert_eq!(t.pull(0, 1), Ok(PullOutcome::Wait));
        t.push(1, 1).unwrap();
        assert_eq!(t.pull(1, 1), Ok(PullOutcome::Ready));
        assert!(t.released(1));
    }

    #[test]
    fn joined_workers_and_non_members_are_not_waited_for() {
        let mut t = DeltaTracker::new(3, Some(Arc::from(vec![0, 1])), Some(0));
        t.push(0, 1).unwrap();
        assert_eq!(t.pull(0, 1), Ok(PullOutcome::Wait));
        assert_eq!(t.lagging(1), vec![1]);
        t.set_joined(1, true);
        assert!(t.released(1));
        assert!(matches!(t.push(2, 1), Err(RoundError::NotMember { .. })));
    }

    #[test]
    fn rounds_alternate_push_and_pull() {
        let mut t = DeltaTracker::new(1, None, None);
        assert_eq!(t.pull(0, 0), Ok(PullOutcome::Ready));
        assert!(matches!(
            t.pull(0, 0),
            Err(RoundError::DuplicatePull { .. })
        ));
        t.push(0, 1).unwrap();
        assert!(matches!(
            t.push(0, 1),
            Err(RoundError::DuplicatePush { .. })
        ));
        let e = t.push(0, 2).unwrap_err();
        assert!(
            e.to_string().contains("round 1 must be pulled first"),
            "{e}"
        );
        let e = t.pull(0, 2).unwrap_err();
        assert!(e.to_string().contains("expected round 1"), "{e}");
        t.pull(0, 1).unwrap();
        let e = t.push(0, 3).unwrap_err();
        assert!(e.to_string().contains("expected round 2"), "{e}");
        let e = t.pull(0, 2).unwrap_err();
        assert!(e.to_string().contains("has not pushed round 2"), "{e}");
        let mut t = DeltaTracker::new(1, None, None);
        t.push(0, 1).unwrap();
        assert!(matches!(
            t.pull(0, 0),
            Err(RoundError::OutOfSequence { .. })
        ));
    }
}
