//! Correctness of every copy-engine collective against independently computed
//! expectations: random sizes (0, 1, odd), offsets, dtypes, roots and rank counts; in place
//! and out of place; guard bands checked. The same bodies run on the host backend here and
//! on CUDA with `--ignored` on a GPU machine.
mod common;
use common::*;

use hoccl::DataType;

const DTYPES: [DataType; 5] = [
    DataType::U8,
    DataType::BF16,
    DataType::F32,
    DataType::I64,
    DataType::F8E4M3,
];

/// The call shape every rank agrees on (same seed), and a per-rank offset.
struct Shape {
    dtype: DataType,
    count: usize,
    in_place: bool,
    root: usize,
}

fn shape(rng: &mut Rng, n: usize, max: u64) -> Shape {
    let dtype = DTYPES[rng.below(DTYPES.len() as u64) as usize];
    let count = match rng.below(6) {
        0 => 0,
        1 => 1,
        _ => rng.below(max) as usize | 1,
    };
    Shape {
        dtype,
        count,
        in_place: rng.below(2) == 0,
        root: rng.below(n as u64) as usize,
    }
}

fn all_gather(b: Backend) {
    for n in 1..=4 {
        run_ranks(b, n, test_config(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let mut rng = Rng(100 + n as u64);
            let mut mine = Rng(1000 + r as u64);
            let s = new_stream(&dev);
            for it in 0..6 {
                quiesce(c);
                let sh = shape(&mut rng, n, 20_000);
                log::debug!(
                    "all_gather n={n} rank {r} it {it}: count {} in_place {}",
                    sh.count,
                    sh.in_place
                );
                let len = sh.count * sh.dtype.size();
                let recv = Buf::new(&dev, len * n, mine.below(64) as usize, 77 + it);
                let own = recv.ptr.add(r * len);
                let sendbuf =
                    (!sh.in_place).then(|| Buf::new(&dev, len, mine.below(64) as usize, 5));
                let send = sendbuf.as_ref().map_or(own, |b| b.ptr);
                allocated(c);
                dev.fill_pattern_async(s, send, len, seed_of(it, r, 0))
                    .unwrap();
                c.all_gather(send, recv.ptr, sh.count, sh.dtype, s).unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                for p in 0..n {
                    assert_eq!(
                        wrong(&got, recv.off + p * len, len, seed_of(it, p, 0)),
                        0,
                        "it {it} block {p} count {}",
                        sh.count
                    );
                }
                assert_eq!(recv.guard_damage(&got), 0, "guard bands");
            }
            c.wait_idle().unwrap();
        });
    }
}

fn all_to_all(b: Backend) {
    for n in 1..=4 {
        run_ranks(b, n, test_config(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let mut rng = Rng(200 + n as u64);
            let mut mine = Rng(2000 + r as u64);
            let s = new_stream(&dev);
            for it in 0..6 {
                quiesce(c);
                let sh = shape(&mut rng, n, 10_000);
                let len = sh.count * sh.dtype.size();
                let send = Buf::new(&dev, len * n, mine.below(64) as usize, 3);
                let recv = Buf::new(&dev, len * n, mine.below(64) as usize, 4);
                allocated(c);
                for j in 0..n {
                    dev.fill_pattern_async(s, send.ptr.add(j * len), len, seed_of(it, r, j))
                        .unwrap();
                }
                c.all_to_all(send.ptr, recv.ptr, sh.count, sh.dtype, s)
                    .unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                for p in 0..n {
                    assert_eq!(
                        wrong(&got, recv.off + p * len, len, seed_of(it, p, r)),
                        0,
                        "it {it} from {p}"
                    );
                }
                assert_eq!(recv.guard_damage(&got), 0);
            }
        });
    }
}

/// Pairwise-consistent random counts: rank i sends cnt(i, j) elements to rank j.
fn cnt(it: u64, i: usize, j: usize) -> usize {
    let mut r = Rng(it * 31 + (i * 7 + j) as u64);
    match r.below(4) {
        0 => 0,
        _ => r.below(3000) as usize,
    }
}

