//! Collectives captured into graphs and replayed (docs/nccl.md, "CUDA graphs"): every op,
//! reductions included, captured once and replayed several times with new inputs written
//! into the captured buffers in stream order before each replay, every replay's result
//! copied aside in stream order and checked against a reference computed here; replays
//! interleaved with eager calls on the same stream and on another; two graphs on two
//! streams; the graph destroyed before its communicator and after it (a replay then fails
//! and its stream is released); a peer that never replays (the others time out).
//!
//! The host backend emulates capture (`Device::begin_capture` records the stream's tasks,
//! `graph_launch` enqueues them again); the CUDA bodies (`--ignored`, on a GPU) capture
//! with `cuStreamBeginCapture` and replay with `cuGraphLaunch`. Ranks are threads, and
//! (host backend, and CUDA with `--ignored`) processes joined by a unique id.
mod common;
use common::{open_device, quiesce, run_ranks, test_config, Backend};
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::config::BackendChoice;
use hoccl::error::ErrorCode;
use hoccl::{Communicator, Config, DataType, DevPtr, Device, RedOp, StreamHandle};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Elements per block: odd, and more than a scratch slot holds under `config()`, so the
/// captured reductions run several chunks.
const CNT: usize = 3001;
/// Replays per graph.
const REPLAYS: usize = 4;
const POISON: i32 = i32::MIN;

/// A small scratch (several chunks per reduction), the tests' timeout.
fn config() -> Config {
    Config { reduce_scratch: 8 << 10, ..test_config() }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllReduce,
    ReduceScatter,
    Reduce,
    AllGather,
    Broadcast,
    AllToAll,
    /// Blocks in reverse order on both sides.
    AllToAllV,
    Gather,
    Scatter,
    SendRecv,
    /// PreMulSum with a device scalar (replay k writes k + 2 into it before the replay):
    /// the captured reduce step reads it when it runs.
    AllReducePreMul,
}

const OPS: [Op; 11] = [
    Op::AllReduce,
    Op::ReduceScatter,
    Op::Reduce,
    Op::AllGather,
    Op::Broadcast,
    Op::AllToAll,
    Op::AllToAllV,
    Op::Gather,
    Op::Scatter,
    Op::SendRecv,
    Op::AllReducePreMul,
];

/// The PreMulSum scalar of replay k.
fn scalar(k: usize) -> i32 {
    k as i32 + 2
}

/// Rank r's element i of replay k's input.
fn v(r: usize, k: usize, i: usize) -> i32 {
    ((i * 7 + r * 13 + k * 29) % 1001) as i32 - 500
}

