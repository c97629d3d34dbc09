//! Device memory, IPC export/import, host-mapped flags and synchronous host copies.
use super::driver::{check, cuda_error, error_name, has_symbols};
use super::{lock, Context, CudaDevice, Import};
use crate::device::{Allocation, DevPtr, ExportHandle, FlagSlab, MemoryInUse};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use cudarc::driver::sys::CUpointer_attribute as PA;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// An allocation this process exported, by handle bytes. `cuIpcOpenMemHandle` refuses a
/// handle from its own process, so `import` serves these from here instead.
#[derive(Clone, Copy, Debug)]
struct LocalExport {
    base: u64,
    len: usize,
}

fn local_exports() -> &'static Mutex<HashMap<[u8; 64], LocalExport>> {
    static EXPORTS: OnceLock<Mutex<HashMap<[u8; 64], LocalExport>>> = OnceLock::new();
    EXPORTS.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Pointer attributes, each read into a zeroed u64 slot (the driver writes 1, 4 or 8 bytes
/// depending on the attribute; all are little-endian integers).
fn pointer_attributes<const N: usize>(op: &'static str, p: DevPtr, attrs: [PA; N]) -> Result<[u64; N]> {
    let mut attrs = attrs;
    let mut vals = [0u64; N];
    let mut data: [*mut c_void; N] = [std::ptr::null_mut(); N];
    for (d, v) in data.iter_mut().zip(vals.iter_mut()) {
        *d = v as *mut u64 as *mut c_void;
    }
    // SAFETY: attrs and data both hold N entries; every data slot is 8 writable bytes, enough
    // for each attribute requested here. For an address unknown to CUDA the call succeeds and
    // leaves the slots at their defaults (zero).
    let r = unsafe { sys::cuPointerGetAttributes(N as u32, attrs.as_mut_ptr(), data.as_mut_ptr(), p.0) };
    // Some drivers answer an address that no context knows with an error instead of
    // defaults; the caller's context is current, so these mean "not CUDA memory".
    use sys::CUresult as R;
    if matches!(r, R::CUDA_ERROR_INVALID_VALUE | R::CUDA_ERROR_NOT_FOUND | R::CUDA_ERROR_INVALID_CONTEXT) {
        return Err(Error::invalid_arg(op, format!("{:#x}: not memory known to CUDA ({})", p.0, error_name(r))));
    }
    check(op, "cuPointerGetAttributes", r)?;
    Ok(vals)
}

/// The buffer id of the allocation holding `p`, or `InvalidArgument` unless `p` is device
/// memory of GPU `ordinal`.
fn device_memory(op: &'static str, p: DevPtr, ordinal: usize) -> Result<u64> {
    let [mem_type, id, dev] =
        pointer_attributes(op, p, [PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE, PA::CU_POINTER_ATTRIBUTE_BUFFER_ID, PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL])?;
    check_device_memory(op, p, ordinal, mem_type, dev)?;
    Ok(id)
}

/// The allocation holding `p` (buffer id, start, length) in one driver call, or
/// `InvalidArgument` unless `p` is device memory of GPU `ordinal`. Every collective validates
/// its buffers with this on the calling thread, whose driver calls bound a small op's time
/// (docs/design.md, "Small operations").
fn device_range(op: &'static str, p: DevPtr, ordinal: usize) -> Result<(u64, u64, usize)> {
    let [mem_type, id, dev, base, len] = pointer_attributes(
        op,
        p,
        [
            PA::CU_POINTER_ATTRIBUTE_MEMORY_TYPE,
            PA::CU_POINTER_ATTRIBUTE_BUFFER_ID,
            PA::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
            PA::CU_POINTER_ATTRIBUTE_RANGE_START_ADDR,
            PA::CU_POINTER_ATTRIBUTE_RANGE_SIZE,
        ],
    )?;
    check_device_memory(op, p, ordinal, mem_type, dev)?;
    Ok((id, base, len as usize))
}

fn check_device_memory(op: &'static str, p: DevPtr, ordinal: usize, mem_type: u64, dev: u64) -> Result<()> {
    if mem_type != sys::CUmemorytype::CU_MEMORYTYPE_DEVICE as u64 {
        let what = match mem_type {
            0 => "not memory known to CUDA",
            t if t == sys::CUmemorytype::CU_MEMORYTYPE_HOST as u64 => "host memory, not device memory",
            _ => "not device memory",
        };
        return Err(Error::invalid_arg(op, format!("{:#x}: {what}", p.0)));
    }
    if dev as usize != ordinal {
        return Err(Error::invalid_arg(op, format!("{:#x} is memory of GPU {dev}, not of GPU {ordinal}", p.0)));
    }
    Ok(())
}

/// The owner of a flag slab's pinned memory: frees it when the slab drops.
struct PinnedFlags {
    host: *mut c_void,
    bytes: usize,
    ctx: Arc<Context>,
}

// SAFETY: the pointer is only freed (once, in Drop); the words are accessed through the
// FlagSlab's atomics. The context handle may be used from any thread.
unsafe impl Send for PinnedFlags {}
// SAFETY: as above; PinnedFlags has no methods besides Drop.
unsafe impl Sync for PinnedFlags {}

impl Drop for PinnedFlags {
    fn drop(&mut self) {
        let _guard = self.ctx.enter("FlagSlab::drop").map_err(|e| log::warn!("hoccl: {e}")).ok();
        // SAFETY: host came from cuMemHostAlloc and is freed exactly once, here.
        let r = unsafe { sys::cuMemFreeHost(self.host) };
        if r != sys::CUresult::CUDA_SUCCESS {
            log::warn!("hoccl: cuMemFreeHost of a flag slab failed: {}", error_name(r));
        } else {
            account_pinned_free(self.bytes);
        }
    }
}

impl CudaDevice {
    pub(super) fn mem_alloc(&self, len: usize) -> Result<DevPtr> {
        const OP: &str = "Device::alloc";
        if len == 0 {
            return Err(Error::invalid_arg(OP, "zero-byte allocation"));
        }
        let _g = self.enter(OP)?;
        let mut p: sys::CUdeviceptr = 0;
        // SAFETY: valid out-pointer; the context is current.
        check(OP, "cuMemAlloc_v2", unsafe { sys::cuMemAlloc_v2(&mut p, len) })?;
        Ok(DevPtr(p))
    }

    pub(super) fn mem_free(&self, p: DevPtr) -> Result<()> {
        const OP: &str = "Device::free";
        if p.is_null() {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        // A pointer that is not the start of a live allocation (freed twice, offset, foreign)
        // is the caller's error: say so instead of reporting the driver's failure.
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; the driver validates p.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, p.0) };
        if r != sys::CUresult::CUDA_SUCCESS || base != p.0 {
            return Err(Error::invalid_arg(
                OP,
                format!("{:#x} is not the start of a live device allocation (freed already, or not from alloc)", p.0),
            ));
        }
        lock(local_exports()).retain(|_, e| e.base != p.0);
        // SAFETY: p is the base of a live allocation (checked above); freeing memory still in
        // use by queued work is the caller's contract, as with cuMemFree itself.
        check(OP, "cuMemFree_v2", unsafe { sys::cuMemFree_v2(p.0) })
    }

    pub(super) fn mem_allocation(&self, p: DevPtr) -> Result<Allocation> {
        const OP: &str = "Device::allocation";
        let _g = self.enter(OP)?;
        let (id, base, len) = device_range(OP, p, self.info.ordinal)?;
        if len > 0 && base <= p.0 && p.0 - base < len as u64 {
            return Ok(Allocation { base: DevPtr(base), len, id });
        }
        // A driver that leaves the range attributes unset: ask for the range itself.
        let (mut base, mut len): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; p is device memory (checked above).
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut len, p.0) };
        if r == sys::CUresult::CUDA_ERROR_NOT_FOUND || r == sys::CUresult::CUDA_ERROR_INVALID_VALUE {
            return Err(Error::invalid_arg(OP, format!("{:#x}: not inside a device allocation", p.0)));
        }
        check(OP, "cuMemGetAddressRange_v2", r)?;
        Ok(Allocation { base: DevPtr(base), len, id })
    }

    pub(super) fn mem_export(&self, a: &Allocation) -> Result<ExportHandle> {
        const OP: &str = "Device::export";
        let _g = self.enter(OP)?;
        let id = device_memory(OP, a.base, self.info.ordinal)?;
        if id != a.id {
            return Err(Error::invalid_arg(OP, format!("stale allocation {:#x} (freed and reused since)", a.base.0)));
        }
        let [ipc] = pointer_attributes(OP, a.base, [PA::CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE])?;
        if ipc == 0 {
            return Err(Error::invalid_arg(
                OP,
                format!("{:#x} cannot be exported with cuIpcGetMemHandle (pool or VMM memory; use cuMemAlloc/cudaMalloc)", a.base.0),
            ));
        }
        let mut h = sys::CUipcMemHandle { reserved: [0; 64] };
        // SAFETY: valid out-pointer; a.base is the base of a live cuMemAlloc allocation.
        check(OP, "cuIpcGetMemHandle", unsafe { sys::cuIpcGetMemHandle(&mut h, a.base.0) })?;
        let mut bytes = [0u8; 64];
        for (b, c) in bytes.iter_mut().zip(h.reserved.iter()) {
            *b = *c as u8;
        }
        lock(local_exports()).insert(bytes, LocalExport { base: a.base.0, len: a.len });
        Ok(ExportHandle(bytes))
    }

    pub(super) fn mem_import(&self, h: &ExportHandle, len: usize) -> Result<DevPtr> {
        const OP: &str = "Device::import";
        let local = lock(local_exports()).get(&h.0).copied();
        if let Some(e) = local {
            if len > e.len {
                return Err(Error::invalid_arg(OP, format!("{len} bytes requested from a {}-byte allocation", e.len)));
            }
            lock(&self.imports).entry(e.base).or_insert(Import { count: 0, local: true }).count += 1;
            return Ok(DevPtr(e.base));
        }
        let _g = self.enter(OP)?;
        let mut handle = sys::CUipcMemHandle { reserved: [0; 64] };
        for (c, b) in handle.reserved.iter_mut().zip(h.0.iter()) {
            *c = *b as _;
        }
        let mut p: sys::CUdeviceptr = 0;
        let flags = sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out-pointer; the driver validates the handle bytes.
        check(OP, "cuIpcOpenMemHandle_v2", unsafe { sys::cuIpcOpenMemHandle_v2(&mut p, handle, flags) })?;
        let (mut base, mut size): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: valid out-pointers; p was just mapped.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, p) };
        if r != sys::CUresult::CUDA_SUCCESS || size < len {
            // SAFETY: p was opened above and is closed once on this error path.
            let _ = unsafe { sys::cuIpcCloseMemHandle(p) };
            if r != sys::CUresult::CUDA_SUCCESS {
                return Err(cuda_error(OP, "cuMemGetAddressRange_v2", r));
            }
            return Err(Error::invalid_arg(OP, format!("{len} bytes requested from a {size}-byte allocation")));
        }
        lock(&self.imports).entry(p).or_insert(Import { count: 0, local: false }).count += 1;
        note_import_open(p, size);
        Ok(DevPtr(p))
    }

    pub(super) fn mem_unimport(&self, base: DevPtr, _len: usize) -> Result<()> {
        const OP: &str = "Device::unimport";
        let mut imports = lock(&self.imports);
        let Some(entry) = imports.get_mut(&base.0) else {
            return Err(Error::invalid_arg(OP, format!("{:#x} was not imported on this device", base.0)));
        };
        let local = entry.local;
        entry.count -= 1;
        if entry.count == 0 {
            imports.remove(&base.0);
        }
        drop(imports);
        if local {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        // SAFETY: base was returned by cuIpcOpenMemHandle and is closed once per open.
        check(OP, "cuIpcCloseMemHandle", unsafe { sys::cuIpcCloseMemHandle(base.0) })?;
        note_import_close(base.0);
        Ok(())
    }

    /// Close every mapping still open (device drop).
    pub(super) fn drop_imports(&self) {
        for (base, imp) in lock(&self.imports).drain() {
            for _ in 0..if imp.local { 0 } else { imp.count } {
                // SAFETY: base was opened `count` times by cuIpcOpenMemHandle.
                let r = unsafe { sys::cuIpcCloseMemHandle(base) };
                if r != sys::CUresult::CUDA_SUCCESS {
                    log::warn!("hoccl: cuIpcCloseMemHandle({base:#x}) on drop failed: {}", error_name(r));
                } else {
                    note_import_close(base);
                }
            }
        }
    }

    pub(super) fn mem_alloc_flags(&self, n: usize) -> Result<FlagSlab> {
        const OP: &str = "Device::alloc_flags";
        let bytes = n.checked_mul(8).filter(|&b| b > 0).ok_or_else(|| Error::invalid_arg(OP, format!("{n} flags")))?;
        let _g = self.enter(OP)?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer; the context is current.
        check(OP, "cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut host, bytes, flags) })?;
        account_pinned_alloc(bytes);
        let owner = PinnedFlags { host, bytes, ctx: self.ctx.clone() };
        // SAFETY: host points to `bytes` writable bytes just allocated (page aligned).
        unsafe { std::ptr::write_bytes(host as *mut u8, 0, bytes) };
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: host is mapped pinned memory (DEVICEMAP); valid out-pointer.
        check(OP, "cuMemHostGetDevicePointer_v2", unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0) })?;
        // SAFETY: n zeroed, page-aligned u64 words that live as long as `owner`, which the
        // slab keeps; `dev` is the device view of the same words.
        Ok(unsafe { FlagSlab::from_raw(host as *mut u64, DevPtr(dev), n, Box::new(owner)) })
    }

    /// Page-locked host memory, portable to every context and mapped for the device, so
    /// `cuMemcpyAsync` on a copy queue moves between it and device memory by address
    /// (unified addressing) and the CPU reads and writes it directly.
    pub(super) fn mem_alloc_host(&self, len: usize) -> Result<DevPtr> {
        const OP: &str = "Device::alloc_host";
        if len == 0 {
            return Err(Error::invalid_arg(OP, "zero-byte allocation"));
        }
        let _g = self.enter(OP)?;
        let mut host: *mut c_void = std::ptr::null_mut();
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: valid out-pointer; the context is current.
        check(OP, "cuMemHostAlloc", unsafe { sys::cuMemHostAlloc(&mut host, len, flags) })?;
        note_host_alloc(host as u64, len);
        Ok(DevPtr(host as u64))
    }

    pub(super) fn mem_free_host(&self, p: DevPtr) -> Result<()> {
        const OP: &str = "Device::free_host";
        if p.is_null() {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        // SAFETY: the driver rejects a pointer cuMemHostAlloc did not return; the caller
        // frees each once, after the copies that use it have completed.
        check(OP, "cuMemFreeHost", unsafe { sys::cuMemFreeHost(p.0 as *mut c_void) })?;
        note_host_free(p.0);
        Ok(())
    }

    /// Register `len` bytes of host memory at `ptr` (a shared-memory mapping another process
    /// writes too) for this device: `cuMemHostRegister` with `DEVICEMAP | PORTABLE`, so
    /// every context reaches it, and the device address of `ptr`.
    pub(super) fn mem_map_host(&self, ptr: *mut u8, len: usize) -> Result<DevPtr> {
        const OP: &str = "Device::map_host";
        if ptr.is_null() || ptr as usize % 8 != 0 || len == 0 {
            return Err(Error::invalid_arg(OP, format!("{ptr:p}+{len}: want a non-null, 8-byte aligned, non-empty range")));
        }
        let _g = self.enter(OP)?;
        let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
        // SAFETY: the caller's `len` bytes at `ptr` are mapped and stay so until
        // `unmap_host`; the driver pins them.
        check(OP, "cuMemHostRegister_v2", unsafe { sys::cuMemHostRegister_v2(ptr as *mut c_void, len, flags) })?;
        let mut dev: sys::CUdeviceptr = 0;
        // SAFETY: ptr was registered with DEVICEMAP just above; valid out-pointer.
        let r = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut dev, ptr as *mut c_void, 0) };
        if let Err(e) = check(OP, "cuMemHostGetDevicePointer_v2", r) {
            // SAFETY: registered above, unregistered once; nothing was queued on it.
            unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) };
            return Err(e);
        }
        note_host_registration(ptr as u64, len);
        Ok(DevPtr(dev))
    }

    pub(super) fn mem_unmap_host(&self, ptr: *mut u8) -> Result<()> {
        const OP: &str = "Device::unmap_host";
        let _g = self.enter(OP)?;
        // SAFETY: the driver rejects a pointer that is not registered; the caller unregisters
        // only after every stream operation on the range has run.
        check(OP, "cuMemHostUnregister", unsafe { sys::cuMemHostUnregister(ptr as *mut c_void) })?;
        forget_host_registration(ptr as u64);
        Ok(())
    }

    pub(super) fn mem_copy_to_host(&self, dst: &mut [u8], src: DevPtr) -> Result<()> {
        const OP: &str = "Device::copy_to_host";
        if dst.is_empty() {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        // SAFETY: dst is a valid writable host buffer of dst.len() bytes; the driver
        // validates src.
        check(OP, "cuMemcpyDtoH_v2", unsafe { sys::cuMemcpyDtoH_v2(dst.as_mut_ptr() as *mut c_void, src.0, dst.len()) })
    }

    pub(super) fn mem_copy_from_host(&self, dst: DevPtr, src: &[u8]) -> Result<()> {
        const OP: &str = "Device::copy_from_host";
        if src.is_empty() {
            return Ok(());
        }
        let _g = self.enter(OP)?;
        // SAFETY: src is a valid host buffer of src.len() bytes; the driver validates dst.
        check(OP, "cuMemcpyHtoD_v2", unsafe { sys::cuMemcpyHtoD_v2(dst.0, src.as_ptr() as *const c_void, src.len()) })?;
        // From pageable memory cuMemcpyHtoD returns once `src` is in the driver's staging
        // buffer; the DMA into `dst` may still be running on the legacy stream, which work on
        // our CU_STREAM_NON_BLOCKING streams does not wait for. Wait here, so that
        // "synchronous" holds: a kernel launched next on any stream sees every byte.
        let legacy = 1usize as sys::CUstream; // CU_STREAM_LEGACY
        // SAFETY: CU_STREAM_LEGACY is a valid stream handle in any current context.
        check(OP, "cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(legacy) })
    }
}

// ---------------------------------------------------------------- memory accounting ------
// Process-wide counts for `Device::memory_in_use`: the driver reports device memory
// (`cuMemGetInfo`) but not which pinned host memory or IPC mappings are hoccl's, so those
// are counted where hoccl makes and frees them.

/// Bytes of pinned host memory hoccl holds (`alloc_host`, `alloc_flags`, `map_host`).
static PINNED_BYTES: AtomicU64 = AtomicU64::new(0);

/// `alloc_host` allocations by address, with their lengths (`free_host` gets only the address).
fn host_allocs() -> &'static Mutex<HashMap<u64, usize>> {
    static HOST: OnceLock<Mutex<HashMap<u64, usize>>> = OnceLock::new();
    HOST.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Open IPC imports by base address here: how many opens, and the mapping's size.
fn open_imports() -> &'static Mutex<HashMap<u64, (u64, u64)>> {
    static OPEN: OnceLock<Mutex<HashMap<u64, (u64, u64)>>> = OnceLock::new();
    OPEN.get_or_init(|| Mutex::new(HashMap::new()))
}

