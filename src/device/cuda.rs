//! CUDA backend (cudarc driver API). Being written; see issue 2/3.
use super::*;
use crate::error::Error;

pub struct Probe {
    pub count: usize,
}

pub fn probe() -> Result<Probe> {
    Err(Error::NoDevice { op: "cuda::probe", what: "CUDA backend not built yet".into() })
}

pub struct CudaDevice;

impl CudaDevice {
    pub fn open(_ordinal: usize) -> Result<HostOnlyNever> {
        Err(Error::NoDevice { op: "CudaDevice::open", what: "CUDA backend not built yet".into() })
    }
}
pub type HostOnlyNever = super::host::HostDevice;
