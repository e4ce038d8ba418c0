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
//!
//! A worker may *join* (Horovod's `join()`: it has finished its data). While joined it
//! pushes and pulls nothing, and a round completes once every member has pushed it or is
//! joined (and at least one push came: a round nobody pushed never completes). Each round
//! that completes without a joined member's push moves that worker's *offset* on by one:
//! the worker's own round numbers then lag the key's by its offset. When it leaves join
//! and pushes or pulls its round r, the key's round r + offset is meant, and every answer
//! it gets names its own numbering again, so workers never learn of offsets.

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
        "worker {worker} has joined (it has finished its data): it may not send {op} of \
         round {round} until it leaves join"
    )]
    Joined {
        worker: u32,
        op: &'static str,
        round: u64,
    },
    #[error(
        "worker {worker} joined with round {round} pushed but not pulled: a worker joins \
         with no rounds in flight"
    )]
    JoinedMidRound { worker: u32, round: u64 },
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

/// Whether `worker` is among a key's `members` (`None`: every worker is).
pub(crate) fn is_member(members: Option<&[u32]>, worker: u32) -> bool {
    members.is_none_or(|m| m.binary_search(&worker).is_ok())
}

/// Refuses a push or pull of `round` by a worker that is not among a key's `members`.
pub(crate) fn admit(
    members: Option<&Arc<[u32]>>,
    worker: u32,
    op: &'static str,
    round: u64,
) -> Result<(), RoundError> {
    match members {
        Some(members) if !is_member(Some(members), worker) => Err(RoundError::NotMember {
            worker,
            op,
            round,
            members: Arc::clone(members),
        }),
        _ => Ok(()),
    }
}

