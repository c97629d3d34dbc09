//! Two ranks, every copy-engine collective and reduction: each rank's data, the op enqueued
//! with buffers it allocates, and the result checked against a reference computed on the
//! host (the gated and staged tests' shared bodies).
#![allow(dead_code)]
use super::ops::Op;
use hoccl::device::{pattern_byte, DevPtr, Device, StreamHandle};
use hoccl::{Communicator, DataType, RedOp};
use std::sync::Arc;

/// Ranks in these tests.
pub const N: usize = 2;

/// Byte `i` of rank `r`'s send data in case `case`.
pub fn byte(r: usize, case: u64, i: usize) -> u8 {
    pattern_byte(case * 16 + r as u64, i as u64)
}

/// Rank `r`'s send data in case `case`, `len` bytes: bytes, or small integral f32 values
/// (sums of them are exact) for the reductions.
pub fn data(r: usize, case: u64, len: usize, f32s: bool) -> Vec<u8> {
    if !f32s {
        return (0..len).map(|i| byte(r, case, i)).collect();
    }
    (0..len / 4).flat_map(|i| ((byte(r, case, i) % 16) as f32).to_le_bytes()).collect()
}

pub fn sum_f32(parts: &[Vec<u8>]) -> Vec<u8> {
    let n = parts[0].len() / 4;
    (0..n)
        .flat_map(|i| {
            let s: f32 = parts.iter().map(|p| f32::from_le_bytes(p[4 * i..4 * i + 4].try_into().unwrap())).sum();
            s.to_le_bytes()
        })
        .collect()
}

/// Elements rank `from` sends rank `to` in AlltoAllv with base count `c` (both sides
/// compute them).
pub fn v_count(c: usize, from: usize, to: usize) -> usize {
    c + from + 2 * to
}

/// One op in flight: its buffers and what its receive buffer must hold afterwards (None: the
/// op writes nothing there on this rank).
pub struct Pending {
    pub what: String,
    pub send: DevPtr,
    pub recv: DevPtr,
    pub expect: Option<Vec<u8>>,
}

/// Enqueue `op` on `s` with `c` elements per block (`u8`, or `f32` for reductions), data of
/// case `case`; returns the buffers and the expected result.
pub fn start(comm: &Communicator, dev: &Arc<dyn Device>, op: Op, c: usize, case: u64, s: StreamHandle) -> Pending {
    let r = comm.rank();
    let reduction = matches!(op, Op::AllReduce | Op::ReduceScatter | Op::Reduce);
    let (dt, es) = if reduction { (DataType::F32, 4) } else { (DataType::U8, 1) };
    let (root_b, root_g) = (1 % N, 0);
    let counts = |rank: usize| -> (usize, usize) {
        match op {
            Op::SendRecv | Op::Broadcast | Op::AllReduce | Op::Reduce => (c, c),
            Op::AllGather | Op::Gather => (c, N * c),
            Op::AllToAll | Op::ReduceScatter => (N * c, if op == Op::AllToAll { N * c } else { c }),
            Op::Scatter => (N * c, c),
            Op::AllToAllV => ((0..N).map(|j| v_count(c, rank, j)).sum(), (0..N).map(|j| v_count(c, j, rank)).sum()),
        }
    };
    let (sn, rn) = counts(r);
    let send_of = |rank: usize| data(rank, case, counts(rank).0 * es, reduction);
    let mine = send_of(r);
    let send = dev.alloc((sn * es).max(1)).expect("alloc");
    let recv = dev.alloc((rn * es).max(1)).expect("alloc");
    dev.copy_from_host(send, &mine).expect("fill send");
    // The receive buffer starts as poison, so a missing write shows.
    let poison: Vec<u8> = (0..rn * es).map(|i| pattern_byte(0xdead, i as u64)).collect();
    dev.copy_from_host(recv, &poison).expect("poison recv");
    let block = |rank: usize, j: usize| send_of(rank)[j * c * es..(j + 1) * c * es].to_vec();
    let expect = match op {
        Op::SendRecv => Some(send_of((r + N - 1) % N)),
        Op::AllGather => Some((0..N).flat_map(send_of).collect()),
        Op::AllToAll => Some((0..N).flat_map(|j| block(j, r)).collect()),
        Op::AllToAllV => Some(
            (0..N)
                .flat_map(|j| {
                    let off: usize = (0..r).map(|t| v_count(c, j, t)).sum();
                    send_of(j)[off..off + v_count(c, j, r)].to_vec()
                })
                .collect(),
        ),
        Op::Broadcast => Some(send_of(root_b)),
        Op::Gather => (r == root_g).then(|| (0..N).flat_map(send_of).collect()),
        Op::Scatter => Some(block(root_b, r)),
        Op::AllReduce => Some(sum_f32(&(0..N).map(send_of).collect::<Vec<_>>())),
        Op::ReduceScatter => Some(sum_f32(&(0..N).map(|j| block(j, r)).collect::<Vec<_>>())),
        Op::Reduce => (r == root_g).then(|| sum_f32(&(0..N).map(send_of).collect::<Vec<_>>())),
    };
    let res = match op {
        Op::SendRecv => comm.group(|g| {
            g.send(send, c, dt, (r + 1) % N, s)?;
            g.recv(recv, c, dt, (r + N - 1) % N, s)
        }),
        Op::AllGather => comm.all_gather(send, recv, c, dt, s),
        Op::AllToAll => comm.all_to_all(send, recv, c, dt, s),
        Op::AllToAllV => {
            let sc: Vec<usize> = (0..N).map(|j| v_count(c, r, j)).collect();
            let rc: Vec<usize> = (0..N).map(|j| v_count(c, j, r)).collect();
            let disp = |v: &[usize]| v.iter().scan(0, |a, n| Some(std::mem::replace(a, *a + n))).collect::<Vec<_>>();
            comm.all_to_allv(send, &sc, &disp(&sc), recv, &rc, &disp(&rc), dt, s)
        }
        Op::Broadcast => comm.broadcast(send, recv, c, dt, root_b, s),
        Op::Gather => comm.gather(send, recv, c, dt, root_g, s),
        Op::Scatter => comm.scatter(send, recv, c, dt, root_b, s),
        Op::AllReduce => comm.all_reduce(send, recv, c, dt, RedOp::Sum, s),
        Op::ReduceScatter => comm.reduce_scatter(send, recv, c, dt, RedOp::Sum, s),
        Op::Reduce => comm.reduce(send, recv, c, dt, RedOp::Sum, root_g, s),
    };
    let what = format!("{op:?} count {c} ({} B per block)", c * es);
    res.unwrap_or_else(|e| panic!("rank {r}: {what}: {e}"));
    Pending { what, send, recv, expect }
}

/// Check and free one finished op.
pub fn check(dev: &Arc<dyn Device>, r: usize, p: Pending) {
    if let Some(want) = &p.expect {
        let mut got = vec![0u8; want.len()];
        dev.copy_to_host(&mut got, p.recv).expect("read recv");
        let bad = got.iter().zip(want).filter(|(a, b)| a != b).count();
        assert_eq!(bad, 0, "rank {r}: {}: {bad} of {} bytes wrong", p.what, want.len());
    }
    dev.free(p.send).expect("free");
    dev.free(p.recv).expect("free");
}
