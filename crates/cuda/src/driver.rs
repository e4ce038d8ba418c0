//! The few CUDA driver calls staging needs, from `libcuda.so.1` opened at run time.
//!
//! The process already has the driver loaded and initialised when it stages a CUDA tensor
//! (PyTorch made the tensor), so opening it again only finds it. Handles (contexts,
//! streams, events) are kept as `usize`: they are opaque pointers that the driver lets any
//! thread use.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};

/// `CUresult`: 0 is success.
type CuResult = c_int;
const CUDA_SUCCESS: CuResult = 0;

/// The library that holds the driver API, as every CUDA installation names it.
pub const LIBRARY: &str = "libcuda.so.1";

/// `CU_STREAM_NON_BLOCKING`: no implicit ordering with the legacy default stream.
const STREAM_NON_BLOCKING: c_uint = 0x1;
/// `CU_EVENT_BLOCKING_SYNC`: a thread that waits for the event sleeps.
const EVENT_BLOCKING_SYNC: c_uint = 0x1;
/// `CU_EVENT_DISABLE_TIMING`: the event only orders work; recording it is cheaper.
const EVENT_DISABLE_TIMING: c_uint = 0x2;

/// What a driver call or the loading of the driver failed with.
#[derive(Debug, Clone, thiserror::Error)]
pub enum DriverError {
    #[error("the CUDA driver ({LIBRARY}) could not be loaded: {0}")]
    Unavailable(String),
    #[error("CUDA driver call {call} failed: {name} ({code}): {description}")]
    Call {
        call: &'static str,
        code: i32,
        name: String,
        description: String,
    },
}

type Init = unsafe extern "C" fn(c_uint) -> CuResult;
type DeviceGet = unsafe extern "C" fn(*mut c_int, c_int) -> CuResult;
type PrimaryCtxRetain = unsafe extern "C" fn(*mut *mut c_void, c_int) -> CuResult;
type CtxGet = unsafe extern "C" fn(*mut *mut c_void) -> CuResult;
type CtxSet = unsafe extern "C" fn(*mut c_void) -> CuResult;
type Create = unsafe extern "C" fn(*mut *mut c_void, c_uint) -> CuResult;
type Destroy = unsafe extern "C" fn(*mut c_void) -> CuResult;
type EventRecord = unsafe extern "C" fn(*mut c_void, *mut c_void) -> CuResult;
type StreamWaitEvent = unsafe extern "C" fn(*mut c_void, *mut c_void, c_uint) -> CuResult;
type MemcpyDtoHAsync = unsafe extern "C" fn(*mut c_void, u64, usize, *mut c_void) -> CuResult;
type ErrorText = unsafe extern "C" fn(CuResult, *mut *const c_char) -> CuResult;

/// The driver's entry points. Each wrapper is a single driver call; the driver checks its
/// handles, so a stale one is an error, not undefined behaviour, for every handle this
/// crate makes and keeps.
#[derive(Debug)]
pub struct Driver {
    device_get: DeviceGet,
    primary_ctx_retain: PrimaryCtxRetain,
    ctx_get_current: CtxGet,
    ctx_set_current: CtxSet,
    ctx_push_current: CtxSet,
    ctx_pop_current: CtxGet,
    stream_create: Create,
    stream_destroy: Destroy,
    event_create: Create,
    event_destroy: Destroy,
    event_record: EventRecord,
    event_synchronize: Destroy,
    stream_wait_event: StreamWaitEvent,
    memcpy_dtoh_async: MemcpyDtoHAsync,
    get_error_name: ErrorText,
    get_error_string: ErrorText,
}

/// The address of `symbol` in the library `handle`, as a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of `symbol`.
unsafe fn symbol<F: Copy>(handle: *mut c_void, symbol: &str) -> Result<F, DriverError> {
    let name = CString::new(symbol).expect("symbol names hold no NUL");
    // SAFETY: `handle` came from dlopen and is never closed; `name` is NUL-terminated.
    let address = unsafe { libc::dlsym(handle, name.as_ptr()) };
    if address.is_null() {
        return Err(DriverError::Unavailable(format!(
            "it has no {symbol}: the driver is older than sumflow needs"
        )));
    }
    assert_eq!(size_of::<F>(), size_of::<*mut c_void>());
    // SAFETY: the caller promises `F` is the symbol's signature; a function pointer has
    // the size of a data pointer on every platform with dlsym (checked above).
    Ok(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&address) })
}

