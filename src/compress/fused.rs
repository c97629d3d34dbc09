//! Launcher of the fused decompress + reduce kernels (`cuda/bfx_fused.cu`): `dst[i]` =
//! the fold, in a given order, of `m` compressed streams' values and one raw local input's,
//! with the arithmetic of [`crate::reduce`], without writing the decompressed values
//! anywhere. The reduce step of the `compressed` engine's reductions (comm/reduction.rs):
//! peers' compressed chunks plus this rank's own, reduced in rank order.
//!
//! Contract of [`decompress_reduce_async`]:
//! - every stream must hold `n` values of `dtype` with the same block size B, and
//!   B × value size <= 32 KiB (the default B of every dtype); otherwise, as for any corrupt
//!   stream, the status word gets the decoder's code (`gpu::Status`, with the block index)
//!   and dst is undefined: never silently wrong data;
//! - `local_pos` (0..=m) is where the local input stands in the fold order; the streams
//!   take the other positions in the order given;
//! - `dst` may be `local` (in place), and must not overlap anything else; with the
//!   accumulator in dst ([`Accumulator::Dst`]) only when `local_pos` is 0.
//!
//! Dtypes: every codec dtype (BFX1 bf16, HFX1 f16, FFX1 f32: one kernel template over the
//! format, instantiated per dtype and operator).
//!
//! **Decompress + reduce + compress** ([`decompress_reduce_compress_async`], the AllReduce
//! step): the same fold into `dst`, and the reduced values coded, block by block, into an
//! output stream, byte for byte the stream `compress_async` makes of `dst` with the same
//! [`Params`], without reading `dst` back: each CTA codes the block it has just reduced
//! from shared memory, with the compressor's block code and its decoupled look-back
//! (`cuda/bfx_fused.cu`, `drc_kernel`). One output stream may be built by several launches
//! over consecutive ranges of its values, each starting on a block boundary
//! ([`DrcOut`]; [`drc_begin_async`] first). Limits: as the fused kernel, and the output's
//! block is the streams' (`params.block`), at most 32 KiB of values.
use super::format::Dtype;
use super::gpu::{self, Args};
use super::Params;
use crate::device::{DevPtr, Device, StreamHandle};
use crate::error::{Error, Result};
use crate::reduce::RedOp;
use std::ffi::c_void;

/// Most compressed inputs of one launch (`FUSE_MAX` in bfx_fused.cu).
pub const MAX_FUSED_INPUTS: usize = 8;

/// Mirror of `bfx::FusedArgs` (bfx_fused.cu), the kernel's one parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct FusedArgs {
    input: [u64; MAX_FUSED_INPUTS],
    input_len: [u64; MAX_FUSED_INPUTS],
    local: u64,
    dst: u64,
    n: u64,
    status: u64,
    m: u32,
    local_pos: u32,
    flags: u32,
    pad: u32,
}

/// Whether a fused kernel exists for `dtype` (every codec dtype; kept as the one question
/// callers ask, so a format without an instance falls back instead of failing).
pub fn supports(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::Bf16 | Dtype::F16 | Dtype::F32)
}

/// The faster accumulator for `dtype` where both apply, as measured on one H200
/// (`reduce_bench`, 256 MiB, 4 + 1 inputs; docs/codec.md): in dst for bf16 (1022 against
/// 896 GB/s of decompressed input) and f16 (442 against 380), in shared memory for f32
/// (1250 against 1133). `in_place_later`: dst is the local input and the local input is not
/// first, which only the shared-memory accumulator allows.
pub fn accumulator_for(dtype: Dtype, in_place_later: bool) -> Accumulator {
    match dtype {
        Dtype::Bf16 | Dtype::F16 if !in_place_later => Accumulator::Dst,
        _ => Accumulator::Shared,
    }
}

/// Module globals: dynamic shared memory of a fused CTA (decoder state + accumulator; with
/// the accumulator in dst, the decoder state only).
const FUSED_SMEM_GLOBAL: &str = "hoccl_bfx_fused_smem";
const FUSED_DACC_SMEM_GLOBAL: &str = "hoccl_bfx_fused_dacc_smem";