fn bytes(x: &[i32]) -> Vec<u8> {
    x.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn ints(b: &[u8]) -> Vec<i32> {
    b.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect()
}

/// Enqueue `op` over `send` (n * CNT elements) and `recv` (n * CNT elements) on `s`;
/// `scalar` holds the PreMulSum scalar.
fn enqueue(c: &Communicator, op: Op, send: DevPtr, recv: DevPtr, scalar: DevPtr, s: StreamHandle) -> hoccl::Result<()> {
    let (n, me) = (c.size(), c.rank());
    let root = n - 1;
    let dt = DataType::I32;
    match op {
        Op::AllReduce => c.all_reduce(send, recv, CNT, dt, RedOp::Sum, s),
        Op::ReduceScatter => c.reduce_scatter(send, recv, CNT, dt, RedOp::Sum, s),
        Op::Reduce => c.reduce(send, recv, CNT, dt, RedOp::Max, root, s),
        Op::AllGather => c.all_gather(send, recv, CNT, dt, s),
        Op::Broadcast => c.broadcast(send, recv, CNT, dt, root, s),
        Op::AllToAll => c.all_to_all(send, recv, CNT, dt, s),
        Op::AllToAllV => {
            let counts = vec![CNT; n];
            let displs: Vec<usize> = (0..n).map(|j| (n - 1 - j) * CNT).collect();
            c.all_to_allv(send, &counts, &displs, recv, &counts, &displs, dt, s)
        }
        Op::AllReducePreMul => c.all_reduce(send, recv, CNT, dt, RedOp::PreMulSum(hoccl::reduce::Scalar::Device(scalar.0)), s),
        Op::Gather => c.gather(send, recv, CNT, dt, root, s),
        Op::Scatter => c.scatter(send, recv, CNT, dt, root, s),
        Op::SendRecv => c.group(|c| {
            c.send(send, CNT, dt, (me + 1) % n, s)?;
            c.recv(recv, CNT, dt, (me + n - 1) % n, s)
        }),
    }
}

/// What rank `me` of `n` holds in `recv` (n * CNT elements, poisoned before) after `op` on
/// the inputs of replay `k`, computed from the definition of each op.
fn expected(op: Op, n: usize, me: usize, k: usize) -> Vec<i32> {
    let root = n - 1;
    let mut out = vec![POISON; n * CNT];
    let sum = |i: usize| (0..n).map(|r| v(r, k, i)).sum::<i32>();
    match op {
        Op::AllReduce => (0..CNT).for_each(|i| out[i] = sum(i)),
        Op::ReduceScatter => (0..CNT).for_each(|i| out[i] = sum(me * CNT + i)),
        Op::Reduce if me == root => (0..CNT).for_each(|i| out[i] = (0..n).map(|r| v(r, k, i)).max().unwrap()),
        Op::AllGather => (0..n * CNT).for_each(|i| out[i] = v(i / CNT, k, i % CNT)),
        Op::Broadcast => (0..CNT).for_each(|i| out[i] = v(root, k, i)),
        Op::AllToAll => (0..n * CNT).for_each(|i| out[i] = v(i / CNT, k, me * CNT + i % CNT)),
        Op::AllToAllV => (0..n * CNT).for_each(|i| {
            let j = n - 1 - i / CNT;
            out[i] = v(j, k, (n - 1 - me) * CNT + i % CNT)
        }),
        Op::AllReducePreMul => (0..CNT).for_each(|i| out[i] = (0..n).map(|r| scalar(k) * v(r, k, i)).sum()),
        Op::Gather if me == root => (0..n * CNT).for_each(|i| out[i] = v(i / CNT, k, i % CNT)),
        Op::Scatter => (0..CNT).for_each(|i| out[i] = v(root, k, me * CNT + i)),
        Op::SendRecv => (0..CNT).for_each(|i| out[i] = v((me + n - 1) % n, k, i)),
        Op::Reduce | Op::Gather => {}
    }
    out
}

/// Device buffers of one rank's body, freed (after a quiesce) by `free`.
struct Bufs {
    dev: Arc<dyn Device>,
    ptrs: Vec<DevPtr>,
}

impl Bufs {
    fn new(dev: &Arc<dyn Device>) -> Bufs {
        Bufs { dev: dev.clone(), ptrs: Vec::new() }
    }
    /// A buffer holding `data`.
    fn with(&mut self, data: &[i32]) -> DevPtr {
        let p = self.dev.alloc(data.len() * 4).expect("alloc");
        self.dev.copy_from_host(p, &bytes(data)).expect("upload");
        self.ptrs.push(p);
        p
    }
    fn read(&self, p: DevPtr, len: usize) -> Vec<i32> {
        let mut b = vec![0u8; len * 4];
        self.dev.copy_to_host(&mut b, p).expect("download");
        ints(&b)
    }
    fn free(self) {
        for p in self.ptrs {
            self.dev.free(p).expect("free");
        }
    }
}

/// Capture what `f` enqueues on `s` into a graph.
fn capture(dev: &Arc<dyn Device>, s: StreamHandle, f: impl FnOnce() -> hoccl::Result<()>) -> hoccl::device::GraphHandle {
    dev.begin_capture(s).expect("begin_capture");
    let r = f();
    let g = match dev.end_capture(s) {
        Ok(g) => g,
        // The captured call's own error says what invalidated the capture.
        Err(e) => panic!("end_capture: {e:?}; the captured call returned {r:?}"),
    };
    r.expect("captured call");
    g
}

/// After this rank's captures: wait until every rank has made its own, so that no rank
/// allocates for a capture (flag slabs, scratch) while another's replay is pending on the
/// GPU they share (docs/design.md, "Several ranks in one process on one GPU").
fn captured(c: &Communicator) {
    c.bootstrap().barrier().expect("barrier");
}

/// One rank: every op captured on `s` and replayed `REPLAYS` times with new inputs; after
/// every other replay an eager AllReduce on `s` and an eager AllGather on `other`. Each
/// replay's result and the eager results are checked.
fn every_op_replayed(c: &Communicator, s: StreamHandle, other: StreamHandle) {
    let (n, me, dev) = (c.size(), c.rank(), c.device().clone());
    let len = n * CNT;
    let mut b = Bufs::new(&dev);
    let inputs: Vec<DevPtr> = (0..REPLAYS).map(|k| b.with(&(0..len).map(|i| v(me, k, i)).collect::<Vec<_>>())).collect();
    let poison = b.with(&vec![POISON; len]);
    let scalars: Vec<DevPtr> = (0..REPLAYS).map(|k| b.with(&[scalar(k)])).collect();
    let scalar_at = b.with(&[0]);
    let (send, recv) = (b.with(&vec![0; len]), b.with(&vec![0; len]));
    let results: Vec<DevPtr> = (0..REPLAYS).map(|_| b.with(&vec![0; len])).collect();
    // The eager calls' buffers: constant inputs, so every eager result is the same.
    let e_in = b.with(&(0..CNT).map(|i| v(me, 99, i)).collect::<Vec<_>>());
    let (e_sum, e_gather) = (b.with(&vec![0; CNT]), b.with(&vec![0; len]));
    quiesce(c);
    for op in OPS {
        let g = capture(&dev, s, || enqueue(c, op, send, recv, scalar_at, s));
        captured(c);
        let b4 = c.pending();
        for k in 0..REPLAYS {
            dev.memcpy_async(s, send, inputs[k], len * 4).expect("new input");
            dev.memcpy_async(s, recv, poison, len * 4).expect("poison");
            dev.memcpy_async(s, scalar_at, scalars[k], 4).expect("scalar");
            dev.graph_launch(g, s).expect("replay");
            dev.memcpy_async(s, results[k], recv, len * 4).expect("result aside");
            if k % 2 == 1 {
                c.all_reduce(e_in, e_sum, CNT, DataType::I32, RedOp::Sum, s).expect("eager all_reduce");
                c.all_gather(e_in, e_gather, CNT, DataType::I32, other).expect("eager all_gather");
            }
        }
        dev.synchronize(s).expect("synchronize");
        dev.synchronize(other).expect("synchronize");
        assert!(c.async_error().is_none(), "rank {me}: {op:?}: {:?}", c.async_error());
        for (k, r) in results.iter().enumerate() {
            let (got, want) = (b.read(*r, len), expected(op, n, me, k));
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "rank {me} of {n}: {op:?} replay {k}: {bad} wrong elements (first: {:?})", got.iter().zip(&want).position(|(a, b)| a != b));
        }
        let sum = b.read(e_sum, CNT);
        assert!(sum.iter().enumerate().all(|(i, x)| *x == (0..n).map(|r| v(r, 99, i)).sum::<i32>()), "rank {me}: eager all_reduce beside {op:?}");
        let gat = b.read(e_gather, len);
        assert!(gat.iter().enumerate().all(|(i, x)| *x == v(i / CNT, 99, i % CNT)), "rank {me}: eager all_gather beside {op:?}");
        assert!(c.pending() <= b4, "rank {me}: {op:?}: operations left pending");
        quiesce(c);
        dev.graph_destroy(g).expect("graph_destroy");
    }
    b.free();
}