fn account_pinned_alloc(bytes: usize) {
    PINNED_BYTES.fetch_add(bytes as u64, Ordering::Relaxed);
}

fn account_pinned_free(bytes: usize) {
    // Saturating: a count can never go below zero, whatever order frees are seen in.
    let _ = PINNED_BYTES.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| Some(v.saturating_sub(bytes as u64)));
}

/// Ranges `map_host` registered (pinned by the driver), by address, with their lengths.
fn host_registrations() -> &'static Mutex<HashMap<u64, usize>> {
    static REG: OnceLock<Mutex<HashMap<u64, usize>>> = OnceLock::new();
    REG.get_or_init(|| Mutex::new(HashMap::new()))
}

/// Count `len` pinned bytes at `p`, remembered in `table` for the matching [`unpin`].
fn pin(table: &Mutex<HashMap<u64, usize>>, p: u64, len: usize) {
    account_pinned_alloc(len);
    lock(table).insert(p, len);
}

/// Stop counting what [`pin`] counted at `p` in `table` (nothing when it is not there).
fn unpin(table: &Mutex<HashMap<u64, usize>>, p: u64) {
    if let Some(len) = lock(table).remove(&p) {
        account_pinned_free(len);
    }
}

fn note_host_registration(p: u64, len: usize) {
    pin(host_registrations(), p, len);
}

