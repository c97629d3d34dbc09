//! CUDA backend (cudarc driver API). Being written on branch `cuda`; this stub only fixes
//! the interface other layers code against.
use super::*;
use crate::error::Error;

/// What the driver reports, without panicking when no driver or GPU exists.
pub struct Probe {
    pub count: usize,
}

pub fn probe() -> Result<Probe> {
    Err(Error::NoDevice { op: "cuda::probe", what: "CUDA backend not built yet".into() })
}

pub struct CudaDevice {
    _private: (),
}

impl CudaDevice {
    pub fn open(_ordinal: usize) -> Result<super::host::HostDevice> {
        Err(Error::NoDevice { op: "CudaDevice::open", what: "CUDA backend not built yet".into() })
    }

    /// Launch kernel `name` from the embedded fatbin on stream `s` (module loaded lazily,
    /// once per device; every launch counted by `kernels::note_launch`).
    ///
    /// # Safety
    /// `args` must hold one pointer per kernel parameter, each pointing to a value of that
    /// parameter's type, and every device pointer among them must be valid for the
    /// kernel's accesses until the launch completes on the stream.
    pub unsafe fn launch(
        &self,
        _s: StreamHandle,
        name: &str,
        _grid: (u32, u32, u32),
        _block: (u32, u32, u32),
        _shared_bytes: u32,
        _args: &mut [*mut std::ffi::c_void],
    ) -> Result<()> {
        Err(Error::NoDevice { op: "CudaDevice::launch", what: format!("{name}: CUDA backend not built yet") })
    }

    /// Multiprocessor count (to size grids).
    pub fn sm_count(&self) -> usize {
        0
    }
}
