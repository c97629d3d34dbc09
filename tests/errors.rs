//! Bad input is a clear error, never UB or a hang: synchronous argument errors, peers that
//! disagree, a peer that aborts, a peer that never calls (timeout), use after abort.
mod common;
use common::*;
use hoccl::device::DevPtr;
use hoccl::{Config, DataType, ErrorCode};
use log::Level;
use std::time::{Duration, Instant};

fn bad_arguments(b: Backend) {
    run_ranks(b, 2, test_config(), |c| {
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let buf = Buf::new(&dev, 1000, 0, 1);
        let code = |r: hoccl::Result<()>| r.unwrap_err().code();
        assert_eq!(code(c.all_gather(DevPtr::NULL, buf.ptr, 10, DataType::U8, s)), ErrorCode::InvalidArgument, "null");
        assert_eq!(code(c.all_gather(buf.ptr, buf.ptr.add(500), 300, DataType::U8, s)), ErrorCode::InvalidArgument, "too short");
        assert_eq!(code(c.send(buf.ptr, 10, DataType::U8, 7, s)), ErrorCode::InvalidArgument, "bad peer");
        assert_eq!(code(c.broadcast(buf.ptr, buf.ptr, 10, DataType::U8, 2, s)), ErrorCode::InvalidArgument, "bad root");
        assert_eq!(code(c.all_gather(buf.ptr, buf.ptr, usize::MAX / 2, DataType::F32, s)), ErrorCode::InvalidArgument, "overflow");
        assert_eq!(code(c.all_to_all(buf.ptr, buf.ptr.add(8), 100, DataType::U8, s)), ErrorCode::InvalidArgument, "in-place alltoall");
        assert_eq!(code(c.send(DevPtr(0x1234), 10, DataType::U8, 1, s)), ErrorCode::InvalidArgument, "not device memory");
        assert_eq!(DataType::from_raw("x", 42).unwrap_err().code(), ErrorCode::InvalidArgument, "unknown dtype");
        assert_eq!(code(c.group_end()), ErrorCode::InvalidUsage, "group_end without start");
        // None of that disturbed the communicator: a real call still works.
        c.all_gather(buf.ptr.add(c.rank() * 100), buf.ptr, 100, DataType::U8, s).unwrap();
        dev.synchronize(s).unwrap();
        assert!(c.async_error().is_none());
    });
}

/// Ranks disagreeing on the count: both fail with InvalidUsage, streams are released.
fn mismatched_counts(b: Backend) {
    run_ranks(b, 2, test_config(), |c| {
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let buf = Buf::new(&dev, 4000, 0, 1);
        let count = if c.rank() == 0 { 100 } else { 120 };
        c.all_gather(buf.ptr.add(c.rank() * count), buf.ptr, count, DataType::U8, s).unwrap();
        dev.synchronize(s).unwrap(); // must not hang
        let e = c.async_error().expect("mismatch detected");
        assert!(matches!(e.code(), ErrorCode::InvalidUsage | ErrorCode::Remote), "{e}");
        // Sticky: later calls fail at once.
        assert!(c.all_gather(buf.ptr, buf.ptr, 1, DataType::U8, s).is_err());
    });
    logs::expect_logged(Level::Error, "counts differ between ranks");
}

/// A peer aborts instead of calling: the others fail with Remote quickly, no hang.
fn peer_aborts(b: Backend) {
    let cfg = Config { timeout: Duration::from_secs(30), ..test_config() };
    run_ranks(b, 3, cfg, |c| {
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let buf = Buf::new(&dev, 3000, 0, 1);
        if c.rank() == 2 {
            std::thread::sleep(Duration::from_millis(100));
            c.abort();
            assert_eq!(c.all_gather(buf.ptr.add(2000), buf.ptr, 1000, DataType::U8, s).unwrap_err().code(), ErrorCode::Aborted);
            return;
        }
        let t = Instant::now();
        c.all_gather(buf.ptr.add(c.rank() * 1000), buf.ptr, 1000, DataType::U8, s).unwrap();
        dev.synchronize(s).unwrap();
        assert!(t.elapsed() < Duration::from_secs(10), "failure must be prompt, not the 30 s timeout");
        let e = c.async_error().expect("peer abort detected");
        assert_eq!(e.code(), ErrorCode::Remote, "{e}");
    });
    logs::expect_logged(Level::Error, "peer rank 2: its communicator was aborted or destroyed");
}

