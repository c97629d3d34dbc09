//! NCCL, loaded at run time with dlopen (no build-time dependency): communicators over the
//! same ranks, GPUs, streams and buffers as hoccl, one per variant (default, and limited
//! to k CTAs through `ncclConfig_t.minCTAs/maxCTAs`).
use crate::ctx::{Ctx, Res};
use crate::dl::{site_packages, Lib};
use crate::ops::{Bufs, Geom, OpKind, RED_OP, ROOT};
use hoccl::device::{DevPtr, StreamHandle};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::Arc;

type NcclResult = c_int;
type RawComm = *mut c_void;
type RawStream = *mut c_void;

#[repr(C)]
#[derive(Clone, Copy)]
struct UniqueId {
    internal: [c_char; 128],
}

/// The prefix of `ncclConfig_t` up to `CTAPolicy` (append-only and versioned: NCCL copies
/// `size` bytes and gives every later field its default).
#[repr(C)]
struct NcclConfig {
    size: usize,
    magic: u32,
    version: u32,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
    traffic_class: c_int,
    comm_name: *const c_char,
    collnet_enable: c_int,
    cta_policy: c_int,
}

const UNDEF_INT: c_int = c_int::MIN;

impl NcclConfig {
    fn new(ctas: Option<i32>) -> NcclConfig {
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: 0xcafe_beef,
            version: 22800,
            blocking: 1,
            cga_cluster_size: UNDEF_INT,
            min_ctas: if ctas.is_some() { 1 } else { UNDEF_INT },
            max_ctas: ctas.unwrap_or(UNDEF_INT),
            net_name: std::ptr::null(),
            split_share: UNDEF_INT,
            traffic_class: UNDEF_INT,
            comm_name: std::ptr::null(),
            collnet_enable: UNDEF_INT,
            cta_policy: UNDEF_INT,
        }
    }
}

type FnVersion = unsafe extern "C" fn(*mut c_int) -> NcclResult;
type FnUniqueId = unsafe extern "C" fn(*mut UniqueId) -> NcclResult;
type FnInit = unsafe extern "C" fn(*mut RawComm, c_int, UniqueId, c_int, *mut NcclConfig) -> NcclResult;
type FnComm = unsafe extern "C" fn(RawComm) -> NcclResult;
type FnGroup = unsafe extern "C" fn() -> NcclResult;
type FnSend = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnRecv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnColl = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, RawComm, RawStream) -> NcclResult;
type FnRooted = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnRed = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnRedRooted = unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, c_int, RawComm, RawStream) -> NcclResult;
type FnErrStr = unsafe extern "C" fn(NcclResult) -> *const c_char;
type FnLastErr = unsafe extern "C" fn(RawComm) -> *const c_char;
type FnAsyncErr = unsafe extern "C" fn(RawComm, *mut NcclResult) -> NcclResult;

/// The NCCL entry points the benchmark calls. Optional ones (newer NCCL) fall back to
/// grouped send/recv.
pub struct Api {
    pub lib: Lib,
    pub version: i32,
    unique_id: FnUniqueId,
    init: FnInit,
    destroy: FnComm,
    group_start: FnGroup,
    group_end: FnGroup,
    send: FnSend,
    recv: FnRecv,
    all_gather: FnColl,
    broadcast: FnRooted,
    all_reduce: FnRed,
    reduce_scatter: FnRed,
    reduce: FnRedRooted,
    all_to_all: Option<FnColl>,
    gather: Option<FnRooted>,
    scatter: Option<FnRooted>,
    err_str: Option<FnErrStr>,
    last_err: Option<FnLastErr>,
    async_err: Option<FnAsyncErr>,
}

fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("HOCCL_NCCL_LIB") {
        v.push(p);
    }
    for sp in site_packages() {
        v.push(format!("{sp}/nvidia/nccl/lib/libnccl.so.2"));
        v.push(format!("{sp}/nvidia/cu13/lib/libnccl.so.2"));
    }
    for d in ["/usr/local/cuda/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/local/lib"] {
        v.push(format!("{d}/libnccl.so.2"));
    }
    v.push("libnccl.so.2".into());
    v
}

