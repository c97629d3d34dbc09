//! Bad input, table-driven, through the Rust API and the C ABI (`include/hoccl/hoccl.h`),
//! and a fixed-seed fuzzer of C API call sequences (issue 41, item 3; `docs/design.md`,
//! "Errors", is the table in prose).
//!
//! Every refused call must return its documented code, leave a non-empty message naming the
//! entry point, and leave the communicator usable: after each case both ranks run a good
//! AllReduce and check its result. A refused call is refused on every rank (the faulted
//! buffer is one that every rank uses; a root-only buffer of a non-root rank is not read, so
//! it is not checked there, as in NCCL), so the ranks never diverge.
//!
//! Faults the host backend cannot produce or detect, listed in the design's table: a freed
//! pointer whose address a later allocation reused is that allocation (on CUDA too), and a
//! host pointer is refused on CUDA only if the driver does not know it as device memory.
//!
//! The tests of this file run one at a time (`serial`): a "freed pointer" case needs its
//! address not to be reused by a concurrent test's allocation.
mod common;
use common::*;
use common::Rng;
use hoccl::{Communicator, DataType, DevPtr, ErrorCode, RedOp, StreamHandle, UniqueId};
use std::ffi::{c_int, c_void};
use std::ptr::null_mut;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

fn serial() -> MutexGuard<'static, ()> {
    static SERIAL: Mutex<()> = Mutex::new(());
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

// ---------------------------------------------------------------- the C ABI --------------

/// The C ABI's entry points, declared as `hoccl.h` declares them, and safe wrappers.
#[allow(non_snake_case, dead_code)]
mod c {
    use hoccl::UniqueId;
    use std::ffi::{c_char, c_int, c_void};
    pub type Comm = *mut c_void;
    pub type Stream = *mut c_void;

    macro_rules! wrap {
        ($($name:ident($($a:ident: $t:ty),*) -> $r:ty;)*) => {
            mod raw {
                use super::*;
                extern "C" {
                    $(pub fn $name($($a: $t),*) -> $r;)*
                }
            }
            $(#[allow(clippy::too_many_arguments)] // the C signatures
            pub fn $name($($a: $t),*) -> $r {
                // SAFETY: the C ABI takes any value of these types: handles and device
                // pointers are looked up (not dereferenced) before use, and every host
                // pointer a caller here passes is NULL or valid for the documented size.
                unsafe { raw::$name($($a),*) }
            })*
        };
    }

    wrap! {
        hocclGetLastError() -> *const c_char;
        hocclGetVersion(v: *mut c_int) -> c_int;
        hocclGetErrorString(r: c_int) -> *const c_char;
        hocclCommInitMpi(comm: *mut Comm, f: c_int) -> c_int;
        hocclStreamDestroy(comm: Comm, s: Stream) -> c_int;
        hocclAlltoAllv(sb: *const c_void, sc: *const usize, sd: *const usize, rb: *mut c_void, rc: *const usize, rd: *const usize, d: c_int, comm: Comm, s: Stream) -> c_int;
        hocclGetUniqueId(id: *mut UniqueId) -> c_int;
        hocclCommInitRank(comm: *mut Comm, nranks: c_int, id: UniqueId, rank: c_int) -> c_int;
        hocclCommDestroy(comm: Comm) -> c_int;
        hocclCommAbort(comm: Comm) -> c_int;
        hocclCommGetAsyncError(comm: Comm, e: *mut c_int) -> c_int;
        hocclCommCount(comm: Comm, n: *mut c_int) -> c_int;
        hocclCommUserRank(comm: Comm, n: *mut c_int) -> c_int;
        hocclGroupStart() -> c_int;
        hocclGroupEnd() -> c_int;
        hocclMemAlloc(comm: Comm, p: *mut *mut c_void, bytes: usize) -> c_int;
        hocclMemFree(comm: Comm, p: *mut c_void) -> c_int;
        hocclStreamCreate(comm: Comm, s: *mut Stream) -> c_int;
        hocclStreamSynchronize(comm: Comm, s: Stream) -> c_int;
        hocclMemcpyToDevice(comm: Comm, dst: *mut c_void, src: *const c_void, bytes: usize) -> c_int;
        hocclMemcpyToHost(comm: Comm, dst: *mut c_void, src: *const c_void, bytes: usize) -> c_int;
        hocclSend(b: *const c_void, n: usize, d: c_int, peer: c_int, comm: Comm, s: Stream) -> c_int;
        hocclRecv(b: *mut c_void, n: usize, d: c_int, peer: c_int, comm: Comm, s: Stream) -> c_int;
        hocclAllGather(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, comm: Comm, s: Stream) -> c_int;
        hocclAlltoAll(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, comm: Comm, s: Stream) -> c_int;
        hocclBroadcast(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, root: c_int, comm: Comm, s: Stream) -> c_int;
        hocclGather(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, root: c_int, comm: Comm, s: Stream) -> c_int;
        hocclScatter(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, root: c_int, comm: Comm, s: Stream) -> c_int;
        hocclAllReduce(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, op: c_int, comm: Comm, s: Stream) -> c_int;
        hocclReduceScatter(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, op: c_int, comm: Comm, s: Stream) -> c_int;
        hocclReduce(sb: *const c_void, rb: *mut c_void, n: usize, d: c_int, op: c_int, root: c_int, comm: Comm, s: Stream) -> c_int;
    }

    pub fn last_error() -> String {
        // SAFETY: hocclGetLastError returns a NUL-terminated string valid until the next
        // failing call on this thread; it is copied at once.
        unsafe { std::ffi::CStr::from_ptr(hocclGetLastError()) }.to_string_lossy().into_owned()
    }
}

const OK: c_int = ErrorCode::Success as c_int;
const F32: c_int = DataType::F32 as c_int;

fn code_of(rc: c_int) -> ErrorCode {
    [
        ErrorCode::Success,
        ErrorCode::Cuda,
        ErrorCode::System,
        ErrorCode::Internal,
        ErrorCode::InvalidArgument,
        ErrorCode::InvalidUsage,
        ErrorCode::Remote,
        ErrorCode::InProgress,
        ErrorCode::Timeout,
        ErrorCode::CorruptData,
        ErrorCode::Aborted,
        ErrorCode::Mpi,
        ErrorCode::NoDevice,
    ]
    .into_iter()
    .find(|c| *c as c_int == rc)
    .unwrap_or_else(|| panic!("undocumented result code {rc}"))
}

// ---------------------------------------------------------------- the table --------------

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Op {
    AllGather,
    AllToAll,
    Broadcast,
    Gather,
    Scatter,
    AllReduce,
    ReduceScatter,
    Reduce,
    Send,
    Recv,
}
use Op::*;
const OPS: [Op; 10] = [AllGather, AllToAll, Broadcast, Gather, Scatter, AllReduce, ReduceScatter, Reduce, Send, Recv];

