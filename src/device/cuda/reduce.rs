//! Launcher of the CopyReduce kernels (`cuda/reduce.cu`): `dst[i] = fold(srcs[0][i], …)` for
//! 1..=8 sources, every dtype × `RedOp`, bit for bit as `crate::reduce` specifies
//! (`PreMulSum`: each source times its scalar, then summed; a scalar in device memory is read
//! by the kernel when it runs).
use super::CudaDevice;
use crate::device::{DevPtr, StreamHandle};
use crate::error::{Error, Result};
use crate::reduce::{RedOp, Scalar};
use crate::types::DataType;
use std::ffi::c_void;

/// Most sources one launch folds (`MAX_SRCS` in reduce.cu).
pub const MAX_REDUCE_SRCS: usize = 8;

/// CTAs per CopyReduce launch unless `HOCCL_REDUCE_CTAS` says otherwise. Measured on one
/// H200 (132 SMs, 4 inputs of 256 MiB bf16; docs/results/h200-1gpu/reduce_kernels.json):
/// the kernel's read rate grows linearly with CTAs up to one 512-thread CTA per SM (132:
/// 2346 GB/s, 114 % of the D2D copy's read rate) and stays there (264: 2329 GB/s).
pub const DEFAULT_REDUCE_CTAS: usize = 132;

/// Mirror of `red::ReduceArgs` in reduce.cu, passed by value as the kernel's one parameter.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct ReduceArgs {
    src: [u64; MAX_REDUCE_SRCS],
    dst: u64,
    count: u64,
    nsrc: u32,
    flags: u32,
    /// PreMulSum: the scalar's bits, or (`scalar_ptr` not 0) its device address.
    scalar: u64,
    scalar_ptr: u64,
}

const OP: &str = "CudaDevice::reduce_kernel_async";

/// The CTA count of CopyReduce launches: `HOCCL_REDUCE_CTAS` (`Config::reduce_ctas`, read
/// once per process) or [`DEFAULT_REDUCE_CTAS`]. An invalid value is reported once and the
/// default used.
pub fn reduce_ctas() -> usize {
    static CTAS: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *CTAS.get_or_init(|| {
        let only = |k: &str| if k == "HOCCL_REDUCE_CTAS" { std::env::var(k).ok() } else { None };
        match crate::config::Config::default().with_env(only) {
            Ok(c) => c.reduce_ctas.unwrap_or(DEFAULT_REDUCE_CTAS),
            Err(e) => {
                log::warn!("hoccl: {e}; using {DEFAULT_REDUCE_CTAS} CTAs for reductions");
                DEFAULT_REDUCE_CTAS
            }
        }
    })
}

/// The kernel for `dtype` and `op` (`hoccl_reduce_<dtype>_<op>`).
fn kernel_name(dtype: DataType, op: RedOp) -> String {
    format!("hoccl_reduce_{}_{}", dtype.name(), op.name())
}

impl CudaDevice {
    /// Enqueue `dst[i] = fold(srcs[0][i], …, srcs[m-1][i])` for `i < count` on stream `s`,
    /// folding left to right in the order given (`Avg` divides by `srcs.len()`), with
    /// [`reduce_ctas`] CTAs. `dst` may be one of the sources; otherwise it must not overlap
    /// them. Every pointer must be aligned to the element size; 16-byte vectors are used
    /// when all of them have the same address modulo 16.
    /// Errors: no sources or more than [`MAX_REDUCE_SRCS`], a byte count that overflows, a
    /// null or misaligned pointer. `count == 0` enqueues nothing.
    pub fn reduce_kernel_async(
        &self,
        s: StreamHandle,
        dst: DevPtr,
        srcs: &[DevPtr],
        count: usize,
        dtype: DataType,
        op: RedOp,
    ) -> Result<()> {
        self.reduce_kernel_ctas_async(s, dst, srcs, count, dtype, op, reduce_ctas())
    }

    /// [`Self::reduce_kernel_async`] with an explicit CTA count (benchmarks sweep it).
    #[allow(clippy::too_many_arguments)]
    pub fn reduce_kernel_ctas_async(
        &self,
        s: StreamHandle,
        dst: DevPtr,
        srcs: &[DevPtr],
        count: usize,
        dtype: DataType,
        op: RedOp,
        ctas: usize,
    ) -> Result<()> {
        if srcs.is_empty() || srcs.len() > MAX_REDUCE_SRCS {
            return Err(Error::invalid_arg(OP, format!("{} sources: want 1..={MAX_REDUCE_SRCS}", srcs.len())));
        }
        if ctas == 0 || ctas > u32::MAX as usize {
            return Err(Error::invalid_arg(OP, format!("{ctas} CTAs")));
        }
        dtype.bytes(OP, count)?;
        if count == 0 {
            return Ok(());
        }
        let size = dtype.size() as u64;
        let mut a = ReduceArgs { dst: dst.0, count: count as u64, nsrc: srcs.len() as u32, ..Default::default() };
        for (slot, p) in a.src.iter_mut().zip(srcs) {
            *slot = p.0;
        }
        for p in srcs.iter().chain(std::iter::once(&dst)) {
            if p.is_null() || p.0 % size != 0 {
                return Err(Error::invalid_arg(OP, format!("pointer {:#x} is null or not aligned to {size} bytes", p.0)));
            }
        }
        if srcs.iter().all(|p| p.0 % 16 == dst.0 % 16) {
            a.flags |= 1;
        }
        match op {
            RedOp::PreMulSum(Scalar::Value(bits)) => a.scalar = bits,
            RedOp::PreMulSum(Scalar::Device(p)) => {
                if p == 0 || p % size != 0 {
                    return Err(Error::invalid_arg(OP, format!("PreMulSum scalar at {p:#x}: null or not aligned to {size} bytes")));
                }
                a.scalar_ptr = p;
            }
            _ => {}
        }
        let threads = self.module_u32("hoccl_reduce_threads").map_err(|e| e.with_op(OP))?;
        let mut args = [&mut a as *mut ReduceArgs as *mut c_void];
        // SAFETY: the kernel takes one parameter, `red::ReduceArgs` (104 bytes, the layout of
        // this #[repr(C)] struct); it reads `count` elements at each source (and a PreMulSum
        // scalar at scalar_ptr) and writes them at dst, device memory the caller provides
        // (bad addresses are reported asynchronously by the driver). No programmatic
        // dependent launch.
        unsafe { self.launch(s, &kernel_name(dtype, op), (ctas as u32, 1, 1), (threads, 1, 1), 0, &mut args, false) }
            .map_err(|e| e.with_op(OP))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn args_match_the_kernel_struct() {
        assert_eq!(std::mem::size_of::<ReduceArgs>(), 104);
        assert_eq!(std::mem::align_of::<ReduceArgs>(), 8);
    }

    #[test]
    fn kernel_names() {
        assert_eq!(kernel_name(DataType::BF16, RedOp::Sum), "hoccl_reduce_bf16_sum");
        assert_eq!(kernel_name(DataType::F8E5M2, RedOp::Avg), "hoccl_reduce_f8e5m2_avg");
        assert_eq!(kernel_name(DataType::F32, RedOp::PreMulSum(Scalar::Value(0))), "hoccl_reduce_f32_premulsum");
    }
}
