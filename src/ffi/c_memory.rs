//! Device memory and stream helpers of the C ABI, on the device a communicator drives. On CUDA an engine uses
//! its own `cudaMalloc`/streams instead (any device pointer and stream of the communicator's
//! GPU works); on the host backend (no GPU) buffers and streams must come from hoccl, and
//! these are how C code gets them. Memory and streams made here belong to the
//! communicator's device and are released with it (destroy or abort).
use super::c_api::{call, cudaStream_t, hocclComm_t, hocclResult_t, live, put};
use super::bridge::{dev_ptr, stream as stream_handle};
use crate::error::{Error, Result};
use std::ffi::c_void;

fn host_slice<'a>(op: &'static str, what: &str, p: *const c_void, bytes: usize) -> Result<&'a [u8]> {
    if bytes == 0 {
        return Ok(&[]);
    }
    if p.is_null() {
        return Err(Error::invalid_arg(op, format!("{what} is NULL")));
    }
    // SAFETY: non-NULL; the caller's contract is `bytes` readable bytes of host memory that
    // no one writes during the call.
    Ok(unsafe { std::slice::from_raw_parts(p as *const u8, bytes) })
}

fn host_slice_mut<'a>(op: &'static str, what: &str, p: *mut c_void, bytes: usize) -> Result<&'a mut [u8]> {
    if bytes == 0 {
        return Ok(&mut []);
    }
    if p.is_null() {
        return Err(Error::invalid_arg(op, format!("{what} is NULL")));
    }
    // SAFETY: non-NULL; the caller's contract is `bytes` writable bytes of host memory that
    // no one else accesses during the call.
    Ok(unsafe { std::slice::from_raw_parts_mut(p as *mut u8, bytes) })
}

/// `*ptr` becomes `bytes` of device memory of `comm`'s device.
#[no_mangle]
pub extern "C" fn hocclMemAlloc(comm: hocclComm_t, ptr: *mut *mut c_void, bytes: usize) -> hocclResult_t {
    const OP: &str = "hocclMemAlloc";
    call(OP, || {
        put(OP, "ptr", ptr, std::ptr::null_mut())?;
        let p = live(OP, comm)?.device().alloc(bytes)?;
        put(OP, "ptr", ptr, p.0 as usize as *mut c_void)
    })
}

/// Free memory from `hocclMemAlloc` (NULL is a no-op).
#[no_mangle]
pub extern "C" fn hocclMemFree(comm: hocclComm_t, ptr: *mut c_void) -> hocclResult_t {
    const OP: &str = "hocclMemFree";
    call(OP, || {
        let c = live(OP, comm)?;
        if ptr.is_null() {
            return Ok(());
        }
        c.device().free(dev_ptr(ptr))
    })
}

#[no_mangle]
pub extern "C" fn hocclStreamCreate(comm: hocclComm_t, stream: *mut cudaStream_t) -> hocclResult_t {
    const OP: &str = "hocclStreamCreate";
    call(OP, || {
        put(OP, "stream", stream, std::ptr::null_mut())?;
        let s = live(OP, comm)?.device().create_stream()?;
        put(OP, "stream", stream, s.0 as usize as cudaStream_t)
    })
}

#[no_mangle]
pub extern "C" fn hocclStreamDestroy(comm: hocclComm_t, stream: cudaStream_t) -> hocclResult_t {
    const OP: &str = "hocclStreamDestroy";
    call(OP, || live(OP, comm)?.device().destroy_stream(stream_handle(stream)))
}

/// Block until everything enqueued on `stream` so far has completed.
#[no_mangle]
pub extern "C" fn hocclStreamSynchronize(comm: hocclComm_t, stream: cudaStream_t) -> hocclResult_t {
    const OP: &str = "hocclStreamSynchronize";
    call(OP, || live(OP, comm)?.device().synchronize(stream_handle(stream)))
}

/// Synchronous copy of `bytes` from host memory `src` to device memory `dst`.
#[no_mangle]
pub extern "C" fn hocclMemcpyToDevice(comm: hocclComm_t, dst: *mut c_void, src: *const c_void, bytes: usize) -> hocclResult_t {
    const OP: &str = "hocclMemcpyToDevice";
    call(OP, || {
        let c = live(OP, comm)?;
        c.device().copy_from_host(dev_ptr(dst), host_slice(OP, "src", src, bytes)?)
    })
}

/// Synchronous copy of `bytes` from device memory `src` to host memory `dst`.
#[no_mangle]
pub extern "C" fn hocclMemcpyToHost(comm: hocclComm_t, dst: *mut c_void, src: *const c_void, bytes: usize) -> hocclResult_t {
    const OP: &str = "hocclMemcpyToHost";
    call(OP, || {
        let c = live(OP, comm)?;
        c.device().copy_to_host(host_slice_mut(OP, "dst", dst, bytes)?, dev_ptr(src))
    })
}
