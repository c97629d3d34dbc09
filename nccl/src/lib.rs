//! `libnccl.so.2`: NCCL 2.28's C API (`include/hoccl-nccl/nccl.h`) with NCCL's ABI, every
//! call served by hoccl, so programs built for NCCL (PyTorch, vLLM's binding, NCCL's test
//! programs) run on hoccl when the dynamic loader finds this library first.
//!
//! It is one more surface of hoccl's call funnel: each collective decodes NCCL's values into
//! the one descriptor, `hoccl::OpDesc`, and calls `Communicator::enqueue`, which validates it
//! exactly as for the Rust, C++ and C APIs. This crate checks only what is the ABI's own
//! (NULL handles and out-pointers, `ncclConfig_t`, operators made by
//! `ncclRedOpCreatePreMulSum`).
//!
//! Every entry point is exported twice, as `ncclX` and as its profiling alias `pncclX`
//! (NCCL's own export map has both; `libnccl.map` keeps every other symbol local). No entry
//! point unwinds: a panic becomes `ncclInternalError`. A failure's message is kept per
//! thread for `ncclGetLastError` and logged at warn. `nccl/symbols.txt` lists what is
//! implemented, accepted without work, or refused.
#![allow(non_snake_case, non_camel_case_types)]
mod abi;
mod comm;

use abi::*;
use comm::{live, ncclComm_t};
use hoccl::surface::put;
use hoccl::reduce::Scalar;
use hoccl::{Collective, Communicator, DataType, DevPtr, Device, Error, OpDesc, RedOp, Result, StreamHandle, UniqueId};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicI32, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// `cudaStream_t`: a stream of the communicator's GPU (on the host backend, 0).
pub type cudaStream_t = *mut c_void;
/// `ncclWindow_t`: opaque; registration hands out a token.
pub type ncclWindow_t = *mut c_void;
/// `ncclDataType_t`, `ncclRedOp_t`, `ncclScalarResidence_t`: received as plain ints so that
/// an out-of-range value is an error, not undefined behaviour.
pub type ncclDataType_t = c_int;
pub type ncclRedOp_t = c_int;
pub type ncclScalarResidence_t = c_int;
/// `ncclUniqueId`: hoccl's TCP rendezvous id has its 128 bytes.
pub type ncclUniqueId = UniqueId;

/// Export `ncclX` and its alias `pncclX` (which calls it).
macro_rules! nccl_api {
    ($(#[$m:meta])* fn $name:ident / $alias:ident ($($arg:ident : $ty:ty),* $(,)?) -> $ret:ty $body:block) => {
        $(#[$m])*
        #[no_mangle]
        pub extern "C" fn $name($($arg: $ty),*) -> $ret $body

        #[doc = concat!("`", stringify!($alias), "`: `", stringify!($name), "` under NCCL's profiling name.")]
        #[no_mangle]
        pub extern "C" fn $alias($($arg: $ty),*) -> $ret {
            $name($($arg),*)
        }
    };
}

// ---------------------------------------------------------------- plumbing ---------------

/// Record and log a failure; its NCCL code.
fn fail(e: &Error) -> ncclResult_t {
    log::warn!("{e}");
    comm::set_last_error(e);
    result_of(e.code())
}

/// Run one entry point: panics are caught, failures recorded for `ncclGetLastError`.
fn call(op: &'static str, f: impl FnOnce() -> Result<()>) -> ncclResult_t {
    match hoccl::guarded(op, f) {
        Ok(()) => NCCL_SUCCESS,
        Err(e) => fail(&e),
    }
}

/// A function this library exports but does not implement: `ncclInvalidUsage` and why.
fn refuse(op: &'static str, why: &str) -> ncclResult_t {
    fail(&Error::invalid_usage(op, format!("not supported by hoccl's NCCL library: {why}")))
}

/// `NCCL_DEBUG` (when `HOCCL_LOG` is unset) sets hoccl's log level; VERSION, INFO and TRACE
/// print one banner line naming hoccl. Once per process, before the first communicator.
pub(crate) fn logging() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let level = std::env::var("NCCL_DEBUG").ok();
        let mapped = level.as_deref().map(|l| (l, debug_filter(l)));
        if std::env::var_os("HOCCL_LOG").is_none() {
            if let Some((_, Some((filter, _)))) = mapped {
                hoccl::config::init_logging(Some(filter));
            }
        }
        match mapped {
            Some((_, Some((_, true)))) => println!(
                "NCCL version {}.{}.{} served by hoccl {} (libnccl.so.2 built from hoccl)",
                NCCL_VERSION_CODE / 10000,
                NCCL_VERSION_CODE / 100 % 100,
                NCCL_VERSION_CODE % 100,
                env!("CARGO_PKG_VERSION")
            ),
            Some((l, None)) => log::warn!("NCCL_DEBUG={l}: want NONE, VERSION, WARN, INFO, ABORT or TRACE; ignored"),
            _ => {}
        }
    });
}

fn dev_ptr(p: *const c_void) -> DevPtr {
    DevPtr(p as usize as u64)
}

fn stream(s: cudaStream_t) -> StreamHandle {
    StreamHandle(s as usize as u64)
}

