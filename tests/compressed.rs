//! The `compressed` engine (`HOCCL_ENGINE=compressed`) on every data-movement collective:
//! real bf16/f16/f32 tensors (the committed fixtures) and random bytes, sizes on both sides
//! of the compression threshold, buffers at arbitrary byte offsets (misaligned for the
//! codec), 2–4 ranks, in groups and alone; every byte checked against what was sent (the
//! codec is lossless, so the result must be exactly the copy-engine engine's). Run with
//! `HOCCL_ENGINE=compressed` or not, these bodies set the engine themselves. The same
//! bodies run on CUDA with `--ignored` on a GPU machine.
//!
//! The reductions (`reductions`) are checked bit for bit against `reduce::reduce_into` over
//! every rank's input in rank order: the result the `sm` engine gives (tests/reductions.rs
//! checks it against the same reference). On CUDA their compressed reduce steps run the
//! fused decompress + reduce kernel, on the host backend decompression then the reduce.
mod common;
use common::*;

use hoccl::config::EngineChoice;
use hoccl::reduce::reduce_into;
use hoccl::{Config, DataType, RedOp};

/// The transfers below this move raw (`comm::compressed::MIN_BYTES`).
const MIN: usize = 64 << 10;

fn config() -> Config {
    Config { engine: EngineChoice::Compressed, ..test_config() }
}

/// The engine pipelined by segment at these sizes: up to 4 segments of at least `MIN`, so
/// that the larger counts below cross in 2–4 segments (the last one shorter) and the
/// smaller ones whole, in the same ops.
fn pipelined() -> Config {
    Config { codec_segments: Some(4), codec_segment_bytes: MIN, ..config() }
}

/// `len` bytes of `dtype` data: a real tensor (tiled, starting at a point chosen by `seed`)
/// or, for odd seeds, random bytes (incompressible: stored raw by the codec).
fn data(dtype: DataType, len: usize, seed: u64) -> Vec<u8> {
    if seed % 2 == 1 {
        return (0..len as u64).map(|i| hoccl::device::pattern_byte(seed, i)).collect();
    }
    let file = match dtype {
        DataType::BF16 => "minilm-weight-l3-ffn-in.bf16",
        DataType::F16 => "minilm-act-l2-ffn-gelu.f16",
        DataType::F32 => "minilm-weight-l0-query.f32",
        _ => "minilm-weight-word-emb.bf16",
    };
    let dir = std::env::var_os("HOCCL_TEST_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data"));
    let t = std::fs::read(dir.join(file)).unwrap_or_else(|e| panic!("{file}: {e} (set HOCCL_TEST_DATA)"));
    let start = (seed as usize * 4099) % t.len() / dtype.size() * dtype.size();
    (0..len).map(|i| t[(start + i) % t.len()]).collect()
}

const DTYPES: [DataType; 4] = [DataType::BF16, DataType::F16, DataType::F32, DataType::I32];

/// Counts (elements) around the threshold and above it, for `dtype`.
fn counts(dtype: DataType) -> Vec<usize> {
    let e = dtype.size();
    vec![MIN / e - 1, MIN / e, 3 * MIN / e + 5, (1 << 20) / e + 17]
}

fn put(dev: &std::sync::Arc<dyn hoccl::Device>, b: &Buf, at: usize, bytes: &[u8]) {
    dev.copy_from_host(b.ptr.add(at), bytes).unwrap();
}

/// AllGather, Broadcast (every root), Gather and Scatter (root 1), AlltoAll and a ring of
/// send/recv in a group, out of place, at random byte offsets.
fn every_op(b: Backend) {
    every_op_with(b, config());
}

/// [`every_op`] with the transfers cut in segments (coded, moved and decoded overlapping).
fn every_op_pipelined(b: Backend) {
    every_op_with(b, pipelined());
}