impl Op {
    fn c_name(self) -> &'static str {
        match self {
            AllGather => "hocclAllGather",
            AllToAll => "hocclAlltoAll",
            Broadcast => "hocclBroadcast",
            Gather => "hocclGather",
            Scatter => "hocclScatter",
            AllReduce => "hocclAllReduce",
            ReduceScatter => "hocclReduceScatter",
            Reduce => "hocclReduce",
            Send => "hocclSend",
            Recv => "hocclRecv",
        }
    }
    fn rooted(self) -> bool {
        matches!(self, Broadcast | Gather | Scatter | Reduce)
    }
    fn reduces(self) -> bool {
        matches!(self, AllReduce | ReduceScatter | Reduce)
    }
    fn p2p(self) -> bool {
        matches!(self, Send | Recv)
    }
    /// Whether the buffer every rank reads or writes is the send buffer (else the receive
    /// buffer): the one a buffer fault is put in.
    fn faults_send(self) -> bool {
        matches!(self, AllGather | AllToAll | Gather | AllReduce | ReduceScatter | Reduce | Send)
    }
}

/// One class of bad input. `Handle*` faults exist only in the C ABI (a Rust
/// `Communicator` cannot be null or used after it is dropped); negative ranks only where a
/// rank is a C `int`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fault {
    NullBuffer,
    HostPointer,
    FreedPointer,
    ShortBuffer,
    ByteSizeOverflows,
    DtypeNegative,
    DtypeOneTooHigh,
    RedOpOneTooHigh,
    RedOpNegative,
    RootIsSize,
    RootNegative,
    PeerIsSize,
    PeerNegative,
    UnknownStream,
    InPlaceAlltoAll,
    HandleNull,
    HandleNeverCreated,
    HandleDestroyed,
    HandleAborted,
}
use Fault::*;

/// The table: each fault, the ops it applies to, its documented code, and whether the
/// Rust API can express it.
const FAULTS: [(Fault, ErrorCode, bool); 19] = [
    (NullBuffer, ErrorCode::InvalidArgument, true),
    (HostPointer, ErrorCode::InvalidArgument, true),
    (FreedPointer, ErrorCode::InvalidArgument, true),
    (ShortBuffer, ErrorCode::InvalidArgument, true),
    (ByteSizeOverflows, ErrorCode::InvalidArgument, true),
    (DtypeNegative, ErrorCode::InvalidArgument, true),
    (DtypeOneTooHigh, ErrorCode::InvalidArgument, true),
    (RedOpOneTooHigh, ErrorCode::InvalidArgument, true),
    (RedOpNegative, ErrorCode::InvalidArgument, true),
    (RootIsSize, ErrorCode::InvalidArgument, true),
    (RootNegative, ErrorCode::InvalidArgument, false),
    (PeerIsSize, ErrorCode::InvalidArgument, true),
    (PeerNegative, ErrorCode::InvalidArgument, false),
    (UnknownStream, ErrorCode::InvalidArgument, true),
    (InPlaceAlltoAll, ErrorCode::InvalidArgument, true),
    (HandleNull, ErrorCode::InvalidArgument, false),
    (HandleNeverCreated, ErrorCode::InvalidUsage, false),
    (HandleDestroyed, ErrorCode::InvalidUsage, false),
    (HandleAborted, ErrorCode::Aborted, false),
];

fn applies(f: Fault, op: Op) -> bool {
    match f {
        RedOpOneTooHigh | RedOpNegative => op.reduces(),
        RootIsSize | RootNegative => op.rooted(),
        PeerIsSize | PeerNegative => op.p2p(),
        InPlaceAlltoAll => op == AllToAll,
        _ => true,
    }
}

/// Every (op, fault, code) of the table, for the Rust API (`rust`) or the C ABI.
fn cases(rust: bool) -> Vec<(Op, Fault, ErrorCode)> {
    let mut v = Vec::new();
    for op in OPS {
        for (f, code, in_rust) in FAULTS {
            if applies(f, op) && (in_rust || !rust) {
                v.push((op, f, code));
            }
        }
    }
    v
}

const RANKS: usize = 2;
const BUF_BYTES: usize = 4096;
const GOOD_COUNT: usize = 16;

/// The raw arguments of one call, as C passes them.
#[derive(Clone, Copy, Debug)]
struct Args {
    send: u64,
    recv: u64,
    count: usize,
    dtype: c_int,
    red: c_int,
    /// Root or peer.
    rank: c_int,
    stream: u64,
}

/// What a rank holds to build arguments from: two buffers of `BUF_BYTES`, a stream, a
/// host array, a freed allocation's address.
struct Pool {
    a: u64,
    b: u64,
    stream: u64,
    host: Vec<u8>,
    freed: u64,
    rank: usize,
}

fn args(op: Op, f: Fault, p: &Pool) -> Args {
    let peer = (1 - p.rank) as c_int;
    let mut a = Args { send: p.a, recv: p.b, count: GOOD_COUNT, dtype: F32, red: RedOp::Sum.raw(), rank: if op.p2p() { peer } else { 0 }, stream: p.stream };
    let bad_buffer = |a: &mut Args, v: u64| {
        if op.faults_send() {
            a.send = v;
        } else {
            a.recv = v;
        }
    };
    match f {
        NullBuffer => bad_buffer(&mut a, 0),
        HostPointer => bad_buffer(&mut a, p.host.as_ptr() as u64),
        FreedPointer => bad_buffer(&mut a, p.freed),
        // One element more than the allocation holds, in the every-rank buffer.
        ShortBuffer => a.count = BUF_BYTES / 4 + 1,
        ByteSizeOverflows => a.count = usize::MAX / 2,
        DtypeNegative => a.dtype = -1,
        DtypeOneTooHigh => a.dtype = DataType::ALL.iter().map(|d| *d as c_int).max().unwrap_or(0) + 1,
        RedOpOneTooHigh => a.red = RedOp::ALL.len() as c_int,
        RedOpNegative => a.red = -1,
        RootIsSize | PeerIsSize => a.rank = RANKS as c_int,
        RootNegative | PeerNegative => a.rank = -1,
        UnknownStream => a.stream = 0x7fff_0000,
        InPlaceAlltoAll => a.recv = a.send,
        HandleNull | HandleNeverCreated | HandleDestroyed | HandleAborted => {}
    }
    a
}

/// The ranks' agreement on whether a freed-pointer case is one: the host backend's
/// allocation registry is process-wide, so a freed address may have been reused by any
/// rank's (or the library's own) allocation. Every rank probes its address between two
/// barriers, when no rank allocates; the case runs on every rank or on none.
struct FreedProbe {
    barrier: std::sync::Barrier,
    reused: std::sync::atomic::AtomicBool,
    skipped: std::sync::atomic::AtomicUsize,
}