/// `every_op_replayed` on `n` thread ranks.
fn every_op_on(backend: Backend, n: usize) {
    run_ranks(backend, n, config(), |c| {
        let (s, o) = (common::new_stream(c.device()), common::new_stream(c.device()));
        every_op_replayed(c, s, o);
    });
}

fn every_op_two_ranks(backend: Backend) {
    every_op_on(backend, 2);
}

fn every_op_three_ranks(backend: Backend) {
    every_op_on(backend, 3);
}

fn every_op_four_ranks(backend: Backend) {
    every_op_on(backend, 4);
}

/// An AllReduce graph on one stream and an AllGather graph on another, replayed in an order
/// that differs between ranks (rank 0 launches the AllGather first): instances match by
/// template and replay, not by call order.
fn two_graphs_two_streams(backend: Backend) {
    run_ranks(backend, 3, config(), |c| {
        let (n, me, dev) = (c.size(), c.rank(), c.device().clone());
        let (s1, s2) = (common::new_stream(&dev), common::new_stream(&dev));
        let len = n * CNT;
        let mut b = Bufs::new(&dev);
        let inputs: Vec<DevPtr> = (0..REPLAYS).map(|k| b.with(&(0..len).map(|i| v(me, k, i)).collect::<Vec<_>>())).collect();
        let (a_in, a_out, g_in, g_out) = (b.with(&vec![0; len]), b.with(&vec![0; len]), b.with(&vec![0; len]), b.with(&vec![0; len]));
        let a_res: Vec<DevPtr> = (0..REPLAYS).map(|_| b.with(&vec![0; CNT])).collect();
        let g_res: Vec<DevPtr> = (0..REPLAYS).map(|_| b.with(&vec![0; len])).collect();
        quiesce(c);
        let ga = capture(&dev, s1, || c.all_reduce(a_in, a_out, CNT, DataType::I32, RedOp::Sum, s1));
        let gg = capture(&dev, s2, || c.all_gather(g_in, g_out, CNT, DataType::I32, s2));
        captured(c);
        for k in 0..REPLAYS {
            let run_a = || {
                dev.memcpy_async(s1, a_in, inputs[k], CNT * 4).unwrap();
                dev.graph_launch(ga, s1).unwrap();
                dev.memcpy_async(s1, a_res[k], a_out, CNT * 4).unwrap();
            };
            let run_g = || {
                dev.memcpy_async(s2, g_in, inputs[(k + 1) % REPLAYS], CNT * 4).unwrap();
                dev.graph_launch(gg, s2).unwrap();
                dev.memcpy_async(s2, g_res[k], g_out, len * 4).unwrap();
            };
            if me == 0 {
                run_g();
                run_a();
            } else {
                run_a();
                run_g();
            }
        }
        dev.synchronize(s1).unwrap();
        dev.synchronize(s2).unwrap();
        assert!(c.async_error().is_none(), "rank {me}: {:?}", c.async_error());
        for k in 0..REPLAYS {
            let a = b.read(a_res[k], CNT);
            assert!(a.iter().enumerate().all(|(i, x)| *x == (0..n).map(|r| v(r, k, i)).sum::<i32>()), "rank {me}: all_reduce replay {k}");
            let g = b.read(g_res[k], len);
            assert!(g.iter().enumerate().all(|(i, x)| *x == v(i / CNT, (k + 1) % REPLAYS, i % CNT)), "rank {me}: all_gather replay {k}");
        }
        quiesce(c);
        dev.graph_destroy(ga).unwrap();
        dev.graph_destroy(gg).unwrap();
        b.free();
    });
}

