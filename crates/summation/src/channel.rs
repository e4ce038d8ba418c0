//! The queues between a server's threads (connection readers, engines, writers, buffer
//! pools): channels whose receivers sleep at once when there is nothing to take.
//!
//! crossbeam's channels, like std's, spin and then call `sched_yield` up to eight times
//! before a receiver sleeps. A server's engine and writer threads wait on their queues
//! hundreds of times a second, so on a machine whose cores are all busy (a worker host
//! with a colocated server, or a CPU server pressed for cores) every wait became a burst of
//! context switches: perf counted 7,400 `sched_yield` calls per second, all from engines
//! and writers, on issue 22's cluster. Here a receiver with nothing to take sleeps on a
//! condition variable, and a sender wakes only a thread that is actually asleep (an
//! unconditional notify is a futex syscall every time).

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use thiserror::Error;

#[derive(Debug)]
struct State<T> {
    items: VecDeque<T>,
    /// Items the queue holds before `send` waits; `None` is unbounded.
    capacity: Option<usize>,
    senders: usize,
    receiver: bool,
    /// Threads asleep in `recv` (at most one receiver, but it may be shared by reference).
    takers_asleep: usize,
    /// Threads asleep in `send` on a full queue.
    givers_asleep: usize,
}

#[derive(Debug)]
struct Queue<T> {
    state: Mutex<State<T>>,
    /// An item arrived or the last sender left.
    filled: Condvar,
    /// Room appeared or the receiver left.
    emptied: Condvar,
}

impl<T> Queue<T> {
    fn lock(&self) -> MutexGuard<'_, State<T>> {
        // A panicking holder cannot leave the queue half-changed (every change is one
        // VecDeque call or a counter), so a poisoned lock is still a sound one.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sending side; clones share the queue, which disconnects once all are dropped.
pub struct Sender<T> {
    queue: Arc<Queue<T>>,
}

/// The receiving side; dropping it makes every later `send` fail.
pub struct Receiver<T> {
    queue: Arc<Queue<T>>,
}

impl<T> std::fmt::Debug for Sender<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Sender { .. }")
    }
}

impl<T> std::fmt::Debug for Receiver<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Receiver { .. }")
    }
}

/// The receiver is gone; the item comes back.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("sending on a channel whose receiver is gone")]
pub struct SendError<T>(pub T);

/// The channel is full, or its receiver gone; the item comes back.
#[derive(Debug, Error, PartialEq, Eq)]
#[error("the channel is full or its receiver gone")]
pub struct TrySendError<T>(pub T);

#[derive(Debug, Error, PartialEq, Eq)]
#[error("receiving on an empty channel whose senders are all gone")]
pub struct RecvError;

#[derive(Debug, Error, PartialEq, Eq)]
pub enum RecvTimeoutError {
    #[error("timed out waiting on a channel")]
    Timeout,
    #[error("receiving on an empty channel whose senders are all gone")]
    Disconnected,
}

#[derive(Debug, Error, PartialEq, Eq)]
pub enum TryRecvError {
    #[error("receiving on an empty channel")]
    Empty,
    #[error("receiving on an empty channel whose senders are all gone")]
    Disconnected,
}

fn channel<T>(capacity: Option<usize>) -> (Sender<T>, Receiver<T>) {
    let queue = Arc::new(Queue {
        state: Mutex::new(State {
            items: VecDeque::new(),
            capacity,
            senders: 1,
            receiver: true,
            takers_asleep: 0,
            givers_asleep: 0,
        }),
        filled: Condvar::new(),
        emptied: Condvar::new(),
    });
    (
        Sender {
            queue: Arc::clone(&queue),
        },
        Receiver { queue },
    )
}

/// A channel whose `send` waits while it holds `capacity` items.
pub fn bounded<T>(capacity: usize) -> (Sender<T>, Receiver<T>) {
    assert!(capacity > 0, "a bounded channel needs room for an item");
    channel(Some(capacity))
}

