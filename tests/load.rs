//! Load (issue 41, item 4): random operations on 4 thread ranks, each result checked against
//! an expectation computed here from every rank's inputs (`reduce_into` folds in rank
//! order for the reductions, which hoccl matches bit for bit on every engine).
//!
//! Every rank holds three communicators over the same ranks, one per engine (`ce`,
//! `compressed`, and `auto` with slowed links so that it compresses some transfers), and each
//! op draws one of them, so the engines interleave on the same streams. Each op also draws
//! its kind (AllGather, Broadcast, AlltoAll, a send/recv ring with a random shift, AllReduce,
//! ReduceScatter, Reduce), in place or not where the op allows, the dtype (all twelve), the
//! operator, the count (0, 1, odd, above the compressed engine's 64 KiB threshold), the
//! buffer offsets (whole elements; any byte for 1-byte types), the root and one of three
//! streams. A quarter of the draws are groups of 2–4 such ops on one communicator and one
//! stream. Ops go in batches of `BATCH` draws: every rank prepares the batch's buffers, then
//! enqueues its ops back to back; results are checked, and buffers freed, after the batch
//! (so allocations and synchronous copies never overlap a pending collective of another
//! thread rank, which CUDA does not allow); guard bands around every buffer must be untouched.
//!
//! CI runs `CI_OPS` ops (about 20 s on this 2-core machine); `HOCCL_STRESS=full` runs
//! `FULL_OPS` with larger "large" counts. The same body runs on CUDA with `--ignored`.
mod common;
use common::*;

use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::config::EngineChoice;
use hoccl::cost::CostModel;
use hoccl::device::{pattern_byte, Device, StreamHandle};
use hoccl::reduce::reduce_into;
use hoccl::{Communicator, Config, DataType, RedOp};
use std::sync::Arc;
use std::time::{Duration, Instant};

const RANKS: usize = 4;
const CI_OPS: usize = 3000;
const FULL_OPS: usize = 10_000;
const BATCH: usize = 40;
const STREAMS: usize = 3;

fn full() -> bool {
    std::env::var("HOCCL_STRESS").is_ok_and(|v| v == "full")
}

fn configs() -> Vec<Config> {
    let slow = CostModel::default().with_overrides("same_gpu_gbps=1,nvlink_gbps=1").unwrap();
    vec![
        Config { engine: EngineChoice::CopyEngine, ..test_config() },
        Config { engine: EngineChoice::Compressed, ..test_config() },
        Config { engine: EngineChoice::Auto, cost_model: slow, ..test_config() },
    ]
}

/// Rank `p`'s input of op `k`: `len` bytes of a pattern.
fn input(k: u64, p: usize, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern_byte(seed_of(k, p, 5), i)).collect()
}

/// One op, drawn identically on every rank from the shared seed.
#[derive(Debug, Clone, Copy)]
struct Call {
    kind: u64,
    dtype: DataType,
    count: usize,
    op: RedOp,
    root: usize,
    in_place: bool,
    shift: usize,
    off_send: usize,
    off_recv: usize,
}

fn draw(rng: &mut Rng, n: usize, large: usize) -> Call {
    let dtype = DataType::ALL[rng.below(DataType::ALL.len() as u64) as usize];
    let count = match rng.below(8) {
        0 => 0,
        1 => 1,
        2 => (70_000 + rng.below(large as u64) as usize) / dtype.size(),
        3 => 2 * rng.below(50) as usize + 1,
        _ => rng.below(3000) as usize + 1,
    };
    let off = |rng: &mut Rng| rng.below(8) as usize * dtype.size();
    Call {
        kind: rng.below(7),
        dtype,
        count,
        op: RedOp::ALL[rng.below(RedOp::ALL.len() as u64) as usize],
        root: rng.below(n as u64) as usize,
        in_place: rng.below(3) == 0,
        shift: 1 + rng.below(n as u64 - 1) as usize,
        off_send: off(rng),
        off_recv: off(rng),
    }
}

/// A result to check: `want` at `at` bytes into `buf`'s window, nothing outside the window.
struct Check {
    k: u64,
    call: Call,
    buf: Buf,
    at: usize,
    want: Vec<u8>,
}

/// What enqueues a prepared op: called once, inside or outside a group.
type Launch = Box<dyn FnOnce(&Communicator) -> hoccl::Result<()> + Send>;

