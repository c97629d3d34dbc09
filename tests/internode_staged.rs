//! The staged inter-node path (`src/comm/internode.rs`): AllGather, AlltoAll, AlltoAllv,
//! Broadcast, Gather and Scatter across 2 and 4 virtual nodes of 1–4 thread ranks, even and
//! uneven, with and without forwarding peers (`HOCCL_FORWARDING_PEERS`: pairs, and several
//! ranks through one), through slots
//! small enough that large flows take many steps, against references computed from the
//! inputs; the direct path (`HOCCL_FORWARDING=0`) on the same draws; a rank that forwards
//! through its peer receives nothing straight from another node; the default choice of
//! path (size floor, predicted gain); flows split over several NIC pairs; two streams
//! sharing the staging. The same
//! bodies run on CUDA with `--ignored`.
mod common;
use common::ops::{Op, OPS};
use common::*;

use hoccl::comm::Communicator;
use hoccl::config::EngineChoice;
use hoccl::{Config, DataType};

/// Byte `i` of rank `r`'s send buffer in round `it`.
fn byte(it: u64, r: usize, i: usize) -> u8 {
    let x = (i as u64).wrapping_mul(0x9E37_79B9).wrapping_add(it.wrapping_mul(1_000_003) ^ (r as u64) << 40);
    (x ^ (x >> 13) ^ (x >> 29)) as u8
}

fn data(it: u64, r: usize, len: usize) -> Vec<u8> {
    (0..len).map(|i| byte(it, r, i)).collect()
}

/// The collectives the staged path takes.
fn staged_ops() -> impl Iterator<Item = Op> + Clone {
    OPS.into_iter().filter(|o| matches!(o, Op::AllGather | Op::AllToAll | Op::AllToAllV | Op::Broadcast | Op::Gather | Op::Scatter))
}

/// Element counts: 0, 1, small, and large enough to take many slots of 16 KiB.
fn count(rng: &mut Rng) -> usize {
    match rng.below(6) {
        0 => 0,
        1 => 1,
        2 => 20_000 + rng.below(60_000) as usize,
        _ => rng.below(5_000) as usize | 1,
    }
}

