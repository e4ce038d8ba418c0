//! `sumflow._core`: the Python extension module, and only the PyO3 layer. The logic lives in
//! the other crates; this crate converts arguments, releases the GIL around anything that
//! blocks, and turns Rust errors into Python exceptions ([`errors`]).
//!
//! It is built by maturin from the repository's `pyproject.toml` against the stable ABI
//! (abi3, CPython >= 3.9): one wheel for every CPython and every PyTorch release, since the
//! core sees host buffers only and never links torch.

use std::ffi::OsString;

use pyo3::prelude::*;

mod defaults;
pub mod errors;
mod owners;
mod service;
mod sim;
mod staging;
mod trace;

/// The name of the SIMD kernels the summation service would use on this CPU:
/// "avx512", "avx2+f16c" or "portable".
#[pyfunction]
fn simd_level() -> &'static str {
    sumflow_summation::SimdLevel::detect().name()
}

/// Runs the `sumflow-server` program in this process and returns its exit status.
///
/// `argv` is the argument list without the program name, as in `sys.argv[1:]`;
/// `run_server(["--help"])` prints the flags. Returns 0 after a clean stop (and for --help),
/// 1 when the server failed, 2 for bad arguments. Blocks until the server stops, with the
/// GIL released. While it runs, SIGTERM and SIGINT stop it gracefully; afterwards they no
/// longer have their default effect, so this suits a process that exits when it returns,
/// like the `sumflow-server` console script.
#[pyfunction]
fn run_server(py: Python<'_>, argv: Vec<OsString>) -> u8 {
    let args = program("sumflow-server", argv);
    py.detach(move || sumflow_summation::cli::run(args))
}

/// Runs the `sumflow-coordinator` program in this process and returns its exit status.
///
/// `argv` is the argument list without the program name, as in `sys.argv[1:]`. Returns 0
/// when the job ended cleanly (and for --help), 1 when a node failed or not every node
/// joined, 2 for bad arguments. Blocks until the job ends, with the GIL released. While it
/// runs, SIGTERM and SIGINT tell every node to shut down; afterwards they no longer have
/// their default effect, so this suits a process that exits when it returns, like the
/// `sumflow-coordinator` console script.
#[pyfunction]
fn run_coordinator(py: Python<'_>, argv: Vec<OsString>) -> u8 {
    let args = program("sumflow-coordinator", argv);
    py.detach(move || sumflow_coordinator::cli::run(args))
}

fn program(name: &str, argv: Vec<OsString>) -> Vec<OsString> {
    std::iter::once(OsString::from(name)).chain(argv).collect()
}

/// sumflow's Rust core: the summation server, the coordinator, the communication
/// service and the simulator. Use it through the `sumflow` package, which re-exports what is public.
#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    defaults::register(m)?;
    m.add_function(wrap_pyfunction!(simd_level, m)?)?;
    m.add_function(wrap_pyfunction!(run_server, m)?)?;
    m.add_function(wrap_pyfunction!(run_coordinator, m)?)?;
    m.add_function(wrap_pyfunction!(sim::simulate, m)?)?;
    m.add_class::<service::PyCommunicationService>()?;
    m.add_class::<staging::StagedSum>()?;
    errors::register(m)?;
    Ok(())
}
