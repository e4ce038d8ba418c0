//! Asynchronous handles: one per push_pull, completed partition by partition.
//!
//! Enqueueing returns a handle at once; the caller polls or waits. A failure of any
//! partition fails the handle, and the error reaches whoever waits on it. A tensor has at
//! most one push_pull in flight, because a worker must pull round r of a key before it may
//! push round r + 1.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, OnceLock};
use std::time::{Duration, Instant};

use sumflow_plan::partition::Partition;

use crate::error::CommError;

#[derive(Debug)]
struct Op {
    tensor_id: u32,
    tensor: String,
    parts: usize,
    /// Outstanding partitions, by server rank, for timeout messages.
    outstanding: HashMap<u64, usize>,
    error: Option<CommError>,
    /// Stage threads reading or writing the caller's buffer right now. A failed operation
    /// is released only once this is 0, and no access starts after a failure, so the
    /// buffer is never touched after `wait` returns.
    in_use: u32,
}

#[derive(Debug, Default)]
struct State {
    next: u64,
    ops: HashMap<u64, Op>,
    busy: HashSet<u32>,
    /// Threads asleep in `wait` or `wait_idle`. Stage threads end an access and complete a
    /// partition hundreds of times a second; they notify only when an operation settles and
    /// someone sleeps, since a notify is a futex system call even with no one to wake, and
    /// a waiter woken for every partition spends a context switch to go back to sleep.
    waiting: usize,
}

impl Op {
    /// Whether a waiter may return: done or failed, and no stage touching the buffer.
    fn settled(&self) -> bool {
        self.in_use == 0 && (self.error.is_some() || self.outstanding.is_empty())
    }
}

/// Operations on tensor ids with this bit set are the network legs of shared-memory
/// rounds (a machine's slice crossing to the servers, aggregated inside the machine
/// first): when one ends, the shared-memory stage is woken (see [`Handles::on_crossing`]).
pub const CROSSING: u32 = 1 << 31;

/// What wakes the shared-memory stage.
struct Wake(Box<dyn Fn() + Send + Sync>);

impl std::fmt::Debug for Wake {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Wake")
    }
}

#[derive(Debug, Default)]
pub struct Handles {
    state: Mutex<State>,
    changed: Condvar,
    crossing: OnceLock<Wake>,
    /// Operations on [`CROSSING`] tensor ids that ended so far (see [`Handles::crossings_ended`]).
    crossings_ended: AtomicU64,
}

impl Handles {
    /// Calls `wake` whenever an operation on a [`CROSSING`] tensor id completes or fails
    /// (the shared-memory stage sleeps on its machine's doorbell). Set once.
    pub fn on_crossing(&self, wake: Box<dyn Fn() + Send + Sync>) {
        let _ = self.crossing.set(Wake(wake));
    }

    fn crossed(&self, ended: bool) {
        if !ended {
            return;
        }
        self.crossings_ended.fetch_add(1, Ordering::Release);
        if let Some(wake) = self.crossing.get() {
            (wake.0)();
        }
    }

    /// How many operations on [`CROSSING`] tensor ids have completed or failed: while it
    /// stays the same, polling those operations again tells nothing new.
    pub fn crossings_ended(&self) -> u64 {
        self.crossings_ended.load(Ordering::Acquire)
    }

    /// Wakes the waiters, if any sleep.
    fn notify(&self, s: &State) {
        if s.waiting > 0 {
            self.changed.notify_all();
        }
    }

    /// Tensors with an operation whose partitions are not all done.
    pub fn busy(&self) -> usize {
        self.state.lock().expect("handles lock").busy.len()
    }

    /// Waits until no operation has partitions outstanding, at most `timeout`; otherwise
    /// returns the tensors still in flight.
    pub fn wait_idle(&self, timeout: Duration) -> Result<(), Vec<String>> {
        let mut s = self.state.lock().expect("handles lock");
        s.waiting += 1;
        let (mut s, _) = self
            .changed
            .wait_timeout_while(s, timeout, |s| !s.busy.is_empty())
            .expect("handles lock");
        s.waiting -= 1;
        if s.busy.is_empty() {
            return Ok(());
        }
        let mut names: Vec<String> = s
            .ops
            .values()
            .filter(|op| op.error.is_none() && !op.outstanding.is_empty())
            .map(|op| op.tensor.clone())
            .collect();
        names.sort();
        Err(names)
    }

    /// Whether tensor `tensor_id` has an operation whose partitions are not all done, or
    /// whose buffer a stage thread is still touching (a failed one's).
    pub fn in_flight(&self, tensor_id: u32) -> bool {
        let s = self.state.lock().expect("handles lock");
        s.busy.contains(&tensor_id)
            || s.ops
                .values()
                .any(|op| op.tensor_id == tensor_id && op.in_use > 0)
    }

