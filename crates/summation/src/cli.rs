//! The `sumflow-server` command-line program as a library function, so that the binary
//! and the Python package's `sumflow-server` console script (which runs it in-process) are
//! one program.
//!
//! ```no_run
//! let code = sumflow_summation::cli::run(["sumflow-server", "--workers", "2"]);
//! std::process::exit(code.into());
//! ```

use std::ffi::OsString;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use clap::{Parser, ValueEnum};
use sumflow_client::coordinator::CoordinatorOptions;
use sumflow_wire::auth::TokenError;
use sumflow_wire::logging::{init_logging, LogFormat};
use sumflow_wire::program::{
    parse_args, positive_seconds, write_addr_file, NotPositiveSeconds, StopSignals,
};
use sumflow_wire::{timing, JobToken};
use thiserror::Error;
use tracing::{error, info, warn};

use crate::elastic::{Answer, ElasticError, Rendezvous};
use crate::{CoordinatorLink, Membership, ServerConfig, Settings, SimdLevel, SummationService};

/// Sums gradient partitions pushed by a job's workers and returns each round's sum.
///
/// In a job, point it at the coordinator (--coordinator); to lend this machine's cores to
/// a running elastic job, at its launcher's rendezvous (--elastic); for tests and
/// benchmarks it can run standalone with a fixed number of workers (--workers). The job
/// token comes from --token-file, SUMFLOW_JOB_TOKEN_FILE or SUMFLOW_JOB_TOKEN.
#[derive(Parser, Debug, Clone)]
#[command(name = "sumflow-server", version)]
struct Args {
    /// Address to listen on. Use 0.0.0.0:PORT on a cluster machine.
    #[arg(long, env = "SUMFLOW_SERVER_BIND", default_value = "127.0.0.1:0")]
    bind: SocketAddr,
    /// The job's coordinator (host:port); the server registers there and learns the workers.
    #[arg(long, env = "SUMFLOW_COORDINATOR", conflicts_with = "workers")]
    coordinator: Option<String>,
    /// Standalone mode: serve exactly this many workers, without a coordinator.
    #[arg(
        long,
        env = "SUMFLOW_NUM_WORKERS",
        required_unless_present_any = ["coordinator", "elastic"]
    )]
    workers: Option<u32>,
    /// Serve a running elastic job (sumflow-run --min-np ...) from its next change of
    /// membership on: the rendezvous sumflow-run prints at start (host:port). The first
    /// SIGTERM or SIGINT retires the server at the job's next commit; a second stops it.
    #[arg(long, value_name = "HOST:PORT", conflicts_with_all = ["coordinator", "workers"])]
    elastic: Option<String>,
    /// With --elastic: the name the job knows this server by [default: HOST-PID].
    #[arg(long, requires = "elastic")]
    name: Option<String>,
    /// Host name or address workers use to reach this server [default: the bind address,
    /// or this machine's host name when binding to all interfaces].
    #[arg(long, env = "SUMFLOW_ADVERTISE_HOST")]
    advertise: Option<String>,
    /// Machine identity shared with colocated workers [default: this machine's host name].
    #[arg(long, env = "SUMFLOW_HOST_ID")]
    host_id: Option<String>,
    /// Ask the coordinator for this server rank.
    #[arg(long, env = "SUMFLOW_SERVER_RANK")]
    rank: Option<u32>,
    /// Engines the keys are split over: how many threads can sum at once [default: half
    /// the CPU cores, 1 to 8].
    #[arg(long, env = "SUMFLOW_ENGINE_THREADS")]
    engine_threads: Option<usize>,
    /// Receive buffers per worker connection: pushes in flight before back-pressure.
    #[arg(long, env = "SUMFLOW_PUSH_BUFFERS", default_value_t = 4)]
    push_buffers: usize,
    /// Seconds a round may keep workers waiting before the server tells them which
    /// workers have not pushed it (and again after each further such stretch); 0: never.
    #[arg(long, env = "SUMFLOW_STALL_WARNING", default_value_t = sumflow_wire::timing::DEFAULT_STALL_WARNING.as_secs_f64(), value_name = "SECS")]
    stall_warning: f64,
    /// Largest frame body accepted, in bytes.
    #[arg(long, env = "SUMFLOW_MAX_FRAME_BYTES", default_value_t = sumflow_wire::DEFAULT_MAX_BODY)]
    max_frame_bytes: u32,
    /// Cap on bytes held for keys (accumulators and sums) [default: no cap].
    #[arg(long, env = "SUMFLOW_MAX_KEY_MEMORY")]
    max_key_memory: Option<u64>,
    /// SIMD kernels to use.
    #[arg(long, env = "SUMFLOW_SIMD", value_enum, default_value_t = Simd::Auto)]
    simd: Simd,
    /// Serve Prometheus metrics (GET /metrics) on this address, e.g. 0.0.0.0:9464
    /// (port 0 picks a free one, logged) [default: nowhere].
    #[arg(long, env = "SUMFLOW_METRICS_BIND", value_name = "ADDR")]
    metrics_bind: Option<SocketAddr>,
    /// Seconds between heartbeats to the coordinator.
    #[arg(
        long,
        env = "SUMFLOW_HEARTBEAT_INTERVAL",
        default_value_t = timing::DEFAULT_HEARTBEAT_INTERVAL.as_secs_f64()
    )]
    heartbeat_interval: f64,
    /// Seconds of coordinator silence after which it is considered lost.
    #[arg(
        long,
        env = "SUMFLOW_HEARTBEAT_TIMEOUT",
        default_value_t = timing::DEFAULT_HEARTBEAT_TIMEOUT.as_secs_f64()
    )]
    heartbeat_timeout: f64,
    /// Seconds to wait for the whole job to register with the coordinator.
    #[arg(
        long,
        env = "SUMFLOW_JOIN_TIMEOUT",
        default_value_t = timing::DEFAULT_JOIN_TIMEOUT.as_secs_f64()
    )]
    join_timeout: f64,
    /// File holding the job token (else SUMFLOW_JOB_TOKEN_FILE or SUMFLOW_JOB_TOKEN).
    #[arg(long)]
    token_file: Option<PathBuf>,
    /// Write the bound address (host:port) to this file once listening.
    #[arg(long)]
    addr_file: Option<PathBuf>,
    /// When the server stops, write the bytes it exchanged with workers, per key, to
    /// DIR/server-RANK.json (server-PORT.json without a coordinator).
    #[arg(long, env = "SUMFLOW_WIRE_STATS_DIR")]
    wire_stats_dir: Option<PathBuf>,
    /// Log format.
    #[arg(long, env = "SUMFLOW_LOG_FORMAT", value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
