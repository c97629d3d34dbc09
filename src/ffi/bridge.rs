//! The cxx bridge behind `include/hoccl/hoccl.hpp`. C++ owns a `rust::Box<Comm>` (and
//! `rust::Box<Dev>` for the device helpers); the public C++ classes wrap them.
//!
//! Contract of every function here: it never unwinds (bodies run under
//! [`guarded`](super::guarded)); failures come back as a [`Status`](ffi::Status) with a
//! numeric [`ErrorCode`](crate::ErrorCode) and a message, which the header turns into
//! `hoccl::Error`. Buffers cross as `uint8_t*` and streams as `CUstream_st*` (CUDA's
//! `CUstream`/`cudaStream_t`); neither is dereferenced here: the device backend validates
//! every address before it is used. cxx requires functions with pointer arguments to be
//! declared `unsafe`; they impose nothing on their caller beyond that.
use super::{guarded, rank_arg, to_c_int, CommHandle};
use crate::comm::Communicator;
use crate::config::Config;
use crate::device::{Backend, DevPtr, Device, StreamHandle};
use crate::error::{Error, Result};
use crate::types::DataType;
pub(super) use ffi::{CUstream_st, Status};
use std::sync::Arc;

#[cxx::bridge(namespace = "hoccl::bridge")]
mod ffi {
    /// Outcome of a call: `code` 0 is success, otherwise an `ErrorCode` value and its message.
    struct Status {
        code: i32,
        message: String,
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
        fn rank(self: &Comm, status: &mut Status) -> i32;
        fn size(self: &Comm, status: &mut Status) -> i32;
        fn async_error(self: &Comm, status: &mut Status) -> Status;
        fn wait_idle(self: &Comm) -> Status;
        fn abort(self: &Comm) -> Status;
        fn destroy(self: &Comm) -> Status;
        fn release(self: &Comm) -> Status;
        fn device(self: &Comm, status: &mut Status) -> Box<Dev>;

        // ---- groups and collectives ----------------------------------------------------
        fn group_start(self: &Comm) -> Status;
        fn group_end(self: &Comm) -> Status;
        unsafe fn send(self: &Comm, buf: *const u8, count: usize, dtype: i32, peer: i32, stream: *mut CUstream_st) -> Status;
        unsafe fn recv(self: &Comm, buf: *mut u8, count: usize, dtype: i32, peer: i32, stream: *mut CUstream_st) -> Status;
        unsafe fn all_gather(
            self: &Comm,
            send: *const u8,
            recv: *mut u8,
            count: usize,
            dtype: i32,
            stream: *mut CUstream_st,
        ) -> Status;
        unsafe fn all_to_all(
            self: &Comm,
            send: *const u8,
            recv: *mut u8,
            count: usize,
            dtype: i32,
            stream: *mut CUstream_st,
        ) -> Status;
        #[allow(clippy::too_many_arguments)]
        unsafe fn all_to_allv(
            self: &Comm,
            send: *const u8,
            send_counts: &[usize],
            send_displs: &[usize],
            recv: *mut u8,
            recv_counts: &[usize],
            recv_displs: &[usize],
            dtype: i32,
            stream: *mut CUstream_st,
        ) -> Status;
        #[allow(clippy::too_many_arguments)]
        unsafe fn broadcast(
            self: &Comm,
            send: *const u8,
            recv: *mut u8,
            count: usize,
            dtype: i32,
            root: i32,
            stream: *mut CUstream_st,
        ) -> Status;
        #[allow(clippy::too_many_arguments)]
        unsafe fn gather(
            self: &Comm,
            send: *const u8,
            recv: *mut u8,
            count: usize,
            dtype: i32,
            root: i32,
            stream: *mut CUstream_st,
        ) -> Status;
        #[allow(clippy::too_many_arguments)]
        unsafe fn scatter(
            self: &Comm,
            send: *const u8,
            recv: *mut u8,
            count: usize,
            dtype: i32,
            root: i32,
            stream: *mut CUstream_st,
        ) -> Status;

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
        unsafe fn fill_pattern(self: &Dev, dst: *mut u8, bytes: usize, seed: u64, stream: *mut CUstream_st) -> Status;

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
    let r = guarded(OP, || Communicator::from_mpi_fortran(mpi_comm_f, Config::from_env()?));
    match r {
        Ok(c) => {
            *out = status(Ok(()));
            Box::new(Comm { handle: CommHandle::new(c) })
        }
        Err(e) => {
            *out = status(Err(e));
            Box::new(Comm { handle: CommHandle::empty() })
        }
    }
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
        match guarded(OP, || Ok(self.handle.get(OP)?.device().clone())) {
            Ok(dev) => {
                *out = status(Ok(()));
                Box::new(Dev { dev: Some(dev) })
            }
            Err(e) => {
                *out = status(Err(e));
                Box::new(Dev { dev: None })
            }
        }
    }

