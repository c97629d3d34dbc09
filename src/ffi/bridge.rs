//! The cxx bridge. C++ side in `cpp/`, public wrapper in `include/hoccl/hoccl.hpp`.
#[cxx::bridge(namespace = "hoccl::bridge")]
mod ffi {
    extern "Rust" {
        fn version() -> String;
    }
}

fn version() -> String {
    env!("CARGO_PKG_VERSION").to_string()
}