impl Api {
    /// Load libnccl.so.2 and resolve its symbols; the error says what was tried.
    pub fn load() -> Res<Api> {
        let lib = Lib::open_first(&candidates(), false).map_err(|why| format!("libnccl.so.2 not found ({why}; set HOCCL_NCCL_LIB to its path)"))?;
        macro_rules! req {
            ($name:literal) => {
                // SAFETY: the type annotation at each use is the C prototype from nccl.h.
                unsafe { lib.func($name) }.ok_or_else(|| format!("{}: no symbol {}", lib.path, $name))?
            };
        }
        macro_rules! opt {
            ($name:literal) => {
                // SAFETY: as above.
                unsafe { lib.func($name) }
            };
        }
        let get_version: FnVersion = req!("ncclGetVersion");
        let mut version: c_int = 0;
        // SAFETY: valid out-pointer; ncclGetVersion has no preconditions.
        let r = unsafe { get_version(&mut version) };
        if r != 0 {
            return Err(format!("ncclGetVersion failed ({r})"));
        }
        Ok(Api {
            unique_id: req!("ncclGetUniqueId"),
            init: req!("ncclCommInitRankConfig"),
            destroy: req!("ncclCommDestroy"),
            group_start: req!("ncclGroupStart"),
            group_end: req!("ncclGroupEnd"),
            send: req!("ncclSend"),
            recv: req!("ncclRecv"),
            all_gather: req!("ncclAllGather"),
            broadcast: req!("ncclBroadcast"),
            all_reduce: req!("ncclAllReduce"),
            reduce_scatter: req!("ncclReduceScatter"),
            reduce: req!("ncclReduce"),
            all_to_all: opt!("ncclAlltoAll"),
            gather: opt!("ncclGather"),
            scatter: opt!("ncclScatter"),
            err_str: opt!("ncclGetErrorString"),
            last_err: opt!("ncclGetLastError"),
            async_err: opt!("ncclCommGetAsyncError"),
            version,
            lib,
        })
    }

    /// "2.28.9" from 22809.
    pub fn version_string(&self) -> String {
        let v = self.version;
        if v >= 10000 {
            format!("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100)
        } else {
            format!("{}.{}.{}", v / 1000, (v / 100) % 10, v % 100)
        }
    }

    fn error(&self, call: &str, r: NcclResult, comm: RawComm) -> String {
        let mut s = format!("{call} failed: NCCL error {r}");
        if let Some(f) = self.err_str {
            // SAFETY: ncclGetErrorString returns a static NUL-terminated string for any code.
            let p = unsafe { f(r) };
            if !p.is_null() {
                // SAFETY: non-null static C string (above).
                s += &format!(" ({})", unsafe { CStr::from_ptr(p) }.to_string_lossy());
            }
        }
        if let (Some(f), false) = (self.last_err, comm.is_null()) {
            // SAFETY: comm is a live communicator; the result is a C string owned by NCCL.
            let p = unsafe { f(comm) };
            if !p.is_null() {
                // SAFETY: non-null C string (above), copied at once.
                let m = unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned();
                if !m.is_empty() {
                    s += &format!(": {m}");
                }
            }
        }
        s
    }

    fn check(&self, call: &str, r: NcclResult, comm: RawComm) -> Res<()> {
        if r == 0 {
            Ok(())
        } else {
            Err(self.error(call, r, comm))
        }
    }
}

/// One NCCL communicator over all ranks.
pub struct NcclComm {
    api: Arc<Api>,
    raw: RawComm,
    /// "nccl" or "nccl-ctaK".
    pub label: String,
}

impl NcclComm {
    /// Collective over the ranks of `ctx`: rank 0 makes the unique id and the control
    /// bootstrap distributes it. The caller's thread must have the GPU's context current.
    pub fn init(ctx: &Ctx, api: &Arc<Api>, ctas: Option<i32>) -> Res<NcclComm> {
        let mut id = UniqueId { internal: [0; 128] };
        let mut rec = Vec::new();
        if ctx.is_root() {
            // SAFETY: valid out-pointer to a 128-byte ncclUniqueId.
            match api.check("ncclGetUniqueId", unsafe { (api.unique_id)(&mut id) }, std::ptr::null_mut()) {
                // SAFETY: reading the 128 initialized bytes of id as u8.
                Ok(()) => rec = unsafe { std::slice::from_raw_parts(id.internal.as_ptr() as *const u8, 128) }.to_vec(),
                Err(e) => eprintln!("bench: {e}"),
            }
        }
        let all = ctx.gather(&rec)?;
        if all[0].len() != 128 {
            return Err("rank 0 could not create an NCCL unique id".into());
        }
        for (d, s) in id.internal.iter_mut().zip(&all[0]) {
            *d = *s as c_char;
        }
        let mut cfg = NcclConfig::new(ctas);
        let mut raw: RawComm = std::ptr::null_mut();
        // SAFETY: valid out-pointer; id is the same 128 bytes on every rank; cfg is a valid
        // versioned prefix of ncclConfig_t that lives across the call.
        let r = unsafe { (api.init)(&mut raw, ctx.n as c_int, id, ctx.rank as c_int, &mut cfg) };
        let ok = r == 0;
        let result = api.check("ncclCommInitRankConfig", r, std::ptr::null_mut());
        let label = ctas.map_or("nccl".to_string(), |k| format!("nccl-cta{k}"));
        let comm = NcclComm { api: api.clone(), raw, label };
        if !ctx.all(ok)? {
            return Err(result.err().unwrap_or_else(|| "NCCL initialization failed on another rank".into()));
        }
        Ok(comm)
    }