    fn group_start(&self) -> Status {
        self.call("group_start", |c| c.group_start())
    }
    fn group_end(&self) -> Status {
        self.call("group_end", |c| c.group_end())
    }
    fn send(&self, buf: *const u8, count: usize, dt: i32, peer: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "send";
        self.call(OP, |c| c.send(dev_ptr(buf), count, dtype(OP, dt)?, rank_arg(OP, "peer", peer)?, stream(s)))
    }
    fn recv(&self, buf: *mut u8, count: usize, dt: i32, peer: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "recv";
        self.call(OP, |c| c.recv(dev_ptr(buf), count, dtype(OP, dt)?, rank_arg(OP, "peer", peer)?, stream(s)))
    }
    fn all_gather(&self, send: *const u8, recv: *mut u8, count: usize, dt: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "all_gather";
        self.call(OP, |c| c.all_gather(dev_ptr(send), dev_ptr(recv), count, dtype(OP, dt)?, stream(s)))
    }
    fn all_to_all(&self, send: *const u8, recv: *mut u8, count: usize, dt: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "all_to_all";
        self.call(OP, |c| c.all_to_all(dev_ptr(send), dev_ptr(recv), count, dtype(OP, dt)?, stream(s)))
    }
    #[allow(clippy::too_many_arguments)]
    fn all_to_allv(
        &self,
        send: *const u8,
        send_counts: &[usize],
        send_displs: &[usize],
        recv: *mut u8,
        recv_counts: &[usize],
        recv_displs: &[usize],
        dt: i32,
        s: *mut CUstream_st,
    ) -> Status {
        const OP: &str = "all_to_allv";
        self.call(OP, |c| {
            let dt = dtype(OP, dt)?;
            c.all_to_allv(dev_ptr(send), send_counts, send_displs, dev_ptr(recv), recv_counts, recv_displs, dt, stream(s))
        })
    }
    #[allow(clippy::too_many_arguments)]
    fn broadcast(&self, send: *const u8, recv: *mut u8, count: usize, dt: i32, root: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "broadcast";
        self.call(OP, |c| c.broadcast(dev_ptr(send), dev_ptr(recv), count, dtype(OP, dt)?, rank_arg(OP, "root", root)?, stream(s)))
    }
    #[allow(clippy::too_many_arguments)]
    fn gather(&self, send: *const u8, recv: *mut u8, count: usize, dt: i32, root: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "gather";
        self.call(OP, |c| c.gather(dev_ptr(send), dev_ptr(recv), count, dtype(OP, dt)?, rank_arg(OP, "root", root)?, stream(s)))
    }
    #[allow(clippy::too_many_arguments)]
    fn scatter(&self, send: *const u8, recv: *mut u8, count: usize, dt: i32, root: i32, s: *mut CUstream_st) -> Status {
        const OP: &str = "scatter";
        self.call(OP, |c| c.scatter(dev_ptr(send), dev_ptr(recv), count, dtype(OP, dt)?, rank_arg(OP, "root", root)?, stream(s)))
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
    fn fill_pattern(&self, dst: *mut u8, bytes: usize, seed: u64, s: *mut CUstream_st) -> Status {
        status(self.call("Device::fill_pattern", |d| d.fill_pattern_async(stream(s), dev_ptr(dst), bytes, seed)))
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
            assert_eq!(code(comm.all_gather(buf, null, 4, U8, s)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(comm.all_gather(buf, buf, 4, 42, s)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(comm.broadcast(buf, buf, 4, U8, -1, s)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(comm.send(buf, 4, U8, -3, s)), ErrorCode::InvalidArgument as i32);
            assert_eq!(code(comm.group_end()), ErrorCode::InvalidUsage as i32);
            let own = buf.wrapping_add(r * 4);
            assert_eq!(code(comm.all_gather(own, buf, 4, U8, s)), 0);
            assert_eq!(code(dev.synchronize(s)), 0);
            assert_eq!(code(comm.async_error(&mut st)), 0);
            assert_eq!(st.code, 0);
            assert_eq!(code(comm.destroy()), 0);
            let st = comm.all_gather(own, buf, 4, U8, s);
            assert_eq!(st.code, ErrorCode::InvalidUsage as i32, "{}", st.message);
            assert_eq!(code(comm.destroy()), ErrorCode::InvalidUsage as i32);
            assert_eq!(code(comm.release()), 0);
            // The device outlives the communicator.
            assert_eq!(code(dev.free(buf)), 0);
            assert_eq!(code(dev.free(buf)), ErrorCode::InvalidArgument as i32);
        });
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