enum Simd {
    Auto,
    Avx512,
    Avx2,
    Portable,
}

/// Runs `sumflow-server` with `args` (the program name first, as in
/// [`std::env::args_os`]) until the job ends or SIGTERM/SIGINT stops it, and returns the
/// exit status: 0 after a clean stop (and for `--help` and `--version`), 1 when the server
/// fails, 2 for bad arguments or configuration. Messages go to stdout (help) and stderr.
///
/// It never exits the process. While it runs, SIGTERM and SIGINT stop it gracefully; its
/// handlers are removed when it returns, but the signals' default actions are not put back
/// (see `signal_hook::low_level::unregister`).
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
    if let Some(addr) = args.elastic.clone() {
        return run_elastic(&args, &addr);
    }
    let cfg = match config(&args) {
        Ok(cfg) => cfg,
        Err(msg) => {
            eprintln!("sumflow-server: {msg}");
            return 2;
        }
    };
    let handle = match SummationService::start(cfg) {
        Ok(h) => h,
        Err(e) => {
            error!("{e}");
            eprintln!("sumflow-server: {e}");
            return 1;
        }
    };
    if let Some(path) = &args.addr_file {
        if let Err(e) = write_addr_file(path, handle.local_addr()) {
            eprintln!("sumflow-server: cannot write {}: {e}", path.display());
            handle.shutdown();
            handle.wait();
            return 1;
        }
    }
    let signals = StopSignals::install();
    while !handle.is_finished() {
        if signals.requested() {
            tracing::info!("signal received; stopping");
            handle.shutdown();
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let name = match handle.rank() {
        Some(rank) => format!("server-{rank}.json"),
        None => format!("server-{}.json", handle.local_addr().port()),
    };
    let failure = handle.failure();
    let traffic = handle.wait();
    drop(signals);
    if let Some(dir) = &args.wire_stats_dir {
        let path = dir.join(name);
        let written =
            std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, traffic.to_json()));
        if let Err(e) = written {
            eprintln!(
                "sumflow-server: cannot write the wire statistics to {}: {e}",
                path.display()
            );
            return 1;
        }
    }
    if let Some(why) = failure {
        eprintln!("sumflow-server: {why}");
        return 1;
    }
    0
}

