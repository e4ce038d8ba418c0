//! The staging thread: queues each copy to host memory, waits for it, and hands it on.
//!
//! Every copy waiting in line is queued on the GPU before the thread waits for the first,
//! so the copy engine runs them back to back; then the thread waits for them in order
//! and runs each one's continuation (which issues its sum) as soon as its copy is done.
//! The thread is started with the stager and ends once the stager is dropped and its
//! queue is empty; a continuation runs exactly once, with the copy's outcome.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread;

use crate::driver::DriverError;

/// A copy of `len` bytes from device address `src` into host memory at `dst`.
#[derive(Debug, Clone, Copy)]
pub struct HostCopy {
    pub dst: usize,
    pub src: u64,
    pub len: usize,
}

/// What queues and awaits copies: the CUDA driver ([`crate::DriverEngine`]), or a fake in
/// tests.
pub trait CopyEngine: Send + Sync + 'static {
    /// A copy's events.
    type Marker: Send + 'static;
    /// Queues the copy on the GPU, ordered after what its marker marked.
    fn start(&self, marker: &Self::Marker, copy: &HostCopy) -> Result<(), DriverError>;
    /// Blocks until the copy started with `marker` is complete.
    fn wait(&self, marker: &Self::Marker) -> Result<(), DriverError>;
    /// Returns the marker's events for reuse, once its copy was waited for (or never
    /// started).
    fn release(&self, marker: Self::Marker);
}

type Then = Box<dyn FnOnce(Result<(), DriverError>) + Send>;

struct Job<M> {
    marker: M,
    copy: HostCopy,
    then: Then,
}

/// A job whose copy was queued on the GPU (or failed to be).
type Started<M> = (Job<M>, Result<(), DriverError>);

struct Queue<M> {
    jobs: VecDeque<Job<M>>,
    closed: bool,
}

struct Shared<E: CopyEngine> {
    engine: E,
    queue: Mutex<Queue<E::Marker>>,
    wake: Condvar,
}

/// The staging thread and its queue.
pub struct Stager<E: CopyEngine> {
    shared: Arc<Shared<E>>,
}

impl<E: CopyEngine> std::fmt::Debug for Stager<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stager").finish_non_exhaustive()
    }
}

impl<E: CopyEngine> Stager<E> {
    /// Starts the staging thread ("sumflow-staging").
    pub fn new(engine: E) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            engine,
            queue: Mutex::new(Queue {
                jobs: VecDeque::new(),
                closed: false,
            }),
            wake: Condvar::new(),
        });
        let run = Arc::clone(&shared);
        thread::Builder::new()
            .name("sumflow-staging".into())
            .spawn(move || stage(&run))?;
        Ok(Self { shared })
    }

    /// The engine, to make markers with.
    pub fn engine(&self) -> &E {
        &self.shared.engine
    }

    /// Queues `copy` (ordered by `marker`); `then` runs on the staging thread once the
    /// copy is complete, or failed.
    ///
    /// # Safety
    /// `copy.dst..copy.dst+copy.len` must stay allocated, and nothing else may read or
    /// write it, until `then` runs.
    pub unsafe fn submit(
        &self,
        marker: E::Marker,
        copy: HostCopy,
        then: impl FnOnce(Result<(), DriverError>) + Send + 'static,
    ) {
        let mut queue = self.shared.queue.lock().expect("staging queue lock");
        queue.jobs.push_back(Job {
            marker,
            copy,
            then: Box::new(then),
        });
        drop(queue);
        self.shared.wake.notify_one();
    }
}

impl<E: CopyEngine> Drop for Stager<E> {
    fn drop(&mut self) {
        // The thread finishes what is queued, then ends; nothing waits for it here (a GPU
        // that hangs must not hang the caller's shutdown).
        self.shared.queue.lock().expect("staging queue lock").closed = true;
        self.shared.wake.notify_one();
    }
}

fn stage<E: CopyEngine>(shared: &Shared<E>) {
    let mut started: VecDeque<Started<E::Marker>> = VecDeque::new();
    loop {
        let fresh: Vec<Job<E::Marker>> = {
            let mut queue = shared.queue.lock().expect("staging queue lock");
            while queue.jobs.is_empty() && started.is_empty() {
                if queue.closed {
                    return;
                }
                queue = shared.wake.wait(queue).expect("staging queue lock");
            }
            queue.jobs.drain(..).collect()
        };
        for job in fresh {
            let outcome = shared.engine.start(&job.marker, &job.copy);
            started.push_back((job, outcome));
        }
        let (job, outcome) = started.pop_front().expect("a started copy");
        let outcome = outcome.and_then(|()| shared.engine.wait(&job.marker));
        shared.engine.release(job.marker);
        (job.then)(outcome);
    }
}

#[cfg(test)]
mod tests {
    use std::sync::mpsc;
    use std::time::Duration;

    use super::*;

