//! Bad input through the NCCL ABI, table-driven (issue 41, item 3; the table in prose is
//! `docs/design.md`, "Errors"): every refused call returns NCCL's documented code with a
//! message for `ncclGetLastError`, on both ranks alike, and both ranks then run a good
//! AllReduce and check its sum. The faulted buffer is one every rank uses, so a refusal is
//! the same on every rank.
//!
//! A freed pointer is not a case here: the tests of this crate run concurrently and share
//! one allocation registry, so a freed address may be another test's live buffer. hoccl's
//! own C ABI test (`tests/bad_input.rs`) covers it through the same validation.
use super::*;
use std::ffi::CStr;
use std::ptr::null_mut;

fn last() -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }.to_string_lossy().into_owned()
}

const F32: ncclDataType_t = 7;
const BYTES: usize = 4096;
const N: usize = 16;

#[derive(Clone, Copy, Debug, PartialEq)]
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

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    NullBuffer,
    HostPointer,
    ShortBuffer,
    ByteSizeOverflows,
    DtypeNegative,
    DtypePastLast,
    RedOpPastLast,
    RedOpNegative,
    RootIsSize,
    RootNegative,
    PeerIsSize,
    PeerNegative,
    CommNull,
    CommDestroyed,
}
use Fault::*;

/// The table: fault, NCCL's code for it.
const FAULTS: [(Fault, ncclResult_t); 14] = [
    (NullBuffer, NCCL_INVALID_ARGUMENT),
    (HostPointer, NCCL_INVALID_ARGUMENT),
    (ShortBuffer, NCCL_INVALID_ARGUMENT),
    (ByteSizeOverflows, NCCL_INVALID_ARGUMENT),
    (DtypeNegative, NCCL_INVALID_ARGUMENT),
    (DtypePastLast, NCCL_INVALID_ARGUMENT),
    (RedOpPastLast, NCCL_INVALID_ARGUMENT),
    (RedOpNegative, NCCL_INVALID_ARGUMENT),
    (RootIsSize, NCCL_INVALID_ARGUMENT),
    (RootNegative, NCCL_INVALID_ARGUMENT),
    (PeerIsSize, NCCL_INVALID_ARGUMENT),
    (PeerNegative, NCCL_INVALID_ARGUMENT),
    (CommNull, NCCL_INVALID_ARGUMENT),
    (CommDestroyed, NCCL_INVALID_USAGE),
];

const OPS: [Op; 10] = [AllGather, AllToAll, Broadcast, Gather, Scatter, AllReduce, ReduceScatter, Reduce, Send, Recv];

fn applies(f: Fault, op: Op) -> bool {
    let reduces = matches!(op, AllReduce | ReduceScatter | Reduce);
    let rooted = matches!(op, Broadcast | Gather | Scatter | Reduce);
    let p2p = matches!(op, Send | Recv);
    match f {
        RedOpPastLast | RedOpNegative => reduces,
        RootIsSize | RootNegative => rooted,
        PeerIsSize | PeerNegative => p2p,
        _ => true,
    }
}

/// One call with the fault applied; `a`, `b`: this rank's buffers of `BYTES`.
#[allow(clippy::too_many_arguments)]
fn call(op: Op, f: Fault, rank: c_int, comm: ncclComm_t, destroyed: ncclComm_t, a: *mut c_void, b: *mut c_void, host: &mut [u8]) -> ncclResult_t {
    let (mut s, mut r, mut n, mut d, mut red) = (a as *const c_void, b, N, F32, 0);
    let mut root = if matches!(op, Send | Recv) { 1 - rank } else { 0 };
    let c = match f {
        CommNull => null_mut(),
        CommDestroyed => destroyed,
        _ => comm,
    };
    // The buffer every rank uses: the receive buffer of Broadcast, Scatter and Recv.
    let recv_side = matches!(op, Broadcast | Scatter | Recv);
    let mut bad = |p: *mut c_void| {
        if recv_side {
            r = p
        } else {
            s = p
        }
    };
    match f {
        NullBuffer => bad(null_mut()),
        HostPointer => bad(host.as_mut_ptr().cast()),
        ShortBuffer => n = BYTES / 4 + 1,
        ByteSizeOverflows => n = usize::MAX / 2,
        DtypeNegative => d = -1,
        DtypePastLast => d = DataType::ALL.iter().map(|t| *t as c_int).max().unwrap_or(0) + 1,
        RedOpPastLast => red = NCCL_NUM_OPS,
        RedOpNegative => red = -1,
        RootIsSize | PeerIsSize => root = 2,
        RootNegative | PeerNegative => root = -1,
        CommNull | CommDestroyed => {}
    }
    let st = null_mut();
    match op {
        AllGather => ncclAllGather(s, r, n, d, c, st),
        AllToAll => ncclAlltoAll(s, r, n, d, c, st),
        Broadcast => ncclBroadcast(s, r, n, d, root, c, st),
        Gather => ncclGather(s, r, n, d, root, c, st),
        Scatter => ncclScatter(s, r, n, d, root, c, st),
        AllReduce => ncclAllReduce(s, r, n, d, red, c, st),
        ReduceScatter => ncclReduceScatter(s, r, n, d, red, c, st),
        Reduce => ncclReduce(s, r, n, d, red, root, c, st),
        Send => ncclSend(s, n, d, root, c, st),
        Recv => ncclRecv(r, n, d, root, c, st),
    }
}

