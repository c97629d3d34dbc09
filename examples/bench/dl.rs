//! Run-time loading of optional C libraries (NCCL, cuBLAS) with `dlopen`/`dlsym` from
//! `libc`, so the benchmark builds and runs where they are absent.
use std::ffi::{c_void, CStr, CString};

/// An opened shared library. Never closed: NCCL and cuBLAS start threads and register
/// exit handlers that must outlive every use, so unloading them early is unsafe and
/// unloading at exit gains nothing.
pub struct Lib {
    handle: *mut c_void,
    pub path: String,
}

// SAFETY: a dlopen handle is a process-wide token; dlsym is thread-safe on glibc.
unsafe impl Send for Lib {}
// SAFETY: as above; Lib has no interior mutability.
unsafe impl Sync for Lib {}

fn dlerror_string() -> String {
    // SAFETY: dlerror returns null or a NUL-terminated string owned by libc that stays valid
    // until the next dl* call on this thread; it is copied at once.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: p is non-null and NUL-terminated (see above).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Lib {
    /// `dlopen(path, RTLD_NOW | flags)`.
    pub fn open(path: &str, global: bool) -> Result<Lib, String> {
        let c = CString::new(path).map_err(|_| format!("{path:?}: path contains NUL"))?;
        let flags = libc::RTLD_NOW | if global { libc::RTLD_GLOBAL } else { libc::RTLD_LOCAL };
        // SAFETY: c is a valid C string; dlopen runs the library's initializers, which is
        // what loading NCCL/cuBLAS requires.
        let h = unsafe { libc::dlopen(c.as_ptr(), flags) };
        if h.is_null() {
            return Err(dlerror_string());
        }
        Ok(Lib { handle: h, path: path.to_string() })
    }

    /// The first candidate that opens. Paths (names with a '/') that do not exist are
    /// skipped; the error gives every real failure and how many paths were absent.
    pub fn open_first(candidates: &[String], global: bool) -> Result<Lib, String> {
        let mut failed = Vec::new();
        let mut absent = 0;
        for c in candidates {
            if c.contains('/') && !std::path::Path::new(c).exists() {
                absent += 1;
                continue;
            }
            match Lib::open(c, global) {
                Ok(l) => return Ok(l),
                Err(e) => failed.push(e),
            }
        }
        failed.push(format!("{absent} known paths absent"));
        Err(failed.join("; "))
    }

    /// The address of `name`, or None.
    pub fn addr(&self, name: &str) -> Option<*mut c_void> {
        let c = CString::new(name).ok()?;
        // SAFETY: handle is a live dlopen handle; c is a valid C string.
        let p = unsafe { libc::dlsym(self.handle, c.as_ptr()) };
        (!p.is_null()).then_some(p)
    }

    /// The symbol `name` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be an `unsafe extern "C" fn` type whose signature matches the C declaration
    /// of `name` exactly.
    pub unsafe fn func<F: Copy>(&self, name: &str) -> Option<F> {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>(), "F must be a function pointer");
        let p = self.addr(name)?;
        // SAFETY: p is a non-null code address of `name`; the caller guarantees F is the
        // matching function-pointer type, which has the size of a data pointer (asserted).
        Some(unsafe { std::mem::transmute_copy::<*mut c_void, F>(&p) })
    }
}

/// `site-packages` directories of the GPU machine's Python environments (where NCCL and
/// cuBLAS come from as pip packages), newest Python first.
pub fn site_packages() -> Vec<String> {
    let mut out = Vec::new();
    for root in ["/opt/torch/.venv/lib", "/usr/local/lib", "/usr/lib"] {
        let Ok(rd) = std::fs::read_dir(root) else { continue };
        let mut names: Vec<String> = rd
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("python3"))
            .collect();
        names.sort();
        for n in names.iter().rev() {
            for sub in ["site-packages", "dist-packages"] {
                let p = format!("{root}/{n}/{sub}");
                if std::path::Path::new(&p).is_dir() {
                    out.push(p);
                }
            }
        }
    }
    out
}
