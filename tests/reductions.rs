//! AllReduce, ReduceScatter and Reduce against a reference computed here, independently of
//! the library's execution: `reduce::reduce_into` over every rank's input in rank order,
//! compared bit for bit. Every data type × every operator, random sizes (0, 1, odd, around
//! the scratch's chunk boundary, larger), random buffer offsets and roots, 1–8 ranks, in
//! place and out of place; guard bands and untouched inputs checked. Inputs are random
//! bytes, so the floating-point types meet NaNs, infinities, subnormals and overflow too.
//! The same bodies run on the host backend here and on CUDA with `--ignored` on a GPU
//! machine.
mod common;
use common::*;

use hoccl::device::pattern_byte;
use hoccl::reduce::{reduce_into, Scalar};
use hoccl::config::EngineChoice;
use hoccl::{Config, DataType, RedOp};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter,
    Reduce,
}

const KINDS: [Kind; 3] = [Kind::AllReduce, Kind::ReduceScatter, Kind::Reduce];

/// A small scratch, so that moderate counts already run in several chunks.
const SCRATCH: usize = 4096;

fn small_scratch() -> Config {
    Config { reduce_scratch: SCRATCH, ..test_config() }
}

/// Elements per chunk for `n` ranks (as the library cuts them: `SCRATCH / n` rounded down
/// to 256 bytes, or to 8 below that).
fn chunk_elems(n: usize, dtype: DataType) -> usize {
    let s = SCRATCH / n;
    let slot = if s >= 256 { s & !255 } else { (s & !7).max(8) };
    slot / dtype.size()
}

/// Rank `p`'s input in iteration `it`: `len` bytes of the pattern of `seed_of(it, p, 1)`,
/// starting at pattern index `off` (what `Buf::new` puts at `off` bytes into its allocation).
fn input(it: u64, p: usize, off: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| pattern_byte(seed_of(it, p, 1), (off + i) as u64)).collect()
}

/// Every rank's send offset, known to all ranks.
fn send_off(it: u64, p: usize) -> usize {
    Rng(it * 7919 + p as u64).below(64) as usize
}

/// Bytes of `b`'s whole allocation (`got`) that differ from what `Buf::new` wrote.
fn changed(b: &Buf, got: &[u8]) -> usize {
    (0..b.total).filter(|i| got[*i] != pattern_byte(b.poison, *i as u64)).count()
}

fn reference(dtype: DataType, op: RedOp, inputs: &[Vec<u8>], at: usize, len: usize) -> Vec<u8> {
    let srcs: Vec<&[u8]> = inputs.iter().map(|v| &v[at..at + len]).collect();
    let mut out = vec![0u8; len];
    reduce_into(dtype, op, &mut out, &srcs).unwrap();
    out
}

/// One call of `kind` with every rank's buffers, checked against the reference.
#[allow(clippy::too_many_arguments)]
fn check_one(c: &hoccl::Communicator, s: hoccl::device::StreamHandle, it: u64, kind: Kind, dtype: DataType, op: RedOp, count: usize, in_place: bool, root: usize) {
    check_one_as(c, s, it, kind, dtype, op, op, count, in_place, root)
}

