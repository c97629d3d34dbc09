//! A copy-engine queue: a dedicated non-blocking stream on which the proxy enqueues
//! `cuMemcpyAsync`s (DMA, no kernel) and fences (events from a per-queue pool).
//!
//! Cost model for the proxy: `copy` and `fence` are one enqueueing driver call each;
//! `completed` is one `cuEventQuery` per fence that completed since the last call plus at
//! most one for the oldest still pending, and never blocks. The driver spreads streams over
//! the GPU's copy engines itself (hardware channels are assigned round-robin), so one queue
//! per engine (`copy_engine_count`) is the natural setting.
//!
//! `wait_geq` and `write_value` are the stream memory operations of `stream.rs` on the
//! queue's stream (64-bit where the GPU has them, the same 32-bit fallback otherwise), and
//! `mem_ops` a run of them in one `cuStreamBatchMemOp` call: the same-host transport's
//! gated queues wait there for both streams' flags and write the receiver's landing flag
//! behind the copies; the staged queues wait for free slots and write chunk flags.
use super::driver::{check, error_name};
use super::stream::{check_flag, check_mem_ops, enqueue_mem_ops, enqueue_wait_geq, enqueue_write};
use super::Context;
use crate::device::{CopyQueue, DevPtr, MemOp};
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::VecDeque;
use std::sync::Arc;

pub struct CudaCopyQueue {
    ctx: Arc<Context>,
    stream: sys::CUstream,
    /// Recorded events, oldest first, with their tickets (increasing by one).
    pending: VecDeque<(u64, sys::CUevent)>,
    /// Events whose fence completed, ready to be recorded again.
    free: Vec<sys::CUevent>,
    /// The ticket the next fence gets (starts at 1).
    next_ticket: u64,
    /// The highest ticket known complete (0 before any).
    done: u64,
    /// Whether the GPU has 64-bit stream memory operations (`stream.rs`).
    mem_ops_64: bool,
}

// SAFETY: the stream and event handles may be used from any thread; the queue is owned by
// one thread at a time (`&mut self` methods).
unsafe impl Send for CudaCopyQueue {}

impl CudaCopyQueue {
    pub(super) fn new(ctx: Arc<Context>, mem_ops_64: bool) -> Result<CudaCopyQueue> {
        const OP: &str = "Device::create_copy_queue";
        let _g = ctx.enter(OP)?;
        let mut stream: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the context is current.
        check(OP, "cuStreamCreate", unsafe { sys::cuStreamCreate(&mut stream, flags) })?;
        drop(_g);
        Ok(CudaCopyQueue { ctx, stream, pending: VecDeque::new(), free: Vec::new(), next_ticket: 1, done: 0, mem_ops_64 })
    }

    /// The queue's stream (for callers that need to order other work after its copies).
    pub fn stream(&self) -> sys::CUstream {
        self.stream
    }

    fn event(&mut self, op: &'static str) -> Result<sys::CUevent> {
        if let Some(e) = self.free.pop() {
            return Ok(e);
        }
        let mut e: sys::CUevent = std::ptr::null_mut();
        let flags = sys::CUevent_flags::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; the context is current (caller holds a guard).
        check(op, "cuEventCreate", unsafe { sys::cuEventCreate(&mut e, flags) })?;
        Ok(e)
    }
}

impl CopyQueue for CudaCopyQueue {
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "CopyQueue::copy";
        if len == 0 {
            return Ok(());
        }
        let _g = self.ctx.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        // SAFETY: the driver validates both ranges (unified addressing); keeping them alive
        // until a later fence completes is the caller's contract.
        check(OP, "cuMemcpyAsync", unsafe { sys::cuMemcpyAsync(dst.0, src.0, len, self.stream) })
    }

    fn fence(&mut self) -> Result<u64> {
        crate::device::calls::enter();
        const OP: &str = "CopyQueue::fence";
        let _g = self.ctx.enter(OP)?;
        let e = self.event(OP)?;
        let gate = self.ctx.enqueue_gate(OP);
        // SAFETY: e is an event of this context, not pending elsewhere; the stream is ours.
        let r = unsafe { sys::cuEventRecord(e, self.stream) };
        drop(gate);
        if let Err(err) = check(OP, "cuEventRecord", r) {
            self.free.push(e);
            return Err(err);
        }
        let t = self.next_ticket;
        self.next_ticket += 1;
        self.pending.push_back((t, e));
        Ok(t)
    }

    fn completed(&mut self) -> Result<u64> {
        crate::device::calls::enter();
        const OP: &str = "CopyQueue::completed";
        if self.pending.is_empty() {
            return Ok(self.done);
        }
        let _g = self.ctx.enter(OP)?;
        while let Some(&(t, e)) = self.pending.front() {
            // SAFETY: e was recorded on our stream; cuEventQuery never blocks.
            let r = unsafe { sys::cuEventQuery(e) };
            if r == sys::CUresult::CUDA_ERROR_NOT_READY {
                break;
            }
            check(OP, "cuEventQuery", r)?;
            self.pending.pop_front();
            self.free.push(e);
            self.done = t;
        }
        Ok(self.done)
    }

    fn wait_geq(&mut self, flag: DevPtr, v: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "CopyQueue::wait_geq";
        check_flag(OP, flag)?;
        let _g = self.ctx.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        enqueue_wait_geq(OP, self.stream, flag, v, self.mem_ops_64)
    }

    /// The default write flag puts a memory barrier before the write, so a reader that sees
    /// the value sees the bytes of the queue's earlier copies.
    fn write_value(&mut self, flag: DevPtr, v: u64) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "CopyQueue::write_value";
        check_flag(OP, flag)?;
        let _g = self.ctx.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        enqueue_write(OP, self.stream, flag, v, self.mem_ops_64)
    }

    fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()> {
        crate::device::calls::enter();
        const OP: &str = "CopyQueue::mem_ops";
        check_mem_ops(OP, ops)?;
        if ops.is_empty() {
            return Ok(());
        }
        let _g = self.ctx.enter(OP)?;
        let _gate = self.ctx.enqueue_gate(OP);
        enqueue_mem_ops(OP, self.stream, ops, self.mem_ops_64)
    }
}

impl Drop for CudaCopyQueue {
    fn drop(&mut self) {
        let _g = self.ctx.enter("CopyQueue::drop").map_err(|e| log::warn!("hoccl: {e}")).ok();
        for e in self.free.drain(..).chain(self.pending.drain(..).map(|(_, e)| e)) {
            // SAFETY: each event was created here and is destroyed once; a pending one is
            // released by the driver after it completes.
            let r = unsafe { sys::cuEventDestroy_v2(e) };
            if r != sys::CUresult::CUDA_SUCCESS {
                log::warn!("hoccl: cuEventDestroy failed: {}", error_name(r));
            }
        }
        // SAFETY: the stream was created here and is destroyed once; queued copies complete
        // before the driver releases it.
        let r = unsafe { sys::cuStreamDestroy_v2(self.stream) };
        if r != sys::CUresult::CUDA_SUCCESS {
            log::warn!("hoccl: cuStreamDestroy of a copy queue failed: {}", error_name(r));
        }
    }
}
