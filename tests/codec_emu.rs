//! The CUDA kernels (cuda/bfx.cu, cuda/bfx_decode.cu) run under the CPU emulator (cuda/bfx_emu.hpp), launched
//! as gpu.rs launches them: the shared test bodies, "GPU bytes == CPU bytes", and the
//! decoder's verdicts on mutated streams, all without a GPU. The emulator is built here
//! with the system C++ compiler (`CXX`, default `c++`), which the crate's build needs anyway.
mod codec_common;
use codec_common::*;
use hoccl::compress::{self, gpu, Dtype, Params};
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::OnceLock;

fn emulator() -> &'static PathBuf {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| build_emulator("bfx_emu", &["-g"]))
}

/// The kernels under the emulator; `shift` misaligns the value buffers, `ctas` is the
/// decoder's grid (fewer CTAs than blocks exercises the contiguous ranges).
struct Emu {
    shift: usize,
    ctas: u32,
    /// Nonzero: the wave of the decoder grid's tail (gpu.rs decode_grid): the last 2·wave
    /// CTAs take 2 blocks, then 1, of a stream of the default block size.
    wave: u32,
    /// Nonzero: BFX_EMU_SCHED, a shuffled order of CTAs and of threads between collectives.
    sched: u64,
    /// The compressor takes blocks by atomic tickets (HOCCL_CODEC_TICKETS=1; BFX_EMU_TICKETS),
    /// its CTAs then in any order; else by CTA index, its CTAs in index order.
    tickets: bool,
}

fn tmp(tag: &str) -> PathBuf {
    static N: AtomicUsize = AtomicUsize::new(0);
    let i = N.fetch_add(1, Ordering::Relaxed);
    PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("emu-{}-{i}-{tag}", std::process::id()))
}

fn run(args: &[String]) -> Result<String, String> {
    run_sched(args, 0, false)
}

fn run_sched(args: &[String], sched: u64, tickets: bool) -> Result<String, String> {
    let mut cmd = Command::new(emulator());
    if sched != 0 {
        cmd.env("BFX_EMU_SCHED", sched.to_string());
    }
    if tickets {
        cmd.env("BFX_EMU_TICKETS", "1");
    }
    let out = cmd.args(args).output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("emulator {args:?} failed: {}", String::from_utf8_lossy(&out.stderr)));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

impl Codec for Emu {
    fn name(&self) -> String {
        format!(
            "emulated kernels (shift {}, {} CTAs, tail wave {}, schedule {}, tickets {})",
            self.shift, self.ctas, self.wave, self.sched, self.tickets
        )
    }

    fn compress(&self, dt: Dtype, data: &[u8], p: &Params) -> Result<Vec<u8>, String> {
        let b = p.check("emu", dt).map_err(|e| e.to_string())?;
        let (i, o) = (tmp("in"), tmp("out"));
        std::fs::write(&i, data).map_err(|e| e.to_string())?;
        let shift = (self.shift * dt.size()).to_string();
        let a = [
            "compress",
            dt.name(),
            &b.to_string(),
            &p.tiers.to_string(),
            &i.to_string_lossy(),
            &o.to_string_lossy(),
            &shift,
        ];
        let r = run_sched(&a.map(String::from), self.sched, self.tickets).and_then(|_| std::fs::read(&o).map_err(|e| e.to_string()));
        let _ = (std::fs::remove_file(&i), std::fs::remove_file(&o));
        r
    }

    fn decompress(&self, dt: Dtype, stream: &[u8], n: usize) -> Result<Vec<u8>, String> {
        let (i, o) = (tmp("s"), tmp("v"));
        std::fs::write(&i, stream).map_err(|e| e.to_string())?;
        let shift = (self.shift * dt.size()).to_string();
        let a = [
            "decompress",
            dt.name(),
            &n.to_string(),
            &i.to_string_lossy(),
            &o.to_string_lossy(),
            &self.ctas.to_string(),
            &shift,
            &self.wave.to_string(),
        ];
        let r = run_sched(&a.map(String::from), self.sched, false).and_then(|out| {
            let w: u32 =
                out.trim().strip_prefix("status ").and_then(|s| s.parse().ok()).ok_or(format!("bad output {out}"))?;
            compress::status_result(w).map_err(|e| e.to_string())?;
            std::fs::read(&o).map_err(|e| e.to_string())
        });
        let _ = (std::fs::remove_file(&i), std::fs::remove_file(&o));
        r
    }

    fn max_block(&self, dt: Dtype) -> u32 {
        gpu::max_gpu_block(dt)
    }

    fn large(&self) -> usize {
        300_000
    }
}

const EMU: Emu = Emu { shift: 0, ctas: 3, wave: 0, sched: 0, tickets: false };

#[test]
fn emu_same_bytes_as_cpu() {
    same_bytes_as_cpu(&EMU);
    same_bytes_as_cpu(&Emu { shift: 1, ctas: 1, wave: 0, sched: 0, tickets: false });
}

#[test]
fn emu_all_16bit_patterns() {
    all_16bit_patterns(&EMU);
}

#[test]
fn emu_f32_specials() {
    f32_specials(&Emu { shift: 1, ctas: 2, wave: 0, sched: 0, tickets: false });
}

