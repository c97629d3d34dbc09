//! The cxx bridge behind `include/hoccl/hoccl.hpp`. C++ owns a `rust::Box<Comm>` (and
//! `rust::Box<Dev>` for the device helpers); the public C++ classes (`cpp/hoccl.cc`) wrap
//! them. Every operation crosses as one [`OpArgs`] descriptor to `Comm::enqueue`; the C ABI
//! fills the same struct, so both reach `Communicator::enqueue` through [`OpArgs::desc`].
//!
//! Contract of every function here: it never unwinds (bodies run under
//! [`guarded`](super::guarded)); failures come back as a [`Status`](ffi::Status) with a
//! numeric [`ErrorCode`](crate::ErrorCode) and a message, which `cpp/hoccl.cc` turns into
//! `hoccl::Error`. Buffers cross as `uint8_t*` and streams as `CUstream_st*` (CUDA's
//! `CUstream`/`cudaStream_t`); neither is dereferenced here: the device backend validates
//! every address before it is used. cxx requires functions with pointer arguments to be
//! declared `unsafe`; they impose nothing on their caller beyond that.
use super::{guarded, rank_arg, to_c_int, CommHandle};
use crate::bootstrap::tcp::UniqueId;
use crate::comm::{Collective, Communicator, OpDesc};
use crate::config::Config;
use crate::device::{Backend, DevPtr, Device, StreamHandle};
use crate::error::{Error, Result};
use crate::reduce::RedOp;
use crate::types::DataType;
pub(super) use ffi::{CUstream_st, OpArgs, OpKind, Status};
use std::sync::Arc;

#[cxx::bridge(namespace = "hoccl::bridge")]
mod ffi {
    /// Outcome of a call: `code` 0 is success, otherwise an `ErrorCode` value and its message.
    struct Status {
        code: i32,
        message: String,
    }

    /// Which operation an [`OpArgs`] describes (`comm::Collective` without its arguments).
    #[repr(i32)]
    enum OpKind {
        Send,
        Recv,
        AllGather,
        AllToAll,
        AllToAllV,
        Broadcast,
        Gather,
        Scatter,
        AllReduce,
        ReduceScatter,
        Reduce,
    }

