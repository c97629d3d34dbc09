//! Leaks (issue 41, item 5): communicator create/destroy cycles, each running collectives,
//! must give back every file descriptor, thread, `/dev/shm` object and mapping hoccl made;
//! collectives on buffers freed and reallocated at the same address must never be served a
//! stale cached entry (checked by their results).
//!
//! Cycles: `HOCCL_STRESS=full` runs 1000 of each; CI runs `CI_CYCLES` (threads) and
//! `CI_PROC_CYCLES` (processes), and `CI_REUSE_OPS` reallocation ops. Counts are compared
//! after a warm-up (the process-wide watchdog thread, malloc arenas, lazily opened files),
//! polling up to `SETTLE` for threads that finish after `destroy` returns. The tests of this
//! binary take `SERIAL`, so that none opens files or threads while another one counts.
//!
//! Memory is compared as the device layer reports it (`Device::memory_in_use`): device
//! memory (host backend: its shared-memory allocations; CUDA: `cuMemGetInfo`), hoccl's pinned
//! host memory and flag slabs, and open IPC imports. The flag pairs that the process-wide
//! pool keeps for later communicators are part of the warm-up values (docs/design.md, "Pairs
//! outlive communicators"). On CUDA (ignored tests) the same bodies run.
mod common;
use common::*;

use hoccl::bootstrap::tcp::{TcpBootstrap, UniqueId};
use hoccl::config::EngineChoice;
use hoccl::device::{pattern_byte, Device, MemoryInUse};
use hoccl::reduce::reduce_into;
use hoccl::{Bootstrap, Communicator, Config, DataType, RedOp};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CI_CYCLES: usize = 200;
const CI_PROC_CYCLES: usize = 100;
const CI_REUSE_OPS: usize = 300;
const FULL: usize = 1000;
const WARMUP: usize = 3;
const SETTLE: Duration = Duration::from_secs(10);
/// Total mappings may grow by a few that are not hoccl's: glibc's per-thread malloc arenas
/// and the stacks of the test harness's own threads. hoccl's shm mappings are counted
/// exactly (`Counts::shm_maps`).
const MAPS_SLACK: usize = 16;
const ENGINES: [EngineChoice; 3] = [EngineChoice::CopyEngine, EngineChoice::Compressed, EngineChoice::Auto];

static SERIAL: Mutex<()> = Mutex::new(());

fn full() -> bool {
    std::env::var("HOCCL_STRESS").is_ok_and(|v| v == "full")
}

fn n_of(ci: usize) -> usize {
    if full() {
        FULL
    } else {
        ci
    }
}

/// The counts once transient threads of the warm-up have had time to stop.
fn baseline(meter: &dyn Device) -> Counts {
    std::thread::sleep(Duration::from_millis(300));
    counts(meter)
}

/// What this process holds that hoccl could leak.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Counts {
    fds: usize,
    /// Threads named `hoccl*` (proxy, host streams and copy queues, TCP bootstrap).
    hoccl_threads: usize,
    /// Every thread, reported only: the test harness starts threads for other tests of
    /// this binary at any time (they wait for `SERIAL`).
    threads: usize,
    /// `/dev/shm/hoccl.<this pid>.*` objects (allocations and mailboxes).
    shm: usize,
    /// Mappings of hoccl shm objects: own allocations, mailboxes, imported peer buffers.
    shm_maps: usize,
    maps: usize,
    /// What the device layer holds, read through `meter` (any device of the backend: the
    /// host backend's and the pinned and import counts are process-wide).
    mem: MemoryInUse,
}

fn count_dir(p: &str) -> usize {
    std::fs::read_dir(p).map(|d| d.count()).unwrap_or(0)
}

