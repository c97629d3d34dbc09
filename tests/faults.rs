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
use common::*;
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::device::{pattern_byte, DevPtr, StreamHandle};
use hoccl::{Communicator, Config, DataType, ErrorCode, RedOp};
use std::io::{BufRead, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

const N: usize = 3;
const TMO_MS: u64 = 2000;
/// Per block, in bf16 elements: above the compressed engine's 64 KiB threshold.
const SMALL: usize = 40_000;
/// Per block while the kill lands during the transfer: 4 MiB of bf16.
const LARGE: usize = 1 << 21;

fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    SendRecv,
    AllGather,
    AllToAll,
    AllToAllV,
    Broadcast,
    Gather,
    Scatter,
    AllReduce,
    ReduceScatter,
    Reduce,
}

const OPS: [Op; 10] = [
    Op::SendRecv,
    Op::AllGather,
    Op::AllToAll,
    Op::AllToAllV,
    Op::Broadcast,
    Op::Gather,
    Op::Scatter,
    Op::AllReduce,
    Op::ReduceScatter,
    Op::Reduce,
];

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

/// One line to the parent on stdout: `FAULTS <rank> <event> <unix ms> <detail>`.
fn say(rank: usize, ev: &str, detail: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "FAULTS {rank} {ev} {} {detail}", unix_ms());
    let _ = o.flush();
}

/// A child's report in one line of its output (the test harness may print before it on
/// the same line): event, unix ms, detail.
fn event(l: &str) -> Option<(String, u64, String)> {
    let f: Vec<&str> = l[l.find("FAULTS ")?..].splitn(5, ' ').collect();
    Some((f.get(2)?.to_string(), f.get(3)?.parse().ok()?, f.get(4).unwrap_or(&"").to_string()))
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
    let dev = open_device(Backend::Host, rank);
    if victim && point == Point::Create {
        say(rank, "point", "");
    }
    let comm = match Communicator::from_unique_id_on(&id, N, rank, Some(dev.clone()), cfg) {
        Ok(comm) => comm,
        Err(e) => {
            assert!(!victim, "victim failed to create: {e}");
            check_kind(&e);
            say(rank, "error", &format!("{:?} creation: {e}", e.code()));
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
    detail: String,
}

/// Runs one peer-death case: three child ranks, `victim` killed `delay_ms` after it reports
/// reaching `point`. Returns what each survivor reported; panics on any violated bound.
fn peer_death(op: Op, engine: &str, point: Point, seed: u64) -> Vec<Seen> {
    let mut rng = Rng(seed);
    let victim = rng.below(N as u64) as usize;
    let root = rng.below(N as u64) as usize;
    let delay_ms = if point == Point::During { rng.below(40) } else { rng.below(150) };
    let what = format!("{op:?} engine {engine} kill {point:?} victim {victim} root {root} delay {delay_ms} ms (seed {seed:#x})");
    let id = Communicator::unique_id(&test_config()).expect("unique id");
    let exe = std::env::current_exe().expect("test binary");
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let mut errs = Vec::new();
    let mut kids: Vec<Option<Child>> = (0..N)
        .map(|r| {
            let mut k = Command::new(&exe)
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env("HOCCL_FAULTS_CHILD", format!("{} {r} {op:?} {point:?} {victim} {root}", id.to_hex()))
                .env("HOCCL_TIMEOUT_MS", TMO_MS.to_string())
                .env("HOCCL_ENGINE", engine)
                .env("HOCCL_BACKEND", "host")
                .env("HOCCL_CHUNK_BYTES", "65536")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn child rank");
            let out = k.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in std::io::BufReader::new(out).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((r, l));
                }
            });
            let mut err = k.stderr.take().unwrap();
            errs.push(std::thread::spawn(move || {
                let mut s = String::new();
                let _ = std::io::Read::read_to_string(&mut err, &mut s);
                s
            }));
            Some(k)
        })
        .collect();
    drop(tx);
    let start = Instant::now();
    let mut lines: Vec<(usize, String)> = Vec::new();
    let mut kill_ms: Option<u64> = None;
    let mut status = vec![None; N];
    let limit = Duration::from_secs(45);
    while (0..N).any(|r| r != victim && status[r].is_none()) && start.elapsed() < limit {
        if let Ok(l) = rx.recv_timeout(Duration::from_millis(10)) {
            lines.push(l);
        }
        if kill_ms.is_none() && lines.iter().any(|(r, l)| *r == victim && event(l).is_some_and(|e| e.0 == "point")) {
            std::thread::sleep(Duration::from_millis(delay_ms));
            let mut k = kids[victim].take().unwrap();
            k.kill().expect("SIGKILL the victim");
            kill_ms = Some(unix_ms());
            status[victim] = Some(k.wait().expect("reap the victim"));
        }
        for r in 0..N {
            if status[r].is_none() {
                if let Some(k) = kids[r].as_mut() {
                    status[r] = k.try_wait().expect("try_wait");
                }
            }
        }
    }
    for k in kids.iter_mut().flatten() {
        let _ = k.kill();
        let _ = k.wait();
    }
    lines.extend(rx.try_iter());
    let stderr: Vec<String> = errs.into_iter().map(|h| h.join().unwrap_or_default()).collect();
    let dump = || {
        let mut s = String::new();
        for (r, l) in &lines {
            s += &format!("[{r}] {l}\n");
        }
        for (r, e) in stderr.iter().enumerate() {
            s += &format!("--- rank {r} stderr (last 3000 bytes):\n{}\n", &e[e.len().saturating_sub(3000)..]);
        }
        s
    };
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
        seen.push(Seen { rank: r, kind: err.split(' ').next().unwrap_or("").to_string(), after_kill_ms: after, detail: done });
    }
    for s in &seen {
        eprintln!("peer death | {what} | rank {} | {} | {} ms after the kill | {}", s.rank, s.kind, s.after_kill_ms, s.detail);
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
fn death(op: Op) {
    logs::capture();
    let s = seed() ^ (op as u64).wrapping_mul(0x9E37_79B9);
    let mut rng = Rng(s);
    let cases: Vec<(&str, Point)> = if full() {
        ENGINES.iter().flat_map(|&e| POINTS[1..].iter().map(move |&p| (e, p))).collect()
    } else {
        vec![(ENGINES[rng.below(2) as usize], POINTS[1 + rng.below(3) as usize])]
    };
    for (i, (e, p)) in cases.into_iter().enumerate() {
        peer_death(op, e, p, s.wrapping_add(i as u64));
    }
}

macro_rules! death_tests {
    ($($name:ident: $op:expr),* $(,)?) => {
        $( #[test] fn $name() { death($op) } )*
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
    logs::capture();
    let s = seed() ^ 0xC4EA7E;
    let mut rng = Rng(s);
    let n = if full() { 4 } else { 1 };
    for i in 0..n {
        let op = OPS[rng.below(OPS.len() as u64) as usize];
        let e = ENGINES[rng.below(2) as usize];
        peer_death(op, e, Point::Create, s.wrapping_add(i));
    }
}
