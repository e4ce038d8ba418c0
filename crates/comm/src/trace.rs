//! A Chrome-trace recorder for one worker: what each partition went through and what the
//! scheduler decided, for a chosen window of training steps, written as one JSON file that
//! Perfetto (ui.perfetto.dev) and chrome://tracing open.
//!
//! Traces of older systems were hard to use because they recorded everything, from the
//! first step, into files too large to open, with tracks named by thread id. This one:
//!
//! - records only steps `start_step .. start_step + steps` (counted by [`Tracer::mark_step`])
//!   and at most `max_events` events, so a file stays small whatever the job's length;
//! - names every track by what it shows ("steps", "scheduler", "push → server 1 lane 0",
//!   the Python tracks by their own names) and orders them top to bottom the way a step
//!   flows: steps, Python (forward, backward, waits), scheduler, then each lane's push and
//!   receive side by side;
//! - puts every worker's events on one clock, microseconds since the Unix epoch (the wall
//!   clock read once at start, plus monotonic offsets), so merged traces of several
//!   workers line up.
//!
//! Besides the window, an interval can be recorded on demand, into a file of its own
//! ([`Tracer::start_interval`] to [`Tracer::stop_interval`]: Horovod's `start_timeline`
//! and `stop_timeline`), with its own bound; the two may run at once.
//!
//! Not recording costs one relaxed atomic load per call ([`Tracer::active`]); callers that
//! build arguments should check it first. Events go to memory under one lock and are
//! written when the window closes (or the interval stops), so recording never does I/O on
//! the data path.

use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File};
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use thiserror::Error;
use tracing::{info, warn};

/// The first recorded step by default: the first steps declare tensors, allocate and
/// warm up, and look like no later one.
pub const DEFAULT_START_STEP: u64 = 10;
/// Steps recorded by default: enough to see the steady pattern and its variation.
pub const DEFAULT_STEPS: u64 = 5;
/// Events kept by default: at most about 90 MB of memory and a file of the same size,
/// which Perfetto opens in seconds; a step of a VGG-16 at 4 MiB partitions takes about a
/// thousand.
pub const DEFAULT_MAX_EVENTS: usize = 500_000;

/// Version of the file's `otherData.sumflow_trace` layout.
const FORMAT_VERSION: u32 = 1;
/// How a file's `ts` is defined (its `otherData.clock`).
const CLOCK: &str = "ts: microseconds since the Unix epoch, this worker's wall clock read once \
                     at its start plus monotonic time since";

/// Thread ids, which are also the tracks' sort order (see [`Track`]).
const STEPS_TID: u32 = 1;
const FIRST_PYTHON_TID: u32 = 100;
const LAST_PYTHON_TID: u32 = 999;
/// Python tracks beyond the 900th sort after everything else.
const OVERFLOW_PYTHON_TID: u32 = 1_000_000;
const SCHEDULER_TID: u32 = 1_000;
const SHARED_MEMORY_TID: u32 = 1_001;
const FIRST_LANE_TID: u32 = 10_000;
/// Thread ids per server: a push and a receive track for each of up to 50 lanes.
const TIDS_PER_SERVER: u32 = 100;

/// Which steps to record, and where.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceConfig {
    /// Where `sumflow-trace-rank{rank}.json` is written; created if missing.
    pub dir: PathBuf,
    /// The first recorded step, counting from 0 (the steps before the first
    /// [`Tracer::mark_step`]).
    pub start_step: u64,
    /// How many steps are recorded; at least 1.
    pub steps: u64,
    /// Recording stops, and the file says so, once this many events were kept.
    pub max_events: usize,
}

impl TraceConfig {
    /// The default window in `dir`.
    pub fn new(dir: impl Into<PathBuf>) -> TraceConfig {
        TraceConfig {
            dir: dir.into(),
            start_step: DEFAULT_START_STEP,
            steps: DEFAULT_STEPS,
            max_events: DEFAULT_MAX_EVENTS,
        }
    }

    /// Checks the settings and creates the directory, so that a bad one fails a worker's
    /// start rather than the end of its window.
    pub(crate) fn prepare(&self) -> Result<(), TraceError> {
        if self.steps == 0 {
            return Err(TraceError::Invalid(
                "the number of traced steps must be at least 1".into(),
            ));
        }
        if self.max_events == 0 {
            return Err(TraceError::Invalid(
                "the maximum number of trace events must be at least 1".into(),
            ));
        }
        if self.start_step.checked_add(self.steps).is_none() {
            return Err(TraceError::Invalid(format!(
                "the trace window's start step {} plus {} steps overflows",
                self.start_step, self.steps
            )));
        }
        fs::create_dir_all(&self.dir).map_err(|source| TraceError::Directory {
            path: self.dir.clone(),
            source,
        })
    }

    /// The file a worker of rank `rank` writes.
    pub(crate) fn path(&self, rank: u32) -> PathBuf {
        self.dir.join(format!("sumflow-trace-rank{rank}.json"))
    }
}

#[derive(Debug, Error)]
pub enum TraceError {
    #[error("invalid trace setting: {0}")]
    Invalid(String),
    #[error("cannot create the trace directory {}: {source}", path.display())]
    Directory { path: PathBuf, source: io::Error },
    #[error("cannot write the trace {}: {source}", path.display())]
    Write { path: PathBuf, source: io::Error },
}

/// A written trace file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceFile {
    pub path: PathBuf,
    /// Which steps it holds ("steps 10 to 14"), or why it holds none.
    pub recorded: String,
    /// Events in it, besides the tracks' names.
    pub events: usize,
}

impl std::fmt::Display for TraceFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "trace {}: {}, {} events",
            self.path.display(),
            self.recorded,
            self.events
        )
    }
}

