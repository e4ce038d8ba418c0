//! The `sumflow-coordinator` command-line program as a library function, so that the
//! binary and the Python package's `sumflow-coordinator` console script (which runs it
//! in-process) are one program.
//!
//! Exit status: 0 when the job ended cleanly, 1 when a node failed or not every node
//! joined, 2 on bad configuration.
//!
//! ```no_run
//! let code = sumflow_coordinator::cli::run(["sumflow-coordinator", "--workers", "4"]);
//! std::process::exit(code.into());
//! ```

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use sumflow_wire::auth::TokenError;
use sumflow_wire::logging::{init_logging, LogFormat};
use sumflow_wire::program::{
    parse_args, positive_seconds, write_addr_file, NotPositiveSeconds, StopSignals,
};
use sumflow_wire::JobToken;
use thiserror::Error;
use tracing::{error, info, warn};

use crate::config::{
    random_job_id, DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_JOIN_TIMEOUT, DEFAULT_MAX_BODY,
};
use crate::{CoordinatorConfig, CoordinatorError, CoordinatorService};

/// Rendezvous for a sumflow job: waits for every worker and summation server to join,
/// assigns ranks, hands out the cluster map, runs barriers and reports failed nodes.
///
/// The job token comes from --token-file, else SUMFLOW_JOB_TOKEN_FILE, else
/// SUMFLOW_JOB_TOKEN. Log verbosity follows RUST_LOG (default "info").
#[derive(Debug, Parser)]
#[command(name = "sumflow-coordinator", version)]
struct Args {
    /// Address to listen on; port 0 picks a free port (see --addr-file).
    #[arg(
        long,
        env = "SUMFLOW_COORDINATOR_BIND",
        default_value = "127.0.0.1:29400"
    )]
    bind: SocketAddr,

    /// Number of workers (training processes) the job waits for; at least 1.
    #[arg(long, env = "SUMFLOW_NUM_WORKERS")]
    workers: u32,

    /// Number of summation servers the job waits for.
    #[arg(long, env = "SUMFLOW_NUM_SERVERS", default_value_t = 0)]
    servers: u32,

    /// Seconds of silence after which a node is declared failed.
    #[arg(
        long,
        env = "SUMFLOW_HEARTBEAT_TIMEOUT",
        default_value_t = DEFAULT_HEARTBEAT_TIMEOUT.as_secs_f64(),
        value_name = "SECS"
    )]
    heartbeat_timeout: f64,

    /// Seconds every expected node has to join before the job is abandoned.
    #[arg(
        long,
        env = "SUMFLOW_JOIN_TIMEOUT",
        default_value_t = DEFAULT_JOIN_TIMEOUT.as_secs_f64(),
        value_name = "SECS"
    )]
    join_timeout: f64,

    /// Name of the job in the cluster map and in messages [default: random hex].
    #[arg(long, env = "SUMFLOW_JOB_ID")]
    job_id: Option<String>,

    /// File holding the job token (a trailing newline is ignored).
    #[arg(long, value_name = "PATH")]
    token_file: Option<PathBuf>,

    /// Largest frame body accepted from a node, in bytes.
    #[arg(long, env = "SUMFLOW_MAX_FRAME_BYTES", default_value_t = DEFAULT_MAX_BODY, value_name = "BYTES")]
    max_frame_bytes: u32,

    /// Write the bound address here once listening (for launchers that use port 0).
    #[arg(long, value_name = "PATH")]
    addr_file: Option<PathBuf>,

    /// Append a JSON line here for every node declared failed or seen stalled (for a
    /// supervisor such as sumflow-run, which blames the first).
    #[arg(long, value_name = "PATH")]
    incidents_file: Option<PathBuf>,

    /// Serve Prometheus metrics (GET /metrics) on this address, e.g. 0.0.0.0:9464
    /// (port 0 picks a free one, logged) [default: nowhere].
    #[arg(long, env = "SUMFLOW_METRICS_BIND", value_name = "ADDR")]
    metrics_bind: Option<SocketAddr>,

    /// Log line format.
    #[arg(long, env = "SUMFLOW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

/// Runs `sumflow-coordinator` with `args` (the program name first, as in
/// [`std::env::args_os`]) until the job ends or SIGTERM/SIGINT stops it, and returns the
/// exit status (see the module documentation; `--help` and `--version` return 0).
///
/// It never exits the process. While it runs, SIGTERM and SIGINT tell every node to shut
/// down; its handlers are removed when it returns, but the signals' default actions are not
/// put back (see `signal_hook::low_level::unregister`).
pub fn run<I, T>(args: I) -> u8
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let args: Args = match parse_args(args) {
        Ok(args) => args,
        Err(code) => return code,
    };
    init_logging(args.log_format);
    let cfg = match config(&args) {
        Ok(cfg) => cfg,
        Err(e) => return bad_config(&e.to_string()),
    };
    let handle = match CoordinatorService::start(cfg) {
        Ok(h) => h,
        Err(e) => return bad_config(&e.to_string()),
    };
    if let Some(path) = &args.addr_file {
        if let Err(e) = write_addr_file(path, handle.local_addr()) {
            handle.shutdown();
            let _ = handle.wait();
            return bad_config(&format!("cannot write --addr-file {}: {e}", path.display()));
        }
    }
    let signals = StopSignals::install();
    for (sig, e) in &signals.unhandled {
        warn!("cannot handle signal {sig}: {e}; stop the coordinator with SIGKILL");
    }
    let mut stopping = false;
    while !handle.is_finished() {
        if !stopping && signals.requested() {
            info!("signal received: telling every node to shut down");
            handle.shutdown();
            stopping = true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let outcome = handle.wait();
    drop(signals);
    match outcome {
        Ok(outcome) if outcome.failed.is_empty() => {
            info!("job finished: {}", outcome.stop_reason);
            0
        }
        Ok(outcome) => {
            for (node, name, reason) in &outcome.failed {
                error!("{node} '{name}' failed: {reason}");
            }
            error!(
                "job ended with {} failed node(s): {}",
                outcome.failed.len(),
                outcome.stop_reason
            );
            1
        }
        // The coordinator has logged why the job never started.
        Err(CoordinatorError::JoinTimeout { .. }) => 1,
        Err(e) => {
            error!("{e}");
            1
        }
    }
}

/// Why the flags make no coordinator configuration; each names the flag to fix.
#[derive(Debug, Error)]
enum ConfigError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Seconds(#[from] NotPositiveSeconds),
    #[error(transparent)]
    Invalid(#[from] CoordinatorError),
}

fn config(args: &Args) -> Result<CoordinatorConfig, ConfigError> {
    let token = JobToken::load(args.token_file.as_deref())?;
    let mut cfg = CoordinatorConfig::new(args.bind, args.workers, args.servers, token);
    cfg.heartbeat_timeout = positive_seconds("--heartbeat-timeout", args.heartbeat_timeout)?;
    cfg.join_timeout = positive_seconds("--join-timeout", args.join_timeout)?;
    cfg.max_body = args.max_frame_bytes;
    cfg.job_id = args.job_id.clone().unwrap_or_else(random_job_id);
    cfg.incidents_file = args.incidents_file.clone();
    cfg.metrics_bind = args.metrics_bind;
    cfg.validate()?;
    Ok(cfg)
}

fn bad_config(msg: &str) -> u8 {
    eprintln!("sumflow-coordinator: error: {msg}");
    2
}
