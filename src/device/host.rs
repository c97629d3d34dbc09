//! Host backend: "device memory" is POSIX shared memory (so other processes can map it by
//! name, as CUDA IPC maps device memory), copy engines are worker threads, a stream is an
//! in-order queue run by its own thread. It lets CI run the whole engine without a GPU.
//!
//! Graph capture is emulated: between `begin_capture` and `end_capture` the tasks enqueued
//! on a stream are recorded instead of run, and `graph_launch` enqueues copies of them (the
//! same writes, waits, copies and reduce steps, with the values recorded), as a CUDA graph
//! replays its nodes. What `capture_retain` attaches to a graph runs in stream order after
//! the graph's last launch once the graph is destroyed (or when the device is dropped).
//!
//! Every address this backend dereferences is checked against its registry of live
//! allocations, imported mappings and flag slabs first, so a bad pointer is an error, not UB.
use super::*;
use crate::error::{Error, Result};
use crate::reduce::RedOp;
use crate::types::DataType;
use std::collections::{BTreeMap, HashMap};
use std::ffi::CString;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

const PAGE: usize = 4096;
const HOST_COPY_ENGINES: usize = 3;

/// `len` rounded up to whole pages; a length no mapping can have is `InvalidArgument`.
fn round_page(op: &'static str, len: usize) -> Result<usize> {
    len.max(1)
        .checked_next_multiple_of(PAGE)
        .filter(|l| *l <= isize::MAX as usize)
        .ok_or_else(|| Error::invalid_arg(op, format!("{len} bytes: larger than any mapping")))
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum RegionKind {
    /// `key`: the random part of the allocation's shm name.
    Own { id: u64, key: u64 },
    Imported,
    Flags,
    /// Host memory of this process registered by `map_host` (flags another process shares).
    HostMapped,
}

#[derive(Clone, Copy, Debug)]
struct Region {
    len: usize,
    map_len: usize,
    kind: RegionKind,
}

/// Live address ranges, keyed by base address.
#[derive(Default)]
struct Registry {
    regions: BTreeMap<u64, Region>,
    /// Imported mappings by base here: whose allocation they map (see
    /// [`fixed_address_imports`]).
    owners: HashMap<u64, Owner>,
}

/// The allocation an imported mapping maps: its owner's process, id, and address range
/// there.
#[derive(Clone, Copy, Debug)]
struct Owner {
    pid: u32,
    id: u64,
    base: u64,
    len: u64,
}

/// Test hook, `HOCCL_HOST_FIXED_ADDRESS_IMPORTS=1`: imports follow CUDA's rule that an
/// import is mapped at its owner's address, so one overlapping a mapping still open of
/// another allocation of the same owner fails with `CUDA_ERROR_ALREADY_MAPPED`
/// (`transport::ipc::already_mapped`), as it does on CUDA while a mapping of a freed
/// allocation is cached. A second import of the same allocation succeeds (CUDA counts
/// references). Off by default: host mappings have their own addresses.
fn fixed_address_imports() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("HOCCL_HOST_FIXED_ADDRESS_IMPORTS").as_deref() == Ok("1"))
}

/// The owner of the allocation a handle names: `/hoccl.<pid>.<key>.<id>` and the owner's
/// base address in bytes 56..64.
fn owner_of(name: &str, h: &ExportHandle, len: u64) -> Option<Owner> {
    let mut parts = name.strip_prefix("/hoccl.")?.split('.');
    let pid = parts.next()?.parse().ok()?;
    let id = parts.nth(1)?.parse().ok()?;
    let mut base = [0u8; 8];
    base.copy_from_slice(&h.0[56..64]);
    Some(Owner { pid, id, base: u64::from_le_bytes(base), len })
}

impl Registry {
    fn find(&self, p: u64) -> Option<(u64, Region)> {
        let (base, r) = self.regions.range(..=p).next_back()?;
        (p < base + r.len.max(1) as u64).then_some((*base, *r))
    }
    /// Checks that `[p, p+len)` lies inside one live region.
    fn check(&self, op: &'static str, p: DevPtr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        let (base, r) = self
            .find(p.0)
            .ok_or_else(|| Error::invalid_arg(op, format!("{:#x} is not memory of the host backend", p.0)))?;
        let end = p.0.checked_add(len as u64).ok_or_else(|| Error::invalid_arg(op, "address range overflows"))?;
        if end > base + r.len as u64 {
            return Err(Error::invalid_arg(
                op,
                format!("range {:#x}+{len} exceeds its allocation {base:#x}+{}", p.0, r.len),
            ));
        }
        Ok(())
    }
}

/// The process-wide registry: ranks of one process (thread bootstrap) map each other's
/// memory, so all host devices of a process share it.
fn registry() -> &'static Mutex<Registry> {
    static R: std::sync::OnceLock<Mutex<Registry>> = std::sync::OnceLock::new();
    R.get_or_init(|| Mutex::new(Registry::default()))
}

