//! Faults become errors (issue 41, items 1 and 2, host backend).
//!
//! Peer death: three ranks as separate processes (this test binary re-run with
//! `HOCCL_FAULTS_CHILD` set, joined through the TCP unique-id bootstrap whose root lives in
//! the parent), one of them killed with SIGKILL during communicator creation, or before,
//! while, or after its data moves in one operation. Every survivor must see an error of kind
//! `Remote` or `Timeout` within `HOCCL_TIMEOUT_MS` (2000 ms here) + 1 s of the kill, its
//! stream released, `abort()` and drop returning, no byte of its buffers outside the failed
//! op's output changed, and exit 0. In CI each op runs once with the engine and kill point
//! drawn from a seed (printed; `HOCCL_FAULTS_SEED` replays it); `HOCCL_STRESS=full` runs
//! every kill point with both engines.
//!
//! Hangs: a rank that never calls the matching op, ranks that call different ops or counts
//! in the same position, a stream that the application blocks, and `abort()` from another
//! thread while an op is stuck; each must end in an error, not a hang.
//!
//! Every case prints its time to error (`eprintln`, `--nocapture` shows it).
mod common;
use common::children;
use common::*;
use common::ops::{Op, OPS};
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::device::{pattern_byte, DevPtr, StreamHandle};
use hoccl::{Communicator, Config, DataType, ErrorCode, RedOp};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const N: usize = 3;
const TMO_MS: u64 = 2000;
/// Per block, in bf16 elements: above the compressed engine's 64 KiB threshold.
const SMALL: usize = 40_000;
/// Per block while the kill lands during the transfer: 2 MiB of bf16.
const LARGE: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Point {
    Create,
    Before,
    During,
    After,
}

const POINTS: [Point; 4] = [Point::Create, Point::Before, Point::During, Point::After];

fn parse<T: Copy + std::fmt::Debug>(all: &[T], s: &str) -> T {
    *all.iter().find(|x| format!("{x:?}") == s).unwrap_or_else(|| panic!("unknown {s}"))
}

/// Elements rank `from` sends rank `to` in AlltoAllv: they differ per pair and agree
/// pairwise, since both sides compute them.
fn v_count(c: usize, from: usize, to: usize) -> usize {
    c + 7 * from + 3 * to
}

/// Gap (elements) left between the blocks a rank receives in AlltoAllv: not output.
const V_GAP: usize = 5;

/// The layout of one rank's buffers for `op` with `c` elements per block: send and receive
/// lengths (elements) and the element ranges of `recv` the op writes on `rank`.
fn layout(op: Op, c: usize, rank: usize, root: usize) -> (usize, usize, Vec<(usize, usize)>) {
    let all = |n: usize| vec![(0, n)];
    match op {
        Op::SendRecv | Op::Broadcast | Op::AllReduce => (c, c, all(c)),
        Op::AllGather => (c, N * c, all(N * c)),
        Op::AllToAll => (N * c, N * c, all(N * c)),
        Op::AllToAllV => {
            let send: usize = (0..N).map(|j| v_count(c, rank, j)).sum();
            let mut out = Vec::new();
            let mut at = 0;
            for j in 0..N {
                let n = v_count(c, j, rank);
                out.push((at, n));
                at += n + V_GAP;
            }
            (send, at, out)
        }
        Op::Gather => (c, N * c, if rank == root { all(N * c) } else { vec![] }),
        Op::Scatter => (N * c, c, all(c)),
        Op::ReduceScatter => (N * c, c, all(c)),
        Op::Reduce => (c, c, if rank == root { all(c) } else { vec![] }),
    }
}