fn all_to_allv(b: Backend) {
    for n in [2, 3, 4] {
        run_ranks(b, n, test_config(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let s = new_stream(&dev);
            let dtype = DataType::BF16;
            let es = dtype.size();
            for it in 0..5u64 {
                quiesce(c);
                let sc: Vec<usize> = (0..n).map(|j| cnt(it, r, j)).collect();
                let rc: Vec<usize> = (0..n).map(|j| cnt(it, j, r)).collect();
                // Displacements with gaps, in a permuted block order.
                let mut sd = vec![0; n];
                let mut acc = 0;
                for j in (0..n).rev() {
                    sd[j] = acc;
                    acc += sc[j] + 3;
                }
                let stotal = acc;
                let mut rd = vec![0; n];
                acc = 1;
                for j in 0..n {
                    rd[j] = acc;
                    acc += rc[j] + 2;
                }
                let rtotal = acc;
                let send = Buf::new(&dev, stotal * es, 5, 1);
                let recv = Buf::new(&dev, rtotal * es, 9, 2);
                allocated(c);
                for j in 0..n {
                    dev.fill_pattern_async(
                        s,
                        send.ptr.add(sd[j] * es),
                        sc[j] * es,
                        seed_of(it, r, j),
                    )
                    .unwrap();
                }
                c.all_to_allv(send.ptr, &sc, &sd, recv.ptr, &rc, &rd, dtype, s)
                    .unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                for p in 0..n {
                    assert_eq!(
                        wrong(&got, recv.off + rd[p] * es, rc[p] * es, seed_of(it, p, r)),
                        0,
                        "it {it} from {p}"
                    );
                }
                // Gaps between received blocks keep the poison.
                let poison = |i: usize| hoccl::device::pattern_byte(2, i as u64);
                let in_block = |i: usize| {
                    (0..n)
                        .any(|p| i >= recv.off + rd[p] * es && i < recv.off + (rd[p] + rc[p]) * es)
                };
                assert_eq!(
                    (0..recv.total)
                        .filter(|i| !in_block(*i) && got[*i] != poison(*i))
                        .count(),
                    0,
                    "gaps untouched"
                );
            }
        });
    }
}

fn broadcast(b: Backend) {
    for n in 1..=4 {
        run_ranks(b, n, test_config(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let mut rng = Rng(300 + n as u64);
            let mut mine = Rng(3000 + r as u64);
            let s = new_stream(&dev);
            for it in 0..6 {
                quiesce(c);
                let sh = shape(&mut rng, n, 50_000);
                let len = sh.count * sh.dtype.size();
                let recv = Buf::new(&dev, len, mine.below(64) as usize, 8);
                let sendbuf = (r == sh.root && !sh.in_place).then(|| Buf::new(&dev, len, 3, 9));
                let send = sendbuf.as_ref().map_or(recv.ptr, |b| b.ptr);
                allocated(c);
                if r == sh.root {
                    dev.fill_pattern_async(s, send, len, seed_of(it, 99, 0))
                        .unwrap();
                }
                c.broadcast(send, recv.ptr, sh.count, sh.dtype, sh.root, s)
                    .unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                assert_eq!(
                    wrong(&got, recv.off, len, seed_of(it, 99, 0)),
                    0,
                    "it {it} root {}",
                    sh.root
                );
                assert_eq!(recv.guard_damage(&got), 0);
            }
        });
    }
}

fn gather_scatter(b: Backend) {
    for n in 1..=4 {
        run_ranks(b, n, test_config(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let mut rng = Rng(400 + n as u64);
            let s = new_stream(&dev);
            for it in 0..5 {
                quiesce(c);
                let sh = shape(&mut rng, n, 8_000);
                let len = sh.count * sh.dtype.size();
                // gather
                let send = Buf::new(&dev, len, 1, 1);
                let recv = Buf::new(&dev, len * n, 2, 2);
                allocated(c);
                dev.fill_pattern_async(s, send.ptr, len, seed_of(it, r, 5))
                    .unwrap();
                c.gather(send.ptr, recv.ptr, sh.count, sh.dtype, sh.root, s)
                    .unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                if r == sh.root {
                    for p in 0..n {
                        assert_eq!(
                            wrong(&got, recv.off + p * len, len, seed_of(it, p, 5)),
                            0,
                            "gather it {it} from {p}"
                        );
                    }
                    assert_eq!(recv.guard_damage(&got), 0);
                } else {
                    assert_eq!(
                        wrong(&got, 0, recv.total, 2),
                        0,
                        "non-root receive buffer untouched"
                    );
                }
                // scatter: another rank may already wait in it for this one, and allocation
                // can wait for its stream (one context; see `quiesce`)
                quiesce(c);
                let send = Buf::new(&dev, len * n, 3, 3);
                let recv = Buf::new(&dev, len, 4, 4);
                allocated(c);
                if r == sh.root {
                    for j in 0..n {
                        dev.fill_pattern_async(s, send.ptr.add(j * len), len, seed_of(it, j, 6))
                            .unwrap();
                    }
                }
                c.scatter(send.ptr, recv.ptr, sh.count, sh.dtype, sh.root, s)
                    .unwrap();
                sync(&dev, s);
                let got = recv.read_all();
                assert_eq!(
                    wrong(&got, recv.off, len, seed_of(it, r, 6)),
                    0,
                    "scatter it {it}"
                );
                assert_eq!(recv.guard_damage(&got), 0);
            }
        });
    }
}

