//! Starting, running and stopping a summation server.

use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::Duration;

use crossbeam_channel::RecvTimeoutError;
use sumflow_client::coordinator::{CoordinatorClient, CoordinatorOptions};
use sumflow_client::link::{connect_local, listen_local, local_name, Link};
use sumflow_client::ClientError;
use sumflow_wire::cluster::host_port;
use sumflow_wire::metrics::{MetricsEndpoint, Render};
use sumflow_wire::{JobToken, Registration, Role};
use thiserror::Error;
use tracing::{error, info, warn};

use crate::engine::Engine;
use crate::messages::StallReport;
use crate::metrics::{EngineCounters, Served};
use crate::shared::{Settings, Shared};
use sumflow_reduce::{Reducer, SimdLevel};

/// How often a server with a stall warning looks for rounds that wait too long.
const STALL_CHECK: Duration = Duration::from_millis(250);

#[derive(Debug, Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}: {source}")]
    Bind {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("cannot join the job: {0}")]
    Join(#[source] ClientError),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("cannot start a thread: {0}")]
    Thread(#[source] std::io::Error),
    #[error("cannot serve metrics on {addr}: {source}")]
    Metrics {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
}

/// How the server learns who the workers are.
#[derive(Clone, Debug)]
pub enum Membership {
    /// A fixed number of workers and no coordinator (tests and benchmarks).
    Standalone { workers: u32 },
    /// Register with the job's coordinator and take the worker set from its cluster map.
    Coordinator(CoordinatorLink),
}

#[derive(Clone, Debug)]
pub struct CoordinatorLink {
    pub addr: String,
    /// Address workers should use to reach this server.
    pub advertise_host: String,
    /// Machine identity, for colocation.
    pub host_id: String,
    pub requested_rank: Option<u32>,
    pub join_timeout: Duration,
    pub options: CoordinatorOptions,
}

#[derive(Clone, Debug)]
pub struct ServerConfig {
    pub bind: SocketAddr,
    pub token: JobToken,
    pub membership: Membership,
    pub engine_threads: usize,
    pub settings: Settings,
    /// Cap on bytes held for keys (accumulators and sums); `None` for no cap.
    pub max_key_memory: Option<u64>,
    /// Forces a SIMD level instead of the best one detected.
    pub simd: Option<SimdLevel>,
    /// Connections served at once; more are closed on arrival.
    pub max_connections: usize,
    /// Where to serve metrics (`GET /metrics`, Prometheus' text format); `None`: nowhere.
    pub metrics_bind: Option<SocketAddr>,
}

impl ServerConfig {
    /// A standalone server on loopback with defaults suited to tests.
    pub fn standalone(workers: u32, token: JobToken) -> Self {
        ServerConfig {
            bind: SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 0),
            token,
            membership: Membership::Standalone { workers },
            engine_threads: 1,
            settings: Settings {
                max_body: sumflow_wire::DEFAULT_MAX_BODY,
                push_buffers: 4,
                handshake_timeout: Duration::from_secs(10),
                stall_warning: Some(sumflow_wire::timing::DEFAULT_STALL_WARNING),
                write_timeout: Duration::from_secs(120),
            },
            max_key_memory: None,
            simd: None,
            max_connections: 1024,
            metrics_bind: None,
        }
    }
}

#[derive(Debug)]
pub struct SummationService;

impl SummationService {
    /// Binds, joins the job (when a coordinator is configured) and starts serving.
    pub fn start(cfg: ServerConfig) -> Result<ServerHandle, ServerError> {
        if cfg.engine_threads == 0 || cfg.settings.push_buffers == 0 {
            return Err(ServerError::Config(
                "engine threads and push buffers must be at least 1".into(),
            ));
        }
        let reducer = match cfg.simd {
            Some(level) => {
                Reducer::with_level(level).map_err(|e| ServerError::Config(e.to_string()))?
            }
            None => Reducer::detect(),
        };
        let listener = TcpListener::bind(cfg.bind).map_err(|source| ServerError::Bind {
            addr: cfg.bind,
            source,
        })?;
        let addr = listener.local_addr().map_err(|source| ServerError::Bind {
            addr: cfg.bind,
            source,
        })?;
        // Workers dial the address the cluster map gives (advertised host, bound port);
        // the machine-local socket is named after it, and listens before the server joins.
        let advertised = match &cfg.membership {
            Membership::Coordinator(link) => host_port(&link.advertise_host, addr.port()),
            Membership::Standalone { .. } => addr.to_string(),
        };
        let local = match listen_local(&advertised) {
            Ok(listener) => Some(listener),
            Err(e) => {
                warn!(
                    name = %local_name(&advertised),
                    error = %e,
                    "no machine-local socket: workers on this machine will use TCP"
                );
                None
            }
        };
        let local_addr = local.as_ref().map(|_| advertised.clone());
        // Listening before the server joins: a port in use fails it before the job counts
        // on it. Scrapes before it serves see only that it is not up yet.
        let serving: Arc<OnceLock<Served>> = Arc::default();
        let metrics = match cfg.metrics_bind {
            Some(bind) => {
                let serving = Arc::clone(&serving);
                let render: Render = Arc::new(move || match serving.get() {
                    Some(served) => crate::metrics::render(&served.shared, &served.engines),
                    None => crate::metrics::not_serving(),
                });
                let endpoint = MetricsEndpoint::start(bind, render)
                    .map_err(|source| ServerError::Metrics { addr: bind, source })?;
                info!(addr = %endpoint.local_addr(), "serving metrics at /metrics");
                Some(endpoint)
            }
            None => None,
        };
        let (worker_names, rank, coordinator) = match &cfg.membership {
            Membership::Standalone { workers } => {
                if *workers == 0 {
                    return Err(ServerError::Config(
                        "a job needs at least one worker".into(),
                    ));
                }
                (vec![String::new(); *workers as usize], None, None)
            }
            Membership::Coordinator(link) => {
                let client = join(link, &cfg.token, addr.port())?;
                let names = client
                    .cluster_map()
                    .workers
                    .iter()
                    .map(|w| w.name.clone())
                    .collect();
                (names, Some(client.rank()), Some(client))
            }
        };
        let mut engines = Vec::new();
        let mut counters = Vec::new();
        let (stall_tx, stall_reports) = std::sync::mpsc::channel();
        for _ in 0..cfg.engine_threads {
            let counted = Arc::new(EngineCounters::default());
            counters.push(Arc::clone(&counted));
            let mut engine = Engine::new(reducer, worker_names.len() as u32)
                .with_stall_warning(cfg.settings.stall_warning)
                .with_counters(counted);
            if coordinator.is_some() {
                engine = engine.with_stall_reports(stall_tx.clone());
            }
            engines.push(engine);
        }
        let shared = Arc::new(Shared::new(
            cfg.settings.clone(),
            cfg.token.clone(),
            worker_names,
            engines,
            cfg.max_key_memory,
        ));
        // Dropped by the handle: the checker stops at once, not at its next check.
        let (stall_checks, stall_stop) = std::sync::mpsc::channel::<()>();
        let stall_checker = match cfg.settings.stall_warning {
            Some(_) => {
                let shared = Arc::clone(&shared);
                Some(spawn("sumflow-stalls".into(), move || {
                    while let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                        stall_stop.recv_timeout(STALL_CHECK)
                    {
                        shared.check_stalls();
                    }
                })?)
            }
            None => None,
        };
        info!(
            %addr,
            rank = ?rank,
            workers = shared.workers,
            engines = cfg.engine_threads,
            simd = reducer.level().name(),
            "summation server listening"
        );
        let _ = serving.set(Served {
            shared: Arc::clone(&shared),
            engines: counters,
        });
        let connections = Arc::new(Mutex::new(Vec::new()));
        let accept = {
            let shared = Arc::clone(&shared);
            let connections = Arc::clone(&connections);
            let max = cfg.max_connections;
            spawn("sumflow-accept".into(), move || {
                let links = listener.incoming().map(|s| s.map(Link::Tcp));
                accept_loop(links, &shared, &connections, max);
            })?
        };
        let accept_local = match local {
            Some(listener) => {
                let shared = Arc::clone(&shared);
                let connections = Arc::clone(&connections);
                let max = cfg.max_connections;
                Some(spawn("sumflow-accept-local".into(), move || {
                    accept_local_loop(&listener, &shared, &connections, max);
                })?)
            }
            None => None,
        };
        let coordinator = coordinator.map(|c| Arc::new(Mutex::new(Some(c))));
        let monitor = match &coordinator {
            Some(client) => {
                let shared = Arc::clone(&shared);
                let client = Arc::clone(client);
                let local = local_addr.clone();
                Some(spawn("sumflow-monitor".into(), move || {
                    monitor(&shared, &client, &stall_reports, addr, local.as_deref());
                })?)
            }
            None => None,
        };
        Ok(ServerHandle {
            addr,
            local: local_addr,
            rank,
            shared,
            accept: Some(accept),
            accept_local,
            stall_checker,
            stall_checks: Some(stall_checks),
            monitor,
            connections,
            coordinator,
            metrics,
        })
    }
}

fn spawn<F: FnOnce() + Send + 'static>(name: String, f: F) -> Result<JoinHandle<()>, ServerError> {
    std::thread::Builder::new()
        .name(name)
        .spawn(f)
        .map_err(ServerError::Thread)
}

