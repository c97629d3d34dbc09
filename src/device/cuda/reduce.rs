//! The reduce step on CUDA: `CudaDevice::reduce_kernel_async`, the launcher of the kernel
//! that folds the inputs in the order given into `dst` on a stream, bit for bit as
//! `crate::reduce::reduce_into` (the `Device::reduce_async` contract).
//!
//! The kernel and its launcher land with the kernels branch (`r/reduce-kernels`), which
//! replaces this file. Until then the launcher refuses, so a reduction on the CUDA backend
//! fails with this error instead of producing wrong data.
use super::CudaDevice;
use crate::device::{DevPtr, StreamHandle};
use crate::error::{Error, Result};
use crate::reduce::RedOp;
use crate::types::DataType;

impl CudaDevice {
    /// Enqueue the fold of `srcs` (in the order given) into `dst` on `s`; see
    /// `Device::reduce_async`.
    pub fn reduce_kernel_async(&self, _s: StreamHandle, _dst: DevPtr, _srcs: &[DevPtr], _count: usize, dtype: DataType, op: RedOp) -> Result<()> {
        Err(Error::invalid_usage(
            "CudaDevice::reduce_kernel_async",
            format!("the CUDA reduce kernel ({} {}) is not part of this build (it comes with the reduce kernels)", op.name(), dtype.name()),
        ))
    }
}