/// `check_one` with the operator the reference applies given apart (a PreMulSum whose
/// scalar the device reads is checked against the same operator with the scalar's value).
#[allow(clippy::too_many_arguments)]
fn check_one_as(c: &hoccl::Communicator, s: hoccl::device::StreamHandle, it: u64, kind: Kind, dtype: DataType, op: RedOp, ref_op: RedOp, count: usize, in_place: bool, root: usize) {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    let es = dtype.size();
    let len = count * es;
    let send_len = if kind == Kind::ReduceScatter { len * n } else { len };
    let inputs: Vec<Vec<u8>> = (0..n).map(|p| input(it, p, send_off(it, p), send_len)).collect();
    let what = format!("it {it} {kind:?} {} {} count {count} n {n} in_place {in_place} root {root} rank {r}", dtype.name(), op.name());
    quiesce(c);
    let send = Buf::new(&dev, send_len, send_off(it, r), seed_of(it, r, 1));
    let recv_off = Rng(it * 31 + r as u64).below(64) as usize;
    let recv = (!in_place).then(|| Buf::new(&dev, len, recv_off, seed_of(it, r, 2)));
    allocated(c);
    let recv_ptr = match (&recv, kind) {
        (Some(b), _) => b.ptr,
        (None, Kind::ReduceScatter) => send.ptr.add(r * len),
        (None, _) => send.ptr,
    };
    match kind {
        Kind::AllReduce => c.all_reduce(send.ptr, recv_ptr, count, dtype, op, s),
        Kind::ReduceScatter => c.reduce_scatter(send.ptr, recv_ptr, count, dtype, op, s),
        Kind::Reduce => c.reduce(send.ptr, recv_ptr, count, dtype, op, root, s),
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    sync(&dev, s);
    // A synchronous copy to pageable memory holds a driver lock the other ranks' proxies
    // need while their part of the call is pending (ranks share one CUDA context): read the
    // results only once every rank is idle.
    quiesce(c);
    let got_send = send.read_all();
    let expect = match kind {
        Kind::AllReduce => Some(reference(dtype, ref_op, &inputs, 0, len)),
        Kind::ReduceScatter => Some(reference(dtype, ref_op, &inputs, r * len, len)),
        Kind::Reduce => (r == root).then(|| reference(dtype, ref_op, &inputs, 0, len)),
    };
    match (&recv, &expect) {
        (Some(b), Some(e)) => {
            let got = b.read_all();
            let bad = (0..len).filter(|i| got[b.off + i] != e[*i]).count();
            assert_eq!(bad, 0, "{what}: {bad} wrong bytes");
            assert_eq!(b.guard_damage(&got), 0, "{what}: recv guard bands");
        }
        (Some(b), None) => {
            assert_eq!(changed(b, &b.read_all()), 0, "{what}: non-root recv untouched");
        }
        (None, Some(e)) => {
            let at = send.off + if kind == Kind::ReduceScatter { r * len } else { 0 };
            let bad = (0..len).filter(|i| got_send[at + i] != e[*i]).count();
            assert_eq!(bad, 0, "{what}: {bad} wrong bytes (in place)");
        }
        (None, None) => {}
    }
    if recv.is_some() || expect.is_none() {
        // Out of place (or a non-root): the input is never written.
        assert_eq!(changed(&send, &got_send), 0, "{what}: send buffer modified");
    } else if kind == Kind::ReduceScatter {
        // In place: only this rank's block changed.
        let own = send.off + r * len..send.off + (r + 1) * len;
        let bad = (send.off..send.off + send_len).filter(|i| !own.contains(i) && got_send[*i] != pattern_byte(seed_of(it, r, 1), *i as u64)).count();
        assert_eq!(bad, 0, "{what}: other blocks of the in-place send buffer modified");
    }
    assert_eq!(send.guard_damage(&got_send), 0, "{what}: send guard bands");
}

/// Every kind × data type × operator for `n` ranks, with counts drawn from 0, 1, odd values
/// and the chunk boundary (one chunk's worth for the shard or block, ±1).
fn matrix(b: Backend, n: usize) {
    run_ranks(b, n, small_scratch(), move |c| {
        let n = c.size();
        c.reserve_reduce_scratch().unwrap();
        let s = new_stream(&c.device().clone());
        let mut rng = Rng(0xfeed + n as u64);
        let mut it = 1000 * n as u64;
        for kind in KINDS {
            for dtype in DataType::ALL {
                for op in RedOp::ALL {
                    it += 1;
                    let cap = chunk_elems(n, dtype);
                    // AllReduce chunks the shard (about count / n), the others the block.
                    let per = if kind == Kind::AllReduce { n } else { 1 };
                    let count = match rng.below(7) {
                        0 => 0,
                        1 => 1,
                        2 => cap * per - 1,
                        3 => cap * per + 1,
                        4 => 2 * cap * per + 3,
                        _ => rng.below(900) as usize | 1,
                    };
                    let in_place = rng.below(2) == 0;
                    let root = rng.below(n as u64) as usize;
                    check_one(c, s, it, kind, dtype, op, count, in_place, root);
                }
            }
        }
    });
}

fn matrix_1(b: Backend) {
    matrix(b, 1)
}
fn matrix_2(b: Backend) {
    matrix(b, 2)
}
fn matrix_3(b: Backend) {
    matrix(b, 3)
}
fn matrix_4(b: Backend) {
    matrix(b, 4)
}
fn matrix_5(b: Backend) {
    matrix(b, 5)
}
fn matrix_8(b: Backend) {
    matrix(b, 8)
}

/// Random shapes on random rank counts (6 and 7 included), with the default scratch and
/// larger counts (one chunk), and with the small scratch (many chunks).
fn random_shapes(b: Backend) {
    for (n, cfg) in [(6, test_config()), (7, small_scratch()), (2, test_config())] {
        run_ranks(b, n, cfg, move |c| {
            let n = c.size();
            c.reserve_reduce_scratch().unwrap();
            let s = new_stream(&c.device().clone());
            let mut rng = Rng(0xabc + n as u64);
            for i in 0..24u64 {
                let kind = KINDS[rng.below(3) as usize];
                let dtype = DataType::ALL[rng.below(12) as usize];
                let op = RedOp::ALL[rng.below(5) as usize];
                let count = match rng.below(4) {
                    0 => rng.below(n as u64) as usize, // fewer elements than ranks
                    1 => rng.below(200_000) as usize,
                    _ => rng.below(5000) as usize,
                };
                let in_place = rng.below(2) == 0;
                let root = rng.below(n as u64) as usize;
                check_one(c, s, 50_000 + n as u64 * 100 + i, kind, dtype, op, count, in_place, root);
            }
        });
    }
}

/// Reductions and copy-engine collectives back to back on two streams with no host
/// synchronisation in between: the two streams share the scratch, so an exchange on one
/// must wait for the other's reduce step. Each op's buffers are its own, checked at the end.
fn mixed_two_streams(b: Backend) {
    run_ranks(b, 4, small_scratch(), |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        c.reserve_reduce_scratch().unwrap();
        let streams = [new_stream(&dev), new_stream(&dev)];
        let dtype = DataType::F32;
        let count = 1500; // several chunks of the small scratch
        let len = count * 4;
        let rounds = 6u64;
        let mut bufs = Vec::new();
        for k in 0..rounds {
            // AllReduce in, out; ReduceScatter in (n blocks), out; AllGather in, out.
            bufs.push((
                Buf::new(&dev, len, 3, seed_of(k, r, 1)),
                Buf::new(&dev, len, 5, 9),
                Buf::new(&dev, len * n, 1, seed_of(k, r, 3)),
                Buf::new(&dev, len, 0, 9),
                Buf::new(&dev, 100, 0, seed_of(k, r, 5)),
                Buf::new(&dev, 100 * n, 0, 9),
            ));
        }
        allocated(c);
        for (k, b) in bufs.iter().enumerate() {
            let (s1, s2) = (streams[k % 2], streams[(k + 1) % 2]);
            c.all_reduce(b.0.ptr, b.1.ptr, count, dtype, RedOp::Sum, s1).unwrap();
            c.all_gather(b.4.ptr, b.5.ptr, 100, DataType::U8, s2).unwrap();
            c.reduce_scatter(b.2.ptr, b.3.ptr, count, dtype, RedOp::Max, s2).unwrap();
            c.reduce(b.0.ptr, b.1.ptr, 0, dtype, RedOp::Sum, 0, s1).unwrap(); // count 0: nothing
        }
        sync(&dev, streams[0]);
        sync(&dev, streams[1]);
        quiesce(c);
        for (k, b) in bufs.iter().enumerate() {
            let k = k as u64;
            let ins: Vec<Vec<u8>> = (0..n).map(|p| (0..len).map(|i| pattern_byte(seed_of(k, p, 1), 3 + i as u64)).collect()).collect();
            let e = reference(dtype, RedOp::Sum, &ins, 0, len);
            let got = b.1.read_all();
            assert_eq!(&got[5..5 + len], &e[..], "round {k}: all_reduce");
            let ins: Vec<Vec<u8>> = (0..n).map(|p| (0..len * n).map(|i| pattern_byte(seed_of(k, p, 3), 1 + i as u64)).collect()).collect();
            let e = reference(dtype, RedOp::Max, &ins, r * len, len);
            assert_eq!(&b.3.read_all()[..len], &e[..], "round {k}: reduce_scatter");
            let got = b.5.read_all();
            for p in 0..n {
                assert_eq!(wrong(&got, p * 100, 100, seed_of(k, p, 5)), 0, "round {k}: all_gather from {p}");
            }
        }
    });
}