/// A channel whose `send` never waits.
pub fn unbounded<T>() -> (Sender<T>, Receiver<T>) {
    channel(None)
}

impl<T> Sender<T> {
    /// Queues `item`, waiting for room in a full bounded channel; fails, handing it back,
    /// once the receiver is gone.
    pub fn send(&self, item: T) -> Result<(), SendError<T>> {
        let mut s = self.queue.lock();
        while s.receiver && s.capacity.is_some_and(|c| s.items.len() >= c) {
            s.givers_asleep += 1;
            s = self
                .queue
                .emptied
                .wait(s)
                .unwrap_or_else(|e| e.into_inner());
            s.givers_asleep -= 1;
        }
        if !s.receiver {
            return Err(SendError(item));
        }
        s.items.push_back(item);
        if s.takers_asleep > 0 {
            self.queue.filled.notify_one();
        }
        Ok(())
    }

    /// Queues `item` if there is room now and a receiver.
    pub fn try_send(&self, item: T) -> Result<(), TrySendError<T>> {
        let mut s = self.queue.lock();
        if !s.receiver || s.capacity.is_some_and(|c| s.items.len() >= c) {
            return Err(TrySendError(item));
        }
        s.items.push_back(item);
        if s.takers_asleep > 0 {
            self.queue.filled.notify_one();
        }
        Ok(())
    }
}

impl<T> Clone for Sender<T> {
    fn clone(&self) -> Self {
        self.queue.lock().senders += 1;
        Sender {
            queue: Arc::clone(&self.queue),
        }
    }
}

impl<T> Drop for Sender<T> {
    fn drop(&mut self) {
        let mut s = self.queue.lock();
        s.senders -= 1;
        if s.senders == 0 && s.takers_asleep > 0 {
            self.queue.filled.notify_all();
        }
    }
}

impl<T> Receiver<T> {
    /// Takes the oldest item, sleeping until one comes; fails once the channel is empty
    /// and every sender is gone.
    pub fn recv(&self) -> Result<T, RecvError> {
        self.take(None).map_err(|_| RecvError)
    }

    /// As [`Receiver::recv`], giving up after `timeout`.
    pub fn recv_timeout(&self, timeout: Duration) -> Result<T, RecvTimeoutError> {
        self.take(Some(Instant::now() + timeout))
    }

    /// Takes the oldest item if there is one, without waiting.
    pub fn try_recv(&self) -> Result<T, TryRecvError> {
        let mut s = self.queue.lock();
        match self.pop(&mut s) {
            Some(item) => Ok(item),
            None if s.senders == 0 => Err(TryRecvError::Disconnected),
            None => Err(TryRecvError::Empty),
        }
    }

    /// The items queued now, without waiting.
    pub fn try_iter(&self) -> impl Iterator<Item = T> + '_ {
        std::iter::from_fn(|| self.try_recv().ok())
    }

    fn pop(&self, s: &mut State<T>) -> Option<T> {
        let item = s.items.pop_front()?;
        if s.givers_asleep > 0 {
            self.queue.emptied.notify_one();
        }
        Some(item)
    }

    fn take(&self, deadline: Option<Instant>) -> Result<T, RecvTimeoutError> {
        let mut s = self.queue.lock();
        loop {
            if let Some(item) = self.pop(&mut s) {
                return Ok(item);
            }
            if s.senders == 0 {
                return Err(RecvTimeoutError::Disconnected);
            }
            s.takers_asleep += 1;
            s = match deadline {
                None => self.queue.filled.wait(s).unwrap_or_else(|e| e.into_inner()),
                Some(deadline) => {
                    let Some(left) = deadline.checked_duration_since(Instant::now()) else {
                        s.takers_asleep -= 1;
                        return Err(RecvTimeoutError::Timeout);
                    };
                    self.queue
                        .filled
                        .wait_timeout(s, left)
                        .unwrap_or_else(|e| e.into_inner())
                        .0
                }
            };
            s.takers_asleep -= 1;
        }
    }
}

