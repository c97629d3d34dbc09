//! Device-gated writes between processes of one host (issue 37, item 1): the same-host
//! transport's gated path, against the proxy's handshake (`HOCCL_GATED=0`) on the same bodies.
//!
//! Every case runs two ranks as separate processes (this test binary re-run with
//! `HOCCL_GATED_CHILD` set, joined through the TCP unique-id bootstrap), since ranks of one
//! process never take the gated path:
//! - `ops_*`: every copy-engine collective and the reductions at sizes around the gated
//!   limit (0, 1, odd, 8 MiB - 1, 8 MiB, 8 MiB + 1 bytes or elements' worth), ten ops in
//!   flight at once over two streams, results against references computed on the host; an
//!   op whose receiving stream the application holds back (the bytes must not land before
//!   that stream reached the op: work before the op on that stream writes the same buffer);
//!   an op with gated and larger flows between the same pair. The children's op timelines
//!   (`HOCCL_TRACE_OPS`) show which path ran: gated copies queued with `HOCCL_GATED=1`,
//!   none with `0`.
//! - `peer_killed_*`: the receiver (its stream held, so the sender's gated copy waits for
//!   its ready flag) or the sender (its stream held, so the receiver waits for its landed
//!   flag) is SIGKILLed; the survivor must fail within `HOCCL_TIMEOUT_MS` + 1 s, its stream
//!   released, abort and drop bounded, and exit 0.
//!
//! - `length_mismatch*`: a gated send into a longer gated receive fails on both sides at
//!   once (`InvalidUsage` at the sender, which queues nothing), no buffer changed.
//! - `queue_*`: the device pieces alone: a copy queue's flag wait holds its copy back until
//!   the CPU raises the flag in host memory registered by `map_host`, and its flag write
//!   lands there after the copy.
//!
//! The `cuda_*` tests run the same bodies on GPU 0 (two processes on one GPU; ignored
//! without one: `cargo test --test gated -- --ignored`).
mod common;
use common::*;
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::device::{DevPtr, Device, StreamHandle};
use hoccl::{Communicator, Config, DataType};
use common::children;
use common::ops::{Op, OPS};
use common::pair::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The gated limit (the chunk scheduler's single-copy limit).
const LIMIT: usize = 8 << 20;
const TMO_MS: u64 = 2000;

fn say(rank: usize, ev: &str, detail: &str) {
    children::say("GATED", rank, ev, detail)
}

fn event(l: &str) -> Option<Event> {
    children::event("GATED", l)
}

// ------------------------------------------------------------------ children ------------

fn child_backend() -> Backend {
    match std::env::var("HOCCL_GATED_BACKEND").as_deref() {
        Ok("cuda") => Backend::Cuda,
        _ => Backend::Host,
    }
}

/// A child rank: `HOCCL_GATED_CHILD` = `<hex id> <rank> <case> [victim]`.
#[test]
fn child_rank() {
    let Ok(v) = std::env::var("HOCCL_GATED_CHILD") else { return };
    let w: Vec<&str> = v.split_whitespace().collect();
    let id = UniqueId::from_hex(w[0]).expect("id");
    let rank: usize = w[1].parse().unwrap();
    let dev = open_device(child_backend(), 0);
    let cfg = Config::from_env().expect("HOCCL_* settings");
    let comm = Communicator::from_unique_id_on(&id, N, rank, Some(dev.clone()), cfg).expect("communicator");
    match w[2] {
        "ops" => ops_body(&comm, &dev),
        "death" => death_body(&comm, &dev, w[3].parse().unwrap()),
        "mismatch" => mismatch_body(&comm, &dev),
        other => panic!("unknown case {other}"),
    }
}

/// Ten ops in flight over two streams per size, then the held-back stream, then gated and
/// large flows in one op.
fn ops_body(comm: &Communicator, dev: &Arc<dyn Device>) {
    let r = comm.rank();
    let streams = [new_stream(dev), new_stream(dev)];
    let mut case = 0u64;
    for bytes in [0, 1, 1001, LIMIT - 1, LIMIT, LIMIT + 1] {
        let mut pending = Vec::new();
        for (i, op) in OPS.iter().enumerate() {
            let reduction = matches!(op, Op::AllReduce | Op::ReduceScatter | Op::Reduce);
            // Per block: `bytes` bytes, or as many f32 as fit (at least one when bytes > 0).
            let c = if reduction { bytes.div_ceil(4) } else { bytes };
            case += 1;
            pending.push(start(comm, dev, *op, c, case, streams[i % 2]));
        }
        for s in streams {
            sync(dev, s);
        }
        comm.wait_idle().expect("wait_idle");
        for p in pending {
            check(dev, r, p);
        }
        comm.bootstrap().barrier().expect("barrier");
    }
    held_back(comm, dev, streams[0]);
    mixed(comm, dev, streams[1]);
    say(r, "done", "");
}

/// Rank 1 holds its stream back (a flag the application raises) in front of work that
/// writes the receive buffer and then the receive: the bytes must land after that work,
/// and rank 0's stream must not pass the send before they land.
fn held_back(comm: &Communicator, dev: &Arc<dyn Device>, s: StreamHandle) {
    let r = comm.rank();
    for len in [4096usize, 1 << 20] {
        let peer = 1 - r;
        let buf = dev.alloc(len).unwrap();
        let want = data(0, 900 + len as u64, len, false);
        let gate = dev.alloc_flags(1).expect("flag");
        let early = dev.alloc(len).unwrap();
        if r == 0 {
            dev.copy_from_host(buf, &want).unwrap();
            comm.send(buf, len, DataType::U8, peer, s).expect("send");
        } else {
            dev.copy_from_host(early, &vec![0x5a; len]).unwrap();
            dev.wait_value_geq(s, gate.dev_addr(0), 1).unwrap();
            dev.memcpy_async(s, buf, early, len).unwrap();
            comm.recv(buf, len, DataType::U8, peer, s).expect("recv");
        }
        comm.bootstrap().barrier().unwrap();
        std::thread::sleep(Duration::from_millis(200));
        if r == 0 {
            assert!(!dev.stream_query(s).unwrap(), "the send's stream passed the op before the receiver's stream reached it");
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

/// One op with two flows each way between the pair: one gated, one above the limit.
fn mixed(comm: &Communicator, dev: &Arc<dyn Device>, s: StreamHandle) {
    let (r, peer) = (comm.rank(), 1 - comm.rank());
    let lens = [4096usize, LIMIT + 4096];
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

/// The victim holds its stream (for ever) in front of its side of a sendrecv with the
/// other rank and waits for its SIGKILL; the survivor's op must fail.
fn death_body(comm: &Communicator, dev: &Arc<dyn Device>, victim: usize) {
    let r = comm.rank();
    let s = new_stream(dev);
    let len = 64 << 10;
    let (sb, rb) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
    let gate = dev.alloc_flags(1).expect("flag");
    if r == victim {
        dev.wait_value_geq(s, gate.dev_addr(0), 1).unwrap();
    }
    // Rank 0 sends, rank 1 receives: a held receiver leaves the sender's gated copy waiting
    // for its ready flag, a held sender leaves the receiver waiting for its landed flag.
    let res = if r == 0 { comm.send(sb, len, DataType::U8, 1, s) } else { comm.recv(rb, len, DataType::U8, 0, s) };
    res.expect("enqueue");
    if r == victim {
        say(r, "point", "");
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
    sync(dev, s);
    let err = comm.wait_idle().expect_err("the op must fail once its peer is gone");
    say(r, "error", &format!("{:?}: {err}", err.code()));
    let t = Instant::now();
    comm.abort();
    let t_abort = t.elapsed();
    assert!(t_abort < Duration::from_millis(1500), "abort took {t_abort:?}");
    sync(dev, s);
    say(r, "done", &format!("abort {} ms", t_abort.as_millis()));
    std::mem::forget(gate);
}

/// Rank 0 sends 4 KiB, rank 1 expects 8 KiB: both gated by length, so the sender finds the
/// mismatch in the announcement and queues nothing; both fail, neither receive buffer
/// changes.
fn mismatch_body(comm: &Communicator, dev: &Arc<dyn Device>) {
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
    let mut after = vec![0u8; len];
    dev.copy_to_host(&mut after, buf).unwrap();
    assert!(after == before, "rank {r}: the buffer changed");
    say(r, "error", &format!("{:?} {} ms: {err}", err.code(), took.as_millis()));
    comm.abort();
    say(r, "done", "");
}

// ------------------------------------------------------------------ parent --------------

/// A child's report: event, unix ms, detail.
type Event = (String, u64, String);

/// Run the two children of `case` (`victim` killed once it reports its point); returns each
/// child's events and stderr and when the victim was killed, after checking that every
/// child not killed finished and exited 0 within `limit`.
fn run_children(backend: Backend, case: &str, gated: &str, victim: Option<usize>, limit: Duration) -> (Vec<Vec<Event>>, Vec<String>, Option<u64>) {
    let id = Communicator::unique_id(&test_config()).expect("unique id");
    let env = |r: usize| {
        [
            ("HOCCL_GATED_CHILD", format!("{} {r} {case} {}", id.to_hex(), victim.map_or(9, |v| v))),
            ("HOCCL_GATED_BACKEND", if backend == Backend::Cuda { "cuda" } else { "host" }.to_string()),
            ("HOCCL_GATED", gated.to_string()),
            // The gated path's own bodies: small transfers would go the staged way.
            ("HOCCL_STAGED_BYTES", "0".to_string()),
            ("HOCCL_TIMEOUT_MS", TMO_MS.to_string()),
            ("HOCCL_TRACE_OPS", "1-1000".to_string()),
            ("HOCCL_LOG", "hoccl::engine::proxy=info".to_string()),
        ]
        .map(|(k, v)| (k.to_string(), v))
        .to_vec()
    };
    // Let the survivor's op reach its wait before the kill.
    let kill = victim.map(|v| (v, Duration::from_millis(100)));
    let run = children::run("child_rank", N, env, kill, |l| event(l).is_some_and(|e| e.0 == "point"), limit);
    for r in (0..N).filter(|r| Some(*r) != victim) {
        let st = run.status[r].unwrap_or_else(|| panic!("{case} HOCCL_GATED={gated}: rank {r} still running after {limit:?}\n{}", run.dump()));
        assert!(st.success(), "{case} HOCCL_GATED={gated}: rank {r} exited with {st}\n{}", run.dump());
        assert!(run.lines.iter().any(|(q, l)| *q == r && event(l).is_some_and(|e| e.0 == "done")), "rank {r} did not finish\n{}", run.dump());
    }
    let events = (0..N).map(|r| run.lines.iter().filter(|(q, _)| *q == r).filter_map(|(_, l)| event(l)).collect()).collect();
    (events, run.stderr, run.kill_ms)
}

/// Op timelines that show gated copies queued (sender) and those that show none.
fn traced(stderr: &[String]) -> (usize, usize) {
    let lines: Vec<&str> = stderr.iter().flat_map(|e| e.lines()).filter(|l| l.contains("hoccl trace:")).collect();
    // A step the op did not have reads "gated_queued -,"; one it had, a signed time.
    let gated = lines.iter().filter(|l| l.split("gated_queued ").nth(1).is_some_and(|t| !t.starts_with("-,"))).count();
    (gated, lines.len() - gated)
}

fn ops(backend: Backend, gated: &str) {
    let (_, stderr, _) = run_children(backend, "ops", gated, None, Duration::from_secs(240));
    let (g, plain) = traced(&stderr);
    eprintln!("HOCCL_GATED={gated}: {g} op timelines with gated copies, {plain} without");
    if gated == "0" {
        assert_eq!(g, 0, "HOCCL_GATED=0 queued gated copies");
        assert!(plain > 0, "no op timeline was logged");
    } else {
        assert!(g > 0, "HOCCL_GATED={gated}: no op queued gated copies");
    }
}

fn peer_killed(backend: Backend, victim: usize) {
    let (events, stderr, kill_ms) = run_children(backend, "death", "1", Some(victim), Duration::from_secs(60));
    let survivor = 1 - victim;
    let kill_ms = kill_ms.expect("the victim reached its point");
    let (_, t, what) = events[survivor].iter().find(|e| e.0 == "error").cloned().unwrap_or_else(|| panic!("no error on rank {survivor}: {}", stderr[survivor]));
    let after = t as i64 - kill_ms as i64;
    eprintln!("peer killed: victim {victim}, rank {survivor} failed {after} ms after the kill: {what}");
    assert!(after <= (TMO_MS + 1000) as i64, "rank {survivor} saw its error {after} ms after the kill: {what}");
    assert!(what.starts_with("Remote") || what.starts_with("Timeout"), "{what}");
}

/// A copy queue waits for a flag in registered host memory before its copy and writes
/// another there after it; unregistering afterwards succeeds, twice does not.
fn queue_waits_and_writes(backend: Backend) {
    use std::sync::atomic::{AtomicU64, Ordering};
    let dev = open_device(backend, 0);
    // Host memory of this process, as a mailbox's flag area is: 64 words, 8-aligned.
    let words: Box<[AtomicU64]> = (0..64).map(|_| AtomicU64::new(0)).collect();
    let page = words.as_ptr() as *mut u8;
    let flags = dev.map_host(page, 64 * 8).expect("map_host");
    let (go, done) = (&words[0], &words[8]);
    let len = 1 << 20;
    let (src, dst) = (dev.alloc(len).unwrap(), dev.alloc(len).unwrap());
    let want = data(0, 77, len, false);
    dev.copy_from_host(src, &want).unwrap();
    dev.copy_from_host(dst, &vec![0u8; len]).unwrap();
    let mut q = dev.create_copy_queue().unwrap();
    q.wait_geq(flags, 5).unwrap();
    q.copy(dst, src, len).unwrap();
    q.write_value(flags.add(64), 9).unwrap();
    go.store(4, Ordering::Release);
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(done.load(Ordering::Acquire), 0, "the queue passed a wait for 5 on a flag holding 4");
    let mut got = vec![0u8; len];
    dev.copy_to_host(&mut got, dst).unwrap();
    assert!(got.iter().all(|b| *b == 0), "the copy ran before its wait passed");
    go.store(5, Ordering::Release);
    let t0 = Instant::now();
    while done.load(Ordering::Acquire) != 9 {
        assert!(t0.elapsed() < Duration::from_secs(10), "the flag write never landed");
        std::thread::yield_now();
    }
    dev.copy_to_host(&mut got, dst).unwrap();
    assert!(got == want, "the copy's bytes are not all there when its flag write is");
    drop(q);
    dev.unmap_host(page).expect("unmap_host");
    assert!(dev.unmap_host(page).is_err(), "a second unmap_host must fail");
    assert!(dev.map_host(std::ptr::null_mut(), 8).is_err() && dev.map_host(page, 0).is_err(), "bad ranges are errors");
    dev.free(src).unwrap();
    dev.free(dst).unwrap();
}

#[test]
fn queue_host() {
    queue_waits_and_writes(Backend::Host);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_queue() {
    queue_waits_and_writes(Backend::Cuda);
}

fn length_mismatch(backend: Backend) {
    let (events, _, _) = run_children(backend, "mismatch", "1", None, Duration::from_secs(60));
    let err = |r: usize| events[r].iter().find(|e| e.0 == "error").map(|e| e.2.clone()).unwrap_or_else(|| panic!("rank {r} reported no error"));
    let (e0, e1) = (err(0), err(1));
    eprintln!("length mismatch: rank 0 {e0}; rank 1 {e1}");
    assert!(e0.starts_with("InvalidUsage"), "the sender: {e0}");
    assert!(e1.starts_with("InvalidUsage") || e1.starts_with("Remote"), "the receiver: {e1}");
    let ms = |e: &str| e.split(' ').nth(1).and_then(|t| t.parse::<u64>().ok()).unwrap_or(u64::MAX);
    assert!(ms(&e0) < TMO_MS && ms(&e1) < TMO_MS, "a mismatch must fail at once, not by the timeout: {e0}; {e1}");
}

#[test]
fn length_mismatch_host() {
    length_mismatch(Backend::Host);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_length_mismatch() {
    length_mismatch(Backend::Cuda);
}

#[test]
fn ops_gated() {
    ops(Backend::Host, "1");
}

#[test]
fn ops_handshake() {
    ops(Backend::Host, "0");
}

#[test]
fn peer_killed_receiver() {
    peer_killed(Backend::Host, 1);
}

#[test]
fn peer_killed_sender() {
    peer_killed(Backend::Host, 0);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_ops_gated() {
    ops(Backend::Cuda, "1");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_ops_handshake() {
    ops(Backend::Cuda, "0");
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_peer_killed_receiver() {
    peer_killed(Backend::Cuda, 1);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_peer_killed_sender() {
    peer_killed(Backend::Cuda, 0);
}
