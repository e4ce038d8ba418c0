//! The synchronous round protocol of one key, as a pure state machine.
//!
//! Every worker alternates push and pull: it pushes round r, pulls round r, then may push
//! round r + 1. So at most one round per key is accumulating while the previous round's
//! sum waits for its last pulls, which is what bounds a key's memory to two buffers. The
//! optional round 0 pull returns the key's initial value before the worker's first push.

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
    last_pushed: Vec<u64>,
    last_pulled: Vec<u64>,
    pulled_initial: Vec<bool>,
}

impl RoundTracker {
    pub fn new(workers: u32) -> Self {
        let n = workers as usize;
        RoundTracker {
            completed: 0,
            pushes_in_round: 0,
            last_pushed: vec![0; n],
            last_pulled: vec![0; n],
            pulled_initial: vec![false; n],
        }
    }

    pub fn workers(&self) -> u32 {
        self.last_pushed.len() as u32
    }

    /// The last round every worker has pushed (0 before the first).
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
        if self.pushes_in_round == self.workers() {
            self.pushes_in_round = 0;
            self.completed = round;
            return Ok(true);
        }
        Ok(false)
    }

    /// Accepts a pull and says whether it can be answered now.
    pub fn pull(&mut self, worker: u32, round: u64) -> Result<PullOutcome, RoundError> {
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
        let mut t = RoundTracker::new(3);
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
        let mut t = RoundTracker::new(2);
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
        let mut t = RoundTracker::new(1);
        assert_eq!(t.pull(0, 0), Ok(PullOutcome::Ready));
        assert!(matches!(
            t.pull(0, 0),
            Err(RoundError::DuplicatePull { .. })
        ));
        let mut t = RoundTracker::new(2);
        t.push(0, 1).unwrap();
        assert!(matches!(
            t.pull(0, 0),
            Err(RoundError::OutOfSequence { .. })
        ));
    }

    #[test]
    fn many_rounds_in_lockstep() {
        let mut t = RoundTracker::new(4);
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
}
