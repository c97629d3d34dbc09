//! CUDA backend: the [`Device`] trait on the driver API through `cudarc::driver::sys`
//! (feature `cuda-13000`, libcuda loaded at run time, no libcudart).
//!
//! Contexts: a [`CudaDevice`] retains the GPU's *primary* context (the one the CUDA runtime
//! uses, so user buffers and streams from `cudaMalloc`/`cudaStreamCreate` are in it).
//! [`Device::bind_thread`] makes it current on the calling thread for good (the proxy thread
//! does this once); every other method makes it current only for its own duration and then
//! restores whatever the caller had current, so calling into hoccl never changes the user's
//! current device.
//!
//! Behaviours the engine relies on (all checked by `tests/device_conformance.rs`):
//! - `alloc` is `cuMemAlloc` (exportable with `cuIpcGetMemHandle`); `allocation(p)` accepts
//!   interior pointers, reports the base, length and the driver's buffer id (a freed and
//!   reused address gets a new id) and is `InvalidArgument` for anything that is not device
//!   memory of this GPU (host memory, pinned host memory, unknown addresses).
//! - `export` fails with `InvalidArgument` for memory `cuIpcGetMemHandle` cannot export
//!   (stream-ordered pool or VMM allocations).
//! - `import` of a handle exported by *this process* returns the exporter's base pointer
//!   itself (the driver refuses `cuIpcOpenMemHandle` on its own handles); `unimport` of it is
//!   then a no-op. Handles from other processes are opened with
//!   `CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS`; importing the same handle twice returns the same
//!   pointer (driver reference count) and needs two `unimport`s.
//! - `write_value`/`wait_value_geq` are stream memory operations (no kernel). The wait is
//!   the driver's cyclic `>=`: it holds for `(flag - v) as i64 >= 0` (or `as i32` in the
//!   32-bit fallback, see `stream.rs`); with monotonic sequence numbers that is plain `>=`.
//! - Copy queues never block: `copy` and `fence` enqueue, `completed` polls events.
use super::*;
use crate::error::Error;
use cudarc::driver::sys;
use std::collections::{HashMap, HashSet};
use std::sync::Mutex;

mod driver;
pub mod fatbin;
mod enqueue_gate;
mod kernel;
mod memory;
mod probe;
mod queue;
mod graph;
mod reduce;
mod stream;

pub use driver::{current_ordinal, hardware_queues};
pub use probe::{probe, GpuInfo, Probe};
pub use queue::CudaCopyQueue;
pub use reduce::{reduce_ctas, DEFAULT_REDUCE_CTAS, MAX_REDUCE_SRCS};

use driver::{check, CtxGuard};

/// A retained primary context. Released when the last owner (device, copy queue, flag
/// slab) drops, so nothing created in it outlives it.
pub(crate) struct Context {
    dev: sys::CUdevice,
    ctx: sys::CUcontext,
    ordinal: usize,
    /// One enqueueing call at a time in this context (`enqueue_gate.rs`); None when
    /// `HOCCL_SERIAL_ENQUEUE=0`.
    enqueue_gate: Option<Arc<enqueue_gate::EnqueueGate>>,
}

// SAFETY: a CUcontext is a driver handle that may be used (made current) on any thread; the
// driver API is thread-safe.
unsafe impl Send for Context {}
// SAFETY: as above; the struct is immutable after creation.
unsafe impl Sync for Context {}

impl Context {
    /// Make this context current until the guard drops.
    pub(crate) fn enter(&self, op: &'static str) -> Result<CtxGuard> {
        CtxGuard::push(op, self.ctx)
    }

    /// Hold the context's gate across one enqueueing driver call (see `enqueue_gate.rs`).
    pub(crate) fn enqueue_gate(&self, op: &'static str) -> enqueue_gate::EnqueueGuard<'_> {
        match &self.enqueue_gate {
            Some(g) => g.enter(op),
            None => enqueue_gate::EnqueueGuard::none(),
        }
    }
}

/// `HOCCL_SERIAL_ENQUEUE` (Config::serial_enqueue), read from the environment once per
/// process.
fn serial_enqueue() -> Result<Option<bool>> {
    static SERIAL: std::sync::OnceLock<Result<Option<bool>>> = std::sync::OnceLock::new();
    let only = |k: &str| if k == "HOCCL_SERIAL_ENQUEUE" { std::env::var(k).ok() } else { None };
    SERIAL.get_or_init(|| crate::config::Config::default().with_env(only).map(|c| c.serial_enqueue)).clone()
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: paired with the cuDevicePrimaryCtxRetain in `CudaDevice::open`.
        let r = unsafe { sys::cuDevicePrimaryCtxRelease_v2(self.dev) };
        if r != sys::CUresult::CUDA_SUCCESS {
            log::warn!("hoccl: releasing the primary context of GPU {} failed: {}", self.ordinal, driver::error_name(r));
        }
    }
}

