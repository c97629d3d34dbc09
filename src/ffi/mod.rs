//! FFI: the cxx bridge for C++ (`include/hoccl/hoccl.hpp`, `cpp/hoccl.cc`) and the C ABI
//! (`include/hoccl/hoccl.h`). Both sit on [`handle::CommHandle`], which gives a
//! communicator handle its life cycle (live → aborted / destroyed), so a call after abort or
//! destroy is an error value, never undefined behaviour. Both describe every operation with
//! one descriptor, the bridge's `OpArgs`, which becomes a `comm::OpDesc` for
//! `Communicator::enqueue`. Nothing unwinds across FFI: every entry point runs its body under
//! [`guarded`].
//!
//! - `bridge.rs`: the cxx bridge: communicator, operations (`OpArgs`), device helpers.
//! - `codec.rs`: the codec's half of the bridge (`hoccl::codec`).
//! - `c_api.rs`: the C ABI: handles, groups, operations.
//! - `c_memory.rs`: the C ABI's device memory and stream helpers.
//! - `handle.rs`: a communicator handle's life cycle.
mod bridge;
mod codec;
pub mod c_api;
mod c_memory;
mod handle;

pub use handle::CommHandle;

use crate::error::{Error, Result};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Run `f`, turning a panic into `Error::Internal` naming `op`: a panic must never unwind
/// into C or C++ (inside a static library it would abort the host program).
pub fn guarded<T>(op: &'static str, f: impl FnOnce() -> Result<T>) -> Result<T> {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(r) => r,
        Err(payload) => {
            let what = payload
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| payload.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "unknown panic payload".into());
            Err(Error::internal(op, format!("panic caught at the FFI boundary: {what}")))
        }
    }
}

/// A rank number from C (an `int`): negative values are invalid arguments.
pub fn rank_arg(op: &'static str, what: &str, v: i32) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid_arg(op, format!("{what} {v} is negative")))
}

/// A rank count or rank for C: ranks always fit an `int` (MPI's own limit).
pub(crate) fn to_c_int(op: &'static str, v: usize) -> Result<i32> {
    i32::try_from(v).map_err(|_| Error::internal(op, format!("{v} does not fit an int")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorCode;

    #[test]
    fn panics_become_internal_errors() {
        let e = guarded::<()>("op", || panic!("boom {}", 1)).unwrap_err();
        assert_eq!(e.code(), ErrorCode::Internal);
        assert!(e.to_string().contains("boom 1"), "{e}");
        let e = guarded::<()>("op", || panic!("static")).unwrap_err();
        assert!(e.to_string().contains("static"), "{e}");
        assert_eq!(guarded("op", || Ok(3)).unwrap(), 3);
    }

    #[test]
    fn negative_ranks_are_invalid() {
        assert_eq!(rank_arg("op", "peer", -1).unwrap_err().code(), ErrorCode::InvalidArgument);
        assert_eq!(rank_arg("op", "peer", 3).unwrap(), 3);
    }
}
