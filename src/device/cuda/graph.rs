//! Graph capture support: attaching a release hook to the graph a stream is captured into
//! (a user object the graph retains), relaxing the calling thread's capture mode around
//! allocations, and the capture/instantiate/launch/destroy calls the tests drive (the
//! application captures with the CUDA runtime; hoccl itself never begins a capture).
//!
//! These driver calls are optional (CUDA 12.3 and later have them all): without them a
//! captured operation between ranks fails with `InvalidUsage`, nothing else changes.
use super::driver::{check, has_symbols};
use super::{cu_stream, lock, CudaDevice};
use crate::device::{GraphHandle, StreamHandle};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

const SYMBOLS: &[&str] = &[
    "cuStreamGetCaptureInfo_v3",
    "cuUserObjectCreate",
    "cuUserObjectRelease",
    "cuGraphRetainUserObject",
    "cuThreadExchangeStreamCaptureMode",
    "cuStreamBeginCapture_v2",
    "cuStreamEndCapture",
    "cuGraphInstantiateWithFlags",
    "cuGraphLaunch",
    "cuGraphExecDestroy",
    "cuGraphDestroy",
];

fn require(op: &'static str) -> Result<()> {
    if has_symbols(SYMBOLS) {
        return Ok(());
    }
    Err(Error::invalid_usage(op, "the NVIDIA driver has no graph user objects (CUDA 12.3 or later needed)"))
}

/// Graphs made by `end_capture`: id -> (CUgraph, CUgraphExec) as addresses.
static GRAPHS: Mutex<BTreeMap<u64, (usize, usize)>> = Mutex::new(BTreeMap::new());
static NEXT_GRAPH: AtomicU64 = AtomicU64::new(1);

type Hook = Box<dyn FnOnce() + Send>;

/// A user object's payload: the hook, taken out unrun when the graph could not retain it.
type Payload = Mutex<Option<Hook>>;

/// The user object's destructor: runs the hook once, on a driver thread; never unwinds.
unsafe extern "C" fn release_hook(p: *mut c_void) {
    // SAFETY: p is the Box<Payload> leaked in `capture_retain`, passed to exactly one
    // destructor call by the driver.
    let payload = unsafe { Box::from_raw(p as *mut Payload) };
    let hook = payload.lock().ok().and_then(|mut g| g.take());
    if let Some(hook) = hook {
        if std::panic::catch_unwind(std::panic::AssertUnwindSafe(hook)).is_err() {
            log::error!("hoccl: a graph's release hook panicked");
        }
    }
}

impl CudaDevice {
    /// The active capture `s` is in: its sequence id and graph.
    fn capture_info(&self, op: &'static str, s: StreamHandle) -> Result<(u64, sys::CUgraph)> {
        require(op)?;
        let _g = self.enter(op)?;
        let mut status = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        let mut id: sys::cuuint64_t = 0;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        let mut deps: *const sys::CUgraphNode = std::ptr::null();
        let mut edges: *const sys::CUgraphEdgeData = std::ptr::null();
        let mut ndeps: usize = 0;
        // SAFETY: valid out-pointers; the driver validates the stream.
        check(op, "cuStreamGetCaptureInfo_v3", unsafe {
            sys::cuStreamGetCaptureInfo_v3(cu_stream(s), &mut status, &mut id, &mut graph, &mut deps, &mut edges, &mut ndeps)
        })?;
        if status != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_ACTIVE || graph.is_null() {
            return Err(Error::invalid_usage(op, format!("stream {:#x} is not being captured (status {status:?})", s.0)));
        }
        Ok((id, graph))
    }

    pub(super) fn graph_capture_id(&self, s: StreamHandle) -> Result<u64> {
        self.capture_info("Device::capture_id", s).map(|(id, _)| id)
    }