/// An operator made by `ncclRedOpCreatePreMulSum`: its data type, its scalar, and the
/// communicator it belongs to (NCCL's operators are per communicator).
struct PreMul {
    dtype: DataType,
    scalar: Scalar,
    comm: usize,
}

/// Operators made by `ncclRedOpCreatePreMulSum` and not yet destroyed.
fn premul_ops() -> &'static Mutex<HashMap<c_int, PreMul>> {
    static S: OnceLock<Mutex<HashMap<c_int, PreMul>>> = OnceLock::new();
    S.get_or_init(Default::default)
}

/// Decode a reduction operator of a collective on `comm` over `dtype`: a built-in one, or a
/// PreMulSum operator made for that communicator and that data type.
fn red_op(op: &'static str, v: ncclRedOp_t, comm: ncclComm_t, dtype: ncclDataType_t) -> Result<RedOp> {
    if v < NCCL_NUM_OPS {
        return RedOp::from_raw(op, v);
    }
    let ops = premul_ops().lock().unwrap_or_else(|p| p.into_inner());
    let Some(m) = ops.get(&v) else { return RedOp::from_raw(op, v) };
    if m.comm != comm as usize {
        return Err(Error::invalid_arg(op, format!("operator {v} was made by ncclRedOpCreatePreMulSum for another communicator")));
    }
    let dt = DataType::from_raw(op, dtype)?;
    if m.dtype != dt {
        return Err(Error::invalid_arg(op, format!("operator {v} was made for {} data, the call is on {}", m.dtype.name(), dt.name())));
    }
    Ok(RedOp::PreMulSum(m.scalar))
}

/// Validate and enqueue one operation through hoccl's funnel (kept for the group's end
/// when `comm`'s creation was deferred there).
fn enqueue(op: &'static str, comm: ncclComm_t, desc: impl FnOnce() -> Result<OpDesc<'static>>) -> ncclResult_t {
    call(op, || comm::enqueue(op, comm, desc))
}

/// The descriptor of an operation without per-rank arrays.
fn desc(coll: Collective<'static>, send: *const c_void, recv: *mut c_void, count: usize, op: &'static str, dtype: ncclDataType_t, s: cudaStream_t) -> Result<OpDesc<'static>> {
    Ok(OpDesc { coll, send: dev_ptr(send), recv: dev_ptr(recv), count, dtype: DataType::from_raw(op, dtype)?, stream: stream(s) })
}

// ---------------------------------------------------------------- library ----------------

nccl_api! {
    /// `NCCL_VERSION_CODE` of the API implemented: 22809 (2.28.9).
    fn ncclGetVersion / pncclGetVersion(version: *mut c_int) -> ncclResult_t {
        const OP: &str = "ncclGetVersion";
        call(OP, || put(OP, "version", version, NCCL_VERSION_CODE))
    }
}

nccl_api! {
    fn ncclGetErrorString / pncclGetErrorString(result: ncclResult_t) -> *const c_char {
        error_string(result).as_ptr()
    }
}

nccl_api! {
    /// The calling thread's last failure ("" if none), whatever `comm` is.
    fn ncclGetLastError / pncclGetLastError(_comm: ncclComm_t) -> *const c_char {
        comm::last_error()
    }
}

nccl_api! {
    /// Accepted: the log level is read once, at the first call that needs it.
    fn ncclResetDebugInit / pncclResetDebugInit() -> () {
        log::debug!("ncclResetDebugInit: hoccl reads NCCL_DEBUG once per process");
    }
}

// ---------------------------------------------------------------- communicators ----------

nccl_api! {
    /// A fresh TCP rendezvous (its root thread runs in this process) on the interface
    /// `HOCCL_SOCKET_IFNAME` chooses.
    fn ncclGetUniqueId / pncclGetUniqueId(uniqueId: *mut ncclUniqueId) -> ncclResult_t {
        const OP: &str = "ncclGetUniqueId";
        call(OP, || {
            logging();
            // Checked before the rendezvous starts: its root thread would listen forever.
            put(OP, "uniqueId", uniqueId, ncclUniqueId { internal: [0; 128] })?;
            let cfg = hoccl::Config::from_env().map_err(|e| e.with_op(OP))?;
            put(OP, "uniqueId", uniqueId, Communicator::unique_id(&cfg).map_err(|e| e.with_op(OP))?)
        })
    }
}

/// `*comm` becomes NULL first, so a failed creation never leaves a stale handle there.
/// Inside a group the creation is deferred to the outermost `ncclGroupEnd` (`comm.rs`):
/// the handle is written at once and made usable there.
fn create(op: &'static str, comm: *mut ncclComm_t, f: impl FnOnce() -> Result<ncclComm_t>) -> ncclResult_t {
    call(op, || {
        put(op, "comm", comm, std::ptr::null_mut())?;
        put(op, "comm", comm, f()?)
    })
}

nccl_api! {
    fn ncclCommInitRank / pncclCommInitRank(comm: *mut ncclComm_t, nranks: c_int, commId: ncclUniqueId, rank: c_int) -> ncclResult_t {
        const OP: &str = "ncclCommInitRank";
        create(OP, comm, || comm::init_rank(OP, &commId, nranks, rank, std::ptr::null()))
    }
}