fn join(
    link: &CoordinatorLink,
    token: &JobToken,
    port: u16,
) -> Result<CoordinatorClient, ServerError> {
    let pid = std::process::id();
    let reg = Registration {
        role: Role::Server,
        requested_rank: link.requested_rank,
        host: link.advertise_host.clone(),
        port,
        host_id: link.host_id.clone(),
        pid,
        link_mbit: 0,
        name: format!("server {}:{port} pid {pid}", link.advertise_host),
    };
    CoordinatorClient::join(
        &link.addr,
        token,
        reg,
        link.join_timeout,
        link.options.clone(),
    )
    .map_err(ServerError::Join)
}

fn accept_local_loop(
    listener: &UnixListener,
    shared: &Arc<Shared>,
    connections: &Mutex<Vec<JoinHandle<()>>>,
    max_connections: usize,
) {
    let links = listener.incoming().map(|s| s.map(Link::Local));
    accept_loop(links, shared, connections, max_connections);
}

fn accept_loop(
    links: impl Iterator<Item = std::io::Result<Link>>,
    shared: &Arc<Shared>,
    connections: &Mutex<Vec<JoinHandle<()>>>,
    max_connections: usize,
) {
    for stream in links {
        if shared.is_stopping() {
            break;
        }
        let stream = match stream {
            Ok(s) => s,
            Err(e) => {
                warn!(error = %e, "accept failed");
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
        };
        // Unauthenticated connections have a cap of their own, well under the total's, so
        // they can neither exhaust the threads nor lock the job's workers out.
        let Some(pass) = shared.handshakes.enter() else {
            if shared.handshakes.should_warn() {
                warn!(
                    peer = %stream.peer(),
                    limit = shared.handshakes.limit(),
                    "too many connections in their handshake; closing new ones"
                );
            }
            continue;
        };
        let mut conns = connections.lock().expect("connections lock");
        conns.retain(|h| !h.is_finished());
        if conns.len() >= max_connections {
            warn!(
                limit = max_connections,
                "connection limit reached; closing new connection"
            );
            continue;
        }
        let shared = Arc::clone(shared);
        match std::thread::Builder::new()
            .name("sumflow-conn".into())
            .spawn(move || crate::connection::serve(shared, stream, pass))
        {
            Ok(h) => conns.push(h),
            Err(e) => warn!(error = %e, "cannot start a connection thread"),
        }
    }
}

/// Relays the coordinator's failure notices to the engines and the engines' stall reports
/// to the coordinator, and stops the server when the coordinator ends the job.
fn monitor(
    shared: &Shared,
    client: &Mutex<Option<CoordinatorClient>>,
    stall_reports: &std::sync::mpsc::Receiver<StallReport>,
    addr: SocketAddr,
    local: Option<&str>,
) {
    let failures = match client.lock().expect("coordinator lock").as_ref() {
        Some(c) => c.failures(),
        None => return,
    };
    while !shared.is_stopping() {
        match failures.recv_timeout(Duration::from_millis(100)) {
            Ok(f) if f.node.role == Role::Worker && f.node.rank < shared.workers => {
                shared.worker_gone(f.node.rank, &format!("failed: {}", f.reason));
                shared.disconnect(f.node.rank);
            }
            Ok(f) if f.is_coordinator() => {
                // Without its coordinator the job can detect no failure, and its workers
                // stop: the server is no use to anyone any more.
                let why = format!("lost the job's {}: {}", f.name, f.reason);
                error!(reason = %why, "the job is gone; stopping");
                shared.fail(why);
                stop(shared, addr, local);
            }
            Ok(f) => warn!(node = %f.name, reason = %f.reason, "node failed"),
            Err(RecvTimeoutError::Timeout) => {}
            Err(RecvTimeoutError::Disconnected) => break,
        }
        if let Some(c) = client.lock().expect("coordinator lock").as_ref() {
            for r in stall_reports.try_iter() {
                // A lost coordinator is reported through `failures`.
                let _ = c.report_stall(r.key, r.round, r.waited, r.missing);
            }
        }
        let done = client
            .lock()
            .expect("coordinator lock")
            .as_ref()
            .is_some_and(|c| c.shutdown_requested());
        if done {
            info!("the coordinator ended the job; stopping");
            stop(shared, addr, local);
        }
    }
}

fn stop(shared: &Shared, addr: SocketAddr, local: Option<&str>) {
    if shared.is_stopping() {
        return;
    }
    shared.stop();
    // Wakes the accept loop, which checks the stop flag on each connection.
    let wake = match addr.ip() {
        ip if ip.is_unspecified() => SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), addr.port()),
        _ => addr,
    };
    let _ = TcpStream::connect_timeout(&wake, Duration::from_secs(1));
    if let Some(local) = local {
        let _ = connect_local(local);
    }
}

