//! The C ABI of `include/hoccl/hoccl.h`, shaped like NCCL's: every function returns a
//! `hocclResult_t` (an [`ErrorCode`] value) and never unwinds; the message of the calling
//! thread's last failure is kept for `hocclGetLastError()`.
//!
//! A `hocclComm_t` is not a pointer to anything: it is the id of an entry in a process-wide
//! registry, never reused. A destroyed (or never created) handle is simply absent, so using
//! it is `hocclInvalidUsage`, not a use of freed memory. After `hocclCommAbort` the entry
//! stays, aborted: calls return `hocclAborted` until `hocclCommDestroy` removes it.
//!
//! Every operation fills the bridge's [`OpArgs`], the descriptor the C++ API fills, and
//! reaches `Communicator::enqueue` through [`OpArgs::desc`]: the C ABI checks only what is
//! C's own (NULL handles, NULL count arrays).
//!
//! Groups are thread-global as NCCL's: between `hocclGroupStart` and `hocclGroupEnd` on one
//! thread, the first call on each communicator opens that communicator's group, and the
//! outermost `hocclGroupEnd` closes (launches) them all.
#![allow(non_snake_case, non_camel_case_types)]
use super::bridge::{init_unique_id, CUstream_st, OpArgs, OpKind};
use super::{guarded, to_c_int, CommHandle};
use crate::bootstrap::tcp::UniqueId;
use crate::comm::Communicator;
use crate::config::Config;
use crate::error::{Error, ErrorCode, Result};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, c_void, CStr};
use std::ptr::{null, null_mut};
use std::sync::Arc;
use super::surface::{LastError, Registry, ThreadGroup};

/// `hocclResult_t`: an [`ErrorCode`] value.
pub type hocclResult_t = c_int;
/// `hocclDataType_t`: a [`DataType`](crate::DataType) value (NCCL's numbering). Received as a plain int so
/// that an out-of-range value is an error, not undefined behaviour.
pub type hocclDataType_t = c_int;

/// `hocclRedOp_t`: a [`RedOp`](crate::RedOp) value (NCCL's `ncclRedOp_t` numbering),
/// received as a plain int so that an out-of-range value is an error.
pub type hocclRedOp_t = c_int;

/// CUDA's `cudaStream_t` / `CUstream` (`struct CUstream_st*`, `hoccl/cuda_stream.h`): a
/// stream of the communicator's GPU, or on the host backend one from `hocclStreamCreate`.
pub type cudaStream_t = *mut CUstream_st;

/// The opaque struct behind `hocclComm_t`; never instantiated.
#[repr(C)]
pub struct hocclComm {
    _opaque: [u8; 0],
}
pub type hocclComm_t = *mut hocclComm;

// ---------------------------------------------------------------- registry ---------------

/// Ids start high and odd (`Registry::new`), apart from the NCCL library's.
static REGISTRY: Registry<CommHandle> = Registry::new(0x4843_0001);

/// Put `comm` in the registry and return its handle.
pub(crate) fn register(comm: Communicator) -> hocclComm_t {
    REGISTRY.insert(CommHandle::new(comm)) as usize as hocclComm_t
}

fn lookup(op: &'static str, comm: hocclComm_t) -> Result<(u64, Arc<CommHandle>)> {
    let id = comm as usize as u64;
    Ok((id, REGISTRY.get(op, id)?))
}

// ---------------------------------------------------------------- thread state -----------

thread_local! {
    static LAST_ERROR: LastError = LastError::default();
    static GROUP: RefCell<ThreadGroup<CommHandle>> = RefCell::default();
}

fn set_last_error(e: &Error) {
    let _ = LAST_ERROR.try_with(|l| l.set(e));
}

/// Run one C entry point: panics are caught, errors recorded for `hocclGetLastError`.
pub(super) fn call(op: &'static str, f: impl FnOnce() -> Result<()>) -> hocclResult_t {
    match guarded(op, f) {
        Ok(()) => ErrorCode::Success as c_int,
        Err(e) => {
            set_last_error(&e);
            e.code() as c_int
        }
    }
}