fn lock_registry(op: &'static str) -> Result<std::sync::MutexGuard<'static, Registry>> {
    registry().lock().map_err(|_| Error::internal(op, "host registry lock poisoned"))
}

static NEXT_ALLOC_ID: AtomicU64 = AtomicU64::new(1);

/// `/hoccl.<pid>.<key>.<id>`: the random `key` makes the name unguessable for other
/// processes (the object is owner-only as well); pid first, for `sweep_stale_objects`.
fn shm_name(id: u64, key: u64) -> String {
    format!("/hoccl.{}.{key:016x}.{id}", std::process::id())
}

/// The longest name an `ExportHandle` carries (bytes 0..48, NUL-padded).
const HANDLE_NAME_MAX: usize = 47;

/// Map `name` (creating it with `len` bytes if `create`).
fn map_shm(op: &'static str, name: &str, map_len: usize, create: bool) -> Result<*mut u8> {
    let c = CString::new(name).map_err(|_| Error::invalid_arg(op, "shm name has a NUL"))?;
    let flags = if create { libc::O_CREAT | libc::O_EXCL | libc::O_RDWR } else { libc::O_RDWR };
    // SAFETY: `c` is a valid NUL-terminated string.
    let fd = unsafe { libc::shm_open(c.as_ptr(), flags, 0o600) };
    if fd < 0 {
        return Err(Error::last_os(op, "shm_open"));
    }
    let res = (|| {
        // SAFETY: fd is an open shm object we own.
        if create && unsafe { libc::ftruncate(fd, map_len as libc::off_t) } != 0 {
            return Err(Error::last_os(op, "ftruncate"));
        }
        if !create {
            // Mapping past the object's end would fault (SIGBUS) on access: refuse.
            // SAFETY: st is plain data filled by fstat on our fd.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: fd is open; st is writable.
            if unsafe { libc::fstat(fd, &mut st) } != 0 {
                return Err(Error::last_os(op, "fstat"));
            }
            if (st.st_size as u64) < map_len as u64 {
                return Err(Error::invalid_arg(op, format!("{name} holds {} bytes, {map_len} requested", st.st_size)));
            }
        }
        // SAFETY: fresh shared mapping of an fd we own; the kernel picks the address.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), map_len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(Error::last_os(op, "mmap"));
        }
        Ok(p as *mut u8)
    })();
    // SAFETY: fd is ours; the mapping stays valid after close.
    unsafe { libc::close(fd) };
    if res.is_err() && create {
        // SAFETY: as above.
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
    res
}

fn unlink_shm(name: &str) {
    if let Ok(c) = CString::new(name) {
        // SAFETY: valid C string; failure is harmless (already gone).
        unsafe { libc::shm_unlink(c.as_ptr()) };
    }
}

/// Remove `/dev/shm/hoccl.<pid>.*` objects left by processes that no longer exist.
fn sweep_stale_objects() {
    let Ok(dir) = std::fs::read_dir("/dev/shm") else { return };
    for e in dir.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix("hoccl.") else { continue };
        let pid_str = rest.split('.').find(|s| !s.is_empty() && s.chars().all(|c| c.is_ascii_digit()));
        let Some(pid) = pid_str.and_then(|s| s.parse::<i32>().ok()) else { continue };
        // SAFETY: kill with signal 0 only checks existence.
        let dead = unsafe { libc::kill(pid, 0) } != 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
        if dead {
            unlink_shm(&format!("/{name}"));
        }
    }
}

// ------------------------------------------------------------------ streams -------------

/// A graph's release hook (`capture_retain`), shared by the copies of a release task.
type ReleaseHook = Arc<Mutex<Option<Box<dyn FnOnce() + Send>>>>;

#[derive(Clone)]
enum Task {
    Write { addr: u64, v: u64 },
    Wait { addr: u64, v: u64 },
    /// A batch of waits and writes (`mem_ops`), run in order as one task.
    MemOps(Vec<MemOp>),
    Copy { dst: u64, src: u64, len: usize },
    Fill { dst: u64, len: usize, seed: u64 },
    /// `reduce_into` over `srcs` (each `len` bytes) into `dst`.
    Reduce { dst: u64, srcs: Vec<u64>, len: usize, dtype: DataType, op: RedOp },
    Marker,
    /// Run a destroyed graph's release hooks (after its last launch, in stream order).
    Release(ReleaseHook),
    /// A host function in stream order (`launch_host_fn`; never captured, so it runs once).
    HostFn(ReleaseHook),
}

/// Run the hooks once; a panicking hook is logged, not propagated into a queue thread.
fn run_release(h: &ReleaseHook) {
    let f = h.lock().ok().and_then(|mut g| g.take());
    if let Some(f) = f {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
            log::error!("host backend: a graph's release hook panicked");
        }
    }
}

/// A stream being captured: the tasks recorded so far and the hooks attached.
struct Capture {
    /// The capture sequence's id (`capture_id`).
    id: u64,
    tasks: Vec<Task>,
    hooks: Vec<Box<dyn FnOnce() + Send>>,
}

/// A captured graph: its tasks, its release hooks, and the stream of its last launch.
struct HostGraph {
    tasks: Vec<Task>,
    hooks: Vec<Box<dyn FnOnce() + Send>>,
    last: Option<u64>,
}

/// One hook that runs every hook of `hooks`.
fn join_hooks(hooks: Vec<Box<dyn FnOnce() + Send>>) -> ReleaseHook {
    Arc::new(Mutex::new(Some(Box::new(move || hooks.into_iter().for_each(|h| h())))))
}

struct QueueState {
    enqueued: AtomicU64,
    done: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
    stop: AtomicBool,
}

impl QueueState {
    fn new() -> Arc<Self> {
        Arc::new(QueueState {
            enqueued: AtomicU64::new(0),
            done: AtomicU64::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
        })
    }
    fn finish_one(&self) {
        self.done.fetch_add(1, Ordering::AcqRel);
        let _g = self.lock.lock();
        self.cv.notify_all();
    }
}

