//! What the driver reports about the GPUs of this host, without panicking when there is no
//! driver or no GPU.
use super::driver::{self, attribute, check, string_from_buf};
use crate::error::Result;
use cudarc::driver::sys;
use cudarc::driver::sys::CUdevice_attribute as Attr;
use std::ffi::{c_char, c_int};

/// One GPU as the driver reports it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuInfo {
    /// CUDA device ordinal (after `CUDA_VISIBLE_DEVICES`).
    pub ordinal: usize,
    pub name: String,
    /// `domain:bus:device.function`, e.g. `0000:18:00.0`.
    pub pci_bus_id: String,
    pub total_mem_bytes: usize,
    /// `CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT` (3 on H200).
    pub async_engines: usize,
    /// Compute capability (major, minor), e.g. (9, 0).
    pub compute_capability: (u32, u32),
    pub sm_count: usize,
    /// `CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS`: 64-bit stream write/wait values.
    pub stream_mem_ops_64: bool,
    /// `CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING`.
    pub unified_addressing: bool,
}

/// The host's GPUs. `peer_access[i][j]` says whether GPU i can map GPU j's memory
/// (`cuDeviceCanAccessPeer`; true on the diagonal).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Probe {
    pub count: usize,
    /// `cuDriverGetVersion`, e.g. 13000 for CUDA 13.0.
    pub driver_version: i32,
    pub gpus: Vec<GpuInfo>,
    pub peer_access: Vec<Vec<bool>>,
}

const OP: &str = "cuda::probe";

/// Ask the driver about every GPU.
///
/// Never panics. `Err(Error::NoDevice)` when libcuda is absent, too old, or `cuInit` fails
/// (the reason is in `what`); `Ok` with `count == 0` when the driver works and reports no
/// device; any other driver failure is `Error::Cuda`.
pub fn probe() -> Result<Probe> {
    driver::init()?;
    let mut version: c_int = 0;
    // SAFETY: init succeeded; valid out-pointer.
    check(OP, "cuDriverGetVersion", unsafe { sys::cuDriverGetVersion(&mut version) })?;
    let count = device_count(OP)?;
    let mut devs = Vec::with_capacity(count);
    let mut gpus = Vec::with_capacity(count);
    for ordinal in 0..count {
        let dev = device_handle(OP, ordinal)?;
        gpus.push(gpu_info(OP, ordinal, dev)?);
        devs.push(dev);
    }
    let mut peer_access = vec![vec![false; count]; count];
    for (i, &a) in devs.iter().enumerate() {
        for (j, &b) in devs.iter().enumerate() {
            peer_access[i][j] = i == j || can_access_peer(a, b)?;
        }
    }
    Ok(Probe { count, driver_version: version, gpus, peer_access })
}

/// `cuDeviceGetCount` (after [`driver::init`]).
pub(crate) fn device_count(op: &'static str) -> Result<usize> {
    let mut count: c_int = 0;
    // SAFETY: init succeeded; valid out-pointer.
    check(op, "cuDeviceGetCount", unsafe { sys::cuDeviceGetCount(&mut count) })?;
    Ok(count.max(0) as usize)
}

pub(crate) fn device_handle(op: &'static str, ordinal: usize) -> Result<sys::CUdevice> {
    let mut dev: sys::CUdevice = 0;
    let ord = c_int::try_from(ordinal).unwrap_or(c_int::MAX);
    // SAFETY: init succeeded; valid out-pointer.
    check(op, "cuDeviceGet", unsafe { sys::cuDeviceGet(&mut dev, ord) })?;
    Ok(dev)
}

fn can_access_peer(a: sys::CUdevice, b: sys::CUdevice) -> Result<bool> {
    let mut v: c_int = 0;
    // SAFETY: a and b come from cuDeviceGet; valid out-pointer.
    check(OP, "cuDeviceCanAccessPeer", unsafe { sys::cuDeviceCanAccessPeer(&mut v, a, b) })?;
    Ok(v != 0)
}

/// Everything [`GpuInfo`] holds, for one device.
pub(crate) fn gpu_info(op: &'static str, ordinal: usize, dev: sys::CUdevice) -> Result<GpuInfo> {
    let mut name = [0u8; 256];
    // SAFETY: the buffer holds `len` bytes; the driver NUL-terminates within it.
    check(op, "cuDeviceGetName", unsafe {
        sys::cuDeviceGetName(name.as_mut_ptr() as *mut c_char, name.len() as c_int, dev)
    })?;
    let mut bus = [0u8; 64];
    // SAFETY: as above.
    check(op, "cuDeviceGetPCIBusId", unsafe {
        sys::cuDeviceGetPCIBusId(bus.as_mut_ptr() as *mut c_char, bus.len() as c_int, dev)
    })?;
    let mut mem: usize = 0;
    // SAFETY: valid out-pointer.
    check(op, "cuDeviceTotalMem_v2", unsafe { sys::cuDeviceTotalMem_v2(&mut mem, dev) })?;
    let a = |attr| attribute(op, dev, attr);
    Ok(GpuInfo {
        ordinal,
        name: string_from_buf(&name),
        pci_bus_id: string_from_buf(&bus).to_ascii_lowercase(),
        total_mem_bytes: mem,
        async_engines: a(Attr::CU_DEVICE_ATTRIBUTE_ASYNC_ENGINE_COUNT)?.max(0) as usize,
        compute_capability: (
            a(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?.max(0) as u32,
            a(Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?.max(0) as u32,
        ),
        sm_count: a(Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?.max(0) as usize,
        stream_mem_ops_64: a(Attr::CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS)? != 0,
        unified_addressing: a(Attr::CU_DEVICE_ATTRIBUTE_UNIFIED_ADDRESSING)? != 0,
    })
}