/// Where an event is drawn: one track (a "thread" of the worker's process) per kind of
/// activity, so that each track's slices never overlap.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Track {
    /// One slice per recorded step, from one [`Tracer::mark_step`] to the next; written by
    /// the tracer itself.
    Steps,
    /// Spans the training script records (forward, backward, waits), one track per name.
    Python(String),
    /// The scheduler's decisions, as instants.
    Scheduler,
    /// What one lane (connection) to a server sends; `lane` counts within the server.
    Push { server: u32, lane: u32 },
    /// What one lane receives from its server.
    Receive { server: u32, lane: u32 },
    /// The shared-memory stage: each operation on a tensor summed in the machine's shared
    /// memory, with its phases (copy in, reduce, take) inside it.
    SharedMemory,
}

impl Track {
    fn category(&self) -> &'static str {
        match self {
            Track::Steps => "step",
            Track::Python(_) => "python",
            Track::Scheduler => "scheduler",
            Track::Push { .. } => "push",
            Track::Receive { .. } => "receive",
            Track::SharedMemory => "shared memory",
        }
    }

    fn label(&self) -> String {
        match self {
            Track::Steps => "steps".into(),
            Track::Python(name) => name.clone(),
            Track::Scheduler => "scheduler".into(),
            Track::Push { server, lane } => format!("push → server {server} lane {lane}"),
            Track::Receive { server, lane } => format!("receive ← server {server} lane {lane}"),
            Track::SharedMemory => "shared memory".into(),
        }
    }
}

/// A value of an event's arguments, shown when the event is selected.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Arg<'a> {
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'a str),
}

impl From<i64> for Arg<'_> {
    fn from(v: i64) -> Self {
        Arg::Int(v)
    }
}
impl From<u64> for Arg<'_> {
    fn from(v: u64) -> Self {
        Arg::Uint(v)
    }
}
impl From<u32> for Arg<'_> {
    fn from(v: u32) -> Self {
        Arg::Uint(v.into())
    }
}
impl From<usize> for Arg<'_> {
    fn from(v: usize) -> Self {
        Arg::Uint(v as u64)
    }
}
impl From<f64> for Arg<'_> {
    fn from(v: f64) -> Self {
        Arg::Float(v)
    }
}
impl<'a> From<&'a str> for Arg<'a> {
    fn from(v: &'a str) -> Self {
        Arg::Str(v)
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Span,
    Instant,
    Counter,
}

#[derive(Clone, Debug)]
struct Event {
    kind: Kind,
    tid: u32,
    cat: &'static str,
    name: Cow<'static, str>,
    at: Instant,
    dur: Duration,
    /// The arguments as a JSON object, serialized when recorded.
    args: Option<Box<str>>,
}

impl Event {
    /// The slice of step `step` on the steps track, from `from` to `to`.
    fn step(step: u64, from: Instant, to: Instant) -> Event {
        Event {
            kind: Kind::Span,
            tid: STEPS_TID,
            cat: "step",
            name: Cow::Owned(format!("step {step}")),
            at: from,
            dur: to.saturating_duration_since(from),
            args: Some(format!("{{\"step\":{step}}}").into()),
        }
    }