    /// One operation as C++ and the C ABI describe it: `comm::OpDesc` with C's integer
    /// types, checked by [`OpArgs::desc`]. Fields an operation does not use are ignored
    /// (the slices are empty unless `kind` is `AllToAllV`).
    struct OpArgs<'a> {
        kind: OpKind,
        send: *const u8,
        recv: *mut u8,
        /// Elements of `dtype` (unused by `AllToAllV`).
        count: usize,
        /// A `DataType` value (NCCL's numbering).
        dtype: i32,
        /// The peer of `Send` and `Recv`, the root of `Broadcast`, `Gather`, `Scatter`,
        /// `Reduce`.
        root: i32,
        /// The reduction operator of `AllReduce`, `ReduceScatter`, `Reduce`: a `RedOp` value
        /// (NCCL's `ncclRedOp_t` numbering); ignored by the other operations.
        red_op: i32,
        send_counts: &'a [usize],
        send_displs: &'a [usize],
        recv_counts: &'a [usize],
        recv_displs: &'a [usize],
        stream: *mut CUstream_st,
    }

    unsafe extern "C++" {
        include!("hoccl/cuda_stream.h");
        /// CUDA's stream struct (`CUstream` = `cudaStream_t` = `CUstream_st*`), only ever
        /// handled by pointer.
        #[namespace = ""]
        type CUstream_st;
    }

    extern "Rust" {
        type Comm;
        type Dev;

        fn version() -> String;
        /// Log through hoccl's logger (`HOCCL_LOG`), for C++ code that must not throw.
        fn log_error(message: &str);

        // ---- communicator: creation, identity, life cycle -------------------------------
        fn comm_init_mpi(mpi_comm_f: i32, status: &mut Status) -> Box<Comm>;
        /// A fresh TCP rendezvous id (128 bytes); this process serves its root.
        fn unique_id(status: &mut Status) -> Vec<u8>;
        /// `rank` of `nranks` through the rendezvous of `id` (128 bytes from `unique_id`).
        fn comm_init_unique_id(id: &[u8], nranks: i32, rank: i32, status: &mut Status) -> Box<Comm>;
        fn rank(self: &Comm, status: &mut Status) -> i32;
        fn size(self: &Comm, status: &mut Status) -> i32;
        fn async_error(self: &Comm, status: &mut Status) -> Status;
        fn wait_idle(self: &Comm) -> Status;
        fn abort(self: &Comm) -> Status;
        fn destroy(self: &Comm) -> Status;
        fn release(self: &Comm) -> Status;
        fn device(self: &Comm, status: &mut Status) -> Box<Dev>;

        // ---- groups and operations -------------------------------------------------------
        fn group_start(self: &Comm) -> Status;
        fn group_end(self: &Comm) -> Status;
        /// Every operation of the C++ API (the C ABI builds the same descriptor).
        fn enqueue(self: &Comm, op: &OpArgs) -> Status;

        // ---- device helpers (tests, and engines on the host backend) --------------------
        fn backend(self: &Dev) -> String;
        fn name(self: &Dev) -> String;
        fn ordinal(self: &Dev) -> usize;
        fn alloc(self: &Dev, bytes: usize, status: &mut Status) -> *mut u8;
        unsafe fn free(self: &Dev, ptr: *mut u8) -> Status;
        fn create_stream(self: &Dev, status: &mut Status) -> *mut CUstream_st;
        unsafe fn destroy_stream(self: &Dev, stream: *mut CUstream_st) -> Status;
        unsafe fn synchronize(self: &Dev, stream: *mut CUstream_st) -> Status;
        unsafe fn copy_to_host(self: &Dev, dst: &mut [u8], src: *const u8) -> Status;
        unsafe fn copy_from_host(self: &Dev, dst: *mut u8, src: &[u8]) -> Status;
        unsafe fn memcpy_async(self: &Dev, dst: *mut u8, src: *const u8, bytes: usize, stream: *mut CUstream_st) -> Status;

        // ---- a device without a communicator ("auto", "cuda" or "host") ------------------
        fn device_open(backend: &str, ordinal: usize, status: &mut Status) -> Box<Dev>;

        // ---- codec (src/ffi/codec.rs; docs/codec.md) ----------------------------------
        fn codec_max_compressed_len(dtype: i32, count: usize, block: u32, tiers: u8, status: &mut Status) -> usize;
        fn codec_compress(dtype: i32, input: &[u8], block: u32, tiers: u8, status: &mut Status) -> Vec<u8>;
        fn codec_decompress(dtype: i32, stream: &[u8], output: &mut [u8]) -> Status;
        fn codec_status(word: u32) -> Status;
        #[allow(clippy::too_many_arguments)]
        unsafe fn compress_async(
            self: &Dev,
            dtype: i32,
            input: *const u8,
            count: usize,
            output: *mut u8,
            output_cap: usize,
            out_len: *mut u64,
            block: u32,
            tiers: u8,
            stream: *mut CUstream_st,
        ) -> Status;
        #[allow(clippy::too_many_arguments)]
        unsafe fn decompress_async(
            self: &Dev,
            dtype: i32,
            input: *const u8,
            input_len: usize,
            output: *mut u8,
            count: usize,
            status_word: *mut u32,
            stream: *mut CUstream_st,
        ) -> Status;
    }
}

use super::codec::{codec_compress, codec_decompress, codec_max_compressed_len, codec_status, device_open};

fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}

fn log_error(message: &str) {
    log::error!("hoccl: {message}");
}

// ---------------------------------------------------------------- conversions ------------