impl FreedProbe {
    fn new(n: usize) -> Arc<FreedProbe> {
        Arc::new(FreedProbe { barrier: std::sync::Barrier::new(n), reused: Default::default(), skipped: Default::default() })
    }
    /// Whether the case runs: `still_freed` is this rank's probe. Call `done` after it.
    fn agree(&self, still_freed: bool) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        if self.barrier.wait().is_leader() {
            self.reused.store(false, SeqCst);
        }
        self.barrier.wait();
        if !still_freed {
            self.reused.store(true, SeqCst);
        }
        self.barrier.wait();
        let run = !self.reused.load(SeqCst);
        if !run && self.barrier.wait().is_leader() {
            self.skipped.fetch_add(1, SeqCst);
        }
        run
    }
    fn done(&self) {
        self.barrier.wait();
    }
    /// Fails if no freed-pointer case ran at all (the fault would be untested).
    fn check(&self, cases: usize) {
        let skipped = self.skipped.load(std::sync::atomic::Ordering::SeqCst);
        assert!(skipped < cases, "every one of {cases} freed-pointer cases was skipped: its address was always reused");
    }
}

// ---------------------------------------------------------------- drivers ----------------

/// One call through the Rust API, typed values decoded as a Rust caller decodes raw ones.
fn rust_call(c: &Communicator, op: Op, a: &Args) -> hoccl::Result<()> {
    const OP: &str = "bad_input";
    let d = DataType::from_raw(OP, a.dtype)?;
    let red = || RedOp::from_raw(OP, a.red);
    let rank = usize::try_from(a.rank).expect("the Rust API takes no negative rank");
    let (s, r, n, st) = (DevPtr(a.send), DevPtr(a.recv), a.count, StreamHandle(a.stream));
    match op {
        AllGather => c.all_gather(s, r, n, d, st),
        AllToAll => c.all_to_all(s, r, n, d, st),
        Broadcast => c.broadcast(s, r, n, d, rank, st),
        Gather => c.gather(s, r, n, d, rank, st),
        Scatter => c.scatter(s, r, n, d, rank, st),
        AllReduce => c.all_reduce(s, r, n, d, red()?, st),
        ReduceScatter => c.reduce_scatter(s, r, n, d, red()?, st),
        Reduce => c.reduce(s, r, n, d, red()?, rank, st),
        Send => c.send(s, n, d, rank, st),
        Recv => c.recv(r, n, d, rank, st),
    }
}

/// One call through the C ABI.
fn c_call(comm: c::Comm, op: Op, a: &Args) -> c_int {
    let (s, r, n, d, st) = (a.send as usize as *const c_void, a.recv as usize as *mut c_void, a.count, a.dtype, a.stream as usize as c::Stream);
    match op {
        AllGather => c::hocclAllGather(s, r, n, d, comm, st),
        AllToAll => c::hocclAlltoAll(s, r, n, d, comm, st),
        Broadcast => c::hocclBroadcast(s, r, n, d, a.rank, comm, st),
        Gather => c::hocclGather(s, r, n, d, a.rank, comm, st),
        Scatter => c::hocclScatter(s, r, n, d, a.rank, comm, st),
        AllReduce => c::hocclAllReduce(s, r, n, d, a.red, comm, st),
        ReduceScatter => c::hocclReduceScatter(s, r, n, d, a.red, comm, st),
        Reduce => c::hocclReduce(s, r, n, d, a.red, a.rank, comm, st),
        Send => c::hocclSend(s, n, d, a.rank, comm, st),
        Recv => c::hocclRecv(r, n, d, a.rank, comm, st),
    }
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn f32s(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4).map(|c| f32::from_ne_bytes(c.try_into().unwrap())).collect()
}

/// Rank r's input of the good AllReduce after case `i`, and the sum every rank expects.
fn good_input(rank: usize, i: usize) -> Vec<f32> {
    (0..GOOD_COUNT).map(|k| (rank * 1000 + i * 10 + k) as f32).collect()
}

fn good_sum(i: usize) -> Vec<f32> {
    (0..GOOD_COUNT).map(|k| (0..RANKS).map(|r| good_input(r, i)[k]).sum()).collect()
}

// ---------------------------------------------------------------- the Rust API -----------

#[test]
fn table_through_the_rust_api() {
    let _g = serial();
    let table = cases(true);
    let t = Instant::now();
    let probe = FreedProbe::new(RANKS);
    let p2 = probe.clone();
    run_ranks(Backend::Host, RANKS, test_config(), move |c| {
        let probe = &p2;
        let dev = c.device().clone();
        let stream = dev.create_stream().unwrap();
        let (a, b) = (dev.alloc(BUF_BYTES).unwrap(), dev.alloc(BUF_BYTES).unwrap());
        let mut pool = Pool { a: a.0, b: b.0, stream: stream.0, host: vec![0; BUF_BYTES], freed: 0, rank: c.rank() };
        for (i, &(op, f, want)) in table.iter().enumerate() {
            if f == FreedPointer {
                // A fresh address, freed before every rank's probe (the first barrier).
                let p = dev.alloc(BUF_BYTES).unwrap();
                dev.free(p).unwrap();
                pool.freed = p.0;
                if !probe.agree(dev.allocation(p).is_err()) {
                    continue;
                }
            }
            let r = rust_call(c, op, &args(op, f, &pool));
            if f == FreedPointer {
                probe.done();
            }
            let e = r.expect_err(&format!("{op:?} with {f:?} was accepted"));
            assert_eq!(e.code(), want, "{op:?} with {f:?}: {e}");
            assert!(!e.to_string().is_empty());
            // The communicator is still usable: a good AllReduce gives the right sum.
            dev.copy_from_host(a, &f32_bytes(&good_input(c.rank(), i))).unwrap();
            c.all_reduce(a, b, GOOD_COUNT, DataType::F32, RedOp::Sum, stream).unwrap_or_else(|e| panic!("after {op:?} with {f:?}: {e}"));
            dev.synchronize(stream).unwrap();
            let mut got = vec![0u8; GOOD_COUNT * 4];
            dev.copy_to_host(&mut got, b).unwrap();
            assert_eq!(f32s(&got), good_sum(i), "after {op:?} with {f:?}");
        }
        assert!(c.async_error().is_none());
        // Group misuse: an end without a start, then nested groups balance.
        assert_eq!(c.group_end().unwrap_err().code(), ErrorCode::InvalidUsage);
        c.group_start().unwrap();
        c.group_start().unwrap();
        c.group_end().unwrap();
        c.group_end().unwrap();
        assert_eq!(c.group_end().unwrap_err().code(), ErrorCode::InvalidUsage);
        c.wait_idle().unwrap();
        dev.free(a).unwrap();
        dev.free(b).unwrap();
    });
    probe.check(OPS.len());
    eprintln!("{} Rust cases on {RANKS} ranks in {:?}", cases(true).len(), t.elapsed());
}

