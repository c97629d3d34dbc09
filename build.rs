//! Build script: (1) compiles `cuda/*.cu` into one fatbin embedded in the library,
//! (2) runs bindgen over rdma-core's verbs headers (the library is loaded at run time),
//! (3) builds the cxx bridge and the C++ API's library part (`cpp/`).
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let out = PathBuf::from(env::var("OUT_DIR").unwrap());
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=HOCCL_NO_CUDA");
    println!("cargo:rerun-if-env-changed=HOCCL_NVCC");
    println!("cargo:rerun-if-env-changed=HOCCL_CUDA_ARCHS");
    build_fatbin(&out);
    build_verbs_bindings(&out);
    build_cxx_bridge();
}

// ---------------------------------------------------------------- fatbin --------------

fn cuda_sources() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir("cuda")
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    v.retain(|p| p.extension().is_some_and(|e| e == "cu" || e == "cuh"));
    v.sort();
    v
}

fn find_nvcc() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Ok(p) = env::var("HOCCL_NVCC") {
        candidates.push(p.into());
    }
    if let Ok(path) = env::var("PATH") {
        candidates.extend(env::split_paths(&path).map(|d| d.join("nvcc")));
    }
    candidates.push("/usr/local/cuda/bin/nvcc".into());
    let prefix = env::var("HOCCL_PREFIX").map(PathBuf::from).unwrap_or_else(|_| {
        PathBuf::from(env::var("HOME").unwrap_or_else(|_| "/root".into())).join(".cache/hoccl/cuda")
    });
    candidates.push(prefix.join("nvidia/cu13/bin/nvcc"));
    // nvcc finds its headers relative to its real path: always call it canonicalized.
    candidates.into_iter().filter(|p| p.is_file()).find_map(|p| p.canonicalize().ok())
}

/// `HOCCL_CUDA_ARCHS`: comma-separated compute capabilities, e.g. `80,90` (default).
/// Machine code (sm_XX) is built for each, plus PTX for the last one.
fn gencode_args() -> Vec<String> {
    let archs = env::var("HOCCL_CUDA_ARCHS").unwrap_or_else(|_| "80,90".into());
    let list: Vec<&str> = archs.split([',', ';', ' ']).filter(|s| !s.is_empty()).collect();
    assert!(!list.is_empty(), "HOCCL_CUDA_ARCHS is empty");
    let mut args = Vec::new();
    for a in &list {
        let a = a.trim_start_matches("sm_").trim_start_matches("compute_");
        args.push(format!("-gencode=arch=compute_{a},code=sm_{a}"));
    }
    let last = list.last().unwrap().trim_start_matches("sm_").trim_start_matches("compute_");
    args.push(format!("-gencode=arch=compute_{last},code=compute_{last}"));
    args
}

fn build_fatbin(out: &Path) {
    let fatbin = out.join("hoccl.fatbin");
    let sources = cuda_sources();
    for s in &sources {
        println!("cargo:rerun-if-changed={}", s.display());
    }
    println!("cargo:rerun-if-changed=cuda");
    let no_cuda = env::var("HOCCL_NO_CUDA").is_ok_and(|v| v == "1");
    if no_cuda {
        std::fs::write(&fatbin, b"").unwrap();
        println!("cargo:rustc-cfg=hoccl_no_fatbin");
    } else {
        let nvcc = find_nvcc().unwrap_or_else(|| {
            panic!(
                "hoccl: nvcc not found. Run `bash scripts/setup.sh` (installs the pinned nvcc \
                 wheels into ~/.cache/hoccl/cuda), or set HOCCL_NVCC=/path/to/nvcc, or build \
                 without kernels with HOCCL_NO_CUDA=1."
            )
        });
        let flags: Vec<String> = gencode_args()
            .into_iter()
            .chain(["-O3", "-std=c++17", "--use_fast_math", "-Xptxas=-v"].map(String::from))
            .collect();
        let key = fatbin_key(&nvcc, &flags);
        let cache = fatbin_cache_dir(out);
        let (cached_bin, cached_log) = (cache.join(format!("{key}.fatbin")), cache.join(format!("{key}.ptxas.log")));
        if cached_bin.is_file() && cached_log.is_file() {
            std::fs::copy(&cached_bin, &fatbin).unwrap();
            std::fs::copy(&cached_log, out.join("ptxas.log")).unwrap();
        } else {
            run_nvcc(&nvcc, &sources, &flags, out, &fatbin);
            // Publish with a rename, so a concurrent build never reads half a file.
            if std::fs::create_dir_all(&cache).is_ok() {
                let pid = std::process::id();
                let (tmp_bin, tmp_log) = (cache.join(format!("{key}.{pid}.tmp")), cache.join(format!("{key}.{pid}.log.tmp")));
                let published = std::fs::copy(&fatbin, &tmp_bin).is_ok()
                    && std::fs::copy(out.join("ptxas.log"), &tmp_log).is_ok()
                    && std::fs::rename(&tmp_log, &cached_log).is_ok()
                    && std::fs::rename(&tmp_bin, &cached_bin).is_ok();
                if !published {
                    let _ = std::fs::remove_file(&tmp_bin);
                    let _ = std::fs::remove_file(&tmp_log);
                }
                prune_fatbin_cache(&cache, 4);
            }
        }
    }
    let len = std::fs::metadata(&fatbin).unwrap().len();
    std::fs::write(
        out.join("fatbin.rs"),
        format!("/// Length of the embedded fatbin in bytes (0 without kernels).\npub const FATBIN_LEN: usize = {len};\n"),
    )
    .unwrap();
}

