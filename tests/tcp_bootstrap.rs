//! The TCP bootstrap (`hoccl::bootstrap::tcp`): ranks as threads and as separate processes
//! (this test binary re-run with `HOCCL_TCP_CHILD` set), refusals by the root, timeouts,
//! a peer that leaves, and a host-backend communicator made from a unique id.
mod common;
use common::*;
use hoccl::bootstrap::tcp::{TcpBootstrap, UniqueId};
use hoccl::{Bootstrap, Communicator, DataType, ErrorCode, RedOp};
use std::time::{Duration, Instant};

const TMO: Duration = Duration::from_secs(20);
const BIG: usize = (1 << 20) + 12345;

/// Record size for (round, rank): 0, small, or over 1 MiB; every rank computes all of them.
fn rec_len(seed: u64, round: u64, rank: usize) -> usize {
    let mut r = Rng(seed ^ (round << 20) ^ (rank as u64) << 8);
    match r.below(4) {
        0 => 0,
        1 => BIG,
        _ => r.below(5000) as usize,
    }
}

fn fill(len: usize, a: u64, b: u64) -> Vec<u8> {
    (0..len).map(|i| (i as u64).wrapping_mul(31).wrapping_add(a * 7 + b * 13) as u8).collect()
}

/// All-gathers, barriers and point-to-point with tags sent in one order and received in
/// another; panics on any mismatch.
fn exercise(b: &TcpBootstrap, seed: u64) {
    let (me, n) = (b.rank(), b.size());
    for round in 0..4u64 {
        let mine = fill(rec_len(seed, round, me), me as u64, round);
        let got = b.all_gather(&mine).expect("all_gather");
        assert_eq!(got.len(), n);
        for (p, rec) in got.iter().enumerate() {
            assert_eq!(rec, &fill(rec_len(seed, round, p), p as u64, round), "round {round} record of rank {p}");
        }
        b.barrier().expect("barrier");
    }
    let len = |from: usize, to: usize, tag: u32| match tag {
        1 => 0,
        2 if (from + to) % 2 == 0 => BIG,
        _ => 100 * from + to + tag as usize,
    };
    for to in 0..n {
        for tag in [3u32, 1, 2] {
            b.send(to, tag, &fill(len(me, to, tag), (me * 10 + to) as u64, tag as u64)).expect("send");
        }
    }
    for from in (0..n).rev() {
        for tag in [1u32, 2, 3] {
            let got = b.recv(from, tag).expect("recv");
            assert_eq!(got, fill(len(from, me, tag), (from * 10 + me) as u64, tag as u64), "from {from} tag {tag}");
        }
    }
    b.barrier().expect("final barrier");
}

#[test]
fn threads_one_to_five_ranks() {
    logs::capture();
    for n in 1..=5usize {
        let id = UniqueId::new().expect("unique id");
        let hs: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || {
                    let b = TcpBootstrap::init(&id, n, r, TMO).expect("init");
                    exercise(&b, 40 + n as u64);
                })
            })
            .collect();
        for h in hs {
            h.join().expect("rank thread");
        }
    }
}

/// The child side of `processes_one_to_five_ranks`: does nothing unless `HOCCL_TCP_CHILD`
/// (`<hex id> <nranks> <rank>`) is set.
#[test]
fn child_rank() {
    let Ok(v) = std::env::var("HOCCL_TCP_CHILD") else { return };
    let mut it = v.split_whitespace();
    let id = UniqueId::from_hex(it.next().expect("id")).expect("id parses");
    let n: usize = it.next().expect("n").parse().expect("n");
    let r: usize = it.next().expect("rank").parse().expect("rank");
    let b = TcpBootstrap::init(&id, n, r, TMO).expect("init");
    exercise(&b, 70 + n as u64);
}

