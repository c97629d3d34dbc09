//! The exported functions end to end on hoccl's host backend (this machine has no GPU in
//! CI): ranks as threads of this process through `ncclCommInitAll`, or one rank through a
//! unique id; stream 0, buffers from `ncclMemAlloc`, results read after `ncclCommFinalize`.
use super::*;
use std::ffi::CStr;
use std::ptr::{null, null_mut};

fn last() -> String {
    // SAFETY: ncclGetLastError returns a NUL-terminated string owned by this thread.
    unsafe { CStr::from_ptr(ncclGetLastError(null_mut())) }.to_string_lossy().into_owned()
}

fn ok(r: ncclResult_t) {
    assert_eq!(r, NCCL_SUCCESS, "{}", last());
}

/// A buffer of `n` f32 from ncclMemAlloc (host memory on the host backend).
struct Buf(*mut c_void, usize);
impl Buf {
    fn new(n: usize) -> Buf {
        let mut p = null_mut();
        ok(ncclMemAlloc(&mut p, n * 4));
        Buf(p, n)
    }
    fn f32s(&mut self) -> &mut [f32] {
        // SAFETY: host-backend device memory is host memory of n f32, read after Finalize.
        unsafe { std::slice::from_raw_parts_mut(self.0.cast::<f32>(), self.1) }
    }
}
impl Drop for Buf {
    fn drop(&mut self) {
        ok(ncclMemFree(self.0));
    }
}

/// The handle as an integer, so it can move to the rank's thread.
fn id(c: ncclComm_t) -> usize {
    c as usize
}

fn init_all(n: usize) -> Vec<usize> {
    std::env::set_var("HOCCL_BACKEND", "host");
    let mut comms = vec![null_mut(); n];
    ok(ncclCommInitAll(comms.as_mut_ptr(), n as c_int, null()));
    assert!(comms.iter().all(|c| !c.is_null()));
    comms.into_iter().map(id).collect()
}

