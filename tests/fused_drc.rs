//! The fused decompress + reduce + compress kernels (`cuda/bfx_fused.cu` `drc_kernel`,
//! `compress::fused::decompress_reduce_compress_async`): the reduced values bit for bit the
//! contract's fold (`hoccl::reduce::reduce_into`, inputs in the order given), and the
//! output stream byte for byte the stream the standalone compressor makes of them (the CPU
//! reference, whose bytes the GPU compressor's equal), for every dtype, operator and local
//! position, sizes around the block, misaligned and in-place buffers, raw blocks, one and
//! two tiers, a stream built by several launches, and corrupt inputs reported.
//!
//! The same bodies run twice: under the CPU emulator (`cuda/bfx_emu.hpp`, the kernel file
//! compiled as C++ by the system compiler, `CXX`), in CI; and on a GPU through the public
//! API (ignored by default: `--ignored`, as scripts/gpu/core.sh and sanitize.sh run it).
mod codec_common;
use codec_common::Rng;
use hoccl::compress::{self, fused, Dtype, Params};
use hoccl::device::{DevPtr, Device};
use hoccl::reduce::RedOp;
use hoccl::types::DataType;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

/// One launch's inputs: the compressed streams (in fold order), the raw local input and its
/// position among them.
struct Case<'a> {
    dt: Dtype,
    op: RedOp,
    streams: &'a [Vec<u8>],
    local: &'a [u8],
    pos: usize,
    params: Params,
    /// dst and local `shift` values past a 256-byte aligned address.
    shift: usize,
    in_place: bool,
}

/// What a launch left: dst's values, the status word, the output stream (when status is 0).
struct Got {
    dst: Vec<u8>,
    status: u32,
    stream: Vec<u8>,
}

/// An implementation of the kernels under test.
trait Drc {
    fn name(&self) -> &'static str;
    fn run(&self, c: &Case) -> Got;
    /// `data` coded by launches of `chunk` values each without streams (the stream continued
    /// across launches).
    fn chain(&self, dt: Dtype, data: &[u8], chunk: usize, p: &Params) -> Vec<u8>;
}

fn data_type(dt: Dtype) -> DataType {
    match dt {
        Dtype::Bf16 => DataType::BF16,
        Dtype::F16 => DataType::F16,
        Dtype::F32 => DataType::F32,
    }
}

fn block_of(dt: Dtype, p: &Params) -> usize {
    if p.block == 0 {
        (32 << 10) / dt.size()
    } else {
        p.block as usize
    }
}

/// Run `c`, check dst against the reference fold and the stream against the CPU
/// compressor's bytes of dst; panics naming the case.
fn check(d: &dyn Drc, c: &Case, what: &str) {
    let es = c.dt.size();
    let n = c.local.len() / es;
    let raw: Vec<Vec<u8>> = c.streams.iter().map(|s| compress::decompress(s).unwrap()).collect();
    let mut order: Vec<&[u8]> = raw.iter().map(|v| v.as_slice()).collect();
    order.insert(c.pos, c.local);
    let mut want = vec![0u8; c.local.len()];
    hoccl::reduce::reduce_into(data_type(c.dt), c.op, &mut want, &order).unwrap();
    let name = format!("{} {what}: {} {} n={n} m={} local at {} shift {} in place {} tiers {}", d.name(), c.dt.name(), c.op.name(), c.streams.len(), c.pos, c.shift, c.in_place, c.params.tiers);
    let got = d.run(c);
    assert_eq!(got.status, 0, "{name}: status {:#x} ({:?})", got.status, compress::status_result(got.status));
    if got.dst != want {
        let i = (0..n).find(|&i| got.dst[es * i..es * (i + 1)] != want[es * i..es * (i + 1)]).unwrap();
        panic!("{name}: value {i}: got {:02x?}, want {:02x?}", &got.dst[es * i..es * (i + 1)], &want[es * i..es * (i + 1)]);
    }
    let cpu = compress::compress(c.dt, &want, &c.params).unwrap();
    if got.stream != cpu {
        let at = got.stream.iter().zip(&cpu).position(|(a, b)| a != b).unwrap_or(got.stream.len().min(cpu.len()));
        panic!("{name}: output stream of {} bytes differs from the compressor's {} bytes from byte {at}", got.stream.len(), cpu.len());
    }
}