pub(super) fn status(r: Result<()>) -> Status {
    match r {
        Ok(()) => Status { code: 0, message: String::new() },
        Err(e) => Status { code: e.code() as i32, message: e.to_string() },
    }
}

/// Store `r`'s error in `out` and return its value (or the default on error).
pub(super) fn value<T: Default>(out: &mut Status, r: Result<T>) -> T {
    match r {
        Ok(v) => {
            *out = status(Ok(()));
            v
        }
        Err(e) => {
            *out = status(Err(e));
            T::default()
        }
    }
}

pub(super) fn dev_ptr<T>(p: *const T) -> DevPtr {
    DevPtr(p as usize as u64)
}

pub(super) fn stream(s: *mut CUstream_st) -> StreamHandle {
    StreamHandle(s as usize as u64)
}

pub(super) fn dtype(op: &'static str, v: i32) -> Result<DataType> {
    DataType::from_raw(op, v)
}

impl OpKind {
    /// The name of the C++ method, for errors found before `Communicator::enqueue`.
    fn name(self) -> &'static str {
        match self {
            OpKind::Send => "send",
            OpKind::Recv => "recv",
            OpKind::AllGather => "allGather",
            OpKind::AllToAll => "allToAll",
            OpKind::AllToAllV => "allToAllv",
            OpKind::Broadcast => "broadcast",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllReduce => "allReduce",
            OpKind::ReduceScatter => "reduceScatter",
            OpKind::Reduce => "reduce",
            _ => "enqueue",
        }
    }
}

impl<'a> OpArgs<'a> {
    /// An operation with no per-peer counts; `root` is the peer or root where `kind` has one.
    pub(super) fn new(kind: OpKind, send: *const u8, recv: *mut u8, count: usize, dtype: i32, root: i32, stream: *mut CUstream_st) -> Self {
        OpArgs { kind, send, recv, count, dtype, root, red_op: 0, send_counts: &[], send_displs: &[], recv_counts: &[], recv_displs: &[], stream }
    }

    /// A reduction: as [`new`](Self::new) with the operator `red_op` (a `RedOp` value).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reduction(kind: OpKind, send: *const u8, recv: *mut u8, count: usize, dtype: i32, red_op: i32, root: i32, stream: *mut CUstream_st) -> Self {
        OpArgs { red_op, ..Self::new(kind, send, recv, count, dtype, root, stream) }
    }

    /// The descriptor `Communicator::enqueue` validates: the data type, operator and rank decoded,
    /// the addresses taken as device pointers (never dereferenced here). `op` names the
    /// failures found here.
    pub(super) fn desc(&self, op: &'static str) -> Result<OpDesc<'a>> {
        let root = |what| rank_arg(op, what, self.root);
        let red_op = || RedOp::from_raw(op, self.red_op);
        let coll = match self.kind {
            OpKind::Send => Collective::Send { peer: root("peer")? },
            OpKind::Recv => Collective::Recv { peer: root("peer")? },
            OpKind::AllGather => Collective::AllGather,
            OpKind::AllToAll => Collective::AllToAll,
            OpKind::AllToAllV => Collective::AllToAllV {
                send_counts: self.send_counts,
                send_displs: self.send_displs,
                recv_counts: self.recv_counts,
                recv_displs: self.recv_displs,
            },
            OpKind::Broadcast => Collective::Broadcast { root: root("root")? },
            OpKind::Gather => Collective::Gather { root: root("root")? },
            OpKind::Scatter => Collective::Scatter { root: root("root")? },
            OpKind::AllReduce => Collective::AllReduce { op: red_op()? },
            OpKind::ReduceScatter => Collective::ReduceScatter { op: red_op()? },
            OpKind::Reduce => Collective::Reduce { op: red_op()?, root: root("root")? },
            other => return Err(Error::invalid_arg(op, format!("unknown operation {}", other.repr))),
        };
        let (send, recv, count, stream) = (dev_ptr(self.send), dev_ptr(self.recv), self.count, stream(self.stream));
        Ok(OpDesc { coll, send, recv, count, dtype: dtype(op, self.dtype)?, stream })
    }
}

