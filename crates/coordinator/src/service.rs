//! The coordinator's network edge: threads and sockets around the pure [`Membership`] core.
//!
//! One accept thread; per connection a reader thread (which also runs the handshake) and a
//! writer thread fed through a bounded queue; one core thread that owns the state, takes
//! events over a channel and ticks the clock. Only the core thread decides anything.

use std::collections::HashMap;
use std::io::ErrorKind;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use crossbeam_channel::{bounded, Receiver, RecvTimeoutError, Sender, TrySendError};
use sumflow_wire::gate::{Gate, Pass, MAX_HANDSHAKES};
use sumflow_wire::io::{accept, write_message, FrameReader};
use sumflow_wire::metrics::{MetricsEndpoint, Render};
use sumflow_wire::{JobToken, Message, Peer, Service, WireError};
use tracing::{debug, error, info, warn, Level};

use crate::config::CoordinatorConfig;
use crate::incidents::IncidentLog;
use crate::liveness::secs;
use crate::membership::{Action, ConnId, Membership};
use crate::{CoordinatorError, JobOutcome};

/// Events waiting for the core; readers block when it is full, which slows floods down.
const EVENT_QUEUE: usize = 4096;
/// Frames waiting to be written to one node; a node this far behind is not reading.
const WRITE_QUEUE: usize = 256;
/// Longest pause between two liveness checks.
const MAX_TICK: Duration = Duration::from_millis(100);
/// How long a scrape waits for the core thread.
const SCRAPE_WAIT: Duration = Duration::from_secs(1);
/// How often the accept loop looks at the stop flag.
const ACCEPT_POLL: Duration = Duration::from_millis(20);
/// Connections allowed beyond the job's nodes' (and those in their handshake): tools
/// asking the coordinator something.
const SPARE_CONNECTIONS: usize = 64;

enum Event {
    Connected {
        conn: ConnId,
        peer: Peer,
        writer: Sender<Message>,
        thread: JoinHandle<()>,
    },
    Frame {
        conn: ConnId,
        msg: Message,
    },
    Invalid {
        conn: ConnId,
        error: WireError,
    },
    Closed {
        conn: ConnId,
        reason: String,
    },
    /// A metrics scrape: the core answers with the exposition.
    Scrape(Sender<String>),
    Stop,
}

/// Starts coordinators.
#[derive(Debug)]
pub struct CoordinatorService;

impl CoordinatorService {
    /// Validates `cfg`, listens on `cfg.bind` and runs the coordinator on its own threads.
    pub fn start(cfg: CoordinatorConfig) -> Result<CoordinatorHandle, CoordinatorError> {
        cfg.validate()?;
        let bind_err = |source| CoordinatorError::Bind {
            addr: cfg.bind,
            source,
        };
        let listener = TcpListener::bind(cfg.bind).map_err(bind_err)?;
        let addr = listener.local_addr().map_err(bind_err)?;
        listener.set_nonblocking(true).map_err(bind_err)?;
        let incidents = cfg
            .incidents_file
            .as_deref()
            .map(IncidentLog::open)
            .transpose()?;
        info!(
            job = %cfg.job_id, %addr,
            "coordinator listening for {} workers and {} servers",
            cfg.num_workers, cfg.num_servers
        );
        let (events, inbox) = bounded(EVENT_QUEUE);
        let metrics = match cfg.metrics_bind {
            Some(bind) => {
                let events = events.clone();
                let render: Render = Arc::new(move || scrape(&events));
                let endpoint = MetricsEndpoint::start(bind, render)
                    .map_err(|source| CoordinatorError::Metrics { addr: bind, source })?;
                info!(addr = %endpoint.local_addr(), "serving metrics at /metrics");
                Some(endpoint)
            }
            None => None,
        };
        let stop = Arc::new(AtomicBool::new(false));
        let nodes = cfg.num_workers as usize + cfg.num_servers as usize;
        let conn_cfg = ConnSettings {
            token: cfg.token.clone(),
            max_body: cfg.max_body,
            timeout: cfg.heartbeat_timeout,
            handshakes: Gate::new(MAX_HANDSHAKES),
            // Every node holds one; a node replacing a lost connection may briefly hold two.
            connections: Gate::new(MAX_HANDSHAKES + 2 * nodes + SPARE_CONNECTIONS),
        };
        let (tx, flag) = (events.clone(), stop.clone());
        thread::Builder::new()
            .name("coord-accept".into())
            .spawn(move || accept_loop(listener, conn_cfg, tx, flag))
            .map_err(CoordinatorError::Spawn)?;
        let core = thread::Builder::new()
            .name("coord-core".into())
            .spawn(move || {
                let result = run_core(&cfg, inbox, incidents);
                stop.store(true, Ordering::Relaxed);
                result
            })
            .map_err(CoordinatorError::Spawn)?;
        Ok(CoordinatorHandle {
            addr,
            events,
            core: Some(core),
            metrics,
        })
    }
}