/// Stream order without host synchronisation: the input is written on the stream before
/// the call and the result copied out after it; an in-place AllReduce repeated feeds on its
/// own output.
fn stream_ordering(b: Backend) {
    run_ranks(b, 3, small_scratch(), |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        c.reserve_reduce_scratch().unwrap();
        let count = 2001;
        let buf = Buf::new(&dev, count, 1, 1);
        let out = Buf::new(&dev, count * 5, 0, 2);
        let s = new_stream(&dev);
        allocated(c);
        dev.fill_pattern_async(s, buf.ptr, count, seed_of(7, r, 0)).unwrap();
        for k in 0..5 {
            c.all_reduce(buf.ptr, buf.ptr, count, DataType::U8, RedOp::Sum, s).unwrap();
            dev.memcpy_async(s, out.ptr.add(k * count), buf.ptr, count).unwrap();
        }
        sync(&dev, s);
        quiesce(c);
        let got = out.read_all();
        let mut x: Vec<u8> = vec![0; count];
        for p in 0..n {
            for (i, v) in x.iter_mut().enumerate() {
                *v = v.wrapping_add(pattern_byte(seed_of(7, p, 0), i as u64));
            }
        }
        for k in 0..5 {
            assert_eq!(&got[k * count..(k + 1) * count], &x[..], "round {k}");
            x.iter_mut().for_each(|v| *v = v.wrapping_mul(n as u8));
        }
    });
}

