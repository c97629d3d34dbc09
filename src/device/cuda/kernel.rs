//! Kernel launches from the embedded fatbin: the module is loaded when the first device of a
//! CUDA context opens, once per context (every `CudaDevice` of that context shares it), with
//! all its functions, and functions are looked up once per device by name.
use super::driver::{check, error_name};
use super::{cu_stream, lock, CudaDevice};
use crate::device::{kernels, DevPtr, StreamHandle};
use crate::error::{Error, Result};
use cudarc::driver::sys;
use std::collections::HashMap;
use std::sync::Mutex;
use std::ffi::{c_void, CString};

/// The loaded module and the functions found in it. Raw driver handles, valid while the
/// device's context lives; only touched under the device's mutex.
#[derive(Default)]
pub(super) struct KernelCache {
    /// The context's module (SHARED_MODULES), once this device has asked for it.
    module: Option<sys::CUmodule>,
    funcs: HashMap<String, sys::CUfunction>,
    /// Dynamic shared memory allowed per function (only those above STATIC_SMEM_LIMIT).
    smem_allowed: HashMap<String, u32>,
    /// `u32` globals of the module read so far (constants the kernels publish).
    globals: HashMap<String, u32>,
    /// CTAs per SM by function, for the (block threads, dynamic shared memory) it was asked with.
    occupancy: HashMap<String, (u32, u32, u32)>,
}

/// Dynamic shared memory a launch gets without cuFuncSetAttribute.
const STATIC_SMEM_LIMIT: u32 = 48 << 10;

// SAFETY: CUmodule/CUfunction are driver handles usable from any thread.
unsafe impl Send for KernelCache {}

const OP: &str = "CudaDevice::launch";

/// The open devices and the module of each context (by its CUcontext). Loading a module, or
/// lazily one of its functions, may wait for the context's streams: on the H200 (driver
/// 580) a thread rank's `cuModuleLoadData` at its first launch (the root of a Broadcast
/// filling its send buffer) never returned while another rank's stream waited in the
/// collective for it, until the 10 s timeout. So a context has one module, with every
/// function loaded, loaded when the context's first device opens (`register_module_user`),
/// when no collective of hoccl can be pending in it yet; later devices of the context (ranks
/// that are threads on one GPU, further communicators, the codec's devices) share it, and
/// the last device to close unloads it. Loading runs no kernel: the copy-engine
/// collectives still launch none (`kernels::launch_count`).
static SHARED_MODULES: Mutex<ModuleTable> = Mutex::new(ModuleTable { entries: Vec::new() });

/// Per context (raw handles as integers): the devices open in it and its module, if loaded.
pub(super) struct ModuleTable {
    entries: Vec<CtxModule>,
}

struct CtxModule {
    ctx: usize,
    devices: usize,
    module: Option<usize>,
}

impl ModuleTable {
    /// One more device open in `ctx`; returns how many are open there now.
    pub(super) fn open_device(&mut self, ctx: usize) -> usize {
        match self.entries.iter_mut().find(|e| e.ctx == ctx) {
            Some(e) => {
                e.devices += 1;
                e.devices
            }
            None => {
                self.entries.push(CtxModule { ctx, devices: 1, module: None });
                1
            }
        }
    }

    /// The module of `ctx`; `load` makes it when the context has none yet (its error is
    /// returned and nothing is recorded). An error too when no device is open in `ctx`.
    pub(super) fn module(&mut self, ctx: usize, load: impl FnOnce() -> Result<usize>) -> Result<usize> {
        let e = self
            .entries
            .iter_mut()
            .find(|e| e.ctx == ctx)
            .ok_or_else(|| Error::invalid_arg(OP, "kernel module asked for in a context with no open device"))?;
        if let Some(m) = e.module {
            return Ok(m);
        }
        let m = load()?;
        e.module = Some(m);
        Ok(m)
    }

    /// One device of `ctx` fewer: its module to unload when that was the last device and a
    /// module was loaded; None otherwise (and for a context not in the table).
    pub(super) fn close_device(&mut self, ctx: usize) -> Option<usize> {
        let i = self.entries.iter().position(|e| e.ctx == ctx)?;
        self.entries[i].devices -= 1;
        if self.entries[i].devices > 0 {
            return None;
        }
        self.entries.swap_remove(i).module
    }
}

