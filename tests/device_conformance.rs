//! One conformance body for every device backend: [`conformance`] exercises each `Device`
//! and `CopyQueue` method and states the contract the engine relies on. Backends
//! instantiate it below: host (runs everywhere) and CUDA (ignored: it needs a GPU).
//!
//! Run on a GPU machine:
//!   cargo test --release --test device_conformance -- --ignored --test-threads=1
//! `HOCCL_TEST_DEVICE=<ordinal>` picks the GPU (default 0).
use hoccl::config::BackendChoice;
use hoccl::device::cuda::{self, CudaDevice};
use hoccl::device::{self, kernels, pattern_byte, Backend, DevPtr, Device};
use hoccl::ErrorCode;
use std::sync::Arc;
use std::time::{Duration, Instant};

const TIMEOUT: Duration = Duration::from_secs(20);
const CHILD_ENV: &str = "HOCCL_CONFORMANCE_CHILD";

fn test_ordinal() -> usize {
    std::env::var("HOCCL_TEST_DEVICE").ok().and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64).map(|i| pattern_byte(seed, i)).collect()
}

/// Bytes of `got` that differ from the pattern (counted, not stopped at the first).
fn mismatches(got: &[u8], seed: u64) -> usize {
    got.iter().enumerate().filter(|&(i, &b)| b != pattern_byte(seed, i as u64)).count()
}

fn read(dev: &dyn Device, p: DevPtr, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    dev.copy_to_host(&mut v, p).expect("copy_to_host");
    v
}

/// Poll `f` until it returns true or TIMEOUT passes.
fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < TIMEOUT, "timed out waiting for {what}");
        std::thread::yield_now();
    }
}

/// Every `Device` method, in the order the engine uses them.
fn conformance(dev: Arc<dyn Device>) {
    identity(dev.as_ref());
    allocation_identity(dev.as_ref());
    export_import_in_process(dev.as_ref());
    flags_and_stream_ordering(dev.as_ref());
    batched_mem_ops(dev.as_ref());
    memcpy_async_unaligned(dev.as_ref());
    fill_pattern_matches_cpu(dev.as_ref());
    copy_queues(dev.as_ref());
    export_import_cross_process(&dev);
}

fn identity(dev: &dyn Device) {
    dev.bind_thread().expect("bind_thread");
    assert!(!dev.name().is_empty());
    assert!(!dev.pci_bus_id().is_empty());
    assert!(dev.copy_engine_count() >= 1, "copy_engine_count {}", dev.copy_engine_count());
    match dev.backend() {
        Backend::Cuda => assert!(dev.as_cuda().is_some_and(|c| c.sm_count() > 0)),
        Backend::Host => assert_eq!(dev.ordinal(), 0),
    }
}

fn allocation_identity(dev: &dyn Device) {
    let a = dev.alloc(1 << 20).expect("alloc");
    let b = dev.alloc(4096).expect("alloc");
    let aa = dev.allocation(a).expect("allocation(base)");
    assert_eq!(aa.base, a);
    assert!(aa.len >= 1 << 20);
    let inner = dev.allocation(a.add(12345)).expect("allocation(interior)");
    assert_eq!(inner, aa, "an interior pointer names the same allocation");
    let last = dev.allocation(a.add((1 << 20) - 1)).expect("allocation(last byte)");
    assert_eq!(last, aa);
    let ab = dev.allocation(b).expect("allocation(b)");
    assert_ne!(ab.id, aa.id);
    // Host memory is not device memory.
    let on_stack = 0u64;
    let host = DevPtr(&on_stack as *const u64 as u64);
    let e = dev.allocation(host).expect_err("host memory must be rejected");
    assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
    // A freed and reused address gets a new id.
    dev.free(b).expect("free");
    let b2 = dev.alloc(4096).expect("alloc");
    let ab2 = dev.allocation(b2).expect("allocation(b2)");
    if b2 == b {
        assert_ne!(ab2.id, ab.id, "reused address must get a new id");
    }
    dev.free(b2).expect("free");
    dev.free(a).expect("free");
}