/// A raw pointer returned to C++ (`Default` for [`value`]).
struct Ptr<T>(*mut T);
impl<T> Default for Ptr<T> {
    fn default() -> Self {
        Ptr(std::ptr::null_mut())
    }
}

// ---------------------------------------------------------------- communicator -----------

/// The communicator as C++ owns it.
pub struct Comm {
    handle: CommHandle,
}

fn comm_init_mpi(mpi_comm_f: i32, out: &mut Status) -> Box<Comm> {
    const OP: &str = "Communicator::from_mpi";
    let c = value(out, guarded(OP, || Communicator::from_mpi_fortran(mpi_comm_f, Config::from_env()?)).map(Some));
    Box::new(Comm { handle: c.map_or_else(CommHandle::empty, CommHandle::new) })
}

fn unique_id(out: &mut Status) -> Vec<u8> {
    const OP: &str = "UniqueId::create";
    value(out, guarded(OP, || Ok(Communicator::unique_id(&Config::from_env()?)?.internal.to_vec())))
}

/// `rank` of `nranks` (C's ints, checked) through the rendezvous of `id`, configured from
/// the environment: the creation behind C's `hocclCommInitRank` and C++'s `fromUniqueId`.
pub(super) fn init_unique_id(op: &'static str, id: &UniqueId, nranks: i32, rank: i32) -> Result<Communicator> {
    let (n, r) = (rank_arg(op, "nranks", nranks)?, rank_arg(op, "rank", rank)?);
    if n == 0 || r >= n {
        return Err(Error::invalid_arg(op, format!("rank {rank} of nranks {nranks}")));
    }
    Communicator::from_unique_id(id, n, r, Config::from_env()?)
}

fn comm_init_unique_id(id: &[u8], nranks: i32, rank: i32, out: &mut Status) -> Box<Comm> {
    const OP: &str = "Communicator::fromUniqueId";
    let c = value(
        out,
        guarded(OP, || {
            let internal: [u8; 128] = id.try_into().map_err(|_| Error::invalid_arg(OP, format!("a unique id is 128 bytes, got {}", id.len())))?;
            init_unique_id(OP, &UniqueId { internal }, nranks, rank)
        })
        .map(Some),
    );
    Box::new(Comm { handle: c.map_or_else(CommHandle::empty, CommHandle::new) })
}

impl Comm {
    /// Run `f` on the live communicator; any failure (or panic) becomes a `Status`.
    fn call(&self, op: &'static str, f: impl FnOnce(&Communicator) -> Result<()>) -> Status {
        status(guarded(op, || f(&*self.handle.get(op)?)))
    }

    fn rank(&self, out: &mut Status) -> i32 {
        const OP: &str = "rank";
        value(out, guarded(OP, || to_c_int(OP, self.handle.get(OP)?.rank())))
    }
    fn size(&self, out: &mut Status) -> i32 {
        const OP: &str = "size";
        value(out, guarded(OP, || to_c_int(OP, self.handle.get(OP)?.size())))
    }
    /// The asynchronous error (success if none). Whether the call itself worked (the
    /// communicator is live) goes to `out`: the two must not be confused, since an async
    /// error may carry the same code (`InvalidUsage`) as a call on a destroyed handle.
    fn async_error(&self, out: &mut Status) -> Status {
        const OP: &str = "async_error";
        status(value(out, guarded(OP, || Ok(self.handle.get(OP)?.async_error()))).map_or(Ok(()), Err))
    }
    fn wait_idle(&self) -> Status {
        self.call("wait_idle", |c| c.wait_idle())
    }
    fn abort(&self) -> Status {
        status(guarded("abort", || self.handle.abort("abort")))
    }
    fn destroy(&self) -> Status {
        status(guarded("destroy", || self.handle.destroy("destroy")))
    }
    fn release(&self) -> Status {
        status(guarded("~Communicator", || self.handle.release("~Communicator")))
    }
    fn device(&self, out: &mut Status) -> Box<Dev> {
        const OP: &str = "device";
        Dev::boxed(out, guarded(OP, || Ok(self.handle.get(OP)?.device().clone())))
    }