/// The live communicator behind `comm`, joined to the thread's open group if there is one.
fn communicator(op: &'static str, comm: hocclComm_t) -> Result<Arc<Communicator>> {
    let (id, h) = lookup(op, comm)?;
    let c = h.get(op)?;
    GROUP.with(|g| g.borrow_mut().join(id, &h, || c.group_start()))?;
    Ok(c)
}

pub(super) use super::surface::put;

// ---------------------------------------------------------------- library ----------------

/// `major * 10000 + minor * 100 + patch`, as NCCL's `ncclGetVersion`.
pub fn version_code() -> c_int {
    let n = |s: &str| s.parse::<c_int>().unwrap_or(0);
    n(env!("CARGO_PKG_VERSION_MAJOR")) * 10000 + n(env!("CARGO_PKG_VERSION_MINOR")) * 100 + n(env!("CARGO_PKG_VERSION_PATCH"))
}

#[no_mangle]
pub extern "C" fn hocclGetVersion(version: *mut c_int) -> hocclResult_t {
    const OP: &str = "hocclGetVersion";
    call(OP, || put(OP, "version", version, version_code()))
}

/// A static description of a result code.
#[no_mangle]
pub extern "C" fn hocclGetErrorString(result: hocclResult_t) -> *const c_char {
    let s: &'static CStr = match result {
        0 => c"no error",
        1 => c"CUDA driver call failed",
        2 => c"system call failed",
        3 => c"internal error (a bug in hoccl)",
        4 => c"invalid argument",
        5 => c"invalid usage",
        6 => c"remote peer failed",
        7 => c"operation in progress",
        8 => c"operation timed out",
        9 => c"corrupt data",
        10 => c"communicator aborted",
        11 => c"MPI error",
        12 => c"no such device or backend",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

/// The message of the calling thread's last failed call ("" if none). The pointer stays
/// valid until the next failing hoccl call on this thread.
#[no_mangle]
pub extern "C" fn hocclGetLastError() -> *const c_char {
    LAST_ERROR.try_with(|l| l.as_ptr()).unwrap_or(c"".as_ptr())
}

// ---------------------------------------------------------------- communicators ----------

#[no_mangle]
pub extern "C" fn hocclCommInitMpi(comm: *mut hocclComm_t, mpi_comm_f: c_int) -> hocclResult_t {
    const OP: &str = "hocclCommInitMpi";
    call(OP, || {
        put(OP, "comm", comm, std::ptr::null_mut())?;
        let c = Communicator::from_mpi_fortran(mpi_comm_f, Config::from_env()?)?;
        put(OP, "comm", comm, register(c))
    })
}

/// `hocclUniqueId`: the 128 bytes of a TCP bootstrap [`UniqueId`] (`#[repr(C)]`, the same
/// layout as C's `struct { char internal[128]; }`), passed by value as NCCL's `ncclUniqueId`.
pub type hocclUniqueId = UniqueId;

/// `*unique_id` becomes a fresh rendezvous id; this process hosts its root thread (on the
/// interface `HOCCL_SOCKET_IFNAME` chooses), so it must stay alive until every rank joined.
#[no_mangle]
pub extern "C" fn hocclGetUniqueId(unique_id: *mut hocclUniqueId) -> hocclResult_t {
    const OP: &str = "hocclGetUniqueId";
    call(OP, || {
        if unique_id.is_null() {
            return Err(Error::invalid_arg(OP, "uniqueId is NULL"));
        }
        let id = Communicator::unique_id(&Config::from_env()?)?;
        put(OP, "uniqueId", unique_id, id)
    })
}

/// Create `rank` of `nranks` through the TCP rendezvous of `comm_id` (no MPI). Collective
/// over the `nranks` ranks; every wait is bounded by `HOCCL_TIMEOUT_MS`. A wrong secret, a
/// duplicate or out-of-range rank, or an `nranks` differing from the other ranks' is refused
/// by the root (`hocclInvalidArgument`). `*comm` is NULL on failure.
#[no_mangle]
pub extern "C" fn hocclCommInitRank(comm: *mut hocclComm_t, nranks: c_int, comm_id: hocclUniqueId, rank: c_int) -> hocclResult_t {
    const OP: &str = "hocclCommInitRank";
    call(OP, || {
        put(OP, "comm", comm, std::ptr::null_mut())?;
        let c = init_unique_id(OP, &comm_id, nranks, rank)?;
        put(OP, "comm", comm, register(c))
    })
}

#[no_mangle]
pub extern "C" fn hocclCommDestroy(comm: hocclComm_t) -> hocclResult_t {
    const OP: &str = "hocclCommDestroy";
    call(OP, || {
        let (id, h) = lookup(OP, comm)?;
        // Out of the registry first: from here on the handle is invalid for every thread.
        REGISTRY.remove(OP, id)?;
        h.destroy(OP)
    })
}

#[no_mangle]
pub extern "C" fn hocclCommAbort(comm: hocclComm_t) -> hocclResult_t {
    const OP: &str = "hocclCommAbort";
    call(OP, || lookup(OP, comm)?.1.abort(OP))
}

/// `*async_error` becomes the code of the communicator's asynchronous error (hocclSuccess
/// if none); its message becomes this thread's last error.
#[no_mangle]
pub extern "C" fn hocclCommGetAsyncError(comm: hocclComm_t, async_error: *mut hocclResult_t) -> hocclResult_t {
    const OP: &str = "hocclCommGetAsyncError";
    call(OP, || {
        let c = lookup(OP, comm)?.1.get(OP)?;
        let e = c.async_error();
        if let Some(e) = &e {
            set_last_error(e);
        }
        put(OP, "asyncError", async_error, e.map_or(ErrorCode::Success, |e| e.code()) as c_int)
    })
}

#[no_mangle]
pub extern "C" fn hocclCommCount(comm: hocclComm_t, count: *mut c_int) -> hocclResult_t {
    const OP: &str = "hocclCommCount";
    call(OP, || put(OP, "count", count, to_c_int(OP, lookup(OP, comm)?.1.get(OP)?.size())?))
}

#[no_mangle]
pub extern "C" fn hocclCommUserRank(comm: hocclComm_t, rank: *mut c_int) -> hocclResult_t {
    const OP: &str = "hocclCommUserRank";
    call(OP, || put(OP, "rank", rank, to_c_int(OP, lookup(OP, comm)?.1.get(OP)?.rank())?))
}

// ---------------------------------------------------------------- groups -----------------

#[no_mangle]
pub extern "C" fn hocclGroupStart() -> hocclResult_t {
    call("hocclGroupStart", || {
        GROUP.with(|g| g.borrow_mut().start());
        Ok(())
    })
}

/// Closes the thread's group; the outermost end launches the gathered calls of every
/// communicator used since the outermost start. Every member is closed even if one fails;
/// the first failure is returned.
#[no_mangle]
pub extern "C" fn hocclGroupEnd() -> hocclResult_t {
    const OP: &str = "hocclGroupEnd";
    call(OP, || {
        GROUP.with(|g| ThreadGroup::end(g, OP, "hocclGroupStart", |h| h.get(OP).and_then(|c| c.group_end())))
    })
}

// ---------------------------------------------------------------- operations -------------

/// Run the operation `args` (built from the live communicator) on `comm`.
fn enqueue<'a>(op: &'static str, comm: hocclComm_t, args: impl FnOnce(&Communicator) -> Result<OpArgs<'a>>) -> hocclResult_t {
    call(op, || {
        let c = communicator(op, comm)?;
        c.enqueue(&args(&c)?.desc(op)?)
    })
}