// ---------------------------------------------------------------- the C ABI --------------

/// `n` communicators of one unique id, rank r's handle returned by thread r of `f`'s run.
fn c_ranks(n: usize, f: impl Fn(usize, c::Comm) + std::marker::Send + Sync + 'static) {
    logs::capture();
    // A diverging case fails within 10 s rather than the default timeout. The tests of
    // this binary run one at a time, so setting the variable races with no reader.
    std::env::set_var("HOCCL_TIMEOUT_MS", "10000");
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(c::hocclGetUniqueId(&mut id), OK, "{}", c::last_error());
    let f = Arc::new(f);
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let f = f.clone();
            std::thread::spawn(move || {
                let mut comm = null_mut();
                assert_eq!(c::hocclCommInitRank(&mut comm, n as c_int, id, r as c_int), OK, "{}", c::last_error());
                f(r, comm);
            })
        })
        .collect();
    let failed: Vec<usize> = hs.into_iter().enumerate().filter_map(|(r, h)| h.join().is_err().then_some(r)).collect();
    assert!(failed.is_empty(), "ranks {failed:?} failed");
}

/// A one-rank communicator of its own unique id.
fn solo() -> c::Comm {
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(c::hocclGetUniqueId(&mut id), OK, "{}", c::last_error());
    let mut comm = null_mut();
    assert_eq!(c::hocclCommInitRank(&mut comm, 1, id, 0), OK, "{}", c::last_error());
    comm
}

fn alloc(comm: c::Comm, bytes: usize) -> *mut c_void {
    let mut p = null_mut();
    assert_eq!(c::hocclMemAlloc(comm, &mut p, bytes), OK, "{}", c::last_error());
    p
}

/// The good AllReduce after case `i`, through the C ABI, checked.
fn c_good_all_reduce(comm: c::Comm, rank: usize, i: usize, a: *mut c_void, b: *mut c_void, s: c::Stream, after: &str) {
    let input = f32_bytes(&good_input(rank, i));
    assert_eq!(c::hocclMemcpyToDevice(comm, a, input.as_ptr().cast(), input.len()), OK, "{}", c::last_error());
    assert_eq!(c::hocclAllReduce(a, b, GOOD_COUNT, F32, RedOp::Sum.raw(), comm, s), OK, "after {after}: {}", c::last_error());
    assert_eq!(c::hocclStreamSynchronize(comm, s), OK, "{}", c::last_error());
    let mut got = vec![0u8; GOOD_COUNT * 4];
    assert_eq!(c::hocclMemcpyToHost(comm, got.as_mut_ptr().cast(), b, got.len()), OK, "{}", c::last_error());
    assert_eq!(f32s(&got), good_sum(i), "after {after}");
}

#[test]
fn table_through_the_c_abi() {
    let _g = serial();
    let t = Instant::now();
    let probe = FreedProbe::new(RANKS);
    let p2 = probe.clone();
    c_ranks(RANKS, move |rank, comm| {
        let probe = &p2;
        let table = cases(false);
        let mut s = null_mut();
        assert_eq!(c::hocclStreamCreate(comm, &mut s), OK);
        let (a, b) = (alloc(comm, BUF_BYTES), alloc(comm, BUF_BYTES));
        // Handles of the handle faults: one destroyed, one aborted (each its own rank 0 of 1).
        let destroyed = solo();
        assert_eq!(c::hocclCommDestroy(destroyed), OK);
        let aborted = solo();
        assert_eq!(c::hocclCommAbort(aborted), OK);
        let mut pool = Pool { a: a as u64, b: b as u64, stream: s as u64, host: vec![0; BUF_BYTES], freed: 0, rank };
        let mut freed = null_mut();
        for (i, &(op, f, want)) in table.iter().enumerate() {
            if f == FreedPointer {
                // A fresh address, freed before every rank's probe (the first barrier).
                freed = alloc(comm, BUF_BYTES);
                assert_eq!(c::hocclMemFree(comm, freed), OK);
                pool.freed = freed as u64;
                let mut byte = [0u8; 1];
                // Not device memory any more: the copy is refused.
                let still_freed = c::hocclMemcpyToHost(comm, byte.as_mut_ptr().cast(), freed, 1) != OK;
                if !probe.agree(still_freed) {
                    continue;
                }
            }
            let target = match f {
                HandleNull => null_mut(),
                HandleNeverCreated => 0x1000 as c::Comm,
                HandleDestroyed => destroyed,
                HandleAborted => aborted,
                _ => comm,
            };
            let rc = c_call(target, op, &args(op, f, &pool));
            if f == FreedPointer {
                probe.done();
            }
            assert_eq!(code_of(rc), want, "{} with {f:?}: {}", op.c_name(), c::last_error());
            let msg = c::last_error();
            // The message names the C entry point, or (for argument errors found by the
            // shared validation) the operation as every surface names it.
            let lower = op.c_name().trim_start_matches("hoccl").to_lowercase();
            let named = msg.contains(op.c_name()) || msg.replace('_', "").to_lowercase().contains(&lower);
            assert!(named, "{} with {f:?}: message {msg:?}", op.c_name());
            c_good_all_reduce(comm, rank, i, a, b, s, &format!("{} with {f:?}", op.c_name()));
        }
        let mut e = -1;
        assert_eq!(c::hocclCommGetAsyncError(comm, &mut e), OK);
        assert_eq!(e, OK);
        // The handle and group calls of the table.
        let mut n = 0;
        for (h, want) in [(null_mut(), ErrorCode::InvalidArgument), (0x1000 as c::Comm, ErrorCode::InvalidUsage), (destroyed, ErrorCode::InvalidUsage), (aborted, ErrorCode::Aborted)] {
            assert_eq!(code_of(c::hocclCommCount(h, &mut n)), want, "hocclCommCount({h:?})");
            assert!(c::last_error().contains("hocclCommCount"), "{}", c::last_error());
            let mut p = null_mut();
            assert_eq!(code_of(c::hocclMemAlloc(h, &mut p, 64)), want, "hocclMemAlloc({h:?})");
            assert!(p.is_null(), "a refused allocation leaves NULL");
        }
        assert_eq!(code_of(c::hocclCommCount(comm, null_mut())), ErrorCode::InvalidArgument);
        assert_eq!(code_of(c::hocclCommDestroy(destroyed)), ErrorCode::InvalidUsage, "destroyed twice");
        assert_eq!(code_of(c::hocclCommAbort(destroyed)), ErrorCode::InvalidUsage, "abort after destroy");
        assert_eq!(code_of(c::hocclMemFree(comm, freed)), ErrorCode::InvalidArgument, "freed twice");
        assert_eq!(code_of(c::hocclMemFree(comm, pool.host.as_ptr() as *mut c_void)), ErrorCode::InvalidArgument, "host pointer freed");
        assert_eq!(code_of(c::hocclGroupEnd()), ErrorCode::InvalidUsage, "GroupEnd without GroupStart");
        assert!(c::last_error().contains("hocclGroupStart"), "{}", c::last_error());
        for _ in 0..3 {
            assert_eq!(c::hocclGroupStart(), OK);
        }
        // A refused call inside a group leaves the group intact: the good op still runs.
        assert_eq!(code_of(c::hocclAllReduce(a, b, GOOD_COUNT, -1, 0, comm, s)), ErrorCode::InvalidArgument);
        for _ in 0..3 {
            assert_eq!(c::hocclGroupEnd(), OK, "{}", c::last_error());
        }
        assert_eq!(code_of(c::hocclGroupEnd()), ErrorCode::InvalidUsage, "one end too many");
        c_good_all_reduce(comm, rank, table.len(), a, b, s, "group misuse");
        assert_eq!(c::hocclCommDestroy(aborted), OK, "destroying an aborted handle is quiet");
        assert_eq!(c::hocclMemFree(comm, a), OK);
        assert_eq!(c::hocclMemFree(comm, b), OK);
        assert_eq!(c::hocclCommDestroy(comm), OK, "{}", c::last_error());
    });
    probe.check(OPS.len());
    eprintln!("{} C cases on {RANKS} ranks in {:?}", cases(false).len(), t.elapsed());
}