    /// Logs what the stager asks of it; `hold` keeps `wait` blocked until released, and
    /// copies into `dst == 13` fail to start.
    #[derive(Default)]
    struct Fake {
        log: Mutex<Vec<String>>,
        hold: Mutex<bool>,
        held: Condvar,
    }

    impl CopyEngine for Fake {
        type Marker = u32;

        fn start(&self, m: &u32, copy: &HostCopy) -> Result<(), DriverError> {
            self.log.lock().unwrap().push(format!("start {m}"));
            if copy.dst == 13 {
                return Err(DriverError::Call {
                    call: "cuMemcpyDtoHAsync",
                    code: 700,
                    name: "CUDA_ERROR_ILLEGAL_ADDRESS".into(),
                    description: "an illegal memory access was encountered".into(),
                });
            }
            Ok(())
        }

        fn wait(&self, m: &u32) -> Result<(), DriverError> {
            let mut hold = self.hold.lock().unwrap();
            while *hold {
                hold = self.held.wait(hold).unwrap();
            }
            self.log.lock().unwrap().push(format!("wait {m}"));
            Ok(())
        }

        fn release(&self, m: u32) {
            self.log.lock().unwrap().push(format!("release {m}"));
        }
    }

    fn copy(dst: usize) -> HostCopy {
        HostCopy {
            dst,
            src: 0,
            len: 8,
        }
    }

    #[test]
    fn copies_queued_together_are_all_started_before_the_first_is_awaited() {
        let fake = Fake::default();
        *fake.hold.lock().unwrap() = true;
        let stager = Stager::new(fake).unwrap();
        let (done, finished) = mpsc::channel();
        // The first is awaited (held) while the next three queue up.
        for m in 0..4u32 {
            let done = done.clone();
            // SAFETY: the fake engine touches no memory.
            unsafe { stager.submit(m, copy(1), move |r| done.send((m, r.is_ok())).unwrap()) };
            if m == 0 {
                while stager.engine().log.lock().unwrap().is_empty() {
                    thread::yield_now();
                }
            }
        }
        thread::sleep(Duration::from_millis(50));
        *stager.engine().hold.lock().unwrap() = false;
        stager.engine().held.notify_all();
        let order: Vec<(u32, bool)> = (0..4)
            .map(|_| finished.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(order, [(0, true), (1, true), (2, true), (3, true)]);
        let log = stager.engine().log.lock().unwrap().clone();
        let starts_before_second_wait = log
            .iter()
            .take_while(|l| *l != "wait 1")
            .filter(|l| l.starts_with("start"))
            .count();
        assert_eq!(starts_before_second_wait, 4, "{log:?}");
        assert_eq!(log.iter().filter(|l| l.starts_with("release")).count(), 4);
    }

    #[test]
    fn a_copy_that_fails_to_start_is_reported_to_its_continuation_and_released() {
        let stager = Stager::new(Fake::default()).unwrap();
        let (done, finished) = mpsc::channel();
        for (m, dst) in [(0u32, 13usize), (1, 1)] {
            let done = done.clone();
            // SAFETY: the fake engine touches no memory.
            unsafe { stager.submit(m, copy(dst), move |r| done.send((m, r)).unwrap()) };
        }
        let (m, r) = finished.recv_timeout(Duration::from_secs(10)).unwrap();
        assert_eq!(m, 0);
        let e = r.unwrap_err().to_string();
        assert!(
            e.contains("cuMemcpyDtoHAsync") && e.contains("ILLEGAL_ADDRESS"),
            "{e}"
        );
        let (m, r) = finished.recv_timeout(Duration::from_secs(10)).unwrap();
        assert!(m == 1 && r.is_ok());
        let log = stager.engine().log.lock().unwrap().clone();
        assert!(!log.contains(&"wait 0".to_string()), "{log:?}");
        assert!(log.contains(&"release 0".to_string()), "{log:?}");
    }

    #[test]
    fn a_dropped_stager_still_finishes_what_was_queued() {
        let fake = Fake::default();
        *fake.hold.lock().unwrap() = true;
        let stager = Stager::new(fake).unwrap();
        let shared = Arc::clone(&stager.shared);
        let (done, finished) = mpsc::channel();
        for m in 0..3u32 {
            let done = done.clone();
            // SAFETY: the fake engine touches no memory.
            unsafe { stager.submit(m, copy(1), move |_| done.send(m).unwrap()) };
        }
        drop(stager);
        *shared.engine.hold.lock().unwrap() = false;
        shared.engine.held.notify_all();
        let got: Vec<u32> = (0..3)
            .map(|_| finished.recv_timeout(Duration::from_secs(10)).unwrap())
            .collect();
        assert_eq!(got, [0, 1, 2]);
        // The thread then ends and lets go of the engine.
        for _ in 0..1000 {
            if Arc::strong_count(&shared) == 1 {
                return;
            }
            thread::sleep(Duration::from_millis(5));
        }
        panic!("the staging thread did not end");
    }
}
