//! What a summation server tells an operator's scraper (`--metrics-bind`): bytes moved,
//! rounds summed, rounds stalled, workers, connections and keys, rendered in Prometheus'
//! text format by `sumflow_wire::metrics`.

use std::sync::atomic::{AtomicU64, Ordering};

use sumflow_wire::metrics::Exposition;

use crate::shared::Shared;

/// One engine's counters, written by the engine and read by scrapes.
#[derive(Debug, Default)]
pub struct EngineCounters {
    /// Rounds completed (every worker of the key pushed, the sum formed).
    pub rounds: AtomicU64,
    /// Keys whose current round has kept pulls waiting past the stall warning, at the last
    /// check.
    pub stalled: AtomicU64,
}

/// What a scrape reads once the server serves.
#[derive(Debug)]
pub struct Served {
    pub shared: std::sync::Arc<Shared>,
    pub engines: Vec<std::sync::Arc<EngineCounters>>,
}

/// The exposition of a scrape before the server serves (while it joins the job).
pub fn not_serving() -> String {
    let mut e = Exposition::default();
    e.gauge(
        "sumflow_server_up",
        "1 once the server serves its workers.",
        0.0,
    );
    e.into_text()
}

/// The exposition of one scrape.
pub fn render(shared: &Shared, engines: &[std::sync::Arc<EngineCounters>]) -> String {
    let traffic = shared.traffic.snapshot().total();
    let (keys, peak, freed) = {
        let dir = shared.directory.read().expect("directory lock");
        (dir.len(), dir.peak(), dir.freed())
    };
    let workers = shared.worker_states();
    let sum = |f: fn(&EngineCounters) -> &AtomicU64| -> u64 {
        engines.iter().map(|e| f(e).load(Ordering::Relaxed)).sum()
    };
    let mut e = Exposition::default();
    e.gauge(
        "sumflow_server_up",
        "1 once the server serves its workers.",
        if shared.is_stopping() { 0.0 } else { 1.0 },
    )
    .counter(
        "sumflow_server_received_bytes_total",
        "Bytes read from workers after their handshake (frames whole).",
        traffic.received,
    )
    .counter(
        "sumflow_server_sent_bytes_total",
        "Bytes written to workers (sums, acknowledgements, notices).",
        traffic.sent,
    )
    .counter(
        "sumflow_server_rounds_total",
        "Rounds completed: every worker of a key pushed and its sum was formed.",
        sum(|c| &c.rounds),
    )
    .gauge(
        "sumflow_server_stalled_keys",
        "Keys whose round has kept workers waiting past the stall warning.",
        sum(|c| &c.stalled) as f64,
    )
    .family(
        "sumflow_server_workers",
        "The job's workers by state: connected, not yet connected, or gone.",
        "gauge",
        &[
            (&[("state", "connected")], workers.connected as f64),
            (&[("state", "waiting")], workers.waiting as f64),
            (&[("state", "gone")], workers.gone as f64),
        ],
    )
    .gauge(
        "sumflow_server_connections",
        "Open worker connections (a worker may hold several: its lanes).",
        workers.connections as f64,
    )
    .gauge(
        "sumflow_server_handshakes",
        "Connections in their handshake (not yet authenticated).",
        shared.handshakes.inside() as f64,
    )
    .gauge("sumflow_server_keys", "Keys live now.", keys as f64)
    .gauge(
        "sumflow_server_keys_peak",
        "The most keys live at once.",
        peak as f64,
    )
    .counter(
        "sumflow_server_keys_freed_total",
        "Keys freed because every worker of theirs retired them.",
        freed,
    );
    e.into_text()
}
