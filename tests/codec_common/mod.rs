//! Test bodies shared by every codec implementation: the CPU reference (tests/codec_cpu.rs),
//! the CUDA kernels on a GPU (tests/codec_cuda.rs, ignored without one) and the same kernels
//! under the CPU emulator (tests/codec_emu.rs). A body takes a `&dyn Codec` and checks
//! counts of wrong values instead of stopping at the first.
#![allow(dead_code)]
use hoccl::compress::{self, format, Dtype, Params};

pub mod device;

/// A compressor/decompressor pair under test.
pub trait Codec {
    fn name(&self) -> String;
    fn compress(&self, dt: Dtype, data: &[u8], p: &Params) -> Result<Vec<u8>, String>;
    /// Decode `stream`, which must hold `n` values of `dt`.
    fn decompress(&self, dt: Dtype, stream: &[u8], n: usize) -> Result<Vec<u8>, String>;
    /// The largest block this encoder takes.
    fn max_block(&self, dt: Dtype) -> u32 {
        let _ = dt;
        format::MAX_BLOCK
    }
    /// How many values a "large" input has for this implementation.
    fn large(&self) -> usize {
        3 << 20
    }
}

/// The CPU reference through the public host API.
pub struct Cpu;

impl Codec for Cpu {
    fn name(&self) -> String {
        "cpu".into()
    }
    fn compress(&self, dt: Dtype, data: &[u8], p: &Params) -> Result<Vec<u8>, String> {
        compress::compress(dt, data, p).map_err(|e| e.to_string())
    }
    fn decompress(&self, dt: Dtype, stream: &[u8], n: usize) -> Result<Vec<u8>, String> {
        let h = compress::cpu::peek(stream).map_err(|e| e.to_string())?;
        if h.dtype != dt || h.n != n as u64 {
            return Err(format!("stream holds {} {}, expected {n} {}", h.n, h.dtype.name(), dt.name()));
        }
        compress::decompress(stream).map_err(|e| e.to_string())
    }
}

/// The CUDA kernels under the CPU emulator (`cuda/bfx_emu_main.cpp`), built with the system
/// C++ compiler (`CXX`, default `c++`) into the test's temporary folder as `name`, with the
/// `extra` flags.
pub fn build_emulator(name: &str, extra: &[&str]) -> std::path::PathBuf {
    let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let bin = std::path::PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(name);
    let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
    let out = std::process::Command::new(&cxx)
        .args(["-std=c++17", "-O2", "-Wall", "-Wno-unknown-pragmas", "-Wno-unused-function"])
        .args(extra)
        .arg("-I")
        .arg(root.join("cuda"))
        .arg("-o")
        .arg(&bin)
        .arg(root.join("cuda/bfx_emu_main.cpp"))
        .output()
        .unwrap_or_else(|e| panic!("cannot run the C++ compiler `{cxx}`: {e}"));
    assert!(out.status.success(), "building the emulator failed:\n{}", String::from_utf8_lossy(&out.stderr));
    bin
}

// ---------------------------------------------------------------- data --------------------

#[path = "../common/rng.rs"]
mod rng;
pub use rng::Rng;

