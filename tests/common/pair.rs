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

// ------------------------------------------------------------------ two processes -------

use super::{children, new_stream, open_device, sync, test_config, Backend};
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::Config;
use std::time::{Duration, Instant};

/// A child's report: event, unix ms, detail.
pub type Event = (String, u64, String);

/// The two-process harness of one test binary: the tag its children report under, the
/// variables that carry a child's instructions (`<hex id> <rank> <case> <victim>`) and its
/// backend, and the op timeout the parent sets.
pub struct Harness {
    pub tag: &'static str,
    pub child_var: &'static str,
    pub backend_var: &'static str,
    pub timeout_ms: u64,
}

impl Harness {
    pub fn say(&self, rank: usize, ev: &str, detail: &str) {
        children::say(self.tag, rank, ev, detail)
    }

    pub fn event(&self, l: &str) -> Option<Event> {
        children::event(self.tag, l)
    }

    /// In a child: its communicator, device, case and victim (None in the parent).
    pub fn child(&self) -> Option<(Communicator, Arc<dyn Device>, String, usize)> {
        let v = std::env::var(self.child_var).ok()?;
        let w: Vec<&str> = v.split_whitespace().collect();
        let id = UniqueId::from_hex(w[0]).expect("id");
        let rank: usize = w[1].parse().unwrap();
        let backend = if std::env::var(self.backend_var).as_deref() == Ok("cuda") { Backend::Cuda } else { Backend::Host };
        let dev = open_device(backend, 0);
        let cfg = Config::from_env().expect("HOCCL_* settings");
        let comm = Communicator::from_unique_id_on(&id, N, rank, Some(dev.clone()), cfg).expect("communicator");
        Some((comm, dev, w[2].to_string(), w[3].parse().unwrap()))
    }

    /// Run the two children of `case` with `env` added (`victim` killed once it reports its
    /// point); returns each child's events and stderr and when the victim was killed, after
    /// checking that every child not killed finished and exited 0 within `limit`.
    pub fn run_children(&self, backend: Backend, case: &str, env: &[(&str, String)], victim: Option<usize>, limit: Duration) -> (Vec<Vec<Event>>, Vec<String>, Option<u64>) {
        let id = Communicator::unique_id(&test_config()).expect("unique id");
        let envs = |r: usize| {
            let mut v = vec![
                (self.child_var.to_string(), format!("{} {r} {case} {}", id.to_hex(), victim.map_or(9, |v| v))),
                (self.backend_var.to_string(), if backend == Backend::Cuda { "cuda" } else { "host" }.to_string()),
                ("HOCCL_TIMEOUT_MS".to_string(), self.timeout_ms.to_string()),
                ("HOCCL_TRACE_OPS".to_string(), "1-1000".to_string()),
                ("HOCCL_LOG".to_string(), "hoccl::engine::proxy=info".to_string()),
            ];
            v.extend(env.iter().map(|(k, v)| (k.to_string(), v.clone())));
            v
        };
        // Let the survivor's op reach its wait before the kill.
        let kill = victim.map(|v| (v, Duration::from_millis(100)));
        let run = children::run("child_rank", N, envs, kill, |l| self.event(l).is_some_and(|e| e.0 == "point"), limit);
        let what = format!("{case} {env:?}");
        for r in (0..N).filter(|r| Some(*r) != victim) {
            let st = run.status[r].unwrap_or_else(|| panic!("{what}: rank {r} still running after {limit:?}\n{}", run.dump()));
            assert!(st.success(), "{what}: rank {r} exited with {st}\n{}", run.dump());
            assert!(run.lines.iter().any(|(q, l)| *q == r && self.event(l).is_some_and(|e| e.0 == "done")), "{what}: rank {r} did not finish\n{}", run.dump());
        }
        let events = (0..N).map(|r| run.lines.iter().filter(|(q, _)| *q == r).filter_map(|(_, l)| self.event(l)).collect()).collect();
        (events, run.stderr, run.kill_ms)
    }

