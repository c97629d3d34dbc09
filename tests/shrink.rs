//! `Communicator::shrink` (host backend): survivors of an excluded rank, alive or killed,
//! form a new communicator without it and run every collective there, results checked
//! against values computed here; survivors that disagree on the exclude list end in an
//! error within the timeout. Ranks as threads (thread bootstrap) and as processes (TCP
//! bootstrap, this binary re-run with `HOCCL_SHRINK_CHILD` set, one of four SIGKILLed
//! while the others run all-reduces). The same bodies run on CUDA with `--ignored`.
mod common;
use common::*;
use hoccl::bootstrap::thread::ThreadBootstrap;
use hoccl::bootstrap::tcp::UniqueId;
use hoccl::{Communicator, Config, DataType, ErrorCode, RedOp};
use std::io::{BufRead, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Element `i` of rank `r`'s input (small, so i32 sums are exact).
fn val(r: usize, i: usize) -> i32 {
    ((r * 131 + i * 7) % 97) as i32
}

fn ints(r: usize, from: usize, n: usize) -> Vec<u8> {
    (from..from + n).flat_map(|i| val(r, i).to_le_bytes()).collect()
}

fn sums(ranks: usize, from: usize, n: usize) -> Vec<u8> {
    (from..from + n).flat_map(|i| (0..ranks).map(|r| val(r, i)).sum::<i32>().to_le_bytes()).collect()
}

/// A buffer of `n` i32 filled with rank `r`'s input from element `from`.
fn filled(c: &Communicator, r: usize, from: usize, n: usize) -> Buf {
    let b = Buf::new(c.device(), n * 4, 0, 1);
    c.device().copy_from_host(b.ptr, &ints(r, from, n)).unwrap();
    b
}

fn out(c: &Communicator, n: usize) -> Buf {
    Buf::new(c.device(), n * 4, 0, 2)
}

/// Every collective once on `c` (any size), each rank's output checked. Buffers are made
/// and filled first, and read after every rank is idle (`quiesce`): thread ranks on CUDA
/// share a context, where allocations and synchronous copies can wait for another rank's
/// stream.
fn every_collective(c: &Communicator) {
    let (r, n) = (c.rank(), c.size());
    let s = new_stream(c.device());
    let k = 1001; // elements per block
    let root = n - 1;
    let i32t = DataType::I32;
    let (to, from) = ((r + 1) % n, (r + n - 1) % n);
    // AllToAllV: rank p sends j + p + 1 elements to rank j, packed from element 0.
    let cnt = |p: usize, j: usize| j + p + 1;
    let displ = |v: Vec<usize>| v.iter().scan(0, |a, x| { let d = *a; *a += x; Some(d) }).collect::<Vec<_>>();
    let sc: Vec<usize> = (0..n).map(|j| cnt(r, j)).collect();
    let rc: Vec<usize> = (0..n).map(|p| cnt(p, r)).collect();
    let (sd, rd) = (displ(sc.clone()), displ(rc.clone()));
    let (st, rt) = (sc.iter().sum::<usize>(), rc.iter().sum::<usize>());
    let (one, many, v_in) = (filled(c, r, 0, k), filled(c, r, 0, n * k), filled(c, r, 0, st));
    let gathered: Vec<u8> = (0..n).flat_map(|p| ints(p, 0, k)).collect();
    // (name, output, elements, expected or None where this rank gets no output)
    let checks: Vec<(&str, Buf, usize, Option<Vec<u8>>)> = vec![
        ("send/recv", out(c, k), k, Some(ints(from, 0, k))),
        ("all_gather", out(c, n * k), n * k, Some(gathered.clone())),
        ("gather", out(c, n * k), n * k, (r == root).then_some(gathered)),
        ("all_to_all", out(c, n * k), n * k, Some((0..n).flat_map(|p| ints(p, r * k, k)).collect())),
        ("all_to_allv", out(c, rt), rt, Some((0..n).flat_map(|p| ints(p, displ((0..n).map(|j| cnt(p, j)).collect())[r], rc[p])).collect())),
        ("broadcast", out(c, k), k, Some(ints(root, 0, k))),
        ("scatter", out(c, k), k, Some(ints(root, r * k, k))),
        ("all_reduce", out(c, k), k, Some(sums(n, 0, k))),
        ("reduce", out(c, k), k, (r == root).then(|| sums(n, 0, k))),
        ("reduce_scatter", out(c, k), k, Some(sums(n, r * k, k))),
    ];
    quiesce(c);
    let o = |i: usize| checks[i].1.ptr;
    c.group(|c| {
        c.send(one.ptr, k, i32t, to, s)?;
        c.recv(o(0), k, i32t, from, s)
    })
    .unwrap();
    c.all_gather(one.ptr, o(1), k, i32t, s).unwrap();
    c.gather(one.ptr, o(2), k, i32t, root, s).unwrap();
    c.all_to_all(many.ptr, o(3), k, i32t, s).unwrap();
    c.all_to_allv(v_in.ptr, &sc, &sd, o(4), &rc, &rd, i32t, s).unwrap();
    c.broadcast(one.ptr, o(5), k, i32t, root, s).unwrap();
    c.scatter(many.ptr, o(6), k, i32t, root, s).unwrap();
    c.all_reduce(one.ptr, o(7), k, i32t, RedOp::Sum, s).unwrap();
    c.reduce(one.ptr, o(8), k, i32t, RedOp::Sum, root, s).unwrap();
    c.reduce_scatter(many.ptr, o(9), k, i32t, RedOp::Sum, s).unwrap();
    sync(c.device(), s);
    quiesce(c);
    for (op, b, len, want) in &checks {
        let all = b.read_all();
        if let Some(want) = want {
            assert!(all[..len * 4] == want[..], "{op} on rank {r} of {n}");
        }
        assert_eq!(b.guard_damage(&all), 0, "{op} on rank {r} of {n}: bytes written past the output");
    }
}

/// Four thread ranks; rank 1 (alive) is excluded, then the new rank 0 (parent rank 0) from
/// the shrunk communicator: every collective on each.
fn exclude_live_ranks_twice(b: Backend) {
    run_ranks(b, 4, test_config(), |c| {
        if c.rank() == 1 {
            return; // excluded: takes no part
        }
        let s1 = c.shrink(&[1], test_config()).expect("shrink");
        let parent_of = [0, 2, 3];
        assert_eq!((s1.size(), parent_of[s1.rank()]), (3, c.rank()));
        every_collective(&s1);
        if s1.rank() != 0 {
            let s2 = s1.shrink(&[0], test_config()).expect("second shrink");
            assert_eq!((s2.size(), s2.rank()), (2, s1.rank() - 1));
            every_collective(&s2);
        }
    });
}

#[test]
fn bad_exclude_lists_are_refused() {
    run_ranks(Backend::Host, 2, test_config(), |c| {
        for bad in [&[2usize][..], &[1 - c.rank(), 1 - c.rank()], &[c.rank()]] {
            let e = c.shrink(bad, test_config()).err().expect("refused");
            assert_eq!(e.code(), ErrorCode::InvalidArgument, "{bad:?}: {e}");
        }
    });
}

/// A one-rank thread bootstrap that reports no timeout, as an MPI bootstrap made without
/// one does.
struct Unbounded(ThreadBootstrap);

impl hoccl::bootstrap::Bootstrap for Unbounded {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn size(&self) -> usize {
        self.0.size()
    }
    fn all_gather(&self, mine: &[u8]) -> hoccl::Result<Vec<Vec<u8>>> {
        self.0.all_gather(mine)
    }
    fn barrier(&self) -> hoccl::Result<()> {
        self.0.barrier()
    }
    fn send(&self, peer: usize, tag: u32, data: &[u8]) -> hoccl::Result<()> {
        self.0.send(peer, tag, data)
    }
    fn recv(&self, peer: usize, tag: u32) -> hoccl::Result<Vec<u8>> {
        self.0.recv(peer, tag)
    }
}

#[test]
fn a_bootstrap_without_a_timeout_is_refused() {
    let boot = Unbounded(ThreadBootstrap::group(1).pop().unwrap());
    let c = Communicator::with_bootstrap(Box::new(boot), Some(open_device(Backend::Host, 0)), test_config()).expect("communicator");
    let e = c.shrink(&[], test_config()).err().expect("refused");
    assert_eq!(e.code(), ErrorCode::InvalidUsage, "{e}");
    assert!(e.to_string().contains("MpiBootstrap::with_timeout"), "{e}");
}

/// Rank 0 excludes rank 2, ranks 1 and 2 exclude nobody: rank 1 sees the difference in the
/// leader's message (`InvalidArgument`), ranks 0 and 2 wait in vain (`Timeout`); all within
/// the timeout (twice: the id's arrival, then the rendezvous) and a margin.
fn mismatched_exclude_lists_fail_within_the_timeout(b: Backend) {
    let tmo = Duration::from_millis(1500);
    let cfg = Config { timeout: tmo, ..test_config() };
    let t0 = Instant::now();
    let ranks: Vec<_> = ThreadBootstrap::group_with_timeout(3, tmo)
        .into_iter()
        .enumerate()
        .map(|(r, boot)| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let comm = Communicator::with_bootstrap(Box::new(boot), Some(open_device(b, r)), cfg.clone()).expect("communicator");
                let exclude: &[usize] = if r == 0 { &[2] } else { &[] };
                let t = Instant::now();
                let e = comm.shrink(exclude, cfg).err().expect("a mismatched shrink fails");
                (e.code(), t.elapsed(), e.to_string())
            })
        })
        .collect();
    let got: Vec<_> = ranks.into_iter().map(|h| h.join().expect("rank thread")).collect();
    for (r, (code, t, e)) in got.iter().enumerate() {
        eprintln!("rank {r}: {code:?} after {t:?}: {e}");
        assert!(*t < 2 * tmo + Duration::from_secs(1), "rank {r} took {t:?}");
    }
    assert_eq!(got[1].0, ErrorCode::InvalidArgument, "{}", got[1].2);
    assert!(got[1].2.contains("survivors differ"), "{}", got[1].2);
    assert_eq!((got[0].0, got[2].0), (ErrorCode::Timeout, ErrorCode::Timeout));
    assert!(t0.elapsed() < Duration::from_secs(10));
}

