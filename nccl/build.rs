//! Link libnccl.so.2: its soname, and the export map that keeps everything but NCCL's entry
//! points local.
fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    let map = std::path::Path::new(&dir).join("libnccl.map");
    println!("cargo:rerun-if-changed=libnccl.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={}", map.display());
    // rustc's own export list holds every `#[no_mangle]` item of every crate linked in
    // (hoccl's C ABI, the cxx bridge); the dependencies arrive as archives, so hiding what
    // archives define keeps only this crate's nccl* / pncclX entry points global.
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
    // MPI is linked only if something this library keeps calls it.
    println!("cargo:rustc-cdylib-link-arg=-Wl,--as-needed");
}
