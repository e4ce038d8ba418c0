//! sumflow's coordinator: the rendezvous point of a job (like ps-lite's scheduler).
//!
//! Workers and summation servers connect, prove they hold the job token and register.
//! Once every expected node has joined, the coordinator assigns ranks and sends each node
//! the same [`ClusterMap`](sumflow_wire::ClusterMap). Afterwards it runs global barriers,
//! answers heartbeats, tells every node when another one fails, and ends the job when all
//! workers have left.
//!
//! The decisions live in a pure state machine ([`membership::Membership`]) fed with events
//! and a clock; [`CoordinatorService`] only moves bytes and time into it.
//!
//! ```no_run
//! use std::time::Duration;
//! use sumflow_coordinator::{CoordinatorConfig, CoordinatorService};
//! use sumflow_wire::JobToken;
//!
//! let token = JobToken::load(None)?;
//! let mut cfg = CoordinatorConfig::new("127.0.0.1:29400".parse()?, 4, 2, token);
//! cfg.heartbeat_timeout = Duration::from_secs(5);
//! let handle = CoordinatorService::start(cfg)?;
//! let outcome = handle.wait()?;
//! println!("{} node(s) failed", outcome.failed.len());
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

pub mod cli;
pub mod config;
pub mod incidents;
pub mod liveness;
pub mod membership;
pub mod metrics;
pub mod ranks;
mod service;

use std::net::SocketAddr;
use std::path::PathBuf;

use sumflow_wire::NodeId;
use thiserror::Error;

pub use config::CoordinatorConfig;
pub use service::{CoordinatorHandle, CoordinatorService};

/// How a job ended, as far as the coordinator saw it.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct JobOutcome {
    /// Nodes declared failed, in the order it happened: id, name and the reason.
    pub failed: Vec<(NodeId, String, String)>,
    /// Why the coordinator stopped, e.g. "all workers finished".
    pub stop_reason: String,
}

/// Why the coordinator could not start or could not bring the job together.
#[derive(Debug, Error)]
pub enum CoordinatorError {
    /// A setting is unusable; the message names it.
    #[error("invalid coordinator configuration: {0}")]
    InvalidConfig(String),
    /// The listening socket could not be opened.
    #[error("cannot listen on {addr}: {source} (is another coordinator using that port? use port 0 to pick a free one)")]
    Bind {
        /// The address asked for.
        addr: SocketAddr,
        /// Why the operating system refused it.
        #[source]
        source: std::io::Error,
    },
    /// Not every expected node joined in time; the job never started.
    #[error(
        "job {job_id}: only {workers_joined} of {workers_expected} workers and {servers_joined} of \
         {servers_expected} servers joined within {secs:.1}s; missing {missing}; joined: {joined}. \
         Check that every node was started with this coordinator's address and the job's token"
    )]
    JoinTimeout {
        /// The job's id.
        job_id: String,
        /// The join timeout that expired, in seconds.
        secs: f64,
        /// Workers that joined.
        workers_joined: u32,
        /// Workers the job waited for.
        workers_expected: u32,
        /// Servers that joined.
        servers_joined: u32,
        /// Servers the job waited for.
        servers_expected: u32,
        /// How many of each role are missing, e.g. "1 worker and 2 servers".
        missing: String,
        /// The nodes that did join, by role and name.
        joined: String,
    },
    /// The incidents file could not be opened.
    #[error("cannot open the incidents file {}: {source}", path.display())]
    IncidentsFile {
        /// The path asked for.
        path: PathBuf,
        /// Why it could not be opened.
        #[source]
        source: std::io::Error,
    },
    /// The metrics endpoint could not listen.
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        /// The address asked for.
        addr: SocketAddr,
        /// Why the operating system refused it.
        #[source]
        source: std::io::Error,
    },
    /// A thread could not be started (the process is out of resources).
    #[error("cannot start a coordinator thread: {0}")]
    Spawn(#[source] std::io::Error),
    /// A bug: the coordinator's core stopped unexpectedly.
    #[error("internal coordinator error: {0}")]
    Internal(String),
}

#[cfg(test)]
mod tests;
