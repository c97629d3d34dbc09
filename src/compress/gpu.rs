//! Launchers of the CUDA codec kernels (`cuda/bfx.cu`, `cuda/bfx_decode.cu`) through `CudaDevice::launch`, and the
//! decoder's status words.
//!
//! **Compression** enqueues two kernels: `hoccl_bfx_compress_begin` zeroes the look-back
//! scratch (which lives in the output buffer past the stream's upper bound, so callers need
//! no workspace) and writes the fixed stream header; `hoccl_bfx_compress_<dtype>_<cpt>` runs
//! one CTA per block (256 threads; the kernel file publishes the count), single pass: each
//! CTA holds its block in registers (`cpt` = 16-byte chunks per thread at 256 threads, i.e.
//! the block in steps of 2048 values), chooses its table, learns its exact size, finds its
//! offset by decoupled look-back and writes straight into the contiguous `BFX1` stream.
//! **Decompression** enqueues `hoccl_bfx_decompress_begin` (status = 0) and
//! `hoccl_bfx_decompress_<dtype>`, whose CTAs decode contiguous ranges of blocks.
use super::format::{self, Dtype};
use super::Params;
use crate::device::cuda::CudaDevice;
use crate::device::{DevPtr, StreamHandle};
use crate::error::{Error, Result};
use std::ffi::c_void;

const THREADS: u32 = 256;
/// Values one CTA step covers (256 threads × 8 values).
const TILE: u32 = THREADS * 8;
/// The decoder publishes the dynamic shared memory a CTA needs in this module global.
const DECODE_SMEM_GLOBAL: &str = "hoccl_bfx_decode_smem";
/// Module global: threads per compressor CTA (the kernel file's choice).
const COMPRESS_THREADS_GLOBAL: &str = "hoccl_bfx_compress_threads";
/// Module global: the compressor's staggered start, its step in ns (0: none).
const COMPRESS_STAGGER_GLOBAL: &str = "hoccl_bfx_compress_stagger";
/// Compressor flag: take blocks by atomic tickets (`kEncTickets` in bfx.cu).
const ENC_TICKETS: u32 = 1 << 25;
/// Module global: threads per decoder CTA (the kernel file's choice).
pub(super) const DECODE_THREADS_GLOBAL: &str = "hoccl_bfx_decode_threads";
/// Module global: the most waves (CTAs that fit the SMs at once) in the decoder's grid.
pub(super) const DECODE_WAVES_GLOBAL: &str = "hoccl_bfx_decode_waves";
/// Module global: 1 when every codec kernel starts with `griddepcontrol.wait` (so it may be
/// launched as a programmatic dependent of the stream's previous kernel).
pub(super) const PDL_GLOBAL: &str = "hoccl_bfx_pdl";
/// Blocks per decoder CTA the grid aims at, beyond one wave (at the default block size).
const DECODE_BLOCKS_PER_CTA: u64 = 8;
/// Module global: nonzero when the decoder places its CTAs' ranges with a tail: the fewest
/// blocks per CTA before it (`decode_grid`).
pub(super) const DECODE_TAIL_GLOBAL: &str = "hoccl_bfx_decode_tail";

/// Largest block the GPU encoder takes (values): 8 chunks per thread (4 for fp32).
pub fn max_gpu_block(dtype: Dtype) -> u32 {
    match dtype {
        Dtype::Bf16 | Dtype::F16 => 8 * TILE,
        Dtype::F32 => 4 * TILE,
    }
}

/// Bytes the device compressor needs past the stream bound: `nblocks + 1` u64 words
/// (ticket counter, one look-back status per block) and 8 bytes of alignment slack.
pub fn scratch_bytes(nblocks: usize) -> usize {
    8 * (nblocks + 1) + 8
}

/// Why the device decoder rejected a stream: the low 8 bits of its status word (the block
/// index is in bits 8..31). Mirror of `enum Status` in `cuda/bfx.cuh`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum Status {
    Magic = 1,
    Version = 2,
    Count = 3,
    Geometry = 4,
    Truncated = 5,
    BlockSize = 6,
    BlockHeader = 7,
    Symbol = 8,
    Escapes = 9,
    Raws = 10,
    /// Any other inconsistency (reported by the host backend, which decodes with the CPU
    /// reference and does not classify block faults).
    Corrupt = 11,
}