/// Creation with bad arguments: out-of-range ranks and sizes, a garbage id, a NULL out
/// pointer; each refused at once with `*comm` left NULL.
#[test]
fn creation_refuses_bad_arguments() {
    let _g = serial();
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(c::hocclGetUniqueId(&mut id), OK, "{}", c::last_error());
    assert_eq!(code_of(c::hocclGetUniqueId(null_mut())), ErrorCode::InvalidArgument);
    let mut garbage = UniqueId { internal: [0; 128] };
    Rng(41).bytes(128).iter().enumerate().for_each(|(i, b)| garbage.internal[i] = *b);
    let cases: [(&str, c_int, UniqueId, c_int); 8] = [
        ("nranks 0", 0, id, 0),
        ("nranks negative", -1, id, 0),
        ("rank negative", 2, id, -1),
        ("rank = nranks", 2, id, 2),
        ("rank past nranks", 2, id, c_int::MAX),
        ("zero id", 1, UniqueId { internal: [0; 128] }, 0),
        ("random id", 1, garbage, 0),
        ("id with a flipped magic", 1, { let mut x = id; x.internal[0] ^= 0xff; x }, 0),
    ];
    for (what, n, uid, r) in cases {
        let t = Instant::now();
        let mut comm = 1usize as c::Comm;
        assert_eq!(code_of(c::hocclCommInitRank(&mut comm, n, uid, r)), ErrorCode::InvalidArgument, "{what}: {}", c::last_error());
        assert!(comm.is_null(), "{what}: a refused creation leaves NULL");
        assert!(c::last_error().contains("invalid argument"), "{what}: {}", c::last_error());
        // Generous for a loaded machine: a refusal needs no peer, so no wait at all.
        assert!(t.elapsed() < Duration::from_secs(5), "{what}: refused after {:?}", t.elapsed());
    }
    assert_eq!(code_of(c::hocclCommInitRank(null_mut(), 1, id, 0)), ErrorCode::InvalidArgument);
    // The id is still good after all that.
    let mut comm = null_mut();
    assert_eq!(c::hocclCommInitRank(&mut comm, 1, id, 0), OK, "{}", c::last_error());
    assert_eq!(c::hocclCommDestroy(comm), OK);
}

/// Ranks that disagree on the count or the data type of one AllGather: the engine's length
/// check turns it into an error on both (InvalidUsage, or Remote for the rank that learns
/// it from its peer), within the timeout; no hang. Equal byte sizes under different types
/// are not detectable (the engine moves bytes) and are not a case.
#[test]
fn mismatches_across_ranks_are_errors() {
    let _g = serial();
    for (what, count, dtype) in [("counts", [16usize, 24], [F32, F32]), ("dtypes", [16, 16], [F32, DataType::F64 as c_int])] {
        let t = Instant::now();
        c_ranks(RANKS, move |rank, comm| {
            let mut s = null_mut();
            assert_eq!(c::hocclStreamCreate(comm, &mut s), OK);
            let (a, b) = (alloc(comm, BUF_BYTES), alloc(comm, BUF_BYTES));
            assert_eq!(c::hocclAllGather(a, b, count[rank], dtype[rank], comm, s), OK, "{}", c::last_error());
            assert_eq!(c::hocclStreamSynchronize(comm, s), OK, "the stream is released");
            let mut e = OK;
            assert_eq!(c::hocclCommGetAsyncError(comm, &mut e), OK);
            assert!(matches!(code_of(e), ErrorCode::InvalidUsage | ErrorCode::Remote), "{what}: {:?}", code_of(e));
            assert!(!c::last_error().is_empty());
            // Sticky: later calls fail, and destroy reports it.
            assert_ne!(c::hocclAllGather(a, b, 16, F32, comm, s), OK);
            assert_ne!(c::hocclCommDestroy(comm), OK);
        });
        // The test config's timeout is 10 s; a mismatch is found by the first exchange.
        assert!(t.elapsed() < Duration::from_secs(11), "{what}: {:?}", t.elapsed());
    }
}

// ---------------------------------------------------------------- the fuzzer -------------

/// Argument classes the fuzzer draws from: never a raw random pointer (that would make the
/// test, not the library, invalid), but NULL, freed, host, and live buffers of known size.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Ptr {
    Live(usize),
    Null,
    Host,
    Freed(usize),
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Handle {
    Main,
    Null,
    NeverCreated,
    Destroyed(usize),
    Aborted(usize),
}

/// State of the fuzzer's rank (a one-rank communicator, so every valid collective runs at
/// once and the expected result of a call is a function of its arguments and this state).
struct Fuzz {
    rng: Rng,
    comm: c::Comm,
    stream: c::Stream,
    live: Vec<(*mut c_void, usize)>,
    freed: Vec<*mut c_void>,
    destroyed: Vec<c::Comm>,
    aborted: Vec<c::Comm>,
    host: Vec<u8>,
    depth: usize,
    group_stream: Option<u64>,
    calls: usize,
    refused: usize,
}

const FUZZ_OPS: [Op; 10] = OPS;
const DTYPES: [c_int; 6] = [0, 1, 7, 8, -1, 1000];

