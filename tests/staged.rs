//! Staged transfers between processes of one host (issues 37 and 39): every device operation
//! of a transfer up to `HOCCL_STAGED_BYTES` is enqueued by the calling thread during the call,
//! and the proxy makes no device call for it. The same bodies run with the path off
//! (`HOCCL_STAGED_BYTES=0`: gated and handshake transfers) as the reference.
//!
//! Every case runs two ranks as separate processes (this test binary re-run with
//! `HOCCL_STAGED_CHILD` set, joined through the TCP unique-id bootstrap), with small rings
//! (`HOCCL_STAGED_RING=4x64K`) and a 512 KiB limit, so that one transfer wraps the ring:
//! - `ops_*`: every copy-engine collective and the reductions at 0, 1, odd, slot ± 1,
//!   ring ± 1 and limit ± 1 bytes per block, ten ops in flight over two streams; then 300
//!   back-to-back sendrecvs over three streams (the ring wraps hundreds of times); an op
//!   whose receiving stream the application holds back; one op with staged, gated and
//!   proxy flows between the pair; the proxy's device calls over 50 staged sendrecvs,
//!   which must be none (`device::calls`); and the calling thread's device calls per staged
//!   sendrecv, which must be the batched count (`staged_sendrecv_calls`). The op timelines
//!   (`HOCCL_TRACE_OPS`) show which path ran.
//! - `driver_gate_*`: the PyTorch hang's regression test. Right after a sendrecv each rank's
//!   application thread holds the driver gate (`device::calls::DriverGate`: every proxy
//!   device call waits for it, as every driver call waits while another thread of the
//!   context is in a pageable copy) while it waits for the op's stream. Staged: the op
//!   completes. Path off: it cannot complete until the gate is dropped.
//! - `proxy_stuck_*`: an op staged throughout completes without any proxy turn. Each
//!   rank's proxy is held inside a device call (the driver gate, held by the application
//!   thread, stops it in a call for a larger sendrecv that the proxy moves), and a staged
//!   sendrecv on another stream must still complete: its streams wait on the staged
//!   queues' own words, not on the proxy's `finish`. Path off: it cannot.
//! - `peer_killed_*`: the receiver (stream held, so the sender's staged queue waits for a
//!   free slot after filling the ring) or the sender (stream held, so the receiver's stream
//!   waits for `staged`) is SIGKILLed; the survivor fails within `HOCCL_TIMEOUT_MS` + 1 s,
//!   its stream released, and exits 0.
//! - `length_mismatch_*`: a staged send into a longer staged receive fails on both sides
//!   at once (the failed op's output is undefined).
//!
//! The `cuda_*` tests run the same bodies on GPU 0 (two processes on one GPU; ignored
//! without one: `cargo test --test staged -- --ignored`).
mod common;
use common::ops::{Op, OPS};
use common::pair::*;
use common::*;
use hoccl::device::calls::{counted, DriverGate};
use hoccl::device::Device;
use hoccl::types::DataType;
use hoccl::Communicator;
use std::sync::Arc;
use std::time::{Duration, Instant};

const SLOT: usize = 64 << 10;
const SLOTS: usize = 4;
const LIMIT: usize = 512 << 10;
const TMO_MS: u64 = 2000;

const H: Harness = Harness { tag: "STAGED", child_var: "HOCCL_STAGED_CHILD", backend_var: "HOCCL_STAGED_BACKEND", timeout_ms: TMO_MS };

/// Whether the staged path is on in this child (the parent sets `HOCCL_STAGED_BYTES`).
fn staged_on() -> bool {
    std::env::var("HOCCL_STAGED_BYTES").as_deref() != Ok("0")
}

/// A child rank: `HOCCL_STAGED_CHILD` = `<hex id> <rank> <case> <victim>`.
#[test]
fn child_rank() {
    let Some((comm, dev, case, victim)) = H.child() else { return };
    match case.as_str() {
        "ops" => ops_body(&comm, &dev),
        "gate" => gate_body(&comm, &dev),
        "death" => death_body(&H, &comm, &dev, victim, LIMIT),
        "mismatch" => mismatch_body(&H, &comm, &dev, false),
        "burst" => burst_body(&comm, &dev),
        "stuck" => stuck_body(&comm, &dev),
        other => panic!("unknown case {other}"),
    }
}

