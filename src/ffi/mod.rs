//! FFI: the cxx bridge for C++ (`include/hoccl/hoccl.hpp`) and the C ABI.
mod bridge;
