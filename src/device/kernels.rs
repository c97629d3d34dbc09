//! The fatbin that `build.rs` compiles from `cuda/*.cu`, embedded 64-byte aligned, and the
//! counters that prove which paths launch kernels (the copy-engine collectives must not).
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

include!(concat!(env!("OUT_DIR"), "/fatbin.rs"));

#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);

static FATBIN: Aligned<[u8; FATBIN_LEN]> = Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/hoccl.fatbin")));

/// The embedded fatbin (empty when built with `HOCCL_NO_CUDA=1`).
pub fn fatbin() -> &'static [u8] {
    &FATBIN.0
}

static LAUNCHES: AtomicU64 = AtomicU64::new(0);
static MODULE_LOADED: AtomicBool = AtomicBool::new(false);

/// Kernels launched by this process through hoccl so far (every launch site counts).
pub fn launch_count() -> u64 {
    LAUNCHES.load(Ordering::Relaxed)
}

/// Whether the fatbin module has been loaded in this process.
pub fn module_loaded() -> bool {
    MODULE_LOADED.load(Ordering::Relaxed)
}

pub(crate) fn note_launch() {
    LAUNCHES.fetch_add(1, Ordering::Relaxed);
}

pub(crate) fn note_module_loaded() {
    MODULE_LOADED.store(true, Ordering::Relaxed);
}