/// A failed attempt, then a retry by every rank: rank 2 passes a bad list (refused before
/// any message), so the id the leader sent it is never read and ranks 0 and 1 time out in
/// the rendezvous; the retry must not read that leftover id.
fn retry_after_a_failed_shrink(b: Backend) {
    let tmo = Duration::from_millis(1000);
    let cfg = Config { timeout: tmo, ..test_config() };
    run_ranks(b, 3, cfg.clone(), move |c| {
        let first: &[usize] = if c.rank() == 2 { &[7] } else { &[] };
        let e = c.shrink(first, cfg.clone()).err().expect("the first attempt fails");
        let want = if c.rank() == 2 { ErrorCode::InvalidArgument } else { ErrorCode::Timeout };
        assert_eq!(e.code(), want, "rank {}: {e}", c.rank());
        let s = c.shrink(&[], cfg.clone()).expect("the retry");
        assert_eq!((s.rank(), s.size()), (c.rank(), 3));
        every_collective(&s);
    });
}

// ---------------------------------------------------------------- processes --------------

const N: usize = 4;
const VICTIM: usize = 2;
const TMO_MS: u64 = 2000;

fn say(rank: usize, what: &str) {
    let mut o = std::io::stdout().lock();
    let _ = writeln!(o, "SHRINK {rank} {what}");
    let _ = o.flush();
}

