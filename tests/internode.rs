//! Ranks on several (virtual) nodes: the ranks of one node talk through the same-host
//! transport, the ranks of different nodes only through the socket transport
//! (`HOCCL_VIRTUAL_NODES` splits this host). Every op and engine against references
//! computed here from the inputs; processes over the TCP bootstrap; a peer killed
//! mid-transfer; the rate limit. The same bodies run on CUDA with `--ignored`.
mod common;
use common::*;
use common::ops::{Op, OPS};

use hoccl::comm::Communicator;
use hoccl::config::EngineChoice;
use hoccl::{Config, DataType, RedOp};

/// Element `i` of rank `r`'s input in round `it`, as an integer every dtype holds exactly
/// (bf16 up to 256): sums of up to 16 ranks stay exact.
fn value(it: u64, r: usize, i: usize) -> u32 {
    ((i as u64).wrapping_mul(2654435761) ^ (it * 31 + r as u64 * 7)) as u32 % 15
}

/// The dtype of a round: bf16 under the compressed engine (so transfers cross compressed),
/// else alternating i32 and bf16.
fn dtype_of(engine: EngineChoice, it: u64) -> DataType {
    if engine == EngineChoice::Compressed || it % 2 == 1 {
        DataType::BF16
    } else {
        DataType::I32
    }
}

fn encode(dt: DataType, v: &[u32]) -> Vec<u8> {
    match dt {
        DataType::I32 => v.iter().flat_map(|x| (*x as i32).to_le_bytes()).collect(),
        DataType::BF16 => v.iter().flat_map(|x| (((*x as f32).to_bits() >> 16) as u16).to_le_bytes()).collect(),
        _ => unreachable!("the tests use i32 and bf16"),
    }
}

fn input(dt: DataType, it: u64, r: usize, count: usize) -> Vec<u8> {
    encode(dt, &(0..count).map(|i| value(it, r, i)).collect::<Vec<_>>())
}

/// Sums of i32, maxima of bf16 (exact either way, whatever the order of the reduction).
fn red_op(dt: DataType) -> RedOp {
    if dt == DataType::BF16 {
        RedOp::Max
    } else {
        RedOp::Sum
    }
}

fn reduced(dt: DataType, it: u64, n: usize, from: usize, count: usize) -> Vec<u8> {
    let v: Vec<u32> = (from..from + count)
        .map(|i| {
            let all = (0..n).map(|p| value(it, p, i));
            if dt == DataType::BF16 {
                all.max().unwrap_or(0)
            } else {
                all.sum()
            }
        })
        .collect();
    encode(dt, &v)
}

fn put(dev: &std::sync::Arc<dyn hoccl::Device>, b: &Buf, bytes: &[u8]) {
    dev.copy_from_host(b.ptr, bytes).unwrap();
}

/// Element counts: 0, 1, odd, and now and then large enough to be cut into chunks over
/// several connections (the socket transport's chunk is 512 KiB).
fn count(rng: &mut Rng, engine: EngineChoice) -> usize {
    match rng.below(8) {
        0 => 0,
        1 => 1,
        2 | 3 => 300_000 + rng.below(200_000) as usize,
        // The compressed engine compresses transfers of 64 KiB or more.
        _ if engine == EngineChoice::Compressed => 40_000 + rng.below(60_000) as usize,
        _ => rng.below(20_000) as usize | 1,
    }
}

