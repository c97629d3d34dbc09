//! The memory/stream/copy backend, shaped by CUDA's own concepts so that the engine above
//! never knows which backend it drives:
//! - device memory that can be exported to another process by a handle and imported there;
//! - streams (in-order queues) that can write a 64-bit value to host-visible memory and
//!   wait until such a value is >= a target (`cuStreamWriteValue64`/`cuStreamWaitValue64`);
//! - copy-engine queues on which the proxy enqueues asynchronous copies and fences whose
//!   completion it can query without blocking.
//!
//! Backends: [`cuda`] (driver API through cudarc) and [`host`] (POSIX shared memory, worker
//! threads as copy engines, an in-order host queue as the stream).
use crate::error::Result;
use crate::reduce::RedOp;
use crate::types::DataType;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

pub mod batch;
pub mod cuda;
pub mod host;
pub mod kernels;

/// A device address: `CUdeviceptr` on CUDA, a virtual address of this process on the host
/// backend. Arithmetic on it never dereferences.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct DevPtr(pub u64);

impl DevPtr {
    pub const NULL: DevPtr = DevPtr(0);
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
    /// `self + bytes` (wrapping is a caller bug and is checked by the callers that validate
    /// user ranges).
    pub fn add(self, bytes: usize) -> DevPtr {
        DevPtr(self.0.wrapping_add(bytes as u64))
    }
}

/// A stream: a `CUstream` value on CUDA (0 is the legacy default stream), a queue id on the
/// host backend.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct StreamHandle(pub u64);

/// A captured graph with its executable graph (test support: `Device::end_capture`).
#[doc(hidden)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct GraphHandle(pub u64);

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    Cuda,
    Host,
}

/// An allocation's identity: a freed and reused address gets a new `id`, so caches keyed by
/// `(owner, id)` never serve a stale mapping.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Allocation {
    pub base: DevPtr,
    pub len: usize,
    pub id: u64,
}

/// An opaque export handle: `CUipcMemHandle` (64 bytes) on CUDA, a shared-memory object
/// name on the host backend.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct ExportHandle(pub [u8; 64]);

impl std::fmt::Debug for ExportHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ExportHandle({:02x?}..)", &self.0[..8])
    }
}

/// 64-bit flags in host memory that streams write/wait and the CPU reads/writes.
/// Invariant: `host` points to `len` 8-byte-aligned u64 words that stay valid while `_keep`
/// lives; `dev` is the same memory as the device sees it.
pub struct FlagSlab {
    host: *const AtomicU64,
    dev: DevPtr,
    len: usize,
    _keep: Box<dyn std::any::Any + Send + Sync>,
}

// SAFETY: the words are only accessed through atomics; `_keep` owns the memory and is Send+Sync.
unsafe impl Send for FlagSlab {}
// SAFETY: as above, all access is atomic.
unsafe impl Sync for FlagSlab {}

impl FlagSlab {
    /// # Safety
    /// `host` must point to `len` zero-initialised, 8-byte-aligned words that stay valid and
    /// are only accessed atomically while `keep` lives; `dev` must address the same words.
    pub unsafe fn from_raw(host: *mut u64, dev: DevPtr, len: usize, keep: Box<dyn std::any::Any + Send + Sync>) -> Self {
        FlagSlab { host: host as *const AtomicU64, dev, len, _keep: keep }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    fn word(&self, i: usize) -> &AtomicU64 {
        assert!(i < self.len, "flag index {i} out of {}", self.len);
        // SAFETY: i < len and the words live as long as self (invariant above).
        unsafe { &*self.host.add(i) }
    }
    pub fn load(&self, i: usize) -> u64 {
        self.word(i).load(Ordering::Acquire)
    }
    pub fn store(&self, i: usize, v: u64) {
        self.word(i).store(v, Ordering::Release)
    }
    /// Raise word `i` to `v` unless it already holds more (flags that only count up, when
    /// two writers may race: a proxy and a forced teardown releasing the same streams).
    pub fn raise(&self, i: usize, v: u64) {
        self.word(i).fetch_max(v, Ordering::AcqRel);
    }
    /// The device address of word `i`, for stream write/wait operations.
    pub fn dev_addr(&self, i: usize) -> DevPtr {
        assert!(i < self.len);
        self.dev.add(i * 8)
    }
}

/// One stream memory operation of a batch ([`Device::mem_ops`], [`CopyQueue::mem_ops`]):
/// the operations of [`Device::wait_value_geq`] and [`Device::write_value`] on a 64-bit
/// flag in host memory mapped for the device, with their comparison and 32-bit fallback.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MemOp {
    /// Hold the stream until the flag at `flag` is >= `value`.
    WaitGeq { flag: DevPtr, value: u64 },
    /// Write `value` to the flag once everything before it on the stream has completed.
    Write { flag: DevPtr, value: u64 },
}