/// Where compiled fatbins are kept, keyed by [`fatbin_key`]: `<target>/hoccl-fatbin/`, shared by
/// every profile of one target directory, so `cargo build --release` after `cargo test` (or
/// CMake's release step) reuses the kernels instead of compiling them again (the fatbin is
/// the slowest part of a build). `HOCCL_FATBIN_CACHE` names another folder.
fn fatbin_cache_dir(out: &Path) -> PathBuf {
    println!("cargo:rerun-if-env-changed=HOCCL_FATBIN_CACHE");
    if let Ok(dir) = env::var("HOCCL_FATBIN_CACHE") {
        return dir.into();
    }
    // OUT_DIR is <target>/[<triple>/]<profile>/build/hoccl-<hash>/out.
    let base = out.ancestors().nth(4).unwrap_or(out);
    base.join("hoccl-fatbin")
}

/// FNV-1a over everything that decides the fatbin's bytes: nvcc's identity (`--version`) and
/// path, the flags, and the name and contents of every file in `cuda/` (headers included).
fn fatbin_key(nvcc: &Path, flags: &[String]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    let mut feed = |bytes: &[u8]| {
        for b in bytes.iter().chain(&[0xffu8]) {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
    };
    let version = Command::new(nvcc).arg("--version").output().map(|o| o.stdout).unwrap_or_default();
    feed(&version);
    feed(nvcc.as_os_str().as_encoded_bytes());
    for f in flags {
        feed(f.as_bytes());
    }
    let mut files: Vec<PathBuf> = std::fs::read_dir("cuda")
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).collect())
        .unwrap_or_default();
    files.sort();
    for f in files.iter().filter(|f| f.is_file()) {
        feed(f.file_name().unwrap().as_encoded_bytes());
        feed(&std::fs::read(f).unwrap_or_default());
    }
    format!("{h:016x}")
}

/// Keeps the `keep` most recent fatbins (and their logs) in `cache`, so edits to `cuda/`
/// do not fill the target directory.
fn prune_fatbin_cache(cache: &Path, keep: usize) {
    let Ok(dir) = std::fs::read_dir(cache) else { return };
    let mut bins: Vec<(std::time::SystemTime, PathBuf)> = dir
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|e| e == "fatbin"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .collect();
    bins.sort_by(|a, b| b.0.cmp(&a.0));
    for (_, bin) in bins.into_iter().skip(keep) {
        let _ = std::fs::remove_file(bin.with_extension("ptxas.log"));
        let _ = std::fs::remove_file(bin);
    }
}

fn run_nvcc(nvcc: &Path, sources: &[PathBuf], flags: &[String], out: &Path, fatbin: &Path) {
    // One translation unit that includes every kernel file, so nvcc makes one fatbin.
    let unity = out.join("hoccl_all.cu");
    let body: String = sources
        .iter()
        .filter(|p| p.extension().is_some_and(|e| e == "cu"))
        .map(|p| format!("#include \"{}\"\n", p.canonicalize().unwrap().display()))
        .collect();
    std::fs::write(&unity, body).unwrap();
    let status = Command::new(nvcc)
        .arg("-fatbin")
        // ptxas runs once per architecture, single-threaded each; in parallel they take the
        // time of the slowest instead of the sum (the fatbin is the same bytes).
        .args(["--threads", "0"])
        .args(flags)
        .arg("-I")
        .arg(Path::new("cuda").canonicalize().unwrap())
        .arg("-o")
        .arg(fatbin)
        .arg(&unity)
        .output()
        .unwrap_or_else(|e| panic!("hoccl: could not run {}: {e}", nvcc.display()));
    if !status.status.success() {
        panic!(
            "hoccl: nvcc failed ({}):\n{}\n{}",
            nvcc.display(),
            String::from_utf8_lossy(&status.stdout),
            String::from_utf8_lossy(&status.stderr)
        );
    }
    std::fs::write(out.join("ptxas.log"), &status.stderr).unwrap();
}