/// One round of `op` on communicator `c`; checks this rank's output.
fn round(c: &Communicator, engine: EngineChoice, op: Op, it: u64, rng: &mut Rng) {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    let s = new_stream(&dev);
    let dt = dtype_of(engine, it);
    let es = dt.size();
    let cnt = count(rng, engine);
    let root = rng.below(n as u64) as usize;
    let off = |rng: &mut Rng| rng.below(64) as usize * es;
    // Every rank draws the same shape; the offsets are drawn after, per rank.
    let mut mine = Rng(it * 977 + r as u64);
    let what = format!("{op:?} round {it} n {n} count {cnt} dtype {dt:?} root {root}");
    match op {
        Op::SendRecv => {
            let shift = 1 + rng.below(n.max(2) as u64 - 1) as usize;
            let (to, from) = ((r + shift) % n, (r + n - shift % n) % n);
            let send = Buf::new(&dev, cnt * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, cnt * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, cnt));
            c.group_start().unwrap();
            c.send(send.ptr, cnt, dt, to, s).unwrap();
            c.recv(recv.ptr, cnt, dt, from, s).unwrap();
            c.group_end().unwrap();
            sync(&dev, s);
            let got = recv.read_all();
            assert!(got[recv.off..recv.off + cnt * es] == input(dt, it, from, cnt)[..], "{what}: from rank {from}");
            assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
        }
        Op::AllGather | Op::Gather => {
            let send = Buf::new(&dev, cnt * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, n * cnt * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, cnt));
            if matches!(op, Op::AllGather) {
                c.all_gather(send.ptr, recv.ptr, cnt, dt, s).unwrap();
            } else {
                c.gather(send.ptr, recv.ptr, cnt, dt, root, s).unwrap();
            }
            sync(&dev, s);
            if matches!(op, Op::AllGather) || r == root {
                let got = recv.read_all();
                for p in 0..n {
                    let at = recv.off + p * cnt * es;
                    assert!(got[at..at + cnt * es] == input(dt, it, p, cnt)[..], "{what}: block of rank {p}");
                }
                assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
            }
        }
        Op::AllToAll => {
            let send = Buf::new(&dev, n * cnt * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, n * cnt * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, n * cnt));
            c.all_to_all(send.ptr, recv.ptr, cnt, dt, s).unwrap();
            sync(&dev, s);
            let got = recv.read_all();
            for p in 0..n {
                let want = &input(dt, it, p, n * cnt)[r * cnt * es..(r + 1) * cnt * es];
                let at = recv.off + p * cnt * es;
                assert!(&got[at..at + cnt * es] == want, "{what}: block from rank {p}");
            }
            assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
        }
        Op::AllToAllV => {
            // Uneven: each pair's count drawn from the shared rng (some zero, some large).
            let pair: Vec<Vec<usize>> = (0..n).map(|_| (0..n).map(|_| if rng.below(4) == 0 { 0 } else { count(rng, engine) / 2 }).collect()).collect();
            let sc: Vec<usize> = (0..n).map(|j| pair[r][j]).collect();
            let rc: Vec<usize> = (0..n).map(|j| pair[j][r]).collect();
            let displs = |v: &[usize]| v.iter().scan(0, |a, x| { let d = *a; *a += x + 3; Some(d) }).collect::<Vec<_>>();
            let (sd, rd) = (displs(&sc), displs(&rc));
            let stot = sd.last().unwrap() + sc.last().unwrap() + 3;
            let rtot = rd.last().unwrap() + rc.last().unwrap() + 3;
            let send = Buf::new(&dev, stot * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, rtot * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, stot));
            c.all_to_allv(send.ptr, &sc, &sd, recv.ptr, &rc, &rd, dt, s).unwrap();
            sync(&dev, s);
            let got = recv.read_all();
            for p in 0..n {
                // Rank p sent its elements [its send displacement to r, + count).
                let psd = displs(&(0..n).map(|j| pair[p][j]).collect::<Vec<_>>())[r];
                let src = input(dt, it, p, psd + rc[p]);
                let at = recv.off + rd[p] * es;
                assert!(got[at..at + rc[p] * es] == src[psd * es..], "{what}: {} elements from rank {p}", rc[p]);
            }
        }
        Op::Broadcast | Op::Scatter => {
            let sn = if matches!(op, Op::Scatter) { n * cnt } else { cnt };
            let send = Buf::new(&dev, sn * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, cnt * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, sn));
            if matches!(op, Op::Scatter) {
                c.scatter(send.ptr, recv.ptr, cnt, dt, root, s).unwrap();
            } else {
                c.broadcast(send.ptr, recv.ptr, cnt, dt, root, s).unwrap();
            }
            sync(&dev, s);
            let got = recv.read_all();
            let from = if matches!(op, Op::Scatter) { r * cnt } else { 0 };
            let want = &input(dt, it, root, sn)[from * es..(from + cnt) * es];
            assert!(&got[recv.off..recv.off + cnt * es] == want, "{what}");
            assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
        }
        Op::AllReduce | Op::Reduce => {
            let send = Buf::new(&dev, cnt * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, cnt * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, cnt));
            if matches!(op, Op::AllReduce) {
                c.all_reduce(send.ptr, recv.ptr, cnt, dt, red_op(dt), s).unwrap();
            } else {
                c.reduce(send.ptr, recv.ptr, cnt, dt, red_op(dt), root, s).unwrap();
            }
            sync(&dev, s);
            if matches!(op, Op::AllReduce) || r == root {
                let got = recv.read_all();
                assert!(got[recv.off..recv.off + cnt * es] == reduced(dt, it, n, 0, cnt)[..], "{what}");
                assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
            }
        }
        Op::ReduceScatter => {
            let send = Buf::new(&dev, n * cnt * es, off(&mut mine), 1);
            let recv = Buf::new(&dev, cnt * es, off(&mut mine), 2);
            put(&dev, &send, &input(dt, it, r, n * cnt));
            c.reduce_scatter(send.ptr, recv.ptr, cnt, dt, red_op(dt), s).unwrap();
            sync(&dev, s);
            let got = recv.read_all();
            assert!(got[recv.off..recv.off + cnt * es] == reduced(dt, it, n, r * cnt, cnt)[..], "{what}");
            assert_eq!(recv.guard_damage(&got), 0, "{what}: guard bands");
        }
    }
}

/// `nodes` virtual nodes of `per_node` thread ranks each, every op once.
fn every_op_on(b: Backend, nodes: usize, per_node: usize, engine: EngineChoice, seed: u64) {
    every_op_with(b, nodes, per_node, Config { engine, ..test_config() }, seed);
}

fn every_op_with(b: Backend, nodes: usize, per_node: usize, cfg: Config, seed: u64) {
    let (qps, engine) = (1 + (seed % 3) as usize, cfg.engine);
    let cfg = Config { virtual_nodes: nodes, qps_per_peer: qps, reduce_scratch: 1 << 20, ..cfg };
    run_ranks(b, nodes * per_node, cfg, move |c| {
        assert_eq!(c.topology().nnodes(), nodes);
        let mut rng = Rng(seed);
        for (i, op) in OPS.iter().enumerate() {
            quiesce(c);
            round(c, engine, *op, seed * 100 + i as u64, &mut rng);
        }
        c.wait_idle().unwrap();
    });
}

fn every_op(b: Backend) {
    for (nodes, per_node, seed) in [(2, 1, 1), (2, 2, 2), (3, 1, 3), (4, 1, 4), (2, 3, 5), (4, 2, 6), (3, 2, 7), (2, 4, 8)] {
        every_op_on(b, nodes, per_node, EngineChoice::CopyEngine, seed);
    }
}

fn every_op_compressed(b: Backend) {
    for (nodes, per_node, seed) in [(2, 1, 11), (2, 2, 12), (3, 2, 13)] {
        every_op_on(b, nodes, per_node, EngineChoice::Compressed, seed);
    }
}

fn every_op_auto(b: Backend) {
    for (nodes, per_node, seed) in [(2, 2, 21), (4, 1, 22)] {
        every_op_on(b, nodes, per_node, EngineChoice::Auto, seed);
    }
}