impl CudaDevice {
    /// Register this newly opened device in its context's entry of SHARED_MODULES and take
    /// the context's module, loading it if this is the context's first device. A load
    /// failure (a GPU the fatbin has no code for) is not fatal here: copy-engine collectives
    /// need no kernel, and the error returns at the first launch.
    pub(super) fn register_module_user(&self) {
        let key = self.ctx.ctx as usize;
        lock(&SHARED_MODULES).open_device(key);
        let r = self.enter("CudaDevice::open").and_then(|_g| Self::module(key, &mut lock(&self.kernels)).map(|_| ()));
        if let Err(e) = r {
            log::info!("hoccl: GPU {}: kernel module not loaded at open ({e}); kernels will fail", self.info.ordinal);
        }
    }

    /// The module of context `key` (this device's), loaded first if the context has none.
    /// The context must be current.
    fn module(key: usize, cache: &mut KernelCache) -> Result<sys::CUmodule> {
        if let Some(m) = cache.module {
            return Ok(m);
        }
        let m = lock(&SHARED_MODULES).module(key, || load_module().map(|m| m as usize))? as sys::CUmodule;
        cache.module = Some(m);
        Ok(m)
    }

    /// The function `name`, loading the module first if needed. The context must be current.
    fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let mut cache = lock(&self.kernels);
        if let Some(&f) = cache.funcs.get(name) {
            return Ok(f);
        }
        let module = Self::module(self.ctx.ctx as usize, &mut cache)?;
        let cname = CString::new(name).map_err(|_| Error::invalid_arg(OP, format!("kernel name {name:?} contains NUL")))?;
        let mut f: sys::CUfunction = std::ptr::null_mut();
        // SAFETY: module is loaded in the current context; valid out-pointer and C string.
        let r = unsafe { sys::cuModuleGetFunction(&mut f, module, cname.as_ptr()) };
        if r == sys::CUresult::CUDA_ERROR_NOT_FOUND {
            return Err(Error::invalid_arg(OP, format!("no kernel named {name} in the embedded fatbin")));
        }
        check(OP, "cuModuleGetFunction", r)?;
        cache.funcs.insert(name.to_string(), f);
        Ok(f)
    }

    /// Launch kernel `name` from the embedded fatbin on stream `s` (module taken when the
    /// device opened, or here if that failed; every launch counted by `kernels::note_launch`). `dependent`:
    /// programmatic dependent launch allowed, so the kernel may start before the stream's
    /// previous kernel has finished, once every CTA of that kernel has started and executed
    /// `griddepcontrol.launch_dependents` (or exited).
    ///
    /// # Safety
    /// `args` must hold one pointer per kernel parameter, each pointing to a value of that
    /// parameter's type, and every device pointer among them must be valid for the
    /// kernel's accesses until the launch completes on the stream. When `dependent`, the
    /// kernel must execute `griddepcontrol.wait` (which returns once the previous work on
    /// the stream has completed and its memory is visible) before it reads or writes
    /// anything that work may touch.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        s: StreamHandle,
        name: &str,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        args: &mut [*mut c_void],
        dependent: bool,
    ) -> Result<()> {
        let _g = self.enter(OP)?;
        let f = self.function(name)?;
        if shared_bytes > STATIC_SMEM_LIMIT {
            self.allow_dynamic_smem(name, f, shared_bytes)?;
        }
        let gate = self.ctx.enqueue_gate(OP);
        let r = if dependent {
            // SAFETY: an all-zero launch attribute is a valid C value (a union of integers
            // and plain structs); its id and value are set below.
            let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
            attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attr.value.programmaticStreamSerializationAllowed = 1;
            let config = sys::CUlaunchConfig {
                gridDimX: grid.0,
                gridDimY: grid.1,
                gridDimZ: grid.2,
                blockDimX: block.0,
                blockDimY: block.1,
                blockDimZ: block.2,
                sharedMemBytes: shared_bytes,
                hStream: cu_stream(s),
                attrs: &mut attr,
                numAttrs: 1,
            };
            // SAFETY: config and its one attribute live across the call; f is a function of
            // this context's module; the argument and ordering contracts are the caller's.
            let r = unsafe { sys::cuLaunchKernelEx(&config, f, args.as_mut_ptr(), std::ptr::null_mut()) };
            check(OP, "cuLaunchKernelEx", r)
        } else {
            // SAFETY: f is a function of this context's module; the argument contract is the
            // caller's (see # Safety); extra is null.
            let r = unsafe {
                sys::cuLaunchKernel(
                    f,
                    grid.0,
                    grid.1,
                    grid.2,
                    block.0,
                    block.1,
                    block.2,
                    shared_bytes,
                    cu_stream(s),
                    args.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            };
            check(OP, "cuLaunchKernel", r)
        };
        drop(gate);
        r?;
        kernels::note_launch();
        Ok(())
    }

    /// The address and size of the module's global `name`, None when the module has none.
    /// The context must be current.
    fn global_ptr(key: usize, cache: &mut KernelCache, name: &str) -> Result<Option<(sys::CUdeviceptr, usize)>> {
        let module = Self::module(key, cache)?;
        let cname = CString::new(name).map_err(|_| Error::invalid_arg(OP, format!("global name {name:?} contains NUL")))?;
        let (mut dptr, mut bytes): (sys::CUdeviceptr, usize) = (0, 0);
        // SAFETY: module is loaded in the current context; valid out-pointers and C string.
        let r = unsafe { sys::cuModuleGetGlobal_v2(&mut dptr, &mut bytes, module, cname.as_ptr()) };
        if r == sys::CUresult::CUDA_ERROR_NOT_FOUND {
            return Ok(None);
        }
        check(OP, "cuModuleGetGlobal", r)?;
        Ok(Some((dptr, bytes)))
    }

    /// The value of the module's `u32` global `name` (a constant a kernel file publishes,
    /// such as the shared memory a kernel needs); read once and cached.
    pub(crate) fn module_u32(&self, name: &str) -> Result<u32> {
        if let Some(&v) = lock(&self.kernels).globals.get(name) {
            return Ok(v);
        }
        let _g = self.enter(OP)?;
        let mut cache = lock(&self.kernels);
        let Some((dptr, bytes)) = Self::global_ptr(self.ctx.ctx as usize, &mut cache, name)? else {
            return Err(Error::invalid_arg(OP, format!("no global named {name} in the kernels")));
        };
        if bytes != 4 {
            return Err(Error::invalid_arg(OP, format!("global {name} has {bytes} bytes, not 4")));
        }
        // The first read may come from a call enqueued into a stream capture; its private
        // stream's synchronize is a call the capture modes other than relaxed refuse on
        // this thread (and then invalidate the capture).
        let mut v = 0;
        self.graph_relaxed(&mut || {
            v = self.read_global_u32(dptr)?;
            Ok(())
        })?;
        cache.globals.insert(name.to_string(), v);
        Ok(v)
    }

    /// Read a 4-byte device global (the context must be current). Not with `cuMemcpyDtoH`: a
    /// synchronous copy runs on the legacy default stream, which first waits for the work queued
    /// on it and on every blocking stream, and launchers read globals while enqueueing a
    /// collective whose handshake wait is already on the caller's stream. On stream 0 (or
    /// `cudaStreamLegacy`, `cudaStreamPerThread`, a stream created without
    /// `CU_STREAM_NON_BLOCKING`) the copy would wait for that collective, which waits for this
    /// thread to finish enqueueing it (a deadlock at a rank's first reduce step). So the copy
    /// goes through a private non-blocking stream.
    fn read_global_u32(&self, dptr: sys::CUdeviceptr) -> Result<u32> {
        let mut s: sys::CUstream = std::ptr::null_mut();
        let flags = sys::CUstream_flags::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; the caller made the context current.
        check(OP, "cuStreamCreate", unsafe { sys::cuStreamCreate(&mut s, flags) })?;
        let mut v = 0u32;
        let gate = self.ctx.enqueue_gate(OP);
        // SAFETY: dptr is a 4-byte device global of the current context's module; v is 4 bytes
        // and outlives the copy (the stream is synchronized before v is read or dropped).
        let queued = check(OP, "cuMemcpyDtoHAsync", unsafe { sys::cuMemcpyDtoHAsync_v2(&mut v as *mut u32 as *mut c_void, dptr, 4, s) });
        drop(gate);
        // SAFETY: s was created above and is live.
        let copied = queued.and_then(|_| check(OP, "cuStreamSynchronize", unsafe { sys::cuStreamSynchronize(s) }));
        // SAFETY: s was created above and is destroyed once; nothing is queued on it any more
        // (synchronized, or the copy was never queued).
        let r = unsafe { sys::cuStreamDestroy_v2(s) };
        if r != sys::CUresult::CUDA_SUCCESS {
            log::warn!("hoccl: cuStreamDestroy of a private stream failed: {}", error_name(r));
        }
        copied.map(|_| v)
    }

    /// CTAs of kernel `name` that fit one SM with `block` threads and `smem` bytes of
    /// dynamic shared memory (allowing that much first when it is above 48 KB); asked of the
    /// driver once per function and cached, since launchers call this for every launch.
    pub(crate) fn ctas_per_sm(&self, name: &str, block: u32, smem: u32) -> Result<u32> {
        if let Some(&(b, s, n)) = lock(&self.kernels).occupancy.get(name) {
            if (b, s) == (block, smem) {
                return Ok(n);
            }
        }
        let _g = self.enter(OP)?;
        let f = self.function(name)?;
        if smem > STATIC_SMEM_LIMIT {
            self.allow_dynamic_smem(name, f, smem)?;
        }
        let mut n: i32 = 0;
        // SAFETY: f is a live function of this context's module; valid out-pointer.
        check(OP, "cuOccupancyMaxActiveBlocksPerMultiprocessor", unsafe {
            sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(&mut n, f, block as i32, smem as usize)
        })?;
        let n = n.max(0) as u32;
        lock(&self.kernels).occupancy.insert(name.to_string(), (block, smem, n));
        Ok(n)
    }

    /// Above 48 KB a kernel's dynamic shared memory must be allowed first (once per
    /// function and size; the driver refuses sizes the device cannot give).
    fn allow_dynamic_smem(&self, name: &str, f: sys::CUfunction, bytes: u32) -> Result<()> {
        let mut cache = lock(&self.kernels);
        if cache.smem_allowed.get(name).is_some_and(|&b| b >= bytes) {
            return Ok(());
        }
        // SAFETY: f is a live function of this context's module; the attribute takes an int.
        let r = unsafe {
            sys::cuFuncSetAttribute(
                f,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        };
        check(OP, "cuFuncSetAttribute", r)?;
        cache.smem_allowed.insert(name.to_string(), bytes);
        Ok(())
    }

    /// `hoccl_fill_pattern` over `len` bytes at `dst` (tests and benchmarks only).
    pub(super) fn fill_pattern(&self, s: StreamHandle, dst: DevPtr, len: usize, seed: u64) -> Result<()> {
        if len == 0 {
            return Ok(());
        }
        const THREADS: u32 = 256;
        let words = (len as u64).div_ceil(4);
        let max_blocks = (self.info.sm_count.max(1) * 16) as u64;
        let blocks = words.div_ceil(THREADS as u64).clamp(1, max_blocks) as u32;
        let (mut p, mut n, mut seed) = (dst.0, len as u64, seed);
        let mut args = [
            &mut p as *mut u64 as *mut c_void,
            &mut n as *mut u64 as *mut c_void,
            &mut seed as *mut u64 as *mut c_void,
        ];
        // SAFETY: hoccl_fill_pattern(uint8_t* dst, uint64_t len, uint64_t seed) takes three
        // 8-byte parameters, matched by `args`; it writes only [dst, dst+len), which the
        // caller provides as device memory (the driver reports bad addresses asynchronously).
        unsafe { self.launch(s, "hoccl_fill_pattern", (blocks, 1, 1), (THREADS, 1, 1), 0, &mut args, false) }
            .map_err(|e| e.with_op("Device::fill_pattern_async"))
    }

    /// Leave the context's entry of SHARED_MODULES; the last device of the context unloads
    /// the module (device drop; the context is current or being torn down).
    pub(super) fn unload_module(&self) {
        let mut cache = lock(&self.kernels);
        cache.funcs.clear();
        cache.module = None;
        if let Some(m) = lock(&SHARED_MODULES).close_device(self.ctx.ctx as usize) {
            // SAFETY: m was loaded by cuModuleLoadData into this context, whose devices have
            // all closed; it is unloaded once (the table forgot it).
            let r = unsafe { sys::cuModuleUnload(m as sys::CUmodule) };
            if r != sys::CUresult::CUDA_SUCCESS {
                log::warn!("hoccl: cuModuleUnload failed: {}", error_name(r));
            }
        }
    }
}

/// Load the embedded fatbin into the current context.
fn load_module() -> Result<sys::CUmodule> {
    let embedded = kernels::fatbin();
    if embedded.is_empty() {
        return Err(Error::NoDevice {
            op: OP,
            what: "this build embeds no kernels (built with HOCCL_NO_CUDA=1); rebuild with nvcc available".into(),
        });
    }
    let image = embedded.as_ptr() as *const c_void;
    let mut m: sys::CUmodule = std::ptr::null_mut();
    log::debug!("loading the kernel module");
    // SAFETY: image is the complete embedded fatbin, 64-byte aligned and 'static (the driver
    // copies it); valid out-pointer.
    check(OP, "cuModuleLoadData", unsafe { sys::cuModuleLoadData(&mut m, image) })?;
    kernels::note_module_loaded();
    load_functions(m);
    log::debug!("kernel module loaded");
    Ok(m)
}

/// Under lazy loading (the driver's default), load every function of `m` now rather than at
/// its first use, which may come while another rank's stream in this context waits for the
/// thread that uses it (see SHARED_MODULES). Best effort: drivers before CUDA 12.4 lack
/// these calls (and load eagerly by default), and a failure here resurfaces at the launch.
fn load_functions(m: sys::CUmodule) {
    const CALLS: [&str; 4] = ["cuModuleGetLoadingMode", "cuModuleGetFunctionCount", "cuModuleEnumerateFunctions", "cuFuncLoad"];
    if !super::driver::has_symbols(&CALLS) {
        return;
    }
    let mut mode = sys::CUmoduleLoadingMode::CU_MODULE_EAGER_LOADING;
    // SAFETY: valid out-pointer; the symbol is present (checked above).
    if unsafe { sys::cuModuleGetLoadingMode(&mut mode) } != sys::CUresult::CUDA_SUCCESS
        || mode != sys::CUmoduleLoadingMode::CU_MODULE_LAZY_LOADING
    {
        return;
    }
    let mut n: std::ffi::c_uint = 0;
    // SAFETY: m is a module loaded in the current context; valid out-pointer.
    let r = unsafe { sys::cuModuleGetFunctionCount(&mut n, m) };
    if r != sys::CUresult::CUDA_SUCCESS {
        log::warn!("hoccl: cuModuleGetFunctionCount failed: {}", error_name(r));
        return;
    }
    let mut funcs: Vec<sys::CUfunction> = vec![std::ptr::null_mut(); n as usize];
    // SAFETY: funcs holds n slots, as the driver is told.
    let r = unsafe { sys::cuModuleEnumerateFunctions(funcs.as_mut_ptr(), n, m) };
    if r != sys::CUresult::CUDA_SUCCESS {
        log::warn!("hoccl: cuModuleEnumerateFunctions failed: {}", error_name(r));
        return;
    }
    let mut loaded = 0;
    for f in funcs {
        // SAFETY: f is a function of m, enumerated by the driver just above.
        let r = unsafe { sys::cuFuncLoad(f) };
        if r == sys::CUresult::CUDA_SUCCESS {
            loaded += 1;
        } else {
            log::warn!("hoccl: cuFuncLoad failed: {}", error_name(r));
        }
    }
    log::debug!("lazy module loading: {loaded} of {n} functions loaded with the module");
}

#[cfg(test)]
mod tests {
    use super::ModuleTable;
    use crate::error::Error;

    #[test]
    fn one_module_per_context_unloaded_with_its_last_device() {
        let mut t = ModuleTable { entries: Vec::new() };
        let loads = std::cell::Cell::new(0);
        let load = |m: usize| {
            let loads = &loads;
            move || {
                loads.set(loads.get() + 1);
                Ok(m)
            }
        };
        assert_eq!(t.open_device(1), 1);
        assert_eq!(t.open_device(1), 2, "a second device in context 1");
        assert_eq!(t.open_device(2), 1, "another context counts its own devices");
        assert_eq!(t.module(1, load(10)).unwrap(), 10);
        assert_eq!(t.module(1, load(11)).unwrap(), 10, "context 1's other device takes its module");
        assert_eq!(t.module(2, load(20)).unwrap(), 20, "another context loads its own");
        assert_eq!(loads.get(), 2, "one load per context");
        assert_eq!(t.close_device(1), None, "one device of context 1 still open");
        assert_eq!(t.close_device(2), Some(20), "context 2's last device unloads");
        assert_eq!(t.close_device(1), Some(10));
        assert_eq!(t.close_device(1), None, "context 1 is gone");
        assert!(t.entries.is_empty());
        assert!(t.module(1, load(12)).is_err(), "no device open in context 1");
        assert_eq!(t.open_device(1), 1);
        assert_eq!(t.close_device(1), None, "no module was loaded: nothing to unload");
        assert_eq!(t.open_device(1), 1);
        assert_eq!(t.module(1, load(13)).unwrap(), 13, "loaded again after the last device left");
        assert_eq!(loads.get(), 3);
    }

    #[test]
    fn a_failed_load_records_nothing() {
        let mut t = ModuleTable { entries: Vec::new() };
        t.open_device(1);
        assert!(t.module(1, || Err(Error::invalid_arg("test", "no module"))).is_err());
        assert_eq!(t.module(1, || Ok(7)).unwrap(), 7, "the next use tries again");
        assert_eq!(t.close_device(1), Some(7));
    }
}