/// A copy-engine queue owned by the proxy. Copies and fences execute in order; nothing here
/// blocks on the device.
pub trait CopyQueue: Send {
    /// Enqueue a copy of `len` bytes. `dst`/`src` may be local or imported peer memory.
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()>;
    /// Enqueue a fence; returns its ticket (tickets increase by one per fence from 1).
    fn fence(&mut self) -> Result<u64>;
    /// The highest ticket whose fence (and so every copy before it) has completed.
    fn completed(&mut self) -> Result<u64>;
    /// Enqueue: hold the queue until the 64-bit flag at `flag` is >= `v` (the comparison
    /// and the 32-bit fallback of [`Device::wait_value_geq`]). `flag` is host memory mapped
    /// for the device ([`Device::alloc_flags`], [`Device::map_host`]). A queue that may
    /// still wait must not be synchronized or destroyed: nothing may be queued behind a wait
    /// that never passes except what may run whenever it passes. The default refuses (a
    /// queue that cannot wait on the device).
    fn wait_geq(&mut self, flag: DevPtr, v: u64) -> Result<()> {
        let _ = (flag, v);
        Err(crate::error::Error::invalid_usage("CopyQueue::wait_geq", "this copy queue has no stream memory operations"))
    }
    /// Enqueue: write `v` to the 64-bit flag at `flag` once everything before it on the
    /// queue has completed (the copies' bytes are visible before the value is). The default
    /// refuses, as `wait_geq`'s.
    fn write_value(&mut self, flag: DevPtr, v: u64) -> Result<()> {
        let _ = (flag, v);
        Err(crate::error::Error::invalid_usage("CopyQueue::write_value", "this copy queue has no stream memory operations"))
    }
    /// Enqueue `ops` in order, as consecutive `wait_geq` / `write_value` calls would, in as
    /// few driver calls as the backend can (one `cuStreamBatchMemOp` on CUDA). On an error
    /// a prefix of `ops` may have been enqueued. The default makes one call per operation.
    fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()> {
        ops.iter().try_for_each(|op| match *op {
            MemOp::WaitGeq { flag, value } => self.wait_geq(flag, value),
            MemOp::Write { flag, value } => self.write_value(flag, value),
        })
    }
}