/// The host backend through the staging CUDA uses (pinned slots filled and drained by the
/// copy queues; here ordinary memory and the host backend's queues): 256 KiB of staging,
/// so transfers cycle through its 64 KiB slots.
#[test]
fn every_op_staged() {
    for (nodes, per_node, engine, seed) in [(2, 2, EngineChoice::CopyEngine, 31), (3, 1, EngineChoice::CopyEngine, 32), (2, 2, EngineChoice::Compressed, 33)] {
        let cfg = Config { engine, net_stage_host_memory: true, net_staging_bytes: 256 << 10, ..test_config() };
        every_op_with(Backend::Host, nodes, per_node, cfg, seed);
    }
}

/// The verbs transport between nodes (`HOCCL_NET=ib` over the in-memory test fabric,
/// `HOCCL_VERBS_FAKE=1`): the same rounds, 1–3 queue pairs per peer (on CUDA through the
/// pinned host staging).
fn verbs_config(engine: EngineChoice) -> Config {
    Config { engine, net: hoccl::config::NetChoice::Ib, verbs_fake: true, ..test_config() }
}

fn every_op_verbs(b: Backend) {
    for (nodes, per_node, seed) in [(2, 1, 41), (2, 2, 42), (3, 1, 43), (4, 1, 44), (2, 3, 45), (4, 2, 46)] {
        every_op_with(b, nodes, per_node, verbs_config(EngineChoice::CopyEngine), seed);
    }
    every_op_with(b, 3, 2, verbs_config(EngineChoice::Compressed), 47);
    // Small slots: every large transfer waits for credits.
    every_op_with(b, 2, 2, Config { net_staging_bytes: 64 << 10, ..verbs_config(EngineChoice::CopyEngine) }, 48);
    // auto takes verbs when the test fabric is usable.
    every_op_with(b, 2, 1, Config { net: hoccl::config::NetChoice::Auto, ..verbs_config(EngineChoice::Auto) }, 49);
}

/// The verbs transport through the host staging CUDA uses (here ordinary memory and the
/// host backend's copy queues): 256 KiB of staging and of registered slots, so transfers
/// cycle through both.
#[test]
fn every_op_verbs_staged() {
    for (nodes, per_node, engine, seed) in [(2, 2, EngineChoice::CopyEngine, 51), (3, 1, EngineChoice::CopyEngine, 52), (2, 2, EngineChoice::Compressed, 53), (4, 1, EngineChoice::CopyEngine, 54)] {
        let cfg = Config { net_stage_host_memory: true, net_staging_bytes: 256 << 10, ..verbs_config(engine) };
        every_op_with(Backend::Host, nodes, per_node, cfg, seed);
    }
}

backend_tests!(every_op, every_op_compressed, every_op_auto, every_op_verbs, relays);

/// Over verbs, a rank that aborts its communicator while its AllGather's data crosses
/// (rate-limited so the transfer lasts; directly and through host staging): every survivor
/// fails within the timeout; with one rank per node, the survivor's error names the victim
/// (with more, a survivor may first learn of a failure from another survivor, whose error
/// it names).
#[test]
fn verbs_peer_aborts_mid_transfer() {
    for (nodes, per_node, staged) in [(2, 1, false), (2, 2, false), (2, 2, true)] {
        let n = nodes * per_node;
        let victim = n - 1;
        let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let errs = errors.clone();
        // The victim keeps its buffers until every rank is done (a rank of its node may still
        // be copying into them: thread ranks share the process's memory).
        let end = std::sync::Arc::new(Gate::new(n));
        let cfg = Config { virtual_nodes: nodes, net_gbps: 0.05, timeout: Duration::from_secs(3), net_stage_host_memory: staged, ..verbs_config(EngineChoice::CopyEngine) };
        run_ranks(Backend::Host, n, cfg, move |c| {
            let (r, dev) = (c.rank(), c.device().clone());
            let cnt = 1 << 20;
            let send = Buf::new(&dev, cnt, 0, 1);
            let recv = Buf::new(&dev, n * cnt, 0, 2);
            let s = new_stream(&dev);
            quiesce(c);
            // The victim aborts 10 ms into its second AllGather; the others loop until one fails.
            let mut iter = 0;
            let (e, started) = loop {
                assert!(iter < 100, "rank {r}: no error after {iter} AllGathers");
                let started = Instant::now();
                let r1 = c.all_gather(send.ptr, recv.ptr, cnt, DataType::U8, s);
                if r == victim && iter == 1 {
                    std::thread::sleep(Duration::from_millis(10));
                    c.abort();
                    let _ = dev.synchronize(s);
                    end.wait(Duration::from_secs(30));
                    return;
                }
                dev.synchronize(s).expect("synchronize returns");
                match r1.and_then(|_| c.wait_idle()) {
                    Ok(()) => iter += 1,
                    Err(e) => break (e, started),
                }
            };
            assert!(started.elapsed() < Duration::from_secs(5), "rank {r} failed {:?} after its last AllGather began: {e}", started.elapsed());
            assert!(matches!(e.code(), hoccl::ErrorCode::Remote | hoccl::ErrorCode::Timeout), "rank {r}: {e}");
            errs.lock().unwrap().push((r, c.topology().same_node(r, victim), e.to_string()));
            end.wait(Duration::from_secs(30));
        });
        let errors = errors.lock().unwrap();
        assert_eq!(errors.len(), n - 1, "{errors:?}");
        let named = errors.iter().any(|(_, same, e)| !same && e.contains(&format!("peer rank {victim}")));
        assert!(named || per_node > 1, "the other node's rank does not name rank {victim}: {errors:?}");
        eprintln!("verbs peer abort on {nodes} x {per_node}: {errors:?}");
    }
}