fn ops_body(comm: &Communicator, dev: &Arc<dyn Device>) {
    let r = comm.rank();
    let streams = [new_stream(dev), new_stream(dev), new_stream(dev)];
    let ring = SLOTS * SLOT;
    let mut case = 0u64;
    for bytes in [0, 1, 1001, SLOT - 1, SLOT, SLOT + 1, ring - 1, ring, ring + 1, LIMIT - 1, LIMIT, LIMIT + 1] {
        let mut pending = Vec::new();
        for (i, op) in OPS.iter().enumerate() {
            let reduction = matches!(op, Op::AllReduce | Op::ReduceScatter | Op::Reduce);
            let c = if reduction { bytes.div_ceil(4) } else { bytes };
            case += 1;
            pending.push(start(comm, dev, *op, c, case, streams[i % 2]));
        }
        streams.iter().for_each(|s| sync(dev, *s));
        comm.wait_idle().expect("wait_idle");
        pending.into_iter().for_each(|p| check(dev, r, p));
        comm.bootstrap().barrier().expect("barrier");
    }
    // Back to back on three streams: the ring wraps many times.
    let mut pending = Vec::new();
    for i in 0..300 {
        case += 1;
        pending.push(start(comm, dev, Op::SendRecv, 100_000 + i, case, streams[i % 3]));
        if pending.len() == 30 {
            streams.iter().for_each(|s| sync(dev, *s));
            pending.drain(..).for_each(|p| check(dev, r, p));
        }
    }
    streams.iter().for_each(|s| sync(dev, *s));
    comm.wait_idle().expect("wait_idle");
    // Above the ring, the sender waits for the held receiver to drain.
    held_back(comm, dev, streams[0], &[4096, LIMIT], |len| len > SLOTS * SLOT);
    // Staged, gated (up to 8 MiB) and through the proxy (above).
    mixed(comm, dev, streams[1], &[4096, LIMIT + 4096, (8 << 20) + 4096]);
    comm.bootstrap().barrier().expect("barrier");
    // The proxy's device calls over staged ops: none (warm: the streams' flags exist).
    let before = counted();
    let mut pending = Vec::new();
    for i in 0..50 {
        case += 1;
        pending.push(start(comm, dev, Op::SendRecv, 4096, case, streams[i % 2]));
    }
    streams.iter().for_each(|s| sync(dev, *s));
    comm.wait_idle().expect("wait_idle");
    let calls = counted() - before;
    pending.into_iter().for_each(|p| check(dev, r, p));
    H.say(r, "proxy_calls", &calls.to_string());
    if staged_on() {
        assert_eq!(calls, 0, "rank {r}: the proxy made {calls} device calls for 50 staged sendrecvs");
    }
    let per_op = call_time_calls(comm, dev, streams[2]);
    H.say(r, "call_calls", &per_op.to_string());
    H.say(r, "bounced", &hoccl::ipc::bounced_transfers().to_string());
    H.say(r, "done", "");
}

/// The calling thread's device calls per staged sendrecv of one chunk each way: on the user
/// stream `[write start, wait staged, wait drained]`, the copy out of the slot, `[write
/// drained, wait copied]`; on the staged queue `[wait start, wait for the slot]`, the copy
/// into it, `[write copied, write staged]` (6 enqueues, each bracket one batch); and two
/// lookups of the buffers' allocations; on CUDA also the capture query
/// (`cuStreamIsCapturing`).
fn staged_sendrecv_calls(dev: &dyn Device) -> u64 {
    6 + 2 + u64::from(dev.backend() == hoccl::device::Backend::Cuda)
}

