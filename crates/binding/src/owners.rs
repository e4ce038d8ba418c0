//! The Python objects owning the buffers of operations not yet waited for, by handle.
//!
//! The binding keeps a reference to each until the operation has been waited for, so the
//! memory the pipeline threads read and write cannot be freed meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use sumflow_comm::CommError;

/// Shared by the service and its CUDA staging thread, which issues sums too.
#[derive(Debug, Clone, Default)]
pub struct Owners(Arc<Mutex<HashMap<u64, Py<PyAny>>>>);

impl Owners {
    /// Runs `start` (which starts an operation and returns its handle) and records `owner`
    /// under that handle. The lock is held across `start`, so that a wait on another
    /// thread cannot find the operation finished before its owner is recorded.
    pub fn start(
        &self,
        owner: Py<PyAny>,
        start: impl FnOnce() -> Result<u64, CommError>,
    ) -> Result<u64, CommError> {
        let mut owners = self.0.lock().expect("owners lock");
        let handle = start()?;
        owners.insert(handle, owner);
        Ok(handle)
    }

    /// Lets go of the owner of `handle`'s buffer (its operation was waited for).
    pub fn release(&self, handle: u64) {
        let owner = self.0.lock().expect("owners lock").remove(&handle);
        drop(owner);
    }

    /// Lets go of every owner (every operation has failed or finished).
    pub fn release_all(&self) {
        let owners = std::mem::take(&mut *self.0.lock().expect("owners lock"));
        drop(owners);
    }
}
