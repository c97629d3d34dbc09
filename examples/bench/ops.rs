//! The operations, their nccl-tests geometry (what "size" means and the bus-bandwidth
//! factor), their buffers, how hoccl is called for each, and which verifiable pattern
//! every block of every buffer holds.
use hoccl::comm::Communicator;
use hoccl::device::{DevPtr, Device, StreamHandle};
use hoccl::{DataType, RedOp};
use std::sync::Arc;

/// The root of the rooted operations (broadcast, gather, scatter, reduce).
pub const ROOT: usize = 0;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OpKind {
    SendRecv,
    AllGather,
    AlltoAll,
    Broadcast,
    Gather,
    Scatter,
    /// The reductions run with `RedOp::Sum`.
    AllReduce,
    ReduceScatter,
    Reduce,
}

/// Every operation the benchmark knows, in its table order.
pub const ALL_OPS: [OpKind; 9] = [
    OpKind::SendRecv,
    OpKind::AllGather,
    OpKind::AlltoAll,
    OpKind::Broadcast,
    OpKind::Gather,
    OpKind::Scatter,
    OpKind::AllReduce,
    OpKind::ReduceScatter,
    OpKind::Reduce,
];

/// The operator the reductions are benchmarked with.
pub const RED_OP: RedOp = RedOp::Sum;

impl OpKind {
    pub fn name(self) -> &'static str {
        match self {
            OpKind::SendRecv => "sendrecv",
            OpKind::AllGather => "allgather",
            OpKind::AlltoAll => "alltoall",
            OpKind::Broadcast => "broadcast",
            OpKind::Gather => "gather",
            OpKind::Scatter => "scatter",
            OpKind::AllReduce => "allreduce",
            OpKind::ReduceScatter => "reducescatter",
            OpKind::Reduce => "reduce",
        }
    }
    /// Whether the result is a reduction of the inputs (checked against `reduce_into`, not
    /// against input patterns), and the op launches its reduce step (a kernel on CUDA).
    pub fn is_reduction(self) -> bool {
        matches!(self, OpKind::AllReduce | OpKind::ReduceScatter | OpKind::Reduce)
    }
    pub fn from_name(s: &str) -> Option<OpKind> {
        ALL_OPS.into_iter().find(|o| o.name() == s.to_ascii_lowercase())
    }
    /// busbw / algbw, as nccl-tests defines it.
    pub fn bus_factor(self, n: usize) -> f64 {
        match self {
            OpKind::SendRecv | OpKind::Broadcast | OpKind::Reduce => 1.0,
            OpKind::AllReduce => 2.0 * (n as f64 - 1.0) / n as f64,
            _ => (n as f64 - 1.0) / n as f64,
        }
    }
}

/// One point's shape. `bytes` is nccl-tests' "size": AllGather/Gather/Scatter the total over
/// ranks, AlltoAll and ReduceScatter one rank's send total, sendrecv/broadcast/allreduce/
/// reduce the message.
#[derive(Clone, Copy, Debug)]
pub struct Geom {
    pub op: OpKind,
    /// The count argument of the call (per rank or per peer where the API says so).
    pub count: usize,
    /// Elements in `bytes` (the "count" column of nccl-tests).
    pub total_count: usize,
    pub bytes: usize,
    pub send_len: usize,
    pub recv_len: usize,
    /// Bytes of one per-rank block (for the blocked ops; = bytes otherwise).
    pub block: usize,
    pub es: usize,
}

/// The geometry of `op` at target size `size` for `rank` of `n`; None when the size holds
/// less than one element per block. Sizes are rounded down to whole blocks, as nccl-tests does.
pub fn geom(op: OpKind, size: usize, n: usize, es: usize, rank: usize) -> Option<Geom> {
    let root = rank == ROOT;
    let whole = size / es;
    let per = size / (n * es);
    let g = |count: usize, bytes: usize, send_len: usize, recv_len: usize, block: usize| Geom {
        op,
        count,
        total_count: bytes / es,
        bytes,
        send_len,
        recv_len,
        block,
        es,
    };
    let b = per * es;
    match op {
        OpKind::SendRecv if whole > 0 => Some(g(whole, whole * es, whole * es, whole * es, whole * es)),
        OpKind::Broadcast if whole > 0 => Some(g(whole, whole * es, if root { whole * es } else { 0 }, whole * es, whole * es)),
        OpKind::AllGather if per > 0 => Some(g(per, b * n, b, b * n, b)),
        OpKind::AlltoAll if per > 0 => Some(g(per, b * n, b * n, b * n, b)),
        OpKind::Gather if per > 0 => Some(g(per, b * n, b, if root { b * n } else { 0 }, b)),
        OpKind::Scatter if per > 0 => Some(g(per, b * n, if root { b * n } else { 0 }, b, b)),
        OpKind::AllReduce if whole > 0 => Some(g(whole, whole * es, whole * es, whole * es, whole * es)),
        OpKind::ReduceScatter if per > 0 => Some(g(per, b * n, b * n, b, b)),
        OpKind::Reduce if whole > 0 => Some(g(whole, whole * es, whole * es, if root { whole * es } else { 0 }, whole * es)),
        _ => None,
    }
}