/// Enqueue one `op` on `s`.
fn enqueue(comm: &Communicator, op: Op, c: usize, root: usize, send: DevPtr, recv: DevPtr, s: StreamHandle) -> hoccl::Result<()> {
    let (r, bf) = (comm.rank(), DataType::BF16);
    match op {
        Op::SendRecv => comm.group(|g| {
            g.send(send, c, bf, (r + 1) % N, s)?;
            g.recv(recv, c, bf, (r + N - 1) % N, s)
        }),
        Op::AllGather => comm.all_gather(send, recv, c, bf, s),
        Op::AllToAll => comm.all_to_all(send, recv, c, bf, s),
        Op::AllToAllV => {
            let sc: Vec<usize> = (0..N).map(|j| v_count(c, r, j)).collect();
            let sd: Vec<usize> = sc.iter().scan(0, |a, n| Some(std::mem::replace(a, *a + n))).collect();
            let rc: Vec<usize> = (0..N).map(|j| v_count(c, j, r)).collect();
            let rd: Vec<usize> = rc.iter().scan(0, |a, n| Some(std::mem::replace(a, *a + n + V_GAP))).collect();
            comm.all_to_allv(send, &sc, &sd, recv, &rc, &rd, bf, s)
        }
        Op::Broadcast => comm.broadcast(send, recv, c, bf, root, s),
        Op::Gather => comm.gather(send, recv, c, bf, root, s),
        Op::Scatter => comm.scatter(send, recv, c, bf, root, s),
        Op::AllReduce => comm.all_reduce(send, recv, c, bf, RedOp::Sum, s),
        Op::ReduceScatter => comm.reduce_scatter(send, recv, c, bf, RedOp::Sum, s),
        Op::Reduce => comm.reduce(send, recv, c, bf, RedOp::Sum, root, s),
    }
}

/// `n` bf16 values of small magnitude (compressible: few distinct exponents), varied by
/// `seed`.
fn bf16_data(n: usize, seed: u64) -> Vec<u8> {
    (0..n as u64)
        .flat_map(|i| {
            let v = ((i.wrapping_mul(7919).wrapping_add(seed * 131)) % 1000) as f32 * 1e-3 - 0.5;
            ((v.to_bits() >> 16) as u16).to_ne_bytes()
        })
        .collect()
}

fn say(rank: usize, ev: &str, detail: &str) {
    children::say("FAULTS", rank, ev, detail)
}

fn event(l: &str) -> Option<(String, u64, String)> {
    children::event("FAULTS", l)
}

/// The victim waits here for its SIGKILL.
fn await_kill(rank: usize, ev: &str) -> ! {
    say(rank, ev, "");
    loop {
        std::thread::sleep(Duration::from_secs(60));
    }
}