fn every_op_with(b: Backend, cfg: Config) {
    for n in [2usize, 3, 4] {
        run_ranks(b, n, cfg.clone(), move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            let s = new_stream(&dev);
            let mut rng = Rng(40 + r as u64);
            for (it, dtype) in DTYPES.into_iter().enumerate() {
                for (ci, count) in counts(dtype).into_iter().enumerate() {
                    quiesce(c);
                    let len = count * dtype.size();
                    let seed = |p: usize, k: usize| (it * 100 + ci * 10 + p + k * 1000) as u64 & !1 | (ci as u64 & 1);
                    let off = |rng: &mut Rng| rng.below(64) as usize;
                    // AllGather
                    let send = Buf::new(&dev, len, off(&mut rng), 3);
                    let recv = Buf::new(&dev, n * len, off(&mut rng), 4);
                    allocated(c);
                    put(&dev, &send, 0, &data(dtype, len, seed(r, 0)));
                    c.all_gather(send.ptr, recv.ptr, count, dtype, s).unwrap();
                    sync(&dev, s);
                    let got = recv.read_all();
                    for p in 0..n {
                        assert!(got[recv.off + p * len..][..len] == data(dtype, len, seed(p, 0))[..], "all_gather {dtype:?} count {count} block {p}");
                    }
                    assert_eq!(recv.guard_damage(&got), 0);
                    // Broadcast from every root
                    for root in 0..n {
                        let buf = Buf::new(&dev, len, off(&mut rng), 5);
                        allocated(c);
                        if r == root {
                            put(&dev, &buf, 0, &data(dtype, len, seed(root, 1)));
                        }
                        c.broadcast(buf.ptr, buf.ptr, count, dtype, root, s).unwrap();
                        sync(&dev, s);
                        let got = buf.read_all();
                        assert!(got[buf.off..][..len] == data(dtype, len, seed(root, 1))[..], "broadcast {dtype:?} count {count} root {root}");
                    }
                    // Gather and Scatter to/from root 1
                    let root = 1;
                    let gsend = Buf::new(&dev, len, off(&mut rng), 6);
                    let grecv = Buf::new(&dev, n * len, off(&mut rng), 7);
                    allocated(c);
                    put(&dev, &gsend, 0, &data(dtype, len, seed(r, 2)));
                    c.gather(gsend.ptr, grecv.ptr, count, dtype, root, s).unwrap();
                    sync(&dev, s);
                    if r == root {
                        let got = grecv.read_all();
                        for p in 0..n {
                            assert!(got[grecv.off + p * len..][..len] == data(dtype, len, seed(p, 2))[..], "gather {dtype:?} count {count} block {p}");
                        }
                    }
                    let ssend = Buf::new(&dev, n * len, off(&mut rng), 8);
                    let srecv = Buf::new(&dev, len, off(&mut rng), 9);
                    allocated(c);
                    if r == root {
                        for p in 0..n {
                            put(&dev, &ssend, p * len, &data(dtype, len, seed(p, 3)));
                        }
                    }
                    c.scatter(ssend.ptr, srecv.ptr, count, dtype, root, s).unwrap();
                    sync(&dev, s);
                    assert!(srecv.read_all()[srecv.off..][..len] == data(dtype, len, seed(r, 3))[..], "scatter {dtype:?} count {count}");
                    // AlltoAll: block p of rank q is data seed(q*n+p)
                    let asend = Buf::new(&dev, n * len, off(&mut rng), 10);
                    let arecv = Buf::new(&dev, n * len, off(&mut rng), 11);
                    allocated(c);
                    for p in 0..n {
                        put(&dev, &asend, p * len, &data(dtype, len, seed(r * n + p, 4)));
                    }
                    c.all_to_all(asend.ptr, arecv.ptr, count, dtype, s).unwrap();
                    sync(&dev, s);
                    let got = arecv.read_all();
                    for q in 0..n {
                        assert!(got[arecv.off + q * len..][..len] == data(dtype, len, seed(q * n + r, 4))[..], "all_to_all {dtype:?} count {count} from {q}");
                    }
                    // A ring of send/recv in one group
                    let rsend = Buf::new(&dev, len, off(&mut rng), 12);
                    let rrecv = Buf::new(&dev, len, off(&mut rng), 13);
                    allocated(c);
                    put(&dev, &rsend, 0, &data(dtype, len, seed(r, 5)));
                    c.group(|c| {
                        c.send(rsend.ptr, count, dtype, (r + 1) % n, s)?;
                        c.recv(rrecv.ptr, count, dtype, (r + n - 1) % n, s)
                    })
                    .unwrap();
                    sync(&dev, s);
                    assert!(rrecv.read_all()[rrecv.off..][..len] == data(dtype, len, seed((r + n - 1) % n, 5))[..], "sendrecv {dtype:?} count {count}");
                }
            }
            c.wait_idle().unwrap();
            assert!(c.async_error().is_none());
        });
    }
}