fn forget_host_registration(p: u64) {
    unpin(host_registrations(), p);
}

fn note_host_alloc(p: u64, len: usize) {
    pin(host_allocs(), p, len);
}

fn note_host_free(p: u64) {
    unpin(host_allocs(), p);
}

fn note_import_open(base: u64, size: usize) {
    lock(open_imports()).entry(base).or_insert((0, size as u64)).0 += 1;
}

fn note_import_close(base: u64) {
    let mut open = lock(open_imports());
    if let Some(e) = open.get_mut(&base) {
        e.0 -= 1;
        if e.0 == 0 {
            open.remove(&base);
        }
    }
}

impl CudaDevice {
    /// `cuMemGetInfo` on this GPU, with the process-wide counts above.
    pub(super) fn mem_in_use(&self) -> Result<MemoryInUse> {
        const OP: &str = "Device::memory_in_use";
        if !has_symbols(&["cuMemGetInfo_v2"]) {
            return Err(Error::invalid_usage(OP, "the driver has no cuMemGetInfo_v2"));
        }
        let _g = self.enter(OP)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: valid out-pointers; this device's context is current.
        check(OP, "cuMemGetInfo_v2", unsafe { sys::cuMemGetInfo_v2(&mut free, &mut total) })?;
        let (imports, import_bytes) = lock(open_imports()).values().fold((0, 0), |(n, b), (c, s)| (n + c, b + c * s));
        Ok(MemoryInUse {
            device_bytes: total.saturating_sub(free) as u64,
            pinned_host_bytes: PINNED_BYTES.load(Ordering::Relaxed),
            imports,
            import_bytes,
        })
    }
}
