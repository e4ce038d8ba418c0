//! The core's defaults as module constants of `sumflow._core`, so that Python
//! (`sumflow.settings`, the launcher, the docs' table of settings) never writes a default
//! of its own: each lives once, in the crate that uses it.

use pyo3::prelude::*;
use pyo3::types::PyTuple;
use sumflow_comm::trace;
use sumflow_plan::{lanes, partition, scheduler};
use sumflow_wire::timing;

/// Adds the `DEFAULT_*` and `MAX_*` constants to the module `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add(
        "DEFAULT_PARTITION_BYTES",
        partition::DEFAULT_PARTITION_BYTES,
    )?;
    m.add(
        "DEFAULT_SCHEDULER",
        scheduler::SchedulerKind::default().name(),
    )?;
    let names = scheduler::SchedulerKind::ALL.map(scheduler::SchedulerKind::name);
    m.add("SCHEDULERS", PyTuple::new(m.py(), names)?)?;
    m.add(
        "DEFAULT_PROPHET_STAGE_FACTOR",
        scheduler::prophet::ProphetConfig::default().stage_factor,
    )?;
    m.add(
        "DEFAULT_CREDIT_PARTITIONS",
        scheduler::DEFAULT_CREDIT_PARTITIONS,
    )?;
    m.add(
        "DEFAULT_WINDOW_PARTITIONS",
        scheduler::DEFAULT_WINDOW_PARTITIONS,
    )?;
    m.add(
        "DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS",
        scheduler::DEFAULT_WINDOW_PARTITIONS_SEVERAL_WORKERS,
    )?;
    m.add("MAX_CPU_SERVER_CONNECTIONS", lanes::MAX)?;
    m.add(
        "DEFAULT_OPERATION_TIMEOUT_S",
        timing::DEFAULT_OPERATION_TIMEOUT.as_secs_f64(),
    )?;
    m.add(
        "DEFAULT_JOIN_TIMEOUT_S",
        timing::DEFAULT_JOIN_TIMEOUT.as_secs_f64(),
    )?;
    m.add(
        "DEFAULT_CONNECT_TIMEOUT_S",
        timing::DEFAULT_CONNECT_TIMEOUT.as_secs_f64(),
    )?;
    m.add(
        "DEFAULT_HEARTBEAT_INTERVAL_S",
        timing::DEFAULT_HEARTBEAT_INTERVAL.as_secs_f64(),
    )?;
    m.add(
        "DEFAULT_HEARTBEAT_TIMEOUT_S",
        timing::DEFAULT_HEARTBEAT_TIMEOUT.as_secs_f64(),
    )?;
    m.add(
        "DEFAULT_STALL_WARNING_S",
        timing::DEFAULT_STALL_WARNING.as_secs_f64(),
    )?;
    m.add("DEFAULT_TRACE_START_STEP", trace::DEFAULT_START_STEP)?;
    m.add("DEFAULT_TRACE_STEPS", trace::DEFAULT_STEPS)?;
    m.add("DEFAULT_TRACE_MAX_EVENTS", trace::DEFAULT_MAX_EVENTS)?;
    Ok(())
}