/// Where a fused CTA accumulates a block's fold (bfx_fused.cu, GACC).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accumulator {
    /// Shared memory (86 KB per CTA, 2 CTAs per SM): any dst, in place included.
    Shared,
    /// dst's block itself, which stays in L2 between the steps (the decoder's 54 KB per
    /// CTA, 3 CTAs per SM). dst may be `local` only when `local_pos` is 0.
    Dst,
}

/// Enqueue on `stream`: `dst[i] = fold(x_0[i], …, x_m[i])` for `i < n`, where the x are the
/// `inputs` (compressed streams: device pointer and length in bytes) in order, with the raw
/// `local` input inserted at position `local_pos`; `Avg` divides by `inputs.len() + 1`.
/// `status` (a device u32) is zeroed, then set by a failing stream (`status_result` reads
/// it). Errors: no inputs or more than [`MAX_FUSED_INPUTS`], `local_pos` past the end, a
/// device without CUDA, null or misaligned pointers.
#[allow(clippy::too_many_arguments)]
pub fn decompress_reduce_async(
    dev: &dyn Device,
    stream: StreamHandle,
    dtype: Dtype,
    inputs: &[(DevPtr, usize)],
    local: DevPtr,
    local_pos: usize,
    dst: DevPtr,
    n: usize,
    op: RedOp,
    status: DevPtr,
) -> Result<()> {
    decompress_reduce_with_async(dev, stream, dtype, inputs, local, local_pos, dst, n, op, status, Accumulator::Shared)
}

/// [`decompress_reduce_async`] with the accumulator in `acc`; [`Accumulator::Dst`] refuses
/// `dst == local` with `local_pos > 0` (`InvalidArgument`).
#[allow(clippy::too_many_arguments)]
pub fn decompress_reduce_with_async(
    dev: &dyn Device,
    stream: StreamHandle,
    dtype: Dtype,
    inputs: &[(DevPtr, usize)],
    local: DevPtr,
    local_pos: usize,
    dst: DevPtr,
    n: usize,
    op: RedOp,
    status: DevPtr,
    acc: Accumulator,
) -> Result<()> {
    const OP: &str = "decompress_reduce_async";
    if acc == Accumulator::Dst && dst == local && local_pos > 0 {
        return Err(Error::invalid_arg(OP, "the accumulator in dst cannot run in place unless the local input comes first"));
    }
    if inputs.is_empty() {
        return Err(Error::invalid_arg(OP, format!("no compressed inputs: want 1..={MAX_FUSED_INPUTS}")));
    }
    check_args(OP, dtype, inputs, (local, local_pos), dst, n, status)?;
    let cuda = dev.as_cuda().ok_or_else(|| Error::invalid_arg(OP, "the fused kernels need a CUDA device"))?;
    gpu::launch(cuda, stream, "hoccl_bfx_decompress_begin", 1, Args::new().u64(status.0)).map_err(|e| e.with_op(OP))?;
    if n == 0 {
        return Ok(());
    }
    let (prefix, smem_global) = match acc {
        Accumulator::Shared => ("", FUSED_SMEM_GLOBAL),
        Accumulator::Dst => ("dacc_", FUSED_DACC_SMEM_GLOBAL),
    };
    let name = format!("hoccl_bfx_fused_reduce_{prefix}{}_{}", dtype.name(), op.name());
    let smem = cuda.module_u32(smem_global)?;
    let threads = cuda.module_u32(gpu::DECODE_THREADS_GLOBAL)?;
    let waves = u64::from(cuda.module_u32(gpu::DECODE_WAVES_GLOBAL)?).clamp(1, 64);
    // The decompressor's grid (decode_grid: ~8 blocks per CTA, one to `waves` waves, a tail
    // of small CTAs) at this kernel's occupancy.
    let per_sm = u64::from(cuda.ctas_per_sm(&name, threads, smem)?.max(1));
    let sms = match cuda.sm_count() {
        0 => 132,
        c => c as u64,
    };
    let shape = gpu::grid_shape(sms, per_sm);
    let tail = if shape.is_some() { u64::from(cuda.module_u32(gpu::DECODE_TAIL_GLOBAL)?) } else { 0 };
    let (ctas, tail_wave) = gpu::decode_grid(n as u64, dtype, sms * per_sm, waves, tail);
    let flags = u32::from(dst.0 % 16 == 0) | (u32::from(dst.0 % 4 == 0) << 1) | shape.unwrap_or(0) | (u32::from(tail_wave != 0) << 24);
    let mut a = FusedArgs {
        local: local.0,
        dst: dst.0,
        n: n as u64,
        status: status.0,
        m: inputs.len() as u32,
        local_pos: local_pos as u32,
        flags,
        ..Default::default()
    };
    for (k, (p, len)) in inputs.iter().enumerate() {
        a.input[k] = p.0;
        a.input_len[k] = *len as u64;
    }
    let pdl = cuda.module_u32(gpu::PDL_GLOBAL)? == 1;
    let mut args = [&mut a as *mut FusedArgs as *mut c_void];
    // SAFETY: the kernel takes one parameter, `bfx::FusedArgs` (176 bytes, this #[repr(C)]
    // struct's layout); it reads each input's `input_len` bytes, `n` values at local, and
    // writes `n` values at dst and the status word: device memory the caller provides. With
    // `pdl`, the kernel executes griddepcontrol.wait before any memory access (pdl_enter).
    unsafe { cuda.launch(stream, &name, (ctas, 1, 1), (threads, 1, 1), smem, &mut args, pdl) }.map_err(|e| e.with_op(OP))
}