fn normal(dt: Dtype, rng: &mut Rng, n: usize, sigma: f64, specials: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(n * dt.size());
    for _ in 0..n {
        let x = (rng.normal() * sigma) as f32;
        let special = specials && rng.below(64) == 0;
        match dt {
            Dtype::F32 => out.extend_from_slice(&(if special { rng.next() as u32 } else { x.to_bits() }).to_le_bytes()),
            Dtype::Bf16 => out.extend_from_slice(&(if special { rng.next() as u16 } else { codec_common::bf16_of(x) }).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&(if special { rng.next() as u16 } else { codec_common::f16_of(x) }).to_le_bytes()),
        }
    }
    out
}

/// Inputs of `m + 1` kinds by k % 3: narrow normal with specials, wide normal, random bytes
/// (raw blocks).
fn inputs(dt: Dtype, rng: &mut Rng, m: usize, n: usize) -> Vec<Vec<u8>> {
    (0..=m)
        .map(|k| match k % 3 {
            0 => normal(dt, rng, n, 0.02, true),
            1 => normal(dt, rng, n, 3.0, false),
            _ => rng.bytes(dt.size() * n),
        })
        .collect()
}

// ------------------------------------------------------------------ bodies -------------

/// Every dtype, operator and local position, sizes around the block, m of 1, 2 and 3.
fn every_dtype_op_and_position(d: &dyn Drc, sizes: &[usize]) {
    let mut rng = Rng(0x5eed_0d1c);
    for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
        let p = Params::default();
        let b = block_of(dt, &p);
        for (i, &n) in sizes.iter().map(|s| if *s == 0 { b } else { *s }).collect::<Vec<_>>().iter().enumerate() {
            let m = 1 + i % 3;
            let data = inputs(dt, &mut rng, m, n);
            let streams: Vec<Vec<u8>> = data[..m].iter().map(|x| compress::compress(dt, x, &p).unwrap()).collect();
            for op in RedOp::ALL {
                for pos in 0..=m {
                    let c = Case { dt, op, streams: &streams, local: &data[m], pos, params: p, shift: 0, in_place: false };
                    check(d, &c, "every op");
                }
            }
        }
    }
}

/// Misaligned dst and local (element offsets 1-3), in place with the local input first,
/// last and between, one tier, and eight streams.
fn alignments_in_place_tiers_and_eight_streams(d: &dyn Drc, n: usize) {
    let mut rng = Rng(0x5eed_0d1d);
    for dt in [Dtype::Bf16, Dtype::F16, Dtype::F32] {
        for tiers in [2u8, 1] {
            let p = Params { block: 0, tiers };
            let data = inputs(dt, &mut rng, 3, n);
            let streams: Vec<Vec<u8>> = data[..3].iter().map(|x| compress::compress(dt, x, &p).unwrap()).collect();
            for (shift, in_place, pos) in [(1, false, 0), (2, true, 3), (3, true, 1), (0, true, 0), (1, true, 2)] {
                let c = Case { dt, op: RedOp::Sum, streams: &streams, local: &data[3], pos, params: p, shift, in_place };
                check(d, &c, "alignment");
            }
        }
        let p = Params::default();
        let data: Vec<Vec<u8>> = (0..9).map(|_| normal(dt, &mut rng, n, 1.0, true)).collect();
        let streams: Vec<Vec<u8>> = data[..8].iter().map(|x| compress::compress(dt, x, &p).unwrap()).collect();
        for op in [RedOp::Sum, RedOp::Avg] {
            check(d, &Case { dt, op, streams: &streams, local: &data[8], pos: 5, params: p, shift: 0, in_place: false }, "eight streams");
        }
    }
}

/// The real bf16 fixtures (tests/data), reduced against one another.
fn real_fixtures(d: &dyn Drc, max_len: usize) {
    let fx: Vec<Vec<u8>> = codec_common::fixtures().into_iter().filter(|f| f.2 == Dtype::Bf16).map(|f| f.3).collect();
    assert!(fx.len() >= 4, "bf16 fixtures missing");
    let len = fx.iter().map(|x| x.len()).min().unwrap().min(max_len) & !1;
    let p = Params::default();
    let streams: Vec<Vec<u8>> = fx[..3].iter().map(|x| compress::compress(Dtype::Bf16, &x[..len], &p).unwrap()).collect();
    for op in [RedOp::Sum, RedOp::Max] {
        check(d, &Case { dt: Dtype::Bf16, op, streams: &streams, local: &fx[3][..len], pos: 2, params: p, shift: 0, in_place: false }, "fixtures");
    }
}