impl Fuzz {
    fn pick<T: Copy>(&mut self, v: &[T]) -> T {
        v[self.rng.below(v.len() as u64) as usize]
    }

    fn ptr(&mut self) -> Ptr {
        match self.rng.below(10) {
            0 => Ptr::Null,
            1 => Ptr::Host,
            2 if !self.freed.is_empty() => Ptr::Freed(self.rng.below(self.freed.len() as u64) as usize),
            _ if !self.live.is_empty() => Ptr::Live(self.rng.below(self.live.len() as u64) as usize),
            _ => Ptr::Null,
        }
    }

    fn raw(&self, p: Ptr) -> *mut c_void {
        match p {
            Ptr::Live(i) => self.live[i].0,
            Ptr::Null => null_mut(),
            Ptr::Host => self.host.as_ptr() as *mut c_void,
            Ptr::Freed(i) => self.freed[i],
        }
    }

    /// Whether `p` holds `bytes` (no bytes need no buffer).
    fn holds(&self, p: Ptr, bytes: usize) -> bool {
        bytes == 0 || matches!(p, Ptr::Live(i) if self.live[i].1 >= bytes)
    }

    fn handle(&mut self) -> Handle {
        match self.rng.below(12) {
            0 => Handle::Null,
            1 => Handle::NeverCreated,
            2 if !self.destroyed.is_empty() => Handle::Destroyed(self.rng.below(self.destroyed.len() as u64) as usize),
            3 if !self.aborted.is_empty() => Handle::Aborted(self.rng.below(self.aborted.len() as u64) as usize),
            _ => Handle::Main,
        }
    }

    fn raw_handle(&self, h: Handle) -> c::Comm {
        match h {
            Handle::Main => self.comm,
            Handle::Null => null_mut(),
            Handle::NeverCreated => 0x2000 as c::Comm,
            Handle::Destroyed(i) => self.destroyed[i],
            Handle::Aborted(i) => self.aborted[i],
        }
    }

    /// The code a call on `h` gets before its arguments are looked at, if any.
    fn handle_code(h: Handle) -> Option<ErrorCode> {
        match h {
            Handle::Main => None,
            Handle::Null => Some(ErrorCode::InvalidArgument),
            Handle::NeverCreated | Handle::Destroyed(_) => Some(ErrorCode::InvalidUsage),
            Handle::Aborted(_) => Some(ErrorCode::Aborted),
        }
    }

    fn check(&mut self, what: &str, rc: c_int, want: ErrorCode) {
        self.calls += 1;
        assert_eq!(code_of(rc), want, "call {}: {what}: {}", self.calls, c::last_error());
        if rc != OK {
            self.refused += 1;
            assert!(!c::last_error().is_empty(), "call {}: {what}: no message", self.calls);
        }
    }

    /// Both streams drained, so buffers can be freed and read.
    fn sync(&mut self) {
        for s in [self.stream, null_mut()] {
            let rc = c::hocclStreamSynchronize(self.comm, s);
            self.check("hocclStreamSynchronize", rc, ErrorCode::Success);
        }
    }

    fn collective(&mut self) {
        let op = self.pick(&FUZZ_OPS);
        let h = self.handle();
        let (sp, rp) = (self.ptr(), self.ptr());
        let count = self.pick(&[0usize, 1, 7, 256, 257, 1024, 1025, usize::MAX / 2]);
        let dtype = self.pick(&DTYPES);
        let red = self.pick(&[0, 1, 2, 3, 4, 5, -1]);
        // One rank: root 0 and no valid peer (a send to self needs a receive in a group).
        let rank = if op.p2p() { self.pick(&[1, -1, c_int::MAX]) } else { self.pick(&[0, 0, 0, 1, -1]) };
        // An unknown stream is found when the op launches: at the call outside a group, at
        // hocclGroupEnd inside one.
        let unknown = if self.depth > 0 { 0 } else { 0x7fff_0001 };
        let stream = self.pick(&[self.stream as u64, self.stream as u64, 0, unknown]);
        let a = Args { send: self.raw(sp) as u64, recv: self.raw(rp) as u64, count, dtype, red, rank, stream };
        let want = Fuzz::handle_code(h).unwrap_or_else(|| {
            let es = DataType::from_raw("fuzz", dtype).ok().map(|d| d.size());
            let bytes = es.and_then(|es| count.checked_mul(es));
            let (uses_send, uses_recv) = (op != Recv, op != Send);
            let args_ok = es.is_some()
                && (!op.reduces() || RedOp::from_raw("fuzz", red).is_ok())
                && (!op.rooted() || rank == 0)
                && !op.p2p()
                && bytes.is_some_and(|b| (!uses_send || self.holds(sp, b)) && (!uses_recv || self.holds(rp, b)))
                // (In-place AlltoAll is refused only with more than one rank.)
                // A one-rank op in place enqueues nothing, so its stream is never looked up;
                // a reduction looks it up on one rank too.
                && (stream != 0x7fff_0001 || bytes == Some(0) || (sp == rp && !op.reduces()));
            if !args_ok {
                ErrorCode::InvalidArgument
            } else if self.depth > 0 && self.group_stream.is_some_and(|g| g != stream) {
                ErrorCode::InvalidUsage
            } else {
                ErrorCode::Success
            }
        });
        let rc = c_call(self.raw_handle(h), op, &a);
        if rc == OK && self.depth > 0 {
            self.group_stream.get_or_insert(stream);
        }
        self.check(&format!("{} {a:?} on {h:?} ({sp:?}, {rp:?}, depth {})", op.c_name(), self.depth), rc, want);
    }

