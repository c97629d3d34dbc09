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
use super::format::Dtype;
use super::gpu::{self, Args};
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
    if inputs.is_empty() || inputs.len() > MAX_FUSED_INPUTS {
        return Err(Error::invalid_arg(OP, format!("{} compressed inputs: want 1..={MAX_FUSED_INPUTS}", inputs.len())));
    }
    if local_pos > inputs.len() {
        return Err(Error::invalid_arg(OP, format!("local position {local_pos} past the {} inputs", inputs.len() + 1)));
    }
    if !supports(dtype) {
        return Err(Error::invalid_arg(OP, format!("no fused kernel for {}", dtype.name())));
    }
    let size = dtype.size() as u64;
    n.checked_mul(size as usize).ok_or_else(|| Error::invalid_arg(OP, format!("{n} values overflow")))?;
    for (what, p, align) in [("local", local, size), ("dst", dst, size), ("status", status, 4)] {
        if p.is_null() || p.0 % align != 0 {
            return Err(Error::invalid_arg(OP, format!("{what} pointer {:#x} is null or not {align}-byte aligned", p.0)));
        }
    }
    for (p, _) in inputs {
        if p.is_null() || p.0 % 4 != 0 {
            return Err(Error::invalid_arg(OP, format!("input pointer {:#x} is null or not 4-byte aligned", p.0)));
        }
    }
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

#[cfg(test)]
mod tests {
    #[test]
    fn args_match_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<super::FusedArgs>(), 176);
    }
}