/// A stream built by several launches (continued by the look-back across them), chunk
/// sizes of one and several blocks, a last chunk shorter than a block.
fn stream_across_launches(d: &dyn Drc) {
    let mut rng = Rng(0x5eed_0d1e);
    for dt in [Dtype::Bf16, Dtype::F32] {
        for tiers in [2u8, 1] {
            let p = Params { block: 0, tiers };
            let b = block_of(dt, &p);
            let data = normal(dt, &mut rng, 5 * b + 37, 0.5, true);
            for chunk in [b, 2 * b, 3 * b] {
                let got = d.chain(dt, &data, chunk, &p);
                assert!(got == compress::compress(dt, &data, &p).unwrap(), "{} {}: chunks of {chunk}: the stream differs from the compressor's", d.name(), dt.name());
            }
        }
    }
}

/// Corrupt streams: reported in the status word (never a hang, a fault or a silent result).
fn corrupt_inputs_reported(d: &dyn Drc) {
    let mut rng = Rng(0x5eed_0d1f);
    let dt = Dtype::Bf16;
    let p = Params::default();
    let n = 4 * 16384 + 3;
    let data = inputs(dt, &mut rng, 2, n);
    let good = compress::compress(dt, &data[0], &p).unwrap();
    let nblocks = u32::from_le_bytes(good[20..24].try_into().unwrap()) as usize;
    let block2 = 24 + 4 * nblocks + (0..2).map(|j| u32::from_le_bytes(good[24 + 4 * j..28 + 4 * j].try_into().unwrap()) as usize).sum::<usize>();
    for (what, at, x) in [("magic", 0usize, 1u8), ("value count", 8, 1), ("block size", 16, 0x20), ("size of block 1", 28, 0x04), ("header of block 2", block2, 0xc0)] {
        let mut bad = good.clone();
        bad[at] ^= x;
        let streams = [good.clone(), bad];
        let got = d.run(&Case { dt, op: RedOp::Sum, streams: &streams, local: &data[2], pos: 1, params: p, shift: 0, in_place: false });
        assert_ne!(got.status, 0, "{}: corrupt {what} not reported", d.name());
    }
    // A stream of another block size than the output's.
    let other = compress::compress(dt, &data[0], &Params { block: 8192, tiers: 2 }).unwrap();
    let got = d.run(&Case { dt, op: RedOp::Sum, streams: &[other], local: &data[2], pos: 0, params: p, shift: 0, in_place: false });
    assert_ne!(got.status, 0, "{}: a stream of another block size not reported", d.name());
}

// ------------------------------------------------------------------ the emulator -------

fn emulator() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    // -ffp-contract=off: the reduction steps round each operation (reduce.cuh).
    BIN.get_or_init(|| codec_common::build_emulator("bfx_emu_drc", &["-ffp-contract=off"]))
}

fn tmp(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let i = N.fetch_add(1, Ordering::Relaxed);
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("drc-{}-{i}-{tag}", std::process::id()))
}

/// `sched` nonzero: BFX_EMU_SCHED, the threads of a CTA resumed in a shuffled order between
/// collectives (a missing barrier shows as wrong output or a deadlock).
struct Emu {
    sched: u64,
}