/// Reductions inside groups, beside a ring of sends and receives and an AllGather.
fn in_groups(b: Backend) {
    run_ranks(b, 3, small_scratch(), |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        c.reserve_reduce_scratch().unwrap();
        let s = new_stream(&dev);
        let count = 999;
        let ar = Buf::new(&dev, count * 2, 0, seed_of(1, r, 1));
        let rs = Buf::new(&dev, count * 2 * n, 0, seed_of(1, r, 2));
        let rs_out = Buf::new(&dev, count * 2, 0, 3);
        let ring_out = Buf::new(&dev, 500, 0, 4);
        let ring_in = Buf::new(&dev, 500, 0, seed_of(1, r, 5));
        allocated(c);
        c.group(|c| {
            c.all_reduce(ar.ptr, ar.ptr, count, DataType::BF16, RedOp::Sum, s)?;
            c.send(ring_in.ptr, 500, DataType::U8, (r + 1) % n, s)?;
            c.reduce_scatter(rs.ptr, rs_out.ptr, count, DataType::F16, RedOp::Min, s)?;
            c.recv(ring_out.ptr, 500, DataType::U8, (r + n - 1) % n, s)
        })
        .unwrap();
        sync(&dev, s);
        quiesce(c);
        let ins: Vec<Vec<u8>> = (0..n).map(|p| input(1, p, 0, count * 2)).collect();
        assert_eq!(&ar.read_all()[..count * 2], &reference(DataType::BF16, RedOp::Sum, &ins, 0, count * 2)[..]);
        let ins: Vec<Vec<u8>> = (0..n).map(|p| (0..count * 2 * n).map(|i| pattern_byte(seed_of(1, p, 2), i as u64)).collect()).collect();
        assert_eq!(&rs_out.read_all()[..count * 2], &reference(DataType::F16, RedOp::Min, &ins, r * count * 2, count * 2)[..]);
        assert_eq!(wrong(&ring_out.read_all(), 0, 500, seed_of(1, (r + n - 1) % n, 5)), 0);
    });
}

