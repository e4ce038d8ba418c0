//! Log setup shared by sumflow's command-line programs (`sumflow-server`,
//! `sumflow-coordinator`), whether they run as binaries or in-process from the Python
//! package's console scripts.
//!
//! It sits behind this crate's `cli` feature because every program already depends on the
//! wire crate and nothing below the programs does logging setup: libraries only emit
//! `tracing` events. Enabling the feature pulls in `tracing-subscriber` and `clap`; the
//! protocol code and the fuzz target do without both.
//!
//! ```no_run
//! use sumflow_wire::logging::{init_logging, LogFormat};
//!
//! init_logging(LogFormat::Json); // one JSON object per line on stderr, level from RUST_LOG
//! ```

use std::io::IsTerminal;

use tracing_subscriber::EnvFilter;

/// How log lines are written to stderr (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    #[default]
    Text,
    /// One JSON object per line.
    Json,
}

/// Sends `tracing` events to stderr in `format`, at the levels `RUST_LOG` asks for
/// (default `info`).
///
/// Returns `false`, and changes nothing, when this process already has a global subscriber:
/// a program run a second time in the same Python process keeps the first run's settings
/// instead of panicking.
pub fn init_logging(format: LogFormat) -> bool {
    init(format, "info")
}

/// The same for a worker process (the communication service inside a training script):
/// text lines at the levels `RUST_LOG` asks for, default `warn`, so the core's warnings
/// and errors reach the script's stderr without its routine lines.
pub fn init_worker_logging() -> bool {
    init(LogFormat::Text, "warn")
}

fn init(format: LogFormat, default_level: &str) -> bool {
    let filter =
        EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new(default_level));
    // Colours only for a terminal: a log file, a pipe to a launcher or a collector gets
    // plain text.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.try_init().is_ok(),
        LogFormat::Json => builder.json().try_init().is_ok(),
    }
}