/// One op of round `it`: every rank draws the same shape from `rng` and its own offsets,
/// runs it on `s` (not synchronized) and returns the check to run after the stream's work.
/// `fixed`: the count and root instead of drawn ones.
fn start(c: &Communicator, op: Op, dt: DataType, it: u64, rng: &mut Rng, fixed: Option<(usize, usize)>, s: hoccl::device::StreamHandle) -> impl FnOnce() {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    let es = dt.size();
    let drawn = (count(rng), rng.below(n as u64) as usize);
    let (cnt, root) = fixed.unwrap_or(drawn);
    // AlltoAllv: every pair's count from the shared draw, some zero.
    let pair: Vec<Vec<usize>> = (0..n).map(|_| (0..n).map(|_| if rng.below(3) == 0 { 0 } else { count(rng) / 3 }).collect()).collect();
    let mut mine = Rng(it * 7919 + r as u64);
    let off = move |m: &mut Rng| m.below(48) as usize * es;
    let what = format!("{op:?} round {it} n {n} count {cnt} {dt:?} root {root}");
    let b = cnt * es;
    // (send length, receive length, expected receive bytes by range)
    let (slen, rlen, want): (usize, usize, Vec<(usize, Vec<u8>)>) = match op {
        Op::AllGather => (b, n * b, (0..n).map(|p| (p * b, data(it, p, b))).collect()),
        Op::AllToAll => (n * b, n * b, (0..n).map(|p| (p * b, data(it, p, n * b)[r * b..(r + 1) * b].to_vec())).collect()),
        Op::Broadcast => (b, b, vec![(0, data(it, root, b))]),
        Op::Gather => (b, n * b, if r == root { (0..n).map(|p| (p * b, data(it, p, b))).collect() } else { Vec::new() }),
        Op::Scatter => (n * b, b, vec![(0, data(it, root, n * b)[r * b..(r + 1) * b].to_vec())]),
        Op::AllToAllV => {
            // Displacements with gaps of 2 elements; rank p's block for r sits at its displacement.
            let displs = |v: Vec<usize>| v.iter().scan(0, |a, x| { let d = *a; *a += x + 2; Some(d) }).collect::<Vec<_>>();
            let rd = displs((0..n).map(|p| pair[p][r]).collect());
            let want = (0..n)
                .map(|p| {
                    let psd = displs(pair[p].clone())[r];
                    (rd[p] * es, data(it, p, (psd + pair[p][r]) * es)[psd * es..].to_vec())
                })
                .collect();
            let sd = displs(pair[r].clone());
            ((sd[n - 1] + pair[r][n - 1] + 2) * es, (rd[n - 1] + pair[n - 1][r] + 2) * es, want)
        }
        Op::SendRecv | Op::AllReduce | Op::ReduceScatter | Op::Reduce => panic!("{op:?} is not a staged collective"),
    };
    let send = Buf::new(&dev, slen, off(&mut mine), 1);
    let recv = Buf::new(&dev, rlen, off(&mut mine), 2);
    dev.copy_from_host(send.ptr, &data(it, r, slen)).unwrap();
    match op {
        Op::AllGather => c.all_gather(send.ptr, recv.ptr, cnt, dt, s),
        Op::AllToAll => c.all_to_all(send.ptr, recv.ptr, cnt, dt, s),
        Op::Broadcast => c.broadcast(send.ptr, recv.ptr, cnt, dt, root, s),
        Op::Gather => c.gather(send.ptr, recv.ptr, cnt, dt, root, s),
        Op::Scatter => c.scatter(send.ptr, recv.ptr, cnt, dt, root, s),
        Op::AllToAllV => {
            let sc: Vec<usize> = pair[r].clone();
            let rc: Vec<usize> = (0..n).map(|p| pair[p][r]).collect();
            let displs = |v: &[usize]| v.iter().scan(0, |a, x| { let d = *a; *a += x + 2; Some(d) }).collect::<Vec<_>>();
            c.all_to_allv(send.ptr, &sc, &displs(&sc), recv.ptr, &rc, &displs(&rc), dt, s)
        }
        Op::SendRecv | Op::AllReduce | Op::ReduceScatter | Op::Reduce => unreachable!("refused above"),
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    move || {
        let got = recv.read_all();
        for (at, w) in &want {
            let at = recv.off + at;
            assert!(got[at..at + w.len()] == w[..], "{what}: {} bytes at {at} on rank {r}", w.len());
        }
        if !matches!(op, Op::AllToAllV) && !want.is_empty() {
            assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
        }
        drop(send);
    }
}

/// `ranks` thread ranks on `nodes` virtual nodes under `cfg`, every op `rounds` times.
fn every_op_with(b: Backend, nodes: usize, ranks: usize, cfg: Config, seed: u64) {
    let cfg = Config { virtual_nodes: nodes, reduce_scratch: 1 << 20, ..cfg };
    run_ranks(b, ranks, cfg, move |c| {
        assert_eq!(c.topology().nnodes(), nodes);
        let (dev, s) = (c.device().clone(), new_stream(c.device()));
        let mut rng = Rng(seed);
        for (i, op) in staged_ops().chain(staged_ops()).enumerate() {
            quiesce(c);
            let it = seed * 100 + i as u64;
            let dt = if c.config().engine == EngineChoice::Compressed || it % 2 == 1 { DataType::BF16 } else { DataType::I32 };
            let check = start(c, op, dt, it, &mut rng, None, s);
            sync(&dev, s);
            check();
        }
        c.wait_idle().unwrap();
    });
}

/// The staged path over the verbs transport (`HOCCL_NET=ib`, the in-memory test fabric),
/// with and without forwarding peers.
#[test]
fn staged_over_verbs() {
    let verbs = |cfg: Config| Config { net: hoccl::config::NetChoice::Ib, verbs_fake: true, qps_per_peer: 2, ..cfg };
    every_op_with(Backend::Host, 2, 4, verbs(fwd_config(&[])), 61);
    every_op_with(Backend::Host, 4, 4, verbs(fwd_config(&[])), 62);
    every_op_with(Backend::Host, 2, 3, verbs(Config { forwarding: false, ..fwd_config(&[]) }), 63);
}

fn fwd_config(peers: &[usize]) -> Config {
    // 16 KiB slots: a large flow takes many steps through them.
    // Every call staged, however small and whatever the prediction.
    Config { forwarding_peers: peers.to_vec(), forward_staging_bytes: 64 << 10, stage_every_call: true, engine: EngineChoice::CopyEngine, ..test_config() }
}

/// 2 and 4 nodes, 2–8 ranks, even and uneven, identity forwarding (virtual nodes carry no
/// NIC information).
fn staged_identity(b: Backend) {
    for (nodes, ranks, seed) in [(2, 2, 1), (2, 3, 2), (2, 4, 3), (4, 4, 4), (2, 5, 5), (4, 7, 6), (4, 8, 7)] {
        every_op_with(b, nodes, ranks, fwd_config(&[]), seed);
    }
}

/// Forwarding pairs (and a rank that forwards through itself) on 2 and 4 nodes, and
/// several ranks through one forwarder (`0,0`; `0,0,2`), the form NIC affinity gives.
fn staged_forwarding(b: Backend) {
    let maps = [(2, 4, &[1, 0][..], 11), (2, 6, &[1, 0, 2][..], 12), (4, 8, &[1, 0][..], 13), (2, 8, &[1, 0, 3, 2][..], 14), (2, 4, &[0, 0][..], 15), (2, 6, &[0, 0, 2][..], 16)];
    for (nodes, ranks, peers, seed) in maps {
        every_op_with(b, nodes, ranks, fwd_config(peers), seed);
    }
}

/// The compressed engine on the staged path: bf16 pieces cross compressed.
fn staged_compressed(b: Backend) {
    every_op_with(b, 2, 4, Config { engine: EngineChoice::Compressed, ..fwd_config(&[1, 0]) }, 21);
}

/// The direct path on the same draws.
fn direct(b: Backend) {
    for (nodes, ranks, seed) in [(2, 4, 11), (4, 7, 6)] {
        every_op_with(b, nodes, ranks, Config { forwarding: false, ..fwd_config(&[]) }, seed);
    }
}

/// Ops rank 0 enqueued with each rank of the other node during one Gather to rank 0 on 2
/// nodes × 3 ranks, local ranks 0 and 1 forwarding through each other (`1,0,2`).
/// `cnt`: i32 elements per rank.
fn ops_to_other_node(b: Backend, forwarding: bool, cnt: usize) -> Vec<u64> {
    let out = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let o = out.clone();
    let cfg = Config { virtual_nodes: 2, forwarding, forward_balance: false, ..fwd_config(&[1, 0, 2]) };
    run_ranks(b, 6, cfg, move |c| {
        let mut rng = Rng(5);
        let s = new_stream(c.device());
        let check = start(c, Op::Gather, DataType::I32, 1, &mut rng, Some((cnt, 0)), s);
        sync(c.device(), s);
        check();
        c.wait_idle().unwrap();
        if c.rank() == 0 {
            *o.lock().unwrap() = (3..6).map(|p| c.ops_with(p).unwrap()).collect();
        }
    });
    let v = out.lock().unwrap().clone();
    v
}

/// Rank 0 receives from the other node only through its forwarder (rank 1) when routes
/// keep their forwarders' NICs (`forward_balance` off); the direct path receives from
/// every remote rank.
fn forwarder_carries_the_traffic(b: Backend) {
    assert_eq!(ops_to_other_node(b, true, 30_000), vec![0, 0, 0], "staged: rank 0 receives through rank 1");
    assert!(ops_to_other_node(b, false, 30_000).iter().all(|x| *x > 0), "direct: rank 0 receives from every remote rank");
}

/// Runs `body` on `ranks` thread ranks under `cfg`, then `count` on rank 0 once it is idle.
fn count_on_rank0(b: Backend, ranks: usize, cfg: Config, body: impl Fn(&Communicator) + Send + Sync + 'static, count: fn(&Communicator) -> hoccl::Result<u64>) -> u64 {
    let out = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
    let o = out.clone();
    run_ranks(b, ranks, cfg, move |c| {
        body(c);
        c.wait_idle().unwrap();
        if c.rank() == 0 {
            o.store(count(c).unwrap(), std::sync::atomic::Ordering::Relaxed);
        }
    });
    out.load(std::sync::atomic::Ordering::Relaxed)
}

/// Calls of one `op` with `cnt` i32 elements on `nodes` virtual nodes of `ranks` ranks
/// under the default choice of path that ran staged, as rank 0 counts them.
fn staged_under_default(b: Backend, nodes: usize, ranks: usize, op: Op, cnt: usize) -> u64 {
    let cfg = Config { virtual_nodes: nodes, engine: EngineChoice::CopyEngine, ..test_config() };
    let body = move |c: &Communicator| {
        let s = new_stream(c.device());
        let check = start(c, op, DataType::I32, 3, &mut Rng(9), Some((cnt, 0)), s);
        sync(c.device(), s);
        check();
    };
    count_on_rank0(b, ranks, cfg, body, Communicator::staged_calls)
}

/// The default choice: below one socket chunk per flow, direct; an AllGather over nodes of
/// two ranks, which the plan fans out on arrival (predicted 0.5 of direct), staged; a
/// uniform AlltoAll with one rank per node, the same bytes either way, direct.
fn default_choice(b: Backend) {
    assert_eq!(Config::default().staged_min_flow_bytes, 512 << 10);
    assert_eq!(staged_under_default(b, 2, 4, Op::AllGather, 30_000), 0, "120 KB blocks: direct");
    assert_eq!(staged_under_default(b, 2, 4, Op::AllGather, 200_000), 1, "800 KB blocks, fan-out: staged");
    assert_eq!(staged_under_default(b, 4, 4, Op::AllToAll, 200_000), 0, "uniform, one rank per node: direct");
}

/// AlltoAllv and AllGather on nodes whose every rank may carry routes
/// (`HOCCL_FORWARD_BALANCE`, the default): the skewed AlltoAllv counts split flows over
/// several NIC pairs in some calls, and every byte still lands where the reference puts it.
/// Returns the calls whose plan split a flow, as rank 0 counts them.
fn split_calls(b: Backend, nodes: usize, ranks: usize, peers: &'static [usize], seed: u64) -> u64 {
    let cfg = Config { virtual_nodes: nodes, ..fwd_config(peers) };
    let body = move |c: &Communicator| {
        let (dev, s) = (c.device().clone(), new_stream(c.device()));
        let mut rng = Rng(seed);
        for i in 0..10u64 {
            quiesce(c);
            let it = seed * 100 + i;
            let (op, dt) = if i % 5 == 4 { (Op::AllGather, DataType::BF16) } else { (Op::AllToAllV, if i % 2 == 0 { DataType::I32 } else { DataType::BF16 }) };
            let check = start(c, op, dt, it, &mut rng, None, s);
            sync(&dev, s);
            check();
        }
    };
    count_on_rank0(b, ranks, cfg, body, Communicator::staged_split_calls)
}

/// Splits on 2 and 4 nodes, with identity and paired forwarding; at least one call splits.
fn staged_split(b: Backend) {
    let runs = [(2, 4, &[][..], 31), (2, 6, &[1, 0, 2][..], 32), (4, 8, &[][..], 33), (2, 8, &[1, 0, 3, 2][..], 34)];
    let splits: Vec<u64> = runs.iter().map(|&(nodes, ranks, peers, seed)| split_calls(b, nodes, ranks, peers, seed)).collect();
    assert!(splits.iter().any(|n| *n > 0), "no staged call split a flow: {splits:?}");
}

/// Two streams of one rank: two staged ops enqueued back to back on different streams share
/// the forwarding staging one after the other. Host backend only: four thread ranks with
/// two waiting streams each exceed CUDA's default waiting-stream limit of the process
/// (`Config::max_waiting_streams`), whose admission would then hold a rank's first op back.
#[test]
fn two_streams() {
    let b = Backend::Host;
    let cfg = Config { virtual_nodes: 2, ..fwd_config(&[1, 0]) };
    run_ranks(b, 4, cfg, |c| {
        let dev = c.device().clone();
        let (s1, s2) = (new_stream(&dev), new_stream(&dev));
        for round in 0..3u64 {
            quiesce(c);
            let mut rng = Rng(40 + round);
            let a = start(c, Op::AllToAll, DataType::I32, 100 + round, &mut rng, Some((20_000, 0)), s1);
            let b2 = start(c, Op::AllGather, DataType::BF16, 200 + round, &mut rng, Some((30_000, 0)), s2);
            sync(&dev, s1);
            sync(&dev, s2);
            a();
            b2();
        }
        c.wait_idle().unwrap();
    });
}

backend_tests!(staged_identity, staged_forwarding, staged_compressed, staged_split, direct, forwarder_carries_the_traffic, default_choice);

/// AlltoAllv counts that disagree between two ranks fail every rank with the same error
/// (the staged path all-gathers the counts before validating), and the communicator goes on.
#[test]
fn alltoallv_count_mismatch_fails_every_rank() {
    let cfg = Config { virtual_nodes: 2, ..fwd_config(&[]) };
    run_ranks(Backend::Host, 3, cfg, |c| {
        let (r, dev) = (c.rank(), c.device().clone());
        let s = new_stream(&dev);
        let (send, recv) = (Buf::new(&dev, 64, 0, 1), Buf::new(&dev, 64, 0, 2));
        // Rank 0 sends 5 elements to rank 2, which expects 4.
        let sc: Vec<usize> = if r == 0 { vec![1, 1, 5] } else { vec![1, 1, 1] };
        let rc: Vec<usize> = if r == 2 { vec![4, 1, 1] } else { vec![1, 1, 1] };
        let displs = [0, 8, 16];
        let e = c.all_to_allv(send.ptr, &sc, &displs, recv.ptr, &rc, &displs, DataType::I32, s).unwrap_err();
        assert_eq!(e.code(), hoccl::ErrorCode::InvalidArgument, "rank {r}: {e}");
        assert!(e.to_string().contains("rank 0 sends 5 elements to rank 2, which expects 4"), "rank {r}: {e}");
        // The next call, with agreeing counts, runs.
        let check = start(c, Op::AllToAllV, DataType::I32, 7, &mut Rng(3), None, s);
        sync(&dev, s);
        check();
        c.wait_idle().unwrap();
    });
}