/// Over verbs, an error completion on one rank's channel mid-transfer (the test fabric's
/// injected fault on each rank's 40th send or write): both ranks fail the op within the timeout,
/// each naming the other, and the next op fails at once the same way.
#[test]
fn verbs_error_completion_fails_both_sides() {
    let errors = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let errs = errors.clone();
    let cfg = Config { virtual_nodes: 2, timeout: Duration::from_secs(3), net_staging_bytes: 64 << 10, verbs_fake_fail_at: 40, ..verbs_config(EngineChoice::CopyEngine) };
    run_ranks(Backend::Host, 2, cfg, move |c| {
        let (r, dev) = (c.rank(), c.device().clone());
        let cnt = 1 << 20;
        let send = Buf::new(&dev, cnt, 0, 1);
        let recv = Buf::new(&dev, 2 * cnt, 0, 2);
        let s = new_stream(&dev);
        quiesce(c);
        let mut got = Vec::new();
        for _ in 0..2 {
            let t0 = Instant::now();
            let r1 = c.all_gather(send.ptr, recv.ptr, cnt, DataType::U8, s);
            dev.synchronize(s).expect("synchronize returns");
            let e = r1.and_then(|_| c.wait_idle()).expect_err("the AllGather fails");
            assert!(t0.elapsed() < Duration::from_secs(5), "rank {r} failed after {:?}: {e}", t0.elapsed());
            got.push((e.code(), e.to_string()));
        }
        errs.lock().unwrap().push((r, got));
    });
    // 1 MiB through slots of at most 16 KiB takes more than 40 writes.
    let errors = errors.lock().unwrap();
    assert_eq!(errors.len(), 2);
    for (r, got) in errors.iter() {
        for (code, e) in got {
            assert!(*code == hoccl::ErrorCode::Remote && e.contains(&format!("peer rank {}", 1 - r)), "rank {r}: {e}");
        }
    }
    let text = format!("{errors:?}");
    assert!(text.contains("channel failed"), "no rank says the channel failed: {text}");
    eprintln!("verbs error completion: {errors:?}");
}

// ================================================================ processes ============

use hoccl::bootstrap::tcp::UniqueId;
use std::io::BufRead;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A child process's line to the parent.
fn say(rank: usize, what: &str) {
    println!("internode-child {rank} {} {what}", unix_ms());
}

/// The body of a child process (a no-op unless the parent set `HOCCL_INTERNODE_CHILD` =
/// `<unique id> <rank> <ranks> <role>`): `every` runs every op once, `kill` loops large
/// AllGathers until one fails (the victim announces each finished one, then waits to be
/// killed in the next).
#[test]
fn child_rank() {
    let Ok(v) = std::env::var("HOCCL_INTERNODE_CHILD") else { return };
    let w: Vec<&str> = v.split_whitespace().collect();
    let id = UniqueId::from_hex(w[0]).expect("id");
    let (rank, n): (usize, usize) = (w[1].parse().unwrap(), w[2].parse().unwrap());
    let role = w[3];
    let cfg = Config::from_env().expect("HOCCL_* settings");
    let engine = cfg.engine;
    let backend = if std::env::var("HOCCL_BACKEND").is_ok_and(|b| b == "cuda") { Backend::Cuda } else { Backend::Host };
    let dev = open_device(backend, rank);
    let c = Communicator::from_unique_id_on(&id, n, rank, Some(dev.clone()), cfg).expect("communicator");
    assert!(c.topology().nnodes() > 1);
    if role == "every" {
        let mut rng = Rng(77);
        for (i, op) in OPS.iter().enumerate() {
            quiesce(&c);
            round(&c, engine, *op, 7700 + i as u64, &mut rng);
        }
        c.wait_idle().unwrap();
        say(rank, "done");
        return;
    }
    if role == "relay" {
        // Grouped sends of the default floor's sizes, relayed through the forwarding peer.
        let via = c.topology().ranks()[rank].forwarding_peer != rank;
        let mut rng = Rng(78);
        let (mut out, mut inn) = (0, 0);
        for it in 0..6 {
            let (o, i) = p2p_round(&c, if it % 2 == 0 { DataType::I32 } else { DataType::BF16 }, 7800 + it, &mut rng, via, c.config().staged_min_flow_bytes);
            (out, inn) = (out + o, inn + i);
        }
        quiesce(&c);
        let got = c.relay_counts();
        assert_eq!((got.handed, got.recv_handed), (out, inn), "rank {rank}: sends and receives handed to the forwarding peer");
        say(rank, &format!("relays handed {} refused {} carried {} landed {}", got.handed + got.recv_handed, got.refused + got.recv_refused, got.carried, got.recv_carried));
        c.wait_idle().unwrap();
        say(rank, "done");
        return;
    }
    if let Some(v) = role.strip_prefix("relaykill:") {
        relay_until_killed(&c, &dev, v.parse().unwrap());
        return;
    }
    let victim: usize = role.strip_prefix("kill:").expect("role").parse().unwrap();
    let cnt = 4 << 20;
    let send = Buf::new(&dev, cnt, 0, 1);
    let recv = Buf::new(&dev, n * cnt, 0, 2);
    let s = new_stream(&dev);
    let t0 = Instant::now();
    for iter in 0.. {
        assert!(t0.elapsed() < Duration::from_secs(30), "rank {rank}: no error after {iter} AllGathers");
        if rank == victim && iter == 1 {
            say(rank, "point");
        }
        let r = c.all_gather(send.ptr, recv.ptr, cnt, DataType::U8, s);
        dev.synchronize(s).expect("synchronize returns");
        match r.and_then(|_| c.wait_idle()) {
            Ok(()) => {}
            Err(e) => {
                assert_ne!(rank, victim, "the victim failed: {e}");
                assert!(matches!(e.code(), hoccl::ErrorCode::Remote | hoccl::ErrorCode::Timeout), "{e}");
                say(rank, &format!("error {:?} {e}", e.code()));
                break;
            }
        }
    }
    c.abort();
    drop(c);
    free_deferred();
    say(rank, "done");
}

/// Run `n` child processes of this test binary with `role` and `env`; kill `victim` (if
/// any) a little after it says `point`. Returns each child's lines, and when the victim was
/// killed (Unix ms).
fn children(n: usize, role: &str, env: &[(&str, &str)], victim: Option<usize>) -> (Vec<Vec<String>>, Option<u64>) {
    children_on(Backend::Host, n, role, env, victim)
}