    pub(super) fn graph_capture_retain(&self, s: StreamHandle, on_release: Hook) -> Result<()> {
        const OP: &str = "Device::capture_retain";
        let (_, graph) = self.capture_info(OP, s)?;
        let _g = self.enter(OP)?;
        let p = Box::into_raw(Box::new(Payload::new(Some(on_release)))) as *mut c_void;
        let mut obj: sys::CUuserObject = std::ptr::null_mut();
        let flags = sys::CUuserObject_flags::CU_USER_OBJECT_NO_DESTRUCTOR_SYNC as u32;
        // SAFETY: p stays valid until the destructor takes it back; release_hook never unwinds.
        let made = check(OP, "cuUserObjectCreate", unsafe { sys::cuUserObjectCreate(&mut obj, p, Some(release_hook), 1, flags) });
        if let Err(e) = made {
            // SAFETY: the driver did not take p: take it back (the hook is dropped unrun).
            drop(unsafe { Box::from_raw(p as *mut Payload) });
            return Err(e);
        }
        let mv = sys::CUuserObjectRetain_flags::CU_GRAPH_USER_OBJECT_MOVE as u32;
        // SAFETY: graph is the capturing graph, obj a live user object whose one reference
        // moves to the graph.
        let r = check(OP, "cuGraphRetainUserObject", unsafe { sys::cuGraphRetainUserObject(graph, obj, 1, mv) });
        if r.is_err() {
            // The hook is dropped unrun (the caller releases what it holds), then the
            // reference that was not moved is dropped, which frees the payload.
            // SAFETY: p stays valid until the destructor runs, which needs that reference.
            drop(unsafe { &*(p as *const Payload) }.lock().ok().and_then(|mut g| g.take()));
            // SAFETY: obj is live and this is its one reference.
            unsafe { sys::cuUserObjectRelease(obj, 1) };
        }
        r
    }

    pub(super) fn graph_relaxed<'a>(&self, f: &mut (dyn FnMut() -> Result<()> + 'a)) -> Result<()> {
        const OP: &str = "Device::relaxed_capture";
        if !has_symbols(SYMBOLS) {
            return f();
        }
        let mut mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED;
        // SAFETY: valid in/out pointer; affects only the calling thread.
        check(OP, "cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) })?;
        let r = f();
        // SAFETY: as above; restores the thread's previous mode.
        let back = check(OP, "cuThreadExchangeStreamCaptureMode", unsafe { sys::cuThreadExchangeStreamCaptureMode(&mut mode) });
        r.and(back)
    }

    pub(super) fn graph_begin(&self, s: StreamHandle) -> Result<()> {
        const OP: &str = "Device::begin_capture";
        require(OP)?;
        let _g = self.enter(OP)?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        // SAFETY: the driver validates the stream.
        check(OP, "cuStreamBeginCapture_v2", unsafe { sys::cuStreamBeginCapture_v2(cu_stream(s), mode) })
    }

    pub(super) fn graph_end(&self, s: StreamHandle) -> Result<GraphHandle> {
        const OP: &str = "Device::end_capture";
        require(OP)?;
        let _g = self.enter(OP)?;
        let mut graph: sys::CUgraph = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the driver validates the stream.
        check(OP, "cuStreamEndCapture", unsafe { sys::cuStreamEndCapture(cu_stream(s), &mut graph) })?;
        let mut exec: sys::CUgraphExec = std::ptr::null_mut();
        // SAFETY: graph was just made by the capture; valid out-pointer.
        let r = check(OP, "cuGraphInstantiateWithFlags", unsafe { sys::cuGraphInstantiateWithFlags(&mut exec, graph, 0) });
        if let Err(e) = r {
            // SAFETY: graph is ours and not instantiated.
            unsafe { sys::cuGraphDestroy(graph) };
            return Err(e);
        }
        let id = NEXT_GRAPH.fetch_add(1, Ordering::Relaxed);
        lock(&GRAPHS).insert(id, (graph as usize, exec as usize));
        Ok(GraphHandle(id))
    }

    pub(super) fn graph_run(&self, g: GraphHandle, s: StreamHandle) -> Result<()> {
        const OP: &str = "Device::graph_launch";
        let (_, exec) = lock(&GRAPHS).get(&g.0).copied().ok_or_else(|| Error::invalid_arg(OP, format!("unknown graph {}", g.0)))?;
        let _g = self.enter(OP)?;
        // SAFETY: exec is a live executable graph (removed from the table only when destroyed).
        check(OP, "cuGraphLaunch", unsafe { sys::cuGraphLaunch(exec as sys::CUgraphExec, cu_stream(s)) })
    }

    pub(super) fn graph_free(&self, g: GraphHandle) -> Result<()> {
        const OP: &str = "Device::graph_destroy";
        let (graph, exec) = lock(&GRAPHS).remove(&g.0).ok_or_else(|| Error::invalid_arg(OP, format!("unknown graph {}", g.0)))?;
        let _g = self.enter(OP)?;
        // SAFETY: both were made by graph_end and are destroyed once (removed above); the
        // driver lets enqueued launches complete and then releases the user objects.
        let a = check(OP, "cuGraphExecDestroy", unsafe { sys::cuGraphExecDestroy(exec as sys::CUgraphExec) });
        // SAFETY: as above.
        let b = check(OP, "cuGraphDestroy", unsafe { sys::cuGraphDestroy(graph as sys::CUgraph) });
        a.and(b)
    }
}
