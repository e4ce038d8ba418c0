//! Blocking clients for sumflow's summation service and coordinator: used by the tests
//! and, underneath its pipeline, by the worker's communication service.

pub mod error;

pub use error::{ClientError, Result};