/// A child rank: `HOCCL_SHRINK_CHILD` = `<hex id> <rank> <Host|Cuda>`. All-reduces until the victim is
/// killed (the victim reports its second one done, then waits); the survivors then abort
/// the parent, shrink without the victim and run every collective.
#[test]
fn child_rank() {
    let Ok(v) = std::env::var("HOCCL_SHRINK_CHILD") else { return };
    let w: Vec<&str> = v.split_whitespace().collect();
    let id = UniqueId::from_hex(w[0]).expect("id");
    let rank: usize = w[1].parse().unwrap();
    let backend = if w[2] == "Cuda" { Backend::Cuda } else { Backend::Host };
    let cfg = Config::from_env().expect("HOCCL_* settings");
    assert_eq!(cfg.timeout, Duration::from_millis(TMO_MS));
    let dev = open_device(backend, rank);
    let comm = Communicator::from_unique_id_on(&id, N, rank, Some(dev.clone()), cfg.clone()).expect("communicator");
    let k = 100_000;
    let (send, recv) = (filled(&comm, rank, 0, k), out(&comm, k));
    let s = new_stream(&dev);
    let deadline = Instant::now() + Duration::from_secs(15);
    let mut iter = 0;
    let err = loop {
        assert!(Instant::now() < deadline, "rank {rank}: no error after {iter} all-reduces");
        let r = comm.all_reduce(send.ptr, recv.ptr, k, DataType::I32, RedOp::Sum, s);
        dev.synchronize(s).expect("synchronize returns");
        match r.and_then(|_| comm.wait_idle()) {
            Ok(()) => iter += 1,
            Err(e) => break e,
        }
        if rank == VICTIM && iter == 2 {
            say(rank, "kill-me");
            loop {
                std::thread::sleep(Duration::from_secs(60));
            }
        }
    };
    assert!(matches!(err.code(), ErrorCode::Remote | ErrorCode::Timeout), "rank {rank}: {err}");
    say(rank, &format!("error {:?} after {iter} all-reduces", err.code()));
    comm.abort();
    let t = Instant::now();
    let small = comm.shrink(&[VICTIM], cfg).expect("shrink after the victim's death");
    say(rank, &format!("shrunk to rank {} of {} in {} ms", small.rank(), small.size(), t.elapsed().as_millis()));
    assert_eq!(small.size(), N - 1);
    assert_eq!(small.rank(), if rank < VICTIM { rank } else { rank - 1 });
    every_collective(&small);
    small.wait_idle().unwrap();
    drop(small);
    drop(comm);
    free_deferred();
    say(rank, "done");
}

