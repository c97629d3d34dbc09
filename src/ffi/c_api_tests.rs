//! The C ABI's argument checking and handle life cycle, in-process (threads as ranks, host
//! backend), and the header's enums against the Rust ones.
use super::*;
use crate::ffi::c_memory::*;
use crate::ffi::handle::tests::with_ranks;
use crate::types::DataType;
use std::ptr::{null, null_mut};

const OK: c_int = ErrorCode::Success as c_int;
const INVALID_ARG: c_int = ErrorCode::InvalidArgument as c_int;
const INVALID_USAGE: c_int = ErrorCode::InvalidUsage as c_int;
const ABORTED: c_int = ErrorCode::Aborted as c_int;
const U8: c_int = DataType::U8 as c_int;

fn last_error() -> String {
    // SAFETY: hocclGetLastError returns a NUL-terminated string valid until the next failure.
    unsafe { CStr::from_ptr(hocclGetLastError()) }.to_string_lossy().into_owned()
}

#[test]
fn null_pointers_are_invalid_arguments() {
    let mut v: c_int = 0;
    assert_eq!(hocclGetVersion(null_mut()), INVALID_ARG);
    assert_eq!(hocclGetVersion(&mut v), OK);
    assert_eq!(v, version_code());
    assert_eq!(hocclCommInitMpi(null_mut(), 0), INVALID_ARG);
    assert!(last_error().contains("hocclCommInitMpi") && last_error().contains("NULL"), "{}", last_error());
    assert_eq!(hocclCommCount(null_mut(), &mut v), INVALID_ARG);
    assert_eq!(hocclCommUserRank(null_mut(), &mut v), INVALID_ARG);
    assert_eq!(hocclCommDestroy(null_mut()), INVALID_ARG);
    assert_eq!(hocclCommAbort(null_mut()), INVALID_ARG);
    assert_eq!(hocclCommGetAsyncError(null_mut(), &mut v), INVALID_ARG);
    assert_eq!(hocclAllGather(null(), null_mut(), 1, U8, null_mut(), null_mut()), INVALID_ARG);
    assert_eq!(hocclSend(null(), 1, U8, 0, null_mut(), null_mut()), INVALID_ARG);
    assert_eq!(hocclBroadcast(null(), null_mut(), 1, U8, 0, null_mut(), null_mut()), INVALID_ARG);
    assert_eq!(hocclAllReduce(null(), null_mut(), 1, U8, 0, null_mut(), null_mut()), INVALID_ARG);
    assert_eq!(hocclReduceScatter(null(), null_mut(), 1, U8, 0, null_mut(), null_mut()), INVALID_ARG);
    assert_eq!(hocclReduce(null(), null_mut(), 1, U8, 0, 0, null_mut(), null_mut()), INVALID_ARG);
    let mut p = null_mut();
    assert_eq!(hocclMemAlloc(null_mut(), &mut p, 8), INVALID_ARG);
    assert_eq!(hocclStreamCreate(null_mut(), null_mut()), INVALID_ARG);
}

#[test]
fn unknown_handles_are_invalid_usage() {
    let fake = 0x1000 as hocclComm_t;
    let mut v: c_int = 0;
    assert_eq!(hocclCommCount(fake, &mut v), INVALID_USAGE);
    assert_eq!(hocclCommDestroy(fake), INVALID_USAGE);
    assert_eq!(hocclAllGather(null(), null_mut(), 1, U8, fake, null_mut()), INVALID_USAGE);
    assert!(last_error().contains("not a live communicator"), "{}", last_error());
}

#[test]
fn creation_without_mpi_fails_cleanly() {
    let mut comm = 1usize as hocclComm_t;
    let rc = hocclCommInitMpi(&mut comm, 0);
    assert_eq!(rc, INVALID_USAGE, "{}", last_error());
    assert!(comm.is_null(), "a failed creation leaves NULL");
}