/// Bad arguments are errors at the call, on every rank alike, and leave the communicator
/// usable.
fn invalid_arguments(b: Backend) {
    run_ranks(b, 2, small_scratch(), |c| {
        let (r, dev) = (c.rank(), c.device().clone());
        c.reserve_reduce_scratch().unwrap();
        let s = new_stream(&dev);
        let buf = Buf::new(&dev, 4096, 0, 1);
        allocated(c);
        let code = |res: hoccl::Result<()>| res.unwrap_err().code();
        use hoccl::ErrorCode::InvalidArgument;
        assert_eq!(code(c.reduce(buf.ptr, buf.ptr, 8, DataType::F32, RedOp::Sum, 2, s)), InvalidArgument);
        // Partial overlaps.
        assert_eq!(code(c.all_reduce(buf.ptr, buf.ptr.add(4), 8, DataType::F32, RedOp::Sum, s)), InvalidArgument);
        assert_eq!(code(c.reduce_scatter(buf.ptr, buf.ptr.add(r * 32 + 4), 8, DataType::F32, RedOp::Sum, s)), InvalidArgument);
        if r == 0 {
            assert_eq!(code(c.reduce(buf.ptr, buf.ptr.add(8), 8, DataType::F32, RedOp::Sum, 0, s)), InvalidArgument);
        }
        // Too short.
        assert_eq!(code(c.all_reduce(buf.ptr, buf.ptr, 2000, DataType::F32, RedOp::Sum, s)), InvalidArgument);
        assert_eq!(code(c.reduce_scatter(buf.ptr, buf.ptr.add(4000), 600, DataType::U8, RedOp::Sum, s)), InvalidArgument);
        // A group with two streams.
        let s2 = new_stream(&dev);
        c.group_start().unwrap();
        c.all_reduce(buf.ptr, buf.ptr, 8, DataType::F32, RedOp::Sum, s).unwrap();
        assert_eq!(c.all_reduce(buf.ptr, buf.ptr, 8, DataType::F32, RedOp::Sum, s2).unwrap_err().code(), hoccl::ErrorCode::InvalidUsage);
        c.group_end().unwrap();
        // Still usable.
        c.all_reduce(buf.ptr, buf.ptr, 8, DataType::I32, RedOp::Max, s).unwrap();
        sync(&dev, s);
        assert!(c.async_error().is_none());
    });
}

/// PreMulSum (every input times a scalar, then summed): every kind × data type on 3 ranks,
/// the scalar given by value and in device memory (there read when the reduce step runs: it
/// is written after the previous call's step completed and before this call is enqueued).
/// Scalars are random bits, so the floating-point types meet NaN and infinite scalars too.
/// `reduce_into`'s PreMulSum is checked against an independent arithmetic in its own tests
/// and in `tests/reduce_kernels.rs`.
fn premulsum(b: Backend) {
    run_ranks(b, 3, small_scratch(), |c| {
        c.reserve_reduce_scratch().unwrap();
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let scalar = dev.alloc(8).unwrap();
        let mut it = 77_000;
        for kind in KINDS {
            for dtype in DataType::ALL {
                for on_device in [false, true] {
                    it += 1;
                    let mut rng = Rng(it); // the same on every rank
                    let bits = rng.next() & (u64::MAX >> (64 - 8 * dtype.size()));
                    let value = RedOp::PreMulSum(Scalar::Value(bits));
                    let op = if on_device {
                        // A synchronous copy while a rank's collective is pending can wait on
                        // that collective inside the driver (README, "Waiting inside the
                        // driver"): every rank idle first.
                        quiesce(c);
                        dev.copy_from_host(scalar, &bits.to_le_bytes()[..dtype.size()]).unwrap();
                        RedOp::PreMulSum(Scalar::Device(scalar.0))
                    } else {
                        value
                    };
                    let count = [1, chunk_elems(3, dtype) * 3 + 1, rng.below(900) as usize | 1][rng.below(3) as usize];
                    let (in_place, root) = (rng.below(2) == 0, rng.below(3) as usize);
                    check_one_as(c, s, it, kind, dtype, op, value, count, in_place, root);
                }
            }
        }
        // A scalar outside device memory is refused when the call is enqueued (allocating
        // and freeing with every rank idle, as above).
        quiesce(c);
        let on_host = [0u8; 8];
        let bad = RedOp::PreMulSum(Scalar::Device(on_host.as_ptr() as u64));
        let buf = dev.alloc(64).unwrap();
        let e = c.all_reduce(buf, buf, 4, DataType::F32, bad, s).unwrap_err();
        assert_eq!(e.code(), hoccl::ErrorCode::InvalidArgument, "{e}");
        assert!(e.to_string().contains("PreMulSum scalar"), "{e}");
        sync(&dev, s);
        quiesce(c);
        dev.free(buf).unwrap();
        dev.free(scalar).unwrap();
    });
}