#[test]
fn processes_one_to_five_ranks() {
    logs::capture();
    let exe = std::env::current_exe().expect("test binary");
    for n in 1..=5usize {
        // The root lives in this process; every rank is a child process.
        let id = UniqueId::new().expect("unique id");
        let kids: Vec<_> = (0..n)
            .map(|r| {
                std::process::Command::new(&exe)
                    .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                    .env("HOCCL_TCP_CHILD", format!("{} {n} {r}", id.to_hex()))
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .expect("spawn child rank")
            })
            .collect();
        for (r, k) in kids.into_iter().enumerate() {
            let out = k.wait_with_output().expect("child");
            assert!(
                out.status.success(),
                "n={n} rank {r}: {}\n{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
    }
}

#[test]
fn root_refuses_bad_joins() {
    logs::capture();
    let id = UniqueId::new().expect("unique id");
    let mut bad = id;
    bad.internal[30] ^= 0x5a;
    let e = TcpBootstrap::init(&bad, 2, 0, TMO).err().expect("wrong secret refused");
    assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
    assert!(e.to_string().contains("wrong secret"), "{e}");
    logs::expect_logged(log::Level::Warn, "wrong secret");

    // A good rank 0 fixes nranks = 2; then a rank out of range (caught before joining), a
    // duplicate and a mismatched nranks are refused, and rank 1 still completes the rendezvous.
    let r0 = std::thread::spawn(move || TcpBootstrap::init(&id, 2, 0, TMO).map(|b| b.barrier()));
    std::thread::sleep(Duration::from_millis(300));
    let e = TcpBootstrap::init(&id, 2, 7, TMO).err().expect("rank out of range");
    assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
    for (n, r, why) in [(2, 0, "duplicate rank 0"), (3, 1, "says nranks 3")] {
        let e = TcpBootstrap::init(&id, n, r, TMO).err().unwrap_or_else(|| panic!("{why}: accepted"));
        assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
        assert!(e.to_string().contains(why), "{why}: {e}");
        logs::expect_logged(log::Level::Warn, why);
    }
    let b1 = TcpBootstrap::init(&id, 2, 1, TMO).expect("rank 1 joins");
    b1.barrier().expect("barrier");
    r0.join().expect("rank 0").expect("rank 0 init").expect("rank 0 barrier");
}

#[test]
fn missing_rank_times_out() {
    logs::capture();
    let tmo = Duration::from_secs(2);
    let id = UniqueId::new().expect("unique id");
    let hs: Vec<_> = (0..2)
        .map(|r| {
            std::thread::spawn(move || {
                let t = Instant::now();
                let e = TcpBootstrap::init(&id, 3, r, tmo).err().expect("rank 2 never joins");
                (e, t.elapsed())
            })
        })
        .collect();
    for h in hs {
        let (e, took) = h.join().expect("rank");
        assert_eq!(e.code(), ErrorCode::Timeout, "{e}");
        assert!(took < tmo + Duration::from_secs(1), "took {took:?}");
    }
}

#[test]
fn peer_that_leaves_is_named() {
    logs::capture();
    let id = UniqueId::new().expect("unique id");
    let h = std::thread::spawn(move || {
        let b = TcpBootstrap::init(&id, 2, 1, TMO).expect("init 1");
        b.barrier().expect("barrier 1");
    });
    let b0 = TcpBootstrap::init(&id, 2, 0, TMO).expect("init 0");
    b0.barrier().expect("barrier 0");
    h.join().expect("rank 1");
    let t = Instant::now();
    let e = b0.recv(1, 9).err().expect("rank 1 is gone");
    assert_eq!(e.code(), ErrorCode::Remote, "{e}");
    assert!(e.to_string().contains("rank 1"), "{e}");
    assert!(t.elapsed() < Duration::from_secs(5));
}

#[test]
fn communicator_from_unique_id() {
    let n = 3;
    let cfg = test_config();
    let id = Communicator::unique_id(&cfg).expect("unique id");
    let hs: Vec<_> = (0..n)
        .map(|r| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let dev = open_device(Backend::Host, r);
                let c = Communicator::from_unique_id_on(&id, n, r, Some(dev.clone()), cfg).expect("communicator");
                assert_eq!((c.rank(), c.size()), (r, n));
                let s = new_stream(&dev);
                // AllGather of pattern blocks.
                let count = 10_000usize;
                let send = Buf::new(&dev, count, 0, 1);
                let recv = Buf::new(&dev, count * n, 0, 2);
                dev.fill_pattern_async(s, send.ptr, count, seed_of(1, r, 0)).unwrap();
                c.all_gather(send.ptr, recv.ptr, count, DataType::U8, s).unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                for p in 0..n {
                    assert_eq!(wrong(&got, recv.off + p * count, count, seed_of(1, p, 0)), 0, "all_gather block {p}");
                }
                // AllReduce (sum) of i32 values rank*1000 + i.
                let m = 5000usize;
                let vals: Vec<u8> = (0..m).flat_map(|i| ((r * 1000 + i) as i32).to_ne_bytes()).collect();
                let a = Buf::new(&dev, m * 4, 0, 3);
                let out = Buf::new(&dev, m * 4, 0, 4);
                dev.copy_from_host(a.ptr, &vals).unwrap();
                c.all_reduce(a.ptr, out.ptr, m, DataType::I32, RedOp::Sum, s).unwrap();
                sync(&dev, s);
                let got = out.read_all();
                let base: i32 = (0..n as i32).map(|q| q * 1000).sum();
                for i in 0..m {
                    let at = out.off + 4 * i;
                    let v = i32::from_ne_bytes(got[at..at + 4].try_into().unwrap());
                    assert_eq!(v, base + (n * i) as i32, "all_reduce element {i}");
                }
                c.wait_idle().unwrap();
                c.bootstrap().barrier().unwrap();
            })
        })
        .collect();
    for h in hs {
        h.join().expect("rank");
    }
    free_deferred();
}