impl Status {
    /// The status and block index of a nonzero word (`None` for success).
    pub fn from_word(w: u32) -> Option<(Status, u32)> {
        if w == 0 {
            return None;
        }
        let s = match w & 0xff {
            1 => Status::Magic,
            2 => Status::Version,
            3 => Status::Count,
            4 => Status::Geometry,
            5 => Status::Truncated,
            6 => Status::BlockSize,
            7 => Status::BlockHeader,
            8 => Status::Symbol,
            9 => Status::Escapes,
            10 => Status::Raws,
            _ => Status::Corrupt,
        };
        Some((s, w >> 8))
    }

    pub fn word(self, block: u64) -> u32 {
        self as u32 | ((block.min(0xff_ffff) as u32) << 8)
    }

    pub fn describe(self, block: u32) -> String {
        let what = match self {
            Status::Magic => "wrong magic (not a stream of this dtype)",
            Status::Version => "unsupported version",
            Status::Count => "value count differs from the caller's",
            Status::Geometry => "bad block size or block count",
            Status::Truncated => "stream longer than its buffer",
            Status::BlockSize => "block size impossible or inconsistent with its header",
            Status::BlockHeader => "bad block header",
            Status::Symbol => "exponent symbol out of range",
            Status::Escapes => "escape count disagrees with the header",
            Status::Raws => "raw exponent count disagrees with the header",
            Status::Corrupt => "corrupt block",
        };
        match self {
            Status::Magic | Status::Version | Status::Count | Status::Geometry => what.to_string(),
            _ => format!("block {block}: {what}"),
        }
    }
}

fn kernel_suffix(dtype: Dtype) -> &'static str {
    dtype.name()
}

/// One kernel parameter, by value, with the exact type of the kernel's parameter.
pub(super) enum Arg {
    U64(u64),
    U32(u32),
}

/// Arguments of one launch, in parameter order.
pub(super) struct Args(Vec<Arg>);

impl Args {
    pub(super) fn new() -> Args {
        Args(Vec::new())
    }
    pub(super) fn u64(mut self, v: u64) -> Args {
        self.0.push(Arg::U64(v));
        self
    }
    fn u32(mut self, v: u32) -> Args {
        self.0.push(Arg::U32(v));
        self
    }
    /// One pointer per parameter, each to a value of that parameter's type.
    fn pointers(&mut self) -> Vec<*mut c_void> {
        self.0
            .iter_mut()
            .map(|a| match a {
                Arg::U64(v) => v as *mut u64 as *mut c_void,
                Arg::U32(v) => v as *mut u32 as *mut c_void,
            })
            .collect()
    }
}

pub(super) fn launch(cuda: &CudaDevice, s: StreamHandle, name: &str, grid: u32, args: Args) -> Result<()> {
    launch_smem(cuda, s, name, grid, THREADS, 0, args)
}

fn launch_smem(cuda: &CudaDevice, s: StreamHandle, name: &str, grid: u32, threads: u32, smem: u32, mut args: Args) -> Result<()> {
    let mut ptrs = args.pointers();
    // Programmatic dependent launch when the kernels wait for their predecessors themselves:
    // the kernel's CTAs can then be resident before the previous kernel ends.
    let pdl = cuda.module_u32(PDL_GLOBAL)? == 1;
    // SAFETY: `ptrs` holds one pointer per parameter of `name` (bfx.cu's and bfx_decode.cu's entry points take
    // exactly the u64/u32 sequence built by the caller), each to a live value in `args`
    // that outlives the call; the device pointers among them were checked by the public
    // functions and must stay valid until the stream reaches the kernel (their contract).
    // With `pdl`, every codec kernel executes griddepcontrol.wait before any memory access
    // (pdl_enter in bfx.cuh), which the module's hoccl_bfx_pdl = 1 declares.
    unsafe { cuda.launch(s, name, (grid, 1, 1), (threads, 1, 1), smem, &mut ptrs, pdl) }
}

/// An output stream whose blocks kernels place by the compressor's decoupled look-back (the
/// compressor; the fused decompress + reduce + compress kernels): its block size, its block
/// count, and the look-back scratch past the stream's bound in the output buffer
/// (`max_compressed_len` bytes).
pub(crate) struct StreamOut {
    pub b: u32,
    pub nblocks: u32,
    pub scratch: DevPtr,
}