fn counts(meter: &dyn Device) -> Counts {
    let prefix = format!("hoccl.{}.", std::process::id());
    let shm = std::fs::read_dir("/dev/shm")
        .map(|d| d.flatten().filter(|e| e.file_name().to_string_lossy().starts_with(&prefix)).count())
        .unwrap_or(0);
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let hoccl_threads = std::fs::read_dir("/proc/self/task")
        .map(|d| {
            d.flatten()
                .filter(|e| std::fs::read_to_string(e.path().join("comm")).is_ok_and(|n| n.starts_with("hoccl")))
                .count()
        })
        .unwrap_or(0);
    Counts {
        fds: count_dir("/proc/self/fd"),
        hoccl_threads,
        threads: count_dir("/proc/self/task"),
        shm,
        shm_maps: maps.lines().filter(|l| l.contains("/dev/shm/hoccl.")).count(),
        maps: maps.lines().count(),
        mem: meter.memory_in_use().expect("Device::memory_in_use"),
    }
}

/// Wait until the counts are back to `base` or below (total mappings within the slack);
/// returns the last counts and whether they got there. Below is no leak: the baseline may
/// catch a transient, such as the TCP root's listener thread, which stops on its own once
/// the communicator is formed.
fn settle(meter: &dyn Device, base: &Counts) -> (Counts, bool) {
    let t0 = Instant::now();
    loop {
        let now = counts(meter);
        let (m, b) = (&now.mem, &base.mem);
        let ok = now.fds <= base.fds
            && now.hoccl_threads <= base.hoccl_threads
            && now.shm <= base.shm
            && now.shm_maps <= base.shm_maps
            && now.maps <= base.maps + MAPS_SLACK
            && m.device_bytes <= b.device_bytes
            && m.pinned_host_bytes <= b.pinned_host_bytes
            && m.imports <= b.imports
            && m.import_bytes <= b.import_bytes;
        if ok || t0.elapsed() > SETTLE {
            return (now, ok);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn bytes_of(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern_byte(seed, i)).collect()
}

/// One cycle's work on a fresh communicator: an AllReduce (f32 sum, above the compressed
/// engine's 64 KiB threshold) and an AllGather, each checked.
fn cycle_body(c: &Communicator, cycle: u64) {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    c.reserve_reduce_scratch().unwrap();
    let s = new_stream(&dev);
    let count = 20_000usize;
    let len = count * 4;
    // Small integers in f32, so the sum is exact whatever the order.
    let vals = |p: usize| -> Vec<u8> { (0..count).flat_map(|i| (((i as u64 + cycle + p as u64) % 7) as f32).to_ne_bytes()).collect() };
    let send = Buf::new(&dev, len, 0, 1);
    let recv = Buf::new(&dev, len, 0, 2);
    dev.copy_from_host(send.ptr, &vals(r)).unwrap();
    let g_len = 1000 + cycle as usize % 13;
    let gs = Buf::new(&dev, g_len, 0, 3);
    let gr = Buf::new(&dev, n * g_len, 0, 4);
    dev.copy_from_host(gs.ptr, &bytes_of(seed_of(cycle, r, 0), g_len)).unwrap();
    c.all_reduce(send.ptr, recv.ptr, count, DataType::F32, RedOp::Sum, s).unwrap();
    c.all_gather(gs.ptr, gr.ptr, g_len, DataType::U8, s).unwrap();
    sync(&dev, s);
    let inputs: Vec<Vec<u8>> = (0..n).map(vals).collect();
    let srcs: Vec<&[u8]> = inputs.iter().map(|v| &v[..]).collect();
    let mut want = vec![0u8; len];
    reduce_into(DataType::F32, RedOp::Sum, &mut want, &srcs).unwrap();
    let got = recv.read_all();
    assert!(got[..len] == want[..], "cycle {cycle}: all_reduce result");
    assert_eq!(recv.guard_damage(&got), 0, "cycle {cycle}: guard bands");
    let got = gr.read_all();
    let want: Vec<u8> = (0..n).flat_map(|p| bytes_of(seed_of(cycle, p, 0), g_len)).collect();
    assert!(got[..n * g_len] == want[..], "cycle {cycle}: all_gather result");
}

/// `cycles` communicators of 2–4 thread ranks (the count and the engine vary by cycle),
/// each created, used and destroyed with its devices, streams and buffers.
fn thread_cycles(b: Backend) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let cycles = n_of(CI_CYCLES);
    let meter = open_device(b, 0);
    let one = |k: usize| {
        let cfg = Config { engine: ENGINES[k % 3], ..test_config() };
        run_ranks(b, 2 + k % 3, cfg, move |c| cycle_body(c, k as u64));
    };
    for k in 0..WARMUP {
        one(k);
    }
    let base = baseline(meter.as_ref());
    let t0 = Instant::now();
    for k in 0..cycles {
        one(WARMUP + k);
    }
    let (end, ok) = settle(meter.as_ref(), &base);
    eprintln!("{cycles} thread-rank cycles in {:?}: {base:?} -> {end:?}", t0.elapsed());
    assert!(ok, "after {cycles} cycles: {base:?} -> {end:?}");
}

/// Ops on buffers freed and reallocated between ops, so that new buffers land at addresses
/// an earlier buffer had (counted: the test fails if none did). Peers' IPC caches are keyed
/// by allocation id, not address; a stale entry would send the data to the freed mapping and
/// the result check fails.
fn reuse_body(c: &Communicator, ops: usize) -> usize {
    let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
    c.reserve_reduce_scratch().unwrap();
    let s = dev.create_stream().unwrap();
    let mut seen = std::collections::HashSet::new();
    let mut reused = 0;
    for k in 0..ops as u64 {
        // Two sizes, so that both reuse of one size and a different size at a freed
        // address occur.
        let count = if k % 3 == 0 { 3000 } else { 17_000 };
        let len = count * 4;
        let send = dev.alloc(len).unwrap();
        let recv = dev.alloc(n * len).unwrap();
        if !seen.insert(recv.0) {
            reused += 1;
        }
        let mine: Vec<u8> = (0..count).flat_map(|i| (((i as u64 * 3 + k + r as u64) % 5) as i32).to_ne_bytes()).collect();
        dev.copy_from_host(send, &mine).unwrap();
        if k % 2 == 0 {
            c.all_gather(send, recv, count, DataType::I32, s).unwrap();
        } else {
            c.all_reduce(send, recv, count, DataType::I32, RedOp::Sum, s).unwrap();
        }
        sync(&dev, s);
        let all: Vec<Vec<u8>> = (0..n)
            .map(|p| (0..count).flat_map(|i| (((i as u64 * 3 + k + p as u64) % 5) as i32).to_ne_bytes()).collect())
            .collect();
        let want: Vec<u8> = if k % 2 == 0 {
            all.concat()
        } else {
            let srcs: Vec<&[u8]> = all.iter().map(|v| &v[..]).collect();
            let mut w = vec![0u8; len];
            reduce_into(DataType::I32, RedOp::Sum, &mut w, &srcs).unwrap();
            w
        };
        let mut got = vec![0u8; want.len()];
        dev.copy_to_host(&mut got, recv).unwrap();
        assert!(got == want, "rank {r} op {k}: wrong result on a reallocated buffer at {:#x}", recv.0);
        // Every rank is done with this op's buffers (its peers' copies into `recv` included)
        // before anyone frees: a rank's frees then cannot race a peer still writing.
        quiesce(c);
        dev.free(send).unwrap();
        dev.free(recv).unwrap();
        // No rank allocates or enqueues the next op while another still frees: thread ranks
        // share one CUDA context, where cuMemFree waits for every stream, a peer's pending
        // collective included (docs/design.md, "Several ranks in one process on one GPU").
        c.bootstrap().barrier().unwrap();
    }
    quiesce(c);
    dev.destroy_stream(s).unwrap();
    reused
}

fn reused_addresses(b: Backend) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let ops = n_of(CI_REUSE_OPS);
    let meter = open_device(b, 0);
    let run = |ops: usize| {
        let total = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let t = total.clone();
        run_ranks(b, 3, Config { engine: EngineChoice::CopyEngine, ..test_config() }, move |c| {
            t.fetch_add(reuse_body(c, ops), std::sync::atomic::Ordering::Relaxed);
        });
        total.load(std::sync::atomic::Ordering::Relaxed)
    };
    // Warm-up: one short run fills the flag-pair pool and the lazily made state.
    run(WARMUP);
    let base = baseline(meter.as_ref());
    let t0 = Instant::now();
    let reused = run(ops);
    let (end, ok) = settle(meter.as_ref(), &base);
    eprintln!(
        "{ops} ops x 3 ranks on reallocated buffers in {:?}; {reused} receive buffers at a reused address: {base:?} -> {end:?}",
        t0.elapsed()
    );
    assert!(reused > ops / 2, "only {reused} of {} receive buffers reused an address: the test does not test reuse", 3 * ops);
    assert!(ok, "after {ops} ops on reallocated buffers: {base:?} -> {end:?}");
}