/// One mapping made by `import`: how many times it was imported, and whether it is this
/// process's own memory (no IPC mapping behind it).
#[derive(Clone, Copy, Debug)]
struct Import {
    count: usize,
    local: bool,
}

/// A GPU driven through the CUDA driver API. Cheap to share behind `Arc<dyn Device>`; all
/// methods take `&self` and may be called from any thread.
pub struct CudaDevice {
    ctx: Arc<Context>,
    info: GpuInfo,
    /// Streams made by `create_stream`, destroyed by `destroy_stream` or on drop.
    streams: Mutex<HashSet<u64>>,
    /// Live imports by their base address here.
    imports: Mutex<HashMap<u64, Import>>,
    /// The fatbin module (loaded on first launch) and the functions looked up in it.
    kernels: Mutex<kernel::KernelCache>,
}

/// Lock a mutex even if a panicking thread poisoned it (the data are plain tables that stay
/// consistent between statements).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl CudaDevice {
    /// Open GPU `ordinal`: load the driver if needed, retain its primary context and
    /// take the context's kernel module, loaded by the context's first device (see
    /// `kernel::SHARED_MODULES`).
    /// `NoDevice` without a driver or when `ordinal` is not a GPU of this host.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        const OP: &str = "CudaDevice::open";
        driver::init()?;
        let count = probe::device_count(OP)?;
        if ordinal >= count {
            return Err(Error::NoDevice { op: OP, what: format!("GPU {ordinal} requested, {count} present") });
        }
        let dev = probe::device_handle(OP, ordinal)?;
        let info = probe::gpu_info(OP, ordinal, dev)?;
        let enqueue_gate = enqueue_gate::for_ordinal(ordinal, serial_enqueue()?);
        let mut ctx: sys::CUcontext = std::ptr::null_mut();
        // SAFETY: dev is a valid device; ctx is a valid out-pointer. Paired with the release
        // in `Context::drop`.
        check(OP, "cuDevicePrimaryCtxRetain", unsafe { sys::cuDevicePrimaryCtxRetain(&mut ctx, dev) })?;
        let ctx = Arc::new(Context { dev, ctx, ordinal, enqueue_gate });
        if !info.stream_mem_ops_64 {
            log::info!("hoccl: GPU {ordinal} has no 64-bit stream memory operations; using the 32-bit fallback");
        }
        let d = CudaDevice {
            ctx,
            info,
            streams: Mutex::new(HashSet::new()),
            imports: Mutex::new(HashMap::new()),
            kernels: Mutex::new(kernel::KernelCache::default()),
        };
        if let Some(g) = &d.ctx.enqueue_gate {
            g.user(true);
        }
        d.register_module_user();
        Ok(d)
    }

    /// What the driver reports about this GPU.
    pub fn info(&self) -> &GpuInfo {
        &self.info
    }

    /// Multiprocessor count (to size grids).
    pub fn sm_count(&self) -> usize {
        self.info.sm_count
    }

    /// The primary context this device works in (for callers that need raw driver calls).
    pub fn cu_context(&self) -> sys::CUcontext {
        self.ctx.ctx
    }

    fn enter(&self, op: &'static str) -> Result<CtxGuard> {
        crate::device::calls::enter();
        self.ctx.enter(op)
    }
}

fn cu_stream(s: StreamHandle) -> sys::CUstream {
    s.0 as usize as sys::CUstream
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        let _guard = match self.enter("CudaDevice::drop") {
            Ok(g) => Some(g),
            Err(e) => {
                log::warn!("hoccl: {e}; cleaning up GPU {} anyway", self.info.ordinal);
                None
            }
        };
        self.drop_imports();
        for s in lock(&self.streams).drain() {
            // SAFETY: s was created by cuStreamCreate in this context and not destroyed.
            let r = unsafe { sys::cuStreamDestroy_v2(s as usize as sys::CUstream) };
            if r != sys::CUresult::CUDA_SUCCESS {
                log::warn!("hoccl: cuStreamDestroy on drop failed: {}", driver::error_name(r));
            }
        }
        self.unload_module();
        if let Some(g) = &self.ctx.enqueue_gate {
            g.user(false);
        }
    }
}

impl Device for CudaDevice {
    fn backend(&self) -> Backend {
        Backend::Cuda
    }
    fn ordinal(&self) -> usize {
        self.info.ordinal
    }
    fn queue_domain(&self) -> (Backend, usize) {
        (Backend::Cuda, self.info.ordinal)
    }
    fn name(&self) -> String {
        self.info.name.clone()
    }
    fn pci_bus_id(&self) -> String {
        self.info.pci_bus_id.clone()
    }
    fn bind_thread(&self) -> Result<()> {
        // SAFETY: the context is retained for as long as self lives.
        check("Device::bind_thread", "cuCtxSetCurrent", unsafe { sys::cuCtxSetCurrent(self.ctx.ctx) })
    }