/// As `children`, on `backend` (CUDA: every child opens GPU `rank % count`; on one GPU run
/// them under MPS).
fn children_on(backend: Backend, n: usize, role: &str, env: &[(&str, &str)], victim: Option<usize>) -> (Vec<Vec<String>>, Option<u64>) {
    let id = Communicator::unique_id(&test_config()).expect("unique id");
    let exe = std::env::current_exe().expect("test binary");
    let (tx, rx) = std::sync::mpsc::channel::<(usize, String)>();
    let mut kids: Vec<Option<Child>> = (0..n)
        .map(|r| {
            let mut cmd = Command::new(&exe);
            cmd.args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env("HOCCL_INTERNODE_CHILD", format!("{} {r} {n} {role}", id.to_hex()))
                .env("HOCCL_BACKEND", if backend == Backend::Cuda { "cuda" } else { "host" })
                .stdout(Stdio::piped())
                .stderr(Stdio::inherit());
            for (k, v) in env {
                cmd.env(k, v);
            }
            let mut k = cmd.spawn().expect("spawn child rank");
            let out = k.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((r, l));
                }
            });
            Some(k)
        })
        .collect();
    drop(tx);
    let mut lines = vec![Vec::new(); n];
    let mut killed = None;
    let start = Instant::now();
    let mut status = vec![None; n];
    while (0..n).any(|r| status[r].is_none()) && start.elapsed() < Duration::from_secs(50) {
        if let Ok((r, l)) = rx.recv_timeout(Duration::from_millis(5)) {
            if Some(r) == victim && killed.is_none() && l.contains(" point") {
                std::thread::sleep(Duration::from_millis(15));
                let mut k = kids[r].take().unwrap();
                k.kill().expect("SIGKILL the victim");
                killed = Some(unix_ms());
                status[r] = Some(k.wait().expect("reap"));
            }
            lines[r].push(l);
        }
        for r in 0..n {
            if status[r].is_none() {
                status[r] = kids[r].as_mut().and_then(|k| k.try_wait().expect("try_wait"));
            }
        }
    }
    for k in kids.iter_mut().flatten() {
        let _ = k.kill();
        let _ = k.wait();
    }
    for (r, l) in rx.try_iter() {
        lines[r].push(l);
    }
    for r in (0..n).filter(|r| Some(*r) != victim) {
        let st = status[r].unwrap_or_else(|| panic!("rank {r} still running: {:?}", lines));
        assert!(st.success(), "rank {r} exited with {st}: {:?}", lines[r]);
        assert!(lines[r].iter().any(|l| l.ends_with(" done")), "rank {r} did not finish: {:?}", lines[r]);
    }
    (lines, killed)
}

/// Processes over the TCP bootstrap: 2 virtual nodes x 2 ranks (same-host transport inside
/// a node, sockets between), then 3 x 1; every op, `ce` and `compressed`.
#[test]
fn processes_every_op() {
    children(4, "every", &[("HOCCL_VIRTUAL_NODES", "2"), ("HOCCL_ENGINE", "ce"), ("HOCCL_QPS_PER_PEER", "3")], None);
    children(3, "every", &[("HOCCL_VIRTUAL_NODES", "3"), ("HOCCL_ENGINE", "compressed")], None);
}

/// The same on CUDA (`--ignored`; scripts/gpu/internode.sh runs it under MPS): 2 virtual
/// nodes x 1 and x 2 ranks, every op, `ce` and `compressed`, through the pinned staging.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_processes_every_op() {
    for engine in ["ce", "compressed"] {
        children_on(Backend::Cuda, 2, "every", &[("HOCCL_VIRTUAL_NODES", "2"), ("HOCCL_ENGINE", engine)], None);
        children_on(Backend::Cuda, 4, "every", &[("HOCCL_VIRTUAL_NODES", "2"), ("HOCCL_ENGINE", engine), ("HOCCL_NET_STAGING", "1M")], None);
    }
}

/// A rank SIGKILLed while its AllGather's data crosses the sockets (rate-limited so the
/// transfer lasts): every survivor, on its node and on the other, fails within the timeout.
#[test]
fn peer_killed_mid_transfer() {
    killed_mid_transfer(Backend::Host);
}

/// The same on CUDA (`--ignored`; on one GPU under MPS): the victim's chunks pass through
/// pinned staging and the survivors' copy queues when it dies.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_peer_killed_mid_transfer() {
    killed_mid_transfer(Backend::Cuda);
}

fn killed_mid_transfer(backend: Backend) {
    const TMO_MS: u64 = 3000;
    let env = [("HOCCL_VIRTUAL_NODES", "2"), ("HOCCL_NET_GBPS", "0.5"), ("HOCCL_TIMEOUT_MS", "3000"), ("HOCCL_ENGINE", "ce")];
    let (lines, killed) = children_on(backend, 4, "kill:2", &env, Some(2));
    survivors_failed(&lines, &[0, 1, 3], killed.expect("the victim reached its kill point"), TMO_MS, "peer killed");
}

/// Each of `survivors` reported an error within `tmo_ms` (and a second of slack) of the
/// kill at `killed` (Unix ms); returns their error lines.
fn survivors_failed<'a>(lines: &'a [Vec<String>], survivors: &[usize], killed: u64, tmo_ms: u64, what: &str) -> Vec<&'a String> {
    let mut errors = Vec::new();
    for &r in survivors {
        let l = lines[r].iter().find(|l| l.contains(" error ")).unwrap_or_else(|| panic!("rank {r} saw no error: {:?}", lines[r]));
        // The test harness may print its "test child_rank ... " before the line.
        let at = l.find("internode-child ").expect("a child's line");
        let t: u64 = l[at..].split_whitespace().nth(2).unwrap().parse().unwrap();
        eprintln!("{what}: rank {r} failed {} ms after the kill: {l}", t as i64 - killed as i64);
        assert!(t <= killed + tmo_ms + 1000, "rank {r} failed {} ms after the kill: {l}", t as i64 - killed as i64);
        errors.push(l);
    }
    errors
}