// ---------------------------------------------------------------- verbs ---------------

/// Exported libibverbs functions that `transport::verbs::sys` loads with dlsym. Bindgen
/// declares them only so that sys.rs can check its function-pointer types against the
/// headers at compile time; nothing calls the declarations, so nothing links libibverbs.
const VERBS_DLSYM_FNS: &[&str] = &[
    "ibv_get_device_list",
    "ibv_free_device_list",
    "ibv_get_device_name",
    "ibv_get_device_guid",
    "ibv_open_device",
    "ibv_close_device",
    "ibv_query_device",
    "ibv_query_port",
    "ibv_query_gid",
    "ibv_alloc_pd",
    "ibv_dealloc_pd",
    "ibv_create_cq",
    "ibv_destroy_cq",
    "ibv_reg_mr_iova2",
    "ibv_reg_dmabuf_mr",
    "ibv_dereg_mr",
    "ibv_create_qp",
    "ibv_modify_qp",
    "ibv_destroy_qp",
    "ibv_wc_status_str",
];

/// Static inline verbs that get C wrappers (`<name>__extern`). Only those that call through
/// the provider's ops tables: a wrapper that called an exported symbol would make every
/// binary linking hoccl need libibverbs at link time.
const VERBS_STATIC_FNS: &[&str] = &["ibv_post_send", "ibv_post_recv", "ibv_poll_cq", "ibv_req_notify_cq", "hoccl_ibv_query_port_ex"];

fn build_verbs_bindings(out: &Path) {
    println!("cargo:rerun-if-changed=src/transport/verbs/wrapper.h");
    let header = "src/transport/verbs/wrapper.h";
    let wrap_c = out.join("verbs_static_fns.c");
    let mut builder = bindgen::Builder::default()
        .header(header)
        .allowlist_type("ibv_.*")
        .allowlist_var("IBV_.*");
    for f in VERBS_DLSYM_FNS.iter().chain(VERBS_STATIC_FNS) {
        builder = builder.allowlist_function(f);
    }
    let bindings = builder
        .wrap_static_fns(true)
        .wrap_static_fns_path(wrap_c.with_extension(""))
        .derive_default(true)
        .prepend_enum_name(false)
        .layout_tests(false)
        .generate()
        .expect("hoccl: bindgen over infiniband/verbs.h failed (is libibverbs-dev installed? run scripts/setup.sh)");
    bindings.write_to_file(out.join("verbs_sys.rs")).unwrap();
    // The wrappers only go through the function tables in `ibv_context`, so they need no
    // link-time libibverbs; exported functions are dlsym'd.
    cc::Build::new()
        .file(&wrap_c)
        .include(env::current_dir().unwrap())
        .warnings(false)
        .compile("hoccl_verbs_wrap");
}

// ---------------------------------------------------------------- cxx -----------------

fn build_cxx_bridge() {
    println!("cargo:rerun-if-changed=src/ffi/bridge.rs");
    println!("cargo:rerun-if-changed=cpp");
    println!("cargo:rerun-if-changed=include");
    println!("cargo:rerun-if-env-changed=MPICC");
    let mut b = cxx_build::bridge("src/ffi/bridge.rs");
    for f in std::fs::read_dir("cpp").unwrap().filter_map(|e| e.ok()).map(|e| e.path()) {
        if f.extension().is_some_and(|e| e == "cc") {
            b.file(&f);
        }
    }
    // cpp/ includes hoccl.hpp, which includes <mpi.h> (without MPI's C++ bindings, as the
    // CMake package's users).
    b.includes(mpi_include_dirs()).define("OMPI_SKIP_MPICXX", None).define("MPICH_SKIP_MPICXX", None);
    b.include("include").std("c++17").flag_if_supported("-Wno-unused-parameter").compile("hoccl_cxx");
}

/// The `-I` directories of the MPI compiler wrapper (`MPICC`, default `mpicc`), as the
/// `mpi` crate finds MPI; none if it cannot be run (then `<mpi.h>` must be on the default
/// include path).
fn mpi_include_dirs() -> Vec<PathBuf> {
    let mpicc = env::var("MPICC").unwrap_or_else(|_| "mpicc".into());
    let Ok(out) = Command::new(mpicc).arg("-show").output() else { return Vec::new() };
    String::from_utf8_lossy(&out.stdout).split_whitespace().filter_map(|a| a.strip_prefix("-I")).map(PathBuf::from).collect()
}