impl<T> Drop for Receiver<T> {
    fn drop(&mut self) {
        let mut s = self.queue.lock();
        s.receiver = false;
        if s.givers_asleep > 0 {
            self.queue.emptied.notify_all();
        }
    }
}

/// Takes items until the channel is empty and every sender gone.
impl<'a, T> IntoIterator for &'a Receiver<T> {
    type Item = T;
    type IntoIter = Box<dyn Iterator<Item = T> + 'a>;

    fn into_iter(self) -> Self::IntoIter {
        Box::new(std::iter::from_fn(move || self.recv().ok()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::thread;

    #[test]
    fn items_come_out_in_order_and_the_end_is_seen_once_drained() {
        let (tx, rx) = unbounded();
        for v in [3, 1, 2] {
            tx.send(v).unwrap();
        }
        drop(tx);
        assert_eq!(rx.try_recv(), Ok(3));
        assert_eq!((&rx).into_iter().collect::<Vec<_>>(), [1, 2]);
        assert_eq!(rx.recv(), Err(RecvError));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Disconnected));
    }

    #[test]
    fn a_sleeping_receiver_wakes_for_an_item_and_for_the_last_sender_leaving() {
        let (tx, rx) = unbounded::<u32>();
        let second = tx.clone();
        let taker = thread::spawn(move || (rx.recv(), rx.recv()));
        thread::sleep(Duration::from_millis(20));
        tx.send(7).unwrap();
        drop(tx);
        thread::sleep(Duration::from_millis(20));
        drop(second);
        assert_eq!(taker.join().unwrap(), (Ok(7), Err(RecvError)));
    }

    #[test]
    fn a_timeout_is_not_a_disconnection() {
        let (tx, rx) = unbounded::<u32>();
        let start = Instant::now();
        assert_eq!(
            rx.recv_timeout(Duration::from_millis(30)),
            Err(RecvTimeoutError::Timeout)
        );
        assert!(start.elapsed() >= Duration::from_millis(30));
        assert_eq!(rx.try_recv(), Err(TryRecvError::Empty));
        drop(tx);
        assert_eq!(
            rx.recv_timeout(Duration::from_secs(5)),
            Err(RecvTimeoutError::Disconnected)
        );
    }

    #[test]
    fn a_full_bounded_channel_holds_its_sender_until_there_is_room() {
        let (tx, rx) = bounded(2);
        tx.send(1).unwrap();
        tx.send(2).unwrap();
        let giver = thread::spawn(move || {
            tx.send(3).unwrap();
            tx
        });
        thread::sleep(Duration::from_millis(20));
        assert!(!giver.is_finished(), "the third item waits for room");
        assert_eq!(rx.recv(), Ok(1));
        let tx = giver.join().unwrap();
        assert_eq!(rx.try_iter().collect::<Vec<_>>(), [2, 3]);
        tx.send(4).unwrap();
        tx.send(5).unwrap();
        assert_eq!(tx.try_send(6), Err(TrySendError(6)), "full");
        drop(rx);
        assert_eq!(tx.send(7), Err(SendError(7)));
    }

    #[test]
    fn a_sender_waiting_for_room_fails_when_the_receiver_leaves() {
        let (tx, rx) = bounded(1);
        tx.send(1).unwrap();
        let giver = thread::spawn(move || tx.send(2));
        thread::sleep(Duration::from_millis(20));
        drop(rx);
        assert_eq!(giver.join().unwrap(), Err(SendError(2)));
    }

    #[test]
    fn many_senders_lose_nothing() {
        let (tx, rx) = bounded(4);
        let givers: Vec<_> = (0..4u64)
            .map(|g| {
                let tx = tx.clone();
                thread::spawn(move || (0..1000).for_each(|i| tx.send(g * 1000 + i).unwrap()))
            })
            .collect();
        drop(tx);
        let total: u64 = (&rx).into_iter().sum();
        givers.into_iter().for_each(|g| g.join().unwrap());
        assert_eq!(total, (0..4000u64).sum::<u64>());
    }
}