// ================================================================ settings =============

/// `HOCCL_NET_GBPS` bounds the rate: 16 MiB between two nodes at 0.25 GB/s take at least
/// ~65 ms (67 ms at exactly the rate, less its 2 ms burst), whatever the unlimited rate.
#[test]
fn rate_limit_bounds_throughput() {
    for verbs in [false, true] {
        let unlimited = send_16mib(0.0, verbs);
        let limited = send_16mib(0.25, verbs);
        eprintln!("16 MiB between two virtual nodes (verbs {verbs}): {unlimited:?} unlimited, {limited:?} at HOCCL_NET_GBPS=0.25");
        assert!(limited >= Duration::from_millis(60), "16 MiB crossed in {limited:?}: faster than 0.25 GB/s");
        assert!(limited < Duration::from_secs(5), "16 MiB took {limited:?} at a 0.25 GB/s limit");
    }
}

/// How long 16 MiB take from rank 0 to rank 1 of another virtual node at `gbps` (the
/// slower rank's time), over sockets or `verbs` (the test fabric).
fn send_16mib(gbps: f64, verbs: bool) -> Duration {
    let base = if verbs { verbs_config(EngineChoice::CopyEngine) } else { test_config() };
    let cfg = Config { virtual_nodes: 2, net_gbps: gbps, engine: EngineChoice::CopyEngine, ..base };
    let took = std::sync::Arc::new(std::sync::Mutex::new(Duration::ZERO));
    let t2 = took.clone();
    run_ranks(Backend::Host, 2, cfg, move |c| {
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let len = 16 << 20;
        let b = Buf::new(&dev, len, 0, 3);
        quiesce(c);
        let t = Instant::now();
        if c.rank() == 0 {
            c.send(b.ptr, len, DataType::U8, 1, s).unwrap();
        } else {
            c.recv(b.ptr, len, DataType::U8, 0, s).unwrap();
        }
        sync(&dev, s);
        let el = t.elapsed();
        let mut g = t2.lock().unwrap();
        *g = (*g).max(el);
    });
    let t = *took.lock().unwrap();
    t
}

/// `HOCCL_NET=ib` across nodes without a usable verbs device is refused on every rank,
/// naming the rank and why; ranks that disagree (one requires verbs, one takes sockets) are
/// refused naming the one that takes sockets; under `auto`, one rank without verbs makes
/// every rank take sockets.
#[test]
fn ib_is_refused_with_the_reason() {
    logs::capture();
    let no_device = hoccl::rdma::usable(None, 3, false).is_err();
    let create = |cfgs: [Config; 2]| -> Vec<Option<String>> {
        let hs: Vec<_> = hoccl::bootstrap::thread::ThreadBootstrap::group_with_timeout(2, Duration::from_secs(10))
            .into_iter()
            .zip(cfgs)
            .enumerate()
            .map(|(r, (b, cfg))| std::thread::spawn(move || Communicator::with_bootstrap(Box::new(b), Some(open_device(Backend::Host, r)), cfg).err().map(|e| e.to_string())))
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    };
    if no_device {
        let cfg = || Config { virtual_nodes: 2, net: hoccl::config::NetChoice::Ib, verbs_fake: false, ..test_config() };
        for (r, e) in create([cfg(), cfg()]).into_iter().enumerate() {
            let e = e.expect("creation fails");
            assert!(e.contains("HOCCL_NET=ib") && e.contains(&format!("rank {r}:")) && e.contains("no usable RDMA device"), "{e}");
        }
    }
    let ib = Config { virtual_nodes: 2, ..verbs_config(EngineChoice::CopyEngine) };
    let socket = Config { net: hoccl::config::NetChoice::Socket, ..ib.clone() };
    for e in create([ib.clone(), socket]) {
        let e = e.expect("creation fails");
        assert!(e.contains("peer rank 1") && e.contains("requires verbs"), "{e}");
    }
    // auto on both, verbs usable on one only: both take sockets.
    if no_device {
        let auto = Config { net: hoccl::config::NetChoice::Auto, ..ib };
        let plain = Config { verbs_fake: false, ..auto.clone() };
        assert_eq!(create([auto, plain]), vec![None, None]);
    }
}

// ================================================================ relays ================