/// Several reductions captured in one graph on one stream (they share a scratch; the second
/// needs a larger one than the first), the last reading the first's result: every replay's
/// results checked.
fn reductions_in_one_graph(backend: Backend) {
    /// Elements of the first and last AllReduce: a scratch slot of 256 bytes.
    const SMALL: usize = 64;
    run_ranks(backend, 3, config(), |c| {
        let (n, me, dev) = (c.size(), c.rank(), c.device().clone());
        let s = common::new_stream(&dev);
        let big = 4 * n * CNT;
        let mut b = Bufs::new(&dev);
        let inputs: Vec<DevPtr> = (0..REPLAYS).map(|k| b.with(&(0..big).map(|i| v(me, k, i)).collect::<Vec<_>>())).collect();
        let input = b.with(&vec![0; big]);
        let (a, rs, bg, chained) = (b.with(&vec![0; CNT]), b.with(&vec![0; CNT]), b.with(&vec![0; big]), b.with(&vec![0; CNT]));
        let res: Vec<[DevPtr; 4]> = (0..REPLAYS).map(|_| [b.with(&vec![0; CNT]), b.with(&vec![0; CNT]), b.with(&vec![0; big]), b.with(&vec![0; CNT])]).collect();
        quiesce(c);
        let dt = DataType::I32;
        let g = capture(&dev, s, || {
            c.all_reduce(input, a, SMALL, dt, RedOp::Sum, s)?;
            c.reduce_scatter(input, rs, CNT, dt, RedOp::Sum, s)?;
            c.all_reduce(input, bg, big, dt, RedOp::Sum, s)?;
            c.all_reduce(a, chained, SMALL, dt, RedOp::Sum, s)
        });
        captured(c);
        for k in 0..REPLAYS {
            dev.memcpy_async(s, input, inputs[k], big * 4).unwrap();
            dev.graph_launch(g, s).unwrap();
            for (dst, src, len) in [(res[k][0], a, SMALL), (res[k][1], rs, CNT), (res[k][2], bg, big), (res[k][3], chained, SMALL)] {
                dev.memcpy_async(s, dst, src, len * 4).unwrap();
            }
        }
        dev.synchronize(s).unwrap();
        assert!(c.async_error().is_none(), "rank {me}: {:?}", c.async_error());
        for k in 0..REPLAYS {
            let sum = |i: usize| (0..n).map(|r| v(r, k, i)).sum::<i32>();
            assert!(b.read(res[k][0], SMALL).iter().enumerate().all(|(i, x)| *x == sum(i)), "rank {me} replay {k}: first all_reduce");
            assert!(b.read(res[k][1], CNT).iter().enumerate().all(|(i, x)| *x == sum(me * CNT + i)), "rank {me} replay {k}: reduce_scatter");
            assert!(b.read(res[k][2], big).iter().enumerate().all(|(i, x)| *x == sum(i)), "rank {me} replay {k}: large all_reduce");
            assert!(b.read(res[k][3], SMALL).iter().enumerate().all(|(i, x)| *x == n as i32 * sum(i)), "rank {me} replay {k}: chained all_reduce");
        }
        quiesce(c);
        dev.graph_destroy(g).unwrap();
        b.free();
    });
}

