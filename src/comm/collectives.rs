//! Every collective as the byte ranges this rank sends and receives. All of them are
//! stream-ordered and asynchronous; buffers are device pointers (any alignment), counts are
//! in elements of `dtype`. Each user buffer is validated once per call.
use super::Communicator;
use crate::device::{DevPtr, StreamHandle};
use crate::error::{Error, Result};
use crate::types::DataType;

fn overlaps(a: DevPtr, alen: usize, b: DevPtr, blen: usize) -> bool {
    alen > 0 && blen > 0 && a.0 < b.0 + blen as u64 && b.0 < a.0 + alen as u64
}

impl Communicator {
    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size {
            return Err(Error::invalid_arg(op, format!("root {root} out of range (size {})", self.size)));
        }
        Ok(())
    }

    fn total(&self, op: &'static str, bytes: usize) -> Result<usize> {
        bytes.checked_mul(self.size).filter(|t| *t <= isize::MAX as usize).ok_or_else(|| Error::invalid_arg(op, "count times ranks overflows"))
    }

    /// Send `count` elements to `peer` (match with its `recv`; use a group for pairs).
    pub fn send(&self, buf: DevPtr, count: usize, dtype: DataType, peer: usize, stream: StreamHandle) -> Result<()> {
        const OP: &str = "send";
        self.check_peer(OP, peer)?;
        let len = Self::bytes(OP, count, dtype)?;
        let x = self.region(OP, "send", buf, len)?.whole(peer)?;
        self.submit(OP, stream, vec![x], vec![])
    }

    /// Receive `count` elements from `peer`.
    pub fn recv(&self, buf: DevPtr, count: usize, dtype: DataType, peer: usize, stream: StreamHandle) -> Result<()> {
        const OP: &str = "recv";
        self.check_peer(OP, peer)?;
        let len = Self::bytes(OP, count, dtype)?;
        let x = self.region(OP, "receive", buf, len)?.whole(peer)?;
        self.submit(OP, stream, vec![], vec![x])
    }

    /// Every rank's `count` elements, concatenated by rank into every rank's `recv`
    /// (`size * count` elements). In place when `send == recv + rank * count`.
    pub fn all_gather(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, stream: StreamHandle) -> Result<()> {
        const OP: &str = "all_gather";
        let len = Self::bytes(OP, count, dtype)?;
        let total = self.total(OP, len)?;
        let r = self.region(OP, "receive", recv, total)?;
        let own = recv.add(self.rank * len);
        let s = if send == own { r.sub(self.rank * len, len)? } else { self.region(OP, "send", send, len)? };
        if send != own && overlaps(send, len, recv, total) {
            return Err(Error::invalid_arg(OP, "send buffer overlaps the receive buffer but is not this rank's slot"));
        }
        let sends = (0..self.size).map(|p| s.whole(p)).collect::<Result<Vec<_>>>()?;
        let recvs = (0..self.size).map(|p| r.part(p * len, len, p)).collect::<Result<Vec<_>>>()?;
        self.submit(OP, stream, sends, recvs)
    }

    /// Block j of `send` (`count` elements) goes to rank j, which stores it as block
    /// `rank` of its `recv`. Buffers must not overlap (in place is not supported).
    pub fn all_to_all(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, stream: StreamHandle) -> Result<()> {
        const OP: &str = "all_to_all";
        let len = Self::bytes(OP, count, dtype)?;
        let total = self.total(OP, len)?;
        if overlaps(send, total, recv, total) && self.size > 1 {
            return Err(Error::invalid_arg(OP, "send and receive buffers overlap (in-place AlltoAll is not supported)"));
        }
        let s = self.region(OP, "send", send, total)?;
        let r = self.region(OP, "receive", recv, total)?;
        let sends = (0..self.size).map(|p| s.part(p * len, len, p)).collect::<Result<Vec<_>>>()?;
        let recvs = (0..self.size).map(|p| r.part(p * len, len, p)).collect::<Result<Vec<_>>>()?;
        self.submit(OP, stream, sends, recvs)
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
        const OP: &str = "all_to_allv";
        for (name, v) in [("send_counts", send_counts), ("send_displs", send_displs), ("recv_counts", recv_counts), ("recv_displs", recv_displs)] {
            if v.len() != self.size {
                return Err(Error::invalid_arg(OP, format!("{name} has {} entries, expected {}", v.len(), self.size)));
            }
        }
        // Extent of each buffer in bytes: the furthest end of any block.
        let extent = |counts: &[usize], displs: &[usize]| -> Result<usize> {
            counts.iter().zip(displs).try_fold(0usize, |m, (c, d)| {
                let end = c.checked_add(*d).ok_or_else(|| Error::invalid_arg(OP, "count + displacement overflows"))?;
                Ok(if *c == 0 { m } else { m.max(Self::bytes(OP, end, dtype)?) })
            })
        };
        let s = self.region(OP, "send", send, extent(send_counts, send_displs)?)?;
        let r = self.region(OP, "receive", recv, extent(recv_counts, recv_displs)?)?;
        let es = dtype.size();
        let mut sends = Vec::with_capacity(self.size);
        let mut recvs = Vec::with_capacity(self.size);
        for p in 0..self.size {
            sends.push(s.part(send_displs[p] * es, Self::bytes(OP, send_counts[p], dtype)?, p)?);
            recvs.push(r.part(recv_displs[p] * es, Self::bytes(OP, recv_counts[p], dtype)?, p)?);
        }
        for x in &sends {
            if recvs.iter().any(|y| overlaps(x.ptr, x.len, y.ptr, y.len)) {
                return Err(Error::invalid_arg(OP, "a send range overlaps a receive range"));
            }
        }
        self.submit(OP, stream, sends, recvs)
    }

    /// `root`'s `count` elements from its `send` into every rank's `recv` (`send` is only
    /// read on the root; in place when the root's `send == recv`).
    pub fn broadcast(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, root: usize, stream: StreamHandle) -> Result<()> {
        const OP: &str = "broadcast";
        self.check_root(OP, root)?;
        let len = Self::bytes(OP, count, dtype)?;
        let r = self.region(OP, "receive", recv, len)?;
        let mut sends = Vec::new();
        if self.rank == root {
            if send != recv && overlaps(send, len, recv, len) {
                return Err(Error::invalid_arg(OP, "send and receive buffers partially overlap"));
            }
            let s = if send == recv { r.sub(0, len)? } else { self.region(OP, "send", send, len)? };
            sends = (0..self.size).map(|p| s.whole(p)).collect::<Result<Vec<_>>>()?;
        }
        self.submit(OP, stream, sends, vec![r.whole(root)?])
    }

    /// Every rank's `count` elements into block `rank` of the root's `recv`
    /// (`size * count` elements, only used on the root).
    pub fn gather(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, root: usize, stream: StreamHandle) -> Result<()> {
        const OP: &str = "gather";
        self.check_root(OP, root)?;
        let len = Self::bytes(OP, count, dtype)?;
        let mut recvs = Vec::new();
        let s;
        if self.rank == root {
            let total = self.total(OP, len)?;
            let r = self.region(OP, "receive", recv, total)?;
            let own = recv.add(root * len);
            if send != own && overlaps(send, len, recv, total) {
                return Err(Error::invalid_arg(OP, "send buffer overlaps the receive buffer but is not the root's slot"));
            }
            s = if send == own { r.sub(root * len, len)? } else { self.region(OP, "send", send, len)? };
            recvs = (0..self.size).map(|p| r.part(p * len, len, p)).collect::<Result<Vec<_>>>()?;
        } else {
            s = self.region(OP, "send", send, len)?;
        }
        self.submit(OP, stream, vec![s.whole(root)?], recvs)
    }

    /// Block j of the root's `send` (`size * count` elements) into rank j's `recv`.
    pub fn scatter(&self, send: DevPtr, recv: DevPtr, count: usize, dtype: DataType, root: usize, stream: StreamHandle) -> Result<()> {
        const OP: &str = "scatter";
        self.check_root(OP, root)?;
        let len = Self::bytes(OP, count, dtype)?;
        let mut sends = Vec::new();
        let r;
        if self.rank == root {
            let total = self.total(OP, len)?;
            let s = self.region(OP, "send", send, total)?;
            let own = send.add(root * len);
            if recv != own && overlaps(recv, len, send, total) {
                return Err(Error::invalid_arg(OP, "receive buffer overlaps the send buffer but is not the root's slot"));
            }
            r = if recv == own { s.sub(root * len, len)? } else { self.region(OP, "receive", recv, len)? };
            sends = (0..self.size).map(|p| s.part(p * len, len, p)).collect::<Result<Vec<_>>>()?;
        } else {
            r = self.region(OP, "receive", recv, len)?;
        }
        self.submit(OP, stream, sends, vec![r.whole(root)?])
    }
}