/// A peer that never calls: Timeout after the configured time, stream released.
fn peer_never_calls(b: Backend) {
    let cfg = Config { timeout: Duration::from_millis(700), ..test_config() };
    run_ranks(b, 2, cfg, |c| {
        let dev = c.device().clone();
        let s = new_stream(&dev);
        let buf = Buf::new(&dev, 100, 0, 1);
        if c.rank() == 0 {
            c.send(buf.ptr, 100, DataType::U8, 1, s).unwrap();
            dev.synchronize(s).unwrap();
            let e = c.async_error().expect("timeout");
            assert_eq!(e.code(), ErrorCode::Timeout, "{e}");
            assert!(e.to_string().contains("rank 1"), "names the peer: {e}");
        } else {
            std::thread::sleep(Duration::from_millis(1500));
        }
    });
    logs::expect_logged(Level::Error, "timed out after 700ms");
}

/// More streams with collectives pending than `max_waiting_streams`: a call on one more
/// stream waits until one of them is released (instead of holding another of the GPU's
/// hardware queues), a call on a stream that already waits does not, and every result is
/// right. Thread ranks on one GPU share one CUDA context and so one limit (rank 1's stream
/// counts against rank 0's): there the limit leaves room for it and the wait is not asserted.
fn waiting_streams_limit(b: Backend) {
    let shared = b == Backend::Cuda && hoccl::device::cuda::probe().map_or(true, |p| p.count < 2);
    let cfg = Config { max_waiting_streams: Some(if shared { 4 } else { 2 }), ..test_config() };
    run_ranks(b, 2, cfg, move |c| {
        let dev = c.device().clone();
        let (n, me) = (500usize, c.rank());
        let streams: Vec<_> = (0..3).map(|_| new_stream(&dev)).collect();
        let bufs: Vec<Buf> = (0..4).map(|i| Buf::new(&dev, 2 * n, 0, 90 + i as u64)).collect();
        for (i, buf) in bufs.iter().enumerate() {
            let mine: Vec<u8> = (0..n as u64).map(|j| hoccl::device::pattern_byte(seed_of(9, me, i), j)).collect();
            dev.copy_from_host(buf.ptr.add(me * n), &mine).unwrap();
        }
        c.bootstrap().barrier().unwrap();
        let on = [0, 1, 0, 2]; // rank 0's stream for op i
        let gather = |i: usize, s| c.all_gather(bufs[i].ptr.add(me * n), bufs[i].ptr, n, DataType::U8, s).unwrap();
        if me == 0 {
            let t = Instant::now();
            (0..3).for_each(|i| gather(i, streams[on[i]]));
            assert!(t.elapsed() < Duration::from_millis(400), "two waiting streams are within the limit");
            let t = Instant::now();
            gather(3, streams[on[3]]);
            if !shared {
                assert!(t.elapsed() >= Duration::from_millis(250), "a third waiting stream must wait for rank 1's first call");
            }
        } else {
            std::thread::sleep(Duration::from_millis(500));
            (0..4).for_each(|i| gather(i, streams[0]));
        }
        quiesce(c);
        for (i, buf) in bufs.iter().enumerate() {
            let got = buf.read_all();
            for r in 0..2 {
                assert_eq!(wrong(&got, r * n, n, seed_of(9, r, i)), 0, "op {i}, block of rank {r}");
            }
            assert_eq!(buf.guard_damage(&got), 0);
        }
        assert!(c.async_error().is_none());
    });
    if !shared {
        logs::expect_logged(Level::Warn, "2 streams already wait for collectives on this GPU");
    }
}

backend_tests!(bad_arguments, mismatched_counts, peer_aborts, peer_never_calls, waiting_streams_limit);