/// The reductions' scratch in `reductions`: chunks of `RED_SCRATCH / n` bytes, so that the
/// larger counts run in several chunks, each well above the compression threshold.
const RED_SCRATCH: usize = 1 << 20;

#[derive(Clone, Copy, Debug, PartialEq)]
enum Red {
    AllReduce,
    ReduceScatter,
    Reduce,
}

/// AllReduce, ReduceScatter and Reduce on bf16, f16 and f32, every operator, counts 0, 1,
/// odd and small (raw transfers), just above the threshold, one chunk ± 1 and several
/// chunks, in and out of place, buffers at element and at odd byte offsets, real tensors
/// and random bytes (NaNs, infinities, subnormals), 2–4 ranks: every rank's result equal
/// bit for bit to `reduce_into` of the inputs in rank order, guard bands untouched.
fn reductions(b: Backend) {
    reductions_with(b, config());
}

/// [`reductions`] with the engine set to cut transfers in segments: a reduction's exchange
/// and its AllGather cross whole on every rank (the AllGather's shard may be coded by the
/// reduce step as one stream), the hierarchical steps' transfers in segments.
fn reductions_pipelined(b: Backend) {
    reductions_with(b, pipelined());
}

fn reductions_with(b: Backend, cfg: Config) {
    for n in [2usize, 3, 4] {
        run_ranks(b, n, Config { reduce_scratch: RED_SCRATCH, ..cfg.clone() }, move |c| {
            let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
            c.reserve_reduce_scratch().unwrap();
            let s = new_stream(&dev);
            let mut it = 0u64;
            for kind in [Red::AllReduce, Red::ReduceScatter, Red::Reduce] {
                for dtype in [DataType::BF16, DataType::F16, DataType::F32] {
                    let es = dtype.size();
                    let cap = (RED_SCRATCH / n) / 256 * 256 / es;
                    // AllReduce chunks the shard (about count / n), the others the block.
                    let per = if kind == Red::AllReduce { n } else { 1 };
                    let counts = [0, 1, 777, (MIN / es) * per + 3, cap * per - 1, cap * per + 1, 2 * cap * per + 5];
                    for (ci, count) in counts.into_iter().enumerate() {
                        // Every operator up to just above the threshold; one each (in turn)
                        // for the multi-chunk counts, which cost the most on the host.
                        let ops: Vec<RedOp> = if ci < 4 { RedOp::ALL.to_vec() } else { vec![RedOp::ALL[(it as usize + ci) % 5]] };
                        for op in ops {
                            it += 1;
                            // A third of the calls on odd byte offsets (the staging path).
                            let off = |p: usize| if it % 3 == 0 { 2 * p + 1 } else { es * (p + it as usize % 5) };
                            let in_place = it % 2 == 0;
                            let root = it as usize % n;
                            let len = count * es;
                            let send_len = if kind == Red::ReduceScatter { n * len } else { len };
                            let seed = |p: usize| (it * 16 + p as u64) << 1 | (it / 2 % 2);
                            let inputs: Vec<Vec<u8>> = (0..n).map(|p| data(dtype, send_len, seed(p))).collect();
                            let what = format!("{kind:?} {} {} count {count} n {n} in_place {in_place} root {root} rank {r}", dtype.name(), op.name());
                            quiesce(c);
                            let send = Buf::new(&dev, send_len, off(r), 20);
                            let recv = (!in_place).then(|| Buf::new(&dev, len, off(r + 1), 21));
                            allocated(c);
                            put(&dev, &send, 0, &inputs[r]);
                            let rp = match (&recv, kind) {
                                (Some(b), _) => b.ptr,
                                (None, Red::ReduceScatter) => send.ptr.add(r * len),
                                (None, _) => send.ptr,
                            };
                            match kind {
                                Red::AllReduce => c.all_reduce(send.ptr, rp, count, dtype, op, s),
                                Red::ReduceScatter => c.reduce_scatter(send.ptr, rp, count, dtype, op, s),
                                Red::Reduce => c.reduce(send.ptr, rp, count, dtype, op, root, s),
                            }
                            .unwrap_or_else(|e| panic!("{what}: {e}"));
                            sync(&dev, s);
                            let at = if kind == Red::ReduceScatter { r * len } else { 0 };
                            let want = (kind != Red::Reduce || r == root).then(|| {
                                let srcs: Vec<&[u8]> = inputs.iter().map(|v| &v[at..at + len]).collect();
                                let mut out = vec![0u8; len];
                                reduce_into(dtype, op, &mut out, &srcs).unwrap();
                                out
                            });
                            let (buf, start) = match &recv {
                                Some(b) => (b, b.off),
                                None => (&send, send.off + at),
                            };
                            let got = buf.read_all();
                            if let Some(w) = want {
                                let bad = (0..len).find(|i| got[start + i] != w[*i]);
                                assert!(bad.is_none(), "{what}: first wrong byte {bad:?} of {len}");
                            }
                            assert_eq!(buf.guard_damage(&got), 0, "{what}: guard bands");
                            if let Some(rb) = &recv {
                                assert!(send.read_all()[send.off..][..send_len] == inputs[r][..], "{what}: send buffer modified");
                                assert_eq!(rb.guard_damage(&got), 0);
                            }
                        }
                    }
                }
            }
            c.wait_idle().unwrap();
            assert!(c.async_error().is_none());
        });
    }
}