impl Emu {
    fn exec(&self, args: &[String]) -> String {
        let mut cmd = Command::new(emulator());
        if self.sched != 0 {
            cmd.env("BFX_EMU_SCHED", self.sched.to_string());
        }
        let out = cmd.args(args).output().unwrap();
        assert!(out.status.success(), "emulator {args:?}: {}\n{}", out.status, String::from_utf8_lossy(&out.stderr));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drc for Emu {
    fn name(&self) -> &'static str {
        "emulator"
    }
    fn run(&self, c: &Case) -> Got {
        let (local, dst, out) = (tmp("local"), tmp("dst"), tmp("out"));
        std::fs::write(&local, c.local).unwrap();
        let paths: Vec<PathBuf> = c.streams.iter().map(|s| {
            let p = tmp("in");
            std::fs::write(&p, s).unwrap();
            p
        }).collect();
        let b = block_of(c.dt, &c.params);
        let mut args: Vec<String> = ["drc", c.dt.name(), c.op.name()].map(String::from).to_vec();
        args.extend([c.pos, c.params.tiers as usize, b, c.shift * c.dt.size(), c.in_place as usize].map(|x| x.to_string()));
        args.extend([&local, &dst, &out].map(|p| p.display().to_string()));
        args.extend(paths.iter().map(|p| p.display().to_string()));
        let stdout = self.exec(&args);
        let status = stdout.trim().strip_prefix("status ").and_then(|s| s.parse().ok()).unwrap_or_else(|| panic!("emulator said {stdout:?}"));
        let got = Got { dst: std::fs::read(&dst).unwrap(), status, stream: std::fs::read(&out).unwrap_or_default() };
        for p in paths.iter().chain([&local, &dst, &out]) {
            let _ = std::fs::remove_file(p);
        }
        got
    }
    fn chain(&self, dt: Dtype, data: &[u8], chunk: usize, p: &Params) -> Vec<u8> {
        let (input, out) = (tmp("chain-in"), tmp("chain-out"));
        std::fs::write(&input, data).unwrap();
        let b = block_of(dt, p);
        let args: Vec<String> = vec!["chain".into(), dt.name().into(), b.to_string(), p.tiers.to_string(), chunk.to_string(), input.display().to_string(), out.display().to_string()];
        self.exec(&args);
        let got = std::fs::read(&out).unwrap();
        let _ = std::fs::remove_file(&input);
        let _ = std::fs::remove_file(&out);
        got
    }
}

#[test]
fn emu_every_dtype_op_and_position() {
    every_dtype_op_and_position(&Emu { sched: 0 }, &[1, 31, 1000, 0, 16385, 40000]);
}

#[test]
fn emu_shuffled_schedule() {
    let e = Emu { sched: 0x5eed_0d20 };
    every_dtype_op_and_position(&e, &[1000, 16385]);
    alignments_in_place_tiers_and_eight_streams(&e, 16384 + 77);
}

#[test]
fn emu_alignments_in_place_tiers_and_eight_streams() {
    alignments_in_place_tiers_and_eight_streams(&Emu { sched: 0 }, 2 * 16384 + 101);
}

#[test]
fn emu_real_fixtures() {
    real_fixtures(&Emu { sched: 0 }, 3 * 32768 + 64);
}

#[test]
fn emu_stream_across_launches() {
    stream_across_launches(&Emu { sched: 0 });
}

#[test]
fn emu_corrupt_inputs_reported() {
    corrupt_inputs_reported(&Emu { sched: 0 });
}

// ------------------------------------------------------------------ the GPU ------------

struct Gpu {
    dev: Arc<dyn Device>,
    s: hoccl::device::StreamHandle,
}

fn gpu() -> Gpu {
    let dev = hoccl::device::open(hoccl::config::BackendChoice::Cuda, 0).unwrap_or_else(|e| panic!("needs a GPU, none usable: {e}"));
    assert!(dev.as_cuda().is_some(), "BackendChoice::Cuda opened a device without CUDA");
    let s = dev.create_stream().unwrap();
    Gpu { dev, s }
}

impl Gpu {
    fn upload(&self, data: &[u8], extra: usize) -> DevPtr {
        let p = self.dev.alloc(data.len() + extra + 256).unwrap();
        self.dev.copy_from_host(p, data).unwrap();
        p
    }
    fn download(&self, p: DevPtr, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.dev.copy_to_host(&mut v, p).unwrap();
        v
    }
}

impl Drc for Gpu {
    fn name(&self) -> &'static str {
        "cuda"
    }
    fn run(&self, c: &Case) -> Got {
        let d = &*self.dev;
        let (es, n) = (c.dt.size(), c.local.len() / c.dt.size());
        let ins: Vec<(DevPtr, usize)> = c.streams.iter().map(|s| (self.upload(s, 0), s.len())).collect();
        let lp = d.alloc(c.local.len() + 256).unwrap();
        let dp = d.alloc(c.local.len() + 256).unwrap();
        let local = lp.add(es * c.shift);
        d.copy_from_host(local, c.local).unwrap();
        let dst = if c.in_place { local } else { dp.add(es * c.shift) };
        let cap = compress::max_compressed_len(c.dt, n, &c.params).unwrap();
        let out = d.alloc(cap).unwrap();
        let words = d.alloc(64).unwrap();
        let ws_len = fused::drc_workspace_len(c.dt, ins.len(), n, &c.params).unwrap();
        let ws = d.alloc(ws_len).unwrap();
        let o = fused::DrcOut { out, cap, out_len: words, total: n, params: c.params };
        fused::drc_begin_async(d, self.s, c.dt, &o).unwrap();
        fused::decompress_reduce_compress_async(d, self.s, c.dt, &ins, local, c.pos, dst, n, c.op, words.add(8), &o, 0, (ws, ws_len)).unwrap();
        d.synchronize(self.s).unwrap();
        let w = self.download(words, 12);
        let len = u64::from_le_bytes(w[..8].try_into().unwrap()) as usize;
        let status = u32::from_le_bytes(w[8..12].try_into().unwrap());
        let got = Got { dst: self.download(dst, c.local.len()), status, stream: if status == 0 { self.download(out, len.min(cap)) } else { Vec::new() } };
        for p in ins.iter().map(|x| x.0).chain([lp, dp, out, words, ws]) {
            d.free(p).unwrap();
        }
        got
    }
    fn chain(&self, dt: Dtype, data: &[u8], chunk: usize, p: &Params) -> Vec<u8> {
        let d = &*self.dev;
        let n = data.len() / dt.size();
        let src = self.upload(data, 0);
        let cap = compress::max_compressed_len(dt, n, p).unwrap();
        let out = d.alloc(cap).unwrap();
        let words = d.alloc(64).unwrap();
        let ws = d.alloc(64).unwrap();
        let o = fused::DrcOut { out, cap, out_len: words, total: n, params: *p };
        fused::drc_begin_async(d, self.s, dt, &o).unwrap();
        for v0 in (0..n).step_by(chunk) {
            let len = chunk.min(n - v0);
            let at = src.add(v0 * dt.size());
            fused::decompress_reduce_compress_async(d, self.s, dt, &[], at, 0, at, len, RedOp::Sum, DevPtr(0), &o, v0, (ws, 64)).unwrap();
        }
        d.synchronize(self.s).unwrap();
        let len = u64::from_le_bytes(self.download(words, 8).try_into().unwrap()) as usize;
        let got = self.download(out, len.min(cap));
        for x in [src, out, words, ws] {
            d.free(x).unwrap();
        }
        got
    }
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_every_dtype_op_and_position() {
    every_dtype_op_and_position(&gpu(), &[1, 31, 1000, 0, 16385, 40000, 40 * 16384 + 5]);
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_alignments_in_place_tiers_and_eight_streams() {
    alignments_in_place_tiers_and_eight_streams(&gpu(), 9 * 16384 + 101);
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_real_fixtures() {
    real_fixtures(&gpu(), usize::MAX);
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_stream_across_launches() {
    stream_across_launches(&gpu());
}

#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_corrupt_inputs_reported() {
    corrupt_inputs_reported(&gpu());
}

/// The argument checks of the launcher (no kernel runs for a refused call).
#[test]
#[ignore = "needs a GPU: run with --ignored"]
fn cuda_argument_errors() {
    let g = gpu();
    let d = &*g.dev;
    let p = d.alloc(1 << 20).unwrap();
    let dt = Dtype::Bf16;
    let n = 40000;
    let cap = compress::max_compressed_len(dt, n, &Params::default()).unwrap();
    let o = fused::DrcOut { out: p, cap, out_len: p.add(cap), total: n, params: Params::default() };
    let ws = (p.add(cap + 64), 4096);
    let run = |ins: &[(DevPtr, usize)], local: DevPtr, dst: DevPtr, first: usize, len: usize, o: &fused::DrcOut| {
        fused::decompress_reduce_compress_async(d, g.s, dt, ins, local, 0, dst, len, RedOp::Sum, p.add(cap + 8), o, first, ws)
    };
    let x = p.add(600 << 10);
    assert!(run(&[(p, 64); 9], x, x, 0, n, &o).is_err(), "9 inputs");
    assert!(run(&[], x, x.add(64), 0, n, &o).is_err(), "no inputs with dst other than local");
    assert!(run(&[(p, 64)], x, x, 100, 1000, &o).is_err(), "a range not on a block boundary");
    assert!(run(&[(p, 64)], x, x, 32768, 16384, &o).is_err(), "a range past the output");
    assert!(run(&[(p, 64)], x, x, 0, n, &fused::DrcOut { cap: cap - 1, ..o }).is_err(), "a short output");
    assert!(run(&[(p, 64)], x, x, 0, n, &fused::DrcOut { params: Params { block: 32768, tiers: 2 }, ..o }).is_err(), "a block past 32 KiB");
    assert!(fused::decompress_reduce_compress_async(d, g.s, dt, &[(p, 64)], x, 0, x, n, RedOp::Sum, p, &o, 0, (ws.0, 8)).is_err(), "a short workspace");
    d.synchronize(g.s).unwrap();
    d.free(p).unwrap();
}
