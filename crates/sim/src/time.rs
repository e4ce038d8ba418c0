//! Simulated time: picoseconds in a `u64` (213 days at most), fine enough that rounding one
//! segment's transmission time never adds up to anything measurable, and exact to compare.

use std::time::{Duration, Instant};

/// Picoseconds since the simulation began.
pub type Time = u64;

pub const PS_PER_S: f64 = 1e12;

pub fn from_secs(s: f64) -> Time {
    (s * PS_PER_S).round() as Time
}

pub fn secs(t: Time) -> f64 {
    t as f64 / PS_PER_S
}

/// Time to move `bytes` at `rate` bytes per second.
pub fn transfer(bytes: u64, rate: f64) -> Time {
    from_secs(bytes as f64 / rate)
}

/// The runtime's scheduler reads `Instant`s: simulated time is an offset from one real
/// instant taken at the start, at nanosecond resolution (the scheduler's own).
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    base: Instant,
}

impl Clock {
    pub fn new() -> Clock {
        Clock {
            base: Instant::now(),
        }
    }

    pub fn instant(&self, t: Time) -> Instant {
        self.base + Duration::from_nanos(t / 1000)
    }

    /// The simulated time of an instant the scheduler handed back (a deadline computed
    /// from [`Clock::instant`]s, so a whole number of nanoseconds: exact).
    pub fn time(&self, at: Instant) -> Time {
        (at.saturating_duration_since(self.base).as_nanos() as Time) * 1000
    }
}

impl Default for Clock {
    fn default() -> Self {
        Clock::new()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn conversions_round_trip_at_the_scheduler_resolution() {
        assert_eq!(from_secs(1.5), 1_500_000_000_000);
        assert_eq!(secs(2_000_000_000_000), 2.0);
        // 1 MB at 1 GB/s: 1 ms.
        assert_eq!(transfer(1_000_000, 1e9), 1_000_000_000);
        let c = Clock::new();
        let t = 123_456_000;
        assert_eq!(c.time(c.instant(t)), t);
        assert_eq!(
            c.time(c.instant(t + 999)),
            t,
            "below a nanosecond is dropped"
        );
    }
}