/// Groups of sends/receives in random patterns: rings both ways, several messages to one
/// peer, to self, and ranks that take no part.
fn send_recv_groups(b: Backend) {
    for n in 1..=4 {
        run_ranks(b, n, test_config(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let s = new_stream(&dev);
            for it in 0..8u64 {
                quiesce(c);
                // Every rank derives the same list of (src, dst, bytes) messages.
                let mut rng = Rng(500 + it * 13 + n as u64);
                let msgs: Vec<(usize, usize, usize)> = (0..rng.below(7) + 1)
                    .map(|_| {
                        (
                            rng.below(n as u64) as usize,
                            rng.below(n as u64) as usize,
                            rng.below(40_000) as usize,
                        )
                    })
                    .collect();
                let mine: Vec<_> = msgs
                    .iter()
                    .enumerate()
                    .filter(|(_, m)| m.0 == r || m.1 == r)
                    .collect();
                let bufs: Vec<(usize, Buf, Option<Buf>)> = mine
                    .iter()
                    .map(|(i, m)| {
                        let sb = (m.0 == r).then(|| Buf::new(&dev, m.2, *i % 7, 1));
                        (*i, Buf::new(&dev, m.2, *i % 5, 2), sb)
                    })
                    .collect();
                allocated(c);
                if mine.is_empty() {
                    continue; // not involved: point-to-point needs no call from this rank
                }
                c.group(|c| {
                    for (i, rb, sb) in &bufs {
                        let (src, dst, len) = msgs[*i];
                        if let Some(sb) = sb {
                            dev.fill_pattern_async(s, sb.ptr, len, seed_of(it, src, *i))
                                .unwrap();
                            c.send(sb.ptr, len, DataType::U8, dst, s)?;
                        }
                        if dst == r {
                            c.recv(rb.ptr, len, DataType::U8, src, s)?;
                        }
                    }
                    Ok(())
                })
                .unwrap();
                sync(&dev, s);
                for (i, rb, _) in &bufs {
                    let (src, dst, len) = msgs[*i];
                    if dst == r {
                        let got = rb.read_all();
                        assert_eq!(
                            wrong(&got, rb.off, len, seed_of(it, src, *i)),
                            0,
                            "it {it} msg {i}"
                        );
                        assert_eq!(rb.guard_damage(&got), 0);
                    }
                }
            }
        });
    }
}

/// 1000 operations back to back on one stream, then on three streams, with one host
/// synchronisation at the end; each op's data depends on the previous op's output.
fn back_to_back(b: Backend) {
    run_ranks(b, 4, test_config(), |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        let len = 1000;
        let a = Buf::new(&dev, len * n, 0, 1);
        let bb = Buf::new(&dev, len * n, 0, 2);
        let s = new_stream(&dev);
        allocated(c);
        dev.fill_pattern_async(s, a.ptr.add(r * len), len, seed_of(1, r, 0))
            .unwrap();
        // AllGather then AlltoAll-identity shuffles: a -> b -> a ... 1000 times. An AllGather
        // of a full buffer slot-by-slot is idempotent, so the end state is checkable and any
        // op running before its predecessor finished would read stale data.
        for i in 0..1000 {
            let (src, dst) = if i % 2 == 0 { (&a, &bb) } else { (&bb, &a) };
            c.all_gather(src.ptr.add(r * len), dst.ptr, len, DataType::U8, s)
                .unwrap();
        }
        sync(&dev, s);
        let got = a.read_all();
        for p in 0..n {
            assert_eq!(wrong(&got, p * len, len, seed_of(1, p, 0)), 0, "slot {p}");
        }
        // Three streams interleaved, independent buffers (allocated once no rank waits).
        quiesce(c);
        let streams: Vec<_> = (0..3).map(|_| new_stream(&dev)).collect();
        let bufs: Vec<_> = (0..3)
            .map(|k| Buf::new(&dev, len * n, k, 10 + k as u64))
            .collect();
        allocated(c);
        for round in 0..30u64 {
            for (k, st) in streams.iter().enumerate() {
                dev.fill_pattern_async(*st, bufs[k].ptr.add(r * len), len, seed_of(round, r, k))
                    .unwrap();
                c.all_gather(
                    bufs[k].ptr.add(r * len),
                    bufs[k].ptr,
                    len,
                    DataType::U8,
                    *st,
                )
                .unwrap();
            }
        }
        for (k, st) in streams.iter().enumerate() {
            sync(&dev, *st);
            let got = bufs[k].read_all();
            for p in 0..n {
                assert_eq!(
                    wrong(&got, bufs[k].off + p * len, len, seed_of(29, p, k)),
                    0,
                    "stream {k} slot {p}"
                );
            }
        }
        c.wait_idle().unwrap();
    });
}