/// A flag write, or a wait until a flag is >= a value (other tasks are ignored).
fn run_mem_op(t: &Task, st: &QueueState) {
    match *t {
        // SAFETY: addr was checked against a live flag slab or allocation, 8-aligned.
        Task::Write { addr, v } => unsafe { (*(addr as *const AtomicU64)).store(v, Ordering::Release) },
        Task::Wait { addr, v } => {
            // SAFETY: as for Write.
            let w = unsafe { &*(addr as *const AtomicU64) };
            let mut spins = 0u32;
            while w.load(Ordering::Acquire) < v && !st.stop.load(Ordering::Relaxed) {
                spins += 1;
                if spins < 256 {
                    std::hint::spin_loop();
                } else if spins < 1024 {
                    std::thread::yield_now();
                } else {
                    std::thread::sleep(Duration::from_micros(20));
                }
            }
        }
        _ => {}
    }
}

/// Executes one task. Addresses were range-checked when the task was enqueued; the
/// registry keeps them mapped until the owner frees them (freeing memory a queued task
/// still uses is the same user error as on CUDA).
fn run_task(t: Task, st: &QueueState) {
    match t {
        Task::Write { .. } | Task::Wait { .. } => run_mem_op(&t, st),
        Task::MemOps(ops) => {
            for op in ops {
                run_mem_op(&(match op {
                    MemOp::WaitGeq { flag, value } => Task::Wait { addr: flag.0, v: value },
                    MemOp::Write { flag, value } => Task::Write { addr: flag.0, v: value },
                }), st);
            }
        }
        // SAFETY: both ranges were checked against live regions; memmove tolerates overlap.
        Task::Copy { dst, src, len } => unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) },
        Task::Fill { dst, len, seed } => {
            // SAFETY: checked range of a live region, exclusively written by this task.
            let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
            for (w, chunk) in out.chunks_mut(4).enumerate() {
                let v = pattern_word(seed, w as u64).to_le_bytes();
                chunk.copy_from_slice(&v[..chunk.len()]);
            }
        }
        Task::Reduce { dst, srcs, len, dtype, mut op } => {
            if let RedOp::PreMulSum(crate::reduce::Scalar::Device(p)) = op {
                // A scalar in device memory is read when the step runs (stream order).
                let mut w = [0u8; 8];
                // SAFETY: the scalar's dtype.size() bytes at p were checked against a live
                // region when the task was enqueued; w holds 8 >= dtype.size() bytes.
                unsafe { std::ptr::copy_nonoverlapping(p as *const u8, w.as_mut_ptr(), dtype.size()) };
                op = RedOp::PreMulSum(crate::reduce::Scalar::Value(u64::from_le_bytes(w)));
            }
            // SAFETY: every range was checked against a live region when the task was
            // enqueued; the stream order guarantees nothing else writes them meanwhile.
            let inputs: Vec<&[u8]> = srcs.iter().map(|p| unsafe { std::slice::from_raw_parts(*p as *const u8, len) }).collect();
            let r = if srcs.iter().any(|p| *p < dst + len as u64 && dst < *p + len as u64) {
                // `dst` is one of the inputs: fold into a copy, then write it back (no
                // mutable slice may alias an input).
                let mut tmp = vec![0u8; len];
                let r = crate::reduce::reduce_into(dtype, op, &mut tmp, &inputs);
                drop(inputs);
                // SAFETY: dst range checked as above; tmp is a distinct allocation.
                unsafe { std::ptr::copy(tmp.as_ptr(), dst as *mut u8, len) };
                r
            } else {
                // SAFETY: dst range checked as above and disjoint from every input.
                let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
                crate::reduce::reduce_into(dtype, op, out, &inputs)
            };
            if let Err(e) = r {
                log::error!("host backend: reduce step: {e}");
            }
        }
        Task::Marker => {}
        Task::Release(h) | Task::HostFn(h) => run_release(&h),
    }
}

/// An in-order queue run by a thread (streams and copy engines alike).
struct HostQueue {
    tx: Mutex<Option<Sender<Task>>>,
    st: Arc<QueueState>,
    thread: Mutex<Option<JoinHandle<()>>>,
}

impl HostQueue {
    fn spawn(name: String) -> Result<Arc<HostQueue>> {
        let (tx, rx): (Sender<Task>, Receiver<Task>) = channel();
        let st = QueueState::new();
        let st2 = st.clone();
        let h = std::thread::Builder::new()
            .name(name)
            .spawn(move || {
                while let Ok(t) = rx.recv() {
                    run_task(t, &st2);
                    st2.finish_one();
                }
            })
            .map_err(|e| Error::io("HostQueue::spawn", "thread spawn", e))?;
        Ok(Arc::new(HostQueue { tx: Mutex::new(Some(tx)), st, thread: Mutex::new(Some(h)) }))
    }

    fn push(&self, op: &'static str, t: Task) -> Result<u64> {
        let g = self.tx.lock().map_err(|_| Error::internal(op, "queue lock poisoned"))?;
        let tx = g.as_ref().ok_or_else(|| Error::invalid_usage(op, "stream was destroyed"))?;
        let n = self.st.enqueued.fetch_add(1, Ordering::AcqRel) + 1;
        tx.send(t).map_err(|_| Error::internal(op, "queue thread is gone"))?;
        Ok(n)
    }