/// Ops back to back on one stream without a sync between them, sizes alternating around
/// the threshold (the stream's staging buffer grows and is reused while earlier ops are
/// still in flight), then every result checked.
fn back_to_back(b: Backend) {
    back_to_back_with(b, config(), MIN / 2);
}

/// [`back_to_back`] pipelined, the larger ops in 2–4 segments: an op's segment flags
/// count on from the previous op's on the same stream, while that one may still run.
fn back_to_back_pipelined(b: Backend) {
    back_to_back_with(b, pipelined(), 2 * MIN);
}

/// `unit`: values per block of the AllGathers; their sizes alternate around `unit`.
fn back_to_back_with(b: Backend, cfg: Config, unit: usize) {
    run_ranks(b, 3, cfg, move |c| {
        let (r, n, dev) = (c.rank(), c.size(), c.device().clone());
        let s = new_stream(&dev);
        let dtype = DataType::BF16;
        let sizes: Vec<usize> = (0..12).map(|i| [unit - 3, unit + 9, 5 * unit + 1][i % 3] + i * 64).collect();
        let bufs: Vec<(Buf, Buf)> = sizes.iter().map(|&c| (Buf::new(&dev, c * 2, 0, 1), Buf::new(&dev, n * c * 2, 0, 2))).collect();
        allocated(c);
        for (i, (&count, (send, _))) in sizes.iter().zip(&bufs).enumerate() {
            put(&dev, send, 0, &data(dtype, count * 2, (i * 8 + r * 2) as u64));
        }
        for (&count, (send, recv)) in sizes.iter().zip(&bufs) {
            c.all_gather(send.ptr, recv.ptr, count, dtype, s).unwrap();
        }
        sync(&dev, s);
        for (i, (&count, (_, recv))) in sizes.iter().zip(&bufs).enumerate() {
            let got = recv.read_all();
            for p in 0..n {
                assert!(got[p * count * 2..][..count * 2] == data(dtype, count * 2, (i * 8 + p * 2) as u64)[..], "op {i} block {p}");
            }
        }
        c.wait_idle().unwrap();
    });
}