/// A device backend. Implementations are cheap to share (`Arc<dyn Device>`).
pub trait Device: Send + Sync + 'static {
    fn backend(&self) -> Backend;
    /// Device ordinal (GPU index; 0 on the host backend).
    fn ordinal(&self) -> usize;
    /// What shares this device's hardware queues, unique in the process while any holder
    /// of the key may still use it: a CUDA GPU's primary context (`(Cuda, ordinal)`), or one
    /// host-backend device (`(Host, a process-wide instance number, never reused)`).
    fn queue_domain(&self) -> (Backend, usize);
    /// Human-readable name and PCI bus id ("host" on the host backend).
    fn name(&self) -> String;
    fn pci_bus_id(&self) -> String;
    /// Make this device current on the calling thread (CUDA context); no-op on host.
    fn bind_thread(&self) -> Result<()>;

    // ---- memory -------------------------------------------------------------------------
    /// Allocate exportable device memory (plain `cuMemAlloc` on CUDA).
    fn alloc(&self, len: usize) -> Result<DevPtr>;
    fn free(&self, p: DevPtr) -> Result<()>;
    /// The allocation that contains `p`, or `InvalidArgument` if `p` is not device memory.
    fn allocation(&self, p: DevPtr) -> Result<Allocation>;
    fn export(&self, a: &Allocation) -> Result<ExportHandle>;
    /// Map a peer's exported allocation into this process; returns its base here.
    fn import(&self, h: &ExportHandle, len: usize) -> Result<DevPtr>;
    fn unimport(&self, base: DevPtr, len: usize) -> Result<()>;
    /// `n` host-visible 64-bit flags, zeroed.
    fn alloc_flags(&self, n: usize) -> Result<FlagSlab>;
    /// Host memory this device's copy queues reach by address and the CPU reads and writes
    /// directly: the inter-node transport's staging. Page-locked (`cuMemHostAlloc`) on
    /// CUDA; an ordinary allocation on the host backend, whose memory is host memory. The
    /// default refuses (a device that does not say how it stages).
    fn alloc_host(&self, len: usize) -> Result<DevPtr> {
        let _ = len;
        Err(crate::error::Error::invalid_usage("Device::alloc_host", format!("{} has no host staging memory", self.name())))
    }
    /// Free what `alloc_host` returned.
    fn free_host(&self, p: DevPtr) -> Result<()> {
        let _ = p;
        Err(crate::error::Error::invalid_usage("Device::free_host", format!("{} has no host staging memory", self.name())))
    }
    /// Make `len` bytes of this process's host memory at `ptr` (8-byte aligned; shared
    /// memory that another process maps too, say) reachable by this device's stream and
    /// queue memory operations; returns the address the device sees them at. CUDA:
    /// `cuMemHostRegister` (`DEVICEMAP | PORTABLE`) and `cuMemHostGetDevicePointer`; the
    /// host backend registers the range as flags. Undone by `unmap_host` with the same
    /// `ptr`, which must come after every queued wait or write on it has run.
    fn map_host(&self, ptr: *mut u8, len: usize) -> Result<DevPtr> {
        let _ = (ptr, len);
        Err(crate::error::Error::invalid_usage("Device::map_host", format!("{} cannot map host memory for the device", self.name())))
    }
    fn unmap_host(&self, ptr: *mut u8) -> Result<()> {
        let _ = ptr;
        Err(crate::error::Error::invalid_usage("Device::unmap_host", format!("{} cannot map host memory for the device", self.name())))
    }
    /// Synchronous copies between host memory and device memory (tests, setup).
    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()>;
    fn copy_from_host(&self, dst: DevPtr, src: &[u8]) -> Result<()>;

    // ---- streams ------------------------------------------------------------------------
    fn create_stream(&self) -> Result<StreamHandle>;
    fn destroy_stream(&self, s: StreamHandle) -> Result<()>;
    /// Enqueue: write `v` to the flag at `flag` when the stream reaches this point.
    fn write_value(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()>;
    /// Enqueue: block the stream until the flag at `flag` is >= `v`.
    fn wait_value_geq(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()>;
    /// Enqueue `ops` on `s` in order, as consecutive `wait_value_geq` / `write_value` calls
    /// would, in as few driver calls as the backend can (one `cuStreamBatchMemOp` on CUDA;
    /// one queued task on the host backend). On an error a prefix of `ops` may have been
    /// enqueued. The default makes one call per operation.
    fn mem_ops(&self, s: StreamHandle, ops: &[MemOp]) -> Result<()> {
        ops.iter().try_for_each(|op| match *op {
            MemOp::WaitGeq { flag, value } => self.wait_value_geq(s, flag, value),
            MemOp::Write { flag, value } => self.write_value(s, flag, value),
        })
    }
    /// Run `f` on a host thread once the stream reaches this point, before the stream's
    /// later work (the host backend's codec runs so). The default refuses: CUDA streams
    /// run kernels instead.
    fn launch_host_fn(&self, _s: StreamHandle, _f: Box<dyn FnOnce() + Send>) -> Result<()> {
        Err(crate::error::Error::invalid_usage("Device::launch_host_fn", format!("not supported by the {:?} backend", self.backend())))
    }
    /// Block the calling thread until the stream drains.
    fn synchronize(&self, s: StreamHandle) -> Result<()>;
    /// Whether everything queued on the stream so far has completed (never blocks).
    /// The default answers "not known to be idle".
    fn stream_query(&self, _s: StreamHandle) -> Result<bool> {
        Ok(false)
    }
    /// Whether work enqueued on `s` is being recorded into a graph instead of run (the
    /// host backend emulates capture: `begin_capture`).
    fn stream_capturing(&self, _s: StreamHandle) -> Result<bool> {
        Ok(false)
    }
    /// Attach `on_release` to the graph that `s` is being captured into
    /// (`cuStreamGetCaptureInfo`, then a user object the graph retains): it runs once, after
    /// the graph and every executable graph made from it are destroyed and their launches
    /// completed, on a thread of the driver's (CUDA) or the stream's (host backend); it must
    /// make no device call. Fails when `s` is not capturing; `on_release` is then dropped
    /// without running. The default refuses (a device without graph capture).
    fn capture_retain(&self, s: StreamHandle, on_release: Box<dyn FnOnce() + Send>) -> Result<()> {
        let _ = (s, on_release);
        Err(crate::error::Error::invalid_usage("Device::capture_retain", format!("{} has no graph capture", self.name())))
    }
    /// The id of the capture sequence `s` is being captured in (unique in the process while
    /// the capture lasts; `cuStreamGetCaptureInfo`), `InvalidUsage` when `s` is not
    /// capturing. Work captured on one stream in one sequence is ordered in the graph.
    fn capture_id(&self, s: StreamHandle) -> Result<u64> {
        let _ = s;
        Err(crate::error::Error::invalid_usage("Device::capture_id", format!("{} has no graph capture", self.name())))
    }
    /// Run `f` with the calling thread allowed the calls a global-mode capture forbids
    /// (`cuThreadExchangeStreamCaptureMode` to relaxed, and back): memory for a captured
    /// operation is allocated while the application captures, as NCCL does. A plain call
    /// where nothing is captured.
    fn relaxed_capture<'a>(&self, f: &mut (dyn FnMut() -> Result<()> + 'a)) -> Result<()> {
        f()
    }

    // ---- graph capture, for tests: the application captures with the CUDA runtime -------
    /// Start capturing `s` (thread-local mode): work enqueued on it is recorded, not run.
    /// Not global mode (`torch.cuda.graph`'s): the tests drive several ranks from threads of
    /// one process, and in global mode another rank's thread making an unsafe call (a
    /// synchronous copy, an allocation) while one captures invalidates that capture
    /// (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED` at the end, seen on the H200). Global mode is
    /// what `tests/nccl/torch_check.py` exercises, one rank per process.
    #[doc(hidden)]
    fn begin_capture(&self, s: StreamHandle) -> Result<()> {
        let _ = s;
        Err(crate::error::Error::invalid_usage("Device::begin_capture", format!("{} has no graph capture", self.name())))
    }
    /// End the capture of `s` and make an executable graph of it.
    #[doc(hidden)]
    fn end_capture(&self, s: StreamHandle) -> Result<GraphHandle> {
        let _ = s;
        Err(crate::error::Error::invalid_usage("Device::end_capture", format!("{} has no graph capture", self.name())))
    }
    /// Enqueue one replay of `g` on `s`.
    #[doc(hidden)]
    fn graph_launch(&self, g: GraphHandle, s: StreamHandle) -> Result<()> {
        let _ = (g, s);
        Err(crate::error::Error::invalid_usage("Device::graph_launch", format!("{} has no graph capture", self.name())))
    }
    /// Destroy `g` (the graph and its executable graph); launches already enqueued complete.
    #[doc(hidden)]
    fn graph_destroy(&self, g: GraphHandle) -> Result<()> {
        let _ = g;
        Err(crate::error::Error::invalid_usage("Device::graph_destroy", format!("{} has no graph capture", self.name())))
    }
    /// Enqueue a copy on a user stream (stream-ordered; a kernel-free DMA on CUDA).
    fn memcpy_async(&self, s: StreamHandle, dst: DevPtr, src: DevPtr, len: usize) -> Result<()>;
    /// Enqueue the test-data generator: byte i of `dst` becomes `pattern_byte(seed, i)`.
    /// A kernel on CUDA (so it is NOT zero-SM). Support for the tests and benchmarks, not
    /// part of the library's API.
    #[doc(hidden)]
    fn fill_pattern_async(&self, s: StreamHandle, dst: DevPtr, len: usize, seed: u64) -> Result<()>;
    /// Enqueue the reduce step: element i of `dst` becomes the fold of element i of every
    /// input in the order given, exactly as [`crate::reduce::reduce_into`] defines it (`Avg`
    /// divides by `srcs.len()`). Stream-ordered like `memcpy_async`. Every buffer holds
    /// `count` elements of `dtype` and is aligned to the element size (the reductions stage
    /// a user buffer that is not, `comm::reduction`); `dst` may be one of the inputs exactly
    /// (same address: each element is read before it is written), other overlaps of `dst`
    /// with an input are not allowed. `srcs` is not empty; `count == 0` enqueues nothing. The
    /// one device call of the reductions that uses SMs on CUDA (a kernel).
    fn reduce_async(&self, s: StreamHandle, dst: DevPtr, srcs: &[DevPtr], count: usize, dtype: DataType, op: RedOp) -> Result<()>;

    // ---- copy engines -------------------------------------------------------------------
    /// Number of copy engines the hardware reports (async engine count on CUDA).
    fn copy_engine_count(&self) -> usize;
    /// A new copy-engine queue for the proxy.
    fn create_copy_queue(&self) -> Result<Box<dyn CopyQueue>>;

    /// The CUDA device behind this backend, for kernel launches (codec, tests).
    fn as_cuda(&self) -> Option<&cuda::CudaDevice> {
        None
    }

    // ---- memory accounting (leak checks) ------------------------------------------------
    /// The memory this backend holds now ([`MemoryInUse`]): leak checks read it after a
    /// warm-up and again after their create/destroy cycles. The default refuses (a device
    /// that cannot say).
    fn memory_in_use(&self) -> Result<MemoryInUse> {
        Err(crate::error::Error::invalid_usage("Device::memory_in_use", format!("{} does not report its memory", self.name())))
    }
}