fn export_import_in_process(dev: &dyn Device) {
    let len = 64 << 10;
    let a = dev.alloc(len).expect("alloc");
    dev.copy_from_host(a, &pattern(3, len)).expect("copy_from_host");
    let alloc = dev.allocation(a).expect("allocation");
    let h = dev.export(&alloc).expect("export");
    // Same process: the mapping addresses the same bytes (on CUDA it IS the pointer).
    // Importing twice is allowed (the same pointer on CUDA, maybe another mapping
    // elsewhere); each import is undone by its own unimport.
    let p1 = dev.import(&h, len).expect("import");
    let p2 = dev.import(&h, len).expect("import twice");
    if dev.backend() == Backend::Cuda {
        assert_eq!(p1, p2, "CUDA: a same-process import is the exporter's own pointer");
        assert_eq!(p1, a);
    }
    assert_eq!(mismatches(&read(dev, p1, len), 3), 0);
    assert_eq!(mismatches(&read(dev, p2, len), 3), 0);
    assert!(dev.import(&h, alloc.len + 1).is_err(), "import larger than the allocation must fail");
    dev.unimport(p1, len).expect("unimport");
    dev.unimport(p2, len).expect("unimport (second reference)");
    assert!(dev.unimport(p1, len).is_err(), "unimport of a mapping no longer held must fail");
    dev.free(a).expect("free");
}

fn flags_and_stream_ordering(dev: &dyn Device) {
    let flags = dev.alloc_flags(4).expect("alloc_flags");
    assert_eq!(flags.len(), 4);
    assert!((0..4).all(|i| flags.load(i) == 0), "flags start at zero");
    let s = dev.create_stream().expect("create_stream");
    let len = 1 << 20;
    let (src, dst) = (dev.alloc(len).expect("alloc"), dev.alloc(len).expect("alloc"));
    dev.copy_from_host(src, &pattern(11, len)).expect("copy_from_host");
    dev.copy_from_host(dst, &vec![0u8; len]).expect("copy_from_host");

    // wait(f0 >= 1) -> copy -> write(f1 = 7): nothing after the wait runs before the CPU
    // releases it.
    dev.wait_value_geq(s, flags.dev_addr(0), 1).expect("wait_value_geq");
    dev.memcpy_async(s, dst, src, len).expect("memcpy_async");
    dev.write_value(s, flags.dev_addr(1), 7).expect("write_value");
    std::thread::sleep(Duration::from_millis(100));
    assert_eq!(flags.load(1), 0, "the stream ran past an unsatisfied wait");
    assert!(!dev.stream_query(s).expect("stream_query"), "a blocked stream is not idle");
    flags.store(0, 1);
    wait_until("flag 1 = 7", || flags.load(1) == 7);
    dev.synchronize(s).expect("synchronize");
    assert!(dev.stream_query(s).expect("stream_query"), "a synchronized stream is idle");
    assert_eq!(mismatches(&read(dev, dst, len), 11), 0, "copy before the write must be complete");

    // >= : a larger value releases a smaller target; 64-bit values survive.
    flags.store(0, 5);
    dev.wait_value_geq(s, flags.dev_addr(0), 3).expect("wait_value_geq");
    dev.write_value(s, flags.dev_addr(2), 0x1_0000_0002).expect("write_value");
    wait_until("flag 2 = 0x1_0000_0002", || flags.load(2) == 0x1_0000_0002);
    // Monotonic sequence numbers across the 32-bit boundary.
    flags.store(3, 0xffff_fff0);
    dev.wait_value_geq(s, flags.dev_addr(3), 0x1_0000_0001).expect("wait_value_geq");
    dev.write_value(s, flags.dev_addr(1), 8).expect("write_value");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(flags.load(1), 7, "wait passed before its 64-bit target");
    flags.store(3, 0x1_0000_0001);
    wait_until("flag 1 = 8", || flags.load(1) == 8);
    dev.synchronize(s).expect("synchronize");
    dev.destroy_stream(s).expect("destroy_stream");
    dev.free(src).expect("free");
    dev.free(dst).expect("free");
}

