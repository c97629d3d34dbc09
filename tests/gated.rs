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
use hoccl::device::Device;
use hoccl::Communicator;
use common::ops::{Op, OPS};
use common::pair::*;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The gated limit (the chunk scheduler's single-copy limit).
const LIMIT: usize = 8 << 20;
const TMO_MS: u64 = 2000;

const H: Harness = Harness { tag: "GATED", child_var: "HOCCL_GATED_CHILD", backend_var: "HOCCL_GATED_BACKEND", timeout_ms: TMO_MS };

/// A child rank: `HOCCL_GATED_CHILD` = `<hex id> <rank> <case> <victim>`.
#[test]
fn child_rank() {
    let Some((comm, dev, case, victim)) = H.child() else { return };
    match case.as_str() {
        "ops" => ops_body(&comm, &dev),
        "death" => death_body(&H, &comm, &dev, victim, 64 << 10),
        "mismatch" => mismatch_body(&H, &comm, &dev, true),
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
    held_back(comm, dev, streams[0], &[4096, 1 << 20], |_| true);
    mixed(comm, dev, streams[1], &[4096, LIMIT + 4096]);
    H.say(r, "done", "");
}

// ------------------------------------------------------------------ parent --------------

/// The children of `case` with `HOCCL_GATED=gated`.
fn run_children(backend: Backend, case: &str, gated: &str, victim: Option<usize>, limit: Duration) -> (Vec<Vec<Event>>, Vec<String>, Option<u64>) {
    H.run_children(backend, case, &env(gated), victim, limit)
}

/// The gated path's settings; the staged path is off: small transfers would go that way.
fn env(gated: &str) -> Vec<(&'static str, String)> {
    vec![("HOCCL_GATED", gated.to_string()), ("HOCCL_STAGED_BYTES", "0".to_string())]
}

fn ops(backend: Backend, gated: &str) {
    let (_, stderr, _) = run_children(backend, "ops", gated, None, Duration::from_secs(240));
    let (g, plain) = traced(&stderr, "gated_queued");
    eprintln!("HOCCL_GATED={gated}: {g} op timelines with gated copies, {plain} without");
    if gated == "0" {
        assert_eq!(g, 0, "HOCCL_GATED=0 queued gated copies");
        assert!(plain > 0, "no op timeline was logged");
    } else {
        assert!(g > 0, "HOCCL_GATED={gated}: no op queued gated copies");
    }
}

fn peer_killed(backend: Backend, victim: usize) {
    H.peer_killed(backend, &env("1"), victim);
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
    H.length_mismatch(backend, &env("1"));
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