/// A running coordinator. Dropping it stops the coordinator as [`shutdown`](Self::shutdown) does.
#[derive(Debug)]
pub struct CoordinatorHandle {
    addr: SocketAddr,
    events: Sender<Event>,
    core: Option<JoinHandle<Result<JobOutcome, CoordinatorError>>>,
    metrics: Option<MetricsEndpoint>,
}

impl CoordinatorHandle {
    /// The address nodes connect to (the actual port when bound to port 0).
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }

    /// Where metrics are served, when they are.
    pub fn metrics_addr(&self) -> Option<SocketAddr> {
        self.metrics.as_ref().map(MetricsEndpoint::local_addr)
    }

    /// Tells every node `Shutdown { reason: "coordinator stopping" }` and stops.
    pub fn shutdown(&self) {
        let _ = self.events.send(Event::Stop);
    }

    /// Blocks until the coordinator has stopped and returns how the job ended.
    pub fn wait(mut self) -> Result<JobOutcome, CoordinatorError> {
        let Some(core) = self.core.take() else {
            return Err(CoordinatorError::Internal("wait called twice".into()));
        };
        core.join().unwrap_or_else(|_| {
            Err(CoordinatorError::Internal(
                "the coordinator's core thread panicked; see the log above".into(),
            ))
        })
    }

    /// Whether the coordinator has stopped, so that `wait` will not block.
    pub fn is_finished(&self) -> bool {
        self.core.as_ref().is_none_or(|c| c.is_finished())
    }
}

impl Drop for CoordinatorHandle {
    fn drop(&mut self) {
        if self.core.is_some() {
            let _ = self.events.try_send(Event::Stop);
        }
    }
}

#[derive(Clone)]
struct ConnSettings {
    token: JobToken,
    max_body: u32,
    timeout: Duration,
    /// Connections in their handshake, capped on their own.
    handshakes: Arc<Gate>,
    /// Every connection (two threads each), handshaking or not.
    connections: Arc<Gate>,
}

fn accept_loop(
    listener: TcpListener,
    cfg: ConnSettings,
    events: Sender<Event>,
    stop: Arc<AtomicBool>,
) {
    let next_id = AtomicU64::new(1);
    while !stop.load(Ordering::Relaxed) {
        match listener.accept() {
            Ok((stream, remote)) => {
                let (Some(place), Some(pass)) = (cfg.connections.enter(), cfg.handshakes.enter())
                else {
                    if cfg.handshakes.should_warn() {
                        warn!(
                            "closing the connection from {remote}: {} connections open, {} of \
                             them in their handshake (limits {} and {})",
                            cfg.connections.inside(),
                            cfg.handshakes.inside(),
                            cfg.connections.limit(),
                            cfg.handshakes.limit()
                        );
                    }
                    continue;
                };
                let conn = next_id.fetch_add(1, Ordering::Relaxed);
                let (cfg, events) = (cfg.clone(), events.clone());
                let spawned = thread::Builder::new()
                    .name(format!("coord-conn-{conn}"))
                    .spawn(move || {
                        serve_connection(stream, remote, conn, cfg, events, pass);
                        drop(place);
                    });
                if let Err(e) = spawned {
                    error!("cannot start a thread for the connection from {remote}: {e}");
                }
            }
            Err(e) if e.kind() == ErrorKind::WouldBlock => thread::sleep(ACCEPT_POLL),
            Err(e) => {
                warn!("accepting a connection failed: {e}");
                thread::sleep(ACCEPT_POLL);
            }
        }
    }
}