    fn wait_for(&self, n: u64) {
        let mut g = self.st.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.st.done.load(Ordering::Acquire) < n {
            g = self.st.cv.wait_timeout(g, Duration::from_millis(50)).unwrap_or_else(|e| e.into_inner()).0;
        }
    }

    fn shutdown(&self) {
        self.st.stop.store(true, Ordering::Relaxed);
        if let Ok(mut g) = self.tx.lock() {
            g.take();
        }
        if let Some(h) = self.thread.lock().ok().and_then(|mut g| g.take()) {
            let _ = h.join();
        }
    }
}

struct HostCopyQueue {
    q: Arc<HostQueue>,
    fences: std::collections::VecDeque<(u64, u64)>, // (ticket, task number)
    next_ticket: u64,
    completed: u64,
}

impl CopyQueue for HostCopyQueue {
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostCopyQueue::copy";
        {
            let reg = lock_registry(OP)?;
            reg.check(OP, dst, len)?;
            reg.check(OP, src, len)?;
        }
        self.q.push(OP, Task::Copy { dst: dst.0, src: src.0, len }).map(|_| ())
    }
    fn fence(&mut self) -> Result<u64> {
        crate::device::calls::enter();
        let n = self.q.push("HostCopyQueue::fence", Task::Marker)?;
        self.next_ticket += 1;
        self.fences.push_back((self.next_ticket, n));
        Ok(self.next_ticket)
    }
    fn completed(&mut self) -> Result<u64> {
        crate::device::calls::enter();
        let done = self.q.st.done.load(Ordering::Acquire);
        while let Some(&(t, n)) = self.fences.front() {
            if n > done {
                break;
            }
            self.completed = t;
            self.fences.pop_front();
        }
        Ok(self.completed)
    }
    fn wait_geq(&mut self, flag: DevPtr, v: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostCopyQueue::wait_geq";
        HostDevice::check_flag(OP, flag)?;
        self.q.push(OP, Task::Wait { addr: flag.0, v }).map(|_| ())
    }
    fn write_value(&mut self, flag: DevPtr, v: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostCopyQueue::write_value";
        HostDevice::check_flag(OP, flag)?;
        self.q.push(OP, Task::Write { addr: flag.0, v }).map(|_| ())
    }
    /// One task, as `cuStreamBatchMemOp` is one call; nothing is queued unless every flag
    /// checks.
    fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostCopyQueue::mem_ops";
        HostDevice::check_mem_ops(OP, ops)?;
        self.q.push(OP, Task::MemOps(ops.to_vec())).map(|_| ())
    }
}

impl Drop for HostCopyQueue {
    fn drop(&mut self) {
        self.q.shutdown();
    }
}

// ------------------------------------------------------------------ device --------------

/// The host backend. Cheap to create; several may exist in one process (one per rank).
pub struct HostDevice {
    /// Allocations made through this device: base -> (shm name, map_len).
    owned: Mutex<HashMap<u64, (String, usize)>>,
    streams: Mutex<HashMap<u64, Arc<HostQueue>>>,
    next_stream: AtomicU64,
    /// Streams being captured, by id.
    captures: Mutex<HashMap<u64, Capture>>,
    graphs: Mutex<HashMap<u64, HostGraph>>,
    next_graph: AtomicU64,
    /// This device's number among the host devices of the process (`Device::queue_domain`).
    instance: usize,
}

impl HostDevice {
    pub fn new() -> Result<HostDevice> {
        static SWEEP: std::sync::Once = std::sync::Once::new();
        SWEEP.call_once(sweep_stale_objects);
        Ok(HostDevice {
            owned: Mutex::new(HashMap::new()),
            streams: Mutex::new(HashMap::new()),
            next_stream: AtomicU64::new(1),
            captures: Mutex::new(HashMap::new()),
            graphs: Mutex::new(HashMap::new()),
            next_graph: AtomicU64::new(1),
            instance: {
                static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
                NEXT.fetch_add(1, Ordering::Relaxed)
            },
        })
    }

    /// Run `t` on stream `s`, or record it when `s` is being captured.
    fn enqueue(&self, op: &'static str, s: StreamHandle, t: Task) -> Result<()> {
        let q = self.stream(op, s)?;
        {
            let mut c = self.captures.lock().map_err(|_| Error::internal(op, "capture table poisoned"))?;
            if let Some(cap) = c.get_mut(&s.0) {
                cap.tasks.push(t);
                return Ok(());
            }
        }
        q.push(op, t).map(|_| ())
    }

    /// Refuse what a capturing stream cannot do (CUDA: `cudaErrorStreamCaptureUnsupported`).
    fn not_capturing(&self, op: &'static str, s: StreamHandle) -> Result<()> {
        let c = self.captures.lock().map_err(|_| Error::internal(op, "capture table poisoned"))?;
        if c.contains_key(&s.0) {
            return Err(Error::invalid_usage(op, format!("stream {:#x} is being captured", s.0)));
        }
        Ok(())
    }

    fn stream(&self, op: &'static str, s: StreamHandle) -> Result<Arc<HostQueue>> {
        let mut m = self.streams.lock().map_err(|_| Error::internal(op, "stream table poisoned"))?;
        if s.0 == 0 {
            // The default stream exists implicitly, as on CUDA.
            if let Some(q) = m.get(&0) {
                return Ok(q.clone());
            }
            let q = HostQueue::spawn("hoccl-host-stream0".into())?;
            m.insert(0, q.clone());
            return Ok(q);
        }
        m.get(&s.0).cloned().ok_or_else(|| Error::invalid_arg(op, format!("unknown stream {:#x}", s.0)))
    }

