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
                // A PreMulSum operator is created, refused by collectives, destroyed.
                let (mut op, scalar) = (0, 2.0f32);
                ok(ncclRedOpCreatePreMulSum(&mut op, &scalar as *const f32 as *mut c_void, 7, 1, c));
                assert!(op >= 5);
                assert_eq!(ncclAllReduce(s.0, out.0, N, 7, op, c, null_mut()), NCCL_INVALID_ARGUMENT);
                assert!(last().contains("ncclRedOpCreatePreMulSum"), "{}", last());
                ok(ncclRedOpDestroy(op, c));
                assert_eq!(ncclRedOpDestroy(op, c), NCCL_INVALID_ARGUMENT);
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
