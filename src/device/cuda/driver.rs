//! The thin layer over `cudarc::driver::sys` that everything else in the CUDA backend uses:
//! loading the driver without panicking, mapping `CUresult`s to [`Error::Cuda`], and making a
//! context current for the duration of one call.
//!
//! cudarc loads libcuda lazily and *panics* when the library or a symbol is missing. Every
//! entry point of the backend therefore goes through [`init`] first, which checks the library
//! and every symbol this backend calls, then runs `cuInit(0)`; only after it succeeded does
//! any other `sys::cu*` call happen.
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::ffi::{c_char, c_int, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

/// Every driver entry point the backend calls. cudarc resolves each on first use and panics
/// if it is absent, so [`init`] checks them all up front (an old driver is then a clean
/// `NoDevice` error instead of an abort). Keep in sync with the `sys::` calls in this module.
const REQUIRED_SYMBOLS: &[&str] = &[
    "cuInit",
    "cuDriverGetVersion",
    "cuGetErrorName",
    "cuDeviceGetCount",
    "cuDeviceGet",
    "cuDeviceGetName",
    "cuDeviceGetPCIBusId",
    "cuDeviceTotalMem_v2",
    "cuDeviceGetAttribute",
    "cuDeviceCanAccessPeer",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease_v2",
    "cuCtxGetCurrent",
    "cuCtxGetDevice",
    "cuCtxSetCurrent",
    "cuMemAlloc_v2",
    "cuMemFree_v2",
    "cuMemGetAddressRange_v2",
    "cuPointerGetAttributes",
    "cuIpcGetMemHandle",
    "cuIpcOpenMemHandle_v2",
    "cuIpcCloseMemHandle",
    "cuMemHostAlloc",
    "cuMemHostGetDevicePointer_v2",
    "cuMemFreeHost",
    "cuMemcpyDtoH_v2",
    "cuMemcpyDtoHAsync_v2",
    "cuMemcpyHtoD_v2",
    "cuMemcpyAsync",
    "cuStreamCreate",
    "cuStreamDestroy_v2",
    "cuStreamSynchronize",
    "cuStreamQuery",
    "cuStreamIsCapturing",
    "cuStreamWriteValue32_v2",
    "cuStreamWaitValue32_v2",
    "cuStreamWriteValue64_v2",
    "cuStreamWaitValue64_v2",
    "cuModuleLoadData",
    "cuModuleGetFunction",
    "cuFuncSetAttribute",
    "cuModuleGetGlobal_v2",
    "cuOccupancyMaxActiveBlocksPerMultiprocessor",
    "cuModuleUnload",
    "cuLaunchKernel",
    "cuEventCreate",
    "cuEventRecord",
    "cuEventQuery",
    "cuEventDestroy_v2",
];

/// Set once libcuda is known to be loadable with every symbol above (so `cuGetErrorName`
/// may be called while formatting errors).
static LIB_READY: AtomicBool = AtomicBool::new(false);

fn load_library() -> Result<()> {
    const OP: &str = "cuda::init";
    // SAFETY: is_culib_present only tries to dlopen the candidate names and drops the handle.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::NoDevice { op: OP, what: "libcuda.so not found (no NVIDIA driver)".into() });
    }
    // SAFETY: the library was just found loadable, so culib() returns instead of panicking;
    // looking a symbol up does not call it.
    let lib = unsafe { sys::culib() };
    let missing: Vec<&str> = REQUIRED_SYMBOLS
        .iter()
        .copied()
        // SAFETY: the symbol is only looked up, never called or dereferenced here.
        .filter(|name| unsafe { lib.get::<usize>(*name) }.is_err())
        .collect();
    if !missing.is_empty() {
        return Err(Error::NoDevice {
            op: OP,
            what: format!("the NVIDIA driver is too old: missing {}", missing.join(", ")),
        });
    }
    LIB_READY.store(true, Ordering::Release);
    Ok(())
}

/// Whether libcuda has every one of `names` (optional calls of newer drivers). False when
/// the library is not loaded yet.
pub(crate) fn has_symbols(names: &[&str]) -> bool {
    if !LIB_READY.load(Ordering::Acquire) {
        return false;
    }
    // SAFETY: the library is loaded (LIB_READY); a symbol is only looked up, never called.
    let lib = unsafe { sys::culib() };
    // SAFETY: as above.
    names.iter().all(|name| unsafe { lib.get::<usize>(*name) }.is_ok())
}