    fn check(op: &'static str, p: DevPtr, len: usize) -> Result<()> {
        lock_registry(op)?.check(op, p, len)
    }

    fn check_mem_ops(op: &'static str, ops: &[MemOp]) -> Result<()> {
        ops.iter().try_for_each(|m| match *m {
            MemOp::WaitGeq { flag, .. } | MemOp::Write { flag, .. } => Self::check_flag(op, flag),
        })
    }

    fn check_flag(op: &'static str, p: DevPtr) -> Result<()> {
        if p.0 % 8 != 0 {
            return Err(Error::invalid_arg(op, "flag address is not 8-byte aligned"));
        }
        Self::check(op, p, 8)
    }
}

/// Check that `[p, p + len)` is host-backend device memory (an error naming `op` if not).
pub fn check(op: &'static str, p: DevPtr, len: usize) -> Result<()> {
    HostDevice::check(op, p, len)
}

/// Copy `dst.len()` bytes of host-backend device memory at `src` into `dst` (what
/// `copy_to_host` does, without a device: for host functions run in stream order).
pub fn read(src: DevPtr, dst: &mut [u8]) -> Result<()> {
    HostDevice::check("host::read", src, dst.len())?;
    // SAFETY: src range checked against a live region; dst is a distinct Rust slice.
    unsafe { std::ptr::copy(src.0 as *const u8, dst.as_mut_ptr(), dst.len()) };
    Ok(())
}

/// Copy `src` into host-backend device memory at `dst` (as `copy_from_host`).
pub fn write(dst: DevPtr, src: &[u8]) -> Result<()> {
    HostDevice::check("host::write", dst, src.len())?;
    // SAFETY: dst range checked against a live region.
    unsafe { std::ptr::copy(src.as_ptr(), dst.0 as *mut u8, src.len()) };
    Ok(())
}

impl Drop for HostDevice {
    fn drop(&mut self) {
        // Graphs and captures left behind can never run again: release what they hold.
        let hooks: Vec<Box<dyn FnOnce() + Send>> = self
            .graphs
            .lock()
            .map(|mut m| m.drain().flat_map(|(_, g)| g.hooks).collect())
            .unwrap_or_default();
        let more: Vec<Box<dyn FnOnce() + Send>> = self
            .captures
            .lock()
            .map(|mut m| m.drain().flat_map(|(_, c)| c.hooks).collect())
            .unwrap_or_default();
        run_release(&join_hooks(hooks.into_iter().chain(more).collect()));
        let streams: Vec<_> = self.streams.lock().map(|mut m| m.drain().map(|(_, q)| q).collect()).unwrap_or_default();
        for q in streams {
            q.shutdown();
        }
        let owned: Vec<u64> = self.owned.lock().map(|m| m.keys().copied().collect()).unwrap_or_default();
        for base in owned {
            if let Err(e) = self.free(DevPtr(base)) {
                log::warn!("host backend: freeing {base:#x} at drop: {e}");
            }
        }
    }
}

impl Device for HostDevice {
    fn backend(&self) -> Backend {
        Backend::Host
    }
    fn ordinal(&self) -> usize {
        0
    }
    fn queue_domain(&self) -> (Backend, usize) {
        (Backend::Host, self.instance)
    }
    fn name(&self) -> String {
        "host".into()
    }
    fn pci_bus_id(&self) -> String {
        "host".into()
    }
    fn bind_thread(&self) -> Result<()> {
        Ok(())
    }

