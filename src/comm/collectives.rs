//! The Rust API of every operation: each method fills an [`OpDesc`] and calls
//! [`Communicator::enqueue`], which validates it (see `op.rs` for each operation's
//! contract). All are stream-ordered and asynchronous; buffers are device pointers (any
//! alignment), counts are in elements of `dtype`.
use super::op::{Collective, OpDesc};
use super::Communicator;
use crate::device::{DevPtr, StreamHandle};
use crate::error::Result;
use crate::reduce::RedOp;
use crate::types::DataType;

impl Communicator {
    fn op(&self, coll: Collective, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, stream: StreamHandle) -> Result<()> {
        self.enqueue(&OpDesc { coll, send, recv, count, dtype, stream })
    }

    /// Send `count` elements to `peer` (match with its `recv`; use a group for pairs).
    pub fn send(&self, buf: DevPtr, count: usize, dtype: DataType, peer: usize, stream: StreamHandle) -> Result<()> {
        self.op(Collective::Send { peer }, buf, DevPtr::NULL, count, dtype, stream)
    }

    /// Receive `count` elements from `peer`.
    pub fn recv(&self, buf: DevPtr, count: usize, dtype: DataType, peer: usize, stream: StreamHandle) -> Result<()> {
        self.op(Collective::Recv { peer }, DevPtr::NULL, buf, count, dtype, stream)
    }

    /// Every rank's `count` elements, concatenated by rank into every rank's `recv`
    /// (`size * count` elements). In place when `send == recv + rank * count`.
    pub fn all_gather(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, stream: StreamHandle) -> Result<()> {
        self.op(Collective::AllGather, send, recv, count, dtype, stream)
    }

    /// Block j of `send` (`count` elements) goes to rank j, which stores it as block
    /// `rank` of its `recv`. Buffers must not overlap (in place is not supported).
    pub fn all_to_all(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, stream: StreamHandle) -> Result<()> {
        self.op(Collective::AllToAll, send, recv, count, dtype, stream)
    }

    /// AlltoAll with per-peer counts and displacements (in elements, MPI style):
    /// `send_counts[j]` elements at `send + send_displs[j]` go to rank j, which receives
    /// `recv_counts[rank]` of them at `recv + recv_displs[rank]`. Counts must agree
    /// pairwise (a mismatch is reported as an error by both ranks).
    #[allow(clippy::too_many_arguments)]
    pub fn all_to_allv(
        &self,
        send: DevPtr,
        send_counts: &[usize],
        send_displs: &[usize],
        recv: DevPtr,
        recv_counts: &[usize],
        recv_displs: &[usize],
        dtype: DataType,
        stream: StreamHandle,
    ) -> Result<()> {
        let coll = Collective::AllToAllV { send_counts, send_displs, recv_counts, recv_displs };
        self.op(coll, send, recv, 0, dtype, stream)
    }

    /// `root`'s `count` elements from its `send` into every rank's `recv` (`send` is only
    /// read on the root; in place when the root's `send == recv`).
    pub fn broadcast(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, root: usize, stream: StreamHandle) -> Result<()> {
        self.op(Collective::Broadcast { root }, send, recv, count, dtype, stream)
    }

    /// Every rank's `count` elements into block `rank` of the root's `recv`
    /// (`size * count` elements, only used on the root).
    pub fn gather(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, root: usize, stream: StreamHandle) -> Result<()> {
        self.op(Collective::Gather { root }, send, recv, count, dtype, stream)
    }

    /// Block j of the root's `send` (`size * count` elements) into rank j's `recv`.
    pub fn scatter(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, root: usize, stream: StreamHandle) -> Result<()> {
        self.op(Collective::Scatter { root }, send, recv, count, dtype, stream)
    }

    /// Every rank's `count` elements, reduced element-wise with `op` in rank order (bit for
    /// bit `reduce::reduce_into`), into every rank's `recv`. In place when `send == recv`.
    pub fn all_reduce(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, op: RedOp, stream: StreamHandle) -> Result<()> {
        self.op(Collective::AllReduce { op }, send, recv, count, dtype, stream)
    }

    /// Block j (`recvcount` elements) of every rank's `send` (`size * recvcount` elements),
    /// reduced in rank order, into rank j's `recv`. In place when
    /// `recv == send + rank * recvcount`.
    pub fn reduce_scatter(&self, send: DevPtr, recv: DevPtr, recvcount: usize, dtype: DataType, op: RedOp, stream: StreamHandle) -> Result<()> {
        self.op(Collective::ReduceScatter { op }, send, recv, recvcount, dtype, stream)
    }

    /// Every rank's `count` elements, reduced in rank order, into the root's `recv` (only
    /// used on the root; in place when the root's `send == recv`).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, op: RedOp, root: usize, stream: StreamHandle) -> Result<()> {
        self.op(Collective::Reduce { op, root }, send, recv, count, dtype, stream)
    }
}