fn input(rank: c_int, i: usize) -> Vec<f32> {
    (0..N).map(|k| (rank as usize * 1000 + i * 10 + k) as f32).collect()
}

#[test]
fn table_through_the_nccl_abi() {
    std::env::set_var("HOCCL_BACKEND", "host");
    let mut comms = vec![null_mut(); 2];
    assert_eq!(ncclCommInitAll(comms.as_mut_ptr(), 2, std::ptr::null()), NCCL_SUCCESS, "{}", last());
    let ids: Vec<usize> = comms.iter().map(|c| *c as usize).collect();
    let threads: Vec<_> = ids
        .into_iter()
        .map(|id| {
            std::thread::spawn(move || {
                let comm = id as ncclComm_t;
                let mut rank = -1;
                assert_eq!(ncclCommUserRank(comm, &mut rank), NCCL_SUCCESS);
                // A destroyed handle: a one-rank communicator of its own.
                let mut uid = UniqueId { internal: [0; 128] };
                assert_eq!(ncclGetUniqueId(&mut uid), NCCL_SUCCESS, "{}", last());
                let mut destroyed = null_mut();
                assert_eq!(ncclCommInitRank(&mut destroyed, 1, uid, 0), NCCL_SUCCESS, "{}", last());
                assert_eq!(ncclCommDestroy(destroyed), NCCL_SUCCESS);
                let (mut a, mut b) = (null_mut(), null_mut());
                assert_eq!(ncclMemAlloc(&mut a, BYTES), NCCL_SUCCESS);
                assert_eq!(ncclMemAlloc(&mut b, BYTES), NCCL_SUCCESS);
                let mut host = vec![0u8; BYTES];
                let mut i = 0;
                for op in OPS {
                    for (f, want) in FAULTS.into_iter().filter(|(f, _)| applies(*f, op)) {
                        let rc = call(op, f, rank, comm, destroyed, a, b, &mut host);
                        assert_eq!(rc, want, "{op:?} with {f:?}: {}", last());
                        assert!(!last().is_empty(), "{op:?} with {f:?}: no message");
                        // Still usable: a good AllReduce gives the sum.
                        // SAFETY: on the host backend ncclMemAlloc memory is host memory of
                        // BYTES bytes, and no operation is pending on it (Finalize below).
                        let (sa, sb) = unsafe { (std::slice::from_raw_parts_mut(a.cast::<f32>(), N), std::slice::from_raw_parts(b.cast::<f32>(), N)) };
                        sa.copy_from_slice(&input(rank, i));
                        assert_eq!(ncclAllReduce(a, b, N, F32, 0, comm, null_mut()), NCCL_SUCCESS, "after {op:?} with {f:?}: {}", last());
                        assert_eq!(ncclCommFinalize(comm), NCCL_SUCCESS, "{}", last());
                        let want: Vec<f32> = (0..N).map(|k| input(0, i)[k] + input(1, i)[k]).collect();
                        assert_eq!(sb, &want[..], "after {op:?} with {f:?}");
                        i += 1;
                    }
                }
                // Group misuse: an end without a start; nested groups balance.
                assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
                assert!(last().contains("ncclGroupStart"), "{}", last());
                for _ in 0..3 {
                    assert_eq!(ncclGroupStart(), NCCL_SUCCESS);
                }
                for _ in 0..3 {
                    assert_eq!(ncclGroupEnd(), NCCL_SUCCESS, "{}", last());
                }
                assert_eq!(ncclGroupEnd(), NCCL_INVALID_USAGE);
                // Freeing a host pointer is refused; the buffers are freed once.
                assert_eq!(ncclMemFree(host.as_mut_ptr().cast()), NCCL_INVALID_ARGUMENT);
                let mut e = -1;
                assert_eq!(ncclCommGetAsyncError(comm, &mut e), NCCL_SUCCESS);
                assert_eq!(e, NCCL_SUCCESS);
                assert_eq!(ncclMemFree(a), NCCL_SUCCESS);
                assert_eq!(ncclMemFree(b), NCCL_SUCCESS);
                i
            })
        })
        .collect();
    let counts: Vec<usize> = threads.into_iter().map(|t| t.join().expect("rank")).collect();
    assert!(counts[0] > 50, "{} cases", counts[0]);
    for c in comms {
        assert_eq!(ncclCommDestroy(c), NCCL_SUCCESS, "{}", last());
    }
}