/// `OpArgs::new` over C's pointer and stream types.
fn args<'a>(kind: OpKind, send: *const c_void, recv: *mut c_void, count: usize, dtype: hocclDataType_t, root: c_int, s: cudaStream_t) -> OpArgs<'a> {
    OpArgs::new(kind, send.cast(), recv.cast(), count, dtype, root, s)
}

#[no_mangle]
pub extern "C" fn hocclSend(
    sendbuff: *const c_void,
    count: usize,
    datatype: hocclDataType_t,
    peer: c_int,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclSend", comm, |_| Ok(args(OpKind::Send, sendbuff, null_mut(), count, datatype, peer, stream)))
}

#[no_mangle]
pub extern "C" fn hocclRecv(
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    peer: c_int,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclRecv", comm, |_| Ok(args(OpKind::Recv, null(), recvbuff, count, datatype, peer, stream)))
}

#[no_mangle]
pub extern "C" fn hocclAllGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    sendcount: usize,
    datatype: hocclDataType_t,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclAllGather", comm, |_| Ok(args(OpKind::AllGather, sendbuff, recvbuff, sendcount, datatype, 0, stream)))
}

#[no_mangle]
pub extern "C" fn hocclAlltoAll(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclAlltoAll", comm, |_| Ok(args(OpKind::AllToAll, sendbuff, recvbuff, count, datatype, 0, stream)))
}