/// What [`Device::memory_in_use`] reports. Flag slabs handed to the process-wide pool of
/// stream flag pairs stay allocated on purpose (docs/design.md, "Pairs outlive
/// communicators"): they count here, and a leak check compares after a warm-up that filled
/// the pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryInUse {
    /// Device memory in use. CUDA: `total - free` of `cuMemGetInfo` for this GPU, so every
    /// context's and process's use on it (comparable only while nothing else allocates).
    /// Host backend: bytes of this process's shared-memory allocations (`alloc`,
    /// `alloc_host`).
    pub device_bytes: u64,
    /// Pinned host memory hoccl holds in this process. CUDA: `alloc_host` and `alloc_flags`
    /// (`cuMemHostAlloc`) and the ranges `map_host` registered. Host backend: flag slabs and
    /// `map_host` ranges (its `alloc_host` is shared memory, counted in `device_bytes`).
    pub pinned_host_bytes: u64,
    /// Peer allocations mapped into this process (open IPC imports), and their bytes.
    pub imports: u64,
    pub import_bytes: u64,
}

/// Byte `i` of the verifiable test pattern for `seed` (a function of seed and index only,
/// so every rank computes any expected value itself). Shared with `cuda/pattern.cu`.
/// Test and benchmark support, not part of the library's API.
#[doc(hidden)]
#[inline]
pub fn pattern_byte(seed: u64, i: u64) -> u8 {
    (pattern_word(seed, i >> 2) >> ((i & 3) * 8)) as u8
}