/// Allocate and fill op `k`'s buffers on `c`'s device; returns what to check and the call
/// that enqueues it on `s`. Preparing never enqueues, so that a batch's buffers all exist
/// before any of its ops is pending: ranks that are threads of one process share a CUDA
/// context, where allocations and synchronous copies may wait for another rank's pending
/// collective (docs/design.md, "Several ranks in one process on one GPU").
fn prepare(c: &Communicator, k: u64, call: Call, s: StreamHandle) -> (Vec<Check>, Launch) {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    let (dt, count, op, root) = (call.dtype, call.count, call.op, call.root);
    let len = count * dt.size();
    let fold = |at: usize, whole: usize| {
        let inputs: Vec<Vec<u8>> = (0..n).map(|p| input(k, p, whole)).collect();
        let srcs: Vec<&[u8]> = inputs.iter().map(|v| &v[at..at + len]).collect();
        let mut out = vec![0u8; len];
        reduce_into(dt, op, &mut out, &srcs).unwrap();
        out
    };
    let put = |b: &Buf, at: usize, bytes: &[u8]| dev.copy_from_host(b.ptr.add(at), bytes).unwrap();
    let check = |buf: Buf, at: usize, want: Vec<u8>| Check { k, call, buf, at, want };
    // The send buffer: the receive buffer itself when in place (`own` is where this rank's
    // input goes in it), else a buffer of its own holding `bytes`.
    let source = |recv: &Buf, own: usize, bytes: &[u8], poison: u64, keep: &mut Vec<Buf>| {
        if call.in_place {
            put(recv, own, bytes);
            recv.ptr.add(own)
        } else {
            let send = Buf::new(&dev, bytes.len(), call.off_send, poison);
            put(&send, 0, bytes);
            let p = send.ptr;
            keep.push(send);
            p
        }
    };
    // Send buffers stay alive (their frees deferred) until the batch is verified.
    let mut keep: Vec<Buf> = Vec::new();
    let (checks, launch): (Vec<Check>, Launch) = match call.kind {
        0 => {
            let recv = Buf::new(&dev, n * len, call.off_recv, 2);
            let sp = source(&recv, r * len, &input(k, r, len), 1, &mut keep);
            let rp = recv.ptr;
            let want: Vec<u8> = (0..n).flat_map(|p| input(k, p, len)).collect();
            (vec![check(recv, 0, want)], Box::new(move |c| c.all_gather(sp, rp, count, dt, s)))
        }
        1 => {
            let recv = Buf::new(&dev, len, call.off_recv, 3);
            let sp = source(&recv, 0, &input(k, r, len), 4, &mut keep);
            let rp = recv.ptr;
            (vec![check(recv, 0, input(k, root, len))], Box::new(move |c| c.broadcast(sp, rp, count, dt, root, s)))
        }
        2 => {
            let send = Buf::new(&dev, n * len, call.off_send, 5);
            let recv = Buf::new(&dev, n * len, call.off_recv, 6);
            put(&send, 0, &input(k, r, n * len));
            let (sp, rp) = (send.ptr, recv.ptr);
            keep.push(send);
            let want: Vec<u8> = (0..n).flat_map(|p| input(k, p, n * len)[r * len..(r + 1) * len].to_vec()).collect();
            (vec![check(recv, 0, want)], Box::new(move |c| c.all_to_all(sp, rp, count, dt, s)))
        }
        3 => {
            let (to, from) = ((r + call.shift) % n, (r + n - call.shift) % n);
            let send = Buf::new(&dev, len, call.off_send, 7);
            let recv = Buf::new(&dev, len, call.off_recv, 8);
            put(&send, 0, &input(k, r, len));
            let (sp, rp) = (send.ptr, recv.ptr);
            keep.push(send);
            let launch: Launch = Box::new(move |c| {
                c.group(|c| {
                    c.send(sp, count, dt, to, s)?;
                    c.recv(rp, count, dt, from, s)
                })
            });
            (vec![check(recv, 0, input(k, from, len))], launch)
        }
        4 => {
            let recv = Buf::new(&dev, len, call.off_recv, 9);
            let sp = source(&recv, 0, &input(k, r, len), 10, &mut keep);
            let rp = recv.ptr;
            (vec![check(recv, 0, fold(0, len))], Box::new(move |c| c.all_reduce(sp, rp, count, dt, op, s)))
        }
        5 => {
            let send = Buf::new(&dev, n * len, call.off_send, 11);
            put(&send, 0, &input(k, r, n * len));
            let want = fold(r * len, n * len);
            let sp = send.ptr;
            if call.in_place {
                let rp = send.ptr.add(r * len);
                // Only this rank's slot is defined afterwards.
                (vec![check(send, r * len, want)], Box::new(move |c| c.reduce_scatter(sp, rp, count, dt, op, s)))
            } else {
                let recv = Buf::new(&dev, len, call.off_recv, 12);
                let rp = recv.ptr;
                keep.push(send);
                (vec![check(recv, 0, want)], Box::new(move |c| c.reduce_scatter(sp, rp, count, dt, op, s)))
            }
        }
        _ => {
            let recv = Buf::new(&dev, len, call.off_recv, 13);
            let is_root = r == root;
            let sp = if call.in_place && is_root {
                put(&recv, 0, &input(k, r, len));
                recv.ptr
            } else {
                let send = Buf::new(&dev, len, call.off_send, 14);
                put(&send, 0, &input(k, r, len));
                let p = send.ptr;
                keep.push(send);
                p
            };
            let rp = recv.ptr;
            let want = if is_root {
                fold(0, len)
            } else {
                // A non-root's receive buffer is not written.
                (0..len as u64).map(|i| pattern_byte(13, i + recv.off as u64)).collect()
            };
            (vec![check(recv, 0, want)], Box::new(move |c| c.reduce(sp, rp, count, dt, op, root, s)))
        }
    };
    // Dropping a `Buf` defers its free to `free_deferred`, after the batch.
    drop(keep);
    (checks, launch)
}