/// `mem_ops` on a stream and on a copy queue: a batch runs in order (nothing after a wait
/// before it passes, 64-bit targets across the 32-bit boundary), a long batch (more than one
/// driver call) keeps its order, and a bad flag anywhere refuses the whole batch.
fn batched_mem_ops(dev: &dyn Device) {
    use hoccl::device::MemOp::{WaitGeq, Write};
    let flags = dev.alloc_flags(4).expect("alloc_flags");
    let f = |i| flags.dev_addr(i);
    let s = dev.create_stream().expect("create_stream");
    let ops = [WaitGeq { flag: f(0), value: 1 }, Write { flag: f(1), value: 7 }, WaitGeq { flag: f(2), value: 0x1_0000_0001 }, Write { flag: f(1), value: 0x1_0000_0002 }, Write { flag: f(3), value: 9 }];
    dev.mem_ops(s, &ops).expect("mem_ops");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(flags.load(1), 0, "the batch ran past its first wait");
    flags.store(0, 1);
    wait_until("flag 1 = 7", || flags.load(1) == 7);
    flags.store(2, 0xffff_fff0);
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((flags.load(1), flags.load(3)), (7, 0), "the second wait passed before its 64-bit target");
    flags.store(2, 0x1_0000_0001);
    wait_until("flag 3 = 9", || flags.load(3) == 9);
    assert_eq!(flags.load(1), 0x1_0000_0002, "a 64-bit value survives a batched write");

    // 300 writes: several driver calls on CUDA, still in order (the last value stays).
    let long: Vec<_> = (1..=300u64).map(|v| Write { flag: f(1), value: v << 32 | v }).collect();
    dev.mem_ops(s, &long).expect("mem_ops");
    dev.synchronize(s).expect("synchronize");
    assert_eq!(flags.load(1), 300 << 32 | 300);

    // A misaligned flag in the middle: refused, and nothing of the batch is enqueued.
    let bad = [Write { flag: f(3), value: 10 }, Write { flag: f(1).add(4), value: 1 }];
    let e = dev.mem_ops(s, &bad).expect_err("a misaligned flag");
    assert!(e.to_string().contains("aligned"), "{e}");
    dev.synchronize(s).expect("synchronize");
    assert_eq!(flags.load(3), 9, "a refused batch enqueued part of itself");
    dev.destroy_stream(s).expect("destroy_stream");

    // On a copy queue: a wait and a write around a copy, each run one call.
    let len = 1 << 20;
    let (src, dst) = (dev.alloc(len).expect("alloc"), dev.alloc(len).expect("alloc"));
    dev.copy_from_host(src, &pattern(13, len)).expect("copy_from_host");
    dev.copy_from_host(dst, &vec![0u8; len]).expect("copy_from_host");
    let mut q = dev.create_copy_queue().expect("create_copy_queue");
    q.mem_ops(&[WaitGeq { flag: f(0), value: 2 }, Write { flag: f(2), value: 5 }]).expect("queue mem_ops");
    q.copy(dst, src, len).expect("copy");
    q.mem_ops(&[Write { flag: f(3), value: 11 }]).expect("queue mem_ops");
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!((flags.load(2), flags.load(3)), (0x1_0000_0001, 9), "the queue ran past its wait");
    flags.store(0, 2);
    wait_until("flag 3 = 11", || flags.load(3) == 11);
    assert_eq!(flags.load(2), 5);
    assert_eq!(mismatches(&read(dev, dst, len), 13), 0, "the copy before the write is complete");
    assert!(q.mem_ops(&[WaitGeq { flag: DevPtr::NULL, value: 1 }]).is_err(), "a NULL flag");
    drop(q);
    dev.free(src).expect("free");
    dev.free(dst).expect("free");
}