    /// Enqueue one `op` on `s` with the same buffers hoccl uses.
    pub fn issue(&self, g: &Geom, b: &Bufs, dt: hoccl::DataType, s: StreamHandle, rank: usize, n: usize) -> Res<()> {
        if g.send_len > b.send_len || g.recv_len > b.recv_len {
            return Err(format!("{}: buffers too short for a {}-byte {}", self.label, g.bytes, g.op.name()));
        }
        let ptr = |p: DevPtr| p.0 as usize as *mut c_void;
        // SAFETY: the buffers are live device allocations of this GPU at least as long as
        // the geometry needs (checked above; null only where the op leaves them unused on
        // this rank), `s` is a live stream of this GPU and self.raw a live communicator.
        unsafe { self.issue_raw(g, ptr(b.send), ptr(b.recv), dt as c_int, s.0 as usize as RawStream, rank, n) }
    }

    /// # Safety
    /// `sb`/`rb` must be device memory valid for `g.send_len`/`g.recv_len` bytes (or unused
    /// by `g.op` on this rank) until the op completes on `st`, a live stream of this GPU.
    /// (hoccl numbers data types as `ncclDataType_t` does, so `t` is `DataType as i32`.)
    #[allow(clippy::too_many_arguments)]
    unsafe fn issue_raw(&self, g: &Geom, sb: *mut c_void, rb: *mut c_void, t: c_int, st: RawStream, rank: usize, n: usize) -> Res<()> {
        let (a, c, cnt) = (&self.api, self.raw, g.count);
        let root = ROOT as c_int;
        let off = |p: *mut c_void, j: usize| (p as usize + j * g.block) as *mut c_void;
        let send = |p, peer: usize| a.check("ncclSend", (a.send)(p, cnt, t, peer as c_int, c, st), c);
        let recv = |p, peer: usize| a.check("ncclRecv", (a.recv)(p, cnt, t, peer as c_int, c, st), c);
        match (g.op, a.all_to_all, a.gather, a.scatter) {
            (OpKind::SendRecv, ..) => self.grouped(|| {
                send(sb, (rank + 1) % n)?;
                recv(rb, (rank + n - 1) % n)
            }),
            (OpKind::AllGather, ..) => a.check("ncclAllGather", (a.all_gather)(sb, rb, cnt, t, c, st), c),
            (OpKind::Broadcast, ..) => {
                let src = if rank == ROOT { sb } else { rb };
                a.check("ncclBroadcast", (a.broadcast)(src, rb, cnt, t, root, c, st), c)
            }
            (OpKind::AlltoAll, Some(f), ..) => a.check("ncclAlltoAll", f(sb, rb, cnt, t, c, st), c),
            (OpKind::AlltoAll, None, ..) => self.grouped(|| (0..n).try_for_each(|j| send(off(sb, j), j).and_then(|_| recv(off(rb, j), j)))),
            (OpKind::Gather, _, Some(f), _) => a.check("ncclGather", f(sb, rb, cnt, t, root, c, st), c),
            (OpKind::Gather, _, None, _) => self.grouped(|| {
                send(sb, ROOT)?;
                (0..n).filter(|_| rank == ROOT).try_for_each(|j| recv(off(rb, j), j))
            }),
            (OpKind::Scatter, _, _, Some(f)) => a.check("ncclScatter", f(sb, rb, cnt, t, root, c, st), c),
            (OpKind::Scatter, _, _, None) => self.grouped(|| {
                (0..n).filter(|_| rank == ROOT).try_for_each(|j| send(off(sb, j), j))?;
                recv(rb, ROOT)
            }),
            // ncclRedOp_t and hoccl's RedOp share their numbering.
            (OpKind::AllReduce, ..) => a.check("ncclAllReduce", (a.all_reduce)(sb, rb, cnt, t, RED_OP.raw(), c, st), c),
            (OpKind::ReduceScatter, ..) => a.check("ncclReduceScatter", (a.reduce_scatter)(sb, rb, cnt, t, RED_OP.raw(), c, st), c),
            (OpKind::Reduce, ..) => a.check("ncclReduce", (a.reduce)(sb, rb, cnt, t, RED_OP.raw(), root, c, st), c),
        }
    }

