//! A compute-bound bf16 GEMM through cuBLAS (`cublasGemmEx`, fp32 accumulation), loaded
//! at run time with dlopen. Used by the interference benchmark as the "training kernel".
use crate::dl::{site_packages, Lib};
use hoccl::device::{DevPtr, Device, StreamHandle};
use std::ffi::{c_int, c_void};
use std::sync::Arc;

type Status = c_int;
type Handle = *mut c_void;

type FnCreate = unsafe extern "C" fn(*mut Handle) -> Status;
type FnDestroy = unsafe extern "C" fn(Handle) -> Status;
type FnSetStream = unsafe extern "C" fn(Handle, *mut c_void) -> Status;
#[rustfmt::skip]
type FnGemmEx = unsafe extern "C" fn(
    Handle, c_int, c_int, c_int, c_int, c_int,
    *const c_void, *const c_void, c_int, c_int,
    *const c_void, c_int, c_int,
    *const c_void, *mut c_void, c_int, c_int,
    c_int, c_int,
) -> Status;

const CUBLAS_OP_N: c_int = 0;
const CUDA_R_16BF: c_int = 14;
const CUBLAS_COMPUTE_32F: c_int = 68;
const CUBLAS_GEMM_DEFAULT: c_int = -1;

fn candidates() -> Vec<String> {
    let mut v = Vec::new();
    if let Ok(p) = std::env::var("HOCCL_CUBLAS_LIB") {
        v.push(p);
    }
    for sp in site_packages() {
        v.push(format!("{sp}/nvidia/cublas/lib/libcublas.so.13"));
        v.push(format!("{sp}/nvidia/cu13/lib/libcublas.so.13"));
    }
    for name in ["libcublas.so.13", "libcublas.so.12", "libcublas.so"] {
        v.push(format!("/usr/local/cuda/lib64/{name}"));
    }
    v.extend(["libcublas.so.13".to_string(), "libcublas.so.12".into(), "libcublas.so".into()]);
    v
}

/// Open libcublas, first making its libcublasLt (same directory) globally visible so that
/// a library outside the loader's path still resolves its dependency.
fn open() -> Result<Lib, String> {
    let mut tried = Vec::new();
    for c in candidates() {
        if c.contains('/') {
            if !std::path::Path::new(&c).exists() {
                continue; // the known install paths; only real failures are reported
            }
            let lt = c.replace("libcublas.so", "libcublasLt.so");
            if std::path::Path::new(&lt).exists() {
                if let Err(e) = Lib::open(&lt, true) {
                    tried.push(format!("{lt} ({e})"));
                }
            }
        }
        match Lib::open(&c, false) {
            Ok(l) => return Ok(l),
            Err(e) => tried.push(format!("{c} ({e})")),
        }
    }
    Err(format!("libcublas not found ({}; set HOCCL_CUBLAS_LIB to its path)", tried.join("; ")))
}

/// An m=n=k GEMM C = A·B in bf16 with its buffers and cuBLAS handle, bound to one stream.
pub struct Gemm {
    lib: Lib,
    gemm: FnGemmEx,
    destroy: FnDestroy,
    handle: Handle,
    dev: Arc<dyn Device>,
    bufs: [DevPtr; 3],
    pub n: usize,
}

/// bf16 values in [-1, 1) from a small LCG (finite, normal numbers; no NaN/Inf patterns).
fn bf16_inputs(count: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    let mut out = Vec::with_capacity(count * 2);
    for _ in 0..count {
        x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let f = ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
        out.extend_from_slice(&((f.to_bits() >> 16) as u16).to_le_bytes());
    }
    out
}

impl Gemm {
    /// Load cuBLAS, allocate and fill A and B (plain host-to-device copies, no kernel), and
    /// bind a handle to `stream`. The calling thread must have the GPU's context current.
    pub fn new(dev: &Arc<dyn Device>, stream: StreamHandle, n: usize) -> Result<Gemm, String> {
        let lib = open()?;
        // SAFETY (three lookups): the types are the cuBLAS v2 prototypes of these symbols.
        let create: FnCreate = unsafe { lib.func("cublasCreate_v2") }.ok_or("no cublasCreate_v2")?;
        // SAFETY: as above.
        let destroy: FnDestroy = unsafe { lib.func("cublasDestroy_v2") }.ok_or("no cublasDestroy_v2")?;
        // SAFETY: as above.
        let set_stream: FnSetStream = unsafe { lib.func("cublasSetStream_v2") }.ok_or("no cublasSetStream_v2")?;
        // SAFETY: as above.
        let gemm: FnGemmEx = unsafe { lib.func("cublasGemmEx") }.ok_or("no cublasGemmEx")?;
        let bytes = n * n * 2;
        let mut bufs = [DevPtr::NULL; 3];
        for (i, b) in bufs.iter_mut().enumerate() {
            *b = dev.alloc(bytes).map_err(|e| format!("GEMM buffer: {e}"))?;
            if i < 2 {
                dev.copy_from_host(*b, &bf16_inputs(n * n, 17 + i as u64)).map_err(|e| format!("GEMM input: {e}"))?;
            }
        }
        let mut handle: Handle = std::ptr::null_mut();
        // SAFETY: valid out-pointer; the GPU's context is current (caller's contract).
        let r = unsafe { create(&mut handle) };
        let mut g = Gemm { lib, gemm, destroy, handle, dev: dev.clone(), bufs, n };
        if r != 0 {
            g.handle = std::ptr::null_mut();
            return Err(format!("cublasCreate_v2 failed: status {r}"));
        }
        // SAFETY: live handle; the stream is a live CUstream of this GPU.
        let r = unsafe { set_stream(g.handle, stream.0 as usize as *mut c_void) };
        if r != 0 {
            return Err(format!("cublasSetStream_v2 failed: status {r}"));
        }
        Ok(g)
    }

    pub fn path(&self) -> &str {
        &self.lib.path
    }

    /// Enqueue one GEMM on the handle's stream.
    pub fn run(&self) -> Result<(), String> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let n = self.n as c_int;
        let p = |d: DevPtr| d.0 as usize as *mut c_void;
        // SAFETY: live handle; A, B, C are n*n bf16 device buffers of this GPU that live as
        // long as self; alpha/beta are host floats (default pointer mode) read during the call.
        let r = unsafe {
            (self.gemm)(
                self.handle,
                CUBLAS_OP_N,
                CUBLAS_OP_N,
                n,
                n,
                n,
                &alpha as *const f32 as *const c_void,
                p(self.bufs[0]),
                CUDA_R_16BF,
                n,
                p(self.bufs[1]),
                CUDA_R_16BF,
                n,
                &beta as *const f32 as *const c_void,
                p(self.bufs[2]),
                CUDA_R_16BF,
                n,
                CUBLAS_COMPUTE_32F,
                CUBLAS_GEMM_DEFAULT,
            )
        };
        if r != 0 {
            return Err(format!("cublasGemmEx failed: status {r}"));
        }
        Ok(())
    }
}

impl Drop for Gemm {
    fn drop(&mut self) {
        if !self.handle.is_null() {
            // SAFETY: a handle from cublasCreate_v2, destroyed once.
            unsafe { (self.destroy)(self.handle) };
        }
        for b in self.bufs {
            if !b.is_null() {
                let _ = self.dev.free(b);
            }
        }
    }
}
