//! The trace recorder's Python side: its settings from keyword arguments, spans from
//! Python, and its errors as exceptions.

use std::path::PathBuf;

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyString};
use sumflow_comm::trace::{Arg, TraceConfig, TraceError, TraceFile, Tracer, Track};

use crate::errors::{to_py_err, ErrorKind};

pub fn py_err(py: Python<'_>, e: TraceError) -> PyErr {
    let kind = match e {
        TraceError::Invalid(_) => ErrorKind::Invalid,
        TraceError::Directory { .. } | TraceError::Write { .. } => ErrorKind::Io,
    };
    to_py_err(py, kind, e.to_string())
}

/// The trace settings from the constructor's keywords: tracing is on when `dir` is given;
/// the others default to [`TraceConfig::new`]'s window.
pub fn config(
    dir: Option<PathBuf>,
    start_step: Option<u64>,
    steps: Option<u64>,
    max_events: Option<usize>,
) -> PyResult<Option<TraceConfig>> {
    let Some(dir) = dir else {
        if start_step.is_some() || steps.is_some() || max_events.is_some() {
            return Err(PyValueError::new_err(
                "trace_start_step, trace_steps and trace_max_events need trace_dir, the \
                 directory the trace is written to",
            ));
        }
        return Ok(None);
    };
    let mut cfg = TraceConfig::new(dir);
    cfg.start_step = start_step.unwrap_or(cfg.start_step);
    cfg.steps = steps.unwrap_or(cfg.steps);
    cfg.max_events = max_events.unwrap_or(cfg.max_events);
    Ok(Some(cfg))
}

/// A written trace as Python sees it: (path, which steps it holds or why none).
pub fn written(file: Option<TraceFile>) -> Option<(String, String)> {
    file.map(|f| (f.path.display().to_string(), f.recorded))
}

/// An owned argument value from Python; `Arg` borrows from it.
enum Value {
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(String),
}

/// A Python-side event's arguments: ints, floats and strings as they are, booleans and
/// anything else as their `str()`.
fn values(args: Option<&Bound<'_, PyDict>>) -> PyResult<Vec<(String, Value)>> {
    let Some(args) = args else {
        return Ok(Vec::new());
    };
    args.iter()
        .map(|(k, v)| {
            if !k.is_instance_of::<PyString>() {
                return Err(PyTypeError::new_err(format!(
                    "trace argument names must be str, not {}",
                    k.repr()?
                )));
            }
            let key: String = k.extract()?;
            let value = if v.is_instance_of::<PyBool>() {
                Value::Str(v.str()?.to_string())
            } else if v.is_instance_of::<PyInt>() {
                match v.extract::<i64>() {
                    Ok(i) => Value::Int(i),
                    Err(_) => match v.extract::<u64>() {
                        Ok(u) => Value::Uint(u),
                        Err(_) => Value::Str(v.str()?.to_string()),
                    },
                }
            } else if v.is_instance_of::<PyFloat>() {
                Value::Float(v.extract()?)
            } else {
                Value::Str(v.str()?.to_string())
            };
            Ok((key, value))
        })
        .collect()
}

fn track(name: &str) -> PyResult<Track> {
    if name.is_empty() {
        return Err(PyValueError::new_err("a trace track needs a name"));
    }
    Ok(Track::Python(name.to_string()))
}

/// Records a span from Python: `start` and `end` are [`Tracer::now_ns`] readings.
pub fn span(
    tracer: &Tracer,
    track_name: &str,
    name: &str,
    start: u64,
    end: u64,
    args: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    if end < start {
        return Err(PyValueError::new_err(format!(
            "trace span '{name}' ends ({end} ns) before it starts ({start} ns)"
        )));
    }
    if !tracer.active() {
        return Ok(());
    }
    let owned = values(args)?;
    tracer.span(
        track(track_name)?,
        name.to_string(),
        tracer.time_at(start),
        tracer.time_at(end),
        &borrowed(&owned),
    );
    Ok(())
}

/// Records an instant from Python at `at`, a [`Tracer::now_ns`] reading (now if `None`).
pub fn instant(
    tracer: &Tracer,
    track_name: &str,
    name: &str,
    at: Option<u64>,
    args: Option<&Bound<'_, PyDict>>,
) -> PyResult<()> {
    if !tracer.active() {
        return Ok(());
    }
    let owned = values(args)?;
    let at = tracer.time_at(at.unwrap_or_else(|| tracer.now_ns()));
    tracer.instant(track(track_name)?, name.to_string(), at, &borrowed(&owned));
    Ok(())
}

fn borrowed(owned: &[(String, Value)]) -> Vec<(&str, Arg<'_>)> {
    owned
        .iter()
        .map(|(k, v)| {
            let arg = match v {
                Value::Int(i) => Arg::Int(*i),
                Value::Uint(u) => Arg::Uint(*u),
                Value::Float(f) => Arg::Float(*f),
                Value::Str(s) => Arg::Str(s),
            };
            (k.as_str(), arg)
        })
        .collect()
}