impl Driver {
    /// Opens the driver library and initialises the driver (a no-op where the process has
    /// done so already). Fails where the library or an entry point is missing, or where
    /// the driver finds no usable GPU.
    pub fn load() -> Result<Self, DriverError> {
        let library = CString::new(LIBRARY).expect("no NUL");
        // SAFETY: dlopen with a NUL-terminated name; the handle is never closed, so the
        // symbols stay valid for the process's life.
        let handle = unsafe { libc::dlopen(library.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns null or a NUL-terminated message owned by libc.
            let why = unsafe { libc::dlerror() };
            let why = if why.is_null() {
                "not found".to_string()
            } else {
                // SAFETY: non-null, NUL-terminated (above), read before any other dl call.
                unsafe { CStr::from_ptr(why) }
                    .to_string_lossy()
                    .into_owned()
            };
            return Err(DriverError::Unavailable(why));
        }
        // SAFETY: each type alias above is the signature cuda.h declares for the symbol
        // named with it (the `_v2` names are those cuda.h maps the plain names to).
        let driver = unsafe {
            let init: Init = symbol(handle, "cuInit")?;
            let driver = Self {
                device_get: symbol(handle, "cuDeviceGet")?,
                primary_ctx_retain: symbol(handle, "cuDevicePrimaryCtxRetain")?,
                ctx_get_current: symbol(handle, "cuCtxGetCurrent")?,
                ctx_set_current: symbol(handle, "cuCtxSetCurrent")?,
                ctx_push_current: symbol(handle, "cuCtxPushCurrent_v2")?,
                ctx_pop_current: symbol(handle, "cuCtxPopCurrent_v2")?,
                stream_create: symbol(handle, "cuStreamCreate")?,
                stream_destroy: symbol(handle, "cuStreamDestroy_v2")?,
                event_create: symbol(handle, "cuEventCreate")?,
                event_destroy: symbol(handle, "cuEventDestroy_v2")?,
                event_record: symbol(handle, "cuEventRecord")?,
                event_synchronize: symbol(handle, "cuEventSynchronize")?,
                stream_wait_event: symbol(handle, "cuStreamWaitEvent")?,
                memcpy_dtoh_async: symbol(handle, "cuMemcpyDtoHAsync_v2")?,
                get_error_name: symbol(handle, "cuGetErrorName")?,
                get_error_string: symbol(handle, "cuGetErrorString")?,
            };
            driver.check("cuInit", init(0))?;
            driver
        };
        Ok(driver)
    }

    fn check(&self, call: &'static str, code: CuResult) -> Result<(), DriverError> {
        if code == CUDA_SUCCESS {
            return Ok(());
        }
        let text = |f: ErrorText| {
            let mut s: *const c_char = std::ptr::null();
            // SAFETY: `s` is a valid out-pointer; the driver points it at a static string.
            if unsafe { f(code, &mut s) } != CUDA_SUCCESS || s.is_null() {
                return "unknown".to_string();
            }
            // SAFETY: non-null, NUL-terminated and static (the driver's own table).
            unsafe { CStr::from_ptr(s) }.to_string_lossy().into_owned()
        };
        Err(DriverError::Call {
            call,
            code,
            name: text(self.get_error_name),
            description: text(self.get_error_string),
        })
    }

    /// The primary context of device `ordinal` (the one PyTorch and the runtime API use),
    /// retained for the process's life.
    pub fn primary_context(&self, ordinal: u32) -> Result<usize, DriverError> {
        let ordinal = c_int::try_from(ordinal).map_err(|_| DriverError::Call {
            call: "cuDeviceGet",
            code: 101,
            name: "CUDA_ERROR_INVALID_DEVICE".into(),
            description: format!("no device {ordinal}"),
        })?;
        let mut device: c_int = 0;
        // SAFETY: a valid out-pointer.
        self.check("cuDeviceGet", unsafe {
            (self.device_get)(&mut device, ordinal)
        })?;
        let mut ctx: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer and a device the driver just returned.
        let code = unsafe { (self.primary_ctx_retain)(&mut ctx, device) };
        self.check("cuDevicePrimaryCtxRetain", code)?;
        Ok(ctx as usize)
    }

    /// Makes `ctx` the calling thread's current context.
    pub fn set_current(&self, ctx: usize) -> Result<(), DriverError> {
        // SAFETY: the driver validates the context handle.
        self.check("cuCtxSetCurrent", unsafe {
            (self.ctx_set_current)(ctx as *mut c_void)
        })
    }

    /// Runs `f` with `ctx` current on the calling thread, and the thread's own current
    /// context current again afterwards (a caller's thread may have another device
    /// current, which the runtime API reads from the context).
    pub fn within<T>(
        &self,
        ctx: usize,
        f: impl FnOnce() -> Result<T, DriverError>,
    ) -> Result<T, DriverError> {
        let mut current: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        self.check("cuCtxGetCurrent", unsafe {
            (self.ctx_get_current)(&mut current)
        })?;
        if current as usize == ctx {
            return f();
        }
        // SAFETY: the driver validates the context handle.
        let code = unsafe { (self.ctx_push_current)(ctx as *mut c_void) };
        self.check("cuCtxPushCurrent", code)?;
        let result = f();
        let mut popped: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer; pops the context pushed above.
        let code = unsafe { (self.ctx_pop_current)(&mut popped) };
        result.and_then(|v| self.check("cuCtxPopCurrent", code).map(|()| v))
    }

    /// A stream of the current context that does not wait for the legacy default stream.
    pub fn stream(&self) -> Result<usize, DriverError> {
        let mut stream: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        let code = unsafe { (self.stream_create)(&mut stream, STREAM_NON_BLOCKING) };
        self.check("cuStreamCreate", code)?;
        Ok(stream as usize)
    }

    /// An event of the current context, without timing; `blocking`: waiting for it sleeps.
    pub fn event(&self, blocking: bool) -> Result<usize, DriverError> {
        let flags = EVENT_DISABLE_TIMING | if blocking { EVENT_BLOCKING_SYNC } else { 0 };
        let mut event: *mut c_void = std::ptr::null_mut();
        // SAFETY: a valid out-pointer.
        self.check("cuEventCreate", unsafe {
            (self.event_create)(&mut event, flags)
        })?;
        Ok(event as usize)
    }

    /// Records `event` on `stream` (0: the legacy default stream), behind the work queued
    /// on it so far.
    pub fn record(&self, event: usize, stream: usize) -> Result<(), DriverError> {
        // SAFETY: the driver validates both handles.
        let code = unsafe { (self.event_record)(event as *mut c_void, stream as *mut c_void) };
        self.check("cuEventRecord", code)
    }

    /// Makes later work on `stream` wait, on the GPU, for `event`'s last recording.
    pub fn wait_event(&self, stream: usize, event: usize) -> Result<(), DriverError> {
        // SAFETY: the driver validates both handles.
        let code =
            unsafe { (self.stream_wait_event)(stream as *mut c_void, event as *mut c_void, 0) };
        self.check("cuStreamWaitEvent", code)
    }

    /// Queues a copy of `len` bytes from device address `src` to host address `dst` on
    /// `stream`.
    ///
    /// # Safety
    /// `dst..dst+len` must be host memory that stays allocated, and that nothing else
    /// reads or writes, until the copy completes; page-locked memory makes the copy
    /// asynchronous. `src` is checked by the driver.
    pub unsafe fn copy_to_host(
        &self,
        dst: usize,
        src: u64,
        len: usize,
        stream: usize,
    ) -> Result<(), DriverError> {
        // SAFETY: the caller's promise covers `dst`; the driver validates `src` and
        // `stream`.
        let code = unsafe {
            (self.memcpy_dtoh_async)(dst as *mut c_void, src, len, stream as *mut c_void)
        };
        self.check("cuMemcpyDtoHAsync", code)
    }

    /// Blocks until the work before `event`'s last recording is done.
    pub fn synchronize(&self, event: usize) -> Result<(), DriverError> {
        // SAFETY: the driver validates the handle.
        self.check("cuEventSynchronize", unsafe {
            (self.event_synchronize)(event as *mut c_void)
        })
    }

    /// Frees an event made by [`event`](Self::event).
    pub fn destroy_event(&self, event: usize) -> Result<(), DriverError> {
        // SAFETY: the driver validates the handle.
        self.check("cuEventDestroy", unsafe {
            (self.event_destroy)(event as *mut c_void)
        })
    }

    /// Frees a stream made by [`stream`](Self::stream), once its work is done.
    pub fn destroy_stream(&self, stream: usize) -> Result<(), DriverError> {
        // SAFETY: the driver validates the handle.
        self.check("cuStreamDestroy", unsafe {
            (self.stream_destroy)(stream as *mut c_void)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_machine_without_the_driver_gets_an_error_that_names_the_library() {
        // Where a driver is installed (a GPU machine) this loads it instead.
        match Driver::load() {
            Ok(_) => {}
            Err(DriverError::Unavailable(why)) => assert!(!why.is_empty()),
            Err(e @ DriverError::Call { .. }) => {
                // A driver without a GPU: cuInit says so.
                assert!(e.to_string().contains("cuInit"), "{e}");
            }
        }
        let e = DriverError::Unavailable("libcuda.so.1: cannot open shared object file".into());
        assert!(e.to_string().contains(LIBRARY), "{e}");
    }
}