/// 32-bit word `w` of the pattern: a splitmix64 finalizer over (seed, w).
#[doc(hidden)]
#[inline]
pub fn pattern_word(seed: u64, w: u64) -> u32 {
    let mut z = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ w.wrapping_add(0x632B_E59B_D9B4_E019);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    (z ^ (z >> 31)) as u32
}

/// Open the backend `choice` asks for on GPU `ordinal` (ignored on host). `Cuda` fails with
/// `NoDevice` (and the reason) when there is no driver or no such GPU; `Auto` takes CUDA when
/// the driver reports at least one GPU and the host backend otherwise.
/// Test hook: the device calls of threads marked with [`count_calls_here`] (the proxies),
/// counted process-wide, and a gate those calls pass through. Both backends count every
/// trait call that reaches the driver (CUDA: every call that makes the context current;
/// host: every memory, stream and copy-queue call). The gate emulates an application
/// thread that holds the driver lock while it waits for the GPU (a pageable copy, a
/// `cuMemFree`): while [`DriverGate::hold`] is held, a marked thread's next device call
/// waits for it (host backend; on CUDA the real driver lock does this).
pub mod calls {
    use std::cell::Cell;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::{Mutex, MutexGuard};

    thread_local! {
        static COUNTED: Cell<bool> = const { Cell::new(false) };
    }
    static CALLS: AtomicU64 = AtomicU64::new(0);
    static GATE: Mutex<()> = Mutex::new(());
    static GATE_HELD: AtomicBool = AtomicBool::new(false);