/// Handshake, then read frames until the connection ends, passing each to the core.
/// `pass`, its place among the connections in their handshake, is given up once the
/// handshake ends.
fn serve_connection(
    mut stream: TcpStream,
    remote: SocketAddr,
    conn: ConnId,
    cfg: ConnSettings,
    events: Sender<Event>,
    pass: Pass,
) {
    // The accepted socket may inherit the listener's non-blocking mode on some platforms.
    let setup = stream
        .set_nonblocking(false)
        .and_then(|_| stream.set_nodelay(true))
        .and_then(|_| stream.set_read_timeout(Some(cfg.timeout)))
        .and_then(|_| stream.set_write_timeout(Some(cfg.timeout)));
    if let Err(e) = setup {
        warn!("cannot configure the connection from {remote}: {e}");
        return;
    }
    let accepted = accept(
        &mut stream,
        &cfg.token,
        Service::Coordinator,
        cfg.timeout,
        |_| Ok(()),
    );
    drop(pass);
    let peer = match accepted {
        Ok((peer, ())) => peer,
        Err(e) => {
            warn!("refused the connection from {remote}: {e}");
            return;
        }
    };
    debug!("{} '{}' connected from {remote}", peer.role, peer.name);
    let out = match stream.try_clone() {
        Ok(s) => s,
        Err(e) => {
            warn!("cannot set up the connection from {remote}: {e}");
            return;
        }
    };
    let (writer, queue) = bounded(WRITE_QUEUE);
    let thread = match thread::Builder::new()
        .name(format!("coord-write-{conn}"))
        .spawn(move || write_loop(out, queue))
    {
        Ok(t) => t,
        Err(e) => {
            error!("cannot start a writer thread for {remote}: {e}");
            return;
        }
    };
    if events
        .send(Event::Connected {
            conn,
            peer,
            writer,
            thread,
        })
        .is_err()
    {
        return;
    }
    // The core detects silence on its own ticks; this longer timeout only frees the thread
    // of a connection the core has somehow not closed.
    let _ = stream.set_read_timeout(Some(cfg.timeout * 2));
    let mut reader = FrameReader::new(stream, cfg.max_body);
    loop {
        let event = match reader.read() {
            Ok(frame) => {
                let skipped = if frame.payload_len > 0 {
                    reader.skip_payload()
                } else {
                    Ok(())
                };
                let event = Event::Frame {
                    conn,
                    msg: frame.message,
                };
                if events.send(event).is_err() || skipped.is_err() {
                    return;
                }
                continue;
            }
            Err(WireError::Closed) => Event::Closed {
                conn,
                reason: "connection closed without shutdown".into(),
            },
            Err(WireError::Io(e)) => Event::Closed {
                conn,
                reason: match e.kind() {
                    ErrorKind::WouldBlock | ErrorKind::TimedOut => format!(
                        "no heartbeat for {} (the connection's read timed out)",
                        secs(cfg.timeout * 2)
                    ),
                    _ => format!("connection failed: {e}"),
                },
            },
            Err(WireError::Timeout { .. }) => Event::Closed {
                conn,
                reason: format!("no heartbeat for {}", secs(cfg.timeout * 2)),
            },
            Err(error) => Event::Invalid { conn, error },
        };
        let _ = events.send(event);
        return;
    }
}