nccl_api! {
    /// `config` may be NULL; `blocking = 0` is accepted (outside a group, creation
    /// completes before the call returns).
    fn ncclCommInitRankConfig / pncclCommInitRankConfig(comm: *mut ncclComm_t, nranks: c_int, commId: ncclUniqueId, rank: c_int, config: *mut ncclConfig_t) -> ncclResult_t {
        const OP: &str = "ncclCommInitRankConfig";
        create(OP, comm, || comm::init_rank(OP, &commId, nranks, rank, config))
    }
}

nccl_api! {
    /// Every rank passes the same ids; hoccl's bootstrap needs one root, so the first id
    /// serves.
    fn ncclCommInitRankScalable / pncclCommInitRankScalable(newcomm: *mut ncclComm_t, nranks: c_int, myrank: c_int, nId: c_int, commIds: *mut ncclUniqueId, config: *mut ncclConfig_t) -> ncclResult_t {
        const OP: &str = "ncclCommInitRankScalable";
        create(OP, newcomm, || {
            comm::init_rank(OP, &first_id(OP, nId, commIds)?, nranks, myrank, config)
        })
    }
}

/// The first of the caller's `n` ids.
fn first_id(op: &'static str, n: c_int, ids: *const ncclUniqueId) -> Result<ncclUniqueId> {
    if n < 1 || ids.is_null() {
        return Err(Error::invalid_arg(op, format!("{n} ids at {ids:p}: want at least one")));
    }
    // SAFETY: non-NULL and n >= 1: the caller's array holds at least one id.
    Ok(unsafe { *ids })
}

/// Rank i's GPU for `ncclCommInitAll`: `devlist[i]`, or i when it is NULL.
fn devices(op: &'static str, devlist: *const c_int, n: usize) -> Result<Vec<usize>> {
    if devlist.is_null() {
        return Ok((0..n).collect());
    }
    // SAFETY: non-NULL; the contract is one device per rank, ndev entries.
    let d = unsafe { std::slice::from_raw_parts(devlist, n) };
    d.iter().map(|&v| hoccl::rank_arg(op, "devlist entry", v)).collect()
}

/// Write the handles of `ncclCommInitAll` (`comm` checked non-NULL, room for all of them).
fn put_all(comm: *mut ncclComm_t, comms: &[ncclComm_t]) {
    // SAFETY: the caller checked comm non-NULL; the contract is room for ndev handles.
    unsafe { std::ptr::copy_nonoverlapping(comms.as_ptr(), comm, comms.len()) };
}

nccl_api! {
    /// `ndev` ranks in this process, one thread each; rank i on `devlist[i]` (GPU i when
    /// NULL; any GPU may carry several ranks).
    fn ncclCommInitAll / pncclCommInitAll(comm: *mut ncclComm_t, ndev: c_int, devlist: *const c_int) -> ncclResult_t {
        const OP: &str = "ncclCommInitAll";
        call(OP, || {
            if comm.is_null() {
                return Err(Error::invalid_arg(OP, "comm is NULL"));
            }
            let n = hoccl::rank_arg(OP, "ndev", ndev)?;
            if n == 0 {
                return Err(Error::invalid_arg(OP, "ndev is 0"));
            }
            put_all(comm, &vec![std::ptr::null_mut(); n]);
            put_all(comm, &comm::init_all(OP, &devices(OP, devlist, n)?)?);
            Ok(())
        })
    }
}

nccl_api! {
    /// Collective over `comm`: ranks of one color form a communicator, ordered by key;
    /// `NCCL_SPLIT_NOCOLOR` gets NULL. `config` NULL inherits the parent's options.
    fn ncclCommSplit / pncclCommSplit(comm: ncclComm_t, color: c_int, key: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t) -> ncclResult_t {
        const OP: &str = "ncclCommSplit";
        create(OP, newcomm, || comm::split(OP, comm, color, key, config))
    }
}

nccl_api! {
    /// Every rank not in `excludeRanksList` calls it (the excluded ranks do not; they may be
    /// dead): the survivors form a new communicator, ranks renumbered in parent order.
    /// `NCCL_SHRINK_ABORT` aborts the parent's operations first; `NCCL_SHRINK_DEFAULT` leaves
    /// them. `config` NULL inherits the parent's options. Bounded by hoccl's timeout.
    fn ncclCommShrink / pncclCommShrink(comm: ncclComm_t, excludeRanksList: *mut c_int, excludeRanksCount: c_int, newcomm: *mut ncclComm_t, config: *mut ncclConfig_t, shrinkFlags: c_int) -> ncclResult_t {
        const OP: &str = "ncclCommShrink";
        create(OP, newcomm, || {
            let abort = match shrinkFlags {
                NCCL_SHRINK_DEFAULT => false,
                NCCL_SHRINK_ABORT => true,
                f => return Err(Error::invalid_arg(OP, format!("shrinkFlags {f:#x} (want NCCL_SHRINK_DEFAULT or NCCL_SHRINK_ABORT)"))),
            };
            let n = hoccl::rank_arg(OP, "excludeRanksCount", excludeRanksCount)?;
            let list: &[c_int] = if n == 0 {
                &[]
            } else if excludeRanksList.is_null() {
                return Err(Error::invalid_arg(OP, format!("excludeRanksList is NULL with excludeRanksCount {n}")));
            } else {
                // SAFETY: non-NULL; the contract is excludeRanksCount readable entries.
                unsafe { std::slice::from_raw_parts(excludeRanksList, n) }
            };
            let exclude = list.iter().map(|&r| hoccl::rank_arg(OP, "excludeRanksList entry", r)).collect::<Result<Vec<_>>>()?;
            comm::shrink(OP, comm, exclude, abort, config)
        })
    }
}

