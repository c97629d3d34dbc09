//! Streams and stream memory operations (`cuStreamWriteValue*` / `cuStreamWaitValue*`).
//!
//! 64-bit operations are used when the GPU reports
//! `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS` (every GPU under CUDA 12+, H200
//! included). Without it the 32-bit fallback applies, with this wrap rule:
//! - `write_value(v)` writes the low 32 bits of `v` and then the high 32 bits (two ordered
//!   stream writes). A CPU reader can observe the mix "new low, old high" in between; for
//!   increasing values that mix is never above the new value, so a CPU `>=` test never
//!   passes early.
//! - `wait_value_geq(v)` compares only the low 32 bits, cyclically:
//!   it passes when `(flag as u32).wrapping_sub(v as u32) as i32 >= 0`. It is therefore
//!   exact as long as the flag's value and `v` differ by less than 2^31, which monotonic
//!   sequence numbers with fewer than 2^31 operations in flight satisfy.
//!
//! The 64-bit wait is the same cyclic comparison on 64 bits (the driver's definition of
//! `CU_STREAM_WAIT_VALUE_GEQ`), i.e. plain `>=` for any realistic sequence numbers.
//!
//! **Batches.** `mem_ops` enqueues a run of waits and writes with `cuStreamBatchMemOp` (the
//! driver enqueues a batch's operations in array order), one driver call per
//! [`BATCH_CALL_OPS`] operations: the same operations, comparisons and 32-bit fallback as
//! the single calls (a fallback write is its two 32-bit writes, low half first, in the same
//! batch), at the cost of one call.
use super::driver::check;
use super::{cu_stream, lock, CudaDevice};
use crate::device::{DevPtr, MemOp, StreamHandle};
use crate::error::{Error, Result};
use cudarc::driver::sys;

const WRITE_DEFAULT: u32 = sys::CUstreamWriteValue_flags::CU_STREAM_WRITE_VALUE_DEFAULT as u32;
const WAIT_GEQ: u32 = sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32;

/// Operations per `cuStreamBatchMemOp` call at most (the driver takes fewer than 256).
pub(super) const BATCH_CALL_OPS: usize = 64;