/// `Device::memory_in_use` follows what the device layer holds: device memory grows by at
/// least an allocation's length (CUDA rounds up), staging memory (`alloc_host`: pinned on
/// CUDA, shared memory on the host backend) by at least its length, flag slabs by their
/// bytes exactly; each is back to its start once freed. Without this the comparisons above
/// would hold for a meter that reads zero.
fn memory_accounting(b: Backend) {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let dev = open_device(b, 0);
    let at = || dev.memory_in_use().expect("memory_in_use");
    let base = at();
    let len = 3 << 20;
    let p = dev.alloc(len).unwrap();
    let m = at();
    assert!(m.device_bytes >= base.device_bytes + len as u64, "alloc: {base:?} -> {m:?}");
    let h = dev.alloc_host(len).unwrap();
    let m2 = at();
    assert!(m2.device_bytes + m2.pinned_host_bytes >= m.device_bytes + m.pinned_host_bytes + len as u64, "alloc_host: {m:?} -> {m2:?}");
    let flags = dev.alloc_flags(3).unwrap();
    let m3 = at();
    assert_eq!(m3.pinned_host_bytes, m2.pinned_host_bytes + 24, "alloc_flags(3): {m2:?} -> {m3:?}");
    drop(flags);
    dev.free_host(h).unwrap();
    dev.free(p).unwrap();
    let end = at();
    assert_eq!(end, base, "after freeing everything");
}

