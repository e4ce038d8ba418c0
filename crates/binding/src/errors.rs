//! The one place where Rust errors become Python exceptions.
//!
//! Every exception sumflow raises derives from `sumflow.SumflowError` (a `RuntimeError`),
//! so `except sumflow.SumflowError` catches them all; timeouts are also the builtin
//! `TimeoutError`, so code that already handles timeouts handles sumflow's:
//!
//! Bad arguments are the builtin `ValueError`, and what the operating system refused (a
//! trace directory, a thread) the builtin `OSError`, so that they are told apart:
//!
//! ```text
//! RuntimeError
//! └── SumflowError
//!     ├── SumflowTimeoutError (also TimeoutError)  a wait ran past its timeout
//!     ├── NodeFailedError                          a worker, server or the coordinator is gone
//!     ├── DeclarationMismatchError                 workers declared a tensor differently
//!     └── ProtocolError                            a peer sent something it must not
//! ```
//!
//! Rust code says which kind an error is with [`ErrorKind`]; [`to_py_err`] picks the class.
//! The message is the Rust error's own sentence, which already names the node, tensor or
//! timeout.

use pyo3::create_exception;
use pyo3::exceptions::{PyOSError, PyRuntimeError, PyTimeoutError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyTuple, PyType};

create_exception!(
    sumflow,
    SumflowError,
    PyRuntimeError,
    "Base class of every error sumflow raises. The message names what failed."
);
create_exception!(
    sumflow,
    NodeFailedError,
    SumflowError,
    "A worker, summation server or the coordinator failed or left; the message names it \
     and says why."
);
create_exception!(
    sumflow,
    DeclarationMismatchError,
    SumflowError,
    "Workers declared the same tensor with different shapes, dtypes or names; the message \
     names the tensor and both declarations."
);
create_exception!(
    sumflow,
    ProtocolError,
    SumflowError,
    "A peer sent a message it must not send (a bug or a version mismatch); the message \
     names the peer."
);

const TIMEOUT_NAME: &str = "SumflowTimeoutError";
const TIMEOUT_DOC: &str = "A wait ran past its timeout; the message names what was awaited \
     and the timeout. Also a builtin TimeoutError.";

/// `SumflowTimeoutError(SumflowError, TimeoutError)`. `create_exception!` takes one base, so
/// this class is made with `type(name, bases, dict)` the first time it is needed.
static TIMEOUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

fn timeout_error_type(py: Python<'_>) -> PyResult<&Bound<'_, PyType>> {
    let ty = TIMEOUT_ERROR.get_or_try_init(py, || -> PyResult<Py<PyType>> {
        let bases = PyTuple::new(
            py,
            [
                py.get_type::<SumflowError>(),
                py.get_type::<PyTimeoutError>(),
            ],
        )?;
        let dict = PyDict::new(py);
        dict.set_item("__module__", "sumflow")?;
        dict.set_item("__doc__", TIMEOUT_DOC)?;
        let ty = py
            .get_type::<PyType>()
            .call1((TIMEOUT_NAME, bases, dict))?
            .cast_into::<PyType>()?;
        Ok(ty.unbind())
    })?;
    Ok(ty.bind(py))
}

/// What went wrong, as far as choosing a Python exception class goes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A wait ran past its timeout: `SumflowTimeoutError`.
    Timeout,
    /// A node failed or left the job: `NodeFailedError`.
    NodeFailed,
    /// Workers disagree about a tensor's declaration: `DeclarationMismatchError`.
    DeclarationMismatch,
    /// A peer broke the protocol: `ProtocolError`.
    Protocol,
    /// A bad argument from the caller: the builtin `ValueError`.
    Invalid,
    /// The operating system refused a file, directory or thread: the builtin `OSError`.
    Io,
    /// Anything else: `SumflowError`.
    Other,
}

/// The Python exception for an error of `kind` saying `message`.
pub fn to_py_err(py: Python<'_>, kind: ErrorKind, message: String) -> PyErr {
    match kind {
        ErrorKind::Timeout => match timeout_error_type(py) {
            Ok(ty) => PyErr::from_type(ty.clone(), message),
            // Creating the class failed (out of memory): say so rather than lose the error.
            Err(e) => e,
        },
        ErrorKind::NodeFailed => NodeFailedError::new_err(message),
        ErrorKind::DeclarationMismatch => DeclarationMismatchError::new_err(message),
        ErrorKind::Protocol => ProtocolError::new_err(message),
        ErrorKind::Invalid => PyValueError::new_err(message),
        ErrorKind::Io => PyOSError::new_err(message),
        ErrorKind::Other => SumflowError::new_err(message),
    }
}

/// Adds the exception classes to the module `m`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("SumflowError", py.get_type::<SumflowError>())?;
    m.add(TIMEOUT_NAME, timeout_error_type(py)?)?;
    m.add("NodeFailedError", py.get_type::<NodeFailedError>())?;
    m.add(
        "DeclarationMismatchError",
        py.get_type::<DeclarationMismatchError>(),
    )?;
    m.add("ProtocolError", py.get_type::<ProtocolError>())?;
    Ok(())
}