/// Ranks on several virtual nodes (ranks of other nodes only through the socket
/// transport): every kind × data type against the same reference, with the
/// small scratch so calls run in many chunks of the hierarchical plan. The layouts cover
/// even nodes, uneven ones (`ranks` not a multiple of `nodes`: the first nodes get one
/// more), and one rank per node (which stays flat); Avg and PreMulSum stay flat too.
fn across_nodes_with(b: Backend, engine: EngineChoice, layouts: &'static [(usize, usize)]) {
    for &(nodes, ranks) in layouts {
        let cfg = Config { virtual_nodes: nodes, engine, ..small_scratch() };
        run_ranks(b, ranks, cfg, move |c| {
            let n = c.size();
            assert_eq!(c.topology().nnodes(), nodes);
            assert_eq!(c.reduces_hierarchically(RedOp::Sum), ranks > nodes, "{nodes} nodes, {ranks} ranks");
            c.reserve_reduce_scratch().unwrap();
            let s = new_stream(&c.device().clone());
            let mut rng = Rng(0x40de + (nodes * 16 + ranks) as u64);
            let mut it = 700_000 + 1000 * (nodes * 16 + ranks) as u64;
            for kind in KINDS {
                // Every data type with one of the operators (each operator's arithmetic is
                // the flat tests' business; here the plan must hand it the right inputs in
                // the right order), and Avg once per kind, which stays flat.
                let picks = DataType::ALL.into_iter().map(|d| (d, RedOp::ALL[rng.below(4) as usize])).chain([(DataType::F32, RedOp::Avg)]);
                for (dtype, op) in picks.collect::<Vec<_>>() {
                    {
                        it += 1;
                        let cap = chunk_elems(n, dtype);
                        let count = match rng.below(6) {
                            0 => rng.below(n as u64 + 1) as usize,
                            1 => cap + 1,
                            2 => 3 * cap + rng.below(cap as u64) as usize,
                            _ => rng.below(900) as usize | 1,
                        };
                        let in_place = rng.below(2) == 0;
                        let root = rng.below(n as u64) as usize;
                        check_one(c, s, it, kind, dtype, op, count, in_place, root);
                    }
                }
            }
        });
    }
}

fn across_nodes(b: Backend) {
    across_nodes_with(b, EngineChoice::CopyEngine, &[(2, 4), (2, 3), (3, 5), (4, 6), (2, 8), (3, 3)]);
}

/// Nodes of 8 ranks: the fold of the prefix and 8 contributions takes more inputs than one
/// reduce launch (the CUDA kernel's 8), so it goes on from its partial result.
fn across_nodes_wide(b: Backend) {
    run_ranks(b, 16, Config { virtual_nodes: 2, ..small_scratch() }, |c| {
        assert!(c.reduces_hierarchically(RedOp::Sum));
        c.reserve_reduce_scratch().unwrap();
        let s = new_stream(&c.device().clone());
        for (i, (kind, dtype, op)) in [(Kind::AllReduce, DataType::F32, RedOp::Sum), (Kind::ReduceScatter, DataType::BF16, RedOp::Prod), (Kind::Reduce, DataType::F16, RedOp::Min)].into_iter().enumerate() {
            check_one(c, s, 850_000 + i as u64, kind, dtype, op, 2 * chunk_elems(16, dtype) + 5, i == 1, 9);
        }
    });
}