/// The look-back scratch of a stream of `n` values in blocks of `b` at `output`: 8-byte
/// aligned, past the stream's bound (`max_compressed_len` counts it).
pub(crate) fn stream_scratch(op: &'static str, dtype: Dtype, n: u64, b: u32, output: DevPtr) -> Result<DevPtr> {
    let bound = format::max_stream_len(op, dtype, n, b)? as u64;
    Ok(DevPtr((output.0 + bound + 7) & !7))
}

/// Enqueue `hoccl_bfx_compress_begin` for a stream of `n` values of `dtype` at `output`:
/// the look-back scratch zeroed, the fixed header written (and, for an empty stream, its
/// length to `out_len`). Errors: a block size the GPU encoder does not take, too many blocks.
#[allow(clippy::too_many_arguments)]
pub(crate) fn begin_stream(
    cuda: &CudaDevice,
    s: StreamHandle,
    op: &'static str,
    dtype: Dtype,
    n: u64,
    output: DevPtr,
    out_len: DevPtr,
    params: &Params,
) -> Result<StreamOut> {
    let b = params.check(op, dtype)?;
    if b > max_gpu_block(dtype) {
        return Err(Error::invalid_arg(
            op,
            format!(
                "the GPU encoder takes blocks of at most {} {} values, not {b}",
                max_gpu_block(dtype),
                dtype.name()
            ),
        ));
    }
    let nblocks = format::block_count(op, n, b)?;
    if nblocks > i32::MAX as u32 {
        return Err(Error::invalid_arg(op, format!("{nblocks} blocks exceed one launch")));
    }
    let scratch = stream_scratch(op, dtype, n, b, output)?;
    let words = nblocks as u64 + 1;
    let begin = Args::new()
        .u64(output.0)
        .u64(n)
        .u32(b)
        .u32(nblocks)
        .u32(dtype.magic())
        .u64(scratch.0)
        .u64(words)
        .u64(out_len.0);
    launch(cuda, s, "hoccl_bfx_compress_begin", (words.div_ceil(THREADS as u64)).min(1024) as u32, begin)?;
    Ok(StreamOut { b, nblocks, scratch })
}

/// Enqueue the compressor (arguments already checked by `compress_async`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn compress(
    cuda: &CudaDevice,
    s: StreamHandle,
    dtype: Dtype,
    input: DevPtr,
    n: u64,
    output: DevPtr,
    out_len: DevPtr,
    params: &Params,
) -> Result<()> {
    const OP: &str = "compress_async";
    let StreamOut { b, nblocks, scratch } = begin_stream(cuda, s, OP, dtype, n, output, out_len, params)?;
    if nblocks == 0 {
        return Ok(());
    }
    let cpt = b.div_ceil(TILE).next_power_of_two();
    // One tier: the kernel instance without the tier-2 paths.
    let t1 = params.tiers == 1;
    let name = format!("hoccl_bfx_compress_{}_{cpt}{}", kernel_suffix(dtype), if t1 { "_t1" } else { "" });
    let threads = cuda.module_u32(COMPRESS_THREADS_GLOBAL)?;
    if threads != 256 && threads != 512 {
        return Err(Error::internal(OP, format!("the kernel module says {threads} threads per compressor CTA")));
    }
    let mut flags = u32::from(input.0 % 16 == 0);
    if codec_tickets()? {
        flags |= ENC_TICKETS;
    }
    let per_sm = cuda.ctas_per_sm(&name, threads, 0)?.max(1);
    let sms = cuda.sm_count().max(1);
    let wave = sms as u64 * u64::from(per_sm);
    // A staggered first wave (stagger_start in bfx.cu) when the kernel file's step is nonzero
    // and the grid is at least two waves: the kernel needs the SMs and the CTAs per SM.
    if cuda.module_u32(COMPRESS_STAGGER_GLOBAL)? != 0 && per_sm >= 2 && u64::from(nblocks) >= 2 * wave {
        flags |= grid_shape(sms as u64, u64::from(per_sm)).unwrap_or(0);
    }
    let args = Args::new()
        .u64(input.0)
        .u64(n)
        .u32(b)
        .u32(params.tiers as u32)
        .u64(output.0)
        .u64(scratch.0)
        .u64(out_len.0)
        .u32(flags);
    launch_smem(cuda, s, &name, nblocks, threads, 0, args)
}