    /// The entry points besides the collectives and the calls `step` makes itself, each with
    /// random argument classes; the expected code as `hoccl.h` documents it.
    fn other_entry_point(&mut self) {
        let h = self.handle();
        let comm = self.raw_handle(h);
        let on_handle = |ok: ErrorCode| Fuzz::handle_code(h).unwrap_or(ok);
        match self.rng.below(11) {
            0 => {
                let mut v = 0;
                let null = self.rng.below(2) == 0;
                let rc = c::hocclGetVersion(if null { null_mut() } else { &mut v });
                self.check("hocclGetVersion", rc, if null { ErrorCode::InvalidArgument } else { ErrorCode::Success });
                assert!(null || v > 0, "version {v}");
            }
            1 => {
                let r = self.pick(&[0, 4, 12, 13, -1, c_int::MAX, c_int::MIN]);
                let p = c::hocclGetErrorString(r);
                self.calls += 1;
                assert!(!p.is_null(), "hocclGetErrorString({r}) is NULL");
                // SAFETY: a non-NULL result is a static NUL-terminated string.
                assert!(!unsafe { std::ffi::CStr::from_ptr(p) }.to_bytes().is_empty(), "hocclGetErrorString({r}) is empty");
            }
            2 => {
                let mut r = -1;
                let null = h == Handle::Main && self.rng.below(3) == 0;
                let rc = c::hocclCommUserRank(comm, if null { null_mut() } else { &mut r });
                self.check(&format!("hocclCommUserRank on {h:?}, out NULL {null}"), rc, if null { ErrorCode::InvalidArgument } else { on_handle(ErrorCode::Success) });
                assert!(rc != OK || r == 0);
            }
            3 if self.depth == 0 => {
                // Arguments that fail before any rendezvous (a valid set would wait for peers).
                let mut out = null_mut();
                let (nranks, rank, zero_id) = match self.rng.below(4) {
                    0 => (self.pick(&[0, -1, c_int::MIN]), 0, false),
                    1 => (2, self.pick(&[-1, 2, c_int::MAX]), false),
                    2 => (1, 0, true),
                    _ => (1, 0, false),
                };
                let null = !zero_id && nranks == 1;
                let mut id = UniqueId { internal: [0; 128] };
                if !zero_id {
                    for b in id.internal.iter_mut() {
                        *b = self.rng.below(256) as u8;
                    }
                }
                let rc = c::hocclCommInitRank(if null { null_mut() } else { &mut out }, nranks, id, rank);
                self.check(&format!("hocclCommInitRank({nranks}, rank {rank}, zero id {zero_id}, out NULL {null})"), rc, ErrorCode::InvalidArgument);
                assert!(out.is_null(), "a refused init returned a handle");
            }
            4 => {
                let rc = c::hocclGetUniqueId(null_mut());
                self.check("hocclGetUniqueId(NULL)", rc, ErrorCode::InvalidArgument);
            }
            5 => {
                let f = self.pick(&[0, 1, -1, c_int::MAX]);
                let rc = c::hocclCommInitMpi(null_mut(), f);
                self.check(&format!("hocclCommInitMpi(NULL, {f})"), rc, ErrorCode::InvalidArgument);
            }
            6 if self.depth == 0 => {
                // A stream created and destroyed, or a create with a NULL out-pointer.
                let null = h == Handle::Main && self.rng.below(3) == 0;
                let mut st = null_mut();
                let rc = c::hocclStreamCreate(comm, if null { null_mut() } else { &mut st });
                self.check(&format!("hocclStreamCreate on {h:?}, out NULL {null}"), rc, if null { ErrorCode::InvalidArgument } else { on_handle(ErrorCode::Success) });
                if rc == OK {
                    let rc = c::hocclStreamDestroy(comm, st);
                    self.check("hocclStreamDestroy(new stream)", rc, ErrorCode::Success);
                }
            }
            7 if self.depth == 0 && h != Handle::Main => {
                let rc = c::hocclStreamDestroy(comm, self.stream);
                self.check(&format!("hocclStreamDestroy on {h:?}"), rc, on_handle(ErrorCode::Success));
            }
            8 if self.depth == 0 => {
                let s = self.pick(&[self.stream, null_mut()]);
                let rc = c::hocclStreamSynchronize(comm, s);
                self.check(&format!("hocclStreamSynchronize on {h:?}"), rc, on_handle(ErrorCode::Success));
            }
            9 if self.depth == 0 => {
                // Copies between the host and a device pointer of any class; the host side is
                // always valid for the size, or NULL.
                let to_device = self.rng.below(2) == 0;
                let dp = self.ptr();
                let bytes = self.pick(&[0usize, 1, 64, 1024, 4096, 4097]);
                let host_null = self.rng.below(6) == 0;
                let mut host = vec![0u8; 4097];
                let hp = if host_null { null_mut() } else { host.as_mut_ptr() as *mut c_void };
                if matches!(dp, Ptr::Live(_)) {
                    self.sync();
                }
                let rc = if to_device { c::hocclMemcpyToDevice(comm, self.raw(dp), hp, bytes) } else { c::hocclMemcpyToHost(comm, hp, self.raw(dp), bytes) };
                let want = on_handle(if bytes > 0 && (host_null || !self.holds(dp, bytes)) { ErrorCode::InvalidArgument } else { ErrorCode::Success });
                self.check(&format!("hocclMemcpyTo{} on {h:?} ({dp:?}, host NULL {host_null}, {bytes} bytes)", if to_device { "Device" } else { "Host" }), rc, want);
            }
            _ => {
                // AlltoAllv on one rank: counts and displacements NULL or one entry each.
                let (sp, rp) = (self.ptr(), self.ptr());
                let n = self.pick(&[0usize, 1, 16, 4096, usize::MAX / 2]);
                let disp = self.pick(&[0usize, 0, 4, usize::MAX / 4]);
                let dtype = self.pick(&DTYPES);
                let arrays = [[n], [disp], [n], [disp]];
                let null = self.rng.below(4) == 0;
                let arr = |i: usize| if null && i == 2 { std::ptr::null() } else { arrays[i].as_ptr() };
                let rc = c::hocclAlltoAllv(self.raw(sp), arr(0), arr(1), self.raw(rp), arr(2), arr(3), dtype, comm, self.stream);
                let es = DataType::from_raw("fuzz", dtype).ok().map(|d| d.size());
                // Byte sizes past isize::MAX overflow; an empty block's displacement counts too.
                let bytes = |x: Option<usize>| x.and_then(|x| es.and_then(|es| x.checked_mul(es))).filter(|b| *b <= isize::MAX as usize);
                let end = bytes(n.checked_add(disp));
                // Send and receive ranges may not overlap (in place is refused even on one rank).
                let ok = !null
                    && bytes(Some(disp)).is_some()
                    && (n == 0 || end.is_some_and(|b| self.holds(sp, b) && self.holds(rp, b) && sp != rp));
                let grouped = self.depth > 0 && self.group_stream.is_some_and(|g| g != self.stream as u64);
                let want = on_handle(if !ok { ErrorCode::InvalidArgument } else if grouped { ErrorCode::InvalidUsage } else { ErrorCode::Success });
                if rc == OK && self.depth > 0 {
                    self.group_stream.get_or_insert(self.stream as u64);
                }
                self.check(&format!("hocclAlltoAllv(n {n}, disp {disp}, dtype {dtype}, NULL array {null}) on {h:?} ({sp:?}, {rp:?})"), rc, want);
            }
        }
    }