#[test]
fn collectives_groups_and_split_on_two_ranks() {
    const N: usize = 1000;
    let comms = init_all(2);
    let threads: Vec<_> = comms
        .iter()
        .map(|&c| {
            std::thread::spawn(move || {
                let c = c as ncclComm_t;
                let (mut rank, mut size, mut dev) = (-1, -1, -1);
                ok(ncclCommUserRank(c, &mut rank));
                ok(ncclCommCount(c, &mut size));
                ok(ncclCommCuDevice(c, &mut dev));
                assert_eq!((size, dev), (2, 0));
                let r = rank as f32;
                let mut s = Buf::new(N);
                let mut out = Buf::new(2 * N);
                for (i, v) in s.f32s().iter_mut().enumerate() {
                    *v = r + i as f32;
                }
                ok(ncclAllReduce(s.0, out.0, N, 7, 0, c, null_mut()));
                ok(ncclCommFinalize(c));
                assert!(out.f32s()[..N].iter().enumerate().all(|(i, v)| *v == 1.0 + 2.0 * i as f32));
                ok(pncclAllGather(s.0, out.0, N, 7, c, null_mut()));
                ok(ncclCommFinalize(c));
                assert!(out.f32s().iter().enumerate().all(|(i, v)| *v == (i / N) as f32 + (i % N) as f32));
                // Send/Recv in a group, to the other rank.
                ok(ncclGroupStart());
                ok(ncclSend(s.0, N, 7, 1 - rank, c, null_mut()));
                ok(ncclRecv(out.0, N, 7, 1 - rank, c, null_mut()));
                ok(ncclGroupEnd());
                ok(ncclCommFinalize(c));
                assert!(out.f32s()[..N].iter().enumerate().all(|(i, v)| *v == (1 - rank) as f32 + i as f32));
                // Bcast in place from rank 1.
                ok(ncclBcast(s.0, N, 7, 1, c, null_mut()));
                ok(ncclCommFinalize(c));
                assert!(s.f32s().iter().enumerate().all(|(i, v)| *v == 1.0 + i as f32));
                // PreMulSum: sum(scalar * x) with the scalar read at creation (host) or by
                // the reduce step when it runs (device memory, written after creation).
                // s holds 1 + i on both ranks here (the Bcast above).
                let (mut op, scalar) = (0, 2.5f32);
                ok(ncclRedOpCreatePreMulSum(&mut op, &scalar as *const f32 as *mut c_void, 7, 1, c));
                assert!(op >= 5);
                ok(ncclAllReduce(s.0, out.0, N, 7, op, c, null_mut()));
                ok(ncclCommFinalize(c));
                assert!(out.f32s()[..N].iter().enumerate().all(|(i, v)| *v == 5.0 * (1.0 + i as f32)), "PreMulSum, host scalar");
                let mut dscalar = Buf::new(1);
                let mut dop = 0;
                ok(ncclRedOpCreatePreMulSum(&mut dop, dscalar.0, 7, 0, c));
                dscalar.f32s()[0] = -0.5;
                ok(ncclReduceScatter(out.0, s.0, N / 2, 7, dop, c, null_mut()));
                ok(ncclCommFinalize(c));
                let me = rank as usize * (N / 2);
                assert!(s.f32s()[..N / 2].iter().enumerate().all(|(i, v)| *v == -5.0 * (1.0 + (me + i) as f32)), "PreMulSum, device scalar");
                // The operator's data type and communicator are its own.
                assert_eq!(ncclAllReduce(s.0, out.0, N, 2, op, c, null_mut()), NCCL_INVALID_ARGUMENT);
                assert!(last().contains("made for f32 data"), "{}", last());
                assert_eq!(ncclRedOpCreatePreMulSum(&mut dop, s.0, 7, 2, c), NCCL_INVALID_ARGUMENT);
                let host_only = [0f32; 1];
                assert_eq!(ncclRedOpCreatePreMulSum(&mut op, host_only.as_ptr() as *mut c_void, 7, 0, c), NCCL_INVALID_ARGUMENT);
                ok(ncclRedOpDestroy(op, c));
                ok(ncclRedOpDestroy(dop, c));
                assert_eq!(ncclRedOpDestroy(op, c), NCCL_INVALID_ARGUMENT);
                assert_eq!(ncclAllReduce(s.0, out.0, N, 7, op, c, null_mut()), NCCL_INVALID_ARGUMENT);
                // Restore s (1 + i) for the checks below.
                for (i, v) in s.f32s().iter_mut().enumerate() {
                    *v = 1.0 + i as f32;
                }
                // Bad arguments come back from hoccl's funnel as NCCL codes.
                assert_eq!(ncclAllReduce(s.0, out.0, N, 12, 0, c, null_mut()), NCCL_INVALID_ARGUMENT);
                assert_eq!(ncclBroadcast(s.0, out.0, N, 7, 2, c, null_mut()), NCCL_INVALID_ARGUMENT);
                assert_eq!(ncclSend(s.0, N, 7, -1, c, null_mut()), NCCL_INVALID_ARGUMENT);
                // Registration is accepted and hands out a token.
                let mut h = null_mut();
                ok(ncclCommRegister(c, s.0, N * 4, &mut h));
                assert!(!h.is_null());
                ok(ncclCommDeregister(c, h));
                // Split: each rank alone (color = rank), then NOCOLOR for everybody.
                let mut sub = null_mut();
                ok(ncclCommSplit(c, rank, 0, &mut sub, null_mut()));
                ok(ncclCommCount(sub, &mut size));
                ok(ncclCommUserRank(sub, &mut rank));
                assert_eq!((size, rank), (1, 0));
                ok(ncclCommDestroy(sub));
                let mut none = 1usize as ncclComm_t;
                ok(ncclCommSplit(c, NCCL_SPLIT_NOCOLOR, 0, &mut none, null_mut()));
                assert!(none.is_null());
                // The device API: teams from the communicator, the rest refused.
                let mut me = -1;
                ok(ncclCommUserRank(c, &mut me));
                let world = ncclTeamWorld(c);
                assert_eq!(world, ncclTeam_t { n_ranks: 2, rank: me, stride: 1 });
                assert_eq!(pncclTeamRankToWorld(c, world, 1 - me), 1 - me);
                assert_eq!(ncclTeamLsa(c), ncclTeam_t::default());
                assert!(last().contains("ncclTeamLsa"), "{}", last());
                assert_eq!(ncclTeamRankToLsa(c, world, 0), -1);
                assert_eq!(ncclDevCommCreate(c, null(), null_mut()), NCCL_INVALID_USAGE);
                assert_eq!(ncclTeamWorld(null_mut()), ncclTeam_t::default());
                let mut e = -1;
                ok(ncclCommGetAsyncError(c, &mut e));
                assert_eq!(e, NCCL_SUCCESS);
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    for c in comms {
        ok(ncclCommDestroy(c as ncclComm_t));
        assert_eq!(ncclCommDestroy(c as ncclComm_t), NCCL_INVALID_USAGE);
    }
}

#[test]
fn device_api_slot_arithmetic_is_nccls() {
    assert_eq!(ncclLLA2ACalcSlots(10, 9), 20);
    assert_eq!(ncclLLA2ACalcSlots(10, 8), 10);
    assert_eq!(pncclLLA2ACalcSlots(3, 0), 0);
}

#[test]
fn split_orders_ranks_by_key() {
    let comms = init_all(3);
    let threads: Vec<_> = comms
        .iter()
        .map(|&c| {
            std::thread::spawn(move || {
                let c = c as ncclComm_t;
                let mut rank = -1;
                ok(ncclCommUserRank(c, &mut rank));
                // One color, keys reversing the order.
                let mut sub = null_mut();
                ok(ncclCommSplit(c, 0, 10 - rank, &mut sub, null_mut()));
                let (mut r, mut n) = (-1, -1);
                ok(ncclCommUserRank(sub, &mut r));
                ok(ncclCommCount(sub, &mut n));
                assert_eq!((r, n), (2 - rank, 3));
                ok(ncclCommDestroy(sub));
                ok(ncclCommDestroy(c));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

#[test]
fn config_and_abort_through_a_unique_id() {
    std::env::set_var("HOCCL_BACKEND", "host");
    let mut uid = UniqueId { internal: [0; 128] };
    ok(ncclGetUniqueId(&mut uid));
    let mut cfg = initializer();
    cfg.magic = 0;
    cfg.blocking = 0;
    let mut c = 1usize as ncclComm_t;
    assert_eq!(ncclCommInitRankConfig(&mut c, 1, uid, 0, &mut cfg), NCCL_INVALID_ARGUMENT);
    assert!(c.is_null(), "a failed creation leaves NULL");
    assert!(last().contains("NCCL_CONFIG_INITIALIZER"), "{}", last());
    assert_eq!(ncclCommInitRankConfig(&mut c, 1, uid, 1, null_mut()), NCCL_INVALID_ARGUMENT);
    cfg.magic = NCCL_API_MAGIC;
    ok(ncclCommInitRankConfig(&mut c, 1, uid, 0, &mut cfg));
    let mut e = -1;
    ok(ncclCommGetAsyncError(c, &mut e));
    assert_eq!(e, NCCL_SUCCESS, "non-blocking creation is complete on return");
    ok(ncclCommAbort(c));
    assert_eq!(ncclCommGetAsyncError(c, &mut e), NCCL_INVALID_USAGE);
    assert_eq!(ncclCommAbort(c), NCCL_INVALID_USAGE);
}

/// NCCL's pattern for driving several ranks from one thread: the creations inside one
/// group return handles at once, `ncclGroupEnd` creates them together, and collectives
/// enqueued in the same group after the creations apply to the new communicators.
#[test]
fn ranks_created_inside_one_group_from_one_thread() {
    std::env::set_var("HOCCL_BACKEND", "host");
    const N: usize = 257;
    for n in [2usize, 4] {
        let mut uid = UniqueId { internal: [0; 128] };
        ok(ncclGetUniqueId(&mut uid));
        let mut comms = vec![null_mut(); n];
        let mut bufs: Vec<Buf> = (0..n).map(|_| Buf::new(N)).collect();
        for (r, b) in bufs.iter_mut().enumerate() {
            b.f32s().iter_mut().enumerate().for_each(|(i, v)| *v = (r * 10 + i) as f32);
        }
        ok(ncclGroupStart());
        for (r, c) in comms.iter_mut().enumerate() {
            let cfg = if r % 2 == 1 { Box::into_raw(Box::new(initializer())) } else { null_mut() };
            ok(ncclCommInitRankConfig(c, n as c_int, uid, r as c_int, cfg));
            if !cfg.is_null() {
                // SAFETY: made by Box::into_raw above; the config is read during the call only.
                drop(unsafe { Box::from_raw(cfg) });
            }
            assert!(!c.is_null(), "a deferred creation returns its handle at once");
        }
        // Before the group's end: the handles exist, the communicators do not yet.
        let mut count = -1;
        assert_eq!(ncclCommCount(comms[0], &mut count), NCCL_INVALID_USAGE);
        assert!(last().contains("ncclGroupEnd"), "{}", last());
        let mut e = -1;
        ok(ncclCommGetAsyncError(comms[0], &mut e));
        assert_eq!(e, NCCL_IN_PROGRESS);
        assert_eq!(ncclCommDestroy(comms[0]), NCCL_INVALID_USAGE, "a pending creation cannot be destroyed");
        for (c, b) in comms.iter().zip(&bufs) {
            ok(ncclAllReduce(b.0, b.0, N, 7, 0, *c, null_mut()));
        }
        ok(ncclGroupEnd());
        for (r, c) in comms.iter().enumerate() {
            let (mut me, mut size) = (-1, -1);
            ok(ncclCommUserRank(*c, &mut me));
            ok(ncclCommCount(*c, &mut size));
            assert_eq!((me, size), (r as c_int, n as c_int));
            ok(ncclCommGetAsyncError(*c, &mut e));
            assert_eq!(e, NCCL_SUCCESS);
            ok(ncclCommFinalize(*c));
        }
        let base = (0..n).map(|r| r * 10).sum::<usize>();
        for b in &mut bufs {
            assert!(b.f32s().iter().enumerate().all(|(i, v)| *v == (base + n * i) as f32), "AllReduce kept in the group, n = {n}");
        }
        // A split of every rank inside one group (two colors, key reversing the order), and
        // NOCOLOR, whose handle is NULL at once.
        let mut subs = vec![null_mut(); n];
        ok(ncclGroupStart());
        for (r, (c, s)) in comms.iter().zip(subs.iter_mut()).enumerate() {
            let color = if r == n - 1 && n > 2 { NCCL_SPLIT_NOCOLOR } else { (r % 2) as c_int };
            ok(ncclCommSplit(*c, color, -(r as c_int), s, null_mut()));
            assert_eq!(s.is_null(), color == NCCL_SPLIT_NOCOLOR);
        }
        ok(ncclGroupEnd());
        for (r, s) in subs.iter().enumerate().filter(|(_, s)| !s.is_null()) {
            let members: Vec<usize> = (0..n).filter(|&p| p % 2 == r % 2 && !(p == n - 1 && n > 2)).collect();
            let (mut me, mut size) = (-1, -1);
            ok(ncclCommUserRank(*s, &mut me));
            ok(ncclCommCount(*s, &mut size));
            let pos = members.iter().rev().position(|&p| p == r).unwrap();
            assert_eq!((me, size), (pos as c_int, members.len() as c_int), "split rank {r} of {n}");
            ok(ncclCommDestroy(*s));
        }
        for c in comms {
            ok(ncclCommDestroy(c));
        }
    }
}

/// A creation of a group that fails makes `ncclGroupEnd` fail, and every handle of the
/// group's creations reports it (the others' communicators are released); destroy and
/// abort take such handles back. Calls outside a group and on another thread are refused.
#[test]
fn a_failed_creation_fails_the_group_and_each_of_its_handles() {
    std::env::set_var("HOCCL_BACKEND", "host");
    let mut good = UniqueId { internal: [0; 128] };
    ok(ncclGetUniqueId(&mut good));
    let bad = UniqueId { internal: [0; 128] }; // not an id: the creation fails at the group's end
    let (mut a, mut b) = (null_mut(), null_mut());
    ok(ncclGroupStart());
    ok(ncclCommInitRank(&mut a, 1, good, 0));
    ok(ncclCommInitRank(&mut b, 1, bad, 0));
    // Bad arguments are still refused at the call.
    let mut c = 1usize as ncclComm_t;
    assert_eq!(ncclCommInitRank(&mut c, 1, good, 3), NCCL_INVALID_ARGUMENT);
    assert!(c.is_null());
    // A pending handle is another thread's business only after the group's end.
    let pending = id(a);
    std::thread::spawn(move || {
        let mut n = -1;
        assert_eq!(ncclCommCount(pending as ncclComm_t, &mut n), NCCL_INVALID_USAGE);
        assert_eq!(ncclAllReduce(null(), null_mut(), 0, 7, 0, pending as ncclComm_t, null_mut()), NCCL_INVALID_USAGE);
    })
    .join()
    .unwrap();
    let rc = ncclGroupEnd();
    assert_ne!(rc, NCCL_SUCCESS);
    let why = last();
    assert!(why.contains("ncclCommInitRank"), "{why}");
    let mut e = -1;
    let mut n = -1;
    for (h, code) in [(a, NCCL_INVALID_USAGE), (b, NCCL_INVALID_ARGUMENT)] {
        assert_eq!(ncclCommCount(h, &mut n), NCCL_INVALID_USAGE);
        assert!(last().contains("creation failed in ncclGroupEnd"), "{}", last());
        ok(ncclCommGetAsyncError(h, &mut e));
        assert_eq!(e, code, "the creation's own code: {}", last());
    }
    assert_eq!(ncclCommCount(a, &mut n), NCCL_INVALID_USAGE);
    assert!(last().contains("another creation of its group failed"), "{}", last());
    ok(ncclCommDestroy(a));
    ok(ncclCommAbort(b));
    assert_eq!(ncclCommDestroy(a), NCCL_INVALID_USAGE);
    assert_eq!(ncclCommAbort(b), NCCL_INVALID_USAGE);
}

/// AllReduce (sum of `rank + i`) on `c` of `n` ranks, from this thread, checked.
fn all_reduce_checks(c: ncclComm_t, n: usize) {
    const K: usize = 333;
    let (mut rank, mut size) = (-1, -1);
    ok(ncclCommUserRank(c, &mut rank));
    ok(ncclCommCount(c, &mut size));
    assert_eq!(size as usize, n);
    let (mut s, mut out) = (Buf::new(K), Buf::new(K));
    s.f32s().iter_mut().enumerate().for_each(|(i, v)| *v = (rank as usize + i) as f32);
    ok(ncclAllReduce(s.0, out.0, K, 7, 0, c, null_mut()));
    ok(ncclCommFinalize(c));
    let base = (n * (n - 1) / 2) as f32;
    assert!(out.f32s().iter().enumerate().all(|(i, v)| *v == base + (n * i) as f32), "rank {rank} of {n}");
}

/// Rank `r` of three shrinks `c` without rank 1 (`flag`) and checks the new communicator.
fn shrink_out_rank_1(c: ncclComm_t, r: usize, flag: c_int) {
    let mut ex = [1 as c_int];
    let mut sub = null_mut();
    ok(ncclCommShrink(c, ex.as_mut_ptr(), 1, &mut sub, null_mut(), flag));
    let mut me = -1;
    ok(ncclCommUserRank(sub, &mut me));
    assert_eq!(me, r as c_int / 2, "survivors renumbered in order");
    all_reduce_checks(sub, 2);
    ok(ncclCommDestroy(sub));
}

/// A one-rank communicator through a unique id, on the host backend.
fn one_rank() -> ncclComm_t {
    std::env::set_var("HOCCL_BACKEND", "host");
    let mut uid = UniqueId { internal: [0; 128] };
    ok(ncclGetUniqueId(&mut uid));
    let mut c = null_mut();
    ok(ncclCommInitRank(&mut c, 1, uid, 0));
    c
}

/// Three ranks; rank 1 (alive) is excluded and takes no part. Rank 0 shrinks with
/// NCCL_SHRINK_DEFAULT (its parent stays usable), rank 2 with NCCL_SHRINK_ABORT (its parent
/// is aborted: every call but destroy fails).
#[test]
fn shrink_excludes_a_rank_that_does_not_call() {
    let comms = init_all(3);
    let threads: Vec<_> = comms
        .iter()
        .enumerate()
        .map(|(r, &c)| {
            std::thread::spawn(move || {
                let c = c as ncclComm_t;
                if r != 1 {
                    let flag = if r == 0 { NCCL_SHRINK_DEFAULT } else { NCCL_SHRINK_ABORT };
                    shrink_out_rank_1(c, r, flag);
                    if flag == NCCL_SHRINK_ABORT {
                        let b = Buf::new(4);
                        assert_ne!(ncclAllReduce(b.0, b.0, 4, 7, 0, c, null_mut()), NCCL_SUCCESS, "the aborted parent refuses operations");
                        assert!(last().contains("abort"), "{}", last());
                    }
                }
                ok(ncclCommDestroy(c));
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// One thread shrinks two ranks of this process inside one group: the creations run together
/// at the group's end, as NCCL's; the new ranks then all-reduce from the same thread.
#[test]
fn shrink_inside_a_group_from_one_thread() {
    let comms: Vec<ncclComm_t> = init_all(3).into_iter().map(|c| c as ncclComm_t).collect();
    let mut subs = [null_mut(); 2];
    let mut ex = [1 as c_int];
    ok(ncclGroupStart());
    for (s, &c) in subs.iter_mut().zip([comms[0], comms[2]].iter()) {
        ok(ncclCommShrink(c, ex.as_mut_ptr(), 1, s, null_mut(), NCCL_SHRINK_DEFAULT));
        assert!(!s.is_null(), "a deferred shrink returns its handle at once");
    }
    ok(ncclGroupEnd());
    const K: usize = 100;
    let mut bufs: Vec<(Buf, Buf)> = (0..2).map(|_| (Buf::new(K), Buf::new(K))).collect();
    ok(ncclGroupStart());
    for (r, (s, out)) in bufs.iter_mut().enumerate() {
        let mut me = -1;
        ok(ncclCommUserRank(subs[r], &mut me));
        assert_eq!(me, r as c_int);
        s.f32s().iter_mut().enumerate().for_each(|(i, v)| *v = (10 * r + i) as f32);
        ok(ncclAllReduce(s.0, out.0, K, 7, 0, subs[r], null_mut()));
    }
    ok(ncclGroupEnd());
    for (r, (_, out)) in bufs.iter_mut().enumerate() {
        ok(ncclCommFinalize(subs[r]));
        assert!(out.f32s().iter().enumerate().all(|(i, v)| *v == (10 + 2 * i) as f32), "rank {r}");
    }
    for c in subs.into_iter().chain(comms) {
        ok(ncclCommDestroy(c));
    }
}

#[test]
fn shrink_bad_arguments() {
    let c = one_rank();
    let mut sub = 1usize as ncclComm_t;
    let bad: [(&[c_int], c_int, c_int, &str); 5] = [
        (&[], 0, 2, "shrinkFlags"),
        (&[], 1, 0, "NULL"),
        (&[], -1, 0, "excludeRanksCount"),
        (&[3], 1, 0, "out of 1 ranks"),
        (&[0], 1, 0, "excludes itself"),
    ];
    for (list, count, flags, why) in bad {
        let mut l = list.to_vec();
        let p = if list.is_empty() { null_mut() } else { l.as_mut_ptr() };
        assert_eq!(ncclCommShrink(c, p, count, &mut sub, null_mut(), flags), NCCL_INVALID_ARGUMENT, "{why}");
        assert!(sub.is_null(), "a failed shrink leaves NULL");
        assert!(last().contains(why), "{why}: {}", last());
    }
    // Excluding nobody is a copy of the communicator.
    ok(ncclCommShrink(c, null_mut(), 0, &mut sub, null_mut(), NCCL_SHRINK_DEFAULT));
    all_reduce_checks(sub, 1);
    ok(ncclCommDestroy(sub));
    ok(ncclCommDestroy(c));
    assert_eq!(ncclCommShrink(c, null_mut(), 0, &mut sub, null_mut(), NCCL_SHRINK_DEFAULT), NCCL_INVALID_USAGE);
}

/// Whether stream 0 of `c`'s device drains within 10 s (a released stream does; the
/// synchronize runs on a thread of its own so that a stream left waiting fails the test
/// instead of hanging it).
fn stream_drains(c: ncclComm_t) -> bool {
    let comm = live("test", c).unwrap();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || drop(tx.send(comm.device().synchronize(StreamHandle(0)))));
    matches!(rx.recv_timeout(std::time::Duration::from_secs(10)), Ok(Ok(())))
}

/// Three ranks; rank 1 never calls its AllReduce, so ranks 0 and 2 have it pending when they
/// revoke: the operation fails and their streams are released, the communicator stays for
/// what NCCL allows after a revoke (shrink, destroy) and refuses the rest with NCCL's codes.
#[test]
fn revoke_releases_pending_operations_then_shrink() {
    on_each_rank(&init_all(3), |c| {
        let mut rank = -1;
        ok(ncclCommUserRank(c, &mut rank));
        let r = rank as usize;
        if r == 1 {
            return ok(ncclCommAbort(c));
        }
        let b = Buf::new(64);
        ok(ncclAllReduce(b.0, b.0, 64, 7, 0, c, null_mut()));
        assert!(live("test", c).unwrap().pending() > 0, "rank {r}: the AllReduce without rank 1 is not pending");
        ok(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT));
        assert!(stream_drains(c), "rank {r}: the revoked AllReduce still holds its stream");
        let mut e = -1;
        ok(ncclCommGetAsyncError(c, &mut e));
        assert_eq!(e, NCCL_SUCCESS, "rank {r}: a revoked communicator is quiescent");
        assert_eq!(ncclAllReduce(b.0, b.0, 64, 7, 0, c, null_mut()), NCCL_INVALID_USAGE);
        assert!(last().contains("revoked"), "{}", last());
        assert_eq!(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT), NCCL_INVALID_ARGUMENT);
        assert!(last().contains("already revoked"), "{}", last());
        assert_eq!(ncclCommFinalize(c), NCCL_INVALID_ARGUMENT);
        let mut size = -1;
        ok(ncclCommCount(c, &mut size));
        assert_eq!(size, 3, "queries still answer");
        shrink_out_rank_1(c, r, NCCL_SHRINK_DEFAULT);
        drop(b);
        ok(ncclCommDestroy(c));
    });
}

/// Both ranks revoke an idle communicator and split it: the split runs over the revoked
/// parent's bootstrap and the child works.
#[test]
fn revoke_then_split() {
    let comms = init_all(2);
    on_each_rank(&comms, |c| {
        let mut rank = -1;
        ok(ncclCommUserRank(c, &mut rank));
        ok(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT));
        let mut sub = null_mut();
        ok(ncclCommSplit(c, 0, 1 - rank, &mut sub, null_mut()));
        let mut me = -1;
        ok(ncclCommUserRank(sub, &mut me));
        assert_eq!(me, 1 - rank, "ordered by key");
        all_reduce_checks(sub, 2);
        ok(ncclCommDestroy(sub));
        ok(ncclCommAbort(c));
    });
}

/// NCCL's argument rules: NULL is accepted, a flag other than the default is
/// `ncclInvalidArgument`, so is a revoke after `ncclCommFinalize`; a destroyed handle is
/// `ncclInvalidUsage`.
#[test]
fn revoke_arguments() {
    let c = one_rank();
    ok(ncclCommRevoke(null_mut(), NCCL_REVOKE_DEFAULT));
    assert_eq!(ncclCommRevoke(c, 1), NCCL_INVALID_ARGUMENT);
    assert!(last().contains("revokeFlags"), "{}", last());
    all_reduce_checks(c, 1);
    assert_eq!(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT), NCCL_INVALID_ARGUMENT, "after ncclCommFinalize");
    assert!(last().contains("finalized"), "{}", last());
    ok(ncclCommDestroy(c));
    assert_eq!(ncclCommRevoke(c, NCCL_REVOKE_DEFAULT), NCCL_INVALID_USAGE);
}

/// The rank of `shrink_after_a_process_is_killed` that is killed.
const KILLED: usize = 2;

/// A rank process of `shrink_after_a_process_is_killed` (`HOCCL_NCCL_SHRINK_CHILD` =
/// `<hex id> <rank>`): all-reduces until one fails (rank KILLED stops after its second and
/// waits for its SIGKILL), then shrinks without rank KILLED (NCCL_SHRINK_ABORT) and
/// all-reduces on the survivors.
#[test]
fn shrink_child() {
    let Ok(v) = std::env::var("HOCCL_NCCL_SHRINK_CHILD") else { return };
    let w: Vec<&str> = v.split_whitespace().collect();
    let uid = UniqueId::from_hex(w[0]).expect("id");
    let rank: usize = w[1].parse().expect("rank");
    let say = |what: &str| {
        use std::io::Write;
        let mut o = std::io::stdout().lock();
        let _ = writeln!(o, "NCCLSHRINK {rank} {what}");
        let _ = o.flush();
    };
    let mut c = null_mut();
    ok(ncclCommInitRank(&mut c, 3, uid, rank as c_int));
    const K: usize = 50_000;
    let (s, out) = (Buf::new(K), Buf::new(K));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(15);
    let mut done = 0;
    let failed = loop {
        assert!(std::time::Instant::now() < deadline, "rank {rank}: no failure after {done} all-reduces");
        let r = match ncclAllReduce(s.0, out.0, K, 7, 0, c, null_mut()) {
            NCCL_SUCCESS => ncclCommFinalize(c),
            e => e,
        };
        if r != NCCL_SUCCESS {
            break r;
        }
        done += 1;
        if rank == KILLED && done == 2 {
            say("kill-me");
            std::thread::sleep(std::time::Duration::from_secs(600));
        }
    };
    assert_ne!(rank, KILLED, "the victim failed before its kill: {}", last());
    let mut e = NCCL_SUCCESS;
    ok(ncclCommGetAsyncError(c, &mut e));
    assert_ne!(e, NCCL_SUCCESS, "the failure is the communicator's asynchronous error");
    say(&format!("failed with {failed} after {done} all-reduces: {}", last()));
    let mut sub = null_mut();
    let mut ex = [KILLED as c_int];
    ok(ncclCommShrink(c, ex.as_mut_ptr(), 1, &mut sub, null_mut(), NCCL_SHRINK_ABORT));
    all_reduce_checks(sub, 2);
    ok(ncclCommDestroy(sub));
    ok(ncclCommAbort(c));
    drop((s, out));
    say("done");
}

/// Three processes through a unique id; rank KILLED is SIGKILLed between all-reduces; the
/// survivors see the error, shrink without it through ncclCommShrink, all-reduce and exit 0.
#[test]
fn shrink_after_a_process_is_killed() {
    use std::io::BufRead;
    let mut uid = UniqueId { internal: [0; 128] };
    std::env::set_var("HOCCL_BACKEND", "host");
    ok(ncclGetUniqueId(&mut uid));
    let exe = std::env::current_exe().expect("test binary");
    let (tx, rx) = std::sync::mpsc::channel();
    let mut kids: Vec<std::process::Child> = (0..3)
        .map(|r| {
            let mut k = std::process::Command::new(&exe)
                .args(["--exact", "api_tests::shrink_child", "--nocapture", "--test-threads=1"])
                .env("HOCCL_NCCL_SHRINK_CHILD", format!("{} {r}", uid.to_hex()))
                .env("HOCCL_TIMEOUT_MS", "2000")
                .env("HOCCL_BACKEND", "host")
                .stdout(std::process::Stdio::piped())
                .spawn()
                .expect("spawn a rank");
            let lines = std::io::BufReader::new(k.stdout.take().unwrap()).lines();
            let tx = tx.clone();
            std::thread::spawn(move || lines.map_while(|l| l.ok()).for_each(|l| drop(tx.send((r, l)))));
            k
        })
        .collect();
    drop(tx);
    let mut killed = false;
    let mut finished = 0;
    while let Ok((r, l)) = rx.recv_timeout(std::time::Duration::from_secs(20)) {
        eprintln!("rank {r}: {l}");
        if l.contains("NCCLSHRINK") && l.ends_with("kill-me") && !killed {
            kids[KILLED].kill().expect("SIGKILL");
            killed = true;
        }
        finished += usize::from(l.contains("NCCLSHRINK") && l.ends_with(" done"));
        if finished == 2 {
            break;
        }
    }
    // A survivor that did not finish is killed too, so that a hang fails the test.
    for (r, k) in kids.iter_mut().enumerate() {
        if r == KILLED || finished < 2 {
            let _ = k.kill();
        }
    }
    let status: Vec<_> = kids.iter_mut().map(|k| k.wait().expect("wait")).collect();
    assert!(killed, "rank {KILLED} never reached its kill point");
    assert_eq!(finished, 2, "survivors finished: {status:?}");
    assert!(status.iter().enumerate().all(|(r, s)| r == KILLED || s.success()), "{status:?}");
}

/// Run `f` on every rank of `comms`, one thread each, and join them.
fn on_each_rank(comms: &[usize], f: fn(ncclComm_t)) {
    let ts: Vec<_> = comms.iter().map(|&c| std::thread::spawn(move || f(c as ncclComm_t))).collect();
    ts.into_iter().for_each(|t| t.join().unwrap());
}

/// Collectives captured through the NCCL ABI into a graph and replayed: the host backend
/// emulates capture on each rank's stream 0 (the application's side, which on CUDA is
/// `cudaStreamBeginCapture`), the calls are the exported functions, and every replay's
/// AllReduce and AllGather results are checked after new inputs were written.
#[test]
fn collectives_captured_through_the_abi_replay() {
    let comms = init_all(2);
    on_each_rank(&comms, |c| {
        const K: usize = 777;
        // The rank's device, to capture on (the application's CUDA runtime calls).
        let dev = comm::lookup("t", c).unwrap().handle("t").unwrap().get("t").unwrap().device().clone();
        let mut rank = -1;
        ok(ncclCommUserRank(c, &mut rank));
        let rank = rank as usize;
        let s0 = StreamHandle(0);
        let (mut s, mut sum, mut all) = (Buf::new(K), Buf::new(K), Buf::new(2 * K));
        dev.begin_capture(s0).unwrap();
        let captured = [ncclAllReduce(s.0, sum.0, K, 7, 0, c, null_mut()), ncclAllGather(s.0, all.0, K, 7, c, null_mut())];
        let g = dev.end_capture(s0).unwrap();
        captured.into_iter().for_each(ok);
        for k in 0..4 {
            let x = |r: usize, i: usize| (r * 10 + i + k * 3) as f32;
            s.f32s().iter_mut().enumerate().for_each(|(i, v)| *v = x(rank, i));
            sum.f32s().fill(-1.0);
            all.f32s().fill(-1.0);
            dev.graph_launch(g, s0).unwrap();
            dev.synchronize(s0).unwrap();
            assert!(sum.f32s().iter().enumerate().all(|(i, v)| *v == x(0, i) + x(1, i)), "rank {rank} replay {k}: all_reduce");
            assert!(all.f32s().iter().enumerate().all(|(i, v)| *v == x(i / K, i % K)), "rank {rank} replay {k}: all_gather");
        }
        dev.graph_destroy(g).unwrap();
        ok(ncclCommFinalize(c));
    });
    for c in comms {
        ok(ncclCommDestroy(c as ncclComm_t));
    }
}