/// One round of point-to-point sends in a group: every rank sends to one to three peers
/// (drawn alike on every rank: the draw is the whole matrix), some on its node, most on
/// others, 0 to ~1.2 MB each at random offsets, and receives what is sent to it; checked
/// against the senders' inputs with guard bands. Returns how many of this rank's sends and
/// receives go through its forwarding peer (`relay_via`: it has one other than itself;
/// `floor`: the least length relayed).
fn p2p_round(c: &Communicator, dt: DataType, it: u64, rng: &mut Rng, relay_via: bool, floor: usize) -> (u64, u64) {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    let es = dt.size();
    let mut sends: Vec<(usize, usize, usize)> = Vec::new(); // (from, to, count)
    for u in 0..n {
        for _ in 0..1 + rng.below(3) {
            let v = (u + 1 + rng.below(n as u64 - 1) as usize) % n;
            let cnt = match rng.below(5) {
                0 => 0,
                1 => rng.below(100) as usize | 1,
                _ => rng.below((1_200_000 / es) as u64) as usize,
            };
            sends.push((u, v, cnt));
        }
    }
    let s = new_stream(&dev);
    let mut mine = Rng(it * 7919 + r as u64);
    let bufs: Vec<(usize, Buf)> = sends.iter().enumerate().filter(|(_, x)| x.0 == r || x.1 == r).map(|(j, &(u, _, cnt))| {
        let b = Buf::new(&dev, cnt * es, mine.below(64) as usize * es, if u == r { 1 } else { 2 });
        if u == r {
            put(&dev, &b, &input(dt, it * 64 + j as u64, r, cnt));
        }
        (j, b)
    }).collect();
    quiesce(c);
    c.group_start().unwrap();
    for (j, b) in &bufs {
        let (u, v, cnt) = sends[*j];
        if u == r {
            c.send(b.ptr, cnt, dt, v, s).unwrap();
        } else {
            c.recv(b.ptr, cnt, dt, u, s).unwrap();
        }
    }
    c.group_end().unwrap();
    sync(&dev, s);
    for (j, b) in bufs.iter().filter(|(j, _)| sends[*j].1 == r) {
        let (u, _, cnt) = sends[*j];
        let got = b.read_all();
        assert!(got[b.off..b.off + cnt * es] == input(dt, it * 64 + *j as u64, u, cnt)[..], "round {it}: {cnt} x {dt:?} from rank {u}");
        assert_eq!(b.guard_damage(&got), 0, "round {it}: guard bands of the receive from rank {u}");
    }
    let other = |v: usize| c.topology().ranks()[v].node != c.topology().ranks()[r].node;
    let relayed = |x: &&(usize, usize, usize)| relay_via && x.2 > 0 && x.2 * es >= floor;
    let out = sends.iter().filter(|x| x.0 == r && other(x.1)).filter(relayed).count() as u64;
    let inn = sends.iter().filter(|x| x.1 == r && other(x.0)).filter(relayed).count() as u64;
    (out, inn)
}

/// `nodes` virtual nodes of `per_node` thread ranks, forwarding peers `fwd` by local rank:
/// eight rounds of grouped sends, checked; every rank handed its forwarding peer exactly
/// the sends it should (none with `HOCCL_FORWARDING=0`), and the forwarding peers carried
/// every one of them (or refused it, then the sender sent it).
fn relayed_sends(b: Backend, nodes: usize, per_node: usize, fwd: &[usize], cfg: Config, seed: u64) {
    let cfg = Config { virtual_nodes: nodes, forwarding_peers: fwd.to_vec(), qps_per_peer: 1 + (seed % 3) as usize, ..cfg };
    let totals = std::sync::Arc::new(std::sync::Mutex::new(hoccl::comm::RelayCounts::default()));
    let t = totals.clone();
    // The verbs transport relays nothing: its receiver takes a sender's bytes from that
    // sender only.
    let on = cfg.forwarding && cfg.net != hoccl::config::NetChoice::Ib;
    let floor = if cfg.stage_every_call { 1 } else { cfg.staged_min_flow_bytes };
    let (engine, refuse) = (cfg.engine, cfg.relay_refuse);
    run_ranks(b, nodes * per_node, cfg, move |c| {
        let r = c.rank();
        let via = c.topology().ranks()[r].forwarding_peer != r;
        let mut rng = Rng(seed);
        let (mut out, mut inn) = (0, 0);
        for it in 0..8 {
            let (o, i) = p2p_round(c, dtype_of(engine, it), seed * 100 + it, &mut rng, via && on, floor);
            (out, inn) = (out + o, inn + i);
        }
        quiesce(c);
        let got = c.relay_counts();
        assert_eq!((got.handed, got.recv_handed), (out, inn), "rank {r}: sends and receives handed to the forwarding peer");
        let mut t = t.lock().unwrap();
        (t.handed, t.refused, t.carried, t.carried_bytes) = (t.handed + got.handed, t.refused + got.refused, t.carried + got.carried, t.carried_bytes + got.carried_bytes);
        (t.recv_handed, t.recv_refused, t.recv_carried, t.recv_carried_bytes) =
            (t.recv_handed + got.recv_handed, t.recv_refused + got.recv_refused, t.recv_carried + got.recv_carried, t.recv_carried_bytes + got.recv_carried_bytes);
    });
    let t = *totals.lock().unwrap();
    eprintln!("{nodes} x {per_node}, forwarding {fwd:?}: {t:?}");
    assert_eq!(t.carried + t.refused, t.handed, "every handed send carried or refused: {t:?}");
    assert_eq!(t.recv_carried + t.recv_refused, t.recv_handed, "every handed receive landed or refused: {t:?}");
    if on && fwd.iter().enumerate().any(|(l, f)| l != *f) {
        if refuse {
            assert!(t.refused > 0 && t.carried == 0 && t.recv_refused > 0 && t.recv_carried == 0, "the forwarding peers carried what they should refuse: {t:?}");
        } else {
            assert!(t.carried > 0 && t.carried_bytes > 0 && t.refused == 0, "no send relayed: {t:?}");
            assert!(t.recv_carried > 0 && t.recv_carried_bytes > 0 && t.recv_refused == 0, "no receive relayed: {t:?}");
        }
    }
}

/// Point-to-point sends to other nodes through the sender's forwarding peer (thread ranks;
/// on CUDA, one GPU, through the pinned staging).
fn relays(b: Backend) {
    let every = || Config { stage_every_call: true, ..test_config() };
    // Pairs forwarding through each other; a star (ranks 1 and 2 through 0); four nodes.
    relayed_sends(b, 2, 2, &[1, 0], every(), 41);
    relayed_sends(b, 2, 3, &[0, 0, 0], every(), 42);
    relayed_sends(b, 4, 2, &[1, 0], every(), 43);
    // The default floor: only sends of a socket chunk or more are relayed.
    relayed_sends(b, 2, 2, &[1, 0], test_config(), 44);
    // The compressed engine's coded sends are relayed as any.
    relayed_sends(b, 2, 2, &[1, 0], Config { engine: EngineChoice::Compressed, ..every() }, 45);
    // HOCCL_FORWARDING=0: nothing handed.
    relayed_sends(b, 2, 2, &[1, 0], Config { forwarding: false, ..every() }, 46);
}