/// A capture with the compressed engine is refused with InvalidUsage (and records nothing
/// that could hang a replay); with one rank, capture records the stream work as before.
fn refusals_and_one_rank(backend: Backend) {
    let cfg = Config { engine: hoccl::config::EngineChoice::Compressed, ..config() };
    run_ranks(backend, 2, cfg, |c| {
        let dev = c.device().clone();
        let s = common::new_stream(&dev);
        let mut b = Bufs::new(&dev);
        let (x, y) = (b.with(&vec![1; 2 * CNT]), b.with(&vec![0; 2 * CNT]));
        quiesce(c);
        dev.begin_capture(s).unwrap();
        let e = c.all_gather(x, y, CNT, DataType::F32, s).expect_err("compressed capture refused");
        let g = dev.end_capture(s).unwrap();
        assert_eq!(e.code(), ErrorCode::InvalidUsage, "{e}");
        assert!(e.to_string().contains("compressed engine"), "{e}");
        // Raw data (no codec for i32) is captured under the same setting.
        let g2 = capture(&dev, s, || c.all_gather(x, y, CNT, DataType::I32, s));
        captured(c);
        dev.graph_launch(g, s).unwrap();
        dev.graph_launch(g2, s).unwrap();
        dev.synchronize(s).unwrap();
        assert!(c.async_error().is_none(), "{:?}", c.async_error());
        quiesce(c);
        dev.graph_destroy(g).unwrap();
        dev.graph_destroy(g2).unwrap();
        b.free();
    });
    run_ranks(backend, 1, config(), |c| {
        let dev = c.device().clone();
        let s = common::new_stream(&dev);
        let mut b = Bufs::new(&dev);
        let (x, y) = (b.with(&(0..CNT as i32).collect::<Vec<_>>()), b.with(&vec![0; CNT]));
        let g = capture(&dev, s, || c.all_reduce(x, y, CNT, DataType::I32, RedOp::Sum, s));
        dev.graph_launch(g, s).unwrap();
        dev.synchronize(s).unwrap();
        assert_eq!(b.read(y, CNT), (0..CNT as i32).collect::<Vec<_>>());
        dev.graph_destroy(g).unwrap();
        b.free();
    });
}