/// Under `auto` with a slow NIC (`HOCCL_NET_GBPS`, which sets the model's NIC rate) and
/// under `compressed`, with the default scratch and counts whose pieces reach the
/// compressed engine's 64 KiB floor, so the hops between nodes cross compressed.
fn across_nodes_compressed(b: Backend) {
    for (engine, nodes, ranks) in [(EngineChoice::Compressed, 2, 4), (EngineChoice::Compressed, 3, 5), (EngineChoice::Auto, 2, 4)] {
        let cfg = Config { virtual_nodes: nodes, engine, net_gbps: 8.0, ..test_config() };
        run_ranks(b, ranks, cfg, move |c| {
            let n = c.size();
            c.reserve_reduce_scratch().unwrap();
            let s = new_stream(&c.device().clone());
            let mut rng = Rng(0xc0de + (nodes * 16 + ranks) as u64);
            let mut it = 800_000 + 1000 * (nodes * 16 + ranks) as u64;
            for kind in KINDS {
                for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
                    for op in [RedOp::Sum, RedOp::Max] {
                        it += 1;
                        let count = 100_000 + rng.below(100_000) as usize;
                        let count = if kind == Kind::ReduceScatter { count / n } else { count };
                        let (in_place, root) = (rng.below(2) == 0, rng.below(n as u64) as usize);
                        check_one(c, s, it, kind, dtype, op, count, in_place, root);
                    }
                }
            }
        });
    }
}

/// The hierarchical plan is the one that runs: on 2 nodes × 2 ranks, an AllReduce has rank
/// 0 exchange data only with its node peer and its counterpart on the other node (rank 2),
/// never with rank 3, while the flat plan (Avg) reaches every rank; the operators and
/// layouts that stay flat say so.
fn hierarchical_path(b: Backend) {
    run_ranks(b, 4, Config { virtual_nodes: 2, ..small_scratch() }, |c| {
        let (r, dev) = (c.rank(), c.device().clone());
        for op in [RedOp::Sum, RedOp::Prod, RedOp::Max, RedOp::Min] {
            assert!(c.reduces_hierarchically(op), "{op:?}");
        }
        assert!(!c.reduces_hierarchically(RedOp::Avg));
        assert!(!c.reduces_hierarchically(RedOp::PreMulSum(Scalar::Value(0))));
        let s = new_stream(&dev);
        let far = [3, 2, 1, 0][r];
        let ops = |c: &hoccl::Communicator| (0..4).map(|p| c.ops_with(p).unwrap()).collect::<Vec<u64>>();
        let before = ops(c);
        for i in 0..3 {
            check_one(c, s, 900_000 + i, Kind::AllReduce, DataType::I32, RedOp::Sum, 3000, i == 1, 0);
        }
        let after = ops(c);
        assert_eq!(after[far], before[far], "rank {r} exchanged with rank {far} under the hierarchical plan: {before:?} -> {after:?}");
        assert!(after[r ^ 1] > before[r ^ 1] && after[r ^ 2] > before[r ^ 2], "rank {r}: {before:?} -> {after:?}");
        check_one(c, s, 900_010, Kind::AllReduce, DataType::I32, RedOp::Avg, 3000, false, 0);
        assert!(ops(c)[far] > after[far], "rank {r}: the flat plan reaches every rank");
        assert!(c.ops_with(4).is_err());
    });
    run_ranks(b, 3, Config { virtual_nodes: 3, ..small_scratch() }, |c| assert!(!c.reduces_hierarchically(RedOp::Sum)));
    run_ranks(b, 4, small_scratch(), |c| assert!(!c.reduces_hierarchically(RedOp::Sum)));
}