impl CudaDevice {
    pub(super) fn stream_create(&self) -> Result<StreamHandle> {
        const OP: &str = "Device::create_stream";
        let _g = self.enter(OP)?;
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check(OP, "cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
        let h = StreamHandle(s as usize as u64);
        lock(&self.streams).insert(h.0);
        Ok(h)
    }

    /// Only streams made by `create_stream` on this device can be destroyed here.
    pub(super) fn stream_destroy(&self, s: StreamHandle) -> Result<()> {
        const OP: &str = "Device::destroy_stream";
        if !lock(&self.streams).remove(&s.0) {
            return Err(Error::invalid_arg(OP, format!("stream {:#x} was not created by this device", s.0)));
        }
        let _g = self.enter(OP)?;
        // SAFETY: s was created by cuStreamCreate here and is destroyed once (removed above).
        // Work still queued on it completes before the driver releases it.
        check(OP, "cuStreamDestroy_v2", unsafe { sys::cuStreamDestroy_v2(cu_stream(s)) })
    }

    pub(super) fn stream_synchronize(&self, s: StreamHandle) -> Result<()> {
        const OP: &str = "Device::synchronize";
        let _g = self.enter(OP)?;
        // SAFETY: the driver validates the stream handle.
        check(OP, "cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(cu_stream(s)) })
    }

    /// Whether all work queued on `s` so far has completed (`cuStreamQuery`; never blocks).
    pub(super) fn stream_query(&self, s: StreamHandle) -> Result<bool> {
        const OP: &str = "Device::stream_query";
        let _g = self.enter(OP)?;
        // SAFETY: the driver validates the stream handle; cuStreamQuery does not block.
        let r = unsafe { sys::cuStreamQuery(cu_stream(s)) };
        if r == sys::CUresult::CUDA_ERROR_NOT_READY {
            return Ok(false);
        }
        check(OP, "cuStreamQuery", r).map(|_| true)
    }

    /// Whether `s` is being captured into a graph (`cuStreamIsCapturing`; an invalidated
    /// capture counts as capturing: work enqueued on it is not run either).
    pub(super) fn stream_is_capturing(&self, s: StreamHandle) -> Result<bool> {
        const OP: &str = "Device::stream_capturing";
        let _g = self.enter(OP)?;
        let mut st = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
        // SAFETY: the driver validates the stream handle; st is a valid out-pointer.
        check(OP, "cuStreamIsCapturing", unsafe { sys::cuStreamIsCapturing(cu_stream(s), &mut st) })?;
        Ok(st != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    }

    pub(super) fn stream_write_value(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        const OP: &str = "Device::write_value";
        check_flag(OP, flag)?;
        let _g = self.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        enqueue_write(OP, cu_stream(s), flag, v, self.info.stream_mem_ops_64)
    }

    pub(super) fn stream_wait_value_geq(&self, s: StreamHandle, flag: DevPtr, v: u64) -> Result<()> {
        const OP: &str = "Device::wait_value_geq";
        check_flag(OP, flag)?;
        let _g = self.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        enqueue_wait_geq(OP, cu_stream(s), flag, v, self.info.stream_mem_ops_64)
    }

    pub(super) fn stream_mem_ops(&self, s: StreamHandle, ops: &[MemOp]) -> Result<()> {
        const OP: &str = "Device::mem_ops";
        check_mem_ops(OP, ops)?;
        if ops.is_empty() {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        enqueue_mem_ops(OP, cu_stream(s), ops, self.info.stream_mem_ops_64)
    }

    pub(super) fn stream_memcpy(&self, s: StreamHandle, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        const OP: &str = "Device::memcpy_async";
        if len == 0 {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        // SAFETY: the driver validates both ranges against its allocations (unified
        // addressing); keeping them alive until the copy completes is the caller's contract.
        check(OP, "cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst.0, src.0, len, cu_stream(s)) })
    }
}

/// Enqueue on `st` the write of `v` to `flag` (64-bit, or the two 32-bit halves: see the
/// module comment). The caller has checked `flag`, holds the context and its enqueue gate.
pub(super) fn enqueue_write(op: &'static str, st: sys::CUstream, flag: DevPtr, v: u64, mem_ops_64: bool) -> Result<()> {
    if mem_ops_64 {
        // SAFETY: flag is an 8-byte-aligned device-visible address (checked by the caller;
        // the driver validates it); the stream handle is validated by the driver.
        return check(op, "cuStreamWriteValue64_v2", unsafe { sys::cuStreamWriteValue64_v2(st, flag.0, v, WRITE_DEFAULT) });
    }
    // Low word first, then high word: see the module comment for why this order.
    // SAFETY: as above, on the two 4-byte halves of the flag (little-endian).
    check(op, "cuStreamWriteValue32_v2", unsafe { sys::cuStreamWriteValue32_v2(st, flag.0, v as u32, WRITE_DEFAULT) })?;
    // SAFETY: as above.
    check(op, "cuStreamWriteValue32_v2", unsafe { sys::cuStreamWriteValue32_v2(st, flag.0 + 4, (v >> 32) as u32, WRITE_DEFAULT) })
}

/// Enqueue on `st` a wait until `flag >= v` (64-bit, or the cyclic 32-bit comparison of the
/// low halves). The caller has checked `flag`, holds the context and its enqueue gate.
pub(super) fn enqueue_wait_geq(op: &'static str, st: sys::CUstream, flag: DevPtr, v: u64, mem_ops_64: bool) -> Result<()> {
    if mem_ops_64 {
        // SAFETY: as in enqueue_write.
        return check(op, "cuStreamWaitValue64_v2", unsafe { sys::cuStreamWaitValue64_v2(st, flag.0, v, WAIT_GEQ) });
    }
    // SAFETY: as above, on the low half of the flag.
    check(op, "cuStreamWaitValue32_v2", unsafe { sys::cuStreamWaitValue32_v2(st, flag.0, v as u32, WAIT_GEQ) })
}

/// Enqueue `ops` on `st` in order with `cuStreamBatchMemOp`, [`BATCH_CALL_OPS`] entries at
/// most per call (64-bit operations, or the 32-bit fallback of the single calls). The caller
/// has checked every flag, holds the context and its enqueue gate. On an error the calls
/// before the failed one stay enqueued.
pub(super) fn enqueue_mem_ops(op: &'static str, st: sys::CUstream, ops: &[MemOp], mem_ops_64: bool) -> Result<()> {
    batches(ops, mem_ops_64, |params| {
        // SAFETY: `params` are initialised operations on checked, 8-byte-aligned (4-byte for
        // a high half) device-visible addresses; the driver reads the array during the call
        // only and validates the stream handle.
        check(op, "cuStreamBatchMemOp_v2", unsafe { sys::cuStreamBatchMemOp_v2(st, params.len() as u32, params.as_mut_ptr(), 0) })
    })
}

/// The driver's entries for `ops`, in order, handed to `submit` in slices of at most
/// [`BATCH_CALL_OPS`]; a 32-bit fallback write is two entries (low word, then high word, as
/// `enqueue_write`), never split between two slices.
fn batches(ops: &[MemOp], mem_ops_64: bool, mut submit: impl FnMut(&mut [sys::CUstreamBatchMemOpParams]) -> Result<()>) -> Result<()> {
    use sys::CUstreamBatchMemOpType as T;
    let mut params: [sys::CUstreamBatchMemOpParams; BATCH_CALL_OPS] = [sys::CUstreamBatchMemOpParams { pad: [0; 6] }; BATCH_CALL_OPS];
    let mut n = 0;
    for (i, m) in ops.iter().enumerate() {
        match (*m, mem_ops_64) {
            (MemOp::WaitGeq { flag, value }, true) => params[n] = batch_param(T::CU_STREAM_MEM_OP_WAIT_VALUE_64, flag.0, value),
            (MemOp::Write { flag, value }, true) => params[n] = batch_param(T::CU_STREAM_MEM_OP_WRITE_VALUE_64, flag.0, value),
            (MemOp::WaitGeq { flag, value }, false) => params[n] = batch_param(T::CU_STREAM_MEM_OP_WAIT_VALUE_32, flag.0, value),
            (MemOp::Write { flag, value }, false) => {
                params[n] = batch_param(T::CU_STREAM_MEM_OP_WRITE_VALUE_32, flag.0, value);
                n += 1;
                params[n] = batch_param(T::CU_STREAM_MEM_OP_WRITE_VALUE_32, flag.0 + 4, value >> 32);
            }
        }
        n += 1;
        // An operation is at most two entries: a slice holds each one whole.
        if n + 2 > BATCH_CALL_OPS || i + 1 == ops.len() {
            submit(&mut params[..n])?;
            n = 0;
        }
    }
    Ok(())
}

/// One entry of a batch: a wait (`>=`, cyclic) or a write (after a memory barrier, as the
/// single calls' default flags) of `value` at `addr`. A 32-bit kind takes the low 32 bits,
/// which the 64-bit field holds in its first four bytes (little-endian, as the fallback's
/// halves at `flag` and `flag + 4` assume).
fn batch_param(kind: sys::CUstreamBatchMemOpType, addr: u64, value: u64) -> sys::CUstreamBatchMemOpParams {
    use sys::CUstreamBatchMemOpType as T;
    let value = match kind {
        T::CU_STREAM_MEM_OP_WAIT_VALUE_64 | T::CU_STREAM_MEM_OP_WRITE_VALUE_64 => value,
        _ => value & 0xffff_ffff,
    };
    let mut p = sys::CUstreamBatchMemOpParams { pad: [0; 6] };
    if matches!(kind, T::CU_STREAM_MEM_OP_WAIT_VALUE_32 | T::CU_STREAM_MEM_OP_WAIT_VALUE_64) {
        let v = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st__bindgen_ty_1 { value64: value };
        p.waitValue = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWaitValueParams_st { operation: kind, address: addr, __bindgen_anon_1: v, flags: WAIT_GEQ, alias: 0 };
    } else {
        let v = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st__bindgen_ty_1 { value64: value };
        p.writeValue = sys::CUstreamBatchMemOpParams_union_CUstreamMemOpWriteValueParams_st { operation: kind, address: addr, __bindgen_anon_1: v, flags: WRITE_DEFAULT, alias: 0 };
    }
    p
}

pub(super) fn check_mem_ops(op: &'static str, ops: &[MemOp]) -> Result<()> {
    ops.iter().try_for_each(|m| match *m {
        MemOp::WaitGeq { flag, .. } | MemOp::Write { flag, .. } => check_flag(op, flag),
    })
}

pub(super) fn check_flag(op: &'static str, flag: DevPtr) -> Result<()> {
    if flag.is_null() || flag.0 % 8 != 0 {
        return Err(Error::invalid_arg(op, format!("flag address {:#x} is null or not 8-byte aligned", flag.0)));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use sys::CUstreamBatchMemOpType as T;

    /// (kind, address, value, flags) of each entry, per driver call.
    fn entries(ops: &[MemOp], mem_ops_64: bool) -> Vec<Vec<(T, u64, u64, u32)>> {
        let mut calls = Vec::new();
        batches(ops, mem_ops_64, |params| {
            let read = |p: &sys::CUstreamBatchMemOpParams| {
                // SAFETY: every entry was written whole through `waitValue` or `writeValue`
                // (`batch_param`), which share their layout up to `flags`; `operation` says which.
                unsafe {
                    match p.operation {
                        T::CU_STREAM_MEM_OP_WAIT_VALUE_32 | T::CU_STREAM_MEM_OP_WAIT_VALUE_64 => (p.waitValue.operation, p.waitValue.address, p.waitValue.__bindgen_anon_1.value64, p.waitValue.flags),
                        _ => (p.writeValue.operation, p.writeValue.address, p.writeValue.__bindgen_anon_1.value64, p.writeValue.flags),
                    }
                }
            };
            calls.push(params.iter().map(read).collect());
            Ok(())
        })
        .unwrap();
        calls
    }

    const W: MemOp = MemOp::WaitGeq { flag: DevPtr(0x1000), value: 0x1_0000_0002 };
    const S: MemOp = MemOp::Write { flag: DevPtr(0x2000), value: 0x3_0000_0004 };

    #[test]
    fn wide_operations_are_one_entry_each() {
        assert_eq!(
            entries(&[W, S], true),
            vec![vec![(T::CU_STREAM_MEM_OP_WAIT_VALUE_64, 0x1000, 0x1_0000_0002, WAIT_GEQ), (T::CU_STREAM_MEM_OP_WRITE_VALUE_64, 0x2000, 0x3_0000_0004, WRITE_DEFAULT)]]
        );
    }

    /// The 32-bit fallback: a wait compares the low word; a write is the low word, then the
    /// high word at `flag + 4`, as the single calls do.
    #[test]
    fn the_fallback_splits_writes_low_word_first() {
        assert_eq!(
            entries(&[W, S], false),
            vec![vec![
                (T::CU_STREAM_MEM_OP_WAIT_VALUE_32, 0x1000, 2, WAIT_GEQ),
                (T::CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x2000, 4, WRITE_DEFAULT),
                (T::CU_STREAM_MEM_OP_WRITE_VALUE_32, 0x2004, 3, WRITE_DEFAULT),
            ]]
        );
    }

    /// A long run goes in calls of at most `BATCH_CALL_OPS` entries, in order, a fallback
    /// write's two entries always in the same call.
    #[test]
    fn long_runs_split_between_operations() {
        for wide in [true, false] {
            let ops: Vec<MemOp> = (0..200u64).map(|v| if v % 3 == 0 { MemOp::WaitGeq { flag: DevPtr(8 * v), value: v } } else { MemOp::Write { flag: DevPtr(8 * v), value: v << 32 | v } }).collect();
            let calls = entries(&ops, wide);
            assert!(calls.len() > 1 && calls.iter().all(|c| !c.is_empty() && c.len() <= BATCH_CALL_OPS), "{wide}: {:?}", calls.iter().map(Vec::len).collect::<Vec<_>>());
            let all: Vec<_> = calls.iter().flatten().copied().collect();
            // 133 of the 200 are writes: two entries each in the fallback.
            assert_eq!(all.len(), if wide { 200 } else { 200 + 133 });
            for c in &calls {
                assert!(c[0].1 % 8 == 0, "{wide}: a call starts with the high word of a write: {:?}", c[0]);
            }
            let addrs: Vec<u64> = all.iter().map(|e| e.1 & !7).collect();
            assert!(addrs.windows(2).all(|w| w[0] <= w[1]), "{wide}: entries out of order");
        }
    }
}