/// The arguments both launchers share: at most [`MAX_FUSED_INPUTS`] streams, 4-byte aligned;
/// the local input's position among them; local and dst aligned to the value size; `n`
/// values within the address space; `status` 4-byte aligned, not null when there are
/// streams.
fn check_args(op: &'static str, dtype: Dtype, inputs: &[(DevPtr, usize)], (local, local_pos): (DevPtr, usize), dst: DevPtr, n: usize, status: DevPtr) -> Result<()> {
    if inputs.len() > MAX_FUSED_INPUTS {
        return Err(Error::invalid_arg(op, format!("{} compressed inputs: want at most {MAX_FUSED_INPUTS}", inputs.len())));
    }
    if local_pos > inputs.len() {
        return Err(Error::invalid_arg(op, format!("local position {local_pos} past the {} inputs", inputs.len() + 1)));
    }
    if !supports(dtype) {
        return Err(Error::invalid_arg(op, format!("no fused kernel for {}", dtype.name())));
    }
    let size = dtype.size() as u64;
    n.checked_mul(size as usize).ok_or_else(|| Error::invalid_arg(op, format!("{n} values overflow")))?;
    for (what, p, align, required) in [("local", local, size, true), ("dst", dst, size, true), ("status", status, 4, !inputs.is_empty())] {
        if (required && p.is_null()) || p.0 % align != 0 {
            return Err(Error::invalid_arg(op, format!("{what} pointer {:#x} is null or not {align}-byte aligned", p.0)));
        }
    }
    for (p, _) in inputs {
        if p.is_null() || p.0 % 4 != 0 {
            return Err(Error::invalid_arg(op, format!("input pointer {:#x} is null or not 4-byte aligned", p.0)));
        }
    }
    Ok(())
}

/// Mirror of `bfx::DrcArgs` (bfx_fused.cu), the drc kernels' one parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DrcArgs {
    f: FusedArgs,
    out: u64,
    scratch: u64,
    out_len: u64,
    offs: u64,
    block0: u64,
    blocks: u64,
    block: u32,
    tiers: u32,
}

/// Module global: dynamic shared memory of a drc CTA (the decoder's or the encoder's state,
/// the accumulator, the streams' offsets).
const DRC_SMEM_GLOBAL: &str = "hoccl_bfx_drc_smem";

/// The output stream of [`decompress_reduce_compress_async`]: `total` values of the dtype,
/// coded with `params` (whose block must be the input streams' block size) into `out`, a
/// device buffer of `cap >= max_compressed_len(dtype, total, params)` bytes (4-byte
/// aligned; the look-back scratch is past the stream's bound, as for `compress_async`).
/// `out_len` (device or host-mapped u64, 8-byte aligned) receives the stream's length in
/// bytes once its last block is written.
#[derive(Clone, Copy, Debug)]
pub struct DrcOut {
    pub out: DevPtr,
    pub cap: usize,
    pub out_len: DevPtr,
    pub total: usize,
    pub params: Params,
}

