//! What staging a CUDA tensor costs the caller's thread (a gradient hook, on backward's
//! thread, where every microsecond lengthens backward on a fast GPU), piece by piece:
//!
//! - handing a copy to the staging thread ([`Stager::submit`]) while it sleeps, as it does
//!   between two gradient hooks that send, and while it is awake: the difference is the
//!   cost of waking it. Measured with an engine that copies nothing, so it runs anywhere.
//! - marking the caller's stream ([`DriverEngine::mark`]: an event recorded through the
//!   CUDA driver), where a GPU is present.
//!
//! Medians of many calls, each timed alone, after a pause (`cold`: caches and the CPU as a
//! hook finds them after a millisecond of kernel launches) and back to back.
//!
//! `cargo bench -p sumflow-cuda --bench stage [-- --quick]`

use std::sync::atomic::{AtomicBool, Ordering};
use std::thread;
use std::time::{Duration, Instant};

use sumflow_cuda::{CopyEngine, Driver, DriverEngine, DriverError, HostCopy, Stager};

/// Copies nothing: what is left of a submission is the queue and the wake-up.
struct Idle;

impl CopyEngine for Idle {
    type Marker = ();

    fn start(&self, _: &(), _: &HostCopy) -> Result<(), DriverError> {
        Ok(())
    }

    fn wait(&self, _: &()) -> Result<(), DriverError> {
        Ok(())
    }

    fn release(&self, _: ()) {}
}

const NOTHING: HostCopy = HostCopy {
    dst: 0,
    src: 0,
    len: 0,
};

fn main() {
    let quick = std::env::args().any(|a| a == "--quick");
    let calls = if quick { 200 } else { 2000 };
    let pause = Duration::from_millis(1);
    println!("sumflow-cuda stage: the caller's cost per call, median of {calls} calls");

    let stager = Stager::new(Idle).expect("a staging thread");
    let submit = |stager: &Stager<Idle>| {
        // SAFETY: the copy is of no bytes, and the engine reads nothing.
        unsafe { stager.submit((), NOTHING, |_| {}) };
    };
    let asleep = median(calls, Some(pause), || submit(&stager));
    // Awake: a second thread keeps the staging thread busy with submissions of its own.
    let stop = AtomicBool::new(false);
    let awake = thread::scope(|s| {
        s.spawn(|| {
            while !stop.load(Ordering::Relaxed) {
                submit(&stager);
            }
        });
        let t = median(calls, None, || submit(&stager));
        stop.store(true, Ordering::Relaxed);
        t
    });
    println!(
        "  submit, staging thread asleep (woken): {:>7.2} us",
        us(asleep)
    );
    println!(
        "  submit, staging thread awake:          {:>7.2} us",
        us(awake)
    );
    println!(
        "  so waking it costs the caller about     {:>7.2} us",
        us(asleep.saturating_sub(awake))
    );
    drop(stager);

    let engine = match Driver::load() {
        Ok(driver) => DriverEngine::new(driver),
        Err(e) => {
            println!("  mark: skipped, no CUDA driver here ({e})");
            return;
        }
    };
    let mut mark = || match engine.mark(0, 0) {
        Ok(marker) => engine.release(marker),
        Err(e) => panic!("mark on device 0 failed: {e}"),
    };
    mark(); // the device's context, side stream and first events
    let cold = median(calls, Some(pause), &mut mark);
    let warm = median(calls, None, &mut mark);
    println!(
        "  mark (an event on the caller's stream), after a pause: {:>7.2} us",
        us(cold)
    );
    println!(
        "  mark, back to back:                                   {:>7.2} us",
        us(warm)
    );
}

/// The median duration of `f` over `calls` calls, each after `pause` if given.
fn median(calls: usize, pause: Option<Duration>, mut f: impl FnMut()) -> Duration {
    let mut times: Vec<Duration> = (0..calls)
        .map(|_| {
            if let Some(p) = pause {
                thread::sleep(p);
            }
            let start = Instant::now();
            f();
            start.elapsed()
        })
        .collect();
    times.sort();
    times[times.len() / 2]
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
