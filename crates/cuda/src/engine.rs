//! The copies to host memory through the CUDA driver.
//!
//! Per device: its primary context (PyTorch's), one side stream the copies run on (so
//! they overlap the kernels of backward, on the copy engine), and a free list of event
//! pairs reused across steps (a copy needs two: after the tensor's producer, and after
//! the copy itself).

use std::collections::HashMap;
use std::sync::Mutex;

use crate::driver::{Driver, DriverError};
use crate::stager::{CopyEngine, HostCopy};

#[derive(Debug)]
struct Device {
    ctx: usize,
    stream: usize,
    /// (produced, copied) pairs not in use.
    free: Vec<(usize, usize)>,
}

/// A copy's place in the device's work: the event recorded behind the tensor's producer
/// on the caller's stream, and the one to record after the copy.
#[derive(Debug)]
pub struct Marker {
    device: u32,
    ctx: usize,
    stream: usize,
    produced: usize,
    copied: usize,
}

/// [`CopyEngine`] through the CUDA driver.
#[derive(Debug)]
pub struct DriverEngine {
    driver: Driver,
    devices: Mutex<HashMap<u32, Device>>,
}

impl DriverEngine {
    pub fn new(driver: Driver) -> Self {
        Self {
            driver,
            devices: Mutex::new(HashMap::new()),
        }
    }

    /// Marks the point of `stream` (a `cudaStream_t` of device `device`, 0: the legacy
    /// default stream) that a tensor is complete at: its copy waits for the work queued
    /// there so far. Called on the caller's thread, which it leaves with its own current
    /// context.
    pub fn mark(&self, device: u32, stream: usize) -> Result<Marker, DriverError> {
        let mut devices = self.devices.lock().expect("devices lock");
        let d = match devices.entry(device) {
            std::collections::hash_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::hash_map::Entry::Vacant(e) => {
                let ctx = self.driver.primary_context(device)?;
                let side = self.driver.within(ctx, || self.driver.stream())?;
                e.insert(Device {
                    ctx,
                    stream: side,
                    free: Vec::new(),
                })
            }
        };
        let ctx = d.ctx;
        let (produced, copied) = match d.free.pop() {
            Some(pair) => pair,
            None => self.driver.within(ctx, || {
                let produced = self.driver.event(false)?;
                match self.driver.event(true) {
                    Ok(copied) => Ok((produced, copied)),
                    Err(e) => {
                        let _ = self.driver.destroy_event(produced);
                        Err(e)
                    }
                }
            })?,
        };
        let marker = Marker {
            device,
            ctx,
            stream: d.stream,
            produced,
            copied,
        };
        drop(devices);
        match self
            .driver
            .within(ctx, || self.driver.record(produced, stream))
        {
            Ok(()) => Ok(marker),
            Err(e) => {
                self.release(marker);
                Err(e)
            }
        }
    }
}

impl CopyEngine for DriverEngine {
    type Marker = Marker;

    fn start(&self, m: &Marker, copy: &HostCopy) -> Result<(), DriverError> {
        // Only the staging thread starts copies: the context it leaves current is its own.
        self.driver.set_current(m.ctx)?;
        self.driver.wait_event(m.stream, m.produced)?;
        // SAFETY: `HostCopy`'s contract: the host span outlives the copy and nothing else
        // touches it until the copy completes (the stager waits for `copied` before it
        // hands the span on).
        unsafe {
            self.driver
                .copy_to_host(copy.dst, copy.src, copy.len, m.stream)
        }?;
        self.driver.record(m.copied, m.stream)
    }

    fn wait(&self, m: &Marker) -> Result<(), DriverError> {
        self.driver.synchronize(m.copied)
    }

    fn release(&self, m: Marker) {
        // An event may be recorded again once its last recording's waiters have queued
        // their waits (cuStreamWaitEvent captures the recording at the call): both have.
        let mut devices = self.devices.lock().expect("devices lock");
        if let Some(d) = devices.get_mut(&m.device) {
            d.free.push((m.produced, m.copied));
        }
    }
}

impl Drop for DriverEngine {
    fn drop(&mut self) {
        // Every copy is done (the stager drops the engine after its last job), so the
        // stream and events are idle. Errors are ignored: at exit the driver may already
        // be shut down, which frees them anyway.
        let devices = self.devices.get_mut().expect("devices lock");
        for d in devices.values() {
            let _ = self.driver.within(d.ctx, || {
                for &(produced, copied) in &d.free {
                    let _ = self.driver.destroy_event(produced);
                    let _ = self.driver.destroy_event(copied);
                }
                self.driver.destroy_stream(d.stream)
            });
        }
    }
}