nccl_api! {
    /// Fails `comm`'s pending operations and releases their streams, keeping the
    /// communicator for split, shrink, destroy and abort (`comm::revoke`).
    fn ncclCommRevoke / pncclCommRevoke(comm: ncclComm_t, revokeFlags: c_int) -> ncclResult_t {
        const OP: &str = "ncclCommRevoke";
        call(OP, || comm::revoke(OP, comm, revokeFlags))
    }
}

nccl_api! {
    /// Waits until every operation issued on `comm` completed (bounded by hoccl's timeout).
    /// Refused (`ncclInvalidArgument`) after `ncclCommRevoke`, as NCCL's.
    /// On the host backend this includes the default stream's queued work, which is how a
    /// program without CUDA waits for results on stream 0.
    fn ncclCommFinalize / pncclCommFinalize(comm: ncclComm_t) -> ncclResult_t {
        const OP: &str = "ncclCommFinalize";
        call(OP, || {
            let c = comm::finalize(OP, comm)?;
            c.wait_idle().map_err(|e| e.with_op(OP))?;
            if c.device().backend() == hoccl::Backend::Host {
                c.device().synchronize(StreamHandle(0)).map_err(|e| e.with_op(OP))?;
            }
            Ok(())
        })
    }
}

nccl_api! {
    /// Lets pending operations finish (bounded by the timeout), then frees the
    /// communicator; reports an asynchronous error it had.
    fn ncclCommDestroy / pncclCommDestroy(comm: ncclComm_t) -> ncclResult_t {
        const OP: &str = "ncclCommDestroy";
        call(OP, || comm::release(OP, comm, false))
    }
}

nccl_api! {
    /// Fails pending operations at once, releases their streams, frees the communicator.
    fn ncclCommAbort / pncclCommAbort(comm: ncclComm_t) -> ncclResult_t {
        const OP: &str = "ncclCommAbort";
        call(OP, || comm::release(OP, comm, true))
    }
}

nccl_api! {
    /// `*asyncError`: the code of the communicator's asynchronous error (`ncclSuccess` if
    /// none, including right after a non-blocking creation, which hoccl completes before
    /// returning); its message becomes this thread's last error.
    fn ncclCommGetAsyncError / pncclCommGetAsyncError(comm: ncclComm_t, asyncError: *mut ncclResult_t) -> ncclResult_t {
        const OP: &str = "ncclCommGetAsyncError";
        call(OP, || put(OP, "asyncError", asyncError, comm::async_error(OP, comm)?))
    }
}

/// A rank or count as a C int (ranks always fit).
fn c_int_of(op: &'static str, v: usize) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| Error::internal(op, format!("{v} does not fit an int")))
}

nccl_api! {
    fn ncclCommCount / pncclCommCount(comm: ncclComm_t, count: *mut c_int) -> ncclResult_t {
        const OP: &str = "ncclCommCount";
        call(OP, || put(OP, "count", count, c_int_of(OP, live(OP, comm)?.size())?))
    }
}

nccl_api! {
    /// The CUDA ordinal of the communicator's GPU (0 on the host backend).
    fn ncclCommCuDevice / pncclCommCuDevice(comm: ncclComm_t, device: *mut c_int) -> ncclResult_t {
        const OP: &str = "ncclCommCuDevice";
        call(OP, || put(OP, "device", device, c_int_of(OP, live(OP, comm)?.device().ordinal())?))
    }
}

nccl_api! {
    fn ncclCommUserRank / pncclCommUserRank(comm: ncclComm_t, rank: *mut c_int) -> ncclResult_t {
        const OP: &str = "ncclCommUserRank";
        call(OP, || put(OP, "rank", rank, c_int_of(OP, live(OP, comm)?.rank())?))
    }
}

// ---------------------------------------------------------------- registration -----------

/// What registration hands out: hoccl validates each buffer per call and needs no
/// registration, so every handle is this one token (never dereferenced).
static TOKEN: u8 = 0;

fn token() -> *mut c_void {
    std::ptr::addr_of!(TOKEN) as *mut c_void
}

nccl_api! {
    /// Accepted: `*handle` becomes a non-NULL token.
    fn ncclCommRegister / pncclCommRegister(comm: ncclComm_t, _buff: *mut c_void, _size: usize, handle: *mut *mut c_void) -> ncclResult_t {
        const OP: &str = "ncclCommRegister";
        call(OP, || {
            live(OP, comm)?;
            put(OP, "handle", handle, token())
        })
    }
}

nccl_api! {
    fn ncclCommDeregister / pncclCommDeregister(comm: ncclComm_t, handle: *mut c_void) -> ncclResult_t {
        const OP: &str = "ncclCommDeregister";
        call(OP, || {
            live(OP, comm)?;
            if handle != token() {
                return Err(Error::invalid_arg(OP, "handle was not returned by ncclCommRegister"));
            }
            Ok(())
        })
    }
}