/// A child rank: `HOCCL_FAULTS_CHILD` = `<hex id> <rank> <op> <point> <victim> <root>`.
#[test]
fn child_rank() {
    let Ok(v) = std::env::var("HOCCL_FAULTS_CHILD") else { return };
    let w: Vec<&str> = v.split_whitespace().collect();
    let id = UniqueId::from_hex(w[0]).expect("id");
    let rank: usize = w[1].parse().unwrap();
    let op = parse(&OPS, w[2]);
    let point = parse(&POINTS, w[3]);
    let victim = rank == w[4].parse::<usize>().unwrap();
    let root: usize = w[5].parse().unwrap();
    let cfg = Config::from_env().expect("HOCCL_* settings");
    assert_eq!(cfg.timeout, Duration::from_millis(TMO_MS));
    let tmo = cfg.timeout;
    let c = if point == Point::During { LARGE } else { SMALL };
    let backend = if std::env::var("HOCCL_BACKEND").is_ok_and(|b| b == "cuda") { Backend::Cuda } else { Backend::Host };
    let dev = open_device(backend, rank);
    if victim && point == Point::Create {
        say(rank, "point", "");
    }
    let comm = match Communicator::from_unique_id_on(&id, N, rank, Some(dev.clone()), cfg) {
        Ok(comm) => comm,
        Err(e) => {
            assert!(!victim, "victim failed to create: {e}");
            check_kind(&e);
            say(rank, "error", &format!("{:?} creation: {e}", e.code()));
            say(rank, "done", "no communicator to abort");
            return;
        }
    };
    if victim && point == Point::Create {
        await_kill(rank, "created");
    }
    let (slen, rlen, out) = layout(op, c, rank, root);
    let send = Buf::new(&dev, 2 * slen, 3, 11 + rank as u64);
    let recv = Buf::new(&dev, 2 * rlen, 5, 22 + rank as u64);
    let canary = Buf::new(&dev, 4096, 1, 33 + rank as u64);
    let canary_img = canary.read_all();
    let data = bf16_data(slen, rank as u64);
    dev.copy_from_host(send.ptr, &data).unwrap();
    let mut send_img = send.read_all();
    send_img[send.off..send.off + data.len()].copy_from_slice(&data);
    let s = new_stream(&dev);
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut iter = 0u32;
    let err = loop {
        assert!(Instant::now() < deadline, "rank {rank}: no error after {iter} iterations of {op:?}");
        if victim && point == Point::Before && iter == 1 {
            await_kill(rank, "point");
        }
        let r = enqueue(&comm, op, c, root, send.ptr, recv.ptr, s);
        if victim && point == Point::During && iter == 1 {
            say(rank, "point", "");
        }
        dev.synchronize(s).expect("synchronize returns");
        let r = r.and_then(|_| comm.wait_idle());
        if victim && iter == 1 {
            assert!(r.is_ok(), "victim failed before its kill: {r:?}");
            await_kill(rank, "point");
        }
        match r {
            Ok(()) => iter += 1,
            Err(e) => break e,
        }
    };
    assert!(!victim, "victim failed: {err}");
    check_kind(&err);
    say(rank, "error", &format!("{:?} iteration {iter}: {err}", err.code()));
    // Nothing written outside the output: the send buffer as filled, the receive buffer's
    // bytes outside the op's output still poison, the canary untouched.
    assert!(send.read_all() == send_img, "rank {rank}: send buffer changed");
    let got = recv.read_all();
    let e = DataType::BF16.size();
    let outside = (0..recv.total)
        .filter(|&i| {
            let in_out = i >= recv.off && out.iter().any(|&(a, n)| i - recv.off >= a * e && i - recv.off < (a + n) * e);
            !in_out && got[i] != pattern_byte(recv.poison, i as u64)
        })
        .count();
    assert_eq!(outside, 0, "rank {rank}: bytes changed outside {op:?}'s output");
    assert!(canary.read_all() == canary_img, "rank {rank}: canary buffer changed");
    let t = Instant::now();
    comm.abort();
    let t_abort = t.elapsed();
    assert!(t_abort < Duration::from_millis(1500), "abort took {t_abort:?}");
    dev.synchronize(s).expect("a later synchronize returns");
    let t = Instant::now();
    drop(comm);
    let t_drop = t.elapsed();
    assert!(t_drop < tmo + Duration::from_secs(2), "drop took {t_drop:?}");
    free_deferred();
    say(rank, "done", &format!("abort {} ms drop {} ms", t_abort.as_millis(), t_drop.as_millis()));
}

fn check_kind(e: &hoccl::Error) {
    assert!(matches!(e.code(), ErrorCode::Remote | ErrorCode::Timeout), "want Remote or Timeout, got {:?}: {e}", e.code());
}

/// What the parent saw of one case: per survivor, the error kind and its time after the kill.
struct Seen {
    rank: usize,
    kind: String,
    after_kill_ms: i64,
    error: String,
    detail: String,
}