fn memcpy_async_unaligned(dev: &dyn Device) {
    let len = 256 << 10;
    let s = dev.create_stream().expect("create_stream");
    let (src, dst) = (dev.alloc(len).expect("alloc"), dev.alloc(len).expect("alloc"));
    dev.copy_from_host(src, &pattern(21, len)).expect("copy_from_host");
    dev.copy_from_host(dst, &vec![0xAB; len]).expect("copy_from_host");
    let launches = kernels::launch_count();
    dev.memcpy_async(s, dst.add(5), src.add(3), 100_001).expect("memcpy_async");
    dev.memcpy_async(s, dst, src, 0).expect("zero-length memcpy_async");
    dev.synchronize(s).expect("synchronize");
    assert_eq!(kernels::launch_count(), launches, "memcpy_async must not launch a kernel");
    let got = read(dev, dst, len);
    let want = pattern(21, len);
    assert!(got[..5].iter().all(|&b| b == 0xAB), "bytes before the copy changed");
    assert_eq!(&got[5..5 + 100_001], &want[3..3 + 100_001]);
    assert!(got[5 + 100_001..].iter().all(|&b| b == 0xAB), "bytes after the copy changed");
    dev.destroy_stream(s).expect("destroy_stream");
    dev.free(src).expect("free");
    dev.free(dst).expect("free");
}

/// `reduce_async` against `reduce::reduce_into`, bit for bit: every data type and operator,
/// 1 to 5 inputs at odd offsets (one of them `dst` itself, one input given twice), counts
/// that are not multiples of anything, stream-ordered behind a copy that writes an input
/// and before a copy that reads the result; bytes around `dst` untouched; count 0 does
/// nothing. The contract a reduce kernel must meet.
fn reduce_step(dev: &dyn Device) {
    use hoccl::reduce::reduce_into;
    use hoccl::{DataType, RedOp};
    let s = dev.create_stream().expect("create_stream");
    let cap = 3000 * 8 + 61 * 8;
    let bufs: Vec<DevPtr> = (0..6).map(|_| dev.alloc(cap).expect("alloc")).collect();
    let out = dev.alloc(cap).expect("alloc");
    let mut case = 0u64;
    for dtype in DataType::ALL {
        for op in RedOp::ALL {
            case += 1;
            let es = dtype.size();
            let count = [1usize, 7, 2999][case as usize % 3];
            let len = count * es;
            let k = 1 + case as usize % 5; // inputs
            // Offsets in whole elements, different per buffer (the reduce step's contract).
            let offs: Vec<usize> = (0..6).map(|i| (case as usize * 7 + i * 13) % 61 * es).collect();
            for (i, b) in bufs.iter().enumerate() {
                dev.copy_from_host(*b, &pattern(case * 10 + i as u64, cap)).expect("copy_from_host");
            }
            // Input 0 is written on the stream just before the reduce step.
            dev.copy_from_host(bufs[5], &pattern(case * 10 + 99, cap)).expect("copy_from_host");
            dev.memcpy_async(s, bufs[0].add(offs[0]), bufs[5].add(offs[5]), len).expect("memcpy_async");
            let mut srcs: Vec<DevPtr> = (0..k).map(|i| bufs[i].add(offs[i])).collect();
            if k >= 3 {
                srcs[2] = srcs[1]; // the same input twice
            }
            // In place: dst is the last input.
            let dst = *srcs.last().unwrap();
            let host_in = |p: DevPtr| -> Vec<u8> {
                let i = bufs.iter().position(|b| p.0 >= b.0 && p.0 < b.0 + cap as u64).unwrap();
                let off = (p.0 - bufs[i].0) as usize;
                let seed = if i == 0 { case * 10 + 99 } else { case * 10 + i as u64 };
                let from = if i == 0 { offs[5] } else { off };
                pattern(seed, from + len)[from..].to_vec()
            };
            let inputs: Vec<Vec<u8>> = srcs.iter().map(|p| host_in(*p)).collect();
            let refs: Vec<&[u8]> = inputs.iter().map(|v| v.as_slice()).collect();
            let mut want = vec![0u8; len];
            reduce_into(dtype, op, &mut want, &refs).unwrap();
            dev.reduce_async(s, dst, &srcs, count, dtype, op).expect("reduce_async");
            dev.reduce_async(s, dst, &srcs, 0, dtype, op).expect("reduce_async with count 0");
            dev.memcpy_async(s, out, dst, len).expect("memcpy_async");
            dev.synchronize(s).expect("synchronize");
            let got = read(dev, out, len);
            let what = format!("{} {} count {count} inputs {k}", dtype.name(), op.name());
            assert_eq!(got, want, "{what}");
            // Bytes around dst are untouched.
            let i = bufs.iter().position(|b| dst.0 >= b.0 && dst.0 < b.0 + cap as u64).unwrap();
            let whole = read(dev, bufs[i], cap);
            let off = (dst.0 - bufs[i].0) as usize;
            let orig = pattern(case * 10 + i as u64, cap);
            let (lo, hi) = (off, off + len);
            assert!(whole[..lo].iter().zip(&orig[..lo]).all(|(a, b)| a == b), "{what}: bytes before dst");
            assert!(whole[hi..].iter().zip(&orig[hi..]).all(|(a, b)| a == b), "{what}: bytes after dst");
        }
    }
    dev.destroy_stream(s).expect("destroy_stream");
    for b in bufs.into_iter().chain([out]) {
        dev.free(b).expect("free");
    }
}