#[test]
fn emu_sizes() {
    sizes(&EMU);
    sizes(&Emu { shift: 1, ctas: 64, wave: 0, sched: 0, tickets: false });
}

#[test]
fn emu_block_sizes_and_distributions() {
    block_sizes(&EMU);
    distributions(&EMU);
    incompressible(&EMU);
}

#[test]
fn emu_real_data() {
    real_data(&EMU);
}

#[test]
fn emu_decodes_cpu_streams() {
    decodes_cpu_streams(&Emu { shift: 0, ctas: 5, wave: 0, sched: 0, tickets: false });
}

/// The kernels with CTAs and threads resumed in shuffled orders (BFX_EMU_SCHED): a thread
/// may run a whole phase before or after any other, which exposes shared memory read in one
/// phase and overwritten in a later one without a barrier between. The decoder at the
/// GPU's grid for these sizes (one CTA per tile, most with nothing to do) and at a few CTAs.
#[test]
fn emu_shuffled_schedules() {
    for (sched, ctas) in [(1u64, 192u32), (2, 3), (3, 1)] {
        let c = Emu { shift: 0, ctas, wave: 0, sched, tickets: false };
        real_data(&c);
        distributions(&c);
    }
    decodes_cpu_streams(&Emu { shift: 1, ctas: 5, wave: 0, sched: 4, tickets: false });
}

/// The compressor taking blocks by atomic tickets (HOCCL_CODEC_TICKETS=1), with its CTAs
/// run in shuffled orders: a CTA's predecessors are always the CTAs that took earlier
/// tickets, whatever order the CTAs start in.
#[test]
fn emu_compressor_tickets() {
    for sched in [0u64, 7, 8] {
        let c = Emu { shift: 0, ctas: 3, wave: 0, sched, tickets: true };
        real_data(&c);
        distributions(&c);
    }
}

/// The decoder's grid with a tail of small CTAs (gpu.rs decode_grid): waves of 2 and 3 CTAs,
/// so that streams of 9 or 13 and more default-size blocks (the large sizes, the real data)
/// take the tail, and the smaller ones the even ranges; also in shuffled schedules.
#[test]
fn emu_decoder_grid_tail() {
    for (wave, head, sched) in [(2u32, 3u32, 0u64), (3, 4, 5), (2, 1, 6)] {
        let c = Emu { shift: 0, ctas: head + 2 * wave, wave, sched, tickets: false };
        sizes(&c);
        real_data(&c);
        distributions(&c);
    }
}

/// Wrong sizes in the block table: rejected like the CPU reference does, and no fault (the
/// emulator checks the alignment of every asynchronous copy).
#[test]
fn emu_rejects_bad_block_sizes() {
    let bad = bad_block_sizes(&EMU);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Garbage block headers: rejected (or decoded) as the CPU reference does, and no fault.
#[test]
fn emu_rejects_bad_block_headers() {
    let bad = bad_block_headers(&EMU);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// fp16 table and raw exponent bytes out of range (>= 32) are rejected as the CPU rejects them.
#[test]
fn emu_rejects_bad_f16_exponents() {
    let bad = bad_f16_exponents(&EMU);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Codes past a group's end (planes1's last group, planes2's past n_esc1) are ignored.
#[test]
fn emu_ignores_padding_codes() {
    let bad = padding_codes_ignored(&EMU);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Mutated streams (bit flips, truncations, random header words): the emulated decoder and
/// the CPU reference agree on what is valid, and on the values when it is.
#[test]
fn emu_decoder_agrees_on_mutated_streams() {
    let mut r = Rng(2024);
    let mut bad = Vec::new();
    for case in 0..200 {
        let dt = Dtype::ALL[case % 3];
        let n = 1 + r.below(9000) as usize;
        let p = Params { block: [32, 96, 2048, 0][r.below(4) as usize], tiers: 1 + (case % 2) as u8 };
        let good = compress::compress(dt, &normal_values(dt, n, 0.05, r.next()), &p).unwrap();
        let mut s = good.clone();
        match r.below(4) {
            0 => {
                for _ in 0..1 + r.below(3) {
                    let bit = r.below(8 * s.len() as u64) as usize;
                    s[bit / 8] ^= 1 << (bit % 8);
                }
            }
            1 => s.truncate(r.below(s.len() as u64) as usize),
            2 => {
                let off = 4 * r.below(s.len().min(256) as u64 / 4) as usize;
                let v = [0, 1, 0xffff_ffff, r.next() as u32, 1 << r.below(32)][r.below(5) as usize];
                s[off..off + 4].copy_from_slice(&v.to_le_bytes());
            }
            _ => {
                let off = r.below(s.len() as u64) as usize;
                s[off] = r.next() as u8;
            }
        }
        check_corrupt(&EMU, dt, n, &s, &format!("case {case} {p:?}"), &mut bad);
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The decoupled look-back summing predecessors that published only their own size, over
/// windows of 32, and waiting (spinning) for predecessors that publish late.
#[test]
fn emu_lookback_sums_partial_aggregates() {
    let out = run(&["lookback", "400", "12345"].map(String::from)).unwrap();
    assert_eq!(out.trim(), "lookback ok 400");
}