/// `HOCCL_CODEC_TICKETS` (Config::codec_tickets): blocks by atomic tickets, not by CTA
/// index. Read from the environment once per process, not on every launch.
fn codec_tickets() -> Result<bool> {
    static TICKETS: std::sync::OnceLock<Result<bool>> = std::sync::OnceLock::new();
    let only_tickets = |k: &str| if k == "HOCCL_CODEC_TICKETS" { std::env::var(k).ok() } else { None };
    TICKETS
        .get_or_init(|| crate::config::Config::default().with_env(only_tickets).map(|c| c.codec_tickets))
        .clone()
}

/// Enqueue the decompressor (arguments already checked by `decompress_async`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn decompress(
    cuda: &CudaDevice,
    s: StreamHandle,
    dtype: Dtype,
    input: DevPtr,
    input_len: u64,
    output: DevPtr,
    n: u64,
    status: DevPtr,
) -> Result<()> {
    launch(cuda, s, "hoccl_bfx_decompress_begin", 1, Args::new().u64(status.0))?;
    // CTAs split the stream's blocks evenly into contiguous ranges; idle ones (more CTAs than
    // blocks) return at once. The grid is at least one wave (as many CTAs as fit the SMs at
    // once at the kernel's registers and shared memory) and at most `waves` of them, aiming
    // at DECODE_BLOCKS_PER_CTA blocks each: later waves start as earlier CTAs finish, which
    // evens out CTAs that run slower than others (H200, bf16, 1 GiB: +6 % two tiers, +3 %
    // one tier against one wave), while a CTA with one or two blocks has nothing to hide its
    // first block's latency behind (64 MiB at four waves: -7 %). The block size is in the
    // stream, in device memory: the default one estimates the count. The kernel file
    // publishes its shared memory, threads and waves.
    let name = format!("hoccl_bfx_decompress_{}", kernel_suffix(dtype));
    let smem = cuda.module_u32(DECODE_SMEM_GLOBAL)?;
    let threads = cuda.module_u32(DECODE_THREADS_GLOBAL)?;
    let waves = u64::from(cuda.module_u32(DECODE_WAVES_GLOBAL)?);
    if threads == 0 || threads > 1024 || threads % 32 != 0 || !(1..=64).contains(&waves) {
        return Err(Error::internal(
            "decompress",
            format!("the kernel module says {threads} threads per decoder CTA, {waves} waves"),
        ));
    }
    let per_sm = u64::from(cuda.ctas_per_sm(&name, threads, smem)?.max(1));
    let sms = match cuda.sm_count() {
        0 => 132,
        c => c as u64,
    };
    // The grid's shape for the kernel (flags bits 8..23; its tail, bit 24, is of that wave).
    let shape = grid_shape(sms, per_sm);
    let tail = if shape.is_some() { u64::from(cuda.module_u32(DECODE_TAIL_GLOBAL)?) } else { 0 };
    let (ctas, tail_wave) = decode_grid(n, dtype, sms * per_sm, waves, tail);
    let flags = u32::from(output.0 % 16 == 0)
        | (u32::from(output.0 % 4 == 0) << 1)
        | shape.unwrap_or(0)
        | (u32::from(tail_wave != 0) << 24);
    let args = Args::new().u64(input.0).u64(input_len).u64(output.0).u64(n).u64(status.0).u32(flags);
    launch_smem(cuda, s, &name, ctas, threads, smem, args)
}

/// The grid's shape as both codec kernels read it from their flags: SMs in bits 8..19, CTAs
/// per SM in bits 20..23 (their product is a wave); None when either does not fit.
pub(super) fn grid_shape(sms: u64, per_sm: u64) -> Option<u32> {
    (sms < 4096 && per_sm < 16).then_some(((sms as u32) << 8) | ((per_sm as u32) << 20))
}

