//! The synchronous round protocol of one key, as a pure state machine.
//!
//! Every worker alternates push and pull: it pushes round r, pulls round r, then may push
//! round r + 1. So at most one round per key is accumulating while the previous round's
//! sum waits for its last pulls, which is what bounds a key's memory to two buffers. The
//! optional round 0 pull returns the key's initial value before the worker's first push.
//!
//! A key may count only some of the job's workers, its members (a Horovod process set):
//! a round is complete once every member has pushed it, and other workers may neither
//! push nor pull it.

use std::sync::Arc;

use thiserror::Error;

/// Why a push or pull breaks the round protocol. The messages are sent to the worker.
#[derive(Debug, Error, PartialEq, Eq)]
pub enum RoundError {
    #[error("worker {worker} pushed round {round} twice")]
    DuplicatePush { worker: u32, round: u64 },
    #[error("worker {worker} pulled round {round} twice")]
    DuplicatePull { worker: u32, round: u64 },
    #[error("worker {worker} sent {op} of round {round} out of sequence: {why}")]
    OutOfSequence {
        worker: u32,
        op: &'static str,
        round: u64,
        why: String,
    },
    #[error(
        "worker {worker} sent {op} of round {round}, but the key's rounds count only its \
         members, workers {members:?}"
    )]
    NotMember {
        worker: u32,
        op: &'static str,
        round: u64,
        members: Arc<[u32]>,
    },
}

/// What a valid pull leads to.
#[derive(Debug, PartialEq, Eq)]
pub enum PullOutcome {
    /// The round is complete: answer now.
    Ready,
    /// Other workers have not pushed this round yet: answer when it completes.
    Wait,
}

#[derive(Debug)]
pub struct RoundTracker {
    completed: u64,
    pushes_in_round: u32,
    /// The workers whose pushes make up a round, ascending; `None`: every worker.
    members: Option<Arc<[u32]>>,
    /// Indexed by worker rank, members or not: a few bytes per worker buys indexing
    /// without a lookup on every push.
    last_pushed: Vec<u64>,
    last_pulled: Vec<u64>,
    pulled_initial: Vec<bool>,
}

impl RoundTracker {
    /// A key of a job of `workers` workers whose rounds count `members` (ranks below
    /// `workers`, ascending), or every worker.
    pub fn new(workers: u32, members: Option<Arc<[u32]>>) -> Self {
        let n = workers as usize;
        debug_assert!(members
            .as_deref()
            .is_none_or(|m| m.windows(2).all(|w| w[0] < w[1]) && m.iter().all(|&r| r < workers)));
        RoundTracker {
            completed: 0,
            pushes_in_round: 0,
            members,
            last_pushed: vec![0; n],
            last_pulled: vec![0; n],
            pulled_initial: vec![false; n],
        }
    }

    /// How many pushes complete a round.
    fn quorum(&self) -> u32 {
        match &self.members {
            Some(m) => m.len() as u32,
            None => self.last_pushed.len() as u32,
        }
    }

    /// Whether `worker`'s pushes count towards this key's rounds.
    pub fn counts(&self, worker: u32) -> bool {
        self.members
            .as_deref()
            .is_none_or(|m| m.binary_search(&worker).is_ok())
    }

    /// Refuses a push or pull of `round` by a worker that is not one of the key's members.
    pub fn admit(&self, worker: u32, op: &'static str, round: u64) -> Result<(), RoundError> {
        match &self.members {
            Some(members) if !self.counts(worker) => Err(RoundError::NotMember {
                worker,
                op,
                round,
                members: Arc::clone(members),
            }),
            _ => Ok(()),
        }
    }

    /// The last round every member has pushed (0 before the first).
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// The round now accumulating.
    pub fn current(&self) -> u64 {
        self.completed + 1
    }

    /// Whether `worker` has pushed `round`.
    pub fn has_pushed(&self, worker: u32, round: u64) -> bool {
        self.last_pushed[worker as usize] >= round
    }