/// Ranks as threads that make their communicators themselves: `f(rank, bootstraps,
/// device)`, with `groups` bootstraps per rank (one per communicator).
fn thread_ranks(backend: Backend, n: usize, groups: usize, f: impl Fn(usize, Vec<ThreadBootstrap>, Arc<dyn Device>) + Send + Sync + 'static) {
    let f = Arc::new(f);
    let mut per_rank: Vec<Vec<ThreadBootstrap>> = (0..n).map(|_| Vec::new()).collect();
    for _ in 0..groups {
        for (r, b) in ThreadBootstrap::group_with_timeout(n, Duration::from_secs(30)).into_iter().enumerate() {
            per_rank[r].push(b);
        }
    }
    let hs: Vec<_> = per_rank
        .into_iter()
        .enumerate()
        .map(|(r, bs)| {
            let f = f.clone();
            std::thread::spawn(move || f(r, bs, open_device(backend, r)))
        })
        .collect();
    let failed: Vec<usize> = hs.into_iter().enumerate().filter_map(|(r, h)| h.join().is_err().then_some(r)).collect();
    assert!(failed.is_empty(), "ranks {failed:?} failed");
}

/// How `destroy_orders` ends a communicator with a captured graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum End {
    /// The graph is destroyed, then the communicator.
    GraphFirst,
    /// The communicator is destroyed, the graph replayed, then destroyed.
    DestroyFirst,
    /// The communicator is aborted, the graph replayed (the handle still exists), then both
    /// go.
    AbortFirst,
}

/// The graph outlives its communicator (destroyed or aborted): a replay afterwards is
/// released (the operation fails, logged) instead of hanging; destroying the graph then
/// ends it. And the usual order, graph first, then the communicator.
fn destroy_orders(backend: Backend) {
    let ends = [End::GraphFirst, End::DestroyFirst, End::AbortFirst];
    thread_ranks(backend, 2, ends.len(), move |me, bs, dev| {
        let s = dev.create_stream().unwrap();
        let mut b = Bufs::new(&dev);
        let (x, y) = (b.with(&vec![me as i32 + 1; CNT]), b.with(&vec![0; CNT]));
        for (end, bs) in ends.into_iter().zip(bs) {
            let comm = Communicator::with_bootstrap(Box::new(bs), Some(dev.clone()), config()).expect("communicator");
            let g = capture(&dev, s, || comm.all_reduce(x, y, CNT, DataType::I32, RedOp::Sum, s));
            captured(&comm);
            dev.graph_launch(g, s).unwrap();
            dev.synchronize(s).unwrap();
            assert_eq!(b.read(y, CNT), vec![3; CNT], "rank {me}: {end:?}");
            comm.bootstrap().barrier().unwrap();
            match end {
                End::GraphFirst => {
                    dev.graph_destroy(g).unwrap();
                    dev.synchronize(s).unwrap();
                    drop(comm);
                }
                End::DestroyFirst | End::AbortFirst => {
                    let comm = match end {
                        End::AbortFirst => {
                            comm.abort();
                            Some(comm)
                        }
                        _ => None,
                    };
                    let t = Instant::now();
                    dev.graph_launch(g, s).unwrap();
                    dev.synchronize(s).unwrap();
                    assert!(t.elapsed() < Duration::from_secs(5), "rank {me}: {end:?}: a replay afterwards took {:?}", t.elapsed());
                    drop(comm);
                    dev.graph_destroy(g).unwrap();
                    dev.synchronize(s).unwrap();
                }
            }
        }
        b.free();
        dev.destroy_stream(s).unwrap();
    });
}