#[test]
fn error_strings_cover_every_code() {
    for code in 0..=12 {
        // SAFETY: static NUL-terminated strings.
        let s = unsafe { CStr::from_ptr(hocclGetErrorString(code)) };
        assert!(!s.to_bytes().is_empty() && s.to_bytes() != b"unknown result code", "{code}");
    }
    // SAFETY: as above.
    assert_eq!(unsafe { CStr::from_ptr(hocclGetErrorString(99)) }.to_bytes(), b"unknown result code");
}

#[test]
fn group_end_without_start_is_invalid_usage() {
    assert_eq!(hocclGroupEnd(), INVALID_USAGE);
    assert_eq!(hocclGroupStart(), OK);
    assert_eq!(hocclGroupStart(), OK);
    assert_eq!(hocclGroupEnd(), OK);
    assert_eq!(hocclGroupEnd(), OK);
    assert_eq!(hocclGroupEnd(), INVALID_USAGE);
}

/// Two ranks through the C ABI only: bad arguments, a real AllGather, a group ring,
/// AlltoAllv, then abort and destroy.
#[test]
fn calls_through_the_c_abi() {
    with_ranks(2, |r, c| {
        let comm = register(c);
        let (mut n, mut me) = (0, 0);
        assert_eq!(hocclCommCount(comm, &mut n), OK);
        assert_eq!(hocclCommUserRank(comm, &mut me), OK);
        assert_eq!((n, me), (2, r as c_int));
        let (mut buf, mut s) = (null_mut(), null_mut());
        assert_eq!(hocclMemAlloc(comm, &mut buf, 256), OK);
        assert_eq!(hocclStreamCreate(comm, &mut s), OK);
        let mine: Vec<u8> = (0..128u32).map(|i| (i * 3 + r as u32 * 101) as u8).collect();
        let own = (buf as usize + r * 64) as *mut c_void;
        assert_eq!(hocclMemcpyToDevice(comm, own, mine.as_ptr().cast(), 64), OK);

        // Bad arguments: errors, and the communicator is still usable afterwards.
        assert_eq!(hocclAllGather(own, null_mut(), 64, U8, comm, s), INVALID_ARG);
        assert_eq!(hocclAllGather(own, buf, 64, 42, comm, s), INVALID_ARG);
        assert!(last_error().contains("data type"), "{}", last_error());
        assert_eq!(hocclBroadcast(buf, buf, 4, U8, -1, comm, s), INVALID_ARG);
        assert_eq!(hocclSend(buf, 4, U8, 2, comm, s), INVALID_ARG);
        assert_eq!(hocclAlltoAllv(buf, null(), null(), buf, null(), null(), U8, comm, s), INVALID_ARG);
        assert_eq!(hocclMemcpyToHost(comm, null_mut(), buf, 4), INVALID_ARG);

        assert_eq!(hocclAllGather(own, buf, 64, U8, comm, s), OK);
        assert_eq!(hocclStreamSynchronize(comm, s), OK);
        let mut got = vec![0u8; 128];
        assert_eq!(hocclMemcpyToHost(comm, got.as_mut_ptr().cast(), buf, 128), OK);
        for p in 0..2 {
            let want: Vec<u8> = (0..64u32).map(|i| (i * 3 + p * 101) as u8).collect();
            assert_eq!(&got[p as usize * 64..][..64], &want[..], "block of rank {p}");
        }

        // A ring exchange inside a thread-global group (a pair that would deadlock without it).
        let (send, recv) = (buf, (buf as usize + 128) as *mut c_void);
        let peer = (1 - r) as c_int;
        assert_eq!(hocclGroupStart(), OK);
        assert_eq!(hocclSend(send, 16, U8, peer, comm, s), OK);
        assert_eq!(hocclRecv(recv, 16, U8, peer, comm, s), OK);
        assert_eq!(hocclGroupEnd(), OK);
        assert_eq!(hocclStreamSynchronize(comm, s), OK);

        // AlltoAllv: rank 0 sends 3 elements to each peer, rank 1 sends 5, from displacement
        // 8 * peer; every rank receives them packed at 0 and 3. Sources are the gathered
        // buffer, identical on both ranks, so byte k of block q is ((8 * r + k) * 3).
        let sc = [[3usize, 3], [5, 5]][r];
        let (sd, rc, rd) = ([0usize, 8], [3usize, 5], [0usize, 3]);
        assert_eq!(hocclAlltoAllv(send, sc.as_ptr(), sd.as_ptr(), recv, rc.as_ptr(), rd.as_ptr(), U8, comm, s), OK);
        assert_eq!(hocclStreamSynchronize(comm, s), OK);
        let mut got = [0u8; 8];
        assert_eq!(hocclMemcpyToHost(comm, got.as_mut_ptr().cast(), recv, 8), OK);
        let want: Vec<u8> = (0..3).chain(0..5).map(|k| ((8 * r + k) * 3) as u8).collect();
        assert_eq!(&got[..], &want[..]);
        // Reductions: a bad operator or root is an error; then a real AllReduce, in place,
        // and a ReduceScatter and a Reduce out of place (u8 sums wrap).
        let red = (buf as usize + 192) as *mut c_void;
        assert_eq!(hocclAllReduce(send, send, 16, U8, 5, comm, s), INVALID_ARG);
        assert!(last_error().contains("reduction operator 5"), "{}", last_error());
        assert_eq!(hocclAllReduce(send, send, 16, U8, -1, comm, s), INVALID_ARG);
        assert_eq!(hocclReduceScatter(send, red, 8, U8, 7, comm, s), INVALID_ARG);
        assert_eq!(hocclReduce(send, red, 16, U8, 0, 2, comm, s), INVALID_ARG);
        assert_eq!(hocclReduce(send, red, 16, U8, 9, 0, comm, s), INVALID_ARG);
        assert_eq!(hocclAllReduce(own, own, 64, U8, 0, comm, s), OK);
        assert_eq!(hocclReduceScatter(buf, red, 32, U8, 2, comm, s), OK); // max
        assert_eq!(hocclReduce(buf, (red as usize + 32) as *mut c_void, 32, U8, 1, 1, comm, s), OK); // prod at rank 1
        assert_eq!(hocclStreamSynchronize(comm, s), OK);
        let mut all = vec![0u8; 256];
        assert_eq!(hocclMemcpyToHost(comm, all.as_mut_ptr().cast(), buf, 256), OK);
        let x = |p: u32, i: u32| (i * 3 + p * 101) as u8;
        let sum: Vec<u8> = (0..64u32).map(|i| x(0, i).wrapping_add(x(1, i))).collect();
        assert_eq!(&all[r * 64..][..64], &sum[..], "all_reduce in place");
        // The first 64 bytes, the ReduceScatter's and the Reduce's input: the sum on rank
        // 0, rank 0's gathered block on rank 1.
        let first = |p: usize, i: usize| if p == 0 { sum[i] } else { x(0, i as u32) };
        let max: Vec<u8> = (0..32).map(|i| first(0, r * 32 + i).max(first(1, r * 32 + i))).collect();
        assert_eq!(&all[192..224], &max[..], "reduce_scatter max");
        if r == 1 {
            let prod: Vec<u8> = (0..32).map(|i| first(0, i).wrapping_mul(first(1, i))).collect();
            assert_eq!(&all[224..256], &prod[..], "reduce prod at the root");
        }

        let mut v = 0;
        assert_eq!(hocclCommGetAsyncError(comm, &mut v), OK);
        assert_eq!(v, OK);

        if r == 0 {
            assert_eq!(hocclCommAbort(comm), OK);
            assert_eq!(hocclCommAbort(comm), OK);
            assert_eq!(hocclAllGather(own, buf, 64, U8, comm, s), ABORTED);
            assert_eq!(hocclCommCount(comm, &mut n), ABORTED);
        }
        assert_eq!(hocclCommDestroy(comm), OK);
        assert_eq!(hocclCommDestroy(comm), INVALID_USAGE);
        assert_eq!(hocclAllGather(own, buf, 64, U8, comm, s), INVALID_USAGE);
        assert_eq!(hocclMemFree(comm, buf), INVALID_USAGE);
    });
}