/// Runs one peer-death case: three child ranks, `victim` killed `delay_ms` after it reports
/// reaching `point`. Returns what each survivor reported; panics on any violated bound.
fn peer_death(b: Backend, op: Op, engine: &str, point: Point, seed: u64) -> Vec<Seen> {
    let mut rng = Rng(seed);
    let victim = rng.below(N as u64) as usize;
    let root = rng.below(N as u64) as usize;
    // Creation takes tens of milliseconds here: a short delay lands inside it.
    let delay_ms = match point {
        Point::Create => rng.below(30),
        Point::During => rng.below(40),
        _ => rng.below(150),
    };
    let what = format!("{op:?} on {b:?} engine {engine} kill {point:?} victim {victim} root {root} delay {delay_ms} ms (seed {seed:#x})");
    let id = Communicator::unique_id(&test_config()).expect("unique id");
    let env = |r: usize| {
        [
            ("HOCCL_FAULTS_CHILD", format!("{} {r} {op:?} {point:?} {victim} {root}", id.to_hex())),
            ("HOCCL_TIMEOUT_MS", TMO_MS.to_string()),
            ("HOCCL_ENGINE", engine.to_string()),
            ("HOCCL_BACKEND", if b == Backend::Cuda { "cuda" } else { "host" }.to_string()),
            ("HOCCL_CHUNK_BYTES", "65536".to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .to_vec()
    };
    let limit = Duration::from_secs(45);
    let run = children::run("child_rank", N, env, Some((victim, Duration::from_millis(delay_ms))), |l| event(l).is_some_and(|e| e.0 == "point"), limit);
    let (lines, status, kill_ms) = (&run.lines, &run.status, run.kill_ms);
    let dump = || run.dump();
    let kill_ms = kill_ms.unwrap_or_else(|| panic!("{what}: the victim never reached its kill point\n{}", dump()));
    let mut seen = Vec::new();
    for r in (0..N).filter(|&r| r != victim) {
        let st = status[r].unwrap_or_else(|| panic!("{what}: rank {r} still running after {limit:?}\n{}", dump()));
        assert!(st.success(), "{what}: rank {r} exited with {st}\n{}", dump());
        let ev = |e: &str| lines.iter().filter(|(q, _)| *q == r).find_map(|(_, l)| event(l).filter(|x| x.0 == e));
        let (_, t, err) = ev("error").unwrap_or_else(|| panic!("{what}: rank {r} reported no error\n{}", dump()));
        let (_, _, done) = ev("done").unwrap_or_else(|| panic!("{what}: rank {r} did not finish its checks\n{}", dump()));
        let after = t as i64 - kill_ms as i64;
        assert!(after <= (TMO_MS + 1000) as i64, "{what}: rank {r} saw its error {after} ms after the kill\n{}", dump());
        seen.push(Seen { rank: r, kind: err.split(' ').next().unwrap_or("").to_string(), after_kill_ms: after, error: err.clone(), detail: done });
    }
    for s in &seen {
        eprintln!("peer death | {what} | rank {} | {} | {} ms after the kill | {} | {}", s.rank, s.kind, s.after_kill_ms, s.detail, s.error);
    }
    seen
}

fn full() -> bool {
    std::env::var("HOCCL_STRESS").is_ok_and(|v| v == "full")
}

/// The run's seed: `HOCCL_FAULTS_SEED` (decimal or 0x hex), else the clock; printed.
fn seed() -> u64 {
    let s = match std::env::var("HOCCL_FAULTS_SEED") {
        Ok(v) => {
            let v = v.trim();
            v.strip_prefix("0x").map_or_else(|| v.parse().ok(), |h| u64::from_str_radix(h, 16).ok()).expect("HOCCL_FAULTS_SEED")
        }
        Err(_) => SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64),
    };
    eprintln!("faults: seed {s:#x} (HOCCL_FAULTS_SEED={s:#x} replays it)");
    s
}

const ENGINES: [&str; 2] = ["ce", "compressed"];

/// `op` with one victim: in CI one kill point (before, during or after the data moves) and
/// one engine drawn from the seed; with `HOCCL_STRESS=full` every point with both engines.
fn death(b: Backend, op: Op) {
    logs::capture();
    let s = seed() ^ (op as u64).wrapping_mul(0x9E37_79B9);
    let mut rng = Rng(s);
    let cases: Vec<(&str, Point)> = if full() {
        ENGINES.iter().flat_map(|&e| POINTS[1..].iter().map(move |&p| (e, p))).collect()
    } else {
        vec![(ENGINES[rng.below(2) as usize], POINTS[1 + rng.below(3) as usize])]
    };
    for (i, (e, p)) in cases.into_iter().enumerate() {
        peer_death(b, op, e, p, s.wrapping_add(i as u64));
    }
}

/// Each test on the host backend, and the same body with CUDA ranks as an ignored test
/// (`cuda::*`, run with `--ignored` on a GPU machine).
macro_rules! death_tests {
    ($($name:ident: $op:expr),* $(,)?) => {
        $( #[test] fn $name() { death(Backend::Host, $op) } )*
        mod cuda {
            use super::*;
            $( #[test] #[ignore = "needs a GPU: run with --ignored"] fn $name() { death(Backend::Cuda, $op) } )*
            #[test]
            #[ignore = "needs a GPU: run with --ignored"]
            fn death_during_creation() {
                creation(Backend::Cuda)
            }
        }
    };
}

death_tests! {
    death_send_recv: Op::SendRecv,
    death_all_gather: Op::AllGather,
    death_all_to_all: Op::AllToAll,
    death_all_to_allv: Op::AllToAllV,
    death_broadcast: Op::Broadcast,
    death_gather: Op::Gather,
    death_scatter: Op::Scatter,
    death_all_reduce: Op::AllReduce,
    death_reduce_scatter: Op::ReduceScatter,
    death_reduce: Op::Reduce,
}

/// The victim killed during communicator creation (`delay_ms` after it starts creating):
/// the survivors' creation or their first op fails.
#[test]
fn death_during_creation() {
    creation(Backend::Host)
}

fn creation(b: Backend) {
    logs::capture();
    let s = seed() ^ 0xC4EA7E;
    let mut rng = Rng(s);
    let n = if full() { 4 } else { 1 };
    for i in 0..n {
        let op = OPS[rng.below(OPS.len() as u64) as usize];
        let e = ENGINES[rng.below(2) as usize];
        peer_death(b, op, e, Point::Create, s.wrapping_add(i));
    }
}

// ===================================================================== hangs ==========

use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::device::Device;
use std::sync::Arc;

/// Runs `f` on a thread and panics if it has not returned within `limit`: a hang fails the
/// test instead of stalling the run.
fn bounded<T: Send + 'static>(what: &str, limit: Duration, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(limit) {
        Ok(v) => v,
        Err(mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung for {limit:?}"),
        Err(mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked"),
    }
}

/// Two ranks as threads of this process, each with its own host device and a communicator
/// whose timeout is `tmo`; `f(rank, comm, dev)` runs on each and the results come back in
/// rank order. Buffers and streams made through `common` are freed after the communicator.
fn two<T, F>(tmo: Duration, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(usize, &Communicator, &Arc<dyn Device>) -> T + Send + Sync + 'static,
{
    let f = Arc::new(f);
    let hs: Vec<_> = ThreadBootstrap::group_with_timeout(2, Duration::from_secs(20))
        .into_iter()
        .enumerate()
        .map(|(r, b)| {
            let f = f.clone();
            std::thread::spawn(move || {
                let dev = open_device(Backend::Host, r);
                let cfg = Config { timeout: tmo, ..test_config() };
                let comm = Communicator::with_bootstrap(Box::new(b), Some(dev.clone()), cfg).expect("communicator");
                let v = f(r, &comm, &dev);
                let t = Instant::now();
                drop(comm);
                assert!(t.elapsed() < tmo + Duration::from_secs(2), "rank {r}: drop took {:?}", t.elapsed());
                free_deferred();
                v
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("rank thread")).collect()
}

const HANG_TMO: Duration = Duration::from_millis(1000);

/// Synchronize `s`, then the communicator's verdict; with the time since `t0`.
fn outcome(comm: &Communicator, dev: &Arc<dyn Device>, s: StreamHandle, enq: hoccl::Result<()>, t0: Instant) -> (Option<hoccl::Error>, Duration) {
    dev.synchronize(s).expect("synchronize returns");
    let r = enq.and_then(|_| comm.wait_idle());
    (r.err(), t0.elapsed())
}

/// Elements (u8) of the AllGather that `stuck_all_gather` leaves stuck.
const STUCK: usize = 10_000;

/// Two ranks, rank 1 never calling the AllGather of `STUCK` bytes that rank 0 enqueues in
/// `f(comm, dev, send, recv, stream)` (rank 1 waits until `f` returned, then destroys its
/// communicator); `f`'s result, under `bounded`.
fn stuck_all_gather<T, F>(what: &'static str, tmo: Duration, f: F) -> T
where
    T: Send + 'static,
    F: Fn(&Communicator, &Arc<dyn Device>, &Buf, &Buf, StreamHandle) -> T + Send + Sync + 'static,
{
    let gate = Arc::new(std::sync::Barrier::new(2));
    let mut res = bounded(what, Duration::from_secs(40), move || {
        two(tmo, move |r, comm, dev| {
            if r == 1 {
                gate.wait();
                return None;
            }
            let send = Buf::new(dev, STUCK, 0, 1);
            let recv = Buf::new(dev, 2 * STUCK, 0, 2);
            let s = new_stream(dev);
            let v = f(comm, dev, &send, &recv, s);
            gate.wait();
            Some(v)
        })
    });
    res.swap_remove(0).expect("rank 0's outcome")
}

/// Rank 1 never calls the AllGather that rank 0 waits in: rank 0 fails with `Timeout`
/// within the timeout + 1 s, its stream released and its receive buffer untouched past its
/// own block.
#[test]
fn rank_that_never_calls() {
    let c = STUCK;
    let res = stuck_all_gather("never calls", HANG_TMO, move |comm, dev, send, recv, s| {
        let t0 = Instant::now();
        let enq = comm.all_gather(send.ptr, recv.ptr, c, DataType::U8, s);
        let (e, took) = outcome(comm, dev, s, enq, t0);
        let all = recv.read_all();
        assert_eq!(recv.guard_damage(&all), 0, "guards");
        assert!((c..2 * c).all(|i| all[i] == pattern_byte(2, i as u64)), "rank 1's block written");
        (e, took)
    });
    let e = res.0.as_ref().expect("rank 0 gets an error");
    let took = res.1;
    eprintln!("hang | rank never calls AllGather | {:?} | {} ms (timeout {} ms) | {e}", e.code(), took.as_millis(), HANG_TMO.as_millis());
    assert_eq!(e.code(), ErrorCode::Timeout, "{e}");
    assert!(took < HANG_TMO + Duration::from_secs(1), "took {took:?}");
}

type Call = fn(&Communicator, usize, DevPtr, DevPtr, StreamHandle) -> hoccl::Result<()>;

/// Elements per block in the mismatch cases, and their type.
const MC: usize = 10_000;
const F: DataType = DataType::F32;

/// Ranks 0 and 1 make different calls in the same position: `(name, rank 0's call, rank
/// 1's call, elements of `recv` each call may write, and whether hoccl can tell them
/// apart)`. Calls that move the same bytes between the same pairs are indistinguishable on
/// the wire (as in NCCL, where they are undefined): those complete, and the test checks
/// only that nothing outside each call's own output changed.
fn mismatches() -> Vec<(&'static str, Call, Call, [usize; 2], bool)> {
    vec![
        ("AllGather count 10000 vs 20000", |c, _, s, r, st| c.all_gather(s, r, MC, F, st), |c, _, s, r, st| c.all_gather(s, r, 2 * MC, F, st), [2 * MC, 4 * MC], true),
        ("AllReduce count 10000 vs 20000", |c, _, s, r, st| c.all_reduce(s, r, MC, F, RedOp::Sum, st), |c, _, s, r, st| c.all_reduce(s, r, 2 * MC, F, RedOp::Sum, st), [MC, 2 * MC], true),
        ("Broadcast count 10000 vs 5000", |c, _, s, r, st| c.broadcast(s, r, MC, F, 0, st), |c, _, s, r, st| c.broadcast(s, r, MC / 2, F, 0, st), [MC, MC / 2], true),
        ("send 10000 vs recv 20000", |c, _, s, _, st| c.send(s, MC, F, 1, st), |c, _, _, r, st| c.recv(r, 2 * MC, F, 0, st), [0, 2 * MC], true),
        ("AllGather vs AllReduce", |c, _, s, r, st| c.all_gather(s, r, MC, F, st), |c, _, s, r, st| c.all_reduce(s, r, MC, F, RedOp::Sum, st), [2 * MC, MC], true),
        ("Broadcast vs Reduce (root 0)", |c, _, s, r, st| c.broadcast(s, r, MC, F, 0, st), |c, _, s, r, st| c.reduce(s, r, MC, F, RedOp::Sum, 0, st), [MC, 0], true),
        ("Broadcast root 0 vs root 1", |c, _, s, r, st| c.broadcast(s, r, MC, F, 0, st), |c, _, s, r, st| c.broadcast(s, r, MC, F, 1, st), [MC, MC], true),
        ("send to 1 vs send to 0", |c, _, s, _, st| c.send(s, MC, F, 1, st), |c, _, s, _, st| c.send(s, MC, F, 0, st), [0, 0], true),
        ("AllToAll vs AllGather (same bytes)", |c, _, s, r, st| c.all_to_all(s, r, MC, F, st), |c, _, s, r, st| c.all_gather(s, r, MC, F, st), [2 * MC, 2 * MC], false),
        ("AllReduce Sum vs Max", |c, _, s, r, st| c.all_reduce(s, r, MC, F, RedOp::Sum, st), |c, _, s, r, st| c.all_reduce(s, r, MC, F, RedOp::Max, st), [MC, MC], false),
        ("AllReduce f32 vs i32", |c, _, s, r, st| c.all_reduce(s, r, MC, F, RedOp::Sum, st), |c, _, s, r, st| c.all_reduce(s, r, MC, DataType::I32, RedOp::Sum, st), [MC, MC], false),
    ]
}

#[test]
fn mismatched_calls() {
    for (i, (name, c0, c1, out, tell)) in mismatches().into_iter().enumerate() {
        let res = bounded(name, Duration::from_secs(20), move || {
            two(HANG_TMO, move |r, comm, dev| {
                let send = Buf::new(dev, 4 * 4 * MC, 0, 10 + r as u64);
                let send_img = send.read_all();
                let recv = Buf::new(dev, 4 * out[r], 0, 20 + r as u64);
                let s = new_stream(dev);
                let t0 = Instant::now();
                let enq = [c0, c1][r](comm, r, send.ptr, recv.ptr, s);
                let (e, took) = outcome(comm, dev, s, enq, t0);
                assert!(send.read_all() == send_img, "{name}: rank {r}'s send buffer changed");
                assert_eq!(recv.guard_damage(&recv.read_all()), 0, "{name}: rank {r} written past its output");
                (e, took)
            })
        });
        for (r, (e, took)) in res.iter().enumerate() {
            let kind = e.as_ref().map_or("completes".to_string(), |e| format!("{:?}", e.code()));
            let msg = e.as_ref().map_or(String::new(), |e| e.to_string());
            eprintln!("hang | mismatch {i}: {name} | rank {r} | {kind} | {} ms | {msg}", took.as_millis());
            if tell {
                let e = e.as_ref().unwrap_or_else(|| panic!("{name}: rank {r} completed"));
                assert!(matches!(e.code(), ErrorCode::InvalidUsage | ErrorCode::Remote | ErrorCode::Timeout), "{name}: rank {r}: {e}");
                assert!(*took < HANG_TMO + Duration::from_secs(1), "{name}: rank {r} took {took:?}");
            }
        }
    }
}

/// Rank 0's stream is blocked by the application (a wait on a flag it never raises, the host
/// backend's model of earlier work that does not finish) when it enqueues an AllGather.
/// An op that its stream has not reached does not time out on its own rank (application
/// work before a collective may legitimately run long); rank 1, started and waiting for rank
/// 0's buffer, fails with `Timeout` and its failure reaches rank 0 as `Remote`, both within
/// the timeout + 1 s. Once the application releases its wait, rank 0's stream runs through
/// the failed collective (its finish flag was written) and synchronize returns.
#[test]
fn stream_blocked_by_the_application() {
    let res = bounded("blocked stream", Duration::from_secs(40), move || {
        two(HANG_TMO, move |r, comm, dev| {
            let c = 10_000;
            let send = Buf::new(dev, c, 0, 1);
            let recv = Buf::new(dev, 2 * c, 0, 2);
            let s = new_stream(dev);
            let app = dev.alloc_flags(1).expect("flags");
            if r == 0 {
                dev.wait_value_geq(s, app.dev_addr(0), 1).expect("application's wait");
            }
            let t0 = Instant::now();
            let enq = comm.all_gather(send.ptr, recv.ptr, c, DataType::U8, s);
            if r == 1 {
                return outcome(comm, dev, s, enq, t0);
            }
            // The stream cannot be synchronized while the application holds it: wait for
            // the communicator's verdict first, then release the stream.
            let deadline = Instant::now() + HANG_TMO + Duration::from_secs(10);
            while comm.async_error().is_none() && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(5));
            }
            let took = t0.elapsed();
            let e = enq.err().or_else(|| comm.async_error());
            app.store(0, 1);
            let t = Instant::now();
            dev.synchronize(s).expect("synchronize returns once released");
            assert!(t.elapsed() < Duration::from_secs(2), "released stream took {:?}", t.elapsed());
            assert_eq!(recv.guard_damage(&recv.read_all()), 0, "guards");
            (e, took)
        })
    });
    for (r, (e, took)) in res.iter().enumerate() {
        let e = e.as_ref().unwrap_or_else(|| panic!("rank {r}: no error"));
        eprintln!("hang | stream blocked by the application | rank {r} | {:?} | {} ms | {e}", e.code(), took.as_millis());
        assert!(*took < HANG_TMO + Duration::from_secs(1), "rank {r} took {took:?}");
        let want = if r == 0 { ErrorCode::Remote } else { ErrorCode::Timeout };
        assert_eq!(e.code(), want, "rank {r}: {e}");
    }
}

/// An AllGather stuck because rank 1 never calls it (timeout 60 s, so that only the abort
/// can end it): `abort()` from another thread releases the stream and ends a thread blocked
/// in `wait_idle` within 1 s, both with an error, and later calls fail with `Aborted`.
#[test]
fn abort_from_another_thread() {
    let c = STUCK;
    let res = stuck_all_gather("abort from another thread", Duration::from_secs(60), move |comm, dev, send, recv, s| {
        comm.all_gather(send.ptr, recv.ptr, c, DataType::U8, s).expect("enqueue");
        let out = std::thread::scope(|sc| {
            let stream = sc.spawn(|| {
                dev.synchronize(s).expect("synchronize returns");
                Instant::now()
            });
            let waiter = sc.spawn(|| (comm.wait_idle(), Instant::now()));
            std::thread::sleep(Duration::from_millis(300));
            assert!(comm.pending() > 0, "the op is still stuck before the abort");
            let t = Instant::now();
            comm.abort();
            let abort_took = t.elapsed();
            let st = stream.join().expect("stream thread");
            let (w, wt) = waiter.join().expect("waiter thread");
            (abort_took, st.saturating_duration_since(t), w, wt.saturating_duration_since(t))
        });
        let later = comm.all_gather(send.ptr, recv.ptr, c, DataType::U8, s).err();
        assert_eq!(recv.guard_damage(&recv.read_all()), 0, "guards");
        (out, later)
    });
    let ((abort_took, stream, w, waiter), later) = res;
    let e = w.err().expect("wait_idle fails after the abort");
    eprintln!(
        "hang | abort() from another thread, op stuck | rank 0 | wait_idle {:?} | abort {} ms, stream released {} ms, wait_idle returned {} ms after it | {e}",
        e.code(),
        abort_took.as_millis(),
        stream.as_millis(),
        waiter.as_millis()
    );
    for (what, d) in [("abort", abort_took), ("stream", stream), ("wait_idle", waiter)] {
        assert!(d < Duration::from_secs(1), "{what} took {d:?} after the abort");
    }
    let later = later.expect("a call after abort fails");
    assert_eq!(later.code(), ErrorCode::Aborted, "{later}");
}