/// CTAs of the decoder's grid for `n` values, and the wave of its tail (0: none).
/// DECODE_BLOCKS_PER_CTA blocks of the default size per CTA, at least one `wave` (CTAs
/// resident at once, >= 1) and at most `waves` of them (>= 1), and never more than one
/// CTA per 2048 values (idle CTAs return at once).
///
/// With a `tail` (> 0) and enough blocks (a wave of CTAs of `tail` blocks, at most
/// DECODE_BLOCKS_PER_CTA, and three waves' worth more), the last 3·wave blocks go to a tail
/// of small CTAs instead: a wave of CTAs of two blocks, then a wave of one block each
/// (`cta_start` in bfx_decode.cu places them, from the stream's block count, and leaves the
/// tail out when a CTA of the head would get none). CTAs start in order as earlier ones end,
/// so the CTAs that start last, as the SMs run out of work at unequal times, are short: the
/// kernel's end is not held by a few late CTAs of eight blocks.
pub(super) fn decode_grid(n: u64, dtype: Dtype, wave: u64, waves: u64, tail: u64) -> (u32, u64) {
    let nblocks = n.div_ceil(u64::from(dtype.default_block()));
    if tail > 0 && nblocks >= (tail.min(DECODE_BLOCKS_PER_CTA) + 3) * wave {
        let head = ((nblocks - 3 * wave) / DECODE_BLOCKS_PER_CTA).clamp(wave, wave * waves);
        if let Ok(ctas) = u32::try_from(head + 2 * wave) {
            if ctas <= i32::MAX as u32 {
                return (ctas, wave);
            }
        }
    }
    let aim = nblocks / DECODE_BLOCKS_PER_CTA;
    let ctas = aim.clamp(wave, wave * waves).min(n.div_ceil(TILE as u64).max(1));
    (ctas.min(i32::MAX as u64) as u32, 0)
}

/// What the device decoder does, on the CPU (the host backend uses it): the stream at the front
/// of `input` (which may be longer) must be of `dtype` and hold `n` values. Returns the
/// values or a status word.
pub fn host_decode(input: &[u8], dtype: Dtype, n: usize) -> std::result::Result<Vec<u8>, u32> {
    if input.len() < format::STREAM_HEADER_BYTES {
        return Err(Status::Truncated.word(0));
    }
    let h = match format::StreamHeader::parse("decompress", input) {
        Ok(h) => h,
        Err(_) => return Err(header_fault(input)),
    };
    if h.dtype != dtype {
        return Err(Status::Magic.word(0));
    }
    if h.n != n as u64 {
        return Err(Status::Count.word(0));
    }
    let mut len = format::header_bytes(h.nblocks);
    for j in 0..h.nblocks as usize {
        len = len.saturating_add(format::rd32(input, format::STREAM_HEADER_BYTES + 4 * j) as usize);
    }
    if len > input.len() {
        return Err(Status::Truncated.word(0));
    }
    let mut out = vec![0u8; n * dtype.size()];
    match super::cpu::decode_into(&input[..len], &mut out) {
        Ok(_) => Ok(out),
        Err(_) => Err(Status::Corrupt.word(0xff_ffff)),
    }
}