/// Load libcuda and run `cuInit(0)`, once per process. Never panics: no driver, an old
/// driver or a failing `cuInit` (e.g. `CUDA_ERROR_NO_DEVICE`) is `Error::NoDevice` with the
/// reason.
pub(crate) fn init() -> Result<()> {
    static INIT: OnceLock<Result<()>> = OnceLock::new();
    INIT.get_or_init(|| {
        widen_hardware_queues();
        load_library()?;
        // SAFETY: the library and cuInit are present (checked above).
        let r = unsafe { sys::cuInit(0) };
        check("cuda::init", "cuInit", r).map_err(|e| Error::NoDevice { op: "cuda::init", what: e.to_string() })
    })
    .clone()
}

/// The ordinal of the GPU whose context is current on the calling thread (what
/// `cudaGetDevice` reports once the runtime made a context current), or `None` when no
/// context is current.
pub fn current_ordinal() -> Result<Option<usize>> {
    const OP: &str = "cuda::current_ordinal";
    init()?;
    let mut ctx: sys::CUcontext = std::ptr::null_mut();
    // SAFETY: init() succeeded; ctx is a valid out-pointer.
    check(OP, "cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut ctx) })?;
    if ctx.is_null() {
        return Ok(None);
    }
    let mut dev: sys::CUdevice = 0;
    // SAFETY: a context is current on this thread; dev is a valid out-pointer.
    check(OP, "cuCtxGetDevice", unsafe { sys::cuCtxGetDevice(&mut dev) })?;
    usize::try_from(dev).map(Some).map_err(|_| Error::internal(OP, format!("negative device ordinal {dev}")))
}

/// Hardware work queues per context that hoccl asks for (`CUDA_DEVICE_MAX_CONNECTIONS`).
pub const WANT_CONNECTIONS: u32 = 32;

/// What hoccl asks for when the process is an MPS client: the MPS server gives every
/// client context the queues it asks for out of one pool, and on an H200 a fourth client
/// asking for 32 cannot create its context, while four asking for 16 run every op
/// (docs/design.md, "Several processes on one GPU").
pub const WANT_CONNECTIONS_MPS: u32 = 16;

/// Whether an MPS control daemon serves this process: its pipe directory
/// (`CUDA_MPS_PIPE_DIRECTORY`, default `/tmp/nvidia-mps`) holds its `control` pipe.
fn mps_daemon_present() -> bool {
    let dir = std::env::var_os("CUDA_MPS_PIPE_DIRECTORY").unwrap_or_else(|| "/tmp/nvidia-mps".into());
    std::path::Path::new(&dir).join("control").exists()
}

/// The queue count to ask for: `WANT_CONNECTIONS`, or `WANT_CONNECTIONS_MPS` under MPS.
fn wanted_connections(mps: bool) -> u32 {
    if mps {
        WANT_CONNECTIONS_MPS
    } else {
        WANT_CONNECTIONS
    }
}

/// The hardware work queues a context of this process has (or will have):
/// `CUDA_DEVICE_MAX_CONNECTIONS` as the driver reads it (hoccl sets 32 when unset before CUDA
/// starts), or the driver's default of 8.
pub fn hardware_queues() -> usize {
    std::env::var("CUDA_DEVICE_MAX_CONNECTIONS").ok().and_then(|v| v.trim().parse().ok()).filter(|n| *n > 0).unwrap_or(8)
}

/// Streams are spread over a context's hardware work queues (8 by default). A stream
/// blocked in `cuStreamWaitValue` (a user stream waiting for a collective to finish) blocks
/// every stream that shares its queue, so a copy-engine queue sharing it could never run
/// and the collective would never finish. Ask for the maximum (32; 16 under MPS, whose
/// clients share one pool) before the driver makes a context, unless the application chose
/// a value itself. Too late once a context exists in the process: then the application's
/// own setting stands (see the README).
fn widen_hardware_queues() {
    const VAR: &str = "CUDA_DEVICE_MAX_CONNECTIONS";
    match std::env::var(VAR) {
        Ok(v) => {
            if v.trim().parse::<u32>().map_or(true, |n| n < 16) {
                log::warn!("hoccl: {VAR}={v}: streams waiting on collectives can block hoccl's copy queues; 32 is recommended");
            }
        }
        Err(_) => {
            // Called once, before cuInit, from the first CUDA use of the process.
            let mps = mps_daemon_present();
            if mps {
                log::info!("hoccl: an MPS daemon serves this process: {VAR}={WANT_CONNECTIONS_MPS}");
            }
            std::env::set_var(VAR, wanted_connections(mps).to_string());
        }
    }
}

/// The driver's name for `r` ("CUDA_ERROR_NOT_FOUND"); the enum's own name when the driver
/// is not loaded.
pub(crate) fn error_name(r: sys::CUresult) -> String {
    if LIB_READY.load(Ordering::Acquire) {
        let mut p: *const c_char = std::ptr::null();
        // SAFETY: the library is loaded with this symbol; p is a valid out-pointer.
        let ok = unsafe { sys::cuGetErrorName(r, &mut p) } == sys::CUresult::CUDA_SUCCESS;
        if ok && !p.is_null() {
            // SAFETY: the driver returns a static NUL-terminated string.
            return unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
        }
    }
    format!("{r:?}")
}

/// `r` as an [`Error::Cuda`] naming the public operation `op` and the driver call `call`.
pub(crate) fn cuda_error(op: &'static str, call: &'static str, r: sys::CUresult) -> Error {
    Error::Cuda { op, call, code: r as i32, name: error_name(r) }
}

/// `Ok(())` for `CUDA_SUCCESS`, otherwise the mapped error.
#[inline]
pub(crate) fn check(op: &'static str, call: &'static str, r: sys::CUresult) -> Result<()> {
    if r == sys::CUresult::CUDA_SUCCESS {
        Ok(())
    } else {
        Err(cuda_error(op, call, r))
    }
}

/// A device attribute as an integer.
pub(crate) fn attribute(op: &'static str, dev: sys::CUdevice, attr: sys::CUdevice_attribute) -> Result<i32> {
    let mut v: c_int = 0;
    // SAFETY: init() succeeded before any CUdevice exists; v is a valid out-pointer.
    check(op, "cuDeviceGetAttribute", unsafe { sys::cuDeviceGetAttribute(&mut v, attr, dev) })?;
    Ok(v)
}

/// A C string written by the driver into a fixed buffer.
pub(crate) fn string_from_buf(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// Makes a context current for the lifetime of the guard and restores the previous one on
/// drop. A no-op (two thread-local reads in the driver) when the context is already current,
/// which is the steady state on a proxy thread that called `bind_thread`.
pub(crate) struct CtxGuard {
    /// The context that was current before, when it had to be switched.
    prev: Option<sys::CUcontext>,
}

impl CtxGuard {
    pub(crate) fn push(op: &'static str, ctx: sys::CUcontext) -> Result<CtxGuard> {
        let mut cur: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: init() succeeded (a context exists); cur is a valid out-pointer.
        check(op, "cuCtxGetCurrent", unsafe { sys::cuCtxGetCurrent(&mut cur) })?;
        if cur == ctx {
            return Ok(CtxGuard { prev: None });
        }
        // SAFETY: ctx is a retained primary context, valid while its owner lives (and the
        // guard never outlives the call that holds the owner).
        check(op, "cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(ctx) })?;
        Ok(CtxGuard { prev: Some(cur) })
    }
}

impl Drop for CtxGuard {
    fn drop(&mut self) {
        if let Some(prev) = self.prev {
            // SAFETY: prev was current on this thread a moment ago (or null, which unbinds).
            let r = unsafe { sys::cuCtxSetCurrent(prev) };
            if r != sys::CUresult::CUDA_SUCCESS {
                log::warn!("hoccl: restoring the caller's CUDA context failed: {}", error_name(r));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fewer_queues_under_mps() {
        assert_eq!(wanted_connections(false), 32);
        assert_eq!(wanted_connections(true), 16);
    }

    #[test]
    fn error_mapping_names_call_and_code() {
        let e = cuda_error("Device::alloc", "cuMemAlloc_v2", sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY);
        match &e {
            Error::Cuda { op, call, code, name } => {
                assert_eq!(*op, "Device::alloc");
                assert_eq!(*call, "cuMemAlloc_v2");
                assert_eq!(*code, 2);
                assert_eq!(name, "CUDA_ERROR_OUT_OF_MEMORY");
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(e.code(), crate::error::ErrorCode::Cuda);
        assert!(check("x", "y", sys::CUresult::CUDA_SUCCESS).is_ok());
    }

    #[test]
    fn string_from_buf_stops_at_nul() {
        assert_eq!(string_from_buf(b"NVIDIA H200\0junk"), "NVIDIA H200");
        assert_eq!(string_from_buf(b"abc"), "abc");
    }
}
