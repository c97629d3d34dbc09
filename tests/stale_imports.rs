//! Receive buffers freed and reallocated between processes (issues 37 and 41): a sender
//! keeps its mapping of a peer's allocation cached, and CUDA may map an import at its
//! owner's address, so once the receiver frees a receive buffer and allocates one over it,
//! the new allocation may not be importable while the stale mapping is open
//! (`CUDA_ERROR_ALREADY_MAPPED`; the H200 has also mapped it beside the stale one). The op
//! must still succeed (refused, the transfer takes the bounce ring in host memory) and the
//! stale mapping must be closed once the sender's proxy is idle, so that mappings do not
//! pile up.
//!
//! Two ranks as separate processes (this binary re-run with `HOCCL_STALE_CHILD` set, joined
//! through the TCP unique-id bootstrap). Rank 1 receives [`CYCLES`] times (half as many on
//! the host backend) two transfers of
//! [`LEN`] bytes (five bounce slots: the ring wraps) from rank 0: one into its current
//! buffer, then, after freeing it and allocating one that overlaps it (asserted), one into
//! the new buffer. Every byte is checked. Rank 0 counts the transfers bounced (one per
//! cycle: the second), waits at the end of each cycle until the cycle's stale mapping was
//! closed and its open imports are back to at most one more than at the start, and after the
//! communicator's destroy both ranks' open imports and pinned host memory (bounce rings)
//! are back at their start (pinned memory as it was after the first transfer, which made
//! the stream's flags: their pool outlives a communicator).
//!
//! The host backend maps imports at addresses of its own, so it runs with
//! `HOCCL_HOST_FIXED_ADDRESS_IMPORTS=1`, its test hook that follows CUDA's rule. The
//! `cuda_*` test runs the same body on GPU 0 (two processes on one GPU; ignored without
//! one: `cargo test --test stale_imports -- --ignored`).
mod common;
use common::pair::*;
use common::*;
use hoccl::device::{pattern_byte, DevPtr, Device};
use hoccl::types::DataType;
use hoccl::Communicator;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Cycles on CUDA; the host backend runs half as many (its copies are CPU threads: about
/// 0.12 s a cycle).
const CYCLES: u64 = 200;
/// Bytes per transfer: more than a bounce ring (4 slots of 2 MiB) and not a multiple of a
/// slot.
const LEN: usize = (9 << 20) + 4097;
const TMO_MS: u64 = 5000;

const H: Harness = Harness { tag: "STALE", child_var: "HOCCL_STALE_CHILD", backend_var: "HOCCL_STALE_BACKEND", timeout_ms: TMO_MS };

#[test]
fn child_rank() {
    let Some((comm, dev, case, _)) = H.child() else { return };
    match case.as_str() {
        "realloc" => realloc_body(comm, &dev),
        other => panic!("unknown case {other}"),
    }
}

fn overlaps(a: DevPtr, b: DevPtr, len: usize) -> bool {
    a.0 < b.0 + len as u64 && b.0 < a.0 + len as u64
}

/// Rank 1: free `old` and allocate `len` bytes that overlap it (allocations that do not are
/// kept aside until one does, then freed).
fn realloc_over(dev: &Arc<dyn Device>, old: DevPtr, len: usize) -> DevPtr {
    dev.free(old).expect("free");
    let mut misses = Vec::new();
    let new = loop {
        let p = dev.alloc(len).expect("alloc");
        if overlaps(p, old, len) {
            break p;
        }
        misses.push(p);
        assert!(misses.len() < 16, "no allocation of {len} bytes overlaps the freed one at {:#x}: {misses:x?}", old.0);
    };
    misses.into_iter().for_each(|p| dev.free(p).expect("free"));
    new
}

fn realloc_body(comm: Communicator, dev: &Arc<dyn Device>) {
    let r = comm.rank();
    let s = new_stream(dev);
    let start = dev.memory_in_use().expect("memory_in_use");
    let bounced0 = hoccl::ipc::bounced_transfers();
    let closed0 = hoccl::ipc::retired_closed();
    let cycles = if dev.backend() == hoccl::device::Backend::Cuda { CYCLES } else { CYCLES / 2 };
    let mut buf = dev.alloc(LEN).expect("alloc");
    let poison: Vec<u8> = (0..LEN).map(|i| pattern_byte(0xdead, i as u64)).collect();
    let mut slow_settle = Duration::ZERO;
    // Pinned host memory once the stream's flags exist (their pool outlives the
    // communicator) and before any bounce ring.
    let mut pinned = None;
    // Per half: the time from the call to the stream's completion (rank 0: the send).
    let mut times: [Vec<f64>; 2] = [Vec::new(), Vec::new()];
    for c in 0..cycles {
        for half in 0..2u64 {
            let case = 2 * c + half;
            if r == 1 && half == 1 {
                buf = realloc_over(dev, buf, LEN);
            }
            let want: Vec<u8> = (0..LEN).map(|i| pattern_byte(case, i as u64)).collect();
            // Both ranks are at this transfer before it is timed.
            comm.bootstrap().barrier().expect("barrier");
            let t = Instant::now();
            if r == 0 {
                dev.copy_from_host(buf, &want).expect("fill");
                comm.send(buf, LEN, DataType::U8, 1, s).unwrap_or_else(|e| panic!("cycle {c}.{half}: send: {e}"));
            } else {
                dev.copy_from_host(buf, &poison).expect("poison");
                comm.recv(buf, LEN, DataType::U8, 0, s).unwrap_or_else(|e| panic!("cycle {c}.{half}: recv: {e}"));
            }
            sync(dev, s);
            times[half as usize].push(t.elapsed().as_secs_f64() * 1e3);
            pinned.get_or_insert(dev.memory_in_use().expect("memory_in_use").pinned_host_bytes);
            if let Some(e) = comm.async_error() {
                panic!("rank {r}: cycle {c}.{half}: {e}");
            }
            if r == 1 {
                let mut got = vec![0u8; LEN];
                dev.copy_to_host(&mut got, buf).expect("read");
                let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "cycle {c}.{half}: {bad} of {LEN} bytes wrong");
            }
        }
        if r == 0 {
            // The stale mapping is closed once the proxy is idle: at most the mapping of
            // the receiver's current buffer stays open.
            let t0 = Instant::now();
            loop {
                let now = dev.memory_in_use().expect("memory_in_use").imports;
                let closed = hoccl::ipc::retired_closed() - closed0;
                if now <= start.imports + 1 && closed > c {
                    break;
                }
                assert!(t0.elapsed() < Duration::from_secs(2), "cycle {c}: {now} imports open, {} at the start, {closed} stale mappings closed: the stale mapping was not closed", start.imports);
                std::thread::sleep(Duration::from_micros(200));
            }
            slow_settle = slow_settle.max(t0.elapsed());
        }
        comm.bootstrap().barrier().expect("barrier");
    }
    let bounced = hoccl::ipc::bounced_transfers() - bounced0;
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (direct, bounced_ms) = (median(&mut times[0]), median(&mut times[1]));
    H.say(
        r,
        "bounced",
        &format!(
            "{bounced} of {cycles} cycles, closed {} while idle, longest wait for the close {:.2} ms; median transfer {direct:.2} ms into the mapped buffer, {bounced_ms:.2} ms into the new one",
            hoccl::ipc::retired_closed() - closed0,
            slow_settle.as_secs_f64() * 1e3
        ),
    );
    let fixed = std::env::var("HOCCL_HOST_FIXED_ADDRESS_IMPORTS").is_ok_and(|v| v == "1");
    if r == 0 && dev.backend() != hoccl::device::Backend::Cuda {
        // The host backend's hook always refuses the overlapping import; CUDA may map it
        // beside the stale mapping instead (then nothing bounces, and the close above
        // still proves the stale mapping retired).
        let want = if fixed { cycles } else { 0 };
        assert_eq!(bounced, want, "with fixed-address imports one transfer per cycle meets the stale mapping of the freed buffer and must take the bounce ring; without, none");
    }
    assert!(bounced <= cycles, "{bounced} transfers bounced in {cycles} cycles: only the one into a new buffer may");
    comm.wait_idle().expect("wait_idle");
    drop(comm);
    dev.free(buf).expect("free");
    free_deferred();
    let end = dev.memory_in_use().expect("memory_in_use");
    let pinned = pinned.unwrap_or_default();
    H.say(r, "imports", &format!("{} -> {}, pinned {pinned} -> {}", start.imports, end.imports, end.pinned_host_bytes));
    assert_eq!(end.imports, start.imports, "open imports after destroy");
    assert_eq!(end.pinned_host_bytes, pinned, "pinned host memory after destroy (bounce rings)");
    H.say(r, "done", "");
}

fn realloc(backend: Backend, fixed: bool) {
    let env = vec![("HOCCL_HOST_FIXED_ADDRESS_IMPORTS", if fixed { "1" } else { "0" }.to_string())];
    let t0 = Instant::now();
    let (events, stderr, _) = H.run_children(backend, "realloc", &env, None, Duration::from_secs(300));
    for (r, ev) in events.iter().enumerate() {
        let get = |what: &str| ev.iter().find(|e| e.0 == what).map(|e| e.2.clone()).unwrap_or_else(|| panic!("rank {r}: no {what}: {}", stderr[r]));
        eprintln!("rank {r}: bounced {}; imports {}", get("bounced"), get("imports"));
    }
    eprintln!("{LEN} B per transfer, in {:?}", t0.elapsed());
}

#[test]
fn realloc_host() {
    realloc(Backend::Host, true);
}

/// The host backend mapping each import at an address of its own, as CUDA has also done:
/// nothing bounces, and the stale mappings are retired and closed all the same.
#[test]
fn realloc_host_beside() {
    realloc(Backend::Host, false);
}

#[test]
#[ignore = "needs a GPU"]
fn cuda_realloc() {
    realloc(Backend::Cuda, true);
}