    /// Parent: case `death` with `victim` killed; the survivor must fail within the timeout
    /// + 1 s with `Remote` or `Timeout`.
    pub fn peer_killed(&self, backend: Backend, env: &[(&str, String)], victim: usize) {
        let (events, stderr, kill_ms) = self.run_children(backend, "death", env, Some(victim), Duration::from_secs(60));
        let survivor = 1 - victim;
        let kill_ms = kill_ms.expect("the victim reached its point");
        let (_, t, what) = events[survivor].iter().find(|e| e.0 == "error").cloned().unwrap_or_else(|| panic!("no error on rank {survivor}: {}", stderr[survivor]));
        let after = t as i64 - kill_ms as i64;
        eprintln!("peer killed: victim {victim}, rank {survivor} failed {after} ms after the kill: {what}");
        assert!(after <= (self.timeout_ms + 1000) as i64, "rank {survivor} saw its error {after} ms after the kill: {what}");
        assert!(what.starts_with("Remote") || what.starts_with("Timeout"), "{what}");
    }

    /// Parent: case `mismatch`; both ranks must fail at once, the sender with `InvalidUsage`.
    pub fn length_mismatch(&self, backend: Backend, env: &[(&str, String)]) {
        let (events, _, _) = self.run_children(backend, "mismatch", env, None, Duration::from_secs(60));
        let err = |r: usize| events[r].iter().find(|e| e.0 == "error").map(|e| e.2.clone()).unwrap_or_else(|| panic!("rank {r} reported no error"));
        let (e0, e1) = (err(0), err(1));
        eprintln!("length mismatch: rank 0 {e0}; rank 1 {e1}");
        assert!(e0.starts_with("InvalidUsage"), "the sender: {e0}");
        assert!(e1.starts_with("InvalidUsage") || e1.starts_with("Remote"), "the receiver: {e1}");
        let ms = |e: &str| e.split(' ').nth(1).and_then(|t| t.parse::<u64>().ok()).unwrap_or(u64::MAX);
        assert!(ms(&e0) < self.timeout_ms && ms(&e1) < self.timeout_ms, "a mismatch must fail at once, not by the timeout: {e0}; {e1}");
    }
}

/// Rank 1 holds its stream back (a flag the application raises) in front of work that
/// writes the receive buffer and then the receive of `len` bytes, for each of `lens`: the
/// bytes must land after that work; where `sender_waits(len)`, rank 0's stream must not
/// pass the send while the receiver is held.
pub fn held_back(comm: &Communicator, dev: &Arc<dyn Device>, s: StreamHandle, lens: &[usize], sender_waits: impl Fn(usize) -> bool) {
    let r = comm.rank();
    for &len in lens {
        let buf = dev.alloc(len).unwrap();
        let want = data(0, 900 + len as u64, len, false);
        let gate = dev.alloc_flags(1).expect("flag");
        let early = dev.alloc(len).unwrap();
        if r == 0 {
            dev.copy_from_host(buf, &want).unwrap();
            comm.send(buf, len, DataType::U8, 1, s).expect("send");
        } else {
            dev.copy_from_host(early, &vec![0x5a; len]).unwrap();
            dev.wait_value_geq(s, gate.dev_addr(0), 1).unwrap();
            dev.memcpy_async(s, buf, early, len).unwrap();
            comm.recv(buf, len, DataType::U8, 0, s).expect("recv");
        }
        comm.bootstrap().barrier().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        if r == 0 && sender_waits(len) {
            assert!(!dev.stream_query(s).unwrap(), "the send's stream passed the op of {len} B while its receiver was held back");
        }
        comm.bootstrap().barrier().unwrap();
        if r == 1 {
            gate.store(0, 1);
        }
        sync(dev, s);
        comm.wait_idle().expect("wait_idle");
        if r == 1 {
            let mut got = vec![0u8; len];
            dev.copy_to_host(&mut got, buf).unwrap();
            let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "held-back receive of {len} B: {bad} bytes wrong (landed before the stream reached the op?)");
        }
        comm.bootstrap().barrier().unwrap();
        dev.free(buf).unwrap();
        dev.free(early).unwrap();
    }
}