/// A rank's send and receive buffers for one op, sized for its largest point and reused by
/// every smaller one (so hoccl's per-allocation IPC mappings are made once). A length of 0
/// means the rank needs no such buffer (null pointer; the APIs ignore it there).
pub struct Bufs {
    dev: Arc<dyn Device>,
    pub send: DevPtr,
    pub recv: DevPtr,
    pub send_len: usize,
    pub recv_len: usize,
}

impl Bufs {
    pub fn new(dev: &Arc<dyn Device>, send_len: usize, recv_len: usize) -> Result<Bufs, String> {
        let mut b = Bufs { dev: dev.clone(), send: DevPtr::NULL, recv: DevPtr::NULL, send_len, recv_len };
        if send_len > 0 {
            b.send = dev.alloc(send_len).map_err(|e| format!("allocating {send_len} send bytes: {e}"))?;
        }
        if recv_len > 0 {
            b.recv = dev.alloc(recv_len).map_err(|e| format!("allocating {recv_len} receive bytes: {e}"))?;
        }
        Ok(b)
    }
}

impl Drop for Bufs {
    fn drop(&mut self) {
        for p in [self.send, self.recv] {
            if !p.is_null() {
                if let Err(e) = self.dev.free(p) {
                    eprintln!("bench: freeing a buffer failed: {e}");
                }
            }
        }
    }
}

/// Enqueue one `op` through hoccl on `s`.
pub fn issue_hoccl(c: &Communicator, g: &Geom, b: &Bufs, dt: DataType, s: StreamHandle) -> hoccl::Result<()> {
    let (r, n) = (c.rank(), c.size());
    match g.op {
        OpKind::SendRecv => c.group(|c| {
            c.send(b.send, g.count, dt, (r + 1) % n, s)?;
            c.recv(b.recv, g.count, dt, (r + n - 1) % n, s)
        }),
        OpKind::AllGather => c.all_gather(b.send, b.recv, g.count, dt, s),
        OpKind::AlltoAll => c.all_to_all(b.send, b.recv, g.count, dt, s),
        OpKind::Broadcast => c.broadcast(b.send, b.recv, g.count, dt, ROOT, s),
        OpKind::Gather => c.gather(b.send, b.recv, g.count, dt, ROOT, s),
        OpKind::Scatter => c.scatter(b.send, b.recv, g.count, dt, ROOT, s),
        OpKind::AllReduce => c.all_reduce(b.send, b.recv, g.count, dt, RED_OP, s),
        OpKind::ReduceScatter => c.reduce_scatter(b.send, b.recv, g.count, dt, RED_OP, s),
        OpKind::Reduce => c.reduce(b.send, b.recv, g.count, dt, RED_OP, ROOT, s),
    }
}

/// A run of bytes holding the verifiable pattern of `seed` from index 0.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Block {
    pub off: usize,
    pub len: usize,
    pub seed: u64,
}

/// The seed of the block that `rank` contributes as block `block` in check number `tag`.
pub fn seed_of(tag: u64, rank: usize, block: usize) -> u64 {
    tag.wrapping_mul(1_000_003) ^ ((rank as u64) << 32) ^ (block as u64).wrapping_mul(7919) ^ 0x5EED
}

/// What `rank` writes into its send buffer before the checked call.
pub fn input_blocks(g: &Geom, tag: u64, rank: usize, n: usize) -> Vec<Block> {
    let blk = |j: usize, seed: u64| Block { off: j * g.block, len: g.block, seed };
    match g.op {
        OpKind::SendRecv | OpKind::AllGather | OpKind::Gather | OpKind::AllReduce | OpKind::Reduce => vec![blk(0, seed_of(tag, rank, 0))],
        OpKind::AlltoAll | OpKind::ReduceScatter => (0..n).map(|j| blk(j, seed_of(tag, rank, j))).collect(),
        OpKind::Broadcast if rank == ROOT => vec![blk(0, seed_of(tag, ROOT, 0))],
        OpKind::Scatter if rank == ROOT => (0..n).map(|j| blk(j, seed_of(tag, ROOT, j))).collect(),
        OpKind::Broadcast | OpKind::Scatter => Vec::new(),
    }
}

