//! The bandwidth monitor: how fast this worker's pushes get through, measured from the
//! transfers themselves (Prophet needs B; its prototype hard-coded 1 Gbit/s).
//!
//! A transfer counts as done when the server acknowledges the push: Prophet's budget is
//! about what a push released now delays, and sums flow the other way on a duplex link.
//! (Counting until the sum returns would measure the slowest worker instead: a sum waits
//! for everyone's push, and a worker holding partitions back would see the others' pushes
//! as a slow network, shrink its budgets, hold more, and spiral down; seen on loopback.)
//! The monitor divides acknowledged bytes by busy time (time with at least one push
//! unacknowledged), never by wall time: idle gaps between iterations would otherwise read
//! as a slow network. Samples of at least [`MIN_SAMPLE`] busy time are smoothed
//! exponentially so one slow transfer does not swing the budget.

use std::time::{Duration, Instant};

/// Busy time one sample spans: long enough to cover several partitions' round trips.
pub const MIN_SAMPLE: Duration = Duration::from_millis(20);

/// Weight of a new sample in the moving average.
const SMOOTHING: f64 = 0.3;

#[derive(Debug)]
pub struct BandwidthMonitor {
    in_flight: u64,
    busy_since: Option<Instant>,
    sample_bytes: u64,
    sample_busy: Duration,
    /// Bytes per second, once measured.
    estimate: Option<f64>,
}

impl Default for BandwidthMonitor {
    fn default() -> Self {
        BandwidthMonitor {
            in_flight: 0,
            busy_since: None,
            sample_bytes: 0,
            sample_busy: Duration::ZERO,
            estimate: None,
        }
    }
}

impl BandwidthMonitor {
    /// A partition went out.
    pub fn started(&mut self, now: Instant) {
        if self.in_flight == 0 {
            self.busy_since = Some(now);
        }
        self.in_flight += 1;
    }

    /// A partition of `bytes` was acknowledged.
    pub fn finished(&mut self, bytes: u64, now: Instant) {
        if self.in_flight == 0 {
            return;
        }
        self.in_flight -= 1;
        if let Some(since) = self.busy_since {
            self.sample_busy += now.saturating_duration_since(since);
        }
        self.busy_since = (self.in_flight > 0).then_some(now);
        self.sample_bytes += bytes;
        if self.sample_busy >= MIN_SAMPLE {
            let rate = self.sample_bytes as f64 / self.sample_busy.as_secs_f64();
            self.estimate = Some(match self.estimate {
                None => rate,
                Some(old) => old + SMOOTHING * (rate - old),
            });
            self.sample_bytes = 0;
            self.sample_busy = Duration::ZERO;
        }
    }

    /// A partition failed: it leaves the flight without counting as throughput.
    pub fn abandoned(&mut self) {
        self.in_flight = self.in_flight.saturating_sub(1);
        if self.in_flight == 0 {
            self.busy_since = None;
        }
    }

    /// Completed bytes per second of busy network, once a sample has been taken.
    pub fn bytes_per_sec(&self) -> Option<f64> {
        self.estimate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn rate_counts_busy_time_only() {
        let t = Instant::now();
        let mut m = BandwidthMonitor::default();
        assert_eq!(m.bytes_per_sec(), None);
        // 1 MB over 10 ms busy, then a 1 s idle gap, then 1 MB over 10 ms more.
        m.started(t);
        m.finished(1_000_000, t + 10 * MS);
        assert_eq!(m.bytes_per_sec(), None, "10 ms is below one sample");
        m.started(t + 1010 * MS);
        m.finished(1_000_000, t + 1020 * MS);
        let rate = m.bytes_per_sec().unwrap();
        assert!((rate - 1e8).abs() < 1.0, "{rate}");
    }

    #[test]
    fn overlapping_transfers_share_busy_time() {
        let t = Instant::now();
        let mut m = BandwidthMonitor::default();
        for _ in 0..4 {
            m.started(t);
        }
        for i in 1..=4u32 {
            m.finished(500_000, t + 5 * i * MS);
        }
        // 2 MB in 20 ms busy.
        assert!((m.bytes_per_sec().unwrap() - 1e8).abs() < 1.0);
    }

    #[test]
    fn new_samples_are_smoothed() {
        let t = Instant::now();
        let mut m = BandwidthMonitor::default();
        m.started(t);
        m.finished(2_000_000, t + 20 * MS); // 1e8
        m.started(t + 100 * MS);
        m.finished(4_000_000, t + 120 * MS); // 2e8
        let r = m.bytes_per_sec().unwrap();
        assert!(r > 1e8 && r < 2e8, "{r}");
    }

    #[test]
    fn abandoned_transfers_do_not_count() {
        let t = Instant::now();
        let mut m = BandwidthMonitor::default();
        m.started(t);
        m.abandoned();
        assert_eq!(m.bytes_per_sec(), None);
        m.finished(1, t + 60 * MS); // nothing in flight: ignored
        assert_eq!(m.bytes_per_sec(), None);
    }
}
