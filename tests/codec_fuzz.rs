//! Bounded fuzzing of the CPU decoder (and `inspect`): valid streams of every dtype, block
//! size and tier mode, mutated by bit flips, byte writes, truncation, extension, rewritten
//! header words and block-size entries, spliced blocks, and streams of random bytes behind
//! a valid header. The decoder must return an error or a buffer of exactly `n` values,
//! never panic. Seeded: a failure prints the case that reproduces it. Runs for at most
//! `HOCCL_FUZZ_SECS` seconds (default 20) or `HOCCL_FUZZ_CASES` cases (default 400000).
mod codec_common;
use codec_common::*;
use hoccl::compress::{self, format, Dtype, Params};
use std::time::{Duration, Instant};

fn env_or(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// A valid stream to mutate: `(dtype, values, stream)`.
fn seed_stream(r: &mut Rng) -> (Dtype, Vec<u8>, Vec<u8>) {
    let dt = Dtype::ALL[r.below(3) as usize];
    let n = match r.below(4) {
        0 => r.below(40) as usize,
        1 => r.below(400) as usize,
        _ => r.below(6000) as usize,
    };
    let data = match r.below(3) {
        0 => r.bytes(n * dt.size()),
        _ => normal_values(dt, n, [1e-3, 0.05, 3.0][r.below(3) as usize], r.next()),
    };
    let p = Params { block: [32, 64, 96, 256, 2048, 0][r.below(6) as usize], tiers: 1 + r.below(2) as u8 };
    let s = compress::compress(dt, &data, &p).unwrap();
    (dt, data, s)
}

fn put32(s: &mut [u8], off: usize, v: u32) {
    if off + 4 <= s.len() {
        s[off..off + 4].copy_from_slice(&v.to_le_bytes());
    }
}

fn interesting(r: &mut Rng) -> u32 {
    [0, 1, 2, 3, 4, 7, 8, 31, 32, 33, 0xff, 0x100, 0xffff, 0x00ff_ffff, 0x0100_0000, 0x7fff_ffff, 0xffff_ffff]
        [r.below(17) as usize]
        ^ if r.below(3) == 0 { r.next() as u32 } else { 0 }
}

/// Applies one random mutation; returns its name.
fn mutate(r: &mut Rng, s: &mut Vec<u8>) -> &'static str {
    let len = s.len().max(1) as u64;
    match r.below(9) {
        0 => {
            for _ in 0..1 + r.below(4) {
                let bit = r.below(8 * len) as usize;
                if bit / 8 < s.len() {
                    s[bit / 8] ^= 1 << (bit % 8);
                }
            }
            "bit flips"
        }
        1 => {
            let off = r.below(len) as usize;
            if off < s.len() {
                s[off] = r.next() as u8;
            }
            "byte write"
        }
        2 => {
            s.truncate(r.below(len) as usize);
            "truncation"
        }
        3 => {
            let k = 1 + r.below(64) as usize;
            let extra = r.bytes(k);
            s.extend_from_slice(&extra);
            "extension"
        }
        4 => {
            let off = 4 * r.below(6) as usize; // the fixed stream header
            let v = interesting(r);
            put32(s, off, v);
            "stream header word"
        }
        5 => {
            let nblocks = if s.len() >= 24 { format::rd32(s, 20) as u64 } else { 0 };
            let off = 24 + 4 * r.below(nblocks.clamp(1, 64)) as usize;
            let v = interesting(r);
            put32(s, off, v);
            "block size entry"
        }
        6 => {
            // A block header word: the first block starts after the block table.
            let nblocks = if s.len() >= 24 { format::rd32(s, 20).min(1 << 20) as usize } else { 0 };
            let off = 24 + 4 * nblocks + 4 * r.below(2) as usize;
            let v = interesting(r);
            put32(s, off, v);
            "block header word"
        }
        7 => {
            // Random bytes behind the valid header and block table.
            let keep = if s.len() >= 24 { (24 + 4 * format::rd32(s, 20) as usize).min(s.len()) } else { 0 };
            let tail = r.bytes(s.len() - keep);
            s[keep..].copy_from_slice(&tail);
            "random body"
        }
        _ => {
            // Copy one 4-byte-aligned span over another (splices sections and blocks).
            let a = 4 * r.below(len / 4 + 1) as usize;
            let b = 4 * r.below(len / 4 + 1) as usize;
            let n = (4 * r.below(16) as usize).min(s.len().saturating_sub(a.max(b)));
            let span = s[a..a + n].to_vec();
            s[b..b + n].copy_from_slice(&span);
            "splice"
        }
    }
}

fn check(case: u64, what: &str, s: &[u8]) {
    let result = std::panic::catch_unwind(|| {
        if let Ok(v) = compress::decompress(s) {
            let h = compress::cpu::peek(s).unwrap();
            assert_eq!(v.len() as u64, h.n * h.dtype.size() as u64, "decoded length");
        }
        let _ = compress::inspect(s);
    });
    if result.is_err() {
        panic!(
            "decoder panicked on fuzz case {case} ({what}); stream {} bytes: {:02x?}",
            s.len(),
            &s[..s.len().min(96)]
        );
    }
}

#[test]
fn fuzz_decoder_on_mutated_streams() {
    let secs = env_or("HOCCL_FUZZ_SECS", 20);
    let cases = env_or("HOCCL_FUZZ_CASES", 400_000);
    let seed = env_or("HOCCL_FUZZ_SEED", 0x00f0_22ed);
    let start = Instant::now();
    let (mut done, mut rejected) = (0u64, 0u64);
    let prev = std::panic::take_hook();
    std::panic::set_hook(Box::new(|_| {})); // reported by check() with the case number
    let mut r = Rng(seed);
    let mut base = seed_stream(&mut r);
    while done < cases && start.elapsed() < Duration::from_secs(secs) {
        if done % 64 == 0 {
            base = seed_stream(&mut r);
            // The unmutated stream decodes to its input.
            assert!(compress::decompress(&base.2).unwrap() == base.1, "valid {} stream", base.0.name());
        }
        let mut s = base.2.clone();
        let mut what = mutate(&mut r, &mut s);
        if r.below(4) == 0 {
            what = mutate(&mut r, &mut s);
        }
        rejected += u64::from(compress::decompress(&s).is_err());
        check(done, what, &s);
        done += 1;
    }
    std::panic::set_hook(prev);
    eprintln!("fuzz: {done} cases in {:?}, {rejected} rejected (seed {seed:#x})", start.elapsed());
    assert!(done >= 1000, "fuzzing ran only {done} cases");
    assert!(rejected > done / 2, "most mutations must be caught ({rejected} of {done})");
}

#[test]
fn fuzz_random_streams_behind_valid_magic() {
    let mut r = Rng(99);
    for case in 0..5000 {
        let dt = Dtype::ALL[r.below(3) as usize];
        let len = r.below(300) as usize + 24;
        let mut s = r.bytes(len);
        put32(&mut s, 0, dt.magic());
        put32(&mut s, 4, 1);
        if r.below(2) == 0 {
            put32(&mut s, 16, 32 * (1 + r.below(4) as u32));
            let n = r.below(200);
            s[8..16].copy_from_slice(&n.to_le_bytes());
            let b = format::rd32(&s, 16) as u64;
            put32(&mut s, 20, n.div_ceil(b) as u32);
        }
        check(case, "random stream", &s);
    }
}