/// One op with a flow each way between the pair for each of `lens`.
pub fn mixed(comm: &Communicator, dev: &Arc<dyn Device>, s: StreamHandle, lens: &[usize]) {
    let (r, peer) = (comm.rank(), 1 - comm.rank());
    let bufs: Vec<(DevPtr, DevPtr, Vec<u8>)> = lens
        .iter()
        .enumerate()
        .map(|(k, &len)| {
            let (sb, rb) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
            dev.copy_from_host(sb, &data(r, 700 + k as u64, len, false)).unwrap();
            (sb, rb, data(peer, 700 + k as u64, len, false))
        })
        .collect();
    comm.group(|g| {
        for (&len, (sb, rb, _)) in lens.iter().zip(&bufs) {
            g.send(*sb, len, DataType::U8, peer, s)?;
            g.recv(*rb, len, DataType::U8, peer, s)?;
        }
        Ok(())
    })
    .expect("mixed group");
    sync(dev, s);
    comm.wait_idle().expect("wait_idle");
    for (&len, (sb, rb, want)) in lens.iter().zip(&bufs) {
        let mut got = vec![0u8; len];
        dev.copy_to_host(&mut got, *rb).unwrap();
        assert!(got == *want, "rank {r}: mixed op, the {len}-byte flow landed wrong");
        dev.free(*sb).unwrap();
        dev.free(*rb).unwrap();
    }
}

/// Child of case `death`: the victim holds its stream (for ever) in front of its side of a
/// transfer of `len` bytes from rank 0 to rank 1 and waits for its SIGKILL; the survivor's
/// op must fail, abort within 1.5 s and its stream be released.
pub fn death_body(h: &Harness, comm: &Communicator, dev: &Arc<dyn Device>, victim: usize, len: usize) {
    let r = comm.rank();
    let s = new_stream(dev);
    let (sb, rb) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
    let gate = dev.alloc_flags(1).expect("flag");
    if r == victim {
        dev.wait_value_geq(s, gate.dev_addr(0), 1).unwrap();
    }
    let res = if r == 0 { comm.send(sb, len, DataType::U8, 1, s) } else { comm.recv(rb, len, DataType::U8, 0, s) };
    res.expect("enqueue");
    if r == victim {
        h.say(r, "point", "");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    sync(dev, s);
    let err = comm.wait_idle().expect_err("the op must fail once its peer is gone");
    h.say(r, "error", &format!("{:?}: {err}", err.code()));
    let t = Instant::now();
    comm.abort();
    let t_abort = t.elapsed();
    assert!(t_abort < Duration::from_millis(1500), "abort took {t_abort:?}");
    sync(dev, s);
    h.say(r, "done", &format!("abort {} ms", t_abort.as_millis()));
    std::mem::forget(gate);
}

/// Child of case `mismatch`: rank 0 sends 4 KiB, rank 1 expects 8 KiB; both must fail.
/// `unchanged`: neither buffer may change (the path checks lengths before any byte moves).
pub fn mismatch_body(h: &Harness, comm: &Communicator, dev: &Arc<dyn Device>, unchanged: bool) {
    let r = comm.rank();
    let s = new_stream(dev);
    let len = if r == 0 { 4096 } else { 8192 };
    let buf = dev.alloc(len).unwrap();
    let before = data(r, 500, len, false);
    dev.copy_from_host(buf, &before).unwrap();
    let t0 = Instant::now();
    let res = if r == 0 { comm.send(buf, len, DataType::U8, 1, s) } else { comm.recv(buf, len, DataType::U8, 0, s) };
    res.expect("enqueue");
    sync(dev, s);
    let err = comm.wait_idle().expect_err("mismatched lengths must fail");
    let took = t0.elapsed();
    if unchanged {
        let mut after = vec![0u8; len];
        dev.copy_to_host(&mut after, buf).unwrap();
        assert!(after == before, "rank {r}: the buffer changed");
    }
    h.say(r, "error", &format!("{:?} {} ms: {err}", err.code(), took.as_millis()));
    comm.abort();
    h.say(r, "done", "");
}

/// Op timelines (`HOCCL_TRACE_OPS`) in which step `step` happened, and those in which it did
/// not (a step the op did not have reads "`step` -,"; one it had, a signed time).
pub fn traced(stderr: &[String], step: &str) -> (usize, usize) {
    let lines: Vec<&str> = stderr.iter().flat_map(|e| e.lines()).filter(|l| l.contains("hoccl trace:")).collect();
    let had = lines.iter().filter(|l| l.split(&format!("{step} ")).nth(1).is_some_and(|t| !t.starts_with("-,"))).count();
    (had, lines.len() - had)
}