/// Sendrecvs of one slot each way (one chunk): the device calls that the calling thread
/// (from here on counted too, besides the proxy's) makes per op, enqueues and queries
/// together; with the staged path on, exactly [`staged_sendrecv_calls`].
fn call_time_calls(comm: &Communicator, dev: &Arc<dyn Device>, s: hoccl::StreamHandle) -> u64 {
    const N: u64 = 20;
    let (r, peer) = (comm.rank(), 1 - comm.rank());
    let (send, recv) = (dev.alloc(4096).expect("alloc"), dev.alloc(4096).expect("alloc"));
    let op = || comm.group(|g| {
        g.send(send, 4096, DataType::U8, peer, s)?;
        g.recv(recv, 4096, DataType::U8, peer, s)
    });
    op().expect("warm-up sendrecv");
    hoccl::device::calls::count_calls_here();
    let before = counted();
    (0..N).for_each(|_| op().expect("sendrecv"));
    let calls = counted() - before;
    sync(dev, s);
    comm.wait_idle().expect("wait_idle");
    dev.free(send).expect("free");
    dev.free(recv).expect("free");
    if staged_on() {
        // The proxy makes none for staged ops (checked above), so all of them are the caller's.
        let want = staged_sendrecv_calls(dev.as_ref());
        assert_eq!(calls, N * want, "rank {r}: {calls} device calls over {N} staged sendrecvs, want {want} each");
    }
    calls / N
}

/// A sendrecv, then the application thread holds the driver gate while it waits (1.5 s at
/// most, below the timeout) for the op's stream; reports whether the op completed under the gate.
fn gate_body(comm: &Communicator, dev: &Arc<dyn Device>) {
    let r = comm.rank();
    let s = new_stream(dev);
    // Warm: the stream's flags and the peers' mappings exist before the gate.
    let p = start(comm, dev, Op::SendRecv, 4096, 1, s);
    sync(dev, s);
    comm.wait_idle().expect("wait_idle");
    check(dev, r, p);
    comm.bootstrap().barrier().unwrap();
    let p = start(comm, dev, Op::SendRecv, 4096, 2, s);
    let t0 = Instant::now();
    let completed = {
        let _gate = DriverGate::hold();
        completes(dev, s, t0)
    };
    H.say(r, "gated_wait", &format!("{} {}", completed, t0.elapsed().as_millis()));
    sync(dev, s);
    comm.wait_idle().expect("the op completes once the gate is dropped");
    check(dev, r, p);
    H.say(r, "done", "");
}