fn survivors_of_a_killed_process_shrink_and_run_every_collective(b: Backend) {
    let id = Communicator::unique_id(&test_config()).expect("unique id");
    let exe = std::env::current_exe().expect("test binary");
    let (tx, rx) = std::sync::mpsc::channel::<(usize, String)>();
    let mut kids: Vec<_> = (0..N)
        .map(|r| {
            let mut k = Command::new(&exe)
                .args(["--exact", "child_rank", "--nocapture", "--test-threads=1"])
                .env("HOCCL_SHRINK_CHILD", format!("{} {r} {b:?}", id.to_hex()))
                .env("HOCCL_TIMEOUT_MS", TMO_MS.to_string())
                .env("HOCCL_BACKEND", if b == Backend::Cuda { "cuda" } else { "host" })
                .stdout(Stdio::piped())
                .spawn()
                .expect("spawn child rank");
            let o = k.stdout.take().unwrap();
            let tx = tx.clone();
            std::thread::spawn(move || {
                for l in std::io::BufReader::new(o).lines().map_while(|l| l.ok()) {
                    let _ = tx.send((r, l));
                }
            });
            k
        })
        .collect();
    drop(tx);
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut done = [false; N];
    let mut killed = None;
    while done.iter().enumerate().any(|(r, d)| r != VICTIM && !d) {
        let left = deadline.saturating_duration_since(Instant::now());
        let Ok((r, l)) = rx.recv_timeout(left) else { break };
        eprintln!("rank {r}: {l}");
        if l.contains(&format!("SHRINK {VICTIM} kill-me")) && killed.is_none() {
            kids[VICTIM].kill().expect("SIGKILL the victim");
            killed = Some(Instant::now());
        }
        if l.contains(&format!("SHRINK {r} done")) {
            done[r] = true;
        }
    }
    for (r, k) in kids.iter_mut().enumerate() {
        if r == VICTIM {
            let _ = k.kill();
            let _ = k.wait();
            continue;
        }
        let st = loop {
            if let Some(st) = k.try_wait().unwrap() {
                break Some(st);
            }
            if Instant::now() > deadline + Duration::from_secs(5) {
                let _ = k.kill();
                let _ = k.wait();
                break None;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        assert!(st.is_some_and(|s| s.success()), "rank {r}: exit {st:?}");
    }
    assert!(killed.is_some(), "the victim never reached its kill point");
    assert!(done.iter().enumerate().all(|(r, d)| r == VICTIM || *d), "survivors done: {done:?}");
}

backend_tests!(exclude_live_ranks_twice, retry_after_a_failed_shrink, mismatched_exclude_lists_fail_within_the_timeout, survivors_of_a_killed_process_shrink_and_run_every_collective);