/// A running server.
#[derive(Debug)]
pub struct ServerHandle {
    addr: SocketAddr,
    /// The advertised address whose machine-local socket the server listens on.
    local: Option<String>,
    rank: Option<u32>,
    shared: Arc<Shared>,
    accept: Option<JoinHandle<()>>,
    accept_local: Option<JoinHandle<()>>,
    /// Looks for rounds waiting past the stall warning; stops once `stall_checks` drops.
    stall_checker: Option<JoinHandle<()>>,
    stall_checks: Option<std::sync::mpsc::Sender<()>>,
    monitor: Option<JoinHandle<()>>,
    connections: Arc<Mutex<Vec<JoinHandle<()>>>>,
    coordinator: Option<Arc<Mutex<Option<CoordinatorClient>>>>,
    metrics: Option<MetricsEndpoint>,
}

impl ServerHandle {
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// The server's rank in the job (coordinator mode).
    pub fn rank(&self) -> Option<u32> {
        self.rank
    }

    /// Where metrics are served, when they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::local_addr)
    }

    /// Whether the server has stopped accepting (after `shutdown` or the job's end).
    pub fn is_finished(&self) -> bool {
        self.shared.is_stopping()
    }

    /// Why the server stopped on its own for a failure (its coordinator was lost), if it
    /// did; None after a clean end or `shutdown`.
    pub fn failure(&self) -> Option<String> {
        self.shared.failure()
    }

    /// The bytes read from and written to workers so far, per key.
    pub fn wire_traffic(&self) -> crate::WireTraffic {
        self.shared.traffic.snapshot()
    }

    /// Keys live now, the most live at once, and how many were freed because every
    /// worker of theirs retired them.
    pub fn key_counts(&self) -> (usize, usize, u64) {
        let dir = self.shared.directory.read().expect("directory lock");
        (dir.len(), dir.peak(), dir.freed())
    }

    /// Asks the server to stop; `wait` returns once it has.
    pub fn shutdown(&self) {
        stop(&self.shared, self.addr, self.local.as_deref());
    }

    /// Waits for the server to stop, then leaves the job gracefully; returns the bytes it
    /// exchanged with workers.
    pub fn wait(mut self) -> crate::WireTraffic {
        for h in [self.accept.take(), self.accept_local.take()]
            .into_iter()
            .flatten()
        {
            let _ = h.join();
        }
        let conns = std::mem::take(&mut *self.connections.lock().expect("connections lock"));
        for h in conns {
            let _ = h.join();
        }
        drop(self.stall_checks.take());
        if let Some(h) = self.stall_checker.take() {
            let _ = h.join();
        }
        if let Some(h) = self.monitor.take() {
            let _ = h.join();
        }
        if let Some(c) = self.coordinator.take() {
            if let Some(client) = c.lock().expect("coordinator lock").take() {
                if let Err(e) = client.leave("summation server stopping") {
                    warn!(error = %e, "could not leave the job gracefully");
                }
            }
        }
        {
            let dir = self.shared.directory.read().expect("directory lock");
            info!(
                "keys: {} live at the end, at most {} at once, {} freed once every worker retired them",
                dir.len(),
                dir.peak(),
                dir.freed()
            );
        }
        let traffic = self.shared.traffic.snapshot();
        let total = traffic.total();
        info!(
            addr = %self.addr,
            keys = traffic.keys.len(),
            bytes_received = total.received,
            bytes_sent = total.sent,
            "summation server stopped"
        );
        traffic
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        if self.accept.is_some() {
            self.shutdown();
        }
    }
}