fn fill_pattern_matches_cpu(dev: &dyn Device) {
    let len = 300_007;
    let s = dev.create_stream().expect("create_stream");
    let buf = dev.alloc(len + 2).expect("alloc");
    dev.copy_from_host(buf, &vec![0x5A; len + 2]).expect("copy_from_host");
    dev.fill_pattern_async(s, buf.add(1), len, 42).expect("fill_pattern_async");
    dev.fill_pattern_async(s, buf, 0, 42).expect("zero-length fill");
    dev.synchronize(s).expect("synchronize");
    let got = read(dev, buf, len + 2);
    assert_eq!(got[0], 0x5A, "byte before the fill changed");
    assert_eq!(got[len + 1], 0x5A, "byte after the fill changed");
    assert_eq!(mismatches(&got[1..=len], 42), 0, "device pattern differs from device::pattern_byte");
    dev.destroy_stream(s).expect("destroy_stream");
    dev.free(buf).expect("free");
}

fn copy_queues(dev: &dyn Device) {
    let n = dev.copy_engine_count().clamp(1, 4);
    let chunk = 4 << 20;
    let src = dev.alloc(n * chunk).expect("alloc");
    let dst = dev.alloc(n * chunk).expect("alloc");
    dev.copy_from_host(src, &pattern(77, n * chunk)).expect("copy_from_host");
    dev.copy_from_host(dst, &vec![0u8; n * chunk]).expect("copy_from_host");
    let launches = kernels::launch_count();
    let mut queues: Vec<_> = (0..n).map(|_| dev.create_copy_queue().expect("create_copy_queue")).collect();
    for (i, q) in queues.iter_mut().enumerate() {
        assert_eq!(q.completed().expect("completed"), 0, "a fresh queue has completed nothing");
        let (d, s) = (dst.add(i * chunk), src.add(i * chunk));
        q.copy(d, s, chunk / 2).expect("copy");
        assert_eq!(q.fence().expect("fence"), 1, "tickets start at 1");
        q.copy(d.add(chunk / 2), s.add(chunk / 2), chunk / 2).expect("copy");
        q.copy(d, s, 0).expect("zero-length copy");
        assert_eq!(q.fence().expect("fence"), 2, "tickets increase by one");
    }
    for q in queues.iter_mut() {
        let mut last = 0;
        wait_until("fence 2", || {
            let c = q.completed().expect("completed");
            assert!(c >= last && c <= 2, "completed went from {last} to {c}");
            last = c;
            c == 2
        });
        assert_eq!(q.completed().expect("completed"), 2, "completed is stable once reached");
    }
    assert_eq!(kernels::launch_count(), launches, "copy queues must not launch kernels");
    drop(queues);
    assert_eq!(mismatches(&read(dev, dst, n * chunk), 77), 0);
    dev.free(src).expect("free");
    dev.free(dst).expect("free");
}

