//! Stream work gathered so that consecutive stream memory operations reach the driver in
//! one call (`cuStreamBatchMemOp`). What the calling thread enqueues for an operation is runs
//! of flag waits and writes separated by copies (the handshake's start and finish, the
//! staged path's chunk flags), and under MPS each driver call costs microseconds: the
//! enqueue, not the copy, bounds a small operation (docs/design.md, "Application threads
//! that wait inside the driver").
//!
//! A [`Batch`] keeps the waits and writes given to it and hands them to its [`Sink`] as one
//! `mem_ops` call before the next copy, at [`Batch::flush`], or when its inline buffer is
//! full. The order on the stream is the order of the calls made on the batch. A batch makes
//! no allocation. Its owner flushes it before letting go of it: operations still held are
//! not on the stream, and a dropped batch discards them (what the failure paths want: after a
//! failed enqueue the rest of the operation is not enqueued either).
use super::{CopyQueue, DevPtr, Device, MemOp, StreamHandle};
use crate::error::Result;

/// Where a batch's work goes: a stream of a device, or a copy queue.
pub trait Sink {
    /// Enqueue `ops` in order (one driver call where the backend batches).
    fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()>;
    /// Enqueue a copy of `len` bytes (`len > 0`).
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()>;
}

/// A stream of a device.
pub struct OnStream<'a> {
    pub dev: &'a dyn Device,
    pub stream: StreamHandle,
}

impl Sink for OnStream<'_> {
    fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()> {
        self.dev.mem_ops(self.stream, ops)
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        self.dev.memcpy_async(self.stream, dst, src, len)
    }
}

impl Sink for Box<dyn CopyQueue> {
    fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()> {
        (**self).mem_ops(ops)
    }
    fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        (**self).copy(dst, src, len)
    }
}

/// Memory operations a batch holds at most before it submits them anyway. CUDA takes fewer
/// than 256 per call, and the 32-bit fallback turns a write into two; the callers' runs
/// are a few operations long (a staged chunk's write and the next chunk's two waits).
pub const BATCH_OPS: usize = 16;

/// Waits and writes held for one call, in front of a [`Sink`].
pub struct Batch<S: Sink> {
    sink: S,
    ops: [MemOp; BATCH_OPS],
    len: usize,
}

impl<S: Sink> Batch<S> {
    pub fn new(sink: S) -> Batch<S> {
        Batch { sink, ops: [MemOp::Write { flag: DevPtr::NULL, value: 0 }; BATCH_OPS], len: 0 }
    }

    fn push(&mut self, op: MemOp) -> Result<()> {
        if self.len == BATCH_OPS {
            self.flush()?;
        }
        self.ops[self.len] = op;
        self.len += 1;
        Ok(())
    }

    /// Hold the stream until the flag at `flag` is >= `value` (enqueued with the run).
    pub fn wait_geq(&mut self, flag: DevPtr, value: u64) -> Result<()> {
        self.push(MemOp::WaitGeq { flag, value })
    }

    /// Write `value` to `flag` after everything before it (enqueued with the run).
    pub fn write(&mut self, flag: DevPtr, value: u64) -> Result<()> {
        self.push(MemOp::Write { flag, value })
    }

    /// Enqueue the held run, then the copy (nothing for 0 bytes).
    pub fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        self.flush()?;
        self.sink.copy(dst, src, len)
    }

    /// Enqueue the held run (one call; none when nothing is held). On an error the run is
    /// dropped: a prefix of it may be on the stream.
    pub fn flush(&mut self) -> Result<()> {
        let n = std::mem::take(&mut self.len);
        if n == 0 {
            return Ok(());
        }
        self.sink.mem_ops(&self.ops[..n])
    }

    /// Operations held and not yet enqueued.
    pub fn held(&self) -> usize {
        self.len
    }

    /// The sink, for work the batch does not carry (fences, queries). Flush first where
    /// that work must come after the held run.
    pub fn sink(&mut self) -> &mut S {
        &mut self.sink
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records each call it gets.
    #[derive(Default)]
    struct Record(Vec<Result<Vec<MemOp>, (u64, u64, usize)>>);

    impl Sink for &mut Record {
        fn mem_ops(&mut self, ops: &[MemOp]) -> Result<()> {
            self.0.push(Ok(ops.to_vec()));
            Ok(())
        }
        fn copy(&mut self, dst: DevPtr, src: DevPtr, len: usize) -> Result<()> {
            self.0.push(Err((dst.0, src.0, len)));
            Ok(())
        }
    }

    fn w(f: u64, v: u64) -> MemOp {
        MemOp::WaitGeq { flag: DevPtr(f), value: v }
    }
    fn s(f: u64, v: u64) -> MemOp {
        MemOp::Write { flag: DevPtr(f), value: v }
    }

    /// A staged receive of two chunks between a handshake's start and finish: the runs
    /// between copies go in one call each (5 calls, 10 operations and copies).
    #[test]
    fn runs_between_copies_are_one_call() {
        let mut r = Record::default();
        let mut b = Batch::new(&mut r);
        b.write(DevPtr(8), 1).unwrap();
        for g in 1..=2u64 {
            b.wait_geq(DevPtr(16), g).unwrap();
            b.wait_geq(DevPtr(24), g - 1).unwrap();
            b.copy(DevPtr(100 * g), DevPtr(1000), 64).unwrap();
            b.write(DevPtr(24), g).unwrap();
        }
        b.copy(DevPtr(1), DevPtr(2), 0).unwrap();
        b.wait_geq(DevPtr(32), 1).unwrap();
        assert_eq!(b.held(), 2);
        b.flush().unwrap();
        b.flush().unwrap();
        assert_eq!(b.held(), 0);
        assert_eq!(
            r.0,
            vec![
                Ok(vec![s(8, 1), w(16, 1), w(24, 0)]),
                Err((100, 1000, 64)),
                Ok(vec![s(24, 1), w(16, 2), w(24, 1)]),
                Err((200, 1000, 64)),
                Ok(vec![s(24, 2), w(32, 1)]),
            ]
        );
    }

    /// A run longer than the buffer goes in order, in calls of at most `BATCH_OPS`.
    #[test]
    fn long_runs_split_in_order() {
        let mut r = Record::default();
        let mut b = Batch::new(&mut r);
        let n = 2 * BATCH_OPS as u64 + 3;
        (0..n).for_each(|i| b.write(DevPtr(8), i).unwrap());
        b.flush().unwrap();
        let sizes: Vec<usize> = r.0.iter().map(|c| c.as_ref().map_or(0, Vec::len)).collect();
        assert_eq!(sizes, vec![BATCH_OPS, BATCH_OPS, 3]);
        let all: Vec<MemOp> = r.0.into_iter().flat_map(|c| c.unwrap()).collect();
        assert_eq!(all, (0..n).map(|i| s(8, i)).collect::<Vec<_>>());
    }
}