fn verify(checks: &[Check]) {
    for ch in checks {
        let got = ch.buf.read_all();
        let at = ch.buf.off + ch.at;
        assert!(got[at..at + ch.want.len()] == ch.want[..], "op {} {:?}: wrong result ({} bytes)", ch.k, ch.call, ch.want.len());
        assert_eq!(ch.buf.guard_damage(&got), 0, "op {} {:?}: guard bands", ch.k, ch.call);
    }
}

fn load(b: Backend) {
    let ops = if full() { FULL_OPS } else { CI_OPS };
    let large = if full() { 2 << 20 } else { 200_000 };
    let cfgs = configs();
    // groups[engine][rank] -> per rank, one bootstrap per engine.
    let mut per_rank: Vec<Vec<ThreadBootstrap>> = (0..RANKS).map(|_| Vec::new()).collect();
    for _ in &cfgs {
        for (r, bs) in ThreadBootstrap::group_with_timeout(RANKS, Duration::from_secs(30)).into_iter().enumerate() {
            per_rank[r].push(bs);
        }
    }
    let t0 = Instant::now();
    let hs: Vec<_> = per_rank
        .into_iter()
        .enumerate()
        .map(|(r, bss)| {
            let cfgs = cfgs.clone();
            std::thread::Builder::new()
                .name(format!("rank{r}"))
                .spawn(move || {
                    let dev = open_device(b, r);
                    let comms: Vec<Communicator> = bss
                        .into_iter()
                        .zip(cfgs)
                        .map(|(bs, cfg)| Communicator::with_bootstrap(Box::new(bs), Some(dev.clone()), cfg).expect("communicator"))
                        .collect();
                    for c in &comms {
                        c.reserve_reduce_scratch().unwrap();
                    }
                    body(&dev, &comms, ops, large);
                })
                .unwrap()
        })
        .collect();
    let failed: Vec<usize> = hs.into_iter().enumerate().filter_map(|(r, h)| h.join().is_err().then_some(r)).collect();
    assert!(failed.is_empty(), "ranks {failed:?} failed");
    eprintln!("{ops} random ops on {RANKS} ranks in {:?}", t0.elapsed());
}

fn body(dev: &Arc<dyn Device>, comms: &[Communicator], ops: usize, large: usize) {
    let n = comms[0].size();
    let streams: Vec<StreamHandle> = (0..STREAMS).map(|_| dev.create_stream().unwrap()).collect();
    let mut rng = Rng(0x10ad_2026);
    let mut checks: Vec<Check> = Vec::new();
    // One draw of the batch: its communicator, whether its ops form a group, and each op's
    // number, call and launch.
    type Draw = (usize, bool, Vec<(u64, Call, Launch)>);
    let mut batch: Vec<Draw> = Vec::new();
    let mut k = 0u64;
    while (k as usize) < ops {
        let ci = rng.below(comms.len() as u64) as usize;
        let s = streams[rng.below(STREAMS as u64) as usize];
        let grouped = rng.below(4) == 0;
        let m = if grouped { 2 + rng.below(3) } else { 1 };
        let mut prepared = Vec::new();
        for i in 0..m {
            let call = draw(&mut rng, n, large);
            let (ch, launch) = prepare(&comms[ci], k + i, call, s);
            checks.extend(ch);
            prepared.push((k + i, call, launch));
        }
        k += m;
        batch.push((ci, grouped, prepared));
        if batch.len() == BATCH || k as usize >= ops {
            // Every rank's buffers of the batch exist before any of its ops is pending.
            comms[0].bootstrap().barrier().unwrap();
            for (ci, grouped, prepared) in batch.drain(..) {
                let c = &comms[ci];
                let calls: Vec<(u64, Call)> = prepared.iter().map(|(kk, call, _)| (*kk, *call)).collect();
                let launched = if grouped {
                    c.group(|c| prepared.into_iter().try_for_each(|(_, _, launch)| launch(c)))
                } else {
                    prepared.into_iter().try_for_each(|(_, _, launch)| launch(c))
                };
                launched.unwrap_or_else(|e| panic!("ops {calls:?}: {e}"));
            }
            for s in &streams {
                sync(dev, *s);
            }
            for c in comms {
                c.wait_idle().unwrap();
            }
            // Reading results back (synchronous copies) and freeing wait until no rank has
            // an op of the batch pending, nor a peer copying into this rank's buffers.
            comms[0].bootstrap().barrier().unwrap();
            verify(&checks);
            checks.clear();
            free_deferred();
        }
    }
    for c in comms {
        quiesce(c);
    }
    for s in streams {
        dev.destroy_stream(s).unwrap();
    }
}

backend_tests!(load);
