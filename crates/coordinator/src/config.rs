//! What a coordinator needs to know about its job, and the checks that run before it starts.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use sumflow_wire::{JobToken, MAX_STRING};

use crate::CoordinatorError;

pub use sumflow_wire::timing::{DEFAULT_HEARTBEAT_TIMEOUT, DEFAULT_JOIN_TIMEOUT};
/// Default cap on an incoming frame body: coordinator traffic is small control frames.
pub const DEFAULT_MAX_BODY: u32 = 1 << 20;
/// Smallest accepted cap: a registration with three maximal strings must fit.
pub const MIN_MAX_BODY: u32 = 16 << 10;

/// Settings of one coordinator (one per job).
#[derive(Clone, Debug)]
pub struct CoordinatorConfig {
    /// Address to listen on; port 0 picks a free port (see `CoordinatorHandle::local_addr`).
    pub bind: SocketAddr,
    /// Workers the job waits for before handing out the cluster map; at least 1.
    pub num_workers: u32,
    /// Summation servers the job waits for; may be 0.
    pub num_servers: u32,
    /// The job's shared secret; nodes without it are refused.
    pub token: JobToken,
    /// A node silent for longer than this is declared failed.
    pub heartbeat_timeout: Duration,
    /// Every expected node must have joined within this time of the start.
    pub join_timeout: Duration,
    /// Largest frame body accepted from a node.
    pub max_body: u32,
    /// The job's name in the cluster map and in messages.
    pub job_id: String,
    /// Where to append a line for every node declared failed or seen stalled
    /// ([`crate::incidents`]); `None`: nowhere.
    pub incidents_file: Option<PathBuf>,
    /// Where to serve metrics (`GET /metrics`, Prometheus' text format); `None`: nowhere.
    pub metrics_bind: Option<SocketAddr>,
}

impl CoordinatorConfig {
    /// A configuration with default timeouts, frame cap and a random job id.
    pub fn new(
        bind: SocketAddr,
        num_workers: u32,
        num_servers: u32,
        token: JobToken,
    ) -> CoordinatorConfig {
        CoordinatorConfig {
            bind,
            num_workers,
            num_servers,
            token,
            heartbeat_timeout: DEFAULT_HEARTBEAT_TIMEOUT,
            join_timeout: DEFAULT_JOIN_TIMEOUT,
            max_body: DEFAULT_MAX_BODY,
            job_id: random_job_id(),
            incidents_file: None,
            metrics_bind: None,
        }
    }

    /// Checks the settings, naming the first one that is unusable and what to use instead.
    pub fn validate(&self) -> Result<(), CoordinatorError> {
        let bad = |msg: String| Err(CoordinatorError::InvalidConfig(msg));
        if self.num_workers == 0 {
            return bad("the job needs at least 1 worker (got --workers 0)".into());
        }
        if self.heartbeat_timeout.is_zero() {
            return bad("the heartbeat timeout must be positive".into());
        }
        if self.join_timeout.is_zero() {
            return bad("the join timeout must be positive".into());
        }
        if self.max_body < MIN_MAX_BODY {
            return bad(format!(
                "the frame size cap of {} bytes is below the {MIN_MAX_BODY} bytes a registration may need",
                self.max_body
            ));
        }
        if self.job_id.is_empty() || self.job_id.len() > MAX_STRING {
            return bad(format!(
                "the job id must be 1 to {MAX_STRING} bytes long (got {})",
                self.job_id.len()
            ));
        }
        Ok(())
    }
}

/// 64 random bits in hex; falls back to the clock and pid where the OS has no randomness.
pub fn random_job_id() -> String {
    let bytes = sumflow_wire::auth::random_bytes::<8>().unwrap_or_else(|_| {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos() as u64)
            .unwrap_or_default();
        (nanos ^ u64::from(std::process::id()).rotate_left(32)).to_le_bytes()
    });
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