    /// Run `f` between ncclGroupStart and ncclGroupEnd (the group is closed even if `f` fails).
    fn grouped(&self, f: impl FnOnce() -> Res<()>) -> Res<()> {
        let a = &self.api;
        // SAFETY: group calls take no arguments and nest.
        a.check("ncclGroupStart", unsafe { (a.group_start)() }, self.raw)?;
        let r = f();
        // SAFETY: closes the group opened above.
        let e = a.check("ncclGroupEnd", unsafe { (a.group_end)() }, self.raw);
        r.and(e)
    }

    /// An asynchronous error NCCL recorded on this communicator, if any.
    pub fn async_error(&self) -> Res<()> {
        let Some(f) = self.api.async_err else { return Ok(()) };
        let mut st: NcclResult = 0;
        // SAFETY: live communicator, valid out-pointer.
        self.api.check("ncclCommGetAsyncError", unsafe { f(self.raw, &mut st) }, self.raw)?;
        self.api.check("NCCL (asynchronous)", st, self.raw)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.raw.is_null() {
            return;
        }
        // SAFETY: raw is a communicator created by ncclCommInitRankConfig, destroyed once.
        let r = unsafe { (self.api.destroy)(self.raw) };
        if r != 0 {
            eprintln!("bench: {}", self.api.error("ncclCommDestroy", r, std::ptr::null_mut()));
        }
    }
}

// SAFETY: an NCCL communicator may be used from any thread as long as calls on it do not
// overlap; moving the owner to another thread cannot make calls overlap. (Not Sync: the
// one place that lends it to a second thread says why that is exclusive, interference.rs.)
unsafe impl Send for NcclComm {}

/// NCCL for this run: the communicators, or the reason there are none.
pub struct Nccl {
    pub api: Option<Arc<Api>>,
    pub comms: Vec<NcclComm>,
    pub note: Option<String>,
}

/// Load NCCL and create the default communicator (plus one per CTA limit in `ctas`), or
/// say why not. Every rank reaches the same decision.
pub fn setup(ctx: &Ctx, ctas: &[i32]) -> Res<Nccl> {
    let skip = |why: String| Ok(Nccl { api: None, comms: Vec::new(), note: Some(format!("NCCL comparison skipped: {why}")) });
    let api = Api::load();
    if !ctx.all(api.is_ok())? {
        let mine = api.as_ref().err().cloned().unwrap_or_default();
        let first_bad = ctx.gather(mine.as_bytes())?.into_iter().find(|r| !r.is_empty()).unwrap_or_default();
        return skip(String::from_utf8_lossy(&first_bad).into_owned());
    }
    let api = Arc::new(api?);
    if !ctx.cuda {
        return skip(format!("{} loaded from {}, but the host backend has no GPU", api.version_string(), api.lib.path));
    }
    if ctx.shared_gpu_ranks > 0 {
        return skip(format!("{} ranks share one GPU (NCCL needs a GPU per rank)", ctx.shared_gpu_ranks));
    }
    ctx.dev.bind_thread().map_err(|e| format!("bind GPU context: {e}"))?;
    let mut comms = Vec::new();
    for v in std::iter::once(None).chain(ctas.iter().map(|k| Some(*k))) {
        match NcclComm::init(ctx, &api, v) {
            Ok(c) => comms.push(c),
            Err(e) if comms.is_empty() => return skip(format!("initialization failed: {e}")),
            Err(e) => eprintln!("bench: rank {}: NCCL variant {v:?} skipped: {e}", ctx.rank),
        }
    }
    Ok(Nccl { api: Some(api), comms, note: None })
}