    fn step(&mut self) {
        match self.rng.below(26) {
            20..=25 => self.other_entry_point(),
            0..=11 => self.collective(),
            12 => {
                let rc = c::hocclGroupStart();
                self.depth += 1;
                self.check("hocclGroupStart", rc, ErrorCode::Success);
            }
            13 => {
                let want = if self.depth == 0 { ErrorCode::InvalidUsage } else { ErrorCode::Success };
                let rc = c::hocclGroupEnd();
                self.depth = self.depth.saturating_sub(1);
                if self.depth == 0 {
                    self.group_stream = None;
                }
                self.check("hocclGroupEnd", rc, want);
            }
            14 if self.depth == 0 => {
                let h = self.handle();
                let bytes = self.pick(&[1usize, 1024, 4096]);
                let mut p = null_mut();
                let rc = c::hocclMemAlloc(self.raw_handle(h), &mut p, bytes);
                self.check(&format!("hocclMemAlloc on {h:?}"), rc, Fuzz::handle_code(h).unwrap_or(ErrorCode::Success));
                if rc == OK {
                    // A new allocation may take a freed address: that address is live again.
                    self.freed.retain(|f| (*f as usize) < p as usize || (*f as usize) >= p as usize + bytes);
                    self.live.push((p, bytes));
                }
            }
            15 if self.depth == 0 => {
                // Free a live buffer (after draining the streams: no pending op reads it), a
                // freed one, or a host pointer.
                let which = self.ptr();
                if matches!(which, Ptr::Live(_)) {
                    self.sync();
                }
                let p = self.raw(which);
                let want = if matches!(which, Ptr::Live(_) | Ptr::Null) { ErrorCode::Success } else { ErrorCode::InvalidArgument };
                let rc = c::hocclMemFree(self.comm, p);
                self.check(&format!("hocclMemFree({which:?})"), rc, want);
                if let Ptr::Live(i) = which {
                    self.live.swap_remove(i);
                    self.freed.push(p);
                }
            }
            16 => {
                let h = self.handle();
                let mut n = 0;
                let rc = c::hocclCommCount(self.raw_handle(h), &mut n);
                self.check(&format!("hocclCommCount on {h:?}"), rc, Fuzz::handle_code(h).unwrap_or(ErrorCode::Success));
                assert!(rc != OK || n == 1);
            }
            17 => {
                let mut e = -1;
                let rc = c::hocclCommGetAsyncError(self.comm, &mut e);
                self.check("hocclCommGetAsyncError", rc, ErrorCode::Success);
                assert_eq!(e, OK, "no call of the fuzzer may leave an asynchronous error");
            }
            18 if self.depth == 0 && self.destroyed.len() + self.aborted.len() < 8 => {
                // A spare communicator, destroyed or aborted.
                let spare = solo();
                if self.rng.below(2) == 0 {
                    let rc = c::hocclCommDestroy(spare);
                    self.check("hocclCommDestroy(spare)", rc, ErrorCode::Success);
                    self.destroyed.push(spare);
                } else {
                    let rc = c::hocclCommAbort(spare);
                    self.check("hocclCommAbort(spare)", rc, ErrorCode::Success);
                    self.aborted.push(spare);
                }
            }
            _ => {
                let h = self.handle();
                if h != Handle::Main {
                    let rc = c::hocclCommDestroy(self.raw_handle(h));
                    // Destroying an aborted handle is quiet, and releases it.
                    let want = match h {
                        Handle::Aborted(_) => ErrorCode::Success,
                        _ => Fuzz::handle_code(h).unwrap_or(ErrorCode::Success),
                    };
                    self.check(&format!("hocclCommDestroy({h:?})"), rc, want);
                    if let Handle::Aborted(i) = h {
                        let c = self.aborted.swap_remove(i);
                        self.destroyed.push(c);
                    }
                }
            }
        }
    }
}

/// Random sequences of C API calls on a one-rank communicator, each checked against the
/// code its argument classes call for (`Fuzz::collective` states the rules), then a good
/// AllReduce and a clean destroy. Every entry point of `hoccl.h` is called (`step`,
/// `other_entry_point`), hocclCommInitMpi only with a NULL out-pointer (the test runs without
/// MPI). A fixed seed and `HOCCL_FUZZ_ITERS` calls (20,000 in CI, 0.1 s; set it higher, with
/// `HOCCL_FUZZ_SEED` for another seed, for a longer run).
#[test]
fn fuzz_the_c_api() {
    let _g = serial();
    logs::capture();
    let var = |k: &str| std::env::var(k).ok().and_then(|v| v.parse().ok());
    let calls: usize = var("HOCCL_FUZZ_ITERS").or_else(|| var("HOCCL_FUZZ_CALLS")).unwrap_or(20_000);
    let seed: u64 = var("HOCCL_FUZZ_SEED").map(|v| v as u64).unwrap_or(41);
    // Printed first, so that a run that dies can be repeated.
    eprintln!("fuzz seed {seed} (HOCCL_FUZZ_SEED), {calls} calls (HOCCL_FUZZ_ITERS)");
    let t = Instant::now();
    let comm = solo();
    let mut stream = null_mut();
    assert_eq!(c::hocclStreamCreate(comm, &mut stream), OK);
    let mut f = Fuzz {
        rng: Rng(seed),
        comm,
        stream,
        live: Vec::new(),
        freed: Vec::new(),
        destroyed: Vec::new(),
        aborted: Vec::new(),
        host: vec![0; 4096],
        depth: 0,
        group_stream: None,
        calls: 0,
        refused: 0,
    };
    for _ in 0..4 {
        let bytes = f.pick(&[1024usize, 4096]);
        f.live.push((alloc(comm, bytes), bytes));
    }
    while f.calls < calls {
        f.step();
    }
    while f.depth > 0 {
        assert_eq!(c::hocclGroupEnd(), OK, "{}", c::last_error());
        f.depth -= 1;
    }
    f.sync();
    // Still usable: a good one-rank AllReduce copies its input.
    let (a, b) = (alloc(comm, 64), alloc(comm, 64));
    let input = f32_bytes(&good_input(0, 1));
    assert_eq!(c::hocclMemcpyToDevice(comm, a, input.as_ptr().cast(), 64), OK);
    assert_eq!(c::hocclAllReduce(a, b, 16, F32, 0, comm, stream), OK, "{}", c::last_error());
    assert_eq!(c::hocclStreamSynchronize(comm, stream), OK);
    let mut got = vec![0u8; 64];
    assert_eq!(c::hocclMemcpyToHost(comm, got.as_mut_ptr().cast(), b, 64), OK);
    assert_eq!(got, input);
    for c in f.aborted.drain(..) {
        assert_eq!(c::hocclCommDestroy(c), OK);
    }
    assert_eq!(c::hocclCommDestroy(comm), OK, "{}", c::last_error());
    assert!(f.refused > f.calls / 4 && f.refused < f.calls, "{} of {} calls refused: the classes are unbalanced", f.refused, f.calls);
    eprintln!("fuzz seed {seed}: {} C calls, {} refused, in {:?}", f.calls, f.refused, t.elapsed());
}