    /// Starts an operation on a tensor of these partitions; refuses a tensor that is
    /// already in flight.
    pub fn start(
        &self,
        tensor_id: u32,
        tensor: &str,
        parts: &[Partition],
    ) -> Result<u64, CommError> {
        let mut s = self.state.lock().expect("handles lock");
        if !s.busy.insert(tensor_id) {
            return Err(CommError::Busy(tensor.to_string()));
        }
        let outstanding: HashMap<u64, usize> =
            parts.iter().map(|p| (p.key, p.server as usize)).collect();
        s.next += 1;
        let id = s.next;
        let parts = outstanding.len();
        s.ops.insert(
            id,
            Op {
                tensor_id,
                tensor: tensor.to_string(),
                parts,
                outstanding,
                error: None,
                in_use: 0,
            },
        );
        Ok(id)
    }

    /// Called before a stage reads or writes the caller's buffer: false when the operation
    /// failed or is unknown, and then the buffer must not be touched (its waiter may have
    /// returned and the buffer be gone). After true, call [`Self::end_access`].
    pub fn begin_access(&self, handle: u64) -> bool {
        let mut s = self.state.lock().expect("handles lock");
        match s.ops.get_mut(&handle) {
            Some(op) if op.error.is_none() => {
                op.in_use += 1;
                true
            }
            _ => false,
        }
    }

    /// Ends an access begun by [`Self::begin_access`]; with `done`, that partition (by key)
    /// is complete.
    pub fn end_access(&self, handle: u64, done: Option<u64>) {
        let mut s = self.state.lock().expect("handles lock");
        let Some(op) = s.ops.get_mut(&handle) else {
            return;
        };
        op.in_use -= 1;
        let released = op.settled();
        let (ended, crossed) = match done {
            Some(key) => Self::complete(&mut s, handle, key),
            None => (false, false),
        };
        if released || ended {
            self.notify(&s);
        }
        drop(s);
        self.crossed(crossed);
    }

    /// Marks partition `key` done: whether that ended the operation, and whether it was a
    /// [`CROSSING`] one.
    fn complete(s: &mut State, handle: u64, key: u64) -> (bool, bool) {
        let Some(op) = s.ops.get_mut(&handle) else {
            return (false, false);
        };
        if op.outstanding.remove(&key).is_none() || !op.outstanding.is_empty() {
            return (false, false);
        }
        let t = op.tensor_id;
        s.busy.remove(&t);
        (true, t & CROSSING != 0)
    }

    /// Fails the operation; its tensor may be used again (the job is likely broken anyway,
    /// but the caller decides).
    pub fn fail(&self, handle: u64, make: impl FnOnce(&str) -> CommError) {
        let mut s = self.state.lock().expect("handles lock");
        let Some(op) = s.ops.get_mut(&handle) else {
            return;
        };
        if op.error.is_none() {
            op.error = Some(make(&op.tensor));
        }
        let t = op.tensor_id;
        s.busy.remove(&t);
        // An access in progress ends with end_access, which notifies again.
        self.notify(&s);
        drop(s);
        self.crossed(t & CROSSING != 0);
    }

    /// Whether the operation finished; an error if it failed. Does not consume the handle.
    pub fn poll(&self, handle: u64) -> Result<bool, CommError> {
        let s = self.state.lock().expect("handles lock");
        let op = s.ops.get(&handle).ok_or(CommError::UnknownHandle(handle))?;
        match &op.error {
            Some(e) => Err(e.clone()),
            None => Ok(op.outstanding.is_empty()),
        }
    }