/// Stream order without host synchronisation: fill (before the call) and a copy out
/// (after the call) on the same stream; only the final copy is read.
fn stream_ordering(b: Backend) {
    run_ranks(b, 3, test_config(), |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        let len = 300_001;
        let send = Buf::new(&dev, len, 3, 1);
        let recv = Buf::new(&dev, len * n, 1, 2);
        let out = Buf::new(&dev, len * n, 0, 3);
        let s = new_stream(&dev);
        allocated(c);
        for it in 0..20u64 {
            dev.fill_pattern_async(s, send.ptr, len, seed_of(it, r, 7))
                .unwrap();
            c.all_gather(send.ptr, recv.ptr, len, DataType::U8, s)
                .unwrap();
            dev.memcpy_async(s, out.ptr, recv.ptr, len * n).unwrap();
        }
        sync(&dev, s);
        let got = out.read_all();
        for p in 0..n {
            assert_eq!(wrong(&got, p * len, len, seed_of(19, p, 7)), 0, "slot {p}");
        }
    });
}

/// Two communicators over the same ranks, used in alternation.
fn two_communicators(b: Backend) {
    use hoccl::bootstrap::thread::ThreadBootstrap;
    let g1 = ThreadBootstrap::group(3);
    let g2 = ThreadBootstrap::group(3);
    let hs: Vec<_> = g1
        .into_iter()
        .zip(g2)
        .enumerate()
        .map(|(r, (b1, b2))| {
            std::thread::spawn(move || {
                two_communicators_rank(b, r, b1, b2);
                free_deferred();
            })
        })
        .collect();
    for h in hs {
        h.join().unwrap();
    }
}

fn two_communicators_rank(
    b: Backend,
    r: usize,
    b1: hoccl::bootstrap::thread::ThreadBootstrap,
    b2: hoccl::bootstrap::thread::ThreadBootstrap,
) {
    use hoccl::comm::Communicator;
    {
        let dev = open_device(b, r);
        let c1 =
            Communicator::with_bootstrap(Box::new(b1), Some(dev.clone()), test_config()).unwrap();
        let c2 =
            Communicator::with_bootstrap(Box::new(b2), Some(dev.clone()), test_config()).unwrap();
        let len = 4099;
        let x = Buf::new(&dev, len * 3, 0, 1);
        let y = Buf::new(&dev, len * 3, 0, 2);
        let s = new_stream(&dev);
        allocated(&c1);
        for it in 0..10u64 {
            dev.fill_pattern_async(s, x.ptr.add(r * len), len, seed_of(it, r, 1))
                .unwrap();
            dev.fill_pattern_async(s, y.ptr.add(r * len), len, seed_of(it, r, 2))
                .unwrap();
            c1.all_gather(x.ptr.add(r * len), x.ptr, len, DataType::U8, s)
                .unwrap();
            c2.broadcast(
                y.ptr.add(r * len),
                y.ptr.add(r * len),
                len,
                DataType::U8,
                (it % 3) as usize,
                s,
            )
            .unwrap();
        }
        dev.synchronize(s).unwrap();
        let gx = x.read_all();
        c1.wait_idle().unwrap();
        c2.wait_idle().unwrap();
        for p in 0..3 {
            assert_eq!(wrong(&gx, p * len, len, seed_of(9, p, 1)), 0);
        }
        let gy = y.read_all();
        assert_eq!(
            wrong(&gy, r * len, len, seed_of(9, 0, 2)),
            0,
            "last broadcast came from root 0"
        );
        // The buffers are freed (and the device closed) only once every rank is idle.
        quiesce(&c2);
    }
}

/// A stream destroyed before the communicator (legal, as with NCCL): teardown must not
/// touch it (on CUDA, querying a destroyed stream crashed), and a second communicator
/// reuses the flag pairs with its own stream.
fn stream_destroyed_first(b: Backend) {
    for round in 0..2u64 {
        run_ranks(b, 2, test_config(), move |c| {
            let (r, dev) = (c.rank(), c.device().clone());
            let buf = Buf::new(&dev, 2000, 0, 1);
            let s = dev.create_stream().unwrap(); // destroyed below, by the test itself
            allocated(c);
            dev.fill_pattern_async(s, buf.ptr.add(r * 1000), 1000, seed_of(round, r, 0)).unwrap();
            c.all_gather(buf.ptr.add(r * 1000), buf.ptr, 1000, DataType::U8, s).unwrap();
            sync(&dev, s);
            dev.destroy_stream(s).unwrap();
            let got = buf.read_all();
            for p in 0..2 {
                assert_eq!(wrong(&got, p * 1000, 1000, seed_of(round, p, 0)), 0);
            }
        });
    }
}

backend_tests!(stream_destroyed_first, 
    all_gather,
    all_to_all,
    all_to_allv,
    broadcast,
    gather_scatter,
    send_recv_groups,
    back_to_back,
    stream_ordering,
    two_communicators
);