    /// Accepts a push; returns true when it is the last push of its round.
    pub fn push(&mut self, worker: u32, round: u64) -> Result<bool, RoundError> {
        self.admit(worker, "push", round)?;
        let w = worker as usize;
        let expected = self.last_pushed[w] + 1;
        if round == self.last_pushed[w] && round > 0 {
            return Err(RoundError::DuplicatePush { worker, round });
        }
        let why = if round != expected {
            Some(format!("expected round {expected}"))
        } else if round > 1 && self.last_pulled[w] < round - 1 {
            Some(format!("round {} must be pulled first", round - 1))
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
        debug_assert_eq!(round, self.current());
        self.last_pushed[w] = round;
        self.pushes_in_round += 1;
        if self.pushes_in_round == self.quorum() {
            self.pushes_in_round = 0;
            self.completed = round;
            return Ok(true);
        }
        Ok(false)
    }

    /// Accepts a pull and says whether it can be answered now.
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
            if self.last_pushed[w] > 0 {
                return Err(out_of_sequence(
                    "the initial value (round 0) can only be pulled before the first push".into(),
                ));
            }
            self.pulled_initial[w] = true;
            return Ok(PullOutcome::Ready);
        }
        if round <= self.last_pulled[w] {
            return Err(RoundError::DuplicatePull { worker, round });
        }
        if round != self.last_pulled[w] + 1 {
            return Err(out_of_sequence(format!(
                "expected round {}",
                self.last_pulled[w] + 1
            )));
        }
        if round > self.last_pushed[w] {
            return Err(out_of_sequence(format!(
                "worker {worker} has not pushed round {round}"
            )));
        }
        self.last_pulled[w] = round;
        Ok(if self.completed >= round {
            PullOutcome::Ready
        } else {
            PullOutcome::Wait
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_round_completes_when_every_worker_pushed() {
        let mut t = RoundTracker::new(3, None);
        assert_eq!(t.push(0, 1), Ok(false));
        assert_eq!(t.pull(0, 1), Ok(PullOutcome::Wait));
        assert_eq!(t.push(2, 1), Ok(false));
        assert_eq!(t.push(1, 1), Ok(true));
        assert_eq!(t.completed(), 1);
        assert_eq!(t.pull(1, 1), Ok(PullOutcome::Ready));
        // Worker 0 pulled round 1 already and may go on; worker 2 may not.
        assert_eq!(t.push(0, 2), Ok(false));
        let e = t.push(2, 2).unwrap_err();
        assert!(
            e.to_string().contains("round 1 must be pulled first"),
            "{e}"
        );
    }

    #[test]
    fn duplicates_and_gaps_are_refused() {
        let mut t = RoundTracker::new(2, None);
        t.push(0, 1).unwrap();
        assert_eq!(
            t.push(0, 1),
            Err(RoundError::DuplicatePush {
                worker: 0,
                round: 1
            })
        );
        assert!(matches!(
            t.push(1, 3),
            Err(RoundError::OutOfSequence { .. })
        ));
        assert!(matches!(
            t.push(1, 0),
            Err(RoundError::OutOfSequence { .. })
        ));
        t.push(1, 1).unwrap();
        t.pull(0, 1).unwrap();
        assert_eq!(
            t.pull(0, 1),
            Err(RoundError::DuplicatePull {
                worker: 0,
                round: 1
            })
        );
        let e = t.pull(1, 2).unwrap_err();
        assert!(e.to_string().contains("expected round 1"), "{e}");
        let e = {
            t.pull(1, 1).unwrap();
            t.pull(1, 2).unwrap_err()
        };
        assert!(e.to_string().contains("has not pushed round 2"), "{e}");
    }

    #[test]
    fn initial_value_is_pulled_once_before_the_first_push() {
        let mut t = RoundTracker::new(1, None);
        assert_eq!(t.pull(0, 0), Ok(PullOutcome::Ready));
        assert!(matches!(
            t.pull(0, 0),
            Err(RoundError::DuplicatePull { .. })
        ));
        let mut t = RoundTracker::new(2, None);
        t.push(0, 1).unwrap();
        assert!(matches!(
            t.pull(0, 0),
            Err(RoundError::OutOfSequence { .. })
        ));
    }

    #[test]
    fn many_rounds_in_lockstep() {
        let mut t = RoundTracker::new(4, None);
        for r in 1..=50 {
            for w in 0..4 {
                assert_eq!(t.push(w, r).unwrap(), w == 3);
            }
            for w in 0..4 {
                assert_eq!(t.pull(w, r), Ok(PullOutcome::Ready));
                assert!(t.has_pushed(w, r));
            }
        }
        assert_eq!(t.completed(), 50);
    }

    #[test]
    fn a_member_key_completes_when_its_members_pushed() {
        let members: Arc<[u32]> = Arc::from([0, 2]);
        let mut t = RoundTracker::new(3, Some(Arc::clone(&members)));
        assert!(t.counts(2) && !t.counts(1));
        for r in 1..=3 {
            assert_eq!(t.push(2, r), Ok(false));
            assert_eq!(t.pull(2, r), Ok(PullOutcome::Wait));
            assert_eq!(t.push(0, r), Ok(true), "round {r}: both members pushed");
            assert_eq!(t.completed(), r);
            assert_eq!(t.pull(0, r), Ok(PullOutcome::Ready));
        }
        // Worker 1 is not a member: its push is refused and counts for nothing.
        assert_eq!(
            t.push(1, 4),
            Err(RoundError::NotMember {
                worker: 1,
                op: "push",
                round: 4,
                members: Arc::clone(&members)
            })
        );
        let e = t.pull(1, 0).unwrap_err();
        assert_eq!(
            e.to_string(),
            "worker 1 sent pull of round 0, but the key's rounds count only its members, \
             workers [0, 2]"
        );
        assert_eq!(t.push(0, 4), Ok(false));
        assert_eq!(t.push(2, 4), Ok(true));
    }

    #[test]
    fn a_key_of_every_worker_admits_everyone() {
        let t = RoundTracker::new(2, None);
        assert!(t.counts(0) && t.counts(1));
        assert_eq!(t.admit(1, "push", 1), Ok(()));
    }
}