/// `--elastic`: serves one membership epoch after another (see [`crate::elastic`]).
fn run_elastic(args: &Args, addr: &str) -> u8 {
    let token = match JobToken::load(args.token_file.as_deref()) {
        Ok(t) => t,
        Err(e) => {
            eprintln!("sumflow-server: {e}");
            return 2;
        }
    };
    let name = args.name.clone().unwrap_or_else(|| {
        format!(
            "{}-{}",
            hostname().unwrap_or_else(|| "server".into()),
            std::process::id()
        )
    });
    let rendezvous = match Rendezvous::new(addr, &token, &name) {
        Ok(r) => r,
        Err(e) => {
            eprintln!("sumflow-server: {e}");
            return 2;
        }
    };
    let signals = StopSignals::install();
    let join_timeout = Duration::from_secs_f64(args.join_timeout.max(1.0));
    let mut after = -1;
    let mut retiring = false;
    loop {
        let place = match await_place(&rendezvous, after, &signals, &mut retiring, join_timeout) {
            Ok(Some(place)) => place,
            Ok(None) => return 0,
            Err(e) => {
                error!("{e}");
                eprintln!("sumflow-server: {e}");
                return 1;
            }
        };
        let (epoch, coordinator, host_id) = place;
        info!("serving epoch {epoch} of the elastic job at {addr} (coordinator {coordinator})");
        let mut epoch_args = args.clone();
        epoch_args.elastic = None;
        epoch_args.coordinator = Some(coordinator);
        epoch_args.host_id = Some(host_id);
        after = epoch;
        let handle = match config(&epoch_args)
            .map_err(|e| e.to_string())
            .and_then(|cfg| SummationService::start(cfg).map_err(|e| e.to_string()))
        {
            Ok(h) => h,
            Err(e) => {
                // The epoch goes on without this server, or fails and forms again.
                warn!("cannot serve epoch {epoch}: {e}");
                continue;
            }
        };
        while !handle.is_finished() {
            if signals.requested() {
                signals.clear();
                if retiring {
                    info!("second signal: stopping now");
                    handle.shutdown();
                } else {
                    retiring = true;
                    match rendezvous.retire() {
                        Ok(()) => info!("retiring: this server leaves at the job's next commit"),
                        Err(e) => {
                            warn!("cannot tell the launcher ({e}); stopping now");
                            handle.shutdown();
                        }
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        if let Some(why) = handle.failure() {
            info!("epoch {epoch} ended: {why}");
        }
        handle.wait();
    }
}

/// Asks for a place after epoch `after` until the launcher gives one (`Some`), says to
/// leave or a signal comes first (`None`), or it cannot be reached for `timeout`.
fn await_place(
    rendezvous: &Rendezvous,
    after: i64,
    signals: &StopSignals,
    retiring: &mut bool,
    timeout: Duration,
) -> Result<Option<(i64, String, String)>, ElasticError> {
    let start = Instant::now();
    let mut deadline = start + timeout;
    loop {
        if signals.requested() && !*retiring {
            // Not serving an epoch: nothing to hand over; the launcher forgets it.
            *retiring = true;
            let _ = rendezvous.retire();
        }
        match rendezvous.serve(after) {
            Ok(Answer::Serve {
                epoch,
                coordinator,
                host_id,
            }) => return Ok(Some((epoch, coordinator, host_id))),
            Ok(Answer::Leave(why)) => {
                info!("leaving the elastic job: {why}");
                return Ok(None);
            }
            Ok(Answer::Wait { patience }) => {
                if let Some(p) = patience.filter(|p| p.is_finite() && *p > 0.0) {
                    deadline = deadline.max(start + Duration::from_secs_f64(p));
                }
                if Instant::now() >= deadline {
                    return Err(ElasticError::Unreachable {
                        addr: rendezvous.addr().to_string(),
                        why: format!(
                            "no place after epoch {after} within {:.0} s",
                            start.elapsed().as_secs_f64()
                        ),
                    });
                }
            }
            Err(ElasticError::Unreachable { .. }) if after >= 0 && *retiring => return Ok(None),
            Err(e @ ElasticError::Unreachable { .. }) => {
                if after >= 0 && start.elapsed() > Duration::from_secs(3) {
                    // It served, and the launcher is gone: the job has ended.
                    info!("the elastic job's launcher is gone ({e}); the job has ended");
                    return Ok(None);
                }
                if Instant::now() >= deadline {
                    return Err(e);
                }
            }
            Err(e) => return Err(e),
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Why the flags make no server configuration; each names the flag to fix.
#[derive(Debug, Error)]
enum ConfigError {
    #[error(transparent)]
    Token(#[from] TokenError),
    #[error(transparent)]
    Seconds(#[from] NotPositiveSeconds),
    #[error("cannot read this machine's host name; pass {flag}")]
    NoHostName { flag: &'static str },
    #[error("--workers must be at least 1")]
    NoWorkers,
    #[error("pass --coordinator ADDR or --workers N")]
    NoMembership,
    #[error("--engine-threads and --push-buffers must be at least 1")]
    NoThreads,
}

fn config(args: &Args) -> Result<ServerConfig, ConfigError> {
    let token = JobToken::load(args.token_file.as_deref())?;
    let membership = match (&args.coordinator, args.workers) {
        (Some(addr), _) => {
            let host = hostname();
            let advertise = match &args.advertise {
                Some(h) => h.clone(),
                None if args.bind.ip().is_unspecified() => {
                    host.clone().ok_or(ConfigError::NoHostName {
                        flag: "--advertise",
                    })?
                }
                None => args.bind.ip().to_string(),
            };
            Membership::Coordinator(CoordinatorLink {
                addr: addr.clone(),
                advertise_host: advertise,
                host_id: args
                    .host_id
                    .clone()
                    .or(host)
                    .ok_or(ConfigError::NoHostName { flag: "--host-id" })?,
                requested_rank: args.rank,
                join_timeout: positive_seconds("--join-timeout", args.join_timeout)?,
                options: CoordinatorOptions {
                    heartbeat_interval: positive_seconds(
                        "--heartbeat-interval",
                        args.heartbeat_interval,
                    )?,
                    heartbeat_timeout: positive_seconds(
                        "--heartbeat-timeout",
                        args.heartbeat_timeout,
                    )?,
                    ..CoordinatorOptions::default()
                },
            })
        }
        (None, Some(0)) => return Err(ConfigError::NoWorkers),
        (None, Some(workers)) => Membership::Standalone { workers },
        (None, None) => return Err(ConfigError::NoMembership),
    };
    let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
    let engine_threads = args.engine_threads.unwrap_or((cores / 2).clamp(1, 8));
    if engine_threads == 0 || args.push_buffers == 0 {
        return Err(ConfigError::NoThreads);
    }
    let simd = match args.simd {
        Simd::Auto => None,
        Simd::Avx512 => Some(SimdLevel::Avx512),
        Simd::Avx2 => Some(SimdLevel::Avx2F16c),
        Simd::Portable => Some(SimdLevel::Portable),
    };
    Ok(ServerConfig {
        bind: args.bind,
        token,
        membership,
        engine_threads,
        settings: Settings {
            max_body: args.max_frame_bytes,
            push_buffers: args.push_buffers,
            handshake_timeout: Duration::from_secs(10),
            write_timeout: Duration::from_secs(120),
            // 0 turns the stall warning off; anything else must be a positive duration.
            stall_warning: if args.stall_warning == 0.0 {
                None
            } else {
                Some(positive_seconds("--stall-warning", args.stall_warning)?)
            },
        },
        max_key_memory: args.max_key_memory,
        simd,
        max_connections: 4096,
        metrics_bind: args.metrics_bind,
    })
}

fn hostname() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}