/// Relays through the staging CUDA uses and over verbs (thread ranks, host backend).
#[test]
fn relays_staged_and_verbs() {
    // Through the staging CUDA uses (the forwarding peer's copy queue reads the sender's
    // memory into its staging).
    let staged = Config { stage_every_call: true, net_stage_host_memory: true, net_staging_bytes: 256 << 10, ..test_config() };
    relayed_sends(Backend::Host, 2, 2, &[1, 0], staged.clone(), 47);
    relayed_sends(Backend::Host, 3, 2, &[1, 0], staged, 48);
    // Forwarding peers that refuse every relay: the senders send directly.
    relayed_sends(Backend::Host, 2, 2, &[1, 0], Config { stage_every_call: true, relay_refuse: true, ..test_config() }, 50);
    // Over verbs the sends go directly.
    relayed_sends(Backend::Host, 2, 2, &[1, 0], Config { stage_every_call: true, ..verbs_config(EngineChoice::CopyEngine) }, 49);
}

/// Processes (host backend: the forwarding peers map the senders' and receivers' shared
/// memory): 2 virtual nodes x 2 ranks forwarding through each other, grouped sends of 0 to
/// 1.2 MB; every rank's handed sends and receives as expected, and every one carried or
/// landed.
#[test]
fn processes_relay() {
    relay_processes(Backend::Host);
}

/// The same on CUDA (`--ignored`; under MPS on one GPU): the forwarding peer's copy queue
/// reads the sender's device memory through an IPC mapping into its pinned staging.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_processes_relay() {
    relay_processes(Backend::Cuda);
}

fn relay_processes(backend: Backend) {
    let env = [("HOCCL_VIRTUAL_NODES", "2"), ("HOCCL_FORWARDING_PEERS", "1,0"), ("HOCCL_ENGINE", "ce"), ("HOCCL_QPS_PER_PEER", "2")];
    let (lines, _) = children_on(backend, 4, "relay", &env, None);
    let (mut handed, mut carried) = (0u64, 0u64);
    for l in lines.iter().flatten().filter(|l| l.contains(" relays handed ")) {
        let w: Vec<&str> = l.split_whitespace().collect();
        let at = w.iter().position(|x| *x == "handed").unwrap();
        handed += w[at + 1].parse::<u64>().unwrap() - w[at + 3].parse::<u64>().unwrap();
        carried += w[at + 5].parse::<u64>().unwrap() + w[at + 7].parse::<u64>().unwrap();
    }
    eprintln!("processes: {handed} sends relayed, {carried} carried");
    assert!(handed > 0 && handed == carried, "handed (less refused) {handed}, carried {carried}: {lines:?}");
}

/// A child of `relay_killed`: ranks r and r + 2 (other node) exchange 8 MiB in a group, over
/// and over, each rank's send relayed by its node peer, until one fails; `victim`
/// announces its first exchange done, then waits to be killed in the next.
fn relay_until_killed(c: &Communicator, dev: &std::sync::Arc<dyn hoccl::Device>, victim: usize) {
    let (rank, n) = (c.rank(), c.size());
    let peer = (rank + n / 2) % n;
    let cnt = 8 << 20;
    let (send, recv) = (Buf::new(dev, cnt, 0, 1), Buf::new(dev, cnt, 0, 2));
    let s = new_stream(dev);
    let t0 = Instant::now();
    for iter in 0.. {
        assert!(t0.elapsed() < Duration::from_secs(30), "rank {rank}: no error after {iter} exchanges");
        if rank == victim && iter == 1 {
            say(rank, "point");
        }
        let r = c.group_start().and_then(|_| c.send(send.ptr, cnt, DataType::U8, peer, s)).and_then(|_| c.recv(recv.ptr, cnt, DataType::U8, peer, s)).and_then(|_| c.group_end());
        dev.synchronize(s).expect("synchronize returns");
        if let Err(e) = r.and_then(|_| c.wait_idle()) {
            assert_ne!(rank, victim, "the victim failed: {e}");
            assert!(matches!(e.code(), hoccl::ErrorCode::Remote | hoccl::ErrorCode::Timeout), "{e}");
            say(rank, &format!("error {:?} {e}", e.code()));
            break;
        }
    }
    c.abort();
    free_deferred();
    say(rank, "done");
}

/// A forwarding peer SIGKILLed while it carries its node peer's sends (rate-limited so the
/// relays last): every survivor fails within the timeout, one of them through a relay's
/// report; the same with a relayed send's receiver killed.
#[test]
fn relay_forwarder_killed() {
    const TMO_MS: u64 = 3000;
    let env = [("HOCCL_VIRTUAL_NODES", "2"), ("HOCCL_FORWARDING_PEERS", "1,0"), ("HOCCL_NET_GBPS", "0.5"), ("HOCCL_TIMEOUT_MS", "3000"), ("HOCCL_ENGINE", "ce")];
    let (lines, killed) = children(4, "relaykill:1", &env, Some(1));
    let errors = survivors_failed(&lines, &[0, 2, 3], killed.expect("the victim reached its kill point"), TMO_MS, "forwarding peer killed");
    // A survivor may first learn of the failure from another survivor (whose error it then
    // names); the relays' own reports come first somewhere.
    assert!(errors.iter().any(|l| l.contains("forwarding peer")), "no survivor's error came from a relay: {errors:?}");
    // The receiver of a relayed send killed (rank 2, which rank 1 carries rank 0's bytes
    // to): the carrying peer's write fails, so does the sender's relay; every survivor
    // fails within the timeout.
    let (lines, killed) = children(4, "relaykill:2", &env, Some(2));
    let errors = survivors_failed(&lines, &[0, 1, 3], killed.expect("the victim reached its kill point"), TMO_MS, "relay receiver killed");
    assert!(errors.iter().all(|l| l.contains("Remote")), "{errors:?}");
}