/// Forwarding peers (`HOCCL_FORWARDING_PEERS` with ranks that forward through another):
/// the hierarchical plan puts each node's pieces on its forwarding peers only, so a rank
/// that forwards through another exchanges nothing with any rank of another node (its
/// contributions go to the owners within the node, ReduceScatter blocks and a Reduce root
/// on it are relayed by them), while the results stay those of `reduce_into` in rank
/// order. 2 × 2, 2 × 3 and 3 × 2 virtual nodes, every kind, random data types, operators,
/// counts (across chunk boundaries), roots and in place; with `HOCCL_FORWARDING=0` every
/// rank owns a piece again and reaches the other node.
fn across_nodes_forwarded(b: Backend) {
    for (nodes, ranks, peers, forwarding) in [(2, 4, &[0, 0][..], true), (2, 6, &[0, 0, 2], true), (3, 6, &[1, 1], true), (2, 4, &[0, 0], false)] {
        let cfg = Config { virtual_nodes: nodes, forwarding_peers: peers.to_vec(), forwarding, ..small_scratch() };
        run_ranks(b, ranks, cfg, move |c| {
            let (n, r) = (c.size(), c.rank());
            let k = n / nodes;
            let owner = !forwarding || peers.contains(&(r % k));
            assert!(c.reduces_hierarchically(RedOp::Sum));
            c.reserve_reduce_scratch().unwrap();
            let s = new_stream(&c.device().clone());
            let stray = (0..k).find(|l| !peers.contains(l)).unwrap_or(0);
            let far: Vec<usize> = (0..n).filter(|p| p / k != r / k).collect();
            let crossings = |c: &hoccl::Communicator| far.iter().map(|p| c.ops_with(*p).unwrap()).sum::<u64>();
            let before = crossings(c);
            let mut rng = Rng(0xf0d + (nodes * 16 + ranks) as u64 + u64::from(forwarding));
            let mut it = 950_000 + 1000 * (nodes * 16 + ranks) as u64 + 500 * u64::from(forwarding);
            for kind in KINDS {
                for i in 0..4 {
                    it += 1;
                    let dtype = DataType::ALL[rng.below(DataType::ALL.len() as u64) as usize];
                    let op = RedOp::ALL[rng.below(4) as usize];
                    let cap = chunk_elems(n, dtype);
                    // The first of each kind long enough for a piece on every owner.
                    let count = match if i == 0 { 1 } else { rng.below(4) } {
                        0 => rng.below(n as u64 + 1) as usize,
                        1 => 3 * cap + rng.below(cap as u64) as usize,
                        _ => rng.below(900) as usize | 1,
                    };
                    // Half the time a root on the first node that forwards through another.
                    let root = if rng.below(2) == 0 { stray } else { rng.below(n as u64) as usize };
                    check_one(c, s, it, kind, dtype, op, count, rng.below(2) == 0, root);
                }
            }
            let after = crossings(c);
            if owner {
                assert!(after > before, "rank {r} owns pieces but exchanged nothing with another node");
            } else {
                assert_eq!(after, before, "rank {r} forwards through {peers:?} but exchanged with another node");
            }
        });
    }
}

/// `across_nodes_forwarded` under `compressed` with the default scratch and counts whose
/// pieces reach the compressed engine's 64 KiB floor: the prefixes, results and relayed
/// blocks cross compressed between the forwarding peers (`0,0` on 2 × 2).
fn across_nodes_forwarded_compressed(b: Backend) {
    let cfg = Config { virtual_nodes: 2, forwarding_peers: vec![0, 0], engine: EngineChoice::Compressed, net_gbps: 8.0, ..test_config() };
    run_ranks(b, 4, cfg, |c| {
        c.reserve_reduce_scratch().unwrap();
        let s = new_stream(&c.device().clone());
        let mut rng = Rng(0xf0dc);
        let mut it = 990_000;
        for kind in KINDS {
            for dtype in [DataType::BF16, DataType::F32] {
                it += 1;
                let count = 100_000 + rng.below(100_000) as usize;
                let count = if kind == Kind::ReduceScatter { count / 4 } else { count };
                // Root 1 forwards through rank 0: its result is relayed.
                check_one(c, s, it, kind, dtype, RedOp::Sum, count, rng.below(2) == 0, 1);
            }
        }
    });
}

backend_tests!(matrix_1, matrix_2, matrix_3, matrix_4, matrix_5, matrix_8, random_shapes, mixed_two_streams, stream_ordering, in_groups, invalid_arguments, premulsum, across_nodes, across_nodes_wide, across_nodes_compressed, across_nodes_forwarded, across_nodes_forwarded_compressed, hierarchical_path);