backend_tests!(thread_cycles, reused_addresses, memory_accounting);

// ------------------------------------------------------------------ processes -----------

const RANKS: usize = 3;
const TMO: Duration = Duration::from_secs(30);

/// The child side of `process_cycles`: does nothing unless `HOCCL_LEAKS_CHILD`
/// (`<hex id> <rank> <cycles> <reuse ops>`) is set. A control bootstrap made from the
/// parent's id carries each cycle's fresh unique id from rank 0 to the others; every cycle's
/// communicator comes from that id over its own TCP bootstrap, as an application's would.
/// Peers are other processes here, so their buffers are imported (mapped), which the thread
/// ranks never do.
#[test]
fn child() {
    let Ok(v) = std::env::var("HOCCL_LEAKS_CHILD") else { return };
    let mut it = v.split_whitespace();
    let id = UniqueId::from_hex(it.next().expect("id")).expect("id parses");
    let r: usize = it.next().expect("rank").parse().expect("rank");
    let cycles: usize = it.next().expect("cycles").parse().expect("cycles");
    let reuse_ops: usize = it.next().expect("ops").parse().expect("ops");
    let ctl = TcpBootstrap::init(&id, RANKS, r, TMO).expect("control bootstrap");
    let meter = open_device(Backend::Host, r);
    let one = |k: usize| {
        let cfg = Config { engine: ENGINES[k % 3], ..test_config() };
        let mine = if r == 0 { Communicator::unique_id(&cfg).expect("unique id").to_hex().into_bytes() } else { Vec::new() };
        let hex = String::from_utf8(ctl.all_gather(&mine).expect("all_gather")[0].clone()).expect("hex");
        let cid = UniqueId::from_hex(&hex).expect("cycle id");
        let dev = open_device(Backend::Host, r);
        let c = Communicator::from_unique_id_on(&cid, RANKS, r, Some(dev), cfg).expect("communicator");
        cycle_body(&c, k as u64);
        quiesce(&c);
        free_deferred();
        drop(c);
        ctl.barrier().expect("barrier");
    };
    for k in 0..WARMUP {
        one(k);
    }
    let base = baseline(meter.as_ref());
    for k in 0..cycles {
        one(WARMUP + k);
    }
    let (end, ok) = settle(meter.as_ref(), &base);
    assert!(ok, "rank {r} after {cycles} cycles: {base:?} -> {end:?}");
    // Reallocated buffers, imported by the peers: results right, and every import closed
    // once the communicator is destroyed.
    let cid_hex = {
        let mine = if r == 0 { Communicator::unique_id(&test_config()).unwrap().to_hex().into_bytes() } else { Vec::new() };
        String::from_utf8(ctl.all_gather(&mine).unwrap()[0].clone()).unwrap()
    };
    let dev = open_device(Backend::Host, r);
    let c = Communicator::from_unique_id_on(&UniqueId::from_hex(&cid_hex).unwrap(), RANKS, r, Some(dev), test_config()).unwrap();
    let reused = reuse_body(&c, reuse_ops);
    // A peer's buffer stays mapped in this rank's import cache after its owner freed it until
    // a new allocation of the owner overlaps it (the import then fails as on CUDA, which
    // proves the free: the mapping is retired and closed once the proxy is idle), it is
    // evicted beyond `IMPORT_CACHE_CAP` entries, or the communicator is destroyed. Freed
    // buffers whose range no new allocation reuses stay mapped; with most receive buffers
    // at a reused address, the open imports stay few (602 of 3 x 300 without the closes).
    let held = counts(meter.as_ref());
    assert!(held.mem.imports < 64, "rank {r}: {} imports open after {reuse_ops} ops on reallocated buffers: stale mappings pile up", held.mem.imports);
    drop(c);
    ctl.barrier().expect("barrier");
    let (end, ok) = settle(meter.as_ref(), &base);
    assert!(ok, "rank {r} after {reuse_ops} ops on reallocated buffers: {base:?} -> {end:?}");
    assert!(reused > reuse_ops / 2, "rank {r}: only {reused} of {reuse_ops} receive buffers at a reused address");
    println!(
        "rank {r}: {cycles} cycles, {reuse_ops} reuse ops ({reused} reused, {} shm mappings and {} imports of {} bytes before destroy): {base:?} -> {end:?}",
        held.shm_maps, held.mem.imports, held.mem.import_bytes
    );
}