#[test]
fn unique_id_calls_check_their_arguments() {
    assert_eq!(hocclGetUniqueId(null_mut()), INVALID_ARG);
    assert!(last_error().contains("uniqueId is NULL"), "{}", last_error());
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(hocclGetUniqueId(&mut id), OK, "{}", last_error());
    assert_eq!(&id.internal[..4], b"HOCT");
    assert_eq!(hocclCommInitRank(null_mut(), 2, id, 0), INVALID_ARG);
    for (n, r) in [(0, 0), (2, 2), (2, -1), (-1, 0)] {
        let mut comm = 1usize as hocclComm_t;
        assert_eq!(hocclCommInitRank(&mut comm, n, id, r), INVALID_ARG, "rank {r} of {n}");
        assert!(comm.is_null(), "a refused creation leaves NULL");
    }
    let mut comm = null_mut();
    let zeros = UniqueId { internal: [0; 128] };
    assert_eq!(hocclCommInitRank(&mut comm, 1, zeros, 0), INVALID_ARG);
    assert!(last_error().contains("not a hoccl unique id"), "{}", last_error());
    // The id above is still unused: one rank of one completes its rendezvous.
    assert_eq!(hocclCommInitRank(&mut comm, 1, id, 0), OK, "{}", last_error());
    let mut n = 0;
    assert_eq!(hocclCommCount(comm, &mut n), OK);
    assert_eq!(n, 1);
    assert_eq!(hocclCommDestroy(comm), OK);
}

