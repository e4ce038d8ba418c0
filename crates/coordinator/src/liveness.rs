//! Failure detection: a node is dead once it has been silent for longer than the timeout.

use std::time::{Duration, Instant};

/// Why a node last heard from at `last_seen` counts as failed at `now`, or `None` while
/// its silence is within `timeout` (silence exactly equal to the timeout is still alive).
/// `started` is the coordinator's start, so the reason can place the last sign of life.
pub fn silence_verdict(
    last_seen: Instant,
    now: Instant,
    timeout: Duration,
    started: Instant,
) -> Option<String> {
    let silent = now.saturating_duration_since(last_seen);
    (silent > timeout).then(|| {
        format!(
            "no heartbeat for {} (timeout {}), last seen {} after the coordinator started",
            secs(silent),
            secs(timeout),
            secs(last_seen.saturating_duration_since(started))
        )
    })
}

/// A duration as seconds with enough digits to tell sub-second timeouts apart.
pub fn secs(d: Duration) -> String {
    format!("{:.2}s", d.as_secs_f64())
}