/// `RANKS` processes (this binary re-run as `child`), each counting its own resources; at
/// the end no `/dev/shm` object of any child is left.
#[test]
fn process_cycles() {
    let _g = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    logs::capture();
    let cycles = n_of(CI_PROC_CYCLES);
    let reuse_ops = n_of(CI_REUSE_OPS);
    let exe = std::env::current_exe().expect("test binary");
    let id = UniqueId::new().expect("unique id");
    let t0 = Instant::now();
    let kids: Vec<_> = (0..RANKS)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", "child", "--nocapture", "--test-threads=1"])
                .env("HOCCL_LEAKS_CHILD", format!("{} {r} {cycles} {reuse_ops}", id.to_hex()))
                // Imports at the owner's address, as on CUDA: a buffer reallocated over a
                // freed one meets the stale mapping (`child`).
                .env("HOCCL_HOST_FIXED_ADDRESS_IMPORTS", "1")
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped())
                .spawn()
                .expect("spawn child rank")
        })
        .collect();
    let pids: Vec<u32> = kids.iter().map(|k| k.id()).collect();
    for (r, k) in kids.into_iter().enumerate() {
        let out = k.wait_with_output().expect("child");
        let so = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "rank {r}: {so}\n{}", String::from_utf8_lossy(&out.stderr));
        for l in so.lines().filter(|l| l.contains("reuse ops (")) {
            eprintln!("{l}");
        }
    }
    eprintln!("{RANKS} processes: {cycles} cycles + {reuse_ops} reuse ops in {:?}", t0.elapsed());
    let left: Vec<String> = std::fs::read_dir("/dev/shm")
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| pids.iter().any(|p| n.starts_with(&format!("hoccl.{p}."))))
        .collect();
    assert!(left.is_empty(), "shm objects left by the children: {left:?}");
}