/// Export here, import in a child process (the same test binary, `conformance_ipc_child`),
/// which checks the bytes and overwrites them; then check its write here.
fn export_import_cross_process(dev: &Arc<dyn Device>) {
    let len = 1 << 20;
    let a = dev.alloc(len).expect("alloc");
    dev.copy_from_host(a, &pattern(5, len)).expect("copy_from_host");
    let h = dev.export(&dev.allocation(a).expect("allocation")).expect("export");
    let hex: String = h.0.iter().map(|b| format!("{b:02x}")).collect();
    let backend = match dev.backend() {
        Backend::Cuda => "cuda",
        Backend::Host => "host",
    };
    let exe = std::env::current_exe().expect("current_exe");
    let out = std::process::Command::new(exe)
        .args(["--exact", "conformance_ipc_child", "--include-ignored", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, format!("{backend}:{}:{len}:{hex}", dev.ordinal()))
        .output()
        .expect("spawn child");
    assert!(
        out.status.success(),
        "child failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("ipc child ok"), "child did not run");
    assert_eq!(mismatches(&read(dev.as_ref(), a, len), 6), 0, "the child's write is not visible here");
    dev.free(a).expect("free");
}

#[test]
#[ignore = "helper of the cross-process conformance step; does nothing unless spawned by it"]
fn conformance_ipc_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let parts: Vec<&str> = spec.split(':').collect();
    assert_eq!(parts.len(), 4, "bad {CHILD_ENV}={spec}");
    let choice = if parts[0] == "cuda" { BackendChoice::Cuda } else { BackendChoice::Host };
    let ordinal: usize = parts[1].parse().expect("ordinal");
    let len: usize = parts[2].parse().expect("len");
    let mut h = [0u8; 64];
    for (i, b) in h.iter_mut().enumerate() {
        *b = u8::from_str_radix(&parts[3][2 * i..2 * i + 2], 16).expect("hex");
    }
    let dev = device::open(choice, ordinal).expect("open in child");
    let p = dev.import(&device::ExportHandle(h), len).expect("import in child");
    assert_eq!(mismatches(&read(dev.as_ref(), p, len), 5), 0, "child reads the exporter's bytes");
    // Write through the mapping with a copy queue (the engine's path), then synchronously.
    let src = dev.alloc(len).expect("alloc");
    dev.copy_from_host(src, &pattern(6, len)).expect("copy_from_host");
    let mut q = dev.create_copy_queue().expect("create_copy_queue");
    q.copy(p, src, len).expect("copy into the import");
    let t = q.fence().expect("fence");
    wait_until("child copy", || q.completed().expect("completed") >= t);
    drop(q);
    dev.unimport(p, len).expect("unimport in child");
    dev.free(src).expect("free");
    println!("ipc child ok");
}

// ---------------------------------------------------------------- instantiations -------

#[test]
fn host_conformance() {
    conformance(device::open(BackendChoice::Host, 0).expect("host backend"));
}

fn open_cuda_or_fail() -> Arc<dyn Device> {
    let p = cuda::probe().unwrap_or_else(|e| panic!("no GPU found: {e}"));
    assert!(p.count > 0, "no GPU found: the driver reports 0 devices");
    let ordinal = test_ordinal();
    Arc::new(CudaDevice::open(ordinal).unwrap_or_else(|e| panic!("CudaDevice::open({ordinal}): {e}")))
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_conformance() {
    conformance(open_cuda_or_fail());
}

#[test]
fn host_reduce_step() {
    reduce_step(device::open(BackendChoice::Host, 0).expect("host backend").as_ref());
}

/// The reduce kernel (`CudaDevice::reduce_kernel_async`) against the reference.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_reduce_step() {
    reduce_step(open_cuda_or_fail().as_ref());
}

/// Two ranks on one GPU in one process: separate `CudaDevice`s, memory exported by one is
/// imported by the other (served without cuIpcOpenMemHandle) and written by its queue.
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_two_devices_on_one_gpu() {
    let (a, b) = (open_cuda_or_fail(), open_cuda_or_fail());
    let len = 1 << 20;
    let buf = a.alloc(len).expect("alloc");
    let h = a.export(&a.allocation(buf).expect("allocation")).expect("export");
    let p = b.import(&h, len).expect("import from the other instance");
    assert_eq!(p, buf);
    let src = b.alloc(len).expect("alloc");
    let s = b.create_stream().expect("create_stream");
    b.fill_pattern_async(s, src, len, 9).expect("fill");
    b.synchronize(s).expect("synchronize");
    let mut q = b.create_copy_queue().expect("queue");
    q.copy(p, src, len).expect("copy");
    let t = q.fence().expect("fence");
    wait_until("copy", || q.completed().expect("completed") >= t);
    assert_eq!(mismatches(&read(a.as_ref(), buf, len), 9), 0);
    b.unimport(p, len).expect("unimport");
    b.destroy_stream(s).expect("destroy_stream");
    b.free(src).expect("free");
    a.free(buf).expect("free");
}

/// Peer copies between two GPUs of one process through a copy queue (needs 2 GPUs; passes
/// trivially with one).
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_peer_copy_between_gpus() {
    let p = cuda::probe().unwrap_or_else(|e| panic!("no GPU found: {e}"));
    if p.count < 2 {
        eprintln!("one GPU: peer copy skipped");
        return;
    }
    let d0: Arc<dyn Device> = Arc::new(CudaDevice::open(0).expect("open 0"));
    let d1: Arc<dyn Device> = Arc::new(CudaDevice::open(1).expect("open 1"));
    let len = 8 << 20;
    let (src, dst) = (d0.alloc(len).expect("alloc"), d1.alloc(len).expect("alloc"));
    d0.copy_from_host(src, &pattern(13, len)).expect("copy_from_host");
    let mut q = d0.create_copy_queue().expect("queue");
    q.copy(dst, src, len).expect("copy");
    let t = q.fence().expect("fence");
    wait_until("peer copy", || q.completed().expect("completed") >= t);
    assert_eq!(mismatches(&read(d1.as_ref(), dst, len), 13), 0);
    d0.free(src).expect("free");
    d1.free(dst).expect("free");
}

/// Runs everywhere: the probe never panics, and without a GPU every CUDA entry point says
/// NoDevice.
#[test]
fn cuda_probe_does_not_panic() {
    match cuda::probe() {
        Err(e) => {
            assert_eq!(e.code(), ErrorCode::NoDevice, "{e}");
            eprintln!("no GPU here: {e}");
            assert_eq!(CudaDevice::open(0).err().map(|e| e.code()), Some(ErrorCode::NoDevice));
            assert_eq!(device::open(BackendChoice::Cuda, 0).err().map(|e| e.code()), Some(ErrorCode::NoDevice));
        }
        Ok(p) => {
            assert_eq!(p.gpus.len(), p.count);
            assert_eq!(p.peer_access.len(), p.count);
            assert!(p.peer_access.iter().enumerate().all(|(i, row)| row.len() == p.count && row[i]));
            if p.count == 0 {
                assert_eq!(CudaDevice::open(0).err().map(|e| e.code()), Some(ErrorCode::NoDevice));
            }
        }
    }
}