nccl_api! {
    /// Accepted: `*win` becomes a non-NULL token.
    fn ncclCommWindowRegister / pncclCommWindowRegister(comm: ncclComm_t, _buff: *mut c_void, _size: usize, win: *mut ncclWindow_t, _winFlags: c_int) -> ncclResult_t {
        const OP: &str = "ncclCommWindowRegister";
        call(OP, || {
            live(OP, comm)?;
            put(OP, "win", win, token())
        })
    }
}

nccl_api! {
    fn ncclCommWindowDeregister / pncclCommWindowDeregister(comm: ncclComm_t, win: ncclWindow_t) -> ncclResult_t {
        const OP: &str = "ncclCommWindowDeregister";
        call(OP, || {
            live(OP, comm)?;
            if win != token() {
                return Err(Error::invalid_arg(OP, "window was not returned by ncclCommWindowRegister"));
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------- memory -----------------

/// Allocations of `ncclMemAlloc`, with the device that made them (the host backend frees
/// only through the device that allocated).
fn allocations() -> &'static Mutex<HashMap<u64, Arc<dyn Device>>> {
    static A: OnceLock<Mutex<HashMap<u64, Arc<dyn Device>>>> = OnceLock::new();
    A.get_or_init(Default::default)
}

/// One device per GPU ordinal for `ncclMemAlloc`, opened at first use.
fn memory_device(op: &'static str) -> Result<Arc<dyn Device>> {
    static D: OnceLock<Mutex<HashMap<usize, Arc<dyn Device>>>> = OnceLock::new();
    let cfg = comm::config(op)?;
    let ordinal = cfg.device.unwrap_or(0);
    let mut m = D.get_or_init(Default::default).lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = m.get(&ordinal) {
        return Ok(d.clone());
    }
    let d = hoccl::device::open(cfg.backend, ordinal).map_err(|e| e.with_op(op))?;
    m.insert(ordinal, d.clone());
    Ok(d)
}

nccl_api! {
    /// Device memory of the current GPU (`cuMemAlloc`; host-backend memory without CUDA),
    /// usable by every communicator of this process.
    fn ncclMemAlloc / pncclMemAlloc(ptr: *mut *mut c_void, size: usize) -> ncclResult_t {
        const OP: &str = "ncclMemAlloc";
        call(OP, || {
            put(OP, "ptr", ptr, std::ptr::null_mut())?;
            if size == 0 {
                return Err(Error::invalid_arg(OP, "size is 0"));
            }
            let d = memory_device(OP)?;
            let p = d.alloc(size).map_err(|e| e.with_op(OP))?;
            allocations().lock().unwrap_or_else(|p| p.into_inner()).insert(p.0, d);
            put(OP, "ptr", ptr, p.0 as usize as *mut c_void)
        })
    }
}

nccl_api! {
    /// Frees what `ncclMemAlloc` returned; NULL is a no-op.
    fn ncclMemFree / pncclMemFree(ptr: *mut c_void) -> ncclResult_t {
        const OP: &str = "ncclMemFree";
        call(OP, || {
            if ptr.is_null() {
                return Ok(());
            }
            let d = allocations().lock().unwrap_or_else(|p| p.into_inner()).remove(&(ptr as usize as u64));
            let d = d.ok_or_else(|| Error::invalid_arg(OP, format!("{ptr:p} was not returned by ncclMemAlloc (or was freed)")))?;
            d.free(dev_ptr(ptr)).map_err(|e| e.with_op(OP))
        })
    }
}

// ---------------------------------------------------------------- operators --------------

/// The next PreMulSum operator number (never reused).
static NEXT_OP: AtomicI32 = AtomicI32::new(NCCL_NUM_OPS);

nccl_api! {
    /// `sum(scalar * x_i)` over the ranks' inputs. `ncclScalarHostImmediate`: the scalar (of
    /// `datatype`) is read here; `ncclScalarDevice`: it must lie in device memory of the
    /// communicator's GPU and is read by each reduce step when it runs (stream-ordered, as
    /// NCCL reads it). The operator serves collectives of `comm` on `datatype`.
    fn ncclRedOpCreatePreMulSum / pncclRedOpCreatePreMulSum(op: *mut ncclRedOp_t, scalar: *mut c_void, datatype: ncclDataType_t, residence: ncclScalarResidence_t, comm: ncclComm_t) -> ncclResult_t {
        const OP: &str = "ncclRedOpCreatePreMulSum";
        call(OP, || {
            let c = live(OP, comm)?;
            let dtype = DataType::from_raw(OP, datatype)?;
            if scalar.is_null() {
                return Err(Error::invalid_arg(OP, "scalar is NULL"));
            }
            if op.is_null() {
                return Err(Error::invalid_arg(OP, "op is NULL"));
            }
            let scalar = match residence {
                NCCL_SCALAR_HOST_IMMEDIATE => {
                    let mut w = [0u8; 8];
                    // SAFETY: non-NULL; the contract is a host value of `datatype`, whose
                    // size (at most 8 bytes) is what is read.
                    unsafe { std::ptr::copy_nonoverlapping(scalar.cast::<u8>(), w.as_mut_ptr(), dtype.size()) };
                    Scalar::Value(u64::from_le_bytes(w))
                }
                NCCL_SCALAR_DEVICE => {
                    let p = dev_ptr(scalar);
                    let a = c.device().allocation(p).map_err(|e| Error::invalid_arg(OP, format!("a device-resident scalar must be device memory of the communicator's GPU: {e}")))?;
                    if p.0 + dtype.size() as u64 > a.base.0 + a.len as u64 || p.0 % dtype.size() as u64 != 0 {
                        return Err(Error::invalid_arg(OP, format!("scalar at {:#x}: not {} aligned bytes inside its allocation", p.0, dtype.size())));
                    }
                    Scalar::Device(p.0)
                }
                _ => return Err(Error::invalid_arg(OP, format!("scalar residence {residence} (want ncclScalarDevice 0 or ncclScalarHostImmediate 1)"))),
            };
            let v = NEXT_OP.fetch_add(1, Ordering::Relaxed);
            if v < NCCL_NUM_OPS {
                return Err(Error::internal(OP, "operator numbers exhausted"));
            }
            premul_ops().lock().unwrap_or_else(|p| p.into_inner()).insert(v, PreMul { dtype, scalar, comm: comm as usize });
            log::debug!("{OP}: operator {v} ({} scalar {scalar:?})", dtype.name());
            put(OP, "op", op, v)
        })
    }
}

nccl_api! {
    fn ncclRedOpDestroy / pncclRedOpDestroy(op: ncclRedOp_t, comm: ncclComm_t) -> ncclResult_t {
        const OP: &str = "ncclRedOpDestroy";
        call(OP, || {
            live(OP, comm)?;
            if (0..NCCL_NUM_OPS).contains(&op) {
                return Err(Error::invalid_arg(OP, format!("operator {op} is built in")));
            }
            if premul_ops().lock().unwrap_or_else(|p| p.into_inner()).remove(&op).is_none() {
                return Err(Error::invalid_arg(OP, format!("operator {op} was not made by ncclRedOpCreatePreMulSum (or was destroyed)")));
            }
            Ok(())
        })
    }
}

// ---------------------------------------------------------------- groups -----------------

nccl_api! {
    fn ncclGroupStart / pncclGroupStart() -> ncclResult_t {
        call("ncclGroupStart", || {
            comm::group_start();
            Ok(())
        })
    }
}

nccl_api! {
    /// The outermost end launches the calls of every communicator used in the group.
    fn ncclGroupEnd / pncclGroupEnd() -> ncclResult_t {
        const OP: &str = "ncclGroupEnd";
        call(OP, || comm::group_end(OP))
    }
}

nccl_api! {
    fn ncclGroupSimulateEnd / pncclGroupSimulateEnd(_simInfo: *mut c_void) -> ncclResult_t {
        refuse("ncclGroupSimulateEnd", "hoccl has no per-call cost model to report")
    }
}

// ---------------------------------------------------------------- operations -------------

nccl_api! {
    fn ncclAllReduce / pncclAllReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclAllReduce";
        enqueue(OP, comm, || desc(Collective::AllReduce { op: red_op(OP, op, comm, datatype)? }, sendbuff, recvbuff, count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclReduceScatter / pncclReduceScatter(sendbuff: *const c_void, recvbuff: *mut c_void, recvcount: usize, datatype: ncclDataType_t, op: ncclRedOp_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclReduceScatter";
        enqueue(OP, comm, || desc(Collective::ReduceScatter { op: red_op(OP, op, comm, datatype)? }, sendbuff, recvbuff, recvcount, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclReduce / pncclReduce(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, op: ncclRedOp_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclReduce";
        enqueue(OP, comm, || desc(Collective::Reduce { op: red_op(OP, op, comm, datatype)?, root: hoccl::rank_arg(OP, "root", root)? }, sendbuff, recvbuff, count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclAllGather / pncclAllGather(sendbuff: *const c_void, recvbuff: *mut c_void, sendcount: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclAllGather";
        enqueue(OP, comm, || desc(Collective::AllGather, sendbuff, recvbuff, sendcount, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclBroadcast / pncclBroadcast(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclBroadcast";
        enqueue(OP, comm, || desc(Collective::Broadcast { root: hoccl::rank_arg(OP, "root", root)? }, sendbuff, recvbuff, count, OP, datatype, stream))
    }
}

nccl_api! {
    /// The in-place broadcast of NCCL's first API.
    fn ncclBcast / pncclBcast(buff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclBcast";
        enqueue(OP, comm, || desc(Collective::Broadcast { root: hoccl::rank_arg(OP, "root", root)? }, buff, buff, count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclSend / pncclSend(sendbuff: *const c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclSend";
        enqueue(OP, comm, || desc(Collective::Send { peer: hoccl::rank_arg(OP, "peer", peer)? }, sendbuff, std::ptr::null_mut(), count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclRecv / pncclRecv(recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, peer: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclRecv";
        enqueue(OP, comm, || desc(Collective::Recv { peer: hoccl::rank_arg(OP, "peer", peer)? }, std::ptr::null(), recvbuff, count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclAlltoAll / pncclAlltoAll(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclAlltoAll";
        enqueue(OP, comm, || desc(Collective::AllToAll, sendbuff, recvbuff, count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclGather / pncclGather(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclGather";
        enqueue(OP, comm, || desc(Collective::Gather { root: hoccl::rank_arg(OP, "root", root)? }, sendbuff, recvbuff, count, OP, datatype, stream))
    }
}

nccl_api! {
    fn ncclScatter / pncclScatter(sendbuff: *const c_void, recvbuff: *mut c_void, count: usize, datatype: ncclDataType_t, root: c_int, comm: ncclComm_t, stream: cudaStream_t) -> ncclResult_t {
        const OP: &str = "ncclScatter";
        enqueue(OP, comm, || desc(Collective::Scatter { root: hoccl::rank_arg(OP, "root", root)? }, sendbuff, recvbuff, count, OP, datatype, stream))
    }
}

// ---------------------------------------------------------------- device API -------------
// The host functions of NCCL's device API (nccl_device.h). hoccl has no device-side
// communication (its kernels never talk to peers), so the calls that would set it up are
// refused; they are exported because programs such as PyTorch resolve them at load time.
// The pure helpers are implemented.

/// `ncclTeam_t`: `nRanks` ranks, this rank's index, the stride between members' world ranks.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ncclTeam_t {
    pub n_ranks: c_int,
    pub rank: c_int,
    pub stride: c_int,
}

/// A team-valued entry point that cannot run: the empty team (what NCCL returns on failure),
/// with the reason recorded and logged.
fn no_team(r: Result<ncclTeam_t>) -> ncclTeam_t {
    r.unwrap_or_else(|e| {
        fail(&e);
        ncclTeam_t::default()
    })
}

nccl_api! {
    fn ncclDevCommCreate / pncclDevCommCreate(_comm: ncclComm_t, _reqs: *const c_void, _outDevComm: *mut c_void) -> ncclResult_t {
        refuse("ncclDevCommCreate", "hoccl has no device-side communication (NCCL's device API)")
    }
}

nccl_api! {
    fn ncclDevCommDestroy / pncclDevCommDestroy(_comm: ncclComm_t, _devComm: *const c_void) -> ncclResult_t {
        refuse("ncclDevCommDestroy", "hoccl has no device-side communication (NCCL's device API)")
    }
}

nccl_api! {
    fn ncclLsaBarrierCreateRequirement / pncclLsaBarrierCreateRequirement(_team: ncclTeam_t, _nBarriers: c_int, _outHandle: *mut c_void, _outReq: *mut c_void) -> ncclResult_t {
        refuse("ncclLsaBarrierCreateRequirement", "hoccl has no device-side communication (NCCL's device API)")
    }
}

nccl_api! {
    fn ncclGinBarrierCreateRequirement / pncclGinBarrierCreateRequirement(_comm: ncclComm_t, _team: ncclTeam_t, _nBarriers: c_int, _outHandle: *mut c_void, _outReq: *mut c_void) -> ncclResult_t {
        refuse("ncclGinBarrierCreateRequirement", "hoccl has no device-side communication (NCCL's device API)")
    }
}

nccl_api! {
    fn ncclLLA2ACreateRequirement / pncclLLA2ACreateRequirement(_nBlocks: c_int, _nSlots: c_int, _outHandle: *mut c_void, _outReq: *mut c_void) -> ncclResult_t {
        refuse("ncclLLA2ACreateRequirement", "hoccl has no device-side communication (NCCL's device API)")
    }
}

nccl_api! {
    /// Slots of the device API's low-latency all-to-all for `maxElts` elements of up to
    /// `maxEltSize` bytes (8-byte slots), as NCCL computes it.
    fn ncclLLA2ACalcSlots / pncclLLA2ACalcSlots(maxElts: c_int, maxEltSize: c_int) -> c_int {
        maxElts.saturating_mul((maxEltSize.max(0) + 7) / 8)
    }
}

nccl_api! {
    /// Every rank of `comm`, stride 1 (the empty team, with the error recorded, for a bad
    /// handle).
    fn ncclTeamWorld / pncclTeamWorld(comm: ncclComm_t) -> ncclTeam_t {
        const OP: &str = "ncclTeamWorld";
        no_team(hoccl::guarded(OP, || {
            let c = live(OP, comm)?;
            Ok(ncclTeam_t { n_ranks: c_int_of(OP, c.size())?, rank: c_int_of(OP, c.rank())?, stride: 1 })
        }))
    }
}

nccl_api! {
    fn ncclTeamLsa / pncclTeamLsa(_comm: ncclComm_t) -> ncclTeam_t {
        no_team(Err(Error::invalid_usage("ncclTeamLsa", "not supported by hoccl's NCCL library: hoccl has no device-side communication (NCCL's device API)")))
    }
}

nccl_api! {
    fn ncclTeamRail / pncclTeamRail(_comm: ncclComm_t) -> ncclTeam_t {
        no_team(Err(Error::invalid_usage("ncclTeamRail", "not supported by hoccl's NCCL library: hoccl has no device-side communication (NCCL's device API)")))
    }
}

nccl_api! {
    /// The world rank of member `rank` of `team`, of which the caller is a member (NCCL's
    /// arithmetic); -1, with the error recorded, for a bad handle.
    fn ncclTeamRankToWorld / pncclTeamRankToWorld(comm: ncclComm_t, team: ncclTeam_t, rank: c_int) -> c_int {
        const OP: &str = "ncclTeamRankToWorld";
        hoccl::guarded(OP, || {
            let me = c_int_of(OP, live(OP, comm)?.rank())?;
            Ok(me.wrapping_add(rank.wrapping_sub(team.rank).wrapping_mul(team.stride)))
        })
        .unwrap_or_else(|e| {
            fail(&e);
            -1
        })
    }
}

nccl_api! {
    fn ncclTeamRankToLsa / pncclTeamRankToLsa(_comm: ncclComm_t, _team: ncclTeam_t, _rank: c_int) -> c_int {
        fail(&Error::invalid_usage("ncclTeamRankToLsa", "not supported by hoccl's NCCL library: hoccl has no device-side communication (NCCL's device API)"));
        -1
    }
}

#[cfg(test)]
mod api_tests;

#[cfg(test)]
mod bad_input_tests;

#[cfg(test)]
mod tests {
    use super::*;

    /// `nccl/symbols.txt` and this crate's exports are the same list.
    #[test]
    fn symbols_txt_names_every_export() {
        let src = include_str!("lib.rs");
        let mut exported: Vec<&str> = src
            .lines()
            .filter_map(|l| l.trim().strip_prefix("fn nccl"))
            .map(|rest| &rest[..rest.find(' ').unwrap_or(rest.len())])
            .collect();
        exported.sort_unstable();
        let mut listed: Vec<&str> = include_str!("../symbols.txt")
            .lines()
            .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
            .map(|l| l.split_whitespace().next().unwrap().strip_prefix("nccl").unwrap())
            .collect();
        listed.sort_unstable();
        assert_eq!(exported, listed);
    }

    #[test]
    fn calls_on_bad_handles_are_errors_with_messages() {
        let mut n = 0;
        assert_eq!(ncclCommCount(std::ptr::null_mut(), &mut n), NCCL_INVALID_ARGUMENT);
        // SAFETY: ncclGetLastError returns a NUL-terminated string.
        let msg = unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) };
        assert!(msg.to_string_lossy().contains("communicator is NULL"), "{msg:?}");
        assert_eq!(ncclCommCount(0x1234 as ncclComm_t, &mut n), NCCL_INVALID_USAGE);
        assert_eq!(ncclAllReduce(std::ptr::null(), std::ptr::null_mut(), 1, 7, 0, 0x1235 as ncclComm_t, std::ptr::null_mut()), NCCL_INVALID_USAGE);
        assert_eq!(pncclCommDestroy(0x1237 as ncclComm_t), NCCL_INVALID_USAGE);
        let mut v = 0;
        assert_eq!(pncclGetVersion(&mut v), NCCL_SUCCESS);
        assert_eq!(v, 22809);
        assert_eq!(ncclGetVersion(std::ptr::null_mut()), NCCL_INVALID_ARGUMENT);
    }

    /// The price of the NCCL surface over hoccl's funnel: an in-place one-rank AllGather (a
    /// launch with nothing to move: validation, the registry lookup, the handle check) through
    /// `ncclAllGather` against `Communicator::enqueue` itself. Timing, so run on request:
    /// `cargo test --release -p hoccl-nccl -- --ignored launch_cost --nocapture`.
    #[test]
    #[ignore = "timing; run in release with --ignored"]
    fn launch_cost_over_the_funnel_is_below_a_microsecond() {
        let mut id = UniqueId { internal: [0; 128] };
        assert_eq!(ncclGetUniqueId(&mut id), NCCL_SUCCESS);
        let mut comm = std::ptr::null_mut();
        assert_eq!(ncclCommInitRank(&mut comm, 1, id, 0), NCCL_SUCCESS);
        let mut buf = std::ptr::null_mut();
        assert_eq!(ncclMemAlloc(&mut buf, 4096), NCCL_SUCCESS);
        let c = live("t", comm).unwrap();
        let d = OpDesc { coll: Collective::AllGather, send: dev_ptr(buf), recv: dev_ptr(buf), count: 1024, dtype: DataType::F32, stream: StreamHandle(0) };
        const N: u32 = 200_000;
        let per_call = |f: &dyn Fn()| {
            let mut best = f64::MAX;
            for _ in 0..5 {
                let t = std::time::Instant::now();
                for _ in 0..N {
                    f();
                }
                best = best.min(t.elapsed().as_secs_f64() * 1e9 / N as f64);
            }
            best
        };
        let direct = per_call(&|| c.enqueue(&d).unwrap());
        let nccl = per_call(&|| assert_eq!(ncclAllGather(buf, buf, 1024, 7, comm, std::ptr::null_mut()), NCCL_SUCCESS));
        println!("launch cost: Communicator::enqueue {direct:.0} ns, ncclAllGather {nccl:.0} ns, difference {:.0} ns", nccl - direct);
        assert_eq!(ncclMemFree(buf), NCCL_SUCCESS);
        drop(c);
        assert_eq!(ncclCommDestroy(comm), NCCL_SUCCESS);
        assert!(nccl - direct < 1000.0, "the NCCL surface adds {:.0} ns per call", nccl - direct);
    }

    #[test]
    fn refused_functions_say_why() {
        assert_eq!(ncclGroupSimulateEnd(std::ptr::null_mut()), NCCL_INVALID_USAGE);
        // SAFETY: as above.
        let msg = unsafe { std::ffi::CStr::from_ptr(ncclGetLastError(std::ptr::null_mut())) };
        assert!(msg.to_string_lossy().contains("not supported"), "{msg:?}");
        assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
    }
}