/// Two ranks (threads) from one unique id through the C ABI: rank 1 first presents a wrong
/// secret and is refused at once, then joins; an AllReduce checks the communicators work.
#[test]
fn communicators_from_a_unique_id() {
    let mut id = UniqueId { internal: [0; 128] };
    assert_eq!(hocclGetUniqueId(&mut id), OK, "{}", last_error());
    let hs: Vec<_> = (0..2usize)
        .map(|r| {
            std::thread::spawn(move || {
                let mut comm = null_mut();
                if r == 1 {
                    let mut bad = id;
                    bad.internal[24..40].iter_mut().for_each(|b| *b ^= 0xa5);
                    let t = std::time::Instant::now();
                    assert_eq!(hocclCommInitRank(&mut comm, 2, bad, 1), INVALID_ARG);
                    assert!(last_error().contains("wrong secret"), "{}", last_error());
                    assert!(t.elapsed() < std::time::Duration::from_secs(5), "refusal took {:?}", t.elapsed());
                    assert!(comm.is_null());
                }
                assert_eq!(hocclCommInitRank(&mut comm, 2, id, r as c_int), OK, "{}", last_error());
                let (mut n, mut me) = (0, 0);
                assert_eq!(hocclCommCount(comm, &mut n), OK);
                assert_eq!(hocclCommUserRank(comm, &mut me), OK);
                assert_eq!((n, me), (2, r as c_int));
                let (mut buf, mut s) = (null_mut(), null_mut());
                assert_eq!(hocclMemAlloc(comm, &mut buf, 4096), OK);
                assert_eq!(hocclStreamCreate(comm, &mut s), OK);
                let vals: Vec<i32> = (0..1024).map(|i| i * 3 - 700 + r as i32 * 1000).collect();
                assert_eq!(hocclMemcpyToDevice(comm, buf, vals.as_ptr().cast(), 4096), OK);
                assert_eq!(hocclAllReduce(buf, buf, 1024, DataType::I32 as c_int, 0, comm, s), OK);
                assert_eq!(hocclStreamSynchronize(comm, s), OK);
                let mut got = vec![0i32; 1024];
                assert_eq!(hocclMemcpyToHost(comm, got.as_mut_ptr().cast(), buf, 4096), OK);
                let want: Vec<i32> = (0..1024).map(|i| 2 * (i * 3 - 700) + 1000).collect();
                assert_eq!(got, want);
                assert_eq!(hocclMemFree(comm, buf), OK);
                assert_eq!(hocclStreamDestroy(comm, s), OK);
                assert_eq!(hocclCommDestroy(comm), OK);
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank");
    }
}

/// Pairs `name = value` of an enum in `include/hoccl/hoccl.h`.
fn header_enum(prefix: &str) -> Vec<(String, i32)> {
    let h = include_str!("../../include/hoccl/hoccl.h");
    let mut out = Vec::new();
    for l in h.lines() {
        let l = l.split("/*").next().unwrap_or("").trim().trim_end_matches(',');
        let Some((name, v)) = l.split_once('=') else { continue };
        let name = name.trim();
        if let (true, false, Ok(v)) = (name.starts_with(prefix), name.contains(' '), v.trim().parse()) {
            out.push((name.to_string(), v));
        }
    }
    out
}

#[test]
fn header_enums_match_the_rust_ones() {
    let results = header_enum("hoccl");
    let code = |n: &str| results.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
    use ErrorCode::*;
    for (name, c) in [
        ("hocclSuccess", Success),
        ("hocclCudaError", Cuda),
        ("hocclSystemError", System),
        ("hocclInternalError", Internal),
        ("hocclInvalidArgument", InvalidArgument),
        ("hocclInvalidUsage", InvalidUsage),
        ("hocclRemoteError", Remote),
        ("hocclInProgress", InProgress),
        ("hocclTimeout", Timeout),
        ("hocclCorruptData", CorruptData),
        ("hocclAborted", Aborted),
        ("hocclMpiError", Mpi),
        ("hocclNoDevice", NoDevice),
    ] {
        assert_eq!(code(name), Some(c as i32), "{name}");
    }
    for (name, d) in [
        ("hocclInt8", DataType::I8),
        ("hocclUint8", DataType::U8),
        ("hocclInt32", DataType::I32),
        ("hocclUint32", DataType::U32),
        ("hocclInt64", DataType::I64),
        ("hocclUint64", DataType::U64),
        ("hocclFloat16", DataType::F16),
        ("hocclFloat32", DataType::F32),
        ("hocclFloat64", DataType::F64),
        ("hocclBfloat16", DataType::BF16),
        ("hocclFloat8e4m3", DataType::F8E4M3),
        ("hocclFloat8e5m2", DataType::F8E5M2),
    ] {
        assert_eq!(code(name), Some(d as i32), "{name}");
    }
}

#[test]
fn header_red_ops_match_the_rust_ones() {
    let ops = header_enum("hoccl");
    let code = |n: &str| ops.iter().find(|(k, _)| k == n).map(|(_, v)| *v);
    use crate::reduce::RedOp;
    for (name, o) in [("hocclSum", RedOp::Sum), ("hocclProd", RedOp::Prod), ("hocclMax", RedOp::Max), ("hocclMin", RedOp::Min), ("hocclAvg", RedOp::Avg)] {
        assert_eq!(code(name), Some(o.raw()), "{name}");
    }
    assert_eq!(code("hocclNumOps"), Some(RedOp::ALL.len() as i32));
}

#[test]
fn header_version_macros_match_cargo() {
    let h = include_str!("../../include/hoccl/hoccl.h");
    let mac = |m: &str| {
        h.lines()
            .find_map(|l| l.strip_prefix(&format!("#define {m} ")))
            .and_then(|v| v.trim().parse::<c_int>().ok())
            .unwrap_or_else(|| panic!("{m} missing from hoccl.h"))
    };
    assert_eq!(mac("HOCCL_MAJOR") * 10000 + mac("HOCCL_MINOR") * 100 + mac("HOCCL_PATCH"), version_code());
}
