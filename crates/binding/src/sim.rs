//! `sumflow._core.simulate`: the simulator (crates/sim) behind one function taking and
//! returning JSON, run with the GIL released; `sumflow.sim` builds the configuration and
//! reads the report.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use sumflow_sim::{simulate_json, Progress, SimError};

use crate::errors::{to_py_err, ErrorKind};

/// Runs a simulation described by `config` (JSON, as `sumflow.sim` writes it) and returns
/// its report as JSON. `progress`, if given, is called about once a second of a long run
/// with `(iteration, iterations, simulated_s, events, wall_s)`; an exception it raises
/// stops the run and is raised here.
#[pyfunction]
#[pyo3(signature = (config, progress=None))]
pub fn simulate(py: Python<'_>, config: String, progress: Option<Py<PyAny>>) -> PyResult<String> {
    let mut failed: Option<PyErr> = None;
    let result = py.detach(|| {
        let mut report = |p: Progress| {
            let Some(cb) = &progress else { return };
            if failed.is_some() {
                return;
            }
            Python::attach(|py| {
                let args = (p.iteration, p.iterations, p.simulated_s, p.events, p.wall_s);
                if let Err(e) = cb.call1(py, args) {
                    failed = Some(e);
                }
            });
        };
        simulate_json(&config, &mut report)
    });
    if let Some(e) = failed {
        return Err(e);
    }
    result.map_err(|e| match e {
        SimError::Stalled { .. } => to_py_err(py, ErrorKind::Other, e.to_string()),
        _ => PyValueError::new_err(e.to_string()),
    })
}