    /// Count (and gate) this thread's device calls from now on.
    pub fn count_calls_here() {
        COUNTED.with(|c| c.set(true));
    }

    /// Device calls made so far by marked threads of this process.
    pub fn counted() -> u64 {
        CALLS.load(Ordering::Acquire)
    }

    /// Called at the top of every backend call.
    #[inline]
    pub fn enter() {
        if !COUNTED.with(Cell::get) {
            return;
        }
        CALLS.fetch_add(1, Ordering::AcqRel);
        if GATE_HELD.load(Ordering::Acquire) {
            drop(GATE.lock().unwrap_or_else(|e| e.into_inner()));
        }
    }

    /// Holds the gate: marked threads' device calls wait until it is dropped.
    pub struct DriverGate(#[allow(dead_code)] MutexGuard<'static, ()>);

    impl DriverGate {
        pub fn hold() -> DriverGate {
            let g = GATE.lock().unwrap_or_else(|e| e.into_inner());
            GATE_HELD.store(true, Ordering::Release);
            DriverGate(g)
        }
    }

    impl Drop for DriverGate {
        fn drop(&mut self) {
            GATE_HELD.store(false, Ordering::Release);
        }
    }
}

pub fn open(choice: crate::config::BackendChoice, ordinal: usize) -> Result<Arc<dyn Device>> {
    use crate::config::BackendChoice;
    match choice {
        BackendChoice::Host => Ok(Arc::new(host::HostDevice::new()?)),
        BackendChoice::Cuda => Ok(Arc::new(cuda::CudaDevice::open(ordinal)?)),
        BackendChoice::Auto => match cuda::probe() {
            Ok(p) if p.count > 0 => Ok(Arc::new(cuda::CudaDevice::open(ordinal % p.count)?)),
            _ => Ok(Arc::new(host::HostDevice::new()?)),
        },
    }
}