impl DrcOut {
    fn check(&self, op: &'static str, dtype: Dtype) -> Result<u32> {
        let b = self.params.check(op, dtype)?;
        if b as usize * dtype.size() > ACC_BYTES {
            return Err(Error::invalid_arg(op, format!("blocks of {b} {} values exceed the fused kernels' {ACC_BYTES} bytes", dtype.name())));
        }
        let need = super::max_compressed_len(dtype, self.total, &self.params)?;
        if self.cap < need {
            return Err(Error::invalid_arg(op, format!("output of {} bytes, {need} needed", self.cap)));
        }
        for (what, p, align) in [("output", self.out, 4), ("out_len", self.out_len, 8)] {
            if p.is_null() || p.0 % align != 0 {
                return Err(Error::invalid_arg(op, format!("{what} pointer {:#x} is null or not {align}-byte aligned", p.0)));
            }
        }
        Ok(b)
    }
}

/// A block of the fused kernels' accumulator (`FUSE_ACC_BYTES` in bfx_fused.cu).
const ACC_BYTES: usize = 32 << 10;

/// Enqueue the start of `o`'s stream (its fixed header, its look-back scratch zeroed): once,
/// before the launches that fill it.
pub fn drc_begin_async(dev: &dyn Device, stream: StreamHandle, dtype: Dtype, o: &DrcOut) -> Result<()> {
    const OP: &str = "drc_begin_async";
    o.check(OP, dtype)?;
    let cuda = dev.as_cuda().ok_or_else(|| Error::invalid_arg(OP, "the fused kernels need a CUDA device"))?;
    gpu::begin_stream(cuda, stream, OP, dtype, o.total as u64, o.out, o.out_len, &o.params).map(|_| ())
}

/// Bytes of the workspace of [`decompress_reduce_compress_async`] over `m` streams of `n`
/// values in blocks of `params.block`: each stream's block offsets (u64).
pub fn drc_workspace_len(dtype: Dtype, m: usize, n: usize, params: &Params) -> Result<usize> {
    const OP: &str = "drc_workspace_len";
    let b = params.check(OP, dtype)? as usize;
    n.div_ceil(b).checked_mul(8 * m).map(|x| x.max(8)).ok_or_else(|| Error::invalid_arg(OP, format!("{n} values overflow")))
}