/// What `rank`'s receive buffer must hold afterwards, derived from the op's definition
/// (not from what any rank sent). The reductions' results are [`reduced_inputs`] instead.
pub fn expected_blocks(g: &Geom, tag: u64, rank: usize, n: usize) -> Vec<Block> {
    let blk = |j: usize, seed: u64| Block { off: j * g.block, len: g.block, seed };
    match g.op {
        OpKind::SendRecv => vec![blk(0, seed_of(tag, (rank + n - 1) % n, 0))],
        OpKind::AllGather => (0..n).map(|p| blk(p, seed_of(tag, p, 0))).collect(),
        OpKind::AlltoAll => (0..n).map(|p| blk(p, seed_of(tag, p, rank))).collect(),
        OpKind::Broadcast => vec![blk(0, seed_of(tag, ROOT, 0))],
        OpKind::Gather if rank == ROOT => (0..n).map(|p| blk(p, seed_of(tag, p, 0))).collect(),
        OpKind::Gather => Vec::new(),
        OpKind::Scatter => vec![blk(0, seed_of(tag, ROOT, rank))],
        OpKind::AllReduce | OpKind::ReduceScatter | OpKind::Reduce => Vec::new(),
    }
}

/// For a reduction: the bytes of `rank`'s receive buffer that must hold the fold, in rank
/// order, of one input block per rank, as (length, the inputs' seeds by rank); each input
/// block holds the pattern of its seed from index 0. None for the other ops and for Reduce
/// off the root.
pub fn reduced_inputs(g: &Geom, tag: u64, rank: usize, n: usize) -> Option<(usize, Vec<u64>)> {
    match g.op {
        OpKind::AllReduce => Some((g.bytes, (0..n).map(|p| seed_of(tag, p, 0)).collect())),
        OpKind::Reduce if rank == ROOT => Some((g.bytes, (0..n).map(|p| seed_of(tag, p, 0)).collect())),
        OpKind::ReduceScatter => Some((g.block, (0..n).map(|p| seed_of(tag, p, rank)).collect())),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    #[test]
    fn geometry_matches_nccl_tests() {
        let g = geom(OpKind::AllGather, 2 << 20, 3, 2, 1).unwrap();
        assert_eq!(g.count, (2 << 20) / 6);
        assert_eq!(g.bytes, g.count * 6);
        assert_eq!(g.recv_len, g.bytes);
        let a = geom(OpKind::AlltoAll, 1 << 20, 4, 2, 0).unwrap();
        assert_eq!((a.send_len, a.block), (1 << 20, 1 << 18));
        assert!(geom(OpKind::Scatter, 4, 4, 2, 0).is_none());
        let r = geom(OpKind::ReduceScatter, 1 << 20, 4, 2, 1).unwrap();
        assert_eq!((r.send_len, r.recv_len, r.count), (1 << 20, 1 << 18, 1 << 17));
        assert_eq!(OpKind::AllReduce.bus_factor(4), 1.5);
        // Every expected block of every rank is some rank's input block; every reduced
        // input is an input block.
        for op in ALL_OPS {
            if op.is_reduction() {
                let n = 3;
                let inputs: Vec<u64> = (0..n).flat_map(|r| input_blocks(&geom(op, 6000, n, 2, r).unwrap(), 7, r, n)).map(|b| b.seed).collect();
                for r in 0..n {
                    if let Some((_, seeds)) = reduced_inputs(&geom(op, 6000, n, 2, r).unwrap(), 7, r, n) {
                        assert!(seeds.iter().all(|s| inputs.contains(s)), "{op:?} rank {r}");
                    }
                }
                continue;
            }
            let n = 3;
            let inputs: Vec<u64> = (0..n).flat_map(|r| input_blocks(&geom(op, 6000, n, 2, r).unwrap(), 7, r, n)).map(|b| b.seed).collect();
            for r in 0..n {
                for b in expected_blocks(&geom(op, 6000, n, 2, r).unwrap(), 7, r, n) {
                    assert!(inputs.contains(&b.seed), "{op:?} rank {r}");
                }
            }
        }
    }
}