/// The status of a stream header that `StreamHeader::parse` rejected, in the device's order.
fn header_fault(s: &[u8]) -> u32 {
    if Dtype::from_magic(format::rd32(s, 0)).is_none() {
        Status::Magic.word(0)
    } else if format::rd32(s, 4) != format::VERSION {
        Status::Version.word(0)
    } else if format::check_block("decompress", format::rd32(s, 16)).is_err() {
        Status::Geometry.word(0)
    } else {
        let nb = format::rd32(s, 20) as u64;
        let n = u64::from_le_bytes(s[8..16].try_into().unwrap_or_default());
        if n.div_ceil(format::rd32(s, 16) as u64) != nb {
            Status::Geometry.word(0)
        } else {
            Status::Truncated.word(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decode_grid_aims_at_eight_blocks_per_cta_between_one_and_max_waves_then_a_tail() {
        let wave = 132 * 4;
        // below one wave's worth: one wave, but at most one CTA per 2048 values
        assert_eq!(decode_grid(0, Dtype::Bf16, wave, 8, 0), (1, 0));
        assert_eq!(decode_grid(5000, Dtype::Bf16, wave, 8, 0), (3, 0));
        assert_eq!(decode_grid(32 << 20, Dtype::Bf16, wave, 8, 0), (528, 0));
        // 256 MiB and 1 GiB of bf16: 8192 and 32768 blocks of 16384 values
        assert_eq!(decode_grid(128 << 20, Dtype::Bf16, wave, 8, 0), (1024, 0));
        assert_eq!(decode_grid(512 << 20, Dtype::Bf16, wave, 8, 0), (4096, 0));
        // beyond: at most `waves` waves
        assert_eq!(decode_grid(2048 << 20, Dtype::Bf16, wave, 8, 0), (8 * 528, 0));
        assert_eq!(decode_grid(512 << 20, Dtype::Bf16, wave, 1, 0), (528, 0));
        // fp32 blocks hold 8192 values: the same bytes, the same grid
        assert_eq!(decode_grid(64 << 20, Dtype::F32, wave, 8, 0), (1024, 0));
        // huge inputs stay a valid grid size
        assert_eq!(decode_grid(u64::MAX / 4, Dtype::Bf16, 1 << 30, 8, 0), (i32::MAX as u32, 0));
        assert_eq!(decode_grid(u64::MAX / 4, Dtype::Bf16, 1 << 20, 8, 8), (10 << 20, 1 << 20));
        // with a tail: 256 MiB, (8192 - 3 * 528) / 8 = 826 CTAs of 8 blocks, then 528 of 2
        // and 528 of 1; 1 GiB: 3898 + 1056; too few blocks for a tail: as without
        assert_eq!(decode_grid(128 << 20, Dtype::Bf16, wave, 8, 8), (826 + 2 * 528, 528));
        assert_eq!(decode_grid(512 << 20, Dtype::Bf16, wave, 8, 8), (3898 + 2 * 528, 528));
        assert_eq!(decode_grid(32 << 20, Dtype::Bf16, wave, 8, 8), (528, 0));
        assert_eq!(decode_grid(11 * 528 * 16384, Dtype::Bf16, wave, 8, 8), (528 + 2 * 528, 528));
        assert_eq!(decode_grid((11 * 528 - 1) * 16384, Dtype::Bf16, wave, 8, 8), (725, 0));
        // a tail after CTAs of at least 4 blocks: from 7 waves' worth (128 MiB, 4096 blocks:
        // 528 CTAs of 4-5 blocks, then the tail; 3695 blocks: none)
        assert_eq!(decode_grid(64 << 20, Dtype::Bf16, wave, 8, 4), (3 * 528, 528));
        assert_eq!(decode_grid(3695 * 16384, Dtype::Bf16, wave, 8, 4), (528, 0));
        assert_eq!(decode_grid(3696 * 16384, Dtype::Bf16, wave, 8, 4), (3 * 528, 528));
    }

    #[test]
    fn grid_shape_packs_sms_and_ctas_per_sm() {
        assert_eq!(grid_shape(132, 4), Some((132 << 8) | (4 << 20)));
        assert_eq!(grid_shape(4095, 15), Some((4095 << 8) | (15 << 20)));
        assert_eq!(grid_shape(4096, 4), None);
        assert_eq!(grid_shape(132, 16), None);
    }

    #[test]
    fn status_words_round_trip() {
        assert_eq!(Status::from_word(0), None);
        let w = Status::Escapes.word(7);
        assert_eq!(Status::from_word(w), Some((Status::Escapes, 7)));
        assert!(Status::Raws.describe(3).contains("block 3"));
    }

    #[test]
    fn host_decode_reports_like_the_device() {
        let s = super::super::compress(Dtype::Bf16, &[1, 2, 3, 4], &Params::default()).unwrap();
        assert_eq!(host_decode(&s, Dtype::Bf16, 2).unwrap(), vec![1, 2, 3, 4]);
        assert_eq!(Status::from_word(host_decode(&s, Dtype::F16, 2).unwrap_err()).unwrap().0, Status::Magic);
        assert_eq!(Status::from_word(host_decode(&s, Dtype::Bf16, 3).unwrap_err()).unwrap().0, Status::Count);
        assert_eq!(
            Status::from_word(host_decode(&s[..s.len() - 4], Dtype::Bf16, 2).unwrap_err()).unwrap().0,
            Status::Truncated
        );
        let mut longer = s.clone();
        longer.extend_from_slice(&[0xee; 12]);
        assert_eq!(host_decode(&longer, Dtype::Bf16, 2).unwrap(), vec![1, 2, 3, 4]);
    }
}