/// Whether stream `s` completes within 1.5 s of `t0` (below the timeout).
fn completes(dev: &Arc<dyn Device>, s: hoccl::StreamHandle, t0: Instant) -> bool {
    loop {
        if dev.stream_query(s).expect("stream_query") {
            return true;
        }
        if t0.elapsed() > Duration::from_millis(1500) {
            return false;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// A sendrecv above the staged limit (the proxy's to move) on one stream while the
/// application thread holds the driver gate: the proxy enters a device call for it and
/// stays there. Then a staged sendrecv on another stream; reports whether that stream
/// completed (1.5 s at most, below the timeout) while the proxy was held.
fn stuck_body(comm: &Communicator, dev: &Arc<dyn Device>) {
    let r = comm.rank();
    let (big, small) = (new_stream(dev), new_stream(dev));
    // Warm: the streams' flags and the peers' mappings exist before the gate.
    for (i, (s, c)) in [(big, LIMIT + 4096), (small, 4096)].into_iter().enumerate() {
        let p = start(comm, dev, Op::SendRecv, c, 1 + i as u64, s);
        sync(dev, s);
        check(dev, r, p);
    }
    comm.wait_idle().expect("wait_idle");
    comm.bootstrap().barrier().unwrap();
    let t0 = Instant::now();
    let (completed, p_big, p_small) = {
        let _gate = DriverGate::hold();
        let before = counted();
        let p_big = start(comm, dev, Op::SendRecv, LIMIT + 4096, 3, big);
        // The proxy entered a device call (counted before it waits for the gate).
        while counted() == before {
            assert!(t0.elapsed() < Duration::from_millis(1000), "rank {r}: the proxy made no device call for the large sendrecv");
            std::thread::sleep(Duration::from_millis(1));
        }
        let p_small = start(comm, dev, Op::SendRecv, 4096, 4, small);
        (completes(dev, small, t0), p_big, p_small)
    };
    H.say(r, "stuck_wait", &format!("{} {}", completed, t0.elapsed().as_millis()));
    [big, small].iter().for_each(|s| sync(dev, *s));
    comm.wait_idle().expect("both ops complete once the gate is dropped");
    check(dev, r, p_big);
    check(dev, r, p_small);
    H.say(r, "done", "");
}

/// Sends the staged queue cannot take at once: rank 0 issues `BURST` one-slot sends before
/// rank 1 posts any receive, so its queue to rank 1 reaches its budget
/// (`STAGED_QUEUE_ENTRIES`) and the rest is held back for the proxy, which enqueues it as
/// rank 1 drains. Rank 0 reports its proxy's device calls (some, the held-back entries) and
/// rank 1 checks every byte.
const BURST: usize = 120;

fn burst_body(comm: &Communicator, dev: &Arc<dyn Device>) {
    let r = comm.rank();
    let s = new_stream(dev);
    let bufs: Vec<(hoccl::DevPtr, Vec<u8>)> = (0..BURST).map(|i| (dev.alloc(SLOT).unwrap(), data(0, 500 + i as u64, SLOT, false))).collect();
    if r == 1 {
        // Poison: a receive that did not land shows.
        bufs.iter().for_each(|(b, _)| dev.copy_from_host(*b, &vec![0x5a; SLOT]).unwrap());
    }
    comm.bootstrap().barrier().unwrap();
    let before = counted();
    if r == 0 {
        for (b, want) in &bufs {
            dev.copy_from_host(*b, want).unwrap();
            comm.send(*b, SLOT, DataType::U8, 1, s).expect("send");
        }
    }
    comm.bootstrap().barrier().unwrap();
    if r == 1 {
        for (b, _) in &bufs {
            comm.recv(*b, SLOT, DataType::U8, 0, s).expect("recv");
        }
    }
    sync(dev, s);
    comm.wait_idle().expect("wait_idle");
    H.say(r, "proxy_calls", &(counted() - before).to_string());
    if r == 1 {
        for (i, (b, want)) in bufs.iter().enumerate() {
            let mut got = vec![0u8; SLOT];
            dev.copy_to_host(&mut got, *b).unwrap();
            assert!(got == *want, "burst: receive {i} landed wrong");
        }
    }
    bufs.into_iter().for_each(|(b, _)| dev.free(b).unwrap());
    H.say(r, "done", "");
}

// ------------------------------------------------------------------ parent --------------

/// The children of `case` with the staged path on (small rings, a 512 KiB limit) or off.
fn run_children(backend: Backend, case: &str, staged: bool, victim: Option<usize>, limit: Duration) -> (Vec<Vec<Event>>, Vec<String>, Option<u64>) {
    H.run_children(backend, case, &env(staged), victim, limit)
}

/// The host backend imports at CUDA's fixed addresses (`HOCCL_HOST_FIXED_ADDRESS_IMPORTS`):
/// the bodies free and allocate buffers per op, so, as on CUDA, some transfers meet stale
/// mappings of freed receive buffers and take the bounce ring.
fn env(staged: bool) -> Vec<(&'static str, String)> {
    vec![
        ("HOCCL_STAGED_BYTES", if staged { LIMIT.to_string() } else { "0".to_string() }),
        ("HOCCL_STAGED_RING", format!("{SLOTS}x{SLOT}")),
        ("HOCCL_HOST_FIXED_ADDRESS_IMPORTS", "1".to_string()),
    ]
}

fn ops(backend: Backend, staged: bool) {
    let (events, stderr, _) = run_children(backend, "ops", staged, None, Duration::from_secs(300));
    let (s, other) = traced(&stderr, "staged_seen");
    let calls: Vec<String> = events.iter().filter_map(|e| e.iter().find(|e| e.0 == "proxy_calls").map(|e| e.2.clone())).collect();
    let per_op: Vec<String> = events.iter().filter_map(|e| e.iter().find(|e| e.0 == "call_calls").map(|e| e.2.clone())).collect();
    let bounced: Vec<String> = events.iter().filter_map(|e| e.iter().find(|e| e.0 == "bounced").map(|e| e.2.clone())).collect();
    eprintln!("staged={staged}: {s} op timelines with staged transfers, {other} without; proxy device calls over 50 sendrecvs: {calls:?}; calling thread's device calls per sendrecv: {per_op:?}; transfers bounced past stale mappings: {bounced:?}");
    assert!(other > 0, "no other op timeline was logged (the mixed op and larger sizes have one)");
    if staged {
        assert!(s > 0, "no op took the staged path");
    } else {
        assert_eq!(s, 0, "HOCCL_STAGED_BYTES=0 took the staged path");
        assert!(calls.iter().all(|c| c.parse::<u64>().is_ok_and(|n| n > 0)), "the handshake path made no proxy device calls? {calls:?}");
    }
}

fn driver_gate(backend: Backend, staged: bool) {
    let (events, stderr, _) = run_children(backend, "gate", staged, None, Duration::from_secs(60));
    for (r, ev) in events.iter().enumerate() {
        let (_, _, d) = ev.iter().find(|e| e.0 == "gated_wait").cloned().unwrap_or_else(|| panic!("rank {r}: no report: {}", stderr[r]));
        eprintln!("driver gate held, staged={staged}: rank {r}: completed, ms: {d}");
        let completed = d.starts_with("true");
        assert_eq!(completed, staged, "rank {r}: with the driver gate held the op {} (staged={staged})", if completed { "completed" } else { "did not complete" });
    }
}

fn proxy_stuck(backend: Backend, staged: bool) {
    let (events, stderr, _) = run_children(backend, "stuck", staged, None, Duration::from_secs(60));
    for (r, ev) in events.iter().enumerate() {
        let (_, _, d) = ev.iter().find(|e| e.0 == "stuck_wait").cloned().unwrap_or_else(|| panic!("rank {r}: no report: {}", stderr[r]));
        eprintln!("proxy held in a device call, staged={staged}: rank {r}: completed, ms: {d}");
        let completed = d.starts_with("true");
        assert_eq!(completed, staged, "rank {r}: with its proxy held the staged sendrecv {} (staged={staged})", if completed { "completed" } else { "did not complete" });
        assert!(ev.iter().any(|e| e.0 == "done"), "rank {r} did not finish: {}", stderr[r]);
    }
}

fn peer_killed(backend: Backend, victim: usize) {
    H.peer_killed(backend, &env(true), victim);
}

fn length_mismatch(backend: Backend) {
    H.length_mismatch(backend, &env(true));
}

/// The burst's sends: with the staged path on, the proxy enqueued what the queue's budget
/// held back (device calls on rank 0); every byte arrived (rank 1 checks).
fn burst(backend: Backend) {
    let (events, stderr, _) = run_children(backend, "burst", true, None, Duration::from_secs(120));
    let calls = |r: usize| events[r].iter().find(|e| e.0 == "proxy_calls").map(|e| e.2.clone()).unwrap_or_else(|| panic!("rank {r}: no report: {}", stderr[r]));
    eprintln!("burst of {BURST} sends: proxy device calls {} (sender), {} (receiver)", calls(0), calls(1));
    assert!(events[1].iter().any(|e| e.0 == "done"), "rank 1 did not finish: {}", stderr[1]);
    assert!(calls(0).parse::<u64>().is_ok_and(|n| n > 0), "the sender's proxy enqueued nothing: the queue took {BURST} sends at the call?");
}

#[test]
fn burst_held_back() {
    burst(Backend::Host);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_burst_held_back() {
    burst(Backend::Cuda);
}

#[test]
fn ops_staged() {
    ops(Backend::Host, true);
}

#[test]
fn ops_staged_off() {
    ops(Backend::Host, false);
}

#[test]
fn driver_gate_staged() {
    driver_gate(Backend::Host, true);
}

#[test]
fn driver_gate_handshake() {
    driver_gate(Backend::Host, false);
}

#[test]
fn proxy_stuck_staged() {
    proxy_stuck(Backend::Host, true);
}

#[test]
fn proxy_stuck_handshake() {
    proxy_stuck(Backend::Host, false);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_proxy_stuck_staged() {
    proxy_stuck(Backend::Cuda, true);
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
fn length_mismatch_host() {
    length_mismatch(Backend::Host);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_ops_staged() {
    ops(Backend::Cuda, true);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_ops_staged_off() {
    ops(Backend::Cuda, false);
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

#[test]
#[ignore = "needs a GPU"]
fn cuda_length_mismatch() {
    length_mismatch(Backend::Cuda);
}

/// On CUDA the real driver lock stands in for the gate: the proxy's device calls would wait
/// for it all the same; the staged op must complete (the gate is held too, harmlessly).
#[test]
#[ignore = "needs a GPU"]
fn cuda_driver_gate_staged() {
    driver_gate(Backend::Cuda, true);
}