    /// The instant on the steps track where recording stopped at `max_events`.
    fn stopped(max_events: usize) -> Event {
        Event {
            kind: Kind::Instant,
            tid: STEPS_TID,
            cat: "step",
            name: Cow::Owned(format!("trace stopped: max_events ({max_events}) reached")),
            at: Instant::now(),
            dur: Duration::ZERO,
            args: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Window {
    /// Counting steps up to the first recorded one.
    Before,
    Recording,
    /// `max_events` reached at this step: steps are still counted, nothing else kept.
    Full {
        at_step: u64,
    },
    /// The file was written, or the tracer has no window.
    Closed,
}

/// What one file will hold: events and the tracks they are drawn on.
#[derive(Debug, Default)]
struct Buffer {
    events: Vec<Event>,
    /// Every track used so far: its label and category, by thread id.
    tracks: BTreeMap<u32, (String, &'static str)>,
}

impl Buffer {
    fn push(&mut self, track: &Track, event: Event) {
        self.tracks
            .entry(event.tid)
            .or_insert_with(|| (track.label(), track.category()));
        self.events.push(event);
    }
}

/// A trace recorded on demand, from [`Tracer::start_interval`] to [`Tracer::stop_interval`].
#[derive(Debug)]
struct Interval {
    path: PathBuf,
    max_events: usize,
    began: Instant,
    began_step: u64,
    buffer: Buffer,
    /// The step during which `max_events` was reached: nothing is kept since.
    full_at_step: Option<u64>,
}

impl Interval {
    /// Keeps `event` unless `max_events` were kept already; then marks where recording
    /// stopped and returns false.
    fn keep(&mut self, track: &Track, event: Event, step: u64) -> bool {
        if self.buffer.events.len() < self.max_events {
            self.buffer.push(track, event);
            return true;
        }
        self.full_at_step = Some(step);
        warn!(
            max_events = self.max_events,
            step,
            "the trace of an interval into {} stopped recording: {} events kept, the most \
             allowed; it ends at step {step}",
            self.path.display(),
            self.max_events
        );
        self.buffer
            .push(&Track::Steps, Event::stopped(self.max_events));
        false
    }
}

#[derive(Debug)]
struct State {
    /// The current step: how many times [`Tracer::mark_step`] was called.
    step: u64,
    step_began: Instant,
    window: Window,
    /// What the window recorded.
    buffer: Buffer,
    python_tids: HashMap<String, u32>,
    /// The interval being recorded on demand, if any.
    interval: Option<Interval>,
}

impl State {
    fn tid(&mut self, track: &Track) -> u32 {
        match track {
            Track::Steps => STEPS_TID,
            Track::Scheduler => SCHEDULER_TID,
            Track::SharedMemory => SHARED_MEMORY_TID,
            Track::Push { server, lane } => {
                FIRST_LANE_TID + server * TIDS_PER_SERVER + 2 * (*lane).min(49)
            }
            Track::Receive { server, lane } => {
                FIRST_LANE_TID + server * TIDS_PER_SERVER + 2 * (*lane).min(49) + 1
            }
            Track::Python(name) => match self.python_tids.get(name) {
                Some(&tid) => tid,
                None => {
                    let n = self.python_tids.len() as u32;
                    let tid = if FIRST_PYTHON_TID + n <= LAST_PYTHON_TID {
                        FIRST_PYTHON_TID + n
                    } else {
                        OVERFLOW_PYTHON_TID + n
                    };
                    self.python_tids.insert(name.clone(), tid);
                    tid
                }
            },
        }
    }
}

/// Bits of [`Tracer::recording`]: the window keeps events now.
const WINDOW: u8 = 1;
/// An interval asked for on demand keeps events now.
const INTERVAL: u8 = 2;

/// Records one worker's trace; shared by the pipeline's threads and the binding through
/// an `Arc`. See the [module documentation](self).
///
/// Two recordings may run, each into its own file and each bounded by its own
/// `max_events`: the window of steps given by the settings, and intervals asked for on
/// demand ([`Tracer::start_interval`], Horovod's `start_timeline`). An event recorded
/// while both run goes into both files.
pub struct Tracer {
    /// Which recordings keep events now ([`WINDOW`], [`INTERVAL`]): the one thing every
    /// call reads.
    recording: AtomicU8,
    anchor: Instant,
    /// Nanoseconds since the Unix epoch at `anchor`.
    anchor_wall_ns: u128,
    rank: u32,
    name: String,
    /// The window of steps to record; `None`: only intervals are recorded.
    window: Option<TraceConfig>,
    state: Mutex<State>,
}

impl std::fmt::Debug for Tracer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tracer")
            .field("window", &self.window)
            .field("recording", &self.active())
            .finish()
    }
}

impl Tracer {
    /// A tracer for worker `rank` without a window: it records only the intervals asked
    /// for ([`Tracer::start_interval`]).
    pub(crate) fn without_window(rank: u32, name: &str) -> Tracer {
        Tracer::build(None, rank, name)
    }

    /// A tracer for worker `rank` (shown as "worker {rank} ({name})") recording the window
    /// `cfg`; checks the settings and creates the directory ([`TraceConfig::prepare`]).
    pub(crate) fn new(cfg: TraceConfig, rank: u32, name: &str) -> Result<Tracer, TraceError> {
        cfg.prepare()?;
        Ok(Tracer::build(Some(cfg), rank, name))
    }

    fn build(window: Option<TraceConfig>, rank: u32, name: &str) -> Tracer {
        let (anchor, anchor_wall_ns) = anchors();
        let state = match &window {
            Some(cfg) if cfg.start_step == 0 => Window::Recording,
            Some(_) => Window::Before,
            None => Window::Closed,
        };
        Tracer {
            recording: AtomicU8::new(if state == Window::Recording {
                WINDOW
            } else {
                0
            }),
            anchor,
            anchor_wall_ns,
            rank,
            name: name.to_string(),
            window,
            state: Mutex::new(State {
                step: 0,
                step_began: anchor,
                window: state,
                buffer: Buffer::default(),
                python_tids: HashMap::new(),
                interval: None,
            }),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().expect("trace state lock")
    }

    /// Whether events are being kept now. Callers building arguments check this first.
    #[inline]
    pub fn active(&self) -> bool {
        self.recording.load(Ordering::Relaxed) != 0
    }

    /// Nanoseconds since this tracer's start on its monotonic clock: the time base of
    /// spans recorded from Python ([`Tracer::time_at`] turns it back into an `Instant`).
    pub fn now_ns(&self) -> u64 {
        u64::try_from(self.anchor.elapsed().as_nanos()).unwrap_or(u64::MAX)
    }

    /// The instant `ns` nanoseconds after this tracer's start.
    pub fn time_at(&self, ns: u64) -> Instant {
        self.anchor + Duration::from_nanos(ns)
    }

    /// Ends the current step and begins the next. Recording starts when the step count
    /// reaches `start_step` and stops `steps` steps later, when the file is written; the
    /// file is returned by the call that wrote it. An interval being recorded gets the
    /// step's slice too.
    pub fn mark_step(&self) -> Result<Option<TraceFile>, TraceError> {
        let now = Instant::now();
        let mut guard = self.lock();
        let st = &mut *guard;
        let ended = st.step;
        let began = st.step_began;
        if matches!(st.window, Window::Recording | Window::Full { .. }) {
            // Steps are drawn even past max_events: they show where recording stopped.
            st.buffer
                .push(&Track::Steps, Event::step(ended, began, now));
        }
        if let Some(interval) = &mut st.interval {
            // An interval may run for any number of steps: its steps count to its bound.
            let step = Event::step(ended, began.max(interval.began), now);
            if interval.full_at_step.is_none() && !interval.keep(&Track::Steps, step, ended) {
                self.recording.fetch_and(!INTERVAL, Ordering::Relaxed);
            }
        }
        st.step += 1;
        st.step_began = now;
        let Some(cfg) = &self.window else {
            return Ok(None);
        };
        if st.step == cfg.start_step && st.window == Window::Before {
            st.window = Window::Recording;
            self.recording.fetch_or(WINDOW, Ordering::Relaxed);
        }
        if st.step == cfg.start_step + cfg.steps && st.window != Window::Closed {
            return self.close(cfg, guard).map(Some);
        }
        Ok(None)
    }

    /// Starts recording an interval on demand into `path` (written by
    /// [`Tracer::stop_interval`]), at most `max_events` events, whatever the window does.
    /// Refused while an interval is recorded already, and when `path`'s directory does not
    /// exist (so that the failure comes now rather than when the file is written).
    pub fn start_interval(&self, path: PathBuf, max_events: usize) -> Result<(), TraceError> {
        if max_events == 0 {
            return Err(TraceError::Invalid(
                "the maximum number of trace events must be at least 1".into(),
            ));
        }
        let dir = match path.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir,
            _ => Path::new("."),
        };
        if !dir.is_dir() {
            return Err(TraceError::Write {
                source: io::Error::new(
                    io::ErrorKind::NotFound,
                    format!("its directory {} does not exist", dir.display()),
                ),
                path,
            });
        }
        let mut st = self.lock();
        if let Some(running) = &st.interval {
            return Err(TraceError::Invalid(format!(
                "a trace of an interval is being recorded already, into {}: stop it first",
                running.path.display()
            )));
        }
        st.interval = Some(Interval {
            path,
            max_events,
            began: Instant::now(),
            began_step: st.step,
            buffer: Buffer::default(),
            full_at_step: None,
        });
        self.recording.fetch_or(INTERVAL, Ordering::Relaxed);
        Ok(())
    }

    /// Stops recording the interval begun by [`Tracer::start_interval`] and writes its
    /// file; returns it. Nothing when no interval is being recorded.
    pub fn stop_interval(&self) -> Result<Option<TraceFile>, TraceError> {
        let mut st = self.lock();
        let Some(interval) = st.interval.take() else {
            return Ok(None);
        };
        self.recording.fetch_and(!INTERVAL, Ordering::Relaxed);
        let step = st.step;
        drop(st);
        let stopped = Instant::now();
        let Interval {
            path,
            max_events,
            began,
            began_step,
            buffer,
            full_at_step,
        } = interval;
        let steps = if began_step == step {
            format!("step {step}")
        } else {
            format!("steps {began_step} to {step}")
        };
        let seconds = stopped.saturating_duration_since(began).as_secs_f64();
        let note = match full_at_step {
            None => format!("an interval of {seconds:.3} s recorded on demand, during {steps}"),
            Some(at) => format!(
                "an interval recorded on demand, during {steps}, only until max_events \
                 ({max_events}) was reached during step {at}"
            ),
        };
        let Buffer { mut events, tracks } = buffer;
        events.sort_by_key(|e| e.at);
        let meta = serde_json::json!({
            "sumflow_trace": FORMAT_VERSION,
            "rank": self.rank,
            "worker": self.name,
            "interval": {"start_step": began_step, "end_step": step, "seconds": seconds},
            "recorded": note,
            "events": events.len(),
            "max_events": max_events,
            "truncated_at_step": full_at_step,
            "clock": CLOCK,
            // Horovod's timeline field: when recording began.
            "start_time_since_epoch_in_micros": u64::try_from(self.wall_ns(began) / 1000)
                .unwrap_or(u64::MAX),
        });
        let file = self.save(path, &tracks, &events, &meta, note)?;
        info!("{file}");
        Ok(Some(file))
    }

    /// Records a slice from `start` to `end` on `track`.
    pub fn span(
        &self,
        track: Track,
        name: impl Into<Cow<'static, str>>,
        start: Instant,
        end: Instant,
        args: &[(&str, Arg<'_>)],
    ) {
        if self.active() {
            let dur = end.saturating_duration_since(start);
            self.record(Kind::Span, track, name.into(), start, dur, args);
        }
    }

    /// Records a moment on `track`: a decision, a switch of settings.
    pub fn instant(
        &self,
        track: Track,
        name: impl Into<Cow<'static, str>>,
        at: Instant,
        args: &[(&str, Arg<'_>)],
    ) {
        if self.active() {
            self.record(Kind::Instant, track, name.into(), at, Duration::ZERO, args);
        }
    }

    /// Records the values of counter `name` (a track of its own, one line per value:
    /// bytes in flight, credit left) from `at` until its next record.
    pub(crate) fn counter(
        &self,
        name: impl Into<Cow<'static, str>>,
        at: Instant,
        values: &[(&str, f64)],
    ) {
        if self.active() {
            let args: Vec<(&str, Arg<'_>)> =
                values.iter().map(|&(k, v)| (k, Arg::Float(v))).collect();
            self.record(
                Kind::Counter,
                Track::Scheduler,
                name.into(),
                at,
                Duration::ZERO,
                &args,
            );
        }
    }

    /// Writes what the window recorded if it began but did not end (the job stopped
    /// early), or a file explaining why nothing was recorded if it never began; returns
    /// it. Nothing when there is no window or its file was already written. An interval
    /// being recorded is not affected ([`Tracer::stop_interval`] writes it).
    pub fn flush(&self) -> Result<Option<TraceFile>, TraceError> {
        let Some(cfg) = &self.window else {
            return Ok(None);
        };
        let st = self.lock();
        if st.window == Window::Closed {
            return Ok(None);
        }
        self.close(cfg, st).map(Some)
    }

    fn record(
        &self,
        kind: Kind,
        track: Track,
        name: Cow<'static, str>,
        at: Instant,
        dur: Duration,
        args: &[(&str, Arg<'_>)],
    ) {
        let args = (!args.is_empty()).then(|| args_json(args));
        let mut guard = self.lock();
        let st = &mut *guard;
        // Either recording may have stopped between the caller's check and this lock.
        let to_window = st.window == Window::Recording;
        let to_interval = st
            .interval
            .as_ref()
            .is_some_and(|i| i.full_at_step.is_none());
        if !to_window && !to_interval {
            return;
        }
        let event = Event {
            kind,
            tid: st.tid(&track),
            cat: track.category(),
            name,
            at,
            dur,
            args,
        };
        let (for_window, for_interval) = match (to_window, to_interval) {
            (true, true) => (Some(event.clone()), Some(event)),
            (true, false) => (Some(event), None),
            (false, _) => (None, Some(event)),
        };
        if let (Some(event), Some(interval)) = (for_interval, &mut st.interval) {
            if !interval.keep(&track, event, st.step) {
                self.recording.fetch_and(!INTERVAL, Ordering::Relaxed);
            }
        }
        let (Some(event), Some(cfg)) = (for_window, &self.window) else {
            return;
        };
        if st.buffer.events.len() >= cfg.max_events {
            let at_step = st.step;
            st.window = Window::Full { at_step };
            self.recording.fetch_and(!WINDOW, Ordering::Relaxed);
            warn!(
                max_events = cfg.max_events,
                step = at_step,
                "trace stopped recording: {} events kept, the most allowed \
                 (SUMFLOW_TRACE_MAX_EVENTS); the trace ends at step {at_step}",
                cfg.max_events
            );
            st.buffer
                .push(&Track::Steps, Event::stopped(cfg.max_events));
            return;
        }
        st.buffer.push(&track, event);
    }

    /// Takes the window's recording, closes it and writes the file (outside the lock).
    fn close(
        &self,
        cfg: &TraceConfig,
        mut st: MutexGuard<'_, State>,
    ) -> Result<TraceFile, TraceError> {
        let window = st.window;
        let step = st.step;
        st.window = Window::Closed;
        self.recording.fetch_and(!WINDOW, Ordering::Relaxed);
        let Buffer { mut events, tracks } = std::mem::take(&mut st.buffer);
        drop(st);
        let last = cfg.start_step + cfg.steps - 1;
        let (note, truncated_at) = match window {
            Window::Before => (
                format!(
                    "nothing recorded: the job ended during step {step}, before the window's \
                     first step {} (SUMFLOW_TRACE_START_STEP)",
                    cfg.start_step
                ),
                None,
            ),
            Window::Recording if step > last => {
                (format!("steps {} to {last}", cfg.start_step), None)
            }
            Window::Recording => (
                format!(
                    "steps {} to {}: the job stopped before the window's last step {last}",
                    cfg.start_step, step
                ),
                None,
            ),
            Window::Full { at_step } => (
                format!(
                    "steps {} to {at_step} only: max_events ({}) was reached during step {at_step}",
                    cfg.start_step, cfg.max_events
                ),
                Some(at_step),
            ),
            Window::Closed => unreachable!("a closed window is never closed again"),
        };
        events.sort_by_key(|e| e.at);
        let path = cfg.path(self.rank);
        let meta = serde_json::json!({
            "sumflow_trace": FORMAT_VERSION,
            "rank": self.rank,
            "worker": self.name,
            "window": {"start_step": cfg.start_step, "steps": cfg.steps},
            "recorded": note,
            "events": events.len(),
            "max_events": cfg.max_events,
            "truncated_at_step": truncated_at,
            "clock": CLOCK,
        });
        let file = self.save(path, &tracks, &events, &meta, note)?;
        if window == Window::Before {
            warn!("{file}");
        } else {
            info!("{file}");
        }
        Ok(file)
    }

    /// Streams the file to a temporary name (`path` + `.partial`) and renames it, so a
    /// reader never sees half.
    /// Writes the file and describes it (`note`: which steps it holds).
    fn save(
        &self,
        path: PathBuf,
        tracks: &BTreeMap<u32, (String, &'static str)>,
        events: &[Event],
        meta: &serde_json::Value,
        note: String,
    ) -> Result<TraceFile, TraceError> {
        self.write(&path, tracks, events, meta)
            .map_err(|source| TraceError::Write {
                path: path.clone(),
                source,
            })?;
        Ok(TraceFile {
            path,
            recorded: note,
            events: events.len(),
        })
    }

    fn write(
        &self,
        path: &Path,
        tracks: &BTreeMap<u32, (String, &'static str)>,
        events: &[Event],
        meta: &serde_json::Value,
    ) -> io::Result<()> {
        let mut partial = path.as_os_str().to_owned();
        partial.push(".partial");
        let tmp = PathBuf::from(partial);
        let mut w = BufWriter::new(File::create(&tmp)?);
        let (rank, name) = (self.rank, &self.name);
        let pid = pid_of(rank);
        let process = if *name == format!("worker {rank}") || name.is_empty() {
            format!("worker {rank}")
        } else {
            format!("worker {rank} ({name})")
        };
        writeln!(w, "{{\"traceEvents\":[")?;
        let mut metadata = vec![
            (0, "process_name", serde_json::json!({ "name": process })),
            (
                0,
                "process_sort_index",
                serde_json::json!({ "sort_index": rank }),
            ),
        ];
        for (&tid, (label, _)) in tracks {
            metadata.push((tid, "thread_name", serde_json::json!({ "name": label })));
            metadata.push((
                tid,
                "thread_sort_index",
                serde_json::json!({ "sort_index": tid }),
            ));
        }
        for (i, (tid, name, args)) in metadata.iter().enumerate() {
            let sep = if i == 0 { "" } else { ",\n" };
            write!(
                w,
                "{sep}{{\"ph\":\"M\",\"pid\":{pid},\"tid\":{tid},\"name\":\"{name}\",\"args\":{args}}}"
            )?;
        }
        for e in events {
            let ph = match e.kind {
                Kind::Span => "X",
                Kind::Instant => "i",
                Kind::Counter => "C",
            };
            write!(w, ",\n{{\"ph\":\"{ph}\",\"cat\":\"{}\",\"name\":", e.cat)?;
            serde_json::to_writer(&mut w, e.name.as_ref())?;
            write!(w, ",\"pid\":{pid},\"tid\":{},\"ts\":", e.tid)?;
            write_micros(&mut w, self.wall_ns(e.at))?;
            match e.kind {
                Kind::Span => {
                    write!(w, ",\"dur\":")?;
                    write_micros(&mut w, e.dur.as_nanos())?;
                }
                Kind::Instant => write!(w, ",\"s\":\"t\"")?,
                Kind::Counter => {}
            }
            if let Some(args) = &e.args {
                write!(w, ",\"args\":{args}")?;
            }
            write!(w, "}}")?;
        }
        write!(w, "\n],\n\"displayTimeUnit\":\"ms\",\n\"otherData\":")?;
        serde_json::to_writer(&mut w, meta)?;
        writeln!(w, "}}")?;
        w.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        fs::rename(&tmp, path)
    }

    /// Nanoseconds since the Unix epoch at `at`, on this worker's clock.
    fn wall_ns(&self, at: Instant) -> u128 {
        match at.checked_duration_since(self.anchor) {
            Some(after) => self.anchor_wall_ns + after.as_nanos(),
            None => self
                .anchor_wall_ns
                .saturating_sub(self.anchor.duration_since(at).as_nanos()),
        }
    }
}

/// Chrome's process id for worker `rank`: Perfetto treats pid 0 as the kernel's idle task,
/// so ranks are shifted by one (the process is named by its rank).
pub(crate) fn pid_of(rank: u32) -> u64 {
    u64::from(rank) + 1
}

fn anchors() -> (Instant, u128) {
    let anchor = Instant::now();
    let wall = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    (anchor, wall)
}

/// Writes nanoseconds as Chrome's microseconds, exactly.
fn write_micros(w: &mut impl Write, ns: u128) -> io::Result<()> {
    write!(w, "{}.{:03}", ns / 1000, ns % 1000)
}

/// The arguments as a JSON object, written directly: a map would cost an allocation per
/// key on the recording threads.
fn args_json(args: &[(&str, Arg<'_>)]) -> Box<str> {
    let mut out = Vec::with_capacity(2 + 24 * args.len());
    out.push(b'{');
    for (i, &(key, value)) in args.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        // Writing into a Vec cannot fail, and strings and finite numbers always serialize.
        let _ = serde_json::to_writer(&mut out, key);
        out.push(b':');
        let _ = match value {
            Arg::Int(v) => serde_json::to_writer(&mut out, &v),
            Arg::Uint(v) => serde_json::to_writer(&mut out, &v),
            Arg::Float(v) if v.is_finite() => serde_json::to_writer(&mut out, &v),
            // Not JSON numbers: shown as null.
            Arg::Float(_) => serde_json::to_writer(&mut out, &()),
            Arg::Str(v) => serde_json::to_writer(&mut out, v),
        };
    }
    out.push(b'}');
    String::from_utf8(out)
        .expect("serde_json writes UTF-8")
        .into_boxed_str()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;

    fn temp_dir(test: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("sumflow-trace-test-{}-{test}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        dir
    }

    fn config(test: &str, start_step: u64, steps: u64, max_events: usize) -> TraceConfig {
        TraceConfig {
            dir: temp_dir(test),
            start_step,
            steps,
            max_events,
        }
    }

    fn read(path: &Path) -> Value {
        serde_json::from_str(&fs::read_to_string(path).unwrap()).unwrap()
    }

    fn events<'a>(trace: &'a Value, ph: &str) -> Vec<&'a Value> {
        trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == ph)
            .collect()
    }

    fn names(trace: &Value, ph: &str) -> Vec<String> {
        events(trace, ph)
            .iter()
            .map(|e| e["name"].as_str().unwrap().to_string())
            .collect()
    }

    /// One span named after the current step on a Python track.
    fn span_now(t: &Tracer, name: &str) {
        let now = Instant::now();
        t.span(
            Track::Python("loop".into()),
            name.to_string(),
            now,
            now,
            &[],
        );
    }

    #[test]
    fn records_only_the_window_and_writes_when_it_ends() {
        let t = Tracer::new(config("window", 2, 3, 1000), 1, "worker 1").unwrap();
        let mut written = Vec::new();
        for step in 0..8 {
            assert_eq!(t.active(), (2..5).contains(&step), "step {step}");
            span_now(&t, &format!("work {step}"));
            if let Some(f) = t.mark_step().unwrap() {
                written.push((step, f.path));
            }
        }
        let path = t.window.as_ref().unwrap().path(1);
        assert_eq!(written, vec![(4, path.clone())]);
        let trace = read(&path);
        let spans = names(&trace, "X");
        assert_eq!(
            spans,
            ["step 2", "work 2", "step 3", "work 3", "step 4", "work 4"],
            "sorted by time; a step's slice starts before its work"
        );
        assert_eq!(trace["otherData"]["recorded"], "steps 2 to 4");
        assert_eq!(trace["otherData"]["events"], 6);
        assert_eq!(t.flush().unwrap(), None, "already written");
        fs::remove_dir_all(&t.window.as_ref().unwrap().dir).unwrap();
    }

    #[test]
    fn a_window_from_step_zero_records_from_the_start() {
        let t = Tracer::new(config("zero", 0, 1, 1000), 0, "w").unwrap();
        assert!(t.active());
        span_now(&t, "declare");
        let path = t
            .mark_step()
            .unwrap()
            .expect("the one step ended the window")
            .path;
        assert!(!t.active());
        assert_eq!(names(&read(&path), "X"), ["step 0", "declare"]);
        fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn stops_at_max_events_and_says_so() {
        let t = Tracer::new(config("bounded", 0, 3, 4), 0, "worker 0").unwrap();
        for i in 0..10 {
            span_now(&t, &format!("e{i}"));
        }
        assert!(!t.active(), "recording stopped at the bound");
        t.mark_step().unwrap();
        span_now(&t, "after");
        t.mark_step().unwrap();
        let path = t.mark_step().unwrap().expect("window end").path;
        let trace = read(&path);
        assert_eq!(
            names(&trace, "X"),
            ["step 0", "e0", "e1", "e2", "e3", "step 1", "step 2"]
        );
        let stop = names(&trace, "i");
        assert_eq!(stop, ["trace stopped: max_events (4) reached"]);
        assert_eq!(trace["otherData"]["truncated_at_step"], 0);
        assert_eq!(
            trace["otherData"]["recorded"],
            "steps 0 to 0 only: max_events (4) was reached during step 0"
        );
        fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn writes_valid_chrome_json_with_named_sorted_tracks() {
        let t = Tracer::new(config("json", 0, 1, 1000), 3, "trainer \"a\"\n").unwrap();
        let t0 = Instant::now();
        let t1 = t0 + Duration::from_micros(1500);
        t.span(
            Track::Push { server: 1, lane: 2 },
            "push",
            t0,
            t1,
            &[
                ("tensor", "fc.weight".into()),
                ("bytes", 4096u64.into()),
                ("prio", (-3i64).into()),
            ],
        );
        t.span(Track::Receive { server: 1, lane: 2 }, "pull", t0, t1, &[]);
        t.instant(
            Track::Scheduler,
            "admit",
            t1,
            &[
                ("credit", 0.5.into()),
                ("rate", f64::NAN.into()),
                ("why \"q\"", "a\nb".into()),
            ],
        );
        t.counter("in flight", t1, &[("bytes", 4096.0)]);
        t.span(Track::Python("backward".into()), "layer \"x\"", t0, t1, &[]);
        let file = t.mark_step().unwrap().unwrap();
        assert_eq!(file.recorded, "steps 0 to 0");
        let path = file.path;
        assert_eq!(path.file_name().unwrap(), "sumflow-trace-rank3.json");
        let trace = read(&path);

        let meta = events(&trace, "M");
        let value = |name: &str, tid: u64| {
            meta.iter()
                .find(|e| e["name"] == name && e["tid"] == tid)
                .map(|e| e["args"].clone())
        };
        assert_eq!(
            value("process_name", 0).unwrap()["name"],
            "worker 3 (trainer \"a\"\n)"
        );
        assert!(meta.iter().all(|e| e["pid"] == 4), "pid = rank + 1");
        let thread = |label: &str| {
            meta.iter()
                .find(|e| e["name"] == "thread_name" && e["args"]["name"] == label)
                .map(|e| e["tid"].as_u64().unwrap())
                .unwrap_or_else(|| panic!("no track {label}"))
        };
        let order = [
            thread("steps"),
            thread("backward"),
            thread("scheduler"),
            thread("push → server 1 lane 2"),
            thread("receive ← server 1 lane 2"),
        ];
        for tid in order {
            assert_eq!(value("thread_sort_index", tid).unwrap()["sort_index"], tid);
        }
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");

        let push = events(&trace, "X")
            .into_iter()
            .find(|e| e["name"] == "push")
            .unwrap();
        assert_eq!(push["cat"], "push");
        assert_eq!(push["dur"].as_f64().unwrap(), 1500.0);
        assert_eq!(push["args"]["tensor"], "fc.weight");
        assert_eq!(push["args"]["bytes"], 4096);
        assert_eq!(push["args"]["prio"], -3);
        let wall_us = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap()
            .as_micros() as f64;
        let ts = push["ts"].as_f64().unwrap();
        assert!(
            (wall_us - ts).abs() < 60e6,
            "ts {ts} is wall-clock microseconds ({wall_us})"
        );
        let admit = &events(&trace, "i")[0];
        assert_eq!(
            (admit["s"].as_str(), admit["args"]["credit"].as_f64()),
            (Some("t"), Some(0.5))
        );
        // Epoch microseconds read as f64 keep a quarter of a microsecond.
        assert!((admit["ts"].as_f64().unwrap() - ts - 1500.0).abs() <= 0.5);
        assert!(admit["args"]["rate"].is_null());
        assert_eq!(admit["args"]["why \"q\""], "a\nb");
        let counter = &events(&trace, "C")[0];
        assert_eq!(
            (counter["name"].as_str(), counter["args"]["bytes"].as_f64()),
            (Some("in flight"), Some(4096.0))
        );
        assert!(names(&trace, "X").contains(&"layer \"x\"".to_string()));
        assert_eq!(trace["otherData"]["rank"], 3);
        fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn flush_writes_a_window_cut_short_once() {
        let t = Tracer::new(config("flush", 1, 10, 1000), 0, "worker 0").unwrap();
        t.mark_step().unwrap();
        span_now(&t, "work");
        t.mark_step().unwrap();
        let path = t.flush().unwrap().expect("the window began").path;
        let trace = read(&path);
        assert_eq!(names(&trace, "X"), ["step 1", "work"]);
        assert_eq!(
            trace["otherData"]["recorded"],
            "steps 1 to 2: the job stopped before the window's last step 10"
        );
        assert!(!t.active());
        assert_eq!(t.flush().unwrap(), None);
        fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn flush_before_the_window_explains_the_empty_file() {
        let t = Tracer::new(config("never", 10, 5, 1000), 0, "worker 0").unwrap();
        t.mark_step().unwrap();
        span_now(&t, "work");
        let file = t.flush().unwrap().unwrap();
        assert_eq!(
            file.to_string(),
            format!(
                "trace {}: nothing recorded: the job ended during step 1, before the \
                 window's first step 10 (SUMFLOW_TRACE_START_STEP), 0 events",
                file.path.display()
            )
        );
        let path = file.path;
        let trace = read(&path);
        assert!(events(&trace, "X").is_empty());
        assert_eq!(
            trace["otherData"]["recorded"],
            "nothing recorded: the job ended during step 1, before the window's first step 10 \
             (SUMFLOW_TRACE_START_STEP)"
        );
        fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }

    #[test]
    fn a_tracer_without_window_records_nothing_unless_asked() {
        let t = Tracer::without_window(0, "w");
        assert!(!t.active() && t.window.is_none());
        span_now(&t, "x");
        assert_eq!(t.mark_step().unwrap(), None);
        assert_eq!(t.flush().unwrap(), None);
    }

    #[test]
    fn an_interval_is_recorded_on_demand_into_a_file_of_its_own() {
        let dir = temp_dir("interval");
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("timeline.json");
        let t = Tracer::without_window(2, "w");
        span_now(&t, "before");
        t.mark_step().unwrap();
        t.start_interval(path.clone(), 1000).unwrap();
        assert!(t.active());
        span_now(&t, "during 1");
        t.mark_step().unwrap();
        span_now(&t, "during 2");
        t.instant(Track::Scheduler, "decision", Instant::now(), &[]);
        let file = t
            .stop_interval()
            .unwrap()
            .expect("an interval was recorded");
        assert!(!t.active());
        span_now(&t, "after");
        assert_eq!(t.stop_interval().unwrap(), None, "already written");
        assert_eq!(file.path, path);
        assert!(
            file.recorded.starts_with("an interval of ")
                && file
                    .recorded
                    .ends_with(" s recorded on demand, during steps 1 to 2"),
            "{}",
            file.recorded
        );
        let trace = read(&path);
        assert_eq!(names(&trace, "X"), ["step 1", "during 1", "during 2"]);
        assert_eq!(names(&trace, "i"), ["decision"]);
        let meta = &trace["otherData"];
        assert_eq!(meta["rank"], 2);
        assert_eq!(meta["interval"]["start_step"], 1);
        assert_eq!(meta["interval"]["end_step"], 2);
        assert_eq!(meta["events"], 4);
        assert!(meta["truncated_at_step"].is_null());
        let start = meta["start_time_since_epoch_in_micros"].as_f64().unwrap();
        let step = &events(&trace, "X")[0];
        // The step began before the interval: its slice starts with the interval.
        assert!(
            (step["ts"].as_f64().unwrap() - start).abs() <= 1.0,
            "{step} {start}"
        );
        assert!(!dir.join("timeline.json.partial").exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_interval_and_the_window_record_at_once_into_their_own_files() {
        let cfg = config("both", 1, 1, 1000);
        let dir = cfg.dir.clone();
        let t = Tracer::new(cfg, 0, "w").unwrap();
        let path = dir.join("timeline.json");
        t.start_interval(path.clone(), 1000).unwrap();
        span_now(&t, "interval only");
        t.mark_step().unwrap();
        span_now(&t, "both");
        let window = t
            .mark_step()
            .unwrap()
            .expect("the window's one step ended")
            .path;
        assert!(
            t.active(),
            "the interval still records after the window closed"
        );
        span_now(&t, "interval again");
        t.stop_interval().unwrap().unwrap();
        assert_eq!(names(&read(&window), "X"), ["step 1", "both"]);
        assert_eq!(
            names(&read(&path), "X"),
            [
                "step 0",
                "interval only",
                "step 1",
                "both",
                "interval again"
            ],
            "sorted by time; step 0 began before the interval and is drawn from its start"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_interval_stops_at_its_max_events_and_says_so() {
        let dir = temp_dir("interval-bounded");
        fs::create_dir_all(&dir).unwrap();
        let t = Tracer::without_window(0, "w");
        t.start_interval(dir.join("t.json"), 3).unwrap();
        for i in 0..10 {
            span_now(&t, &format!("e{i}"));
        }
        assert!(!t.active(), "recording stopped at the bound");
        t.mark_step().unwrap();
        let file = t.stop_interval().unwrap().unwrap();
        assert_eq!(
            file.recorded,
            "an interval recorded on demand, during steps 0 to 1, only until max_events (3) \
             was reached during step 0"
        );
        let trace = read(&file.path);
        assert_eq!(names(&trace, "X"), ["e0", "e1", "e2"]);
        assert_eq!(
            names(&trace, "i"),
            ["trace stopped: max_events (3) reached"]
        );
        assert_eq!(trace["otherData"]["truncated_at_step"], 0);
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn an_interval_is_refused_while_one_runs_or_without_its_directory() {
        let dir = temp_dir("interval-refused");
        fs::create_dir_all(&dir).unwrap();
        let t = Tracer::without_window(0, "w");
        let e = t.start_interval(dir.join("t.json"), 0).unwrap_err();
        assert!(matches!(e, TraceError::Invalid(_)), "{e}");
        let e = t
            .start_interval(dir.join("missing").join("t.json"), 10)
            .unwrap_err();
        assert!(
            matches!(e, TraceError::Write { .. }) && e.to_string().contains("does not exist"),
            "{e}"
        );
        assert!(!t.active());
        t.start_interval(dir.join("a.json"), 10).unwrap();
        let e = t.start_interval(dir.join("b.json"), 10).unwrap_err();
        assert!(
            e.to_string().contains("being recorded already, into"),
            "{e}"
        );
        assert!(t.stop_interval().unwrap().is_some());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn bad_settings_are_refused() {
        for (cfg, want) in [
            (config("bad", 0, 0, 1), "steps must be at least 1"),
            (config("bad", 0, 1, 0), "events must be at least 1"),
            (config("bad", u64::MAX, 2, 1), "overflows"),
        ] {
            let e = Tracer::new(cfg, 0, "w").unwrap_err().to_string();
            assert!(e.contains(want), "{e}");
        }
        let file = temp_dir("file");
        fs::create_dir_all(file.parent().unwrap()).unwrap();
        fs::write(&file, "").unwrap();
        let e = Tracer::new(TraceConfig::new(file.join("sub")), 0, "w").unwrap_err();
        assert!(matches!(e, TraceError::Directory { .. }), "{e}");
        fs::remove_file(&file).unwrap();
    }

    #[test]
    fn events_from_many_threads_all_land() {
        let t = std::sync::Arc::new(Tracer::new(config("threads", 0, 1, 100_000), 0, "w").unwrap());
        let threads: Vec<_> = (0..4u32)
            .map(|lane| {
                let t = std::sync::Arc::clone(&t);
                std::thread::spawn(move || {
                    for i in 0..500u64 {
                        let now = Instant::now();
                        t.span(
                            Track::Push { server: 0, lane },
                            "push",
                            now,
                            now,
                            &[("i", i.into())],
                        );
                    }
                })
            })
            .collect();
        for th in threads {
            th.join().unwrap();
        }
        let path = t.mark_step().unwrap().unwrap().path;
        assert_eq!(events(&read(&path), "X").len(), 4 * 500 + 1);
        fs::remove_dir_all(path.parent().unwrap()).unwrap();
    }
}