#[derive(Debug)]
pub struct RoundTracker {
    completed: u64,
    pushes_in_round: u32,
    /// The workers whose pushes make up a round, ascending; `None`: every worker.
    members: Option<Arc<[u32]>>,
    /// Indexed by worker rank, members or not: a few bytes per worker buys indexing
    /// without a lookup on every push. Rounds here are the key's; a joined worker's move
    /// on with each round that completes without it.
    last_pushed: Vec<u64>,
    last_pulled: Vec<u64>,
    pulled_initial: Vec<bool>,
    /// Which workers have joined, and how many.
    joined: Vec<bool>,
    joined_count: u32,
    /// How far each worker's own round numbers lag the key's: the rounds that completed
    /// while it had joined.
    offset: Vec<u64>,
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
            joined: vec![false; n],
            joined_count: 0,
            offset: vec![0; n],
        }
    }

    /// How many pushes complete a round when no worker has joined.
    fn quorum(&self) -> u32 {
        match &self.members {
            Some(m) => m.len() as u32,
            None => self.last_pushed.len() as u32,
        }
    }

    /// Whether `worker`'s pushes count towards this key's rounds.
    pub fn counts(&self, worker: u32) -> bool {
        is_member(self.members.as_deref(), worker)
    }

    /// Refuses a push or pull of `round` by a worker that is not one of the key's members.
    pub fn admit(&self, worker: u32, op: &'static str, round: u64) -> Result<(), RoundError> {
        admit(self.members.as_ref(), worker, op, round)
    }

    /// Whether no round has begun: nothing pushed, nothing completed.
    pub fn is_fresh(&self) -> bool {
        self.completed == 0 && self.pushes_in_round == 0
    }

    /// The last round every member has pushed or was joined for (0 before the first), in
    /// the key's numbering.
    pub fn completed(&self) -> u64 {
        self.completed
    }

    /// The round now accumulating, in the key's numbering.
    pub fn current(&self) -> u64 {
        self.completed + 1
    }

    /// Whether `worker` has pushed the key's `round` (or was joined when it completed).
    pub fn has_pushed(&self, worker: u32, round: u64) -> bool {
        self.last_pushed[worker as usize] >= round
    }

    /// The workers whose pushes the round now accumulating still lacks: members that have
    /// neither pushed it nor joined, ascending.
    pub fn missing(&self) -> Vec<u32> {
        let round = self.current();
        let lacks = |w: &u32| !self.has_pushed(*w, round) && !self.is_joined(*w);
        match &self.members {
            Some(m) => m.iter().copied().filter(lacks).collect(),
            None => (0..self.last_pushed.len() as u32).filter(lacks).collect(),
        }
    }

    /// Whether `worker` has joined.
    pub fn is_joined(&self, worker: u32) -> bool {
        self.joined[worker as usize]
    }

    /// How many of this key's rounds completed while `worker` had joined.
    pub fn offset(&self, worker: u32) -> u64 {
        self.offset[worker as usize]
    }

    /// The key's `round` in `worker`'s own numbering.
    pub fn own_round(&self, worker: u32, round: u64) -> u64 {
        round.saturating_sub(self.offset[worker as usize])
    }

    /// `worker`'s own `round` in the key's numbering.
    pub fn key_round(&self, worker: u32, round: u64) -> u64 {
        round.saturating_add(self.offset[worker as usize])
    }

    /// Accepts a push of `worker`'s own `round`; returns true when it completes its round.
    pub fn push(&mut self, worker: u32, round: u64) -> Result<bool, RoundError> {
        self.admit(worker, "push", round)?;
        let w = worker as usize;
        if self.joined[w] {
            return Err(RoundError::Joined {
                worker,
                op: "push",
                round,
            });
        }
        let off = self.offset[w];
        let r = round.saturating_add(off);
        let expected = self.last_pushed[w] + 1;
        if r == self.last_pushed[w] && round > 0 {
            return Err(RoundError::DuplicatePush { worker, round });
        }
        let why = if r != expected {
            Some(format!("expected round {}", expected - off))
        } else if r > 1 && self.last_pulled[w] < r - 1 {
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
        debug_assert_eq!(r, self.current());
        self.last_pushed[w] = r;
        self.pushes_in_round += 1;
        Ok(self.complete_if_ready())
    }

    /// Completes the current round if every member has pushed it or has joined, and at
    /// least one push came; joined members that did not push it fall one round further
    /// behind. Returns whether it completed.
    fn complete_if_ready(&mut self) -> bool {
        if self.pushes_in_round == 0 {
            return false;
        }
        let round = self.current();
        if self.joined_count == 0 {
            if self.pushes_in_round < self.quorum() {
                return false;
            }
        } else {
            let ready = (0..self.last_pushed.len() as u32)
                .filter(|&w| self.counts(w))
                .all(|w| self.joined[w as usize] || self.last_pushed[w as usize] >= round);
            if !ready {
                return false;
            }
            for w in 0..self.last_pushed.len() {
                if self.joined[w] && self.counts(w as u32) && self.last_pushed[w] < round {
                    self.offset[w] += 1;
                    self.last_pushed[w] = round;
                    self.last_pulled[w] = round;
                }
            }
        }
        self.pushes_in_round = 0;
        self.completed = round;
        true
    }

    /// `worker` has joined: this key's rounds no longer wait for it. Returns true when
    /// that completes the round now accumulating. Joining twice changes nothing.
    pub fn join(&mut self, worker: u32) -> Result<bool, RoundError> {
        let w = worker as usize;
        if self.joined[w] {
            return Ok(false);
        }
        if self.counts(worker) && self.last_pulled[w] < self.last_pushed[w] {
            return Err(RoundError::JoinedMidRound {
                worker,
                round: self.last_pushed[w] - self.offset[w],
            });
        }
        self.joined[w] = true;
        self.joined_count += 1;
        Ok(self.counts(worker) && self.complete_if_ready())
    }

    /// `worker` leaves join: its next push is its own next round, the key's round that
    /// follows the last one completed. Leaving when not joined changes nothing.
    pub fn leave(&mut self, worker: u32) {
        let w = worker as usize;
        if self.joined[w] {
            self.joined[w] = false;
            self.joined_count -= 1;
        }
    }

    /// Accepts a pull of `worker`'s own `round` and says whether it can be answered now.
    pub fn pull(&mut self, worker: u32, round: u64) -> Result<PullOutcome, RoundError> {
        self.admit(worker, "pull", round)?;
        let w = worker as usize;
        if self.joined[w] {
            return Err(RoundError::Joined {
                worker,
                op: "pull",
                round,
            });
        }
        let out_of_sequence = |why: String| RoundError::OutOfSequence {
            worker,
            op: "pull",
            round,
            why,
        };
        let off = self.offset[w];
        if round == 0 {
            if self.pulled_initial[w] {
                return Err(RoundError::DuplicatePull { worker, round });
            }
            if off > 0 {
                return Err(out_of_sequence(format!(
                    "the initial value (round 0) is gone: {off} round(s) completed while \
                     worker {worker} had joined"
                )));
            }
            if self.last_pushed[w] > 0 {
                return Err(out_of_sequence(
                    "the initial value (round 0) can only be pulled before the first push".into(),
                ));
            }
            self.pulled_initial[w] = true;
            return Ok(PullOutcome::Ready);
        }
        let r = round.saturating_add(off);
        if r <= self.last_pulled[w] {
            return Err(RoundError::DuplicatePull { worker, round });
        }
        if r != self.last_pulled[w] + 1 {
            return Err(out_of_sequence(format!(
                "expected round {}",
                self.last_pulled[w] + 1 - off
            )));
        }
        if r > self.last_pushed[w] {
            return Err(out_of_sequence(format!(
                "worker {worker} has not pushed round {round}"
            )));
        }
        self.last_pulled[w] = r;
        Ok(if self.completed >= r {
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

    #[test]
    fn a_joined_worker_counts_as_pushed_and_falls_behind_by_an_offset() {
        let mut t = RoundTracker::new(3, None);
        // Round 1 with everyone.
        for w in 0..3 {
            t.push(w, 1).unwrap();
        }
        for w in 0..3 {
            assert_eq!(t.pull(w, 1), Ok(PullOutcome::Ready));
        }
        // Worker 2 joins; rounds 2 and 3 complete with workers 0 and 1 alone.
        assert_eq!(
            t.join(2),
            Ok(false),
            "no push of round 2 yet: nothing completes"
        );
        assert!(t.is_joined(2));
        for r in 2..=3 {
            assert_eq!(t.push(0, r), Ok(false));
            assert_eq!(t.push(1, r), Ok(true), "round {r}: worker 2 has joined");
            assert_eq!(t.pull(0, r), Ok(PullOutcome::Ready));
            assert_eq!(t.pull(1, r), Ok(PullOutcome::Ready));
        }
        assert_eq!((t.completed(), t.offset(2), t.offset(0)), (3, 2, 0));
        // A joined worker neither pushes nor pulls.
        let e = t.push(2, 2).unwrap_err();
        assert_eq!(
            e,
            RoundError::Joined {
                worker: 2,
                op: "push",
                round: 2
            }
        );
        assert!(e.to_string().contains("has joined"), "{e}");
        assert!(matches!(t.pull(2, 1), Err(RoundError::Joined { .. })));
        // Joining twice changes nothing.
        assert_eq!(t.join(2), Ok(false));
        // It leaves join: its own round 2 is the key's round 4.
        t.leave(2);
        assert!(!t.is_joined(2));
        assert_eq!(t.key_round(2, 2), 4);
        assert_eq!(t.own_round(2, 4), 2);
        assert_eq!(t.push(0, 4), Ok(false));
        assert_eq!(t.push(2, 2), Ok(false));
        assert_eq!(t.pull(2, 2), Ok(PullOutcome::Wait));
        assert_eq!(t.push(1, 4), Ok(true));
        assert_eq!(t.completed(), 4);
        // Errors name the worker's own rounds.
        let e = t.push(2, 2).unwrap_err();
        assert_eq!(
            e,
            RoundError::DuplicatePush {
                worker: 2,
                round: 2
            }
        );
        let e = t.push(2, 5).unwrap_err();
        assert!(e.to_string().contains("expected round 3"), "{e}");
        let e = t.pull(2, 4).unwrap_err();
        assert!(e.to_string().contains("expected round 3"), "{e}");
        assert!(matches!(
            t.pull(2, 0),
            Err(RoundError::OutOfSequence { .. })
        ));
    }

    #[test]
    fn joining_completes_a_round_the_others_pushed() {
        let mut t = RoundTracker::new(3, None);
        t.push(0, 1).unwrap();
        t.push(1, 1).unwrap();
        assert_eq!(t.pull(0, 1), Ok(PullOutcome::Wait));
        assert_eq!(t.join(2), Ok(true), "worker 2 was the only one missing");
        assert_eq!((t.completed(), t.offset(2)), (1, 1));
        assert_eq!(t.pull(1, 1), Ok(PullOutcome::Ready));
        // Everyone joined but one: each of its pushes completes a round alone.
        assert_eq!(t.join(1), Ok(false));
        assert_eq!(t.push(0, 2), Ok(true));
        assert_eq!((t.offset(1), t.offset(2)), (1, 2));
        // Everyone joined: nothing completes, for no one pushed.
        t.pull(0, 2).unwrap();
        assert_eq!(t.join(0), Ok(false));
        assert_eq!(t.completed(), 2);
        for w in 0..3 {
            t.leave(w);
        }
        // Back in step, each in its own numbering: worker 0 at 3, 1 at 2, 2 at 1.
        assert_eq!(t.push(0, 3), Ok(false));
        assert_eq!(t.push(1, 2), Ok(false));
        assert_eq!(t.push(2, 1), Ok(true));
        for (w, own) in [(0, 3), (1, 2), (2, 1)] {
            assert_eq!(t.pull(w, own), Ok(PullOutcome::Ready));
            assert_eq!(t.own_round(w, t.completed()), own);
        }
    }

    #[test]
    fn a_worker_joins_only_with_no_round_in_flight() {
        let mut t = RoundTracker::new(2, None);
        t.push(0, 1).unwrap();
        let e = t.join(0).unwrap_err();
        assert_eq!(
            e,
            RoundError::JoinedMidRound {
                worker: 0,
                round: 1
            }
        );
        assert!(!t.is_joined(0));
        // Worker 1 may join: round 1 completes with worker 0's push alone.
        assert_eq!(t.join(1), Ok(true));
        assert_eq!(t.pull(0, 1), Ok(PullOutcome::Ready));
    }

    #[test]
    fn a_member_key_counts_only_joined_members() {
        let mut t = RoundTracker::new(3, Some(Arc::from([0, 2])));
        // Worker 1 is no member: its joining completes nothing and moves no offset.
        assert_eq!(t.join(1), Ok(false));
        t.push(0, 1).unwrap();
        assert_eq!(t.completed(), 0, "worker 2 still has to push");
        assert_eq!(t.join(2), Ok(true));
        assert_eq!((t.offset(1), t.offset(2)), (0, 1));
    }

    #[test]
    fn a_key_first_used_while_a_worker_had_joined_starts_it_behind() {
        let mut t = RoundTracker::new(2, None);
        assert_eq!(t.join(1), Ok(false));
        for r in 1..=3 {
            assert_eq!(t.push(0, r), Ok(true));
            t.pull(0, r).unwrap();
        }
        t.leave(1);
        // Worker 1's first push of the key is its round 1, the key's round 4.
        assert_eq!(t.push(1, 1), Ok(false));
        assert_eq!(t.push(0, 4), Ok(true));
        assert_eq!(t.pull(1, 1), Ok(PullOutcome::Ready));
        assert_eq!(t.own_round(1, t.completed()), 1);
    }
}