/// Enqueue on `stream`: what [`decompress_reduce_async`] does (the accumulator in shared
/// memory), and the reduced values, values `first .. first + n` of `o`'s stream, coded into
/// it. `first` is a multiple of the block size; the launches of one stream may come in any
/// sizes but in order of `first` (each block's place depends on those before it), all
/// after [`drc_begin_async`]. The stream is complete, and `o.out_len` written, once the
/// launch that covers its last value has run; it is then the stream `compress_async` makes
/// of the `o.total` reduced values with `o.params`, byte for byte. With no `inputs`, the
/// `local` values are only coded (dst must be `local`, and `status` may be null): for
/// values reduced by other means. `workspace`: [`drc_workspace_len`] bytes of device
/// memory, 8-byte aligned. A corrupt stream sets `status` as for the fused kernel; `dst`
/// and `o`'s stream are then undefined. Errors: as [`decompress_reduce_async`], a range
/// outside the output or not on a block boundary, a block larger than 32 KiB, a short
/// output or workspace.
#[allow(clippy::too_many_arguments)]
pub fn decompress_reduce_compress_async(
    dev: &dyn Device,
    stream: StreamHandle,
    dtype: Dtype,
    inputs: &[(DevPtr, usize)],
    local: DevPtr,
    local_pos: usize,
    dst: DevPtr,
    n: usize,
    op: RedOp,
    status: DevPtr,
    o: &DrcOut,
    first: usize,
    workspace: (DevPtr, usize),
) -> Result<()> {
    const OP: &str = "decompress_reduce_compress_async";
    let b = o.check(OP, dtype)?;
    if inputs.is_empty() && dst != local {
        return Err(Error::invalid_arg(OP, "without compressed inputs dst must be the local input"));
    }
    check_args(OP, dtype, inputs, (local, local_pos), dst, n, status)?;
    if first % b as usize != 0 || first.checked_add(n).is_none_or(|end| end > o.total) {
        return Err(Error::invalid_arg(OP, format!("values {first}..+{n} are not a block-aligned range of the {} of the output", o.total)));
    }
    let need = drc_workspace_len(dtype, inputs.len(), n, &o.params)?;
    if workspace.1 < need || workspace.0.is_null() || workspace.0 .0 % 8 != 0 {
        return Err(Error::invalid_arg(OP, format!("workspace of {} bytes at {:#x}: {need} bytes, 8-byte aligned, needed", workspace.1, workspace.0 .0)));
    }
    let cuda = dev.as_cuda().ok_or_else(|| Error::invalid_arg(OP, "the fused kernels need a CUDA device"))?;
    if !status.is_null() {
        gpu::launch(cuda, stream, "hoccl_bfx_decompress_begin", 1, Args::new().u64(status.0)).map_err(|e| e.with_op(OP))?;
    }
    if n == 0 {
        return Ok(());
    }
    let mut a = DrcArgs {
        f: FusedArgs {
            local: local.0,
            dst: dst.0,
            n: n as u64,
            status: status.0,
            m: inputs.len() as u32,
            local_pos: local_pos as u32,
            flags: u32::from(dst.0 % 16 == 0) | (u32::from(dst.0 % 4 == 0) << 1),
            ..Default::default()
        },
        out: o.out.0,
        scratch: gpu::stream_scratch(OP, dtype, o.total as u64, b, o.out)?.0,
        out_len: o.out_len.0,
        offs: workspace.0 .0,
        block0: (first / b as usize) as u64,
        blocks: o.total.div_ceil(b as usize) as u64,
        block: b,
        tiers: o.params.tiers as u32,
    };
    for (k, (p, len)) in inputs.iter().enumerate() {
        a.f.input[k] = p.0;
        a.f.input_len[k] = *len as u64;
    }
    let threads = cuda.module_u32(gpu::DECODE_THREADS_GLOBAL)?;
    let pdl = cuda.module_u32(gpu::PDL_GLOBAL)? == 1;
    let ctas = u32::try_from(n.div_ceil(b as usize)).map_err(|_| Error::invalid_arg(OP, format!("{n} values exceed one launch")))?;
    let mut args = [&mut a as *mut DrcArgs as *mut c_void];
    if !inputs.is_empty() {
        let name = format!("hoccl_bfx_drc_offsets_{}", dtype.name());
        // SAFETY: the kernel takes one parameter, `bfx::DrcArgs` (232 bytes, this #[repr(C)]
        // struct's layout); it reads each input's header and size table (within
        // `input_len`) and writes `8 * m * ceil(n / B)` bytes at `offs` (the workspace,
        // checked above) and the status word. It waits for its predecessors (pdl_enter).
        unsafe { cuda.launch(stream, &name, (inputs.len() as u32, 1, 1), (threads, 1, 1), 0, &mut args, pdl) }.map_err(|e| e.with_op(OP))?;
    }
    let name = format!("hoccl_bfx_drc_{}_{}", dtype.name(), op.name());
    let smem = cuda.module_u32(DRC_SMEM_GLOBAL)?;
    // SAFETY: as above; the kernel reads the inputs' blocks at the workspace's offsets (each
    // checked against `input_len`), `n` values at local, writes `n` values at dst, the
    // output stream's blocks within `max_compressed_len(total)` bytes at `out` (checked
    // against `cap`), its look-back scratch there, `out_len` and the status word.
    unsafe { cuda.launch(stream, &name, (ctas, 1, 1), (threads, 1, 1), smem, &mut args, pdl) }.map_err(|e| e.with_op(OP))
}

#[cfg(test)]
mod tests {
    #[test]
    fn args_match_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<super::FusedArgs>(), 176);
        assert_eq!(std::mem::size_of::<super::DrcArgs>(), 232);
    }
}