/// Writes queued frames until the core lets go of the queue, then closes the socket so the
/// reader sees the end too.
fn write_loop(mut stream: TcpStream, queue: Receiver<Message>) {
    for msg in queue {
        if write_message(&mut stream, &msg).is_err() {
            break;
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// The core thread: owns the state, feeds it events and ticks, and carries out its actions.
fn run_core(
    cfg: &CoordinatorConfig,
    inbox: Receiver<Event>,
    incidents: Option<IncidentLog>,
) -> Result<JobOutcome, CoordinatorError> {
    let span = tracing::info_span!("coordinator", job = %cfg.job_id);
    let _entered = span.enter();
    let tick = MAX_TICK.min(cfg.heartbeat_timeout / 4);
    let mut core = Membership::new(cfg, Instant::now());
    let mut io = Io {
        incidents,
        ..Io::default()
    };
    let mut next_tick = Instant::now() + tick;
    let result = loop {
        let actions = match inbox.recv_deadline(next_tick) {
            Ok(Event::Connected {
                conn,
                peer,
                writer,
                thread,
            }) => {
                io.writers.insert(conn, writer);
                io.threads.push(thread);
                core.connected(conn, peer, Instant::now())
            }
            Ok(Event::Frame { conn, msg }) => core.message(conn, msg, Instant::now()),
            Ok(Event::Invalid { conn, error }) => core.invalid_frame(conn, &error),
            Ok(Event::Closed { conn, reason }) => core.disconnected(conn, &reason),
            // Unreachable while the handle holds a sender; stopping is the safe answer.
            Ok(Event::Scrape(reply)) => {
                let _ = reply.try_send(crate::metrics::render(&core.counts()));
                Vec::new()
            }
            Ok(Event::Stop) | Err(RecvTimeoutError::Disconnected) => core.stop(),
            Err(RecvTimeoutError::Timeout) => Vec::new(),
        };
        if let Some(result) = io.execute(actions, &mut core) {
            break result;
        }
        let now = Instant::now();
        if now >= next_tick {
            next_tick = now + tick;
            io.threads.retain(|t| !t.is_finished());
            if let Some(result) = io.execute(core.tick(now), &mut core) {
                break result;
            }
        }
    };
    // Dropping the queues lets each writer flush its last frames (the Shutdown notices) and
    // close; waiting for them means a process exiting after `wait` does not cut them off.
    let Io {
        writers, threads, ..
    } = io;
    drop(writers);
    for t in threads {
        let _ = t.join();
    }
    result
}

#[derive(Default)]
struct Io {
    writers: HashMap<ConnId, Sender<Message>>,
    threads: Vec<JoinHandle<()>>,
    incidents: Option<IncidentLog>,
}

impl Io {
    /// Carries out actions; a node whose queue is full is disconnected, which feeds the
    /// core again. Returns the outcome once the core has finished.
    fn execute(
        &mut self,
        mut actions: Vec<Action>,
        core: &mut Membership,
    ) -> Option<Result<JobOutcome, CoordinatorError>> {
        let mut finished = None;
        loop {
            let mut stuck = Vec::new();
            for action in actions {
                match action {
                    Action::Send(conn, msg) => {
                        if let Some(w) = self.writers.get(&conn) {
                            if let Err(TrySendError::Full(_)) = w.try_send(msg) {
                                stuck.push(conn);
                            }
                        }
                    }
                    Action::Close(conn) => {
                        self.writers.remove(&conn);
                    }
                    Action::Log(level, line) => log(level, &line),
                    Action::Incident(incident) => {
                        if let Some(file) = &mut self.incidents {
                            file.record(&incident);
                        }
                    }
                    Action::Finished(result) => finished = Some(result),
                }
            }
            if stuck.is_empty() || finished.is_some() {
                return finished;
            }
            actions = stuck
                .into_iter()
                .flat_map(|conn| {
                    let why = format!(
                        "stopped reading: {WRITE_QUEUE} frames are waiting to be sent to it"
                    );
                    core.disconnected(conn, &why)
                })
                .collect();
        }
    }
}

/// Asks the core thread for a scrape's exposition; a core that does not answer within a
/// second (or has stopped) shows as not running.
fn scrape(events: &Sender<Event>) -> String {
    let (tx, rx) = bounded(1);
    let answered = events
        .send_timeout(Event::Scrape(tx), SCRAPE_WAIT)
        .is_ok()
        .then(|| rx.recv_timeout(SCRAPE_WAIT).ok())
        .flatten();
    answered.unwrap_or_else(|| crate::metrics::render(&crate::membership::Counts::default()))
}

fn log(level: Level, line: &str) {
    match level {
        Level::ERROR => error!("{line}"),
        Level::WARN => warn!("{line}"),
        Level::INFO => info!("{line}"),
        _ => debug!("{line}"),
    }
}