#[test]
fn socket_ifname_picks_the_root_interface() {
    logs::capture();
    let id = UniqueId::with_ifname(Some("=lo")).expect("loopback id");
    let a = id.root_addr().expect("root address");
    assert!(a.ip().is_loopback(), "{a}");
    assert_eq!(UniqueId::from_hex(&id.to_hex()).expect("hex"), id);
    let b = TcpBootstrap::init(&id, 1, 0, TMO).expect("single rank over loopback");
    assert_eq!(b.all_gather(b"x").expect("all_gather"), vec![b"x".to_vec()]);
    let e = UniqueId::with_ifname(Some("=no-such-if0")).err().expect("no such interface");
    assert_eq!(e.code(), ErrorCode::InvalidArgument, "{e}");
    assert!(e.to_string().contains("HOCCL_SOCKET_IFNAME"), "{e}");
}

#[test]
fn silent_and_garbage_clients_delay_nobody() {
    logs::capture();
    let id = UniqueId::new().expect("unique id");
    let root = id.root_addr().expect("root address");
    // One connects and says nothing; one claims a 2 GiB join request.
    let _silent = std::net::TcpStream::connect(root).expect("connect");
    let mut liar = std::net::TcpStream::connect(root).expect("connect");
    let mut h = [0u8; 13];
    h[5..13].copy_from_slice(&(2u64 << 30).to_be_bytes());
    std::io::Write::write_all(&mut liar, &h).expect("write");
    let t = Instant::now();
    let r1 = std::thread::spawn(move || TcpBootstrap::init(&id, 2, 1, TMO).and_then(|b| b.barrier()));
    let b0 = TcpBootstrap::init(&id, 2, 0, TMO).expect("rank 0");
    b0.barrier().expect("barrier");
    r1.join().expect("rank 1").expect("rank 1 init and barrier");
    assert!(t.elapsed() < Duration::from_secs(3), "took {:?}", t.elapsed());
    logs::expect_logged(log::Level::Warn, "no join request (frame of 2147483648 bytes)");
}