    /// Waits for the operation and releases the handle. `describe_server` turns a server
    /// rank into a name for the timeout message. Once this returns anything but a timeout,
    /// the operation never touches its buffer again; after a timeout it may still.
    pub fn wait(
        &self,
        handle: u64,
        timeout: Duration,
        describe_server: impl Fn(usize) -> String,
    ) -> Result<(), CommError> {
        let started = Instant::now();
        let mut s = self.state.lock().expect("handles lock");
        if !s.ops.contains_key(&handle) {
            return Err(CommError::UnknownHandle(handle));
        }
        s.waiting += 1;
        let (mut s, _) = self
            .changed
            .wait_timeout_while(s, timeout, |s| !s.ops[&handle].settled())
            .expect("handles lock");
        s.waiting -= 1;
        let op = &s.ops[&handle];
        if !op.settled() {
            let mut servers: Vec<usize> = op.outstanding.values().copied().collect();
            servers.sort_unstable();
            servers.dedup();
            let names: Vec<String> = servers.into_iter().map(describe_server).collect();
            return Err(CommError::Timeout {
                tensor: op.tensor.clone(),
                secs: started.elapsed().as_secs_f64(),
                outstanding: op.outstanding.len(),
                parts: op.parts,
                servers: names.join(", "),
            });
        }
        let op = s.ops.remove(&handle).expect("present");
        match op.error {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    /// Fails every operation still in flight, or with `server`, those waiting on it.
    pub fn fail_all(&self, server: Option<usize>, make: impl Fn(&str) -> CommError) {
        let mut s = self.state.lock().expect("handles lock");
        let mut freed = Vec::new();
        for op in s.ops.values_mut() {
            let affected = match server {
                Some(srv) => op.outstanding.values().any(|s| *s == srv),
                None => !op.outstanding.is_empty(),
            };
            if op.error.is_none() && affected {
                op.error = Some(make(&op.tensor));
                freed.push(op.tensor_id);
            }
        }
        let crossed = freed.iter().any(|t| t & CROSSING != 0);
        for t in freed {
            s.busy.remove(&t);
        }
        self.notify(&s);
        drop(s);
        self.crossed(crossed);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Partitions of these keys on these servers.
    fn on_servers(parts: &[(u64, u32)]) -> Vec<Partition> {
        parts
            .iter()
            .map(|&(key, server)| Partition {
                key,
                bytes: 4,
                server,
                ..Partition::default()
            })
            .collect()
    }

    /// What a receiver does with a partition's sum: reads it in, and marks it done.
    fn done(h: &Handles, handle: u64, key: u64) {
        assert!(h.begin_access(handle));
        h.end_access(handle, Some(key));
    }

    #[test]
    fn completes_when_every_partition_is_done() {
        let h = Handles::default();
        let id = h.start(1, "w", &on_servers(&[(10, 0), (11, 1)])).unwrap();
        assert!(matches!(
            h.start(1, "w", &on_servers(&[(12, 0)])),
            Err(CommError::Busy(_))
        ));
        assert!(!h.poll(id).unwrap());
        done(&h, id, 10);
        done(&h, id, 11);
        assert!(h.poll(id).unwrap());
        h.wait(id, Duration::from_secs(1), |s| s.to_string())
            .unwrap();
        assert!(matches!(h.poll(id), Err(CommError::UnknownHandle(_))));
        // The tensor is free again.
        h.start(1, "w", &on_servers(&[(10, 0)])).unwrap();
    }

    #[test]
    fn errors_reach_the_waiter_and_timeouts_name_the_servers() {
        let h = Handles::default();
        let id = h
            .start(2, "fc.weight", &on_servers(&[(1, 0), (2, 3)]))
            .unwrap();
        done(&h, id, 1);
        let e = h
            .wait(id, Duration::from_millis(20), |s| format!("server {s}"))
            .unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("fc.weight") && msg.contains("1 of 2") && msg.contains("server 3"),
            "{msg}"
        );
        h.fail(id, |t| CommError::Invalid(format!("{t} broke")));
        let e = h
            .wait(id, Duration::from_secs(1), |s| s.to_string())
            .unwrap_err();
        assert_eq!(e.to_string(), "invalid argument: fc.weight broke");
    }

    #[test]
    fn no_access_starts_after_a_failure_and_a_failed_wait_outlasts_one() {
        let h = std::sync::Arc::new(Handles::default());
        let id = h.start(4, "c", &on_servers(&[(1, 0), (2, 1)])).unwrap();
        assert!(h.begin_access(id));
        h.fail(id, |t| CommError::Invalid(format!("{t} lost a server")));
        assert!(
            !h.begin_access(id),
            "no access may start once the operation failed"
        );
        let h2 = h.clone();
        let waiter =
            std::thread::spawn(move || h2.wait(id, Duration::from_secs(10), |s| s.to_string()));
        std::thread::sleep(Duration::from_millis(30));
        assert!(
            !waiter.is_finished(),
            "the wait must outlast the access in progress"
        );
        h.end_access(id, Some(1));
        assert!(waiter.join().unwrap().is_err());
        assert!(!h.begin_access(id), "released");
    }

    #[test]
    fn a_waiter_wakes_when_another_thread_completes() {
        let h = std::sync::Arc::new(Handles::default());
        let id = h.start(3, "b", &on_servers(&[(7, 0)])).unwrap();
        let h2 = h.clone();
        let t = std::thread::spawn(move || h2.wait(id, Duration::from_secs(10), |s| s.to_string()));
        std::thread::sleep(Duration::from_millis(20));
        done(&h, id, 7);
        t.join().unwrap().unwrap();
    }
}