/// `n` entries of a caller's `size_t` array, or `InvalidArgument` if it is NULL.
fn counts<'a>(op: &'static str, what: &str, p: *const usize, n: usize) -> Result<&'a [usize]> {
    if p.is_null() {
        return Err(Error::invalid_arg(op, format!("{what} is NULL")));
    }
    // SAFETY: non-NULL; the documented contract (as NCCL's and MPI's) is that each count
    // and displacement array holds one entry per rank of the communicator, i.e. `n`, and
    // stays valid for the duration of the call.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn hocclAlltoAllv(
    sendbuff: *const c_void,
    sendcounts: *const usize,
    sdispls: *const usize,
    recvbuff: *mut c_void,
    recvcounts: *const usize,
    rdispls: *const usize,
    datatype: hocclDataType_t,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    const OP: &str = "hocclAlltoAllv";
    enqueue(OP, comm, |c| {
        let n = c.size();
        Ok(OpArgs {
            send_counts: counts(OP, "sendcounts", sendcounts, n)?,
            send_displs: counts(OP, "sdispls", sdispls, n)?,
            recv_counts: counts(OP, "recvcounts", recvcounts, n)?,
            recv_displs: counts(OP, "rdispls", rdispls, n)?,
            ..args(OpKind::AllToAllV, sendbuff, recvbuff, 0, datatype, 0, stream)
        })
    })
}

#[no_mangle]
pub extern "C" fn hocclBroadcast(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    root: c_int,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclBroadcast", comm, |_| Ok(args(OpKind::Broadcast, sendbuff, recvbuff, count, datatype, root, stream)))
}

#[no_mangle]
pub extern "C" fn hocclGather(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    root: c_int,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclGather", comm, |_| Ok(args(OpKind::Gather, sendbuff, recvbuff, count, datatype, root, stream)))
}

#[no_mangle]
pub extern "C" fn hocclScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    root: c_int,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclScatter", comm, |_| Ok(args(OpKind::Scatter, sendbuff, recvbuff, count, datatype, root, stream)))
}

#[no_mangle]
pub extern "C" fn hocclAllReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    op: hocclRedOp_t,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclAllReduce", comm, |_| Ok(OpArgs::reduction(OpKind::AllReduce, sendbuff.cast(), recvbuff.cast(), count, datatype, op, 0, stream)))
}

#[no_mangle]
pub extern "C" fn hocclReduceScatter(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    recvcount: usize,
    datatype: hocclDataType_t,
    op: hocclRedOp_t,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclReduceScatter", comm, |_| Ok(OpArgs::reduction(OpKind::ReduceScatter, sendbuff.cast(), recvbuff.cast(), recvcount, datatype, op, 0, stream)))
}

#[no_mangle]
#[allow(clippy::too_many_arguments)]
pub extern "C" fn hocclReduce(
    sendbuff: *const c_void,
    recvbuff: *mut c_void,
    count: usize,
    datatype: hocclDataType_t,
    op: hocclRedOp_t,
    root: c_int,
    comm: hocclComm_t,
    stream: cudaStream_t,
) -> hocclResult_t {
    enqueue("hocclReduce", comm, |_| Ok(OpArgs::reduction(OpKind::Reduce, sendbuff.cast(), recvbuff.cast(), count, datatype, op, root, stream)))
}

/// The live communicator behind `comm` outside any group (device and stream helpers).
pub(super) fn live(op: &'static str, comm: hocclComm_t) -> Result<Arc<Communicator>> {
    lookup(op, comm)?.1.get(op)
}

#[cfg(test)]
#[path = "c_api_tests.rs"]
mod tests;