/// A copy queue that breaks every copy of 64 KiB or more in transit: byte 0 of the
/// destination (a compressed stream's magic) gets the source's byte 1.
struct Breaks(Box<dyn hoccl::device::CopyQueue>);
impl hoccl::device::CopyQueue for Breaks {
    fn copy(&mut self, dst: hoccl::DevPtr, src: hoccl::DevPtr, len: usize) -> hoccl::Result<()> {
        self.0.copy(dst, src, len)?;
        if len >= MIN / 2 {
            self.0.copy(dst, src.add(1), 1)?;
        }
        Ok(())
    }
    fn fence(&mut self) -> hoccl::Result<u64> {
        self.0.fence()
    }
    fn completed(&mut self) -> hoccl::Result<u64> {
        self.0.completed()
    }
}
struct Corrupting;
impl common::wrap::Hooks for Corrupting {
    fn copy_queue(&self, q: Box<dyn hoccl::device::CopyQueue>) -> Box<dyn hoccl::device::CopyQueue> {
        Box::new(Breaks(q))
    }
}

/// A compressed stream damaged on the way (rank 0's copy queues corrupt what they move) is
/// rejected by the receiver's decoder: the receiver's communicator reports `CorruptData`
/// as its asynchronous error, never a silent success. Host backend only (the damage is
/// done by a wrapped host device).
#[test]
fn a_stream_damaged_in_transit_is_an_error() {
    let got = damaged(config(), |c, buf, count, r, s| if r == 0 { c.send(buf, count, DataType::BF16, 1, s) } else { c.recv(buf, count, DataType::BF16, 0, s) });
    assert!(got[0].is_ok(), "the sender saw nothing wrong: {:?}", got[0]);
    let e = got[1].clone().expect_err("the damaged stream is reported");
    assert_eq!(e.code(), hoccl::ErrorCode::CorruptData, "{e}");
}

/// The same for a reduction: the exchange's stream from rank 0 arrives damaged, and rank 1
/// reports `CorruptData` instead of a result folded from bad values.
#[test]
fn a_reduction_stream_damaged_in_transit_is_an_error() {
    let got = damaged(config(), |c, buf, count, _, s| c.all_reduce(buf, buf, count, DataType::BF16, RedOp::Sum, s));
    let e = got[1].clone().expect_err("the damaged stream is reported");
    assert_eq!(e.code(), hoccl::ErrorCode::CorruptData, "{e}");
}

/// The same for a send cut in segments (two of `MIN` bytes, each damaged on the way): the
/// receiver's decoding of a segment rejects it and its communicator reports `CorruptData`.
#[test]
fn a_segment_damaged_in_transit_is_an_error() {
    let got = damaged(pipelined(), |c, buf, count, r, s| if r == 0 { c.send(buf, count, DataType::BF16, 1, s) } else { c.recv(buf, count, DataType::BF16, 0, s) });
    assert!(got[0].is_ok(), "the sender saw nothing wrong: {:?}", got[0]);
    let e = got[1].clone().expect_err("the damaged segment is reported");
    assert_eq!(e.code(), hoccl::ErrorCode::CorruptData, "{e}");
}