/// Rank 1 never replays: rank 0's instance times out with Timeout and its stream is
/// released; rank 1 learns of the failure when it next calls.
fn peer_never_replays(backend: Backend) {
    let cfg = Config { timeout: Duration::from_secs(1), ..config() };
    run_ranks(backend, 2, cfg, |c| {
        let (me, dev) = (c.rank(), c.device().clone());
        let s = common::new_stream(&dev);
        let mut b = Bufs::new(&dev);
        let (x, y) = (b.with(&vec![1; CNT]), b.with(&vec![0; CNT]));
        quiesce(c);
        let g = capture(&dev, s, || c.all_reduce(x, y, CNT, DataType::I32, RedOp::Sum, s));
        captured(c);
        if me == 0 {
            let t = Instant::now();
            dev.graph_launch(g, s).unwrap();
            dev.synchronize(s).unwrap();
            let e = c.async_error().expect("the replay failed");
            assert_eq!(e.code(), ErrorCode::Timeout, "{e}");
            assert!(t.elapsed() < Duration::from_secs(10), "released after {:?}", t.elapsed());
        }
        c.bootstrap().barrier().unwrap();
        dev.graph_destroy(g).unwrap();
        dev.synchronize(s).unwrap();
        // Rank 0's buffers are freed only once its failed op is gone; rank 1 never used its.
        b.free();
    });
}

backend_tests!(every_op_two_ranks, every_op_three_ranks, every_op_four_ranks, two_graphs_two_streams, reductions_in_one_graph, refusals_and_one_rank, destroy_orders, peer_never_replays);

// ---------------------------------------------------------------- processes -------------

/// The child side: does nothing unless `HOCCL_GRAPHS_CHILD` (`<hex id> <n> <rank>
/// <host|cuda>`) is set. Runs `every_op_replayed` over a TCP bootstrap.
#[test]
fn child_rank() {
    let Ok(a) = std::env::var("HOCCL_GRAPHS_CHILD") else { return };
    let a: Vec<&str> = a.split_whitespace().collect();
    let id = UniqueId::from_hex(a[0]).expect("id");
    let (n, me): (usize, usize) = (a[1].parse().unwrap(), a[2].parse().unwrap());
    let backend = if a[3] == "cuda" { BackendChoice::Cuda } else { BackendChoice::Host };
    let c = Communicator::from_unique_id(&id, n, me, Config { backend, ..config() }).expect("communicator");
    let dev = c.device().clone();
    let (s, o) = (dev.create_stream().unwrap(), dev.create_stream().unwrap());
    every_op_replayed(&c, s, o);
    c.wait_idle().unwrap();
    println!("rank {me}: every op captured and replayed: ok");
}

fn processes(backend: &str, n: usize) {
    common::logs::capture();
    let exe = std::env::current_exe().unwrap();
    let id = Communicator::unique_id(&Config::from_env().unwrap()).unwrap();
    let mut kids: Vec<_> = (0..n)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env("HOCCL_GRAPHS_CHILD", format!("{} {n} {r} {backend}", id.to_hex()))
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let t0 = Instant::now();
    while kids.iter_mut().any(|k| k.try_wait().unwrap().is_none()) {
        if t0.elapsed() > Duration::from_secs(120) {
            kids.iter_mut().for_each(|k| drop(k.kill()));
            panic!("{backend}: the ranks did not finish within 120 s (hung)");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success() && stdout.contains("captured and replayed: ok"), "{backend} rank {r}: {stdout}\n{}", String::from_utf8_lossy(&out.stderr));
    }
}

#[test]
fn every_op_three_processes_host() {
    processes("host", 3);
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn every_op_three_processes_cuda() {
    processes("cuda", 3);
}