    fn group_start(&self) -> Status {
        self.call("group_start", |c| c.group_start())
    }
    fn group_end(&self) -> Status {
        self.call("group_end", |c| c.group_end())
    }
    fn enqueue(&self, op: &OpArgs) -> Status {
        let name = op.kind.name();
        self.call(name, |c| c.enqueue(&op.desc(name)?))
    }
}

// ---------------------------------------------------------------- device -----------------

/// The device a communicator drives, shared with it (it outlives the communicator, so
/// buffers can be freed after `destroy`). `None` after a failed `Comm::device`.
pub struct Dev {
    pub(super) dev: Option<Arc<dyn Device>>,
}

impl Drop for Dev {
    fn drop(&mut self) {
        // Reached from C++ destructors: the last reference frees the device's memory and
        // streams, and nothing may unwind out of here.
        if let Some(dev) = self.dev.take() {
            if let Err(e) = guarded("~Device", || {
                drop(dev);
                Ok(())
            }) {
                log::error!("hoccl: {e}");
            }
        }
    }
}

impl Dev {
    /// The device of `r`, or (its error stored in `out`) a handle that holds none.
    pub(super) fn boxed(out: &mut Status, r: Result<Arc<dyn Device>>) -> Box<Dev> {
        Box::new(Dev { dev: value(out, r.map(Some)) })
    }
    pub(super) fn call<T>(&self, op: &'static str, f: impl FnOnce(&dyn Device) -> Result<T>) -> Result<T> {
        guarded(op, || f(self.dev.as_deref().ok_or_else(|| Error::invalid_usage(op, "no device (Communicator::device failed)"))?))
    }
    pub(super) fn backend(&self) -> String {
        match self.dev.as_ref().map(|d| d.backend()) {
            Some(Backend::Cuda) => "cuda".into(),
            Some(Backend::Host) => "host".into(),
            None => String::new(),
        }
    }
    pub(super) fn name(&self) -> String {
        self.call("Device::name", |d| Ok(d.name())).unwrap_or_default()
    }
    pub(super) fn ordinal(&self) -> usize {
        self.call("Device::ordinal", |d| Ok(d.ordinal())).unwrap_or_default()
    }
    pub(super) fn alloc(&self, bytes: usize, out: &mut Status) -> *mut u8 {
        value(out, self.call("Device::alloc", |d| Ok(Ptr(d.alloc(bytes)?.0 as usize as *mut u8)))).0
    }
    pub(super) fn free(&self, ptr: *mut u8) -> Status {
        status(self.call("Device::free", |d| if ptr.is_null() { Ok(()) } else { d.free(dev_ptr(ptr)) }))
    }
    pub(super) fn create_stream(&self, out: &mut Status) -> *mut CUstream_st {
        value(out, self.call("Device::create_stream", |d| Ok(Ptr(d.create_stream()?.0 as usize as *mut CUstream_st)))).0
    }
    pub(super) fn destroy_stream(&self, s: *mut CUstream_st) -> Status {
        status(self.call("Device::destroy_stream", |d| d.destroy_stream(stream(s))))
    }
    pub(super) fn synchronize(&self, s: *mut CUstream_st) -> Status {
        status(self.call("Device::synchronize", |d| d.synchronize(stream(s))))
    }
    pub(super) fn copy_to_host(&self, dst: &mut [u8], src: *const u8) -> Status {
        status(self.call("Device::copy_to_host", |d| d.copy_to_host(dst, dev_ptr(src))))
    }
    pub(super) fn copy_from_host(&self, dst: *mut u8, src: &[u8]) -> Status {
        status(self.call("Device::copy_from_host", |d| d.copy_from_host(dev_ptr(dst), src)))
    }
    fn memcpy_async(&self, dst: *mut u8, src: *const u8, bytes: usize, s: *mut CUstream_st) -> Status {
        status(self.call("Device::memcpy_async", |d| d.memcpy_async(stream(s), dev_ptr(dst), dev_ptr(src), bytes)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;
    use crate::ffi::handle::tests::with_ranks;

    const U8: i32 = DataType::U8 as i32;

    #[test]
    fn calls_report_codes_and_lifecycle() {
        with_ranks(2, |r, c| {
            let comm = Comm { handle: CommHandle::new(c) };
            let mut st = status(Ok(()));
            let dev = comm.device(&mut st);
            assert_eq!(st.code, 0, "{}", st.message);
            assert_eq!(dev.backend(), "host");
            let buf = dev.alloc(64, &mut st);
            assert_eq!(st.code, 0, "{}", st.message);
            let s = dev.create_stream(&mut st);
            assert_eq!(comm.rank(&mut st), r as i32);
            assert_eq!(comm.size(&mut st), 2);
            let null = std::ptr::null_mut::<u8>();
            let code = |s: Status| s.code;
            let op = |kind, send: *mut u8, recv, dt, root| comm.enqueue(&OpArgs::new(kind, send, recv, 4, dt, root, s));
            assert_eq!(code(op(OpKind::AllGather, buf, null, U8, 0)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(op(OpKind::AllGather, buf, buf, 42, 0)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(op(OpKind::Broadcast, buf, buf, U8, -1)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(op(OpKind::Send, buf, null, U8, -3)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(op(OpKind { repr: 99 }, buf, buf, U8, 0)), ErrorCode::InvalidArgument as i32);
            let red = |kind, red_op, root| comm.enqueue(&OpArgs::reduction(kind, buf, buf, 4, U8, red_op, root, s));
            for kind in [OpKind::AllReduce, OpKind::ReduceScatter, OpKind::Reduce] {
                let e = red(kind, 5, 0);
                assert_eq!(e.code, ErrorCode::InvalidArgument as i32, "{}", e.message);
                assert!(e.message.contains("reduction operator 5"), "{}", e.message);
                assert_eq!(code(red(kind, -1, 0)), ErrorCode::InvalidArgument as i32);
            }
            assert_eq!(code(red(OpKind::Reduce, 0, 2)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(red(OpKind::Reduce, 0, -1)), ErrorCode::InvalidArgument as i32);
            let counts = [4usize, 4];
            let short = OpArgs { send_counts: &counts[..1], send_displs: &counts, recv_counts: &counts, recv_displs: &counts, ..OpArgs::new(OpKind::AllToAllV, buf, buf, 0, U8, 0, s) };
            let e = comm.enqueue(&short);
            assert_eq!(e.code, ErrorCode::InvalidArgument as i32);
            assert!(e.message.contains("send_counts"), "{}", e.message);
            assert_eq!(code(comm.group_end()), ErrorCode::InvalidUsage as i32);
            let own = buf.wrapping_add(r * 4);
            assert_eq!(code(op(OpKind::AllGather, own, buf, U8, 0)), 0);
            assert_eq!(code(dev.synchronize(s)), 0);
            assert_eq!(code(comm.async_error(&mut st)), 0);
            assert_eq!(st.code, 0);
            assert_eq!(code(comm.destroy()), 0);
            let st = op(OpKind::AllGather, own, buf, U8, 0);
            assert_eq!(st.code, ErrorCode::InvalidUsage as i32, "{}", st.message);
            assert_eq!(code(comm.destroy()), ErrorCode::InvalidUsage as i32);
            assert_eq!(code(comm.release()), 0);
            // The device outlives the communicator.
            assert_eq!(code(dev.free(buf)), 0);
            assert_eq!(code(dev.free(buf)), ErrorCode::InvalidArgument as i32);
        });
    }

    /// Arguments that overflow address arithmetic inside `enqueue` unless it is checked (a
    /// panic in this build, with overflow checks, which the guard would turn into `Internal`;
    /// a silent wrap in release) are `InvalidArgument` (ctest/bad_input_check.cpp drives the
    /// same through C++).
    #[test]
    fn overflowing_addresses_are_invalid_arguments() {
        with_ranks(2, |_, c| {
            let comm = Comm { handle: CommHandle::new(c) };
            let mut st = status(Ok(()));
            let dev = comm.device(&mut st);
            let (a, b) = (dev.alloc(256, &mut st), dev.alloc(256, &mut st));
            let s = dev.create_stream(&mut st);
            assert_eq!(st.code, 0, "{}", st.message);
            // A receive buffer whose end wraps past 2^64, seen by the overlap test first.
            let top = usize::MAX as *mut u8;
            let e = comm.enqueue(&OpArgs::new(OpKind::AllToAll, a, top.wrapping_sub(15), 16, U8, 0, s));
            assert_eq!(e.code, ErrorCode::InvalidArgument as i32, "{}", e.message);
            // An empty block at a displacement whose byte offset overflows.
            let counts = [4usize, 0];
            let displs = [0usize, usize::MAX / 2];
            let f32_ = DataType::F32 as i32;
            let v = OpArgs { send_counts: &counts, send_displs: &displs, recv_counts: &counts, recv_displs: &displs, ..OpArgs::new(OpKind::AllToAllV, a, b, 0, f32_, 0, s) };
            let e = comm.enqueue(&v);
            assert_eq!(e.code, ErrorCode::InvalidArgument as i32, "{}", e.message);
            assert!(e.message.contains("displacement"), "{}", e.message);
            assert_eq!(comm.destroy().code, 0);
        });
    }

    #[test]
    fn communicator_from_a_unique_id() {
        let mut st = status(Ok(()));
        let id = unique_id(&mut st);
        assert_eq!((st.code, id.len()), (0, 128), "{}", st.message);
        let comm = comm_init_unique_id(&id[..100], 1, 0, &mut st);
        assert_eq!(st.code, ErrorCode::InvalidArgument as i32);
        assert!(st.message.contains("128 bytes, got 100"), "{}", st.message);
        assert_eq!(comm.size(&mut st), 0);
        assert_eq!(st.code, ErrorCode::InvalidUsage as i32);
        for (n, r) in [(1, 1), (0, 0), (1, -1)] {
            comm_init_unique_id(&id, n, r, &mut st);
            assert_eq!(st.code, ErrorCode::InvalidArgument as i32, "rank {r} of {n}: {}", st.message);
        }
        let comm = comm_init_unique_id(&id, 1, 0, &mut st);
        assert_eq!(st.code, 0, "{}", st.message);
        assert_eq!((comm.rank(&mut st), comm.size(&mut st)), (0, 1));
        assert_eq!(comm.destroy().code, 0);
    }

    #[test]
    fn failed_creation_leaves_an_unusable_handle() {
        let mut st = status(Ok(()));
        // Without MPI initialized, creation fails with an error value, not a crash.
        let comm = comm_init_mpi(0, &mut st);
        assert_ne!(st.code, 0);
        assert_eq!(comm.rank(&mut st), 0);
        assert_eq!(st.code, ErrorCode::InvalidUsage as i32);
        let dev = comm.device(&mut st);
        assert_eq!(st.code, ErrorCode::InvalidUsage as i32);
        assert_eq!(dev.alloc(8, &mut st), std::ptr::null_mut());
        assert_eq!(st.code, ErrorCode::InvalidUsage as i32);
    }
}