/// Ranks that cut a transfer differently (`codec_segments` 4 on rank 0, 1 on rank 1) fail
/// the op on both sides with an error, and their streams run on: never a hang, never
/// wrong data reported as success.
#[test]
fn ranks_that_cut_differently_fail_the_op() {
    let boots = hoccl::bootstrap::thread::ThreadBootstrap::group(2);
    let ranks: Vec<_> = boots
        .into_iter()
        .enumerate()
        .map(|(r, boot)| {
            std::thread::spawn(move || {
                let dev = hoccl::device::open(hoccl::BackendChoice::Host, 0).expect("host backend");
                let cfg = Config { codec_segments: Some(if r == 0 { 4 } else { 1 }), timeout: std::time::Duration::from_secs(5), ..pipelined() };
                let c = hoccl::Communicator::with_bootstrap(Box::new(boot), Some(dev.clone()), cfg).expect("communicator");
                let count = 4 * MIN;
                let buf = dev.alloc(count * 2).unwrap();
                dev.copy_from_host(buf, &data(DataType::BF16, count * 2, 2)).unwrap();
                let s = dev.create_stream().unwrap();
                let t = std::time::Instant::now();
                let call = if r == 0 { c.send(buf, count, DataType::BF16, 1, s) } else { c.recv(buf, count, DataType::BF16, 0, s) };
                call.unwrap();
                dev.synchronize(s).unwrap();
                let outcome = c.wait_idle().and(c.async_error().map_or(Ok(()), Err));
                assert!(t.elapsed() < std::time::Duration::from_secs(30), "rank {r} took {:?}", t.elapsed());
                drop(c);
                dev.destroy_stream(s).unwrap();
                dev.free(buf).unwrap();
                outcome
            })
        })
        .collect();
    for (r, h) in ranks.into_iter().enumerate() {
        let e = h.join().expect("rank").expect_err("the mismatch is an error");
        assert!(matches!(e.code(), hoccl::ErrorCode::InvalidUsage | hoccl::ErrorCode::Remote), "rank {r}: {e}");
    }
}

/// Two host ranks, rank 0's copy queues damaging what they move; `call(comm, buffer, count,
/// rank, stream)` on each with `MIN` bf16 values of real data; each rank's outcome.
fn damaged(cfg: Config, call: fn(&hoccl::Communicator, hoccl::DevPtr, usize, usize, hoccl::device::StreamHandle) -> hoccl::Result<()>) -> Vec<hoccl::Result<()>> {
    let boots = hoccl::bootstrap::thread::ThreadBootstrap::group(2);
    let ranks: Vec<_> = boots
        .into_iter()
        .enumerate()
        .map(|(r, boot)| {
            let cfg = cfg.clone();
            std::thread::spawn(move || {
                let host = hoccl::device::open(hoccl::BackendChoice::Host, 0).expect("host backend");
                let dev: std::sync::Arc<dyn hoccl::Device> =
                    if r == 0 { std::sync::Arc::new(common::wrap::Wrapped(host, Corrupting)) } else { host };
                let c = hoccl::Communicator::with_bootstrap(Box::new(boot), Some(dev.clone()), cfg).expect("communicator");
                let (count, dtype) = (MIN, DataType::BF16);
                let buf = dev.alloc(count * 2).unwrap();
                dev.copy_from_host(buf, &data(dtype, count * 2, 2)).unwrap();
                let s = dev.create_stream().unwrap();
                call(&c, buf, count, r, s).unwrap();
                dev.synchronize(s).unwrap();
                let outcome = c.wait_idle();
                drop(c);
                dev.destroy_stream(s).unwrap();
                dev.free(buf).unwrap();
                outcome
            })
        })
        .collect();
    ranks.into_iter().map(|h| h.join().expect("rank")).collect()
}

backend_tests!(every_op, every_op_pipelined, back_to_back, back_to_back_pipelined, reductions, reductions_pipelined);