    fn alloc(&self, len: usize) -> Result<DevPtr> {
        self.mem_alloc(len)
    }
    fn free(&self, p: DevPtr) -> Result<()> {
        self.mem_free(p)
    }
    fn allocation(&self, p: DevPtr) -> Result<Allocation> {
        self.mem_allocation(p)
    }
    fn export(&self, a: &Allocation) -> Result<ExportHandle> {
        self.mem_export(a)
    }
    fn import(&self, h: &ExportHandle, len: usize) -> Result<DevPtr> {
        self.mem_import(h, len)
    }
    fn unimport(&self, base: DevPtr, len: usize) -> Result<()> {
        self.mem_unimport(base, len)
    }
    fn alloc_flags(&self, n: usize) -> Result<FlagSlab> {
        self.mem_alloc_flags(n)
    }
    fn alloc_host(&self, len: usize) -> Result<DevPtr> {
        self.mem_alloc_host(len)
    }
    fn free_host(&self, p: DevPtr) -> Result<()> {
        self.mem_free_host(p)
    }
    fn map_host(&self, ptr: *mut u8, len: usize) -> Result<DevPtr> {
        self.mem_map_host(ptr, len)
    }
    fn unmap_host(&self, ptr: *mut u8) -> Result<()> {
        self.mem_unmap_host(ptr)
    }
    fn memory_in_use(&self) -> Result<crate::device::MemoryInUse> {
        self.mem_in_use()
    }
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        self.mem_copy_to_host(dst, src)
    }
    fn copy_from_host(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        self.mem_copy_from_host(dst, src)
    }

    fn create_stream(&self) -> Result<StreamHandle> {
        self.stream_create()
    }
    fn destroy_stream(&self, s: StreamHandle) -> Result<()> {
        self.stream_destroy(s)
    }
    fn write_value(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        self.stream_write_value(s, flag, v)
    }
    fn wait_value_geq(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        self.stream_wait_value_geq(s, flag, v)
    }
    fn mem_ops(&self, s: StreamHandle, ops: &[crate::device::MemOp]) -> Result<()> {
        self.stream_mem_ops(s, ops)
    }
    fn synchronize(&self, s: StreamHandle) -> Result<()> {
        self.stream_synchronize(s)
    }
    fn stream_query(&self, s: StreamHandle) -> Result<bool> {
        self.stream_query(s)
    }
    fn stream_capturing(&self, s: StreamHandle) -> Result<bool> {
        self.stream_is_capturing(s)
    }
    fn capture_id(&self, s: StreamHandle) -> Result<u64> {
        self.graph_capture_id(s)
    }
    fn capture_retain(&self, s: StreamHandle, on_release: Box<dyn FnOnce() + Send>) -> Result<()> {
        self.graph_capture_retain(s, on_release)
    }
    fn relaxed_capture<'a>(&self, f: &mut (dyn FnMut() -> Result<()> + 'a)) -> Result<()> {
        self.graph_relaxed(f)
    }
    fn begin_capture(&self, s: StreamHandle) -> Result<()> {
        self.graph_begin(s)
    }
    fn end_capture(&self, s: StreamHandle) -> Result<crate::device::GraphHandle> {
        self.graph_end(s)
    }
    fn graph_launch(&self, g: crate::device::GraphHandle, s: StreamHandle) -> Result<()> {
        self.graph_run(g, s)
    }
    fn graph_destroy(&self, g: crate::device::GraphHandle) -> Result<()> {
        self.graph_free(g)
    }
    fn memcpy_async(&self, s: StreamHandle, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        self.stream_memcpy(s, dst, src, len)
    }
    fn fill_pattern_async(&self, s: StreamHandle, dst: DevPtr, len: usize, seed: u64) -> Result<()> {
        self.fill_pattern(s, dst, len, seed)
    }

    fn reduce_async(&self, s: StreamHandle, dst: DevPtr, srcs: &[DevPtr], count: usize, dtype: crate::types::DataType, op: crate::reduce::RedOp) -> Result<()> {
        self.reduce_kernel_async(s, dst, srcs, count, dtype, op)
    }

    fn copy_engine_count(&self) -> usize {
        self.info.async_engines
    }
    fn create_copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        Ok(Box::new(CudaCopyQueue::new(self.ctx.clone(), self.info.stream_mem_ops_64)?))
    }

    fn as_cuda(&self) -> Option<&CudaDevice> {
        Some(self)
    }
}