    fn alloc(&self, len: usize) -> Result<DevPtr> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::alloc";
        let id = NEXT_ALLOC_ID.fetch_add(1, Ordering::Relaxed);
        let mut key = [0u8; 8];
        crate::bootstrap::tcp::fill_random(&mut key).map_err(|e| e.with_op(OP))?;
        let key = u64::from_le_bytes(key);
        let name = shm_name(id, key);
        let map_len = round_page(OP, len)?;
        let p = map_shm(OP, &name, map_len, true)? as u64;
        lock_registry(OP)?.regions.insert(p, Region { len: len.max(1), map_len, kind: RegionKind::Own { id, key } });
        self.owned.lock().map_err(|_| Error::internal(OP, "poisoned"))?.insert(p, (name, map_len));
        Ok(DevPtr(p))
    }

    fn free(&self, p: DevPtr) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::free";
        let (name, map_len) = self
            .owned
            .lock()
            .map_err(|_| Error::internal(OP, "poisoned"))?
            .remove(&p.0)
            .ok_or_else(|| Error::invalid_arg(OP, format!("{:#x} is not an allocation of this device", p.0)))?;
        lock_registry(OP)?.regions.remove(&p.0);
        // SAFETY: p/map_len came from our own mmap and are removed from the registry.
        unsafe { libc::munmap(p.0 as *mut libc::c_void, map_len) };
        unlink_shm(&name);
        Ok(())
    }

    /// Device memory is host memory here: an ordinary allocation (registered, so the copy
    /// queues reach it).
    fn alloc_host(&self, len: usize) -> Result<DevPtr> {
        crate::device::calls::enter();
        self.alloc(len)
    }

    fn free_host(&self, p: DevPtr) -> Result<()> {
        crate::device::calls::enter();
        self.free(p)
    }

    fn allocation(&self, p: DevPtr) -> Result<Allocation> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::allocation";
        let reg = lock_registry(OP)?;
        match reg.find(p.0) {
            Some((base, Region { len, kind: RegionKind::Own { id, .. }, .. })) => Ok(Allocation { base: DevPtr(base), len, id }),
            _ => Err(Error::invalid_arg(OP, format!("{:#x} is not device memory of the host backend", p.0))),
        }
    }

    /// Handle layout: the shm name, NUL-padded, in bytes 0..48; the exact allocation length
    /// (u64, little-endian) in bytes 48..56, so an importer asking for more is refused; the
    /// allocation's base address here in bytes 56..64 (for `fixed_address_imports`).
    fn export(&self, a: &Allocation) -> Result<ExportHandle> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::export";
        let key = match lock_registry(OP)?.regions.get(&a.base.0) {
            Some(Region { kind: RegionKind::Own { id, key }, .. }) if *id == a.id => *key,
            _ => return Err(Error::invalid_arg(OP, format!("{:#x} is not a live allocation (freed and reused since?)", a.base.0))),
        };
        let name = shm_name(a.id, key);
        if name.len() > HANDLE_NAME_MAX {
            return Err(Error::internal(OP, format!("shm name {name} does not fit a handle")));
        }
        let mut h = [0u8; 64];
        h[..name.len()].copy_from_slice(name.as_bytes());
        h[48..56].copy_from_slice(&(a.len as u64).to_le_bytes());
        h[56..64].copy_from_slice(&a.base.0.to_le_bytes());
        Ok(ExportHandle(h))
    }

    fn import(&self, h: &ExportHandle, len: usize) -> Result<DevPtr> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::import";
        let end = h.0[..48].iter().position(|b| *b == 0).unwrap_or(48);
        let name = std::str::from_utf8(&h.0[..end]).map_err(|_| Error::invalid_arg(OP, "bad handle"))?;
        if !name.starts_with("/hoccl.") {
            return Err(Error::invalid_arg(OP, "not a host-backend handle"));
        }
        let mut exported = [0u8; 8];
        exported.copy_from_slice(&h.0[48..56]);
        let exported = u64::from_le_bytes(exported);
        if len as u64 > exported {
            return Err(Error::invalid_arg(OP, format!("{len} bytes requested from an allocation of {exported}")));
        }
        let owner = owner_of(name, h, exported);
        if let Some(o) = owner.filter(|_| fixed_address_imports()) {
            let reg = lock_registry(OP)?;
            let clash = reg.owners.values().any(|x| x.pid == o.pid && x.id != o.id && x.base < o.base.saturating_add(o.len) && o.base < x.base.saturating_add(x.len));
            if clash {
                return Err(Error::Cuda {
                    op: OP,
                    call: "import at the owner's address (HOCCL_HOST_FIXED_ADDRESS_IMPORTS)",
                    code: crate::transport::ipc::CUDA_ERROR_ALREADY_MAPPED,
                    name: "CUDA_ERROR_ALREADY_MAPPED".into(),
                });
            }
        }
        let map_len = round_page(OP, len)?;
        let p = map_shm(OP, name, map_len, false)? as u64;
        let mut reg = lock_registry(OP)?;
        reg.regions.insert(p, Region { len: len.max(1), map_len, kind: RegionKind::Imported });
        if let Some(o) = owner {
            reg.owners.insert(p, o);
        }
        Ok(DevPtr(p))
    }

    fn unimport(&self, base: DevPtr, _len: usize) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::unimport";
        let r = lock_registry(OP)?.regions.remove(&base.0);
        match r {
            Some(Region { map_len, kind: RegionKind::Imported, .. }) => {
                lock_registry(OP)?.owners.remove(&base.0);
                // SAFETY: an imported mapping we made, now out of the registry.
                unsafe { libc::munmap(base.0 as *mut libc::c_void, map_len) };
                Ok(())
            }
            Some(other) => {
                lock_registry(OP)?.regions.insert(base.0, other);
                Err(Error::invalid_arg(OP, "not an imported mapping"))
            }
            None => Err(Error::invalid_arg(OP, "not an imported mapping")),
        }
    }

    fn alloc_flags(&self, n: usize) -> Result<FlagSlab> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::alloc_flags";
        let words: Box<[AtomicU64]> = (0..n.max(1)).map(|_| AtomicU64::new(0)).collect();
        let p = words.as_ptr() as *mut u64;
        lock_registry(OP)?.regions.insert(p as u64, Region { len: n.max(1) * 8, map_len: 0, kind: RegionKind::Flags });
        struct Keep(Box<[AtomicU64]>);
        impl Drop for Keep {
            fn drop(&mut self) {
                if let Ok(mut r) = registry().lock() {
                    r.regions.remove(&(self.0.as_ptr() as u64));
                }
            }
        }
        // SAFETY: `words` are n zeroed aligned atomics, kept alive by `Keep`; host == dev here.
        Ok(unsafe { FlagSlab::from_raw(p, DevPtr(p as u64), n, Box::new(Keep(words))) })
    }

    /// Host memory is what the queues reach already: the range only joins the registry, so
    /// queue waits and writes there pass its checks.
    fn map_host(&self, ptr: *mut u8, len: usize) -> Result<DevPtr> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::map_host";
        if ptr.is_null() || ptr as usize % 8 != 0 || len == 0 {
            return Err(Error::invalid_arg(OP, format!("{ptr:p}+{len}: want a non-null, 8-byte aligned, non-empty range")));
        }
        let mut reg = lock_registry(OP)?;
        let p = ptr as u64;
        let end = p.checked_add(len as u64).ok_or_else(|| Error::invalid_arg(OP, "address range overflows"))?;
        let before = reg.regions.range(..end).next_back().map(|(b, r)| b + r.len.max(1) as u64);
        if before.is_some_and(|e| e > p) {
            return Err(Error::invalid_arg(OP, format!("{ptr:p}+{len} overlaps memory the host backend knows already")));
        }
        reg.regions.insert(p, Region { len, map_len: 0, kind: RegionKind::HostMapped });
        Ok(DevPtr(p))
    }

    fn unmap_host(&self, ptr: *mut u8) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::unmap_host";
        let mut reg = lock_registry(OP)?;
        match reg.regions.get(&(ptr as u64)) {
            Some(Region { kind: RegionKind::HostMapped, .. }) => {
                reg.regions.remove(&(ptr as u64));
                Ok(())
            }
            _ => Err(Error::invalid_arg(OP, format!("{ptr:p} is not a range map_host registered"))),
        }
    }

    fn copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        crate::device::calls::enter();
        read(src, dst)
    }

    fn copy_from_host(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        crate::device::calls::enter();
        write(dst, src)
    }

    fn create_stream(&self) -> Result<StreamHandle> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::create_stream";
        let id = self.next_stream.fetch_add(1, Ordering::Relaxed);
        let q = HostQueue::spawn(format!("hoccl-host-stream{id}"))?;
        self.streams.lock().map_err(|_| Error::internal(OP, "poisoned"))?.insert(id, q);
        Ok(StreamHandle(id))
    }

    fn destroy_stream(&self, s: StreamHandle) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::destroy_stream";
        let q = self.streams.lock().map_err(|_| Error::internal(OP, "poisoned"))?.remove(&s.0);
        let q = q.ok_or_else(|| Error::invalid_arg(OP, format!("unknown stream {:#x}", s.0)))?;
        // Like cuStreamDestroy: work already queued completes first.
        let n = q.st.enqueued.load(Ordering::Acquire);
        q.wait_for(n);
        q.shutdown();
        Ok(())
    }

    fn write_value(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::write_value";
        Self::check_flag(OP, flag)?;
        self.enqueue(OP, s, Task::Write { addr: flag.0, v })
    }

    fn wait_value_geq(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::wait_value_geq";
        Self::check_flag(OP, flag)?;
        self.enqueue(OP, s, Task::Wait { addr: flag.0, v })
    }

    /// One task on the stream (or in its capture), as `cuStreamBatchMemOp` is one call;
    /// nothing is queued unless every flag checks.
    fn mem_ops(&self, s: StreamHandle, ops: &[MemOp]) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::mem_ops";
        Self::check_mem_ops(OP, ops)?;
        self.enqueue(OP, s, Task::MemOps(ops.to_vec()))
    }

    /// Queued like any task (memory it reads goes through [`read`] and [`write`]); refused
    /// while `s` is captured, since a graph would run it once per launch.
    fn launch_host_fn(&self, s: StreamHandle, f: Box<dyn FnOnce() + Send>) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::launch_host_fn";
        self.not_capturing(OP, s)?;
        self.stream(OP, s)?.push(OP, Task::HostFn(Arc::new(Mutex::new(Some(f))))).map(|_| ())
    }

    fn synchronize(&self, s: StreamHandle) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::synchronize";
        self.not_capturing(OP, s)?;
        let q = self.stream(OP, s)?;
        let n = q.push(OP, Task::Marker)?;
        q.wait_for(n);
        Ok(())
    }

    fn stream_query(&self, s: StreamHandle) -> Result<bool> {
        crate::device::calls::enter();
        self.not_capturing("HostDevice::stream_query", s)?;
        let q = self.stream("HostDevice::stream_query", s)?;
        Ok(q.st.done.load(Ordering::Acquire) >= q.st.enqueued.load(Ordering::Acquire))
    }

    fn stream_capturing(&self, s: StreamHandle) -> Result<bool> {
        const OP: &str = "HostDevice::stream_capturing";
        self.stream(OP, s)?;
        Ok(self.captures.lock().map_err(|_| Error::internal(OP, "capture table poisoned"))?.contains_key(&s.0))
    }

    fn capture_retain(&self, s: StreamHandle, on_release: Box<dyn FnOnce() + Send>) -> Result<()> {
        const OP: &str = "HostDevice::capture_retain";
        let mut c = self.captures.lock().map_err(|_| Error::internal(OP, "capture table poisoned"))?;
        let cap = c.get_mut(&s.0).ok_or_else(|| Error::invalid_usage(OP, format!("stream {:#x} is not being captured", s.0)))?;
        cap.hooks.push(on_release);
        Ok(())
    }

    fn capture_id(&self, s: StreamHandle) -> Result<u64> {
        const OP: &str = "HostDevice::capture_id";
        let c = self.captures.lock().map_err(|_| Error::internal(OP, "capture table poisoned"))?;
        c.get(&s.0).map(|cap| cap.id).ok_or_else(|| Error::invalid_usage(OP, format!("stream {:#x} is not being captured", s.0)))
    }

    fn begin_capture(&self, s: StreamHandle) -> Result<()> {
        const OP: &str = "HostDevice::begin_capture";
        self.stream(OP, s)?;
        let mut c = self.captures.lock().map_err(|_| Error::internal(OP, "capture table poisoned"))?;
        if c.contains_key(&s.0) {
            return Err(Error::invalid_usage(OP, format!("stream {:#x} is already being captured", s.0)));
        }
        static IDS: AtomicU64 = AtomicU64::new(1);
        c.insert(s.0, Capture { id: IDS.fetch_add(1, Ordering::Relaxed), tasks: Vec::new(), hooks: Vec::new() });
        Ok(())
    }

    fn end_capture(&self, s: StreamHandle) -> Result<GraphHandle> {
        const OP: &str = "HostDevice::end_capture";
        let cap = self.captures.lock().map_err(|_| Error::internal(OP, "capture table poisoned"))?.remove(&s.0);
        let cap = cap.ok_or_else(|| Error::invalid_usage(OP, format!("stream {:#x} is not being captured", s.0)))?;
        let id = self.next_graph.fetch_add(1, Ordering::Relaxed);
        let g = HostGraph { tasks: cap.tasks, hooks: cap.hooks, last: None };
        self.graphs.lock().map_err(|_| Error::internal(OP, "graph table poisoned"))?.insert(id, g);
        Ok(GraphHandle(id))
    }

    fn graph_launch(&self, g: GraphHandle, s: StreamHandle) -> Result<()> {
        const OP: &str = "HostDevice::graph_launch";
        let tasks = {
            let mut m = self.graphs.lock().map_err(|_| Error::internal(OP, "graph table poisoned"))?;
            let gr = m.get_mut(&g.0).ok_or_else(|| Error::invalid_arg(OP, format!("unknown graph {}", g.0)))?;
            gr.last = Some(s.0);
            gr.tasks.clone()
        };
        tasks.into_iter().try_for_each(|t| self.enqueue(OP, s, t))
    }

    fn graph_destroy(&self, g: GraphHandle) -> Result<()> {
        const OP: &str = "HostDevice::graph_destroy";
        let gr = self.graphs.lock().map_err(|_| Error::internal(OP, "graph table poisoned"))?.remove(&g.0);
        let gr = gr.ok_or_else(|| Error::invalid_arg(OP, format!("unknown graph {}", g.0)))?;
        let hook = join_hooks(gr.hooks);
        // After the last launch, as CUDA releases a graph's user objects.
        match gr.last.map(|s| self.stream(OP, StreamHandle(s))) {
            Some(Ok(q)) if q.push(OP, Task::Release(hook.clone())).is_ok() => Ok(()),
            _ => {
                run_release(&hook);
                Ok(())
            }
        }
    }

    fn memcpy_async(&self, s: StreamHandle, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::memcpy_async";
        Self::check(OP, dst, len)?;
        Self::check(OP, src, len)?;
        self.enqueue(OP, s, Task::Copy { dst: dst.0, src: src.0, len })
    }

    fn fill_pattern_async(&self, s: StreamHandle, dst: DevPtr, len: usize, seed: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::fill_pattern_async";
        Self::check(OP, dst, len)?;
        self.enqueue(OP, s, Task::Fill { dst: dst.0, len, seed })
    }

    fn reduce_async(&self, s: StreamHandle, dst: DevPtr, srcs: &[DevPtr], count: usize, dtype: DataType, op: RedOp) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "HostDevice::reduce_async";
        if srcs.is_empty() {
            return Err(Error::invalid_arg(OP, "no inputs"));
        }
        let len = dtype.bytes(OP, count)?;
        if len == 0 {
            return Ok(());
        }
        {
            let reg = lock_registry(OP)?;
            reg.check(OP, dst, len)?;
            for p in srcs {
                reg.check(OP, *p, len)?;
            }
            if let RedOp::PreMulSum(crate::reduce::Scalar::Device(p)) = op {
                reg.check(OP, DevPtr(p), dtype.size()).map_err(|e| Error::invalid_arg(OP, format!("PreMulSum scalar: {e}")))?;
            }
        }
        let srcs = srcs.iter().map(|p| p.0).collect();
        self.enqueue(OP, s, Task::Reduce { dst: dst.0, srcs, len, dtype, op })
    }

    fn copy_engine_count(&self) -> usize {
        HOST_COPY_ENGINES
    }

    fn create_copy_queue(&self) -> Result<Box<dyn CopyQueue>> {
        crate::device::calls::enter();
        let q = HostQueue::spawn("hoccl-host-ce".into())?;
        Ok(Box::new(HostCopyQueue { q, fences: Default::default(), next_ticket: 0, completed: 0 }))
    }

    fn memory_in_use(&self) -> Result<MemoryInUse> {
        registry_memory_in_use()
    }
}

// ------------------------------------------------------------------ memory accounting ---

/// The registry's totals: process-wide, since every host device of a process shares it.
fn registry_memory_in_use() -> Result<MemoryInUse> {
    let reg = lock_registry("HostDevice::memory_in_use")?;
    let mut m = MemoryInUse::default();
    for r in reg.regions.values() {
        match r.kind {
            RegionKind::Own { .. } => m.device_bytes += r.len as u64,
            RegionKind::Imported => {
                m.imports += 1;
                m.import_bytes += r.len as u64;
            }
            RegionKind::Flags | RegionKind::HostMapped => m.pinned_host_bytes += r.len as u64,
        }
    }
    Ok(m)
}