/// fp32 → bf16, round to nearest even (NaN stays NaN).
pub fn bf16_of(x: f32) -> u16 {
    let u = x.to_bits();
    if x.is_nan() {
        return ((u >> 16) | 0x40) as u16;
    }
    ((u + 0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

/// fp32 → fp16, round to nearest even (enough for test data: no NaN payload care).
pub fn f16_of(x: f32) -> u16 {
    let u = x.to_bits();
    let sign = ((u >> 16) & 0x8000) as u16;
    let e = ((u >> 23) & 0xff) as i32 - 127 + 15;
    let m = u & 0x7f_ffff;
    if ((u >> 23) & 0xff) == 0xff {
        return sign | 0x7c00 | if m != 0 { 0x200 } else { 0 };
    }
    if e >= 31 {
        return sign | 0x7c00;
    }
    if e <= 0 {
        if e < -10 {
            return sign;
        }
        let m = m | 0x80_0000;
        let shift = (14 - e) as u32;
        let half = 1u32 << (shift - 1);
        let r = (m + half - 1 + ((m >> shift) & 1)) >> shift;
        return sign | r as u16;
    }
    let r = ((e as u32) << 10 | (m >> 13)) + (((m & 0x1fff) + 0xfff + ((m >> 13) & 1)) >> 13);
    sign | r as u16
}

/// `n` values of `dt` drawn like trained data: normal with std `std`, as raw bytes.
pub fn normal_values(dt: Dtype, n: usize, std: f64, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed);
    let mut out = Vec::with_capacity(n * dt.size());
    for _ in 0..n {
        let x = (r.normal() * std) as f32;
        match dt {
            Dtype::Bf16 => out.extend_from_slice(&bf16_of(x).to_le_bytes()),
            Dtype::F16 => out.extend_from_slice(&f16_of(x).to_le_bytes()),
            Dtype::F32 => out.extend_from_slice(&x.to_le_bytes()),
        }
    }
    out
}

/// The committed real-data fixtures: (file, class, dtype, bytes), from `HOCCL_TEST_DATA`
/// (for test binaries run away from their checkout) or the crate's `tests/data`.
pub fn fixtures() -> Vec<(String, String, Dtype, Vec<u8>)> {
    let dir = std::env::var_os("HOCCL_TEST_DATA")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data"));
    let manifest = std::fs::read_to_string(dir.join("minilm-manifest.txt"))
        .unwrap_or_else(|e| panic!("{}: {e} (set HOCCL_TEST_DATA to the fixtures' folder)", dir.display()));
    manifest
        .lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .map(|l| {
            let mut f = l.split_whitespace();
            let (file, class) = (f.next().unwrap().to_string(), f.next().unwrap().to_string());
            let dt = Dtype::parse(file.rsplit('.').next().unwrap()).expect("fixture extension names a dtype");
            let data = std::fs::read(dir.join(&file)).unwrap_or_else(|e| panic!("{file}: {e}"));
            (file, class, dt, data)
        })
        .collect()
}

// ---------------------------------------------------------------- bodies ------------------

/// Compress and decompress; panics with the case name unless bit-exact. Returns the stream.
pub fn round_trip(c: &dyn Codec, dt: Dtype, data: &[u8], p: &Params, case: &str) -> Vec<u8> {
    let n = data.len() / dt.size();
    let s = c.compress(dt, data, p).unwrap_or_else(|e| panic!("{}: {case}: compress: {e}", c.name()));
    let back = c.decompress(dt, &s, n).unwrap_or_else(|e| panic!("{}: {case}: decompress: {e}", c.name()));
    assert_eq!(back.len(), data.len(), "{}: {case}: length", c.name());
    let bad = back.chunks(dt.size()).zip(data.chunks(dt.size())).filter(|(a, b)| a != b).count();
    assert_eq!(bad, 0, "{}: {case}: {bad} of {n} values differ", c.name());
    s
}

/// Every one of the 65,536 bf16 (and fp16) bit patterns, in order and shuffled, with the
/// default block and with 32-value blocks.
pub fn all_16bit_patterns(c: &dyn Codec) {
    let mut all: Vec<u16> = (0..=u16::MAX).collect();
    let ordered: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
    let mut r = Rng(7);
    for i in (1..all.len()).rev() {
        all.swap(i, r.below(i as u64 + 1) as usize);
    }
    let shuffled: Vec<u8> = all.iter().flat_map(|v| v.to_le_bytes()).collect();
    for dt in [Dtype::Bf16, Dtype::F16] {
        for (what, data) in [("ordered", &ordered), ("shuffled", &shuffled)] {
            for block in [0, 32, 4096] {
                for tiers in [1, 2] {
                    let p = Params { block, tiers };
                    round_trip(c, dt, data, &p, &format!("all {} patterns {what} B={block} tiers={tiers}", dt.name()));
                }
            }
        }
    }
}

/// fp32 special values and random bit patterns (NaN payloads, ±inf, ±0, subnormals).
pub fn f32_specials(c: &dyn Codec) {
    let mut v: Vec<u32> =
        vec![0, 0x8000_0000, 0x7f80_0000, 0xff80_0000, 0x7fc0_0000, 0x7f80_0001, 0xffff_ffff, 1, 0x807f_ffff];
    let mut r = Rng(11);
    v.extend((0..40_000).map(|_| r.next() as u32));
    v.extend((0..40_000).map(|i| {
        if i % 3 == 0 {
            r.next() as u32 & 0x807f_ffff
        } else {
            (r.normal() as f32 * 1e-3).to_bits()
        }
    }));
    let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
    for tiers in [1, 2] {
        round_trip(c, Dtype::F32, &data, &Params { block: 0, tiers }, &format!("f32 specials tiers={tiers}"));
    }
}

/// Sizes 0, 1, 31, 33, B±1, B, 5B+77 and a large input, for every dtype.
pub fn sizes(c: &dyn Codec) {
    for dt in Dtype::ALL {
        let b = dt.default_block() as usize;
        for n in [0, 1, 2, 7, 8, 9, 31, 32, 33, 255, 2047, 2048, 2049, b - 1, b, b + 1, 5 * b + 77, c.large() + 3] {
            let data = normal_values(dt, n, 0.02, n as u64 ^ 0x5eed);
            let s = round_trip(c, dt, &data, &Params::default(), &format!("{} n={n}", dt.name()));
            if n > 0 && n >= b {
                assert!(s.len() < data.len(), "{}: {} n={n}: normal data did not compress", c.name(), dt.name());
            }
        }
    }
}

/// Block sizes from the smallest to the encoder's largest, odd counts of blocks.
pub fn block_sizes(c: &dyn Codec) {
    for dt in Dtype::ALL {
        for b in [32u32, 64, 96, 160, 2048, 2080, 4096, 8192, 16384, 65536] {
            if b > c.max_block(dt) {
                continue;
            }
            let n = 3 * b as usize + 17;
            let data = normal_values(dt, n, 1.0, b as u64);
            round_trip(c, dt, &data, &Params { block: b, tiers: 2 }, &format!("{} B={b}", dt.name()));
        }
    }
}

/// Random bits: never larger than the input plus headers (24 + 12 per block, and the last
/// block's padding to 4 bytes).
pub fn incompressible(c: &dyn Codec) {
    for dt in Dtype::ALL {
        let n = 3 * dt.default_block() as usize + 5;
        let data = Rng(99).bytes(n * dt.size());
        let s = round_trip(c, dt, &data, &Params::default(), &format!("{} random bits", dt.name()));
        let nblocks = n.div_ceil(dt.default_block() as usize);
        assert!(
            s.len() <= data.len() + 24 + 12 * nblocks + 3,
            "{}: {} random: {} > bound",
            c.name(),
            dt.name(),
            s.len()
        );
    }
    // Raw blocks between coded ones, so that a raw block's values start at every 4-byte
    // offset modulo 16 of the stream (the device compressor copies them out in aligned
    // 16-byte units and the first and last units word by word).
    for dt in Dtype::ALL {
        let b = dt.default_block() as usize;
        let mut data = Vec::new();
        for k in 0..16u64 {
            if k % 2 == 0 {
                data.extend(normal_values(dt, b + 32 * k as usize, 0.01 * (1 + k) as f64, k));
            } else {
                data.extend(Rng(100 + k).bytes(b * dt.size()));
            }
        }
        data.truncate(data.len() / dt.size() * dt.size());
        // both tier modes: the one-tier bf16 compressor stages a raw block in two passes
        for tiers in [1u8, 2] {
            let (p, case) = (Params { block: 0, tiers }, format!("{} coded and raw blocks, tiers={tiers}", dt.name()));
            let s = round_trip(c, dt, &data, &p, &case);
            assert!(
                s == compress::compress(dt, &data, &p).unwrap(),
                "{}: {case}: bytes differ from the CPU encoder's",
                c.name()
            );
            let (_, blocks) = compress::inspect(&s).unwrap();
            let (mut off, mut seen) = (24 + 4 * blocks.len(), [false; 4]);
            for bl in &blocks {
                if bl.header.is_raw() {
                    seen[(off + 8) % 16 / 4] = true;
                }
                off += bl.bytes;
            }
            assert!(seen.iter().all(|&x| x), "{case}: raw blocks' values at offsets {seen:?} modulo 16 only");
        }
    }
}

/// Edge distributions: one exponent only, two, all 256 equally, zeros, alternating.
pub fn distributions(c: &dyn Codec) {
    let n = 40_000;
    let mut r = Rng(5);
    let cases: Vec<(&str, Vec<u16>)> = vec![
        ("zeros", vec![0; n]),
        ("one exponent", (0..n).map(|_| 0x3f80 | (r.next() as u16 & 0x807f)).collect()),
        (
            "two exponents",
            (0..n).map(|i| if i % 2 == 0 { 0x3f80 } else { 0x4000 } | (r.next() as u16 & 0x7f)).collect(),
        ),
        ("uniform exponents", (0..n).map(|_| r.next() as u16).collect()),
        (
            "rare outliers",
            (0..n)
                .map(|i| if i % 1000 == 0 { 0x7f00 | i as u16 & 0x7f } else { 0x3c00 | (r.next() as u16 & 0x81ff) })
                .collect(),
        ),
        ("32 exponents", (0..n).map(|_| ((100 + r.below(32) as u16) << 7) | (r.next() as u16 & 0x807f)).collect()),
    ];
    for (what, v) in cases {
        let data: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        for tiers in [1, 2] {
            round_trip(c, Dtype::Bf16, &data, &Params { block: 0, tiers }, &format!("bf16 {what} tiers={tiers}"));
        }
    }
}

/// Every fixture in both tier modes. Returns (file, class, one-tier ratio, two-tier ratio).
pub fn real_data(c: &dyn Codec) -> Vec<(String, String, f64, f64)> {
    let mut out = Vec::new();
    for (file, class, dt, data) in fixtures() {
        let s1 = round_trip(c, dt, &data, &Params { block: 0, tiers: 1 }, &format!("{file} one tier"));
        let s2 = round_trip(c, dt, &data, &Params { block: 0, tiers: 2 }, &format!("{file} two tiers"));
        out.push((file, class, s1.len() as f64 / data.len() as f64, s2.len() as f64 / data.len() as f64));
    }
    out
}

/// Round trips of large inputs one after another, each in freshly allocated buffers, each
/// with different data. A device whose host-to-device copy returns before the bytes land
/// (pageable memory: the DMA finishes on the legacy stream, which a non-blocking stream does
/// not wait for) lets a kernel read the previous round's bytes at the reused address: whole
/// blocks come back as the previous input. This caught the one-tier `cuda_real_data` failure
/// (5 whole blocks of 24 wrong, status 0) that the emulator could not show.
pub fn back_to_back_fresh_buffers(c: &dyn Codec) {
    for round in 0..6u64 {
        let dt = Dtype::ALL[round as usize % 3];
        let n = c.large() + 1000 * round as usize;
        let data = normal_values(dt, n, 0.02 + round as f64, 0xb2b ^ round);
        let tiers = 1 + (round % 2) as u8;
        round_trip(c, dt, &data, &Params { block: 0, tiers }, &format!("{} round {round} n={n}", dt.name()));
    }
}

/// The implementation's bytes equal the CPU reference's, for the same input and block.
pub fn same_bytes_as_cpu(c: &dyn Codec) {
    let mut inputs: Vec<(String, Dtype, Vec<u8>, Params)> = Vec::new();
    for (file, _, dt, data) in fixtures() {
        inputs.push((file.clone(), dt, data.clone(), Params { block: 0, tiers: 2 }));
        inputs.push((format!("{file} one tier"), dt, data, Params { block: 0, tiers: 1 }));
    }
    for dt in Dtype::ALL {
        for (n, b) in [(1usize, 0u32), (33, 0), (100_003, 0), (5000, 32), (70_000, 2048), (9000, 4096)] {
            inputs.push((
                format!("{} normal n={n} B={b}", dt.name()),
                dt,
                normal_values(dt, n, 0.5, n as u64),
                Params { block: b, tiers: 2 },
            ));
        }
        inputs.push((format!("{} random bits", dt.name()), dt, Rng(3).bytes(20_000 * dt.size()), Params::default()));
    }
    let mut differing = Vec::new();
    for (what, dt, data, p) in &inputs {
        if p.block_for(*dt) > c.max_block(*dt) {
            continue;
        }
        let mine = c.compress(*dt, data, p).unwrap_or_else(|e| panic!("{}: {what}: {e}", c.name()));
        let cpu = compress::compress(*dt, data, p).unwrap();
        if mine != cpu {
            let first = mine.iter().zip(&cpu).position(|(a, b)| a != b).unwrap_or(mine.len().min(cpu.len()));
            differing.push(format!("{what}: {} vs {} bytes, first difference at {first}", mine.len(), cpu.len()));
        }
    }
    assert!(differing.is_empty(), "{}: bytes differ from the CPU reference:\n{}", c.name(), differing.join("\n"));
}

/// Streams of the CPU encoder with any legal block size decode on this implementation.
pub fn decodes_cpu_streams(c: &dyn Codec) {
    for dt in Dtype::ALL {
        for b in [32u32, 96, 2048, 2080, 16384, 40_000 * 32 / 32 + 32, 1 << 20] {
            let b = b / 32 * 32;
            let n = 2 * b as usize + 1000;
            let data = normal_values(dt, n.min(3_000_000), 0.1, b as u64 + 1);
            let s = compress::compress(dt, &data, &Params { block: b, tiers: 2 }).unwrap();
            let back = c
                .decompress(dt, &s, data.len() / dt.size())
                .unwrap_or_else(|e| panic!("{}: {} B={b}: {e}", c.name(), dt.name()));
            assert!(back == data, "{}: {} B={b}: CPU stream decoded wrong", c.name(), dt.name());
        }
    }
}

/// How a decoder under test that ran but failed says so (the emulator's process failing:
/// a deadlock, a misaligned copy): such an error is a fault, not a rejection.
pub const FAULT_PREFIX: &str = "emulator ";

/// The decoder under test agrees with the CPU reference on a (possibly corrupt) stream: the
/// same values, or both reject it, the tested one without a fault.
pub fn agrees<E>(cpu: &Result<Vec<u8>, E>, got: &Result<Vec<u8>, String>) -> bool {
    match (cpu, got) {
        (Ok(a), Ok(b)) => a == b,
        (Err(_), Err(e)) => !e.starts_with(FAULT_PREFIX),
        _ => false,
    }
}

/// One corrupt stream `s` (of `n` values): a line in `bad` unless the decoder under test
/// agrees with the CPU reference.
pub fn check_corrupt(c: &dyn Codec, dt: Dtype, n: usize, s: &[u8], what: &str, bad: &mut Vec<String>) {
    let cpu = compress::gpu::host_decode(s, dt, n);
    let got = c.decompress(dt, s, n);
    if !agrees(&cpu, &got) {
        bad.push(format!("{} n={n} {what}: cpu {:?} {}: {:?}", dt.name(), cpu.map(|_| ()), c.name(), got.map(|_| ())));
    }
}

/// Wrong sizes in the stream's block table, every block in turn: not a multiple of 4, one
/// word off, zero, huge. The decoder must agree with the CPU reference (which rejects them)
/// and report, not fault. Returns the disagreements.
pub fn bad_block_sizes(c: &dyn Codec) -> Vec<String> {
    let mut bad = Vec::new();
    for (dt, n, block) in [(Dtype::Bf16, 40_000, 0u32), (Dtype::Bf16, 5000, 1024), (Dtype::F16, 3000, 512), (Dtype::F32, 3000, 512)] {
        let data = normal_values(dt, n, 0.02, 9);
        let good = compress::compress(dt, &data, &Params { block, tiers: 2 }).unwrap();
        let word = |s: &[u8], at: usize| u32::from_le_bytes(s[at..at + 4].try_into().unwrap());
        let nblocks = word(&good, 20) as usize;
        for j in 0..nblocks {
            let at = 24 + 4 * j;
            let size = word(&good, at);
            for v in [size + 1, size + 2, size + 3, size - 1, size + 4, size - 4, 0, 1, 0xffff_fffd, u32::MAX] {
                let mut s = good.clone();
                s[at..at + 4].copy_from_slice(&v.to_le_bytes());
                check_corrupt(c, dt, n, &s, &format!("block {j} size {size} -> {v}"), &mut bad);
            }
        }
    }
    bad
}

/// Garbage in every block's header words in turn (widths, counts, reserved bits, all ones):
/// the decoder must agree with the CPU reference and report, not fault. Returns the
/// disagreements.
pub fn bad_block_headers(c: &dyn Codec) -> Vec<String> {
    let mut bad = Vec::new();
    for (dt, n, block, tiers) in [(Dtype::Bf16, 40_000, 0u32, 2u8), (Dtype::Bf16, 5000, 1024, 1), (Dtype::F16, 3000, 512, 2), (Dtype::F32, 3000, 512, 2)] {
        let data = normal_values(dt, n, 0.02, 5);
        let good = compress::compress(dt, &data, &Params { block, tiers }).unwrap();
        let word = |s: &[u8], at: usize| u32::from_le_bytes(s[at..at + 4].try_into().unwrap());
        for BlockAt { j, at, .. } in blocks_of(&good, n) {
            let (w0, w1) = (word(&good, at), word(&good, at + 4));
            let cases = [
                (0, 0),
                (u32::MAX, w1),
                (w0, u32::MAX),
                (w0 ^ 7, w1),                 // k1
                (w0 ^ (7 << 3), w1),          // k2
                (w0 | 0xc0, w1),              // reserved bits
                (w0.wrapping_add(1 << 8), w1), // n_raw + 1
                (w0.wrapping_sub(1 << 8), w1), // n_raw - 1
                (w0, w1.wrapping_add(1)),      // n_esc1 + 1
                (w0, w1.wrapping_sub(1)),      // n_esc1 - 1
                (w0, w1 | 1 << 24),            // above n_esc1's bits
            ];
            for (x0, x1) in cases {
                let mut s = good.clone();
                s[at..at + 4].copy_from_slice(&x0.to_le_bytes());
                s[at + 4..at + 8].copy_from_slice(&x1.to_le_bytes());
                let what = format!("block {j} header {w0:#x} {w1:#x} -> {x0:#x} {x1:#x}");
                check_corrupt(c, dt, n, &s, &what, &mut bad);
            }
        }
    }
    bad
}

/// A block of a stream as the test bodies that corrupt sections need it: where it starts,
/// its values, its header fields and (coded blocks, k1 > 0) where its sections start.
pub struct BlockAt {
    pub j: usize,
    pub at: usize,
    pub nb: usize,
    pub k1: usize,
    pub k2: usize,
    pub n_raw: usize,
    pub n_esc1: usize,
    /// table entries (T1 + T2)
    pub tt: usize,
    pub p1: usize,
    pub p2: usize,
    pub raw: usize,
}

/// Every block of the valid stream `s` (of `n` values), in order.
pub fn blocks_of(s: &[u8], n: usize) -> Vec<BlockAt> {
    let word = |at: usize| u32::from_le_bytes(s[at..at + 4].try_into().unwrap());
    let (b, nblocks) = (word(16) as usize, word(20) as usize);
    let mut at = 24 + 4 * nblocks;
    let mut out = Vec::with_capacity(nblocks);
    for j in 0..nblocks {
        let (w0, w1) = (word(at), word(at + 4));
        let nb = b.min(n - j * b);
        let (k1, k2) = ((w0 & 7) as usize, ((w0 >> 3) & 7) as usize);
        let (n_raw, n_esc1) = ((w0 >> 8) as usize, (w1 & 0xff_ffff) as usize);
        let tt = if k1 > 0 { ((1usize << k1) - 1) + if k2 > 0 { (1usize << k2) - 1 } else { 0 } } else { 0 };
        let p1 = at + 8 + ((tt + 3) & !3);
        let p2 = p1 + 4 * nb.div_ceil(32) * k1;
        let raw = p2 + 4 * n_esc1.div_ceil(32) * k2;
        out.push(BlockAt { j, at, nb, k1, k2, n_raw, n_esc1, tt, p1, p2, raw });
        at += word(24 + 4 * j) as usize;
    }
    out
}

/// fp16 exponents are 5 bits: a table byte or a raw exponent byte >= 32 in a coded block is
/// corrupt. Every block of tier-1 and tier-2 fp16 streams gets such a byte in turn (its first,
/// middle and last raw byte and table byte): the decoder must agree with the CPU reference
/// and report, not fault. Returns the disagreements; panics if no block had raws to corrupt.
pub fn bad_f16_exponents(c: &dyn Codec) -> Vec<String> {
    let mut bad = Vec::new();
    let mut raws_seen = 0;
    for (n, block, tiers) in [(20_000, 0u32, 1u8), (20_000, 0, 2), (3000, 512, 2), (3000, 512, 1)] {
        let data = normal_values(Dtype::F16, n, 0.5, 21);
        let good = compress::compress(Dtype::F16, &data, &Params { block, tiers }).unwrap();
        for k in blocks_of(&good, n).iter().filter(|k| k.k1 > 0) {
            let mut spots = vec![(k.at + 8, "table[0]"), (k.at + 8 + k.tt - 1, "table[last]")];
            if k.n_raw > 0 {
                raws_seen += 1;
                spots.extend([(k.raw, "raw[0]"), (k.raw + k.n_raw / 2, "raw[mid]"), (k.raw + k.n_raw - 1, "raw[last]")]);
            }
            for (pos, what) in spots {
                for v in [32u8, 0xff] {
                    let mut s = good.clone();
                    s[pos] = v;
                    check_corrupt(c, Dtype::F16, n, &s, &format!("tiers {tiers} block {} {what} = {v:#x}", k.j), &mut bad);
                }
            }
        }
    }
    assert!(raws_seen > 0, "no fp16 block with raw exponents: the test corrupts nothing there");
    bad
}

/// Codes past the end of a group that decoders must ignore, set to ones: planes2's codes
/// past `n_esc1` in its last group (every coded two-tier block with n_esc1 % 32 != 0) and
/// planes1's codes past the last partial group's values (the last block). A decoder that
/// reads them as raws or escapes decodes wrong values, or rejects the stream. Returns the
/// blocks decoded wrong or rejected; panics if no block had such codes to set.
pub fn padding_codes_ignored(c: &dyn Codec) -> Vec<String> {
    let mut bad = Vec::new();
    let (mut set2, mut set1) = (0, 0);
    for (dt, n, block, tiers) in [(Dtype::Bf16, 40_017, 0u32, 2u8), (Dtype::Bf16, 5005, 1024, 2), (Dtype::Bf16, 40_017, 0, 1), (Dtype::F16, 40_017, 0, 2), (Dtype::F32, 20_009, 0, 2)] {
        let data = normal_values(dt, n, if dt == Dtype::F16 { 0.5 } else { 0.02 }, 33);
        let mut s = compress::compress(dt, &data, &Params { block, tiers }).unwrap();
        let ones = |s: &mut Vec<u8>, at: usize, from_bit: usize| {
            let v = u32::from_le_bytes(s[at..at + 4].try_into().unwrap()) | (u32::MAX << from_bit);
            s[at..at + 4].copy_from_slice(&v.to_le_bytes());
        };
        for k in blocks_of(&s, n).iter().filter(|k| k.k1 > 0) {
            if k.nb % 32 != 0 {
                let g = k.nb / 32;
                (0..k.k1).for_each(|p| ones(&mut s, k.p1 + 4 * (g * k.k1 + p), k.nb % 32));
                set1 += 1;
            }
            if k.k2 > 0 && k.n_esc1 % 32 != 0 {
                let g = k.n_esc1 / 32;
                (0..k.k2).for_each(|p| ones(&mut s, k.p2 + 4 * (g * k.k2 + p), k.n_esc1 % 32));
                set2 += 1;
            }
        }
        match c.decompress(dt, &s, n) {
            Ok(v) if v == data => {}
            Ok(v) => {
                let wrong = v.chunks(dt.size()).zip(data.chunks(dt.size())).filter(|(a, b)| a != b).count();
                bad.push(format!("{} n={n} B={block} tiers {tiers}: {wrong} values wrong", dt.name()));
            }
            Err(e) => bad.push(format!("{} n={n} B={block} tiers {tiers}: rejected: {e}", dt.name())),
        }
    }
    assert!(set1 > 0 && set2 > 0, "no padding codes set ({set1} planes1, {set2} planes2): the test checks nothing");
    bad
}
